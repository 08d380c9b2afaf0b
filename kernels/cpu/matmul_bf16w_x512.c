/* kernels/cpu/matmul_bf16w_x512.c — fp32 math on bf16 weights for a few rows of x (decode
 * batches), with the weights widened in AVX-512 registers.
 *
 * A 64-byte load holds 32 bf16 weights; as 16 32-bit lanes, a shift left by 16 gives the even-
 * indexed weights as fp32 and a mask of the high halves the odd ones (exact: bf16 is fp32's top
 * half). x is copied once per matmul into the same order (each 32-float group as its 16 even then
 * its 16 odd elements, the last group zero-padded), so there is no shuffle in the loop. A block is
 * BW_R rows of w against up to BW_M rows of x: 2 · BW_R · BW_M FMAs per 32 weights for BW_R loads
 * and 2 · BW_R widening ops, the accumulators in registers (24 + 6 of the 32). The m rows of x go
 * in chunks of BW_M, so w's rows come from memory once and from L1 for the other chunks.
 *
 * Each y[i][j] is summed in one order whatever m, the chunk or the thread's columns (lanes over
 * the groups of 32, then a fixed reduction): a row's result is the same alone as in a batch.
 *
 * fp32 weights (pd_cpu_f32w_x512) take the same blocks with each group of 32 as two 16-float loads
 * in their own order (x copied unpermuted), in place of sgemm at 2-64 rows, which packed w on
 * every call: 565 M model with fp32 weights, batch 8 at 47 tok/s (w read at ~13 GB/s) and batch 32
 * at ~142 GFLOP/s (pd-bench-ops, 2026-11-25). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/matmul_lowp.h"

#define X512        __attribute__((target("avx512f,avx512bw,avx512vl")))
#define X512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline

enum { BW_R = 3, BW_M = 8 };

size_t pd_cpu_bf16w_x512_floats(int m, int k)
{
    return (size_t)m * (size_t)((k + 31) & ~31);
}

X512 void pd_cpu_bf16w_x512_prepare(float *xp, const float *x, int m, int k)
{
    int kp = (k + 31) & ~31, k32 = k & ~31;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int i = 0; i < m; i++) {
        const float *xr = x + (size_t)i * k;
        float *pr = xp + (size_t)i * kp;
        for (int g = 0; g < k32; g += 32) {
            __m512 a = _mm512_loadu_ps(xr + g), b = _mm512_loadu_ps(xr + g + 16);
            _mm512_storeu_ps(pr + g, _mm512_permutex2var_ps(a, even, b));
            _mm512_storeu_ps(pr + g + 16, _mm512_permutex2var_ps(a, odd, b));
        }
        for (int e = 0; k32 < kp && e < 16; e++) { /* the last group, zero-padded */
            pr[k32 + e] = k32 + 2 * e < k ? xr[k32 + 2 * e] : 0.0f;
            pr[k32 + 16 + e] = k32 + 2 * e + 1 < k ? xr[k32 + 2 * e + 1] : 0.0f;
        }
    }
}

X512 void pd_cpu_f32w_x512_prepare(float *xp, const float *x, int m, int k)
{
    int kp = (k + 31) & ~31;
    for (int i = 0; i < m; i++) {
        memcpy(xp + (size_t)i * kp, x + (size_t)i * k, (size_t)k * sizeof(float));
        memset(xp + (size_t)i * kp + k, 0, (size_t)(kp - k) * sizeof(float));
    }
}

/* y[i0 + i][j + r] for i < M, r < R: R rows of w from row j against M rows of xp from row i0
 * (R, M and f32 — w fp32 rather than bf16 — are constants where this is inlined). */
