"""Choices made by measuring, kept per machine so that every process makes the same one.

A lever that is on "where it measures faster" must not flip between two processes on the same
machine (a server and the test that checks its numbers, the ranks of a distributed run): a
close race would otherwise give each its own arithmetic. :func:`remembered` measures once per
key (the processor, the thread count, whatever else the choice depends on) and keeps the
result in ``~/.cache/attnkit/kernels/NAME.json`` (``ATTNKIT_CACHE`` moves it), under a lock so
that processes starting together measure once and agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: processes measuring at once may each write their own
    fcntl = None

__all__ = ["cache_dir", "machine_key", "processor", "remembered"]


def cache_dir(part: str = "kernels") -> Path:
    """Where attnkit keeps what it worked out once: ``~/.cache/attnkit/PART`` (``ATTNKIT_CACHE``
    moves it); measured choices under ``kernels``."""
    root = os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit"
    return Path(root) / part


def processor() -> str:
    """The processor's model name and instruction-set flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def machine_key() -> str:
    """The processor (its name and a hash of its flags), torch's version and thread count."""
    cpu = processor()
    name = cpu.splitlines()[0].partition(":")[2].strip() if ":" in cpu else cpu
    flags = hashlib.sha256(cpu.encode()).hexdigest()[:8]
    return f"{name} ({flags}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def remembered(name: str, key: str, measure: Callable[[], dict]) -> dict:
    """The result of ``measure()`` kept under ``key`` in the file ``NAME.json``: read if there,
    else measured and written (atomically, under a lock). With ``"file"`` added: where it is
    kept. A read-only home: measured for this process alone."""
    path = cache_dir() / f"{name}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                known = json.loads(path.read_text())
            except (OSError, ValueError):
                known = {}
            if key not in known:
                known[key] = measure()
                scratch = path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_text(json.dumps(known, indent=1))
                scratch.replace(path)  # atomic: a reader never sees half a file
            return {**known[key], "file": str(path)}
    except OSError:
        return measure()
