/* kernels/cpu/simd.h — helpers for the optimized CPU ops: kernels compiled twice (AVX2+FMA+F16C and
 * baseline x86-64) and chosen by the ISA cap, and a vectorizable exp. */
#ifndef PD_KERNELS_CPU_SIMD_H
#define PD_KERNELS_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

#include "kernels/cpu/isa.h"

/* A kernel compiled twice, for x86-64-v3 (AVX2, FMA, F16C) and for baseline x86-64, and chosen per
 * call by the ISA cap (pd_cpu_isa_usable(PD_ISA_AVX2)), so PD_CPU_ISA=portable runs — and its test
 * runs check — the baseline build on any machine (GCC's target_clones, used before, chose by the CPU
 * alone: the baseline build never ran on an AVX2 machine). Write the body as
 *     PD_CPU_BODY void name_body(params) { ... }
 * then PD_CPU_VARIANTS_VOID(name, (params), (args)), or PD_CPU_VARIANTS(ret, name, ...) for a value.
 * Under TSan (whose runtime mishandled the clones' ifunc) and off x86 GCC: one build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define PD_CPU_BODY static inline __attribute__((always_inline))
#define PD_CPU_VARIANTS(ret, name, params, args)                                                             \
    __attribute__((target("arch=x86-64-v3"))) static ret name##_avx2 params                                  \
    {                                                                                                        \
        return name##_body args;                                                                             \
    }                                                                                                        \
    static ret name##_portable params                                                                        \
    {                                                                                                        \
        return name##_body args;                                                                             \
    }                                                                                                        \
    static ret name params                                                                                   \
    {                                                                                                        \
        return pd_cpu_isa_usable(PD_ISA_AVX2) ? name##_avx2 args : name##_portable args;                     \
    }
#define PD_CPU_VARIANTS_VOID(name, params, args)                                                             \
    __attribute__((target("arch=x86-64-v3"))) static void name##_avx2 params                                 \
    {                                                                                                        \
        name##_body args;                                                                                    \
    }                                                                                                        \
    static void name##_portable params                                                                       \
    {                                                                                                        \
        name##_body args;                                                                                    \
    }                                                                                                        \
    static void name params                                                                                  \
    {                                                                                                        \
        if (pd_cpu_isa_usable(PD_ISA_AVX2)) {                                                                \
            name##_avx2 args;                                                                                \
        } else {                                                                                             \
            name##_portable args;                                                                            \
        }                                                                                                    \
    }
#else
#define PD_CPU_BODY static inline
#define PD_CPU_VARIANTS(ret, name, params, args)                                                             \
    static ret name params                                                                                   \
    {                                                                                                        \
        return name##_body args;                                                                             \
    }
#define PD_CPU_VARIANTS_VOID(name, params, args)                                                             \
    static void name params                                                                                  \
    {                                                                                                        \
        name##_body args;                                                                                    \
    }
#endif

/* Whether the CPU runs AVX-512 F, BW and VL (the kernels' AVX-512 paths need all three). */
static inline int pd_cpu_avx512_usable(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    return pd_cpu_isa_cap() >= PD_ISA_AVX512 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* The lane mask of a 16-lane step with `left` elements still to go: all 16, or the first `left`. */
static inline uint16_t pd_tail_mask16(long left)
{
    return left >= 16 ? (uint16_t)0xffff : (uint16_t)((1u << left) - 1);
}

/* e^r · 2^n for |r| <= ln 2 / 2 and an integer n in [-126, 127]: the polynomial of both exps. */
static inline float pd_exp_poly(float r, float n)
{
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* exp(x) for x <= 0 (softmax arguments), relative error < 2e-7; -inf or very small x gives 0.
 * Branch-free so loops around it vectorize. */
static inline float pd_fast_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float out = pd_exp_poly(r, n);
    return x <= -87.0f ? 0.0f : out;
}

/* 2^x for x <= 0 (softmax in the log2 domain, kernels/cpu/attention_bf16.h), relative error
 * < 2e-7; x <= -126 gives 0. x is split as n + f with n the nearest integer (ties to even) and
 * f = x − n exact, and 2^f is pd_fast_expf's polynomial at f·ln 2: for an integer k,
 * pd_fast_exp2f(x − k) is exactly pd_fast_exp2f(x) · 2^−k (while x − k is exact, the result is
 * normal, and x is not halfway between integers). Branch-free, so loops around it vectorize
 * (with -fno-trapping-math, as the kernels build: CMakeLists.txt). */
static inline float pd_fast_exp2f(float x)
{
    x = x < -126.0f ? -126.0f : x;
    float n = (x + 12582912.0f) - 12582912.0f; /* 1.5 · 2^23: rounds x to an integer */
    float r = (x - n) * 0.693147180559945309f;
    float out = pd_exp_poly(r, n);
    return x <= -126.0f ? 0.0f : out;
}

/* f rounded to the nearest bf16 (ties to even), as a float; f finite. pd_f32_to_bf16
 * (dtype_impl.h) without its NaN case: that branch kept the softmax loops scalar (bf16 prefill
 * attention 164 against 194 GFLOP/s, pd-bench-ops). */
static inline float pd_round_bf16f(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

#endif
