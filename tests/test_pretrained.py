"""save_pretrained / from_pretrained round trips, atomic writes, clear errors, and the
`attnkit generate` command on a saved model."""

import json

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer
from attnkit.files import atomic_directory

CFG = ak.ModelConfig.preset("tiny", vocab_size=60, position="rope", n_kv_heads=2)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ak.DecoderLM(CFG),
        lambda: ak.Transformer(CFG.replace(norm="post", position="sinusoidal")),
        lambda: ak.EncoderModel(CFG.replace(type_vocab_size=2, pooler=True)),
        lambda: ak.EncoderClassifier(CFG, num_classes=3, pooling="mean"),
    ],
    ids=["decoder", "encoder-decoder", "encoder", "classifier"],
)
def test_round_trip_is_exact(tmp_path, build):
    torch.manual_seed(0)
    model = build().eval()
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    loaded = ak.from_pretrained(tmp_path / "m")
    assert type(loaded) is type(model) and not loaded.training
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    ids = torch.tensor([[5, 6, 7, 8]])
    if isinstance(model, ak.Transformer):
        torch.testing.assert_close(loaded(ids, ids), model(ids, ids), atol=0, rtol=0)
    else:
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    if isinstance(model, ak.EncoderClassifier):
        assert loaded.pooling == "mean" and loaded.classifier.out_features == 3


def test_tied_weights_stay_tied_and_the_tokenizer_comes_along(tmp_path):
    tok = CharTokenizer.train(["to be or not to be"])
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    loaded = ak.from_pretrained(tmp_path / "m")
    assert loaded.lm_head.weight is loaded.embeddings.tokens.weight
    assert ak.interop.load_tokenizer_for(tmp_path / "m").encode("to be") == tok.encode("to be")


def test_a_failed_write_leaves_the_previous_directory_intact(tmp_path):
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny"))
    model.save_pretrained(tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(tmp_path / "m") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("disk full")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary left behind


def _saved(tmp_path):
    ak.DecoderLM(ak.ModelConfig.preset("tiny")).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ak.from_pretrained(tmp_path / "missing")
    path = _saved(tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="cannot read the weights"):
        ak.from_pretrained(path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        ak.from_pretrained(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ak.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="'t5' is not supported"):
        ak.from_pretrained(path)
    config = json.loads((_saved(tmp_path / "b") / "config.json").read_text())
    config["config"]["d_modle"] = 3
    (tmp_path / "b" / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="d_modle"):
        ak.from_pretrained(tmp_path / "b" / "m")


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    path = _saved(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["config"]["n_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not fit the config"):
        ak.from_pretrained(path)


def test_generate_command_streams_a_continuation(tmp_path, capsys):
    tok = CharTokenizer.train(["to be or not to be, that is the question"])
    torch.manual_seed(0)
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", vocab_size=tok.vocab_size, eos_id=None))
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    assert (
        main(["generate", str(tmp_path / "m"), "to be", "--greedy", "--max-new-tokens", "12"]) == 0
    )
    out = capsys.readouterr().out
    expected = model.generate(torch.tensor([tok.encode("to be")]), 12)[0, 5:].tolist()
    assert out == "to be" + tok.decode(expected) + "\n"
    assert (
        main(["generate", "--checkpoint", str(tmp_path / "m"), "to", "--max-new-tokens", "5"]) == 0
    )
    assert capsys.readouterr().out.startswith("to")
    assert main(["generate", str(tmp_path / "nope"), "x"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "m"), "x", "--max-new-tokens", "999"]) == 2
    assert "max_len=128" in capsys.readouterr().err
