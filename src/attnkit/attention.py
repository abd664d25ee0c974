"""Scaled dot-product attention, its masks, multi-head attention and the KV cache.

The whole of attention is one line of the paper (Vaswani et al., 2017, eq. 1)::

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + mask) V

Everything here is that line, made safe to call:

- ``scaled_dot_product_attention``: the formula, with an explicit math path (the reference, and
  the one that can hand back the weights) beside a fused path through
  ``torch.nn.functional.scaled_dot_product_attention`` (never materialises the N x M scores).
- ``causal_mask`` and ``padding_mask``: the two masks the paper needs. **True means "may
  attend"** everywhere in attnkit, as in ``torch.nn.functional.scaled_dot_product_attention``.
- ``MultiHeadAttention``: h heads of width d_k = d_v = d_model / h, concatenated and mixed by
  W^O; self- or cross-attention; grouped-query attention; RoPE / ALiBi hooks; a KV cache.
- ``KVCache``: preallocated keys and values for incremental decoding.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.efficient import (
    Linear,
    LinearAttentionState,
    RollingKVCache,
    linear,
    linear_attention,
    linear_attention_weights,
    sliding_window_attention,
    window_mask,
)
from attnkit.position import ALiBi, RotaryEmbedding

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "causal_mask",
    "padding_mask",
    "scaled_dot_product_attention",
]

Implementation = Literal["auto", "math", "fused"]


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def causal_mask(
    n: int, m: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """The look-ahead mask: query i may see key j only if j is not in its future.

    Returns a bool tensor of shape (n, m), True where ``j <= i + (m - n)``. With ``m == n`` this
    is the lower triangle (the diagonal included). With ``m > n`` the n queries are taken to be
    the *last* n of the m positions (bottom-right alignment), which is what a decoder that has
    already cached ``m - n`` keys needs. With ``m < n`` the first ``n - m`` queries see nothing.

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """
    m = n if m is None else m
    for name, value in (("n", n), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"causal_mask: {name} must be a non-negative int, got {value!r}")
    i = torch.arange(n, device=device).unsqueeze(1)  # (n, 1)
    j = torch.arange(m, device=device).unsqueeze(0)  # (1, m)
    return j <= i + (m - n)


def padding_mask(input_ids: Tensor, pad_id: int) -> Tensor:
    """Which keys are real tokens: a bool tensor (B, 1, 1, M), True on real tokens.

    The two singleton axes let it broadcast against attention scores of shape (B, H, N, M):
    every head and every query ignores the same padded keys.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"padding_mask: input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(
            f"padding_mask: input_ids must have shape (B, M), got {tuple(input_ids.shape)}"
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"padding_mask: input_ids must be integer token ids, got {input_ids.dtype}")
    return (input_ids != pad_id)[:, None, None, :]  # (B, 1, 1, M)


