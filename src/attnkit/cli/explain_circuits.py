"""``attnkit explain circuits MODEL [TEXT]``: every head's detector, copying and composition
scores (:mod:`attnkit.explain.circuits`), as a table, JSON and heatmaps."""

from __future__ import annotations

import argparse
import json

import torch

from attnkit.cli.common import UsageError, load_model, load_tokenizer

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


def run(args: argparse.Namespace) -> None:
    from attnkit.explain.circuits import DETECTORS, circuit_scores

    source = args.text or args.model
    if source is None:
        raise UsageError("explain circuits: give MODEL, e.g. attnkit explain circuits smollm2")
    if args.repeat < 2:
        raise UsageError(f"--repeat: at least 2 tokens, got {args.repeat}")
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
    scores = circuit_scores(model, ids, half=args.repeat, seed=args.seed, bos=bos)
    detectors, copying = scores["detectors"], scores["copying"]
    if args.json:
        out = {name: _keyed(detectors[name]) for name in DETECTORS}
        if copying is not None:
            out["copying"] = _keyed(copying)
        out["composition"] = {
            mode: {pair: round(v, 6) for pair, v in _pairs(s, s.numel())}
            for mode, s in scores["composition"].items()
        }
        if "loss" in scores:
            out["loss"] = scores["loss"]
        print(json.dumps(out, ensure_ascii=False))
    else:
        layers, heads = detectors["induction"].shape
        print(f"model: {source} ({layers} layers x {heads} heads)")
        on = "TEXT" if ids is not None else f"{args.repeat} random tokens, twice"
        print(
            f"previous-token and duplicate-token measured on {on}; induction on "
            f"{args.repeat} random tokens, twice (seed {args.seed})\n"
        )
        print("strongest heads (layer.head score):")
        for name in DETECTORS:
            print(f"  {name:<16} {_strongest(detectors[name])}")
        if copying is not None:
            print(f"  {'copying (OV)':<16} {_strongest(copying)}")
        for mode, s in scores["composition"].items():
            pairs = "  ".join(f"{p} {v:.3f}" for p, v in _pairs(s))
            print(f"  {mode + '-composition':<16} {pairs}")
        if "loss" in scores:
            loss = scores["loss"]
            print(
                f"\nloss per token on the random tokens: first copy {loss['first']:.2f}, "
                f"second copy {loss['second']:.2f} (what induction heads make predictable)"
            )
    if args.png or args.svg:
        _draw(args, detectors, copying)


def _draw(args, detectors: dict, copying) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {**detectors, **({"copying (OV)": copying} if copying is not None else {})}
    figure, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 4), squeeze=False)
    for axis, (name, scores) in zip(axes[0], panels.items(), strict=True):
        low = -1.0 if name.startswith("copying") else 0.0
        image = axis.imshow(
            scores.float().numpy(),
            aspect="auto",
            vmin=low,
            vmax=1.0,
            cmap="RdBu_r" if low < 0 else "viridis",
        )
        axis.set_title(name)
        axis.set_xlabel("head")
        axis.set_ylabel("layer")
        figure.colorbar(image, ax=axis, shrink=0.8)
    figure.tight_layout()
    for path in filter(None, (args.png, args.svg)):
        figure.savefig(path)
        print(f"wrote {path}")
    plt.close(figure)
