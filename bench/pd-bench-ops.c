/* bench/pd-bench-ops.c — CPU compute benchmarks, each against a baseline measured in the same run:
 *   1. paged attention decode: bytes of KV read per second vs this machine's memcpy bandwidth
 *      (working set larger than the last-level cache, and a cache-resident case)
 *   2. matmul on the model's shapes: GFLOP/s vs a large square OpenBLAS sgemm (the BLAS peak here)
 *   3. decode tokens/s of a model (default: the demo preset) single-stream and batched, vs the
 *      roofline: (weight bytes + the step's KV bytes) / the multi-thread read bandwidth (a decode
 *      step reads its weights and KV; memcpy also writes, and understates what can be read)
 * Prints a table; --results FILE appends it (with the command, machine and date) as markdown. */
#define _GNU_SOURCE
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "bench/op_profile.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "kernels/backend.h"
#include "kernels/cpu/attention_prefill_tiled.h"
#include "kernels/cpu/isa.h"
#include "kernels/paged_impl.h"
#include "model/model.h"

typedef struct row {
    char name[96];
    char value[48];
    char baseline[64];
    char ratio[32];
} row_t;

static row_t g_rows[128];
static int g_nrows;

/* Prints a row and keeps it for --results (rows past the table's size are printed only). */
static void add_row(const char *name, const char *value, const char *baseline, double ratio)
{
    row_t spare, *r = g_nrows < (int)(sizeof(g_rows) / sizeof(g_rows[0])) ? &g_rows[g_nrows++] : &spare;
    snprintf(r->name, sizeof(r->name), "%s", name);
    snprintf(r->value, sizeof(r->value), "%s", value);
    snprintf(r->baseline, sizeof(r->baseline), "%s", baseline);
    if (ratio > 0) {
        snprintf(r->ratio, sizeof(r->ratio), "%.2fx", ratio);
    } else {
        snprintf(r->ratio, sizeof(r->ratio), "-");
    }
    printf("%-52s %14s   %-28s %8s\n", r->name, r->value, r->baseline, r->ratio);
    fflush(stdout);
}

static void progress(const char *what)
{
    pd_log_info("bench: %s", what);
}

/* ------------------------------------------------------------------ memcpy baseline */

/* Bytes copied per second by memcpy over a buffer much larger than the LLC, split over threads. */
/* The baselines' buffers come from the backend's allocator, as the weights and the KV cache do: the
 * same page size (2 MiB-aligned, transparent huge pages asked for), so that a baseline does not pay
 * TLB misses the model's streams do not (until 2026-11-29 they were malloc'd 4 KiB pages, and
 * decode read up to 1.6x "the read roofline"). NULL when it cannot allocate. */
static void *baseline_alloc(pd_backend_t *be, size_t bytes)
{
    void *p = NULL;
    return be->ops->alloc(be, bytes, &p) == PD_OK ? p : NULL;
}

static double memcpy_gbps(pd_backend_t *be, size_t bytes, int threads)
{
    char *a = baseline_alloc(be, bytes), *b = baseline_alloc(be, bytes);
    if (a == NULL || b == NULL) {
        be->ops->free(be, a);
        be->ops->free(be, b);
        return 0;
    }
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int rep = 0; rep < 7; rep++) {
        double t0 = pd_time_now_s();
#pragma omp parallel num_threads(threads)
        {
            int n = omp_get_num_threads(), i = omp_get_thread_num();
            size_t chunk = bytes / (size_t)n;
            memcpy(b + (size_t)i * chunk, a + (size_t)i * chunk,
                   i == n - 1 ? bytes - (size_t)i * chunk : chunk);
        }
        double dt = pd_time_now_s() - t0;
        best = dt < best ? dt : best;
    }
    be->ops->free(be, a);
    be->ops->free(be, b);
    return (double)bytes / best / 1e9;
}

/* Bytes read per second over a buffer much larger than the LLC, split over threads (a 64-bit XOR
 * reduction the compiler vectorises: loads only, as a GEMV's weight stream). */
static double read_gbps(pd_backend_t *be, size_t bytes, int threads)
{
    uint64_t *a = baseline_alloc(be, bytes);
    if (a == NULL) {
        return 0;
    }
    size_t n = bytes / sizeof(uint64_t);
    for (size_t i = 0; i < n; i++) {
        a[i] = i * 0x9e3779b97f4a7c15ull;
    }
    double best = 1e30;
    volatile uint64_t sink = 0;
    for (int rep = 0; rep < 7; rep++) {
        double t0 = pd_time_now_s();
        uint64_t acc = 0;
#pragma omp parallel num_threads(threads) reduction(^ : acc)
        {
            int nt = omp_get_num_threads(), t = omp_get_thread_num();
            size_t chunk = n / (size_t)nt, lo = (size_t)t * chunk, hi = t == nt - 1 ? n : lo + chunk;
            uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
            size_t i = lo;
            for (; i + 4 <= hi; i += 4) {
                x0 ^= a[i], x1 ^= a[i + 1], x2 ^= a[i + 2], x3 ^= a[i + 3];
            }
            for (; i < hi; i++) {
                x0 ^= a[i];
            }
            acc ^= x0 ^ x1 ^ x2 ^ x3;
        }
        double dt = pd_time_now_s() - t0;
        sink ^= acc;
        best = dt < best ? dt : best;
    }
    (void)sink;
    be->ops->free(be, a);
    return (double)bytes / best / 1e9;
}

/* ------------------------------------------------------------------ attention */

typedef struct attn_setup {
    pd_kv_view_t kv;
    int32_t *tables, *cu, *seq_lens, *slots;
    float *q, *out;
    int num_seqs, ctx, num_heads, max_blocks;
    pd_attn_meta_t meta;
} attn_setup_t;

