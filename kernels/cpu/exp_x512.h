/* kernels/cpu/exp_x512.h — simd.h's softmax exps and the bf16 rounding 16 lanes at a time with
 * AVX-512 intrinsics, for kernels that keep their scores in registers.
 *
 * Bitwise what GCC makes of pd_fast_expf / pd_fast_exp2f / pd_round_bf16f in a `#pragma omp simd`
 * loop compiled for AVX-512 (gnu11 contracts a · b + c into FMAs there): the polynomial's last
 * step is fma(p·r, r, r) + 1, as `p * r * r + r + 1.0f` contracts. The form fma(p·r, r, r + 1)
 * differed from that loop on 28 % of 2^20 arguments in [-30, 0]; this one on none (2026-11-25). So
 * an intrinsic kernel and a vectorized loop give the same p. Private to kernels/cpu; the including
 * file must be x86-64 GCC. */
#ifndef PD_KERNELS_CPU_EXP_X512_H
#define PD_KERNELS_CPU_EXP_X512_H

#include <immintrin.h>

#define PD_X512_INLINE static inline __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline))

/* e^r · 2^n (n integral), pd_exp_poly's polynomial. */
PD_X512_INLINE __m512 pd_exp_poly512(__m512 r, __m512 n)
{
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* pd_fast_expf: exp(x) for x <= 0; x <= -87 (or −∞) gives 0. */
PD_X512_INLINE __m512 pd_expf512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n =
        _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                             _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, pd_exp_poly512(r, n));
}

/* pd_fast_exp2f: 2^x for x <= 0; x <= -126 (or −∞) gives 0. */
PD_X512_INLINE __m512 pd_exp2f512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 · 2^23: rounds to an integer */
    __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
    __m512 r = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945309f));
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, pd_exp_poly512(r, n));
}

/* pd_round_bf16f: each lane to the nearest bf16 (ties to even), as floats; lanes finite. */
PD_X512_INLINE __m512 pd_round_bf16_512(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

#endif
