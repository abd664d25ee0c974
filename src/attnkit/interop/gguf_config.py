"""GGUF metadata -> ModelConfig: the ``llama.*``, ``gemma3.*`` and ``gpt2.*`` keys, each checked
(through :class:`attnkit.interop.hf_config.HFConfig`, so an unknown key that might change the
model is refused by name).

    gpt2.* metadata                        ModelConfig (GPT-2: Pre-LN, learned positions, GELU)
    embedding_length, block_count       -> d_model, n_layers
    feed_forward_length, context_length -> d_ff, max_len
    attention.head_count                -> n_heads
    attention.layer_norm_epsilon        -> norm_eps (LayerNorm)

llama.cpp's ``gpt2`` graph computes GELU with the tanh approximation, so the config says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnkit.config import ModelConfig
from attnkit.interop.hf_config import HFConfig

__all__ = ["gemma3_config_from_gguf", "gpt2_config_from_gguf", "llama_config_from_gguf"]


def _refuse_rope_scaling(hf: HFConfig, arch: str) -> None:
    scaling = hf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise hf.error(
            f"{arch}.rope.scaling.type={scaling!r}: RoPE scaling is not implemented in attnkit"
        )
    hf.ignore(f"{arch}.rope.scaling.factor")


def _config(hf: HFConfig, metadata: dict[str, Any], source: str, vocab: int, *,
            pad_is_eos: bool = True, **fields) -> ModelConfig:  # fmt: skip
    """The ModelConfig of a GGUF file: ``fields`` plus the special ids of its tokenizer
    (None where absent or out of range; a missing pad id is the EOS id where ``pad_is_eos``,
    else 0); a value ModelConfig refuses is reported as the file's."""

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < vocab else None

    bos, eos, pad = (token_id(k) for k in ("bos_token_id", "eos_token_id", "padding_token_id"))
    if pad is None:
        pad = eos if pad_is_eos and eos is not None else 0
    try:
        return ModelConfig(
            vocab_size=vocab,
            dropout=0.0,
            pad_id=pad,
            bos_id=bos,
            eos_id=eos,
            norm="pre",
            extra={"source": "gguf", "file": Path(source).name},
            **fields,
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def llama_config_from_gguf(
    metadata: dict[str, Any], source: str, *, vocab_size: int | None = None, tied: bool
) -> ModelConfig:
    """A ModelConfig from a GGUF file's ``llama.*`` metadata (every key checked)."""
    fields = {k: v for k, v in metadata.items() if k.startswith("llama.")}
    hf = HFConfig(fields, f"{source} (GGUF metadata)")
    d_model = hf.get_int("llama.embedding_length")
    n_heads = hf.get_int("llama.attention.head_count")
    n_kv_heads = hf.get_int("llama.attention.head_count_kv", n_heads)
    if d_model % n_heads:
        raise hf.error(
            f"llama.attention.head_count={n_heads} does not divide llama.embedding_length="
            f"{d_model}; attnkit's attention needs d_head = d_model / n_heads"
        )
    d_head = d_model // n_heads
    for name in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = hf.get_int(f"llama.{name}", d_head)
        if value != d_head:
            raise hf.error(
                f"llama.{name}={value} differs from the head width {d_head}; attnkit rotates "
                "and attends over whole heads of d_model / n_heads"
            )
    _refuse_rope_scaling(hf, "llama")
    hf.ignore("llama.rope.scaling.original_context_length")
    hf.ignore("llama.rope.scaling.finetuned")
    experts = hf.get_int("llama.expert_count", 0, minimum=0)
    if experts:
        raise hf.error(
            f"llama.expert_count={experts}: mixture-of-experts GGUF files are not supported"
        )
    hf.ignore("llama.expert_used_count")
    if vocab_size is None:
        vocab = hf.get_int("llama.vocab_size")
    else:
        vocab = hf.get_int("llama.vocab_size", vocab_size)
    sizes = {
        "n_layers": hf.get_int("llama.block_count"),
        "d_ff": hf.get_int("llama.feed_forward_length"),
        "max_len": hf.get_int("llama.context_length", 2048),
        "norm_eps": hf.get_positive("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": hf.get_float("llama.rope.freq_base", 10000.0, minimum=1.0),
    }
    hf.check_unknown()

    return _config(
        hf,
        metadata,
        source,
        vocab,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        norm_type="rmsnorm",
        position="rope",
        activation="swiglu",
        bias=False,
        **sizes,
        tie_embeddings=tied,
    )


def gemma3_config_from_gguf(
    metadata: dict[str, Any], source: str, *, vocab_size: int | None = None
) -> ModelConfig:
    """A ModelConfig from a GGUF file's ``gemma3.*`` metadata (every key checked). The window
    layers' RoPE base (10,000) and their pattern (every 6th layer global) are not in the file:
    llama.cpp fixes them for Gemma 3, and so does attnkit."""
    fields = {k: v for k, v in metadata.items() if k.startswith("gemma3.")}
    hf = HFConfig(fields, f"{source} (GGUF metadata)")
    d_head = hf.get_int("gemma3.attention.key_length", 256)
    value_length = hf.get_int("gemma3.attention.value_length", d_head)
    if value_length != d_head:
        raise hf.error(
            f"gemma3.attention.value_length={value_length} differs from key_length={d_head}"
        )
    _refuse_rope_scaling(hf, "gemma3")
    hf.ignore("gemma3.rope.dimension_count")
    n_heads = hf.get_int("gemma3.attention.head_count")
    vocab = vocab_size if vocab_size is not None else hf.get_int("gemma3.vocab_size")
    sizes = dict(
        d_model=hf.get_int("gemma3.embedding_length"),
        n_heads=n_heads,
        n_kv_heads=hf.get_int("gemma3.attention.head_count_kv", n_heads),
        head_dim=d_head,
        n_layers=hf.get_int("gemma3.block_count"),
        d_ff=hf.get_int("gemma3.feed_forward_length"),
        max_len=hf.get_int("gemma3.context_length", 32768),
        norm_eps=hf.get_positive("gemma3.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=hf.get_float("gemma3.rope.freq_base", 1_000_000.0, minimum=1.0),
        window=hf.get_int("gemma3.attention.sliding_window", 512),
    )
    hf.check_unknown()

    return _config(
        hf,
        metadata,
        source,
        vocab,
        pad_is_eos=False,
        norm_type="rmsnorm",
        position="rope",
        rope_local_theta=10_000.0,
        activation="geglu",
        gelu_approximation="tanh",
        bias=False,
        tie_embeddings=True,
        scale_embeddings=True,
        qk_norm=True,
        sandwich_norms=True,
        attention="window",
        global_every=6,
        **sizes,
    )


def gpt2_config_from_gguf(
    metadata: dict[str, Any], source: str, *, vocab_size: int | None, tied: bool
) -> ModelConfig:
    """A ModelConfig from a GGUF file's ``gpt2.*`` metadata (every key checked)."""
    fields = {k: v for k, v in metadata.items() if k.startswith("gpt2.")}
    hf = HFConfig(fields, f"{source} (GGUF metadata)")
    sizes = {
        "d_model": hf.get_int("gpt2.embedding_length"),
        "n_heads": hf.get_int("gpt2.attention.head_count"),
        "n_layers": hf.get_int("gpt2.block_count"),
        "d_ff": hf.get_int("gpt2.feed_forward_length"),
        "max_len": hf.get_int("gpt2.context_length"),
        "norm_eps": hf.get_positive("gpt2.attention.layer_norm_epsilon", 1e-5),
    }
    vocab = vocab_size if vocab_size is not None else hf.get_int("gpt2.vocab_size")
    hf.ignore("gpt2.vocab_size")
    hf.check_unknown()
    return _config(
        hf,
        metadata,
        source,
        vocab,
        position="learned",
        activation="gelu",
        gelu_approximation="tanh",
        tie_embeddings=tied,
        **sizes,
    )
