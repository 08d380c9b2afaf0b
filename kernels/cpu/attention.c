/* kernels/cpu/attention.c — writing new K/V into the paged cache and paged attention over it.
 * Layout and index math: kernels/paged_impl.h (shared with the CUDA kernels). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_decode.h"
#include "kernels/cpu/attention_prefill_tiled.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/simd.h"
#include "kernels/paged_impl.h"

/* ---------------------------------------------------------------- reshape_and_cache */

static pd_status_t cache_check(const pd_kv_view_t *kv, const int32_t *slot_mapping, int num_tokens)
{
    int64_t num_slots = (int64_t)kv->num_blocks * kv->block_size;
    for (int t = 0; t < num_tokens; t++) {
        if (slot_mapping[t] >= num_slots) {
            pd_log_error("reshape_and_cache: slot %d of token %d is outside the cache (%lld slots)",
                         slot_mapping[t], t, (long long)num_slots);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    return PD_OK;
}

pd_status_t pd_cpu_reshape_and_cache_ref(pd_backend_t *be, const pd_kv_view_t *kv, const float *k,
                                         const float *v, const int32_t *slot_mapping, int num_tokens)
{
    pd_status_t st = cache_check(kv, slot_mapping, num_tokens);
    if (st != PD_OK) {
        return st;
    }
    int H = kv->num_kv_heads, D = kv->head_size;
    for (int t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) {
            continue;
        }
        for (int h = 0; h < H; h++) {
            int64_t ki = pd_slot_kv_index(slot, 0, h, kv->block_size, H, D);
            int64_t vi = pd_slot_kv_index(slot, 1, h, kv->block_size, H, D);
            for (int d = 0; d < D; d++) {
                pd_dtype_store(kv->base, ki + d, kv->dtype, k[((size_t)t * H + h) * D + d]);
                pd_dtype_store(kv->base, vi + d, kv->dtype, v[((size_t)t * H + h) * D + d]);
            }
        }
    }
    return PD_OK;
}

/* Stores n floats as dtype (same rounding as pd_dtype_store, vectorized). */
PD_CPU_BODY void store_row_body(void *dst, const float *src, int n, pd_dtype_t dt)
{
    if (dt == PD_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dt == PD_DTYPE_BF16) {
        /* pd_f32_to_bf16 without its early return, which kept GCC from vectorizing the loop (a scalar
         * loop here was 13 µs a layer, 2 % of a batch-32 decode step of the demo model) */
        uint16_t *d = dst;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, src + i, sizeof(u));
            uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
            d[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
        }
    } else { /* NaNs made pd_f32_to_f16's one quiet NaN: the conversion instruction keeps payloads */
        uint16_t *d = dst;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            _Float16 h = (_Float16)src[i];
            uint16_t hb;
            uint32_t u;
            memcpy(&hb, &h, sizeof(hb));
            memcpy(&u, src + i, sizeof(u));
            d[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)(((u >> 16) & 0x8000u) | 0x7e00u) : hb;
        }
    }
}
PD_CPU_VARIANTS_VOID(store_row, (void *dst, const float *src, int n, pd_dtype_t dt), (dst, src, n, dt))

pd_status_t pd_cpu_reshape_and_cache(pd_backend_t *be, const pd_kv_view_t *kv, const float *k, const float *v,
                                     const int32_t *slot_mapping, int num_tokens)
{
    pd_status_t st = cache_check(kv, slot_mapping, num_tokens);
    if (st != PD_OK) {
        return st;
    }
    int H = kv->num_kv_heads, D = kv->head_size, es = pd_dtype_size(kv->dtype);
    /* a token's heads are contiguous in both the input and the cache row: one row of H·D. Two
     * threads from 9 tokens: a decode batch writes a row into each of its sequences' own pages,
     * cold lines (batch 32 of the demo model: 7 µs a layer on one thread, 5-6 on two). */
#pragma omp parallel for num_threads(be->num_threads) schedule(static) if (num_tokens > 8)
    for (int t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) {
            continue;
        }
        int64_t ki = pd_slot_kv_index(slot, 0, 0, kv->block_size, H, D);
        int64_t vi = pd_slot_kv_index(slot, 1, 0, kv->block_size, H, D);
        store_row((char *)kv->base + ki * es, k + (size_t)t * H * D, H * D, kv->dtype);
        store_row((char *)kv->base + vi * es, v + (size_t)t * H * D, H * D, kv->dtype);
    }
    return PD_OK;
}

/* ---------------------------------------------------------------- validation */

