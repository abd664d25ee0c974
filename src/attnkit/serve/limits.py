"""What guards the server before a request reaches a route: the body's size and the API key.

Both are plain ASGI middleware, so that they answer before FastAPI reads the body:

- :class:`BodyLimit` refuses a body over ``limit`` bytes with 413, however it is sent: with a
  ``Content-Length`` over the limit at once, and a chunked body (no length) once the chunks
  read so far pass it (the chunks are held until the body is whole, at most ``limit`` bytes).
- :class:`ApiKey` answers 401 to a request without ``Authorization: Bearer <key>`` or
  Anthropic's ``x-api-key: <key>`` (every route but ``/health`` and CORS preflights).

On Anthropic's routes (``/v1/messages``) their errors take Anthropic's shape.
"""

from __future__ import annotations

import hmac
import json

from attnkit.serve.schema import error_body, in_shape

__all__ = ["ApiKey", "BodyLimit", "guard"]


async def _answer(scope, send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(in_shape(scope["path"], body, status)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, before it is read into memory."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._refuse(scope, send)
            return await self.app(scope, receive, send)  # the server holds it to its length
        # No length (chunked): read the chunks up to the limit, then hand them on.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._refuse(scope, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, scope, send):
        message = f"the request body is larger than {self.limit} bytes"
        await _answer(scope, send, 413, error_body(413, message), [(b"connection", b"close")])


class ApiKey:
    """Answer 401 unless the request carries ``Authorization: Bearer <key>`` (or
    ``x-api-key: <key>``); ``/health`` and CORS preflights (``OPTIONS``) pass without it."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        if hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key):
            return await self.app(scope, receive, send)
        given = given or headers.get(b"x-api-key", b"")
        message = (
            "Incorrect API key provided"
            if given
            else "No API key provided: send the header 'Authorization: Bearer <key>' (or "
            "'x-api-key: <key>')"
        )
        body = error_body(401, message, code="invalid_api_key")
        await _answer(scope, send, 401, body, [(b"www-authenticate", b"Bearer")])


def guard(app, *, max_body: int, api_key: str | None = None, cors_origins=None):
    """``app`` with the body limit, the API key (if any) and CORS for ``cors_origins`` (if
    any); returns it. The middleware added last runs first: CORS answers a preflight before the
    key is asked for, and the key is checked before the body is read."""
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(BodyLimit, limit=max_body)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-api-key", "anthropic-version"],
        )
    return app
