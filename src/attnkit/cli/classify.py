"""``attnkit classify``: texts labelled by a trained classifier."""

from __future__ import annotations

import argparse

from attnkit.cli.common import add_device_option, to_device
from attnkit.cli.tasks import load_for_task


def register(commands) -> None:
    """``attnkit classify``: label texts with a trained classifier."""
    classify = commands.add_parser(
        "classify",
        help="label texts with a trained encoder classifier, with the label's probability",
        description=(
            "Classify each TEXT with an encoder-classifier checkpoint (e.g. the one "
            "'attnkit train examples/reviews-zh.toml' writes): prints the likeliest label, its "
            "probability and the text, one line per text. --all prints every label's "
            "probability."
        ),
        epilog=(
            "examples:\n"
            '  attnkit classify runs/reviews-zh/checkpoint "这家酒店服务很好"\n'
            '  attnkit classify runs/reviews-zh/checkpoint --all "电池不耐用" "物流很快"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    classify.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    classify.add_argument("texts", nargs="+", metavar="TEXT", help="a text to label")
    classify.add_argument("--all", action="store_true", help="every label's probability")
    add_device_option(classify, "classify")
    classify.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.training.classification import classify

    model, tokenizer = load_for_task(args.checkpoint, "encoder-classifier", "classify")
    to_device(model, args.device, args.checkpoint)
    labels = model.labels or [str(c) for c in range(model.classifier.out_features)]
    probs = classify(model, tokenizer, args.texts)  # (B, C)
    for text, row in zip(args.texts, probs.tolist(), strict=True):
        best = max(range(len(row)), key=row.__getitem__)
        if args.all:
            every = "  ".join(f"{name} {p:.3f}" for name, p in zip(labels, row, strict=True))
            print(f"{labels[best]}\t{every}\t{text}")
        else:
            print(f"{labels[best]}\t{row[best]:.3f}\t{text}")
