"""The tour (docs/TOUR.md, docs/TOUR.zh.md): its pasted outputs are what the code prints today.

Runnable blocks, the convention both tours follow:

- A fenced block with the info string ``console``: each line that starts with ``$ `` is a
  command, and the lines after it, up to the next ``$ `` line or the end of the block, are its
  expected output. ``$ attnkit ARGS`` runs ``attnkit.cli.main`` in this process (stdout
  captured, exit status 0 expected); ``$ NAME=$(python -c "CODE")`` runs CODE and keeps what it
  prints as ``$NAME`` for the later commands of that tour (as a shell would).
- A fenced block with the info string ``python run`` is executed on its own (a fresh namespace),
  and the next fenced block, ``text output``, is what it must print.
- Every other fenced block (``sh``, ``python``, ``text``, ...) is prose: not run.

Outputs must match exactly after stripping trailing whitespace. The two tours share their code,
so a block (python comments aside) runs once for both.

Links into the code are written ``[`name`](../src/attnkit/FILE.py#LN)``: line N must define
``name`` (``Class.method`` for a method). Every name in ``attnkit.__all__`` is linked from each
tour.

After a change in the code, ``python tests/test_tour.py --fix-links`` moves the links to the
lines that define their names now, and ``python tests/test_tour.py --update`` pastes what the
blocks print now (read the diff before committing it: the point is that a person checks it).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

import attnkit
from attnkit.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TOURS = [DOCS / "TOUR.md", DOCS / "TOUR.zh.md"]

FENCE = re.compile(r"^(```+)\s*(.*)$")
ASSIGN = re.compile(r"""^([A-Za-z_]\w*)=\$\(python -c (["'])(.*)\2\)$""")
CODE_LINK = re.compile(r"\[`([^`]+)`\]\((\.\./src/attnkit/[\w/]+\.py)#L(\d+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


# --------------------------------------------------------------------------------------------
# Reading the tours
# --------------------------------------------------------------------------------------------


@dataclass
class Block:
    info: str
    body: str
    line: int  # 1-based line of the opening fence
    end: int  # 0-based index of the closing fence line


def fenced_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.groups()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: a fenced block is never closed")
        blocks.append(Block(info.strip(), "\n".join(lines[i + 1 : j]), i + 1, j))
        i = j + 1
    return blocks


@dataclass
class Check:
    """One runnable unit: a console command or a python run block, with its expected output."""

    tour: Path
    line: int
    kind: str  # "attnkit", "assign" or "python"
    code: str
    expected: str

    @property
    def id(self) -> str:
        return f"{self.tour.name}:{self.line}"


def checks_in(tour: Path) -> list[Check]:
    blocks = fenced_blocks(tour.read_text(encoding="utf-8"))
    checks = []
    for index, block in enumerate(blocks):
        if block.info == "console":
            checks += _console_checks(tour, block)
        elif block.info == "python run":
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            if following is None or following.info != "text output":
                raise ValueError(
                    f"{tour.name}:{block.line}: a 'python run' block must be followed by its "
                    "'text output' block"
                )
            checks.append(Check(tour, block.line, "python", block.body, following.body))
    return checks


def _console_checks(tour: Path, block: Block) -> list[Check]:
    checks: list[Check] = []
    for offset, line in enumerate(block.body.splitlines(), start=1):
        if line.startswith("$ "):
            command = line[2:].strip()
            if command.startswith("attnkit ") or command == "attnkit":
                kind = "attnkit"
            elif ASSIGN.match(command):
                kind = "assign"
            else:
                raise ValueError(
                    f"{tour.name}:{block.line + offset}: a console command must be "
                    f"'attnkit ...' or 'NAME=$(python -c \"...\")', got {command!r}"
                )
            checks.append(Check(tour, block.line + offset, kind, command, ""))
        elif checks:
            checks[-1].expected += line + "\n"
        elif line.strip():
            raise ValueError(f"{tour.name}:{block.line + offset}: output before any '$ ' command")
    return checks


# --------------------------------------------------------------------------------------------
# Running them
# --------------------------------------------------------------------------------------------


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def _code_key(code: str) -> tuple:
    """The code without its comments: the two tours comment the same code in two languages."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT}
    tokens = tokenize.generate_tokens(io.StringIO(code + "\n").readline)
    return tuple((t.type, t.string) for t in tokens if t.type not in skip)


def _run_python(code: str) -> str:
    out = io.StringIO()
    namespace = {"__name__": "__tour__"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tour>", "exec"), namespace)
    return out.getvalue()


def _run_attnkit(command: str, variables: dict[str, str]) -> str:
    def expand(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise AssertionError(f"${name} is used before the tour sets it")
        return variables[name]

    expanded = re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, command)
    argv = shlex.split(expanded)[1:]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            status = cli_main(argv)
        except SystemExit as done:  # --version and --help exit through argparse
            status = done.code or 0
    assert status == 0, f"{command!r} exited with status {status}"
    return out.getvalue()


_results: dict[tuple, str] = {}
_variables: dict[Path, dict[str, str]] = {}


def run(check: Check) -> str:
    """What the check's code prints (cached: both tours run the same code)."""
    variables = _variables.setdefault(check.tour, {})
    if check.kind == "assign":
        name, _, code = ASSIGN.match(check.code).groups()
        key = ("python", _code_key(code))
        if key not in _results:
            _results[key] = _run_python(code)
        variables[name] = _results[key].strip()
        return ""
    if check.kind == "python":
        key = ("python", _code_key(check.code))
        if key not in _results:
            _results[key] = _run_python(check.code)
        return _results[key]
    # Variables change what a command means, so they are part of its key.
    key = ("attnkit", check.code, tuple(sorted(variables.items())))
    if key not in _results:
        _results[key] = _run_attnkit(check.code, variables)
    return _results[key]


def _prepare_variables(check: Check) -> None:
    """Run the tour's assignments that come before ``check`` (a test may run on its own)."""
    for earlier in checks_in(check.tour):
        if earlier.line >= check.line:
            break
        if earlier.kind == "assign":
            run(earlier)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

ALL_CHECKS = [check for tour in TOURS if tour.exists() for check in checks_in(tour)]


def test_both_tours_exist_and_have_runnable_blocks():
    for tour in TOURS:
        assert tour.exists(), f"{tour} is missing"
        kinds = {check.kind for check in checks_in(tour)}
        assert {"attnkit", "python"} <= kinds, f"{tour.name} has no runnable blocks"


@pytest.mark.needs("minilm")  # the tours read the shipped all-MiniLM-L6-v2
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.id)
def test_pasted_output_is_what_the_code_prints(check):
    _prepare_variables(check)
    got = run(check)
    expected = check.expected
    assert normalise(got) == normalise(expected), (
        f"{check.id}: the output pasted in the tour is stale for\n{check.code}\n"
        f"--- now it prints ---\n{normalise(got)}\n"
        "(python tests/test_tour.py --update pastes it; check the diff)"
    )


def _defines(lines: list[str], name: str, number: int) -> bool:
    if not 1 <= number <= len(lines):
        return False
    short = name.split(".")[-1]
    pattern = (
        rf"^\s*(?:(?:async\s+)?def|class)\s+{re.escape(short)}\b|^\s*{re.escape(short)}\s*[:=]"
    )
    return re.match(pattern, lines[number - 1]) is not None


def find_definition(lines: list[str], name: str) -> int | None:
    """The line (1-based) that defines ``name`` (or ``Class.method``), or None."""
    *owner, short = name.split(".")
    start = 0
    if owner:
        found = find_definition(lines, owner[-1])
        if found is None:
            return None
        start = found
    top_level = rf"^(?:(?:async\s+)?def|class)\s+{re.escape(short)}\b|^{re.escape(short)}\s*[:=]"
    for pattern in (top_level, None):
        for number in range(start + 1, len(lines) + 1):
            if (pattern and re.match(pattern, lines[number - 1])) or (
                not pattern and _defines(lines, name, number)
            ):
                return number
    return None


@pytest.mark.parametrize("tour", TOURS, ids=lambda t: t.name)
def test_code_links_point_at_the_definitions(tour):
    text = tour.read_text(encoding="utf-8")
    links = CODE_LINK.findall(text)
    assert links, f"{tour.name} links to no code"
    wrong = []
    for name, target, number in links:
        path = (tour.parent / target).resolve()
        assert path.exists(), f"{tour.name}: {target} does not exist"
        lines = path.read_text(encoding="utf-8").splitlines()
        if not _defines(lines, name, int(number)):
            now = find_definition(lines, name)
            wrong.append(f"`{name}` -> {target}#L{number} (defined at line {now})")
    assert not wrong, (
        f"{tour.name}: links that miss their definition (python tests/test_tour.py "
        "--fix-links):\n  " + "\n  ".join(wrong)
    )


@pytest.mark.parametrize("tour", TOURS, ids=lambda t: t.name)
def test_every_public_name_is_linked(tour):
    linked = {name.split(".")[-1] for name, _, _ in CODE_LINK.findall(tour.read_text("utf-8"))}
    missing = sorted(set(attnkit.__all__) - linked)
    assert not missing, f"{tour.name} links none of: {missing}"


@pytest.mark.parametrize("tour", TOURS, ids=lambda t: t.name)
def test_relative_links_and_pictures_exist(tour):
    text = tour.read_text(encoding="utf-8")
    for target in IMAGE.findall(text) + LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (tour.parent / target).exists(), f"{tour.name} links to a missing {target}"
    for image in IMAGE.findall(text):
        assert image.startswith("img/") and image.endswith(".png"), image


def test_chinese_readme_links_exist():
    readme = ROOT / "README.zh.md"
    text = readme.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.zh.md links to a missing {target}"
    assert "docs/TOUR.zh.md" in text and "make demo" in text and "make test" in text
    assert "README.zh.md" in (ROOT / "README.md").read_text(encoding="utf-8").split("\n## ")[0]


def test_pictures_are_small():
    pictures = {DOCS / image for tour in TOURS for image in IMAGE.findall(tour.read_text("utf-8"))}
    assert pictures
    for png in pictures:
        assert png.stat().st_size < 150 * 1024, f"{png.name} is over 150 KB"
    assert sum(p.stat().st_size for p in pictures) < 1.5 * 1024 * 1024


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = (
        c
        for c in heading.strip().lower()
        if c in " -_" or unicodedata.category(c)[0] in "LM" or unicodedata.category(c) == "Nd"
    )
    return "".join(kept).replace(" ", "-")


@pytest.mark.parametrize("tour", TOURS, ids=lambda t: t.name)
def test_anchors_name_headings(tour):
    text = tour.read_text(encoding="utf-8")
    outside_code = [b for b in re.split(r"^```.*?^```", text, flags=re.M | re.S)]
    headings = {
        slug(line.lstrip("#"))
        for part in outside_code
        for line in part.splitlines()
        if line.startswith("#")
    }
    for anchor in re.findall(r"\]\(#([^)\s]+)\)", text):
        assert anchor in headings, f"{tour.name}: no heading has the anchor #{anchor}"


# --------------------------------------------------------------------------------------------
# Maintenance: python tests/test_tour.py --fix-links | --update
# --------------------------------------------------------------------------------------------


def fix_links(tour: Path) -> int:
    text = tour.read_text(encoding="utf-8")
    changed = 0

    def fix(match: re.Match) -> str:
        nonlocal changed
        name, target, number = match.groups()
        lines = (tour.parent / target).resolve().read_text(encoding="utf-8").splitlines()
        if _defines(lines, name, int(number)):
            return match.group(0)
        now = find_definition(lines, name)
        if now is None:
            print(f"{tour.name}: cannot find `{name}` in {target}; fix it by hand")
            return match.group(0)
        changed += 1
        return f"[`{name}`]({target}#L{now})"

    tour.write_text(CODE_LINK.sub(fix, text), encoding="utf-8")
    return changed


def update_outputs(tour: Path) -> int:
    """Paste what every runnable block prints now into the tour; return how many changed."""
    lines = tour.read_text(encoding="utf-8").splitlines()
    blocks = fenced_blocks("\n".join(lines))
    edits: list[tuple[int, int, list[str]]] = []  # (first, last) 0-based lines to replace
    for index, block in enumerate(blocks):
        if block.info == "python run":
            output = blocks[index + 1]
            got = normalise(run(Check(tour, block.line, "python", block.body, "")))
            edits.append((output.line, output.end, got.splitlines()))
        elif block.info == "console":
            new_body: list[str] = []
            for check in _console_checks(tour, block):
                new_body.append("$ " + check.code)
                got = normalise(run(check))
                new_body += got.splitlines() if got else []
            edits.append((block.line, block.end, new_body))
    changed = 0
    for first, last, body in sorted(edits, reverse=True):
        if lines[first:last] != body:
            changed += 1
            lines[first:last] = body
    tour.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return changed


if __name__ == "__main__":
    os.chdir(ROOT)
    what = sys.argv[1:] or ["--help"]
    for tour in (t for t in TOURS if t.exists()):
        if "--fix-links" in what:
            print(f"{tour.name}: {fix_links(tour)} link(s) moved")
        if "--update" in what:
            print(f"{tour.name}: {update_outputs(tour)} block(s) pasted anew")
    if not {"--fix-links", "--update"} & set(what):
        print(__doc__)
