"""Builds attnkit's native kernels when the package is installed (``pip install .`` or
``pip install -e .``; ``make demo`` and ``make test`` do it).

Why setuptools: the project already builds with it (pyproject.toml), the kernels are three C
files with no dependencies beyond libgomp, and its ``build_ext`` command is what both a wheel
and an editable install run. Each variant of ``src/attnkit/accel/variants.py`` (AMX, AVX-512
VNNI, AVX-512, AVX-VNNI, AVX2, plain C) becomes one shared library,
``attnkit/accel/_kernels_<variant>.*.so``, compiled with that variant's machine flags;
``attnkit.accel.native`` loads the best one the CPU runs. They are loaded with ctypes, not
imported: they hold no Python module.

No C compiler, or a variant the compiler cannot build: the install goes on and says so, and
attnkit runs those steps on PyTorch (``attnkit info`` shows which kernels are there).
"""

import os
import platform
import runpy
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ACCEL = Path("src/attnkit/accel")
spec = runpy.run_path(str(ACCEL / "variants.py"))
X86 = platform.machine().lower() in ("x86_64", "amd64")


class BuildKernels(build_ext):
    """Compiles each variant's library with the C compiler directly (one command, the variant's
    flags; distutils' own compile step would add Python's flags and share object files between
    variants of the same sources). The variants compile side by side, one per core."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1]
        if not compiler or shutil.which(compiler[0]) is None:
            compiler = [shutil.which("gcc") or shutil.which("cc") or "cc"]
        command = [*compiler, *ext.extra_compile_args, *ext.sources, "-o", str(target), "-lm"]
        self.announce(" ".join(command), level=2)
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            result = subprocess.CompletedProcess(command, 127, "", str(error))
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
            print(
                f"attnkit: warning: the {ext.name.rsplit('_', 1)[-1]!r} kernels were not built "
                f"({compiler[0]} failed: {last}); attnkit still works, on PyTorch's paths for "
                "those steps. Install a C compiler with OpenMP (gcc) and reinstall to build them.",
                flush=True,
            )


def kernels() -> list[Extension]:
    sources = [str(ACCEL / name) for name in spec["SOURCES"]]
    extensions = []
    for name, variant in spec["VARIANTS"].items():
        flags = variant["compiler_flags"] if X86 else ()
        if not X86 and name in spec["X86_ONLY"]:
            continue
        extensions.append(
            Extension(
                f"attnkit.accel._kernels_{name}",
                sources=sources,
                depends=[str(p) for p in ACCEL.glob("*.h")],
                extra_compile_args=[*spec["COMMON_FLAGS"], *flags],
                optional=True,  # not built: the install goes on (setuptools copies what exists)
            )
        )
    return extensions


setup(ext_modules=kernels(), cmdclass={"build_ext": BuildKernels})
