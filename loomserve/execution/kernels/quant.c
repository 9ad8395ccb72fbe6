/* Quantized-weight matrix products for the CPU: y[M,N] = x[M,K] @ W^T (+ bias), W never
 * dequantized to floats.
 *
 * Format (loomserve/execution/layers/quant.py): w[n,k] = s[n,g] * q[n,k] + m[n,g] in groups of
 * G=32 along K; s, m fp16, m optional; q 4-bit (0..15) or int8. The kernel reads the weights
 * tiled, as llama.cpp's repacked x86 formats do: R=8 weight rows per tile, and per (tile, group)
 * one contiguous block of
 *   q: 4-byte chunks of the 8 rows interleaved, chunk-major ([chunk][row][4 bytes]); a 4-bit
 *      chunk holds the packed bytes 4c..4c+3 (q[4c..4c+3] low nibbles, q[16+4c..] high);
 *      an int8 chunk q[4c..4c+3]. 128 or 256 bytes.
 *   s: 8 fp16.   [int8 only] wsum: 8 int16, sum of q over the group (the VNNI offset below).
 *   [with mins] m: 8 fp16.
 * N is padded to a multiple of 8 with zero rows. One 32-byte load then holds a 4-byte chunk of
 * 8 rows, and an int8 dot product of it with the x chunk broadcast to every lane (vpdpbusd, or
 * maddubs + madd on AVX2) gives each of the 8 rows' partial sums in its own lane: the 8 outputs
 * of a tile accumulate in one vector, scales apply as vectors, and no horizontal sum or per-row
 * setup is left (the one-row case was bound by those, not by memory).
 *
 * x: each row is quantized once per call to int8 per 32-block (dx = max|x|/127,
 * xq = round(x/dx)), as llama.cpp does: y = sum_g s*dx*dot(q, xq) + m*dx*sum(xq). The int32 dot
 * products are exact on every path, so the AVX2 and VNNI builds agree bit for bit.
 * int8 weights under VNNI: vpdpbusd multiplies unsigned by signed bytes, so x goes in as
 * xq + 128 (unsigned) and 128 * wsum is subtracted from the int32 sum (exact).
 *
 * Threads: OpenMP splits the tiles; x rows come in chunks of MC (x stays in L2) and in register
 * blocks of MR rows that share each unpacked weight chunk.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#define QAVX2 1
#include <immintrin.h>
#else
#define QAVX2 0
#endif
#if QAVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(QUANT_NO_VNNI)
#define QVNNI 1
#else
#define QVNNI 0
#endif

#define QK 32
#define R 8
#define MR 4
#define MC 64
#define SMALL_WORK (1 << 17)  /* multiply-adds: below, one thread */
/* Each tile's first pass prefetches the weights PF_LEAD bytes ahead into L2, one group's bytes
 * per group: the hardware prefetchers restart at every 4 KB page, and the int8 dot products
 * leave the memory idle between pages otherwise. SmolLM2-135M Q4_1 on the 2-vCPU Intel Xeon VM,
 * one decode step: 7.46 -> 6.47 ms at 1 sequence, 42.4 -> 40.3 at 32; into L1 at 8 KB: 8.19. */
#define PF_LEAD 16384

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

/* Bytes of one (tile, group) block; the offsets of s, wsum and m inside it. */
static inline int64_t qbytes(int bits) { return bits == 4 ? 128 : 256; }
int64_t quant_block_bytes(int bits, int has_mins) {
    return qbytes(bits) + 16 + (bits == 8 ? 16 : 0) + (has_mins ? 16 : 0);
}

/* Element j of row r (of 8) in a (tile, group) block, and the fp16 at slot r of the 8 after `p`. */
static inline int tiled_q(int bits, const uint8_t *blk, int r, int j) {
    if (bits == 4) {
        int j4 = j & 15, byte = blk[(j4 / 4) * 32 + r * 4 + j4 % 4];
        return j < 16 ? (byte & 0x0f) : (byte >> 4);
    }
    return ((const int8_t *)blk)[(j / 4) * 32 + r * 4 + j % 4];
}

