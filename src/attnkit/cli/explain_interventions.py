"""``attnkit explain heads|patch|attribute``: a metric of the model's output, and how it moves
when a head is ablated, an activation patched, or the input's embeddings are varied
(attnkit.explain.interventions and attribution)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli.common import UsageError
from attnkit.cli.explain_subject import Subject, draw, matrix, progress, target


def _measure(subject: Subject, args):
    """(run for an input, metric, what the metric is)."""
    model, kind = subject.model, subject.kind
    if kind == "DecoderLM":
        with torch.no_grad():
            top = int(model(subject.ids)[0, -1].argmax())
        answer = subject.token_id(args.answer, "--answer") if args.answer else top
        text = f"log p({subject.describe(answer)!r} next)"
        versus = subject.token_id(args.versus, "--versus") if args.versus else None
        if versus is not None:
            text += f" - log p({subject.describe(versus)!r} next)"

        def metric(logits):
            logp = logits.log_softmax(-1)[0, -1]
            return logp[answer] - (logp[versus] if versus is not None else 0.0)

        return (lambda ids: lambda m: m(ids)), metric, text
    if kind == "EncoderClassifier":
        classes = model.classifier.out_features
        with torch.no_grad():
            label = int(model(subject.ids)[0].argmax()) if args.label is None else args.label
        if not 0 <= label < classes:
            raise UsageError(f"--label: must be a class in [0, {classes}), got {label}")
        names = getattr(model, "labels", None) or []
        text = f"log p(class {label}" + (f" {names[label]})" if label < len(names) else ")")
        return (lambda ids: lambda m: m(ids)), (lambda out: out.log_softmax(-1)[0, label]), text
    if kind == "Transformer":
        tgt, _ = target(subject, args)

        def metric(logits):
            logp = logits.log_softmax(-1)
            return logp.gather(-1, tgt[:, 1:, None]).sum()

        return (lambda ids: lambda m: m(ids, tgt[:, :-1])), metric, "log p(target | source)"
    raise UsageError(
        f"explain {args.topic}: needs a model with an output to measure (a decoder, a "
        f"classifier or an encoder-decoder), got a {kind}"
    )


def _stack(subject: Subject, args) -> tuple[str | None, str]:
    if subject.kind == "Transformer":
        stack = args.stack or "decoder"
        return stack, "cross" if stack == "decoder" and args.topic == "heads" else "self"
    return None, "self"


def heads(args) -> None:
    from attnkit.explain.grids import plot_grid
    from attnkit.explain.interventions import ablate_heads

    subject = Subject(args, "decoder")
    runner, metric, what = _measure(subject, args)
    stack, attention = _stack(subject, args)
    run = runner(subject.ids)
    with torch.no_grad():
        base = float(metric(run(subject.model)))
    deltas = ablate_heads(
        subject.model, run, metric, mode=args.mode, stack=stack, attention=attention,
        progress=progress("ablations"),
    )  # fmt: skip
    layers, heads = deltas.shape
    print(f"model: {subject.source}\nmetric: {what} = {base:.4f}")
    print(f"change when one head is {args.mode}-ablated ({attention}-attention), layer x head:\n")
    print(matrix([f"layer {i}" for i in range(layers)], [f"h{h}" for h in range(heads)],
                  deltas.tolist()))  # fmt: skip
    order = deltas.abs().flatten().argsort(descending=True)[:5]
    print("\nthe heads that matter most:")
    for k in order.tolist():
        print(f"  layer {k // heads} head {k % heads}: {float(deltas.flatten()[k]):+.4f}")
    draw(
        args,
        lambda path: plot_grid(
            deltas, [f"layer {i}" for i in range(layers)], [f"head {h}" for h in range(heads)],
            path, title=f"{args.mode}-ablation: change in {what}", label="change",
        ),
    )  # fmt: skip


def patch(args) -> None:
    from attnkit.explain.grids import plot_grid
    from attnkit.explain.interventions import patch_heads, patch_residual

    if args.corrupted is None:
        raise UsageError("explain patch: give --corrupted TEXT (the same number of tokens)")
    subject = Subject(args, "decoder")
    corrupted_ids, _ = subject.encode(args.corrupted, "--corrupted")
    if corrupted_ids.shape != subject.ids.shape:
        raise UsageError(
            f"--corrupted: must have as many tokens as TEXT ({subject.ids.shape[1]}), "
            f"got {corrupted_ids.shape[1]}"
        )
    runner, metric, what = _measure(subject, args)
    stack, _ = _stack(subject, args)
    clean, corrupted = runner(subject.ids), runner(corrupted_ids)
    with torch.no_grad():
        high, low = float(metric(clean(subject.model))), float(metric(corrupted(subject.model)))
    span = high - low if abs(high - low) > 1e-9 else 1.0
    model = subject.model
    residual = patch_residual(
        model, clean, corrupted, metric, stack=stack, progress=progress("residual patches")
    )
    heads = patch_heads(
        model, clean, corrupted, metric, stack=stack, progress=progress("head patches")
    )
    restored_residual, restored_heads = (residual - low) / span, (heads - low) / span
    layers = [f"layer {i}" for i in range(residual.shape[0])]
    print(f"model: {subject.source}\nmetric: {what}: clean {high:.4f}, corrupted {low:.4f}")
    print("share of the clean metric restored by patching the clean run's residual stream "
          "into the corrupted run (layer input x position; 1 = all of it):\n")  # fmt: skip
    print(matrix(layers, subject.tokens, restored_residual.tolist()))
    print("\n... and by patching one head's output (layer x head):\n")
    print(matrix(layers, [f"h{h}" for h in range(heads.shape[1])], restored_heads.tolist()))
    heads_path = {}
    for option in ("png", "svg"):
        name = getattr(args, option)
        if name:
            heads_path[option] = str(Path(name).with_stem(Path(name).stem + "-heads"))
    draw(
        args,
        lambda path: plot_grid(
            restored_residual, layers, subject.tokens, path,
            title=f"activation patching of the residual stream: {what}", label="share restored",
        ),
    )  # fmt: skip
    draw(
        argparse.Namespace(
            png=heads_path.get("png"), svg=heads_path.get("svg"), drawn=getattr(args, "drawn", [])
        ),
        lambda path: plot_grid(
            restored_heads, layers, [f"head {h}" for h in range(heads.shape[1])], path,
            title=f"activation patching of heads: {what}", label="share restored",
        ),
    )  # fmt: skip


def attribute(args) -> None:
    from attnkit.explain.attribution import (
        attribute_classifier,
        attribute_next_token,
        attribute_translation,
    )
    from attnkit.explain.grids import plot_grid

    subject = Subject(args, "decoder")
    model, kind = subject.model, subject.kind
    if args.steps < 1:
        raise UsageError(f"--steps: must be a positive integer, got {args.steps}")
    options = {"method": args.method, "steps": args.steps}
    print(f"model: {subject.source}\nmethod: {args.method}\n")
    if kind == "Transformer":
        tgt, tgt_tokens = target(subject, args)
        scores = attribute_translation(model, subject.ids, tgt, **options)[0]  # (T - 1, S)
        with torch.no_grad():
            _, attentions = model(subject.ids, tgt[:, :-1], return_attention=True)
        cross = attentions["cross"][-1][0].mean(0)  # (T - 1, S): the top layer, heads averaged
        words = tgt_tokens[1:]
        print("which source tokens lie behind each output word (attribution):")
        print(matrix(words, subject.tokens, scores.tolist()))
        print("\n... and where the top layer's cross-attention looks (heads averaged):")
        print(matrix(words, subject.tokens, cross.tolist()))
        grid, rows, what = scores, words, "log p(word)"
    else:
        if kind == "DecoderLM":
            answer = subject.token_id(args.answer, "--answer") if args.answer else None
            scores = attribute_next_token(model, subject.ids, target=answer, **options)[0]
            with torch.no_grad():
                answer = int(model(subject.ids)[0, -1].argmax()) if answer is None else answer
            what = f"log p({subject.describe(answer)!r} next)"
        elif kind == "EncoderClassifier":
            scores = attribute_classifier(model, subject.ids, target=args.label, **options)[0]
            with torch.no_grad():
                label = int(model(subject.ids)[0].argmax()) if args.label is None else args.label
            names = getattr(model, "labels", None) or []
            what = f"class {label}" + (f" ({names[label]})" if label < len(names) else "")
            what += " logit"
        else:
            raise UsageError(
                f"explain attribute: needs a decoder, a classifier or an encoder-decoder, "
                f"got a {kind}"
            )
        print(f"each token's share in {what} (positive pushed it up):\n")
        for token, score in zip(subject.tokens, scores.tolist(), strict=True):
            bar = ("+" if score > 0 else "-") * min(40, round(abs(score) / max(
                scores.abs().max().item(), 1e-12) * 20))  # fmt: skip
            print(f"  {token.strip()[:16]:<17}{score:+9.4f}  {bar}")
        grid, rows = scores[None], [what]
    draw(
        args,
        lambda path: plot_grid(
            grid, rows, subject.tokens, path, title=f"{args.method}: {what}", label="attribution"
        ),
    )
