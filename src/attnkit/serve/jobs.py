"""What the serving engine answers: a request (:class:`Request`, what to generate) and its state
while it is being answered (:class:`Job`, on the engine's thread: its text so far, its random
generator, its grammar's matcher, whether its client went away)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit.serve.chat import TextStream

__all__ = ["Job", "Request", "Sink"]

Sink = Callable[[dict], None]  # receives a request's events


@dataclass
class Request:
    """What to generate. ``temperature`` 0 is greedy decoding.

    - ``logprobs``: each token event carries the token's log-probability under the model
      (``log_softmax`` of its logits, before penalties, bias and temperature) and the
      ``logprobs`` most likely tokens with theirs; None: nothing.
    - ``prompt_logprobs``: the done event carries the prompt's tokens with their
      log-probabilities too (the first has none); ``max_tokens`` may then be 0.
    - ``frequency_penalty``, ``presence_penalty``: subtracted from the logit of each token
      already generated, times its count and once (OpenAI's penalties); ``logit_bias``:
      {token id: added to its logit}.
    - ``grammar``: an llguidance grammar (``Grammars.json_schema``) the reply must follow:
      each step's logits are masked to the tokens it allows (:mod:`attnkit.serve.grammar`),
      and the reply ends when the grammar is complete.
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    attention: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None


class Job:
    """A request being answered: its state on the engine's thread."""

    _ids = itertools.count(1)

    def __init__(self, request: Request, sink: Sink, tokenizer, grammars=None) -> None:
        self.id = f"{next(self._ids)}-{int(time.time() * 1000) % 10**9}"
        self.request, self.sink = request, sink
        self.text = TextStream(tokenizer, request.stop)
        self.generated: list[int] = []
        self.cancelled = threading.Event()
        self.generator = None
        if request.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(
                request.seed if request.seed is not None else torch.seed() % 2**63
            )
        self.weights: list[Tensor] = []  # attention=True: (layers, heads, positions) per token
        self.scores: dict | None = None  # logprobs: the last chosen token's (logprob, top)
        self.prompt_scores: list | None = None  # prompt_logprobs: per prompt token
        bias = request.logit_bias
        self.bias = (torch.tensor(list(bias)), torch.tensor(list(bias.values()))) if bias else None
        self.matcher = None if request.grammar is None else grammars.matcher(request.grammar)

    def cancel(self) -> None:
        """The client went away: the row is dropped at the next step."""
        self.cancelled.set()

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.generated)
