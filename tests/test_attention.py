"""scaled_dot_product_attention and the masks: the fused path against the math path, rows that
see nothing, the causal alignment, gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak


def _inputs(seed, b, h, n, m, d_k, d_v, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d_k, generator=g, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, h, m, d_k, generator=g, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, h, m, d_v, generator=g, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _mask(kind, seed, b, h, n, m):
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "none":
        return None
    if kind == "padding":  # (B, 1, 1, M), some rows may be all padding
        return torch.rand(b, 1, 1, m, generator=g) > 0.3
    if kind == "full-bool":  # (B, H, N, M)
        return torch.rand(b, h, n, m, generator=g) > 0.4
    if kind == "2d-bool":  # (N, M)
        return torch.rand(n, m, generator=g) > 0.4
    if kind == "float":  # biases and blocked entries
        bias = torch.randn(b, 1, n, m, generator=g)
        return bias.masked_fill(torch.rand(b, 1, n, m, generator=g) > 0.7, float("-inf"))
    raise AssertionError(kind)


shapes = st.tuples(
    st.integers(1, 3),  # B
    st.integers(1, 4),  # H
    st.integers(1, 17),  # N
    st.integers(1, 17),  # M
    st.sampled_from([1, 4, 8, 16, 64]),  # d_k
    st.sampled_from([1, 4, 8, 32]),  # d_v
)


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    kind=st.sampled_from(["none", "padding", "full-bool", "2d-bool", "float"]),
    is_causal=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_fused_equals_math(shape, kind, is_causal, seed):
    b, h, n, m, d_k, d_v = shape
    q, k, v = _inputs(seed, b, h, n, m, d_k, d_v, requires_grad=True)
    mask = _mask(kind, seed, b, h, n, m)
    out_math, weights = ak.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, return_weights=True
    )
    out_fused = ak.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, implementation="sdpa"
    )
    assert out_math.shape == out_fused.shape == (b, h, n, d_v)
    assert weights.shape == (b, h, n, m)
    torch.testing.assert_close(out_fused, out_math, atol=1e-5, rtol=1e-5)

    # rows sum to 1, or to 0 where nothing may be attended to; never NaN
    assert torch.isfinite(weights).all() and torch.isfinite(out_fused).all()
    sums = weights.sum(-1)
    assert ((sums - 1).abs() < 1e-5).logical_or(sums == 0).all()

    # the gradients of both paths agree and are finite
    grad_out = torch.randn_like(out_math)
    g_math = torch.autograd.grad(out_math, (q, k, v), grad_out)
    g_fused = torch.autograd.grad(out_fused, (q, k, v), grad_out)
    for a, f in zip(g_math, g_fused, strict=True):
        assert torch.isfinite(a).all() and torch.isfinite(f).all()
        torch.testing.assert_close(f, a, atol=1e-4, rtol=1e-4)


def test_matches_the_formula_written_out():
    q, k, v = _inputs(0, 2, 3, 5, 7, 8, 4, dtype=torch.float64)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1) @ v
    for implementation in ("math", "sdpa"):
        out = ak.scaled_dot_product_attention(q, k, v, implementation=implementation)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
def test_row_with_nothing_to_attend_to_is_zero_with_finite_gradients(implementation):
    q, k, v = _inputs(1, 2, 2, 4, 5, 8, 8, requires_grad=True)
    mask = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    mask[0, 0, 1] = False  # query 1 of batch 0 may see nothing
    mask[1] = False  # batch 1 sees nothing at all
    out = ak.scaled_dot_product_attention(q, k, v, mask, implementation=implementation)
    assert torch.isfinite(out).all()
    assert torch.all(out[0, :, 1] == 0) and torch.all(out[1] == 0)
    assert out[0, :, 0].abs().sum() > 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[1] == 0)


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
def test_all_minus_inf_float_row_is_zero(implementation):
    q, k, v = _inputs(2, 1, 1, 3, 4, 8, 8, requires_grad=True)
    mask = torch.zeros(3, 4)
    mask[2] = float("-inf")
    out = ak.scaled_dot_product_attention(q, k, v, mask, implementation=implementation)
    assert torch.all(out[..., 2, :] == 0) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_weights_put_zero_on_masked_keys_and_rows_sum_to_one():
    q, k, v = _inputs(3, 2, 4, 6, 6, 16, 16)
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = ak.padding_mask(ids, pad_id=0)
    _, w = ak.scaled_dot_product_attention(q, k, v, mask, is_causal=True, return_weights=True)
    assert torch.all(w[0, ..., 3:] == 0)  # padding keys get nothing
    assert torch.all(torch.triu(w[1], diagonal=1) == 0)  # nor does the future
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
@pytest.mark.parametrize(("n", "m"), [(1, 9), (3, 9), (9, 9), (5, 3)])
def test_is_causal_is_bottom_right_aligned(implementation, n, m):
    q, k, v = _inputs(4, 2, 3, n, m, 8, 8)
    a = ak.scaled_dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    b = ak.scaled_dot_product_attention(q, k, v, ak.causal_mask(n, m), implementation="math")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if n <= m:
        # the KV-cache case: the last n queries of full causal self-attention over m positions
        q_full = torch.cat([torch.randn(2, 3, m - n, 8), q], dim=2)
        full = ak.scaled_dot_product_attention(q_full, k, v, is_causal=True, implementation="math")
        torch.testing.assert_close(a, full[..., m - n :, :], atol=1e-6, rtol=1e-6)


def test_causal_mask_values():
    assert ak.causal_mask(4).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]
    assert ak.causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert ak.causal_mask(3, 1).tolist() == [[False], [False], [True]]
    assert ak.causal_mask(4).dtype == torch.bool


def test_padding_mask_shape_and_meaning():
    ids = torch.tensor([[7, 8, 0], [0, 9, 9]])
    mask = ak.padding_mask(ids, pad_id=0)
    assert mask.shape == (2, 1, 1, 3) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [[True, True, False], [False, True, True]]


def test_float_mask_is_added_and_minus_inf_equals_false():
    q, k, v = _inputs(5, 1, 2, 4, 6, 8, 8)
    keep = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[:, 0] = True
    as_float = torch.zeros(4, 6).masked_fill(~keep, float("-inf"))
    for implementation in ("math", "sdpa"):
        a = ak.scaled_dot_product_attention(q, k, v, keep, implementation=implementation)
        b = ak.scaled_dot_product_attention(q, k, v, as_float, implementation=implementation)
        torch.testing.assert_close(a, b)
    bias = torch.randn(4, 6)
    _, w = ak.scaled_dot_product_attention(q, k, v, bias, return_weights=True)
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8) + bias, dim=-1)
    torch.testing.assert_close(w, expected)


def test_gradcheck_math_path_float64():
    q, k, v = _inputs(6, 1, 2, 3, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1, 2:] = False
    mask[2] = False  # an empty row must have a (zero) finite gradient too

    def f(q, k, v):
        return ak.scaled_dot_product_attention(q, k, v, mask, implementation="math")

    assert torch.autograd.gradcheck(f, (q, k, v))

    def f_causal(q, k, v):
        return ak.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)

    assert torch.autograd.gradcheck(f_causal, (q, k, v))


def test_dropout_only_in_effect_when_asked():
    q, k, v = _inputs(7, 1, 1, 8, 8, 8, 8)
    plain = ak.scaled_dot_product_attention(q, k, v, implementation="math")
    torch.manual_seed(0)
    dropped = ak.scaled_dot_product_attention(q, k, v, dropout_p=0.5, implementation="math")
    assert not torch.allclose(plain, dropped)
    torch.manual_seed(0)
    again = ak.scaled_dot_product_attention(q, k, v, dropout_p=0.5, implementation="math")
    torch.testing.assert_close(dropped, again)


def test_half_precision_scores_stay_finite():
    q = torch.full((1, 1, 4, 64), 30.0, dtype=torch.bfloat16)
    k = torch.full((1, 1, 4, 64), 30.0, dtype=torch.bfloat16)
    v = torch.randn(1, 1, 4, 64).to(torch.bfloat16)
    _, w = ak.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.float().sum(-1), torch.ones(1, 1, 4), atol=1e-2, rtol=0)


def test_fused_path_off_the_cpu_never_reads_the_mask_values():
    """On a GPU the fused path zeroes the rows with nothing to attend to without looking at the
    values first (a look makes the host wait for the device, and breaks a compiled graph). A
    meta tensor has no values: any look raises."""
    q, k, v = (t.to("meta") for t in _inputs(3, 2, 2, 4, 5, 8, 8))
    for mask in (torch.rand(2, 1, 4, 5) > 0.5, torch.zeros(4, 5)):
        for is_causal in (False, True):
            out = ak.scaled_dot_product_attention(
                q, k, v, mask.to("meta"), is_causal=is_causal, implementation="sdpa"
            )
            assert out.shape == (2, 2, 4, 8) and out.device.type == "meta"
