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


def svg_heatmaps(path) -> list:
    """The heatmaps of an SVG that ``attnkit viz --svg`` wrote: one RGB picture per head, as
    drawn (matplotlib stores each upside down under a ``scale(1 -1)`` transform)."""
    import base64
    import io
    import xml.etree.ElementTree as ET

    from PIL import Image, ImageOps

    pictures = []
    for image in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}image"):
        href = image.get("{http://www.w3.org/1999/xlink}href") or image.get("href")
        data = base64.b64decode(href.split(",", 1)[1])
        picture = Image.open(io.BytesIO(data)).convert("RGB")
        if "scale(1 -1)" in (image.get("transform") or ""):
            picture = ImageOps.flip(picture)
        pictures.append(picture)
    return pictures


def test_viz_svg_writes_vector_pictures_a_paper_can_use(tmp_path, capsys):
    """Text and axes as vector shapes, each head's grid a picture of its weights: for a decoder,
    the causal mask's zeros above the diagonal in viridis' darkest colour, and the first query's
    whole weight on the first key in its brightest (each head scaled to its largest weight)."""
    from matplotlib import colormaps

    dark, bright = (tuple(round(255 * c) for c in colormaps["viridis"](v)[:3]) for v in (0, 1.0))
    words = "今天 下雨 我 没 带 伞"
    for family in ("decoder", "encoder"):
        svg = tmp_path / family
        assert main(["viz", words, "--family", family, "--svg", str(svg)]) == 0
        assert "wrote" in capsys.readouterr().out
        files = sorted(p.name for p in svg.iterdir())
        assert files == ["self_layer0.svg", "self_layer1.svg"]
        text = (svg / "self_layer0.svg").read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text
        assert all(f"<!-- head {h} -->" in text for h in range(4))  # the labels as text
        assert all(f"<!-- {word} -->" in text for word in words.split())  # the axes' words
        heads = svg_heatmaps(svg / "self_layer0.svg")
        assert len(heads) == 4
        for picture in heads:
            width, height = picture.size

            def cell(i, j, picture=picture, width=width, height=height):
                return picture.getpixel((int((j + 0.5) * width / 6), int((i + 0.5) * height / 6)))

            def near(a, b):  # the same colour, to the PNG's rounding
                return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 2

            above = [cell(i, j) for i in range(6) for j in range(i + 1, 6)]
            if family == "decoder":
                assert all(near(c, dark) for c in above) and near(cell(0, 0), bright)
            else:  # no mask: every key gets some weight
                assert not any(near(c, dark) for c in above)
