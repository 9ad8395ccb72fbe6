/* Quantized-weight matrix products for the CPU: y[M,N] = x[M,K] @ W^T (+ bias), W never
 * dequantized to floats.
 *
 * Weight format (loomserve/execution/layers/quant.py): groups of G=32 along K; value
 * w[n,k] = s[n,g] * q[n,k] + m[n,g] (m optional), s and m fp16 [N, K/32].
 *   bits=4: q in 0..15, 16 bytes per group, GGUF Q4_0 nibble order (byte j: q[j] | q[j+16] << 4).
 *   bits=8: q int8, 32 bytes per group.
 * The llama.cpp way: each row of x is quantized once per call to int8 per 32-block
 * (dx = max|x| / 127, xq = round(x / dx)); then per group an integer dot product,
 * y = sum_g s*dx*dot(q, xq) + m*dx*sum(xq). Error: the weights' own rounding plus x's int8
 * rounding (relative ~0.4% of each block's max |x|).
 *
 * Memory traffic: OpenMP splits N into tiles of 4 weight rows; each tile is read from memory
 * once and every x row is multiplied with it from L1 (x, K bytes per row, stays in L2; rows
 * come in chunks of 64 so a long prefill's x does not overflow it). int4 tiles are unpacked
 * to bytes once per tile when M > 1, so the unpacking is not repeated per x row. With AVX2,
 * int4 (and int8 at M > 1) runs two groups per step (tile_dot_p, see pair_x).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* The vector paths need AVX2 and F16C (every AVX2 CPU has both); else the portable C runs. */
#if defined(__AVX2__) && defined(__F16C__)
#define QAVX2 1
#include <immintrin.h>
#else
#define QAVX2 0
#endif
/* AVX-512 VNNI (with VL, for 256-bit registers: Zen 4, Ice Lake and later Xeons): vpdpbusd does
 * maddubs + madd (+ the int32 add) in one instruction and never saturates; the int32 sums, and
 * so every output, are bit for bit those of the AVX2 sequence (whose int16 sums cannot
 * saturate here, see tile_dot_pairs). -DQUANT_NO_VNNI builds the AVX2 sequence anyway (an A/B). */
#if QAVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(QUANT_NO_VNNI)
#define QVNNI 1
#else
#define QVNNI 0
#endif

#define QK 32
#define NR 4
#define MC 64
#define SMALL_WORK (1 << 17)  /* multiply-adds: below, one thread (a 192x576 matrix at one row) */

static inline float fp16_to_fp32(uint16_t h) {
#if QAVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* x row -> int8 per 32-block; dx[b] the block scale, dxs[b] = dx[b] * sum(xq) (mins term). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, float *dxs) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) {  /* not fmaxf: without -ffast-math it is a call per element */
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * id);
            xq[b * QK + j] = (int8_t)v;
            sum += v;
        }
        dx[b] = d;
        dxs[b] = d * (float)sum;
    }
}

/* Weight-row kinds: packed int4 (16 B/group), unpacked int4 as bytes (32 B), int8 (32 B). */
enum { PACKED4 = 0, BYTES4 = 1, INT8 = 2 };

static void unpack4(const uint8_t *p, int64_t nb, uint8_t *out) {
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < 16; j++) {
            out[b * QK + j] = p[b * 16 + j] & 0x0f;
            out[b * QK + j + 16] = p[b * 16 + j] >> 4;
        }
}

#if QAVX2
static inline __m256i load_w(int kind, const uint8_t *w, int64_t b) {
    if (kind == PACKED4) {
        __m128i p = _mm_loadu_si128((const __m128i *)(w + b * 16));
        __m256i v = _mm256_set_m128i(_mm_srli_epi16(p, 4), p);
        return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
    }
    return _mm256_loadu_si256((const __m256i *)(w + b * QK));
}

/* 8 int32 partial sums of w . x as floats; int4 is unsigned (maddubs takes it directly),
 * int8 is signed: |w| times x with w's sign, as llama.cpp does (max 2*128*127 < 2^15). */
