"""Beyond the quadratic cost: window attention, linear attention, grouped-query attention and
mixture-of-experts, each against its reference and through every model property."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.backends import linear_attention, linear_attention_weights, sliding_window_attention
from attnkit.layers import FeedForward, MoEFeedForward
from attnkit.masks import window_mask


def _qkv(seed, b, h, n, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3))


# --------------------------------------------------------------------------------------------
# Window attention
# --------------------------------------------------------------------------------------------


def test_window_mask_matches_its_definition():
    causal = window_mask(5, window=2, causal=True)
    both = window_mask(5, window=2, causal=False)
    for i in range(5):
        for j in range(5):
            assert causal[i, j] == (0 <= i - j < 2)
            assert both[i, j] == (abs(i - j) < 2)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    window=st.integers(1, 12),
    causal=st.booleans(),
    padded=st.booleans(),
    alibi=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_blocked_window_equals_the_masked_math_path(n, window, causal, padded, alibi, seed):
    q, k, v = _qkv(seed, 2, 4, n, 8)
    valid = None
    mask = window_mask(n, window=window, causal=causal)
    if padded:
        valid = torch.rand(2, n, generator=torch.Generator().manual_seed(seed)) > 0.3
        mask = mask & valid[:, None, None, :]
    positions, slopes = torch.arange(n), ak.alibi_slopes(4)
    if alibi:
        bias = ak.ALiBi(4).bias(positions, positions)
        mask = bias.masked_fill(~mask, float("-inf"))
    expected = ak.scaled_dot_product_attention(q, k, v, mask, implementation="math")
    got = sliding_window_attention(
        q,
        k,
        v,
        window,
        causal=causal,
        key_valid=valid,
        positions=positions if alibi else None,
        alibi_slopes=slopes if alibi else None,
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_a_window_as_long_as_the_sequence_is_full_attention(causal):
    q, k, v = _qkv(1, 2, 3, 17, 16)
    full = ak.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for window in (17, 40):
        got = sliding_window_attention(q, k, v, window, causal=causal)
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_window_attention_never_builds_the_n_by_n_scores(monkeypatch):
    """Every score tensor is (B, H, N / w, w, span): its size grows as N * w, not N^2."""
    sizes = []
    einsum = torch.einsum

    def spy(eq, *ops):
        out = einsum(eq, *ops)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "einsum", spy)
    n, w = 1024, 16
    sliding_window_attention(*_qkv(2, 1, 2, n, 8), w, causal=True)
    assert max(sizes) <= 2 * n * 2 * w  # heads * N * span, far below heads * N * N


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 70),
    causal=st.booleans(),
    padded=st.booleans(),
    chunk=st.sampled_from([1, 7, 64]),
    seed=st.integers(0, 1000),
)
def test_linear_attention_equals_its_quadratic_form(n, causal, padded, chunk, seed):
    q, k, v = _qkv(seed, 2, 3, n, 8, dtype=torch.float64)
    valid = None
    if padded:
        valid = torch.rand(2, n, generator=torch.Generator().manual_seed(seed)) > 0.3
        valid[:, 0] = True
    weights = linear_attention_weights(q, k, causal=causal, key_valid=valid)
    expected = weights @ v
    got = linear_attention(q, k, v, causal=causal, key_valid=valid, chunk=chunk)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the quadratic form itself, written out: (phi(Q) phi(K)^T masked) V / normaliser
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    a = phi_q @ phi_k.transpose(-2, -1)
    if causal:
        a = a * torch.ones(n, n, dtype=torch.float64).tril()
    if padded:
        a = a * valid[:, None, None, :]
    torch.testing.assert_close(got, (a @ v) / a.sum(-1, keepdim=True), atol=1e-5, rtol=1e-5)


def test_linear_attention_weights_are_distributions():
    q, k, _ = _qkv(3, 1, 2, 6, 4)
    w = linear_attention_weights(q, k, causal=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 6))
    assert torch.all(torch.triu(w, diagonal=1) == 0) and torch.all(w >= 0)


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------


def test_one_expert_is_the_plain_ffn():
    cfg = ak.ModelConfig.preset("tiny", n_experts=1, moe_top_k=1)
    moe = MoEFeedForward(cfg)
    dense = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation)
    dense.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(3, 5, cfg.d_model)
    torch.testing.assert_close(moe(x), dense(x))
    assert moe.aux_loss.item() == pytest.approx(1.0)


def test_top_k_gates_are_renormalised_router_probabilities():
    cfg = ak.ModelConfig.preset("tiny", d_model=8, d_ff=16, n_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    x = torch.randn(1, 3, 8)
    probs = torch.softmax(moe.router(x[0]), -1)
    expected = torch.zeros(3, 8)
    for t in range(3):
        top = probs[t].topk(2)
        gates = top.values / top.values.sum()
        for g, e in zip(gates, top.indices, strict=True):
            expected[t] += g * moe.experts[int(e)](x[0, t])
    torch.testing.assert_close(moe(x)[0], expected, atol=1e-6, rtol=1e-5)
    f = torch.zeros(4)
    for e in probs.topk(2).indices.flatten():
        f[e] += 1 / 6
    assert moe.aux_loss.item() == pytest.approx(4 * (f * probs.mean(0)).sum().item(), rel=1e-5)


def test_in_training_every_expert_gets_a_gradient():
    # One token, top-1 of 4 experts: three experts get no token. In training they still run
    # (on no rows) and get a zero gradient, so data-parallel ranks agree on which parameters
    # have gradients (FSDP's reduce-scatter needs that); in evaluation they are skipped.
    cfg = ak.ModelConfig.preset("tiny", d_model=8, d_ff=16, n_experts=4, moe_top_k=1)
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    moe(torch.randn(1, 1, 8)).sum().backward()
    grads = [expert.up.weight.grad for expert in moe.experts]
    assert all(g is not None for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) == 1  # only the chosen one is nonzero
    calls = []
    for expert in moe.experts:
        expert.register_forward_hook(lambda module, args, out: calls.append(module))
    moe.eval()
    with torch.no_grad():
        moe(torch.randn(1, 1, 8))
    assert len(calls) == 1


def test_model_exposes_the_load_balancing_loss():
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", n_experts=4, moe_top_k=2))
    assert model.moe_loss() == 0.0
    model(torch.tensor([[5, 6, 7, 8]]))
    loss = model.moe_loss()
    assert loss.requires_grad and loss.item() >= 1.0 - 1e-6  # >= 1, equal when balanced
    loss.backward()
    assert model.decoder.layers[0].ffn.router.weight.grad is not None


# --------------------------------------------------------------------------------------------
# Every variant through the model properties
# --------------------------------------------------------------------------------------------

VARIANTS = {
    "window": dict(attention="window", window=3),
    "linear": dict(attention="linear"),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "moe": dict(n_experts=4, moe_top_k=2),
}
POSITIONS = ["learned", "rope", "alibi", "sinusoidal", "none"]


def make(family, variant, position="learned", **overrides):
    values = dict(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=64)
    values.update(VARIANTS[variant])
    values.update(overrides)
    cfg = ak.ModelConfig.preset("tiny", position=position, eos_id=None, **values)
    torch.manual_seed(0)
    cls = {"decoder": ak.DecoderLM, "encoder": ak.EncoderModel, "seq2seq": ak.Transformer}
    model = cls[family](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.3)
    return model


def _positions_for(variant):
    return [p for p in POSITIONS if not (variant == "linear" and p == "alibi")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_linear_attention_refuses_alibi_and_gqa_equal_heads_is_mha(variant):
    if variant == "linear":
        with pytest.raises(ValueError, match="ALiBi"):
            make("decoder", "linear", "alibi")
    base = make("decoder", variant)
    same = make("decoder", variant, n_kv_heads=4)  # n_kv_heads == n_heads: plain MHA
    plain = make("decoder", variant, n_kv_heads=None)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(same(ids), plain(ids))
    assert base(ids).shape == (1, 5, 40)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_cached_generation_equals_uncached(variant):
    for position in _positions_for(variant):
        model = make("decoder", variant, position)
        ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]])
        mask = ids != 0
        a = model.generate(ids, 12, attention_mask=mask)
        b = model.generate(ids, 12, attention_mask=mask, use_cache=False)
        assert torch.equal(a, b), position
        alone = model.generate(ids[:1, 2:], 12)
        assert a[0, 7:].tolist() == alone[0, 5:].tolist(), position
        seq2seq = make("seq2seq", variant, position)
        src = torch.tensor([[5, 6, 7, 8, 9, 10]])
        assert torch.equal(seq2seq.generate(src, 8), seq2seq.generate(src, 8, use_cache=False))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_keep_causality_and_padding_invariance(variant):
    for position in _positions_for(variant):
        model = make("decoder", variant, position)
        ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))
        changed = ids.clone()
        changed[:, 6:] = 3
        with torch.no_grad():
            a, b = model(ids), model(changed)
        torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-5, rtol=1e-5)
        encoder = make("encoder", variant, position)
        for side in ("right", "left"):
            row = [5, 6, 7, 8, 9]
            padded = [0, 0, *row] if side == "left" else [*row, 0, 0]
            batch = torch.tensor([padded, [9, 8, 7, 6, 5, 4, 3]])
            mask = batch != 0
            real = mask[0]
            with torch.no_grad():
                for m in (model, encoder):
                    together = m(batch, mask)[0][real]
                    alone = m(torch.tensor([row]))[0]
                    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_return_attention_equals_the_fast_path(variant):
    for family in ("decoder", "encoder"):
        model = make(family, variant)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 0, 0, 0, 0]])
        mask = ids != 0
        with torch.no_grad():
            plain = model(ids, mask)
            out, attentions = model(ids, mask, return_attention=True)
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
        for w in attentions:
            assert w.shape == (2, 4, 8, 8)
            assert torch.all(w[1, :, :, 4:] == 0)
            if variant == "window":
                band = window_mask(8, window=3, causal=family == "decoder")
                assert torch.all(w[..., ~band] == 0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_overfit_four_examples(variant):
    model = make("decoder", variant, position="rope")
    with torch.no_grad():  # back to a trainable scale
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.05)
    model.train()
    data = torch.tensor(
        [[5, 9, 14, 22, 30, 7, 2], [6, 11, 11, 33, 3, 2, 8], [17, 8, 25, 2, 4, 9, 1]]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(400):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2), data[:, 1:])
        opt.zero_grad()
        (loss + 0.01 * model.moe_loss()).backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.05
