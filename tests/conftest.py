"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture(autouse=True)
def restore_threads():
    """Every test leaves torch's thread count as it found it (the trainer and the CLI set it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny models run as fast on one thread, and never stall on a busy second core (two
    OpenMP threads on a shared 2-core machine can wait on each other for minutes)."""
    torch.set_num_threads(1)
