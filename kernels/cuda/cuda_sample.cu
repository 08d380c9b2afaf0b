/* kernels/cuda/cuda_sample.cu — tokens from device logits: greedy argmax, and sampling with the CPU
 * sampler's semantics and draws (temperature, top-k, top-p, min-p). */
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/sample.h"

namespace pd_cuda
{
namespace
{

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

} /* namespace */

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
        greedy = greedy && p->temperature < PD_SAMPLING_EPS;
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
            bool g = p->temperature < PD_SAMPLING_EPS;
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

} /* namespace pd_cuda */
