"""Long generation keeps memory flat with window and linear attention.

Generates 10,000 tokens with a small DecoderLM (RoPE positions, no length limit) using window
attention (a ring buffer of the last w keys) and linear attention (a constant-size state), and
samples the process's resident memory and the time per token every 1,000 tokens. With full
attention the cache grows with the sequence; with these two it must not.

    python bench/long_generation.py [--tokens 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import attnkit as ak


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(attention: str, tokens: int, every: int = 1000) -> list[dict]:
    cfg = ak.ModelConfig.preset(
        "tiny", attention=attention, window=64, position="rope", eos_id=None, vocab_size=256
    )
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg).eval()
    samples: list[dict] = []
    count = 0
    last = time.perf_counter()

    def on_token(_):
        nonlocal count, last
        count += 1
        if count % every == 0:
            now = time.perf_counter()
            samples.append(
                {"tokens": count, "rss_mib": rss_mib(), "ms_per_token": (now - last) / every * 1e3}
            )
            last = now

    model.generate(torch.tensor([[5, 6, 7]]), tokens, do_sample=True, seed=0, on_token=on_token)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {}
    for attention in ("window", "linear"):
        samples = run(attention, args.tokens)
        report[attention] = samples
        first, final = samples[0], samples[-1]
        print(
            f"{attention:>6}: RSS {first['rss_mib']:.1f} MiB after {first['tokens']} tokens, "
            f"{final['rss_mib']:.1f} MiB after {final['tokens']} "
            f"({final['rss_mib'] - first['rss_mib']:+.1f} MiB); ms/token "
            f"{first['ms_per_token']:.2f} -> {final['ms_per_token']:.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
