"""``attnkit generate``: continue a prompt with a language model."""

from __future__ import annotations

import argparse
import re
import sys

import torch

from attnkit.cli.common import (
    UsageError,
    add_dequantize_option,
    add_device_option,
    add_exact_option,
    add_speculate_option,
    load_model,
    load_tokenizer,
    speculative_from,
    to_device,
)

# --------------------------------------------------------------------------------------------
# attnkit generate
# --------------------------------------------------------------------------------------------


def register(commands) -> None:
    """``attnkit generate``: continue a prompt."""
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a decoder-only model, streaming the tokens",
        description=(
            "Continue a prompt with a decoder-only language model, printing each token as it "
            "is made. The model is a directory that attnkit wrote (a training checkpoint or "
            "model.save_pretrained) with its tokenizer.json, a Hugging Face directory or a GGUF "
            "file of an architecture docs/MODELS.md lists (GPT-2, Llama, Mistral, Qwen, Phi-3, "
            "Gemma 3; a GGUF file's tokenizer is inside; 'smollm2' and 'gemma3' name the "
            "shipped ones). Sampling by default; --greedy or --beam N for deterministic decoding."
        ),
        epilog=(
            "examples:\n"
            "  attnkit generate runs/shakespeare-char/checkpoint 'ROMEO:'\n"
            "  attnkit generate --checkpoint DIR 'To be' --greedy --max-new-tokens 50\n"
            "  attnkit generate --model model.gguf 'The capital of France is' --greedy\n"
            "  attnkit generate DIR 'ROMEO:' --max-new-tokens 2000 --compile\n"
            "  attnkit generate smollm2 'Repeat: to be or not to be. Again:' --greedy --speculate 6"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("args", nargs="*", metavar="[CHECKPOINT] PROMPT")
    generate.add_argument("--checkpoint", metavar="DIR", help="the model directory")
    generate.add_argument(
        "--model", metavar="PATH", help="the model directory (same as --checkpoint)"
    )
    generate.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="how many tokens to add (default 200, or as many as fit where the model's "
        "learned or sinusoidal positions end sooner)",
    )
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=None, metavar="K")
    generate.add_argument("--top-p", type=float, default=None, metavar="P")
    generate.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    generate.add_argument("--beam", type=int, default=1, metavar="N", help="beam search, N beams")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    generate.add_argument(
        "--compile",
        action="store_true",
        help="run each decoding step through torch.compile: about 3x faster per token on a "
        "CPU, after a one-off compile of 10-40 s (on a CPU it needs a C++ compiler); worth it "
        "for long outputs",
    )
    add_dequantize_option(generate)
    add_exact_option(generate)
    add_speculate_option(generate, draft=True)
    add_device_option(generate, "generate")
    generate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    positional = list(args.args)
    path = args.checkpoint or args.model
    option = "--checkpoint" if args.checkpoint else "--model" if args.model else "CHECKPOINT"
    if path is None:
        if not positional:
            raise UsageError("generate: give a model directory and a prompt (see --help)")
        path = positional.pop(0)
    if len(positional) != 1:
        raise UsageError(f"generate: expected one prompt, got {len(positional)} arguments")
    prompt = positional[0]
    model = load_model(path, option, dequantize=args.dequantize)
    if getattr(model, "family", None) != "decoder-only":
        raise UsageError(
            f"{option}: {path} holds a {type(model).__name__}; generate needs a decoder-only "
            "language model"
        )
    tokenizer = load_tokenizer(path, option)
    if tokenizer is None:
        raise UsageError(
            f"{option}: {path} has no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF "
            "file) to turn the prompt into ids"
        )
    ids = tokenizer.encode(prompt)
    if not ids:
        if model.cfg.bos_id is None:
            raise UsageError("generate: the prompt is empty and the model has no BOS token")
        ids = [model.cfg.bos_id]
    speculative = speculative_from(args, tokenizer)
    device = to_device(model, args.device, path)
    from attnkit import accel

    prepared = accel.prepare(model, "decoding", exact=args.exact, compile=args.compile)
    model = prepared.model
    prompt_ids = torch.tensor([ids], device=device)
    new_tokens = args.max_new_tokens
    if new_tokens is None:  # 200, or what a table of positions leaves (none: generate says why)
        limit = model.cfg.position_limit
        new_tokens = 200 if limit is None else min(200, max(limit - len(ids), 1))
    new_ids: list[int] = []
    shown = ""
    # The new text is what decoding prompt + new tokens adds to the decoded prompt: decoding the
    # new tokens alone would lose a SentencePiece token's leading space.
    base = tokenizer.decode(ids)

    def stream(tokens):
        nonlocal shown
        if not new_ids:  # the run's header (how it runs), then the prompt
            print(prepared.line(), file=sys.stderr, flush=True)
            print(prompt, end="", flush=True)
        new_ids.append(int(tokens[0]))
        text = tokenizer.decode(ids + new_ids)[len(base) :]
        if text.endswith("\ufffd"):
            return  # half a UTF-8 character so far: wait for the rest
        print(text[len(shown) :], end="", flush=True)
        shown = text

    try:
        out = model.generate(
            prompt_ids,
            new_tokens,
            do_sample=not args.greedy and args.beam == 1,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_beams=args.beam,
            seed=args.seed,
            on_token=stream if args.beam == 1 else None,
            speculative=speculative,
        )
    except ValueError as error:  # named as the options are, not as generate's arguments
        message = re.sub(
            r"\b(max_new_tokens|temperature|top_k|top_p|num_beams)\b", _option, str(error)
        )
        raise UsageError(f"generate: {message}") from None
    if args.beam > 1:
        print(prompt + tokenizer.decode(out[0].tolist())[len(base) :], end="")
    print()
    if speculative is not None:
        print(speculative.stats.line(), file=sys.stderr)


def _option(name: re.Match) -> str:
    """model.generate's argument -> the option that sets it: num_beams -> --beam."""
    return {"num_beams": "--beam"}.get(name[0], "--" + name[0].replace("_", "-"))
