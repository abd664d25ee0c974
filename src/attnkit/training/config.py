"""What a training run is asked to do (``TrainConfig``), what it returns, and the context a
training or evaluation step runs under (precision and the speed levers of ``attnkit.accel``)."""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit import accel
from attnkit.training.schedules import SCHEDULES

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "check_world",
    "make_optimizer",
    "precision_context",
    "resolve_device",
    "resolve_precision",
    "step_context",
    "train_config_fields",
]

PRECISIONS = ("fp32", "bf16", "auto")
DEVICES = r"auto|cpu|cuda(:\d+)?"  # train.device and the commands' --device, as a pattern


@dataclass
class TrainConfig:
    """The ``[train]`` section of a recipe: optimisation, evaluation, checkpoints."""

    steps: int = 1000  # optimizer updates in the whole run
    batch_size: int = 32
    lr: float = 1e-3  # the peak (cosine, constant); the multiplier of the paper's formula (noam)
    schedule: str = "cosine"  # "cosine" | "noam" | "constant"
    warmup: int = 100  # warm-up steps
    min_lr_ratio: float = 0.1  # cosine: the floor, as a fraction of the peak
    weight_decay: float = 0.1  # AdamW, on matrices only (not biases, norms)
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    clip: float = 1.0  # max gradient norm; 0 = no clipping
    accumulate: int = 1  # micro-batches per step (gradient accumulation); same global batch
    label_smoothing: float | None = None  # None: the model config's label_smoothing
    eval_every: int = 250  # steps between validation runs
    eval_batches: int = 20  # validation batches per run; 0 = the whole split
    checkpoint_every: int = 500
    keep_checkpoints: int = 0  # also keep the models of the last N checkpoints (to average)
    log_every: int = 10  # steps per line of metrics.jsonl
    # "fp32" | "bf16" (autocast; weights and optimizer stay fp32) | "auto" (bf16 where the
    # device has fast bf16 products, else fp32: resolve_precision)
    precision: str = "fp32"
    # "auto" (a GPU where torch sees one, else the CPU) | "cpu" | "cuda" | "cuda:N":
    # resolve_device; under torchrun each process takes its own GPU or the CPU
    device: str = "auto"
    compile: bool = False  # the Transformer layers through torch.compile (accel.compiled_layers)
    seed: int = 0  # model init, data order, dropout
    threads: int = 0  # CPU threads for torch (0: torch's default); `attnkit train` sets it
    sample_tokens: int = 200  # tokens of text to generate at the end (0: none)
    sample_prompt: str = ""
    # fine-tuning (model.init): parameters kept as loaded, and the pretrained tensors' lr factor
    freeze: list[str] = field(default_factory=list)  # e.g. ["embeddings", "layers.0-5"]
    # head detectors recorded at each evaluation, with the in-context-learning score (language
    # models): any of "induction", "previous-token", "duplicate-token"
    watch: list[str] = field(default_factory=list)
    pretrained_lr_scale: float = 1.0  # loaded tensors train at lr x this; new ones at lr

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "accumulate",
            "eval_every",
            "checkpoint_every",
            "log_every",
        ):
            _check_int(name, getattr(self, name), 1)
        for name in (
            "warmup",
            "eval_batches",
            "keep_checkpoints",
            "sample_tokens",
            "seed",
            "threads",
        ):
            _check_int(name, getattr(self, name), 0)
        for name in ("lr", "eps"):
            if not _is_number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"train.{name} must be a number > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "clip"):
            if not _is_number(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("beta1", "beta2", "min_lr_ratio"):
            if not _is_number(getattr(self, name)) or not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"train.{name} must be in [0, 1], got {getattr(self, name)!r}")
        known = ("induction", "previous-token", "duplicate-token")
        if not isinstance(self.watch, list) or any(w not in known for w in self.watch):
            raise ValueError(f"train.watch must be a list of {list(known)}, got {self.watch!r}")
        if self.label_smoothing is not None and (
            not _is_number(self.label_smoothing) or not 0 <= self.label_smoothing < 1
        ):
            raise ValueError(
                f"train.label_smoothing must be in [0, 1) or None, got {self.label_smoothing!r}"
            )
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile must be true or false, got {self.compile!r}")
        if not isinstance(self.freeze, list) or not all(
            isinstance(p, str) and p for p in self.freeze
        ):
            raise ValueError(f"train.freeze must be a list of names, got {self.freeze!r}")
        scale = self.pretrained_lr_scale
        if not _is_number(scale) or not scale > 0:
            raise ValueError(f"train.pretrained_lr_scale must be a number > 0, got {scale!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "noam" and self.warmup < 1:
            raise ValueError("train.warmup must be >= 1 for the noam schedule")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.device, str) or not re.fullmatch(DEVICES, self.device):
            raise ValueError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"train.{name} must be an int >= {minimum}, got {value!r}")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the update was not applied."""


@dataclass
class TrainResult:
    """How :meth:`Trainer.fit` ended."""

    status: str  # "finished", "paused" (reached `until`) or "interrupted" (a signal)
    step: int
    checkpoint: Path | None
    validation: dict[str, float] | None
    elapsed_s: float
    signal: int | None = None
    sample: str | None = None


SLOW_BF16 = (
    "train.precision='bf16': torch has no fast bf16 matrix products on this CPU (on x86 they "
    "need AVX-512), so they fall back to a scalar loop, many times slower than float32; "
    "use precision fp32 (or auto, which picks it) here"
)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``"fp32"`` or ``"bf16"`` as given; ``"auto"`` is bf16 where ``device`` has fast bf16
    matrix products (a CPU where :func:`attnkit.accel.bf16_products_fast` says so, a GPU that
    supports bf16) and fp32 elsewhere: on an AVX2-only CPU such as AMD's Zen 3, bf16 products
    take a scalar loop at about a hundredth of float32's speed."""
    if precision != "auto":
        return precision
    if device.type == "cpu":
        fast = accel.bf16_products_fast()
    else:
        fast = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return "bf16" if fast else "fp32"


