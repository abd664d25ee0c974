"""The three families, assembled from one set of parts.

::

    EncoderModel (BERT)      ids -> Embeddings -> [EncoderLayer] x L -> hidden (B, N, D)
    EncoderClassifier        EncoderModel -> [CLS] (or mean) read-out -> Linear -> logits (B, C)
    Transformer (the paper)  src -> Embeddings -> [EncoderLayer] x L -> memory
                             tgt -> Embeddings -> [DecoderLayer(memory)] x L -> Linear -> (B, T, V)
    DecoderLM (GPT)          ids -> Embeddings -> [DecoderLayer, no cross] x L -> Linear -> (B,N,V)

Model-level masks are (B, N) bool, True on real tokens (None: all real). Padding may sit on the
right or the left: absolute positions are counted from each row's first real token, so a padded
row gives its real tokens the same outputs as the row alone. Every forward takes
``return_attention``; with True it returns ``(output, attentions)``, one (B, H, N, M) tensor per
layer (for the encoder-decoder a dict with "encoder", "decoder" and "cross"), computed on the math
path; without it the fused path runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.attention import KVCache
from attnkit.config import ModelConfig
from attnkit.efficient import (
    Linear,
    LinearAttentionState,
    RollingKVCache,
    linear_cross_entropy,
)
from attnkit.generation import generate
from attnkit.layers import (
    DecoderLayer,
    EncoderLayer,
    MoEFeedForward,
    count_parameters,
    make_norm,
)
from attnkit.position import LearnedPositions, SinusoidalPositions, positions_from_mask

__all__ = [
    "DecoderCache",
    "DecoderLM",
    "EncoderClassifier",
    "EncoderModel",
    "Transformer",
    "shift_right",
]


# --------------------------------------------------------------------------------------------
# Input checks: every one runs before any computation
# --------------------------------------------------------------------------------------------


def _check_ids(name: str, ids: Tensor, cfg: ModelConfig) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (B, N), got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty, shape {tuple(ids.shape)}: need at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= cfg.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} contains token id {bad}, outside the vocabulary [0, {cfg.vocab_size})"
        )


def _check_mask(name: str, mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
    """A (B, N) padding mask as bool (True = real token); integer 0/1 masks are accepted."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a (B, N) bool tensor, got {type(mask).__name__}")
    if mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = real token), got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape (B, N) = {tuple(shape)}, matching the ids, "
            f"got {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        if int(mask.min()) < 0 or int(mask.max()) > 1:
            raise ValueError(f"{name} must be bool or 0/1, got values outside {{0, 1}}")
        mask = mask.bool()
    return mask


