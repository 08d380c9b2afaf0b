/* tests/unit/test_kernels.c — every optimized CPU op against its reference on random inputs
 * (never zeros), the shared index math, dtype conversions, and bad-index rejection. */
#include "test_util.h" /* first: it defines _GNU_SOURCE */

#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/backend.h"
#include "kernels/cpu/attention_decode.h"
#include "kernels/cpu/attention_prefill_tiled.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul_bf16.h"
#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/matmul_cols32.h"
#include "kernels/cpu/matmul_dnnl.h"
#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/matmul_variants.h"
#include "kernels/cpu/simd.h"
#include "kernels/paged_impl.h"
#include "kernels/sample.h"

static pd_backend_t *g_be;
static pd_rng_t g_rng;

static float *rand_buf(size_t n, float lo, float hi)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        p[i] = pd_rng_uniform_f(&g_rng, lo, hi);
        if (p[i] == 0.0f) {
            p[i] = 0.25f;
        }
    }
    return p;
}

static float *copy_buf(const float *src, size_t n)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    memcpy(p, src, n * sizeof(float));
    return p;
}

/* max |a−b| / (|b| + atol) over n elements */
static double max_rel_err(const float *a, const float *b, size_t n, double atol)
{
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]) / (fabs((double)b[i]) + atol);
        if (!(e <= worst)) {
            worst = e; /* NaN propagates as a failure */
        }
    }
    return worst;
}

static void setup(void)
{
    pd_rng_seed(&g_rng, 20261122);
    ck_assert_int_eq(pd_backend_create("cpu", 2, &g_be), PD_OK);
}

static void teardown(void)
{
    pd_backend_destroy(g_be);
}

/* ------------------------------------------------------------ dtype and index math */

START_TEST(test_dtype_conversions)
{
    /* every half value round-trips through f32 exactly; f32 → f16 matches the compiler's */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pd_f16_to_f32((uint16_t)h);
        _Float16 ref;
        uint16_t hh = (uint16_t)h;
        memcpy(&ref, &hh, 2);
        if (isnan(f)) {
            ck_assert(isnan((float)ref));
            continue;
        }
        ck_assert_float_eq(f, (float)ref);
        ck_assert_uint_eq(pd_f32_to_f16(f), h);
    }
    for (int i = 0; i < 200000; i++) {
        float f = (float)(pd_rng_normal(&g_rng) * pow(2.0, (double)pd_rng_below(&g_rng, 60) - 40));
        _Float16 ref = (_Float16)f;
        uint16_t rb;
        memcpy(&rb, &ref, 2);
        ck_assert_uint_eq(pd_f32_to_f16(f), rb);
        /* bf16: within half an ulp of 8 mantissa bits */
        float b = pd_bf16_to_f32(pd_f32_to_bf16(f));
        ck_assert(fabsf(b - f) <= fabsf(f) * (1.0f / 256));
    }
    ck_assert_uint_eq(pd_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(pd_f32_to_f16(65520.0f), 0x7c00);
    ck_assert_uint_eq(pd_f32_to_f16(-2.0f), 0xc000);
}
END_TEST

START_TEST(test_index_math)
{
    /* block_size 16, 2 kv heads, head 8: page = 2·16·2·8 elements */
    ck_assert_int_eq(pd_page_elems(16, 2, 8), 512);
    ck_assert_int_eq(pd_slot_block(37, 16), 2);
    ck_assert_int_eq(pd_slot_offset_in_block(37, 16), 5);
    /* slot 37 → block 2, offset 5; V plane; head 1 */
    ck_assert_int_eq(pd_slot_kv_index(37, 1, 1, 16, 2, 8), ((2 * 2 + 1) * 16 + 5) * 2 * 8 + 1 * 8);
    ck_assert_int_eq(pd_kv_index(3, 0, 0, 0, 16, 2, 8), 3 * 512);
    /* GQA: 8 query heads on 2 kv heads */
    ck_assert_int_eq(pd_gqa_kv_head(0, 8, 2), 0);
    ck_assert_int_eq(pd_gqa_kv_head(3, 8, 2), 0);
    ck_assert_int_eq(pd_gqa_kv_head(4, 8, 2), 1);
    ck_assert_int_eq(pd_gqa_kv_head(7, 8, 8), 7);
    int32_t table[2][4] = {{7, 3, 9, 1}, {2, 5, 0, 0}};
    ck_assert_int_eq(pd_block_table_lookup(&table[0][0], 4, 0, 33, 16), 9);
    ck_assert_int_eq(pd_block_table_slot(&table[0][0], 4, 1, 17, 16), 5 * 16 + 1);
    ck_assert_int_eq(pd_blocks_for_tokens(0, 16), 0);
    ck_assert_int_eq(pd_blocks_for_tokens(16, 16), 1);
    ck_assert_int_eq(pd_blocks_for_tokens(17, 16), 2);
    ck_assert_int_eq(pd_query_pos(10, 3, 0), 7);
    ck_assert_int_eq(pd_attn_first_key(10, 0), 0);
    ck_assert_int_eq(pd_attn_first_key(10, 4), 7);
    ck_assert_int_eq(pd_attn_first_key(2, 4), 0);
}
END_TEST

/* ------------------------------------------------------------ dense ops */

/* w[n] of fp32 values stored as dt (a fresh buffer; the fp32 values are rounded in place to what
 * dt holds, so the reference sees the same weights). */
static void *store_as(float *w, size_t n, pd_dtype_t dt)
{
    void *out = malloc(n * (size_t)pd_dtype_size(dt));
    for (size_t i = 0; i < n; i++) {
        pd_dtype_store(out, (int64_t)i, dt, w[i]);
        w[i] = pd_dtype_load(out, (int64_t)i, dt);
    }
    return out;
}

/* w[rows][cols] quantized to int8 with a symmetric scale per row (*scale_out, fresh); w is replaced
 * by the values the int8 weight stands for. */
static int8_t *quantize_rows(float *w, int rows, int cols, float **scale_out)
{
    int8_t *q = malloc((size_t)rows * cols);
    float *sc = malloc((size_t)rows * sizeof(float));
    for (int r = 0; r < rows; r++) {
        float mx = 0;
        for (int c = 0; c < cols; c++) {
            mx = fabsf(w[(size_t)r * cols + c]) > mx ? fabsf(w[(size_t)r * cols + c]) : mx;
        }
        sc[r] = mx > 0 ? mx / 127.0f : 1.0f;
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            pd_dtype_store(q, (int64_t)i, PD_DTYPE_I8, w[i] / sc[r]);
            w[i] = (float)q[i] * sc[r];
        }
    }
    *scale_out = sc;
    return q;
}

/* Every path of the optimized matmul (sgemv, sgemm; 16-bit and int8 weights: the
 * register-widening GEMV at m <= PD_LOWP_GEMV_MAX_M in pairs and singles of x rows, blocks of 4 and
 * leftover w rows, k tails; widened tiles + sgemm above it, several tiles per thread) against the
 * reference, and the reference against the same weights given as fp32. */
START_TEST(test_matmul)
{
    int shapes[][3] = {{1, 7, 5},    {3, 64, 33},  {17, 129, 64},   {64, 96, 200}, {1, 1000, 64},
                       {2, 130, 72}, {4, 37, 512}, {5, 40, 9000},   {8, 600, 64},  {1, 1, 3},
                       {7, 21, 40},  {9, 300, 48}, {260, 2100, 16}, {1, 9, 80},    {10, 130, 1000},
                       {11, 40, 64}, {16, 50, 70}, {32, 97, 1000},  {33, 40, 33},  {65, 30, 64}};
    pd_dtype_t dts[] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_F16, PD_DTYPE_I8};
    for (size_t d = 0; d < 4; d++) {
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            float *x = rand_buf((size_t)m * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
            float *scale = NULL;
            void *ws = dts[d] == PD_DTYPE_I8 ? (void *)quantize_rows(w, n, k, &scale)
                                             : store_as(w, (size_t)n * k, dts[d]);
            pd_weight_t wt = {ws, dts[d], scale, PD_WEIGHT_ROWS, 0},
                        wf = {w, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0};
            float *bias = rand_buf((size_t)n, -1, 1);
            float *y = rand_buf((size_t)m * n, -9, 9), *yr = rand_buf((size_t)m * n, -9, 9);
            float *yf = rand_buf((size_t)m * n, -9, 9);
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                const float *b = with_bias ? bias : NULL;
                ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, wt, b, m, n, k), PD_OK);
                ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, wt, b, m, n, k), PD_OK);
                /* error relative to the magnitude of a k-term dot product of values in [-1, 1] */
                ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-5, "dtype %d, %dx%dx%d",
                              (int)dts[d], m, n, k);
                /* the same weights widened to fp32 beforehand give the same products */
                ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yf, x, wf, b, m, n, k), PD_OK);
                ck_assert_msg(max_rel_err(yf, yr, (size_t)m * n, sqrt(k)) < 1e-6, "dtype %d, %dx%dx%d",
                              (int)dts[d], m, n, k);
            }
            free(x), free(w), free(ws), free(scale), free(bias), free(y), free(yr), free(yf);
        }
    }
}
END_TEST

/* The matmul's variant table (kernels/cpu/matmul_variants.h): every entry the host (and PD_CPU_ISA)
 * can run, on every case below it serves, against the reference (bf16 math: the reference on x
 * rounded to bf16) and against the entry pd_cpu_matmul picks for the same call. An entry the host
 * can run that no case serves fails (a variant this test never ran would pass unseen); the ones it
 * cannot run are printed by name, with the level they need. */
typedef struct mv_case {
    pd_dtype_t dt;
    bool bf16_math, pack;
    int n, k;
    int ms[12];
} mv_case_t;

static const mv_case_t mv_cases[] = {
    /* 100 rows: 3 blocks of 32 and 4 row-major rows past them; k whole blocks of 32 (bf16 math) */
    {PD_DTYPE_F32, false, false, 100, 96, {1, 2, 7, 33, 64, 65, 130}},
    {PD_DTYPE_F32, false, true, 100, 96, {1, 2, 33, 64, 65, 130}},
    {PD_DTYPE_BF16, false, false, 100, 96, {1, 2, 7, 10, 33, 64, 65, 130}},
    {PD_DTYPE_BF16, false, true, 100, 96, {1, 2, 33, 64, 65, 130}},
    {PD_DTYPE_BF16, false, true, 96, 64, {31, 32, 64, 65, 130}}, /* whole AMX blocks */
    {PD_DTYPE_F16, false, false, 100, 96, {1, 3, 8, 9, 65}},
    {PD_DTYPE_I8, false, false, 100, 96, {1, 3, 8, 9, 65}},
    {PD_DTYPE_I8, false, true, 96, 64, {1, 3, 64, 65, 130}},
    {PD_DTYPE_BF16, true, false, 100, 96, {1, 2, 16, 17, 32, 33, 130}},
    {PD_DTYPE_BF16, true, true, 100, 96, {1, 16, 17, 32, 33, 130}},
    {PD_DTYPE_BF16, true, true, 96, 64, {1, 16, 17, 32, 33, 130}},
    {PD_DTYPE_BF16, false, false, 2048, 2048, {24}}, /* >= 4 M weights: oneDNN on AMX */
};

START_TEST(test_matmul_variants)
{
    const mv_case_t *cases = mv_cases;
    int ran[64] = {0};
    ck_assert_int_le(pd_cpu_num_matmul_variants, 64);
    for (size_t c = 0; c < sizeof(mv_cases) / sizeof(mv_cases[0]); c++) {
        const mv_case_t *cs = &cases[c];
        int n = cs->n, k = cs->k, M = 0;
        for (int i = 0; i < 12 && cs->ms[i] > 0; i++) {
            M = cs->ms[i] > M ? cs->ms[i] : M;
        }
        float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *xr = copy_buf(x, (size_t)M * k);
        if (cs->bf16_math) {
            free(store_as(xr, (size_t)M * k, PD_DTYPE_BF16)); /* what bf16 math multiplies */
        }
        float *scale = NULL;
        void *ws = cs->dt == PD_DTYPE_I8 ? (void *)quantize_rows(w, n, k, &scale)
                                         : store_as(w, (size_t)n * k, cs->dt);
        size_t bytes = (size_t)n * k * (size_t)pd_dtype_size(cs->dt);
        void *wp = malloc(bytes);
        memcpy(wp, ws, bytes);
        pd_weight_t rows = {ws, cs->dt, scale, PD_WEIGHT_ROWS, 0},
                    wt = {wp, cs->dt, scale, PD_WEIGHT_ROWS, 0};
        g_be->matmul_precision = cs->bf16_math ? PD_MATMUL_BF16 : PD_MATMUL_FP32;
        if (cs->pack) {
            ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &wt, n, k, 0), PD_OK);
        }
        float *bias = rand_buf((size_t)n, -1, 1), *yr = malloc((size_t)M * n * sizeof(float));
        float *yd = malloc((size_t)M * n * sizeof(float)), *y = malloc((size_t)M * n * sizeof(float));
        for (int i = 0; i < 12 && cs->ms[i] > 0; i++) {
            int m = cs->ms[i];
            const float *b = i % 2 ? bias : NULL;
            ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, xr, rows, b, m, n, k), PD_OK);
            const pd_cpu_matmul_variant_t *chosen = pd_cpu_matmul_choose(g_be, &wt, m, n, k);
            ck_assert_ptr_nonnull(chosen);
            ck_assert_int_eq(pd_cpu_matmul(g_be, yd, x, wt, b, m, n, k), PD_OK);
            for (int v = 0; v < pd_cpu_num_matmul_variants; v++) {
                const pd_cpu_matmul_variant_t *var = &pd_cpu_matmul_variants[v];
                bool bf16_math = cs->bf16_math && cs->dt == PD_DTYPE_BF16;
                if (var->bf16_math != bf16_math || !pd_cpu_matmul_variant_usable(var) ||
                    !var->serves(g_be, &wt, m, n, k)) {
                    continue;
                }
                for (size_t e = 0; e < (size_t)m * n; e++) {
                    y[e] = NAN; /* every output written */
                }
                ck_assert_int_eq(var->run(g_be, y, x, wt, b, m, n, k), PD_OK);
                ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-5,
                              "%s: dtype %d%s%s, %dx%dx%d vs the reference", var->name, (int)cs->dt,
                              cs->bf16_math ? ", bf16 math" : "",
                              wt.layout != PD_WEIGHT_ROWS ? ", blocked" : "", m, n, k);
                ck_assert_msg(max_rel_err(y, yd, (size_t)m * n, sqrt(k)) < 1e-5,
                              "%s vs %s (the choice): %dx%dx%d", var->name, chosen->name, m, n, k);
                ran[v]++;
            }
        }
        g_be->matmul_precision = PD_MATMUL_FP32;
        free(x), free(xr), free(w), free(ws), free(wp), free(scale), free(bias), free(yr), free(yd), free(y);
    }
    for (int v = 0; v < pd_cpu_num_matmul_variants; v++) {
        const pd_cpu_matmul_variant_t *var = &pd_cpu_matmul_variants[v];
        if (!pd_cpu_matmul_variant_usable(var)) {
            printf("matmul variant %-15s not run: needs %s%s (kernels here run at %s)\n", var->name,
                   pd_cpu_isa_name(var->isa), var->needs != NULL ? " and oneDNN's own support" : "",
                   pd_cpu_isa_name(pd_cpu_isa_level()));
            continue;
        }
        printf("matmul variant %-15s ran on %d shapes\n", var->name, ran[v]);
        ck_assert_msg(ran[v] > 0, "matmul variant %s can run here but no case served it", var->name);
    }
}
END_TEST

