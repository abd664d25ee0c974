"""Module swaps: a lever that changes a model replaces some of its modules by new ones, built by
the lever's classes, in their parents (as torchao's ``quantize_`` and torchtitan's
``convert_to_float8_training`` do). No module changes class in place.

``swap_modules(model, build)`` walks the model and, for every module ``m`` for which
``build(m)`` returns a module, sets that new module where ``m`` was, in every parent that holds
it (a module shared by two parents is built once). ``rebuilt(cls, m)`` is the usual ``build``:
a new ``cls`` instance that holds ``m``'s own parameters, buffers, submodules and settings, the
same tensors (nothing is copied, a tied weight stays tied).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["rebuilt", "swap_modules", "swap_named"]


def rebuilt(cls: type[nn.Module], module: nn.Module) -> nn.Module:
    """A new ``cls`` module with ``module``'s state: ``cls`` must be a subclass of
    ``type(module)`` that adds methods, not state (``UnpaddedEncoder`` of
    ``Encoder``)."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"rebuilt: {cls.__name__} is not a subclass of {type(module).__name__}")
    new = cls.__new__(cls)
    # the registries (_parameters, _buffers, _modules, hooks) as new dicts over the same values
    new.__dict__.update(
        {k: v.copy() if isinstance(v, dict) else v for k, v in vars(module).items()}
    )
    return new


def swap_modules(model: nn.Module, build: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """Replace each module ``m`` of ``model`` for which ``build(m)`` is not None by what it
    returns (see the module docstring); returns the model, or its replacement if ``build``
    replaced the model itself."""
    done: dict[int, nn.Module | None] = {}

    def replacement(module: nn.Module) -> nn.Module | None:
        if id(module) not in done:
            done[id(module)] = build(module)
        return done[id(module)]

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
    root = replacement(model)
    return model if root is None else root


def swap_named(model: nn.Module, new: dict[str, nn.Module]) -> nn.Module:
    """:func:`swap_modules` for the modules of ``model`` named by ``new``'s keys (as
    ``named_modules`` names them), each replaced by its value."""
    modules = dict(model.named_modules())
    by_id = {id(modules[name]): module for name, module in new.items()}
    return swap_modules(model, lambda m: by_id.get(id(m)))
