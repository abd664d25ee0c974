"""MultiHeadAttention: parity with torch.nn.MultiheadAttention, grouped-query attention, the KV
cache, positions inside attention."""

import pytest
import torch
from torch import nn

import attnkit as ak


def _pair(d_model=32, n_heads=4, bias=True, seed=0):
    """torch's MultiheadAttention and ours with the same weights."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d_model, n_heads, bias=bias, batch_first=True).eval()
    ours = ak.MultiHeadAttention(d_model, n_heads, bias=bias).eval()
    with torch.no_grad():
        ours.in_proj.weight.copy_(ref.in_proj_weight)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        if bias:
            ours.in_proj.bias.copy_(ref.in_proj_bias)
            ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ref, ours


@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_matches_torch(bias):
    ref, ours = _pair(bias=bias)
    x = torch.randn(3, 7, 32)
    out_ref, w_ref = ref(x, x, x, need_weights=True, average_attn_weights=False)
    out, w = ours(x, return_weights=True)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x), out_ref, atol=1e-5, rtol=1e-5)  # the fused path


def test_key_padding_mask_has_the_opposite_meaning_in_torch():
    ref, ours = _pair(seed=1)
    x = torch.randn(2, 6, 32)
    key_padding_mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # True = ignore
    out_ref, w_ref = ref(
        x, x, x, key_padding_mask=key_padding_mask, need_weights=True, average_attn_weights=False
    )
    mask = ~key_padding_mask[:, None, None, :]  # attnkit: True = may attend
    out, w = ours(x, mask=mask, return_weights=True)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x, mask=mask), out_ref, atol=1e-5, rtol=1e-5)
    assert torch.all(w[1, :, :, 4:] == 0)


def test_attention_masks_match_torch_bool_and_float():
    ref, ours = _pair(seed=2)
    x = torch.randn(2, 5, 32)
    blocked = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)  # torch: True = blocked
    out_ref, _ = ref(x, x, x, attn_mask=blocked)
    torch.testing.assert_close(ours(x, mask=~blocked), out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x, is_causal=True), out_ref, atol=1e-5, rtol=1e-5)
    bias = torch.randn(5, 5)
    out_ref, _ = ref(x, x, x, attn_mask=bias)
    torch.testing.assert_close(ours(x, mask=bias), out_ref, atol=1e-5, rtol=1e-5)


def test_cross_attention_matches_torch():
    ref, ours = _pair(seed=3)
    x = torch.randn(2, 4, 32)  # decoder side: queries
    memory = torch.randn(2, 9, 32)  # encoder output: keys and values
    key_padding_mask = torch.zeros(2, 9, dtype=torch.bool)
    key_padding_mask[0, 6:] = True
    out_ref, w_ref = ref(
        x,
        memory,
        memory,
        key_padding_mask=key_padding_mask,
        need_weights=True,
        average_attn_weights=False,
    )
    out, w = ours(x, memory, mask=~key_padding_mask[:, None, None, :], return_weights=True)
    assert w.shape == (2, 4, 4, 9)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)


def _grouped_as_full(gqa: ak.MultiHeadAttention) -> ak.MultiHeadAttention:
    """An ordinary MHA whose key/value heads repeat the grouped ones (head h uses group h // r)."""
    h, h_kv, d = gqa.n_heads, gqa.n_kv_heads, gqa.d_head
    full = ak.MultiHeadAttention(gqa.d_model, h).eval()
    w, b = gqa.in_proj.weight, gqa.in_proj.bias
    q_w, k_w, v_w = w.split([h * d, h_kv * d, h_kv * d])
    q_b, k_b, v_b = b.split([h * d, h_kv * d, h_kv * d])

    def repeat(t):  # (H_kv * d, ...) -> (H * d, ...)
        return t.unflatten(0, (h_kv, d)).repeat_interleave(h // h_kv, dim=0).flatten(0, 1)

    with torch.no_grad():
        full.in_proj.weight.copy_(torch.cat([q_w, repeat(k_w), repeat(v_w)]))
        full.in_proj.bias.copy_(torch.cat([q_b, repeat(k_b), repeat(v_b)]))
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    return full


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_mha_with_shared_heads(n_kv_heads):
    torch.manual_seed(4)
    gqa = ak.MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads).eval()
    assert gqa.in_proj.weight.shape == ((4 + 2 * n_kv_heads) * 8, 32)
    full = _grouped_as_full(gqa)
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(gqa(x, is_causal=True), full(x, is_causal=True))
    memory = torch.randn(2, 3, 32)
    torch.testing.assert_close(gqa(x, memory), full(x, memory))


def _positional(kind, n_heads=4, d_head=8):
    if kind == "rope":
        return {"rope": ak.RotaryEmbedding(d_head)}
    if kind == "alibi":
        return {"alibi": ak.ALiBi(n_heads)}
    return {}


@pytest.mark.parametrize("position", ["none", "rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_cached_decoding_equals_full_causal_attention(position, n_kv_heads):
    torch.manual_seed(5)
    mha = ak.MultiHeadAttention(32, 4, n_kv_heads, **_positional(position)).eval()
    x = torch.randn(2, 10, 32)
    full = mha(x, is_causal=True)
    cache = ak.KVCache(2, n_kv_heads, 16, 8)
    steps = [mha(x[:, :4], is_causal=True, cache=cache)]  # prefill the prompt
    for t in range(4, 10):
        steps.append(mha(x[:, t : t + 1], is_causal=True, cache=cache))
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cross_attention_cache_computes_the_source_once():
    torch.manual_seed(6)
    mha = ak.MultiHeadAttention(32, 4, n_kv_heads=2).eval()
    memory = torch.randn(2, 7, 32)
    cache = ak.KVCache(2, 2, 7, 8)
    first = mha(torch.randn(2, 1, 32), memory, cache=cache)
    assert cache.length == 7 and first.shape == (2, 1, 32)
    x = torch.randn(2, 1, 32)
    # the cached keys are used: even a different "memory" would not be looked at again
    torch.testing.assert_close(mha(x, memory * 0, cache=cache), mha(x, memory))


def test_rope_inside_attention_uses_relative_positions():
    torch.manual_seed(7)
    mha = ak.MultiHeadAttention(32, 4, rope=ak.RotaryEmbedding(8)).eval()
    x = torch.randn(1, 5, 32)
    a = mha(x, positions=torch.arange(5))
    b = mha(x, positions=torch.arange(100, 105))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    no_rope = ak.MultiHeadAttention(32, 4).eval()
    no_rope.load_state_dict(mha.state_dict())
    assert not torch.allclose(no_rope(x), a, atol=1e-3)


def test_alibi_weights_decay_with_distance():
    mha = ak.MultiHeadAttention(16, 2, alibi=ak.ALiBi(2)).eval()
    with torch.no_grad():
        mha.in_proj.weight.zero_()  # all scores 0: only ALiBi's bias remains
    _, w = mha(torch.randn(1, 4, 16), is_causal=True, return_weights=True)
    slopes = ak.alibi_slopes(2)
    for h in range(2):
        expected = torch.softmax(-slopes[h] * torch.tensor([3.0, 2.0, 1.0, 0.0]), dim=0)
        torch.testing.assert_close(w[0, h, 3], expected)


def test_a_fused_step_marks_what_it_wrote_into_the_cache():
    """``KVCache.written``: positions a fused step (the packed C step) wrote in place count as
    cached, and attention then reads them as if :meth:`append` had stored them."""
    cache = ak.KVCache(1, 2, 4, 8)
    k, v = torch.randn(2, 1, 2, 3, 8)
    cache.append(k, v)
    cache.k[:, :, 3], cache.v[:, :, 3] = k[:, :, 0], v[:, :, 0]  # as the C step writes
    cache.written(1)
    assert cache.length == 4
    torch.testing.assert_close(cache.cached().k[:, :, 3], k[:, :, 0])
    with pytest.raises(ValueError, match="1 more positions after 4 do not fit in 4"):
        cache.written(1)


def test_a_decoder_layer_names_its_parts_by_role():
    layer = ak.DecoderLM(ak.ModelConfig.preset("tiny")).decoder.layers[0]
    parts = layer.parts()
    assert parts.attention is layer.self_attn and parts.ffn is layer.ffn
    assert parts.attention_norm is layer.norm1 and parts.ffn_norm is layer.norm3
    assert parts.cross_attention is None
    seq2seq = ak.Transformer(ak.ModelConfig.preset("tiny")).decoder.layers[0]
    assert seq2seq.parts().cross_attention is seq2seq.cross_attn
