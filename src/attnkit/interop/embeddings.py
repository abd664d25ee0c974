"""Sentence embeddings from an encoder, the sentence-transformers recipe (all-MiniLM-L6-v2)::

    h = EncoderModel(tokens(s))                         (N, D) hidden states, [CLS] ... [SEP]
    e(s) = normalize( sum_t m_t h_t / sum_t m_t )       mean over the real tokens (m: the mask)
    cos(s_i, s_j) = e(s_i) . e(s_j)                     unit vectors: the dot product

Padding never enters the mean, so a sentence gets the same embedding alone or in a batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.models import EncoderClassifier, EncoderModel

__all__ = ["cosine_similarities", "max_seq_length", "mean_pool", "sentence_embeddings"]


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """The mean of the real tokens' vectors: hidden (B, N, D), mask (B, N) -> (B, D)."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, N, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def sentence_embeddings(
    model: nn.Module,
    tokenizer,
    sentences: Sequence[str],
    *,
    max_length: int | None = None,
    batch_size: int = 32,
) -> Tensor:
    """L2-normalised mean-pooled embeddings (S, D) of ``sentences``, on the model's device.

    ``model``: an EncoderModel (or an EncoderClassifier, whose encoder is used); ``tokenizer``:
    its tokenizer (a PretrainedTokenizer adds [CLS] / [SEP]); ``max_length``: tokens per
    sentence at most (default: the model's max_len).
    """
    if isinstance(model, EncoderClassifier):
        model = model.encoder
    if not isinstance(model, EncoderModel):
        raise TypeError(
            f"sentence_embeddings needs an encoder (EncoderModel), got {type(model).__name__}"
        )
    if isinstance(sentences, str) or not sentences:
        raise ValueError("sentence_embeddings: give a non-empty list of sentences")
    limit = min(max_length or model.cfg.max_len, model.cfg.max_len)
    pad = getattr(tokenizer, "pad_id", None)
    pad = model.cfg.pad_id if pad is None else pad
    device = next(model.parameters()).device  # the ids are made on the CPU
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = [_encode(tokenizer, s, limit) for s in sentences[start : start + batch_size]]
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # right padding
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = True
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            hidden = model(ids, mask)  # (B, N, D)
        out.append(F.normalize(mean_pool(hidden, mask), p=2, dim=-1))
    return torch.cat(out)  # (S, D)


def _encode(tokenizer, sentence: str, limit: int) -> list[int]:
    try:
        ids = tokenizer.encode(sentence, max_length=limit)
    except TypeError:  # attnkit's own tokenizers: no special tokens, no max_length
        ids = tokenizer.encode(sentence)[:limit]
    if not ids:
        raise ValueError(f"sentence_embeddings: {sentence!r} gives no tokens")
    return ids


def cosine_similarities(embeddings: Tensor) -> Tensor:
    """(S, S) cosine similarities of the rows of ``embeddings`` (S, D)."""
    unit = F.normalize(embeddings, p=2, dim=-1)
    return unit @ unit.T


def max_seq_length(path: str | os.PathLike[str]) -> int | None:
    """The ``max_seq_length`` of a sentence-transformers directory
    (``sentence_bert_config.json``), or None."""
    config = Path(path) / "sentence_bert_config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_seq_length")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
