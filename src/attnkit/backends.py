r"""Attention backends: full, sliding-window and linear attention behind one signature.

Every backend is called by ``MultiHeadAttention`` as::

    out, weights = backend(q, keys, mask=..., is_causal=..., dropout_p=..., return_weights=...,
                           alibi=..., positions=...)

with q (B, H, N, d_k), ``keys`` a :class:`~attnkit.caches.Keys` (k, v (B, H, M, d), their
positions, which are real tokens, and for linear attention the sums over earlier keys), and
returns out (B, H, N, d_v) and the weights (B, H, N, M) when asked (else None).

- **Full** attention is the paper's eq. 1, ``softmax(Q K^T / sqrt(d_k) + mask) V``: N x M
  scores. :func:`attend` holds its two paths side by side: the explicit math (the reference,
  and the one that returns weights) and torch's fused kernel (no N x M matrix in memory).
- **Sliding window** (Longformer, Mistral): query i sees only keys j with ``0 <= i - j < w``
  (causal) or ``|i - j| < w`` (bidirectional). Computed block by block: queries in blocks of w
  positions, each block against the 2 (causal) or 3 (bidirectional) key blocks that can hold
  its keys, so the scores take O(N w) memory, never N x N.
- **Linear attention** (Katharopoulos et al., 2020): replace ``exp(q . k)`` by
  ``phi(q) . phi(k)`` with the feature map ``phi(x) = elu(x) + 1 > 0``. Then::

      out_i = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T,   z = sum_j phi(k_j)

  and S (d x d_v) and z (d) are shared by all queries: O(N) time and memory. Causal attention
  keeps running sums over j <= i; decoding carries (S, z) from step to step, a constant-size
  state (:class:`LinearAttentionState`). No 1/sqrt(d_k): the normaliser keeps the weights a
  distribution.

Each fast path is tested against an explicit quadratic counterpart (``window_mask`` with the math
path; :func:`linear_attention_weights`), which ``return_weights`` uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.caches import Keys
from attnkit.masks import causal_mask, combine, window_mask
from attnkit.position import ALiBi

__all__ = [
    "ATTENTION",
    "BACKENDS",
    "AttentionImplementation",
    "LinearAttentionState",
    "PackedAttention",
    "attend",
    "attention_implementation",
    "feature_map",
    "full_attention",
    "linear_attention",
    "linear_attention_weights",
    "register_attention",
    "sliding_window_attention",
    "window_attention",
]


# --------------------------------------------------------------------------------------------
# Full attention: the math path and the fused path side by side
# --------------------------------------------------------------------------------------------


class PackedAttention(NamedTuple):
    """An implementation's variable-length form (FlashAttention's varlen API): softmax
    attention with scale 1/sqrt(d) within each of B sequences packed into rows
    (``varlen.Sequences``), H query and H key/value heads, no dropout.

    - ``takes(x, longest)``: whether it takes rows like x (their dtype, device, size) in
      sequences of at most ``longest``;
    - ``self_attention(qkv, sequences, causal=...)``: qkv (T, 3, H, d) -> (T, H, d);
    - ``attention(q, kv, queries, keys, causal=...)``: q (T, H, d), kv (T_k, 2, H, d) ->
      (T, H, d), each query's sequence b attending to the keys' sequence b.
    """

    takes: Callable
    self_attention: Callable
    attention: Callable


class AttentionImplementation(NamedTuple):
    """One way to compute softmax attention, as Hugging Face's ``attn_implementation`` names
    them: ``fused`` takes ``F.scaled_dot_product_attention``'s arguments and, unlike torch's, a
    mask together with ``is_causal`` (bottom-right aligned), handing torch what it does not
    take itself (None: the explicit math path); ``packed`` is its variable-length form, if any."""

    fused: Callable | None
    packed: PackedAttention | None = None


# The one registry of attention implementations, by name: "math" (the explicit path, which
# also gives weights), "sdpa" (torch's fused kernel, the default) and whatever a speed lever
# registers ("attnkit", its C kernel with its packed form, when attnkit.accel is imported). A
# model chooses one in its config (``ModelConfig.attn_implementation``).
ATTENTION: dict[str, AttentionImplementation] = {}


def register_attention(
    name: str, fused: Callable | None, packed: PackedAttention | None = None
) -> None:
    """Register an attention implementation called ``name`` (see :data:`ATTENTION`)."""
    if not isinstance(name, str) or not name or name in ("math", "sdpa"):
        raise ValueError(f"register_attention: name must be a new non-empty name, got {name!r}")
    ATTENTION[name] = AttentionImplementation(fused, packed)


def attention_implementation(name: str, argument: str = "attn_implementation"):
    """The registered implementation ``name``; a ValueError names ``argument`` and the known
    ones."""
    if not isinstance(name, str) or name not in ATTENTION:
        raise ValueError(
            f"{argument} must be one of {sorted(ATTENTION)}, got {name!r} (a speed "
            "lever registers its own when imported: import attnkit.accel for 'attnkit')"
        )
    return ATTENTION[name]


def attend(q, k, v, mask=None, is_causal=False, dropout_p=0.0, return_weights=False, scale=None,
           implementation="sdpa"):  # fmt: skip
    """``softmax(q k^T * scale + mask) v`` for checked inputs; (out, weights or None).

    The registered implementation ``implementation`` runs (:data:`ATTENTION`: torch's
    ``"sdpa"`` by default, ``"math"`` the explicit path), and the math path whenever weights
    are asked for (the one that has them). A query with nothing to attend to gets a zero
    output, never NaN.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    kernel = ATTENTION[implementation].fused
    if return_weights or kernel is None:
        return _math(q, k, v, mask, is_causal, dropout_p, scale)
    gqa = {"enable_gqa": True} if k.dim() >= 3 and k.shape[-3] != q.shape[-3] else {}
    return kernel(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    ), None


