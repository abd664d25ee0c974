"""Translation: the paper's task, for the encoder-decoder ``Transformer``.

Each example is a pair of token sequences, both ending in EOS::

    source  x = Wir  sind  nicht  viel  weiter  gekommen  .  <eos>
    target  y = We   did   not    get   much    further   .  <eos>

Teacher forcing: the decoder reads the target shifted right, ``shift_right(y, bos)`` =
``<bos> We did ... .``, and at position t is trained to predict ``y[t]`` (it sees ``y[<t]``
only: its self-attention is causal). Padding is never a target: label positions holding
``pad_id`` are left out of the loss, and the masks keep padding out of every attention.

Batches hold ``batch_size`` pairs of similar length (:class:`~attnkit.data.BucketBatchSampler`,
keyed on the longer side), a pure function of ``(seed, epoch, index)``. Pairs with a side
longer than ``max_len`` tokens are left out of training; held-out sources are cut to
``max_len`` so every held-out pair is scored.

Evaluation reports the loss and, for each requested beam width, corpus BLEU and chrF from
``sacrebleu`` (default settings: 13a tokenisation, exponential smoothing off for the corpus
score) of the decoded translations against the reference texts exactly as the corpus gives them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from torch import Tensor, nn

from attnkit.data import pad_batch
from attnkit.files import atomic_write_text, read_json
from attnkit.models import shift_right
from attnkit.training.losses import label_smoothed_cross_entropy
from attnkit.training.tasks import Batch, ExampleTask, on_device

__all__ = [
    "DECODING_FILE",
    "LENGTH_PENALTIES",
    "TranslationTask",
    "choose_length_penalty",
    "corpus_scores",
    "read_decoding",
    "score_signatures",
    "translate",
    "write_decoding",
    "write_translations",
]

Pair = tuple[str, str]
# A translator's decoding settings, kept in its model directory: {"num_beams", "length_penalty"}.
DECODING_FILE = "decoding.json"
DEFAULT_DECODING = {"num_beams": 4, "length_penalty": 1.0}
LENGTH_PENALTIES = (0.6, 0.8, 1.0, 1.2, 1.5)  # what choose_length_penalty tries by default


def score_signatures() -> dict[str, str]:
    """sacrebleu's signatures of the scores :func:`corpus_scores` computes (one reference,
    tokeniser, smoothing, case, version): quote them with any BLEU or chrF figure."""
    signatures = {}
    for name, metric in (("bleu", sacrebleu.BLEU()), ("chrf", sacrebleu.CHRF())):
        metric.corpus_score(["-"], [["-"]])  # a signature exists once the reference count does
        signatures[name] = str(metric.get_signature())
    return signatures


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu's defaults) of ``hypotheses`` against one reference
    each: ``{"bleu": ..., "chrf": ...}``, both on sacrebleu's 0-100 scale."""
    if len(hypotheses) != len(references):
        raise ValueError(
            f"corpus_scores: {len(hypotheses)} hypotheses for {len(references)} references"
        )
    return {
        "bleu": sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score,
        "chrf": sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score,
    }


