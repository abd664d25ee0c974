"""bench/training.py's report: the per-round spread printed beside each ratio pairs the steps of
one round, the bf16 row divides the step's gain by the products' gain round by round, and a
target counts as met only where the ratio and the rounds' median both reach it."""

import importlib.util
import statistics
import sys
import warnings
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # as `python bench/training.py` runs: its helpers beside it
SPEC = importlib.util.spec_from_file_location("bench_training", BENCH / "training.py")
training = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = training  # dataclasses look their module up there
with warnings.catch_warnings():  # x-transformers, imported there, calls torch.jit.script
    warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
    SPEC.loader.exec_module(training)


def row(times):
    return {"per_s": 1.0 / statistics.median(times), "times_s": times}


def test_the_spread_pairs_the_steps_of_one_round():
    # attnkit is twice as fast as GPT-2 in every round, while the machine speed varies 5x: the
    # ratio of each round is 2, although the times themselves spread widely
    ours = [0.3, 0.1, 0.5, 0.2, 0.4]
    results = {"lm": {"attnkit fp32": row(ours), "HF GPT-2 fp32": row([2 * t for t in ours])}}
    results["ratios"] = training.ratios(results, {})
    assert results["ratios"]["lm-small fp32: attnkit / HF GPT-2"] == pytest.approx(2.0)
    spread = training.spreads(results)
    assert spread["lm-small fp32: attnkit / HF GPT-2"] == pytest.approx([2.0, 2.0, 2.0])


def test_the_spread_shows_rounds_that_disagree():
    ours = [1.0] * 8
    gpt2 = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]
    results = {"mt": {"attnkit fp32": row(ours), "torch.nn.Transformer fp32": row(gpt2)}}
    results["ratios"] = training.ratios(results, {})
    low, mid, high = training.spreads(results)["mt-small fp32: attnkit / torch.nn.Transformer"]
    assert low < results["ratios"]["mt-small fp32: attnkit / torch.nn.Transformer"] < high
    assert (low, mid, high) == pytest.approx(statistics.quantiles(gpt2, n=4))


def test_attnkit_is_compared_with_itself_compiled_and_without_onednn():
    # the same step twice (torch's GEMM the default) gives 1; compiled layers 10% faster, 1.1
    eager = [1.0, 1.2, 0.9, 1.1]
    results = {
        "lm": {
            "attnkit fp32": row(eager),
            "attnkit no oneDNN fp32": row(list(eager)),
            "attnkit compiled fp32": row([t / 1.1 for t in eager]),
        }
    }
    results["ratios"] = training.ratios(results, {})
    assert results["ratios"]["lm-small fp32: attnkit / attnkit no oneDNN"] == pytest.approx(1.0)
    assert results["ratios"]["lm-small fp32: attnkit compiled / attnkit"] == pytest.approx(1.1)
    spread = training.spreads(results)
    assert spread["lm-small fp32: attnkit / attnkit no oneDNN"] == pytest.approx([1.0] * 3)
    assert spread["lm-small fp32: attnkit compiled / attnkit"] == pytest.approx([1.1] * 3)
    assert not any(name.startswith("mt-small") for name in results["ratios"])


def test_the_bf16_spread_divides_gains_of_the_same_round():
    # round by round the step gains 2x from bf16 and the products 2.5x: 0.8 in every round
    fp32 = [1.0, 2.0, 3.0, 4.0]
    results = {
        "lm": {"attnkit fp32": row(fp32), "attnkit bf16": row([t / 2 for t in fp32])},
        "products": {
            "lm-small products fp32": row(fp32),
            "lm-small products bf16": row([t / 2.5 for t in fp32]),
        },
    }
    results["ratios"] = training.ratios(results, {})
    name = "lm-small: (attnkit bf16 / fp32) / (products bf16 / fp32)"
    assert results["ratios"][name] == pytest.approx(0.8)
    assert training.spreads(results)[name] == pytest.approx([0.8, 0.8, 0.8])


