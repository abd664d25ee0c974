"""Gemma 3 270M (the shipped Q4_K_M GGUF) in attnkit against transformers and llama.cpp.

- **Logits.** transformers' Gemma3ForCausalLM reads the same file (its own GGUF reader and
  dequantization); attnkit's float32 path (every weight dequantized) over the same tokens.
- **Greedy tokens.** Five prompts, 16 tokens each, attnkit's packed path against llama.cpp
  (llama-cpp-python) fed attnkit's prompt ids: the tokens equal before the first difference.
- **Decode speed.** Tokens per second of a 64-token greedy continuation, both, 2 threads.

    python bench/gemma3.py [--threads 2]

llama-cpp-python 0.3.36 dies with SIGILL in its batched prompt path on some CPUs (an Intel Xeon
with AMX); there its prompts run with n_batch=1.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import cpu_description, llama_cpp_n_batch, save_results

PROMPTS = [
    "The capital of France is",
    "The animal didn't cross the street because it was too tired.",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a land far away,",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from llama_cpp import Llama

    import attnkit as ak
    from attnkit.interop import load_tokenizer_for
    from attnkit.interop.pretrained import shipped

    path = shipped(__import__("pathlib").Path("gemma3"))
    print(f"CPU: {cpu_description()}\nfile: {path}")
    tokenizer = load_tokenizer_for("gemma3")
    figures: dict = {}

    ids = torch.tensor([tokenizer.encode(PROMPTS[1])])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    exact = ak.from_pretrained(path, dequantize=True).eval()
    with torch.no_grad():
        diff = (exact(ids) - ref(ids).logits).abs().max().item()
    del ref, exact
    figures["logits: max |attnkit float32 - transformers|"] = diff
    print(f"logits over {ids.shape[1]} tokens: max difference {diff:.2e}")

    model = ak.from_pretrained(path, dequantize=False).eval()
    n_batch = llama_cpp_n_batch(path, args.threads)
    llm = Llama(model_path=str(path), n_threads=args.threads, n_ctx=256, n_batch=n_batch,
                verbose=False)  # fmt: skip
    agree = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        ours = model.generate(torch.tensor([prompt_ids]), 16, do_sample=False)[0]
        ours = ours[len(prompt_ids) :].tolist()
        llm.reset()
        llm.eval(prompt_ids)
        theirs = []
        for _ in range(16):
            token = llm.sample(temp=0.0, top_k=1)
            theirs.append(token)
            llm.eval([token])
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), 16)
        agree.append(same)
        print(f"  {same:>2} / 16 tokens equal: {prompt!r}")
    figures["greedy tokens equal before the first difference"] = agree

    prompt_ids = tokenizer.encode(PROMPTS[0])
    start = time.perf_counter()
    model.generate(torch.tensor([prompt_ids]), 64, do_sample=False, eos_id=None)
    ours_rate = 64 / (time.perf_counter() - start)
    llm.reset()
    llm.eval(prompt_ids)
    start = time.perf_counter()
    for _ in range(64):
        llm.eval([llm.sample(temp=0.0, top_k=1)])
    theirs_rate = 64 / (time.perf_counter() - start)
    figures.update({"decode tok/s attnkit": ours_rate, "decode tok/s llama.cpp": theirs_rate})
    print(f"decode (prompt included for attnkit): attnkit {ours_rate:.1f} tok/s, "
          f"llama.cpp {theirs_rate:.1f} tok/s ({ours_rate / theirs_rate:.2f}x)")  # fmt: skip
    print(f"wrote {save_results('gemma3', figures)}")


if __name__ == "__main__":
    main()
