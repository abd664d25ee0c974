"""Padded positions skipped by the layers' products: each stack runs on its real tokens only.

A padded batch (B, N) of sequences with L_1, ..., L_B real tokens spends B N rows of every
product, where T = sum L_b would do. Padding cannot change a real token's output: as a key it is
masked, and everything else in a layer (the projections, the feed-forward network, the norms,
the residual adds) works on each position alone. So ``unpad_stacks(model)`` (a module swap, like
:func:`~attnkit.accel.fuse_lm_loss`) gives the model's encoder and decoder stacks a forward
that

1. gathers the T real rows of x (B, N, D) into (1, T, D) once, before the first layer;
2. runs every layer on those rows. Attention takes them as B sequences packed one after
   another (``accel.attention.packed_attention``: the C kernel reads each sequence's rows
   where they lie, and a decoder's causal mask counts positions within its sequence). Where
   the kernel does not apply (RoPE, ALiBi, window or linear attention, grouped key/value
   heads, dropout on the weights, the kernel off), attention scatters q, k and v into the
   padded (B, H, N, d) layout (zeros at the padding), attends with the batch's mask as
   before, and gathers its output's real rows again. Inside compiled layers
   (``accel.compiled_layers``) attention runs eagerly between the compiled parts;
3. scatters the last layer's rows back into (B, N, D), zeros at the padding.

This is the "unpadding" of BERT implementations and FlashAttention's variable-length kernels.
Every real token's output and gradient is the one the padded stack gives (to float rounding:
the products add the same numbers in another order); what comes out at a padded position is
zero instead of a value nothing reads. With dropout, the random draws fall differently on the
rows, which changes no distribution.

The stacks keep their padded forward where nothing is gained or something would change: no
padding (the model passes no mask), a cache (decoding), attention weights asked for, and a
mixture of experts (whose load-balancing loss counts the padded tokens too): ``unpad_stacks``
leaves such a model as it is. Without padding, attention still takes the batch's B rows of N
tokens as B packed sequences where the kernel applies: the same attention, and its gradient
comes back in the projection's own layout, so the backward joins no dq, dk and dv (a ``cat``
per layer). ``unpadding(False)`` or ``ATTNKIT_UNPAD=0`` turns it all off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.accel.attention import (
    Sequences,
    packed_attention,
    packed_self_attention,
    takes_packed,
)
from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.accel.switch import Switch
from attnkit.attention import MultiHeadAttention
from attnkit.layers import MoEFeedForward
from attnkit.stacks import Decoder, Encoder

__all__ = [
    "Rows", "Unpadded", "UnpaddedAttention", "UnpaddedDecoder", "UnpaddedEncoder",
    "unpad_stacks", "unpadding",
]  # fmt: skip

_switch = Switch("ATTNKIT_UNPAD")


def unpadding(enabled: bool):
    """Turn the unpadded stacks on or off inside a ``with`` block (tests and benchmarks compare
    both). The default is on; ``ATTNKIT_UNPAD=0`` turns it off."""
    return _switch(enabled)


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


def key_mask(mask, x: Tensor) -> bool:
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


@dataclass
class Unpadded:
    """What an unpadded stack hands its layers' attention in place of the mask: where the
    queries' and the keys' real rows are, and the padded batch's own mask (or None)."""

    queries: Rows
    keys: Rows
    mask: Tensor | None


