/* kernels/cpu/attention_prefill_tiled.c — prefill attention in tiles shaped for a GEMM
 * (FlashAttention-2's scheme on the CPU): for one (sequence, kv head, tile of query tokens), the
 * queries of every head of the GQA group form Q [M = tokens × group][D] (pre-scaled); the keys
 * they can see are walked in tiles of ATTN_MM_KT, each gathered from the paged cache into fp32
 * K, V [KT][D]; S = Q·Kᵀ and O += P·V are OpenBLAS sgemm calls (single-threaded inside the
 * caller's OpenMP thread), with an online softmax per row between them (running max m and sum l;
 * O rescaled by exp(m_old − m_new) when the max grows). Tiles past the tile's last query position
 * are never visited (causal); keys outside a row's [first, pos] (causal, sliding window) are
 * masked to −inf. Same results as pd_cpu_paged_attention_prefill_ref within fp32 rounding
 * (tests/unit/test_kernels.c). */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attention_prefill_tiled.h"
#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/simd.h"
#include "kernels/paged_impl.h"

size_t pd_cpu_attn_tiled_scratch_floats(int group, int head_size)
{
    size_t M = (size_t)ATTN_MM_TQ * group, D = (size_t)head_size, KT = ATTN_MM_KT;
    return M * D /* q */ + 2 * KT * D /* k, v */ + M * KT /* s */ + M * D /* o */ + 2 * M /* m, l */;
}

/* One row s[nk] of scores: the online softmax update of (m, l) and o's rescale over the keys in
 * [lo, hi] (tile-relative, inclusive); leaves p = exp(s − m_new) in s, 0 for keys outside (masked).
 * Returns 0 when the row sees no key of this tile (s all zero then, o and the state untouched). */
PD_CPU_CLONES static int softmax_row(float *s, int nk, int lo, int hi, float *m, float *l, float *o, int D)
{
    if (hi < lo) {
        memset(s, 0, (size_t)nk * sizeof(float));
        return 0;
    }
    float mb = -INFINITY;
    for (int j = lo; j <= hi; j++) {
        mb = s[j] > mb ? s[j] : mb;
    }
    float m_new = mb > *m ? mb : *m;
    if (m_new > *m && *l > 0) {
        float alpha = pd_fast_expf(*m - m_new);
        *l *= alpha;
#pragma omp simd
        for (int d = 0; d < D; d++) {
            o[d] *= alpha;
        }
    }
    *m = m_new;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < nk; j++) {
        float p = j >= lo && j <= hi ? pd_fast_expf(s[j] - m_new) : 0.0f;
        s[j] = p;
        sum += p;
    }
    *l += sum;
    return 1;
}

/* K and V rows of keys [j0, j0 + nk) for kv_head, converted to fp32, into k and v [nk][D]. */
static void gather_kv(float *k, float *v, const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int seq,
                      int kv_head, int64_t j0, int nk)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, es = pd_dtype_size(kv->dtype);
    for (int j = 0; j < nk; j++) {
        int64_t key = j0 + j;
        int64_t block = pd_block_table_lookup(meta->block_tables, meta->max_blocks_per_seq, seq, key, bs);
        int64_t ki = pd_kv_index(block, 0, (int)(key % bs), kv_head, bs, H, D);
        int64_t vi = pd_kv_index(block, 1, (int)(key % bs), kv_head, bs, H, D);
        pd_cpu_widen(k + (size_t)j * D, (const char *)kv->base + ki * es, kv->dtype, D);
        pd_cpu_widen(v + (size_t)j * D, (const char *)kv->base + vi * es, kv->dtype, D);
    }
}

void pd_cpu_attn_tiled_run(float *out, const float *q, const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                           int num_heads, float scale, int seq, int kv_head, int q_begin, int q_end,
                           float *scratch)
{
    const int H = kv->num_kv_heads, D = kv->head_size;
    const int group = num_heads / H;
    const int q0 = meta->cu_seqlens_q[seq];
    const int q_len = meta->cu_seqlens_q[seq + 1] - q0;
    const int64_t seq_len = meta->seq_lens[seq];
    const int T = q_end - q_begin, M = T * group;
    float *qt = scratch, *kt = qt + (size_t)ATTN_MM_TQ * group * D, *vt = kt + (size_t)ATTN_MM_KT * D;
    float *st = vt + (size_t)ATTN_MM_KT * D, *ot = st + (size_t)ATTN_MM_TQ * group * ATTN_MM_KT;
    float *mt = ot + (size_t)ATTN_MM_TQ * group * D, *lt = mt + (size_t)ATTN_MM_TQ * group;

    /* Q rows (token-major, heads of the group within): row (t − q_begin)·group + r, × scale */
    for (int t = q_begin; t < q_end; t++) {
        for (int r = 0; r < group; r++) {
            const float *src = q + ((size_t)(q0 + t) * num_heads + kv_head * group + r) * D;
            float *dst = qt + ((size_t)(t - q_begin) * group + r) * D;
            for (int d = 0; d < D; d++) {
                dst[d] = src[d] * scale;
            }
            mt[(t - q_begin) * group + r] = -INFINITY;
            lt[(t - q_begin) * group + r] = 0;
        }
    }
    memset(ot, 0, (size_t)M * D * sizeof(float));
    int64_t pos_lo = pd_query_pos(seq_len, q_len, q_begin);
    int64_t pos_hi = pd_query_pos(seq_len, q_len, q_end - 1);
    int64_t key_lo = pd_attn_first_key(pos_lo, meta->sliding_window);
    for (int64_t j0 = key_lo; j0 <= pos_hi; j0 += ATTN_MM_KT) {
        int nk = pos_hi - j0 + 1 < ATTN_MM_KT ? (int)(pos_hi - j0 + 1) : ATTN_MM_KT;
        gather_kv(kt, vt, kv, meta, seq, kv_head, j0, nk);
        /* S[M][nk] = Q · Kᵀ */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, nk, D, 1.0f, qt, D, kt, D, 0.0f, st, nk);
        int any = 0;
        for (int t = q_begin; t < q_end; t++) {
            int64_t pos = pd_query_pos(seq_len, q_len, t);
            int64_t first = pd_attn_first_key(pos, meta->sliding_window);
            int lo = first > j0 ? (int)(first - j0) : 0;
            int hi = pos - j0 < nk - 1 ? (int)(pos - j0) : nk - 1; /* may be < lo: row sees nothing */
            for (int r = 0; r < group; r++) {
                int row = (t - q_begin) * group + r;
                any |= softmax_row(st + (size_t)row * nk, nk, lo, hi, &mt[row], &lt[row],
                                   ot + (size_t)row * D, D);
            }
        }
        if (any) { /* O[M][D] += P · V */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, D, nk, 1.0f, st, nk, vt, D, 1.0f, ot,
                        D);
        }
    }
    for (int t = q_begin; t < q_end; t++) {
        for (int r = 0; r < group; r++) {
            int row = (t - q_begin) * group + r;
            float inv = lt[row] > 0 ? 1.0f / lt[row] : 0.0f;
            float *o = out + ((size_t)(q0 + t) * num_heads + kv_head * group + r) * D;
            for (int d = 0; d < D; d++) {
                o[d] = ot[(size_t)row * D + d] * inv;
            }
        }
    }
}
