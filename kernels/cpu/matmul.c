/* kernels/cpu/matmul.c — y[m][n] = x[m][k] · w[n][k]ᵀ + bias: a plain loop, and the optimized op:
 * bf16, int8 and fp32 weights that prepare_weight laid out in 32-row blocks (PD_WEIGHT_PAIRS32 /
 * PD_WEIGHT_COLS32, AVX-512, fp32 math) through the outer-product kernels of matmul_bf16p.h /
 * matmul_cols32.h up to 64 rows and transposed widened (copied) tiles + sgemm above — on an AMX CPU,
 * the AMX kernel (matmul_bf16p_amx.c) on x in three exact bf16 parts instead, bf16 from
 * PD_BF16P_AMX_X3_MIN_M rows and int8 above 64 (fp32 weights never: not exact in bf16 parts), and
 * bf16 math above the GEMV's rows; row-major fp32 weights (under 32 rows, a slice off the blocks, no
 * AVX-512) through OpenBLAS sgemm/sgemv, on an AVX-512 CPU at 2..PD_BF16W_X512_MAX_M rows through
 * matmul_bf16w_x512.c's register-blocked kernel instead; for row-major bf16/fp16/int8 weights a
 * GEMV that widens in registers (matmul_lowp_x86.c) at small m, and tiles of w widened into fp32
 * for sgemm at larger m; on an AVX-512 CPU, bf16 weights at 2..PD_BF16W_X512_MAX_M rows go through a register-blocked kernel that
 * widens them in registers (matmul_bf16w_x512.c), and at one row (with AVX512-BF16) through the
 * bf16 GEMV on x split in three exact bf16 parts (matmul_bf16.h), both fp32 math; where oneDNN
 * runs bf16 on AMX tiles, 24..64 rows of a large matrix, split in three, go through its GEMM. With
 * --matmul-precision bf16 and bf16 weights, x is rounded to bf16 first and multiplied in bf16
 * (matmul_bf16.h): an AVX512-BF16 GEMV at small m (up to 32 rows, 16 with AMX), oneDNN above. */
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul_bf16.h"
#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/matmul_cols32.h"
#include "kernels/cpu/matmul_dnnl.h"
#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/matmul_variants.h"
#include "kernels/cpu/simd.h"
#include "kernels/dtype_impl.h"

pd_status_t pd_cpu_matmul_ref(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                              int m, int n, int k)
{
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            double acc = bias != NULL ? bias[j] : 0.0;
            for (int p = 0; p < k; p++) {
                acc += (double)x[(size_t)i * k + p] * pd_weight_at(w, j, p, k);
            }
            y[(size_t)i * n + j] = (float)acc;
        }
    }
    return PD_OK;
}

/* Columns [n0, n1) of y with fp32 weights: OpenBLAS (sgemv at m = 1). */
static void slice_f32(float *y, const float *x, const float *w, float beta, int m, int n, int k, int n0,
                      int n1)
{
    if (m == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n1 - n0, k, 1.0f, w + (size_t)n0 * k, k, x, 1, beta, y + n0,
                    1);
    } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n1 - n0, k, 1.0f, x, k, w + (size_t)n0 * k, k,
                    beta, y + n0, n);
    }
}

/* Columns [n0, n1) of y with 16-bit or int8 weights at m > PD_LOWP_GEMV_MAX_M: tiles of w rows widened into
 * tile (fp32, tile_rows × k) and multiplied by sgemm. The widening reads each weight once per
 * matmul; sgemm re-reads x once per tile, so tiles are as tall as the buffer allows. */
static void slice_lowp_tiles(float *y, const float *x, pd_weight_t w, float beta, int m, int n, int k, int n0,
                             int n1, float *tile, int tile_rows)
{
    for (int j0 = n0; j0 < n1; j0 += tile_rows) {
        int rows = n1 - j0 < tile_rows ? n1 - j0 : tile_rows;
        pd_cpu_widen_rows(tile, w, j0, rows, k);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, rows, k, 1.0f, x, k, tile, k, beta, y + j0,
                    n);
    }
}

/* Rows of the fp32 tile a thread widens 16-bit or int8 weights into. sgemm packs all of x once per
 * tile, so the tile grows with m: up to 256 rows in at most 2 MiB (decode batches), and for
 * prefill-sized m (>= 256 rows of x) up to 1024 rows in at most 8 MiB — at 256 rows a 2048-token
 * prefill of the 565 M model ran its bf16 linear layers at 0.85x the peak against 0.93x for fp32. */
static int tile_rows_for(int m, int k)
{
    size_t budget = m >= 256 ? (size_t)8 << 20 : (size_t)2 << 20;
    int cap = m >= 256 ? 1024 : 256;
    int rows = (int)(budget / ((size_t)k * sizeof(float)));
    rows = rows > cap ? cap : rows;
    return rows < 16 ? 16 : rows & ~15;
}

