"""Decode speed, packed attnkit against llama.cpp, in alternating bursts: SmolLM2-135M-Instruct
(Q4_1), greedy, the same 12-token prompt and thread count.

This machine's speed drifts by a third within minutes, and more at times, so two runs a minute
apart (``gguf_speed.py``'s rounds) can differ by 2x for reasons of their own. Here each side
loads the model once, in its own process, and they take turns: a burst of ``--tokens`` new
tokens by one, then by the other (every other pair in the reverse order), ``--pairs`` times.
Each pair's ratio compares two bursts run seconds apart; the median of the pairs is the figure.

    python bench/gguf_decode.py [--threads 2] [--tokens 128] [--pairs 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import subprocess
import sys
import time

from common import cpu_description, save_results
from gguf_speed import PROMPT, model_path


def attnkit_worker(threads: int):
    import torch

    import attnkit as ak
    from attnkit.interop import load_tokenizer_for

    torch.set_num_threads(threads)
    model = ak.from_pretrained(model_path(), dequantize=False)
    ids = torch.tensor([load_tokenizer_for(model_path()).encode(PROMPT)])

    def burst(tokens: int) -> float:
        stamps: list[float] = []
        model.generate(
            ids, tokens + 1, do_sample=False, on_token=lambda t: stamps.append(time.perf_counter())
        )
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return burst


def llama_cpp_worker(threads: int, n_batch: int = 512):
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(model_path()), n_threads=threads, n_ctx=1024, n_batch=n_batch,
        verbose=False,
    )  # fmt: skip
    ids = llm.tokenize(PROMPT.encode(), add_bos=False)

    def burst(tokens: int) -> float:
        llm.reset()
        stamps = []
        for _ in llm.generate(ids, temp=0.0, top_k=1):
            stamps.append(time.perf_counter())
            if len(stamps) == tokens + 1:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return burst


def serve(name: str, threads: int, n_batch: int) -> None:
    """A worker: load, warm up, then answer each line N on stdin with N tokens' tokens/s."""
    burst = attnkit_worker(threads) if name == "attnkit" else llama_cpp_worker(threads, n_batch)
    burst(8)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(burst(int(line))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--worker", choices=["attnkit", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--n-batch", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args.worker, args.threads, args.n_batch)
        return
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("needs llama-cpp-python (make bench builds it)")
    print(f"CPU: {cpu_description()}; {args.threads} threads; {model_path().name}")

    def start(name: str, n_batch: int = 512) -> subprocess.Popen:
        command = [sys.executable, __file__, "--worker", name, "--threads", str(args.threads)]
        return subprocess.Popen(
            [*command, "--n-batch", str(n_batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    workers = {name: start(name) for name in ("attnkit", "llama.cpp")}
    for name, process in list(workers.items()):
        if process.stdout.readline().strip() == "ready":
            continue
        if name == "llama.cpp" and process.wait() == -signal.SIGILL:
            # llama-cpp-python 0.3.36 built with GGML_NATIVE=ON dies with SIGILL in its
            # batched prompt path on some CPUs (an Intel Xeon with AMX); its decode, one token
            # at a time, is the same with a batch of one
            print("llama.cpp: SIGILL in its batched prompt path on this CPU; n_batch=1 instead")
            workers[name] = process = start(name, 1)
            if process.stdout.readline().strip() == "ready":
                continue
        sys.exit(f"the {name} worker failed to start (exit status {process.wait()})")

    def burst(name: str) -> float:
        workers[name].stdin.write(f"{args.tokens}\n")
        workers[name].stdin.flush()
        return json.loads(workers[name].stdout.readline())

    ratios = []
    print(f"{'pair':>4} {'attnkit tok/s':>14} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for pair in range(args.pairs):
        order = ["attnkit", "llama.cpp"] if pair % 2 == 0 else ["llama.cpp", "attnkit"]
        speeds = {name: burst(name) for name in order}
        ratios.append(speeds["attnkit"] / speeds["llama.cpp"])
        mine, theirs = speeds["attnkit"], speeds["llama.cpp"]
        print(f"{pair + 1:>4} {mine:>14.1f} {theirs:>16.1f} {ratios[-1]:>6.2f}x")
    for process in workers.values():
        process.stdin.close()
        process.wait()
    print(
        f"decode, attnkit packed / llama.cpp: median {statistics.median(ratios):.2f}x "
        f"(pairs {min(ratios):.2f}-{max(ratios):.2f}x, {args.tokens} tokens a burst)"
    )
    name = "SmolLM2 Q4_1 decode: attnkit packed / llama.cpp"
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    figures = {
        "pairs": ratios,
        "ratios": {name: statistics.median(ratios)},
        "spreads": {name: [quartiles[0], statistics.median(ratios), quartiles[2]]},
        "targets": {name: 1.0},
    }
    print(f"wrote {save_results('gguf_decode', figures)}")


if __name__ == "__main__":
    main()
