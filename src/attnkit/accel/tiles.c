/* The integer path, as llama.cpp multiplies: x is quantized per block of 32 to int8 with a float
 * scale (dx = max|x_b| / 127, qx = round(x_b / dx), ties to even), and each block's share of y
 * is an integer dot product scaled:
 *
 *   y[n] += (q . qx) (d dx)               Q8_0 (q signed), Q4_0 (q - 8)
 *   y[n] += (q . qx) (d dx)  then + m xs  Q4_1, Q4_K, Q5_K (q unsigned; xs = dx sum(qx))
 *   y[n] += ((q_a . qx_a) d_a + (q_b . qx_b) d_b) dx    Q6_K (weights 0-15 and 16-31)
 *
 * The same bits on every variant. The integer dot product is exact on every instruction set:
 * AVX-512 VNNI and AVX-VNNI (vpdpbusd, unsigned bytes by signed bytes, in fours), AVX2
 * (vpmaddubsw, then vpmaddwd), plain C; where VNNI needs an unsigned side that the weights or
 * x are not, the offset of 128 it adds is taken back as an integer (128 sum(qx), or 128 sum(q)
 * kept in the tile), never as a float. The float steps above then run in that order, each
 * rounded once (no FMA: -ffp-contract=off, and mul then add in the vector code), one lane per
 * output row: so generic, avx2, avxvnni, avx512, vnni and amx give identical y.
 *
 * Tiles: the blocks repacked TILE rows at a time, so that one integer instruction serves TILE
 * rows at once and no block needs a horizontal sum (the layout of llama.cpp's AMX/VNNI backend
 * and its "repacked" CPU types). Tile (t, b) holds rows t * TILE .. + TILE - 1 of block column
 * b, in as many bytes as the blocks it replaces:
 *
 *   code  from   head (TILE of each)                           then
 *   8     Q8_0   float16 d                                    8 chunks of TILE x 4 bytes
 *   9     Q4_0   float16 d                                    4 chunks of TILE x 4 bytes
 *   10    Q4_1   float16 d, float16 m                         4 chunks
 *   11    Q4_K   float32 d, float32 m (repacked)              4 chunks
 *   12    Q6_K   float32 d_a, d_b; int16 sum(q_a), sum(q_b)   8 chunks (signed q)
 *   13    Q5_K   float32 d, float32 m (repacked)              8 chunks (q in 0..31)
 *
 * 4-bit chunk c, row i, byte j holds weight 8c + j in its low nibble and 8c + 4 + j in its high
 * one: its low nibbles meet x's bytes 8c .. 8c + 3 (broadcast to every row's lane), its high
 * nibbles bytes 8c + 4 .. 8c + 7. Byte chunk c, row i, byte j holds weight 4c + j: Q8_0's q
 * + 128 with VNNI (the unsigned side), q itself otherwise (AVX2 takes |q| against x with q's
 * sign); Q6_K's q signed (with VNNI x + 128 is the unsigned side); Q5_K's q as it is.
 *
 * TILE is 16 with AVX-512 VNNI (a 512-bit register: 16 rows x 4 bytes), 8 elsewhere: a tile's
 * layout (packed_tile_layout) depends on the variant that built it, its arithmetic does not. A
 * last tile of fewer rows is padded with zero weights, whose outputs are never stored.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "packed.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INT8_PATH 3 /* AVX-512 VNNI */
#elif defined(__AVXVNNI__)
#include <immintrin.h>
#define INT8_PATH 2 /* AVX-VNNI */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INT8_PATH 1 /* AVX2 */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
    /* pairs of u8 x s8 summed to int16 (at most 2 x 128 x 127: no saturation), then to int32 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#else
#define INT8_PATH 0 /* plain C */
#endif

#if INT8_PATH == 3
#define TILE 16
#else
#define TILE 8
#endif
#define OFFSET (INT8_PATH >= 2) /* VNNI: an unsigned side, offset by 128 */

/* the head's bytes and the whole tile's, by kind (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_K) */
static const int tile_head[BLOCK_KINDS] = {2 * TILE, 2 * TILE, 4 * TILE, 8 * TILE, 12 * TILE, 8 * TILE};
static const int block_bytes[BLOCK_KINDS] = BLOCK_BYTES_BY_KIND;
/* a tile holds TILE blocks, Q6_K's with 4 bytes more each (its two scales' sums: see below) */
static const int tile_bytes[BLOCK_KINDS] = {Q8_0_BYTES * TILE, Q4_0_BYTES * TILE, Q4_1_BYTES * TILE,
                                            Q4_K_BYTES * TILE, (Q6_K_BYTES + 4) * TILE,
                                            Q5_K_BYTES * TILE};

