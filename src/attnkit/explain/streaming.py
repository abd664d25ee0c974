r"""Attention weights one block of queries at a time, so that a long text's heads can be read in
memory that grows with N, not with N².

``return_attention=True`` hands back every layer's (B, H, N, N) weights at once: 2.4 GB a layer
for SmolLM2's 9 heads over 8,192 tokens. :func:`stream_attention` runs the model once as usual
(its own fused attention, no weights kept) and, as each self-attention layer is reached, hands
its weights to a consumer a block of queries at a time::

    weights[h, i, j] = softmax_j(q_i^h k_j^h / sqrt(d_k) + mask_ij)    for i in one block

computed from the layer's own projections, QK-norm, RoPE or ALiBi, grouped heads and mask
(causal, a sliding window's band, padding). At most H x block x N weights exist at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from attnkit.backends import full_attention
from attnkit.caches import Keys
from attnkit.masks import combine

__all__ = ["attention_patterns", "pooled_attention", "self_attentions", "stream_attention"]

BLOCK = 256  # queries per block
VIEW = 1024  # the rows (and columns) a long text's pooled view keeps at most


def self_attentions(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules whose heads are read: a decoder's (a translator's decoder
    too), else an encoder's."""
    stack = getattr(model, "decoder", None) or getattr(model, "encoder", None)
    stack = getattr(stack, "encoder", stack)  # a classifier's encoder model holds the stack
    if stack is None or not hasattr(stack, "layers"):
        raise ValueError(f"{type(model).__name__} has no attention stack")
    return [layer.self_attn for layer in stack.layers]


def _allowed(rows: range, n: int, *, causal: bool, window: int | None) -> Tensor | None:
    """Which keys the queries ``rows`` may see, (b, n) bool (None: all of them)."""
    d = torch.tensor(rows)[:, None] - torch.arange(n)[None, :]  # query position - key position
    if window is not None:
        return (d >= 0) & (d < window) if causal else d.abs() < window
    return d >= 0 if causal else None


def _blocks(consume, block: int, layer: int, module: nn.Module, args, kwargs) -> None:
    """A forward pre-hook: the weights of ``module``'s call, block by block, to ``consume``."""
    (x,) = args
    n, rows = x.shape[1], kwargs.get("rows")  # one text's rows (the unpadded lever) are its own
    whole = rows is None or (rows.batch == 1 and rows.length == n)
    if x.shape[0] != 1 or kwargs.get("cache") is not None or not whole:
        raise ValueError("stream_attention: one text (1, N), read without a cache")
    positions = module._positions(kwargs.get("positions"), 1, n, None, x.device)
    q, k, v = module.project(x)  # (1, H, N, d), (1, H_kv, N, d) twice
    if module.rope is not None:
        q, k = module.rope.rotate(q, k, positions=positions)
    keys = Keys(k, v, positions, None)
    causal = bool(kwargs.get("is_causal", False))
    window = module.window if module.attention == "window" else None
    mask = kwargs.get("mask")  # True = may attend, (1 or B, 1 or H, 1 or N, N), or additive
    for start in range(0, n, block):
        rows = range(start, min(start + block, n))
        allowed = _allowed(rows, n, causal=causal, window=window)
        if mask is not None:
            allowed = combine(mask if mask.shape[-2] == 1 else mask[..., start : rows.stop, :],
                              allowed)  # fmt: skip
        _, weights = full_attention(
            q[:, :, start : rows.stop],
            keys,
            mask=allowed,
            return_weights=True,
            alibi=module.alibi,
            positions=None if positions is None else positions[:, start : rows.stop],
            implementation="math",
        )
        consume(layer, start, weights[0].float())  # (H, b, N)


def stream_attention(
    model: nn.Module,
    ids: Tensor,
    consume: Callable[[int, int, Tensor], None],
    *,
    block: int = BLOCK,
) -> None:
    """Run ``model`` over one text ``ids`` (1, N) and call ``consume(layer, start, weights)``
    for every block of ``block`` queries of every self-attention layer read (a decoder's, a
    translator's decoder's over the same text as its source, else an encoder's): ``weights``
    (H, b, N) float32, rows ``start`` to ``start + b`` of the layer's attention."""
    if model.cfg.attention == "linear":
        raise ValueError("stream_attention: linear attention has no weights to read")
    handles = [
        module.register_forward_pre_hook(partial(_blocks, consume, block, layer), with_kwargs=True)
        for layer, module in enumerate(self_attentions(model))
    ]
    try:
        with torch.no_grad():
            if hasattr(model, "encoder") and hasattr(model, "decoder"):
                model(ids, ids)
            elif hasattr(model, "hidden_states"):  # a decoder's layers, not its LM head
                model.hidden_states(ids)
            else:
                model(ids)
    finally:
        for handle in handles:
            handle.remove()


def attention_patterns(model: nn.Module, ids: Tensor, *, block: int = BLOCK) -> list[Tensor]:
    """Every read layer's attention over ``ids`` (1, N), one (H, N, N) float32 tensor per
    layer, built block by block (what ``return_attention=True`` gives, for a short text)."""
    patterns: list[Tensor] = []
    n = ids.shape[1]

    def keep(layer: int, start: int, weights: Tensor) -> None:
        if layer == len(patterns):
            patterns.append(torch.empty(weights.shape[0], n, n))
        patterns[layer][:, start : start + weights.shape[1]] = weights

    stream_attention(model, ids, keep, block=block)
    return patterns


def pooled_attention(
    model: nn.Module,
    ids: Tensor,
    *,
    size: int = VIEW,
    heads_averaged: bool = False,
    block: int = BLOCK,
) -> tuple[Tensor, int]:
    """A long text's attention at a size a page can draw: every read layer's weights over
    ``ids`` (1, N) pooled into cells of f = ceil(N / size) tokens a side, streamed.

    Returns (pooled, f), pooled (L, H, n, n) with n = ceil(N / f) (H = 1 with
    ``heads_averaged``): cell (I, J) is the mean, over the queries of bin I, of their summed
    weight on the keys of bin J, so each row still sums to 1. With f = 1 it is the attention
    itself. Memory: the pooled tensor and one block's weights."""
    n = ids.shape[1]
    f = -(-n // size)
    bins = -(-n // f)
    modules = self_attentions(model)
    heads = 1 if heads_averaged else modules[0].n_heads
    pooled = torch.zeros(len(modules), heads, bins, bins)

    def add(layer: int, start: int, weights: Tensor) -> None:
        if heads_averaged:
            weights = weights.mean(0, keepdim=True)
        h, b, _ = weights.shape
        keys = nn.functional.pad(weights, (0, bins * f - n)).view(h, b, bins, f).sum(-1)
        pooled[layer].index_add_(1, torch.arange(start, start + b) // f, keys)

    stream_attention(model, ids, add, block=block)
    per_bin = torch.bincount(torch.arange(n) // f, minlength=bins).float()
    return pooled / per_bin[:, None], f