pd_status_t pd_cpu_attn_validate(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                 int decode_only)
{
    if (kv->num_kv_heads <= 0 || num_heads % kv->num_kv_heads != 0) {
        pd_log_error("attention: %d query heads are not a multiple of %d kv heads", num_heads,
                     kv->num_kv_heads);
        return PD_ERR_INVALID_ARG;
    }
    if (meta->cu_seqlens_q[0] != 0 || meta->cu_seqlens_q[meta->num_seqs] != meta->num_tokens) {
        pd_log_error("attention: cu_seqlens_q must run from 0 to num_tokens (%d)", meta->num_tokens);
        return PD_ERR_INVALID_ARG;
    }
    for (int s = 0; s < meta->num_seqs; s++) {
        int q_len = meta->cu_seqlens_q[s + 1] - meta->cu_seqlens_q[s];
        int64_t seq_len = meta->seq_lens[s];
        if (q_len < 0 || seq_len < q_len || (decode_only && q_len != 1)) {
            pd_log_error("attention: sequence %d has %d new tokens and context length %lld", s, q_len,
                         (long long)seq_len);
            return PD_ERR_INVALID_ARG;
        }
        int64_t nblk = pd_blocks_for_tokens(seq_len, kv->block_size);
        if (nblk > meta->max_blocks_per_seq) {
            pd_log_error("attention: sequence %d needs %lld blocks, the block table holds %d", s,
                         (long long)nblk, meta->max_blocks_per_seq);
            return PD_ERR_OUT_OF_RANGE;
        }
        int64_t first =
            q_len > 0 ? pd_attn_first_key(pd_query_pos(seq_len, q_len, 0), meta->sliding_window) : 0;
        for (int64_t b = first / kv->block_size; b < nblk; b++) {
            int32_t id = meta->block_tables[(int64_t)s * meta->max_blocks_per_seq + b];
            if (id < 0 || id >= kv->num_blocks) {
                pd_log_error("attention: sequence %d block %lld has id %d, outside [0, %d)", s, (long long)b,
                             id, kv->num_blocks);
                return PD_ERR_OUT_OF_RANGE;
            }
        }
    }
    return PD_OK;
}

/* ---------------------------------------------------------------- reference attention */

/* Both attention maths, plainly: one query row at a time, double sums. fp32: s = q·k·scale,
 * p = e^(s − max s); bf16 (attention_bf16.h): s = q̂·k, p = bf16(2^(s − ⌈max s⌉)) with libm's exp2.
 * o = Σ p·v / Σ p. */
static pd_status_t attention_ref(float *out, const float *q, const pd_kv_view_t *kv,
                                 const pd_attn_meta_t *meta, int num_heads, float scale, bool bf16)
{
    pd_status_t st = pd_cpu_attn_validate(kv, meta, num_heads, 0);
    if (st != PD_OK) {
        return st;
    }
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size;
    int64_t max_len = 1;
    for (int s = 0; s < meta->num_seqs; s++) {
        max_len = meta->seq_lens[s] > max_len ? meta->seq_lens[s] : max_len;
    }
    float *scores = malloc((size_t)max_len * sizeof(float)), *qh = malloc((size_t)D * sizeof(float));
    double *p = malloc((size_t)max_len * sizeof(double));
    if (scores == NULL || qh == NULL || p == NULL) {
        free(scores), free(qh), free(p);
        return PD_ERR_NO_MEMORY;
    }
    for (int s = 0; s < meta->num_seqs; s++) {
        int q0 = meta->cu_seqlens_q[s], q_len = meta->cu_seqlens_q[s + 1] - q0;
        for (int i = 0; i < q_len; i++) {
            int64_t pos = pd_query_pos(meta->seq_lens[s], q_len, i);
            int64_t first = pd_attn_first_key(pos, meta->sliding_window);
            for (int h = 0; h < num_heads; h++) {
                int g = pd_gqa_kv_head(h, num_heads, H);
                const float *qv = q + ((size_t)(q0 + i) * num_heads + h) * D;
                if (bf16) {
                    pd_attn_bf16_query(qh, qv, scale, D); /* q̂ carries the scale */
                    qv = qh;
                }
                float m = -INFINITY;
                for (int64_t j = first; j <= pos; j++) {
                    int64_t slot =
                        pd_block_table_slot(meta->block_tables, meta->max_blocks_per_seq, s, j, bs);
                    int64_t ki = pd_slot_kv_index(slot, 0, g, bs, H, D);
                    double dot = 0;
                    for (int d = 0; d < D; d++) {
                        dot += (double)qv[d] * pd_dtype_load(kv->base, ki + d, kv->dtype);
                    }
                    scores[j] = (float)(bf16 ? dot : dot * scale);
                    m = bf16 ? pd_attn_bf16_max(m, scores[j]) : (scores[j] > m ? scores[j] : m);
                }
                double sum = 0;
                for (int64_t j = first; j <= pos; j++) {
                    p[j] = bf16 ? pd_round_bf16f((float)exp2((double)scores[j] - m))
                                : exp((double)scores[j] - m);
                    sum += p[j];
                }
                float *o = out + ((size_t)(q0 + i) * num_heads + h) * D;
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t j = first; j <= pos; j++) {
                        int64_t slot =
                            pd_block_table_slot(meta->block_tables, meta->max_blocks_per_seq, s, j, bs);
                        int64_t vi = pd_slot_kv_index(slot, 1, g, bs, H, D);
                        acc += p[j] * pd_dtype_load(kv->base, vi + d, kv->dtype);
                    }
                    o[d] = (float)(acc / sum);
                }
            }
        }
    }
    free(scores), free(qh), free(p);
    return PD_OK;
}

