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

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnkit import checks, serialization
from attnkit.attention import MultiHeadAttention
from attnkit.backends import attention_implementation
from attnkit.config import ModelConfig
from attnkit.generation import generate
from attnkit.layers import LMHead, MoEFeedForward, count_parameters
from attnkit.position import positions_from_mask
from attnkit.stacks import Decoder, DecoderCache, Embeddings, Encoder, init_weights

__all__ = [
    "DecoderCache",
    "DecoderLM",
    "EncoderClassifier",
    "EncoderModel",
    "Transformer",
    "shift_right",
]


def _check_length(cfg: ModelConfig, length: int, what: str) -> None:
    if cfg.position_limit is not None and length > cfg.position_limit:
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
    """(B, M) real-token mask -> (B, 1, 1, M) attention mask; None when nothing is padding (the
    fused kernel's fastest path), except in ``torch.compile``: reading it would split the graph."""
    if mask is None or (not checks.tracing() and bool(mask.all())):
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

    def set_attn_implementation(self, name: str) -> nn.Module:
        """Run softmax attention by the implementation ``name`` (``backends.ATTENTION``: torch's
        ``"sdpa"``, ``"math"``, or one a speed lever registered) in every layer; the model's
        config records it. Returns the model."""
        attention_implementation(name)
        self.cfg = dataclasses.replace(self.cfg, attn_implementation=name)
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.attn_implementation = name
        return self

    def save_pretrained(self, directory, *, tokenizer=None):
        """Write config.json + model.safetensors (+ tokenizer.json) atomically;
        ``attnkit.from_pretrained(directory)`` reads it back exactly (packed layers too)."""
        return serialization.save_pretrained(self, directory, tokenizer=tokenizer)

    def extra_meta(self) -> dict:
        """What besides the config a saved model needs to be rebuilt (see ``from_meta``)."""
        return {}

    @classmethod
    def from_meta(cls, cfg: ModelConfig, meta: dict):
        return cls(cfg)


# --------------------------------------------------------------------------------------------
# Encoder-only
# --------------------------------------------------------------------------------------------


@serialization.family("encoder-only")
class EncoderModel(_Model):
    """BERT-style encoder: ``model(input_ids, attention_mask=None, token_type_ids=None)`` ->
    hidden states (B, N, d_model)."""

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
        checks.token_ids("input_ids", input_ids, self.cfg.vocab_size)
        attention_mask = checks.padding_mask("attention_mask", attention_mask, input_ids.shape)
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


@serialization.family("encoder-classifier")
class EncoderClassifier(_Model):
    """Classify a sequence: run the encoder, read out one vector, a linear layer -> (B, C).

    ``pooling="cls"`` reads the first real token (the ``[CLS]`` the tokenizer put in front;
    through BERT's pooler when the config has one); ``pooling="mean"`` averages the real tokens.
    ``labels`` optionally names the classes (``labels[c]`` for logit c); saved with the model.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_classes: int,
        *,
        pooling: str = "cls",
        labels: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        checks.positive_int("num_classes", num_classes, minimum=2)
        checks.one_of("pooling", pooling, ("cls", "mean"))
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

    def extra_meta(self) -> dict:
        meta = {"num_classes": self.classifier.out_features, "pooling": self.pooling}
        return meta if self.labels is None else {**meta, "labels": list(self.labels)}

    @classmethod
    def from_meta(cls, cfg: ModelConfig, meta: dict):
        return cls(
            cfg,
            meta.get("num_classes"),
            pooling=meta.get("pooling", "cls"),
            labels=meta.get("labels"),
        )

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
        mask = checks.padding_mask("attention_mask", attention_mask, input_ids.shape)
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


@serialization.family("encoder-decoder")
class Transformer(_Model):
    """The paper's encoder-decoder: ``model(src_ids, tgt_ids, src_mask=None, tgt_mask=None)`` ->
    logits (B, T, V).

    Teacher forcing: pass the target shifted right (``shift_right(targets, cfg.bos_id)``) as
    ``tgt_ids`` and train the logits against the unshifted targets. The decoder's
    self-attention is causal; its cross-attention sees only the real source tokens.
    With ``tie_embeddings`` source embedding = target embedding = output projection.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.src_embeddings = Embeddings(cfg)
        self.tgt_embeddings = self.src_embeddings if cfg.tie_embeddings else Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross_attention=True)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.src_embeddings.tokens.weight

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None, *, return_attention=False):
        """The encoder alone: memory (B, S, D) (and its attentions)."""
        checks.token_ids("src_ids", src_ids, self.cfg.vocab_size)
        src_mask = checks.padding_mask("src_mask", src_mask, src_ids.shape)
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
        src_mask, tgt_mask = self._check_decode(tgt_ids, memory, src_mask, tgt_mask, cache)
        x, self_w, cross_w = self.decoder_states(
            tgt_ids, memory, src_mask, tgt_mask, cache, return_attention
        )
        logits = self.lm_head(x)  # (B, T, V)
        if return_attention:
            return logits, {"decoder": self_w, "cross": cross_w}
        return logits

    def _check_decode(self, tgt_ids, memory, src_mask, tgt_mask, cache):
        """The checks of :meth:`decode`; returns the two masks as bool (or None)."""
        checks.token_ids("tgt_ids", tgt_ids, self.cfg.vocab_size)
        if memory.dim() != 3 or memory.shape[0] != tgt_ids.shape[0]:
            raise ValueError(
                f"memory must have shape (B={tgt_ids.shape[0]}, S, D), got {tuple(memory.shape)}"
            )
        past = 0 if cache is None else cache.length
        b, t = tgt_ids.shape
        tgt_mask = checks.padding_mask("tgt_mask", tgt_mask, (b, past + t))
        src_mask = checks.padding_mask("src_mask", src_mask, memory.shape[:2])
        _check_length(self.cfg, past + t, "the target")
        return src_mask, tgt_mask

    def decoder_states(self, tgt_ids, memory, src_mask, tgt_mask, cache, return_attention):
        """The decoder stack after :meth:`decode`'s checks: (hidden (B, T, D), self- and
        cross-attention weights)."""
        past = 0 if cache is None else cache.length
        t = tgt_ids.shape[1]
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
        checks.same_batch(src_ids, tgt_ids)
        checks.token_ids("tgt_ids", tgt_ids, self.cfg.vocab_size)
        checks.padding_mask("tgt_mask", tgt_mask, tgt_ids.shape)
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
        smoothing ``smoothing``, computed by the
        output layer's own ``loss`` (``LMHead.loss``)."""
        checks.targets(targets, tgt_ids)
        checks.same_batch(src_ids, tgt_ids)
        memory = self.encode(src_ids, src_mask)
        src_mask, tgt_mask = self._check_decode(tgt_ids, memory, src_mask, tgt_mask, None)
        checks.loss_options(targets, self.cfg.vocab_size, ignore_index, smoothing)
        hidden, _, _ = self.decoder_states(tgt_ids, memory, src_mask, tgt_mask, None, False)
        return self.lm_head.loss(hidden, targets, ignore_index=ignore_index, smoothing=smoothing)

    def new_cache(self, batch_size: int, src_len: int, max_len: int | None = None, **kw):
        """Empty caches for incremental decoding of up to ``max_len`` target positions."""
        return self.decoder.new_cache(
            batch_size, max_len or self.cfg.max_len, memory_len=src_len, **kw
        )

    def generate(self, src_ids: Tensor, max_new_tokens: int, *, src_mask=None, **options):
        """Translate: target tokens (B, 1 + T), BOS first, each row filled with pad_id after its
        EOS. The encoder runs once; with the cache each layer's cross-attention keys and values
        are computed once per source. ``options`` (do_sample, num_beams, ...) as in
        :func:`attnkit.generation.generate`."""
        if "attention_mask" in options:  # DecoderLM.generate's name for its mask
            raise TypeError("Transformer.generate: pass the source's mask as src_mask=")
        return generate(self, src_ids, max_new_tokens, attention_mask=src_mask, **options)


