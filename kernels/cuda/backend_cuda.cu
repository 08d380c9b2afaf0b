/* kernels/cuda/backend_cuda.cu — the CUDA backend: the same function table as kernels/cpu/
 * (kernels/backend.h), device memory from cudaMalloc, one stream, cuBLAS for the matmuls, and a
 * kernel per op. This file holds the table, init/fini, memory, copies and page moves; the ops are
 * one file per family (cuda_matmul.cu, cuda_elementwise.cu, cuda_attention.cu, cuda_sample.cu),
 * sharing cuda_internal.cuh. Index math comes only from kernels/paged_impl.h and dtype_impl.h (the functions
 * the CPU backend calls), so the CPU tests cover the addressing used here.
 *
 * Host metadata (ids, positions, slot mappings, block tables, sequence lengths) is validated on
 * the host exactly as the CPU backend validates it (pd_cpu_attn_validate for attention), then
 * copied into a device scratch area. Every CUDA call and launch is checked; the first error is
 * logged and returned as PD_ERR_BACKEND.
 *
 * Not done on the device yet (said where it happens): sampling runs on the host when the logits
 * are host memory (the model runner copies them there) — with device logits, greedy rows use a
 * device argmax; the matmul takes fp32 weights only (the model keeps fp32 weights). */
#include "kernels/cuda/cuda_internal.cuh"

namespace pd_cuda
{

pd_status_t cu_alloc(pd_backend_t *be, size_t bytes, void **out)
{
    void *p = nullptr;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        pd_log_error("cuda backend: cudaMalloc of %zu bytes failed", bytes);
        return PD_ERR_NO_MEMORY;
    }
    {
        std::lock_guard<std::mutex> g(S(be)->mu);
        S(be)->sizes[p] = bytes;
        be->bytes_in_use += bytes;
        be->bytes_peak = be->bytes_in_use > be->bytes_peak ? be->bytes_in_use : be->bytes_peak;
    }
    *out = p;
    return PD_OK;
}

void cu_free(pd_backend_t *be, void *p)
{
    if (p == nullptr) {
        return;
    }
    {
        std::lock_guard<std::mutex> g(S(be)->mu);
        auto it = S(be)->sizes.find(p);
        if (it != S(be)->sizes.end()) {
            be->bytes_in_use -= it->second;
            S(be)->sizes.erase(it);
        }
    }
    cudaFree(p);
}

pd_status_t cu_workspace(pd_backend_t *be, void **ws, size_t *cap, size_t bytes, void **out)
{
    if (bytes > *cap) {
        size_t want = bytes > (size_t)4 << 20 ? bytes + bytes / 2 : (size_t)4 << 20;
        void *p = nullptr;
        TRY(cu_alloc(be, want, &p));
        cu_free(be, *ws);
        *ws = p;
        *cap = want;
    }
    *out = *ws;
    return PD_OK;
}

pd_status_t cu_copy(pd_backend_t *be, void *dst, const void *src, size_t bytes, pd_copy_kind_t kind)
{
    cudaMemcpyKind k = kind == PD_COPY_H2D   ? cudaMemcpyHostToDevice
                       : kind == PD_COPY_D2H ? cudaMemcpyDeviceToHost
                                             : cudaMemcpyDeviceToDevice;
    TRY(check(cudaMemcpyAsync(dst, src, bytes, k, S(be)->stream), "copy"));
    return check(cudaStreamSynchronize(S(be)->stream), "copy sync");
}

pd_status_t cu_sync(pd_backend_t *be)
{
    return check(cudaStreamSynchronize(S(be)->stream), "synchronize");
}

pd_status_t cu_gather(pd_backend_t *be, void *dst, const void *region, const pd_page_range_t *r, int n)
{
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        TRY(check(cudaMemcpyAsync(static_cast<char *>(dst) + off,
                                  static_cast<const char *>(region) + r[i].offset, r[i].length,
                                  cudaMemcpyDefault, S(be)->stream),
                  "gather_pages"));
        off += r[i].length;
    }
    return cu_sync(be);
}

