"""Tokenizers: text to token ids and back, a character tokenizer and a byte-level BPE one.

Both share one contract (the :class:`Tokenizer` base):

- the special tokens sit at fixed ids in every tokenizer attnkit builds, so a model config can
  name them without looking at the vocabulary::

      0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 [CLS]

- ``encode(text, add_bos=False, add_eos=False) -> list[int]`` and
  ``decode(ids, skip_special=True) -> str``. Text is always plain text: the *string* "<eos>"
  inside a text is encoded as ordinary characters, never as the special token; special tokens
  enter only through ``add_bos`` / ``add_eos`` (or by the caller adding ``cls_id``).
- ``save(path)`` writes one JSON file, atomically (a temporary file, then ``os.replace``);
  :func:`load_tokenizer` reads either kind back and tells them apart by the file's content.

:class:`CharTokenizer` gives each character its own id (Chinese text, character-level English).
Characters never seen in training become ``<unk>``; text made of known characters round-trips
exactly. Its file: ``{"attnkit_tokenizer": "char", "version": 1, "special_tokens": [...],
"vocab": [...]}``, ``vocab[i]`` being the token with id ``i``.

:class:`BPETokenizer` is byte-pair encoding trained by Hugging Face ``tokenizers`` (nothing of
BPE is re-implemented here). It works on UTF-8 bytes (GPT-2's byte-level pre-tokenizer and
decoder, no normaliser), so every text -- English, German, Chinese, spaces, tabs, newlines --
round-trips exactly and ``<unk>`` never occurs. Its file is the ordinary ``tokenizer.json`` of
``tokenizers``, so ``tokenizers.Tokenizer.from_file`` reads it too.

>>> tok = CharTokenizer.train(["今天下雨", "我没带伞"])
>>> tok.decode(tok.encode("下雨", add_bos=True))
'下雨'
"""

from __future__ import annotations

import json
import operator
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnkit.files import atomic_write_text

