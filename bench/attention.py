"""Forward time and peak extra memory of causal attention as the sequence grows.

Compares, in one process on the same inputs (B=1, 8 heads, d_k=64, causal):

- attnkit's math path (materialises the N x N scores: memory grows as N^2),
- attnkit's fused path (torch's fused kernel: no N x N matrix, memory grows as N),
- torch.nn.MultiheadAttention (d_model=512, 8 heads; includes its input and output
  projections, which attnkit's two rows do not).

Peak memory is the growth of the process's resident set (Linux VmHWM, reset through
/proc/self/clear_refs) during one forward call, above what the inputs already hold.

    python bench/attention.py [--lengths 512,1024,2048,4096] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import attnkit as ak
from attnkit.accel import return_freed_memory
from attnkit.explain.complexity import peak_extra_mib

B, H, D_K = 1, 8, 64


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def run(lengths: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(H * D_K, H, batch_first=True).eval()
    rows = []
    for n in lengths:
        q, k, v = (torch.randn(B, H, n, D_K) for _ in range(3))
        x = torch.randn(B, n, H * D_K)
        blocked = ~ak.causal_mask(n)  # torch.nn.MultiheadAttention: True = blocked
        candidates = {
            "attnkit math": lambda q=q, k=k, v=v: ak.scaled_dot_product_attention(
                q, k, v, is_causal=True, implementation="math"
            ),
            "attnkit fused": lambda q=q, k=k, v=v: ak.scaled_dot_product_attention(
                q, k, v, is_causal=True, implementation="sdpa"
            ),
            "torch.nn.MultiheadAttention": lambda x=x, blocked=blocked: mha(
                x, x, x, attn_mask=blocked, need_weights=False, is_causal=True
            )[0],
        }
        with torch.no_grad():
            for name, fn in candidates.items():
                reps = max(1, repeats // 2) if (name == "attnkit math" and n >= 4096) else repeats
                rows.append(
                    {
                        "n": n,
                        "implementation": name,
                        "forward_ms": median_ms(fn, reps),
                        "peak_extra_mib": peak_extra_mib(fn),
                    }
                )
                print(_format_row(rows[-1]), flush=True)
    return rows


def _format_row(row: dict) -> str:
    mem = row["peak_extra_mib"]
    mem_text = "n/a" if mem is None else f"{mem:10.1f}"
    return f"{row['n']:>6}  {row['implementation']:<28}  {row['forward_ms']:10.2f}  {mem_text:>10}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="sequence lengths N")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per cell")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    print(
        f"causal attention forward, B={B}, heads={H}, d_k={D_K}, float32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(f"{'N':>6}  {'implementation':<28}  {'forward ms':>10}  {'peak MiB':>10}")
    # large blocks in their own mappings and freed pages handed back, so that a call's peak of
    # resident memory is its own (as in ``attnkit explain complexity``)
    with return_freed_memory():
        rows = run(lengths, args.repeats)
    by = {(r["n"], r["implementation"]): r for r in rows}
    print("\nratios at each N (fused over math; >1 = fused faster / smaller):")
    for n in lengths:
        math_row, fused_row = by[(n, "attnkit math")], by[(n, "attnkit fused")]
        speed = math_row["forward_ms"] / fused_row["forward_ms"]
        mem = ""
        if math_row["peak_extra_mib"] and fused_row["peak_extra_mib"]:
            mem = f", memory {math_row['peak_extra_mib'] / fused_row['peak_extra_mib']:.1f}x"
        print(f"  N={n:>5}: speed {speed:.2f}x{mem}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
