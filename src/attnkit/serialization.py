"""attnkit's own model directories, and the one registry of model families.

A directory written by ``model.save_pretrained(dir)``::

    dir/config.json         {"attnkit": {"format": 1, "family": ..., ...}, "config": {...}}
    dir/model.safetensors   the weights (a tied matrix is stored once)
    dir/tokenizer.json      the tokenizer, when one was given

The directory is written next to its final place and renamed into it, so a crash never leaves a
half-written model where a good one was. Nothing is ever unpickled: weights are safetensors.

``FAMILIES`` maps each family name to its class; the model classes enter it with the
:func:`family` decorator, and everything that builds a model from a name (loading, recipes, the
command line) looks it up here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_file
from torch import nn

from attnkit.config import ModelConfig
from attnkit.files import atomic_directory, read_json

__all__ = [
    "CONFIG_FILE",
    "FAMILIES",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "build_empty",
    "family",
    "load_attnkit",
    "packed_layout",
    "read_config",
    "save_pretrained",
    "write_pretrained",
]

FORMAT = 1
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"

FAMILIES: dict[str, type[nn.Module]] = {}


def family(name: str):
    """Class decorator: register a model class under a family name (and set ``cls.family``)."""

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        cls.family = name
        FAMILIES[name] = cls
        return cls

    return register


def _family_of(model: nn.Module) -> str:
    name = getattr(model, "family", None)
    cls = FAMILIES.get(name)
    if cls is None or not isinstance(model, cls):
        raise TypeError(f"save_pretrained: not an attnkit model: {type(model).__name__}")
    return name


def _stored(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as the file keeps it: each tensor contiguous (a weight laid out for
    decoding is (out, in) with strides (1, out)), a tied one once, under its first name
    (``load_model`` fills the others)."""
    stored, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            stored[name] = t.contiguous()
    return stored


def write_pretrained(model: nn.Module, directory: Path, *, tokenizer=None) -> None:
    """Write config.json + model.safetensors (+ tokenizer.json) into an existing directory,
    not atomically: for writers (training checkpoints) that make their own directory atomic."""
    meta: dict[str, Any] = {"format": FORMAT, "family": _family_of(model), **model.extra_meta()}
    (directory / CONFIG_FILE).write_text(
        json.dumps({"attnkit": meta, "config": model.cfg.to_dict()}, indent=2) + "\n"
    )
    save_file(_stored(model), str(directory / WEIGHTS_FILE))
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)


def packed_layout(model: nn.Module) -> dict[str, str]:
    """{module name: block format} for every layer of ``model`` that keeps its weights in
    blocks (a module with a ``block_format``, as ``accel.PackedLinear`` and
    ``accel.PackedEmbedding`` have): saved in config.json, so that loading rebuilds them."""
    return {
        name: module.block_format
        for name, module in model.named_modules()
        if isinstance(getattr(module, "block_format", None), str)
    }


def save_pretrained(model: nn.Module, directory: str | os.PathLike[str], *, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json) to ``directory``, atomically;
    config.json's ``extra.packed`` names the layers kept in blocks, if any."""
    _family_of(model)  # refuse a non-attnkit model before creating anything
    model.cfg.extra["packed"] = packed_layout(model)
    if not model.cfg.extra["packed"]:
        del model.cfg.extra["packed"]
    with atomic_directory(directory) as tmp:
        write_pretrained(model, tmp, tokenizer=tokenizer)
    return Path(directory)


def read_config(path: Path) -> dict[str, Any]:
    """A model directory's config.json as a dict (a clear error when it is missing or bad)."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a model directory)")
    return read_json(config_path)


def load_attnkit(path: Path, data: dict[str, Any], prepare=None) -> nn.Module:
    """The model of an attnkit directory whose config.json is ``data``, in eval mode.
    ``prepare(model)``, if given, runs on the built model before its weights are read (the
    packed layers of a quantized model are restored there)."""
    meta = data["attnkit"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path / CONFIG_FILE}: unsupported attnkit format {meta!r}")
    name = meta.get("family")
    if name not in FAMILIES:
        raise ValueError(
            f"{path / CONFIG_FILE}: unknown family {name!r}; expected one of {sorted(FAMILIES)}"
        )
    try:
        cfg = ModelConfig.from_dict(data.get("config"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path / CONFIG_FILE}: {error}") from None
    model = build_empty(lambda: FAMILIES[name].from_meta(cfg, meta))  # every weight is read
    if prepare is not None:
        prepare(model)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"{weights}: cannot read the weights ({error})") from None
    if missing or unexpected:
        raise ValueError(
            f"{weights}: the weights do not fit the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()


def build_empty(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` without drawing random initial weights, for a model whose weights are all
    loaded next.

    A model about to receive loaded weights would spend over a second (SmolLM2-135M, 2 cores)
    filling 135M parameters with random numbers. So the model is built on the ``meta`` device
    (shapes, no memory); each parameter and buffer then gets uninitialised memory on the CPU (a
    tied weight one tensor, still tied), and each module that computes buffers in its
    constructor (positions' tables and frequencies) computes them again (``reset_buffers()``).
    """
    with torch.device("meta"):
        model = build()
    fresh: dict[int, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False)]
    named += [*model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        if id(t) not in fresh:
            new = torch.empty_like(t, device="cpu")
            is_parameter = isinstance(t, nn.Parameter)
            fresh[id(t)] = nn.Parameter(new, t.requires_grad) if is_parameter else new
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, fresh[id(t)])
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model
