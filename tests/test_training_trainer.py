"""The training loop: exact resume (bit for bit), atomic checkpoints, signals, divergence."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

import attnkit as ak
from attnkit.data import CharTokenizer
from attnkit.training import (
    LanguageModelTask,
    TrainConfig,
    Trainer,
    TrainingDiverged,
    find_checkpoint,
    load_checkpoint,
    read_trainer_state,
)
from attnkit.training import checkpoint as checkpoint_module

TEXT = "to be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "


pytestmark = pytest.mark.usefixtures("one_thread")


def make_task(block_size=16):
    tok = CharTokenizer.train([TEXT])
    ids = torch.tensor(tok.encode(TEXT * 5))  # 24 blocks of 16: 6 steps of 4 per epoch
    task = LanguageModelTask({"train": ids, "validation": ids[:200]}, block_size, seed=3)
    return task, tok


def make_model(vocab_size, dropout=0.1):
    torch.manual_seed(0)
    cfg = ak.ModelConfig.preset(
        "tiny", vocab_size=vocab_size, d_model=32, n_heads=2, n_layers=1, d_ff=64, max_len=16
    )
    return ak.DecoderLM(cfg.replace(dropout=dropout))


CONFIG = dict(
    steps=14,
    batch_size=4,
    lr=3e-3,
    warmup=3,
    eval_every=3,
    eval_batches=2,
    checkpoint_every=4,
    log_every=2,
    sample_tokens=0,
)


def make_trainer(run_dir, task_wrapper=None, **changes):
    task, tok = make_task()
    if task_wrapper is not None:
        task = task_wrapper(task)
    model = make_model(tok.vocab_size)
    return Trainer(model, task, TrainConfig(**{**CONFIG, **changes}), run_dir, tokenizer=tok)


def assert_same_run(a, b):
    for (name, p), (_, q) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entries in sa["state"].items():
        for name, value in entries.items():
            assert torch.equal(value, sb["state"][index][name]), (index, name)
    assert (a.state.step, a.state.epoch, a.state.batch_in_epoch) == (
        b.state.step,
        b.state.epoch,
        b.state.batch_in_epoch,
    )
    # the torch RNG state (dropout) each run saved with its last checkpoint
    assert a.state.torch_rng and a.state.torch_rng == b.state.torch_rng


def assert_json_or_safetensors(path):
    """``path`` is a JSON document, or a safetensors file: an 8-byte little-endian header
    length, a JSON header of dtypes, shapes and offsets, then exactly the bytes it describes."""
    data = path.read_bytes()
    if path.suffix == ".json":
        json.loads(data.decode("utf-8"))
        return
    assert path.suffix == ".safetensors", f"{path.name}: neither JSON nor safetensors"
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size].decode("utf-8"))
    spans = [t["data_offsets"] for name, t in header.items() if name != "__metadata__"]
    assert spans and max(end for _, end in spans) == len(data) - 8 - size, path.name
    with safe_open(path, "pt") as f:  # and the safetensors library reads it back
        assert set(f.keys()) == set(header) - {"__metadata__"}


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["split"], r["step"], r["loss"]) for r in records]


# --------------------------------------------------------------------------------------------
# Exact resume
# --------------------------------------------------------------------------------------------


def test_stop_and_resume_gives_the_same_parameters_bit_for_bit(tmp_path):
    straight = make_trainer(tmp_path / "straight")
    assert straight.fit().status == "finished"
    rng_straight = torch.get_rng_state()

    first = make_trainer(tmp_path / "resumed")
    result = first.fit(until=7)  # mid-epoch, between checkpoints, dropout on
    assert (result.status, result.step) == ("paused", 7)
    assert read_trainer_state(tmp_path / "resumed" / "checkpoint").step == 7
    torch.manual_seed(12345)  # whatever happens in between must not matter
    second = make_trainer(tmp_path / "resumed")
    assert second.resume() and second.state.step == 7
    assert (second.state.epoch, second.state.batch_in_epoch) == (1, 1)
    assert second.fit().status == "finished"

    assert_same_run(straight, second)
    assert torch.equal(torch.get_rng_state(), rng_straight)
    # The metrics agree too, but for the first train record after the resume, which averages
    # the loss over the steps since the stop only.
    assert [r for r in losses(tmp_path / "straight") if r[:2] != ("train", 8)] == [
        r for r in losses(tmp_path / "resumed") if r[:2] != ("train", 8)
    ]
    assert (tmp_path / "resumed" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_on_a_gpu_keeps_the_gpu_generator_too(tmp_path, monkeypatch):
    """Dropout on a GPU draws from the GPU's own generator, so a checkpoint of a run that used
    CUDA keeps its state and a resume puts it back (bench/history/: on an H200 a resumed run
    with dropout followed the straight one only so). No GPU here: torch.cuda's four calls
    are stood in for, with a generator state of 16 bytes."""
    gpu = {"state": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: gpu.update(state=state))
    assert make_trainer(tmp_path / "run").fit(until=2).status == "paused"
    gpu["state"] = torch.zeros(16, dtype=torch.uint8)  # the generator moves on
    resumed = make_trainer(tmp_path / "run")
    assert resumed.resume() and resumed.state.step == 2
    assert torch.equal(gpu["state"], torch.arange(16, dtype=torch.uint8))


def test_resume_without_a_checkpoint_changes_nothing(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    assert trainer.resume() is False and trainer.state.step == 0


def test_the_checkpoint_is_a_model_directory_and_stores_no_pickle(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    trainer.fit()
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "tokenizer.json",
        "trainer_state.json",
    ]
    loaded = ak.from_pretrained(ckpt)
    for (name, p), (_, q) in zip(
        trainer.model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 14 and state["torch_rng"] and state["task"]["name"] == "lm"
    for path in ckpt.iterdir():  # every file is JSON or safetensors, nothing else (no pickle)
        assert_json_or_safetensors(path)


# --------------------------------------------------------------------------------------------
# Atomic checkpoints
# --------------------------------------------------------------------------------------------


def test_a_write_that_fails_part_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path / "run", steps=8)
    trainer.fit(until=4)
    ckpt = tmp_path / "run" / "checkpoint"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def half_then_fail(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # part of a file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        trainer.fit()  # the checkpoint at step 8 fails
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")) == []
    monkeypatch.undo()
    again = make_trainer(tmp_path / "run", steps=8)
    assert again.resume() and again.state.step == 4


def test_a_kill_between_the_two_renames_is_repaired(tmp_path):
    trainer = make_trainer(tmp_path / "run", steps=4)
    trainer.fit()
    run = tmp_path / "run"
    os.replace(run / "checkpoint", run / ".checkpoint.old-999")  # the old one, moved aside
    (run / ".checkpoint.tmp-abc").mkdir()  # and an unfinished new one
    assert find_checkpoint(run) == run / "checkpoint"
    assert read_trainer_state(run / "checkpoint").step == 4
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch, attnkit as ak
    from attnkit.training import TrainerState, save_checkpoint
    from attnkit.training import checkpoint
    torch.set_num_threads(1)
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", d_model=128, n_layers=4, d_ff=512))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[5, 6, 7]])).sum().backward()
    optimizer.step()
    real_save_file = checkpoint.save_file

    def save_file(*args, **kwargs):  # the optimizer's tensors, after the model's files
        if step == 4:  # the fourth checkpoint stops half-written, and says so
            print("mid-write", flush=True)
            time.sleep(600)
        return real_save_file(*args, **kwargs)

    checkpoint.save_file = save_file
    step = 0
    while True:
        step += 1
        save_checkpoint(sys.argv[1], model=model, optimizer=optimizer,
                        state=TrainerState(step=step))
        print(step, flush=True)
    """
)


