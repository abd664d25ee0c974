"""Weights laid out for decoding: one-row products over (in, out) rows.

A decoding step is a matrix-vector product per layer. With the weight stored as (in, out) rows,
``F.linear`` hands torch's GEMM the contiguous (in, out) matrix and the product streams it row
after row (``y += x_k * W^T[k, :]``), which on the CPUs measured (bench/history/) runs faster
than over the (out, in) layout (Hugging Face's GPT-2 stores its weights as (in, out) ``Conv1D``s).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from attnkit.accel.switch import Switch

__all__ = ["decoding_layout", "decoding_layouts"]

_switch = Switch("ATTNKIT_DECODING_LAYOUT")


def decoding_layouts(enabled: bool):
    """Turn :func:`decoding_layout` on or off inside a ``with`` block (benchmarks and tests
    compare both). The default is on; ``ATTNKIT_DECODING_LAYOUT=0`` turns it off."""
    return _switch(enabled)


@contextmanager
def decoding_layout(module: nn.Module):
    """Inside the block the weight of every ``nn.Linear`` of ``module`` is stored transposed:
    the same (out, in) tensor, the same values, laid out in memory as (in, out) rows.

    The layout is changed in place, one weight at a time (no second copy of the model), and
    restored when the block ends; the weights must not be trained or saved inside it.
    """
    if not _switch.on:
        yield
        return
    weights = {id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Linear)}
    changed = []
    try:
        for w in weights.values():  # a tied weight (LM head = embedding) once
            if w.dim() == 2 and w.is_contiguous():
                w.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)
                changed.append(w)
        yield
    finally:
        for w in changed:
            w.data = w.data.contiguous()
