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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LinearAttentionState",
    "RollingKVCache",
    "feature_map",
    "linear_attention",
    "linear_attention_weights",
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
