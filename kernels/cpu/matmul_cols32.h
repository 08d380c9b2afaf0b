/* kernels/cpu/matmul_cols32.h — fp32 math on int8 weights (--quantization int8: per-row scales) and
 * on fp32 weights kept in the PD_WEIGHT_COLS32 layout (kernels/backend.h), which the CPU backend's
 * prepare_weight chooses on an AVX-512 CPU.
 *
 * In that layout a column c of 32 output rows is 32 bytes, so one 64-byte load is two columns of a
 * block; `vpmovsxbd` + `vcvtdq2ps` widen a column's 16-row halves to fp32 in registers, and the
 * kernel multiplies the 32 outputs at once by x[i][c] broadcast: the outer product of
 * matmul_bf16p.h, with x transposed once by pd_cpu_bf16p_prepare. The row-major int8 path widened
 * tiles for sgemm above 8 rows (0.33x / 0.41x of its roofline at batch 8 / 32 on the 565 M model).
 *
 * Each y[i][j] is fma(Σ_p, scale[j], bias[j]) where Σ_p is x[i][p] · q[j][p] by fused multiply-adds
 * in column order from 0 (q the int8 values, exact in fp32): one order whatever m, the thread's
 * columns or the batch, so a row's result is the same alone as in a batch of any size up to
 * PD_COLS32_MAX_M. It equals pd_cpu_matmul_ref (which multiplies q · scale per element) within fp32
 * rounding.
 *
 * fp32 weights take the same blocks with a column of 32 rows as two 64-byte loads (no widening),
 * and y[i][j] = Σ_p + bias[j], Σ_p by fused multiply-adds in column order from 0, as above. Below
 * that layout (row-major fp32, matmul_bf16w_x512.c) the kernel streamed x from L2 once per three
 * weight rows and topped out near 165 GFLOP/s at 32 rows; the outer product broadcasts x from L1
 * (bench/RESULTS.md 2026-11-25). Above PD_COLS32_MAX_M rows (prefill) the blocks are copied into
 * [k][rows] tiles for sgemm, as int8 ones are widened. */
#ifndef PD_KERNELS_CPU_MATMUL_COLS32_H
#define PD_KERNELS_CPU_MATMUL_COLS32_H

#include <stddef.h>
#include <stdint.h>

/* Up to this many rows of x the kernels below; above, tiles widened by pd_cpu_i8p_widen_kn (scale
 * included, as pd_weight_at) or copied by pd_cpu_f32p_copy_kn, and sgemm; int8 on an AMX CPU
 * through pd_cpu_i8p_amx (matmul_bf16p.h) instead. */
#define PD_COLS32_MAX_M 64

/* Whether a [rows][cols] int8 or fp32 matrix can take the layout (a block of 32 rows at least). */
static inline int pd_cpu_cols32_fits(int64_t rows, int64_t cols)
{
    return rows >= 32 && cols > 0;
}

/* dst = src[rows][cols] (row-major int8, rows % 32 == 0) in PD_WEIGHT_COLS32 order; dst and src do
 * not overlap. Runs on num_threads OpenMP threads. */
void pd_cpu_i8p_pack(int8_t *dst, const int8_t *src, int64_t rows, int64_t cols, int num_threads);

/* y[i][j] = fma(Σ_p x[i][p] · q[j][p], scale[j], bias[j]) in the order above, for i < m, j in
 * [n0, n1) (n0 a multiple of 32; y is [m][n], bias NULL (0) or [n], scale [n]); xt from
 * pd_cpu_bf16p_prepare (x transposed, [k][m]), w the matrix [n][k] with its first n_packed rows
 * packed (the rest row-major: the same order of sums, one row at a time). Needs AVX-512 F/BW/VL
 * (pd_cpu_avx512_usable). */
void pd_cpu_i8p_x512(float *y, const float *xt, const int8_t *w, const float *scale, const float *bias, int m,
                     int n, int k, int n_packed, int n0, int n1);

/* tile[k][rows] = rows j0 .. j0 + rows of w [.][k] (first n_packed rows packed, j0 a multiple of 32)
 * as fp32 times their scale (pd_weight_at), transposed: the B operand of sgemm (NoTrans) above
 * PD_COLS32_MAX_M rows. AVX-512. */
void pd_cpu_i8p_widen_kn(float *tile, const int8_t *w, const float *scale, int n_packed, int j0, int rows,
                         int k);

/* The same for fp32 weights (y[i][j] = Σ_p x[i][p] · w[j][p] + bias[j]; bias NULL or [n]), and
 * tile[k][rows] = rows j0 .. j0 + rows of w transposed (sgemm's B above PD_COLS32_MAX_M rows).
 * pd_cpu_f32p_pack lays out rows % 32 == 0 rows of a row-major [rows][cols] matrix. AVX-512. */
void pd_cpu_f32p_pack(float *dst, const float *src, int64_t rows, int64_t cols, int num_threads);
void pd_cpu_f32p_x512(float *y, const float *xt, const float *w, const float *bias, int m, int n, int k,
                      int n_packed, int n0, int n1);
void pd_cpu_f32p_copy_kn(float *tile, const float *w, int n_packed, int j0, int rows, int k);

#endif
