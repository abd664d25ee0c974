"""What the task commands share (evaluate, translate, classify, tune-length-penalty): a
checkpoint with its recipe, its decoding settings, the evaluation options."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli.common import UsageError, add_device_option, load_model, load_tokenizer

OUT_OF_DOMAIN = "out-of-domain"


def format_metric(name: str, value: float) -> str:
    return f"{int(value):,}" if name in ("tokens", "sentences") else f"{value:.4f}"


def model_and_recipe(path: Path, recipe_file: str | None, overrides: list[str]):
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
    model = load_model(str(path), "CHECKPOINT")
    tokenizer = load_tokenizer(str(path), "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    return model, tokenizer, recipe, step


def decoding_settings(path: Path, beams: int | None, length_penalty: float | None) -> dict:
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


def add_out_of_domain(task, recipe, *, required: bool) -> None:
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


def load_for_task(path: str, family: str, command: str):
    """The model and tokenizer of ``path``, which must hold a model of ``family``."""
    model = load_model(path, "CHECKPOINT")
    if getattr(model, "family", None) != family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; {command} needs an {family} model"
        )
    tokenizer = load_tokenizer(path, "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    return model, tokenizer


def add_evaluation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        help="fp32, bf16 autocast, or auto: bf16 where the device has fast bf16 matrix "
        "products (a CPU with them, a GPU that supports bf16), else fp32. Default: the run's "
        "own (its recipe's train.precision, which its validation used), so that the figures "
        "are the ones its training reported",
    )
    add_device_option(parser, "evaluate")


def run_precision(args: argparse.Namespace, recipe) -> str:
    """--precision, or the recipe's train.precision (what the run validated with)."""
    return args.precision or recipe.train.precision