class UnpaddedAttention(MultiHeadAttention):
    """Multi-head attention that takes x (1, T, D) (and context (1, T_src, D)) as real rows
    when its ``mask`` is an :class:`Unpadded`; any other call is the plain module's."""

    def forward(self, x, context=None, *, mask=None, **options):
        if isinstance(mask, Unpadded) and torch.compiler.is_compiling():
            return _eager_attention(self, x, context, mask=mask, **options)
        if mask is None and self._whole(x, context, options):
            return self._packed_whole(x, context, options)
        if not isinstance(mask, Unpadded):
            return super().forward(x, context, mask=mask, **options)
        queries, cross = mask.queries, context is not None
        if self._packs(x, max(queries.sequences.longest, mask.keys.sequences.longest)):
            return self._packed(x, context, mask, options.get("is_causal", False))
        if cross:  # (B, H, N, d) and twice (B, H_kv, M, d), zeros at the padding
            q, k, v = self.heads(
                queries.scatter(self._project_q(x)), mask.keys.scatter(self._project_kv(context))
            )
        else:
            q, k, v = self.heads(queries.scatter(self.in_proj(x)))
        b, n = queries.batch, queries.length
        positions = options.get("positions")
        if not cross:
            positions = self._positions(positions, b, n, None, x.device)
        out, _ = self.attend(
            q, k, v, mask=mask.mask, is_causal=options.get("is_causal", False),
            positions=positions, context_positions=options.get("context_positions"),
            cross=cross, cache=None, return_weights=False,
        )  # fmt: skip
        heads = out.transpose(1, 2).reshape(b, n, self.d_model)  # Concat(heads), (B, N, D)
        return self.out_proj(queries.gather(heads))  # (1, T, D)

    def _whole(self, x: Tensor, context: Tensor | None, options: dict) -> bool:
        """Whether attention over a batch without padding (no mask) runs as packed sequences
        of one length (:meth:`_packed_whole`): as :meth:`_packs` says, and not decoding (a
        cache) or asked for its weights."""
        keys = x if context is None else context
        return (
            _switch.on
            and options.get("cache") is None
            and not options.get("return_weights", False)
            and x.dim() == keys.dim() == 3
            and x.shape[0] == keys.shape[0]
            and self._packs(x, max(x.shape[1], keys.shape[1]))
        )

    def _packed_whole(self, x: Tensor, context: Tensor | None, options: dict) -> Tensor:
        """x (B, N, D) (context (B, M, D)) -> (B, N, D) by :meth:`_packed`, the batch's rows as
        B packed sequences of N (and M) rows. The same attention as the padded layout's; the
        kernel's gradient then comes back as one (B N, 3, H, d) tensor (cross-attention's k and
        v as one (B M, 2, H, d)), where the padded layout's are joined by the split's backward
        (a ``cat`` per layer, about 1% of an lm-small step)."""
        self._check(x, context, None, options.get("positions"), options.get("context_positions"))
        b, n, d = x.shape
        keys = x if context is None else context
        rows = Unpadded(Rows.of(None, x), Rows.of(None, keys), None)
        context = None if context is None else context.reshape(1, -1, d)
        out = self._packed(x.reshape(1, b * n, d), context, rows, options.get("is_causal", False))
        return out.view(b, n, d)

    def _packs(self, x: Tensor, longest: int) -> bool:
        """Whether attention can run on the packed rows themselves (``packed_attention``),
        sequences of at most ``longest`` queries and keys: plain softmax attention, no dropout,
        as many key/value heads as query heads."""
        return (
            self.attention == "full"
            and self.rope is None
            and self.alibi is None
            and self.n_kv_heads == self.n_heads
            and (self.dropout == 0.0 or not self.training)
            and takes_packed(x, longest)
        )

    def _packed(self, x: Tensor, context: Tensor | None, mask: Unpadded, causal: bool):
        """Attention over packed rows: x (1, T, D) (context (1, T_src, D)) -> (1, T, D)."""
        heads, queries = (self.n_heads, self.d_head), mask.queries.sequences
        # squeeze(0), not x[0]: a view whose gradient is one too, where indexing's backward
        # writes the gradient into a new zero-filled (1, T, D) tensor, two passes a layer
        if context is None:  # [Q, K, V]: (T, 3, H, d)
            qkv = self.in_proj(x.squeeze(0)).unflatten(-1, (3, *heads))
            out = packed_self_attention(qkv, queries, causal=causal)  # (T, H, d)
        else:
            q = self._project_q(x.squeeze(0)).unflatten(-1, heads)  # (T, H, d)
            kv = self._project_kv(context.squeeze(0)).unflatten(-1, (2, *heads))  # (T_src, 2, H, d)
            out = packed_attention(q, kv, queries, mask.keys.sequences, causal=causal)
        return self.out_proj(out.flatten(1))[None]  # Concat(heads) W^O, (1, T, D)


# torch.compiler.disable, as torch's own modules write it: torch.compiler.disable imports Dynamo
# at once (2 s for every process that imports attnkit), torch._disable_dynamo at the first call
@torch._disable_dynamo
def _eager_attention(module: UnpaddedAttention, x, context=None, **options):
    """``module(x, context, **options)`` run eagerly: inside a compiled layer
    (``accel.compiled_layers``), attention over packed rows runs between the layer's compiled
    parts (a graph break), where the kernel takes the rows as they lie. The output's row
    count is marked dynamic, as the layer's input is (``compiled_layers``), so that the rest
    of the layer compiles once for any number of rows."""
    out = module.forward(x, context, **options)  # (1, T, D)
    torch._dynamo.maybe_mark_dynamic(out, 1)
    return out


class UnpaddedEncoder(Encoder):
    """An encoder stack over the real rows of a padded batch (see the module docstring)."""

    def forward(self, x, *, mask=None, positions=None, return_attention=False):
        if not key_mask(mask, x) or return_attention or not _switch.on:
            return super().forward(
                x, mask=mask, positions=positions, return_attention=return_attention
            )
        rows = Rows.of(mask, x)
        out, attentions = super().forward(
            rows.gather(x), mask=Unpadded(rows, rows, mask), positions=positions
        )
        return rows.scatter(out), attentions


class UnpaddedDecoder(Decoder):
    """A decoder stack over the real rows of a padded batch, its memory (the encoder output)
    too (see the module docstring)."""

    def forward(self, x, memory=None, *, self_mask=None, memory_mask=None, cache=None, **kw):
        padded = not key_mask(self_mask, x) or cache is not None or kw.get("return_attention")
        if memory is not None and memory_mask is not None:
            padded = padded or not key_mask(memory_mask, memory)
        if padded or not _switch.on:
            return super().forward(
                x, memory, self_mask=self_mask, memory_mask=memory_mask, cache=cache, **kw
            )
        rows = Rows.of(self_mask, x)
        if memory is not None:
            source = Rows.of(memory_mask, memory)
            memory, memory_mask = source.gather(memory), Unpadded(rows, source, memory_mask)
        out, self_weights, cross_weights = super().forward(
            rows.gather(x),
            memory,
            self_mask=Unpadded(rows, rows, self_mask),
            memory_mask=memory_mask,
            **kw,
        )
        return rows.scatter(out), self_weights, cross_weights


_SWAPS = {
    Encoder: UnpaddedEncoder,
    Decoder: UnpaddedDecoder,
    MultiHeadAttention: UnpaddedAttention,
}


def unpad_stacks(model: nn.Module) -> nn.Module:
    """Replace ``model``'s stacks and attention layers by their unpadded versions over the same
    weights (:func:`~attnkit.accel.swap.swap_modules`; see the module docstring); returns the
    model. A mixture of experts keeps the padded forward."""
    if any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return model

    def unpadded(module: nn.Module) -> nn.Module | None:
        swap = _SWAPS.get(type(module))
        return None if swap is None else rebuilt(swap, module)

    return swap_modules(model, unpadded)
