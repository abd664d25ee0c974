"""The packed stack (accel.PackedStack: a Llama model's decoder stack in C, prompt chunks and
decoding steps alike) against the eager stack it replaces: the same logits up to float32
rounding order, the same caches, the same greedy tokens; everything it cannot run goes through
the eager stack.

And the invariance it promises, bit for bit: a token's logits do not depend on how the prompt
was split into calls, on a prefix copied from another cache (a prompt cache), on the other rows
of a batch or their padding; on the integer path, not on the kernel variant either (the tests
named ``invariance`` and ``variants``)."""

import hashlib
from itertools import pairwise

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import accel
from attnkit.accel import PackedStack, native, packed_stack, packed_steps, use_integer_products
from attnkit.accel.packed_step import why_not

FORMATS = {
    "Q8_0": (Q.Q8_0, 64), "Q4_0": (Q.Q4_0, 64), "Q4_1": (Q.Q4_1, 64), "Q4_K": (Q.Q4_K, 256),
    "Q5_K": (Q.Q5_K, 256), "Q6_K": (Q.Q6_K, 256),
}  # fmt: skip
RUNNABLE = [v for v in native.VARIANTS if native.runnable(v)]
_files = {}


def packed_llama(tmp_path_factory, kind="Q4_1", d_ff=None, *, integer=False):
    """A 2-layer Llama (4 query heads sharing 2 key/value heads) written as a GGUF file in
    ``kind``, loaded with its weights packed, on the ``integer`` path or the float one, its
    stack swapped for a PackedStack (the file is written once per format and FFN width)."""
    from test_interop_gguf import _hf_llama, write_gguf

    qtype, width = FORMATS[kind]
    d_ff = d_ff or width + 32 * (width == 64)
    if (kind, d_ff) not in _files:
        path = tmp_path_factory.mktemp("gguf") / f"{kind}.gguf"
        write_gguf(path, _hf_llama(d_model=width, d_ff=d_ff, vocab=101), qtype)
        _files[kind, d_ff] = path
    model = ak.from_pretrained(_files[kind, d_ff], dequantize=False).eval()
    use_integer_products(model, integer)
    model = packed_stack(model)
    assert type(model.decoder) is PackedStack, why_not(model)
    return model


def close(a, b, bound=1e-5):
    """Equal up to ``bound`` relative to the largest value: float32 rounding order (1e-5)."""
    return (a - b).abs().max().item() <= bound * b.abs().max().item()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def run(model, ids, *, cache=None, mask=None, eager=False):
    with torch.no_grad(), packed_steps(not eager):
        return model(ids, attention_mask=mask, cache=cache)


@pytest.mark.variants
@pytest.mark.parametrize(
    ("kind", "d_ff"), [*[(kind, None) for kind in FORMATS], ("Q4_1", 32)], ids=str
)  # the last: an FFN narrower than the model
def test_the_c_forward_equals_the_eager_one(tmp_path_factory, kind, d_ff):
    """The prompt's logits, then ten cached steps, then the caches, against Decoder.forward."""
    model = packed_llama(tmp_path_factory, kind, d_ff)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    eager_cache, c_cache = model.new_cache(1, 20), model.new_cache(1, 20)
    want, got = run(model, prompt, cache=eager_cache, eager=True), run(model, prompt, cache=c_cache)
    assert close(got, want)
    token = want[:, -1:].argmax(-1)
    for _ in range(10):
        want = run(model, token, cache=eager_cache, eager=True)
        got = run(model, token, cache=c_cache)
        assert close(got, want)
        token = want[:, -1:].argmax(-1)
    assert c_cache.length == eager_cache.length == 16
    for mine, theirs in zip(c_cache.self_attn, eager_cache.self_attn, strict=True):
        assert mine.length == 16
        assert close(mine.k, theirs.k) and close(mine.v, theirs.v)
        assert torch.equal(mine.positions, theirs.positions)