def _check_targets(targets: Tensor, ids: Tensor) -> None:
    """Targets for ``loss``: integer ids of the ids' shape (the id range is checked there)."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a tensor of token ids, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.shape != ids.shape:
        raise ValueError(
            f"targets must have the shape of the ids {tuple(ids.shape)}, got {tuple(targets.shape)}"
        )


def _check_length(cfg: ModelConfig, length: int, what: str) -> None:
    if cfg.position in ("learned", "sinusoidal") and length > cfg.max_len:
        raise ValueError(
            f"{what} has {length} positions but this model's {cfg.position} positions stop at "
            f"max_len={cfg.max_len}"
        )


def _positions(mask: Tensor | None, n: int, past: int, device: torch.device) -> Tensor:
    """Position ids of the last n tokens: (B, n) from a mask over past + n tokens, else (n,)."""
    if mask is None:
        return torch.arange(past, past + n, device=device)
    return positions_from_mask(mask)[:, past:]  # (B, n)


def _key_mask(mask: Tensor | None) -> Tensor | None:
    """(B, M) real-token mask -> (B, 1, 1, M) attention mask; None when nothing is padding (so
    the fused kernel can take its fastest path)."""
    if mask is None or bool(mask.all()):
        return None
    return mask[:, None, None, :]


def shift_right(tgt_ids: Tensor, bos_id: int) -> Tensor:
    """Teacher forcing's decoder input: ``[bos, y_1, ..., y_{T-1}]`` for targets ``[y_1 .. y_T]``.

    The decoder at step t sees y_<t and is trained to predict y_t.
    """
    if tgt_ids.dim() != 2:
        raise ValueError(f"tgt_ids must have shape (B, T), got {tuple(tgt_ids.shape)}")
    bos = torch.full_like(tgt_ids[:, :1], bos_id)
    return torch.cat([bos, tgt_ids[:, :-1]], dim=1)  # (B, T)


# --------------------------------------------------------------------------------------------
# Parts shared by the families
# --------------------------------------------------------------------------------------------


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

    def forward(self, x, *, mask=None, positions=None, return_attention=False):
        attentions = []
        for layer in self.layers:
            x, weights = layer(x, mask=mask, positions=positions, return_weights=return_attention)
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


class Decoder(nn.Module):
    """A stack of decoder layers (with or without cross-attention) and, for Pre-LN, a final norm."""

    def __init__(self, cfg: ModelConfig, *, cross_attention: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cross_attention=cross_attention) for _ in range(cfg.n_layers)
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

        if cfg.attention == "window":
            self_caches = [
                RollingKVCache(batch_size, cfg.kv_heads, cfg.window, cfg.d_head, **kv)
                for _ in self.layers
            ]
        elif cfg.attention == "linear":
            self_caches = [
                LinearAttentionState(batch_size, cfg.n_heads, cfg.d_head, device=device)
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
    ):
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


class _Model(nn.Module):
    def num_parameters(self) -> int:
        """Distinct parameters; a tied weight counts once."""
        return count_parameters(self)

    def moe_loss(self) -> Tensor | float:
        """The sum of every MoE layer's load-balancing loss from the last forward (0.0 without
        experts). The trainer adds it, times a small coefficient, to the task loss."""
        losses = [
            m.aux_loss
            for m in self.modules()
            if isinstance(m, MoEFeedForward) and m.aux_loss is not None
        ]
        return sum(losses) if losses else 0.0

    def save_pretrained(self, directory, *, tokenizer=None):
        """Write config.json + model.safetensors (+ tokenizer.json) atomically;
        ``attnkit.from_pretrained(directory)`` reads it back exactly."""
        from attnkit.interop.pretrained import save_pretrained  # interop builds on this module

        return save_pretrained(self, directory, tokenizer=tokenizer)


# --------------------------------------------------------------------------------------------
# Encoder-only
# --------------------------------------------------------------------------------------------


class EncoderModel(_Model):
    """BERT-style encoder: ``model(input_ids, attention_mask=None, token_type_ids=None)`` ->
    hidden states (B, N, d_model)."""

    family = "encoder-only"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.pooler else None
        init_weights(self, cfg)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_attention: bool = False,
    ):
        _check_ids("input_ids", input_ids, self.cfg)
        attention_mask = _check_mask("attention_mask", attention_mask, input_ids.shape)
        _check_length(self.cfg, input_ids.shape[1], "input_ids")
        if token_type_ids is not None:
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                    f"got {tuple(token_type_ids.shape)}"
                )
            if self.cfg.type_vocab_size == 0:
                raise ValueError("token_type_ids given but this model has type_vocab_size=0")
        positions = _positions(attention_mask, input_ids.shape[1], 0, input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        x, attentions = self.encoder(
            x,
            mask=_key_mask(attention_mask),
            positions=positions,
            return_attention=return_attention,
        )
        return (x, attentions) if return_attention else x

    def pool(self, hidden: Tensor) -> Tensor:
        """BERT's pooler on the first token: tanh(W h_0 + b) (requires cfg.pooler)."""
        if self.pooler is None:
            raise ValueError("this EncoderModel has no pooler (ModelConfig.pooler=False)")
        return torch.tanh(self.pooler(hidden[:, 0]))


