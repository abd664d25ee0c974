"""The ``attnkit`` command.

Usage errors (a bad option, a malformed value) print one line naming the option and exit with
status 2; other failures print one line and exit with status 1. Set ``ATTNKIT_DEBUG=1`` to see
the traceback of a failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import unicodedata
from collections.abc import Sequence

import torch

import attnkit
from attnkit.attention import causal_mask, scaled_dot_product_attention
from attnkit.config import PRESETS, ModelConfig
from attnkit.models import DecoderLM, EncoderModel, Transformer


class UsageError(Exception):
    """A problem with what the user typed: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------------------------
# Plain-text tables that line up with Chinese characters (two columns wide on a terminal)
# --------------------------------------------------------------------------------------------


def _width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cell(text: str, width: int, align: str = "right") -> str:
    pad = " " * max(0, width - _width(text))
    return pad + text if align == "right" else text + pad


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table with the first column left-aligned and the others right-aligned."""
    columns = list(zip(header, *rows, strict=True))
    widths = [max(_width(c) for c in column) for column in columns]
    lines = []
    for row in [header, *rows]:
        cells = [
            _cell(c, w, "left" if i == 0 else "right")
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# attnkit explain
# --------------------------------------------------------------------------------------------


def _parse_scores(text: str) -> list[float]:
    try:
        scores = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--scores: expected comma-separated numbers such as 0.1,0.3,1.2, got {text!r}"
        ) from None
    if not all(math.isfinite(s) for s in scores):
        raise UsageError(f"--scores: every score must be a finite number, got {text!r}")
    return scores


def _parse_tokens(text: str | None, count: int, option: str) -> list[str]:
    if text is None:
        return [f"t{i}" for i in range(count)]
    tokens = [t.strip() for t in text.split(",")]
    if len(tokens) != count:
        raise UsageError(f"--tokens: got {len(tokens)} tokens for {count} {option}")
    return tokens


def explain_softmax(scores: list[float], tokens: list[str], d_k: int | None = None) -> str:
    """The softmax of one row of scores as a table: score, (scaled), exp, weight, and the sum.

    The weights come from attnkit's own attention (the math path): one query q = [1] against
    keys k_j = [s_j] with scale 1 makes the scores exactly s_j (or s_j / sqrt(d_k)).
    """
    scale = 1.0 if d_k is None else 1.0 / math.sqrt(d_k)
    q = torch.ones(1, 1, dtype=torch.float64)  # (N=1, d=1)
    k = torch.tensor(scores, dtype=torch.float64).unsqueeze(1)  # (M, 1)
    v = torch.eye(len(scores), dtype=torch.float64)  # (M, M): out = the weights themselves
    _, weights = scaled_dot_product_attention(q, k, v, scale=scale, return_weights=True)
    scaled = [s * scale for s in scores]
    exps = [math.exp(s) for s in scaled]
    header = ["token", "score"] + ([f"score/sqrt({d_k})"] if d_k else []) + ["exp", "weight"]
    rows = []
    for token, s, sc, e, w in zip(tokens, scores, scaled, exps, weights[0].tolist(), strict=True):
        rows.append([token, f"{s:.4f}"] + ([f"{sc:.4f}"] if d_k else []) + [f"{e:.4f}", f"{w:.4f}"])
    rows.append(
        ["sum", ""] + ([""] if d_k else []) + [f"{sum(exps):.4f}", f"{sum(weights[0]):.4f}"]
    )
    formula = "weight_j = exp(s_j) / sum_i exp(s_i)"
    if d_k:
        formula = f"s_j = score_j / sqrt(d_k), d_k = {d_k};  " + formula
    return f"softmax over {len(scores)} scores ({formula})\n\n" + format_table(header, rows)


def explain_causal(n: int, tokens: list[str]) -> str:
    """The causal mask of size n, as it is added to the scores: 0 = may attend, -inf = blocked."""
    mask = causal_mask(n)
    header = ["query \\ key", *tokens]
    rows = [
        [tokens[i], *("0" if allowed else "-inf" for allowed in mask[i].tolist())] for i in range(n)
    ]
    title = (
        f"causal mask, {n} x {n}: query i may attend to keys j <= i "
        "(0 is added to allowed scores, -inf to blocked ones, so softmax gives them weight 0)"
    )
    return title + "\n\n" + format_table(header, rows)


def _explain_scaling(args: argparse.Namespace) -> None:
    from attnkit.explain import format_scaling_table, plot_scaling, scaling_experiment

    rows = scaling_experiment(seed=args.seed)
    print(format_scaling_table(rows))
    if args.png:
        try:
            path = plot_scaling(rows, args.png)
        except OSError as error:
            raise UsageError(f"--png: cannot write {args.png}: {error.strerror}") from None
        print(f"\nwrote {path}")


def _cmd_explain(args: argparse.Namespace) -> None:
    if args.topic is not None:
        if args.topic != "scaling":
            raise UsageError(
                f"explain: unknown topic {args.topic!r}; the topics are: scaling "
                "(or use --scores / --causal)"
            )
        _explain_scaling(args)
        return
    if args.png:
        raise UsageError("--png goes with 'attnkit explain scaling'")
    if args.scores is None and args.causal is None:
        raise UsageError(
            "explain: give --scores S1,S2,..., --causal N or a topic such as 'scaling' "
            "(see 'attnkit explain --help')"
        )
    parts = []
    if args.scores is not None:
        scores = _parse_scores(args.scores)
        if args.d_k is not None and args.d_k <= 0:
            raise UsageError(f"--d-k: must be a positive integer, got {args.d_k}")
        tokens = _parse_tokens(args.tokens, len(scores), "scores")
        parts.append(explain_softmax(scores, tokens, args.d_k))
    if args.causal is not None:
        if not 1 <= args.causal <= 64:
            raise UsageError(f"--causal: the size must be between 1 and 64, got {args.causal}")
        tokens = _parse_tokens(
            args.tokens if args.scores is None else None, args.causal, "positions"
        )
        parts.append(explain_causal(args.causal, tokens))
    print("\n\n".join(parts))


# --------------------------------------------------------------------------------------------
# attnkit models
# --------------------------------------------------------------------------------------------

FAMILY_CLASSES = {
    "encoder-only": EncoderModel,
    "encoder-decoder": Transformer,
    "decoder-only": DecoderLM,
    "any": DecoderLM,  # "tiny" serves every family; counted as a decoder-only model
}


def preset_parameters(name: str) -> int:
    """Parameters of a preset's model, counted on the meta device (no memory, no time)."""
    cfg = ModelConfig.preset(name)
    with torch.device("meta"):
        model = FAMILY_CLASSES[PRESETS[name]["family"]](cfg)
    return model.num_parameters()


