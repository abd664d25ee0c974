"""The front door stays short and its links lead somewhere: README.md and README.zh.md at most
300 lines, bench/README.md at most 200, and every relative link in them and in docs/ names a
file that exists (and, with a #fragment, a heading of that file)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "README.zh.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    ids = set()
    fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return ids


def links(page: Path):
    fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence:
            yield from LINK.findall(line)


@pytest.mark.parametrize(
    ("page", "limit"),
    [("README.md", 300), ("README.zh.md", 300), ("bench/README.md", 200)],
)
def test_the_front_pages_stay_short(page, limit):
    lines = (ROOT / page).read_text(encoding="utf-8").count("\n")
    assert lines <= limit, f"{page} has {lines} lines; move detail into a guide under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        where = page if not path else (page.parent / path).resolve()
        assert where.exists(), f"{page.name} links to a missing {target}"
        if fragment and where.suffix == ".md":
            assert fragment in anchors(where), f"{page.name}: no heading #{fragment} in {path}"
