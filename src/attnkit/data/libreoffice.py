"""Sentence pairs from LibreOffice's help pages: German-English and Chinese-English.

LibreOffice's help is written in English and translated by people, paragraph by paragraph, into
many languages. Every language's copy of a page keeps the English page's element ids::

    en-US/text/swriter/guide/autocorr_except.html
      <p id="par_id3154254">You can prevent AutoCorrect from correcting specific ...</p>
    de/text/swriter/guide/autocorr_except.html
      <p id="par_id3154254">Sie können verhindern, dass AutoKorrektur bestimmte ...</p>

so the paragraphs (``par_id...``) and headings (``hd_id...``) align by (page, id), with no
alignment model. The pages come in Debian's ``libreoffice-help-en-us``, ``libreoffice-help-de``
and ``libreoffice-help-zh-cn`` (1.8 to 3.4 MB each). Installing them would pull in all of
LibreOffice, so ``make data`` only unpacks them (``apt-get download`` + ``dpkg -x``, no root
needed) into ``data/libreoffice/`` in the repository.

Cleaning, in order (:func:`load_help_pairs`):

1. markup is stripped (a paragraph's text is all the text inside it, nested spans and links
   included), entities decoded (``&amp;`` -> ``&``), runs of whitespace made one space;
2. a pair is dropped if either side is empty, or if the translation was never made: the source
   equals the English (after :func:`normalize_key`), or, for Chinese, the source holds no Chinese
   character at all;
3. pairs whose English side has fewer than ``min_words`` or more than ``max_words`` words are
   dropped (one-word menu labels and whole tables are not sentences to learn from);
4. repeated (source, English) pairs are kept once, in page order.

Each pair goes to the split picked by the hash of its **normalised source** (:func:`normalize_key`:
NFKC, case-folded, with every space removed), so a test sentence cannot reach training in
another casing or spacing, and every English rendering of one source shares its split.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from pathlib import Path

from attnkit.data.corpora import CorpusNotFoundError, PathLike
from attnkit.data.splits import DEFAULT_TEST_FRACTION, DEFAULT_VAL_FRACTION, Splits, split_by_hash

__all__ = [
    "HELP_LANGUAGES",
    "INSTALL_LIBREOFFICE_HELP",
    "default_help_path",
    "help_paragraphs",
    "load_help_pairs",
    "normalize_key",
]

# source language -> (the directory under help/, the Debian package)
HELP_LANGUAGES = {"de": ("de", "libreoffice-help-de"), "zh": ("zh-CN", "libreoffice-help-zh-cn")}
ENGLISH = ("en-US", "libreoffice-help-en-us")
INSTALL_LIBREOFFICE_HELP = (
    "make data (or: apt-get download libreoffice-help-en-us libreoffice-help-de "
    "libreoffice-help-zh-cn && for f in libreoffice-help-*.deb; do dpkg -x $f data/libreoffice; "
    "done)"
)
HELP_SUBDIR = Path("usr/share/libreoffice/help")
_REPO_DATA = Path(__file__).resolve().parents[3] / "data" / "libreoffice"

_ALIGNED_ID = re.compile(r"(?:par|hd)_id")
_TEXT_BLOCKS = frozenset({"p", "h1", "h2", "h3", "h4", "h5", "h6"})
# Elements that end a paragraph even when its </p> is missing (the help pages omit some).
_BREAKS = _TEXT_BLOCKS | {"div", "table", "tr", "td", "th", "li", "ul", "ol", "header"}
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def normalize_key(text: str) -> str:
    """The text as the split sees it: NFKC (full-width forms folded), case-folded, and with
    every whitespace character removed. ``"Zahl  ist"`` and ``"zahl ist"`` share a key."""
    return "".join(unicodedata.normalize("NFKC", text).casefold().split())


class _Paragraphs:
    """Collects the text of each ``<p>`` / ``<h1-6>`` whose id is ``par_id...`` or ``hd_id...``:
    the events of lxml's HTML parser (libxml2, which decodes the entities) as a parser target."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}
        self._id: str | None = None
        self._text: list[str] = []

    def _finish(self) -> None:
        if self._id is not None:
            self.found.setdefault(self._id, " ".join("".join(self._text).split()))
        self._id, self._text = None, []

    def start(self, tag: str, attrs) -> None:
        if tag in _BREAKS:
            self._finish()
            element_id = attrs.get("id") or ""
            if tag in _TEXT_BLOCKS and _ALIGNED_ID.match(element_id):
                self._id = element_id
        elif tag == "br":
            self._text.append(" ")

    def end(self, tag: str) -> None:
        if tag in _BREAKS:
            self._finish()

    def data(self, data: str) -> None:
        if self._id is not None:
            self._text.append(data)

    def close(self) -> dict[str, str]:
        self._finish()
        return self.found