pd_status_t pd_cpu_paged_attention_prefill_ref(pd_backend_t *be, float *out, const float *q,
                                               const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                                               int num_heads, float scale)
{
    (void)be;
    return attention_ref(out, q, kv, meta, num_heads, scale, false);
}

pd_status_t pd_cpu_paged_attention_bf16_ref(pd_backend_t *be, float *out, const float *q,
                                            const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                            float scale)
{
    (void)be;
    if (kv->dtype != PD_DTYPE_BF16) {
        pd_log_error("attention: the bf16 reference needs a bf16 cache (dtype %d)", (int)kv->dtype);
        return PD_ERR_INVALID_ARG;
    }
    return attention_ref(out, q, kv, meta, num_heads, scale, true);
}

pd_status_t pd_cpu_paged_attention_decode_ref(pd_backend_t *be, float *out, const float *q,
                                              const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                                              int num_heads, float scale)
{
    pd_status_t st = pd_cpu_attn_validate(kv, meta, num_heads, 1);
    if (st != PD_OK) {
        return st;
    }
    return pd_cpu_paged_attention_prefill_ref(be, out, q, kv, meta, num_heads, scale);
}

/* ---------------------------------------------------------------- optimized attention
 *
 * Work item = (sequence, kv head, tile of up to ATTN_TILE_Q query tokens). The item walks the
 * blocks its queries can see once, converts each block's K and V rows for its kv head to fp32
 * in thread-local scratch, and updates an online softmax for every (query token, query head of
 * the GQA group) pair: per block, scores → block max → rescale accumulator once → p·V. */

#define ATTN_TILE_Q 8

typedef struct attn_item {
    int seq;
    int kv_head;
    int q_begin; /* index of the first query token within its sequence */
    int q_end;
    int tiled; /* the GEMM-tiled item (attention_prefill_tiled.c) */
} attn_item_t;

typedef struct attn_scratch {
    float *qh;  /* [ATTN_TILE_Q · group][head_size]: q̂ under bf16 math */
    float *k;   /* [block_size][head_size] */
    float *v;   /* [block_size][head_size] */
    float *s;   /* [block_size] */
    float *acc; /* [ATTN_TILE_Q · group][head_size] */
    float *m;   /* [ATTN_TILE_Q · group] */
    float *l;   /* [ATTN_TILE_Q · group] */
} attn_scratch_t;

/* The per-key item; bf16 (a constant at each call) selects bf16 attention math (attention_bf16.h):
 * q̂ prepared once per item, log2-domain scores, an integer running max, p̂ rounded to bf16. */
