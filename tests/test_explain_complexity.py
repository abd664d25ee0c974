"""`attnkit explain complexity`: the measurements, the fitted exponents, the plot."""

import json
import subprocess
import sys

from attnkit.cli import main
from attnkit.explain.complexity import ComplexityRow, fit_slopes


def test_math_memory_grows_as_n_squared_and_the_others_do_not():
    # a fixed list of lengths, every one measured whatever the machine's speed (no time budget),
    # in a fresh process, as `attnkit explain complexity` measures: resident-set peaks in the
    # test process depend on what earlier tests left in its allocator (after the suite's
    # training tests, math at N=512 peaked at 1.7-40 MiB, fused at 0; alone, 24 and 5)
    code = (
        "import math, json; from attnkit.explain.complexity import measure_complexity; "
        "rows = measure_complexity(lengths=(512, 1024), budget_s=math.inf, repeats=1); "
        "print(json.dumps([[r.variant, r.n, r.peak_mib] for r in rows]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak = {(variant, n): mib for variant, n, mib in json.loads(done.stdout)}
    assert sorted(peak) == [
        (v, n) for v in ("fused", "linear", "math", "window") for n in (512, 1024)
    ]
    # the math path holds N x N scores (8 heads * N^2 * 4 bytes): doubling N quadruples it
    assert peak[("math", 1024)] > 3 * peak[("math", 512)]
    # fused and linear never hold N x N: far less at the same N (window, w=256, only pulls
    # ahead for N >> 3w; its O(N w) scores are checked in test_efficient; small sizes are too
    # noisy to fit growth here: bench/complexity.py fits it over N up to 16384)
    for variant in ("fused", "linear"):
        assert peak[("math", 1024)] > 1.5 * peak[(variant, 1024)]


def test_fit_slopes_recovers_known_exponents():
    rows = [ComplexityRow("sq", n, n**2 / 1e3, n**2 / 1e3, n**2 / 1e4) for n in (1024, 2048, 4096)]
    rows += [ComplexityRow("lin", n, n / 10, n / 5, n / 100) for n in (1024, 2048, 4096)]
    slopes = fit_slopes(rows)
    assert abs(slopes["sq"]["forward"] - 2) < 1e-9 and abs(slopes["sq"]["memory"] - 2) < 1e-9
    assert abs(slopes["lin"]["backward"] - 1) < 1e-9


def test_the_command_prints_a_table_and_draws_the_plot(capsys, tmp_path):
    png = tmp_path / "complexity.png"
    assert main(["explain", "complexity", "--budget", "0.3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fitted exponent of N" in out and "linear" in out and "window" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["explain", "complexity", "--budget", "0"]) == 2