def models_table() -> str:
    header = ["preset", "family", "layers", "d_model", "heads", "d_ff", "vocab", "parameters"]
    rows = []
    for name, spec in PRESETS.items():
        cfg = ModelConfig.preset(name)
        family = spec["family"]
        layers = f"{cfg.n_layers}+{cfg.n_layers}" if family == "encoder-decoder" else cfg.n_layers
        rows.append(
            [
                name,
                "decoder-only*" if family == "any" else family,
                str(layers),
                str(cfg.d_model),
                str(cfg.n_heads),
                str(cfg.d_ff),
                str(cfg.vocab_size),
                f"{preset_parameters(name):,}",
            ]
        )
    note = (
        "\nparameters count each tied matrix once; bert-base is without the pooler "
        "(with it: ModelConfig.preset('bert-base', pooler=True)); * tiny serves every family"
    )
    return format_table(header, rows) + note


def _cmd_models(args: argparse.Namespace) -> None:
    print(models_table())


# --------------------------------------------------------------------------------------------
# attnkit generate
# --------------------------------------------------------------------------------------------


def _load_model(path: str, option: str):
    """from_pretrained, with a missing or unreadable path reported as a usage error."""
    from attnkit.interop import from_pretrained

    try:
        return from_pretrained(path)
    except (FileNotFoundError, ValueError, TypeError) as error:
        raise UsageError(f"{option}: {error}") from None