static inline __attribute__((always_inline)) void attn_item_body(const attn_item_t *it, float *out,
                                                                 const float *q, const pd_kv_view_t *kv,
                                                                 const pd_attn_meta_t *meta, int num_heads,
                                                                 float scale, const attn_scratch_t *sc,
                                                                 const int bf16)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size;
    const int group = num_heads / H;
    const int s = it->seq;
    const int q0 = meta->cu_seqlens_q[s];
    const int q_len = meta->cu_seqlens_q[s + 1] - q0;
    const int64_t seq_len = meta->seq_lens[s];
    const int nq = (it->q_end - it->q_begin) * group;
    const int es = pd_dtype_size(kv->dtype);

    for (int i = 0; i < nq; i++) {
        sc->m[i] = -INFINITY;
        sc->l[i] = 0;
        memset(sc->acc + (size_t)i * D, 0, (size_t)D * sizeof(float));
        if (bf16) {
            int t = it->q_begin + i / group, h = it->kv_head * group + i % group;
            pd_attn_bf16_query(sc->qh + (size_t)i * D, q + ((size_t)(q0 + t) * num_heads + h) * D, scale, D);
        }
    }
    const float s_scale = bf16 ? 1.0f : scale; /* q̂ carries the scale */
    int64_t pos_lo = pd_query_pos(seq_len, q_len, it->q_begin);
    int64_t pos_hi = pd_query_pos(seq_len, q_len, it->q_end - 1);
    int64_t key_lo = pd_attn_first_key(pos_lo, meta->sliding_window);

    for (int64_t b = key_lo / bs; b <= pos_hi / bs; b++) {
        int64_t block = pd_block_table_lookup(meta->block_tables, meta->max_blocks_per_seq, s, b * bs, bs);
        int64_t j0 = b * bs;
        int64_t j_end = j0 + bs - 1 < pos_hi ? j0 + bs - 1 : pos_hi; /* last key of this block in use */
        int nk = (int)(j_end - j0 + 1);
        for (int j = 0; j < nk; j++) {
            int64_t ki = pd_kv_index(block, 0, j, it->kv_head, bs, H, D);
            int64_t vi = pd_kv_index(block, 1, j, it->kv_head, bs, H, D);
            pd_cpu_widen(sc->k + (size_t)j * D, (const char *)kv->base + ki * es, kv->dtype, D);
            pd_cpu_widen(sc->v + (size_t)j * D, (const char *)kv->base + vi * es, kv->dtype, D);
        }
        for (int t = it->q_begin; t < it->q_end; t++) {
            int64_t pos = pd_query_pos(seq_len, q_len, t);
            int64_t first = pd_attn_first_key(pos, meta->sliding_window);
            int lo = first > j0 ? (int)(first - j0) : 0;
            int hi = pos < j_end ? (int)(pos - j0) : nk - 1; /* inclusive */
            if (hi < lo) {
                continue;
            }
            for (int r = 0; r < group; r++) {
                int h = it->kv_head * group + r;
                int qi = (t - it->q_begin) * group + r;
                const float *qv = bf16 ? sc->qh + (size_t)qi * D : q + ((size_t)(q0 + t) * num_heads + h) * D;
                float mb = -INFINITY;
                for (int j = lo; j <= hi; j++) {
                    const float *kr = sc->k + (size_t)j * D;
                    float dot = 0;
#pragma omp simd reduction(+ : dot)
                    for (int d = 0; d < D; d++) {
                        dot += qv[d] * kr[d];
                    }
                    sc->s[j] = dot * s_scale;
                    mb = sc->s[j] > mb ? sc->s[j] : mb;
                }
                float *acc = sc->acc + (size_t)qi * D;
                float m_new = bf16 ? pd_attn_bf16_max(sc->m[qi], mb) : (mb > sc->m[qi] ? mb : sc->m[qi]);
                if (m_new > sc->m[qi] && sc->l[qi] > 0) {
                    float alpha = bf16 ? pd_fast_exp2f(sc->m[qi] - m_new) : pd_fast_expf(sc->m[qi] - m_new);
                    sc->l[qi] *= alpha;
#pragma omp simd
                    for (int d = 0; d < D; d++) {
                        acc[d] *= alpha;
                    }
                }
                sc->m[qi] = m_new;
                float lsum = 0;
                for (int j = lo; j <= hi; j++) {
                    float p = bf16 ? pd_round_bf16f(pd_fast_exp2f(sc->s[j] - m_new))
                                   : pd_fast_expf(sc->s[j] - m_new);
                    lsum += p;
                    const float *vr = sc->v + (size_t)j * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) {
                        acc[d] += p * vr[d];
                    }
                }
                sc->l[qi] += lsum;
            }
        }
    }
    for (int t = it->q_begin; t < it->q_end; t++) {
        for (int r = 0; r < group; r++) {
            int h = it->kv_head * group + r;
            int qi = (t - it->q_begin) * group + r;
            float inv = sc->l[qi] > 0 ? 1.0f / sc->l[qi] : 0.0f;
            float *o = out + ((size_t)(q0 + t) * num_heads + h) * D;
            const float *acc = sc->acc + (size_t)qi * D;
            for (int d = 0; d < D; d++) {
                o[d] = acc[d] * inv;
            }
        }
    }
}

PD_CPU_BODY void attn_item_run_body(const attn_item_t *it, float *out, const float *q, const pd_kv_view_t *kv,
                                    const pd_attn_meta_t *meta, int num_heads, float scale,
                                    const attn_scratch_t *sc)
{
    attn_item_body(it, out, q, kv, meta, num_heads, scale, sc, 0);
}
PD_CPU_VARIANTS_VOID(attn_item_run,
                     (const attn_item_t *it, float *out, const float *q, const pd_kv_view_t *kv,
                      const pd_attn_meta_t *meta, int num_heads, float scale, const attn_scratch_t *sc),
                     (it, out, q, kv, meta, num_heads, scale, sc))

PD_CPU_BODY void attn_item_run_bf16_body(const attn_item_t *it, float *out, const float *q,
                                         const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                         float scale, const attn_scratch_t *sc)
{
    attn_item_body(it, out, q, kv, meta, num_heads, scale, sc, 1);
}
PD_CPU_VARIANTS_VOID(attn_item_run_bf16,
                     (const attn_item_t *it, float *out, const float *q, const pd_kv_view_t *kv,
                      const pd_attn_meta_t *meta, int num_heads, float scale, const attn_scratch_t *sc),
                     (it, out, q, kv, meta, num_heads, scale, sc))

static int g_allow_tiled = 1;

void pd_cpu_attn_allow_tiled(int allow)
{
    g_allow_tiled = allow;
}

