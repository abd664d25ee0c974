"""The model ``from_pretrained`` returns against the one ``attnkit generate`` runs: greedy decode
tokens/s of ``ak.from_pretrained(name, dequantize=False).generate(...)`` as it comes, and of
the command's own path (``load_model``, then ``accel.prepare(model, "decoding")``), each in
fresh processes, alternating, so that neither is always first.

    python bench/ready_by_default.py [--model smollm2 gemma3] [--processes 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import cpu_description, save_results

PROMPT = "The animal didn't cross the street because it was too tired."


def worker(name: str, path: str) -> None:
    import torch

    import attnkit as ak
    from attnkit import accel
    from attnkit.cli.common import load_model
    from attnkit.interop import load_tokenizer_for

    torch.set_num_threads(2)
    if path == "from_pretrained":
        model = ak.from_pretrained(name, dequantize=False)
    else:  # as cli/generate.py runs it
        model = accel.prepare(load_model(name, "MODEL", dequantize=False), "decoding").model
    ids = torch.tensor([load_tokenizer_for(name).encode(PROMPT)])

    def rate() -> float:
        stamps: list[float] = []
        model.generate(ids, 129, on_token=lambda t: stamps.append(time.perf_counter()))
        return 128 / (stamps[-1] - stamps[0])

    rate()
    print(statistics.median(rate() for _ in range(5)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per path")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    print(cpu_description())
    figures: dict = {"ratios": {}, "rates": {}}
    for name in args.model:
        rates: dict[str, list[float]] = {"from_pretrained": [], "attnkit generate's path": []}
        for _ in range(args.processes):
            for path in rates:
                out = subprocess.run([sys.executable, __file__, "--worker", name, path],
                                     capture_output=True, text=True, check=True)  # fmt: skip
                rates[path].append(float(out.stdout.split()[-1]))
        ratio = statistics.median(rates["from_pretrained"]) / statistics.median(
            rates["attnkit generate's path"]
        )
        for path, found in rates.items():
            print(f"{name}: {path}: {', '.join(f'{r:.1f}' for r in found)} tokens/s")
        print(f"{name}: from_pretrained / attnkit generate's path: {ratio:.3f}x")
        figures["rates"][name] = rates
        figures["ratios"][f"{name} decode: from_pretrained / attnkit generate"] = ratio
    print(f"saved {save_results('ready_by_default', figures)}")


if __name__ == "__main__":
    main()
