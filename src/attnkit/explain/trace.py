"""Every number inside one attention head, for any model and any input.

``trace_attention(model, input_ids, layer=L, head=H)`` runs the model once, catches the input of
layer L's self-attention, and recomputes head H step by step, as the notes teach it::

    Q = x W_Q,  K = x W_K,  V = x W_V          (then RoPE, if the model uses it)
    scores  = Q K^T                             (N, M)
    scaled  = scores / sqrt(d_k)
    masked  = scaled + mask (+ ALiBi bias)      (-inf where a key may not be seen)
    weights = softmax(masked)                   (each row sums to 1)
    output  = weights V                         (row i: sum_j weights[i, j] * V[j])

The trace also keeps the weights the model itself returned for that head, so that anyone (and
the tests) can check that the step-by-step numbers are the model's numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.tables import format_table

__all__ = ["AttentionTrace", "format_trace", "trace_attention"]


@dataclass
class AttentionTrace:
    """One head's attention over one sequence, every intermediate a (rows, columns) tensor."""

    tokens: list[str]
    layer: int
    head: int
    d_k: int
    causal: bool
    q: Tensor  # (N, d_k)
    k: Tensor  # (M, d_k)
    v: Tensor  # (M, d_v)
    scores: Tensor  # (N, M) = q k^T
    scaled: Tensor  # (N, M) = scores / sqrt(d_k)
    mask: Tensor  # (N, M): 0 where allowed, -inf where blocked
    bias: Tensor | None  # (N, M): ALiBi's -slope * |i - j|, when the model uses ALiBi
    weights: Tensor  # (N, M) = softmax(scaled + mask (+ bias))
    output: Tensor  # (N, d_v) = weights v
    model_weights: Tensor  # (N, M): what the model's own forward returned for this head


def _stack(model, stack: str):
    """The list of layers whose self-attention is traced, and whether it is causal."""
    family = getattr(model, "family", None)
    if hasattr(model, "classifier") and hasattr(model, "encoder"):  # EncoderClassifier
        return model.encoder.encoder.layers, False, "encoder"
    if family == "encoder-only":
        return model.encoder.layers, False, "encoder"
    if family == "decoder-only":
        return model.decoder.layers, True, "decoder"
    if family == "encoder-decoder":
        if stack == "decoder":
            return model.decoder.layers, True, "decoder"
        return model.encoder.layers, False, "encoder"
    raise TypeError(f"trace_attention needs an attnkit model, got {type(model).__name__}")


