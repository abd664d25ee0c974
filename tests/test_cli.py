"""The attnkit command: --help, --version, explain, and its exit codes."""

import math
import subprocess
import sys

import pytest

import attnkit
import attnkit as ak
from attnkit.cli import main
from attnkit.config import PRESETS


def _rows(text):
    return [line.split() for line in text.splitlines()]


def test_explain_scores_prints_the_softmax_table(capsys):
    scores = [0.1, 0.3, 0.2, 0.5, 0.1, 1.2]
    tokens = ["今天", "下雨", "我", "没", "带", "伞"]
    assert (
        main(["explain", "--scores", ",".join(map(str, scores)), "--tokens", ",".join(tokens)]) == 0
    )
    out = capsys.readouterr().out
    total = sum(math.exp(s) for s in scores)
    rows = {row[0]: row for row in _rows(out) if row and row[0] in tokens}
    for token, s in zip(tokens, scores, strict=True):
        _, score, exp, weight = rows[token]
        assert float(score) == pytest.approx(s)
        assert float(exp) == pytest.approx(math.exp(s), abs=1e-4)
        assert float(weight) == pytest.approx(math.exp(s) / total, abs=1e-4)
    sum_row = next(row for row in _rows(out) if row and row[0] == "sum")
    assert float(sum_row[-1]) == pytest.approx(1.0)
    assert float(rows["下雨"][-1]) == pytest.approx(0.1384, abs=1e-4)  # the notes' self-test Q3
    assert float(rows["没"][-1]) == pytest.approx(0.1691, abs=1e-4)


def test_explain_scores_with_d_k_divides_by_its_root(capsys):
    assert main(["explain", "--scores", "2,8,4", "--d-k", "16"]) == 0
    rows = [row for row in _rows(capsys.readouterr().out) if row and row[0] in ("t0", "t1", "t2")]
    assert [float(r[2]) for r in rows] == [0.5, 2.0, 1.0]
    total = sum(math.exp(s) for s in (0.5, 2.0, 1.0))
    assert float(rows[1][-1]) == pytest.approx(math.exp(2.0) / total, abs=1e-4)


def test_explain_causal_prints_minus_inf_above_the_diagonal(capsys):
    assert main(["explain", "--causal", "4"]) == 0
    rows = [
        row[1:]
        for row in _rows(capsys.readouterr().out)
        if row and row[0] in ("t0", "t1", "t2", "t3")
    ]
    assert rows == [
        ["0", "-inf", "-inf", "-inf"],
        ["0", "0", "-inf", "-inf"],
        ["0", "0", "0", "-inf"],
        ["0", "0", "0", "0"],
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain"], "--scores"),
        (["explain", "--scores", "1,x"], "--scores"),
        (["explain", "--scores", "1,inf"], "finite"),
        (["explain", "--scores", "1,2", "--tokens", "a"], "--tokens"),
        (["explain", "--scores", "1,2", "--d-k", "0"], "--d-k"),
        (["explain", "--causal", "0"], "--causal"),
        (["explain", "--causal", "four"], "--causal"),
        (["explain", "--no-such-option"], "--no-such-option"),
        (["models", "--bogus"], "--bogus (see 'attnkit models --help')"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_the_installed_command_help_and_version(capsys):
    for module in ("attnkit", "attnkit.cli"):  # python -m attnkit, python -m attnkit.cli
        command = [sys.executable, "-m", module, "--version"]
        version = subprocess.run(command, capture_output=True, text=True, check=True)
        assert version.stdout.strip() == f"attnkit {attnkit.__version__}"
    # the rest in this process (each new one costs CI seconds of imports)
    for argv in (["--help"], ["explain", "--help"]):
        with pytest.raises(SystemExit) as exited:  # argparse prints the help and exits
            main(argv)
        assert exited.value.code == 0, argv
    assert main(["explain", "--causal", "x"]) == 2
    out, err = capsys.readouterr()
    assert "explain" in out and "--scores" in out and "--causal" in out
    assert err.count("\n") == 1  # the bad value: one line


def test_models_lists_presets_with_known_parameter_counts(capsys):
    assert main(["models"]) == 0
    rows = {row[0]: row for row in _rows(capsys.readouterr().out) if row}
    count = {name: int(rows[name][-1].replace(",", "")) for name in rows if name in PRESETS}
    assert count["gpt2-small"] == 124_439_808  # Hugging Face GPT-2 small, tied head
    assert count["bert-base"] == 108_891_648  # BERT-base without the pooler
    assert abs(count["paper-base"] - 65e6) / 65e6 < 0.05  # the paper's Table 3: 65M
    assert abs(count["paper-big"] - 213e6) / 213e6 < 0.02  # and 213M
    assert rows["paper-base"][1:6] == ["encoder-decoder", "6+6", "512", "8", "2048"]
    with_pooler = ak.EncoderModel(ak.ModelConfig.preset("bert-base", pooler=True, max_len=512))
    assert with_pooler.num_parameters() == 109_482_240


def test_explain_scaling_prints_variances_near_d_k_and_draws_the_plot(capsys, tmp_path):
    png = tmp_path / "scaling.png"
    assert main(["explain", "scaling", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [row for row in _rows(out) if row and row[0] in ("4", "16", "64", "256", "512")]
    assert [int(r[0]) for r in rows] == [4, 16, 64, 256, 512]
    for r in rows:
        assert abs(float(r[1]) / int(r[0]) - 1) < 0.05  # Var[q.k] within 5% of d_k
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["explain", "--png", str(png)]) == 2  # --png needs a topic


@pytest.mark.needs("smollm2")
def test_the_commands_speculate_and_refuse_in_one_line(capsys):
    prompt = "Repeat: the animal was too tired. Again: the animal"
    assert main(["generate", "smollm2", prompt, "--greedy", "--max-new-tokens", "8"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "smollm2", prompt, "--greedy", "--max-new-tokens", "8",
                 "--speculate", "4"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out == plain and "draft tokens kept" in err
    for argv, message in [
        (["--speculate", "4", "--beam", "2"], "--speculate cannot be combined with --beam"),
        (["--speculate", "16"], r"--speculate: the draft length must be an int in [1, 15]"),
        (["--speculate", "2", "--draft", "gemma3"], "--draft: gemma3's tokenizer is not the"),
        (["--draft", "smollm2"], "--draft drafts for --speculate K"),
    ]:
        assert main(["generate", "smollm2", "x", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert main(["chat", "smollm2", "--speculate", "3"]) == 2
    assert "give --temperature 0" in capsys.readouterr().err
