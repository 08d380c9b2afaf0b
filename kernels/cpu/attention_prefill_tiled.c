/* kernels/cpu/attention_prefill_tiled.c — prefill attention in tiles shaped for a GEMM
 * (FlashAttention-2's scheme on the CPU): for one (sequence, kv head, tile of query tokens), the
 * queries of every head of the GQA group form Q [M = tokens × group][D] (pre-scaled); the keys
 * they can see are walked in tiles of ATTN_MM_KT, each gathered from the paged cache into fp32
 * K, V [KT][D]; S = Q·Kᵀ and O += P·V are OpenBLAS sgemm calls (single-threaded inside the
 * caller's OpenMP thread), with an online softmax per row between them (running max m and sum l;
 * O rescaled by exp(m_old − m_new) when the max grows). Tiles past the tile's last query position
 * are never visited (causal); keys outside a row's [first, pos] (causal, sliding window) are
 * masked to −inf. Same results as pd_cpu_paged_attention_prefill_ref within fp32 rounding
 * (tests/unit/test_kernels.c).
 *
 * Under bf16 attention math (attention_bf16.h) the item rounds Q and P to bf16 and runs the softmax
 * in the log2 domain with an integer running max; both products then run on AMX tiles where the
 * CPU has them and the head size is a multiple of 32 (pd_cpu_amx_gemm_pairs, K and V gathered
 * straight into its pair layouts: 1.06-1.15x oneDNN's GEMM on this tile in pd-bench-ops, 2026-11-25),
 * else through oneDNN's bf16 GEMM on a CPU with AVX512-BF16 (K and V tiles copied from the cache as
 * they are, zero-padded to ATTN_MM_KT keys so that one primitive serves every tile), else through
 * sgemm on the same bf16-exact values widened (same products, exact in fp32). The scratch is on
 * 64-byte lines (attention.c): tile rows that straddle two lines made the AMX products 30 % slower
 * in a process whose heap had moved them there. */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "kernels/cpu/attention_bf16.h"
#include "kernels/cpu/attention_prefill_tiled.h"
#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/matmul_dnnl.h"
#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/simd.h"
#include "kernels/paged_impl.h"

size_t pd_cpu_attn_tiled_scratch_floats(int group, int head_size)
{
    size_t M = (size_t)ATTN_MM_TQ * group, D = (size_t)head_size, KT = ATTN_MM_KT;
    size_t M16 = (M + 15) & ~(size_t)15; /* whole AMX tiles of q̂ and p̂ rows */
    size_t f32 = M * D /* q */ + 2 * KT * D /* k, v */ + M * KT /* s */ + M * D /* o */ + 2 * M /* m, l */;
    size_t b16 = M16 * D /* q̂ */ + 2 * KT * D /* k, v */ + M16 * KT /* p̂ */; /* bf16, for oneDNN or AMX */
    return f32 + (b16 + 1) / 2 + 16;
}

/* The online softmax's first half for one row: the new running max over s[lo..hi] (an integer
 * under bf16 math), with l and o rescaled when it grew; *m updated. bf16 is a constant at each
 * call. */
static inline __attribute__((always_inline)) float row_max_rescale(const float *s, int lo, int hi, float *m,
                                                                   float *l, float *o, int D, const int bf16)
{
    float mb = -INFINITY;
#pragma omp simd reduction(max : mb)
    for (int j = lo; j <= hi; j++) {
        mb = s[j] > mb ? s[j] : mb;
    }
    float m_new = bf16 ? pd_attn_bf16_max(*m, mb) : (mb > *m ? mb : *m);
    if (m_new > *m && *l > 0) {
        float alpha = bf16 ? pd_fast_exp2f(*m - m_new) /* an exact power of two */ : pd_fast_expf(*m - m_new);
        *l *= alpha;
#pragma omp simd
        for (int d = 0; d < D; d++) {
            o[d] *= alpha;
        }
    }
    *m = m_new;
    return m_new;
}

/* One row s[nk] of scores: the online softmax update of (m, l) and o's rescale over the keys in
 * [lo, hi] (tile-relative, inclusive); leaves p = exp(s − m_new) in s, 0 for keys outside (masked).
 * Returns 0 when the row sees no key of this tile (s all zero then, o and the state untouched). */