/* Thread t's columns [*n0, *n1) of n split over nt threads in slices of whole multiples of unit
 * (a power of two: 16, whole 64-byte rows of y; 32, whole blocks of a blocked weight);
 * false when it has none. */
static bool thread_cols(int n, int nt, int t, int unit, int *n0, int *n1)
{
    int cols = ((n + nt - 1) / nt + unit - 1) & ~(unit - 1);
    *n0 = t * cols;
    *n1 = *n0 + cols < n ? *n0 + cols : n;
    return *n0 < *n1;
}

/* Columns [n0, n1) of y[m][n] set to the bias before an sgemm adds into them: the sgemm's beta
 * (1, or 0 without a bias, when y's old values are ignored). */
static float bias_into(float *y, const float *bias, int m, int n, int n0, int n1)
{
    if (bias == NULL) {
        return 0.0f;
    }
    for (int i = 0; i < m; i++) {
        memcpy(y + (size_t)i * n + n0, bias + n0, (size_t)(n1 - n0) * sizeof(float));
    }
    return 1.0f;
}

/* fp32 math on bf16 weights (matmul_bf16.h): x split into 3m bf16 rows, then y3[3m][n] by the bf16
 * GEMV (m <= PD_BF16X3_MAX_M, each thread its columns) or by oneDNN (on AMX), and each thread adds
 * its own columns' three rows (lo + mid + hi). */
static pd_status_t matmul_bf16x3(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                                 int m, int n, int k, bool gemv)
{
    int nt = be->num_threads, m3 = 3 * m;
    uint16_t *xs = malloc((size_t)m3 * k * sizeof(uint16_t));
    float *y3 = malloc((size_t)m3 * n * sizeof(float));
    if (xs == NULL || y3 == NULL) {
        pd_log_error("matmul: cannot allocate %d x %d split inputs", m3, k);
        free(xs), free(y3);
        return PD_ERR_NO_MEMORY;
    }
    for (int i = 0; i < m; i++) {
        pd_cpu_split_bf16x3(xs + (size_t)3 * i * k, x + (size_t)i * k, k);
    }
    pd_status_t st = gemv ? PD_OK : pd_cpu_dnnl_matmul_bf16(y3, xs, w.data, NULL, m3, n, k, nt);
    if (st != PD_OK) {
        free(xs), free(y3);
        return st;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (!thread_cols(n, nt, t, 16, &n0, &n1)) {
            continue;
        }
        if (gemv) {
            pd_cpu_gemv_bf16dot(y3, xs, w.data, NULL, m3, n, k, n0, n1);
        }
        for (int i = 0; i < m; i++) {
            const float *hi = y3 + (size_t)3 * i * n, *mid = hi + n, *lo = mid + n;
            for (int j = n0; j < n1; j++) {
                y[(size_t)i * n + j] = (lo[j] + mid[j]) + hi[j] + (bias != NULL ? bias[j] : 0.0f);
            }
        }
    }
    free(xs), free(y3);
    return PD_OK;
}

/* fp32 math on bf16 or fp32 weights at m <= PD_BF16W_X512_MAX_M with AVX-512 (matmul_lowp.h): x
 * copied into the kernel's order once, then each thread its own columns. */
static pd_status_t matmul_w_x512(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                                 int m, int n, int k)
{
    int nt = be->num_threads;
    bool f32 = w.dtype == PD_DTYPE_F32;
    float *xp = malloc(pd_cpu_bf16w_x512_floats(m, k) * sizeof(float));
    if (xp == NULL) {
        pd_log_error("matmul: cannot allocate %d x %d inputs for the %s weights", m, k,
                     f32 ? "fp32" : "bf16");
        return PD_ERR_NO_MEMORY;
    }
    if (f32) {
        pd_cpu_f32w_x512_prepare(xp, x, m, k);
    } else {
        pd_cpu_bf16w_x512_prepare(xp, x, m, k);
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (!thread_cols(n, nt, t, 16, &n0, &n1)) {
            continue;
        }
        if (f32) {
            pd_cpu_f32w_x512(y, xp, w.data, bias, m, n, k, n0, n1);
        } else {
            pd_cpu_bf16w_x512(y, xp, w.data, bias, m, n, k, n0, n1);
        }
    }
    free(xp);
    return PD_OK;
}

/* y = x · wᵀ + bias on AMX tiles (matmul_bf16p_amx.c), x given as `parts` bf16 rows per row
 * (pd_cpu_bf16p_amx's xs); w bf16 in PD_WEIGHT_PAIRS32, or int8 in PD_WEIGHT_COLS32 (three parts;
 * panels[t] the thread's k × 32 bf16 panel); threads take whole 32-column blocks. */
static void matmul_amx(pd_backend_t *be, float *y, const uint16_t *xs, int parts, pd_weight_t w,
                       const float *bias, int m, int n, int k, uint16_t *panels)
{
    int nt = be->num_threads;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (!thread_cols(n, nt, t, 32, &n0, &n1)) {
            continue;
        }
        if (w.dtype == PD_DTYPE_I8) {
            pd_cpu_i8p_amx(y, xs, w.data, w.scale, bias, m, n, k, n0, n1, panels + (size_t)t * k * 32);
        } else {
            pd_cpu_bf16p_amx(y, xs, parts, w.data, bias, m, n, k, n0, n1);
        }
    }
}

