/* kernels/cpu/attention_decode_x512.c — the split-K decode item (attention_decode.h) with AVX-512,
 * the query heads of a GQA group taken together: picked at run time before the AVX2 kernel
 * (attention_decode_x86.c) where the CPU has AVX-512 F/BW/VL and the head size is a multiple of 16.
 *
 * The AVX2 kernel walks one query head at a time, so every K and V row of a kv head is loaded and
 * widened `group` times, and its eight-key dot products end in a horizontal transpose each. Short
 * contexts in a big batch (a decode step of 32 sequences at 100 tokens) were then bound by those
 * instructions, not by the bytes: 18 % of the demo model's batch-32 step at 37 GFLOP/s (perf,
 * 2026-11-25). Here a chunk of up to 16 keys of one kv head is taken by register tiles of 4 query
 * heads:
 *   S  [4 heads][4 keys]  16 accumulators over d, K rows widened once per tile; one reduction tree
 *                         (sum16x4) turns the 16 vectors into the 16 scores
 *   P·V [4 heads][64 d]   16 accumulators; each V row widened once for the 4 heads
 * with the online softmax between them 16 keys at a time (one vector per head). The values are the
 * AVX2 kernel's up to the fp32 summation order (S's sums are split over 16 lanes, not 8), so the
 * reference bounds of tests/unit/test_kernels.c hold for both; under bf16 attention math the
 * roundings of attention_bf16.h are the same.
 *
 * pd-bench-ops, against the AVX2 kernel, three alternating rounds (2026-11-25): bf16 KV 32 × 4096
 * (DRAM) 22.3-22.7 GB/s against 13.9-14.7, fp16 23.0-23.9 against 15.7-17.9, fp32 19.9-21.5 against
 * 17.8-18.1; bf16 32 × 96 (a batch-32 step of the demo model) 16.8-17.4 against 12.2-13.2. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_decode.h"
#include "kernels/cpu/exp_x512.h"
#include "kernels/cpu/matmul_bf16.h" /* pd_cpu_bf16dot_usable */
#include "kernels/cpu/simd.h"
#include "kernels/paged_impl.h"

#define X512   __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define INLINE inline __attribute__((always_inline))

#define KC 16 /* keys per chunk: one vector of scores per query head */
#define NR 4  /* query heads per register tile */
#define ND 4  /* 16-wide column vectors per P·V tile (64 columns) */

/* How many blocks ahead to prefetch (as the AVX2 kernel), into L2: into L1, as the AVX2 kernel
 * does, the prefetches held up the loads of the page in use (bf16 32 × 4096: 20-21 GB/s against
 * 22-23 into L2; no prefetch: 13). */
#define PREFETCH_BLOCKS 2

int pd_cpu_attn_decode_x512_usable(int head_size, int group)
{
    return pd_cpu_avx512_usable() && head_size % 16 == 0 && head_size <= PD_ATTN_MAX_HEAD &&
           group <= PD_ATTN_MAX_GROUP;
}

/* 16 consecutive elements of a cache plane at element index i, as fp32; lanes off in `k` are
 * zero and not read. 16-bit caches are widened in registers. */
X512 static INLINE __m512 ld16(const void *p, size_t i, __mmask16 k, pd_dtype_t dt)
{
    if (dt == PD_DTYPE_F32) {
        return _mm512_maskz_loadu_ps(k, (const float *)p + i);
    }
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i);
    if (dt == PD_DTYPE_BF16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtph_ps(h);
}

/* The sums of 16 vectors, four to a 128-bit lane: lane r of the result is
 * [Σ a[4r], Σ a[4r+1], Σ a[4r+2], Σ a[4r+3]]. 12 shuffles and 9 adds, a fixed order. */
