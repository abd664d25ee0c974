/* Products with weights kept in llama.cpp's block formats (Q8_0, Q4_0, Q4_1).
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
 * dequantized weights up to float32 rounding in a different order.
 *
 * Vector code for AVX-512 (16 floats at a time) and AVX2 + FMA + F16C (8), plain C elsewhere;
 * built at install by setup.py, one library per instruction set (variants.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include "structs.h"
#include <string.h>
#include <math.h>

#define QK 32
#define MAX_ROWS 16

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

PACKED_MATMUL(matmul_q8_0, load_q8_0, 34)
PACKED_MATMUL(matmul_q4_0, load_q4_0, 18)
PACKED_MATMUL(matmul_q4_1, load_q4_1, 20)
PACKED_MATMUL(matmul_q4_k, load_q4_k, 24)
PACKED_MATMUL(matmul_q6_k, load_q6_k, 40)
PACKED_MATMUL(matmul_q5_k, load_q5_k, 40)
DEQUANTIZE(dequantize_q8_0, load_q8_0, 34)
DEQUANTIZE(dequantize_q4_0, load_q4_0, 18)
DEQUANTIZE(dequantize_q4_1, load_q4_1, 20)
DEQUANTIZE(dequantize_q4_k, load_q4_k, 24)
DEQUANTIZE(dequantize_q6_k, load_q6_k, 40)
DEQUANTIZE(dequantize_q5_k, load_q5_k, 40)

/* W (N rows of K weights) as float32, out: (N, K). d * q is exact in float32 in every format,
 * so d * q + m rounds once, as gguf's dequantization does: the values are the same bit for bit.
 * Returns 0, or -1 for arguments it cannot take. */
int packed_dequantize(int kind, const uint8_t *W, float *out, int N, int K, int threads) {
    if (K % QK || threads < 1 || kind < 0 || kind > 5) return -1;
    if (kind == 0) dequantize_q8_0(W, out, N, K, threads);
    else if (kind == 1) dequantize_q4_0(W, out, N, K, threads);
    else if (kind == 2) dequantize_q4_1(W, out, N, K, threads);
    else if (kind == 3) dequantize_q4_k(W, out, N, K, threads);
    else if (kind == 4) dequantize_q6_k(W, out, N, K, threads);
    else dequantize_q5_k(W, out, N, K, threads);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The integer path, as llama.cpp multiplies: x is quantized per block of 32 to int8 with a float
 * scale (dx = max|x_b| / 127, qx = round(x_b / dx), ties to even), and a block's share of y is
 *
 *   d dx (q . qx) + m dx sum(qx)        (Q4_0: m = -8 d, the offset of its nibbles; Q8_0: m = 0)
 *
 * with q . qx an integer dot product: AVX-512 VNNI or AVX-VNNI (vpdpbusd: unsigned bytes by
 * signed bytes, summed in fours), AVX2 (vpmaddubsw, then vpmaddwd), plain C elsewhere, over
 * the weights repacked into tiles (below). Only the rounding of x to int8 differs from the
 * float path: the products and sums of integers are exact.
 * ------------------------------------------------------------------------------------------ */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT8_PATH 3 /* AVX-512 VNNI */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVXVNNI__)
#define INT8_PATH 2 /* AVX-VNNI */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_PATH 1 /* AVX2 */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    /* pairs of u8 x s8 summed to int16 (at most 2 x 128 x 127: no saturation), then to int32 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#else
#define INT8_PATH 0 /* plain C */
#endif

/* Which integer dot product this build uses: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 plain C. */
int packed_int8_path(void) { return INT8_PATH; }

/* qx (rows, K) int8, dx and xs (rows, K / 32): each block of x quantized, its scale, and
 * dx * sum(qx) (what the minimum m multiplies). */
static void quantize_rows(const float *x, int8_t *qx, float *dx, float *xs, int rows, int K) {
    const int nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            int8_t *q = qx + (size_t)r * K + (size_t)b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(xb[j] * id);
                q[j] = (int8_t)v;
                sum += v;
            }
            dx[(size_t)r * nb + b] = d;
            xs[(size_t)r * nb + b] = d * (float)sum;
        }
}

/* ---------------------------------------------------------------------------------------------
 * Tiles: the blocks repacked for the integer path, TILE rows at a time, so that one integer
 * instruction serves TILE rows at once and no block needs a horizontal sum (the layout that
 * llama.cpp's AMX/VNNI backend and its "repacked" CPU types use). Tile (t, b) holds rows
 * t * TILE .. + TILE - 1 of block column b, in as many bytes as the blocks it replaces:
 *
 *   code  from   scales (w = d q + m)                          then
 *   8     Q8_0   float16 d[TILE]; m = -128 d (VNNI) or 0       8 chunks of TILE x 4 bytes
 *   9     Q4_0   float16 d[TILE]; m = -8 d                     4 chunks of TILE x 4 bytes
 *   10    Q4_1   float16 d[TILE], float16 m[TILE]              4 chunks
 *   11    Q4_K   float32 d[TILE], float32 m[TILE] (repacked)   4 chunks
 *   12    Q6_K   float32 d_a[TILE], d_b[TILE], c[TILE]         8 chunks (signed q)
 *   13    Q5_K   float32 d[TILE], float32 m[TILE] (repacked)   8 chunks (q in 0..31)
 *
 * 4-bit chunk c, row i, byte j holds weight 8c + j in its low nibble and 8c + 4 + j in its high
 * one: its low nibbles meet x's bytes 8c .. 8c + 3 (broadcast to every row's lane), its high
 * nibbles bytes 8c + 4 .. 8c + 7. Q8_0 chunk c, row i, byte j holds weight 4c + j: with VNNI
 * (unsigned x signed bytes) as q + 128, the offset taken back by m; with AVX2 as q, and the
 * product takes |q| against x with q's sign. Q6_K's chunks hold q signed, in Q8_0's order, with
 * two scales per row (weights 0-15, 16-31); with VNNI x is the unsigned side, as x + 128, and
 * c = -128 (d_a sum(q_a) + d_b sum(q_b)) takes the offset back (0 with AVX2). Q5_K's chunks
 * hold q (0..31) in Q8_0's order: the unsigned side as it is, on every path.
 *
 * TILE is 16 with AVX-512 VNNI (a 512-bit register: 16 rows x 4 bytes), 8 elsewhere.
 * ------------------------------------------------------------------------------------------ */
