"""Training speed: attnkit against reference implementations, measured side by side.

Two fixed configurations (bench/README.md lists every size):

- ``lm-small``: attnkit's DecoderLM (preset "lm-small": vocab 8192, d_model 256, 8 heads,
  4 layers, d_ff 1024, 256 positions, Pre-LN, GELU, tied embeddings, no dropout), batch 8 x 256
  tokens, against Hugging Face ``GPT2LMHeadModel`` (sdpa attention, given attnkit's weights
  through ``interop.gpt2_to_hf``) and x-transformers' ``TransformerWrapper(Decoder)`` of the same
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
import contextlib
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from x_transformers import Decoder, TransformerWrapper

import attnkit as ak
from attnkit import accel
from attnkit.accel import onednn_linear_available
from attnkit.interop import gpt2_to_hf

transformers.logging.set_verbosity_error()

SEED = 0
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
# attnkit's variants, as (compiled layers, oneDNN products): the trainer's step (eager layers,
# oneDNN products where accel.onednn_choice() measured them faster: None), its layers compiled
# (train.compile), and both without the oneDNN products (ATTNKIT_ONEDNN_LINEAR=0), which leaves
# float32 products to torch's own GEMM (MKL on x86)
PADDED = "attnkit padded stacks"  # mt-small: the trainer's step without accel.unpad_stacks
VARIANTS = {
    "attnkit": (False, None),
    "attnkit compiled": (True, None),
    "attnkit no oneDNN": (False, False),
    "attnkit compiled, no oneDNN": (True, False),
}
LM_BATCH, LM_LEN = 8, 256
MT_BATCH, MT_LEN, MT_MIN_LEN = 32, 64, 51  # lengths uniform in [51, 64]: about 10% padding


# --------------------------------------------------------------------------------------------
# Timing: candidates interleaved round by round
# --------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    """One thing to time: ``run()`` does one unit of work (a training step, a matmul)."""

    name: str
    run: Callable[[], object]
    work: float  # tokens (or FLOPs) per run
    times: list[float] = field(default_factory=list)
    first: object = None  # what the first run returned (a training step: its loss)
    first_s: float = 0.0  # how long the first run took (a compiled step: compiling included)

    @property
    def rate(self) -> float:
        """Work per second, from the median time."""
        return self.work / statistics.median(self.times)


def measure(candidates: list[Candidate], repeats: int, warmup: int) -> None:
    """Time every candidate ``repeats`` times, interleaved, after ``warmup`` untimed rounds.
    Each round runs them in a new order (shuffled, seeded), so that no candidate always
    follows the same one: the step after a 4096 x 4096 bf16 product ran 4-14% slower, and a
    step that follows one which handed much memory back to the kernel faults its own memory in
    again (bench/README.md: 26,925 page faults a step for the candidate that always came after
    the bf16 products when each round only started one candidate further on, 0 in the median
    round when shuffled)."""
    order = random.Random(SEED)
    for round_ in range(warmup + repeats):
        shuffled = list(candidates)
        order.shuffle(shuffled)
        for c in shuffled:
            start = time.perf_counter()
            result = c.run()
            elapsed = time.perf_counter() - start
            if round_ == 0:
                c.first, c.first_s = result, elapsed
            if round_ >= warmup:
                c.times.append(elapsed)


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
        linear = torch.ops.mkldnn._linear_pointwise
        out.append(
            Candidate(
                f"oneDNN matmul {n} {name}",
                lambda: linear(a, bt, None, "none", [], ""),
                flops,
            )
        )
    return out


def onednn_switch(onednn: bool | None):
    """``accel.onednn_linear(onednn)``; None leaves the default (``accel.onednn_choice()``)."""
    return contextlib.nullcontext() if onednn is None else accel.onednn_linear(onednn)


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
        with autocast, onednn_switch(onednn), accel.onednn_products():
            for x, w, gy in zip(xs, ws, gys, strict=True):
                F.linear(x, w).backward(gy)

    flops = 6.0 * rows * sum(i * o for i, o in shapes)
    suffix = {None: "", False: " no oneDNN", True: " oneDNN"}[onednn]
    return Candidate(f"lm-small products {precision}{suffix}", run, flops)


# --------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW as every candidate gets it: ``fused`` (one kernel per tensor group), ``foreach``
    or ``loop`` (PyTorch's per-parameter loop, its CPU default)."""
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **options[kind])


