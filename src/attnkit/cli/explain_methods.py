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
from attnkit.cli.explain_subject import Subject, add_picture_options, check_outputs, target

METHODS = ("rollout", "flow", "lens", "heads", "patch", "attribute")

EXAMPLES = (
    '  attnkit explain rollout "The animal didn\'t cross the street because it was too tired." '
    "--model smollm2 --query it\n"
    '  attnkit explain flow "今天 下雨 我 没 带 伞" --query 伞\n'
    '  attnkit explain lens "The capital of France is" --model smollm2\n'
    "  attnkit explain heads \"The animal didn't cross the street because it was too tired. "
    'It was the" --model smollm2 --answer animal --versus street\n'
    '  attnkit explain patch "... because it was too tired. It was the" --corrupted '
    '"... because it was too wide. It was the" --model smollm2 --answer animal --versus street\n'
    '  attnkit explain attribute "这 家 酒店 很 好" --model runs/reviews-zh --svg runs/attr.svg'
)


# each method: what it does, and the options it takes beyond TEXT, --model, --preset, --seed,
# --family, --png, --svg and --html (every method's)
DESCRIPTIONS = {
    "rollout": "Follow the attention down through every layer to the input tokens: attention "
    "rollout (Abnar & Zuidema), the product of every layer's head-averaged weights with the "
    "residual counted, beside the top layer's raw weights.",
    "flow": "Attention flow (Abnar & Zuidema): the same layers as rollout, read as a graph "
    "whose edges carry the weights, and each input token's share of a position as a maximum "
    "flow (slower than rollout).",
    "lens": "The logit lens: a decoder's prediction of the next token read after every layer, "
    "through the final norm and the LM head.",
    "heads": "Ablate each head in turn (zero or its mean) and measure what the output loses: "
    "log p(answer), a logit difference with --versus, a class or a target's log-probability.",
    "patch": "Activation patching: run --corrupted, copy one activation from TEXT's run into "
    "it at a time (a layer's residual stream at a position, or a head), and measure how much "
    "of the clean output comes back.",
    "attribute": "Score each input token by the gradient of the output measured with respect "
    "to its embedding: integrated gradients or input x gradient (Captum).",
}
OWN = {
    "rollout": ("query", "target", "stack"),
    "flow": ("query", "target", "stack"),
    "lens": ("query", "answer"),
    "heads": ("answer", "versus", "label", "mode", "target", "stack"),
    "patch": ("corrupted", "answer", "versus", "label", "target", "stack"),
    "attribute": ("answer", "versus", "label", "method", "steps", "target", "stack"),
}
_DECODER = "decoder: the next token whose log-probability is measured"
OPTIONS = {  # name: the option's argparse keywords
    "query": dict(metavar="TOKEN", help="the position to read (a token, TOKEN#k for its k-th "
                  "occurrence, or an index; lens: default the last)"),
    "target": dict(metavar="TEXT", help="an encoder-decoder's output text"),
    "stack": dict(choices=["encoder", "decoder"], help="encoder-decoder: which stack (default: "
                  "the decoder; for rollout and flow, the encoder)"),
    "corrupted": dict(metavar="TEXT", help="the corrupted text (as many tokens as TEXT; e.g. "
                      "'too wide' for 'too tired')"),
    "answer": dict(metavar="TOKEN", help=_DECODER + " (default: the top prediction after TEXT)"),
    "versus": dict(metavar="TOKEN", help="decoder: measure log p(answer) - log p(TOKEN) "
                   "instead (a logit difference)"),
    "label": dict(type=int, help="classifier: the class measured (default: the predicted one)"),
    "mode": dict(choices=["zero", "mean"], default="zero", help="the ablation (zero)"),
    "method": dict(choices=["integrated_gradients", "input_x_gradient"],
                   default="integrated_gradients", help="the gradient method (default "
                   "integrated_gradients)"),
    "steps": dict(type=int, default=50, help="integrated gradients' steps (50)"),
}  # fmt: skip


def register(explain) -> None:
    """A parser per method, each with the options it reads (and the others' set to None, so
    the shared code finds them unset)."""
    for method in METHODS:
        parser = explain.route(
            method,
            description=DESCRIPTIONS[method],
            epilog="examples:\n"
            + "\n".join(line for line in EXAMPLES.splitlines() if f"explain {method} " in line),
        )
        parser.add_argument("text", metavar="TEXT", help="the text")
        parser.add_argument("--model", metavar="PATH", help="a model directory or .gguf file")
        parser.add_argument(
            "--preset", default="tiny", help="without --model: an untrained preset (tiny)"
        )
        parser.add_argument(
            "--seed", type=int, default=0, help="without --model: the weights' seed (0)"
        )
        parser.add_argument(
            "--family",
            choices=["encoder", "decoder", "classifier", "encoder-decoder"],
            help="without --model: the untrained family to build (default "
            + ("encoder" if method in ("rollout", "flow") else "decoder")
            + ")",
        )
        for name in OWN[method]:
            parser.add_argument(f"--{name}", **OPTIONS[name])
        add_picture_options(
            parser,
            "the printed tables, the pictures (a PNG beside the report unless --png), every "
            "layer and head of the text's attention and its rollout",
        )
        parser.set_defaults(
            handler=run_method, topic=method, **{n: None for n in OPTIONS if n not in OWN[method]}
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
    args.drawn = []
    check_outputs(args)
    if args.html and not args.png:
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
