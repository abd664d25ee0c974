"""What the commands share: the one-line usage error, the parser that raises it, and loading a
model or a tokenizer with the problems reported as usage errors."""

from __future__ import annotations

import argparse

import torch

from attnkit.config import ModelConfig


class UsageError(Exception):
    """A problem with what the user typed: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2.

    ``routes`` names parsers of their own: when the first argument is one of these names, the
    rest goes to that parser (``attnkit explain circuits ...``), so that each one's --help lists
    only its own options; anything else is this parser's (``attnkit explain "今天 下雨"``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.routes: dict[str, argparse.ArgumentParser] = {}

    def route(self, name: str, **kwargs) -> Parser:
        """A parser for ``PROG NAME ...``, taking the arguments after NAME."""
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        self.routes[name] = Parser(prog=f"{self.prog} {name}", **kwargs)
        return self.routes[name]

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if args and args[0] in self.routes:
            return self.routes[args[0]].parse_known_args(args[1:], namespace)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def add_dequantize_option(parser: argparse.ArgumentParser) -> None:
    """``--dequantize``, for the commands that run a model without training it."""
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="turn every weight of a GGUF file or of a quantized model into float32 (by default "
        "the layers stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K or Q5_0 stay in their blocks, "
        "which decodes about 2.5x faster "
        "in a third of the memory, with the same greedy tokens; a GPU needs float32)",
    )


def add_exact_option(parser: argparse.ArgumentParser) -> None:
    """``--exact``, for the commands that decode with a model's packed weights."""
    parser.add_argument(
        "--exact",
        action="store_true",
        help="keep float32 activations in the products with packed weights (their float path), "
        "instead of rounding them to 8 bits for integer dot products (the integer path, the "
        "default: faster, and the same answers on every x86 CPU); ATTNKIT_INT8=0 does the same",
    )


def add_speculate_option(parser: argparse.ArgumentParser, draft: bool = False) -> None:
    """``--speculate K`` (and ``--draft MODEL``), for the commands that decode."""
    from attnkit.speculative import MAX_DRAFT

    parser.add_argument(
        "--speculate",
        type=int,
        metavar="K",
        help=f"speculative decoding: draft K tokens (1-{MAX_DRAFT}) from the context"
        + (" (or --draft)" if draft else "")
        + " and check them in one call of the model: the same greedy tokens, faster where the "
        "answer repeats its context (a summary, an edit, code)"
        + ("" if draft else "; greedy requests (temperature 0) only"),
    )
    if draft:
        parser.add_argument(
            "--draft",
            metavar="MODEL",
            help="with --speculate: a smaller model with the same tokenizer drafts the tokens",
        )


def speculative_from(args: argparse.Namespace, tokenizer=None):
    """The Speculative that ``--speculate`` (and ``--draft``) ask for, or None; the draft
    model must share the model's tokenizer."""
    from attnkit.speculative import Speculative

    draft_path = getattr(args, "draft", None)
    if args.speculate is None:
        if draft_path:
            raise UsageError("--draft drafts for --speculate K: give both")
        return None
    if getattr(args, "beam", 1) > 1:
        raise UsageError("--speculate cannot be combined with --beam (beam search)")
    draft = None
    if draft_path:
        theirs = load_tokenizer(draft_path, "--draft")
        if theirs is None or _vocabulary(theirs) != _vocabulary(tokenizer):
            raise UsageError(
                f"--draft: {draft_path}'s tokenizer is not the model's; a draft model must "
                "share its tokenizer"
            )
        draft = load_model(draft_path, "--draft")
    try:
        return Speculative(args.speculate, model=draft)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--speculate: {str(error).removeprefix('speculative: ')}") from None


def _vocabulary(tokenizer) -> dict | int:
    """A tokenizer's token -> id table (its size where it has none)."""
    inner = getattr(tokenizer, "hf", tokenizer)
    return inner.get_vocab() if hasattr(inner, "get_vocab") else tokenizer.vocab_size