static inline __m256 dot32(int kind, __m256i w, __m256i x) {
    if (kind == INT8) {
        x = _mm256_sign_epi8(x, w);
        w = _mm256_sign_epi8(w, w);
    }
#if QVNNI
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* int32 lanes of u8 a . s8 x plus u8 b . s8 y, 4 bytes per lane (the caller keeps every int16
 * pair sum of the AVX2 path within range). */
static inline __m256i dot_two(__m256i a, __m256i x, __m256i b, __m256i y) {
#if QVNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, x), b, y);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, x), _mm256_maddubs_epi16(b, y)),
                             _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* out[r] = sum_b sf[r][b] * dx[b] * dot(w[r] block b, xq block b), r < NR. */
static inline __attribute__((always_inline)) void tile_dot(
        int kind, const uint8_t *const *w, const int8_t *xq, const float *dx, int64_t nb,
        const float *sf, float *out) {
#if QAVX2
    __m256 acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        for (int r = 0; r < NR; r++) {
            __m256 p = dot32(kind, load_w(kind, w[r], b), xv);
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(sf[r * nb + b] * dx[b]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum(acc[r]);
#else
    for (int r = 0; r < NR; r++) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t s = 0;
            for (int j = 0; j < QK; j++) {
                int q;
                if (kind == PACKED4)
                    q = j < 16 ? (w[r][b * 16 + j] & 0x0f) : (w[r][b * 16 + j - 16] >> 4);
                else if (kind == BYTES4)
                    q = w[r][b * QK + j];
                else
                    q = ((const int8_t *)w[r])[b * QK + j];
                s += q * xq[b * QK + j];
            }
            acc += sf[r * nb + b] * dx[b] * (float)s;
        }
        out[r] = acc;
    }
#endif
}

static void tile_dot_kind(int kind, const uint8_t *const *w, const int8_t *xq, const float *dx,
                          int64_t nb, const float *sf, float *out) {
    switch (kind) {  /* constant kinds: each call below is specialized by the compiler */
        case PACKED4: tile_dot(PACKED4, w, xq, dx, nb, sf, out); break;
        case BYTES4: tile_dot(BYTES4, w, xq, dx, nb, sf, out); break;
        default: tile_dot(INT8, w, xq, dx, nb, sf, out); break;
    }
}

#if QAVX2
/* int4 in group pairs: the packed bytes of groups 2p and 2p+1 are 32 contiguous bytes whose low
 * nibbles are q[0..15] of both groups and high nibbles q[16..31]. x is laid out to match
 * (pair_x: [x_2p[0:16], x_2p+1[0:16], x_2p[16:32], x_2p+1[16:32]]), so one 32-byte load serves
 * two groups without lane shuffles, two maddubs share one madd/convert/FMA, and the scales come
 * as vectors ([s_2p x4, s_2p+1 x4] times the same of dx): about half the instructions per group
 * of the one-group loop. An odd last group goes through the one-group path. */
static void pair_x(const int8_t *xq, const float *dx, int64_t nb, int8_t *x2, float *dxv) {
    for (int64_t p = 0; p < nb / 2; p++) {
        const int8_t *a = xq + 2 * p * QK, *b = a + QK;
        int8_t *o = x2 + p * 64;
        memcpy(o, a, 16);
        memcpy(o + 16, b, 16);
        memcpy(o + 32, a + 16, 16);
        memcpy(o + 48, b + 16, 16);
        for (int i = 0; i < 4; i++) {
            dxv[p * 8 + i] = dx[2 * p];
            dxv[p * 8 + 4 + i] = dx[2 * p + 1];
        }
    }
}

/* A packed int4 row -> bytes in pair order (64 bytes per pair: low nibbles, high nibbles), an
 * odd last group unpacked in natural order after them. */
static void expand_pairs(const uint8_t *w, int64_t nb, uint8_t *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + p * 32));
        _mm256_storeu_si256((__m256i *)(out + p * 64), _mm256_and_si256(v, m4));
        _mm256_storeu_si256((__m256i *)(out + p * 64 + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    }
    if (nb & 1) unpack4(w + np * 32, 1, out + np * 64);
}

/* An int8 row -> pair order for the M > 1 loop, 128 bytes per pair: |w| low halves, |w| high
 * halves, w low halves, w high halves (the sign trick needs both; |w| is made once per tile
 * instead of once per x row). An odd last group follows in natural order. */
static void expand_pairs8(const uint8_t *w, int64_t nb, uint8_t *out) {
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(w + p * 64));
        __m256i b = _mm256_loadu_si256((const __m256i *)(w + p * 64 + 32));
        __m256i lo = _mm256_permute2x128_si256(a, b, 0x20), hi = _mm256_permute2x128_si256(a, b, 0x31);
        _mm256_storeu_si256((__m256i *)(out + p * 128), _mm256_sign_epi8(lo, lo));
        _mm256_storeu_si256((__m256i *)(out + p * 128 + 32), _mm256_sign_epi8(hi, hi));
        _mm256_storeu_si256((__m256i *)(out + p * 128 + 64), lo);
        _mm256_storeu_si256((__m256i *)(out + p * 128 + 96), hi);
    }
    if (nb & 1) memcpy(out + np * 128, w + np * 64, QK);
}

