/* How the AVX2 and AVX-512 paths read K/V rows of each cache dtype (included by
 * paged_attention.c before them, inside its AVX2 block): widened into a buffer once per chunk
 * (widen_row), or read in place as 8 fp32 lanes per load (ld8). */
#include <immintrin.h>

#ifdef __F16C__
/* Eight 8-bit floats at p as fp32 lanes by F16C's convert: e5m2 is a binary16's top byte; e4m3
 * shifted into a binary16's places is worth 2^-8 of itself (fp8.h: E4M3_F16_SCALE, applied by
 * widen_row). The e4m3 shift: << 8 then >> 1 arithmetic (the sign copied into bit 14), bit 14
 * cleared. */
static inline __attribute__((always_inline)) __m256 f8x8(const uint8_t *p, int e4m3) {
    __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8);
    if (e4m3) h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xbfff));
    return _mm256_cvtph_ps(h);
}
#endif

/* n values of a row narrower than fp32 (paged_attention.c's dtype codes 1-5) -> fp32, exactly. */
static inline void widen_row(const void *src, float *dst, int n, int dtype) {
    int j = 0;
    const uint16_t *s16 = (const uint16_t *)src;
    const uint8_t *s8 = (const uint8_t *)src;
    if (dtype >= 3) {
#ifdef __F16C__
        for (; j + 8 <= n; j += 8) {
            __m256 x = dtype == 3 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s16 + j)))
                                  : f8x8(s8 + j, dtype == 4);
            if (dtype == 4) x = _mm256_mul_ps(x, _mm256_set1_ps(E4M3_F16_SCALE));
            _mm256_storeu_ps(dst + j, x);
        }
#endif
        for (; j < n; j++)
            dst[j] = dtype == 3 ? f16_to_f32(s16[j]) : dtype == 4 ? e4m3_to_f32(s8[j]) : e5m2_to_f32(s8[j]);
        return;
    }
    for (; j + 8 <= n; j += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s16 + j)));
        _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; j < n; j++) dst[j] = bf16_to_f32(s16[j]);
}

/* Rows read in place, by format: 0 fp32; 1 bf16 in pairs (a bf16 cache, head_dim % 16 == 0): a
 * 32-byte load holds 16 values, a 32-bit lane shifted left 16 is the even value as fp32, masked
 * the odd one; the split keeps queries and accumulators in that order (vector 2i: values 16i,
 * 16i + 2, .., 16i + 14; 2i + 1: 16i + 1, .., 16i + 15): no widening pass (a shuffle-port op per 8
 * values, a store and a reload); 2 fp16 (F16C's convert). 8-bit rows are always widened (see
 * the AVX2 path's CHUNKED). j: the vector's first lane. */
#define FMT_F32 0
#define FMT_BF16_PAIRS 1
#define FMT_F16 2
static inline __attribute__((always_inline)) __m256 ld8(const float *row, int j, int fmt) {
#ifdef __F16C__
    if (fmt == FMT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + j)));
#endif
    if (fmt != FMT_BF16_PAIRS) return _mm256_loadu_ps(row + j);
    __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + (j & ~15)));
    return _mm256_castsi256_ps((j & 8) ? _mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u))
                                       : _mm256_slli_epi32(x, 16));
}

/* A head_dim vector into the pairs order of ld8 (y), and back in place. */
static inline void to_pairs(const float *x, float *y, int d) {
    for (int i = 0; i < d; i += 16)
        for (int l = 0; l < 8; l++) y[i + l] = x[i + 2 * l], y[i + 8 + l] = x[i + 2 * l + 1];
}

static inline void from_pairs(float *x, int d) {
    float t[16];
    for (int i = 0; i < d; i += 16) {
        memcpy(t, x + i, sizeof t);
        for (int l = 0; l < 8; l++) x[i + 2 * l] = t[l], x[i + 2 * l + 1] = t[8 + l];
    }
}
