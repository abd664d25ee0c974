"""``attnkit perplexity MODEL TEXT``: a language model's perplexity, as llama.cpp measures it."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli.common import (
    UsageError,
    add_dequantize_option,
    add_device_option,
    add_exact_option,
    device_description,
    load_model,
    load_tokenizer,
    to_device,
)

SHIPPED = {"shakespeare": "the validation split of the shipped Shakespeare corpus"}


def register(commands) -> None:
    """``attnkit perplexity``: how well a language model predicts a text."""
    parser = commands.add_parser(
        "perplexity",
        help="a language model's perplexity over a text, measured as llama-perplexity does",
        description=(
            "The perplexity of a decoder-only model over a text, measured as llama.cpp's "
            "llama-perplexity does so that the figures compare: the tokens in consecutive "
            "windows of --ctx (each starting with BOS), the second half of each window scored, "
            "PPL = exp(mean negative log-likelihood) +/- its standard error. TEXT is a UTF-8 "
            "file, or 'shakespeare' for the validation split of the shipped Shakespeare corpus. "
            "The model runs as generate and serve run it: packed weights on the integer path "
            "(8-bit activations, as llama.cpp; the default), or with --exact on their float32 "
            "path; --dequantize turns every weight into float32. Compare the three, or with "
            "llama.cpp."
        ),
        epilog=(
            "examples:\n"
            "  attnkit perplexity smollm2 shakespeare --windows 8\n"
            "  attnkit perplexity smollm2 shakespeare --windows 8 --dequantize\n"
            "  attnkit perplexity smollm2 shakespeare --windows 8 --exact\n"
            "  attnkit perplexity model.gguf book.txt --ctx 1024"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="a model directory, a .gguf file or a shipped name")
    parser.add_argument("text", metavar="TEXT", help="a text file, or 'shakespeare'")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window (512)")
    parser.add_argument(
        "--windows", type=int, help="score only the first N windows (default: all of the text)"
    )
    add_dequantize_option(parser)
    add_exact_option(parser)
    parser.add_argument(
        "--int8",
        action="store_true",
        help="packed weights on the integer path (the default; refused where there are no "
        "packed weights)",
    )
    add_device_option(parser, "run the model")
    parser.set_defaults(handler=run)


def read_text(name: str) -> tuple[str, str]:
    """(the text, where it came from)."""
    if name in SHIPPED:
        from attnkit.data import load_shakespeare

        try:
            return load_shakespeare().validation, SHIPPED[name]
        except (FileNotFoundError, ImportError, ValueError) as error:
            raise UsageError(f"TEXT: {error}") from None
    path = Path(name)
    if not path.is_file():
        raise UsageError(f"TEXT: no such file {name!r} (or give 'shakespeare')")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"TEXT: {name} is not UTF-8 text ({error.reason})") from None
    return text, str(path)


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from attnkit.models import DecoderLM
    from attnkit.training.perplexity import perplexity

    if args.ctx < 4:
        raise UsageError(f"--ctx: must be at least 4, got {args.ctx}")
    if args.windows is not None and args.windows < 1:
        raise UsageError(f"--windows: must be a positive integer, got {args.windows}")
    if args.int8 and args.exact:
        raise UsageError("--int8 and --exact: the integer path or the float32 one, not both")
    text, source = read_text(args.text)
    if not text.strip():
        raise UsageError(f"TEXT: {source} is empty")
    model = load_model(args.model, "MODEL", dequantize=args.dequantize).eval()
    if not isinstance(model, DecoderLM):
        raise UsageError(
            f"MODEL: perplexity needs a decoder-only language model, got a {type(model).__name__}"
        )
    from attnkit import accel

    if args.int8 and not any(isinstance(m, accel.PackedLinear) for m in model.modules()):
        raise UsageError("--int8: needs packed weights (a GGUF model without --dequantize)")
    model = accel.prepare(model, "decoding", exact=args.exact).model  # as generate and serve
    tokenizer = load_tokenizer(args.model, "MODEL")
    if tokenizer is None:
        raise UsageError(f"MODEL: {args.model} has no tokenizer")
    device = to_device(model, args.device, args.model)
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # attnkit's own tokenizers add nothing
        ids = tokenizer.encode(text)
    where = device_description(device)
    integer = any(getattr(m, "integer", False) for m in model.modules())
    path = ", int8 activations" if integer else ""
    print(f"model: {args.model} ({where}{path}); text: {source}, {len(ids):,} tokens")
    if args.ctx > model.cfg.max_len:
        limit = model.cfg.max_len
        raise UsageError(f"--ctx={args.ctx} is longer than the model's {limit} positions")
    if len(ids) < args.ctx:
        raise UsageError(f"TEXT: {len(ids)} tokens, fewer than one window of --ctx {args.ctx}")
    bars = []

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc="windows", unit="window", leave=False))
        bars[0].update(done - bars[0].n)

    try:
        result = perplexity(model, ids, context=args.ctx, windows=args.windows, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    print(result)
