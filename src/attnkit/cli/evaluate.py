"""``attnkit evaluate``, ``translate`` and ``classify``: a trained model on its task."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli._common import UsageError, _load_model, _load_tokenizer
from attnkit.tables import format_table


def _format_metric(name: str, value: float) -> str:
    return f"{int(value):,}" if name in ("tokens", "sentences") else f"{value:.4f}"


def _cmd_evaluate(args: argparse.Namespace) -> None:
    import json

    from attnkit.data import CorpusNotFoundError
    from attnkit.training import CheckpointError, Recipe, RecipeError, read_trainer_state
    from attnkit.training.classification import classification_report
    from attnkit.training.config import precision_context
    from attnkit.training.recipes import build_task, load_recipe
    from attnkit.training.translation import write_translations

    path = Path(args.checkpoint)
    for option, value in (
        ("--batch-size", args.batch_size),
        ("--max-batches", args.max_batches),
        ("--beam", args.beam),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{option}: must be a positive integer, got {value}")
    if not path.is_dir():
        raise UsageError(f"CHECKPOINT: {path} is not a directory")
    step = None
    try:
        if args.recipe:
            recipe = load_recipe(args.recipe, args.set)
        else:
            state = read_trainer_state(path)
            recipe = Recipe.from_dict(state.recipe or {}, f"{path}/trainer_state.json")
            step = state.step
    except CheckpointError as error:
        raise UsageError(f"CHECKPOINT: {error}; give --recipe FILE to name its data") from None
    except RecipeError as error:
        raise UsageError(str(error)) from None
    model = _load_model(str(path), "CHECKPOINT")
    tokenizer = _load_tokenizer(str(path), "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    if getattr(model, "family", None) != task.family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; the {task.name!r} task "
            f"evaluates {task.family} models"
        )
    if args.translations and task.name != "translation":
        raise UsageError(f"--translations: {path} is a {task.name!r} model, not a translator")
    splits = args.split or [s for s in ("validation", "test") if s in task.splits]
    if task.name == "translation":
        task.length_penalty = args.length_penalty
    results, outputs = {}, {}
    for split in splits:
        options = {}
        if task.name == "translation":
            outputs[split] = {}
            options = {"beams": sorted({1, args.beam}), "outputs": outputs[split]}
        with precision_context(args.precision, torch.device("cpu")):
            try:
                results[split] = task.evaluate(
                    model,
                    split,
                    batch_size=args.batch_size,
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
    print(f"{path}: {type(model).__name__}, {where}task {task.name}, {args.precision}\n")
    if task.name == "classification":
        print(classification_report(results, task.labels))
        return
    names = [n for n, v in next(iter(results.values())).items() if not isinstance(v, list)]
    header = ["split", *names]
    rows = [[s, *(_format_metric(n, m[n]) for n in names)] for s, m in results.items()]
    print(format_table(header, rows))
    print("\nloss: mean cross entropy in nats per token; perplexity = exp(loss)")
    if task.name == "translation":
        beam = f"beam search with {args.beam} beams" if args.beam > 1 else "greedy only"
        print(
            f"bleu, chrf: sacrebleu corpus scores (0-100) of greedy decoding; *_beam{args.beam}: "
            f"{beam}, length penalty {args.length_penalty:g}"
        )
        split = splits[-1]
        shown = outputs[split]
        print(f"\nthe first {min(3, len(shown['source']))} {split} pairs:")
        for i in range(min(3, len(shown["source"]))):
            print(f"  source     {shown['source'][i]}")
            print(f"  reference  {shown['reference'][i]}")
            for key in (k for k in shown if k not in ("source", "reference")):
                print(f"  {key:<10} {shown[key][i]}")
            print()


def _load_for_task(path: str, family: str, command: str):
    """The model and tokenizer of ``path``, which must hold a model of ``family``."""
    model = _load_model(path, "CHECKPOINT")
    if getattr(model, "family", None) != family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; {command} needs an {family} model"
        )
    tokenizer = _load_tokenizer(path, "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    return model, tokenizer


def _cmd_translate(args: argparse.Namespace) -> None:
    from attnkit.training.translation import translate

    beams = 1 if args.greedy else args.beam
    if beams < 1:
        raise UsageError(f"--beam: must be a positive integer, got {beams}")
    if any(not s.strip() for s in args.sentences):
        raise UsageError("SENTENCE: an empty sentence; give the text to translate")
    model, tokenizer = _load_for_task(args.checkpoint, "encoder-decoder", "translate")
    for line in translate(
        model, tokenizer, args.sentences, num_beams=beams, length_penalty=args.length_penalty
    ):
        print(line)


def _cmd_classify(args: argparse.Namespace) -> None:
    from attnkit.training.classification import classify

    model, tokenizer = _load_for_task(args.checkpoint, "encoder-classifier", "classify")
    labels = model.labels or [str(c) for c in range(model.classifier.out_features)]
    probs = classify(model, tokenizer, args.texts)  # (B, C)
    for text, row in zip(args.texts, probs.tolist(), strict=True):
        best = max(range(len(row)), key=row.__getitem__)
        if args.all:
            every = "  ".join(f"{name} {p:.3f}" for name, p in zip(labels, row, strict=True))
            print(f"{labels[best]}\t{every}\t{text}")
        else:
            print(f"{labels[best]}\t{row[best]:.3f}\t{text}")
