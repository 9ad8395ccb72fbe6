/* Quantized-weight matrix products for the CPU: y[M,N] = x[M,K] @ W^T (+ bias), W never
 * dequantized to floats.
 *
 * Formats (loomserve/execution/layers/quant.py; `fmt` below, the same codes there):
 *   4, 5, 8   groups of G=32 along K: w[n,k] = s[n,g] * q[n,k] + m[n,g], s and m fp16, m
 *             optional; q 4-bit (0..15), 5-bit (0..31; without m the value is s * (q - 16), as
 *             GGUF Q5_0) or int8. GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 map onto them exactly.
 *   14 Q4_K, 15 Q5_K, 16 Q6_K   GGUF's K-quants as the file stores them: super-blocks of 256
 *             with an fp16 d (and dmin); Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale sc and
 *             min mn, w = d*sc * q - dmin*mn, q 0..15 / 0..31; Q6_K: 16 sub-blocks of 16 with an
 *             int8 scale, w = d*sc * (q - 32), q 0..63. d*sc (fp16 times a small integer) is
 *             exact in fp32, so the kernel multiplies by gguf's own values.
 *   1 (multi) W is row segments of the formats above (a fused q|k|v or gate|up whose parts
 *             differ in type): w starts with int64 words [S, then per segment fmt, has_mins,
 *             rows, byte offset of its tiles from w]; each segment is tiled as below.
 *
 * The kernel reads the weights tiled, as llama.cpp's repacked x86 formats do: R=8 weight rows
 * per tile, and per (tile, block along K) one contiguous block. The unit everywhere is the
 * "chunk plane" of a 32-value group: 4-byte chunks of the 8 rows interleaved, chunk-major
 * ([chunk][row][4 bytes], 32 bytes a chunk):
 *   nibbles (128 B): chunk c holds bytes 4c..4c+3 of the row's group packed as GGUF Q4_0 (byte j
 *            = q[j] low nibble, q[j+16] high): the low nibbles are values 4c..4c+3, the high
 *            ones 16+4c..16+4c+3.
 *   q5 bits (32 B): per row one 32-bit word; byte b holds in bit c the 5th bit of q[4c+b] and
 *            in bit 4+c that of q[16+4c+b] (so chunk c's bits are (w << (4-c)) & 0x10 for the
 *            low nibbles and (w >> c) & 0x10 for the high ones: two shifts, two ands).
 *   q6 bits (64 B): two such planes H0 (chunks 0,1) and H1 (chunks 2,3); in H_k, byte b holds
 *            the top 2 bits of q[8k+b] (bits 0-1), q[8k+4+b] (2-3), q[16+8k+b] (4-5),
 *            q[16+8k+4+b] (6-7).
 *   int8 (256 B): chunk c holds q[4c..4c+3].
 * Per format, one block:
 *   4, 5, 8:  [nibbles | nibbles, q5 bits | int8] s[8] fp16, [int8: wsum[8] int16 = sum of q,
 *             the VNNI offset below], [m[8] fp16].          144/160/176/192/288/304 bytes
 *   Q4_K:     per super-block: 8 x nibbles, d[8], dmin[8] fp16, sc[8 sub][8 rows] u8,
 *             mn[8 sub][8 rows] u8.                         1184 bytes = 4.625 bits/weight
 *   Q5_K:     8 x (nibbles, q5 bits), then as Q4_K.          1440 bytes = 5.625 bits/weight
 *   Q6_K:     8 x (nibbles, q6 bits) (each 32-group: low nibbles = the first sub-block of 16,
 *             high = the second), d[8] fp16, sc[8 groups][8 rows][2] int8.
 *                                                           1680 bytes = 6.5625 bits/weight
 * N is padded to a multiple of 8 with zero rows. One 32-byte load then holds a 4-byte chunk of
 * 8 rows, and an int8 dot product of it with the x chunk broadcast to every lane (vpdpbusd, or
 * maddubs + madd on AVX2) gives each of the 8 rows' partial sums in its own lane: the 8 outputs
 * of a tile accumulate in one vector, scales apply as vectors, and no horizontal sum or per-row
 * setup is left (the one-row case was bound by those, not by memory).
 *
 * x: each row is quantized once per call to int8 per 32-block (dx = max|x|/127,
 * xq = round(x/dx)), as llama.cpp does: y = sum_g s*dx*dot(q, xq) + m*dx*sum(xq). The int32 dot
 * products are exact on every path, so the AVX2 and VNNI builds agree bit for bit.
 * Q4_K/Q5_K: per sub-block the fp32 vector d*sc (and dmin*mn) replaces s (and -m). Q6_K: the
 * two halves' sums are scaled in integers (madd by sc as int16, or vpdpwssd) and the -32 offset
 * taken off as 32 * (scA * sum(xq first half) + scB * sum(xq second half)), then times d*dx.
 * int8 weights under VNNI: vpdpbusd multiplies unsigned by signed bytes, so x goes in as
 * xq + 128 (unsigned) and 128 * wsum is subtracted from the int32 sum (exact). 5-bit without m:
 * 16 * sum(xq) is subtracted the same way, so Q5_0 gives the int8 path's integers.
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
#define QKK 256
#define R 8
/* Register blocks of up to MR x rows share each unpacked weight chunk: a verified draft's 1 + d
 * rows (d <= 7) in one block. SmolLM2-135M Q4_1 products, one thread, 2-vCPU AMD EPYC (AVX2)
 * under load, MR 4 -> 8: 5 rows 6-11% faster, 8 rows 6-8% (Q8_0 LM head 5 rows 14.0 -> 11.2 ms,
 * 8 rows 21.9 -> 14.9); 1-4 rows unchanged. Summing the 4-bit maddubs pairs in int16 across a
 * group before widening (exact) measured no faster and 2 rows slower (a longer dependency chain). */
