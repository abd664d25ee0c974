"""The fast paths of issue 10 against the plain ones: oneDNN linear layers (forward and both
gradients) against F.linear, the chunked LM-head loss against logits + F.cross_entropy (label
smoothing, ignore_index, autocast, no grad), the models' ``loss`` methods, and generation with
transposed decoding weights against the uncached reference."""

import copy

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit import accel
from attnkit.accel import (
    decoding_layouts,
    fuse_lm_loss,
    linear,
    linear_cross_entropy,
    onednn_linear,
    onednn_linear_available,
    use_onednn_products,
)
from attnkit.accel.onednn import OneDNNLinear


def took_onednn(t: torch.Tensor) -> bool:
    """Whether t came out of the operator attnkit::onednn_mm (through the views around it)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__.startswith(("ViewBackward", "UnsafeView")):
        fn = fn.next_functions[0][0]
    return fn is not None and "onednn_mm" in type(fn).__name__


needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN in torch")


@needs_onednn
@pytest.mark.parametrize("shape", [(8, 16), (3, 5, 16), (2, 9, 4, 16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [12, 40])  # narrower and wider than the input
def test_onednn_linear_matches_f_linear_and_its_gradients(shape, bias, out_features):
    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(out_features, 16, requires_grad=True)
    b = torch.randn(out_features, requires_grad=True) if bias else None
    grad = torch.randn(*shape[:-1], out_features)
    expected = F.linear(x, w, b)
    expected.backward(grad)
    want = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    with onednn_linear(True):
        got = linear(x, w, b)
    assert got.grad_fn is not None and took_onednn(got)
    got.backward(grad)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for t, g in zip([t for t in (x, w, b) if t is not None], want, strict=True):
        torch.testing.assert_close(t.grad, g, rtol=1e-5, atol=1e-5)


def test_linear_falls_back_to_f_linear_where_onednn_does_not_apply():
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(10, 4, dtype=torch.float64)
    assert not took_onednn(linear(x, w))  # float64
    x32, w32 = torch.randn(1, 4), torch.randn(6, 4, requires_grad=True)
    assert not took_onednn(linear(x32, w32))  # a single row
    with onednn_linear(False):
        assert not took_onednn(linear(torch.randn(10, 4), w32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(torch.randn(10, 4), w32).dtype == torch.bfloat16  # autocast's own path


@needs_onednn
def test_linear_keeps_strided_weight_slices_away_from_onednn():
    """Rows of a transposed in_proj (the cross-attention's q and kv laid out for decoding) are
    neither (out, in) nor (in, out) dense; oneDNN ran them 100-1000x slower, so F.linear does."""
    x = torch.randn(32, 16)
    transposed = torch.randn(48, 16).t().contiguous().t()  # (48, 16), strides (1, 48)
    for w in (transposed, transposed[16:], transposed[:16]):
        expected = F.linear(x, w.contiguous())
        with onednn_linear(True):
            got = linear(x, w.detach().requires_grad_())
        uses_onednn = took_onednn(got)
        assert uses_onednn == (w.is_contiguous() or w.t().is_contiguous())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_use_onednn_products_swaps_linears_and_routes_cross_attention_slices():
    """A module swap, not a mode: the model's nn.Linear layers become OneDNNLinear over the same
    parameters, and cross-attention's Q and [K, V] slices of in_proj take the same product."""
    cfg = ak.ModelConfig.preset("tiny")
    torch.manual_seed(0)
    plain = ak.Transformer(cfg)
    swapped = use_onednn_products(copy.deepcopy(plain))
    linears = [m for m in swapped.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is not torch.nn.Linear for m in linears)
    assert any(isinstance(m, OneDNNLinear) for m in linears)
    assert swapped.state_dict().keys() == plain.state_dict().keys()
    layer = swapped.decoder.layers[0].cross_attn.in_proj
    assert isinstance(layer, OneDNNLinear) and layer.weight is not None
    x = torch.randn(2, 10, cfg.d_model)
    with onednn_linear(True):  # whatever ATTNKIT_ONEDNN_LINEAR says
        q = layer.rows(x, slice(None, cfg.d_model))  # cross-attention's W^Q
        out = layer(x)
    assert took_onednn(q) and took_onednn(out)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    src = torch.randint(3, cfg.vocab_size, (2, 9))
    tgt = torch.randint(3, cfg.vocab_size, (2, 7))
    with onednn_linear(True):
        got = swapped(src, tgt)
    torch.testing.assert_close(got, plain(src, tgt), rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize(("vendor", "on"), [("AuthenticAMD", True), ("GenuineIntel", False)])
def test_the_default_takes_onednn_by_the_rule(vendor, on, monkeypatch):
    """Neither forced on nor off, a rule on the CPU chooses (never a stopwatch: the two GEMMs
    round differently): oneDNN on AMD processors, MKL elsewhere; onednn_linear(...) still
    forces either inside a block."""
    import attnkit.accel.onednn as onednn

    monkeypatch.setattr(onednn._switch, "on", None)
    monkeypatch.setattr(onednn, "_RULE", vendor in onednn.ONEDNN_VENDORS)
    monkeypatch.setattr(onednn.native, "cpu", lambda: {"vendor": vendor})
    x, w = torch.randn(10, 16), torch.randn(12, 16, requires_grad=True)
    assert took_onednn(linear(x, w)) == on
    layer = use_onednn_products(torch.nn.Sequential(torch.nn.Linear(16, 12)))[0]
    assert took_onednn(layer(x)) == on
    choice = onednn.onednn_choice()
    assert choice["on"] == on and choice["by"].endswith(f"this is {vendor}")
    name = "oneDNN" if on else "MKL"
    assert onednn.describe_choice() == f"float32 products: {name} ({choice['by']})"
    with onednn_linear(not on):
        assert took_onednn(linear(x, w)) == (not on)
        assert onednn.onednn_choice()["by"] == f"ATTNKIT_ONEDNN_LINEAR={int(not on)}"
    assert onednn._switch.on is None  # the block restores the rule's default


def test_the_rule_is_this_cpus_vendor_read_at_import():
    import attnkit.accel.onednn as onednn
    from attnkit.accel import native

    assert onednn._RULE == (native.cpu()["vendor"] in ("AuthenticAMD",))


@pytest.mark.parametrize(("value", "on"), [("0", False), ("1", True), ("auto", None), (None, None)])
def test_the_environment_forces_onednn_off_or_on_or_leaves_it_to_the_rule(monkeypatch, value, on):
    # Read when the levers are reported (accel.levers, accel.prepare), not at import.
    import attnkit.accel.onednn as onednn

    monkeypatch.delenv("ATTNKIT_ONEDNN_LINEAR", raising=False)
    if value is not None:
        monkeypatch.setenv("ATTNKIT_ONEDNN_LINEAR", value)
    accel.levers("training")
    assert onednn._switch.on is on
    monkeypatch.delenv("ATTNKIT_ONEDNN_LINEAR", raising=False)
    accel.levers("training")


@needs_onednn
def test_onednn_gradients_of_a_broadcast_upstream_gradient():
    """The gradient of a sum arrives with strides 0; it is made dense before oneDNN reads it
    (oneDNN's reference kernel took seconds on it)."""
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    F.linear(x, w).sum().backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    with onednn_linear(True):
        linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [False, True])
@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("chunk", [None, 37])
def test_linear_cross_entropy_equals_logits_and_cross_entropy(
    smoothing, ignore, onednn, chunk, monkeypatch
):
    import attnkit.accel.lm_loss as lm_loss

    if chunk:  # uneven chunks, whose dL/dW parts are summed (each product library its own way)
        monkeypatch.setattr(lm_loss, "_chunk_rows", lambda vocab: chunk)
    torch.manual_seed(0)
    hidden = torch.randn(3, 70, 16, requires_grad=True)
    weight = (torch.randn(300, 16) * 0.3).requires_grad_()
    targets = torch.randint(0, 300, (3, 70))
    if ignore:
        targets[:, -20:] = -100
    expected = F.cross_entropy(
        (hidden @ weight.t()).flatten(0, 1), targets.flatten(), label_smoothing=smoothing
    )
    expected.backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with onednn_linear(onednn):
        got = linear_cross_entropy(hidden, weight, targets, smoothing=smoothing)
    (2 * got).backward(retain_graph=True)  # the upstream gradient scales both gradients
    got.backward()  # and a second backward through the same graph adds 1x more
    want = [3 * g for g in want]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, want[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad, want[1], rtol=1e-4, atol=1e-6)


def test_linear_cross_entropy_chunks_bf16_no_grad_and_edge_cases(monkeypatch):
    import attnkit.accel.lm_loss as lm_loss

    monkeypatch.setattr(lm_loss, "_chunk_rows", lambda vocab: 7)  # many uneven chunks
    torch.manual_seed(1)
    hidden, weight = torch.randn(50, 8), torch.randn(40, 8)
    targets = torch.randint(0, 40, (50,))
    expected = F.cross_entropy(hidden @ weight.t(), targets)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, weight, targets)
        reference = F.cross_entropy((hidden @ weight.t()).float(), targets)
    torch.testing.assert_close(got, reference, rtol=2e-2, atol=2e-2)
    # huge logits: the log-sum-exp must not overflow, nor a tiny probability underflow to inf
    big = linear_cross_entropy(hidden * 1e3, weight, targets)
    assert torch.isfinite(big)
    torch.testing.assert_close(big, F.cross_entropy((hidden * 1e3) @ weight.t(), targets))
    everything_ignored = torch.full((50,), -100)
    hidden.requires_grad_()
    zero = linear_cross_entropy(hidden, weight, everything_ignored)
    zero.backward()
    assert float(zero.detach()) == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))
    with pytest.raises(ValueError, match="target id 40"):
        linear_cross_entropy(hidden, weight, torch.full((50,), 40))
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(hidden, weight, targets[:10])


