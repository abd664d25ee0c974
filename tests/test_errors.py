"""Bad input fails early, with an error that names the problem."""

import pytest
import torch

import attnkit as ak

q = torch.randn(2, 4, 5, 8)
k = torch.randn(2, 4, 6, 8)
v = torch.randn(2, 4, 6, 8)
sdpa = ak.scaled_dot_product_attention

CASES = [
    ("mismatched d_k", lambda: sdpa(q, torch.randn(2, 4, 6, 7), v), ValueError, "d_k"),
    ("k and v lengths", lambda: sdpa(q, k, torch.randn(2, 4, 5, 8)), ValueError, "same length M"),
    ("batch dims", lambda: sdpa(q, torch.randn(3, 4, 6, 8), v), ValueError, "leading"),
    ("ranks differ", lambda: sdpa(q, k[0], v[0]), ValueError, "number of dimensions"),
    ("1-d query", lambda: sdpa(torch.randn(8), k, v), ValueError, r"\(\.\.\., length, dim\)"),
    ("integer q", lambda: sdpa(q.long(), k, v), TypeError, "floating-point"),
    ("dtypes differ", lambda: sdpa(q.double(), k, v), TypeError, "one dtype"),
    ("not a tensor", lambda: sdpa(q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    ("mask shape", lambda: sdpa(q, k, v, torch.ones(5, 5, dtype=torch.bool)), ValueError, "broadcast"),
    ("mask expands batch", lambda: sdpa(q, k, v, torch.ones(3, 1, 5, 6) > 0), ValueError, "(2, 4, 5, 6)"),
    ("int mask", lambda: sdpa(q, k, v, torch.ones(5, 6, dtype=torch.long)), TypeError, "bool"),
    ("dropout", lambda: sdpa(q, k, v, dropout_p=1.5), ValueError, "dropout_p"),
    ("implementation", lambda: sdpa(q, k, v, implementation="flash"), ValueError, "implementation"),
    ("fused weights", lambda: sdpa(q, k, v, return_weights=True, implementation="fused"), ValueError, "return_weights"),
    ("causal size", lambda: ak.causal_mask(-1), ValueError, "non-negative"),
    ("padding ids float", lambda: ak.padding_mask(torch.randn(2, 3), 0), TypeError, "integer"),
    ("padding ids 3-d", lambda: ak.padding_mask(torch.ones(2, 3, 4, dtype=torch.long), 0), ValueError, "(B, M)"),
    ("heads divide", lambda: ak.MultiHeadAttention(30, 4), ValueError, "n_heads=4 must divide d_model=30"),
    ("kv heads", lambda: ak.MultiHeadAttention(32, 4, n_kv_heads=3), ValueError, "multiple of n_kv_heads=3"),
    ("zero heads", lambda: ak.MultiHeadAttention(32, 0), ValueError, "n_heads must be a positive int"),
    ("mha dropout", lambda: ak.MultiHeadAttention(32, 4, dropout=1.0), ValueError, "dropout"),
    ("rope and alibi", lambda: ak.MultiHeadAttention(32, 4, rope=ak.RotaryEmbedding(8), alibi=ak.ALiBi(4)), ValueError, "not both"),
    ("rope width", lambda: ak.MultiHeadAttention(32, 4, rope=ak.RotaryEmbedding(16)), ValueError, "d_head=8"),
    ("alibi heads", lambda: ak.MultiHeadAttention(32, 4, alibi=ak.ALiBi(8)), ValueError, "n_heads=4"),
    ("mha input width", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 16)), ValueError, "d_model=32"),
    ("mha context batch", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), torch.randn(3, 5, 32)), ValueError, "B=2"),
    ("mha positions", lambda: ak.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), positions=torch.arange(4)), ValueError, "N=5"),
    ("odd sinusoid", lambda: ak.sinusoidal_table(10, 7), ValueError, "even"),
    ("odd rope", lambda: ak.RotaryEmbedding(7), ValueError, "even"),
    ("float positions", lambda: ak.LearnedPositions(4, 4)(torch.zeros(1, 2)), TypeError, "integer"),
    ("cache overflow", lambda: ak.KVCache(1, 1, 2, 4).append(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)), ValueError, "do not fit"),
    ("cache shape", lambda: ak.KVCache(1, 2, 4, 4).append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)), ValueError, "H_kv=2"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, error, message):
    with pytest.raises(error, match=message):
        call()
