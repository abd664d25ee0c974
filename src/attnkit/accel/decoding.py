"""Weights laid out for decoding: one-row products over (in, out) rows.

A decoding step is a matrix-vector product per layer. With the weight stored as (in, out) rows,
``F.linear`` hands torch's GEMM the contiguous (in, out) matrix and the product streams it row
after row (``y += x_k * W^T[k, :]``), which on the CPUs measured (bench/history/) runs faster
than over the (out, in) layout (Hugging Face's GPT-2 stores its weights as (in, out) ``Conv1D``s).

``accel.prepare(model, "decoding")`` lays a model out once (:func:`lay_out_for_decoding`), for a
model that only decodes from then on (the server, ``attnkit generate``); ``generate`` called on
a model nobody prepared lays it out for the call alone (:func:`decoding_layout`), so that a
model still in training keeps its layout. A weight already laid out is left as it is.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from attnkit.accel.switch import Switch

__all__ = ["decoding_layout", "decoding_layouts", "lay_out_for_decoding"]

_switch = Switch("ATTNKIT_DECODING_LAYOUT")


def decoding_layouts(enabled: bool):
    """Turn :func:`decoding_layout` on or off inside a ``with`` block (benchmarks and tests
    compare both). The default is on; ``ATTNKIT_DECODING_LAYOUT=0`` turns it off."""
    return _switch(enabled)


def _weights(module: nn.Module) -> list:
    """Every ``nn.Linear`` weight of ``module`` in the (out, in) layout, a tied one once."""
    weights = {id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Linear)}
    return [w for w in weights.values() if w.dim() == 2 and w.is_contiguous()]


def _transpose_layout(weights: list) -> None:
    for w in weights:
        w.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)


def lay_out_for_decoding(module: nn.Module) -> nn.Module:
    """Store every ``nn.Linear`` weight of ``module`` as (in, out) rows from now on (the same
    (out, in) tensor and values; see the module docstring), once, in place; returns the
    module. Saving still writes the usual layout (``save_pretrained``); training such a model
    works but its products run slower."""
    if _switch.on:
        _transpose_layout(_weights(module))
    return module


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
    changed = _weights(module)  # none where the model was laid out already
    try:
        _transpose_layout(changed)
        yield
    finally:
        for w in changed:
            w.data = w.data.contiguous()
