"""Pretrained tokenizers: a Hugging Face ``tokenizer.json``, or the one a GGUF file embeds.

Both become a :class:`PretrainedTokenizer`, a ``tokenizers.Tokenizer`` behind attnkit's tokenizer
interface (``encode(text) -> list[int]``, ``decode(ids, skip_special=True) -> str``,
``vocab_size``, and the special ids the files name). Unlike attnkit's own tokenizers, whose
special tokens sit at fixed ids and enter only on request, a pretrained tokenizer adds its
model's special tokens the way the model was trained: ``[CLS] ... [SEP]`` for BERT, ``<s>`` in
front for Llama, nothing for GPT-2 (``add_special_tokens=False`` turns that off).

A GGUF file has no ``tokenizer.json``; its ``tokenizer.ggml.*`` metadata describe one, which
this module rebuilds with the ``tokenizers`` library alone (``transformers`` is not needed)::

    tokenizer.ggml.model   what it is                      how it is rebuilt
    "gpt2"                 byte-level BPE (GPT-2, Llama 3)  BPE(tokens, merges), ByteLevel; the
                                                            split regex from tokenizer.ggml.pre
    "llama"                SentencePiece BPE (Llama 1, 2,   BPE(tokens, merges from the scores),
                           Mistral, Phi-3, Gemma)           byte fallback, "▁" for spaces and
                                                            in front of every text

``tokenizer.ggml.token_type`` marks control tokens (3: special, skipped by ``decode``) and
user-defined ones (4: kept whole); ``add_bos_token`` / ``add_eos_token`` give the template.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as HFTokenizer

from attnkit.files import cache_dir, read_json
from attnkit.interop.hf_config import HFConfig

__all__ = [
    "GGUF_IDS",
    "PretrainedTokenizer",
    "load_hf_tokenizer",
    "pre_tokenizer",
    "tokenizer_from_gguf",
    "tokenizer_from_gguf_metadata",
]

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_NAMES = ("pad", "bos", "eos", "unk", "cls", "sep", "mask")
# Well-known spellings, used when no file names a special token.
_KNOWN = {
    "pad": ("[PAD]", "<pad>", "<|pad|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
    "unk": ("[UNK]", "<unk>"),
    "cls": ("[CLS]",),
    "sep": ("[SEP]",),
    "mask": ("[MASK]", "<mask>"),
}

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (the regexes that split text into words before BPE, one after the
# other, as llama.cpp's llama-vocab.cpp lists them; whether whole words skip the merges).
# None: tokenizers' ByteLevel(use_regex=True), which is GPT-2's own split.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...] | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "gpt-2": (None, False),  # llama.cpp's name for GPT-2's split (what attnkit's BPE uses)
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "smollm": ((r"\p{N}", _GPT2_REGEX), False),  # every digit alone, then GPT-2's split
    "qwen2": ((_QWEN2_SPLIT,), False),  # Qwen2, Qwen2.5, Qwen3: Llama 3's, digits alone
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# a special token's role -> its id's key in a GGUF file (after tokenizer.ggml.; llama.cpp's
# spelling of "separator")
GGUF_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "pad": "padding_token_id", "sep": "seperator_token_id"}  # fmt: skip


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name."""
    splits = PRE_TOKENIZERS[pre][0]
    if splits is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class PretrainedTokenizer:
    """A ``tokenizers.Tokenizer`` with attnkit's tokenizer interface.

    ``pad_id``, ``bos_id``, ``eos_id``, ``unk_id``, ``cls_id``, ``sep_id``, ``mask_id``: the
    special ids the source names (None where it names none). ``hf`` is the wrapped tokenizer;
    ``gguf``, for one read from a GGUF file, its ``tokenizer.ggml.*`` values (an export to GGUF
    writes them back as they were).
    """

    gguf: dict | None = None

    def __init__(
        self, tokenizer: HFTokenizer, special_ids: dict[str, int | None], source: str
    ) -> None:
        tokenizer.no_padding()  # a tokenizer.json may pad every text to a fixed length
        tokenizer.no_truncation()
        self.hf = tokenizer
        self.source = source
        for name in SPECIAL_NAMES:
            setattr(self, f"{name}_id", special_ids.get(name))

    pad_id: int | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    cls_id: int | None
    sep_id: int | None
    mask_id: int | None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PretrainedTokenizer:
        """A ``tokenizer.json``; special ids found by their usual spellings."""
        path = Path(path)
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: not a valid tokenizers JSON file ({error})") from None
        return cls(tokenizer, _guess_special_ids(tokenizer), str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"PretrainedTokenizer({self.source!r}, vocab_size={self.vocab_size})"

    def encode(
        self, text: str, *, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]:
        """Token ids of ``text``, with the model's special tokens unless asked not to.

        ``max_length`` cuts the text's tokens so that, special tokens included, at most that
        many ids come back (the special tokens stay).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
        encoding = self.hf.encode(text, add_special_tokens=False)
        if max_length is not None:
            room = max_length - (
                self.hf.num_special_tokens_to_add(False) if add_special_tokens else 0
            )
            if room < 1:
                raise ValueError(f"encode: max_length={max_length} leaves no room for the text")
            encoding.truncate(room)
        if add_special_tokens:
            encoding = self.hf.post_process(encoding, None, True)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids``; ``skip_special`` drops the special (control) tokens."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        checked = []
        for i in ids:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise TypeError(f"decode: ids must be ints, got {i!r} ({type(i).__name__})")
            i = operator.index(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"decode: token id {i} is out of range for vocabulary size {self.vocab_size}"
                )
            checked.append(i)
        return self.hf.decode(checked, skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str:
        token = self.hf.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"id_to_token: token id {token_id} is out of range for vocabulary size "
                f"{self.vocab_size}"
            )
        return token

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def to_json(self) -> str:
        return self.hf.to_str(pretty=True)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` (``save_pretrained`` calls this)."""
        Path(path).write_text(self.to_json(), encoding="utf-8")


def _guess_special_ids(tokenizer: HFTokenizer) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for name, spellings in _KNOWN.items():
        ids[name] = next(
            (i for t in spellings if (i := tokenizer.token_to_id(t)) is not None), None
        )
    return ids


# --------------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json spell it."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_hf_tokenizer(directory: str | os.PathLike[str]) -> PretrainedTokenizer:
    """The ``tokenizer.json`` of a Hugging Face model directory, with the special ids that
    ``special_tokens_map.json``, ``tokenizer_config.json`` or ``config.json`` name."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {TOKENIZER_FILE}")
    tokenizer = PretrainedTokenizer.from_file(path)
    ids = _guess_special_ids(tokenizer.hf)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # later files win
        if not (directory / name).is_file():
            continue
        data = read_json(directory / name)
        for special in SPECIAL_NAMES:
            content = _token_content(data.get(f"{special}_token"))
            if content is not None and tokenizer.hf.token_to_id(content) is not None:
                ids[special] = tokenizer.hf.token_to_id(content)
    if (directory / "config.json").is_file():
        config = HFConfig.from_file(directory / "config.json")
        for special in ("pad", "bos", "eos"):
            if ids.get(special) is None:
                ids[special] = config.get_token_id(f"{special}_token_id", tokenizer.vocab_size)
    for special in SPECIAL_NAMES:
        setattr(tokenizer, f"{special}_id", ids.get(special))
    return tokenizer


# --------------------------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------------------------


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges recovered from the vocabulary: every split of a token into two
    tokens, best-scored result first (as transformers' ``generate_merges`` does). Token ids
    stand for the tokens while sorting: the same order, found a fifth faster."""
    vocab = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[float, int, int, int, int]] = []
    find = vocab.get
    for token, score in zip(tokens, scores, strict=True):
        local = []
        for k in range(1, len(token)):
            left = find(token[:k])
            if left is not None:
                right = find(token[k:])
                if right is not None:
                    local.append((left, right))
        if len(local) > 1:
            local.sort()  # by (left id, right id), as the tokens' own order
        merges.extend((score, k, len(token) - k, left, right) for left, right in local
                      for k in (len(tokens[left]),))  # fmt: skip
    merges.sort(key=lambda m: m[:3], reverse=True)  # stable: ties keep the order above
    return [(tokens[left], tokens[right]) for _, _, _, left, right in merges]


