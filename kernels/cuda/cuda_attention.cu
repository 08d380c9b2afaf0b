/* kernels/cuda/cuda_attention.cu — paged attention: prefill (tiled varlen) and decode (split-K
 * partitions merged by log-sum-exp), with the host-side checks the CPU backend makes. */
#include "kernels/cuda/cuda_internal.cuh"

namespace pd_cuda
{
namespace
{

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

} /* namespace */

/* Device copy of the attention metadata (pointers replaced). */
static pd_status_t upload_meta(pd_backend_t *be, upload &u, const pd_attn_meta_t *meta, pd_attn_meta_t *d)
{
    *d = *meta;
    d->cu_seqlens_q = u.put(meta->cu_seqlens_q, (size_t)meta->num_seqs + 1);
    d->seq_lens = u.put(meta->seq_lens, (size_t)meta->num_seqs);
    d->block_tables = u.put(meta->block_tables, (size_t)meta->num_seqs * meta->max_blocks_per_seq);
    d->slot_mapping = nullptr;
    (void)be;
    return u.st;
}

static pd_status_t attn_checks(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads, int decode)
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
    void *ws = nullptr;
    TRY(cu_workspace(be, &S(be)->attn_ws, &S(be)->attn_ws_cap,
                     rows * ((size_t)kv->head_size + 2) * sizeof(float), &ws));
    float *t_out = static_cast<float *>(ws);
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

} /* namespace pd_cuda */
