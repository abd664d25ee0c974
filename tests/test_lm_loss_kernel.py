"""The C row kernel of the fused LM-head loss (``accel/lm_loss.c``) against torch's operators
and against logits + ``F.cross_entropy``: float32 and bfloat16 (autocast), label smoothing,
ignored rows, extreme logits, every variant this CPU runs, and a property over random shapes."""

import subprocess

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit.accel.lm_loss as lm_loss
from attnkit.accel import linear_cross_entropy, loss_kernels, native


def test_the_kernel_builds_and_is_used(monkeypatch):
    assert native.library() is not None  # make test builds the kernels at install
    calls = []
    real = lm_loss._rows_c
    monkeypatch.setattr(lm_loss, "_rows_c", lambda *a: calls.append(1) or real(*a))
    hidden, weight = torch.randn(10, 8), torch.randn(30, 8)
    with loss_kernels(True):
        linear_cross_entropy(hidden, weight, torch.randint(0, 30, (10,)))
    assert calls


def rows_both_ways(logits, targets, weights, smoothing, with_grads=True):
    """(lse, z_target, mean, gradient) from the kernel and from torch's operators."""
    out = []
    for rows in (lm_loss._rows_c, lm_loss._rows_torch):
        z = logits.clone()
        columns = [torch.full((len(z), 1), float("nan")) for _ in range(3)]
        g = rows(z, targets, weights, smoothing, with_grads, *columns)
        if rows is lm_loss._rows_c:
            assert g is True
            g = z
        out.append((*columns, g.to(logits.dtype) if with_grads else None))
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab=st.integers(1, 300),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
    smoothing=st.sampled_from([0.0, 0.1]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_rows_equal_torch_rows(rows, vocab, scale, smoothing, bf16, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if bf16:
        logits = logits.bfloat16()
    targets = torch.randint(0, vocab, (rows, 1), generator=g)
    weights = torch.rand(rows, 1, generator=g)
    weights[0] = 0.0  # an ignored row
    (lse, zt, mean, grad), (lse_t, zt_t, mean_t, grad_t) = rows_both_ways(
        logits, targets, weights, smoothing
    )
    torch.testing.assert_close(lse, lse_t, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(zt, zt_t, rtol=0, atol=0)
    torch.testing.assert_close(mean, mean_t, rtol=1e-5, atol=1e-5)
    # float32: a few ulp (of exp(), and of 1 where p - 1 cancels at the target); bfloat16:
    # the same value rounded, at most one ulp apart
    tol = dict(rtol=8e-3, atol=1e-7) if bf16 else dict(rtol=1e-5, atol=2e-7)
    torch.testing.assert_close(grad.float(), grad_t.float(), **tol)
    assert torch.all(grad[0] == 0)  # weight 0: no gradient at all


def test_extreme_and_tied_logits():
    logits = torch.tensor(
        [
            [1e4, -1e4, 0.0, 5.0],  # one logit dwarfs the rest: exp underflows to 0 elsewhere
            [-3e4, -3e4, -3e4, -3e4],  # all equal and very negative: uniform
            [88.0, 88.0, -200.0, 1.0],  # two tied maxima
        ]
    )
    targets = torch.tensor([[1], [2], [0]])
    weights = torch.ones(3, 1)
    (lse, zt, _, grad), _ = rows_both_ways(logits, targets, weights, 0.0)
    reference = torch.logsumexp(logits, dim=-1, keepdim=True)
    torch.testing.assert_close(lse, reference)
    assert torch.equal(zt, logits.gather(1, targets))
    expected = torch.softmax(logits, -1) - F.one_hot(targets[:, 0], 4)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_loss_and_gradients_match_autocast_logits_and_cross_entropy(
    smoothing, chunk, monkeypatch
):
    """Under autocast the reference makes bfloat16 logits, takes the cross-entropy in float32
    and sends a bfloat16 gradient into the products: the fused loss does the same. In chunks
    of 64 rows, dL/dW is summed from five bfloat16 parts (the kernel's transpose_add, or torch)."""
    if chunk is not None:
        monkeypatch.setattr(lm_loss, "_chunk_rows", lambda vocab: chunk)
    torch.manual_seed(0)
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = (torch.randn(1000, 32) * 0.2).requires_grad_()
    targets = torch.randint(0, 1000, (300,))
    targets[-40:] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.t()
        expected = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
    expected.backward()
    want = hidden.grad.clone(), weight.grad.clone()
    for kernel in (True, False):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), loss_kernels(kernel):
            got = linear_cross_entropy(hidden, weight, targets, smoothing=smoothing)
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden.grad, want[0], rtol=2e-2, atol=1e-5)
        # five parts each rounded to bfloat16, against one rounding of the whole product
        atol = 1e-5 if chunk is None else 4e-5
        torch.testing.assert_close(weight.grad, want[1], rtol=2e-2, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8192, 256), (37, 50), (16, 3)])
