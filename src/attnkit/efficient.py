"""Attention that is not quadratic: sliding-window (local) attention and linear attention, with
the caches that make their decoding steps cost the same at any length.

Full attention compares every query with every key: N x N scores, O(N^2) time and memory.

- **Sliding window** (Longformer, Mistral): query i sees only keys j with ``0 <= i - j < w``
  (causal) or ``|i - j| < w`` (bidirectional). Computed block by block: queries in blocks of w
  positions, each block against the 2 (causal) or 3 (bidirectional) key blocks that can hold
  its keys, so the scores take (N / w) * w * 3w = O(N w) memory, never N x N. Decoding keeps
  a rolling cache of the last w keys and values.
- **Linear attention** (Katharopoulos et al., 2020): replace ``exp(q . k)`` by
  ``phi(q) . phi(k)`` with the feature map ``phi(x) = elu(x) + 1 > 0``. Then::

      out_i = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)

  and S (d x d_v) and z (d) are shared by all queries: O(N) time and memory. Causal
  attention keeps running sums S_i, z_i over j <= i; decoding carries (S, z) from step to
  step, a constant-size state. (No 1/sqrt(d_k) here: the normaliser already keeps the weights
  a distribution.)

Every function here has an explicit quadratic counterpart (``window_mask`` with the ordinary
math path; ``linear_attention_weights``) that the tests hold it to, and that ``return_weights``
uses.

The last two sections are about the other costs, the matrix products around attention:
``Linear`` / ``linear``, the layer every projection in attnkit uses, runs float32 products on
the CPU through oneDNN's GEMM, which on the AMD EPYC measured here is 2-3x faster than torch's
default (MKL), and keeps transposed weights for decoding steps (``decoding_weights``);
``linear_cross_entropy`` is the output layer and its loss in one chunked pass, without the
(tokens x vocabulary) logits.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = [
    "Linear",
    "LinearAttentionState",
    "RollingKVCache",
    "decoding_weights",
    "feature_map",
    "linear",
    "linear_attention",
    "linear_attention_weights",
    "linear_cross_entropy",
    "onednn_linear",
    "onednn_linear_available",
    "sliding_window_attention",
    "window_mask",
]


# --------------------------------------------------------------------------------------------
# Sliding window
# --------------------------------------------------------------------------------------------


def window_mask(
    n: int, m: int | None = None, *, window: int, causal: bool = True, device=None
) -> Tensor:
    """Bool (n, m), True where query i may see key j: ``0 <= d < window`` (causal) or
    ``|d| < window`` (bidirectional), d = i + (m - n) - j (queries are the last n of m, as in
    ``causal_mask``)."""
    m = n if m is None else m
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    i = torch.arange(n, device=device).unsqueeze(1) + (m - n)  # (n, 1) absolute positions
    d = i - torch.arange(m, device=device).unsqueeze(0)  # (n, m)
    return (d >= 0) & (d < window) if causal else d.abs() < window


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    causal: bool = True,
    key_valid: Tensor | None = None,
    positions: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Self-attention over a band of width ``window``, computed in blocks: O(N * window).

    q, k, v: (B, H, N, d). ``key_valid`` (B, N) bool marks real tokens (False = padding).
    With ``alibi_slopes`` (H,) and ``positions`` (B, N) the scores get ALiBi's
    ``-slope_h * |pos_i - pos_j|``. Equal to the math path with ``window_mask`` (tested).
    """
    b, h, n, d = q.shape
    w = window
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    blocks = -(-n // w)  # ceil(n / w)
    padded = blocks * w
    span = 2 * w if causal else 3 * w  # keys a query block can see: blocks b-1, b (and b+1)
    back = padded - n + (0 if causal else w)

    q_blocks = F.pad(q, (0, 0, 0, padded - n)).view(b, h, blocks, w, d)  # (B, H, nb, w, d)
    k_windows = F.pad(k, (0, 0, w, back)).unfold(2, span, w).transpose(-1, -2)  # (B,H,nb,span,d)
    v_windows = F.pad(v, (0, 0, w, back)).unfold(2, span, w).transpose(-1, -2)
    scores = torch.einsum("bhnrd,bhncd->bhnrc", q_blocks, k_windows) * scale  # (B,H,nb,w,span)

    # Which (query r, key slot c) pairs are in the band: query i = nb*w + r, key j = (nb-1)*w + c
    r = torch.arange(w, device=q.device).view(w, 1)
    c = torch.arange(span, device=q.device).view(1, span)
    dist = w + r - c  # i - j
    band = (dist >= 0) & (dist < w) if causal else dist.abs() < w  # (w, span)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_valid is None else key_valid
    valid = F.pad(valid, (w, back), value=False).unfold(1, span, w)  # (B, nb, span)
    allowed = band & valid[:, :, None, :]  # (B, nb, w, span)
    if alibi_slopes is not None:
        pos = positions.expand(b, n).float()
        pos_q = F.pad(pos, (0, padded - n)).view(b, blocks, w)  # (B, nb, w)
        pos_k = F.pad(pos, (w, back)).unfold(1, span, w)  # (B, nb, span)
        distance = (pos_q[..., :, None] - pos_k[..., None, :]).abs()  # (B, nb, w, span)
        scores = scores - alibi_slopes.view(1, h, 1, 1, 1) * distance[:, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    empty = ~allowed.any(-1)[:, None, :, :, None]  # (B, 1, nb, w, 1): padded query rows
    scores = scores.masked_fill(empty, 0.0)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype).masked_fill(empty, 0.0)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.einsum("bhnrc,bhncd->bhnrd", weights, v_windows)  # (B, H, nb, w, d)
    return out.reshape(b, h, padded, d)[:, :, :n]  # (B, H, N, d)


class RollingKVCache:
    """The last ``window`` keys and values of one layer, in a ring buffer of fixed size.

    Position p lives in slot ``p % window``; a decoding step overwrites the oldest entry, so
    memory and cost stay flat however long the generation runs. ``valid`` marks slots that
    hold a real token (not padding, not yet written); ``positions`` keeps each slot's position
    (ALiBi needs it; RoPE is already applied to the cached keys).
    """

    def __init__(self, batch_size, n_kv_heads, window, d_head, *, dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_heads, window, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, window, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, window, dtype=torch.bool, device=device)
        self.window = window
        self.length = 0  # positions seen so far

    def append(self, k: Tensor, v: Tensor, positions: Tensor | None, valid: Tensor) -> None:
        """Write the last min(T, window) of T new positions (B, H_kv, T, d) into their slots."""
        t = k.shape[2]
        keep = min(t, self.window)
        slots = (torch.arange(self.length + t - keep, self.length + t) % self.window).to(
            self.k.device
        )
        self.k[:, :, slots] = k[:, :, t - keep :]
        self.v[:, :, slots] = v[:, :, t - keep :]
        self.valid[:, slots] = valid[:, t - keep :]
        if positions is not None:
            self.positions[:, slots] = positions.expand(k.shape[0], t)[:, t - keep :]
        self.length += t

    def reorder(self, index: Tensor) -> None:
        for name in ("k", "v", "positions", "valid"):
            setattr(self, name, getattr(self, name).index_select(0, index))


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1: positive, so every phi(q) . phi(k) is a positive similarity."""
    return F.elu(x.float()) + 1.0


def linear_attention_weights(
    q: Tensor, k: Tensor, *, causal: bool, key_valid: Tensor | None = None
) -> Tensor:
    """The quadratic form of linear attention, (B, H, N, M): row-normalised phi(Q) phi(K)^T,
    masked. ``weights @ v`` equals ``linear_attention`` (the reference it is tested against)."""
    scores = feature_map(q) @ feature_map(k).transpose(-2, -1)  # (B, H, N, M)
    n, m = q.shape[-2], k.shape[-2]
    if causal:
        scores = scores.masked_fill(~window_mask(n, m, window=m + n, device=q.device), 0.0)
    if key_valid is not None:
        scores = scores * key_valid[:, None, None, :]
    return (scores / scores.sum(-1, keepdim=True).clamp_min(1e-30)).to(q.dtype)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_valid: Tensor | None = None,
    state: LinearAttentionState | None = None,
    chunk: int = 128,
) -> Tensor:
    """Linear attention in O(N): q, k (B, H, N, d), v (B, H, N, d_v) -> (B, H, N, d_v).

    Causal attention works in chunks of ``chunk`` positions, all chunks at once: inside a chunk
    the (chunk x chunk) masked products; from earlier chunks the prefix sums of each chunk's
    ``phi(K)^T V`` and ``phi(K)`` (an exclusive cumulative sum over chunks). Memory is
    O(N * chunk + N / chunk * d * d_v), never N x N. With a ``state`` (decoding), the sums
    start from it and it is updated in place.
    """
    b, h, n, _ = q.shape
    phi_q, phi_k = feature_map(q), feature_map(k)
    vf = v.float()
    if key_valid is not None:
        phi_k = phi_k * key_valid[:, None, :, None]  # padding contributes nothing
    if not causal:
        s = phi_k.transpose(-2, -1) @ vf  # (B, H, d, d_v)
        z = phi_k.sum(2)  # (B, H, d)
        num = phi_q @ s  # (B, H, N, d_v)
        den = (phi_q * z[:, :, None]).sum(-1, keepdim=True)  # (B, H, N, 1)
        return (num / den.clamp_min(1e-30)).to(v.dtype)

    c = min(chunk, n)
    nc = -(-n // c)  # ceil(n / c)
    pad = nc * c - n  # padded keys have phi = 0 (so they add nothing), padded queries are cut

    def chunks(t):
        return F.pad(t, (0, 0, 0, pad)).view(b, h, nc, c, t.shape[-1])  # (B, H, nc, c, .)

    qc, kc, vc = chunks(phi_q), chunks(phi_k), chunks(vf)  # padding is zero: no contribution
    kv = kc.transpose(-2, -1) @ vc  # (B, H, nc, d, d_v): each chunk's sum of phi(k) v^T
    kz = kc.sum(3)  # (B, H, nc, d)
    s_before = kv.cumsum(2) - kv  # sums over the chunks before each chunk
    z_before = kz.cumsum(2) - kz
    if state is not None:
        s_before = s_before + state.s[:, :, None]
        z_before = z_before + state.z[:, :, None]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    intra = (qc @ kc.transpose(-2, -1)).masked_fill(~lower, 0.0)  # (B, H, nc, c, c)
    num = qc @ s_before + intra @ vc  # (B, H, nc, c, d_v)
    den = (qc * z_before[:, :, :, None]).sum(-1, keepdim=True) + intra.sum(-1, keepdim=True)
    out = (num / den.clamp_min(1e-30)).reshape(b, h, nc * c, -1)[:, :, :n]
    if state is not None:
        state.s = s_before[:, :, -1] + kv[:, :, -1]
        state.z = z_before[:, :, -1] + kz[:, :, -1]
        state.length += n
    return out.to(v.dtype)  # (B, H, N, d_v)


class LinearAttentionState:
    """The running sums of causal linear attention for one layer: S (B, H, d, d_v) and
    z (B, H, d). Their size does not depend on how many tokens came before."""

    def __init__(self, batch_size, n_heads, d_head, *, device=None, **_ignored):
        self.s = torch.zeros(batch_size, n_heads, d_head, d_head, device=device)
        self.z = torch.zeros(batch_size, n_heads, d_head, device=device)
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        self.s = self.s.index_select(0, index)
        self.z = self.z.index_select(0, index)


# --------------------------------------------------------------------------------------------
# Linear layers: oneDNN's float32 GEMM on the CPU
# --------------------------------------------------------------------------------------------

# Rows below which a product stays with torch's own GEMM: for a single row (a decoding step)
# its matrix-vector kernel beats oneDNN's per-call set-up; from about 8 rows on oneDNN wins.
_ONEDNN_MIN_ROWS = 8
_onednn = {"enabled": os.environ.get("ATTNKIT_ONEDNN_LINEAR", "1") != "0"}


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear operator (x86 and ARM CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextmanager
def onednn_linear(enabled: bool):
    """Turn the oneDNN path of :func:`linear` on or off inside a ``with`` block (benchmarks and
    tests compare both). The default is on; ``ATTNKIT_ONEDNN_LINEAR=0`` turns it off."""
    before = _onednn["enabled"]
    _onednn["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _onednn["enabled"] = before


def _onednn_mm(a: Tensor, b_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b_t.T (+ bias)`` for 2-D float32 CPU tensors, by oneDNN. ``b_t`` may be a
    transposed view (oneDNN reads either layout); ``a`` is made contiguous if it is not."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``x W^T + b`` with the forward and both backward products in oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (T, in): every leading axis is a row
        ctx.save_for_backward(x2, weight)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        return _onednn_mm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])  # (T, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_mm(g2, weight.t()).view(ctx.x_shape)  # dL/dx = g W
        if ctx.needs_input_grad[1]:
            # dL/dW = g^T x, (out, in). oneDNN wants its left operand contiguous, so transpose
            # whichever of g (T x out) and x (T x in) is the smaller copy.
            if g2.shape[1] <= x2.shape[1]:
                grad_w = _onednn_mm(g2.t(), x2.t())
            else:  # (x^T g)^T: copies x and the (in, out) result, not the wide g (LM head)
                grad_w = _onednn_mm(x2.t(), g2.t()).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def _use_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (
        _onednn["enabled"]
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32)
        # A dense (out, in) or (in, out) layout only: a strided slice of a transposed weight
        # (the cross-attention's rows of in_proj inside decoding_weights) sends oneDNN to a
        # reference kernel, measured 100-1000x slower than torch's GEMM on the same view.
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and x.dim() >= 2
        and x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1] > 0
        and not torch.is_autocast_enabled("cpu")  # autocast casts to bf16: torch's path
        and not torch.compiler.is_compiling()  # let the compiler see an ordinary linear
        and onednn_linear_available()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, the same numbers up to float32 rounding, faster on CPUs
    where torch's own float32 GEMM is slow.

    torch sends float32 CPU matrix products to MKL, whose CPU dispatch gives non-Intel
    processors slower code paths: on the AMD EPYC this was measured on, MKL's SGEMM ran 2-3x
    below oneDNN's AVX-512 float32 kernels on the same matrices (bench/README.md). oneDNN, which
    torch already uses for bf16, chooses its kernels by the instruction set alone. So float32
    products with at least a few rows go through oneDNN (forward, dL/dx and dL/dW); everything
    else (other dtypes, autocast, other devices, single rows, ``torch.compile``) through
    ``F.linear``. Strict float32 throughout: no reduced-precision accumulation. The oneDNN path
    differentiates once (no ``create_graph=True`` second derivatives): for those, run inside
    ``onednn_linear(False)``.
    """
    if _use_onednn(x, weight, bias):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, same state-dict names) whose forward is
    :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


