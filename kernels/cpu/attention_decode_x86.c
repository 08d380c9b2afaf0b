/* kernels/cpu/attention_decode_x86.c — paged attention decode (one new token per sequence) with
 * AVX2/FMA/F16C intrinsics, picked at run time when the CPU has them (attention.c dispatches).
 *
 * Work split (split-K, like vLLM's paged_attention_v2 / flash-decoding): a work item is a
 * (sequence, partition) pair covering a contiguous range of that sequence's blocks, all kv heads.
 * Whole pages [2][block_size][kv_heads][head_size] are streamed once, so every byte of KV is read
 * once per step. Each item keeps an online softmax (max m, sum l, accumulator acc) per query
 * head; partitions of one sequence are merged by pd_cpu_attn_merge_partitions (log-sum-exp).
 * Same results as the reference within fp32 rounding (tests/unit/test_kernels.c). */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_decode.h"
#include "kernels/paged_impl.h"

#define X86 __attribute__((target("avx2,fma,f16c")))

/* How many blocks ahead to prefetch: far enough to cover DRAM latency behind one block's compute. */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif

int pd_cpu_attn_decode_x86_usable(int head_size, int group)
{
    return pd_cpu_isa_cap() >= PD_ISA_AVX2 && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") && head_size % 8 == 0 &&
           head_size <= PD_ATTN_MAX_HEAD && group <= PD_ATTN_MAX_GROUP;
}

/* e^r · 2^n for |r| <= ln 2 / 2: pd_fast_expf's polynomial (kernels/cpu/simd.h). */
X86 static inline __m256 exp_poly256(__m256 r, __m256 n)
{
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    /* (p·r·r + r) + 1, as GCC contracts pd_exp_poly's last line (exp_x512.h) */
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* exp(x) for x <= 0, as pd_fast_expf. */
X86 static inline __m256 exp256(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n =
        _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 out = exp_poly256(r, n);
    return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
}

/* 2^x for x <= 0, as pd_fast_exp2f: n = x rounded to an integer (ties to even), and the
 * polynomial at (x − n)·ln 2. */
X86 static inline __m256 exp2_256(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 magic = _mm256_set1_ps(12582912.0f); /* 1.5 · 2^23 */
    __m256 n = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
    __m256 r = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.693147180559945309f));
    __m256 out = exp_poly256(r, n);
    return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GT_OQ));
}

