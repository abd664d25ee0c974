"""OpenAI's Responses API, ``POST /v1/responses`` (what Codex CLI and the Agents SDK speak), on
the chat pipeline of :mod:`attnkit.serve.core`.

A request's ``instructions`` and ``input`` (a string, or items: messages, ``function_call``,
``function_call_output``; ``reasoning`` items are dropped) become chat messages; ``tools``
(function tools), ``tool_choice``, ``text.format``, ``max_output_tokens``, ``temperature`` and
``top_p`` become a chat body's. The answer comes back as output items (a ``message`` with
``output_text``, ``function_call`` items, a ``reasoning`` item), with ``usage``; streamed, as
the API's typed events, numbered by ``sequence_number``.

A response is kept in memory (the latest :data:`KEPT`, unless ``store`` is false), so a
follow-up may name it in ``previous_response_id``: its conversation (input and output, not its
instructions) goes before the new input. ``GET`` and ``DELETE /v1/responses/{id}`` read and
forget one.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any, Literal

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

__all__ = ["KEPT", "ResponsesBody", "add_responses_api"]

KEPT = 1000  # responses kept for previous_response_id (the oldest is forgotten first)


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(StrictBody):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, changes nothing


class ResponsesBody(StrictBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    # fields of the API that change nothing here, accepted as they are
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # none are returned here
    # fields attnkit refuses by name
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None


_REFUSED = {
    "background": "responses are answered while the request waits",
    "prompt": "stored prompt templates live on OpenAI's servers",
    "conversation": "conversations are not kept: use previous_response_id",
}


def _messages(items: list[dict], known_calls: set[str]) -> list[dict]:
    """Chat messages for Responses input items; ``known_calls`` (the calls made earlier in the
    conversation) grows by the function calls met."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise error(
                    400,
                    f"{where}.role: expected user, system, developer or assistant, got {role!r}",
                    f"{where}.role",
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise error(400, f"{where}: a function_call needs call_id and name", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments") or "{}"},
            }
            known_calls.add(call_id)
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise error(
                    400,
                    f"{where}: function_call_output for call_id {call_id!r}, which no "
                    "function_call in the conversation made",
                    f"{where}.call_id",
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # the model's earlier thoughts are not shown to it again
        else:
            raise error(
                400,
                f"{where}: unknown item type {kind!r}; expected message, "
                "function_call, function_call_output or reasoning",
                f"{where}.type",
            )
    return messages


def _text(content, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise error(400, f"{where}.content: expected a string or a list of parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            texts.append(part.get("text") or part.get("refusal") or "")
        else:
            raise error(
                400,
                f"{where}.content: part type {kind!r} is not supported by attnkit "
                "serve: the served model reads text only",
                f"{where}.content",
            )
    return "".join(texts)


def _tools(body: ResponsesBody) -> tuple[list[dict] | None, Any]:
    """The chat body's ``tools`` and ``tool_choice`` for the Responses ones."""
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise error(
                    400,
                    f"tools[{i}]: type {tool.get('type')!r} is not supported by "
                    "attnkit serve: only function tools",
                    f"tools[{i}].type",
                )
            function = {
                k: tool[k]
                for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None
            }
            tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise error(
                400,
                "tool_choice: expected auto, none, required or {'type': 'function', 'name': ...}",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def add_responses_api(app: FastAPI, core: Core) -> None:
    """Add ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` to ``app``."""
    kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def chat_body(body: ResponsesBody) -> tuple[ChatBody, list[dict]]:
        """The chat body for a request, and its conversation (without the instructions)."""
        refuse_unsupported(body, _REFUSED)
        history, known = [], set()
        if body.previous_response_id is not None:
            if body.previous_response_id not in kept:
                raise error(
                    404,
                    f"previous_response_id: no response {body.previous_response_id!r} is kept here",
                    "previous_response_id",
                )
            history = [dict(m) for m in kept[body.previous_response_id][1]]
            known = {c["id"] for m in history for c in m.get("tool_calls") or []}
        items = (
            [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        )
        conversation = history + _messages(items, known)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools, choice = _tools(body)
        form = body.text.format if body.text and body.text.format else None
        fields = dict(
            messages=system + conversation,
            tools=tools,
            tool_choice=choice,
            max_completion_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
        )
        if form is not None and form.type != "text":
            schema = {"name": form.name or "answer", "schema": form.schema_, "strict": form.strict}
            fields["response_format"] = {"type": form.type, "json_schema": schema}
            if form.type == "json_object":
                fields["response_format"].pop("json_schema")
        try:
            return ChatBody.model_validate(fields), conversation
        except ValidationError as problem:
            message, param = validation_message(problem)
            raise error(400, message, param) from None

    def head(body: ResponsesBody, rid: str) -> dict:
        form = body.text.format if body.text and body.text.format else TextFormat()
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": core.name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": form.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def finished(response: dict, answer: Answer, reading: Reading) -> tuple[dict, list[dict]]:
        """``response`` completed by ``answer``: its output items (reasoning, calls, message),
        status and usage; and the assistant's messages for the conversation kept."""
        choice = chat_choice(0, answer, core.special, False, reading)
        message, stamp = choice["message"], f"{time.time_ns():x}"
        output = []
        if message.get("reasoning_content") is not None:
            output.append(_reasoning_item(f"rs_{stamp}", message["reasoning_content"]))
        for i, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{stamp}_{i}",
                    "status": "completed",
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": function["arguments"],
                }
            )
        if message["content"] or (message["content"] is not None and not output):
            output.append(_message_item(f"msg_{stamp}", message["content"]))
        done = answer.done
        cut = done["finish_reason"] == "length"
        response.update(
            status="incomplete" if cut else "completed",
            output=output,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={
                "input_tokens": done["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": done["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
            },
        )
        said = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        return response, [said]

    def keep(body: ResponsesBody, response: dict, conversation: list[dict]) -> None:
        if body.store:
            kept[response["id"]] = (response, conversation)
            while len(kept) > KEPT:
                kept.popitem(last=False)

    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, http: HTTPRequest):
        check_model(body.model, core.name)
        chat, conversation = chat_body(body)
        (request,), reading = core.chat_requests(chat)
        response = head(body, f"resp_{time.time_ns():x}")
        if not body.stream:
            answers = await core.answers([request], http)
            if answers is None:
                return Response(status_code=499)
            response, said = finished(response, answers[0], reading)
            keep(body, response, conversation + said)
            return response
        stream = _stream(
            core,
            request,
            reading,
            response,
            finished,
            lambda r, said: keep(body, r, conversation + said),
        )
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        if rid not in kept:
            raise error(404, f"no response {rid!r} is kept here", "response_id")
        return kept[rid][0]

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if kept.pop(rid, None) is None:
            raise error(404, f"no response {rid!r} is kept here", "response_id")
        return {"id": rid, "object": "response", "deleted": True}


def _message_item(item_id: str, text: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": text}],
    }


_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


async def _stream(core: Core, request, reading: Reading, response: dict, finished, keep):
    """The typed events of one response: created, in progress, the output items in order
    (reasoning and text token by token as they come; calls, and text that may have been one,
    whole once complete), completed (or incomplete)."""
    number, stamp = 0, f"{time.time_ns():x}"
    ids = {"reasoning": f"rs_{stamp}", "message": f"msg_{stamp}"}

    def event(kind: str, **data) -> str:
        nonlocal number
        number += 1
        payload = {"type": kind, "sequence_number": number - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def opening(index: int, item: dict) -> list[str]:
        shown = {**item, "status": "in_progress"}
        if item["type"] == "function_call":
            return [
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**shown, "arguments": ""},
                )
            ]
        part = {**item["content"][0], "text": ""}
        return [
            event("response.output_item.added", output_index=index, item={**shown, "content": []}),
            event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def delta(index: int, item: dict, text: str) -> str:
        if item["type"] == "function_call":
            return event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=text,
            )
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return event(
            _DELTA[item["type"]],
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=text,
            **extra,
        )

    def closing(index: int, item: dict) -> list[str]:
        if item["type"] == "function_call":
            done = event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            where = dict(item_id=item["id"], output_index=index, content_index=0)
            done = [
                event(_DONE[item["type"]], **where, text=part["text"], **extra),
                event("response.content_part.done", **where, part=part),
            ]
        done = done if isinstance(done, list) else [done]
        return [*done, event("response.output_item.done", output_index=index, item=item)]

    yield event("response.created", response=json.loads(json.dumps(response)))
    yield event("response.in_progress", response=json.loads(json.dumps(response)))
    streamed: list[dict] = []  # the items opened so far, in order (reasoning, then message)
    answer = None
    async for kind, piece in pieces(core, request, reading):
        if kind == "error":
            code = "timeout" if piece.get("status") == 504 else "server_error"
            yield event("error", code=code, message=piece["message"], param=None)
            return
        if kind == "done":
            answer = piece
            break
        item = (
            _reasoning_item(ids["reasoning"], "")
            if kind == "reasoning"
            else _message_item(ids["message"], "")
        )
        if not streamed or streamed[-1]["type"] != item["type"]:
            streamed.append(item)
            for e in opening(len(streamed) - 1, item):
                yield e
        yield delta(len(streamed) - 1, item, piece)
    response, said = finished(response, answer, reading)
    keep(response, said)
    for index, item in enumerate(response["output"]):
        if item["type"] in ids:
            item["id"] = ids[item["type"]]
        if not any(s["type"] == item["type"] for s in streamed):  # it came whole
            for e in opening(index, item):
                yield e
            whole = item["arguments"] if item["type"] == "function_call" else None
            yield delta(index, item, whole if whole is not None else item["content"][0]["text"])
        for e in closing(index, item):
            yield e
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(kind, response=response)
