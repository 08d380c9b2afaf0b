/* kernels/cuda/cuda_matmul.cu — y = x · wᵀ + bias through cuBLAS (fp32 weights; --matmul-precision
 * lets tensor cores round the inputs), and the bias broadcast. */
#include "kernels/cuda/cuda_internal.cuh"

namespace pd_cuda
{
namespace
{

/* y[m][n] += bias[n] */
__global__ void bias_kernel(float *y, const float *bias, int n)
{
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        y[(size_t)blockIdx.x * n + j] += bias[j];
    }
}

} /* namespace */

pd_status_t cu_matmul(pd_backend_t *be, float *y, const float *x, const float *w, const float *bias, int m,
                      int n, int k)
{
    if (m == 0 || n == 0) {
        return PD_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    /* row-major y[m][n] = x·wᵀ is column-major yᵀ (n×m) = w·xᵀ: w row-major [n][k] read column-major is
     * k×n (so op T), x row-major [m][k] read column-major is xᵀ (k×m, op N) */
    const cublasComputeType_t ct = be->matmul_precision == PD_MATMUL_BF16   ? CUBLAS_COMPUTE_32F_FAST_16BF
                                   : be->matmul_precision == PD_MATMUL_FP16 ? CUBLAS_COMPUTE_32F_FAST_16F
                                   : be->matmul_precision == PD_MATMUL_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                            : CUBLAS_COMPUTE_32F;
    cublasStatus_t s = cublasGemmEx(S(be)->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_32F, k, x,
                                    CUDA_R_32F, k, &zero, y, CUDA_R_32F, n, ct, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        pd_log_error("cuda matmul: cublasGemmEx failed (%d) for %dx%dx%d", (int)s, m, n, k);
        return PD_ERR_BACKEND;
    }
    if (bias != nullptr) {
        bias_kernel<<<m, 256, 0, S(be)->stream>>>(y, bias, n);
        return check_launch("bias");
    }
    return PD_OK;
}

} /* namespace pd_cuda */
