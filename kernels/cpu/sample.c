/* kernels/cpu/sample.c — token sampling: greedy, temperature, top-k, top-p, seeded.
 *
 * Semantics (shared by every backend so seeded runs agree):
 *   temperature < 1e-5 → argmax (lowest id on ties), no random draw.
 *   otherwise: z = logits / T; order tokens by (z desc, id asc); keep the first top_k (if > 0),
 *   and of those only tokens with expf(z − z_max) >= min_p (vLLM's min_p: p >= min_p · p_max);
 *   p = softmax over the kept set (max-subtracted, summed in that order); keep the shortest
 *   prefix whose mass before each token is < top_p; renormalise; draw u ∈ [0,1) once from the
 *   sequence's generator and walk the kept tokens in ascending id order until the cumulative
 *   mass exceeds u·total. */
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/sample.h"

typedef pd_sample_cand_t cand_t;

/* (z desc, id asc) */
static int cand_cmp(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->z != y->z) {
        return x->z > y->z ? -1 : 1;
    }
    return x->id < y->id ? -1 : (x->id > y->id);
}

static int cand_id_cmp(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* The specialisations of the two sorts (tested against cand_cmp / cand_id_cmp's qsort in
 * test_kernels): stable LSD radix sorts in O(n) instead of O(n log n) comparisons, 20 ms a sampled
 * token at a 128 k vocabulary. Both orders are total (ties by the unique id), so the result is the
 * qsort's exactly. */

/* A key whose ascending order is (z desc): the float's bits made monotonic, then reversed; -0 as +0
 * (cand_cmp finds them equal, so their order must fall to the id). */
static inline uint32_t desc_key(float z)
{
    uint32_t u;
    z = z == 0.0f ? 0.0f : z;
    memcpy(&u, &z, sizeof(u));
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

/* One stable counting pass of src[n] into dst[n] by 8 bits of the key at shift; false (nothing
 * moved) when every entry has the same digit. */
static bool radix_pass(const cand_t *src, cand_t *dst, int n, int shift, bool by_id)
{
    uint32_t count[257] = {0};
    for (int i = 0; i < n; i++) {
        uint32_t k = by_id ? (uint32_t)src[i].id : desc_key(src[i].z);
        count[((k >> shift) & 255) + 1]++;
    }
    for (int b = 0; b < 256; b++) {
        if (count[b + 1] == (uint32_t)n) {
            return false;
        }
        count[b + 1] += count[b];
    }
    for (int i = 0; i < n; i++) {
        uint32_t k = by_id ? (uint32_t)src[i].id : desc_key(src[i].z);
        dst[count[(k >> shift) & 255]++] = src[i];
    }
    return true;
}

/* Sorts c[n] by (z desc, id asc) when by_id is false (c must then come in ascending id order: the
 * passes are stable, so ties keep it), by id when true; tmp has room for n. */
static void radix_sort(cand_t *c, cand_t *tmp, int n, bool by_id)
{
    cand_t *src = c, *dst = tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        if (radix_pass(src, dst, n, shift, by_id)) {
            cand_t *x = src;
            src = dst;
            dst = x;
        }
    }
    if (src != c) {
        memcpy(c, src, (size_t)n * sizeof(cand_t));
    }
}

/* The reference argmax: the first index whose value no later one exceeds (lowest id on ties;
 * NaN never wins, and a NaN at 0 stays). */
static int32_t argmax_row(const float *z, int vocab)
{
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++) {
        if (z[i] > z[best]) {
            best = i;
        }
    }
    return best;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SAMPLE_X512 __attribute__((target("avx512f")))

/* argmax_row with AVX-512, the same index: the row's maximum M over z[0] and every value greater
 * than it (a per-lane running max that only takes strictly greater, ordered values: NaN never),
 * then the first index holding a value equal to M. argmax_row's best moves only on a strict
 * increase, so it ends at that first index (−0 and +0 compare equal in both). */
SAMPLE_X512 static int32_t argmax_row_x512(const float *z, int vocab)
{
    if (z[0] != z[0]) {
        return 0; /* argmax_row: nothing compares greater than a NaN */
    }
    __m512 mv = _mm512_set1_ps(z[0]);
    for (int i = 0; i < vocab; i += 16) {
        __mmask16 lanes = pd_tail_mask16(vocab - i);
        __m512 v = _mm512_maskz_loadu_ps(lanes, z + i);
        mv = _mm512_mask_mov_ps(mv, _mm512_mask_cmp_ps_mask(lanes, v, mv, _CMP_GT_OQ), v);
    }
    __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv)); /* no NaN lane: each holds a value of z */
    for (int i = 0; i < vocab; i += 16) {
        __mmask16 lanes = pd_tail_mask16(vocab - i);
        __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, z + i), m, _CMP_EQ_OQ);
        if (hit != 0) {
            return i + __builtin_ctz(hit);
        }
    }
    return 0; /* not reached: M is one of the values */
}
#endif

