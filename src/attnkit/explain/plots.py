"""Pictures of the paper's objects, as PNG or SVG files: attention weights, masks, positions,
the schedule.

Every function takes plain tensors (or nested lists, or numpy arrays) and token lists, so it
works for any model, writes one file atomically (a temporary file, then ``os.replace``): SVG
for a name ending in ``.svg`` (vector, for papers), PNG otherwise. It returns the path:

- ``plot_attention_heatmap``: one (N, M) weight matrix, row i = how query i spreads its
  attention over the M keys (each row sums to 1).
- ``plot_attention_heads``: the H heads of one layer side by side, (H, N, M).
- ``plot_mask``: a bool (N, M) mask (causal, padding, or both), True = may attend.
- ``plot_sinusoidal_table``: the paper's positional encoding table (section 3.5).
- ``plot_schedule``: the paper's learning-rate schedule with warm-up (section 5.3).

Pictures are drawn with matplotlib's object API (``matplotlib.figure.Figure`` and the Agg
canvas), never pyplot: no window, no global figure state, and the caller's backend is left
alone. Chinese tokens render when a CJK font is installed (see :mod:`attnkit.explain.fonts`).
Token text is never parsed as mathtext, so a token such as ``$x$`` is drawn as it is.
A figure of ``figsize`` inches at ``dpi`` is exactly ``figsize * dpi`` pixels (no tight crop).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from attnkit.explain._checks import as_array, check_positive_int, check_tokens
from attnkit.explain.fonts import font_context
from attnkit.files import atomic_path
from attnkit.position import sinusoidal_table

__all__ = [
    "plot_attention_heads",
    "plot_attention_heatmap",
    "plot_mask",
    "plot_schedule",
    "plot_sinusoidal_table",
    "warmup_schedule",
]

PathLike = str | os.PathLike[str]

_MAX_LABELS = 64  # more tokens than this on an axis: label every k-th one


# --------------------------------------------------------------------------------------------
# Figures and files
# --------------------------------------------------------------------------------------------


def _label(token: str, width: int = 16) -> str:
    """How a token is printed on an axis: whitespace made visible, long ones cut, never empty."""
    if token == "":
        return "∅"
    if not token.strip():
        return "␣" * min(len(token), width)
    token = token.replace("\n", "\\n").replace("\t", "\\t")
    return token if len(token) <= width else token[: width - 1] + "…"


def new_figure(width: float, height: float, dpi: int) -> Figure:
    """A figure of exactly width x height inches, laid out so that labels fit inside."""
    return Figure(figsize=(width, height), dpi=dpi, layout="constrained")


FORMATS = {".png": "png", ".svg": "svg"}


def save_figure(figure: Figure, path: PathLike, owner: str) -> Path:
    """Write ``figure`` to ``path`` atomically, as SVG (vector, for papers) when the name ends in
    ``.svg`` and as PNG otherwise; return the path."""
    fmt = FORMATS.get(Path(path).suffix.lower(), "png")
    with atomic_path(path, owner) as tmp:
        # an SVG without its date is the same file for the same figure
        extra = {"metadata": {"Date": None}} if fmt == "svg" else {}
        figure.savefig(tmp, format=fmt, dpi=figure.dpi, **extra)
    return Path(path)


def _token_axis(ax, axis: str, tokens: list[str], fontsize: float) -> None:
    """Label an axis with tokens (every k-th if there are many), never parsed as mathtext."""
    step = max(1, math.ceil(len(tokens) / _MAX_LABELS))
    ticks = list(range(0, len(tokens), step))
    labels = [_label(tokens[i]) for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize, parse_math=False)
    else:
        ax.set_yticks(ticks, labels, fontsize=fontsize, parse_math=False)


def _side(count: int) -> float:
    """Inches for an axis of ``count`` tokens: 0.45 inch each, within 3 to 14 inches."""
    return min(14.0, max(3.0, 0.45 * count))


def _fontsize(count: int) -> float:
    return max(5.0, min(10.0, 220.0 / max(count, 1)))


# --------------------------------------------------------------------------------------------
# Attention weights
# --------------------------------------------------------------------------------------------


def _draw_weights(ax, weights: np.ndarray, query_tokens, key_tokens, annotate: bool):
    """One weight matrix on ``ax``: rows are queries, columns are keys."""
    vmax = max(float(weights.max()), 1e-12)
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
    _token_axis(ax, "x", key_tokens, _fontsize(len(key_tokens)))
    _token_axis(ax, "y", query_tokens, _fontsize(len(query_tokens)))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if annotate:
        for i, row in enumerate(weights):
            for j, w in enumerate(row):
                color = "black" if w > 0.6 * vmax else "white"
                ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=7, color=color)
    return image


def plot_attention_heatmap(
    weights,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    path: PathLike,
    *,
    title: str | None = None,
    annotate: bool | None = None,
    dpi: int = 100,
) -> Path:
    """Write one attention matrix as a heat map PNG; return the path.

    ``weights`` (N, M) are softmax weights, ``weights[i, j]`` = how much query token i attends to
    key token j (row i sums to 1, or is all 0 for a query that may attend to nothing). The
    colour scale runs from 0 to the largest weight. ``annotate`` prints each weight in its cell
    (default: when N and M are both at most 16).
    """
    owner = "plot_attention_heatmap"
    w = as_array(weights, owner, "weights", 2, "(N, M)")
    n, m = w.shape
    query_tokens = check_tokens(
        query_tokens, owner, "query_tokens", n, f"weights of shape {w.shape} has N={n} query rows"
    )
    key_tokens = check_tokens(
        key_tokens, owner, "key_tokens", m, f"weights of shape {w.shape} has M={m} key columns"
    )
    check_positive_int(owner, "dpi", dpi)
    annotate = (n <= 16 and m <= 16) if annotate is None else annotate
    texts = [*query_tokens, *key_tokens, title or ""]
    with font_context(texts):
        figure = new_figure(_side(m) + 2.2, _side(n) + 1.6, dpi)
        ax = figure.add_subplot()
        image = _draw_weights(ax, w, query_tokens, key_tokens, annotate)
        figure.colorbar(image, ax=ax, label="attention weight", shrink=0.8)
        if title:
            ax.set_title(title, parse_math=False)
        return save_figure(figure, path, owner)


def plot_attention_heads(
    weights,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str] | None,
    path: PathLike,
    *,
    title: str | None = None,
    columns: int = 4,
    dpi: int = 100,
) -> Path:
    """Write the H heads of one layer, (H, N, M), as a grid of heat maps; return the path.

    ``key_tokens=None`` means self-attention: the keys are the query tokens. Each head has its
    own colour scale (0 to its largest weight), since heads differ a lot in how peaked they are.
    """
    owner = "plot_attention_heads"
    w = as_array(weights, owner, "weights", 3, "(H, N, M)")
    h, n, m = w.shape
    query_tokens = check_tokens(
        query_tokens, owner, "query_tokens", n, f"weights of shape {w.shape} has N={n} query rows"
    )
    key_tokens = query_tokens if key_tokens is None else key_tokens
    key_tokens = check_tokens(
        key_tokens, owner, "key_tokens", m, f"weights of shape {w.shape} has M={m} key columns"
    )
    check_positive_int(owner, "columns", columns)
    check_positive_int(owner, "dpi", dpi)
    cols = min(columns, h)
    rows = math.ceil(h / cols)
    cell_w = min(5.0, max(2.2, 0.22 * m + 1.2))
    cell_h = min(5.0, max(2.2, 0.22 * n + 1.2))
    with font_context([*query_tokens, *key_tokens, title or ""]):
        figure = new_figure(cols * cell_w, rows * cell_h + (0.4 if title else 0.0), dpi)
        axes = figure.subplots(rows, cols, squeeze=False)
        for head in range(rows * cols):
            ax = axes[head // cols][head % cols]
            if head >= h:
                ax.set_axis_off()
                continue
            _draw_weights(ax, w[head], query_tokens, key_tokens, annotate=False)
            ax.set_title(f"head {head}", fontsize=9)
            ax.set_xlabel("")
            ax.set_ylabel("")
            # Tokens only on the outer edge of the grid: the left column, the lowest row.
            ax.tick_params(labelleft=head % cols == 0, labelbottom=head + cols >= h)
        if title:
            figure.suptitle(title, parse_math=False)
        return save_figure(figure, path, owner)


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def plot_mask(
    mask,
    tokens: Sequence[str],
    path: PathLike,
    *,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Write a bool attention mask (N, M) as a picture; return the path.

    **True = may attend** (attnkit's convention): such a cell adds 0 to the score; a False cell
    adds -inf, so softmax gives it weight 0. ``tokens`` label the N queries, and the M keys too
    unless ``key_tokens`` are given. For a padding mask of shape (B, 1, 1, M) pass one row,
    ``mask[b, 0].expand(N, M)``, combined with a causal mask if you like
    (``padding & ak.causal_mask(N)``).
    """
    owner = "plot_mask"
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        raise TypeError(
            f"{owner}: mask must be a bool tensor (True = may attend), got {mask.dtype}"
        )
    m_array = as_array(mask, owner, "mask", 2, "(N, M)")
    if not np.isin(m_array, (0.0, 1.0)).all():
        raise ValueError(f"{owner}: mask must hold only True/False, got other values")
    allowed = m_array.astype(bool)
    n, m = allowed.shape
    query_tokens = check_tokens(
        tokens, owner, "tokens", n, f"mask of shape {allowed.shape} has N={n} query rows"
    )
    keys = query_tokens if key_tokens is None else key_tokens
    keys = check_tokens(
        keys, owner, "key_tokens", m, f"mask of shape {allowed.shape} has M={m} key columns"
    )
    check_positive_int(owner, "dpi", dpi)
    with font_context([*query_tokens, *keys, title or ""]):
        figure = new_figure(_side(m) + 1.8, _side(n) + 2.0, dpi)
        ax = figure.add_subplot()
        colors = ListedColormap(["#d0d0d0", "#2f6fb3"])
        ax.imshow(allowed.astype(float), cmap=colors, vmin=0.0, vmax=1.0, aspect="auto")
        _token_axis(ax, "x", keys, _fontsize(m))
        _token_axis(ax, "y", query_tokens, _fontsize(n))
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if n <= 24 and m <= 24:
            for i in range(n):
                for j in range(m):
                    text, color = ("0", "white") if allowed[i, j] else ("-inf", "#505050")
                    ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
        handles = [
            Patch(color="#2f6fb3", label="True: may attend (+0)"),
            Patch(color="#d0d0d0", label="False: blocked (-inf)"),
        ]
        figure.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8)
        if title:
            ax.set_title(title, parse_math=False)
        return save_figure(figure, path, owner)


