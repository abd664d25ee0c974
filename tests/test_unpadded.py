"""The unpadded stacks (``accel/unpadded.py``), ``MultiHeadAttention(rows=...)`` and packed
attention (``attention.c``'s packed sequences): packed attention against torch's math over the
padded batch in float64 (a property over lengths, holes, heads and widths), attention over
packed rows against the padded call, and every family's loss and gradients with the stacks
unpadded against the same model padded, on the packed kernel and on the scatter path."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit import accel
from attnkit.accel.attention import (
    attention_kernel,
    packed_attention,
    packed_self_attention,
    takes_packed,
)
from attnkit.accel.unpadded import UnpaddedDecoder, UnpaddedEncoder
from attnkit.attention import MultiHeadAttention
from attnkit.varlen import Sequences


def padded_reference(q, k, v, real_q, real_k, causal):
    """torch's math in float64 over padded (B, H, N, d) heads: keys masked by real_k (B, M),
    causal by position; a query with no key gets 0."""
    q, k, v = (t.double() for t in (q, k, v))
    n, m = q.shape[2], k.shape[2]
    allowed = real_k[:, None, None, :].expand(-1, 1, n, m)
    if causal:
        allowed = allowed & torch.ones(n, m, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.nan_to_num(weights) @ v


def pack(t, real):
    """(B, H, N, d) -> the real rows (T, H, d), in order."""
    return t.transpose(1, 2)[real]


def real_mask(b, n, gen, holes):
    """(B, N) real tokens: right padding to a random length (0 .. n), or random holes."""
    if holes:
        return torch.rand(b, n, generator=gen) > 0.4
    lengths = torch.randint(0, n + 1, (b, 1), generator=gen)
    return torch.arange(n) < lengths


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 4),
    h=st.integers(1, 3),
    n=st.integers(1, 40),
    m=st.integers(1, 40),
    d=st.sampled_from([1, 8, 16, 32, 40, 64]),
    self_attention=st.booleans(),
    causal=st.booleans(),
    holes=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_equals_padded_attention(
    b, h, n, m, d, self_attention, causal, holes, seed
):
    """Packed rows against the padded batch's attention at the real queries, output and the
    gradients of q, k and v. Self-attention (queries are the keys, causal or not); cross
    attention (its own key sequences, not causal). Sequences may be empty; with holes, a
    causal query sees the real keys up to its position, as in the padded batch."""
    gen = torch.Generator().manual_seed(seed)
    m = n if self_attention else m
    causal = causal and self_attention
    real_q = real_mask(b, n, gen, holes)
    real_k = real_q if self_attention else real_mask(b, m, gen, holes)
    q, k, v = (torch.randn(b, h, size, d, generator=gen) for size in (n, m, m))
    grad = torch.randn(b, h, n, d, generator=gen)
    grad = grad * real_q[:, None, :, None]  # padded queries' outputs are not used
    queries, keys = Sequences.of(real_q), Sequences.of(real_k)

    packed = [pack(t, r).requires_grad_() for t, r in ((q, real_q), (k, real_k), (v, real_k))]
    assert takes_packed(packed[0], max(queries.longest, keys.longest))
    if self_attention:
        qkv = torch.stack(packed, 1).detach().requires_grad_()  # (T, 3, H, d)
        out = packed_self_attention(qkv, queries, causal=causal)
        (dqkv,) = torch.autograd.grad(out, qkv, pack(grad, real_q))
        got = dqkv.unbind(1)
    else:
        kv = torch.stack(packed[1:], 1).detach().requires_grad_()  # (T_k, 2, H, d)
        out = packed_attention(packed[0], kv, queries, keys, causal=False)
        got = (*torch.autograd.grad(out, (packed[0], kv), pack(grad, real_q)),)
        got = (got[0], *got[1].unbind(1))

    heads = [t.double().requires_grad_() for t in (q, k, v)]
    want_out = padded_reference(*heads, real_q, real_k, causal)
    want = torch.autograd.grad(want_out, heads, grad.double())
    torch.testing.assert_close(out.double(), pack(want_out, real_q), rtol=1e-5, atol=1e-5)
    for a, w, r in zip(got, want, (real_q, real_k, real_k), strict=True):
        torch.testing.assert_close(a.double(), pack(w, r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "attnkit"])
@pytest.mark.parametrize("kind", ["self", "causal", "cross", "rope"])
def test_attention_over_packed_rows_equals_the_padded_call(kind, implementation):
    """``MultiHeadAttention(x_rows, rows=...)`` at every real row against the padded call,
    through torch's SDPA (the scatter path) and attnkit's kernel (its packed form where it
    applies: not with RoPE)."""
    from attnkit.position import RotaryEmbedding
    from attnkit.varlen import Rows

    torch.manual_seed(0)
    rope = RotaryEmbedding(8) if kind == "rope" else None
    attention = MultiHeadAttention(32, 4, rope=rope).eval()
    accel.use_attention_kernel(attention, implementation == "attnkit")
    real = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [1] * 6 + [0]], dtype=torch.bool)
    source = torch.tensor([[1] * 4 + [0], [1] * 5, [1] + [0] * 4], dtype=torch.bool)
    x, context = torch.randn(3, 7, 32), torch.randn(3, 5, 32)
    cross = kind == "cross"
    keys = source if cross else real
    mask = keys[:, None, None, :]
    rows, key_rows = Rows.of(real[:, None, None], x), Rows.of(source[:, None, None], context)
    options = dict(mask=mask, is_causal=kind == "causal")
    want = attention(x, context if cross else None, **options)
    got = attention(
        rows.gather(x),
        key_rows.gather(context) if cross else None,
        rows=rows,
        context_rows=key_rows if cross else None,
        **options,
    )
    assert got.shape == (1, int(real.sum()), 32)
    torch.testing.assert_close(got[0], want[real], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rows= takes x as"):
        attention(x, rows=rows, **options)  # padded x with rows=


def batch(cfg, b=3, n=13, left=False):
    """ids (B, N) with padding of three kinds: none, a short row, a row of padding only in the
    middle of the batch's lengths (right padding; left padding for decoder-only prompts)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (b, n), generator=gen)
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, -5:] = False
    real[2, -1:] = False
    if left:
        real = real.flip(1)
    return ids.masked_fill(~real, cfg.pad_id), real


