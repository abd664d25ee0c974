/* Products with weights kept in llama.cpp's block formats (Q8_0, Q4_0, Q4_1).
 *
 * y[m, n] = sum_k x[m, k] W[n, k] for a few rows m (decoding: one row per sequence), W stored as
 * rows of K / 32 blocks. Each block is decoded to 32 floats once and used for every row of x, so
 * the weights are read once per call: decoding is bound by the bytes of weights it reads, and a
 * packed block is 3.6-6.4x smaller than its 32 float32 weights.
 *
 *   Q8_0  34 bytes: float16 d, 32 int8 q                w = q * d
 *   Q4_0  18 bytes: float16 d, 16 bytes of nibbles       w = d * (q - 8)
 *   Q4_1  20 bytes: float16 d, float16 m, 16 bytes       w = d * q + m
 *
 * In the 16 bytes of a 4-bit block, the low nibbles are weights 0-15, the high ones 16-31.
 * Built at run time with the machine's own compiler flags (attnkit/accel/packed.py).
 */
#include <stdint.h>
#include <string.h>

#define QK 32
#define MAX_ROWS 16

static float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* Decode one block to 32 floats (one function per format, so that each loop vectorizes). */
static inline void decode_q8_0(const uint8_t *block, float *w) {
    uint16_t raw;
    memcpy(&raw, block, 2);
    const float d = half_to_float(raw);
    const int8_t *q = (const int8_t *)(block + 2);
    for (int j = 0; j < QK; j++) w[j] = (float)q[j] * d;
}

static inline void decode_q4_0(const uint8_t *block, float *w) {
    uint16_t raw;
    memcpy(&raw, block, 2);
    const float d = half_to_float(raw);
    const uint8_t *q = block + 2;
    for (int j = 0; j < QK / 2; j++) w[j] = d * (float)((int)(q[j] & 15) - 8);
    for (int j = 0; j < QK / 2; j++) w[j + QK / 2] = d * (float)((int)(q[j] >> 4) - 8);
}

static inline void decode_q4_1(const uint8_t *block, float *w) {
    uint16_t raw_d, raw_m;
    memcpy(&raw_d, block, 2);
    memcpy(&raw_m, block + 2, 2);
    const float d = half_to_float(raw_d), m = half_to_float(raw_m);
    const uint8_t *q = block + 4;
    for (int j = 0; j < QK / 2; j++) w[j] = d * (float)(q[j] & 15) + m;
    for (int j = 0; j < QK / 2; j++) w[j + QK / 2] = d * (float)(q[j] >> 4) + m;
}

/* y[r, n] for rows r < rows: every block decoded once, then used for each row of x. */
#define PACKED_MATMUL(NAME, DECODE, BLOCK_BYTES)                                              \
    static void NAME(const uint8_t *W, const float *x, float *y, int rows, int N, int K,      \
                     int threads) {                                                           \
        const int nb = K / QK;                                                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int n = 0; n < N; n++) {                                                         \
            const uint8_t *row = W + (size_t)n * nb * BLOCK_BYTES;                            \
            float acc[MAX_ROWS][QK];                                                          \
            for (int r = 0; r < rows; r++)                                                    \
                for (int j = 0; j < QK; j++) acc[r][j] = 0.0f;                                \
            float w[QK];                                                                      \
            for (int b = 0; b < nb; b++) {                                                    \
                DECODE(row + (size_t)b * BLOCK_BYTES, w);                                     \
                for (int r = 0; r < rows; r++) {                                              \
                    const float *xb = x + (size_t)r * K + (size_t)b * QK;                     \
                    for (int j = 0; j < QK; j++) acc[r][j] += w[j] * xb[j];                   \
                }                                                                             \
            }                                                                                 \
            for (int r = 0; r < rows; r++) {                                                  \
                float s = 0.0f;                                                               \
                for (int j = 0; j < QK; j++) s += acc[r][j];                                  \
                y[(size_t)r * N + n] = s;                                                     \
            }                                                                                 \
        }                                                                                     \
    }

PACKED_MATMUL(matmul_q8_0, decode_q8_0, 34)
PACKED_MATMUL(matmul_q4_0, decode_q4_0, 18)
PACKED_MATMUL(matmul_q4_1, decode_q4_1, 20)

/* kind: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1. x: (rows, K), y: (rows, N), rows <= MAX_ROWS. threads:
 * passed by the caller (torch's count), because a thread other than the main one would
 * otherwise get OpenMP's default team, which measured as one thread under torch. */
int packed_matmul(int kind, const uint8_t *W, const float *x, float *y, int rows, int N, int K,
                  int threads) {
    if (rows < 1 || rows > MAX_ROWS || K % QK || threads < 1) return -1;
    if (kind == 0) matmul_q8_0(W, x, y, rows, N, K, threads);
    else if (kind == 1) matmul_q4_0(W, x, y, rows, N, K, threads);
    else if (kind == 2) matmul_q4_1(W, x, y, rows, N, K, threads);
    else return -1;
    return 0;
}
