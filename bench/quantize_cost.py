"""What ``ak.quantize`` costs in accuracy on SmolLM2-135M-Instruct: int8 (Q8_0) and int4 (Q4_1)
against the float32 model, on the prompts of ``gguf_agreement.py``.

SmolLM2's only shipped weights are a Q4_1 GGUF file, so "float32" here is that file
dequantized, and int4 and int8 round those values again (with new block minimums and scales:
int4 does not land back on the file's own blocks). For each scheme: the largest and the mean
absolute logit difference over every position of the prompts, and how many of 32 greedy
tokens equal float32's before the first difference (summed over the prompts).

    python bench/quantize_cost.py
"""

from __future__ import annotations

import argparse

import torch

import attnkit as ak
from attnkit import accel
from attnkit.interop import load_tokenizer_for
from common import cpu_description
from gguf_agreement import PROMPTS
from gguf_speed import model_path


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {cpu_description()}; {model_path().name}")
    tokenizer = load_tokenizer_for(model_path())
    prompts = [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS]
    floats = ak.from_pretrained(model_path())
    with torch.no_grad():
        want = [floats(x) for x in prompts]
        greedy = [floats.generate(x, 32, do_sample=False)[0, x.shape[1] :] for x in prompts]
    print(f"{'scheme':<8} {'max |logit diff|':>17} {'mean |logit diff|':>18} {'same greedy':>12}")
    for scheme in ("int8", "int4"):
        model = accel.quantize(ak.from_pretrained(model_path()), scheme)
        diffs, same, total = [], 0, 0
        with torch.no_grad():
            for x, w, g in zip(prompts, want, greedy, strict=True):
                diffs.append((model(x) - w).abs().flatten())
                out = model.generate(x, 32, do_sample=False)[0, x.shape[1] :]
                pairs = list(zip(out.tolist(), g.tolist(), strict=False))
                same += next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
                total += len(g)
        d = torch.cat(diffs)
        print(f"{scheme:<8} {d.max():>17.4f} {d.mean():>18.4f} {same:>5} / {total}")


if __name__ == "__main__":
    main()
