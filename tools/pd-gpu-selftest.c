/* tools/pd-gpu-selftest.c — checks the CUDA backend against the CPU reference on a machine with a
 * GPU (built with CUDA; CTest label "gpu"):
 *   1. every op: random inputs (never zero), output buffers poisoned (NaN bytes) before each run,
 *      CUDA vs the "cpu-ref" backend within the dtype tolerance (fp32 1e-5 relative to the
 *      largest reference value; fp16/bf16 caches 1e-2); every CUDA call checked by the backend;
 *   2. the tiny model end to end: greedy generations and their logprobs through the engine on
 *      --device cuda vs --device cpu (same tokens, logprobs within 1e-3);
 *   3. timing: paged decode attention bytes/s vs a device-to-device copy, and --model's
 *      tokens/s at batch 1 and 8 (with --model DIR, e.g. the demo preset).
 * Exit 0 only if every check passed; 77 ("skipped: no CUDA device") without a GPU.
 *   pd-gpu-selftest --tiny DIR [--model DIR] */
#define _GNU_SOURCE
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/flags.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "engine/engine.h"
#include "kernels/backend.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/paged_impl.h"

static pd_backend_t *g_cpu, *g_gpu;
static pd_rng_t g_rng;
static int g_failed, g_checks;

static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = pd_rng_uniform_f(&g_rng, 0.05f, 1.0f);
        x[i] = pd_rng_below(&g_rng, 2) ? v : -v; /* never zero */
    }
}

static void *to_gpu(const void *host, size_t bytes)
{
    void *d = NULL;
    if (g_gpu->ops->alloc(g_gpu, bytes, &d) != PD_OK ||
        (host != NULL && g_gpu->ops->copy(g_gpu, d, host, bytes, PD_COPY_H2D) != PD_OK)) {
        fprintf(stderr, "selftest: device allocation/copy failed\n");
        exit(1);
    }
    return d;
}

/* A poisoned device buffer (0xFF bytes: NaN as float). */
static void *poisoned(size_t bytes)
{
    void *h = malloc(bytes);
    memset(h, 0xff, bytes);
    void *d = to_gpu(h, bytes);
    free(h);
    return d;
}

static void from_gpu(void *host, const void *dev, size_t bytes)
{
    if (g_gpu->ops->copy(g_gpu, host, dev, bytes, PD_COPY_D2H) != PD_OK) {
        fprintf(stderr, "selftest: device copy failed\n");
        exit(1);
    }
}

/* max |a − b| / max |b| over n floats; NaN counts as a failure. */
static void compare(const char *what, const float *got, const float *want, size_t n, double tol)
{
    double maxd = 0, maxv = 1e-30;
    bool nan = false;
    for (size_t i = 0; i < n; i++) {
        nan = nan || isnan(got[i]) || isnan(want[i]);
        double d = fabs((double)got[i] - want[i]);
        maxd = d > maxd ? d : maxd;
        maxv = fabs(want[i]) > maxv ? fabs(want[i]) : maxv;
    }
    double rel = maxd / maxv;
    bool ok = !nan && rel <= tol;
    g_checks++;
    g_failed += !ok;
    printf("%-44s %s  max rel diff %.2e (tolerance %.0e)%s\n", what, ok ? "ok  " : "FAIL", rel, tol,
           nan ? " — NaN in the output" : "");
}

static void check_status(const char *what, pd_status_t a, pd_status_t b)
{
    if (a != PD_OK || b != PD_OK) {
        printf("%-44s FAIL  cpu %s, cuda %s\n", what, pd_status_str(a), pd_status_str(b));
        g_failed++;
        g_checks++;
    }
}

