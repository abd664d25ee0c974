/* The float path's products with weights kept in llama.cpp's block formats (the integer path's
 * are tiles.c's; the Llama forward that calls both, llama_step.c).
 *
 * y[m, n] = sum_k x[m, k] W[n, k] for a few rows m (decoding: one row per sequence), W stored as
 * rows of K / 32 blocks. Each block is read once per call and used for every row of x, so the
 * weights are read once per call: decoding is bound by the bytes of weights it reads, and a
 * packed block is 3.6-6.4x smaller than its 32 float32 weights.
 *
 *   Q8_0  34 bytes: float16 d, 32 int8 q                w = d * q
 *   Q4_0  18 bytes: float16 d, 16 bytes of nibbles       w = d * (q - 8)
 *   Q4_1  20 bytes: float16 d, float16 m, 16 bytes       w = d * q + m
 *   Q4_K  24 bytes: float32 d, float32 m, 16 bytes       w = d * q + m  (a GGUF Q4_K
 *         super-block's 32-weight groups, repacked at load: d and m are exact in float32)
 *   Q6_K  40 bytes: float32 d_a, d_b, 32 int8 q           w = d_a q (weights 0-15), d_b q
 *         (16-31)  (a GGUF Q6_K super-block's 32-weight groups, repacked at load)
 *   Q5_K  40 bytes: float32 d, float32 m, 32 bytes q       w = d * q + m, q in 0..31  (a GGUF
 *         Q5_K super-block's 32-weight groups, repacked at load)
 *
 * In the 16 bytes of a 4-bit block, the low nibbles are weights 0-15, the high ones 16-31.
 * A block's share of y is computed as d * (q . x_b) + m * sum(x_b): the integers q become
 * floats in vector registers (exactly: they are small), x stays float32, and the scale is
 * applied once per block rather than once per weight. The result equals the product with the
 * dequantized weights up to float32 rounding in a different order. A row's result does not
 * depend on the other rows of the call; it does depend on the variant (16, 8 or 1 float lanes
 * add a block's products in different orders).
 *
 * Vector code for AVX-512 (16 floats at a time) and AVX2 + FMA + F16C (8), plain C elsewhere;
 * built at install by setup.py, one library per instruction set (variants.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "packed.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, a) _mm512_storeu_ps(p, a)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vfmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vset1(s) _mm512_set1_ps(s)
#define vsum(a) _mm512_reduce_add_ps(a)
/* 16 signed bytes -> 16 floats */
static inline void i8_to_vec(__m128i q, vec *w) { w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, a) _mm256_storeu_ps(p, a)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vfmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vset1(s) _mm256_set1_ps(s)
static inline float vsum(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_hadd_ps(r, r);
    r = _mm_hadd_ps(r, r);
    return _mm_cvtss_f32(r);
}
static inline void u8_to_vec(__m128i q, vec *w) {
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
}
static inline void i8_to_vec(__m128i q, vec *w) {
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}
#else /* plain C: a "vector" of one float, so the loops below serve every build */
#define LANES 1
typedef float vec;
#define vzero() 0.0f
#define vload(p) (*(p))
#define vstore(p, a) (*(p) = (a))
#define vmul(a, b) ((a) * (b))
#define vfmadd(a, b, c) ((a) * (b) + (c))
#define vset1(s) (s)
#define vsum(a) (a)
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if LANES > 1
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

#define NV (QK / LANES) /* vectors per block */

#if LANES > 1
/* One block -> its 32 integer weights as NV float vectors, its scale d and minimum m. */
static inline void load_q8_0(const uint8_t *b, vec *w, float *d, float *m) {
    *d = half_to_float(b);
    *m = 0.0f;
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 2)), w);
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 18)), w + NV / 2);
}

/* Q6_K, repacked (repack_q6_k): float32 d_a and d_b, each 16 weights' d * scale, then 32
 * int8 q - 32. The weights come out as d_a q (rounded once, as gguf's dequantization) with
 * d = 1 and m = 0. */
static inline void load_q6_k(const uint8_t *b, vec *w, float *d, float *m) {
    float da, db;
    memcpy(&da, b, 4);
    memcpy(&db, b + 4, 4);
    *d = 1.0f;
    *m = 0.0f;
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 8)), w);
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 24)), w + NV / 2);
    for (int v = 0; v < NV / 2; v++) {
        w[v] = vmul(w[v], vset1(da));
        w[v + NV / 2] = vmul(w[v + NV / 2], vset1(db));
    }
}

