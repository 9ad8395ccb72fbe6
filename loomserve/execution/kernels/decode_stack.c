/* A Llama-family decoder stack for a step of decode rows, in one call: per layer RMSNorm,
 * q|k|v product, RoPE, the new K/V rows into their slots, paged attention, o product, residual
 * add + RMSNorm, gate|up product, SiLU * up, down product.
 *
 * It runs the same kernels the Python layer calls (quant.c or dense.c, fused.c, paged_attention.c, passed
 * in as function pointers from their own libraries), in the same order on the same buffers, so
 * its outputs equal the Python path's bit for bit; what it removes is ~150 us of Python per
 * layer around those calls (models/llama_decode.py says when it applies).
 *
 * Residual stream as DecoderLayer.forward_residual: layer 0 normalizes x and keeps x as the
 * residual; layer l > 0 adds its input (the previous down product) to the residual in the same
 * call as the norm. On return `res` holds the residual and `x` the last layer's down product;
 * the caller's final norm adds them.
 */
#include <stdint.h>
#include <string.h>

#include "fp8.h"
#include "half_float.h"

typedef void (*quant_matmul_fn)(const float *x, int64_t M, int64_t K, const uint8_t *w, int has_mins,
                                int64_t N, int bits, const float *bias, float *y, int nthreads);
typedef void (*rms_norm_fn)(const void *x, long x_stride, const void *residual, void *sum,
                            const void *w, void *out, long n, long d, float eps, int dtype,
                            int flags, int num_threads);
typedef void (*rope_fn)(void *qkv, long stride, long n, long heads, long d, const void *cos,
                        const void *sin, const void *wq, const void *wk, long hq, float eps,
                        int flags, int dtype, int num_threads);
typedef void (*silu_fn)(const void *gate_up, long stride, void *out, long n, long m, int dtype,
                        int num_threads);
typedef int (*decode_fn)(const float *q, const void *k_base, const void *v_base,
                         int64_t block_stride, int block_size, int kv_heads, int head_dim,
                         int heads, int num_seqs, const int32_t *const *tables,
                         const int32_t *seq_lens, int window, const float *sinks, float scale,
                         float *out, float *scratch, int max_splits, int split_tokens, int dtype,
                         int nthreads);

typedef void (*dense_matmul_fn)(const float *x, int64_t M, int64_t K, const void *w, int dtype,
                                const float *bias, float *out, int64_t N, int nthreads);

typedef struct {  /* one product: quantized (layers/quant.py's tiled weight) or dense (layers/dense.py) */
    const void *w;
    const float *bias;
    int64_t n, k;
    int32_t bits, has_mins;      /* quantized */
    int32_t dense, dtype, threads;  /* dense: 1, its weight dtype code and thread count */
} Lin;

typedef struct {
    const float *norm1, *norm2;  /* input and post-attention RMSNorm weights */
    Lin qkv, o, gate_up, down;
    const float *q_norm, *k_norm;  /* per-head RMSNorm weights before RoPE (Qwen3), or NULL */
    void *k_cache, *v_cache;     /* [blocks, block_size, kv_heads, head_dim] views, same strides */
    int64_t block_stride;        /* elements between blocks */
    int32_t group, norm_flags;   /* the layer's KV group (index into plans); RMSNorm variant */
    int32_t qk_flags;            /* the head norms' variant */
    float qk_eps;
    int32_t kv_dtype;            /* paged_attention.c's code: 0 fp32, 2 bf16, 3 fp16, 4 e4m3, 5 e5m2 */
} Layer;

typedef struct {  /* a KV group's decode plan (attention/cpu_backend.py: _plan) */
    const int32_t *const *tables;
    const int32_t *lens;
    const int64_t *slot_blocks, *slot_offsets;  /* [M] where each row's K/V goes in this group */
    int32_t window, split, max_splits, threads;
} Plan;

typedef struct {
    quant_matmul_fn matmul;
    dense_matmul_fn dense;
    rms_norm_fn norm;
    rope_fn rope;
    silu_fn silu;
    decode_fn attend;
    int32_t heads, kv_heads, head_dim, hidden, inter, block_size;
    float eps, scale;
} Model;

typedef struct {  /* the step's buffers, fp32, M rows each (sizes in the Python caller) */
    float *h, *qkv, *q, *attn, *gate_up, *act, *scratch;
} Work;

int decode_stack_abi(void) { return 3; }

/* n values through f32_to_f16 (tests check it against torch's rounding). */
void decode_stack_to_f16(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_f16(x[i]);
}

