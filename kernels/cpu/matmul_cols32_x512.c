/* kernels/cpu/matmul_cols32_x512.c — fp32 math on int8 and fp32 weights in the PD_WEIGHT_COLS32
 * layout with AVX-512 (matmul_cols32.h).
 *
 * A block is 32 output rows of w (one block of the layout: int8, a 64-byte load is two of its
 * columns, widened into 4 registers; fp32, a column is two loads) against up to IP_R rows of x:
 * 2 · 2 · IP_R FMAs per column pair, their x operands broadcast from xt ([k][m]), 2 · IP_R
 * accumulators in registers (24 + 4 of the 32). The rows of x go in groups of IP_R, so a block of
 * w comes from memory once and from L1/L2 for the other groups; the weights are prefetched ahead
 * as in matmul_bf16p_x512.c, the same number of columns ahead for both dtypes. One block function
 * serves both, the dtype a constant where it is inlined. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/matmul_cols32.h"

#define X512        __attribute__((target("avx512f,avx512bw,avx512vl")))
#define X512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline

enum { IP_R = 12, IP_PREFETCH_COLUMNS = 48 };

/* The layout for elements of `size` bytes (pd_cpu_i8p_pack, pd_cpu_f32p_pack). */
static void pack(char *dst, const char *src, int64_t rows, int64_t cols, size_t size, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t b = 0; b < rows / 32; b++) {
        char *d = dst + (size_t)(b * 32 * cols) * size;
        for (int64_t c = 0; c < cols; c++) {
            for (int r = 0; r < 32; r++, d += size) {
                memcpy(d, src + (size_t)((b * 32 + r) * cols + c) * size, size);
            }
        }
    }
}

void pd_cpu_i8p_pack(int8_t *dst, const int8_t *src, int64_t rows, int64_t cols, int num_threads)
{
    pack((char *)dst, (const char *)src, rows, cols, 1, num_threads);
}

void pd_cpu_f32p_pack(float *dst, const float *src, int64_t rows, int64_t cols, int num_threads)
{
    pack((char *)dst, (const char *)src, rows, cols, sizeof(float), num_threads);
}

/* Column c of a block's 32 rows (32 bytes at p) as fp32: rows 0-15 and 16-31. */
X512_INLINE void widen_column(const int8_t *p, __m512 *lo, __m512 *hi)
{
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
}

/* Column c of a block (int8 at wb + c · 32, or fp32 at wb + c · 128 bytes) as fp32. */
X512_INLINE void load_column(const char *wb, int64_t c, const int F32, __m512 *lo, __m512 *hi)
{
    if (F32) {
        *lo = _mm512_loadu_ps(wb + c * 128);
        *hi = _mm512_loadu_ps(wb + c * 128 + 64);
    } else {
        widen_column((const int8_t *)wb + c * 32, lo, hi);
    }
}

/* acc[i] += column (lo, hi) · x[i][c] for i < R, x[i][c] at xc[i]. */
#define IP_COLUMN(lo, hi, xc)                                                                                \
    do {                                                                                                     \
        _Pragma("GCC unroll 12") for (int i = 0; i < R; i++)                                                 \
        {                                                                                                    \
            __m512 xv = _mm512_set1_ps((xc)[i]);                                                             \
            acc[i][0] = _mm512_fmadd_ps(lo, xv, acc[i][0]);                                                  \
            acc[i][1] = _mm512_fmadd_ps(hi, xv, acc[i][1]);                                                  \
        }                                                                                                    \
    } while (0)

/* y[i0 + i][j .. j + 32) for i < R (a constant where this is inlined), of w int8 (scale [n]) or
 * fp32 (F32, scale NULL: the sums plus the bias). */
