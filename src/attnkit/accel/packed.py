"""Linear layers whose weights stay in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
Q6_K).

Decoding a token multiplies one row by every weight matrix, so its speed is set by the bytes
of weights read per token (``bench/gguf_kernel.py``: on a 2-core EPYC both float32 ``F.linear``
and a packed kernel run near 8 GB/s). A GGUF file's 4-bit blocks are 6.4x smaller than the
float32 weights they stand for, so :class:`PackedLinear` keeps them as they are and multiplies
with a small C kernel (``packed.c``, AVX-512 or AVX2 where the processor has them) that reads
each block once and uses it for every row::

    y = x W^T,  W = rows of blocks:  Q8_0 w = q d,  Q4_0 w = d (q - 8),  Q4_1 w = d q + m,
                                     Q4_K, Q5_K w = d q + m per 32 weights (repack_q4_k,
                                     repack_q5_k)
    block b's share of y[n] = d_b (q_b . x_b) + m_b sum(x_b)

**The integer path** (``integer=True``, chosen by :func:`use_integer_products`): as llama.cpp
does, x is first quantized per block of 32 to int8 with a float scale, and each block's share
is an integer dot product (AVX-512 VNNI, AVX-VNNI or AVX2, by the variant loaded)::

    block b's share of y[n] = d_b dx_b (q_b . qx_b) + m_b dx_b sum(qx_b)

The blocks are then repacked once into tiles of 16 rows (8 without AVX-512 VNNI;
``packed.c``'s ``packed_tile``), so that one instruction multiplies every row of a tile with the
same 4 bytes of x and no block ends in a horizontal sum: on the Xeon the project was measured
on, 4-6x the float path's speed for one row. Only x's rounding to 8 bits differs from the float
path (``docs/GGUF.md`` measures what it
costs in perplexity). ``accel.prepare(model, "decoding")`` turns it on where it measures faster
on the model's own layers.

Under ``torch.compile`` the kernel is an operator, ``torch.ops.attnkit.packed_linear``
(:func:`register_operator`), which stays one call inside a compiled step.

The kernel is built at install, one variant per instruction set, the CPU's own loaded at run
time (:mod:`attnkit.accel.native`). Up to ``PROMPT_ROWS`` rows go through
it, ``MAX_ROWS`` at a time. A longer input (a prompt), a gradient, or no kernels: the blocks
are dequantized to float32 (by the kernel's one-pass ``packed_dequantize``, or by
:func:`dequantize` without it; both bit for bit ``gguf.quants``), a few thousand rows at a time,
and go through a GEMM, which reuses each weight for many rows: oneDNN's where
``accel.onednn.linear`` takes the product (``ATTNKIT_ONEDNN_LINEAR=0`` turns it off), else
``F.linear``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.accel import native
from attnkit.accel.memory import release_file_pages
from attnkit.accel.onednn import linear

__all__ = [
    "BLOCK_BYTES",
    "MAX_ROWS",
    "PackedEmbedding",
    "PackedLinear",
    "dequantize",
    "int8_path",
    "packed_kernel",
    "register_operator",
    "repack_q4_k",
    "repack_q5_0",
    "repack_q5_k",
    "repack_q6_k",
    "use_integer_products",
]

# bytes per block of 32 weights (the K-quants: as repack_q4_k, repack_q6_k, repack_q5_k keep them)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 24, "Q6_K": 40, "Q5_K": 40}
_KIND_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "Q5_K": 5}
TILE_CODES = {kind: 8 + code for kind, code in _KIND_CODES.items()}  # packed_tile's output
TILE_BYTES = {**BLOCK_BYTES, "Q6_K": 44}  # per row of 32 weights: the blocks' own, Q6_K's + 4
Q4_K_BYTES = 144  # a GGUF Q4_K super-block: 256 weights
Q5_K_BYTES = 176  # a GGUF Q5_K super-block: 256 weights
MAX_ROWS = 16  # rows per kernel call; a prompt's rows take several calls
DEQUANTIZED_ROWS = 4096  # output features dequantized at a time for the GEMM
PROMPT_ROWS = 32  # longer inputs: dequantize a layer and multiply with torch's GEMM


# --------------------------------------------------------------------------------------------
# Dequantization (the reference, and the path for prompts)
# --------------------------------------------------------------------------------------------


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
    blocks = data.reshape(-1, Q4_K_BYTES)  # (S, 144)
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
    blocks = data.reshape(-1, Q5_K_BYTES)  # (S, 176)
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
    blocks = data.reshape(-1, 22)  # (B, 22)
    high = blocks[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8)  # weight j: byte j // 8
    bits = (high & 1).reshape(-1, 32)  # (B, 32): weight j's 5th bit (bit j % 8 of its byte)
    qs = blocks[:, 6:]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # (B, 32)
    q = (low | (bits << 4)) - 16  # q - 16 in -16..15, as uint8 wraps: the int8's bytes
    return torch.cat([blocks[:, :2], q], dim=1).reshape(rows, -1)


Q6_K_BYTES = 210  # a GGUF Q6_K super-block: 256 weights


def repack_q6_k(data: Tensor) -> Tensor:
    """GGUF Q6_K rows, uint8 (rows, n / 256 * 210), -> the blocks PackedLinear keeps for them,
    uint8 (rows, n / 32 * 40).

    A Q6_K super-block holds 256 6-bit integers q (4 low bits in ``ql``, 2 high ones in
    ``qh``), 16 int8 scales (one per 16 weights) and a float16 d: ``w = (d scale) (q - 32)``.
    Each group of 32 becomes a block of its own: float32 ``d scale`` for its first and its
    last 16 weights (exact products) and its 32 ``q - 32`` as int8, so that ``d_a q`` rounds
    once, as ``gguf.quants`` computes it."""
    rows = data.shape[0]
    blocks = data.reshape(-1, Q6_K_BYTES)  # (S, 210)
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


# --------------------------------------------------------------------------------------------
# The kernel, built once per machine
# --------------------------------------------------------------------------------------------


def packed_kernel():
    """The native kernels' library in use (:func:`attnkit.accel.native.library`), or None:
    callers fall back to dequantizing."""
    return native.library()


LlamaLayer = native.structure("LlamaLayer")  # structs.h: packed_llama_step's layer
LlamaCache = native.structure("LlamaCache")  # ... and a layer's cache

_INT8_PATHS = {3: "AVX-512 VNNI", 2: "AVX-VNNI", 1: "AVX2", 0: "plain C"}


def int8_path() -> str | None:
    """Which integer dot product the loaded kernels use ("AVX-512 VNNI", "AVX-VNNI", "AVX2",
    "plain C"), or None without kernels."""
    kernel = packed_kernel()
    return None if kernel is None else _INT8_PATHS[kernel.packed_int8_path()]


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


def _check_blocks(where: str, blocks: Tensor, kind: str, row_length: int) -> None:
    """Rows of ``row_length`` weights, each as whole blocks of ``kind``."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"{where}: kind must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    if row_length % 32 or blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(
            f"{where}: blocks must be uint8 (rows, bytes per row) and a row's length a "
            f"multiple of 32, got {tuple(blocks.shape)} {blocks.dtype} and {row_length}"
        )
    if blocks.shape[1] != row_length // 32 * BLOCK_BYTES[kind]:
        raise ValueError(
            f"{where}: a row of {row_length} {kind} weights takes "
            f"{row_length // 32 * BLOCK_BYTES[kind]} bytes, got {blocks.shape[1]}"
        )


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W (out_features, in_features) kept as rows of blocks.

    ``blocks``: uint8 (out_features, in_features / 32 * block bytes), a buffer (saved with the
    model's state); ``bias`` (out_features,) float32, optional. Up to ``PROMPT_ROWS`` rows
    without a gradient go through the packed kernel, with float32 activations, and anything
    else through a GEMM on the dequantized weight; with ``integer`` True, int8 activations
    through tiles, any number of rows (``MAX_ROWS`` at a time: a row's result does not depend
    on how a prompt was split, as with llama.cpp's integer path).
    """

    @property
    def block_format(self) -> str:
        """The blocks' format (``serialization.packed_layout`` saves it with the model)."""
        return self.kind

    def __init__(
        self,
        blocks: Tensor,
        kind: str,
        in_features: int,
        *,
        bias: Tensor | None = None,
        integer: bool = False,
    ) -> None:
        super().__init__()
        _check_blocks("PackedLinear", blocks, kind, in_features)
        if bias is not None and (bias.dim() != 1 or len(bias) != blocks.shape[0]):
            raise ValueError(
                f"PackedLinear: bias must have shape ({blocks.shape[0]},), got {tuple(bias.shape)}"
            )
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("tiles", None, persistent=False)
        self.set_integer(integer)

    @property
    def integer(self) -> bool:
        """Whether products take the integer path: whether the blocks are held as tiles."""
        return self.tiles is not None

    def set_integer(self, enabled: bool) -> None:
        """Take the integer path (``enabled``) or the float32 one. The integer path reads the
        blocks repacked into tiles (once; ``tiles``, not saved with the model); rows that make
        no whole tiles (or no kernels) stay on the float32 path. Blocks that are a view of a
        memory-mapped file (``load_gguf``'s) leave the resident set as they are tiled
        (``accel.memory.release_file_pages``): the file's pages are read again only if the
        float32 path or a lookup of a tied table needs them."""
        if not enabled:
            self.tiles = None
        elif self.tiles is None:
            self.tiles = _tiled(self.blocks, self.kind, self.in_features, release=True)

    def extra_repr(self) -> str:
        integer = ", int8 activations" if self.integer else ""
        return f"{self.in_features} -> {self.out_features}, {self.kind}{integer}"

    def dequantized(self) -> Tensor:
        """The float32 weight (out_features, in_features)."""
        return _dequantized(self.blocks, self.kind, self.in_features)

    def _dequantized_product(self, x: Tensor) -> Tensor:
        """A GEMM on the dequantized weight, ``DEQUANTIZED_ROWS`` output features at a time: a
        large layer (an output layer over a vocabulary) is never float32 whole. The GEMM is
        oneDNN's where ``accel.onednn.linear`` takes it (a prompt's rows), else ``F.linear``."""
        parts = []
        for start in range(0, self.out_features, DEQUANTIZED_ROWS):
            rows = self.blocks[start : start + DEQUANTIZED_ROWS]
            parts.append(linear(x, _dequantized(rows, self.kind, self.in_features).to(x.dtype)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # one call in the compiled graph
            usable, product = _operator is not None, _operator
        else:
            usable, product = packed_kernel() is not None, _packed_product
        tiled = self.tiles is not None  # the integer path takes every row: one arithmetic
        if (
            not usable
            or x.device.type != "cpu"
            or (x.requires_grad and torch.is_grad_enabled())
            or (x.numel() > PROMPT_ROWS * self.in_features and not tiled)
        ):
            y = self._dequantized_product(x)  # a prompt: a GEMM beats the kernel
        elif self.tiles is not None:
            y = product(x, self.tiles, TILE_CODES[self.kind], self.out_features)
        else:
            y = product(x, self.blocks, _KIND_CODES[self.kind], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _dequantized(blocks: Tensor, kind: str, in_features: int) -> Tensor:
    """Rows of blocks as a float32 matrix: by the C kernel where it is built (one pass, the
    same values bit for bit), else by :func:`dequantize`."""
    kernel = packed_kernel()
    if kernel is None or not blocks.is_contiguous():
        return dequantize(blocks, kind).reshape(len(blocks), in_features)
    out = torch.empty(len(blocks), in_features)
    threads = torch.get_num_threads()
    status = kernel.packed_dequantize(
        _KIND_CODES[kind], blocks.data_ptr(), out.data_ptr(), len(blocks), in_features, threads
    )
    if status != 0:  # cannot happen for blocks PackedLinear checked
        raise RuntimeError(f"packed_dequantize refused {kind} rows of {in_features} ({status})")
    return out


def _tiled(blocks: Tensor, kind: str, in_features: int, release: bool = False) -> Tensor | None:
    """``blocks`` repacked into tiles for the integer path (``packed.c``'s ``packed_tile``), or
    None where the kernel cannot: no kernels, or rows that do not make whole tiles. With
    ``release``, the pages of blocks that a memory-mapped file holds leave the resident set as
    soon as their rows are tiled (``DEQUANTIZED_ROWS`` rows at a time), so that the file's
    blocks and their tiles are never resident together whole."""
    kernel = packed_kernel()
    if kernel is None or len(blocks) % kernel.packed_tile_rows():
        return None
    tiles = torch.empty(len(blocks), in_features // 32 * TILE_BYTES[kind], dtype=torch.uint8)
    threads = torch.get_num_threads()
    for start in range(0, len(blocks), DEQUANTIZED_ROWS):  # a multiple of the tiles' rows
        rows, out = (
            blocks[start : start + DEQUANTIZED_ROWS],
            tiles[start : start + DEQUANTIZED_ROWS],
        )
        status = kernel.packed_tile(
            _KIND_CODES[kind], rows.data_ptr(), out.data_ptr(), len(rows), in_features, threads
        )
        if status != 0:  # cannot happen for blocks PackedLinear checked
            raise RuntimeError(f"packed_tile refused {kind} rows of {in_features} ({status})")
        if release:
            release_file_pages(rows)
    return tiles


class PackedEmbedding(nn.Module):
    """A token table kept as rows of blocks: a lookup dequantizes only the rows it reads.

    ``blocks``: uint8 (num_embeddings, embedding_dim / 32 * block bytes), a buffer; a tied
    output layer (a :class:`PackedLinear`) may hold the same blocks."""

    @property
    def block_format(self) -> str:
        """The blocks' format (``serialization.packed_layout`` saves it with the model)."""
        return self.kind

    def __init__(self, blocks: Tensor, kind: str, embedding_dim: int) -> None:
        super().__init__()
        _check_blocks("PackedEmbedding", blocks, kind, embedding_dim)
        self.kind, self.embedding_dim, self.num_embeddings = kind, embedding_dim, blocks.shape[0]
        self.register_buffer("blocks", blocks)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.blocks[ids.reshape(-1)]  # (n, bytes per row)
        return dequantize(rows, self.kind).reshape(*ids.shape, self.embedding_dim)


def _packed_product(x: Tensor, blocks: Tensor, kind: int, out_features: int) -> Tensor:
    """``x W^T`` by the packed kernel, x (..., in_features): ``MAX_ROWS`` rows at a time (a
    prompt's rows in several calls, each reading the weights once); ``blocks`` are tiles (the
    integer path) where ``kind`` is one of ``TILE_CODES``. Written for a small call cost: a
    decoding step makes one call per linear layer."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)  # (rows, in)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    rows = flat.shape[0]
    out = torch.empty(*x.shape[:-1], out_features)
    library = packed_kernel()
    kernel = library.packed_matmul_tiles if kind >= 8 else library.packed_matmul
    threads = torch.get_num_threads()
    x_at, y_at, w_at = flat.data_ptr(), out.data_ptr(), blocks.data_ptr()
    for start in range(0, rows, MAX_ROWS):  # 4-byte floats: the rows' addresses
        n = min(MAX_ROWS, rows - start)
        x_row, y_row = x_at + 4 * start * in_features, y_at + 4 * start * out_features
        status = kernel(kind, w_at, x_row, y_row, n, out_features, in_features, threads)
        if status != 0:  # cannot happen for shapes PackedLinear checked
            raise RuntimeError(f"packed_matmul refused {n} rows of {in_features} ({status})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


# The kernel as an operator, torch.ops.attnkit.packed_linear, once register_operator() ran.
_operator = None


def register_operator():
    """Register :func:`_packed_product` as the operator ``torch.ops.attnkit.packed_linear``
    (once; returns it), so that ``torch.compile`` keeps a packed product as one call in a
    compiled step. ``accel.compiled_step`` registers it when the kernel is built. (Not at
    import: torch's operator registration imports its compiler, a second of start-up; and
    eager calls skip the operator's dispatch, which costs more than a decoding step's small
    product.)"""
    global _operator
    if _operator is None:

        @torch.library.custom_op("attnkit::packed_linear", mutates_args=())
        def packed_linear(x: Tensor, blocks: Tensor, kind: int, out_features: int) -> Tensor:
            return _packed_product(x, blocks, kind, out_features)

        @packed_linear.register_fake
        def _(x: Tensor, blocks: Tensor, kind: int, out_features: int) -> Tensor:
            return x.new_empty(*x.shape[:-1], out_features)

        _operator = packed_linear
    return _operator


# --------------------------------------------------------------------------------------------
# The integer path, chosen by a call
# --------------------------------------------------------------------------------------------


def use_integer_products(model: nn.Module, enabled: bool = True) -> int:
    """Set every :class:`PackedLinear` of ``model`` to the integer path (``enabled``) or the
    float32 one; returns how many were set. (``accel.prepare`` calls it with its choice.)"""
    count = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.set_integer(enabled)
            count += 1
    return count


def time_paths(layer: PackedLinear, rounds: int = 7) -> dict[str, float]:
    """The fastest of ``rounds`` one-row products through ``layer``'s blocks, in seconds, by
    the float32 path and the integer one (alternating, after a warm-up); the integer one is
    infinite where the rows make no whole tiles."""
    import time

    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(0))
    tiles = _tiled(layer.blocks, layer.kind, layer.in_features)
    paths = {"float32": (layer.blocks, _KIND_CODES[layer.kind])}
    if tiles is not None:
        paths["int8"] = (tiles, TILE_CODES[layer.kind])
    best = {"float32": float("inf"), "int8": float("inf")}
    for round_ in range(rounds + 1):
        for name, (weights, code) in paths.items():
            start = time.perf_counter()
            for _ in range(4):
                _packed_product(x, weights, code, layer.out_features)
            if round_:
                best[name] = min(best[name], (time.perf_counter() - start) / 4)
    return best
