"""Making text: greedy decoding, sampling (temperature, top-k, top-p) and beam search, with or
without the KV cache, for the decoder-only and the encoder-decoder models.

Both families are driven through one small interface, a *stepper*: ``start()`` returns the
logits for the first new token, ``step(tokens)`` feeds the chosen tokens and returns the next
logits, ``reorder(index)`` keeps the chosen rows (beam search). With the cache a step runs the
model on one position per sequence; without it the whole sequence is run again each step (the
reference that the cache is tested against).

Beam search follows fairseq's sequence generator: a hypothesis' score is the sum of its tokens'
log-probabilities; a finished hypothesis (one that produced EOS, or reached the length limit) is
ranked by ``score / length ** length_penalty``, where ``length`` counts the generated tokens
(EOS included, the prompt or BOS not); each step looks at the 2 x beam best candidates so that
hypotheses ending in EOS do not starve the beam; a sentence stops when no running hypothesis
can beat its best finished one any more.

``length_penalty``: 0 ranks by the raw sum (which favours short outputs, as every token adds a
negative log-probability); 1.0 (the default) ranks by the mean log-probability per token; larger
values favour longer outputs further. Hugging Face's formula is the same, but for decoder-only
models its ``length`` includes the prompt; attnkit's never does.

A cached step is the one the model provides: ``model.decoding_steps``, a :class:`DecodingSteps`
that a speed lever may put there (``accel.prepare(model, "decoding", compile=True)`` puts
compiled steps: the same tokens, tested), else the plain steps below, the model's own forward.
This module knows no lever: a model that ``accel.prepare`` readied runs faster by what its
modules became (a packed Llama stack in C, weights laid out for one-row products), not by
anything decided here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from attnkit import checks
from attnkit.sampling import sample_next, sampling_probabilities
from attnkit.speculative import Speculative
from attnkit.speculative import decode as speculative_decode

__all__ = ["BeamHypothesis", "DecodingSteps", "beam_search", "generate", "lm_step", "sample_next",
           "sampling_probabilities", "seq2seq_step", "steps_of"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The options
# --------------------------------------------------------------------------------------------


def _check_options(max_new_tokens, temperature, top_k, top_p, num_beams, do_sample):
    checks.positive_int("max_new_tokens", max_new_tokens)
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k is not None and (not checks.is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    checks.positive_int("num_beams", num_beams)
    if num_beams > 1 and do_sample:
        raise ValueError("num_beams > 1 is beam search; it cannot be combined with do_sample=True")


# --------------------------------------------------------------------------------------------
# Steppers: one per family, with and without the cache
# --------------------------------------------------------------------------------------------


def lm_step(model, tokens: Tensor, mask: Tensor | None, cache) -> Tensor:
    """A DecoderLM's logits (B, V) for the position after ``tokens`` (B, N): with a ``cache``,
    the new positions only; without one, the whole sequence."""
    return model.lm_head(model.hidden_states(tokens, mask, cache)[0][:, -1])


def seq2seq_step(model, tokens: Tensor, memory: Tensor, src_mask: Tensor | None, cache) -> Tensor:
    """A Transformer decoder's logits (B, V) after ``tokens``, as :func:`lm_step`: the lean
    ``decoder_states`` (``generate`` and ``encode`` did ``decode``'s checks), the LM head."""
    hidden = model.decoder_states(tokens, memory, src_mask, None, cache, False)[0]
    return model.lm_head(hidden[:, -1])


@dataclass(frozen=True)
class DecodingSteps:
    """The protocol between a model and the decoding loops: ``lm`` (called as :func:`lm_step`)
    and ``seq2seq`` (as :func:`seq2seq_step`) run the cached steps, and ``session(model)`` is a
    context held around a whole ``generate`` call. A model provides its own as
    ``model.decoding_steps``; the default is the plain steps."""

    lm: Callable[..., Tensor] = lm_step
    seq2seq: Callable[..., Tensor] = seq2seq_step
    session: Callable[..., AbstractContextManager] = nullcontext


def steps_of(model) -> DecodingSteps:
    """The cached steps ``model`` provides (``model.decoding_steps``), else the plain ones."""
    return getattr(model, "decoding_steps", None) or DecodingSteps()


class _DecoderLMStepper:
    """Feeds a DecoderLM. Rows are left-aligned by ``attention_mask`` (left padding).

    The prompt goes through the checks of ``forward``, then :func:`lm_step` (the lean
    ``hidden_states``, the LM head on the last position only), as do uncached steps; cached
    steps go through the model's own (:func:`steps_of`).
    """

    def __init__(self, model, input_ids, attention_mask, max_new_tokens, use_cache):
        self.model, self.use_cache = model, use_cache
        self.device = input_ids.device
        self.cached_step = steps_of(model).lm
        self.ids = input_ids
        self.mask = model.check_inputs(input_ids, attention_mask)
        dtype = next(model.parameters()).dtype
        self.cache = (
            model.new_cache(
                input_ids.shape[0],
                input_ids.shape[1] + max_new_tokens,
                dtype=dtype,
                device=input_ids.device,
            )
            if use_cache
            else None
        )

    def start(self) -> Tensor:
        return lm_step(self.model, self.ids, self.mask, self.cache)

    def step(self, tokens: Tensor) -> Tensor:
        tokens = tokens.unsqueeze(1)  # (B, 1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        if self.use_cache:
            return self.cached_step(self.model, tokens, self.mask, self.cache)
        self.ids = torch.cat([self.ids, tokens], dim=1)
        return lm_step(self.model, self.ids, self.mask, None)

    def reorder(self, index: Tensor) -> None:
        self.ids = self.ids.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


class _TransformerStepper:
    """Feeds the encoder-decoder: the encoder runs once; the decoder starts from BOS."""

    def __init__(self, model, src_ids, src_mask, max_new_tokens, use_cache):
        self.model, self.use_cache = model, use_cache
        self.device = src_ids.device
        self.cached_step = steps_of(model).seq2seq
        self.src_mask = src_mask
        self.memory = model.encode(src_ids, src_mask)  # (B, S, D), computed once
        b = src_ids.shape[0]
        self.tgt = torch.full((b, 1), model.cfg.bos_id, dtype=torch.long, device=src_ids.device)
        self.cache = (
            model.new_cache(
                b,
                src_ids.shape[1],
                1 + max_new_tokens,
                dtype=self.memory.dtype,
                device=src_ids.device,
            )
            if use_cache
            else None
        )

    def start(self) -> Tensor:
        return seq2seq_step(self.model, self.tgt, self.memory, self.src_mask, self.cache)

    def step(self, tokens: Tensor) -> Tensor:
        tokens = tokens.unsqueeze(1)  # (B, 1)
        self.tgt = torch.cat([self.tgt, tokens], dim=1)
        if self.use_cache:
            return self.cached_step(self.model, tokens, self.memory, self.src_mask, self.cache)
        return seq2seq_step(self.model, self.tgt, self.memory, self.src_mask, None)

    def reorder(self, index: Tensor) -> None:
        self.tgt = self.tgt.index_select(0, index)
        self.memory = self.memory.index_select(0, index)
        if self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


# --------------------------------------------------------------------------------------------
# Greedy and sampling
# --------------------------------------------------------------------------------------------


def _greedy_or_sample(
    stepper, batch, max_new_tokens, eos_id, pad_id, choose, on_token, on_logits
) -> Tensor:
    """Generate up to max_new_tokens per row; a row that produced EOS is filled with pad_id.
    Stops early once every row has finished. Returns the new tokens (B, T)."""
    device = stepper.device
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens = []
    logits = stepper.start()
    for t in range(max_new_tokens):
        tokens = choose(logits)  # (B,)
        tokens = tokens.masked_fill(finished, pad_id)
        new_tokens.append(tokens)
        if on_logits is not None:
            on_logits(logits)
        if on_token is not None:
            on_token(tokens)
        if eos_id is not None:
            finished |= tokens == eos_id
            if bool(finished.all()):
                break
        if t + 1 < max_new_tokens:
            logits = stepper.step(tokens)
    return torch.stack(new_tokens, dim=1)  # (B, T)


# --------------------------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------------------------


@dataclass
class BeamHypothesis:
    """One finished hypothesis: its generated tokens, raw score (sum of log-probabilities) and
    the normalised score it is ranked by."""

    tokens: list[int]
    score: float
    normalized: float


def _beam_search(stepper, batch, k, max_new_tokens, eos_id, length_penalty, on_finish=None):
    """Beam search for ``batch`` sentences of ``k`` rows each (the stepper holds B * k rows).

    Returns, per sentence, the finished hypotheses sorted best first.
    """
    device = stepper.device

    def normalized(score: float, length: int) -> float:
        return score / (length**length_penalty)

    def best_possible(score: float, length: int) -> float:
        """The best normalised score any continuation of a running hypothesis can reach: its raw
        score can only fall, and the length can grow up to max_new_tokens."""
        if length_penalty > 0:
            return score / (max_new_tokens**length_penalty)
        return score / ((length + 1) ** length_penalty)

    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = float("-inf")  # all k rows start identical: expand only the first
    sequences: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(batch)]
    finished: list[list[BeamHypothesis]] = [[] for _ in range(batch)]
    done = [False] * batch
    logits = stepper.start()  # (B * k, V)
    for t in range(max_new_tokens):
        length = t + 1
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        vocab = log_probs.shape[-1]
        candidates = (scores.unsqueeze(-1) + log_probs.view(batch, k, vocab)).view(batch, -1)
        n_cand = min(2 * k, candidates.shape[1])
        top_scores, top_index = candidates.topk(n_cand, dim=-1)  # (B, 2k)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()
        next_rows, next_tokens, next_scores = [], [], []
        new_sequences = []
        for b in range(batch):
            kept: list[tuple[int, int, float]] = []  # (source beam, token, score)
            if not done[b]:
                for j in range(n_cand):
                    score = top_scores[b][j]
                    if score == float("-inf"):
                        break
                    beam, token = divmod(top_index[b][j], vocab)
                    tokens = [*sequences[b][beam], token]
                    if eos_id is not None and token == eos_id:
                        if j < k:  # as fairseq: only EOS among the top k candidates finishes
                            hyp = BeamHypothesis(tokens, score, normalized(score, length))
                            finished[b].append(hyp)
                            if on_finish is not None:
                                on_finish(b, hyp)
                        continue
                    if len(kept) < k:
                        kept.append((beam, token, score))
            if done[b] or not kept:  # keep the row shape: dummy rows that stay at -inf
                kept = [(0, eos_id if eos_id is not None else 0, float("-inf"))] * k
                done[b] = True
            while len(kept) < k:
                kept.append((kept[0][0], kept[0][1], float("-inf")))
            new_sequences.append([[*sequences[b][beam], token] for beam, token, _ in kept])
            for beam, token, score in kept:
                next_rows.append(b * k + beam)
                next_tokens.append(token)
                next_scores.append(score)
        sequences = new_sequences
        scores = torch.tensor(next_scores, device=device).view(batch, k)
        last = t + 1 == max_new_tokens
        for b in range(batch):
            if done[b]:
                continue
            running = [s for s in scores[b].tolist() if s != float("-inf")]
            if last:  # the length limit finishes every running hypothesis
                for seq, s in zip(sequences[b], scores[b].tolist(), strict=True):
                    if s != float("-inf"):
                        hyp = BeamHypothesis(seq, s, normalized(s, length))
                        finished[b].append(hyp)
                        if on_finish is not None:
                            on_finish(b, hyp)
                done[b] = True
            elif finished[b]:
                best = max(h.normalized for h in finished[b])
                if not running or best >= max(best_possible(s, length) for s in running):
                    done[b] = True
        if all(done):
            break
        index = torch.tensor(next_rows, device=device)
        stepper.reorder(index)
        logits = stepper.step(torch.tensor(next_tokens, device=device))
    return [sorted(f, key=lambda h: h.normalized, reverse=True) for f in finished]