/* Each lane rounded to the nearest bf16 (ties to even), as floats; lanes finite. */
X86 static inline __m256 round_bf16_256(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

X86 static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

X86 static inline float hmax256(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sums of 8 accumulators, lane i of the result = horizontal sum of a[i]. */
X86 static inline __m256 transpose_sum8(const __m256 *a)
{
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: [0 1 2 3 | 0 1 2 3] halves of 0123 and 4567; fold 128-bit halves */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* 8 consecutive elements of a cache plane at element index i, as fp32: 16-bit caches are
 * widened in registers (bf16: shift into the high half; fp16: F16C), never through a buffer. */
X86 static inline __m256 ld8(const void *p, size_t i, pd_dtype_t dt)
{
    if (dt == PD_DTYPE_F32) {
        return _mm256_loadu_ps((const float *)p + i);
    }
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == PD_DTYPE_BF16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtph_ps(h);
}

/* The item kernel for one cache dtype; dt and bf16 (bf16 attention math, attention_bf16.h) are
 * constants at each call, so their branches fold away and each variant gets its own loop. The
 * pages are read in place (no converted copy). */
X86 static inline __attribute__((always_inline)) void
item_dt(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
        int num_heads, float scale, pd_attn_partial_t *part, const pd_dtype_t dt, const int bf16)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, group = num_heads / H;
    const int s = it->seq;
    const int64_t seq_len = meta->seq_lens[s];
    const int64_t pos = seq_len - 1; /* the one new token */
    const int64_t first = pd_attn_first_key(pos, meta->sliding_window);
    const int row = H * D; /* elements per token row of one plane */
    const size_t esize = (size_t)pd_dtype_size(dt);
    const float *qs = q + (size_t)meta->cu_seqlens_q[s] * num_heads * D;
    float qscaled[PD_ATTN_MAX_HEAD];
    float scores[PD_ATTN_MAX_BLOCK + 8];

    pd_attn_partial_reset(part, num_heads, D);
    pd_attn_prefetch_first_pages(it, kv, meta, PREFETCH_BLOCKS, true);
    for (int64_t b = it->block_begin; b < it->block_end; b++) {
        int lo, hi;
        if (!pd_attn_block_keys(b, bs, first, pos, &lo, &hi)) {
            continue;
        }
        /* the block's K and V planes, in the cache's own dtype */
        const char *kp = pd_attn_block_plane(kv, meta, s, b, 0), *vp = pd_attn_block_plane(kv, meta, s, b, 1);
        int nk = hi - lo + 1;
        /* the next block's page is somewhere else in the region: prefetch it while this one is
         * computed, a slice per head so the requests spread over the block's work */
        const char *next_page = NULL;
        size_t page_bytes = (size_t)2 * bs * row * esize, slice = 0;
        if (b + PREFETCH_BLOCKS < it->block_end) {
            next_page = pd_attn_block_plane(kv, meta, s, b + PREFETCH_BLOCKS, 0);
            slice = (page_bytes / (size_t)num_heads + 63) & ~(size_t)63;
        }
        for (int g = 0; g < H; g++) {
            for (int r = 0; r < group; r++) {
                int h = g * group + r;
                if (next_page != NULL) {
                    for (size_t off = (size_t)h * slice; off < (size_t)(h + 1) * slice && off < page_bytes;
                         off += 64) {
                        _mm_prefetch(next_page + off, _MM_HINT_T0);
                    }
                }
                const float *qh = qs + (size_t)h * D;
                const __m256 qf = _mm256_set1_ps(bf16 ? scale * PD_LOG2E : scale);
                for (int d = 0; d < D; d += 8) {
                    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qh + d), qf);
                    _mm256_storeu_ps(qscaled + d, bf16 ? round_bf16_256(x) : x);
                }
                /* scores of keys lo..hi, 8 at a time (a short tail reuses row lo, masked below);
                 * kr(u): element index of key u's row for kv head g */
                for (int j = 0; j < nk; j += 8) {
#define KROW(u) ((size_t)(lo + (j + (u) < nk ? j + (u) : 0)) * row + (size_t)g * D)
                    const size_t k0 = KROW(0), k1 = KROW(1), k2 = KROW(2), k3 = KROW(3);
                    const size_t k4 = KROW(4), k5 = KROW(5), k6 = KROW(6), k7 = KROW(7);
#undef KROW
                    __m256 a[8];
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                           a7 = a0;
                    for (int d = 0; d < D; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qscaled + d);
                        a0 = _mm256_fmadd_ps(qv, ld8(kp, k0 + d, dt), a0);
                        a1 = _mm256_fmadd_ps(qv, ld8(kp, k1 + d, dt), a1);
                        a2 = _mm256_fmadd_ps(qv, ld8(kp, k2 + d, dt), a2);
                        a3 = _mm256_fmadd_ps(qv, ld8(kp, k3 + d, dt), a3);
                        a4 = _mm256_fmadd_ps(qv, ld8(kp, k4 + d, dt), a4);
                        a5 = _mm256_fmadd_ps(qv, ld8(kp, k5 + d, dt), a5);
                        a6 = _mm256_fmadd_ps(qv, ld8(kp, k6 + d, dt), a6);
                        a7 = _mm256_fmadd_ps(qv, ld8(kp, k7 + d, dt), a7);
                    }
                    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, a[4] = a4, a[5] = a5, a[6] = a6, a[7] = a7;
                    _mm256_storeu_ps(scores + j, transpose_sum8(a));
                }
                for (int j = nk; j < ((nk + 7) & ~7); j++) {
                    scores[j] = -INFINITY;
                }
                __m256 mv = _mm256_set1_ps(-INFINITY);
                for (int j = 0; j < nk; j += 8) {
                    mv = _mm256_max_ps(mv, _mm256_loadu_ps(scores + j));
                }
                float m_blk = hmax256(mv);
                float m_old = part->m[h];
                float m_new = bf16 ? pd_attn_bf16_max(m_old, m_blk) : (m_blk > m_old ? m_blk : m_old);
                float *acc = part->acc + (size_t)h * D;
                if (m_new > m_old && part->l[h] > 0) {
                    float alpha = bf16 ? pd_fast_exp2f(m_old - m_new) : expf(m_old - m_new);
                    part->l[h] *= alpha;
                    __m256 av = _mm256_set1_ps(alpha);
                    for (int d = 0; d < D; d += 8) {
                        _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), av));
                    }
                }
                part->m[h] = m_new;
                __m256 lsum = _mm256_setzero_ps(), mn = _mm256_set1_ps(m_new);
                for (int j = 0; j < nk; j += 8) {
                    __m256 x = _mm256_sub_ps(_mm256_loadu_ps(scores + j), mn);
                    __m256 p = bf16 ? round_bf16_256(exp2_256(x)) : exp256(x);
                    _mm256_storeu_ps(scores + j, p);
                    lsum = _mm256_add_ps(lsum, p);
                }
                part->l[h] += hsum256(lsum);
                /* acc += Σ_j p_j · V_j: columns in chunks of 32 (four registers), then of 8 */
                const size_t vb = (size_t)lo * row + (size_t)g * D; /* element index of V row lo */
                int d0 = 0;
                for (; d0 + 32 <= D; d0 += 32) {
                    __m256 a0 = _mm256_loadu_ps(acc + d0), a1 = _mm256_loadu_ps(acc + d0 + 8);
                    __m256 a2 = _mm256_loadu_ps(acc + d0 + 16), a3 = _mm256_loadu_ps(acc + d0 + 24);
                    for (int j = 0; j < nk; j++) {
                        const size_t vr = vb + (size_t)j * row + d0;
                        __m256 p = _mm256_broadcast_ss(scores + j);
                        a0 = _mm256_fmadd_ps(p, ld8(vp, vr, dt), a0);
                        a1 = _mm256_fmadd_ps(p, ld8(vp, vr + 8, dt), a1);
                        a2 = _mm256_fmadd_ps(p, ld8(vp, vr + 16, dt), a2);
                        a3 = _mm256_fmadd_ps(p, ld8(vp, vr + 24, dt), a3);
                    }
                    _mm256_storeu_ps(acc + d0, a0);
                    _mm256_storeu_ps(acc + d0 + 8, a1);
                    _mm256_storeu_ps(acc + d0 + 16, a2);
                    _mm256_storeu_ps(acc + d0 + 24, a3);
                }
                for (; d0 < D; d0 += 8) {
                    __m256 a0 = _mm256_loadu_ps(acc + d0);
                    for (int j = 0; j < nk; j++) {
                        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + j),
                                             ld8(vp, vb + (size_t)j * row + d0, dt), a0);
                    }
                    _mm256_storeu_ps(acc + d0, a0);
                }
            }
        }
    }
}

X86 void pd_cpu_attn_decode_x86_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                     const pd_attn_meta_t *meta, int num_heads, float scale, int bf16,
                                     pd_attn_partial_t *part, float *scratch)
{
    (void)scratch; /* pages are read in place */
    if (kv->dtype == PD_DTYPE_BF16 && bf16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, PD_DTYPE_BF16, 1);
    } else if (kv->dtype == PD_DTYPE_BF16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, PD_DTYPE_BF16, 0);
    } else if (kv->dtype == PD_DTYPE_F16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, PD_DTYPE_F16, 0);
    } else {
        item_dt(it, q, kv, meta, num_heads, scale, part, PD_DTYPE_F32, 0);
    }
}
