"""Serving a language model: an OpenAI-compatible HTTP API with continuous batching
(:mod:`attnkit.serve.engine`), chat templates (:mod:`attnkit.serve.chat`) and a page that shows
what each layer and head attended to for every generated token (:mod:`attnkit.serve.app`).

``attnkit serve MODEL`` runs it; ``attnkit chat MODEL`` is the same engine in a terminal.
"""

from attnkit.serve.chat import PLAIN_TEMPLATE, TextStream, chat_template_for, render_chat
from attnkit.serve.engine import Engine, Request

__all__ = [
    "PLAIN_TEMPLATE",
    "Engine",
    "Request",
    "TextStream",
    "chat_template_for",
    "create_app",
    "render_chat",
]


def create_app(*args, **kwargs):
    """The ASGI app (imports FastAPI only when a server is made); see
    :func:`attnkit.serve.app.create_app`."""
    from attnkit.serve.app import create_app as make

    return make(*args, **kwargs)
