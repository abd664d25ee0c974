"""``attnkit average``: one model from the last checkpoints of a run."""

from __future__ import annotations

import argparse

from attnkit.cli.common import UsageError


def register(commands) -> None:
    """``attnkit average``: average the models of several checkpoints."""
    average = commands.add_parser(
        "average",
        help="average the weights of a run's last checkpoints (the paper's checkpoint averaging)",
        description=(
            "Write the model whose every weight is the mean of that weight in the given models "
            "(the paper averages the last 5 checkpoints). MODEL is a model directory, or a run "
            "directory (or its checkpoints/) whose kept snapshots are then used: train with "
            "train.keep_checkpoints = N to keep them. The models must share architecture and "
            "tokenizer; config, tokenizer and recipe come from the last."
        ),
        epilog=(
            "examples:\n"
            "  attnkit average runs/de-en/checkpoints --out runs/de-en/averaged\n"
            "  attnkit average runs/de-en --last 3 --out runs/de-en/avg3\n"
            "  attnkit average DIR1 DIR2 DIR3 --out DIR"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    average.add_argument("models", nargs="+", metavar="MODEL", help="model or run directories")
    average.add_argument(
        "--out", required=True, metavar="DIR", help="the averaged model's directory"
    )
    average.add_argument(
        "--last", type=int, default=None, metavar="N", help="only the last N models"
    )
    average.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.training.averaging import average_models, models_to_average

    if args.last is not None and args.last < 1:
        raise UsageError(f"--last: must be a positive integer, got {args.last}")
    try:
        models = models_to_average(args.models, args.last)
        out = average_models(models, args.out)
    except (FileNotFoundError, ValueError) as error:  # the models named
        raise UsageError(f"MODEL: {error}") from None
    except OSError as error:  # writing the output
        raise UsageError(f"--out: cannot write {args.out}: {error}") from None
    print(f"averaged {len(models)} models into {out}:")
    for model in models:
        print(f"  {model}")
