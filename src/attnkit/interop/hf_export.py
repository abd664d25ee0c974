"""attnkit models -> Hugging Face layouts: a ``config.json`` and a state dict that a
``transformers`` class loads with no weight missing or unused.

Each family goes to the class that computes the same function::

    attnkit model                                   transformers class (model_type)
    DecoderLM                                       the class of its architecture's description
                                                    (interop.architectures: the one it was read
                                                    from, else the first that holds it: Llama,
                                                    GPT-2, Qwen2, Qwen3, Phi-3, Gemma 3, Mistral)
    EncoderModel / EncoderClassifier, Post-LN       BertModel / BertForSequenceClassification
      with a norm after the embeddings (BERT)
    EncoderModel / EncoderClassifier, Pre-LN        XLMRobertaXLModel / ...ForSequenceClassification
      (a final norm, none after the embeddings)     (xlm-roberta-xl: the one Pre-LN encoder there)
    Transformer, Post-LN, sinusoidal positions      MarianMTModel (marian)

Two of these need a word:

- **Marian** is the paper's Post-LN encoder-decoder with fixed sinusoidal positions, like
  attnkit's translator; BART learns its positions and normalises the embeddings, so it is not.
  Marian's table keeps the sines in the first half of the model dimension and the cosines in
  the second, where the paper (and attnkit) interleave them. Every operation on the residual
  stream (LayerNorm, residual adds, projections in and out) commutes with a fixed permutation of
  the model dimension, so the export permutes it (:func:`marian_permutation`): the columns of
  every matrix that reads the residual stream, the rows of every matrix that writes it, the
  norms' weights and biases. The logits are the same.
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

from typing import Any

import torch
from torch import Tensor, nn

from attnkit.config import ModelConfig
from attnkit.interop.architecture import config_to_hf, weights_to
from attnkit.interop.architectures import ARCHITECTURES, for_model, takers
from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer
from attnkit.position import sinusoidal_table

__all__ = ["HEAD_EPS", "hf_layout", "marian_permutation", "refuse", "to_hf"]

HEAD_EPS = 1e-4  # the pooler's linear range for a classifier without a pooler

# the encoders' layouts -> (what it is, the fields it needs as attnkit names them)
_ENCODER = {
    "attention": "full",
    "n_experts": 0,
    "qk_norm": False,
    "sandwich_norms": False,
    "position": "learned",
    "norm_type": "layernorm",
    "bias": True,
    "head_dim": None,
}
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": (
        "BERT",
        {**_ENCODER, "norm": "post", "embedding_norm": True, "scale_embeddings": False},
    ),
    "xlm-roberta-xl": (
        "XLM-RoBERTa-XL",
        {**_ENCODER, "norm": "pre", "embedding_norm": False, "scale_embeddings": False},
    ),
    "marian": (
        "Marian",
        {
            **_ENCODER,  # scale_embeddings: Marian's scale_embedding
            "position": "sinusoidal",
            "norm": "post",
            "embedding_norm": False,
            "type_vocab_size": 0,
            "norm_eps": 1e-5,
        },
    ),
}
_ACTIVATIONS = {  # (activation, GELU approximation) -> transformers' name
    ("gelu", "none"): "gelu",
    ("gelu", "tanh"): "gelu_pytorch_tanh",
    ("relu", "none"): "relu",
    ("relu", "tanh"): "relu",
}


def refuse(field: str, value: Any, where: str, takes: str) -> ValueError:
    """The one-line refusal: the field, its value, what the format needs, what would take it."""
    return ValueError(f"cannot export {field}={value!r} to {where}: {takes}")


def hf_layout(model: nn.Module, where: str = "hf") -> str:
    """The name of the layout (an architecture of :mod:`attnkit.interop.architectures` for a
    decoder, a key of :data:`LAYOUTS` otherwise) that computes the same function as ``model``
    in ``where`` ("hf" or "gguf"); a ValueError naming the first field with no counterpart."""
    cfg: ModelConfig = model.cfg
    if isinstance(model, DecoderLM):
        arch, refused = for_model(cfg, where)
        if refused is None:
            return arch.name
        field, value, needs = refused
        others = takers(field, value)
        others = f"; {', '.join(others)} would" if others else "; no layout attnkit writes takes it"
        fmt = "GGUF" if where == "gguf" else "Hugging Face"
        where = f"{arch.title} (the {fmt} layout for this model)"
        raise refuse(field, value, where, needs + others)
    if isinstance(model, EncoderModel | EncoderClassifier):
        layout = "bert" if cfg.norm == "post" else "xlm-roberta-xl"
        if isinstance(model, EncoderClassifier) and model.pooling != "cls":
            raise refuse(
                "pooling",
                model.pooling,
                "Hugging Face",
                "BERT's and XLM-R's classifiers read the [CLS] position ('cls'); "
                "export the encoder alone and pool outside",
            )
    elif isinstance(model, Transformer):
        layout = "marian"
    else:
        raise TypeError(f"model must be an attnkit model, got {type(model).__name__}")
    name, needs = LAYOUTS[layout]
    for field, expected in needs.items():
        value = getattr(cfg, field)
        if value != expected:
            raise refuse(
                field,
                value,
                f"{name} (the Hugging Face layout for this model)",
                f"{name} needs {expected!r}" + _elsewhere(field, value),
            )
    if cfg.kv_heads != cfg.n_heads:
        raise refuse("n_kv_heads", cfg.n_kv_heads, name, "grouped-query attention: Llama has it")
    if (cfg.activation, cfg.gelu_approximation) not in _ACTIVATIONS:
        raise refuse("activation", cfg.activation, name, "it takes 'relu' or 'gelu'")
    return layout


def _elsewhere(field: str, value: Any) -> str:
    """Which layouts would take ``field=value`` (for the refusal)."""
    found = [name for name, needs in LAYOUTS.values() if field in needs and needs[field] == value]
    found += takers(field, value)
    return f"; {', '.join(found)} would" if found else "; no layout attnkit writes takes it"


def to_hf(model: nn.Module, labels: list[str] | None = None) -> tuple[dict, dict[str, Tensor]]:
    """``config.json`` values and the state dict of the matching transformers class."""
    layout = hf_layout(model)
    model_state = {k: v.detach().float() for k, v in model.state_dict().items()}
    if layout in ARCHITECTURES:
        arch = ARCHITECTURES[layout]
        config = config_to_hf(arch, model.cfg)
        state = weights_to(arch, "hf", model.cfg, model_state)
        if model.cfg.tie_embeddings:  # transformers finds the output layer tied, as attnkit's
            state["lm_head.weight"] = model_state["lm_head.weight"]
    elif layout == "marian":
        config, state = _marian(model.cfg, model_state)
    else:
        config, state = _encoder(model, layout, model_state, labels)
    return config, {k: v.detach().float().contiguous() for k, v in state.items()}


def _special_ids(cfg: ModelConfig) -> dict[str, int | None]:
    return {"pad_token_id": cfg.pad_id, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id}


def _split_attention(state: dict, sd: dict, mine: str, theirs: str, names: tuple[str, ...]):
    """in_proj rows [W^Q; W^K; W^V] (and biases) -> three linear layers named ``names``."""
    for part in ("weight", "bias"):
        for name, rows in zip(names, sd[f"{mine}.in_proj.{part}"].chunk(3), strict=True):
            state[f"{theirs}.{name}.{part}"] = rows


def _linear(state: dict, sd: dict, mine: str, theirs: str) -> None:
    for part in ("weight", "bias"):
        state[f"{theirs}.{part}"] = sd[f"{mine}.{part}"]


def _encoder(model, layout: str, sd: dict, labels) -> tuple[dict, dict[str, Tensor]]:
    """BERT (Post-LN) or XLM-RoBERTa-XL (Pre-LN), plain or with the classification head."""
    cfg: ModelConfig = model.cfg
    classifier = isinstance(model, EncoderClassifier)
    if classifier:
        sd = {k.removeprefix("encoder."): v for k, v in sd.items()}
    bert = layout == "bert"
    offset = 0 if bert else cfg.pad_id + 1  # XLM-R counts positions from pad_id + 1
    config = {
        "model_type": layout,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": _ACTIVATIONS[cfg.activation, cfg.gelu_approximation],
        "max_position_embeddings": cfg.max_len + offset,
        "type_vocab_size": max(cfg.type_vocab_size, 1),
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "position_embedding_type": "absolute",
        **_special_ids(cfg),
    }
    d = cfg.d_model
    positions = sd["embeddings.positions.embedding.weight"]
    types = sd.get("embeddings.token_types.weight", torch.zeros(1, d))
    state = {
        "embeddings.word_embeddings.weight": sd["embeddings.tokens.weight"],
        "embeddings.position_embeddings.weight": torch.cat(
            [positions.new_zeros(offset, d), positions]
        ),
        "embeddings.token_type_embeddings.weight": types,
    }
    if bert:
        _linear(state, sd, "embeddings.norm", "embeddings.LayerNorm")
    else:
        _linear(state, sd, "encoder.norm", "encoder.LayerNorm")
    for i in range(cfg.n_layers):
        mine, theirs = f"encoder.layers.{i}", f"encoder.layer.{i}"
        _split_attention(
            state, sd, f"{mine}.self_attn", f"{theirs}.attention.self", ("query", "key", "value")
        )
        _linear(state, sd, f"{mine}.self_attn.out_proj", f"{theirs}.attention.output.dense")
        _linear(state, sd, f"{mine}.ffn.up", f"{theirs}.intermediate.dense")
        _linear(state, sd, f"{mine}.ffn.down", f"{theirs}.output.dense")
        if bert:
            _linear(state, sd, f"{mine}.norm1", f"{theirs}.attention.output.LayerNorm")
            _linear(state, sd, f"{mine}.norm2", f"{theirs}.output.LayerNorm")
        else:
            _linear(state, sd, f"{mine}.norm1", f"{theirs}.attention.self_attn_layer_norm")
            _linear(state, sd, f"{mine}.norm2", f"{theirs}.LayerNorm")
    pooler = (sd["pooler.weight"], sd["pooler.bias"]) if cfg.pooler else None
    stem = "Bert" if bert else "XLMRobertaXL"
    if not classifier:
        config["architectures"] = [f"{stem}Model"]
        weight, bias = pooler or (torch.zeros(d, d), torch.zeros(d))  # pooled output: 0
        return config, {**state, "pooler.dense.weight": weight, "pooler.dense.bias": bias}
    head_w, head_b = sd["classifier.weight"], sd["classifier.bias"]
    if pooler is None:  # tanh's linear range: tanh(eps h) / eps = h
        pooler = (torch.eye(d) * HEAD_EPS, torch.zeros(d))
        head_w = head_w / HEAD_EPS
    names = labels or [f"LABEL_{c}" for c in range(len(head_b))]
    config.update(
        architectures=[f"{stem}ForSequenceClassification"],
        id2label=dict(enumerate(names)),
        label2id={n: c for c, n in enumerate(names)},
    )
    prefix = "bert." if bert else "roberta."
    state = {prefix + k: v for k, v in state.items()}
    dense, out = (
        ("bert.pooler.dense", "classifier") if bert else ("classifier.dense", "classifier.out_proj")
    )
    state.update(
        {
            f"{dense}.weight": pooler[0],
            f"{dense}.bias": pooler[1],
            f"{out}.weight": head_w,
            f"{out}.bias": head_b,
        }
    )
    return config, state


def marian_permutation(d_model: int) -> Tensor:
    """Marian's dimension m holds attnkit's dimension ``perm[m]``: the even dimensions (sines)
    first, then the odd ones (cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian(cfg: ModelConfig, sd: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """MarianMTModel with the model dimension permuted (see the module's docstring)."""
    d, perm = cfg.d_model, marian_permutation(cfg.d_model)
    config = {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": d,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.n_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": _ACTIVATIONS[cfg.activation, cfg.gelu_approximation],
        "max_position_embeddings": cfg.max_len,
        "scale_embedding": cfg.scale_embeddings,
        "share_encoder_decoder_embeddings": cfg.tie_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "decoder_start_token_id": cfg.bos_id,
        "forced_eos_token_id": None,
        "is_encoder_decoder": True,
        **_special_ids(cfg),
    }
    src = sd["src_embeddings.tokens.weight"][:, perm]
    tgt = sd["tgt_embeddings.tokens.weight"][:, perm]
    table = sinusoidal_table(cfg.max_len, d)[:, perm]  # Marian's own table: sines, then cosines
    state = {
        "model.shared.weight": src,
        "model.encoder.embed_tokens.weight": src,
        "model.decoder.embed_tokens.weight": tgt,
        "model.encoder.embed_positions.weight": table,
        "model.decoder.embed_positions.weight": table,
        "lm_head.weight": sd["lm_head.weight"][:, perm],
        "final_logits_bias": torch.zeros(1, cfg.vocab_size),
    }

    def reads(name: str) -> None:  # a linear layer reading the residual stream
        state[f"{name}.weight"] = state[f"{name}.weight"][:, perm]

    def writes(name: str) -> None:  # a linear layer (or a norm) writing it
        for part in ("weight", "bias"):
            state[f"{name}.{part}"] = state[f"{name}.{part}"][perm]

    for side in ("encoder", "decoder"):
        attentions = [("self_attn", "self_attn", "norm1")]
        if side == "decoder":
            attentions.append(("cross_attn", "encoder_attn", "norm2"))
        for i in range(cfg.n_layers):
            mine, theirs = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            for attention, name, norm in attentions:
                _split_attention(
                    state,
                    sd,
                    f"{mine}.{attention}",
                    f"{theirs}.{name}",
                    ("q_proj", "k_proj", "v_proj"),
                )
                _linear(state, sd, f"{mine}.{attention}.out_proj", f"{theirs}.{name}.out_proj")
                _linear(state, sd, f"{mine}.{norm}", f"{theirs}.{name}_layer_norm")
                for p in ("q_proj", "k_proj", "v_proj"):
                    reads(f"{theirs}.{name}.{p}")
                writes(f"{theirs}.{name}.out_proj")
                writes(f"{theirs}.{name}_layer_norm")
            last_norm = "norm2" if side == "encoder" else "norm3"
            _linear(state, sd, f"{mine}.ffn.up", f"{theirs}.fc1")
            _linear(state, sd, f"{mine}.ffn.down", f"{theirs}.fc2")
            _linear(state, sd, f"{mine}.{last_norm}", f"{theirs}.final_layer_norm")
            reads(f"{theirs}.fc1")
            writes(f"{theirs}.fc2")
            writes(f"{theirs}.final_layer_norm")
    return config, state