#define MR 8
#define MC 64
#define MAX_SEGS 8
#define SMALL_WORK (1 << 17)  /* multiply-adds: below, one thread */
/* Each tile's first pass prefetches the weights PF_LEAD bytes ahead into L2, one block's bytes
 * per block: the hardware prefetchers restart at every 4 KB page, and the int8 dot products
 * leave the memory idle between pages otherwise. SmolLM2-135M Q4_1 on the 2-vCPU Intel Xeon VM,
 * one decode step: 7.46 -> 6.47 ms at 1 sequence, 42.4 -> 40.3 at 32; into L1 at 8 KB: 8.19. */
#ifndef PF_LEAD
#define PF_LEAD 16384
#endif

enum { QF_MULTI = 1, QF_Q4 = 4, QF_Q5 = 5, QF_Q8 = 8, QF_Q4K = 14, QF_Q5K = 15, QF_Q6K = 16 };

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

static inline int is_k(int fmt) { return fmt >= QF_Q4K; }
/* q bytes of one 32-group (legacy formats) or one 32-group of a K super-block. */
static inline int64_t qbytes(int fmt) {
    switch (fmt) {
        case QF_Q4: case QF_Q4K: return 128;
        case QF_Q5: case QF_Q5K: return 160;
        case QF_Q6K: return 192;
        default: return 256;
    }
}
/* Bytes of one (tile, block) block: a 32-group (legacy) or a 256-super-block (K). */
int64_t quant_block_bytes(int fmt, int has_mins) {
    if (fmt == QF_Q6K) return 8 * 192 + 16 + 128;
    if (is_k(fmt)) return 8 * qbytes(fmt) + 32 + 128;
    return qbytes(fmt) + 16 + (fmt == QF_Q8 ? 16 : 0) + (has_mins ? 16 : 0);
}
static inline int64_t tile_bytes(int fmt, int has_mins, int64_t K) {
    return K / (is_k(fmt) ? QKK : QK) * quant_block_bytes(fmt, has_mins);
}
/* Offset of m (legacy) after the q bytes. */
static inline int64_t mins_off(int fmt) { return 16 + (fmt == QF_Q8 ? 16 : 0); }

/* --- scalar access (portable path, embedding gather) --------------------------------------- */

