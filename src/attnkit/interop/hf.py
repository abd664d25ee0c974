"""Hugging Face model directories -> attnkit models.

A Hugging Face directory is ``config.json`` (whose ``model_type`` names the architecture) and
the weights in safetensors, one file or shards (see :mod:`attnkit.interop.checkpoint`)::

    model_type   architectures                               attnkit model
    bert         BertModel, BertForMaskedLM, BertForPreTraining   EncoderModel
    bert         BertForSequenceClassification                 EncoderClassifier
    roberta      RobertaModel, RobertaForMaskedLM                EncoderModel
    xlm-roberta  XLMRobertaModel, XLMRobertaForMaskedLM          EncoderModel
    (either)     ...ForSequenceClassification                  EncoderClassifier
    llama, mistral, qwen2, qwen3, phi3, gemma3_text, gpt2     DecoderLM
                 (interop.architectures: one description each)

Every field of ``config.json`` is read with its type checked, fields attnkit cannot represent
are refused by name, and so are fields it does not know (see :mod:`attnkit.interop.hf_config`).
The weights are converted to float32. ``attnkit.from_pretrained(path)`` dispatches here for any
directory whose ``config.json`` is not attnkit's own.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from attnkit.interop.architecture import build, config_from_hf
from attnkit.interop.architectures import ARCHITECTURES, by_hf_type, gguf_names
from attnkit.interop.bert import load_bert
from attnkit.interop.checkpoint import Tensors, read_hf_weights
from attnkit.interop.hf_config import HFConfig
from attnkit.interop.roberta import load_roberta

__all__ = ["from_hf", "load_hf_directory", "model_types"]

CONFIG_FILE = "config.json"
ENCODERS = {"bert": load_bert, "roberta": load_roberta, "xlm-roberta": load_roberta}
# very old configs have no model_type: the class name's prefix says it
_PREFIXES = {"Bert": "bert", "Roberta": "roberta", "XLMRoberta": "xlm-roberta"}


def model_types() -> list[str]:
    """Every ``model_type`` attnkit reads."""
    return sorted([*ENCODERS, *(t for a in ARCHITECTURES.values() for t in a.hf_types)])


def _model_type(hf: HFConfig) -> str:
    model_type = hf.get("model_type")
    if model_type is None:
        architectures = hf.get("architectures") or []
        first = str(architectures[0]) if isinstance(architectures, list) and architectures else ""
        prefixes = {**_PREFIXES, **{c: a.hf_types[0] for a in ARCHITECTURES.values()
                                    for c in a.hf_classes}}  # fmt: skip
        model_type = next((t for p, t in prefixes.items() if first.startswith(p)), None)
    if model_type not in model_types():
        found = model_type or hf.data.get("architectures") or "unknown"
        raise ValueError(
            f"{hf.source}: model type {found!r} is not supported; attnkit reads Hugging Face "
            f"directories of {model_types()}, GGUF files of {gguf_names()}, and its own "
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
    if model_type in ENCODERS:
        return ENCODERS[model_type](hf, tensors).eval()
    arch = by_hf_type(model_type)
    classes = hf.get("architectures") or [arch.hf_classes[0]]
    if not isinstance(classes, list) or classes[0] not in arch.hf_classes:
        raise hf.error(
            f"{arch.title} architecture {classes!r} is not supported; attnkit reads "
            f"{list(arch.hf_classes)}"
        )
    return build(arch, "hf", config_from_hf(arch, hf), tensors)
