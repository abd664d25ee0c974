/* Float arithmetic in one fixed order, so that every kernel variant (plain C, AVX2, AVX-512,
 * AMX) and every CPU gives the same bits: what the packed forward (llama_step.c) computes
 * besides its products.
 *
 * Three rules make a result independent of the instruction set:
 * - every variant is compiled with -ffp-contract=off (variants.py), so a * b + c is always a
 *   product rounded, then a sum rounded: the compiler never fuses them where FMA exists;
 * - a sum has one order, written out: dot() gives lane l (of 16) the elements e = l mod 16 in
 *   increasing e, then adds the lanes pairwise (8, 4, 2, 1 apart). A compiler may run the
 *   lanes in vectors of any width: each lane's own sequence of operations stays the same;
 * - no libm function whose last bit depends on the CPU (expf, cosf, tanhf have FMA and
 *   non-FMA versions chosen at run time): exp, sine and cosine are written here with +, *, /
 *   and fmaf (which every libm rounds once, correctly, as the instruction does).
 */
#ifndef ATTNKIT_FIXED_H
#define ATTNKIT_FIXED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fastmath.h" /* exp_neg */

/* 16 floats as one value (GCC's vector extension): a compiler keeps it in registers, one
 * AVX-512 register, two AVX2 ones or four SSE2 ones, the same elementwise operations on each. */
typedef float f16x16 __attribute__((vector_size(64)));
typedef int32_t i16x16 __attribute__((vector_size(64)));

/* sum over e < n of a[e] b[e]: lane l (of 16) sums the elements e = l mod 16 in increasing e,
 * then the lanes are added pairwise, 8, 4, 2 and 1 apart (lane l + w into lane l). */
static inline float dot(const float *a, const float *b, int n) {
    f16x16 acc = {0};
    int e = 0;
    for (; e + 16 <= n; e += 16) {
        f16x16 x, y;
        memcpy(&x, a + e, sizeof x);
        memcpy(&y, b + e, sizeof y);
        acc += x * y;
    }
    for (; e < n; e++) acc[e & 15] += a[e] * b[e];
    const i16x16 by8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const i16x16 by4 = {4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15};
    const i16x16 by2 = {2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const i16x16 by1 = {1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    acc += __builtin_shuffle(acc, by8); /* lanes 0-7: l + (l + 8) */
    acc += __builtin_shuffle(acc, by4); /* lanes 0-3: l + (l + 4) */
    acc += __builtin_shuffle(acc, by2);
    acc += __builtin_shuffle(acc, by1);
    return acc[0];
}

/* out = x / sqrt(mean(x^2) + eps) * g for each row (out may be x). */
static inline void rms_norm_fixed(const float *x, const float *g, float *out, int rows, int D,
                                  float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * D;
        const float inv = 1.0f / sqrtf(dot(xr, xr, D) / (float)D + eps);
        float *o = out + (size_t)r * D;
        if (o == xr) /* in place: each element read before it is written */
            for (int i = 0; i < D; i++) o[i] = o[i] * inv * g[i];
        else
            for (int i = 0; i < D; i++) o[i] = xr[i] * inv * g[i];
    }
}

/* 1 / (1 + exp(-z)), through the exp of a non-positive number only. */
static inline float sigmoid_fixed(float z) {
    const float e = exp_neg(-fabsf(z));
    return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* SiLU, x sigmoid(x); GELU with the tanh approximation (torch's gelu(approximate="tanh")),
 * 0.5 g (1 + tanh(u)) = g sigmoid(2u). */
static inline float silu_fixed(float x) { return x * sigmoid_fixed(x); }
static inline float gelu_tanh_fixed(float g) {
    return g * sigmoid_fixed(2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g));
}

/* cos and sin of a float angle, each rounded to float from a double computed with + and *
 * only: the angle reduced by pi/2 in three parts (Cody and Waite, fdlibm's constants: exact
 * products for |angle| < 2^20 radians, far beyond a context's positions), then Taylor
 * polynomials on |r| <= pi/4 to r^17 and r^18 (the next terms are below 1e-19). */
static inline void cos_sin_fixed(float angle, float *c, float *s) {
    static const double sin_coef[9] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0,
                                       1.0 / 6227020800.0,      -1.0 / 39916800.0,
                                       1.0 / 362880.0,          -1.0 / 5040.0,
                                       1.0 / 120.0,             -1.0 / 6.0,
                                       1.0}; /* (-1)^k / (2k + 1)!, k = 8 .. 0 */
    static const double cos_coef[10] = {-1.0 / 6402373705728000.0, 1.0 / 20922789888000.0,
                                        -1.0 / 87178291200.0,      1.0 / 479001600.0,
                                        -1.0 / 3628800.0,          1.0 / 40320.0,
                                        -1.0 / 720.0,              1.0 / 24.0,
                                        -1.0 / 2.0,                1.0}; /* (-1)^k / (2k)! */
    const double x = angle, k = nearbyint(x * 0.63661977236758134308);
    const double r = ((x - k * 1.57079632673412561417e+00) - k * 6.07710050630396597660e-11) -
                     k * 2.02226624871116645580e-21;
    const double r2 = r * r;
    double sp = 0.0, cp = 0.0;
    for (int i = 0; i < 9; i++) sp = sp * r2 + sin_coef[i];
    for (int i = 0; i < 10; i++) cp = cp * r2 + cos_coef[i];
    const double sin_r = sp * r, cos_r = cp;
    const int quadrant = (int)((int64_t)k & 3); /* angle = k pi/2 + r */
    const double sn = quadrant == 0 ? sin_r : quadrant == 1 ? cos_r : quadrant == 2 ? -sin_r : -cos_r;
    const double cs = quadrant == 0 ? cos_r : quadrant == 1 ? -sin_r : quadrant == 2 ? -cos_r : sin_r;
    *c = (float)cs;
    *s = (float)sn;
}

#endif