PD_CPU_BODY int softmax_row_body(float *s, int nk, int lo, int hi, float *m, float *l, float *o, int D)
{
    if (hi < lo) {
        memset(s, 0, (size_t)nk * sizeof(float));
        return 0;
    }
    float m_new = row_max_rescale(s, lo, hi, m, l, o, D, 0);
    float sum = 0;
    memset(s, 0, (size_t)lo * sizeof(float)); /* masked keys: p = 0 */
    memset(s + hi + 1, 0, (size_t)(nk - 1 - hi) * sizeof(float));
#pragma omp simd reduction(+ : sum)
    for (int j = lo; j <= hi; j++) {
        float p = pd_fast_expf(s[j] - m_new);
        s[j] = p;
        sum += p;
    }
    *l += sum;
    return 1;
}
PD_CPU_VARIANTS(int, softmax_row, (float *s, int nk, int lo, int hi, float *m, float *l, float *o, int D),
                (s, nk, lo, hi, m, l, o, D))

/* softmax_row under bf16 math (attention_bf16.h): s holds log2-domain scores, the running max m
 * is an integer, and p̂ = bf16(2^(s − m)) is summed into l and left in pb as bf16 (oneDNN's
 * operand), or in s as floats when pb is NULL. */
PD_CPU_BODY int softmax_row_bf16_body(float *s, uint16_t *pb, int nk, int lo, int hi, float *m, float *l,
                                      float *o, int D)
{
    if (hi < lo) {
        if (pb != NULL) {
            memset(pb, 0, (size_t)nk * sizeof(uint16_t));
        } else {
            memset(s, 0, (size_t)nk * sizeof(float));
        }
        return 0;
    }
    float m_new = row_max_rescale(s, lo, hi, m, l, o, D, 1);
    float sum = 0;
    if (pb != NULL) {
        memset(pb, 0, (size_t)lo * sizeof(uint16_t)); /* masked keys: p̂ = 0 */
        memset(pb + hi + 1, 0, (size_t)(nk - 1 - hi) * sizeof(uint16_t));
#pragma omp simd reduction(+ : sum)
        for (int j = lo; j <= hi; j++) {
            float p = pd_round_bf16f(pd_fast_exp2f(s[j] - m_new));
            uint32_t u;
            memcpy(&u, &p, 4);
            pb[j] = (uint16_t)(u >> 16); /* exact: p is a bf16 value */
            sum += p;
        }
    } else {
        memset(s, 0, (size_t)lo * sizeof(float));
        memset(s + hi + 1, 0, (size_t)(nk - 1 - hi) * sizeof(float));
#pragma omp simd reduction(+ : sum)
        for (int j = lo; j <= hi; j++) {
            float p = pd_round_bf16f(pd_fast_exp2f(s[j] - m_new));
            s[j] = p;
            sum += p;
        }
    }
    *l += sum;
    return 1;
}
PD_CPU_VARIANTS(int, softmax_row_bf16,
                (float *s, uint16_t *pb, int nk, int lo, int hi, float *m, float *l, float *o, int D),
                (s, pb, nk, lo, hi, m, l, o, D))

#if defined(__x86_64__) && defined(__GNUC__)
#include "kernels/cpu/exp_x512.h"
#include "kernels/cpu/transpose_x512.h"
#define SOFTMAX_512 __attribute__((target("avx512f,avx512bw,avx512vl,prefer-vector-width=512")))

/* softmax_row, and softmax_row_bf16 with pb, for a CPU with AVX-512 (bf16: the oneDNN path, which
 * needs AVX512-BF16 anyway): the same p (the same exp loops, compiled with FMA as the AVX2 clones
 * are), but the row's max and sum are AVX-512 reductions. GCC's `omp simd reduction` ends each loop
 * in a scalar pass over a stack array; with 128-key rows those two epilogues cost about as much as
 * the exps (perf: 35 % of a 2048-token bf16 prefill with 64-wide heads in softmax_row_bf16). The
 * sum's order differs from the clones' (fp32 summation order, as between any two paths). bf16 is a
 * constant at each call. */
