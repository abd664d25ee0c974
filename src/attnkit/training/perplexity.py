"""Perplexity of a language model over a text, measured as llama.cpp's ``llama-perplexity``
measures it, so that the two figures compare.

The text's tokens are cut into consecutive windows of ``context`` tokens (the first token of
each replaced by BOS when the model has one). In each window only the second half is scored:
the log-probability of token j + 1 given tokens 0..j, for j from ``context // 2`` to
``context - 2``, so every scored token sees at least half a window of context. Then

    PPL = exp(mean over the scored tokens of -log p(token | context))

and its uncertainty is the standard error of that mean, carried through the exponential
(PPL * stderr), as llama.cpp reports "PPL = X +/- Y".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Perplexity", "perplexity"]


@dataclass(frozen=True)
class Perplexity:
    """The result: ``value`` = exp(mean NLL), ``error`` its standard error, over ``tokens``
    scored tokens in ``windows`` windows of ``context`` tokens."""

    value: float
    error: float
    nll: float
    tokens: int
    windows: int
    context: int

    def __str__(self) -> str:
        return (
            f"perplexity {self.value:.4f} +/- {self.error:.4f} ({self.tokens:,} tokens scored "
            f"in {self.windows} windows of {self.context})"
        )


@torch.no_grad()
def perplexity(
    model,
    ids: Sequence[int] | Tensor,
    *,
    context: int = 512,
    windows: int | None = None,
    bos_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Perplexity:
    """The perplexity of ``model`` (a :class:`attnkit.DecoderLM`) over the token ids ``ids``.

    ``context``: the window length (at most the model's ``max_len``); ``windows``: score only
    the first so many (default: every whole window of the text); ``bos_id``: the token that
    replaces each window's first (default the model's ``bos_id``; None keeps the text's).
    ``progress(done, total)`` is called after each window.
    """
    from attnkit.models import DecoderLM

    owner = "perplexity"
    if not isinstance(model, DecoderLM):
        raise TypeError(
            f"{owner}: model must be a decoder-only language model (attnkit.DecoderLM), "
            f"got {type(model).__name__}"
        )
    if isinstance(context, bool) or not isinstance(context, int) or context < 4:
        raise ValueError(f"{owner}: context must be an int >= 4, got {context!r}")
    if context > model.cfg.max_len:
        raise ValueError(
            f"{owner}: context={context} is longer than the model's {model.cfg.max_len} positions"
        )
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    available = ids.numel() // context
    if available == 0:
        raise ValueError(
            f"{owner}: the text has {ids.numel()} tokens, fewer than one window of {context}"
        )
    if windows is not None and (isinstance(windows, bool) or not isinstance(windows, int)
                                or windows < 1):  # fmt: skip
        raise ValueError(f"{owner}: windows must be a positive int, got {windows!r}")
    count = available if windows is None else min(windows, available)
    bos_id = model.cfg.bos_id if bos_id is None else bos_id
    device = next(model.parameters()).device
    first = context // 2
    nll = []
    for w in range(count):
        window = ids[w * context : (w + 1) * context].clone()
        if bos_id is not None:
            window[0] = bos_id
        logits = model(window[None].to(device))[0, first:-1].float()  # predicts first+1..end
        logp = torch.log_softmax(logits, dim=-1)
        targets = window[first + 1 :].to(device)
        nll.append(-logp.gather(-1, targets[:, None])[:, 0].double().cpu())
        if progress is not None:
            progress(w + 1, count)
    losses = torch.cat(nll)
    mean = float(losses.mean())
    n = losses.numel()
    stderr = float(losses.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    value = math.exp(mean)
    return Perplexity(value, value * stderr, mean, n, count, context)