def help_paragraphs(html: str) -> dict[str, str]:
    """``{element id: plain text}`` for the aligned paragraphs and headings of one help page."""
    from lxml import etree  # libxml2's parser: 3.4x Python's html.parser on these pages

    parser = etree.HTMLParser(target=_Paragraphs())
    parser.feed(html)
    return parser.close()


def default_help_path() -> Path:
    """Where the help pages are looked for: ``$ATTNKIT_DATA/libreoffice``, then the repository's
    ``data/libreoffice`` (what ``make data`` fills), then ``/`` (the packages installed)."""
    candidates = (
        [Path(os.environ["ATTNKIT_DATA"]) / "libreoffice"] if "ATTNKIT_DATA" in os.environ else []
    )
    candidates += [_REPO_DATA, Path("/")]
    for root in candidates:
        if (root / HELP_SUBDIR / ENGLISH[0]).is_dir():
            return root
    return candidates[0]


def _pages(root: Path, language: str, package: str) -> dict[Path, Path]:
    text = root / language / "text"
    pages = {page.relative_to(text): page for page in sorted(text.rglob("*.html"))}
    if not pages:
        raise CorpusNotFoundError(
            f"LibreOffice help ({language})",
            f"no help pages under {str(text)!r} (package {package})",
            INSTALL_LIBREOFFICE_HELP,
        )
    return pages


@functools.lru_cache(maxsize=2)
def _english_paragraphs(root: Path) -> dict[Path, dict[str, str]]:
    """The aligned paragraphs of every English page, by page. Cached: German and Chinese are
    both aligned to them, and parsing the 2,560 pages takes seconds."""
    return {
        relative: help_paragraphs(page.read_text(encoding="utf-8"))
        for relative, page in _pages(root, *ENGLISH).items()
    }


@functools.lru_cache(maxsize=4)
def _aligned_paragraphs(root: Path, source: str) -> tuple[tuple[tuple[str, str], ...], dict]:
    """Every (source, English) paragraph pair of the pages both languages have, in page order,
    and the page counts. Cached: parsing the ~5,000 pages takes seconds."""
    language, package = HELP_LANGUAGES[source]
    english = _english_paragraphs(root)
    translated = _pages(root, language, package)
    aligned = []
    for relative, paragraphs in english.items():
        if relative not in translated:
            continue
        theirs = help_paragraphs(translated[relative].read_text(encoding="utf-8"))
        for element_id, target in paragraphs.items():
            if element_id in theirs:
                aligned.append((theirs[element_id], target))
    pages = len(english.keys() & translated.keys())
    return tuple(aligned), {"pages": pages, "pages_without_translation": len(english) - pages}


def load_help_pairs(
    source: str,
    path: PathLike | None = None,
    *,
    min_words: int = 3,
    max_words: int = 40,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[list[tuple[str, str]]]:
    """``(source sentence, English sentence)`` pairs of LibreOffice's help; ``source`` is
    ``"de"`` (German) or ``"zh"`` (simplified Chinese). See the module docstring for the rule.

    ``path``: a directory holding ``usr/share/libreoffice/help/<en-US|de|zh-CN>/text`` (what
    ``dpkg -x`` makes) or the ``help`` directory itself. Default: :func:`default_help_path`.
    ``info`` counts pages, aligned paragraphs and what each cleaning step dropped.
    """
    if source not in HELP_LANGUAGES:
        raise ValueError(
            f"load_help_pairs: source must be one of {sorted(HELP_LANGUAGES)}, got {source!r}"
        )
    for name, value in (("min_words", min_words), ("max_words", max_words)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"load_help_pairs: {name} must be an int >= 1, got {value!r}")
    if max_words < min_words:
        raise ValueError(f"load_help_pairs: max_words={max_words} is below min_words={min_words}")
    root = Path(default_help_path() if path is None else path)
    if (root / HELP_SUBDIR).is_dir():
        root = root / HELP_SUBDIR
    aligned, pages = _aligned_paragraphs(root, source)
    counts = dict.fromkeys(("empty", "untranslated", "length", "duplicate"), 0)
    kept: dict[tuple[str, str], None] = {}
    for text, target in aligned:
        if not text or not target:
            counts["empty"] += 1
        elif normalize_key(text) == normalize_key(target) or (
            source == "zh" and _CJK.search(text) is None
        ):
            counts["untranslated"] += 1
        elif not min_words <= len(target.split()) <= max_words:
            counts["length"] += 1
        elif (text, target) in kept:
            counts["duplicate"] += 1
        else:
            kept[(text, target)] = None
    pairs = list(kept)
    parts = split_by_hash(pairs, lambda pair: normalize_key(pair[0]), val_fraction, test_fraction)
    info = {
        **pages,
        "aligned": len(aligned),
        **{f"{reason}_dropped": n for reason, n in counts.items()},
        "pairs": len(pairs),
    }
    return Splits(parts.train, parts.validation, parts.test, info)