static void attn_make(attn_setup_t *s, pd_backend_t *be, int num_seqs, int ctx, int num_heads, int kv_heads,
                      int head, int bs, pd_dtype_t dt)
{
    memset(s, 0, sizeof(*s));
    s->num_seqs = num_seqs;
    s->ctx = ctx;
    s->num_heads = num_heads;
    s->max_blocks = (int)pd_blocks_for_tokens(ctx, bs);
    int nblocks = num_seqs * s->max_blocks + 1;
    s->kv = (pd_kv_view_t){NULL, dt, nblocks, bs, kv_heads, head};
    size_t elems = (size_t)pd_page_elems(bs, kv_heads, head) * (size_t)nblocks;
    be->ops->alloc(be, elems * (size_t)pd_dtype_size(dt), &s->kv.base);
    pd_rng_t r;
    pd_rng_seed(&r, 1);
    for (size_t i = 0; i < elems; i++) {
        pd_dtype_store(s->kv.base, (int64_t)i, dt, pd_rng_uniform_f(&r, -1, 1));
    }
    s->tables = malloc((size_t)num_seqs * s->max_blocks * sizeof(int32_t));
    /* blocks interleaved across sequences, as a busy pool hands them out */
    for (int q = 0; q < num_seqs; q++) {
        for (int b = 0; b < s->max_blocks; b++) {
            s->tables[q * s->max_blocks + b] = 1 + b * num_seqs + q;
        }
    }
    s->cu = malloc((size_t)(num_seqs + 1) * sizeof(int32_t));
    s->seq_lens = malloc((size_t)num_seqs * sizeof(int32_t));
    s->slots = malloc((size_t)num_seqs * sizeof(int32_t));
    for (int q = 0; q <= num_seqs; q++) {
        s->cu[q] = q;
    }
    for (int q = 0; q < num_seqs; q++) {
        s->seq_lens[q] = ctx;
        s->slots[q] = -1;
    }
    s->q = malloc((size_t)num_seqs * num_heads * head * sizeof(float));
    s->out = malloc((size_t)num_seqs * num_heads * head * sizeof(float));
    for (int i = 0; i < num_seqs * num_heads * head; i++) {
        s->q[i] = pd_rng_uniform_f(&r, -1, 1);
    }
    s->meta =
        (pd_attn_meta_t){num_seqs, num_seqs, s->cu, s->seq_lens, s->tables, s->max_blocks, s->slots, 0, NULL};
}

static void attn_free(attn_setup_t *s, pd_backend_t *be)
{
    be->ops->free(be, s->kv.base);
    free(s->tables), free(s->cu), free(s->seq_lens), free(s->slots), free(s->q), free(s->out);
}

/* The median of t[n] (sorted in place; n is small). */
static double median_s(double *t, int n)
{
    for (int i = 1; i < n; i++) { /* insertion sort */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    }
    return t[n / 2];
}

/* Median seconds of reps calls of the backend's decode attention. */
static double attn_time(attn_setup_t *s, pd_backend_t *be, int reps)
{
    double *t = malloc((size_t)reps * sizeof(double));
    float scale = 1.0f / sqrtf((float)s->kv.head_size);
    be->ops->paged_attention_decode(be, s->out, s->q, &s->kv, &s->meta, s->num_heads, scale); /* warm */
    for (int i = 0; i < reps; i++) {
        double t0 = pd_time_now_s();
        be->ops->paged_attention_decode(be, s->out, s->q, &s->kv, &s->meta, s->num_heads, scale);
        t[i] = pd_time_now_s() - t0;
    }
    double med = median_s(t, reps);
    free(t);
    return med;
}

/* Prefill attention of one fresh sequence of T tokens (causal), GFLOP/s: 2 FLOP per multiply-add
 * of S = QKᵀ and of PV over the T(T+1)/2 visible query–key pairs of every query head. Best of
 * reps after a warm-up; bf16 runs bf16 attention math (--matmul-precision bf16 on a bf16 cache). */
static double attn_prefill_gflops(pd_backend_t *be, int T, int nh, int kvh, int D, int bf16, int reps)
{
    attn_setup_t s;
    attn_make(&s, be, 1, T, nh, kvh, D, 16, PD_DTYPE_BF16);
    free(s.q), free(s.out), free(s.slots);
    s.q = malloc((size_t)T * nh * D * sizeof(float));
    s.out = malloc((size_t)T * nh * D * sizeof(float));
    s.slots = malloc((size_t)T * sizeof(int32_t));
    for (size_t i = 0; i < (size_t)T * nh * D; i++) {
        s.q[i] = (float)(i % 17) * 0.05f - 0.4f;
    }
    for (int i = 0; i < T; i++) {
        s.slots[i] = -1;
    }
    s.cu[1] = T;
    s.meta = (pd_attn_meta_t){1, T, s.cu, s.seq_lens, s.tables, s.max_blocks, s.slots, 0, NULL};
    float scale = 1.0f / sqrtf((float)D);
    pd_matmul_precision_t saved = be->matmul_precision;
    be->matmul_precision = bf16 ? PD_MATMUL_BF16 : PD_MATMUL_FP32;
    double best = 1e30;
    for (int i = 0; i <= reps; i++) { /* the first is a warm-up */
        double t0 = pd_time_now_s();
        be->ops->paged_attention_prefill(be, s.out, s.q, &s.kv, &s.meta, nh, scale);
        double dt = pd_time_now_s() - t0;
        best = i > 0 && dt < best ? dt : best;
    }
    be->matmul_precision = saved;
    attn_free(&s, be);
    return 4.0 * D * nh * ((double)T * (T + 1) / 2) / best / 1e9;
}

/* Prefill attention at 512 and 2048 tokens in GEMM tiles: fp32 math against the sgemm peak, bf16
 * math against the bf16 GEMM peak (issue 18's goal: ≥ 0.5× at 2048 tokens). */
