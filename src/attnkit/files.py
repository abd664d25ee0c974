"""Atomic writes: a file (a report, a picture, a tokenizer, a log) or a directory (a model, a
checkpoint) is either the old one or the whole new one, never half; and the directory where
attnkit keeps what it worked out once (:func:`cache_dir`).

Each writer puts its bytes in a temporary file in the destination's own directory (so the rename
never crosses a file system) and then ``os.replace``-s it over the destination, which is atomic
on POSIX and on Windows. If writing fails, the temporary file is removed and the destination is
left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "atomic_directory",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "cache_dir",
    "read_json",
]


def cache_dir(part: str) -> Path:
    """Where attnkit keeps what it worked out once (a GGUF vocabulary's merges):
    ``~/.cache/attnkit/PART``, or ``$ATTNKIT_CACHE/PART``."""
    root = os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit"
    return Path(root) / part


def _destination(path: str | os.PathLike[str], owner: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{owner}: path must be a str or os.PathLike, got {type(path).__name__}")
    dest = Path(path)
    if dest.is_dir():
        raise ValueError(f"{owner}: path {str(dest)!r} is a directory, expected a file name")
    if not dest.parent.is_dir():
        raise ValueError(
            f"{owner}: the directory {str(dest.parent)!r} of path {str(dest)!r} does not exist"
        )
    return dest


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read the umask is to set it and put it back
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], owner: str = "write") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically.

    >>> with atomic_path("plot.png") as tmp:   # doctest: +SKIP
    ...     figure.savefig(tmp, format="png")
    """
    dest = _destination(path, owner)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp makes the file private (0600); give it the mode a plain open() would have.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike[str], text: str, owner: str = "write") -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return the destination path."""
    return atomic_write_bytes(path, text.encode("utf-8"), owner)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, owner: str = "write") -> Path:
    """Write ``data`` to ``path`` atomically, flushed to the disk before the rename."""
    with atomic_path(path, owner) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces ``path`` by a rename.

    If the body raises, ``path`` is left as it was and the temporary directory is removed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        umask = _umask()
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


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; FileNotFoundError / ValueError naming the file otherwise."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
