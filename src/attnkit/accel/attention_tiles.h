/* attention.c's bfloat16 path on processors with AMX tiles (Intel Xeon from Sapphire Rapids on):
 * the same equations, with every product on the tile unit (bfloat16 in, float32 sums), and the
 * softmax and ds = scale p (dp - D) in float32 as in the float32 path. p and ds are rounded to
 * bfloat16 before the products that take them, as FlashAttention's bf16 kernels round them.
 *
 * A tile product C (16 x 16 float32) += A (16 x 32 bf16) B (32 x 16 bf16) wants B in pairs of
 * rows: row t of the tile holds B[2t][c] and B[2t+1][c] side by side for each column c. So each
 * head is copied into bf16 scratch, zero-padded (rows and keys to 32, d to 32), in the layouts
 * its products read:
 *
 *   s  = q k^T     A: q rows          B: k, pairs over d      (k^T's rows are k's columns)
 *   o  = p v       A: p rows          B: v, pairs of keys
 *   dp = do v^T    A: do rows         B: v, pairs over d
 *   dq = ds k      A: ds rows         B: k, pairs of keys
 *   dv^T = do^T p  A: do transposed   B: p, pairs of queries
 *   dk^T = q^T ds  A: q transposed    B: ds, pairs of queries
 *
 * The last two give dv and dk transposed (d x m, small), so p and ds (n x m) are never
 * transposed, only interleaved two rows at a time; the small transposes (q, do, k and v's pairs
 * over d, dv^T, dk^T) go 16 x 16 32-bit values at a time in registers. Rows go in blocks of 32
 * (two tiles). The softmax runs on AVX-512 intrinsics, one pass for the row maximum and one for
 * exp, the sum and the rounding (the forward divides o by the sum instead of p). On an Intel
 * Xeon (family 6, model 167; 2 threads) this halves the bf16 kernel's time at lm-small's and
 * mt-small's shapes against the float32-arithmetic path (bench/history/). */
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_ROWS 32

/* Linux lends a process the tile registers only when asked (arch_prctl ARCH_REQ_XCOMP_PERM,
 * feature 18: XTILEDATA); once per process. */
static int tiles_permitted(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}

/* Each thread configures its own tiles: all eight 16 rows x 64 bytes. tmm0-1 hold A (32 rows),
 * tmm2 B, tmm4-5 C. */
static void tiles_configure(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        config __attribute__((aligned(64)));
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

/* C[r][c] = sum_{t < kk} A[r][t] B[t][c] for 32 rows r and c < cols (a multiple of 16), kk a
 * multiple of 32: A bf16 with row stride lda; B in pairs of rows, pair row t/2 at B + (t/2) ldb
 * (ldb in pairs); C float32, row stride ldc. kk = 0 gives zeros. */
static void tiles_product(const uint16_t *A, int lda, const uint32_t *B, int ldb, int kk,
                          int cols, float *C, int ldc) {
    for (int c = 0; c < cols; c += 16) {
        _tile_zero(4);
        _tile_zero(5);
        for (int t = 0; t < kk; t += 32) {
            _tile_loadd(0, A + t, lda * 2);
            _tile_loadd(1, A + (size_t)16 * lda + t, lda * 2);
            _tile_loadd(2, B + (size_t)(t / 2) * ldb + c, ldb * 4);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 1, 2);
        }
        _tile_stored(4, C + c, ldc * 4);
        _tile_stored(5, C + (size_t)16 * ldc + c, ldc * 4);
    }
}

/* a bf16 row of a (b, h) slice into out (d values; the padding past d is left as it is) */
static inline void copy_row16(const View *v, int b, int h, int n, int d, uint16_t *out) {
    const uint16_t *src = (const uint16_t *)v->data + offset(v, b, h, n);
    for (int t = 0; t < d; t += 32) {
        __mmask32 lanes = d - t >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (d - t)) - 1;
        _mm512_mask_storeu_epi16(out + t, lanes, _mm512_maskz_loadu_epi16(lanes, src + t));
    }
}

/* 16 bf16 values of x and of y, interleaved: lane l holds x[l] (low half) and y[l] */
static inline __m512i interleave16(const uint16_t *x, const uint16_t *y) {
    __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)y));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* n rows of a bf16 slice: row-major (np x dp) into rows, and transposed (dp x np) into cols if
 * not NULL; zero-padded. The transpose goes 32 rows at a time: rows interleaved in pairs, then
 * 16 x 16 pairs transposed in registers. */
