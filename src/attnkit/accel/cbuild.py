"""C kernels built at first use with the machine's C compiler.

``build(source)`` compiles ``source`` (a ``.c`` file beside this module, which may include the
headers beside it) with ``-O3 -march=native -fopenmp`` into ``~/.cache/attnkit/kernels``
(``ATTNKIT_CACHE`` moves it), keyed by the source, the headers, the flags and the processor,
so that a second process loads the library at once. It returns a ``ctypes`` library, or None
where none can be built (no C compiler, not Linux, a failed build, a missing source): every
caller has a PyTorch path to fall back to.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build", "cache_dir", "processor"]

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit"
    return Path(root) / "kernels"


def processor() -> str:
    """The processor's model name and instruction-set flags (a cache key)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def build(source: Path) -> ctypes.CDLL | None:
    """The library compiled from ``source`` (linked with ``-lm``), or None (see above)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None or platform.system() != "Linux" or not source.is_file():
        return None
    # the source and the headers beside it (fastmath.h), so that editing either rebuilds
    text = b"".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + processor().encode()).hexdigest()
    library = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run(
                [compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                return None
            built.replace(library)  # atomic: another process never sees half a library
    return ctypes.CDLL(str(library))
