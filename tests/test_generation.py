"""Generation: the cache changes nothing, beam search finds what exhaustive search finds,
sampling is reproducible, EOS stops each row on its own."""

import copy
import itertools

import pytest
import torch

import attnkit as ak
from attnkit import accel
from attnkit.accel import autotuning
from attnkit.generation import beam_search, sample_next
from ties import greedy_ties, lm_logits_at

POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "none"]
V = 12


def make(family, position="learned", vocab_size=V, seed=0, **overrides):
    """A small model with sharp (not near-uniform) next-token distributions. Its config has no
    EOS (never stop early) unless a test passes ``eos_id`` to generate."""
    overrides.setdefault("eos_id", None)
    overrides.setdefault("n_layers", 2)
    cfg = ak.ModelConfig.preset(
        "tiny",
        vocab_size=vocab_size,
        d_model=32,
        n_heads=4,
        d_ff=64,
        max_len=64,
        position=position,
        **overrides,
    )
    torch.manual_seed(seed)
    model = (ak.DecoderLM if family == "decoder" else ak.Transformer)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.3)
    return model


def record_logits(model):
    """Collect, for every decoding step, the logits of the last position (recomputed from the
    decoder's final hidden state, which is what the generation loop feeds to the LM head)."""
    seen = []

    def hook(module, inputs, out):
        seen.append(model.lm_head(out[0][:, -1]).detach())

    model.decoder.register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_greedy_with_and_without_cache_agree(family, position, n_kv_heads):
    model = make(family, position, n_kv_heads=n_kv_heads)
    inputs = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    seen = record_logits(model)
    cached = model.generate(inputs, 12, use_cache=True, eos_id=None)
    cached_logits, seen[:] = list(seen), []
    uncached = model.generate(inputs, 12, use_cache=False, eos_id=None)
    assert torch.equal(cached, uncached)
    assert len(cached_logits) == len(seen) == 12
    for a, b in zip(cached_logits, seen, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_uneven_prompts_batched_equal_each_alone(position, use_cache):
    model = make("decoder", position)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 3]]
    n = max(map(len, prompts))
    ids = torch.zeros(3, n, dtype=torch.long)
    mask = torch.zeros(3, n, dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = True
    batched = model.generate(ids, 8, attention_mask=mask, use_cache=use_cache, eos_id=None)
    for i, p in enumerate(prompts):
        alone = model.generate(torch.tensor([p]), 8, use_cache=use_cache, eos_id=None)
        assert batched[i, n:].tolist() == alone[0, len(p) :].tolist()


def test_padded_sources_translate_as_each_alone():
    model = make("encoder-decoder", "sinusoidal")
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    out = model.generate(src, 6, src_mask=src != 0, eos_id=None)
    assert out[1].tolist() == model.generate(src[1:, :2], 6, eos_id=None)[0].tolist()
    assert torch.all(out[:, 0] == model.cfg.bos_id)


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_beam_search_with_one_beam_is_greedy(family):
    model = make(family)
    inputs = torch.tensor([[3, 4, 5], [6, 7, 8]])
    greedy = model.generate(inputs, 10, eos_id=None)
    hyps = beam_search(model, inputs, 10, num_beams=1, eos_id=None)
    for b in range(2):
        assert hyps[b][0].tokens == greedy[b, -10:].tolist()


def _best_two_token_continuation(model, prompt):
    """Exhaustive search over all V x V continuations of two tokens."""
    with torch.no_grad():
        first = torch.log_softmax(model(prompt)[0, -1], -1)
        best, best_pair = float("-inf"), None
        for a in range(V):
            second = torch.log_softmax(
                model(torch.cat([prompt, torch.tensor([[a]])], 1))[0, -1], -1
            )
            for b in range(V):
                score = (first[a] + second[b]).item()
                if score > best:
                    best, best_pair = score, [a, b]
    return best, best_pair


def test_beam_as_wide_as_the_vocabulary_is_exhaustive_over_two_tokens():
    model = make("decoder", seed=3)
    greedy_missed = 0
    for prompt in itertools.islice(itertools.product(range(3, V), repeat=2), 40):
        prompt = torch.tensor([prompt])
        best, pair = _best_two_token_continuation(model, prompt)
        hyps = beam_search(model, prompt, 2, num_beams=V, eos_id=None, length_penalty=0.0)
        assert hyps[0][0].tokens == pair
        assert hyps[0][0].score == pytest.approx(best, abs=1e-4)
        greedy = model.generate(prompt, 2, eos_id=None)[0, -2:].tolist()
        greedy_missed += greedy != pair
    assert greedy_missed > 0  # some prompt where greedy is not optimal: the test is not vacuous


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_beam_search_never_returns_worse_than_a_hypothesis_it_dropped(family, length_penalty):
    model = make(family, vocab_size=6, seed=5)
    inputs = torch.tensor([[3, 4, 5], [4, 4, 3]])
    seen = {0: [], 1: []}
    hyps = beam_search(
        model,
        inputs,
        8,
        num_beams=3,
        eos_id=2,
        length_penalty=length_penalty,
        on_finish=lambda b, h: seen[b].append(h),
    )
    for b in range(2):
        assert len(seen[b]) >= 1
        best = hyps[b][0]
        assert all(best.normalized >= h.normalized for h in seen[b])
        assert best.normalized == pytest.approx(best.score / len(best.tokens) ** length_penalty)
        # the raw score really is the sum of the model's log-probabilities
        if family == "decoder":
            seq = torch.tensor([inputs[b].tolist() + best.tokens])
            with torch.no_grad():
                lp = torch.log_softmax(model(seq)[0, 2:-1], -1)
            total = lp.gather(1, torch.tensor(best.tokens)[:, None]).sum().item()
            assert best.score == pytest.approx(total, abs=1e-4)
    out = model.generate(inputs, 8, num_beams=3, eos_id=2, length_penalty=length_penalty)
    start = 3 if family == "decoder" else 1  # after the prompt, or after BOS
    assert out[0, start : start + len(hyps[0][0].tokens)].tolist() == hyps[0][0].tokens


def test_top_k_one_sampling_is_greedy():
    model = make("decoder")
    inputs = torch.tensor([[3, 4, 5], [6, 7, 8]])
    greedy = model.generate(inputs, 10, eos_id=None)
    sampled = model.generate(inputs, 10, do_sample=True, top_k=1, seed=123, eos_id=None)
    assert torch.equal(greedy, sampled)
    tiny_p = model.generate(inputs, 10, do_sample=True, top_p=1e-6, seed=7, eos_id=None)
    assert torch.equal(greedy, tiny_p)


def test_sampling_with_a_seed_is_reproducible():
    model = make("decoder")
    inputs = torch.tensor([[3, 4, 5]])
    a = model.generate(inputs, 20, do_sample=True, temperature=1.5, seed=11, eos_id=None)
    b = model.generate(inputs, 20, do_sample=True, temperature=1.5, seed=11, eos_id=None)
    c = model.generate(inputs, 20, do_sample=True, temperature=1.5, seed=12, eos_id=None)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, 5)
    g = torch.Generator().manual_seed(0)
    drawn = set(sample_next(logits, top_k=2, generator=g).tolist())
    assert drawn == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p=0.8 keeps tokens 0 and 1
    assert probs[0] < 0.8 < probs[0] + probs[1]
    drawn = set(sample_next(logits, top_p=0.8, generator=g).tolist())
    assert drawn == {0, 1}


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_each_row_stops_at_its_own_eos(family):
    model = make(family)
    inputs = torch.tensor([[3, 4, 5], [6, 7, 8]])
    free = model.generate(inputs, 10, eos_id=None)
    start = free.shape[1] - 10
    row0, row1 = free[0, start:].tolist(), free[1, start:].tolist()
    eos = next(t for t in row0[1:] if t not in row1)  # row 0 produces it, row 1 never does
    cut = row0.index(eos)
    out = model.generate(inputs, 10, eos_id=eos)
    assert out[0, start:].tolist() == row0[: cut + 1] + [model.cfg.pad_id] * (9 - cut)
    assert out[1, start:].tolist() == row1


