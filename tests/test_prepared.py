"""A prepared model answers as the plain one: every lever ``accel.prepare`` applies for training
or for decoding, on or off, keeps ``generate`` (cached and uncached, greedy and beam search) equal
to the plain model's for the decoder-only and encoder-decoder families, and the classifier's
outputs equal to its plain forward's. (The one lever that changes answers by a documented rule,
the integer path of packed products, is held to its own tests: test_packed_step.)

The prompts stay under 8 tokens, below which no product takes oneDNN's GEMM: the levers are then
the same arithmetic as the plain model, and the tokens can be compared on any CPU."""

import copy
import warnings
from contextlib import ExitStack

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import accel

pytestmark = pytest.mark.variants  # make test runs it again under each kernel variant

# each training lever's switch (a with block turns it on or off)
TRAINING = {
    "unpadded": accel.unpadding,
    "attention-kernel": accel.attention_kernel,
    "fused-loss": accel.loss_kernels,
    "onednn-fp32": accel.onednn_linear,
}
DECODING = {"packed-step": accel.packed_steps, "decoding-layout": accel.decoding_layouts}


def build(family: str, seed: int):
    torch.manual_seed(seed)
    cfg = ak.ModelConfig.preset("tiny", vocab_size=61, bos_id=1, eos_id=2, dropout=0.1)
    if family == "decoder-only":
        return ak.DecoderLM(cfg)
    if family == "encoder-decoder":
        return ak.Transformer(cfg)
    return ak.EncoderClassifier(cfg, num_classes=3)


def answers(model, family: str, ids: torch.Tensor, mask: torch.Tensor):
    """What the model answers for ``ids``: its tokens (greedy cached and uncached, beam search)
    or, for the classifier, its logits."""
    model.eval()
    with torch.no_grad():
        if family == "encoder-only":
            return [model(ids, attention_mask=mask)]
        kind = "attention_mask" if family == "decoder-only" else "src_mask"
        options = [dict(), dict(use_cache=False), dict(num_beams=3)]
        return [model.generate(ids, 8, **{kind: mask}, **o) for o in options]


def switched(switches: dict, on: dict) -> ExitStack:
    stack = ExitStack()
    for name, switch in switches.items():
        stack.enter_context(switch(on[name]))
    return stack


def same(family, got, want):
    for a, b in zip(got, want, strict=True):
        if family == "encoder-only":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert torch.equal(a, b)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(
    family=st.sampled_from(["decoder-only", "encoder-decoder", "encoder-only"]),
    on=st.fixed_dictionaries({name: st.booleans() for name in TRAINING}),
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=3),
    seed=st.integers(0, 50),
)
def test_a_model_prepared_for_training_answers_as_the_plain_one(family, on, lengths, seed):
    """Prepared for training (what the trainer's validation and its end-of-training sample
    decode with), each lever on or off: the plain model's answers, for a padded batch."""
    plain = build(family, seed)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 61, (len(lengths), width), generator=g)
    mask = torch.arange(width)[None] >= (width - torch.tensor(lengths))[:, None]  # left padding
    if family != "decoder-only":
        mask = mask.flip(1)  # sources padded on the right
    want = answers(plain, family, ids, mask)
    with switched(TRAINING, on):
        prepared = accel.prepare(copy.deepcopy(plain), "training").model
        found = {lever.name: lever.on for lever in accel.levers("training")}
        assert all(found[name] == on[name] for name in ("unpadded", "attention-kernel")), found
        same(family, answers(prepared, family, ids, mask), want)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    on=st.fixed_dictionaries({name: st.booleans() for name in DECODING}), seed=st.integers(0, 50)
)
def test_a_packed_model_prepared_for_decoding_answers_as_the_plain_one(on, seed):
    """A packed Llama prepared for decoding on its float32 path (``exact``: the integer path is
    the rule's own change), its C stack and its layout on or off: the plain model's tokens."""
    torch.manual_seed(seed)
    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=64, position="rope", norm_type="rmsnorm", activation="swiglu",
        bias=False, n_kv_heads=2, eos_id=2,
    )  # fmt: skip
    plain = accel.quantize(ak.DecoderLM(cfg).eval(), "Q8_0", skip=["lm_head"])
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :2] = False
    want = answers(plain, "decoder-only", ids, mask)
    with switched(DECODING, on):
        prepared = accel.prepare(copy.deepcopy(plain), "decoding", exact=True).model
        assert (type(prepared.decoder) is accel.PackedStack) == on["packed-step"]
        same("decoder-only", answers(prepared, "decoder-only", ids, mask), want)


def test_the_switches_environment_is_read_when_the_levers_are_reported(monkeypatch):
    # One place reads the environment (accel.levers, accel.prepare): setting a variable
    # changes nothing until then, and a with block holds its own value against it.
    from attnkit.accel.switch import switch

    monkeypatch.setenv("ATTNKIT_UNPAD", "0")
    assert switch("ATTNKIT_UNPAD").on  # not read yet
    line = ", ".join(str(lever) for lever in accel.levers("training"))
    assert "unpadded off (ATTNKIT_UNPAD=0)" in line and not switch("ATTNKIT_UNPAD").on
    with accel.unpadding(True):
        accel.levers("training")
        assert switch("ATTNKIT_UNPAD").on
    monkeypatch.delenv("ATTNKIT_UNPAD")
    assert "unpadded on" in ", ".join(str(lever) for lever in accel.levers("training"))


def test_a_model_loaded_with_packed_weights_is_ready_for_decoding(tmp_path):
    """from_pretrained readies a model that keeps blocks as ``attnkit generate`` does (the
    same levers, the same tokens); a packed model nobody readied says so, once."""
    from attnkit.accel import packed

    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=64, position="rope", norm_type="rmsnorm", activation="swiglu",
        bias=False, n_kv_heads=2, eos_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = accel.quantize(ak.DecoderLM(cfg).eval(), "Q8_0")
    plain.save_pretrained(tmp_path / "q")
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    packed._said = False
    with pytest.warns(UserWarning, match=r"runs unprepared: accel.prepare\(model, 'decoding'\)"):
        unprepared = plain.generate(ids, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails
        plain.generate(ids, 8)  # said once
        loaded = ak.from_pretrained(tmp_path / "q")
        assert type(loaded.decoder) is accel.PackedStack
        assert all(m.integer for m in loaded.modules() if isinstance(m, accel.PackedLinear))
        ready = accel.prepare(copy.deepcopy(plain), "decoding").model
        assert torch.equal(loaded.generate(ids, 8), ready.generate(ids, 8))
        exact = accel.prepare(loaded, "decoding", exact=True).model  # the explicit form
        assert torch.equal(exact.generate(ids, 8), unprepared)
