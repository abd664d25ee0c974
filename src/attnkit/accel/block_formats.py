"""llama.cpp's block formats as attnkit keeps them: their bytes, their dequantization, and the
repacking of the formats the kernels do not read as stored.

A block holds 32 weights; a row of a weight matrix is ``in_features / 32`` blocks::

    kind  bytes  layout                                       w
    Q8_0  34     float16 d, 32 int8 q                         d q
    Q4_0  18     float16 d, 16 bytes of nibbles               d (q - 8)
    Q4_1  20     float16 d, float16 m, 16 bytes of nibbles    d q + m
    Q4_K  24     float32 d, float32 m, 16 bytes of nibbles    d q + m     (repack_q4_k)
    Q5_K  40     float32 d, float32 m, 32 bytes q (0..31)     d q + m     (repack_q5_k)
    Q6_K  40     float32 d_a, d_b, 32 int8 q                  d_a q, d_b q (repack_q6_k)

A GGUF file's K-quants (super-blocks of 256 weights under float16 factors) are repacked at load
into those 32-weight blocks with float32 scales, which are exact, and Q5_0 into Q8_0
(``repack_q5_0``). :func:`dequantize` is the reference: bit for bit ``gguf.quants``.
:mod:`attnkit.accel.packed` multiplies the blocks.

:data:`QUANT_TYPES` is the one table of GGML tensor types: each type's id and blocks in a file,
the kernel kind that multiplies it packed (and the repacking on the way), the bytes the kernels
keep a block of 32 weights in (``packed.h`` defines the same; a test compares them), and
whether ``attnkit export`` writes it. The GGUF loader, the exporter, the packed layers and
``attnkit info`` read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BLOCK_BYTES",
    "QUANT_TYPES",
    "QuantType",
    "dequantize",
    "repack_q4_k",
    "repack_q5_0",
    "repack_q5_k",
    "repack_q6_k",
]


def _halves(blocks: Tensor, at: int) -> Tensor:
    """The float16 stored at byte ``at`` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def dequantize(blocks: Tensor, kind: str) -> Tensor:
    """uint8 blocks (any shape whose bytes are whole blocks) -> float32 values, flat.

    The same arithmetic as ``gguf.quants`` in the same order, so the values are bit for bit
    the same (tested on random blocks, extreme scales among them). ``"Q4_K"``, ``"Q5_K"`` and
    ``"Q6_K"`` mean the blocks :func:`repack_q4_k`, :func:`repack_q5_k` and :func:`repack_q6_k`
    make."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"dequantize: kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    blocks = blocks.reshape(-1, BLOCK_BYTES[kind])
    if kind == "Q5_K":
        d, m = (blocks[:, i : i + 4].contiguous().view(torch.float32) for i in (0, 4))
        return (d * blocks[:, 8:].float() + m).ravel()
    if kind == "Q4_K":
        d, m = (blocks[:, i : i + 4].contiguous().view(torch.float32) for i in (0, 4))
        qs = blocks[:, 8:]
        return (d * torch.cat([qs & 0x0F, qs >> 4], dim=1).float() + m).ravel()
    if kind == "Q6_K":
        d_a, d_b = (blocks[:, i : i + 4].contiguous().view(torch.float32) for i in (0, 4))
        q = blocks[:, 8:].contiguous().view(torch.int8).float()
        return torch.cat([d_a * q[:, :16], d_b * q[:, 16:]], dim=1).ravel()
    if kind == "Q8_0":
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * _halves(blocks, 0)).ravel()
    qs = blocks[:, 4:] if kind == "Q4_1" else blocks[:, 2:]
    nibbles = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # low halves: weights 0-15, high: 16-31
    if kind == "Q4_0":
        return (_halves(blocks, 0) * (nibbles.to(torch.int8) - 8).float()).ravel()
    return (_halves(blocks, 0) * nibbles.float() + _halves(blocks, 2)).ravel()


def repack_q4_k(data: Tensor) -> Tensor:
    """GGUF Q4_K rows, uint8 (rows, n / 256 * 144), -> the blocks PackedLinear keeps for them,
    uint8 (rows, n / 32 * 24).

    A Q4_K super-block holds 8 groups of 32 weights, each with a 6-bit scale and a 6-bit
    minimum under two float16 factors: ``w = (d sc) q - (dmin m)``. Each group becomes a
    block of its own, float32 ``d sc`` and ``-(dmin m)`` (both products are exact in float32)
    and its 16 bytes of nibbles in Q4_1's order, so the kernel reads it as it reads Q4_1."""
    rows = data.shape[0]
    blocks = data.reshape(-1, QUANT_TYPES["Q4_K"].bytes)  # (S, 144)
    scale, minimum = _k_scales(blocks)  # (S, 8) each
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # low nibbles: group 2c, high nibbles: group 2c + 1
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)  # (S, 8 groups, 32)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # Q4_1's order: weights j and j + 16 share a byte
    parts = [t.unsqueeze(-1).contiguous().view(torch.uint8) for t in (scale, minimum)]
    return torch.cat([*parts, nibbles], dim=-1).reshape(rows, -1)  # (rows, groups * 24)


