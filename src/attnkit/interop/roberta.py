"""RoBERTa and XLM-RoBERTa (Hugging Face layout) -> attnkit's EncoderModel or EncoderClassifier.

RoBERTa is BERT's encoder with three differences that matter to the weights (the tensor names
inside ``roberta.`` are BERT's; see :mod:`attnkit.interop.bert`):

- **Positions start after the padding index.** Hugging Face numbers a real token
  ``padding_idx + 1 + t`` (``padding_idx`` = ``pad_token_id``, 1 for RoBERTa and XLM-R), so
  rows 0 .. padding_idx of the position table are never read for text. attnkit counts positions
  from 0, so it keeps the rows from ``padding_idx + 1`` on: the same vectors for the same
  tokens, and ``max_len`` = ``max_position_embeddings - padding_idx - 1`` (512 for 514). This
  is exact for unpadded and right-padded batches, the way RoBERTa's tokenizers pad.
- **One token type** (``type_vocab_size`` = 1): its row is added to every token, as in BERT.
- **The classification head** of ``...ForSequenceClassification`` is
  ``out_proj(tanh(dense(h_<s>)))``, which is BERT's pooler followed by its classifier:
  ``classifier.dense`` -> ``pooler``, ``classifier.out_proj`` -> ``classifier``.

``...ForMaskedLM`` loads as its encoder (the ``lm_head.*`` tensors are left out).
"""

from __future__ import annotations

from torch import nn

from attnkit.interop.bert import (
    _num_labels,
    bert_config_from_hf,
    bert_state_dict,
    encoder_model,
)
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.hf_config import HFConfig

__all__ = ["load_roberta"]

PREFIXES = ("Roberta", "XLMRoberta")
ENCODERS = ("Model", "ForMaskedLM")
CLASSIFIERS = ("ForSequenceClassification",)
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _architecture(hf: HFConfig) -> tuple[str, bool]:
    """(the first architecture's name, whether it is a sequence classifier)."""
    default = "XLMRobertaModel" if hf.get("model_type") == "xlm-roberta" else "RobertaModel"
    architectures = hf.get("architectures") or [default]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise hf.error(f"architectures must be a list of names, got {architectures!r}")
    supported = [p + s for p in PREFIXES for s in ENCODERS + CLASSIFIERS]
    if architectures[0] not in supported:
        raise hf.error(
            f"RoBERTa architecture {architectures[0]!r} is not supported; attnkit reads {supported}"
        )
    return architectures[0], architectures[0].endswith(CLASSIFIERS)


def load_roberta(hf: HFConfig, tensors: Tensors) -> nn.Module:
    """An EncoderModel or EncoderClassifier from a RoBERTa / XLM-R ``config.json`` and tensors."""
    _, classifier = _architecture(hf)
    tensors = tensors.rename(lambda name: name.removeprefix("roberta."))
    tensors.discard(lambda name: name not in _BUFFERS and not name.startswith("lm_head."))
    if classifier:
        tensors = tensors.rename(
            lambda name: name.replace("classifier.dense.", "pooler.dense.").replace(
                "classifier.out_proj.", "classifier."
            )
        )
    num_classes = _num_labels(hf) if classifier else 0
    table = bert_config_from_hf(hf, pooler=classifier or "pooler.dense.weight" in tensors)
    first = table.pad_id + 1  # the position row of the first token
    if table.max_len <= first:
        raise hf.error(
            f"max_position_embeddings={table.max_len} leaves no positions after "
            f"pad_token_id={table.pad_id}"
        )
    hf.check_unknown()
    state = bert_state_dict(table, tensors)  # the whole position table, then its used rows
    positions = "embeddings.positions.embedding.weight"
    state[positions] = state[positions][first:].contiguous()
    cfg = table.replace(max_len=table.max_len - first, extra={"source": "roberta"})
    return encoder_model(cfg, state, tensors, num_classes)