static pd_status_t attn_run(pd_backend_t *be, float *out, const float *q, const pd_kv_view_t *kv,
                            const pd_attn_meta_t *meta, int num_heads, float scale)
{
    pd_status_t st = pd_cpu_attn_validate(kv, meta, num_heads, 0);
    if (st != PD_OK) {
        return st;
    }
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size;
    const int group = num_heads / H;
    const int bf16 = pd_cpu_attn_bf16_math(be, kv);
    size_t n_items = 0;
    bool any_tiled = false;
    for (int s = 0; s < meta->num_seqs; s++) {
        int q_len = meta->cu_seqlens_q[s + 1] - meta->cu_seqlens_q[s];
        bool tiled = g_allow_tiled && q_len >= ATTN_MM_MIN_Q;
        int tq = tiled ? ATTN_MM_TQ : ATTN_TILE_Q;
        any_tiled |= tiled;
        n_items += (size_t)((q_len + tq - 1) / tq) * H;
    }
    if (n_items == 0) {
        return PD_OK;
    }
    attn_item_t *items = malloc(n_items * sizeof(*items));
    if (items == NULL) {
        pd_log_error("attention: cannot allocate %zu work items", n_items);
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0;
    for (int s = 0; s < meta->num_seqs; s++) {
        int q_len = meta->cu_seqlens_q[s + 1] - meta->cu_seqlens_q[s];
        int tiled = g_allow_tiled && q_len >= ATTN_MM_MIN_Q, tq = tiled ? ATTN_MM_TQ : ATTN_TILE_Q;
        /* the longest tiles first (they see the most keys): dynamic scheduling then balances */
        for (int t = ((q_len - 1) / tq) * tq; t >= 0; t -= tq) {
            for (int g = 0; g < H; g++) {
                items[k++] = (attn_item_t){s, g, t, t + tq < q_len ? t + tq : q_len, tiled};
            }
        }
    }
    size_t per_thread = (size_t)bs * D * 2 + (size_t)bs + (size_t)ATTN_TILE_Q * group * (2 * D + 2);
    size_t tiled_floats = any_tiled ? pd_cpu_attn_tiled_scratch_floats(group, D) : 0;
    per_thread = tiled_floats > per_thread ? tiled_floats : per_thread;
    per_thread = (per_thread + 15) & ~(size_t)15; /* every thread's area on a 64-byte line */
    int nthreads = be->num_threads < (int)n_items ? be->num_threads : (int)n_items;
    float *scratch = aligned_alloc(64, (size_t)nthreads * per_thread * sizeof(float));
    if (scratch == NULL) {
        free(items);
        pd_log_error("attention: cannot allocate scratch for %d threads", nthreads);
        return PD_ERR_NO_MEMORY;
    }
    int failed = PD_OK; /* a tiled item's oneDNN status; written under the atomic below */
#pragma omp parallel num_threads(nthreads)
    {
        float *base = scratch + (size_t)omp_get_thread_num() * per_thread;
        attn_scratch_t sc;
        sc.qh = base;
        sc.k = sc.qh + (size_t)ATTN_TILE_Q * group * D;
        sc.v = sc.k + (size_t)bs * D;
        sc.s = sc.v + (size_t)bs * D;
        sc.acc = sc.s + bs;
        sc.m = sc.acc + (size_t)ATTN_TILE_Q * group * D;
        sc.l = sc.m + (size_t)ATTN_TILE_Q * group;
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_items; i++) {
            if (items[i].tiled) {
                pd_status_t ts =
                    pd_cpu_attn_tiled_run(out, q, kv, meta, num_heads, scale, bf16, items[i].seq,
                                          items[i].kv_head, items[i].q_begin, items[i].q_end, base);
                if (ts != PD_OK) {
                    __atomic_store_n(&failed, (int)ts, __ATOMIC_RELAXED);
                }
            } else if (bf16) {
                attn_item_run_bf16(&items[i], out, q, kv, meta, num_heads, scale, &sc);
            } else {
                attn_item_run(&items[i], out, q, kv, meta, num_heads, scale, &sc);
            }
        }
    }
    free(scratch);
    free(items);
    return (pd_status_t)failed;
}

static pd_status_t attn_prefill_as_decode(pd_backend_t *be, float *out, const float *q,
                                          const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                          float scale);

pd_status_t pd_cpu_paged_attention_prefill(pd_backend_t *be, float *out, const float *q,
                                           const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                           float scale)
{
    if (be->batch_invariant) {
        return attn_prefill_as_decode(be, out, q, kv, meta, num_heads, scale);
    }
    return attn_run(be, out, q, kv, meta, num_heads, scale);
}

/* ---------------------------------------------------------------- optimized decode (split-K) */

static int g_force_decode = -1;

void pd_cpu_attn_decode_force(int variant)
{
    g_force_decode = variant;
}

/* Portable twin of pd_cpu_attn_decode_x86_item (same work split and results), compiled with
 * runtime-dispatched clones; used where AVX2 is missing or the shape does not fit the vector
 * kernel (head size not a multiple of 8, very large heads or groups). */
