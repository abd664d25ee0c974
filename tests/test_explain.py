"""attnkit.explain, the model-independent parts: the sqrt(d_k) experiment, PNG pictures, the
CJK font fallback, the offline HTML report (and its escaping), the bertviz layout."""

import json
import math
import os
import re
import struct
import warnings
from pathlib import Path

import matplotlib.image
import pytest
import torch
from matplotlib.figure import Figure

import attnkit as ak
from attnkit.explain import (
    MissingFontWarning,
    attention_sections,
    bertviz_data,
    export_bertviz_json,
    fonts,
    format_scaling_table,
    plot_attention_heads,
    plot_attention_heatmap,
    plot_mask,
    plot_scaling,
    plot_schedule,
    plot_sinusoidal_table,
    plots,
    render_attention_html,
    scaling,
    scaling_experiment,
    to_bertviz,
    warmup_schedule,
)
from attnkit.explain.scaling import DEFAULT_D_KS, dot_product_variance, softmax_jacobian

HOSTILE = "<img src=x onerror=alert(1)>"
CLOSER = "</script><script>alert(2)</script>"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and decoding it completely."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    pixels = matplotlib.image.imread(path)  # fails on a truncated or corrupt file
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0, "the picture is blank"
    return width, height


def softmax_rows(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1)


# --------------------------------------------------------------------------------------------
# The sqrt(d_k) experiment
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rows():
    return scaling_experiment()


def test_measured_variance_of_q_dot_k_is_d_k_within_5_percent(rows):
    assert [r.d_k for r in rows] == list(DEFAULT_D_KS)
    for r in rows:
        assert abs(r.var_ratio - 1.0) < 0.05, (r.d_k, r.var_qk)
    # reliably, not by luck of one seed
    for seed in range(1, 6):
        for d_k in (4, 64):
            gen = torch.Generator().manual_seed(seed)
            assert abs(dot_product_variance(d_k, generator=gen) / d_k - 1.0) < 0.05


def test_unscaled_softmax_saturates_as_d_k_grows(rows):
    raw = [r.unscaled for r in rows]
    maxes = [s.max_weight for s in raw]
    assert maxes == sorted(maxes), maxes  # more peaked with every d_k
    assert raw[-1].max_weight > 0.9
    assert raw[-1].entropy < 0.3 < 2.0 < raw[0].entropy
    # the typical row's Jacobian all but vanishes; even the mean (carried by close calls) drops
    assert raw[-1].jacobian_median < 0.05 * raw[0].jacobian_median
    assert raw[-1].jacobian_mean < 0.5 * raw[0].jacobian_mean
    assert raw[-1].logit_std == pytest.approx(math.sqrt(512), rel=0.1)


def test_scaled_softmax_stays_moderate_at_every_d_k(rows):
    for r in rows:
        s = r.scaled
        assert 0.1 < s.max_weight < 0.25, (r.d_k, s)
        assert s.entropy > 2.8  # log 32 = 3.47 is uniform
        assert 0.18 < s.jacobian_median < 0.3, (r.d_k, s)
        assert s.logit_std == pytest.approx(1.0, rel=0.1)
    medians = [r.scaled.jacobian_median for r in rows]
    assert max(medians) / min(medians) < 1.25


def test_softmax_jacobian_is_the_autograd_jacobian():
    z = torch.randn(7, dtype=torch.float64)
    expected = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), z)
    torch.testing.assert_close(softmax_jacobian(torch.softmax(z, -1)), expected)


def test_scaling_weights_come_from_the_library(monkeypatch):
    calls = []

    def spy(q, k, v, mask=None, **kwargs):
        calls.append((q.shape[-1], kwargs.get("scale"), kwargs.get("return_weights")))
        return ak.scaled_dot_product_attention(q, k, v, mask, **kwargs)

    monkeypatch.setattr(scaling, "scaled_dot_product_attention", spy)
    scaling_experiment((4, 16), n_queries=8, samples=100)
    assert calls == [
        (4, 1.0, True),
        (4, 0.5, True),
        (16, 1.0, True),
        (16, 0.25, True),
    ]


def test_scaling_table_and_plot(rows, tmp_path):
    table = format_scaling_table(rows)
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("d_k"))
    body = lines[header + 1 : header + 1 + len(rows)]
    assert [int(line.split()[0]) for line in body] == list(DEFAULT_D_KS)
    assert "log 32 = 3.466" in table
    path = plot_scaling(rows, tmp_path / "scaling.png")
    assert png_size(path) == (1000, 750)
    with pytest.raises(ValueError, match="d_ks"):
        scaling_experiment([])
    with pytest.raises(ValueError, match="each d_k must be a positive int, got 0"):
        scaling_experiment([4, 0])


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------


