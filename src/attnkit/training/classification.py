"""Sequence classification: an ``EncoderClassifier`` reads a text and picks one of C labels.

Each example is ``[CLS] t_1 ... t_n`` (cut to ``max_len`` tokens, the ``[CLS]`` included) and a
label. The encoder attends over the whole text in both directions; the classifier reads the
``[CLS]`` position (or the mean of the real positions, ``pooling="mean"``) and a linear layer
gives the C logits. The loss is the cross entropy of the logits against the label, averaged over
the batch (label smoothing as the trainer says).

Batches hold ``batch_size`` texts of similar length (:class:`~attnkit.data.BucketBatchSampler`),
a pure function of ``(seed, epoch, index)``; padding is masked out of attention and pooling.

Evaluation: ``loss``, ``accuracy``, per class ``precision/NAME``, ``recall/NAME``, ``f1/NAME``,
their unweighted mean ``macro_f1``, and ``confusion``: C x C counts, row = true label,
column = predicted label (a list of lists; the only non-number in the metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.data import pad_batch
from attnkit.tables import format_table
from attnkit.training.tasks import Batch, ExampleTask, on_device

__all__ = ["ClassificationTask", "classification_metrics", "classification_report", "classify"]


def classification_metrics(
    predicted: Sequence[int], actual: Sequence[int], labels: Sequence[str]
) -> dict[str, Any]:
    """Accuracy, per-class precision / recall / F1, macro F1 and the confusion matrix.

    ``confusion[i][j]`` counts examples of true class i predicted as j. A class never predicted
    has precision 0 (and one never present recall 0), as scikit-learn's ``zero_division=0``.
    """
    if len(predicted) != len(actual):
        raise ValueError(
            f"classification_metrics: {len(predicted)} predictions for {len(actual)} labels"
        )
    c = len(labels)
    confusion = [[0] * c for _ in range(c)]
    for p, a in zip(predicted, actual, strict=True):
        confusion[a][p] += 1
    n = len(actual)
    result: dict[str, Any] = {"accuracy": sum(confusion[i][i] for i in range(c)) / max(n, 1)}
    f1s = []
    for i, name in enumerate(labels):
        hits = confusion[i][i]
        said = sum(confusion[j][i] for j in range(c))  # predicted as i
        there = sum(confusion[i])  # truly i
        precision = hits / said if said else 0.0
        recall = hits / there if there else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        result[f"precision/{name}"], result[f"recall/{name}"] = precision, recall
        result[f"f1/{name}"] = f1
        f1s.append(f1)
    result["macro_f1"] = sum(f1s) / c
    result["examples"] = n
    result["confusion"] = confusion
    return result


def encode_for_classifier(tokenizer, text: str, max_len: int) -> list[int]:
    """``[CLS]`` + the text's tokens, cut to ``max_len`` ids in all. A pretrained tokenizer adds
    its model's own special tokens (``[CLS] ... [SEP]``, ``<s> ... </s>``) and keeps them."""
    try:
        return tokenizer.encode(text, max_length=max_len)
    except TypeError:  # attnkit's own tokenizers: no special tokens, no max_length
        return [tokenizer.cls_id, *tokenizer.encode(text)][:max_len]


@torch.no_grad()
def classify(
    model: nn.Module, tokenizer, texts: Sequence[str], *, max_len: int | None = None
) -> Tensor:
    """Class probabilities (len(texts), C) of ``model`` (an ``EncoderClassifier``) for
    ``texts``, each encoded as ``[CLS]`` + tokens and cut to ``max_len`` (default the
    model's)."""
    if isinstance(texts, str):
        raise TypeError("classify: texts must be a list of strings, got one string")
    max_len = max_len or model.cfg.max_len
    ids, mask = pad_batch(
        [encode_for_classifier(tokenizer, t, max_len) for t in texts], tokenizer.pad_id
    )
    ids, mask = on_device(model, {"ids": ids, "mask": mask}).values()  # (B, N) x 2
    was_training = model.training
    model.eval()
    try:
        logits = model(ids, mask)  # (B, C)
    finally:
        model.train(was_training)
    return logits.float().softmax(-1)


