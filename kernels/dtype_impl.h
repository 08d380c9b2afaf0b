/* kernels/dtype_impl.h — storage dtypes of weights and KV cache, and exact scalar conversions
 * shared by every backend (compute is always fp32). */
#ifndef PD_KERNELS_DTYPE_IMPL_H
#define PD_KERNELS_DTYPE_IMPL_H

#include <stdint.h>
#include <string.h>

#include "kernels/pd_hd.h"

typedef enum pd_dtype {
    PD_DTYPE_F32 = 0,
    PD_DTYPE_F16 = 1,
    PD_DTYPE_BF16 = 2,
    PD_DTYPE_I8 = 3, /* weights only (--quantization int8): values × a per-row scale (pd_weight_t) */
} pd_dtype_t;

PD_HD static inline int pd_dtype_size(pd_dtype_t dt)
{
    return dt == PD_DTYPE_F32 ? 4 : dt == PD_DTYPE_I8 ? 1 : 2;
}

PD_HD static inline uint32_t pd_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

PD_HD static inline float pd_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bf16 → f32 is exact (the top 16 bits). */
PD_HD static inline float pd_bf16_to_f32(uint16_t h)
{
    return pd_bits_f32((uint32_t)h << 16);
}

/* f32 → bf16 with round-to-nearest-even; NaN stays NaN. */
PD_HD static inline uint16_t pd_f32_to_bf16(float f)
{
    uint32_t u = pd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 0x40);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE half → f32, exact, including subnormals, inf and NaN. */
PD_HD static inline float pd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else {
        /* subnormal: value = mant × 2^-24, normalise it */
        int e = -1;
        do {
            e++;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        u = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    return pd_bits_f32(u);
}

/* f32 → IEEE half, round-to-nearest-even, overflow to inf. */
PD_HD static inline uint16_t pd_f32_to_f16(float f)
{
    uint32_t u = pd_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return (uint16_t)(sign | 0x7e00u);
    }
    if (a >= 0x477ff000u) { /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (a < 0x33000000u) {
            return (uint16_t)sign;
        }
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t half = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u))) {
            half++;
        }
        return (uint16_t)(sign | half);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u; /* rebias 127 → 15 */
    return (uint16_t)(sign | (r >> 13));
}

/* Reads element i of a buffer of dtype dt as f32 (int8: the integer, unscaled). */
PD_HD static inline float pd_dtype_load(const void *base, int64_t i, pd_dtype_t dt)
{
    if (dt == PD_DTYPE_F32) {
        return ((const float *)base)[i];
    }
    if (dt == PD_DTYPE_I8) {
        return (float)((const int8_t *)base)[i];
    }
    uint16_t h = ((const uint16_t *)base)[i];
    return dt == PD_DTYPE_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h);
}

/* Writes f32 value x as element i of a buffer of dtype dt (rounding to nearest even; int8: to the
 * nearest integer, clamped to [-127, 127]). */
PD_HD static inline void pd_dtype_store(void *base, int64_t i, pd_dtype_t dt, float x)
{
    if (dt == PD_DTYPE_F32) {
        ((float *)base)[i] = x;
    } else if (dt == PD_DTYPE_I8) {
        float r = x < -127.0f ? -127.0f : x > 127.0f ? 127.0f : x;
        ((int8_t *)base)[i] = (int8_t)(r < 0 ? r - 0.5f : r + 0.5f);
    } else if (dt == PD_DTYPE_BF16) {
        ((uint16_t *)base)[i] = pd_f32_to_bf16(x);
    } else {
        ((uint16_t *)base)[i] = pd_f32_to_f16(x);
    }
}

#endif
