"""Every script in bench/ starts: its imports resolve and it answers ``--help`` without running
its measurements. (``bench/attention.py``, the first command of ``make bench``, once imported a
helper that had been removed from ``attnkit.explain.complexity``, and nothing ran it.)"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from attnkit import accel

BENCH = Path(__file__).parents[1] / "bench"

# Each script as ``python bench/NAME.py --help`` runs it (bench/ first on the path, so that
# the scripts import each other), all in one process so that torch is imported once.
HELP_ALL = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
results = {}
for path in sys.argv[2:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = ("ran without exiting", out.getvalue())
    except SystemExit as done:
        results[path] = (done.code, out.getvalue())
    except Exception as error:
        results[path] = (f"{type(error).__name__}: {error}", out.getvalue())
print("RESULTS" + json.dumps(results))
"""


# the modules the scripts share (no command line of their own)
HELPERS = {"common.py", "training_models.py"}


def test_every_bench_script_imports_and_answers_help():
    scripts = sorted(str(p) for p in BENCH.glob("*.py") if p.name not in HELPERS)
    assert len(scripts) >= 20
    for helper in HELPERS:  # a helper has no main; a script has one
        assert "__main__" not in (BENCH / helper).read_text(encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, str(BENCH), *scripts],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.split("RESULTS", 1)[1])
    failed = {Path(p).name: code for p, (code, _) in results.items() if code not in (0, None)}
    assert failed == {}
    for path, (_, text) in results.items():
        assert text.startswith(f"usage: {Path(path).name}"), (path, text[:200])


def test_the_attention_benchmark_runs(tmp_path):
    out = tmp_path / "attention.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "attention.py"), "--lengths", "64,128", "--repeats", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {(r["n"], r["implementation"]) for r in rows} == {
        (n, name)
        for n in (64, 128)
        for name in ("attnkit math", "attnkit fused", "torch.nn.MultiheadAttention")
    }
    assert all(r["forward_ms"] > 0 for r in rows)
    assert "ratios at each N" in done.stdout


def test_compile_time_skips_bf16_where_its_products_are_slow(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_compile_time", BENCH / "compile_time.py")
    compile_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_time)
    names = list(compile_time.CONFIGS)
    monkeypatch.setattr(accel, "bf16_products_fast", lambda: False)
    assert compile_time.runnable(names) == ["lm-small", "mt-small"]
    monkeypatch.setattr(accel, "bf16_products_fast", lambda: True)
    assert compile_time.runnable(names) == names
