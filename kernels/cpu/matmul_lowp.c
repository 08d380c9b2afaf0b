/* kernels/cpu/matmul_lowp.c — the portable 16-bit weight GEMV and widener, and the dispatch to
 * the x86 versions (matmul_lowp_x86.c) when the CPU has them. */
#include <string.h>

#include "kernels/cpu/matmul_lowp.h"

static int x86_usable(void)
{
#if defined(__x86_64__)
    static int usable = -1; /* a benign race: every thread computes the same answer */
    if (__atomic_load_n(&usable, __ATOMIC_RELAXED) < 0) {
        __atomic_store_n(&usable, pd_cpu_lowp_x86_usable(), __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&usable, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

void pd_cpu_widen_rows(float *dst, pd_weight_t w, int64_t row0, int64_t rows, int64_t cols)
{
    if (w.layout != PD_WEIGHT_ROWS) { /* a packed table's rows (a tied embedding): element by element */
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) {
                dst[r * cols + c] = pd_weight_at(w, row0 + r, c, cols);
            }
        }
        return;
    }
    const char *src = pd_weight_rows(w, row0, cols).data;
    if (w.dtype == PD_DTYPE_F32) {
        memcpy(dst, src, (size_t)(rows * cols) * sizeof(float));
        return;
    }
    size_t row_bytes = (size_t)cols * (size_t)pd_dtype_size(w.dtype);
    for (int64_t r = 0; r < rows; r++) {
        float scale = w.scale != NULL ? w.scale[row0 + r] : 1.0f;
        float *d = dst + r * cols;
        if (x86_usable()) {
            pd_cpu_widen_x86(d, src + (size_t)r * row_bytes, w.dtype, (size_t)cols, scale);
            continue;
        }
        for (int64_t c = 0; c < cols; c++) {
            d[c] = pd_dtype_load(src + (size_t)r * row_bytes, c, w.dtype) * scale;
        }
    }
}

size_t pd_cpu_gemv_lowp_scratch(pd_dtype_t dt, int m, int k, bool invariant)
{
    return pd_cpu_gemv_lowp_x86_wants_xp(dt, m, invariant) ? (size_t)m * k : 0;
}

/* The x86 bf16 GEMV's order: each group of 16 floats of a row as its 8 even then its 8 odd
 * elements (the lanes a 256-bit load of 16 bf16 weights widens into); the k % 16 tail is unused. */
void pd_cpu_gemv_lowp_prepare(float *xp, const float *x, pd_dtype_t dt, int m, int k, bool invariant)
{
    if (pd_cpu_gemv_lowp_scratch(dt, m, k, invariant) == 0) {
        return;
    }
    for (int i = 0; i < m; i++) {
        const float *xr = x + (size_t)i * k;
        float *pr = xp + (size_t)i * k;
        for (int g = 0; g + 16 <= k; g += 16) {
            for (int e = 0; e < 8; e++) {
                pr[g + e] = xr[g + 2 * e];
                pr[g + 8 + e] = xr[g + 2 * e + 1];
            }
        }
    }
}

void pd_cpu_gemv_lowp(float *y, const float *x, const float *xp, pd_weight_t w, const float *bias, int m,
                      int n, int k, int n0, int n1, bool x86, bool invariant)
{
    if (x86) {
        pd_cpu_gemv_lowp_x86(y, x, xp, w, bias, m, n, k, n0, n1, invariant);
        return;
    }
    for (int i = 0; i < m; i++) {
        for (int j = n0; j < n1; j++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) {
                acc += x[(size_t)i * k + p] * pd_dtype_load(w.data, (int64_t)j * k + p, w.dtype);
            }
            acc *= w.scale != NULL ? w.scale[j] : 1.0f;
            y[(size_t)i * n + j] = acc + (bias != NULL ? bias[j] : 0.0f);
        }
    }
}
