/* kernels/cuda/cuda_internal.cuh — what the CUDA backend's files share: the backend state (one
 * stream, cuBLAS), status checks, the per-op metadata upload, block/warp reductions, and the ops
 * each file defines (kernels/cuda/: backend_cuda.cu the table, memory and copies; cuda_matmul.cu,
 * cuda_elementwise.cu, cuda_attention.cu, cuda_sample.cu one op family each, as kernels/cpu/).
 * Index math comes only from kernels/paged_impl.h and dtype_impl.h (the CPU backend's). */
#ifndef PD_KERNELS_CUDA_INTERNAL_CUH
#define PD_KERNELS_CUDA_INTERNAL_CUH

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

extern "C" {
#include "common/log.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/dtype_impl.h"
#include "kernels/paged_impl.h"
}

namespace pd_cuda
{

struct cuda_state {
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch; /* device copies of host metadata */
    size_t scratch_cap;
    void *attn_ws; /* decode attention's partial results, grown when a step needs more (cu_alloc'd) */
    size_t attn_ws_cap;
    void *mm_ws; /* x rounded to a 16-bit weight's dtype for cublasGemmEx (cu_alloc'd, grown) */
    size_t mm_ws_cap;
    int device;
    std::mutex mu;
    std::unordered_map<void *, size_t> sizes; /* allocator accounting (profile run) */
};

inline cuda_state *S(pd_backend_t *be)
{
    return static_cast<cuda_state *>(be->impl);
}

inline pd_status_t check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        pd_log_error("cuda backend: %s: %s", what, cudaGetErrorString(e));
        return PD_ERR_BACKEND;
    }
    return PD_OK;
}

inline pd_status_t check_launch(const char *kernel)
{
    return check(cudaGetLastError(), kernel);
}

#define TRY(x)                                                                                               \
    do {                                                                                                     \
        pd_status_t st_ = (x);                                                                               \
        if (st_ != PD_OK)                                                                                    \
            return st_;                                                                                      \
    } while (0)

/* Copies host metadata arrays into the device scratch area (16-byte aligned pieces), one op's
 * worth per upload object: every put of the op stays valid until the object is destroyed. When a
 * put outgrows the area, a larger one takes over and the old one is freed only in the destructor
 * (after the op's launches; cudaFree waits for the device), so the op's earlier puts do not
 * dangle. Reuse across ops is safe by stream order (the next op's copies run after this op's
 * kernels). */
struct upload {
    pd_backend_t *be;
    size_t used = 0;
    pd_status_t st = PD_OK;
    std::vector<void *> retired; /* areas earlier puts of this op still point into */
    explicit upload(pd_backend_t *b) : be(b)
    {
    }
    ~upload()
    {
        for (void *p : retired) {
            cudaFree(p);
        }
    }
    upload(const upload &) = delete;
    upload &operator=(const upload &) = delete;
    template <typename T> const T *put(const T *host, size_t n)
    {
        if (st != PD_OK || host == nullptr || n == 0) {
            return nullptr;
        }
        size_t bytes = n * sizeof(T), off = (used + 15) & ~size_t(15);
        cuda_state *s = S(be);
        if (off + bytes > s->scratch_cap) {
            /* grow: the old area lives on until this op is done with it (the destructor) */
            size_t cap = (off + bytes) * 2 > (1u << 20) ? (off + bytes) * 2 : (1u << 20);
            void *p = nullptr;
            if ((st = check(cudaMalloc(&p, cap), "scratch cudaMalloc")) != PD_OK) {
                return nullptr;
            }
            if (s->scratch != nullptr) {
                retired.push_back(s->scratch);
            }
            s->scratch = p;
            s->scratch_cap = cap;
            off = 0;
            used = 0;
        }
        char *dst = static_cast<char *>(s->scratch) + off;
        st = check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s->stream), "metadata upload");
        used = off + bytes;
        return reinterpret_cast<const T *>(dst);
    }
};

/* ------------------------------------------------------------------ reductions */

static __device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

/* Block-wide sum / max (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result. */
static __device__ __forceinline__ float block_sum(float v)
{
    __shared__ float part[32];
    v = warp_sum(v);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        part[w] = v;
    }
    __syncthreads();
    float t = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.0f;
    if (w == 0) {
        t = warp_sum(t);
        if (lane == 0) {
            part[0] = t;
        }
    }
    __syncthreads();
    return part[0];
}