def train_step(
    loss_of: Callable[[], Tensor], optimizer: torch.optim.Optimizer, precision: str
) -> Callable[[], float]:
    """One step: loss -> backward -> AdamW. bf16 runs the forward and the loss under autocast
    (weights, gradients and optimizer state stay float32)."""
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "bf16"
        else contextlib.nullcontext()
    )

    def step() -> float:
        with autocast:
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def logits_loss(
    logits_of: Callable[[], Tensor], targets: Tensor, ignore_index: int = -100
) -> Callable[[], Tensor]:
    """The usual loss: the model's logits (B, N, V), then ``F.cross_entropy`` over them."""
    flat = targets.reshape(-1)

    def loss() -> Tensor:
        logits = logits_of()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index
        )

    return loss


# --------------------------------------------------------------------------------------------
# lm-small: attnkit DecoderLM, Hugging Face GPT-2, x-transformers
# --------------------------------------------------------------------------------------------


def lm_models() -> dict[str, nn.Module]:
    """The language models, seeded, one per candidate ("attnkit logits" is a second copy of
    attnkit's, so each has its own optimizer state); GPT-2 holds attnkit's weights exactly."""
    cfg = ak.ModelConfig.preset("lm-small")

    def attnkit() -> ak.DecoderLM:
        torch.manual_seed(SEED)
        return ak.DecoderLM(cfg).train()

    ours = attnkit()
    variants = {name: attnkit() for name in VARIANTS if name != "attnkit"}
    hf_config, state = gpt2_to_hf(ours)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**hf_config, attn_implementation="sdpa")
    )
    gpt2.load_state_dict(state, strict=False)  # strict=False: GPT-2's causal-mask buffers
    torch.manual_seed(SEED)
    xt = TransformerWrapper(
        num_tokens=cfg.vocab_size,
        max_seq_len=cfg.max_len,
        attn_layers=Decoder(
            dim=cfg.d_model,
            depth=cfg.n_layers,
            heads=cfg.n_heads,
            attn_dim_head=cfg.d_head,  # its default (64) would make attention twice as wide
            ff_mult=cfg.d_ff // cfg.d_model,
            attn_flash=True,  # torch's fused attention, as attnkit and GPT-2 (sdpa) use
        ),
        tie_embedding=True,
    )
    return {
        "attnkit": ours,
        **variants,
        "attnkit logits": attnkit(),
        "HF GPT-2": gpt2.train(),
        "x-transformers": xt.train(),
    }


def lm_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 8192, (LM_BATCH, LM_LEN + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]  # inputs, next-token targets


def with_levers(
    loss_of: Callable[[], Tensor], model: nn.Module, variant: str = "attnkit"
) -> Callable[[], Tensor]:
    """attnkit's forward (and loss) with the speed levers the trainer applies to a step
    (``attnkit.accel.onednn_products``, ``accel.fast_attention``, and
    ``accel.compiled_layers`` for ``train.compile``) as ``variant`` (a key of VARIANTS) says;
    the references run as they are."""
    compiled, onednn = VARIANTS[variant]

    def run() -> Tensor:
        with (
            onednn_switch(onednn),
            accel.onednn_products(),
            accel.fast_attention(),
            accel.compiled_layers(model, compiled),
        ):
            return loss_of()

    return run


def lm_losses(models: dict[str, nn.Module], inputs: Tensor, targets: Tensor) -> dict:
    """Each candidate's loss. attnkit's own training loss is ``DecoderLM.loss`` (the LM head
    and the cross-entropy fused, no logits tensor); "attnkit logits" is the same model through
    its logits and ``F.cross_entropy``, as the references run."""
    plain = models["attnkit logits"]
    gpt2, xt = models["HF GPT-2"], models["x-transformers"]

    def ours(variant: str) -> Callable[[], Tensor]:
        model = accel.apply(models[variant])
        return with_levers(lambda: model.loss(inputs, targets), model, variant)

    return {
        **{variant: ours(variant) for variant in VARIANTS},
        "attnkit logits": with_levers(logits_loss(lambda: plain(inputs), targets), plain),
        "HF GPT-2": logits_loss(lambda: gpt2(inputs).logits, targets),
        "x-transformers": logits_loss(lambda: xt(inputs), targets),
    }


