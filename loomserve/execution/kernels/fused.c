/* Fused elementwise kernels of a decoder layer: residual add + RMSNorm, RoPE on q and k in
 * place, SiLU(gate) * up. Each replaces 4-8 small torch kernels (each ~5-15 us on a CPU right
 * after a weight-streaming matmul) by one call that reads and writes each row once.
 *
 * Invariants:
 * - dtype 0 is fp32, 1 is bf16 (raw uint16 bits). Statistics and products are computed in fp32.
 * - bf16 results round where the torch reference rounds (round to nearest even after each op
 *   the reference runs in bf16), so bf16 outputs equal torch's bit for bit except where expf
 *   differs by an ulp. fp32 differs from torch only in summation order and FMA contraction.
 * - Rows are independent: OpenMP splits rows, only when there is enough work to pay for it (a
 *   parallel region, even an if(0) one, sets up a team: ~0.5 us, as much as a decode row's work).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half_float.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PAR_MIN_ELEMS 32768L /* below this a parallel region costs more than it saves */
#define MAX_HEAD_DIM 1024

static inline float round_bf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static void load_row(const void *src, int dtype, long d, float *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)d * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (long i = 0; i < d; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static void store_row(const float *src, int dtype, long d, void *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)d * sizeof(float));
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (long i = 0; i < d; i++) o[i] = f32_to_bf16(src[i]);
    }
}

/* ---- RMSNorm, optionally after a residual add -------------------------------------------- */

enum { NORM_SCALE_FP32 = 1, NORM_ZERO_CENTERED = 2 };

/* One row: s = x (+ residual, rounded to the dtype and stored to sum), then
 * out = norm(s) * w with the cast order of the variant (see layers/norm.py). */
static void norm_row(const void *x, const void *res, void *sum, const void *w, void *out, long d,
                     float eps, int dtype, int flags, float *h, float *wf) {
    load_row(x, dtype, d, h);
    if (res) {
        load_row(res, dtype, d, wf);
        for (long i = 0; i < d; i++) h[i] += wf[i];
        if (dtype == 1)
            for (long i = 0; i < d; i++) h[i] = round_bf(h[i]);
        store_row(h, dtype, d, sum);
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < d; i++) ss += h[i] * h[i];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    load_row(w, dtype, d, wf);
    if (flags & NORM_ZERO_CENTERED)
        for (long i = 0; i < d; i++) wf[i] = 1.0f + wf[i];
    if (dtype == 1 && !(flags & NORM_SCALE_FP32)) /* Llama: cast the normalized row, then scale */
        for (long i = 0; i < d; i++) h[i] = wf[i] * round_bf(h[i] * r);
    else
        for (long i = 0; i < d; i++) h[i] = (h[i] * r) * wf[i];
    store_row(h, dtype, d, out);
}

/* x: [n, d] with row stride x_stride (elements); residual: NULL or [n, d] contiguous, then
 * x + residual is stored to sum ([n, d] contiguous; may be x itself, each row is read before
 * it is written); out: [n, d] contiguous; w: [d]. */
static void norm_token(const void *x, long x_stride, const void *residual, void *sum, const void *w, void *out,
                       long t, long d, float eps, int dtype, int flags) {
    const size_t es = dtype == 0 ? 4 : 2;
    float h[d], wf[d];
    norm_row((const char *)x + t * x_stride * es, residual ? (const char *)residual + t * d * es : NULL,
             (char *)sum + t * d * es, w, (char *)out + t * d * es, d, eps, dtype, flags, h, wf);
}

void rms_norm(const void *x, long x_stride, const void *residual, void *sum, const void *w, void *out,
              long n, long d, float eps, int dtype, int flags, int num_threads) {
    if (num_threads <= 1 || n * d < PAR_MIN_ELEMS) {
        for (long t = 0; t < n; t++) norm_token(x, x_stride, residual, sum, w, out, t, d, eps, dtype, flags);
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (long t = 0; t < n; t++) norm_token(x, x_stride, residual, sum, w, out, t, d, eps, dtype, flags);
    }
}

/* ---- RoPE on the q and k heads of a fused qkv row, in place -------------------------------- */

/* qkv: [n, *] with token stride `stride`; heads 0..heads-1 (q then k) of head_dim d are rotated:
 * x' = x * cos + roll(x, d/2) * sin, sin carrying rotate_half's sign (layers/rotary.py).
 * cos, sin: [n, d] contiguous, the step's gathered rows. wq, wk: NULL, or the per-head RMSNorm
 * weights ([d]) applied to each head first (Qwen3, Gemma 3: q heads 0..hq-1 with wq, the rest
 * with wk), with the norm's flags and eps, the normalized head rounded to the dtype as torch
 * hands it to the rotation. */