static void bench_attention_prefill(pd_backend_t *be, double peak, double bpeak)
{
    struct {
        int nh, kvh, D;
        const char *shape;
    } shapes[] = {{8, 2, 64, "demo: 8 q / 2 kv heads of 64"}, {12, 4, 128, "565M: 12 q / 4 kv heads of 128"}};
    char base[2][64], name[112], val[48];
    snprintf(base[0], sizeof(base[0]), "sgemm 2048^3 %.1f GFLOP/s", peak);
    snprintf(base[1], sizeof(base[1]), "bf16 GEMM 2048^3 %.1f GFLOP/s", bpeak);
    for (int sh = 0; sh < 2; sh++) {
        int Ts[] = {512, 2048};
        for (int ti = 0; ti < 2; ti++) {
            for (int bf16 = 0; bf16 <= 1; bf16++) {
                double g =
                    attn_prefill_gflops(be, Ts[ti], shapes[sh].nh, shapes[sh].kvh, shapes[sh].D, bf16, 3);
                snprintf(name, sizeof(name), "attn prefill %d tok, %s, bf16 KV, %s math", Ts[ti],
                         shapes[sh].shape, bf16 ? "bf16" : "fp32");
                snprintf(val, sizeof(val), "%.1f GFLOP/s", g);
                add_row(name, val, base[bf16], g / (bf16 ? bpeak : peak));
            }
        }
    }
}

static void bench_attention(pd_backend_t *be, pd_backend_t *ref, double memcpy_bw)
{
    struct {
        int seqs, ctx;
        pd_dtype_t dt;
        const char *note;
        bool bf16_math; /* --matmul-precision bf16: attention_bf16.h's math (AVX512-BF16 items) */
    } cases[] = {
        {32, 4096, PD_DTYPE_F32, "DRAM", false},
        {32, 4096, PD_DTYPE_BF16, "DRAM", false},
        {32, 4096, PD_DTYPE_F16, "DRAM", false},
        {1, 4096, PD_DTYPE_F32, "LLC", false},
        {8, 1024, PD_DTYPE_F32, "LLC", false},
        {32, 96, PD_DTYPE_BF16, "LLC, a batch-32 step at a short context", false},
        {32, 4096, PD_DTYPE_BF16, "DRAM, bf16 math", true},
        {32, 96, PD_DTYPE_BF16, "LLC, short context, bf16 math", true},
    };
    const char *dtn[] = {"fp32", "fp16", "bf16"};
    char base[64];
    snprintf(base, sizeof(base), "memcpy %.2f GB/s", memcpy_bw);
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        attn_setup_t s;
        attn_make(&s, be, cases[c].seqs, cases[c].ctx, 8, 2, 64, 16, cases[c].dt);
        double kv_bytes = (double)cases[c].seqs * cases[c].ctx * 2 * 2 * 64 * pd_dtype_size(cases[c].dt);
        be->matmul_precision = cases[c].bf16_math ? PD_MATMUL_BF16 : PD_MATMUL_FP32;
        double t = attn_time(&s, be, 15);
        be->matmul_precision = PD_MATMUL_FP32;
        char name[96], val[48];
        snprintf(name, sizeof(name), "attn decode %s %dx%d ctx (%.0f MiB KV, %s)", dtn[cases[c].dt],
                 cases[c].seqs, cases[c].ctx, kv_bytes / (1 << 20), cases[c].note);
        snprintf(val, sizeof(val), "%.2f GB/s", kv_bytes / t / 1e9);
        add_row(name, val, base, kv_bytes / t / 1e9 / memcpy_bw);
        if (c == 0) {
            double tr = attn_time(&s, ref, 1);
            snprintf(name, sizeof(name), "  same, reference implementation");
            snprintf(val, sizeof(val), "%.3f GB/s", kv_bytes / tr / 1e9);
            char b2[64];
            snprintf(b2, sizeof(b2), "optimized %.2f GB/s", kv_bytes / t / 1e9);
            add_row(name, val, b2, t / tr);
        }
        attn_free(&s, be);
    }
}

/* ------------------------------------------------------------------ sampling */

/* One sampled token at a 128 k vocabulary (Llama 3's 128,256), the op against its reference
 * (cpu-ref: the qsorts the semantics are written in; they draw the same tokens, test_kernels):
 * nothing cut, top_p, min_p, and a grammar's mask (4 in 5 tokens at -inf) with top_p. */
static void bench_sampling(pd_backend_t *be, pd_backend_t *ref)
{
    const int vocab = 128256, reps = 20;
    struct {
        const char *what;
        pd_sampling_params_t p;
        bool masked;
    } cases[] = {
        {"temperature 1 (nothing cut)", {1.0f, 0, 1.0f, 0.0f}, false},
        {"top_p 0.9", {1.0f, 0, 0.9f, 0.0f}, false},
        {"min_p 0.05", {1.0f, 0, 1.0f, 0.05f}, false},
        {"top_p 0.9, 4/5 masked (a grammar)", {1.0f, 0, 0.9f, 0.0f}, true},
    };
    float *logits = malloc((size_t)vocab * sizeof(float)), *work = malloc((size_t)vocab * sizeof(float));
    pd_rng_t g;
    pd_rng_seed(&g, 1);
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        for (int i = 0; i < vocab; i++) {
            logits[i] = cases[c].masked && i % 5 != 0 ? -INFINITY : (float)(pd_rng_uniform(&g) * 8.0 - 4.0);
        }
        double t[2][20];
        for (int b = 0; b < 2; b++) {
            for (int r = 0; r < reps; r++) {
                memcpy(work, logits, (size_t)vocab * sizeof(float));
                pd_rng_t rng;
                pd_rng_seed(&rng, (uint64_t)r);
                int32_t tok;
                double t0 = pd_time_now_s();
                (b ? ref : be)->ops->sample(b ? ref : be, &tok, work, 1, vocab, &cases[c].p, &rng);
                t[b][r] = pd_time_now_s() - t0;
            }
        }
        double tf = median_s(t[0], reps), tr = median_s(t[1], reps);
        char name[96], val[48], base[64];
        snprintf(name, sizeof(name), "sample 1 token, vocab %d, %s", vocab, cases[c].what);
        snprintf(val, sizeof(val), "%.3f ms", tf * 1e3);
        snprintf(base, sizeof(base), "reference %.3f ms", tr * 1e3);
        add_row(name, val, base, tr / tf);
    }
    free(logits);
    free(work);
}

