"""``attnkit evaluate``: a checkpoint's loss and metrics on a split."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli.common import UsageError, device_description, to_device
from attnkit.cli.tasks import (
    OUT_OF_DOMAIN,
    add_evaluation_options,
    add_out_of_domain,
    decoding_settings,
    format_metric,
    model_and_recipe,
    run_precision,
)
from attnkit.tables import format_table


def register(commands) -> None:
    """``attnkit evaluate``: a checkpoint's metrics on a split."""
    evaluate = commands.add_parser(
        "evaluate",
        help="held-out loss, perplexity, BLEU/chrF or accuracy of a trained checkpoint",
        description=(
            "Evaluate a checkpoint that 'attnkit train' wrote on the held-out splits of the data "
            "it was trained on (its recipe is in the checkpoint). Language models: the mean "
            "cross entropy in nats per token, the perplexity exp(loss) and bits per token. "
            "Translators: the loss, and sacrebleu's corpus BLEU and chrF of greedy decoding and "
            "of beam search (--beam) side by side, with three example translations. "
            "Classifiers: accuracy, per-class precision / recall / F1 and the confusion matrix. "
            "A model directory without a run state needs --recipe to name its data."
        ),
        epilog=(
            "examples:\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint --split test --json\n"
            "  attnkit evaluate runs/de-en/checkpoint --split test --translations out.jsonl\n"
            "  attnkit evaluate runs/de-en/averaged --split test --split out-of-domain\n"
            "  attnkit evaluate runs/reviews-zh/checkpoint --split test\n"
            "  attnkit evaluate DIR --recipe examples/shakespeare-char.toml --max-batches 20"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory")
    evaluate.add_argument(
        "--split",
        action="append",
        choices=("train", "validation", "test", "out-of-domain"),
        help="a split to evaluate (repeatable; default: validation and test, and for the "
        "LibreOffice translators also out-of-domain: Ding's sentences for de-en, the HSK "
        "sentences for zh-en)",
    )
    evaluate.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="examples per batch (default: the run's train.batch_size, as its validation had)",
    )
    evaluate.add_argument(
        "--max-batches", type=int, default=None, metavar="N", help="at most N batches per split"
    )
    add_evaluation_options(evaluate)
    evaluate.add_argument("--recipe", metavar="FILE", help="the data to evaluate on, as a recipe")
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe"
    )
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    evaluate.add_argument(
        "--beam",
        type=int,
        default=None,
        metavar="N",
        help="translators: also decode with beam search of N beams (default: the model's "
        "decoding.json, else 4; 1 = greedy only)",
    )
    evaluate.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="A",
        help="translators: beam hypotheses ranked by score / length**A (default: the one "
        "'attnkit tune-length-penalty' recorded in the model's decoding.json, else 1.0)",
    )
    evaluate.add_argument(
        "--translations",
        metavar="FILE",
        help="translators: write every evaluated pair and its translations as JSON lines",
    )
    evaluate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    import json

    from attnkit.data import CorpusNotFoundError
    from attnkit.training.classification import classification_report
    from attnkit.training.config import precision_context, resolve_precision
    from attnkit.training.recipes import build_task
    from attnkit.training.translation import score_signatures, write_translations

    path = Path(args.checkpoint)
    for option, value in (
        ("--batch-size", args.batch_size),
        ("--max-batches", args.max_batches),
        ("--beam", args.beam),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{option}: must be a positive integer, got {value}")
    if args.length_penalty is not None and args.length_penalty < 0:
        raise UsageError(f"--length-penalty: must be >= 0, got {args.length_penalty}")
    if not path.is_dir():
        raise UsageError(f"CHECKPOINT: {path} is not a directory")
    model, tokenizer, recipe, step = model_and_recipe(path, args.recipe, args.set)
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    if getattr(model, "family", None) != task.family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; the {task.name!r} task "
            f"evaluates {task.family} models"
        )
    device = to_device(model, args.device, str(path))
    if args.translations and task.name != "translation":
        raise UsageError(f"--translations: {path} is a {task.name!r} model, not a translator")
    splits = args.split or [s for s in ("validation", "test") if s in task.splits]
    decoding = {}
    if task.name == "translation":
        decoding = decoding_settings(path, args.beam, args.length_penalty)
        task.length_penalty = decoding["length_penalty"]
        if args.split is None or OUT_OF_DOMAIN in args.split:
            add_out_of_domain(task, recipe, required=args.split is not None)
        if args.split is None and OUT_OF_DOMAIN in task.splits:
            splits.append(OUT_OF_DOMAIN)
    elif args.split and OUT_OF_DOMAIN in args.split:
        raise UsageError(f"--split {OUT_OF_DOMAIN}: only translators have one")
    results, outputs = {}, {}
    for split in splits:
        options = {}
        if task.name == "translation":
            outputs[split] = {}
            options = {"beams": sorted({1, decoding["num_beams"]}), "outputs": outputs[split]}
        with precision_context(run_precision(args, recipe), device):
            try:
                results[split] = task.evaluate(
                    model,
                    split,
                    batch_size=args.batch_size or recipe.train.batch_size,
                    max_batches=args.max_batches,
                    **options,
                )
            except ValueError as error:
                raise UsageError(f"--split: {error}") from None
    if args.translations:
        try:
            write_translations(Path(args.translations), outputs)
        except OSError as error:
            raise UsageError(f"--translations: cannot write {args.translations}: {error}") from None
    if args.json:
        print(json.dumps({"checkpoint": str(path), "step": step, **results}, indent=2))
        return
    where = f"step {step:,}, " if step is not None else ""
    asked = run_precision(args, recipe)
    precision = resolve_precision(asked, device)
    precision += " (auto)" if asked == "auto" else ""
    runs_on = device_description(device)
    print(f"{path}: {type(model).__name__}, {where}task {task.name}, {precision}, {runs_on}\n")
    if task.name == "classification":
        print(classification_report(results, task.labels))
        return
    names = [n for n, v in next(iter(results.values())).items() if not isinstance(v, list)]
    header = ["split", *names]
    rows = [[s, *(format_metric(n, m[n]) for n in names)] for s, m in results.items()]
    print(format_table(header, rows))
    print("\nloss: mean cross entropy in nats per token; perplexity = exp(loss)")
    if task.name == "translation":
        beams = decoding["num_beams"]
        beam = f"beam search with {beams} beams" if beams > 1 else "greedy only"
        print(
            f"bleu, chrf: sacrebleu corpus scores (0-100) of greedy decoding; *_beam{beams}: "
            f"{beam}, length penalty {decoding['length_penalty']:g} ({decoding['source']})"
        )
        print("sacrebleu signatures: " + "  ".join(score_signatures().values()))
        if OUT_OF_DOMAIN in results:
            print(f"{OUT_OF_DOMAIN}: {task.out_of_domain_name}, a test set the model never saw")
        split = splits[-1]
        shown = outputs[split]
        print(f"\nthe first {min(3, len(shown['source']))} {split} pairs:")
        for i in range(min(3, len(shown["source"]))):
            print(f"  source     {shown['source'][i]}")
            print(f"  reference  {shown['reference'][i]}")
            for key in (k for k in shown if k not in ("source", "reference")):
                print(f"  {key:<10} {shown[key][i]}")
            print()
