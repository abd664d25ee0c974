"""Hugging Face model directories -> attnkit models.

A Hugging Face directory is ``config.json`` (whose ``model_type`` names the architecture) and
the weights in safetensors, one file or shards (see :mod:`attnkit.interop.checkpoint`)::

    model_type   architectures                               attnkit model
    bert         BertModel, BertForMaskedLM, BertForPreTraining   EncoderModel
    bert         BertForSequenceClassification                 EncoderClassifier
    gemma3_text  Gemma3ForCausalLM, Gemma3TextModel             DecoderLM
    gpt2         GPT2LMHeadModel, GPT2Model                     DecoderLM
    llama        LlamaForCausalLM, LlamaModel                   DecoderLM
    roberta      RobertaModel, RobertaForMaskedLM                EncoderModel
    xlm-roberta  XLMRobertaModel, XLMRobertaForMaskedLM          EncoderModel
    (either)     ...ForSequenceClassification                  EncoderClassifier

Every field of ``config.json`` is read with its type checked, fields attnkit cannot represent
are refused by name, and so are fields it does not know (see :mod:`attnkit.interop.hf_config`).
The weights are converted to float32. ``attnkit.from_pretrained(path)`` dispatches here for any
directory whose ``config.json`` is not attnkit's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch import nn

from attnkit.interop.bert import load_bert
from attnkit.interop.checkpoint import Tensors, read_hf_weights
from attnkit.interop.gemma3 import load_gemma3
from attnkit.interop.gpt2 import load_gpt2
from attnkit.interop.hf_config import HFConfig
from attnkit.interop.llama import load_llama
from attnkit.interop.roberta import load_roberta

__all__ = ["ARCHITECTURES", "load_hf_directory"]

CONFIG_FILE = "config.json"

# model_type -> loader(config, tensors)
ARCHITECTURES: dict[str, Callable[[HFConfig, Tensors], nn.Module]] = {
    "bert": load_bert,
    "gemma3_text": load_gemma3,
    "gpt2": load_gpt2,
    "llama": load_llama,
    "roberta": load_roberta,
    "xlm-roberta": load_roberta,
}
_PREFIXES = {
    "Bert": "bert",
    "Gemma3": "gemma3_text",
    "GPT2": "gpt2",
    "Llama": "llama",
    "Roberta": "roberta",
    "XLMRoberta": "xlm-roberta",
}


def _model_type(hf: HFConfig) -> str:
    model_type = hf.get("model_type")
    if model_type is None:  # very old configs: guess from the class name
        architectures = hf.get("architectures") or []
        first = architectures[0] if isinstance(architectures, list) and architectures else ""
        model_type = next(
            (t for prefix, t in _PREFIXES.items() if str(first).startswith(prefix)), None
        )
    if model_type not in ARCHITECTURES:
        found = model_type or hf.data.get("architectures") or "unknown"
        raise ValueError(
            f"{hf.source}: model type {found!r} is not supported; attnkit reads Hugging Face "
            f"directories of {sorted(ARCHITECTURES)}, GGUF files of Llama and Gemma 3 models, "
            "and its own directories"
        )
    return model_type


def load_hf_directory(path: str | os.PathLike[str]) -> nn.Module:
    """The attnkit model for a Hugging Face model directory, in eval mode."""
    path = Path(path)
    hf = HFConfig.from_file(path / CONFIG_FILE)
    model_type = _model_type(hf)
    tensors = read_hf_weights(path)
    return ARCHITECTURES[model_type](hf, tensors).eval()
