"""Where attnkit's greedy tokens and llama.cpp's part, and why: SmolLM2-135M-Instruct (Q4_1)
on five prompts, 64 greedy tokens each.

Four runs of the same file, the same token ids in, greedy decoding:

- attnkit float32: every weight dequantized (the reference);
- attnkit packed: the weights kept in their blocks (``dequantize=False``);
- llama.cpp (``llama-cpp-python``);
- attnkit packed, with llama.cpp's rounding of the activations copied: before each product,
  llama.cpp rounds the input row to 8 bits per value in blocks of 32 (Q8_0 / Q8_1: a float16
  scale d = max |x| / 127 and integers q = round(x / d)) so that it can use integer dot
  products. attnkit multiplies the float32 row.

For each run it prints the number of tokens equal to the reference's before the first
difference, and the largest logit difference on the prompt's last position; then the same
between the rounded attnkit run and llama.cpp. The packed model is prepared for decoding on
its float32 path (``prepare(model, "decoding", exact=True)``: the stack in C, ``PackedStack``),
except in the rounded run, which needs every product to go through ``PackedLinear`` (the
stack's eager forward, ``packed_steps(False)``). "the C steps" is the largest logit difference
over every decoding step, the packed model fed the reference's own tokens one at a time through
the C stack, against the float32 model's logits for the same sequence.

    python bench/gguf_agreement.py [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import torch

import attnkit as ak
from attnkit.accel import packed, packed_steps
from attnkit.interop import load_tokenizer_for
from common import cpu_description, llama_cpp_n_batch
from gguf_speed import model_path

PROMPTS = [
    "Once upon a time, in a land far away, there lived",
    "The capital of France is",
    "def fibonacci(n):",
    "The animal didn't cross the street because it was too tired.",
    "Photosynthesis is the process by which",
]


def round_like_llama_cpp(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) rounded as llama.cpp's Q8_0 / Q8_1 activations: blocks of 32 values, a
    float16 scale max|x| / 127 each, integers in [-127, 127]."""
    blocks = x.float().reshape(-1, 32)
    d = (blocks.abs().amax(dim=1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, torch.round(blocks / d.clamp_min(1e-30)), torch.zeros_like(blocks))
    return (q * d).reshape(x.shape).to(x.dtype)


class LlamaCppRounding:
    """Inside the block, every packed product of ``model`` rounds its input row as llama.cpp
    does (a forward pre-hook on each PackedLinear)."""

    def __init__(self, model) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, packed.PackedLinear)]

    def __enter__(self):
        def round_input(layer, args):
            return (round_like_llama_cpp(args[0]),)

        self.hooks = [layer.register_forward_pre_hook(round_input) for layer in self.layers]

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def attnkit_run(model, ids: list[int], new_tokens: int, rounding: bool = False):
    x = torch.tensor([ids])
    with torch.no_grad(), LlamaCppRounding(model) if rounding else _nothing():
        with packed_steps(not rounding):  # the C step would bypass the rounding
            logits = model(x)[0, -1].numpy()
            out = model.generate(x, new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist(), logits


def c_step_difference(floats, packs, ids: list[int], tokens: list[int]) -> float:
    """The largest logit difference over the decoding steps: the packed model's C stack fed
    ``tokens`` one at a time after the prompt, against the float32 model's logits for the whole
    sequence."""
    sequence = torch.tensor([ids + tokens])
    cache = packs.new_cache(1, sequence.shape[1])
    with torch.no_grad():
        want = floats(sequence)[0, len(ids) : -1]  # predicting each token after the first
        packs(sequence[:, : len(ids)], cache=cache)
        got = [
            packs(sequence[:, t : t + 1], cache=cache)[0, -1]
            for t in range(len(ids), sequence.shape[1] - 1)
        ]
    return float((torch.stack(got) - want).abs().max())


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def llama_cpp_run(llm, ids: list[int], new_tokens: int):
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    llm.reset()
    tokens = []
    for token in llm.generate(ids, temp=0.0, top_k=1):
        tokens.append(token)
        if len(tokens) == new_tokens:
            break
    return tokens, logits


def agreement(tokens: list[int], reference: list[int]) -> int:
    pairs = list(zip(tokens, reference, strict=False))
    return next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {model_path().name}; {args.new_tokens} greedy tokens")
    tokenizer = load_tokenizer_for(model_path())
    floats = ak.from_pretrained(model_path())
    packs = ak.from_pretrained(model_path(), dequantize=False)
    packs = ak.accel.prepare(packs, "decoding", exact=True).model
    llm = None
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        llm = Llama(
            model_path=str(model_path()),
            n_threads=args.threads,
            n_ctx=512,
            n_batch=llama_cpp_n_batch(model_path(), args.threads),  # 1 where 512 dies
            logits_all=True,  # llm.scores holds every position's logits
            verbose=False,
        )
    else:
        print("llama-cpp-python is not installed: no llama.cpp rows")
    header = f"{'prompt':<34} {'run':<34} {'same tokens':>11} {'max |logit diff|':>17}"
    print(header)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        reference, ref_logits = attnkit_run(floats, ids, args.new_tokens)
        runs = {"attnkit packed": attnkit_run(packs, ids, args.new_tokens)}
        if llm is not None:
            runs["llama.cpp"] = llama_cpp_run(llm, ids, args.new_tokens)
            runs["attnkit packed + llama.cpp rounding"] = attnkit_run(
                packs, ids, args.new_tokens, rounding=True
            )
        label = prompt if len(prompt) <= 32 else prompt[:29] + "..."
        for name, (tokens, logits) in runs.items():
            same = agreement(tokens, reference)
            diff = float(np.abs(logits - ref_logits).max())
            print(f"{label:<34} {name:<34} {same:>5} / {len(reference):<5} {diff:>17.4f}")
            label = ""
        difference = c_step_difference(floats, packs, ids, reference)
        name = "attnkit packed, the C steps"
        print(f"{'':<34} {name:<34} {len(reference) - 1:>5} steps {difference:>16.1e}")
        if llm is not None:
            mimic, cpp = runs["attnkit packed + llama.cpp rounding"], runs["llama.cpp"]
            same, diff = agreement(mimic[0], cpp[0]), float(np.abs(mimic[1] - cpp[1]).max())
            name = "the rounded run against llama.cpp"
            print(f"{'':<34} {name:<34} {same:>5} / {len(cpp[0]):<5} {diff:>17.4f}")


if __name__ == "__main__":
    main()
