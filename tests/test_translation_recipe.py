"""The paper's recipe around a trained translator: checkpoint averaging (kept snapshots, the
element-wise mean, refusals) and the beam-search length penalty chosen on validation data and
recorded with the model."""

import json

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer
from attnkit.training import translation
from attnkit.training.averaging import average_models, models_to_average
from attnkit.training.checkpoint import keep_snapshot, read_recipe, snapshots
from attnkit.training.translation import (
    TranslationTask,
    choose_length_penalty,
    read_decoding,
    write_decoding,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------------------------
# Checkpoint averaging
# --------------------------------------------------------------------------------------------


def tiny_translator(seed: int, d_model: int = 16):
    tokenizer = CharTokenizer.train(["Gute Nacht!", "Good night!"])
    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=tokenizer.vocab_size, d_model=d_model, d_ff=32, tie_embeddings=True
    )
    torch.manual_seed(seed)
    return ak.Transformer(cfg), tokenizer


def test_the_average_is_the_element_wise_mean(tmp_path):
    models = []
    for seed in range(3):
        model, tokenizer = tiny_translator(seed)
        model.save_pretrained(tmp_path / f"m{seed}", tokenizer=tokenizer)
        models.append(model)
    out = average_models([tmp_path / f"m{seed}" for seed in range(3)], tmp_path / "avg")
    averaged = ak.from_pretrained(out)
    states = [m.state_dict() for m in models]
    for name, value in averaged.state_dict().items():
        expected = sum(s[name].double() for s in states) / 3
        assert torch.allclose(value.double(), expected, atol=1e-7), name
    # tied weights stay tied: source and target embeddings and the output layer are one tensor
    assert averaged.lm_head.weight.data_ptr() == averaged.src_embeddings.tokens.weight.data_ptr()
    assert (out / "tokenizer.json").is_file()


def test_averaging_refuses_models_that_do_not_match(tmp_path):
    small, tokenizer = tiny_translator(0)
    wide, _ = tiny_translator(0, d_model=32)
    small.save_pretrained(tmp_path / "small", tokenizer=tokenizer)
    wide.save_pretrained(tmp_path / "wide", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="another architecture"):
        average_models([tmp_path / "small", tmp_path / "wide"], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()
    with pytest.raises(FileNotFoundError, match="keep_checkpoints"):
        models_to_average([tmp_path / "nothing"])


def test_kept_snapshots_roll_and_average_from_the_command_line(tmp_path, capsys):
    model, tokenizer = tiny_translator(0)
    recipe = {"name": "toy", "task": "translation", "data": {"corpus": "help-de-en"}}
    for step in (10, 20, 30, 40):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        keep_snapshot(tmp_path, model, step, 3, tokenizer=tokenizer, recipe=recipe)
    assert [p.name for p in snapshots(tmp_path)] == ["step-0000020", "step-0000030", "step-0000040"]
    assert read_recipe(snapshots(tmp_path)[-1]) == recipe
    keep_snapshot(tmp_path, model, 25, 3, tokenizer=tokenizer, recipe=recipe)  # resumed at 25
    assert [p.name for p in snapshots(tmp_path)] == ["step-0000020", "step-0000025"]

    assert (
        main(
            ["average", str(tmp_path / "checkpoints"), "--last", "2", "--out", str(tmp_path / "a")]
        )
        == 0
    )
    assert "averaged 2 models" in capsys.readouterr().out
    assert read_recipe(tmp_path / "a") == recipe
    assert main(["average", str(tmp_path / "none"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "keep_checkpoints" in err


# --------------------------------------------------------------------------------------------
# The length penalty, chosen on validation data and recorded with the model
# --------------------------------------------------------------------------------------------

PAIRS = [
    ("Gute Nacht!", "Good night!"),
    ("Ich bin müde.", "I am tired."),
    ("Es regnet heute.", "It is raining today."),
]


def test_the_length_penalty_with_the_best_validation_bleu_is_chosen(monkeypatch):
    tokenizer = CharTokenizer.train([t for pair in PAIRS for t in pair])
    task = TranslationTask({"train": PAIRS, "validation": PAIRS}, tokenizer, 32)
    references = dict(PAIRS)

    def fake_translate(model, tokenizer, sources, *, length_penalty, **options):
        # right at 0.8 and 1.5, one word short elsewhere
        if length_penalty in (0.8, 1.5):
            return [references[s] for s in sources]
        return [references[s].rsplit(" ", 1)[0] for s in sources]

    monkeypatch.setattr(translation, "translate", fake_translate)
    seen = []
    best, scores = choose_length_penalty(
        None, task, candidates=(0.6, 1.5, 0.8, 1.0), progress=lambda p, s: seen.append(p)
    )
    assert best == 1.5  # a tie goes to the candidate listed first
    assert scores[1.5]["bleu"] == scores[0.8]["bleu"] == pytest.approx(100.0)
    assert scores[1.0]["bleu"] < 90
    assert seen == [0.6, 1.5, 0.8, 1.0]
    with pytest.raises(ValueError, match="choose on validation data"):
        choose_length_penalty(None, task, split="test")


def test_decoding_settings_round_trip_and_bad_files_are_named(tmp_path):
    assert read_decoding(tmp_path) == {"num_beams": 4, "length_penalty": 1.0}
    write_decoding(tmp_path, {"num_beams": 5, "length_penalty": 0.6, "chosen_on": "validation"})
    assert read_decoding(tmp_path)["length_penalty"] == 0.6
    (tmp_path / "decoding.json").write_text(json.dumps({"num_beams": 0, "length_penalty": 1}))
    with pytest.raises(ValueError, match="num_beams must be an int >= 1, got 0"):
        read_decoding(tmp_path)
