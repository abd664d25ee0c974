"""`attnkit explain TEXT`: the step-by-step numbers are the model's own numbers."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.explain.trace import format_trace, trace_attention


def _model(cls, **overrides):
    torch.manual_seed(0)
    model = cls(ak.ModelConfig.preset("tiny", vocab_size=40, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.3)
    return model


CASES = [
    (ak.EncoderModel, {}),
    (ak.EncoderModel, {"position": "alibi"}),
    (ak.DecoderLM, {"position": "rope", "n_kv_heads": 2}),
    (ak.DecoderLM, {"position": "alibi"}),
    (ak.DecoderLM, {"attention": "window", "window": 3}),
    (ak.Transformer, {"position": "sinusoidal"}),
]


@pytest.mark.parametrize(("cls", "overrides"), CASES)
def test_trace_reproduces_the_models_attention(cls, overrides):
    model = _model(cls, **overrides)
    ids = torch.tensor([[5, 6, 7, 7, 7, 8]])
    trace = trace_attention(model, ids, layer=1, head=2)
    torch.testing.assert_close(trace.weights, trace.model_weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trace.scaled, trace.scores / math.sqrt(trace.d_k))
    torch.testing.assert_close(trace.output, trace.weights @ trace.v)
    torch.testing.assert_close(trace.weights.sum(-1), torch.ones(6))
    blocked = torch.isneginf(trace.mask)
    assert torch.all(trace.weights[blocked] == 0)  # -inf before softmax, 0 after
    assert trace.causal == (cls is ak.DecoderLM) and blocked.any() == trace.causal


def test_format_shows_every_step_and_the_query_mix():
    trace = trace_attention(_model(ak.DecoderLM), torch.tensor([[5, 6, 7]]), tokens=list("abc"))
    text = format_trace(trace, dims=2, query=2)
    for heading in ("Q = x W_Q", "K = x W_K", "V = x W_V", "scores = Q K^T", "scaled", "mask",
                    "weights = softmax", "row sums: 1.000 1.000 1.000", "output = weights V",
                    "query 2 ('c') mixes the values"):  # fmt: skip
        assert heading in text
    assert "-inf" in text


def test_the_command_traces_the_notes_sentence(capsys):
    assert main(["explain", "今天 下雨 我 没 带 伞", "--query", "没", "--head", "1"]) == 0
    out = capsys.readouterr().out
    assert "tokens: 今天 | 下雨 | 我 | 没 | 带 | 伞" in out and "query 3 ('没')" in out
    assert main(["explain", "我 用 毒 毒 毒 蛇", "--causal"]) == 0
    assert "causal (decoder)" in capsys.readouterr().out
    assert main(["explain", "a b", "--query", "z"]) == 2
    assert main(["explain", "a b", "--layer", "9"]) == 2
    assert "layer must be in [0, 2)" in capsys.readouterr().err