X512 static INLINE __m512 sum16x4(const __m512 *a)
{
    __m512 c[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *x = a + 4 * g;
        /* per 128-bit lane L: b0 = [x0 L0+L2, x1 L0+L2, x0 L1+L3, x1 L1+L3], b1 the same of x2, x3 */
        __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
        __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
        /* per lane L: [Σ_L x0, Σ_L x1, Σ_L x2, Σ_L x3] */
        c[g] = _mm512_add_ps(_mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    /* lanes of f01: [c0 L0+L2, c0 L1+L3, c1 L0+L2, c1 L1+L3] */
    __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of nr (constant, 1..4) query heads against 4 keys:
 *   s[r·KC + u] = Σ_d qh[r·D + d] · K[kr[u] + d]     r < nr, u < 4
 * qh [nr][D] fp32 (pre-scaled), kr: element indices of the keys' rows in the K plane kp. */
X512 static INLINE void qk_tile(float *s, const float *qh, const void *kp, const size_t *kr, int D,
                                const pd_dtype_t dt, const int nr)
{
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        a[i] = _mm512_setzero_ps();
    }
    for (int d = 0; d < D; d += 16) {
        __m512 k0 = ld16(kp, kr[0] + d, 0xffff, dt), k1 = ld16(kp, kr[1] + d, 0xffff, dt);
        __m512 k2 = ld16(kp, kr[2] + d, 0xffff, dt), k3 = ld16(kp, kr[3] + d, 0xffff, dt);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            __m512 qv = _mm512_loadu_ps(qh + (size_t)r * D + d);
            a[4 * r] = _mm512_fmadd_ps(qv, k0, a[4 * r]);
            a[4 * r + 1] = _mm512_fmadd_ps(qv, k1, a[4 * r + 1]);
            a[4 * r + 2] = _mm512_fmadd_ps(qv, k2, a[4 * r + 2]);
            a[4 * r + 3] = _mm512_fmadd_ps(qv, k3, a[4 * r + 3]);
        }
    }
    float out[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, sum16x4(a));
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
        _mm_storeu_ps(s + r * KC, _mm_load_ps(out + 4 * r));
    }
}

/* o[r·D + c] += Σ_{j<kc} p[r·KC + j] · V[vr + j·row + c] for r < nr (constant, 1..4) and the
 * columns c < 16·nd (nd 1..4) of one 64-column tile; o is the accumulator at the tile's column. */
X512 static INLINE void pv_tile(float *o, const float *p, const void *vp, size_t vr, size_t row, int kc,
                                int nd, int D, const pd_dtype_t dt, const int nr)
{
    __mmask16 mk[ND];
    __m512 a[NR * ND];
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
        mk[u] = u < nd ? 0xffff : 0;
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
#pragma GCC unroll 4
        for (int u = 0; u < ND; u++) {
            a[ND * r + u] = _mm512_maskz_loadu_ps(mk[u], o + (size_t)r * D + 16 * u);
        }
    }
    for (int j = 0; j < kc; j++, vr += row) {
        __m512 v[ND];
#pragma GCC unroll 4
        for (int u = 0; u < ND; u++) {
            v[u] = ld16(vp, vr + 16 * (size_t)u, mk[u], dt);
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            __m512 pj = _mm512_set1_ps(p[r * KC + j]);
#pragma GCC unroll 4
            for (int u = 0; u < ND; u++) {
                a[ND * r + u] = _mm512_fmadd_ps(pj, v[u], a[ND * r + u]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
#pragma GCC unroll 4
        for (int u = 0; u < ND; u++) {
            _mm512_mask_storeu_ps(o + (size_t)r * D + 16 * u, mk[u], a[ND * r + u]);
        }
    }
}

/* The online softmax of query head h over one chunk's scores s[0..kc) (the rest ignored): the
 * running max and sum in part updated, the accumulator rescaled when the max grew, and s
 * replaced by the weights p (0 past kc). bf16: attention_bf16.h's log2-domain roundings. */
X512 static INLINE void softmax_chunk(float *s, int kc, int h, int D, pd_attn_partial_t *part, const int bf16)
{
    __mmask16 km = pd_tail_mask16(kc);
    __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), km, s);
    float mb = _mm512_reduce_max_ps(sv);
    float m_old = part->m[h];
    float m_new = bf16 ? pd_attn_bf16_max(m_old, mb) : (mb > m_old ? mb : m_old);
    float *acc = part->acc + (size_t)h * D;
    if (m_new > m_old && part->l[h] > 0) {
        float alpha =
            bf16 ? pd_fast_exp2f(m_old - m_new) /* an exact power of two */ : pd_fast_expf(m_old - m_new);
        part->l[h] *= alpha;
        __m512 av = _mm512_set1_ps(alpha);
        for (int d = 0; d < D; d += 16) {
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
        }
    }
    part->m[h] = m_new;
    __m512 x = _mm512_sub_ps(sv, _mm512_set1_ps(m_new));
    __m512 p = bf16 ? pd_round_bf16_512(pd_exp2f512(x)) : pd_expf512(x);
    p = _mm512_maskz_mov_ps(km, p);
    part->l[h] += _mm512_reduce_add_ps(p);
    _mm512_storeu_ps(s, p);
}