/* --batch-invariant (vLLM's VLLM_BATCH_INVARIANT): every entry that promises inv_rows gives each of up
 * to inv_rows rows bitwise what it gives that row alone, and pd_cpu_matmul in the mode gives every row
 * of any batch (1-300 rows, chunked) the bits of the row alone, on every case of the table's test,
 * fp32 and bf16 math, at the levels the host runs. */
START_TEST(test_matmul_row_invariant)
{
    const int ms[] = {2, 3, 7, 8, 10, 33, 64, 65, 130, 300};
    int ran[64] = {0};
    g_be->batch_invariant = true;
    for (size_t c = 0; c < sizeof(mv_cases) / sizeof(mv_cases[0]); c++) {
        const mv_case_t *cs = &mv_cases[c];
        int n = cs->n, k = cs->k, M = 300;
        float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *scale = NULL;
        void *wp = cs->dt == PD_DTYPE_I8 ? (void *)quantize_rows(w, n, k, &scale)
                                         : store_as(w, (size_t)n * k, cs->dt);
        pd_weight_t wt = {wp, cs->dt, scale, PD_WEIGHT_ROWS, 0};
        g_be->matmul_precision = cs->bf16_math ? PD_MATMUL_BF16 : PD_MATMUL_FP32;
        if (cs->pack) {
            ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &wt, n, k, 0), PD_OK);
        }
        bool bf16_math = cs->bf16_math && cs->dt == PD_DTYPE_BF16;
        float *bias = rand_buf((size_t)n, -1, 1), *alone = malloc((size_t)M * n * sizeof(float));
        float *y = malloc((size_t)M * n * sizeof(float));
        for (int v = -1; v < pd_cpu_num_matmul_variants; v++) { /* -1: pd_cpu_matmul, the mode's choice */
            const pd_cpu_matmul_variant_t *var = v < 0 ? NULL : &pd_cpu_matmul_variants[v];
            if (var != NULL && (var->bf16_math != bf16_math || var->inv_rows == 0 ||
                                !pd_cpu_matmul_variant_usable(var) || !var->serves(g_be, &wt, 1, n, k))) {
                continue;
            }
            for (int i = 0; i < M; i++) { /* each row alone */
                ck_assert_int_eq(
                    var != NULL
                        ? var->run(g_be, alone + (size_t)i * n, x + (size_t)i * k, wt, bias, 1, n, k)
                        : pd_cpu_matmul(g_be, alone + (size_t)i * n, x + (size_t)i * k, wt, bias, 1, n, k),
                    PD_OK);
            }
            for (size_t t = 0; t < sizeof(ms) / sizeof(ms[0]); t++) {
                int m = ms[t], off = (int)(t * 7) % (M - m + 1); /* a batch starting anywhere */
                if (var != NULL && (m > var->inv_rows || !var->serves(g_be, &wt, m, n, k))) {
                    continue;
                }
                for (size_t e = 0; e < (size_t)m * n; e++) {
                    y[e] = NAN;
                }
                const float *xm = x + (size_t)off * k;
                ck_assert_int_eq(var != NULL ? var->run(g_be, y, xm, wt, bias, m, n, k)
                                             : pd_cpu_matmul(g_be, y, xm, wt, bias, m, n, k),
                                 PD_OK);
                for (int i = 0; i < m; i++) {
                    ck_assert_msg(memcmp(y + (size_t)i * n, alone + (size_t)(off + i) * n,
                                         (size_t)n * sizeof(float)) == 0,
                                  "%s: row %d of %d differs from the row alone (dtype %d%s%s, n %d, k %d)",
                                  var != NULL ? var->name : "pd_cpu_matmul (batch-invariant)", i, m,
                                  (int)cs->dt, bf16_math ? ", bf16 math" : "",
                                  wt.layout != PD_WEIGHT_ROWS ? ", blocked" : "", n, k);
                }
                ran[v + 1]++;
            }
        }
        g_be->matmul_precision = PD_MATMUL_FP32;
        free(x), free(w), free(wp), free(scale), free(bias), free(alone), free(y);
    }
    g_be->batch_invariant = false;
    for (int v = 0; v < pd_cpu_num_matmul_variants; v++) {
        const pd_cpu_matmul_variant_t *var = &pd_cpu_matmul_variants[v];
        if (var->inv_rows > 0 && !pd_cpu_matmul_variant_usable(var)) {
            printf("matmul variant %-15s batch-invariant: not run (needs %s)\n", var->name,
                   pd_cpu_isa_name(var->isa));
        } else if (var->inv_rows > 0) {
            char rows[16];
            snprintf(rows, sizeof(rows), var->inv_rows == PD_INV_ROWS_ANY ? "any" : "%d", var->inv_rows);
            printf("matmul variant %-15s batch-invariant up to %s rows: checked on %d batches%s\n", var->name,
                   rows, ran[v + 1], var->inv_rows == 1 ? " (one row a call: pd_cpu_matmul's rows)" : "");
            ck_assert_msg(ran[v + 1] > 0 || var->inv_rows == 1,
                          "matmul variant %s promises inv_rows but no case served it", var->name);
        }
    }
}
END_TEST

/* --cpu-isa: unknown names refused; once the kernels read the cap, only the same level is accepted;
 * the level the kernels run at is never above the cap; portable is always usable. */
START_TEST(test_cpu_isa_cap)
{
    ck_assert_int_eq(pd_cpu_isa_set_cap("bogus"), PD_ERR_INVALID_ARG);
    ck_assert_int_eq(pd_cpu_isa_set_cap("auto"), PD_OK);
    ck_assert_int_eq(pd_cpu_isa_set_cap(NULL), PD_OK);
    pd_cpu_isa_t cap = pd_cpu_isa_cap(); /* read: fixed from here on */
    ck_assert_int_eq(pd_cpu_isa_set_cap(pd_cpu_isa_name(cap)), PD_OK);
    pd_cpu_isa_t other = cap == PD_ISA_PORTABLE ? PD_ISA_AVX2 : PD_ISA_PORTABLE;
    ck_assert_int_eq(pd_cpu_isa_set_cap(pd_cpu_isa_name(other)), PD_ERR_INVALID_ARG);
    ck_assert_int_eq(pd_cpu_isa_cap(), cap);
    ck_assert_int_le(pd_cpu_isa_level(), cap);
    ck_assert(pd_cpu_isa_usable(PD_ISA_PORTABLE));
    for (int i = PD_ISA_AVX2; i <= PD_ISA_AMX; i++) {
        ck_assert_int_eq(pd_cpu_isa_usable((pd_cpu_isa_t)i) != 0, i <= (int)pd_cpu_isa_level());
    }
    printf("cpu isa: kernels run at %s under the cap %s\n", pd_cpu_isa_name(pd_cpu_isa_level()),
           pd_cpu_isa_name(cap));
}
END_TEST

/* fp32 math on bf16 weights at one row with AVX512-BF16 (matmul_bf16.h): the three bf16 parts of x
 * add up to x exactly, for magnitudes from 1e-30 to 1e30, signs, zeros and k tails, without writing
 * past 3k (test_matmul checks the products). */
START_TEST(test_split_bf16x3)
{
    if (!pd_cpu_bf16dot_usable()) {
        printf("test_split_bf16x3: no AVX512-BF16 on this CPU; fp32 math widens bf16 instead\n");
        return;
    }
    int ks[] = {1, 15, 16, 37, 1000};
    for (size_t c = 0; c < sizeof(ks) / sizeof(ks[0]); c++) {
        int k = ks[c];
        float *x = rand_buf((size_t)k, -1, 1), *e = rand_buf((size_t)k, -69, 69);
        for (int p = 0; p < k; p++) {
            x[p] = p % 7 == 3 ? 0.0f : x[p] * powf(2.0f, floorf(e[p])); /* |x| in about 1e-21 .. 1e21 */
        }
        uint16_t *d = malloc((3 * (size_t)k + 8) * sizeof(uint16_t));
        for (int p = 0; p < 3 * k + 8; p++) {
            d[p] = 0xdead;
        }
        pd_cpu_split_bf16x3(d, x, k);
        for (int p = 0; p < k; p++) {
            double sum =
                (double)pd_bf16_to_f32(d[p]) + pd_bf16_to_f32(d[k + p]) + pd_bf16_to_f32(d[2 * k + p]);
            ck_assert_msg(sum == (double)x[p], "k %d, x[%d] = %a: parts add to %a", k, p, x[p], sum);
        }
        for (int p = 3 * k; p < 3 * k + 8; p++) {
            ck_assert_uint_eq(d[p], 0xdead);
        }
        free(x), free(e), free(d);
    }
}
END_TEST

/* fp32 math on bf16 weights of at least PD_BF16X3_AMX_MIN_WEIGHTS at 24..64 rows: on a CPU with AMX,
 * x split in three exact bf16 parts through oneDNN (elsewhere the widening kernel), against the
 * reference (k = 1025: a tail; n = 4100: not a multiple of a tile). */
START_TEST(test_matmul_bf16_big)
{
    int shapes[][3] = {{PD_BF16X3_AMX_MIN_M, 4096, 1024}, {37, 4100, 1025}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        ck_assert((int64_t)n * k >= PD_BF16X3_AMX_MIN_WEIGHTS && m <= PD_BF16X3_AMX_MAX_M);
        float *x = rand_buf((size_t)m * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *bias = rand_buf((size_t)n, -1, 1), *y = rand_buf((size_t)m * n, -9, 9),
              *yr = rand_buf((size_t)m * n, -9, 9);
        void *ws = store_as(w, (size_t)n * k, PD_DTYPE_BF16);
        pd_weight_t wt = {ws, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, wt, bias, m, n, k), PD_OK);
        ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, wt, bias, m, n, k), PD_OK);
        /* fp32 math: ~2e-7 here; without the lo parts of x (8 bits fewer) ~3e-6 */
        ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-6, "%dx%dx%d (AMX: %d)", m, n, k,
                      (int)pd_cpu_dnnl_amx());
        free(x), free(w), free(ws), free(bias), free(y), free(yr);
    }
}
END_TEST

/* y = x · wᵀ + bias through matmul_bf16w_x512.c directly (w bf16, or fp32 with f32), as two
 * threads' slices split at a column. */
static void bf16w_direct(float *y, const float *x, const void *w, int f32, const float *bias, int m, int n,
                         int k, int split)
{
    float *xp = malloc(pd_cpu_bf16w_x512_floats(m, k) * sizeof(float));
    ck_assert_ptr_nonnull(xp);
    if (f32) {
        pd_cpu_f32w_x512_prepare(xp, x, m, k);
        pd_cpu_f32w_x512(y, xp, w, bias, m, n, k, 0, split);
        pd_cpu_f32w_x512(y, xp, w, bias, m, n, k, split, n);
    } else {
        pd_cpu_bf16w_x512_prepare(xp, x, m, k);
        pd_cpu_bf16w_x512(y, xp, w, bias, m, n, k, 0, split);
        pd_cpu_bf16w_x512(y, xp, w, bias, m, n, k, split, n);
    }
    free(xp);
}

/* Bf16 weights widened in AVX-512 registers (matmul_bf16w_x512.c), called directly (on a CPU with
 * AMX the dispatch sends 24 rows and more of a large matrix to oneDNN): a row's result is bitwise the
 * same in a batch of 2 as in a batch of every size up to PD_BF16W_X512_MAX_M (chunks of 8 rows and
 * their tails, blocks of 3 w rows and the single-row tail, k tails: k = 300 is 9 groups of 32 and
 * 12), and the same whichever columns a thread's slice starts at; for fp32 weights too. */
START_TEST(test_bf16w_batch_invariant)
{
    if (!pd_cpu_avx512_usable()) {
        printf("test_bf16w_batch_invariant: no AVX-512 on this CPU; fp32 math widens bf16 in AVX2\n");
        return;
    }
    enum { M = PD_BF16W_X512_MAX_M, N = 70, K = 300 };
    float *x = rand_buf((size_t)M * K, -1, 1), *w = rand_buf((size_t)N * K, -1, 1);
    float *y = rand_buf((size_t)M * N, -9, 9), *y2 = rand_buf((size_t)M * N, -9, 9),
          *bias = rand_buf(N, -1, 1);
    uint16_t *ws = store_as(w, (size_t)N * K, PD_DTYPE_BF16);
    for (int f32 = 0; f32 < 2; f32++) {
        const void *wd = f32 ? (const void *)w : ws;
        for (int i = 0; i + 2 <= M; i += 2) { /* the reference rows: pairs, in one slice */
            bf16w_direct(y2 + (size_t)i * N, x + (size_t)i * K, wd, f32, bias, 2, N, K, N);
        }
        int sizes[] = {3, 8, 9, 17, 37, M}, splits[] = {16, 35, 0, 48, 7, 69};
        for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
            int m = sizes[s] & ~1; /* whole pairs, starting at row 0 */
            bf16w_direct(y, x, wd, f32, bias, sizes[s], N, K, splits[s]);
            ck_assert_msg(memcmp(y, y2, (size_t)m * N * sizeof(float)) == 0,
                          "fp32 weights %d: a batch of %d (slices split at column %d) differs from pairs",
                          f32, sizes[s], splits[s]);
        }
        /* through the dispatch (a matrix this small takes the kernel at every row count, AMX or not) */
        pd_weight_t wt = {(void *)wd, f32 ? PD_DTYPE_F32 : PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, wt, bias, M, N, K), PD_OK);
        ck_assert_msg(memcmp(y, y2, (size_t)M * N * sizeof(float)) == 0,
                      "fp32 weights %d: pd_cpu_matmul of %d rows differs", f32, M);
    }
    free(x), free(w), free(y), free(y2), free(bias), free(ws);
}
END_TEST

