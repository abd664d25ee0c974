"""Fault injection into `attnkit train` (issue 12): SIGKILL at three points of a run, one of them
in the middle of a checkpoint write, then --resume to the same final step gives the same
parameters as an uninterrupted run, bit for bit; and a disk that fills up during a checkpoint
keeps the previous checkpoint intact, with a message that says why.

The trainer-level versions of these faults (a simulated ENOSPC in Trainer.fit, a kill between
the two renames, a child that does nothing but write checkpoints) are in
tests/test_training_trainer.py; SIGTERM through the command line in tests/test_training_cli.py.
"""

import errno
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.cli import main
from attnkit.training import checkpoint as checkpoint_module
from attnkit.training import find_checkpoint, read_trainer_state

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SHAKESPEARE = str(EXAMPLES / "shakespeare-char.toml")
pytestmark = pytest.mark.needs("shakespeare")
STEPS = 15
SETTINGS = {
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.n_layers": 1,
    "model.d_ff": 64,
    "model.dropout": 0.1,  # the resumed run must also restore the dropout RNG
    "data.block_size": 32,
    "data.max_chars": 30000,
    "train.steps": STEPS,
    "train.batch_size": 4,
    "train.lr": 3e-3,
    "train.warmup": 3,
    "train.eval_every": 5,
    "train.eval_batches": 1,
    "train.checkpoint_every": 5,
    "train.log_every": 1,
    "train.sample_tokens": 0,
    "train.threads": 1,
    "train.precision": "fp32",
}
TINY = [arg for key, value in SETTINGS.items() for arg in ("--set", f"{key}={value}")]
FILES = ("model.safetensors", "optimizer.safetensors")

# The child: `attnkit train` (attnkit.cli.main), with one hook that stops the process at a
# chosen point, prints PAUSED and waits there for the parent's SIGKILL.
#   batch:N       while fetching the N-th training batch (mid-run, between checkpoints)
#   write:N       in the N-th checkpoint's optimizer file, half of it written
#   after-save:N  just after the N-th checkpoint is complete, before the loop goes on
CHILD = textwrap.dedent(
    """
    import sys, time
    from attnkit import cli
    from attnkit.training import checkpoint, tasks, trainer

    where, n = sys.argv[1].split(":")
    n, calls = int(n), [0]

    def pause():
        print("PAUSED", flush=True)
        while True:
            time.sleep(1)

    def hook(original, before=False, half_file=False):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n and half_file:
                with open(args[1], "wb") as f:
                    f.write(b"\\x00" * 64)
                    f.flush()
                pause()
            if calls[0] == n and before:
                pause()
            result = original(*args, **kwargs)
            if calls[0] == n:
                pause()
            return result
        return wrapped

    if where == "batch":
        cls = tasks.LanguageModelTask
        cls.train_batch = hook(cls.train_batch, before=True)
    elif where == "write":
        checkpoint.save_file = hook(checkpoint.save_file, half_file=True)
    else:
        trainer.save_checkpoint = hook(trainer.save_checkpoint)
    sys.exit(cli.main(sys.argv[2:]))
    """
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's final checkpoint files."""
    out = tmp_path_factory.mktemp("straight") / "run"
    threads = torch.get_num_threads()
    try:
        assert main(["train", SHAKESPEARE, "--out", str(out), "--quiet", *TINY]) == 0
    finally:
        torch.set_num_threads(threads)
    return {name: (out / "checkpoint" / name).read_bytes() for name in FILES}


def kill_at(point: str, out: Path) -> None:
    """Run `attnkit train` in a child, stop it at ``point`` and SIGKILL it there."""
    argv = [sys.executable, "-c", CHILD, point, "train", SHAKESPEARE, "--out", str(out)]
    proc = subprocess.Popen(
        [*argv, "--quiet", *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # blocks until the hook has stopped the child
        assert line == "PAUSED\n", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def resume_and_compare(out: Path, saved_step: int, straight: dict, capsys) -> None:
    ckpt = find_checkpoint(out)  # what --resume sees; tidies a killed write away
    assert ckpt == out / "checkpoint"
    assert read_trainer_state(ckpt).step == saved_step
    assert isinstance(ak.from_pretrained(ckpt), ak.DecoderLM)  # loadable as it is
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    capsys.readouterr()
    assert main(["train", SHAKESPEARE, "--out", str(out), "--resume", *TINY]) == 0
    assert f"resuming at step {saved_step} " in capsys.readouterr().out
    assert read_trainer_state(out / "checkpoint").step == STEPS
    for name in FILES:
        assert (out / "checkpoint" / name).read_bytes() == straight[name], name
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in steps if r["split"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))  # no step lost, none counted twice


def test_sigkill_during_a_checkpoint_write_then_resume_is_exact(tmp_path, straight, capsys):
    """Killed with the step-10 checkpoint half written: the step-5 one is what resumes."""
    out = tmp_path / "run"
    kill_at("write:2", out)
    assert any(p.name.startswith(".checkpoint.tmp-") for p in out.iterdir())  # the torn write
    resume_and_compare(out, 5, straight, capsys)


@pytest.mark.slow
def test_sigkill_between_checkpoints_then_resume_is_exact(tmp_path, straight, capsys):
    """Killed while fetching the batch of step 8: steps 6-7 are lost and redone."""
    out = tmp_path / "run"
    kill_at("batch:8", out)
    resume_and_compare(out, 5, straight, capsys)


@pytest.mark.slow
def test_sigkill_right_after_a_checkpoint_then_resume_is_exact(tmp_path, straight, capsys):
    """Killed the moment the step-10 checkpoint is complete: nothing to redo."""
    out = tmp_path / "run"
    kill_at("after-save:2", out)
    resume_and_compare(out, 10, straight, capsys)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(
    tmp_path, straight, capsys, monkeypatch
):
    out = tmp_path / "run"
    ckpt = out / "checkpoint"
    real_save_file = checkpoint_module.save_file
    calls, before = [0], {}

    def fills_up(tensors, filename, *args, **kwargs):
        calls[0] += 1
        if calls[0] < 2:
            return real_save_file(tensors, filename, *args, **kwargs)
        before.update({p.name: p.read_bytes() for p in ckpt.iterdir()})  # step 5's files
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", fills_up)
    monkeypatch.delenv("ATTNKIT_DEBUG", raising=False)
    assert main(["train", SHAKESPEARE, "--out", str(out), "--quiet", *TINY]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "No space left on device" in err
    assert before and {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # intact
    assert read_trainer_state(ckpt).step == 5
    assert isinstance(ak.from_pretrained(ckpt), ak.DecoderLM)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []

    monkeypatch.undo()  # space again: the run continues from step 5 as if nothing happened
    resume_and_compare(out, 5, straight, capsys)
