"""GGUF files (llama.cpp's format) of Llama models -> attnkit's DecoderLM, in float32.

A GGUF file holds metadata (``general.*``, ``llama.*``, ``tokenizer.ggml.*`` keys) and tensors,
each stored as F32, F16 or one of llama.cpp's block quantizations. attnkit parses the file over a
memory map (:func:`read_gguf`, checked against ``gguf.GGUFReader``), dequantizes every tensor to
float32 with ``gguf.quants.dequantize``, renames
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

Gemma 3 files (``gemma3``) go to :mod:`attnkit.interop.gemma3` instead, with their four norms a
layer and QK-norm (:func:`gemma3_config_from_gguf`); their q and k rows are not reordered.

Quantizations read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K .. Q6_K.
Anything else, and any architecture but ``llama`` and ``gemma3``, is a ValueError naming the
file and what it found. The tokenizer the file embeds is read by :mod:`attnkit.interop.tokenizer`.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnkit.accel.memory import release_file_pages
from attnkit.accel.packed import (
    PackedEmbedding,
    PackedLinear,
    repack_q4_k,
    repack_q5_0,
    repack_q5_k,
    repack_q6_k,
)
from attnkit.accel.packed import dequantize as dequantize_packed
from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.gemma3 import gemma3_from_tensors
from attnkit.interop.gguf_config import (
    gemma3_config_from_gguf,
    gpt2_config_from_gguf,
    llama_config_from_gguf,
)
from attnkit.interop.gguf_file import GGUFFile, GGUFTensor, gguf_metadata, read_gguf
from attnkit.interop.gpt2 import GGUF_LAYER_NAMES as GPT2_LAYER_NAMES
from attnkit.interop.gpt2 import gpt2_from_gguf_tensors
from attnkit.interop.llama import llama_from_tensors
from attnkit.models import DecoderLM

__all__ = [
    "SUPPORTED_QUANTIZATIONS",
    "GGUFFile",
    "GGUFTensor",
    "gguf_metadata",
    "llama_config_from_gguf",
    "load_gguf",
    "read_gguf",
    "unpermute",
]

ARCHITECTURES = ("llama", "gemma3", "gpt2")
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


def _hf_name(name: str, architecture: str = "llama") -> str:
    """GGUF tensor name -> Hugging Face name (unknown names are kept, and refused later)."""
    layer_names = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return name


# Gemma 3: its own names for the same parts, and four norms a layer (GGUF name -> Hugging Face)
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
AS_STORED = ("Q8_0", "Q4_0", "Q4_1")  # packed layers read the file's blocks as they are


def dequantize_blocks(data: np.ndarray, kind: str) -> Tensor | None:
    """Q8_0, Q4_0 and Q4_1 blocks (a numpy view of the file) -> float32 values (flat), in
    torch and bit for bit ``gguf.quants`` (:func:`attnkit.accel.packed.dequantize`); None for
    other types."""
    if kind not in AS_STORED:
        return None
    return dequantize_packed(torch.from_numpy(np.array(data, dtype=np.uint8)), kind)


# The file's block types that stay packed, and the kind PackedLinear keeps them as: Q4_K, Q5_K,
# Q6_K and Q5_0 are repacked on the way in (repack_q4_k, repack_q5_k, repack_q6_k, repack_q5_0),
# the others kept as they are.
PACKED_KINDS = {
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q4_K": "Q4_K",
    "Q5_K": "Q5_K",
    "Q6_K": "Q6_K",
    "Q5_0": "Q8_0",
}


def _packed_kind(tensor: GGUFTensor | None) -> str | None:
    return None if tensor is None else PACKED_KINDS.get(tensor.tensor_type.name)


def _file_blocks(tensor: GGUFTensor) -> Tensor:
    """A packable tensor's rows of blocks: a view of the file, or for Q4_K, Q5_K, Q6_K and Q5_0
    a repacked copy (the file's pages it was made from then leave the resident set)."""
    blocks = torch.from_numpy(tensor.data)  # (out, bytes per row)
    repack = {"Q4_K": repack_q4_k, "Q5_K": repack_q5_k, "Q6_K": repack_q6_k, "Q5_0": repack_q5_0}
    repack = repack.get(tensor.tensor_type.name)
    if repack is None:
        return blocks
    copy = repack(blocks)
    release_file_pages(blocks)
    return copy


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
    fast = dequantize_blocks(tensor.data, kind)
    if fast is not None:
        return fast.reshape(shape)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32).reshape(shape)  # a copy, off the memory map
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"{source}: cannot dequantize {tensor.name!r} ({kind}): {error}") from None
    return torch.from_numpy(array)


