"""``attnkit explain circuits MODEL [TEXT]``: every head's detector, copying and composition
scores (:mod:`attnkit.explain.circuits`), as a table, JSON and heatmaps; ``attnkit explain
circuits RUN_DIR``: the scores a run recorded (``train.watch``) against the step, under its loss
curve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from attnkit.cli.common import UsageError, load_model, load_tokenizer
from attnkit.cli.explain_subject import add_picture_options, check_outputs, draw

TOP = 5  # heads (or pairs) named per score


def _keyed(scores: torch.Tensor) -> dict[str, float]:
    return {f"{layer}.{head}": round(float(v), 6) for (layer, head), v in _cells(scores)}


def _cells(scores: torch.Tensor) -> list[tuple[tuple[int, int], float]]:
    """((layer, head), score) for every head."""
    return [(divmod(i, scores.shape[1]), float(v)) for i, v in enumerate(scores.flatten())]


def _strongest(scores: torch.Tensor, count: int = TOP) -> str:
    ranked = sorted(_cells(scores), key=lambda cell: -float(cell[1]))[:count]
    return "  ".join(f"{layer}.{head} {float(v):.3f}" for (layer, head), v in ranked)


def _pairs(scores: torch.Tensor, count: int = TOP) -> list[tuple[str, float]]:
    flat = scores.flatten()
    top = torch.topk(flat, min(count, flat.numel()))
    layers, heads = scores.shape[:2]
    out = []
    for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        l1, h1, l2, h2 = torch.unravel_index(torch.tensor(index), (layers, heads, layers, heads))
        out.append((f"{int(l1)}.{int(h1)}>{int(l2)}.{int(h2)}", value))
    return out


def register(explain) -> None:
    """``attnkit explain circuits``'s parser."""
    parser = explain.route(
        "circuits",
        description="Score every head of a model: previous-token, duplicate-token and "
        "induction (TransformerLens' detectors; induction on random tokens written twice, with "
        "the loss per token on each copy), how much it copies (the eigenvalues of its OV "
        "circuit W_E W_V W_O W_U) and how the heads of successive layers compose (Q, K and V "
        "composition). The strongest heads' attention patterns are drawn with --png and in the "
        "--html report. Long texts (up to 8,192 tokens and past) are scored block by block of "
        "queries, in bounded memory. Given a training run's directory instead (train.watch in "
        "its recipe), show its heads' scores against the step, under the loss curve.",
        epilog="examples:\n"
        "  attnkit explain circuits smollm2\n"
        "  attnkit explain circuits smollm2 --png runs/circuits.png --html runs/circuits.html\n"
        '  attnkit explain circuits smollm2 "$(cat notes.txt)" --json\n'
        "  attnkit explain circuits runs/induction --png runs/induction/heads.png",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a shipped model's name (smollm2, gemma3, minilm), a model directory, a .gguf "
        "file, or a training run's directory",
    )
    parser.add_argument(
        "more",
        nargs="?",
        metavar="TEXT",
        help="a text to measure previous- and duplicate-token on (default: the random tokens)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=50,
        metavar="N",
        help="induction is measured on N random tokens, written twice (default 50)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the random tokens' seed (0)")
    parser.add_argument("--json", action="store_true", help="every head's scores as JSON")
    add_picture_options(parser, "the table, the pictures and the best heads' attention")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    from attnkit.explain.circuits import circuit_scores

    source = args.model
    check_outputs(args)
    if args.repeat < 2:
        raise UsageError(f"--repeat: at least 2 tokens, got {args.repeat}")
    if (Path(source) / "metrics.jsonl").is_file():
        return _run_dir(args, Path(source))
    model = load_model(source, "MODEL", dequantize=True).eval()
    if getattr(model.cfg, "attention", "full") == "linear":
        raise UsageError(
            f"explain circuits: {source} uses linear attention, whose heads have no "
            "attention pattern to score"
        )
    ids = None
    if args.more is not None:
        tokenizer = load_tokenizer(source, "MODEL")
        if tokenizer is None:
            raise UsageError(f"MODEL: {source} has no tokenizer to read TEXT with")
        ids = torch.tensor([tokenizer.encode(args.more)])
        if ids.shape[1] < 2:
            raise UsageError(f"TEXT: {ids.shape[1]} token; the scores need at least 2")
    bos = getattr(model.cfg, "bos_id", None)
    try:
        scores = circuit_scores(model, ids, half=args.repeat, seed=args.seed, bos=bos)
    except ValueError as error:
        raise UsageError(f"explain circuits: {error}") from None
    if args.json:
        print(json.dumps(_json(scores), ensure_ascii=False))
    else:
        printed = _table(source, args, ids, scores)
        print(printed)
    args.drawn = []
    draw(args, lambda path: _draw(path, scores))
    if args.html:
        _report(args, source, scores, load_tokenizer(source, "MODEL"), printed)