static inline __attribute__((always_inline)) void decode_item_body(const pd_attn_decode_item_t *it,
                                                                   const float *q, const pd_kv_view_t *kv,
                                                                   const pd_attn_meta_t *meta, int num_heads,
                                                                   float scale, pd_attn_partial_t *part,
                                                                   float *scratch, const int bf16)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, group = num_heads / H;
    const int s = it->seq;
    const int64_t pos = meta->seq_lens[s] - 1;
    const int64_t first = pd_attn_first_key(pos, meta->sliding_window);
    const int row = H * D;
    const float *qs = q + (size_t)meta->cu_seqlens_q[s] * num_heads * D;
    float *kbuf = scratch, *vbuf = scratch + (size_t)bs * row, *sc = vbuf + (size_t)bs * row;
    float *qh_all = sc + bs + 8; /* [num_heads][D]: q̂ under bf16 math */
    for (int h = 0; h < num_heads && bf16; h++) {
        pd_attn_bf16_query(qh_all + (size_t)h * D, qs + (size_t)h * D, scale, D);
    }
    const float s_scale = bf16 ? 1.0f : scale;
    pd_attn_partial_reset(part, num_heads, D);
    for (int64_t b = it->block_begin; b < it->block_end; b++) {
        int lo, hi;
        if (!pd_attn_block_keys(b, bs, first, pos, &lo, &hi)) {
            continue;
        }
        const char *kpage = pd_attn_block_plane(kv, meta, s, b, 0),
                   *vpage = pd_attn_block_plane(kv, meta, s, b, 1);
        const float *kp, *vp;
        if (kv->dtype == PD_DTYPE_F32) {
            kp = (const float *)kpage;
            vp = (const float *)vpage;
        } else {
            pd_cpu_widen(kbuf, kpage, kv->dtype, (hi + 1) * row);
            pd_cpu_widen(vbuf, vpage, kv->dtype, (hi + 1) * row);
            kp = kbuf;
            vp = vbuf;
        }
        for (int h = 0; h < num_heads; h++) {
            int g = h / group;
            const float *qh = bf16 ? qh_all + (size_t)h * D : qs + (size_t)h * D;
            float mb = -INFINITY;
            for (int j = lo; j <= hi; j++) {
                const float *kr = kp + (size_t)j * row + (size_t)g * D;
                float dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) {
                    dot += qh[d] * kr[d];
                }
                sc[j] = dot * s_scale;
                mb = sc[j] > mb ? sc[j] : mb;
            }
            float *acc = part->acc + (size_t)h * D;
            float m_new = bf16 ? pd_attn_bf16_max(part->m[h], mb) : (mb > part->m[h] ? mb : part->m[h]);
            if (m_new > part->m[h] && part->l[h] > 0) {
                float alpha = bf16 ? pd_fast_exp2f(part->m[h] - m_new) : expf(part->m[h] - m_new);
                part->l[h] *= alpha;
                for (int d = 0; d < D; d++) {
                    acc[d] *= alpha;
                }
            }
            part->m[h] = m_new;
            for (int j = lo; j <= hi; j++) {
                float p = bf16 ? pd_round_bf16f(pd_fast_exp2f(sc[j] - m_new)) : pd_fast_expf(sc[j] - m_new);
                part->l[h] += p;
                const float *vr = vp + (size_t)j * row + (size_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) {
                    acc[d] += p * vr[d];
                }
            }
        }
    }
}

PD_CPU_BODY void attn_decode_item_portable_body(const pd_attn_decode_item_t *it, const float *q,
                                                const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                                                int num_heads, float scale, pd_attn_partial_t *part,
                                                float *scratch, int bf16)
{
    if (bf16) {
        decode_item_body(it, q, kv, meta, num_heads, scale, part, scratch, 1);
    } else {
        decode_item_body(it, q, kv, meta, num_heads, scale, part, scratch, 0);
    }
}
PD_CPU_VARIANTS_VOID(attn_decode_item_portable,
                     (const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                      const pd_attn_meta_t *meta, int num_heads, float scale, pd_attn_partial_t *part,
                      float *scratch, int bf16),
                     (it, q, kv, meta, num_heads, scale, part, scratch, bf16))

static bool serves_dot(const pd_kv_view_t *kv, int bf16, int group)
{
    return bf16 && kv->block_size <= PD_ATTN_MAX_BLOCK && pd_cpu_attn_decode_dot_usable(kv->head_size, group);
}

static bool serves_x512(const pd_kv_view_t *kv, int bf16, int group)
{
    return kv->block_size <= PD_ATTN_MAX_BLOCK && pd_cpu_attn_decode_x512_usable(kv->head_size, group);
}

static bool serves_avx2(const pd_kv_view_t *kv, int bf16, int group)
{
    return kv->block_size <= PD_ATTN_MAX_BLOCK && pd_cpu_attn_decode_x86_usable(kv->head_size, group);
}

static bool serves_any(const pd_kv_view_t *kv, int bf16, int group)
{
    return true;
}

static void run_dot(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                    const pd_attn_meta_t *meta, int num_heads, float scale, int bf16, pd_attn_partial_t *part,
                    float *scratch)
{
    pd_cpu_attn_decode_dot_item(it, q, kv, meta, num_heads, scale, part, scratch);
}

static void run_portable(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                         const pd_attn_meta_t *meta, int num_heads, float scale, int bf16,
                         pd_attn_partial_t *part, float *scratch)
{
    attn_decode_item_portable(it, q, kv, meta, num_heads, scale, part, scratch, bf16);
}