SOFTMAX_512 static inline __attribute__((always_inline)) int softmax_row_512(float *s, uint16_t *pb, int nk,
                                                                             int lo, int hi, float *m,
                                                                             float *l, float *o, int D,
                                                                             const int bf16)
{
    if (hi < lo) {
        if (bf16) {
            memset(pb, 0, (size_t)nk * sizeof(uint16_t));
        } else {
            memset(s, 0, (size_t)nk * sizeof(float));
        }
        return 0;
    }
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int j = lo; j <= hi; j += 16) {
        __mmask16 k = pd_tail_mask16(hi + 1 - j);
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
    }
    float mb = _mm512_reduce_max_ps(mv);
    float m_new = bf16 ? pd_attn_bf16_max(*m, mb) : (mb > *m ? mb : *m);
    if (m_new > *m && *l > 0) {
        float alpha = bf16 ? pd_fast_exp2f(*m - m_new) /* an exact power of two */ : pd_fast_expf(*m - m_new);
        *l *= alpha;
        const __m512 av = _mm512_set1_ps(alpha);
        for (int d = 0; d < D; d += 16) {
            __mmask16 k = pd_tail_mask16(D - d);
            _mm512_mask_storeu_ps(o + d, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, o + d), av));
        }
    }
    *m = m_new;
    if (bf16) {
        memset(pb, 0, (size_t)lo * sizeof(uint16_t)); /* masked keys: p̂ = 0 */
        memset(pb + hi + 1, 0, (size_t)(nk - 1 - hi) * sizeof(uint16_t));
    } else {
        memset(s, 0, (size_t)lo * sizeof(float)); /* masked keys: p = 0 */
        memset(s + hi + 1, 0, (size_t)(nk - 1 - hi) * sizeof(float));
    }
    /* p (bitwise the vectorized pd_fast_exp2f / pd_fast_expf: exp_x512.h), its sum, and where the
     * products read it (pb's bf16 values under bf16 math, s otherwise) in one pass */
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sv = _mm512_setzero_ps();
    for (int j = lo; j <= hi; j += 16) {
        __mmask16 k = pd_tail_mask16(hi + 1 - j);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mn);
        __m512 p = _mm512_maskz_mov_ps(k, bf16 ? pd_round_bf16_512(pd_exp2f512(x)) : pd_expf512(x));
        sv = _mm512_add_ps(sv, p);
        if (bf16) { /* exact: p is a bf16 value, so its high half is it */
            _mm256_mask_storeu_epi16(pb + j, k,
                                     _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
        } else {
            _mm512_mask_storeu_ps(s + j, k, p);
        }
    }
    *l += _mm512_reduce_add_ps(sv);
    return 1;
}

SOFTMAX_512 static int softmax_row_f32_512(float *s, int nk, int lo, int hi, float *m, float *l, float *o,
                                           int D)
{
    return softmax_row_512(s, NULL, nk, lo, hi, m, l, o, D, 0);
}

SOFTMAX_512 static int softmax_row_bf16_512(float *s, uint16_t *pb, int nk, int lo, int hi, float *m,
                                            float *l, float *o, int D)
{
    return softmax_row_512(s, pb, nk, lo, hi, m, l, o, D, 1);
}

#endif

#if defined(__x86_64__) && defined(__GNUC__)
/* dst[d] = src[d] · f for d < n, then rounded to bf16 as pd_round_bf16f when round: the scalar
 * loops' values (a query row as attention_bf16.h prepares it, an output row / l), 16 at a time
 * (GCC 12 at -O2 leaves those loops scalar: 14-17 % of the item's own time in perf). */
SOFTMAX_512 static void scale_row_512(float *dst, const float *src, float f, int n, int round)
{
    const __m512 vf = _mm512_set1_ps(f);
    for (int d = 0; d < n; d += 16) {
        __mmask16 k = pd_tail_mask16(n - d);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, src + d), vf);
        if (round) {
            __m512i u = _mm512_castps_si512(v);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
            v = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
        }
        _mm512_mask_storeu_ps(dst + d, k, v);
    }
}
#endif

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

/* gather_kv for a bf16 cache, the rows copied as they are into kb and vb [ATTN_MM_KT][D]; rows
 * past nk are zero (their p̂ is 0, and 0 · 0 keeps the sums clean). */
static void gather_kv_bf16(uint16_t *kb, uint16_t *vb, const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
                           int seq, int kv_head, int64_t j0, int nk)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size;
    const uint16_t *base = kv->base;
    for (int j = 0; j < nk; j++) {
        int64_t key = j0 + j;
        int64_t block = pd_block_table_lookup(meta->block_tables, meta->max_blocks_per_seq, seq, key, bs);
        memcpy(kb + (size_t)j * D, base + pd_kv_index(block, 0, (int)(key % bs), kv_head, bs, H, D),
               (size_t)D * sizeof(uint16_t));
        memcpy(vb + (size_t)j * D, base + pd_kv_index(block, 1, (int)(key % bs), kv_head, bs, H, D),
               (size_t)D * sizeof(uint16_t));
    }
    memset(kb + (size_t)nk * D, 0, (size_t)(ATTN_MM_KT - nk) * D * sizeof(uint16_t));
    memset(vb + (size_t)nk * D, 0, (size_t)(ATTN_MM_KT - nk) * D * sizeof(uint16_t));
}

