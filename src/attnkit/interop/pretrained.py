"""attnkit's own model directories, and ``from_pretrained`` for every kind of weights.

``from_pretrained(path)`` asks each registered loader in :data:`LOADERS` whether it recognises
``path`` (Hugging Face directories: :mod:`attnkit.interop.hf`; GGUF files:
:mod:`attnkit.interop.gguf`), and otherwise reads attnkit's own directory format.

A directory written by ``model.save_pretrained(dir)``::

    dir/config.json         {"attnkit": {"format": 1, "family": ..., ...}, "config": {...}}
    dir/model.safetensors   the weights (a tied matrix is stored once)
    dir/tokenizer.json      the tokenizer, when one was given

The directory is written next to its final place and renamed into it, so a crash never leaves a
half-written model where a good one was. Nothing is ever unpickled: weights are safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn

from attnkit.config import ModelConfig
from attnkit.interop.gguf import is_gguf_file, load_gguf
from attnkit.interop.hf import is_hf_directory, load_hf_directory
from attnkit.models import DecoderLM, EncoderClassifier, EncoderModel, Transformer

__all__ = [
    "LOADERS",
    "atomic_directory",
    "from_pretrained",
    "load_tokenizer_for",
    "save_pretrained",
]

FORMAT = 1
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"

_FAMILIES: dict[str, type[nn.Module]] = {
    "encoder-only": EncoderModel,
    "encoder-classifier": EncoderClassifier,
    "encoder-decoder": Transformer,
    "decoder-only": DecoderLM,
}

# Loaders for other layouts register here: (name, recognises(path), load(path)).
LOADERS: list[tuple[str, Callable[[Path], bool], Callable[[Path], nn.Module]]] = [
    ("Hugging Face directories (bert, gpt2, llama)", is_hf_directory, load_hf_directory),
    ("GGUF files (llama)", is_gguf_file, load_gguf),
]


@contextmanager
def atomic_directory(path: str | os.PathLike[str]):
    """Yield a fresh temporary directory; on success it replaces ``path`` by a rename.

    If the body raises, ``path`` is left as it was and the temporary directory is removed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        umask = os.umask(0o022)  # read the umask (only settable), then put it back
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a model directory is for sharing
        for child in tmp.rglob("*"):
            os.chmod(child, (0o777 if child.is_dir() else 0o666) & ~umask)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _family(model: nn.Module) -> str:
    if isinstance(model, EncoderClassifier):
        return "encoder-classifier"
    family = getattr(model, "family", None)
    if family not in _FAMILIES:
        raise TypeError(f"save_pretrained: not an attnkit model: {type(model).__name__}")
    return family


def write_pretrained(model: nn.Module, directory: Path, *, tokenizer=None) -> None:
    """Write config.json + model.safetensors (+ tokenizer.json) into an existing directory,
    not atomically: for writers (training checkpoints) that make their own directory atomic."""
    family = _family(model)
    meta: dict[str, Any] = {"format": FORMAT, "family": family}
    if isinstance(model, EncoderClassifier):
        meta["num_classes"] = model.classifier.out_features
        meta["pooling"] = model.pooling
        if model.labels is not None:
            meta["labels"] = list(model.labels)
    (directory / CONFIG_FILE).write_text(
        json.dumps({"attnkit": meta, "config": model.cfg.to_dict()}, indent=2) + "\n"
    )
    save_model(model, str(directory / WEIGHTS_FILE))
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)


def save_pretrained(model: nn.Module, directory: str | os.PathLike[str], *, tokenizer=None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json) to ``directory``, atomically."""
    _family(model)  # refuse a non-attnkit model before creating anything
    with atomic_directory(directory) as tmp:
        write_pretrained(model, tmp, tokenizer=tokenizer)
    return Path(directory)


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a model directory)")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_attnkit(path: Path, data: dict[str, Any]) -> nn.Module:
    meta = data["attnkit"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path / CONFIG_FILE}: unsupported attnkit format {meta!r}")
    family = meta.get("family")
    if family not in _FAMILIES:
        raise ValueError(
            f"{path / CONFIG_FILE}: unknown family {family!r}; expected one of {sorted(_FAMILIES)}"
        )
    try:
        cfg = ModelConfig.from_dict(data.get("config"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path / CONFIG_FILE}: {error}") from None
    if family == "encoder-classifier":
        model = EncoderClassifier(
            cfg,
            meta.get("num_classes"),
            pooling=meta.get("pooling", "cls"),
            labels=meta.get("labels"),
        )
    else:
        model = _FAMILIES[family](cfg)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"{weights}: cannot read the weights ({error})") from None
    if missing or unexpected:
        raise ValueError(
            f"{weights}: the weights do not fit the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()


def from_pretrained(path: str | os.PathLike[str]) -> nn.Module:
    """Load a model, in eval mode: a directory that ``save_pretrained`` wrote, or any layout a
    registered loader recognises (Hugging Face directories, GGUF files)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    for _name, recognises, load in LOADERS:
        if recognises(path):
            return load(path)
    if path.is_dir():
        data = _read_config(path)
        if "attnkit" in data:
            return _load_attnkit(path, data)
        found = data.get("model_type") or data.get("architectures") or "unknown"
        raise ValueError(
            f"{path}: model type {found!r} is not supported; attnkit reads its own directories"
            + "".join(f", {name}" for name, _, _ in LOADERS)
        )
    raise ValueError(f"{path}: not a model directory and not a file type attnkit can read")


def _is_attnkit_tokenizer(path: Path) -> bool:
    """attnkit's char tokenizer, or a BPE one with attnkit's special tokens at ids 0-4."""
    from attnkit.data.tokenizer import SPECIAL_TOKENS

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True  # let attnkit's loader report the problem
    if not isinstance(data, dict) or "attnkit_tokenizer" in data:
        return True
    added = data.get("added_tokens")
    contents = {t.get("id"): t.get("content") for t in added or [] if isinstance(t, dict)}
    return all(contents.get(i) == token for i, token in enumerate(SPECIAL_TOKENS))


def load_tokenizer_for(path: str | os.PathLike[str]):
    """The tokenizer stored with a model, or None when there is none.

    - a GGUF file: the tokenizer its ``tokenizer.ggml.*`` metadata describe;
    - a Hugging Face directory: its ``tokenizer.json`` as a
      :class:`~attnkit.interop.tokenizer.PretrainedTokenizer` (special ids from the files);
    - an attnkit directory: its ``tokenizer.json`` through :func:`attnkit.data.load_tokenizer`
      (attnkit's char or BPE tokenizers, special ids 0-4), or, for any other ``tokenizers``
      JSON (a pretrained model's tokenizer saved with it), a ``PretrainedTokenizer``.
    """
    from attnkit.data import load_tokenizer
    from attnkit.interop.tokenizer import (
        PretrainedTokenizer,
        load_hf_tokenizer,
        tokenizer_from_gguf,
    )

    path = Path(path)
    if is_gguf_file(path):
        return tokenizer_from_gguf(path)
    candidate = path / TOKENIZER_FILE if path.is_dir() else None
    if candidate is None or not candidate.is_file():
        return None
    if is_hf_directory(path):
        return load_hf_tokenizer(path)
    if _is_attnkit_tokenizer(candidate):
        return load_tokenizer(candidate)
    return PretrainedTokenizer.from_file(candidate)
