"""Decode speed, packed attnkit against llama.cpp, in alternating bursts: SmolLM2-135M-Instruct
(Q4_1) and Gemma 3 270M (Q4_K_M), greedy, the same prompt and thread count; attnkit on each
path of its packed products (float32: exact float32 activations; int8: activations quantized
to 8 bits, integer dot products, as llama.cpp).

This machine's speed drifts by a third within minutes, and more at times, so two runs a minute
apart (``gguf_speed.py``'s rounds) can differ by 2x for reasons of their own. Here each side
loads the model once, in its own process, and they take turns: a burst of ``--tokens`` new
tokens by one, then by the other (every other pair in the reverse order), ``--pairs`` times.
Each pair's ratio compares two bursts run seconds apart; the median of the pairs is the figure.

    python bench/gguf_decode.py [--model smollm2 gemma3] [--threads 2] [--tokens 128] [--pairs 10]
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

MODELS = {"smollm2": "SmolLM2 Q4_1", "gemma3": "Gemma 3 270M Q4_K_M"}
PATHS = ("float32", "int8")


def gguf_path(model: str):
    if model == "smollm2":
        return model_path()
    from pathlib import Path

    from attnkit.interop.pretrained import shipped

    return shipped(Path("gemma3"))  # the shipped chunks, joined once


def attnkit_worker(threads: int, model_name: str, path: str):
    import torch

    import attnkit as ak
    from attnkit.interop import load_tokenizer_for

    torch.set_num_threads(threads)
    file = gguf_path(model_name)
    model = ak.from_pretrained(file, dequantize=False)
    model = ak.accel.prepare(model, "decoding", exact=path == "float32").model
    ids = torch.tensor([load_tokenizer_for(file).encode(PROMPT)])

    def burst(tokens: int) -> float:
        stamps: list[float] = []
        model.generate(
            ids, tokens + 1, do_sample=False, on_token=lambda t: stamps.append(time.perf_counter())
        )
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return burst


def llama_cpp_worker(threads: int, model_name: str, n_batch: int = 512):
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf_path(model_name)), n_threads=threads, n_ctx=1024, n_batch=n_batch,
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


def serve(name: str, model: str, threads: int, n_batch: int) -> None:
    """A worker: load, warm up, then answer each line N on stdin with N tokens' tokens/s."""
    if name == "llama.cpp":
        burst = llama_cpp_worker(threads, model, n_batch)
    else:
        burst = attnkit_worker(threads, model, name.removeprefix("attnkit-"))
    burst(8)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(burst(int(line))), flush=True)


def start(name: str, model: str, threads: int, n_batch: int = 512) -> subprocess.Popen:
    command = [sys.executable, __file__, "--worker", name, "--model", model]
    return subprocess.Popen(
        [*command, "--threads", str(threads), "--n-batch", str(n_batch)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def compare(model: str, args) -> dict:
    """Alternating bursts of each attnkit path and llama.cpp on ``model``: the pairs' ratios."""
    print(f"\n{MODELS[model]} ({gguf_path(model).name})")
    names = [*(f"attnkit-{path}" for path in PATHS), "llama.cpp"]
    workers = {name: start(name, model, args.threads) for name in names}
    for name, process in list(workers.items()):
        if process.stdout.readline().strip() == "ready":
            continue
        status = process.wait()
        if name == "llama.cpp" and status < 0:
            # llama-cpp-python 0.3.36 built with GGML_NATIVE=ON dies in its batched prompt path
            # on some CPUs (SIGILL or SIGSEGV on Intel Xeons with AMX); its decode, one token
            # at a time, is the same with a batch of one
            died = signal.Signals(-status).name
            print(f"llama.cpp: {died} in its batched prompt path on this CPU; n_batch=1 instead")
            workers[name] = process = start(name, model, args.threads, 1)
            if process.stdout.readline().strip() == "ready":
                continue
        sys.exit(f"the {name} worker failed to start (exit status {process.wait()})")

    def burst(name: str) -> float:
        workers[name].stdin.write(f"{args.tokens}\n")
        workers[name].stdin.flush()
        return json.loads(workers[name].stdout.readline())

    ratios: dict[str, list[float]] = {path: [] for path in PATHS}
    print(f"{'pair':>4} " + " ".join(f"{n + ' tok/s':>18}" for n in names) + "   ratios")
    for pair in range(args.pairs):
        order = names if pair % 2 == 0 else names[::-1]
        speeds = {name: burst(name) for name in order}
        for path in PATHS:
            ratios[path].append(speeds[f"attnkit-{path}"] / speeds["llama.cpp"])
        cells = " ".join(f"{speeds[n]:>18.1f}" for n in names)
        shown = "  ".join(f"{path} {ratios[path][-1]:.2f}x" for path in PATHS)
        print(f"{pair + 1:>4} {cells}   {shown}")
    for process in workers.values():
        process.stdin.close()
        process.wait()
    figures = {}
    for path in PATHS:
        found = ratios[path]
        print(
            f"{MODELS[model]} decode, attnkit {path} / llama.cpp: median "
            f"{statistics.median(found):.2f}x (pairs {min(found):.2f}-{max(found):.2f}x, "
            f"{args.tokens} tokens a burst)"
        )
        quartiles = statistics.quantiles(found, n=4) if len(found) > 1 else [found[0]] * 3
        figures[f"{MODELS[model]} decode: attnkit {path} / llama.cpp"] = (
            found,
            [quartiles[0], statistics.median(found), quartiles[2]],
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument(
        "--worker", choices=[*(f"attnkit-{p}" for p in PATHS), "llama.cpp"], help=argparse.SUPPRESS
    )
    parser.add_argument("--n-batch", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args.worker, args.model[0], args.threads, args.n_batch)
        return
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("needs llama-cpp-python (make bench builds it)")
    print(f"CPU: {cpu_description()}; {args.threads} threads")
    found = {}
    for model in args.model:
        found.update(compare(model, args))
    figures = {
        "pairs": {name: pairs for name, (pairs, _) in found.items()},
        "ratios": {name: spread[1] for name, (_, spread) in found.items()},
        "spreads": {name: spread for name, (_, spread) in found.items()},
        "targets": dict.fromkeys(found, 1.0),
    }
    print(f"wrote {save_results('gguf_decode', figures)}")


if __name__ == "__main__":
    main()
