"""``attnkit explain``: the worked examples of the notes, step by step."""

from __future__ import annotations

import argparse
import math

import torch

from attnkit.cli import explain_methods
from attnkit.cli.common import UsageError, tokenize_for
from attnkit.cli.explain_subject import add_picture_options, check_outputs, draw, query_position
from attnkit.models import DecoderLM, EncoderModel

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


def _explain_scaling(args: argparse.Namespace) -> None:
    from attnkit.explain import format_scaling_table, plot_scaling, scaling_experiment

    check_outputs(args)
    rows = scaling_experiment(seed=args.seed)
    print(format_scaling_table(rows))
    draw(args, lambda path: plot_scaling(rows, path))


def _explain_complexity(args: argparse.Namespace) -> None:
    from attnkit.explain.complexity import (
        fit_slopes,
        format_complexity_table,
        measure_complexity,
        plot_complexity,
    )

    check_outputs(args)
    if not args.budget > 0:
        raise UsageError(f"--budget: must be > 0 seconds, got {args.budget}")
    print(f"measuring math, fused, window and linear attention ({args.budget:g} s each)...")
    rows = measure_complexity(
        budget_s=args.budget,
        threads=args.threads,
        progress=lambda r: print(
            f"  {r.variant:<7} N={r.n:<6} {r.backward_ms:9.1f} ms", flush=True
        ),
    )
    print()
    print(format_complexity_table(rows, fit_slopes(rows), threads=args.threads))
    draw(args, lambda path: plot_complexity(rows, path))


def _explain_text(args: argparse.Namespace) -> None:
    """One head's attention over a sentence, every number shown (explain.trace)."""
    from attnkit.explain.trace import format_trace, trace_attention

    if args.dims < 1:
        raise UsageError(f"--dims: must be a positive integer, got {args.dims}")
    family = DecoderLM if args.causal is not None else EncoderModel
    model, [(ids, tokens)] = tokenize_for(args.model, [args.text], args.preset, args.seed, family)
    if not ids:
        raise UsageError("explain: the text gives no tokens")
    query = query_position(tokens, args.query)
    try:
        trace = trace_attention(
            model, torch.tensor([ids]), layer=args.layer, head=args.head, tokens=tokens
        )
    except (ValueError, TypeError) as error:
        raise UsageError(f"explain: {error}") from None
    source = args.model or f"preset {args.preset!r}, untrained, seed {args.seed}"
    print(f"model: {source}\n")
    print(format_trace(trace, dims=args.dims, query=query))


def _register_topics(explain) -> None:
    """``attnkit explain scaling`` and ``complexity``: measurements, not a model's numbers."""
    scaling = explain.route(
        "scaling",
        description="Why attention divides the scores by sqrt(d_k): Var[q.k] = d_k for "
        "unit-variance q and k (measured for several d_k), and what the softmax does to the "
        "scores with and without the scaling.",
        epilog="example:\n  attnkit explain scaling --png runs/scaling.png",
    )
    scaling.add_argument("--seed", type=int, default=0, help="the random seed (default 0)")
    add_picture_options(scaling)
    scaling.set_defaults(handler=_explain_scaling)
    complexity = explain.route(
        "complexity",
        description="Time attention (math, fused, sliding-window, linear) forward and backward "
        "as the length N grows, and fit the exponent of N: about 2 for full attention, 1 for "
        "the window and linear ones.",
        epilog="example:\n  attnkit explain complexity --budget 20 --png runs/complexity.png",
    )
    complexity.add_argument(
        "--budget", type=float, default=60.0, help="seconds per variant (default 60)"
    )
    complexity.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads while timing (default 1: steadier when busy)",
    )
    add_picture_options(complexity)
    complexity.set_defaults(handler=_explain_complexity)