/* ------------------------------------------------------------------ matmul */

/* Best time of reps matmuls y[m][n] = x[m][k] · w[n][k]ᵀ with w stored as dt (after one warm-up);
 * as_model: w laid out first by the backend's prepare_weight, as the model's weights are (the
 * library peaks are measured on row-major weights). */
static double matmul_seconds(pd_backend_t *be, pd_dtype_t dt, int m, int n, int k, int reps, bool as_model)
{
    float *x = malloc((size_t)m * k * 4), *y = malloc((size_t)m * n * 4);
    void *w = malloc((size_t)n * k * (size_t)pd_dtype_size(dt));
    for (size_t i = 0; i < (size_t)m * k; i++) {
        x[i] = (float)(i % 13) * 0.1f - 0.6f;
    }
    for (size_t i = 0; i < (size_t)n * k; i++) {
        pd_dtype_store(w, (int64_t)i, dt, (float)(i % 7) * 0.1f - 0.3f);
    }
    float *scale = NULL;
    if (dt == PD_DTYPE_I8) { /* int8 values i % 7 - 3, scaled back to the fp32 rows' magnitude */
        scale = malloc((size_t)n * sizeof(float));
        for (int j = 0; j < n; j++) {
            scale[j] = 0.1f;
        }
        for (size_t i = 0; i < (size_t)n * k; i++) {
            ((int8_t *)w)[i] = (int8_t)(i % 7) - 3;
        }
    }
    pd_weight_t wt = {w, dt, scale, PD_WEIGHT_ROWS, 0};
    if (as_model && be->ops->prepare_weight != NULL) { /* laid out as the model's weights are */
        (void)be->ops->prepare_weight(be, &wt, n, k, 0);
    }
    be->ops->matmul(be, y, x, wt, NULL, m, n, k);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = pd_time_now_s();
        be->ops->matmul(be, y, x, wt, NULL, m, n, k);
        double dt_s = pd_time_now_s() - t0;
        best = dt_s < best ? dt_s : best;
    }
    free(x), free(w), free(y), free(scale);
    return best;
}

static double sgemm_gflops(pd_backend_t *be, pd_dtype_t dt, int m, int n, int k, int reps)
{
    return 2.0 * m * n * k / matmul_seconds(be, dt, m, n, k, reps, false) / 1e9;
}

/* The bf16 GEMM peak: 2048³ with bf16 weights under --matmul-precision bf16 (oneDNN). */
static double bf16_gemm_peak(pd_backend_t *be)
{
    pd_matmul_precision_t saved = be->matmul_precision;
    be->matmul_precision = PD_MATMUL_BF16;
    double g = sgemm_gflops(be, PD_DTYPE_BF16, 2048, 2048, 2048, 5);
    be->matmul_precision = saved;
    return g;
}

static const char *dt_name(pd_dtype_t dt)
{
    return dt == PD_DTYPE_BF16 ? "bf16" : dt == PD_DTYPE_F16 ? "fp16" : dt == PD_DTYPE_I8 ? "int8" : "fp32";
}

/* Returns the measured BLAS peak (GFLOP/s), used as the compute roofline of the model; bpeak is
 * the bf16 GEMM peak, the baseline of the bf16-math rows. */
static double bench_matmul(pd_backend_t *be, double read_bw, double bpeak)
{
    double peak = sgemm_gflops(be, PD_DTYPE_F32, 2048, 2048, 2048, 5);
    char base[64], val[48], name[96];
    snprintf(base, sizeof(base), "sgemm 2048^3 %.1f GFLOP/s", peak);
    snprintf(val, sizeof(val), "%.1f GFLOP/s", peak);
    add_row("sgemm 2048x2048x2048 (OpenBLAS peak here)", val, "", 0);
    struct {
        int m, n, k;
        const char *what;
    } shapes[] = {
        {256, 2816, 512, "prefill 256 tok: gate_up 512->2816"},
        {256, 512, 1408, "prefill 256 tok: down 1408->512"},
        {32, 2816, 512, "decode batch 32: gate_up"},
        {8, 2816, 512, "decode batch 8: gate_up"},
        {1, 2816, 512, "decode batch 1: gate_up (gemv)"},
        {256, 2048, 512, "prefill 256 tok: lm_head 512->2048"},
        {2048, 2048, 2048, "2048^3"},
    };
    pd_dtype_t dts[] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_F16, PD_DTYPE_I8};
    for (size_t d = 0; d < 4; d++) {
        for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
            if (d == 0 && shapes[i].m == 2048) {
                continue; /* the peak itself */
            }
            double g =
                sgemm_gflops(be, dts[d], shapes[i].m, shapes[i].n, shapes[i].k, shapes[i].m > 1000 ? 3 : 20);
            snprintf(val, sizeof(val), "%.1f GFLOP/s", g);
            snprintf(name, sizeof(name), "%s, %s weights", shapes[i].what, dt_name(dts[d]));
            add_row(name, val, base, g / peak);
        }
    }
    /* the same shapes in bf16 math (--matmul-precision bf16: oneDNN above 16 or 32 rows) */
    snprintf(val, sizeof(val), "%.1f GFLOP/s", bpeak);
    add_row("bf16 GEMM 2048^3, bf16 math (oneDNN peak here)", val, base, bpeak / peak);
    snprintf(base, sizeof(base), "bf16 GEMM 2048^3 %.1f GFLOP/s", bpeak);
    be->matmul_precision = PD_MATMUL_BF16;
    for (size_t i = 0; i + 1 < sizeof(shapes) / sizeof(shapes[0]); i++) { /* the last, 2048³, is bpeak */
        double g = sgemm_gflops(be, PD_DTYPE_BF16, shapes[i].m, shapes[i].n, shapes[i].k, 20);
        snprintf(val, sizeof(val), "%.1f GFLOP/s", g);
        snprintf(name, sizeof(name), "%s, bf16 weights, bf16 math", shapes[i].what);
        add_row(name, val, base, g / bpeak);
    }
    be->matmul_precision = PD_MATMUL_FP32;
    snprintf(base, sizeof(base), "sgemm 2048^3 %.1f GFLOP/s", peak);
    /* batch-1 GEMV over 512 MiB of weights (as the read baseline): bytes of w per second vs reads */
    snprintf(base, sizeof(base), "read %.1f GB/s", read_bw);
    for (size_t d = 0; d < 4; d++) {
        int k = 4096, n = (int)((512u << 20) / ((size_t)k * pd_dtype_size(dts[d])));
        double bytes = (double)n * k * pd_dtype_size(dts[d]);
        double gbs = bytes / matmul_seconds(be, dts[d], 1, n, k, 5, false) / 1e9;
        snprintf(val, sizeof(val), "%.2f GB/s", gbs);
        snprintf(name, sizeof(name), "gemv 4096->%d, %s weights (%.0f MiB, DRAM)", n, dt_name(dts[d]),
                 bytes / (1 << 20));
        add_row(name, val, base, gbs / read_bw);
    }
    return peak;
}

