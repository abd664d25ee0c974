"""The integer product on AMX tiles against AVX-512 VNNI, per 32-weight block (bench/amx_blocks.c):
what AMX gives the batched decoding step and the prompt when every block of 32 weights keeps
its own scales, as the integer path's arithmetic requires (the same bits as the one-token step).

Compiles bench/amx_blocks.c with gcc for Sapphire Rapids and runs it on one core: ns per tile
(16 output rows x 32 weights) and row of x, for 1, 4, 8 and 16 rows, and whether both ways give
the same floats. Needs an Intel Xeon with AMX-INT8 (``amx_int8`` in /proc/cpuinfo).

    python bench/amx_blocks.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import cpu_description


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if "amx_int8" not in Path("/proc/cpuinfo").read_text():
        sys.exit("amx_blocks: this CPU has no AMX-INT8 (amx_int8 in /proc/cpuinfo)")
    print(cpu_description())
    with tempfile.TemporaryDirectory() as folder:
        binary = Path(folder) / "amx_blocks"
        source = Path(__file__).with_name("amx_blocks.c")
        flags = ["-O3", "-march=sapphirerapids", "-ffp-contract=off"]
        subprocess.run(["gcc", *flags, str(source), "-o", str(binary)], check=True)
        subprocess.run(["taskset", "-c", "0", str(binary)], check=True)


if __name__ == "__main__":
    main()
