"""Speculative decoding: guess the next k tokens cheaply, and let the model check them in one call.

A decoding step reads every weight of the model to make one token, so on a CPU its time is set by
the bytes of weights (docs/PERFORMANCE.md). A call over k + 1 positions reads them once too. So
the model is given the token it chose last and k *draft* tokens, ``[t, d_1, ..., d_k]``, and its
logits at those k + 1 positions say, in one read of the weights, which drafts it would have
chosen itself::

    g_i = choose(logits_i)       the model's own choice after t, d_1, ..., d_i
    keep d_1 .. d_a              while g_{i-1} = d_i (the longest agreeing prefix)
    then g_a                     its own next token (a correction, or after all k: a bonus)

Each call makes a + 1 tokens, and the cache forgets the k - a rejected positions (``rewind``;
a sliding-window layer's ring puts back the slots they overwrote, so k + 1 stays within the
narrowest window).

**Drafts.** ``Speculative(model=None)`` looks them up in the context (prompt lookup, as
transformers' ``prompt_lookup_num_tokens``): the last ``ngram`` tokens (then fewer, down to
``min_ngram``) are found earlier in the prompt and the answer so far, and the k tokens that
followed them there are the draft. Text that repeats its context (a summary, an edit, code)
agrees with it often. ``Speculative(model=draft)`` asks a smaller model with the same tokenizer
for k greedy tokens (sampled, when the model samples) instead.

**The same answer.** Greedy decoding keeps exactly the tokens the model chooses, so the output
is plain decoding's token for token, with the same logits wherever the model gives a position
the same bits however the positions are split into calls: ``accel.PackedStack`` does (its C
stack, on the float32 and the integer paths), and packed output layers do. A model of float32
layers runs a verifying call through a GEMM whose rounding may differ from a one-row product's in
the last bits. Sampling keeps the model's distribution by the acceptance rule of Leviathan et
al. (2023) and Chen et al. (2023): draft d with the draft's probability q(d) is kept with
probability min(1, p(d) / q(d)), and a rejected one is replaced by a draw from
``max(0, p - q)`` renormalised (a looked-up draft has q(d) = 1). p and q are the probabilities
after temperature, top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.caches import KVCache, RollingKVCache

__all__ = ["MAX_DRAFT", "Speculative", "SpeculativeStats", "longest_draft", "lookup_draft"]

MAX_DRAFT = 15  # k + 1 positions per verifying call: 16, the C stack's rows per call


@dataclass
class SpeculativeStats:
    """What one speculative ``generate`` did: ``drafted`` and ``accepted`` draft tokens, the
    model's ``calls`` after the prompt (each one read of the weights) and the ``tokens`` made."""

    drafted: int = 0
    accepted: int = 0
    calls: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        """The share of draft tokens the model kept."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_read(self) -> float:
        """Tokens made per read of the weights (the prompt's call makes the first token)."""
        return (self.tokens - 1) / self.calls if self.calls else 1.0

    def line(self) -> str:
        return (
            f"speculative: {self.accepted} of {self.drafted} draft tokens kept "
            f"({100 * self.acceptance:.0f}%), {self.tokens_per_read:.2f} tokens per read of "
            "the weights"
        )


@dataclass
class Speculative:
    """How to draft: ``draft_tokens`` (k, 1 to ``MAX_DRAFT``) per call; ``ngram`` and
    ``min_ngram``, the longest and the shortest context n-gram that prompt lookup matches (a
    single token's match drafts poorly: where nothing longer matches, the step is a plain one);
    ``model``, a draft DecoderLM with the same vocabulary (None: prompt lookup). ``stats``
    holds the last generation's :class:`SpeculativeStats`."""

    draft_tokens: int = 5
    ngram: int = 3
    model: nn.Module | None = None
    min_ngram: int = 2
    stats: SpeculativeStats | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        k = self.draft_tokens
        if not checks.is_int(k) or not 1 <= k <= MAX_DRAFT:
            raise ValueError(
                f"speculative: the draft length must be an int in [1, {MAX_DRAFT}], got {k!r}"
            )
        if not checks.is_int(self.ngram) or self.ngram < 1:
            raise ValueError(f"speculative: ngram must be a positive int, got {self.ngram!r}")
        if not checks.is_int(self.min_ngram) or not 1 <= self.min_ngram <= self.ngram:
            raise ValueError(
                f"speculative: min_ngram must be an int in [1, ngram={self.ngram}], "
                f"got {self.min_ngram!r}"
            )
        if self.model is not None and getattr(self.model, "family", None) != "decoder-only":
            found = type(self.model).__name__
            raise TypeError(f"speculative: the draft model must be a DecoderLM, got {found}")

    @classmethod
    def of(cls, value) -> Speculative | None:
        """``generate``'s ``speculative=``: None, a draft length, or a Speculative."""
        if value is None or isinstance(value, Speculative):
            return value
        if checks.is_int(value):
            return cls(draft_tokens=value)
        raise TypeError(f"speculative must be None, a draft length or a Speculative, got {value!r}")


def lookup_draft(sequence: Tensor, ngram: int, k: int, shortest: int = 1) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last ``ngram`` tokens (then of fewer, down to ``shortest``), or [] when none
    occurs. ``sequence``: (N,)"""
    n_tokens = sequence.shape[0]
    for n in range(min(ngram, n_tokens - 1), shortest - 1, -1):
        windows = sequence[: n_tokens - 1].unfold(0, n, 1)  # (N - n, n): every earlier n-gram
        found = (windows == sequence[n_tokens - n :]).all(dim=1).nonzero()
        if len(found):
            start = int(found[-1]) + n
            return sequence[start : start + k].tolist()
    return []


def longest_draft(cache, k: int) -> int:
    """k, or less where a ring of w slots must take back the positions of a call: k + 1 <= the
    narrowest window of ``cache`` (a DecoderCache)."""
    return min([k] + [c.window - 1 for c in cache.self_attn if isinstance(c, RollingKVCache)])


class _DraftModel:
    """A draft model's proposals; its cache holds the context tokens it was fed, kept to those
    the target agreed with."""

    def __init__(self, model, target, length: int) -> None:
        if model.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"speculative: the draft model's vocabulary ({model.cfg.vocab_size} tokens) is "
                f"not the model's ({target.cfg.vocab_size}): a draft must share its tokenizer"
            )
        self.model = model
        self.cache = model.new_cache(1, length, dtype=next(model.parameters()).dtype)
        for cache in self.cache.self_attn:
            if type(cache) is not KVCache:
                raise ValueError(
                    "speculative: the draft model's layers must attend over the whole context "
                    f"({type(cache).__name__} cannot be rewound to any length)"
                )
        self.fed: list[int] = []

    def propose(self, sequence: list[int], k: int, choose) -> tuple[list[int], list[Tensor]]:
        """k draft tokens after ``sequence`` and the distribution each was drawn from (None
        for a greedy choice): ``choose(logits) -> (token, probabilities or None)``."""
        same = 0
        for mine, theirs in zip(self.fed, sequence[:-1], strict=False):  # feed the last one
            if mine != theirs:
                break
            same += 1
        self.cache.rewind(len(self.fed) - same)
        self.fed = sequence[:same]
        tokens, drawn_from = [], []
        step = sequence[same:]
        while True:
            hidden = self.model.hidden_states(torch.tensor([step]), None, self.cache)[0]
            self.fed += step
            token, q = choose(self.model.lm_head(hidden[:, -1]))
            tokens.append(token)
            drawn_from.append(q)
            if len(tokens) == k:
                return tokens, drawn_from
            step = [token]


def decode(model, input_ids, attention_mask, spec, max_new_tokens, eos_id, warp, generator,
           on_token=None, on_logits=None, *, num_beams=1, use_cache=True) -> Tensor:  # fmt: skip
    """Speculative greedy decoding (``warp`` None) or sampling (``warp(logits)``: the
    probabilities after temperature, top-k, top-p) of one prompt; the new tokens (1, T).
    ``spec.stats`` gets the counts."""
    if num_beams > 1:
        raise ValueError("speculative decoding cannot be combined with beam search (num_beams > 1)")
    if model.family != "decoder-only" or not use_cache:
        raise ValueError("speculative decoding needs a DecoderLM and use_cache=True")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative decoding takes one prompt at a time, got a batch of {input_ids.shape[0]}"
        )
    mask = model.check_inputs(input_ids, attention_mask)
    if mask is not None and not bool(mask.all()):
        raise ValueError("speculative decoding takes one prompt without padding")
    n = input_ids.shape[1]
    cache = model.new_cache(1, n + max_new_tokens, dtype=next(model.parameters()).dtype)
    for layer in cache.self_attn:
        if not hasattr(layer, "rewind"):
            raise ValueError(
                f"speculative decoding forgets rejected drafts, which a {type(layer).__name__} "
                f"({model.cfg.attention} attention) cannot"
            )
    longest = longest_draft(cache, spec.draft_tokens)
    draft = None if spec.model is None else _DraftModel(spec.model, model, n + max_new_tokens)
    stats = spec.stats = SpeculativeStats()
    sequence, new = input_ids[0].tolist(), []

    def choose(logits: Tensor) -> tuple[int, Tensor | None]:  # (1, V) -> token, distribution
        if warp is None:
            return int(logits.argmax()), None
        p = warp(logits)[0]
        return int(torch.multinomial(p, 1, generator=generator)), p

    def emit(token: int, logits: Tensor) -> bool:
        """Keep ``token``, chosen from ``logits`` (1, V); True when decoding ends."""
        new.append(token)
        sequence.append(token)
        stats.tokens += 1
        if on_logits is not None:
            on_logits(logits)
        if on_token is not None:
            on_token(torch.tensor([token]))
        return token == eos_id or len(new) == max_new_tokens

    logits = model.lm_head(model.hidden_states(input_ids, mask, cache)[0][:, -1])
    done = emit(choose(logits)[0], logits)
    while not done:
        k = min(longest, max_new_tokens - len(new) - 1)  # k + 1 tokens at most
        drafts, drawn_from = [], []
        if k and draft is not None:
            drafts, drawn_from = draft.propose(sequence, k, choose)
        elif k:
            drafts = lookup_draft(torch.tensor(sequence), spec.ngram, k, spec.min_ngram)
            drawn_from = [None] * len(drafts)
        saved = cache.ahead(len(drafts) + 1)
        fed = torch.tensor([[sequence[-1], *drafts]])
        logits = model.lm_head(model.hidden_states(fed, None, cache)[0])[0]  # (1 + k, V)
        stats.calls += 1
        stats.drafted += len(drafts)
        for i, (token, q) in enumerate(zip(drafts, drawn_from, strict=True)):
            row = logits[i : i + 1]
            kept, own = _verify(row, token, q, warp, generator)
            if not kept:
                done = emit(own, row)
                cache.rewind(len(drafts) - i, saved)
                break
            stats.accepted += 1
            if done := emit(token, row):
                break
        else:
            row = logits[len(drafts) :]
            done = emit(choose(row)[0], row)
    return torch.tensor([new], device=input_ids.device)


def _verify(logits: Tensor, token: int, q: Tensor | None, warp, generator) -> tuple[bool, int]:
    """Whether the model keeps draft ``token`` at a position with ``logits`` (1, V), and its own
    token there if not. Greedy: kept when it is the argmax. Sampling: kept with probability
    min(1, p / q) (``q`` the draft's distribution; None: a looked-up draft, q = 1), else
    replaced by a draw from max(0, p - q), renormalised."""
    if warp is None:
        own = int(logits.argmax())
        return own == token, own
    p = warp(logits)[0]
    chance = p[token] if q is None else torch.clamp(p[token] / q[token], max=1.0)
    if float(torch.rand(1, generator=generator)) < float(chance):
        return True, token
    rest = p.clone()
    if q is None:
        rest[token] = 0.0
    else:
        rest = torch.clamp(p - q, min=0.0)
    if float(rest.sum()) <= 0.0:  # p = q: the draft is always kept (cannot reach here)
        return True, token
    return False, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))