def test_generation_stops_early_when_every_row_has_finished():
    model = make("decoder")
    inputs = torch.tensor([[3, 4, 5]])
    free = model.generate(inputs, 10, eos_id=None)
    eos = free[0, 4].item()
    out = model.generate(inputs, 10, eos_id=eos)
    assert out.shape[1] < free.shape[1] and out[0, -1].item() == eos


def test_cross_attention_keys_and_values_are_computed_once(monkeypatch):
    model = make("encoder-decoder", n_kv_heads=2)
    calls = []
    original = ak.MultiHeadAttention._project_kv
    monkeypatch.setattr(
        ak.MultiHeadAttention, "_project_kv", lambda self, c: calls.append(1) or original(self, c)
    )
    model.generate(torch.tensor([[3, 4, 5, 6]]), 10, eos_id=None)
    assert len(calls) == model.cfg.n_layers  # once per layer, not once per step
    calls.clear()
    model.generate(torch.tensor([[3, 4, 5, 6]]), 10, eos_id=None, use_cache=False)
    assert len(calls) == model.cfg.n_layers * 10


def test_requests_that_cannot_fit_fail_clearly():
    model = make("decoder", "learned")  # max_len 64
    with pytest.raises(ValueError, match="max_len=64; lower max_new_tokens to at most 60"):
        model.generate(torch.tensor([[3, 4, 5, 6]]), 61)
    rope = make("decoder", "rope")  # no absolute positions: no limit
    assert rope.generate(torch.tensor([[3, 4, 5, 6]]), 70, eos_id=None).shape == (1, 74)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.tensor([[3]]), 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(torch.tensor([[3]]), 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(torch.tensor([[3]]), 2, num_beams=2, do_sample=True)
    with pytest.raises(ValueError, match="eos_id"):
        model.generate(torch.tensor([[3]]), 2, eos_id=99)
    with pytest.raises(ValueError, match="token id 99"):
        model.generate(torch.tensor([[99]]), 2)


def test_generate_restores_training_mode():
    model = make("decoder").train()
    model.generate(torch.tensor([[3, 4]]), 3)
    assert model.training


def compiled_copy(model):
    """A copy of ``model`` prepared for decoding with compiled steps."""
    prepared = accel.prepare(copy.deepcopy(model), "decoding", compile=True)
    assert "compiled-step on" in prepared.line()
    return prepared.model


@pytest.mark.slow
@pytest.mark.needs("g++")
@autotuning(False)
def test_compiled_decoding_gives_the_same_tokens():
    # prepare(model, "decoding", compile=True) gives a model compiled cached steps (a copy of
    # each model here, so that the eager model stays eager): the tokens must not change,
    # for both families, greedy, sampling, beam search and left-padded prompts; a second call
    # reuses the compiled code, and another model gets its own (a stale reuse would change
    # its tokens). On a CPU the weights are constants of the compiled step, so after they
    # change in place the step must be compiled again (which changes to the weights count is
    # test_changed_weights_drop_the_compiled_steps' part). Each step is one graph: nothing in
    # it (a mask or position check) makes Dynamo split it. One layer per stack, and no
    # autotuning (test_compiled_steps_autotune_unless_turned_off has that): each compile costs
    # CI 10-30 s (twice that with autotuning on an empty cache).
    from torch._dynamo.utils import counters

    compiled_frames = counters["frames"]["ok"]
    graph_breaks = sum(counters["graph_break"].values())
    lm, other = make("decoder", "rope", n_layers=1), make("decoder", "rope", seed=1, n_layers=1)
    prompts = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], dim=1)
    ties = 0  # greedy rows accepted at a near-tie of their best two logits (tests/ties.py)
    fast = {id(m): compiled_copy(m) for m in (lm, other)}

    def same_greedy(model, expected, got):
        nonlocal ties
        ties += greedy_ties(expected, got, lm_logits_at(model, expected, full_mask))

    for model in (lm, other, lm):
        for options in ({}, {"do_sample": True, "seed": 3, "top_k": 5}, {"num_beams": 3}):
            eager = model.generate(prompts, 10, attention_mask=mask, **options)
            compiled = fast[id(model)].generate(prompts, 10, attention_mask=mask, **options)
            if options:  # sampling with one seed and beam search: the same tokens exactly
                assert torch.equal(eager, compiled), options
            else:
                same_greedy(model, eager, compiled)
    fast_lm = fast[id(lm)]
    fast_lm.load_state_dict(other.state_dict())  # in place: it now computes what other does
    expected = other.generate(prompts, 10, attention_mask=mask)
    same_greedy(other, expected, fast_lm.generate(prompts, 10, attention_mask=mask))
    mt = make("encoder-decoder", "sinusoidal", n_layers=1)
    fast_mt = compiled_copy(mt)
    sources = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    eager = mt.generate(sources, 10, num_beams=3)
    assert torch.equal(eager, fast_mt.generate(sources, 10, num_beams=3))
    eager = mt.generate(sources, 10)

    def mt_logits_at(b, i):
        with torch.no_grad():
            return mt(sources[b : b + 1], eager[b : b + 1, :i])[0, -1]

    ties += greedy_ties(eager, fast_mt.generate(sources, 10), mt_logits_at)
    assert ties <= 1  # a near-tie is rare: at most one of the 9 greedy rows compared here
    assert counters["frames"]["ok"] >= compiled_frames + 3  # the steps really were compiled
    assert sum(counters["graph_break"].values()) == graph_breaks, dict(counters["graph_break"])