# --------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., length, dim), got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"q, k, v must have the same number of dimensions, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension d_k, got q {tuple(q.shape)} "
            f"(d_k={q.shape[-1]}) and k {tuple(k.shape)} (d_k={k.shape[-1]})"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length M, got k {tuple(k.shape)} (M={k.shape[-2]}) "
            f"and v {tuple(v.shape)} (M={v.shape[-2]})"
        )
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"q, k, v must have the same leading (batch, head) dimensions, got "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if not isinstance(dropout_p, int | float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    _check_mask(mask, q, k)


def _check_mask(mask: Tensor | None, q: Tensor, k: Tensor) -> None:
    """A mask must be bool or float, on q's device, and broadcast to the scores (..., N, M)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    target = (*q.shape[:-1], k.shape[-2])  # (..., N, M)
    try:
        broadcast = torch.broadcast_shapes(mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"{target} (..., N, M)"
        )


def _combine_masks(mask: Tensor | None, is_causal: bool, n: int, m: int, like: Tensor):
    """One mask from a user mask and the causal flag: bool if both are bool, else additive float."""
    if not is_causal or n == 1 <= m:
        return mask  # (one query, the last position, sees every key: nothing to mask)
    causal = causal_mask(n, m, device=like.device)  # (N, M)
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    scale: float | None = None,
    implementation: Implementation = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Scaled dot-product attention (the paper's eq. 1)::

        Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + mask) V

    Args:
        q: queries, (..., N, d_k).
        k: keys, (..., M, d_k).
        v: values, (..., M, d_v).
        mask: optional. A bool tensor broadcastable to (..., N, M), **True = may attend**; or a
            float tensor of that shape added to the scores (finite values are biases, such as
            ALiBi's; ``-inf`` blocks).
        is_causal: also apply ``causal_mask(N, M)``. With N < M the queries are the last N
            positions (bottom-right aligned: the KV-cache case). Note that
            ``torch.nn.functional.scaled_dot_product_attention`` aligns top-left instead.
        dropout_p: dropout on the attention weights (pass 0 at evaluation).
        return_weights: also return the softmax weights (..., N, M) (before dropout). This uses
            the math path.
        scale: the factor on the scores; default ``1 / sqrt(d_k)``.
        implementation: ``"auto"`` (fused unless weights are asked for), ``"math"`` or
            ``"fused"``.

    Returns:
        ``out`` (..., N, d_v), or ``(out, weights)`` with ``return_weights=True``. Each row of
        ``weights`` sums to 1; a query with nothing to attend to (its mask row all False or all
        ``-inf``) gets a zero row and a zero output, never NaN, and finite gradients.
    """
    _check_attention_inputs(q, k, v, mask, dropout_p)
    if implementation not in ("auto", "math", "fused"):
        raise ValueError(
            f"implementation must be 'auto', 'math' or 'fused', got {implementation!r}"
        )
    if return_weights and implementation == "fused":
        raise ValueError("return_weights=True needs implementation='math' (or 'auto')")
    return _attention(q, k, v, mask, is_causal, dropout_p, return_weights, scale, implementation)


def _attention(
    q, k, v, mask, is_causal, dropout_p, return_weights, scale=None, implementation="auto"
):
    """:func:`scaled_dot_product_attention` after its checks (``MultiHeadAttention`` builds q,
    k and v itself and checks only the mask: a decoding step should not re-check its own
    tensors)."""
    d_k = q.shape[-1]
    scale = 1.0 / math.sqrt(d_k) if scale is None else float(scale)
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)

    use_math = implementation == "math" or (implementation == "auto" and return_weights)
    if use_math:
        return _math_attention(q, k, v, mask, is_causal, dropout_p, scale, return_weights)
    return _fused_attention(q, k, v, mask, is_causal, dropout_p, scale)


def _empty_rows(mask: Tensor | None) -> Tensor | None:
    """Which query rows may attend to nothing, (..., N or 1, 1) bool; None when there are none."""
    if mask is None:
        return None
    blocked = ~mask if mask.dtype == torch.bool else torch.isneginf(mask)
    empty = blocked.all(dim=-1, keepdim=True)
    return empty if bool(empty.any()) else None


def _math_attention(q, k, v, mask, is_causal, dropout_p, scale, return_weights):
    """The reference: every intermediate is an ordinary tensor that can be printed."""
    n, m = q.shape[-2], k.shape[-2]
    mask = _combine_masks(mask, is_causal, n, m, q)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., N, M), a fresh tensor: edit it in place
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
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
    out = attn @ v  # (..., N, d_v)
    return (out, weights) if return_weights else out


