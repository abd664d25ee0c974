"""``attnkit serve``: an OpenAI-compatible server with the live attention page."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnkit.cli.common import (
    UsageError,
    add_dequantize_option,
    add_device_option,
)
from attnkit.cli.serving import MODEL_HELP, load_chat_model


def register(commands) -> None:
    """``attnkit serve``: an OpenAI-compatible server."""
    serve = commands.add_parser(
        "serve",
        help="serve a language model over OpenAI's chat API, with a live attention page",
        description=(
            "Serve a decoder-only language model over HTTP with OpenAI's API: POST "
            "/v1/chat/completions (the model's own chat template), POST /v1/completions, GET "
            "/v1/models, GET /health. Requests that arrive together are decoded together, as "
            "rows of one batch that requests join and leave between steps. GET / is a page "
            "that streams a reply and shows, for any token of it, what each layer and head "
            "attended to when it was produced. Binds to 127.0.0.1 unless --host says otherwise."
        ),
        epilog=(
            "examples:\n"
            "  attnkit serve smollm2\n"
            "  attnkit serve model.gguf --port 8080\n"
            "  curl http://127.0.0.1:8000/v1/chat/completions \\\n"
            "    -H 'content-type: application/json' \\\n"
            '    -d \'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}\''
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--name", help="the model's name in the API (default: the file's name)")
    serve.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="requests decoded together (default 8); more wait in line",
    )
    serve.add_argument(
        "--max-body",
        type=int,
        default=1 << 20,
        metavar="BYTES",
        help="largest request body accepted (default 1 MiB); larger ones get 413",
    )
    add_dequantize_option(serve)
    add_device_option(serve, "run the model")
    serve.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    import threading

    import uvicorn

    from attnkit.serve import Engine, create_app

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_body < 1:
        raise UsageError(f"--max-body must be at least 1, got {args.max_body}")
    model, tokenizer, template = load_chat_model(args.model, args.dequantize, args.device)
    name = args.name or Path(args.model).stem
    # The model runs on this (the main) thread, the HTTP server on another (see serve.engine).
    engine = Engine(model, tokenizer, max_batch=args.max_batch, start=False)
    app = create_app(
        model, tokenizer, name=name, template=template, max_body=args.max_body, engine=engine
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    )
    http = threading.Thread(target=server.run, name="attnkit-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    print(
        f"serving {name} on http://{args.host}:{args.port} (the attention page at /, the API "
        "at /v1); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    try:
        engine.run(until=lambda: not http.is_alive())
    finally:
        server.should_exit = True
        http.join(timeout=10)
