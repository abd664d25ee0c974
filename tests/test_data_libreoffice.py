"""The translators' corpora: LibreOffice's help pages (markup, cleaning, a leak-free split,
stable counts, missing files) and the HSK sentences."""

from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.data import (
    CorpusNotFoundError,
    load_help_pairs,
    load_hsk_sentences,
    normalize_key,
    split_of,
)
from attnkit.data.libreoffice import help_paragraphs

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------------------------
# The help pages: a small tree in the same layout as the Debian packages
# --------------------------------------------------------------------------------------------

PAGE = (
    '<html><body><header id="TopLeftHeader"><p dir="auto">{title}</p></header>{body}</body></html>'
)


def write_help(root: Path, pages: dict[str, dict[str, str]]) -> Path:
    """``pages[language][relative path] = body``: written under usr/share/libreoffice/help."""
    for language, by_path in pages.items():
        for relative, body in by_path.items():
            page = root / "usr/share/libreoffice/help" / language / "text" / relative
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(PAGE.format(title=language, body=body), encoding="utf-8")
    return root


def test_paragraphs_lose_their_markup_and_keep_their_text():
    html = (
        '<h1 id="hd_id1" dir="auto">\nTabellen &amp; Zellen</h1>'
        '<p id="par_id2" class="listitem">Wählen Sie <span class="menuitem">Format –\n'
        "  Zeichen</span>.<br/>Dann <a href='x.html'>OK</a>.</p>"
        '<p id="par_id3">Verwandte Themen'  # no </p>: the next element ends it
        '<table><tr><td><p id="par_id4">In&nbsp;einer Zelle</p></td></tr></table>'
        '<p id="bm_module"></p><p id="other">kein Absatz mit Kennung</p>'
    )
    assert help_paragraphs(html) == {
        "hd_id1": "Tabellen & Zellen",
        "par_id2": "Wählen Sie Format – Zeichen. Dann OK.",
        "par_id3": "Verwandte Themen",
        "par_id4": "In einer Zelle",
    }


def test_normalize_key_folds_case_width_and_spacing():
    assert normalize_key("Zahl  IST\tgut.") == normalize_key("zahl ist gut.") == "zahlistgut."
    assert normalize_key("ＡＢＣ　１２") == "abc12"  # full-width letters, digits and space


def help_tree(tmp_path):
    english = {
        "a/one.html": '<p id="par_id1">Choose Format - Character in the menu.</p>'
        '<p id="par_id2">Click OK to close the dialog.</p>'
        '<p id="par_id3">This stays in English here.</p>'
        '<p id="par_id4">The same sentence twice over.</p>'
        '<p id="par_id5">OK</p>',
        "a/two.html": '<p id="par_id1">The same sentence twice over.</p>'
        '<p id="par_id6">Numbers are counted again.</p>'
        '<p id="par_id7">Numbers are counted once more.</p>'
        '<p id="par_id8">  </p>',
        "b/only-english.html": '<p id="par_id1">No translation of this page exists.</p>',
    }
    german = {
        "a/one.html": '<p id="par_id1">Wählen Sie Format - Zeichen im Menü.</p>'
        '<p id="par_id2">Klicken Sie auf OK, um den Dialog zu schließen.</p>'
        '<p id="par_id3">This stays in  english here.</p>'  # untranslated (case, spacing)
        '<p id="par_id4">Derselbe Satz noch einmal.</p>'
        '<p id="par_id5">Gut</p>',
        "a/two.html": '<p id="par_id1">Derselbe Satz noch einmal.</p>'  # a duplicate pair
        '<p id="par_id6">Zahlen werden erneut gezählt.</p>'
        '<p id="par_id7">zahlen  werden erneut gezählt.</p>'  # same key as par_id6
        '<p id="par_id8">Leer.</p>',
    }
    chinese = {
        "a/one.html": '<p id="par_id1">在菜单中选择「格式 - 字符」。</p>'
        '<p id="par_id2">Click OK to close the dialogue.</p>',  # no Chinese: untranslated
    }
    return write_help(tmp_path, {"en-US": english, "de": german, "zh-CN": chinese})


