"""Plain-text tables that line up on a terminal, Chinese characters (two columns wide) included."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

__all__ = ["format_table"]


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cell(text: str, width: int, align: str = "right") -> str:
    pad = " " * max(0, width - _width(text))
    return pad + text if align == "right" else text + pad


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table with the first column left-aligned and the others right-aligned."""
    columns = list(zip(header, *rows, strict=True))
    widths = [max(_width(c) for c in column) for column in columns]
    lines = []
    for row in [header, *rows]:
        cells = [
            _cell(c, w, "left" if i == 0 else "right")
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
