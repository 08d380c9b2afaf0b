/* kernels/cpu/matmul_bf16dot_x86.c — the decode GEMV of --matmul-precision bf16 (matmul_bf16.h), up to
 * PD_BF16DOT_MAX_M rows:
 * x already rounded to bf16, w bf16 as stored, and AVX512-BF16's `vdpbf16ps`, which multiplies 32
 * bf16 pairs exactly and adds them into 16 fp32 lanes, so neither side is widened.
 *
 * A block of 4 rows of w is streamed against up to 4 rows of x at a time (16 accumulators in
 * registers beside the loads); further passes take the next 4 rows of x and read the block's w
 * again from L1/L2. Every pass also prefetches a share of the next block's rows into L2 (pass q
 * of P takes rows [4q/P, 4(q+1)/P)), so DRAM streams the next block while this one computes, on
 * the passes that read L1 too. Without it the second pass at 8 rows left DRAM idle: 20-24 GB/s of
 * w at 8 rows against 29-31 with it, and 24-25 against 32-34 at 1 to 4 rows (2 threads, k = 1536
 * and 5632, w ≫ L3). (Two w rows against 8 x rows in one pass kept only two DRAM streams per
 * thread: 19 GB/s of w at k = 1536 against 26 for four. Cutting k into chunks whose x fits L1 was
 * slower: rows read in 2 KiB pieces defeat the prefetchers.) The k % 32 tail is a masked load
 * (zeros add nothing). Each accumulator's 16 lanes are summed at the end. The hardware flushes
 * bf16 subnormals (|v| < 1.2e-38) to zero; otherwise the result is pd_cpu_matmul_ref on the
 * rounded x within fp32 summation-order rounding. */
#include <immintrin.h>
#include <stdint.h>

#include "kernels/cpu/matmul_bf16.h"
#include "kernels/cpu/simd.h"

#define DOT_ISA    "avx512f,avx512bw,avx512vl,avx512bf16"
#define DOT        __attribute__((target(DOT_ISA)))
#define DOT_INLINE __attribute__((target(DOT_ISA), always_inline)) static inline

/* How far ahead of the dot products each w row stream is prefetched (as the AVX2 GEMV does). */
#ifndef DOT_PREFETCH_BYTES
#define DOT_PREFETCH_BYTES 512
#endif

int pd_cpu_bf16dot_usable(void)
{
    return pd_cpu_isa_cap() >= PD_ISA_AVX512_BF16 && pd_cpu_avx512_usable() &&
           __builtin_cpu_supports("avx512bf16");
}

/* 32 bf16 values at p, the first `valid` of them (the rest zero). */
DOT_INLINE __m512bh load32(const uint16_t *p, int valid)
{
    if (valid >= 32) {
        return (__m512bh)_mm512_loadu_si512((const void *)p);
    }
    __mmask32 mask = (__mmask32)((1ull << valid) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* y rows [i0, i0 + MB) (MB ≤ 4) at columns j .. j+JB-1 (JB ≤ 4): one pass over k, prefetching rows
 * [pf0, pf1) of the next block wn (NULL: none) into L2. */
DOT_INLINE void block(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int i0, int MB,
                      int n, int k, int j, int JB, const uint16_t *wn, int pf0, int pf1)
{
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int b = 0; b < JB; b++) {
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            acc[b][i] = _mm512_setzero_ps();
        }
    }
    const uint16_t *wr = w + (size_t)j * k, *xr = xb + (size_t)i0 * k;
    for (int p = 0; p < k; p += 32) {
        int valid = k - p;
        __m512bh wv[4];
#pragma GCC unroll 4
        for (int b = 0; b < JB; b++) {
            if (i0 == 0) { /* later passes find the block in L1/L2 */
                _mm_prefetch((const char *)(wr + (size_t)b * k + p) + DOT_PREFETCH_BYTES, _MM_HINT_T0);
            }
            wv[b] = load32(wr + (size_t)b * k + p, valid);
        }
        for (int b = pf0; wn != NULL && b < pf1; b++) {
            _mm_prefetch((const char *)(wn + (size_t)b * k + p), _MM_HINT_T1);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            __m512bh xv = load32(xr + (size_t)i * k + p, valid);
#pragma GCC unroll 4
            for (int b = 0; b < JB; b++) {
                acc[b][i] = _mm512_dpbf16_ps(acc[b][i], wv[b], xv);
            }
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < JB; b++) {
        float bj = bias != NULL ? bias[j + b] : 0.0f;
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) {
            y[(size_t)(i0 + i) * n + j + b] = _mm512_reduce_add_ps(acc[b][i]) + bj;
        }
    }
}

/* The passes of up to 4 x rows over the JB rows of w at column j (MB and JB are constants in each
 * case, so the accumulators are registers); the next block of 4 rows, when it is below n1, is
 * prefetched across the passes. */
DOT_INLINE void blocks(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int m, int n,
                       int k, int j, int JB, int n1)
{
    const uint16_t *wn = j + JB + 4 <= n1 ? w + (size_t)(j + JB) * k : NULL;
    int passes = (m + 3) / 4;
    for (int i0 = 0, q = 0; i0 < m; i0 += 4, q++) {
        int pf0 = 4 * q / passes, pf1 = 4 * (q + 1) / passes;
        switch (m - i0) {
        case 1: block(y, xb, w, bias, i0, 1, n, k, j, JB, wn, pf0, pf1); break;
        case 2: block(y, xb, w, bias, i0, 2, n, k, j, JB, wn, pf0, pf1); break;
        case 3: block(y, xb, w, bias, i0, 3, n, k, j, JB, wn, pf0, pf1); break;
        default: block(y, xb, w, bias, i0, 4, n, k, j, JB, wn, pf0, pf1); break;
        }
    }
}

/* v widened from bf16 (exact). */
DOT_INLINE __m512 widen16(__m256bh h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

DOT void pd_cpu_round_bf16_dot(uint16_t *dst, const float *src, size_t n)
{
    for (size_t p = 0; p < n; p += 16) {
        __mmask16 mask = pd_tail_mask16((long)(n - p));
        __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + p));
        _mm256_mask_storeu_epi16(dst + p, mask, (__m256i)h);
    }
}

DOT void pd_cpu_split_bf16x3(uint16_t *dst, const float *x, int k)
{
    for (int p = 0; p < k; p += 16) {
        __mmask16 mask = pd_tail_mask16(k - p);
        __m512 v = _mm512_maskz_loadu_ps(mask, x + p);
        __m256bh hi = _mm512_cvtneps_pbh(v); /* round to nearest even */
        __m512 r1 = _mm512_sub_ps(v, widen16(hi));
        __m256bh mid = _mm512_cvtneps_pbh(r1);
        __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen16(mid)));
        _mm256_mask_storeu_epi16(dst + p, mask, (__m256i)hi);
        _mm256_mask_storeu_epi16(dst + k + p, mask, (__m256i)mid);
        _mm256_mask_storeu_epi16(dst + 2 * k + p, mask, (__m256i)lo);
    }
}

DOT void pd_cpu_gemv_bf16dot(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int m, int n,
                             int k, int n0, int n1)
{
    int j = n0;
    for (; j + 4 <= n1; j += 4) {
        blocks(y, xb, w, bias, m, n, k, j, 4, n1);
    }
    for (; j < n1; j++) {
        blocks(y, xb, w, bias, m, n, k, j, 1, n1);
    }
}
