"""The parts the three families share: the embeddings, the encoder stack, the decoder stack and
its caches, and the initialisation.

::

    Embeddings   ids -> token embedding (x sqrt(D) in the paper) + positions (+ token types)
    Encoder      [EncoderLayer] x L (+ a final norm for Pre-LN)
    Decoder      [DecoderLayer] x L (+ a final norm for Pre-LN); new_cache() for decoding
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.backends import LinearAttentionState
from attnkit.caches import KVCache, RollingKVCache
from attnkit.config import ModelConfig
from attnkit.layers import DecoderLayer, EncoderLayer, make_norm
from attnkit.position import LearnedPositions, SinusoidalPositions

__all__ = ["Decoder", "DecoderCache", "Embeddings", "Encoder", "init_weights"]


class Embeddings(nn.Module):
    r"""Token embedding (times sqrt(d_model) in the paper) + absolute position + token type,
    then an optional norm (BERT) and dropout (the paper: "we apply dropout to the sums of the
    embeddings and the positional encodings")."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions: nn.Module | None = None
        if cfg.position == "sinusoidal":
            self.positions = SinusoidalPositions(cfg.max_len, cfg.d_model)
        elif cfg.position == "learned":
            self.positions = LearnedPositions(cfg.max_len, cfg.d_model)
        self.token_types = (
            nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        )
        self.norm = make_norm(cfg) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0

    def forward(
        self, ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        x = self.tokens(ids)  # (B, N, D)
        if self.scale != 1.0:
            x = x * self.scale
        if isinstance(self.positions, LearnedPositions):
            # the models make positions themselves, in range by construction (their lengths
            # are checked against max_len): read the table without the module's own checks
            x = x + self.positions.embedding(positions)
        elif self.positions is not None:
            x = x + self.positions(positions)
        if self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            x = x + self.token_types(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x) if self.training and self.dropout.p > 0 else x


class Encoder(nn.Module):
    """A stack of encoder layers; Pre-LN stacks end with a final norm, Post-LN stacks do not."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg) if cfg.norm == "pre" else None

    def forward(self, x, *, mask=None, positions=None, return_attention=False, rows=None):
        """x (B, N, D), or with ``rows`` (``attnkit.varlen.Rows``) the real rows (1, T, D)
        of a padded batch; returns (x, each layer's attention weights or None)."""
        attentions = []
        for layer in self.layers:
            x, weights = layer(
                x, mask=mask, positions=positions, return_weights=return_attention, rows=rows
            )
            attentions.append(weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, attentions


@dataclass
class DecoderCache:
    """The KV caches of a decoder stack: one per layer for self-attention, and (encoder-decoder
    only) one per layer for cross-attention, filled once from the encoder output."""

    self_attn: list[KVCache]
    cross_attn: list[KVCache] | None = None

    @property
    def length(self) -> int:
        """How many positions are cached."""
        return self.self_attn[0].length

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in every cache (beam search)."""
        for cache in self.self_attn + (self.cross_attn or []):
            cache.reorder(index)

    def ahead(self, count: int) -> list:
        """What :meth:`rewind` needs kept, per layer, before ``count`` more positions are
        written (the ring slots they overwrite)."""
        return [cache.ahead(count) for cache in self.self_attn]

    def rewind(self, count: int, saved: list | None = None) -> None:
        """Forget the last ``count`` positions in every layer (``saved``: :meth:`ahead`'s, taken
        before they were written; None where every layer keeps every position)."""
        saved = [None] * len(self.self_attn) if saved is None else saved
        for cache, kept in zip(self.self_attn, saved, strict=True):
            cache.rewind(count, kept)


class Decoder(nn.Module):
    """A stack of decoder layers (with or without cross-attention) and, for Pre-LN, a final norm."""

    def __init__(self, cfg: ModelConfig, *, cross_attention: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cross_attention=cross_attention, layer=i) for i in range(cfg.n_layers)
        )
        self.norm = make_norm(cfg) if cfg.norm == "pre" else None

    def new_cache(
        self, batch_size: int, max_len: int, *, dtype=torch.float32, device=None, memory_len=None
    ) -> DecoderCache:
        """Per-layer caches: preallocated keys/values (full attention), a ring buffer of the
        last ``window`` positions (window attention) or the running sums (linear attention).
        Cross-attention (memory_len given) always caches the whole source."""
        cfg = self.cfg
        kv = dict(dtype=dtype, device=device)

        def full(length):
            return [
                KVCache(batch_size, cfg.kv_heads, length, cfg.d_head, **kv) for _ in self.layers
            ]

        if cfg.attention == "window":  # each layer's own: a window, or all (global_every)
            self_caches = [
                RollingKVCache(batch_size, cfg.kv_heads, window, cfg.d_head, **kv)
                if kind == "window"
                else KVCache(batch_size, cfg.kv_heads, max_len, cfg.d_head, **kv)
                for kind, window, _ in (cfg.layer_attention(i) for i in range(len(self.layers)))
            ]
        elif cfg.attention == "linear":
            self_caches = [
                LinearAttentionState(batch_size, cfg.kv_heads, cfg.d_head, device=device)
                for _ in self.layers
            ]
        else:
            self_caches = full(max_len)
        return DecoderCache(self_caches, full(memory_len) if memory_len else None)

    def forward(
        self,
        x,
        memory=None,
        *,
        self_mask=None,
        memory_mask=None,
        positions=None,
        cache: DecoderCache | None = None,
        return_attention=False,
        rows=None,
        memory_rows=None,
    ):
        """x (B, N, D) and memory (B, M, D), or with ``rows`` (and ``memory_rows``) their real
        rows (1, T, D) (``attnkit.varlen.Rows``); returns (x, self- and cross-attention
        weights per layer, None unless asked)."""
        self_attentions, cross_attentions = [], []
        for i, layer in enumerate(self.layers):
            x, self_w, cross_w = layer(
                x,
                memory,
                self_mask=self_mask,
                memory_mask=memory_mask,
                positions=positions,
                cache=None if cache is None else cache.self_attn[i],
                cross_cache=None
                if cache is None or cache.cross_attn is None
                else cache.cross_attn[i],
                return_weights=return_attention,
                rows=rows,
                memory_rows=memory_rows,
            )
            self_attentions.append(self_w)
            cross_attentions.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)
        return x, self_attentions, cross_attentions


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """Normal(0, 0.02) for linear and embedding weights (GPT-2, BERT), zero biases; with scaled
    embeddings (the paper) the token table gets Normal(0, d_model^-0.5) so that
    sqrt(d_model) * embedding has unit scale."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
    if cfg.scale_embeddings:
        for m in module.modules():
            if isinstance(m, Embeddings):
                nn.init.normal_(m.tokens.weight, std=cfg.d_model**-0.5)
