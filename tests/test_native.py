"""The native kernels as an extension: every variant built at install, the best one this CPU runs
chosen at run time, the struct layouts shared by C and Python, a warning (never silence) when
none loads, the same results without them, and ``attnkit info`` / ``accel.prepare`` saying so.
(Each kernel's own tests run every variant this CPU can: test_attention_kernel,
test_lm_loss_kernel, test_packed, test_packed_step.)"""

import ctypes
import json
import subprocess
import sys

import pytest
import torch

import attnkit as ak
from attnkit import accel
from attnkit.accel import native
from attnkit.cli import main


def test_every_variant_is_built_at_install():
    """``make test`` installs the package, which compiles every variant for x86-64 (the plain C
    one elsewhere): a missing library is a broken install, not a slow path."""
    for name in native.VARIANTS:
        if name not in native.X86_ONLY or native._x86():
            assert native.library_path(name).is_file(), name


def test_the_best_variant_this_cpu_runs_is_in_use(monkeypatch):
    """The first variant (best first) whose instructions this CPU has, whichever CPU runs the
    suite: never a particular one."""
    monkeypatch.delenv("ATTNKIT_KERNELS", raising=False)
    best = next(name for name in native.VARIANTS if native.runnable(name))
    assert native._choose() == best
    assert native.runnable("generic")


# /proc/cpuinfo's flags of the CPUs met so far (only the ones the variants ask for) -> the
# variant each must load
AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
KNOWN_CPUS = [
    (set(), "generic"),
    (AVX2, "avx2"),  # AMD Zen 3, Intel Haswell
    (AVX2 | {"avx_vnni"}, "avxvnni"),  # Intel client CPUs from Alder Lake on
    (AVX512, "avx512"),  # Intel Skylake-X
    (AVX512 | {"avx512_vnni", "avx512_bf16", "avx_vnni"}, "vnni"),  # AMD Zen 4, Zen 5
    (AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),  # Sapphire Rapids
]


@pytest.mark.parametrize(("flags", "expected"), KNOWN_CPUS)
def test_each_known_cpu_chooses_its_variant(monkeypatch, flags, expected):
    monkeypatch.delenv("ATTNKIT_KERNELS", raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "_x86", lambda: True)
    monkeypatch.setattr(native, "load", lambda name: None)  # chosen, not loaded
    assert native._choose() == expected


def test_a_variant_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert native.runnable("avx2") and not native.runnable("avx512")
    with pytest.raises(RuntimeError, match=r"cannot run the 'avx512' kernels \(no avx512bw"):
        native.load.__wrapped__("avx512")
    with pytest.raises(ValueError, match="variant must be one of"):
        native.runnable("sse9")


@pytest.mark.parametrize("name", native.STRUCTS)
def test_struct_layouts_are_one_definition(name):
    """ctypes' classes come from structs.h's lines; C reports its own sizes of the same
    structs, which every variant must agree with."""
    struct = native.structure(name)
    for variant in (v for v in native.VARIANTS if native.runnable(v)):
        lib = native.load(variant)
        assert lib.attnkit_struct_size(native.STRUCTS.index(name)) == ctypes.sizeof(struct)
    fields = [field for field, _ in struct._fields_]
    assert len(fields) == len(set(fields)) > 3


def test_the_other_variants_are_the_rest_this_cpu_runs():
    """What make test runs the tests marked variants under, besides the one in use."""
    others = native.others()
    assert native.variant() not in others
    assert {*others, native.variant()} == {v for v in native.VARIANTS if native.runnable(v)}
    assert "generic" in others or native.variant() == "generic"


def test_using_a_variant_makes_it_the_one_in_use():
    for name in (v for v in native.VARIANTS if native.runnable(v)):
        with native.using(name) as lib:
            assert native.variant() == name and native.library() is lib
    assert native.variant() == native._choose()


SCRIPT = """
import torch
from attnkit.accel import native
from attnkit.accel.attention import attention
{setup}
torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(3))
out = attention(q, k, v, is_causal=True)
attention(q, k, v, is_causal=True)
grads = torch.autograd.grad(out.sum(), (q, k, v))
torch.save((out.detach(), grads), {path!r})
print(native.variant())
"""


