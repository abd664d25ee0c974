"""A catalogue of bad command-line inputs (issue 12): each one gives a single line naming the
problem, no traceback, and exit status 2 for a usage error or 1 for a failure.

The Python API's bad inputs are in tests/test_errors.py, the recipe keys of ``--set`` in
tests/test_training.py and tests/test_training_cli.py, corrupt model files in
tests/test_interop_errors.py; this file adds the command line: every command that takes a path,
recipe files with typos, wrong types and bad encodings, unwritable outputs and bad numbers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.data import CharTokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SHAKESPEARE = str(EXAMPLES / "shakespeare-char.toml")
SMALL = ["--set", "data.max_chars=20000", "--set", "train.steps=2", "--quiet"]


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A directory of good and bad inputs: models with and without tokenizers, recipes."""
    root = tmp_path_factory.mktemp("inputs")
    tok = CharTokenizer.train(["hello world"])
    cfg = ak.ModelConfig.preset("tiny", vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    ak.DecoderLM(cfg).save_pretrained(root / "dec", tokenizer=tok)
    ak.EncoderModel(cfg).save_pretrained(root / "enc", tokenizer=tok)
    ak.DecoderLM(cfg).save_pretrained(root / "notok")
    ak.DecoderLM(cfg).save_pretrained(root / "badtok", tokenizer=tok)
    (root / "badtok" / "tokenizer.json").write_bytes(b"\xff\xfe{not utf-8")
    ak.DecoderLM(cfg).save_pretrained(root / "badcfg", tokenizer=tok)
    (root / "badcfg" / "config.json").write_bytes(b"\xff\xfe{not utf-8")
    (root / "file.txt").write_text("a regular file, so nothing can be created under it\n")
    (root / "latin1.toml").write_bytes("name = 'caf\xe9'\n".encode("latin-1"))
    (root / "unknown.toml").write_text("[train]\nlrr = 3e-4\n")
    (root / "wrongtype.toml").write_text('[train]\nsteps = "ten"\n')
    (root / "wrongtype2.toml").write_text('[model]\nd_model = "big"\n')
    (root / "section.toml").write_text("[trian]\nsteps = 10\n")
    (root / "invalid.toml").write_text("[train\nsteps =\n")
    return root


# (argv with {d} for the inputs' directory, exit status, a piece of the one-line message)
CASES = [
    # train: recipe files
    (["train", "{d}/unknown.toml"], 2, "unknown key 'train.lrr'"),
    (["train", "{d}/wrongtype.toml"], 2, "train.steps must be int, got 'ten'"),
    (["train", "{d}/wrongtype2.toml"], 2, "model.d_model must be int, got 'big'"),
    (["train", "{d}/section.toml"], 2, "unknown key 'trian'"),
    (["train", "{d}/invalid.toml"], 2, "invalid.toml: not a valid TOML file"),
    (["train", "{d}/latin1.toml"], 2, "latin1.toml: not a valid TOML file ('utf-8' codec"),
    (["train", "{d}/missing.toml"], 2, "missing.toml: no such recipe file"),
    (["train", "{d}"], 2, "no such recipe file"),
    (["train", SHAKESPEARE, "--set", "model.preset=nope"], 2, "unknown preset 'nope'"),
    (["train", SHAKESPEARE, "--set", "data.corpus=nope"], 2, "data.corpus must be one of"),
    (["train", SHAKESPEARE, "--set", "train.steps=0"], 2, "train.steps must be an int >= 1"),
    (["train", SHAKESPEARE, "--set", "train.lr=nan"], 2, "train.lr must be a number > 0"),
    (["train", SHAKESPEARE, "--set", "train.threads=-1"], 2, "train.threads must be an int >= 0"),
    (["train", SHAKESPEARE, "--set", "nodot"], 2, "--set nodot: expected KEY=VALUE"),
    (["train", SHAKESPEARE, "--out", "{d}/file.txt/run", *SMALL], 2, "--out: cannot create"),
    (["train", SHAKESPEARE, "--out", "{d}/file.txt", *SMALL], 2, "--out: cannot create"),
    # generate: paths
    (["generate", "{d}/missing", "hi"], 2, "CHECKPOINT: {d}/missing: no such file or directory"),
    (["generate", "--checkpoint", "{d}/missing", "hi"], 2, "--checkpoint: {d}/missing: no such"),
    (["generate", "--model", "{d}/missing", "hi"], 2, "--model: {d}/missing: no such"),
    (["generate", "{d}/file.txt", "hi"], 2, "not a model directory and not a file type"),
    (["generate", "{d}/enc", "hi"], 2, "generate needs a decoder-only language model"),
    (["generate", "{d}/notok", "hi"], 2, "has no tokenizer"),
    (["generate", "{d}/badtok", "hi"], 2, "tokenizer.json' is not a JSON file"),
    (["generate", "{d}/badcfg", "hi"], 2, "config.json: not valid JSON ('utf-8' codec"),
    # generate: prompts and numbers
    (["generate", "{d}/dec"], 2, "expected one prompt, got 0 arguments"),
    (
        ["generate", "{d}/dec", "", "--max-new-tokens", "200"],
        2,
        "lower --max-new-tokens to at most 127",
    ),
    (["generate", "{d}/dec", "l" * 128], 2, "max_len=128; shorten the prompt"),
    (["generate", "{d}/dec", "hi", "--max-new-tokens", "0"], 2, "--max-new-tokens must be a pos"),
    (["generate", "{d}/dec", "hi", "--max-new-tokens", "x"], 2, "--max-new-tokens: invalid int"),
    (["generate", "{d}/dec", "hi", "--max-new-tokens", "100000"], 2, "learned positions stop"),
    (["generate", "{d}/dec", "hi", "--temperature", "-1"], 2, "--temperature must be > 0"),
    (["generate", "{d}/dec", "hi", "--temperature", "nan"], 2, "--temperature must be > 0"),
    (["generate", "{d}/dec", "hi", "--top-p", "2"], 2, "--top-p must be in (0, 1]"),
    (["generate", "{d}/dec", "hi", "--top-k", "0"], 2, "--top-k must be a positive int"),
    (["generate", "{d}/dec", "hi", "--beam", "0"], 2, "--beam must be a positive int"),
    (["generate", "{d}/dec", "hi", "--seed", "x"], 2, "argument --seed: invalid int value"),
    (["generate", "{d}/dec", "hi", "--device", "cuda:7"], 2, "--device='cuda:7': torch sees"),
    (["translate", "{d}/dec", "hi", "--device", "cuda"], 2, "translate needs an encoder-decoder"),
    (["classify", "{d}/enc", "hi", "--device", "tpu"], 2, "argument --device: expected auto, cpu"),
    # evaluate
    (["evaluate", "{d}/missing"], 2, "CHECKPOINT: {d}/missing is not a directory"),
    (["evaluate", "{d}/file.txt"], 2, "is not a directory"),
    (["evaluate", "{d}/dec"], 2, "has no trainer_state.json or recipe.json"),
    (["evaluate", "{d}/dec", "--recipe", "{d}/missing.toml"], 2, "no such recipe file"),
    (["evaluate", "{d}/dec", "--recipe", "{d}/latin1.toml"], 2, "not a valid TOML file"),
    (["evaluate", "{d}/dec", "--batch-size", "0"], 2, "--batch-size: must be a positive"),
    (["evaluate", "{d}/dec", "--split", "bogus"], 2, "argument --split: invalid choice"),
    # translate, average, tune-length-penalty
    (["translate", "{d}/dec", "hi"], 2, "translate needs an encoder-decoder model"),
    (["translate", "{d}/dec", "hi", ""], 2, "SENTENCE 2: empty"),
    (["translate", "{d}/dec", "hi", "--length-penalty", "-1"], 2, "--length-penalty: must be"),
    (["average", "{d}/missing", "--out", "{d}/avg"], 2, "neither a model directory"),
    (["average", "{d}/dec", "{d}/enc", "--out", "{d}/avg"], 2, "another architecture"),
    (["average", "{d}/dec", "--last", "0", "--out", "{d}/avg"], 2, "--last: must be a positive"),
    (["average", "{d}/dec", "{d}/dec", "--out", "{d}/file.txt/avg"], 2, "cannot write"),
    (["tune-length-penalty", "{d}/dec"], 2, "has no trainer_state.json or recipe.json"),
    (["tune-length-penalty", "{d}/dec", "--beam", "1"], 2, "only matters for beam search"),
    # embed
    (["embed", "--model", "{d}/missing", "hi"], 2, "--model: {d}/missing: no such file"),
    (["embed", "--model", "{d}/enc"], 2, "give one or more sentences"),
    (["embed", "--model", "{d}/enc", ""], 2, "'' gives no tokens"),
    (["embed", "--model", "{d}/dec", "hi"], 2, "embed needs an encoder"),
    (["embed", "--model", "{d}/enc", "hi", "--max-length", "1"], 2, "--max-length: must be at"),
    (["embed", "hi"], 2, "required: --model"),
    # viz
    (["viz", "hi", "--model", "{d}/missing"], 2, "--model: {d}/missing: no such file"),
    (["viz", "hi", "--model", "{d}/badcfg"], 2, "config.json: not valid JSON"),
    (["viz", "hi", "--model", "{d}/notok"], 2, "has no tokenizer.json"),
    (["viz", ""], 2, "viz: a text gives no tokens"),
    (["viz", "hi", "--preset", "nope"], 2, "--preset: unknown preset 'nope'"),
    (["viz", "hi", "--html", "{d}/file.txt/r.html"], 2, "viz: cannot write the output"),
    (["viz", "hi", "--png", "{d}/file.txt/png"], 2, "viz: cannot write the output"),
    (["viz", "hi", "--bertviz", "{d}/file.txt/b.json"], 2, "viz: cannot write the output"),
    (["viz", "hi", "--family", "encoder-decoder"], 2, "needs --target TEXT"),
    # explain
    (["explain", "hi", "--model", "{d}/missing"], 2, "--model: {d}/missing: no such file"),
    (["explain", "hi", "--model", "{d}/badtok"], 2, "--model: load_tokenizer:"),
    (["explain", "hi", "--preset", "nope"], 2, "--preset: unknown preset 'nope'"),
    (["explain", "hi", "--layer", "99"], 2, "layer must be in [0, 2), got 99"),
    (["explain", "hi", "--head", "99"], 2, "head must be in [0, 4), got 99"),
    (["explain", "hi", "--dims", "-1"], 2, "--dims: must be a positive integer, got -1"),
    (["explain", "hi", "--query", "zz"], 2, "--query: 'zz' is not one of the tokens"),
    (["explain", "   "], 2, "the text gives no tokens"),
    (["explain", "--scores", "a,b"], 2, "--scores: expected comma-separated numbers"),
    (["explain", "--scores", "1,nan"], 2, "every score must be a finite number"),
    (["explain", "--causal", "100"], 2, "the size must be between 1 and 64"),
    (["explain", "scaling", "--png", "{d}/file.txt/s.png"], 2, "--png: cannot write"),
    (["explain", "complexity", "--budget", "0"], 2, "--budget: must be > 0 seconds"),
    # demo and the top level
    (["demo", "--train-seconds", "0"], 2, "--train-seconds: must be > 0, got 0.0"),
    (["demo", "--train-seconds", "-1"], 2, "--train-seconds: must be > 0, got -1.0"),
    (["demo", "--train-seconds", "x"], 2, "argument --train-seconds: invalid float value"),
    (["demo", "--out", "{d}/file.txt/demo", "--train-seconds", "1"], 2, "--out: cannot write"),
    (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
    (["models", "--bogus"], 2, "unrecognized arguments: --bogus"),
]


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 40
    commands = {argv[0] for argv, _, _ in CASES}
    assert {"train", "generate", "evaluate", "embed", "viz", "explain", "demo"} <= commands


@pytest.mark.parametrize(
    ("argv", "status", "message"), CASES, ids=[" ".join(c[0])[:60] for c in CASES]
)
def test_bad_input_gives_one_clear_line(d, capsys, argv, status, message):
    argv = [a.replace("{d}", str(d)) for a in argv]
    if argv[0] == "train" and "--out" not in argv:
        argv += ["--out", str(d / "runs" / "never")]
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert err.startswith("attnkit: error: ") and err.count("\n") == 1, err
    assert message.replace("{d}", str(d)) in err
    assert "Traceback" not in err + out
    assert not (d / "runs" / "never" / "checkpoint").exists()


def test_no_bad_input_wrote_under_the_regular_file(d):
    """Every case that pointed an output under file.txt left it a plain, unchanged file."""
    assert (d / "file.txt").is_file()
    assert (d / "file.txt").read_text().startswith("a regular file")


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["generate", "{d}/missing", "hi"], 2, "no such file or directory"),
        (["train", "{d}/wrongtype.toml"], 2, "train.steps must be int"),
    ],
)
def test_the_installed_entry_point_exit_status(d, argv, status, message):
    """The real `attnkit` script: exit status and a one-line stderr, no traceback."""
    exe = Path(sys.executable).with_name("attnkit")
    argv = [a.replace("{d}", str(d)) for a in argv]
    env = {**os.environ, "ATTNKIT_DEBUG": ""}
    done = subprocess.run([str(exe), *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == status, done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_an_unexpected_failure_exits_1_in_one_line(d, capsys, monkeypatch):
    """A failure that is not the user's input (here: the model cannot be run) is status 1."""

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure inside generate")

    monkeypatch.setattr(ak.DecoderLM, "generate", broken)
    monkeypatch.delenv("ATTNKIT_DEBUG", raising=False)
    assert main(["generate", str(d / "dec"), "hi", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err == "attnkit: error: RuntimeError: simulated failure inside generate\n"
