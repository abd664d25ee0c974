"""A padded batch's real tokens as packed rows: the variable-length layout.

A padded batch (B, N) of sequences with L_1, ..., L_B real tokens spends B N rows of every
product where T = sum L_b would do. The variable-length layout keeps only the T real rows,
sequence after sequence, as FlashAttention's varlen API takes them (its ``cu_seqlens`` are
:class:`Sequences`' ``first`` followed by T)::

    rows = Rows.of(key_mask, x)     # where the real tokens of x (B, N, D) are
    packed = rows.gather(x)         # (1, T, D)
    ...                             # every layer runs on packed, its attention told `rows=`
    x = rows.scatter(packed)        # (B, N, D) again, zeros at the padding

Padding cannot change a real token's output: as a key it is masked, and everything else in a
layer (the projections, the feed-forward network, the norms, the residual adds) works on each
position alone. So only attention needs to know where each sequence starts and ends: a
``MultiHeadAttention`` called with ``rows=`` attends within each sequence (see its forward).
The encoder and decoder stacks take ``rows=`` and hand it to their layers; ``accel.unpad_stacks``
gives a model stacks that gather the rows themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Rows", "Sequences", "key_padding"]


class Sequences(NamedTuple):
    """Where B sequences lie in packed (T, ...) rows, one after another: sequence b in rows
    ``first[b]`` to ``first[b] + lengths[b] - 1``; ``longest`` is the largest length."""

    first: Tensor  # (B,) int64
    lengths: Tensor  # (B,) int32
    longest: int

    @classmethod
    def of(cls, real: Tensor) -> Sequences:
        """The real tokens of a padded batch, ``real`` (B, N) bool, packed in order."""
        lengths = real.sum(1, dtype=torch.int32)
        first = torch.cumsum(lengths, 0, dtype=torch.int64) - lengths
        return cls(first, lengths, int(lengths.max()) if len(lengths) else 0)


class _Gather(torch.autograd.Function):
    """rows = x[index] over the flattened (B N, C) positions; the gradient is scattered back."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.total = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return _scatter(grad, index, ctx.total), None


class _Scatter(torch.autograd.Function):
    """x (total, C) with x[index] = rows and zeros elsewhere; the gradient is gathered back."""

    @staticmethod
    def forward(ctx, rows: Tensor, index: Tensor, total: int) -> Tensor:
        ctx.save_for_backward(index)
        return _scatter(rows, index, total)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def _scatter(rows: Tensor, index: Tensor, total: int) -> Tensor:
    return rows.new_zeros(total, rows.shape[1]).index_copy_(0, index, rows)


def key_padding(mask, x: Tensor) -> bool:
    """Whether ``mask`` is a key padding mask of x (B, N, D)'s batch: bool (B, 1, 1, N)."""
    return (
        isinstance(mask, Tensor)
        and mask.dtype == torch.bool
        and mask.shape == (x.shape[0], 1, 1, x.shape[1])
    )


@dataclass
class Rows:
    """Where the real tokens of a padded (B, N) batch are: ``index`` (T,) into the flattened
    B N positions (None: every position is real), and as packed ``sequences``."""

    index: Tensor | None
    batch: int
    length: int
    sequences: Sequences

    @classmethod
    def of(cls, mask: Tensor | None, x: Tensor) -> Rows:
        """The real rows of x (B, N, D) by its key mask (B, 1, 1, N), True = real (None: all)."""
        b, n = x.shape[:2]
        if mask is None:
            real = torch.ones(b, n, dtype=torch.bool, device=x.device)
        else:
            real = mask.reshape(b, n)
        index = None if mask is None else real.reshape(b * n).nonzero().squeeze(1)
        return cls(index, b, n, Sequences.of(real))

    def gather(self, x: Tensor) -> Tensor:
        """(B, N, C) -> (1, T, C): the real rows."""
        flat = x.reshape(self.batch * self.length, x.shape[-1])
        return (flat if self.index is None else _Gather.apply(flat, self.index))[None]

    def scatter(self, rows: Tensor) -> Tensor:
        """(1, T, C) -> (B, N, C): the rows back in place, zeros at the padding."""
        flat = rows.squeeze(0)
        if self.index is not None:
            flat = _Scatter.apply(flat, self.index, self.batch * self.length)
        return flat.view(self.batch, self.length, flat.shape[-1])