#if defined(__x86_64__) && defined(__GNUC__)
/* gather_kv_bf16 into the pair layouts of pd_cpu_amx_gemm_pairs's B operand: K for S = Q̂·K̂ᵀ, a sum
 * over d, as words kp[p·ATTN_MM_KT + j] = (K[j][2p], K[j][2p + 1]) — 16 keys × 16 words at a time
 * transposed in registers (transpose_x512.h); V for O += P̂·V̂, a sum over keys, as words vp[q·D + d] = (V[2q][d],
 * V[2q + 1][d]), two rows interleaved by permutes. Keys past nk are zero. D % 32 == 0. */
SOFTMAX_512 static void gather_kv_pairs(uint32_t *kp, uint32_t *vp, const pd_kv_view_t *kv,
                                        const pd_attn_meta_t *meta, int seq, int kv_head, int64_t j0, int nk)
{
    const int H = kv->num_kv_heads, D = kv->head_size, bs = kv->block_size;
    const uint16_t *base = kv->base;
    const uint16_t *krow[ATTN_MM_KT], *vrow[ATTN_MM_KT];
    for (int j = 0; j < ATTN_MM_KT; j++) {
        krow[j] = vrow[j] = NULL;
        if (j < nk) {
            int64_t key = j0 + j;
            int64_t block = pd_block_table_lookup(meta->block_tables, meta->max_blocks_per_seq, seq, key, bs);
            krow[j] = base + pd_kv_index(block, 0, (int)(key % bs), kv_head, bs, H, D);
            vrow[j] = base + pd_kv_index(block, 1, (int)(key % bs), kv_head, bs, H, D);
        }
    }
    for (int j = 0; j < ATTN_MM_KT; j += 16) {
        for (int p0 = 0; p0 < D / 2; p0 += 16) {
            __m512i t[16];
            for (int i = 0; i < 16; i++) { /* row i: key j + i, words p0 .. p0 + 16 */
                t[i] =
                    krow[j + i] != NULL ? _mm512_loadu_si512(krow[j + i] + 2 * p0) : _mm512_setzero_si512();
            }
            pd_transpose16_epi32(t);
            for (int c = 0; c < 16; c++) { /* row c: word p0 + c of keys j .. j + 16 */
                _mm512_storeu_si512(kp + (size_t)(p0 + c) * ATTN_MM_KT + j, t[c]);
            }
        }
    }
    int16_t i0[32], i1[32];
    for (int i = 0; i < 16; i++) {
        i0[2 * i] = (int16_t)i, i0[2 * i + 1] = (int16_t)(32 + i);
        i1[2 * i] = (int16_t)(16 + i), i1[2 * i + 1] = (int16_t)(48 + i);
    }
    const __m512i v_lo = _mm512_loadu_si512(i0), v_hi = _mm512_loadu_si512(i1);
    for (int j = 0; j < ATTN_MM_KT; j += 2) {
        uint32_t *out = vp + (size_t)(j / 2) * D;
        for (int d = 0; d < D; d += 32) {
            __m512i a = vrow[j] != NULL ? _mm512_loadu_si512(vrow[j] + d) : _mm512_setzero_si512();
            __m512i b = vrow[j + 1] != NULL ? _mm512_loadu_si512(vrow[j + 1] + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(a, v_lo, b));
            _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(a, v_hi, b));
        }
    }
}
#endif

static int mm_serves_amx(int bf16, int head_size) /* the tiles themselves: the entry's level */
{
    return bf16 && head_size % 32 == 0;
}

static int mm_serves_dnnl(int bf16, int head_size)
{
    (void)head_size;
    return bf16 && pd_cpu_dnnl_bf16_native();
}

static int mm_serves_any(int bf16, int head_size)
{
    (void)bf16, (void)head_size;
    return 1;
}

