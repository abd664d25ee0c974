"""Data-parallel and sharded training under torchrun (2 CPU processes, gloo, loopback): DDP and
FSDP give the same losses and parameters as one process with the same global batch (with and
without gradient accumulation, with clipping active), checkpoints that resume across world
sizes and strategies, and a job that stops (instead of hanging) when a rank dies."""

import contextlib
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
# How far a distributed run may stray from one process over 20 steps (float sums in another
# order); README.md quotes the loss bound. Measured: losses 3e-7 to 7e-7, weights up to 2e-7,
# logits up to 2.3e-6, AdamW moments 7e-9.
LOSS_TOL, WEIGHT_TOL, LOGIT_TOL, MOMENT_TOL = 2e-6, 1e-6, 1e-5, 1e-7


def tiny(steps, **changes):
    """A model and a run small enough for a test; a constant schedule so that a run of 10
    steps resumed to 20 follows the same learning rates as 20 steps straight. batch_size 7
    splits unevenly over 2 ranks (4 + 3 rows), which must still be exact. The gradient norm
    of this model is 0.7-1.8 over these 20 steps: clip 0.4 clips every one of them."""
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
        "train.clip": 0.4,
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


def test_nproc_runs_the_same_command_under_torchrun(monkeypatch, capsys):
    # `attnkit train ... --nproc N` hands every option on to torchrun's workers (the runs
    # below go through it end to end once; this checks each option without a launch).
    launched = []

    def run(command, check):
        launched.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", run)
    options = ["--set", "train.steps=3", "--out", "o", "--init", "w", "--resume", "--quiet"]
    options += ["--precision", "bf16", "--device", "cpu", "--compile", "--strategy", "fsdp"]
    assert main(["train", SHAKESPEARE, "--nproc", "3", *options]) == 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", "3", "-m", "attnkit.train", SHAKESPEARE]
    assert launched == [launcher + options]
    assert capsys.readouterr().out == ""  # --quiet: not even the torchrun line
    # what every worker would refuse is refused once, before a launch: a bad recipe key, or a
    # device the workers cannot take (each takes its own GPU, or here the CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in (
        (["--set", "train.lrr=1"], "unknown key 'train.lrr'"),
        (["--set", "train.batch_size=1"], "train.batch_size=1 cannot feed 2 process(es)"),
        (
            ["--device", "cuda"],
            "train.device='cuda' under torchrun: each process trains on the CPU",
        ),
    ):
        assert main(["train", SHAKESPEARE, "--nproc", "2", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert len(launched) == 1


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """One process, global batch 7: 10 steps (a copy is kept: "at-10"), then resumed to 20.
    Returns (the 20-step run, the 10-step copy)."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("single")
    run = root / "run"
    try:
        assert main(["train", SHAKESPEARE, "--out", str(run), "--quiet", *tiny(10)]) == 0
        shutil.copytree(run, root / "at-10")
        resume = ["train", SHAKESPEARE, "--out", str(run), "--resume", "--quiet", *tiny(20)]
        assert main(resume) == 0
    finally:
        torch.set_num_threads(threads)
    return run, root / "at-10"


def compare(run, reference, what):
    """``run`` against ``reference``: both logged steps 1-20; the largest differences of their
    losses, weights and logits are printed and must be below their tolerances."""
    a, b = train_losses(run), train_losses(reference)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    loss = max(abs(a[s] - b[s]) for s in a)
    weight = max_difference(weights(run), weights(reference))
    logit = output_difference(run, reference)
    print(f"\n{what}: max difference: loss {loss:.2e}, weights {weight:.2e}, logits {logit:.2e}")
    assert loss < LOSS_TOL and weight < WEIGHT_TOL and logit < LOGIT_TOL


@pytest.mark.needs("shakespeare")
def test_gradient_accumulation_in_one_process(single_run, tmp_path, capsys):
    # 7 rows as 3 micro-batches (3 + 2 + 2) give the same run as the 7 rows at once.
    single, _ = single_run
    run = tmp_path / "micro"
    accumulate = tiny(20, **{"train.accumulate": 3})
    assert main(["train", SHAKESPEARE, "--out", str(run), "--quiet", *accumulate]) == 0
    with capsys.disabled():
        compare(run, single, "accumulate 3 vs 1")
    bad = ["train", SHAKESPEARE, "--out", str(tmp_path / "x"), *tiny(2, **{"train.accumulate": 8})]
    assert main(bad) == 2  # 7 rows cannot make 8 micro-batches: a usage error, one line
    assert "train.accumulate=8" in capsys.readouterr().err


@pytest.mark.needs("shakespeare")
def test_ddp_matches_one_process_and_resumes_across_world_sizes(single_run, tmp_path):
    single, at_10 = single_run
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
    compare(ddp, single, "1 vs 2 processes")
    one = train_losses(single)
    assert one[20] < one[1] - 0.3  # it did learn something

    # The 1-process checkpoint of step 10 resumed on 2 processes: the same as 1 process.
    grown = tmp_path / "single-then-ddp"
    shutil.copytree(at_10, grown)
    torchrun(SHAKESPEARE, "--out", str(grown), "--resume", "--quiet", *tiny(20))
    compare(grown, single, "1 -> 2 process resume")

    # 10 steps on 2 processes (plain torchrun), resumed to 20 in one process: the same as the
    # uninterrupted 2-process run.
    half = tmp_path / "half"
    torchrun(SHAKESPEARE, "--out", str(half), "--quiet", *tiny(10))
    assert json.loads((half / "checkpoint" / "trainer_state.json").read_text())["step"] == 10
    triple = tmp_path / "half-then-3"
    shutil.copytree(half, triple)
    assert main(["train", SHAKESPEARE, "--out", str(half), "--resume", "--quiet", *tiny(20)]) == 0
    compare(half, ddp, "2 -> 1 process resume")

    # The same 2-process checkpoint resumed on 3 processes (7 rows: 3 + 2 + 2; 3 processes
    # start in 18 s on 2 cores, 4 in 24 s).
    done = torchrun(SHAKESPEARE, "--out", str(triple), "--resume", *tiny(20), nproc=3, timeout=240)
    assert "3 processes (ddp)" in done.stdout
    compare(triple, ddp, "2 -> 3 process resume")


@pytest.mark.needs("shakespeare")
def test_fsdp_matches_one_process_and_resumes_across_world_sizes(single_run, tmp_path):
    single, at_10 = single_run
    fsdp_options = ("--strategy", "fsdp")
    # FSDP on 2 processes, each rank's rows (4 and 3) in 2 micro-batches: the same as 1 process.
    fsdp = tmp_path / "fsdp"
    micro = tiny(20, **{"train.accumulate": 2})
    done = torchrun(SHAKESPEARE, "--out", str(fsdp), *fsdp_options, *micro)
    assert "2 processes (fsdp)" in done.stdout and "in 2 micro-batches" in done.stdout
    assert done.stdout.count("finished: step 20") == 1
    compare(fsdp, single, "1 process vs FSDP on 2")
    # The optimizer state gathered from the shards is the single process's, entry for entry.
    a, b = (load_file(str(run / "checkpoint" / "optimizer.safetensors")) for run in (fsdp, single))
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a if k.endswith(".step"))
    moment_gap = max(float((a[k] - b[k]).abs().max()) for k in a if not k.endswith(".step"))
    print(f"optimizer state: max difference {moment_gap:.2e}")
    assert moment_gap < MOMENT_TOL
    meta = [
        json.loads((run / "checkpoint" / "optimizer.json").read_text()) for run in (fsdp, single)
    ]
    assert meta[0] == meta[1]  # the same parameter numbering and groups

    # The 1-process checkpoint of step 10 resumed under FSDP (weights and moments sharded).
    grown = tmp_path / "single-then-fsdp"
    shutil.copytree(at_10, grown)
    torchrun(SHAKESPEARE, "--out", str(grown), "--resume", "--quiet", *fsdp_options, *tiny(20))
    compare(grown, single, "1 -> FSDP 2 resume")

    # 10 steps under FSDP, resumed to 20 in one process: the same as 20 steps under FSDP.
    half = tmp_path / "fsdp-half"
    torchrun(SHAKESPEARE, "--out", str(half), "--quiet", *fsdp_options, *tiny(10))
    assert main(["train", SHAKESPEARE, "--out", str(half), "--resume", "--quiet", *tiny(20)]) == 0
    compare(half, fsdp, "FSDP 2 -> 1 resume")


@pytest.mark.needs("shakespeare")
def test_mixture_of_experts_trains_under_both_strategies(tmp_path):
    # Top-1 of 4 experts on 3-4 rows per rank: some experts get no token on one rank and some on
    # the other. Both strategies need every rank to have the same gradients to reduce (FSDP's
    # reduce-scatter would stop with a size mismatch): in training every expert runs, on no
    # rows if none chose it. The runs follow one process (routing near a tie can flip with
    # rounding, hence a looser bound than the dense model's).
    moe = tiny(8, **{"model.n_experts": 4, "model.moe_top_k": 1})
    single = tmp_path / "single"
    assert main(["train", SHAKESPEARE, "--out", str(single), "--quiet", *moe]) == 0
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        torchrun(SHAKESPEARE, "--out", str(run), "--quiet", "--strategy", strategy, *moe)
        one, two = train_losses(single), train_losses(run)
        assert sorted(two) == list(range(1, 9))
        assert max(abs(one[s] - two[s]) for s in one) < 1e-3, strategy


@contextlib.contextmanager
def long_run(out, *options):
    """A 2-process torchrun of a very long run, yielded once it has logged two steps; killed
    (its whole session) if it is still running when the block ends."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "attnkit.train", SHAKESPEARE, "--out", str(out)]
    launcher = subprocess.Popen(
        [*command, *options, *tiny(100000, **{"train.log_every": 1})],
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
        yield launcher
    finally:
        if launcher.poll() is None:
            # a hung job: kill its workers too (torchrun starts them in groups of their own)
            children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
            for pid in map(int, children.read_text().split() if children.exists() else []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.needs("shakespeare")
def test_a_dead_rank_stops_the_job(tmp_path):
    with long_run(tmp_path / "run", "--quiet") as launcher:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2
        os.kill(int(children[-1]), signal.SIGKILL)  # one worker dies mid-run
        _, stderr = launcher.communicate(timeout=60)  # the launcher must not hang
        assert launcher.returncode != 0
        assert "attnkit.train FAILED" in stderr or "ChildFailedError" in stderr, stderr[-3000:]


def _worker_of_rank(launcher_pid: int, rank: int) -> int:
    """The PID of torchrun's worker with RANK=rank (read from the worker's environment)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


@pytest.mark.needs("shakespeare")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_one_worker_stops_every_worker_after_the_same_step(tmp_path, signum):
    """The signal reaches rank 1 only. The stop flag travels with the step's all-reduce, so both
    ranks finish the same step; rank 0 saves that step's checkpoint, and the job ends (a rank
    that stopped one step early or late would leave the other waiting in a collective)."""
    out = tmp_path / "run"
    with long_run(out) as launcher:
        os.kill(_worker_of_rank(launcher.pid, 1), signum)
        stdout, stderr = launcher.communicate(timeout=90)  # every worker stops: no hang
    stopped = [line for line in stdout.splitlines() if ": stopped at step" in line]
    assert len(stopped) == 1, stdout[-3000:]  # rank 0 alone reports
    step = int(stopped[0].split(": stopped at step")[1].split()[0].strip(",;:"))
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == step >= 2
    # rank 0 learnt of the stop through the all-reduce (it names it SIGTERM); the workers leave
    # after the save's barrier with 128 + the signal, and torchrun reports that, in either order
    assert stopped[0].startswith("SIGTERM: stopped at step")
    assert launcher.returncode != 0 and "ChildFailedError" in stderr, stderr[-3000:]
