"""Comparing greedy tokens across implementations, aware of near-ties.

Two correct implementations (eager and compiled, attnkit and Hugging Face) sum floats in
different orders; where a step's best two logits are closer than that rounding, either token is
right, and a CPU with other kernels may pick the other one. ``greedy_ties`` accepts a row whose
tokens first part at such a near-tie (and does not compare the row after it), fails on any other
difference, and returns how many rows it accepted so that the caller can assert it is rare.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

NOISE = 1e-4  # float32 noise on a logit, relative to its size (at least 1)


def greedy_ties(expected: Tensor, got: Tensor, logits_at: Callable[[int, int], Tensor]) -> int:
    """``expected`` and ``got`` (B, L) token rows; ``logits_at(b, i)`` the reference's logits
    (V,) that chose ``expected[b, i]``. Returns the number of rows accepted at a near-tie."""
    assert expected.shape == got.shape, (tuple(expected.shape), tuple(got.shape))
    ties = 0
    for b in range(expected.shape[0]):
        differ = (expected[b] != got[b]).nonzero()
        if differ.numel() == 0:
            continue
        i = int(differ[0])
        best, second = logits_at(b, i).float().topk(2).values.tolist()
        gap = best - second
        assert gap <= NOISE * max(1.0, abs(best)), (
            f"row {b}: token {i} is {int(got[b, i])}, expected {int(expected[b, i])}, "
            f"and the best two logits are {gap:.3g} apart (no near-tie)"
        )
        ties += 1
    return ties


def lm_logits_at(model, tokens: Tensor, mask: Tensor | None = None):
    """``logits_at`` for a DecoderLM's greedy rows ``tokens`` (B, L) (with their mask)."""

    def logits_at(b: int, i: int) -> Tensor:
        with torch.no_grad():
            row_mask = None if mask is None else mask[b : b + 1, :i]
            return model(tokens[b : b + 1, :i], row_mask)[0, -1]

    return logits_at
