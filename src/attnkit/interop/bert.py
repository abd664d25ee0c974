"""BERT (Hugging Face layout) -> attnkit's EncoderModel or EncoderClassifier.

BERT is the paper's encoder in Post-LN order, with learned positions, token types ("segment A /
B"), a LayerNorm right after the embeddings, GELU and its own ``layer_norm_eps`` (1e-12), and a
pooler ``tanh(W h_[CLS] + b)``. The mapping (``bert.`` prefixes optional)::

    Hugging Face                                    attnkit
    embeddings.word_embeddings                   -> embeddings.tokens
    embeddings.position_embeddings               -> embeddings.positions.embedding
    embeddings.token_type_embeddings             -> embeddings.token_types
    embeddings.LayerNorm                         -> embeddings.norm
    encoder.layer.{i}.attention.self.query  \\
    encoder.layer.{i}.attention.self.key     }   -> encoder.layers.{i}.self_attn.in_proj
    encoder.layer.{i}.attention.self.value  /       (rows stacked: [query; key; value])
    encoder.layer.{i}.attention.output.dense     -> encoder.layers.{i}.self_attn.out_proj
    encoder.layer.{i}.attention.output.LayerNorm -> encoder.layers.{i}.norm1
    encoder.layer.{i}.intermediate.dense         -> encoder.layers.{i}.ffn.up
    encoder.layer.{i}.output.dense               -> encoder.layers.{i}.ffn.down
    encoder.layer.{i}.output.LayerNorm           -> encoder.layers.{i}.norm2
    pooler.dense                                 -> pooler
    classifier          (sequence classification) -> classifier

Architectures: ``BertModel`` -> EncoderModel (with the pooler when the checkpoint has one);
``BertForSequenceClassification`` -> EncoderClassifier reading [CLS] through the pooler;
``BertForMaskedLM`` / ``BertForPreTraining`` -> their encoder, as an EncoderModel (the
pretraining heads, ``cls.*``, are left out). Old checkpoints' LayerNorm ``gamma`` / ``beta`` are
read as ``weight`` / ``bias``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.config import ModelConfig
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig
from attnkit.models import EncoderClassifier, EncoderModel
from attnkit.serialization import build_empty

__all__ = ["bert_config_from_hf", "bert_state_dict", "encoder_model", "load_bert"]

# hidden_act -> (attnkit activation, GELU approximation)
_ACTIVATIONS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", "none"),
}
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification",)


def bert_config_from_hf(hf: HFConfig, *, pooler: bool = True) -> ModelConfig:
    """A ModelConfig from a BERT ``config.json`` (every field checked)."""
    activation, approximation = hf.get_choice("hidden_act", _ACTIVATIONS, "gelu")
    hf.expect(
        "position_embedding_type", "absolute", why="attnkit's BERT has absolute learned positions"
    )
    hf.expect("is_decoder", False, why="attnkit's BERT is a bidirectional encoder")
    vocab = hf.get_int("vocab_size")
    d_model, n_heads = hf.get_int("hidden_size"), hf.get_int("num_attention_heads")
    if d_model % n_heads:
        raise hf.error(
            f"num_attention_heads={n_heads} does not divide hidden_size={d_model}; attnkit's "
            "attention needs d_head = d_model / n_heads"
        )
    pad = hf.get_token_id("pad_token_id", vocab)
    try:
        return ModelConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_heads=n_heads,
            n_layers=hf.get_int("num_hidden_layers"),
            d_ff=hf.get_int("intermediate_size"),
            max_len=hf.get_int("max_position_embeddings", 512),
            dropout=hf.get_dropout("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get_dropout("attention_probs_dropout_prob", 0.1),
            pad_id=0 if pad is None else pad,
            bos_id=hf.get_token_id("bos_token_id", vocab),
            eos_id=hf.get_token_id("eos_token_id", vocab),
            norm="post",
            norm_type="layernorm",
            norm_eps=hf.get_positive("layer_norm_eps", 1e-12),
            position="learned",
            activation=activation,
            gelu_approximation=approximation,
            bias=True,
            tie_embeddings=False,
            embedding_norm=True,
            type_vocab_size=hf.get_int("type_vocab_size", 2),
            pooler=pooler,
            extra={"source": "bert"},
        )
    except ValueError as error:
        raise hf.error(str(error)) from None


def _rename(name: str) -> str:
    name = name.removeprefix("bert.")
    if name.endswith(".gamma"):
        return name.removesuffix(".gamma") + ".weight"
    if name.endswith(".beta"):
        return name.removesuffix(".beta") + ".bias"
    return name


def bert_state_dict(cfg: ModelConfig, tensors: Tensors) -> dict[str, Tensor]:
    """EncoderModel weights from BERT tensors (already renamed: no ``bert.`` prefix)."""
    d, ff = cfg.d_model, cfg.d_ff

    def norm(theirs: str, mine: str) -> None:
        ours[f"{mine}.weight"] = tensors.take(f"{theirs}.weight", (d,))
        ours[f"{mine}.bias"] = tensors.take(f"{theirs}.bias", (d,))

    def linear(theirs: str, mine: str, n_out: int, n_in: int) -> None:
        ours[f"{mine}.weight"] = tensors.take(f"{theirs}.weight", (n_out, n_in))
        ours[f"{mine}.bias"] = tensors.take(f"{theirs}.bias", (n_out,))

    ours: dict[str, Tensor] = {
        "embeddings.tokens.weight": tensors.take(
            "embeddings.word_embeddings.weight", (cfg.vocab_size, d)
        ),
        "embeddings.positions.embedding.weight": tensors.take(
            "embeddings.position_embeddings.weight", (cfg.max_len, d)
        ),
        "embeddings.token_types.weight": tensors.take(
            "embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, d)
        ),
    }
    norm("embeddings.LayerNorm", "embeddings.norm")
    for i in range(cfg.n_layers):
        theirs, mine = f"encoder.layer.{i}", f"encoder.layers.{i}"
        attention = f"{theirs}.attention.self"
        ours[f"{mine}.self_attn.in_proj.weight"] = torch.cat(
            [tensors.take(f"{attention}.{p}.weight", (d, d)) for p in ("query", "key", "value")]
        )  # (3 D, D): [W^Q; W^K; W^V]
        ours[f"{mine}.self_attn.in_proj.bias"] = torch.cat(
            [tensors.take(f"{attention}.{p}.bias", (d,)) for p in ("query", "key", "value")]
        )
        linear(f"{theirs}.attention.output.dense", f"{mine}.self_attn.out_proj", d, d)
        norm(f"{theirs}.attention.output.LayerNorm", f"{mine}.norm1")
        linear(f"{theirs}.intermediate.dense", f"{mine}.ffn.up", ff, d)
        linear(f"{theirs}.output.dense", f"{mine}.ffn.down", d, ff)
        norm(f"{theirs}.output.LayerNorm", f"{mine}.norm2")
    if cfg.pooler:
        linear("pooler.dense", "pooler", d, d)
    return ours


def load_bert(hf: HFConfig, tensors: Tensors) -> nn.Module:
    """An EncoderModel or EncoderClassifier from a BERT ``config.json`` and its tensors."""
    architectures = hf.get("architectures") or ["BertModel"]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise hf.error(f"architectures must be a list of names, got {architectures!r}")
    architecture = architectures[0]
    supported = ENCODER_ARCHITECTURES + CLASSIFIER_ARCHITECTURES
    if architecture not in supported:
        raise hf.error(
            f"BERT architecture {architecture!r} is not supported; attnkit reads {list(supported)}"
        )
    tensors = tensors.rename(_rename)
    tensors.discard(lambda name: name != "embeddings.position_ids")  # a buffer, not a weight
    classifier = architecture in CLASSIFIER_ARCHITECTURES
    if not classifier:
        tensors.discard(lambda name: not name.startswith("cls."))  # pretraining heads
    num_classes = _num_labels(hf) if classifier else 0
    cfg = bert_config_from_hf(hf, pooler=classifier or "pooler.dense.weight" in tensors)
    hf.check_unknown()
    return encoder_model(cfg, bert_state_dict(cfg, tensors), tensors, num_classes)


def encoder_model(
    cfg: ModelConfig, state: dict[str, Tensor], tensors: Tensors, num_classes: int
) -> nn.Module:
    """The EncoderModel holding ``state`` or, with ``num_classes``, the EncoderClassifier that
    also takes ``classifier.weight`` / ``.bias`` from ``tensors``; every tensor must be used."""
    if num_classes:  # load_state_dict(strict=True) below fills every weight
        model = build_empty(lambda: EncoderClassifier(cfg, num_classes, pooling="cls"))
        state = {f"encoder.{k}": v for k, v in state.items()}
        state["classifier.weight"] = tensors.take("classifier.weight", (num_classes, cfg.d_model))
        state["classifier.bias"] = tensors.take("classifier.bias", (num_classes,))
    else:
        model = build_empty(lambda: EncoderModel(cfg))
    tensors.check_all_used()
    model.load_state_dict(state, strict=True)
    return model.eval()


def _num_labels(hf: HFConfig) -> int:
    id2label = hf.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise hf.error(f"id2label must be an object, got {type(id2label).__name__}")
    count = len(id2label) if id2label else hf.get_int("num_labels", 2)
    hf.ignore("num_labels")
    if count < 2:
        raise hf.error(
            f"{count} label(s): a regression head is not supported; attnkit's "
            "EncoderClassifier needs at least 2 classes"
        )
    return count
