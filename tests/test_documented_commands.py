"""Every command the documentation shows runs: each ``attnkit ...`` line of the READMEs' and
docs/' code blocks and of the recipes' comments, parsed by the CLI's own parser (a flag that
does not exist, a missing argument or a value it refuses fails here, naming the file and line).

A block that marks its commands with a ``$`` prompt has its output beside them: only the
prompted lines are commands there. Continued lines (``\\``) are joined, a shell's ``$(...)``
stands for one word, and ``VAR=value`` in front and ``time`` are the shell's."""

import re
import shlex
from pathlib import Path

import pytest

from attnkit.cli import build_parser
from attnkit.cli.common import UsageError

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    *sorted(ROOT.glob("README*.md")),
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*.toml")),
]
COMMAND = re.compile(r"(?:\.venv/bin/)?attnkit (?:-|[a-z][a-z-]*(?: |$))")


def _blocks(path: Path) -> list[list[tuple[int, str]]]:
    """The numbered lines of each code block (Markdown) or comment block (TOML)."""
    blocks, current, fenced = [], [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if path.suffix == ".toml":
            if line.startswith("#"):
                current.append((n, line.lstrip("#").strip()))
                continue
        elif line.lstrip().startswith("```"):
            fenced = not fenced
            if fenced:
                continue
        elif fenced:
            current.append((n, line.strip()))
            continue
        if current:
            blocks.append(current)
        current = []
    return [*blocks, current] if current else blocks


def _shell_words(text: str) -> list[str]:
    """``text`` split as a shell would, each ``$(...)`` standing for one word."""
    out, depth, i = "", 0, 0
    while i < len(text):
        if text.startswith("$(", i):
            depth, i = depth + 1, i + 2
            out += "WORD" if depth == 1 else ""
            continue
        if depth and text[i] in "()":
            depth += 1 if text[i] == "(" else -1
        elif not depth:
            out += text[i]
        i += 1
    return shlex.split(out, comments=True)


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in FILES:
        for block in _blocks(path):
            prompted = any(text.startswith("$ ") for _, text in block)
            lines = iter(block)
            for n, text in lines:
                if prompted and not text.startswith("$ "):
                    continue
                text = re.sub(r"^\$\s+(time\s+)?", "", text)
                text = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", text)  # VAR=value
                if not COMMAND.match(text):
                    continue
                while text.endswith("\\"):
                    text = text[:-1] + " " + next(lines, (0, ""))[1]
                words = _shell_words(text)
                found.append((f"{path.relative_to(ROOT)}:{n}", words[1:]))
    return found


COMMANDS = documented_commands()


def test_the_documentation_shows_commands_of_every_kind():
    shown = {words[0] for _, words in COMMANDS if words and not words[0].startswith("-")}
    assert len(COMMANDS) > 100 and {"train", "evaluate", "export", "serve", "chat"} <= shown


@pytest.mark.parametrize(("where", "words"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses(where, words):
    try:
        build_parser().parse_args(words)
    except UsageError as error:
        pytest.fail(f"{where}: attnkit {shlex.join(words)}: {error}")
    except SystemExit as done:  # --help and --version exit on their own
        assert done.code == 0, where
