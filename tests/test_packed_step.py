"""The packed decoding step (accel.PackedDecoder: a Llama layer's one-token step as one C call)
against the eager step it replaces and against the uncached forward pass: the same logits up
to float32 rounding order, the same caches, the same greedy tokens; and everything it cannot
run goes through the eager step."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.accel import PackedDecoder, native, packed_decoder, packed_steps
from attnkit.generation import lm_step

FORMATS = {
    "Q8_0": (Q.Q8_0, 64), "Q4_0": (Q.Q4_0, 64), "Q4_1": (Q.Q4_1, 64), "Q4_K": (Q.Q4_K, 256),
    "Q5_K": (Q.Q5_K, 256),
}  # fmt: skip
_models = {}


def packed_llama(tmp_path_factory, kind="Q4_1", d_ff=None):
    """A 2-layer Llama (4 query heads sharing 2 key/value heads) written as a GGUF file in
    ``kind`` and loaded with its weights packed; one per format (and FFN width) for the whole
    module."""
    from test_interop_gguf import _llama, write_gguf

    qtype, width = FORMATS[kind]
    d_ff = d_ff or width + 32 * (width == 64)
    if (kind, d_ff) not in _models:
        path = tmp_path_factory.mktemp("gguf") / f"{kind}.gguf"
        write_gguf(path, _llama(d_model=width, d_ff=d_ff, vocab=101), qtype)
        _models[kind, d_ff] = ak.from_pretrained(path, dequantize=False).eval()
    return _models[kind, d_ff]


def close(a, b, scale):
    """Equal up to float32 rounding order, relative to the size of what was summed."""
    return (a - b).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize(
    ("kind", "d_ff"), [*[(kind, None) for kind in FORMATS], ("Q4_1", 32)], ids=str
)  # the last: an FFN narrower than the model
def test_the_c_step_equals_the_eager_step(tmp_path_factory, kind, d_ff):
    model = packed_llama(tmp_path_factory, kind, d_ff)
    decoder = packed_decoder(model)
    assert decoder is not None
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    eager_cache, c_cache = model.new_cache(1, 20), model.new_cache(1, 20)
    with torch.no_grad():
        token = lm_step(model, prompt, None, eager_cache).argmax(-1, keepdim=True)
        lm_step(model, prompt, None, c_cache)
        for _ in range(10):
            want = lm_step(model, token, None, eager_cache)
            got = decoder.step(model, token, None, c_cache, eager=None)  # never falls back
            assert close(got, want, want.abs().max().item())
            token = want.argmax(-1, keepdim=True)
    assert c_cache.length == eager_cache.length == 16
    for mine, theirs in zip(c_cache.self_attn, eager_cache.self_attn, strict=True):
        assert mine.length == 16
        for name in ("k", "v"):
            theirs_kv = getattr(theirs, name)
            assert close(getattr(mine, name), theirs_kv, theirs_kv.abs().max().item())
        assert torch.equal(mine.positions, theirs.positions)


@pytest.mark.parametrize("kind", FORMATS)
def test_the_c_step_on_the_integer_path_equals_the_eager_integer_step(tmp_path_factory, kind):
    """With every packed product on the integer path (int8 activations), the C step against the
    eager step with the same products: the first step to float32 rounding order. Later steps
    read caches that each path wrote, whose values differ by that rounding, which now and then
    moves a value of x across a boundary of its int8 grid (one step of max|x_b| / 127 in one
    term, against this random model's 2-3% between the integer and float32 paths): they are
    held to 1% of the largest logit."""
    from attnkit.accel import use_integer_products

    model = packed_llama(tmp_path_factory, kind)
    with torch.no_grad():
        float_logits = model(torch.tensor([[5, 6, 7]]))
    try:
        use_integer_products(model, True)
        decoder = packed_decoder(model)
        assert decoder is not None and min(decoder.layers[0].kind) >= 8  # every product in tiles
        prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
        eager_cache, c_cache = model.new_cache(1, 20), model.new_cache(1, 20)
        with torch.no_grad():
            token = lm_step(model, prompt, None, eager_cache).argmax(-1, keepdim=True)
            lm_step(model, prompt, None, c_cache)
            for step in range(8):
                want = lm_step(model, token, None, eager_cache)
                got = decoder.step(model, token, None, c_cache, eager=None)
                bound = 1e-5 if step == 0 else 1e-2
                assert (got - want).abs().max().item() <= bound * want.abs().max().item(), step
                token = want.argmax(-1, keepdim=True)
    finally:
        use_integer_products(model, False)
    assert max(packed_decoder(model).layers[0].kind) < 8  # blocks again
    with torch.no_grad():  # the file's pages that tiling gave back are read again, unchanged
        assert torch.equal(model(torch.tensor([[5, 6, 7]])), float_logits)


def test_padded_batches_decode_the_same_tokens(tmp_path_factory):
    """Rows of different lengths, left-padded: each row's own positions and key mask."""
    model = packed_llama(tmp_path_factory)
    ids = torch.tensor([[2, 2, 2, 5, 6, 7], [2, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26]])
    mask = ids != 2
    mask[2] = True  # the third row starts with real tokens
    eager_calls = []

    def eager(*args):
        eager_calls.append(args[1].shape)
        return lm_step(*args)

    with torch.no_grad():
        with packed_steps(False):
            want = model.generate(ids, 12, attention_mask=mask, do_sample=False)
            assert packed_decoder(model) is None
        got = model.generate(ids, 12, attention_mask=mask, do_sample=False)
        alone = [model.generate(ids[i : i + 1, mask[i]], 12, do_sample=False) for i in range(3)]
        # the C step takes the padded rows itself
        decoder = packed_decoder(model)
        cache = model.new_cache(3, 8)
        lm_step(model, ids, mask, cache)
        longer = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        decoder.step(model, ids[:, -1:], longer, cache, eager=eager)
    assert eager_calls == []
    assert torch.equal(got, want)
    for i in range(3):  # each row as if it stood alone
        new = alone[i][0, int(mask[i].sum()) :]
        assert torch.equal(got[i, 6 : 6 + len(new)], new)


def test_beam_search_and_sampling_follow_the_eager_steps(tmp_path_factory):
    """Beam search reorders the cache's rows between C steps; sampling draws from its logits."""
    model = packed_llama(tmp_path_factory)
    ids = torch.tensor([[5, 6, 7, 8]])
    options = [dict(num_beams=3), dict(do_sample=True, seed=7, top_k=20)]
    with torch.no_grad():
        for option in options:
            with packed_steps(False):
                want = model.generate(ids, 10, **option)
            assert torch.equal(model.generate(ids, 10, **option), want), option


@settings(max_examples=15, deadline=None)
@given(
    prompt=st.lists(st.integers(3, 100), min_size=1, max_size=8),
    steps=st.lists(st.integers(3, 100), min_size=1, max_size=6),
)
def test_cached_c_steps_equal_the_uncached_forward(tmp_path_factory, prompt, steps):
    """The invariant: what the C step computes from its cache equals the whole sequence run
    again from the start, without a cache (the future cannot leak into the past either: each
    step's logits are those of the prefix it has seen)."""
    model = packed_llama(tmp_path_factory)
    decoder = packed_decoder(model)
    cache = model.new_cache(1, len(prompt) + len(steps))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        lm_step(model, ids, None, cache)
        for token in steps:
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            got = decoder.step(model, ids[:, -1:], None, cache, eager=None)
            want = model(ids)[:, -1]
            assert close(got, want, want.abs().max().item())


def test_what_it_cannot_run_goes_eager(tmp_path_factory):
    model = packed_llama(tmp_path_factory)
    decoder = packed_decoder(model)
    calls = []

    def eager(*args):
        calls.append(args[1].shape)
        return lm_step(*args)

    with torch.no_grad():
        cache = model.new_cache(1, 12)
        decoder.step(model, torch.tensor([[5, 6, 7]]), None, cache, eager=eager)  # a prompt
        assert calls == [(1, 3)]
        decoder.step(model, torch.tensor([[8]]), None, cache, eager=eager)
        assert calls == [(1, 3)]  # one new token: the C step
    # models it cannot run: it says why, and generation keeps the eager step
    floats = ak.quantize(ak.DecoderLM(ak.ModelConfig.preset("tiny")).eval(), "int8")
    assert packed_decoder(floats) is None
    with pytest.raises(ValueError, match="PackedDecoder: cannot run this model's steps: cfg"):
        PackedDecoder(floats)
    model.train()
    try:
        with pytest.raises(ValueError, match="training mode"):
            PackedDecoder(model)
    finally:
        model.eval()


@pytest.mark.parametrize("variant", [v for v in native.VARIANTS if native.runnable(v)])
def test_every_variant_this_cpu_runs_steps_alike(tmp_path_factory, variant):
    """Every variant built at install that this CPU can run (plain C on any): its step against
    the eager step with the same variant's products."""
    with native.using(variant):
        test_the_c_step_equals_the_eager_step(tmp_path_factory, "Q4_1", 32)
        test_the_c_step_equals_the_eager_step(tmp_path_factory, "Q8_0", None)


@pytest.mark.needs("smollm2")
def test_smollm2_decodes_the_same_tokens_through_the_c_step():
    from attnkit.interop import load_tokenizer_for

    model = ak.from_pretrained("smollm2", dequantize=False)
    tokenizer = load_tokenizer_for("smollm2")
    prompts = ["The capital of France is", "今天 下雨 我 没 带 伞"]
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with packed_steps(False):
                want = model.generate(ids, 32, do_sample=False)
            assert torch.equal(model.generate(ids, 32, do_sample=False), want)


@pytest.mark.parametrize(
    ("integer", "laid_out"), [(False, False), (False, True), (True, False)], ids=str
)
def test_gemma3_steps_in_c_equal_the_eager_steps(tmp_path, integer, laid_out):
    """Gemma 3's layers in the C step: QK-norm, sandwich norms, GeGLU, heads wider than
    d_model / n_heads, and window layers whose ring of 4 keys wraps several times over 14
    steps; one product left in float32, as the Q6_K ones of the shipped file (in both of its
    layouts: laid out for decoding, the (in, out) rows). Against the eager steps on the same
    products; on the integer path the first step to rounding order and the rest to 1%, as
    for Llama."""
    from attnkit.accel import use_integer_products
    from attnkit.accel.decoding import lay_out_for_decoding
    from test_interop_gemma3 import _gemma3

    _, model = _gemma3(tmp_path)
    ak.quantize(model, "Q4_1", skip=["lm_head"])
    ffn = model.decoder.layers[1].ffn
    dense = torch.nn.Linear(ffn.down.in_features, ffn.down.out_features, bias=False)
    dense.weight.data = ffn.down.dequantized()
    ffn.down = dense.eval()
    if laid_out:
        lay_out_for_decoding(model)
        assert not dense.weight.is_contiguous() and dense.weight.t().is_contiguous()
    use_integer_products(model, integer)
    decoder = packed_decoder(model)
    assert decoder is not None, ak.accel.packed_step.why_not(model)
    assert [layer.window for layer in decoder.layers] == [4, 0, 4, 0]
    assert decoder.layers[1].kind[4] == (17 if laid_out else 16)  # float32: (in, out) or (out, in)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    eager_cache, c_cache = model.new_cache(1, 32), model.new_cache(1, 32)
    with torch.no_grad():
        token = lm_step(model, prompt, None, eager_cache).argmax(-1, keepdim=True)
        lm_step(model, prompt, None, c_cache)
        for step in range(14):
            want = lm_step(model, token, None, eager_cache)
            got = decoder.step(model, token, None, c_cache, eager=None)  # never falls back
            bound = 1e-5 if step == 0 or not integer else 1e-2
            assert (got - want).abs().max().item() <= bound * want.abs().max().item(), step
            token = want.argmax(-1, keepdim=True)
    for mine, theirs in zip(c_cache.self_attn, eager_cache.self_attn, strict=True):
        assert mine.length == theirs.length == 20
        assert torch.equal(mine.positions, theirs.positions)
        if hasattr(mine, "valid"):
            assert torch.equal(mine.valid, theirs.valid)
        if not integer:
            torch.testing.assert_close(mine.k, theirs.k, rtol=1e-4, atol=1e-5)