static void test_elementwise(void)
{
    int rows = 37, dim = 384, vocab = 1000, inter = 320, k = 256, n = 200;
    size_t N = (size_t)rows * dim;
    float *x = malloc(N * 4), *w = malloc((size_t)dim * 4), *b = malloc((size_t)dim * 4);
    float *ref = malloc(N * 8 + (size_t)vocab * dim * 4), *got = malloc(N * 8 + (size_t)vocab * dim * 4);
    fill(x, N), fill(w, (size_t)dim), fill(b, (size_t)dim);
    float *dx = to_gpu(x, N * 4), *dw = to_gpu(w, (size_t)dim * 4), *db = to_gpu(b, (size_t)dim * 4);
    /* rmsnorm, layernorm */
    float *dout = poisoned(N * 4);
    check_status("rmsnorm", g_cpu->ops->rmsnorm(g_cpu, ref, x, w, rows, dim, 1e-6f),
                 g_gpu->ops->rmsnorm(g_gpu, dout, dx, dw, rows, dim, 1e-6f));
    from_gpu(got, dout, N * 4);
    compare("rmsnorm [37][384]", got, ref, N, 1e-5);
    g_gpu->ops->free(g_gpu, dout);
    dout = poisoned(N * 4);
    check_status("layernorm", g_cpu->ops->layernorm(g_cpu, ref, x, w, b, rows, dim, 1e-5f),
                 g_gpu->ops->layernorm(g_gpu, dout, dx, dw, db, rows, dim, 1e-5f));
    from_gpu(got, dout, N * 4);
    compare("layernorm [37][384]", got, ref, N, 1e-5);
    /* add, gelu, softmax (in place on copies) */
    float *y = malloc(N * 4);
    fill(y, N);
    memcpy(ref, y, N * 4);
    float *dy = to_gpu(y, N * 4);
    check_status("add", g_cpu->ops->add(g_cpu, ref, x, N), g_gpu->ops->add(g_gpu, dy, dx, N));
    from_gpu(got, dy, N * 4);
    compare("add [14208]", got, ref, N, 1e-6);
    memcpy(ref, x, N * 4);
    float *dg = to_gpu(x, N * 4);
    check_status("gelu", g_cpu->ops->gelu(g_cpu, ref, N), g_gpu->ops->gelu(g_gpu, dg, N));
    from_gpu(got, dg, N * 4);
    compare("gelu [14208]", got, ref, N, 1e-5);
    memcpy(ref, x, N * 4);
    g_gpu->ops->copy(g_gpu, dg, x, N * 4, PD_COPY_H2D);
    check_status("softmax", g_cpu->ops->softmax(g_cpu, ref, rows, dim),
                 g_gpu->ops->softmax(g_gpu, dg, rows, dim));
    from_gpu(got, dg, N * 4);
    compare("softmax [37][384]", got, ref, N, 1e-5);
    /* rope on [rows tokens][6 heads][64] */
    int32_t pos[37];
    for (int i = 0; i < rows; i++) {
        pos[i] = (int32_t)pd_rng_below(&g_rng, 4000);
    }
    /* a default table, then a scaled one (llama3-style frequencies, YaRN-style attention factor) */
    pd_rope_t rope;
    memset(&rope, 0, sizeof(rope));
    rope.half = 32;
    rope.scale = 1.0f;
    for (int i = 0; i < 32; i++) {
        rope.inv_freq[i] = 1.0 / pow(10000.0, (2.0 * i) / 64);
    }
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            for (int i = 16; i < 32; i++) {
                rope.inv_freq[i] /= 8.0;
            }
            rope.scale = 1.2f;
        }
        memcpy(ref, x, N * 4);
        g_gpu->ops->copy(g_gpu, dg, x, N * 4, PD_COPY_H2D);
        check_status("rope", g_cpu->ops->rope(g_cpu, ref, pos, rows, 6, 64, &rope),
                     g_gpu->ops->rope(g_gpu, dg, pos, rows, 6, 64, &rope));
        from_gpu(got, dg, N * 4);
        compare(pass == 0 ? "rope [37][6][64], positions < 4000" : "rope scaled table", got, ref, N, 1e-5);
    }
    /* silu_mul [rows][2·inter] → [rows][inter] */
    size_t GU = (size_t)rows * 2 * inter;
    float *gu = malloc(GU * 4);
    fill(gu, GU);
    float *dgu = to_gpu(gu, GU * 4), *dsm = poisoned((size_t)rows * inter * 4);
    check_status("silu_mul", g_cpu->ops->silu_mul(g_cpu, ref, gu, rows, inter),
                 g_gpu->ops->silu_mul(g_gpu, dsm, dgu, rows, inter));
    from_gpu(got, dsm, (size_t)rows * inter * 4);
    compare("silu_mul [37][320]", got, ref, (size_t)rows * inter, 1e-5);
    check_status("gelu_mul", g_cpu->ops->gelu_mul(g_cpu, ref, gu, rows, inter),
                 g_gpu->ops->gelu_mul(g_gpu, dsm, dgu, rows, inter));
    from_gpu(got, dsm, (size_t)rows * inter * 4);
    compare("gelu_mul [37][320]", got, ref, (size_t)rows * inter, 1e-5);
    /* embed */
    float *table = malloc((size_t)vocab * dim * 4);
    fill(table, (size_t)vocab * dim);
    int32_t ids[37];
    for (int i = 0; i < rows; i++) {
        ids[i] = (int32_t)pd_rng_below(&g_rng, (uint64_t)vocab);
    }
    float *dtab = to_gpu(table, (size_t)vocab * dim * 4), *demb = poisoned(N * 4);
    pd_weight_t tw = {table, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0},
                dtw = {dtab, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0};
    check_status("embed", g_cpu->ops->embed(g_cpu, ref, tw, 1.0f, ids, rows, dim, vocab),
                 g_gpu->ops->embed(g_gpu, demb, dtw, 1.0f, ids, rows, dim, vocab));
    from_gpu(got, demb, N * 4);
    compare("embed [37][384] of 1000", got, ref, N, 0);
    /* a bf16 table, scaled (Gemma's √hidden) */
    uint16_t *t16 = malloc((size_t)vocab * dim * 2);
    for (size_t i = 0; i < (size_t)vocab * dim; i++) {
        t16[i] = pd_f32_to_bf16(table[i]);
    }
    void *dt16 = to_gpu(t16, (size_t)vocab * dim * 2);
    pd_weight_t tw16 = {t16, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0},
                dtw16 = {dt16, PD_DTYPE_BF16, NULL, PD_WEIGHT_ROWS, 0};
    check_status("embed (bf16)", g_cpu->ops->embed(g_cpu, ref, tw16, 3.0f, ids, rows, dim, vocab),
                 g_gpu->ops->embed(g_gpu, demb, dtw16, 3.0f, ids, rows, dim, vocab));
    from_gpu(got, demb, N * 4);
    compare("embed [37][384] of 1000, bf16 table × 3", got, ref, N, 0);
    int32_t bad = vocab;
    pd_status_t est = g_gpu->ops->embed(g_gpu, demb, dtw, 1.0f, &bad, 1, dim, vocab);
    g_checks++;
    g_failed += est != PD_ERR_OUT_OF_RANGE;
    printf("%-44s %s\n", "embed refuses an id outside the vocabulary",
           est == PD_ERR_OUT_OF_RANGE ? "ok" : "FAIL");
    /* matmul with and without bias: [rows][k] · [n][k]ᵀ */
    float *mx = malloc((size_t)rows * k * 4), *mw = malloc((size_t)n * k * 4), *mb = malloc((size_t)n * 4);
    fill(mx, (size_t)rows * k), fill(mw, (size_t)n * k), fill(mb, (size_t)n);
    float *dmx = to_gpu(mx, (size_t)rows * k * 4), *dmb = to_gpu(mb, (size_t)n * 4);
    pd_weight_t mw_ = {mw, PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0},
                dmw = {to_gpu(mw, (size_t)n * k * 4), PD_DTYPE_F32, NULL, PD_WEIGHT_ROWS, 0};
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        float *dmy = poisoned((size_t)rows * n * 4);
        check_status("matmul", g_cpu->ops->matmul(g_cpu, ref, mx, mw_, with_bias ? mb : NULL, rows, n, k),
                     g_gpu->ops->matmul(g_gpu, dmy, dmx, dmw, with_bias ? dmb : NULL, rows, n, k));
        from_gpu(got, dmy, (size_t)rows * n * 4);
        compare(with_bias ? "matmul [37][256]·[200][256]ᵀ + bias" : "matmul [37][256]·[200][256]ᵀ", got, ref,
                (size_t)rows * n, 1e-5);
        g_gpu->ops->free(g_gpu, dmy);
    }
    /* reduced-precision tensor-core inputs (--matmul-precision), fp32 accumulate */
    static const struct {
        pd_matmul_precision_t p;
        const char *name;
        double tol;
    } precs[] = {{PD_MATMUL_TF32, "matmul, tf32 inputs", 5e-3},
                 {PD_MATMUL_FP16, "matmul, fp16 inputs", 5e-3},
                 {PD_MATMUL_BF16, "matmul, bf16 inputs", 1e-2}};
    for (size_t i = 0; i < sizeof(precs) / sizeof(precs[0]); i++) {
        float *dmy = poisoned((size_t)rows * n * 4);
        g_gpu->matmul_precision = precs[i].p;
        check_status("matmul (reduced precision)", g_cpu->ops->matmul(g_cpu, ref, mx, mw_, NULL, rows, n, k),
                     g_gpu->ops->matmul(g_gpu, dmy, dmx, dmw, NULL, rows, n, k));
        g_gpu->matmul_precision = PD_MATMUL_FP32;
        from_gpu(got, dmy, (size_t)rows * n * 4);
        compare(precs[i].name, got, ref, (size_t)rows * n, precs[i].tol);
        g_gpu->ops->free(g_gpu, dmy);
    }
    /* 16-bit weights (checkpoint precision): the device rounds x to the weight's dtype too */
    for (int dt = PD_DTYPE_F16; dt <= PD_DTYPE_BF16; dt++) {
        uint16_t *w16 = malloc((size_t)n * k * 2);
        for (size_t i = 0; i < (size_t)n * k; i++) {
            pd_dtype_store(w16, (int64_t)i, (pd_dtype_t)dt, mw[i]);
        }
        pd_weight_t hw = {w16, (pd_dtype_t)dt, NULL, PD_WEIGHT_ROWS, 0},
                    dw16 = {to_gpu(w16, (size_t)n * k * 2), (pd_dtype_t)dt, NULL, PD_WEIGHT_ROWS, 0};
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            float *dmy = poisoned((size_t)rows * n * 4);
            check_status("matmul (16-bit weights)",
                         g_cpu->ops->matmul(g_cpu, ref, mx, hw, with_bias ? mb : NULL, rows, n, k),
                         g_gpu->ops->matmul(g_gpu, dmy, dmx, dw16, with_bias ? dmb : NULL, rows, n, k));
            from_gpu(got, dmy, (size_t)rows * n * 4);
            compare(dt == PD_DTYPE_BF16 ? "matmul, bf16 weights" : "matmul, fp16 weights", got, ref,
                    (size_t)rows * n, dt == PD_DTYPE_BF16 ? 1e-2 : 5e-3);
            g_gpu->ops->free(g_gpu, dmy);
        }
        g_gpu->ops->free(g_gpu, (void *)dw16.data);
        free(w16);
    }
    g_gpu->ops->free(g_gpu, (void *)dmw.data);
    g_gpu->ops->free(g_gpu, dt16);
    free(t16);
    free(x), free(w), free(b), free(ref), free(got), free(y), free(gu), free(table), free(mx), free(mw),
        free(mb);
}