/* y = x · wᵀ + bias in the order matmul_bf16p.h documents: per output, fused multiply-adds in
 * column order from 0, then the bias added. */
static void bf16p_order_ref(float *y, const float *x, const float *w, const float *bias, int m, int n, int k)
{
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) {
                acc = fmaf(x[(size_t)i * k + p], w[(size_t)j * k + p], acc);
            }
            y[(size_t)i * n + j] = acc + (bias != NULL ? bias[j] : 0.0f);
        }
    }
}

/* Bf16 weights in PD_WEIGHT_PAIRS32 (matmul_bf16p.h), laid out by the backend's prepare_weight:
 * every element reads back as it was (pd_weight_at, slices at whole blocks, embedding rows of a
 * tied table); up to PD_BF16P_MAX_M rows every output is bitwise the documented order (row groups
 * of 12 and their tails, 32-column blocks and the row-major rows after them, slices starting at
 * any block), so a row's result does not depend on its batch; above, the sgemm tiles match the
 * reference. Not laid out for bf16 math, under 32 rows, an odd k, or PD_CPU_WEIGHT_PACKING=0. */
START_TEST(test_matmul_bf16_packed)
{
    if (!pd_cpu_avx512_usable()) {
        printf("test_matmul_bf16_packed: no AVX-512 on this CPU; bf16 weights stay row-major\n");
        return;
    }
    int shapes[][2] = {{32, 2}, {64, 300}, {70, 48}, {2050, 64}, {97, 130}};
    int sizes[] = {1, 2, 5, 11, 12, 13, 24, 31, 37, PD_BF16P_MAX_M, PD_BF16P_MAX_M + 1, 150};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int n = shapes[s][0], k = shapes[s][1], M = 150;
        float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *bias = rand_buf((size_t)n, -1, 1), *y = rand_buf((size_t)M * n, -9, 9),
              *yr = rand_buf((size_t)M * n, -9, 9);
        uint16_t *ws = store_as(w, (size_t)n * k, PD_DTYPE_BF16), *wp = malloc((size_t)n * k * 2);
        memcpy(wp, ws, (size_t)n * k * 2);
        pd_weight_t wt = {ws, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0}, pk = {wp, PD_DTYPE_BF16, NULL, 0, 0};
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &pk, n, k, 0), PD_OK);
        ck_assert_int_eq(pk.layout, PD_WEIGHT_PAIRS32);
        ck_assert_int_eq(pk.packed_rows, n & ~31);
        for (int j = 0; j < n; j++) {
            for (int p = 0; p < k; p++) {
                ck_assert_float_eq(pd_weight_at(pk, j, p, k), w[(size_t)j * k + p]);
            }
        }
        pd_weight_t sl = pd_weight_rows(pk, 32, k); /* a fused weight's slice (GPT-2's k, v) */
        for (int j = 0; j + 32 < n; j++) {
            ck_assert_float_eq(pd_weight_at(sl, j, k - 1, k), w[(size_t)(j + 32) * k + k - 1]);
        }
        int32_t ids[3] = {n - 1, 0, n / 2};
        float *e = malloc((size_t)3 * k * sizeof(float)), *er = malloc((size_t)3 * k * sizeof(float));
        ck_assert_int_eq(pd_cpu_embed(g_be, e, pk, 2.0f, ids, 3, k, n), PD_OK);
        ck_assert_int_eq(pd_cpu_embed_ref(g_be, er, wt, 2.0f, ids, 3, k, n), PD_OK);
        ck_assert(memcmp(e, er, (size_t)3 * k * sizeof(float)) == 0);
        for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
            int m = sizes[c];
            const float *b = c % 2 ? bias : NULL;
            ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, pk, b, m, n, k), PD_OK);
            if (m <= PD_BF16P_MAX_M) {
                bf16p_order_ref(yr, x, w, b, m, n, k);
                ck_assert_msg(memcmp(y, yr, (size_t)m * n * sizeof(float)) == 0,
                              "%dx%dx%d: not the documented order of sums", m, n, k);
            } else {
                ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, wt, b, m, n, k), PD_OK);
                ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-6, "%dx%dx%d", m, n, k);
            }
        }
        /* a thread's slice may start at any block */
        float *xt = malloc(pd_cpu_bf16p_x_floats(13, k) * sizeof(float));
        pd_cpu_bf16p_prepare(xt, x, 13, k);
        for (int split = 32; split < n; split += 32) {
            pd_cpu_bf16p_x512(y, xt, wp, bias, 13, n, k, (int)pk.packed_rows, 0, split);
            pd_cpu_bf16p_x512(y, xt, wp, bias, 13, n, k, (int)pk.packed_rows, split, n);
            bf16p_order_ref(yr, x, w, bias, 13, n, k);
            ck_assert_msg(memcmp(y, yr, (size_t)13 * n * sizeof(float)) == 0, "split at %d", split);
        }
        free(x), free(w), free(bias), free(y), free(yr), free(ws), free(wp), free(e), free(er), free(xt);
    }
    /* what stays row-major */
    uint16_t buf[64 * 4] = {0};
    pd_weight_t a = {buf, PD_DTYPE_BF16, NULL, 0, 0}, b = a, c = a, d = a;
    g_be->matmul_precision = PD_MATMUL_BF16;
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &a, 64, 4, 0), PD_OK);
    g_be->matmul_precision = PD_MATMUL_FP32;
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &b, 31, 4, 0), PD_OK);
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &c, 32, 5, 0), PD_OK);
    setenv("PD_CPU_WEIGHT_PACKING", "0", 1);
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &d, 64, 4, 0), PD_OK);
    unsetenv("PD_CPU_WEIGHT_PACKING");
    pd_weight_t g = {buf, PD_DTYPE_BF16, NULL, 0, 0}; /* GPT-2's fused qkv with a hidden size of 40 */
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &g, 64, 4, 40), PD_OK);
    ck_assert(a.layout == PD_WEIGHT_ROWS && b.layout == PD_WEIGHT_ROWS && c.layout == PD_WEIGHT_ROWS &&
              d.layout == PD_WEIGHT_ROWS && g.layout == PD_WEIGHT_ROWS);
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &g, 64, 4, 32), PD_OK);
    ck_assert_int_eq(g.layout, PD_WEIGHT_PAIRS32);
    float xs[4] = {0}, ys[64];
    ck_assert_int_eq(pd_cpu_matmul(g_be, ys, xs, g, NULL, 1, 40, 4),
                     PD_ERR_INVALID_ARG); /* ends in a block */
}
END_TEST

/* y = x · wᵀ + bias in the order matmul_cols32.h documents: per output, fused multiply-adds of the
 * weight's values (int8 ones unscaled) in column order from 0, then one fused multiply-add of the
 * sum by the row's scale (1 for fp32) and the bias. w is row-major int8 or fp32. */
static void cols32_order_ref(float *y, const float *x, const void *w, pd_dtype_t dt, const float *scale,
                             const float *bias, int m, int n, int k)
{
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) {
                size_t e = (size_t)j * k + p;
                float v = dt == PD_DTYPE_I8 ? (float)((const int8_t *)w)[e] : ((const float *)w)[e];
                acc = fmaf(x[(size_t)i * k + p], v, acc);
            }
            y[(size_t)i * n + j] = fmaf(acc, scale != NULL ? scale[j] : 1.0f, bias != NULL ? bias[j] : 0.0f);
        }
    }
}

/* Int8 and fp32 weights in PD_WEIGHT_COLS32 (matmul_cols32.h), laid out by prepare_weight: every
 * element reads back as the int8 value times its scale, or the fp32 value (pd_weight_at, a slice at
 * a whole block); up to PD_COLS32_MAX_M rows every output is bitwise the documented order (row
 * groups of 12 and their tails, 32-row blocks and the row-major rows after them, an odd k, slices
 * starting at any block), so a row's result does not depend on its batch; above, the sgemm tiles
 * match the reference. Not laid out under 32 rows, off-block slices, or with
 * PD_CPU_WEIGHT_PACKING=0. */
START_TEST(test_matmul_cols32)
{
    if (!pd_cpu_avx512_usable()) {
        printf("test_matmul_cols32: no AVX-512 on this CPU; int8 and fp32 weights stay row-major\n");
        return;
    }
    int shapes[][2] = {{32, 1}, {64, 300}, {70, 47}, {2050, 64}, {97, 131}};
    int sizes[] = {1, 2, 5, 11, 12, 13, 24, 31, 37, PD_COLS32_MAX_M, PD_COLS32_MAX_M + 1, 150};
    pd_dtype_t dts[] = {PD_DTYPE_I8, PD_DTYPE_F32};
    for (size_t d = 0; d < 2; d++) {
        pd_dtype_t dt = dts[d];
        const char *name = dt == PD_DTYPE_I8 ? "int8" : "fp32";
        size_t esize = (size_t)pd_dtype_size(dt);
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            int n = shapes[s][0], k = shapes[s][1], M = 150;
            float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1), *scale = NULL;
            /* q: the row-major matrix prepare_weight is given (int8 values, or w itself); w then
             * holds the values it stands for */
            void *q = dt == PD_DTYPE_I8 ? (void *)quantize_rows(w, n, k, &scale) : (void *)w;
            void *wp = malloc((size_t)n * k * esize);
            memcpy(wp, q, (size_t)n * k * esize);
            float *bias = rand_buf((size_t)n, -1, 1), *y = rand_buf((size_t)M * n, -9, 9),
                  *yr = rand_buf((size_t)M * n, -9, 9);
            pd_weight_t wt = {q, dt, scale, PD_WEIGHT_ROWS, 0}, pk = {wp, dt, scale, 0, 0};
            ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &pk, n, k, 0), PD_OK);
            ck_assert_int_eq(pk.layout, PD_WEIGHT_COLS32);
            ck_assert_int_eq(pk.packed_rows, n & ~31);
            for (int j = 0; j < n; j++) {
                for (int p = 0; p < k; p++) {
                    ck_assert_float_eq(pd_weight_at(pk, j, p, k), w[(size_t)j * k + p]);
                }
            }
            pd_weight_t sl = pd_weight_rows(pk, 32, k);
            for (int j = 0; j + 32 < n; j++) {
                ck_assert_float_eq(pd_weight_at(sl, j, k - 1, k), w[(size_t)(j + 32) * k + k - 1]);
            }
            for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
                int m = sizes[c];
                const float *b = c % 2 ? bias : NULL;
                ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, pk, b, m, n, k), PD_OK);
                if (m <= PD_COLS32_MAX_M) {
                    cols32_order_ref(yr, x, q, dt, scale, b, m, n, k);
                    ck_assert_msg(memcmp(y, yr, (size_t)m * n * sizeof(float)) == 0,
                                  "%s %dx%dx%d: not the documented order of sums", name, m, n, k);
                } else {
                    ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, wt, b, m, n, k), PD_OK);
                    ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-6, "%s %dx%dx%d", name, m,
                                  n, k);
                }
            }
            float *xt = malloc(pd_cpu_bf16p_x_floats(13, k) * sizeof(float));
            pd_cpu_bf16p_prepare(xt, x, 13, k);
            for (int split = 32; split < n; split += 32) { /* a thread's slice may start at any block */
                for (int half = 0; half < 2; half++) {
                    int n0 = half ? split : 0, n1 = half ? n : split;
                    if (dt == PD_DTYPE_I8) {
                        pd_cpu_i8p_x512(y, xt, wp, scale, bias, 13, n, k, (int)pk.packed_rows, n0, n1);
                    } else {
                        pd_cpu_f32p_x512(y, xt, wp, bias, 13, n, k, (int)pk.packed_rows, n0, n1);
                    }
                }
                cols32_order_ref(yr, x, q, dt, scale, bias, 13, n, k);
                ck_assert_msg(memcmp(y, yr, (size_t)13 * n * sizeof(float)) == 0, "%s split at %d", name,
                              split);
            }
            if (dt == PD_DTYPE_I8) {
                free(q);
            }
            free(x), free(w), free(scale), free(wp), free(bias), free(y), free(yr), free(xt);
        }
        /* what stays row-major */
        float buf[64 * 4] = {0}, sc[64];
        for (int j = 0; j < 64; j++) {
            sc[j] = 1.0f;
        }
        const float *bsc = dt == PD_DTYPE_I8 ? sc : NULL;
        pd_weight_t a = {buf, dt, bsc, 0, 0}, dd = a, g = a;
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &a, 31, 4, 0), PD_OK);
        setenv("PD_CPU_WEIGHT_PACKING", "0", 1);
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &dd, 64, 4, 0), PD_OK);
        unsetenv("PD_CPU_WEIGHT_PACKING");
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &g, 64, 4, 40), PD_OK);
        ck_assert(a.layout == PD_WEIGHT_ROWS && dd.layout == PD_WEIGHT_ROWS && g.layout == PD_WEIGHT_ROWS);
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &g, 64, 4, 32), PD_OK);
        ck_assert_int_eq(g.layout, PD_WEIGHT_COLS32);
        float xs[4] = {0}, ys[64];
        ck_assert_int_eq(pd_cpu_matmul(g_be, ys, xs, g, NULL, 1, 40, 4),
                         PD_ERR_INVALID_ARG); /* ends in a block */
    }
}
END_TEST

/* The AMX kernel (matmul_bf16p_amx.c) on weights prepare_weight laid out, x in one part (bf16
 * math: x rounded) and in three (fp32 math: pd_cpu_split_bf16x3): the reference on the values it
 * stands for within fp32 summation order; each row bitwise the same alone (m = 1) as in its batch,
 * whatever the rows padding the last tile hold (NaN here) and wherever a thread's columns start;
 * row chunks of pd_cpu_bf16p_amx_chunk_rows crossed; and pd_cpu_matmul taking it in both
 * precisions from its row counts on; and int8 weights in PD_WEIGHT_COLS32 above PD_COLS32_MAX_M rows
 * (pd_cpu_i8p_amx: blocks widened into bf16 panels, scale and bias after), against the reference
 * and row by row alone. */