def _with_causal(mask: Tensor | None, is_causal: bool, n: int, m: int, like: Tensor):
    """The user's mask and the causal flag as one mask (bool if both are bool)."""
    if not is_causal or n == 1 <= m:
        return mask  # (one query, the last position, sees every key: nothing to mask)
    return combine(mask, causal_mask(n, m, device=like.device))


def _blocked_rows(mask: Tensor) -> Tensor:
    """Which query rows may attend to nothing, (..., N or 1, 1) bool."""
    blocked = ~mask if mask.dtype == torch.bool else torch.isneginf(mask)
    return blocked.all(dim=-1, keepdim=True)


def _empty_rows(mask: Tensor | None) -> Tensor | None:
    """:func:`_blocked_rows`, or None when the mask has none (a look at the values: on a GPU,
    the host waits for the device)."""
    if mask is None:
        return None
    empty = _blocked_rows(mask)
    return empty if bool(empty.any()) else None


def _math(q, k, v, mask, is_causal, dropout_p, scale):
    """The reference: every intermediate is an ordinary tensor that can be printed."""
    k, v = _grouped(k, q), _grouped(v, q)
    mask = _with_causal(mask, is_causal, q.shape[-2], k.shape[-2], q)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., N, M), a fresh tensor: edit it in place
    if mask is not None and mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        scores += mask
    # A row that may attend to nothing is all -inf, and softmax would give 0/0 = NaN. Give such a
    # row uniform scores instead, then zero its weights: output 0, gradient 0, never NaN.
    empty = _empty_rows(mask)
    if empty is not None:
        scores = scores.masked_fill(empty, 0.0)
    # softmax in float32 at least, so half-precision scores do not overflow inside exp().
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = weights.to(q.dtype)  # (..., N, M)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    attn = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attn @ v, weights  # (..., N, d_v), (..., N, M)


