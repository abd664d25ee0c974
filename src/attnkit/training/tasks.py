"""Tasks: what the one training loop needs to know about a kind of training.

The :class:`~attnkit.training.trainer.Trainer` is the same for every model family; a task
supplies the rest::

    task.steps_per_epoch(B)              how many batches make one pass over the training split
    task.train_batch(epoch, i, B)        batch i of epoch e: a pure function of (seed, e, i, B),
                                         so a resumed run asks for exactly the batch it would
                                         have got (no data-loader state to save)
    task.loss(model, batch, smoothing)   (mean loss over the batch's real tokens, their count)
    task.evaluate(model, split, B, k)    {"loss": ..., plus the task's own metrics} on the first
                                         k batches (all when k is None) of a held-out split
    task.describe()                      JSON that goes into the checkpoint (the task's name...)
    task.splits                          the splits it holds ("train", "validation", "test")
    task.batch_tokens(batch)             tokens a batch trains on (for tokens/s)
    task.sample(model, tokenizer, ...)   a short demonstration for the end of training, or None

:class:`LanguageModelTask` is next-token prediction on packed blocks (``DecoderLM``).
:class:`ExampleTask` is the common part of the tasks over separate examples: length-bucketed
training batches and a fixed held-out order.
:class:`~attnkit.training.translation.TranslationTask` (``Transformer``; BLEU and chrF) and
:class:`~attnkit.training.classification.ClassificationTask` (``EncoderClassifier``; accuracy,
precision, recall, F1) fill the same interface.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit.data import BucketBatchSampler, PackedBlocks
from attnkit.training.losses import label_smoothed_cross_entropy

__all__ = ["Batch", "ExampleTask", "LanguageModelTask", "Task"]

Batch = dict[str, Tensor]


def on_device(model: nn.Module, batch: Batch) -> Batch:
    """The batch's tensors on the device of ``model``'s weights. Batches are made on the CPU;
    a model on a GPU (a run under torchrun on GPUs) evaluates them there."""
    device = next(model.parameters()).device
    return {key: value.to(device) for key, value in batch.items()}


class Task(ABC):
    """One kind of training: batches, the loss, evaluation. See the module docstring."""

    name: ClassVar[str]
    family: ClassVar[str]  # the model family it trains: "decoder-only", "encoder-decoder", ...

    @abstractmethod
    def steps_per_epoch(self, batch_size: int) -> int:
        """Full batches of ``batch_size`` in one pass over the training split."""

    @abstractmethod
    def train_batch(self, epoch: int, index: int, batch_size: int) -> Batch:
        """Batch ``index`` of ``epoch``; always the same tensors for the same arguments."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch, *, smoothing: float = 0.0) -> tuple[Tensor, int]:
        """The training loss of one batch (a scalar, mean over real tokens) and their count."""

    @abstractmethod
    def evaluate(
        self, model: nn.Module, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> dict[str, float]:
        """Metrics on a held-out split; always includes ``"loss"``. Runs under no_grad."""

    @property
    @abstractmethod
    def splits(self) -> list[str]:
        """The splits the task holds ("train", "validation", and "test" when there is one)."""

    def describe(self) -> dict[str, Any]:
        """What the checkpoint records about the task."""
        return {"name": self.name, "family": self.family}

    def batch_tokens(self, batch: Batch) -> int:
        """Tokens the batch trains on, for the tokens/s figure: every input id by default."""
        return int(batch["input_ids"].numel())

    def sample(self, model: nn.Module, tokenizer, *, prompt: str, max_new_tokens: int, seed: int):
        """A short text the trained model makes, for the end of a run; None if the task has
        no such thing."""
        return None


class ExampleTask(Task):
    """A task over separate examples (sentence pairs, labelled texts) rather than one stream.

    A subclass fills ``self.ids`` (split -> list of encoded examples), ``self.lengths`` (the
    length of each training example, for bucketing) and ``self.seed``, and writes
    ``_collate(indices, split) -> Batch``. Training batches then hold ``batch_size`` examples of
    similar length: ``BucketBatchSampler(lengths, B, seed, drop_last=True).batches(epoch)``, a
    pure function of (seed, epoch, index). Evaluation reads :meth:`held_out`, one fixed random
    order of a split, so ``max_batches=k`` is always the same unbiased sample.
    """

    ids: dict[str, list]
    lengths: list[int]
    seed: int
    _epoch_batches: tuple[int, int, list[list[int]]] | None = None

    @abstractmethod
    def _collate(self, indices: list[int], split: str) -> Batch:
        """The examples ``indices`` of ``split``, padded into one batch."""

    @property
    def splits(self) -> list[str]:
        return list(self.ids)

    def steps_per_epoch(self, batch_size: int) -> int:
        return len(self.ids["train"]) // batch_size

    def train_batch(self, epoch: int, index: int, batch_size: int) -> Batch:
        cached = self._epoch_batches
        if cached is None or cached[:2] != (epoch, batch_size):
            sampler = BucketBatchSampler(self.lengths, batch_size, seed=self.seed, drop_last=True)
            cached = (epoch, batch_size, sampler.batches(epoch))
            self._epoch_batches = cached
        return self._collate(cached[2][index], "train")

    def held_out(self, split: str, max_examples: int | None = None) -> list[int]:
        """The first ``max_examples`` (all when None) of a fixed random order of ``split``."""
        if split not in self.ids:
            raise ValueError(
                f"{type(self).__name__}.evaluate: split must be one of {self.splits}, got {split!r}"
            )
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(self.ids[split]), generator=generator).tolist()
        return order if max_examples is None else order[:max_examples]