X512_INLINE void block(float *y, const float *xt, const void *w, const float *scale, const float *bias, int m,
                       int n, int k, int i0, int j, const int R, const int F32, const char *pf,
                       size_t pf_step)
{
    __m512 acc[IP_R][2];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    }
    const size_t col_bytes = F32 ? 128 : 32;
    const char *wb = (const char *)w + (size_t)j * k * (col_bytes / 32); /* j % 32 == 0: the block */
    const float *xc = xt + i0, *xn = xt + m + i0; /* columns p and p + 1: two bases, so each x is
                                                    * one base plus a constant (one base and m
                                                    * spilled 5 index registers at 12 rows) */
    /* lines of the next block into L2 per column pair: 2 (fp32) or 1 (pf_step <= this), none when
     * blocks() asks for no such stream (pf_step 0) */
    const size_t pf_lines = pf_step > 0 ? col_bytes / 64 : 0;
    int p = 0;
    for (; p + 2 <= k; p += 2, wb += 2 * col_bytes, xc += 2 * (size_t)m, xn += 2 * (size_t)m) {
        for (size_t l = 0; l < 2 * col_bytes; l += 64) {
            _mm_prefetch(wb + IP_PREFETCH_COLUMNS * col_bytes + l, _MM_HINT_T0);
        }
        for (size_t l = 0; l < pf_lines; l++) {
            _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
        }
        pf += pf_step;
        __m512 lo0, hi0, lo1, hi1;
        load_column(wb, 0, F32, &lo0, &hi0);
        load_column(wb, 1, F32, &lo1, &hi1);
        IP_COLUMN(lo0, hi0, xc);
        IP_COLUMN(lo1, hi1, xn);
    }
    if (p < k) { /* an odd k's last column */
        __m512 lo, hi;
        load_column(wb, 0, F32, &lo, &hi);
        IP_COLUMN(lo, hi, xc);
    }
    __m512 s0 = F32 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(scale + j);
    __m512 s1 = F32 ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(scale + j + 16);
    __m512 b0 = bias != NULL ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
    __m512 b1 = bias != NULL ? _mm512_loadu_ps(bias + j + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) { /* fp32: fma(Σ, 1, b) is Σ + b, rounded once */
        _mm512_storeu_ps(y + (size_t)(i0 + i) * n + j, _mm512_fmadd_ps(acc[i][0], s0, b0));
        _mm512_storeu_ps(y + (size_t)(i0 + i) * n + j + 16, _mm512_fmadd_ps(acc[i][1], s1, b1));
    }
}

/* y[i][j] for every i < m, of a row-major row j of w (int8, or fp32 with scale NULL): 16 rows of x
 * at a time against w[j][p] broadcast, FMAs in column order — the packed blocks' sums exactly. */
X512_INLINE void tail_row(float *y, const float *xt, const void *w, const float *scale, const float *bias,
                          int m, int n, int k, int j, const int F32)
{
    const int8_t *wq = (const int8_t *)w + (size_t)j * k;
    const float *wf = (const float *)w + (size_t)j * k;
    __m512 s = _mm512_set1_ps(F32 ? 1.0f : scale[j]), b = _mm512_set1_ps(bias != NULL ? bias[j] : 0.0f);
    for (int i0 = 0; i0 < m; i0 += 16) {
        __mmask16 lanes = (__mmask16)(m - i0 >= 16 ? 0xffff : (1u << (m - i0)) - 1);
        __m512 acc = _mm512_setzero_ps();
        for (int p = 0; p < k; p++) {
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, xt + (size_t)p * m + i0),
                                  _mm512_set1_ps(F32 ? wf[p] : (float)wq[p]), acc);
        }
        float out[16];
        _mm512_storeu_ps(out, _mm512_fmadd_ps(acc, s, b));
        for (int i = 0; i < 16 && i0 + i < m; i++) {
            y[(size_t)(i0 + i) * n + j] = out[i];
        }
    }
}

#define BLOCK_CASE(R_)                                                                                       \
    case R_:                                                                                                 \
        block(y, xt, w, scale, bias, m, n, k, i0, j, R_, F32, pf + g * (size_t)(k / 2) * step, step);        \
        break

