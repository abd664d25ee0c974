"""``attnkit explain rollout|flow|lens``: reading what the model computes, without changing it
(attnkit.explain.rollout and lens)."""

from __future__ import annotations

import torch

from attnkit.cli.common import UsageError
from attnkit.cli.explain_subject import Subject, draw, matrix, progress, query_position, target


def _attentions(subject: Subject, args) -> list:
    model = subject.model
    with torch.no_grad():
        if subject.kind == "Transformer":
            stack = args.stack or "encoder"
            if stack == "encoder":
                _, attentions = model.encode(subject.ids, return_attention=True)
            else:
                tgt, _ = target(subject, args)
                _, attentions = model(subject.ids, tgt, return_attention=True)
                attentions = attentions["decoder"]
        else:
            _, attentions = model(subject.ids, return_attention=True)
    if any(a is None for a in attentions):
        raise UsageError(
            f"explain {args.topic}: this model's attention gives no weights "
            f"(attention={model.cfg.attention!r}); rollout and flow need them"
        )
    return attentions


def rollout(args) -> None:
    from attnkit.explain.plots import plot_attention_heatmap
    from attnkit.explain.rollout import attention_flow, attention_rollout

    subject = Subject(args, "encoder")
    attentions = _attentions(subject, args)
    tokens = subject.tokens if attentions[0].shape[-1] == len(subject.tokens) else None
    if tokens is None:
        tokens = target(subject, args)[1]
    raw = attentions[-1][0].mean(0)  # the top layer, heads averaged
    rollout = attention_rollout(attentions)[0]
    views = {"raw (top layer)": raw, "rollout": rollout}
    if args.topic == "flow":
        views["flow"] = attention_flow(attentions, progress=progress("max flows"))[0]
    result = views["flow" if args.topic == "flow" else "rollout"]
    print(f"model: {subject.source}; {len(attentions)} layers, heads averaged, residual counted\n")
    query = query_position(tokens, args.query)
    if query is None:
        print(f"{args.topic}: row i = the share of each input token in position i at the top")
        print(matrix(tokens, tokens, result.tolist()))
    else:
        print(f"what reaches {tokens[query].strip()!r} (position {query}) at the top:\n")
        names = list(views)
        print(f"{'token':<14}" + "".join(f"{n:>18}" for n in names))
        for j, token in enumerate(tokens):
            row = "".join(f"{float(views[n][query, j]):>18.3f}" for n in names)
            print(f"{token.strip()[:13]:<14}{row}")
    draw(
        args,
        lambda path: plot_attention_heatmap(
            result, tokens, tokens, path, title=f"attention {args.topic}"
        ),
    )


def lens(args) -> None:
    from attnkit.explain.grids import plot_lens
    from attnkit.explain.lens import logit_lens

    subject = Subject(args, "decoder")
    if subject.kind != "DecoderLM":
        raise UsageError(f"explain lens: needs a decoder-only model, got a {subject.kind}")
    lens = logit_lens(subject.model, subject.ids)[:, 0]  # (L + 1, N, V)
    layers = ["embeddings"] + [f"layer {i + 1}" for i in range(lens.shape[0] - 1)]
    query = query_position(subject.tokens, args.query)
    query = len(subject.tokens) - 1 if query is None else query
    answer = subject.token_id(args.answer, "--answer") if args.answer else None
    print(f"model: {subject.source}")
    print(f"the next token after {subject.tokens[query].strip()!r} (position {query}), read "
          "after each layer through the final norm and the LM head:\n")  # fmt: skip
    for name, logp in zip(layers, lens[:, query], strict=True):
        top = logp.exp().topk(3)
        cells = "  ".join(
            f"{subject.describe(int(i))!r:>12} {float(p):.3f}"
            for p, i in zip(top.values, top.indices, strict=True)
        )
        extra = ""
        if answer is not None:
            rank = int((logp > logp[answer]).sum()) + 1
            extra = f"   {args.answer!r}: p={float(logp[answer].exp()):.3f} rank {rank}"
        print(f"{name:<12}{cells}{extra}")
    probs, ids = lens.exp().max(-1)  # (L + 1, N)
    predictions = [[subject.describe(int(i)) for i in row] for row in ids]
    draw(
        args,
        lambda path: plot_lens(
            probs, predictions, layers, subject.tokens, path, title="the logit lens"
        ),
    )