/* Sampling of device logits vs the CPU sampler with identically seeded generators: greedy,
 * temperature, top-k, top-p and their mixes, rows of one batch with different parameters. */
static void test_sample(void)
{
    enum { ROWS = 48, VOCAB = 5003 };
    float *logits = malloc((size_t)ROWS * VOCAB * 4), *scratch = malloc((size_t)ROWS * VOCAB * 4);
    for (size_t i = 0; i < (size_t)ROWS * VOCAB; i++) {
        logits[i] = pd_rng_uniform_f(&g_rng, -8.0f, 8.0f);
    }
    logits[7 * VOCAB + 11] = logits[7 * VOCAB + 12] = 40.0f; /* a tie: lowest id first */
    pd_sampling_params_t params[ROWS];
    for (int r = 0; r < ROWS; r++) {
        static const float temps[] = {0.0f, 0.7f, 1.0f, 1.5f};
        static const int ks[] = {0, 1, 5, 50, 4999};
        static const float ps[] = {1.0f, 0.9f, 0.5f, 0.05f};
        static const float min_ps[] = {0.0f, 0.0f, 0.1f, 0.5f, 0.0f, 0.02f, 1.0f};
        params[r] = (pd_sampling_params_t){temps[r % 4], ks[(r / 4) % 5], ps[(r / 2) % 4], min_ps[r % 7]};
    }
    pd_rng_t rc[ROWS], rg[ROWS];
    for (int r = 0; r < ROWS; r++) {
        pd_rng_seed(&rc[r], 1000 + (uint64_t)r);
        pd_rng_seed(&rg[r], 1000 + (uint64_t)r);
    }
    float *dl = to_gpu(logits, (size_t)ROWS * VOCAB * 4);
    int32_t want[ROWS], got[ROWS];
    int same = 0;
    for (int round = 0; round < 4; round++) { /* the generators advance: four draws per row */
        memcpy(scratch, logits, (size_t)ROWS * VOCAB * 4);
        check_status("sample", g_cpu->ops->sample(g_cpu, want, scratch, ROWS, VOCAB, params, rc),
                     g_gpu->ops->sample(g_gpu, got, dl, ROWS, VOCAB, params, rg));
        for (int r = 0; r < ROWS; r++) {
            same += want[r] == got[r];
        }
    }
    /* a token exactly on a top-p or draw boundary may differ (sums in another order): allow 1 */
    bool ok = same >= 4 * ROWS - 1;
    g_checks++;
    g_failed += !ok;
    printf("%-44s %s  %d of %d tokens equal to the CPU sampler\n", "sample (greedy/T/top-k/top-p)",
           ok ? "ok  " : "FAIL", same, 4 * ROWS);
    g_gpu->ops->free(g_gpu, dl);
    free(logits), free(scratch);
}

