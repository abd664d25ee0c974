"""Speculative decoding keeps the model's answer: greedy output equal to plain decoding's, token
for token and logit for logit, across draft lengths, drafts from the context and from a draft
model, full and sliding-window caches, the integer and float32 paths of the C stack; sampling
keeps the model's distribution (the acceptance rule, measured against a rule that is wrong)."""

import copy

import pytest
import torch

import attnkit as ak
from attnkit import accel
from attnkit.caches import RollingKVCache
from attnkit.speculative import MAX_DRAFT, Speculative, _verify, lookup_draft

pytestmark = pytest.mark.variants  # make test runs it again under each kernel variant


def llama(seed: int, attention: str = "full", vocab: int = 64, layers: int = 2):
    torch.manual_seed(seed)
    window = dict(attention="window", window=8, global_every=2) if attention == "window" else {}
    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=vocab, position="rope", norm_type="rmsnorm", activation="swiglu",
        bias=False, n_kv_heads=2, eos_id=None, n_layers=layers, max_len=256, **window,
    )  # fmt: skip
    model = ak.DecoderLM(cfg).eval()
    with torch.no_grad():  # weights 6x their initial scale: varied text, not one echoed token
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.mul_(6)
    return model


def packed(model, path: str):
    model = accel.quantize(copy.deepcopy(model), "Q8_0")
    model = accel.prepare(model, "decoding", exact=path == "float32").model
    assert type(model.decoder) is accel.PackedStack
    return model


def run(model, ids, steps, **options):
    logits = []
    out = model.generate(ids, steps, on_logits=lambda row: logits.append(row.clone()), **options)
    return out, logits


# a prompt that repeats itself in part: lookup finds drafts, a random model rejects many
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 12, 13, 5, 6, 7, 8, 40, 41, 5, 6]])


@pytest.mark.parametrize("attention", ["full", "window"])
@pytest.mark.parametrize("path", ["int8", "float32"])
def test_speculative_greedy_is_plain_greedy_bit_for_bit(path, attention):
    model = packed(llama(0, attention), path)
    draft = llama(1, vocab=64, layers=1)
    want, want_logits = run(model, PROMPT, 40)
    kept = rejected = 0
    for k in (1, 2, 5, MAX_DRAFT):
        for source in (None, draft):
            spec = Speculative(k, ngram=2, model=source)
            out, logits = run(model, PROMPT, 40, speculative=spec)
            assert torch.equal(out, want), (k, source is None)
            assert len(logits) == len(want_logits)
            assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
            stats = spec.stats  # each call after the prompt's: its kept drafts and one more
            assert stats.tokens == 40 and stats.calls + stats.accepted == 39
            kept += stats.accepted
            rejected += stats.drafted - stats.accepted
    assert kept > 0 and rejected > 0  # both branches ran: drafts kept, drafts rewound


def test_speculative_greedy_on_float32_layers_gives_the_same_tokens():
    # A model of nn.Linear layers: a verifying call's GEMM may round differently in the last
    # bits from a one-row product; the tokens are the same here.
    model = llama(2)
    want, want_logits = run(model, PROMPT, 30)
    out, logits = run(model, PROMPT, 30, speculative=Speculative(4, ngram=2))
    assert torch.equal(out, want)
    for a, b in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.needs("smollm2")
def test_the_shipped_model_speculates_exactly_on_a_grounded_prompt():
    from attnkit.interop import load_tokenizer_for

    model = ak.from_pretrained("smollm2", dequantize=False)
    tokenizer = load_tokenizer_for("smollm2")
    text = "The animal didn't cross the street because it was too tired. " * 4
    ids = torch.tensor([tokenizer.encode(f"Repeat: {text}\nAgain: The animal")])
    want, want_logits = run(model, ids, 24)
    spec = Speculative(6)
    out, logits = run(model, ids, 24, speculative=spec)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
    assert spec.stats.acceptance > 0.5 and spec.stats.tokens_per_read > 2


def test_a_draft_from_the_context_is_what_followed_the_last_ngram():
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3])
    assert lookup_draft(seq, 3, 2) == [4, 5]  # the latest earlier match of [1, 2, 3]
    assert lookup_draft(seq, 3, 10) == [4, 5, 1, 2, 3]
    assert lookup_draft(torch.tensor([7, 8, 9, 8]), 3, 2) == [9, 8]  # falls back to 1-grams
    assert lookup_draft(torch.tensor([1, 2, 3]), 3, 4) == []
    assert lookup_draft(torch.tensor([7, 8, 9, 8]), 3, 2, shortest=2) == []  # no 2-gram recurs