/* ------------------------------------------------------------------ model decode */

static bool g_op_profile; /* --op-profile: model_decode_tps prints where its steps' time went */

typedef struct decoder {
    pd_model_t *m;
    pd_kv_view_t *views;
    int L, bs, max_blocks;
} decoder_t;

/* Greedy decode of n_seqs sequences: prefill `prompt` tokens each, then `steps` decode steps.
 * Returns decode tokens per second (all sequences) of the median step: its context is the
 * roofline's average one, and a step the VM's other tenants held up does not move it (whole-run
 * figures of one build moved by ±10 % between runs on the 2-core VM, 2026-11-25). */
static double model_decode_tps(pd_backend_t *be, pd_model_t *m, pd_dtype_t kv_dtype, int n_seqs, int prompt,
                               int steps, float *prefill_logits, double *prefill_s)
{
    const pd_model_config_t *c = pd_model_config(m);
    int bs = 16, max_blocks = (int)pd_blocks_for_tokens(prompt + steps + 1, bs);
    int nblocks = n_seqs * max_blocks + 1;
    pd_kv_view_t *views = calloc((size_t)c->num_layers, sizeof(pd_kv_view_t));
    for (int l = 0; l < c->num_layers; l++) {
        views[l] = (pd_kv_view_t){NULL, kv_dtype, nblocks, bs, c->num_kv_heads, c->head_size};
        be->ops->alloc(be,
                       (size_t)pd_page_elems(bs, c->num_kv_heads, c->head_size) * nblocks *
                           (size_t)pd_dtype_size(kv_dtype),
                       &views[l].base);
    }
    int32_t *tables = malloc((size_t)n_seqs * max_blocks * 4);
    for (int s = 0; s < n_seqs; s++) {
        for (int b = 0; b < max_blocks; b++) {
            tables[s * max_blocks + b] = 1 + s * max_blocks + b;
        }
    }
    int T = n_seqs * prompt;
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *slots = malloc((size_t)T * 4);
    int32_t *cu = malloc((size_t)(n_seqs + 1) * 4), *lens = malloc((size_t)n_seqs * 4);
    int32_t *lidx = malloc((size_t)n_seqs * 4);
    float *logits = malloc((size_t)n_seqs * c->vocab_size * 4);
    pd_rng_t r;
    pd_rng_seed(&r, 3);
    for (int s = 0; s < n_seqs; s++) {
        for (int i = 0; i < prompt; i++) {
            int t = s * prompt + i;
            ids[t] = (int32_t)pd_rng_below(&r, (uint64_t)c->vocab_size);
            pos[t] = i;
            slots[t] = (int32_t)pd_block_table_slot(tables, max_blocks, s, i, bs);
        }
        cu[s] = s * prompt;
        lens[s] = prompt;
        lidx[s] = s * prompt + prompt - 1;
    }
    cu[n_seqs] = T;
    pd_batch_t batch = {T, ids, pos};
    pd_attn_meta_t meta = {n_seqs, T, cu, lens, tables, max_blocks, slots, 0, NULL};
    double tp = pd_time_now_s();
    pd_model_forward(m, &batch, views, &meta, lidx, n_seqs, NULL, logits);
    if (prefill_s != NULL) {
        *prefill_s = pd_time_now_s() - tp;
    }
    if (prefill_logits != NULL) {
        memcpy(prefill_logits, logits, (size_t)n_seqs * c->vocab_size * sizeof(float));
    }
    double *step_s = malloc((size_t)(steps > 0 ? steps : 1) * sizeof(double));
    pd_sampling_params_t *greedy = calloc((size_t)n_seqs, sizeof(pd_sampling_params_t));
    int32_t *next = malloc((size_t)n_seqs * sizeof(int32_t));
    for (int s = 0; s < n_seqs; s++) {
        greedy[s].top_p = 1.0f; /* temperature 0: the argmax, as the engine samples greedy rows */
    }
    if (g_op_profile) {
        pd_op_profile_attach(be);
        pd_op_profile_reset();
    }
    for (int step = 0; step < steps; step++) {
        double t0 = pd_time_now_s();
        be->ops->sample(be, next, logits, n_seqs, c->vocab_size, greedy, NULL);
        for (int s = 0; s < n_seqs; s++) {
            ids[s] = next[s];
            pos[s] = prompt + step;
            slots[s] = (int32_t)pd_block_table_slot(tables, max_blocks, s, prompt + step, bs);
            cu[s] = s;
            lens[s] = prompt + step + 1;
            lidx[s] = s;
        }
        cu[n_seqs] = n_seqs;
        batch.num_tokens = n_seqs;
        meta.num_tokens = n_seqs;
        pd_model_forward(m, &batch, views, &meta, lidx, n_seqs, NULL, logits);
        step_s[step] = pd_time_now_s() - t0;
    }
    if (g_op_profile && steps > 0) {
        double total = 0;
        for (int step = 0; step < steps; step++) {
            total += step_s[step];
        }
        char title[96];
        snprintf(title, sizeof(title), "decode, batch %d, context %d-%d", n_seqs, prompt + 1, prompt + steps);
        pd_op_profile_print(title, total, steps);
    }
    pd_op_profile_detach(be);
    double med = steps > 0 ? median_s(step_s, steps) : 0.0;
    free(step_s), free(greedy), free(next);
    for (int l = 0; l < c->num_layers; l++) {
        be->ops->free(be, views[l].base);
    }
    free(views), free(tables), free(ids), free(pos), free(slots), free(cu), free(lens), free(lidx),
        free(logits);
    return med > 0 ? (double)n_seqs / med : 0.0;
}

