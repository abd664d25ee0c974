/* What the packed kernels' three files share: the float path's products from blocks (packed.c),
 * the integer path's tiles (tiles.c) and the Llama forward that calls both (llama_step.c).
 * Functions here are internal to the library (hidden); Python calls the ones the files export. */
#ifndef ATTNKIT_PACKED_H
#define ATTNKIT_PACKED_H

#include <stddef.h>
#include <stdint.h>

#define QK 32       /* weights per block */
#define MAX_ROWS 16 /* rows of x per product call */
#define HIDDEN __attribute__((visibility("hidden")))

/* Weight kinds, as LlamaLayer.kind and the exported functions take them: blocks 0-5, the
 * integer path's tiles (TILE_BASE + the blocks' kind), float32 (N, K) rows and (K, N) columns.
 * Defined here alone: attnkit/accel/native.py reads these enums (native.kinds()). */
enum { Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q5_K, BLOCK_KINDS };
enum { TILE_BASE = 8, FLOAT_ROWS = 16, FLOAT_COLUMNS = 17 };
/* The bytes of a block of 32 weights, by kind, as the kernels keep them (the K-quants repacked:
 * accel/block_formats.py); a test checks them against Python's table of quantization types. */
enum { Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q4_1_BYTES = 20, Q4_K_BYTES = 24, Q6_K_BYTES = 40,
       Q5_K_BYTES = 40 };
#define BLOCK_BYTES_BY_KIND {Q8_0_BYTES, Q4_0_BYTES, Q4_1_BYTES, Q4_K_BYTES, Q6_K_BYTES, Q5_K_BYTES}
#define TILES(kind) (TILE_BASE + (kind))
#define IS_TILES(code) ((code) >= TILE_BASE && (code) < TILE_BASE + BLOCK_KINDS)

/* packed.c: sums[r * K/32 + b] = the sum of x's block b in row r (for a block's minimum m), and
 * y (rows, N) = or += (add) x (rows, K) W^T for blocks of `kind`, inside a parallel region. */
HIDDEN void block_sums(const float *x, float *sums, int rows, int K);
HIDDEN void block_matmul(int kind, const uint8_t *W, const float *x, const float *sums, float *y,
                         int rows, int N, int K, int add);

/* tiles.c: x quantized per block of 32 to int8, as the integer path multiplies it. */
typedef struct {
    int8_t *q;     /* (rows, K) */
    float *d;      /* (rows, K/32) each block's scale: max |x_b| / 127 */
    float *xs;     /* d * sum(q_b): what a block's minimum m multiplies */
    int32_t *sums; /* sum(q_b) */
} Int8Rows;
HIDDEN void quantize_rows(const float *x, const Int8Rows *qx, int rows, int K);
/* y (rows, N) = or += the tiles' (code) product with qx, inside a parallel region. */
HIDDEN void tile_matmul(int code, const uint8_t *T, const Int8Rows *qx, float *y, int rows, int N,
                        int K, int add);
HIDDEN int tile_height(void); /* rows per tile in this build */

#endif