/* Q5_K, repacked (repack_q5_k): float32 d and m, then the 32 integers q (0..31), a byte each:
 * read as int8, which they fit. */
static inline void load_q5_k(const uint8_t *b, vec *w, float *d, float *m) {
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 8)), w);
    i8_to_vec(_mm_loadu_si128((const __m128i *)(b + 24)), w + NV / 2);
}

#if LANES == 16
/* AVX-512: a 4-bit weight becomes a float by a table lookup, vpermps reading the low 4 bits of
 * each 32-bit lane: the 16 bytes widened to 16 lanes give the low nibbles directly and, shifted
 * right by 4, the high ones. The table holds the 16 integer values as floats. */
static inline void nibble_floats(const uint8_t *qs, vec table, vec *w) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    w[0] = _mm512_permutexvar_ps(q, table);                         /* weights 0-15 */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);   /* weights 16-31 */
}

static inline void load_q4_0(const uint8_t *b, vec *w, float *d, float *m) {
    const vec table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    *d = half_to_float(b);
    *m = 0.0f;
    nibble_floats(b + 2, table, w);
}

static inline void load_q4_1(const uint8_t *b, vec *w, float *d, float *m) {
    const vec table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *d = half_to_float(b);
    *m = half_to_float(b + 2);
    nibble_floats(b + 4, table, w);
}

static inline void load_q4_k(const uint8_t *b, vec *w, float *d, float *m) {
    const vec table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    nibble_floats(b + 8, table, w);
}
#else /* AVX2 */
static inline void nibbles(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
    *lo = _mm_and_si128(q, mask);                     /* weights 0-15 */
    *hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);  /* weights 16-31 */
}

static inline void load_q4_0(const uint8_t *b, vec *w, float *d, float *m) {
    __m128i lo, hi;
    *d = half_to_float(b);
    *m = 0.0f;
    nibbles(b + 2, &lo, &hi);
    const __m128i eight = _mm_set1_epi8(8);
    i8_to_vec(_mm_sub_epi8(lo, eight), w);  /* q - 8, in [-8, 7] */
    i8_to_vec(_mm_sub_epi8(hi, eight), w + NV / 2);
}

static inline void load_q4_1(const uint8_t *b, vec *w, float *d, float *m) {
    __m128i lo, hi;
    *d = half_to_float(b);
    *m = half_to_float(b + 2);
    nibbles(b + 4, &lo, &hi);
    u8_to_vec(lo, w);
    u8_to_vec(hi, w + NV / 2);
}

static inline void load_q4_k(const uint8_t *b, vec *w, float *d, float *m) {
    __m128i lo, hi;
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    nibbles(b + 8, &lo, &hi);
    u8_to_vec(lo, w);
    u8_to_vec(hi, w + NV / 2);
}
#endif

#else /* plain C: each block decoded to 32 floats */

static inline void load_q8_0(const uint8_t *b, float *w, float *d, float *m) {
    *d = half_to_float(b);
    *m = 0.0f;
    for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)b[2 + j];
}

static inline void load_q4_0(const uint8_t *b, float *w, float *d, float *m) {
    *d = half_to_float(b);
    *m = 0.0f;
    for (int j = 0; j < QK / 2; j++) w[j] = (float)((b[2 + j] & 15) - 8);
    for (int j = 0; j < QK / 2; j++) w[j + QK / 2] = (float)((b[2 + j] >> 4) - 8);
}

static inline void load_q4_1(const uint8_t *b, float *w, float *d, float *m) {
    *d = half_to_float(b);
    *m = half_to_float(b + 2);
    for (int j = 0; j < QK / 2; j++) w[j] = (float)(b[4 + j] & 15);
    for (int j = 0; j < QK / 2; j++) w[j + QK / 2] = (float)(b[4 + j] >> 4);
}

static inline void load_q4_k(const uint8_t *b, float *w, float *d, float *m) {
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    for (int j = 0; j < QK / 2; j++) w[j] = (float)(b[8 + j] & 15);
    for (int j = 0; j < QK / 2; j++) w[j + QK / 2] = (float)(b[8 + j] >> 4);
}

static inline void load_q6_k(const uint8_t *b, float *w, float *d, float *m) {
    float da, db;
    memcpy(&da, b, 4);
    memcpy(&db, b + 4, 4);
    *d = 1.0f;
    *m = 0.0f;
    for (int j = 0; j < QK; j++) w[j] = (float)(int8_t)b[8 + j] * (j < QK / 2 ? da : db);
}

