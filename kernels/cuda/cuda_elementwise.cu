/* kernels/cuda/cuda_elementwise.cu — embedding, residual add, RMSNorm / LayerNorm, RoPE, GELU /
 * SiLU-mul / GELU-mul, softmax, and the KV cache write (reshape_and_cache): a kernel each. */
#include "kernels/cuda/cuda_internal.cuh"

namespace pd_cuda
{
namespace
{

/* ------------------------------------------------------------------ elementwise kernels */

/* out[n][dim] = table[ids[i]][dim] */
__global__ void embed_kernel(float *out, pd_weight_t table, float scale, const int32_t *ids, int dim)
{
    int64_t row = (int64_t)ids[blockIdx.x] * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        out[(size_t)blockIdx.x * dim + d] = pd_dtype_load(table.data, row + d, table.dtype) * scale;
    }
}

__global__ void add_kernel(float *y, const float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        y[i] += x[i];
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

} /* namespace */

pd_status_t cu_embed(pd_backend_t *be, float *out, pd_weight_t table, float scale, const int32_t *ids, int n,
                     int dim, int vocab)
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
    embed_kernel<<<n, 256, 0, S(be)->stream>>>(out, table, scale, d_ids, dim);
    return check_launch("embed");
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

} /* namespace pd_cuda */
