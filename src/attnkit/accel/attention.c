/* Scaled dot-product attention on the CPU, forward and backward, one (batch, head) per task:
 *
 *   s_ij = scale q_i . k_j   (j allowed: key j is valid, and j <= i + M - N when causal)
 *   p_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij),  o_i = sum_j p_ij v_j
 *
 *   backward, from lse (p is recomputed, never stored by the forward):
 *   dp_ij = do_i . v_j,  D_i = do_i . o_i,  ds_ij = scale p_ij (dp_ij - D_i)
 *   dv_j = sum_i p_ij do_i,   dq_i = sum_j ds_ij k_j,   dk_j = sum_i ds_ij q_i
 *
 * A head's q, k, v (and do, o) are first copied into float32 scratch, zero-padded (rows to
 * ROWS, keys to 32, d to 32; k and v also transposed), so that every product is one of two
 * small register-blocked loops (ROWS x COLS: 8 x 32 with AVX-512, else 4 x 16) over rows
 * of memory. float32 rows that need no padding (d a multiple of 32, n of ROWS, m of 32) are
 * read where they lie instead (rows_of). The forward keeps ROWS rows of scores at a time; the backward a head's p
 * and ds (n x m each, in the cache for the sequence lengths this is used for). Tensors may be
 * float32 or bfloat16 (the arithmetic is float32) with any strides over (batch, head,
 * position) and a contiguous last axis. A query with no allowed key gets o_i = 0 and
 * lse_i = +inf (its p and gradients are 0). Causal masks skip the blocks above the diagonal.
 * With AVX-512 the softmax's passes and the transposes of k and v are written in intrinsics
 * (avx512.h): gcc's own vectorisation of the sum left a scalar tail per row, and the transposes
 * went an element at a time. With AVX2 the transposes are (avx2.h). Where gcc targets AMX
 * tiles (the "amx" variant, for an Intel Xeon from Sapphire Rapids on) and Linux lends them,
 * bfloat16 inputs take attention_tiles.h's path instead: the products on tiles.
 * Packed sequences (View.first, Shape.n_of / m_of): batch b's rows start at row first[b] of
 * one (T, H, d) tensor and it has its own n and m, all real; each task lays its head out in
 * the scratch at its own sizes. (The tile path takes padded heads only.)
 * Built at install by setup.py, one library per instruction set (variants.py).
 */
#include <stdlib.h>
#include "fastmath.h"
#include "structs.h"
#ifdef __AVX512F__
#include "avx512.h"
#define KEYS 16 /* keys transposed at a time in registers (load_cols) */
#define TRANSPOSE_BLOCK transpose_block16
#elif defined(__AVX2__)
#include "avx2.h"
#define KEYS 8
#define TRANSPOSE_BLOCK transpose_block8
#endif

/* View (a tensor's rows) and Shape (the call's sizes) are defined in structs.h */

/* where position n of head h of batch b starts, in elements */
static inline int64_t offset(const View *v, int b, int h, int n) {
    return (v->first ? v->first[b] * v->sn : b * v->sb) + h * v->sh + n * v->sn;
}

static inline void load_row(const View *v, int b, int h, int n, int d, float *out) {
    int64_t at = offset(v, b, h, n);
    if (v->dtype == 0) {
        memcpy(out, (const float *)v->data + at, sizeof(float) * d);
    } else {
        const uint16_t *src = (const uint16_t *)v->data + at;
        for (int t = 0; t < d; t++) out[t] = bf16_load(src[t]);
    }
}

/* With AVX-512, float32 rows, and bf16 rows a cache line at a time, go out by non-temporal
 * stores, which skip reading each output line into the cache first (a Sapphire Rapids-class
 * Xeon spent a sixth of the backward there); the fence at the end of each thread's work makes
 * them visible before the kernel returns. */
