"""``attnkit evaluate``, ``translate`` and ``classify``: a trained model on its task."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli._common import UsageError, _load_model, _load_tokenizer, _to_device, _where
from attnkit.tables import format_table

OUT_OF_DOMAIN = "out-of-domain"


def _format_metric(name: str, value: float) -> str:
    return f"{int(value):,}" if name in ("tokens", "sentences") else f"{value:.4f}"


def _cmd_evaluate(args: argparse.Namespace) -> None:
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
    model, tokenizer, recipe, step = _model_and_recipe(path, args.recipe, args.set)
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    if getattr(model, "family", None) != task.family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; the {task.name!r} task "
            f"evaluates {task.family} models"
        )
    device = _to_device(model, args.device, str(path))
    if args.translations and task.name != "translation":
        raise UsageError(f"--translations: {path} is a {task.name!r} model, not a translator")
    splits = args.split or [s for s in ("validation", "test") if s in task.splits]
    decoding = {}
    if task.name == "translation":
        decoding = _decoding(path, args.beam, args.length_penalty)
        task.length_penalty = decoding["length_penalty"]
        if args.split is None or OUT_OF_DOMAIN in args.split:
            _add_out_of_domain(task, recipe, required=args.split is not None)
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
        with precision_context(args.precision, device):
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
    precision = resolve_precision(args.precision, device)
    precision += " (auto)" if args.precision == "auto" else ""
    print(
        f"{path}: {type(model).__name__}, {where}task {task.name}, {precision}, {_where(device)}\n"
    )
    if task.name == "classification":
        print(classification_report(results, task.labels))
        return
    names = [n for n, v in next(iter(results.values())).items() if not isinstance(v, list)]
    header = ["split", *names]
    rows = [[s, *(_format_metric(n, m[n]) for n in names)] for s, m in results.items()]
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


def _model_and_recipe(path: Path, recipe_file: str | None, overrides: list[str]):
    """The model, its tokenizer, the recipe that names its data, and its step (or None)."""
    from attnkit.training import CheckpointError, Recipe, RecipeError, read_trainer_state
    from attnkit.training.checkpoint import read_recipe
    from attnkit.training.recipes import load_recipe

    try:
        if recipe_file:
            recipe = load_recipe(recipe_file, overrides)
        else:
            raw = read_recipe(path)
            if raw is None:
                raise UsageError(
                    f"CHECKPOINT: {path} has no trainer_state.json or recipe.json to say what "
                    "data it was trained on; give --recipe FILE"
                )
            recipe = Recipe.from_dict(raw, str(path))
    except (CheckpointError, ValueError) as error:
        if isinstance(error, RecipeError):
            raise UsageError(str(error)) from None
        raise UsageError(f"CHECKPOINT: {error}; give --recipe FILE to name its data") from None
    step = read_trainer_state(path).step if (path / "trainer_state.json").is_file() else None
    model = _load_model(str(path), "CHECKPOINT")
    tokenizer = _load_tokenizer(str(path), "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    return model, tokenizer, recipe, step


def _decoding(path: Path, beams: int | None, length_penalty: float | None) -> dict:
    """The beams and length penalty to decode with: the options, else the model's
    decoding.json, else 4 and 1.0; ``source`` says where the length penalty came from."""
    from attnkit.training.translation import DECODING_FILE, read_decoding

    try:
        recorded = read_decoding(path)
    except ValueError as error:
        raise UsageError(f"CHECKPOINT: {error}") from None
    source = "default"
    if (path / DECODING_FILE).is_file():
        chosen_on = recorded.get("chosen_on")
        source = f"chosen on {chosen_on}" if chosen_on else DECODING_FILE
    if length_penalty is not None:
        source = "--length-penalty"
    return {
        "num_beams": beams if beams is not None else recorded["num_beams"],
        "length_penalty": length_penalty
        if length_penalty is not None
        else recorded["length_penalty"],
        "source": source,
    }


def _add_out_of_domain(task, recipe, *, required: bool) -> None:
    """Add the recipe's out-of-domain test set to ``task`` as a split (when there is one)."""
    import sys

    from attnkit.data import CorpusNotFoundError
    from attnkit.training.recipes import out_of_domain_pairs

    try:
        found = out_of_domain_pairs(recipe)
    except CorpusNotFoundError as error:
        if required:
            raise UsageError(f"--split {OUT_OF_DOMAIN}: {error}") from None
        print(f"note: no {OUT_OF_DOMAIN} test set ({error})", file=sys.stderr)
        return
    if found is None:
        if required:
            raise UsageError(
                f"--split {OUT_OF_DOMAIN}: data.corpus={recipe.data.corpus!r} has no "
                "out-of-domain test set (help-de-en and help-zh-en have one)"
            )
        return
    task.out_of_domain_name, pairs = found
    task.add_split(OUT_OF_DOMAIN, pairs)


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
    import sys

    from attnkit.training.translation import translate

    if args.beam is not None and args.beam < 1:
        raise UsageError(f"--beam: must be a positive integer, got {args.beam}")
    if args.length_penalty is not None and args.length_penalty < 0:
        raise UsageError(f"--length-penalty: must be >= 0, got {args.length_penalty}")
    for number, sentence in enumerate(args.sentences, start=1):
        if not sentence.strip():
            raise UsageError(f"SENTENCE {number}: empty; give the text to translate")
    model, tokenizer = _load_for_task(args.checkpoint, "encoder-decoder", "translate")
    _to_device(model, args.device, args.checkpoint)
    decoding = _decoding(
        Path(args.checkpoint), 1 if args.greedy else args.beam, args.length_penalty
    )
    limit = model.cfg.max_len
    for number, sentence in enumerate(args.sentences, start=1):
        length = len(tokenizer.encode(sentence, add_eos=True))
        if length > limit:
            print(
                f"note: SENTENCE {number} is {length} tokens; only its first {limit} (the "
                "model's context) are translated",
                file=sys.stderr,
            )
    for line in translate(
        model,
        tokenizer,
        args.sentences,
        num_beams=decoding["num_beams"],
        length_penalty=decoding["length_penalty"],
    ):
        print(line)


def _cmd_classify(args: argparse.Namespace) -> None:
    from attnkit.training.classification import classify

    model, tokenizer = _load_for_task(args.checkpoint, "encoder-classifier", "classify")
    _to_device(model, args.device, args.checkpoint)
    labels = model.labels or [str(c) for c in range(model.classifier.out_features)]
    probs = classify(model, tokenizer, args.texts)  # (B, C)
    for text, row in zip(args.texts, probs.tolist(), strict=True):
        best = max(range(len(row)), key=row.__getitem__)
        if args.all:
            every = "  ".join(f"{name} {p:.3f}" for name, p in zip(labels, row, strict=True))
            print(f"{labels[best]}\t{every}\t{text}")
        else:
            print(f"{labels[best]}\t{row[best]:.3f}\t{text}")