def _json(scores: dict) -> dict:
    from attnkit.explain.circuits import DETECTORS

    out = {name: _keyed(scores["detectors"][name]) for name in DETECTORS}
    if scores["copying"] is not None:
        out["copying"] = _keyed(scores["copying"])
    out["composition"] = {
        mode: {pair: round(v, 6) for pair, v in _pairs(s, s.numel())}
        for mode, s in scores["composition"].items()
    }
    if "loss" in scores:
        out["loss"] = scores["loss"]
    return out


def _table(source: str, args, ids, scores: dict) -> str:
    """The terminal's report: the strongest heads of each score, where each detector's best
    head looks, and the loss on the random tokens."""
    from attnkit.explain.circuits import DETECTORS, weight_shares

    detectors, copying = scores["detectors"], scores["copying"]
    layers, heads = detectors["induction"].shape
    on = f"TEXT ({ids.shape[1]} tokens)" if ids is not None else "the random tokens"
    lines = [
        f"model: {source} ({layers} layers x {heads} heads)",
        f"previous-token and duplicate-token measured on {on}; induction on "
        f"{args.repeat} random tokens, twice (seed {args.seed})\n",
        "strongest heads (layer.head score):",
    ]
    lines += [f"  {name:<16} {_strongest(detectors[name])}" for name in DETECTORS]
    if copying is not None:
        lines.append(f"  {'copying (OV)':<16} {_strongest(copying)}")
    for mode, s in scores["composition"].items():
        pairs = "  ".join(f"{p} {v:.3f}" for p, v in _pairs(s))
        lines.append(f"  {mode + '-composition':<16} {pairs}")
    lines.append(
        "\nwhere each best head's attention goes on the second copy of the random tokens "
        "(share of its weight):"
    )
    columns = [*DETECTORS, "first token"]
    lines.append(f"  {'head':<22}" + "".join(f"{c:>17}" for c in columns))
    for name, ((layer, head), weights) in scores["patterns"].items():
        shares = weight_shares(weights, scores["repeated"])
        lines.append(
            f"  {name + f' {layer}.{head}':<22}" + "".join(f"{shares[c]:>17.3f}" for c in columns)
        )
    if "loss" in scores:
        loss = scores["loss"]
        lines.append(
            f"\nloss per token on the random tokens: first copy {loss['first']:.2f}, "
            f"second copy {loss['second']:.2f} (what induction heads make predictable)"
        )
    return "\n".join(lines)


def _report(args, source: str, scores: dict, tokenizer, printed: str | None) -> None:
    """--html: the table, the pictures, and each detector's best head over the random tokens."""
    from attnkit.explain import render_attention_html

    ids = scores["repeated"].tolist()
    tokens = [tokenizer.decode([i]) if tokenizer is not None else str(i) for i in ids]
    sections = [
        {
            "name": f"{name}: head {layer}.{head}",
            "query_tokens": [f"{i}:{t}" for i, t in enumerate(tokens)],
            "weights": weights[None, None],
            "description": f"the best {name} head's attention over {args.repeat} random tokens "
            "written twice",
        }
        for name, ((layer, head), weights) in scores["patterns"].items()
    ]
    if printed is None:
        printed = _table(source, args, None, scores)
    try:
        path = render_attention_html(
            sections,
            args.html,
            title=f"attnkit explain circuits {source}",
            images=args.drawn,
            notes=[f"Model: {source}"],
            texts=[printed],
        )
    except (OSError, ValueError) as error:
        raise UsageError(f"--html: cannot write {args.html}: {error}") from None
    print(f"wrote {path}")


