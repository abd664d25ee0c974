"""Training speed: attnkit against reference implementations, measured side by side.

Two fixed configurations (bench/history/ lists every size):

- ``lm-small``: attnkit's DecoderLM (preset "lm-small": vocab 8192, d_model 256, 8 heads,
  4 layers, d_ff 1024, 256 positions, Pre-LN, GELU, tied embeddings, no dropout), batch 8 x 256
  tokens, against Hugging Face ``GPT2LMHeadModel`` (sdpa attention, given attnkit's weights
  through ``interop.to_hf``) and x-transformers' ``TransformerWrapper(Decoder)`` of the same
  sizes; in float32 and under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
- ``mt-small``: attnkit's Transformer (preset "mt-small": 3 + 3 Post-LN layers, ReLU,
  sinusoidal positions, three-way tying), batch 32, source and target 64 tokens, about 10%
  padding, against ``torch.nn.Transformer`` (with embeddings, positions and a tied output layer)
  and Hugging Face ``BartForConditionalGeneration`` of the same sizes; float32. One more
  attnkit candidate, "attnkit padded stacks", is the trainer's step with its layers over the
  padded batch (without ``accel.unpad_stacks``), to show what skipping the padding is worth.

A training step is forward, cross-entropy over the vocabulary, backward, and an AdamW step; every
implementation gets the same loss code and the same optimizer settings (``--adamw``, default
fused), so the ratios compare the models, not the optimizers. All candidates run in one process,
interleaved step by step (round r times one step of each, in a new shuffled order each
round; lm-small's float32 and bf16 candidates share their rounds, mt-small's have their
own), so a load change on this shared machine hits them alike; warm-up steps are excluded and
each figure is the median over rounds. Beside each ratio the report prints the median and the
quartiles of its per-round ratios (the reference's step over attnkit's in the same round): how
far one round strays here, which says how far a ratio near its target can be trusted. A target
counts as met only where the ratio and the median round both reach it.

Model FLOPs utilisation (MFU) of lm-small::

    FLOPs per token = 6 P + 12 L D T        (PaLM, appendix B)
    MFU = FLOPs per token x tokens/s / matmul peak

with P the parameters that enter matrix products (all but the position table; the tied
embedding once, as the LM head), L layers, D d_model, T the context (the attention term counts
the full T x T scores, as PaLM does, although causal attention needs half). The peak is measured
in the same rounds: ``torch.mm`` of two 4096 x 4096 matrices in the same dtype, and, for float32,
also oneDNN's matmul on the same matrices (the best float32 GEMM this torch build has here).

    python bench/training.py [--suite lm,mt] [--repeats 15] [--warmup 2] [--threads 2]
                             [--keep-memory] [--json runs/bench/training.json]

By default the process keeps glibc's default malloc, as a user of the references runs them;
attnkit's trainer keeps freed memory (``accel.keep_freed_memory``), which ``bench/memory.py``
measures on its own and ``--keep-memory`` applies to every candidate here.

The report opens with the processor (lscpu's model name, family and model) and how fast a tensor
copy moves memory at the run's thread count, 1 MiB (inside the caches) and 64 MiB (beyond
them): figures from machines that differ in either are not comparable, and two cloud machines
that report the same processor can differ in the second.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import transformers
from torch import nn

import attnkit as ak
from attnkit import accel
from attnkit.accel import onednn_linear_available
from common import (
    SEED,
    SLOW_BF16,
    Candidate,
    cpu_description,
    measure,
    memory_rates,
    save_results,
)
from training_models import (
    LM_BATCH,
    LM_LEN,
    MT_BATCH,
    MT_LEN,
    PADDED,
    VARIANTS,
    lm_batch,
    lm_flops_per_token,
    lm_losses,
    lm_models,
    make_optimizer,
    mt_batch,
    mt_losses,
    mt_models,
    mt_padding,
    onednn_switch,
    train_step,
)

transformers.logging.set_verbosity_error()

TARGETS = {  # issue 24 (and issue 10's x-transformers and MFU rows): the ratios, in one run
    "lm-small fp32: attnkit / HF GPT-2": 1.3,
    "lm-small fp32: attnkit compiled / HF GPT-2": 1.3,
    "lm-small fp32: attnkit no oneDNN / HF GPT-2": 1.3,
    "lm-small fp32: attnkit compiled, no oneDNN / HF GPT-2": 1.3,
    "lm-small fp32: attnkit / x-transformers": 1.1,
    "mt-small fp32: attnkit / torch.nn.Transformer": 1.3,
    "mt-small fp32: attnkit compiled / torch.nn.Transformer": 1.3,
    "mt-small fp32: attnkit no oneDNN / torch.nn.Transformer": 1.3,
    "mt-small fp32: attnkit compiled, no oneDNN / torch.nn.Transformer": 1.3,
    "lm-small: (attnkit bf16 / fp32) / (products bf16 / fp32)": 0.8,
    "lm-small: (attnkit compiled bf16 / fp32) / (products bf16 / fp32)": 0.8,
    "lm-small MFU fp32 attnkit vs torch.mm 4096 float32": 0.45,
}


# --------------------------------------------------------------------------------------------
# Timing: candidates interleaved round by round
# --------------------------------------------------------------------------------------------


def matmul_candidates(dtype: torch.dtype, n: int = 4096) -> list[Candidate]:
    """The matmul peak: torch.mm (n x n) @ (n x n), and for float32 oneDNN's matmul too."""
    g = torch.Generator().manual_seed(SEED)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    flops = 2.0 * n**3
    name = {torch.float32: "float32", torch.bfloat16: "bf16"}[dtype]
    out = [Candidate(f"torch.mm {n} {name}", lambda: torch.mm(a, b), flops)]
    if dtype == torch.float32 and onednn_linear_available():
        bt = b.t().contiguous()  # oneDNN's linear takes the weight as (out, in)

        def by_onednn():
            with accel.onednn_linear(True):
                return accel.linear(a, bt)

        out.append(Candidate(f"oneDNN matmul {n} {name}", by_onednn, flops))
    return out


