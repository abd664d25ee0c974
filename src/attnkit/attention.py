r"""Scaled dot-product attention and multi-head attention.

The whole of attention is one line of the paper (Vaswani et al., 2017, eq. 1)::

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + mask) V

- ``scaled_dot_product_attention``: that line, checked, with the explicit math path (which can
  hand back the weights) and torch's fused kernel (``backends.attend``).
- ``causal_mask`` and ``padding_mask`` (``masks``): **True means "may attend"** everywhere.
- ``MultiHeadAttention``: h heads of width d_k = d_v = d_model / h, concatenated and mixed by
  W^O; self- or cross-attention; grouped-query attention; RoPE / ALiBi; a cache; a backend
  (full, sliding-window or linear attention) chosen when it is built.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.backends import BACKENDS, attend, attention_implementation
from attnkit.caches import Keys, KVCache
from attnkit.masks import causal_mask, padding_mask
from attnkit.position import ALiBi, RotaryEmbedding
from attnkit.varlen import Rows

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "causal_mask",
    "padding_mask",
    "scaled_dot_product_attention",
]


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
    implementation: str = "sdpa",
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
        implementation: a name of ``backends.ATTENTION``: torch's fused ``"sdpa"`` (the
            default), the explicit ``"math"`` path, or one a speed lever registers. Weights
            come from the math path whatever the name.

    Returns:
        ``out`` (..., N, d_v), or ``(out, weights)`` with ``return_weights=True``. Each row of
        ``weights`` sums to 1; a query with nothing to attend to (its mask row all False or all
        ``-inf``) gets a zero row and a zero output, never NaN, and finite gradients.
    """
    checks.attention_inputs(q, k, v, mask, dropout_p)
    attention_implementation(implementation, "implementation")  # a registered name
    out, weights = attend(
        q, k, v, mask, is_causal, dropout_p, return_weights, scale, implementation
    )
    return (out, weights) if return_weights else out


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
    - Positions inside attention: ``rope`` rotates q and k by their positions; ``alibi`` adds
      ``-slope_h * |i - j|`` to the scores.
    - ``attention``: the backend, ``"full"``, ``"window"`` (with ``window``) or ``"linear"``.
    - A cache (``caches.KVCache``, ``caches.RollingKVCache``, ``backends.LinearAttentionState``)
      keeps earlier keys and values for incremental decoding.
    - ``attn_implementation``: softmax attention's implementation by name, one of
      ``backends.ATTENTION``: torch's ``"sdpa"`` (the default), ``"math"``, or one a speed
      lever registered (``accel.prepare`` chooses ``"attnkit"`` for training).

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
        qkv_bias: bool | None = None,
        dropout: float = 0.0,
        rope: RotaryEmbedding | None = None,
        alibi: ALiBi | None = None,
        attention: str = "full",
        window: int | None = None,
        d_head: int | None = None,
        qk_norm_eps: float | None = None,
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        attention_implementation(attn_implementation)  # a known name
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_module(d_model, n_heads, n_kv_heads, dropout, rope, alibi, attention, window, d_head)
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head = d_model // n_heads if d_head is None else d_head
        self.dropout, self.rope, self.alibi = dropout, rope, alibi
        self.attention, self.window = attention, window
        backend = BACKENDS[attention]
        self.backend = partial(backend, window=window) if attention == "window" else backend
        self.attn_implementation = attn_implementation  # by name: backends.ATTENTION
        in_bias = bias if qkv_bias is None else qkv_bias  # Qwen2: on q, k and v alone
        self.in_proj = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.d_head, bias=in_bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        # QK-norm (Gemma 3): each query and key head RMS-normalised before RoPE
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(self.d_head, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(self.d_head, eps=qk_norm_eps)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        positions: Tensor | None = None,
        context_positions: Tensor | None = None,
        cache=None,
        return_weights: bool = False,
        rows: Rows | None = None,
        context_rows: Rows | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, N, d_model) to itself, or to ``context`` (B, M, d_model).

        Args:
            mask: bool (True = may attend) or additive float, broadcastable to (B, H, N, M),
                where M counts the cached keys too when a cache is used. Window and linear
                attention take a key padding mask (B, 1, 1, M) only.
            is_causal: the look-ahead mask, bottom-right aligned (queries are the last N keys).
            positions: absolute positions of x's tokens, (N,) or (B, N) integers, for RoPE and
                ALiBi; default ``cache.length + arange(N)``.
            context_positions: positions of the context's tokens (cross-attention).
            cache: self-attention adds this step's keys and values to it and attends over what
                it returns; cross-attention fills it once and then reuses it.
            return_weights: also return the attention weights (B, H, N, M).
            rows: x is (1, T, d_model), the real rows of a padded (B, N) batch that ``rows``
                describes (the variable-length layout, ``attnkit.varlen``), and so is the
                output; ``mask`` and ``positions`` are still the padded batch's.
                ``context_rows`` describes the context's rows likewise (cross-attention).
        """
        if rows is not None:
            return self._varlen(
                x, context, rows, context_rows, mask=mask, is_causal=is_causal,
                positions=positions, context_positions=context_positions,
                cache=cache, return_weights=return_weights,
            )  # fmt: skip
        self._check(x, context, mask, positions, context_positions)
        b, n, _ = x.shape
        cross = context is not None
        if not cross:
            positions = self._positions(positions, b, n, cache, x.device)
        if cross and cache is not None and cache.length:  # the source's keys, computed once
            q, k, v = self._norm_q(self._heads(self._project_q(x), self.n_heads)), None, None
        else:
            q, k, v = self.project(x, context)  # (B, H, N, d), (B, H_kv, M, d) twice
        out, weights = self.attend(
            q, k, v, mask=mask, is_causal=is_causal, positions=positions,
            context_positions=context_positions, cross=cross, cache=cache,
            return_weights=return_weights,
        )  # fmt: skip
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, -1))  # Concat(heads) W^O
        return (out, weights) if return_weights else out

    def _varlen(self, x, context, rows, context_rows, *, mask, is_causal, positions,
                context_positions, cache, return_weights) -> Tensor:  # fmt: skip
        """:meth:`forward` over packed real rows x (1, T, D) (context (1, T_src, D)).

        Where the layer's attention implementation has a variable-length form that
        takes these rows, and the attention is the plain softmax over equal heads, each
        sequence attends to its own rows as they lie (no padding computed). Otherwise q, k and
        v are scattered into the padded (B, H, N, d) layout (zeros at the padding), attention
        runs as usual with the batch's mask, and its output's real rows are gathered again.
        """
        cross = context is not None
        keys = context_rows if cross else rows
        if cache is not None or return_weights or keys is None or x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(
                "rows= takes x as (1, T, d_model) packed rows (and context_rows= with a "
                "context), with no cache and no attention weights"
            )
        packed = attention_implementation(self.attn_implementation).packed
        longest = max(rows.sequences.longest, keys.sequences.longest)
        if packed is not None and self._plain_softmax() and packed.takes(x, longest):
            return self._packed(packed, x, context, rows, keys, is_causal)
        if cross:  # (B, H, N, d) and twice (B, H_kv, M, d), zeros at the padding
            q, k, v = self.heads(
                rows.scatter(self._project_q(x)), keys.scatter(self._project_kv(context))
            )
        else:
            q, k, v = self.heads(rows.scatter(self.in_proj(x)))
        b, n = rows.batch, rows.length
        if not cross:
            positions = self._positions(positions, b, n, None, x.device)
        out, _ = self.attend(
            q, k, v, mask=mask, is_causal=is_causal, positions=positions,
            context_positions=context_positions, cross=cross, cache=None, return_weights=False,
        )  # fmt: skip
        heads = out.transpose(1, 2).reshape(b, n, -1)  # Concat(heads), (B, N, H d_head)
        return self.out_proj(rows.gather(heads))  # (1, T, D)

    def _plain_softmax(self) -> bool:
        """Whether this layer's attention is what a packed kernel computes: full softmax
        attention, no RoPE or ALiBi, as many key/value heads as query heads, no dropout."""
        return (
            self.attention == "full"
            and self.rope is None
            and self.alibi is None
            and self.q_norm is None
            and self.n_kv_heads == self.n_heads
            and (self.dropout == 0.0 or not self.training)
        )

    def _packed(self, packed, x: Tensor, context: Tensor | None, rows: Rows, keys: Rows,
                causal: bool) -> Tensor:  # fmt: skip
        """Attention over packed rows by ``packed`` (a ``backends.PackedAttention``): x
        (1, T, D) (context (1, T_src, D)) -> (1, T, D). The projections come out as the kernel
        reads them, [Q, K, V] as (T, 3, H, d), so its gradient comes back as one tensor."""
        heads = (self.n_heads, self.d_head)
        # squeeze(0), not x[0]: a view whose gradient is one too, where indexing's backward
        # writes the gradient into a new zero-filled (1, T, D) tensor, two passes a layer
        if context is None:
            qkv = self.in_proj(x.squeeze(0)).unflatten(-1, (3, *heads))  # (T, 3, H, d)
            out = packed.self_attention(qkv, rows.sequences, causal=causal)  # (T, H, d)
        else:
            q = self._project_q(x.squeeze(0)).unflatten(-1, heads)  # (T, H, d)
            kv = self._project_kv(context.squeeze(0)).unflatten(-1, (2, *heads))
            out = packed.attention(q, kv, rows.sequences, keys.sequences, causal=causal)
        return self.out_proj(out.flatten(1))[None]  # Concat(heads) W^O, (1, T, D)

    def attend(
        self,
        q,
        k,
        v,
        *,
        mask,
        is_causal,
        positions,
        context_positions,
        cross,
        cache,
        return_weights,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention itself over heads q (B, H, N, d) and k, v (B, H_kv, M, d) (None: the
        cross-attention cache holds them): RoPE, the cache, the backend. Returns out
        (B, H, N, d_head) and the weights (or None)."""
        if k is None:
            keys = cache.cached()
        else:
            if self.rope is not None and not cross:
                q, k = self.rope.rotate(q, k, positions=positions)
            valid = self._valid(mask, q.shape[2])
            keys = Keys(k, v, context_positions if cross else positions, valid)
            if cache is not None:
                keys = cache.update(keys)
        return self.backend(
            q,
            keys,  # H_kv heads: the backend lets each serve n_heads / n_kv_heads queries
            mask=None if self.attention != "full" else mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=return_weights,
            alibi=None if cross else self.alibi,
            positions=positions,
            implementation=self.attn_implementation,
        )  # (B, H, N, d_head)

    def project(self, x: Tensor, context: Tensor | None = None):
        """Q, K, V split into heads: q (B, H, N, d_head), k and v (B, H_kv, M, d_head); K and V
        from x (self-attention, one matmul with Q) or from the context (cross-attention)."""
        if context is None:
            return self.heads(self.in_proj(x))
        return self.heads(self._project_q(x), self._project_kv(context))

    def heads(self, qkv: Tensor, kv: Tensor | None = None):
        """Projections (B, N, width) -> q (B, H, N, d_head), k and v (B, H_kv, M, d_head): from
        ``qkv`` alone ([Q, K, V] of self-attention), or Q from ``qkv`` and [K, V] from ``kv``
        (cross-attention)."""
        q_width, kv_width = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if kv is None:
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        else:
            q, (k, v) = qkv, kv.split([kv_width, kv_width], dim=-1)
        q, k = self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self._heads(v, self.n_kv_heads)

    def _norm_q(self, q: Tensor) -> Tensor:
        return q if self.q_norm is None else self.q_norm(q)

    def _project_q(self, x: Tensor) -> Tensor:
        """x W^Q: the first n_heads * d_head rows of in_proj."""
        return self._project_rows(x, slice(None, self.n_heads * self.d_head))

    def _project_kv(self, context: Tensor) -> Tensor:
        """[context W^K, context W^V] in one matmul: the remaining rows of in_proj."""
        return self._project_rows(context, slice(self.n_heads * self.d_head, None))

    def _project_rows(self, x: Tensor, rows: slice) -> Tensor:
        """x W[rows]^T + b[rows] for some rows of in_proj. A layer that applies a slice of its
        rows itself (a ``rows(x, slice)`` method, as a swapped-in Linear with its own product
        has) does it; otherwise the weight's rows are sliced here."""
        if hasattr(self.in_proj, "rows"):
            return self.in_proj.rows(x, rows)
        bias = self.in_proj.bias
        return nn.functional.linear(
            x, self.in_proj.weight[rows], None if bias is None else bias[rows]
        )

    def _heads(self, t: Tensor, n_heads: int) -> Tensor:
        b, n, _ = t.shape
        return t.view(b, n, n_heads, self.d_head).transpose(1, 2)  # (B, heads, N, d_head)

    def _positions(self, positions, b, n, cache, device) -> Tensor | None:
        """(B, N) positions of x's tokens for RoPE and ALiBi (None when neither is used)."""
        if self.rope is None and self.alibi is None:
            return None
        if positions is None:
            past = 0 if cache is None else cache.length
            positions = torch.arange(past, past + n, device=device)
        return positions.expand(b, n)

    def _valid(self, mask: Tensor | None, n: int) -> Tensor | None:
        """Window and linear attention read key padding as (B, N) real-token flags of the new
        keys; full attention reads ``mask`` itself."""
        if self.attention == "full" or mask is None:
            return None
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
            raise ValueError(
                f"attention={self.attention!r} takes a key padding mask of shape (B, 1, 1, M), "
                f"bool; got {tuple(mask.shape)} {mask.dtype}"
            )
        return mask[:, 0, 0, -n:]

    def _check(self, x, context, mask, positions, context_positions) -> None:
        """Shapes only (no device synchronisation): the model checks ids and masks itself."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (B, N, d_model={self.d_model}), got {got}")
        if context is not None and (
            not isinstance(context, Tensor)
            or context.dim() != 3
            or context.shape[0] != x.shape[0]
            or context.shape[-1] != self.d_model
        ):
            got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
            raise ValueError(
                f"context must have shape (B={x.shape[0]}, M, d_model={self.d_model}), got {got}"
            )
        lengths = (x.shape[1], None if context is None else context.shape[1])
        pairs = zip(("positions", "context_positions"), (positions, context_positions), strict=True)
        for (name, p), length in zip(pairs, lengths, strict=True):
            if p is None:
                continue
            if p.dtype == torch.bool or p.is_floating_point():
                raise TypeError(f"{name} must hold integer positions, got dtype {p.dtype}")
            if p.dim() not in (1, 2) or (length is not None and p.shape[-1] != length):
                raise ValueError(
                    f"{name} must have shape (N,) or (B, N) with N={length}, got {tuple(p.shape)}"
                )


def _check_module(
    d_model, n_heads, n_kv_heads, dropout, rope, alibi, attention, window, d_head=None
) -> None:
    """What a directly built MultiHeadAttention needs (ModelConfig checks the same for models)."""
    where = "MultiHeadAttention"
    checks.one_of(f"{where}: attention", attention, ("full", "window", "linear"))
    if attention == "window" and (not checks.is_int(window) or window < 1):
        raise ValueError(f"{where}: attention='window' needs window >= 1, got {window!r}")
    if attention == "linear" and alibi is not None:
        raise ValueError(f"{where}: ALiBi cannot be combined with linear attention")
    checks.positive_int(f"{where}: d_model", d_model)
    checks.positive_int(f"{where}: n_heads", n_heads)
    if d_head is not None:
        checks.positive_int(f"{where}: d_head", d_head)
    elif d_model % n_heads:
        raise ValueError(
            f"{where}: n_heads={n_heads} must divide d_model={d_model} (d_k = d_model / n_heads)"
        )
    width = d_model // n_heads if d_head is None else d_head
    checks.positive_int(f"{where}: n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{where}: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}"
        )
    checks.number_in(f"{where}: dropout", dropout, 0.0, 1.0)
    if rope is not None and alibi is not None:
        raise ValueError(f"{where}: use rope or alibi, not both")
    if alibi is not None and alibi.n_heads != n_heads:
        raise ValueError(f"{where}: alibi has {alibi.n_heads} slopes, expected n_heads={n_heads}")
    if rope is not None and rope.dim > width:
        raise ValueError(f"{where}: rope.dim={rope.dim} must be at most d_head={width}")