class EncoderClassifier(_Model):
    """Classify a sequence: run the encoder, read out one vector, a linear layer -> (B, C).

    ``pooling="cls"`` reads the first real token (the ``[CLS]`` the tokenizer put in front;
    through BERT's pooler when the config has one); ``pooling="mean"`` averages the real tokens.
    ``labels`` optionally names the classes (``labels[c]`` for logit c); saved with the model.
    """

    family = "encoder-classifier"

    def __init__(
        self,
        cfg: ModelConfig,
        num_classes: int,
        *,
        pooling: str = "cls",
        labels: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        if labels is not None:
            labels = [str(label) for label in labels]
            if len(labels) != num_classes or len(set(labels)) != num_classes:
                raise ValueError(
                    f"labels must be {num_classes} distinct names (one per class), got {labels!r}"
                )
        self.cfg = cfg
        self.pooling = pooling
        self.labels = labels
        self.encoder = EncoderModel(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.d_model, num_classes)
        init_weights(self.classifier, cfg)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        return_attention: bool = False,
    ):
        result = self.encoder(
            input_ids, attention_mask, token_type_ids, return_attention=return_attention
        )
        hidden, attentions = result if return_attention else (result, None)
        mask = _check_mask("attention_mask", attention_mask, input_ids.shape)
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        if self.pooling == "cls":
            first = mask.int().argmax(dim=1)  # index of each row's first real token
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
            if self.encoder.pooler is not None:
                pooled = torch.tanh(self.encoder.pooler(pooled))
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)  # (B, N, 1)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        logits = self.classifier(self.dropout(pooled))  # (B, C)
        return (logits, attentions) if return_attention else logits


# --------------------------------------------------------------------------------------------
# Encoder-decoder
# --------------------------------------------------------------------------------------------


