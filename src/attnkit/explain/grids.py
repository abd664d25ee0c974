"""Pictures of the explain methods' grids, as PNG or SVG (by the file name, as in
:mod:`attnkit.explain.plots`):

- ``plot_grid``: signed values on a grid (layer x head, layer x position), a diverging colour
  scale centred on zero: head ablation, activation patching, attributions.
- ``plot_lens``: the logit lens, layer x position, each cell the top prediction and its
  probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path

import numpy as np

from attnkit.explain._checks import as_array, check_positive_int, check_tokens
from attnkit.explain.fonts import font_context
from attnkit.explain.plots import _fontsize, _label, new_figure, save_figure

__all__ = ["plot_grid", "plot_lens"]


def _labelled_axes(ax, rows: list[str], columns: list[str]) -> None:
    size = _fontsize(max(len(rows), len(columns)))
    ax.set_xticks(range(len(columns)), [_label(c) for c in columns], rotation=60, ha="right")
    ax.set_yticks(range(len(rows)), [_label(r) for r in rows])
    ax.tick_params(labelsize=size)


def plot_grid(
    values,
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    path: PathLike,
    *,
    title: str | None = None,
    label: str = "change",
    annotate: bool | None = None,
    dpi: int = 100,
) -> Path:
    """Write an (R, C) grid of signed numbers as a heat map; return the path. Blue is negative,
    red positive, white zero; the scale is symmetric. ``annotate`` prints each value (default:
    when R and C are both at most 16)."""
    owner = "plot_grid"
    v = as_array(values, owner, "values", 2, "(R, C)")
    r, c = v.shape
    rows = check_tokens(row_labels, owner, "row_labels", r, f"values has R={r} rows")
    columns = check_tokens(column_labels, owner, "column_labels", c, f"values has C={c} columns")
    check_positive_int(owner, "dpi", dpi)
    annotate = (r <= 16 and c <= 16) if annotate is None else annotate
    limit = max(float(np.abs(v).max()), 1e-12)
    with font_context([*rows, *columns, title or ""]):
        figure = new_figure(min(14.0, 2.5 + 0.45 * c), min(14.0, 1.8 + 0.4 * r), dpi)
        ax = figure.add_subplot()
        image = ax.imshow(v, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        _labelled_axes(ax, rows, columns)
        if annotate:
            for i in range(r):
                for j in range(c):
                    dark = abs(v[i, j]) > 0.6 * limit
                    ax.text(j, i, f"{v[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")  # fmt: skip
        figure.colorbar(image, ax=ax, label=label, shrink=0.8)
        if title:
            ax.set_title(title, parse_math=False)
        return save_figure(figure, path, owner)


def plot_lens(
    probabilities,
    predictions: Sequence[Sequence[str]],
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    path: PathLike,
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Write the logit lens as a grid; return the path. ``probabilities`` (L + 1, N): the top
    prediction's probability read after each layer at each position; ``predictions`` the same
    grid of those tokens, printed in the cells."""
    owner = "plot_lens"
    p = as_array(probabilities, owner, "probabilities", 2, "(L + 1, N)")
    r, c = p.shape
    rows = check_tokens(row_labels, owner, "row_labels", r, f"probabilities has {r} rows")
    columns = check_tokens(column_labels, owner, "column_labels", c, f"probabilities has {c}")
    if len(predictions) != r or any(len(row) != c for row in predictions):
        raise ValueError(f"{owner}: predictions must be a grid of {r} x {c} tokens")
    check_positive_int(owner, "dpi", dpi)
    cells = [_label(t, 8) for row in predictions for t in row]
    with font_context([*rows, *columns, *cells, title or ""]):
        figure = new_figure(min(16.0, 2.5 + 0.8 * c), min(16.0, 1.8 + 0.35 * r), dpi)
        ax = figure.add_subplot()
        image = ax.imshow(p, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
        _labelled_axes(ax, rows, columns)
        for i in range(r):
            for j in range(c):
                ax.text(j, i, _label(predictions[i][j], 8), ha="center", va="center",
                        fontsize=6, color="white" if p[i, j] > 0.6 else "black")  # fmt: skip
        figure.colorbar(image, ax=ax, label="probability of the top token", shrink=0.8)
        if title:
            ax.set_title(title, parse_math=False)
        return save_figure(figure, path, owner)
