"""The live attention page of ``attnkit serve``: ``GET /`` serves it; ``POST /attnkit/generate``
streams a reply with its attention recorded (server-sent events: the prompt's tokens and the
reply's id, then each token, then the finish); ``GET /attnkit/attention/{id}/{t}`` returns
what each layer and head attended to when token ``t`` of that reply was produced."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from attnkit.serve.engine import Engine
from attnkit.serve.schema import AttentionBody, error

__all__ = ["add_attention_page"]


def add_attention_page(
    app: FastAPI,
    engine: Engine,
    *,
    special: Callable[[int], str],
    render: Callable[[list[dict]], str],
    request_for: Callable,
) -> None:
    """Add the page's routes to ``app``: ``special(id)`` is a token's text, ``render`` the
    chat template, ``request_for(text, temperature, max_tokens)`` the engine's checked
    request."""

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("attnkit.serve").joinpath("page.html").read_text("utf-8")

    @app.post("/attnkit/generate")
    async def generate_with_attention(body: AttentionBody):
        text = render([{"role": "user", "content": body.prompt}]) if body.chat else body.prompt
        request = request_for(text, body.temperature, body.max_tokens)

        async def stream():
            loop = asyncio.get_running_loop()
            inbox: asyncio.Queue = asyncio.Queue()
            job = engine.submit(request, lambda e: loop.call_soon_threadsafe(inbox.put_nowait, e))
            yield _sse({"prompt": [special(i) for i in request.prompt_ids], "id": job.id})
            try:
                while True:
                    event = await inbox.get()
                    if event["type"] == "token":
                        token = special(event["id"]) if event["id"] is not None else ""
                        yield _sse({"token": token})
                        continue
                    if event["type"] == "done":
                        yield _sse({"done": event["finish_reason"], "id": event["id"]})
                    else:
                        yield _sse({"error": event["message"]})
                    return
            finally:
                job.cancel()  # a no-op once the reply is done; frees the engine otherwise

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/attnkit/attention/{job_id}/{index}")
    async def attention(job_id: str, index: int):
        recording = engine.recording(job_id)
        if recording is None:
            raise error(404, f"no recorded reply {job_id!r} (only the last few are kept)")
        job = recording["job"]
        if not 0 <= index < len(job.generated):
            raise error(404, f"reply {job_id} has {len(job.generated)} tokens, not {index + 1}")
        weights = job.weights[index].float()  # (layers, heads, positions)
        ids = recording["prompt"] + job.generated[:index]
        return {
            "token": special(job.generated[index]),
            "context": [special(i) for i in ids],
            "weights": [
                [[round(w, 4) for w in head] for head in layer] for layer in weights.tolist()
            ],
        }


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
