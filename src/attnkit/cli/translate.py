"""``attnkit translate``: sentences through a trained translator."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli.common import UsageError, add_device_option, to_device
from attnkit.cli.tasks import decoding_settings, load_for_task


def register(commands) -> None:
    """``attnkit translate``: translate sentences with a trained translator."""
    translate = commands.add_parser(
        "translate",
        help="translate sentences with a trained encoder-decoder (beam search by default)",
        description=(
            "Translate each SENTENCE with an encoder-decoder checkpoint (e.g. the one "
            "'attnkit train examples/de-en.toml' writes): beam search with --beam beams "
            "(default 4), or --greedy, with the length penalty that 'attnkit "
            "tune-length-penalty' recorded in the model directory (else 1.0). One translation "
            "per line, in order. A sentence longer than the model's context is cut to it "
            "(with a note on stderr)."
        ),
        epilog=(
            "examples:\n"
            '  attnkit translate runs/de-en/averaged "Wählen Sie Format - Zeichen."\n'
            '  attnkit translate runs/zh-en/averaged "今天下雨，我没带伞。"\n'
            '  attnkit translate runs/de-en/checkpoint --greedy "Klicken Sie auf OK." "Gute Nacht!"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    translate.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    translate.add_argument(
        "sentences", nargs="+", metavar="SENTENCE", help="text in the source language"
    )
    translate.add_argument(
        "--beam",
        type=int,
        default=None,
        metavar="N",
        help="beams (default: the model's decoding.json, else 4)",
    )
    translate.add_argument("--greedy", action="store_true", help="greedy decoding (= --beam 1)")
    translate.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="A",
        help="beam hypotheses ranked by score / length**A (default: the model's decoding.json, "
        "else 1.0)",
    )
    add_device_option(translate, "translate")
    translate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    import sys

    from attnkit.training.translation import translate

    if args.beam is not None and args.beam < 1:
        raise UsageError(f"--beam: must be a positive integer, got {args.beam}")
    if args.length_penalty is not None and args.length_penalty < 0:
        raise UsageError(f"--length-penalty: must be >= 0, got {args.length_penalty}")
    for number, sentence in enumerate(args.sentences, start=1):
        if not sentence.strip():
            raise UsageError(f"SENTENCE {number}: empty; give the text to translate")
    model, tokenizer = load_for_task(args.checkpoint, "encoder-decoder", "translate")
    to_device(model, args.device, args.checkpoint)
    decoding = decoding_settings(
        Path(args.checkpoint), 1 if args.greedy else args.beam, args.length_penalty
    )
    limit = model.cfg.max_len
    for number, sentence in enumerate(args.sentences, start=1):
        length = len(tokenizer.encode(sentence, add_eos=True))
        if length > limit:
            print(
                f"note: SENTENCE {number} is {length} tokens; only its first {limit} (the "
                "model's context) are translated",
                file=sys.stderr,
            )
    for line in translate(
        model,
        tokenizer,
        args.sentences,
        num_beams=decoding["num_beams"],
        length_penalty=decoding["length_penalty"],
    ):
        print(line)
