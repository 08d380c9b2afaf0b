/* kernels/cpu/attention_bf16.h — attention under --matmul-precision bf16 with a bf16 KV cache.
 *
 * Every CPU attention path (the GEMM-tiled prefill item, the per-key item, the split-K decode
 * kernel) computes the same roundings, so a token's result does not depend on how its sequence
 * was chunked or batched (as the bf16 matmuls, matmul_bf16.h):
 *
 *   q̂    = bf16(q · scale · log2 e)     the query, pre-scaled into the log2 domain
 *   s_j  = Σ_d q̂_d · k_jd              bf16 × bf16 products are exact in fp32; fp32 sums
 *   m    = ⌈max of the s seen so far⌉   the running max is an integer
 *   p̂_j  = bf16(2^(s_j − m))            the weights the P·V product takes
 *   o    = Σ_j p̂_j · v_j / Σ_j p̂_j     exact products, fp32 sums
 *
 * Because m is an integer, 2^(s − m) under two different running maxima (a different tiling of
 * the keys) differ by an exact power of two (pd_fast_exp2f), and so do their bf16 roundings, and
 * the rescale 2^(m_old − m_new) of the accumulators is exact. Paths then differ only in the fp32
 * summation order of s, which moves a p̂ to its bf16 neighbour about once in 10⁴ keys.
 * pd_cpu_paged_attention_bf16_ref (cpu_ops.h) is the plain reference. With an fp32 or fp16 KV
 * cache, or fp32 matmul precision, attention is fp32 throughout (attention.c). */
#ifndef PD_KERNELS_CPU_ATTENTION_BF16_H
#define PD_KERNELS_CPU_ATTENTION_BF16_H

#include <math.h>

#include "kernels/backend.h"
#include "kernels/cpu/simd.h"

#define PD_LOG2E 1.44269504088896341f

/* Whether attention runs the bf16 math above for this backend and cache. */
static inline int pd_cpu_attn_bf16_math(const pd_backend_t *be, const pd_kv_view_t *kv)
{
    return be->matmul_precision == PD_MATMUL_BF16 && kv->dtype == PD_DTYPE_BF16;
}

/* q̂: dst[d] = bf16(src[d] · scale · log2 e) for d < D, as floats. */
static inline void pd_attn_bf16_query(float *dst, const float *src, float scale, int D)
{
    const float f = scale * PD_LOG2E;
    for (int d = 0; d < D; d++) {
        dst[d] = pd_round_bf16f(src[d] * f);
    }
}

/* The new running max: the old one, or ⌈block_max⌉ when that is larger. */
static inline float pd_attn_bf16_max(float m_old, float block_max)
{
    float c = ceilf(block_max);
    return c > m_old ? c : m_old;
}

#endif
