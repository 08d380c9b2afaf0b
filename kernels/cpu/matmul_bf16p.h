/* kernels/cpu/matmul_bf16p.h — fp32 math on bf16 weights kept in the PD_WEIGHT_PAIRS32 layout
 * (kernels/backend.h), which the CPU backend's prepare_weight chooses on an AVX-512 CPU for bf16
 * weights in fp32 math (--matmul-precision fp32, the default).
 *
 * In that layout one 64-byte load holds a column pair (c, c + 1) of 32 output rows; as 16 32-bit
 * lanes, a shift gives column c of 16 rows as fp32 and a mask column c + 1 (exact: bf16 is fp32's
 * top half). The kernel broadcasts x[i][c] and x[i][c + 1] and multiplies 32 outputs at once — an
 * outer product, with x read from L1 as scalars, where the row-major kernel (matmul_bf16w_x512.c)
 * streamed x vectors from L2 and was bound by those loads on Intel cores. Measured alone (2
 * threads, 11264 × 1536 from L3, 2-core AMX Xeon): 24-32 rows 290-298 GFLOP/s against 195-207
 * for the row-major kernel, 8 rows level (both read w at ~22 GB/s), 1 row 31.5 against 29.5 GB/s
 * for the bf16 GEMV on x split in three.
 *
 * Each y[i][j] is bias[j] + (Σ over column pairs p of (x[i][2p] · w[j][2p] then
 * x[i][2p+1] · w[j][2p+1]), fused multiply-adds in column order from 0): one order whatever m,
 * the thread's columns or the batch, so a row's result is the same alone as in a batch of any
 * size up to PD_BF16P_MAX_M. */
#ifndef PD_KERNELS_CPU_MATMUL_BF16P_H
#define PD_KERNELS_CPU_MATMUL_BF16P_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/matmul_bf16.h" /* PD_BF16DOT_AMX_MAX_M */

/* Up to this many rows of x the kernel below; above, tiles widened by pd_cpu_bf16p_widen_kn and
 * sgemm (which re-reads the tile from cache per row block: prefill). */
#define PD_BF16P_MAX_M 64

/* Whether a [rows][cols] bf16 matrix can take the layout (a block of 32 rows at least, cols even). */
static inline int pd_cpu_bf16p_fits(int64_t rows, int64_t cols)
{
    return rows >= 32 && cols > 0 && cols % 2 == 0;
}

/* dst = src[rows][cols] (row-major bf16, rows % 32 == 0, cols even) in PD_WEIGHT_PAIRS32 order;
 * dst and src do not overlap. Runs on num_threads OpenMP threads. */
void pd_cpu_bf16p_pack(uint16_t *dst, const uint16_t *src, int64_t rows, int64_t cols, int num_threads);

/* Floats of pd_cpu_bf16p_prepare's copy of x[m][k], and the copy itself (x transposed, [k][m]:
 * each column's m values side by side), made once per matmul before the threads split y. */
size_t pd_cpu_bf16p_x_floats(int m, int k);
void pd_cpu_bf16p_prepare(float *xt, const float *x, int m, int k);

/* y[i][j] = bias[j] + Σ_p x[i][p] · w[j][p] in the order above, for i < m, j in [n0, n1) (n0 a
 * multiple of 32; y is [m][n], bias NULL or [n]); xt from pd_cpu_bf16p_prepare, w the matrix
 * [n][k] with its first n_packed rows packed (the rest row-major: the same order of sums, one
 * column at a time). Needs AVX-512 F/BW/VL (pd_cpu_avx512_usable). */
void pd_cpu_bf16p_x512(float *y, const float *xt, const uint16_t *w, const float *bias, int m, int n, int k,
                       int n_packed, int n0, int n1);

/* tile[k][rows] = rows j0 .. j0 + rows of w [.][k] (first n_packed rows packed, j0 a multiple of
 * 32) as fp32, transposed: the B operand of sgemm (NoTrans) above PD_BF16P_MAX_M rows. AVX-512. */
