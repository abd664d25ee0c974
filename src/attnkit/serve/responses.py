"""OpenAI's response objects, built from the engine's events: choices, log-probabilities, usage
and stream chunks, for ``/v1/chat/completions`` and ``/v1/completions``.

A choice is collected as :class:`Answer`: the tokens as they came (id, log-probability, the
most likely alternatives) and the engine's final event. Log-probabilities follow OpenAI's two
formats: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the
completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.serve.tools import tool_calls

__all__ = [
    "Answer",
    "call_item",
    "chat_choice",
    "chat_logprobs",
    "completion_choice",
    "completion_logprobs",
    "stream_item",
]

Piece = Callable[[int], str]  # a token id's text


@dataclass
class Answer:
    """One choice as it came from the engine."""

    tokens: list[tuple[int, float | None, list]] = field(default_factory=list)
    done: dict | None = None
    eos: tuple | None = None  # the EOS token that ended it, with its logprob (completions list it)

    def add(self, event: dict) -> None:
        if event["type"] == "token" and event["id"] is not None and "logprob" in event:
            scored = (event["id"], event["logprob"], event["top"])
            if event.get("eos"):
                self.eos = scored
            else:
                self.tokens.append(scored)
        elif event["type"] == "done":
            self.done = event


def _entry(piece: Piece, token: int, logprob: float) -> dict:
    text = piece(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(piece: Piece, tokens: list) -> dict:
    """Chat's ``logprobs`` object for [(id, logprob, top)]."""
    content = []
    for token, logprob, top in tokens:
        entry = _entry(piece, token, logprob)
        entry["top_logprobs"] = [_entry(piece, t, lp) for t, lp in top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(piece: Piece, tokens: list, offset: int = 0) -> dict:
    """The completions' ``logprobs`` object for [(id, logprob or None, top or None)]; text
    offsets count from ``offset`` characters."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in tokens:
        text = piece(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {piece(t): lp for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_choice(
    index: int, answer: Answer, piece: Piece, logprobs: bool, tools: bool = False
) -> dict:
    """A chat choice; with ``tools``, a complete answer is a tool call (``tool_calls``,
    ``content`` null, finish reason ``tool_calls``)."""
    message = {"role": "assistant", "content": answer.done["text"], "refusal": None}
    finish = answer.done["finish_reason"]
    calls = tool_calls(answer.done["text"], index) if tools and finish == "stop" else None
    if calls:
        message.update(content=None, tool_calls=calls)
        finish = "tool_calls"
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(piece, answer.tokens) if logprobs else None,
        "finish_reason": finish,
    }


def completion_choice(
    index: int, answer: Answer, piece: Piece, logprobs: int | None, echo: str | None
) -> dict:
    """A completion choice; ``echo`` is the prompt's text when it is echoed (its tokens'
    log-probabilities come first)."""
    text = answer.done["text"]
    scores = None
    if logprobs is not None:
        prompt = answer.done.get("prompt_logprobs", []) if echo is not None else []
        ended = [answer.eos] if answer.eos else []
        scores = completion_logprobs(piece, [*prompt, *answer.tokens, *ended])
    return {
        "index": index,
        "text": text if echo is None else echo + text,
        "logprobs": scores,
        "finish_reason": answer.done["finish_reason"],
    }


def stream_item(index: int, event: dict | None, piece: Piece, *, chat: bool, first=False) -> dict:
    """One choice of a stream chunk for a token event (None: no text; ``first``: chat's role)."""
    text = event["text"] if event else None
    scores = None
    if event is not None and "logprob" in event and event["id"] is not None:
        tokens = [(event["id"], event["logprob"], event["top"])]
        scores = chat_logprobs(piece, tokens) if chat else completion_logprobs(piece, tokens)
    if not chat:
        return {"index": index, "text": text or "", "logprobs": scores}
    delta = {"role": "assistant", "content": ""} if first else {}
    if text:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": scores}


def call_item(index: int, answer: Answer, piece: Piece) -> tuple[dict, str]:
    """A tool-call answer as one stream chunk's choice (the call whole), and its finish
    reason."""
    whole = chat_choice(index, answer, piece, False, tools=True)
    delta = {k: v for k, v in whole["message"].items() if k in ("content", "tool_calls")}
    for i, call in enumerate(delta.get("tool_calls") or []):
        call["index"] = i
    return {"index": index, "delta": delta, "logprobs": None}, whole["finish_reason"]