static inline void store_row(const View *v, int b, int h, int n, int d, const float *in) {
    int64_t at = offset(v, b, h, n);
    if (v->dtype == 0) {
        float *dst = (float *)v->data + at;
#ifdef __AVX512F__
        if (d % 16 == 0 && ((uintptr_t)dst & 63) == 0) {
            for (int t = 0; t < d; t += 16) _mm512_stream_ps(dst + t, _mm512_loadu_ps(in + t));
            return;
        }
#endif
        memcpy(dst, in, sizeof(float) * d);
    } else {
        uint16_t *dst = (uint16_t *)v->data + at;
#ifdef __AVX512F__
        if (d % 32 == 0 && ((uintptr_t)dst & 63) == 0) {
            for (int t = 0; t < d; t += 32) {
                uint16_t line[32] __attribute__((aligned(64)));
                for (int u = 0; u < 32; u++) line[u] = bf16_store(in[t + u]);
                _mm512_stream_si512((void *)(dst + t), _mm512_load_si512(line));
            }
            return;
        }
#endif
        for (int t = 0; t < d; t++) dst[t] = bf16_store(in[t]);
    }
}

/* A register's worth of floats, loaded and stored without alignment: 16 with AVX-512, else 8
 * (AVX2's width; gcc split wider generic vectors into 128-bit pieces through the stack there,
 * and the products ran at a tenth of their speed). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(4 * LANES), aligned(4)));
#define AT(p) (*(vec *)(p))

/* Keeps a vector in a register. On AVX2 gcc otherwise folds the row of B (or X) into each of
 * the products' multiply-adds as a memory operand: 12 loads for 8 multiply-adds, more than the
 * two 256-bit loads a cycle a Zen 3 core can do. AVX-512 builds keep them in registers
 * anyway. */
#if defined(__AVX__) && !defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline int round_up(int x, int to) { return (x + to - 1) / to * to; }

/* the number of keys query i may see (causal, bottom-right aligned) */
static inline int visible(int i, int n, int m, int causal) {
    if (!causal) return m;
    int last = i + m - n + 1;
    return last < 0 ? 0 : (last > m ? m : last);
}

/* Rows per block: every product below is register-blocked as ROWS rows x COLS = 2 LANES columns,
 * 2 x ROWS vectors of accumulators. AVX-512's 32 registers hold 8 rows x 32 columns (a quarter
 * less time than 4 rows at lm-small's shapes); AVX2's 16 hold 4 rows x 16 columns, with room
 * for the row of B and the broadcast. */
#ifdef __AVX512F__
#define ROWS 8
#else
#define ROWS 4
#endif
#define COLS (2 * LANES)

/* C[r][j] = alpha sum_t A[r][t] B[t][j] for ROWS rows r and j < cols (a multiple of 32): A is
 * ROWS x dp (row stride lda), B dp x cols (row stride ldb), C row stride ldc. */
static void rows_times_bt(const float *A, int lda, const float *B, int ldb, int dp, int cols,
                          float alpha, float *C, int ldc) {
    for (int j = 0; j < cols; j += COLS) {
        vec c0[ROWS], c1[ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) c0[r] = c1[r] = (vec){0};
        for (int t = 0; t < dp; t++) {
            vec b0 = AT(B + (size_t)t * ldb + j), b1 = AT(B + (size_t)t * ldb + j + LANES);
            IN_REGISTER(b0);
            IN_REGISTER(b1);
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                float a = A[(size_t)r * lda + t];
                c0[r] += a * b0;
                c1[r] += a * b1;
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            AT(C + (size_t)r * ldc + j) = alpha * c0[r];
            AT(C + (size_t)r * ldc + j + LANES) = alpha * c1[r];
        }
    }
}

/* C[r][:] = sum_{k0 <= k < k1} P(r, k) X[k][:] for ROWS rows r: P(r, k) = P[r sr + k sk] (so P
 * or its transpose), X is k1 x dp (row stride ldx, dp a multiple of 32), C row stride ldc. */
