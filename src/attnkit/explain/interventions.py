"""Causal tests of what a model uses: head ablation and activation patching.

An attention map says where a head looks; these say whether the answer depends on it.

- **Head ablation** replaces one head's output (before W^O) by zeros, or by its mean over every
  position of the batch, and reports how a metric changes.
- **Activation patching** (Vig et al., 2020; Meng et al., 2022; TransformerLens's
  ``patching``) runs the model on a *corrupted* input, with one activation copied from the run
  on the *clean* input, and reports the metric of each patched run. With the notes' sentences
  "... because it was too tired" (clean) and "... too wide" (corrupted), the sites whose patch
  brings the clean answer back are where the model carries the difference.

``run`` arguments are callables that take the model and return its output, e.g.
``lambda m: m(ids)``; ``metric`` takes that output and returns a scalar tensor, e.g. a token's
log-probability: ``lambda logits: logits.log_softmax(-1)[0, -1, token]``. Every function runs
the model under ``torch.no_grad()``; put it in ``eval()`` mode first (dropout would add noise).
``progress(done, total)``, if given, is called after each patched or ablated run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnkit.explain.sites import (
    attention_modules,
    capture_head_outputs,
    find_stack,
    replace_head_output,
    replace_layer_input,
)

__all__ = ["ablate_heads", "patch_heads", "patch_residual"]

Run = Callable[[nn.Module], object]
Metric = Callable[[object], Tensor]


def _value(metric: Metric, output, owner: str) -> float:
    value = metric(output)
    if not isinstance(value, Tensor | float | int) or (
        isinstance(value, Tensor) and value.numel() != 1
    ):
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{owner}: metric must return a scalar (one number), got {got}")
    return float(value)


def _check_callables(owner: str, **callables) -> None:
    for name, f in callables.items():
        if not callable(f):
            raise TypeError(
                f"{owner}: {name} must be a callable (e.g. lambda m: m(ids)), "
                f"got {type(f).__name__}"
            )


def ablate_heads(
    model: nn.Module,
    run: Run,
    metric: Metric,
    *,
    mode: str = "zero",
    stack: str | None = None,
    attention: str = "self",
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """The change in ``metric`` when each head alone is ablated: ``(L, H)``, entry [l, h] =
    metric(run with head h of layer l ablated) - metric(run).

    ``mode``: ``"zero"`` (the head outputs zeros) or ``"mean"`` (its output at every position
    is its mean over all positions of the batch, so the head still adds its average, but nothing
    that depends on the input). ``stack``: ``"encoder"`` or ``"decoder"`` (default: the model's
    only stack, or the decoder); ``attention``: ``"self"`` or ``"cross"``.
    """
    owner = "ablate_heads"
    _check_callables(owner, run=run, metric=metric)
    if mode not in ("zero", "mean"):
        raise ValueError(f"{owner}: mode must be 'zero' or 'mean', got {mode!r}")
    _, layers = find_stack(model, stack, owner)
    attns = attention_modules(layers, attention, owner)
    with torch.no_grad():
        with capture_head_outputs(attns) as heads:
            clean = _value(metric, run(model), owner)
        n_heads = attns[0].n_heads
        deltas = torch.zeros(len(attns), n_heads, dtype=torch.float64)
        for layer, attn in enumerate(attns):
            for head in range(n_heads):
                if mode == "zero":
                    value = torch.zeros_like
                else:
                    mean = heads[layer][..., head, :].flatten(0, -2).mean(0)  # (d_head,)
                    value = lambda x, mean=mean: mean.expand_as(x)  # noqa: E731
                with replace_head_output(attn, head, value):
                    deltas[layer, head] = _value(metric, run(model), owner) - clean
                _tick(progress, layer * n_heads + head + 1, deltas.numel())
    return deltas


def patch_heads(
    model: nn.Module,
    clean: Run,
    corrupted: Run,
    metric: Metric,
    *,
    stack: str | None = None,
    attention: str = "self",
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """Activation patching of head outputs: ``(L, H)``, entry [l, h] = metric of the corrupted
    run in which head h of layer l outputs what it output in the clean run (at every position).
    The same as TransformerLens's ``get_act_patch_attn_head_out_all_pos``."""
    owner = "patch_heads"
    _check_callables(owner, clean=clean, corrupted=corrupted, metric=metric)
    _, layers = find_stack(model, stack, owner)
    attns = attention_modules(layers, attention, owner)
    with torch.no_grad():
        with capture_head_outputs(attns) as clean_heads:
            clean(model)
        with capture_head_outputs(attns[:1]) as corrupted_heads:
            corrupted(model)
        _same_shape(owner, clean_heads[0], corrupted_heads[0], "head outputs")
        n_heads = attns[0].n_heads
        result = torch.zeros(len(attns), n_heads, dtype=torch.float64)
        for layer, attn in enumerate(attns):
            for head in range(n_heads):
                saved = clean_heads[layer][..., head, :]
                with replace_head_output(attn, head, lambda x, saved=saved: saved):
                    result[layer, head] = _value(metric, corrupted(model), owner)
                _tick(progress, layer * n_heads + head + 1, result.numel())
    return result


def patch_residual(
    model: nn.Module,
    clean: Run,
    corrupted: Run,
    metric: Metric,
    *,
    stack: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """Activation patching of the residual stream: ``(L, N)``, entry [l, p] = metric of the
    corrupted run in which the stream entering layer l at position p is the clean run's. The
    same as TransformerLens's ``get_act_patch_resid_pre``."""
    owner = "patch_residual"
    _check_callables(owner, clean=clean, corrupted=corrupted, metric=metric)
    _, layers = find_stack(model, stack, owner)
    layers = list(layers)
    with torch.no_grad():
        clean_inputs = _capture_inputs(layers, clean, model)
        corrupted_inputs = _capture_inputs(layers[:1], corrupted, model)
        _same_shape(owner, clean_inputs[0], corrupted_inputs[0], "residual streams")
        n = clean_inputs[0].shape[1]
        result = torch.zeros(len(layers), n, dtype=torch.float64)
        for layer, module in enumerate(layers):
            for position in range(n):
                with replace_layer_input(module, position, clean_inputs[layer][:, position]):
                    result[layer, position] = _value(metric, corrupted(model), owner)
                _tick(progress, layer * n + position + 1, result.numel())
    return result


def _tick(progress, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)


def _capture_inputs(layers, run: Run, model) -> list[Tensor]:
    inputs: list[Tensor | None] = [None] * len(layers)

    def hook(i):
        def record(module, args):
            inputs[i] = args[0].detach().clone()

        return record

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        run(model)
    finally:
        for h in handles:
            h.remove()
    return inputs


def _same_shape(owner: str, clean: Tensor | None, corrupted: Tensor | None, what: str) -> None:
    if clean is None or corrupted is None:
        raise ValueError(f"{owner}: the clean or corrupted run did not go through the model")
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"{owner}: the clean and corrupted runs must have the same shape (the same number "
            f"of tokens), got {what} of shape {tuple(clean.shape)} and {tuple(corrupted.shape)}"
        )
