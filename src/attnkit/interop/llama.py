"""Llama (Hugging Face layout) -> attnkit's DecoderLM.

Llama is a Pre-LN decoder with RMSNorm, rotary positions (RoPE, base ``rope_theta``), a SwiGLU
feed-forward network, grouped-query attention (``num_key_value_heads`` key/value heads) and no
biases. Its RoPE pairs dimension i with i + d/2 ("rotate_half"), as attnkit's does, so the
weights need no permutation. The mapping (``model.`` prefixes optional)::

    Hugging Face                             attnkit
    model.embed_tokens                    -> embeddings.tokens
    model.layers.{i}.input_layernorm      -> decoder.layers.{i}.norm1
    model.layers.{i}.self_attn.q_proj  \\
    model.layers.{i}.self_attn.k_proj   }  -> decoder.layers.{i}.self_attn.in_proj
    model.layers.{i}.self_attn.v_proj  /      (rows: [H query heads; H_kv key; H_kv value])
    model.layers.{i}.self_attn.o_proj     -> decoder.layers.{i}.self_attn.out_proj
    model.layers.{i}.post_attention_layernorm -> decoder.layers.{i}.norm3
    model.layers.{i}.mlp.gate_proj        -> decoder.layers.{i}.ffn.gate
    model.layers.{i}.mlp.up_proj          -> decoder.layers.{i}.ffn.up
    model.layers.{i}.mlp.down_proj        -> decoder.layers.{i}.ffn.down
    model.norm                            -> decoder.norm
    lm_head                               -> lm_head (absent when tie_word_embeddings)

Refused, because attnkit cannot represent them: biases (``attention_bias`` / ``mlp_bias``), a
``head_dim`` other than hidden_size / num_attention_heads, RoPE scaling (linear, dynamic,
llama3, yarn ...), an activation other than SiLU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig
from attnkit.models import DecoderLM
from attnkit.serialization import build_empty

__all__ = ["llama_config_from_hf", "llama_from_tensors", "load_llama"]

ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")


def _rope_theta(hf: HFConfig) -> float:
    """rope_theta from ``rope_parameters`` (transformers >= 5) or the older top-level fields;
    any RoPE scaling is refused."""
    parameters = hf.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise hf.error(f"rope_parameters must be an object, got {parameters!r}")
        rope = HFConfig(parameters, f"{hf.source}: rope_parameters")
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type != "default":
            raise rope.error(
                f"rope_type={rope_type!r} is not supported: RoPE scaling is not implemented "
                "in attnkit"
            )
        theta = rope.get_float("rope_theta", 10000.0, minimum=1.0)
        unknown = sorted(set(parameters) - {"rope_type", "type", "rope_theta"})
        if unknown:
            raise rope.error(f"{unknown} are not supported (RoPE scaling is not implemented)")
        hf.ignore("rope_theta")
        if hf.get("rope_scaling") not in (None, parameters):
            raise hf.error("rope_scaling is set; RoPE scaling is not implemented in attnkit")
        return theta
    scaling = hf.get("rope_scaling")
    if scaling is not None and not (
        isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default"
    ):
        raise hf.error(
            f"rope_scaling={scaling!r} is not supported: RoPE scaling is not implemented in attnkit"
        )
    return hf.get_float("rope_theta", 10000.0, minimum=1.0)


def llama_config_from_hf(hf: HFConfig) -> ModelConfig:
    """A ModelConfig from a Llama ``config.json`` (every field checked)."""
    hf.expect("hidden_act", "silu", why="Llama's SwiGLU gate is SiLU")
    hf.expect("attention_bias", False, why="attnkit's Llama has no attention biases")
    hf.expect("mlp_bias", False, why="attnkit's Llama has no MLP biases")
    hf.ignore("pretraining_tp")  # sliced matmuls in old transformers: the same numbers
    vocab = hf.get_int("vocab_size")
    d_model, n_heads = hf.get_int("hidden_size"), hf.get_int("num_attention_heads")
    n_kv_heads = hf.get_int("num_key_value_heads", n_heads)
    if d_model % n_heads:
        raise hf.error(
            f"num_attention_heads={n_heads} does not divide hidden_size={d_model}; attnkit's "
            "attention needs head_dim = hidden_size / num_attention_heads"
        )
    head_dim = hf.get_int("head_dim", d_model // n_heads)
    if head_dim != d_model // n_heads:
        raise hf.error(
            f"head_dim={head_dim} differs from hidden_size / num_attention_heads = "
            f"{d_model // n_heads}; attnkit's attention needs them equal"
        )
    if n_heads % n_kv_heads:
        raise hf.error(
            f"num_key_value_heads={n_kv_heads} must divide num_attention_heads={n_heads}"
        )
    theta = _rope_theta(hf)
    bos = hf.get_token_id("bos_token_id", vocab)
    eos = hf.get_token_id("eos_token_id", vocab)
    pad = hf.get_token_id("pad_token_id", vocab)
    extra: dict[str, Any] = {"source": "llama"}
    if isinstance(hf.data.get("eos_token_id"), list):
        extra["eos_token_ids"] = hf.data["eos_token_id"]  # generate stops at the first only
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            n_layers=hf.get_int("num_hidden_layers"),
            d_ff=hf.get_int("intermediate_size"),
            max_len=hf.get_int("max_position_embeddings", 2048),
            dropout=0.0,
            attention_dropout=hf.get_dropout("attention_dropout", 0.0),
            pad_id=pad if pad is not None else eos if eos is not None else 0,
            bos_id=bos,
            eos_id=eos,
            norm="pre",
            norm_type="rmsnorm",
            norm_eps=hf.get_positive("rms_norm_eps", 1e-6),
            position="rope",
            rope_theta=theta,
            activation="swiglu",
            bias=False,
            tie_embeddings=hf.get_bool("tie_word_embeddings", False),
            extra=extra,
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def llama_from_tensors(
    cfg: ModelConfig, tensors: Tensors, *, norm_shift: float = 0.0, assign: bool = False
) -> DecoderLM:
    """A DecoderLM from Llama-family tensors named as in Hugging Face (``model.`` prefix
    optional): Llama itself, and Gemma 3 where the config names its differences
    (``cfg.qk_norm``: q_norm and k_norm; ``cfg.sandwich_norms``: post_attention_layernorm after
    attention, pre_ and post_feedforward_layernorm around the FFN).

    ``norm_shift`` is added to every norm weight (1 for Gemma's ``1 + weight`` RMSNorm in
    Hugging Face's files). Every tensor must be used: a leftover is a ValueError (the weights do
    not fit the config). ``assign=True`` makes the tensors the parameters instead of copying them
    in (the tie of a tied output layer is then not kept: for a model about to be packed, see
    interop.gguf).
    """
    tensors = tensors.rename(lambda name: name.removeprefix("model."))
    tensors.discard(lambda name: not name.endswith("rotary_emb.inv_freq"))  # old buffers
    d, ff, hd = cfg.d_model, cfg.d_ff, cfg.d_head
    q_rows, kv_rows = cfg.n_heads * hd, cfg.kv_heads * hd

    def norm(name: str, size: int) -> Tensor:
        weight = tensors.take(name, (size,))
        return weight + norm_shift if norm_shift else weight

    ours: dict[str, Tensor] = {
        "embeddings.tokens.weight": tensors.take("embed_tokens.weight", (cfg.vocab_size, d)),
        "decoder.norm.weight": norm("norm.weight", d),
    }
    norms = {"norm1": "input_layernorm"}  # attnkit's name: theirs
    if cfg.sandwich_norms:
        norms.update(
            attn_out_norm="post_attention_layernorm",
            norm3="pre_feedforward_layernorm",
            ffn_out_norm="post_feedforward_layernorm",
        )
    else:
        norms["norm3"] = "post_attention_layernorm"
    for i in range(cfg.n_layers):
        theirs, mine = f"layers.{i}", f"decoder.layers.{i}"
        ours[f"{mine}.self_attn.in_proj.weight"] = torch.cat(
            [
                tensors.take(f"{theirs}.self_attn.q_proj.weight", (q_rows, d)),
                tensors.take(f"{theirs}.self_attn.k_proj.weight", (kv_rows, d)),
                tensors.take(f"{theirs}.self_attn.v_proj.weight", (kv_rows, d)),
            ]
        )  # ((H + 2 H_kv) d_head, D)
        ours[f"{mine}.self_attn.out_proj.weight"] = tensors.take(
            f"{theirs}.self_attn.o_proj.weight", (d, q_rows)
        )
        if cfg.qk_norm:
            for part in ("q", "k"):
                name = f"self_attn.{part}_norm.weight"
                ours[f"{mine}.{name}"] = norm(f"{theirs}.{name}", hd)
        for attnkit_name, hf_name in norms.items():
            ours[f"{mine}.{attnkit_name}.weight"] = norm(f"{theirs}.{hf_name}.weight", d)
        for part in ("gate", "up"):
            ours[f"{mine}.ffn.{part}.weight"] = tensors.take(
                f"{theirs}.mlp.{part}_proj.weight", (ff, d)
            )
        ours[f"{mine}.ffn.down.weight"] = tensors.take(f"{theirs}.mlp.down_proj.weight", (d, ff))
    if cfg.tie_embeddings:
        tensors.discard(lambda name: name != "lm_head.weight")  # Hugging Face ties it too
        ours["lm_head.weight"] = ours["embeddings.tokens.weight"]
    else:
        ours["lm_head.weight"] = tensors.take("lm_head.weight", (cfg.vocab_size, d))
    tensors.check_all_used()
    model = build_empty(lambda: DecoderLM(cfg))  # every weight is loaded next
    model.load_state_dict(ours, strict=True, assign=assign)
    return model.eval()


def load_llama(hf: HFConfig, tensors: Tensors) -> DecoderLM:
    """A DecoderLM from a Llama ``config.json`` and its tensors."""
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(architectures, list) or architectures[0] not in ARCHITECTURES:
        raise hf.error(
            f"Llama architecture {architectures!r} is not supported; attnkit reads "
            f"{list(ARCHITECTURES)}"
        )
    cfg = llama_config_from_hf(hf)
    hf.check_unknown()
    return llama_from_tensors(cfg, tensors)