@pytest.mark.variants
@pytest.mark.parametrize("kind", FORMATS)
def test_the_c_forward_on_the_integer_path_follows_the_eager_integer_one(tmp_path_factory, kind):
    """Every packed product on the integer path (int8 activations) in both: the eager stack
    rounds its own activations, whose float32 values differ from the C call's by rounding
    order, which now and then moves a value across a boundary of its int8 grid (one step of
    max|x_b| / 127 in one term, against this random model's 2-3% between the integer and
    float32 paths): held to 1% of the largest logit, and the same greedy tokens."""
    model = packed_llama(tmp_path_factory, kind, integer=True)
    assert min(model.decoder.layers_in_c()[0].kind) >= 8  # every product in tiles
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert close(run(model, ids), run(model, ids, eager=True), 1e-2)
    with torch.no_grad():
        got = model.generate(ids, 10)
        with packed_steps(False):
            want = model.generate(ids, 10)
    assert torch.equal(got, want)


@pytest.mark.variants
def test_padded_batches_decode_the_same_tokens(tmp_path_factory):
    """Rows of different lengths, left-padded: each row's own positions and key mask; each row's
    tokens are those it gets alone."""
    model = packed_llama(tmp_path_factory)
    ids = torch.tensor([[2, 2, 2, 5, 6, 7], [2, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26]])
    mask = ids != 2
    mask[2] = True  # the third row starts with real tokens
    with torch.no_grad():
        with packed_steps(False):
            want = model.generate(ids, 12, attention_mask=mask, do_sample=False)
        got = model.generate(ids, 12, attention_mask=mask, do_sample=False)
        alone = [model.generate(ids[i : i + 1, mask[i]], 12, do_sample=False) for i in range(3)]
    assert torch.equal(got, want)
    for i in range(3):  # each row as if it stood alone
        new = alone[i][0, int(mask[i].sum()) :]
        assert torch.equal(got[i, 6 : 6 + len(new)], new)


def test_beam_search_and_sampling_follow_the_eager_steps(tmp_path_factory):
    """Beam search reorders the cache's rows between C calls; sampling draws from its logits."""
    model = packed_llama(tmp_path_factory)
    ids = torch.tensor([[5, 6, 7, 8]])
    options = [dict(num_beams=3), dict(do_sample=True, seed=7, top_k=20)]
    with torch.no_grad():
        for option in options:
            with packed_steps(False):
                want = model.generate(ids, 10, **option)
            assert torch.equal(model.generate(ids, 10, **option), want), option