/* Attention over a random paged cache: block tables shuffled, GQA 8 on 2, lengths up to 1300. */
static void test_attention(pd_dtype_t dt, const char *dtname)
{
    int bs = 16, H = 2, D = 64, heads = 8, nblocks = 400;
    size_t page = (size_t)pd_page_elems(bs, H, D) * (size_t)pd_dtype_size(dt);
    size_t kvbytes = page * (size_t)nblocks;
    void *kvh = malloc(kvbytes);
    pd_kv_view_t hv = {kvh, dt, nblocks, bs, H, D};
    /* fill the cache through reshape_and_cache on both backends (checks that op too) */
    int ntok = nblocks * bs;
    float *k = malloc((size_t)ntok * H * D * 4), *v = malloc((size_t)ntok * H * D * 4);
    fill(k, (size_t)ntok * H * D), fill(v, (size_t)ntok * H * D);
    int32_t *slots = malloc((size_t)ntok * 4);
    for (int i = 0; i < ntok; i++) {
        slots[i] = i % 97 == 5 ? -1 : i; /* a few padding slots stay untouched */
    }
    memset(kvh, 0, kvbytes);
    void *kvd = to_gpu(kvh, kvbytes);
    pd_kv_view_t dv = {kvd, dt, nblocks, bs, H, D};
    float *dk = to_gpu(k, (size_t)ntok * H * D * 4), *dvv = to_gpu(v, (size_t)ntok * H * D * 4);
    check_status("reshape_and_cache", g_cpu->ops->reshape_and_cache(g_cpu, &hv, k, v, slots, ntok),
                 g_gpu->ops->reshape_and_cache(g_gpu, &dv, dk, dvv, slots, ntok));
    void *back = malloc(kvbytes);
    from_gpu(back, kvd, kvbytes);
    bool same = memcmp(back, kvh, kvbytes) == 0;
    g_checks++;
    g_failed += !same;
    printf("%-44s %s\n",
           dt == PD_DTYPE_F32   ? "reshape_and_cache fp32 (bit-exact)"
           : dt == PD_DTYPE_F16 ? "reshape_and_cache fp16 (bit-exact)"
                                : "reshape_and_cache bf16 (bit-exact)",
           same ? "ok" : "FAIL");
    /* 4 sequences: mixed prefill chunks and context lengths (5 and 3 queries after a context are the
     * speculative verify step: k + 1 tokens scored at once); tables use shuffled blocks */
    int seq_lens[4] = {1300, 37, 530, 17}, q_lens[4] = {5, 37, 1, 3}, maxb = 100;
    int32_t *tables = malloc((size_t)4 * maxb * 4);
    int32_t *perm = malloc((size_t)nblocks * 4);
    for (int i = 0; i < nblocks; i++) {
        perm[i] = i;
    }
    for (int i = nblocks - 1; i > 0; i--) {
        int j = (int)pd_rng_below(&g_rng, (uint64_t)i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < 4 * maxb; i++) {
        tables[i] = perm[i % nblocks];
    }
    int32_t cu[5] = {0};
    for (int s = 0; s < 4; s++) {
        cu[s + 1] = cu[s] + q_lens[s];
    }
    int T = cu[4];
    pd_attn_meta_t m = {4, T, cu, seq_lens, tables, maxb, NULL, 0, NULL};
    float *q = malloc((size_t)T * heads * D * 4), *ref = malloc((size_t)T * heads * D * 4),
          *got = malloc((size_t)T * heads * D * 4);
    fill(q, (size_t)T * heads * D);
    float *dq = to_gpu(q, (size_t)T * heads * D * 4), *dout = poisoned((size_t)T * heads * D * 4);
    double tol = dt == PD_DTYPE_F32 ? 1e-5 : 1e-2;
    check_status("paged_attention_prefill",
                 g_cpu->ops->paged_attention_prefill(g_cpu, ref, q, &hv, &m, heads, 0.125f),
                 g_gpu->ops->paged_attention_prefill(g_gpu, dout, dq, &dv, &m, heads, 0.125f));
    from_gpu(got, dout, (size_t)T * heads * D * 4);
    char name[96];
    snprintf(name, sizeof(name), "paged attention prefill, %s cache", dtname);
    compare(name, got, ref, (size_t)T * heads * D, tol);
    /* sliding window */
    m.sliding_window = 100;
    g_gpu->ops->free(g_gpu, dout);
    dout = poisoned((size_t)T * heads * D * 4);
    check_status("paged_attention_prefill window",
                 g_cpu->ops->paged_attention_prefill(g_cpu, ref, q, &hv, &m, heads, 0.125f),
                 g_gpu->ops->paged_attention_prefill(g_gpu, dout, dq, &dv, &m, heads, 0.125f));
    from_gpu(got, dout, (size_t)T * heads * D * 4);
    snprintf(name, sizeof(name), "  … with a 100-token sliding window");
    compare(name, got, ref, (size_t)T * heads * D, tol);
    m.sliding_window = 0;
    /* decode: one token per sequence, long contexts use several split-K partitions */
    int dl[4] = {1600, 1, 700, 513};
    int32_t cud[5] = {0, 1, 2, 3, 4};
    pd_attn_meta_t md = {4, 4, cud, dl, tables, maxb, NULL, 0, NULL};
    g_gpu->ops->free(g_gpu, dout);
    dout = poisoned((size_t)4 * heads * D * 4);
    check_status("paged_attention_decode",
                 g_cpu->ops->paged_attention_decode(g_cpu, ref, q, &hv, &md, heads, 0.125f),
                 g_gpu->ops->paged_attention_decode(g_gpu, dout, dq, &dv, &md, heads, 0.125f));
    from_gpu(got, dout, (size_t)4 * heads * D * 4);
    snprintf(name, sizeof(name), "paged attention decode (split-K), %s cache", dtname);
    compare(name, got, ref, (size_t)4 * heads * D, tol);
    /* gather + scatter of pages round trip */
    pd_page_range_t ranges[3] = {{page * 7, page}, {page * 2, page * 2}, {page * 100, page}};
    void *stage = poisoned(page * 4);
    check_status("gather_pages", PD_OK, g_gpu->ops->gather_pages(g_gpu, stage, kvd, ranges, 3));
    void *stage_h = malloc(page * 4);
    from_gpu(stage_h, stage, page * 4);
    bool gok = memcmp(stage_h, (char *)kvh + page * 7, page) == 0 &&
               memcmp((char *)stage_h + page, (char *)kvh + page * 2, page * 2) == 0 &&
               memcmp((char *)stage_h + page * 3, (char *)kvh + page * 100, page) == 0;
    g_checks++;
    g_failed += !gok;
    printf("%-44s %s\n", "gather_pages (3 ranges)", gok ? "ok" : "FAIL");
    /* mirror copies (the KV connector's staging): device → pinned host mirror → fresh device copy,
     * only the ranges move, the bytes around them keep their poison */
    unsigned char *mirror = malloc(kvbytes);
    memset(mirror, 0xA5, kvbytes);
    bool pinned = g_gpu->ops->pin_host(g_gpu, mirror, kvbytes) == PD_OK;
    check_status("copy_pages D2H", PD_OK, g_gpu->ops->copy_pages(g_gpu, mirror, kvd, ranges, 3, PD_COPY_D2H));
    void *kvd2 = poisoned(kvbytes);
    check_status("copy_pages H2D", PD_OK,
                 g_gpu->ops->copy_pages(g_gpu, kvd2, mirror, ranges, 3, PD_COPY_H2D));
    unsigned char *back2 = malloc(kvbytes), *poison = malloc(kvbytes);
    from_gpu(back2, kvd2, kvbytes);
    memset(poison, 0xA5, kvbytes);
    bool cok = pinned;
    for (int i = 0; i < 3; i++) {
        cok = cok &&
              memcmp(mirror + ranges[i].offset, (char *)kvh + ranges[i].offset, ranges[i].length) == 0 &&
              memcmp(back2 + ranges[i].offset, (char *)kvh + ranges[i].offset, ranges[i].length) == 0;
    }
    cok = cok && memcmp(mirror, poison, page * 2) == 0 && memcmp(mirror + page * 4, poison, page * 3) == 0;
    g_checks++;
    g_failed += !cok;
    printf("%-44s %s\n", "copy_pages D2H/H2D via a pinned mirror", cok ? "ok" : "FAIL");
    if (pinned) {
        g_gpu->ops->unpin_host(g_gpu, mirror);
    }
    g_gpu->ops->free(g_gpu, kvd2);
    free(mirror), free(back2), free(poison);
    free(kvh), free(k), free(v), free(slots), free(back), free(tables), free(perm), free(q), free(ref),
        free(got), free(stage_h);
    g_gpu->ops->free(g_gpu, kvd);
}

/* Greedy generations of prompts through the engine on cpu and cuda; returns tokens/s on cuda. */
static double engine_run(const char *model, const char *device, int batch, int max_tokens,
                         int32_t *tokens_out, float *lps_out)
{
    pd_engine_config_t cfg;
    pd_engine_config_defaults(&cfg);
    cfg.model_dir = model;
    cfg.device = device;
    cfg.kv_cache_memory = (size_t)2 << 30;
    cfg.max_model_len = 512;
    pd_engine_t *e = NULL;
    if (pd_engine_create(&cfg, &e) != PD_OK) {
        printf("engine on %s: cannot start\n", device);
        g_failed++;
        return 0;
    }
    char err[128];
    for (int b = 0; b < batch; b++) {
        int32_t prompt[24];
        for (int i = 0; i < 24; i++) {
            prompt[i] = 5 + (b * 31 + i * 7) % 200;
        }
        char id[16];
        snprintf(id, sizeof(id), "%d", b);
        pd_engine_request_t rq = {0};
        rq.id = id;
        rq.prompt = prompt;
        rq.num_prompt = 24;
        rq.params.max_tokens = max_tokens;
        rq.params.ignore_eos = true;
        rq.params.logprobs = 1;
        pd_engine_add(e, &rq, err, sizeof(err));
    }
    int n = 0;
    double t0 = pd_time_now_s();
    while (pd_engine_has_work(e)) {
        pd_engine_output_t *outs = NULL;
        pd_engine_step(e, &outs);
        for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
            if (o->token >= 0 && tokens_out != NULL) {
                tokens_out[n] = o->token; /* same order on both devices: the schedule is the same */
                lps_out[n] = o->logprob;
            }
            n += o->token >= 0;
        }
        pd_engine_output_free(outs);
    }
    double dt = pd_time_now_s() - t0;
    pd_engine_destroy(e);
    return dt > 0 ? n / dt : 0;
}