def loss_of(model, family, cfg):
    ids, real = batch(cfg, left=family == "decoder")
    if family == "seq2seq":
        src, src_real = batch(cfg, n=11)
        tgt_in = ak.shift_right(ids, cfg.bos_id)
        tgt_real = torch.cat([torch.ones_like(real[:, :1]), real[:, :-1]], 1)
        return model.loss(src, tgt_in, ids, src_real, tgt_real, ignore_index=cfg.pad_id)
    if family == "decoder":
        targets = ids[:, 1:].masked_fill(~(real[:, 1:] & real[:, :-1]), -100)  # real inputs
        return model.loss(ids[:, :-1], targets, attention_mask=real[:, :-1])
    return torch.nn.functional.cross_entropy(
        model(ids, attention_mask=real), torch.tensor([0, 1, 0])
    )


def build(family, cfg):
    torch.manual_seed(0)
    if family == "seq2seq":
        return ak.Transformer(cfg)
    if family == "decoder":
        return ak.DecoderLM(cfg)
    return ak.EncoderClassifier(cfg, num_classes=2)


def grads_of(model, family, cfg, kernel=True):
    model.zero_grad()
    accel.use_attention_kernel(model)  # as accel.prepare does for training
    with attention_kernel(kernel):
        loss = loss_of(model, family, cfg)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


VARIANTS = {
    "post-LN": dict(norm="post"),
    "pre-LN": dict(norm="pre"),
    "rope": dict(position="rope"),
    "alibi": dict(position="alibi"),
    "grouped": dict(n_kv_heads=1),
    "window": dict(attention="window", window=4),
    "linear": dict(attention="linear"),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["seq2seq", "decoder", "encoder"])
def test_unpadded_stacks_give_the_padded_loss_and_gradients(family, variant):
    """Every family and attention variant, the kernel on (packed attention where it applies,
    else the scatter path) and off (torch's attention over the scattered heads)."""
    cfg = ak.ModelConfig.preset("tiny", dropout=0.0, **VARIANTS[variant])
    padded = build(family, cfg).train()
    unpadded = accel.unpad_stacks(copy.deepcopy(padded))
    assert any(isinstance(m, UnpaddedEncoder | UnpaddedDecoder) for m in unpadded.modules())
    for kernel in (True, False):
        want, got = grads_of(padded, family, cfg, kernel), grads_of(unpadded, family, cfg, kernel)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        for name, w in want[1].items():
            torch.testing.assert_close(got[1][name], w, rtol=1e-4, atol=1e-6, msg=name)


