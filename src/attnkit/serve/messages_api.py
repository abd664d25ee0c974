"""Anthropic's Messages API, ``POST /v1/messages`` (what Claude Code and the ``anthropic`` SDK
speak), and ``POST /v1/messages/count_tokens``, on the chat pipeline of
:mod:`attnkit.serve.core`.

``system`` and the messages' content blocks (``text``, ``tool_use``, ``tool_result``;
``thinking`` blocks are dropped) become chat messages; ``tools`` (``name``, ``description``,
``input_schema``), ``tool_choice`` (auto, any, tool, none), ``output_config.format`` (a JSON
schema), ``stop_sequences``, ``max_tokens``, and ``temperature`` and ``top_p`` (which earlier
versions of the API took) become a chat body's. The answer comes back as content blocks
(``text``, ``tool_use``) with Anthropic's stop reasons (``end_turn``, ``max_tokens``,
``stop_sequence``, ``tool_use``) and usage; streamed, as its events (``message_start``,
``content_block_start`` / ``delta`` / ``stop``, ``message_delta``, ``message_stop``). Errors on
these routes take Anthropic's shape (:func:`attnkit.serve.schema.anthropic_error`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from attnkit.serve.core import Core, pieces
from attnkit.serve.formats import Reading
from attnkit.serve.responses import Answer, chat_choice
from attnkit.serve.schema import (
    ChatBody,
    StrictBody,
    check_model,
    error,
    refuse_unsupported,
    validation_message,
)

__all__ = ["CountBody", "MessagesBody", "add_messages_api"]

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


class CountBody(StrictBody):
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format (a JSON schema) holds the answer
    output_format: dict[str, Any] | None = None  # the same, as count_tokens also takes it
    # accepted, change nothing here
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def schema(self) -> dict | None:
        """The JSON schema the answer must follow (None: free text)."""
        form = (self.output_config or {}).get("format") or self.output_format
        if not form:
            return None
        if form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise error(
                400,
                "output_config.format: expected {'type': 'json_schema', 'schema': {...}}",
                "output_config",
            )
        return form["schema"]


class MessagesBody(CountBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)  # (earlier versions of the API)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    # accepted, change nothing here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    # refused by name
    top_k: int | None = None
    container: Any = None
    mcp_servers: Any = None


_REFUSED = {
    "top_k": "sampling takes temperature and top_p",
    "container": "the server runs no code",
    "mcp_servers": "the server connects to no MCP server",
}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content or []):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise error(
                400,
                f"{where}[{j}]: block type {kind!r} is not supported here: "
                "the served model reads text only",
                where,
            )
        texts.append(block.get("text", ""))
    return "".join(texts)


def _messages(body: CountBody) -> list[dict]:
    """Chat messages for ``system`` and the Anthropic messages."""
    out = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    calls: set[str] = set()
    for i, message in enumerate(body.messages):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise error(400, f"{where}.role: expected user or assistant, got {role!r}", where)
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise error(400, f"{where}.content: expected a string or a list of blocks", where)
        texts, uses = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "tool_use" and role == "assistant":
                calls.add(block.get("id"))
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                uses.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": arguments},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if block.get("tool_use_id") not in calls:
                    raise error(
                        400,
                        f"{at}: tool_result for tool_use_id "
                        f"{block.get('tool_use_id')!r}, which no tool_use in the "
                        "conversation made",
                        at,
                    )
                answer = _text(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    answer = f"Error: {answer}"
                out.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": answer}
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise error(
                    400,
                    f"{at}: block type {kind!r} is not supported in a {role} message"
                    " by attnkit serve (text, tool_use, tool_result)",
                    at,
                )
        if uses:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": uses})
        elif texts or role == "assistant":
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(body: CountBody) -> tuple[list[dict] | None, Any]:
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") not in (None, "custom") or "input_schema" not in tool:
                raise error(
                    400,
                    f"tools[{i}]: type {tool.get('type')!r} is not supported by "
                    "attnkit serve: only custom tools (name, input_schema)",
                    f"tools[{i}]",
                )
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise error(
                400,
                f"tool_choice.type: expected auto, any, tool or none, got {kind!r}",
                "tool_choice",
            )
    return tools, choice


def _chat_body(body: CountBody) -> ChatBody:
    tools, choice = _tools(body)
    fields = dict(messages=_messages(body), tools=tools, tool_choice=choice)
    schema = body.schema()
    if schema is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        }
    if isinstance(body, MessagesBody):
        refuse_unsupported(body, _REFUSED)
        if len(body.stop_sequences or []) > 4:
            raise error(400, "stop_sequences: at most 4 strings", "stop_sequences")
        fields.update(
            max_completion_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop_sequences,
        )
    try:
        return ChatBody.model_validate(fields)
    except ValidationError as problem:
        message, param = validation_message(problem)
        raise error(400, message, param) from None


def _content(core: Core, answer: Answer, reading: Reading) -> tuple[list[dict], str, str | None]:
    """The content blocks (thinking, text, tool uses), the stop reason and the stop sequence of
    an answer."""
    choice = chat_choice(0, answer, core.special, False, reading)
    message, blocks = choice["message"], []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    stop = answer.done.get("stop_sequence")
    reason = "stop_sequence" if stop else _STOP_REASONS[choice["finish_reason"]]
    return blocks, reason, stop


def add_messages_api(app: FastAPI, core: Core) -> None:
    """Add ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` to ``app``."""

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountBody):
        check_model(body.model, core.name)
        ids, _, _ = core.chat_prompt(_chat_body(body))
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    async def messages(body: MessagesBody, http: HTTPRequest):
        check_model(body.model, core.name)
        (request,), reading = core.chat_requests(_chat_body(body))
        head = {
            "id": f"msg_{time.time_ns():x}",
            "type": "message",
            "role": "assistant",
            "model": core.name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }
        if not body.stream:
            answers = await core.answers([request], http)
            if answers is None:
                return Response(status_code=499)
            blocks, reason, stop = _content(core, answers[0], reading)
            done = answers[0].done
            usage = {
                "input_tokens": done["prompt_tokens"],
                "output_tokens": done["completion_tokens"],
            }
            return {
                **head,
                "content": blocks,
                "stop_reason": reason,
                "stop_sequence": stop,
                "usage": usage,
            }
        start = {**head, "usage": {"input_tokens": len(request.prompt_ids), "output_tokens": 0}}
        return StreamingResponse(
            _stream(core, request, reading, start), media_type="text/event-stream"
        )


def _event(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


_DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


async def _stream(core: Core, request, reading: Reading, start: dict):
    """The events of one message: its start, each content block in order (thinking and text
    token by token as they come; tool uses, and text that may have been one, whole once
    complete), the stop reason with the usage, the end."""

    def delta(index: int, kind: str, text: str) -> str:
        name, key = _DELTAS[kind]
        return _event("content_block_delta", index=index, delta={"type": name, key: text})

    def opening(index: int, kind: str) -> str:
        block = {"type": kind, kind: ""}
        if kind == "thinking":
            block["signature"] = ""
        return _event("content_block_start", index=index, content_block=block)

    yield _event("message_start", message=start)
    streamed: list[str] = []  # the kinds of the blocks opened so far
    async for kind, piece in pieces(core, request, reading):
        if kind == "error":
            name = "timeout_error" if piece.get("status") == 504 else "api_error"
            yield _event("error", error={"type": name, "message": piece["message"]})
            return
        if kind == "done":
            answer = piece
            break
        kind = "thinking" if kind == "reasoning" else "text"
        if not streamed or streamed[-1] != kind:
            if streamed:
                yield _event("content_block_stop", index=len(streamed) - 1)
            streamed.append(kind)
            yield opening(len(streamed) - 1, kind)
        yield delta(len(streamed) - 1, kind, piece)
    if streamed:
        yield _event("content_block_stop", index=len(streamed) - 1)
    blocks, reason, stop = _content(core, answer, reading)
    for index, block in enumerate(blocks[len(streamed) :], start=len(streamed)):
        if block["type"] == "tool_use":
            yield _event("content_block_start", index=index, content_block={**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            yield _event(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": partial},
            )
        else:
            yield opening(index, block["type"])
            yield delta(index, block["type"], block[block["type"]])
        yield _event("content_block_stop", index=index)
    usage = {"output_tokens": answer.done["completion_tokens"]}
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop}, usage=usage)
    yield _event("message_stop")
