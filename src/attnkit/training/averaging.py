"""Checkpoint averaging: the model whose every weight is the mean of the same weight in the last
few checkpoints of a run.

The paper (section 6.1) evaluates its base models "obtained by averaging the last 5 checkpoints,
which were written at 10-minute intervals". Late in training the weights wander around a
minimum with the noise of the mini-batches; their mean usually sits nearer the middle of it than
any one of them does, which is worth a fraction of a BLEU point to a point, for free::

    theta_avg = (theta_1 + theta_2 + ... + theta_n) / n        (element-wise, every tensor)

With ``train.keep_checkpoints = N`` a run keeps the models of its last N checkpoints in
``RUN/checkpoints/step-*``; :func:`average_models` (``attnkit average``) writes their mean as an
ordinary model directory. The sum runs in float64, then each tensor goes back to its own dtype;
integer tensors (none in attnkit's models today) must agree exactly and are copied.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.files import atomic_directory, read_json
from attnkit.serialization import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from attnkit.training.checkpoint import read_recipe, snapshots, write_recipe

__all__ = ["average_models", "models_to_average"]


def models_to_average(
    paths: Sequence[str | os.PathLike[str]], last: int | None = None
) -> list[Path]:
    """The model directories named by ``paths``, in order: a model directory stands for itself;
    a run directory or its ``checkpoints/`` for the snapshots kept there (oldest first). With
    ``last``, only the last ``last`` of them."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if (path / CONFIG_FILE).is_file():
            found.append(path)
            continue
        kept = snapshots(path.parent if path.name == "checkpoints" else path)
        if not kept:
            raise FileNotFoundError(
                f"{path}: neither a model directory (no {CONFIG_FILE}) nor a run directory with "
                "kept checkpoints (checkpoints/step-*; train with train.keep_checkpoints = N)"
            )
        found.extend(kept)
    if last is not None:
        if last < 1:
            raise ValueError(f"last must be a positive integer, got {last}")
        found = found[-last:]
    return found


def _config_of(path: Path) -> dict:
    data = read_json(path / CONFIG_FILE)
    return {"attnkit": data.get("attnkit"), "config": data.get("config")}


def average_models(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Write to ``out`` (atomically) the element-wise mean of the models in ``paths`` (model
    directories of one architecture). Config, tokenizer and recipe (:func:`read_recipe`) come
    from the last one;
    differing configs, tokenizers, tensor names, shapes or dtypes are refused by name."""
    models = [Path(p) for p in paths]
    if not models:
        raise ValueError("average_models: no models to average")
    first, last = models[0], models[-1]
    config = _config_of(first)
    tokenizers = {
        (m / TOKENIZER_FILE).read_bytes() if (m / TOKENIZER_FILE).is_file() else None
        for m in models
    }
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    metadata = None
    for model in models:
        if _config_of(model) != config:
            raise ValueError(
                f"average_models: {model} has another architecture than {first} "
                "(config.json differs)"
            )
        if not (model / WEIGHTS_FILE).is_file():
            raise ValueError(f"average_models: {model} has no {WEIGHTS_FILE}")
        with safe_open(str(model / WEIGHTS_FILE), framework="pt") as weights:
            metadata = weights.metadata() if metadata is None else metadata
            names = set(weights.keys())
            if sums and names != set(sums):
                differ = sorted(names ^ set(sums))[:3]
                raise ValueError(f"average_models: {model} and {first} differ in tensors {differ}")
            for name in names:
                tensor = weights.get_tensor(name)
                if name not in sums:
                    dtypes[name] = tensor.dtype
                    sums[name] = (
                        tensor.to(torch.float64) if tensor.is_floating_point() else tensor.clone()
                    )
                elif tensor.shape != sums[name].shape or tensor.dtype != dtypes[name]:
                    raise ValueError(
                        f"average_models: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype} "
                        f"in {model}, {tuple(sums[name].shape)} {dtypes[name]} in {first}"
                    )
                elif tensor.is_floating_point():
                    sums[name] += tensor
                elif not torch.equal(tensor, sums[name]):
                    hint = "; quantized blocks do not average: average the float32 models, then "
                    raise ValueError(
                        f"average_models: integer tensor {name!r} differs in {first} and {model}"
                        + (hint + "quantize" if name.endswith(".blocks") else "")
                    )
    if len(tokenizers) > 1:
        raise ValueError("average_models: the models have different tokenizers")
    mean = {
        name: (total / len(models)).to(dtypes[name]) if total.is_floating_point() else total
        for name, total in sums.items()
    }
    with atomic_directory(out) as tmp:
        save_file(mean, str(tmp / WEIGHTS_FILE), metadata=metadata)
        for name in (CONFIG_FILE, TOKENIZER_FILE):
            if (last / name).is_file():
                shutil.copyfile(last / name, tmp / name)
        recipe = read_recipe(last)
        if recipe is not None:
            write_recipe(tmp, recipe)
    return Path(out)