def _draw(path: str, scores: dict) -> str:
    """Every head's scores as heatmaps (layer x head), and under them each detector's best
    head's attention over the random tokens written twice (query x key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copying = scores["copying"]
    panels = {**scores["detectors"], **({"copying (OV)": copying} if copying is not None else {})}
    figure, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 7.5), squeeze=False)
    for axis, (name, table) in zip(axes[0], panels.items(), strict=True):
        low = -1.0 if name.startswith("copying") else 0.0
        image = axis.imshow(
            table.float().numpy(),
            aspect="auto",
            vmin=low,
            vmax=1.0,
            cmap="RdBu_r" if low < 0 else "viridis",
        )
        axis.set_title(name)
        axis.set_xlabel("head")
        axis.set_ylabel("layer")
        figure.colorbar(image, ax=axis, shrink=0.8)
    best = scores["patterns"].items()
    for axis, (name, ((layer, head), weights)) in zip(axes[1], best, strict=False):
        axis.imshow(weights.numpy(), cmap="Blues", vmin=0.0)
        axis.set_title(f"best {name}: head {layer}.{head}", fontsize=9)
        axis.set_xlabel("key position")
        axis.set_ylabel("query position")
    for axis in axes[1, len(scores["patterns"]) :]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _run_dir(args: argparse.Namespace, run: Path) -> None:
    """A training run's heads as they formed: a table per evaluation, the step where each
    watched score jumped, and (--png, --svg) every head's score against the step under the
    loss curve."""
    from attnkit.explain.circuits import formation
    from attnkit.training.metrics import MetricsLog

    records = MetricsLog(run / "metrics.jsonl").read()
    seen = formation(records)
    if seen is None:
        raise UsageError(
            f"RUN_DIR: {run / 'metrics.jsonl'} records no head scores (train with "
            'train.watch = ["induction", "previous-token"] in the recipe)'
        )
    if args.json:
        out = {k: seen[k] for k in ("steps", "loss", "in_context", "jumps")}
        out["scores"] = {
            n: {h: t[:, i].tolist() for i, h in enumerate(seen["heads"])}
            for n, t in seen["scores"].items()
        }
        print(json.dumps(out))
    else:
        names = list(seen["scores"])
        print(f"run: {run} ({len(seen['steps'])} evaluations)")
        header = f"{'step':>6} {'loss':>7} {'in-context':>10}" + "".join(
            f" {n + ' (best head)':>26}" for n in names
        )
        print(header)
        for i, step in enumerate(seen["steps"]):
            row = f"{step:>6} {seen['loss'][i]:>7.4f} {_number(seen['in_context'][i]):>10}"
            for name in names:
                table = seen["scores"][name][i]
                best = int(table.argmax())
                row += f" {float(table[best]):>17.3f} ({seen['heads'][best]:>5})"
            print(row)
        for name, jump in seen["jumps"].items():
            print(
                f"{name}: the best head's score rose most at step {jump['step']}: "
                f"{jump['before']:.3f} -> {jump['after']:.3f}"
            )
    draw(args, lambda path: _draw_run(path, records, seen))


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _draw_run(path: str, records: list[dict], seen: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(seen["scores"])
    figure, axes = plt.subplots(
        1 + len(names), 1, figsize=(8, 2.6 * (1 + len(names))), sharex=True, squeeze=False
    )
    axes = axes[:, 0]
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    axes[0].plot(seen["steps"], seen["loss"], "o-", label="validation loss")
    axes[0].set_ylabel("loss per token")
    if any(v is not None for v in seen["in_context"]):
        twin = axes[0].twinx()
        twin.plot(
            seen["steps"], seen["in_context"], "s--", color="tab:green", label="in-context score"
        )
        twin.set_ylabel("in-context score")
        twin.legend(loc="upper center")
    axes[0].legend(loc="upper right")
    for axis, name in zip(axes[1:], names, strict=True):
        table = seen["scores"][name]
        for i, head in enumerate(seen["heads"]):
            axis.plot(seen["steps"], table[:, i].tolist(), lw=1, alpha=0.8, label=head)
        axis.set_ylabel(f"{name} score")
        axis.set_ylim(0, 1)
        axis.legend(ncol=max(1, len(seen["heads"]) // 4), fontsize=6, loc="upper left")
    for axis in axes:
        for jump in seen["jumps"].values():
            axis.axvline(jump["step"], color="grey", ls=":", lw=1)
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
