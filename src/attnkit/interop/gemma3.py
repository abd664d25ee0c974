"""Gemma 3 (Hugging Face layout, ``model_type: gemma3_text``) -> attnkit's DecoderLM.

Gemma 3 is Llama's decoder with these differences, each a field of :class:`ModelConfig`:

    difference                                          ModelConfig
    heads wider than hidden_size / heads (256 in 270M)   head_dim
    each query and key head RMS-normalised before RoPE   qk_norm
    a norm on each sublayer's output too                  sandwich_norms
    GeGLU (GELU, tanh approximation) in place of SwiGLU  activation="geglu", gelu_approximation
    token embeddings times sqrt(hidden_size)             scale_embeddings
    sliding-window layers, every k-th layer global       attention="window", window, global_every
    RoPE base 10,000 on the window layers, 1e6 global    rope_local_theta, rope_theta

Its RMSNorm multiplies by ``1 + weight``; attnkit's by ``weight``, so 1 is added to every norm
weight on the way in (llama.cpp's GGUF files store them so already). The mapping beyond Llama's
(:mod:`attnkit.interop.llama`)::

    Hugging Face                                     attnkit
    layers.{i}.self_attn.q_norm / k_norm          -> decoder.layers.{i}.self_attn.q_norm / k_norm
    layers.{i}.post_attention_layernorm           -> decoder.layers.{i}.attn_out_norm
    layers.{i}.pre_feedforward_layernorm          -> decoder.layers.{i}.norm3
    layers.{i}.post_feedforward_layernorm         -> decoder.layers.{i}.ffn_out_norm

Refused: softcapping of logits or scores, ``query_pre_attn_scalar`` other than head_dim,
bidirectional attention, RoPE scaling, and layer types that do not repeat every k layers.
"""

from __future__ import annotations

from typing import Any

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig
from attnkit.interop.llama import llama_from_tensors
from attnkit.models import DecoderLM

__all__ = ["gemma3_config_from_hf", "gemma3_from_tensors", "load_gemma3"]

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3TextModel")