def test_compiled_steps_autotune_unless_turned_off(monkeypatch):
    # On a CPU the step is compiled with the weights frozen in and, unless autotuning is off,
    # with max_autotune over Inductor's C++ GEMM and torch's; each setting has its own step.
    from attnkit.accel import compiled

    made = []
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda step, **kw: made.append(kw) or (lambda: step))
    step, cpu = (lambda: None), torch.device("cpu")
    first = compiled.compiled_step(step, cpu)
    assert compiled.compiled_step(step, cpu) is first and len(made) == 1  # made once
    with autotuning(False):
        assert compiled.compiled_step(step, cpu) is not first
    assert made[0]["dynamic"] and made[0]["options"]["freezing"]
    assert made[0]["options"]["max_autotune"]
    assert made[0]["options"]["max_autotune_gemm_backends"] == "CPP,ATEN"
    assert made[1]["options"]["freezing"] and "max_autotune" not in made[1]["options"]


def test_changed_weights_drop_the_compiled_steps(monkeypatch):
    # What frozen_weights (the block every call to a CPU's compiled steps runs in) does when a
    # model's weights changed since its steps were compiled: it drops the compiled code (which then
    # compiles again, as the test above shows for an in-place load). Every kind of change
    # counts: in place, a parameter replaced by one of the same values, a buffer moved.
    from attnkit.accel import compiled

    resets = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1))
    lm = make("decoder", "rope", n_layers=1)

    def drops():
        before = len(resets)
        with compiled.frozen_weights(lm):
            pass
        return len(resets) > before

    assert not drops()  # first use: nothing compiled for it yet
    assert not drops()  # unchanged weights keep the compiled code
    lm.load_state_dict(make("decoder", "rope", seed=1, n_layers=1).state_dict())
    assert drops() and not drops()
    with torch.no_grad():  # a replaced parameter: the same values and version, a new tensor
        lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach())
        lm.embeddings.tokens.weight = lm.lm_head.weight  # keep the tying
    assert drops() and not drops()
    with torch.no_grad():
        lm.lm_head.weight.mul_(-1)
    assert drops() and not drops()
    lm.to(torch.float64)
    assert drops() and not drops()
    other = make("decoder", "rope", seed=2, n_layers=1)
    with compiled.frozen_weights(other):  # another model's first use drops nothing
        pass
    assert not drops()