@torch.no_grad()
def translate(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str],
    *,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    batch_size: int = 64,
    max_len: int | None = None,
) -> list[str]:
    """Translate ``texts`` with ``model`` (a ``Transformer``): greedy for ``num_beams=1``, else
    beam search. Sources are encoded with EOS, cut to ``max_len`` (default the model's), and
    decoded in batches of similar length; the output keeps the input order. A translation may
    be up to 1.5 x its source length + 10 tokens (within ``max_len``)."""
    if isinstance(texts, str):
        raise TypeError("translate: texts must be a list of strings, got one string")
    cfg = model.cfg
    max_len = max_len or cfg.max_len
    encoded = [tokenizer.encode(text, add_eos=True)[:max_len] for text in texts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(encoded)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            src, mask = pad_batch([encoded[i] for i in chunk], cfg.pad_id)  # (B, S), (B, S)
            src, mask = on_device(model, {"src": src, "mask": mask}).values()
            budget = min(cfg.max_len - 1, int(1.5 * src.shape[1]) + 10)
            tgt = model.generate(
                src,
                budget,
                src_mask=mask,
                num_beams=num_beams,
                length_penalty=length_penalty,
            )  # (B, 1 + T), BOS first, pad after EOS
            for i, row in zip(chunk, tgt.tolist(), strict=True):
                out[i] = tokenizer.decode(row[1:]).strip()
    finally:
        model.train(was_training)
    return out


class TranslationTask(ExampleTask):
    """Sentence-pair translation with a ``Transformer``; see the module docstring.

    ``pairs`` maps "train", "validation" (and optionally "test") to lists of
    ``(source text, target text)``; ``tokenizer`` (shared by both languages) encodes them.
    Metrics: ``loss`` (nats per target token, no smoothing), ``perplexity``, and per beam width
    k: ``bleu`` / ``chrf`` for greedy (k = 1), ``bleu_beam{k}`` / ``chrf_beam{k}`` otherwise;
    ``sentences`` counts the pairs decoded.
    """

    name = "translation"
    family = "encoder-decoder"

    def __init__(
        self,
        pairs: Mapping[str, Sequence[Pair]],
        tokenizer,
        max_len: int,
        *,
        seed: int = 0,
        length_penalty: float = 1.0,
    ) -> None:
        if "train" not in pairs or "validation" not in pairs:
            raise ValueError(
                f"TranslationTask: pairs must hold 'train' and 'validation', got {sorted(pairs)}"
            )
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"TranslationTask: max_len must be an int >= 2, got {max_len!r}")
        self.tokenizer, self.max_len, self.seed = tokenizer, max_len, seed
        self.length_penalty = length_penalty
        self.pad_id, self.bos_id = tokenizer.pad_id, tokenizer.bos_id
        self.texts: dict[str, list[Pair]] = {}
        self.ids: dict[str, list[tuple[list[int], list[int]]]] = {}
        self.dropped = 0
        for split, items in pairs.items():
            self.add_split(split, items)
        self.lengths = [max(len(s), len(t)) for s, t in self.ids["train"]]

    def add_split(self, split: str, pairs: Sequence[Pair]) -> None:
        """Encode ``pairs`` as ``split`` (e.g. an out-of-domain test set). Training pairs with
        a side longer than ``max_len`` tokens are left out; held-out ones are cut to it."""
        encoded, kept = [], []
        for source, target in pairs:
            src = self.tokenizer.encode(source, add_eos=True)
            tgt = self.tokenizer.encode(target, add_eos=True)
            if split == "train" and max(len(src), len(tgt)) > self.max_len:
                self.dropped += 1
                continue
            encoded.append((src[: self.max_len], tgt[: self.max_len]))
            kept.append((source, target))
        if not encoded:
            raise ValueError(f"TranslationTask: the {split} split has no pairs")
        self.texts[split], self.ids[split] = kept, encoded

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "max_len": self.max_len,
            "pairs": {split: len(ids) for split, ids in self.ids.items()},
            "train_pairs_too_long": self.dropped,
        }

    def _collate(self, indices: Sequence[int], split: str) -> Batch:
        chosen = [self.ids[split][i] for i in indices]
        src, src_mask = pad_batch([s for s, _ in chosen], self.pad_id)  # (B, S), (B, S)
        labels, tgt_mask = pad_batch([t for _, t in chosen], self.pad_id)  # (B, T), (B, T)
        return {
            "src_ids": src,
            "src_mask": src_mask,
            "tgt_ids": shift_right(labels, self.bos_id),  # (B, T): <bos> y_1 .. y_{T-1}
            "tgt_mask": tgt_mask,
            "labels": labels,  # (B, T): y_1 .. y_T, pad_id where there is no target
        }

    def batch_tokens(self, batch: Batch) -> int:
        return int((batch["labels"] != self.pad_id).sum())

    def loss(self, model: nn.Module, batch: Batch, *, smoothing: float = 0.0) -> tuple[Tensor, int]:
        labels = batch["labels"]
        count = int((labels != self.pad_id).sum())
        args = (batch["src_ids"], batch["tgt_ids"])
        if hasattr(model, "loss"):  # the plain model: output layer and loss in one pass
            loss = model.loss(
                *args,
                labels,
                batch["src_mask"],
                batch["tgt_mask"],
                ignore_index=self.pad_id,
                smoothing=smoothing,
            )
        else:  # a DistributedDataParallel wrapper: its forward must run (gradient sync)
            logits = model(*args, batch["src_mask"], batch["tgt_mask"])  # (B, T, V)
            loss = label_smoothed_cross_entropy(
                logits, labels, smoothing=smoothing, ignore_index=self.pad_id
            )
        return loss, count

    @torch.no_grad()
    def evaluate(
        self,
        model: nn.Module,
        split: str,
        *,
        batch_size: int,
        max_batches: int | None = None,
        beams: Sequence[int] = (1,),
        outputs: dict[str, list[str]] | None = None,
    ) -> dict[str, float]:
        """Loss, and BLEU / chrF for each beam width in ``beams``, on the first
        ``max_batches * batch_size`` pairs of a fixed random order (all when None).
        ``outputs``, if given, receives "source", "reference" and one list of translations
        per beam width ("greedy", "beam4", ...), in that order."""
        chosen = self.held_out(split, None if max_batches is None else max_batches * batch_size)
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        try:
            by_length = sorted(chosen, key=lambda i: len(self.ids[split][i][0]))
            for start in range(0, len(by_length), batch_size):
                batch = on_device(
                    model, self._collate(by_length[start : start + batch_size], split)
                )
                logits = model(
                    batch["src_ids"], batch["tgt_ids"], batch["src_mask"], batch["tgt_mask"]
                )
                total += float(
                    label_smoothed_cross_entropy(
                        logits, batch["labels"], ignore_index=self.pad_id, reduction="sum"
                    )
                )
                tokens += self.batch_tokens(batch)
        finally:
            model.train(was_training)
        loss = total / max(tokens, 1)
        result: dict[str, float] = {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        sources = [self.texts[split][i][0] for i in chosen]
        references = [self.texts[split][i][1] for i in chosen]
        if outputs is not None:
            outputs["source"], outputs["reference"] = sources, references
        for k in beams:
            hypotheses = translate(
                model,
                self.tokenizer,
                sources,
                num_beams=k,
                length_penalty=self.length_penalty,
                batch_size=batch_size,
                max_len=self.max_len,
            )
            suffix = "" if k == 1 else f"_beam{k}"
            scores = corpus_scores(hypotheses, references)
            result[f"bleu{suffix}"], result[f"chrf{suffix}"] = scores["bleu"], scores["chrf"]
            if outputs is not None:
                outputs["greedy" if k == 1 else f"beam{k}"] = hypotheses
        result["sentences"] = len(chosen)
        return result

    @torch.no_grad()
    def sample(self, model: nn.Module, tokenizer, *, prompt: str, max_new_tokens: int, seed: int):
        """``prompt`` (or the first validation source) and its greedy translation."""
        if tokenizer is None or max_new_tokens <= 0:
            return None
        source = prompt.strip() or self.texts["validation"][0][0]
        (translation,) = translate(model, tokenizer, [source], max_len=self.max_len)
        return f"{source}\n-> {translation}"


def read_decoding(directory: str | Path) -> dict[str, Any]:
    """A model directory's decoding settings: ``{"num_beams": k, "length_penalty": a, ...}``
    from its decoding.json (written by :func:`write_decoding`), else the defaults (4, 1.0)."""
    path = Path(directory) / DECODING_FILE
    if not path.is_file():
        return dict(DEFAULT_DECODING)
    settings = read_json(path)
    beams, penalty = settings.get("num_beams"), settings.get("length_penalty")
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"{path}: num_beams must be an int >= 1, got {beams!r}")
    if isinstance(penalty, bool) or not isinstance(penalty, int | float) or penalty < 0:
        raise ValueError(f"{path}: length_penalty must be a number >= 0, got {penalty!r}")
    return settings


