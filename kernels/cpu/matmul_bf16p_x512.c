/* kernels/cpu/matmul_bf16p_x512.c — fp32 math on bf16 weights in the PD_WEIGHT_PAIRS32 layout with
 * AVX-512 (matmul_bf16p.h).
 *
 * A block is 32 output columns (one block of the layout: two 64-byte loads per column pair, widened
 * into 4 registers) against up to BP_R rows of x: 2 · 2 · BP_R FMAs per column pair, their x
 * operands broadcast from xt ([k][m]: a column's rows side by side, one cache line for 16 rows),
 * 2 · BP_R accumulators in registers (24 + 4 of the 32). The rows go in groups of BP_R, so w's
 * block comes from memory once and from L1/L2 for the other groups. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/matmul_bf16p.h"

#define X512        __attribute__((target("avx512f,avx512bw,avx512vl")))
#define X512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline

enum { BP_R = 12 };

/* Bytes ahead of the column pair being read that a block prefetches its weights: without it the
 * first row group streamed w from DRAM at 14 GB/s at 8 rows (one 11264 x 1536 matrix alone), with
 * 1 KiB at 22 GB/s; in the 565 M model (1 GiB of weights) 1.5-2 KiB decoded batch 8 at 157-160
 * tok/s against 149 with 1 KiB and 145 with 512 B (2-core Xeon). */
#define BP_PREFETCH_BYTES 1536

void pd_cpu_bf16p_pack(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t b = 0; b < rows / 32; b++) {
        uint16_t *d = dst + b * 32 * cols;
        for (int64_t p = 0; p < cols; p += 2) {
            for (int r = 0; r < 32; r++, d += 2) {
                memcpy(d, src + (b * 32 + r) * cols + p, 2 * sizeof(uint16_t));
            }
        }
    }
}

size_t pd_cpu_bf16p_x_floats(int m, int k)
{
    return (size_t)m * (size_t)k;
}

void pd_cpu_bf16p_prepare(float *xt, const float *x, int m, int k)
{
    for (int p = 0; p < k; p++) { /* writes in order (rows outer was 7 % of a batch-32 step) */
        for (int i = 0; i < m; i++) {
            xt[(size_t)p * m + i] = x[(size_t)i * k + p];
        }
    }
}

/* y[i0 + i][j .. j + 32) for i < R (a constant where this is inlined). */
X512_INLINE void block(float *y, const float *xt, const uint16_t *w, const float *bias, int m, int n, int k,
                       int i0, int j, const int R)
{
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[BP_R][2];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    }
    const uint16_t *wb = w + (size_t)j * k;       /* j % 32 == 0: the block's start (backend.h) */
    const float *xc = xt + i0, *xn = xt + m + i0; /* columns p, p + 1 (matmul_cols32_x512.c) */
    for (int p = 0; p < k; p += 2, wb += 64, xc += 2 * (size_t)m, xn += 2 * (size_t)m) {
        _mm_prefetch((const char *)wb + BP_PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)wb + BP_PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m512i v0 = _mm512_loadu_si512(wb), v1 = _mm512_loadu_si512(wb + 32);
        __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)),
               o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
        __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)),
               o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
#pragma GCC unroll 12
        for (int i = 0; i < R; i++) {
            __m512 xe = _mm512_set1_ps(xc[i]), xo = _mm512_set1_ps(xn[i]);
            acc[i][0] = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, acc[i][0]));
            acc[i][1] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, acc[i][1]));
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

/* y[i][j] for every i < m, of a row-major row j of w: 16 rows of x at a time against w[j][p]
 * broadcast, FMAs in column order — the packed blocks' sums exactly. */
X512_INLINE void tail_column(float *y, const float *xt, const uint16_t *w, const float *bias, int m, int n,
                             int k, int j)
{
    const uint16_t *wr = w + (size_t)j * k;
    float b = bias != NULL ? bias[j] : 0.0f;
    for (int i0 = 0; i0 < m; i0 += 16) {
        __mmask16 lanes = (__mmask16)(m - i0 >= 16 ? 0xffff : (1u << (m - i0)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int p = 0; p < k; p++) {
            uint32_t bits = (uint32_t)wr[p] << 16;
            float wv;
            memcpy(&wv, &bits, sizeof(wv));
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, xt + (size_t)p * m + i0), _mm512_set1_ps(wv),
                                  acc);
        }
        float out[16];
        _mm512_storeu_ps(out, _mm512_add_ps(acc, _mm512_set1_ps(b)));
        for (int i = 0; i < 16 && i0 + i < m; i++) {
            y[(size_t)(i0 + i) * n + j] = out[i];
        }
    }
}

#define BLOCK_CASE(R_)                                                                                       \
    case R_: block(y, xt, w, bias, m, n, k, i0, j, R_); break

X512 void pd_cpu_bf16p_x512(float *y, const float *xt, const uint16_t *w, const float *bias, int m, int n,
                            int k, int n_packed, int n0, int n1)
{
    int j = n0;
    for (; j < n1 && j < n_packed; j += 32) {
        for (int i0 = 0; i0 < m; i0 += BP_R) {
            switch (m - i0 < BP_R ? m - i0 : BP_R) {
                PD_BF16P_ROW_CASES(BLOCK_CASE);
            }
        }
    }
    for (; j < n1; j++) {
        tail_column(y, xt, w, bias, m, n, k, j);
    }
}

X512 void pd_cpu_bf16p_widen_kn(float *tile, const uint16_t *w, int n_packed, int j0, int rows, int k)
{
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    int j = 0;
    for (; j < rows && j0 + j < n_packed; j += 32) {
        const uint16_t *wb = w + (size_t)(j0 + j) * k;
        for (int p = 0; p < k; p += 2, wb += 64) {
            float *te = tile + (size_t)p * rows + j, *to = te + rows;
            __m512i v0 = _mm512_loadu_si512(wb), v1 = _mm512_loadu_si512(wb + 32);
            _mm512_storeu_ps(te, _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)));
            _mm512_storeu_ps(te + 16, _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)));
            _mm512_storeu_ps(to, _mm512_castsi512_ps(_mm512_and_si512(v0, hi)));
            _mm512_storeu_ps(to + 16, _mm512_castsi512_ps(_mm512_and_si512(v1, hi)));
        }
    }
    for (; j < rows; j++) { /* the row-major rows after the blocks */
        const uint16_t *wr = w + (size_t)(j0 + j) * k;
        for (int p = 0; p < k; p++) {
            uint32_t bits = (uint32_t)wr[p] << 16;
            memcpy(tile + (size_t)p * rows + j, &bits, sizeof(float));
        }
    }
}
