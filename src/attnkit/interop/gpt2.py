"""GPT-2 (Hugging Face layout) <-> attnkit's DecoderLM.

GPT-2 is a Pre-LN decoder with learned positions, GELU (the tanh approximation, "gelu_new"),
biases everywhere and the LM head tied to the token embedding. Its linear layers are
``Conv1D`` modules whose weight is stored transposed, (in, out) instead of torch's (out, in),
and its attention keeps Q, K and V in one ``c_attn`` matrix, in the same order as attnkit's
``in_proj``. The mapping, per layer::

    h.{i}.ln_1          -> decoder.layers.{i}.norm1
    h.{i}.attn.c_attn   -> decoder.layers.{i}.self_attn.in_proj   (transposed)
    h.{i}.attn.c_proj   -> decoder.layers.{i}.self_attn.out_proj  (transposed)
    h.{i}.ln_2          -> decoder.layers.{i}.norm3
    h.{i}.mlp.c_fc      -> decoder.layers.{i}.ffn.up              (transposed)
    h.{i}.mlp.c_proj    -> decoder.layers.{i}.ffn.down            (transposed)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig
from attnkit.models import DecoderLM
from attnkit.serialization import build_empty

__all__ = [
    "gpt2_config_from_hf",
    "gpt2_from_gguf_tensors",
    "gpt2_from_hf_state_dict",
    "gpt2_to_hf",
    "load_gpt2",
]

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")

# activation_function -> attnkit's GELU approximation
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}

_LAYER_MAP = [  # (GPT-2 name, attnkit name, transposed)
    ("ln_1.weight", "norm1.weight", False),
    ("ln_1.bias", "norm1.bias", False),
    ("attn.c_attn.weight", "self_attn.in_proj.weight", True),
    ("attn.c_attn.bias", "self_attn.in_proj.bias", False),
    ("attn.c_proj.weight", "self_attn.out_proj.weight", True),
    ("attn.c_proj.bias", "self_attn.out_proj.bias", False),
    ("ln_2.weight", "norm3.weight", False),
    ("ln_2.bias", "norm3.bias", False),
    ("mlp.c_fc.weight", "ffn.up.weight", True),
    ("mlp.c_fc.bias", "ffn.up.bias", False),
    ("mlp.c_proj.weight", "ffn.down.weight", True),
    ("mlp.c_proj.bias", "ffn.down.bias", False),
]


def gpt2_config_from_hf(hf: dict[str, Any] | HFConfig) -> ModelConfig:
    """A ModelConfig from a GPT-2 ``config.json`` (a dict or an :class:`HFConfig`), every
    field checked."""
    if not isinstance(hf, HFConfig):
        hf = HFConfig(hf, "GPT-2 config")
    approximation = hf.get_choice("activation_function", _GELU, "gelu_new")
    hf.expect("scale_attn_weights", True, why="attention scores are divided by sqrt(d_k)")
    hf.expect("scale_attn_by_inverse_layer_idx", False, why="attnkit scales every layer alike")
    hf.ignore("reorder_and_upcast_attn")  # float32 either way on CPU: the same numbers
    # GPT2DoubleHeadsModel's multiple-choice head, which attnkit does not build
    hf.ignore(*(f"summary_{x}" for x in ("activation", "first_dropout", "proj_to_labels")))
    hf.ignore("summary_type", "summary_use_proj")
    hf.ignore("embd_pdrop")  # attnkit has one dropout rate; resid_pdrop is taken
    vocab = hf.get_int("vocab_size", 50257)
    d_model, n_heads = hf.get_int("n_embd", 768), hf.get_int("n_head", 12)
    if d_model % n_heads:
        raise hf.error(f"n_head={n_heads} does not divide n_embd={d_model}")
    max_len = hf.get_int("n_positions", 1024)
    if hf.get_int("n_ctx", max_len) != max_len:
        raise hf.error(f"n_ctx={hf.get('n_ctx')} differs from n_positions={max_len}")
    eos = hf.get_token_id("eos_token_id", vocab)
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=hf.get_int("n_layer", 12),
            d_ff=hf.get_int("n_inner", 4 * d_model),
            max_len=max_len,
            dropout=hf.get_dropout("resid_pdrop", 0.1),
            attention_dropout=hf.get_dropout("attn_pdrop", 0.1),
            norm="pre",
            norm_eps=hf.get_positive("layer_norm_epsilon", 1e-5),
            position="learned",
            activation="gelu",
            gelu_approximation=approximation,
            tie_embeddings=hf.get_bool("tie_word_embeddings", True),
            pad_id=eos if eos is not None else 0,
            bos_id=hf.get_token_id("bos_token_id", vocab),
            eos_id=eos,
            extra={"source": "gpt2"},
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def gpt2_from_hf_state_dict(cfg: ModelConfig, state: dict[str, Tensor] | Tensors) -> DecoderLM:
    """A DecoderLM holding a GPT-2 state dict (``transformer.`` prefixes optional).

    Every tensor is checked against the config's shapes; one that fits nowhere is a ValueError.
    """
    tensors = state if isinstance(state, Tensors) else Tensors(state, "the GPT-2 state dict")
    tensors = tensors.rename(lambda name: name.removeprefix("transformer."))
    # the causal-mask buffers that old checkpoints saved
    tensors.discard(lambda name: not name.endswith((".attn.bias", ".attn.masked_bias")))
    d, ff = cfg.d_model, cfg.d_ff
    shapes = {  # GPT-2's shapes: Conv1D weights are (in, out)
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.c_attn.weight": (d, 3 * d),
        "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d),
        "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (d, ff),
        "mlp.c_fc.bias": (ff,),
        "mlp.c_proj.weight": (ff, d),
        "mlp.c_proj.bias": (d,),
    }
    ours: dict[str, Tensor] = {
        "embeddings.tokens.weight": tensors.take("wte.weight", (cfg.vocab_size, d)),
        "embeddings.positions.embedding.weight": tensors.take("wpe.weight", (cfg.max_len, d)),
        "decoder.norm.weight": tensors.take("ln_f.weight", (d,)),
        "decoder.norm.bias": tensors.take("ln_f.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        for theirs, mine, transposed in _LAYER_MAP:
            tensor = tensors.take(f"h.{i}.{theirs}", shapes[theirs])
            ours[f"decoder.layers.{i}.{mine}"] = tensor.t() if transposed else tensor
    if cfg.tie_embeddings:
        tensors.discard(lambda name: name != "lm_head.weight")  # the same matrix as wte
        ours["lm_head.weight"] = ours["embeddings.tokens.weight"]
    else:
        ours["lm_head.weight"] = tensors.take("lm_head.weight", (cfg.vocab_size, d))
    tensors.check_all_used()
    model = DecoderLM(cfg)
    model.load_state_dict({k: v.contiguous() for k, v in ours.items()}, strict=True)
    return model.eval()


def load_gpt2(hf: HFConfig, tensors: Tensors) -> DecoderLM:
    """A DecoderLM from a GPT-2 ``config.json`` and its tensors."""
    architectures = hf.get("architectures") or ["GPT2LMHeadModel"]
    if not isinstance(architectures, list) or architectures[0] not in ARCHITECTURES:
        raise hf.error(
            f"GPT-2 architecture {architectures!r} is not supported; attnkit reads "
            f"{list(ARCHITECTURES)}"
        )
    cfg = gpt2_config_from_hf(hf)
    hf.check_unknown()
    return gpt2_from_hf_state_dict(cfg, tensors)


def gpt2_to_hf(model: DecoderLM) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """GPT-2 ``config.json`` values and a ``GPT2LMHeadModel`` state dict for a DecoderLM that
    has GPT-2's shape (Pre-LN, learned positions, GELU, biases, LayerNorm)."""
    cfg = model.cfg
    if not (
        cfg.norm == "pre"
        and cfg.position == "learned"
        and cfg.activation == "gelu"
        and cfg.bias
        and cfg.norm_type == "layernorm"
        and cfg.kv_heads == cfg.n_heads
    ):
        raise ValueError(
            "gpt2_to_hf needs a GPT-2-shaped DecoderLM: norm='pre', position='learned', "
            "activation='gelu', bias=True, norm_type='layernorm', no grouped-query attention"
        )
    hf_config = {
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new" if cfg.gelu_approximation == "tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
    }
    sd = model.state_dict()
    state = {
        "transformer.wte.weight": sd["embeddings.tokens.weight"],
        "transformer.wpe.weight": sd["embeddings.positions.embedding.weight"],
        "transformer.ln_f.weight": sd["decoder.norm.weight"],
        "transformer.ln_f.bias": sd["decoder.norm.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        for theirs, mine, transposed in _LAYER_MAP:
            tensor = sd[f"decoder.layers.{i}.{mine}"]
            state[f"transformer.h.{i}.{theirs}"] = tensor.t() if transposed else tensor
    return hf_config, {k: v.detach().clone().contiguous() for k, v in state.items()}


# GGUF tensor name (llama.cpp's gpt2 architecture) -> attnkit name; GGUF keeps torch's (out, in)
GGUF_NAMES = {
    "token_embd": "embeddings.tokens",
    "position_embd": "embeddings.positions.embedding",
    "output_norm": "decoder.norm",
    "output": "lm_head",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "norm1",
    "attn_qkv": "self_attn.in_proj",
    "attn_output": "self_attn.out_proj",
    "ffn_norm": "norm3",
    "ffn_up": "ffn.up",
    "ffn_down": "ffn.down",
}


def gpt2_from_gguf_tensors(
    cfg: ModelConfig, tensors: Tensors, *, assign: bool = False
) -> DecoderLM:
    """A DecoderLM from the tensors of a GGUF file of the ``gpt2`` architecture; every tensor
    must be used and have the config's shape."""
    model = build_empty(lambda: DecoderLM(cfg))
    expected = dict(model.state_dict())
    if cfg.tie_embeddings:
        del expected["lm_head.weight"]
    top = {mine: theirs for theirs, mine in GGUF_NAMES.items()}
    layer = {mine: theirs for theirs, mine in GGUF_LAYER_NAMES.items()}
    ours = {}
    for name, target in expected.items():
        stem, _, part = name.rpartition(".")
        if stem.startswith("decoder.layers."):
            i, _, rest = stem.removeprefix("decoder.layers.").partition(".")
            theirs = f"blk.{i}.{layer[rest]}"
        else:
            theirs = top[stem]
        ours[name] = tensors.take(f"{theirs}.{part}", tuple(target.shape))
    if cfg.tie_embeddings:
        ours["lm_head.weight"] = ours["embeddings.tokens.weight"]
    tensors.check_all_used()
    model.load_state_dict(ours, strict=True, assign=assign)
    return model.eval()