/* The item for one cache dtype and math (constants at each call, so each variant gets its own
 * loops). scratch holds the pre-scaled queries [num_heads][D]. */
X512 static INLINE void item_dt(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                const pd_attn_meta_t *meta, int num_heads, float scale,
                                pd_attn_partial_t *part, float *scratch, const pd_dtype_t dt, const int bf16)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, group = num_heads / H;
    const int s = it->seq;
    const int64_t pos = meta->seq_lens[s] - 1; /* the one new token */
    const int64_t first = pd_attn_first_key(pos, meta->sliding_window);
    const size_t row = (size_t)H * D; /* elements per token row of one plane */
    const size_t esize = (size_t)pd_dtype_size(dt);
    const float *qs = q + (size_t)meta->cu_seqlens_q[s] * num_heads * D;
    float *qh = scratch; /* [num_heads][D]: q·scale, or q̂ under bf16 math */
    float sc[PD_ATTN_MAX_GROUP * KC] __attribute__((aligned(64)));

    const __m512 qf = _mm512_set1_ps(bf16 ? scale * PD_LOG2E : scale);
    for (size_t i = 0; i < (size_t)num_heads * D; i += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qs + i), qf);
        _mm512_storeu_ps(qh + i, bf16 ? pd_round_bf16_512(x) : x);
    }
    pd_attn_partial_reset(part, num_heads, D);
    pd_attn_prefetch_first_pages(it, kv, meta, PREFETCH_BLOCKS, true);
    for (int64_t b = it->block_begin; b < it->block_end; b++) {
        int lo, hi;
        if (!pd_attn_block_keys(b, bs, first, pos, &lo, &hi)) {
            continue;
        }
        const char *kp = pd_attn_block_plane(kv, meta, s, b, 0), *vp = pd_attn_block_plane(kv, meta, s, b, 1);
        /* the next block's page is somewhere else in the region: prefetch it while this one is
         * computed, a slice per query head */
        const char *next_page = NULL;
        size_t page_bytes = 2 * (size_t)bs * row * esize, slice = 0;
        if (b + PREFETCH_BLOCKS < it->block_end) {
            next_page = pd_attn_block_plane(kv, meta, s, b + PREFETCH_BLOCKS, 0);
            slice = (page_bytes / (size_t)num_heads + 63) & ~(size_t)63;
        }
        for (int c0 = lo; c0 <= hi; c0 += KC) {
            const int kc = hi + 1 - c0 < KC ? hi + 1 - c0 : KC;
            for (int g = 0; g < H; g++) {
                size_t kr[KC]; /* a short chunk's missing keys reuse its first row; masked by kc */
                for (int u = 0; u < KC; u++) {
                    kr[u] = (size_t)(c0 + (u < kc ? u : 0)) * row + (size_t)g * D;
                }
                const float *qg = qh + (size_t)g * group * D;
                for (int r0 = 0; r0 < group; r0 += NR) {
                    const int nr = group - r0 < NR ? group - r0 : NR;
                    for (int u = 0; u < kc; u += 4) {
                        float *so = sc + r0 * KC + u;
                        const float *qr = qg + (size_t)r0 * D;
                        switch (nr) {
                        case 4: qk_tile(so, qr, kp, kr + u, D, dt, 4); break;
                        case 3: qk_tile(so, qr, kp, kr + u, D, dt, 3); break;
                        case 2: qk_tile(so, qr, kp, kr + u, D, dt, 2); break;
                        default: qk_tile(so, qr, kp, kr + u, D, dt, 1); break;
                        }
                    }
                }
                for (int r = 0; r < group; r++) {
                    int h = g * group + r;
                    if (next_page != NULL && c0 == lo) {
                        for (size_t off = (size_t)h * slice;
                             off < (size_t)(h + 1) * slice && off < page_bytes; off += 64) {
                            _mm_prefetch(next_page + off, _MM_HINT_T1);
                        }
                    }
                    softmax_chunk(sc + r * KC, kc, h, D, part, bf16);
                }
                const size_t vr = (size_t)c0 * row + (size_t)g * D; /* element index of V row c0 */
                for (int r0 = 0; r0 < group; r0 += NR) {
                    const int nr = group - r0 < NR ? group - r0 : NR;
                    for (int d0 = 0; d0 < D; d0 += 16 * ND) {
                        const int nd = (D - d0) / 16 < ND ? (D - d0) / 16 : ND;
                        float *o = part->acc + (size_t)(g * group + r0) * D + d0;
                        const float *p = sc + r0 * KC;
                        switch (nr) {
                        case 4: pv_tile(o, p, vp, vr + d0, row, kc, nd, D, dt, 4); break;
                        case 3: pv_tile(o, p, vp, vr + d0, row, kc, nd, D, dt, 3); break;
                        case 2: pv_tile(o, p, vp, vr + d0, row, kc, nd, D, dt, 2); break;
                        default: pv_tile(o, p, vp, vr + d0, row, kc, nd, D, dt, 1); break;
                        }
                    }
                }
            }
        }
    }
}

