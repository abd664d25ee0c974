/* Small float helpers shared by attnkit's C kernels (attention.c, lm_loss.c): bit casts,
 * bfloat16 loads and stores (rounded to nearest even, as torch rounds), and an exp that gcc
 * can vectorise without a vector maths library. */
#ifndef ATTNKIT_FASTMATH_H
#define ATTNKIT_FASTMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* gcc tunes some processors with AVX-512 (Rocket Lake, Ice Lake, Sapphire Rapids) to
 * auto-vectorise 256 bits wide; the kernels' exp and row loops run faster 512 bits wide. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

static inline float as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* exp(x) for x <= 0, within 2 ulp of expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
 * degree-6 polynomial, 2^n from the exponent bits; 0 below -87 (where expf is subnormal). */
static inline float exp_neg(float x) {
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    float scale = as_float((uint32_t)((int32_t)n + 127) << 23);
    /* 0 below -87 by clearing the bits, not by a branch: with `x < -87 ? 0 : p * scale` gcc
     * computes p only where it is used, and cannot then vectorise the loop on AVX2 (without
     * AVX-512's masks, it may not compute p in the lanes that do not need it) */
    return as_float(as_bits(p * scale) & -(uint32_t)!(x < -87.0f));
}

static inline float bf16_load(uint16_t h) { return as_float((uint32_t)h << 16); }
static inline uint16_t bf16_store(float f) {
    uint32_t u = as_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