__all__ = [
    "BOS",
    "CLS",
    "EOS",
    "PAD",
    "SPECIAL_TOKENS",
    "UNK",
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

PAD, BOS, EOS, UNK, CLS = "<pad>", "<bos>", "<eos>", "<unk>", "[CLS]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, CLS)  # ids 0, 1, 2, 3, 4
_FORMAT_VERSION = 1


def _check_texts(texts: Iterable[str], who: str) -> list[str]:
    if isinstance(texts, str):
        raise TypeError(f"{who}: texts must be an iterable of strings, not one string")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{who}: texts[{i}] must be a str, got {type(text).__name__}")
    return texts


class Tokenizer(ABC):
    """What every attnkit tokenizer offers. Subclasses implement the abstract methods."""

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 3
    cls_id: int = 4
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """How many ids there are: every id is in ``range(vocab_size)``."""

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """The ids of ``text``, without BOS / EOS."""

    @abstractmethod
    def _decode(self, ids: list[int], skip_special: bool) -> str:
        """The text of ids already checked to lie in ``range(vocab_size)``."""

    @abstractmethod
    def to_json(self) -> str:
        """The whole tokenizer as one JSON document (what :meth:`save` writes)."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """The token string with this id (for byte-level BPE, in its byte-to-unicode form)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None if it is not in the vocabulary."""

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, with ``bos_id`` in front and ``eos_id`` at the end if asked."""
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        ids = self._encode(text)
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids``. ``skip_special`` drops all five special tokens, ``<unk>`` too.

        ``ids`` may be a list of ints or a 1-D tensor; an id outside ``range(vocab_size)`` is a
        ValueError naming it.
        """
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        checked = []
        for i in ids:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise TypeError(f"decode: ids must be ints, got {i!r} ({type(i).__name__})")
            i = operator.index(i)
            checked.append(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"decode: token id {i} is out of range for vocabulary size {self.vocab_size}"
                )
        return self._decode(checked, skip_special)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer to one JSON file, atomically. :func:`load_tokenizer` reads it."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json())

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class CharTokenizer(Tokenizer):
    """One id per character; ids 0-4 are the special tokens, characters start at id 5.

    Build one with :meth:`train` (characters ordered by falling frequency, ties by code point,
    so the same texts always give the same ids) or directly from a list of characters.
    """

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(
                    f"CharTokenizer: each vocabulary entry must be one character, got {c!r}"
                )
        if len(set(chars)) != len(chars):
            dupes = sorted(c for c, n in Counter(chars).items() if n > 1)
            raise ValueError(f"CharTokenizer: repeated characters in the vocabulary: {dupes[:10]}")
        self._itos: list[str] = list(SPECIAL_TOKENS) + chars
        self._stoi: dict[str, int] = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}

    @classmethod
    def train(
        cls, texts: Iterable[str], min_freq: int = 1, max_vocab: int | None = None
    ) -> CharTokenizer:
        """Count characters in ``texts``; keep those seen at least ``min_freq`` times.

        ``max_vocab`` caps the whole vocabulary, the five special tokens included, keeping the
        most frequent characters.
        """
        texts = _check_texts(texts, "CharTokenizer.train")
        if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
            raise ValueError(f"CharTokenizer.train: min_freq must be an int >= 1, got {min_freq!r}")
        n_special = len(SPECIAL_TOKENS)
        if max_vocab is not None and (
            isinstance(max_vocab, bool) or not isinstance(max_vocab, int) or max_vocab < n_special
        ):
            raise ValueError(
                f"CharTokenizer.train: max_vocab must be None or an int >= {n_special} "
                f"(the special tokens), got {max_vocab!r}"
            )
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(text)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        chars = [c for c, n in ranked if n >= min_freq]
        if max_vocab is not None:
            chars = chars[: max_vocab - n_special]
        return cls(chars)

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    @property
    def chars(self) -> list[str]:
        """The characters of the vocabulary, in id order (id 5 first)."""
        return self._itos[len(SPECIAL_TOKENS) :]

    def _encode(self, text: str) -> list[int]:
        unk = self.unk_id
        return [self._stoi.get(c, unk) for c in text]

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        n_special = len(SPECIAL_TOKENS)
        if skip_special:
            return "".join(self._itos[i] for i in ids if i >= n_special)
        return "".join(self._itos[i] for i in ids)

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"id_to_token: token id {token_id} is out of range for vocabulary size "
                f"{self.vocab_size}"
            )
        return self._itos[token_id]

    def token_to_id(self, token: str) -> int | None:
        """The id of a character or special token, or None if it is not in the vocabulary."""
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS.index(token)
        return self._stoi.get(token)

    def to_json(self) -> str:
        data = {
            "attnkit_tokenizer": "char",
            "version": _FORMAT_VERSION,
            "special_tokens": list(SPECIAL_TOKENS),
            "vocab": self._itos,
        }
        return json.dumps(data, ensure_ascii=False, indent=1)

    @classmethod
    def from_json_dict(cls, data: dict, source: str = "<json>") -> CharTokenizer:
        """Rebuild from the parsed JSON of :meth:`to_json`; ``source`` names it in errors."""
        vocab = data.get("vocab")
        if not isinstance(vocab, list) or list(vocab[: len(SPECIAL_TOKENS)]) != list(
            SPECIAL_TOKENS
        ):
            raise ValueError(
                f"{source}: a char tokenizer's 'vocab' must be a list starting with "
                f"{list(SPECIAL_TOKENS)}, got {str(vocab)[:80]}"
            )
        return cls(vocab[len(SPECIAL_TOKENS) :])


class BPETokenizer(Tokenizer):
    """Byte-level BPE, trained and run by Hugging Face ``tokenizers``.

    The first 261 ids are fixed by construction: the five special tokens, then the 256 byte
    symbols; learned merges fill the rest up to ``vocab_size``. Wraps a ``tokenizers.Tokenizer``
    (``.hf`` gives it back, e.g. for fast batch encoding).
    """

    MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

    def __init__(self, hf_tokenizer: HFTokenizer) -> None:
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            got = hf_tokenizer.token_to_id(token)
            if got != expected_id:
                raise ValueError(
                    f"BPETokenizer: special token {token!r} must have id {expected_id}, got {got}"
                )
        # Text is text: the string "<eos>" in a text is not the special token.
        hf_tokenizer.encode_special_tokens = True
        self.hf = hf_tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> BPETokenizer:
        """Learn merges from ``texts`` until the vocabulary has ``vocab_size`` entries (or no pair
        occurs ``min_frequency`` times). Deterministic: the same texts give the same tokenizer."""
        texts = _check_texts(texts, "BPETokenizer.train")
        if (
            isinstance(vocab_size, bool)
            or not isinstance(vocab_size, int)
            or vocab_size < cls.MIN_VOCAB_SIZE
        ):
            raise ValueError(
                f"BPETokenizer.train: vocab_size must be an int >= {cls.MIN_VOCAB_SIZE} "
                f"(5 special tokens + 256 bytes), got {vocab_size!r}"
            )
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def _encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str:
        token = self.hf.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"id_to_token: token id {token_id} is out of range for vocabulary size "
                f"{self.vocab_size}"
            )
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (byte-to-unicode form), or None if it is not a token."""
        return self.hf.token_to_id(token)

    def to_json(self) -> str:
        return self.hf.to_str(pretty=True)

    @classmethod
    def from_json_dict(cls, data: dict, source: str = "<json>") -> BPETokenizer:
        """Rebuild from a parsed BPE ``tokenizer.json``; ``source`` names it in errors."""
        try:
            hf = HFTokenizer.from_str(json.dumps(data))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{source}: not a valid tokenizers JSON file: {err}") from err
        return cls(hf)


def load_tokenizer(path: str | os.PathLike[str]) -> CharTokenizer | BPETokenizer:
    """Read a tokenizer that :meth:`Tokenizer.save` wrote; the file's content says which kind.

    A file with ``"attnkit_tokenizer": "char"`` is a :class:`CharTokenizer`; a ``tokenizers``
    JSON file whose model is BPE is a :class:`BPETokenizer` (its special tokens must sit at ids
    0-4). Anything else is a ValueError naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_tokenizer: no tokenizer file at {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"load_tokenizer: {str(path)!r} is not a JSON file: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(
            f"load_tokenizer: {str(path)!r} holds a {type(data).__name__}, expected a JSON object"
        )
    kind = data.get("attnkit_tokenizer")
    if kind == "char":
        return CharTokenizer.from_json_dict(data, source=str(path))
    model = data.get("model")
    model_type = model.get("type") if isinstance(model, dict) else None
    if kind is None and model_type == "BPE":
        return BPETokenizer.from_json_dict(data, source=str(path))
    found = f"attnkit_tokenizer={kind!r}" if kind is not None else f"model type {model_type!r}"
    raise ValueError(
        f"load_tokenizer: {str(path)!r} is not an attnkit tokenizer (found {found}); expected "
        f"a char tokenizer or a tokenizers BPE JSON file"
    )