START_TEST(test_matmul_bf16_amx)
{
    if (!pd_cpu_amx_usable() || !pd_cpu_bf16dot_usable()) {
        printf("test_matmul_bf16_amx: no AMX on this CPU (or not allowed); skipped\n");
        return;
    }
    int shapes[][2] = {{32, 32}, {96, 64}, {64, 1536}};
    int sizes[] = {1, 5, 16, 17, 31, 32, 33, 100, 300};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int n = shapes[s][0], k = shapes[s][1], M = 300;
        float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *bias = rand_buf((size_t)n, -1, 1), *yr = malloc((size_t)M * n * sizeof(float));
        float *xr = copy_buf(x, (size_t)M * k);
        free(store_as(xr, (size_t)M * k, PD_DTYPE_BF16)); /* xr: x rounded to bf16 */
        uint16_t *ws = store_as(w, (size_t)n * k, PD_DTYPE_BF16);
        pd_weight_t pk = {ws, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
        pd_weight_t ref = {w, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &pk, n, k, 0), PD_OK);
        ck_assert(pk.layout == PD_WEIGHT_PAIRS32 && pd_cpu_bf16p_amx_fits(n, pk.packed_rows, k));
        for (int parts = 1; parts <= 3; parts += 2) {
            /* xs[i][part][k] for pd_cpu_bf16p_amx_rows(M) rows, the padding NaN */
            size_t rows = (size_t)pd_cpu_bf16p_amx_rows(M), row_words = (size_t)parts * k;
            uint16_t *xs = malloc(rows * row_words * sizeof(uint16_t)), *x1 = malloc(16 * row_words * 2);
            for (size_t i = 0; i < 16 * row_words; i++) {
                x1[i] = 0x7fc0; /* bf16 NaN */
            }
            float *y = malloc((size_t)M * n * sizeof(float)), *y1 = malloc((size_t)n * sizeof(float));
            for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
                int m = sizes[c];
                const float *b = c % 2 ? bias : NULL;
                for (size_t i = 0; i < (size_t)m; i++) {
                    if (parts == 1) {
                        pd_cpu_round_bf16(xs + i * row_words, x + i * k, (size_t)k);
                    } else {
                        pd_cpu_split_bf16x3(xs + i * row_words, x + i * k, k);
                    }
                }
                for (size_t i = (size_t)m * row_words; i < (size_t)pd_cpu_bf16p_amx_rows(m) * row_words;
                     i++) {
                    xs[i] = 0x7fc0;
                }
                int split = 32 * (int)(c % (size_t)(n / 32)); /* two threads' columns, split anywhere */
                pd_cpu_bf16p_amx(y, xs, parts, pk.data, b, m, n, k, 0, split);
                pd_cpu_bf16p_amx(y, xs, parts, pk.data, b, m, n, k, split, n);
                ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, parts == 1 ? xr : x, ref, b, m, n, k), PD_OK);
                double err = max_rel_err(y, yr, (size_t)m * n, sqrt(k));
                ck_assert_msg(err < (parts == 1 ? 1e-5 : 1e-6), "%d parts, %dx%dx%d: %g", parts, m, n, k,
                              err);
                for (int row = 0; row < m; row += m / 3 + 1) { /* the row alone, NaN beside it */
                    memcpy(x1, xs + (size_t)row * row_words, row_words * sizeof(uint16_t));
                    pd_cpu_bf16p_amx(y1, x1, parts, pk.data, b, 1, n, k, 0, n);
                    ck_assert_msg(memcmp(y1, y + (size_t)row * n, (size_t)n * sizeof(float)) == 0,
                                  "%d parts: row %d of %dx%dx%d alone differs", parts, row, m, n, k);
                }
            }
            free(xs), free(x1), free(y), free(y1);
        }
        /* pd_cpu_matmul from the AMX row counts on: fp32 math, then bf16 math */
        float *y = malloc((size_t)M * n * sizeof(float));
        ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, pk, bias, PD_BF16P_AMX_X3_MIN_M, n, k), PD_OK);
        ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, ref, bias, PD_BF16P_AMX_X3_MIN_M, n, k), PD_OK);
        ck_assert(max_rel_err(y, yr, (size_t)PD_BF16P_AMX_X3_MIN_M * n, sqrt(k)) < 1e-6);
        g_be->matmul_precision = PD_MATMUL_BF16;
        ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, pk, bias, M, n, k), PD_OK);
        g_be->matmul_precision = PD_MATMUL_FP32;
        ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, xr, ref, bias, M, n, k), PD_OK);
        ck_assert(max_rel_err(y, yr, (size_t)M * n, sqrt(k)) < 1e-5);
        /* int8: quantized w, through pd_cpu_matmul above PD_COLS32_MAX_M, then rows alone */
        float *scale = NULL;
        int8_t *q = quantize_rows(w, n, k, &scale); /* w now the values q stands for */
        pd_weight_t qk = {q, PD_DTYPE_I8, scale, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &qk, n, k, 0), PD_OK);
        ck_assert_int_eq(qk.layout, PD_WEIGHT_COLS32);
        int i8_sizes[] = {PD_COLS32_MAX_M + 1, 100, M};
        for (size_t c = 0; c < sizeof(i8_sizes) / sizeof(i8_sizes[0]); c++) {
            int m = i8_sizes[c];
            const float *b = c % 2 ? NULL : bias;
            ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, qk, b, m, n, k), PD_OK);
            ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, x, ref, b, m, n, k), PD_OK);
            double err = max_rel_err(y, yr, (size_t)m * n, sqrt(k));
            ck_assert_msg(err < 1e-6, "int8 %dx%dx%d: %g", m, n, k, err);
        }
        uint16_t *xs = calloc((size_t)pd_cpu_bf16p_amx_rows(M) * 3 * k, sizeof(uint16_t));
        uint16_t *xs1 = calloc((size_t)16 * 3 * k, sizeof(uint16_t)), *panel = malloc((size_t)k * 32 * 2);
        float *y1 = malloc((size_t)n * sizeof(float));
        for (int i = 0; i < M; i++) {
            pd_cpu_split_bf16x3(xs + (size_t)3 * i * k, x + (size_t)i * k, k);
        }
        pd_cpu_i8p_amx(y, xs, qk.data, scale, bias, M, n, k, 0, 32, panel); /* two threads' columns */
        pd_cpu_i8p_amx(y, xs, qk.data, scale, bias, M, n, k, 32, n, panel);
        for (int row = 0; row < M; row += 37) {
            memcpy(xs1, xs + (size_t)3 * row * k, (size_t)3 * k * sizeof(uint16_t));
            pd_cpu_i8p_amx(y1, xs1, qk.data, scale, bias, 1, n, k, 0, n, panel);
            ck_assert_msg(memcmp(y1, y + (size_t)row * n, (size_t)n * sizeof(float)) == 0,
                          "int8: row %d of %dx%dx%d alone differs", row, M, n, k);
        }
        free(scale), free(q), free(xs), free(xs1), free(panel), free(y1);
        free(x), free(w), free(bias), free(yr), free(xr), free(ws), free(y);
    }
    ck_assert_int_eq(pd_cpu_bf16p_amx_chunk_rows(1536, 1), 256);
    ck_assert_int_eq(pd_cpu_bf16p_amx_chunk_rows(1536, 3), 96);
}
END_TEST

/* --matmul-precision bf16 on weights prepare_weight laid out (k a multiple of 32; with n one too,
 * oneDNN's BA16a32b2a): the packed `vdpbf16ps` kernel up to the GEMV row count, oneDNN with
 * fixed-row-count primitives above (rows padded with zeros to 16 or 64, chunks of
 * PD_DNNL_BLOCKED_CHUNK) — each the reference on x rounded to bf16, and a row alone as in its batch,
 * within fp32 summation order, and bit for bit where the packed kernel serves both. Rows past the
 * last block (n = 70, 40, 330) go through pd_cpu_bf16p_dot_rows at every row count, so there a row
 * alone is its batch's row bit for bit at every m; x's rounding and transposition into column pairs
 * (16 × 16 words in registers) is checked through the same results, at 1..300 rows. */
START_TEST(test_matmul_bf16_math_packed)
{
    if (!pd_cpu_bf16dot_usable()) {
        printf("test_matmul_bf16_math_packed: no AVX512-BF16 on this CPU; bf16 weights stay row-major\n");
        return;
    }
    int shapes[][2] = {{32, 32}, {96, 64}, {320, 1536}, {70, 64}, {40, 96}, {330, 128}};
    int sizes[] = {1,  3,  12, 13, 17, PD_BF16DOT_AMX_MAX_M, PD_BF16DOT_MAX_M, PD_BF16DOT_MAX_M + 1,
                   64, 65, 300};
    int gemv_max = pd_cpu_dnnl_amx() ? PD_BF16DOT_AMX_MAX_M : PD_BF16DOT_MAX_M;
    g_be->matmul_precision = PD_MATMUL_BF16;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int n = shapes[s][0], k = shapes[s][1], M = 300;
        float *x = rand_buf((size_t)M * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *xr = malloc((size_t)M * k * sizeof(float));
        memcpy(xr, x, (size_t)M * k * sizeof(float));
        free(store_as(xr, (size_t)M * k, PD_DTYPE_BF16)); /* xr rounded to bf16 in place */
        uint16_t *ws = store_as(w, (size_t)n * k, PD_DTYPE_BF16);
        pd_weight_t wt = {ws, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
        pd_weight_t rows = {w, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0}; /* the same values for the reference */
        ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &wt, n, k, 0), PD_OK);
        ck_assert_int_eq(wt.layout, PD_WEIGHT_PAIRS32);
        ck_assert_int_eq(wt.packed_rows, n & ~31);
        bool tail = n % 32 != 0;
        float *bias = rand_buf((size_t)n, -1, 1), *y = rand_buf((size_t)M * n, -9, 9),
              *yr = rand_buf((size_t)M * n, -9, 9), *y1 = rand_buf((size_t)n, -9, 9);
        for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
            int m = sizes[c], row = m / 2;
            const float *b = c % 2 ? bias : NULL;
            ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, wt, b, m, n, k), PD_OK);
            ck_assert_int_eq(pd_cpu_matmul(g_be, y1, x + (size_t)row * k, wt, b, 1, n, k), PD_OK);
            ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, xr, rows, b, m, n, k), PD_OK);
            ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-5, "%dx%dx%d", m, n, k);
            ck_assert_msg(max_rel_err(y1, y + (size_t)row * n, (size_t)n, sqrt(k)) < 1e-5,
                          "row %d of %dx%dx%d", row, m, n, k);
            if (m <= gemv_max || tail) {
                ck_assert_msg(memcmp(y1, y + (size_t)row * n, (size_t)n * sizeof(float)) == 0,
                              "row %d of %dx%dx%d alone differs in bits", row, m, n, k);
            }
        }
        free(x), free(xr), free(w), free(ws), free(bias), free(y), free(yr), free(y1);
    }
    uint16_t buf[40 * 80] = {0};
    pd_weight_t small = {buf, PD_DTYPE_BF16, NULL, 0, 0}, oddk = {buf, PD_DTYPE_BF16, NULL, 0, 0};
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &small, 31, 64, 0), PD_OK);
    ck_assert_int_eq(pd_cpu_prepare_weight(g_be, &oddk, 40, 80, 0), PD_OK);
    ck_assert(small.layout == PD_WEIGHT_ROWS && oddk.layout == PD_WEIGHT_ROWS); /* no block; k % 32 != 0 */
    if (pd_cpu_dnnl_bf16_native()) { /* the blocked oneDNN path ran, not the fp32 fallback */
        uint16_t xb[17 * 32] = {0};
        float yb[17 * 32];
        ck_assert_int_eq(pd_cpu_dnnl_matmul_bf16_blocked(yb, xb, buf, NULL, 17, 32, 32, 2), PD_OK);
    }
    g_be->matmul_precision = PD_MATMUL_FP32;
}
END_TEST

/* --matmul-precision bf16 with bf16 weights: every path (the AVX512-BF16 GEMV at each m up to
 * PD_BF16DOT_MAX_M, with w-row blocks, passes of 4 x rows and k tails; oneDNN above) is the
 * reference on x rounded to bf16, so a row's result does not depend on the rows beside it; and the
 * rounding happens (the result differs from fp32 math). */
START_TEST(test_matmul_bf16_math)
{
    int shapes[][3] = {{1, 7, 5},
                       {2, 33, 100},
                       {3, 64, 33},
                       {4, 130, 512},
                       {5, 70, 96},
                       {6, 9, 40},
                       {7, 21, 47},
                       {8, 600, 64},
                       {9, 300, 48},
                       {17, 129, 64},
                       {64, 96, 200},
                       {1, 1, 3},
                       {260, 1100, 1536},
                       {PD_BF16DOT_MAX_M, 70, 100},
                       {PD_BF16DOT_MAX_M + 1, 40, 64}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        float *x = rand_buf((size_t)m * k, -1, 1), *w = rand_buf((size_t)n * k, -1, 1);
        float *xr = malloc((size_t)m * k * sizeof(float));
        memcpy(xr, x, (size_t)m * k * sizeof(float));
        free(store_as(xr, (size_t)m * k, PD_DTYPE_BF16)); /* xr rounded to bf16 in place */
        void *ws = store_as(w, (size_t)n * k, PD_DTYPE_BF16);
        pd_weight_t wt = {ws, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
        float *bias = rand_buf((size_t)n, -1, 1);
        float *y = rand_buf((size_t)m * n, -9, 9), *yr = rand_buf((size_t)m * n, -9, 9);
        float *y32 = rand_buf((size_t)m * n, -9, 9), *y1 = rand_buf((size_t)n, -9, 9);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            const float *b = with_bias ? bias : NULL;
            g_be->matmul_precision = PD_MATMUL_BF16;
            ck_assert_int_eq(pd_cpu_matmul(g_be, y, x, wt, b, m, n, k), PD_OK);
            int row = m / 2; /* the same row alone (the GEMV when m > PD_BF16DOT_MAX_M went through oneDNN) */
            ck_assert_int_eq(pd_cpu_matmul(g_be, y1, x + (size_t)row * k, wt, b, 1, n, k), PD_OK);
            g_be->matmul_precision = PD_MATMUL_FP32;
            ck_assert_int_eq(pd_cpu_matmul(g_be, y32, x, wt, b, m, n, k), PD_OK);
            ck_assert_int_eq(pd_cpu_matmul_ref(g_be, yr, xr, wt, b, m, n, k), PD_OK);
            ck_assert_msg(max_rel_err(y, yr, (size_t)m * n, sqrt(k)) < 1e-5, "%dx%dx%d", m, n, k);
            ck_assert_msg(max_rel_err(y1, y + (size_t)row * n, (size_t)n, sqrt(k)) < 1e-5,
                          "row %d of %dx%dx%d", row, m, n, k);
            ck_assert_msg(max_rel_err(y32, y, (size_t)m * n, sqrt(k)) > 1e-5, "%dx%dx%d not rounded", m, n,
                          k);
        }
        free(x), free(xr), free(w), free(ws), free(bias), free(y), free(yr), free(y32), free(y1);
    }
    /* on a CPU with AVX512-BF16 the rows above PD_BF16DOT_MAX_M went through oneDNN, not the fallback */
    if (pd_cpu_dnnl_bf16_native()) {
        enum { M = PD_BF16DOT_MAX_M + 1 };
        uint16_t xb[M * 16] = {0}, wb[16 * 16] = {0};
        float yb[M * 16];
        ck_assert_int_eq(pd_cpu_dnnl_matmul_bf16(yb, xb, wb, NULL, M, 16, 16, 2), PD_OK);
    } else {
        printf("test_matmul_bf16_math: no AVX512-BF16 on this CPU; the oneDNN path may fall back\n");
    }
}
END_TEST

