"""``attnkit serve`` beside llama.cpp's own server (``llama-cpp-python[server]``) on the same GGUF.

Two comparisons on the 50 questions of ``tests/data/lm_eval``:

- **Generated tokens.** Each question as a prompt, 8 greedy tokens with ``logprobs``, on both
  servers: how many tokens agree, and how far the chosen tokens' log-probabilities lie apart
  while they agree (llama.cpp multiplies 8-bit quantized activations by the weights; attnkit's
  packed products keep the activations in float32).
- **Log-likelihood (echo).** Each choice's text after its question with ``echo`` and
  ``logprobs``, the continuation's log-probabilities summed, as lm-eval scores a multiple
  choice; each server's accuracy. llama-cpp-python's echoed log-probabilities are those of each
  token under the *next* position's distribution (its issue #1983, open), so its accuracy here
  is not the model's; llama.cpp's own ``llama-server`` returns no echoed log-probabilities at
  all (ggml-org/llama.cpp#27174, open). The script prints both so that a fix shows.

    python bench/serve_vs_llamacpp.py [--threads 2]

llama-cpp-python 0.3.36 built with GGML_NATIVE dies with SIGILL in its batched prompt path on
some CPUs (an Intel Xeon with AMX); the script then starts it again with ``--n_batch 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx

from common import cpu_description, save_results
from gguf_speed import model_path
from serve import llamacpp_server, start_server

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "lm_eval" / "attnkit_mc.jsonl"


def questions() -> list[tuple[str, list[str], int]]:
    """(context, [continuations], answer) per question, as lm-eval's multiple choice builds
    them."""
    out = []
    for line in DATA.read_text().splitlines():
        item = json.loads(line)
        context = f"Question: {item['question']}\nAnswer:"
        out.append((context, [" " + c for c in item["choices"]], item["answer"]))
    return out


def scores(url: str, context: str, continuation: str) -> list[float]:
    """The log-probability of each token of ``continuation`` after ``context``, as the server
    tokenized the two together (its tokens that start at or after the context's end)."""
    text = context + continuation
    body = {"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    logprobs = reply.json()["choices"][0]["logprobs"]
    return [
        lp
        for lp, at in zip(logprobs["token_logprobs"], logprobs["text_offset"], strict=True)
        if len(context) <= at < len(text)
    ]


def continuation(url: str, prompt: str, tokens: int = 8) -> list[tuple[str, float]]:
    """The greedy continuation's tokens with their log-probabilities."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 1}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    logprobs = reply.json()["choices"][0]["logprobs"]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))


def generated(url: str, items) -> list[list[tuple[str, float]]]:
    return [continuation(url, context) for context, _, _ in items]


def score_all(url: str, items) -> list[list[list[float]]]:
    return [[scores(url, context, c) for c in options] for context, options, _ in items]


def api_scores(items, threads: int) -> list[list[list[float]]]:
    """Each continuation's token log-probabilities from llama.cpp's own logits (its Python API,
    not the server): the text's tokens after the context's, as lm-eval splits a pair."""
    import numpy as np
    from llama_cpp import Llama

    from common import llama_cpp_n_batch

    n_batch = llama_cpp_n_batch(model_path(), threads)
    llm = Llama(
        model_path=str(model_path()), n_threads=threads, n_ctx=512, n_batch=n_batch,
        logits_all=True, verbose=False,
    )  # fmt: skip
    out = []
    for context, options, _ in items:
        per_choice = []
        for option in options:
            n = len(llm.tokenize(context.encode(), add_bos=False))
            whole = llm.tokenize((context + option).encode(), add_bos=False)
            llm.reset()
            llm.eval(whole)
            logits = np.asarray(llm.scores[: len(whole)], dtype=np.float64)
            top = logits.max(-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            per_choice.append([float(logp[i - 1, whole[i]]) for i in range(n, len(whole))])
        out.append(per_choice)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}")
    items = questions()
    ours, url = start_server()
    try:
        attnkit = score_all(url, items)
        attnkit_tokens = generated(url, items)
    finally:
        ours.terminate()
        ours.wait(timeout=30)
    theirs, lurl = llamacpp_server(args.threads)
    try:
        llama = score_all(lurl, items)
        llama_tokens = generated(lurl, items)
    finally:
        theirs.terminate()
        theirs.wait(timeout=30)
    llama_api = api_scores(items, args.threads)

    gaps, mismatched = [], 0
    api_gaps = [
        abs(a - b)
        for ours_q, theirs_q in zip(attnkit, llama_api, strict=True)
        for ours_c, theirs_c in zip(ours_q, theirs_q, strict=True)
        if len(ours_c) == len(theirs_c)
        for a, b in zip(ours_c, theirs_c, strict=True)
    ]
    for ours_q, theirs_q in zip(attnkit, llama, strict=True):
        for ours_c, theirs_c in zip(ours_q, theirs_q, strict=True):
            if len(ours_c) != len(theirs_c):  # the two tokenizers split it differently
                mismatched += 1
                continue
            gaps += [abs(a - b) for a, b in zip(ours_c, theirs_c, strict=True)]

    def accuracy(table) -> float:
        right = 0
        for q, (_, _, answer) in zip(table, items, strict=True):
            sums = [sum(c) for c in q]
            right += max(range(len(sums)), key=sums.__getitem__) == answer
        return right / len(items)

    agree, total, chosen_gaps = 0, 0, []
    for ours_g, theirs_g in zip(attnkit_tokens, llama_tokens, strict=True):
        total += len(ours_g)
        for (a_tok, a_lp), (b_tok, b_lp) in zip(ours_g, theirs_g, strict=False):
            if a_tok != b_tok:
                break
            agree += 1
            chosen_gaps.append(abs(a_lp - b_lp))

    figures = {
        "generated tokens that agree": f"{agree} of {total}",
        "chosen-token logprob difference, mean": statistics.mean(chosen_gaps),
        "chosen-token logprob difference, median": statistics.median(chosen_gaps),
        "chosen-token logprob difference, max": max(chosen_gaps),
        "echo: tokens compared": len(gaps),
        "choices tokenized differently": mismatched,
        "echo: logprob difference, mean": statistics.mean(gaps),
        "accuracy attnkit": accuracy(attnkit),
        "accuracy llama.cpp (server echo)": accuracy(llama),
        "accuracy llama.cpp (its own logits)": accuracy(llama_api),
        "own logits: logprob difference, mean": statistics.mean(api_gaps),
        "own logits: logprob difference, max": max(api_gaps),
    }
    print(f"{len(items)} questions; llama.cpp's echo accuracy is not the model's (see --help)")
    for name, value in figures.items():
        print(f"  {name:<42} {value:.4g}" if isinstance(value, float) else f"  {name:<42} {value}")
    print(f"wrote {save_results('serve_vs_llamacpp', figures)}")


if __name__ == "__main__":
    main()