def test_the_transposed_add_equals_torchs(shape, dtype):
    """dL/dW's chunks come as (D, V) parts and are summed in W's (V, D) layout: the C kernel's
    sum (whole 16 x 16 blocks and the ragged edges) is torch's to the bit, and so is its
    first part, turned and widened to float32."""
    torch.manual_seed(0)
    rows, cols = shape
    parts = [torch.randn(cols, rows).to(dtype) for _ in range(2)]
    for kernel in (True, False):
        with loss_kernels(kernel):
            first = lm_loss._add_transposed(None, parts[0])
            assert first.dtype == torch.float32 and first.is_contiguous()
            assert torch.equal(first, parts[0].t().float())
            total = lm_loss._add_transposed(first, parts[1])
        assert total is first  # summed in place
        assert torch.equal(total, parts[0].t().float() + parts[1].t().float())


def test_int32_targets_give_the_int64_loss():
    torch.manual_seed(3)
    hidden, weight = torch.randn(20, 8), torch.randn(30, 8)
    targets = torch.randint(0, 30, (20,))
    assert torch.equal(
        linear_cross_entropy(hidden, weight, targets.int()),
        linear_cross_entropy(hidden, weight, targets),
    )


def test_a_bad_target_is_refused_by_the_kernel():
    logits, weights = torch.randn(2, 5), torch.ones(2, 1)
    columns = [torch.empty(2, 1) for _ in range(3)]
    with pytest.raises(RuntimeError, match="target id outside"):
        lm_loss._rows_c(logits, torch.tensor([[1], [5]]), weights, 0.0, True, *columns)


def test_the_kernel_can_be_switched_off():
    logits, columns = torch.randn(2, 5), [torch.empty(2, 1) for _ in range(3)]
    with loss_kernels(False):
        assert not lm_loss._rows_c(logits, torch.zeros(2, 1, dtype=torch.long),
                                   torch.ones(2, 1), 0.0, True, *columns)  # fmt: skip


@pytest.mark.parametrize("variant", [v for v in native.VARIANTS if native.runnable(v)])
def test_every_variant_this_cpu_runs_agrees_with_torch(variant):
    """Every variant built at install that this CPU can run (plain C on any) against torch's
    operators: float32 rows at float32 tolerance, bfloat16 rows (whose gradient is rounded to
    bfloat16) at bfloat16's."""
    with native.using(variant):
        rows_agree_with_torch()


def rows_agree_with_torch():
    torch.manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(7, 333) * 5).to(dtype)
        targets, weights = torch.randint(0, 333, (7, 1)), torch.rand(7, 1)
        (lse, zt, mean, grad), (lse_t, zt_t, mean_t, grad_t) = rows_both_ways(
            logits, targets, weights, 0.1
        )
        torch.testing.assert_close(lse, lse_t, rtol=2e-6, atol=2e-6)
        assert torch.equal(zt, zt_t)
        torch.testing.assert_close(mean, mean_t, rtol=1e-5, atol=1e-5)
        tolerance = 8e-3 if dtype == torch.bfloat16 else 2e-6
        torch.testing.assert_close(grad.float(), grad_t.float(), rtol=tolerance, atol=1e-7)


@pytest.mark.parametrize(
    ("cache_bytes", "vocab", "rows"),
    [
        (0, 8192, 1024),  # unknown: 32 MiB of float32 logits
        (32 << 20, 8192, 1024),  # a Zen 3, Zen 4 or Zen 5 L3: still 32 MiB
        (107520 << 10, 8192, 1024),  # the Xeon's 105 MiB: half of it, down to a power of two
        (256 << 20, 8192, 2048),  # a 256 MiB cache: half of it is 4,096 rows, capped at 2,048
        (32 << 20, 50257, 128),  # GPT-2's vocabulary: 166 rows, down to 128
        (0, 100, 2048),  # never more than 2,048 rows
        (0, 1 << 20, 64),  # nor fewer than 64
    ],
)
def test_the_chunk_follows_the_last_level_cache(monkeypatch, cache_bytes, vocab, rows):
    monkeypatch.setattr(lm_loss, "_last_level_cache", lambda: cache_bytes)
    assert lm_loss._chunk_rows(vocab) == rows


def test_the_last_level_cache_is_the_one_lscpu_reports():
    # lscpu -B -C: one row per cache, ONE-SIZE in bytes; the last row is the last level
    table = subprocess.run(["lscpu", "-B", "-C"], capture_output=True, text=True, check=True)
    rows = [line.split() for line in table.stdout.splitlines()[1:] if line.strip()]
    header = table.stdout.splitlines()[0].split()
    level, size = header.index("LEVEL"), header.index("ONE-SIZE")
    expected = int(max(rows, key=lambda row: int(row[level]))[size])
    assert lm_loss._last_level_cache() == expected