def _k_scales(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's and Q5_K's super-blocks (S, bytes): float16 d and dmin, then 12 bytes of 6-bit
    scales and minimums, one of each per group of 32 -> each group's ``d sc`` and ``-(dmin m)``,
    float32 (S, 8); both products are exact in float32."""
    d, dmin = (blocks[:, i : i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
    packed_scales = blocks[:, 4:16].reshape(-1, 3, 4)  # 6-bit scales and minimums, (S, 3, 4)
    low, high, rest = packed_scales.unbind(1)
    scales = torch.cat([low & 63, (rest & 15) | ((low >> 2) & 48)], dim=1)  # (S, 8)
    minimums = torch.cat([high & 63, (rest >> 4) | ((high >> 2) & 48)], dim=1)
    return d * scales.float(), -(dmin * minimums.float())


def repack_q5_k(data: Tensor) -> Tensor:
    """GGUF Q5_K rows, uint8 (rows, n / 256 * 176), -> the blocks PackedLinear keeps for them,
    uint8 (rows, n / 32 * 40).

    A Q5_K super-block is Q4_K's with a fifth bit per weight: float16 d and dmin, 6-bit scales
    and minimums (``w = (d sc) q - (dmin m)``), 32 bytes of high bits (group g's in bit g) and
    128 bytes of low nibbles (groups 2c and 2c + 1 in the low and high halves of chunk c). Each
    group becomes a block of its own: float32 ``d sc`` and ``-(dmin m)`` and its 32 integers q
    (0..31) a byte each, so ``w = d q + m`` rounds once, as ``gguf.quants`` computes it."""
    rows = data.shape[0]
    blocks = data.reshape(-1, QUANT_TYPES["Q5_K"].bytes)  # (S, 176)
    scale, minimum = _k_scales(blocks)  # (S, 8) each
    high = blocks[:, None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]  # (S, 8, 32)
    qs = blocks[:, 48:].reshape(-1, 4, 32)  # low nibbles: group 2c, high nibbles: group 2c + 1
    low = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 8, 32)
    q = low | ((high & 1) << 4)  # (S, 8 groups, 32), in 0..31
    parts = [t.unsqueeze(-1).contiguous().view(torch.uint8) for t in (scale, minimum)]
    return torch.cat([*parts, q], dim=-1).reshape(rows, -1)  # (rows, groups * 40)


def repack_q5_0(data: Tensor) -> Tensor:
    """GGUF Q5_0 rows, uint8 (rows, n / 32 * 22), -> Q8_0 rows (rows, n / 32 * 34), exactly.

    A Q5_0 block is a float16 d, 32 high bits (weight j's in bit j) and 16 bytes of low nibbles
    (weights 0-15 low, 16-31 high): ``w = d (q - 16)``, q in 0..31. As Q8_0, ``q - 16`` is an
    int8 and the same d: the values are the same bit for bit, in 34 bytes instead of 22, and
    the kernels read them as they read Q8_0."""
    rows = data.shape[0]
    blocks = data.reshape(-1, QUANT_TYPES["Q5_0"].bytes)  # (B, 22)
    high = blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)  # weight j: byte j // 8
    bits = (high & 1).reshape(-1, 32)  # (B, 32): weight j's 5th bit (bit j % 8 of its byte)
    qs = blocks[:, 6:]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # (B, 32)
    q = (low | (bits << 4)) - 16  # q - 16 in -16..15, as uint8 wraps: the int8's bytes
    return torch.cat([blocks[:, :2], q], dim=1).reshape(rows, -1)


def repack_q6_k(data: Tensor) -> Tensor:
    """GGUF Q6_K rows, uint8 (rows, n / 256 * 210), -> the blocks PackedLinear keeps for them,
    uint8 (rows, n / 32 * 40).

    A Q6_K super-block holds 256 6-bit integers q (4 low bits in ``ql``, 2 high ones in
    ``qh``), 16 int8 scales (one per 16 weights) and a float16 d: ``w = (d scale) (q - 32)``.
    Each group of 32 becomes a block of its own: float32 ``d scale`` for its first and its
    last 16 weights (exact products) and its 32 ``q - 32`` as int8, so that ``d_a q`` rounds
    once, as ``gguf.quants`` computes it."""
    rows = data.shape[0]
    blocks = data.reshape(-1, QUANT_TYPES["Q6_K"].bytes)  # (S, 210)
    n = len(blocks)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (S, 16)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()  # (S, 1)
    low = (ql.reshape(n, -1, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 15
    high = (qh.reshape(n, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << 4)).to(torch.int8) - 32  # (S, 8, 32)
    halves = (d * scales).reshape(n, 8, 2)  # each 16 weights' d * scale, exact in float32
    parts = [halves[..., i : i + 1].contiguous().view(torch.uint8) for i in (0, 1)]  # (S, 8, 4)
    return torch.cat([*parts, q.view(torch.uint8)], dim=-1).reshape(rows, -1)  # (rows, 8 * 40)


class QuantType(NamedTuple):
    """One GGML tensor type, as a GGUF file stores it and as attnkit keeps it."""

    ggml: int  # gguf.GGMLQuantizationType's value
    block: int  # weights per block in a file
    bytes: int  # bytes per block in a file
    kernel: str | None = None  # the kernel kind that multiplies it packed (None: float32)
    kept: int | None = None  # a kernel kind's bytes per block of 32 weights (packed.h's)
    repack: Callable[[Tensor], Tensor] | None = None  # the file's rows -> the kernel's
    written: bool = False  # attnkit export writes it (quantized by gguf.quants)


# fmt: off
QUANT_TYPES: dict[str, QuantType] = {
    #               GGML weights bytes  kernel  kept  repack        written
    "F32":  QuantType(0,   1,   4,   None,   None, None,         True),
    "F16":  QuantType(1,   1,   2,   None,   None, None,         True),
    "BF16": QuantType(30,  1,   2,   None,   None, None,         True),
    "Q4_0": QuantType(2,   32,  18,  "Q4_0", 18,   None,         True),
    "Q4_1": QuantType(3,   32,  20,  "Q4_1", 20,   None,         True),
    "Q5_0": QuantType(6,   32,  22,  "Q8_0", None, repack_q5_0),
    "Q5_1": QuantType(7,   32,  24),
    "Q8_0": QuantType(8,   32,  34,  "Q8_0", 34,   None,         True),
    "Q2_K": QuantType(10,  256, 84),
    "Q3_K": QuantType(11,  256, 110),
    "Q4_K": QuantType(12,  256, 144, "Q4_K", 24,   repack_q4_k),
    "Q5_K": QuantType(13,  256, 176, "Q5_K", 40,   repack_q5_k),
    "Q6_K": QuantType(14,  256, 210, "Q6_K", 40,   repack_q6_k),
}
# fmt: on
# the kernels' kinds -> bytes per block of 32 weights as they keep them
BLOCK_BYTES = {name: t.kept for name, t in QUANT_TYPES.items() if t.kept}
