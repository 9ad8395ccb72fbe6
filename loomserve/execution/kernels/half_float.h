/* 16-bit floats <-> fp32, shared by the C kernels (each includes it beside its source, so it
 * is part of every build's cache key). Conversions to 16 bits round to nearest even as torch's
 * .to(bfloat16) / .to(float16) do, NaN kept a quiet NaN; conversions from 16 bits are exact. */
#ifndef LOOMSERVE_HALF_FLOAT_H
#define LOOMSERVE_HALF_FLOAT_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE binary16 -> fp32: normal, subnormal, zero, inf, nan. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0x1f) {
        u = s | 0x7f800000u | (m << 13);
    } else if (e) {
        u = s | ((e + 112) << 23) | (m << 13);
    } else {  /* zero or subnormal: m x 2^-24, exact in fp32 */
        f = (float)m * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= s;
    }
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> IEEE binary16: past 65504 rounds to inf, below 2^-14 to a subnormal. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00u);
    if (a >= 0x47800000u) return (uint16_t)(s | 0x7c00u);  /* >= 65536 (and inf): inf */
    if (a < 0x38800000u) {  /* |f| < 2^-14: a multiple of 2^-24, rounded (exact product) */
        float v;
        memcpy(&v, &a, sizeof v);
        return (uint16_t)(s | (uint32_t)__builtin_rintf(v * 0x1p24f));
    }
    return (uint16_t)(s | ((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
}
#endif