START_TEST(test_norms)
{
    int rows = 13, dims[] = {1, 7, 64, 513};
    for (int di = 0; di < 4; di++) {
        int dim = dims[di];
        size_t n = (size_t)rows * dim;
        float *x = rand_buf(n, -3, 3), *w = rand_buf((size_t)dim, 0.5f, 1.5f),
              *b = rand_buf((size_t)dim, -1, 1);
        float *o = rand_buf(n, -9, 9), *oref = rand_buf(n, -9, 9);
        ck_assert_int_eq(pd_cpu_rmsnorm(g_be, o, x, w, rows, dim, 1e-5f), PD_OK);
        ck_assert_int_eq(pd_cpu_rmsnorm_ref(g_be, oref, x, w, rows, dim, 1e-5f), PD_OK);
        /* outputs are O(1): errors are measured against that scale, not against values near 0 */
        ck_assert_double_lt(max_rel_err(o, oref, n, 1.0), 1e-5);
        if (dim > 1) { /* a 1-wide layernorm is 0 · w + b: nothing to compare but b */
            ck_assert_int_eq(pd_cpu_layernorm(g_be, o, x, w, b, rows, dim, 1e-5f), PD_OK);
            ck_assert_int_eq(pd_cpu_layernorm_ref(g_be, oref, x, w, b, rows, dim, 1e-5f), PD_OK);
            ck_assert_double_lt(max_rel_err(o, oref, n, 1.0), 1e-5);
        }
        /* in place (out aliases x) gives the same values */
        float *xi = copy_buf(x, n);
        ck_assert_int_eq(pd_cpu_rmsnorm(g_be, xi, xi, w, rows, dim, 1e-5f), PD_OK);
        ck_assert_int_eq(pd_cpu_rmsnorm_ref(g_be, oref, x, w, rows, dim, 1e-5f), PD_OK);
        ck_assert_double_lt(max_rel_err(xi, oref, n, 1.0), 1e-5);
        free(x), free(w), free(b), free(o), free(oref), free(xi);
    }
}
END_TEST

START_TEST(test_elementwise)
{
    size_t n = 100003;
    float *x = rand_buf(n, -8, 8);
    float *a = copy_buf(x, n), *b = copy_buf(x, n);
    ck_assert_int_eq(pd_cpu_gelu(g_be, a, n), PD_OK);
    ck_assert_int_eq(pd_cpu_gelu_ref(g_be, b, n), PD_OK);
    ck_assert_double_lt(max_rel_err(a, b, n, 1e-3), 1e-5);

    int rows = 9, inter = 301;
    float *gu = rand_buf((size_t)rows * 2 * inter, -6, 6);
    float *o1 = rand_buf((size_t)rows * inter, -1, 1), *o2 = rand_buf((size_t)rows * inter, -1, 1);
    ck_assert_int_eq(pd_cpu_silu_mul(g_be, o1, gu, rows, inter), PD_OK);
    ck_assert_int_eq(pd_cpu_silu_mul_ref(g_be, o2, gu, rows, inter), PD_OK);
    ck_assert_double_lt(max_rel_err(o1, o2, (size_t)rows * inter, 1e-3), 1e-5);
    ck_assert_int_eq(pd_cpu_gelu_mul(g_be, o1, gu, rows, inter), PD_OK);
    ck_assert_int_eq(pd_cpu_gelu_mul_ref(g_be, o2, gu, rows, inter), PD_OK);
    ck_assert_double_lt(max_rel_err(o1, o2, (size_t)rows * inter, 1e-3), 1e-5);
    /* the reference is the formula: GELU-tanh(0.5)·2 and GELU-tanh(−3)·1 */
    float g2[4] = {0.5f, -3.0f, 2.0f, 1.0f}, o3[2];
    ck_assert_int_eq(pd_cpu_gelu_mul_ref(g_be, o3, g2, 1, 2), PD_OK);
    ck_assert_double_lt(fabs(o3[0] - 2 * 0.345714), 1e-5);
    ck_assert_double_lt(fabs(o3[1] - (-0.00363739)), 1e-6);

    int cols = 1031;
    float *s1 = rand_buf((size_t)rows * cols, -20, 20), *s2 = copy_buf(s1, (size_t)rows * cols);
    ck_assert_int_eq(pd_cpu_softmax(g_be, s1, rows, cols), PD_OK);
    ck_assert_int_eq(pd_cpu_softmax_ref(g_be, s2, rows, cols), PD_OK);
    ck_assert_double_lt(max_rel_err(s1, s2, (size_t)rows * cols, 1e-6), 1e-5);
    for (int r = 0; r < rows; r++) {
        double sum = 0;
        for (int c = 0; c < cols; c++) {
            sum += s1[(size_t)r * cols + c];
        }
        ck_assert_double_eq_tol(sum, 1.0, 1e-5);
    }

    float *y1 = rand_buf(n, -1, 1), *y2 = copy_buf(y1, n);
    ck_assert_int_eq(pd_cpu_add(g_be, y1, x, n), PD_OK);
    ck_assert_int_eq(pd_cpu_add_ref(g_be, y2, x, n), PD_OK);
    ck_assert_int_eq(memcmp(y1, y2, n * sizeof(float)), 0);

    int vocab = 50, dim = 24, ntok = 11;
    float *table = rand_buf((size_t)vocab * dim, -1, 1);
    pd_weight_t tw = {table, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0};
    int32_t ids[11] = {0, 49, 3, 3, 17, 25, 8, 1, 48, 30, 2};
    float *e1 = rand_buf((size_t)ntok * dim, -1, 1), *e2 = rand_buf((size_t)ntok * dim, -1, 1);
    ck_assert_int_eq(pd_cpu_embed(g_be, e1, tw, 1.0f, ids, ntok, dim, vocab), PD_OK);
    ck_assert_int_eq(pd_cpu_embed_ref(g_be, e2, tw, 1.0f, ids, ntok, dim, vocab), PD_OK);
    ck_assert_int_eq(memcmp(e1, e2, (size_t)ntok * dim * sizeof(float)), 0);
    ck_assert_float_eq(e1[1 * dim + 5], table[49 * dim + 5]);
    for (int dt = PD_DTYPE_F16; dt <= PD_DTYPE_BF16; dt++) { /* 16-bit tables, scaled (Gemma's √hidden) */
        void *t16 = store_as(table, (size_t)vocab * dim, (pd_dtype_t)dt);
        pd_weight_t w16 = {t16, (pd_dtype_t)dt, NULL, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_embed(g_be, e1, w16, 2.5f, ids, ntok, dim, vocab), PD_OK);
        ck_assert_int_eq(pd_cpu_embed_ref(g_be, e2, w16, 2.5f, ids, ntok, dim, vocab), PD_OK);
        ck_assert_int_eq(memcmp(e1, e2, (size_t)ntok * dim * sizeof(float)), 0);
        ck_assert_float_eq(e1[2 * dim + 7], table[3 * dim + 7] * 2.5f);
        free(t16);
    }
    { /* an int8 table with per-row scales (the embed op's contract, though the model keeps its
       * embeddings at --dtype) */
        float *deq = copy_buf(table, (size_t)vocab * dim), *rs = NULL;
        int8_t *t8 = quantize_rows(deq, vocab, dim, &rs);
        pd_weight_t w8 = {t8, PD_DTYPE_I8, rs, PD_WEIGHT_ROWS, 0};
        ck_assert_int_eq(pd_cpu_embed(g_be, e1, w8, 2.0f, ids, ntok, dim, vocab), PD_OK);
        ck_assert_int_eq(pd_cpu_embed_ref(g_be, e2, w8, 2.0f, ids, ntok, dim, vocab), PD_OK);
        ck_assert_int_eq(memcmp(e1, e2, (size_t)ntok * dim * sizeof(float)), 0);
        ck_assert_float_eq(e1[2 * dim + 7], deq[3 * dim + 7] * 2.0f);
        free(deq), free(t8), free(rs);
    }
    ids[4] = 50; /* out of the vocabulary: rejected, nothing written */
    memcpy(e2, e1, (size_t)ntok * dim * sizeof(float));
    ck_assert_int_eq(pd_cpu_embed(g_be, e1, tw, 1.0f, ids, ntok, dim, vocab), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(memcmp(e1, e2, (size_t)ntok * dim * sizeof(float)), 0);
    ids[4] = -1;
    ck_assert_int_eq(pd_cpu_embed_ref(g_be, e1, tw, 1.0f, ids, ntok, dim, vocab), PD_ERR_OUT_OF_RANGE);

    free(x), free(a), free(b), free(gu), free(o1), free(o2), free(s1), free(s2), free(y1), free(y2);
    free(table), free(e1), free(e2);
}
END_TEST

static pd_rope_t rope_default(int hd, double theta)
{
    pd_rope_t r;
    memset(&r, 0, sizeof(r));
    r.half = hd / 2;
    r.scale = 1.0f;
    for (int i = 0; i < r.half; i++) {
        r.inv_freq[i] = 1.0 / pow(theta, (2.0 * i) / hd);
    }
    return r;
}

START_TEST(test_rope)
{
    int ntok = 19, heads = 6, hd = 64;
    pd_rope_t r1 = rope_default(hd, 10000.0), r5 = rope_default(hd, 500000.0);
    size_t n = (size_t)ntok * heads * hd;
    float *x = rand_buf(n, -2, 2), *a = copy_buf(x, n), *b = copy_buf(x, n);
    int32_t pos[19];
    for (int i = 0; i < ntok; i++) {
        pos[i] = (int32_t)pd_rng_below(&g_rng, 4096);
    }
    ck_assert_int_eq(pd_cpu_rope(g_be, a, pos, ntok, heads, hd, &r1), PD_OK);
    ck_assert_int_eq(pd_cpu_rope_ref(g_be, b, pos, ntok, heads, hd, &r1), PD_OK);
    ck_assert_double_lt(max_rel_err(a, b, n, 1.0), 1e-6);
    /* any table and a scale (YaRN's attention factor): the fast op equals the reference, and the
     * reference equals the rotation written out */
    pd_rope_t rs = r1;
    rs.scale = 1.37f;
    for (int i = 0; i < rs.half; i++) {
        rs.inv_freq[i] = pd_rng_uniform(&g_rng) * 0.9;
    }
    memcpy(a, x, n * sizeof(float));
    memcpy(b, x, n * sizeof(float));
    ck_assert_int_eq(pd_cpu_rope(g_be, a, pos, ntok, heads, hd, &rs), PD_OK);
    ck_assert_int_eq(pd_cpu_rope_ref(g_be, b, pos, ntok, heads, hd, &rs), PD_OK);
    ck_assert_double_lt(max_rel_err(a, b, n, 1.0), 1e-6);
    for (int t = 0; t < ntok; t++) {
        for (int i = 0; i < hd / 2; i += 7) {
            const float *u = x + (size_t)t * heads * hd;
            double ang = pos[t] * rs.inv_freq[i];
            double want = (u[i] * cos(ang) - u[i + hd / 2] * sin(ang)) * rs.scale;
            ck_assert_double_eq_tol(b[(size_t)t * heads * hd + i], want, 1e-4);
        }
    }
    pd_rope_t bad = r1;
    bad.half = 16;
    ck_assert_int_eq(pd_cpu_rope(g_be, a, pos, ntok, heads, hd, &bad), PD_ERR_INVALID_ARG);
    /* rotation keeps each (i, i+half) pair's norm; position 0 is the identity */
    pos[0] = 0;
    memcpy(a, x, n * sizeof(float));
    ck_assert_int_eq(pd_cpu_rope(g_be, a, pos, ntok, heads, hd, &r5), PD_OK);
    for (int d = 0; d < heads * hd; d++) {
        ck_assert_float_eq(a[d], x[d]);
    }
    for (int t = 1; t < ntok; t++) {
        float *v = a + (size_t)t * heads * hd, *u = x + (size_t)t * heads * hd;
        for (int i = 0; i < hd / 2; i++) {
            double n0 = u[i] * u[i] + u[i + hd / 2] * u[i + hd / 2];
            double n1 = v[i] * v[i] + v[i + hd / 2] * v[i + hd / 2];
            ck_assert_double_eq_tol(n0, n1, 1e-4 * (n0 + 1e-3));
        }
    }
    free(x), free(a), free(b);
}
END_TEST

/* The "cpu" backend keeps the last batch's cos/sin (kernels/cpu/rope.c): every call, hit or miss,
 * equals the op on a backend without that state bit for bit — the same positions and table again
 * (q then k), one position changed, the same table at another scale, another table, fewer tokens, a
 * batch over the cache's cap, and the small batch after it. */
START_TEST(test_rope_cache)
{
    ck_assert_ptr_nonnull(g_be->impl);
    pd_backend_t plain = *g_be; /* the same ops, no cache */
    plain.impl = NULL;
    enum { BIG = 9000, HD = 128 }; /* 9000 × 64 frequencies: over the cache's 2^19 entries */
    int32_t *pos = malloc(BIG * sizeof(int32_t));
    for (int i = 0; i < BIG; i++) {
        pos[i] = (int32_t)pd_rng_below(&g_rng, 8192);
    }
    pd_rope_t r1 = rope_default(HD, 10000.0), r5 = rope_default(HD, 500000.0), rs = r1;
    rs.scale = 1.37f;
    struct {
        int ntok, heads;
        const pd_rope_t *rope;
        int change; /* a position to change first, or -1 */
    } calls[] = {{32, 8, &r1, -1}, {32, 2, &r1, -1}, {32, 8, &r1, 31},  {32, 8, &rs, -1},
                 {32, 8, &r5, -1}, {31, 2, &r5, -1}, {BIG, 1, &r1, -1}, {32, 8, &r1, -1}};
    size_t most = (size_t)BIG * HD;
    float *x = rand_buf(most, -2, 2), *a = malloc(most * sizeof(float)), *b = malloc(most * sizeof(float));
    for (size_t c = 0; c < sizeof(calls) / sizeof(calls[0]); c++) {
        if (calls[c].change >= 0) {
            pos[calls[c].change] += 1;
        }
        size_t n = (size_t)calls[c].ntok * calls[c].heads * HD;
        memcpy(a, x, n * sizeof(float));
        memcpy(b, x, n * sizeof(float));
        ck_assert_int_eq(pd_cpu_rope(g_be, a, pos, calls[c].ntok, calls[c].heads, HD, calls[c].rope), PD_OK);
        ck_assert_int_eq(pd_cpu_rope(&plain, b, pos, calls[c].ntok, calls[c].heads, HD, calls[c].rope),
                         PD_OK);
        ck_assert_msg(memcmp(a, b, n * sizeof(float)) == 0, "call %zu differs from the uncached op", c);
    }
    free(pos), free(x), free(a), free(b);
}
END_TEST

/* ------------------------------------------------------------ paged KV cache and attention */

typedef struct attn_case {
    int num_seqs;
    int q_lens[6];
    int ctx_before[6]; /* tokens already cached before this step */
    int block_size;
    int num_heads;
    int num_kv_heads;
    int head_size;
    pd_dtype_t dtype;
    int window;
} attn_case_t;

static double mean_abs_err(const float *a, const float *b, size_t n)
{
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        sum += fabs((double)a[i] - b[i]);
    }
    return n > 0 ? sum / (double)n : 0;
}