static inline float tiled_half(const uint8_t *p, int r) {
    uint16_t h;
    memcpy(&h, p + 2 * r, 2);
    return fp16_to_fp32(h);
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

#if QAVX2
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc (int32 lanes) += u8 a . s8 b, 4 bytes per lane; callers keep AVX2's int16 pair sums in range. */
static inline __m256i dot_acc(__m256i acc, __m256i a, __m256i b) {
#if QVNNI
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

/* out[i][0..7] = the 8 outputs of one tile for x rows i < mr (mr <= MR, a constant per call
 * site after inlining). xq: mr rows of K bytes (int8; under VNNI with int8 weights, xq ^ 0x80).
 * pf: prefetch ahead (the first register block of x rows of each pass over the weights). */
static inline __attribute__((always_inline)) void tile_rows(
        int bits, int has_mins, int mr, const uint8_t *tile, int64_t nb, int64_t bb,
        const int8_t *xq, int64_t K, const float *dx, const float *dxs, __m256 *acc, int pf) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(bits);
        if (pf)  /* prefetches never fault: past w's end is harmless */
            for (int64_t o = 0; o < bb; o += 64) _mm_prefetch((const char *)blk + PF_LEAD + o, _MM_HINT_T1);
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
        __m256i d32[MR];
        for (int i = 0; i < mr; i++) d32[i] = _mm256_setzero_si256();
        if (bits == 4) {
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for (int i = 0; i < mr; i++) {
                    const int8_t *xr = xq + i * K + g * QK;
#if QVNNI
                    d32[i] = dot_acc(dot_acc(d32[i], lo, bcast4(xr + 4 * c)), hi, bcast4(xr + 16 + 4 * c));
#else  /* two maddubs pair sums (each <= 2*15*127) add in int16, then one madd */
                    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xr + 4 * c)),
                                                   _mm256_maddubs_epi16(hi, bcast4(xr + 16 + 4 * c)));
                    d32[i] = _mm256_add_epi32(d32[i], _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
#endif
                }
            }
        } else {
            for (int c = 0; c < 8; c++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
#if !QVNNI  /* |w| times x with w's sign (max 2*128*127 < 2^15), as llama.cpp does */
                __m256i aw = _mm256_sign_epi8(w, w);
#endif
                for (int i = 0; i < mr; i++) {
                    __m256i xb = bcast4(xq + i * K + g * QK + 4 * c);
#if QVNNI
                    d32[i] = dot_acc(d32[i], xb, w);  /* xb is xq + 128 here */
#else
                    d32[i] = dot_acc(d32[i], aw, _mm256_sign_epi8(xb, w));
#endif
                }
            }
#if QVNNI
            __m256i off = _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(tail + 16))), 7);
            for (int i = 0; i < mr; i++) d32[i] = _mm256_sub_epi32(d32[i], off);
#endif
        }
        for (int i = 0; i < mr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[i]), _mm256_mul_ps(sc, _mm256_set1_ps(dx[i * (K / QK) + g])), acc[i]);
        if (has_mins) {
            __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + (bits == 8 ? 32 : 16))));
            for (int i = 0; i < mr; i++)
                acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dxs[i * (K / QK) + g]), acc[i]);
        }
    }
}

/* Specializations: bits x mins x register-block rows, each compiled with constants. */
#define TILE_CASES(B, H) \
    switch (mr) { \
        case 4: tile_rows(B, H, 4, tile, nb, bb, xq, K, dx, dxs, acc, pf); break; \
        case 3: tile_rows(B, H, 3, tile, nb, bb, xq, K, dx, dxs, acc, pf); break; \
        case 2: tile_rows(B, H, 2, tile, nb, bb, xq, K, dx, dxs, acc, pf); break; \
        default: tile_rows(B, H, 1, tile, nb, bb, xq, K, dx, dxs, acc, pf); break; \
    }