@contextmanager
def decoding_weights(module: nn.Module):
    """Inside the block the weight of every :class:`Linear` of ``module`` is stored transposed:
    the same (out, in) tensor, the same values, but laid out in memory as (in, out) rows.

    A decoding step is a matrix-vector product per layer whose weights come from memory each
    time (a whole model's weights do not stay in a core's cache). With the (in, out) layout,
    ``F.linear`` hands torch's GEMM the contiguous (in, out) matrix and the product streams it
    row after row (``y += x_k * W^T[k, :]``), which on this CPU runs 1.7x faster than over the
    (out, in) layout (Hugging Face's GPT-2 stores its weights as (in, out) ``Conv1D``s). The
    layout is changed in place, one weight at a time (no second copy of the model), and
    restored when the block ends; the weights must not be trained or saved inside it.
    """
    weights = {id(m.weight): m.weight for m in module.modules() if isinstance(m, Linear)}
    changed = []
    try:
        for w in weights.values():  # a tied weight (LM head = embedding) once
            if w.dim() == 2 and w.is_contiguous():
                w.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)
                changed.append(w)
        yield
    finally:
        for w in changed:
            w.data = w.data.contiguous()


# --------------------------------------------------------------------------------------------
# The output layer and its loss in one pass: no (tokens x vocabulary) logits tensor
# --------------------------------------------------------------------------------------------