static void tiles_rows(const View *v, int b, int h, int n, int d, int np, int dp, uint16_t *rows,
                       uint16_t *cols) {
    memset(rows, 0, 2 * (size_t)np * dp);
    for (int i = 0; i < n; i++) copy_row16(v, b, h, i, d, rows + (size_t)i * dp);
    if (!cols) return;
    for (int i0 = 0; i0 < np; i0 += 32)
        for (int c0 = 0; c0 < dp; c0 += 16) {
            __m512i r[16];
            for (int l = 0; l < 16; l++) {
                const uint16_t *x = rows + (size_t)(i0 + 2 * l) * dp + c0;
                r[l] = interleave16(x, x + dp);
            }
            transpose16(r);
            for (int q = 0; q < 16; q++)
                _mm512_storeu_si512(cols + (size_t)(c0 + q) * np + i0, r[q]);
        }
}

/* m key (or value) rows of a bf16 slice, zero-padded: pairs over d (dp/2 x mp pairs) into
 * over_d and pairs of keys (mp/2 x dp pairs) into over_keys, each if not NULL. rows: 16 x dp
 * scratch. 16 keys at a time; pairs over d are 16 x 16 transposes of the keys' pairs. */
static void tiles_keys(const View *v, int b, int h, int m, int d, int mp, int dp, uint16_t *rows,
                       uint32_t *over_d, uint32_t *over_keys) {
    for (int j0 = 0; j0 < mp; j0 += 16) {
        memset(rows, 0, 2 * 16 * (size_t)dp);
        for (int l = 0; l < 16 && j0 + l < m; l++)
            copy_row16(v, b, h, j0 + l, d, rows + (size_t)l * dp);
        if (over_d) /* the rows as dp / 2 pairs each */
            for (int p0 = 0; p0 < dp / 2; p0 += 16)
                transpose_block16(rows + 2 * p0, dp / 2, over_d + (size_t)p0 * mp + j0, mp);
        if (over_keys)
            for (int l = 0; l < 16; l += 2)
                for (int c0 = 0; c0 < dp; c0 += 16) {
                    const uint16_t *x = rows + (size_t)l * dp + c0;
                    _mm512_storeu_si512(over_keys + (size_t)((j0 + l) / 2) * dp + c0,
                                        interleave16(x, x + dp));
                }
    }
}

/* columns j0 .. j0 + 15 of a dp x ld float32 matrix X, as 16 rows of dp in out */
static void tiles_columns(const float *X, int ld, int j0, int dp, float *out) {
    for (int c0 = 0; c0 < dp; c0 += 16)
        transpose_block16(X + (size_t)c0 * ld + j0, ld, out + c0, dp);
}

/* 0 for a key that may be attended, -inf for padding (and past m), for mp keys */
static void tiles_bias(const uint8_t *valid, int m, int mp, float *bias) {
    for (int j = 0; j < mp; j++) bias[j] = j < m && (!valid || valid[j]) ? 0.0f : -INFINITY;
}

/* bf16 bits of 16 floats (rounded to nearest even), widened to 32 bits each */
static inline __m512i bf16_wide(__m512 x) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

/* The forward's softmax over 32 rows of raw scores S (row stride mp): p = exp(scale s + bias -
 * top_i) for the keys row i may see, 0 for the rest up to width, into P as bf16 (row stride
 * mp), unnormalised; 1 / sum_j p_ij into inv, and lse_i = top_i + log sum_j p_ij. A row with
 * nothing to attend to gets p = 0, inv = 0 and lse = +inf. */