static void tile_block(int bits, int has_mins, int mr, const uint8_t *tile, int64_t nb, int64_t bb,
                       const int8_t *xq, int64_t K, const float *dx, const float *dxs, float *out,
                       int pf) {
    __m256 acc[MR];
    if (bits == 4 && has_mins) TILE_CASES(4, 1)
    else if (bits == 4) TILE_CASES(4, 0)
    else if (has_mins) TILE_CASES(8, 1)
    else TILE_CASES(8, 0)
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * R, acc[i]);
}
#else
/* Portable: the same arithmetic, one weight row and one x row at a time. */
static void tile_block(int bits, int has_mins, int mr, const uint8_t *tile, int64_t nb, int64_t bb,
                       const int8_t *xq, int64_t K, const float *dx, const float *dxs, float *out,
                       int pf) {
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < R; r++) {
            float acc = 0.f;
            for (int64_t g = 0; g < nb; g++) {
                const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(bits);
                const int8_t *xr = xq + i * K + g * QK;
                int32_t d = 0;
                for (int j = 0; j < QK; j++) d += tiled_q(bits, blk, r, j) * xr[j];
                acc += tiled_half(tail, r) * dx[i * nb + g] * (float)d;
                if (has_mins) acc += tiled_half(tail + (bits == 8 ? 32 : 16), r) * dxs[i * nb + g];
            }
            out[i * R + r] = acc;
        }
}
#endif

void quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int has_mins, int64_t N,
                  int bits, const float *bias, float *y, int nthreads) {
    const int64_t nb = K / QK, ntiles = (N + R - 1) / R, bb = quant_block_bytes(bits, has_mins);
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb)), *dxs = malloc(sizeof(float) * (size_t)(M * nb));
    /* Small products run on the calling thread: a team's fork and join costs as much as the work. */
    if (nthreads < 1 || M * N * K < SMALL_WORK) nthreads = 1;
    /* x is quantized before the parallel region: an OpenMP barrier on a busy 2-core host can
     * wait out a descheduled thread's time slice, so the region below has none but its join. */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, xq + m * K, dx + m * nb, dxs + m * nb);
#if QVNNI
        if (bits == 8)
            for (int64_t k = 0; k < K; k++) xq[m * K + k] = (int8_t)((uint8_t)xq[m * K + k] ^ 0x80);
#endif
    }
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        int64_t m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t n0 = t * R, nr = N - n0 < R ? N - n0 : R;
            for (int64_t m = m0; m < m1; m += MR) {
                int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                float out[MR * R];
                tile_block(bits, has_mins, mr, w + t * nb * bb, nb, bb, xq + m * K, K, dx + m * nb,
                           dxs + m * nb, out, m == m0);
                for (int i = 0; i < mr; i++)
                    for (int r = 0; r < nr; r++)
                        y[(m + i) * N + n0 + r] = bias ? out[i * R + r] + bias[n0 + r] : out[i * R + r];
            }
        }
    }
    free(xq);
    free(dx);
    free(dxs);
}

/* Embedding lookup from the tiled layout: out[i, :] = dequantized row ids[i] of W (fp32). */
void quant_gather(const uint8_t *w, int has_mins, int bits, int64_t K, const int64_t *ids,
                  int64_t n_ids, float *out, int nthreads) {
    const int64_t nb = K / QK, bb = quant_block_bytes(bits, has_mins);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n_ids > 16)
    for (int64_t i = 0; i < n_ids; i++) {
        const int64_t n = ids[i], r = n % R;
        const uint8_t *tile = w + (n / R) * nb * bb;
        for (int64_t g = 0; g < nb; g++) {
            const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(bits);
            const float sc = tiled_half(tail, (int)r),
                        mn = has_mins ? tiled_half(tail + (bits == 8 ? 32 : 16), (int)r) : 0.f;
            for (int j = 0; j < QK; j++) out[i * K + g * QK + j] = sc * (float)tiled_q(bits, blk, (int)r, j) + mn;
        }
    }
}