def test_a_target_is_met_only_by_both_the_value_and_the_rounds(capsys):
    # a run of this machine (bench/history/): the ratio of the medians 1.07, the rounds' median
    # 0.78, against 0.8
    assert training.verdict(1.07, [0.70, 0.78, 0.82], 0.8) == "NOT met"
    assert training.verdict(1.28, [1.25, 1.31, 1.35], 1.3) == "NOT met"
    assert training.verdict(1.31, [1.25, 1.30, 1.35], 1.3) == "met"
    assert training.verdict(0.46, None, 0.45) == "met"  # MFU: no rounds
    name = "lm-small fp32: attnkit / HF GPT-2"
    training.print_report(
        {"threads": 2, "repeats": 8, "adamw": "fused", "ratios": {name: 1.33},
         "spreads": {name: [1.25, 1.29, 1.35]}}
    )  # fmt: skip
    line = next(x for x in capsys.readouterr().out.splitlines() if name in x)
    assert line.split()[-2:] == ["NOT", "met"] and "1.290 (1.25-1.35)" in line
    training.print_report(
        {"threads": 2, "repeats": 8, "adamw": "fused", "ratios": {name: 1.2972},
         "spreads": {name: [1.25, 1.31, 1.35]}}
    )  # fmt: skip
    line = next(x for x in capsys.readouterr().out.splitlines() if name in x)
    assert "1.297x" in line and line.endswith("NOT met")  # not "1.30x ... NOT met"


def test_the_report_says_when_the_no_onednn_rows_run_the_same_code(capsys):
    base = {"threads": 2, "repeats": 1, "adamw": "fused", "ratios": {}, "lm": {}}
    twins = "each row and its 'no oneDNN' twin run the same code"
    for on, said in ((False, True), (True, False)):
        training.print_report({**base, "onednn": {"on": on, "by": "measured"}})
        assert (twins in capsys.readouterr().out) == said


def test_the_report_prints_how_fast_memory_moves(capsys):
    rates = training.memory_rates((1, 2))
    assert set(rates) == {"1 MiB", "2 MiB"} and all(rate > 1e8 for rate in rates.values())
    training.print_report(
        {"threads": 2, "repeats": 1, "adamw": "fused", "ratios": {}, "memory": rates}
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory:"))
    assert "GB/s in 1 MiB" in line and "GB/s in 2 MiB" in line and "(2 threads)" in line


def test_each_round_times_every_candidate_once_and_no_one_always_follows_the_same():
    """A step pays for what the step before it left behind (page faults after a reference
    handed its memory back), so the rounds shuffle the order: over 20 rounds every candidate
    has more than one predecessor, and each round times each candidate once."""
    log = []
    names = [f"c{i}" for i in range(6)]
    candidates = [training.Candidate(n, lambda n=n: log.append(n), 1.0) for n in names]
    training.measure(candidates, repeats=20, warmup=1)
    assert all(len(c.times) == 20 for c in candidates)
    rounds = [log[i : i + 6] for i in range(0, len(log), 6)]
    assert all(sorted(r) == names for r in rounds)
    before = {n: {r[r.index(n) - 1] for r in rounds if r.index(n) > 0} for n in names}
    assert all(len(b) > 1 for b in before.values()), before


def test_bf16_rows_are_skipped_where_torch_has_no_fast_bf16_products(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(training.accel, "bf16_products_fast", lambda: False)
    monkeypatch.setattr(training, "lm_candidates", lambda p, adamw: asked.append(p) or [])
    monkeypatch.setattr(training, "matmul_candidates", lambda dtype: asked.append(dtype) or [])
    monkeypatch.setattr(training, "products_candidate", lambda p, onednn=True: asked.append(p))

    class Timed(Exception):
        pass

    def measure(candidates, repeats, warmup):
        raise Timed

    monkeypatch.setattr(training, "measure", measure)
    with pytest.raises(Timed):
        training.run(["lm"], 1, 0, "fused")
    assert asked == ["fp32", training.torch.float32, "fp32", "fp32"]
    out = capsys.readouterr().out
    assert "lm-small bf16: skipped" in out and "lm-small fp32: timing" in out
