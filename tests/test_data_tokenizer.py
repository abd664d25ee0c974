"""Tokenizers: fixed special ids, exact round trips (Chinese, English, German, whitespace), one
JSON file written atomically and read back by load_tokenizer, clear errors."""

import functools
import json
import os

import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.data import (
    SPECIAL_TOKENS,
    BPETokenizer,
    CharTokenizer,
    load_tokenizer,
)

ENGLISH = [
    "Who's there? Nay, answer me: stand, and unfold yourself.",
    "Long live the king!  Bernardo?\tHe.\n",
    "You come most carefully upon your hour.",
    "'Tis now struck twelve. Get thee to bed, Francisco.",
]
GERMAN = [
    "Es tut mir leid, aber ich habe kein Kleingeld.",
    "Die Straße nimmt entlang der Küste einen gewundenen Verlauf.",
    "Über Nacht ist der Fluss übergetreten; die Brücke ist gesperrt.",
]
CHINESE = [
    "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）",
    "这本书太好了，我一口气买了5本！",
    "今天下雨，我没带伞。",
]
ALL_TEXTS = ENGLISH + GERMAN + CHINESE


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(ALL_TEXTS * 3, vocab_size=400)


@pytest.fixture(scope="module")
def char():
    return CharTokenizer.train(ALL_TEXTS)


# --- special tokens -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_special_tokens_have_fixed_ids(kind, char, bpe):
    tok = char if kind == "char" else bpe
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.cls_id) == (0, 1, 2, 3, 4)
    assert [tok.id_to_token(i) for i in range(5)] == ["<pad>", "<bos>", "<eos>", "<unk>", "[CLS]"]
    assert list(SPECIAL_TOKENS) == ["<pad>", "<bos>", "<eos>", "<unk>", "[CLS]"]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_bos_eos_and_skip_special(kind, char, bpe):
    tok = char if kind == "char" else bpe
    plain = tok.encode("Long live the king!")
    ids = tok.encode("Long live the king!", add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, *plain, tok.eos_id]
    assert all(i >= 5 for i in plain)
    assert tok.decode(ids) == "Long live the king!"
    assert tok.decode([tok.cls_id, *ids, tok.pad_id], skip_special=False) == (
        "[CLS]<bos>Long live the king!<eos><pad>"
    )


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_special_token_text_is_plain_text(kind, char, bpe):
    """The string "<eos>" in a text is characters, not the special token: it round-trips."""
    tok = char if kind == "char" else bpe
    text = "<eos>[CLS]<pad>"
    if kind == "char":  # make sure all the characters are known
        tok = CharTokenizer.train([text])
    ids = tok.encode(text)
    assert not set(ids) & {0, 1, 2, 3, 4}
    assert tok.decode(ids) == text


# --- character tokenizer --------------------------------------------------------------------


def test_char_round_trip_chinese_and_english(char):
    for text in ALL_TEXTS:
        ids = char.encode(text)
        assert len(ids) == len(text)
        assert char.unk_id not in ids
        assert char.decode(ids) == text


def test_char_vocab_is_ordered_by_frequency_then_code_point():
    tok = CharTokenizer.train(["abcabca", "c"])  # a:3, c:3, b:2
    assert tok.chars == ["a", "c", "b"]
    assert tok.encode("abc") == [5, 7, 6]
    assert tok.vocab_size == 8


def test_char_unknown_characters_become_unk():
    tok = CharTokenizer.train(["你好"])
    assert tok.encode("你们好") == [tok.token_to_id("你"), tok.unk_id, tok.token_to_id("好")]
    assert tok.decode(tok.encode("你们好"), skip_special=False) == "你<unk>好"
    assert tok.decode(tok.encode("你们好")) == "你好"


def test_char_min_freq_and_max_vocab():
    texts = ["aaaa", "bbb", "cc", "d"]
    assert CharTokenizer.train(texts, min_freq=2).chars == ["a", "b", "c"]
    assert CharTokenizer.train(texts, max_vocab=7).chars == ["a", "b"]
    assert CharTokenizer.train(texts, max_vocab=5).chars == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_freq": 0}, "min_freq must be an int >= 1, got 0"),
        ({"max_vocab": 4}, "max_vocab must be None or an int >= 5"),
        ({"max_vocab": 2.5}, "max_vocab must be None or an int >= 5"),
    ],
)
def test_char_train_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CharTokenizer.train(["abc"], **kwargs)


def test_train_rejects_a_single_string():
    with pytest.raises(TypeError, match="not one string"):
        CharTokenizer.train("abc")
    with pytest.raises(TypeError, match="not one string"):
        BPETokenizer.train("abc", vocab_size=300)


