/* The structs that Python hands the kernels, defined once.
 *
 * Each is a list of FIELD(type, name, array length or nothing). C expands the lists below into
 * typedefs; attnkit/accel/native.py reads the same lines and builds its ctypes.Structure
 * classes from them (a pointer becomes c_void_p), so the two layouts cannot drift apart. Keep
 * one field per FIELD(...), with types among: int, float, int64_t, and pointers.
 */
#ifndef ATTNKIT_STRUCTS_H
#define ATTNKIT_STRUCTS_H
#include <stdint.h>

/* A (B, H, N, d) tensor, or packed sequences' (T, H, d) rows (attention.c). */
#define ATTNKIT_VIEW(FIELD)                                                                  \
    FIELD(int, dtype, )           /* 0 float32, 1 bfloat16 */                              \
    FIELD(void *, data, )                                                                  \
    FIELD(int64_t, sb, )          /* strides in elements: batch, head, position (last: 1) */ \
    FIELD(int64_t, sh, )                                                                   \
    FIELD(int64_t, sn, )                                                                   \
    FIELD(const int64_t *, first, ) /* packed: batch b starts at row first[b] (sb unused) */

/* An attention call's sizes and options (attention.c). */
#define ATTNKIT_SHAPE(FIELD)                                                                 \
    FIELD(int, batch, )                                                                    \
    FIELD(int, heads, )                                                                    \
    FIELD(int, n, )                                                                        \
    FIELD(int, m, )                                                                        \
    FIELD(int, d, )                                                                        \
    FIELD(int, causal, )                                                                   \
    FIELD(float, scale, )                                                                  \
    FIELD(const uint8_t *, valid, ) /* batch x m (1 = a real key) or NULL */               \
    FIELD(int, tiles, )           /* 1: bfloat16 products on AMX tiles where there are any */ \
    FIELD(const int32_t *, n_of, ) /* packed: batch b's queries (n is the largest) or NULL */ \
    FIELD(const int32_t *, m_of, ) /* ... and keys (m is the largest) or NULL */

/* One Llama-family layer's sizes, norms and weights (llama_step.c's packed_llama_forward). */
#define ATTNKIT_LLAMA_LAYER(FIELD)                                                           \
    FIELD(int, d_model, )                                                                  \
    FIELD(int, n_heads, )                                                                  \
    FIELD(int, n_kv_heads, )                                                               \
    FIELD(int, d_head, )                                                                   \
    FIELD(int, d_ff, )                                                                     \
    FIELD(float, eps, )           /* RMSNorm's epsilon */                                  \
    FIELD(float, scale, )         /* the scores' factor, 1 / sqrt(d_head) */               \
    FIELD(const float *, norm1, ) /* RMSNorm gains (d_model) before attention */           \
    FIELD(const float *, norm2, ) /* ... and before the feed-forward network */           \
    FIELD(const float *, inv_freq, ) /* RoPE's inverse frequencies (rotary_dim / 2) */     \
    FIELD(int, kind, [5])         /* in, out, gate, up, down: 0 Q8_0 1 Q4_0 2 Q4_1 3 Q4_K \
                                     4 Q6_K 5 Q5_K, 8-13 tiles, 16 float32 (N, K), 17 (K, N) */ \
    FIELD(const uint8_t *, weight, [5])                                                    \
    FIELD(const float *, q_norm, ) /* QK-norm gains (d_head), or NULL (Gemma) */             \
    FIELD(const float *, k_norm, )                                                          \
    FIELD(float, qk_eps, )                                                                  \
    FIELD(const float *, attn_out_norm, ) /* sandwich norms' gains (d_model), or NULL */    \
    FIELD(const float *, ffn_out_norm, )                                                    \
    FIELD(int, activation, )      /* 0 SwiGLU, 1 GeGLU (GELU with tanh) */                 \
    FIELD(int, window, )          /* 0: a KVCache; w: a ring of the last w positions */      \
    FIELD(const float *, in_bias, ) /* W_in's bias (Qwen2: q, k, v), or NULL */              \
    FIELD(int, rotary_dim, )      /* RoPE turns each head's first rotary_dim dimensions */

/* One layer's cache for packed_llama_forward: a KVCache, or a RollingKVCache ring (valid set). */
#define ATTNKIT_LLAMA_CACHE(FIELD)                                                           \
    FIELD(float *, k, )           /* (rows, n_kv_heads, slots, d_head) keys */             \
    FIELD(float *, v, )           /* ... and values */                                     \
    FIELD(int64_t *, positions, ) /* (rows, slots) */                                      \
    FIELD(uint8_t *, valid, )     /* a ring's (rows, window) flags; NULL for a KVCache */  \
    FIELD(int, slots, )           /* max_len, or the window */                             \
    FIELD(int, length, )          /* positions cached before this step */

#define ATTNKIT_C_FIELD(type, name, dims) type name dims;
typedef struct { ATTNKIT_VIEW(ATTNKIT_C_FIELD) } View;
typedef struct { ATTNKIT_SHAPE(ATTNKIT_C_FIELD) } Shape;
typedef struct { ATTNKIT_LLAMA_LAYER(ATTNKIT_C_FIELD) } LlamaLayer;
typedef struct { ATTNKIT_LLAMA_CACHE(ATTNKIT_C_FIELD) } LlamaCache;
#undef ATTNKIT_C_FIELD

#endif
