"""The LM head's three float32 products, one chunk of the fused loss, in each layout and GEMM.

The fused loss (``accel.linear_cross_entropy``) spends most of its time in three products per
chunk of rows h (rows x d): the logits h W^T (rows x V), dL/dh = g W and dL/dW = g^T h, where
W is the head (V x d) and g the logits' gradient. Each can be formed in another layout, or by
oneDNN instead of torch's GEMM (MKL), and which is fastest depends on the processor. This
script times, at lm-small's shape (1,024 rows a chunk, d 256, V 8,192):

- the logits as h W^T (what the loss does), as h (W^T contiguous), as (W h^T)^T (the logits
  transposed, V x rows) and by oneDNN;
- dL/dW as g^T h added into (V x d) (what the loss does without oneDNN), as h^T g added into
  (d x V), and by oneDNN as (d x V);
- dL/dh as g W (MKL) and by oneDNN;
- the three together: the loss's layout (A), and with the logits transposed (B; its g is
  V x rows), each with dL/dW by MKL and by oneDNN.

The candidates of a group alternate call by call (``--rounds`` rounds); each line gives the
median time and the median over rounds of (first candidate's time / this one's): > 1 is
faster than the loss's own layout.

    python bench/head_products.py [--rounds 25] [--threads 2] [--rows 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from attnkit import accel
from common import cpu_description

V, D = 8192, 256


def race(candidates: dict[str, Callable[[], object]], rounds: int) -> None:
    """Time the candidates in alternation; print each one's median and speed against the first."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for run in candidates.values():  # warm-up: packing buffers, page faults
        run()
        run()
    for _ in range(rounds):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    first = times[next(iter(candidates))]
    for name, spent in times.items():
        speed = statistics.median(a / b for a, b in zip(first, spent, strict=True))
        print(f"  {name:<44} {statistics.median(spent) * 1e3:8.2f} ms  {speed:6.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="calls of each candidate")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--rows", type=int, default=1024, help="rows in a chunk")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def by_onednn(a, b_t):  # (a, b) -> a b^T through oneDNN, as accel.linear calls it
        with accel.onednn_linear(True):
            return accel.linear(a, b_t)

    g = torch.Generator().manual_seed(0)
    rows = args.rows
    w = torch.randn(V, D, generator=g)
    w_t = w.t().contiguous()
    h = torch.randn(rows, D, generator=g)
    grad = torch.randn(rows, V, generator=g)  # g, the loss's layout
    grad_t = grad.t().contiguous()  # g^T, layout B's
    logits, logits_t = torch.empty(rows, V), torch.empty(V, rows)
    dw, dw_t = torch.zeros(V, D), torch.zeros(D, V)
    print(f"CPU: {cpu_description()}; {args.threads} threads; {rows} rows x d {D} -> V {V}")
    print(f"  {'':<44} {'median':>11}  {'speed':>7}")
    print("logits")
    race(
        {
            "h W^T (the loss's)": lambda: torch.mm(h, w.t(), out=logits),
            "h (W^T contiguous)": lambda: torch.mm(h, w_t, out=logits),
            "W h^T (logits transposed)": lambda: torch.mm(w, h.t(), out=logits_t),
            "h W^T by oneDNN": lambda: by_onednn(h, w),
        },
        args.rounds,
    )
    print("dL/dW")
    race(
        {
            "(V x d) += g^T h (the loss's, MKL)": lambda: dw.addmm_(grad.t(), h),
            "(d x V) += h^T g": lambda: dw_t.addmm_(h.t(), grad),
            "(d x V) = h^T g by oneDNN": lambda: by_onednn(h.t(), grad.t()),
        },
        args.rounds,
    )
    print("dL/dh")
    race(
        {
            "g W (the loss's, MKL)": lambda: torch.mm(grad, w),
            "g W by oneDNN": lambda: by_onednn(grad, w_t),
        },
        args.rounds,
    )

    def chain(transposed: bool, dw_by_onednn: bool) -> Callable[[], None]:
        def run() -> None:
            if transposed:
                torch.mm(w, h.t(), out=logits_t)
                torch.mm(grad_t.t(), w)
                if dw_by_onednn:
                    by_onednn(h.t(), grad_t)
                else:
                    dw.addmm_(grad_t, h)
            else:
                torch.mm(h, w.t(), out=logits)
                torch.mm(grad, w)
                if dw_by_onednn:
                    by_onednn(h.t(), grad.t())
                else:
                    dw.addmm_(grad.t(), h)

        return run

    print("the three products of a chunk")
    race(
        {
            "A: the loss's layout, MKL": chain(False, False),
            "A, dL/dW by oneDNN": chain(False, True),
            "B: logits transposed, MKL": chain(True, False),
            "B, dL/dW by oneDNN": chain(True, True),
        },
        args.rounds,
    )


if __name__ == "__main__":
    main()
