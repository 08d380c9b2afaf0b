/* kernels/cpu/matmul.c — y[m][n] = x[m][k] · w[n][k]ᵀ + bias: a plain loop and OpenBLAS sgemm. */
#include <cblas.h>

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

pd_status_t pd_cpu_matmul(pd_backend_t *be, float *y, const float *x, const float *w, const float *bias,
                          int m, int n, int k)
{
    if (m == 0 || n == 0) {
        return PD_OK;
    }
    float beta = 0.0f;
    if (bias != NULL) {
        for (int i = 0; i < m; i++) {
            for (int j = 0; j < n; j++) {
                y[(size_t)i * n + j] = bias[j];
            }
        }
        beta = 1.0f;
    }
    if (m == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w, k, x, 1, beta, y, 1);
    } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, beta, y, n);
    }
    return PD_OK;
}