def _grouped(t: Tensor, q: Tensor) -> Tensor:
    """Grouped-query attention: keys or values (B, H_kv, M, d) repeated for q's H heads, each
    K/V head serving H / H_kv consecutive query heads."""
    if t.dim() < 3 or t.shape[-3] == q.shape[-3]:
        return t
    return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's fused kernel (``F.scaled_dot_product_attention``): no N x M score matrix when
    there is no explicit mask; fewer K/V heads than query heads (grouped-query attention) read
    in place (``enable_gqa``), not repeated. A mask and ``is_causal`` together, or a causal
    mask over more keys than queries, become one bottom-right aligned mask (torch takes one or
    the other, and aligns its own causal mask top-left)."""
    n, m = q.shape[-2], k.shape[-2]
    if is_causal and attn_mask is None and n == m:  # torch builds the (square) causal mask
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    mask = _with_causal(attn_mask, is_causal, n, m, q)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    if q.device.type != "cpu" and mask is not None:
        # torch's CPU kernel already returns 0 for a row with nothing to attend to; other
        # backends may not, so zero those rows explicitly there. Always, without asking first
        # whether there are any: that question would make the host wait for the GPU at every
        # call, and break a compiled layer's graph in two.
        out = out.masked_fill(_blocked_rows(mask), 0.0)
    return out


ATTENTION["math"] = AttentionImplementation(None)
ATTENTION["sdpa"] = AttentionImplementation(sdpa)


def full_attention(q, keys: Keys, *, mask=None, is_causal=False, dropout_p=0.0,
                   return_weights=False, alibi: ALiBi | None = None, positions=None,
                   implementation="sdpa"):  # fmt: skip
    """Every query against every key: the paper's attention (ALiBi's bias joins the mask)."""
    if alibi is not None:
        mask = combine(alibi.bias(positions, keys.positions).to(q.dtype), mask)
    return attend(q, keys.k, keys.v, mask, is_causal, dropout_p, return_weights,
                  implementation=implementation)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Sliding window
# --------------------------------------------------------------------------------------------


def window_attention(q, keys: Keys, *, window: int, mask=None, is_causal=False, dropout_p=0.0,
                     return_weights=False, alibi: ALiBi | None = None, positions=None,
                     implementation="sdpa"):  # fmt: skip
    """Self-attention over a band of ``window`` keys. ``keys.valid`` marks padding (the
    ``mask`` argument, a key padding mask, has already been turned into it)."""
    keys = keys.repeat(q.shape[1] // keys.k.shape[1])  # grouped-query attention
    n, m = q.shape[2], keys.k.shape[2]
    if n != m:  # a decoding step against a RollingKVCache: every valid slot is in the window
        slots = keys.valid[:, None, None, :]  # (B, 1, 1, w)
        return full_attention(
            q, keys, mask=slots, dropout_p=dropout_p, return_weights=return_weights,
            alibi=alibi, positions=positions, implementation=implementation,
        )  # fmt: skip
    if return_weights:  # the reference: the math path under the band mask
        band = window_mask(n, window=window, causal=is_causal, device=q.device)
        if keys.valid is not None:
            band = band & keys.valid[:, None, None, :]
        keys = Keys(keys.k, keys.v, positions)
        return full_attention(
            q, keys, mask=band, dropout_p=dropout_p, return_weights=True, alibi=alibi,
            positions=positions,
        )  # fmt: skip
    slopes = None if alibi is None else alibi.slopes
    out = sliding_window_attention(
        q, keys.k, keys.v, window, causal=is_causal, key_valid=keys.valid, positions=positions,
        alibi_slopes=slopes, dropout_p=dropout_p,
    )  # fmt: skip
    return out, None


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


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1: positive, so every phi(q) . phi(k) is a positive similarity."""
    return F.elu(x.float()) + 1.0