const pd_cpu_attn_decode_variant_t pd_cpu_attn_decode_variants[] = {
    {"dot", PD_ISA_AVX512_BF16, serves_dot, run_dot,
     "bf16 cache under bf16 attention math, heads a multiple of 32 wide: vdpbf16ps for both products"},
    {"x512", PD_ISA_AVX512, serves_x512, pd_cpu_attn_decode_x512_item,
     "any cache, heads a multiple of 16 wide: AVX-512, query heads of a group in register tiles of four"},
    {"avx2", PD_ISA_AVX2, serves_avx2, pd_cpu_attn_decode_x86_item,
     "any cache, heads a multiple of 8 wide: AVX2/FMA/F16C, pages read in place"},
    {"portable", PD_ISA_PORTABLE, serves_any, run_portable,
     "any cache: plain C (PD_CPU_VARIANTS: an AVX2 and a baseline build)"},
};
const int pd_cpu_num_attn_decode_variants =
    (int)(sizeof(pd_cpu_attn_decode_variants) / sizeof(pd_cpu_attn_decode_variants[0]));

const pd_cpu_attn_decode_variant_t *pd_cpu_attn_decode_choose(const pd_kv_view_t *kv, int bf16, int group)
{
    for (int i = 0; i < pd_cpu_num_attn_decode_variants; i++) {
        const pd_cpu_attn_decode_variant_t *v = &pd_cpu_attn_decode_variants[i];
        if (pd_cpu_isa_usable(v->isa) && v->serves(kv, bf16, group)) {
            return v;
        }
    }
    return &pd_cpu_attn_decode_variants[pd_cpu_num_attn_decode_variants - 1];
}

/* Splits each sequence's visible blocks into partitions so that there are about 4 items per
 * thread (at least 8 blocks per partition), runs them, and merges the partitions of each
 * sequence with log-sum-exp weights: out = Σ_p acc_p·e^(m_p−M) / Σ_p l_p·e^(m_p−M) (2^(m_p−M),
 * exact, under bf16 attention math). */
pd_status_t pd_cpu_paged_attention_decode(pd_backend_t *be, float *out, const float *q,
                                          const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                          float scale)
{
    pd_status_t st = pd_cpu_attn_validate(kv, meta, num_heads, 1);
    if (st != PD_OK) {
        return st;
    }
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, S = meta->num_seqs;
    if (S == 0) {
        return PD_OK;
    }
    const int bf16 = pd_cpu_attn_bf16_math(be, kv);
    const pd_cpu_attn_decode_variant_t *variant = g_force_decode >= 0
                                                      ? &pd_cpu_attn_decode_variants[g_force_decode]
                                                      : pd_cpu_attn_decode_choose(kv, bf16, num_heads / H);
    int64_t total_blocks = 0;
    for (int s = 0; s < S; s++) {
        int64_t pos = meta->seq_lens[s] - 1;
        total_blocks += pos / bs - pd_attn_first_key(pos, meta->sliding_window) / bs + 1;
    }
    int64_t want_items = 4 * (int64_t)be->num_threads;
    int64_t per_part = total_blocks / want_items;
    per_part = per_part < 8 ? 8 : per_part;
    if (be->batch_invariant) { /* partitions fixed by position, not by the batch's total */
        per_part = PD_ATTN_INV_PART_BLOCKS;
    }
    size_t n_items = 0;
    for (int s = 0; s < S; s++) {
        int64_t pos = meta->seq_lens[s] - 1;
        int64_t nb = pos / bs - pd_attn_first_key(pos, meta->sliding_window) / bs + 1;
        n_items += (size_t)((nb + per_part - 1) / per_part);
    }
    pd_attn_decode_item_t *items = malloc(n_items * sizeof(*items));
    int *first_item = malloc((size_t)(S + 1) * sizeof(int));
    size_t part_floats = (size_t)num_heads * (D + 2);
    size_t scratch_floats = (size_t)2 * bs * H * D + (size_t)bs + 8 + (size_t)num_heads * D;
    int nthreads = be->num_threads < (int)n_items ? be->num_threads : (int)n_items;
    float *parts = malloc(n_items * part_floats * sizeof(float));
    float *scratch = malloc((size_t)nthreads * scratch_floats * sizeof(float));
    if (items == NULL || first_item == NULL || parts == NULL || scratch == NULL) {
        free(items), free(first_item), free(parts), free(scratch);
        pd_log_error("attention: cannot allocate decode work space for %zu items", n_items);
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0;
    for (int s = 0; s < S; s++) {
        first_item[s] = (int)k;
        int64_t pos = meta->seq_lens[s] - 1;
        int64_t b0 = pd_attn_first_key(pos, meta->sliding_window) / bs, b1 = pos / bs + 1;
        for (int64_t b = b0; b < b1; b += per_part) {
            items[k++] = (pd_attn_decode_item_t){s, b, b + per_part < b1 ? b + per_part : b1};
        }
    }
    first_item[S] = (int)k;
#pragma omp parallel num_threads(nthreads)
    {
        float *my_scratch = scratch + (size_t)omp_get_thread_num() * scratch_floats;
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_items; i++) {
            float *p = parts + i * part_floats;
            pd_attn_partial_t part = {p, p + num_heads, p + 2 * num_heads};
            /* the item this thread most likely takes next (dynamic, 1 hands them out in turn):
             * its first pages towards L2 while this one computes */
            if (i + (size_t)nthreads < n_items) {
                pd_attn_prefetch_first_pages(&items[i + nthreads], kv, meta, 2, false);
            }
            variant->run(&items[i], q, kv, meta, num_heads, scale, bf16, &part, my_scratch);
        }
#pragma omp for schedule(static)
        for (int sh = 0; sh < S * num_heads; sh++) {
            int s = sh / num_heads, h = sh % num_heads;
            if (first_item[s + 1] - first_item[s] == 1) {
                /* one partition (a short context): its weight is exactly 1, so this is the loop
                 * below without the exp and the second pass, bit for bit (0 + acc as it adds) */
                const float *p = parts + (size_t)first_item[s] * part_floats;
                float l = p[num_heads + h], inv = l > 0 ? 1.0f / l : 0.0f;
                const float *acc = p + 2 * num_heads + (size_t)h * D;
                float *o = out + ((size_t)meta->cu_seqlens_q[s] * num_heads + h) * D;
                for (int d = 0; d < D; d++) {
                    o[d] = (0.0f + acc[d]) * inv;
                }
                continue;
            }
            float M = -INFINITY;
            for (int i = first_item[s]; i < first_item[s + 1]; i++) {
                float m = parts[(size_t)i * part_floats + h];
                M = m > M ? m : M;
            }
            float L = 0;
            float *o = out + ((size_t)meta->cu_seqlens_q[s] * num_heads + h) * D;
            memset(o, 0, (size_t)D * sizeof(float));
            for (int i = first_item[s]; i < first_item[s + 1]; i++) {
                const float *p = parts + (size_t)i * part_floats;
                if (p[num_heads + h] == 0) {
                    continue; /* a partition with no visible key */
                }
                float w = bf16 ? exp2f(p[h] - M) : expf(p[h] - M);
                L += p[num_heads + h] * w;
                const float *acc = p + 2 * num_heads + (size_t)h * D;
                for (int d = 0; d < D; d++) {
                    o[d] += acc[d] * w;
                }
            }
            float inv = L > 0 ? 1.0f / L : 0.0f;
            for (int d = 0; d < D; d++) {
                o[d] *= inv;
            }
        }
    }
    free(items), free(first_item), free(parts), free(scratch);
    return PD_OK;
}