const pd_cpu_attn_mm_variant_t pd_cpu_attn_mm_variants[] = {
    {"amx", PD_ISA_AMX, PD_ATTN_MM_AMX, mm_serves_amx,
     "bf16 math, head size % 32: both products on AMX tiles"},
    {"onednn_bf16", PD_ISA_AVX512_BF16, PD_ATTN_MM_DNNL_BF16, mm_serves_dnnl,
     "bf16 math: oneDNN bf16 GEMMs (the CPU's native bf16)"},
    {"sgemm", PD_ISA_PORTABLE, PD_ATTN_MM_SGEMM, mm_serves_any, "any call: OpenBLAS sgemm on fp32 copies"},
};
const int pd_cpu_num_attn_mm_variants =
    (int)(sizeof(pd_cpu_attn_mm_variants) / sizeof(pd_cpu_attn_mm_variants[0]));

static int g_force_mm = -1;

void pd_cpu_attn_mm_force(int variant)
{
    g_force_mm = variant;
}

const pd_cpu_attn_mm_variant_t *pd_cpu_attn_mm_choose(int bf16, int head_size)
{
    if (g_force_mm >= 0 && g_force_mm < pd_cpu_num_attn_mm_variants) {
        return &pd_cpu_attn_mm_variants[g_force_mm];
    }
    for (int i = 0; i < pd_cpu_num_attn_mm_variants; i++) {
        const pd_cpu_attn_mm_variant_t *v = &pd_cpu_attn_mm_variants[i];
        if (pd_cpu_isa_usable(v->isa) && v->serves(bf16, head_size)) {
            return v;
        }
    }
    return &pd_cpu_attn_mm_variants[pd_cpu_num_attn_mm_variants - 1];
}

/* The top halves of n floats that are bf16 values already (no rounding left to do). */
static void take_bf16(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], 4);
        dst[i] = (uint16_t)(u >> 16);
    }
}

pd_status_t pd_cpu_attn_tiled_run(float *out, const float *q, const pd_kv_view_t *kv,
                                  const pd_attn_meta_t *meta, int num_heads, float scale, int bf16, int seq,
                                  int kv_head, int q_begin, int q_end, float *scratch)
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
    /* bf16 copies for oneDNN or AMX, on a 64-byte line past the fp32 area */
    const int M16 = (ATTN_MM_TQ * group + 15) & ~15; /* q̂ and p̂ rows in whole AMX tiles, the rest zero */
    uintptr_t b16_at = ((uintptr_t)(lt + (size_t)ATTN_MM_TQ * group) + 63) & ~(uintptr_t)63;
    uint16_t *qb = (uint16_t *)b16_at, *kb = qb + (size_t)M16 * D;
    uint16_t *vb = kb + (size_t)ATTN_MM_KT * D, *pb = vb + (size_t)ATTN_MM_KT * D;
    const pd_attn_mm_engine_t engine = pd_cpu_attn_mm_choose(bf16, D)->engine;
    const int amx = engine == PD_ATTN_MM_AMX;               /* both products on AMX tiles */
    const int dnnl = amx || engine == PD_ATTN_MM_DNNL_BF16; /* the bf16 copies, for oneDNN or AMX */
    const bool full = T == ATTN_MM_TQ; /* oneDNN primitives made for full items' M rows, kept per thread */
#if defined(__x86_64__) && defined(__GNUC__)
    const int avx512 = pd_cpu_avx512_usable();
