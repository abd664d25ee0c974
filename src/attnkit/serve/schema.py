"""The request bodies the server takes, and its errors, in OpenAI's shapes.

Unknown fields are refused (``extra="forbid"``): a typo should not pass silently. A field that
OpenAI's API defines but attnkit cannot honour is accepted by the schema and refused by
:func:`refuse_unsupported` with a 400 that names it and says why, so that a client learns what
is missing rather than reading "unknown field".
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

__all__ = [
    "AttentionBody",
    "ChatBody",
    "CompletionBody",
    "DetokenizeBody",
    "StrictBody",
    "TokenizeBody",
    "anthropic_error",
    "check_model",
    "error",
    "error_body",
    "in_shape",
    "openai_errors",
    "refuse_unsupported",
    "validation_message",
]


class StrictBody(BaseModel):
    """A request body that refuses unknown fields."""

    model_config = ConfigDict(extra="forbid")


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class CalledFunction(StrictBody):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    reasoning_content: str | None = None  # an assistant's reasoning, given back

    def for_template(self) -> dict:
        """The message as ``transformers`` hands it to a template that takes tools: the text
        ("" for none), an assistant's calls with their arguments as objects, a tool answer's
        call id, the reasoning given back."""
        out = {"role": self.role, "content": self.text() if self.content else ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _json_or_text(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        extra = {
            "name": self.name,
            "tool_call_id": self.tool_call_id,
            "reasoning_content": self.reasoning_content,
        }
        return {**out, **{k: v for k, v in extra.items() if v is not None}}

    def text(self) -> str:
        """What the template shows of the message: its content; an assistant's tool calls as
        the JSON the model wrote for them."""
        if self.tool_calls and not self.content:
            calls = [
                {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}
                for c in self.tool_calls
            ]
            return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        if self.content is None:
            raise error(400, f"a {self.role} message needs content", "messages")
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class Function(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: Function


class ChosenFunction(StrictBody):
    name: str


class ToolChoice(StrictBody):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(StrictBody):
    include_usage: bool = False


class JSONSchema(StrictBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    """``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    def schema(self) -> dict | None:
        """The JSON schema the answer must follow (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            raise error(
                400, "response_format: type json_schema needs a json_schema", "response_format"
            )
        return self.json_schema.schema_ or {}


# Fields of OpenAI's API that attnkit does not honour yet, and why (each refused by name).
UNSUPPORTED = {
    "functions": "function calls (the older form of tools) are not implemented",
    "function_call": "function calls (the older form of tools) are not implemented",
    "audio": "the served model reads and writes text only",
    "modalities": "the served model reads and writes text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the served model has no reasoning modes",
    "web_search_options": "the server has no web search",
    "suffix": "the served model cannot fill in the middle",
    "best_of": "best_of is not implemented: ask for n choices and pick one",
}


class _Sampling(StrictBody):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # fields of OpenAI's API that change nothing here, accepted as they are
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise error(400, f"stop takes at most 4 strings, got {len(stops)}", "stop")
        return stops

    def bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` as {token id: bias}, checked (ids in the vocabulary, biases in
        [-100, 100], as OpenAI's)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                raise error(
                    400,
                    f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r}",
                    "logit_bias",
                )
            if not -100 <= value <= 100:
                raise error(
                    400, f"logit_bias: biases must be in [-100, 100], got {value}", "logit_bias"
                )
            out[int(key)] = float(value)
        return out


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: Any = None
    best_of: Any = None


class AttentionBody(StrictBody):
    prompt: str
    max_tokens: int = Field(default=48, ge=1, le=512)
    chat: bool = True
    temperature: float = Field(default=0.0, ge=0, le=2)


class TokenizeBody(StrictBody):
    """``POST /tokenize`` in llama.cpp's form (``content``, ``add_special``) or vLLM's
    (``prompt``, ``add_special_tokens``; lm-eval's remote tokenizer sends it)."""

    content: str | None = None
    prompt: str | None = None
    add_special: bool | None = None
    add_special_tokens: bool | None = None
    with_pieces: bool = False

    def text(self) -> str:
        text = self.content if self.content is not None else self.prompt
        if text is None:
            raise error(400, "missing field 'content' (or 'prompt')", "content")
        return text

    def special(self) -> bool:
        return bool(self.add_special or self.add_special_tokens)


class DetokenizeBody(StrictBody):
    """llama.cpp server's ``POST /detokenize``."""

    tokens: list[int]


def refuse_unsupported(body: BaseModel, fields: dict[str, str] = UNSUPPORTED) -> None:
    """A 400 naming the first of ``fields`` (name: why) that ``body`` sets: a field of the API
    that attnkit cannot honour (by default, OpenAI's chat and completion fields)."""
    for name, why in fields.items():
        if getattr(body, name, None) not in (None, False):
            raise error(400, f"{name} is not supported by attnkit serve: {why}", name)


# --------------------------------------------------------------------------------------------
# Errors in OpenAI's shape
# --------------------------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
}


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
) -> dict:
    """OpenAI's error object; ``kind`` is its type (by default the status's)."""
    kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
    kind: str | None = None,
) -> HTTPException:
    body = error_body(status, message, param, code, kind)
    return HTTPException(status, json.dumps(body), headers)


# Anthropic's error types by status (its Messages API answers in its own shape)
_ANTHROPIC = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(body: dict, status: int) -> dict:
    """OpenAI's error object ``body`` in Anthropic's shape:
    ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def in_shape(path: str, body: dict, status: int) -> dict:
    """An error for a request to ``path``: Anthropic's shape on its routes, OpenAI's elsewhere."""
    return anthropic_error(body, status) if path.startswith("/v1/messages") else body


_MEMBERS = {"str", "int", "float", "bool", "function-after", "literal"}


def validation_message(problem: RequestValidationError) -> tuple[str, str | None]:
    first = problem.errors()[0]
    # the path to the field, without pydantic's names of a union's members ("str", "list[...]")
    where = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _MEMBERS]
    where = [p for p in where if "[" not in p]
    param = ".".join(where) or None
    if first.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    if first.get("type") == "missing":
        return f"missing field {param!r}", param
    received = first.get("input")
    shown = json.dumps(received)[:80] if not isinstance(received, bytes) else "bytes"
    return f"{param or 'body'}: {first.get('msg', 'invalid')} (got {shown})", param


def check_model(model: str | None, name: str) -> None:
    """404 ``model_not_found``, as OpenAI answers, for a ``model`` other than the served one."""
    if model is not None and model != name:
        raise error(
            404,
            f"The model '{model}' does not exist: this server serves '{name}'",
            "model",
            "model_not_found",
            kind="invalid_request_error",
        )


def openai_errors(app):
    """Answer ``app``'s validation errors and HTTP errors as OpenAI's error object; returns
    the HTTP error handler (for handlers that hand errors on to it)."""
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def invalid(request, problem: RequestValidationError):
        message, param = validation_message(problem)
        body = in_shape(request.url.path, error_body(400, message, param), 400)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, problem: HTTPException):
        try:
            body = json.loads(problem.detail)
        except (TypeError, ValueError):
            body = error_body(problem.status_code, str(problem.detail))
        body = in_shape(request.url.path, body, problem.status_code)
        return JSONResponse(body, status_code=problem.status_code, headers=problem.headers)

    return http_error
