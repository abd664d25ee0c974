"""The parts every Transformer layer is built from: the feed-forward network, norms, and the
encoder and decoder layers in the paper's Post-LN order or the modern Pre-LN order.

::

    Post-LN (the paper)                      Pre-LN (GPT-2, Llama, most modern models)
    x -> Sublayer -> + -> LayerNorm ->       x -> LayerNorm -> Sublayer -> + ->
    |________________^                       |__________________________^

    EncoderLayer: self-attention, FFN              (2 sublayers)
    DecoderLayer: masked self-attention, cross-attention over the encoder output, FFN
                  (3 sublayers; without cross-attention for decoder-only models)
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.attention import MultiHeadAttention
from attnkit.config import ModelConfig
from attnkit.position import ALiBi, RotaryEmbedding
from attnkit.varlen import Rows

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LMHead",
    "MoEFeedForward",
    "count_parameters",
    "make_norm",
]


class FeedForward(nn.Module):
    r"""The position-wise feed-forward network (the paper's eq. 2), applied to each token alone::

        FFN(x) = max(0, x W_1 + b_1) W_2 + b_2                  activation="relu" (the paper)
        FFN(x) = GELU(x W_1 + b_1) W_2 + b_2                    activation="gelu" (BERT, GPT-2)
        FFN(x) = (SiLU(x W_gate) * (x W_up)) W_down             activation="swiglu" (Llama)
        FFN(x) = (GELU(x W_gate) * (x W_up)) W_down             activation="geglu" (Gemma)

    ``up`` is W_1 (d_model -> d_ff), ``down`` is W_2 (d_ff -> d_model), ``gate`` exists only for
    the gated ones (SwiGLU, GeGLU).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        *,
        bias: bool = True,
        gelu_approximation: str = "none",
    ) -> None:
        super().__init__()
        if activation not in ("relu", "gelu", "swiglu", "geglu"):
            raise ValueError(
                "FeedForward: activation must be 'relu', 'gelu', 'swiglu' or 'geglu', "
                f"got {activation!r}"
            )
        self.activation = activation
        self.gelu_approximation = gelu_approximation
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        gated = activation in ("swiglu", "geglu")
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "geglu":
            gate = F.gelu(self.gate(x), approximate=self.gelu_approximation)
            hidden = gate * self.up(x)  # (B, N, d_ff)
        elif self.gate is not None:
            hidden = F.silu(self.gate(x)) * self.up(x)  # (B, N, d_ff)
        elif self.activation == "gelu":
            hidden = F.gelu(self.up(x), approximate=self.gelu_approximation)
        else:
            hidden = F.relu(self.up(x))
        return self.down(hidden)  # (B, N, d_model)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (the paper) or RMSNorm (Llama): ``x / rms(x) * g``, no mean, no bias."""
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def _attention(cfg: ModelConfig, positional: bool = True, layer: int = 0) -> MultiHeadAttention:
    """Multi-head attention as the config asks for layer ``layer`` (``cfg.layer_attention``);
    RoPE / ALiBi only where positions mean something (self-attention: queries and keys from one
    sequence)."""
    attention, window, theta = cfg.layer_attention(layer)
    rope = alibi = None
    if positional and cfg.position == "rope":
        rope = RotaryEmbedding(cfg.rotary_dim or cfg.d_head, base=theta, scaling=cfg.rope_scaling)
    if positional and cfg.position == "alibi":
        alibi = ALiBi(cfg.n_heads)
    return MultiHeadAttention(
        cfg.d_model,
        cfg.n_heads,
        cfg.n_kv_heads,
        bias=cfg.bias,
        qkv_bias=cfg.bias or cfg.qkv_bias,
        dropout=cfg.attention_dropout,
        rope=rope,
        alibi=alibi,
        # window and linear attention are for self-attention; cross-attention stays full
        attention=attention if positional else "full",
        window=window,
        d_head=cfg.head_dim,
        qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
        attn_implementation=cfg.attn_implementation,
    )