# --------------------------------------------------------------------------------------------
# Decoder-only
# --------------------------------------------------------------------------------------------


@serialization.family("decoder-only")
class DecoderLM(_Model):
    """GPT-style language model: ``model(input_ids, attention_mask=None)`` -> logits (B, N, V),
    where logits[:, t] predict token t + 1 from tokens <= t.

    With a ``cache`` (from :meth:`new_cache`), ``input_ids`` are the next positions only and
    ``attention_mask``, if given, covers the cached positions plus the new ones.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.decoder = Decoder(cfg, cross_attention=False)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
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
        the targets that are not ``ignore_index``, computed by the LM head's own ``loss``
        (``LMHead.loss``; ``attnkit.accel.fuse_lm_loss`` makes it one chunked pass)."""
        attention_mask = self.check_inputs(input_ids, attention_mask)
        checks.targets(targets, input_ids)
        checks.loss_options(targets, self.cfg.vocab_size, ignore_index, smoothing)
        hidden, _ = self.hidden_states(input_ids, attention_mask)
        return self.lm_head.loss(hidden, targets, ignore_index=ignore_index, smoothing=smoothing)

    def check_inputs(self, input_ids, attention_mask=None, cache=None) -> Tensor | None:
        """Every check ``forward`` makes; returns the mask as bool (or None)."""
        checks.token_ids("input_ids", input_ids, self.cfg.vocab_size)
        past = 0 if cache is None else cache.length
        b, n = input_ids.shape
        attention_mask = checks.padding_mask("attention_mask", attention_mask, (b, past + n))
        _check_length(self.cfg, past + n, "input_ids")
        return attention_mask

    def hidden_states(self, input_ids, attention_mask=None, cache=None, return_attention=False):
        """The final hidden states (B, N, D), before the LM head: what ``forward`` computes after
        :meth:`check_inputs` (``loss`` and the decoding steps call it after the same checks)."""
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

    def generate(self, input_ids: Tensor, max_new_tokens: int, *, attention_mask=None, **options):
        """Continue the prompts: (B, N + T), the prompt followed by the new tokens, each row
        filled with pad_id after its EOS. Prompts of different lengths go left-padded with an
        ``attention_mask``. ``on_token(tokens)`` is called with each step's new tokens (B,)
        (greedy and sampling), for streaming. ``options`` (do_sample, temperature, top_k, top_p,
        num_beams, length_penalty, eos_id, use_cache, seed, on_token) as in
        :func:`attnkit.generation.generate`."""
        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, **options)