class LanguageModelTask(Task):
    """Next-token prediction on blocks of a token stream (``DecoderLM``).

    ``streams`` maps "train", "validation" and "test" to 1-D tensors of token ids (the test
    split may be missing). Training batches are ``PackedBlocks(train, block_size,
    seed=seed).batch(epoch, index, B)``: x (B, T) and y = x shifted by one. Evaluation reads the
    held-out blocks in one fixed random order (seeded), so ``max_batches=k`` is the same k
    batches every time, an unbiased sample of the whole split.

    ``repeat`` (0 to 1) is the share of training blocks, drawn from ``(seed, epoch, index)``,
    in which a passage of the block's first tokens is written again at a random later place:
    only copying from earlier in the context predicts the second copy (the practice that makes
    induction heads form within minutes; validation blocks stay as they are).

    Metrics: ``loss`` (mean cross entropy in nats per token, no smoothing), ``perplexity``
    = exp(loss), ``bits_per_token`` = loss / ln 2, ``tokens`` counted.
    """

    name = "lm"
    family = "decoder-only"

    def __init__(
        self,
        streams: Mapping[str, Tensor],
        block_size: int,
        *,
        seed: int = 0,
        pad_id: int = 0,
        repeat: float = 0.0,
    ) -> None:
        if "train" not in streams or "validation" not in streams:
            raise ValueError(
                f"LanguageModelTask: streams must hold 'train' and 'validation', got "
                f"{sorted(streams)}"
            )
        self.block_size, self.seed, self.pad_id, self.repeat = block_size, seed, pad_id, repeat
        self.blocks: dict[str, PackedBlocks] = {}
        for split, stream in streams.items():
            if len(stream) < block_size + 1:
                raise ValueError(
                    f"LanguageModelTask: the {split} split has {len(stream)} tokens, fewer than "
                    f"block_size + 1 = {block_size + 1}; use a smaller data.block_size"
                )
            self.blocks[split] = PackedBlocks(stream, block_size, seed=seed, shuffle=True)

    @property
    def splits(self) -> list[str]:
        return list(self.blocks)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "block_size": self.block_size,
            "tokens": {split: len(blocks.tokens) for split, blocks in self.blocks.items()},
        }

    def steps_per_epoch(self, batch_size: int) -> int:
        return self.blocks["train"].steps_per_epoch(batch_size)

    def train_batch(self, epoch: int, index: int, batch_size: int) -> Batch:
        x, y = self.blocks["train"].batch(epoch, index, batch_size)  # (B, T), (B, T)
        if self.repeat:
            x, y = self._repeated(x, y, epoch, index)
        return {"input_ids": x, "labels": y}

    def _repeated(self, x: Tensor, y: Tensor, epoch: int, index: int) -> tuple[Tensor, Tensor]:
        """``self.repeat`` of the rows, each with a passage of its first tokens (1/8 to 1/2 of
        the block) written again at a random later place: where it comes only matching the
        passage's content, not a fixed distance, predicts it."""
        generator = torch.Generator().manual_seed(hash((self.seed, epoch, index)) % 2**63)
        text = torch.cat([x, y[:, -1:]], dim=1)  # (B, T + 1)
        n = text.shape[1]
        for row in range(text.shape[0]):
            draws = torch.rand(3, generator=generator).tolist()
            if draws[0] >= self.repeat:
                continue
            length = max(1, int(n / 8 + draws[1] * (n / 2 - n / 8)))
            at = length + int(draws[2] * (n - 2 * length))
            text[row, at : at + length] = text[row, :length].clone()
        return text[:, :-1], text[:, 1:]

    def loss(self, model: nn.Module, batch: Batch, *, smoothing: float = 0.0) -> tuple[Tensor, int]:
        labels = batch["labels"]  # (B, T)
        count = int((labels != self.pad_id).sum())
        if hasattr(model, "loss"):  # the model itself (or FSDP's): LM head and loss in one pass
            loss = model.loss(
                batch["input_ids"], labels, ignore_index=self.pad_id, smoothing=smoothing
            )
        else:  # a DistributedDataParallel wrapper: its forward must run (gradient sync)
            logits = model(batch["input_ids"])  # (B, T, V)
            loss = label_smoothed_cross_entropy(
                logits, labels, smoothing=smoothing, ignore_index=self.pad_id
            )
        return loss, count

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None = None):
        """(inputs, targets) batches of a split, (B, T) each, in a fixed order."""
        if split not in self.blocks:
            raise ValueError(
                f"LanguageModelTask.evaluate: split must be one of {sorted(self.blocks)}, "
                f"got {split!r}"
            )
        blocks = self.blocks[split]
        order = blocks.order(0)  # a fixed random order of all the split's blocks
        count = math.ceil(len(order) / batch_size)
        if max_batches is not None:
            count = min(count, max_batches)
        for b in range(count):
            picked = order[b * batch_size : (b + 1) * batch_size].tolist()
            pairs = [blocks[i] for i in picked]
            yield torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, split: str, *, batch_size: int, max_batches: int | None = None
    ) -> dict[str, float]:
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        try:
            for x, y in self.eval_batches(split, batch_size, max_batches):  # (B, T), (B, T)
                x, y = on_device(model, {"x": x, "y": y}).values()
                logits = model(x)
                total += float(
                    label_smoothed_cross_entropy(
                        logits, y, ignore_index=self.pad_id, reduction="sum"
                    )
                )
                tokens += int((y != self.pad_id).sum())
        finally:
            model.train(was_training)
        loss = total / max(tokens, 1)
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_token": loss / math.log(2),
            "tokens": tokens,
        }

    @torch.no_grad()
    def sample(self, model: nn.Module, tokenizer, *, prompt: str, max_new_tokens: int, seed: int):
        """``prompt`` continued by sampling (temperature 0.8), within the model's max_len."""
        if tokenizer is None or max_new_tokens <= 0:
            return None
        ids = tokenizer.encode(prompt) if prompt else [int(self.blocks["validation"].tokens[0])]
        ids = ids[-(model.cfg.max_len - 1) :]
        new = min(max_new_tokens, model.cfg.max_len - len(ids))
        was_training = model.training
        model.eval()
        try:
            prompt_ids = on_device(model, {"ids": torch.tensor([ids])})["ids"]  # (1, N)
            out = model.generate(prompt_ids, new, do_sample=True, temperature=0.8, seed=seed)
        finally:
            model.train(was_training)
        return tokenizer.decode(out[0].tolist())