def test_sigkill_during_a_write_never_leaves_a_broken_checkpoint(tmp_path):
    """The child writes three checkpoints and stops in the middle of the fourth (the model's
    files written, the optimizer's not); the kill lands there, every time."""
    ckpt = tmp_path / "run" / "checkpoint"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(ckpt)], stdout=subprocess.PIPE, text=True
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
        assert lines == ["1", "2", "3", "mid-write"]
        unfinished = [p for p in ckpt.parent.iterdir() if p.name.startswith(".checkpoint.tmp-")]
        assert len(unfinished) == 1 and (unfinished[0] / "model.safetensors").is_file()
    finally:
        proc.kill()
        proc.wait()
    found = find_checkpoint(tmp_path / "run")
    assert found == ckpt
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny", d_model=128, n_layers=4, d_ff=512))
    optimizer = torch.optim.AdamW(model.parameters())
    assert load_checkpoint(found, model=model, optimizer=optimizer).step == 3
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["checkpoint"]


# --------------------------------------------------------------------------------------------
# Signals and divergence
# --------------------------------------------------------------------------------------------


class SignalAt:
    """The task, sending ``signum`` to this process while fetching the batch of step ``at``."""

    def __init__(self, task, at, signum):
        self.task, self.at, self.signum = task, at, signum
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.task, name)

    def train_batch(self, epoch, index, batch_size):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), self.signum)
        return self.task.train_batch(epoch, index, batch_size)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, signum):
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupted = make_trainer(tmp_path / "run", lambda task: SignalAt(task, 6, signum))
    result = interrupted.fit()
    assert (result.status, result.step, result.signal) == ("interrupted", 6, signum)
    assert read_trainer_state(tmp_path / "run" / "checkpoint").step == 6
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers

    resumed = make_trainer(tmp_path / "run")
    assert resumed.resume()
    resumed.fit()
    straight = make_trainer(tmp_path / "straight")
    straight.fit()
    assert_same_run(straight, resumed)


