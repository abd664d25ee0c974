"""`attnkit demo`: every step runs and the report links every picture."""

import warnings
from pathlib import Path

import pytest
import torch

from attnkit.cli.demo import SENTENCE, it_attention, run_demo, train_for_demo

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


def test_the_demo_trains_in_the_precision_this_cpu_runs_fast(tmp_path):
    """Step 3 for real, as short as it goes (30 steps): the recipe's precision "auto" never
    takes bf16 where its products crawl (on a Zen 3 a bf16 demo was heading for 35 minutes), so
    nothing warns; the loss curve and a sample come out."""
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            pictures, summary = train_for_demo(tmp_path / "run", seconds=0.1)
    finally:
        torch.set_num_threads(threads)  # the recipe sets one thread
    assert summary.startswith("(30 steps in ") and "validation loss" in summary
    assert [p.name for p in pictures] == ["loss_curve.png"]
