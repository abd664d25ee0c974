"""What the server's APIs share: one chat pipeline that OpenAI's chat completions, its Responses
API and Anthropic's Messages API each translate into and out of.

A Responses or Messages request becomes a :class:`~attnkit.serve.schema.ChatBody` (messages,
tools, the answer's format, sampling), goes through the same template, grammar and engine as a
chat completion, and its :class:`~attnkit.serve.responses.Answer` is told back in that API's
shape. So one question asked through the three routes gets the same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from attnkit.serve.engine import Engine
from attnkit.serve.formats import Reading
from attnkit.serve.jobs import Request
from attnkit.serve.responses import Answer
from attnkit.serve.schema import ChatBody

__all__ = ["Core", "disconnected", "pieces", "unless_client_leaves"]


@dataclass(frozen=True)
class Core:
    """The served model's name, its engine, a token's text (``special``) and the chat
    pipeline: ``chat_prompt(body)`` gives (prompt ids, grammar, how the answer is read),
    ``chat_requests(body)`` the engine's checked and admitted requests and how they are read,
    ``answers(requests, http)`` the whole answers (None when the client left),
    ``stream(requests)`` (index, event) as they come (a last (None, error event) past the
    timeout)."""

    name: str
    engine: Engine
    special: Callable[[int], str]
    chat_prompt: Callable[[ChatBody], tuple[list[int], str | None, Reading]]
    chat_requests: Callable[[ChatBody], tuple[list[Request], Reading]]
    answers: Callable[[list[Request], object], Awaitable[list[Answer] | None]]
    stream: Callable[[list[Request]], AsyncIterator[tuple[int | None, dict]]]


async def unless_client_leaves(work, http):
    """``await work``, unless the client closes its connection first: then ``work`` is
    cancelled (which cancels its job and frees its row in the batch) and the result is None.
    A streamed reply notices on its own (its generator is closed); a whole one would
    otherwise decode to the end for nobody."""
    task = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({task, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (the server stopping)
        leaving.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task.done() else None


async def disconnected(http) -> None:
    """Return once the server reports the client gone. The body has been read by then, so the
    next ASGI message is ``http.disconnect`` (sent when the connection closes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def pieces(core: Core, request: Request, reading: Reading):
    """One request's answer as it comes, told apart: ("reasoning", text) and ("content", text)
    pieces (none of the content when the answer may be calls: those come whole at the end),
    then ("done", the :class:`Answer`), or ("error", the engine's error event)."""
    answer = Answer()
    split = reading.thinking.stream() if reading.thinking else None
    async for _, event in core.stream([request]):
        if event["type"] == "error":
            yield "error", event
            return
        answer.add(event)
        final = event["type"] == "done"
        text = event.get("text", "") if event["type"] == "token" else ""
        found = split.push(text, final=final) if split else [("content", text)]
        for kind, piece in found:
            if piece and not (kind == "content" and reading.calls):
                yield kind, piece
    yield "done", answer
