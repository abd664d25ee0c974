"""The native kernels' variants, one per instruction set: what each needs of the CPU and how
it is compiled. Plain data (no imports), read both by ``setup.py``, which builds every variant
when the package is installed, and by :mod:`attnkit.accel.native`, which loads the best one
this CPU can run.

The C sources (``attention.c``, ``lm_loss.c``, ``packed.c``, ``tiles.c``, ``llama_step.c``)
choose their code paths with the compiler's own macros (``__AVX2__``, ``__AVX512F__``,
``__AMX_TILE__``), so one source gives every variant. Best first.
"""

SOURCES = ("attention.c", "lm_loss.c", "packed.c", "tiles.c", "llama_step.c")

# common to every variant: optimised, OpenMP for the threads, a shared library; a * b + c
# never fused into one FMA behind the code's back (fixed.h: the same bits on every variant)
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off")

VARIANTS = {
    # AMX tiles for bfloat16 attention (Intel Xeon from Sapphire Rapids on), on top of AVX-512
    "amx": {
        "cpu_flags": (
            "avx512f",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512_bf16",
            "avx512_vnni",
            "amx_tile",
            "amx_bf16",
        ),
        "compiler_flags": (
            "-march=x86-64-v4",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
        ),
    },
    # AVX-512 with VNNI's integer dot products (Intel from Cascade Lake on, AMD Zen 4 and later)
    "vnni": {
        "cpu_flags": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"),
        "compiler_flags": ("-march=x86-64-v4", "-mavx512vnni"),
    },
    # AVX-512 F/BW/DQ/VL (x86-64-v4: Intel Skylake-X and later, AMD Zen 4 and later)
    "avx512": {
        "cpu_flags": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
        "compiler_flags": ("-march=x86-64-v4",),
    },
    # AVX2 with AVX-VNNI's 256-bit integer dot products (Intel client CPUs from Alder Lake on)
    "avxvnni": {
        "cpu_flags": ("avx2", "fma", "f16c", "avx_vnni"),
        "compiler_flags": ("-march=x86-64-v3", "-mavxvnni"),
    },
    # AVX2, FMA and F16C (x86-64-v3: Intel Haswell and later, AMD Zen 1 and later)
    "avx2": {
        "cpu_flags": ("avx2", "fma", "f16c"),
        "compiler_flags": ("-march=x86-64-v3",),
    },
    # plain C: any x86-64 (SSE2), or another processor with no machine flags at all
    "generic": {
        "cpu_flags": (),
        "compiler_flags": ("-march=x86-64",),
    },
}

# on another architecture only "generic" is built
X86_ONLY = ("amx", "vnni", "avx512", "avxvnni", "avx2")