/* Value j (0..31) of row r from a nibble plane, and the high bits from a q5 / q6 plane. */
static inline int nib_q(const uint8_t *p, int r, int j) {
    int j4 = j & 15, byte = p[(j4 / 4) * 32 + r * 4 + j4 % 4];
    return j < 16 ? (byte & 0x0f) : (byte >> 4);
}
static inline int q5_bit(const uint8_t *p, int r, int j) {
    int j4 = j & 15;
    return (p[r * 4 + j4 % 4] >> (j4 / 4 + (j < 16 ? 0 : 4))) & 1;
}
static inline int q6_bits(const uint8_t *p, int r, int j) {
    int j4 = j & 15, c = j4 / 4;
    return (p[(c >> 1) * 32 + r * 4 + j4 % 4] >> (2 * (c & 1) + (j < 16 ? 0 : 4))) & 3;
}
/* q of row r, value j of a 32-group at p in format fmt (unsigned but int8). */
static inline int group_q(int fmt, const uint8_t *p, int r, int j) {
    switch (fmt) {
        case QF_Q8: return ((const int8_t *)p)[(j / 4) * 32 + r * 4 + j % 4];
        case QF_Q5: case QF_Q5K: return nib_q(p, r, j) | q5_bit(p + 128, r, j) << 4;
        case QF_Q6K: return nib_q(p, r, j) | q6_bits(p + 128, r, j) << 4;
        default: return nib_q(p, r, j);
    }
}

static inline float tiled_half(const uint8_t *p, int r) {
    uint16_t h;
    memcpy(&h, p + 2 * r, 2);
    return fp16_to_fp32(h);
}

/* x row -> int8 per 32-block; dx[b] the block scale, dxs[b] = dx[b] * sum(xq) (mins term),
 * xs[2b], xs[2b+1]: sum(xq) over each 16-half (the Q5_0 / Q6_K offsets). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, float *dxs, int16_t *xs) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) {  /* not fmaxf: without -ffast-math it is a call per element */
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum[2];
        for (int h = 0; h < 2; h++) {  /* two plain loops: they vectorize */
            int s = 0;
            for (int j = 16 * h; j < 16 * h + 16; j++) {
                int v = (int)nearbyintf(xb[j] * id);
                xq[b * QK + j] = (int8_t)v;
                s += v;
            }
            sum[h] = s;
        }
        dx[b] = d;
        dxs[b] = d * (float)(sum[0] + sum[1]);
        xs[2 * b] = (int16_t)sum[0];
        xs[2 * b + 1] = (int16_t)sum[1];
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

/* acc += a0 . b0 + a1 . b1; on AVX2 the two maddubs pair sums (each <= 2*31*127) add in int16. */
static inline __m256i dot2_acc(__m256i acc, __m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#if QVNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, a0, b0), a1, b1);
#else
    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(a0, b0), _mm256_maddubs_epi16(a1, b1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
#endif
}

/* acc += int16 pairs p . s (madd; vpdpwssd under VNNI). */
static inline __m256i madd_acc(__m256i acc, __m256i p, __m256i s) {
#if QVNNI
    return _mm256_dpwssd_epi32(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* Chunk c's 5th bits (q5 plane word w per lane) into its low / high nibbles. */
static inline void q5_merge(__m256i *lo, __m256i *hi, __m256i w, int c) {
    const __m256i m10 = _mm256_set1_epi8(0x10);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi32(w, 4 - c), m10));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi32(w, c), m10));
}

/* Chunk 2k+c1's top 2 bits (q6 plane H_k) into its low / high nibbles. */
static inline void q6_merge(__m256i *lo, __m256i *hi, __m256i h, int c1) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi32(h, 4 - 2 * c1), m30));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi32(h, 2 * c1), m30));
}

/* Low and high nibbles of chunk c of a nibble plane. */
static inline void nibbles(const uint8_t *p, int c, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * c));
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

/* d32[i] += dot of a 4/5-bit 32-group (nibbles at p, q5 plane at p + 128 when five) with x row i. */
static inline __attribute__((always_inline)) void group_dot(
        int five, int mr, const uint8_t *p, const int8_t *xq, int64_t K, __m256i *d32) {
    __m256i w5 = five ? _mm256_loadu_si256((const __m256i *)(p + 128)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        nibbles(p, c, &lo, &hi);
        if (five) q5_merge(&lo, &hi, w5, c);
        for (int i = 0; i < mr; i++) {
            const int8_t *xr = xq + i * K;
            d32[i] = dot2_acc(d32[i], lo, bcast4(xr + 4 * c), hi, bcast4(xr + 16 + 4 * c));
        }
    }
}