class Transformer(_Model):
    """The paper's encoder-decoder: ``model(src_ids, tgt_ids, src_mask=None, tgt_mask=None)`` ->
    logits (B, T, V).

    Teacher forcing: pass the target shifted right (``shift_right(targets, cfg.bos_id)``) as
    ``tgt_ids`` and train the logits against the unshifted targets. The decoder's
    self-attention is causal; its cross-attention sees only the real source tokens.
    With ``tie_embeddings`` source embedding = target embedding = output projection.
    """

    family = "encoder-decoder"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.src_embeddings = Embeddings(cfg)
        self.tgt_embeddings = self.src_embeddings if cfg.tie_embeddings else Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross_attention=True)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.src_embeddings.tokens.weight

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None, *, return_attention=False):
        """The encoder alone: memory (B, S, D) (and its attentions)."""
        _check_ids("src_ids", src_ids, self.cfg)
        src_mask = _check_mask("src_mask", src_mask, src_ids.shape)
        _check_length(self.cfg, src_ids.shape[1], "src_ids")
        positions = _positions(src_mask, src_ids.shape[1], 0, src_ids.device)
        x = self.src_embeddings(src_ids, positions)
        memory, attentions = self.encoder(
            x, mask=_key_mask(src_mask), positions=positions, return_attention=return_attention
        )
        return (memory, attentions) if return_attention else memory

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        return_attention: bool = False,
    ):
        """The decoder over an encoder output: logits (B, T, V).

        With a ``cache`` (from :meth:`new_cache`), ``tgt_ids`` are the next positions only and
        ``tgt_mask``, if given, covers all cached positions plus the new ones.
        """
        x, self_w, cross_w = self._decoder_hidden(
            tgt_ids, memory, src_mask, tgt_mask, cache, return_attention
        )
        logits = self.lm_head(x)  # (B, T, V)
        if return_attention:
            return logits, {"decoder": self_w, "cross": cross_w}
        return logits

    def _decoder_hidden(self, tgt_ids, memory, src_mask, tgt_mask, cache, return_attention):
        """:meth:`decode` without the output layer: (hidden (B, T, D), self and cross weights)."""
        _check_ids("tgt_ids", tgt_ids, self.cfg)
        if memory.dim() != 3 or memory.shape[0] != tgt_ids.shape[0]:
            raise ValueError(
                f"memory must have shape (B={tgt_ids.shape[0]}, S, D), got {tuple(memory.shape)}"
            )
        past = 0 if cache is None else cache.length
        b, t = tgt_ids.shape
        tgt_mask = _check_mask("tgt_mask", tgt_mask, (b, past + t))
        src_mask = _check_mask("src_mask", src_mask, memory.shape[:2])
        _check_length(self.cfg, past + t, "the target")
        positions = _positions(tgt_mask, t, past, tgt_ids.device)
        x = self.tgt_embeddings(tgt_ids, positions)
        return self.decoder(
            x,
            memory,
            self_mask=_key_mask(tgt_mask),
            memory_mask=_key_mask(src_mask),
            positions=positions,
            cache=cache,
            return_attention=return_attention,
        )

    def forward(
        self,
        src_ids: Tensor,
        tgt_ids: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        *,
        return_attention: bool = False,
    ):
        if isinstance(src_ids, Tensor) and isinstance(tgt_ids, Tensor):
            if src_ids.dim() >= 1 and tgt_ids.dim() >= 1 and src_ids.shape[0] != tgt_ids.shape[0]:
                raise ValueError(
                    f"src_ids and tgt_ids must have the same batch size, got "
                    f"{src_ids.shape[0]} and {tgt_ids.shape[0]}"
                )
        _check_ids("tgt_ids", tgt_ids, self.cfg)
        _check_mask("tgt_mask", tgt_mask, tgt_ids.shape)
        if not return_attention:
            return self.decode(tgt_ids, self.encode(src_ids, src_mask), src_mask, tgt_mask)
        memory, enc_w = self.encode(src_ids, src_mask, return_attention=True)
        logits, dec = self.decode(tgt_ids, memory, src_mask, tgt_mask, return_attention=True)
        return logits, {"encoder": enc_w, **dec}

    def loss(
        self,
        src_ids: Tensor,
        tgt_ids: Tensor,
        targets: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        *,
        ignore_index: int = -100,
        smoothing: float = 0.0,
    ) -> Tensor:
        """The training loss: the mean cross-entropy of ``forward``'s logits against
        ``targets`` (B, T), over the targets that are not ``ignore_index``, with label
        smoothing ``smoothing``. The same value as ``F.cross_entropy`` on the logits, but the
        output layer and the loss run as one chunked pass
        (:func:`attnkit.efficient.linear_cross_entropy`): the (B, T, V) logits never exist."""
        _check_targets(targets, tgt_ids)
        if isinstance(src_ids, Tensor) and src_ids.dim() >= 1 and src_ids.shape[0] != len(tgt_ids):
            raise ValueError(
                f"src_ids and tgt_ids must have the same batch size, got "
                f"{src_ids.shape[0]} and {tgt_ids.shape[0]}"
            )
        memory = self.encode(src_ids, src_mask)
        hidden, _, _ = self._decoder_hidden(tgt_ids, memory, src_mask, tgt_mask, None, False)
        return linear_cross_entropy(
            hidden, self.lm_head.weight, targets, ignore_index=ignore_index, smoothing=smoothing
        )

    def new_cache(self, batch_size: int, src_len: int, max_len: int | None = None, **kw):
        """Empty caches for incremental decoding of up to ``max_len`` target positions."""
        return self.decoder.new_cache(
            batch_size, max_len or self.cfg.max_len, memory_len=src_len, **kw
        )

    def generate(
        self,
        src_ids: Tensor,
        max_new_tokens: int,
        *,
        src_mask: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        eos_id: int | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        on_token=None,
        compile: bool = False,
    ) -> Tensor:
        """Translate: target tokens (B, 1 + T), BOS first, each row filled with pad_id after its
        EOS. The encoder runs once; with the cache each layer's cross-attention keys and values
        are computed once per source. Options as in :func:`attnkit.generation.generate`."""
        return generate(
            self,
            src_ids,
            max_new_tokens,
            attention_mask=src_mask,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_beams=num_beams,
            length_penalty=length_penalty,
            eos_id=eos_id,
            use_cache=use_cache,
            seed=seed,
            on_token=on_token,
            compile=compile,
        )