pd_status_t cu_scatter(pd_backend_t *be, void *region, const void *src, const pd_page_range_t *r, int n)
{
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        TRY(check(cudaMemcpyAsync(static_cast<char *>(region) + r[i].offset,
                                  static_cast<const char *>(src) + off, r[i].length, cudaMemcpyDefault,
                                  S(be)->stream),
                  "scatter_pages"));
        off += r[i].length;
    }
    return cu_sync(be);
}

/* Mirror copy between the device KV region and its host staging region: one async copy per
 * range on the compute stream (ordered after the kernels that wrote the pages), one sync. */
pd_status_t cu_copy_pages(pd_backend_t *be, void *dst, const void *src, const pd_page_range_t *r, int n,
                          pd_copy_kind_t kind)
{
    cudaMemcpyKind k = kind == PD_COPY_H2D   ? cudaMemcpyHostToDevice
                       : kind == PD_COPY_D2H ? cudaMemcpyDeviceToHost
                                             : cudaMemcpyDeviceToDevice;
    for (int i = 0; i < n; i++) {
        TRY(check(cudaMemcpyAsync(static_cast<char *>(dst) + r[i].offset,
                                  static_cast<const char *>(src) + r[i].offset, r[i].length, k,
                                  S(be)->stream),
                  "copy_pages"));
    }
    return cu_sync(be);
}

pd_status_t cu_pin_host(pd_backend_t *be, void *p, size_t bytes)
{
    (void)be;
    return check(cudaHostRegister(p, bytes, cudaHostRegisterDefault), "cudaHostRegister");
}

void cu_unpin_host(pd_backend_t *be, void *p)
{
    (void)be;
    cudaHostUnregister(p);
}

} /* namespace pd_cuda */

using namespace pd_cuda;

extern "C" {

const pd_backend_ops_t pd_cuda_backend_ops = {
    "cuda",
    cu_alloc,
    cu_free,
    cu_copy,
    cu_sync,
    nullptr /* prepare_weight: row-major, as cuBLAS reads it */,
    cu_embed,
    cu_matmul,
    cu_add,
    cu_rmsnorm,
    cu_layernorm,
    cu_rope,
    cu_gelu,
    cu_silu_mul,
    cu_gelu_mul,
    cu_softmax,
    cu_reshape_and_cache,
    cu_attn_prefill,
    cu_attn_decode,
    cu_sample,
    cu_gather,
    cu_scatter,
    cu_copy_pages,
    cu_pin_host,
    cu_unpin_host,
};

int pd_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

pd_status_t pd_cuda_backend_init(pd_backend_t *be, int device)
{
    if (pd_cuda_device_count() <= device) {
        pd_log_error("cuda backend: no CUDA device %d", device);
        return PD_ERR_UNSUPPORTED;
    }
    cuda_state *s = new (std::nothrow) cuda_state();
    if (s == nullptr) {
        return PD_ERR_NO_MEMORY;
    }
    s->device = device;
    if (check(cudaSetDevice(device), "cudaSetDevice") != PD_OK ||
        check(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "stream") != PD_OK) {
        delete s;
        return PD_ERR_BACKEND;
    }
    if (cublasCreate(&s->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(s->blas, s->stream) != CUBLAS_STATUS_SUCCESS) {
        pd_log_error("cuda backend: cuBLAS init failed");
        cudaStreamDestroy(s->stream);
        delete s;
        return PD_ERR_BACKEND;
    }
    be->impl = s;
    be->host_memory = false; /* cudaMalloc: a host pipe stages through pinned memory */
    be->bf16_math_native = true;
    be->ops = &pd_cuda_backend_ops;
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) == cudaSuccess) {
        pd_log_info("cuda backend: device %d %s, %.1f GiB, sm_%d%d", device, p.name,
                    (double)p.totalGlobalMem / (1u << 30), p.major, p.minor);
        be->memory_bytes = p.totalGlobalMem; /* --gpu-memory-utilization is a share of this, as vLLM's */
    }
    return PD_OK;
}

void pd_cuda_backend_fini(pd_backend_t *be)
{
    cuda_state *s = S(be);
    if (s == nullptr) {
        return;
    }
    cudaStreamSynchronize(s->stream);
    cublasDestroy(s->blas);
    cu_free(be, s->attn_ws);
    cu_free(be, s->mm_ws);
    cudaFree(s->scratch);
    cudaStreamDestroy(s->stream);
    delete s;
    be->impl = nullptr;
}

} /* extern "C" */