static inline void prefetch_block(const uint8_t *blk, int64_t bb) {
    for (int64_t o = 0; o < bb; o += 64) _mm_prefetch((const char *)blk + PF_LEAD + o, _MM_HINT_T1);
}

/* A K block's prefetches, spread over its 8 groups (part j of 8 before group j), as the legacy
 * formats' per-group ones are: the whole 1.2-1.7 KB at once stalled the loads behind them
 * (SmolLM2-sized 49152x512, one row streamed from memory, one thread, AMD EPYC host: Q4_K 10.8
 * -> 13.9 GB/s, Q6_K 10.9 -> 18.7). */
static inline void prefetch_part(const uint8_t *blk, int64_t bb, int j) {
    for (int64_t o = (j * bb / 8) & ~(int64_t)63; o < (j + 1) * bb / 8; o += 64)
        _mm_prefetch((const char *)blk + PF_LEAD + o, _MM_HINT_T1);
}

/* out[i][0..7] = the 8 outputs of one tile for x rows i < mr (mr <= MR, a constant per call
 * site after inlining), legacy formats. xq: mr rows of K bytes (int8; under VNNI with int8
 * weights, xq ^ 0x80). pf: prefetch ahead (the first register block of x rows of each pass). */
static inline __attribute__((always_inline)) void tile_rows(
        int bits, int has_mins, int mr, const uint8_t *tile, int64_t K, const int8_t *xq,
        const float *dx, const float *dxs, const int16_t *xs, __m256 *acc, int pf) {
    const int64_t nb = K / QK, bb = quant_block_bytes(bits, has_mins);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(bits);
        if (pf) prefetch_block(blk, bb);  /* prefetches never fault: past w's end is harmless */
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
        __m256i d32[MR];
        for (int i = 0; i < mr; i++) d32[i] = _mm256_setzero_si256();
        if (bits != 8) {
            group_dot(bits == 5, mr, blk, xq + g * QK, K, d32);
            if (bits == 5 && !has_mins)  /* Q5_0: value s * (q - 16) */
                for (int i = 0; i < mr; i++) {
                    const int16_t *h = xs + i * 2 * nb + 2 * g;
                    d32[i] = _mm256_sub_epi32(d32[i], _mm256_set1_epi32(16 * (h[0] + h[1])));
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
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[i]), _mm256_mul_ps(sc, _mm256_set1_ps(dx[i * nb + g])), acc[i]);
        if (has_mins) {
            __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + mins_off(bits))));
            for (int i = 0; i < mr; i++)
                acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dxs[i * nb + g]), acc[i]);
        }
    }
}