def _mm_t(a: Tensor, b_t: Tensor) -> Tensor:
    """``a @ b_t.T`` for 2-D tensors, through oneDNN where :func:`linear` would use it."""
    if _use_onednn(a, b_t, None):
        return _onednn_mm(a, b_t)
    return a @ b_t.t()


def _chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: about 16 MiB of float32 logits, which stay in the last-level cache, in
    few enough chunks that the per-chunk operations cost little (512 rows for V = 8192)."""
    return max(64, min(2048, (1 << 22) // vocab_size))


def _loss_and_grads(hidden, weight, targets, ignore_index, smoothing, with_grads):
    """The chunked loop behind :func:`linear_cross_entropy`: (loss, dL/dhidden, dL/dweight).

    Per chunk only the big operations run (three products, the max, the softmax, the in-place
    gradient); everything per row is gathered into (T, 1) columns and finished after the loop,
    so that few small serial operations sit between the parallel ones.
    """
    device = hidden.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else hidden.dtype
    h_all, w = hidden.to(dtype), weight.to(dtype)  # the dtype autocast would give the product
    n, vocab = hidden.shape[0], weight.shape[0]
    real = (targets != ignore_index)[:, None]  # (T, 1)
    safe = torch.where(real, targets[:, None], 0)  # (T, 1): an ignored id may be anything
    row_weight = real / real.sum().clamp(min=1)  # (T, 1): 1 / count on the counted rows, else 0
    top = torch.empty(n, 1, device=device)  # the row's max logit
    top_id = torch.empty(n, 1, dtype=torch.long, device=device)
    z_target = torch.empty(n, 1, device=device)  # the target's logit
    p_top = torch.empty(n, 1, device=device)  # softmax at the max: >= 1 / V, never underflows
    z_mean = torch.empty(n, 1, device=device) if smoothing else None
    grad_h_chunks, grad_w_t = [], None  # dL/dhidden per chunk; dL/dW^T (D, V) summed
    step = _chunk_rows(vocab)
    probs_buffer = torch.empty(min(step, n), vocab, device=device)
    with torch.autocast(device.type, enabled=False):
        for start in range(0, n, step):
            rows = slice(start, start + step)
            h = h_all[rows]
            logits = _mm_t(h, w).float()  # (c, V): the only logits that ever exist
            torch.max(logits, dim=-1, keepdim=True, out=(top[rows], top_id[rows]))
            torch.gather(logits, 1, safe[rows], out=z_target[rows])
            if smoothing:
                torch.mean(logits, dim=-1, keepdim=True, out=z_mean[rows])
            # torch's fused row-wise softmax: max, exp-sum and scale while a row sits in L1
            probs = torch.softmax(logits, dim=-1, out=probs_buffer[: h.shape[0]])
            torch.gather(probs, 1, top_id[rows], out=p_top[rows])
            if not with_grads:
                continue
            # dL/dlogits = (softmax - (1 - eps) onehot - eps / V) * real / count, in place
            g = probs.mul_(row_weight[rows])
            g.scatter_add_(1, safe[rows], row_weight[rows] * (smoothing - 1))
            if smoothing:
                g.sub_(row_weight[rows] * (smoothing / vocab))
            g = g.to(dtype)
            grad_h_chunks.append(_mm_t(g, w.t()))  # (c, D)
            part = _mm_t(h.t(), g.t()).float()  # (D, V) = h^T g
            grad_w_t = part if grad_w_t is None else grad_w_t.add_(part)
    lse = top - p_top.log()  # logsumexp of each row's logits
    loss = lse - z_target  # -log p(y)
    if smoothing:  # eps times the cross-entropy against the uniform distribution
        loss = (1 - smoothing) * loss + smoothing * (lse - z_mean)
    loss = (loss * row_weight).sum()
    if not with_grads:
        return loss, None, None
    grad_h = torch.cat(grad_h_chunks).to(hidden.dtype)
    grad_w = grad_w_t.t().to(weight.dtype)
    return loss, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients come out of one forward pass (the chunk's logits are still
    in the cache when their gradient is formed); backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, smoothing):
        loss, grad_h, grad_w = _loss_and_grads(
            hidden, weight, targets, ignore_index, smoothing, with_grads=True
        )
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    smoothing: float = 0.0,
) -> Tensor:
    r"""Mean cross-entropy of the output layer ``logits = hidden @ weight^T`` against
    ``targets``, without ever holding the (tokens x V) logits::

        loss = mean over tokens with target != ignore_index of
               (1 - eps) (logsumexp(z) - z_y) + eps (logsumexp(z) - mean_k z_k)

    the same value as ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=...,
    label_smoothing=eps)`` (tested). hidden (..., D), weight (V, D), targets (...) ids.

    The tokens go through in chunks of a few hundred rows; for each chunk the logits, their
    log-sum-exp and, while they are still in the cache, the gradient
    ``(softmax - target distribution) / count`` and its two products (dL/dhidden, dL/dW) are
    formed. Against logits + ``F.cross_entropy`` this saves writing and re-reading the full
    logits, their log-softmax, the zero-filled gradient and its log-softmax backward: four or
    five passes over tokens x V floats (64 MiB per pass for lm-small). The products run in the
    autocast dtype when autocast is on; the softmax always in float32.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"linear_cross_entropy: targets must have shape hidden.shape[:-1] = "
            f"{tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: weight must have shape (V, D={hidden.shape[-1]}), "
            f"got {tuple(weight.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: targets must hold token ids, got {targets.dtype}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"linear_cross_entropy: smoothing must be in [0, 1), got {smoothing!r}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (T, D)
    flat = targets.reshape(-1)  # (T,)
    real = flat[flat != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= weight.shape[0]):
        bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
        raise ValueError(f"linear_cross_entropy: target id {bad} is outside [0, {weight.shape[0]})")
    if hidden2.shape[0] == 0:  # no tokens: a zero loss, still attached to the graph
        return (hidden2.sum() + weight.sum()) * 0.0
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden2, weight, flat, ignore_index, float(smoothing))
    loss, _, _ = _loss_and_grads(hidden2, weight, flat, ignore_index, smoothing, False)
    return loss
