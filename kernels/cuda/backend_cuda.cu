/* kernels/cuda/backend_cuda.cu — the CUDA backend: the same function table as kernels/cpu/
 * (kernels/backend.h), device memory from cudaMalloc, one stream, cuBLAS for the matmuls, and a
 * kernel per op. Index math comes only from kernels/paged_impl.h and dtype_impl.h (the functions
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

namespace
{

struct cuda_state {
    cudaStream_t stream;
    cublasHandle_t blas;
    void *scratch; /* device copies of host metadata */
    size_t scratch_cap;
    void *attn_ws; /* decode attention's partial results, grown when a step needs more (cu_alloc'd) */
    size_t attn_ws_cap;
    int device;
    std::mutex mu;
    std::unordered_map<void *, size_t> sizes; /* allocator accounting (profile run) */
};

cuda_state *S(pd_backend_t *be)
{
    return static_cast<cuda_state *>(be->impl);
}

pd_status_t check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        pd_log_error("cuda backend: %s: %s", what, cudaGetErrorString(e));
        return PD_ERR_BACKEND;
    }
    return PD_OK;
}

pd_status_t check_launch(const char *kernel)
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

__device__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

__device__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

/* Block-wide sum / max (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result. */
__device__ float block_sum(float v)
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

__device__ float block_max(float v)
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

/* ------------------------------------------------------------------ elementwise kernels */

/* out[n][dim] = table[ids[i]][dim] */
__global__ void embed_kernel(float *out, const float *table, const int32_t *ids, int dim)
{
    const float *row = table + (size_t)ids[blockIdx.x] * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        out[(size_t)blockIdx.x * dim + d] = row[d];
    }
}

__global__ void add_kernel(float *y, const float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        y[i] += x[i];
    }
}

/* y[m][n] += bias[n] */
__global__ void bias_kernel(float *y, const float *bias, int n)
{
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        y[(size_t)blockIdx.x * n + j] += bias[j];
    }
}

/* One block per row: out = x / sqrt(mean(x²) + eps) · w */
__global__ void rmsnorm_kernel(float *out, const float *x, const float *w, int dim, float eps)
{
    const float *xr = x + (size_t)blockIdx.x * dim;
    float ss = 0;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        ss += xr[d] * xr[d];
    }
    float inv = rsqrtf(block_sum(ss) / dim + eps);
    float *o = out + (size_t)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        o[d] = xr[d] * inv * w[d];
    }
}

/* One block per row: out = (x − mean) / sqrt(var + eps) · w + b */
__global__ void layernorm_kernel(float *out, const float *x, const float *w, const float *b, int dim,
                                 float eps)
{
    const float *xr = x + (size_t)blockIdx.x * dim;
    float s = 0;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        s += xr[d];
    }
    float mean = block_sum(s) / dim;
    float v = 0;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float c = xr[d] - mean;
        v += c * c;
    }
    float inv = rsqrtf(block_sum(v) / dim + eps);
    float *o = out + (size_t)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        o[d] = (xr[d] - mean) * inv * w[d] + b[d];
    }
}

/* HF rotate-half RoPE with the model's rotary table (kernels/rope_impl.h, shared with the CPU); one
 * thread per (token, head, i < half). */
__global__ void rope_kernel(float *x, const int32_t *positions, int num_tokens, int num_heads, int head_size,
                            const pd_rope_t *rope)
{
    int half = head_size / 2;
    long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long total = (long long)num_tokens * num_heads * half;
    if (idx >= total) {
        return;
    }
    int i = (int)(idx % half);
    long long th = idx / half;
    int t = (int)(th / num_heads);
    float c, s;
    pd_rope_cos_sin(rope, i, positions[t], &c, &s);
    pd_rope_rotate(x + th * head_size, i, half, c, s);
}

__global__ void gelu_kernel(float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        double v = x[i];
        x[i] = (float)(0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
    }
}

__global__ void silu_mul_kernel(float *out, const float *gate_up, int inter)
{
    const float *g = gate_up + (size_t)blockIdx.x * 2 * inter, *u = g + inter;
    for (int j = threadIdx.x; j < inter; j += blockDim.x) {
        float a = g[j];
        out[(size_t)blockIdx.x * inter + j] = a / (1.0f + expf(-a)) * u[j];
    }
}

__global__ void gelu_mul_kernel(float *out, const float *gate_up, int inter)
{
    const float *g = gate_up + (size_t)blockIdx.x * 2 * inter, *u = g + inter;
    for (int j = threadIdx.x; j < inter; j += blockDim.x) {
        double v = g[j];
        double gelu = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
        out[(size_t)blockIdx.x * inter + j] = (float)(gelu * u[j]);
    }
}

