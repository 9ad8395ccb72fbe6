/* MXFP4 (OCP microscaling FP4) matrix products for the CPU: y[M,N] = x[M,K] @ W^T (+ bias),
 * W kept as its 4-bit codes and e8m0 scales, never dequantized to floats.
 *
 * Format (loomserve/execution/layers/mxfp4.py): blocks of 32 values along K, each value an e2m1
 * code (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) times
 * the block's scale 2^(e - 127), e an e8m0 byte. Doubled, the code values are the integers
 * {0, 1, 2, 3, 4, 6, 8, 12} (as ggml's kvalues_mxfp4), so w = kv[code] * 2^(e - 128): the
 * halved scale is a power of two, exact in fp32 for every e (e < 2 as subnormals).
 *
 * Tiled layout, as kernels/quant.c's 4-bit one: R=8 weight rows per tile, and per (tile, block)
 * 136 bytes: 128 of codes (4-byte chunks of the 8 rows interleaved, chunk-major
 * [chunk][row][4 bytes]; chunk c of a row holds its bytes 4c..4c+3, byte j carrying value j in
 * its low and value j+16 in its high nibble: GGUF's order, not HF's 2j / 2j+1), then the 8
 * rows' e8m0 bytes. N is padded to a multiple of 8 with zero rows.
 *
 * x: each row quantized once per call to int8 per 32-block (dx = max|x|/127, xq = round(x/dx)),
 * as quant.c does. A pshufb turns 32 codes into their signed doubled values; |w| times x with
 * w's sign (maddubs + madd, pair sums <= 2*12*127; vpdpbusd under AVX-512 VNNI; scalar C
 * elsewhere) gives exact int32 block dot products on every path, so the SIMD builds agree bit for
 * bit, and y = sum_blocks (2^(e-128) * dx) * dot(kv, xq) accumulates in fp32.
 *
 * Threads: OpenMP over tiles; x rows in register blocks of MR that share each unpacked chunk.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && !defined(MXFP4_PORTABLE)
#define MAVX2 1
#include <immintrin.h>
#else
#define MAVX2 0
#endif
#if MAVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(MXFP4_NO_VNNI)
#define MVNNI 1
#else
#define MVNNI 0
#endif

#define QK 32
#define R 8
#define MR 4
#define CODE_BYTES 128
#define BLOCK_BYTES 136
#define SMALL_WORK (1 << 17)  /* multiply-adds: below, one thread */

static const int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

int64_t mxfp4_block_bytes(void) { return BLOCK_BYTES; }

/* 2^(e - 128) as fp32 bits: the halved e8m0 scale (ggml_e8m0_to_fp32_half). */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Code of value j (0..31) of row r in a (tile, block). */
static inline int tiled_code(const uint8_t *blk, int r, int j) {
    int j4 = j & 15, byte = blk[(j4 / 4) * 32 + r * 4 + j4 % 4];
    return j < 16 ? (byte & 0x0f) : (byte >> 4);
}

static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK; j++) xq[b * QK + j] = (int8_t)(int)nearbyintf(xb[j] * id);
        dx[b] = d;
    }
}

#if MAVX2
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The 8 rows' halved scales of a block as fp32 lanes. */
static inline __m256 scales8(const uint8_t *e8) {
    const __m256i one = _mm256_set1_epi32(1);
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e8));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, one)));
}

/* acc[i][0..7] = the 8 outputs of one tile for x rows i < mr (a constant after inlining). */
static inline __attribute__((always_inline)) void tile_rows(
        int mr, const uint8_t *tile, int64_t nb, const int8_t *xq, int64_t K, const float *dx,
        __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i kv = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                        0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
#if !MVNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *blk = tile + g * BLOCK_BYTES;
        __m256i d32[MR];
        for (int i = 0; i < mr; i++) d32[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * c));
            __m256i wl = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));
            __m256i wh = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            __m256i al = _mm256_abs_epi8(wl), ah = _mm256_abs_epi8(wh);
            for (int i = 0; i < mr; i++) {
                const int8_t *xr = xq + i * K + g * QK;
                __m256i xl = _mm256_sign_epi8(bcast4(xr + 4 * c), wl);
                __m256i xh = _mm256_sign_epi8(bcast4(xr + 16 + 4 * c), wh);
#if MVNNI
                d32[i] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(d32[i], al, xl), ah, xh);