void pd_cpu_bf16p_widen_kn(float *tile, const uint16_t *w, int n_packed, int j0, int rows, int k);

/* --matmul-precision bf16 (matmul_bf16p_dot.c, AVX512-BF16): weights laid out when k % 32 == 0 and
 * there is a block; with every row in a block they are also oneDNN's BA16a32b2a (matmul_dnnl.h),
 * otherwise the rows past the blocks (an odd vocabulary's lm_head) stay row-major and only these
 * kernels read them. xq is x rounded to bf16 as column pairs transposed: xq[p][i] = x[i][2p] |
 * x[i][2p + 1] << 16 (k/2 × m words), pd_cpu_bf16p_dot_prepare writing pairs [p0, p1) (multiples
 * of 16) from x[m][k] fp32 (rounded as pd_cpu_round_bf16_dot rounds). pd_cpu_bf16p_dot: y[i][j] =
 * bias[j] + Σ_p x[i][p] · w[j][p] for i < m, j in [n0, n1) (multiples of 32, inside the blocks);
 * pd_cpu_bf16p_dot_rows the same for rows [j0, j1) past the blocks, with the same products in the
 * same order, so every output is what a block would give. */
static inline int pd_cpu_bf16p_dot_fits(int64_t rows, int64_t cols)
{
    return rows >= 32 && cols > 0 && cols % 32 == 0;
}
/* The kernel runs up to the row-major GEMV's row count (PD_BF16DOT_AMX_MAX_M with AMX,
 * PD_BF16DOT_MAX_M otherwise), oneDNN above — at every row count when some rows are past the
 * blocks. oneDNN would be faster from 5 rows on the AMX Xeon
 * (565 M model: batch 8 158-159 tok/s against 140-143 here; batch 1 22 against 28-29 here), but a
 * decode batch and a lone sequence must take the same kernel for their bf16 roundings to agree
 * (test_engine test_bf16_math_batch_invariant: 0.014 apart in logprobs when batch 8 went to oneDNN
 * and batch 1 here). */
void pd_cpu_bf16p_dot_prepare(uint32_t *xq, const float *x, int m, int k, int p0, int p1);
void pd_cpu_bf16p_dot(float *y, const uint32_t *xq, const uint16_t *w, const float *bias, int m, int n, int k,
                      int n0, int n1);
void pd_cpu_bf16p_dot_rows(float *y, const uint32_t *xq, const uint16_t *w, const float *bias, int m, int n,
                           int k, int j0, int j1);

/* AMX (matmul_bf16p_amx.c): whether this CPU has AMX-TILE and AMX-BF16 and the kernel let this
 * process use them (asked once, for every thread). */
int pd_cpu_amx_usable(void);

/* From these row counts on the matmul takes the AMX kernel. bf16 math: above the `vdpbf16ps`
 * kernel's rows (PD_BF16DOT_AMX_MAX_M), in place of oneDNN (565 M model, batch 32: 470-480 against
 * 402-418 tok/s). The AMX kernel would also win at 8 rows (164-170 against 133-138 tok/s) but lose
 * at one (22-24 against 26-28), and the two kernels round sums differently (about half the outputs
 * differ in the last bit): a sequence alone and in a batch of 8 then part by 0.014 in logprobs
 * through bf16 activations (test_engine test_bf16_math_batch_invariant), so one kernel serves 1-16
 * rows. fp32 math, x in three parts (three times the products): from 32 rows (565 M model batch 32
 * 301-322 against 225-228 tok/s, prefill 1.4-1.8x; batch 8 129-142 against 142-149; serving the
 * demo model, whose 47 MiB sit in L3, from 16 rows lost 11-15 % requests/s at concurrency 16, from
 * 32 level there and +12-18 % at concurrency 8). bench/RESULTS.md 2026-11-25. */
#define PD_BF16P_AMX_MIN_M    (PD_BF16DOT_AMX_MAX_M + 1)
#define PD_BF16P_AMX_X3_MIN_M 32

