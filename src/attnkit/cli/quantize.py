"""``attnkit quantize``: any model's linear layers to 8- or 4-bit blocks, saved as a directory."""

from __future__ import annotations

import argparse
import time

from attnkit.cli.common import UsageError, load_model, load_tokenizer


def register(commands) -> None:
    quantize = commands.add_parser(
        "quantize",
        help="round a model's weights to 8 or 4 bits (weight-only) and save it",
        description=(
            "Round every linear layer of a model to blocks of 32 weights with a scale each "
            "(int8: llama.cpp's Q8_0, 8.5 bits per weight; int4: Q4_1, a scale and a minimum, "
            "5 bits per weight) and save the model, with its tokenizer, as an attnkit "
            "directory. Activations stay float32. MODEL is anything from_pretrained reads: an "
            "attnkit or Hugging Face directory, a GGUF file (dequantized first), 'smollm2'."
        ),
        epilog=(
            "examples:\n"
            "  attnkit quantize runs/shakespeare-char/checkpoint runs/shakespeare-int4 "
            "--scheme int4\n"
            "  attnkit quantize smollm2 runs/smollm2-int8\n"
            "  attnkit generate runs/smollm2-int8 'The capital of France is' --greedy"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quantize.add_argument("model", metavar="MODEL", help="the model to quantize")
    quantize.add_argument("out", metavar="OUT", help="the directory to write (must not exist)")
    quantize.add_argument(
        "--scheme",
        choices=["int8", "int4"],
        default="int8",
        help="int8 (Q8_0, the default) or int4 (Q4_1)",
    )
    quantize.add_argument(
        "--skip",
        nargs="+",
        default=[],
        metavar="NAME",
        help="modules to keep in float32, e.g. lm_head",
    )
    quantize.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from pathlib import Path

    from attnkit.accel.packed import PackedLinear
    from attnkit.accel.quantize import quantize

    if Path(args.out).exists():
        raise UsageError(f"OUT: {args.out} already exists; choose a new directory")
    model = load_model(args.model, "MODEL")
    tokenizer = load_tokenizer(args.model, "MODEL")
    before = _size(model)
    start = time.perf_counter()
    try:
        quantize(model, args.scheme, skip=args.skip)
    except ValueError as error:
        raise UsageError(str(error)) from None
    seconds = time.perf_counter() - start
    packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    model.save_pretrained(args.out, tokenizer=tokenizer)
    _keep_provenance(Path(args.model), Path(args.out))
    after = _size(model)
    print(
        f"{args.model} -> {args.out}: {packed} linear layers as {args.scheme} in {seconds:.1f} s; "
        f"weights {before / 2**20:.1f} MB -> {after / 2**20:.1f} MB"
    )


def _keep_provenance(source, out) -> None:
    """The source directory's recipe (the data it was trained on) and a translator's decoding
    settings go with the quantized copy, so that ``attnkit evaluate``, ``translate`` and
    ``tune-length-penalty`` read the copy as they read the source."""
    import shutil

    from attnkit.training.checkpoint import CheckpointError, read_recipe, write_recipe
    from attnkit.training.translation import DECODING_FILE

    if not source.is_dir():  # a GGUF file, a packaged model: no recipe to keep
        return
    try:
        recipe = read_recipe(source)
    except CheckpointError:  # unreadable: the weights still load; evaluate asks for --recipe
        recipe = None
    if recipe:
        write_recipe(out, recipe)
    if (source / DECODING_FILE).is_file():
        shutil.copyfile(source / DECODING_FILE, out / DECODING_FILE)


def _size(model) -> int:
    """Bytes of the model's weights, a tied matrix counted once."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