def linear_backend(q, keys: Keys, *, mask=None, is_causal=False, dropout_p=0.0,
                   return_weights=False, alibi=None, positions=None,
                   implementation="sdpa"):  # fmt: skip
    """Linear attention as a backend (no dropout on its implicit weights, no ALiBi;
    ``implementation``, the softmax kernel, does not apply)."""
    keys = keys.repeat(q.shape[1] // keys.k.shape[1])  # grouped-query attention
    if return_weights:
        if keys.past is not None:
            raise ValueError("return_weights is not available with a linear-attention cache")
        weights = linear_attention_weights(q, keys.k, causal=is_causal, key_valid=keys.valid)
        return weights @ keys.v, weights
    out = linear_attention(
        q, keys.k, keys.v, causal=is_causal, key_valid=keys.valid, past=keys.past
    )
    return out, None


def linear_attention_weights(
    q: Tensor, k: Tensor, *, causal: bool, key_valid: Tensor | None = None
) -> Tensor:
    """The quadratic form of linear attention, (B, H, N, M): row-normalised phi(Q) phi(K)^T,
    masked. ``weights @ v`` equals ``linear_attention`` (the reference it is tested against)."""
    scores = feature_map(q) @ feature_map(k).transpose(-2, -1)  # (B, H, N, M)
    n, m = q.shape[-2], k.shape[-2]
    if causal:
        scores = scores.masked_fill(~causal_mask(n, m, device=q.device), 0.0)
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
    past: tuple[Tensor, Tensor] | None = None,
    chunk: int = 128,
) -> Tensor:
    """Linear attention in O(N): q, k (B, H, N, d), v (B, H, N, d_v) -> (B, H, N, d_v).

    Causal attention works in chunks of ``chunk`` positions, all chunks at once: inside a chunk
    the (chunk x chunk) masked products; from earlier chunks the prefix sums of each chunk's
    ``phi(K)^T V`` and ``phi(K)`` (an exclusive cumulative sum over chunks). Memory is
    O(N * chunk + N / chunk * d * d_v), never N x N. ``past`` = (S, z) adds the sums over keys
    that came before (decoding).
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
    if past is not None:
        s_before = s_before + past[0][:, :, None]
        z_before = z_before + past[1][:, :, None]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    intra = (qc @ kc.transpose(-2, -1)).masked_fill(~lower, 0.0)  # (B, H, nc, c, c)
    num = qc @ s_before + intra @ vc  # (B, H, nc, c, d_v)
    den = (qc * z_before[:, :, :, None]).sum(-1, keepdim=True) + intra.sum(-1, keepdim=True)
    out = (num / den.clamp_min(1e-30)).reshape(b, h, nc * c, -1)[:, :, :n]
    return out.to(v.dtype)  # (B, H, N, d_v)


class LinearAttentionState:
    """The running sums of causal linear attention for one layer, S (B, H_kv, d, d_v) and
    z (B, H_kv, d): their size does not depend on how many tokens came before."""

    def __init__(self, batch_size, n_kv_heads, d_head, *, device=None, **_ignored):
        self.s = torch.zeros(batch_size, n_kv_heads, d_head, d_head, device=device)
        self.z = torch.zeros(batch_size, n_kv_heads, d_head, device=device)
        self.length = 0

    def update(self, keys: Keys) -> Keys:
        """Attend over the new keys plus the sums before them; add the new keys to the sums."""
        phi_k = feature_map(keys.k)  # (B, H_kv, T, d)
        if keys.valid is not None:
            phi_k = phi_k * keys.valid[:, None, :, None]
        past = (self.s, self.z)
        self.s = self.s + phi_k.transpose(-2, -1) @ keys.v.float()
        self.z = self.z + phi_k.sum(2)
        self.length += keys.k.shape[2]
        return Keys(keys.k, keys.v, keys.positions, keys.valid, past=past)

    def reorder(self, index: Tensor) -> None:
        self.s = self.s.index_select(0, index)
        self.z = self.z.index_select(0, index)


BACKENDS = {"full": full_attention, "window": window_attention, "linear": linear_backend}
