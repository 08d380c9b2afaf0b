/* kernels/cpu/norm.c — RMSNorm and LayerNorm over rows. */
#include <math.h>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd.h"

pd_status_t pd_cpu_rmsnorm_ref(pd_backend_t *be, float *out, const float *x, const float *w, int rows,
                               int dim, float eps)
{
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        double ss = 0;
        for (int i = 0; i < dim; i++) {
            ss += (double)xr[i] * xr[i];
        }
        float inv = (float)(1.0 / sqrt(ss / dim + eps));
        float *o = out + (size_t)r * dim;
        for (int i = 0; i < dim; i++) {
            o[i] = xr[i] * inv * w[i];
        }
    }
    return PD_OK;
}

PD_CPU_BODY void rmsnorm_row_body(float *o, const float *xr, const float *w, int dim, float eps)
{
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; i++) {
        ss += xr[i] * xr[i];
    }
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) {
        o[i] = xr[i] * inv * w[i];
    }
}
PD_CPU_VARIANTS_VOID(rmsnorm_row, (float *o, const float *xr, const float *w, int dim, float eps),
                     (o, xr, w, dim, eps))

pd_status_t pd_cpu_rmsnorm(pd_backend_t *be, float *out, const float *x, const float *w, int rows, int dim,
                           float eps)
{
#pragma omp parallel for num_threads(be->num_threads) schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        rmsnorm_row(out + (size_t)r * dim, x + (size_t)r * dim, w, dim, eps);
    }
    return PD_OK;
}

pd_status_t pd_cpu_layernorm_ref(pd_backend_t *be, float *out, const float *x, const float *w, const float *b,
                                 int rows, int dim, float eps)
{
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        double mean = 0;
        for (int i = 0; i < dim; i++) {
            mean += xr[i];
        }
        mean /= dim;
        double var = 0;
        for (int i = 0; i < dim; i++) {
            var += (xr[i] - mean) * (xr[i] - mean);
        }
        var /= dim;
        double inv = 1.0 / sqrt(var + eps);
        float *o = out + (size_t)r * dim;
        for (int i = 0; i < dim; i++) {
            o[i] = (float)((xr[i] - mean) * inv) * w[i] + b[i];
        }
    }
    return PD_OK;
}

PD_CPU_BODY void layernorm_row_body(float *o, const float *xr, const float *w, const float *b, int dim,
                                    float eps)
{
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < dim; i++) {
        sum += xr[i];
    }
    float mean = sum / (float)dim;
    float var = 0;
#pragma omp simd reduction(+ : var)
    for (int i = 0; i < dim; i++) {
        var += (xr[i] - mean) * (xr[i] - mean);
    }
    float inv = 1.0f / sqrtf(var / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) {
        o[i] = (xr[i] - mean) * inv * w[i] + b[i];
    }
}
PD_CPU_VARIANTS_VOID(layernorm_row,
                     (float *o, const float *xr, const float *w, const float *b, int dim, float eps),
                     (o, xr, w, b, dim, eps))

pd_status_t pd_cpu_layernorm(pd_backend_t *be, float *out, const float *x, const float *w, const float *b,
                             int rows, int dim, float eps)
{
#pragma omp parallel for num_threads(be->num_threads) schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        layernorm_row(out + (size_t)r * dim, x + (size_t)r * dim, w, b, dim, eps);
    }
    return PD_OK;
}
