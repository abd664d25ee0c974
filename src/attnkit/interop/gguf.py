"""GGUF files (llama.cpp's format) of Llama models -> attnkit's DecoderLM, in float32.

A GGUF file holds metadata (``general.*``, ``llama.*``, ``tokenizer.ggml.*`` keys) and tensors,
each stored as F32, F16 or one of llama.cpp's block quantizations. attnkit reads the file with
``gguf.GGUFReader``, dequantizes every tensor to float32 with ``gguf.quants.dequantize``, renames
the tensors to Hugging Face's Llama names and hands them to :mod:`attnkit.interop.llama`::

    GGUF                   Hugging Face Llama
    token_embd          -> model.embed_tokens
    blk.{i}.attn_norm   -> model.layers.{i}.input_layernorm
    blk.{i}.attn_q      -> model.layers.{i}.self_attn.q_proj (*)
    blk.{i}.attn_k      -> model.layers.{i}.self_attn.k_proj (*)
    blk.{i}.attn_v      -> model.layers.{i}.self_attn.v_proj
    blk.{i}.attn_output -> model.layers.{i}.self_attn.o_proj
    blk.{i}.ffn_norm    -> model.layers.{i}.post_attention_layernorm
    blk.{i}.ffn_gate    -> model.layers.{i}.mlp.gate_proj
    blk.{i}.ffn_up      -> model.layers.{i}.mlp.up_proj
    blk.{i}.ffn_down    -> model.layers.{i}.mlp.down_proj
    output_norm         -> model.norm
    output              -> lm_head (absent: tied to token_embd)

    llama.* metadata                       ModelConfig
    embedding_length, block_count       -> d_model, n_layers
    feed_forward_length, context_length -> d_ff, max_len
    attention.head_count, _count_kv     -> n_heads, n_kv_heads
    attention.layer_norm_rms_epsilon    -> norm_eps (RMSNorm)
    rope.freq_base                      -> rope_theta
    vocab_size (else token_embd's rows) -> vocab_size

(*) llama.cpp's converter reorders the rows of q and k: Hugging Face's RoPE pairs dimension i
with i + d/2 in each head, llama.cpp's pairs 2i with 2i + 1, so the converter interleaves the
two halves of every head (``permute`` in ``convert_hf_to_gguf.py``). :func:`unpermute` undoes
it, with n_heads for q and n_kv_heads for k.

Quantizations read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K .. Q6_K.
Anything else, and any architecture but ``llama``, is a ValueError naming the file and what it
found. The tokenizer the file embeds is read by :mod:`attnkit.interop.tokenizer`.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig
from attnkit.interop.llama import llama_from_tensors
from attnkit.models import DecoderLM

__all__ = [
    "SUPPORTED_QUANTIZATIONS",
    "gguf_metadata",
    "llama_config_from_gguf",
    "load_gguf",
    "read_gguf",
    "unpermute",
]

MAGIC = b"GGUF"
ARCHITECTURES = ("llama",)
SUPPORTED_QUANTIZATIONS = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf(path: str | os.PathLike[str]):
    """A ``gguf.GGUFReader`` over the file; a malformed or truncated file is a ValueError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # the reader parses untrusted bytes and may fail in any way
        raise ValueError(
            f"{path}: a malformed or truncated GGUF file ({type(error).__name__}: {error})"
        ) from None


def gguf_metadata(reader) -> dict[str, Any]:
    """Every metadata key of a GGUF reader as plain Python values (``GGUF.*`` header fields
    left out)."""
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def unpermute(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's row order of a q or k weight (out, in).

    The converter's ``permute`` reshapes the rows to (heads, 2, d_head / 2) and swaps the last two
    axes, interleaving each head's two RoPE halves; the file holds (heads, d_head / 2, 2).
    """
    rows, cols = weight.shape
    if rows % (2 * n_heads):
        raise ValueError(f"unpermute: {rows} rows do not split into {n_heads} heads of pairs")
    pairs = weight.reshape(n_heads, rows // n_heads // 2, 2, cols)  # (heads, d_head / 2, 2, in)
    return pairs.transpose(1, 2).reshape(rows, cols)  # (heads, 2, d_head / 2, in) -> (out, in)


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
    scaling = hf.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise hf.error(
            f"llama.rope.scaling.type={scaling!r}: RoPE scaling is not implemented in attnkit"
        )
    hf.ignore("llama.rope.scaling.factor", "llama.rope.scaling.original_context_length")
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

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < vocab else None

    bos, eos, pad = token_id("bos_token_id"), token_id("eos_token_id"), token_id("padding_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            dropout=0.0,
            pad_id=pad if pad is not None else eos if eos is not None else 0,
            bos_id=bos,
            eos_id=eos,
            norm="pre",
            norm_type="rmsnorm",
            position="rope",
            activation="swiglu",
            bias=False,
            **sizes,
            tie_embeddings=tied,
            extra={"source": "gguf", "file": Path(source).name},
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def _hf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face Llama name (unknown names are kept, and refused later)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return name


def _dequantize(tensor, source: str) -> Tensor:
    """One GGUF tensor as a float32 torch tensor in torch's (out, in) order."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_QUANTIZATIONS:
        raise ValueError(
            f"{source}: the tensor {tensor.name!r} is stored as {kind}, which attnkit does not "
            f"read; supported: {', '.join(SUPPORTED_QUANTIZATIONS)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32).reshape(shape)  # a copy, off the memory map
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"{source}: cannot dequantize {tensor.name!r} ({kind}): {error}") from None
    return torch.from_numpy(array)


def load_gguf(path: str | os.PathLike[str]) -> DecoderLM:
    """A DecoderLM from a GGUF file of a Llama model, every tensor dequantized to float32."""
    path = Path(path)
    reader = read_gguf(path)
    metadata = gguf_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; attnkit reads "
            f"{list(ARCHITECTURES)}"
        )
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{path}: the tensor 'rope_freqs.weight' holds RoPE frequency factors (Llama 3.1 "
            "scaling); RoPE scaling is not implemented in attnkit"
        )
    embedding = names.get("token_embd.weight")  # GGUF shape (d_model, vocab)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if embedding is not None and len(embedding.shape) == 2:
        vocab: int | None = int(embedding.shape[1])
    else:
        vocab = len(tokens) if isinstance(tokens, list) and tokens else None
    cfg = llama_config_from_gguf(
        metadata, str(path), vocab_size=vocab, tied="output.weight" not in names
    )
    tensors: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        weight = _dequantize(tensor, str(path))
        name = _hf_name(tensor.name)
        heads = {"q_proj": cfg.n_heads, "k_proj": cfg.kv_heads}.get(name.split(".")[-2])
        if heads is not None and weight.dim() == 2 and weight.shape[0] % (2 * heads) == 0:
            weight = unpermute(weight, heads)  # (a wrong shape is reported by the mapping)
        tensors[name] = weight
    cfg.extra["tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    return llama_from_tensors(cfg, Tensors(tensors, str(path)))