def test_compile_without_a_cxx_compiler_fails_clearly(monkeypatch):
    monkeypatch.setattr("attnkit.accel.compiled.shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        accel.prepare(make("decoder"), "decoding", compile=True)


_JOINS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack, torch.Tensor.repeat})


class _CountConcatenations(torch.overrides.TorchFunctionMode):
    """Records every torch.cat / torch.stack (any spelling) called inside the block."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _JOINS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_the_kv_cache_is_preallocated_and_a_step_concatenates_nothing(family):
    """Each cached step writes into storage allocated once: the cache tensors keep their
    memory, and no step joins tensors (a cache that grew by torch.cat would)."""
    model = make(family)
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(0))
    if family == "decoder":
        cache = model.new_cache(2, 16)
        step = lambda t: model(ids[:, t : t + 1], cache=cache)  # noqa: E731
    else:
        memory = model.encode(ids)
        cache = model.new_cache(2, ids.shape[1], 16)
        step = lambda t: model.decode(ids[:, t : t + 1], memory, cache=cache)  # noqa: E731
    with torch.no_grad():
        step(0)  # the first step (cross-attention fills its cache once)
        storage = [c.k.data_ptr() for c in cache.self_attn + (cache.cross_attn or [])]
        with _CountConcatenations() as joins:
            for t in range(1, 12):
                step(t)
    assert joins.calls == []
    assert [c.k.data_ptr() for c in cache.self_attn + (cache.cross_attn or [])] == storage
    assert cache.length == 12


def test_greedy_ties_accepts_a_near_tie_and_nothing_else():
    logits = {0: torch.tensor([1.0, 1.0 + 5e-5, -3.0]), 1: torch.tensor([2.0, 0.0, 0.5])}
    expected = torch.tensor([[1, 1], [0, 0]])
    assert greedy_ties(expected, expected.clone(), lambda b, i: logits[b]) == 0
    near = torch.tensor([[0, 2], [0, 0]])  # row 0 parts at a near-tie: accepted, not compared on
    assert greedy_ties(expected, near, lambda b, i: logits[b]) == 1
    far = torch.tensor([[1, 1], [2, 0]])  # row 1 parts where the best logit leads by 1.5
    with pytest.raises(AssertionError, match="row 1: token 0 is 2, expected 0"):
        greedy_ties(expected, far, lambda b, i: logits[b])


def test_generate_runs_the_steps_the_model_provides():
    # The protocol between a model and the decoding loops (generation.DecodingSteps): the
    # cached steps and the session come from model.decoding_steps; without it, the plain ones.
    from contextlib import contextmanager

    from attnkit.generation import DecodingSteps, lm_step

    lm = make("decoder", "rope", n_layers=1)
    prompts = torch.tensor([[3, 4, 5], [6, 7, 8]])
    plain = lm.generate(prompts, 6)
    calls, sessions = [], []

    def counted(model, *args):
        calls.append(1)
        return lm_step(model, *args)

    @contextmanager
    def session(model):
        sessions.append(model)
        yield

    lm.decoding_steps = DecodingSteps(lm=counted, session=session)
    assert torch.equal(lm.generate(prompts, 6), plain)
    assert len(calls) == 5 and sessions == [lm]  # one cached step per token after the first
    assert torch.equal(lm.generate(prompts, 6, use_cache=False), plain)
    assert len(calls) == 5  # uncached steps run the whole sequence through the plain step
    del lm.decoding_steps
    assert torch.equal(lm.generate(prompts, 6), plain)