/* Roofline of a decode step of `batch` sequences: it reads read_bytes of weights and each
 * sequence's KV (kv_bytes for the whole batch; memory bound at read_bw) and does 2 FLOP per
 * matmul weight (matmul_params) per sequence (compute bound at the BLAS peak); the slower one
 * bounds. */
static double roofline_tps(double read_bytes, double matmul_params, double kv_bytes, double read_bw,
                           double peak_gflops, int batch)
{
    double t_mem = (read_bytes + kv_bytes) / (read_bw * 1e9);
    double t_flop = 2.0 * matmul_params * batch / (peak_gflops * 1e9);
    return batch / (t_mem > t_flop ? t_mem : t_flop);
}

/* The linear-layer weights of a Llama-shaped model: q, k, v, o, gate-up and down of every layer. */
static double linear_params(const pd_model_config_t *c)
{
    double hid = c->hidden_size, inter = c->intermediate_size, hsz = c->head_size;
    return (2 * c->num_heads * hsz * hid + 2 * c->num_kv_heads * hsz * hid + 3 * inter * hid) * c->num_layers;
}

/* The weights a decode step multiplies per token: the linear layers and the lm_head. */
static double matmul_params(const pd_model_config_t *c)
{
    return linear_params(c) + (double)c->vocab_size * c->hidden_size;
}

/* The weight bytes a decode step of `batch` sequences reads: all of them, but of an embedding table
 * the lm_head does not share only the batch's rows (until 2026-11-27 the roofline counted the whole
 * table as read and multiplied, ~4 % of the demo model: a bound that loose flattered every ratio). */
static double step_weight_bytes(const pd_model_config_t *c, double weight_bytes, pd_dtype_t wdt, int batch)
{
    if (c->tie_word_embeddings) {
        return weight_bytes;
    }
    double row = (double)c->hidden_size * pd_dtype_size(wdt);
    return weight_bytes - row * c->vocab_size + row * batch;
}

/* Logit error of logits q against a (32 rows of vocab): a row "what vs fp32". */
static void logit_error_row(const char *what, const float *a, const float *q, int vocab)
{
    double maxd = 0, maxa = 0;
    int agree = 0;
    for (int r = 0; r < 32; r++) {
        const float *ar = a + (size_t)r * vocab, *qr = q + (size_t)r * vocab;
        int ia = 0, iq = 0;
        for (int v = 0; v < vocab; v++) {
            double dd = fabs((double)qr[v] - ar[v]);
            maxd = dd > maxd ? dd : maxd;
            maxa = fabs(ar[v]) > maxa ? fabs(ar[v]) : maxa;
            ia = ar[v] > ar[ia] ? v : ia;
            iq = qr[v] > qr[iq] ? v : iq;
        }
        agree += ia == iq;
    }
    char val[64], base[64], name[96];
    snprintf(val, sizeof(val), "max abs dlogit %.3f (%.2f%% of max)", maxd, 100 * maxd / (maxa + 1e-30));
    snprintf(base, sizeof(base), "top-1 agrees %d/32 with fp32", agree);
    snprintf(name, sizeof(name), "%s logit error vs fp32 (32 prompts of 64 tokens)", what);
    add_row(name, val, base, agree / 32.0);
}

/* Decode and prefill of the model with its matrices as fp32, at the checkpoint's dtype (--dtype
 * auto), with --quantization int8, and for a bf16 checkpoint in bf16 math (--matmul-precision
 * bf16), each with the KV cache serving would pick (--kv-cache-dtype auto: the model's dtype).
 * Compute-bound figures compare with the GEMM peak of their math: sgemm, or the bf16 GEMM. */