def _run(tmp_path, setup: str, env: dict | None = None):
    path = tmp_path / "out.pt"
    script = SCRIPT.format(setup=setup, path=str(path))
    environment = {k: v for k, v in __import__("os").environ.items() if k != "ATTNKIT_KERNELS"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        env={**environment, **(env or {})},
    )  # fmt: skip
    warned = [line for line in result.stderr.splitlines() if "PyTorch's paths run" in line]
    return result.stdout.splitlines() + warned, torch.load(path)


def test_without_the_libraries_a_warning_says_why_once_and_results_are_the_same(tmp_path):
    """The install's libraries gone (as after a build with no compiler): one warning naming
    what is missing, torch's path, and the kernel's results to float32 rounding."""
    lines, (out, grads) = _run(tmp_path, "")
    assert lines == [native._choose()]  # no warning with the libraries in place
    missing = "from pathlib import Path\nnative.library_path = lambda name: Path('/nowhere.so')"
    lines, (out_torch, grads_torch) = _run(tmp_path, missing)
    assert lines[0] == "None"
    assert len(lines) == 2 and lines[1].startswith("attnkit's native kernels are")
    assert "not built" in lines[1] and "PyTorch's paths run instead" in lines[1]
    torch.testing.assert_close(out_torch, out, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_torch, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kernels_off_is_a_choice_and_a_bad_name_warns(tmp_path):
    lines, _ = _run(tmp_path, "", {"ATTNKIT_KERNELS": "off"})
    assert lines == ["None"]  # asked for: no warning
    lines, _ = _run(tmp_path, "", {"ATTNKIT_KERNELS": "avx3"})
    assert lines[0] == "None" and "ATTNKIT_KERNELS='avx3' is not a kernel variant" in lines[1]
    lines, _ = _run(tmp_path, "", {"ATTNKIT_KERNELS": "generic"})
    assert lines == ["generic"]


def test_info_names_the_cpu_the_kernels_and_the_levers(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"attnkit {ak.__version__}\ncpu       ")
    assert f"{native.variant():<8} in use" in out
    for name in ("fused-loss", "unpadded", "attention-kernel", "packed-step", "decoding-layout"):
        assert name in out
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [row["variant"] for row in facts["kernels"]] == list(native.VARIANTS)
    assert sum(row["active"] for row in facts["kernels"]) == 1
    assert {lever["name"] for lever in facts["levers"]["training"]} >= {"unpadded", "fused-loss"}


@pytest.mark.serial
def test_info_runs_in_a_fresh_process_in_under_6_seconds():
    """What a user types: no lever is timed to choose it, so a fresh process only imports and
    reads the CPU."""
    subprocess.run([sys.executable, "-m", "attnkit.cli", "info"], check=True, capture_output=True)
    import time

    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "info"], check=True, capture_output=True, text=True
    )
    assert "kernels" in result.stdout
    assert time.perf_counter() - start < 6.0  # 2.7 s on a Xeon; room for a loaded CI machine


def test_prepare_swaps_modules_and_reports_why_a_lever_is_off():
    model = ak.DecoderLM(ak.ModelConfig.preset("tiny"))
    report = accel.prepare(model, "training")
    assert report.model is model and report.job == "training"
    assert type(model.lm_head) is accel.FusedLMHead
    assert report.line().startswith("levers: fused-loss on")
    with accel.unpadding(False):
        off = {lever.name: lever for lever in accel.levers("training")}
    assert not off["unpadded"].on and off["unpadded"].why == "switched off"
    moe = ak.DecoderLM(ak.ModelConfig.preset("tiny", n_experts=2, moe_top_k=1))
    found = {lever.name: lever for lever in accel.prepare(moe, "training").levers}
    assert not found["unpadded"].on and "mixture of experts" in found["unpadded"].why
    decoding = accel.prepare(ak.DecoderLM(ak.ModelConfig.preset("tiny")), "decoding")
    names = [lever.name for lever in decoding.levers][:3]
    assert names == ["packed-step", "int8-products", "decoding-layout"]
    assert not decoding.levers[1].on and decoding.levers[1].why in (
        "no packed weights",
        "no native kernels (see attnkit info)",
    )
    with pytest.raises(ValueError, match=r"job must be one of \('training', 'decoding'\)"):
        accel.prepare(model, "serving")
    with pytest.raises(TypeError, match=r"prepare: model must be an nn\.Module, got str"):
        accel.prepare("model", "training")