static inline void load_q5_k(const uint8_t *b, float *w, float *d, float *m) {
    memcpy(d, b, 4);
    memcpy(m, b + 4, 4);
    for (int j = 0; j < QK; j++) w[j] = (float)b[8 + j];
}
#endif

/* Block b's share for rows r < ROWS of x, against the output row at `row`:
 * acc[r] += d * (q . x_b) lane by lane, shift[r] += m * sum(x_b). */
#define BLOCK_SHARE(ROWS, LOAD, BLOCK_BYTES, row, acc, shift)                                  \
    {                                                                                          \
        vec w[NV];                                                                             \
        float d, m;                                                                            \
        LOAD((row) + (size_t)b * BLOCK_BYTES, w, &d, &m);                                      \
        const vec vd = vset1(d);                                                               \
        for (int r = 0; r < (ROWS); r++) {                                                     \
            const float *xb = x + (size_t)r * K + (size_t)b * QK;                              \
            vec s = vmul(w[0], vload(xb));                                                     \
            for (int v = 1; v < NV; v++) s = vfmadd(w[v], vload(xb + v * LANES), s);          \
            (acc)[r] = vfmadd(vd, s, (acc)[r]);                                                \
            (shift)[r] += m * sums[(size_t)r * nb + b];                                        \
        }                                                                                      \
    }

/* y[r, n] (or y[r, n] + that, with add: a residual connection) for the rows of x, every block
 * loaded once and used for each row. One row (a decoding step) has a loop of its own, whose
 * sums stay in registers. The loops are shared among the threads of the enclosing parallel
 * region (omp for). */