def _kept_spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """:func:`_spm_merges`, worked out once per vocabulary and kept as token ids in
    ``~/.cache/attnkit/tokenizers/SHA256.npy`` (``ATTNKIT_CACHE`` moves it; the hash is over
    the tokens and their scores): Gemma 3's 262,144 tokens make 514,847 merges, 1.5 s of
    Python each time otherwise. A kept file that does not read back as ids of this vocabulary
    is worked out again; a read-only cache directory: worked out every time."""
    digest = hashlib.sha256(json.dumps(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(scores, dtype=np.float64).tobytes())
    path = cache_dir("tokenizers") / f"{digest.hexdigest()}.npy"
    try:
        ids = np.load(path, allow_pickle=False)
        if ids.ndim == 2 and ids.shape[1] == 2 and ids.dtype == np.int32:
            if not len(ids) or (ids.min() >= 0 and ids.max() < len(tokens)):
                left, right = (map(tokens.__getitem__, ids[:, i].tolist()) for i in (0, 1))
                return list(zip(left, right, strict=True))
    except (OSError, ValueError):
        pass
    merges = _spm_merges(tokens, scores)
    vocab = {token: i for i, token in enumerate(tokens)}
    ids = np.array([(vocab[a], vocab[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(scratch, ids, allow_pickle=False)
        scratch.replace(path)  # atomic: a reader never sees half a file
    except OSError:
        pass
    return merges


def _gguf_merges(metadata: dict[str, Any], source: str) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise ValueError(f"{source}: tokenizer.ggml.merges holds a malformed merge {merge!r}")
        pairs.append((left, right))
    return pairs


def _template(tokens: list[str], bos: int | None, eos: int | None) -> processors.TemplateProcessing:
    """BOS in front and / or EOS at the end of each sequence (llama.cpp's add_bos / add_eos)."""
    special = [(tokens[i], i) for i in (bos, eos) if i is not None]

    def sequence(name: str) -> list[str]:
        first = [] if bos is None else [tokens[bos]]
        return first + [name] + ([] if eos is None else [tokens[eos]])

    return processors.TemplateProcessing(
        single=" ".join(sequence("$A")),
        pair=" ".join(sequence("$A") + sequence("$B:1")),
        special_tokens=sorted(set(special)),
    )


def tokenizer_from_gguf_metadata(metadata: dict[str, Any], source: str) -> PretrainedTokenizer:
    """Rebuild the tokenizer that a GGUF file's ``tokenizer.ggml.*`` metadata describe."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{source}: no tokenizer.ggml.tokens list: the file embeds no tokenizer")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")

    ids = {}
    for role, key in GGUF_IDS.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        ids[role] = value if isinstance(value, int) and 0 <= value < len(tokens) else None
    merges = _gguf_merges(metadata, source)
    if kind == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"{source}: tokenizer.ggml.pre={pre!r} is not supported; attnkit knows "
                f"{sorted(PRE_TOKENIZERS)}"
            )
        if merges is None:
            raise ValueError(f"{source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges")
        ignore_merges = PRE_TOKENIZERS[pre][1]
        tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
        tokenizer.pre_tokenizer = pre_tokenizer(pre)
        tokenizer.decoder = decoders.ByteLevel()
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
    elif kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if merges is None:
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ValueError(
                    f"{source}: a 'llama' tokenizer needs tokenizer.ggml.scores, one per token"
                )
            merges = _kept_spm_merges(tokens, scores)
        unk = ids["unk"]
        tokenizer = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=None if unk is None else tokens[unk],
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
        # SentencePiece's (and llama.cpp's) dummy prefix: "▁" in front of every text, even one
        # that starts with a space (tokenizers' Metaspace would not add it there)
        spaces = [normalizers.Replace(" ", "▁")]
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), *spaces] if prefix else spaces
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tokenizer.decoder = decoders.Sequence(steps)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported; attnkit rebuilds "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) tokenizers"
        )
    types = metadata.get("tokenizer.ggml.token_type") or []
    control = [t for t, kind_ in zip(tokens, types, strict=False) if kind_ == CONTROL]
    user = [t for t, kind_ in zip(tokens, types, strict=False) if kind_ == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    tokenizer.post_processor = _template(
        tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None
    )
    found = PretrainedTokenizer(tokenizer, ids, source)
    found.gguf = {k.removeprefix("tokenizer.ggml."): v for k, v in metadata.items()
                  if k.startswith("tokenizer.ggml.")}  # fmt: skip
    return found


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> PretrainedTokenizer | None:
    """The tokenizer a GGUF file embeds, or None if it embeds none."""
    from attnkit.interop.gguf_file import read_gguf

    metadata = read_gguf(path).metadata
    if "tokenizer.ggml.model" not in metadata:
        return None
    return tokenizer_from_gguf_metadata(metadata, str(path))
