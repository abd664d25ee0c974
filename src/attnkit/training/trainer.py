"""One training loop for every task: AdamW, clipping, a schedule, evaluation, exact resume.

::

    for step in 1 .. steps:
        batch = task.train_batch(epoch, i, B)          # a pure function of (seed, epoch, i)
        lr = schedule(step)                            # a pure function of the step
        for part in `accumulate` micro-batches of it:  # gradient accumulation (default 1)
            loss, n = task.loss(model, part)           # bf16 autocast, compiled layers if asked
            (loss * n).backward()                      # the sum of the token losses
        g /= (tokens in the batch); clip ||g|| to `clip`; AdamW step
        every log_every steps:         a line in metrics.jsonl (loss, lr, tokens/s)
        every eval_every steps:        task.evaluate(model, "validation") -> metrics.jsonl
        every checkpoint_every steps:  checkpoint/ (atomic: the old one or the new one)

Under torchrun (RANK / WORLD_SIZE set) the same loop runs data-parallel: the model is wrapped
in DistributedDataParallel (``strategy="ddp"``) or sharded with FSDP2 (``"fsdp"``), each rank
trains on rows ``rank::world`` of the global batch and the gradient is divided by the global
token count, so it equals the single-process one (see :mod:`attnkit.training.distributed`);
rank 0 alone logs and writes checkpoints. The checkpoint holds the plain model and the
optimizer state as one process would save them (a sharded run gathers both on rank 0 first),
so it does not depend on the world size or the strategy.

Everything that decides the next step is in the checkpoint: weights, optimizer state, the
step, the data position (epoch, batch in epoch) and the torch RNG state (dropout). The
schedule and the batches are pure functions of the step, so N steps, a stop, and a resume to
2N give the same parameters, bit for bit on CPU, as 2N steps straight.

Stopping: SIGINT (Ctrl-C) or SIGTERM finishes the current step, saves a checkpoint and returns
(status "interrupted"); a second Ctrl-C gives up at once (the previous checkpoint stays good).
A loss or gradient that is NaN or infinite raises :class:`TrainingDiverged` before the update,
without saving over the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from attnkit import accel
from attnkit.training.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    TrainerState,
    find_checkpoint,
    load_checkpoint,
    read_optimizer_state,
    read_trainer_state,
    restore_rng,
    save_checkpoint,
)
from attnkit.training.config import (
    PRECISIONS,
    TrainConfig,
    TrainingDiverged,
    TrainResult,
    check_world,
    make_optimizer,
    step_context,
)
from attnkit.training.distributed import (
    STRATEGIES,
    full_model_state,
    full_optimizer_state,
    global_loss,
    gradient_sync,
    init_distributed,
    load_full_model_state,
    load_full_optimizer_state,
    shard_batch,
    split_batch,
    wrap_model,
)
from attnkit.training.finetune import freeze
from attnkit.training.metrics import MetricsLog, format_time, plot_loss_curve
from attnkit.training.schedules import make_schedule
from attnkit.training.tasks import Task
from attnkit.training.watch import check_watch, watched

__all__ = ["PRECISIONS", "TrainConfig", "TrainResult", "Trainer", "TrainingDiverged"]

METRICS_FILE, LOSS_CURVE_FILE, SAMPLE_FILE = "metrics.jsonl", "loss_curve.png", "sample.txt"


class Trainer:
    """Trains ``model`` on ``task`` as ``config`` says, keeping everything in ``run_dir``.

    ``run_dir`` gets ``checkpoint/`` (a model directory that also resumes the run),
    ``metrics.jsonl``, ``loss_curve.png`` and ``sample.txt``. ``tokenizer`` and ``recipe`` (a
    JSON-able dict) are stored with each checkpoint. Call :meth:`resume` first to continue a
    run, then :meth:`fit`. ``config.freeze`` turns off gradients by name; ``pretrained``
    names the loaded parameters that train at ``lr x config.pretrained_lr_scale``.

    Under torchrun the trainer joins the process group itself and trains data-parallel;
    ``strategy`` is "ddp" (DistributedDataParallel: every rank holds the whole model) or "fsdp"
    (FSDP2: every rank holds 1/N of each parameter, gradient and optimizer state). Every rank
    runs validation (on the same data, so they stay in step); rank 0 alone logs and saves.

    ``self.model`` is always a plain model that evaluation, sampling and checkpoints use;
    ``self.train_model`` is what the training forward runs (the model, its DDP wrapper, or the
    sharded model). Under FSDP ``self.model`` is a full copy (no gradients, no optimizer
    state), refreshed from the shards before each validation and checkpoint.
    """

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        tokenizer=None,
        recipe: dict[str, Any] | None = None,
        quiet: bool = False,
        strategy: str = "ddp",
        pretrained: Collection[str] = (),
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer: config must be a TrainConfig, got {type(config).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"Trainer: strategy must be one of {STRATEGIES}, got {strategy!r}")
        check_watch(task, config.watch)
        self.model, self.task, self.config = model, task, config
        self.run_dir = Path(run_dir)
        self.dist = init_distributed()  # a single process unless torchrun started this one
        self.tokenizer, self.quiet = tokenizer, quiet or not self.dist.is_main
        self.strategy = strategy
        self.sharded = self.dist.enabled and strategy == "fsdp"
        self.frozen = freeze(model, config.freeze)  # before the optimizer sees the parameters
        accel.check_compiler(config.compile, sharded=self.sharded)  # train.compile: can it run?
        # the fused LM-head loss and the unpadded stacks; the levers of a step: step_context
        self.levers = accel.prepare(model, "training")
        check_world(config, self.dist.world)  # every micro-batch of every rank gets a row
        # what the training forward runs, and (FSDP) the plain full copy made before sharding
        self.train_model, self.model = wrap_model(model, self.dist, strategy, config.device)
        self.device = next(self.model.parameters()).device
        # The optimizer steps the parameters the training forward uses (sharded under FSDP).
        self.optimizer, self._param_names = make_optimizer(
            config, self.train_model if self.sharded else self.model, pretrained
        )
        cfg, smoothing = getattr(model, "cfg", None), config.label_smoothing
        smoothing = getattr(cfg, "label_smoothing", 0.0) if smoothing is None else smoothing
        self.smoothing = float(smoothing)
        self.schedule = make_schedule(
            config.schedule,
            lr=config.lr,
            warmup=config.warmup,
            total=config.steps,
            d_model=getattr(cfg, "d_model", 512),
            min_ratio=config.min_lr_ratio,
        )
        self.state = TrainerState(task=task.describe(), recipe=recipe)
        self.metrics = MetricsLog(self.run_dir / METRICS_FILE)
        self._saved_step: int | None = None
        self._stop_signal: int | None = None
        self._stop_agreed = False
        self._bar, self._lr = None, 0.0

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / CHECKPOINT_DIR

    def _barrier(self) -> None:
        if self.dist.enabled:
            torch.distributed.barrier()

    def _refresh_model(self) -> None:
        """Under FSDP, gather the shards into the plain copy ``self.model`` (a collective:
        every rank calls it). Nothing to do otherwise: ``self.model`` is what trains."""
        if self.sharded:
            self.model.load_state_dict(full_model_state(self.train_model))

    # ----------------------------------------------------------------------------------------
    # Resume, save, evaluate
    # ----------------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Continue from ``run_dir/checkpoint`` if there is one: weights, optimizer, step, data
        position and RNG. Returns False (and changes nothing) when there is none."""
        directory = find_checkpoint(self.run_dir)
        if directory is None:
            return False
        task = read_trainer_state(directory).task.get("name")
        if task != self.task.name:
            raise CheckpointError(
                f"{directory}: the checkpoint is a {task!r} run, this is a {self.task.name!r} task"
            )
        if self.sharded:  # the whole state into the plain copy, then shard it
            state = load_checkpoint(directory, model=self.model)
            load_full_model_state(self.train_model, self.model.state_dict())
            try:
                optimizer_state = read_optimizer_state(directory)
                load_full_optimizer_state(
                    self.train_model, self.optimizer, optimizer_state, self._param_names
                )
            except (OSError, RuntimeError, KeyError, IndexError, ValueError) as error:
                raise CheckpointError(
                    f"{directory}: the optimizer state does not fit this run ({error})"
                ) from None
        else:
            state = load_checkpoint(directory, model=self.model, optimizer=self.optimizer)
        restore_rng(state)
        state.recipe = self.state.recipe if self.state.recipe is not None else state.recipe
        state.task = self.task.describe()
        self.state = state
        self._saved_step = state.step
        if self.dist.is_main:
            self.metrics.truncate_after(state.step)
        return True

    def save(self) -> Path:
        """Write the checkpoint now (atomically); under torchrun rank 0 writes it and the
        others wait until it is there. The model saved is the plain one; under FSDP the
        weights and the optimizer state are gathered first (every rank must call this)."""
        optimizer: torch.optim.Optimizer | dict = self.optimizer
        if self.sharded:
            self._refresh_model()
            optimizer = full_optimizer_state(self.train_model, self.optimizer, self._param_names)
        if self.dist.is_main:
            save_checkpoint(
                self.checkpoint_dir,
                model=self.model,
                optimizer=optimizer,
                state=self.state,
                tokenizer=self.tokenizer,
                keep_snapshots=self.config.keep_checkpoints,
            )
        self._barrier()
        self._saved_step = self.state.step
        return self.checkpoint_dir

    def evaluate(self, split: str = "validation", max_batches: int | None = None) -> dict:
        """``task.evaluate`` under the run's precision (under FSDP every rank must call it)."""
        self._refresh_model()
        with step_context(self.config.precision, self.device):
            return self.task.evaluate(
                self.model, split, batch_size=self.config.batch_size, max_batches=max_batches
            )

    # ----------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        if self.quiet:
            return
        if self._bar is not None and not self._bar.disable:
            self._bar.write(message)
        else:
            print(message, flush=True)

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGINT / SIGTERM set a flag the loop checks after each step; a second SIGINT raises
        KeyboardInterrupt at once. Handlers can only be set from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signum

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _stopping(self) -> bool:
        """A signal arrived; under torchrun, one that every rank knows of (all-reduced)."""
        return self._stop_agreed if self.dist.enabled else self._stop_signal is not None

    def _diverged(self, what: str, value: float) -> TrainingDiverged:
        kept = (
            f"the last good checkpoint is {self.checkpoint_dir} (step {self._saved_step})"
            if self._saved_step is not None
            else "no checkpoint was written yet"
        )
        return TrainingDiverged(
            f"{what} is {value} at step {self.state.step + 1} (epoch {self.state.epoch}, batch "
            f"{self.state.batch_in_epoch}); the update was not applied and {kept}. Lower train.lr "
            "or raise train.warmup / train.clip, then --resume"
        )

    def _train_step(self, steps_per_epoch: int) -> tuple[float, int, int]:
        """One update. Returns (loss, real tokens, tokens in the batch)."""
        state, config = self.state, self.config
        if state.batch_in_epoch >= steps_per_epoch:  # batch_size grew since the checkpoint
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        batch = self.task.train_batch(state.epoch, state.batch_in_epoch, config.batch_size)
        n_tokens = self.task.batch_tokens(batch)  # of the global batch
        batch = shard_batch(batch, self.dist.rank, self.dist.world)  # this rank's rows
        lr = self._lr = self.schedule(state.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        parts = split_batch(batch, config.accumulate)
        loss_sum, count = 0.0, 0
        for i, part in enumerate(parts):
            part = {k: v.to(self.device) for k, v in part.items()}
            last = i == len(parts) - 1
            with gradient_sync(self.train_model, last or not self.dist.enabled, self.sharded):
                with (
                    step_context(config.precision, self.device),
                    accel.compiled_layers(self.model, config.compile),
                ):
                    loss, n = self.task.loss(self.train_model, part, smoothing=self.smoothing)
                (loss * n).backward()  # the sum of this part's token losses
            loss_sum += float(loss.detach()) * n
            count += n
        if self.dist.enabled:  # DDP / FSDP averaged the gradients over the ranks
            value, count = self._global_loss(loss_sum, count)
            scale = self.dist.world / max(count, 1)
        else:
            value, scale = loss_sum / max(count, 1), 1 / max(count, 1)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not math.isfinite(value):
            self.optimizer.zero_grad(set_to_none=True)
            raise self._diverged("the loss", value)
        for param in params:  # the sum over the batch's tokens -> their mean
            if param.grad is not None:
                param.grad.mul_(scale)
        # ||g|| is checked even without clipping (max_norm = inf then leaves g as it is).
        norm = torch.nn.utils.clip_grad_norm_(params, config.clip or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise self._diverged("the gradient norm", norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.batch_in_epoch += 1
        if state.batch_in_epoch >= steps_per_epoch:
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
        state.tokens_seen += n_tokens
        return value, count, n_tokens

    def _global_loss(self, loss_sum: float, count: int) -> tuple[float, int]:
        """The global mean loss and token count (one all-reduce); a signal on any rank stops
        every rank after this step."""
        value, total, stopped = global_loss(
            loss_sum, count, self._stop_signal is not None, self.device
        )
        self._stop_agreed = stopped  # the loop stops on this, the same on every rank
        if stopped and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM
        return value, total

    def _validate(self) -> dict[str, float]:
        result = self.evaluate("validation", self.config.eval_batches or None)
        self.state.last_validation = result
        record = {"split": "validation", "step": self.state.step, "epoch": self.state.epoch}
        if self.dist.is_main:
            heads = watched(self.model, self.task, self.config, self.device)  # train.watch
            record.update(heads, **result, elapsed_s=round(self.state.elapsed_s, 2))
            self.metrics.append(record)
        extra = "".join(
            f"  {k} {v:.4g}"
            for k, v in result.items()
            if k not in ("loss", "tokens", "sentences", "examples") and isinstance(v, float)
        )
        self._say(f"step {self.state.step}: validation loss {result['loss']:.4f}{extra}")
        return result

    def fit(self, until: int | None = None) -> TrainResult:
        """Train to ``config.steps`` (or stop early at step ``until``); save; return how it
        ended. Raises :class:`TrainingDiverged` on a NaN/inf loss."""
        config, state = self.config, self.state
        steps_per_epoch = self.task.steps_per_epoch(config.batch_size)
        if steps_per_epoch < 1:
            raise ValueError(
                f"train.batch_size={config.batch_size} is larger than the training split "
                "(not one full batch per epoch)"
            )
        if state.step == 0:
            torch.manual_seed(config.seed)
            if self.dist.is_main:
                self.metrics.clear()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        stop_at = config.steps if until is None else min(until, config.steps)
        self._stop_signal, self._stop_agreed = None, False
        self.model.train(), self.train_model.train()
        interactive = sys.stderr.isatty() and not self.quiet
        self._bar = tqdm(
            total=config.steps,
            initial=state.step,
            disable=not interactive,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )
        window_loss, window_count, window_tokens, window_time = 0.0, 0, 0, 0.0
        session_start, session_steps = time.perf_counter(), 0
        try:
            with self._stop_on_signals():
                while state.step < stop_at and not self._stopping():
                    started = time.perf_counter()
                    loss, count, n_tokens = self._train_step(steps_per_epoch)
                    took = time.perf_counter() - started
                    state.elapsed_s += took
                    session_steps += 1
                    window_loss += loss * count
                    window_count += count
                    window_tokens += n_tokens
                    window_time += took
                    self._bar.update(1)
                    if config.compile and session_steps == 1:
                        self._say(f"compiled the layers: step {state.step} took {took:.1f} s")

                    if self.dist.is_main and (
                        state.step % config.log_every == 0 or state.step == config.steps
                    ):
                        mean = window_loss / max(window_count, 1)
                        rate = window_tokens / max(window_time, 1e-9)
                        self.metrics.append(
                            {
                                "split": "train",
                                "step": state.step,
                                "epoch": state.epoch,
                                "loss": mean,
                                "lr": self._lr,
                                "tokens_per_s": round(rate, 1),
                                "elapsed_s": round(state.elapsed_s, 2),
                            }
                        )
                        self._bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{rate:,.0f}")
                        if not interactive:
                            per_step = (time.perf_counter() - session_start) / session_steps
                            eta = format_time(per_step * (stop_at - state.step))
                            self._say(
                                f"step {state.step}/{config.steps}  loss {mean:.4f}  "
                                f"lr {self._lr:.2e}  "
                                f"{rate:,.0f} tok/s  elapsed {format_time(state.elapsed_s)}  "
                                f"eta {eta}"
                            )
                        window_loss, window_count, window_tokens, window_time = 0.0, 0, 0, 0.0

                    if state.step % config.eval_every == 0 or state.step == config.steps:
                        started = time.perf_counter()
                        self._validate()
                        state.elapsed_s += time.perf_counter() - started
                    if state.step % config.checkpoint_every == 0:
                        self.save()
                if self._saved_step != state.step:
                    self.save()
        finally:
            self._bar.close()
            self._bar = None

        if self._stop_signal is not None:
            name = signal.Signals(self._stop_signal).name
            self._say(
                f"{name}: stopped at step {state.step}; checkpoint saved to "
                f"{self.checkpoint_dir} (continue with --resume)"
            )
            status = "interrupted"
        elif state.step < config.steps:
            status = "paused"
        else:
            status = "finished"
        sample = None
        if status == "finished" and self.dist.is_main:
            self.plot()
            sample = self.task.sample(
                self.model,
                self.tokenizer,
                prompt=config.sample_prompt,
                max_new_tokens=config.sample_tokens,
                seed=config.seed,
            )
            if sample is not None:
                (self.run_dir / SAMPLE_FILE).write_text(sample + "\n", encoding="utf-8")
        return TrainResult(
            status=status,
            step=state.step,
            checkpoint=self.checkpoint_dir,
            validation=state.last_validation,
            elapsed_s=state.elapsed_s,
            signal=self._stop_signal,
            sample=sample,
        )

    def plot(self) -> Path:
        """Draw ``loss_curve.png`` from ``metrics.jsonl``."""
        recipe = self.state.recipe or {}
        title = f"{recipe.get('name', self.task.name)}: loss per token"
        return plot_loss_curve(self.metrics.read(), self.run_dir / LOSS_CURVE_FILE, title=title)
