/* AVX-512 helpers shared by attention.c's float32 path and its AMX path (attention_tiles.h):
 * exp on 16 lanes, a tail mask, and a 16 x 16 transpose in registers. */
#ifndef ATTNKIT_AVX512_H
#define ATTNKIT_AVX512_H

#include <immintrin.h>

#include "fastmath.h"

/* exp_neg (fastmath.h) on 16 lanes */
static inline __m512 exp_neg16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    bits = _mm512_slli_epi32(bits, 23);
    __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(big, p, _mm512_castsi512_ps(bits));
}

/* lanes j0 .. j0 + 15 below len */
static inline __mmask16 below(int len, int j0) {
    int k = len - j0;
    return k >= 16 ? 0xFFFF : (k <= 0 ? 0 : (__mmask16)((1u << k) - 1));
}

/* 16 x 16 32-bit values transposed in registers: r[i] lane j becomes r[j] lane i */
static inline void transpose16(__m512i r[16]) {
    __m512i a[16], t[16];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) { /* pairs of rows, 32 bits at a time, within 128-bit lanes */
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) { /* t[4k + q], lane L: column 4L + q of rows 4k .. 4k + 3 */
        t[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        t[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        t[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        t[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) { /* then the 128-bit lanes, a 4 x 4 transpose */
        __m512i c0 = _mm512_shuffle_i32x4(t[q], t[4 + q], 0x44);
        __m512i c1 = _mm512_shuffle_i32x4(t[q], t[4 + q], 0xEE);
        __m512i c2 = _mm512_shuffle_i32x4(t[8 + q], t[12 + q], 0x44);
        __m512i c3 = _mm512_shuffle_i32x4(t[8 + q], t[12 + q], 0xEE);
        r[q] = _mm512_shuffle_i32x4(c0, c2, 0x88);
        r[4 + q] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
        r[8 + q] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[12 + q] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

/* a 16 x 16 block of 32-bit values at src (row stride src_ld values), transposed into dst (row
 * stride dst_ld values) */
static inline void transpose_block16(const void *src, size_t src_ld, void *dst, size_t dst_ld) {
    const uint32_t *from = (const uint32_t *)src;
    uint32_t *to = (uint32_t *)dst;
    __m512i r[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_si512(from + l * src_ld);
    transpose16(r);
    for (int q = 0; q < 16; q++) _mm512_storeu_si512(to + q * dst_ld, r[q]);
}

#endif