def test_linear_cross_entropy_skips_the_products_of_ignored_rows(monkeypatch):
    import attnkit.accel.lm_loss as lm_loss

    rows = []  # rows of every logits product (hidden chunk @ weight^T)

    def mm_t(a, b, out=None):
        if b.shape == (50, 8):  # the weight itself: a logits product
            rows.append(a.shape[0])
        return a @ b.t()

    monkeypatch.setattr(lm_loss, "mm_t", mm_t)
    torch.manual_seed(2)
    hidden = torch.randn(4, 30, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(1, 50, (4, 30))
    targets[:, 21:] = 0  # padding, as a batch of sentences has
    loss = linear_cross_entropy(hidden, weight, targets, ignore_index=0)
    loss.backward()
    assert sum(rows) == 4 * 21
    assert torch.equal(hidden.grad[:, 21:], torch.zeros(4, 9, 8))
    want = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), ignore_index=0)
    torch.testing.assert_close(loss, want)


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_keeps_one_tensor_for_every_chunks_logits(monkeypatch, autocast):
    """Where torch's product forms the logits (not oneDNN: float32 with the oneDNN path off, or
    bf16), every chunk of every call writes into the same memory instead of fresh pages, also
    when the first call runs in inference mode and the next ones do not."""
    import threading

    import attnkit.accel.lm_loss as lm_loss

    monkeypatch.setattr(lm_loss, "_chunk_rows", lambda vocab: 16)
    monkeypatch.setattr(lm_loss, "_kept", threading.local())  # nothing kept yet
    outs = []  # where each logits product wrote
    real_mm_t = lm_loss.mm_t

    def mm_t(a, b, out=None):
        result = real_mm_t(a, b, out=out)
        if b.shape == (50, 8):
            outs.append(result.data_ptr())
        return result

    monkeypatch.setattr(lm_loss, "mm_t", mm_t)
    torch.manual_seed(3)
    hidden = torch.randn(60, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (60,))
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {}
    with onednn_linear(False), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = F.cross_entropy((hidden @ weight.t()).float(), targets)
        with torch.inference_mode():
            torch.testing.assert_close(
                linear_cross_entropy(hidden, weight, targets), want.detach(), **tolerance
            )
        loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    torch.testing.assert_close(loss, want, **tolerance)
    assert len(outs) == 8 and len(set(outs)) == 1  # two calls of four chunks, one tensor


