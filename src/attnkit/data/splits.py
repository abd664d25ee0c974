"""Deterministic train / validation / test splits, decided by a stable hash of each example.

Every corpus loader in :mod:`attnkit.data.corpora` puts an example in a split by hashing its
*text* (or another key that belongs to the example itself), never by its position in a file and
never with Python's ``hash()`` (which is salted per process for strings). So:

- the same example lands in the same split on every machine, in every run, with any file order;
- adding or removing other examples does not move it;
- two copies of one text always share a split, so a duplicate can never leak from train to test.

The hash is SHA-1 of the UTF-8 bytes; its first 8 bytes, read as a big-endian integer and
divided by 2**64, give a number u in [0, 1)::

    u < test_fraction                                   -> "test"
    test_fraction <= u < test_fraction + val_fraction   -> "validation"
    otherwise                                           -> "train"

>>> split_of("Who's there?")
'train'
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

__all__ = ["SPLIT_NAMES", "SplitName", "Splits", "split_by_hash", "split_of", "stable_unit"]

T = TypeVar("T")
E = TypeVar("E")

SplitName = Literal["train", "validation", "test"]
SPLIT_NAMES: tuple[SplitName, ...] = ("train", "validation", "test")

DEFAULT_VAL_FRACTION = 0.05
DEFAULT_TEST_FRACTION = 0.05


@dataclass(frozen=True)
class Splits(Generic[T]):
    """The three splits of one corpus, plus a few counts about how it was cleaned.

    ``splits["train"]`` works as well as ``splits.train``. ``info`` holds corpus-specific counts
    (examples kept, duplicates dropped, ...), so a caller can report what the loader did.
    """

    train: T
    validation: T
    test: T
    info: Mapping[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> T:
        if name not in SPLIT_NAMES:
            raise KeyError(f"Splits: no split named {name!r}; expected one of {SPLIT_NAMES}")
        return getattr(self, name)


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    if val_fraction + test_fraction >= 1:
        raise ValueError(
            f"val_fraction + test_fraction must be below 1 (something must be left to train on), "
            f"got {val_fraction} + {test_fraction}"
        )


def stable_unit(key: str) -> float:
    """A number in [0, 1) that depends only on ``key``: SHA-1 of its UTF-8 bytes, first 8 bytes."""
    if not isinstance(key, str):
        raise TypeError(f"stable_unit: key must be a str, got {type(key).__name__}")
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(
    key: str,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> SplitName:
    """Which split the example with this key belongs to: "train", "validation" or "test"."""
    _check_fractions(val_fraction, test_fraction)
    u = stable_unit(key)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"


def split_by_hash(
    examples: Iterable[E],
    key: Callable[[E], str],
    val_fraction: float = DEFAULT_VAL_FRACTION,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Splits[list[E]]:
    """Deal ``examples`` into three lists by ``split_of(key(example))``, keeping their order."""
    _check_fractions(val_fraction, test_fraction)
    parts: dict[str, list[E]] = {name: [] for name in SPLIT_NAMES}
    for example in examples:
        parts[split_of(key(example), val_fraction, test_fraction)].append(example)
    return Splits(parts["train"], parts["validation"], parts["test"])