# --------------------------------------------------------------------------------------------
# Decoder-only
# --------------------------------------------------------------------------------------------


class DecoderLM(_Model):
    """GPT-style language model: ``model(input_ids, attention_mask=None)`` -> logits (B, N, V),
    where logits[:, t] predict token t + 1 from tokens <= t.

    With a ``cache`` (from :meth:`new_cache`), ``input_ids`` are the next positions only and
    ``attention_mask``, if given, covers the cached positions plus the new ones.
    """

    family = "decoder-only"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.decoder = Decoder(cfg, cross_attention=False)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embeddings.tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        return_attention: bool = False,
    ):
        attention_mask = self.check_inputs(input_ids, attention_mask, cache)
        x, attentions = self.hidden_states(input_ids, attention_mask, cache, return_attention)
        logits = self.lm_head(x)  # (B, N, V)
        return (logits, attentions) if return_attention else logits

    def loss(
        self,
        input_ids: Tensor,
        targets: Tensor,
        attention_mask: Tensor | None = None,
        *,
        ignore_index: int = -100,
        smoothing: float = 0.0,
    ) -> Tensor:
        """The training loss: the mean cross-entropy of ``forward``'s logits against
        ``targets`` (B, N) (for next-token prediction, the inputs shifted left by one), over
        the targets that are not ``ignore_index``. The same value as ``F.cross_entropy`` on the
        logits, but the LM head and the loss run as one chunked pass
        (:func:`attnkit.efficient.linear_cross_entropy`): the (B, N, V) logits never exist."""
        attention_mask = self.check_inputs(input_ids, attention_mask)
        _check_targets(targets, input_ids)
        hidden, _ = self.hidden_states(input_ids, attention_mask)
        return linear_cross_entropy(
            hidden, self.lm_head.weight, targets, ignore_index=ignore_index, smoothing=smoothing
        )

    def check_inputs(self, input_ids, attention_mask=None, cache=None) -> Tensor | None:
        """Every check ``forward`` makes; returns the mask as bool (or None)."""
        _check_ids("input_ids", input_ids, self.cfg)
        past = 0 if cache is None else cache.length
        b, n = input_ids.shape
        attention_mask = _check_mask("attention_mask", attention_mask, (b, past + n))
        _check_length(self.cfg, past + n, "input_ids")
        return attention_mask

    def hidden_states(self, input_ids, attention_mask=None, cache=None, return_attention=False):
        """The final hidden states (B, N, D), before the LM head. Unlike ``forward`` this checks
        nothing: it is the decoding loop's lean step, fed with ids the model produced itself."""
        past = 0 if cache is None else cache.length
        positions = _positions(attention_mask, input_ids.shape[1], past, input_ids.device)
        x = self.embeddings(input_ids, positions)
        x, attentions, _ = self.decoder(
            x,
            self_mask=_key_mask(attention_mask),
            positions=positions,
            cache=cache,
            return_attention=return_attention,
        )
        return x, attentions

    def new_cache(self, batch_size: int, max_len: int | None = None, **kw) -> DecoderCache:
        """Empty per-layer KV caches for up to ``max_len`` positions (default cfg.max_len)."""
        return self.decoder.new_cache(batch_size, max_len or self.cfg.max_len, **kw)

    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        eos_id: int | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        on_token=None,
        compile: bool = False,
    ) -> Tensor:
        """Continue the prompts: (B, N + T), the prompt followed by the new tokens, each row
        filled with pad_id after its EOS. Prompts of different lengths go left-padded with an
        ``attention_mask``. ``on_token(tokens)`` is called with each step's new tokens (B,)
        (greedy and sampling), for streaming. Options as in :func:`attnkit.generation.generate`."""
        return generate(
            self,
            input_ids,
            max_new_tokens,
            attention_mask=attention_mask,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_beams=num_beams,
            length_penalty=length_penalty,
            eos_id=eos_id,
            use_cache=use_cache,
            seed=seed,
            on_token=on_token,
            compile=compile,
        )
