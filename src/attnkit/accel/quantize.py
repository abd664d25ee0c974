"""Weight-only quantization of any attnkit model into llama.cpp's block formats.

``quantize(model, "int8")`` replaces every ``nn.Linear`` whose input width is a multiple of 32
by a :class:`~attnkit.accel.packed.PackedLinear` over blocks of 32 weights, each with its own
scale (and, for 4 bits, its own minimum)::

    int8 -> Q8_0:  w ~ d q,      q in [-127, 127],  d = max |w| / 127   (8.5 bits per weight)
    int4 -> Q4_1:  w ~ d q + m,  q in [0, 15],      m = min w, d = (max w - m) / 15   (5 bits)

Activations stay float32; only the weights are rounded, by ``gguf.quants`` (llama.cpp's own
rounding, ported to numpy), so a quantized model equals one that llama.cpp's
``llama-quantize`` would give for those formats. Models from any source qualify: trained by
attnkit, read from a Hugging Face directory or dequantized from a GGUF file.

A quantized model saves like any other (``save_pretrained``: the blocks go into
``model.safetensors`` as uint8 tensors, and ``cfg.extra["packed"]`` lists which layers hold
blocks of which format); ``from_pretrained`` rebuilds those layers before reading the weights.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from attnkit.accel.packed import BLOCK_BYTES, PackedEmbedding, PackedLinear, dequantize
from attnkit.accel.swap import swap_named
from attnkit.serialization import packed_layout

__all__ = ["SCHEMES", "dequantize_model", "packed_layout", "quantize", "restore_packed_layout"]

SCHEMES = {"int8": "Q8_0", "int4": "Q4_1", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1"}
GROUP_SIZE = 32  # weights per block in every format the kernel reads


def quantize(
    model: nn.Module, scheme: str = "int8", *, group_size: int = GROUP_SIZE, skip=()
) -> nn.Module:
    """Replace the linear layers of ``model`` by packed ones, in place; returns the model.

    Args:
        scheme: ``"int8"`` (Q8_0) or ``"int4"`` (Q4_1); the format names ``"Q8_0"``,
            ``"Q4_0"``, ``"Q4_1"`` are accepted too.
        group_size: weights per scale; the block formats have 32 (other sizes are refused).
        skip: names of modules to leave in float32 (for instance ``["lm_head"]``).

    Layers whose input width is not a multiple of 32 stay float32; ``cfg.extra["packed"]``
    records every packed layer. The model is for inference afterwards (``model.eval()``).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    if group_size != GROUP_SIZE:
        raise ValueError(
            f"quantize: group_size must be {GROUP_SIZE} (the block formats' group), got "
            f"{group_size!r}"
        )
    names = dict(model.named_modules())
    unknown = sorted(set(skip) - set(names))
    if unknown:
        raise ValueError(f"quantize: skip names no module of the model: {unknown}")
    kind = SCHEMES[scheme]
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    new: dict[str, nn.Module] = {}
    for name, module in names.items():
        if not isinstance(module, nn.Linear) or name in skip or module.in_features % GROUP_SIZE:
            continue
        weight = module.weight.detach().float().cpu().numpy()  # (out, in)
        blocks = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weight, qtype)))
        bias = None if module.bias is None else module.bias.detach().float().cpu()
        new[name] = PackedLinear(blocks, kind, module.in_features, bias=bias)
    swap_named(model, new)
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        if getattr(cfg, "tie_embeddings", False) and isinstance(
            getattr(model, "lm_head", None), PackedLinear
        ):
            cfg.tie_embeddings = False  # the output layer holds blocks of its own now
        cfg.extra["packed"] = packed_layout(model)
    return model.eval()


def dequantize_model(model: nn.Module) -> int:
    """The way back for training, in place: every packed layer of ``model`` (from
    :func:`quantize`, or a GGUF file read with ``dequantize=False``) becomes a float32
    ``nn.Linear`` / ``nn.Embedding`` holding its blocks' values (the rounding stays). Returns
    how many layers it replaced."""
    new: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            layer = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            weight, bias = module.dequantized(), module.bias
        elif isinstance(module, PackedEmbedding):
            layer = nn.Embedding(module.num_embeddings, module.embedding_dim)
            weight, bias = dequantize(module.blocks, module.kind), None
        else:
            continue
        with torch.no_grad():
            layer.weight.copy_(weight.reshape(layer.weight.shape))
            if bias is not None:
                layer.bias.copy_(bias)
        new[name] = layer
    swap_named(model, new)
    cfg = getattr(model, "cfg", None)
    if new and cfg is not None:
        cfg.extra.pop("packed", None)
    return len(new)


def restore_packed_layout(model: nn.Module, layout: dict[str, str], source: str) -> None:
    """Before reading saved weights: replace the layers that ``layout`` names by packed ones
    of the same shape (their blocks and biases are then read from the file)."""
    if not isinstance(layout, dict):
        raise ValueError(f"{source}: config.extra.packed must be a mapping, got {layout!r}")
    names = dict(model.named_modules())
    new: dict[str, nn.Module] = {}
    for name, kind in layout.items():
        module = names.get(name)
        if kind not in BLOCK_BYTES or not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(
                f"{source}: config.extra.packed names {name!r} as {kind!r}; expected a linear "
                f"layer or embedding of the model and one of {sorted(BLOCK_BYTES)}"
            )
        if isinstance(module, nn.Embedding):
            rows, width = module.num_embeddings, module.embedding_dim
        else:
            rows, width = module.out_features, module.in_features
        if width % 32:
            raise ValueError(f"{source}: {name!r} is {width} wide, not a multiple of 32")
        blocks = torch.zeros(rows, width // 32 * BLOCK_BYTES[kind], dtype=torch.uint8)
        if isinstance(module, nn.Embedding):
            new[name] = PackedEmbedding(blocks, kind, width)
        else:
            bias = None if module.bias is None else torch.zeros(rows)
            new[name] = PackedLinear(blocks, kind, width, bias=bias)
    swap_named(model, new)