static void rows_times_x(const float *P, size_t sr, size_t sk, const float *X, int ldx, int k0,
                         int k1, int dp, float *C, int ldc) {
    for (int c = 0; c < dp; c += COLS) {
        vec c0[ROWS], c1[ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) c0[r] = c1[r] = (vec){0};
        for (int k = k0; k < k1; k++) {
            vec x0 = AT(X + (size_t)k * ldx + c), x1 = AT(X + (size_t)k * ldx + c + LANES);
            IN_REGISTER(x0);
            IN_REGISTER(x1);
            const float *pk = P + k * sk;
#pragma GCC unroll 8
            for (int r = 0; r < ROWS; r++) {
                float p = pk[r * sr];
                c0[r] += p * x0;
                c1[r] += p * x1;
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; r++) {
            AT(C + (size_t)r * ldc + c) = c0[r];
            AT(C + (size_t)r * ldc + c + LANES) = c1[r];
        }
    }
}

/* batch b's own shape */
static Shape of_batch(const Shape *s, int b) {
    Shape t = *s;
    if (s->n_of) t.n = s->n_of[b];
    if (s->m_of) t.m = s->m_of[b];
    return t;
}

/* floats, 64-byte aligned (aligned_alloc wants a size that is a multiple of the alignment) */
static float *scratch(size_t floats) {
    return aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
}

/* A head's sizes in scratch: rows padded to ROWS, keys to 32, d to 32 (the padding is zero). */
typedef struct { int np, mp, dp; } Padded;

static Padded padded(const Shape *s) {
    Padded p = {round_up(s->n, ROWS), round_up(s->m, 32), round_up(s->d, 32)};
    return p;
}

/* rows of a (b, h) slice into float32 scratch: n rows of d, zero-padded to np x dp */
static void load_rows(const View *v, int b, int h, int n, int d, int np, int dp, float *out) {
    memset(out, 0, sizeof(float) * (size_t)np * dp);
    for (int i = 0; i < n; i++) load_row(v, b, h, i, d, out + (size_t)i * dp);
}

/* Asks for the ROWS rows of X from row `from` on (below n; row stride ld, dp floats each) to
 * be brought into the cache: the next block's rows of q, read in place, are far apart (a fused
 * projection's rows are 3 H d floats long) and each lies on its own page, where the
 * processor's prefetchers stop. */
static inline void prefetch_rows(const float *X, int ld, int from, int n, int dp) {
    for (int r = from; r < from + ROWS && r < n; r++)
        for (int c = 0; c < dp; c += 16) __builtin_prefetch(X + (size_t)r * ld + c);
}

/* Rows of a (b, h) slice for the products, which take any row stride: read in place where
 * they are float32, d == dp and n == np (no padding to add), else loaded into out; the row
 * stride goes to *ld. In place saves a copy of rows that are usually not in the cache yet. */
static const float *rows_of(const View *v, int b, int h, int n, int d, int np, int dp,
                            float *out, int *ld) {
    if (v->dtype == 0 && d == dp && n == np) {
        *ld = (int)v->sn;
        return (const float *)v->data + offset(v, b, h, 0);
    }
    load_rows(v, b, h, n, d, np, dp, out);
    *ld = dp;
    return out;
}

/* the same, transposed: dp x mp. rows: 16 x dp scratch (AVX-512 transposes 16 keys at a time
 * in registers, AVX2 8; otherwise a row of dp is used). */
static void load_cols(const View *v, int b, int h, int m, int d, int mp, int dp, float *rows,
                      float *out) {
#ifdef TRANSPOSE_BLOCK
    for (int j0 = 0; j0 < mp; j0 += KEYS) {
        memset(rows, 0, sizeof(float) * KEYS * (size_t)dp);
        for (int l = 0; l < KEYS && j0 + l < m; l++)
            load_row(v, b, h, j0 + l, d, rows + (size_t)l * dp);
        for (int c0 = 0; c0 < dp; c0 += KEYS)
            TRANSPOSE_BLOCK(rows + c0, dp, out + (size_t)c0 * mp + j0, mp);
    }
#else
    memset(out, 0, sizeof(float) * (size_t)dp * mp);
    for (int j = 0; j < m; j++) {
        load_row(v, b, h, j, d, rows);
        for (int t = 0; t < d; t++) out[(size_t)t * mp + j] = rows[t];
    }
#endif
}

/* Turn ROWS rows of scores (row stride mp) into probabilities p = exp(s - lse): for the forward
 * (lse == NULL) the row's lse is computed, stored in out_lse, and p normalised. Keys past what
 * a row may see, and invalid keys, get p = 0; so does every key of a row with none. Only the
 * block's first `width` keys are written (block_cols: all that the products read; with a
 * causal mask no later product reads a row's keys past its block's width either). */
static void probabilities(float *S, int mp, int width, int i0, const Shape *s,
                          const uint8_t *valid, const float *lse, float *out_lse) {
    for (int r = 0; r < ROWS; r++) {
        float *row = S + (size_t)r * mp;
        int i = i0 + r, len = i < s->n ? visible(i, s->n, s->m, s->causal) : 0;
        if (valid)
            for (int j = 0; j < len; j++)
                if (!valid[j]) row[j] = -INFINITY;
        float top = -INFINITY;
        if (lse) {
            top = i < s->n ? lse[i] : INFINITY;
        } else {
#ifdef __AVX512F__
            __m512 tops = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < len; j += 16)
                tops = _mm512_mask_max_ps(tops, below(len, j), tops, _mm512_loadu_ps(row + j));
            top = _mm512_reduce_max_ps(tops);
#else
#pragma omp simd reduction(max : top)
            for (int j = 0; j < len; j++) top = row[j] > top ? row[j] : top;
#endif
        }
        if (top == -INFINITY || top == INFINITY) { /* nothing to attend to */
            memset(row, 0, sizeof(float) * width);
            if (out_lse && i < s->n) out_lse[i] = INFINITY;
            continue;
        }
        float sum = 0.0f; /* exp only over the keys the row may see; the rest are 0 */
#ifdef __AVX512F__
        __m512 sums = _mm512_setzero_ps(), tops = _mm512_set1_ps(top);
        for (int j = 0; j < width; j += 16) {
            __m512 x = _mm512_sub_ps(_mm512_loadu_ps(row + j), tops);
            __m512 e = _mm512_maskz_mov_ps(below(len, j), exp_neg16(x)); /* exp(-inf) = 0 */
            _mm512_storeu_ps(row + j, e);
            sums = _mm512_add_ps(sums, e);
        }
        sum = _mm512_reduce_add_ps(sums);
#else
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < len; j++) { /* exp_neg(-inf) = 0 */
            float e = exp_neg(row[j] - top);
            row[j] = e;
            sum += e;
        }
        memset(row + len, 0, sizeof(float) * (size_t)(width - len));
#endif
        if (out_lse) {
            float inv = 1.0f / sum;
#pragma omp simd
            for (int j = 0; j < len; j++) row[j] *= inv;
            out_lse[i] = top + logf(sum);
        }
    }
}