enum { P_PACKED4 = 0, P_BYTES4 = 1, P_INT8 = 2 };

static inline __attribute__((always_inline)) void tile_dot_pairs(
        int kind, const uint8_t *const *w, const int8_t *x2, const float *dxv, int64_t np,
        const float *sfv, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    (void)ones;  /* unused with VNNI */
    for (int64_t p = 0; p < np; p++) {
        __m256i xlo = _mm256_loadu_si256((const __m256i *)(x2 + p * 64));
        __m256i xhi = _mm256_loadu_si256((const __m256i *)(x2 + p * 64 + 32));
        __m256 dv = _mm256_loadu_ps(dxv + p * 8);
        for (int r = 0; r < NR; r++) {
            __m256i lo, hi, i32;
            if (kind == P_INT8) {  /* |w| times x with w's sign; int16 sums up to 2*128*127: no add */
                const uint8_t *b = w[r] + p * 128;
                __m256i slo = _mm256_sign_epi8(xlo, _mm256_loadu_si256((const __m256i *)(b + 64)));
                __m256i shi = _mm256_sign_epi8(xhi, _mm256_loadu_si256((const __m256i *)(b + 96)));
#if QVNNI
                i32 = dot_two(_mm256_loadu_si256((const __m256i *)b), slo,
                              _mm256_loadu_si256((const __m256i *)(b + 32)), shi);
#else
                i32 = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)b), slo), ones),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(b + 32)), shi), ones));
#endif
            } else {
                if (kind == P_PACKED4) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + p * 32));
                    lo = _mm256_and_si256(v, m4);
                    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                } else {
                    lo = _mm256_loadu_si256((const __m256i *)(w[r] + p * 64));
                    hi = _mm256_loadu_si256((const __m256i *)(w[r] + p * 64 + 32));
                }
                /* each maddubs pair sum <= 2 * 15 * 127, so two add in int16 without saturating */
                i32 = dot_two(lo, xlo, hi, xhi);
            }
            __m256 f = _mm256_cvtepi32_ps(i32);
            acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(_mm256_loadu_ps(sfv + (r * np + p) * 8), dv), acc[r]);
        }
    }
}

