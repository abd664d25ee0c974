"""One decoding loop for every request: continuous batching over a shared KV cache.

Served one after another, each request's decoding step is a matrix-vector product per layer,
which leaves most of a CPU's arithmetic idle. The engine instead keeps the requests that are
being answered as the rows of one batch and advances them all with one step of the model::

    step:   tokens (B, 1) ──► DecoderLM with the batch's KV cache ──► logits (B, V)
    rows:   request a  ░░░░▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓  (left padding ░, its tokens ▓)
            request b  ▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓▓
            request c  ░░░░░░░░░░░░▓▓▓▓▓▓▓▓▓▓  joined later: its prompt was run alone, then
                                               its keys and values were copied in, right-aligned

Requests join and leave between steps. A request that fails on its own (its grammar refuses a
token, its client's sink raises) ends alone with an error event; the others go on. A joining
request's prompt is run on its own (the prefill), and its cache is laid into the batch's cache
so that every row ends at the same column; the rows are left-padded, and the attention mask and
the position ids (counted over each row's real tokens) make the padding invisible. A request
that finishes (EOS, a stop string, ``max_tokens``) or whose client went away leaves: its row is
dropped, and columns that are padding in every remaining row are cut off.

Everything that touches the model runs on one thread, the engine's own (``start=True``) or the
one that calls :meth:`Engine.run` (``attnkit serve`` runs it on the main thread: OpenMP's
workers, which torch and the packed kernel use, wait for work by spinning only while a process
has no more of them than cores, and every other thread that computes brings workers of its
own). Requests come in through :meth:`Engine.submit` from any thread and their results go out
through the ``sink`` each request brings (a callback that receives event dicts).

A request with ``attention=True`` (the live attention page) runs alone, with the attention
weights of every layer and head recorded for each token it produces.

With ``speculative`` (``attnkit serve --speculate K``), a greedy request (temperature 0) that
is the batch's only row checks up to K tokens drafted from its context per step
(:mod:`attnkit.speculative`): each position's token is chosen as a plain step chooses it
(penalties, grammar), so the answer is the same, and the rejected positions are forgotten.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.caches import KVCache
from attnkit.generation import eval_mode, lm_step, sample_next, steps_of
from attnkit.serve.grammar import Grammars
from attnkit.serve.jobs import Job, Request, Sink
from attnkit.serve.prompt_cache import PromptCache
from attnkit.speculative import Speculative, longest_draft, lookup_draft
from attnkit.stacks import DecoderCache

# tokens that close a chat turn (Gemma, Llama 3, ChatML, Phi), where a vocabulary has them
END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")

__all__ = ["Engine", "Request"]


def _on_cpu(logits: Tensor) -> Tensor:
    """A step's logits in float32 on the CPU, where each request's own generator draws (one
    copy a step for the whole batch on a GPU; nothing on the CPU): a seed draws the same
    tokens from the same logits wherever the model runs."""
    return logits.float().cpu()


def _top(logprobs: Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a row of log-probabilities, [(id, logprob)]."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def _error(error: Exception) -> dict:
    """The event that tells a request's client why it ended."""
    return {"type": "error", "message": f"{type(error).__name__}: {error}"}