def write_decoding(directory: str | Path, settings: dict[str, Any]) -> Path:
    """Record decoding settings (``num_beams``, ``length_penalty`` and how they were chosen) in
    ``directory/decoding.json``; ``translate`` and ``evaluate`` use them by default."""
    path = Path(directory) / DECODING_FILE
    atomic_write_text(path, json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    return path


def choose_length_penalty(
    model: nn.Module,
    task: TranslationTask,
    *,
    split: str = "validation",
    num_beams: int = 4,
    candidates: Sequence[float] = LENGTH_PENALTIES,
    batch_size: int = 64,
    progress=None,
) -> tuple[float, dict[float, dict[str, float]]]:
    """The length penalty (of ``candidates``) whose beam search scores the best corpus BLEU on
    ``split`` (never the test split: the choice is part of the model). Returns ``(best,
    {penalty: {"bleu": ..., "chrf": ...}})``; a tie goes to the penalty listed first.
    ``progress(penalty, scores)`` is called after each candidate."""
    if split == "test":
        raise ValueError("choose_length_penalty: split='test'; choose on validation data")
    if not candidates:
        raise ValueError("choose_length_penalty: no candidates")
    chosen = task.held_out(split)
    sources = [task.texts[split][i][0] for i in chosen]
    references = [task.texts[split][i][1] for i in chosen]
    scores: dict[float, dict[str, float]] = {}
    for penalty in candidates:
        hypotheses = translate(
            model,
            task.tokenizer,
            sources,
            num_beams=num_beams,
            length_penalty=penalty,
            batch_size=batch_size,
            max_len=task.max_len,
        )
        scores[penalty] = corpus_scores(hypotheses, references)
        if progress is not None:
            progress(penalty, scores[penalty])
    best = max(candidates, key=lambda penalty: scores[penalty]["bleu"])
    return best, scores


def write_translations(path: Path, outputs: dict[str, dict[str, list[str]]]) -> None:
    """One JSON line per evaluated pair: split, source, reference, greedy, beamK."""
    lines = []
    for split, columns in outputs.items():
        for i in range(len(columns["source"])):
            lines.append(json.dumps({"split": split, **{k: v[i] for k, v in columns.items()}}))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
