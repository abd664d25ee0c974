"""attnkit models -> Hugging Face layouts: a ``config.json`` and a state dict that a
``transformers`` class loads with no weight missing or unused.

Each family goes to the class that computes the same function::

    attnkit model                                   transformers class (model_type)
    DecoderLM                                       the class of its architecture's description
                                                    (interop.architectures: the one it was read
                                                    from, else the first that holds it: Llama,
                                                    GPT-2, Qwen2, Qwen3, Phi-3, Gemma 3, Mistral)
    EncoderModel / EncoderClassifier, Post-LN       BertModel / BertForSequenceClassification
      with a norm after the embeddings (BERT)         (the descriptions of BERT and XLM-R-XL too)
    EncoderModel / EncoderClassifier, Pre-LN        XLMRobertaXLModel / ...ForSequenceClassification
      (a final norm, none after the embeddings)     (xlm-roberta-xl: the one Pre-LN encoder there)
    Transformer, Post-LN, sinusoidal positions      MarianMTModel (marian)

Two of these need a word:

- **Marian** is the paper's Post-LN encoder-decoder with fixed sinusoidal positions, like
  attnkit's translator; BART learns its positions and normalises the embeddings, so it is not.
  Marian's table keeps the sines in the first half of the model dimension and the cosines in
  the second, where the paper (and attnkit) interleave them. Every operation on the residual
  stream (LayerNorm, residual adds, projections in and out) commutes with a fixed permutation of
  the model dimension, so the export permutes it (Marian's description, ``~cols`` and ``~rows``:
  :func:`attnkit.interop.weights.marian_permutation`): the columns of every matrix that reads
  the residual stream, the rows of every matrix that writes it, the norms' weights and biases.
  The logits are the same, and attnkit reads the directory back.
- **Classifier heads.** BERT's head is ``tanh(W_p h_[CLS] + b_p)`` then a linear layer, and
  XLM-R-XL's is the same shape. An attnkit classifier that loaded BERT has that pooler and it is
  written as it is. One without a pooler reads ``h_[CLS]`` straight into its linear layer; the
  export then writes ``W_p = eps I`` and the classifier times ``1 / eps`` (eps = 1e-4), so that
  ``tanh(eps h) / eps = h (1 - eps^2 h^2 / 3 ...)``: equal to float32 rounding for hidden values
  up to hundreds. A plain encoder without a pooler gets a zero pooler (its pooled output is 0);
  ``last_hidden_state`` is the model's output.

XLM-R-XL (like RoBERTa) counts positions from ``pad_token_id + 1``: the position table is
written with ``pad_id + 1`` zero rows in front of attnkit's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.config import ModelConfig
from attnkit.interop.architecture import Architecture, config_to_hf, refusal
from attnkit.interop.architectures import ARCHITECTURES, HF_ONLY, for_model, takers
from attnkit.interop.weights import marian_permutation, weights_to
from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer
from attnkit.position import sinusoidal_table

__all__ = ["HEAD_EPS", "hf_layout", "refuse", "to_hf"]

HEAD_EPS = 1e-4  # the pooler's linear range for a classifier without a pooler


def refuse(field: str, value: Any, where: str, takes: str) -> ValueError:
    """The one-line refusal: the field, its value, what the format needs, what would take it."""
    return ValueError(f"cannot export {field}={value!r} to {where}: {takes}")


def _description(model: nn.Module, where: str) -> tuple[Architecture, tuple | None]:
    """The description ``model`` is written by in ``where``, and its refusal (or None)."""
    if isinstance(model, DecoderLM):
        return for_model(model.cfg, where)
    classes = {a.name: a for a in HF_ONLY}
    if isinstance(model, Transformer):
        return classes["marian"], refusal(classes["marian"], model.cfg, where)
    pre = model.cfg.norm == "pre"  # Pre-LN encoders: XLM-RoBERTa-XL, the one there is
    arch = classes["xlm-roberta-xl" if pre else "bert"]
    if isinstance(model, EncoderClassifier):
        arch = classes[f"{arch.name}-classifier"]
    cfg = replace(model.cfg, pooler=True, type_vocab_size=max(model.cfg.type_vocab_size, 1))
    return arch, refusal(arch, cfg, where)  # (a pooler and a token type are written anyway)


def hf_layout(model: nn.Module, where: str = "hf") -> str:
    """The name of the description that writes ``model`` in ``where`` ("hf" or "gguf"); a
    ValueError naming the first field with no counterpart there."""
    if not isinstance(model, DecoderLM | EncoderModel | EncoderClassifier | Transformer):
        raise TypeError(f"model must be an attnkit model, got {type(model).__name__}")
    if isinstance(model, EncoderClassifier) and model.pooling != "cls":
        raise refuse(
            "pooling",
            model.pooling,
            "Hugging Face",
            "BERT's and XLM-R's classifiers read the [CLS] position ('cls'); "
            "export the encoder alone and pool outside",
        )
    arch, refused = _description(model, where)
    if refused is None:
        return arch.name
    field, value, needs = refused
    others = takers(field, value) if isinstance(model, DecoderLM) else []
    others = f"; {', '.join(others)} would" if others else "; no layout attnkit writes takes it"
    fmt = "GGUF" if where == "gguf" else "Hugging Face"
    raise refuse(field, value, f"{arch.title} (the {fmt} layout for this model)", needs + others)


def to_hf(model: nn.Module, labels: list[str] | None = None) -> tuple[dict, dict[str, Tensor]]:
    """``config.json`` values and the state dict of the matching transformers class."""
    layout = hf_layout(model)
    cfg, state = model.cfg, {k: v.detach().float() for k, v in model.state_dict().items()}
    arch = ARCHITECTURES.get(layout) or next(a for a in HF_ONLY if a.name == layout)
    if arch.family in ("encoder-only", "encoder-classifier"):
        cfg, state = _encoder_parts(model, state)
    config = config_to_hf(arch, cfg)
    files = weights_to(arch, "hf", cfg, state)
    if arch.family == "decoder-only" and cfg.tie_embeddings:  # transformers ties it too
        files["lm_head.weight"] = state["lm_head.weight"]
    if arch.family == "encoder-decoder":  # Marian's own sinusoids (sines, then cosines), no bias,
        table = sinusoidal_table(cfg.max_len, cfg.d_model)[:, marian_permutation(cfg.d_model)]
        for side in ("encoder", "decoder"):
            files[f"model.{side}.embed_positions.weight"] = table
        files["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
        shared = files["model.shared.weight"]  # and the tables transformers ties
        files["model.encoder.embed_tokens.weight"] = shared
        if cfg.tie_embeddings:
            files.update({"model.decoder.embed_tokens.weight": shared, "lm_head.weight": shared})
    if isinstance(model, EncoderClassifier):
        count = len(state["classifier.bias"])
        names = labels or model.labels or [f"LABEL_{c}" for c in range(count)]
        config.update(id2label=dict(enumerate(names)), label2id={n: c for c, n in enumerate(names)})
    return config, {k: v.contiguous() for k, v in files.items()}


def _encoder_parts(model, state: dict) -> tuple[ModelConfig, dict]:
    """What BERT's and XLM-R-XL's classes always have and an attnkit encoder may not: a token
    type (a zero row, added to every token) and a pooler (see the module docstring)."""
    cfg, d = model.cfg, model.cfg.d_model
    inner = "encoder." if isinstance(model, EncoderClassifier) else ""
    if not cfg.type_vocab_size:
        state[f"{inner}embeddings.token_types.weight"] = torch.zeros(1, d)
    if not cfg.pooler and inner:  # tanh's linear range: tanh(eps h) / eps = h
        state.update({"encoder.pooler.weight": torch.eye(d) * HEAD_EPS,
                      "encoder.pooler.bias": torch.zeros(d)})  # fmt: skip
        state["classifier.weight"] = state["classifier.weight"] / HEAD_EPS
    elif not cfg.pooler:  # the pooled output is 0; last_hidden_state is the model's output
        state.update({"pooler.weight": torch.zeros(d, d), "pooler.bias": torch.zeros(d)})
    return replace(cfg, pooler=True, type_vocab_size=max(cfg.type_vocab_size, 1)), state
