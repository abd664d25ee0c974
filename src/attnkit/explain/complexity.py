"""How attention's cost grows with the sequence length N, measured.

Four ways to compute causal self-attention over the same q, k, v (B=1, 8 heads, d_k=64):

- ``math``: the explicit formula, which builds the N x N scores: time and memory O(N^2);
- ``fused``: torch's fused kernel: still O(N^2) time, but O(N) memory (no N x N matrix);
- ``window``: sliding-window attention, w=256, computed in blocks: O(N w) time and memory;
- ``linear``: linear attention, elu(x)+1 features, running sums: O(N) time and memory.

Each is timed (forward, and forward + backward) for growing N until its time budget runs
out; peak memory is the growth of the process's resident set during the call (Linux). The
slope of log(time) against log(N) is the exponent: about 2 for the quadratic paths, about 1
for window and linear attention.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.accel.memory import return_freed_memory
from attnkit.attention import scaled_dot_product_attention
from attnkit.backends import linear_attention, sliding_window_attention

__all__ = [
    "ComplexityRow",
    "fit_slopes",
    "format_complexity_table",
    "measure_complexity",
    "peak_extra_mib",
    "plot_complexity",
]

HEADS, D_K, WINDOW = 8, 64, 256
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _variants(window: int) -> dict[str, Callable]:
    return {
        "math": lambda q, k, v: scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="math"
        ),
        "fused": lambda q, k, v: scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="sdpa"
        ),
        "window": lambda q, k, v: sliding_window_attention(q, k, v, window, causal=True),
        "linear": lambda q, k, v: linear_attention(q, k, v, causal=True),
    }


VARIANTS = tuple(_variants(WINDOW))


@dataclass
class ComplexityRow:
    variant: str
    n: int
    forward_ms: float
    backward_ms: float  # forward + backward
    peak_mib: float | None  # extra resident memory of one forward + backward


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_extra_mib(fn: Callable[[], object]) -> float | None:
    """Resident memory that ``fn()`` adds at its peak, in MiB (None off Linux)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current size
    except OSError:
        return None
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    if before is None or peak is None:
        return None
    return max(0, peak - before) / 1024


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure_complexity(
    variants: Sequence[str] = VARIANTS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    budget_s: float = 60.0,
    window: int = WINDOW,
    repeats: int = 3,
    max_scores_gib: float = 4.0,
    threads: int | None = None,
    progress: Callable[[ComplexityRow], None] | None = None,
) -> list[ComplexityRow]:
    """Time and memory of each variant at each length, until its ``budget_s`` is spent (or, for
    the math path, until its N x N scores would pass ``max_scores_gib``). ``threads`` sets
    torch's thread count for the measurement (1 gives steadier slopes on a busy machine)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # large blocks in their own mappings, freed pages returned: resident-set peaks then mean
    # something (glibc would otherwise keep freed pages resident after raising its threshold)
    try:
        with return_freed_memory():
            return _measure(variants, lengths, budget_s, window, repeats, max_scores_gib, progress)
    finally:
        torch.set_num_threads(previous)


def _measure(variants, lengths, budget_s, window, repeats, max_scores_gib, progress):
    fns = _variants(window)
    unknown = sorted(set(variants) - set(fns))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(fns)}")
    rows = []
    for name in variants:
        fn, spent = fns[name], 0.0
        for n in sorted(lengths):
            if name == "math" and 2 * HEADS * n * n * 4 / 2**30 > max_scores_gib:
                break
            if spent > budget_s:
                break
            start = time.perf_counter()
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, HEADS, n, D_K, generator=g) for _ in range(3))
            with torch.no_grad():
                fn(q, k, v)  # warm-up
                forward = _median_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), repeats)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def both(fn=fn, qg=qg, kg=kg, vg=vg):
                fn(qg, kg, vg).sum().backward()

            backward = _median_ms(both, max(1, repeats - 1))
            peak = peak_extra_mib(both)
            row = ComplexityRow(name, n, forward, backward, peak)
            rows.append(row)
            if progress is not None:
                progress(row)
            spent += time.perf_counter() - start
    return rows


def fit_slopes(rows: Sequence[ComplexityRow], min_n: int = 1024) -> dict[str, dict[str, float]]:
    """Least-squares slope of log(cost) on log(N), per variant, over N >= min_n (smaller N are
    dominated by fixed overheads): the exponent of N in the cost."""

    def slope(xs, ys):
        if len(xs) < 2:
            return float("nan")
        lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
        mx, my = statistics.mean(lx), statistics.mean(ly)
        den = sum((x - mx) ** 2 for x in lx)
        return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / den

    slopes = {}
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name and r.n >= min_n]
        with_mem = [r for r in mine if r.peak_mib]
        slopes[name] = {
            "forward": slope([r.n for r in mine], [r.forward_ms for r in mine]),
            "backward": slope([r.n for r in mine], [r.backward_ms for r in mine]),
            "memory": slope([r.n for r in with_mem], [r.peak_mib for r in with_mem]),
        }
    return slopes


def format_complexity_table(
    rows: Sequence[ComplexityRow], slopes: dict | None = None, threads: int | None = None
) -> str:
    threads = torch.get_num_threads() if threads is None else threads
    lines = [
        f"causal self-attention, B=1, {HEADS} heads, d_k={D_K}, float32, "
        f"{threads} thread(s) (window w={WINDOW})",
        "",
        f"{'variant':<8} {'N':>6} {'forward ms':>11} {'fwd+bwd ms':>11} {'peak MiB':>9}",
    ]
    for r in rows:
        mem = "n/a" if r.peak_mib is None else f"{r.peak_mib:.1f}"
        lines.append(
            f"{r.variant:<8} {r.n:>6} {r.forward_ms:>11.2f} {r.backward_ms:>11.2f} {mem:>9}"
        )
    if slopes:
        lines += ["", "fitted exponent of N (N >= 1024): time ~ N^a, memory ~ N^b"]
        lines.append(f"{'variant':<8} {'a forward':>10} {'a fwd+bwd':>10} {'b memory':>9}")
        for name, s in slopes.items():
            lines.append(
                f"{name:<8} {s['forward']:>10.2f} {s['backward']:>10.2f} {s['memory']:>9.2f}"
            )
    return "\n".join(lines)


def plot_complexity(rows: Sequence[ComplexityRow], path: str | Path) -> Path:
    """Log-log plots of time and memory against N, one line per variant (PNG)."""
    from matplotlib.figure import Figure

    from attnkit.explain.plots import save_figure

    fig = Figure(figsize=(11, 4.5), dpi=100)
    ax_t, ax_m = fig.subplots(1, 2)
    for name in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == name]
        ax_t.plot([r.n for r in mine], [r.backward_ms for r in mine], "o-", label=name)
        mem = [r for r in mine if r.peak_mib]
        if mem:
            ax_m.plot([r.n for r in mem], [r.peak_mib for r in mem], "o-", label=name)
    for ax, title, unit in ((ax_t, "forward + backward time", "ms"), (ax_m, "peak memory", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_lines():
            ax.legend()
        else:  # e.g. no peak memory was measured
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("attention cost against sequence length (log-log: slope = exponent)")
    fig.tight_layout()
    return save_figure(fig, path, "plot_complexity")
