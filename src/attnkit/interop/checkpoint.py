"""The weights of a Hugging Face model directory, read from safetensors and never unpickled.

Two layouts::

    dir/model.safetensors                       one file
    dir/model.safetensors.index.json            sharded: {"weight_map": {tensor name: shard file}}
    dir/model-00001-of-00002.safetensors ...

Files are opened with ``safetensors.safe_open``, which checks the header against the file (sizes,
offsets, dtypes) before a byte of tensor data is read; a file that is truncated or whose header
lies is a ValueError naming the file. A ``pytorch_model.bin`` is refused: it is a pickle, and
unpickling runs code.

The tensors come back as a :class:`Tensors`, from which a mapping takes each tensor it needs by
name, with its expected shape: a missing tensor, a wrong shape or a tensor that no mapping took
is a ValueError naming the file and the tensor, never a silently wrong model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from attnkit.files import read_json

__all__ = [
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "Tensors",
    "read_hf_weights",
    "read_safetensors",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "tf_model.h5")


class Tensors:
    """Named tensors from one checkpoint, taken out one by one with their shapes checked.

    ``origin`` maps each name to the file it came from (for error messages).
    """

    def __init__(
        self, tensors: dict[str, Tensor], origin: dict[str, str] | str, *, flat: bool = False
    ) -> None:
        self._tensors = dict(tensors)
        self.flat = flat  # the file stores tensors flat: each takes the shape asked of it
        self._origin = (
            dict.fromkeys(self._tensors, origin) if isinstance(origin, str) else dict(origin)
        )
        self.source = origin if isinstance(origin, str) else _common_source(self._origin)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def rename(self, rename: Callable[[str], str]) -> Tensors:
        """The same tensors under new names (``rename`` must not merge two names)."""
        renamed: dict[str, Tensor] = {}
        origin: dict[str, str] = {}
        for name, tensor in self._tensors.items():
            new = rename(name)
            if new in renamed:
                raise ValueError(f"{self.source}: two tensors map to the name {new!r}")
            renamed[new] = tensor
            origin[new] = self._origin[name]
        return Tensors(renamed, origin, flat=self.flat)

    def take(self, name: str, shape: Iterable[int]) -> Tensor:
        """The tensor ``name`` as float32, checked to have ``shape``; it counts as used."""
        shape = tuple(shape)
        if name not in self._tensors:
            raise ValueError(
                f"{self.source}: the tensor {name!r} is missing (expected shape {shape}); the "
                "weights do not fit config.json"
            )
        tensor = self._tensors.pop(name)
        if self.flat and tensor.dim() == 1 and tensor.numel() == math.prod(shape):
            tensor = tensor.reshape(shape)
        where = self._origin[name]
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: the tensor {name!r} has dtype {tensor.dtype}; expected floating point"
            )
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{where}: the tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} "
                "from config.json"
            )
        return tensor.to(torch.float32).contiguous()

    def discard(self, keep: Callable[[str], bool]) -> None:
        """Drop the tensors for which ``keep`` is false (buffers, heads attnkit leaves out)."""
        for name in [n for n in self._tensors if not keep(n)]:
            del self._tensors[name]

    def check_all_used(self) -> None:
        """Refuse tensors no mapping took: they mean the weights are not what the config says."""
        if self._tensors:
            names = sorted(self._tensors)
            raise ValueError(
                f"{self.source}: {len(names)} tensor(s) that attnkit does not know how to place, "
                f"e.g. {names[:4]}; the checkpoint does not match its config.json"
            )


def _common_source(origin: dict[str, str]) -> str:
    files = sorted(set(origin.values()))
    if len(files) == 1:
        return files[0]
    return f"{Path(files[0]).parent / INDEX_FILE}" if files else "<no tensors>"


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file (read with ``safe_open``, nothing unpickled)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a valid safetensors file ({error})") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read the file ({error})") from None


def _read_sharded(directory: Path) -> Tensors:
    index_path = directory / INDEX_FILE
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: expected a non-empty 'weight_map' object")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ValueError(
                f"{index_path}: the shard of {name!r} must be a file name in the directory, "
                f"got {shard!r}"
            )
        shards.setdefault(shard, []).append(name)
    tensors: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    for shard, names in shards.items():
        shard_path = directory / shard
        if not shard_path.is_file():
            raise FileNotFoundError(f"{shard_path}: no such file (listed in {index_path})")
        found = read_safetensors(shard_path)
        for name in names:
            if name not in found:
                raise ValueError(
                    f"{shard_path}: the tensor {name!r} is missing (listed in {index_path})"
                )
        unlisted = sorted(set(found) - set(names))
        if unlisted:
            raise ValueError(
                f"{shard_path}: holds tensor(s) {unlisted[:4]} that {index_path} does not list "
                "for this shard"
            )
        for name in names:
            tensors[name] = found[name]
            origin[name] = str(shard_path)
    return Tensors(tensors, origin)


def read_hf_weights(directory: str | Path) -> Tensors:
    """The weights of a Hugging Face model directory: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists."""
    directory = Path(directory)
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return Tensors(read_safetensors(single), str(single))
    if (directory / INDEX_FILE).is_file():
        return _read_sharded(directory)
    pickles = [name for name in _PICKLES if (directory / name).exists()]
    if pickles:
        raise ValueError(
            f"{directory}: the weights are in {pickles[0]}, a format attnkit does not read "
            "(pickle files can run code when loaded); convert them to safetensors"
        )
    raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} (and no {INDEX_FILE})")
