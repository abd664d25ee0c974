"""Weights laid out for decoding: one-row products over (in, out) rows.

A decoding step is a matrix-vector product per layer. With the weight stored as (in, out) rows,
``F.linear`` hands torch's GEMM the contiguous (in, out) matrix and the product streams it row
after row (``y += x_k * W^T[k, :]``), which on the CPUs measured (bench/history/) runs faster
than over the (out, in) layout (Hugging Face's GPT-2 stores its weights as (in, out) ``Conv1D``s).

``accel.prepare(model, "decoding")`` lays a model out once (:func:`lay_out_for_decoding`), for a
model that decodes from then on (the server, ``attnkit generate``); a model nobody prepared
decodes with the layout it has. A weight already laid out is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit.accel.switch import Switch

__all__ = ["decoding_layouts", "lay_out_for_decoding"]

# decoding_layouts(False) holds the lever off inside a with block (ATTNKIT_DECODING_LAYOUT=0: off)
decoding_layouts = _switch = Switch("ATTNKIT_DECODING_LAYOUT")


def lay_out_for_decoding(module: nn.Module) -> nn.Module:
    """Give every ``nn.Linear`` of ``module`` a new weight stored as (in, out) rows: the same
    (out, in) tensor and values, strides (1, out) (see the module docstring); a tied weight is
    replaced everywhere it is held, so it stays tied. Returns the module. Saving still writes
    the usual layout (``save_pretrained``); training such a model works but runs slower."""
    if not _switch.on:
        return module
    old = {id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Linear)}
    new = {
        key: nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
        for key, w in old.items()
        if w.dim() == 2 and w.is_contiguous()
    }
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) in new:
            owner, _, leaf = name.rpartition(".")
            with torch.no_grad():
                setattr(module.get_submodule(owner), leaf, new[id(param)])
    return module
