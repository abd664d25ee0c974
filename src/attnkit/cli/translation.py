"""``attnkit average`` and ``attnkit tune-length-penalty``: the last two steps of the paper's
recipe for a translator, after training and before the test set."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit.cli._common import UsageError, _to_device


def _cmd_average(args: argparse.Namespace) -> None:
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


def _cmd_tune_length_penalty(args: argparse.Namespace) -> None:
    from attnkit.cli.evaluate import _model_and_recipe
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
    model, tokenizer, recipe, _ = _model_and_recipe(path, args.recipe, args.set)
    if recipe.task != "translation" or getattr(model, "family", None) != "encoder-decoder":
        raise UsageError(f"MODEL: {path} is not a translator (task {recipe.task!r})")
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    device = _to_device(model, args.device, str(path))

    def progress(penalty: float, scores: dict[str, float]) -> None:
        print(
            f"  length penalty {penalty:<4g} BLEU {scores['bleu']:6.2f}  "
            f"chrF {scores['chrf']:6.2f}",
            file=sys.stderr,
            flush=True,
        )

    print(f"{len(task.ids['validation']):,} validation pairs, {args.beam} beams:", file=sys.stderr)
    with precision_context(args.precision, device):
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