/* 8 u8 -> fp32 lanes. */
static inline __m256 u8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* As tile_rows, for the K formats: one block per super-block of 256. */
static inline __attribute__((always_inline)) void tile_rows_k(
        int fmt, int mr, const uint8_t *tile, int64_t K, const int8_t *xq, const float *dx,
        const float *dxs, const int16_t *xs, __m256 *acc, int pf) {
    const int64_t nb = K / QK, nsb = K / QKK, bb = quant_block_bytes(fmt, 1), qb = qbytes(fmt);
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = tile + sb * bb, *tail = blk + 8 * qb;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail));
        if (fmt == QF_Q6K) {
            for (int j = 0; j < 8; j++) {
                const uint8_t *grp = blk + j * qb;
                const int64_t g = sb * 8 + j;
                if (pf) prefetch_part(blk, bb, j);
                /* sc16 lane r: (scA, scB) int16; sa, sb16: (scA, scA), (scB, scB) */
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(tail + 16 + 16 * j)));
                const __m256i sa = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xA0), 0xA0);
                const __m256i sb16 = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xF5), 0xF5);
                __m256i d32[MR];
                for (int i = 0; i < mr; i++) d32[i] = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    __m256i lo, hi;
                    nibbles(grp, c, &lo, &hi);
                    q6_merge(&lo, &hi, _mm256_loadu_si256((const __m256i *)(grp + 128 + 32 * (c >> 1))), c & 1);
                    for (int i = 0; i < mr; i++) {  /* pair sums <= 2*63*127: exact in int16 */
                        const int8_t *xr = xq + i * K + g * QK;
                        d32[i] = madd_acc(d32[i], _mm256_maddubs_epi16(lo, bcast4(xr + 4 * c)), sa);
                        d32[i] = madd_acc(d32[i], _mm256_maddubs_epi16(hi, bcast4(xr + 16 + 4 * c)), sb16);
                    }
                }
                for (int i = 0; i < mr; i++) {  /* - 32 * (scA * sum(xq A) + scB * sum(xq B)) */
                    int32_t pair;
                    memcpy(&pair, xs + i * 2 * nb + 2 * g, 4);
                    __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_set1_epi32(pair)), 5);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(d32[i], off)),
                                             _mm256_mul_ps(dv, _mm256_set1_ps(dx[i * nb + g])), acc[i]);
                }
            }
        } else {
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 16)));
            for (int j = 0; j < 8; j++) {
                const int64_t g = sb * 8 + j;
                if (pf) prefetch_part(blk, bb, j);
                __m256i d32[MR];
                for (int i = 0; i < mr; i++) d32[i] = _mm256_setzero_si256();
                group_dot(fmt == QF_Q5K, mr, blk + j * qb, xq + g * QK, K, d32);
                const __m256 scv = _mm256_mul_ps(dv, u8_ps(tail + 32 + 8 * j));
                const __m256 mnv = _mm256_mul_ps(mv, u8_ps(tail + 96 + 8 * j));
                for (int i = 0; i < mr; i++) {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32[i]), _mm256_mul_ps(scv, _mm256_set1_ps(dx[i * nb + g])), acc[i]);
                    acc[i] = _mm256_fnmadd_ps(mnv, _mm256_set1_ps(dxs[i * nb + g]), acc[i]);
                }
            }
        }
    }
}

/* Specializations: format x mins x register-block rows, each compiled with constants. */
#define MR_CASES(CALL) \
    switch (mr) { \
        case 8: CALL(8); break; \
        case 7: CALL(7); break; \
        case 6: CALL(6); break; \
        case 5: CALL(5); break; \
        case 4: CALL(4); break; \
        case 3: CALL(3); break; \
        case 2: CALL(2); break; \
        default: CALL(1); break; \
    }
#define L4M(n) tile_rows(4, 1, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define L4(n) tile_rows(4, 0, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define L5M(n) tile_rows(5, 1, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define L5(n) tile_rows(5, 0, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define L8M(n) tile_rows(8, 1, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define L8(n) tile_rows(8, 0, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define K4(n) tile_rows_k(QF_Q4K, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define K5(n) tile_rows_k(QF_Q5K, n, tile, K, xq, dx, dxs, xs, acc, pf)
#define K6(n) tile_rows_k(QF_Q6K, n, tile, K, xq, dx, dxs, xs, acc, pf)

