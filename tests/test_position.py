"""Positions: the sinusoid formula, RoPE's relative property and Hugging Face parity, ALiBi's
slopes, position ids from a padding mask."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak


def test_sinusoidal_table_is_the_papers_formula():
    d_model, max_len = 16, 50
    table = ak.sinusoidal_table(max_len, d_model)
    assert table.shape == (max_len, d_model)
    for pos in range(max_len):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_module_looks_up_positions_and_rejects_too_long():
    pe = ak.SinusoidalPositions(max_len=8, d_model=4)
    out = pe(torch.tensor([[0, 1, 2], [0, 0, 1]]))
    assert out.shape == (2, 3, 4)
    torch.testing.assert_close(out[1, 2], ak.sinusoidal_table(8, 4)[1])
    with pytest.raises(ValueError, match="max_len=8"):
        pe(torch.tensor([[7, 8]]))


def test_learned_positions_reject_positions_beyond_max_len():
    pe = ak.LearnedPositions(max_len=4, d_model=6)
    assert pe(torch.arange(4)[None]).shape == (1, 4, 6)
    with pytest.raises(ValueError, match="position 4 is out of range"):
        pe(torch.arange(5)[None])


@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 300), n=st.integers(0, 300), shift=st.integers(-200, 2000))
def test_rope_scores_depend_only_on_the_offset(m, n, shift):
    m, n = m + max(0, -shift), n + max(0, -shift)  # keep positions >= 0 after the shift
    rope = ak.RotaryEmbedding(32)
    g = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 32, generator=g, dtype=torch.float64)

    def score(i, j):
        return (rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum().item()

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-3)


def test_rope_matches_hugging_face_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0)
    hf = LlamaRotaryEmbedding(config)
    ours = ak.RotaryEmbedding(16, base=500000.0)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 4, 7, 16)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]])
    cos, sin = hf(q, positions)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ours(q, positions), q_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(k, positions), k_hf, atol=1e-5, rtol=1e-5)


def test_alibi_slopes_for_eight_heads_are_powers_of_one_half():
    assert ak.alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]


@pytest.mark.parametrize("n_heads", [4, 6, 12, 16])
def test_alibi_matches_bloom_in_transformers(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 5, dtype=torch.long)
    bloom = build_alibi_tensor(mask, n_heads, torch.float32)  # (H, 1, 5): slope_h * j
    torch.testing.assert_close(ak.alibi_slopes(n_heads), bloom[:, 0, 1])
    bias = ak.ALiBi(n_heads).bias(torch.arange(5), torch.arange(5))  # (1, H, 5, 5)
    # row i: -slope * (i - j) on j <= i; softmax ignores the constant -slope * i, as BLOOM does
    causal = ak.causal_mask(5)
    for h in range(n_heads):
        row = bias[0, h, 4]
        torch.testing.assert_close(row - row[4], bloom[h, 0] - bloom[h, 0, 4])
        assert torch.all(bias[0, h][causal] <= 0)


def test_positions_from_mask_counts_from_the_first_real_token():
    mask = torch.tensor([[True, True, True, False], [False, False, True, True]])
    assert ak.positions_from_mask(mask).tolist() == [[0, 1, 2, 0], [0, 0, 0, 1]]