def _fused_attention(q, k, v, mask, is_causal, dropout_p, scale):
    """torch's fused kernel: no N x M score matrix when there is no explicit mask."""
    n, m = q.shape[-2], k.shape[-2]
    if is_causal and mask is None and n == m:
        # The common self-attention case: the kernel builds the (top-left = bottom-right) mask.
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale
        )
    mask = _combine_masks(mask, is_causal, n, m, q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if q.device.type != "cpu":
        # torch's CPU kernel already returns 0 for a row with nothing to attend to; other
        # backends may not, so zero those rows explicitly there.
        empty = _empty_rows(mask)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
    return out


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


class KVCache:
    """Preallocated keys and values for one attention layer (incremental decoding).

    Storage is allocated once, (B, H_kv, max_len, d_head), and each step writes its new keys and
    values in place at ``[length, length + T)``: no ``torch.cat`` per step, so a decoding step
    costs the same memory traffic however long the cache already is.

    For self-attention ``MultiHeadAttention`` calls :meth:`append` with the new positions' keys
    and values (after RoPE) and attends over the returned views. For cross-attention the keys
    and values of the source are computed once: ``MultiHeadAttention`` stores them on the first
    call (:meth:`append` on an empty cache) and reuses them while ``length > 0``.

    ``positions`` (B, max_len) keeps each cached key's absolute position, for ALiBi.
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        d_head: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("d_head", d_head),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache: {name} must be a positive int, got {value!r}")
        shape = (batch_size, n_kv_heads, max_len, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def append(self, k: Tensor, v: Tensor, positions: Tensor | None = None):
        """Write k, v (B, H_kv, T, d_head) after the cached entries; return all of them.

        Returns views ``(k_all, v_all, positions_all)`` of shapes (B, H_kv, length, d_head) and
        (B, length).
        """
        if k.shape != v.shape or k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]:
            raise ValueError(
                f"KVCache.append: expected k and v of shape (B={self.k.shape[0]}, "
                f"H_kv={self.k.shape[1]}, T, d_head={self.k.shape[3]}), got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KVCache.append: the cache holds {self.max_len} positions; {start} are used "
                f"and {k.shape[2]} more do not fit"
            )
        t = end - start  # narrow() + copy_(): one view and one copy, no Python indexing
        self.k.narrow(2, start, t).copy_(k)
        self.v.narrow(2, start, t).copy_(v)
        if positions is not None:
            self.positions.narrow(1, start, t).copy_(positions)
        self.length = end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end), self.positions.narrow(1, 0, end)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search reorders hypotheses each step)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        self.positions = self.positions.index_select(0, index)


# --------------------------------------------------------------------------------------------
# Multi-head attention
# --------------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention (the paper's section 3.2.2)::

        MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O
        head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

    with d_k = d_v = d_model / h. All heads' projections live in one matrix ``in_proj``
    (rows: the h query heads, then the h_kv key heads, then the h_kv value heads), the same
    layout as ``torch.nn.MultiheadAttention.in_proj_weight``, so self-attention costs one matmul.

    - Self-attention: ``forward(x)``; Q, K and V all come from x.
    - Cross-attention: ``forward(x, context)``; Q from x (the decoder), K and V from context
      (the encoder output).
    - Grouped-query attention: ``n_kv_heads < n_heads`` key/value heads, each shared by
      ``n_heads // n_kv_heads`` query heads (``n_kv_heads=1`` is multi-query attention).
    - Positions inside attention: pass ``rope`` (rotates q and k by their positions) or
      ``alibi`` (adds ``-slope_h * |i - j|`` to the scores).
    - KV cache: pass ``cache=KVCache(...)`` to reuse earlier keys and values.

    ``mask`` follows attnkit's convention, True = may attend, broadcastable to (B, H, N, M).
    (``torch.nn.MultiheadAttention``'s ``key_padding_mask`` means the opposite: convert with
    ``~key_padding_mask[:, None, None, :]``.)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        alibi: ALiBi | None = None,
        attention: str = "full",
        window: int | None = None,
    ) -> None:
        super().__init__()
        if attention not in ("full", "window", "linear"):
            raise ValueError(
                f"MultiHeadAttention: attention must be 'full', 'window' or 'linear', "
                f"got {attention!r}"
            )
        if attention == "window" and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(
                f"MultiHeadAttention: attention='window' needs window >= 1, got {window!r}"
            )
        if attention == "linear" and alibi is not None:
            raise ValueError("MultiHeadAttention: ALiBi cannot be combined with linear attention")
        for name, value in (("d_model", d_model), ("n_heads", n_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"MultiHeadAttention: {name} must be a positive int, got {value!r}"
                )
        if d_model % n_heads:
            raise ValueError(
                f"MultiHeadAttention: n_heads={n_heads} must divide d_model={d_model} "
                f"(d_k = d_model / n_heads)"
            )
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads <= 0:
            raise ValueError(
                f"MultiHeadAttention: n_kv_heads must be a positive int, got {n_kv_heads!r}"
            )
        if n_heads % n_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: n_heads={n_heads} must be a multiple of "
                f"n_kv_heads={n_kv_heads}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be in [0, 1), got {dropout!r}")
        if rope is not None and alibi is not None:
            raise ValueError("MultiHeadAttention: use rope or alibi, not both")
        if alibi is not None and alibi.n_heads != n_heads:
            raise ValueError(
                f"MultiHeadAttention: alibi has {alibi.n_heads} slopes, expected n_heads={n_heads}"
            )
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.d_head = d_model // n_heads
        if rope is not None and rope.dim != self.d_head:
            raise ValueError(
                f"MultiHeadAttention: rope.dim={rope.dim} must equal d_head={self.d_head}"
            )
        self.dropout = dropout
        self.rope = rope
        self.alibi = alibi
        self.attention = attention  # for self-attention; cross-attention is always full
        self.window = window
        self.in_proj = Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)

    def _project(self, x: Tensor, context: Tensor | None):
        """Q from x; K, V from x (self-attention) or from context (cross-attention)."""
        q_width = self.n_heads * self.d_head
        kv_width = self.n_kv_heads * self.d_head
        if context is None:
            qkv = self.in_proj(x)  # (B, N, (H + 2 H_kv) d_head)
            return qkv.split([q_width, kv_width, kv_width], dim=-1)
        return (linear(x, *self._q_params()), *self._kv(context).split([kv_width, kv_width], -1))

    def _split_heads(self, t: Tensor, n_heads: int) -> Tensor:
        b, n, _ = t.shape
        return t.view(b, n, n_heads, self.d_head).transpose(1, 2)  # (B, heads, N, d_head)

    def _check(self, x, context, mask, positions, context_positions):
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (B, N, d_model={self.d_model}), got {got}")
        if context is not None:
            if not isinstance(context, Tensor) or context.dim() != 3:
                got = (
                    tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
                )
                raise ValueError(f"context must have shape (B, M, d_model), got {got}")
            if context.shape[0] != x.shape[0] or context.shape[-1] != self.d_model:
                raise ValueError(
                    f"context must have shape (B={x.shape[0]}, M, d_model={self.d_model}), "
                    f"got {tuple(context.shape)}"
                )
        for name, p, length in (
            ("positions", positions, x.shape[1]),
            ("context_positions", context_positions, None if context is None else context.shape[1]),
        ):
            if p is None:
                continue
            if p.dtype in (torch.bool,) or p.is_floating_point():
                raise TypeError(f"{name} must hold integer positions, got dtype {p.dtype}")
            if p.dim() not in (1, 2) or (length is not None and p.shape[-1] != length):
                raise ValueError(
                    f"{name} must have shape (N,) or (B, N) with N={length}, got {tuple(p.shape)}"
                )

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        positions: Tensor | None = None,
        context_positions: Tensor | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, N, d_model) to itself, or to ``context`` (B, M, d_model).

        Args:
            mask: bool (True = may attend) or additive float, broadcastable to (B, H, N, M),
                where M counts the cached keys too when a cache is used.
            is_causal: the look-ahead mask, bottom-right aligned (queries are the last N keys).
            positions: absolute positions of x's tokens, (N,) or (B, N) integers, for RoPE and
                ALiBi; default ``cache.length + arange(N)``.
            context_positions: positions of the context's tokens (cross-attention with ALiBi).
            cache: a :class:`KVCache`. Self-attention appends this step's keys and values and
                attends over all of them; cross-attention fills it once and then reuses it.
            return_weights: also return the attention weights (B, H, N, M).

        Returns:
            ``out`` (B, N, d_model), or ``(out, weights)``.
        """
        self._check(x, context, mask, positions, context_positions)
        b, n, _ = x.shape
        past = 0 if cache is None or context is not None else cache.length
        if self.rope is None and self.alibi is None:
            positions = None  # only RoPE and ALiBi read positions (the caches keep them for ALiBi)
        elif positions is None:
            positions = torch.arange(past, past + n, device=x.device)
        if positions is not None:
            positions = positions.expand(b, n)  # (B, N)

        cross_cached = context is not None and cache is not None and cache.length > 0
        if cross_cached:
            q = self._split_heads(linear(x, *self._q_params()), self.n_heads)
            k, v, key_positions = (
                cache.k.narrow(2, 0, cache.length),
                cache.v.narrow(2, 0, cache.length),
                None,
            )
        else:
            q, k, v = self._project(x, context)
            q = self._split_heads(q, self.n_heads)  # (B, H, N, d_head)
            k = self._split_heads(k, self.n_kv_heads)  # (B, H_kv, M, d_head)
            v = self._split_heads(v, self.n_kv_heads)  # (B, H_kv, M, d_head)
            key_positions = positions if context is None else context_positions
            if self.rope is not None and context is None:
                q = self.rope(q, positions)
                k = self.rope(k, positions)
            if self.attention != "full" and context is None:
                out, weights = self._efficient(
                    q, k, v, mask, is_causal, positions, cache, return_weights
                )
                out = self.out_proj(out.transpose(1, 2).reshape(b, n, self.d_model))
                return (out, weights) if return_weights else out
            if cache is not None:
                k, v, cached_positions = cache.append(k, v, key_positions)
                if context is None and key_positions is not None:
                    key_positions = cached_positions

        k, v = self._repeat_kv(k), self._repeat_kv(v)  # (B, H, M, d_head)

        if self.alibi is not None and context is None:
            bias = self.alibi.bias(positions, key_positions).to(q.dtype)  # (B, H, N, M)
            if mask is None:
                mask = bias
            elif mask.dtype == torch.bool:
                mask = bias.masked_fill(~mask, float("-inf"))
            else:
                mask = mask + bias

        _check_mask(mask, q, k)  # q, k and v are this module's own; the mask is the caller's
        dropout = self.dropout if self.training else 0.0
        result = _attention(q, k, v, mask, is_causal, dropout, return_weights)
        out, weights = result if return_weights else (result, None)
        out = out.transpose(1, 2).reshape(b, n, self.d_model)  # (B, N, H d_head)
        out = self.out_proj(out)  # W^O
        return (out, weights) if return_weights else out

    def _repeat_kv(self, t: Tensor) -> Tensor:
        """(B, H_kv, M, d) -> (B, H, M, d): each key/value head serves n_heads / n_kv_heads."""
        if self.n_kv_heads == self.n_heads:
            return t
        return t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)

    def _key_valid(self, mask: Tensor | None, n: int) -> Tensor | None:
        """The (B, M) real-token mask inside a key padding mask (B, 1, 1, M); the window and
        linear paths take no other kind of mask."""
        if mask is None:
            return None
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
            raise ValueError(
                f"attention={self.attention!r} takes a key padding mask of shape (B, 1, 1, M), "
                f"bool; got {tuple(mask.shape)} {mask.dtype}"
            )
        return mask[:, 0, 0, :]

    def _efficient(self, q, k, v, mask, is_causal, positions, cache, return_weights):
        """Self-attention with attention='window' or 'linear'; returns (out (B,H,N,d), weights)."""
        n = q.shape[2]
        valid = self._key_valid(mask, n)
        dropout = self.dropout if self.training else 0.0
        if self.attention == "linear":
            if cache is not None and not isinstance(cache, LinearAttentionState):
                raise TypeError("attention='linear' decodes with a LinearAttentionState cache")
            if cache is not None and return_weights:
                raise ValueError("return_weights is not available with a linear-attention cache")
            if valid is not None:
                valid = valid[:, -n:]
            k, v = self._repeat_kv(k), self._repeat_kv(v)
            if return_weights:
                weights = linear_attention_weights(q, k, causal=is_causal, key_valid=valid)
                return weights @ v, weights
            return linear_attention(q, k, v, causal=is_causal, key_valid=valid, state=cache), None

        slopes = None if self.alibi is None else self.alibi.slopes
        if cache is not None and not isinstance(cache, RollingKVCache):
            raise TypeError("attention='window' decodes with a RollingKVCache")
        if cache is not None and cache.length > 0:  # a decoding step: attend over the ring buffer
            if n != 1:
                raise ValueError(
                    f"window attention with a filled cache decodes one position at a time, got {n}"
                )
            new_valid = (
                torch.ones_like(q[:, 0, :, 0], dtype=torch.bool)
                if valid is None
                else (valid[:, -1:])
            )
            cache.append(k, v, positions, new_valid)
            keys_mask = cache.valid[:, None, None, :]  # (B, 1, 1, w)
            if slopes is not None:
                bias = self.alibi.bias(positions, cache.positions).to(q.dtype)  # (B, H, 1, w)
                keys_mask = bias.masked_fill(~keys_mask, float("-inf"))
            result = scaled_dot_product_attention(
                q,
                self._repeat_kv(cache.k),
                self._repeat_kv(cache.v),
                keys_mask,
                dropout_p=dropout,
                return_weights=return_weights,
            )
            return result if return_weights else (result, None)

        if valid is not None:
            valid = valid[:, -n:]
        if cache is not None:  # the prompt: fill the ring buffer with its last w positions
            fill = torch.ones_like(q[:, 0, :, 0], dtype=torch.bool) if valid is None else valid
            cache.append(k, v, positions, fill)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        if return_weights:  # the reference: the math path under a band mask
            band = window_mask(n, window=self.window, causal=is_causal, device=q.device)
            full_mask = band if valid is None else band & valid[:, None, None, :]
            if slopes is not None:
                bias = self.alibi.bias(positions, positions).to(q.dtype)
                full_mask = bias.masked_fill(~full_mask, float("-inf"))
            return scaled_dot_product_attention(
                q, k, v, full_mask, dropout_p=dropout, return_weights=True
            )
        out = sliding_window_attention(
            q,
            k,
            v,
            self.window,
            causal=is_causal,
            key_valid=valid,
            positions=positions,
            alibi_slopes=slopes,
            dropout_p=dropout,
        )
        return out, None

    def _q_params(self) -> tuple[Tensor, Tensor | None]:
        """W^Q and its bias: the first n_heads * d_head rows of in_proj."""
        q_width = self.n_heads * self.d_head
        b = self.in_proj.bias
        return self.in_proj.weight[:q_width], None if b is None else b[:q_width]

    def _kv(self, context: Tensor) -> Tensor:
        """K and V of the context in one matmul: the remaining rows of in_proj."""
        q_width = self.n_heads * self.d_head
        b = self.in_proj.bias
        return linear(context, self.in_proj.weight[q_width:], None if b is None else b[q_width:])