/* fp32 math on AMX tiles, for PD_WEIGHT_PAIRS32 bf16 weights or PD_WEIGHT_COLS32 int8 ones: x split
 * in three exact bf16 parts (pd_cpu_split_bf16x3; rows split over the threads), all three
 * multiplied into the same sums. */
static pd_status_t matmul_amx_x3(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                                 int m, int n, int k)
{
    int nt = be->num_threads, rows = pd_cpu_bf16p_amx_rows(m);
    size_t panel_words = w.dtype == PD_DTYPE_I8 ? (size_t)nt * k * 32 : 0;
    uint16_t *xs = malloc(((size_t)rows * 3 * k + panel_words) * sizeof(uint16_t));
    if (xs == NULL) {
        pd_log_error("matmul: cannot allocate %d x 3 x %d split inputs", rows, k);
        return PD_ERR_NO_MEMORY;
    }
    memset(xs + (size_t)m * 3 * k, 0, (size_t)(rows - m) * 3 * k * sizeof(uint16_t));
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && m > 1)
    for (int i = 0; i < m; i++) {
        pd_cpu_split_bf16x3(xs + (size_t)3 * i * k, x + (size_t)i * k, k);
    }
    matmul_amx(be, y, xs, 3, w, bias, m, n, k, xs + (size_t)rows * 3 * k);
    free(xs);
    return PD_OK;
}

/* fp32 math on bf16 weights in PD_WEIGHT_PAIRS32 (matmul_bf16p.h) or int8 and fp32 ones in
 * PD_WEIGHT_COLS32 (matmul_cols32.h): up to 64 rows the layout's outer-product kernel on x
 * transposed once; above, each thread widens (copies) its blocks into transposed fp32 tiles
 * ([k][rows]) for sgemm. Threads take whole 32-column blocks. */
static pd_status_t matmul_blocked(pd_backend_t *be, float *y, const float *x, pd_weight_t w,
                                  const float *bias, int m, int n, int k, bool direct)
{
    int nt = be->num_threads;
    bool i8 = w.dtype == PD_DTYPE_I8, f32 = w.dtype == PD_DTYPE_F32;
    int n_packed = w.packed_rows < n ? (int)w.packed_rows : n;
    if (n_packed % 32 != 0) { /* a slice that ends inside a block: prepare_weight's slice_rows */
        pd_log_error("matmul: %d rows of a weight with %lld in 32-row blocks end inside a block", n,
                     (long long)w.packed_rows);
        return PD_ERR_INVALID_ARG;
    }
    int tile_rows = tile_rows_for(m, k) & ~31;
    tile_rows = tile_rows < 32 ? 32 : tile_rows;
    size_t floats = direct ? pd_cpu_bf16p_x_floats(m, k) : (size_t)nt * tile_rows * k;
    float *buf = malloc(floats * sizeof(float));
    if (buf == NULL) {
        pd_log_error("matmul: cannot allocate %zu floats for a blocked weight", floats);
        return PD_ERR_NO_MEMORY;
    }
    if (direct) {
        pd_cpu_bf16p_prepare(buf, x, m, k);
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (!thread_cols(n, nt, t, 32, &n0, &n1)) {
            continue;
        }
        if (direct && i8) {
            pd_cpu_i8p_x512(y, buf, w.data, w.scale, bias, m, n, k, n_packed, n0, n1);
            continue;
        }
        if (direct && f32) {
            pd_cpu_f32p_x512(y, buf, w.data, bias, m, n, k, n_packed, n0, n1);
            continue;
        }
        if (direct) {
            pd_cpu_bf16p_x512(y, buf, w.data, bias, m, n, k, n_packed, n0, n1);
            continue;
        }
        float *tile = buf + (size_t)t * tile_rows * k;
        for (int j0 = n0; j0 < n1; j0 += tile_rows) {
            int rows = n1 - j0 < tile_rows ? n1 - j0 : tile_rows;
            float beta = bias_into(y, bias, m, n, j0, j0 + rows);
            if (i8) {
                pd_cpu_i8p_widen_kn(tile, w.data, w.scale, n_packed, j0, rows, k);
            } else if (f32) {
                pd_cpu_f32p_copy_kn(tile, w.data, n_packed, j0, rows, k);
            } else {
                pd_cpu_bf16p_widen_kn(tile, w.data, n_packed, j0, rows, k);
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, rows, k, 1.0f, x, k, tile, rows, beta,
                        y + j0, n);
        }
    }
    free(buf);
    return PD_OK;
}

/* PD_CPU_AMX=0 keeps the matmuls off the AMX kernel (A/B benchmarks): bf16 math then goes to
 * oneDNN above the GEMV's rows, fp32 math to matmul_blocked. */