__global__ void softmax_kernel(float *x, int cols)
{
    float *r = x + (size_t)blockIdx.x * cols;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        m = fmaxf(m, r[j]);
    }
    m = block_max(m);
    float s = 0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float e = expf(r[j] - m);
        r[j] = e;
        s += e;
    }
    float inv = 1.0f / block_sum(s);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        r[j] *= inv;
    }
}

/* One block per token: k and v rows into the cache at slot_mapping[t] (< 0: padding, skipped). */
__global__ void reshape_and_cache_kernel(pd_kv_view_t kv, const float *k, const float *v,
                                         const int32_t *slots)
{
    int64_t slot = slots[blockIdx.x];
    if (slot < 0) {
        return;
    }
    int H = kv.num_kv_heads, D = kv.head_size;
    for (int e = threadIdx.x; e < H * D; e += blockDim.x) {
        int h = e / D, d = e % D;
        int64_t ki = pd_slot_kv_index(slot, 0, h, kv.block_size, H, D) + d;
        int64_t vi = pd_slot_kv_index(slot, 1, h, kv.block_size, H, D) + d;
        pd_dtype_store(kv.base, ki, kv.dtype, k[(size_t)blockIdx.x * H * D + e]);
        pd_dtype_store(kv.base, vi, kv.dtype, v[(size_t)blockIdx.x * H * D + e]);
    }
}

/* ------------------------------------------------------------------ paged attention */

constexpr int ATTN_THREADS = 128;
constexpr int ATTN_TILE = 256; /* keys per tile (shared scores) */
constexpr int MAX_HEAD = 256;

/* q · key row (D elements of kv.dtype at element index ki), the lanes of a warp splitting the row;
 * the caller sums over the warp. Rows whose bytes are 16-byte aligned (D·size a multiple of 16,
 * as for every head size we serve) are read with one 16-byte load per lane per chunk (4 fp32 or
 * 8 fp16/bf16), converted by the shared dtype_impl.h functions; others element by element. */
__device__ __forceinline__ float key_dot(const pd_kv_view_t &kv, int64_t ki, const float *qs, int D, int lane)
{
    const int es = pd_dtype_size(kv.dtype), vec = 16 / es;
    const char *row = static_cast<const char *>(kv.base) + ki * es;
    float dot = 0;
    if (D % vec == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        for (int c = lane; c * vec < D; c += 32) {
            const uint4 raw = *reinterpret_cast<const uint4 *>(row + (size_t)c * 16);
            const float *qc = qs + c * vec;
            if (kv.dtype == PD_DTYPE_F32) {
                dot += qc[0] * __uint_as_float(raw.x) + qc[1] * __uint_as_float(raw.y) +
                       qc[2] * __uint_as_float(raw.z) + qc[3] * __uint_as_float(raw.w);
            } else {
                const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
                for (int e = 0; e < 8; e++) {
                    uint16_t h = (uint16_t)(w[e >> 1] >> ((e & 1) * 16));
                    dot += qc[e] * (kv.dtype == PD_DTYPE_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h));
                }
            }
        }
        return dot;
    }
    for (int d = lane; d < D; d += 32) {
        dot += qs[d] * pd_dtype_load(kv.base, ki + d, kv.dtype);
    }
    return dot;
}

/* Scores of keys [k0, k1) for one query row into sc[]: a warp per key, lanes over the head dim. */
__device__ void tile_scores(const pd_kv_view_t &kv, const pd_attn_meta_t &m, int seq, int g, const float *qs,
                            float scale, int64_t k0, int64_t k1, float *sc)
{
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int D = kv.head_size;
    for (int64_t j = k0 + w; j < k1; j += nw) {
        int64_t slot = pd_block_table_slot(m.block_tables, m.max_blocks_per_seq, seq, j, kv.block_size);
        int64_t ki = pd_slot_kv_index(slot, 0, g, kv.block_size, kv.num_kv_heads, D);
        float dot = warp_sum(key_dot(kv, ki, qs, D, lane));
        if (lane == 0) {
            sc[j - k0] = dot * scale;
        }
    }
}

/* Online softmax of one query row over keys [from, to), ATTN_TILE keys at a time. run_max,
 * run_sum and acc carry over between calls; acc[i] is output element threadIdx.x + i·blockDim.x,
 * unnormalised (Σ exp(score − run_max) · v). Every thread of the block calls it. */