static void rope_token(void *qkv, long stride, long t, long heads, long d, const void *cos, const void *sin,
                       const void *wq, const void *wk, long hq, float eps, int flags, int dtype) {
    const long half = d / 2;
    const size_t es = dtype == 0 ? 4 : 2;
    float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], x[MAX_HEAD_DIM], y[MAX_HEAD_DIM];
    load_row((const char *)cos + t * d * es, dtype, d, c);
    load_row((const char *)sin + t * d * es, dtype, d, s);
    for (long j = 0; j < heads; j++) {
        char *p = (char *)qkv + (t * stride + j * d) * es;
        if (wq) /* in place: the row is read whole before it is written */
            norm_row(p, NULL, NULL, j < hq ? wq : wk, p, d, eps, dtype, flags, x, y);
        load_row(p, dtype, d, x);
        if (dtype == 0) {
            for (long i = 0; i < half; i++) y[i] = x[i] * c[i] + x[i + half] * s[i];
            for (long i = half; i < d; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
        } else { /* two bf16 products and a bf16 sum, as torch rounds them */
            for (long i = 0; i < half; i++) y[i] = round_bf(x[i] * c[i]) + round_bf(x[i + half] * s[i]);
            for (long i = half; i < d; i++) y[i] = round_bf(x[i] * c[i]) + round_bf(x[i - half] * s[i]);
        }
        store_row(y, dtype, d, p);
    }
}

void rope_inplace(void *qkv, long stride, long n, long heads, long d, const void *cos, const void *sin,
                  const void *wq, const void *wk, long hq, float eps, int flags, int dtype, int num_threads) {
    if (num_threads <= 1 || n * heads * d < PAR_MIN_ELEMS) {
        for (long t = 0; t < n; t++) rope_token(qkv, stride, t, heads, d, cos, sin, wq, wk, hq, eps, flags, dtype);
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (long t = 0; t < n; t++) rope_token(qkv, stride, t, heads, d, cos, sin, wq, wk, hq, eps, flags, dtype);
    }
}

/* ---- SiLU(gate) * up ------------------------------------------------------------------------ */

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x in [-87.3, 88.7]: 2^k * p(r), r = x - k ln2 in [-ln2/2, ln2/2], degree-6
 * polynomial (Cephes' coefficients); within 2 ulp of expf. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* One row of `m` outputs: out[i] = silu(g[i]) * u[i] from fp32 inputs; in bf16 silu's result is
 * rounded before the product, as torch's two bf16 kernels do (the store rounds the product). */
static void silu_mul_row(const float *g, const float *u, float *o, long m, int dtype) {
    long i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= m; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(o + i, _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
    }
#endif
    for (; i < m; i++) o[i] = g[i] / (1.0f + expf(-g[i]));
    if (dtype == 1)
        for (i = 0; i < m; i++) o[i] = round_bf(o[i]);
    for (i = 0; i < m; i++) o[i] *= u[i];
}

/* gate_up: [n, 2m] rows [gate | up] (row stride `stride` elements); out: [n, m] contiguous. */
static void silu_token(const void *gate_up, long stride, void *out, long t, long m, int dtype) {
    if (dtype == 0) {
        const float *row = (const float *)gate_up + t * stride;
        silu_mul_row(row, row + m, (float *)out + t * m, m, 0);
    } else {
        const long chunk = 512;
        float g[512], u[512], o[512];
        const uint16_t *row = (const uint16_t *)gate_up + t * stride;
        for (long a = 0; a < m; a += chunk) {
            long len = m - a < chunk ? m - a : chunk;
            load_row(row + a, 1, len, g);
            load_row(row + m + a, 1, len, u);
            silu_mul_row(g, u, o, len, 1);
            store_row(o, 1, len, (uint16_t *)out + t * m + a);
        }
    }
}

void silu_and_mul(const void *gate_up, long stride, void *out, long n, long m, int dtype, int num_threads) {
    if (num_threads <= 1 || n * m < PAR_MIN_ELEMS) {
        for (long t = 0; t < n; t++) silu_token(gate_up, stride, out, t, m, dtype);
    } else {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (long t = 0; t < n; t++) silu_token(gate_up, stride, out, t, m, dtype);
    }
}

int fused_abi_version(void) { return 1; }