def test_padded_positions_come_out_zero_and_the_switch_restores_them():
    """What the unpadded encoder gives at a padded position is zero; the real positions are
    the padded model's; ``unpadding(False)`` runs the padded forward again."""
    cfg = ak.ModelConfig.preset("tiny")
    padded = build("encoder", cfg).eval()
    unpadded = accel.unpad_stacks(copy.deepcopy(padded))
    ids, real = batch(cfg)
    with torch.no_grad():
        want = padded.encoder(ids, attention_mask=real)
        got = unpadded.encoder(ids, attention_mask=real)
        with accel.unpadding(False):
            off = unpadded.encoder(ids, attention_mask=real)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))
    assert torch.equal(off, want)


def test_generation_is_unchanged():
    """Greedy translation of padded sources (the encoder runs unpadded; the decoding steps,
    with a cache, padded) and a decoder-only model's left-padded prompts."""
    cfg = ak.ModelConfig.preset("tiny")
    for family in ("seq2seq", "decoder"):
        padded = build(family, cfg).eval()
        unpadded = accel.unpad_stacks(copy.deepcopy(padded))
        ids, real = batch(cfg, left=family == "decoder")
        options = dict(src_mask=real) if family == "seq2seq" else dict(attention_mask=real)
        want = padded.generate(ids, 6, **options)
        assert torch.equal(unpadded.generate(ids, 6, **options), want)


def test_what_keeps_the_padded_forward():
    """A mixture of experts is left as it is; attention weights come from the padded
    forward."""
    moe = accel.unpad_stacks(ak.DecoderLM(ak.ModelConfig.preset("tiny", n_experts=2)))
    assert not any(isinstance(m, UnpaddedEncoder | UnpaddedDecoder) for m in moe.modules())
    cfg = ak.ModelConfig.preset("tiny")
    padded = build("seq2seq", cfg).eval()
    unpadded = accel.unpad_stacks(copy.deepcopy(padded))
    assert isinstance(unpadded.encoder, UnpaddedEncoder)
    src, src_real = batch(cfg)
    tgt, tgt_real = batch(cfg, n=9)
    with torch.no_grad():
        _, want = padded(src, tgt, src_real, tgt_real, return_attention=True)
        _, got = unpadded(src, tgt, src_real, tgt_real, return_attention=True)
    for key in ("encoder", "decoder", "cross"):
        for a, w in zip(got[key], want[key], strict=True):
            assert torch.equal(a, w)


