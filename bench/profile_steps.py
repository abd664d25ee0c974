"""Where the time goes: torch.profiler over lm-small training steps and greedy decoding steps,
the operators' own (self) CPU time summed into a few categories.

    python bench/profile_steps.py [--threads 1] [--steps 3] [--tokens 64] [--loss fused|logits]
                            [--adamw fused|foreach|loop] [--precision fp32|bf16]
                            [--json out.json] [--no-compile]

``--loss logits --adamw loop`` is the training step as attnkit ran it before issue 10 (the
model's logits and F.cross_entropy, AdamW's per-parameter loop). To profile the code as it was,
run this file with ``PYTHONPATH`` pointing at an older ``src`` (see bench/history/).

The training step is profiled eager and with its layers compiled (``train.compile = true``,
``accel.compiled_layers``); the decoding step eager and compiled (``accel.prepare(model,
"decoding", compile=True)``).
In the compiled steps Inductor's own kernels are named ``graph_N_cpp_fused_...`` (elementwise
work) and ``graph_N_gemm_...`` (its matrix kernels); they are profiled by turning on Inductor's
``cpp.enable_kernel_profile``. Dynamo's guard checks ("TorchDynamo Cache Lookup") and the
compiled graph's Python wrapper ("Call CompiledFxGraph", self time) get categories of their own.

On a shared machine, read small operators with care: with 2 threads, an OpenMP barrier that
waits for a descheduled thread makes a 1,000-element GELU or a one-query attention take
milliseconds. ``--threads 1`` has no barriers and gives the cleaner picture.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import attnkit as ak
from attnkit import accel
from common import training_levers

CATEGORIES = [  # (category, substrings of operator names), first match wins
    ("Inductor's fused elementwise kernels", ("_cpp_fused_",)),
    ("matrix products", ("::mm", "addmm", "bmm", "_linear_pointwise", "::matmul", "_gemm_")),
    ("guard checks (Dynamo)", ("TorchDynamo Cache Lookup",)),
    ("compiled graph's Python wrapper", ("Call CompiledFxGraph",)),
    ("attention kernel", ("scaled_dot_product", "attnkit::attention")),
    (
        "softmax / cross-entropy",
        (
            "softmax",
            "nll_loss",
            "logsumexp",
            "aten::max",
            "aten::exp",
            "aten::log",
            "gather",
            "lm_loss_rows",
        ),
    ),
    ("layer norm", ("layer_norm",)),
    ("activation (GELU)", ("gelu", "relu", "threshold")),
    ("copies, fills, cat", ("copy_", "fill_", "aten::cat", "zero_", "clone", "contiguous")),
    (
        "views and shape ops (no arithmetic)",
        (
            "view",
            "as_strided",
            "transpose",
            "aten::t",
            "narrow",
            "slice",
            "select",
            "expand",
            "reshape",
            "unsqueeze",
            "split",
            "detach",
            "resolve_",
            "aten::empty",
            "alias",
        ),
    ),
]


PROFILED = (  # operators, and the C kernels' calls (attnkit::)
    "aten::",
    "mkldnn::",
    "attnkit::",
    "graph_",
    "TorchDynamo Cache Lookup",
    "## Call CompiledFxGraph",
)


def category(event) -> str:
    parent = event
    while parent is not None:
        if parent.name.startswith("Optimizer."):
            return "optimizer (AdamW)"
        parent = parent.cpu_parent
    for name, keys in CATEGORIES:
        if any(key in event.name for key in keys):
            return name
    return "other operators"


def summarise(prof, wall_s: float, units: int) -> dict:
    """Self CPU milliseconds per category and per unit (step or token), and what no operator
    accounts for (Python, dispatch, waiting)."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type.name != "CPU" or not event.name.startswith(PROFILED):
            continue
        totals[category(event)] += event.self_cpu_time_total / 1000.0
    per_unit = {k: v / units for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    wall = wall_s * 1000.0 / units
    per_unit["outside operators (Python, dispatch)"] = max(0.0, wall - sum(per_unit.values()))
    return {"wall_ms": wall, "ms": per_unit}


def training_profile(
    steps: int, loss_kind: str, adamw: str, compiled: bool = False, precision: str = "fp32"
) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (8, 257), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    torch.manual_seed(0)
    model = training_levers(ak.DecoderLM(ak.ModelConfig.preset("lm-small")).train())
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **options[adamw])

    def step():
        # as the trainer runs a step (compiled: train.compile = true)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with (
            autocast,
            accel.compiled_layers(model, compiled),
        ):
            if loss_kind == "fused":
                loss = model.loss(inputs, targets)
            else:
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    plain_ms = (time.perf_counter() - start) * 1000.0 / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - start
    return {"unprofiled_ms": plain_ms, **summarise(prof, wall, steps)}


def decode_profile(tokens: int, compile: bool = False) -> dict:
    cfg = ak.ModelConfig.preset("lm-small", max_len=512, eos_id=None, bos_id=None)
    torch.manual_seed(0)
    model = accel.prepare(ak.DecoderLM(cfg).eval(), "decoding", compile=compile).model
    prompt = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, tokens)  # warm-up (and compile)
    start = time.perf_counter()
    model.generate(prompt, 1)  # the prompt alone, to subtract
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(prompt, tokens + 1)
    plain_ms = (time.perf_counter() - start - prompt_s) * 1000.0 / tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model.generate(prompt, tokens + 1)
        wall = time.perf_counter() - start
    # the prompt's forward is inside the profile too; with 64+ tokens it is a few percent
    result = {"unprofiled_ms": plain_ms, **summarise(prof, wall - prompt_s, tokens)}
    result["note"] = "per generated token; the prompt's operators are included"
    return result


def print_table(title: str, result: dict, unit: str) -> None:
    print(
        f"\n{title}: {result['unprofiled_ms']:.2f} ms per {unit} "
        f"({result['wall_ms']:.2f} ms under the profiler, which adds ~1 us per operator)"
    )
    for name, ms in result["ms"].items():
        print(f"  {name:<40} {ms:9.3f} ms  {ms / result['wall_ms']:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="training steps profiled")
    parser.add_argument("--tokens", type=int, default=64, help="decoding steps profiled")
    parser.add_argument("--loss", choices=("fused", "logits"), default="fused")
    parser.add_argument("--adamw", choices=("fused", "foreach", "loop"), default="fused")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16"), default="fp32", help="of the training steps"
    )
    parser.add_argument("--json", type=Path, default=Path("runs/bench/profile.json"))
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the compile=True decoding step"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # name Inductor's kernels
    options = dict(loss_kind=args.loss, adamw=args.adamw, precision=args.precision)
    train = training_profile(args.steps, **options)
    train_compiled = training_profile(args.steps, compiled=True, **options)
    decode = decode_profile(args.tokens)
    compiled = None if args.no_compile else decode_profile(args.tokens, compile=True)
    print(f"torch.profiler, {args.threads} thread(s); self CPU time of the operators")
    print_table(
        f"lm-small training step (batch 8 x 256, {args.precision}, loss {args.loss}, "
        f"AdamW {args.adamw})",
        train,
        "step",
    )
    print_table("the same with compiled layers (train.compile = true)", train_compiled, "step")
    print_table("lm-small greedy decoding step (batch 1, KV cache)", decode, "token")
    if compiled is not None:
        print_table("the same with compile=True", compiled, "token")
    figures = {
        "threads": args.threads,
        "training": train,
        "training_compiled": train_compiled,
        "decode": decode,
        "compiled": compiled,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