def add_device_option(parser: argparse.ArgumentParser, work: str) -> None:
    """``--device``, for the commands that run a model without training it."""
    parser.add_argument(
        "--device",
        default="auto",
        type=device_name,
        metavar="DEVICE",
        help=f"where to {work}: auto (a GPU where torch sees one, else the CPU; the default), "
        "cpu, cuda or cuda:N. A model with quantized layers stays on the CPU",
    )


def device_name(text: str) -> str:
    """``--device``'s value, checked before any model is loaded."""
    import re

    from attnkit.training.config import DEVICES

    if not re.fullmatch(DEVICES, text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def to_device(model, device: str, path: str) -> torch.device:
    """Move ``model`` to ``--device`` and return where it is. Quantized (packed) layers run
    on the CPU: auto keeps such a model there, and a GPU named for it is refused."""
    from attnkit.serialization import packed_layout
    from attnkit.training.config import resolve_device

    packed = bool(packed_layout(model))
    try:
        asked = "cpu" if packed and device == "auto" else device
        chosen = resolve_device(asked, torch.device("cpu"), name="--device")
    except ValueError as error:
        raise UsageError(str(error)) from None
    if packed and chosen.type != "cpu":
        raise UsageError(
            f"--device={device!r}: {path} has quantized layers, which run on the CPU only; "
            "for a GPU load it as float32 (generate --dequantize, or "
            "from_pretrained(path, dequantize=True))"
        )
    model.to(chosen)
    return chosen


def device_description(device: torch.device) -> str:
    """A run's device as the commands' headers name it."""
    if device.type == "cuda":
        return f"on {device} ({torch.cuda.get_device_name(device)})"
    return f"{torch.get_num_threads()} CPU thread(s)"


def load_model(path: str, option: str, *, dequantize: bool | None = None):
    """from_pretrained, with a missing or unreadable path reported as a usage error."""
    from attnkit.interop import from_pretrained

    try:
        return from_pretrained(path, dequantize=dequantize)
    except (FileNotFoundError, ValueError, TypeError) as error:
        raise UsageError(f"{option}: {error}") from None


def load_tokenizer(path: str, option: str):
    """load_tokenizer_for, with an unreadable tokenizer reported as a usage error."""
    from attnkit.interop import load_tokenizer_for

    try:
        return load_tokenizer_for(path)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(f"{option}: {error}") from None


def tokenize_for(model_path: str | None, texts: list[str], preset: str, seed: int, family):
    """(model, [(ids, tokens) per text]): a saved model with its tokenizer, or an untrained
    preset of the given family whose vocabulary is the texts' words (or characters), its
    positions as many as the longest text's."""
    if model_path:
        model = load_model(model_path, "--model")
        tokenizer = load_tokenizer(model_path, "--model")
        if tokenizer is None:
            raise UsageError(f"--model: {model_path} has no tokenizer.json")
        out = []
        for text in texts:
            ids = tokenizer.encode(text)
            to_token = getattr(tokenizer, "id_to_token", None)
            out.append((ids, [to_token(i) if to_token else tokenizer.decode([i]) for i in ids]))
        return model, out
    # An untrained model: one token per space-separated word (per character without spaces).
    split = [t.split() if " " in t.strip() else list(t.strip()) for t in texts]
    vocab = {tok: i + 5 for i, tok in enumerate(dict.fromkeys(x for toks in split for x in toks))}
    try:
        longest = max(ModelConfig.preset(preset).max_len, *(len(toks) for toks in split))
        cfg = ModelConfig.preset(preset, vocab_size=max(512, len(vocab) + 5), max_len=longest)
    except ValueError as error:
        raise UsageError(f"--preset: {error}") from None
    torch.manual_seed(seed)
    model = family(cfg).eval()
    return model, [([vocab[x] for x in toks], toks) for toks in split]
