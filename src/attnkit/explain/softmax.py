"""The softmax of one row of scores and the causal mask, as tables (``attnkit explain --scores``
and ``--causal``): the notes' first worked examples."""

from __future__ import annotations

import math

import torch

from attnkit.attention import causal_mask, scaled_dot_product_attention
from attnkit.tables import format_table

__all__ = ["explain_causal", "explain_softmax"]


def explain_softmax(scores: list[float], tokens: list[str], d_k: int | None = None) -> str:
    """The softmax of one row of scores as a table: score, (scaled), exp, weight, and the sum.

    The weights come from attnkit's own attention (the math path): one query q = [1] against
    keys k_j = [s_j] with scale 1 makes the scores exactly s_j (or s_j / sqrt(d_k)).
    """
    scale = 1.0 if d_k is None else 1.0 / math.sqrt(d_k)
    q = torch.ones(1, 1, dtype=torch.float64)  # (N=1, d=1)
    k = torch.tensor(scores, dtype=torch.float64).unsqueeze(1)  # (M, 1)
    v = torch.eye(len(scores), dtype=torch.float64)  # (M, M): out = the weights themselves
    _, weights = scaled_dot_product_attention(q, k, v, scale=scale, return_weights=True)
    scaled = [s * scale for s in scores]
    exps = [math.exp(s) for s in scaled]
    header = ["token", "score"] + ([f"score/sqrt({d_k})"] if d_k else []) + ["exp", "weight"]
    rows = []
    for token, s, sc, e, w in zip(tokens, scores, scaled, exps, weights[0].tolist(), strict=True):
        rows.append([token, f"{s:.4f}"] + ([f"{sc:.4f}"] if d_k else []) + [f"{e:.4f}", f"{w:.4f}"])
    rows.append(
        ["sum", ""] + ([""] if d_k else []) + [f"{sum(exps):.4f}", f"{sum(weights[0]):.4f}"]
    )
    formula = "weight_j = exp(s_j) / sum_i exp(s_i)"
    if d_k:
        formula = f"s_j = score_j / sqrt(d_k), d_k = {d_k};  " + formula
    return f"softmax over {len(scores)} scores ({formula})\n\n" + format_table(header, rows)


def explain_causal(n: int, tokens: list[str]) -> str:
    """The causal mask of size n, as it is added to the scores: 0 = may attend, -inf = blocked."""
    mask = causal_mask(n)
    header = ["query \\ key", *tokens]
    rows = [
        [tokens[i], *("0" if allowed else "-inf" for allowed in mask[i].tolist())] for i in range(n)
    ]
    title = (
        f"causal mask, {n} x {n}: query i may attend to keys j <= i "
        "(0 is added to allowed scores, -inf to blocked ones, so softmax gives them weight 0)"
    )
    return title + "\n\n" + format_table(header, rows)