def check_world(config: TrainConfig, world: int) -> None:
    """Refuse a global batch too small for ``world`` processes x ``train.accumulate``
    micro-batches: every micro-batch of every rank needs at least one row."""
    if config.batch_size < world * config.accumulate:
        raise ValueError(
            f"train.batch_size={config.batch_size} cannot feed {world} process(es) "
            f"x train.accumulate={config.accumulate} micro-batches: every micro-batch of "
            "every rank needs at least one row"
        )


def resolve_device(
    device: str,
    current: torch.device,
    local_rank: int | None = None,
    *,
    name: str = "train.device",
) -> torch.device:
    """Where a run trains, for ``train.device`` (or a command's option, ``name`` in the
    errors). In one process: ``"auto"`` keeps a model already on a GPU where it is, else takes
    the first GPU torch sees, else the CPU; ``"cpu"``, ``"cuda"`` and ``"cuda:N"`` as named,
    refused where torch sees no such GPU. Under torchrun (``local_rank`` given) each process
    takes its own GPU, cuda:LOCAL_RANK, where torch sees one, else the CPU (as the process
    group was set up), and ``train.device`` may only agree."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank is not None:
        chosen = torch.device("cuda", local_rank) if gpus else torch.device("cpu")
        if device != "auto" and torch.device(device).type != chosen.type:
            raise ValueError(
                f"train.device={device!r} under torchrun: each process trains on "
                f"{'its GPU (cuda:LOCAL_RANK)' if gpus else 'the CPU'} here; leave it at auto"
            )
        return chosen
    if device == "auto":
        if current.type != "cpu":
            return current
        return torch.device("cuda", 0) if gpus else torch.device("cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda":
        index = chosen.index or 0
        if index >= gpus:
            seen = f"{gpus} GPU(s), cuda:0 to cuda:{gpus - 1}" if gpus else "no GPU"
            raise ValueError(f"{name}={device!r}: torch sees {seen} here")
        return torch.device("cuda", index)
    return chosen


def precision_context(precision: str, device: torch.device):
    """bf16 autocast on ``device`` for ``"bf16"``; nothing for ``"fp32"``; ``"auto"`` as
    :func:`resolve_precision` decides. bf16 asked for by name on a CPU where torch has no fast
    bf16 products (:func:`attnkit.accel.bf16_products_fast`) warns, once."""
    precision = resolve_precision(precision, device)
    if precision == "bf16":
        if device.type == "cpu" and not accel.bf16_products_fast():
            warnings.warn(SLOW_BF16, RuntimeWarning, stacklevel=2)
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def step_context(precision: str, device: torch.device):
    """What a training or evaluation forward runs under: the precision, and, once per process,
    :func:`attnkit.accel.keep_freed_memory`. The other levers are in the model itself
    (``accel.prepare``)."""
    accel.keep_freed_memory()
    with precision_context(precision, device):
        yield


def train_config_fields() -> list[str]:
    """The names of TrainConfig's fields, in order (for help texts and recipe errors)."""
    return [f.name for f in fields(TrainConfig)]


def make_optimizer(
    config: TrainConfig, model: nn.Module, pretrained: Collection[str] = ()
) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over the parameters that need a gradient; weight decay on matrices (dim >= 2)
    only, never on biases or norm gains. The parameters named in ``pretrained`` (loaded by
    model.init) form groups of their own whose ``lr_scale`` is ``config.pretrained_lr_scale``
    (the trainer sets each group's lr to the schedule's times it). Also returns the parameter
    names in the optimizer's order (group after group)."""
    kinds: dict[tuple[bool, float], list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():  # a tied weight comes once
        if param.requires_grad:
            scale = config.pretrained_lr_scale if name in pretrained else 1.0
            kinds.setdefault((param.dim() >= 2, scale), []).append((name, param))
    order = sorted(kinds, key=lambda kind: (not kind[0], -kind[1]))  # decay first, as before
    groups = [
        {
            "params": [p for _, p in kinds[kind]],
            "weight_decay": config.weight_decay if kind[0] else 0.0,
            "lr_scale": kind[1],
        }
        for kind in order
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps
    )
    return optimizer, [name for kind in order for name, _ in kinds[kind]]