@pytest.mark.parametrize("fused", [False, True])
def test_decoder_lm_loss_equals_cross_entropy_of_its_logits(fused):
    cfg = ak.ModelConfig.preset("tiny", vocab_size=97)
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg)
    if fused:  # the same loss as one chunked pass (attnkit.accel)
        fuse_lm_loss(model)
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    targets = torch.roll(ids, -1, dims=1).masked_fill(~mask, -100)
    expected = F.cross_entropy(model(ids, mask).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model.loss(ids, targets, mask), expected)
    with pytest.raises(ValueError, match="targets must have the shape"):
        model.loss(ids, targets[:, :5])


@pytest.mark.parametrize("fused", [False, True])
def test_transformer_loss_equals_cross_entropy_of_its_logits(fused):
    cfg = ak.ModelConfig.preset("tiny", vocab_size=61, norm="post", position="sinusoidal")
    torch.manual_seed(0)
    model = ak.Transformer(cfg)
    if fused:  # the same loss as one chunked pass (attnkit.accel)
        fuse_lm_loss(model)
    src, tgt = torch.randint(3, 61, (3, 9)), torch.randint(3, 61, (3, 7))
    src[0, -2:] = 0
    tgt[1, -3:] = 0
    tgt_in = ak.shift_right(tgt, cfg.bos_id)
    logits = model(src, tgt_in, src != 0)
    expected = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
    got = model.loss(src, tgt_in, tgt, src != 0, ignore_index=0, smoothing=0.0)
    torch.testing.assert_close(got, expected)
    smoothed = F.cross_entropy(
        logits.flatten(0, 1), tgt.flatten(), ignore_index=0, label_smoothing=0.1
    )
    torch.testing.assert_close(
        model.loss(src, tgt_in, tgt, src != 0, ignore_index=0, smoothing=0.1), smoothed
    )