/* ---- bf16 attention math on AVX512-BF16 (pd_cpu_attn_decode_dot_item) ----
 *
 * Under bf16 attention math (attention_bf16.h) q̂, the cache and p̂ are all bf16, so both products
 * are vdpbf16ps's: bf16 pairs multiplied exactly and summed in fp32. QK keeps the tiles above with
 * a 32-wide dot of q̂ and a K row per instruction in place of a widening and two FMAs per 16
 * columns; P·V takes keys in pairs, the two V rows interleaved (vpunpck{l,h}wd) against p̂ of both
 * keys broadcast as one dword, so one instruction adds two keys to 16 columns. The interleave
 * leaves each 32-column group's accumulators in the order [8l..8l+3 of 128-bit lane l] then
 * [8l+4..8l+7] (COLS_LO/COLS_HI below); the item puts them back in column order at its end. The
 * softmax is the one above, so the roundings are attention_bf16.h's; only the fp32 summation order
 * of s and o differs from the FMA item. */
#define DOT_ISA     "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c"
#define XDOT        __attribute__((target(DOT_ISA)))
#define XDOT_INLINE __attribute__((target(DOT_ISA), always_inline)) static inline

/* 16 fp32 values that are bf16 already (q̂, p̂) as their 16 bf16 words: the upper halves, exact. */
XDOT_INLINE __m256i bf16_words(__m512 x)
{
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
}

/* Scores of nr (constant, 1..4) query heads against 4 keys, as qk_tile; qb [nr][D] the bf16 q̂, kp
 * the bf16 K plane (D a multiple of 32). */
XDOT_INLINE void qk_tile_dot(float *s, const uint16_t *qb, const uint16_t *kp, const size_t *kr, int D,
                             const int nr)
{
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        a[i] = _mm512_setzero_ps();
    }
    for (int d = 0; d < D; d += 32) {
        __m512bh k[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; u++) {
            k[u] = (__m512bh)_mm512_loadu_si512((const void *)(kp + kr[u] + d));
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qb + (size_t)r * D + d));
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                a[4 * r + u] = _mm512_dpbf16_ps(a[4 * r + u], qv, k[u]);
            }
        }
    }
    float out[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, sum16x4(a));
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
        _mm_storeu_ps(s + r * KC, _mm_load_ps(out + 4 * r));
    }
}

/* o[r][...] += Σ_{j<kc} p̂[r][j] · V[vr + j·row + c] for r < nr (constant, 1..4) over ng (1 or 2)
 * groups of 32 columns from the tile's first, accumulators in the interleaved order above; pp[r][i]
 * holds p̂ of keys 2i (low half) and 2i + 1 as one dword (KC / 2 per head). An odd kc's last key is
 * paired with zeros, not with the row after it. */
