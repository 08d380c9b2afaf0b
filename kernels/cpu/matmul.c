/* kernels/cpu/matmul.c — y[m][n] = x[m][k] · w[n][k]ᵀ + bias: a plain loop and OpenBLAS sgemm. */
#include <cblas.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

pd_status_t pd_cpu_matmul_ref(pd_backend_t *be, float *y, const float *x, const float *w, const float *bias,
                              int m, int n, int k)
{
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            double acc = bias != NULL ? bias[j] : 0.0;
            for (int p = 0; p < k; p++) {
                acc += (double)x[(size_t)i * k + p] * w[(size_t)j * k + p];
            }
            y[(size_t)i * n + j] = (float)acc;
        }
    }
    return PD_OK;
}

/* One thread pool: OpenBLAS is single-threaded (set at backend creation) and runs inside our
 * OpenMP threads, each computing a slice of the output columns (rows of w). Two pools — OpenMP
 * workers spin-waiting while OpenBLAS's own threads run — halve throughput on a small machine.
 * Every matmul is split, however small: at batch 1 a decode step is a chain of GEMVs bound by
 * reading w, and a lone thread reads at about half the machine's bandwidth. (A 2 MFLOP threshold
 * ran q, k, v, o and down of the demo model on one core: 147-154 tok/s at batch 1 against 198-215
 * split, pd-bench-ops, bench/RESULTS.md 2026-11-23.) Slices stay whole 64-byte rows of y. */
pd_status_t pd_cpu_matmul(pd_backend_t *be, float *y, const float *x, const float *w, const float *bias,
                          int m, int n, int k)
{
    if (m == 0 || n == 0) {
        return PD_OK;
    }
    int nt = be->num_threads;
    int cols = (n + nt - 1) / nt;
    cols = (cols + 15) & ~15; /* slices of whole 64-byte rows of y */
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        int n0 = t * cols, n1 = n0 + cols < n ? n0 + cols : n;
        if (n0 >= n1) {
            continue;
        }
        float beta = 0.0f;
        if (bias != NULL) {
            for (int i = 0; i < m; i++) {
                memcpy(y + (size_t)i * n + n0, bias + n0, (size_t)(n1 - n0) * sizeof(float));
            }
            beta = 1.0f;
        }
        if (m == 1) {
            cblas_sgemv(CblasRowMajor, CblasNoTrans, n1 - n0, k, 1.0f, w + (size_t)n0 * k, k, x, 1, beta,
                        y + n0, 1);
        } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n1 - n0, k, 1.0f, x, k,
                        w + (size_t)n0 * k, k, beta, y + n0, n);
        }
    }
    return PD_OK;
}