/* Under bf16 attention math (bf16 matmul precision, bf16 cache) every optimized path — GEMM tiles,
 * per-key items, the split-K decode kernel (vector and portable) — follows the bf16 reference's
 * roundings: each is far closer to it than the fp32 result is (the roundings happened, and they
 * are the same ones). A p̂ may still land on its bf16 neighbour where fp32 sums round apart (about
 * once in 10⁴ keys), hence the loose bound on the largest difference. */
/* cases each decode variant and each tiled prefill product engine ran on in this process
 * (test_attention_random reports them) */
static int g_decode_ran[16], g_mm_ran[8];

static void check_attn_bf16(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, const float *q, int NH,
                            float scale, const float *o32, int all_decode)
{
    size_t n = (size_t)meta->num_tokens * NH * kv->head_size;
    float *ref = malloc(n * sizeof(float)), *o = malloc(n * sizeof(float));
    g_be->matmul_precision = PD_MATMUL_BF16;
    ck_assert_int_eq(pd_cpu_paged_attention_bf16_ref(g_be, ref, q, kv, meta, NH, scale), PD_OK);
    double d32 = mean_abs_err(o32, ref, n);
    ck_assert_msg(d32 > 1e-5, "bf16 math changed nothing: %g", d32);
    /* tiled with each product engine the host can run, per-key; then each decode variant the host
     * can run that serves this cache */
    const int n_mm = pd_cpu_num_attn_mm_variants;
    for (int path = 0; path < n_mm + 1 + pd_cpu_num_attn_decode_variants; path++) {
        if (path > n_mm && !all_decode) {
            break;
        }
        const pd_cpu_attn_mm_variant_t *mv = path < n_mm ? &pd_cpu_attn_mm_variants[path] : NULL;
        const pd_cpu_attn_decode_variant_t *dv =
            path > n_mm ? &pd_cpu_attn_decode_variants[path - n_mm - 1] : NULL;
        if ((mv != NULL && (!pd_cpu_isa_usable(mv->isa) || !mv->serves(1, kv->head_size))) ||
            (dv != NULL && (!pd_cpu_isa_usable(dv->isa) || !dv->serves(kv, 1, NH / kv->num_kv_heads)))) {
            continue;
        }
        pd_cpu_attn_allow_tiled(path != n_mm);
        pd_cpu_attn_mm_force(mv != NULL ? path : -1);
        pd_cpu_attn_decode_force(dv != NULL ? path - n_mm - 1 : -1);
        ck_assert_int_eq(path <= n_mm ? pd_cpu_paged_attention_prefill(g_be, o, q, kv, meta, NH, scale)
                                      : pd_cpu_paged_attention_decode(g_be, o, q, kv, meta, NH, scale),
                         PD_OK);
        double mean = mean_abs_err(o, ref, n), worst = max_rel_err(o, ref, n, 1e-2);
        ck_assert_msg(mean < d32 / 200 && worst < 2e-2, "bf16 path %s%s: mean %g (fp32's %g), worst %g",
                      dv != NULL   ? dv->name
                      : mv != NULL ? "tiled "
                                   : "per-key",
                      mv != NULL ? mv->name : "", mean, d32, worst);
        if (dv != NULL) {
            g_decode_ran[path - n_mm - 1]++;
        } else if (mv != NULL) {
            g_mm_ran[path]++;
        }
    }
    pd_cpu_attn_allow_tiled(1);
    pd_cpu_attn_mm_force(-1);
    pd_cpu_attn_decode_force(-1);
    g_be->matmul_precision = PD_MATMUL_FP32;
    free(ref), free(o);
}

/* Builds a random paged cache holding each sequence's history (blocks in shuffled order),
 * writes the new tokens' K/V with reshape_and_cache (plus padding slots), and checks both
 * attention entry points against the reference. */
/* --batch-invariant: the step's attention (any mix of prefill chunks and decode tokens) near the
 * reference, and each query's output bitwise what a decode step gives that query alone, its context
 * its position + 1 (so a token has the same bits however its prompt was chunked and batched). */
static void check_attn_invariant(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, const float *q, int NH,
                                 float scale, const float *oref)
{
    int T = meta->num_tokens, D = kv->head_size;
    size_t row = (size_t)NH * D;
    float *o = rand_buf((size_t)T * row, -5, 5), *one = malloc(row * sizeof(float));
    g_be->batch_invariant = true;
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, kv, meta, NH, scale), PD_OK);
    ck_assert_double_lt(max_rel_err(o, oref, (size_t)T * row, 1e-2), 2e-5);
    for (int s = 0; s < meta->num_seqs; s++) {
        int q0 = meta->cu_seqlens_q[s], q_len = meta->cu_seqlens_q[s + 1] - q0;
        for (int i = 0; i < q_len; i++) {
            int32_t cu1[2] = {0, 1}, len1 = (int32_t)pd_query_pos(meta->seq_lens[s], q_len, i) + 1;
            pd_attn_meta_t m1 = {1,
                                 1,
                                 cu1,
                                 &len1,
                                 meta->block_tables + (size_t)s * meta->max_blocks_per_seq,
                                 meta->max_blocks_per_seq,
                                 meta->slot_mapping + q0 + i,
                                 meta->sliding_window,
                                 NULL};
            ck_assert_int_eq(
                pd_cpu_paged_attention_decode(g_be, one, q + (size_t)(q0 + i) * row, kv, &m1, NH, scale),
                PD_OK);
            ck_assert_msg(memcmp(one, o + (size_t)(q0 + i) * row, row * sizeof(float)) == 0,
                          "batch-invariant attention: sequence %d query %d of %d differs from it alone", s, i,
                          q_len);
        }
    }
    g_be->batch_invariant = false;
    free(o), free(one);
}

static void run_attn_case(const attn_case_t *c)
{
    int bs = c->block_size, H = c->num_kv_heads, D = c->head_size, NH = c->num_heads;
    int max_blocks = 0, total_blocks = 1, num_tokens = 0, padding = 3;
    int seq_lens[6], cu[7];
    cu[0] = 0;
    for (int s = 0; s < c->num_seqs; s++) {
        seq_lens[s] = c->ctx_before[s] + c->q_lens[s];
        int nb = (int)pd_blocks_for_tokens(seq_lens[s], bs);
        max_blocks = nb > max_blocks ? nb : max_blocks;
        total_blocks += nb;
        num_tokens += c->q_lens[s];
        cu[s + 1] = num_tokens;
    }
    total_blocks += 5; /* spare blocks nobody owns */
    pd_kv_view_t kv = {NULL, c->dtype, total_blocks, bs, H, D};
    size_t cache_elems = (size_t)pd_page_elems(bs, H, D) * total_blocks;
    size_t cache_bytes = cache_elems * (size_t)pd_dtype_size(c->dtype);
    kv.base = malloc(cache_bytes);
    for (size_t i = 0; i < cache_elems; i++) {
        pd_dtype_store(kv.base, (int64_t)i, c->dtype, pd_rng_uniform_f(&g_rng, -1, 1));
    }
    /* shuffled block ids 1..total_blocks-1 handed out to sequences */
    int32_t *perm = malloc((size_t)total_blocks * sizeof(int32_t));
    for (int i = 0; i < total_blocks; i++) {
        perm[i] = i;
    }
    for (int i = total_blocks - 1; i > 1; i--) {
        int j = 1 + (int)pd_rng_below(&g_rng, (uint64_t)i);
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int32_t *tables = calloc((size_t)c->num_seqs * (max_blocks > 0 ? max_blocks : 1), sizeof(int32_t));
    int next = 1;
    for (int s = 0; s < c->num_seqs; s++) {
        for (int b = 0; b < pd_blocks_for_tokens(seq_lens[s], bs); b++) {
            tables[s * max_blocks + b] = perm[next++];
        }
    }
    /* new tokens (+ padding rows at the end with slot −1) */
    int rows = num_tokens + padding;
    float *k = rand_buf((size_t)rows * H * D, -1, 1), *v = rand_buf((size_t)rows * H * D, -1, 1);
    int32_t *slots = malloc((size_t)rows * sizeof(int32_t));
    for (int s = 0; s < c->num_seqs; s++) {
        for (int i = 0; i < c->q_lens[s]; i++) {
            slots[cu[s] + i] = (int32_t)pd_block_table_slot(tables, max_blocks, s,
                                                            pd_query_pos(seq_lens[s], c->q_lens[s], i), bs);
        }
    }
    for (int i = num_tokens; i < rows; i++) {
        slots[i] = -1;
    }
    void *cache_ref = malloc(cache_bytes);
    memcpy(cache_ref, kv.base, cache_bytes);
    pd_kv_view_t kv_ref = kv;
    kv_ref.base = cache_ref;
    ck_assert_int_eq(pd_cpu_reshape_and_cache(g_be, &kv, k, v, slots, rows), PD_OK);
    ck_assert_int_eq(pd_cpu_reshape_and_cache_ref(g_be, &kv_ref, k, v, slots, rows), PD_OK);
    ck_assert_int_eq(memcmp(kv.base, cache_ref, cache_bytes), 0);
    /* the written K row of the first new token reads back (after dtype rounding) */
    if (num_tokens > 0) {
        int64_t ki = pd_slot_kv_index(slots[0], 0, H - 1, bs, H, D);
        float back = pd_dtype_load(kv.base, ki + D - 1, c->dtype);
        float want = k[(size_t)(H - 1) * D + D - 1];
        ck_assert(fabsf(back - want) <= fabsf(want) * 4e-3f);
    }

    pd_attn_meta_t meta = {c->num_seqs, num_tokens, cu, seq_lens, tables, max_blocks, slots, c->window, NULL};
    float *q = rand_buf((size_t)num_tokens * NH * D, -1, 1);
    float *o = rand_buf((size_t)num_tokens * NH * D, -5, 5),
          *oref = rand_buf((size_t)num_tokens * NH * D, -5, 5);
    float scale = 1.0f / sqrtf((float)D);
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, &kv, &meta, NH, scale), PD_OK);
    ck_assert_int_eq(pd_cpu_paged_attention_prefill_ref(g_be, oref, q, &kv, &meta, NH, scale), PD_OK);
    ck_assert_double_lt(max_rel_err(o, oref, (size_t)num_tokens * NH * D, 1e-2), 2e-5);
    int all_decode = 1;
    for (int s = 0; s < c->num_seqs; s++) {
        all_decode &= c->q_lens[s] == 1;
    }
    if (all_decode) {
        /* the split-K decode kernel: each variant the host can run that serves this cache (fp32 math),
         * and the table's own choice */
        for (int dv = -1; dv < pd_cpu_num_attn_decode_variants; dv++) {
            const pd_cpu_attn_decode_variant_t *var = dv >= 0 ? &pd_cpu_attn_decode_variants[dv] : NULL;
            if (var != NULL && (!pd_cpu_isa_usable(var->isa) || !var->serves(&kv, 0, NH / H))) {
                continue;
            }
            pd_cpu_attn_decode_force(dv);
            float *od = rand_buf((size_t)num_tokens * NH * D, -5, 5);
            ck_assert_int_eq(pd_cpu_paged_attention_decode(g_be, od, q, &kv, &meta, NH, scale), PD_OK);
            ck_assert_msg(max_rel_err(od, oref, (size_t)num_tokens * NH * D, 1e-2) < 2e-5, "decode (%s): %g",
                          var != NULL ? var->name : "the table's choice",
                          max_rel_err(od, oref, (size_t)num_tokens * NH * D, 1e-2));
            g_decode_ran[dv >= 0 ? dv : 0] += var != NULL;
            free(od);
        }
        pd_cpu_attn_decode_force(-1);
    } else {
        ck_assert_int_eq(pd_cpu_paged_attention_decode(g_be, o, q, &kv, &meta, NH, scale),
                         PD_ERR_INVALID_ARG);
    }
    if (c->dtype == PD_DTYPE_BF16) {
        check_attn_bf16(&kv, &meta, q, NH, scale, oref, all_decode);
    }
    check_attn_invariant(&kv, &meta, q, NH, scale, oref);
    free(kv.base), free(cache_ref), free(perm), free(tables), free(k), free(v), free(slots), free(q), free(o);
    free(oref);
}