static void tile_dot_p(int kind, const uint8_t *const *w, const int8_t *x2, const float *dxv,
                       const int8_t *xq, const float *dx, int64_t nb, const float *sf,
                       const float *sfv, float *out) {
    const int64_t np = nb / 2;
    __m256 acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    if (kind == P_PACKED4)
        tile_dot_pairs(P_PACKED4, w, x2, dxv, np, sfv, acc);
    else if (kind == P_BYTES4)
        tile_dot_pairs(P_BYTES4, w, x2, dxv, np, sfv, acc);
    else
        tile_dot_pairs(P_INT8, w, x2, dxv, np, sfv, acc);
    if (nb & 1) {
        const int64_t b = nb - 1;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        for (int r = 0; r < NR; r++) {
            __m256 d;
            if (kind == P_PACKED4)
                d = dot32(BYTES4, load_w(PACKED4, w[r], b), xv);
            else if (kind == P_BYTES4)
                d = dot32(BYTES4, _mm256_loadu_si256((const __m256i *)(w[r] + np * 64)), xv);
            else
                d = dot32(INT8, _mm256_loadu_si256((const __m256i *)(w[r] + np * 128)), xv);
            acc[r] = _mm256_fmadd_ps(d, _mm256_set1_ps(sf[r * nb + b] * dx[b]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum(acc[r]);
}
#endif

/* Per-row setup, vectorized: at one x row it runs once per weight row, as often as the dot
 * product itself, so scalar conversions here would cost as much as the product. */
static void scales_row(const uint16_t *h, int64_t nb, float *out) {
    int64_t b = 0;
#if QAVX2
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(out + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))));
#endif
    for (; b < nb; b++) out[b] = fp16_to_fp32(h[b]);
}

/* sum_b mins[b] * dxs[b] (the mins term of one output), mins fp16. */
static inline float mins_dot(const uint16_t *mn, const float *dxs, int64_t nb) {
    int64_t b = 0;
    float v = 0.f;
#if QAVX2
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + b))),
                              _mm256_loadu_ps(dxs + b), acc);
    v = hsum(acc);
#endif
    for (; b < nb; b++) v += fp16_to_fp32(mn[b]) * dxs[b];
    return v;
}

void quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint16_t *s,
                  const uint16_t *mins, int64_t N, int bits, const float *bias, float *y,
                  int nthreads) {
    const int64_t nb = K / QK, np = nb / 2, row_bytes = bits == 4 ? K / 2 : K, ntiles = (N + NR - 1) / NR;
#if QAVX2
    const int pairs = bits == 4 || M > 1;  /* int8 at one row: the plain loop is memory-bound */
#else
    const int pairs = 0;
#endif
    const int64_t wstride = bits == 4 ? K : 2 * K;  /* bytes per expanded row */
    int8_t *xq = malloc((size_t)(M * K)), *x2 = pairs ? malloc((size_t)(M * K)) : NULL;
    float *dx = malloc(sizeof(float) * (size_t)(M * nb)), *dxs = malloc(sizeof(float) * (size_t)(M * nb));
    float *dxv = pairs ? malloc(sizeof(float) * (size_t)(M * (np * 8 + 1))) : NULL;
    /* Small products run on the calling thread: a team's fork and join costs as much as the
     * work. One row of the default model's matrices (576x576 up) is not small: the int4 loop is
     * compute-bound on one core (~4 GB/s), so two threads cut a quiet host's single-stream
     * step by ~15% (threshold 2^21 before: every layer ran on one thread). */
    if (nthreads < 1 || M * N * K < SMALL_WORK) nthreads = 1;
    /* Few rows of x are quantized before the parallel region: an OpenMP barrier on a busy
     * 2-core host can wait out a descheduled thread's time slice, so the region below has none
     * but its join (static schedules: each thread keeps its tiles across row chunks). */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, xq + m * K, dx + m * nb, dxs + m * nb);
#if QAVX2
        if (pairs) pair_x(xq + m * K, dx + m * nb, nb, x2 + m * K, dxv + m * np * 8);
