/* kernels/cpu/matmul_bf16.h — the pieces of --matmul-precision bf16 on the CPU (bf16 weights): x is
 * rounded to bf16 (round to nearest even) before every matmul, products of two bf16 values are
 * exact in fp32, and sums are fp32. Up to PD_BF16DOT_MAX_M rows of x (decode) an AVX512-BF16 GEMV
 * (matmul_bf16dot_x86.c); above, oneDNN (matmul_dnnl.c); on a CPU with neither, the fp32 paths on
 * the rounded x. Weights prepare_weight laid out in 32-row blocks take the same row counts through
 * matmul_bf16p_dot.c and pd_cpu_dnnl_matmul_bf16_blocked instead (matmul_bf16p.h). Every path is pd_cpu_matmul_ref on the rounded x within fp32 summation-order
 * rounding, so a row's result does not depend on the batch it is in. */
#ifndef PD_KERNELS_CPU_MATMUL_BF16_H
#define PD_KERNELS_CPU_MATMUL_BF16_H

#include <stddef.h>
#include <stdint.h>

/* Up to this many rows of x the bf16 GEMV streams w once per call; above, oneDNN's GEMM. With 2
 * threads, w ≫ L3 (k = 1536 / 5632): the GEMV 376-405 GFLOP/s at 16-32 rows against oneDNN's
 * 213-312 (its 2048³ peak is 416); oneDNN overtakes at 96-128 rows, and at 32-48 rows when w fits
 * in the caches (512 × 1408: 323 against 328 at 32). */
#define PD_BF16DOT_MAX_M 32

/* Up to this many rows of x, fp32 math on bf16 weights also runs on the bf16 GEMV: each x row is
 * split into three bf16 rows whose sum is x exactly (hi = bf16(x), mid = bf16(x - hi),
 * lo = bf16(x - hi - mid): 8 + 8 + 8 significant bits), each product with a bf16 weight is exact
 * in fp32, and the three dot products are added (lo + mid first). So the result is the fp32
 * product within fp32 summation-order rounding, read at the GEMV's bandwidth, and a row's result
 * does not depend on the rows beside it. Against the register-widening GEMV (matmul_lowp_x86.c),
 * pd-bench-ops on the 565 M model, alternating binaries: batch 1 0.83-0.90x the read roofline
 * against 0.73-0.79x; batch 8 94-98 tok/s against 62-65 (2026-11-24). On an AVX-512 CPU it runs at
 * one row only: from two rows the widening kernel of matmul_bf16w_x512.c is faster (batch 8
 * 118-128 against 98-103 tok/s), while at one row this reads w faster (0.87-0.96x against
 * 0.76-0.79x the read roofline). */
#define PD_BF16X3_MAX_M (PD_BF16DOT_MAX_M / 3)

/* On a CPU where oneDNN runs bf16 on AMX tiles (pd_cpu_dnnl_amx), its GEMM overtakes the GEMV above
 * PD_BF16DOT_AMX_MAX_M rows, and fp32 math on bf16 weights at PD_BF16X3_AMX_MIN_M..MAX_M rows goes
 * through it on x split in three (3m rows) rather than the widening kernel — for matrices of at
 * least PD_BF16X3_AMX_MIN_WEIGHTS weights only: the demo model's (at most 1.4 M) served slower that
 * way (TTFT p50 +3-4 ms at concurrency 16), the 565 M model's big ones (8.6-25 M) decode faster.
 * Measured on a 2-core Xeon with AMX (bf16 GEMM peak ~1400 GFLOP/s, sgemm ~345; bench/RESULTS.md
 * 2026-11-24 20:43 and after). */
#define PD_BF16DOT_AMX_MAX_M      16
#define PD_BF16X3_AMX_MIN_M       24
#define PD_BF16X3_AMX_MAX_M       64
#define PD_BF16X3_AMX_MIN_WEIGHTS ((int64_t)4 << 20)

/* dst[0 .. k) = hi, dst[k .. 2k) = mid, dst[2k .. 3k) = lo of x[0 .. k) as above (bf16 subnormals,
 * |v| < 1.2e-38, flushed to zero as the GEMV would). Needs pd_cpu_bf16dot_usable(). */
void pd_cpu_split_bf16x3(uint16_t *dst, const float *x, int k);

/* dst[n] = src[n] rounded to bf16 (round to nearest even); on an AVX512-BF16 CPU by
 * pd_cpu_round_bf16_dot (`vcvtneps2bf16`, which also flushes bf16 subnormals to zero, as the GEMV
 * and oneDNN do when they multiply them: the products are the same). */
void pd_cpu_round_bf16(uint16_t *dst, const float *src, size_t n);
void pd_cpu_round_bf16_dot(uint16_t *dst, const float *src, size_t n);

/* Whether the CPU has AVX512-BF16 (and AVX512 F/BW/VL) for pd_cpu_gemv_bf16dot. */
int pd_cpu_bf16dot_usable(void);

/* y[i][j] = bias[j] + Σ_p xb[i][p] · w[j][p] for i < m, j in [n0, n1); y is [m][n], xb [m][k] and
 * w [n][k] bf16, bias NULL or [n]. w is streamed once; x is re-read per block of 4 w rows, so keep
 * m small (decode). */
void pd_cpu_gemv_bf16dot(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int m, int n,
                         int k, int n0, int n1);

#endif