static void tiles_softmax(const float *S, int mp, int width, int i0, const Shape *s,
                          const float *bias, uint16_t *P, float *inv, float *lse) {
    __m512 scale = _mm512_set1_ps(s->scale);
    for (int r = 0; r < TILE_ROWS; r++) {
        const float *row = S + (size_t)r * mp;
        uint16_t *out = P + (size_t)r * mp;
        int i = i0 + r, len = i < s->n ? visible(i, s->n, s->m, s->causal) : 0;
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int j = 0; j < len; j += 16) {
            __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(row + j), scale, _mm512_loadu_ps(bias + j));
            top = _mm512_mask_max_ps(top, below(len, j), top, x);
        }
        float t = _mm512_reduce_max_ps(top);
        if (t == -INFINITY) len = 0;
        top = _mm512_set1_ps(t);
        for (int j = 0; j < width; j += 16) {
            __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(row + j), scale, _mm512_loadu_ps(bias + j));
            __m512 e = _mm512_maskz_mov_ps(below(len, j), exp_neg16(_mm512_sub_ps(x, top)));
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i *)(out + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        float total = _mm512_reduce_add_ps(sum);
        inv[r] = len ? 1.0f / total : 0.0f;
        if (i < s->n) lse[i] = len ? t + logf(total) : INFINITY;
    }
}

/* The backward's softmax and ds over 32 rows, two at a time: from raw scores S and dp = do . v
 * (row stride mp each), p = exp(scale s + bias - lse_i) where row i may see the key, else 0,
 * and ds = scale p (dp - D_i) (D: the block's 32), for keys below width, rounded to bf16: p
 * and ds in pairs of rows (Pv, dSv; row stride mp pairs) and ds row-major (dSb, row stride
 * mp). */