START_TEST(test_attention_random)
{
    int block_sizes[] = {1, 16, 32};
    pd_dtype_t dtypes[] = {PD_DTYPE_F32, PD_DTYPE_F16, PD_DTYPE_BF16};
    int gqa[][2] = {{4, 4}, {8, 2}, {6, 1}};
    int head_sizes[] = {8, 64, 80};
    for (int bi = 0; bi < 3; bi++) {
        for (int di = 0; di < 3; di++) {
            for (int gi = 0; gi < 3; gi++) {
                /* mixed prefill chunk / decode / fresh prompt / exact block multiples */
                attn_case_t c = {4,          {5, 1, 37, 16}, {0, 40, 19, 32},           block_sizes[bi],
                                 gqa[gi][0], gqa[gi][1],     head_sizes[(bi + gi) % 3], dtypes[di],
                                 0};
                run_attn_case(&c);
                attn_case_t d = {5,          {1, 1, 1, 1, 1}, {0, 15, 16, 100, 63},      block_sizes[bi],
                                 gqa[gi][0], gqa[gi][1],      head_sizes[(bi + di) % 3], dtypes[di],
                                 0};
                run_attn_case(&d);
            }
        }
    }
    /* sliding window, prefill and decode */
    attn_case_t w = {3, {20, 1, 9}, {30, 50, 0}, 16, 4, 2, 32, PD_DTYPE_F32, 24};
    run_attn_case(&w);
    attn_case_t wd = {2, {1, 1}, {70, 5}, 16, 4, 2, 32, PD_DTYPE_BF16, 16};
    run_attn_case(&wd);
    /* long decode contexts: one sequence split into many partitions, merged by log-sum-exp */
    attn_case_t longc = {1, {1}, {3000}, 16, 8, 2, 64, PD_DTYPE_F16, 0};
    run_attn_case(&longc);
    attn_case_t longw = {2, {1, 1}, {2500, 900}, 16, 8, 2, 64, PD_DTYPE_F32, 700};
    run_attn_case(&longw);
    attn_case_t longb = {3, {1, 1, 1}, {1000, 37, 600}, 32, 4, 4, 128, PD_DTYPE_BF16, 0};
    run_attn_case(&longb);
    /* the AVX-512 decode kernel's register tiles: a group of 3 with 128-wide heads (two 64-column
     * tiles; the 565 M model's shape), a group of 16 (four tiles of heads), 48-wide heads (a
     * partial column tile) */
    attn_case_t g3 = {4, {1, 1, 1, 1}, {200, 17, 64, 3}, 16, 12, 4, 128, PD_DTYPE_BF16, 0};
    run_attn_case(&g3);
    attn_case_t g16 = {3, {1, 1, 1}, {40, 100, 7}, 16, 16, 1, 64, PD_DTYPE_F32, 0};
    run_attn_case(&g16);
    attn_case_t d48 = {3, {1, 1, 1}, {90, 31, 250}, 32, 10, 2, 48, PD_DTYPE_F16, 40};
    run_attn_case(&d48);
    /* the GEMM-tiled prefill (q_len >= ATTN_MM_MIN_Q): several query tiles and key tiles, chunked
     * prefill after a context, sliding windows that cut inside tiles, GQA, every KV dtype, block 1 */
    attn_case_t tl = {3, {300, 33, 64}, {100, 0, 129}, 16, 8, 2, 64, PD_DTYPE_F32, 0};
    run_attn_case(&tl);
    attn_case_t tw = {2, {200, 90}, {10, 300}, 16, 4, 2, 32, PD_DTYPE_BF16, 50};
    run_attn_case(&tw);
    attn_case_t tb = {2, {129, 40}, {0, 7}, 1, 6, 1, 80, PD_DTYPE_F16, 0};
    run_attn_case(&tb);
    attn_case_t tm = {3, {1, 257, 1}, {500, 3, 20}, 32, 4, 4, 128, PD_DTYPE_BF16, 130};
    run_attn_case(&tm);
    /* head size that is not a multiple of 8: the portable kernel only */
    attn_case_t odd = {3, {1, 1, 1}, {40, 3, 300}, 16, 6, 2, 12, PD_DTYPE_F32, 0};
    run_attn_case(&odd);
    attn_case_t oddp = {2, {9, 3}, {40, 0}, 16, 6, 2, 12, PD_DTYPE_F16, 0};
    run_attn_case(&oddp);
    /* the tiled prefill's product engines: each the host can run ran on some bf16 case (a case whose
     * prefill is tiled: ATTN_MM_MIN_Q new tokens); the rest by name */
    for (int v = 0; v < pd_cpu_num_attn_mm_variants; v++) {
        const pd_cpu_attn_mm_variant_t *var = &pd_cpu_attn_mm_variants[v];
        if (!pd_cpu_isa_usable(var->isa) || !var->serves(1, 128)) {
            printf("tiled prefill engine %-11s not run: needs %s%s (kernels here run at %s)\n", var->name,
                   pd_cpu_isa_name(var->isa),
                   pd_cpu_isa_usable(var->isa) ? " and what its serves() checks" : "",
                   pd_cpu_isa_name(pd_cpu_isa_level()));
            continue;
        }
        printf("tiled prefill engine %-11s ran on %d bf16 cases\n", var->name, g_mm_ran[v]);
        ck_assert_msg(g_mm_ran[v] > 0, "tiled prefill engine %s can run here but no case used it", var->name);
    }
    /* the decode variant table: each entry the host can run ran on some case; the rest by name */
    for (int v = 0; v < pd_cpu_num_attn_decode_variants; v++) {
        const pd_cpu_attn_decode_variant_t *var = &pd_cpu_attn_decode_variants[v];
        if (!pd_cpu_isa_usable(var->isa)) {
            printf("decode attention variant %-9s not run: needs %s (kernels here run at %s)\n", var->name,
                   pd_cpu_isa_name(var->isa), pd_cpu_isa_name(pd_cpu_isa_level()));
            continue;
        }
        printf("decode attention variant %-9s ran on %d cases\n", var->name, g_decode_ran[v]);
        ck_assert_msg(g_decode_ran[v] > 0, "decode attention variant %s can run here but no case served it",
                      var->name);
    }
}
END_TEST

START_TEST(test_attention_rejects_bad_ids)
{
    int bs = 4, H = 1, D = 8;
    pd_kv_view_t kv = {NULL, PD_DTYPE_F32, 3, bs, H, D};
    kv.base = rand_buf((size_t)pd_page_elems(bs, H, D) * 3, -1, 1);
    float *k = rand_buf((size_t)2 * D, -1, 1), *v = rand_buf((size_t)2 * D, -1, 1);
    float *before = copy_buf(kv.base, (size_t)pd_page_elems(bs, H, D) * 3);
    int32_t slots[2] = {1, 12}; /* 3 blocks × 4 = 12 slots: 12 is one past the end */
    ck_assert_int_eq(pd_cpu_reshape_and_cache(g_be, &kv, k, v, slots, 2), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(pd_cpu_reshape_and_cache_ref(g_be, &kv, k, v, slots, 2), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(memcmp(kv.base, before, (size_t)pd_page_elems(bs, H, D) * 3 * sizeof(float)), 0);

    int32_t cu[2] = {0, 1}, seq_lens[1] = {6}, table[2] = {1, 3}; /* block 3 does not exist */
    pd_attn_meta_t meta = {1, 1, cu, seq_lens, table, 2, slots, 0, NULL};
    float *q = rand_buf(D, -1, 1), *o = rand_buf(D, -1, 1);
    ck_assert_int_eq(pd_cpu_paged_attention_decode(g_be, o, q, &kv, &meta, 1, 1.0f), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(pd_cpu_paged_attention_prefill_ref(g_be, o, q, &kv, &meta, 1, 1.0f),
                     PD_ERR_OUT_OF_RANGE);
    table[1] = -2;
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, &kv, &meta, 1, 1.0f), PD_ERR_OUT_OF_RANGE);
    table[1] = 2;
    seq_lens[0] = 9; /* needs 3 blocks, the table has 2 */
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, &kv, &meta, 1, 1.0f), PD_ERR_OUT_OF_RANGE);
    seq_lens[0] = 6;
    /* 3 query heads cannot share 1 kv head... they can; 3 query heads on 2 kv heads cannot */
    kv.num_kv_heads = 2;
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, &kv, &meta, 3, 1.0f), PD_ERR_INVALID_ARG);
    kv.num_kv_heads = 1;
    ck_assert_int_eq(pd_cpu_paged_attention_prefill(g_be, o, q, &kv, &meta, 1, 1.0f), PD_OK);
    free(kv.base), free(k), free(v), free(before), free(q), free(o);
}
END_TEST

/* reshape_and_cache rounds as pd_dtype_store does, bit for bit, on the values a vectorized rounding
 * gets wrong: NaNs (quiet and signaling, either sign: made quiet, never rounded into infinity),
 * infinities, zeros, subnormals, ties to even either way, and the largest floats (rounding up to
 * infinity). */
START_TEST(test_cache_store_edges)
{
    static const uint32_t bits[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff80ffffu, 0x7fbfffffu,
                                    0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u, 0x00000001u,
                                    0x807fffffu, 0x00008000u, 0x3f808000u, 0x3f818000u, 0xbf808000u,
                                    0x3f808001u, 0x3f807fffu, 0x7f7fffffu, 0xff7f8000u, 0x7f7f7fffu};
    enum { N = sizeof(bits) / sizeof(bits[0]), D = 32 }; /* one token, one head of D */
    float k[D], v[D];
    for (int d = 0; d < D; d++) {
        uint32_t kb = bits[d % N], vb = bits[(d + 7) % N];
        memcpy(&k[d], &kb, 4), memcpy(&v[d], &vb, 4);
    }
    pd_dtype_t dts[] = {PD_DTYPE_BF16, PD_DTYPE_F16, PD_DTYPE_F32};
    for (int i = 0; i < 3; i++) {
        size_t bytes = (size_t)pd_page_elems(4, 1, D) * pd_dtype_size(dts[i]);
        pd_kv_view_t kv = {calloc(1, bytes), dts[i], 1, 4, 1, D}, kv_ref = kv;
        kv_ref.base = calloc(1, bytes);
        int32_t slot = 2;
        ck_assert_int_eq(pd_cpu_reshape_and_cache(g_be, &kv, k, v, &slot, 1), PD_OK);
        ck_assert_int_eq(pd_cpu_reshape_and_cache_ref(g_be, &kv_ref, k, v, &slot, 1), PD_OK);
        ck_assert_msg(memcmp(kv.base, kv_ref.base, bytes) == 0, "dtype %d", (int)dts[i]);
        free(kv.base), free(kv_ref.base);
    }
}
END_TEST

/* ------------------------------------------------------------ sampling */

START_TEST(test_sampling_matches_reference)
{
    int vocab = 777, rows = 8;
    pd_sampling_params_t params[8] = {
        {0.0f, 0, 1.0f, 0.0f},  {1.0f, 0, 1.0f, 0.0f}, {0.7f, 40, 1.0f, 0.0f}, {1.3f, 0, 0.9f, 0.0f},
        {0.8f, 25, 0.5f, 0.0f}, {1.0f, 1, 1.0f, 0.0f}, {1.0f, 0, 1.0f, 0.3f},  {0.9f, 50, 0.95f, 0.05f},
    };
    for (int trial = 0; trial < 200; trial++) {
        float *logits = rand_buf((size_t)rows * vocab, -6, 6);
        for (int i = 1; trial % 2 == 1 && i < vocab; i += 2) { /* a grammar's mask on rows 1 and 3 */
            logits[vocab + i] = -INFINITY;
            logits[3 * vocab + i] = -INFINITY;
        }
        for (size_t i = 0; trial % 4 == 2 && i < (size_t)rows * vocab; i++) { /* ties, and -0 beside +0 */
            logits[i] = roundf(logits[i] * 0.5f) * 2.0f;
        }
        float *l1 = copy_buf(logits, (size_t)rows * vocab), *l2 = copy_buf(logits, (size_t)rows * vocab);
        pd_rng_t r1[8], r2[8];
        for (int i = 0; i < rows; i++) {
            pd_rng_seed(&r1[i], (uint64_t)(trial * 10 + i));
            pd_rng_seed(&r2[i], (uint64_t)(trial * 10 + i));
        }
        int32_t t1[8], t2[8];
        ck_assert_int_eq(pd_cpu_sample(g_be, t1, l1, rows, vocab, params, r1), PD_OK);
        ck_assert_int_eq(pd_cpu_sample_ref(g_be, t2, l2, rows, vocab, params, r2), PD_OK);
        for (int i = 0; i < rows; i++) {
            ck_assert_int_eq(t1[i], t2[i]);
            ck_assert(t1[i] >= 0 && t1[i] < vocab);
        }
        /* greedy and top_k = 1 are the argmax */
        int32_t best = 0, best5 = 0;
        for (int i = 1; i < vocab; i++) {
            best = logits[i] > logits[best] ? i : best;
            best5 = logits[5 * vocab + i] > logits[5 * vocab + best5] ? i : best5;
        }
        ck_assert_int_eq(t1[0], best);
        ck_assert_int_eq(t1[5], best5);
        /* top-k 40 picks one of the 40 largest */
        int larger = 0;
        for (int i = 0; i < vocab; i++) {
            larger += logits[2 * vocab + i] > logits[2 * vocab + t1[2]];
        }
        ck_assert_int_lt(larger, 40);
        /* min_p 0.3 at T = 1: the pick has at least 0.3 of the best token's probability */
        float zmax = logits[6 * vocab];
        for (int i = 1; i < vocab; i++) {
            zmax = logits[6 * vocab + i] > zmax ? logits[6 * vocab + i] : zmax;
        }
        ck_assert(expf(logits[6 * vocab + t1[6]] - zmax) >= 0.3f);
        free(logits), free(l1), free(l2);
    }
}
END_TEST

/* The sorts' specialisations (radix sorts) at a vocabulary of 70,000 (3 id digits): rows with top_p,
 * min_p and none, random and tied logits and a mask of -inf, draw what the reference draws. */
