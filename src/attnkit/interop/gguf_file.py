"""Reading a GGUF file (llama.cpp's format): its metadata and its tensors, over a memory map.

The layout is llama.cpp's ``gguf.md``: magic, version, tensor and key counts, the keys (name,
type, value), the tensor directory (name, dims, type, offset), then the data at
``general.alignment``. :func:`read_gguf` parses it; what the tensors mean for a model is
:mod:`attnkit.interop.gguf`'s business.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAGIC", "GGUFFile", "GGUFTensor", "read_gguf"]

MAGIC = b"GGUF"

# GGUF metadata value types (the file format's numbering) -> struct format ("" for strings)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor's directory entry, and its bytes as a numpy view of the memory-mapped file
    (float types as their dtype, block quantizations as uint8 rows of blocks): the same
    ``name``, ``tensor_type``, ``shape`` (ne0 first) and ``data`` as ``gguf.GGUFReader``'s."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


@dataclass
class GGUFFile:
    """A parsed GGUF file: ``metadata`` (every key, as plain Python values) and ``tensors``."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


_LENGTH = struct.Struct("<Q")  # a string's length


class _Cursor:
    """Reads little-endian values from a buffer, failing with a clear error at its end."""

    def __init__(self, buffer, source: str) -> None:
        # a memoryview: slicing it is cheap, where slicing a numpy memmap builds an object
        self.buffer, self.at, self.source = memoryview(buffer).cast("B"), 0, source

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buffer):
            raise ValueError(f"it ends at byte {len(self.buffer)}, inside its header")
        value = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a length, then UTF-8 bytes), read in one loop."""
        view, at, end, length = self.buffer, self.at, len(self.buffer), _LENGTH.unpack_from
        out = []
        for _ in range(count):
            if at + 8 > end:
                raise ValueError(f"it ends at byte {end}, inside its header")
            (n,) = length(view, at)
            at += 8
            if at + n > end:
                raise ValueError(f"a string of {n} bytes runs past the end of the file")
            out.append(str(view[at : at + n], "utf-8", "replace"))
            at += n
        self.at = at
        return out

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALARS and item != 7:  # numbers: one numpy read, not count struct calls
                dtype = np.dtype("<" + _SCALARS[item])
                if self.at + count * dtype.itemsize > len(self.buffer):
                    raise ValueError(f"an array of {count} numbers runs past the end of the file")
                array = np.frombuffer(self.buffer, dtype, count, self.at)
                self.at += count * dtype.itemsize
                return array.tolist()
            if item == _STRING:  # a tokenizer's vocabulary and merges: hundreds of thousands
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file (version 2 or 3): its metadata and its tensors, memory-mapped.

    ``gguf.GGUFReader`` reads the same, but builds a numpy view for every part of every value,
    which takes seconds for a tokenizer of 49k tokens and 48k merges; this reads strings with
    ``struct`` and numbers with one ``np.frombuffer`` per array (tested to agree with
    ``GGUFReader`` on every key and tensor). The result is cached per file (path, size,
    modification time), so the model, its tokenizer and its chat template parse the file
    once. A malformed or truncated file is a ValueError.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _PARSED:
        _PARSED.clear()  # one file at a time: the tensors are views of its memory map
        _PARSED[key] = _parse(path)
    return _PARSED[key]


_PARSED: dict[tuple, GGUFFile] = {}


def _parse(path: Path) -> GGUFFile:
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    # copy-on-write: the pages stay the file's (shared, read on demand), and the arrays are
    # writable, so packed layers can hold them as tensors without a copy
    buffer = np.memmap(path, dtype=np.uint8, mode="c")
    cursor = _Cursor(buffer, str(path))
    try:
        cursor.take("I")  # the magic
        version = cursor.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; attnkit reads versions 2 and 3")
        n_tensors, n_keys = cursor.take("Q"), cursor.take("Q")
        metadata = {}
        for _ in range(n_keys):
            name = cursor.string()
            metadata[name] = cursor.value(cursor.take("I"))
        entries = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.take("Q") for _ in range(cursor.take("I"))]
            entries.append((name, dims, cursor.take("I"), cursor.take("Q")))
        alignment = metadata.get("general.alignment", 32)
        start = -(-cursor.at // alignment) * alignment
        tensors = []
        for name, dims, raw_type, offset in entries:
            try:
                kind = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(
                    f"the tensor {name!r} has unknown type number {raw_type}"
                ) from None
            block, size = gguf.GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims))
            shape = tuple(reversed(dims))
            dtype = _FLOAT_TYPES.get(kind.name)
            begin = start + offset
            n_bytes = n * size // block
            if begin + n_bytes > len(buffer):
                raise ValueError(
                    f"the tensor {name!r} needs bytes {begin}-{begin + n_bytes}, but the file "
                    f"has {len(buffer)}"
                )
            if dtype is not None:
                data = np.frombuffer(buffer, dtype, n, begin).reshape(shape)
            else:  # blocks: (rows..., bytes per row)
                data = buffer[begin : begin + n_bytes].reshape(
                    gguf.quant_shape_to_byte_shape(shape, kind)
                )
            tensors.append(GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), data))
    except (ValueError, struct.error, OverflowError, MemoryError) as error:
        raise ValueError(f"{path}: a malformed or truncated GGUF file ({error})") from None
    return GGUFFile(path, metadata, tensors)


_FLOAT_TYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}