def products_candidate(precision: str, onednn: bool | None = None) -> Candidate:
    """The matrix products of one lm-small training step, alone, at the step's own shapes
    (8 x 256 = 2,048 rows): each linear layer's forward and both gradients (q/k/v, output,
    FFN up and down, in every layer) and the LM head's three, as attnkit's step runs them
    (float32 through oneDNN where it is the default, or with ``onednn=False`` through torch's
    own GEMM as the references run them; bf16 under autocast). Its work is FLOPs."""
    cfg = ak.ModelConfig.preset("lm-small")
    d, f, rows = cfg.d_model, cfg.d_ff, LM_BATCH * LM_LEN
    shapes = [(d, 3 * d), (d, d), (d, f), (f, d)] * cfg.n_layers + [(d, cfg.vocab_size)]
    g = torch.Generator().manual_seed(SEED)
    xs = [torch.randn(rows, i, generator=g).requires_grad_() for i, _ in shapes]
    ws = [nn.Parameter(torch.randn(o, i, generator=g) * i**-0.5) for i, o in shapes]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gys = [torch.randn(rows, o, generator=g).to(dtype) for _, o in shapes]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def run() -> None:
        with autocast, onednn_switch(onednn):
            for x, w, gy in zip(xs, ws, gys, strict=True):
                accel.linear(x, w).backward(gy)  # OneDNNLinear's product (accel.apply)

    flops = 6.0 * rows * sum(i * o for i, o in shapes)
    suffix = {None: "", False: " no oneDNN", True: " oneDNN"}[onednn]
    return Candidate(f"lm-small products {precision}{suffix}", run, flops)


# --------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# lm-small: attnkit DecoderLM, Hugging Face GPT-2, x-transformers
# --------------------------------------------------------------------------------------------


def lm_candidates(precision: str, adamw: str) -> list[Candidate]:
    inputs, targets = lm_batch()
    models = lm_models()
    out = []
    for name, loss_of in lm_losses(models, inputs, targets).items():
        step = train_step(loss_of, make_optimizer(models[name], adamw), precision)
        out.append(Candidate(f"{name} {precision}", step, float(targets.numel())))
    return out


# --------------------------------------------------------------------------------------------
# mt-small: attnkit Transformer, torch.nn.Transformer, Hugging Face BART
# --------------------------------------------------------------------------------------------


def mt_candidates(adamw: str) -> list[Candidate]:
    b = mt_batch()
    real = float((b["targets"] != 0).sum())  # target tokens that count (padding does not)
    models = mt_models()
    out = []
    for name, loss_of in mt_losses(models, b).items():
        step = train_step(loss_of, make_optimizer(models[name], adamw), "fp32")
        out.append(Candidate(f"{name} fp32", step, real))
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