def test_fixed_size_pictures_have_their_documented_pixel_size(tmp_path):
    assert png_size(plot_schedule(512, 4000, 20000, tmp_path / "s.png")) == (800, 450)
    assert png_size(plot_sinusoidal_table(50, 32, tmp_path / "pe.png", dpi=50)) == (450, 400)


def test_heatmap_size_follows_tokens_and_dpi(tmp_path):
    tokens = [f"t{i}" for i in range(6)]
    small = png_size(plot_attention_heatmap(softmax_rows(6, 6), tokens, tokens, tmp_path / "a.png"))
    sharp = plot_attention_heatmap(softmax_rows(6, 6), tokens, tokens, tmp_path / "b.png", dpi=200)
    assert png_size(sharp) == (2 * small[0], 2 * small[1])
    many = [f"t{i}" for i in range(20)]
    big = png_size(plot_attention_heatmap(softmax_rows(20, 20), many, many, tmp_path / "c.png"))
    assert big[0] > small[0] and big[1] > small[1]
    wide = [f"k{i}" for i in range(30)]
    rect = png_size(
        plot_attention_heatmap(softmax_rows(3, 30), tokens[:3], wide, tmp_path / "d.png")
    )
    assert rect[0] > rect[1]


def test_heads_and_masks_are_written(tmp_path):
    tokens = ["今天", "下雨", "我", "没", "带", "伞"]
    heads = plot_attention_heads(softmax_rows(6, 6, 6), tokens, None, tmp_path / "heads.png")
    w, h = png_size(heads)
    assert w > h  # 4 columns, 2 rows
    causal = plot_mask(ak.causal_mask(6), tokens, tmp_path / "causal.png", title="causal")
    padding = ak.padding_mask(torch.tensor([[5, 6, 7, 0, 0, 0]]), pad_id=0)[0, 0].expand(6, 6)
    both = plot_mask(padding & ak.causal_mask(6), tokens, tmp_path / "both.png")
    assert png_size(causal) == png_size(both)
    assert causal.read_bytes() != both.read_bytes()