__device__ void attend_keys(const pd_kv_view_t &kv, const pd_attn_meta_t &m, int seq, int g, const float *qs,
                            float scale, int64_t from, int64_t to, float *sc, float &run_max, float &run_sum,
                            float *acc)
{
    int D = kv.head_size;
    for (int64_t k0 = from; k0 < to; k0 += ATTN_TILE) {
        int64_t k1 = k0 + ATTN_TILE < to ? k0 + ATTN_TILE : to;
        tile_scores(kv, m, seq, g, qs, scale, k0, k1, sc);
        __syncthreads();
        float tm = -INFINITY;
        for (int64_t j = threadIdx.x; j < k1 - k0; j += blockDim.x) {
            tm = fmaxf(tm, sc[j]);
        }
        tm = block_max(tm);
        float new_max = fmaxf(run_max, tm), corr = expf(run_max - new_max), ts = 0;
        for (int64_t j = threadIdx.x; j < k1 - k0; j += blockDim.x) {
            float p = expf(sc[j] - new_max);
            sc[j] = p;
            ts += p;
        }
        ts = block_sum(ts); /* also orders the sc[] writes before the reads below */
        run_sum = run_sum * corr + ts;
        run_max = new_max;
        for (int i = 0; i * (int)blockDim.x + (int)threadIdx.x < D; i++) {
            int d = i * blockDim.x + threadIdx.x;
            float a = acc[i] * corr;
            for (int64_t j = k0; j < k1; j++) {
                int64_t slot =
                    pd_block_table_slot(m.block_tables, m.max_blocks_per_seq, seq, j, kv.block_size);
                int64_t vi = pd_slot_kv_index(slot, 1, g, kv.block_size, kv.num_kv_heads, D);
                a += sc[j - k0] * pd_dtype_load(kv.base, vi + d, kv.dtype);
            }
            acc[i] = a;
        }
        __syncthreads();
    }
}

/* Varlen prefill: one block per (query token, head), online softmax over key tiles. */
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_prefill_kernel(float *out, const float *q, pd_kv_view_t kv, pd_attn_meta_t m, int num_heads,
                        float scale)
{
    __shared__ float qs[MAX_HEAD];
    __shared__ float sc[ATTN_TILE];
    int t = blockIdx.x, h = blockIdx.y, D = kv.head_size;
    int seq = 0; /* the sequence of token t: cu_seqlens_q[seq] <= t < cu_seqlens_q[seq + 1] */
    int lo = 0, hi = m.num_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (m.cu_seqlens_q[mid] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    seq = lo;
    int q_len = m.cu_seqlens_q[seq + 1] - m.cu_seqlens_q[seq];
    int64_t pos = pd_query_pos(m.seq_lens[seq], q_len, t - m.cu_seqlens_q[seq]);
    int64_t first = pd_attn_first_key(pos, m.sliding_window);
    int g = pd_gqa_kv_head(h, num_heads, kv.num_kv_heads);
    const float *qv = q + ((size_t)t * num_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        qs[d] = qv[d];
    }
    __syncthreads();
    float run_max = -INFINITY, run_sum = 0;
    float acc[MAX_HEAD / ATTN_THREADS] = {0}; /* this thread's output elements d = threadIdx.x + i·blockDim */
    attend_keys(kv, m, seq, g, qs, scale, first, pos + 1, sc, run_max, run_sum, acc);
    float *o = out + ((size_t)t * num_heads + h) * D;
    for (int i = 0; i * (int)blockDim.x + (int)threadIdx.x < D; i++) {
        o[i * blockDim.x + threadIdx.x] = acc[i] / run_sum;
    }
}

constexpr int PARTITION = 512; /* keys per split-K partition of a decode */

/* Decode, split-K (vLLM's v2): one block per (sequence, head, partition of PARTITION keys);
 * partial output, max and sum per partition, combined by attn_reduce_kernel. */
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_decode_partial_kernel(float *tmp_out, float *tmp_max, float *tmp_sum, const float *q,
                               pd_kv_view_t kv, pd_attn_meta_t m, int num_heads, float scale, int num_parts)
{
    __shared__ float qs[MAX_HEAD];
    __shared__ float sc[ATTN_TILE];
    int seq = blockIdx.x, h = blockIdx.y, part = blockIdx.z, D = kv.head_size;
    int64_t pos = m.seq_lens[seq] - 1;
    int64_t first = pd_attn_first_key(pos, m.sliding_window);
    int64_t p0 = first + (int64_t)part * PARTITION, p1 = p0 + PARTITION <= pos + 1 ? p0 + PARTITION : pos + 1;
    size_t slot_out = ((size_t)seq * num_heads + h) * num_parts + part;
    if (p0 > pos) {
        if (threadIdx.x == 0) {
            tmp_max[slot_out] = -INFINITY;
            tmp_sum[slot_out] = 0;
        }
        return;
    }
    int g = pd_gqa_kv_head(h, num_heads, kv.num_kv_heads);
    const float *qv = q + ((size_t)m.cu_seqlens_q[seq] * num_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        qs[d] = qv[d];
    }
    __syncthreads();
    float run_max = -INFINITY, run_sum = 0;
    float acc[MAX_HEAD / ATTN_THREADS] = {0};
    attend_keys(kv, m, seq, g, qs, scale, p0, p1, sc, run_max, run_sum, acc);
    float *o = tmp_out + slot_out * D;
    for (int i = 0; i * (int)blockDim.x + (int)threadIdx.x < D; i++) {
        o[i * blockDim.x + threadIdx.x] = acc[i]; /* unnormalised: Σ exp(s − max) · v */
    }
    if (threadIdx.x == 0) {
        tmp_max[slot_out] = run_max;
        tmp_sum[slot_out] = run_sum;
    }
}

/* Combines the partitions of one (sequence, head): out = Σ_p e^(m_p − M) o_p / Σ_p e^(m_p − M) s_p. */
__global__ void attn_reduce_kernel(float *out, const float *tmp_out, const float *tmp_max,
                                   const float *tmp_sum, const int32_t *cu_seqlens_q, int num_heads, int D,
                                   int num_parts)
{
    int seq = blockIdx.x, h = blockIdx.y;
    size_t base = ((size_t)seq * num_heads + h) * num_parts;
    float M = -INFINITY;
    for (int p = 0; p < num_parts; p++) {
        M = fmaxf(M, tmp_max[base + p]);
    }
    float denom = 0;
    for (int p = 0; p < num_parts; p++) {
        denom += tmp_sum[base + p] > 0 ? expf(tmp_max[base + p] - M) * tmp_sum[base + p] : 0.0f;
    }
    float *o = out + ((size_t)cu_seqlens_q[seq] * num_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0;
        for (int p = 0; p < num_parts; p++) {
            if (tmp_sum[base + p] > 0) {
                a += expf(tmp_max[base + p] - M) * tmp_out[(base + p) * D + d];
            }
        }
        o[d] = a / denom;
    }
}

/* Greedy rows of device logits: one block per row, the first maximum wins (as the CPU's). */
__global__ void argmax_kernel(int32_t *out, const float *logits, int vocab)
{
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    const float *r = logits + (size_t)blockIdx.x * vocab;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        if (r[j] > best) {
            best = r[j];
            idx = j;
        }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            int oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = bi[0];
    }
}