static bool amx_wanted(void)
{
    static int wanted = -1; /* a benign race: every thread reads the same environment */
    if (__atomic_load_n(&wanted, __ATOMIC_RELAXED) < 0) {
        const char *v = getenv("PD_CPU_AMX");
        __atomic_store_n(&wanted, v == NULL || strcmp(v, "0") != 0, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&wanted, __ATOMIC_RELAXED);
}

/* PD_CPU_WEIGHT_PACKING=0 keeps every weight row-major (A/B benchmarks of the two layouts). */
static bool packing_wanted(void)
{
    const char *v = getenv("PD_CPU_WEIGHT_PACKING");
    return v == NULL || strcmp(v, "0") != 0;
}

pd_status_t pd_cpu_prepare_weight(pd_backend_t *be, pd_weight_t *w, int64_t rows, int64_t cols,
                                  int64_t slice_rows)
{
    bool bf16_math = be->matmul_precision == PD_MATMUL_BF16;
    bool fits = false;
    if (w->dtype == PD_DTYPE_BF16) {
        fits = bf16_math ? pd_cpu_bf16p_dot_fits(rows, cols) && pd_cpu_bf16dot_usable()
                         : be->matmul_precision == PD_MATMUL_FP32 && pd_cpu_bf16p_fits(rows, cols);
    } else if (w->dtype == PD_DTYPE_I8 || w->dtype == PD_DTYPE_F32) { /* always fp32 math */
        fits = pd_cpu_cols32_fits(rows, cols);
    }
    if (slice_rows % 32 != 0 || w->layout != PD_WEIGHT_ROWS || !fits || !pd_cpu_avx512_usable() ||
        !packing_wanted()) {
        return PD_OK;
    }
    int64_t blocked = rows & ~(int64_t)31; /* the rows after stay where they are, row-major */
    size_t bytes = (size_t)blocked * (size_t)cols * (size_t)pd_dtype_size(w->dtype);
    void *copy = malloc(bytes);
    if (copy == NULL) {
        pd_log_error("cpu backend: cannot allocate %zu bytes to lay out a weight", bytes);
        return PD_ERR_NO_MEMORY;
    }
    memcpy(copy, w->data, bytes);
    if (w->dtype == PD_DTYPE_I8) {
        pd_cpu_i8p_pack((int8_t *)w->data, copy, blocked, cols, be->num_threads);
    } else if (w->dtype == PD_DTYPE_F32) {
        pd_cpu_f32p_pack((float *)w->data, copy, blocked, cols, be->num_threads);
    } else {
        pd_cpu_bf16p_pack((uint16_t *)w->data, copy, blocked, cols, be->num_threads);
    }
    free(copy);
    w->layout = w->dtype == PD_DTYPE_BF16 ? PD_WEIGHT_PAIRS32 : PD_WEIGHT_COLS32;
    w->packed_rows = blocked;
    return PD_OK;
}

/* One thread pool: OpenBLAS is single-threaded (set at backend creation) and runs inside our
 * OpenMP threads, each computing a slice of the output columns (rows of w). Two pools — OpenMP
 * workers spin-waiting while OpenBLAS's own threads run — halve throughput on a small machine.
 * Every matmul is split, however small: at batch 1 a decode step is a chain of GEMVs bound by
 * reading w, and a lone thread reads at about half the machine's bandwidth. (A 2 MFLOP threshold
 * ran q, k, v, o and down of the demo model on one core: 147-154 tok/s at batch 1 against 198-215
 * split, pd-bench-ops, bench/RESULTS.md 2026-11-23.) Slices stay whole 64-byte rows of y.
 * The row-major tail of the table: 16-bit and int8 weights through the GEMV that widens in registers
 * (AVX2, or portable C) at small m and widened tiles + sgemm above; fp32 weights through OpenBLAS. */
typedef enum { TAIL_GEMV_X86, TAIL_GEMV, TAIL_TILES, TAIL_F32 } tail_kind_t;

static pd_status_t matmul_tail(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                               int m, int n, int k, tail_kind_t kind)
{
    int nt = be->num_threads;
    bool gemv = kind == TAIL_GEMV_X86 || kind == TAIL_GEMV;
    int tile_rows = tile_rows_for(m, k);
    float *tiles = NULL, *xp = NULL;
    bool inv = be->batch_invariant;
    size_t xp_floats = kind == TAIL_GEMV_X86 ? pd_cpu_gemv_lowp_scratch(w.dtype, m, k, inv) : 0;
    if (kind == TAIL_TILES) {
        tiles = malloc((size_t)nt * tile_rows * k * sizeof(float));
        if (tiles == NULL) {
            pd_log_error("matmul: cannot allocate %d tiles of %d x %d for 16-bit weights", nt, tile_rows, k);
            return PD_ERR_NO_MEMORY;
        }
    } else if (xp_floats > 0) {
        xp = malloc(xp_floats * sizeof(float));
        if (xp == NULL) {
            pd_log_error("matmul: cannot allocate %zu floats of GEMV scratch", xp_floats);
            return PD_ERR_NO_MEMORY;
        }
        pd_cpu_gemv_lowp_prepare(xp, x, w.dtype, m, k, inv);
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (!thread_cols(n, nt, t, 16, &n0, &n1)) {
            continue;
        }
        if (gemv) {
            pd_cpu_gemv_lowp(y, x, xp, w, bias, m, n, k, n0, n1, kind == TAIL_GEMV_X86, inv);
            continue;
        }
        float beta = bias_into(y, bias, m, n, n0, n1);
        if (kind == TAIL_TILES) {
            slice_lowp_tiles(y, x, w, beta, m, n, k, n0, n1, tiles + (size_t)t * tile_rows * k, tile_rows);
        } else {
            slice_f32(y, x, w.data, beta, m, n, k, n0, n1);
        }
    }
    free(tiles);
    free(xp);
    return PD_OK;
}

void pd_cpu_round_bf16(uint16_t *dst, const float *src, size_t n)
{
    if (pd_cpu_bf16dot_usable()) { /* a scalar loop here was 2.4 % of a batch-32 decode step */
        pd_cpu_round_bf16_dot(dst, src, n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        dst[i] = pd_f32_to_bf16(src[i]);
    }
}

#define PD_BF16P_SPLIT_PREPARE 8192

/* --matmul-precision bf16 on weights in PD_WEIGHT_PAIRS32 through the `vdpbf16ps` kernels
 * (matmul_bf16p.h), in one parallel region: each thread rounds and transposes a share of x's column
 * pairs into xq, then, after the barrier, multiplies its share of the blocks' columns; the last
 * thread also the rows past the blocks. (Rounding on its own region and transposing on one thread
 * cost 5-8 µs a matmul, 5-7 % of a batch-32 decode step of the demo model.) Under
 * PD_BF16P_SPLIT_PREPARE elements of x the caller prepares xq alone: less than the barrier costs. */
static pd_status_t matmul_bf16_dot(pd_backend_t *be, float *y, const float *x, pd_weight_t w,
                                   const float *bias, int m, int n, int k)
{
    uint32_t *xq = malloc((size_t)m * (size_t)(k / 2) * sizeof(uint32_t));
    if (xq == NULL) {
        pd_log_error("matmul: cannot allocate %d x %d bf16 inputs", m, k);
        return PD_ERR_NO_MEMORY;
    }
    int packed = (int)w.packed_rows, units = k / 32; /* units of 16 column pairs */
    bool split = (int64_t)m * k >= PD_BF16P_SPLIT_PREPARE;
    if (!split) {
        pd_cpu_bf16p_dot_prepare(xq, x, m, k, 0, k / 2);
    }
#pragma omp parallel num_threads(be->num_threads) if (be->num_threads > 1)
    {
        int t = omp_get_thread_num(), nth = omp_get_num_threads();
        if (split) { /* the same for every thread, so all or none meet the barrier */
            pd_cpu_bf16p_dot_prepare(xq, x, m, k, 16 * (units * t / nth), 16 * (units * (t + 1) / nth));
#pragma omp barrier
        }
        int n0, n1;
        if (thread_cols(packed, nth, t, 32, &n0, &n1)) {
            pd_cpu_bf16p_dot(y, xq, w.data, bias, m, n, k, n0, n1);
        }
        if (t == nth - 1 && packed < n) {
            pd_cpu_bf16p_dot_rows(y, xq, w.data, bias, m, n, k, packed, n);
        }
    }
    free(xq);
    return PD_OK;
}

/* x[m][k] rounded to bf16 (rows split over the threads) in `rows` >= m rows, the rest zero (the AMX
 * kernel's whole tiles); NULL when it cannot be allocated (logged). */
static uint16_t *round_x_bf16(pd_backend_t *be, const float *x, int m, int k, int rows)
{
    int nt = be->num_threads;
    uint16_t *xb = malloc((size_t)rows * k * sizeof(uint16_t));
    if (xb == NULL) {
        pd_log_error("matmul: cannot allocate %d x %d bf16 inputs", m, k);
        return NULL;
    }
    memset(xb + (size_t)m * k, 0, (size_t)(rows - m) * k * sizeof(uint16_t));
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && m > 1)
    for (int i = 0; i < m; i++) {
        pd_cpu_round_bf16(xb + (size_t)i * k, x + (size_t)i * k, (size_t)k);
    }
    return xb;
}

/* --matmul-precision bf16 on PD_WEIGHT_PAIRS32 above the GEMV's rows: AMX tiles. */
static pd_status_t bf16_amx(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                            int m, int n, int k)
{
    uint16_t *xb = round_x_bf16(be, x, m, k, pd_cpu_bf16p_amx_rows(m));
    if (xb == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    matmul_amx(be, y, xb, 1, w, bias, m, n, k, NULL);
    free(xb);
    return PD_OK;
}

/* --matmul-precision bf16 through oneDNN: on PD_WEIGHT_PAIRS32 (its BA16a32b2a) or row-major. */
static pd_status_t bf16_dnnl(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                             int m, int n, int k)
{
    uint16_t *xb = round_x_bf16(be, x, m, k, m);
    if (xb == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = w.layout == PD_WEIGHT_PAIRS32
                         ? pd_cpu_dnnl_matmul_bf16_blocked(y, xb, w.data, bias, m, n, k, be->num_threads)
                         : pd_cpu_dnnl_matmul_bf16(y, xb, w.data, bias, m, n, k, be->num_threads);
    free(xb);
    return st;
}

/* --matmul-precision bf16 on row-major weights up to the GEMV's rows: the AVX512-BF16 GEMV. */
static pd_status_t bf16_gemv(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                             int m, int n, int k)
{
    int nt = be->num_threads;
    uint16_t *xb = round_x_bf16(be, x, m, k, m);
    if (xb == NULL) {
        return PD_ERR_NO_MEMORY;
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0, n1;
        if (thread_cols(n, nt, t, 16, &n0, &n1)) {
            pd_cpu_gemv_bf16dot(y, xb, w.data, bias, m, n, k, n0, n1);
        }
    }
    free(xb);
    return PD_OK;
}

/* The first entry of the table (below) that serves the call in fp32 or bf16 math. */
static const pd_cpu_matmul_variant_t *choose(bool bf16_math, const pd_backend_t *be, const pd_weight_t *w,
                                             int m, int n, int k);
static pd_status_t run_variant(const pd_cpu_matmul_variant_t *v, pd_backend_t *be, float *y, const float *x,
                               pd_weight_t w, const float *bias, int m, int n, int k);

/* --matmul-precision bf16 anywhere else: x rounded to bf16, then the fp32-math part of the table on
 * the rounded x (it computes the same exact products: where oneDNN would emulate bf16 — no
 * AVX512-BF16 — this is faster, and rounds alike at every row count). */
static pd_status_t bf16_via_fp32(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                                 int m, int n, int k)
{
    uint16_t *xb = round_x_bf16(be, x, m, k, m);
    float *xr = xb != NULL ? malloc((size_t)m * k * sizeof(float)) : NULL;
    pd_status_t st = xr != NULL ? PD_OK : PD_ERR_NO_MEMORY;
    if (xr != NULL) {
        pd_cpu_widen(xr, xb, PD_DTYPE_BF16, (int64_t)m * k);
        const pd_cpu_matmul_variant_t *v = choose(false, be, &w, m, n, k);
        st = v != NULL ? run_variant(v, be, y, xr, w, bias, m, n, k) : PD_ERR_UNSUPPORTED;
    } else {
        pd_log_error("matmul: cannot allocate %d x %d rounded inputs", m, k);
    }
    free(xr);
    free(xb);
    return st;
}

/* ------------------------------------------------------------------ the variant table */

static bool blocked(const pd_weight_t *w)
{
    return w->layout == PD_WEIGHT_PAIRS32 || w->layout == PD_WEIGHT_COLS32;
}

static bool rows_bf16(const pd_weight_t *w)
{
    return w->layout == PD_WEIGHT_ROWS && w->dtype == PD_DTYPE_BF16;
}

static bool lowp_rows(const pd_weight_t *w)
{
    return w->layout == PD_WEIGHT_ROWS && w->dtype != PD_DTYPE_F32;
}

/* every row of these n in a block, k whole blocks of 32: oneDNN's BA16a32b2a (matmul_bf16p.h) */
static bool amx_blocks(const pd_weight_t *w, int n, int k)
{
    return w->layout == PD_WEIGHT_PAIRS32 && pd_cpu_bf16p_amx_fits(n, w->packed_rows, k);
}

/* The bf16 GEMV's rows: above them AMX or oneDNN (gemv_max < PD_BF16P_AMX_MIN_M). */
static int bf16_gemv_max(void)
{
    return pd_cpu_dnnl_amx() ? PD_BF16DOT_AMX_MAX_M : PD_BF16DOT_MAX_M;
}

static bool s_amx_x3(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    /* bf16 from PD_BF16P_AMX_X3_MIN_M rows, int8 above the outer-product kernel's rows; fp32 weights
     * never (not exact in bf16 parts); the AMX kernel multiplies bf16 parts with `vdpbf16ps` too */
    int from = w->layout == PD_WEIGHT_PAIRS32 ? PD_BF16P_AMX_X3_MIN_M : PD_COLS32_MAX_M + 1;
    return blocked(w) && w->dtype != PD_DTYPE_F32 && m >= from &&
           pd_cpu_bf16p_amx_fits(n, w->packed_rows, k) && amx_wanted();
}

static bool s_blocked_outer(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return blocked(w) && m <= (w->layout == PD_WEIGHT_COLS32 ? PD_COLS32_MAX_M : PD_BF16P_MAX_M);
}

static bool s_blocked_tiles(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return blocked(w);
}

static bool s_bf16x3_dnnl(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return rows_bf16(w) && m >= PD_BF16X3_AMX_MIN_M && m <= PD_BF16X3_AMX_MAX_M &&
           (int64_t)n * k >= PD_BF16X3_AMX_MIN_WEIGHTS;
}

static bool s_w_x512(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return w->layout == PD_WEIGHT_ROWS && (w->dtype == PD_DTYPE_BF16 || w->dtype == PD_DTYPE_F32) && m > 1 &&
           m <= PD_BF16W_X512_MAX_M;
}

static bool s_bf16x3_gemv(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return rows_bf16(w) && m <= PD_BF16X3_MAX_M;
}

static bool s_lowp_gemv(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return lowp_rows(w) && m <= PD_LOWP_GEMV_MAX_M;
}

static bool s_lowp_tiles(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return lowp_rows(w);
}

static bool s_f32_blas(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return w->layout == PD_WEIGHT_ROWS && w->dtype == PD_DTYPE_F32;
}

static bool s_bf16_dot(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    /* up to the GEMV's rows, and at every row count for rows past the blocks, which only it reads */
    return w->layout == PD_WEIGHT_PAIRS32 && k % 32 == 0 && (m <= bf16_gemv_max() || !amx_blocks(w, n, k));
}

static bool s_bf16_amx(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return amx_blocks(w, n, k) && m >= PD_BF16P_AMX_MIN_M && amx_wanted();
}

static bool s_bf16_dnnl(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return (amx_blocks(w, n, k) || w->layout == PD_WEIGHT_ROWS) && m > bf16_gemv_max();
}

static bool s_bf16_gemv(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return w->layout == PD_WEIGHT_ROWS && m <= bf16_gemv_max();
}

static bool s_any(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k)
{
    return true;
}

/* The entries over one kernel function and a choice inside it (matmul_blocked: outer-product
 * kernels or tiles; matmul_bf16x3: GEMV or oneDNN; matmul_tail: which row-major kernel). */
#define ENTRY(name, fn, choice)                                                                              \
    static pd_status_t name(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,    \
                            int m, int n, int k)                                                             \
    {                                                                                                        \
        return fn(be, y, x, w, bias, m, n, k, choice);                                                       \
    }
ENTRY(run_blocked_outer, matmul_blocked, true)
ENTRY(run_blocked_tiles, matmul_blocked, false)
ENTRY(run_bf16x3_gemv, matmul_bf16x3, true)
ENTRY(run_bf16x3_dnnl, matmul_bf16x3, false)
ENTRY(run_lowp_gemv_x86, matmul_tail, TAIL_GEMV_X86)
ENTRY(run_lowp_gemv, matmul_tail, TAIL_GEMV)
ENTRY(run_lowp_tiles, matmul_tail, TAIL_TILES)
ENTRY(run_f32_blas, matmul_tail, TAIL_F32)

static bool dnnl_amx(void)
{
    return pd_cpu_dnnl_amx();
}

static bool dnnl_bf16(void)
{
    return pd_cpu_dnnl_bf16_native();
}

const pd_cpu_matmul_variant_t pd_cpu_matmul_variants[] = {
    /* fp32 math */
    {"amx_x3", PD_ISA_AMX, false, NULL, s_amx_x3, matmul_amx_x3, 0,
     "blocked bf16 from 32 rows, blocked int8 above 64: x in three exact bf16 parts on AMX tiles"},
    {"blocked_outer", PD_ISA_AVX512, false, NULL, s_blocked_outer, run_blocked_outer, PD_BF16P_MAX_M,
     "blocked bf16/int8/fp32 up to 64 rows: the layouts' outer-product kernels"},
    {"blocked_tiles", PD_ISA_AVX512, false, NULL, s_blocked_tiles, run_blocked_tiles, 0,
     "blocked bf16/int8/fp32, any rows: blocks widened into transposed fp32 tiles + sgemm"},
    {"bf16x3_dnnl", PD_ISA_AMX, false, dnnl_amx, s_bf16x3_dnnl, run_bf16x3_dnnl, 0,
     "row-major bf16, 24..64 rows of >= 4 M weights: x in three bf16 parts through oneDNN on AMX"},
    {"w_x512", PD_ISA_AVX512, false, NULL, s_w_x512, matmul_w_x512, 0,
     "row-major bf16/fp32, 2..64 rows: register-blocked, widened in registers"},
    {"bf16x3_gemv", PD_ISA_AVX512_BF16, false, NULL, s_bf16x3_gemv, run_bf16x3_gemv, PD_BF16X3_MAX_M,
     "row-major bf16 up to 10 rows: x in three exact bf16 parts through the vdpbf16ps GEMV"},
    {"lowp_gemv_avx2", PD_ISA_AVX2, false, NULL, s_lowp_gemv, run_lowp_gemv_x86, PD_LOWP_GEMV_MAX_M,
     "row-major bf16/fp16/int8 up to 8 rows: the GEMV widening in AVX2 registers"},
    {"lowp_gemv", PD_ISA_PORTABLE, false, NULL, s_lowp_gemv, run_lowp_gemv, PD_LOWP_GEMV_MAX_M,
     "row-major bf16/fp16/int8 up to 8 rows: the portable GEMV"},
    {"lowp_tiles", PD_ISA_PORTABLE, false, NULL, s_lowp_tiles, run_lowp_tiles, 0,
     "row-major bf16/fp16/int8, any rows: tiles widened into fp32 + sgemm"},
    {"f32_blas", PD_ISA_PORTABLE, false, NULL, s_f32_blas, run_f32_blas, 1,
     "row-major fp32, any rows: OpenBLAS sgemv/sgemm"},
    /* bf16 math (--matmul-precision bf16 on bf16 weights) */
    {"bf16_dot", PD_ISA_AVX512_BF16, true, NULL, s_bf16_dot, matmul_bf16_dot, 0,
     "blocked bf16, k % 32 == 0, up to the GEMV's rows (32; 16 with AMX) or not in whole AMX blocks: "
     "vdpbf16ps"},
    {"bf16_amx", PD_ISA_AMX, true, NULL, s_bf16_amx, bf16_amx, 0,
     "blocked bf16 in whole AMX blocks from 17 rows: AMX"},
    {"bf16_dnnl", PD_ISA_AVX512_BF16, true, dnnl_bf16, s_bf16_dnnl, bf16_dnnl, 0,
     "row-major or whole-block bf16 above the GEMV's rows: oneDNN"},
    {"bf16_gemv", PD_ISA_AVX512_BF16, true, NULL, s_bf16_gemv, bf16_gemv, 0,
     "row-major bf16 up to the GEMV's rows: the vdpbf16ps GEMV"},
    {"bf16_via_fp32", PD_ISA_PORTABLE, true, NULL, s_any, bf16_via_fp32, PD_INV_ROWS_ANY,
     "any bf16: x rounded to bf16, then the fp32-math entries"},
};
const int pd_cpu_num_matmul_variants =
    (int)(sizeof(pd_cpu_matmul_variants) / sizeof(pd_cpu_matmul_variants[0]));

bool pd_cpu_matmul_variant_usable(const pd_cpu_matmul_variant_t *v)
{
    return pd_cpu_isa_usable(v->isa) && (v->needs == NULL || v->needs());
}

static const pd_cpu_matmul_variant_t *choose(bool bf16_math, const pd_backend_t *be, const pd_weight_t *w,
                                             int m, int n, int k)
{
    for (int i = 0; i < pd_cpu_num_matmul_variants; i++) {
        const pd_cpu_matmul_variant_t *v = &pd_cpu_matmul_variants[i];
        if (v->bf16_math != bf16_math || !pd_cpu_matmul_variant_usable(v)) {
            continue;
        }
        /* batch-invariant: an entry that serves one row and a whole chunk (an entry of any rows hands
         * them on, chunked there: one row says it all) */
        int chunk = v->inv_rows == PD_INV_ROWS_ANY ? 1 : v->inv_rows;
        if (be->batch_invariant
                ? v->inv_rows > 0 && v->serves(be, w, 1, n, k) && v->serves(be, w, chunk, n, k)
                : v->serves(be, w, m, n, k)) {
            return v;
        }
    }
    return NULL;
}

/* v on m rows; under be->batch_invariant at most v->inv_rows rows a call, so every row is computed as
 * it is alone (the chunks run one after another, each on every thread). */
static pd_status_t run_variant(const pd_cpu_matmul_variant_t *v, pd_backend_t *be, float *y, const float *x,
                               pd_weight_t w, const float *bias, int m, int n, int k)
{
    if (!be->batch_invariant || m <= v->inv_rows) {
        return v->run(be, y, x, w, bias, m, n, k);
    }
    for (int i = 0; i < m; i += v->inv_rows) {
        int r = m - i < v->inv_rows ? m - i : v->inv_rows;
        PD_TRY(v->run(be, y + (size_t)i * n, x + (size_t)i * k, w, bias, r, n, k));
    }
    return PD_OK;
}

const pd_cpu_matmul_variant_t *pd_cpu_matmul_choose(const pd_backend_t *be, const pd_weight_t *w, int m,
                                                    int n, int k)
{
    return choose(be->matmul_precision == PD_MATMUL_BF16 && w->dtype == PD_DTYPE_BF16, be, w, m, n, k);
}

pd_status_t pd_cpu_matmul(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias, int m,
                          int n, int k)
{
    if (m == 0 || n == 0) {
        return PD_OK;
    }
    const pd_cpu_matmul_variant_t *v = pd_cpu_matmul_choose(be, &w, m, n, k);
    if (v == NULL) {
        pd_log_error("matmul: no CPU variant serves weights of dtype %d, layout %d at %d x %d x %d here",
                     (int)w.dtype, (int)w.layout, m, n, k);
        return PD_ERR_UNSUPPORTED;
    }
    return run_variant(v, be, y, x, w, bias, m, n, k);
}