def test_the_decoding_layout_changes_the_layout_not_the_values():
    # prepare(model, "decoding") gives every linear layer a new weight laid out as (in, out)
    # rows: the same values, a tied weight still tied, saved in the usual layout; greedy
    # decoding with and without the cache agrees.
    cfg = ak.ModelConfig.preset("tiny", eos_id=None)
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 1, cfg.d_model)
    head = model.lm_head
    expected = head(x)
    assert "decoding-layout on" in accel.prepare(model, "decoding").line()
    assert head.weight.shape == (cfg.vocab_size, cfg.d_model)
    assert head.weight.stride() == (1, cfg.vocab_size)  # (in, out) rows in memory
    assert head.weight is model.embeddings.tokens.weight  # still tied
    torch.testing.assert_close(head(x), expected, rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    prompt = torch.randint(3, cfg.vocab_size, (2, 5))
    cached = model.generate(prompt, 12)
    assert torch.equal(cached, model.generate(prompt, 12, use_cache=False))


def test_the_decoding_layout_can_be_switched_off():
    cfg = ak.ModelConfig.preset("tiny", eos_id=None)
    torch.manual_seed(0)
    model = ak.DecoderLM(cfg).eval()
    with decoding_layouts(False):
        assert "decoding-layout off" in accel.prepare(model, "decoding").line()
    assert all(p.is_contiguous() for p in model.parameters())  # the weights as they were


@needs_onednn
@pytest.mark.parametrize(("value", "name"), [("0", "MKL"), ("1", "oneDNN")])
def test_the_choice_is_described_in_one_line(monkeypatch, value, name):
    """`attnkit train` prints this line for a float32 run on the CPU."""
    import attnkit.accel.onednn as onednn

    monkeypatch.setattr(onednn._switch, "on", value == "1")
    want = f"float32 products: {name} (ATTNKIT_ONEDNN_LINEAR={value})"
    assert onednn.describe_choice() == want


def test_prepare_for_decoding_lays_weights_out_once_and_saving_still_works(tmp_path):
    """``prepare(model, "decoding")`` stores every linear weight as (in, out) rows, in place and
    once: generate then changes no layout, gives the unprepared model's tokens, and the saved
    weights are the usual (out, in) tensors that load back equal."""
    from attnkit import accel

    cfg = ak.ModelConfig.preset("tiny")
    torch.manual_seed(0)
    plain = ak.DecoderLM(cfg).eval()
    model = copy.deepcopy(plain)
    report = accel.prepare(model, "decoding")
    assert "decoding-layout on" in report.line()
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert weights and all(not w.is_contiguous() and w.t().is_contiguous() for w in weights)
    ids = torch.randint(3, cfg.vocab_size, (2, 5))
    assert torch.equal(model.generate(ids, 6), plain.generate(ids, 6))
    assert all(w.t().is_contiguous() for w in weights)  # generate left the layout alone
    model.save_pretrained(tmp_path / "m")
    loaded = ak.from_pretrained(tmp_path / "m")
    for name, value in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


@needs_onednn
def test_the_onednn_operator_passes_opcheck():
    # attnkit::onednn_mm as compiled layers see it: its schema, fake tensor and gradients.
    import attnkit.accel.onednn as onednn

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True)
    torch.library.opcheck(onednn.register_operator(), (x, w, b))
    torch.library.opcheck(onednn.register_operator(), (x, w, None))
