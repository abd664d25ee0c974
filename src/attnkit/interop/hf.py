"""Hugging Face model directories -> attnkit models.

A Hugging Face directory is ``config.json`` (whose ``model_type`` and classes name the
architecture: one description each, :mod:`attnkit.interop.architectures`) and the weights in
safetensors, one file or shards (see :mod:`attnkit.interop.checkpoint`). The description is read
by :mod:`attnkit.interop.architecture` (the config) and :mod:`attnkit.interop.weights` (the
tensors).

Every field of ``config.json`` is read with its type checked, fields attnkit cannot represent
are refused by name, and so are fields it does not know (see :mod:`attnkit.interop.hf_config`).
The weights are converted to float32. ``attnkit.from_pretrained(path)`` dispatches here for any
directory whose ``config.json`` is not attnkit's own.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from attnkit.interop.architecture import config_from_hf
from attnkit.interop.architectures import ARCHITECTURES, by_hf, gguf_names, hf_types
from attnkit.interop.checkpoint import Tensors, read_hf_weights
from attnkit.interop.hf_config import HFConfig
from attnkit.interop.weights import build

__all__ = ["from_hf", "load_hf_directory"]

CONFIG_FILE = "config.json"
# very old configs have no model_type: the class name says it
_PREFIXES = {"Bert": "bert", "XLMRobertaXL": "xlm-roberta-xl", "XLMRoberta": "xlm-roberta",
             "Roberta": "roberta"}  # fmt: skip


def _model_type(hf: HFConfig) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        architectures = hf.get("architectures") or []
        first = str(architectures[0]) if isinstance(architectures, list) and architectures else ""
        prefixes = {**_PREFIXES, **{c: a.hf_types[0] for a in ARCHITECTURES.values()
                                    for c in a.hf_classes}}  # fmt: skip
        model_type = next((t for p, t in prefixes.items() if first.startswith(p)), None)
    if model_type not in hf_types():
        found = model_type or hf.data.get("architectures") or "unknown"
        raise ValueError(
            f"{hf.source}: model type {found!r} is not supported; attnkit reads Hugging Face "
            f"directories of {hf_types()}, GGUF files of {gguf_names()}, and its own "
            "directories"
        )
    return model_type


def load_hf_directory(path: str | os.PathLike[str]) -> nn.Module:
    """The attnkit model for a Hugging Face model directory, in eval mode."""
    path = Path(path)
    hf = HFConfig.from_file(path / CONFIG_FILE)
    _model_type(hf)  # an unknown architecture is refused before the weights are read
    return from_hf(hf, read_hf_weights(path))


def from_hf(config: dict | HFConfig, tensors: dict | Tensors) -> nn.Module:
    """The attnkit model for a ``config.json``'s values and a state dict of the transformers
    class it names (what :func:`attnkit.interop.hf_export.to_hf` returns, for instance)."""
    hf = config if isinstance(config, HFConfig) else HFConfig(config, "the config")
    if not isinstance(tensors, Tensors):
        tensors = Tensors(tensors, "the state dict")
    model_type = _model_type(hf)
    classes = hf.get("architectures")
    if classes is not None and not (
        isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)
    ):
        raise hf.error(f"architectures must be a list of names, got {classes!r}")
    try:
        arch = by_hf(model_type, classes[0] if classes else None)
    except ValueError as error:
        raise hf.error(str(error)) from None
    return build(arch, "hf", config_from_hf(arch, hf, tensors.keys()), tensors)
