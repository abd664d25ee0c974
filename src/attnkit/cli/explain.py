"""``attnkit explain``: the worked examples of the notes, step by step."""

from __future__ import annotations

import argparse
import math

import torch

from attnkit.cli._common import UsageError, _tokenize_for
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

    rows = scaling_experiment(seed=args.seed)
    print(format_scaling_table(rows))
    if args.png:
        try:
            path = plot_scaling(rows, args.png)
        except (OSError, ValueError) as error:
            raise UsageError(f"--png: cannot write {args.png}: {error}") from None
        print(f"\nwrote {path}")


def _explain_complexity(args: argparse.Namespace) -> None:
    from attnkit.explain.complexity import (
        fit_slopes,
        format_complexity_table,
        measure_complexity,
        plot_complexity,
    )

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
    if args.png:
        try:
            path = plot_complexity(rows, args.png)
        except (OSError, ValueError) as error:
            raise UsageError(f"--png: cannot write {args.png}: {error}") from None
        print(f"\nwrote {path}")


TOPICS = {"scaling": _explain_scaling, "complexity": _explain_complexity}


def _explain_text(args: argparse.Namespace) -> None:
    """One head's attention over a sentence, every number shown (explain.trace)."""
    from attnkit.explain.trace import format_trace, trace_attention

    if args.dims < 1:
        raise UsageError(f"--dims: must be a positive integer, got {args.dims}")
    family = DecoderLM if args.causal is not None else EncoderModel
    model, [(ids, tokens)] = _tokenize_for(args.model, [args.topic], args.preset, args.seed, family)
    if not ids:
        raise UsageError("explain: the text gives no tokens")
    query = None
    if args.query is not None:
        name, _, nth = args.query.rpartition("#")
        if args.query in tokens:
            query = tokens.index(args.query)
        elif name in tokens and nth.isdigit() and 1 <= int(nth) <= tokens.count(name):
            query = [i for i, t in enumerate(tokens) if t == name][int(nth) - 1]  # 毒#2
        elif args.query.lstrip("-").isdigit() and -len(tokens) <= int(args.query) < len(tokens):
            query = int(args.query) % len(tokens)
        else:
            raise UsageError(f"--query: {args.query!r} is not one of the tokens {tokens}")
    try:
        trace = trace_attention(
            model, torch.tensor([ids]), layer=args.layer, head=args.head, tokens=tokens
        )
    except (ValueError, TypeError) as error:
        raise UsageError(f"explain: {error}") from None
    source = args.model or f"preset {args.preset!r}, untrained, seed {args.seed}"
    print(f"model: {source}\n")
    print(format_trace(trace, dims=args.dims, query=query))


def _cmd_explain(args: argparse.Namespace) -> None:
    # attnkit.explain loads matplotlib (0.8 s): only the commands that use it import it
    from attnkit.explain.softmax import explain_causal, explain_softmax

    if args.topic is not None:
        if args.topic in TOPICS:
            TOPICS[args.topic](args)
        else:
            _explain_text(args)
        return
    if args.png:
        raise UsageError("--png goes with a topic ('attnkit explain scaling --png FILE')")
    if args.causal == 0 and args.scores is None:
        raise UsageError("--causal: give the mask size N (or a TEXT to trace causally)")
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
