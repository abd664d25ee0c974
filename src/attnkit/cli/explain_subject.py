"""What every ``attnkit explain`` method shares: the model and its texts (Subject), --query,
--target, progress bars, the printed matrices and the pictures (--png, --svg)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli.common import UsageError, load_model, load_tokenizer


class Subject:
    """The model, its tokenizer (or the untrained preset's word vocabulary) and the texts."""

    def __init__(self, args: argparse.Namespace, default_family: str) -> None:
        from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer

        texts = [args.text] + [t for t in (args.target, args.corrupted) if t is not None]
        if not args.text.strip():
            raise UsageError("explain: TEXT is empty")
        if args.model:
            self.model = load_model(args.model, "--model", dequantize=True).eval()
            self.tokenizer = load_tokenizer(args.model, "--model")
            if self.tokenizer is None:
                raise UsageError(f"--model: {args.model} has no tokenizer")
            self.source = args.model
            self.vocab = None
        else:
            from attnkit.config import ModelConfig

            family = args.family or default_family
            words = [t.split() if " " in t.strip() else list(t.strip()) for t in texts]
            unique = dict.fromkeys(w for ws in words for w in ws)
            self.vocab = {w: i + 5 for i, w in enumerate(unique)}
            cfg = ModelConfig.preset(args.preset, vocab_size=max(512, len(self.vocab) + 5))
            torch.manual_seed(args.seed)
            build = {
                "encoder": EncoderModel,
                "decoder": DecoderLM,
                "classifier": lambda c: EncoderClassifier(c, num_classes=2),
                "encoder-decoder": Transformer,
            }[family]
            self.model = build(cfg).eval()
            self.tokenizer = None
            self.source = f"untrained preset {args.preset!r} ({family}, seed {args.seed})"
        self.kind = type(self.model).__name__
        self.ids, self.tokens = self.encode(args.text, "TEXT")

    def encode(self, text: str, what: str) -> tuple[torch.Tensor, list[str]]:
        if self.tokenizer is None:
            words = text.split() if " " in text.strip() else list(text.strip())
            ids = [self.vocab[w] for w in words]
            tokens = words
        else:
            if self.kind == "EncoderClassifier":  # [CLS] first, as the classifier was trained
                from attnkit.training.classification import encode_for_classifier

                ids = encode_for_classifier(self.tokenizer, text, self.model.cfg.max_len)
            else:
                ids = self.tokenizer.encode(text)
            tokens = [self._token(i) for i in ids]
        if not ids:
            raise UsageError(f"explain: {what} gives no tokens")
        return torch.tensor([ids]), tokens

    def _token(self, token_id: int) -> str:
        """A token as it reads: its text, or its name for a special token ([CLS])."""
        text = self.tokenizer.decode([token_id], skip_special=False)
        to_token = getattr(self.tokenizer, "id_to_token", None)
        return text if text or to_token is None else to_token(token_id)

    def token_id(self, text: str, option: str) -> int:
        """One vocabulary entry: as written, or as a word after a space (' animal')."""
        if self.tokenizer is None:
            if text not in self.vocab:
                raise UsageError(f"{option}: {text!r} is not a word of the texts given")
            return self.vocab[text]
        for form in (" " + text, text):
            ids = self.tokenizer.encode(form, add_special_tokens=False)
            if len(ids) == 1:
                return ids[0]
        raise UsageError(f"{option}: {text!r} is more than one token; give a single token")

    def describe(self, token_id: int) -> str:
        if self.tokenizer is None:
            words = {i: w for w, i in self.vocab.items()}
            return words.get(token_id, f"<{token_id}>")
        return self.tokenizer.decode([token_id], skip_special=False)


def query_position(tokens: list[str], text: str | None) -> int | None:
    """--query as a token (stripped of spaces), TOKEN#k for its k-th occurrence, or an index."""
    if text is None:
        return None
    stripped = [t.strip() for t in tokens]
    name, _, nth = text.rpartition("#")
    if text in stripped:
        return stripped.index(text)
    if name in stripped and nth.isdigit() and 1 <= int(nth) <= stripped.count(name):
        return [i for i, t in enumerate(stripped) if t == name][int(nth) - 1]
    if text.lstrip("-").isdigit() and -len(tokens) <= int(text) < len(tokens):
        return int(text) % len(tokens)
    raise UsageError(f"--query: {text!r} is not one of the tokens {stripped}")


def progress(label: str):
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=label, unit="run", leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def add_picture_options(parser: argparse.ArgumentParser, html: str | None = None) -> None:
    """--png and --svg, as draw() reads them, and --html (the report holding ``html``)."""
    parser.add_argument("--png", metavar="FILE", help="also draw the result as PNG")
    parser.add_argument("--svg", metavar="FILE", help="also draw the result as SVG (vector)")
    if html:
        parser.add_argument("--html", metavar="FILE", help=f"also write the offline report: {html}")


def check_outputs(args) -> None:
    """--png, --svg and --html name files of their kind: checked before any work is done."""
    for option, suffixes in (("png", (".png",)), ("svg", (".svg",)), ("html", (".html", ".htm"))):
        path = getattr(args, option, None)
        if path and Path(path).suffix.lower() not in suffixes:
            raise UsageError(f"--{option}: the file name must end in {suffixes[0]}, got {path!r}")


def draw(args, plot) -> None:
    """Draw with ``plot(path)`` to --png and --svg, as asked (the format follows the option)."""
    check_outputs(args)
    for option in ("png", "svg"):
        path = getattr(args, option, None)
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                written = plot(path)
                print(f"wrote {written}")
                if option == "png":
                    getattr(args, "drawn", []).append(written)
            except (OSError, ValueError) as error:
                raise UsageError(f"--{option}: cannot write {path}: {error}") from None


def matrix(rows: list[str], columns: list[str], values) -> str:
    width = max(6, *(len(c.strip()[:8]) for c in columns))
    head = " " * 12 + " ".join(f"{c.strip()[:8]:>{width}}" for c in columns)
    lines = [head]
    for name, row in zip(rows, values, strict=True):
        lines.append(f"{name.strip()[:11]:<12}" + " ".join(f"{v:>{width}.2f}" for v in row))
    return "\n".join(lines)


def target(subject: Subject, args) -> tuple[torch.Tensor, list[str]]:
    if args.target is None:
        raise UsageError("explain: an encoder-decoder model needs --target TEXT (its output)")
    ids, tokens = subject.encode(args.target, "--target")
    bos = subject.model.cfg.bos_id
    if bos is not None and int(ids[0, 0]) != bos:
        ids = torch.cat([torch.tensor([[bos]]), ids], dim=1)
        tokens = ["<bos>", *tokens]
    return ids, tokens
