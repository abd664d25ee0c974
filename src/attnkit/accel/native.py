"""attnkit's native kernels: one shared library per instruction set, built when the package is
installed, the best one this CPU can run loaded at first use.

``setup.py`` compiles ``attention.c``, ``lm_loss.c`` and ``packed.c`` into one library per
variant of :mod:`attnkit.accel.variants` (``amx``, ``vnni``, ``avx512``, ``avxvnni``, ``avx2``,
``generic``), each with its own machine flags, so that one install serves any x86-64 CPU and
survives a move to another. :func:`library` loads the first variant, best first, whose
instructions this CPU has (``/proc/cpuinfo``'s flags); ``ATTNKIT_KERNELS`` names one instead
(``generic``, ``avx2``, ...) or turns them all off (``off``). Whatever goes wrong (nothing
built, a variant that fails to load), :func:`library` returns None, every caller takes its
PyTorch path, and a warning says why, once per process: a fallback is never silent.
:func:`status` reports it all for ``attnkit info``.

The structs passed to the kernels are defined once, in ``structs.h``; :func:`structure`
builds the ``ctypes`` classes from the same lines.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from attnkit.accel.switch import Switch, read_environment
from attnkit.accel.variants import VARIANTS, X86_ONLY

__all__ = [
    "STRUCTS",
    "VARIANTS",
    "X86_ONLY",
    "cpu",
    "cpu_flags",
    "library",
    "library_path",
    "load",
    "runnable",
    "status",
    "structure",
    "summary",
    "using",
    "variant",
]

_HERE = Path(__file__).parent
_ENV = "ATTNKIT_KERNELS"
_kernels = Switch(_ENV)  # a variant's name, or off (read by read_environment)
# structs.h's structs, in attnkit_struct_size's order
STRUCTS = ("View", "Shape", "LlamaLayer", "LlamaCache")


# Why the native kernels could not be used (the PyTorch paths run instead), once per reason: a
# warning on the "attnkit" logger, which Python prints to stderr unless the caller's logging
# says otherwise (the command line prints it as "attnkit: warning: ...").
_log = logging.getLogger("attnkit")


# --------------------------------------------------------------------------------------------
# The CPU
# --------------------------------------------------------------------------------------------


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``/proc/cpuinfo``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu() -> dict[str, str]:
    """The CPU as ``lscpu`` names it, from ``/proc/cpuinfo``: ``model_name``, ``family``,
    ``model``, ``vendor``, and ``machine`` and ``cpus`` (what ``attnkit info`` and the
    benchmarks print)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {
        "model_name": fields.get("model name") or platform.processor() or platform.machine(),
        "family": fields.get("cpu family", "?"),
        "model": fields.get("model", "?"),
        "vendor": fields.get("vendor_id", "?"),
        "machine": platform.machine(),
        "cpus": str(os.cpu_count()),
    }


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def runnable(name: str) -> bool:
    """Whether this CPU can run variant ``name`` (its instructions are all in :func:`cpu_flags`)."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    if name in X86_ONLY and not _x86():
        return False
    return set(VARIANTS[name]["cpu_flags"]) <= cpu_flags()


# --------------------------------------------------------------------------------------------
# The libraries
# --------------------------------------------------------------------------------------------


def library_path(name: str) -> Path:
    """Where variant ``name``'s library lies (it may be missing: not built)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return _HERE / f"_kernels_{name}{suffix}"


