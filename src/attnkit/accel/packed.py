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

**The integer path** (:class:`IntegerPackedLinear`, swapped in by
:func:`use_integer_products`): as llama.cpp does, x is first quantized per block of 32 to int8
with a float scale, and each block's share is an integer dot product (AVX-512 VNNI, AVX-VNNI
or AVX2, by the variant loaded)::

    block b's share of y[n] = d_b dx_b (q_b . qx_b) + m_b dx_b sum(qx_b)

The blocks are then repacked once into tiles of 16 rows (8 without AVX-512 VNNI;
``packed.c``'s ``packed_tile``), so that one instruction multiplies every row of a tile with the
same 4 bytes of x and no block ends in a horizontal sum: on the Xeon the project was measured
on, 4-6x the float path's speed for one row. Only x's rounding to 8 bits differs from the float
path (``docs/GGUF.md`` measures what it
costs in perplexity). ``accel.prepare(model, "decoding")`` turns it on by its rule: wherever the
kernels are built.

Under ``torch.compile`` the kernel is an operator, ``torch.ops.attnkit.packed_linear``
(:func:`register_operator`), which stays one call inside a compiled step.

The kernel is built at install, one variant per instruction set, the CPU's own loaded at run
time (:mod:`attnkit.accel.native`). Every product without a gradient goes through it,
``MAX_ROWS`` rows at a time, each row alone: a row's result never depends on how many rows share
the call (a prompt, a batch, one decoding step). A gradient, another device, or no kernels: the
blocks are dequantized to float32 (by the kernel's one-pass ``packed_dequantize``, or by
:func:`dequantize` without it; both bit for bit ``gguf.quants``), a few thousand rows at a time,
and go through a GEMM: oneDNN's where ``accel.onednn.linear`` takes the product, else
``F.linear``'s.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from attnkit.accel import native
from attnkit.accel.block_formats import (
    BLOCK_BYTES,
    dequantize,
    repack_q4_k,
    repack_q5_0,
    repack_q5_k,
    repack_q6_k,
)
from attnkit.accel.memory import release_file_pages
from attnkit.accel.onednn import linear
from attnkit.accel.swap import swap_modules

__all__ = [
    "BLOCK_BYTES",
    "MAX_ROWS",
    "IntegerPackedLinear",
    "PackedEmbedding",
    "PackedLinear",
    "check_tile_layout",
    "dequantize",
    "int8_path",
    "register_operator",
    "repack_q4_k",
    "repack_q5_0",
    "repack_q5_k",
    "repack_q6_k",
    "tiles_changed",
    "use_integer_products",
]

# the kinds' codes, as packed.h defines them (native.kinds()): blocks, and tiles of blocks
KIND_CODES = {kind: native.kinds()[kind] for kind in BLOCK_BYTES}
_TILE_BASE = native.kinds()["TILE_BASE"]
TILE_CODES = {kind: _TILE_BASE + code for kind, code in KIND_CODES.items()}
TILE_BYTES = {**BLOCK_BYTES, "Q6_K": 44}  # per row of 32 weights: the blocks' own, Q6_K's + 4
MAX_ROWS = 16  # rows per kernel call; a prompt's rows take several calls
_changes = 0  # how many times packed layers were swapped for the other path (tiles_changed())
DEQUANTIZED_ROWS = 4096  # output features dequantized at a time for the GEMM


# --------------------------------------------------------------------------------------------
# The kernel, built once per machine
# --------------------------------------------------------------------------------------------


LlamaLayer = native.structure("LlamaLayer")  # structs.h: packed_llama_forward's layer
LlamaCache = native.structure("LlamaCache")  # ... and a layer's cache

_INT8_PATHS = {3: "AVX-512 VNNI", 2: "AVX-VNNI", 1: "AVX2", 0: "plain C"}


def int8_path() -> str | None:
    """Which integer dot product the loaded kernels use ("AVX-512 VNNI", "AVX-VNNI", "AVX2",
    "plain C"), or None without kernels."""
    kernel = native.library()
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
    model's state); ``bias`` (out_features,) float32, optional. Rows without a gradient go
    through the packed kernel, ``MAX_ROWS`` at a time (a row's result does not depend on the
    others), with float32 activations; anything else through a GEMM on the dequantized weight.
    """

    integer = False  # float32 activations (IntegerPackedLinear: int8)
    prepared = False  # accel.prepare(model, "decoding") marks the layers of a model it readied

    @property
    def block_format(self) -> str:
        """The blocks' format (``serialization.packed_layout`` saves it with the model)."""
        return self.kind

    def __init__(
        self, blocks: Tensor, kind: str, in_features: int, *, bias: Tensor | None = None
    ) -> None:
        super().__init__()
        _check_blocks(type(self).__name__, blocks, kind, in_features)
        if bias is not None and (bias.dim() != 1 or len(bias) != blocks.shape[0]):
            raise ValueError(
                f"PackedLinear: bias must have shape ({blocks.shape[0]},), got {tuple(bias.shape)}"
            )
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", bias)

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

    def _packed(self, x: Tensor, product) -> Tensor:
        return product(x, self.blocks, KIND_CODES[self.kind], self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # one call in the compiled graph
            usable, product = _operator is not None, _operator
        else:
            usable, product = native.library() is not None, _packed_product
            if not self.prepared:
                _say_unprepared()
        if not usable or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            y = self._dequantized_product(x)
        else:
            y = self._packed(x, product)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class IntegerPackedLinear(PackedLinear):
    """A :class:`PackedLinear` on the integer path: the same blocks, repacked once into tiles
    (``tiles``, not saved with the model; needs the kernels), multiplied with x rounded to int8
    per block of 32. Blocks that are a view of a memory-mapped file (``load_gguf``'s) leave the
    resident set as they are tiled (``accel.memory.release_file_pages``): the file's pages are
    read again only if the float32 path or a lookup of a tied table needs them.
    :func:`use_integer_products` swaps these in and out."""

    integer = True

    def __init__(
        self, blocks: Tensor, kind: str, in_features: int, *, bias: Tensor | None = None
    ) -> None:
        super().__init__(blocks, kind, in_features, bias=bias)
        if native.library() is None:
            raise RuntimeError("IntegerPackedLinear: the integer path needs the native kernels")
        tiles = _tiled(self.blocks, kind, in_features, release=True)
        self.register_buffer("tiles", tiles, persistent=False)
        self.tile_layout = native.library().packed_tile_layout()  # the layout that made them

    def _packed(self, x: Tensor, product) -> Tensor:
        check_tile_layout(self)
        return product(x, self.tiles, TILE_CODES[self.kind], self.out_features)


def tiles_changed() -> int:
    """A count that grows whenever packed layers are swapped onto or off the integer path: what
    reads the tiles' addresses (``PackedStack``) knows from it when to read them again."""
    return _changes


def check_tile_layout(layer: PackedLinear) -> None:
    """Refuse tiles made by kernels of another layout than the ones in use (rows per tile, and
    whether bytes carry VNNI's offset, depend on the variant: ``packed.c``'s
    ``packed_tile_layout``): read under another, they would give wrong products."""
    kernel = native.library()
    if kernel is not None and layer.tile_layout != kernel.packed_tile_layout():
        raise RuntimeError(
            f"PackedLinear: its tiles were made by kernels of tile layout {layer.tile_layout}, "
            f"but the {native.variant()!r} kernels in use read layout "
            f"{kernel.packed_tile_layout()}; call accel.use_integer_products(model) again "
            "under these kernels"
        )


def _dequantized(blocks: Tensor, kind: str, in_features: int) -> Tensor:
    """Rows of blocks as a float32 matrix: by the C kernel where it is built (one pass, the
    same values bit for bit), else by :func:`dequantize`."""
    kernel = native.library()
    if kernel is None or not blocks.is_contiguous():
        return dequantize(blocks, kind).reshape(len(blocks), in_features)
    out = torch.empty(len(blocks), in_features)
    threads = torch.get_num_threads()
    status = kernel.packed_dequantize(
        KIND_CODES[kind], blocks.data_ptr(), out.data_ptr(), len(blocks), in_features, threads
    )
    if status != 0:  # cannot happen for blocks PackedLinear checked
        raise RuntimeError(f"packed_dequantize refused {kind} rows of {in_features} ({status})")
    return out


def _tiled(blocks: Tensor, kind: str, in_features: int, release: bool = False) -> Tensor | None:
    """``blocks`` repacked into tiles for the integer path (``tiles.c``'s ``packed_tile``; the
    rows rounded up to whole tiles, the padding zero weights), or None without kernels. With
    ``release``, the pages of blocks that a memory-mapped file holds leave the resident set as
    soon as their rows are tiled (``DEQUANTIZED_ROWS`` rows at a time), so that the file's
    blocks and their tiles are never resident together whole."""
    kernel = native.library()
    if kernel is None:
        return None
    height = kernel.packed_tile_rows()
    padded = -(-len(blocks) // height) * height
    tiles = torch.empty(padded, in_features // 32 * TILE_BYTES[kind], dtype=torch.uint8)
    threads = torch.get_num_threads()
    for start in range(0, len(blocks), DEQUANTIZED_ROWS):  # a multiple of the tiles' rows
        rows, out = (
            blocks[start : start + DEQUANTIZED_ROWS],
            tiles[start : start + DEQUANTIZED_ROWS],
        )
        status = kernel.packed_tile(
            KIND_CODES[kind], rows.data_ptr(), out.data_ptr(), len(rows), in_features, threads
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
    library = native.library()
    kernel = library.packed_matmul_tiles if kind >= _TILE_BASE else library.packed_matmul
    threads = torch.get_num_threads()
    x_at, y_at, w_at = flat.data_ptr(), out.data_ptr(), blocks.data_ptr()
    for start in range(0, rows, MAX_ROWS):  # 4-byte floats: the rows' addresses
        n = min(MAX_ROWS, rows - start)
        x_row, y_row = x_at + 4 * start * in_features, y_at + 4 * start * out_features
        status = kernel(kind, w_at, x_row, y_row, n, out_features, in_features, threads)
        if status != 0:  # cannot happen for shapes PackedLinear checked
            raise RuntimeError(f"packed_matmul refused {n} rows of {in_features} ({status})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


_said = False  # whether _say_unprepared spoke


def _say_unprepared() -> None:
    """Say once per process that a packed layer ran in a model nobody readied for decoding."""
    global _said
    if not _said:
        _said = True
        warnings.warn(
            "a model with packed weights runs unprepared: accel.prepare(model, 'decoding') "
            "gives it the integer path and its decoder stack in C (from_pretrained does it)",
            stacklevel=3,
        )


# The kernel as an operator, torch.ops.attnkit.packed_linear, once register_operator() ran.
_operator = None


def register_operator():
    """Register :func:`_packed_product` as the operator ``torch.ops.attnkit.packed_linear``
    (once; returns it), so that ``torch.compile`` keeps a packed product as one call in a
    compiled step. ``accel.compiled_steps`` registers it when the kernel is built. (Not at
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


def use_integer_products(model: nn.Module, enabled: bool = True) -> nn.Module:
    """A module swap: every :class:`PackedLinear` of ``model`` becomes an
    :class:`IntegerPackedLinear` over the same blocks (``enabled``; the kernels are needed), or
    every IntegerPackedLinear a PackedLinear again; returns the model. (``accel.prepare``
    calls it with its rule's choice.)"""
    global _changes
    if enabled and native.library() is None:
        raise RuntimeError("use_integer_products: the integer path needs the native kernels")
    cls = IntegerPackedLinear if enabled else PackedLinear

    def swap(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, PackedLinear) or type(module) is cls:
            return None
        return cls(module.blocks, module.kind, module.in_features, bias=module.bias)

    swapped = swap_modules(model, swap)
    _changes += 1
    return swapped