/* The argmax's variant table (cpu_ops.h): vectorized where the CPU allows (a greedy row at a 128 K
 * vocabulary was ~0.3 ms of scalar compares, serial in every decode step); every entry returns
 * argmax_row's index. */
const pd_cpu_argmax_variant_t pd_cpu_argmax_variants[] = {
#if defined(__x86_64__) && defined(__GNUC__)
    {"x512", PD_ISA_AVX512, argmax_row_x512},
#endif
    {"portable", PD_ISA_PORTABLE, argmax_row},
};
const int pd_cpu_num_argmax_variants =
    (int)(sizeof(pd_cpu_argmax_variants) / sizeof(pd_cpu_argmax_variants[0]));

static int32_t argmax_fast(const float *z, int vocab)
{
    for (int i = 0;; i++) { /* the last entry is portable: usable everywhere */
        if (pd_cpu_isa_usable(pd_cpu_argmax_variants[i].isa)) {
            return pd_cpu_argmax_variants[i].run(z, vocab);
        }
    }
}

/* Given kept candidates c[n] sorted by (z desc, id asc): applies top-p and leaves the distribution
 * in c[0, keep) in ascending id order, c[].z replaced by the unnormalised probability; returns keep
 * and the mass in *total. */
/* tmp (room for n): the id sort as a radix sort; NULL: qsort (the reference). */
static int dist_from_sorted(cand_t *c, int n, float top_p, double *total, cand_t *tmp)
{
    float zmax = c[0].z;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        c[i].z = expf(c[i].z - zmax);
        sum += c[i].z;
    }
    int keep = n;
    if (top_p < 1.0f) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            if (cum >= (double)top_p * sum) {
                keep = i;
                break;
            }
            cum += c[i].z;
        }
        if (keep < 1) {
            keep = 1;
        }
    }
    if (tmp != NULL && keep > 256) {
        radix_sort(c, tmp, keep, true);
    } else {
        qsort(c, (size_t)keep, sizeof(cand_t), cand_id_cmp);
    }
    double t = 0;
    for (int i = 0; i < keep; i++) {
        t += c[i].z;
    }
    *total = t;
    return keep;
}

int32_t pd_sample_draw(const pd_sample_cand_t *c, int n, double total, double u)
{
    double target = u * total;
    double cum = 0;
    for (int i = 0; i < n; i++) {
        cum += c[i].z;
        if (cum > target) {
            return c[i].id;
        }
    }
    return c[n - 1].id;
}

static int32_t draw_from_sorted(cand_t *c, int n, float top_p, pd_rng_t *rng)
{
    double total;
    int keep = dist_from_sorted(c, n, top_p, &total, NULL);
    return pd_sample_draw(c, keep, total, pd_rng_uniform(rng));
}

/* Of the n candidates sorted by (z desc, id asc), how many pass min_p (at least the best one). */
static int min_p_keep(const cand_t *c, int n, float min_p)
{
    if (!(min_p > 0)) {
        return n;
    }
    int k = 1;
    while (k < n && expf(c[k].z - c[0].z) >= min_p) {
        k++;
    }
    return k;
}

static pd_status_t sample_check(const pd_sampling_params_t *p, int row)
{
    if (!(p->temperature >= 0) || !(p->top_p > 0) || isnan(p->top_p) || isnan(p->min_p) || p->min_p > 1) {
        pd_log_error("sample: row %d has invalid parameters (temperature %g, top_p %g)", row, p->temperature,
                     p->top_p);
        return PD_ERR_INVALID_ARG;
    }
    return PD_OK;
}

