"""Training checkpoints: one directory that is a loadable model *and* a resumable run.

::

    checkpoint/
      config.json             \\  exactly what ``model.save_pretrained`` writes, so
      model.safetensors        >  ``attnkit.from_pretrained(checkpoint)`` and
      tokenizer.json          /   ``attnkit generate checkpoint "prompt"`` work on it
      optimizer.safetensors   every tensor of the optimizer state ("state.<i>.exp_avg", ...)
      optimizer.json          the rest of it: param groups (lr, betas, ...) and scalar state
      trainer_state.json      step, epoch, position in the epoch, tokens seen, the torch RNG
                              state (base64 of its uint8 tensor), the task and the recipe
    checkpoints/step-0004000/ with ``train.keep_checkpoints = N``: the model alone (config,
                              weights, tokenizer, and the recipe as recipe.json) of each of
                              the last N checkpoints, for ``attnkit average``

Nothing is pickled: tensors go to safetensors, everything else to JSON. The directory is built
in a temporary sibling and renamed into place (:func:`attnkit.files.atomic_directory`), so a
crash or a kill part-way leaves the previous checkpoint as it was. One window remains: between
the two renames that swap the old directory for the new one, only the old one exists, under
the name ``.checkpoint.old-<pid>``; :func:`find_checkpoint` puts it back.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file
from torch import Tensor, nn

from attnkit.files import atomic_directory, read_json
from attnkit.serialization import CONFIG_FILE, WEIGHTS_FILE, write_pretrained

__all__ = [
    "CHECKPOINT_DIR",
    "RECIPE_FILE",
    "CheckpointError",
    "TrainerState",
    "find_checkpoint",
    "keep_snapshot",
    "load_checkpoint",
    "optimizer_state_from_tensors",
    "optimizer_state_to_tensors",
    "read_optimizer_state",
    "read_recipe",
    "read_trainer_state",
    "restore_rng",
    "save_checkpoint",
    "snapshots",
    "write_recipe",
]

FORMAT = 1
CHECKPOINT_DIR = "checkpoint"
SNAPSHOTS_DIR = "checkpoints"
RECIPE_FILE = "recipe.json"  # in kept snapshots and averaged models: the run's recipe
OPTIMIZER_TENSORS, OPTIMIZER_JSON = "optimizer.safetensors", "optimizer.json"
STATE_FILE = "trainer_state.json"
REQUIRED = (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_TENSORS, OPTIMIZER_JSON, STATE_FILE)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or does not fit the run."""


@dataclass
class TrainerState:
    """Where a run stands. ``step`` updates are done; the next batch is ``batch_in_epoch`` of
    ``epoch`` (for the LM task, ``PackedBlocks.batch(epoch, batch_in_epoch, B)``)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time so far, over all sessions
    last_validation: dict[str, float] | None = None
    torch_rng: str = ""  # base64 of torch.get_rng_state(), filled in by save_checkpoint
    # and of torch.cuda.get_rng_state() (this process's GPU), where the run has used CUDA:
    # dropout on a GPU draws from the GPU's own generator
    cuda_rng: str = ""
    task: dict[str, Any] = field(default_factory=dict)  # what Task.describe() says
    recipe: dict[str, Any] | None = None  # the recipe the run was started with, if any

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = STATE_FILE) -> TrainerState:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{source}: not an attnkit trainer state of format {FORMAT}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# --------------------------------------------------------------------------------------------
# Optimizer state <-> (tensors, JSON)
# --------------------------------------------------------------------------------------------


def optimizer_state_to_tensors(
    optimizer: torch.optim.Optimizer | dict[str, Any],
) -> tuple[dict[str, Tensor], dict]:
    """Split ``optimizer.state_dict()`` (or such a dict) into a flat dict of tensors and a
    JSON-able rest.

    ``{"state": {0: {"step": t, "exp_avg": t, ...}, ...}, "param_groups": [...]}`` becomes
    tensors ``{"state.0.step": t, "state.0.exp_avg": t, ...}`` and JSON
    ``{"state": {"0": {"step": {"tensor": "state.0.step"}, ...}}, "param_groups": [...]}``.
    """
    state_dict = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        state[str(index)] = {}
        for name, value in entries.items():
            if isinstance(value, Tensor):
                key = f"state.{index}.{name}"
                tensors[key] = value.detach().contiguous().clone()
                state[str(index)][name] = {"tensor": key}
            else:
                state[str(index)][name] = value
    return tensors, {"state": state, "param_groups": state_dict["param_groups"]}


def optimizer_state_from_tensors(tensors: dict[str, Tensor], meta: dict) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_to_tensors`: a dict for ``load_state_dict``."""
    state: dict[int, dict[str, Any]] = {}
    for index, entries in meta["state"].items():
        state[int(index)] = {
            name: tensors[value["tensor"]] if isinstance(value, dict) else value
            for name, value in entries.items()
        }
    groups = []
    for group in meta["param_groups"]:
        group = dict(group)
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # JSON has no tuples
        groups.append(group)
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------