def test_a_ring_rewinds_to_the_slots_it_held():
    ring = RollingKVCache(1, 1, 4, 2)
    for position in range(6):
        ring.update(ak.caches.Keys(torch.full((1, 1, 1, 2), float(position)),
                                   torch.full((1, 1, 1, 2), float(position))))  # fmt: skip
    before = [t.clone() for t in (ring.k, ring.v, ring.positions, ring.valid)]
    saved = ring.ahead(3)
    ring.k[:, :, [2, 3, 0]] = -1.0  # three positions written over slots 2, 3, 0
    ring.written(3)
    ring.rewind(2, saved)  # the last two forgotten: slots 3 and 0 hold what they held
    assert ring.length == 7
    assert torch.equal(ring.k[:, :, [3, 0]], before[0][:, :, [3, 0]])
    assert torch.equal(ring.k[:, :, 2], torch.full((1, 1, 2), -1.0))


@pytest.mark.parametrize("q", [None, torch.tensor([0.05, 0.6, 0.05, 0.2, 0.1])])
def test_the_acceptance_rule_keeps_the_models_distribution(q):
    """Drafts drawn from q (None: always token 1, a looked-up draft), kept or replaced by the
    rule: the tokens that come out follow p. Keeping every draft would follow q instead."""
    p = torch.tensor([0.3, 0.1, 0.25, 0.05, 0.3])
    logits = p.log()[None]
    generator = torch.Generator().manual_seed(0)
    counts, n = torch.zeros(5), 20000
    for _ in range(n):
        draft = 1 if q is None else int(torch.multinomial(q, 1, generator=generator))
        kept, own = _verify(logits, draft, q, lambda x: x.softmax(-1), generator)
        counts[draft if kept else own] += 1
    got = counts / n
    assert (got - p).abs().sum() / 2 < 0.02
    wrong = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]) if q is None else q
    assert (wrong - p).abs().sum() / 2 > 0.3  # what a rule that kept every draft would give


def test_speculative_sampling_is_seeded_and_runs_every_path():
    model = packed(llama(3), "int8")
    draft = llama(4, layers=1)
    for source in (None, draft):
        options = dict(do_sample=True, temperature=1.5, top_k=20, seed=7)
        a = model.generate(PROMPT, 30, speculative=Speculative(3, ngram=2, model=source), **options)
        b = model.generate(PROMPT, 30, speculative=Speculative(3, ngram=2, model=source), **options)
        assert torch.equal(a, b) and a.shape == (1, PROMPT.shape[1] + 30)


def test_speculative_refuses_what_it_cannot_do():
    model = llama(5)
    with pytest.raises(ValueError, match=r"draft length must be an int in \[1, 15\], got 16"):
        model.generate(PROMPT, 4, speculative=16)
    with pytest.raises(ValueError, match="got 0"):
        Speculative(0)
    with pytest.raises(ValueError, match=r"min_ngram must be an int in \[1, ngram=2\], got 3"):
        Speculative(4, ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="cannot be combined with beam search"):
        model.generate(PROMPT, 4, speculative=4, num_beams=2)
    with pytest.raises(ValueError, match="one prompt at a time, got a batch of 2"):
        model.generate(PROMPT.repeat(2, 1), 4, speculative=4)
    other = llama(6, vocab=80)
    with pytest.raises(ValueError, match=r"vocabulary \(80 tokens\) is not the model's \(64\)"):
        model.generate(PROMPT, 4, speculative=Speculative(2, model=other))
    torch.manual_seed(0)
    linear = ak.DecoderLM(ak.ModelConfig.preset("tiny", vocab_size=64, attention="linear"))
    with pytest.raises(ValueError, match="LinearAttentionState"):
        linear.generate(PROMPT, 4, speculative=2)
    with pytest.raises(TypeError, match="speculative must be None, a draft length"):
        model.generate(PROMPT, 4, speculative="4")


@pytest.mark.parametrize("attention", ["full", "window"])
def test_the_engine_speculates_greedy_requests_to_the_same_answer(attention):
    """attnkit serve --speculate: a greedy request alone in the batch, with and without
    penalties and logprobs, answers as the engine without speculation; a sampled one decodes
    as before."""
    import queue

    from attnkit.serve import Engine, Request
    from test_serve_engine import collect

    class Ids:  # a tokenizer of token ids: the text is the ids
        vocab_size, eos_id = 64, None

        def decode(self, ids):
            return "".join(f"{i} " for i in ids)

    model = packed(llama(7, attention), "int8")
    requests = [
        dict(temperature=0, logprobs=2),
        dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.8, seed=3),
    ]
    answers = []
    for speculative in (None, Speculative(5, ngram=2)):
        engine = Engine(model, Ids(), max_batch=1, start=True, speculative=speculative)
        try:
            got = []
            for options in requests:
                q = queue.Queue()
                engine.submit(Request(PROMPT[0].tolist(), 30, **options), q.put)
                got.append([(e.get("id"), e.get("logprob")) for e in collect(q)[:-1]])
            answers.append(got)
            stats = engine.stats()
        finally:
            engine.close()
    assert answers[0] == answers[1]
    assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"]
