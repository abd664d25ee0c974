/* AVX2 helpers for attention.c's path without AVX-512: an 8 x 8 transpose in registers. */
#ifndef ATTNKIT_AVX2_H
#define ATTNKIT_AVX2_H

#include <immintrin.h>

/* an 8 x 8 block of floats at src (row stride src_ld), transposed into dst (row stride dst_ld):
 * pairs of rows interleaved, then pairs of pairs, then the 128-bit halves exchanged */
static inline void transpose_block8(const float *src, size_t src_ld, float *dst, size_t dst_ld) {
    __m256 r[8], a[8], t[8];
    for (int l = 0; l < 8; l++) r[l] = _mm256_loadu_ps(src + l * src_ld);
    for (int k = 0; k < 4; k++) { /* a[2k], a[2k+1]: rows 2k and 2k+1 interleaved */
        a[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) { /* t[4k + q]: column q of rows 4k..4k+3, then column 4 + q */
        t[4 * k] = _mm256_shuffle_ps(a[4 * k], a[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        t[4 * k + 1] = _mm256_shuffle_ps(a[4 * k], a[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        t[4 * k + 2] = _mm256_shuffle_ps(a[4 * k + 1], a[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        t[4 * k + 3] = _mm256_shuffle_ps(a[4 * k + 1], a[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int q = 0; q < 4; q++) { /* low halves give columns q, high halves columns 4 + q */
        _mm256_storeu_ps(dst + q * dst_ld, _mm256_permute2f128_ps(t[q], t[4 + q], 0x20));
        _mm256_storeu_ps(dst + (4 + q) * dst_ld, _mm256_permute2f128_ps(t[q], t[4 + q], 0x31));
    }
}

#endif