/* Sampling of device logits with the CPU sampler's semantics (kernels/cpu/sample.c): z = logit/T,
 * candidates ordered by (z desc, id asc), top-k, softmax over the kept set (max subtracted), the
 * shortest prefix whose mass before each token is < top_p, then the first token in ascending id
 * order whose cumulative mass exceeds u·total, u drawn on the host from the sequence's generator
 * (so seeded runs agree across backends). No sort: the order is a unique 64-bit key per token and
 * both cut-offs are found by radix descent over it, one block of SAMPLE_THREADS per row. Sums are
 * double, as on the CPU (their order differs: a token exactly on a boundary may differ). */
#define SAMPLE_THREADS 1024

struct sample_row {
    int32_t row;   /* row of logits */
    int32_t top_k; /* kept candidates, 1..vocab (greedy rows: 1) */
    float temperature;
    float top_p; /* >= 1: off */
    float min_p; /* 0: off; else only tokens with expf(z - zmax) >= min_p stay candidates */
    double u;    /* uniform draw in [0, 1) */
};

/* ascending key = (z desc, id asc); -0 is folded into +0 (equal as floats on the CPU) */
__device__ __forceinline__ uint64_t cand_key(float z, int id)
{
    uint32_t b = __float_as_uint(z == 0.0f ? 0.0f : z);
    uint32_t ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u); /* ascending with z */
    return ((uint64_t)(~ord) << 32) | (uint32_t)id;
}