BF16_SKIPPED = f"lm-small bf16: skipped, {SLOW_BF16}"


def run(suites: list[str], repeats: int, warmup: int, adamw: str) -> dict:
    """Time the suites ("lm": float32 and bf16, with their matmul peaks; "mt": float32) and
    return every figure, with the ratios, as one JSON-ready dict."""
    results: dict = {"threads": torch.get_num_threads(), "repeats": repeats, "adamw": adamw}
    peaks: dict[str, float] = {}
    if "lm" in suites:
        flops = lm_flops_per_token(ak.DecoderLM(ak.ModelConfig.preset("lm-small")))
        results["lm_flops_per_token"] = flops
        # float32 and bf16 in the same rounds: the bf16 / float32 ratios divide figures from
        # one round, so a machine that drifts between minutes cannot bend them
        cands = []
        precisions = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
        if not accel.bf16_products_fast():
            precisions.pop()
            results["bf16_skipped"] = BF16_SKIPPED
            print(BF16_SKIPPED, flush=True)
        for precision, dtype in precisions:
            cands += lm_candidates(precision, adamw) + matmul_candidates(dtype)
            cands.append(products_candidate(precision))
            if precision == "fp32":
                cands.append(products_candidate(precision, onednn=False))
        names = " and ".join(p for p, _ in precisions)
        print(f"lm-small {names}: timing {len(cands)} candidates ...", flush=True)
        measure(cands, repeats, warmup)
        for c in cands:
            key = "peak" if "matmul" in c.name or "torch.mm" in c.name else "lm"
            key = "products" if "products" in c.name else key
            results.setdefault(key, {})[c.name] = _row(c)
            if key == "peak":
                peaks[c.name] = c.rate
    if "mt" in suites:
        cands = mt_candidates(adamw)
        print(f"mt-small fp32: timing {len(cands)} candidates ...", flush=True)
        measure(cands, repeats, warmup)
        results["mt_padding"] = mt_padding()
        results["mt"] = {c.name: _row(c) for c in cands}
    results["ratios"] = ratios(results, peaks)
    results["spreads"] = spreads(results)
    return results


def _row(c: Candidate) -> dict:
    row = {"per_s": c.rate, "times_s": c.times, "first_s": c.first_s}
    if isinstance(c.first, float):
        row["first_loss"] = c.first
    return row


def ratios(results: dict, peaks: dict[str, float]) -> dict[str, float]:
    """The comparisons the issue asks for, attnkit / reference (> 1: attnkit faster), for
    attnkit's training loss and, in the "(logits)" rows, for its logits + F.cross_entropy."""
    out = {name: ours["per_s"] / ref["per_s"] for name, ours, ref in comparisons(results)}
    lm = results.get("lm", {})
    products = results.get("products", {})
    gpt2 = lm.get("HF GPT-2 fp32", {}).get("per_s")
    for name in ("lm-small products fp32", "lm-small products fp32 no oneDNN"):
        if gpt2 and name in products:  # tokens/s if a step were its products and nothing else
            alone = LM_BATCH * LM_LEN / statistics.median(products[name]["times_s"])
            out[f"bound: {name.removeprefix('lm-small ')} alone / HF GPT-2 fp32 step"] = (
                alone / gpt2
            )
    if "lm-small products fp32" in products and "lm-small products bf16" in products:
        gain = (
            products["lm-small products bf16"]["per_s"]
            / products["lm-small products fp32"]["per_s"]
        )
        out["lm-small: products bf16 / fp32"] = gain
        for ours in ("attnkit", "attnkit compiled"):
            if f"{ours} fp32" in lm and f"{ours} bf16" in lm:
                step = lm[f"{ours} bf16"]["per_s"] / lm[f"{ours} fp32"]["per_s"]
                out[f"lm-small: {ours} bf16 / {ours} fp32"] = step
                out[f"lm-small: ({ours} bf16 / fp32) / (products bf16 / fp32)"] = step / gain
    flops = results.get("lm_flops_per_token")
    for precision, label in (("fp32", "float32"), ("bf16", "bf16")):
        if flops and f"attnkit {precision}" in lm:
            achieved = lm[f"attnkit {precision}"]["per_s"] * flops
            for peak_name, peak in peaks.items():
                if label in peak_name:
                    out[f"lm-small MFU {precision} attnkit vs {peak_name}"] = achieved / peak
    return out