def load_gguf(path: str | os.PathLike[str], *, dequantize: bool = True) -> DecoderLM:
    """A DecoderLM from a GGUF file of a Llama model, every tensor dequantized to float32.

    ``dequantize=False`` keeps the linear layers and the token table stored as Q8_0, Q4_0 or
    Q4_1 in their blocks instead (:class:`attnkit.accel.packed.PackedLinear`,
    :class:`attnkit.accel.packed.PackedEmbedding`), mostly as views of the memory-mapped file
    (query and key rows are reordered, so those are copies); other types and the norms are
    float32. Those layers are never dequantized: the model is built around untouched
    placeholders (memory the process never writes) that the packed layers then replace.
    ``cfg.extra["weights"]`` says which path each layer took."""
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
    gemma, gpt2 = architecture == "gemma3", architecture == "gpt2"
    tied = "output.weight" not in names
    if gemma:
        cfg = gemma3_config_from_gguf(metadata, str(path), vocab_size=vocab)
    elif gpt2:
        cfg = gpt2_config_from_gguf(metadata, str(path), vocab_size=vocab, tied=tied)
    else:
        cfg = llama_config_from_gguf(metadata, str(path), vocab_size=vocab, tied=tied)
    keep = set() if dequantize else _packable(cfg, names)
    tensors: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name if gpt2 else _hf_name(tensor.name, architecture)
        if tensor.name in keep:  # replaced by its blocks below: never filled in
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            tensors[name] = torch.empty(shape)
            continue
        weight = _dequantize(tensor, str(path))
        # llama.cpp reorders Llama's q and k rows (not Gemma's: its RoPE pairs as HF's does)
        heads = {"q_proj": cfg.n_heads, "k_proj": cfg.kv_heads}.get(name.split(".")[-2])
        if architecture == "llama" and heads is not None and weight.dim() == 2:
            if weight.shape[0] % (2 * heads) == 0:  # (a wrong shape is reported by the mapping)
                weight = unpermute(weight, heads)
        tensors[name] = weight
    cfg.extra["tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    found = Tensors(tensors, str(path))
    if gpt2:
        model = gpt2_from_gguf_tensors(cfg, found, assign=not dequantize)
    elif gemma:  # the file's norm weights hold Gemma's 1 + w already
        model = gemma3_from_tensors(cfg, found, norm_shift=0.0, assign=not dequantize)
    else:
        model = llama_from_tensors(cfg, found, assign=not dequantize)
    if not dequantize:
        pack_linear_layers(model, names, permuted=architecture == "llama")
    return model


def _plan(cfg: ModelConfig, names: dict[str, GGUFTensor]) -> list[tuple[str, list[str]]]:
    """(module, the GGUF tensors whose rows make its weight) for every linear layer."""
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    plan = [("lm_head", [head])]
    for i in range(cfg.n_layers):
        stem, mine = f"blk.{i}.", f"decoder.layers.{i}."
        if "position_embd.weight" in names:  # gpt2: one qkv matrix, no gate
            parts = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
            plan += [(mine + GPT2_LAYER_NAMES[p], [f"{stem}{p}.weight"]) for p in parts]
            continue
        qkv = [stem + p + ".weight" for p in ("attn_q", "attn_k", "attn_v")]
        plan.append((mine + "self_attn.in_proj", qkv))
        plan.append((mine + "self_attn.out_proj", [stem + "attn_output.weight"]))
        for part in ("gate", "up", "down"):
            plan.append((mine + "ffn." + part, [stem + f"ffn_{part}.weight"]))
    return plan


def _packable(cfg: ModelConfig, names: dict[str, GGUFTensor]) -> set[str]:
    """The GGUF tensors that only packed layers need."""
    keep = set()
    for _module, parts in _plan(cfg, names):
        kinds = {_packed_kind(names.get(name)) for name in parts}
        if len(kinds) == 1 and None not in kinds:
            keep.update(parts)
    if _packed_kind(names.get("token_embd.weight")) is not None:
        keep.add("token_embd.weight")  # looked up row by row from its blocks
    return keep


def _packed_blocks(names: dict[str, GGUFTensor], parts, heads) -> tuple[torch.Tensor, str] | None:
    """The rows of blocks of the GGUF tensors ``parts`` stacked (q and k rows unpermuted), or
    None when they are not all of one packable type."""
    tensors = [names.get(name) for name in parts]
    kinds = {_packed_kind(t) for t in tensors}
    if len(kinds) != 1 or None in kinds:
        return None
    rows = [
        unpermute(_file_blocks(t), n) if n else _file_blocks(t)
        for t, n in zip(tensors, heads, strict=True)
    ]  # each (out, bytes per row); a view of the file unless unpermuted or repacked
    return (torch.cat(rows) if len(rows) > 1 else rows[0]), next(iter(kinds))


def pack_linear_layers(
    model: DecoderLM, names: dict[str, GGUFTensor], *, permuted: bool = True
) -> None:
    """Replace the model's linear layers with PackedLinear, and its token table with
    PackedEmbedding, over the file's own blocks where they are Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
    Q6_K or Q5_0 (tied embeddings: the output layer and the table share the table's blocks)."""
    cfg = model.cfg
    packed: Counter = Counter()
    kept: Counter = Counter()
    found = _packed_blocks(names, ["token_embd.weight"], [0])
    if found is not None:
        blocks, kind = found
        model.embeddings.tokens = PackedEmbedding(blocks, kind, cfg.d_model)
        packed[kind] += 1
    for module_name, parts in _plan(cfg, names):
        heads = [cfg.n_heads, cfg.kv_heads, 0] if len(parts) == 3 and permuted else [0] * len(parts)
        found = _packed_blocks(names, parts, heads)
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr, None)
        if old is None:
            continue
        if found is None:
            kept[attr] += 1
            continue
        blocks, kind = found
        bias = None if old.bias is None else old.bias.detach()  # GPT-2's; a buffer there
        setattr(parent, attr, PackedLinear(blocks, kind, old.in_features, bias=bias))
        packed[kind] += 1
    if "lm_head" not in kept:
        cfg.tie_embeddings = False  # the output layer has its own (packed) copy now
    cfg.extra["weights"] = {"packed": dict(packed), "float32": dict(kept)}