/* The widest row of keys any of rows i0..i0+ROWS-1 sees, rounded up to COLS (a causal block
 * computes fewer keys past its diagonal with AVX2's 16 than with 32). */
static int block_cols(int i0, const Shape *s) {
    int last = i0 + ROWS - 1 < s->n ? i0 + ROWS - 1 : s->n - 1;
    return round_up(visible(last, s->n, s->m, s->causal), COLS);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define TILES 1
#include "attention_tiles.h"
#endif

int attention_forward(const Shape *s, const View *q, const View *k, const View *v, const View *o,
                      float *lse, int threads) {
    if (s->d <= 0 || (!s->n_of && (s->n <= 0 || s->m <= 0))) return -1; /* packed: may be 0 */
#ifdef TILES
    if (s->tiles && !s->n_of && q->dtype == 1 && k->dtype == 1 && v->dtype == 1 &&
        tiles_permitted())
        return tiles_forward(s, q, k, v, o, lse, threads);
#endif
    Padded most = padded(s); /* the scratch's sizes; each batch lays its own out in it */
    size_t nd = (size_t)most.np * most.dp, md = (size_t)most.mp * most.dp;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Q: np x dp, Kt: dp x mp, V: mp x dp, S: ROWS x mp, O: ROWS x dp, 16 rows of dp */
        float *Q = scratch(nd + 2 * md + ROWS * (size_t)most.mp + (ROWS + 16) * (size_t)most.dp);
        if (!Q) {
#pragma omp atomic write
            failed = 1;
        }
        float *Kt = Q + nd, *V = Kt + md, *S = V + md, *O = S + ROWS * (size_t)most.mp;
        float *row = O + ROWS * most.dp;
#pragma omp for schedule(dynamic)
        for (int bh = 0; bh < s->batch * s->heads; bh++) {
            if (!Q) continue;
            int b = bh / s->heads, h = bh % s->heads;
            Shape t = of_batch(s, b);
            Padded z = padded(&t);
            int lq, lv;
            const float *Qh = rows_of(q, b, h, t.n, t.d, z.np, z.dp, Q, &lq);
            load_cols(k, b, h, t.m, t.d, z.mp, z.dp, row, Kt);
            const float *Vh = rows_of(v, b, h, t.m, t.d, z.mp, z.dp, V, &lv);
            const uint8_t *valid = s->valid ? s->valid + (size_t)b * s->m : 0;
            for (int i0 = 0; i0 < t.n; i0 += ROWS) {
                int cols = block_cols(i0, &t);
                prefetch_rows(Qh, lq, i0 + ROWS, t.n, z.dp);
                rows_times_bt(Qh + (size_t)i0 * lq, lq, Kt, z.mp, z.dp, cols, t.scale, S, z.mp);
                probabilities(S, z.mp, cols, i0, &t, valid, 0, lse + (size_t)bh * s->n);
                rows_times_x(S, z.mp, 1, Vh, lv, 0, cols, z.dp, O, z.dp);
                for (int r = 0; r < ROWS && i0 + r < t.n; r++)
                    store_row(o, b, h, i0 + r, t.d, O + (size_t)r * z.dp);
            }
        }
        free(Q);
#ifdef __AVX512F__
        _mm_sfence();
#endif
    }
    return failed ? -2 : 0;
}

