"""Input checks for the public boundary, in one place.

The public entry points (``ModelConfig``, ``scaled_dot_product_attention``, the models' ``forward``
and ``loss``, ``generate``, the command line) call these once; everything they call trusts its
inputs. Every error names the argument, what was received and what was expected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "attention_inputs",
    "attention_mask",
    "integer_ids",
    "is_int",
    "number_in",
    "one_of",
    "padding_mask",
    "positive_int",
    "targets",
    "token_ids",
    "tracing",
]


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the code that asks: the one place the model code
    knows about the compiler (a test holds it to this). A check that reads a tensor's values
    (is any position out of range, is anything padded) would split the traced graph in two, so
    such checks are skipped while tracing; ``generate`` checks its inputs before a compiled
    step runs."""
    return torch.compiler.is_compiling()


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is an int in Python, never a size here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` if it is an int >= minimum, else a ValueError naming ``name``."""
    if not is_int(value) or value < minimum:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def number_in(name: str, value: Any, low: float, high: float, *, closed: bool = False) -> float:
    """A real number in [low, high) (or [low, high] with ``closed``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (low <= value <= high if closed else low <= value < high):
        interval = f"[{low:g}, {high:g}]" if closed else f"[{low:g}, {high:g})"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return value


def one_of(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def integer_ids(name: str, ids: Any) -> None:
    """A tensor of integer ids (any shape)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")


def token_ids(name: str, ids: Any, vocab_size: int) -> None:
    """A non-empty (B, N) tensor of ids in [0, vocab_size)."""
    integer_ids(name, ids)
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (B, N), got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty, shape {tuple(ids.shape)}: need at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} contains token id {bad}, outside the vocabulary [0, {vocab_size})"
        )


def padding_mask(name: str, mask: Any, shape: tuple[int, int]) -> Tensor | None:
    """A (B, N) padding mask as bool (True = real token); integer 0/1 masks are accepted."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a (B, N) bool tensor, got {type(mask).__name__}")
    if mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = real token), got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape (B, N) = {tuple(shape)}, matching the ids, "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        if int(mask.min()) < 0 or int(mask.max()) > 1:
            raise ValueError(f"{name} must be bool or 0/1, got values outside {{0, 1}}")
        mask = mask.bool()
    return mask


def targets(targets: Any, ids: Tensor) -> None:
    """Training targets: integer ids of the ids' shape (their range is checked by the loss)."""
    integer_ids("targets", targets)
    if targets.shape != ids.shape:
        raise ValueError(
            f"targets must have the shape of the ids {tuple(ids.shape)}, got {tuple(targets.shape)}"
        )


def attention_mask(mask: Any, q: Tensor, k: Tensor) -> None:
    """A mask must be bool or float, on q's device, and broadcast to the scores (..., N, M)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    target = (*q.shape[:-1], k.shape[-2])  # (..., N, M)
    try:
        broadcast = torch.broadcast_shapes(mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"{target} (..., N, M)"
        )


def attention_inputs(q: Any, k: Any, v: Any, mask: Any, dropout_p: Any) -> None:
    """What ``scaled_dot_product_attention`` needs of its arguments."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., length, dim), got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"q, k, v must have the same number of dimensions, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension d_k, got q {tuple(q.shape)} "
            f"(d_k={q.shape[-1]}) and k {tuple(k.shape)} (d_k={k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length M, got k {tuple(k.shape)} (M={k.shape[-2]}) "
            f"and v {tuple(v.shape)} (M={v.shape[-2]})"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"q, k, v must have the same leading (batch, head) dimensions, got "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    number_in("dropout_p", dropout_p, 0.0, 1.0)
    attention_mask(mask, q, k)


def same_batch(src_ids: Any, tgt_ids: Any) -> None:
    """The source and the target of an encoder-decoder hold the same number of rows."""
    if isinstance(src_ids, Tensor) and isinstance(tgt_ids, Tensor):
        if src_ids.dim() >= 1 and tgt_ids.dim() >= 1 and src_ids.shape[0] != tgt_ids.shape[0]:
            raise ValueError(
                f"src_ids and tgt_ids must have the same batch size, got "
                f"{src_ids.shape[0]} and {tgt_ids.shape[0]}"
            )


def loss_options(targets: Tensor, vocab_size: int, ignore_index: int, smoothing) -> None:
    """Targets in the vocabulary (or ``ignore_index``) and a smoothing in [0, 1)."""
    number_in("smoothing", smoothing, 0.0, 1.0)
    real = targets[targets != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
        raise ValueError(f"targets: target id {bad} is outside [0, {vocab_size})")