static __device__ __forceinline__ float block_max(float v)
{
    __shared__ float part[32];
    v = warp_max(v);
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        part[w] = v;
    }
    __syncthreads();
    float t = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : -INFINITY;
    if (w == 0) {
        t = warp_max(t);
        if (lane == 0) {
            part[0] = t;
        }
    }
    __syncthreads();
    return part[0];
}

inline int blocks_for(size_t n, int threads)
{
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    return (int)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

/* ------------------------------------------------------------------ the ops (one file per family) */

/* backend_cuda.cu: memory, copies, pages, pinning */
pd_status_t cu_alloc(pd_backend_t *be, size_t bytes, void **out);
void cu_free(pd_backend_t *be, void *p);
pd_status_t cu_copy(pd_backend_t *be, void *dst, const void *src, size_t bytes, pd_copy_kind_t kind);
pd_status_t cu_sync(pd_backend_t *be);
pd_status_t cu_gather(pd_backend_t *be, void *dst, const void *region, const pd_page_range_t *r, int n);
pd_status_t cu_scatter(pd_backend_t *be, void *region, const void *src, const pd_page_range_t *r, int n);
pd_status_t cu_copy_pages(pd_backend_t *be, void *dst, const void *src, const pd_page_range_t *r, int n,
                          pd_copy_kind_t kind);
pd_status_t cu_pin_host(pd_backend_t *be, void *p, size_t bytes);
void cu_unpin_host(pd_backend_t *be, void *p);

/* A workspace (*ws, *cap) of at least bytes, reserved once and grown, never per call (a cudaMalloc +
 * sync + cudaFree on every layer of every step stalls the stream). Growing frees the old one with
 * cudaFree, which waits for the kernels still using it. */
pd_status_t cu_workspace(pd_backend_t *be, void **ws, size_t *cap, size_t bytes, void **out);

/* cuda_matmul.cu */
pd_status_t cu_matmul(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias, int m,
                      int n, int k);

/* cuda_elementwise.cu: embedding, norms, RoPE, activations, softmax, the KV cache write */
pd_status_t cu_embed(pd_backend_t *be, float *out, pd_weight_t table, float scale, const int32_t *ids, int n,
                     int dim, int vocab);
pd_status_t cu_add(pd_backend_t *be, float *y, const float *x, size_t n);
pd_status_t cu_rmsnorm(pd_backend_t *be, float *out, const float *x, const float *w, int rows, int dim,
                       float eps);
pd_status_t cu_layernorm(pd_backend_t *be, float *out, const float *x, const float *w, const float *b,
                         int rows, int dim, float eps);
pd_status_t cu_rope(pd_backend_t *be, float *x, const int32_t *positions, int num_tokens, int num_heads,
                    int head_size, const pd_rope_t *rope);
pd_status_t cu_gelu(pd_backend_t *be, float *x, size_t n);
pd_status_t cu_silu_mul(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter);
pd_status_t cu_gelu_mul(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter);
pd_status_t cu_softmax(pd_backend_t *be, float *x, int rows, int cols);
pd_status_t cu_reshape_and_cache(pd_backend_t *be, const pd_kv_view_t *kv, const float *k, const float *v,
                                 const int32_t *slots, int num_tokens);

/* cuda_attention.cu: paged attention, prefill and split-K decode */
pd_status_t cu_attn_prefill(pd_backend_t *be, float *out, const float *q, const pd_kv_view_t *kv,
                            const pd_attn_meta_t *meta, int num_heads, float scale);
pd_status_t cu_attn_decode(pd_backend_t *be, float *out, const float *q, const pd_kv_view_t *kv,
                           const pd_attn_meta_t *meta, int num_heads, float scale);

/* cuda_sample.cu: greedy and sampled tokens from device logits */
pd_status_t cu_sample(pd_backend_t *be, int32_t *tokens, float *logits, int n, int vocab,
                      const pd_sampling_params_t *params, pd_rng_t *rngs);

} /* namespace pd_cuda */

#endif
