"""Padded positions skipped by the layers' products: each stack runs on its real tokens only.

A padded batch (B, N) of sequences with L_1, ..., L_B real tokens spends B N rows of every
product, where T = sum L_b would do. Padding cannot change a real token's output (see
``attnkit.varlen``). So ``unpad_stacks(model)`` (a module swap, like
:func:`~attnkit.accel.fuse_lm_loss`) gives the model's encoder and decoder stacks a forward that

1. gathers the T real rows of x (B, N, D) into (1, T, D) once, before the first layer
   (``varlen.Rows``: where they are, as index and as packed sequences);
2. runs every layer on those rows, telling each layer's attention where the sequences are
   (``rows=``, the explicit variable-length input of ``MultiHeadAttention``). Attention takes
   them as B sequences packed one after another where its fused kernel has a packed form
   (attnkit's C kernel, ``accel.use_attention_kernel``: it reads each sequence's rows where
   they lie, and a decoder's causal mask counts positions within its sequence); elsewhere
   (RoPE, ALiBi, window or linear attention, grouped key/value heads, dropout on the weights,
   the kernel off) it scatters q, k and v into the padded layout around the usual call;
3. scatters the last layer's rows back into (B, N, D), zeros at the padding.

This is the "unpadding" of BERT implementations and FlashAttention's variable-length kernels.
Every real token's output and gradient is the one the padded stack gives (to float rounding:
the products add the same numbers in another order); what comes out at a padded position is
zero instead of a value nothing reads. With dropout, the random draws fall differently on the
rows, which changes no distribution.

A batch without padding (no mask) runs the same way, its B N rows as B sequences of N: the same
attention, and the kernel's gradient comes back in the projection's own layout, so the backward
joins no dq, dk and dv (a ``cat`` per layer). The stacks keep their padded forward where
nothing is gained or something would change: a mask that is not a key padding mask, a cache
(decoding), attention weights asked for, and a mixture of experts (whose load-balancing loss
counts the padded tokens too): ``unpad_stacks`` leaves such a model as it is.
``unpadding(False)`` or ``ATTNKIT_UNPAD=0`` turns it all off.
"""

from __future__ import annotations

from torch import nn

from attnkit.accel.swap import rebuilt, swap_modules
from attnkit.accel.switch import Switch
from attnkit.layers import MoEFeedForward
from attnkit.stacks import Decoder, Encoder
from attnkit.varlen import Rows, key_padding

__all__ = ["UnpaddedDecoder", "UnpaddedEncoder", "unpad_stacks", "unpadding"]

# unpadding(False) holds the lever off inside a with block (ATTNKIT_UNPAD=0: off)
unpadding = _switch = Switch("ATTNKIT_UNPAD")


def _packs(mask, x) -> bool:
    """Whether a stack's input x (B, N, D) with ``mask`` runs as packed rows: no mask, or a key
    padding mask."""
    return mask is None or key_padding(mask, x)


class UnpaddedEncoder(Encoder):
    """An encoder stack over the real rows of a padded batch (see the module docstring)."""

    def forward(self, x, *, mask=None, positions=None, return_attention=False, rows=None):
        if rows is not None or not _packs(mask, x) or return_attention or not _switch.on:
            return super().forward(
                x, mask=mask, positions=positions, return_attention=return_attention, rows=rows
            )
        rows = Rows.of(mask, x)
        out, attentions = super().forward(rows.gather(x), mask=mask, positions=positions, rows=rows)
        return rows.scatter(out), attentions


class UnpaddedDecoder(Decoder):
    """A decoder stack over the real rows of a padded batch, its memory (the encoder output)
    too (see the module docstring)."""

    def forward(self, x, memory=None, *, self_mask=None, memory_mask=None, cache=None, **kw):
        padded = (
            not _packs(self_mask, x)
            or cache is not None
            or kw.get("return_attention")
            or kw.get("rows") is not None
            or (memory is not None and not _packs(memory_mask, memory))
        )
        if padded or not _switch.on:
            return super().forward(
                x, memory, self_mask=self_mask, memory_mask=memory_mask, cache=cache, **kw
            )
        rows = Rows.of(self_mask, x)
        source = None if memory is None else Rows.of(memory_mask, memory)
        out, self_weights, cross_weights = super().forward(
            rows.gather(x),
            None if memory is None else source.gather(memory),
            self_mask=self_mask,
            memory_mask=memory_mask,
            rows=rows,
            memory_rows=source,
            **kw,
        )
        return rows.scatter(out), self_weights, cross_weights


_SWAPS = {Encoder: UnpaddedEncoder, Decoder: UnpaddedDecoder}


def unpad_stacks(model: nn.Module) -> nn.Module:
    """Replace ``model``'s encoder and decoder stacks by their unpadded versions over the same
    weights (:func:`~attnkit.accel.swap.swap_modules`; see the module docstring); returns the
    model. A mixture of experts keeps the padded forward."""
    if any(isinstance(m, MoEFeedForward) for m in model.modules()):
        return model

    def unpadded(module: nn.Module) -> nn.Module | None:
        swap = _SWAPS.get(type(module))
        return None if swap is None else rebuilt(swap, module)

    return swap_modules(model, unpadded)
