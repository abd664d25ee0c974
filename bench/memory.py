"""What ``accel.keep_freed_memory`` (glibc's malloc keeping freed blocks) does to a training step.

The setting is per process, and how malloc behaves depends on everything the process has
allocated, so it cannot be compared inside one process as ``training.py`` compares the models.
Each worker is a fresh process that trains one model, as a user's training run does: lm-small
(batch 8 x 256, as ``training.py``), attnkit's or Hugging Face GPT-2's, float32 or bf16, with
glibc's default malloc (``ATTNKIT_KEEP_MEMORY=0``) or with freed memory kept; it times the steps
and counts each step's minor page faults. Every round runs each configuration once, the two
malloc settings in alternating order. The speed-up applies to any model: the trainer turns it
on for attnkit's, and a user of the references could do the same. bf16 is skipped where torch
has no fast bf16 products (``accel.bf16_products_fast()``), as in ``training.py``.

    python bench/memory.py [--rounds 2] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CANDIDATES = ("attnkit", "HF GPT-2")


def worker(name: str, precision: str, repeats: int, threads: int) -> dict:
    """Time ``repeats`` steps of one candidate (after 2 untimed): the median step in seconds,
    the median minor page faults per step, and whether memory is kept."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from attnkit import accel
    from training_models import lm_batch, lm_losses, lm_models, make_optimizer, train_step

    torch.set_num_threads(threads)
    kept = accel.keep_freed_memory()  # as the trainer does (ATTNKIT_KEEP_MEMORY=0: not)
    inputs, targets = lm_batch()
    models = lm_models()
    model = models[name]
    loss = lm_losses(models, inputs, targets)[name]
    del models  # only this candidate stays
    step = train_step(loss, make_optimizer(model, "fused"), precision)
    times, faults = [], []
    for round_ in range(2 + repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        if round_ >= 2:
            times.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"kept": kept, "s": statistics.median(times), "faults": statistics.median(faults)}


def run_worker(config: str, keep: bool, repeats: int, threads: int) -> dict:
    env = {**os.environ, "ATTNKIT_KEEP_MEMORY": "1" if keep else "0"}
    command = [sys.executable, __file__, "--worker", config, "--repeats", str(repeats)]
    result = subprocess.run(
        [*command, "--threads", str(threads)], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"worker failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="pairs of worker processes")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per candidate")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "NAME PRECISION"
    args = parser.parse_args()
    if args.worker:
        name, precision = args.worker.rsplit(" ", 1)
        print(json.dumps(worker(name, precision, args.repeats, args.threads)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from attnkit import accel
    from common import SLOW_BF16, cpu_description

    precisions = ("fp32", "bf16") if accel.bf16_products_fast() else ("fp32",)
    if "bf16" not in precisions:
        print(f"bf16 steps: skipped, {SLOW_BF16}", flush=True)
    configs = [f"{name} {precision}" for precision in precisions for name in CANDIDATES]
    runs: dict[tuple[str, bool], list[dict]] = {}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}: {2 * len(configs)} processes ...", flush=True)
        for config in configs:
            for keep in (False, True) if round_ % 2 == 0 else (True, False):
                runs.setdefault((config, keep), []).append(
                    run_worker(config, keep, args.repeats, args.threads)
                )
    if not all(r["kept"] for c in configs for r in runs[c, True]):
        print("note: keep_freed_memory() did nothing here (not glibc?)")
    print(f"\nCPU: {cpu_description()}; {args.threads} threads; lm-small training steps")
    print(f"{'':<16} {'default malloc':>26} {'freed memory kept':>26} {'speed-up':>9}")
    for config in configs:
        cells, times = [], []
        for keep in (False, True):
            s = statistics.median(r["s"] for r in runs[config, keep])
            faults = statistics.median(r["faults"] for r in runs[config, keep])
            cells.append(f"{s * 1e3:7.1f} ms {faults:8.0f} faults")
            times.append(s)
        print(f"{config:<16} {cells[0]:>26} {cells[1]:>26} {times[0] / times[1]:8.2f}x")


if __name__ == "__main__":
    main()
