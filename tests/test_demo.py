"""`attnkit demo`: every step runs and the report links every picture."""

import math
import warnings
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.cli.demo import SENTENCE, _steps_per_second, it_attention, run_demo
from attnkit.data import CharTokenizer
from attnkit.training import LanguageModelTask, TrainConfig
from attnkit.training.recipes import load_recipe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.needs("minilm", "shakespeare")  # the demo reads one, trains on the other


def test_demo_writes_the_report_and_the_pictures(tmp_path):
    lines = []

    def fake_train(out: Path, seconds: float):
        out.mkdir(parents=True)
        (out / "loss_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        return [out / "loss_curve.png"], f"trained {seconds:.0f} s"

    report = run_demo(tmp_path, train_seconds=7, say=lines.append, train=fake_train)
    text = "\n".join(lines)
    assert "0.1384" in text and "0.3405" in text  # step 1: the notes' softmax
    assert "it->animal" in text and "trained 7 s" in text  # steps 2 and 3
    page = report.read_text()
    for name in ("causal_mask.png", "it_attention_by_layer.png", "last_layer_heads.png",
                 "loss_curve.png"):  # fmt: skip
        assert name in page and any(p.name == name for p in tmp_path.rglob("*.png"))
    assert "self-attention" in page


def test_it_attends_to_animal_more_than_to_street_in_the_upper_layers():
    from attnkit.cli.demo import _minilm

    model, tokenizer = _minilm()
    tokens, attentions, it = it_attention(model, tokenizer, SENTENCE)
    animal, street = tokens.index("animal"), tokens.index("street")
    upper = [a[0, :, it].mean(0) for a in attentions[3:]]
    assert all(row[animal] > row[street] for row in upper)


def test_no_example_recipe_asks_for_bf16_by_name():
    """The recipes that train in bf16 say "auto" (the demo's among them): bf16 only where its
    products are fast. By name, bf16 crawls on an AVX2-only CPU: on a Zen 3 the demo was
    heading for 35 minutes."""
    for path in sorted(EXAMPLES.glob("*.toml")):
        assert load_recipe(path).train.precision in ("auto", "fp32"), path.name
    assert load_recipe(EXAMPLES / "shakespeare-char-3min.toml").train.precision == "auto"


def test_the_demo_sizes_its_run_by_a_measured_step():
    """train_for_demo runs seconds x this many steps: a positive rate, measured without
    training the model it is given (a copy takes the steps)."""
    torch.manual_seed(0)
    text = "to be, or not to be, that is the question "
    tokenizer = CharTokenizer.train([text])
    ids = torch.tensor(tokenizer.encode(text * 8))
    task = LanguageModelTask({"train": ids, "validation": ids}, 16)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, max_len=16)
    model = ak.DecoderLM(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "auto" never takes the slow bf16
        rate = _steps_per_second(model, task, TrainConfig(batch_size=4, precision="auto"))
    assert 0 < rate < math.inf
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
