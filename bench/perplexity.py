"""Perplexity of SmolLM2 (Q4_1 GGUF) or Gemma 3 270M (Q4_K_M GGUF) on the same windows of the
same tokens: attnkit in float32
(every weight dequantized; the packed weights' float32 path gives the same), attnkit's integer
path (packed weights, activations quantized to 8 bits: ``prepare(model, "decoding")``), and
llama.cpp (llama-cpp-python's logits, its own integer path).

The text is the validation split of the shipped Shakespeare corpus, tokenized once by attnkit;
llama.cpp evaluates exactly those token ids. Each path scores the second half of consecutive
windows of --ctx tokens, each window starting with BOS, as llama-perplexity does
(``attnkit.training.perplexity``). The figures go to the per-CPU results table.

    python bench/perplexity.py [--model smollm2] [--windows 8] [--ctx 512] [--threads 2]

llama-cpp-python 0.3.36 dies with SIGILL in its batched prompt path on some CPUs (an Intel Xeon
with AMX); there it runs with n_batch=1 (slower, the same logits).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from common import cpu_description, llama_cpp_n_batch, save_results
from gguf_speed import gguf_file


def llama_cpp_perplexity(path, ids: list[int], ctx: int, windows: int, threads: int, bos: int):
    from llama_cpp import Llama

    n_batch = llama_cpp_n_batch(path, threads)
    llm = Llama(
        model_path=str(path), n_threads=threads, n_ctx=ctx, n_batch=min(n_batch, ctx),
        logits_all=True, verbose=False,
    )  # fmt: skip
    losses = []
    first = ctx // 2
    for w in range(windows):
        window = list(ids[w * ctx : (w + 1) * ctx])
        window[0] = bos
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[first : ctx - 1], dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        losses += [-logp[k, window[first + 1 + k]] for k in range(ctx - 1 - first)]
    losses = np.array(losses)
    mean = float(losses.mean())
    value = math.exp(mean)
    return value, value * float(losses.std(ddof=1)) / math.sqrt(len(losses)), len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import attnkit as ak
    from attnkit.data import load_shakespeare
    from attnkit.interop import load_tokenizer_for
    from attnkit.training.perplexity import perplexity

    print(f"CPU: {cpu_description()}")
    tokenizer = load_tokenizer_for(args.model)
    ids = tokenizer.encode(load_shakespeare().validation, add_special_tokens=False)
    figures = {"tokens in the text": len(ids), "ctx": args.ctx, "windows": args.windows}
    rows = []
    for name, dequantize in (("attnkit float32", True), ("attnkit int8 (integer path)", False)):
        model = ak.from_pretrained(args.model, dequantize=dequantize)
        model = ak.accel.prepare(model, "decoding").model
        start = time.perf_counter()
        result = perplexity(model, ids, context=args.ctx, windows=args.windows)
        rows.append((name, result.value, result.error, time.perf_counter() - start))
        bos = model.cfg.bos_id
        del model
    start = time.perf_counter()
    path = gguf_file(args.model)
    value, error, _ = llama_cpp_perplexity(path, ids, args.ctx, args.windows, args.threads, bos)
    rows.append(("llama.cpp (its logits, same tokens)", value, error, time.perf_counter() - start))
    print(f"{path.name} on Shakespeare (validation split), {args.windows} windows of {args.ctx}")
    print(f"{'path':<38}{'perplexity':>12}{'+/-':>9}{'seconds':>10}")
    for name, value, error, seconds in rows:
        print(f"{name:<38}{value:>12.4f}{error:>9.4f}{seconds:>10.1f}")
        figures[f"perplexity {name}"] = value
        figures[f"seconds {name}"] = seconds
    base = rows[0][1]
    for name, value, _, _ in (rows[1], rows[2]):
        print(f"  {name}: {100 * (value / base - 1):+.3f}% against float32")
    name = "perplexity" if args.model == "smollm2" else f"perplexity_{args.model}"
    print(f"wrote {save_results(name, figures)}")


if __name__ == "__main__":
    main()
