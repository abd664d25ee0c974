"""The HTTP side of ``attnkit serve``: OpenAI's chat and completion API, and the attention page.

Routes:

- ``POST /v1/chat/completions``: messages rendered with the model's chat template;
  ``max_tokens`` (or ``max_completion_tokens``), ``temperature`` (0 = greedy), ``top_p``,
  ``n`` choices (rows of the same batch), ``stop`` (up to 4), ``seed``, ``frequency_penalty``,
  ``presence_penalty``, ``logit_bias``, ``logprobs`` with ``top_logprobs``,
  ``response_format`` (JSON mode and JSON schemas, by constrained decoding), ``stream``
  (server-sent events in OpenAI's chunk format, logprobs included, ending in
  ``data: [DONE]``; ``stream_options.include_usage`` adds the usage chunk).
- ``POST /v1/completions``: the same for a ``prompt`` (a string, a list of strings, token ids,
  or a list of those), ``logprobs`` (an int) and ``echo`` (the prompt back, with its tokens'
  log-probabilities: what log-likelihood evaluations such as lm-eval read).
- ``POST /v1/responses`` (OpenAI's Responses API, :mod:`attnkit.serve.responses_api`) and
  ``POST /v1/messages`` (Anthropic's Messages API, :mod:`attnkit.serve.messages_api`): the same
  chat pipeline (:mod:`attnkit.serve.core`) in those APIs' shapes.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`attnkit.serve.metrics`);
  llama.cpp's ``POST /tokenize`` and ``POST /detokenize``.
- ``GET /``: the live attention page; ``POST /attnkit/generate`` streams a reply with its
  attention recorded and ``GET /attnkit/attention/{id}/{t}`` returns what each layer and head
  attended to when token ``t`` of it was produced.

Every error is OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with
its status: 400 for a malformed body, an unknown field, a field of OpenAI's API that attnkit
cannot honour (named, with why), a prompt that is empty or does not fit the context; 401
without the API key (``api_key``); 404 ``model_not_found`` for another ``model``; 413 for a
body over ``max_body`` bytes, however it is sent; 429 with ``Retry-After`` when ``max_queue``
requests already wait; 504 past ``timeout`` seconds. A client that goes away mid-answer has its
rows dropped from the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from attnkit.serve.chat import render_chat
from attnkit.serve.core import Core, unless_client_leaves
from attnkit.serve.engine import Engine
from attnkit.serve.engine import Request as GenerationRequest
from attnkit.serve.formats import OWN, Reading, takes_tools, thinking_for, tool_format
from attnkit.serve.grammar import COMPACT
from attnkit.serve.limits import guard
from attnkit.serve.messages_api import add_messages_api
from attnkit.serve.metrics import CONTENT_TYPE, Counted, Metrics
from attnkit.serve.page import add_attention_page
from attnkit.serve.responses import Answer, respond
from attnkit.serve.responses_api import add_responses_api
from attnkit.serve.schema import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    check_model,
    error,
    error_body,
    openai_errors,
    refuse_unsupported,
)
from attnkit.serve.tools import call_schema, chosen_tools, with_tools

__all__ = ["create_app"]


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
    max_queue: int | None = None,
    timeout: float | None = None,
    api_key: str | None = None,
    cors_origins: list[str] | None = None,
    engine: Engine | None = None,
    meta: dict | None = None,
) -> FastAPI:
    """The server's ASGI app for a decoder-only ``model`` and its ``tokenizer``; ``template``
    is the chat template (see :func:`attnkit.serve.chat.chat_template_for`). ``max_queue``:
    requests that may wait beyond the batch (None: no bound); ``timeout``: seconds a request
    may take (None: no limit); ``api_key``: the Bearer key every request must carry;
    ``cors_origins``: the web origins whose pages may call the API; ``meta``: what
    ``/v1/models`` says of how the model runs (``attnkit serve``: its kernels and levers)."""
    engine = engine or Engine(model, tokenizer, max_batch=max_batch)
    created = int(time.time())
    vocab = model.cfg.vocab_size

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
    metrics = Metrics(engine)

    http_error = openai_errors(app)

    def encode(text: str) -> list[int]:
        """The ids ``generate`` would use; a template that wrote BOS itself gets no second."""
        if bos and text.startswith(bos) and _takes_flag(tokenizer):
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text)

    def prepare(ids: list[int], body, max_tokens: int | None, param: str, **options):
        """The engine's requests for one prompt's ids: ``body.n`` of them (seeds seed, seed +
        1, ...), checked."""
        if not ids:
            raise error(400, "the prompt is empty", param)
        if body.n > engine.max_batch:
            raise error(
                400, f"n: at most {engine.max_batch} choices (the batch's rows), got {body.n}", "n"
            )
        room = engine.context - len(ids)
        if room <= 0 and not (options.get("prompt_logprobs") and max_tokens == 0):
            raise error(
                400,
                f"the prompt has {len(ids)} tokens; the model's context is {engine.context}",
                param,
            )
        if max_tokens is None:
            max_tokens = min(512, room)
        requests = []
        for i in range(body.n):
            request = GenerationRequest(
                ids,
                max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=None if body.seed is None else body.seed + i,
                stop=body.stops(),
                frequency_penalty=body.frequency_penalty,
                presence_penalty=body.presence_penalty,
                logit_bias=body.bias(vocab),
                **options,
            )
            try:
                engine.check(request)
            except ValueError as problem:
                raise error(400, str(problem), "max_tokens" if room > 0 else param) from None
            requests.append(request)
        return requests

    def grammar(body, answer=None, param="response_format", thinking=None) -> str | None:
        """The grammar an answer is held to, compiled and checked: the Lark rule ``answer``
        (the tools' calls) or ``response_format``'s schema, after the reasoning when the model
        reasons (None: free text)."""
        schema = None
        if answer is None and body.response_format is not None:
            schema = body.response_format.schema()
        if answer is None and schema is None:
            return None
        why = engine.grammars.available()
        if why is not None:
            raise error(400, f"{param}: {why}", param)
        try:
            if answer is None and thinking is None:
                return engine.grammars.json_schema(schema)
            if answer is None:
                answer = f"answer: %json {json.dumps({**schema, 'x-guidance': COMPACT})}"
            rule = thinking.lark(answer) if thinking else "start: answer\n" + answer
            return engine.grammars.lark(rule, "the tools" if schema is None else "the JSON schema")
        except ValueError as problem:
            raise error(400, f"{param}: {problem}", param) from None

    def admit(count: int) -> None:
        """429 when ``count`` more requests would wait past ``max_queue``."""
        if max_queue is None:
            return
        stats = engine.stats()
        waiting = stats["waiting"] + max(0, stats["running"] + count - engine.max_batch)
        if waiting > max_queue:
            raise error(
                429,
                f"the server is busy: {stats['waiting']} requests wait (at most {max_queue}); "
                "try again shortly",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

    async def events(requests: list[GenerationRequest]):
        """Submit, then yield (index, event) as the engine's events come, until every request
        is done; when the generator is closed (a client that went away, a timeout), the jobs
        are cancelled."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def sink(index):
            return lambda e: loop.call_soon_threadsafe(inbox.put_nowait, (index, e))

        jobs = [engine.submit(r, sink(i)) for i, r in enumerate(requests)]
        left, clock = len(jobs), metrics.clock(len(jobs))
        try:
            while left:
                index, event = await inbox.get()
                metrics.see(clock, index, event)
                yield index, event
                left -= event["type"] != "token"
        finally:
            for job in jobs:
                job.cancel()  # a no-op once the request is done; frees the row otherwise

    async def whole(requests: list[GenerationRequest]) -> list[Answer]:
        answers = [Answer() for _ in requests]
        async for index, event in events(requests):
            if event["type"] == "error":
                raise error(500, event["message"])
            answers[index].add(event)
        return answers

    async def within_time(work):
        if timeout is None:
            return await work
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            message = f"the request took longer than {timeout:g} s"
            raise error(504, message, code="timeout") from None

    async def stream_events(requests: list[GenerationRequest]):
        """(index, event) as the engine's events come, until every request is done; past
        ``timeout`` one last (None, 504 error event) ends it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        source = events(requests)
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    yield await asyncio.wait_for(anext(source), wait)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    message = f"the request took longer than {timeout:g} s"
                    late = {"type": "error", "status": 504, "message": message}
                    metrics.rejected.labels("504").inc()  # (a stream's status was 200)
                    yield None, late
                    return
        finally:
            await source.aclose()

    async def answers(requests: list[GenerationRequest], http) -> list[Answer] | None:
        """The whole answers (None when the client left first: the jobs were cancelled)."""
        return await unless_client_leaves(within_time(whole(requests)), http)

    def render(messages: list[dict], **variables) -> str:
        try:
            return render_chat(template, messages, bos_token=bos, eos_token=eos, **variables)
        except ValueError as problem:
            raise error(400, str(problem), "messages") from None

    def chat_prompt(body: ChatBody) -> tuple[list[int], str | None, Reading]:
        """The prompt's ids for a chat body, the grammar its answer is held to, and how the
        answer is read back (its calls' format, its reasoning)."""
        if body.top_logprobs is not None and not body.logprobs:
            raise error(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools, text_allowed = chosen_tools(body)
        if tools and body.response_format and body.response_format.type != "text":
            raise error(400, "response_format cannot be used with tool calls", "response_format")
        if takes_tools(template):  # the template lays tools and calls out in its own words
            messages = [m.for_template() for m in body.messages]
            offered = body.tools or []  # (with tool_choice "none" too: told, but not called)
            listed = (
                {"tools": [t.model_dump(exclude_none=True) for t in offered]} if offered else {}
            )
            prompt, form = render(messages, **listed), tool_format(template)
        else:  # attnkit's system message tells the model of the tools
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt, form = render(with_tools(messages, tools) if tools else messages), OWN
        if not prompt.strip():
            raise error(400, "the prompt is empty", "messages")
        thinking = thinking_for(template, prompt)
        if tools:  # the answer is held to calls in the format (or text)
            several = body.parallel_tool_calls is not False
            answer = form.lark(call_schema(tools, form.arguments), text_allowed, several)
            rule = grammar(body, answer, "tools", thinking)
        else:
            rule = grammar(body, thinking=thinking)
        return encode(prompt), rule, Reading(form if tools else None, thinking)

    def chat_requests(body: ChatBody) -> tuple[list[GenerationRequest], Reading]:
        """The engine's requests for a chat body, checked and admitted, and how their answers
        are read."""
        ids, rule, reading = chat_prompt(body)
        limit = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        options = dict(logprobs=logprobs, grammar=rule)
        requests = prepare(ids, body, limit, "messages", **options)
        admit(len(requests))
        return requests, reading

    core = Core(name, engine, special, chat_prompt, chat_requests, answers, stream_events)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        check_model(body.model, name)
        refuse_unsupported(body)
        requests, reading = chat_requests(body)
        return await respond(core, body, requests, http, chat=True, reading=reading)

    def prompt_ids(body: CompletionBody) -> tuple[list[list[int]], list[str]]:
        """The prompts as ids and as text: a string, strings, token ids, or lists of ids."""
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise error(400, "the prompt is empty", "prompt")
        ids, texts = [], []
        for item in prompt:
            if isinstance(item, str):
                if not item.strip():
                    raise error(400, "the prompt is empty", "prompt")
                ids.append(encode(item))
                texts.append(item)
            else:
                if any(not 0 <= t < vocab for t in item):
                    raise error(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
                ids.append(list(item))
                texts.append(tokenizer.decode(list(item)))
        return ids, texts

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        check_model(body.model, name)
        refuse_unsupported(body)
        if body.max_tokens == 0 and not body.echo:
            raise error(400, "max_tokens=0 needs echo: true (scoring the prompt)", "max_tokens")
        ids, texts = prompt_ids(body)
        scored = body.echo and body.logprobs is not None
        options = dict(logprobs=body.logprobs, prompt_logprobs=scored, grammar=grammar(body))
        requests = [r for p in ids for r in prepare(p, body, body.max_tokens, "prompt", **options)]
        admit(len(requests))
        echo = texts if body.echo else None
        return await respond(core, body, requests, http, chat=False, per_prompt=body.n, echo=echo)

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "attnkit"}
        if meta is not None:
            card["meta"] = meta
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health():
        stats = {"status": "ok", "model": name, "max_batch": engine.max_batch, **engine.stats()}
        return {**stats, "resident_mib": _resident_mib()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        text = body.text()
        ids = (
            tokenizer.encode(text, add_special_tokens=body.special())
            if _takes_flag(tokenizer) else tokenizer.encode(text)
        )  # fmt: skip
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": special(i)} for i in ids]}
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        if any(not 0 <= t < vocab for t in body.tokens):
            raise error(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
        text = tokenizer.decode(body.tokens)
        return {"content": text, "prompt": text}  # llama.cpp's name, and vLLM's

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's description of the tokenizer (lm-eval's remote tokenizer reads it)."""
        return {
            "eos_token": eos or None,
            "bos_token": bos or None,
            "pad_token": None,
            "chat_template": template,
            "model_max_length": engine.context,
            "vocab_size": vocab,
        }

    def page_request(text: str, temperature: float, max_tokens: int) -> GenerationRequest:
        """The attention page's request: ``text`` greedy (or sampled), attention recorded."""
        if not text.strip():
            raise error(400, "the prompt is empty", "prompt")
        sampling = ChatBody(messages=[{"role": "user", "content": text}])
        sampling.temperature = temperature
        (request,) = prepare(encode(text), sampling, max_tokens, "prompt", attention=True)
        return request

    add_attention_page(app, engine, special=special, render=render, request_for=page_request)
    add_responses_api(app, core)
    add_messages_api(app, core)

    @app.exception_handler(404)
    async def not_found(request, error):
        if isinstance(error, HTTPException) and error.detail.startswith("{"):
            return await http_error(request, error)
        return JSONResponse(error_body(404, f"no route {request.url.path}"), status_code=404)

    guard(app, max_body=max_body, api_key=api_key, cors_origins=cors_origins)
    app.add_middleware(Counted, metrics=metrics, routes={r.path for r in app.routes})
    return app


def _resident_mib() -> float | None:
    """The server's resident memory in MiB (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _takes_flag(tokenizer) -> bool:
    import inspect

    try:
        return "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        return False
