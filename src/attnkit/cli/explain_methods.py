"""``attnkit explain rollout|flow|lens|heads|patch|attribute TEXT``: the views beyond the
heatmap (attnkit.explain.rollout, lens, interventions, attribution), on any model."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnkit.cli.common import UsageError, load_model, load_tokenizer

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


# --------------------------------------------------------------------------------------------
# loading and encoding
# --------------------------------------------------------------------------------------------


class Subject:
    """The model, its tokenizer (or the untrained preset's word vocabulary) and the texts."""

    def __init__(self, args: argparse.Namespace, default_family: str) -> None:
        from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer

        texts = [args.text] + [t for t in (args.target, args.corrupted) if t is not None]
        if not args.text.strip():
            raise UsageError("explain: TEXT is empty")
        if args.model:
            self.model = load_model(args.model, "--model", dequantize=True).eval()
            self.tokenizer = load_tokenizer(args.model, "--model")
            if self.tokenizer is None:
                raise UsageError(f"--model: {args.model} has no tokenizer")
            self.source = args.model
            self.vocab = None
        else:
            from attnkit.config import ModelConfig

            family = args.family or default_family
            words = [t.split() if " " in t.strip() else list(t.strip()) for t in texts]
            unique = dict.fromkeys(w for ws in words for w in ws)
            self.vocab = {w: i + 5 for i, w in enumerate(unique)}
            cfg = ModelConfig.preset(args.preset, vocab_size=max(512, len(self.vocab) + 5))
            torch.manual_seed(args.seed)
            build = {
                "encoder": EncoderModel,
                "decoder": DecoderLM,
                "classifier": lambda c: EncoderClassifier(c, num_classes=2),
                "encoder-decoder": Transformer,
            }[family]
            self.model = build(cfg).eval()
            self.tokenizer = None
            self.source = f"untrained preset {args.preset!r} ({family}, seed {args.seed})"
        self.kind = type(self.model).__name__
        self.ids, self.tokens = self.encode(args.text, "TEXT")

    def encode(self, text: str, what: str) -> tuple[torch.Tensor, list[str]]:
        if self.tokenizer is None:
            words = text.split() if " " in text.strip() else list(text.strip())
            ids = [self.vocab[w] for w in words]
            tokens = words
        else:
            if self.kind == "EncoderClassifier":  # [CLS] first, as the classifier was trained
                from attnkit.training.classification import encode_for_classifier

                ids = encode_for_classifier(self.tokenizer, text, self.model.cfg.max_len)
            else:
                ids = self.tokenizer.encode(text)
            tokens = [self._token(i) for i in ids]
        if not ids:
            raise UsageError(f"explain: {what} gives no tokens")
        return torch.tensor([ids]), tokens

    def _token(self, token_id: int) -> str:
        """A token as it reads: its text, or its name for a special token ([CLS])."""
        text = self.tokenizer.decode([token_id], skip_special=False)
        to_token = getattr(self.tokenizer, "id_to_token", None)
        return text if text or to_token is None else to_token(token_id)

    def token_id(self, text: str, option: str) -> int:
        """One vocabulary entry: as written, or as a word after a space (' animal')."""
        if self.tokenizer is None:
            if text not in self.vocab:
                raise UsageError(f"{option}: {text!r} is not a word of the texts given")
            return self.vocab[text]
        for form in (" " + text, text):
            ids = self.tokenizer.encode(form, add_special_tokens=False)
            if len(ids) == 1:
                return ids[0]
        raise UsageError(f"{option}: {text!r} is more than one token; give a single token")

    def describe(self, token_id: int) -> str:
        if self.tokenizer is None:
            words = {i: w for w, i in self.vocab.items()}
            return words.get(token_id, f"<{token_id}>")
        return self.tokenizer.decode([token_id], skip_special=False)


def _query(tokens: list[str], text: str | None) -> int | None:
    """--query as a token (stripped of spaces), TOKEN#k for its k-th occurrence, or an index."""
    if text is None:
        return None
    stripped = [t.strip() for t in tokens]
    name, _, nth = text.rpartition("#")
    if text in stripped:
        return stripped.index(text)
    if name in stripped and nth.isdigit() and 1 <= int(nth) <= stripped.count(name):
        return [i for i, t in enumerate(stripped) if t == name][int(nth) - 1]
    if text.lstrip("-").isdigit() and -len(tokens) <= int(text) < len(tokens):
        return int(text) % len(tokens)
    raise UsageError(f"--query: {text!r} is not one of the tokens {stripped}")


def _progress(label: str):
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=label, unit="run", leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def draw(args, plot) -> None:
    """Draw with ``plot(path)`` to --png and --svg, as asked (the format follows the option)."""
    for option in ("png", "svg"):
        path = getattr(args, option, None)
        if path:
            if Path(path).suffix.lower() != f".{option}":
                raise UsageError(f"--{option}: the file name must end in .{option}, got {path!r}")
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                written = plot(path)
                print(f"wrote {written}")
                if option == "png":
                    getattr(args, "drawn", []).append(written)
            except (OSError, ValueError) as error:
                raise UsageError(f"--{option}: cannot write {path}: {error}") from None


def _cell(x: float) -> str:
    return f"{x:6.2f}"


def _matrix(rows: list[str], columns: list[str], values) -> str:
    width = max(6, *(len(c.strip()[:8]) for c in columns))
    head = " " * 12 + " ".join(f"{c.strip()[:8]:>{width}}" for c in columns)
    lines = [head]
    for name, row in zip(rows, values, strict=True):
        lines.append(f"{name.strip()[:11]:<12}" + " ".join(f"{v:>{width}.2f}" for v in row))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# rollout and flow
# --------------------------------------------------------------------------------------------


def _attentions(subject: Subject, args) -> list:
    model = subject.model
    with torch.no_grad():
        if subject.kind == "Transformer":
            stack = args.stack or "encoder"
            if stack == "encoder":
                _, attentions = model.encode(subject.ids, return_attention=True)
            else:
                tgt, _ = _target(subject, args)
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


def _rollout(args) -> None:
    from attnkit.explain.plots import plot_attention_heatmap
    from attnkit.explain.rollout import attention_flow, attention_rollout

    subject = Subject(args, "encoder")
    attentions = _attentions(subject, args)
    tokens = subject.tokens if attentions[0].shape[-1] == len(subject.tokens) else None
    if tokens is None:
        tokens = _target(subject, args)[1]
    raw = attentions[-1][0].mean(0)  # the top layer, heads averaged
    rollout = attention_rollout(attentions)[0]
    views = {"raw (top layer)": raw, "rollout": rollout}
    if args.topic == "flow":
        views["flow"] = attention_flow(attentions, progress=_progress("max flows"))[0]
    result = views["flow" if args.topic == "flow" else "rollout"]
    print(f"model: {subject.source}; {len(attentions)} layers, heads averaged, residual counted\n")
    query = _query(tokens, args.query)
    if query is None:
        print(f"{args.topic}: row i = the share of each input token in position i at the top")
        print(_matrix(tokens, tokens, result.tolist()))
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


# --------------------------------------------------------------------------------------------
# the logit lens
# --------------------------------------------------------------------------------------------


def _lens(args) -> None:
    from attnkit.explain.grids import plot_lens
    from attnkit.explain.lens import logit_lens

    subject = Subject(args, "decoder")
    if subject.kind != "DecoderLM":
        raise UsageError(f"explain lens: needs a decoder-only model, got a {subject.kind}")
    lens = logit_lens(subject.model, subject.ids)[:, 0]  # (L + 1, N, V)
    layers = ["embeddings"] + [f"layer {i + 1}" for i in range(lens.shape[0] - 1)]
    query = _query(subject.tokens, args.query)
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


# --------------------------------------------------------------------------------------------
# ablation, patching, attribution: a metric of the model's output
# --------------------------------------------------------------------------------------------


def _target(subject: Subject, args) -> tuple[torch.Tensor, list[str]]:
    if args.target is None:
        raise UsageError("explain: an encoder-decoder model needs --target TEXT (its output)")
    ids, tokens = subject.encode(args.target, "--target")
    bos = subject.model.cfg.bos_id
    if bos is not None and int(ids[0, 0]) != bos:
        ids = torch.cat([torch.tensor([[bos]]), ids], dim=1)
        tokens = ["<bos>", *tokens]
    return ids, tokens


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
        tgt, _ = _target(subject, args)

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


def _heads(args) -> None:
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
        progress=_progress("ablations"),
    )  # fmt: skip
    layers, heads = deltas.shape
    print(f"model: {subject.source}\nmetric: {what} = {base:.4f}")
    print(f"change when one head is {args.mode}-ablated ({attention}-attention), layer x head:\n")
    print(_matrix([f"layer {i}" for i in range(layers)], [f"h{h}" for h in range(heads)],
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


def _patch(args) -> None:
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
        model, clean, corrupted, metric, stack=stack, progress=_progress("residual patches")
    )
    heads = patch_heads(
        model, clean, corrupted, metric, stack=stack, progress=_progress("head patches")
    )
    restored_residual, restored_heads = (residual - low) / span, (heads - low) / span
    layers = [f"layer {i}" for i in range(residual.shape[0])]
    print(f"model: {subject.source}\nmetric: {what}: clean {high:.4f}, corrupted {low:.4f}")
    print("share of the clean metric restored by patching the clean run's residual stream "
          "into the corrupted run (layer input x position; 1 = all of it):\n")  # fmt: skip
    print(_matrix(layers, subject.tokens, restored_residual.tolist()))
    print("\n... and by patching one head's output (layer x head):\n")
    print(_matrix(layers, [f"h{h}" for h in range(heads.shape[1])], restored_heads.tolist()))
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


def _attribute(args) -> None:
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
        tgt, tgt_tokens = _target(subject, args)
        scores = attribute_translation(model, subject.ids, tgt, **options)[0]  # (T - 1, S)
        with torch.no_grad():
            _, attentions = model(subject.ids, tgt[:, :-1], return_attention=True)
        cross = attentions["cross"][-1][0].mean(0)  # (T - 1, S): the top layer, heads averaged
        words = tgt_tokens[1:]
        print("which source tokens lie behind each output word (attribution):")
        print(_matrix(words, subject.tokens, scores.tolist()))
        print("\n... and where the top layer's cross-attention looks (heads averaged):")
        print(_matrix(words, subject.tokens, cross.tolist()))
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


def _report(args, printed: str) -> None:
    """--html: the method's output, its pictures and the text's attention, in one page."""
    from attnkit.explain import attention_sections, render_attention_html
    from attnkit.explain.report import rollout_sections

    subject = Subject(args, "decoder" if args.topic not in ("rollout", "flow") else "encoder")
    with torch.no_grad():
        if subject.kind == "Transformer":
            tgt, tgt_tokens = _target(subject, args)
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
        "rollout": _rollout,
        "flow": _rollout,
        "lens": _lens,
        "heads": _heads,
        "patch": _patch,
        "attribute": _attribute,
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
