/* kernels/cpu/matmul_dnnl.h — bf16 matmul through oneDNN (Debian's libdnnl), for
 * --matmul-precision bf16 on the CPU with bf16 weights: x is rounded to bf16 (RNE), weights are
 * read as stored, products are exact in fp32 and sums are fp32. On a CPU with AVX512-BF16 oneDNN's
 * JIT GEMM runs `vdpbf16ps` at about twice the fp32 sgemm peak (bench/RESULTS.md). The math is
 * pd_cpu_matmul_ref on the rounded x, within fp32 summation-order rounding. */
#ifndef PD_KERNELS_CPU_MATMUL_DNNL_H
#define PD_KERNELS_CPU_MATMUL_DNNL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* Whether oneDNN runs bf16 on this CPU's native bf16 instructions (AVX512-BF16 or newer). Without
 * them it may still emulate bf16 (slowly; logged once) or refuse (PD_ERR_UNSUPPORTED below). */
bool pd_cpu_dnnl_bf16_native(void);

/* Whether oneDNN runs bf16 on AMX tiles here (Sapphire Rapids and newer, with the kernel's
 * permission): its bf16 GEMM then beats the AVX512-BF16 GEMV from about 16 rows of x. */
bool pd_cpu_dnnl_amx(void);

/* y[m][n] = xb[m][k] · w[n][k]ᵀ (+ bias[n]) with xb and w bf16, y fp32, on num_threads threads.
 * PD_ERR_UNSUPPORTED when oneDNN has no implementation (logged once); PD_ERR_BACKEND when it
 * fails. Safe to call from several threads at once. */
pd_status_t pd_cpu_dnnl_matmul_bf16(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int m,
                                    int n, int k, int num_threads);

/* pd_cpu_dnnl_matmul_bf16 with w in PD_WEIGHT_PAIRS32, every row in a block and k % 32 == 0: that is
 * oneDNN's BA16a32b2a, read as it is — no reorder of the weights per call (the row-major path's
 * run-time GEMM packs them every call and read them from DRAM at 9-12 GB/s). oneDNN 2.6 runs these
 * weights only with a fixed row count (a run-time one gets its reference kernel, seconds per call),
 * so x goes in chunks of PD_DNNL_BLOCKED_CHUNK rows, the last one padded with rows of zeros to a
 * multiple of 16 (up to 64 rows) or 64: a primitive per (shape, row count), kept per thread. PD_ERR_UNSUPPORTED when
 * oneDNN has no such kernel here (then never tried again). */
#define PD_DNNL_BLOCKED_CHUNK 256
pd_status_t pd_cpu_dnnl_matmul_bf16_blocked(float *y, const uint16_t *xb, const uint16_t *w,
                                            const float *bias, int m, int n, int k, int num_threads);

/* c[m][n] = a[m][k] · b (+ c's old values when accumulate), on the calling thread only (for a
 * caller inside its own parallel region: attention tiles). a is bf16 [m][k]; b is bf16 [n][k] when
 * b_is_nk (c = a·bᵀ), else [k][n]; c is fp32 [m][n]. m_fixed asks for a primitive made for exactly
 * m rows (kept per thread: worth it for a row count that recurs, a full attention tile; making one
 * costs milliseconds); otherwise one for any row count. Statuses as pd_cpu_dnnl_matmul_bf16. */
pd_status_t pd_cpu_dnnl_gemm_bf16_1t(float *c, const uint16_t *a, const uint16_t *b, int m, int n, int k,
                                     bool b_is_nk, bool accumulate, bool m_fixed);

#endif