static void bench_model(pd_backend_t *be, const char *model_dir, double read_bw, double peak_gflops,
                        double bf16_peak, const char *only_dtype, int only_batch)
{
    const char *dtypes[] = {"float32", "auto", "int8", "bf16-math"};
    float *logits[4] = {NULL, NULL, NULL, NULL}; /* last prompt token's logits of the 32 sequences */
    bool have[4] = {false, false, false, false};
    int vocab = 0;
    for (int d = 0; d < 4; d++) {
        if (only_dtype != NULL && strcmp(only_dtype, dtypes[d]) != 0) {
            continue;
        }
        pd_model_t *m = NULL;
        const char *dt = d >= 1 ? "auto" : dtypes[d], *quant = d == 2 ? "int8" : NULL;
        bool bf16_math = d == 3;
        /* before loading, as the engine does: the CPU backend lays out weights for the math */
        be->matmul_precision = bf16_math ? PD_MATMUL_BF16 : PD_MATMUL_FP32;
        if (pd_model_load_dtype(model_dir, be, dt, quant, &m) != PD_OK) {
            pd_log_error("bench: cannot load %s; skipping the model benchmark", model_dir);
            return;
        }
        pd_dtype_t wdt = pd_model_weight_dtype(m);
        if ((d == 1 && wdt == PD_DTYPE_F32 && only_dtype == NULL) || (d == 3 && wdt != PD_DTYPE_BF16)) {
            pd_model_free(m); /* an fp32 checkpoint: auto is the row above; bf16 math needs bf16 */
            continue;
        }
        pd_dtype_t ldt = pd_model_linear_dtype(m);
        double peak = bf16_math ? bf16_peak : peak_gflops;
        const char *math = bf16_math ? ", bf16 math" : "";
        vocab = pd_model_config(m)->vocab_size;
        if (logits[d] == NULL) {
            logits[d] = malloc((size_t)32 * vocab * sizeof(float));
        }
        double wbytes = (double)pd_model_weight_bytes(m);
        char val[48], name[112], base[80];
        int batches[] = {1, 8, 32};
        for (int i = 0; i < 3; i++) {
            if (only_batch > 0 && batches[i] != only_batch) {
                continue;
            }
            snprintf(name, sizeof(name), "model decode, %s%s weights+KV%s, batch %d (prompt 64, 64 steps)",
                     dt_name(wdt), ldt == PD_DTYPE_I8 ? "+int8" : "", math, batches[i]);
            progress(name);
            bool keep = batches[i] == 32;
            double tps = model_decode_tps(be, m, wdt, batches[i], 64, 64, keep ? logits[d] : NULL, NULL);
            have[d] |= keep;
            /* KV of the average context (64 prompt + 32 of the 64 steps) per sequence */
            const pd_model_config_t *c = pd_model_config(m);
            double kv = 2.0 * c->num_layers * c->num_kv_heads * c->head_size * pd_dtype_size(wdt) *
                        (64 + 32) * batches[i];
            double rbytes = step_weight_bytes(c, wbytes, wdt, batches[i]);
            double roof = roofline_tps(rbytes, matmul_params(c), kv, read_bw, peak, batches[i]);
            snprintf(val, sizeof(val), "%.1f tok/s", tps);
            snprintf(base, sizeof(base), "roofline %.0f tok/s (%.0f MiB %s read)", roof, rbytes / (1 << 20),
                     dt_name(ldt));
            add_row(name, val, base, tps / roof);
        }
        int prompts[] = {512, 2048}; /* whole prefill of one fresh prompt (one forward), vs the peak */
        for (int i = 0; only_batch == 0 && i < 2; i++) {
            snprintf(name, sizeof(name), "model prefill, %s%s weights%s, %d tokens", dt_name(wdt),
                     ldt == PD_DTYPE_I8 ? "+int8" : "", math, prompts[i]);
            progress(name);
            double best = 1e30, secs = 0;
            for (int r = 0; r < 2; r++) {
                model_decode_tps(be, m, wdt, 1, prompts[i], 0, NULL, &secs);
                best = secs < best ? secs : best;
            }
            /* 2 FLOP per linear-layer weight per token (Llama shapes; the lm_head runs on the last
             * token only and attention is not counted) */
            const pd_model_config_t *c = pd_model_config(m);
            double hid = c->hidden_size, inter = c->intermediate_size, hsz = c->head_size;
            double lin = linear_params(c);
            double flops = 2.0 * lin * prompts[i];
            snprintf(val, sizeof(val), "%.0f tok/s", prompts[i] / best);
            snprintf(base, sizeof(base), "%.1f GFLOP/s in linear layers; %s %.1f", flops / best / 1e9,
                     bf16_math ? "bf16 GEMM" : "sgemm", peak);
            add_row(name, val, base, flops / best / 1e9 / peak);
            /* the layer's matmuls alone at this many rows, weights of the model's shapes and dtype */
            double qd = c->num_heads * hsz, kvd = c->num_kv_heads * hsz, secs_lin = 0;
            int sh[][2] = {{(int)qd, (int)hid}, {(int)kvd, (int)hid},         {(int)kvd, (int)hid},
                           {(int)hid, (int)qd}, {(int)(2 * inter), (int)hid}, {(int)hid, (int)inter}};
            for (int q = 0; q < 6; q++) {
                secs_lin += matmul_seconds(be, ldt, prompts[i], sh[q][0], sh[q][1], 2, true);
            }
            double g = 2.0 * lin / c->num_layers * prompts[i] / secs_lin / 1e9;
            snprintf(name, sizeof(name), "model linear layers alone, %s%s weights%s, %d tokens", dt_name(wdt),
                     ldt == PD_DTYPE_I8 ? "+int8" : "", math, prompts[i]);
            snprintf(val, sizeof(val), "%.1f GFLOP/s", g);
            snprintf(base, sizeof(base), "%s %.1f GFLOP/s", bf16_math ? "bf16 GEMM" : "sgemm", peak);
            add_row(name, val, base, g / peak);
        }
        be->matmul_precision = PD_MATMUL_FP32;
        pd_model_free(m);
    }
    /* --quantization int8 and bf16 math against fp32 weights, same prompts */
    if (have[0] && have[2]) {
        logit_error_row("int8", logits[0], logits[2], vocab);
    }
    if (have[0] && have[3]) {
        logit_error_row("bf16 math", logits[0], logits[3], vocab);
    }
    for (int d = 0; d < 4; d++) {
        free(logits[d]);
    }
}

/* ------------------------------------------------------------------ main */

