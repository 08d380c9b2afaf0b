/* kernels/cpu/matmul_lowp.h — matmul pieces for 16-bit (bf16/fp16) weights kept at checkpoint
 * precision and int8 weights (--quantization int8, per-row scales): a GEMV that widens weights in
 * registers (small m: decode), and a row widener (the tiles that sgemm multiplies at larger m,
 * embedding rows). x86 AVX2/F16C versions are picked at
 * run time (matmul_lowp_x86.c); the portable versions are the same math in plain C. Results equal
 * pd_cpu_matmul_ref within fp32 summation-order rounding (tests/unit/test_kernels.c). */
#ifndef PD_KERNELS_CPU_MATMUL_LOWP_H
#define PD_KERNELS_CPU_MATMUL_LOWP_H

#include <stdbool.h>
#include <stddef.h>

#include "kernels/backend.h"

/* Up to this many rows of x the GEMV streams w once per call (pairs of x rows re-read a 4-row block
 * of w from L1/L2); above it, widened tiles + sgemm. At 8 rows the GEMV ran a demo-model gate_up at
 * 90 (bf16) / 161 (fp16) GFLOP/s against 55 / 67 through tiles (pd-bench-ops, 2026-11-23). */
#define PD_LOWP_GEMV_MAX_M 8

/* dst[rows][cols] = rows row0.. of w as fp32 (pd_weight_at: exact for fp32/bf16/fp16; int8 times
 * its row's scale), in any layout (a packed one element by element: embedding rows only). */
void pd_cpu_widen_rows(float *dst, pd_weight_t w, int64_t row0, int64_t rows, int64_t cols);

/* dst[n] = src[n] of dtype dt as fp32 (one row: a KV cache row, say). */
static inline void pd_cpu_widen(float *dst, const void *src, pd_dtype_t dt, int64_t n)
{
    pd_weight_t w = {src, dt, NULL, PD_WEIGHT_ROWS, 0};
    pd_cpu_widen_rows(dst, w, 0, 1, n);
}

/* Floats of scratch the x86 GEMV needs for x (0: none), and filling it from x[m][k] — once per
 * matmul, before the threads split the columns. invariant (--batch-invariant): every row of x goes
 * through the same arithmetic as the first row of a pair (no one-row kernel, no split chains), so a
 * row comes out bitwise as it does alone or in any batch. */
size_t pd_cpu_gemv_lowp_scratch(pd_dtype_t dt, int m, int k, bool invariant);
void pd_cpu_gemv_lowp_prepare(float *xp, const float *x, pd_dtype_t dt, int m, int k, bool invariant);

/* y[i][j] = bias[j] + Σ_p x[i][p] · w[j][p] for i < m, j in [n0, n1) (y is [m][n], x [m][k],
 * w [n][k] of a 16-bit or int8 dtype, bias may be NULL; xp the prepared scratch). x86: the AVX2
 * version (the caller checked pd_cpu_lowp_x86_usable: the matmul variant table), else portable C. */
void pd_cpu_gemv_lowp(float *y, const float *x, const float *xp, pd_weight_t w, const float *bias, int m,
                      int n, int k, int n0, int n1, bool x86, bool invariant);

/* The x86 versions (matmul_lowp_x86.c), usable when the CPU has AVX2, FMA and F16C. */
int pd_cpu_lowp_x86_usable(void);
void pd_cpu_widen_x86(float *dst, const void *src, pd_dtype_t dt, size_t n, float scale);
void pd_cpu_gemv_lowp_x86(float *y, const float *x, const float *xp, pd_weight_t w, const float *bias, int m,
                          int n, int k, int n0, int n1, bool invariant);
/* Whether the x86 GEMV for dt at m rows reads the permuted copy of x (the AVX2 bf16 path). */
int pd_cpu_gemv_lowp_x86_wants_xp(pd_dtype_t dt, int m, bool invariant);

/* fp32 math on bf16 weights widened in AVX-512 registers (matmul_bf16w_x512.c), for up to
 * PD_BF16W_X512_MAX_M rows of x on a CPU with AVX-512 F/BW/VL (2 threads, 8192 × 1536 from L3:
 * 180-187 GFLOP/s at 8-64 rows, sgemm's 2048³ peak 192; 49152 × 1536 from DRAM: 160 at 8 rows,
 * 190 at 32; above 64 rows, widened tiles + sgemm): y[i][j] = bias[j] + Σ_p x[i][p] ·
 * w[j][p] for i < m, j in [n0, n1) (bias may be NULL), from xp, x[m][k] copied by
 * pd_cpu_bf16w_x512_prepare into pd_cpu_bf16w_x512_floats(m, k) floats (once per matmul). */
#define PD_BF16W_X512_MAX_M 64
size_t pd_cpu_bf16w_x512_floats(int m, int k);
void pd_cpu_bf16w_x512_prepare(float *xp, const float *x, int m, int k);
void pd_cpu_bf16w_x512(float *y, const float *xp, const uint16_t *w, const float *bias, int m, int n, int k,
                       int n0, int n1);

/* The same kernel for fp32 weights (2-PD_BF16W_X512_MAX_M rows, AVX-512 F/BW/VL), in place of sgemm:
 * the same contract, with x copied by pd_cpu_f32w_x512_prepare (unpermuted, zero-padded to whole
 * groups of 32) into pd_cpu_bf16w_x512_floats(m, k) floats. */
void pd_cpu_f32w_x512_prepare(float *xp, const float *x, int m, int k);
void pd_cpu_f32w_x512(float *y, const float *xp, const float *w, const float *bias, int m, int n, int k,
                      int n0, int n1);

#endif