# --------------------------------------------------------------------------------------------
# Positions and the learning-rate schedule
# --------------------------------------------------------------------------------------------


def plot_sinusoidal_table(max_len: int, d_model: int, path: PathLike, *, dpi: int = 100) -> Path:
    """Write the paper's positional encoding table (``attnkit.sinusoidal_table``); return the path.

    Top: the whole (max_len, d_model) table, PE(pos, 2i) = sin(pos / 10000^(2i / d_model)) and
    PE(pos, 2i + 1) = cos(...). Bottom: a few of its columns as curves; the wavelength grows
    from 2 pi (i = 0) to 10000 * 2 pi along the dimensions. The figure is 9 x 8 inches.
    """
    owner = "plot_sinusoidal_table"
    check_positive_int(owner, "dpi", dpi)
    table = sinusoidal_table(max_len, d_model).numpy()  # (max_len, d_model); checks its args
    with font_context():
        figure = new_figure(9.0, 8.0, dpi)
        top, bottom = figure.subplots(2, 1, height_ratios=[3, 2])
        image = top.imshow(table, cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto")
        top.set_xlabel("dimension")
        top.set_ylabel("position")
        top.set_title(f"sinusoidal positional encoding, max_len={max_len}, d_model={d_model}")
        figure.colorbar(image, ax=top, label="PE(pos, dim)")
        dims = sorted({0, 2 * (d_model // 8), 2 * (d_model // 4), 2 * (d_model // 2) - 2})
        for dim in dims:
            bottom.plot(table[:, dim], label=f"dim {dim} (sin, i={dim // 2})")
        bottom.set_xlabel("position")
        bottom.set_ylabel("PE(pos, dim)")
        bottom.legend(fontsize=8, loc="best")
        return save_figure(figure, path, owner)


def warmup_schedule(step: int, d_model: int, warmup: int) -> float:
    """The paper's learning rate (section 5.3, eq. 3)::

        lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)

    linear warm-up for ``warmup`` steps, then decay with the inverse square root of the step;
    the peak, at ``step == warmup``, is ``(d_model * warmup)^-0.5``. Steps count from 1.
    """
    for name, value in (("step", step), ("d_model", d_model), ("warmup", warmup)):
        check_positive_int("warmup_schedule", name, value)
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def plot_schedule(d_model: int, warmup: int, steps: int, path: PathLike, *, dpi: int = 100) -> Path:
    """Write the warm-up schedule (:func:`warmup_schedule`) for steps 1..steps; return the path.

    The two branches of the ``min`` are drawn dashed, so the picture shows where each one
    rules; the peak at ``step = warmup`` is marked. The figure is 8 x 4.5 inches.
    """
    owner = "plot_schedule"
    for name, value in (("d_model", d_model), ("warmup", warmup), ("steps", steps), ("dpi", dpi)):
        check_positive_int(owner, name, value)
    step = np.arange(1, steps + 1, dtype=np.float64)
    rise = d_model**-0.5 * step * warmup**-1.5
    decay = d_model**-0.5 * step**-0.5
    rate = np.minimum(rise, decay)
    with font_context():
        figure = new_figure(8.0, 4.5, dpi)
        ax = figure.add_subplot()
        ax.plot(step, rate, color="#2f6fb3", linewidth=2, label="lrate")
        ax.plot(step, rise, "--", color="#999999", linewidth=1, label="step * warmup^-1.5 branch")
        ax.plot(step, decay, ":", color="#999999", linewidth=1, label="step^-0.5 branch")
        if warmup <= steps:
            peak = warmup_schedule(warmup, d_model, warmup)
            ax.plot([warmup], [peak], "o", color="#d62728")
            ax.annotate(
                f"peak {peak:.2e} at step {warmup}",
                (warmup, peak),
                textcoords="offset points",
                xytext=(8, 6),
            )
        ax.set_ylim(0.0, float(rate.max()) * 1.3)
        ax.set_xlabel("step")
        ax.set_ylabel("learning rate")
        ax.set_title(
            f"lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), "
            f"d_model={d_model}, warmup={warmup}",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper right")
        return save_figure(figure, path, owner)
