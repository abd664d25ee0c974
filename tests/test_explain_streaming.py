"""Attention read a block of queries at a time (attnkit.explain.streaming): the same weights as
``return_attention=True`` for every kind of attention attnkit builds, the detector scores of a
long text equal to those of its whole matrices, and 8,192 tokens in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.config import ModelConfig
from attnkit.explain.circuits import (
    DETECTORS,
    detection_pattern,
    detector_scores,
    streamed_detector_scores,
)
from attnkit.explain.streaming import attention_patterns, pooled_attention
from attnkit.models import DecoderLM, EncoderModel, Transformer

KINDS = {
    "learned, full": dict(position="learned"),
    "rope, grouped heads, qk-norm": dict(
        position="rope", n_heads=4, n_kv_heads=2, qk_norm=True, norm_type="rmsnorm"
    ),
    "alibi": dict(position="alibi"),
    "window and global layers": dict(
        position="rope", attention="window", window=5, global_every=2, n_layers=3
    ),
}


def _model(family, **fields):
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=64, max_len=256, **fields)
    return family(cfg).eval()


def _whole(model, ids):
    with torch.no_grad():
        if isinstance(model, Transformer):
            return [a[0] for a in model(ids, ids, return_attention=True)[1]["decoder"]]
        return [a[0] for a in model(ids, return_attention=True)[1]]


CASES = [(DecoderLM, kind) for kind in KINDS] + [
    (EncoderModel, "learned, full"),
    (EncoderModel, "rope, grouped heads, qk-norm"),
    (EncoderModel, "alibi"),
    (EncoderModel, "window and global layers"),  # a band on both sides
    (Transformer, "learned, full"),  # the decoder's self-attention
    (Transformer, "rope, grouped heads, qk-norm"),
]


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_blocks_give_the_weights_return_attention_gives(family, kind):
    model = _model(family, **KINDS[kind])
    ids = torch.randint(3, 64, (1, 41), generator=torch.Generator().manual_seed(1))
    whole = _whole(model, ids)
    for block in (1, 7, 64):
        streamed = attention_patterns(model, ids, block=block)
        assert len(streamed) == len(whole)
        for a, b in zip(streamed, whole, strict=True):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
            torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:2]))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 60),
    block=st.integers(1, 70),
    vocab=st.integers(3, 12),
    seed=st.integers(0, 2**16),
)
def test_streamed_detector_scores_equal_the_whole_matrices(n, block, vocab, seed):
    """Any length, any block: the scores summed block by block are the scores of the whole
    (N, N) attention and pattern; a pattern's rows are the whole pattern's rows."""
    model = _model(DecoderLM, position="rope")
    ids = torch.randint(3, 3 + vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    whole = _whole(model, ids)
    streamed = streamed_detector_scores(model, ids, block=block)
    for name in DETECTORS:
        pattern = detection_pattern(name, ids[0])
        rows = range(min(block, n) - 1, n)
        assert torch.equal(detection_pattern(name, ids[0], rows), pattern[rows.start :])
        if pattern.sum() == 0:  # nothing marked (no repeated token): no score to compare
            assert torch.isnan(streamed[name]).all(), name
            continue
        torch.testing.assert_close(
            streamed[name], detector_scores(whole, pattern), atol=1e-6, rtol=0
        )


LONG = r"""
import json, torch
from attnkit.config import ModelConfig
from attnkit.explain.circuits import repeated_tokens
from attnkit.explain.streaming import stream_attention
from attnkit.models import DecoderLM
torch.manual_seed(0)
cfg = ModelConfig.preset("tiny", vocab_size=512, max_len=8192, position="rope")
model = DecoderLM(cfg).eval()
ids = repeated_tokens(512, 4096, seed=1)  # (1, 8192)
largest = []
stream_attention(model, ids, lambda layer, start, w: largest.append(w.numel()))
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"rss_mib": int(peak.split()[1]) / 1024,
                  "largest": max(largest), "blocks": len(largest)}))
"""


def test_eight_thousand_tokens_in_bounded_memory():
    """8,192 tokens through a 2-layer, 4-head model: return_attention would hold 2 x 4 x 8,192²
    float32 weights (2 GiB); streamed, no block holds more than 4 x 256 x 8,192 (32 MiB) and the
    whole process stays under 1 GiB (its own peak, VmHWM: getrusage's would carry over the peak
    of the test process it was forked from)."""
    out = subprocess.run(
        [sys.executable, "-c", LONG], capture_output=True, text=True, check=True, timeout=300
    )
    result = json.loads(out.stdout)
    assert result["largest"] == 4 * 256 * 8192 and result["blocks"] == 2 * 8192 // 256
    assert result["rss_mib"] < 1024, result["rss_mib"]


def test_a_pooled_view_is_the_attention_summed_over_keys_and_averaged_over_queries():
    model = _model(DecoderLM, position="rope")
    ids = torch.randint(3, 64, (1, 41), generator=torch.Generator().manual_seed(2))
    whole = torch.stack(_whole(model, ids))  # (L, H, 41, 41)
    same, f = pooled_attention(model, ids, size=64, block=5)
    assert f == 1 and same.shape == whole.shape
    torch.testing.assert_close(same, whole, atol=2e-6, rtol=0)
    pooled, f = pooled_attention(model, ids, size=14, block=4)  # cells of 3 tokens, 14 bins
    bins = torch.arange(41) // 3
    expected = torch.zeros(2, 4, 14, 14)
    for i in range(41):
        for j in range(41):
            expected[:, :, bins[i], bins[j]] += whole[:, :, i, j] / (bins == bins[i]).sum()
    assert f == 3 and pooled.shape == (2, 4, 14, 14)
    torch.testing.assert_close(pooled, expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(pooled.sum(-1), torch.ones(2, 4, 14))
    averaged, _ = pooled_attention(model, ids, size=14, heads_averaged=True)
    torch.testing.assert_close(averaged[:, 0], expected.mean(1), atol=2e-6, rtol=0)


def test_viz_draws_a_long_text_in_cells(tmp_path, capsys):
    """Past 2,048 tokens `attnkit viz` streams the attention and draws cells of tokens; the
    bertviz export, whose own views fail near 512 tokens, is refused in one line."""
    from attnkit.cli import main

    text = " ".join(f"w{i % 1500}" for i in range(3000))
    html, png = tmp_path / "long.html", tmp_path / "png"
    argv = ["viz", text, "--family", "decoder", "--html", str(html), "--png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "reading 3,000 tokens a block of queries at a time" in out
    page = html.read_text()
    assert "drawn in cells of 3 x 3 tokens" in page and "0-2 w0" in page
    assert sorted(p.name for p in png.iterdir()) == ["self_layer0.png", "self_layer1.png"]
    assert main(["viz", text, "--family", "decoder", "--bertviz", str(tmp_path / "b.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert "--bertviz: at most 2,048 tokens" in error and len(error.splitlines()) == 1
