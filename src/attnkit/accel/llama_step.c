/* The forward of a Llama-family decoder stack with packed weights, for new tokens: what
 * attnkit.layers.DecoderLayer computes for each layer, then the stack's final norm, as one
 * parallel region (attnkit/accel/packed_step.py). Llama (Pre-LN, RMSNorm, RoPE, grouped-query
 * attention, SwiGLU, no biases), and Gemma 3 where the layer names its differences (QK-norm,
 * sandwich norms, GeGLU, a sliding window over a ring of cached keys, heads wider than
 * d_model / H), Qwen2's biases on q, k and v, and Phi-3's RoPE over part of each head:
 *
 *   h = RMSNorm_1(x);  q, k, v = h W_in [+ b_in] (split);  q, k = RMSNorm_q(q), RMSNorm_k(k)
 *   q, k = RoPE(q, k, position);  cache[slot] = k, v   (slot: index, or index % window)
 *   a = softmax(q K^T / sqrt(d_head) + mask) V   (each query head reads the key head it shares)
 *   x = x + [RMSNorm_a](a W_out)
 *   h = RMSNorm_2(x);  x = x + [RMSNorm_f]((act(h W_gate) * (h W_up)) W_down)
 *
 * with act SiLU (SwiGLU) or GELU with tanh (GeGLU), and the bracketed norms only where the
 * layer has them. A product's weights are packed blocks (packed.c), the integer path's tiles
 * (tiles.c), or float32 (kind 16: (N, K) rows; kind 17: (K, N), as accel.decoding lays a
 * linear layer out).
 *
 * A call takes B rows of the cache (sequences) and T new tokens for each: a decoding step is
 * T = 1, a prompt's chunk is B = 1. A token's arithmetic is the same whatever shares its call:
 * the products treat each row alone (packed.c, tiles.c), every other sum has one written order
 * (fixed.h), and a token's attention walks its keys in the order of the cache's slots, reading
 * the keys of tokens in the same call from where this call keeps them. So a token's hidden
 * state does not depend on how a prompt was split into chunks, on a prompt cache, or on the
 * other rows of a batch; and on the integer path (whose products give the same bits on every
 * variant), not on the variant either.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixed.h"
#include "packed.h"
#include "structs.h"

/* RoPE, the half-split layout over a head's first `rot` of its d dimensions: pair i with
 * i + rot/2, rotated by cos_sin (cos, then sin); the rest passes through (partial rotary). */
static void rope(const float *x, float *out, int d, int rot, const float *cos_sin) {
    const int half = rot / 2;
    for (int i = 0; i < half; i++) {
        const float c = cos_sin[i], s = cos_sin[half + i];
        const float a = x[i], b = x[i + half];
        out[i] = a * c - b * s;
        out[i + half] = b * c + a * s;
    }
    for (int i = rot; i < d; i++) out[i] = x[i];
}

/* y (rows, N) = or += x (rows, K) W^T for float32 weights, inside a parallel region: kind 16,
 * W (N, K) rows (each y one dot()); kind 17, W^T (K, N) (each y summed over k in order). */