#else  /* two pair sums (each <= 2*12*127) add in int16, then one madd */
                __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(al, xl),
                                               _mm256_maddubs_epi16(ah, xh));
                d32[i] = _mm256_add_epi32(d32[i], _mm256_madd_epi16(s16, ones));
#endif
            }
        }
        __m256 sc = scales8(blk + CODE_BYTES);
        for (int i = 0; i < mr; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[i]),
                                     _mm256_mul_ps(sc, _mm256_set1_ps(dx[i * (K / QK) + g])), acc[i]);
    }
}

static void tile_block(int mr, const uint8_t *tile, int64_t nb, const int8_t *xq, int64_t K,
                       const float *dx, float *out) {
    __m256 acc[MR];
    switch (mr) {
        case 4: tile_rows(4, tile, nb, xq, K, dx, acc); break;
        case 3: tile_rows(3, tile, nb, xq, K, dx, acc); break;
        case 2: tile_rows(2, tile, nb, xq, K, dx, acc); break;
        default: tile_rows(1, tile, nb, xq, K, dx, acc); break;
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * R, acc[i]);
}
#else
/* Portable: the same arithmetic, one weight row and one x row at a time. */
static void tile_block(int mr, const uint8_t *tile, int64_t nb, const int8_t *xq, int64_t K,
                       const float *dx, float *out) {
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < R; r++) {
            float acc = 0.f;
            for (int64_t g = 0; g < nb; g++) {
                const uint8_t *blk = tile + g * BLOCK_BYTES;
                const int8_t *xr = xq + i * K + g * QK;
                int32_t d = 0;
                for (int j = 0; j < QK; j++) d += KV[tiled_code(blk, r, j)] * xr[j];
                acc += (float)d * (e8m0_half(blk[CODE_BYTES + r]) * dx[i * nb + g]);
            }
            out[i * R + r] = acc;
        }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias[N]); w tiled [ceil(N/8), K/32, 136]; K a multiple of 32. */
void mxfp4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                  const float *bias, float *y, int nthreads) {
    const int64_t nb = K / QK, ntiles = (N + R - 1) / R;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(M * nb));
    if (nthreads < 1 || M * N * K < SMALL_WORK) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * K, dx + m * nb);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t n0 = t * R, nr = N - n0 < R ? N - n0 : R;
        for (int64_t m = 0; m < M; m += MR) {
            int mr = M - m < MR ? (int)(M - m) : MR;
            float out[MR * R];
            tile_block(mr, w + t * nb * BLOCK_BYTES, nb, xq + m * K, K, dx + m * nb, out);
            for (int i = 0; i < mr; i++)
                for (int r = 0; r < nr; r++)
                    y[(m + i) * N + n0 + r] = bias ? out[i * R + r] + bias[n0 + r] : out[i * R + r];
        }
    }
    free(xq);
    free(dx);
}

/* The fp32 weight rows [N, K] a tiled W represents (tests, and the off-CPU unpack). */
void mxfp4_dequantize(const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t nb = K / QK;
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *tile = w + (n / R) * nb * BLOCK_BYTES;
        const int r = (int)(n % R);
        for (int64_t g = 0; g < nb; g++) {
            const uint8_t *blk = tile + g * BLOCK_BYTES;
            const float s = e8m0_half(blk[CODE_BYTES + r]);
            for (int j = 0; j < QK; j++) out[n * K + g * QK + j] = s * (float)KV[tiled_code(blk, r, j)];
        }
    }
}