@cache
def structure(name: str) -> type[ctypes.Structure]:
    """The ``ctypes`` class of ``structs.h``'s struct ``name`` (``"View"``, ``"Shape"``,
    ``"LlamaLayer"``, ``"LlamaCache"``), built from the header's ``FIELD(type, name, [n])``
    lines."""
    text = (_HERE / "structs.h").read_text(encoding="utf-8")
    macro = re.search(rf"typedef struct {{ (ATTNKIT_\w+)\(ATTNKIT_C_FIELD\) }} {name};", text)
    if macro is None:
        raise ValueError(f"structs.h defines no struct {name!r}")
    body = re.search(rf"#define {macro.group(1)}\(FIELD\)(.*?)\n\n", text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    scalars = {"int": ctypes.c_int, "float": ctypes.c_float, "int64_t": ctypes.c_int64}
    fields = []
    for ctype, field, dims in re.findall(r"FIELD\(([^,]+),\s*(\w+),\s*(\[\d+\])?\s*\)", body):
        kind = ctypes.c_void_p if "*" in ctype else scalars[ctype.strip()]
        fields.append((field, kind * int(dims[1:-1]) if dims else kind))
    return type(name, (ctypes.Structure,), {"_fields_": fields})


@cache
def kinds() -> dict[str, int]:
    """The weight kinds of ``packed.h``'s enums, the one definition both sides read:
    ``{"Q8_0": 0, ..., "BLOCK_KINDS": 6, "TILE_BASE": 8, "FLOAT_ROWS": 16, ...}``."""
    text = re.sub(r"/\*.*?\*/", "", (_HERE / "packed.h").read_text(encoding="utf-8"), flags=re.S)
    found: dict[str, int] = {}
    for body in re.findall(r"enum\s*{([^}]*)}", text):
        value = -1
        for item in body.split(","):
            name, _, given = item.partition("=")
            value = int(given) if given.strip() else value + 1
            found[name.strip()] = value
    return found


def _prototypes(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every exported function's arguments and result, set once on a loaded library."""
    view, shape = ctypes.POINTER(structure("View")), ctypes.POINTER(structure("Shape"))
    layers = ctypes.POINTER(structure("LlamaLayer"))
    caches = ctypes.POINTER(structure("LlamaCache"))
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    signatures = {
        # attention.c: shape, q, k, v, out, lse, threads; the backward adds grad, lse, dq, dk, dv
        "attention_forward": (i, [shape, *[view] * 4, p, i]),
        "attention_backward": (i, [shape, *[view] * 5, p, *[view] * 3, i]),
        "attention_tiles": (i, []),
        "attnkit_struct_size": (ctypes.c_long, [i]),
        # lm_loss.c
        "lm_loss_rows": (i, [i, p, i, i, p, p, f, i, *[p] * 3, i]),
        "transpose_add": (None, [p, p, *[i] * 5]),
        # packed.c (the float path's blocks)
        "packed_matmul": (i, [i, *[p] * 3, *[i] * 4]),
        "packed_dequantize": (i, [i, *[p] * 2, *[i] * 3]),
        # tiles.c (the integer path)
        "packed_int8_path": (i, []),
        "packed_tile_rows": (i, []),
        "packed_tile_layout": (i, []),
        "packed_tile": (i, [i, p, p, i, i, i]),
        "packed_matmul_tiles": (i, [i, *[p] * 3, *[i] * 4]),
        # llama_step.c: layers, caches, n_layers, norm, eps, x, batch, tokens, positions, mask,
        # threads
        "packed_llama_forward": (i, [layers, caches, i, p, f, p, i, i, p, p, i]),
    }
    for function, (result, arguments) in signatures.items():
        getattr(lib, function).restype = result
        getattr(lib, function).argtypes = arguments
    return lib


@cache
def load(name: str) -> ctypes.CDLL:
    """Variant ``name``'s library, loaded (once) with its prototypes set. Raises OSError if it
    is not built or cannot be loaded, RuntimeError if this CPU cannot run it."""
    if not runnable(name):
        missing = sorted(set(VARIANTS[name]["cpu_flags"]) - cpu_flags())
        raise RuntimeError(f"this CPU cannot run the {name!r} kernels (no {', '.join(missing)})")
    path = library_path(name)
    if not path.is_file():
        raise OSError(f"{path.name} is not built (reinstall attnkit with a C compiler)")
    lib = _prototypes(ctypes.CDLL(str(path)))
    for which, struct in enumerate(STRUCTS):
        size, expected = lib.attnkit_struct_size(which), ctypes.sizeof(structure(struct))
        if size != expected:
            raise OSError(f"{path.name}: struct {struct} is {size} bytes in C, {expected} here")
    return lib


_chosen: str | None = None  # the variant in use, once chosen
_decided = False
_forced: list[str] = []  # variants named by :func:`using`, innermost last
_warned: set[str] = set()


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _log.warning("%s: PyTorch's paths run instead", message)


def _choose() -> str | None:
    """The variant to load, by ``ATTNKIT_KERNELS`` or the best this CPU runs; None with a
    warning when none can be loaded."""
    read_environment()
    wanted = _kernels.value.lower()
    if wanted == "off":
        return None
    if wanted:
        if wanted not in VARIANTS:
            _warn(f"{_ENV}={wanted!r} is not a kernel variant ({', '.join(VARIANTS)} or off)")
            return None
        candidates = [wanted]
    else:
        candidates = [name for name in VARIANTS if runnable(name)]
    reasons = []
    for name in candidates:
        try:
            load(name)
            if reasons:
                _warn("attnkit's kernels: " + "; ".join(reasons) + f"; using {name!r}")
            return name
        except (OSError, RuntimeError) as error:
            reasons.append(f"{name}: {error}")
    if len(candidates) > 1 and not any(library_path(name).is_file() for name in candidates):
        _warn(
            "attnkit's native kernels are not built (no _kernels_*.so in "
            f"{_HERE}; reinstall attnkit with a C compiler)"
        )
    else:
        _warn("attnkit's native kernels could not be loaded (" + "; ".join(reasons) + ")")
    return None


def variant() -> str | None:
    """The variant in use (a name of :data:`VARIANTS`: ``"amx"``, ``"avx2"``, ...), or None."""
    if _forced:
        return _forced[-1]
    global _chosen, _decided
    if not _decided:
        _chosen, _decided = _choose(), True
    return _chosen


def library() -> ctypes.CDLL | None:
    """The library of the variant in use (see the module docstring), or None."""
    name = variant()
    return None if name is None else load(name)


@contextmanager
def using(name: str) -> Iterator[ctypes.CDLL]:
    """Inside the block, variant ``name`` is the one in use (tests run every variant the CPU
    can); raises as :func:`load` does when it cannot be."""
    lib = load(name)
    _forced.append(name)
    try:
        yield lib
    finally:
        _forced.pop()


def status() -> list[dict]:
    """Every variant: its name, whether it is built, whether this CPU runs it, whether it is the
    one in use, and why not where it is not (``attnkit info`` prints it)."""
    active = variant()
    read_environment()
    rows = []
    for name, spec in VARIANTS.items():
        path = library_path(name)
        row = {"variant": name, "built": path.is_file(), "runnable": runnable(name),
               "active": name == active, "needs": list(spec["cpu_flags"]), "why": ""}  # fmt: skip
        if not row["runnable"]:
            missing = sorted(set(spec["cpu_flags"]) - cpu_flags())
            row["why"] = "not this CPU's: no " + ", ".join(missing) if missing else "not x86"
        elif not row["built"]:
            row["why"] = "not built"
        elif not row["active"]:
            row["why"] = f"off ({_ENV}={_kernels.value})" if _kernels.value else "a better one runs"
        rows.append(row)
    return rows


def summary() -> str:
    """One line: which variants are built and which one runs (``make`` prints it after an
    install, so a build without a compiler is seen at once)."""
    rows = status()
    built = [row["variant"] for row in rows if row["built"]]
    if not built:
        return (
            "attnkit: warning: no native kernels were built (no C compiler with OpenMP?): "
            "attnkit works, on PyTorch's slower paths; install gcc and run 'make' again"
        )
    active = next((row["variant"] for row in rows if row["active"]), None)
    return f"attnkit: native kernels built: {', '.join(built)}; in use here: {active}"


def others() -> list[str]:
    """The variants this CPU also runs, besides the one in use (``make test`` runs the tests
    marked ``variants`` again under each)."""
    return [name for name in VARIANTS if runnable(name) and name != variant()]


if __name__ == "__main__":
    print(summary())