@pytest.mark.needs("cjk-font")
def test_chinese_tokens_render_with_a_cjk_font(tmp_path):
    if fonts.cjk_font() is None:  # make test installs it; only a user without root lacks it
        if os.environ.get("CI"):
            raise AssertionError("no CJK font: make test installs fonts-wqy-zenhei")
        pytest.skip("no CJK font installed (Debian: apt-get install fonts-wqy-zenhei)")
    tokens = ["今天", "下雨", "我", "没", "带", "伞"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = plot_attention_heatmap(
            softmax_rows(6, 6), tokens, tokens, tmp_path / "zh.png", title="今天 下雨"
        )
    missing = [str(w.message) for w in caught if "missing from" in str(w.message)]
    assert missing == []
    assert not any(issubclass(w.category, MissingFontWarning) for w in caught)
    png_size(path)


def test_without_a_cjk_font_one_warning_and_still_a_picture(tmp_path, monkeypatch):
    monkeypatch.setattr(fonts, "cjk_font", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = plot_attention_heatmap(
            softmax_rows(2, 2), ["今天", "下雨"], ["今天", "下雨"], tmp_path / "tofu.png"
        )
    ours = [w for w in caught if issubclass(w.category, MissingFontWarning)]
    assert len(ours) == 1 and "fonts-wqy-zenhei" in str(ours[0].message)
    assert not [w for w in caught if "missing from" in str(w.message)]
    png_size(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Latin-only text needs no CJK font: no warning
        plot_attention_heatmap(softmax_rows(2, 2), ["a", "b"], ["a", "b"], tmp_path / "ab.png")


def test_awkward_tokens_are_drawn_as_text(tmp_path, monkeypatch):
    """Each token's label is the token itself (whitespace made visible, a long one cut), and
    none is parsed as mathtext: "$x^2$" is drawn as the five characters, not as x squared."""
    tokens = ["$x^2$", "a$b", "", " ", "\n", HOSTILE, "x" * 80]
    figures = []
    real_save = plots.save_figure
    monkeypatch.setattr(
        plots, "save_figure", lambda fig, *a: figures.append(fig) or real_save(fig, *a)
    )
    path = plot_attention_heatmap(softmax_rows(7, 7), tokens, tokens, tmp_path / "odd.png")
    png_size(path)
    ((ax, *_),) = [figure.axes for figure in figures]
    expected = ["$x^2$", "a$b", "∅", "␣", "␣", HOSTILE[:15] + "…", "x" * 15 + "…"]
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        assert [label.get_text() for label in labels] == expected
        assert not any(label.get_parse_math() for label in labels)


def test_plot_inputs_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"query_tokens has 2 tokens, but .* N=3"):
        plot_attention_heatmap(softmax_rows(3, 3), ["a", "b"], ["a", "b", "c"], tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"weights must have shape \(N, M\), got \(2, 3, 3\)"):
        plot_attention_heatmap(softmax_rows(2, 3, 3), ["a"] * 3, ["a"] * 3, tmp_path / "x.png")
    with pytest.raises(ValueError, match="finite"):
        plot_attention_heatmap([[float("nan")]], ["a"], ["a"], tmp_path / "x.png")
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        plot_mask(torch.ones(2, 2), ["a", "b"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="does not exist"):
        plot_schedule(64, 10, 100, tmp_path / "no" / "such" / "dir.png")
    with pytest.raises(ValueError, match="warmup must be a positive int, got 0"):
        plot_schedule(64, 0, 100, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "keep.png"
    path.write_bytes(b"old")

    def broken(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        plot_schedule(64, 10, 100, path)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.png"]


def test_warmup_schedule_is_the_papers_formula():
    d, warmup = 512, 4000
    assert warmup_schedule(1, d, warmup) == pytest.approx(d**-0.5 * warmup**-1.5)
    assert warmup_schedule(warmup, d, warmup) == pytest.approx((d * warmup) ** -0.5)
    assert warmup_schedule(4 * warmup, d, warmup) == pytest.approx(0.5 * (d * warmup) ** -0.5)
    rates = [warmup_schedule(s, d, warmup) for s in (1, 1000, 3999, 4000, 4001, 10000)]
    assert rates.index(max(rates)) == 3


# --------------------------------------------------------------------------------------------
# The HTML report
# --------------------------------------------------------------------------------------------


def data_block(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="attnkit-data">(.*?)</script>', page)
    assert match, "no data block"
    return json.loads(match.group(1))


def hostile_report(tmp_path) -> tuple[Path, list[str], torch.Tensor]:
    tokens = ["今天", HOSTILE, CLOSER, "a&b", '"q"', " "]
    weights = softmax_rows(2, 3, 6, 6)  # (L, H, N, M)
    path = render_attention_html(
        [{"name": f"enc {HOSTILE}", "query_tokens": tokens, "weights": weights}],
        tmp_path / "report.html",
        title=f"report {HOSTILE}",
        notes=[f"note {HOSTILE}"],
        images=[("heat.png", f"caption {HOSTILE}")],
    )
    return path, tokens, weights


def test_hostile_tokens_are_escaped_and_survive_as_data(tmp_path):
    path, tokens, weights = hostile_report(tmp_path)
    page = path.read_text(encoding="utf-8")
    assert "<img src=x" not in page  # never markup
    assert "alert(2)" in page and "<script>alert(2)" not in page
    assert page.count("</script>") == page.count("<script")  # no token closed a script block
    assert f"<title>report {HOSTILE.replace('<', '&lt;').replace('>', '&gt;')}</title>" in page
    assert "caption &lt;img src=x onerror=alert(1)&gt;" in page
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page
    assert "document.write" not in page
    data = data_block(page)["sections"][0]
    assert data["query_tokens"] == tokens == data["key_tokens"]  # exactly the tokens, as text
    assert data["name"] == f"enc {HOSTILE}"
    assert data["shape"] == [2, 3, 6, 6]
    flat = torch.tensor(data["weights"], dtype=torch.float64)
    torch.testing.assert_close(flat, weights.double().reshape(-1), atol=5e-5, rtol=0)


def test_report_is_offline_and_self_contained(tmp_path):
    path, _, _ = hostile_report(tmp_path)
    page = path.read_text(encoding="utf-8")
    assert not re.search(r"https?://", page)
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert "<link" not in page and "@import" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page.replace("&#x27;", "'")
    for select in ("section-select", "layer-select", "head-select"):
        assert f'<select id="{select}">' in page
    assert '<img src="heat.png"' in page


def test_report_images_are_relative_and_urls_refused(tmp_path):
    (tmp_path / "pics").mkdir()
    picture = tmp_path / "pics" / "热 map.png"
    page = render_attention_html([], tmp_path / "r.html", images=[picture]).read_text("utf-8")
    assert '<img src="pics/%E7%83%AD%20map.png"' in page
    for url in ("https://example.com/a.png", "//cdn.example/a.png", "javascript:alert(1)"):
        with pytest.raises(ValueError, match="offline"):
            render_attention_html([], tmp_path / "r.html", images=[url])


def test_report_inputs_are_checked(tmp_path):
    out = tmp_path / "r.html"
    w = softmax_rows(1, 2, 3, 3)
    with pytest.raises(ValueError, match=r"\(L, H, N, M\).*got \(2, 3, 3\)"):
        render_attention_html([{"name": "x", "query_tokens": ["a"] * 3, "weights": w[0]}], out)
    with pytest.raises(ValueError, match=r"key_tokens'\] has 2 tokens, but .* M=3"):
        render_attention_html(
            [{"name": "x", "query_tokens": ["a"] * 3, "key_tokens": ["a", "b"], "weights": w}], out
        )
    with pytest.raises(ValueError, match=r"unknown keys \['weight'\]"):
        render_attention_html([{"name": "x", "query_tokens": ["a"] * 3, "weight": w}], out)
    with pytest.raises(ValueError, match="nothing to show"):
        render_attention_html([], out)
    assert not out.exists()


def test_attention_sections_cover_the_three_attentions():
    enc = [softmax_rows(2, 4, 5, 5, seed=i) for i in range(3)]
    dec = [softmax_rows(2, 4, 3, 3, seed=i) for i in range(3)]
    cross = [softmax_rows(2, 4, 3, 5, seed=i) for i in range(3)]
    src, tgt = list("abcde"), ["<s>", "x", "y"]
    sections = attention_sections(
        {"encoder": enc, "decoder": dec, "cross": cross}, src_tokens=src, tgt_tokens=tgt, index=1
    )
    names = [s["name"] for s in sections]
    assert names == ["encoder self-attention", "decoder self-attention", "cross-attention"]
    assert (sections[2]["query_tokens"], sections[2]["key_tokens"]) == (tgt, src)
    torch.testing.assert_close(sections[2]["weights"][2], cross[2][1])
    (only,) = attention_sections(enc, src)
    assert only["query_tokens"] == src and len(only["weights"]) == 3
    with pytest.raises(ValueError, match="tgt_tokens"):
        attention_sections({"decoder": dec}, src_tokens=src)


# --------------------------------------------------------------------------------------------
# bertviz
# --------------------------------------------------------------------------------------------


def test_to_bertviz_shapes_and_batch_selection():
    layers = [softmax_rows(3, 4, 5, 5, seed=i) for i in range(2)]  # (B, H, N, M) per layer
    out = to_bertviz(layers, index=2)
    assert isinstance(out, tuple) and len(out) == 2
    assert [tuple(t.shape) for t in out] == [(1, 4, 5, 5)] * 2
    torch.testing.assert_close(out[1][0], layers[1][2])
    enc_dec = {"encoder": layers, "cross": [softmax_rows(3, 4, 2, 5)] * 2}
    out = to_bertviz(enc_dec)
    assert list(out) == ["encoder_attention", "cross_attention"]
    assert tuple(out["cross_attention"][0].shape) == (1, 4, 2, 5)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 3\), got 3"):
        to_bertviz(layers, index=3)
    with pytest.raises(ValueError, match=r"attentions\[1\] has batch size 2, but layer 0 has 3"):
        to_bertviz([layers[0], layers[1][:2]])
    with pytest.raises(ValueError, match="keys among"):
        to_bertviz({"self": layers})


def test_bertviz_json_export(tmp_path):
    enc = [softmax_rows(1, 2, 3, 3)]
    cross = [softmax_rows(1, 2, 2, 3)]
    path = export_bertviz_json(
        {"encoder": enc, "cross": cross},
        tmp_path / "bv.json",
        src_tokens=list("abc"),
        tgt_tokens=["今", HOSTILE],
    )
    data = json.loads(path.read_text(encoding="utf-8"))["attention"]
    assert [d["name"] for d in data] == ["Encoder", "Cross"]
    assert data[1]["left_text"] == ["今", HOSTILE] and data[1]["right_text"] == list("abc")
    torch.testing.assert_close(torch.tensor(data[1]["attn"]), cross[0], atol=1e-6, rtol=0)
    (plain,) = bertviz_data(enc, list("abc"))
    assert plain["name"] is None
    with pytest.raises(ValueError, match=r"tokens has 2 tokens, but the self attention has N=3"):
        bertviz_data(enc, ["a", "b"])
