"""The HTTP side of ``attnkit serve``: OpenAI's chat and completion API, and the attention page.

Routes:

- ``POST /v1/chat/completions``: messages rendered with the model's chat template;
  ``max_tokens`` (or ``max_completion_tokens``), ``temperature`` (0 = greedy), ``top_p``,
  ``stop``, ``seed``, ``stream`` (server-sent events in OpenAI's chunk format, ending in
  ``data: [DONE]``; ``stream_options.include_usage`` adds the usage chunk).
- ``POST /v1/completions``: the same for a plain ``prompt``.
- ``GET /v1/models``, ``GET /health``.
- ``GET /``: the live attention page; ``POST /attnkit/generate`` streams a reply with its
  attention recorded and ``GET /attnkit/attention/{id}/{t}`` returns what each layer and head
  attended to when token ``t`` of it was produced.

Every error is OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with
a 4xx status: malformed JSON, unknown fields, wrong types, a prompt that is empty or does not
fit the context, a body over ``max_body`` bytes (413). A client that goes away mid-stream has its
row dropped from the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from attnkit.serve.chat import render_chat
from attnkit.serve.engine import Engine
from attnkit.serve.engine import Request as GenerationRequest

__all__ = ["create_app"]


# --------------------------------------------------------------------------------------------
# Request bodies: unknown fields are refused (extra="forbid"), as a typo should not pass silently
# --------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise _error(400, f"stop takes at most 4 strings, got {len(stops)}", "stop")
        return stops


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionBody(_Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class AttentionBody(_Body):
    prompt: str
    max_tokens: int = Field(default=48, ge=1, le=512)
    chat: bool = True
    temperature: float = Field(default=0.0, ge=0, le=2)


# --------------------------------------------------------------------------------------------
# Errors in OpenAI's shape
# --------------------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, param: str | None = None) -> HTTPException:
    return HTTPException(status, json.dumps(_error_body(status, message, param)))


_MEMBERS = {"str", "int", "float", "bool", "function-after", "literal"}


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
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


class _BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, before it is read into memory."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(
            _error_body(413, f"the request body is larger than {self.limit} bytes")
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


def create_app(
    model,
    tokenizer,
    *,
    name: str = "attnkit",
    template: str | None = None,
    max_batch: int = 8,
    max_body: int = 1 << 20,
    engine: Engine | None = None,
) -> FastAPI:
    """The server's ASGI app for a decoder-only ``model`` and its ``tokenizer``; ``template``
    is the chat template (see :func:`attnkit.serve.chat.chat_template_for`)."""
    engine = engine or Engine(model, tokenizer, max_batch=max_batch)
    created = int(time.time())

    def special(token_id):
        if token_id is None:
            return ""
        return tokenizer.decode([token_id], skip_special=False)

    bos, eos = (
        special(getattr(tokenizer, "bos_id", None)),
        special(getattr(tokenizer, "eos_id", None)),
    )

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = FastAPI(title="attnkit", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        message, param = _validation_message(error)
        return JSONResponse(_error_body(400, message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        try:
            body = json.loads(error.detail)
        except (TypeError, ValueError):
            body = _error_body(error.status_code, str(error.detail))
        return JSONResponse(body, status_code=error.status_code)

    def encode(text: str) -> list[int]:
        """The ids ``generate`` would use; a template that wrote BOS itself gets no second."""
        if bos and text.startswith(bos) and _takes_flag(tokenizer):
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text)

    def prepare(prompt: str, body: _Sampling, max_tokens: int | None, param: str):
        if not prompt.strip():
            raise _error(400, "the prompt is empty", param)
        ids = encode(prompt)
        if not ids:
            raise _error(400, "the prompt is empty", param)
        room = engine.context - len(ids)
        if max_tokens is None:
            max_tokens = min(512, room)
        request = GenerationRequest(
            ids,
            max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stops(),
        )
        try:
            engine.check(request)
        except ValueError as error:
            raise _error(400, str(error), "max_tokens" if room > 0 else param) from None
        return request

    async def events(request: GenerationRequest):
        """Submit, then yield the job, then the engine's events as they come; a client that
        goes away (the generator is closed) cancels the job."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        job = engine.submit(request, lambda e: loop.call_soon_threadsafe(inbox.put_nowait, e))
        try:
            yield job
            while True:
                event = await inbox.get()
                yield event
                if event["type"] != "token":
                    return
        finally:
            job.cancel()  # a no-op once the request is done; frees the row otherwise

    def usage(done: dict) -> dict:
        p, c = done["prompt_tokens"], done["completion_tokens"]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def whole(request: GenerationRequest) -> dict:
        """The engine's last event for a request answered whole (not streamed)."""
        done = None
        async for event in _after_job(events(request)):
            if event["type"] == "error":
                raise _error(500, event["message"])
            done = event if event["type"] == "done" else done
        return done

    async def respond(body: _Sampling, request: GenerationRequest, chat: bool, http: HTTPRequest):
        rid = ("chatcmpl-" if chat else "cmpl-") + f"{time.time_ns():x}"
        head = {"id": rid, "created": int(time.time()), "model": name}
        if not body.stream:
            done = await _unless_client_leaves(whole(request), http)
            if done is None:  # nobody is left to answer; the job was cancelled
                return Response(status_code=499)
            if chat:
                message = {"role": "assistant", "content": done["text"]}
                choice = {"index": 0, "message": message, "finish_reason": done["finish_reason"]}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"]}
                choice["logprobs"] = None
                obj = "text_completion"
            return {**head, "object": obj, "choices": [choice], "usage": usage(done)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            data = {**head, "object": obj, "choices": [choice]}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def stream():
            if chat:
                yield chunk(None, None, first=True)
            async for event in _after_job(events(request)):
                if event["type"] == "token" and event["text"]:
                    yield chunk(event["text"], None)
                elif event["type"] == "done":
                    yield chunk(None, event["finish_reason"])
                    if include_usage:
                        data = {**head, "object": obj, "choices": [], "usage": usage(event)}
                        yield f"data: {json.dumps(data)}\n\n"
                elif event["type"] == "error":
                    yield f"data: {json.dumps(_error_body(500, event['message']))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def render(messages: list[dict]) -> str:
        try:
            return render_chat(template, messages, bos_token=bos, eos_token=eos)
        except ValueError as error:
            raise _error(400, str(error), "messages") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        limit = body.max_completion_tokens or body.max_tokens
        request = prepare(render(messages), body, limit, "messages")
        return await respond(body, request, chat=True, http=http)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise _error(400, f"prompt: one prompt per request, got {len(prompts)}", "prompt")
        request = prepare(prompts[0], body, body.max_tokens, "prompt")
        return await respond(body, request, chat=False, http=http)

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "attnkit"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "max_batch": engine.max_batch, **engine.stats()}

    # ---- the live attention page ----------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("attnkit.serve").joinpath("page.html").read_text("utf-8")

    @app.post("/attnkit/generate")
    async def generate_with_attention(body: AttentionBody):
        text = render([{"role": "user", "content": body.prompt}]) if body.chat else body.prompt
        sampling = _Sampling(temperature=body.temperature)
        request = prepare(text, sampling, body.max_tokens, "prompt")
        request.attention = True

        async def stream():
            async for event in events(request):
                if not isinstance(event, dict):  # the job: its id names the recording
                    tokens = [special(i) for i in request.prompt_ids]
                    yield _sse({"prompt": tokens, "id": event.id})
                elif event["type"] == "token":
                    yield _sse({"token": special(event["id"]) if event["id"] is not None else ""})
                elif event["type"] == "done":
                    yield _sse({"done": event["finish_reason"], "id": event["id"]})
                else:
                    yield _sse({"error": event["message"]})

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/attnkit/attention/{job_id}/{index}")
    async def attention(job_id: str, index: int):
        recording = engine.recording(job_id)
        if recording is None:
            raise _error(404, f"no recorded reply {job_id!r} (only the last few are kept)")
        job = recording["job"]
        if not 0 <= index < len(job.generated):
            raise _error(404, f"reply {job_id} has {len(job.generated)} tokens, not {index + 1}")
        weights = job.weights[index].float()  # (layers, heads, positions)
        ids = recording["prompt"] + job.generated[:index]
        return {
            "token": special(job.generated[index]),
            "context": [special(i) for i in ids],
            "weights": [
                [[round(w, 4) for w in head] for head in layer] for layer in weights.tolist()
            ],
        }

    @app.exception_handler(404)
    async def not_found(request, error):
        if isinstance(error, HTTPException) and error.detail.startswith("{"):
            return await http_error(request, error)
        return JSONResponse(_error_body(404, f"no route {request.url.path}"), status_code=404)

    app.add_middleware(_BodyLimit, limit=max_body)
    return app


async def _unless_client_leaves(work, http: HTTPRequest):
    """``await work``, unless the client closes its connection first: then ``work`` is
    cancelled (which cancels its job and frees its row in the batch) and the result is None.
    A streamed reply notices on its own (its generator is closed); a whole one would
    otherwise decode to the end for nobody."""
    task = asyncio.ensure_future(work)
    leaving = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (the server stopping)
        leaving.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task.done() else None


async def _disconnected(http: HTTPRequest) -> None:
    """Return once the server reports the client gone. The body has been read by then, so the
    next ASGI message is ``http.disconnect`` (sent when the connection closes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _after_job(events):
    """The events without the job that comes first."""
    async for event in events:
        if isinstance(event, dict):
            yield event


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _takes_flag(tokenizer) -> bool:
    import inspect

    try:
        return "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        return False
