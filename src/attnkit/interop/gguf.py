"""GGUF files (llama.cpp's format) -> attnkit's DecoderLM, dequantized or packed.

A GGUF file holds metadata (``general.*``, ``<arch>.*``, ``tokenizer.ggml.*`` keys) and tensors,
each stored as F32, F16, BF16 or one of llama.cpp's block quantizations. attnkit parses the file
over a memory map (:func:`read_gguf`, checked against ``gguf.GGUFReader``), finds the
architecture's description by ``general.architecture``
(:mod:`attnkit.interop.architectures`: llama, qwen2, qwen3, phi3, gemma3, gpt2), reads its
config from the metadata and places every tensor where the description says, after the
transform it names (llama.cpp's q / k row order for Llama, fused blocks split for Phi-3).

Tensor types are :data:`attnkit.accel.block_formats.QUANT_TYPES`. ``dequantize=False`` keeps
the linear layers and the token table whose types a kernel multiplies in their blocks
(:class:`~attnkit.accel.packed.PackedLinear`, :class:`~attnkit.accel.packed.PackedEmbedding`),
mostly as views of the memory-mapped file, by the description's packing plan; the rest is
dequantized to float32. Another architecture or type is a ValueError naming the file, what it
found and what attnkit reads. A ``rope_freqs`` tensor (Llama 3.1 and 3.2) becomes
``rope_scaling``'s frequency factors. The tokenizer the file embeds is read by
:mod:`attnkit.interop.tokenizer`.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from attnkit.accel.block_formats import QUANT_TYPES
from attnkit.accel.memory import release_file_pages
from attnkit.accel.packed import PackedEmbedding, PackedLinear
from attnkit.accel.packed import dequantize as dequantize_packed
from attnkit.accel.swap import swap_named
from attnkit.interop.architecture import config_from_gguf
from attnkit.interop.architectures import by_gguf, gguf_names
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.gguf_file import GGUFFile, GGUFTensor, read_gguf
from attnkit.interop.weights import build, plan, unpermute
from attnkit.models import DecoderLM

__all__ = ["GGUFFile", "GGUFTensor", "dequantize_tensor", "load_gguf", "read_gguf"]

# the attnkit weights a packed layer can hold: linear layers and the token table
_PACKABLE = (".in_proj.weight", ".out_proj.weight", ".gate.weight", ".up.weight", ".down.weight",
             "lm_head.weight", "embeddings.tokens.weight")  # fmt: skip


def _kernel(tensor: GGUFTensor | None) -> str | None:
    kind = None if tensor is None else QUANT_TYPES.get(tensor.tensor_type.name)
    return None if kind is None else kind.kernel


def _file_blocks(tensor: GGUFTensor) -> Tensor:
    """A packable tensor's rows of blocks as the kernel reads them: a view of the file, or a
    repacked copy (the file's pages it was made from then leave the resident set)."""
    blocks = torch.from_numpy(tensor.data)  # (out, bytes per row)
    repack = QUANT_TYPES[tensor.tensor_type.name].repack
    if repack is None:
        return blocks
    copy = repack(blocks)
    release_file_pages(blocks)
    return copy


def dequantize_tensor(tensor: GGUFTensor, source: str) -> Tensor:
    """One GGUF tensor as a float32 torch tensor in torch's (out, in) order: a kernel's blocks
    by :func:`attnkit.accel.packed.dequantize` (bit for bit ``gguf.quants``), other types by
    ``gguf.quants.dequantize``."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in QUANT_TYPES:
        raise ValueError(
            f"{source}: the tensor {tensor.name!r} is stored as {kind}, which attnkit does not "
            f"read; supported: {', '.join(QUANT_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
    kernel = _kernel(tensor)
    if kernel is not None:
        return dequantize_packed(_file_blocks(tensor), kernel).reshape(shape)
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.array(array, dtype=np.float32).reshape(shape)  # a copy, off the memory map
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"{source}: cannot dequantize {tensor.name!r} ({kind}): {error}") from None
    return torch.from_numpy(array)


def load_gguf(path: str | os.PathLike[str], *, dequantize: bool = True) -> DecoderLM:
    """A DecoderLM from a GGUF file, every tensor dequantized to float32.

    ``dequantize=False`` keeps the linear layers and the token table whose types a kernel
    reads (:data:`~attnkit.accel.block_formats.QUANT_TYPES`) in their blocks instead, mostly
    as views of the memory-mapped file (reordered or repacked rows are copies); other types
    and the norms are float32. Those layers are never dequantized: the model is built around
    untouched placeholders that the packed layers then replace. ``cfg.extra["weights"]`` says
    which path each layer took."""
    path = Path(path)
    reader = read_gguf(path)
    metadata = reader.metadata
    name = metadata.get("general.architecture")
    arch = by_gguf(name)
    if arch is None:
        raise ValueError(
            f"{path}: GGUF architecture {name!r} is not supported; attnkit reads {gguf_names()}"
        )
    names = {t.name: t for t in reader.tensors}
    factors = None
    if "rope_freqs.weight" in names:  # Llama 3.1 / 3.2: RoPE's frequency factors
        factors = dequantize_tensor(names.pop("rope_freqs.weight"), str(path)).tolist()
    embedding, tokens = names.get("token_embd.weight"), metadata.get("tokenizer.ggml.tokens")
    if embedding is not None and len(embedding.shape) == 2:
        vocab: int | None = int(embedding.shape[1])  # GGUF shape (d_model, vocab)
    else:
        vocab = len(tokens) if isinstance(tokens, list) and tokens else None
    tied = "output.weight" not in names
    cfg = config_from_gguf(arch, metadata, str(path), vocab=vocab, tied=tied, rope_factors=factors)
    layout = plan(arch, cfg)
    packed = frozenset() if dequantize else _packable(layout, names)
    read = {t for ours, pieces in layout.items() if ours not in packed for t, _, _ in pieces}
    linked = {t for pieces in layout.values() for t, _, _ in pieces}
    tensors = {n: dequantize_tensor(t, str(path)) for n, t in names.items() if n in read}
    tensors.update({n: torch.empty(0) for n in names if n not in linked})  # refused by build
    cfg.extra["tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    found = Tensors(tensors, str(path))
    model = build(arch, "gguf", cfg, found, assign=not dequantize, placeholders=packed)
    if not dequantize:
        pack_linear_layers(model, names, layout)
    return model


def _kind(names: dict[str, GGUFTensor], pieces) -> str | None:
    """The kernel kind of the tensors that the ``pieces`` of a weight come from; None unless
    all are of one kind a kernel reads."""
    kinds = {_kernel(names.get(name)) for name, _, _ in pieces}
    return next(iter(kinds)) if len(kinds) == 1 else None


def _packable(layout: dict, names: dict[str, GGUFTensor]) -> frozenset[str]:
    """The weights that packed layers will hold: the linear layers and the token table, each
    made of tensors of one kernel kind."""
    return frozenset(ours for ours, pieces in layout.items()
                     if ours.endswith(_PACKABLE) and _kind(names, pieces))  # fmt: skip


def _blocks(names: dict[str, GGUFTensor], pieces) -> tuple[Tensor, str] | None:
    """The rows of blocks the ``pieces`` of a weight hold, stacked (q and k rows unpermuted,
    fused tensors' rows sliced), and their kernel kind; None unless all are of one kind."""
    kind = _kind(names, pieces)
    if kind is None:
        return None
    rows = []
    for name, part, heads in pieces:
        blocks = _file_blocks(names[name])[part]  # (out, bytes per row): a view of the file
        rows.append(unpermute(blocks, heads) if heads else blocks)
    return (torch.cat(rows) if len(rows) > 1 else rows[0]), kind


def pack_linear_layers(model: DecoderLM, names: dict[str, GGUFTensor], layout: dict) -> None:
    """Swap the model's linear layers for PackedLinear, and its token table for
    PackedEmbedding, over the file's own blocks where ``layout`` (the description's plan)
    makes them of one kernel kind (tied embeddings: the output layer and the table share the
    table's blocks)."""
    cfg = model.cfg
    packed: Counter = Counter()
    kept: Counter = Counter()
    new: dict[str, nn.Module] = {}
    found = _blocks(names, layout["embeddings.tokens.weight"])
    if found is not None:
        new["embeddings.tokens"] = PackedEmbedding(found[0], found[1], cfg.d_model)
        packed[found[1]] += 1
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = "embeddings.tokens.weight" if name == "lm_head" and cfg.tie_embeddings else None
        found = _blocks(names, layout[weight or f"{name}.weight"])
        if found is None:
            kept[name.rpartition(".")[2]] += 1
            continue
        bias = None if module.bias is None else module.bias.detach()
        new[name] = PackedLinear(found[0], found[1], module.in_features, bias=bias)
        packed[found[1]] += 1
    swap_named(model, new)
    if "lm_head" not in kept:
        cfg.tie_embeddings = False  # the output layer has its own (packed) copy now
    cfg.extra["weights"] = {"packed": dict(packed), "float32": dict(kept)}