static void float_matmul(int kind, const float *W, const float *x, float *y, int rows, int N,
                         int K, int add) {
    if (kind == FLOAT_ROWS) {
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++)
            for (int r = 0; r < rows; r++) {
                const float share = dot(x + (size_t)r * K, W + (size_t)n * K, K);
                float *out = y + (size_t)r * N + n;
                *out = add ? *out + share : share;
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

/* What a call of layer L needs to know besides its weights. */
typedef struct {
    int batch, tokens, rows;       /* rows = batch * tokens; row b * tokens + t */
    const int64_t *positions;      /* (rows) RoPE's positions */
    const uint8_t *mask;           /* (batch, length + tokens), 1 = a real token; or NULL */
} Call;

/* Scratch for one layer's call, by role. */
typedef struct {
    float *h, *qkv, *attn, *gate, *up, *scores, *sums, *angles, *out, *new_k, *new_v;
    const float **values; /* (rows, H, M): the value each score weighs, NULL where none */
    Int8Rows qx;
} Scratch;

/* Which inputs layer L's products need: tiles (the integer path) and / or blocks; -1 for a kind
 * or a shape this file cannot take. */
static int layer_inputs(const LlamaLayer *L, int *tiles, int *blocks) {
    const int D = L->d_model, H = L->n_heads, Hkv = L->n_kv_heads, dh = L->d_head, F = L->d_ff;
    const int A = H * dh;
    if (D % QK || F % QK || A % QK || dh % 2 || Hkv < 1 || H % Hkv || L->activation < 0 ||
        L->activation > 1 || L->window < 0)
        return -1;
    *tiles = *blocks = 0;
    for (int i = 0; i < 5; i++) {
        const int k = L->kind[i];
        const int known = (k >= 0 && k < BLOCK_KINDS) || IS_TILES(k) || k == FLOAT_ROWS ||
                          k == FLOAT_COLUMNS;
        if (!known) return -1;
        *tiles |= IS_TILES(k);
        *blocks |= k >= 0 && k < BLOCK_KINDS;
    }
    return 0;
}

static int widest(const LlamaLayer *L) { /* the longest row a product reads */
    const int A = L->n_heads * L->d_head;
    int w = L->d_model > L->d_ff ? L->d_model : L->d_ff;
    return w > A ? w : A;
}

/* Bytes of scratch one row of layer L's call takes, with M key slots per query. */
static size_t layer_scratch(const LlamaLayer *L, int M) {
    const int D = L->d_model, H = L->n_heads, dh = L->d_head, F = L->d_ff, W = widest(L);
    const int A = H * dh, Nqkv = (H + 2 * L->n_kv_heads) * dh;
    const size_t floats = (size_t)D + Nqkv + A + 2 * F + (size_t)H * M + 4 * (W / QK) + dh + D +
                          2 * (size_t)L->n_kv_heads * dh;
    return sizeof(const float *) * H * M + sizeof(float) * floats + W;
}

static Scratch carve(const LlamaLayer *L, float *base, int rows, int M) {
    const int D = L->d_model, H = L->n_heads, dh = L->d_head, F = L->d_ff, W = widest(L) / QK;
    const int A = H * dh, Nqkv = (H + 2 * L->n_kv_heads) * dh, kv = L->n_kv_heads * dh;
    Scratch s;
    s.values = (const float **)base; /* first: the pointers keep malloc's alignment */
    s.h = (float *)(s.values + (size_t)rows * H * M);
    s.qkv = s.h + (size_t)rows * D;
    s.attn = s.qkv + (size_t)rows * Nqkv;
    s.gate = s.attn + (size_t)rows * A;
    s.up = s.gate + (size_t)rows * F;
    s.scores = s.up + (size_t)rows * F;
    s.sums = s.scores + (size_t)rows * H * M;
    s.qx.d = s.sums + (size_t)rows * W;
    s.qx.xs = s.qx.d + (size_t)rows * W;
    s.qx.sums = (int32_t *)(s.qx.xs + (size_t)rows * W);
    s.angles = (float *)(s.qx.sums + (size_t)rows * W); /* (rows, d_head): cos, then sin */
    s.out = s.angles + (size_t)rows * dh;                /* (rows, D): a sublayer's output */
    s.new_k = s.out + (size_t)rows * D;                  /* (rows, n_kv_heads, d_head) */
    s.new_v = s.new_k + (size_t)rows * kv;
    s.qx.q = (int8_t *)(s.new_v + (size_t)rows * kv);
    return s;
}

/* Row R of a product's input made ready for the layer's weights (block sums for blocks, int8
 * blocks for tiles; a layer may hold both), and the product of weight i with the rows: y (rows,
 * N) = or += x (rows, K) W_i^T (kinds 16 and 17: float32 weights, read from X itself). */
#define PREPARE_ROW(X, K_, R)                                                                  \
    do {                                                                                       \
        const size_t nb_ = (size_t)(K_) / QK, r_ = (size_t)(R);                                \
        if (tiles) {                                                                           \
            const Int8Rows row_ = {s.qx.q + r_ * (K_), s.qx.d + r_ * nb_, s.qx.xs + r_ * nb_,   \
                                   s.qx.sums + r_ * nb_};                                      \
            quantize_rows((X) + r_ * (K_), &row_, 1, K_);                                      \
        }                                                                                      \
        if (blocks) block_sums((X) + r_ * (K_), s.sums + r_ * nb_, 1, K_);                      \
    } while (0)
#define PRODUCT(I, X, Y, N_, K_, ADD)                                                          \
    do {                                                                                       \
        const int kind_ = L->kind[I];                                                          \
        if (kind_ >= FLOAT_ROWS)                                                               \
            float_matmul(kind_, (const float *)L->weight[I], X, Y, c->rows, N_, K_, ADD);      \
        else if (IS_TILES(kind_))                                                              \
            tile_matmul(kind_, L->weight[I], &s.qx, Y, c->rows, N_, K_, ADD);                  \
        else block_matmul(kind_, L->weight[I], X, s.sums, Y, c->rows, N_, K_, ADD);            \
    } while (0)

/* Where the key of slot j lives for token (b, t) at cache index i, and whether it is one to
 * attend to. Slots run over the cache (a KVCache: index j itself, j <= i; a ring of the window:
 * slot j holds the latest index <= i that is j modulo the window). An index before this call's
 * first (`length`) is read from the cache, a later one from this call's new keys. */
static inline int key_at(const LlamaLayer *L, const LlamaCache *C, const Call *c, const Scratch *s,
                         int b, int g, int64_t i, int j, const float **k, const float **v) {
    const int w = L->window, Hkv = L->n_kv_heads, dh = L->d_head, length = C->length;
    const int64_t index = w > 0 ? i - ((i - j) % w + w) % w : j;
    if (index < 0) return 0; /* a ring slot nothing has reached yet */
    const size_t stride = (size_t)length + c->tokens;
    if (index >= length) {
        if (c->mask != NULL && !c->mask[(size_t)b * stride + index]) return 0;
        const size_t row = (size_t)b * c->tokens + (size_t)(index - length);
        *k = s->new_k + (row * Hkv + g) * dh;
        *v = s->new_v + (row * Hkv + g) * dh;
        return 1;
    }
    if (w > 0 ? !C->valid[(size_t)b * C->slots + j]
              : c->mask != NULL && !c->mask[(size_t)b * stride + index])
        return 0;
    const size_t at = (((size_t)b * Hkv + g) * C->slots + j) * dh;
    *k = C->k + at;
    *v = C->v + at;
    return 1;
}

/* Row r's new key and value into the cache C (a ring keeps the window's last ones: a row
 * older than that writes nothing), once every query of the call has read them. Each row
 * writes a slot of its own. */
static void store_key(const LlamaLayer *L, const LlamaCache *C, const Call *c, const Scratch *s,
                      int r) {
    const int Hkv = L->n_kv_heads, dh = L->d_head, T = c->tokens, length = C->length;
    const int b = r / T, t = r % T, ring = L->window > 0;
    if (ring && t < T - L->window) return;
    const int64_t index = (int64_t)length + t;
    const int slot = ring ? (int)(index % L->window) : (int)index;
    for (int g = 0; g < Hkv; g++) {
        const size_t at = (((size_t)b * Hkv + g) * C->slots + slot) * dh;
        memcpy(C->k + at, s->new_k + ((size_t)r * Hkv + g) * dh, sizeof(float) * dh);
        memcpy(C->v + at, s->new_v + ((size_t)r * Hkv + g) * dh, sizeof(float) * dh);
    }
    C->positions[(size_t)b * C->slots + slot] = c->positions[r];
    if (ring)
        C->valid[(size_t)b * C->slots + slot] =
            c->mask == NULL ? 1 : c->mask[(size_t)b * (length + T) + index];
}

/* x += RMSNorm_g(out), row by row among the threads (a sandwich norm's residual add). */
static void add_normed(const float *g, float eps, float *out, float *x, int rows, int D) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * D, *xr = x + (size_t)r * D;
        rms_norm_fixed(o, g, o, 1, D, eps);
        for (int e = 0; e < D; e++) xr[e] += o[e];
    }
}