/* n values through f32_to_e4m3 (e5m2: 0) or f32_to_e5m2 (1), checked the same way. */
void decode_stack_to_f8(const float *x, uint8_t *out, int64_t n, int e5m2) {
    for (int64_t i = 0; i < n; i++) out[i] = e5m2 ? f32_to_e5m2(x[i]) : f32_to_e4m3(x[i]);
}

/* One token's K or V row (kvs values) into its slot of a cache of `dtype` (paged_attention.c's
 * code: 0 fp32, 2 bf16, 3 fp16, 4 e4m3, 5 e5m2; 8-bit stores saturate, as kv_dtype.to_cache). */
static void store_row(void *cache, int64_t at, const float *src, int64_t kvs, int dtype) {
    if (dtype == 0) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)kvs);
        return;
    }
    if (dtype >= 4) {
        uint8_t *d8 = (uint8_t *)cache + at;
        for (int64_t j = 0; j < kvs; j++) d8[j] = dtype == 4 ? f32_to_e4m3(src[j]) : f32_to_e5m2(src[j]);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    if (dtype == 3)
        for (int64_t j = 0; j < kvs; j++) dst[j] = f32_to_f16(src[j]);
    else
        for (int64_t j = 0; j < kvs; j++) dst[j] = f32_to_bf16(src[j]);
}

/* y[M, n] = x[M, k] @ W^T (+ bias), with the kernel and threads the Python layer would use. */
static void product(const Model *m, const Lin *p, const float *x, int M, float *y, int nthreads) {
    if (p->dense)
        m->dense(x, M, p->k, p->w, p->dtype, p->bias, y, p->n, p->threads);
    else
        m->matmul(x, M, p->k, p->w, p->has_mins, p->n, p->bits, p->bias, y, nthreads);
}

/* x: [M, hidden] embeddings in, last down product out; res: [M, hidden] residual out.
 * cos, sin: [M, head_dim]. Returns 0, or the paged kernel's error (-1: sizes past its limits,
 * which the caller rules out beforehand; the outputs are then not to be used). */
int decode_stack(const Model *m, const Layer *layers, int nlayers, const Plan *plans, float *x,
                 float *res, int M, const float *cos, const float *sin, const Work *w, int nthreads) {
    const int64_t H = m->hidden, hd = m->head_dim, qs = (int64_t)m->heads * hd;
    const int64_t kvs = (int64_t)m->kv_heads * hd, row = qs + 2 * kvs;
    for (int l = 0; l < nlayers; l++) {
        const Layer *L = &layers[l];
        const Plan *p = &plans[L->group];
        if (l == 0) {
            memcpy(res, x, sizeof(float) * (size_t)(M * H));
            m->norm(x, H, NULL, x, L->norm1, w->h, M, H, m->eps, 0, L->norm_flags, nthreads);
        } else {
            m->norm(x, H, res, res, L->norm1, w->h, M, H, m->eps, 0, L->norm_flags, nthreads);
        }
        product(m, &L->qkv, w->h, M, w->qkv, nthreads);
        m->rope(w->qkv, row, M, m->heads + m->kv_heads, hd, cos, sin, L->q_norm, L->k_norm,
                L->q_norm ? m->heads : 0, L->qk_eps, L->qk_flags, 0, nthreads);
        for (int i = 0; i < M; i++) {
            const float *r = w->qkv + i * row;
            const int64_t at = p->slot_blocks[i] * L->block_stride + p->slot_offsets[i] * kvs;
            store_row(L->k_cache, at, r + qs, kvs, L->kv_dtype);
            store_row(L->v_cache, at, r + qs + kvs, kvs, L->kv_dtype);
            memcpy(w->q + i * qs, r, sizeof(float) * (size_t)qs);
        }
        int rc = m->attend(w->q, L->k_cache, L->v_cache, L->block_stride, m->block_size, m->kv_heads,
                           m->head_dim, m->heads, M, p->tables, p->lens, p->window, NULL, m->scale,
                           w->attn, w->scratch, p->max_splits, p->split, L->kv_dtype, p->threads);
        if (rc != 0) return rc;
        product(m, &L->o, w->attn, M, x, nthreads);
        m->norm(x, H, res, res, L->norm2, w->h, M, H, m->eps, 0, L->norm_flags, nthreads);
        product(m, &L->gate_up, w->h, M, w->gate_up, nthreads);
        m->silu(w->gate_up, 2 * (int64_t)m->inter, w->act, M, m->inter, 0, nthreads);
        product(m, &L->down, w->act, M, x, nthreads);
    }
    return 0;
}