static void tile_block(int fmt, int has_mins, int mr, const uint8_t *tile, int64_t K,
                       const int8_t *xq, const float *dx, const float *dxs, const int16_t *xs,
                       float *out, int pf) {
    __m256 acc[MR];
    switch (fmt) {
        case QF_Q4: if (has_mins) MR_CASES(L4M) else MR_CASES(L4) break;
        case QF_Q5: if (has_mins) MR_CASES(L5M) else MR_CASES(L5) break;
        case QF_Q8: if (has_mins) MR_CASES(L8M) else MR_CASES(L8) break;
        case QF_Q4K: MR_CASES(K4) break;
        case QF_Q5K: MR_CASES(K5) break;
        default: MR_CASES(K6) break;
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * R, acc[i]);
}
#else
/* Portable: the same arithmetic, one weight row and one x row at a time. */
static void tile_block(int fmt, int has_mins, int mr, const uint8_t *tile, int64_t K,
                       const int8_t *xq, const float *dx, const float *dxs, const int16_t *xs,
                       float *out, int pf) {
    const int64_t nb = K / QK, bb = quant_block_bytes(fmt, has_mins);
    (void)pf;
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < R; r++) {
            float acc = 0.f;
            for (int64_t g = 0; g < nb; g++) {
                const int8_t *xr = xq + i * K + g * QK;
                const int16_t *h = xs + i * 2 * nb + 2 * g;
                const float dxg = dx[i * nb + g], dxsg = dxs[i * nb + g];
                int32_t d[2] = {0, 0};
                if (!is_k(fmt)) {
                    const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(fmt);
                    for (int j = 0; j < QK; j++) d[0] += group_q(fmt, blk, r, j) * xr[j];
                    if (fmt == QF_Q5 && !has_mins) d[0] -= 16 * (h[0] + h[1]);
                    acc += tiled_half(tail, r) * dxg * (float)d[0];
                    if (has_mins) acc += tiled_half(tail + mins_off(fmt), r) * dxsg;
                    continue;
                }
                const uint8_t *blk = tile + (g / 8) * bb, *grp = blk + (g % 8) * qbytes(fmt),
                              *tail = blk + 8 * qbytes(fmt);
                for (int j = 0; j < QK; j++) d[j >= 16] += group_q(fmt, grp, r, j) * xr[j];
                const float dk = tiled_half(tail, r);
                if (fmt == QF_Q6K) {
                    const int8_t *sc = (const int8_t *)tail + 16 + 16 * (g % 8) + 2 * r;
                    int32_t t = sc[0] * (d[0] - 32 * h[0]) + sc[1] * (d[1] - 32 * h[1]);
                    acc += dk * dxg * (float)t;
                } else {
                    const int s = tail[32 + 8 * (g % 8) + r], m = tail[96 + 8 * (g % 8) + r];
                    acc += dk * (float)s * dxg * (float)(d[0] + d[1]);
                    acc -= tiled_half(tail + 16, r) * (float)m * dxsg;
                }
            }
            out[i * R + r] = acc;
        }
}
#endif

/* A weight's row segments: one for a single format, the header's for QF_MULTI. */
typedef struct { int fmt, has_mins; int64_t rows, n0, t0; const uint8_t *w; } seg_t;

static int segments(const uint8_t *w, int fmt, int has_mins, int64_t N, seg_t *segs) {
    if (fmt != QF_MULTI) {
        segs[0] = (seg_t){fmt, has_mins, N, 0, 0, w};
        return 1;
    }
    int64_t hdr[1 + 4 * MAX_SEGS];
    memcpy(hdr, w, sizeof(int64_t));
    int ns = hdr[0] < 1 ? 1 : hdr[0] > MAX_SEGS ? MAX_SEGS : (int)hdr[0];
    memcpy(hdr + 1, w + 8, sizeof(int64_t) * 4 * (size_t)ns);
    int64_t n0 = 0, t0 = 0;
    for (int s = 0; s < ns; s++) {
        const int64_t *h = hdr + 1 + 4 * s;
        segs[s] = (seg_t){(int)h[0], (int)h[1], h[2], n0, t0, w + h[3]};
        n0 += h[2];
        t0 += (h[2] + R - 1) / R;
    }
    return ns;
}