/* --batch-invariant: every query of a prefill chunk is attended as a decode step attends a sequence's
 * one new token at that position (each query a sequence of its own, its context its position + 1,
 * its sequence's block table): the same items of PD_ATTN_INV_PART_BLOCKS blocks, the same kernel and
 * merge, so a token's attention has the same bits in a prefill chunk of any size and split, in a
 * decode step, or beside any other sequences (vLLM's batch-invariant mode, by construction rather
 * than by a second kernel). The keys of the chunk are in the cache already (reshape_and_cache runs
 * first). Costs a read of a query's keys per query instead of per tile of queries. */
static pd_status_t attn_prefill_as_decode(pd_backend_t *be, float *out, const float *q,
                                          const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                          float scale)
{
    pd_status_t st = pd_cpu_attn_validate(kv, meta, num_heads, 0);
    if (st != PD_OK || meta->num_tokens == 0) {
        return st;
    }
    const int T = meta->num_tokens, bs = kv->block_size;
    int64_t nb = 1;
    for (int s = 0; s < meta->num_seqs; s++) {
        int64_t b = pd_blocks_for_tokens(meta->seq_lens[s], bs);
        nb = b > nb ? b : nb;
    }
    int32_t *cu = malloc((size_t)(T + 1) * sizeof(int32_t)), *lens = malloc((size_t)T * sizeof(int32_t));
    int32_t *tables = malloc((size_t)T * (size_t)nb * sizeof(int32_t));
    if (cu == NULL || lens == NULL || tables == NULL) {
        free(cu), free(lens), free(tables);
        pd_log_error("attention: cannot allocate per-query tables for %d queries", T);
        return PD_ERR_NO_MEMORY;
    }
    for (int s = 0; s < meta->num_seqs; s++) {
        int q0 = meta->cu_seqlens_q[s], q_len = meta->cu_seqlens_q[s + 1] - q0;
        for (int i = 0; i < q_len; i++) {
            int t = q0 + i;
            cu[t] = t;
            lens[t] = (int32_t)pd_query_pos(meta->seq_lens[s], q_len, i) + 1;
            memcpy(tables + (size_t)t * nb, meta->block_tables + (size_t)s * meta->max_blocks_per_seq,
                   (size_t)pd_blocks_for_tokens(lens[t], bs) * sizeof(int32_t));
        }
    }
    cu[T] = T;
    pd_attn_meta_t dm = *meta;
    dm.num_seqs = T;
    dm.cu_seqlens_q = cu;
    dm.seq_lens = lens;
    dm.block_tables = tables;
    dm.max_blocks_per_seq = (int32_t)nb;
    st = pd_cpu_paged_attention_decode(be, out, q, kv, &dm, num_heads, scale);
    free(cu), free(lens), free(tables);
    return st;
}