/* One row of sample_row per block: writes the sampled token id to out[blockIdx.x]. */
__global__ void sample_kernel(int32_t *out, const float *logits, int vocab, const sample_row *rows)
{
    __shared__ unsigned int hc[256];
    __shared__ double hm[256];
    __shared__ double red[SAMPLE_THREADS];
    __shared__ uint64_t s_prefix;
    __shared__ double s_acc;
    __shared__ float s_zmax;
    __shared__ int s_tok, s_last;
    const sample_row rp = rows[blockIdx.x];
    const float *lg = logits + (size_t)rp.row * vocab;
    const float temp = rp.temperature;
    const int tid = threadIdx.x;
#define ZOF(j) (temp > 0.0f ? lg[j] / temp : lg[j])

    /* 1. zmax (the best candidate is always kept) */
    float zm = -INFINITY;
    for (int j = tid; j < vocab; j += blockDim.x) {
        zm = fmaxf(zm, ZOF(j));
    }
    red[tid] = zm;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            red[tid] = fmax(red[tid], red[tid + s]);
        }
        __syncthreads();
    }
    if (tid == 0) {
        s_zmax = (float)red[0];
    }
    __syncthreads();
    const float zmax = s_zmax;
    /* 2. min_p keeps the candidates with expf(z - zmax) >= min_p: a prefix of the key order, so it
     * only lowers top_k (as kernels/cpu/sample.c) */
    int top_k = rp.top_k;
    if (rp.min_p > 0.0f) {
        double cnt = 0;
        for (int j = tid; j < vocab; j += blockDim.x) {
            cnt += expf(ZOF(j) - zmax) >= rp.min_p ? 1.0 : 0.0;
        }
        red[tid] = cnt;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (tid < s) {
                red[tid] += red[tid + s];
            }
            __syncthreads();
        }
        int c = (int)red[0];
        top_k = c < 1 ? 1 : (c < top_k ? c : top_k);
        __syncthreads();
    }
    /* 3. the top_k-th smallest key (every key is unique: the id is in it) */
    uint64_t kth = ~0ull;
    if (top_k < vocab) {
        uint64_t prefix = 0, mask = 0;
        unsigned int remaining = (unsigned int)top_k;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) {
                hc[b] = 0;
            }
            __syncthreads();
            for (int j = tid; j < vocab; j += blockDim.x) {
                uint64_t key = cand_key(ZOF(j), j);
                if ((key & mask) == prefix) {
                    atomicAdd(&hc[(key >> shift) & 255], 1u);
                }
            }
            __syncthreads();
            if (tid == 0) {
                int d = 255;
                for (int b = 0; b < 256; b++) {
                    if (remaining <= hc[b]) {
                        d = b;
                        break;
                    }
                    remaining -= hc[b];
                }
                s_prefix = prefix | ((uint64_t)d << shift);
            }
            __syncthreads();
            prefix = s_prefix;
            mask |= 0xffull << shift;
            __syncthreads();
        }
        kth = prefix;
    }