/* Paged decode attention: bytes of K and V read per second vs a device-to-device copy of the same
 * bytes (32 sequences × 4096 tokens, fp32 cache, GQA 8 on 2, head 64, block 16). */
static void time_attention(void)
{
    int seqs = 32, ctx = 4096, bs = 16, H = 2, D = 64, heads = 8, maxb = ctx / bs, nblocks = seqs * maxb;
    size_t page = (size_t)pd_page_elems(bs, H, D) * 4, kvbytes = page * (size_t)nblocks;
    void *kv = poisoned(kvbytes), *copy = poisoned(kvbytes);
    int32_t *tables = malloc((size_t)nblocks * 4), lens[32], cu[33];
    for (int i = 0; i < nblocks; i++) {
        tables[i] = (i % seqs) * maxb + i / seqs; /* blocks interleaved across sequences */
    }
    for (int s = 0; s < seqs; s++) {
        lens[s] = ctx;
        cu[s] = s;
    }
    cu[seqs] = seqs;
    float *q = malloc((size_t)seqs * heads * D * 4);
    fill(q, (size_t)seqs * heads * D);
    float *dq = to_gpu(q, (size_t)seqs * heads * D * 4), *dout = poisoned((size_t)seqs * heads * D * 4);
    pd_kv_view_t v = {kv, PD_DTYPE_F32, nblocks, bs, H, D};
    pd_attn_meta_t m = {seqs, seqs, cu, lens, tables, maxb, NULL, 0, NULL};
    /* fp32 cache filled with NaN bytes would poison the softmax: zero it first */
    void *zero = calloc(1, kvbytes);
    g_gpu->ops->copy(g_gpu, kv, zero, kvbytes, PD_COPY_H2D);
    free(zero);
    double best_a = 1e30, best_c = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        g_gpu->ops->synchronize(g_gpu);
        double t0 = pd_time_now_s();
        g_gpu->ops->paged_attention_decode(g_gpu, dout, dq, &v, &m, heads, 0.125f);
        g_gpu->ops->synchronize(g_gpu);
        double t1 = pd_time_now_s();
        g_gpu->ops->copy(g_gpu, copy, kv, kvbytes, PD_COPY_D2D);
        double t2 = pd_time_now_s();
        best_a = t1 - t0 < best_a ? t1 - t0 : best_a;
        best_c = t2 - t1 < best_c ? t2 - t1 : best_c;
    }
    double ga = (double)kvbytes / best_a / 1e9, gc = 2.0 * kvbytes / best_c / 1e9; /* copy reads + writes */
    printf("%-44s %.1f GB/s read vs d2d copy %.1f GB/s moved = %.2fx\n",
           "paged decode attention, 4k ctx, fp32", ga, gc, ga / gc);
    g_gpu->ops->free(g_gpu, kv), g_gpu->ops->free(g_gpu, copy), g_gpu->ops->free(g_gpu, dq),
        g_gpu->ops->free(g_gpu, dout);
    free(tables), free(q);
}