def comparisons(results: dict):
    """(name, attnkit's row, the reference's row) for each attnkit / reference pair timed:
    attnkit's training loss and, in the "(logits)" rows, its logits + F.cross_entropy."""
    lm, mt = results.get("lm", {}), results.get("mt", {})

    def pair(table, ours, ref, precision, label):
        if f"{ours} {precision}" in table and f"{ref} {precision}" in table:
            name = "attnkit (logits)" if ours == "attnkit logits" else ours
            yield (
                f"{label} {precision}: {name} / {ref}",
                table[f"{ours} {precision}"],
                table[f"{ref} {precision}"],
            )

    for ours in (*VARIANTS, "attnkit logits"):
        for precision in ("fp32", "bf16"):
            for ref in ("HF GPT-2", "x-transformers"):
                yield from pair(lm, ours, ref, precision, "lm-small")
        for ref in ("torch.nn.Transformer", "HF BART"):
            yield from pair(mt, ours, ref, "fp32", "mt-small")
    yield from pair(mt, "attnkit", PADDED, "fp32", "mt-small")  # what unpadding is worth
    # attnkit against itself: what compiling the layers is worth, and what the oneDNN routing is
    # worth. Where torch's GEMM is the default, "attnkit" and "attnkit no oneDNN" run the same
    # step, and that row shows how far this run's noise alone moves a ratio.
    for table, label in ((lm, "lm-small"), (mt, "mt-small")):
        yield from pair(table, "attnkit compiled", "attnkit", "fp32", label)
        yield from pair(table, "attnkit", "attnkit no oneDNN", "fp32", label)


def round_ratios(ours: dict, ref: dict) -> list[float]:
    """The ratio of one round: the reference's step time over attnkit's in the same round (both
    ran one step each round, one after the other), one value per timed round."""
    return [r / o for o, r in zip(ours["times_s"], ref["times_s"], strict=True)]


def spreads(results: dict) -> dict[str, list[float]]:
    """For each attnkit / reference pair (:func:`comparisons`) and the two bf16 rows of
    :func:`ratios`: the lower quartile, the median and the upper quartile of its per-round
    ratios (:func:`round_ratios`), which show how far a single round can be from the ratio on
    this machine."""
    out = {
        name: statistics.quantiles(round_ratios(ours, ref), n=4)
        for name, ours, ref in comparisons(results)
        if len(ours["times_s"]) >= 4
    }
    lm, products = results.get("lm", {}), results.get("products", {})
    fp32, bf16 = products.get("lm-small products fp32"), products.get("lm-small products bf16")
    for ours in ("attnkit", "attnkit compiled"):
        name = f"lm-small: ({ours} bf16 / fp32) / (products bf16 / fp32)"
        steps = lm.get(f"{ours} bf16"), lm.get(f"{ours} fp32")
        if name in results["ratios"] and fp32 and bf16 and None not in steps:
            # one round: the step's bf16 gain over the products' bf16 gain in that round
            each = [
                s / p for s, p in zip(round_ratios(*steps), round_ratios(bf16, fp32), strict=True)
            ]
            out[name] = statistics.quantiles(each, n=4)
    return out