void quant_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, int has_mins, int64_t N,
                  int fmt, const float *bias, float *y, int nthreads) {
    seg_t segs[MAX_SEGS];
    const int ns = segments(w, fmt, has_mins, N, segs);
    const int64_t nb = K / QK, ntiles = segs[ns - 1].t0 + (segs[ns - 1].rows + R - 1) / R;
    int q8 = 0;
    for (int s = 0; s < ns; s++) q8 |= segs[s].fmt == QF_Q8;
    int8_t *xq = malloc((size_t)(M * K));
    /* under VNNI, int8 weights read x as xq + 128: a second copy where other formats share x */
    int8_t *x8 = QVNNI && q8 && ns > 1 ? malloc((size_t)(M * K)) : xq;
    float *dx = malloc(sizeof(float) * (size_t)(M * nb)), *dxs = malloc(sizeof(float) * (size_t)(M * nb));
    int16_t *xs = malloc(sizeof(int16_t) * (size_t)(M * 2 * nb));
    /* Small products run on the calling thread: a team's fork and join costs as much as the work. */
    if (nthreads < 1 || M * N * K < SMALL_WORK) nthreads = 1;
    /* x is quantized before the parallel region: an OpenMP barrier on a busy 2-core host can
     * wait out a descheduled thread's time slice, so the region below has none but its join. */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, xq + m * K, dx + m * nb, dxs + m * nb, xs + m * 2 * nb);
        if (QVNNI && q8)
            for (int64_t k = 0; k < K; k++) x8[m * K + k] = (int8_t)((uint8_t)xq[m * K + k] ^ 0x80);
    }
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        int64_t m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < ntiles; t++) {
            int s = 0;
            while (s + 1 < ns && t >= segs[s + 1].t0) s++;
            const seg_t *sg = segs + s;
            const int64_t tl = t - sg->t0, n0 = sg->n0 + tl * R,
                          nr = sg->rows - tl * R < R ? sg->rows - tl * R : R;
            const uint8_t *tile = sg->w + tl * tile_bytes(sg->fmt, sg->has_mins, K);
            const int8_t *xs8 = sg->fmt == QF_Q8 ? x8 : xq;
            for (int64_t m = m0; m < m1; m += MR) {
                int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                float out[MR * R];
                tile_block(sg->fmt, sg->has_mins, mr, tile, K, xs8 + m * K, dx + m * nb, dxs + m * nb,
                           xs + m * 2 * nb, out, m == m0);
                for (int i = 0; i < mr; i++)
                    for (int r = 0; r < nr; r++)
                        y[(m + i) * N + n0 + r] = bias ? out[i * R + r] + bias[n0 + r] : out[i * R + r];
            }
        }
    }
    if (x8 != xq) free(x8);
    free(xq);
    free(dx);
    free(dxs);
    free(xs);
}

/* Embedding lookup from the tiled layout (one format, not multi): out[i, :] = dequantized row
 * ids[i] of W in fp32, computed as gguf-py dequantizes (d*sc first, then * q, then - dmin*mn). */
void quant_gather(const uint8_t *w, int has_mins, int fmt, int64_t K, const int64_t *ids,
                  int64_t n_ids, float *out, int nthreads) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt, has_mins, K), bb = quant_block_bytes(fmt, has_mins);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n_ids > 16)
    for (int64_t i = 0; i < n_ids; i++) {
        const int r = (int)(ids[i] % R);
        const uint8_t *tile = w + (ids[i] / R) * tb;
        float *o = out + i * K;
        for (int64_t g = 0; g < nb; g++, o += QK) {
            if (!is_k(fmt)) {
                const uint8_t *blk = tile + g * bb, *tail = blk + qbytes(fmt);
                const float sc = tiled_half(tail, r), mn = has_mins ? tiled_half(tail + mins_off(fmt), r) : 0.f;
                const int off = fmt == QF_Q5 && !has_mins ? 16 : 0;
                for (int j = 0; j < QK; j++) o[j] = sc * (float)(group_q(fmt, blk, r, j) - off) + mn;
                continue;
            }
            const uint8_t *blk = tile + (g / 8) * bb, *grp = blk + (g % 8) * qbytes(fmt),
                          *tail = blk + 8 * qbytes(fmt);
            const float dk = tiled_half(tail, r);
            if (fmt == QF_Q6K) {
                const int8_t *sc = (const int8_t *)tail + 16 + 16 * (g % 8) + 2 * r;
                for (int j = 0; j < QK; j++) o[j] = dk * (float)sc[j >= 16] * (float)(group_q(fmt, grp, r, j) - 32);
            } else {
                const float ds = dk * (float)tail[32 + 8 * (g % 8) + r],
                            dm = tiled_half(tail + 16, r) * (float)tail[96 + 8 * (g % 8) + r];
                for (int j = 0; j < QK; j++) o[j] = ds * (float)group_q(fmt, grp, r, j) - dm;
            }
        }
    }
}