int attention_backward(const Shape *s, const View *q, const View *k, const View *v,
                       const View *o, const View *dout, const float *lse, const View *dq,
                       const View *dk, const View *dv, int threads) {
    if (s->d <= 0 || (!s->n_of && (s->n <= 0 || s->m <= 0))) return -1; /* packed: may be 0 */
#ifdef TILES
    if (s->tiles && !s->n_of && q->dtype == 1 && k->dtype == 1 && v->dtype == 1 &&
        dout->dtype == 1 && tiles_permitted())
        return tiles_backward(s, q, k, v, o, dout, lse, dq, dk, dv, threads);
#endif
    Padded most = padded(s); /* the scratch's sizes; each batch lays its own out in it */
    size_t nd = (size_t)most.np * most.dp, md = (size_t)most.mp * most.dp;
    size_t nm = (size_t)most.np * most.mp;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Q, dO, dQ: np x dp; K, dK, dV: mp x dp; Kt, Vt: dp x mp; P, dS: np x mp; D: np;
         * 17 rows of dp */
        float *Q = scratch(3 * nd + 5 * md + 2 * nm + most.np + 17 * (size_t)most.dp);
        if (!Q) {
#pragma omp atomic write
            failed = 1;
        }
        float *dO = Q + nd, *dQ = dO + nd, *K = dQ + nd, *dK = K + md, *dV = dK + md;
        float *Kt = dV + md, *Vt = Kt + md, *P = Vt + md, *dS = P + nm, *D = dS + nm;
        float *row = D + most.np, *oi = row + 16 * (size_t)most.dp;
#pragma omp for schedule(dynamic)
        for (int bh = 0; bh < s->batch * s->heads; bh++) {
            if (!Q) continue;
            int b = bh / s->heads, h = bh % s->heads;
            Shape t = of_batch(s, b);
            Padded z = padded(&t);
            int n = t.n, m = t.m, d = t.d;
            int lq, lo, lk;
            const float *Qh = rows_of(q, b, h, n, d, z.np, z.dp, Q, &lq);
            const float *dOh = rows_of(dout, b, h, n, d, z.np, z.dp, dO, &lo);
            const float *Kh = rows_of(k, b, h, m, d, z.mp, z.dp, K, &lk);
            load_cols(k, b, h, m, d, z.mp, z.dp, row, Kt);
            load_cols(v, b, h, m, d, z.mp, z.dp, row, Vt);
            for (int i = 0; i < z.np; i++) { /* D_i = do_i . o_i */
                float sum = 0.0f;
                if (i < n) {
                    load_row(o, b, h, i, d, oi);
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < d; t++) sum += dOh[(size_t)i * lo + t] * oi[t];
                }
                D[i] = sum;
            }
            const uint8_t *valid = s->valid ? s->valid + (size_t)b * s->m : 0;
            const float *head_lse = lse + (size_t)bh * s->n;
            for (int i0 = 0; i0 < z.np; i0 += ROWS) {
                float *Pi = P + (size_t)i0 * z.mp, *dSi = dS + (size_t)i0 * z.mp;
                int cols = i0 < n ? block_cols(i0, &t) : 0;
                prefetch_rows(Qh, lq, i0 + ROWS, n, z.dp);
                rows_times_bt(Qh + (size_t)i0 * lq, lq, Kt, z.mp, z.dp, cols, t.scale, Pi, z.mp);
                probabilities(Pi, z.mp, cols, i0, &t, valid, head_lse, 0);
                rows_times_bt(dOh + (size_t)i0 * lo, lo, Vt, z.mp, z.dp, cols, 1.0f, dSi, z.mp);
                for (int r = 0; r < ROWS; r++) { /* ds = p (dp - D) scale; 0 wherever p is */
                    float Di = D[i0 + r], *pr = Pi + (size_t)r * z.mp, *dsr = dSi + (size_t)r * z.mp;
#pragma omp simd
                    for (int j = 0; j < cols; j++) dsr[j] = pr[j] * (dsr[j] - Di) * s->scale;
                }
                /* dq_i = sum_j ds_ij k_j */
                rows_times_x(dSi, z.mp, 1, Kh, lk, 0, cols, z.dp, dQ + (size_t)i0 * z.dp, z.dp);
            }
            /* dv_j = sum_i p_ij do_i and dk_j = sum_i ds_ij q_i: rows of P^T and dS^T; causal
             * rows i < j - (m - n) have p_ij = 0 and are skipped */
            for (int j0 = 0; j0 < z.mp; j0 += ROWS) {
                int first = t.causal ? j0 - (m - n) : 0;
                first = first < 0 ? 0 : (first > z.np ? z.np : first);
                float *dVj = dV + (size_t)j0 * z.dp, *dKj = dK + (size_t)j0 * z.dp;
                rows_times_x(P + j0, 1, z.mp, dOh, lo, first, z.np, z.dp, dVj, z.dp);
                rows_times_x(dS + j0, 1, z.mp, Qh, lq, first, z.np, z.dp, dKj, z.dp);
            }
            for (int i = 0; i < n; i++) store_row(dq, b, h, i, d, dQ + (size_t)i * z.dp);
            for (int j = 0; j < m; j++) {
                store_row(dk, b, h, j, d, dK + (size_t)j * z.dp);
                store_row(dv, b, h, j, d, dV + (size_t)j * z.dp);
            }
        }
        free(Q);
#ifdef __AVX512F__
        _mm_sfence();
#endif
    }
    return failed ? -2 : 0;
}

/* 1 where the bfloat16 path runs on AMX tiles: built with them, and Linux lends them */
int attention_tiles(void) {
#ifdef TILES
    return tiles_permitted();
#else
    return 0;
#endif
}

/* The size of each struct in structs.h (0 View, 1 Shape, 2 LlamaLayer): native.py compares them
 * with its ctypes classes when it loads the library. */
long attnkit_struct_size(int which) {
    switch (which) {
    case 0: return (long)sizeof(View);
    case 1: return (long)sizeof(Shape);
    case 2: return (long)sizeof(LlamaLayer);
    case 3: return (long)sizeof(LlamaCache);
    default: return -1;
    }
}