class BadAt:
    """The task, with a non-finite loss, or a non-finite gradient of the first parameter, at
    its ``at``-th loss."""

    def __init__(self, task, at, what, value):
        self.task, self.at, self.what, self.value, self.calls = task, at, what, value, 0

    def __getattr__(self, name):
        return getattr(self.task, name)

    def loss(self, model, batch, *, smoothing=0.0):
        self.calls += 1
        loss, count = self.task.loss(model, batch, smoothing=smoothing)
        if self.calls == self.at and self.what == "loss":
            loss = loss * self.value
        elif self.calls == self.at:  # the loss stays finite; one gradient does not

            def poison(grad):  # once
                handle.remove()
                return torch.full_like(grad, self.value)

            handle = next(model.parameters()).register_hook(poison)
        return loss, count


@pytest.mark.parametrize(
    ("what", "value", "message"),
    [
        ("loss", float("nan"), "the loss is nan"),
        ("loss", float("inf"), "the loss is inf"),
        ("gradient", float("nan"), "the gradient norm is nan"),
        ("gradient", float("inf"), "the gradient norm is inf"),
    ],
    ids=["nan-loss", "inf-loss", "nan-gradient", "inf-gradient"],
)
def test_a_non_finite_loss_or_gradient_stops_before_the_update_and_keeps_the_checkpoint(
    tmp_path, what, value, message
):
    trainer = make_trainer(tmp_path / "run", lambda task: BadAt(task, 7, what, value))
    with pytest.raises(TrainingDiverged, match=rf"{message} at step 7 .*checkpoint.*step 4"):
        trainer.fit()
    ckpt = tmp_path / "run" / "checkpoint"
    assert read_trainer_state(ckpt).step == 4
    reference = make_trainer(tmp_path / "ref")
    reference.fit(until=4)
    loaded = ak.from_pretrained(ckpt)
    for (name, p), (_, q) in zip(
        reference.model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    six = make_trainer(tmp_path / "six")
    six.fit(until=6)  # the bad step 7 changed nothing: the weights are those after step 6
    for (name, p), (_, q) in zip(
        six.model.state_dict().items(), trainer.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
    assert trainer.state.step == 6


def test_trainer_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"train\.steps must be an int >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match=r"train\.precision must be one of"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match=r"train\.beta2 must be in"):
        TrainConfig(beta2=1.5)