def bf16_step(model, cfg, tiles: bool):
    """Two seq2seq batches under bf16 autocast, one padded and one without padding: (their two
    losses, {name: the gradient of their sum})."""
    model.zero_grad()
    accel.use_attention_kernel(model)
    ids = torch.randint(3, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with accel.attention_tiles(tiles):
            losses = torch.stack([
                loss_of(model, "seq2seq", cfg).float(),
                model.loss(ids, ak.shift_right(ids, cfg.bos_id), ids).float(),
            ])  # fmt: skip
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def worst_gradient(got: dict, want: dict) -> float:
    """The largest relative error of one gradient tensor, ||got - want|| / ||want||."""
    return max(
        float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0
    )


@pytest.mark.parametrize("tiles", [True, False])
def test_bfloat16_autocast_steps_match(tiles, monkeypatch):
    """bfloat16 autocast: packed attention in float32 arithmetic, or the padded heads on AMX
    tiles where the processor has them (the layers' input is float32 under autocast, the
    rows attention gets are bf16: the choice follows the rows). Against the padded model: the
    loss to 1e-3 and every gradient tensor to 2% of its norm (measured: 0.5% at most, none
    with the tiles). A model drawn from another seed misses both by far (its loss 0.7% away,
    a gradient 158% away): the tolerances can fail."""
    cfg = ak.ModelConfig.preset("tiny", norm="post")
    padded = build("seq2seq", cfg).train()
    unpadded = accel.unpad_stacks(copy.deepcopy(padded))
    torch.manual_seed(1)
    other = accel.unpad_stacks(ak.Transformer(cfg).train())
    packed_calls = []
    original = MultiHeadAttention._packed
    monkeypatch.setattr(
        MultiHeadAttention, "_packed", lambda *a: packed_calls.append(1) or original(*a)
    )
    want_loss, want = bf16_step(padded, cfg, tiles)
    assert not packed_calls  # the padded model never packs
    loss, got = bf16_step(unpadded, cfg, tiles)
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    assert worst_gradient(got, want) <= 2e-2
    assert bool(packed_calls) == (not (tiles and accel.tiles_available()))
    other_loss, other_grads = bf16_step(other, cfg, tiles)
    assert float((other_loss / want_loss - 1).abs().max()) > 1e-3
    assert worst_gradient(other_grads, want) > 0.5


@pytest.mark.needs("g++")  # torch.compile on a CPU
def test_compiled_layers_attend_over_the_real_rows_and_compile_once(monkeypatch):
    """Inside ``compiled_layers`` the stacks still skip the padding: the layers take the real
    rows, attention over them runs eagerly between the compiled parts (on the packed kernel),
    loss and gradients are the eager step's, and a batch of other lengths (another number of
    real rows) runs the same compiled code: nothing compiles again."""
    cfg = ak.ModelConfig.preset("tiny")
    model = accel.prepare(build("encoder", cfg), "training").model
    calls = []
    real_forward = MultiHeadAttention._packed
    monkeypatch.setattr(
        MultiHeadAttention, "_packed", lambda *a: calls.append(1) or real_forward(*a)
    )
    want_loss, want = grads_of(model, "encoder", cfg)
    calls.clear()

    def compiled_step(ids, real):
        model.zero_grad()
        with accel.compiled_layers(model):
            loss = torch.nn.functional.cross_entropy(
                model(ids, attention_mask=real), torch.tensor([0, 1, 0])
            )
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ids, real = batch(cfg)
    loss, got = compiled_step(ids, real)
    assert len(calls) == cfg.n_layers  # packed attention in every layer
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    graphs = dict(counters["stats"])
    other = real.clone()
    other[0, -4:] = False  # four real rows fewer
    compiled_step(ids.masked_fill(~other, cfg.pad_id), other)
    assert dict(counters["stats"]) == graphs  # no new graph for the new row count


class _CountCats(TorchDispatchMode):
    """Counts the aten ``cat`` calls inside the block (autograd's backward ones too)."""

    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func.overloadpacket is torch.ops.aten.cat
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("family", ["seq2seq", "decoder", "encoder"])
def test_a_batch_without_padding_attends_as_packed_rows(family, norm, monkeypatch):
    """No padding (no mask): attention runs as B packed sequences of N rows (M for the
    source), with the plain model's loss and gradients, and its gradient comes back as one
    (B N, 3, H, d) tensor (cross-attention's k and v as one): the backward joins no dq, dk and
    dv (the plain model's split does, in every layer)."""
    cfg = ak.ModelConfig.preset("tiny", dropout=0.0, norm=norm)
    plain = build(family, cfg).train()
    packed = accel.unpad_stacks(copy.deepcopy(plain))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, cfg.vocab_size, (3, 12), generator=gen)
    packed_calls = []
    original = MultiHeadAttention._packed

    def spy(self, packed, x, context, rows, keys, causal):
        packed_calls.append(("cross" if context is not None else "self", causal))
        return original(self, packed, x, context, rows, keys, causal)

    monkeypatch.setattr(MultiHeadAttention, "_packed", spy)
    results, cats = [], []
    for model in (plain, packed):
        accel.use_attention_kernel(model)
        if family == "seq2seq":
            loss = model.loss(ids, ak.shift_right(ids, cfg.bos_id), ids)
        elif family == "decoder":
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        else:
            loss = model(ids).logsumexp(-1).sum()
        with _CountCats() as counter:
            loss.backward()
        cats.append(counter.cats)
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, w in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], w, rtol=1e-4, atol=1e-6, msg=name)
    n = cfg.n_layers
    assert (
        packed_calls
        == {  # each layer's attention, in the order they run
            "encoder": [("self", False)] * n,
            "decoder": [("self", True)] * n,
            "seq2seq": [("self", False)] * n + [("self", True), ("cross", False)] * n,
        }[family]
    )
    layers = n * (3 if family == "seq2seq" else 1)  # the splits of q, k, v (and of k, v)
    assert cats[0] >= layers and cats[1] == 0, cats