/* Whether pd_cpu_bf16p_amx takes a [rows][cols] matrix: every row in a block, k whole tiles. */
static inline int pd_cpu_bf16p_amx_fits(int64_t rows, int64_t n_packed, int64_t cols)
{
    return rows % 32 == 0 && n_packed >= rows && cols % 32 == 0;
}

/* Rows of x a pd_cpu_bf16p_amx input holds: m rounded up to whole tiles of 16 (the rows after m
 * are read, and their products dropped: zero them). */
static inline int pd_cpu_bf16p_amx_rows(int m)
{
    return (m + 15) & ~15;
}

/* y[i][j] = bias[j] + Σ_p x[i][p] · w[j][p] for i < m, j in [n0, n1) (multiples of 32); y is
 * [m][n], bias NULL or [n], w [n][k] with pd_cpu_bf16p_amx_fits. x is given as `parts` bf16 rows per
 * row of x, xs[i][part][k] for pd_cpu_bf16p_amx_rows(m) rows i, whose sum is x: 1 part for bf16
 * math (x rounded), 3 for fp32 math (pd_cpu_split_bf16x3's hi, mid, lo). Sums start from the bias
 * and go 32 columns at a time from column 0, every part in turn: the same for a row whatever m is.
 * Rows are taken in chunks of pd_cpu_bf16p_amx_chunk_rows(k, parts), ~1 MiB of x, each chunk
 * against all of the thread's columns. Needs pd_cpu_amx_usable(). */
void pd_cpu_bf16p_amx(float *y, const uint16_t *xs, int parts, const uint16_t *w, const float *bias, int m,
                      int n, int k, int n0, int n1);
int pd_cpu_bf16p_amx_chunk_rows(int k, int parts);

/* pd_cpu_bf16p_amx (x in three parts, fp32 math) for int8 weights in PD_WEIGHT_COLS32
 * (matmul_cols32.h) with every row in a block and k % 32 == 0: per chunk of rows and 32-row block,
 * the block's int8 values widened into `panel` (k × 32 bf16, exact: int8 fits bf16) in PAIRS32
 * order, multiplied on the tiles, then y = fma(y, scale[j], bias[j]). The products are exact, sums
 * fp32: pd_cpu_matmul_ref within fp32 rounding. Above PD_COLS32_MAX_M rows (prefill), in place of
 * widened tiles and sgemm. */
void pd_cpu_i8p_amx(float *y, const uint16_t *xs, const int8_t *w, const float *scale, const float *bias,
                    int m, int n, int k, int n0, int n1, uint16_t *panel);

/* c[i][j] = (accumulate ? c[i][j] : 0) + Σ_p a[i][p] · B[p][j] for i < m, j < n, on the calling
 * thread's AMX tiles (the prefill attention tile, kernels/cpu/attention_prefill_tiled.c). a is
 * bf16, row i at a + i·lda, with pd_cpu_bf16p_amx_rows(m) rows readable (the products of rows past
 * m dropped); B [k][n] comes as bf16 pairs, word b[p·ldb + j] = B[2p][j] | B[2p + 1][j] << 16; c
 * is fp32, row i at c + i·ldc. n and k multiples of 32. Sums from column 0, 32 at a time. Needs
 * pd_cpu_amx_usable(). */
void pd_cpu_amx_gemm_pairs(float *c, long ldc, const uint16_t *a, long lda, const uint32_t *b, long ldb,
                           int m, int n, int k, int accumulate);

/* The 12 cases of a block's row count R (a constant in each), for the kernels' row groups. */
#define PD_BF16P_ROW_CASES(CASE)                                                                             \
    CASE(1);                                                                                                 \
    CASE(2);                                                                                                 \
    CASE(3);                                                                                                 \
    CASE(4);                                                                                                 \
    CASE(5);                                                                                                 \
    CASE(6);                                                                                                 \
    CASE(7);                                                                                                 \
    CASE(8);                                                                                                 \
    CASE(9);                                                                                                 \
    CASE(10);                                                                                                \
    CASE(11);                                                                                                \
    CASE(12)

#endif
