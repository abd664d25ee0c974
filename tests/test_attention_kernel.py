"""The C attention kernel (``accel/attention.c``) against torch: a property over random shapes,
masks and strides (float32 against float64 references, bfloat16 against float32), rows with
nothing to attend to, the models' training steps with the kernel on and off (eager and compiled
layers), the cases it leaves to torch, and the AVX2 and plain C builds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
import attnkit.accel.attention as kernel_module
from attnkit import accel, backends
from attnkit.accel import native
from attnkit.accel.attention import (
    Sequences,
    attention,
    attention_kernel,
    attention_tiles,
    packed_self_attention,
    tiles_available,
)

RUNNABLE = [name for name in native.VARIANTS if native.runnable(name)]


def reference(q, k, v, mask, causal):
    """torch's math in float64: out, and a row with nothing to attend to gives 0 (as attnkit)."""
    q, k, v = (t.double() for t in (q, k, v))
    n, m = q.shape[2], k.shape[2]
    allowed = torch.ones(n, m, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(m - n)  # bottom-right aligned
    if mask is not None:
        allowed = allowed & mask
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return (torch.nan_to_num(weights) @ v).float()


def heads(b, h, n, d, dtype, gen, layout):
    """(B, H, N, d) heads laid out as the layers make them (a slice of (B, N, 3 H d),
    transposed) or contiguous."""
    if layout == "contiguous":
        return torch.randn(b, h, n, d, generator=gen).to(dtype).requires_grad_()
    wide = torch.randn(b, n, 3 * h * d, generator=gen).to(dtype).requires_grad_()
    return wide[..., h * d : 2 * h * d].view(b, n, h, d).transpose(1, 2)


def cases(most: int, length: int, widths: list[int]) -> dict:
    """Hypothesis strategies for a shape (batch and heads up to most, positions up to length,
    d from widths), masks, a layout and a seed."""
    return dict(
        b=st.integers(1, most),
        h=st.integers(1, most),
        n=st.integers(1, length),
        m=st.integers(1, length),
        d=st.sampled_from(widths),
        causal=st.booleans(),
        padding=st.booleans(),
        layout=st.sampled_from(["contiguous", "heads"]),
        seed=st.integers(0, 2**16),
    )


@settings(max_examples=60, deadline=None)
@given(**cases(3, 40, [1, 8, 16, 24, 32, 40, 64]))
def test_kernel_equals_the_float64_reference(b, h, n, m, d, causal, padding, layout, seed):
    check_float32(b, h, n, m, d, causal, padding, layout, torch.Generator().manual_seed(seed))


def check_float32(b, h, n, m, d, causal, padding, layout, gen):
    """The kernel's float32 output and gradients against the float64 reference."""
    q = heads(b, h, n, d, torch.float32, gen, layout)
    k, v = (heads(b, h, m, d, torch.float32, gen, layout) for _ in range(2))
    mask = torch.rand(b, 1, 1, m, generator=gen) > 0.3 if padding else None
    grad = torch.randn(b, h, n, d, generator=gen)
    assert kernel_module._takes(q, k, v, 0.0, False)  # the kernel, not torch, answers below
    with attention_kernel(True):
        out = attention(q, k, v, attn_mask=mask, is_causal=causal)  # key padding and/or causal
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out = reference(q64, k64, v64, mask, causal)
    want = torch.autograd.grad(want_out, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w.float(), rtol=1e-4, atol=1e-5)


def test_bf16_matches_float32_to_bf16_rounding():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 50, 32, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 50, 32)
    want_out = reference(q, k, v, None, True)
    want = torch.autograd.grad(want_out, (q, k, v), grad)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = attention(*low, is_causal=True)
    got = torch.autograd.grad(out, low, grad.bfloat16())
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got)
    torch.testing.assert_close(out.float(), want_out, rtol=3e-2, atol=3e-2)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), w, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("causal,padding", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("layout", ["contiguous", "heads"])
def test_rows_read_in_place_equal_the_float64_reference(causal, padding, layout):
    """float32 rows of exactly d = 32 or 64 with no padding rows (n, m multiples of 8 and 32)
    are read where they lie instead of copied: those shapes, against the reference."""
    gen = torch.Generator().manual_seed(5)
    for b, h, n, m, d in [(2, 3, 64, 64, 32), (2, 2, 40, 96, 64)]:
        check_float32(b, h, n, m, d, causal, padding, layout, gen)


def _has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "amx_bf16" in flags and "amx_tile" in flags


def test_bf16_takes_amx_tiles_exactly_where_the_processor_has_them():
    assert tiles_available() == _has_amx()


@settings(max_examples=40, deadline=None)
@given(**cases(2, 80, [1, 8, 24, 32, 40, 64, 96]))
def test_bf16_on_tiles_equals_the_float64_reference(b, h, n, m, d, causal, padding, layout, seed):
    """The bfloat16 path (on AMX tiles where there are any) against float64 arithmetic on the
    same bf16 inputs (of unit scale): off by what rounding p and ds to bf16 costs, which scales
    with the terms summed (so an output near 0 by cancellation is not closer), hence an
    absolute bound at the larger of 1 and the result's size. A wrong layout or block misses by
    O(1). Shapes cross the 32-row and 16-key blocks, with causal rows that see no key."""
    gen = torch.Generator().manual_seed(seed)
    q = heads(b, h, n, d, torch.bfloat16, gen, layout)
    k, v = (heads(b, h, m, d, torch.bfloat16, gen, layout) for _ in range(2))
    mask = torch.rand(b, 1, 1, m, generator=gen) > 0.3 if padding else None
    grad = torch.randn(b, h, n, d, generator=gen).bfloat16()
    with attention_tiles(True):
        out = attention(q, k, v, attn_mask=mask, is_causal=causal)
        got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out = reference(q64, k64, v64, mask, causal)
    want = torch.autograd.grad(want_out, (q64, k64, v64), grad.double())
    for a, w in zip((out, *got), (want_out, *want), strict=True):
        assert torch.isfinite(a).all()
        size = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(a.double(), w.double(), rtol=2e-2, atol=2e-2 * size)


def test_the_tiles_switch_chooses_the_path():
    """Off, bf16 runs in float32 arithmetic; on, on tiles where there are any, which round p
    to bf16, so the two differ there, and are the same code elsewhere."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 70, 32).bfloat16().requires_grad_() for _ in range(3))
    outs = {}
    for tiles in (True, False):
        with attention_tiles(tiles):
            out = attention(q, k, v, is_causal=True)
            outs[tiles] = (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    same = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True))
    assert same != tiles_available()
    for a, b in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


def test_a_query_with_nothing_to_attend_to_gets_zeros_not_nan():
    q, k, v = (torch.randn(2, 2, 5, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False  # the second sequence has no real key
    out = attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))


@pytest.mark.parametrize(
    ("family", "compiled"), [("decoder", False), ("seq2seq", False), ("seq2seq", True)]
)
def test_training_steps_equal_with_and_without_the_kernel(family, compiled):
    """The models' loss and every gradient, with the kernel and with torch's attention
    (eager, and with compiled layers where the kernel is a registered operator). Compiled
    once, for the translator: its layers call the kernel in every way the decoder-only model
    does (causal self-attention) and more (padding, cross-attention), and each compile costs
    CI 30-40 s on an empty Inductor cache."""
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset("tiny", norm="post" if family == "seq2seq" else "pre")
    model = ak.DecoderLM(cfg) if family == "decoder" else ak.Transformer(cfg)
    model = accel.prepare(model, "training").model
    ids = torch.randint(3, cfg.vocab_size, (3, 17))
    ids[0, -4:] = cfg.pad_id

    def step(kernel: bool):
        model.zero_grad()
        with attention_kernel(kernel), accel.compiled_layers(model, compiled and kernel):
            if family == "decoder":
                loss = model.loss(ids[:, :-1], ids[:, 1:])
            else:
                tgt_in = ak.shift_right(ids, cfg.bos_id)
                loss = model.loss(ids, tgt_in, ids, ids != cfg.pad_id, ignore_index=cfg.pad_id)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want, got = step(False), step(True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6)


def test_the_kernel_takes_what_it_can_and_leaves_the_rest_to_torch(monkeypatch):
    calls = []
    real = kernel_module._forward  # what the operator attnkit::attention runs
    monkeypatch.setattr(kernel_module, "_forward", lambda *a: calls.append(1) or real(*a))
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    attention(q, k, v, is_causal=True)
    assert len(calls) == 1
    attention(q, k, v, dropout_p=0.1)  # dropout: torch
    attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
    attention(q, k[:, :2], v[:, :2], enable_gqa=True)
    with torch.no_grad():  # inference: torch
        attention(q, k, v)
    with attention_kernel(False):
        attention(q, k, v)
    assert len(calls) == 1
    attention(q, k, v, attn_mask=torch.ones(2, 1, 1, 6, dtype=torch.bool))
    assert len(calls) == 2
    keys = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    keys = keys[:, None, None]
    attention(q, k, v, attn_mask=keys & ak.causal_mask(6))  # torch
    assert len(calls) == 2
    # a decoder's self-attention through the registry: the fused path hands the padding and the
    # causal flag over unmerged to the kernel the layer chose, and torch's SDPA gets them merged
    assert backends.ATTENTION[accel.FUSED_NAME].fused is attention
    out = backends.attend(q, k, v, mask=keys, is_causal=True, implementation=accel.FUSED_NAME)[0]
    assert len(calls) == 3
    want = backends.attend(q, k, v, mask=keys, is_causal=True)[0]
    assert len(calls) == 3
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_a_model_chooses_its_attention_by_name():
    """One registry (``backends.ATTENTION``): the model's config names the implementation,
    ``use_attention_kernel`` (which ``accel.prepare`` calls) sets it through
    ``set_attn_implementation``; "math", "sdpa" and "attnkit" give the same loss."""
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny"))
    layers = [m for m in model.modules() if isinstance(m, ak.MultiHeadAttention)]
    assert {m.attn_implementation for m in layers} == {"sdpa"} == {model.cfg.attn_implementation}
    ids = torch.randint(3, 100, (2, 9))
    want = model.loss(ids[:, :-1], ids[:, 1:])
    assert accel.use_attention_kernel(model) is model
    assert {m.attn_implementation for m in layers} == {accel.FUSED_NAME}
    assert model.cfg.attn_implementation == accel.FUSED_NAME
    torch.testing.assert_close(model.loss(ids[:, :-1], ids[:, 1:]), want, rtol=1e-5, atol=1e-6)
    model.set_attn_implementation("math")
    torch.testing.assert_close(model.loss(ids[:, :-1], ids[:, 1:]), want, rtol=1e-5, atol=1e-6)
    accel.use_attention_kernel(model, False)
    assert {m.attn_implementation for m in layers} == {"sdpa"}
    assert {"math", "sdpa", accel.FUSED_NAME} <= set(backends.ATTENTION)
    built = ak.DecoderLM(ak.ModelConfig.preset("tiny", attn_implementation=accel.FUSED_NAME))
    assert {m.attn_implementation for m in built.modules() if hasattr(m, "in_proj")} == {"attnkit"}
    assert "attn_implementation" not in built.cfg.to_dict()  # the run's choice, not saved
    with pytest.raises(ValueError, match="register_attention: name must be a new non-empty"):
        backends.register_attention("sdpa", attention)
    with pytest.raises(ValueError, match=r"attn_implementation must be one of .* got 'flash'"):
        model.set_attn_implementation("flash")


def test_a_causal_call_with_fewer_queries_aligns_bottom_right():
    """torch's is_causal aligns top-left; attnkit's (and the kernel's) bottom-right, the
    KV-cache case."""
    q, k, v = torch.randn(1, 2, 3, 8, requires_grad=True), *torch.randn(2, 1, 2, 5, 8)
    bottom_right = attention(q, k, v, is_causal=True)
    torch.testing.assert_close(bottom_right, reference(q, k, v, None, True), rtol=1e-5, atol=1e-5)
    keys = torch.tensor([True, False, True, True, True])[None, None, None]
    with torch.no_grad():  # the kernel does not take it: torch, with the two masks merged
        merged = attention(q, k, v, attn_mask=keys, is_causal=True)
    torch.testing.assert_close(merged, reference(q, k, v, keys, True), rtol=1e-5, atol=1e-5)
    for n in (3, 1):  # no gradient, no mask (a cached decoding step): torch, bottom-right too
        with torch.no_grad():
            fallback = attention(q[:, :, :n], k, v, is_causal=True)
        want = reference(q[:, :, :n], k, v, None, True)
        torch.testing.assert_close(fallback, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", RUNNABLE)
def test_every_variant_this_cpu_runs_agrees_with_torch(variant):
    """Every variant built at install that this CPU can run (plain C on any), checked against
    the float64 reference in float32: padded heads and packed sequences."""
    with native.using(variant):
        check_against_the_reference()


def check_against_the_reference():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 37, 40, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, is_causal=True)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want_out = reference(q, k, v, None, True)
    want = torch.autograd.grad(want_out.sum(), (q, k, v))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)
    # packed sequences (the unpadded stacks' path): rows of two sequences, 37 and 20 long
    real = torch.arange(37) < torch.tensor([[37], [20]])
    rows = torch.stack([t.detach().transpose(1, 2)[real] for t in (q, k, v)], 1)  # (T, 3, H, d)
    rows.requires_grad_()
    packed = packed_self_attention(rows, Sequences.of(real), causal=True)
    (packed_grad,) = torch.autograd.grad(packed.sum(), rows)
    torch.testing.assert_close(packed[:37], want_out[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    short = reference(*(t[1:, :, :20] for t in (q, k, v)), None, True)[0]
    torch.testing.assert_close(packed[37:], short.transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        packed_grad[:37, 0], want[0][0].transpose(0, 1), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["decoder", "seq2seq", "encoder"])
def test_a_layer_that_chose_the_kernel_runs_it_in_every_call_of_a_step(family, dtype, monkeypatch):
    """Every attention call of a training step goes to the kernel once the layers chose it:
    a decoder's causal self-attention without padding (torch's own causal SDPA otherwise),
    cross-attention, an encoder's; in float32 and under bf16 autocast."""
    calls = []
    real = kernel_module._forward  # what the operator attnkit::attention runs
    monkeypatch.setattr(kernel_module, "_forward", lambda *a: calls.append(1) or real(*a))
    cfg = ak.ModelConfig.preset("tiny")
    torch.manual_seed(0)
    model = {"decoder": ak.DecoderLM, "seq2seq": ak.Transformer}.get(family)
    model = model(cfg) if model else ak.EncoderClassifier(cfg, num_classes=2)
    accel.use_attention_kernel(model.train())
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if family == "decoder":
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        elif family == "seq2seq":
            loss = model.loss(ids, ak.shift_right(ids, cfg.bos_id), ids)
        else:
            loss = model(ids).logsumexp(-1).sum()
    layers = sum(isinstance(m, ak.MultiHeadAttention) for m in model.modules())
    assert len(calls) == layers > 0
    loss.float().backward()


def test_the_kernel_is_registered_as_torch_operators():
    """``torch.library.opcheck`` on each operator: its schema, its fake tensor (what
    torch.compile traces), its registered autograd, and the compiled (AOT) dispatch."""
    from attnkit.varlen import Sequences

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen, requires_grad=True) for _ in range(3))
    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.uint8)
    torch.library.opcheck(torch.ops.attnkit.attention, (q, k, v, valid, True, 0.35))
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    sequences = Sequences.of(real)
    rows = int(real.sum())
    qkv = torch.randn(rows, 3, 3, 8, generator=gen, requires_grad=True)
    torch.library.opcheck(torch.ops.attnkit.packed_self_attention, (qkv, *sequences, True, 0.35))
    kv = torch.randn(rows, 2, 3, 8, generator=gen, requires_grad=True)
    q_rows = torch.randn(rows, 3, 8, generator=gen, requires_grad=True)
    torch.library.opcheck(
        torch.ops.attnkit.packed_attention, (q_rows, kv, *sequences, *sequences, False, 0.35)
    )