class MoEFeedForward(nn.Module):
    r"""A mixture of experts in place of the FFN (Shazeer et al., 2017; Switch, Mixtral).

    A router scores the ``n_experts`` experts for each token; the token goes to its ``top_k``
    best, and the output is their outputs weighted by the renormalised router probabilities::

        p = softmax(x W_router)          g = top-k of p, renormalised to sum to 1
        MoE(x) = sum_{e in top-k} g_e * FFN_e(x)

    Routing is dropless: every token is routed on its own, with no capacity limit, so a token's
    output never depends on the rest of the batch (causality and caching stay intact).
    After each forward, ``aux_loss`` holds the load-balancing loss (Switch Transformer, eq. 4,
    for top-k): ``n_experts * sum_e f_e * P_e``, with f_e the fraction of routing slots given
    to expert e and P_e its mean router probability; 1.0 when perfectly balanced.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(_dense_ffn(cfg) for _ in range(cfg.n_experts))
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (T, D): every token on its own
        probs = torch.softmax(self.router(flat).float(), dim=-1)  # (T, E)
        gates, chosen = probs.topk(self.top_k, dim=-1)  # (T, k)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            # In training every expert runs, on no tokens if none chose it, so that every
            # expert gets a gradient (zeros): data-parallel ranks must agree on which
            # parameters have one (FSDP reduce-scatters exactly those).
            if token.numel() or self.training:
                out.index_add_(0, token, expert(flat[token]) * gates[token, slot, None])
        n_experts = len(self.experts)
        share = F.one_hot(chosen, n_experts).float().sum(1).mean(0) / self.top_k  # f_e
        self.aux_loss = n_experts * (share * probs.mean(0)).sum()
        return out.view_as(x)


def _dense_ffn(cfg: ModelConfig) -> FeedForward:
    if cfg.d_ff == 0:  # an attention-only model: empty weights (torch warns it cannot init them)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            return FeedForward(cfg.d_model, 0, cfg.activation, bias=cfg.bias)
    return FeedForward(
        cfg.d_model,
        cfg.d_ff,
        cfg.activation,
        bias=cfg.bias,
        gelu_approximation=cfg.gelu_approximation,
    )


def _ffn(cfg: ModelConfig) -> nn.Module:
    return MoEFeedForward(cfg) if cfg.n_experts else _dense_ffn(cfg)


def _attend(attention: MultiHeadAttention, h: Tensor, return_weights: bool, **kwargs):
    """(output, weights or None) from a MultiHeadAttention call."""
    out = attention(h, return_weights=return_weights, **kwargs)
    return out if return_weights else (out, None)


class EncoderLayer(nn.Module):
    """Self-attention -> Add & Norm -> FFN -> Add & Norm (or the Pre-LN order)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.dropout = nn.Dropout(cfg.dropout)  # on each sublayer's output (section 5.4)
        self.self_attn = _attention(cfg)
        self.norm1 = make_norm(cfg)
        self.ffn = _ffn(cfg)
        self.norm2 = make_norm(cfg)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        return_weights: bool = False,
        rows: Rows | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, N, D), mask broadcastable to (B, H, N, N) (True = may attend); or, with
        ``rows``, x (1, T, D) the real rows of a padded batch (``attnkit.varlen``), which only
        attention needs to know.

        Returns (x, self-attention weights (B, H, N, N) or None).
        """
        kw = dict(mask=mask, positions=positions, rows=rows)
        if self.pre_norm:  # x + Sublayer(LN(x))
            a, weights = _attend(self.self_attn, self.norm1(x), return_weights, **kw)
            x = x + self.dropout(a)
            x = x + self.dropout(self.ffn(self.norm2(x)))
        else:  # LN(x + Sublayer(x)), the paper
            a, weights = _attend(self.self_attn, x, return_weights, **kw)
            x = self.norm1(x + self.dropout(a))
            x = self.norm2(x + self.dropout(self.ffn(x)))
        return x, weights


class DecoderParts(NamedTuple):
    """A decoder layer's parts by role, for code that runs the layer's step another way (a
    fused kernel) and must not depend on attribute names: the norm before self-attention, the
    self-attention, the norm before the feed-forward network, the feed-forward network, the
    cross-attention (None in a decoder-only layer), and the sandwich norms on the
    self-attention's and the FFN's outputs (None unless ``cfg.sandwich_norms``)."""

    attention_norm: nn.Module
    attention: MultiHeadAttention
    ffn_norm: nn.Module
    ffn: nn.Module
    cross_attention: MultiHeadAttention | None
    attention_out_norm: nn.Module | None = None
    ffn_out_norm: nn.Module | None = None


class DecoderLayer(nn.Module):
    """Masked self-attention -> Add & Norm -> [cross-attention -> Add & Norm] -> FFN -> Add & Norm.

    ``cross_attention=False`` drops the middle sublayer: the decoder-only (GPT) layer.
    """

    def parts(self) -> DecoderParts:
        """The layer's parts by role (:class:`DecoderParts`)."""
        return DecoderParts(
            self.norm1, self.self_attn, self.norm3, self.ffn, self.cross_attn,
            self.attn_out_norm, self.ffn_out_norm,
        )  # fmt: skip

    def __init__(self, cfg: ModelConfig, *, cross_attention: bool = True, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.dropout = nn.Dropout(cfg.dropout)
        self.self_attn = _attention(cfg, layer=layer)
        self.norm1 = make_norm(cfg)
        self.cross_attn = _attention(cfg, positional=False) if cross_attention else None
        self.norm2 = make_norm(cfg) if cross_attention else None
        self.ffn = _ffn(cfg)
        self.norm3 = make_norm(cfg)
        # sandwich norms (Gemma): each sublayer's output is normalised before the residual add
        self.attn_out_norm = make_norm(cfg) if cfg.sandwich_norms else None
        self.ffn_out_norm = make_norm(cfg) if cfg.sandwich_norms else None

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache=None,
        cross_cache=None,
        return_weights: bool = False,
        rows: Rows | None = None,
        memory_rows: Rows | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, N, D); memory (B, M, D), the encoder output (needed iff the layer has
        cross-attention). The self-attention is causal (bottom-right aligned with a cache);
        ``self_mask`` adds key padding; ``memory_mask`` masks the source's padding. With
        ``rows`` (and ``memory_rows``), x (and memory) are the real rows of padded batches,
        (1, T, D) (``attnkit.varlen``).

        Returns (x, self-attention weights, cross-attention weights), weights None unless asked.
        """
        if (memory is None) != (self.cross_attn is None):
            raise ValueError(
                "DecoderLayer: memory (the encoder output) must be given exactly when the layer "
                f"has cross-attention (cross_attention={self.cross_attn is not None})"
            )
        masked = dict(mask=self_mask, is_causal=True, positions=positions, cache=cache, rows=rows)
        cross = dict(
            context=memory, mask=memory_mask, cache=cross_cache, rows=rows, context_rows=memory_rows
        )
        cross_weights = None
        if self.pre_norm:  # x + Sublayer(LN(x)); with sandwich norms x + LN(Sublayer(LN(x)))
            a, self_weights = _attend(self.self_attn, self.norm1(x), return_weights, **masked)
            if self.attn_out_norm is not None:
                a = self.attn_out_norm(a)
            x = x + self.dropout(a)
            if self.cross_attn is not None:
                c, cross_weights = _attend(self.cross_attn, self.norm2(x), return_weights, **cross)
                x = x + self.dropout(c)
            f = self.ffn(self.norm3(x))
            if self.ffn_out_norm is not None:
                f = self.ffn_out_norm(f)
            x = x + self.dropout(f)
        else:  # LN(x + Sublayer(x)), the paper
            a, self_weights = _attend(self.self_attn, x, return_weights, **masked)
            x = self.norm1(x + self.dropout(a))
            if self.cross_attn is not None:
                c, cross_weights = _attend(self.cross_attn, x, return_weights, **cross)
                x = self.norm2(x + self.dropout(c))
            x = self.norm3(x + self.dropout(self.ffn(x)))
        return x, self_weights, cross_weights


class LMHead(nn.Linear):
    """The output layer: logits = h W^T over the vocabulary (before the paper's softmax).

    ``loss`` is the training objective on top of it. (``attnkit.accel.fuse_lm_loss`` swaps in
    a version that never holds the (tokens x V) logits; the value is the same.)
    """

    def loss(self, hidden, targets, *, ignore_index: int = -100, smoothing: float = 0.0):
        """Mean cross-entropy of ``self(hidden)`` against ``targets`` over the targets that are
        not ``ignore_index``, with label smoothing ``smoothing``; 0 when there are none."""
        logits = self(hidden).flatten(0, -2).float()  # (T, V)
        flat = targets.reshape(-1)  # (T,)
        count = (flat != ignore_index).sum().clamp(min=1)
        total = F.cross_entropy(
            logits, flat, ignore_index=ignore_index, label_smoothing=smoothing, reduction="sum"
        )
        return total / count


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