int main(int argc, char **argv)
{
    const char *tiny = NULL, *model = NULL;
    const pd_flag_t flags[] = {
        {"tiny", PD_FLAG_STR, &tiny, "the tiny model (pd-mkmodel --preset tiny) for the end-to-end check",
         NULL},
        {"model", PD_FLAG_STR, &model, "a bigger model for the tokens/s row (e.g. the demo preset)", NULL},
    };
    if (pd_flags_parse(flags, 2, argc, argv, "usage: pd-gpu-selftest --tiny DIR [--model DIR]", NULL) !=
        PD_OK) {
        return 2;
    }
    pd_log_set_level(PD_LOG_WARN);
    if (pd_cuda_device_count() == 0) {
        printf(
            "skipped: no CUDA device (the CUDA backend was compiled and linked; run this on a GPU node)\n");
        return 77;
    }
    pd_rng_seed(&g_rng, 2024);
    if (pd_backend_create("cpu-ref", 1, &g_cpu) != PD_OK || pd_backend_create("cuda", 0, &g_gpu) != PD_OK) {
        printf("FAIL: cannot create the backends\n");
        return 1;
    }
    printf("== ops: CUDA vs the CPU reference ==\n");
    test_elementwise();
    test_sample();
    test_attention(PD_DTYPE_F32, "fp32");
    test_attention(PD_DTYPE_F16, "fp16");
    test_attention(PD_DTYPE_BF16, "bf16");
    if (tiny != NULL) {
        printf("== tiny model, greedy, 4 × 16 tokens: cuda vs cpu ==\n");
        int32_t tc[64], tg[64];
        float lc[64], lg[64];
        engine_run(tiny, "cpu", 4, 16, tc, lc);
        engine_run(tiny, "cuda", 4, 16, tg, lg);
        int diff = 0;
        double maxlp = 0;
        for (int i = 0; i < 64; i++) {
            diff += tc[i] != tg[i];
            maxlp = fabs((double)lc[i] - lg[i]) > maxlp ? fabs((double)lc[i] - lg[i]) : maxlp;
        }
        g_checks++;
        g_failed += diff != 0 || maxlp > 1e-3;
        printf("%-44s %s  %d tokens differ, max |Δlogprob| %.2e\n", "tiny model generations",
               diff == 0 && maxlp <= 1e-3 ? "ok  " : "FAIL", diff, maxlp);
    }
    printf("== timing ==\n");
    time_attention();
    if (model != NULL) {
        double t1 = engine_run(model, "cuda", 1, 64, NULL, NULL),
               t8 = engine_run(model, "cuda", 8, 64, NULL, NULL);
        printf("%-44s %.1f tokens/s (batch 1), %.1f tokens/s (batch 8)\n", "model decode on cuda", t1, t8);
    }
    pd_backend_destroy(g_cpu);
    pd_backend_destroy(g_gpu);
    printf("%d of %d checks passed\n", g_checks - g_failed, g_checks);
    return g_failed == 0 ? 0 : 1;
}
