"""``attnkit chat``: a conversation with a model in the terminal."""

from __future__ import annotations

import argparse
import sys

from attnkit.cli.common import (
    UsageError,
    add_dequantize_option,
    add_device_option,
    add_exact_option,
    add_speculate_option,
    speculative_from,
)
from attnkit.cli.serving import MODEL_HELP, load_chat_model


def register(commands) -> None:
    """``attnkit chat``: a conversation in the terminal."""
    chat = commands.add_parser(
        "chat",
        help="talk to a language model in the terminal, with the reply streamed",
        description=(
            "A conversation with a decoder-only language model in the terminal: each line you "
            "type is a message; the reply streams as it is made, and the whole conversation "
            "goes into the next prompt through the model's chat template. /reset starts over, "
            "/quit (or Ctrl-D) ends."
        ),
        epilog=(
            "examples:\n  attnkit chat smollm2\n  attnkit chat model.gguf --temperature 0\n"
            "  attnkit chat smollm2 --temperature 0 --speculate 6"
        ),
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
    add_dequantize_option(chat)
    add_exact_option(chat)
    add_speculate_option(chat)
    add_device_option(chat, "run the model")
    chat.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.serve import Engine, Request, render_chat

    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.speculate is not None and args.temperature != 0:
        raise UsageError("--speculate checks greedy replies: give --temperature 0 with it")
    model, tokenizer, template, _ = load_chat_model(
        args.model, args.dequantize, args.device, exact=args.exact
    )
    speculative = speculative_from(args)
    engine = Engine(model, tokenizer, max_batch=1, start=False, speculative=speculative)
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
