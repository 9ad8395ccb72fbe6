/* Dense matrix products for few rows: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 out.
 *
 * A decode step multiplies one row per running sequence by every weight matrix, so with few
 * sequences the product is a streaming read of W and its speed is the read bandwidth. On the
 * 2-core AMD benchmark VM torch's fp32 GEMM (MKL) reads a [49152, 128] LM head at ~4 GB/s for
 * one row and bf16 (no AVX-512-BF16) at ~7 GB/s, against ~12 GB/s per core that a plain
 * streaming read reaches; this kernel walks W row by row, each thread one contiguous range of
 * rows, so the hardware prefetchers see long sequential streams.
 *
 * W rows are [N, K] contiguous (torch's nn.Linear layout), fp32 (dtype 0) or bf16 (dtype 1,
 * widened exactly to fp32 in registers); x and out fp32, bias fp32 or NULL. Each weight row is
 * loaded once per 4 input rows (from L1 again for the next 4), fp32 accumulation.
 *
 * Each weight row's first pass also prefetches the row PF_LEAD bytes ahead into L2: a 4 KB page
 * of weights is one to eight rows, and the hardware prefetchers restart at every page. On the
 * 2-vCPU Intel Xeon VM a [49152, 128] fp32 LM head read after 67 MB of other traffic took 1.14
 * -> 0.91 ms (torch's plain sum of it: 0.92), bf16 0.64-0.77 -> 0.34-0.47, 4 rows 1.9 -> 1.3.
 * Into L1 instead: 1.00; every other line: 1.05. Matrices under PF_MIN_BYTES skip it (they stay
 * in cache, where it would only cost instructions).
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"

#define PF_LEAD 16384
#define PF_MIN_BYTES (256 << 10)

static inline float w_at(const void *w, int dtype, int64_t i) {
    return dtype ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Rows [n0, n1) of out for all M input rows, portable. */
static void tile_any(const float *x, int64_t K, const void *w, int dtype, int64_t n0, int64_t n1,
                     int64_t M, float *acc_out, int64_t N) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += x[m * K + k] * w_at(w, dtype, n * K + k);
            acc_out[m * N + n] = s;
        }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load_w8(const void *w, int dtype, int64_t i) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)w + i);
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* [sum(a[0]), ..., sum(a[7])] */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One weight row against input rows [m, m + MB), MB <= 4: per input row two accumulators over
 * K16 (16 lanes a step, the weight loaded once for all rows), summed into v[i]. */
static inline __attribute__((always_inline)) void row_dot(
        const float *x, int64_t m, int MB, int64_t K, int64_t K16, const void *w, int dtype,
        int64_t n, __m256 *v) {
    __m256 a[4][2];
    for (int i = 0; i < MB; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
        __m256 w0 = load_w8(w, dtype, n * K + k), w1 = load_w8(w, dtype, n * K + k + 8);
        for (int i = 0; i < MB; i++) {
            const float *xi = x + (m + i) * K + k;
            a[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a[i][0]);
            a[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a[i][1]);
        }
    }
    for (int i = 0; i < MB; i++) v[i] = _mm256_add_ps(a[i][0], a[i][1]);
}

/* Weight rows [n, n + 8) for input rows [m, m + MB). Weight rows are read one after another
 * (one sequential stream per thread: tiles of several rows read side by side were ~30% slower
 * here); the 8 rows' partial vectors are reduced at once per input row. */
static inline __attribute__((always_inline)) void tile_mb(
        const float *x, int64_t m, int MB, int64_t K, const void *w, int dtype, int64_t n,
        float *out, int64_t N, int pf) {
    const int64_t K16 = K & ~(int64_t)15, rb = K * (dtype ? 2 : 4);
    float s[8];
    __m256 v[4][8], t[4];
    for (int r = 0; r < 8; r++) {
        if (pf) {  /* prefetches never fault, so past W's end is harmless */
            const char *p = (const char *)w + (n + r) * rb + PF_LEAD;
            for (int64_t o = 0; o < rb; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        }
        row_dot(x, m, MB, K, K16, w, dtype, n + r, t);
        for (int i = 0; i < MB; i++) v[i][r] = t[i];
    }
    for (int i = 0; i < MB; i++) {
        _mm256_storeu_ps(s, hsum8x8(v[i]));
        for (int r = 0; r < 8; r++) {
            float o = s[r];
            for (int64_t k = K16; k < K; k++) o += x[(m + i) * K + k] * w_at(w, dtype, (n + r) * K + k);
            out[(m + i) * N + n + r] = o;
        }
    }
}

/* Copies with the row count and weight dtype constant, so accumulators stay in registers. */
#define TILE(MB, DT)                                                                          \
    static void tile_##MB##_##DT(const float *x, int64_t m, int64_t K, const void *w,          \
                                 int64_t n, float *out, int64_t N, int pf) {                  \
        tile_mb(x, m, MB, K, w, DT, n, out, N, pf);                                            \
    }
TILE(1, 0) TILE(2, 0) TILE(3, 0) TILE(4, 0) TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)

/* Rows [n0, n1) (n1 - n0 a multiple of 8) for all M input rows: per 8-row weight tile (in L1
 * after its first use), every group of 4 input rows, so the weights stream from memory once. */
static void rows_avx2(const float *x, int64_t M, int64_t K, const void *w, int dtype,
                      int64_t n0, int64_t n1, float *out, int64_t N) {
    typedef void (*fn)(const float *, int64_t, int64_t, const void *, int64_t, float *, int64_t,
                       int);
    static const fn table[2][4] = {{tile_1_0, tile_2_0, tile_3_0, tile_4_0},
                                   {tile_1_1, tile_2_1, tile_3_1, tile_4_1}};
    const fn *t = table[dtype != 0];
    const int pf = N * K * (dtype ? 2 : 4) >= PF_MIN_BYTES;
    for (int64_t n = n0; n < n1; n += 8)
        for (int64_t m = 0; m < M; m += 4)
            t[(M - m < 4 ? M - m : 4) - 1](x, m, K, w, n, out, N, pf && m == 0);
}
#endif

/* One thread's share: rows [n0, n1) of out. */
static void rows(const float *x, int64_t M, int64_t K, const void *w, int dtype, int64_t n0,
                 int64_t n1, float *out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
    int64_t n4 = n0 + ((n1 - n0) & ~(int64_t)7);
    rows_avx2(x, M, K, w, dtype, n0, n4, out, N);
    n0 = n4;
#endif
    tile_any(x, K, w, dtype, n0, n1, M, out, N);
}

/* out[M, N] = x[M, K] @ W[N, K]^T (+ bias). Each of nthreads threads takes one contiguous
 * range of rows (a multiple of 16, so ranges start on whole cache lines for fp32 and bf16).
 * nthreads 1 runs without an OpenMP region. */
void dense_matmul(const float *x, int64_t M, int64_t K, const void *w, int dtype,
                  const float *bias, float *out, int64_t N, int nthreads) {
    if (nthreads <= 1) {
        rows(x, M, K, w, dtype, 0, N, out, N);
    } else {
        int64_t per = ((N + nthreads - 1) / nthreads + 15) & ~(int64_t)15;
#pragma omp parallel num_threads(nthreads)
        {
            int t = 0;
#ifdef _OPENMP
            extern int omp_get_thread_num(void);
            t = omp_get_thread_num();
#endif
            int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
            if (n0 < n1) rows(x, M, K, w, dtype, n0, n1, out, N);
        }
    }
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) out[m * N + n] += bias[n];
}