/* Which integer dot product this build uses: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 0 plain C. */
int packed_int8_path(void) { return INT8_PATH; }

/* Rows per tile in this build (16 or 8). */
int packed_tile_rows(void) { return TILE; }
int tile_height(void) { return TILE; }

/* The layout of the tiles this build makes and reads: rows per tile, and whether byte weights
 * carry VNNI's offset. Tiles made under one layout must not be read under another. */
int packed_tile_layout(void) { return 2 * TILE + OFFSET; }

void quantize_rows(const float *x, const Int8Rows *qx, int rows, int K) {
    const int nb = K / QK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const size_t at = (size_t)r * nb + b;
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            int8_t *q = qx->q + (size_t)r * K + (size_t)b * QK;
            float amax = 0.0f; /* (a comparison, not fmaxf: a call where NaN rules apply) */
            for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) {
                const int v = (int)nearbyintf(xb[j] * id);
                q[j] = (int8_t)v;
                sum += v;
            }
            qx->d[at] = d;
            qx->sums[at] = sum;
            qx->xs[at] = d * (float)sum;
        }
}

/* W (N rows of K weights, kind 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K or 5 Q5_K, the last
 * three repacked) -> tiles, out: ceil(N / TILE) * K / 32 tiles of tile_bytes[kind] (code 8 +
 * kind), a row of tiles per thread at a time; the last tile's rows past N hold zero weights.
 * Returns 0, or -1 for arguments it cannot take. */
