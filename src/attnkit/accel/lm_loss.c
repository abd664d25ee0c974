/* The row-wise part of the fused LM-head loss (lm_loss.py): for each row of logits z (one
 * token, V = vocab entries), in three passes over the row while it sits in the cache:
 *
 *   m = max_j z_j,  lse = m + log sum_j exp(z_j - m),  z_t = z[target],  mean_j z_j
 *   g_j = w (exp(z_j - lse) - eps / V - (1 - eps) [j = target])        (dL/dz_j, in place)
 *
 * w is the row's weight (1 / counted tokens, 0 for an ignored row) and eps the label
 * smoothing. The logits are float32 or bfloat16 (the dtype of the product that made them);
 * all arithmetic is float32 and g is written back in the logits' dtype, rounded to nearest
 * even as torch rounds. torch's own operators do the same work in six to eight passes over the
 * chunk (max, gather, softmax, gather, scale, scatter, and under autocast two casts). With the
 * gradient, the second pass keeps exp(z_j - m) (over the float32 row itself, or in a float32
 * row per thread for bfloat16) and the third scales it: one exp per value, not two.
 *
 * transpose_add (at the end) sums the output layer's dL/dW from the chunks' parts, which the
 * products give transposed.
 *
 * Built at install by setup.py, once per instruction set (variants.py); exp is fastmath.h's
 * polynomial, so that gcc can vectorise every loop without a vector maths library.
 */
#include <stdlib.h>

#ifdef __AVX512F__
#include "avx512.h" /* transpose16 */
#endif
#include "fastmath.h"

/* One row in float32 (f32 != 0) or bfloat16: writes lse, z_t, the mean (if mean != 0) and,
 * if grad, g over the row. */
static void row(int f32, void *z, int vocab, int64_t target, float w, float eps, int grad,
                float *lse, float *z_t, float *mean, float *e) {
    float *zf = (float *)z;
    uint16_t *zh = (uint16_t *)z;
    float m = -INFINITY, total = 0.0f;
    if (f32) {
#pragma omp simd reduction(max : m) reduction(+ : total)
        for (int j = 0; j < vocab; j++) { m = zf[j] > m ? zf[j] : m; total += zf[j]; }
    } else {
#pragma omp simd reduction(max : m) reduction(+ : total)
        for (int j = 0; j < vocab; j++) { float v = bf16_load(zh[j]); m = v > m ? v : m; total += v; }
    }
    float z_target = f32 ? zf[target] : bf16_load(zh[target]);
    float s = 0.0f;
    if (grad && f32) { /* keep exp(z_j - m) over the row itself: the gradient's pass scales it */
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < vocab; j++) { zf[j] = exp_neg(zf[j] - m); s += zf[j]; }
    } else if (grad) { /* ... in e (float32: rounding it to bf16 would round g twice) */
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < vocab; j++) { e[j] = exp_neg(bf16_load(zh[j]) - m); s += e[j]; }
    } else if (f32) {
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < vocab; j++) s += exp_neg(zf[j] - m);
    } else {
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < vocab; j++) s += exp_neg(bf16_load(zh[j]) - m);
    }
    *lse = m + logf(s);
    *z_t = z_target;
    if (mean) *mean = total / (float)vocab;
    if (!grad) return;
    /* g_j = w exp(z_j - m) / s - w eps / V, then the target's entry less w (1 - eps) */
    float scale = w / s, shift = w * eps / (float)vocab;
    float g_target = w * (exp_neg(z_target - m) / s - eps / (float)vocab - (1.0f - eps));
    if (f32) {
#pragma omp simd
        for (int j = 0; j < vocab; j++) zf[j] = fmaf(zf[j], scale, -shift);
        zf[target] = g_target;
    } else {
#pragma omp simd
        for (int j = 0; j < vocab; j++) zh[j] = bf16_store(fmaf(e[j], scale, -shift));
        zh[target] = bf16_store(g_target);
    }
}

/* rows x vocab logits (contiguous; dtype 0 float32, 1 bfloat16), each row's target id (in
 * [0, vocab)) and weight; per row out: lse, z_target, mean (mean may be NULL). grad != 0
 * overwrites the logits with dL/dz. Returns 0, -1 for a bad argument, or -2 where a thread's
 * float32 row (bfloat16 gradients) could not be allocated. */
int lm_loss_rows(int dtype, void *logits, int rows, int vocab, const int64_t *targets,
                 const float *weights, float eps, int grad, float *lse, float *z_target,
                 float *mean, int threads) {
    if ((dtype != 0 && dtype != 1) || rows < 0 || vocab <= 0) return -1;
    for (int r = 0; r < rows; r++)
        if (targets[r] < 0 || targets[r] >= vocab) return -1;
    size_t width = (size_t)vocab * (dtype == 0 ? 4 : 2);
    /* bfloat16 gradients: each thread's row of exp values in float32 */
    int need = grad && dtype == 1, failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *e = need ? malloc((size_t)vocab * sizeof(float)) : 0;
        if (need && !e) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            if (!need || e)
                row(dtype == 0, (char *)logits + (size_t)r * width, vocab, targets[r],
                    weights[r], eps, grad, lse + r, z_target + r, mean ? mean + r : 0, e);
        free(e);
    }
    return failed ? -2 : 0;
}

/* The output layer's dL/dW, summed over chunks: each chunk's product gives it transposed,
 * part = h^T g (cols x rows: D x V), the layout in which oneDNN's products (float32, and
 * bfloat16 under autocast) run fastest, and
 * acc (rows x cols: V x D, float32, W's own layout) = part^T (add == 0) or acc + part^T
 * (add != 0). part is float32 or bfloat16 (dtype 0 or 1). torch's add of a transposed view
 * takes 5-10 ms for lm-small's 8192 x 256; this takes under 1 ms: blocks of 16 x 16 values,
 * read a row of part at a time and written a row of acc at a time. */
void transpose_add(float *acc, const void *part, int dtype, int rows, int cols, int add,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i0 = 0; i0 < rows; i0 += 16) {
        for (int j0 = 0; j0 < cols; j0 += 16) {
#ifdef __AVX512F__
            if (i0 + 16 <= rows && j0 + 16 <= cols) { /* a full block, in registers */
                __m512i r[16];
                for (int k = 0; k < 16; k++) {
                    size_t at = (size_t)(j0 + k) * rows + i0;
                    r[k] = dtype == 0 ? _mm512_loadu_si512((const float *)part + at)
                                      : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                              (const __m256i *)((const uint16_t *)part + at))),
                                                          16);
                }
                transpose16(r);
                for (int k = 0; k < 16; k++) {
                    float *out = acc + (size_t)(i0 + k) * cols + j0;
                    __m512 v = _mm512_castsi512_ps(r[k]);
                    _mm512_storeu_ps(out, add ? _mm512_add_ps(v, _mm512_loadu_ps(out)) : v);
                }
                continue;
            }
#endif
            for (int i = i0; i < rows && i < i0 + 16; i++)
                for (int j = j0; j < cols && j < j0 + 16; j++) {
                    size_t at = (size_t)j * rows + i;
                    float v = dtype == 0 ? ((const float *)part)[at] : bf16_load(((const uint16_t *)part)[at]);
                    acc[(size_t)i * cols + j] = add ? acc[(size_t)i * cols + j] + v : v;
                }
        }
    }
}