static void tiles_grad_scores(const float *S, const float *dP, int mp, int width, int i0,
                              const Shape *s, const float *bias, const float *lse,
                              const float *D, uint32_t *Pv, uint32_t *dSv, uint16_t *dSb) {
    __m512 scale = _mm512_set1_ps(s->scale);
    for (int r = 0; r < TILE_ROWS; r += 2) {
        int i = i0 + r, len0 = i < s->n ? visible(i, s->n, s->m, s->causal) : 0;
        int len1 = i + 1 < s->n ? visible(i + 1, s->n, s->m, s->causal) : 0;
        __m512 lse0 = _mm512_set1_ps(len0 ? lse[i] : INFINITY);
        __m512 lse1 = _mm512_set1_ps(len1 ? lse[i + 1] : INFINITY);
        __m512 D0 = _mm512_set1_ps(D[r]), D1 = _mm512_set1_ps(D[r + 1]);
        const float *s0 = S + (size_t)r * mp, *s1 = s0 + mp;
        const float *g0 = dP + (size_t)r * mp, *g1 = g0 + mp;
        uint32_t *pv = Pv + (size_t)(r / 2) * mp, *dsv = dSv + (size_t)(r / 2) * mp;
        uint16_t *ds0 = dSb + (size_t)r * mp, *ds1 = ds0 + mp;
        for (int j = 0; j < width; j += 16) {
            __m512 b = _mm512_loadu_ps(bias + j);
            __m512 x0 = _mm512_fmadd_ps(_mm512_loadu_ps(s0 + j), scale, b);
            __m512 x1 = _mm512_fmadd_ps(_mm512_loadu_ps(s1 + j), scale, b);
            __m512 p0 = _mm512_maskz_mov_ps(below(len0, j), exp_neg16(_mm512_sub_ps(x0, lse0)));
            __m512 p1 = _mm512_maskz_mov_ps(below(len1, j), exp_neg16(_mm512_sub_ps(x1, lse1)));
            __m512 a0 = _mm512_mul_ps(_mm512_mul_ps(p0, scale), _mm512_loadu_ps(g0 + j) - D0);
            __m512 a1 = _mm512_mul_ps(_mm512_mul_ps(p1, scale), _mm512_loadu_ps(g1 + j) - D1);
            __m512i w0 = bf16_wide(a0), w1 = bf16_wide(a1);
            __m512i pair = _mm512_or_si512(bf16_wide(p0), _mm512_slli_epi32(bf16_wide(p1), 16));
            _mm512_storeu_si512(pv + j, pair);
            _mm512_storeu_si512(dsv + j, _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
            _mm256_storeu_si256((__m256i *)(ds0 + j), _mm512_cvtepi32_epi16(w0));
            _mm256_storeu_si256((__m256i *)(ds1 + j), _mm512_cvtepi32_epi16(w1));
        }
    }
}

/* the widest row of keys any of rows i0..i0+31 sees, rounded up to 32 */
static int tiles_width(int i0, const Shape *s) {
    int last = i0 + TILE_ROWS - 1 < s->n ? i0 + TILE_ROWS - 1 : s->n - 1;
    return round_up(visible(last, s->n, s->m, s->causal), 32);
}

static void *bytes(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

static int tiles_forward(const Shape *s, const View *q, const View *k, const View *v,
                         const View *o, float *lse, int threads) {
    int np = round_up(s->n, TILE_ROWS), mp = round_up(s->m, 32), dp = round_up(s->d, 32);
    size_t nd = (size_t)np * dp, md = (size_t)mp * dp, wide = (size_t)TILE_ROWS * mp;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* bf16: Q np x dp, K pairs over d, V pairs of keys, P 32 x mp, 16 rows of dp;
         * float32: S 32 x mp, O 32 x dp, bias mp, inv 32 */
        uint16_t *Q = bytes(2 * (nd + 2 * md + wide + 16 * (size_t)dp) +
                            4 * (wide + (size_t)TILE_ROWS * dp + mp + TILE_ROWS));
        if (!Q) {
#pragma omp atomic write
            failed = 1;
        } else {
            tiles_configure();
        }
        uint32_t *K = (uint32_t *)(Q + nd);
        uint16_t *V = (uint16_t *)(K + md / 2), *P = V + md, *row = P + wide;
        float *S = (float *)(row + 16 * (size_t)dp), *O = S + wide;
        float *bias = O + (size_t)TILE_ROWS * dp, *inv = bias + mp;
#pragma omp for schedule(dynamic)
        for (int bh = 0; bh < s->batch * s->heads; bh++) {
            if (!Q) continue;
            int b = bh / s->heads, h = bh % s->heads;
            tiles_rows(q, b, h, s->n, s->d, np, dp, Q, 0);
            tiles_keys(k, b, h, s->m, s->d, mp, dp, row, K, 0);
            tiles_keys(v, b, h, s->m, s->d, mp, dp, row, 0, (uint32_t *)V);
            tiles_bias(s->valid ? s->valid + (size_t)b * s->m : 0, s->m, mp, bias);
            for (int i0 = 0; i0 < s->n; i0 += TILE_ROWS) {
                int cols = tiles_width(i0, s);
                tiles_product(Q + (size_t)i0 * dp, dp, K, mp, dp, cols, S, mp);
                tiles_softmax(S, mp, cols, i0, s, bias, P, inv, lse + (size_t)bh * s->n);
                tiles_product(P, mp, (const uint32_t *)V, dp, cols, dp, O, dp);
                for (int r = 0; r < TILE_ROWS && i0 + r < s->n; r++) {
                    float *out = O + (size_t)r * dp;
#pragma omp simd
                    for (int c = 0; c < dp; c++) out[c] *= inv[r];
                    store_row(o, b, h, i0 + r, s->d, out);
                }
            }
        }
        if (Q) _tile_release();
        free(Q);
        _mm_sfence();
    }
    return failed ? -2 : 0;
}

static int tiles_backward(const Shape *s, const View *q, const View *k, const View *v,
                          const View *o, const View *dout, const float *lse, const View *dq,
                          const View *dk, const View *dv, int threads) {
    int np = round_up(s->n, TILE_ROWS), mp = round_up(s->m, 32), dp = round_up(s->d, 32);
    size_t nd = (size_t)np * dp, md = (size_t)mp * dp, nm = (size_t)np * mp;
    size_t wide = (size_t)TILE_ROWS * mp;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* bf16: Q, Q^T, dO, dO^T (np x dp each); K pairs over d, V pairs over d, K pairs of keys;
         * P and dS in pairs of queries (np x mp each); 32 rows of dS; 16 rows of dp.
         * float32: S, dP (32 x mp each); dQ (32 x dp); dV^T, dK^T (dp x mp each); D (np); 16
         * rows of dp; bias (mp) */
        uint16_t *Q = bytes(2 * (4 * nd + 3 * md + 2 * nm + wide + 16 * (size_t)dp) +
                            4 * (2 * wide + (size_t)(TILE_ROWS + 16) * dp + 2 * md + np + mp));
        if (!Q) {
#pragma omp atomic write
            failed = 1;
        } else {
            tiles_configure();
        }
        uint16_t *Qt = Q + nd, *dO = Qt + nd, *dOt = dO + nd;
        uint32_t *Kd = (uint32_t *)(dOt + nd), *Vd = Kd + md / 2;
        uint16_t *Kk = (uint16_t *)(Vd + md / 2);
        uint32_t *Pv = (uint32_t *)(Kk + md), *dSv = Pv + nm / 2;
        uint16_t *dSb = (uint16_t *)(dSv + nm / 2), *row = dSb + wide;
        float *S = (float *)(row + 16 * (size_t)dp), *dP = S + wide, *dQ = dP + wide;
        float *dVt = dQ + (size_t)TILE_ROWS * dp, *dKt = dVt + md, *D = dKt + md, *vec = D + np;
        float *bias = vec + 16 * (size_t)dp;
#pragma omp for schedule(dynamic)
        for (int bh = 0; bh < s->batch * s->heads; bh++) {
            if (!Q) continue;
            int b = bh / s->heads, h = bh % s->heads, n = s->n, m = s->m, d = s->d;
            tiles_rows(q, b, h, n, d, np, dp, Q, Qt);
            tiles_rows(dout, b, h, n, d, np, dp, dO, dOt);
            tiles_keys(k, b, h, m, d, mp, dp, row, Kd, (uint32_t *)Kk);
            tiles_keys(v, b, h, m, d, mp, dp, row, Vd, 0);
            for (int i = 0; i < np; i++) { /* D_i = do_i . o_i */
                float sum = 0.0f;
                if (i < n) {
                    load_row(o, b, h, i, d, vec);
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < d; t++) sum += bf16_load(dO[(size_t)i * dp + t]) * vec[t];
                }
                D[i] = sum;
            }
            tiles_bias(s->valid ? s->valid + (size_t)b * m : 0, m, mp, bias);
            const float *head_lse = lse + (size_t)bh * n;
            for (int i0 = 0; i0 < n; i0 += TILE_ROWS) {
                int cols = tiles_width(i0, s);
                tiles_product(Q + (size_t)i0 * dp, dp, Kd, mp, dp, cols, S, mp);
                tiles_product(dO + (size_t)i0 * dp, dp, Vd, mp, dp, cols, dP, mp);
                tiles_grad_scores(S, dP, mp, cols, i0, s, bias, head_lse, D + i0,
                                  Pv + (size_t)(i0 / 2) * mp, dSv + (size_t)(i0 / 2) * mp, dSb);
                /* dq_i = sum_j ds_ij k_j */
                tiles_product(dSb, mp, (const uint32_t *)Kk, dp, cols, dp, dQ, dp);
                for (int r = 0; r < TILE_ROWS && i0 + r < n; r++)
                    store_row(dq, b, h, i0 + r, d, dQ + (size_t)r * dp);
            }
            /* dv^T = do^T p and dk^T = q^T ds, 16 keys at a time; causal blocks of queries that
             * cannot see them are skipped (every block read was written up to these keys) */
            for (int j0 = 0; j0 < mp; j0 += 16) {
                int first = s->causal ? j0 - (m - n) : 0;
                first = (first < 0 ? 0 : (first > np ? np : first)) / TILE_ROWS * TILE_ROWS;
                for (int c = 0; c < dp; c += TILE_ROWS) {
                    size_t a = (size_t)c * np + first, pairs = (size_t)(first / 2) * mp + j0;
                    size_t out = (size_t)c * mp + j0;
                    tiles_product(dOt + a, np, Pv + pairs, mp, np - first, 16, dVt + out, mp);
                    tiles_product(Qt + a, np, dSv + pairs, mp, np - first, 16, dKt + out, mp);
                }
            }
            for (int j0 = 0; j0 < m; j0 += 16) {
                tiles_columns(dKt, mp, j0, dp, vec);
                for (int l = 0; l < 16 && j0 + l < m; l++)
                    store_row(dk, b, h, j0 + l, d, vec + (size_t)l * dp);
                tiles_columns(dVt, mp, j0, dp, vec);
                for (int l = 0; l < 16 && j0 + l < m; l++)
                    store_row(dv, b, h, j0 + l, d, vec + (size_t)l * dp);
            }
        }
        if (Q) _tile_release();
        free(Q);
        _mm_sfence();
    }
    return failed ? -2 : 0;
}