@pytest.mark.variants
@settings(max_examples=12, deadline=None)
@given(
    tokens=st.lists(st.integers(3, 100), min_size=2, max_size=40),
    cuts=st.lists(st.integers(1, 39), max_size=4),
    integer=st.booleans(),
    kind=st.sampled_from(["Q4_1", "Q8_0", "Q6_K"]),
    others=st.lists(st.lists(st.integers(3, 100), min_size=1, max_size=40), max_size=3),
    reused=st.integers(0, 39),
)
def test_invariance_a_tokens_logits_do_not_depend_on_what_shares_its_call(
    tmp_path_factory, tokens, cuts, integer, kind, others, reused
):
    """Bit for bit, the logits of every position of a sequence computed one token at a time
    equal those of the whole prompt in one call, of the prompt split at random places, of a
    prefix copied from another cache (a prompt cache) and the rest computed, and of the
    sequence as one row of a batch with other sequences, left-padded to the longest."""
    model = packed_llama(tmp_path_factory, kind, integer=integer)
    n, ids = len(tokens), torch.tensor([tokens])
    cache = model.new_cache(1, n)
    reference = torch.cat([run(model, ids[:, i : i + 1], cache=cache) for i in range(n)], dim=1)
    assert torch.equal(run(model, ids), reference)  # one call (chunks of MAX_ROWS inside)
    bounds = sorted({0, n, *[c for c in cuts if c < n]})
    cache = model.new_cache(1, n)
    parts = [run(model, ids[:, a:b], cache=cache) for a, b in pairwise(bounds)]
    assert torch.equal(torch.cat(parts, dim=1), reference)
    reused = min(reused, n - 1)
    source, cache = model.new_cache(1, n), model.new_cache(1, n)
    run(model, ids, cache=source)
    for out, kept in zip(cache.self_attn, source.self_attn, strict=True):
        out.append(kept.k[:, :, :reused], kept.v[:, :, :reused], kept.positions[:, :reused])
    assert torch.equal(run(model, ids[:, reused:], cache=cache), reference[:, reused:])
    rows = [tokens, *others]
    width = max(map(len, rows))
    batch = torch.tensor([[2] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    assert torch.equal(run(model, batch, mask=mask)[0, width - n :], reference[0])


def logits_under(variant, model, ids):
    """``model``'s logits for ``ids`` with the ``variant`` kernels, tiled by them."""
    with native.using(variant):
        use_integer_products(model, False)  # tiles are made by the variant that reads them
        use_integer_products(model, True)
        with torch.no_grad():
            logits = model(ids)
            tokens = model.generate(ids[:, :8], 4)
    return logits, tokens


@pytest.mark.parametrize("kind", FORMATS)
def test_variants_give_the_same_bits_on_the_integer_path(tmp_path_factory, kind):
    """Integer dot products are exact and the scales are applied in one order: every variant
    this CPU runs gives generic's logits bit for bit."""
    model = packed_llama(tmp_path_factory, kind, integer=True)
    ids = torch.randint(3, 101, (1, 23), generator=torch.Generator().manual_seed(0))
    want = logits_under("generic", model, ids)
    for variant in RUNNABLE:
        got = logits_under(variant, model, ids)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), variant


def test_tiles_made_by_another_layout_are_refused(tmp_path_factory):
    layouts = {}
    for variant in RUNNABLE:
        with native.using(variant) as kernel:
            layouts.setdefault(kernel.packed_tile_layout(), variant)
    if len(layouts) < 2:  # a CPU without AVX2: every variant it runs makes the same tiles
        assert RUNNABLE == ["generic"]
        return
    (one, maker), (other, reader) = list(layouts.items())[:2]
    model = packed_llama(tmp_path_factory)
    with native.using(maker):
        use_integer_products(model, True)
    with native.using(reader), torch.no_grad():
        message = rf"tile layout {one}, but the '{reader}' kernels in use read layout {other}"
        with pytest.raises(RuntimeError, match=message):
            model(torch.tensor([[5, 6, 7]]))


@pytest.mark.parametrize("variant", RUNNABLE)
def test_every_variant_this_cpu_runs_computes_the_eager_forward(tmp_path_factory, variant):
    """The float path of every variant built at install that this CPU can run (plain C on
    any) against the eager stack with the same variant's products."""
    with native.using(variant):
        test_the_c_forward_equals_the_eager_one(tmp_path_factory, "Q4_1", 32)
        test_the_c_forward_equals_the_eager_one(tmp_path_factory, "Q6_K", None)


def test_what_it_cannot_run_goes_eager(tmp_path_factory):
    model = packed_llama(tmp_path_factory)
    ids = torch.tensor([[5, 6, 7]])
    layers = model.decoder.layers
    calls = []
    hook = layers[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        run(model, ids)
        assert calls == []  # in C
        with torch.no_grad():
            logits, attentions = model(ids, return_attention=True)  # weights: eager
        assert calls == [1] and attentions[0].shape == (1, 4, 3, 3)
        assert close(logits, run(model, ids))
        model(ids)  # gradients on: eager
        assert calls == [1, 1]
        model.train()
        with torch.no_grad():
            model(ids)  # training mode: eager
        assert calls == [1, 1, 1]
    finally:
        hook.remove()
        model.eval()
    # models it cannot run: it says why, and packed_stack leaves them as they are
    floats = accel.quantize(ak.DecoderLM(ak.ModelConfig.preset("tiny")).eval(), "int8")
    assert why_not(floats).startswith("cfg.")
    assert type(packed_stack(floats).decoder) is ak.stacks.Decoder


@pytest.mark.needs("smollm2")
def test_smollm2_decodes_the_same_tokens_in_c():
    from attnkit.interop import load_tokenizer_for

    model = ak.from_pretrained("smollm2", dequantize=False)
    ak.accel.prepare(model, "decoding", exact=True)
    tokenizer = load_tokenizer_for("smollm2")
    prompts = ["The capital of France is", "今天 下雨 我 没 带 伞"]
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            with packed_steps(False):
                want = model.generate(ids, 16, do_sample=False)
            assert torch.equal(model.generate(ids, 16, do_sample=False), want)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_variants_give_the_shipped_models_the_same_prompt_logits(name, request):
    """The shipped GGUF models on the integer path: every variant this CPU runs gives the same
    logits for a prompt, and the same greedy tokens (hashes in the assertion message)."""
    request.applymarker(pytest.mark.needs(name))
    model = ak.from_pretrained(name, dequantize=False)
    ak.accel.prepare(model, "decoding")
    ids = torch.randint(3, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    seen = {variant: logits_under(variant, model, ids) for variant in RUNNABLE}
    hashes = {v: (digest(logits), digest(tokens)) for v, (logits, tokens) in seen.items()}
    assert len(set(hashes.values())) == 1, hashes


@pytest.mark.variants
@pytest.mark.parametrize(
    ("integer", "laid_out"), [(False, False), (False, True), (True, False)], ids=str
)
def test_gemma3_in_c_equals_the_eager_stack(tmp_path, integer, laid_out):
    """Gemma 3's layers in C: QK-norm, sandwich norms, GeGLU, heads wider than d_model /
    n_heads, and window layers whose ring of 4 keys wraps several times, in the prompt (a
    prompt of 6) and over 14 steps; one product left in float32, as the Q6_K ones of the shipped
    file once were (in both of its layouts: laid out for decoding, the (in, out) rows). Against
    the eager stack on the same products (to rounding order; on the integer path to 1%, as
    for Llama); and the stack's invariance, one token at a time against the whole sequence."""
    from attnkit.accel.decoding import lay_out_for_decoding
    from test_interop_gemma3 import _gemma3

    _, model = _gemma3(tmp_path)
    accel.quantize(model, "Q4_1", skip=["lm_head"])
    ffn = model.decoder.layers[1].ffn
    dense = torch.nn.Linear(ffn.down.in_features, ffn.down.out_features, bias=False)
    dense.weight.data = ffn.down.dequantized()
    ffn.down = dense.eval()
    if laid_out:
        lay_out_for_decoding(model)
        assert not dense.weight.is_contiguous() and dense.weight.t().is_contiguous()
    use_integer_products(model, integer)
    model = packed_stack(model)
    assert type(model.decoder) is PackedStack, why_not(model)
    layers = model.decoder.layers_in_c()
    assert [layer.window for layer in layers] == [4, 0, 4, 0]
    assert layers[1].kind[4] == (17 if laid_out else 16)  # float32: (in, out) or (out, in)
    bound = 1e-2 if integer else 1e-5
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    eager_cache, c_cache = model.new_cache(1, 32), model.new_cache(1, 32)
    want, got = run(model, prompt, cache=eager_cache, eager=True), run(model, prompt, cache=c_cache)
    assert close(got, want, bound)
    ids, token = prompt, want[:, -1:].argmax(-1)
    for step in range(14):
        want = run(model, token, cache=eager_cache, eager=True)
        got = run(model, token, cache=c_cache)
        assert close(got, want, bound), step
        ids, token = torch.cat([ids, token], dim=1), want[:, -1:].argmax(-1)
    for mine, theirs in zip(c_cache.self_attn, eager_cache.self_attn, strict=True):
        assert mine.length == theirs.length == 20
        assert torch.equal(mine.positions, theirs.positions)
        if hasattr(mine, "valid"):
            assert torch.equal(mine.valid, theirs.valid)
        assert close(mine.k, theirs.k, 1e-2 if integer else 1e-4)
    # the stack's output, one token at a time or all at once (this model's output layer is
    # float32, torch's product, whose last bits may depend on the rows it is given)
    with torch.no_grad():
        cache = model.new_cache(1, 20)
        one = [model.hidden_states(ids[:, i : i + 1], None, cache)[0] for i in range(20)]
        assert torch.equal(model.hidden_states(ids)[0], torch.cat(one, dim=1))
