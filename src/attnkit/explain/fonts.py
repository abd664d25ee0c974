"""Fonts for pictures with Chinese (Japanese, Korean) tokens: find a CJK font, fall back to it.

matplotlib's default font, DejaVu Sans, has no Chinese characters: 今天 下雨 would be drawn as
empty boxes. Since matplotlib 3.6 the Agg renderer falls back glyph by glyph along the list in
``font.family``, so every picture here is drawn with ``["DejaVu Sans", <a CJK font>]``: Latin
text keeps its usual look and each Chinese character comes from the CJK font.

Where the CJK font comes from, in order:

1. a well-known CJK family that matplotlib already knows (Noto Sans CJK, Source Han Sans,
   WenQuanYi, ...);
2. fontconfig (``fc-list :lang=zh``), for a font installed after matplotlib built its font
   cache (the cache is not refreshed by itself); the file is added with ``addfont``.

On Debian, ``apt-get install fonts-wqy-zenhei`` (7 MB) or ``fonts-noto-cjk`` (56 MB) provides
one. With none, the pictures are still written, with one :class:`MissingFontWarning` instead of
a crash (and instead of matplotlib's warning per missing glyph).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import subprocess
import warnings
from collections.abc import Iterable, Iterator

import matplotlib
from matplotlib import font_manager

__all__ = ["MissingFontWarning", "cjk_font", "font_context", "has_cjk"]

# Families that cover Chinese, best first; any one of them will do.
PREFERRED_CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK TC",
    "Noto Sans CJK JP",
    "Noto Sans CJK KR",
    "Source Han Sans SC",
    "Source Han Sans CN",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "AR PL UKai CN",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "Heiti SC",
    "Arial Unicode MS",
)

# CJK symbols and punctuation, kana, CJK ideographs (and extension A), Hangul, compatibility
# ideographs, full-width forms, and the supplementary ideograph planes.
_CJK_RANGES = (
    (0x2E80, 0x9FFF),
    (0xAC00, 0xD7AF),
    (0xF900, 0xFAFF),
    (0xFF00, 0xFFEF),
    (0x20000, 0x3FFFF),
)


class MissingFontWarning(UserWarning):
    """Text needs a CJK font and none is installed: those characters will be empty boxes."""


def has_cjk(text: str) -> bool:
    """Whether ``text`` contains a character that needs a CJK font."""
    return any(low <= ord(c) <= high for c in text for low, high in _CJK_RANGES)


def _fontconfig_cjk_files() -> list[str]:
    """Font files that fontconfig says cover Chinese; empty without fontconfig."""
    fc_list = shutil.which("fc-list")
    if fc_list is None:
        return []
    try:
        result = subprocess.run(
            [fc_list, ":lang=zh", "file"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    files = [line.strip().rstrip(":") for line in result.stdout.splitlines() if line.strip()]
    return sorted(f for f in files if f.lower().endswith((".ttf", ".otf", ".ttc")))


@functools.cache
def cjk_font() -> str | None:
    """The family name of an installed font with Chinese characters, or None if there is none.

    The answer is cached; call ``cjk_font.cache_clear()`` after installing a font.
    """
    known = {entry.name for entry in font_manager.fontManager.ttflist}
    for family in PREFERRED_CJK_FAMILIES:
        if family in known:
            return family
    for file in _fontconfig_cjk_files():  # installed after matplotlib built its cache
        try:
            font_manager.fontManager.addfont(file)
            return font_manager.get_font(file).family_name
        except (OSError, RuntimeError, ValueError):
            continue
    return None


def _drop_weight_substitution(record: logging.LogRecord) -> bool:
    """Hide 'findfont: Failed to find font weight normal for X, now using 500': CJK fonts often
    come in one weight only (WenQuanYi's is 500), and the substitution is what we want."""
    return not str(record.msg).startswith("findfont: Failed to find font weight")


@contextlib.contextmanager
def font_context(texts: Iterable[str] = ()) -> Iterator[str | None]:
    """matplotlib settings that draw ``texts`` (Latin and CJK) with real glyphs.

    Create *and save* the figure inside the context (fonts are looked up when text is drawn).
    Yields the CJK family in use, or None. If ``texts`` contain CJK characters and no CJK font
    is installed, warns once with :class:`MissingFontWarning` and hides matplotlib's warning per
    missing glyph.
    """
    family = cjk_font()
    missing = family is None and any(has_cjk(str(t)) for t in texts)
    if missing:
        warnings.warn(
            "no CJK font found: Chinese, Japanese and Korean characters will be drawn as empty "
            "boxes; install one (Debian: apt-get install fonts-wqy-zenhei, or fonts-noto-cjk)",
            MissingFontWarning,
            stacklevel=3,
        )
    families = ["DejaVu Sans"] + ([family] if family else [])
    logger = logging.getLogger("matplotlib.font_manager")
    logger.addFilter(_drop_weight_substitution)
    try:
        with matplotlib.rc_context({"font.family": families}), warnings.catch_warnings():
            if missing:
                warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from")
            yield family
    finally:
        logger.removeFilter(_drop_weight_substitution)