/* One layer for the call's rows, run by every thread of the caller's parallel region: x (rows,
 * d_model) is updated in place, and the new keys and values go into the cache C. */
static void layer_forward(const LlamaLayer *L, const LlamaCache *C, float *x, const Call *c,
                          float *scratch) {
    const int D = L->d_model, H = L->n_heads, Hkv = L->n_kv_heads, dh = L->d_head, F = L->d_ff;
    const int A = H * dh, Nqkv = (H + 2 * Hkv) * dh, groups = H / Hkv, T = c->tokens;
    const int ring = L->window > 0, length = C->length, rot = L->rotary_dim;
    const int M = ring ? L->window : length + T; /* key slots a query may walk */
    int tiles = 0, blocks = 0;
    layer_inputs(L, &tiles, &blocks);
    const Scratch s = carve(L, scratch, c->rows, M);

#pragma omp for schedule(static)
    for (int r = 0; r < c->rows; r++) {
        rms_norm_fixed(x + (size_t)r * D, L->norm1, s.h + (size_t)r * D, 1, D, L->eps);
        PREPARE_ROW(s.h, D, r);
        float *cs = s.angles + (size_t)r * dh;
        for (int i = 0; i < rot / 2; i++)
            cos_sin_fixed((float)c->positions[r] * L->inv_freq[i], cs + i, cs + rot / 2 + i);
    }
    PRODUCT(0, s.h, s.qkv, Nqkv, D, 0);
    if (L->in_bias != NULL) { /* q, k and v's biases (Qwen2), added after the product */
#pragma omp for schedule(static)
        for (int r = 0; r < c->rows; r++)
            for (int e = 0; e < Nqkv; e++) s.qkv[(size_t)r * Nqkv + e] += L->in_bias[e];
    }
    /* the new keys, normalised and rotated, and values */
#pragma omp for schedule(static)
    for (int item = 0; item < c->rows * Hkv; item++) {
        const int r = item / Hkv, g = item % Hkv;
        const float *k = s.qkv + (size_t)r * Nqkv + A + (size_t)g * dh;
        float normed[dh];
        if (L->k_norm != NULL) rms_norm_fixed(k, L->k_norm, normed, 1, dh, L->qk_eps);
        rope(L->k_norm != NULL ? normed : k, s.new_k + (size_t)item * dh, dh, rot,
             s.angles + (size_t)r * dh);
        memcpy(s.new_v + (size_t)item * dh, k + (size_t)Hkv * dh, sizeof(float) * dh);
    }
    /* each query head against its key head's keys, in slot order */
#pragma omp for schedule(static, 1)
    for (int item = 0; item < c->rows * H; item++) {
        const int r = item / H, head = item % H, g = head / groups, b = r / T;
        const int64_t i = (int64_t)length + r % T; /* this token's cache index */
        const int slots = ring ? M : (int)(i + 1);
        float q[dh], normed[dh], *sc = s.scores + (size_t)item * M;
        const float **vs = s.values + (size_t)item * M;
        float *o = s.attn + (size_t)r * A + (size_t)head * dh;
        const float *raw = s.qkv + (size_t)r * Nqkv + (size_t)head * dh, *k, *v;
        if (L->q_norm != NULL) rms_norm_fixed(raw, L->q_norm, normed, 1, dh, L->qk_eps);
        rope(L->q_norm != NULL ? normed : raw, q, dh, rot, s.angles + (size_t)r * dh);
        /* scores; a slot not attended to scores below exp's range, so its weight is 0 */
        float top = -INFINITY;
        for (int j = 0; j < slots; j++) {
            sc[j] = -INFINITY;
            vs[j] = NULL;
            if (!key_at(L, C, c, &s, b, g, i, j, &k, &v)) continue;
            vs[j] = v;
            sc[j] = dot(q, k, dh) * L->scale;
            if (sc[j] > top) top = sc[j];
        }
        if (top == -INFINITY) { /* nothing to attend to: a zero output */
            memset(o, 0, sizeof(float) * dh);
            continue;
        }
        for (int j = 0; j < slots; j++) { /* below -87 exp_neg gives 0; -inf must not reach it */
            const float z = sc[j] - top;
            sc[j] = exp_neg(z > -88.0f ? z : -88.0f);
        }
        float total = 0.0f; /* in slot order: the zeros of the slots left out change nothing */
        for (int j = 0; j < slots; j++) total += sc[j];
        for (int j = 0; j < slots; j++) sc[j] /= total;
        /* o = sum of p_j v_j in slot order (a weight of 0 adds nothing: skipped), 64 of o's
         * values at a time in four vectors that stay in registers */
        int e0 = 0;
        for (; e0 + 64 <= dh; e0 += 64) {
            f16x16 acc[4] = {{0}, {0}, {0}, {0}};
            for (int j = 0; j < slots; j++)
                if (sc[j] != 0.0f && vs[j] != NULL)
                    for (int part = 0; part < 4; part++) {
                        f16x16 w;
                        memcpy(&w, vs[j] + e0 + 16 * part, sizeof w);
                        acc[part] += sc[j] * w;
                    }
            memcpy(o + e0, acc, sizeof acc);
        }
        for (int e = e0; e < dh; e++) o[e] = 0.0f; /* the last values, fewer than 64 */
        if (e0 < dh)
            for (int j = 0; j < slots; j++)
                if (sc[j] != 0.0f && vs[j] != NULL)
                    for (int e = e0; e < dh; e++) o[e] += sc[j] * vs[j][e];
    }
#pragma omp for schedule(static)
    for (int r = 0; r < c->rows; r++) {
        store_key(L, C, c, &s, r);
        PREPARE_ROW(s.attn, A, r);
    }
    if (L->attn_out_norm == NULL) {
        PRODUCT(1, s.attn, x, D, A, 1); /* x += a W_out */
    } else {
        PRODUCT(1, s.attn, s.out, D, A, 0);
        add_normed(L->attn_out_norm, L->eps, s.out, x, c->rows, D);
    }
#pragma omp for schedule(static)
    for (int r = 0; r < c->rows; r++) {
        rms_norm_fixed(x + (size_t)r * D, L->norm2, s.h + (size_t)r * D, 1, D, L->eps);
        PREPARE_ROW(s.h, D, r);
    }
    PRODUCT(2, s.h, s.gate, F, D, 0);
    PRODUCT(3, s.h, s.up, F, D, 0);
#pragma omp for schedule(static)
    for (int r = 0; r < c->rows; r++) { /* the gate: a loop per kind, so that it runs in vectors */
        float *gate = s.gate + (size_t)r * F, *up = s.up + (size_t)r * F;
        if (L->activation == 1)
            for (int e = 0; e < F; e++) gate[e] = gelu_tanh_fixed(gate[e]) * up[e];
        else
            for (int e = 0; e < F; e++) gate[e] = silu_fixed(gate[e]) * up[e];
    }
#pragma omp for schedule(static)
    for (int r = 0; r < c->rows; r++) PREPARE_ROW(s.gate, F, r);
    if (L->ffn_out_norm == NULL) {
        PRODUCT(4, s.gate, x, D, F, 1); /* x += ... W_down */
    } else {
        PRODUCT(4, s.gate, s.out, D, F, 0);
        add_normed(L->ffn_out_norm, L->eps, s.out, x, c->rows, D);
    }
}