#if INT8_PATH == 3
#define TILE 16
#else
#define TILE 8
#endif
#define Q8_OFFSET (INT8_PATH >= 2) /* Q8_0 tiles hold q + 128 (VNNI) */
static const int tile_head[6] = {2 * TILE, 2 * TILE, 4 * TILE, 8 * TILE, 12 * TILE, 8 * TILE};
static const int tile_bytes[6] = {34 * TILE, 18 * TILE, 20 * TILE, 24 * TILE, 44 * TILE, 40 * TILE};

/* Rows per tile in this build (16 or 8). */
int packed_tile_rows(void) { return TILE; }

/* W (N rows of K weights, kind 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K or 5 Q5_K, the last
 * three repacked) -> tiles, out: N / TILE * K / 32 tiles of tile_bytes[kind] (code 8 + kind),
 * a row of tiles per thread at a time. Returns 0, or -1 for arguments it cannot take. */
int packed_tile(int kind, const uint8_t *W, uint8_t *out, int N, int K, int threads) {
    if (K % QK || N % TILE || N < 1 || kind < 0 || kind > 5 || threads < 1) return -1;
    static const int bytes[6] = {34, 18, 20, 24, 40, 40}, at[4] = {2, 2, 4, 8};
    const int nb = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < N / TILE; t++)
        for (int b = 0; b < nb; b++) {
            uint8_t *tile = out + ((size_t)t * nb + b) * tile_bytes[kind];
            uint8_t *chunks = tile + tile_head[kind];
            for (int i = 0; i < TILE; i++) {
                const uint8_t *block = W + ((size_t)(t * TILE + i) * nb + b) * bytes[kind];
                if (kind == 4) { /* Q6_K: d_a, d_b, the offset's correction, signed q */
                    float da, db, c = 0.0f;
                    int sa = 0, sb = 0;
                    memcpy(&da, block, 4);
                    memcpy(&db, block + 4, 4);
                    for (int j = 0; j < QK / 2; j++) {
                        sa += (int8_t)block[8 + j];
                        sb += (int8_t)block[8 + QK / 2 + j];
                    }
                    if (Q8_OFFSET) c = -128.0f * (da * (float)sa + db * (float)sb);
                    memcpy(tile + 4 * i, &da, 4);
                    memcpy(tile + 4 * (TILE + i), &db, 4);
                    memcpy(tile + 4 * (2 * TILE + i), &c, 4);
                    for (int k = 0; k < 8; k++)
                        for (int j = 0; j < 4; j++)
                            chunks[(k * TILE + i) * 4 + j] = block[8 + 4 * k + j];
                    continue;
                }
                if (kind == 5) { /* Q5_K: d, m, then q as Q8_0's chunks hold it, unchanged */
                    memcpy(tile + 4 * i, block, 4);
                    memcpy(tile + 4 * (TILE + i), block + 4, 4);
                    for (int c = 0; c < 8; c++)
                        for (int j = 0; j < 4; j++)
                            chunks[(c * TILE + i) * 4 + j] = block[8 + 4 * c + j];
                    continue;
                }
                if (kind == 3) {
                    memcpy(tile + 4 * i, block, 4);
                    memcpy(tile + 4 * (TILE + i), block + 4, 4);
                } else {
                    memcpy(tile + 2 * i, block, 2);
                    if (kind == 2) memcpy(tile + 2 * (TILE + i), block + 2, 2);
                }
                if (kind == 0) {
                    for (int c = 0; c < 8; c++)
                        for (int j = 0; j < 4; j++)
                            chunks[(c * TILE + i) * 4 + j] =
                                (uint8_t)(block[2 + 4 * c + j] ^ (Q8_OFFSET ? 0x80 : 0));
                    continue;
                }
                uint8_t q[QK]; /* the block's 32 integers, in order */
                for (int j = 0; j < QK / 2; j++) {
                    q[j] = block[at[kind] + j] & 15;
                    q[j + QK / 2] = block[at[kind] + j] >> 4;
                }
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++)
                        chunks[(c * TILE + i) * 4 + j] = q[8 * c + j] | (q[8 * c + 4 + j] << 4);
            }
        }
    return 0;
}

