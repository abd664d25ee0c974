"""Attention cost against sequence length: math, fused, window (w=256) and linear attention.

Forward and forward + backward time and peak memory for N = 256 ... 16384 (each variant until
its time budget runs out), a table, the fitted exponents of N, and a log-log PNG. The same as
`attnkit explain complexity`.

    python bench/complexity.py [--budget 60] [--png runs/bench/complexity.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from attnkit.explain.complexity import (
    fit_slopes,
    format_complexity_table,
    measure_complexity,
    plot_complexity,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing")
    parser.add_argument("--png", type=Path, default=Path("runs/bench/complexity.png"))
    parser.add_argument("--json", type=Path, help="also write the rows and slopes as JSON")
    args = parser.parse_args()
    rows = measure_complexity(
        budget_s=args.budget,
        threads=args.threads,
        progress=lambda r: print(f"  {r.variant} N={r.n} done", flush=True),
    )
    slopes = fit_slopes(rows)
    print(format_complexity_table(rows, slopes, threads=args.threads))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plot_complexity(rows, args.png)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"rows": [dataclasses.asdict(r) for r in rows], "slopes": slopes}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
