"""The optimisation levers one by one: lm-small training steps of attnkit with each lever on or
off, interleaved in one process (as bench/training.py times its candidates), so the table says
what each lever is worth on this machine today.

Training variants (batch 8 x 256 tokens, float32 unless the name says bf16):

- ``MKL linear, logits + CE, AdamW loop``: torch's defaults: nn.Linear's float32 GEMM (MKL),
  the model's logits and ``F.cross_entropy``, AdamW's per-parameter loop (its CPU default);
- ``+ oneDNN linear``: attnkit's ``Linear`` sends float32 products to oneDNN;
- ``+ fused LM-head loss``: ``DecoderLM.loss`` (``linear_cross_entropy``, no logits tensor);
- ``+ fused AdamW`` / ``foreach AdamW``: the optimizer's single-kernel / multi-tensor forms;
- ``+ C attention``: ``accel.use_attention_kernel`` (attention's forward and backward by attnkit's
  kernel instead of torch's flash attention); the rows after it keep it;
- ``bf16 autocast`` (with everything above, and without the C attention; and with logits + CE);
- ``torch.compile`` (``--compile``; minutes of compiling on 2 cores, so off by default).

    python bench/levers.py [--repeats 7] [--threads 2] [--compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit import accel
from common import SEED, Candidate, measure
from training_models import lm_batch, make_optimizer


def variant(
    name: str,
    *,
    onednn: bool = True,
    fused_loss: bool = True,
    adamw: str = "fused",
    attention: bool = False,
    precision: str = "fp32",
    compile_model: bool = False,
) -> Candidate:
    """One lm-small training step with the levers as given."""
    inputs, targets = lm_batch()
    torch.manual_seed(SEED)
    model = ak.DecoderLM(ak.ModelConfig.preset("lm-small")).train()
    if fused_loss:
        model = accel.fuse_lm_loss(model)
    accel.use_attention_kernel(model, attention)
    model = accel.use_onednn_products(model, onednn)
    optimizer = make_optimizer(model, adamw)

    def loss_of():
        if fused_loss:  # accel.fuse_lm_loss: the LM head and its loss in one chunked pass
            return model.loss(inputs, targets)
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    if compile_model:
        loss_of = torch.compile(loss_of)

    def step() -> float:
        with contextlib.ExitStack() as stack:
            if precision == "bf16":
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return Candidate(name, step, float(targets.numel()))


def training_variants(with_compile: bool) -> list[Candidate]:
    out = [
        variant(
            "MKL linear, logits + CE, AdamW loop", onednn=False, fused_loss=False, adamw="loop"
        ),
        variant("+ oneDNN linear", fused_loss=False, adamw="loop"),
        variant("+ fused LM-head loss", adamw="loop"),
        variant("+ foreach AdamW (not fused)", adamw="foreach"),
        variant("+ fused AdamW"),
        variant("+ C attention (all levers)", attention=True),
        variant("all levers, logits + CE", fused_loss=False, attention=True),
        variant("bf16 autocast (all levers)", precision="bf16", attention=True),
        variant("bf16, torch's attention", precision="bf16"),
        variant("bf16, logits + CE", precision="bf16", fused_loss=False, attention=True),
    ]
    if with_compile:
        out.append(variant("torch.compile (all levers)", compile_model=True, attention=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--json", type=Path, default=Path("runs/bench/levers.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    candidates = training_variants(args.compile)
    measure(candidates, args.repeats, args.warmup)
    base = candidates[0].rate
    print(
        f"lm-small training step, batch 8 x 256, {args.threads} threads, "
        f"median of {args.repeats} interleaved steps"
    )
    print(f"  {'variant':<40} {'tokens/s':>9} {'vs first':>9}  first loss")
    rows = {}
    for c in candidates:
        print(f"  {c.name:<40} {c.rate:9.0f} {c.rate / base:8.2f}x  {c.first:.4f}")
        rows[c.name] = {"tokens_per_s": c.rate, "times_s": c.times, "first_loss": c.first}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": args.threads, "training": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