#if INT8_PATH == 3
#define TVEC __m512
#define TINT __m512i
#define ti_load(p) _mm512_loadu_si512((const void *)(p))
#define ti_and(a, b) _mm512_and_si512(a, b)
#define ti_add(a, b) _mm512_add_epi32(a, b)
#define ti_srli16(a, n) _mm512_srli_epi16(a, n)
#define ti_set1_8(v) _mm512_set1_epi8(v)
#define ti_set1_32(v) _mm512_set1_epi32(v)
#define ti_zero() _mm512_setzero_si512()
#define ti_dot(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define tv_zero() _mm512_setzero_ps()
#define tv_load(p) _mm512_loadu_ps(p)
#define tv_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define tv_store(p, a) _mm512_storeu_ps(p, a)
#define tv_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define tv_mul(a, b) _mm512_mul_ps(a, b)
#define tv_add(a, b) _mm512_add_ps(a, b)
#define tv_set1(s) _mm512_set1_ps(s)
#define tv_float(i) _mm512_cvtepi32_ps(i)
#elif INT8_PATH > 0
#define TVEC __m256
#define TINT __m256i
#define ti_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define ti_and(a, b) _mm256_and_si256(a, b)
#define ti_add(a, b) _mm256_add_epi32(a, b)
#define ti_srli16(a, n) _mm256_srli_epi16(a, n)
#define ti_set1_8(v) _mm256_set1_epi8(v)
#define ti_set1_32(v) _mm256_set1_epi32(v)
#define ti_zero() _mm256_setzero_si256()
#define ti_dot(acc, u, s) _mm256_add_epi32(acc, dot_u8_i8(u, s))
#define tv_zero() _mm256_setzero_ps()
#define tv_load(p) _mm256_loadu_ps(p)
#define tv_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define tv_store(p, a) _mm256_storeu_ps(p, a)
#define tv_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define tv_mul(a, b) _mm256_mul_ps(a, b)
#define tv_add(a, b) _mm256_add_ps(a, b)
#define tv_set1(s) _mm256_set1_ps(s)
#define tv_float(i) _mm256_cvtepi32_ps(i)
#endif

/* The tiles of one thread's share of a product lie one after the other, and decoding reads them
 * from memory once per token: the hardware prefetchers stop at each 4 KiB page, so each tile's
 * cache lines are asked for PREFETCH_AHEAD bytes before they are read. (On the Xeon the project
 * was measured on, a step over SmolLM2's layers and output layer with the caches emptied first
 * took 4.8-5.6 ms with it, 6.0-7.8 ms without: 2048, 4096, 8192 and 16384 bytes ahead were
 * tried, 4096 kept.) */
#define PREFETCH_AHEAD 4096
static inline void prefetch_ahead(const uint8_t *tile, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(tile + PREFETCH_AHEAD + o, 0, 3);
}

