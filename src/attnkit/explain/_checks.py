"""Input checks shared by the explain modules: errors name the function, the argument, what was
received and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["as_array", "check_positive_int", "check_tokens"]


def as_array(x, owner: str, name: str, ndim: int, shape_hint: str) -> np.ndarray:
    """A float64 numpy copy of ``x``, with ``ndim`` dims and all finite.

    ``x`` may be a tensor, a numpy array, a nested list of numbers, or a list of equally shaped
    tensors (stacked along a new first axis: a list of per-layer tensors).
    """
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
    elif isinstance(x, list | tuple) and x and all(isinstance(e, torch.Tensor) for e in x):
        shapes = {tuple(e.shape) for e in x}  # a list of per-layer tensors: stack them
        if len(shapes) != 1:
            raise ValueError(
                f"{owner}: {name} is a list of tensors of different shapes {sorted(shapes)}; "
                f"expected one shape, stacking to {shape_hint}"
            )
        t = torch.stack([e.detach().to("cpu") for e in x])
    else:
        try:
            t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{owner}: {name} must be a tensor, array or nested list of numbers {shape_hint}, "
                f"got {type(x).__name__} ({error})"
            ) from None
    if t.is_complex():
        raise TypeError(f"{owner}: {name} must be real numbers, got dtype {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{owner}: {name} must have shape {shape_hint}, got {tuple(t.shape)}")
    array = t.to(torch.float64).numpy().copy()
    if not np.isfinite(array).all():
        raise ValueError(f"{owner}: {name} must be finite, got NaN or inf values")
    return array


def check_tokens(tokens, owner: str, name: str, count: int, what: str) -> list[str]:
    """``tokens`` as a list of exactly ``count`` strings; ``what`` says where ``count`` comes from,
    e.g. ``"weights of shape (4, 5) has N=4 query rows"``."""
    if isinstance(tokens, str) or not isinstance(tokens, Sequence):
        raise TypeError(f"{owner}: {name} must be a list of strings, got {type(tokens).__name__}")
    bad = [t for t in tokens if not isinstance(t, str)]
    if bad:
        raise TypeError(
            f"{owner}: {name} must be a list of strings, got {type(bad[0]).__name__} {bad[0]!r}"
        )
    if len(tokens) != count:
        raise ValueError(f"{owner}: {name} has {len(tokens)} tokens, but {what}")
    return list(tokens)


def check_positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value
