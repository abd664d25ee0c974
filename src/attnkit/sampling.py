"""Choosing the next token by sampling: ``softmax(logits / temperature)``, restricted to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``
(nucleus sampling). ``generate``, the server and speculative decoding draw from the same
distribution."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sample_next", "sampling_probabilities"]


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row of logits (B, V): ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens and to the smallest set whose probability reaches
    ``top_p`` (nucleus sampling); the most likely token always stays in."""
    probs = sampling_probabilities(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


def sampling_probabilities(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """The distribution :func:`sample_next` draws from (B, V): ``softmax(logits /
    temperature)`` restricted by ``top_k`` and ``top_p``."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        drop_sorted = before >= top_p  # the first token has 0 before it: always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