XDOT_INLINE void pv_tile_dot(float *o, const uint32_t *pp, const uint16_t *vp, size_t vr, size_t row, int kc,
                             int ng, int D, const int nr)
{
    __mmask16 mk[ND];
    __m512 a[NR * ND];
#pragma GCC unroll 4
    for (int u = 0; u < ND; u++) {
        mk[u] = u < 2 * ng ? 0xffff : 0;
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
#pragma GCC unroll 4
        for (int u = 0; u < ND; u++) {
            a[ND * r + u] = _mm512_maskz_loadu_ps(mk[u], o + (size_t)r * D + 16 * u);
        }
    }
    for (int j = 0; j < kc; j += 2, vr += 2 * row) {
        __m512bh lo[2], hi[2];
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) {
            __mmask32 live = g < ng ? 0xffffffffu : 0;
            __m512i v0 = _mm512_maskz_loadu_epi16(live, vp + vr + 32 * (size_t)g);
            __m512i v1 = _mm512_maskz_loadu_epi16(j + 1 < kc ? live : 0, vp + vr + row + 32 * (size_t)g);
            lo[g] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
            hi[g] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        }
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pp[r * (KC / 2) + j / 2]);
#pragma GCC unroll 2
            for (int g = 0; g < 2; g++) {
                a[ND * r + 2 * g] = _mm512_dpbf16_ps(a[ND * r + 2 * g], pj, lo[g]);
                a[ND * r + 2 * g + 1] = _mm512_dpbf16_ps(a[ND * r + 2 * g + 1], pj, hi[g]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
#pragma GCC unroll 4
        for (int u = 0; u < ND; u++) {
            _mm512_mask_storeu_ps(o + (size_t)r * D + 16 * u, mk[u], a[ND * r + u]);
        }
    }
}

