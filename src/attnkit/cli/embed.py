"""``attnkit embed``: sentence embeddings and their similarities."""

from __future__ import annotations

import argparse

import attnkit
from attnkit.cli._common import UsageError, _load_model, _load_tokenizer, _to_device
from attnkit.tables import format_table

# --------------------------------------------------------------------------------------------
# attnkit embed
# --------------------------------------------------------------------------------------------


def _cmd_embed(args: argparse.Namespace) -> None:
    from attnkit.interop.embeddings import (
        cosine_similarities,
        max_seq_length,
        sentence_embeddings,
    )

    if not args.sentences:
        raise UsageError("embed: give one or more sentences to embed (see --help)")
    if args.max_length is not None and args.max_length < 3:
        raise UsageError(f"--max-length: must be at least 3, got {args.max_length}")
    model = _load_model(args.model, "--model")
    if getattr(model, "family", None) != "encoder-only" and not isinstance(
        model, attnkit.EncoderClassifier
    ):
        raise UsageError(
            f"--model: {args.model} holds a {type(model).__name__}; embed needs an encoder "
            "(a BERT-style model such as all-MiniLM-L6-v2)"
        )
    _to_device(model, args.device, args.model)
    tokenizer = _load_tokenizer(args.model, "--model")
    if tokenizer is None:
        raise UsageError(f"--model: {args.model} has no tokenizer.json to turn text into ids")
    limit = args.max_length or max_seq_length(args.model)
    prefix = args.prefix
    if prefix is None:  # e5 was trained with "query: " / "passage: " in front of every text
        prefix = "query: " if model.cfg.extra.get("source") == "e5" else ""
    texts = [prefix + sentence for sentence in args.sentences]
    try:
        embeddings = sentence_embeddings(model, tokenizer, texts, max_length=limit)
    except ValueError as error:
        raise UsageError(f"embed: {error}") from None
    similarity = cosine_similarities(embeddings.cpu())
    names = [str(i + 1) for i in range(len(args.sentences))]
    print(
        f"{len(args.sentences)} sentence(s), {embeddings.shape[1]}-dimensional embeddings "
        "(mean over the real tokens, L2-normalised)"
        + (f", each read as {prefix!r} + sentence" if prefix else "")
        + "\n"
    )
    for name, sentence in zip(names, args.sentences, strict=True):
        print(f"{name:>{len(names[-1])}}  {sentence}")
    print("\ncosine similarity\n")
    rows = [
        [n, *(f"{v:.4f}" for v in row)] for n, row in zip(names, similarity.tolist(), strict=True)
    ]
    print(format_table(["", *names], rows))