@torch.no_grad()
def trace_attention(
    model,
    input_ids: Tensor,
    *,
    layer: int = 0,
    head: int = 0,
    tokens: list[str] | None = None,
    stack: str = "encoder",
    decoder_input_ids: Tensor | None = None,
) -> AttentionTrace:
    """Trace head ``head`` of layer ``layer``'s self-attention over ``input_ids`` (1, N).

    For an encoder-decoder, ``stack="encoder"`` traces the encoder over ``input_ids``;
    ``stack="decoder"`` traces the decoder's masked self-attention over ``decoder_input_ids``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, N), got {tuple(input_ids.shape)}")
    layers, causal, _ = _stack(model, stack)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}), got {layer}")
    mha = layers[layer].self_attn
    if not 0 <= head < mha.n_heads:
        raise ValueError(f"head must be in [0, {mha.n_heads}), got {head}")
    if mha.attention == "linear":
        raise ValueError("linear attention has no softmax to trace; trace a full or window model")

    caught = {}

    def catch(module, args, kwargs):
        caught["x"], caught["kwargs"] = args[0], kwargs

    handle = mha.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        model.eval()
        if getattr(model, "family", None) == "encoder-decoder":
            tgt = decoder_input_ids if decoder_input_ids is not None else input_ids[:, :1]
            _, attentions = model(input_ids, tgt, return_attention=True)
            attentions = attentions["decoder" if stack == "decoder" else "encoder"]
        else:
            _, attentions = model(input_ids, return_attention=True)
    finally:
        handle.remove()

    x, kwargs = caught["x"], caught["kwargs"]
    n = x.shape[1]
    q, k, v = mha.project(x)  # (1, H, N, d_k), (1, H_kv, N, d_k), (1, H_kv, N, d_v)
    positions = kwargs.get("positions")
    if positions is None:
        positions = torch.arange(n)
    positions = positions.expand(1, n)
    if mha.rope is not None:
        q, k = mha.rope(q, positions), mha.rope(k, positions)
    kv_head = head // (mha.n_heads // mha.n_kv_heads)
    q_h, k_h, v_h = q[0, head], k[0, kv_head], v[0, kv_head]  # (N, d_k), (N, d_k), (N, d_v)

    d_k = q_h.shape[-1]
    scores = q_h @ k_h.T  # (N, N)
    scaled = scores / math.sqrt(d_k)
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    if mha.attention == "window":
        d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        allowed &= ((d >= 0) & (d < mha.window)) if causal else (d.abs() < mha.window)
    if kwargs.get("mask") is not None:
        allowed &= kwargs["mask"][0, 0].expand(n, n).bool()
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))
    bias = None
    if mha.alibi is not None:
        bias = mha.alibi.bias(positions, positions)[0, head]  # (N, N)
    logits = scaled + mask + (0 if bias is None else bias)
    empty = ~allowed.any(-1, keepdim=True)
    weights = torch.softmax(logits.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return AttentionTrace(
        tokens=list(tokens) if tokens is not None else [str(int(t)) for t in input_ids[0]],
        layer=layer,
        head=head,
        d_k=d_k,
        causal=causal,
        q=q_h,
        k=k_h,
        v=v_h,
        scores=scores,
        scaled=scaled,
        mask=mask,
        bias=bias,
        weights=weights,
        output=weights @ v_h,
        model_weights=attentions[layer][0, head],
    )


# --------------------------------------------------------------------------------------------
# As text
# --------------------------------------------------------------------------------------------


def _matrix(title: str, rows: list[str], cols: list[str], values: Tensor, digits: int) -> str:
    def cell(x: float) -> str:
        if x == float("-inf"):
            return "-inf"
        return f"{x:.{digits}f}"

    body = [[r, *(cell(float(x)) for x in row)] for r, row in zip(rows, values, strict=True)]
    return f"{title}\n" + format_table(["", *cols], body)


def format_trace(trace: AttentionTrace, *, dims: int = 4, query: int | None = None) -> str:
    """The trace as text tables: Q, K, V (first ``dims`` dimensions), the scores, the scaled
    scores, the mask, the weights (each row sums to 1) and the output; then, for ``query``, which
    values it mixes and with what weight."""
    t = trace.tokens
    shown = min(dims, trace.d_k)
    dim_cols = [f"d{i}" for i in range(shown)] + (["..."] if trace.d_k > shown else [])

    def cut(m: Tensor) -> Tensor:
        return m[:, :shown]

    def with_dots(title, m):
        values = cut(m)
        text = _matrix(title, t, dim_cols[:shown], values, 3)
        return text + (
            f"\n(first {shown} of {m.shape[1]} dimensions)" if m.shape[1] > shown else ""
        )

    kind = "causal (decoder)" if trace.causal else "bidirectional (encoder)"
    parts = [
        f"layer {trace.layer}, head {trace.head}, d_k = {trace.d_k}, {kind} self-attention",
        "tokens: " + " | ".join(t),
        with_dots("Q = x W_Q", trace.q),
        with_dots("K = x W_K", trace.k),
        with_dots("V = x W_V", trace.v),
        _matrix("scores = Q K^T (row: query, column: key)", t, t, trace.scores, 3),
        _matrix(
            f"scaled = scores / sqrt(d_k) = scores / {math.sqrt(trace.d_k):.3f}",
            t,
            t,
            trace.scaled,
            3,
        ),
        _matrix(
            "mask (added to the scaled scores: 0 = may attend, -inf = blocked)", t, t, trace.mask, 0
        ),
    ]
    if trace.bias is not None:
        parts.append(_matrix("ALiBi bias (-slope * |i - j|)", t, t, trace.bias, 3))
    sums = trace.weights.sum(-1)
    parts.append(
        _matrix("weights = softmax(scaled + mask), row by row", t, t, trace.weights, 3)
        + "\nrow sums: "
        + " ".join(f"{float(s):.3f}" for s in sums)
    )
    parts.append(with_dots("output = weights V (row i = sum_j weights[i, j] * V[j])", trace.output))
    if query is not None:
        row = trace.weights[query]
        more = ", ..." if trace.d_k > shown else ""
        order = torch.argsort(row, descending=True)
        lines = [f"query {query} ({t[query]!r}) mixes the values:"]
        for j in order.tolist():
            if row[j] > 0:
                v = ", ".join(f"{float(x):.3f}" for x in trace.v[j, :shown]) + more
                lines.append(f"  {row[j]:.3f} x V[{j}:{t[j]}] = {row[j]:.3f} x [{v}]")
        out = ", ".join(f"{float(x):.3f}" for x in trace.output[query, :shown])
        lines.append(f"  = output[{query}:{t[query]}] = [{out}{more}]")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