def _cmd_generate(args: argparse.Namespace) -> None:
    from attnkit.interop import load_tokenizer_for

    positional = list(args.args)
    path = args.checkpoint or args.model
    option = "--checkpoint" if args.checkpoint else "--model" if args.model else "CHECKPOINT"
    if path is None:
        if not positional:
            raise UsageError("generate: give a model directory and a prompt (see --help)")
        path = positional.pop(0)
    if len(positional) != 1:
        raise UsageError(f"generate: expected one prompt, got {len(positional)} arguments")
    prompt = positional[0]
    model = _load_model(path, option)
    if getattr(model, "family", None) != "decoder-only":
        raise UsageError(
            f"{option}: {path} holds a {type(model).__name__}; generate needs a decoder-only "
            "language model"
        )
    tokenizer = load_tokenizer_for(path)
    if tokenizer is None:
        raise UsageError(f"{option}: {path} has no tokenizer.json to turn the prompt into ids")
    ids = tokenizer.encode(prompt)
    if not ids:
        if model.cfg.bos_id is None:
            raise UsageError("generate: the prompt is empty and the model has no BOS token")
        ids = [model.cfg.bos_id]
    prompt_ids = torch.tensor([ids])
    new_ids: list[int] = []
    shown = ""

    def stream(tokens):
        nonlocal shown
        if not new_ids:
            print(prompt, end="", flush=True)
        new_ids.append(int(tokens[0]))
        text = tokenizer.decode(new_ids)
        print(text[len(shown) :], end="", flush=True)
        shown = text

    try:
        out = model.generate(
            prompt_ids,
            args.max_new_tokens,
            do_sample=not args.greedy and args.beam == 1,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_beams=args.beam,
            seed=args.seed,
            on_token=stream if args.beam == 1 else None,
        )
    except ValueError as error:
        raise UsageError(f"generate: {error}") from None
    if args.beam > 1:
        print(prompt + tokenizer.decode(out[0, len(ids) :].tolist()), end="")
    print()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit",
        description="attnkit: the Transformer, whole and open to inspection.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    explain = commands.add_parser(
        "explain",
        help="show the numbers inside attention: a softmax table, a causal mask",
        description=(
            "Show the numbers inside attention. --scores prints the softmax of one row of "
            "attention scores (score, exp, weight; the weights sum to 1). --causal N prints the "
            "look-ahead mask of size N as it is added to the scores. 'attnkit explain scaling' "
            "measures why the scores are divided by sqrt(d_k): Var[q.k] = d_k for unit-variance "
            "q and k, and what the softmax does with and without the scaling."
        ),
        epilog=(
            "examples:\n"
            "  attnkit explain --scores 0.1,0.3,0.2,0.5,0.1,1.2 --tokens 今天,下雨,我,没,带,伞\n"
            "  attnkit explain --scores 2,8,4 --d-k 16\n"
            "  attnkit explain --causal 4\n"
            "  attnkit explain scaling --png runs/scaling.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument("topic", nargs="?", help="a topic to explain: scaling")
    explain.add_argument("--scores", metavar="S1,S2,...", help="one query's scores over the keys")
    explain.add_argument("--tokens", metavar="T1,T2,...", help="labels for the keys, one each")
    explain.add_argument(
        "--d-k", type=int, metavar="D", help="treat the scores as raw q.k and divide by sqrt(D)"
    )
    explain.add_argument("--causal", type=int, metavar="N", help="print the causal mask of size N")
    explain.add_argument("--png", metavar="FILE", help="with 'scaling': also draw the plot here")
    explain.add_argument("--seed", type=int, default=0, help="with 'scaling': the random seed")
    explain.set_defaults(handler=_cmd_explain)

    models = commands.add_parser(
        "models",
        help="list the model presets with their sizes and parameter counts",
        description="List the named ModelConfig presets: family, sizes and parameter count.",
    )
    models.set_defaults(handler=_cmd_models)

    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a decoder-only model, streaming the tokens",
        description=(
            "Continue a prompt with a decoder-only language model, printing each token as it "
            "is made. The model is a directory that attnkit wrote (a training checkpoint or "
            "model.save_pretrained) with its tokenizer.json. Sampling by default; --greedy or "
            "--beam N for deterministic decoding."
        ),
        epilog=(
            "examples:\n"
            "  attnkit generate runs/shakespeare-char/checkpoint 'ROMEO:'\n"
            "  attnkit generate --checkpoint DIR 'To be' --greedy --max-new-tokens 50"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("args", nargs="*", metavar="[CHECKPOINT] PROMPT")
    generate.add_argument("--checkpoint", metavar="DIR", help="the model directory")
    generate.add_argument(
        "--model", metavar="PATH", help="the model directory (same as --checkpoint)"
    )
    generate.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=None, metavar="K")
    generate.add_argument("--top-p", type=float, default=None, metavar="P")
    generate.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    generate.add_argument("--beam", type=int, default=1, metavar="N", help="beam search, N beams")
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    generate.set_defaults(handler=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        args.handler(args)
        return 0
    except UsageError as error:
        print(f"attnkit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # one line, no traceback, unless asked for
        if os.environ.get("ATTNKIT_DEBUG"):
            raise
        print(f"attnkit: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