def _encode_rng(state: Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode_rng(text: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_rng(state: TrainerState) -> None:
    """Put back the torch RNG states saved in ``state``, the CPU's and (where saved and a GPU
    is here) the GPU's: dropout continues the same."""
    if state.torch_rng:
        torch.set_rng_state(_decode_rng(state.torch_rng))
    if state.cuda_rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode_rng(state.cuda_rng))


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: TrainerState,
    tokenizer=None,
    keep_snapshots: int = 0,
) -> Path:
    """Write the checkpoint directory atomically (see the module docstring); return its path.
    ``optimizer`` is the optimizer or its ``state_dict()`` (what a sharded run gathers). With
    ``keep_snapshots = N`` the model also goes to ``checkpoints/step-<step>`` beside it, of
    which the last N are kept (:func:`keep_snapshot`).

    The model part is written by :func:`attnkit.serialization.write_pretrained`, so it is
    byte for byte what ``model.save_pretrained(directory, tokenizer=tokenizer)`` writes.
    """
    state.torch_rng = _encode_rng(torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never starts CUDA
        state.cuda_rng = _encode_rng(torch.cuda.get_rng_state())
    tensors, meta = optimizer_state_to_tensors(optimizer)
    with atomic_directory(directory) as tmp:  # one temporary directory, renamed at the end
        write_pretrained(model, tmp, tokenizer=tokenizer)
        save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
        (tmp / OPTIMIZER_JSON).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        (tmp / STATE_FILE).write_text(state.to_json(), encoding="utf-8")
    if keep_snapshots:
        run_dir = Path(directory).parent
        keep_snapshot(
            run_dir, model, state.step, keep_snapshots, tokenizer=tokenizer, recipe=state.recipe
        )
    return Path(directory)


def read_trainer_state(directory: str | os.PathLike[str]) -> TrainerState:
    """The trainer state of a checkpoint, without loading any tensor."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{directory}: no {STATE_FILE}; not a training checkpoint (a model directory "
            "without its run state)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    return TrainerState.from_dict(data, str(path))


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainerState:
    """Load the weights into ``model`` (and the state into ``optimizer``); return the trainer
    state. The RNG is not touched: call :func:`restore_rng` when the run really continues."""
    directory = Path(directory)
    missing = [name for name in REQUIRED if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: incomplete checkpoint, missing {missing}")
    state = read_trainer_state(directory)
    try:
        load_model(model, str(directory / WEIGHTS_FILE), strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(read_optimizer_state(directory))
    except (SafetensorError, OSError, RuntimeError, KeyError, ValueError) as error:
        raise CheckpointError(
            f"{directory}: the checkpoint does not fit this run ({error})"
        ) from None
    return state


def read_optimizer_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The optimizer state of a checkpoint, as ``optimizer.state_dict()`` gives it."""
    directory = Path(directory)
    tensors = load_file(str(directory / OPTIMIZER_TENSORS))
    meta = json.loads((directory / OPTIMIZER_JSON).read_text(encoding="utf-8"))
    return optimizer_state_from_tensors(tensors, meta)


def find_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """``run_dir/checkpoint`` if it exists (None otherwise), after tidying up a killed write.

    Temporary directories of an unfinished write (``.checkpoint.tmp-*``, and the nested
    ``..checkpoint.tmp-*`` that earlier versions could leave) are removed. If the
    checkpoint itself is missing but a previous one waits under ``.checkpoint.old-*`` (a kill
    between the two renames of the swap), that one is renamed back into place.
    """
    run_dir = Path(run_dir)
    target = run_dir / CHECKPOINT_DIR
    if not run_dir.is_dir():
        return None
    # ".checkpoint.tmp-*" is an unfinished write; "..checkpoint.tmp-*" the nested temporaries
    # that earlier versions (which wrote the model part atomically inside it) could leave.
    for pattern in (f".{CHECKPOINT_DIR}.tmp-*", f"..{CHECKPOINT_DIR}.tmp-*"):
        for leftover in run_dir.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    olds = sorted(run_dir.glob(f".{CHECKPOINT_DIR}.old-*"), key=lambda p: p.stat().st_mtime)
    if not target.exists() and olds:
        os.replace(olds.pop(), target)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
    return target if target.is_dir() else None


def write_recipe(directory: str | os.PathLike[str], recipe: dict[str, Any]) -> None:
    """``recipe`` as ``directory/recipe.json``: what data a model directory was trained on."""
    text = json.dumps(recipe, indent=2, ensure_ascii=False) + "\n"
    (Path(directory) / RECIPE_FILE).write_text(text, encoding="utf-8")


def read_recipe(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The recipe a model directory was trained with, or None: from a checkpoint's
    trainer_state.json, a recipe.json, or (for a kept snapshot ``RUN/checkpoints/step-N``)
    the run's ``RUN/checkpoint``."""
    path = Path(directory)
    if (path / STATE_FILE).is_file():
        return read_trainer_state(path).recipe
    if (path / RECIPE_FILE).is_file():
        return read_json(path / RECIPE_FILE)
    run_checkpoint = path.parent.parent / CHECKPOINT_DIR
    if path.parent.name == SNAPSHOTS_DIR and (run_checkpoint / STATE_FILE).is_file():
        return read_trainer_state(run_checkpoint).recipe
    return None


def snapshots(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The kept model snapshots of a run (``checkpoints/step-*``), oldest first."""
    root = Path(run_dir) / SNAPSHOTS_DIR
    found = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def keep_snapshot(
    run_dir: str | os.PathLike[str],
    model: nn.Module,
    step: int,
    keep: int,
    *,
    tokenizer=None,
    recipe: dict[str, Any] | None = None,
) -> Path:
    """Save the model (and ``recipe`` as recipe.json) as ``checkpoints/step-<step>``,
    atomically; then delete all but the last ``keep`` snapshots, and any snapshot past ``step``
    (left by a run that was resumed from an earlier checkpoint)."""
    target = Path(run_dir) / SNAPSHOTS_DIR / f"step-{step:07d}"
    for old in snapshots(run_dir):
        if int(old.name[5:]) > step:
            shutil.rmtree(old)
    with atomic_directory(target) as tmp:
        write_pretrained(model, tmp, tokenizer=tokenizer)
        if recipe is not None:
            write_recipe(tmp, recipe)
    for old in snapshots(run_dir)[:-keep]:
        shutil.rmtree(old)
    return target