class ClassificationTask(ExampleTask):
    """Text classification with an ``EncoderClassifier``; see the module docstring.

    ``examples`` maps "train", "validation" (and optionally "test") to lists of
    ``(text, label)`` with label in ``range(len(labels))``.
    """

    name = "classification"
    family = "encoder-classifier"

    def __init__(
        self,
        examples: Mapping[str, Sequence[tuple[str, int]]],
        tokenizer,
        labels: Sequence[str],
        max_len: int,
        *,
        seed: int = 0,
    ) -> None:
        if "train" not in examples or "validation" not in examples:
            raise ValueError(
                f"ClassificationTask: examples must hold 'train' and 'validation', got "
                f"{sorted(examples)}"
            )
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"ClassificationTask: max_len must be an int >= 2, got {max_len!r}")
        self.labels, self.max_len, self.seed = list(labels), max_len, seed
        self.pad_id = tokenizer.pad_id
        self.ids: dict[str, list[list[int]]] = {}
        self.targets: dict[str, Tensor] = {}
        for split, items in examples.items():
            if not items:
                raise ValueError(f"ClassificationTask: the {split} split has no examples")
            bad = [y for _, y in items if not 0 <= y < len(self.labels)]
            if bad:
                raise ValueError(
                    f"ClassificationTask: label {bad[0]!r} in the {split} split is outside "
                    f"[0, {len(self.labels)}) for labels {self.labels}"
                )
            self.ids[split] = [encode_for_classifier(tokenizer, text, max_len) for text, _ in items]
            self.targets[split] = torch.tensor([y for _, y in items], dtype=torch.long)
        self.lengths = [len(ids) for ids in self.ids["train"]]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "max_len": self.max_len,
            "labels": self.labels,
            "examples": {split: len(ids) for split, ids in self.ids.items()},
        }

    def _collate(self, indices: Sequence[int], split: str) -> Batch:
        ids, mask = pad_batch([self.ids[split][i] for i in indices], self.pad_id)  # (B, N) x 2
        return {"input_ids": ids, "attention_mask": mask, "labels": self.targets[split][indices]}

    def batch_tokens(self, batch: Batch) -> int:
        return int(batch["attention_mask"].sum())

    def loss(self, model: nn.Module, batch: Batch, *, smoothing: float = 0.0) -> tuple[Tensor, int]:
        logits = model(batch["input_ids"], batch["attention_mask"])  # (B, C)
        labels = batch["labels"]
        return F.cross_entropy(logits.float(), labels, label_smoothing=smoothing), len(labels)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> dict[str, Any]:
        """Loss and the metrics of :func:`classification_metrics` on the first
        ``max_batches * batch_size`` examples of a fixed random order (all when None)."""
        chosen = self.held_out(split, None if max_batches is None else max_batches * batch_size)
        chosen.sort(key=lambda i: len(self.ids[split][i]))
        was_training = model.training
        model.eval()
        total, predicted, actual = 0.0, [], []
        try:
            for start in range(0, len(chosen), batch_size):
                batch = on_device(model, self._collate(chosen[start : start + batch_size], split))
                logits = model(batch["input_ids"], batch["attention_mask"]).float()  # (B, C)
                total += float(F.cross_entropy(logits, batch["labels"], reduction="sum"))
                predicted += logits.argmax(-1).tolist()
                actual += batch["labels"].tolist()
        finally:
            model.train(was_training)
        return {"loss": total / max(len(chosen), 1)} | classification_metrics(
            predicted, actual, self.labels
        )

    @torch.no_grad()
    def sample(self, model: nn.Module, tokenizer, *, prompt: str, max_new_tokens: int, seed: int):
        """The predicted label of ``prompt`` (if given) with its probability."""
        if tokenizer is None or not prompt.strip():
            return None
        probs = classify(model, tokenizer, [prompt], max_len=self.max_len)[0]
        best = int(probs.argmax())
        return f"{prompt}\n-> {self.labels[best]} ({float(probs[best]):.3f})"


def classification_report(results: dict[str, dict], labels: list[str]) -> str:
    """Accuracy and macro F1 per split, then per-class precision / recall / F1 / support and
    the confusion matrix (rows: true label, columns: predicted)."""
    parts = [
        format_table(
            ["split", "examples", "loss", "accuracy", "macro F1"],
            [
                [
                    s,
                    f"{m['examples']:,}",
                    *(f"{m[k]:.4f}" for k in ("loss", "accuracy", "macro_f1")),
                ]
                for s, m in results.items()
            ],
        )
    ]
    for split, m in results.items():
        support = [sum(row) for row in m["confusion"]]
        rows = [
            [name, *(f"{m[f'{k}/{name}']:.4f}" for k in ("precision", "recall", "f1")), str(n)]
            for name, n in zip(labels, support, strict=True)
        ]
        parts.append(
            f"{split}: per class\n"
            + format_table(["label", "precision", "recall", "F1", "support"], rows)
        )
        matrix = [
            [f"true {name}", *map(str, row)]
            for name, row in zip(labels, m["confusion"], strict=True)
        ]
        parts.append(
            f"{split}: confusion matrix\n"
            + format_table(["", *(f"predicted {name}" for name in labels)], matrix)
        )
    parts.append("loss: mean cross entropy per example (nats)")
    return "\n\n".join(parts)