def print_report(results: dict) -> None:
    print(f"\nCPU: {results.get('cpu', 'not recorded')}")
    if rates := results.get("memory"):
        each = ", ".join(f"{rate / 1e9:.1f} GB/s in {size}" for size, rate in rates.items())
        print(f"memory: a tensor copy reads and writes {each} ({results['threads']} threads)")
    if choice := results.get("onednn"):
        print(f"float32 products: {'oneDNN' if choice['on'] else 'MKL'} ({choice['by']})")
    memory = "freed memory kept" if results.get("keep_memory") else "glibc's default malloc"
    print(
        f"training throughput, {results['threads']} threads, median of {results['repeats']} "
        f"interleaved steps, AdamW {results['adamw']}, {memory}"
    )
    if "lm" in results:
        print(f"\nlm-small, batch {LM_BATCH} x {LM_LEN} tokens")
        for name, row in results["lm"].items():
            loss, first = row["first_loss"], row["first_s"]
            print(
                f"  {name:<32} {row['per_s']:10.0f} tokens/s   first loss {loss:.4f}   "
                f"first step {first:.1f} s"
            )
    if skipped := results.get("bf16_skipped"):
        print(f"  ({skipped})")
    if "peak" in results:
        print("\nmatmul peak (4096 x 4096)")
        for name, row in results["peak"].items():
            print(f"  {name:<34} {row['per_s'] / 1e9:10.1f} GFLOP/s")
    if "products" in results:
        print("\nthe products of one lm-small step alone (forward and both gradients)")
        for name, row in results["products"].items():
            print(f"  {name:<34} {row['per_s'] / 1e9:10.1f} GFLOP/s")
    if "mt" in results:
        print(
            f"\nmt-small, batch {MT_BATCH}, source and target {MT_LEN} tokens, "
            f"{results['mt_padding']:.1%} padding"
        )
        for name, row in results["mt"].items():
            print(
                f"  {name:<32} {row['per_s']:10.0f} target tokens/s   "
                f"first loss {row['first_loss']:.4f}   first step {row['first_s']:.1f} s"
            )
    if "lm_flops_per_token" in results:
        flops = results["lm_flops_per_token"]
        print(f"\nlm-small model FLOPs per token (6 P + 12 L D T): {flops:,.0f}")
    spread = results.get("spreads", {})
    print(f"\n{'ratios (> 1: attnkit faster)':<68} {'value':>8} {'rounds':>18} {'target':>7}")
    for name, value in results["ratios"].items():
        # three decimals: a ratio of 1.297 against 1.3 is not met, which "1.30x" would hide
        text = f"{value:.1%}" if "MFU" in name else f"{value:.3f}x"
        rounds = "{1:.3f} ({0:.2f}-{2:.2f})".format(*spread[name]) if name in spread else ""
        target = TARGETS.get(name)
        goal = "" if target is None else (f"{target:.0%}" if "MFU" in name else f"{target:.2f}x")
        mark = "" if target is None else f"  {verdict(value, spread.get(name), target)}"
        print(f"  {name:<66} {text:>8} {rounds:>18} {goal:>7}{mark}")
    print(
        "\nvalue: the ratio of the medians; rounds: the median (quartiles) of the per-round "
        "ratios, one step of each candidate a round; met: both the value and the rounds' median "
        "reach the target"
    )
    choice = results.get("onednn")
    if choice and not choice.get("on") and "lm" in results:
        print(
            "on this CPU the float32 products go to MKL either way, so each row and its 'no "
            "oneDNN' twin run the same code: the gap between them is this run's spread"
        )


def verdict(value: float, spread: list[float] | None, target: float) -> str:
    """``"met"`` when the ratio of the medians reaches ``target`` and so does the median of the
    per-round ratios (``spread``'s middle value, where there is one): on a shared machine the
    two can differ by 0.1 or more in one run, and a target met by one of them only is not met
    (bench/history/ has runs of both kinds)."""
    met = value >= target and (spread is None or spread[1] >= target)
    return "met" if met else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="lm,mt", help="comma-separated: lm, mt")
    parser.add_argument(
        "--repeats",
        type=int,
        default=15,
        help="timed steps per candidate (rounds): one round strays 3-5%% on a shared machine, "
        "and more rounds narrow a ratio's spread (bench/history/)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--adamw", choices=("fused", "foreach", "loop"), default="fused")
    parser.add_argument("--json", type=Path, default=Path("runs/bench/training.json"))
    parser.add_argument(
        "--keep-memory",
        action="store_true",
        help="accel.keep_freed_memory() for the whole process (every candidate, references "
        "too): no step pays page faults for memory an earlier step freed",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.keep_memory and not accel.keep_freed_memory():
        raise SystemExit("--keep-memory: glibc's malloc is not in use here")
    results = run(args.suite.split(","), args.repeats, args.warmup, args.adamw)
    results["cpu"] = cpu_description()
    results["memory"] = memory_rates()
    results["onednn"] = accel.onednn_choice()
    results["keep_memory"] = args.keep_memory
    results["targets"] = {name: TARGETS[name] for name in results["ratios"] if name in TARGETS}
    print_report(results)
    print(f"\nwrote {save_results('training', results, args.json)}")


if __name__ == "__main__":
    main()
