/* kernels/cpu/simd.h — helpers for the optimized CPU ops: runtime-dispatched clones (AVX2+FMA+F16C
 * where the CPU has them, baseline x86-64 otherwise) and a vectorizable exp. */
#ifndef PD_KERNELS_CPU_SIMD_H
#define PD_KERNELS_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

/* The function is compiled twice and picked at load time by the CPU's features (ifunc). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define PD_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PD_CPU_CLONES
#endif

/* exp(x) for x <= 0 (softmax arguments), relative error < 2e-7; -inf or very small x gives 0.
 * Branch-free so loops around it vectorize. */
static inline float pd_fast_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
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
    float out = p * scale;
    return x <= -87.0f ? 0.0f : out;
}

#endif
