/* kernels/cpu/matmul_bf16p_dot.c — --matmul-precision bf16 on bf16 weights in PD_WEIGHT_PAIRS32
 * (matmul_bf16p.h) at few rows, with AVX512-BF16: one 64-byte load is a column pair (c, c + 1) of
 * 16 output rows as bf16 pairs, exactly what `vdpbf16ps` multiplies against x's pair (x[i][c],
 * x[i][c + 1]) broadcast, adding both products into the 16 outputs' lanes — no widening and no
 * reduction across lanes. Blocks of 32 columns × ≤ 12 rows of x (24 accumulators), the weights
 * prefetched ahead as in matmul_bf16p_x512.c. Products of two bf16 values are exact in fp32 and
 * sums fp32, so the result is pd_cpu_matmul_ref on the rounded x within summation order (the
 * hardware flushes bf16 subnormals, |v| < 1.2e-38, to zero). */
#include <immintrin.h>
#include <stdint.h>

#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/transpose_x512.h"

#define DOT_ISA    "avx512f,avx512bw,avx512vl,avx512bf16"
#define DOT        __attribute__((target(DOT_ISA)))
#define DOT_INLINE __attribute__((target(DOT_ISA), always_inline)) static inline

enum { BD_R = 12, BD_PREFETCH_BYTES = 1536 };

DOT void pd_cpu_bf16p_dot_prepare(uint32_t *xq, const float *x, int m, int k, int p0, int p1)
{
    for (int p = p0; p < p1; p += 16) {
        for (int i0 = 0; i0 < m; i0 += 16) {
            int rows = m - i0 < 16 ? m - i0 : 16;
            __m512i r[16];
            for (int i = 0; i < 16;
                 i++) { /* row i0 + i's pairs p .. p + 16, as pd_cpu_round_bf16_dot rounds */
                r[i] = _mm512_setzero_si512();
                if (i < rows) {
                    const float *src = x + (size_t)(i0 + i) * k + 2 * p;
                    __m256bh lo = _mm512_cvtneps_pbh(_mm512_loadu_ps(src));
                    __m256bh hi = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + 16));
                    r[i] = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)lo), (__m256i)hi, 1);
                }
            }
            if (m == 1) { /* one row: its pairs are xq's words already */
                _mm512_storeu_si512(xq + p, r[0]);
                continue;
            }
            pd_transpose16_epi32(r);
            __mmask16 mask = pd_tail_mask16(rows);
            for (int j = 0; j < 16; j++) {
                _mm512_mask_storeu_epi32(xq + (size_t)(p + j) * m + i0, mask, r[j]);
            }
        }
    }
}

/* y[i0 + i][j .. j + 32) for i < R (a constant where this is inlined). */
DOT_INLINE void block(float *y, const uint32_t *xq, const uint16_t *w, const float *bias, int m, int n, int k,
                      int i0, int j, const int R)
{
    __m512 acc[BD_R][2];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    }
    const uint16_t *wb = w + (size_t)j * k;
    const uint32_t *xc = xq + i0;
    for (int p = 0; p < k; p += 2, wb += 64, xc += m) {
        _mm_prefetch((const char *)wb + BD_PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)wb + BD_PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(wb), v1 = (__m512bh)_mm512_loadu_si512(wb + 32);
#pragma GCC unroll 12
        for (int i = 0; i < R; i++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xc[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], v0, xv);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], v1, xv);
        }
    }
    __m512 b0 = bias != NULL ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
    __m512 b1 = bias != NULL ? _mm512_loadu_ps(bias + j + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(y + (size_t)(i0 + i) * n + j, _mm512_add_ps(acc[i][0], b0));
        _mm512_storeu_ps(y + (size_t)(i0 + i) * n + j + 16, _mm512_add_ps(acc[i][1], b1));
    }
}

#define BLOCK_CASE(R_)                                                                                       \
    case R_: block(y, xq, w, bias, m, n, k, i0, j, R_); break

DOT void pd_cpu_bf16p_dot(float *y, const uint32_t *xq, const uint16_t *w, const float *bias, int m, int n,
                          int k, int n0, int n1)
{
    for (int j = n0; j < n1; j += 32) {
        for (int i0 = 0; i0 < m; i0 += BD_R) {
            switch (m - i0 < BD_R ? m - i0 : BD_R) {
                PD_BF16P_ROW_CASES(BLOCK_CASE);
            }
        }
    }
}

/* Rows [j0, j1) of w past the blocks, row-major: the lanes are 16 rows of x (xq[p][i0 .. i0 + 16)),
 * w's pair p broadcast — per output the products and the order of the block kernel above. */
DOT void pd_cpu_bf16p_dot_rows(float *y, const uint32_t *xq, const uint16_t *w, const float *bias, int m,
                               int n, int k, int j0, int j1)
{
    for (int j = j0; j < j1; j++) {
        const uint32_t *wj = (const uint32_t *)(const void *)(w + (size_t)j * k);
        float b = bias != NULL ? bias[j] : 0.0f;
        for (int i0 = 0; i0 < m; i0 += 16) {
            __mmask16 mask = pd_tail_mask16(m - i0);
            __m512 acc = _mm512_setzero_ps();
            for (int p = 0; p < k / 2; p++) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi32(mask, xq + (size_t)p * m + i0);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)wj[p]), xv);
            }
            float out[16];
            _mm512_storeu_ps(out, _mm512_add_ps(acc, _mm512_set1_ps(b)));
            for (int i = 0; i < 16 && i0 + i < m; i++) {
                y[(size_t)(i0 + i) * n + j] = out[i];
            }
        }
    }
}
