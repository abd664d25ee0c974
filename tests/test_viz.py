"""`attnkit viz`: the HTML report, the PNGs and the bertviz export from a model over a text."""

import json

import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer


def test_viz_of_an_untrained_encoder_decoder_writes_all_three_attentions(tmp_path, capsys):
    html, png, bv = tmp_path / "r.html", tmp_path / "png", tmp_path / "b.json"
    argv = ["viz", "ich bin hier", "--target", "i am here", "--family", "encoder-decoder"]
    assert main([*argv, "--html", str(html), "--png", str(png), "--bertviz", str(bv)]) == 0
    page = html.read_text()
    for name in ("encoder self-attention", "decoder self-attention", "cross-attention"):
        assert name in page
    assert "encoder rollout" in page and "decoder rollout" in page  # attention followed down
    assert "http://" not in page and "https://" not in page  # offline
    assert sorted(p.name for p in png.iterdir()) == sorted(
        f"{kind}_layer{i}.png" for kind in ("encoder", "decoder", "cross") for i in (0, 1)
    )
    data = json.loads(bv.read_text())
    assert len(data["attention"]) == 3  # all, encoder-decoder pairs as bertviz lays them out
    assert "wrote" in capsys.readouterr().out


def test_viz_of_a_saved_decoder_escapes_hostile_tokens(tmp_path):
    tok = CharTokenizer.train(["<img src=x onerror=alert(1)> hello"])
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", vocab_size=tok.vocab_size))
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    html = tmp_path / "r.html"
    assert main(["viz", "<img src=x>", "--model", str(tmp_path / "m"), "--html", str(html)]) == 0
    page = html.read_text()
    assert "<img src=x>" not in page  # the tokens are data, never markup


def test_viz_usage_errors(tmp_path, capsys):
    assert main(["viz", "a b", "--family", "encoder-decoder"]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["viz", "a b", "--model", str(tmp_path / "none")]) == 2
    assert main(["viz", "a b", "--family", "nope"]) == 2


def test_default_output_is_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    assert main(["viz", "今天 下雨 我 没 带 伞"]) == 0
    assert (tmp_path / "runs" / "viz" / "report.html").is_file()


def test_viz_svg_writes_vector_pictures_a_paper_can_use(tmp_path, capsys):
    svg = tmp_path / "svg"
    assert main(["viz", "今天 下雨 我 没 带 伞", "--svg", str(svg)]) == 0
    files = sorted(p.name for p in svg.iterdir())
    assert files == ["self_layer0.svg", "self_layer1.svg"]
    text = (svg / "self_layer0.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "<image" in text or "<path" in text  # drawn as vector shapes (the grid an image)
    assert "wrote" in capsys.readouterr().out
