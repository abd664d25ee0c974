"""accel.keep_freed_memory: a block freed and allocated again no longer faults its pages in
again (the kernel's minor page faults per block, in a fresh process each way), and the
trainer's step turns it on. accel.release_file_pages: a memory-mapped file's pages leave the
resident set (/proc/self/smaps) and read back unchanged; written and heap memory are left."""

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import attnkit.accel as accel
from attnkit.training import config as training_config

PROGRAM = """
import resource, statistics, sys, torch
import attnkit.accel as accel
kept = accel.keep_freed_memory()
if "held" in sys.argv:  # 256 MiB freed in the middle of the heap, its pages resident
    import ctypes, ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(256 << 20)
    ctypes.memset(block, 1, 256 << 20)
    guard = libc.malloc(64)  # keeps the block off the top of the heap
    libc.free(block)
if "measured" in sys.argv:  # a resident-memory measurement (explain.complexity) in between
    with accel.return_freed_memory():
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            torch.empty(16 << 20).fill_(1.0)
        inside = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 3
faults = []
for _ in range(16):  # 64 MiB: above glibc's largest automatic mmap threshold (32 MiB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the last eight blocks: the first ones may still extend the heap (see the test below)
print(kept, statistics.median(faults[8:]), inside if "measured" in sys.argv else "")
"""


def faults_per_block(keep: bool, *args: str) -> tuple[str, float] | tuple[str, float, float]:
    env = {"ATTNKIT_KEEP_MEMORY": "1" if keep else "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True, check=True,
        env={**os.environ, **env},
    ).stdout.split()  # fmt: skip
    return out[0], *map(float, out[1:])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_freed_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    kept, faults_kept = faults_per_block(True)
    assert kept == "True"
    kept, faults_default = faults_per_block(False)
    assert kept == "False" and faults_default > pages / 2  # glibc's default: every page again
    # Kept: no page again in the median of the last eight of sixteen blocks. The first blocks
    # may extend the heap and fault every page, as many of them as the heap the imports left
    # needs: up to the second or third once, up to the sixth since `import attnkit` stopped
    # loading accel (the same program, another import order); never a later one in 30 runs.
    assert faults_kept < pages / 20


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_memory_measurement_returns_freed_memory_then_keeps_it_again():
    pages = (64 << 20) // 4096
    kept, faults_after, faults_inside = faults_per_block(True, "measured")
    assert kept == "True"
    assert faults_inside > pages / 2  # inside the block: every page faulted in again
    _, faults_default = faults_per_block(False)
    assert faults_after < pages / 20 < faults_default  # after it: kept again


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_measurement_after_training_does_not_reuse_the_kept_pages():
    """Memory that a training step freed stays resident (that is what keeping it means); a
    measurement of resident memory hands it back first, or its blocks would reuse those pages
    and show less growth than they make. (One CI run measured the math path's N x N scores
    at 0.01 MiB for N = 512 and 1,024, after tests that train; this is one way that happens.)"""
    pages = (64 << 20) // 4096
    kept, _, faults_inside = faults_per_block(True, "held", "measured")
    assert kept == "True" and faults_inside > 0.9 * pages  # (a third fewer, before)


def test_the_training_step_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(accel, "keep_freed_memory", lambda: calls.append(1))
    with training_config.step_context("fp32", torch.device("cpu")):
        pass
    assert calls


def _mapping_rss_kb(address: int) -> int:
    """The resident kB of the mapping that holds ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped_file(tmp_path, pages: int = 256) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor over a copy-on-write map of a file (as load_gguf's blocks), every page read."""
    data = np.random.default_rng(0).integers(0, 256, pages * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.tobytes())
    tensor = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    assert int(tensor.sum()) == int(data.sum(dtype=np.int64))  # every page resident
    return tensor, data


def test_release_file_pages_gives_back_a_files_pages_and_keeps_their_values(tmp_path):
    tensor, data = _mapped_file(tmp_path)
    before = _mapping_rss_kb(tensor.data_ptr())
    released = accel.release_file_pages(tensor)
    assert released == len(data)  # the map starts on a page: every page
    assert _mapping_rss_kb(tensor.data_ptr()) <= before - released // 1024 + 4
    assert np.array_equal(tensor.numpy(), data)  # read again from the file


def test_release_file_pages_leaves_written_and_heap_memory_alone(tmp_path):
    tensor, data = _mapped_file(tmp_path)
    tensor[5 * mmap.PAGESIZE] = int(data[5 * mmap.PAGESIZE]) ^ 0xFF  # a private copy now
    assert accel.release_file_pages(tensor) == 0  # MADV_DONTNEED would drop the write
    assert int(tensor[5 * mmap.PAGESIZE]) == int(data[5 * mmap.PAGESIZE]) ^ 0xFF
    assert accel.release_file_pages(tensor[: 4 * mmap.PAGESIZE]) == 4 * mmap.PAGESIZE
    heap = torch.arange(1 << 20, dtype=torch.int32)
    assert accel.release_file_pages(heap) == 0
    assert torch.equal(heap, torch.arange(1 << 20, dtype=torch.int32))