static void append_results(const char *path, int argc, char **argv, double memcpy1, double memcpyn,
                           int threads)
{
    FILE *f = fopen(path, "a");
    if (f == NULL) {
        pd_log_error("cannot append to %s", path);
        return;
    }
    time_t now = time(NULL);
    char date[64];
    strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
    struct utsname u;
    uname(&u);
    fprintf(f, "\n## pd-bench-ops — %s\n\n", date);
    fprintf(f, "Command: `");
    for (int i = 0; i < argc; i++) {
        fprintf(f, "%s%s", i ? " " : "", argv[i]);
    }
    fprintf(f,
            "`  \nMachine: %s %s, %ld cores, %d threads used; memcpy %.2f GB/s (1 thread), %.2f GB/s "
            "(%d threads); CPU kernels at %s (cap %s)\n\n",
            u.sysname, u.machine, sysconf(_SC_NPROCESSORS_ONLN), threads, memcpy1, memcpyn, threads,
            pd_cpu_isa_name(pd_cpu_isa_level()), pd_cpu_isa_name(pd_cpu_isa_cap()));
    fprintf(f, "| benchmark | result | baseline (same run) | ratio |\n|---|---|---|---|\n");
    for (int i = 0; i < g_nrows; i++) {
        fprintf(f, "| %s | %s | %s | %s |\n", g_rows[i].name, g_rows[i].value, g_rows[i].baseline,
                g_rows[i].ratio);
    }
    fclose(f);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *results = NULL;
    int threads = 0;
    bool skip_model = false, attention_only = false, model_only = false, sampling_only = false;
    const char *weights = NULL, *cpu_isa = "auto";
    int batch = 0;
    pd_flag_t flags[] = {
        {"model", PD_FLAG_STR, &model, "model dir for the decode benchmark (e.g. a pd-mkmodel demo preset)",
         NULL},
        {"threads", PD_FLAG_INT, &threads, "threads (0 = all cores)", NULL},
        {"cpu-isa", PD_FLAG_CHOICE, &cpu_isa,
         "the highest instruction-set level the CPU kernels use (auto: $PD_CPU_ISA, else all the CPU has)",
         "auto|portable|avx2|avx512|avx512_bf16|amx"},
        {"results", PD_FLAG_STR, &results, "append the table to this markdown file", NULL},
        {"skip-model", PD_FLAG_BOOL, &skip_model, "skip the model decode benchmark", NULL},
        {"attention-only", PD_FLAG_BOOL, &attention_only,
         "run only memcpy, the GEMM peaks and paged attention (decode and prefill)", NULL},
        {"sampling-only", PD_FLAG_BOOL, &sampling_only,
         "run only memcpy and the sampling op at a 128 k vocabulary against its reference", NULL},
        {"model-only", PD_FLAG_BOOL, &model_only,
         "run only the baselines (memcpy, read, sgemm peak) and the model decode", NULL},
        {"weights", PD_FLAG_CHOICE, &weights,
         "model decode with only these weights (default: all; int8 = auto + --quantization int8; "
         "bf16-math = auto + --matmul-precision bf16)",
         "float32|auto|int8|bf16-math"},
        {"batch", PD_FLAG_INT, &batch, "model decode at only this batch, 1, 8 or 32 (0 = all)", NULL},
        {"op-profile", PD_FLAG_BOOL, &g_op_profile,
         "after each model decode row, the decode steps' wall time per backend op and matmul shape "
         "(bench/op_profile.h)",
         NULL},
    };
    pd_status_t st = pd_flags_parse(flags, sizeof(flags) / sizeof(flags[0]), argc, argv,
                                    "usage: pd-bench-ops [--model DIR] [--results bench/RESULTS.md]", NULL);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    pd_backend_t *be = NULL, *ref = NULL;
    if (pd_cpu_isa_set_cap(cpu_isa) != PD_OK) {
        return 2;
    }
    if (pd_backend_create("cpu", threads, &be) != PD_OK || pd_backend_create("cpu-ref", 1, &ref) != PD_OK) {
        return 1;
    }
    threads = be->num_threads;
    progress("memcpy baseline (512 MiB)");
    double m1 = memcpy_gbps(be, 512u << 20, 1), mn = memcpy_gbps(be, 512u << 20, threads);
    double mbw = mn > m1 ? mn : m1;
    progress("read bandwidth (512 MiB)");
    double rbw = read_gbps(be, 512u << 20, threads);
    printf("%-52s %14s   %-28s %8s\n", "benchmark", "result", "baseline (same run)", "ratio");
    char v[48];
    snprintf(v, sizeof(v), "%.2f GB/s", m1);
    add_row("memcpy 512 MiB, 1 thread", v, "", 0);
    snprintf(v, sizeof(v), "%.2f GB/s", mn);
    char name[64];
    snprintf(name, sizeof(name), "memcpy 512 MiB, %d threads", threads);
    add_row(name, v, "", 0);
    snprintf(v, sizeof(v), "%.2f GB/s", rbw);
    snprintf(name, sizeof(name), "read 512 MiB, %d threads", threads);
    add_row(name, v, "", 0);
    if (sampling_only) {
        progress("sampling");
        bench_sampling(be, ref);
        if (results != NULL) {
            append_results(results, argc, argv, m1, mn, threads);
        }
        pd_backend_destroy(ref);
        pd_backend_destroy(be);
        return 0;
    }
    if (!model_only) {
        progress("paged attention decode");
        bench_attention(be, ref, mbw);
        progress("sampling");
        bench_sampling(be, ref);
    }
    progress("matmul");
    double bpeak = bf16_gemm_peak(be);
    double peak = model_only || attention_only ? sgemm_gflops(be, PD_DTYPE_F32, 2048, 2048, 2048, 5)
                                               : bench_matmul(be, rbw, bpeak);
    if (model_only || attention_only) {
        snprintf(v, sizeof(v), "%.1f GFLOP/s", peak);
        add_row("sgemm 2048x2048x2048 (OpenBLAS peak here)", v, "", 0);
        char b[64];
        snprintf(b, sizeof(b), "sgemm 2048^3 %.1f GFLOP/s", peak);
        snprintf(v, sizeof(v), "%.1f GFLOP/s", bpeak);
        add_row("bf16 GEMM 2048^3, bf16 math (oneDNN peak here)", v, b, bpeak / peak);
    }
    if (!model_only) {
        progress("prefill attention");
        bench_attention_prefill(be, peak, bpeak);
    }
    if (!skip_model && !attention_only && model != NULL) {
        bench_model(be, model, rbw, peak, bpeak, weights, batch);
    }
    if (results != NULL) {
        append_results(results, argc, argv, m1, mn, threads);
    }
    pd_backend_destroy(ref);
    pd_backend_destroy(be);
    return 0;
}