def lm_flops_per_token(model: ak.DecoderLM) -> float:
    """6 P + 12 L D T (see the module docstring)."""
    cfg = model.cfg
    positions = model.embeddings.positions
    p = model.num_parameters() - (0 if positions is None else positions.embedding.weight.numel())
    return 6.0 * p + 12.0 * cfg.n_layers * cfg.d_model * cfg.max_len


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


class TorchSeq2Seq(nn.Module):
    """torch.nn.Transformer made into a translation model the way mt-small is built: a shared
    embedding times sqrt(d_model) plus the sinusoidal table, Post-LN layers, ReLU, and the output
    layer tied to the embedding. (nn.Transformer adds a final LayerNorm to each stack.)"""

    def __init__(self, cfg: ak.ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer("table", ak.sinusoidal_table(cfg.max_len, cfg.d_model))
        self.scale = math.sqrt(cfg.d_model)
        self.core = nn.Transformer(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_layers,
            cfg.n_layers,
            cfg.d_ff,
            dropout=0.0,
            batch_first=True,
        )
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.out.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=cfg.d_model**-0.5)  # as attnkit's scaled tables

    def forward(self, src: Tensor, tgt: Tensor, src_real: Tensor, tgt_real: Tensor) -> Tensor:
        s = self.embed(src) * self.scale + self.table[: src.shape[1]]
        t = self.embed(tgt) * self.scale + self.table[: tgt.shape[1]]
        blocked = ~ak.causal_mask(tgt.shape[1])  # torch's bool attn_mask: True = blocked
        hidden = self.core(
            s,
            t,
            tgt_mask=blocked,
            tgt_is_causal=True,
            # torch's key_padding_mask means True = padding: the opposite of attnkit's masks
            src_key_padding_mask=~src_real,
            tgt_key_padding_mask=~tgt_real,
            memory_key_padding_mask=~src_real,
        )
        return self.out(hidden)


def mt_models() -> dict[str, nn.Module]:
    """The translation models, seeded, one per candidate (as :func:`lm_models`)."""
    cfg = ak.ModelConfig.preset("mt-small")

    def attnkit() -> ak.Transformer:
        torch.manual_seed(SEED)
        return ak.Transformer(cfg).train()

    ours = attnkit()
    variants = {name: attnkit() for name in (*VARIANTS, PADDED) if name != "attnkit"}
    torch.manual_seed(SEED)
    reference = TorchSeq2Seq(cfg).train()
    torch.manual_seed(SEED)
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_len,
            d_model=cfg.d_model,
            encoder_layers=cfg.n_layers,
            decoder_layers=cfg.n_layers,
            encoder_attention_heads=cfg.n_heads,
            decoder_attention_heads=cfg.n_heads,
            encoder_ffn_dim=cfg.d_ff,
            decoder_ffn_dim=cfg.d_ff,
            activation_function="relu",
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            scale_embedding=True,
            pad_token_id=cfg.pad_id,
            bos_token_id=cfg.bos_id,
            eos_token_id=cfg.eos_id,
            decoder_start_token_id=cfg.bos_id,
            attn_implementation="sdpa",
        )
    )
    return {
        "attnkit": ours,
        **variants,
        "attnkit logits": attnkit(),
        "torch.nn.Transformer": reference,
        "HF BART": bart.train(),
    }


def mt_batch() -> dict[str, Tensor]:
    """Sources and targets with lengths uniform in [MT_MIN_LEN, MT_LEN], right-padded with 0."""
    cfg = ak.ModelConfig.preset("mt-small")
    g = torch.Generator().manual_seed(SEED)

    def padded() -> Tensor:
        ids = torch.randint(3, cfg.vocab_size, (MT_BATCH, MT_LEN), generator=g)
        lengths = torch.randint(MT_MIN_LEN, MT_LEN + 1, (MT_BATCH, 1), generator=g)
        return ids.masked_fill(torch.arange(MT_LEN) >= lengths, cfg.pad_id)

    src, tgt = padded(), padded()
    tgt_in = ak.shift_right(tgt, cfg.bos_id)  # teacher forcing: [BOS, y_1 .. y_{T-1}]
    tgt_in_real = torch.cat([torch.ones_like(tgt[:, :1], dtype=torch.bool), tgt[:, :-1] != 0], 1)
    return {"src": src, "src_real": src != 0, "tgt_in": tgt_in, "tgt_in_real": tgt_in_real,
            "targets": tgt}  # fmt: skip


