"""What a batch's decoding step costs against one row's: the measure of "batches that read the
weights once" (eight rows should cost little more than one, since every row's products read the
same weights).

A model loaded as ``from_pretrained(name, dequantize=False)`` (the integer path, the C stack)
decodes B random prompts of 24 tokens for 64 greedy steps (no EOS), and each step's time is
read between two of ``generate``'s ``on_token`` calls; the figure per B is the median step. The
row counts alternate in rounds, so each ratio compares rows in the same process and the same
minutes.

    python bench/batch_rows.py [--model smollm2] [--rows 1 4 8] [--rounds 3] [--steps 64]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from common import cpu_description, save_results


def step_ms(model, rows: int, steps: int) -> float:
    """The median time of one decoding step of ``rows`` rows, in ms."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(100, min(40000, model.cfg.vocab_size), (rows, 24), generator=g)
    stamps: list[float] = []
    model.generate(
        ids,
        steps + 1,
        eos_id=model.cfg.vocab_size - 1,  # a token random prompts do not reach: no early stop
        on_token=lambda _: stamps.append(time.perf_counter()),
    )
    return statistics.median(b - a for a, b in itertools.pairwise(stamps)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a shipped model or a .gguf file")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()

    import attnkit as ak

    torch.set_num_threads(2)
    print(cpu_description())
    model = ak.from_pretrained(args.model, dequantize=False).eval()
    step_ms(model, 1, 8)  # warm: tiles, caches, threads
    times: dict[int, list[float]] = {rows: [] for rows in args.rows}
    for round_ in range(args.rounds):
        for rows in args.rows if round_ % 2 == 0 else reversed(args.rows):
            times[rows].append(step_ms(model, rows, args.steps))
    one = statistics.median(times[args.rows[0]])
    print(f"\n{args.model}: a decoding step by rows (median of {args.rounds} rounds)")
    print(f"{'rows':>5} {'step ms':>9} {'x one row':>10} {'tokens/s':>9}")
    figures: dict = {"ratios": {}, "targets": {}, "step_ms": {}}
    for rows, values in times.items():
        ms = statistics.median(values)
        print(f"{rows:>5} {ms:>9.2f} {ms / one:>10.2f} {rows * 1000 / ms:>9.1f}")
        figures["step_ms"][str(rows)] = values
        if rows != args.rows[0]:
            name = f"{args.model} step, {rows} rows / {args.rows[0]}"
            figures["ratios"][name] = ms / one
            if rows == 8 and args.rows[0] == 1:
                figures["targets"][name] = 1.6  # issue: eight rows at most 1.6x one row
    print(f"\nwrote {save_results('batch_rows', figures)}")


if __name__ == "__main__":
    main()
