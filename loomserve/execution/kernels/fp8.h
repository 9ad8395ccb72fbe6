/* 8-bit floats <-> fp32 for the KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2), shared by the
 * C kernels that include it. Formats as torch's float8_e4m3fn (bias 7, no inf, NaN 0x7f / 0xff,
 * largest finite 448) and float8_e5m2 (bias 15, the top byte of an IEEE binary16, largest
 * finite 57344). Stores round to nearest even and saturate at the largest finite value, as
 * vLLM's fp8 KV writes do (torch's e4m3 cast saturates too; its e5m2 cast would give inf, so
 * the Python writes clamp first: attention/kv_dtype.py); NaN stays NaN. Loads are exact. */
#ifndef LOOMSERVE_FP8_H
#define LOOMSERVE_FP8_H
#include <stdint.h>
#include <string.h>

/* An e4m3 value's 7 magnitude bits shifted into a binary16's bit positions give a
 * binary16 worth 2^-8 of it, subnormals included (bias 15 vs 7, the subnormal scales 2^-14 vs
 * 2^-6): how the vector path widens e4m3 (F16C's convert, then x 256: paged_attention_rows.h). */
#define E4M3_F16_SCALE 256.f

static inline float e4m3_to_f32(uint8_t x) {
    uint32_t e = (x >> 3) & 0xfu, m = x & 7u;
    float f;
    if ((x & 0x7fu) == 0x7fu) {
        f = __builtin_nanf("");
    } else if (e) {
        uint32_t u = ((e + 120) << 23) | (m << 20);
        memcpy(&f, &u, sizeof f);
    } else {
        f = (float)m * 0x1p-9f;
    }
    return (x & 0x80u) ? -f : f;
}

static inline float e5m2_to_f32(uint8_t x) {
    uint32_t e = (x >> 2) & 0x1fu, m = x & 3u, u;
    float f;
    if (e == 0x1f) {
        u = 0x7f800000u | (m << 21);
        memcpy(&f, &u, sizeof f);
    } else if (e) {
        u = ((e + 112) << 23) | (m << 21);
        memcpy(&f, &u, sizeof f);
    } else {
        f = (float)m * 0x1p-16f;
    }
    return (x & 0x80u) ? -f : f;
}

/* |f| rounded to nearest even into an 8-bit float with `mbits` mantissa bits and exponent bias
 * `bias`, saturated at `maxf` (whose code is `maxc`); below the smallest normal, a multiple of
 * the subnormal step 2^(1 - bias - mbits) (the product is exact). */
static inline uint8_t f32_to_f8(float f, int mbits, int bias, float maxf, uint8_t maxc,
                                uint8_t nanc) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t s = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(s | nanc);
    float v;
    memcpy(&v, &a, sizeof v);
    if (v >= maxf) return (uint8_t)(s | maxc);
    const uint32_t min_normal = (uint32_t)(128 - bias) << 23;  /* 2^(1 - bias) */
    if (a < min_normal)
        return (uint8_t)(s | (uint32_t)__builtin_rintf(v * __builtin_ldexpf(1.f, bias - 1 + mbits)));
    const int shift = 23 - mbits;
    uint32_t r = (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u)) >> shift;
    r -= (uint32_t)(127 - bias) << mbits;
    return (uint8_t)(s | (r > maxc ? maxc : r));
}

static inline uint8_t f32_to_e4m3(float f) { return f32_to_f8(f, 3, 7, 448.f, 0x7e, 0x7f); }

static inline uint8_t f32_to_e5m2(float f) { return f32_to_f8(f, 2, 15, 57344.f, 0x7b, 0x7e); }
#endif
