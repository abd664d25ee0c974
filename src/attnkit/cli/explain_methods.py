"""``attnkit explain rollout|flow|lens|heads|patch|attribute TEXT``: the views beyond the
heatmap, on any model: the options, the --html report, and the choice of method. The methods
are in explain_reading.py and explain_interventions.py, their shared parts in
explain_subject.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli import explain_interventions, explain_reading
from attnkit.cli.common import UsageError
from attnkit.cli.explain_subject import Subject, target

METHODS = ("rollout", "flow", "lens", "heads", "patch", "attribute")

EXAMPLES = (
    '  attnkit explain rollout "The animal didn\'t cross the street because it was too tired." '
    "--model smollm2 --query it\n"
    '  attnkit explain lens "The capital of France is" --model smollm2\n'
    "  attnkit explain heads \"The animal didn't cross the street because it was too tired. "
    'It was the" --model smollm2 --answer animal --versus street\n'
    '  attnkit explain patch "... because it was too tired. It was the" --corrupted '
    '"... because it was too wide. It was the" --model smollm2 --answer animal --versus street\n'
    '  attnkit explain attribute "这 家 酒店 很 好" --model runs/reviews-zh --svg runs/attr.svg'
)


def add_arguments(explain: argparse.ArgumentParser) -> None:
    """The options of the methods (the rest of ``attnkit explain`` is in explain.py)."""
    group = explain.add_argument_group(
        "with a method (rollout, flow, lens, heads, patch, attribute) and TEXT"
    )
    group.add_argument(
        "--family",
        choices=["encoder", "decoder", "classifier", "encoder-decoder"],
        help="without --model: the untrained family to build (default: decoder for lens, heads, "
        "patch and attribute; encoder for rollout and flow)",
    )
    group.add_argument("--target", metavar="TEXT", help="an encoder-decoder's output text")
    group.add_argument(
        "--corrupted",
        metavar="TEXT",
        help="patch: the corrupted text (as many tokens as TEXT; e.g. 'too wide' for 'too tired')",
    )
    group.add_argument(
        "--answer",
        metavar="TOKEN",
        help="decoder: the next token whose log-probability is measured (default: the top "
        "prediction after TEXT)",
    )
    group.add_argument(
        "--versus",
        metavar="TOKEN",
        help="decoder: measure log p(answer) - log p(TOKEN) instead (a logit difference)",
    )
    group.add_argument(
        "--label", type=int, help="classifier: the class measured (default: the predicted one)"
    )
    group.add_argument(
        "--mode", choices=["zero", "mean"], default="zero", help="heads: the ablation (zero)"
    )
    group.add_argument(
        "--method",
        choices=["integrated_gradients", "input_x_gradient"],
        default="integrated_gradients",
        help="attribute: the gradient method (default integrated_gradients)",
    )
    group.add_argument(
        "--steps", type=int, default=50, help="attribute: integrated gradients' steps (50)"
    )
    group.add_argument(
        "--stack",
        choices=["encoder", "decoder"],
        help="encoder-decoder: which stack (default: encoder for rollout and flow, else decoder)",
    )
    group.add_argument("--svg", metavar="FILE", help="also draw the result as SVG (vector)")
    group.add_argument(
        "--html",
        metavar="FILE",
        help="also write the offline report: the printed tables, the pictures (a PNG beside "
        "the report unless --png), every layer and head of the text's attention and its rollout",
    )


def _report(args, printed: str) -> None:
    """--html: the method's output, its pictures and the text's attention, in one page."""
    from attnkit.explain import attention_sections, render_attention_html
    from attnkit.explain.report import rollout_sections

    subject = Subject(args, "decoder" if args.topic not in ("rollout", "flow") else "encoder")
    with torch.no_grad():
        if subject.kind == "Transformer":
            tgt, tgt_tokens = target(subject, args)
            _, attentions = subject.model(subject.ids, tgt, return_attention=True)
            where = {"src_tokens": subject.tokens, "tgt_tokens": tgt_tokens}
        else:
            _, attentions = subject.model(subject.ids, return_attention=True)
            where = {"tokens": subject.tokens}
    sections = attention_sections(attentions, **where) + rollout_sections(attentions, **where)
    try:
        path = render_attention_html(
            sections,
            args.html,
            title=f"attnkit explain {args.topic}",
            images=args.drawn,
            notes=[f"Model: {subject.source}", f"Text: {args.text}"]
            + ([f"Corrupted: {args.corrupted}"] if args.corrupted else [])
            + ([f"Target: {args.target}"] if args.target else []),
            texts=[printed],
        )
    except (OSError, ValueError) as error:
        raise UsageError(f"--html: cannot write {args.html}: {error}") from None
    print(f"wrote {path}")


def run_method(args: argparse.Namespace) -> None:
    if args.text is None:
        raise UsageError(f"explain {args.topic}: give TEXT, e.g. {EXAMPLES.splitlines()[0]}")
    args.drawn = []
    if args.html and not args.png:
        if Path(args.html).suffix.lower() not in (".html", ".htm"):
            raise UsageError(f"--html: the file name must end in .html, got {args.html!r}")
        args.png = str(Path(args.html).with_suffix(".png"))
    handler = {
        "rollout": explain_reading.rollout,
        "flow": explain_reading.rollout,
        "lens": explain_reading.lens,
        "heads": explain_interventions.heads,
        "patch": explain_interventions.patch,
        "attribute": explain_interventions.attribute,
    }[args.topic]
    if not args.html:
        handler(args)
        return
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        handler(args)
    print(buffer.getvalue(), end="")
    _report(args, "\n".join(line for line in buffer.getvalue().splitlines()
                            if not line.startswith("wrote ")))  # fmt: skip
