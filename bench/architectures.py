"""Every architecture fixture (tests/data/architectures: Qwen2, Qwen3, Phi-3, Mistral, made by
llama.cpp's own converter and quantizer) in llama.cpp and in attnkit: the same token ids in,
greedy decoding, the tokens compared and the decoding speed of each.

attnkit runs each file packed, on its default path (``accel.prepare(model, "decoding")``: the
integer path, the stack in C) and on its float32 path (``exact=True``). llama.cpp rounds the
activations of its quantized products to 8 bits as attnkit's integer path does; for F32 and F16
weights it multiplies float32 (F16: float16) activations. A row shows how many of the greedy
tokens equal llama.cpp's before the first difference; there, the margin by which attnkit's
float path (the file's weights in float32) prefers its own token to llama.cpp's, relative to
its largest logit (a near-tie is a few thousandths); and the decoding speed of each side (the
median of ``--rounds`` runs of ``--tokens`` tokens, after the first token, in one process: these
models are tiny, so this measures each side's cost per step more than its products).

    python bench/architectures.py [--tokens 32] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

import attnkit as ak
from attnkit.interop import load_tokenizer_for
from common import cpu_description, llama_cpp_n_batch, save_results

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data" / "architectures"
NAMES = ("qwen2", "qwen3", "phi3", "mistral", "llama3")
KINDS = ("f32", "f16", "q8_0", "q4_k_m")
PROMPT = "The animal didn't cross the street because it was too tired. 今天 下雨"


def margin(path: Path, ids: list[int], ours: list[int], theirs: list[int]) -> float | None:
    """At the first token where the two differ: (the float path's logit of its own choice minus
    that of llama.cpp's) / its largest logit; None where they do not differ."""
    i = same_before_difference(ours, theirs)
    if i == len(ours):
        return None
    model = ak.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([ids + theirs[:i]]))[0, -1]
    return float((logits.max() - logits[theirs[i]]) / logits.abs().max())


def attnkit_run(path: Path, ids: list[int], tokens: int, rounds: int, exact: bool):
    model = ak.from_pretrained(path, dequantize=False)
    model = ak.accel.prepare(model, "decoding", exact=exact).model
    model.cfg.eos_id = None  # never stop early: as llama.cpp's loop below
    x, speeds, out = torch.tensor([ids]), [], None
    for _ in range(rounds):
        stamps: list[float] = []
        out = model.generate(x, tokens, on_token=lambda _t, s=stamps: s.append(time.perf_counter()))
        speeds.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return out[0, len(ids) :].tolist(), statistics.median(speeds)


def llama_cpp_run(path: Path, ids: list[int], tokens: int, rounds: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=threads, n_ctx=256, verbose=False,
                n_batch=llama_cpp_n_batch(path, threads))  # fmt: skip
    speeds, found = [], []
    for _ in range(rounds):
        llm.reset()
        found, stamps = [], []
        for token in llm.generate(ids, temp=0.0, top_k=1):
            stamps.append(time.perf_counter())
            found.append(token)
            if len(found) == tokens:
                break
        speeds.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return found, statistics.median(speeds)


def same_before_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("needs llama-cpp-python: pip install llama-cpp-python==0.3.36")
    print(f"CPU: {cpu_description()}; {args.tokens} greedy tokens; median of {args.rounds}")
    print(f"{'file':<22} {'same (int8 path)':>16} {'same (float path)':>17} {'margin':>7} "
          f"{'attnkit tok/s':>13} {'llama.cpp tok/s':>15} {'ratio':>6}")  # fmt: skip
    files, ratios = {}, {}
    for name in NAMES:
        for kind in KINDS:
            path = FIXTURES / name / f"{name}-{kind}.gguf"
            ids = load_tokenizer_for(path).encode(PROMPT)
            theirs, their_speed = llama_cpp_run(path, ids, args.tokens, args.rounds, args.threads)
            ours, speed = attnkit_run(path, ids, args.tokens, args.rounds, exact=False)
            exact, _ = attnkit_run(path, ids, args.tokens, 1, exact=True)
            same, same_exact = (
                same_before_difference(ours, theirs),
                same_before_difference(exact, theirs),
            )
            gap = margin(path, ids, exact, theirs)
            shown = "" if gap is None else f"{gap:.4f}"
            print(f"{path.name:<22} {same:>13}/{args.tokens} {same_exact:>14}/{args.tokens} "
                  f"{shown:>7} {speed:>13.0f} {their_speed:>15.0f} "
                  f"{speed / their_speed:>5.2f}x")  # fmt: skip
            ratios[f"{path.name} decode: attnkit / llama.cpp"] = speed / their_speed
            files[path.name] = {
                "same_tokens_int8": same, "same_tokens_float": same_exact, "tokens": args.tokens,
                "margin_at_first_difference": gap,
                "attnkit_tok_s": speed, "llama_cpp_tok_s": their_speed,
                "ratio": speed / their_speed, "llama_cpp": theirs, "attnkit": ours,
            }  # fmt: skip
    figures = {"ratios": ratios, "files": files}  # bench/report.py tables the ratios
    print(f"saved {save_results('architectures', figures)}")


if __name__ == "__main__":
    main()