#if INT8_PATH > 0
static inline int32_t four(const int8_t *q) { /* 4 bytes of x, as one int32 to broadcast */
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* A 4-bit tile's chunks against one row's int8 block qb: the TILE rows' dot products. */
static inline TINT tile_dot_q4(const uint8_t *chunks, const int8_t *qb) {
    const TINT low = ti_set1_8(15);
    TINT acc[4];
    for (int c = 0; c < 4; c++) {
        const TINT v = ti_load(chunks + c * 4 * TILE);
        acc[c] = ti_dot(ti_zero(), ti_and(v, low), ti_set1_32(four(qb + 8 * c)));
        acc[c] = ti_dot(acc[c], ti_and(ti_srli16(v, 4), low), ti_set1_32(four(qb + 8 * c + 4)));
    }
    return ti_add(ti_add(acc[0], acc[1]), ti_add(acc[2], acc[3]));
}

/* A tile of a byte per weight against qb. Q5_K's q (0..31) and, with VNNI, Q8_0's q + 128 are
 * the unsigned side as they are; Q8_0's signed q without VNNI (AVX2) go in as |q|, against x
 * with q's sign. */
static inline TINT tile_dot_bytes(const uint8_t *chunks, const int8_t *qb, int is_signed) {
    TINT acc[4];
    for (int c = 0; c < 4; c++) {
        TINT sum = ti_zero();
        for (int h = 0; h < 2; h++) {
            const int k = 2 * c + h;
            const TINT v = ti_load(chunks + k * 4 * TILE), x4 = ti_set1_32(four(qb + 4 * k));
#if Q8_OFFSET
            (void)is_signed;
            sum = ti_dot(sum, v, x4);
#else
            sum = is_signed ? ti_dot(sum, _mm256_sign_epi8(v, v), _mm256_sign_epi8(x4, v))
                            : ti_dot(sum, v, x4);
#endif
        }
        acc[c] = sum;
    }
    return ti_add(ti_add(acc[0], acc[1]), ti_add(acc[2], acc[3]));
}
static inline TINT tile_dot_q8(const uint8_t *c, const int8_t *qb) { return tile_dot_bytes(c, qb, 1); }
static inline TINT tile_dot_u8(const uint8_t *c, const int8_t *qb) { return tile_dot_bytes(c, qb, 0); }

/* A tile's scales d and minimums m, TILE of each, by its code. */
#define SCALES_Q8(tile, d, m)                                                                  \
    d = tv_half(tile);                                                                         \
    m = Q8_OFFSET ? tv_mul(d, tv_set1(-128.0f)) : tv_zero();
#define SCALES_Q4_0(tile, d, m)                                                                \
    d = tv_half(tile);                                                                         \
    m = tv_mul(d, tv_set1(-8.0f));
#define SCALES_Q4_1(tile, d, m)                                                                \
    d = tv_half(tile);                                                                         \
    m = tv_half((tile) + 2 * TILE);
#define SCALES_Q4_K(tile, d, m)                                                                \
    d = tv_load((const float *)(tile));                                                        \
    m = tv_load((const float *)(tile) + TILE);

/* y (rows, N) = or += the tiles' product with the int8 rows qx, inside a parallel region:
 * each tile's share is d dx (q . qx) + m xs, TILE rows at once. */
#define TILE_MATMUL(NAME, SCALES, DOT, KIND)                                                   \
    static void NAME(const uint8_t *T, const int8_t *qx, const float *dx, const float *xs,     \
                     float *y, int rows, int N, int K, int add) {                              \
        const int nb = K / QK;                                                                 \
        const size_t bytes = tile_bytes[KIND], head = tile_head[KIND];                         \
        _Pragma("omp for schedule(static)")                                                    \
        for (int t = 0; t < N / TILE; t++) {                                                   \
            TVEC acc[MAX_ROWS];                                                                \
            for (int r = 0; r < rows; r++) acc[r] = tv_zero();                                 \
            for (int b = 0; b < nb; b++) {                                                     \
                const uint8_t *tile = T + ((size_t)t * nb + b) * bytes;                        \
                prefetch_ahead(tile, bytes);                                                   \
                TVEC d, m;                                                                     \
                SCALES(tile, d, m)                                                             \
                for (int r = 0; r < rows; r++) {                                               \
                    const size_t at = (size_t)r * nb + b;                                      \
                    const TVEC dot = tv_float(DOT(tile + head, qx + at * QK));                 \
                    acc[r] = tv_fmadd(dot, tv_mul(d, tv_set1(dx[at])), acc[r]);                \
                    acc[r] = tv_fmadd(m, tv_set1(xs[at]), acc[r]);                             \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < rows; r++) {                                                   \
                float *out = y + (size_t)r * N + (size_t)t * TILE;                             \
                tv_store(out, add ? tv_add(tv_load(out), acc[r]) : acc[r]);                    \
            }                                                                                  \
        }                                                                                      \
    }
TILE_MATMUL(tile_matmul_q8_0, SCALES_Q8, tile_dot_q8, 0)
TILE_MATMUL(tile_matmul_q4_0, SCALES_Q4_0, tile_dot_q4, 1)
TILE_MATMUL(tile_matmul_q4_1, SCALES_Q4_1, tile_dot_q4, 2)
TILE_MATMUL(tile_matmul_q4_k, SCALES_Q4_K, tile_dot_q4, 3)
TILE_MATMUL(tile_matmul_q5_k, SCALES_Q4_K, tile_dot_u8, 5)

/* A Q6_K tile's chunks against qb: the dot products of weights 0-15 (lo) and 16-31 (hi). */
static inline void tile_dot_q6(const uint8_t *chunks, const int8_t *qb, TINT *lo, TINT *hi) {
    TINT acc[4] = {ti_zero(), ti_zero(), ti_zero(), ti_zero()};
    for (int k = 0; k < 8; k++) {
        const int at = (k / 4) * 2 + (k & 1); /* two accumulators per half */
        const TINT v = ti_load(chunks + k * 4 * TILE);
#if Q8_OFFSET
        acc[at] = ti_dot(acc[at], ti_set1_32(four(qb + 4 * k) ^ (int32_t)0x80808080), v);
#else
        const TINT x4 = ti_set1_32(four(qb + 4 * k));
        acc[at] = ti_dot(acc[at], _mm256_sign_epi8(v, v), _mm256_sign_epi8(x4, v));
#endif
    }
    *lo = ti_add(acc[0], acc[1]);
    *hi = ti_add(acc[2], acc[3]);
}

static void tile_matmul_q6_k(const uint8_t *T, const int8_t *qx, const float *dx,
                             const float *xs, float *y, int rows, int N, int K, int add) {
    (void)xs;
    const int nb = K / QK;
#pragma omp for schedule(static)
    for (int t = 0; t < N / TILE; t++) {
        TVEC acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = tv_zero();
        for (int b = 0; b < nb; b++) {
            const uint8_t *tile = T + ((size_t)t * nb + b) * tile_bytes[4];
            prefetch_ahead(tile, tile_bytes[4]);
            const TVEC da = tv_load((const float *)tile), db = tv_load((const float *)tile + TILE);
            const TVEC c = tv_load((const float *)tile + 2 * TILE);
            for (int r = 0; r < rows; r++) {
                const size_t at = (size_t)r * nb + b;
                TINT lo, hi;
                tile_dot_q6(tile + tile_head[4], qx + at * QK, &lo, &hi);
                TVEC sum = tv_fmadd(tv_float(lo), da, tv_mul(tv_float(hi), db));
                acc[r] = tv_fmadd(tv_add(sum, c), tv_set1(dx[at]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            float *out = y + (size_t)r * N + (size_t)t * TILE;
            tv_store(out, add ? tv_add(tv_load(out), acc[r]) : acc[r]);
        }
    }
}

/* The tiles' product (code 8 + kind), inside a parallel region. */
static void tile_matmul(int code, const uint8_t *T, const int8_t *qx, const float *dx,
                        const float *xs, float *y, int rows, int N, int K, int add) {
    if (code == 8) tile_matmul_q8_0(T, qx, dx, xs, y, rows, N, K, add);
    else if (code == 9) tile_matmul_q4_0(T, qx, dx, xs, y, rows, N, K, add);
    else if (code == 10) tile_matmul_q4_1(T, qx, dx, xs, y, rows, N, K, add);
    else if (code == 11) tile_matmul_q4_k(T, qx, dx, xs, y, rows, N, K, add);
    else if (code == 12) tile_matmul_q6_k(T, qx, dx, xs, y, rows, N, K, add);
    else tile_matmul_q5_k(T, qx, dx, xs, y, rows, N, K, add);
}

#else /* plain C */

/* Weight 0 <= k < 32 of row i in a tile's chunks, as the integer the product uses (a byte each
 * for Q8_0, Q6_K and Q5_K, whose 0..31 read the same as int8). */
static inline int tile_weight(const uint8_t *chunks, int q8, int i, int k) {
    if (q8) return (int8_t)chunks[((k / 4) * TILE + i) * 4 + k % 4];
    const uint8_t byte = chunks[((k / 8) * TILE + i) * 4 + k % 4];
    return k % 8 < 4 ? byte & 15 : byte >> 4;
}

/* Row i's scale d and minimum m in a tile of `kind` (Q6_K: d for the first 16 weights, m for
 * the last 16). */
static inline void tile_scales(const uint8_t *tile, int kind, int i, float *d, float *m) {
    if (kind >= 3) {
        memcpy(d, tile + 4 * i, 4);
        memcpy(m, tile + 4 * (TILE + i), 4);
        return;
    }
    *d = half_to_float(tile + 2 * i);
    *m = kind == 1 ? -8.0f * *d : kind == 2 ? half_to_float(tile + 2 * (TILE + i)) : 0.0f;
}

static void tile_matmul(int code, const uint8_t *T, const int8_t *qx, const float *dx,
                        const float *xs, float *y, int rows, int N, int K, int add) {
    const int nb = K / QK, kind = code - 8;
#pragma omp for schedule(static)
    for (int t = 0; t < N / TILE; t++) {
        float total[MAX_ROWS][TILE] = {{0}};
        for (int b = 0; b < nb; b++) {
            const uint8_t *tile = T + ((size_t)t * nb + b) * tile_bytes[kind];
            prefetch_ahead(tile, tile_bytes[kind]);
            for (int i = 0; i < TILE; i++) {
                float d, m;
                tile_scales(tile, kind, i, &d, &m);
                for (int r = 0; r < rows; r++) {
                    const size_t at = (size_t)r * nb + b;
                    int dot = 0, high = 0; /* Q6_K: weights 16-31 apart */
                    for (int k = 0; k < QK; k++) {
                        const int p = tile_weight(tile + tile_head[kind], kind == 0 || kind >= 4,
                                                  i, k) * qx[at * QK + k];
                        if (kind == 4 && k >= QK / 2) high += p;
                        else dot += p;
                    }
                    if (kind == 4) total[r][i] += (d * (float)dot + m * (float)high) * dx[at];
                    else total[r][i] += d * dx[at] * (float)dot + m * xs[at];
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < TILE; i++) {
                float *out = y + (size_t)r * N + (size_t)t * TILE + i;
                *out = add ? *out + total[r][i] : total[r][i];
            }
    }
}
#endif

/* packed_matmul for tiles (packed_tile's output, code 8 + the blocks' kind), x quantized per
 * block to int8 first: the same arguments and returns. */
int packed_matmul_tiles(int code, const uint8_t *T, const float *x, float *y, int rows, int N,
                        int K, int threads) {
    if (rows < 1 || rows > MAX_ROWS || K % QK || N % TILE || threads < 1 || code < 8 ||
        code > 13)
        return -1;
    const size_t nb = (size_t)rows * (K / QK);
    int8_t *qx = malloc((size_t)rows * K + sizeof(float) * 2 * nb);
    if (qx == NULL) return -2;
    float *dx = (float *)(qx + (size_t)rows * K), *xs = dx + nb;
    quantize_rows(x, qx, dx, xs, rows, K);
#pragma omp parallel num_threads(threads)
    tile_matmul(code, T, qx, dx, xs, y, rows, N, K, 0);
    free(qx);
    return 0;
}

/* sums[r * nb + b] = the sum of x's block b in row r (for the minimum m). */
static void block_sums(const float *x, float *sums, int rows, int K) {
    const int nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[(size_t)r * K + (size_t)b * QK + j];
            sums[(size_t)r * nb + b] = s;
        }
}

/* One product of any kind, inside a parallel region. */
static void matmul(int kind, const uint8_t *W, const float *x, const float *sums, float *y,
                   int rows, int N, int K, int add) {
    if (kind == 0) matmul_q8_0(W, x, sums, y, rows, N, K, add);
    else if (kind == 1) matmul_q4_0(W, x, sums, y, rows, N, K, add);
    else if (kind == 2) matmul_q4_1(W, x, sums, y, rows, N, K, add);
    else if (kind == 3) matmul_q4_k(W, x, sums, y, rows, N, K, add);
    else if (kind == 4) matmul_q6_k(W, x, sums, y, rows, N, K, add);
    else matmul_q5_k(W, x, sums, y, rows, N, K, add);
}

/* kind: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1, 3 = Q4_K, 4 = Q6_K, 5 = Q5_K (the last three repacked). x: (rows, K), y: (rows, N),
 * rows <= MAX_ROWS. threads:
 * passed by the caller (torch's count), because a thread other than the main one would
 * otherwise get OpenMP's default team, which measured as one thread under torch.
 * Returns 0, or -1 for arguments it cannot take, -2 when out of memory. */
int packed_matmul(int kind, const uint8_t *W, const float *x, float *y, int rows, int N, int K,
                  int threads) {
    if (rows < 1 || rows > MAX_ROWS || K % QK || threads < 1 || kind < 0 || kind > 5) return -1;
    float *sums = malloc(sizeof(float) * (size_t)rows * (K / QK));
    if (sums == NULL) return -2;
    block_sums(x, sums, rows, K);
#pragma omp parallel num_threads(threads)
    matmul(kind, W, x, sums, y, rows, N, K, 0);
    free(sums);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * One decoding step of a Llama-family layer with packed weights: what
 * attnkit.layers.DecoderLayer computes for one new position per row, as one parallel region
 * (attnkit/accel/packed_step.py). Llama (Pre-LN, RMSNorm, RoPE, grouped-query attention,
 * SwiGLU, no biases), and Gemma 3 where the layer names its differences (QK-norm, sandwich
 * norms, GeGLU, a sliding window over a ring of cached keys, heads wider than d_model / H):
 *
 *   h = RMSNorm_1(x);  q, k, v = h W_in (split);  q, k = RMSNorm_q(q), RMSNorm_k(k)  (QK-norm)
 *   q, k = RoPE(q, k, position);  cache[slot] = k, v   (slot: length, or length % window)
 *   a = softmax(q K^T / sqrt(d_head) + mask) V   (each query head reads the key head it shares)
 *   x = x + [RMSNorm_a](a W_out)
 *   h = RMSNorm_2(x);  x = x + [RMSNorm_f]((act(h W_gate) * (h W_up)) W_down)
 *
 * with act SiLU (SwiGLU) or GELU with tanh (GeGLU), and the bracketed norms only where the
 * layer has them. A product's weights are packed blocks, tiles (integer path), or float32
 * (kind 16: (N, K) rows; kind 17: (K, N), as accel.decoding lays a linear layer out).
 * ------------------------------------------------------------------------------------------ */
/* LlamaLayer (the layer's sizes, norms and weights) is defined in structs.h */

/* out = x / sqrt(mean(x^2) + eps) * g for each row. */
static void rms_norm(const float *x, const float *g, float *out, int rows, int D, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * D;
        float sq = 0.0f;
        for (int i = 0; i < D; i++) sq += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sq / D + eps);
        for (int i = 0; i < D; i++) out[(size_t)r * D + i] = xr[i] * inv * g[i];
    }
}

/* RoPE's cos and sin for one position: angle i = position * inv_freq[i], i < d / 2. */
static void rope_angles(int64_t position, const float *inv_freq, int half, float *cos_sin) {
    for (int i = 0; i < half; i++) {
        const float angle = (float)position * inv_freq[i];
        cos_sin[i] = cosf(angle);
        cos_sin[half + i] = sinf(angle);
    }
}

/* RoPE, the half-split layout: pair i with i + d/2, rotated by the angles' cos and sin. */
static void rope(const float *x, float *out, int d, const float *cos_sin) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float c = cos_sin[i], s = cos_sin[half + i];
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
}

/* y (rows, N) = or += x (rows, K) W^T for float32 weights, inside a parallel region: kind 16,
 * W (N, K) rows; kind 17, W^T (K, N) (each column block of y summed over k). */
static void float_matmul(int kind, const float *W, const float *x, float *y, int rows, int N,
                         int K, int add) {
    if (kind == 16) {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++)
            for (int r = 0; r < rows; r++) {
                const float *xr = x + (size_t)r * K, *w = W + (size_t)n * K;
                float dot = 0.0f;
                for (int k = 0; k < K; k++) dot += xr[k] * w[k];
                float *out = y + (size_t)r * N + n;
                *out = add ? *out + dot : dot;
            }
        return;
    }
    enum { COLUMNS = 64 };
#pragma omp for schedule(static)
    for (int c = 0; c < (N + COLUMNS - 1) / COLUMNS; c++) {
        const int n0 = c * COLUMNS, width = N - n0 < COLUMNS ? N - n0 : COLUMNS;
        for (int r = 0; r < rows; r++) {
            float acc[COLUMNS] = {0};
            const float *xr = x + (size_t)r * K;
            for (int k = 0; k < K; k++) {
                const float *w = W + (size_t)k * N + n0;
                for (int j = 0; j < width; j++) acc[j] += xr[k] * w[j];
            }
            float *out = y + (size_t)r * N + n0;
            for (int j = 0; j < width; j++) out[j] = add ? out[j] + acc[j] : acc[j];
        }
    }
}

/* GELU with the tanh approximation, as torch's gelu(approximate="tanh"). */
static inline float gelu_tanh(float g) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(inner));
}

/* A product's input made ready for the layer's weights (block sums for blocks, int8 blocks for
 * tiles; a layer may hold both), and the product of weight i with it: y (rows, N) = or +=
 * x (rows, K) W_i^T (kinds 16 and 17: float32 weights, read from X itself). */
#define PREPARE(X, K_)                                                                         \
    do {                                                                                       \
        if (tiles) quantize_rows(X, qx, dx, xs, rows, K_);                                    \
        if (blocks) block_sums(X, sums, rows, K_);                                             \
    } while (0)
#define PRODUCT(I, X, Y, N_, K_, ADD)                                                          \
    do {                                                                                       \
        if (L->kind[I] >= 16)                                                                  \
            float_matmul(L->kind[I], (const float *)L->weight[I], X, Y, rows, N_, K_, ADD);   \
        else if (L->kind[I] >= 8)                                                              \
            tile_matmul(L->kind[I], L->weight[I], qx, dx, xs, Y, rows, N_, K_, ADD);           \
        else matmul(L->kind[I], L->weight[I], X, sums, Y, rows, N_, K_, ADD);                 \
    } while (0)

/* Which inputs layer L's products need: tiles (the integer path) and / or blocks; -1 for a kind
 * or a shape packed_llama_step cannot take. */
static int layer_inputs(const LlamaLayer *L, int *tiles, int *blocks) {
    const int D = L->d_model, H = L->n_heads, Hkv = L->n_kv_heads, dh = L->d_head, F = L->d_ff;
    const int A = H * dh, Nqkv = (H + 2 * Hkv) * dh;
    if (D % QK || F % QK || A % QK || dh % 2 || Hkv < 1 || H % Hkv || L->activation < 0 ||
        L->activation > 1 || L->window < 0)
        return -1;
    *tiles = *blocks = 0;
    for (int i = 0; i < 5; i++) { /* 0-5 blocks, 8-13 tiles (integer path), 16-17 float32 */
        const int k = L->kind[i];
        if (k < 0 || (k > 5 && k < 8) || (k > 13 && k < 16) || k > 17) return -1;
        if (k >= 8 && k <= 13 && (Nqkv % TILE || D % TILE || F % TILE)) return -1;
        *tiles |= k >= 8 && k <= 13;
        *blocks |= k <= 5;
    }
    return 0;
}

/* The floats (and bytes, for the integer path's int8 rows) of scratch one row of layer L's
 * step takes, for M keys. */
static size_t layer_scratch(const LlamaLayer *L, int M) {
    const int D = L->d_model, H = L->n_heads, dh = L->d_head, F = L->d_ff;
    const int A = H * dh, Nqkv = (H + 2 * L->n_kv_heads) * dh;
    int widest = D > F ? D : F; /* the longest row whose block sums are kept */
    widest = widest > A ? widest : A;
    const size_t floats = (size_t)D + Nqkv + A + 2 * F + (size_t)H * M + 3 * (widest / QK) + dh + D;
    return sizeof(float) * floats + widest;
}

/* One layer's step for `rows` new tokens, run by every thread of the caller's parallel region:
 * x (rows, d_model) is updated in place, the cache C written at this step's slot. */
static void layer_step(const LlamaLayer *L, const LlamaCache *C, float *x, int rows,
                       const int64_t *positions, uint8_t *mask, float *scratch) {
    const int D = L->d_model, H = L->n_heads, Hkv = L->n_kv_heads, dh = L->d_head, F = L->d_ff;
    const int A = H * dh, Nqkv = (H + 2 * Hkv) * dh, groups = H / Hkv;
    const int ring = L->window > 0, slots = C->slots, length = C->length;
    const int M = ring ? L->window : length + 1, at = ring ? length % L->window : length;
    float *cache_k = C->k, *cache_v = C->v;
    int64_t *cache_pos = C->positions;
    uint8_t *valid = ring ? C->valid : mask;
    int tiles, blocks;
    layer_inputs(L, &tiles, &blocks);
    int widest = D > F ? D : F;
    widest = widest > A ? widest : A;
    float *h = scratch, *qkv = h + (size_t)rows * D, *attn = qkv + (size_t)rows * Nqkv;
    float *gate = attn + (size_t)rows * A, *up = gate + (size_t)rows * F;
    float *scores = up + (size_t)rows * F, *sums = scores + (size_t)rows * H * M;
    float *dx = sums + (size_t)rows * (widest / QK), *xs = dx + (size_t)rows * (widest / QK);
    float *angles = xs + (size_t)rows * (widest / QK); /* (rows, d_head): cos, then sin */
    float *out = angles + (size_t)rows * dh;            /* (rows, D): a sublayer's output */
    int8_t *qx = (int8_t *)(out + (size_t)rows * D);

#pragma omp single
    {
        rms_norm(x, L->norm1, h, rows, D, L->eps);
        PREPARE(h, D);
        for (int r = 0; r < rows; r++)
            rope_angles(positions[r], L->inv_freq, dh / 2, angles + (size_t)r * dh);
    }
    PRODUCT(0, h, qkv, Nqkv, D, 0);
    /* this step's keys, normalised and rotated, and values into the cache */
#pragma omp for schedule(static)
    for (int i = 0; i < rows * Hkv; i++) {
        const int r = i / Hkv, g = i % Hkv;
        const size_t slot = (((size_t)r * Hkv + g) * slots + at) * dh;
        const float *k = qkv + (size_t)r * Nqkv + A + (size_t)g * dh;
        float normed[dh];
        if (L->k_norm != NULL) rms_norm(k, L->k_norm, normed, 1, dh, L->qk_eps);
        rope(L->k_norm != NULL ? normed : k, cache_k + slot, dh, angles + (size_t)r * dh);
        memcpy(cache_v + slot, k + (size_t)Hkv * dh, sizeof(float) * dh);
        if (g == 0) {
            cache_pos[(size_t)r * slots + at] = positions[r];
            if (ring) valid[(size_t)r * slots + at] = 1;
        }
    }
    /* each query head against its key head's cached keys */
#pragma omp for schedule(static)
    for (int i = 0; i < rows * H; i++) {
        const int r = i / H, head = i % H, g = head / groups;
        const float *keys = cache_k + ((size_t)r * Hkv + g) * slots * dh;
        const float *values = cache_v + ((size_t)r * Hkv + g) * slots * dh;
        const uint8_t *ok = valid == NULL ? NULL : valid + (size_t)r * (ring ? slots : M);
        float q[dh], normed[dh], *s = scores + (size_t)i * M;
        float *o = attn + (size_t)r * A + (size_t)head * dh;
        const float *raw = qkv + (size_t)r * Nqkv + (size_t)head * dh;
        if (L->q_norm != NULL) rms_norm(raw, L->q_norm, normed, 1, dh, L->qk_eps);
        rope(L->q_norm != NULL ? normed : raw, q, dh, angles + (size_t)r * dh);
        float top = -INFINITY;
        for (int j = 0; j < M; j++) {
            if (ok != NULL && !ok[j]) continue;
            float dot = 0.0f;
            for (int e = 0; e < dh; e++) dot += q[e] * keys[(size_t)j * dh + e];
            s[j] = dot * L->scale;
            if (s[j] > top) top = s[j];
        }
        for (int e = 0; e < dh; e++) o[e] = 0.0f;
        if (top == -INFINITY) continue; /* nothing to attend to: a zero output */
        float total = 0.0f;
        for (int j = 0; j < M; j++) {
            if (ok != NULL && !ok[j]) continue;
            s[j] = expf(s[j] - top);
            total += s[j];
        }
        for (int j = 0; j < M; j++) {
            if (ok != NULL && !ok[j]) continue;
            const float p = s[j] / total;
            for (int e = 0; e < dh; e++) o[e] += p * values[(size_t)j * dh + e];
        }
    }
#pragma omp single
    PREPARE(attn, A);
    if (L->attn_out_norm == NULL) {
        PRODUCT(1, attn, x, D, A, 1); /* x += a W_out */
    } else {
        PRODUCT(1, attn, out, D, A, 0);
#pragma omp single
        {
            rms_norm(out, L->attn_out_norm, out, rows, D, L->eps);
            for (size_t i = 0; i < (size_t)rows * D; i++) x[i] += out[i];
        }
    }
#pragma omp single
    {
        rms_norm(x, L->norm2, h, rows, D, L->eps);
        PREPARE(h, D);
    }
    PRODUCT(2, h, gate, F, D, 0);
    PRODUCT(3, h, up, F, D, 0);
#pragma omp for schedule(static)
    for (int i = 0; i < rows * F; i++)
        gate[i] = (L->activation == 1 ? gelu_tanh(gate[i])
                                       : gate[i] / (1.0f + expf(-gate[i]))) * up[i];
#pragma omp single
    PREPARE(gate, F);
    if (L->ffn_out_norm == NULL) {
        PRODUCT(4, gate, x, D, F, 1); /* x += ... W_down */
    } else {
        PRODUCT(4, gate, out, D, F, 0);
#pragma omp single
        {
            rms_norm(out, L->ffn_out_norm, out, rows, D, L->eps);
            for (size_t i = 0; i < (size_t)rows * D; i++) x[i] += out[i];
        }
    }
}

/* The decoding step of n_layers Llama-family layers, one after the other, in one parallel
 * region: x (rows, d_model) is updated in place. Layer i's cache, caches[i], holds (rows,
 * n_kv_heads, slots, d_head) keys and values and (rows, slots) positions, slots = max_len (a
 * KVCache: this step writes slot `length` and attends over slots 0..length, the keys `mask`
 * (rows, length + 1) flags, or all of them where mask is NULL) or the layer's window (a ring:
 * slot length % window, and every slot its own `valid` flags; this step's flag is set). The
 * lengths are not advanced (the caller's cache objects count). Returns 0, -1 for arguments it
 * cannot take, -2 when out of memory. */
int packed_llama_step(const LlamaLayer *layers, const LlamaCache *caches, int n_layers, float *x,
                      int rows, const int64_t *positions, uint8_t *mask, int threads) {
    if (n_layers < 1 || rows < 1 || rows > MAX_ROWS || threads < 1) return -1;
    size_t per_row = 0;
    for (int l = 0; l < n_layers; l++) {
        const LlamaLayer *L = layers + l;
        const LlamaCache *C = caches + l;
        const int ring = L->window > 0;
        int tiles, blocks;
        if (layer_inputs(L, &tiles, &blocks) != 0 || C->length < 0 ||
            (!ring && C->length >= C->slots) || (ring && (C->valid == NULL || C->slots != L->window)))
            return -1;
        const size_t need = layer_scratch(L, ring ? L->window : C->length + 1);
        per_row = need > per_row ? need : per_row;
    }
    float *scratch = malloc(per_row * rows);
    if (scratch == NULL) return -2;
#pragma omp parallel num_threads(threads)
    for (int l = 0; l < n_layers; l++) /* each layer ends on a barrier */
        layer_step(layers + l, caches + l, x, rows, positions, mask, scratch);
    free(scratch);
    return 0;
}