class Engine:
    """Serves generation requests for one decoder-only model on a background thread.

    ``max_batch`` requests are decoded together; more wait in line. Models whose caches are
    not plain KV caches (window or linear attention) are served one request at a time. The
    batch's ids, mask and cache are made on the model's device (a GPU, after ``model.to``);
    each step's logits come back to the CPU, where every request's own generator draws.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 8,
        keep_attention: int = 8,
        prompt_cache: int = 16384,
        start: bool = True,
        speculative: Speculative | None = None,
    ) -> None:
        if getattr(model, "family", None) != "decoder-only":
            raise TypeError(
                f"the server needs a decoder-only language model, got {type(model).__name__}"
            )
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device  # the batch's tensors live there too
        self.context = model.cfg.max_len
        probe = model.new_cache(1, 1)
        # plain KV caches can be laid side by side into one batch; window layers' ring buffers
        # (Gemma 3) and linear attention's running sums cannot: one request at a time
        self.plain = all(isinstance(c, KVCache) for c in probe.self_attn)
        self.max_batch = max_batch if self.plain else 1
        eos = [model.cfg.eos_id, getattr(tokenizer, "eos_id", None)]
        to_id = getattr(tokenizer, "token_to_id", None)
        if to_id is not None:  # the end of a chat turn ends a reply too, as in llama.cpp
            eos += [to_id(t) for t in END_OF_TURN]
        self.eos_ids = {i for i in eos if i is not None}
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, self.eos_ids)
        self.waiting: queue.Queue[Job] = queue.Queue()
        self.jobs: list[Job] = []  # the batch's rows, in order
        self.cache: DecoderCache | None = None
        self.mask: Tensor | None = None  # (B, L) True on real tokens
        self.recordings: OrderedDict[str, dict] = OrderedDict()
        self.keep_attention = keep_attention
        # recent prompts' prefilled caches, reused by a prompt that begins the same way
        self.prompt_cache = PromptCache(prompt_cache) if prompt_cache and self.plain else None
        self.steps = 0
        self.speculative = speculative
        self.drafted = self.accepted = 0  # speculative steps' draft tokens, and those kept
        self.admitting = 0  # a request taken from the queue and being prefilled: not yet a row
        self._stop = threading.Event()
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self.run, name="attnkit-engine", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------------------------------
    # The public side (any thread)
    # ---------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse what cannot be answered, with a one-line ValueError."""
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        least = 0 if request.prompt_logprobs else 1  # scoring a prompt alone: no new token
        if not isinstance(request.max_tokens, int) or request.max_tokens < least:
            raise ValueError(f"max_tokens must be a positive int, got {request.max_tokens!r}")
        if n + request.max_tokens > self.context:
            raise ValueError(
                f"max_tokens={request.max_tokens} does not fit: the prompt has {n} tokens and "
                f"the model's context is {self.context}, so at most {self.context - n} new "
                "tokens fit"
                if n < self.context
                else f"the prompt has {n} tokens; the model's context is {self.context}"
            )

    def submit(self, request: Request, sink: Sink) -> Job:
        """Queue a request; ``sink`` receives its events on the engine's thread:
        ``{"type": "token", "id", "text"}`` per token, then ``{"type": "done",
        "finish_reason", "prompt_tokens", "completion_tokens", "text"}`` (or ``{"type":
        "error", "message"}``)."""
        self.check(request)
        job = Job(request, sink, self.tokenizer, self.grammars)
        self.waiting.put(job)
        return job

    def stats(self) -> dict:
        """Rows being decoded, requests waiting, the batched steps taken so far, and how often
        a prompt reused a recent one's cache (and how many positions it copied)."""
        running = len(self.jobs) + self.admitting  # a request in its prefill counts already
        stats = {"running": running, "waiting": self.waiting.qsize(), "steps": self.steps}
        if self.speculative is not None:
            stats.update(drafted=self.drafted, accepted=self.accepted)
        if self.prompt_cache is not None:
            stats.update(self.prompt_cache.stats())
        return stats

    def recording(self, job_id: str) -> dict | None:
        """The attention recorded for a request made with ``attention=True``."""
        return self.recordings.get(job_id)

    def close(self) -> None:
        """Stop the loop (after the step in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---------------------------------------------------------------------------------------
    # The engine's thread
    # ---------------------------------------------------------------------------------------

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """The decoding loop, on the calling thread, until :meth:`close` (or ``until()``)."""
        with torch.no_grad(), eval_mode(self.model):
            self.cached_step = steps_of(self.model).lm
            while not self._stop.is_set() and not (until is not None and until()):
                try:
                    self._admit()
                    if self.jobs:
                        self._step()
                except Exception as error:  # the batch's step failed: every row ends with it
                    for job in self.jobs:
                        job.sink(_error(error))
                    self.jobs, self.cache, self.mask = [], None, None

    def _admit(self) -> None:
        """Take waiting requests into the batch (wait for one when the batch is empty)."""
        while len(self.jobs) < self.max_batch:
            try:
                job = self.waiting.get(timeout=0.05) if not self.jobs else self.waiting.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                continue
            self.admitting = 1  # counted as running by stats() until it is a row (or done)
            try:
                if job.request.attention:
                    self._run_alone(job)
                else:
                    self._prefill(job)
            except Exception as error:
                if job in self.jobs:  # it failed joining: run() tells every row, starts over
                    raise
                job.sink(_error(error))  # not a row of the batch: run() would not tell it
            finally:
                self.admitting = 0

    def _prefill(self, job: Job) -> None:
        ids = torch.tensor([job.request.prompt_ids], device=self.device)  # (1, P)
        # a cache that is not laid into a batch later keeps room for the whole answer
        size = ids.shape[1] + (0 if self.plain else job.request.max_tokens + 1)
        cache = self.model.new_cache(1, size, device=self.device)
        if job.request.prompt_logprobs:
            hidden = self.model.hidden_states(ids, None, cache)[0]  # (1, P, D)
            job.prompt_scores = self._prompt_scores(job, hidden[0])
            logits = self.model.lm_head(hidden[:, -1])
            if job.request.max_tokens == 0:
                self._finish(job, "length", ended_on_eos=False)
                return
        else:
            reused, source = 0, None
            if self.prompt_cache is not None:
                reused, source = self.prompt_cache.lookup(job.request.prompt_ids)
            if source is not None:  # the shared prefix's keys and values, copied
                PromptCache.fill(cache, source, reused)
            logits = lm_step(self.model, ids[:, reused:], None, cache)  # (1, V)
            if self.prompt_cache is not None:
                self.prompt_cache.store(job.request.prompt_ids, cache)
        token = self._choose(job, _on_cpu(logits)[0])
        if self._emit(job, token):
            return
        mask = torch.ones(1, ids.shape[1], dtype=torch.bool, device=self.device)
        self._join(job, cache, mask, token)

    def _step(self) -> None:
        keep = [i for i, job in enumerate(self.jobs) if not job.cancelled.is_set()]
        if len(keep) < len(self.jobs):
            self._keep(keep)
            if not self.jobs:
                return
        b = len(self.jobs)
        if b == 1 and self.speculative is not None and self.jobs[0].request.temperature == 0:
            if self._speculate(self.jobs[0]):
                return
        tokens = torch.tensor([[job.generated[-1]] for job in self.jobs], device=self.device)
        new = torch.ones(b, 1, dtype=torch.bool, device=self.device)
        self.mask = torch.cat([self.mask, new], dim=1)  # (B, L + 1)
        logits = _on_cpu(self.cached_step(self.model, tokens, self.mask, self.cache))  # (B, V)
        self.steps += 1
        done = []
        for i, job in enumerate(self.jobs):
            try:
                if self._emit(job, self._choose(job, logits[i])):
                    done.append(i)
            except Exception as error:  # this row's own failure (its grammar, its sink): it alone
                job.sink(_error(error))  # ends; the step itself failing ends every row (run)
                done.append(i)
        if done:
            self._keep([i for i in range(b) if i not in done])

    def _speculate(self, job: Job) -> bool:
        """One speculative step of the batch's only row: its last token and the drafts in one
        call, each position's token chosen as :meth:`_step` would, until one differs from its
        draft (the positions after it forgotten). False when there is no draft."""
        k = min(longest_draft(self.cache, self.speculative.draft_tokens), job.remaining - 1)
        sequence = torch.tensor(job.request.prompt_ids + job.generated)
        spec = self.speculative
        drafts = lookup_draft(sequence, spec.ngram, k, spec.min_ngram) if k > 0 else []
        if not drafts:
            return False
        n = len(drafts) + 1
        saved = self.cache.ahead(n)
        tokens = torch.tensor([[job.generated[-1], *drafts]], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(1, n)], dim=1)
        hidden = self.model.hidden_states(tokens, self.mask, self.cache)[0]
        logits = _on_cpu(self.model.lm_head(hidden[0]))  # (n, V)
        self.steps += 1
        self.drafted += len(drafts)
        try:
            for i in range(n):
                token = self._choose(job, logits[i])
                if self._emit(job, token):
                    self._keep([])
                    return True
                if i == len(drafts) or token != drafts[i]:
                    break
                self.accepted += 1
        except Exception as error:  # this row's own failure (its grammar, its sink)
            job.sink(_error(error))
            self._keep([])
            return True
        if n - 1 - i:
            self.cache.rewind(n - 1 - i, saved)
            self.mask = self.mask[:, : -(n - 1 - i)]
        return True

    def _prompt_scores(self, job: Job, hidden: Tensor, rows: int = 256) -> list:
        """[(token id, its log-probability given the tokens before it, top)] for the prompt,
        the first with (None, None); the LM head in chunks of ``rows`` positions, so that the
        (P, V) logits are never held whole."""
        ids, k = job.request.prompt_ids, job.request.logprobs or 0
        scores = [(ids[0], None, None)]
        for start in range(0, len(ids) - 1, rows):
            logits = _on_cpu(self.model.lm_head(hidden[start : start + rows]))
            logprobs = torch.log_softmax(logits, -1)  # row i: the token after position i
            for i, row in enumerate(logprobs[: len(ids) - 1 - start]):
                token = ids[start + i + 1]
                scores.append((token, float(row[token]), _top(row, k)))
        return scores

    def _choose(self, job: Job, logits: Tensor) -> int:
        r = job.request
        raw = logits
        if job.bias is not None or (job.generated and (r.frequency_penalty or r.presence_penalty)):
            logits = logits.clone()
            if job.bias is not None:
                logits[job.bias[0]] += job.bias[1]
            if job.generated and (r.frequency_penalty or r.presence_penalty):
                seen, counts = torch.unique(torch.tensor(job.generated), return_counts=True)
                logits[seen] -= r.frequency_penalty * counts + r.presence_penalty
        if job.matcher is not None:
            logits = job.matcher.allow(logits)
        token = self._draw(job, logits)
        if job.matcher is not None and token not in self.eos_ids:
            job.matcher.accept(token)
        if r.logprobs is not None:
            logprobs = torch.log_softmax(raw, -1)
            job.scores = {"logprob": float(logprobs[token]), "top": _top(logprobs, r.logprobs)}
        return token

    def _draw(self, job: Job, logits: Tensor) -> int:
        r = job.request
        if r.temperature == 0:
            return int(logits.argmax())
        top_p = r.top_p if r.top_p < 1 else None
        return int(
            sample_next(
                logits[None], temperature=r.temperature, top_p=top_p, generator=job.generator
            )[0]
        )

    def _emit(self, job: Job, token: int) -> bool:
        """Hand the token to the client; return True when the request is finished."""
        if job.cancelled.is_set():
            return True
        finish = None
        if token in self.eos_ids:
            finish = "stop"
            if job.scores is not None:  # its logprob too: a completion lists the EOS token
                job.sink({"type": "token", "id": token, "text": "", "eos": True, **job.scores})
        else:
            job.generated.append(token)
            event = {"type": "token", "id": token, "text": job.text.push(token)}
            if job.scores is not None:
                event.update(job.scores)
            job.sink(event)
            if job.text.stopped or (job.matcher is not None and job.matcher.done):
                finish = "stop"
            elif job.remaining == 0:
                finish = "length"
        if finish is None:
            return False
        self._finish(job, finish, ended_on_eos=token in self.eos_ids)
        return True

    def _finish(self, job: Job, finish: str, *, ended_on_eos: bool) -> None:
        """Tell the client the request is done (the text held back for a stop string first)."""
        rest = job.text.flush()
        if rest:
            job.sink({"type": "token", "id": None, "text": rest})
        done = {
            "type": "done",
            "finish_reason": finish,
            "prompt_tokens": len(job.request.prompt_ids),
            "completion_tokens": len(job.generated) + ended_on_eos,  # EOS counts, as usual
            "text": job.text.text,
            "id": job.id,
            "stop_sequence": job.text.found,
        }
        if job.prompt_scores is not None:
            done["prompt_logprobs"] = job.prompt_scores
        job.sink(done)

    # ---------------------------------------------------------------------------------------
    # The batch's cache: rows join (right-aligned) and leave
    # ---------------------------------------------------------------------------------------

    def _join(self, job: Job, cache: DecoderCache, mask: Tensor, token: int) -> None:
        if not self.plain:  # the one request: its own cache, as prefilled
            self.jobs, self.cache, self.mask = [job], cache, mask
            return
        if not self.jobs:
            parts = [(cache, mask, None, 0)]
        else:
            parts = [(self.cache, self.mask, None, 0), (cache, mask, None, 0)]
        self.jobs.append(job)
        self._assemble(parts)

    def _keep(self, rows: list[int]) -> None:
        """Keep batch rows ``rows``; cut the columns that are padding in all of them."""
        self.jobs = [self.jobs[i] for i in rows]
        if not rows:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(rows, device=self.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).int().argmax())  # the first column some row uses
        self._assemble([(self.cache, mask[:, start:], index, start)])

    def _assemble(self, parts) -> None:
        """Build the batch's cache from ``parts`` = [(cache, mask (b, L), rows, first
        column)], each right-aligned to the longest, with room for every row's remaining
        tokens."""
        length = max(mask.shape[1] for _, mask, _, _ in parts)
        room = length + max(job.remaining for job in self.jobs) + 1
        b = sum(mask.shape[0] for _, mask, _, _ in parts)
        first = parts[0][0].self_attn[0]
        dtype, device = first.k.dtype, first.k.device
        new = self.model.new_cache(b, room, dtype=dtype, device=device)
        self.mask = torch.zeros(b, length, dtype=torch.bool, device=device)
        row = 0
        for cache, mask, rows, start in parts:
            n, width = mask.shape
            at = length - width
            self.mask[row : row + n, at:] = mask
            for old, out in zip(cache.self_attn, new.self_attn, strict=True):
                for name in ("k", "v"):
                    src = getattr(old, name)
                    src = src if rows is None else src.index_select(0, rows)
                    getattr(out, name)[row : row + n, :, at:length] = src[
                        :, :, start : start + width
                    ]
                positions = old.positions if rows is None else old.positions.index_select(0, rows)
                out.positions[row : row + n, at:length] = positions[:, start : start + width]
            row += n
        for out in new.self_attn:
            out.length = length
        self.cache = new

    # ---------------------------------------------------------------------------------------
    # A request with its attention recorded (the live page)
    # ---------------------------------------------------------------------------------------

    def _run_alone(self, job: Job) -> None:
        """Decode one request with the attention weights of every step kept: for generated
        token t, the weights (layers, heads, positions) of the query that chose it (the last
        position of the input at that step)."""
        model = self.model
        # registered first, so that a token can be looked at while the reply still streams
        self.recordings[job.id] = {"prompt": job.request.prompt_ids, "job": job}
        while len(self.recordings) > self.keep_attention:
            self.recordings.popitem(last=False)
        # (1, P): the prompt first, then one token
        ids = torch.tensor([job.request.prompt_ids], device=self.device)
        cache = model.new_cache(1, ids.shape[1] + job.request.max_tokens, device=self.device)
        while True:
            x, attentions = model.hidden_states(ids, None, cache, return_attention=True)
            logits = model.lm_head(x[:, -1])  # (1, V)
            job.weights.append(torch.stack([a[0, :, -1] for a in attentions]).half().cpu())
            token = self._choose(job, _on_cpu(logits)[0])
            if self._emit(job, token):
                return
            ids = torch.tensor([[token]], device=self.device)