#define PROB(j, key, thr) ((key) <= (thr) ? (double)expf(ZOF(j) - zmax) : 0.0)
    /* 4. top-p: the largest kept key t whose mass before it is < top_p · sum */
    uint64_t thr = kth;
    if (rp.top_p < 1.0f) {
        double sum = 0;
        for (int j = tid; j < vocab; j += blockDim.x) {
            uint64_t key = cand_key(ZOF(j), j);
            sum += PROB(j, key, kth);
        }
        red[tid] = sum;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (tid < s) {
                red[tid] += red[tid + s];
            }
            __syncthreads();
        }
        const double P = (double)rp.top_p * red[0];
        uint64_t prefix = 0, mask = 0;
        if (tid == 0) {
            s_acc = 0; /* mass of keys below the current prefix range (always < P) */
        }
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) {
                hc[b] = 0;
                hm[b] = 0;
            }
            __syncthreads();
            for (int j = tid; j < vocab; j += blockDim.x) {
                uint64_t key = cand_key(ZOF(j), j);
                if (key <= kth && (key & mask) == prefix) {
                    atomicAdd(&hc[(key >> shift) & 255], 1u);
                    atomicAdd(&hm[(key >> shift) & 255], PROB(j, key, kth));
                }
            }
            __syncthreads();
            if (tid == 0) {
                double below = s_acc;
                int d = 0;
                for (int b = 0; b < 256; b++) {
                    if (hc[b] > 0 && below < P) {
                        d = b;
                        s_acc = below;
                    }
                    below += hm[b];
                }
                s_prefix = prefix | ((uint64_t)d << shift);
            }
            __syncthreads();
            prefix = s_prefix;
            mask |= 0xffull << shift;
            __syncthreads();
        }
        thr = prefix;
    }
    /* 4. draw: walk the kept tokens in ascending id order; each thread owns a contiguous id chunk */
    const int chunk = (vocab + (int)blockDim.x - 1) / (int)blockDim.x;
    const int j0 = tid * chunk, j1 = min(vocab, j0 + chunk);
    double mine = 0;
    int last = -1;
    for (int j = j0; j < j1; j++) {
        uint64_t key = cand_key(ZOF(j), j);
        double p = PROB(j, key, thr);
        mine += p;
        last = key <= thr ? j : last;
    }
    red[tid] = mine;
    if (tid == 0) {
        s_tok = 0x7fffffff;
        s_last = -1;
    }
    __syncthreads();
    if (last >= 0) {
        atomicMax(&s_last, last);
    }
    if (tid == 0) { /* exclusive scan of the chunk sums (serial: 1024 adds) */
        double acc = 0;
        for (int t = 0; t < (int)blockDim.x; t++) {
            double v = red[t];
            red[t] = acc;
            acc += v;
        }
        s_acc = acc * rp.u; /* target */
    }
    __syncthreads();
    const double target = s_acc;
    double cum = red[tid];
    if (cum <= target && cum + mine > target) {
        for (int j = j0; j < j1; j++) {
            uint64_t key = cand_key(ZOF(j), j);
            cum += PROB(j, key, thr);
            if (cum > target) {
                atomicMin(&s_tok, j);
                break;
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        out[blockIdx.x] = s_tok != 0x7fffffff ? s_tok : s_last; /* rounding past the end: last kept id */
    }
#undef PROB
#undef ZOF
}

/* ------------------------------------------------------------------ the table */

int blocks_for(size_t n, int threads)
{
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    return (int)(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

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

pd_status_t cu_embed(pd_backend_t *be, float *out, const float *table, const int32_t *ids, int n, int dim,
                     int vocab)
{
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab) {
            pd_log_error("cuda embed: token id %d outside [0, %d)", ids[i], vocab);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    if (n == 0) {
        return PD_OK;
    }
    upload u(be);
    const int32_t *d_ids = u.put(ids, (size_t)n);
    TRY(u.st);
    embed_kernel<<<n, 256, 0, S(be)->stream>>>(out, table, d_ids, dim);
    return check_launch("embed");
}

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

pd_status_t cu_add(pd_backend_t *be, float *y, const float *x, size_t n)
{
    if (n == 0) {
        return PD_OK;
    }
    add_kernel<<<blocks_for(n, 256), 256, 0, S(be)->stream>>>(y, x, n);
    return check_launch("add");
}

pd_status_t cu_rmsnorm(pd_backend_t *be, float *out, const float *x, const float *w, int rows, int dim,
                       float eps)
{
    if (rows == 0) {
        return PD_OK;
    }
    rmsnorm_kernel<<<rows, 256, 0, S(be)->stream>>>(out, x, w, dim, eps);
    return check_launch("rmsnorm");
}

pd_status_t cu_layernorm(pd_backend_t *be, float *out, const float *x, const float *w, const float *b,
                         int rows, int dim, float eps)
{
    if (rows == 0) {
        return PD_OK;
    }
    layernorm_kernel<<<rows, 256, 0, S(be)->stream>>>(out, x, w, b, dim, eps);
    return check_launch("layernorm");
}

pd_status_t cu_rope(pd_backend_t *be, float *x, const int32_t *positions, int num_tokens, int num_heads,
                    int head_size, const pd_rope_t *rope)
{
    if (rope == NULL || head_size % 2 != 0 || rope->half != head_size / 2) {
        pd_log_error("rope: the rotary table does not fit head size %d", head_size);
        return PD_ERR_INVALID_ARG;
    }
    if (num_tokens == 0) {
        return PD_OK;
    }
    upload u(be);
    const int32_t *d_pos = u.put(positions, (size_t)num_tokens);
    const pd_rope_t *d_rope = u.put(rope, 1);
    TRY(u.st);
    size_t total = (size_t)num_tokens * num_heads * (head_size / 2);
    rope_kernel<<<(int)((total + 255) / 256), 256, 0, S(be)->stream>>>(x, d_pos, num_tokens, num_heads,
                                                                       head_size, d_rope);
    return check_launch("rope");
}

pd_status_t cu_gelu(pd_backend_t *be, float *x, size_t n)
{
    if (n == 0) {
        return PD_OK;
    }
    gelu_kernel<<<blocks_for(n, 256), 256, 0, S(be)->stream>>>(x, n);
    return check_launch("gelu");
}

pd_status_t cu_silu_mul(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter)
{
    if (rows == 0) {
        return PD_OK;
    }
    silu_mul_kernel<<<rows, 256, 0, S(be)->stream>>>(out, gate_up, inter);
    return check_launch("silu_mul");
}

pd_status_t cu_gelu_mul(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter)
{
    if (rows == 0) {
        return PD_OK;
    }
    gelu_mul_kernel<<<rows, 256, 0, S(be)->stream>>>(out, gate_up, inter);
    return check_launch("gelu_mul");
}

pd_status_t cu_softmax(pd_backend_t *be, float *x, int rows, int cols)
{
    if (rows == 0) {
        return PD_OK;
    }
    softmax_kernel<<<rows, 256, 0, S(be)->stream>>>(x, cols);
    return check_launch("softmax");
}

pd_status_t cu_reshape_and_cache(pd_backend_t *be, const pd_kv_view_t *kv, const float *k, const float *v,
                                 const int32_t *slots, int num_tokens)
{
    int64_t cap = (int64_t)kv->num_blocks * kv->block_size;
    for (int t = 0; t < num_tokens; t++) {
        if (slots[t] >= cap) {
            pd_log_error("cuda reshape_and_cache: slot %d beyond the cache's %lld slots", slots[t],
                         (long long)cap);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    if (num_tokens == 0) {
        return PD_OK;
    }
    upload u(be);
    const int32_t *d_slots = u.put(slots, (size_t)num_tokens);
    TRY(u.st);
    reshape_and_cache_kernel<<<num_tokens, 128, 0, S(be)->stream>>>(*kv, k, v, d_slots);
    return check_launch("reshape_and_cache");
}

/* Device copy of the attention metadata (pointers replaced). */
pd_status_t upload_meta(pd_backend_t *be, upload &u, const pd_attn_meta_t *meta, pd_attn_meta_t *d)
{
    *d = *meta;
    d->cu_seqlens_q = u.put(meta->cu_seqlens_q, (size_t)meta->num_seqs + 1);
    d->seq_lens = u.put(meta->seq_lens, (size_t)meta->num_seqs);
    d->block_tables = u.put(meta->block_tables, (size_t)meta->num_seqs * meta->max_blocks_per_seq);
    d->slot_mapping = nullptr;
    (void)be;
    return u.st;
}

pd_status_t attn_checks(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads, int decode)
{
    if (kv->head_size > MAX_HEAD) {
        pd_log_error("cuda attention: head size %d above %d", kv->head_size, MAX_HEAD);
        return PD_ERR_UNSUPPORTED;
    }
    return pd_cpu_attn_validate(kv, meta, num_heads, decode); /* the CPU's checks, on the host metadata */
}

pd_status_t cu_attn_prefill(pd_backend_t *be, float *out, const float *q, const pd_kv_view_t *kv,
                            const pd_attn_meta_t *meta, int num_heads, float scale)
{
    TRY(attn_checks(kv, meta, num_heads, 0));
    if (meta->num_tokens == 0) {
        return PD_OK;
    }
    upload u(be);
    pd_attn_meta_t d;
    TRY(upload_meta(be, u, meta, &d));
    dim3 grid((unsigned)meta->num_tokens, (unsigned)num_heads);
    attn_prefill_kernel<<<grid, ATTN_THREADS, 0, S(be)->stream>>>(out, q, *kv, d, num_heads, scale);
    return check_launch("paged_attention_prefill");
}

/* Decode attention's workspace of at least bytes, reserved once and grown (never per call: a
 * cudaMalloc + sync + cudaFree on every layer of every step stalled the stream). Growing frees the
 * old one with cudaFree, which waits for the kernels still using it. */
pd_status_t attn_workspace(pd_backend_t *be, size_t bytes, float **out)
{
    cuda_state *s = S(be);
    if (bytes > s->attn_ws_cap) {
        size_t cap = bytes > (size_t)4 << 20 ? bytes + bytes / 2 : (size_t)4 << 20;
        void *p = nullptr;
        TRY(cu_alloc(be, cap, &p));
        cu_free(be, s->attn_ws);
        s->attn_ws = p;
        s->attn_ws_cap = cap;
    }
    *out = static_cast<float *>(s->attn_ws);
    return PD_OK;
}

pd_status_t cu_attn_decode(pd_backend_t *be, float *out, const float *q, const pd_kv_view_t *kv,
                           const pd_attn_meta_t *meta, int num_heads, float scale)
{
    TRY(attn_checks(kv, meta, num_heads, 1));
    if (meta->num_seqs == 0) {
        return PD_OK;
    }
    int max_len = 1;
    for (int s = 0; s < meta->num_seqs; s++) {
        max_len = meta->seq_lens[s] > max_len ? meta->seq_lens[s] : max_len;
    }
    int parts = (max_len + PARTITION - 1) / PARTITION;
    size_t rows = (size_t)meta->num_seqs * num_heads * parts;
    float *t_out = nullptr;
    TRY(attn_workspace(be, rows * ((size_t)kv->head_size + 2) * sizeof(float), &t_out));
    float *t_max = t_out + rows * kv->head_size, *t_sum = t_max + rows;
    upload u(be);
    pd_attn_meta_t d;
    pd_status_t st = upload_meta(be, u, meta, &d);
    if (st == PD_OK) {
        dim3 grid((unsigned)meta->num_seqs, (unsigned)num_heads, (unsigned)parts);
        attn_decode_partial_kernel<<<grid, ATTN_THREADS, 0, S(be)->stream>>>(t_out, t_max, t_sum, q, *kv, d,
                                                                             num_heads, scale, parts);
        st = check_launch("paged_attention_decode");
    }
    if (st == PD_OK) {
        dim3 g2((unsigned)meta->num_seqs, (unsigned)num_heads);
        attn_reduce_kernel<<<g2, 128, 0, S(be)->stream>>>(out, t_out, t_max, t_sum, d.cu_seqlens_q, num_heads,
                                                          kv->head_size, parts);
        st = check_launch("paged_attention_decode reduce");
    }
    return st; /* the workspace is reused by the next call, after these kernels (stream order) */
}

pd_status_t cu_sample(pd_backend_t *be, int32_t *tokens, float *logits, int n, int vocab,
                      const pd_sampling_params_t *params, pd_rng_t *rngs)
{
    cudaPointerAttributes a;
    bool device = cudaPointerGetAttributes(&a, logits) == cudaSuccess && a.type == cudaMemoryTypeDevice;
    cudaGetLastError();
    if (!device) {
        return pd_cpu_sample(be, tokens, logits, n, vocab, params, rngs); /* host logits: the CPU's sampler */
    }
    bool greedy = true;
    for (int i = 0; i < n; i++) {
        const pd_sampling_params_t *p = &params[i];
        if (!(p->temperature >= 0) || !(p->top_p > 0) || isnan(p->top_p) || isnan(p->min_p) || p->min_p > 1) {
            pd_log_error("sample: row %d has invalid parameters (temperature %g, top_p %g, min_p %g)", i,
                         p->temperature, p->top_p, p->min_p);
            return PD_ERR_INVALID_ARG;
        }
        greedy = greedy && p->temperature < 1e-5f;
    }
    int32_t *d_tok = nullptr;
    TRY(cu_alloc(be, (size_t)n * sizeof(int32_t), reinterpret_cast<void **>(&d_tok)));
    pd_status_t st = PD_OK;
    if (greedy) {
        argmax_kernel<<<n, 1024, 0, S(be)->stream>>>(d_tok, logits, vocab);
        st = check_launch("argmax");
    } else {
        /* the draws happen here, in row order, one per non-greedy row (as the CPU sampler) */
        std::vector<sample_row> rows((size_t)n);
        for (int i = 0; i < n; i++) {
            const pd_sampling_params_t *p = &params[i];
            bool g = p->temperature < 1e-5f;
            int k = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
            rows[(size_t)i] = sample_row{i,
                                         g ? 1 : k,
                                         g ? 0.0f : p->temperature,
                                         g ? 1.0f : p->top_p,
                                         g ? 0.0f : p->min_p,
                                         g ? 0.0 : pd_rng_uniform(&rngs[i])};
        }
        sample_row *d_rows = nullptr;
        st = cu_alloc(be, (size_t)n * sizeof(sample_row), reinterpret_cast<void **>(&d_rows));
        if (st == PD_OK) {
            st = cu_copy(be, d_rows, rows.data(), (size_t)n * sizeof(sample_row), PD_COPY_H2D);
        }
        if (st == PD_OK) {
            sample_kernel<<<n, SAMPLE_THREADS, 0, S(be)->stream>>>(d_tok, logits, vocab, d_rows);
            st = check_launch("sample");
        }
        cu_free(be, d_rows);
    }
    if (st == PD_OK) {
        st = cu_copy(be, tokens, d_tok, (size_t)n * sizeof(int32_t), PD_COPY_D2H);
    }
    cu_free(be, d_tok);
    return st;
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

} /* namespace */

extern "C" {

const pd_backend_ops_t pd_cuda_backend_ops = {
    "cuda",          cu_alloc,       cu_free,     cu_copy,
    cu_sync,         cu_embed,       cu_matmul,   cu_add,
    cu_rmsnorm,      cu_layernorm,   cu_rope,     cu_gelu,
    cu_silu_mul,     cu_gelu_mul,    cu_softmax,  cu_reshape_and_cache,
    cu_attn_prefill, cu_attn_decode, cu_sample,   cu_gather,
    cu_scatter,      cu_copy_pages,  cu_pin_host, cu_unpin_host,
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
    be->ops = &pd_cuda_backend_ops;
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) == cudaSuccess) {
        pd_log_info("cuda backend: device %d %s, %.1f GiB, sm_%d%d", device, p.name,
                    (double)p.totalGlobalMem / (1u << 30), p.major, p.minor);
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
    cudaFree(s->scratch);
    cudaStreamDestroy(s->stream);
    delete s;
    be->impl = nullptr;
}

} /* extern "C" */
