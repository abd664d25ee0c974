"""Label-smoothed cross entropy, averaged over real tokens only.

Section 5.4 of the paper: "During training, we employed label smoothing of value eps_ls = 0.1.
This hurts perplexity, as the model learns to be more unsure, but improves accuracy and BLEU
score." The one-hot target y is replaced by a mixture of it and the uniform distribution over
the V classes::

    q(k) = (1 - eps) * [k == y] + eps / V                       (the smoothed target)
    loss = -sum_k q(k) log p(k)
         = (1 - eps) * (-log p(y)) + eps * mean_k(-log p(k))    (p = softmax(logits))

This is ``torch.nn.functional.cross_entropy(..., label_smoothing=eps)``'s convention (the
uniform share eps / V goes to every class, the true one included); eps = 0 is ordinary cross
entropy. Positions whose target is ``ignore_index`` (padding) count for nothing: the result is
the mean over the real positions only, and a batch with no real position at all gives a loss of
exactly 0 with zero gradients, never NaN (the Annotated Transformer's version divides by zero
there). The log-softmax always runs in float32, even on bf16 logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["label_smoothed_cross_entropy", "smoothed_targets"]


def _check(logits: Tensor, targets: Tensor, smoothing: float) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 2:
        raise ValueError(
            "label_smoothed_cross_entropy: logits must be a float tensor (..., V), got "
            f"{type(logits).__name__ if not isinstance(logits, Tensor) else tuple(logits.shape)}"
        )
    if not isinstance(targets, Tensor) or targets.is_floating_point():
        raise TypeError("label_smoothed_cross_entropy: targets must be an integer tensor")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"label_smoothed_cross_entropy: targets must have shape logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if isinstance(smoothing, bool) or not isinstance(smoothing, int | float):
        raise TypeError(
            f"label_smoothed_cross_entropy: smoothing must be a float, got {smoothing!r}"
        )
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(
            f"label_smoothed_cross_entropy: smoothing must be in [0, 1), got {smoothing!r}"
        )


def smoothed_targets(targets: Tensor, vocab_size: int, smoothing: float) -> Tensor:
    """The smoothed target distribution q, (..., V): ``(1 - eps) * one_hot(y) + eps / V``.

    Every row sums to 1. For illustration and tests; the loss never builds this tensor.
    """
    one_hot = F.one_hot(targets.long(), vocab_size).to(torch.float32)  # (..., V)
    return (1.0 - smoothing) * one_hot + smoothing / vocab_size


def label_smoothed_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    smoothing: float = 0.0,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """``-sum_k q(k) log softmax(logits)(k)`` per position, reduced over the real positions.

    ``logits`` (..., V) and ``targets`` (...) with ids in [0, V); positions where
    ``targets == ignore_index`` are left out. ``reduction``: ``"mean"`` (over real positions;
    0 when there are none), ``"sum"``, or ``"none"`` (per position, 0 at ignored ones).
    """
    _check(logits, targets, smoothing)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"label_smoothed_cross_entropy: reduction must be 'mean', 'sum' or 'none', "
            f"got {reduction!r}"
        )
    vocab_size = logits.shape[-1]
    if ignore_index is None:
        real = torch.ones_like(targets, dtype=torch.bool)
    else:
        real = targets != ignore_index  # (...), True on the positions that count
    safe_targets = torch.where(real, targets, 0).long()  # an ignored id may be out of range
    if bool(((safe_targets < 0) | (safe_targets >= vocab_size)).any()):
        bad = int(safe_targets[(safe_targets < 0) | (safe_targets >= vocab_size)][0])
        raise ValueError(
            f"label_smoothed_cross_entropy: target id {bad} is outside [0, {vocab_size})"
        )
    log_p = F.log_softmax(logits.float(), dim=-1)  # (..., V), float32 whatever the logits' dtype
    nll = -log_p.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)  # (...): -log p(y)
    loss = nll if smoothing == 0 else (1.0 - smoothing) * nll - smoothing * log_p.mean(dim=-1)
    loss = torch.where(real, loss, torch.zeros_like(loss))  # (...), 0 at ignored positions
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / real.sum().clamp(min=1)  # mean over real positions; 0 / 1 when there are none
