"""Keep freed memory in the process, so that a training step stops paying page faults.

glibc's ``malloc`` serves every block above its mmap threshold (128 KiB, raised on its own up
to 32 MiB as blocks are freed) with a fresh ``mmap``, and returns the top of its heap to the
kernel once more than the trim threshold is free. A training step allocates and frees the same
large activations every step, so each step touches fresh pages again: an lm-small step on 2
cores took 14,000-24,000 minor page faults, and 2-20% of its time went to them (bench/history/,
``bench/memory.py``). ``keep_freed_memory()`` raises both thresholds (``mallopt``), once per
process: blocks up to 1 GiB come from the heap, and up to 2 GiB of free heap stays mapped. The
step's peak memory does not change; the process simply keeps it between steps, as PyTorch's
CUDA allocator does on a GPU.

The trainer calls it when training starts (``ATTNKIT_KEEP_MEMORY=0`` leaves malloc as it is).
On other C libraries it does nothing. ``with return_freed_memory():`` is the opposite for a
block that measures resident memory (``explain.complexity``): small thresholds inside it, and
the kept ones back after it if they were set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from contextlib import contextmanager

__all__ = ["keep_freed_memory", "return_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB from the heap
_TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of free heap (mallopt takes an int)
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if they are raised
    (now or before), False on another C library or with ``ATTNKIT_KEEP_MEMORY=0``."""
    global _done
    if _done is None:
        _done = os.environ.get("ATTNKIT_KEEP_MEMORY", "1") != "0" and _set_thresholds(
            _MMAP_THRESHOLD, _TRIM_THRESHOLD
        )
    return _done


@contextmanager
def return_freed_memory(threshold: int = 128 * 1024):
    """Inside the block, blocks above ``threshold`` bytes get their own mappings and freed heap
    above it goes back to the kernel, so that a resident-set peak measures the block's own
    memory; after it, :func:`keep_freed_memory`'s thresholds again if it had set them (glibc
    cannot report its settings, so nothing else is restored). On entry the free memory the
    process kept goes back to the kernel too (``malloc_trim``): malloc serves a block from a
    free chunk before it maps a new one, so a block would otherwise reuse pages that are
    already resident and show no growth."""
    if _set_thresholds(threshold, threshold):
        _libc().malloc_trim(0)
    try:
        yield
    finally:
        if _done:
            _set_thresholds(_MMAP_THRESHOLD, _TRIM_THRESHOLD)


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``mallopt`` for both thresholds; False on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = _libc()
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"))
