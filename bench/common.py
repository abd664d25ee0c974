"""What every benchmark shares: the processor's description, how fast it moves memory, timing
candidates in interleaved rounds, and saving a run's figures as JSON with the CPU, the commit
and the command, for ``bench/report.py`` to table per CPU in docs/PERFORMANCE.md.

Every candidate of a benchmark runs in the same process with the same settings (threads,
malloc), so a ratio compares the code, not the process."""

from __future__ import annotations

import datetime
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkit import accel
from attnkit.accel import native

RESULTS = Path(__file__).with_name("results")  # bench/results/<cpu>/<bench>.json


SEED = 0


@dataclass
class Candidate:
    """One thing to time: ``run()`` does one unit of work (a training step, a matmul)."""

    name: str
    run: Callable[[], object]
    work: float  # tokens (or FLOPs) per run
    times: list[float] = field(default_factory=list)
    first: object = None  # what the first run returned (a training step: its loss)
    first_s: float = 0.0  # how long the first run took (a compiled step: compiling included)

    @property
    def rate(self) -> float:
        """Work per second, from the median time."""
        return self.work / statistics.median(self.times)


def training_levers(model, *, unpadded: bool = True):
    """Every lever of a training step, each by its public call, whatever the rules of this CPU
    choose (``accel.prepare`` follows them): the fused loss, the unpadded stacks, oneDNN's
    products (each call then takes oneDNN or MKL as ``accel.onednn_linear`` says) and the
    attention kernel. A benchmark compares them on and off. The switches' environment
    variables are read here, as ``accel.prepare`` reads them."""
    accel.levers("training")
    model = accel.fuse_lm_loss(model)
    if unpadded:
        model = accel.unpad_stacks(model)
    return accel.use_attention_kernel(accel.use_onednn_products(model))


def measure(candidates: list[Candidate], repeats: int, warmup: int) -> None:
    """Time every candidate ``repeats`` times, interleaved, after ``warmup`` untimed rounds.
    Each round runs them in a new order (shuffled, seeded), so that no candidate always
    follows the same one: the step after a 4096 x 4096 bf16 product ran 4-14% slower, and a
    step that follows one which handed much memory back to the kernel faults its own memory in
    again (bench/history/: 26,925 page faults a step for the candidate that always came after
    the bf16 products when each round only started one candidate further on, 0 in the median
    round when shuffled)."""
    order = random.Random(SEED)
    for round_ in range(warmup + repeats):
        shuffled = list(candidates)
        order.shuffle(shuffled)
        for c in shuffled:
            start = time.perf_counter()
            result = c.run()
            elapsed = time.perf_counter() - start
            if round_ == 0:
                c.first, c.first_s = result, elapsed
            if round_ >= warmup:
                c.times.append(elapsed)


# where accel.bf16_products_fast() is False (an AVX2-only CPU such as Zen 3): a round of the
# bf16 candidates, the 4096 x 4096 bf16 product among them, would take most of the run
SLOW_BF16 = (
    "torch has no fast bf16 products on this CPU (accel.bf16_products_fast() is False): they "
    "fall back to a scalar loop, about 100x slower than float32 at 512 x 512"
)


def cpu_description() -> str:
    """The processor as lscpu names it: model name, family and model, so that figures from
    different CPUs are never read as if they were comparable."""
    c = native.cpu()
    return f"{c['model_name']}, family {c['family']}, model {c['model']}, {c['cpus']} CPU(s)"


def memory_rates(sizes_mib: tuple[int, ...] = (1, 64)) -> dict[str, float]:
    """Bytes read and written per second by a float32 tensor copy of each size (torch's threads;
    the median of several copies): how fast this machine moves data inside its caches and
    beyond them. Machines that report the same processor (cloud machines) can differ here, and
    much of a step's work outside its products reads and writes memory (bench/history/)."""
    rates = {}
    for mib in sizes_mib:
        src = torch.ones(mib << 18)  # mib MiB of float32
        dst = torch.empty_like(src)
        times = []
        for _ in range(max(6, 256 // mib)):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        rates[f"{mib} MiB"] = 2 * src.nbytes / statistics.median(times[1:])
    return rates


def llama_cpp_n_batch(model: Path, threads: int) -> int:
    """The prompt batch llama.cpp can run here: 512 (its default), or 1 where its batched
    prompt path dies of a signal (llama-cpp-python 0.3.36 built with GGML_NATIVE: SIGILL on one
    Intel Xeon with AMX, SIGSEGV on another), found by trying it once in a child process. Says
    so when it is 1."""
    code = (
        "import sys; from llama_cpp import Llama; "
        "llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=64, "
        "verbose=False); llm.eval(llm.tokenize(b'The animal did not cross the street', "
        "add_bos=False))"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code, str(model), str(threads)], capture_output=True, timeout=300
    )
    if probe.returncode < 0:
        name = signal.Signals(-probe.returncode).name
        print(f"llama.cpp: {name} in its batched prompt path on this CPU; n_batch=1 instead")
        return 1
    return 512


def save_results(bench: str, figures: dict, path: Path | None = None) -> Path:
    """Write ``figures`` as ``runs/bench/<bench>.json`` (or ``path``) with what makes them
    comparable: the CPU, torch's version and threads, the commit, the date and the command.
    ``python bench/report.py --record FILE`` keeps such a file in bench/results/."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()  # fmt: skip
    record = {
        "bench": bench,
        "cpu": native.cpu(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "commit": commit or "unknown",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "figures": figures,
    }
    path = path or Path("runs/bench") / f"{bench}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path
