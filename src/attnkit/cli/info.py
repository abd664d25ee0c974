"""``attnkit info``: this machine as attnkit sees it: the CPU and its features, the torch build,
the native kernels' variants, the speed levers ``accel.prepare`` turns on for training and
for decoding, with the reason for each one that is off, and the GGUF tensor types attnkit reads,
packs (and with which kernel) and writes (``accel.block_formats.QUANT_TYPES``)."""

from __future__ import annotations

import argparse
import json

# the CPU features that decide a kernel variant or a torch path, in the order printed
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
            "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def register(commands) -> None:
    info = commands.add_parser(
        "info",
        help="the CPU, the torch build, the native kernels and the speed levers in use",
        description=(
            "Say what attnkit runs on here: the CPU (model, family, the instruction-set "
            "features that matter), the torch build and its thread count, which variant of "
            "the native kernels loaded (one per instruction set, built at install; "
            "ATTNKIT_KERNELS=generic|avx2|avx512|amx|off picks one), and which speed levers "
            "accel.prepare turns on for training and for decoding, with the reason for each "
            "one that is off, and the GGUF tensor types it reads, multiplies packed (with "
            "which kernel) and writes."
        ),
        epilog="examples:\n  attnkit info\n  ATTNKIT_KERNELS=avx2 attnkit info --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    info.add_argument("--json", action="store_true", help="print one JSON object instead")
    info.set_defaults(handler=run)


def gather() -> dict:
    """Everything ``attnkit info`` prints, as plain data."""
    import torch

    import attnkit
    from attnkit.accel import bf16_products_fast, levers, native
    from attnkit.accel.block_formats import QUANT_TYPES

    flags = native.cpu_flags()
    return {
        "attnkit": attnkit.__version__,
        "cpu": native.cpu(),
        "features": [name for name in FEATURES if name in flags],
        "torch": {
            "version": torch.__version__,
            "threads": torch.get_num_threads(),
            "mkl": torch.backends.mkl.is_available(),
            "onednn": torch.backends.mkldnn.is_available(),
            "openmp": torch.backends.openmp.is_available(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "fast_bf16": bf16_products_fast(),
        },
        "kernels": native.status(),
        "levers": {
            job: [{"name": lever.name, "on": lever.on, "why": lever.why} for lever in levers(job)]
            for job in ("training", "decoding")
        },
        "gguf_types": {name: t._asdict() | {"repack": None} for name, t in QUANT_TYPES.items()},
    }


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def run(args: argparse.Namespace) -> int:
    facts = gather()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    c, t = facts["cpu"], facts["torch"]
    print(f"attnkit {facts['attnkit']}")
    print(f"cpu       {c['model_name']} (family {c['family']}, model {c['model']}), "
          f"{c['cpus']} cores, {c['machine']}")  # fmt: skip
    print(f"features  {' '.join(facts['features']) or '(none of ' + ', '.join(FEATURES) + ')'}")
    print(f"torch     {t['version']}, {t['threads']} threads, capability {t['capability']}; "
          f"MKL {_yes(t['mkl'])}, oneDNN {_yes(t['onednn'])}, OpenMP {_yes(t['openmp'])}, "
          f"fast bf16 products {_yes(t['fast_bf16'])}")  # fmt: skip
    for i, row in enumerate(facts["kernels"]):
        state = "in use" if row["active"] else row["why"]
        print(f"{'kernels' if i == 0 else '':<9} {row['variant']:<8} {state}")
    if not any(row["active"] for row in facts["kernels"]):
        print(f"{'':<9} none loaded: attention, the fused loss and GGUF blocks run on torch")
    for job, found in facts["levers"].items():
        for i, lever in enumerate(found):
            state = "on " if lever["on"] else "off"
            why = f"  {lever['why']}" if lever["why"] else ""
            print(f"{job if i == 0 else '':<9} {lever['name']:<17} {state}{why}".rstrip())
    types = facts["gguf_types"]
    packed = [n if t["kernel"] == n else f"{n} (as {t['kernel']})"
              for n, t in types.items() if t["kernel"]]  # fmt: skip
    print(f"gguf      reads {' '.join(types)}")
    print(f"{'':<9} packs {' '.join(packed)}")
    print(f"{'':<9} writes {' '.join(n for n, t in types.items() if t['written'])}")
    return 0