/* The forward of n_layers Llama-family layers for `tokens` new tokens in each of `batch` rows of
 * their caches, in one parallel region: x (batch * tokens, d_model), row b * tokens + t, is
 * updated in place, then normalised by the stack's final RMSNorm (norm, eps) unless norm is
 * NULL. Layer l's cache, caches[l], holds (batch, n_kv_heads, slots, d_head) keys and values
 * and (batch, slots) positions after `length` tokens: a KVCache (slots = its max_len; token t
 * goes to slot length + t) or a ring of the layer's window (slot index % window, each slot's
 * `valid` flag kept). mask (batch, length + tokens) flags the real tokens of the KVCache layers
 * and the new tokens of the rings; NULL: all real. positions (batch * tokens) are RoPE's. The
 * lengths are not advanced (the caller's cache objects count). Returns 0, -1 for arguments it
 * cannot take, -2 when out of memory. */
int packed_llama_forward(const LlamaLayer *layers, const LlamaCache *caches, int n_layers,
                         const float *norm, float eps, float *x, int batch, int tokens,
                         const int64_t *positions, const uint8_t *mask, int threads) {
    const int rows = batch * tokens;
    if (n_layers < 1 || batch < 1 || tokens < 1 || rows > MAX_ROWS || threads < 1) return -1;
    size_t per_row = 0;
    for (int l = 0; l < n_layers; l++) {
        const LlamaLayer *L = layers + l;
        const LlamaCache *C = caches + l;
        const int ring = L->window > 0;
        int tiles, blocks;
        if (layer_inputs(L, &tiles, &blocks) != 0 || C->length < 0 || L->d_model != layers->d_model ||
            (!ring && C->length + tokens > C->slots) ||
            (ring && (C->valid == NULL || C->slots != L->window)))
            return -1;
        const size_t need = layer_scratch(L, ring ? L->window : C->length + tokens);
        per_row = need > per_row ? need : per_row;
    }
    float *scratch = malloc(per_row * rows);
    if (scratch == NULL) return -2;
    const Call call = {batch, tokens, rows, positions, mask};
#pragma omp parallel num_threads(threads)
    {
        for (int l = 0; l < n_layers; l++) /* each layer ends on a barrier */
            layer_forward(layers + l, caches + l, x, &call, scratch);
        if (norm != NULL) {
#pragma omp single
            rms_norm_fixed(x, norm, x, rows, layers->d_model, eps);
        }
    }
    free(scratch);
    return 0;
}