START_TEST(test_sampling_large_vocab_matches_reference)
{
    int vocab = 70000, rows = 4;
    pd_sampling_params_t params[4] = {
        {1.0f, 0, 0.9f, 0.0f}, {0.8f, 0, 1.0f, 0.01f}, {1.2f, 0, 0.999f, 0.0f}, {1.0f, 0, 1.0f, 0.0f}};
    for (int trial = 0; trial < 12; trial++) {
        float *logits = rand_buf((size_t)rows * vocab, -4, 4);
        for (size_t i = 0; i < (size_t)rows * vocab; i++) {
            if (trial % 3 == 1) {
                logits[i] = roundf(logits[i] * 4.0f) / 4.0f; /* many ties */
            }
            if (trial % 3 == 2 && i % 5 != 0) {
                logits[i] = -INFINITY; /* a grammar's mask */
            }
        }
        float *l1 = copy_buf(logits, (size_t)rows * vocab), *l2 = copy_buf(logits, (size_t)rows * vocab);
        pd_rng_t r1[4], r2[4];
        for (int i = 0; i < rows; i++) {
            pd_rng_seed(&r1[i], (uint64_t)(trial * 10 + i));
            pd_rng_seed(&r2[i], (uint64_t)(trial * 10 + i));
        }
        int32_t t1[4], t2[4];
        ck_assert_int_eq(pd_cpu_sample(g_be, t1, l1, rows, vocab, params, r1), PD_OK);
        ck_assert_int_eq(pd_cpu_sample_ref(g_be, t2, l2, rows, vocab, params, r2), PD_OK);
        for (int i = 0; i < rows; i++) {
            ck_assert_msg(t1[i] == t2[i], "trial %d row %d: %d against the reference's %d", trial, i, t1[i],
                          t2[i]);
            ck_assert(trial % 3 != 2 || t1[i] % 5 == 0); /* never a masked token */
        }
        free(logits), free(l1), free(l2);
    }
    /* a tie of +0 and -0 logits that top_p cuts through: the kept tokens are the tie's lowest ids,
     * whatever the sign (cand_cmp finds them equal) */
    float *z = calloc((size_t)vocab, sizeof(float));
    for (int i = 0; i < vocab; i++) {
        z[i] = i < 10 ? 5.0f : (i % 2 ? -0.0f : 0.0f);
    }
    pd_sampling_params_t tp = {1.0f, 0, 0.8f, 0.0f};
    for (int s = 0; s < 50; s++) {
        float *l1 = copy_buf(z, (size_t)vocab), *l2 = copy_buf(z, (size_t)vocab);
        pd_rng_t r1, r2;
        pd_rng_seed(&r1, (uint64_t)s);
        pd_rng_seed(&r2, (uint64_t)s);
        int32_t t1, t2;
        ck_assert_int_eq(pd_cpu_sample(g_be, &t1, l1, 1, vocab, &tp, &r1), PD_OK);
        ck_assert_int_eq(pd_cpu_sample_ref(g_be, &t2, l2, 1, vocab, &tp, &r2), PD_OK);
        ck_assert_int_eq(t1, t2);
        free(l1), free(l2);
    }
    free(z);
}
END_TEST

/* The greedy token through pd_sample_argmax (vectorized where the CPU has AVX-512) and through the
 * op, on rows built to catch a wrong index: ties at the maximum (lowest id wins), NaNs anywhere
 * (never win; a NaN at 0 stays), −0 before +0, −∞, a maximum in every tail position, every row
 * length from 1 to 70 and a 128 K vocabulary; checked against the scalar definition. */
static int32_t argmax_def(const float *z, int vocab)
{
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++) {
        best = z[i] > z[best] ? i : best;
    }
    return best;
}

START_TEST(test_sampling_argmax_edges)
{
    pd_rng_t r;
    pd_rng_seed(&r, 17);
    int lens[] = {1, 2, 15, 16, 17, 31, 33, 64, 70, 131072};
    float *z = malloc((size_t)131072 * sizeof(float));
    for (int v = 0; v < pd_cpu_num_argmax_variants; v++) {
        const pd_cpu_argmax_variant_t *var = &pd_cpu_argmax_variants[v];
        printf("argmax variant %-9s %s %s\n", var->name,
               pd_cpu_isa_usable(var->isa) ? "runs here" : "not run: needs",
               pd_cpu_isa_usable(var->isa) ? "" : pd_cpu_isa_name(var->isa));
    }
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        int vocab = lens[li];
        for (int trial = 0; trial < 400; trial++) {
            int kind = trial % 8;
            for (int i = 0; i < vocab; i++) { /* few distinct values: ties are common */
                z[i] = kind < 4 ? (float)(int)pd_rng_below(&r, 5) - 2.0f : pd_rng_uniform_f(&r, -3, 3);
            }
            int at = (int)pd_rng_below(&r, (uint64_t)vocab);
            if (kind == 1 || kind == 5) {
                z[at] = NAN;
            }
            if (kind == 2) {
                z[0] = NAN;
            }
            if (kind == 3) {
                for (int i = 0; i < vocab; i++) {
                    z[i] = i % 3 == 0 ? -0.0f : (i % 3 == 1 ? 0.0f : -INFINITY);
                }
            }
            if (kind == 6) {
                z[vocab - 1] = 9.0f; /* the maximum in the last, possibly partial, vector */
            }
            if (kind == 7) {
                for (int i = 0; i < vocab; i++) {
                    z[i] = -INFINITY;
                }
            }
            int32_t want = argmax_def(z, vocab);
            ck_assert_msg(pd_sample_argmax(z, vocab) == want, "vocab %d kind %d: %d, not %d", vocab, kind,
                          pd_sample_argmax(z, vocab), want);
            for (int v = 0; v < pd_cpu_num_argmax_variants; v++) { /* each variant the host can run */
                const pd_cpu_argmax_variant_t *var = &pd_cpu_argmax_variants[v];
                if (pd_cpu_isa_usable(var->isa)) {
                    ck_assert_msg(var->run(z, vocab) == want, "argmax %s: vocab %d kind %d: %d, not %d",
                                  var->name, vocab, kind, var->run(z, vocab), want);
                }
            }
        }
    }
    /* the op, rows split over the threads: greedy rows are the argmax; a batch with an invalid row
     * samples nothing */
    int vocab = 1000, rows = 7;
    float *l = rand_buf((size_t)rows * vocab, -5, 5);
    pd_sampling_params_t p[7];
    pd_rng_t rngs[7];
    for (int i = 0; i < rows; i++) {
        p[i] = (pd_sampling_params_t){0.0f, 0, 1.0f, 0.0f};
        pd_rng_seed(&rngs[i], (uint64_t)i);
    }
    int32_t t[7];
    ck_assert_int_eq(pd_cpu_sample(g_be, t, l, rows, vocab, p, rngs), PD_OK);
    for (int i = 0; i < rows; i++) {
        ck_assert_int_eq(t[i], argmax_def(l + (size_t)i * vocab, vocab));
    }
    p[5].temperature = -1.0f;
    int32_t untouched[7] = {-7, -7, -7, -7, -7, -7, -7};
    ck_assert_int_eq(pd_cpu_sample(g_be, untouched, l, rows, vocab, p, rngs), PD_ERR_INVALID_ARG);
    for (int i = 0; i < rows; i++) {
        ck_assert_int_eq(untouched[i], -7);
    }
    free(z), free(l);
}
END_TEST

START_TEST(test_sampling_distribution)
{
    /* 4 tokens with probabilities 0.1/0.2/0.3/0.4 at T = 1: empirical frequencies match, and
     * top_p 0.5 keeps only the two most likely tokens (0.4 + 0.3 crosses 0.5). */
    int vocab = 4;
    float base[4] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    pd_rng_t rng;
    pd_rng_seed(&rng, 99);
    int counts[4] = {0}, counts_p[4] = {0}, counts_m[4] = {0};
    /* min_p 0.6: tokens with p >= 0.6 * 0.4 = 0.24 stay (0.3 and 0.4) */
    pd_sampling_params_t p = {1.0f, 0, 1.0f, 0.0f}, pp = {1.0f, 0, 0.5f, 0.0f}, pm = {1.0f, 0, 1.0f, 0.6f};
    const int n = 40000;
    for (int i = 0; i < n; i++) {
        float l[4];
        int32_t t;
        memcpy(l, base, sizeof(l));
        ck_assert_int_eq(pd_cpu_sample(g_be, &t, l, 1, vocab, &p, &rng), PD_OK);
        counts[t]++;
        memcpy(l, base, sizeof(l));
        ck_assert_int_eq(pd_cpu_sample(g_be, &t, l, 1, vocab, &pp, &rng), PD_OK);
        counts_p[t]++;
        memcpy(l, base, sizeof(l));
        ck_assert_int_eq(pd_cpu_sample_ref(g_be, &t, l, 1, vocab, &pm, &rng), PD_OK);
        counts_m[t]++;
    }
    ck_assert_int_eq(counts_m[0] + counts_m[1], 0);
    ck_assert_double_eq_tol((double)counts_m[3] / n, 0.4 / 0.7, 0.015);
    for (int i = 0; i < 4; i++) {
        ck_assert_double_eq_tol((double)counts[i] / n, 0.1 * (i + 1), 0.01);
    }
    ck_assert_int_eq(counts_p[0] + counts_p[1], 0);
    ck_assert_double_eq_tol((double)counts_p[3] / n, 0.4 / 0.7, 0.015);
    /* same seed, same tokens */
    pd_rng_t a, b;
    pd_rng_seed(&a, 5);
    pd_rng_seed(&b, 5);
    for (int i = 0; i < 100; i++) {
        float l1[4], l2[4];
        int32_t t1, t2;
        memcpy(l1, base, sizeof(l1));
        memcpy(l2, base, sizeof(l2));
        pd_cpu_sample(g_be, &t1, l1, 1, vocab, &p, &a);
        pd_cpu_sample(g_be, &t2, l2, 1, vocab, &p, &b);
        ck_assert_int_eq(t1, t2);
    }
    pd_sampling_params_t bad = {-1.0f, 0, 1.0f, 0.0f};
    int32_t t;
    float l[4];
    memcpy(l, base, sizeof(l));
    ck_assert_int_eq(pd_cpu_sample(g_be, &t, l, 1, vocab, &bad, &rng), PD_ERR_INVALID_ARG);
}
END_TEST

START_TEST(test_pages_gather_scatter)
{
    size_t region_bytes = 1 << 20;
    unsigned char *region = malloc(region_bytes), *region2 = malloc(region_bytes);
    for (size_t i = 0; i < region_bytes; i++) {
        region[i] = (unsigned char)(pd_rng_next(&g_rng) | 1);
    }
    int counts[] = {3, 200};
    for (int ci = 0; ci < 2; ci++) {
        int n = counts[ci];
        pd_page_range_t *r = malloc((size_t)n * sizeof(*r));
        size_t total = 0;
        for (int i = 0; i < n; i++) {
            r[i].length = 64 + pd_rng_below(&g_rng, 2000);
            r[i].offset = pd_rng_below(&g_rng, region_bytes - r[i].length);
            total += r[i].length;
        }
        unsigned char *s1 = malloc(total), *s2 = malloc(total);
        ck_assert_int_eq(pd_cpu_gather_pages(g_be, s1, region, r, n), PD_OK);
        ck_assert_int_eq(pd_cpu_gather_pages_ref(g_be, s2, region, r, n), PD_OK);
        ck_assert_int_eq(memcmp(s1, s2, total), 0);
        ck_assert_int_eq(memcmp(s1, region + r[0].offset, r[0].length), 0);
        /* scatter into a zeroed region: each range's bytes land at its offset (non-overlapping
         * ranges only: make them disjoint by laying them out in order) */
        uint64_t off = 0;
        for (int i = 0; i < n; i++) {
            r[i].offset = off;
            off += r[i].length + 17;
        }
        memset(region2, 0, region_bytes);
        ck_assert_int_eq(pd_cpu_scatter_pages(g_be, region2, s1, r, n), PD_OK);
        size_t src = 0;
        for (int i = 0; i < n; i++) {
            ck_assert_int_eq(memcmp(region2 + r[i].offset, s1 + src, r[i].length), 0);
            ck_assert_int_eq(region2[r[i].offset + r[i].length], 0);
            src += r[i].length;
        }
        /* mirror copy (the connector's staging): the disjoint ranges land at the same offsets,
         * every byte between them keeps its old value */
        memset(region2, 0xA5, region_bytes);
        ck_assert_int_eq(g_be->ops->copy_pages(g_be, region2, region, r, n, PD_COPY_D2H), PD_OK);
        for (int i = 0; i < n; i++) {
            ck_assert_int_eq(memcmp(region2 + r[i].offset, region + r[i].offset, r[i].length), 0);
            ck_assert_int_eq(region2[r[i].offset + r[i].length], 0xA5);
        }
        free(r), free(s1), free(s2);
    }
    free(region), free(region2);
}
END_TEST

START_TEST(test_backend_accounting)
{
    pd_backend_t *ref = NULL;
    ck_assert_int_eq(pd_backend_create("cpu-ref", 1, &ref), PD_OK);
    ck_assert_str_eq(ref->ops->name, "cpu-ref");
    pd_backend_destroy(ref);
    ref = NULL;
    ck_assert_int_eq(pd_backend_create("tpu", 1, &ref), PD_ERR_NOT_FOUND);
    ck_assert_ptr_null(ref);
    void *a = NULL, *b = NULL;
    ck_assert_int_eq(g_be->ops->alloc(g_be, 1000, &a), PD_OK);
    ck_assert_int_eq(g_be->ops->alloc(g_be, 3000, &b), PD_OK);
    ck_assert_uint_eq((uintptr_t)a % 64, 0);
    ck_assert_uint_eq(g_be->bytes_in_use, 4000);
    g_be->ops->free(g_be, a);
    ck_assert_uint_eq(g_be->bytes_in_use, 3000);
    ck_assert_uint_eq(g_be->bytes_peak, 4000);
    pd_backend_reset_peak(g_be);
    ck_assert_uint_eq(g_be->bytes_peak, 3000);
    g_be->ops->free(g_be, b);
    ck_assert_uint_eq(g_be->bytes_in_use, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("cpu");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_dtype_conversions);
    tcase_add_test(tc, test_index_math);
    tcase_add_test(tc, test_matmul);
    tcase_add_test(tc, test_matmul_variants);
    tcase_add_test(tc, test_matmul_row_invariant);
    tcase_add_test(tc, test_cpu_isa_cap);
    tcase_add_test(tc, test_matmul_bf16_math);
    tcase_add_test(tc, test_split_bf16x3);
    tcase_add_test(tc, test_bf16w_batch_invariant);
    tcase_add_test(tc, test_matmul_bf16_packed);
    tcase_add_test(tc, test_matmul_cols32);
    tcase_add_test(tc, test_matmul_bf16_math_packed);
    tcase_add_test(tc, test_matmul_bf16_amx);
    tcase_add_test(tc, test_matmul_bf16_big);
    tcase_add_test(tc, test_norms);
    tcase_add_test(tc, test_elementwise);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_rope_cache);
    tcase_add_test(tc, test_attention_random);
    tcase_add_test(tc, test_attention_rejects_bad_ids);
    tcase_add_test(tc, test_cache_store_edges);
    tcase_add_test(tc, test_sampling_matches_reference);
    tcase_add_test(tc, test_sampling_large_vocab_matches_reference);
    tcase_add_test(tc, test_sampling_distribution);
    tcase_add_test(tc, test_sampling_argmax_edges);
    tcase_add_test(tc, test_pages_gather_scatter);
    tcase_add_test(tc, test_backend_accounting);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