#endif

    /* Q rows (token-major, heads of the group within): row (t − q_begin)·group + r, × scale */
    for (int t = q_begin; t < q_end; t++) {
        for (int r = 0; r < group; r++) {
            const float *src = q + ((size_t)(q0 + t) * num_heads + kv_head * group + r) * D;
            float *dst = qt + ((size_t)(t - q_begin) * group + r) * D;
#if defined(__x86_64__) && defined(__GNUC__)
            if (avx512) {
                scale_row_512(dst, src, bf16 ? scale * PD_LOG2E : scale, D, bf16);
            } else
#endif
                if (bf16) {
                pd_attn_bf16_query(dst, src, scale, D);
            } else {
                for (int d = 0; d < D; d++) {
                    dst[d] = src[d] * scale;
                }
            }
            mt[(t - q_begin) * group + r] = -INFINITY;
            lt[(t - q_begin) * group + r] = 0;
        }
    }
    memset(ot, 0, (size_t)M * D * sizeof(float));
    if (dnnl) {
        take_bf16(qb, qt, (size_t)M * D);
        memset(qb + (size_t)M * D, 0, (size_t)(M16 - M) * D * sizeof(uint16_t));
        memset(pb + (size_t)M * ATTN_MM_KT, 0, (size_t)(M16 - M) * ATTN_MM_KT * sizeof(uint16_t));
    }
    int64_t pos_lo = pd_query_pos(seq_len, q_len, q_begin);
    int64_t pos_hi = pd_query_pos(seq_len, q_len, q_end - 1);
    int64_t key_lo = pd_attn_first_key(pos_lo, meta->sliding_window);
    for (int64_t j0 = key_lo; j0 <= pos_hi; j0 += ATTN_MM_KT) {
        int nk = pos_hi - j0 + 1 < ATTN_MM_KT ? (int)(pos_hi - j0 + 1) : ATTN_MM_KT;
        int ld = dnnl ? ATTN_MM_KT : nk; /* S's row pitch: oneDNN's tiles are padded */
        if (amx) {                       /* S[M][KT] = Q̂ · K̂ᵀ */
#if defined(__x86_64__) && defined(__GNUC__)
            gather_kv_pairs((uint32_t *)kb, (uint32_t *)vb, kv, meta, seq, kv_head, j0, nk);
#endif
            pd_cpu_amx_gemm_pairs(st, ATTN_MM_KT, qb, D, (const uint32_t *)kb, ATTN_MM_KT, M, ATTN_MM_KT, D,
                                  0);
        } else if (dnnl) { /* S[M][KT] = Q̂ · K̂ᵀ */
            gather_kv_bf16(kb, vb, kv, meta, seq, kv_head, j0, nk);
            pd_status_t gs = pd_cpu_dnnl_gemm_bf16_1t(st, qb, kb, M, ATTN_MM_KT, D, true, false, full);
            if (gs != PD_OK) {
                return gs;
            }
        } else { /* S[M][nk] = Q · Kᵀ */
            gather_kv(kt, vt, kv, meta, seq, kv_head, j0, nk);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, nk, D, 1.0f, qt, D, kt, D, 0.0f, st, nk);
        }
        int any = 0;
        for (int t = q_begin; t < q_end; t++) {
            int64_t pos = pd_query_pos(seq_len, q_len, t);
            int64_t first = pd_attn_first_key(pos, meta->sliding_window);
            int lo = first > j0 ? (int)(first - j0) : 0;
            int hi = pos - j0 < nk - 1 ? (int)(pos - j0) : nk - 1; /* may be < lo: row sees nothing */
            for (int r = 0; r < group; r++) {
                int row = (t - q_begin) * group + r;
                float *srow = st + (size_t)row * ld, *orow = ot + (size_t)row * D;
                uint16_t *prow = dnnl ? pb + (size_t)row * ATTN_MM_KT : NULL;
#if defined(__x86_64__) && defined(__GNUC__)
                if (dnnl) {
                    any |= softmax_row_bf16_512(srow, prow, ld, lo, hi, &mt[row], &lt[row], orow, D);
                    continue;
                }
                if (!bf16 && avx512) {
                    any |= softmax_row_f32_512(srow, ld, lo, hi, &mt[row], &lt[row], orow, D);
                    continue;
                }
#endif
                any |= bf16 ? softmax_row_bf16(srow, prow, ld, lo, hi, &mt[row], &lt[row], orow, D)
                            : softmax_row(srow, ld, lo, hi, &mt[row], &lt[row], orow, D);
            }
        }
        if (any && amx) { /* O[M][D] += P̂ · V̂ */
            pd_cpu_amx_gemm_pairs(ot, D, pb, ATTN_MM_KT, (const uint32_t *)vb, D, M, D, ATTN_MM_KT, 1);
        } else if (any && dnnl) { /* O[M][D] += P̂ · V̂ */
            pd_status_t gs = pd_cpu_dnnl_gemm_bf16_1t(ot, pb, vb, M, D, ATTN_MM_KT, false, true, full);
            if (gs != PD_OK) {
                return gs;
            }
        } else if (any) { /* O[M][D] += P · V */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, D, nk, 1.0f, st, nk, vt, D, 1.0f, ot,
                        D);
        }
    }
    for (int t = q_begin; t < q_end; t++) {
        for (int r = 0; r < group; r++) {
            int row = (t - q_begin) * group + r;
            float inv = lt[row] > 0 ? 1.0f / lt[row] : 0.0f;
            float *o = out + ((size_t)(q0 + t) * num_heads + kv_head * group + r) * D;
#if defined(__x86_64__) && defined(__GNUC__)
            if (avx512) {
                scale_row_512(o, ot + (size_t)row * D, inv, D, 0);
                continue;
            }
#endif
            for (int d = 0; d < D; d++) {
                o[d] = ot[(size_t)row * D + d] * inv;
            }
        }
    }
    return PD_OK;
}
