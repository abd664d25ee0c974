"""Where the explain tools read and change a model: its stacks of layers, each layer's residual
stream, and each attention head's output before W^O.

Everything here uses PyTorch's public forward hooks, registered for one call by the caller that
asks for them (the ``with`` blocks below) and removed on leaving, so the model code stays plain.
A head's output is the slice ``[h * d_head, (h + 1) * d_head)`` of the input of the attention's
``out_proj``: ``MultiHeadAttention`` computes ``Concat(head_1, ..., head_h) W^O`` with that
layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor, nn

__all__ = [
    "attention_modules",
    "capture_head_outputs",
    "capture_outputs",
    "find_stack",
    "replace_head_output",
    "replace_layer_input",
]


def _stacks(model: nn.Module) -> dict[str, nn.ModuleList]:
    from attnkit.stacks import Decoder, Encoder

    found: dict[str, nn.ModuleList] = {}
    for module in model.modules():
        if isinstance(module, Encoder):
            found.setdefault("encoder", module.layers)
        elif isinstance(module, Decoder):
            found.setdefault("decoder", module.layers)
    return found


def find_stack(model: nn.Module, stack: str | None, owner: str) -> tuple[str, nn.ModuleList]:
    """The layers of ``model``'s ``"encoder"`` or ``"decoder"`` stack; ``None`` picks the only
    one, or the decoder of an encoder-decoder."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner}: model must be an attnkit model, got {type(model).__name__}")
    found = _stacks(model)
    if not found:
        raise TypeError(
            f"{owner}: model must be an attnkit model with an encoder or decoder stack, "
            f"got {type(model).__name__}"
        )
    if stack is None:
        stack = "decoder" if "decoder" in found else "encoder"
    if stack not in found:
        raise ValueError(f"{owner}: stack must be one of {sorted(found)}, got {stack!r}")
    return stack, found[stack]


def attention_modules(layers: nn.ModuleList, attention: str, owner: str) -> list[nn.Module]:
    """Each layer's ``self_attn`` or ``cross_attn`` (``attention`` = "self" or "cross")."""
    if attention not in ("self", "cross"):
        raise ValueError(f"{owner}: attention must be 'self' or 'cross', got {attention!r}")
    modules = [getattr(layer, f"{attention}_attn", None) for layer in layers]
    if any(m is None for m in modules):
        raise ValueError(f"{owner}: attention='{attention}', but this stack has no such attention")
    return modules


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def capture_outputs(modules) -> Iterator[list[Tensor | None]]:
    """Within the block, ``streams[i]`` is the latest output of ``modules[i]`` (the first element
    when a module returns a tuple, as the layers do: their new residual stream)."""
    streams: list[Tensor | None] = [None] * len(modules)

    def hook(i):
        def record(module, args, output):
            streams[i] = _first(output).detach()

        return record

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield streams
    finally:
        for h in handles:
            h.remove()


def _heads(attn: nn.Module, x: Tensor) -> Tensor:
    return x.unflatten(-1, (attn.n_heads, x.shape[-1] // attn.n_heads))  # (..., N, H, d_head)


@contextlib.contextmanager
def capture_head_outputs(attns) -> Iterator[list[Tensor | None]]:
    """Within the block, ``heads[l]`` is the latest per-head output of ``attns[l]`` before W^O:
    (B, N, H, d_head)."""
    heads: list[Tensor | None] = [None] * len(attns)

    def hook(i):
        def record(module, args):
            heads[i] = _heads(attns[i], args[0]).detach().clone()

        return record

    handles = [a.out_proj.register_forward_pre_hook(hook(i)) for i, a in enumerate(attns)]
    try:
        yield heads
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replace_head_output(attn: nn.Module, head: int, value: Callable[[Tensor], Tensor]):
    """Within the block, head ``head`` of ``attn`` outputs ``value(its output)`` instead of its
    output (both (B, N, d_head)), before W^O mixes the heads."""

    def swap(module, args):
        x = _heads(attn, args[0]).clone()
        x[..., head, :] = value(x[..., head, :])
        return (x.flatten(-2), *args[1:])

    handle = attn.out_proj.register_forward_pre_hook(swap)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def replace_layer_input(layer: nn.Module, position: int, value: Tensor):
    """Within the block, the residual stream entering ``layer`` at ``position`` is ``value``
    (B, D): the other positions are left as they are."""

    def swap(module, args, kwargs):
        x = args[0].clone()
        x[:, position] = value
        return (x, *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(swap, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
