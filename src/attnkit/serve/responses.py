"""OpenAI's response objects, built from the engine's events: choices, log-probabilities, usage
and stream chunks, for ``/v1/chat/completions`` and ``/v1/completions``.

A choice is collected as :class:`Answer`: the tokens as they came (id, log-probability, the
most likely alternatives) and the engine's final event. Log-probabilities follow OpenAI's two
formats: chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` and the
completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import Response, StreamingResponse

from attnkit.serve.formats import Reading
from attnkit.serve.schema import error_body

__all__ = [
    "PLAIN",
    "Answer",
    "chat_choice",
    "chat_logprobs",
    "completion_choice",
    "completion_logprobs",
    "respond",
    "sse",
    "stream_item",
    "usage",
]

Piece = Callable[[int], str]  # a token id's text
PLAIN = Reading()  # a text answer of a model that does not reason


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
    index: int, answer: Answer, piece: Piece, logprobs: bool, reading: Reading = PLAIN
) -> dict:
    """A chat choice, read as ``reading`` says: reasoning apart (``reasoning_content``), and a
    complete answer of calls as ``tool_calls`` (``content`` null, finish reason
    ``tool_calls``)."""
    message, finish = reading.message(answer.done["text"], answer.done["finish_reason"], index)
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


def usage(answers: list[Answer], per_prompt: int = 1) -> dict:
    """OpenAI's ``usage``: a prompt counted once for its ``per_prompt`` choices."""
    p = sum(a.done["prompt_tokens"] for a in answers[::per_prompt])
    c = sum(a.done["completion_tokens"] for a in answers)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def respond(
    core,
    body,
    requests,
    http,
    *,
    chat: bool,
    per_prompt: int = 1,
    echo=None,
    reading: Reading = PLAIN,
):
    """A chat completion (``chat``) or a completion for ``requests`` of ``core`` (the server's
    :class:`~attnkit.serve.core.Core`): whole, or streamed as
    OpenAI's chunks (reasoning as ``reasoning_content`` deltas; calls whole once complete)."""
    rid = ("chatcmpl-" if chat else "cmpl-") + f"{time.time_ns():x}"
    head = {"id": rid, "created": int(time.time()), "model": core.name}
    top, piece = (None if chat else body.logprobs), core.special

    def choice(index: int, answer: Answer) -> dict:
        if chat:
            return chat_choice(index, answer, piece, body.logprobs, reading)
        shown = None if echo is None else echo[index // per_prompt]
        return completion_choice(index, answer, piece, top, shown)

    if not body.stream:
        done = await core.answers(requests, http)
        if done is None:  # nobody is left to answer; the jobs were cancelled
            return Response(status_code=499)
        obj = "chat.completion" if chat else "text_completion"
        choices = [choice(i, a) for i, a in enumerate(done)]
        return {**head, "object": obj, "choices": choices, "usage": usage(done, per_prompt)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(item: dict, finish: str | None = None) -> str:
        return sse({**head, "object": obj, "choices": [{**item, "finish_reason": finish}]})

    async def stream():
        answers = [Answer() for _ in requests]
        splits = [
            reading.thinking.stream() if chat and reading.thinking else None for _ in requests
        ]
        if chat:
            for index in range(len(requests)):
                yield chunk(stream_item(index, None, piece, chat=True, first=True))
        async for index, event in core.stream(requests):
            if event["type"] == "error":
                status = event.get("status", 500)
                code = "timeout" if status == 504 else None
                yield sse(error_body(status, event["message"], code=code))
                continue
            answer, split = answers[index], splits[index]
            answer.add(event)
            final = event["type"] == "done"
            if split is not None and (event["type"] == "token" or final):
                item = stream_item(index, event if not final else None, piece, chat=True)
                said = "" if final else event["text"]
                for kind, text in split.push(said, final=final) or [("", "")]:
                    key = {"reasoning": "reasoning_content", "content": "content"}.get(kind)
                    delta = {key: text} if key and not (key == "content" and reading.calls) else {}
                    if delta or item["logprobs"]:  # a token's logprobs go with its first piece
                        yield chunk({**item, "delta": delta})
                    item["logprobs"] = None
            elif (
                reading.calls is None
                and event["type"] == "token"
                and (event["text"] or ("logprob" in event and not (chat and event.get("eos"))))
            ):
                yield chunk(stream_item(index, event, piece, chat=chat))
            if not final:
                continue
            if reading.calls:  # the calls (or the text), whole, now that they are complete
                whole = chat_choice(index, answer, piece, False, reading)
                delta = {
                    k: v for k, v in whole["message"].items() if k in ("content", "tool_calls")
                }
                for i, call in enumerate(delta.get("tool_calls") or []):
                    call["index"] = i
                yield chunk(
                    {"index": index, "delta": delta, "logprobs": None}, whole["finish_reason"]
                )
            else:
                yield chunk(stream_item(index, None, piece, chat=chat), event["finish_reason"])
        if include_usage and all(a.done for a in answers):
            yield sse({**head, "object": obj, "choices": [], "usage": usage(answers, per_prompt)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def sse(data: dict) -> str:
    """One server-sent event of JSON data."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
