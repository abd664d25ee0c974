"""The run's record: ``metrics.jsonl`` (one JSON object per line) and the loss-curve picture.

Each line is one measurement::

    {"split": "train", "step": 100, "epoch": 0, "loss": 2.31, "lr": 0.001,
     "tokens_per_s": 16400.0, "elapsed_s": 50.2}
    {"split": "validation", "step": 250, "loss": 2.05, "perplexity": 7.77, ...}

Lines are appended and flushed as they come, so the file can be read (``tail -f``) during the
run. A resumed run first drops the lines past its checkpoint's step (the work it is about to
redo), so the file always describes one continuous run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from attnkit.files import atomic_write_bytes, atomic_write_text

__all__ = ["MetricsLog", "format_time", "plot_loss_curve"]


class MetricsLog:
    """Append-only ``metrics.jsonl`` in a run directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """Every complete record (a line cut short by a crash is skipped)."""
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def truncate_after(self, step: int) -> None:
        """Keep only the records with ``step <= step`` (rewritten atomically)."""
        if not self.path.is_file():
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
        atomic_write_text(self.path, text)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def plot_loss_curve(
    records: list[dict[str, Any]], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Training loss (per logged interval) and validation loss against the step, as a PNG.

    Drawn with matplotlib's object API on the Agg canvas (no window, no pyplot state) and
    written atomically.
    """
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if r.get("split") == "train"]
    valid = [(r["step"], r["loss"]) for r in records if r.get("split") == "validation"]
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), color="#2f6fb3", linewidth=1, label="train")
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", color="#d62728", markersize=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "loss", parse_math=False)
    ax.grid(alpha=0.3)
    if train or valid:
        ax.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def format_time(seconds: float) -> str:
    """12m05s, or 1h02m05s from an hour on (for progress lines)."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"
