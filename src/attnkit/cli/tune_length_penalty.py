"""``attnkit tune-length-penalty``: beam search's length penalty chosen on validation data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit.cli.common import UsageError, to_device
from attnkit.cli.tasks import add_evaluation_options, run_precision


def register(commands) -> None:
    """``attnkit tune-length-penalty``: choose beam search's length penalty."""
    tune = commands.add_parser(
        "tune-length-penalty",
        help="choose a translator's beam-search length penalty on its validation split",
        description=(
            "Translate the validation split of a translator's data with beam search at each "
            "candidate length penalty (hypotheses ranked by score / length**A), and record the "
            "one with the best BLEU in the model directory's decoding.json, which 'attnkit "
            "translate' and 'attnkit evaluate' then use. Never on the test split."
        ),
        epilog="example:\n  attnkit tune-length-penalty runs/de-en/averaged",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", metavar="MODEL", help="a translator's model directory")
    tune.add_argument("--beam", type=int, default=4, metavar="N", help="beams (default 4)")
    tune.add_argument(
        "--candidates",
        type=float,
        nargs="+",
        default=[0.6, 0.8, 1.0, 1.2, 1.5],
        metavar="A",
        help="length penalties to try (default 0.6 0.8 1 1.2 1.5)",
    )
    tune.add_argument("--batch-size", type=int, default=64, metavar="B")
    add_evaluation_options(tune)
    tune.add_argument(
        "--recipe", metavar="FILE", help="the data, as a recipe (default: the model's)"
    )
    tune.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe"
    )
    tune.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.cli.tasks import model_and_recipe
    from attnkit.data import CorpusNotFoundError
    from attnkit.training.config import precision_context
    from attnkit.training.recipes import build_task
    from attnkit.training.translation import choose_length_penalty, write_decoding

    path = Path(args.model)
    if args.beam < 2:
        raise UsageError(
            f"--beam: the length penalty only matters for beam search, got {args.beam}"
        )
    if any(value < 0 for value in args.candidates):
        raise UsageError(f"--candidates: each must be >= 0, got {args.candidates}")
    if not path.is_dir():
        raise UsageError(f"MODEL: {path} is not a directory")
    model, tokenizer, recipe, _ = model_and_recipe(path, args.recipe, args.set)
    if recipe.task != "translation" or getattr(model, "family", None) != "encoder-decoder":
        raise UsageError(f"MODEL: {path} is not a translator (task {recipe.task!r})")
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    device = to_device(model, args.device, str(path))

    def progress(penalty: float, scores: dict[str, float]) -> None:
        print(
            f"  length penalty {penalty:<4g} BLEU {scores['bleu']:6.2f}  "
            f"chrF {scores['chrf']:6.2f}",
            file=sys.stderr,
            flush=True,
        )

    print(f"{len(task.ids['validation']):,} validation pairs, {args.beam} beams:", file=sys.stderr)
    with precision_context(run_precision(args, recipe), device):
        best, scores = choose_length_penalty(
            model,
            task,
            num_beams=args.beam,
            candidates=args.candidates,
            batch_size=args.batch_size,
            progress=progress,
        )
    written = write_decoding(
        path,
        {
            "num_beams": args.beam,
            "length_penalty": best,
            "chosen_on": "validation",
            "validation_pairs": len(task.ids["validation"]),
            "bleu_by_length_penalty": {f"{p:g}": round(s["bleu"], 2) for p, s in scores.items()},
        },
    )
    print(
        f"length penalty {best:g} (validation BLEU {scores[best]['bleu']:.2f}); "
        f"written to {written}"
    )