int packed_tile(int kind, const uint8_t *W, uint8_t *out, int N, int K, int threads) {
    if (K % QK || N < 1 || kind < 0 || kind >= BLOCK_KINDS || threads < 1) return -1;
    static const int at[4] = {2, 2, 4, 8};
    static const uint8_t zero[40] = {0}; /* a block of zero weights (d = m = q = 0) */
    const int nb = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < (N + TILE - 1) / TILE; t++)
        for (int b = 0; b < nb; b++) {
            uint8_t *tile = out + ((size_t)t * nb + b) * tile_bytes[kind];
            uint8_t *chunks = tile + tile_head[kind];
            for (int i = 0; i < TILE; i++) {
                const int n = t * TILE + i;
                const uint8_t *block = n < N ? W + ((size_t)n * nb + b) * block_bytes[kind] : zero;
                if (kind == Q6_K || kind == Q5_K) { /* float32 d_a, d_b (or d, m), then q */
                    memcpy(tile + 4 * i, block, 4);
                    memcpy(tile + 4 * (TILE + i), block + 4, 4);
                    if (kind == Q6_K) { /* the halves' sums of q, for VNNI's offset */
                        int16_t half[2] = {0, 0};
                        for (int j = 0; j < QK; j++) half[j >= QK / 2] += (int8_t)block[8 + j];
                        memcpy(tile + 8 * TILE + 2 * i, &half[0], 2);
                        memcpy(tile + 10 * TILE + 2 * i, &half[1], 2);
                    }
                    for (int c = 0; c < 8; c++)
                        for (int j = 0; j < 4; j++)
                            chunks[(c * TILE + i) * 4 + j] = block[8 + 4 * c + j];
                    continue;
                }
                if (kind == Q4_K) {
                    memcpy(tile + 4 * i, block, 4);
                    memcpy(tile + 4 * (TILE + i), block + 4, 4);
                } else {
                    memcpy(tile + 2 * i, block, 2);
                    if (kind == Q4_1) memcpy(tile + 2 * (TILE + i), block + 2, 2);
                }
                if (kind == Q8_0) {
                    for (int c = 0; c < 8; c++)
                        for (int j = 0; j < 4; j++)
                            chunks[(c * TILE + i) * 4 + j] =
                                (uint8_t)(block[2 + 4 * c + j] ^ (OFFSET ? 0x80 : 0));
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
#if INT8_PATH == 3
#define TVEC __m512
#define TINT __m512i
#define ti_load(p) _mm512_loadu_si512((const void *)(p))
#define ti_wide16(p) _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(p)))
#define ti_and(a, b) _mm512_and_si512(a, b)
#define ti_add(a, b) _mm512_add_epi32(a, b)
#define ti_sub(a, b) _mm512_sub_epi32(a, b)
#define ti_slli(a, n) _mm512_slli_epi32(a, n)
#define ti_srli16(a, n) _mm512_srli_epi16(a, n)
#define ti_set1_8(v) _mm512_set1_epi8(v)
#define ti_set1_32(v) _mm512_set1_epi32(v)
#define ti_zero() _mm512_setzero_si512()
#define ti_dot(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define tv_zero() _mm512_setzero_ps()
#define tv_load(p) _mm512_loadu_ps(p)
#define tv_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define tv_store(p, a) _mm512_storeu_ps(p, a)
#define tv_mul(a, b) _mm512_mul_ps(a, b)
#define tv_add(a, b) _mm512_add_ps(a, b)
#define tv_set1(s) _mm512_set1_ps(s)
#define tv_float(i) _mm512_cvtepi32_ps(i)
#else
#define TVEC __m256
#define TINT __m256i
#define ti_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define ti_wide16(p) _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define ti_and(a, b) _mm256_and_si256(a, b)
#define ti_add(a, b) _mm256_add_epi32(a, b)
#define ti_sub(a, b) _mm256_sub_epi32(a, b)
#define ti_slli(a, n) _mm256_slli_epi32(a, n)
#define ti_srli16(a, n) _mm256_srli_epi16(a, n)
#define ti_set1_8(v) _mm256_set1_epi8(v)
#define ti_set1_32(v) _mm256_set1_epi32(v)
#define ti_zero() _mm256_setzero_si256()
#define ti_dot(acc, u, s) _mm256_add_epi32(acc, dot_u8_i8(u, s))
#define tv_zero() _mm256_setzero_ps()
#define tv_load(p) _mm256_loadu_ps(p)
#define tv_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define tv_store(p, a) _mm256_storeu_ps(p, a)
#define tv_mul(a, b) _mm256_mul_ps(a, b)
#define tv_add(a, b) _mm256_add_ps(a, b)
#define tv_set1(s) _mm256_set1_ps(s)
#define tv_float(i) _mm256_cvtepi32_ps(i)
#endif

static inline int32_t four(const int8_t *q) { /* 4 bytes of x, as one int32 to broadcast */
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* A 4-bit tile's chunks against one row's int8 block qb: the TILE rows' sum(q qx), q unsigned. */
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

/* A tile of a byte per weight against qb: sum(q qx) exactly. Q5_K's q (0..31) are the unsigned
 * side as they are; Q8_0's signed q are held as q + 128 with VNNI (128 sum(qx) taken back) and
 * as q without (|q| against x with q's sign: AVX2 has no signed-by-signed product). */
static inline TINT tile_dot_bytes(const uint8_t *chunks, const int8_t *qb, int is_signed,
                                  int32_t qsum) {
    TINT acc[4];
    for (int c = 0; c < 4; c++) {
        TINT sum = ti_zero();
        for (int h = 0; h < 2; h++) {
            const int k = 2 * c + h;
            const TINT v = ti_load(chunks + k * 4 * TILE), x4 = ti_set1_32(four(qb + 4 * k));
#if OFFSET
            sum = ti_dot(sum, v, x4);
#else
            sum = is_signed ? ti_dot(sum, _mm256_sign_epi8(v, v), _mm256_sign_epi8(x4, v))
                            : ti_dot(sum, v, x4);
#endif
        }
        acc[c] = sum;
    }
    const TINT dot = ti_add(ti_add(acc[0], acc[1]), ti_add(acc[2], acc[3]));
#if OFFSET
    return is_signed ? ti_sub(dot, ti_set1_32(128 * qsum)) : dot;
#else
    (void)qsum;
    return dot;
#endif
}

/* A Q6_K tile against qb: sum(q qx) over weights 0-15 (lo) and 16-31 (hi), exactly. */
static inline void tile_dot_q6(const uint8_t *tile, const int8_t *qb, TINT *lo, TINT *hi) {
    const uint8_t *chunks = tile + tile_head[Q6_K];
    TINT acc[4] = {ti_zero(), ti_zero(), ti_zero(), ti_zero()};
    for (int k = 0; k < 8; k++) {
        const int at = (k / 4) * 2 + (k & 1); /* two accumulators per half */
        const TINT v = ti_load(chunks + k * 4 * TILE);
#if OFFSET /* x + 128 the unsigned side: sum((qx + 128) q) = sum(q qx) + 128 sum(q) */
        acc[at] = ti_dot(acc[at], ti_set1_32(four(qb + 4 * k) ^ (int32_t)0x80808080), v);
#else
        const TINT x4 = ti_set1_32(four(qb + 4 * k));
        acc[at] = ti_dot(acc[at], _mm256_sign_epi8(v, v), _mm256_sign_epi8(x4, v));
#endif
    }
    *lo = ti_add(acc[0], acc[1]);
    *hi = ti_add(acc[2], acc[3]);
#if OFFSET
    *lo = ti_sub(*lo, ti_slli(ti_wide16(tile + 8 * TILE), 7));
    *hi = ti_sub(*hi, ti_slli(ti_wide16(tile + 10 * TILE), 7));
#endif
}

/* One tile's share for row r: the TILE lanes' (q . qx) scaled, added to acc in the order of the
 * file's comment. */
static inline TVEC tile_share(int kind, const uint8_t *tile, const Int8Rows *qx, size_t at,
                              TVEC acc) {
    const int8_t *qb = qx->q + at * QK;
    const TVEC dx = tv_set1(qx->d[at]);
    if (kind == Q6_K) {
        TINT lo, hi;
        tile_dot_q6(tile, qb, &lo, &hi);
        const TVEC da = tv_load((const float *)tile), db = tv_load((const float *)tile + TILE);
        const TVEC sum = tv_add(tv_mul(tv_float(lo), da), tv_mul(tv_float(hi), db));
        return tv_add(acc, tv_mul(sum, dx));
    }
    const uint8_t *chunks = tile + tile_head[kind];
    TINT dot;
    TVEC d, m = tv_zero();
    if (kind == Q8_0 || kind == Q5_K) {
        dot = tile_dot_bytes(chunks, qb, kind == Q8_0, qx->sums[at]);
    } else {
        dot = tile_dot_q4(chunks, qb);
        if (kind == Q4_0) dot = ti_sub(dot, ti_set1_32(8 * qx->sums[at])); /* q - 8 */
    }
    if (kind == Q4_K || kind == Q5_K) {
        d = tv_load((const float *)tile);
        m = tv_load((const float *)tile + TILE);
    } else {
        d = tv_half(tile);
        if (kind == Q4_1) m = tv_half(tile + 2 * TILE);
    }
    acc = tv_add(acc, tv_mul(tv_float(dot), tv_mul(d, dx)));
    if (kind == Q4_1 || kind == Q4_K || kind == Q5_K) acc = tv_add(acc, tv_mul(m, tv_set1(qx->xs[at])));
    return acc;
}

/* Output features t * TILE .. of one row y = or += acc (only those below N: a last tile's
 * padding is not stored). */
static inline void store_tile(float *y, int t, int N, TVEC acc, int add) {
    float *out = y + (size_t)t * TILE;
    if (N - t * TILE >= TILE) {
        tv_store(out, add ? tv_add(tv_load(out), acc) : acc);
        return;
    }
    float lanes[TILE];
    tv_store(lanes, acc);
    for (int i = 0; i < N - t * TILE; i++) out[i] = add ? out[i] + lanes[i] : lanes[i];
}

/* y (rows, N) = or += the tiles' product with the int8 rows qx, inside a parallel region. */
#define TILE_MATMUL(NAME, KIND)                                                                \
    static void NAME(const uint8_t *T, const Int8Rows *qx, float *y, int rows, int N, int K,   \
                     int add) {                                                                \
        const int nb = K / QK;                                                                 \
        const size_t bytes = tile_bytes[KIND];                                                 \
        _Pragma("omp for schedule(static)")                                                    \
        for (int t = 0; t < (N + TILE - 1) / TILE; t++) {                                      \
            TVEC acc[MAX_ROWS];                                                                \
            for (int r = 0; r < rows; r++) acc[r] = tv_zero();                                 \
            for (int b = 0; b < nb; b++) {                                                     \
                const uint8_t *tile = T + ((size_t)t * nb + b) * bytes;                        \
                prefetch_ahead(tile, bytes);                                                   \
                for (int r = 0; r < rows; r++)                                                 \
                    acc[r] = tile_share(KIND, tile, qx, (size_t)r * nb + b, acc[r]);           \
            }                                                                                  \
            for (int r = 0; r < rows; r++) store_tile(y + (size_t)r * N, t, N, acc[r], add);  \
        }                                                                                      \
    }
TILE_MATMUL(tile_matmul_q8_0, Q8_0)
TILE_MATMUL(tile_matmul_q4_0, Q4_0)
TILE_MATMUL(tile_matmul_q4_1, Q4_1)
TILE_MATMUL(tile_matmul_q4_k, Q4_K)
TILE_MATMUL(tile_matmul_q6_k, Q6_K)
TILE_MATMUL(tile_matmul_q5_k, Q5_K)

void tile_matmul(int code, const uint8_t *T, const Int8Rows *qx, float *y, int rows, int N, int K,
                 int add) {
    const int kind = code - 8;
    if (kind == Q8_0) tile_matmul_q8_0(T, qx, y, rows, N, K, add);
    else if (kind == Q4_0) tile_matmul_q4_0(T, qx, y, rows, N, K, add);
    else if (kind == Q4_1) tile_matmul_q4_1(T, qx, y, rows, N, K, add);
    else if (kind == Q4_K) tile_matmul_q4_k(T, qx, y, rows, N, K, add);
    else if (kind == Q6_K) tile_matmul_q6_k(T, qx, y, rows, N, K, add);
    else tile_matmul_q5_k(T, qx, y, rows, N, K, add);
}

#else /* plain C: the same integers and the same float steps, a lane at a time */

/* Weight 0 <= k < 32 of row i in a tile's chunks, as the integer the product uses. */
static inline int tile_weight(const uint8_t *chunks, int kind, int i, int k) {
    if (kind == Q8_0 || kind == Q6_K) return (int8_t)chunks[((k / 4) * TILE + i) * 4 + k % 4];
    if (kind == Q5_K) return chunks[((k / 4) * TILE + i) * 4 + k % 4];
    const uint8_t byte = chunks[((k / 8) * TILE + i) * 4 + k % 4];
    return (k % 8 < 4 ? byte & 15 : byte >> 4) - (kind == Q4_0 ? 8 : 0);
}

static inline float half_to_float(const uint8_t *p) {
    _Float16 f;
    memcpy(&f, p, 2);
    return (float)f;
}

static inline float tile_float(const uint8_t *tile, int kind, int which, int i) {
    if (kind >= Q4_K) {
        float f;
        memcpy(&f, tile + 4 * (which * TILE + i), 4);
        return f;
    }
    return half_to_float(tile + 2 * (which * TILE + i));
}

void tile_matmul(int code, const uint8_t *T, const Int8Rows *qx, float *y, int rows, int N, int K,
                 int add) {
    const int nb = K / QK, kind = code - 8;
    const int has_m = kind == Q4_1 || kind == Q4_K || kind == Q5_K;
#pragma omp for schedule(static)
    for (int t = 0; t < (N + TILE - 1) / TILE; t++) {
        float acc[MAX_ROWS][TILE] = {{0}};
        for (int b = 0; b < nb; b++) {
            const uint8_t *tile = T + ((size_t)t * nb + b) * tile_bytes[kind];
            prefetch_ahead(tile, tile_bytes[kind]);
            for (int i = 0; i < TILE; i++) {
                const float d = tile_float(tile, kind, 0, i);
                const float m = has_m || kind == Q6_K ? tile_float(tile, kind, 1, i) : 0.0f;
                for (int r = 0; r < rows; r++) {
                    const size_t at = (size_t)r * nb + b;
                    int32_t lo = 0, hi = 0; /* Q6_K: weights 0-15 and 16-31 apart */
                    for (int k = 0; k < QK; k++) {
                        const int32_t p = tile_weight(tile + tile_head[kind], kind, i, k) *
                                          qx->q[at * QK + k];
                        if (kind == Q6_K && k >= QK / 2) hi += p;
                        else lo += p;
                    }
                    const float dx = qx->d[at];
                    if (kind == Q6_K) {
                        acc[r][i] = acc[r][i] + ((float)lo * d + (float)hi * m) * dx;
                        continue;
                    }
                    acc[r][i] = acc[r][i] + (float)lo * (d * dx);
                    if (has_m) acc[r][i] = acc[r][i] + m * qx->xs[at];
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < TILE && t * TILE + i < N; i++) {
                float *out = y + (size_t)r * N + (size_t)t * TILE + i;
                *out = add ? *out + acc[r][i] : acc[r][i];
            }
    }
}
#endif

/* packed_matmul for tiles (packed_tile's output, code 8 + the blocks' kind), x quantized per
 * block to int8 first: y (rows, N) = x (rows, K) W^T, rows <= MAX_ROWS. Returns 0, -1 for
 * arguments it cannot take, -2 when out of memory. */
int packed_matmul_tiles(int code, const uint8_t *T, const float *x, float *y, int rows, int N,
                        int K, int threads) {
    if (rows < 1 || rows > MAX_ROWS || K % QK || N < 1 || threads < 1 || !IS_TILES(code))
        return -1;
    const size_t nb = (size_t)rows * (K / QK);
    int8_t *q = malloc((size_t)rows * K + sizeof(float) * 3 * nb);
    if (q == NULL) return -2;
    float *d = (float *)(q + (size_t)rows * K);
    const Int8Rows qx = {q, d, d + nb, (int32_t *)(d + 2 * nb)};
    quantize_rows(x, &qx, rows, K);
#pragma omp parallel num_threads(threads)
    tile_matmul(code, T, &qx, y, rows, N, K, 0);
    free(q);
    return 0;
}