@given(st.text(alphabet="abc 你好世界\n\t.ÄÖü", max_size=50))
@settings(max_examples=50, deadline=None)
def test_char_round_trip_property(text):
    tok = CharTokenizer.train(["abc 你好世界\n\t.ÄÖü"])
    assert tok.decode(tok.encode(text)) == text


# --- BPE ------------------------------------------------------------------------------------


def test_bpe_round_trip_english_german_chinese(bpe):
    for text in [*ALL_TEXTS, "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n"]:
        ids = bpe.encode(text)
        assert bpe.unk_id not in ids
        assert bpe.decode(ids) == text


def test_bpe_learns_merges(bpe):
    text = "You come most carefully upon your hour."
    assert len(bpe.encode(text)) < len(text.encode("utf-8"))
    assert bpe.vocab_size <= 400
    assert bpe.vocab_size > BPETokenizer.MIN_VOCAB_SIZE


@functools.cache
def _small_bpe():
    return BPETokenizer.train(ENGLISH, vocab_size=300)


@given(st.text(max_size=60))
@settings(max_examples=60, deadline=None)
def test_bpe_round_trips_any_text(text):
    """Byte-level: every Unicode text, seen in training or not, comes back exactly."""
    tok = _small_bpe()
    assert tok.decode(tok.encode(text)) == text


def test_bpe_training_is_deterministic():
    a = BPETokenizer.train(ALL_TEXTS, vocab_size=350)
    b = BPETokenizer.train(list(ALL_TEXTS), vocab_size=350)
    assert a.to_json() == b.to_json()


def test_bpe_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 261"):
        BPETokenizer.train(ENGLISH, vocab_size=100)


# --- save / load ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_load_round_trip(kind, char, bpe, tmp_path):
    tok = char if kind == "char" else bpe
    path = tmp_path / "sub" / "tok.json"
    tok.save(path)
    assert sorted(os.listdir(path.parent)) == ["tok.json"]  # no temporary file left behind
    loaded = load_tokenizer(path)
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    for text in ALL_TEXTS:
        assert loaded.encode(text, add_bos=True) == tok.encode(text, add_bos=True)
        assert loaded.decode(loaded.encode(text)) == text
    json.loads(path.read_text(encoding="utf-8"))  # one plain JSON document


def test_save_overwrites_atomically(char, bpe, tmp_path):
    path = tmp_path / "tok.json"
    char.save(path)
    bpe.save(path)
    assert isinstance(load_tokenizer(path), BPETokenizer)
    assert sorted(os.listdir(tmp_path)) == ["tok.json"]


def test_failed_save_keeps_the_old_file(char, bpe, tmp_path, monkeypatch):
    path = tmp_path / "tok.json"
    char.save(path)
    before = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        bpe.save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["tok.json"]  # the temporary file is removed


def test_bpe_file_is_a_tokenizers_file(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert hf.encode("Long live the king!", add_special_tokens=False).ids == bpe.encode(
        "Long live the king!"
    )


def test_char_file_keeps_chinese_readable(char, tmp_path):
    path = tmp_path / "char.json"
    char.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["attnkit_tokenizer"] == "char"
    assert data["vocab"][:5] == list(SPECIAL_TOKENS)
    assert "希" in path.read_text(encoding="utf-8")  # not \\u escapes


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="is not a JSON file"):
        load_tokenizer(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": {"type": "WordPiece"}}), encoding="utf-8")
    with pytest.raises(ValueError, match="model type 'WordPiece'"):
        load_tokenizer(other)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_tokenizer(listing)
    broken = tmp_path / "broken_char.json"
    broken.write_text(json.dumps({"attnkit_tokenizer": "char", "vocab": ["a"]}), encoding="utf-8")
    with pytest.raises(ValueError, match="must be a list starting with"):
        load_tokenizer(broken)


def test_bpe_with_special_tokens_at_other_ids_is_rejected():
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<bos>", "<pad>"], show_progress=False
    )
    hf.train_from_iterator(ENGLISH, trainer)
    with pytest.raises(ValueError, match="special token '<pad>' must have id 0, got 1"):
        BPETokenizer(hf)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_decode_rejects_out_of_range_ids(kind, char, bpe):
    tok = char if kind == "char" else bpe
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is out of range"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.decode([-1])
    with pytest.raises(TypeError, match="encode: text must be a str"):
        tok.encode(["not", "a", "string"])


def test_decode_accepts_a_tensor(char):
    ids = torch.tensor(char.encode("今天下雨"))
    assert char.decode(ids) == "今天下雨"