def register(commands) -> None:
    """``attnkit explain``: the numbers inside attention; each method a parser of its own."""
    from attnkit.cli import explain_circuits

    explain = commands.add_parser(
        "explain",
        help="show the numbers inside attention: a softmax table, a causal mask, head scores",
        usage="attnkit explain [TEXT] [options]\n       attnkit explain METHOD ... "
        "(attnkit explain METHOD --help)",
        description=(
            "Show the numbers inside attention. With a TEXT, trace one head of a model over "
            "it: Q, K, V, the scores, their scaling by sqrt(d_k), the mask, the softmax weights "
            "and the output (a small untrained model unless --model is given). --scores prints "
            "the softmax of one row of attention scores (score, exp, weight; the weights sum to "
            "1). --causal N prints the look-ahead mask of size N as it is added to the scores."
            "\n\nMethods, each with options of its own (attnkit explain METHOD --help):\n"
            "  scaling     why the scores are divided by sqrt(d_k)\n"
            "  complexity  attention's time as N grows, and the exponent of N\n"
            "  circuits    every head scored: previous-token, duplicate-token, induction, "
            "copying,\n              composition; or a training run's heads as they formed\n"
            "  rollout     attention followed down through every layer (Abnar & Zuidema)\n"
            "  flow        the same as a maximum flow\n"
            "  lens        a decoder's prediction read after every layer (the logit lens)\n"
            "  heads       each head ablated: what the output loses\n"
            "  patch       activations copied from TEXT into --corrupted: what comes back\n"
            "  attribute   each input token scored by its gradients (Captum)"
        ),
        epilog=(
            "examples:\n"
            '  attnkit explain "今天 下雨 我 没 带 伞" --query 没\n'
            '  attnkit explain "我 用 毒 毒 毒 蛇" --causal --head 1\n'
            "  attnkit explain --scores 0.1,0.3,0.2,0.5,0.1,1.2 --tokens 今天,下雨,我,没,带,伞\n"
            "  attnkit explain --scores 2,8,4 --d-k 16\n"
            "  attnkit explain --causal 4\n"
            "  attnkit explain scaling --png runs/scaling.png\n"
            "  attnkit explain circuits smollm2 --png runs/circuits.png\n"
            + explain_methods.EXAMPLES
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument(
        "text", nargs="?", metavar="TEXT", help="a sentence to trace through one attention head"
    )
    explain.add_argument("--model", metavar="PATH", help="with TEXT: a model directory to trace")
    explain.add_argument(
        "--preset", default="tiny", help="with TEXT and no --model: an untrained preset (tiny)"
    )
    explain.add_argument(
        "--seed", type=int, default=0, help="with TEXT and no --model: the weights' seed (0)"
    )
    explain.add_argument("--layer", type=int, default=0, help="with TEXT: the layer (default 0)")
    explain.add_argument("--head", type=int, default=0, help="with TEXT: the head (default 0)")
    explain.add_argument(
        "--query",
        metavar="TOKEN",
        help="with TEXT: show what this token mixes (a token, TOKEN#k for its k-th occurrence, "
        "or an index)",
    )
    explain.add_argument("--dims", type=int, default=4, help="with TEXT: dimensions of Q/K/V shown")
    explain.add_argument("--scores", metavar="S1,S2,...", help="one query's scores over the keys")
    explain.add_argument("--tokens", metavar="T1,T2,...", help="labels for the keys, one each")
    explain.add_argument(
        "--d-k", type=int, metavar="D", help="treat the scores as raw q.k and divide by sqrt(D)"
    )
    explain.add_argument(
        "--causal",
        type=int,
        nargs="?",
        const=0,
        metavar="N",
        help="print the causal mask of size N; with TEXT, use a causal (decoder) model",
    )
    explain.set_defaults(handler=run)
    _register_topics(explain)
    explain_circuits.register(explain)
    explain_methods.register(explain)


def run(args: argparse.Namespace) -> None:
    # attnkit.explain loads matplotlib (0.8 s): only the commands that use it import it
    from attnkit.explain.softmax import explain_causal, explain_softmax

    if args.text is not None:
        _explain_text(args)
        return
    if args.causal == 0 and args.scores is None:
        raise UsageError("--causal: give the mask size N (or a TEXT to trace causally)")
    if args.scores is None and args.causal is None:
        raise UsageError(
            "explain: give --scores S1,S2,..., --causal N, a TEXT or a METHOD such as "
            "'scaling' (see 'attnkit explain --help')"
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