def mt_losses(models: dict[str, nn.Module], b: dict[str, Tensor]) -> dict:
    """Each candidate's loss over the real target tokens (padding is ignore_index 0)."""
    plain = models["attnkit logits"]
    ref, bart = models["torch.nn.Transformer"], models["HF BART"]
    args = (b["src"], b["tgt_in"], b["src_real"], b["tgt_in_real"])

    def bart_logits() -> Tensor:
        return bart(
            input_ids=b["src"],
            attention_mask=b["src_real"].long(),
            decoder_input_ids=b["tgt_in"],
            decoder_attention_mask=b["tgt_in_real"].long(),
        ).logits

    def ours(variant: str) -> Callable[[], Tensor]:
        model = accel.apply(models[variant], unpadded=variant != PADDED)
        return with_levers(
            lambda: model.loss(*args[:2], b["targets"], *args[2:], ignore_index=0),
            model,
            "attnkit" if variant == PADDED else variant,
        )

    return {
        **{variant: ours(variant) for variant in (*VARIANTS, PADDED)},
        "attnkit logits": with_levers(logits_loss(lambda: plain(*args), b["targets"], 0), plain),
        "torch.nn.Transformer": logits_loss(lambda: ref(*args), b["targets"], 0),
        "HF BART": logits_loss(bart_logits, b["targets"], 0),
    }


def mt_candidates(adamw: str) -> list[Candidate]:
    b = mt_batch()
    real = float((b["targets"] != 0).sum())  # target tokens that count (padding does not)
    models = mt_models()
    out = []
    for name, loss_of in mt_losses(models, b).items():
        step = train_step(loss_of, make_optimizer(models[name], adamw), "fp32")
        out.append(Candidate(f"{name} fp32", step, real))
    return out


def mt_padding() -> float:
    b = mt_batch()
    real = (b["src_real"].float().mean() + (b["targets"] != 0).float().mean()) / 2
    return 1.0 - float(real)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


# where accel.bf16_products_fast() is False (an AVX2-only CPU such as Zen 3): a round of the
# bf16 candidates, the 4096 x 4096 bf16 product among them, would take most of the run
SLOW_BF16 = (
    "torch has no fast bf16 products on this CPU (accel.bf16_products_fast() is False): they "
    "fall back to a scalar loop, about 100x slower than float32 at 512 x 512"
)
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


def cpu_description() -> str:
    """The processor as lscpu names it: model name, family and model (from /proc/cpuinfo), so
    figures from different CPUs are never read as if they were comparable."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f", family {fields['cpu family']}, model {fields.get('model', '?')}"
    return f"{name}, {os.cpu_count()} CPU(s)"


def memory_rates(sizes_mib: tuple[int, ...] = (1, 64)) -> dict[str, float]:
    """Bytes read and written per second by a float32 tensor copy of each size (torch's threads;
    the median of several copies): how fast this machine moves data inside its caches and
    beyond them. Machines that report the same processor (cloud machines) can differ here, and
    much of a step's work outside its products reads and writes memory (bench/README.md)."""
    rates = {}
    for mib in sizes_mib:
        src = torch.ones(mib << 18)  # mib MiB of float32
        dst = torch.empty_like(src)
        times = []
        for _ in range(max(6, 256 // mib)):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        rates[f"{mib} MiB"] = 2 * src.nbytes / statistics.median(times[1:])
    return rates


def print_report(results: dict) -> None:
    print(f"\nCPU: {results.get('cpu', 'not recorded')}")
    if rates := results.get("memory"):
        each = ", ".join(f"{rate / 1e9:.1f} GB/s in {size}" for size, rate in rates.items())
        print(f"memory: a tensor copy reads and writes {each} ({results['threads']} threads)")
    if choice := results.get("onednn"):
        print(accel.onednn.describe_choice(choice))
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
    (bench/README.md has runs of both kinds)."""
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
        "and more rounds narrow a ratio's spread (bench/README.md)",
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
    print_report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
