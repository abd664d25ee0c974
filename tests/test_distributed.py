"""Data-parallel training under torchrun (2 CPU processes, gloo, loopback): the same losses and
parameters as one process with the same global batch, world-size independent checkpoints, and
a job that stops (instead of hanging) when a rank dies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attnkit as ak
from attnkit.cli import main
from attnkit.training.distributed import shard_batch, torchrun_env

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

SHAKESPEARE = str(Path(__file__).resolve().parent.parent / "examples" / "shakespeare-char.toml")
TOL = 1e-5


def tiny(steps, **changes):
    """A model and a run small enough for a test; a constant schedule so that a run of 10
    steps resumed to 20 follows the same learning rates as 20 steps straight. batch_size 7
    splits unevenly over 2 ranks (4 + 3 rows), which must still be exact."""
    values = {
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.n_layers": 1,
        "model.d_ff": 64,
        "model.dropout": 0.0,
        "data.block_size": 16,
        "data.max_chars": 20000,
        "train.steps": steps,
        "train.batch_size": 7,
        "train.lr": 3e-3,
        "train.schedule": "constant",
        "train.warmup": 3,
        "train.eval_every": 1000,
        "train.eval_batches": 1,
        "train.checkpoint_every": 1000,
        "train.log_every": 1,
        "train.sample_tokens": 0,
        "train.threads": 1,
        "train.precision": "fp32",
        **changes,
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def train_losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


def weights(run_dir):
    return load_file(str(Path(run_dir) / "checkpoint" / "model.safetensors"))


def max_difference(a, b):
    """The largest difference between two state dicts, leaving out the key biases.

    The gradient of a key bias is zero in exact arithmetic (softmax is unchanged when every
    score of a row moves by q . b_k), so what backward gives is float rounding noise, ~1e-10,
    and AdamW divides it by its own root mean square: those entries random-walk by ~lr per
    step in any two runs whose sums are ordered differently (measured: 7e-5 after 20 steps
    while every other weight agrees to 1e-7). They change no output; :func:`same_outputs`
    checks the models as functions."""
    assert a.keys() == b.keys()
    gaps = []
    for key in a:
        x, y = a[key].clone(), b[key].clone()
        if key.endswith("self_attn.in_proj.bias"):
            d = x.numel() // 3  # [q | k | v]
            x[d : 2 * d] = y[d : 2 * d] = 0
        gaps.append(float((x - y).abs().max()))
    return max(gaps)


def output_difference(run_a, run_b):
    """The largest difference of the two checkpoints' logits on a few validation blocks."""
    a, b = (ak.from_pretrained(Path(run) / "checkpoint") for run in (run_a, run_b))
    ids = torch.randint(0, a.cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((a(ids) - b(ids)).abs().max())


def clean_env():
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(*args, nproc=2, timeout=120):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "-m", "attnkit.train", *args]
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_shard_batch_takes_strided_rows():
    batch = {"input_ids": torch.arange(7 * 3).view(7, 3), "labels": torch.arange(7)}
    parts = [shard_batch(batch, r, 2) for r in range(2)]
    assert parts[0]["labels"].tolist() == [0, 2, 4, 6] and parts[1]["labels"].tolist() == [1, 3, 5]
    assert torch.equal(parts[1]["input_ids"], batch["input_ids"][1::2])
    assert shard_batch(batch, 0, 1) is batch


def test_torchrun_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not torchrun_env().enabled
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = torchrun_env()
    assert (env.rank, env.world, env.local_rank, env.is_main) == (1, 2, 1, False)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        torchrun_env()


def test_ddp_matches_one_process_and_resumes_across_world_sizes(tmp_path, capsys):
    # One process, global batch 7: 10 steps, a copy of that run, then resumed to 20 steps.
    single = tmp_path / "single"
    assert main(["train", SHAKESPEARE, "--out", str(single), "--quiet", *tiny(10)]) == 0
    shutil.copytree(single, tmp_path / "single-then-ddp")
    assert main(["train", SHAKESPEARE, "--out", str(single), "--resume", "--quiet", *tiny(20)]) == 0

    # The same run on 2 processes, through `attnkit train --nproc 2` (which runs torchrun).
    ddp = tmp_path / "ddp"
    command = [sys.executable, "-m", "attnkit.cli", "train", SHAKESPEARE, "--out", str(ddp)]
    done = subprocess.run(
        [*command, "--nproc", "2", *tiny(20)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchrun --standalone --nproc-per-node 2 -m attnkit.train" in done.stdout
    assert done.stdout.count("finished: step 20") == 1  # rank 0 alone reports
    assert "2 processes (ddp)" in done.stdout

    one, two = train_losses(single), train_losses(ddp)
    assert sorted(one) == sorted(two) == list(range(1, 21))
    loss_gap = max(abs(one[s] - two[s]) for s in one)
    weight_gap = max_difference(weights(single), weights(ddp))
    logit_gap = output_difference(single, ddp)
    print(
        f"\n1 vs 2 processes: max loss difference {loss_gap:.2e}, weights {weight_gap:.2e}, "
        f"logits {logit_gap:.2e}"
    )
    assert loss_gap < TOL and weight_gap < TOL and logit_gap < TOL
    assert one[20] < one[1] - 0.3  # it did learn something

    # The 1-process checkpoint of step 10 resumed on 2 processes: the same as 1 process.
    grown = tmp_path / "single-then-ddp"
    torchrun(SHAKESPEARE, "--out", str(grown), "--resume", "--quiet", *tiny(20))
    grown_losses = train_losses(grown)
    assert sorted(grown_losses) == list(range(1, 21))
    grow_gap = max(abs(grown_losses[s] - one[s]) for s in one)
    grow_weights = max_difference(weights(single), weights(grown))
    print(f"1 -> 2 process resume: max loss difference {grow_gap:.2e}, weights {grow_weights:.2e}")
    assert grow_gap < TOL and grow_weights < TOL

    # 10 steps on 2 processes (plain torchrun), resumed to 20 in one process: the same as the
    # uninterrupted 2-process run.
    half = tmp_path / "half"
    torchrun(SHAKESPEARE, "--out", str(half), "--quiet", *tiny(10))
    assert json.loads((half / "checkpoint" / "trainer_state.json").read_text())["step"] == 10
    resume = ["train", SHAKESPEARE, "--out", str(half), "--resume", "--quiet", *tiny(20)]
    assert main(resume) == 0
    resumed = train_losses(half)
    assert sorted(resumed) == list(range(1, 21))
    resume_gap = max(abs(resumed[s] - two[s]) for s in resumed)
    resume_weights = max_difference(weights(half), weights(ddp))
    resume_logits = output_difference(half, ddp)
    print(
        f"2 -> 1 process resume: max loss difference {resume_gap:.2e}, weights "
        f"{resume_weights:.2e}, logits {resume_logits:.2e}"
    )
    assert resume_gap < TOL and resume_weights < TOL and resume_logits < TOL


def test_a_dead_rank_stops_the_job(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "attnkit.train", SHAKESPEARE, "--out", str(out)]
    launcher = subprocess.Popen(
        [*command, "--quiet", *tiny(100000, **{"train.log_every": 1})],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2
        os.kill(int(children[-1]), signal.SIGKILL)  # one worker dies mid-run
        _, stderr = launcher.communicate(timeout=60)  # the launcher must not hang
        assert launcher.returncode != 0
        assert "attnkit.train FAILED" in stderr or "ChildFailedError" in stderr, stderr[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