def test_the_loader_cleans_deduplicates_and_splits_by_the_normalised_source(tmp_path):
    root = help_tree(tmp_path / "tree")
    splits = load_help_pairs("de", root, min_words=2, val_fraction=0.3, test_fraction=0.3)
    pairs = splits.train + splits.validation + splits.test
    assert sorted(pairs) == sorted(
        [
            ("Wählen Sie Format - Zeichen im Menü.", "Choose Format - Character in the menu."),
            ("Klicken Sie auf OK, um den Dialog zu schließen.", "Click OK to close the dialog."),
            ("Derselbe Satz noch einmal.", "The same sentence twice over."),
            ("Zahlen werden erneut gezählt.", "Numbers are counted again."),
            ("zahlen  werden erneut gezählt.".replace("  ", " "), "Numbers are counted once more."),
        ]
    )
    assert dict(splits.info) == {
        "pages": 2,
        "pages_without_translation": 1,
        "aligned": 9,
        "empty_dropped": 1,
        "untranslated_dropped": 1,
        "length_dropped": 1,  # "OK": one English word
        "duplicate_dropped": 1,
        "pairs": 5,
    }
    for name in ("train", "validation", "test"):
        for source, _ in splits[name]:
            assert split_of(normalize_key(source), 0.3, 0.3) == name
    # the two spellings of "Zahlen werden erneut gezählt." share one split
    homes = {
        name for name in ("train", "validation", "test") for s, _ in splits[name] if "ahlen" in s
    }
    assert len(homes) == 1
    chinese = load_help_pairs("zh", root, min_words=2)
    assert chinese.train + chinese.validation + chinese.test == [
        ("在菜单中选择「格式 - 字符」。", "Choose Format - Character in the menu.")
    ]
    assert chinese.info["untranslated_dropped"] == 1


def test_a_missing_or_partial_corpus_names_what_to_install(tmp_path):
    with pytest.raises(CorpusNotFoundError, match=r"make data .*apt-get download"):
        load_help_pairs("de", tmp_path / "nothing")
    partial = write_help(tmp_path / "partial", {"en-US": {"a.html": '<p id="par_id1">Hi.</p>'}})
    with pytest.raises(CorpusNotFoundError, match="libreoffice-help-zh-cn"):
        load_help_pairs("zh", partial)
    with pytest.raises(ValueError, match="source must be one of"):
        load_help_pairs("fr", partial)
    with pytest.raises(ValueError, match="max_words=2 is below min_words=3"):
        load_help_pairs("de", partial, max_words=2)


@pytest.mark.parametrize("recipe", ["de-en", "zh-en"])
def test_training_on_a_missing_corpus_is_a_one_line_error(recipe, tmp_path, capsys):
    recipe = Path(__file__).resolve().parent.parent / "examples" / f"{recipe}.toml"
    argv = ["train", str(recipe), "--set", f"data.path={tmp_path}", "--out", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LibreOffice help" in err[0] and "make data" in err[0]
    assert not (tmp_path / "r" / "checkpoint").exists()


@pytest.mark.needs("libreoffice")
@pytest.mark.parametrize(
    ("source", "info", "sizes"),
    [
        (
            "de",
            {"aligned": 64301, "untranslated_dropped": 8503, "pairs": 27211},
            (25323, 822, 1066),
        ),
        (
            "zh",
            {"aligned": 64301, "untranslated_dropped": 23936, "pairs": 18700},
            (17323, 576, 801),
        ),
    ],
)
def test_the_real_corpus_counts_are_stable_and_its_split_is_leak_free(source, info, sizes):
    """The counts the README quotes (the recipes' 3 % validation, 4 % test), and no normalised
    source sentence in two splits."""
    splits = load_help_pairs(source, val_fraction=0.03, test_fraction=0.04)
    assert {key: splits.info[key] for key in info} == info
    assert splits.info["pages"] == 2560
    assert (len(splits.train), len(splits.validation), len(splits.test)) == sizes
    keys = {
        name: {normalize_key(s) for s, _ in splits[name]}
        for name in ("train", "validation", "test")
    }
    assert not keys["train"] & keys["test"]
    assert not keys["train"] & keys["validation"]
    assert not keys["validation"] & keys["test"]
    assert all(s and e and normalize_key(s) != normalize_key(e) for s, e in splits.train)


@pytest.mark.needs("hsk")
def test_the_hsk_sentences():
    pairs = load_hsk_sentences()
    assert len(pairs) == 4354
    assert pairs[0] == ("老师，您好！", "Hello, teacher!")
    assert all(zh and en for zh, en in pairs)