/* acc[n_rows][D] from the interleaved order back to column order, 32 columns at a time. */
XDOT_INLINE void unpermute_columns(float *acc, int n_rows, int D)
{
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < n_rows; i++) {
        for (int c = 0; c < D; c += 32) {
            float *g = acc + (size_t)i * D + c;
            __m512 lo = _mm512_loadu_ps(g), hi = _mm512_loadu_ps(g + 16);
            _mm512_storeu_ps(g, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(g + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
    }
}

int pd_cpu_attn_decode_dot_usable(int head_size, int group)
{
    return pd_cpu_attn_decode_x512_usable(head_size, group) && head_size % 32 == 0 && pd_cpu_bf16dot_usable();
}

XDOT void pd_cpu_attn_decode_dot_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                      const pd_attn_meta_t *meta, int num_heads, float scale,
                                      pd_attn_partial_t *part, float *scratch)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size, group = num_heads / H;
    const int s = it->seq;
    const int64_t pos = meta->seq_lens[s] - 1; /* the one new token */
    const int64_t first = pd_attn_first_key(pos, meta->sliding_window);
    const size_t row = (size_t)H * D; /* elements per token row of one plane */
    const float *qs = q + (size_t)meta->cu_seqlens_q[s] * num_heads * D;
    uint16_t *qb = (uint16_t *)scratch; /* [num_heads][D]: q̂ as bf16 */
    float sc[PD_ATTN_MAX_GROUP * KC] __attribute__((aligned(64)));
    uint32_t pp[PD_ATTN_MAX_GROUP * KC / 2]; /* p̂ of key pairs, per head */

    const __m512 qf = _mm512_set1_ps(scale * PD_LOG2E);
    for (size_t i = 0; i < (size_t)num_heads * D; i += 16) {
        __m512 x = pd_round_bf16_512(_mm512_mul_ps(_mm512_loadu_ps(qs + i), qf));
        _mm256_storeu_si256((__m256i *)(qb + i), bf16_words(x));
    }
    pd_attn_partial_reset(part, num_heads, D);
    pd_attn_prefetch_first_pages(it, kv, meta, PREFETCH_BLOCKS, true);
    for (int64_t b = it->block_begin; b < it->block_end; b++) {
        int lo, hi;
        if (!pd_attn_block_keys(b, bs, first, pos, &lo, &hi)) {
            continue;
        }
        const uint16_t *kp = (const uint16_t *)pd_attn_block_plane(kv, meta, s, b, 0);
        const uint16_t *vp = (const uint16_t *)pd_attn_block_plane(kv, meta, s, b, 1);
        const char *next_page = NULL; /* prefetched a slice per query head, as item_dt */
        size_t page_bytes = 2 * (size_t)bs * row * sizeof(uint16_t), slice = 0;
        if (b + PREFETCH_BLOCKS < it->block_end) {
            next_page = pd_attn_block_plane(kv, meta, s, b + PREFETCH_BLOCKS, 0);
            slice = (page_bytes / (size_t)num_heads + 63) & ~(size_t)63;
        }
        for (int c0 = lo; c0 <= hi; c0 += KC) {
            const int kc = hi + 1 - c0 < KC ? hi + 1 - c0 : KC;
            for (int g = 0; g < H; g++) {
                size_t kr[KC]; /* a short chunk's missing keys reuse its first row; masked by kc */
                for (int u = 0; u < KC; u++) {
                    kr[u] = (size_t)(c0 + (u < kc ? u : 0)) * row + (size_t)g * D;
                }
                const uint16_t *qg = qb + (size_t)g * group * D;
                for (int r0 = 0; r0 < group; r0 += NR) {
                    const int nr = group - r0 < NR ? group - r0 : NR;
                    for (int u = 0; u < kc; u += 4) {
                        float *so = sc + r0 * KC + u;
                        const uint16_t *qr = qg + (size_t)r0 * D;
                        switch (nr) {
                        case 4: qk_tile_dot(so, qr, kp, kr + u, D, 4); break;
                        case 3: qk_tile_dot(so, qr, kp, kr + u, D, 3); break;
                        case 2: qk_tile_dot(so, qr, kp, kr + u, D, 2); break;
                        default: qk_tile_dot(so, qr, kp, kr + u, D, 1); break;
                        }
                    }
                }
                for (int r = 0; r < group; r++) {
                    int h = g * group + r;
                    if (next_page != NULL && c0 == lo) {
                        for (size_t off = (size_t)h * slice;
                             off < (size_t)(h + 1) * slice && off < page_bytes; off += 64) {
                            _mm_prefetch(next_page + off, _MM_HINT_T1);
                        }
                    }
                    softmax_chunk(sc + r * KC, kc, h, D, part, 1);
                    _mm256_storeu_si256((__m256i *)(pp + r * (KC / 2)),
                                        bf16_words(_mm512_loadu_ps(sc + r * KC)));
                }
                const size_t vr = (size_t)c0 * row + (size_t)g * D; /* element index of V row c0 */
                for (int r0 = 0; r0 < group; r0 += NR) {
                    const int nr = group - r0 < NR ? group - r0 : NR;
                    for (int d0 = 0; d0 < D; d0 += 16 * ND) {
                        const int ng = (D - d0) / 32 < 2 ? (D - d0) / 32 : 2;
                        float *o = part->acc + (size_t)(g * group + r0) * D + d0;
                        const uint32_t *pr = pp + r0 * (KC / 2);
                        switch (nr) {
                        case 4: pv_tile_dot(o, pr, vp, vr + d0, row, kc, ng, D, 4); break;
                        case 3: pv_tile_dot(o, pr, vp, vr + d0, row, kc, ng, D, 3); break;
                        case 2: pv_tile_dot(o, pr, vp, vr + d0, row, kc, ng, D, 2); break;
                        default: pv_tile_dot(o, pr, vp, vr + d0, row, kc, ng, D, 1); break;
                        }
                    }
                }
            }
        }
    }
    unpermute_columns(part->acc, num_heads, D);
}

X512 void pd_cpu_attn_decode_x512_item(const pd_attn_decode_item_t *it, const float *q,
                                       const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                       float scale, int bf16, pd_attn_partial_t *part, float *scratch)
{
    if (kv->dtype == PD_DTYPE_BF16 && bf16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, scratch, PD_DTYPE_BF16, 1);
    } else if (kv->dtype == PD_DTYPE_BF16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, scratch, PD_DTYPE_BF16, 0);
    } else if (kv->dtype == PD_DTYPE_F16) {
        item_dt(it, q, kv, meta, num_heads, scale, part, scratch, PD_DTYPE_F16, 0);
    } else {
        item_dt(it, q, kv, meta, num_heads, scale, part, scratch, PD_DTYPE_F32, 0);
    }
}