X512_INLINE void block(float *y, const float *xp, const void *w, const float *bias, int n, int k, int i0,
                       int j, const int R, const int M, const int f32)
{
    const int kp = (k + 31) & ~31, k32 = k & ~31;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[BW_R][BW_M];
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            acc[r][i] = _mm512_setzero_ps();
        }
    }
    const uint16_t *wr = (const uint16_t *)w + (size_t)j * k;
    const float *wf = (const float *)w + (size_t)j * k;
    const float *xr = xp + (size_t)i0 * kp;
    for (int p = 0; p < kp; p += 32) {
        __m512 ev[BW_R], od[BW_R];
        /* the last group: the weights past k read as zeros (x is zero there too) */
        __mmask32 lanes = p < k32 ? ~(__mmask32)0 : (__mmask32)((1ull << (k - k32)) - 1);
#pragma GCC unroll 3
        for (int r = 0; r < R && f32; r++) { /* each 32 in their order, x likewise */
            _mm_prefetch((const char *)(wf + (size_t)(r + R) * k + p), _MM_HINT_T0);
            _mm_prefetch((const char *)(wf + (size_t)(r + R) * k + p + 16), _MM_HINT_T0);
            ev[r] = _mm512_maskz_loadu_ps((__mmask16)lanes, wf + (size_t)r * k + p);
            od[r] = _mm512_maskz_loadu_ps((__mmask16)(lanes >> 16), wf + (size_t)r * k + p + 16);
        }
#pragma GCC unroll 3
        for (int r = 0; r < R && !f32; r++) {
            /* the same place in the next block's row: a whole block of lead, so the first chunk
             * streams w from DRAM without waiting (m = 8 from DRAM: 120 → 160 GFLOP/s) */
            _mm_prefetch((const char *)(wr + (size_t)(r + R) * k + p), _MM_HINT_T0);
            __m512i v = _mm512_maskz_loadu_epi16(lanes, wr + (size_t)r * k + p);
            ev[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            od[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            __m512 xe = _mm512_loadu_ps(xr + (size_t)i * kp + p),
                   xo = _mm512_loadu_ps(xr + (size_t)i * kp + p + 16);
            /* in registers: GCC would fold each load into every FMA that uses it (3 loads of each x
             * vector per step; the loads, not the FMAs, then bound the loop) */
            __asm__("" : "+v"(xe), "+v"(xo));
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) {
                acc[r][i] = _mm512_fmadd_ps(od[r], xo, _mm512_fmadd_ps(ev[r], xe, acc[r][i]));
            }
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) {
        float b = bias != NULL ? bias[j + r] : 0.0f;
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            y[(size_t)(i0 + i) * n + j + r] = _mm512_reduce_add_ps(acc[r][i]) + b;
        }
    }
}

#define BLOCK_CASE(M_)                                                                                       \
    case M_: block(y, xp, w, bias, n, k, i0, j, R, M_, f32); break

/* Every row of x, BW_M at a time, against R rows of w from row j (read from memory by the first
 * chunk, from L1 by the others). */
X512_INLINE void all_rows(float *y, const float *xp, const void *w, const float *bias, int m, int n, int k,
                          int j, const int R, const int f32)
{
    for (int i0 = 0; i0 < m; i0 += BW_M) {
        switch (m - i0 < BW_M ? m - i0 : BW_M) {
            BLOCK_CASE(1);
            BLOCK_CASE(2);
            BLOCK_CASE(3);
            BLOCK_CASE(4);
            BLOCK_CASE(5);
            BLOCK_CASE(6);
            BLOCK_CASE(7);
            BLOCK_CASE(8);
        }
    }
}

X512 void pd_cpu_bf16w_x512(float *y, const float *xp, const uint16_t *w, const float *bias, int m, int n,
                            int k, int n0, int n1)
{
    int j = n0;
    for (; j + BW_R <= n1; j += BW_R) {
        all_rows(y, xp, w, bias, m, n, k, j, BW_R, 0);
    }
    for (; j < n1; j++) {
        all_rows(y, xp, w, bias, m, n, k, j, 1, 0);
    }
}

X512 void pd_cpu_f32w_x512(float *y, const float *xp, const float *w, const float *bias, int m, int n, int k,
                           int n0, int n1)
{
    int j = n0;
    for (; j + BW_R <= n1; j += BW_R) {
        all_rows(y, xp, w, bias, m, n, k, j, BW_R, 1);
    }
    for (; j < n1; j++) {
        all_rows(y, xp, w, bias, m, n, k, j, 1, 1);
    }
}
