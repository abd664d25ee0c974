"""Learning-rate schedules: pure functions of the step, so resuming needs no scheduler state.

Steps count from 1: ``lr(step)`` is the rate of the ``step``-th optimizer update. The trainer
sets ``lr = schedule(step)`` on every parameter group before each update (the same thing as a
``torch.optim.lr_scheduler.LambdaLR`` with this multiplier, without state to save).

``noam`` (section 5.3 of the paper, eq. 3)::

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

linear warm-up for ``warmup`` steps, then decay as 1 / sqrt(step); the peak at
``step == warmup`` is ``(d_model * warmup)^-0.5``. The paper uses it as the learning rate
itself (``scale = 1``, warmup = 4000, Adam with beta2 = 0.98, eps = 1e-9); ``scale`` multiplies
it.

``cosine`` (warm-up, then cosine decay to a floor; GPT-style)::

    lr(step) = peak * step / warmup                                       step <= warmup
    lr(step) = floor + (peak - floor) * (1 + cos(pi * t)) / 2             t = (step - warmup)
                                                                             / (total - warmup)
    (with warmup = 0, read warmup as 1: the first step is at the peak)
    floor = peak * min_ratio, and lr = floor after ``total`` steps.

``constant``: ``peak * min(1, step / warmup)`` (warm-up, then flat).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["SCHEDULES", "constant_lr", "cosine_lr", "make_schedule", "noam_lr"]

SCHEDULES = ("cosine", "noam", "constant")


def _check_step(who: str, step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{who}: step must be an int >= 1 (steps count from 1), got {step!r}")


def _check_positive(who: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{who}: {name} must be > 0, got {value!r}")


def noam_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """``scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (the paper's eq. 3)."""
    _check_step("noam_lr", step)
    _check_positive("noam_lr", "d_model", d_model)
    _check_positive("noam_lr", "warmup", warmup)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cosine_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, cosine decay to ``peak * min_ratio`` at
    ``total``, flat after it. ``warmup = 0`` starts at the peak."""
    _check_step("cosine_lr", step)
    _check_positive("cosine_lr", "total", total)
    if not 0 <= min_ratio <= 1:
        raise ValueError(f"cosine_lr: min_ratio must be in [0, 1], got {min_ratio!r}")
    if warmup and step <= warmup:
        return peak * step / warmup
    floor = peak * min_ratio
    if step >= total:
        return floor
    start = max(warmup, 1)  # the step at the peak
    t = (step - start) / max(1, total - start)  # in [0, 1)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def constant_lr(step: int, peak: float, warmup: int) -> float:
    """``peak * min(1, step / warmup)``; ``warmup = 0`` is the constant ``peak``."""
    _check_step("constant_lr", step)
    return peak if not warmup else peak * min(1.0, step / warmup)


def make_schedule(
    name: str,
    *,
    lr: float,
    warmup: int,
    total: int,
    d_model: int,
    min_ratio: float = 0.1,
) -> Callable[[int], float]:
    """``step -> learning rate`` for ``name`` in ``SCHEDULES``.

    ``lr`` is the peak for ``cosine`` and ``constant`` and the multiplier ``scale`` for ``noam``
    (``lr = 1`` is the paper's schedule exactly).
    """
    if name not in SCHEDULES:
        raise ValueError(f"make_schedule: name must be one of {SCHEDULES}, got {name!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"make_schedule: warmup must be an int >= 0, got {warmup!r}")
    if name == "noam":
        if warmup < 1:
            raise ValueError("make_schedule: the noam schedule needs warmup >= 1")
        return lambda step: noam_lr(step, d_model, warmup, lr)
    if name == "cosine":
        return lambda step: cosine_lr(step, lr, warmup, total, min_ratio)
    return lambda step: constant_lr(step, lr, warmup)