#define PACKED_MATMUL(NAME, LOAD, BLOCK_BYTES)                                                 \
    static void NAME(const uint8_t *W, const float *x, const float *sums, float *y, int rows,  \
                     int N, int K, int add) {                                                  \
        const int nb = K / QK;                                                                 \
        const size_t row_bytes = (size_t)nb * BLOCK_BYTES;                                     \
        if (rows == 1) {                                                                       \
            _Pragma("omp for schedule(static)")                                                \
            for (int n = 0; n < N; n++) {                                                      \
                vec acc[1] = {vzero()};                                                        \
                float shift[1] = {0.0f};                                                       \
                const uint8_t *row = W + (size_t)n * row_bytes;                                \
                for (int b = 0; b < nb; b++) BLOCK_SHARE(1, LOAD, BLOCK_BYTES, row, acc, shift) \
                const float share = vsum(acc[0]) + shift[0];                                   \
                y[n] = add ? y[n] + share : share;                                             \
            }                                                                                  \
        } else {                                                                               \
            _Pragma("omp for schedule(static)")                                                \
            for (int n = 0; n < N; n++) {                                                      \
                vec acc[MAX_ROWS];                                                             \
                float shift[MAX_ROWS];                                                         \
                for (int r = 0; r < rows; r++) {                                               \
                    acc[r] = vzero();                                                          \
                    shift[r] = 0.0f;                                                           \
                }                                                                              \
                const uint8_t *row = W + (size_t)n * row_bytes;                                \
                for (int b = 0; b < nb; b++) BLOCK_SHARE(rows, LOAD, BLOCK_BYTES, row, acc, shift) \
                for (int r = 0; r < rows; r++) {                                               \
                    const float share = vsum(acc[r]) + shift[r];                               \
                    float *out = y + (size_t)r * N + n;                                        \
                    *out = add ? *out + share : share;                                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

/* W as float32 rows, out[n * K + k]: for a prompt, whose product then goes through a GEMM. */
#define DEQUANTIZE(NAME, LOAD, BLOCK_BYTES)                                                    \
    static void NAME(const uint8_t *W, float *out, int N, int K, int threads) {                \
        const int nb = K / QK;                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                      \
        for (int n = 0; n < N; n++) {                                                          \
            const uint8_t *row = W + (size_t)n * nb * BLOCK_BYTES;                             \
            for (int b = 0; b < nb; b++) {                                                     \
                vec w[NV];                                                                     \
                float d, m;                                                                    \
                LOAD(row + (size_t)b * BLOCK_BYTES, w, &d, &m);                                \
                float *o = out + (size_t)n * K + (size_t)b * QK;                               \
                for (int v = 0; v < NV; v++)                                                   \
                    vstore(o + v * LANES, vfmadd(w[v], vset1(d), vset1(m)));                   \
            }                                                                                  \
        }                                                                                      \
    }

PACKED_MATMUL(matmul_q8_0, load_q8_0, Q8_0_BYTES)
PACKED_MATMUL(matmul_q4_0, load_q4_0, Q4_0_BYTES)
PACKED_MATMUL(matmul_q4_1, load_q4_1, Q4_1_BYTES)
PACKED_MATMUL(matmul_q4_k, load_q4_k, Q4_K_BYTES)
PACKED_MATMUL(matmul_q6_k, load_q6_k, Q6_K_BYTES)
PACKED_MATMUL(matmul_q5_k, load_q5_k, Q5_K_BYTES)
DEQUANTIZE(dequantize_q8_0, load_q8_0, Q8_0_BYTES)
DEQUANTIZE(dequantize_q4_0, load_q4_0, Q4_0_BYTES)
DEQUANTIZE(dequantize_q4_1, load_q4_1, Q4_1_BYTES)
DEQUANTIZE(dequantize_q4_k, load_q4_k, Q4_K_BYTES)
DEQUANTIZE(dequantize_q6_k, load_q6_k, Q6_K_BYTES)
DEQUANTIZE(dequantize_q5_k, load_q5_k, Q5_K_BYTES)

/* W (N rows of K weights) as float32, out: (N, K). d * q is exact in float32 in every format,
 * so d * q + m rounds once, as gguf's dequantization does: the values are the same bit for bit.
 * Returns 0, or -1 for arguments it cannot take. */
int packed_dequantize(int kind, const uint8_t *W, float *out, int N, int K, int threads) {
    if (K % QK || threads < 1 || kind < 0 || kind >= BLOCK_KINDS) return -1;
    if (kind == Q8_0) dequantize_q8_0(W, out, N, K, threads);
    else if (kind == Q4_0) dequantize_q4_0(W, out, N, K, threads);
    else if (kind == Q4_1) dequantize_q4_1(W, out, N, K, threads);
    else if (kind == Q4_K) dequantize_q4_k(W, out, N, K, threads);
    else if (kind == Q6_K) dequantize_q6_k(W, out, N, K, threads);
    else dequantize_q5_k(W, out, N, K, threads);
    return 0;
}

/* sums[r * nb + b] = the sum of x's block b in row r (for the minimum m). */
void block_sums(const float *x, float *sums, int rows, int K) {
    const int nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[(size_t)r * K + (size_t)b * QK + j];
            sums[(size_t)r * nb + b] = s;
        }
}

/* One product of any kind, inside a parallel region. */
void block_matmul(int kind, const uint8_t *W, const float *x, const float *sums, float *y,
                   int rows, int N, int K, int add) {
    if (kind == Q8_0) matmul_q8_0(W, x, sums, y, rows, N, K, add);
    else if (kind == Q4_0) matmul_q4_0(W, x, sums, y, rows, N, K, add);
    else if (kind == Q4_1) matmul_q4_1(W, x, sums, y, rows, N, K, add);
    else if (kind == Q4_K) matmul_q4_k(W, x, sums, y, rows, N, K, add);
    else if (kind == Q6_K) matmul_q6_k(W, x, sums, y, rows, N, K, add);
    else matmul_q5_k(W, x, sums, y, rows, N, K, add);
}

/* kind: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1, 3 = Q4_K, 4 = Q6_K, 5 = Q5_K (the last three repacked). x: (rows, K), y: (rows, N),
 * rows <= MAX_ROWS. threads:
 * passed by the caller (torch's count), because a thread other than the main one would
 * otherwise get OpenMP's default team, which measured as one thread under torch.
 * Returns 0, or -1 for arguments it cannot take, -2 when out of memory. */
int packed_matmul(int kind, const uint8_t *W, const float *x, float *y, int rows, int N, int K,
                  int threads) {
    if (rows < 1 || rows > MAX_ROWS || K % QK || threads < 1 || kind < 0 || kind >= BLOCK_KINDS)
        return -1;
    float *sums = malloc(sizeof(float) * (size_t)rows * (K / QK));
    if (sums == NULL) return -2;
    block_sums(x, sums, rows, K);
#pragma omp parallel num_threads(threads)
    block_matmul(kind, W, x, sums, y, rows, N, K, 0);
    free(sums);
    return 0;
}