/* pd_cpu_i8p_x512 (F32 0) and pd_cpu_f32p_x512 (F32 1). */
X512_INLINE void blocks(float *y, const float *xt, const void *w, const float *scale, const float *bias,
                        int m, int n, int k, int n_packed, int n0, int n1, const int F32)
{
    /* With G row groups the first streams the block from memory and the others read it from L2;
     * so every group also prefetches 1/G of the next block into L2, step bytes per column pair,
     * and memory is read during every group, not only the first. Prefetches past the weights do
     * not fault. (Group 1 of 3 fetching it all read 16.5 GB/s at 32 rows of a 384 MiB matrix.)
     * One row of x against fp32 weights (single-stream decode) reads each block once, and the
     * prefetch 48 columns ahead keeps its one stream going: a second stream into the next block only
     * costs line-fill buffers (the 565 M model at batch 1 on a 2-core Xeon: 9.3-10.6 -> 10.9-11.7
     * tok/s at avx512 and amx, alternated; int8 weights, a quarter of the bytes, within the noise
     * either way, so kept; at batch 8 it pays: fp32 75 tok/s with it, 65 without). */
    int G = (m + IP_R - 1) / IP_R;
    size_t step = F32 && m == 1 ? 0 : (((F32 ? 256 : 64) / (size_t)G) + 3) & ~(size_t)3;
    int j = n0;
    for (; j < n1 && j < n_packed; j += 32) {
        const char *pf = (const char *)w + (size_t)(j + 32) * k * (F32 ? 4 : 1);
        for (int i0 = 0, g = 0; i0 < m; i0 += IP_R, g++) {
            switch (m - i0 < IP_R ? m - i0 : IP_R) {
                PD_BF16P_ROW_CASES(BLOCK_CASE);
            }
        }
    }
    for (; j < n1; j++) {
        tail_row(y, xt, w, scale, bias, m, n, k, j, F32);
    }
}

X512 void pd_cpu_i8p_x512(float *y, const float *xt, const int8_t *w, const float *scale, const float *bias,
                          int m, int n, int k, int n_packed, int n0, int n1)
{
    blocks(y, xt, w, scale, bias, m, n, k, n_packed, n0, n1, 0);
}

X512 void pd_cpu_f32p_x512(float *y, const float *xt, const float *w, const float *bias, int m, int n, int k,
                           int n_packed, int n0, int n1)
{
    blocks(y, xt, w, NULL, bias, m, n, k, n_packed, n0, n1, 1);
}

X512 void pd_cpu_i8p_widen_kn(float *tile, const int8_t *w, const float *scale, int n_packed, int j0,
                              int rows, int k)
{
    int j = 0;
    for (; j < rows && j0 + j < n_packed; j += 32) {
        const int8_t *wb = w + (size_t)(j0 + j) * k;
        __m512 s0 = _mm512_loadu_ps(scale + j0 + j), s1 = _mm512_loadu_ps(scale + j0 + j + 16);
        for (int p = 0; p < k; p++, wb += 32) {
            __m512 lo, hi;
            widen_column(wb, &lo, &hi);
            _mm512_storeu_ps(tile + (size_t)p * rows + j, _mm512_mul_ps(lo, s0));
            _mm512_storeu_ps(tile + (size_t)p * rows + j + 16, _mm512_mul_ps(hi, s1));
        }
    }
    for (; j < rows; j++) { /* the row-major rows after the blocks */
        const int8_t *wr = w + (size_t)(j0 + j) * k;
        for (int p = 0; p < k; p++) {
            tile[(size_t)p * rows + j] = (float)wr[p] * scale[j0 + j];
        }
    }
}

void pd_cpu_f32p_copy_kn(float *tile, const float *w, int n_packed, int j0, int rows, int k)
{
    int j = 0;
    for (; j < rows && j0 + j < n_packed; j += 32) {
        const float *wb = w + (size_t)(j0 + j) * k;
        for (int p = 0; p < k; p++, wb += 32) {
            memcpy(tile + (size_t)p * rows + j, wb, 32 * sizeof(float));
        }
    }
    for (; j < rows; j++) { /* the row-major rows after the blocks */
        const float *wr = w + (size_t)(j0 + j) * k;
        for (int p = 0; p < k; p++) {
            tile[(size_t)p * rows + j] = wr[p];
        }
    }
}
