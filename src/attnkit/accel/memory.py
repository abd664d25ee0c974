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

``release_file_pages(tensor)`` takes a memory-mapped file's pages that a tensor views out of
the resident set (a packed layer whose integer path reads tiles instead of the file's blocks).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import platform
import sys
from contextlib import contextmanager
from functools import cache

import numpy as np
from torch import Tensor

from attnkit.accel.switch import Switch, read_environment

__all__ = ["keep_freed_memory", "release_file_pages", "return_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MADV_DONTNEED = 4  # Linux's mman.h
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB from the heap
_TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of free heap (mallopt takes an int)
_done: bool | None = None
keeping = Switch("ATTNKIT_KEEP_MEMORY")  # 0: leave malloc's thresholds as they are


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if they are raised
    (now or before), False on another C library or with ``ATTNKIT_KEEP_MEMORY=0``."""
    global _done
    if _done is None:
        read_environment()
        _done = keeping.on and _set_thresholds(_MMAP_THRESHOLD, _TRIM_THRESHOLD)
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


def release_file_pages(tensor: Tensor) -> int:
    """Take ``tensor``'s pages out of the process's resident set where they are a file's pages
    that the process never wrote (a view of a memory-mapped model file, as ``load_gguf`` keeps
    its blocks): ``madvise(MADV_DONTNEED)``, after which a read maps them again from the file,
    unchanged. Returns the bytes given back: 0 for any other memory (the heap, an anonymous
    mapping, or a copy-on-write mapping with a page written, all of which that call would
    zero), a tensor smaller than a page, or outside Linux.

    A layer whose products read a copy of its blocks (the integer path's tiles) calls it, so
    that the blocks it no longer reads are not counted twice in the process's memory."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if not sys.platform.startswith("linux") or not tensor.is_contiguous() or last <= first:
        return 0
    if not (_file_mapping(first, last) and _unwritten(first, last)):
        return 0
    madvise = _libc().madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = madvise(first, last - first, _MADV_DONTNEED)
    return last - first if done == 0 else 0


def _file_mapping(first: int, last: int) -> bool:
    """Whether one mapping of a file holds the addresses [first, last) (/proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="ascii") as maps:
            for line in maps:  # "low-high perms offset dev inode [path]"
                fields = line.split()
                low, _, high = fields[0].partition("-")
                if int(low, 16) <= first and last <= int(high, 16):
                    return fields[4] != "0"  # an inode: a file's
    except (OSError, ValueError, IndexError):
        pass
    return False


def _unwritten(first: int, last: int) -> bool:
    """Whether every page in [first, last) is absent or the file's own page, none a private
    copy that a write made (/proc/self/pagemap: bit 63 present, bit 62 swapped, bit 61 a
    file page or shared)."""
    page = mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first // page * 8)
            entries = np.frombuffer(pagemap.read((last - first) // page * 8), dtype=np.uint64)
    except OSError:
        return False
    if len(entries) != (last - first) // page:
        return False
    present, swapped = (entries >> 63) & 1, (entries >> 62) & 1
    file_page = (entries >> 61) & 1
    return not bool(np.any(swapped) or np.any(present & (1 - file_page)))


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's ``mallopt`` for both thresholds; False on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = _libc()
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
        and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"))