@contextmanager
def eval_mode(model):
    """Dropout off while generating, inside the model's decoding session (:func:`steps_of`);
    the mode restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with steps_of(model).session(model):
            yield
    finally:
        model.train(was_training)


@torch.no_grad()
def beam_search(
    model,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    num_beams: int,
    attention_mask: Tensor | None = None,
    length_penalty: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    on_finish: Callable[[int, BeamHypothesis], None] | None = None,
) -> list[list[BeamHypothesis]]:
    """Beam search, returning every finished hypothesis of each input, best first.

    ``on_finish(row, hypothesis)`` is called for each hypothesis as it finishes (for
    inspection). ``model.generate(..., num_beams=k)`` returns the best of these as tokens.
    """
    _check_options(max_new_tokens, 1.0, None, None, num_beams, False)
    eos_id = _prepare(model, input_ids, max_new_tokens, eos_id)
    with eval_mode(model):
        stepper = _stepper(model, input_ids, attention_mask, num_beams, max_new_tokens, use_cache)
        return _beam_search(
            stepper,
            input_ids.shape[0],
            num_beams,
            max_new_tokens,
            eos_id,
            length_penalty,
            on_finish,
        )


def _prepare(model, input_ids, max_new_tokens, eos_id) -> int | None:
    """Check the model and the request; return the EOS id to stop at."""
    cfg, family = getattr(model, "cfg", None), getattr(model, "family", None)
    if cfg is None or family not in ("decoder-only", "encoder-decoder"):
        raise TypeError(f"generate needs a DecoderLM or a Transformer, got {type(model).__name__}")
    eos_id = cfg.eos_id if eos_id is None else eos_id
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id must be a token id in [0, {cfg.vocab_size}), got {eos_id}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, N) tensor of token ids, got {got}")
    is_lm = family == "decoder-only"
    used, limit = (input_ids.shape[1] if is_lm else 1), cfg.position_limit
    if limit is not None and used + max_new_tokens > limit:
        what = f"the prompt ({used} tokens)" if is_lm else "BOS"
        fix = f"lower max_new_tokens to at most {limit - used}"
        fix = fix if limit > used else "shorten the prompt"
        raise ValueError(
            f"cannot generate {max_new_tokens} new tokens: {what} plus the new tokens need "
            f"{used + max_new_tokens} positions, but this model's {cfg.position} positions stop "
            f"at max_len={limit}; {fix}"
        )
    if not is_lm and cfg.bos_id is None:
        raise ValueError("Transformer.generate needs cfg.bos_id to start the target")
    return eos_id


def _stepper(model, input_ids, attention_mask, k, max_new_tokens, use_cache):
    """A stepper over k copies of each input row (k > 1: beam search)."""
    rows = input_ids.repeat_interleave(k, dim=0) if k > 1 else input_ids  # (B k, N)
    mask = attention_mask
    if mask is not None:
        mask = mask.bool().repeat_interleave(k, dim=0) if k > 1 else mask.bool()
    stepper_cls = _DecoderLMStepper if model.family == "decoder-only" else _TransformerStepper
    return stepper_cls(model, rows, mask, max_new_tokens, use_cache)


# --------------------------------------------------------------------------------------------
# The entry point behind DecoderLM.generate and Transformer.generate
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model,
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
    on_token: Callable[[Tensor], None] | None = None,
    on_logits: Callable[[Tensor], None] | None = None,
    speculative: int | Speculative | None = None,
) -> Tensor:
    """Generate with a DecoderLM (``input_ids`` = prompts, result = prompt + new tokens) or a
    Transformer (``input_ids`` = sources, ``attention_mask`` = the source mask, result = target
    tokens with BOS first). Rows that finish (EOS) are filled with ``pad_id``; generation stops
    early once every row has finished. The module docstring has the decoding rules.

    ``on_token(tokens)`` and ``on_logits(logits)`` are called with each step's new tokens (B,)
    and the logits (B, V) they were chosen from (greedy and sampling). ``speculative`` (a draft
    length, or a :class:`~attnkit.speculative.Speculative`) lets a DecoderLM check several
    drafted tokens per call (:mod:`attnkit.speculative`): the same greedy tokens, the same
    sampling distribution, one prompt at a time."""
    _check_options(max_new_tokens, temperature, top_k, top_p, num_beams, do_sample)
    eos_id = _prepare(model, input_ids, max_new_tokens, eos_id)
    cfg = model.cfg
    batch = input_ids.shape[0]
    generator, warp = None, None  # sampling: the seeded draws, the distribution they follow
    if do_sample:
        generator = torch.Generator(device=input_ids.device)
        generator.manual_seed(seed if seed is not None else torch.seed())
        warp = partial(sampling_probabilities, temperature=temperature, top_k=top_k, top_p=top_p)
    spec = Speculative.of(speculative)
    if spec is not None:
        with eval_mode(model), eval_mode(spec.model) if spec.model is not None else nullcontext():
            new = speculative_decode(
                model, input_ids, attention_mask, spec, max_new_tokens, eos_id, warp, generator,
                on_token, on_logits, num_beams=num_beams, use_cache=use_cache,
            )  # fmt: skip
    elif num_beams > 1:
        hypotheses = beam_search(
            model,
            input_ids,
            max_new_tokens,
            num_beams=num_beams,
            attention_mask=attention_mask,
            length_penalty=length_penalty,
            eos_id=eos_id,
            use_cache=use_cache,
        )
        longest = max(len(h[0].tokens) for h in hypotheses)
        new = torch.full((batch, longest), cfg.pad_id, dtype=torch.long, device=input_ids.device)
        for b, hyps in enumerate(hypotheses):  # new: (B, T)
            new[b, : len(hyps[0].tokens)] = torch.tensor(hyps[0].tokens)
    else:

        def choose(logits):  # (B, V) -> (B,)
            if warp is None:
                return logits.argmax(dim=-1)
            return torch.multinomial(warp(logits), 1, generator=generator).squeeze(-1)

        with eval_mode(model):
            stepper = _stepper(model, input_ids, attention_mask, 1, max_new_tokens, use_cache)
            new = _greedy_or_sample(
                stepper, batch, max_new_tokens, eos_id, cfg.pad_id, choose, on_token, on_logits
            )

    if model.family == "decoder-only":
        return torch.cat([input_ids, new], dim=1)  # (B, N + T)
    bos = torch.full((batch, 1), cfg.bos_id, dtype=torch.long, device=input_ids.device)
    return torch.cat([bos, new], dim=1)  # (B, 1 + T)
