r"""Why attention divides by sqrt(d_k): the paper's footnote 4, measured.

The derivation. Let the components of a query q and a key k be independent, with mean 0 and
variance 1. Their dot product ``q . k = sum_i q_i k_i`` is a sum of d_k independent terms, each
with mean 0 and variance ``E[q_i^2] E[k_i^2] = 1``, so::

    E[q . k] = 0,        Var[q . k] = d_k.

The scores grow like sqrt(d_k). Softmax turns scores z into weights ``p = softmax(z)``, whose
Jacobian is::

    dp_i / dz_j = p_i (delta_ij - p_j),      J = diag(p) - p p^T.

When the scores are spread far apart, p is nearly one-hot and every entry of J is nearly 0: the
softmax saturates and almost no gradient flows back through it ("pushing the softmax function
into regions where it has extremely small gradients", footnote 4). Dividing the scores by
sqrt(d_k) brings their variance back to 1 whatever d_k is:
``Var[q . k / sqrt(d_k)] = 1``, and the softmax stays soft.

``scaling_experiment`` checks both halves with random vectors: it measures Var[q . k] for each
d_k, and runs rows of raw and scaled scores through ``attnkit.scaled_dot_product_attention``
(``scale=1.0`` is the raw, unscaled variant; the default is ``1 / sqrt(d_k)``) to compare the
largest weight, the entropy and the norm of the softmax Jacobian.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnkit.attention import scaled_dot_product_attention
from attnkit.explain._checks import check_positive_int
from attnkit.explain.fonts import font_context
from attnkit.explain.plots import new_figure, save_figure

__all__ = [
    "DEFAULT_D_KS",
    "ScalingRow",
    "SoftmaxStats",
    "dot_product_variance",
    "format_scaling_table",
    "plot_scaling",
    "scaling_experiment",
    "softmax_jacobian",
    "softmax_stats",
]

DEFAULT_D_KS = (4, 16, 64, 256, 512)


@dataclass(frozen=True)
class SoftmaxStats:
    """How peaked a batch of softmax rows is; each number is over the rows.

    logit_std: standard deviation of the numbers the softmax sees (raw: about sqrt(d_k)).
    max_weight: mean of each row's largest weight (1 / M = uniform, 1 = one-hot).
    entropy: mean entropy of a row in nats, ``-sum_j p_j log p_j`` (log M = uniform, 0 = one-hot).
    jacobian_median, jacobian_mean: the median and the mean of the rows' Frobenius norms
        ``||diag(p) - p p^T||_F``: how much gradient the softmax passes back (0 = none).
    """

    logit_std: float
    max_weight: float
    entropy: float
    jacobian_median: float
    jacobian_mean: float


@dataclass(frozen=True)
class ScalingRow:
    """One d_k: the measured Var[q . k], and the softmax of raw and of scaled scores."""

    d_k: int
    var_qk: float
    n_keys: int
    unscaled: SoftmaxStats
    scaled: SoftmaxStats

    @property
    def var_ratio(self) -> float:
        """Measured Var[q . k] / d_k; the derivation says 1."""
        return self.var_qk / self.d_k


# --------------------------------------------------------------------------------------------
# The two measurements
# --------------------------------------------------------------------------------------------


def dot_product_variance(
    d_k: int, *, samples: int = 50_000, generator: torch.Generator | None = None
) -> float:
    """The sample variance of q . k over ``samples`` pairs of standard normal q, k in R^{d_k}.

    The derivation gives d_k. The estimate's relative standard error is about
    ``sqrt((2 + 6 / d_k) / samples)`` (q . k has fourth moment 3 d_k^2 + 6 d_k), 0.8% for
    d_k = 4 and 50,000 samples, so 5% is six standard errors away.
    """
    check_positive_int("dot_product_variance", "d_k", d_k)
    check_positive_int("dot_product_variance", "samples", samples)
    dots = []
    for start in range(0, samples, 10_000):  # chunks keep memory small at d_k = 512
        count = min(10_000, samples - start)
        q = torch.randn(count, d_k, generator=generator)  # (S, d_k)
        k = torch.randn(count, d_k, generator=generator)  # (S, d_k)
        dots.append((q * k).sum(dim=-1, dtype=torch.float64))  # (S,), summed in float64
    return float(torch.cat(dots).var())


def softmax_jacobian(weights: Tensor) -> Tensor:
    """The softmax Jacobian ``J = diag(p) - p p^T`` of each row p: (..., M) -> (..., M, M).

    ``J[..., i, j] = dp_i / dz_j`` where ``p = softmax(z)``.
    """
    return torch.diag_embed(weights) - weights.unsqueeze(-1) * weights.unsqueeze(-2)


def softmax_stats(weights: Tensor, logits: Tensor) -> SoftmaxStats:
    """Summarise softmax rows ``weights`` (R, M) computed from ``logits`` (R, M)."""
    if weights.dim() != 2 or weights.shape != logits.shape:
        raise ValueError(
            f"softmax_stats: weights and logits must both have shape (R, M), got "
            f"{tuple(weights.shape)} and {tuple(logits.shape)}"
        )
    entropy = -torch.xlogy(weights, weights).sum(dim=-1)  # (R,); 0 log 0 = 0
    jacobian_norm = softmax_jacobian(weights).flatten(1).norm(dim=-1)  # (R,)
    return SoftmaxStats(
        logit_std=float(logits.std()),
        max_weight=float(weights.max(dim=-1).values.mean()),
        entropy=float(entropy.mean()),
        jacobian_median=float(jacobian_norm.median()),
        jacobian_mean=float(jacobian_norm.mean()),
    )


def scaling_experiment(
    d_ks: Sequence[int] = DEFAULT_D_KS,
    *,
    n_keys: int = 32,
    n_queries: int = 512,
    samples: int = 50_000,
    seed: int = 0,
) -> list[ScalingRow]:
    """For each d_k: Var[q . k], and raw vs scaled softmax of ``n_queries`` rows of scores.

    Each row is one random query against its own ``n_keys`` random keys (standard normal
    entries, in float32 as models use; the statistics are taken in float64). The weights come
    from ``attnkit.scaled_dot_product_attention`` with ``scale=1.0`` (raw ``q . k``) and with
    its default ``1 / sqrt(d_k)``. Every d_k draws from its own generator, seeded from ``seed``
    and d_k, so one row does not depend on which others are asked for.
    """
    owner = "scaling_experiment"
    if isinstance(d_ks, int) or not isinstance(d_ks, Sequence) or len(d_ks) == 0:
        raise ValueError(f"{owner}: d_ks must be a non-empty list of ints, got {d_ks!r}")
    for d_k in d_ks:
        check_positive_int(owner, "each d_k", d_k)
    for name, value in (("n_keys", n_keys), ("n_queries", n_queries), ("samples", samples)):
        check_positive_int(owner, name, value)
    if n_queries < 2:
        raise ValueError(f"{owner}: n_queries must be at least 2 (a median and a std), got 1")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{owner}: seed must be an int, got {seed!r}")

    rows = []
    for d_k in d_ks:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + d_k)
        var_qk = dot_product_variance(d_k, samples=samples, generator=generator)
        q = torch.randn(n_queries, 1, d_k, generator=generator)  # (R, 1, d_k)
        k = torch.randn(n_queries, n_keys, d_k, generator=generator)  # (R, M, d_k)
        v = torch.zeros(n_queries, n_keys, 1)  # (R, M, 1): only the weights are used
        raw_scores = (q @ k.transpose(-2, -1)).squeeze(1)  # (R, M), for logit_std only
        stats = {}
        for name, scale in (("unscaled", 1.0), ("scaled", 1.0 / math.sqrt(d_k))):
            _, weights = scaled_dot_product_attention(q, k, v, scale=scale, return_weights=True)
            weights = weights.squeeze(1).to(torch.float64)  # (R, M)
            stats[name] = softmax_stats(weights, raw_scores.to(torch.float64) * scale)
        rows.append(ScalingRow(d_k, var_qk, n_keys, stats["unscaled"], stats["scaled"]))
    return rows


# --------------------------------------------------------------------------------------------
# A table and a picture
# --------------------------------------------------------------------------------------------


def format_scaling_table(rows: Sequence[ScalingRow]) -> str:
    """The experiment as a plain-text table, "raw" = softmax(q . k), "scaled" = /sqrt(d_k)."""
    if not rows or not all(isinstance(r, ScalingRow) for r in rows):
        raise ValueError("format_scaling_table: rows must be a non-empty list of ScalingRow")
    header = [
        "d_k",
        "Var[q.k]",
        "/d_k",
        "max w raw",
        "scaled",
        "entropy raw",
        "scaled",
        "|J| med raw",
        "scaled",
        "|J| mean raw",
        "scaled",
    ]
    body = []
    for r in rows:
        u, s = r.unscaled, r.scaled
        body.append(
            [
                str(r.d_k),
                f"{r.var_qk:.1f}",
                f"{r.var_ratio:.3f}",
                f"{u.max_weight:.3f}",
                f"{s.max_weight:.3f}",
                f"{u.entropy:.3f}",
                f"{s.entropy:.3f}",
                f"{u.jacobian_median:.4f}",
                f"{s.jacobian_median:.4f}",
                f"{u.jacobian_mean:.4f}",
                f"{s.jacobian_mean:.4f}",
            ]
        )
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
        for line in [header, *body]
    ]
    m = rows[0].n_keys
    title = (
        f"Var[q.k] = d_k for unit-variance q, k; and one query's softmax over {m} keys, raw "
        f"(q.k) and scaled (q.k / sqrt(d_k))"
    )
    notes = (
        f"max w: the largest weight (1/{m} = {1 / m:.3f} uniform, 1 one-hot). entropy in nats "
        f"(log {m} = {math.log(m):.3f} uniform, 0 one-hot).\n"
        "|J|: Frobenius norm of the softmax Jacobian diag(p) - p p^T, the gradient it passes "
        "back; near 0 = saturated."
    )
    return "\n".join([title, "", *lines, "", notes])


def plot_scaling(
    rows: Sequence[ScalingRow], path: str | os.PathLike[str], *, dpi: int = 100
) -> Path:
    """Write the experiment as a 2 x 2 panel PNG (10 x 7.5 inches); return the path.

    Panels: measured Var[q . k] against the line d_k; the largest weight; the entropy; the
    Jacobian norm (median solid, mean dashed); raw and scaled scores in each.
    """
    owner = "plot_scaling"
    if not rows or not all(isinstance(r, ScalingRow) for r in rows):
        raise ValueError(f"{owner}: rows must be a non-empty list of ScalingRow")
    check_positive_int(owner, "dpi", dpi)
    d = np.array([r.d_k for r in rows], dtype=float)
    raw, scaled = "#d62728", "#2f6fb3"
    with font_context():
        figure = new_figure(10.0, 7.5, dpi)
        (ax_var, ax_max), (ax_ent, ax_jac) = figure.subplots(2, 2)

        ax_var.loglog(d, d, "--", color="#999999", label="d_k (the derivation)")
        ax_var.loglog(d, [r.var_qk for r in rows], "o", color=raw, label="measured Var[q.k]")
        ax_var.loglog(d, np.ones_like(d), ":", color=scaled, label="after / sqrt(d_k): 1")
        ax_var.set_title("Var[q . k] grows like d_k")
        ax_var.set_ylabel("variance")

        ax_max.plot(d, [r.unscaled.max_weight for r in rows], "o-", color=raw, label="raw")
        ax_max.plot(d, [r.scaled.max_weight for r in rows], "o-", color=scaled, label="scaled")
        ax_max.axhline(1.0 / rows[0].n_keys, ls=":", color="#999999", label="uniform")
        ax_max.set_ylim(0.0, 1.05)
        ax_max.set_title("largest softmax weight")

        ax_ent.plot(d, [r.unscaled.entropy for r in rows], "o-", color=raw, label="raw")
        ax_ent.plot(d, [r.scaled.entropy for r in rows], "o-", color=scaled, label="scaled")
        ax_ent.axhline(math.log(rows[0].n_keys), ls=":", color="#999999", label="uniform")
        ax_ent.set_ylim(bottom=0.0)
        ax_ent.set_title("entropy of the weights (nats)")

        for stats, color, name in (("unscaled", raw, "raw"), ("scaled", scaled, "scaled")):
            med = [getattr(r, stats).jacobian_median for r in rows]
            mean = [getattr(r, stats).jacobian_mean for r in rows]
            ax_jac.plot(d, med, "o-", color=color, label=f"{name}, median")
            ax_jac.plot(d, mean, "s--", color=color, alpha=0.6, label=f"{name}, mean")
        ax_jac.set_ylim(bottom=0.0)
        ax_jac.set_title("|| diag(p) - p p^T ||_F: gradient through softmax")

        for ax in (ax_var, ax_max, ax_ent, ax_jac):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("d_k")
            ax.legend(fontsize=8)
        figure.suptitle(f"Why scores are divided by sqrt(d_k) (one query, {rows[0].n_keys} keys)")
        return save_figure(figure, path, owner)