pd_status_t pd_cpu_sample_ref(pd_backend_t *be, int32_t *tokens_out, float *logits, int n, int vocab,
                              const pd_sampling_params_t *params, pd_rng_t *rngs)
{
    cand_t *c = malloc((size_t)vocab * sizeof(cand_t));
    if (c == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    for (int r = 0; r < n; r++) {
        const pd_sampling_params_t *p = &params[r];
        pd_status_t st = sample_check(p, r);
        if (st != PD_OK) {
            free(c);
            return st;
        }
        float *z = logits + (size_t)r * vocab;
        if (p->temperature < PD_SAMPLING_EPS) {
            tokens_out[r] = argmax_row(z, vocab);
            continue;
        }
        for (int i = 0; i < vocab; i++) {
            c[i].z = z[i] / p->temperature;
            c[i].id = i;
        }
        qsort(c, (size_t)vocab, sizeof(cand_t), cand_cmp);
        int kept = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
        kept = min_p_keep(c, kept, p->min_p);
        tokens_out[r] = draw_from_sorted(c, kept, p->top_p, &rngs[r]);
    }
    free(c);
    return PD_OK;
}

/* Min-heap on cand_cmp order (the root is the "smallest" = worst kept candidate). */
static int cand_worse(const cand_t *a, const cand_t *b)
{
    return cand_cmp(a, b) > 0;
}

static void heap_sift_down(cand_t *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && cand_worse(&h[l], &h[w])) {
            w = l;
        }
        if (r < n && cand_worse(&h[r], &h[w])) {
            w = r;
        }
        if (w == i) {
            return;
        }
        cand_t t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

int pd_sample_dist(const float *z, int vocab, const pd_sampling_params_t *p, pd_sample_cand_t *c,
                   double *total)
{
    float temp = p->temperature;
    int k = p->top_k > 0 && p->top_k < vocab ? p->top_k : vocab;
    cand_t *tmp = NULL;
    if (k == vocab && !(p->min_p > 0) && !(p->top_p < 1.0f)) {
        /* nothing is cut, so the sort is moot: the reference's two sorts (by (z desc, id asc), then by
         * id) leave every token's probability expf(z / t - max) and the id-order sum exactly as here,
         * without two O(V log V) sorts of the vocabulary (46 ms a token at 128 k) */
        float zmax = -INFINITY;
        for (int i = 0; i < vocab; i++) {
            c[i].z = z[i] / temp;
            c[i].id = i;
            zmax = c[i].z > zmax ? c[i].z : zmax;
        }
        double t = 0;
        for (int i = 0; i < vocab; i++) {
            c[i].z = expf(c[i].z - zmax);
            t += c[i].z;
        }
        *total = t;
        return vocab;
    }
    if (k < vocab) { /* the top-k with a heap (O(V log k)) instead of sorting the vocabulary */
        for (int i = 0; i < k; i++) {
            c[i].z = z[i] / temp;
            c[i].id = i;
        }
        for (int i = k / 2 - 1; i >= 0; i--) {
            heap_sift_down(c, k, i);
        }
        for (int i = k; i < vocab; i++) {
            cand_t x = {z[i] / temp, i};
            if (cand_worse(&c[0], &x)) {
                c[0] = x;
                heap_sift_down(c, k, 0);
            }
        }
        qsort(c, (size_t)k, sizeof(cand_t), cand_cmp);
    } else {
        for (int i = 0; i < vocab; i++) {
            c[i].z = z[i] / temp;
            c[i].id = i;
        }
        /* the (z desc, id asc) order fixes the summation order, so it is part of the
         * contract: the whole vocabulary in the reference's order */
        tmp = malloc((size_t)vocab * sizeof(cand_t));
        if (tmp != NULL) {
            /* tokens at -inf (a grammar's mask) sort last, in id order, and carry no mass: with
             * something cut (top_p < 1 or min_p) none is kept, so only the others are sorted */
            int nf = 0, ni = 0;
            for (int i = 0; i < vocab; i++) {
                if (c[i].z == -INFINITY) {
                    tmp[ni++] = c[i];
                } else {
                    c[nf++] = c[i];
                }
            }
            memcpy(c + nf, tmp, (size_t)ni * sizeof(cand_t));
            radix_sort(c, tmp, nf, false);
        } else {
            qsort(c, (size_t)vocab, sizeof(cand_t), cand_cmp);
        }
    }
    int n = dist_from_sorted(c, min_p_keep(c, k, p->min_p), p->top_p, total, tmp);
    free(tmp);
    return n;
}

int32_t pd_sample_argmax(const float *z, int vocab)
{
    return argmax_fast(z, vocab);
}

/* Same result as the reference, through pd_sample_dist. Rows are independent (each draws from its
 * own generator), so they are split over the backend's threads, each with its own candidates;
 * every row's parameters are checked first, and nothing is sampled when one is invalid. */
pd_status_t pd_cpu_sample(pd_backend_t *be, int32_t *tokens_out, float *logits, int n, int vocab,
                          const pd_sampling_params_t *params, pd_rng_t *rngs)
{
    bool any_random = false;
    for (int r = 0; r < n; r++) {
        pd_status_t st = sample_check(&params[r], r);
        if (st != PD_OK) {
            return st;
        }
        any_random |= params[r].temperature >= PD_SAMPLING_EPS;
    }
    int nt = n < be->num_threads ? n : be->num_threads;
    nt = nt < 1 ? 1 : nt;
    cand_t *c = NULL;
    if (any_random) {
        c = malloc((size_t)nt * (size_t)vocab * sizeof(cand_t));
        if (c == NULL) {
            pd_log_error("sample: cannot allocate %d x %d candidates", nt, vocab);
            return PD_ERR_NO_MEMORY;
        }
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (int r = 0; r < n; r++) {
        const pd_sampling_params_t *p = &params[r];
        float *z = logits + (size_t)r * vocab;
        if (p->temperature < PD_SAMPLING_EPS) {
            tokens_out[r] = argmax_fast(z, vocab);
            continue;
        }
        cand_t *mine = c + (size_t)omp_get_thread_num() * vocab;
        double total;
        int kept = pd_sample_dist(z, vocab, p, mine, &total);
        tokens_out[r] = pd_sample_draw(mine, kept, total, pd_rng_uniform(&rngs[r]));
    }
    free(c);
    return PD_OK;
}