#endif
    }
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *wbuf = (M > 1 && (pairs || bits == 4)) ? malloc((size_t)(NR * wstride)) : NULL;
        float *sf = malloc(sizeof(float) * (size_t)(NR * nb));
        float *sfv = pairs ? malloc(sizeof(float) * (size_t)(NR * np * 8 + 1)) : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            int64_t m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < ntiles; t++) {
                int64_t n0 = t * NR;
                int nr = N - n0 < NR ? (int)(N - n0) : NR;
                const uint8_t *w[NR];
                int kind = bits == 8 ? INT8 : (wbuf ? BYTES4 : PACKED4);
                for (int r = 0; r < NR; r++) {
                    int64_t n = n0 + (r < nr ? r : nr - 1);  /* a short tile repeats its last row */
                    if (!pairs)
                        scales_row(s + n * nb, nb, sf + r * nb);
                    else if (nb & 1)  /* the pair loop's odd last group */
                        sf[r * nb + nb - 1] = fp16_to_fp32(s[n * nb + nb - 1]);
#if QAVX2
                    if (pairs) {  /* [s_2p x4, s_2p+1 x4] per pair */
                        const __m256i dup = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
                        for (int64_t p = 0; p < np; p++) {
                            int32_t two;
                            memcpy(&two, s + n * nb + 2 * p, 4);
                            __m256 v = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
                            _mm256_storeu_ps(sfv + (r * np + p) * 8, _mm256_permutevar8x32_ps(v, dup));
                        }
                    }
#endif
                    w[r] = q + n * row_bytes;
                    if (wbuf && r < nr) {
#if QAVX2
                        if (pairs && bits == 8)
                            expand_pairs8(w[r], nb, wbuf + r * wstride);
                        else if (pairs)
                            expand_pairs(w[r], nb, wbuf + r * wstride);
                        else
#endif
                            unpack4(w[r], nb, wbuf + r * wstride);
                        w[r] = wbuf + r * wstride;
                    } else if (wbuf) {
                        w[r] = wbuf + (nr - 1) * wstride;
                    }
                }
                for (int64_t m = m0; m < m1; m++) {
                    float out[NR];
#if QAVX2
                    if (pairs)
                        tile_dot_p(bits == 8 ? P_INT8 : (wbuf ? P_BYTES4 : P_PACKED4), w, x2 + m * K,
                                   dxv + m * np * 8, xq + m * K, dx + m * nb, nb, sf, sfv, out);
                    else
#endif
                        tile_dot_kind(kind, w, xq + m * K, dx + m * nb, nb, sf, out);
                    for (int r = 0; r < nr; r++) {
                        float v = out[r];
                        if (mins) v += mins_dot(mins + (n0 + r) * nb, dxs + m * nb, nb);
                        y[m * N + n0 + r] = bias ? v + bias[n0 + r] : v;
                    }
                }
            }
        }
        free(wbuf);
        free(sf);
        free(sfv);
    }
    free(xq);
    free(x2);
    free(dx);
    free(dxs);
    free(dxv);
}

/* Embedding lookup: out[i, :] = dequantized row ids[i] of W (fp32). */
void quant_gather(const uint8_t *q, const uint16_t *s, const uint16_t *mins, int bits, int64_t K,
                  const int64_t *ids, int64_t n_ids, float *out, int nthreads) {
    const int64_t nb = K / QK, row_bytes = bits == 4 ? K / 2 : K;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n_ids > 16)
    for (int64_t i = 0; i < n_ids; i++) {
        const int64_t n = ids[i];
        const uint8_t *row = q + n * row_bytes;
        float *o = out + i * K;
        for (int64_t b = 0; b < nb; b++) {
            float sc = fp16_to_fp32(s[n * nb + b]), mn = mins ? fp16_to_fp32(mins[n * nb + b]) : 0.f;
            for (int j = 0; j < QK; j++) {
                int v;
                if (bits == 4)
                    v = j < 16 ? (row[b * 16 + j] & 0x0f) : (row[b * 16 + j - 16] >> 4);
                else
                    v = ((const int8_t *)row)[b * QK + j];
                o[b * QK + j] = sc * (float)v + mn;
            }
        }
    }
}