def global_every(layer_types: list[str], source: str) -> int:
    """k where layers k - 1, 2k - 1, ... are "full_attention" and the rest "sliding_attention"
    (Gemma 3's pattern, k = 6); ValueError for any other arrangement."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not full:
        raise ValueError(f"{source}: no full_attention layer; attnkit needs one every k layers")
    k = full[0] + 1
    expected = [
        "full_attention" if (i + 1) % k == 0 else "sliding_attention"
        for i in range(len(layer_types))
    ]
    if layer_types != expected:
        raise ValueError(
            f"{source}: layer_types {layer_types} do not repeat every {k} layers "
            "(k - 1 sliding, then one full), as attnkit's global_every needs"
        )
    return k


def _rope(hf: HFConfig) -> tuple[float, float]:
    """(global base, local base) from ``rope_parameters`` per layer type (transformers >= 5)
    or the older ``rope_theta`` / ``rope_local_base_freq``."""
    parameters = hf.get("rope_parameters")
    if parameters is None:
        hf.expect("rope_scaling", None, why="RoPE scaling is not implemented in attnkit")
        return (
            hf.get_float("rope_theta", 1_000_000.0, minimum=1.0),
            hf.get_float("rope_local_base_freq", 10_000.0, minimum=1.0),
        )
    bases = {}
    for kind, default in (("full_attention", 1_000_000.0), ("sliding_attention", 10_000.0)):
        part = parameters.get(kind, {}) if isinstance(parameters, dict) else None
        if not isinstance(part, dict) or part.get("rope_type", "default") != "default":
            raise hf.error(
                f"rope_parameters[{kind!r}]={part!r} is not supported: RoPE scaling is not "
                "implemented in attnkit"
            )
        bases[kind] = float(part.get("rope_theta", default))
    hf.ignore("rope_theta", "rope_local_base_freq", "rope_scaling")
    return bases["full_attention"], bases["sliding_attention"]


def gemma3_config_from_hf(hf: HFConfig) -> ModelConfig:
    """A ModelConfig from a Gemma 3 ``config.json`` (every field checked)."""
    hf.expect("hidden_activation", "gelu_pytorch_tanh", why="Gemma 3's GeGLU uses tanh GELU")
    hf.expect("attention_bias", False, why="Gemma 3 has no attention biases")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        hf.expect(name, None, why="softcapping is not implemented in attnkit")
    hf.expect("use_bidirectional_attention", False, None, why="attnkit's Gemma 3 is causal")
    hf.ignore("sliding_window_pattern", "_sliding_window_pattern", "hidden_act")
    vocab = hf.get_int("vocab_size")
    d_model, n_heads = hf.get_int("hidden_size"), hf.get_int("num_attention_heads")
    n_kv_heads = hf.get_int("num_key_value_heads", n_heads)
    head_dim = hf.get_int("head_dim", 256)
    scalar = hf.get_float("query_pre_attn_scalar", head_dim, minimum=1.0)
    if scalar != head_dim:
        raise hf.error(
            f"query_pre_attn_scalar={scalar:g} differs from head_dim={head_dim}; attnkit scales "
            "the scores by 1/sqrt(head_dim)"
        )
    n_layers = hf.get_int("num_hidden_layers")
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)
    ]
    try:
        every = global_every(list(layer_types), hf.source)
    except ValueError as error:
        raise hf.error(str(error)) from None
    theta, local_theta = _rope(hf)
    bos = hf.get_token_id("bos_token_id", vocab)
    eos = hf.get_token_id("eos_token_id", vocab)
    pad = hf.get_token_id("pad_token_id", vocab)
    extra: dict[str, Any] = {"source": "gemma3"}
    if isinstance(hf.data.get("eos_token_id"), list):
        extra["eos_token_ids"] = hf.data["eos_token_id"]
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_layers=n_layers,
            d_ff=hf.get_int("intermediate_size"),
            max_len=hf.get_int("max_position_embeddings", 32768),
            dropout=0.0,
            attention_dropout=hf.get_dropout("attention_dropout", 0.0),
            pad_id=pad if pad is not None else 0,
            bos_id=bos,
            eos_id=eos,
            norm="pre",
            norm_type="rmsnorm",
            norm_eps=hf.get_positive("rms_norm_eps", 1e-6),
            position="rope",
            rope_theta=theta,
            rope_local_theta=local_theta,
            activation="geglu",
            gelu_approximation="tanh",
            bias=False,
            tie_embeddings=hf.get_bool("tie_word_embeddings", True),
            scale_embeddings=True,
            qk_norm=True,
            sandwich_norms=True,
            attention="window",
            window=hf.get_int("sliding_window", 512),
            global_every=every,
            extra=extra,
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def gemma3_from_tensors(
    cfg: ModelConfig, tensors: Tensors, *, norm_shift: float = 1.0, assign: bool = False
) -> DecoderLM:
    """A DecoderLM from Gemma 3 tensors named as in Hugging Face (``model.`` prefix optional):
    the Llama mapping (interop.llama), with the QK-norms and sandwich norms the config names.
    ``norm_shift`` is added to every norm weight (1 for Hugging Face's ``1 + weight`` RMSNorm;
    0 where the weights already hold the factor, as in a GGUF file)."""
    return llama_from_tensors(cfg, tensors, norm_shift=norm_shift, assign=assign)


def load_gemma3(hf: HFConfig, tensors: Tensors) -> DecoderLM:
    """A DecoderLM from a Gemma 3 (text) ``config.json`` and its tensors."""
    architectures = hf.get("architectures") or ["Gemma3ForCausalLM"]
    if not isinstance(architectures, list) or architectures[0] not in ARCHITECTURES:
        raise hf.error(
            f"Gemma 3 architecture {architectures!r} is not supported; attnkit reads "
            f"{list(ARCHITECTURES)}"
        )
    cfg = gemma3_config_from_hf(hf)
    hf.check_unknown()
    return gemma3_from_tensors(cfg, tensors)
