/* kernels/cuda/cuda_matmul.cu — y = x · wᵀ + bias through cuBLAS, and the bias broadcast.
 * fp32 weights: cublasGemmEx in fp32 (--matmul-precision lets tensor cores round the inputs).
 * bf16/fp16 weights (checkpoint precision): x is rounded to the weight's dtype in a workspace and
 * both go to cublasGemmEx as 16-bit inputs with an fp32 output and fp32 accumulation — tensor-core
 * math, as vLLM runs bf16 models; the CPU backend keeps x fp32 instead. */
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

/* out[i] = x[i] rounded to dt (bf16 or fp16), round-to-nearest-even (kernels/dtype_impl.h). */
__global__ void round_kernel(uint16_t *out, const float *x, size_t n, pd_dtype_t dt)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        pd_dtype_store(out, (int64_t)i, dt, x[i]);
    }
}

/* y = x · wᵀ with 16-bit w: x rounded into the matmul workspace, then one 16-bit cublasGemmEx. */
pd_status_t matmul_lowp(pd_backend_t *be, float *y, const float *x, pd_weight_t w, int m, int n, int k)
{
    size_t elems = (size_t)m * k;
    void *xs = nullptr;
    TRY(cu_workspace(be, &S(be)->mm_ws, &S(be)->mm_ws_cap, elems * 2, &xs));
    unsigned blocks = (unsigned)((elems + 255) / 256 < 4096 ? (elems + 255) / 256 : 4096);
    round_kernel<<<blocks, 256, 0, S(be)->stream>>>(static_cast<uint16_t *>(xs), x, elems, w.dtype);
    TRY(check_launch("matmul round"));
    const float one = 1.0f, zero = 0.0f;
    cudaDataType_t t = w.dtype == PD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    cublasStatus_t s = cublasGemmEx(S(be)->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.data, t, k, xs, t,
                                    k, &zero, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        pd_log_error("cuda matmul: cublasGemmEx (%s weights) failed (%d) for %dx%dx%d",
                     w.dtype == PD_DTYPE_BF16 ? "bf16" : "fp16", (int)s, m, n, k);
        return PD_ERR_BACKEND;
    }
    return PD_OK;
}

} /* namespace */

pd_status_t cu_matmul(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias, int m,
                      int n, int k)
{
    if (m == 0 || n == 0) {
        return PD_OK;
    }
    if (w.dtype == PD_DTYPE_I8) { /* the model refuses --quantization int8 on a device first */
        pd_log_error("cuda matmul: int8 weights are not implemented on the cuda backend");
        return PD_ERR_UNSUPPORTED;
    }
    if (w.dtype != PD_DTYPE_F32) {
        TRY(matmul_lowp(be, y, x, w, m, n, k));
        if (bias != nullptr) {
            bias_kernel<<<m, 256, 0, S(be)->stream>>>(y, bias, n);
            return check_launch("bias");
        }
        return PD_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    /* row-major y[m][n] = x·wᵀ is column-major yᵀ (n×m) = w·xᵀ: w row-major [n][k] read column-major is
     * k×n (so op T), x row-major [m][k] read column-major is xᵀ (k×m, op N) */
    const cublasComputeType_t ct = be->matmul_precision == PD_MATMUL_BF16   ? CUBLAS_COMPUTE_32F_FAST_16BF
                                   : be->matmul_precision == PD_MATMUL_FP16 ? CUBLAS_COMPUTE_32F_FAST_16F
                                   : be->matmul_precision == PD_MATMUL_TF32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                            : CUBLAS_COMPUTE_32F;
    cublasStatus_t s = cublasGemmEx(S(be)->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w.data, CUDA_R_32F,
                                    k, x, CUDA_R_32F, k, &zero, y, CUDA_R_32F, n, ct, CUBLAS_GEMM_DEFAULT);
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
