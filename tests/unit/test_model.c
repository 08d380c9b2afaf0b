/* tests/unit/test_model.c — model loading and the forward pass over a paged KV cache:
 * logits vs an independent NumPy implementation, cache on vs off, chunked prefill, batching,
 * hooks, sharded and low-precision checkpoints, and rejection of bad model files. */
#include "test_util.h"

#include <check.h>
#include <jansson.h>
#include <math.h>
#include <sys/stat.h>

#include "common/log.h"
#include "common/rng.h"
#include "kernels/backend.h"
#include "kernels/paged_impl.h"
#include "model/model.h"
#include "model/rope.h"
#include "model/safetensors.h"

#define BS         16
#define MAX_BLOCKS 64
#define NUM_BLOCKS 512

static pd_backend_t *g_be;

/* ------------------------------------------------------------------ a tiny paged cache + runner */

typedef struct tcache {
    pd_kv_view_t *views;
    int num_layers;
    int next_block;
} tcache_t;

static void tcache_init(tcache_t *c, const pd_model_config_t *cfg, pd_dtype_t dt)
{
    c->num_layers = cfg->num_layers;
    c->views = calloc((size_t)cfg->num_layers, sizeof(pd_kv_view_t));
    for (int l = 0; l < cfg->num_layers; l++) {
        pd_kv_view_t *v = &c->views[l];
        *v = (pd_kv_view_t){NULL, dt, NUM_BLOCKS, BS, cfg->num_kv_heads, cfg->head_size};
        size_t bytes =
            (size_t)pd_page_elems(BS, cfg->num_kv_heads, cfg->head_size) * NUM_BLOCKS * pd_dtype_size(dt);
        ck_assert_int_eq(g_be->ops->alloc(g_be, bytes, &v->base), PD_OK);
        memset(v->base, 0x7f, bytes); /* poison: stale data must never be read */
    }
    c->next_block = 1; /* block 0 is the null block */
}

static void tcache_free(tcache_t *c)
{
    for (int l = 0; l < c->num_layers; l++) {
        g_be->ops->free(g_be, c->views[l].base);
    }
    free(c->views);
}

typedef struct tseq {
    const int32_t *tokens;
    int computed;
    int32_t blocks[MAX_BLOCKS];
    int num_blocks;
} tseq_t;

/* One step: sequence i gets n_new[i] new tokens; logits for every new token (in order) go to
 * logits_out. Blocks are handed out in a scattered order (stride 7) to exercise the tables. */
static pd_status_t run_step(pd_model_t *m, tcache_t *c, tseq_t **seqs, const int *n_new, int nseqs,
                            const pd_forward_hooks_t *hooks, float *logits_out)
{
    int T = 0;
    for (int i = 0; i < nseqs; i++) {
        T += n_new[i];
    }
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *slots = malloc((size_t)T * 4);
    int32_t *lidx = malloc((size_t)T * 4), cu[17], seq_lens[16], tables[16 * MAX_BLOCKS];
    memset(tables, 0, sizeof(tables));
    int t = 0;
    cu[0] = 0;
    for (int i = 0; i < nseqs; i++) {
        tseq_t *s = seqs[i];
        int total = s->computed + n_new[i];
        while (s->num_blocks < pd_blocks_for_tokens(total, BS)) {
            s->blocks[s->num_blocks++] = (int32_t)(1 + ((c->next_block++ * 7) % (NUM_BLOCKS - 1)));
        }
        memcpy(&tables[i * MAX_BLOCKS], s->blocks, (size_t)s->num_blocks * 4);
        for (int k = 0; k < n_new[i]; k++, t++) {
            int p = s->computed + k;
            ids[t] = s->tokens[p];
            pos[t] = p;
            slots[t] = (int32_t)pd_block_table_slot(&tables[i * MAX_BLOCKS], MAX_BLOCKS, 0, p, BS);
            lidx[t] = t;
        }
        cu[i + 1] = t;
        seq_lens[i] = total;
    }
    pd_batch_t batch = {T, ids, pos};
    pd_attn_meta_t meta = {
        nseqs, T, cu, seq_lens, tables, MAX_BLOCKS, slots, pd_model_config(m)->sliding_window, NULL};
    pd_status_t st = pd_model_forward(m, &batch, c->views, &meta, lidx, T, hooks, logits_out);
    if (st == PD_OK) {
        for (int i = 0; i < nseqs; i++) {
            seqs[i]->computed += n_new[i];
        }
    }
    free(ids), free(pos), free(slots), free(lidx);
    return st;
}

/* logits of every position of tokens[n] via chunks of `chunk` tokens */
static float *logits_chunked(pd_model_t *m, const int32_t *tokens, int n, int chunk, pd_dtype_t kv_dtype)
{
    const pd_model_config_t *cfg = pd_model_config(m);
    float *out = malloc((size_t)n * cfg->vocab_size * sizeof(float));
    tcache_t c;
    tcache_init(&c, cfg, kv_dtype);
    tseq_t s = {tokens, 0, {0}, 0};
    tseq_t *sp = &s;
    for (int done = 0; done < n;) {
        int k = n - done < chunk ? n - done : chunk;
        ck_assert_int_eq(run_step(m, &c, &sp, &k, 1, NULL, out + (size_t)done * cfg->vocab_size), PD_OK);
        done += k;
    }
    tcache_free(&c);
    return out;
}

static double max_abs(const float *a, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        m = fabs(a[i]) > m ? fabs(a[i]) : m;
    }
    return m;
}

/* max |a − b| relative to max |b| */
static double rel_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        m = d > m || isnan(d) ? d : m;
    }
    return m / (max_abs(b, n) + 1e-30);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) {
        b = x[i] > x[b] ? i : b;
    }
    return b;
}

/* top-1 minus top-2 logit: argmax comparisons are only meaningful above the error tolerance */
static double top2_margin(const float *x, int n)
{
    float a = -INFINITY, b = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (x[i] > a) {
            b = a;
            a = x[i];
        } else if (x[i] > b) {
            b = x[i];
        }
    }
    return (double)a - b;
}

static int32_t *random_tokens(int n, int vocab, uint64_t seed)
{
    pd_rng_t r;
    pd_rng_seed(&r, seed);
    int32_t *t = malloc((size_t)n * 4);
    for (int i = 0; i < n; i++) {
        t[i] = (int32_t)pd_rng_below(&r, (uint64_t)vocab);
    }
    return t;
}

static void setup(void)
{
    ck_assert_int_eq(pd_backend_create("cpu", 2, &g_be), PD_OK);
}

static void teardown(void)
{
    pd_backend_destroy(g_be);
}

/* ------------------------------------------------------------------ numpy reference */

static void check_against_numpy(const char *mk_args, int n)
{
    if (!tu_need(TU_NUMPY)) {
        return;
    }
    const char *py = tu_python_numpy();
    ck_assert_msg(py != NULL, "no python3 with numpy: tools/install-deps.sh installs python3-numpy");
    char *dir = tu_make_model(mk_args);
    ck_assert_ptr_nonnull(dir);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(dir, g_be, &m), PD_OK);
    const pd_model_config_t *cfg = pd_model_config(m);
    int V = cfg->vocab_size;
    int32_t *tokens = random_tokens(n, V, 7);
    float *ours = logits_chunked(m, tokens, n, n, PD_DTYPE_F32);

    char cmd[8192], out[512];
    snprintf(out, sizeof(out), "%s/ref.f32", dir);
    int k =
        snprintf(cmd, sizeof(cmd), "%s %s/tests/reference/model_ref.py %s %s", py, tu_source_dir(), dir, out);
    for (int i = 0; i < n; i++) {
        k += snprintf(cmd + k, sizeof(cmd) - (size_t)k, " %d", tokens[i]);
    }
    ck_assert_int_eq(tu_run(300, "%s", cmd), 0);
    size_t len = 0;
    float *ref = tu_read_file(out, &len);
    ck_assert_ptr_nonnull(ref);
    ck_assert_uint_eq(len, (size_t)n * V * sizeof(float));
    double d = rel_diff(ours, ref, (size_t)n * V);
    fprintf(stderr, "numpy reference (%s): max rel diff %.3g over %d positions\n", mk_args, d, n);
    ck_assert_double_lt(d, 1e-4);
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(argmax(ours + (size_t)i * V, V), argmax(ref + (size_t)i * V, V));
    }
    free(ref), free(ours), free(tokens);
    pd_model_free(m);
    tu_rmrf(dir);
    free(dir);
}

START_TEST(test_gpt2_matches_numpy)
{
    check_against_numpy("--preset tiny --arch gpt2", 45);
}
END_TEST

START_TEST(test_llama_matches_numpy)
{
    check_against_numpy("--preset tiny --arch llama", 45);
}
END_TEST

START_TEST(test_qwen2_matches_numpy)
{
    /* q/k/v biases and tied embeddings; MHA head count differs from GQA tests */
    check_against_numpy("--preset tiny --arch qwen2 --kv-heads 4", 33);
}
END_TEST

START_TEST(test_qwen3_matches_numpy)
{
    /* per-head q/k RMSNorm before RoPE; head_dim 32 so heads · head_dim (128) != hidden (64) */
    check_against_numpy("--preset tiny --arch qwen3 --head-dim 32", 33);
}
END_TEST

START_TEST(test_mistral_window_matches_numpy)
{
    /* sliding_window 16 on every layer, 60 positions: most queries see only the window */
    check_against_numpy("--preset tiny --arch mistral --sliding-window 16", 60);
}
END_TEST

START_TEST(test_gemma3_matches_numpy)
{
    /* 4 layers, every 2nd global: local layers with a 16-token window and their own rotary base,
     * global layers with linear rope_scaling; head_dim 32, query_pre_attn_scalar 16 */
    check_against_numpy("--preset tiny --arch gemma3 --layers 4 --head-dim 32 --sliding-window 16 "
                        "--sliding-pattern 2 --max-pos 128 --rope-scaling "
                        "{\\\"rope_type\\\":\\\"linear\\\",\\\"factor\\\":2.0}",
                        60);
}
END_TEST

/* rope_scaling of every type, over positions past original_max_position_embeddings (32) */
START_TEST(test_rope_scaling_matches_numpy)
{
    static const char *const scalings[] = {
        "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
        "\"original_max_position_embeddings\": 32}",
        "{\"type\": \"linear\", \"factor\": 2.5}",
        "{\"rope_type\": \"dynamic\", \"factor\": 3.0}",
        "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32}",
        "{\"rope_type\": \"yarn\", \"factor\": 16.0, \"original_max_position_embeddings\": 32, "
        "\"beta_fast\": 16, "
        "\"beta_slow\": 2, \"mscale\": 0.9, \"mscale_all_dim\": 0.7}",
    };
    for (size_t i = 0; i < sizeof(scalings) / sizeof(scalings[0]); i++) {
        /* the JSON goes through sh -c '...': quotes escaped for the inner shell, spaces dropped */
        char args[900], json[600];
        size_t k = 0;
        for (const char *c = scalings[i]; *c != '\0' && k + 3 < sizeof(json); c++) {
            if (*c == '"') {
                json[k++] = '\\';
            }
            if (*c != ' ') {
                json[k++] = *c;
            }
        }
        json[k] = '\0';
        snprintf(args, sizeof(args), "--preset tiny --arch llama --max-pos 128 --rope-scaling %s", json);
        check_against_numpy(args, 70);
    }
}
END_TEST

START_TEST(test_bf16_sharded_matches_numpy)
{
    check_against_numpy("--preset tiny --arch llama --dtype bf16 --shards 3 --untie", 20);
}
END_TEST

/* ------------------------------------------------------------------ weight dtypes */

/* A 16-bit checkpoint kept at its precision (--dtype auto) computes what the same checkpoint
 * widened to fp32 at load computes (bf16/fp16 → fp32 is exact; only fp32 summation order differs),
 * in about half the bytes; an fp32 checkpoint narrowed with --dtype bfloat16 stays close; an unknown
 * dtype is refused. GPT-2 covers transposed and fused-qkv weights, Gemma3 the scaled embedding that
 * is also the tied head. */
START_TEST(test_weight_dtypes)
{
    static const struct {
        const char *args;
        pd_dtype_t dt;
    } cases[] = {{"--preset tiny --arch llama --dtype bf16 --shards 2 --untie", PD_DTYPE_BF16},
                 {"--preset tiny --arch gpt2 --dtype f16", PD_DTYPE_F16},
                 {"--preset tiny --arch gemma3 --layers 2 --head-dim 32 --dtype bf16", PD_DTYPE_BF16}};
    int n = 24;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char *dir = tu_make_model(cases[c].args);
        ck_assert_ptr_nonnull(dir);
        pd_model_t *lo = NULL, *hi = NULL;
        ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "auto", NULL, &lo), PD_OK);
        ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "float32", NULL, &hi), PD_OK);
        ck_assert_int_eq(pd_model_weight_dtype(lo), cases[c].dt);
        ck_assert_int_eq(pd_model_weight_dtype(hi), PD_DTYPE_F32);
        double ratio = (double)pd_model_weight_bytes(lo) / (double)pd_model_weight_bytes(hi);
        ck_assert_msg(ratio > 0.5 && ratio < 0.56, "%s: 16-bit weights take %.3f of fp32's bytes",
                      cases[c].args, ratio);
        int V = pd_model_config(lo)->vocab_size;
        int32_t *tokens = random_tokens(n, V, 11);
        float *a = logits_chunked(lo, tokens, n, 5, PD_DTYPE_F32),
              *b = logits_chunked(hi, tokens, n, 5, PD_DTYPE_F32);
        double d = rel_diff(a, b, (size_t)n * V);
        fprintf(stderr, "%s: %s weights vs fp32: max rel diff %.3g\n", cases[c].args,
                pd_dtype_torch_name(cases[c].dt), d);
        ck_assert_double_lt(d, 1e-5);
        for (int i = 0; i < n; i++) {
            if (top2_margin(b + (size_t)i * V, V) > 1e-3) {
                ck_assert_int_eq(argmax(a + (size_t)i * V, V), argmax(b + (size_t)i * V, V));
            }
        }
        free(a), free(b), free(tokens);
        pd_model_free(lo);
        pd_model_free(hi);
        tu_rmrf(dir);
        free(dir);
    }
    /* fp32 checkpoint narrowed to bf16 at load: 8 mantissa bits per weight */
    char *dir = tu_make_model("--preset tiny --arch llama");
    pd_model_t *lo = NULL, *hi = NULL;
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "bfloat16", NULL, &lo), PD_OK);
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, NULL, NULL, &hi), PD_OK);
    ck_assert_int_eq(pd_model_weight_dtype(lo), PD_DTYPE_BF16);
    ck_assert_int_eq(pd_model_weight_dtype(hi), PD_DTYPE_F32);
    int V = pd_model_config(lo)->vocab_size;
    int32_t *tokens = random_tokens(n, V, 12);
    float *a = logits_chunked(lo, tokens, n, n, PD_DTYPE_F32),
          *b = logits_chunked(hi, tokens, n, n, PD_DTYPE_F32);
    double d = rel_diff(a, b, (size_t)n * V);
    ck_assert_msg(d > 0 && d < 3e-2, "bf16-narrowed weights: rel diff %.3g", d);
    free(a), free(b), free(tokens);
    pd_model_free(lo);
    pd_model_free(hi);
    pd_model_t *bad = NULL;
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "int4", NULL, &bad), PD_ERR_INVALID_ARG);
    ck_assert_ptr_null(bad);
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "auto", "awq", &bad), PD_ERR_UNSUPPORTED);
    ck_assert_ptr_null(bad);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* --quantization int8: the linear layers of a bf16 checkpoint in int8 with per-channel scales.
 * Greedy equality with fp32 is not expected; the logit error and the top-1 agreement are measured,
 * printed and bounded (the demo-sized figures are in bench/RESULTS.md), and the int8 path's own
 * kernels agree with the reference backend. */
START_TEST(test_int8_quantization)
{
    char *dir = tu_make_model("--preset tiny --arch llama --dtype bf16 --untie --layers 4");
    ck_assert_ptr_nonnull(dir);
    pd_model_t *q = NULL, *f = NULL, *qref = NULL;
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "auto", "int8", &q), PD_OK);
    ck_assert_int_eq(pd_model_load_dtype(dir, g_be, "float32", NULL, &f), PD_OK);
    ck_assert_int_eq(pd_model_linear_dtype(q), PD_DTYPE_I8);
    ck_assert_int_eq(pd_model_weight_dtype(q), PD_DTYPE_BF16);
    pd_backend_t *ref = NULL;
    ck_assert_int_eq(pd_backend_create("cpu-ref", 1, &ref), PD_OK);
    ck_assert_int_eq(pd_model_load_dtype(dir, ref, "auto", "int8", &qref), PD_OK);
    int n = 40, V = pd_model_config(q)->vocab_size;
    int32_t *tokens = random_tokens(n, V, 13);
    float *a = logits_chunked(q, tokens, n, 7, PD_DTYPE_F32),
          *b = logits_chunked(f, tokens, n, 7, PD_DTYPE_F32);
    float *c = logits_chunked(qref, tokens, n, 7, PD_DTYPE_F32);
    double d = rel_diff(a, b, (size_t)n * V), dref = rel_diff(a, c, (size_t)n * V);
    int agree = 0;
    for (int i = 0; i < n; i++) {
        agree += argmax(a + (size_t)i * V, V) == argmax(b + (size_t)i * V, V);
    }
    fprintf(stderr,
            "int8 linear layers vs fp32: max rel logit diff %.3g, top-1 agreement %d/%d; vs cpu-ref %.3g\n",
            d, agree, n, dref);
    ck_assert_double_lt(dref, 1e-5);
    ck_assert_double_lt(d, 0.1);
    ck_assert_int_ge(agree, n * 7 / 10);
    free(a), free(b), free(c), free(tokens);
    pd_model_free(q);
    pd_model_free(f);
    pd_model_free(qref);
    pd_backend_destroy(ref);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ------------------------------------------------------------------ cache on vs off */

static void check_cache_equivalence(const char *mk_args, pd_dtype_t kv_dtype, double tol)
{
    char *dir = tu_make_model(mk_args);
    ck_assert_ptr_nonnull(dir);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(dir, g_be, &m), PD_OK);
    int V = pd_model_config(m)->vocab_size, n = 100;
    int32_t *tokens = random_tokens(n, V, 11);
    float *full = logits_chunked(m, tokens, n, n, kv_dtype);
    int chunks[] = {1, 7, 64};
    for (int ci = 0; ci < 3; ci++) {
        float *ch = logits_chunked(m, tokens, n, chunks[ci], kv_dtype);
        double d = rel_diff(ch, full, (size_t)n * V);
        ck_assert_msg(d < tol, "chunk %d: rel diff %g", chunks[ci], d);
        for (int i = 0; i < n; i++) {
            if (top2_margin(full + (size_t)i * V, V) > 2 * tol * max_abs(full + (size_t)i * V, (size_t)V)) {
                ck_assert_int_eq(argmax(ch + (size_t)i * V, V), argmax(full + (size_t)i * V, V));
            }
        }
        free(ch);
    }
    /* no cache at all: recomputing each prefix from scratch gives the same last-position logits */
    for (int p = 1; p <= n; p += 33) {
        float *again = logits_chunked(m, tokens, p, p, kv_dtype);
        double d = rel_diff(again + (size_t)(p - 1) * V, full + (size_t)(p - 1) * V, (size_t)V);
        ck_assert_msg(d < tol, "prefix %d: rel diff %g", p, d);
        free(again);
    }
    free(full), free(tokens);
    pd_model_free(m);
    tu_rmrf(dir);
    free(dir);
}

START_TEST(test_cache_equivalence_llama)
{
    check_cache_equivalence("--preset tiny --arch llama", PD_DTYPE_F32, 1e-4);
}
END_TEST

START_TEST(test_cache_equivalence_sliding_window)
{
    /* chunks of 1, 7 and 64 tokens against a 16-token window cross block edges inside the window */
    check_cache_equivalence("--preset tiny --arch mistral --sliding-window 16", PD_DTYPE_F32, 1e-4);
}
END_TEST

START_TEST(test_cache_equivalence_gpt2)
{
    check_cache_equivalence("--preset tiny --arch gpt2", PD_DTYPE_F32, 1e-4);
}
END_TEST

START_TEST(test_cache_equivalence_bf16_cache)
{
    /* K/V are rounded to bf16 (8 mantissa bits) when written: fp32 summation-order differences
     * between chunkings can land on either side of a bf16 rounding step, so agreement is to bf16
     * precision, not fp32's */
    check_cache_equivalence("--preset tiny --arch llama", PD_DTYPE_BF16, 4e-3);
}
END_TEST

/* ------------------------------------------------------------------ batching and hooks */

typedef struct hook_log {
    int calls[2][8];
    int order_ok;
    int last_layer;
    int fail_at;
} hook_log_t;

static pd_status_t hook_after(void *ctx, int layer)
{
    hook_log_t *h = ctx;
    h->calls[0][layer]++;
    h->order_ok &= layer == h->last_layer + 1;
    return PD_OK;
}

static pd_status_t hook_before(void *ctx, int layer)
{
    hook_log_t *h = ctx;
    h->calls[1][layer]++;
    h->order_ok &= h->calls[0][layer] == h->calls[1][layer]; /* after_cache_write came first */
    h->last_layer = layer;
    return layer == h->fail_at ? PD_ERR_TIMEOUT : PD_OK;
}

START_TEST(test_batched_equals_alone_and_hooks)
{
    char *dir = tu_make_model("--preset tiny --arch llama");
    ck_assert_ptr_nonnull(dir);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(dir, g_be, &m), PD_OK);
    int V = pd_model_config(m)->vocab_size;
    int lens[4] = {5, 16, 33, 1};
    int32_t *toks[4];
    float *alone[4];
    for (int i = 0; i < 4; i++) {
        toks[i] = random_tokens(lens[i] + 4, V, 100 + (uint64_t)i); /* +1 for the failing step */
        alone[i] = logits_chunked(m, toks[i], lens[i] + 3, 64, PD_DTYPE_F32);
    }
    /* step 1: all four prompts in one batch (prefill); step 2..4: one decode token each */
    tcache_t c;
    tcache_init(&c, pd_model_config(m), PD_DTYPE_F32);
    tseq_t s[4];
    tseq_t *sp[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (tseq_t){toks[i], 0, {0}, 0};
        sp[i] = &s[i];
    }
    float *out = malloc((size_t)(16 + 33 + 5 + 1) * V * sizeof(float));
    hook_log_t h;
    memset(&h, 0, sizeof(h));
    h.order_ok = 1;
    h.last_layer = -1;
    h.fail_at = -1;
    pd_forward_hooks_t hooks = {&h, hook_after, hook_before};
    ck_assert_int_eq(run_step(m, &c, sp, lens, 4, &hooks, out), PD_OK);
    ck_assert(h.order_ok);
    for (int l = 0; l < pd_model_config(m)->num_layers; l++) {
        ck_assert_int_eq(h.calls[0][l], 1);
        ck_assert_int_eq(h.calls[1][l], 1);
    }
    int off = 0;
    for (int i = 0; i < 4; i++) {
        ck_assert_double_lt(rel_diff(out + (size_t)off * V, alone[i], (size_t)lens[i] * V), 1e-4);
        off += lens[i];
    }
    int ones[4] = {1, 1, 1, 1};
    for (int step = 0; step < 3; step++) {
        ck_assert_int_eq(run_step(m, &c, sp, ones, 4, NULL, out), PD_OK);
        for (int i = 0; i < 4; i++) {
            const float *want = alone[i] + (size_t)(lens[i] + step) * V;
            ck_assert_double_lt(rel_diff(out + (size_t)i * V, want, (size_t)V), 1e-4);
            ck_assert_int_eq(argmax(out + (size_t)i * V, V), argmax(want, V));
        }
    }
    /* a failing hook aborts the forward with its status */
    h.fail_at = 1;
    h.last_layer = -1;
    ck_assert_int_eq(run_step(m, &c, sp, ones, 4, &hooks, out), PD_ERR_TIMEOUT);
    tcache_free(&c);
    for (int i = 0; i < 4; i++) {
        free(toks[i]), free(alone[i]);
    }
    free(out);
    pd_model_free(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(test_forward_rejects_bad_input)
{
    char *dir = tu_make_model("--preset tiny --arch gpt2 --max-pos 64");
    ck_assert_ptr_nonnull(dir);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(dir, g_be, &m), PD_OK);
    int V = pd_model_config(m)->vocab_size;
    tcache_t c;
    tcache_init(&c, pd_model_config(m), PD_DTYPE_F32);
    float *out = malloc((size_t)80 * V * sizeof(float));
    int32_t bad_tok[3] = {1, V, 2};
    tseq_t s = {bad_tok, 0, {0}, 0};
    tseq_t *sp = &s;
    int n = 3;
    ck_assert_int_eq(run_step(m, &c, &sp, &n, 1, NULL, out), PD_ERR_OUT_OF_RANGE);
    int32_t *long_toks = random_tokens(70, V, 3); /* beyond GPT-2's 64 positions */
    tseq_t s2 = {long_toks, 0, {0}, 0};
    sp = &s2;
    n = 70;
    ck_assert_int_eq(run_step(m, &c, &sp, &n, 1, NULL, out), PD_ERR_OUT_OF_RANGE);
    free(long_toks);
    free(out);
    tcache_free(&c);
    pd_model_free(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ------------------------------------------------------------------ bad model files */

static void corrupt_and_expect(const char *dir, const char *file, long offset, const void *bytes, size_t n,
                               long truncate_to, pd_status_t want)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    size_t len = 0;
    char *orig = tu_read_file(path, &len);
    ck_assert_ptr_nonnull(orig);
    char *mod = malloc(len + 1);
    memcpy(mod, orig, len);
    if (bytes != NULL) {
        memcpy(mod + offset, bytes, n);
    }
    size_t newlen = truncate_to >= 0 ? (size_t)truncate_to : len;
    ck_assert_int_eq(tu_write_file(path, mod, newlen), 0);
    pd_model_t *m = NULL;
    pd_status_t st = pd_model_load(dir, g_be, &m);
    ck_assert_msg(st == want, "%s: got %s, want %s", file, pd_status_str(st), pd_status_str(want));
    ck_assert_ptr_null(m);
    ck_assert_uint_eq(g_be->bytes_in_use, 0); /* nothing leaked on the failure path */
    ck_assert_int_eq(tu_write_file(path, orig, len), 0);
    free(orig), free(mod);
}

/* Rewrites the safetensors header (same data) with one tensor descriptor replaced via sed. */
static void header_edit_and_expect(const char *dir, const char *from, const char *to, pd_status_t want)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    size_t len = 0;
    unsigned char *orig = tu_read_file(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) {
        hlen = (hlen << 8) | orig[i];
    }
    char *hdr = strndup((char *)orig + 8, hlen);
    char *at = strstr(hdr, from);
    ck_assert_ptr_nonnull(at);
    size_t fl = strlen(from), tl = strlen(to);
    size_t nh = hlen - fl + tl;
    unsigned char *mod = malloc(8 + nh + (len - 8 - hlen));
    for (int i = 0; i < 8; i++) {
        mod[i] = (unsigned char)((uint64_t)nh >> (8 * i));
    }
    size_t pre = (size_t)(at - hdr);
    memcpy(mod + 8, hdr, pre);
    memcpy(mod + 8 + pre, to, tl);
    memcpy(mod + 8 + pre + tl, at + fl, hlen - pre - fl);
    memcpy(mod + 8 + nh, orig + 8 + hlen, len - 8 - hlen);
    ck_assert_int_eq(tu_write_file(path, mod, 8 + nh + (len - 8 - hlen)), 0);
    pd_model_t *m = NULL;
    pd_status_t st = pd_model_load(dir, g_be, &m);
    ck_assert_msg(st == want, "edit '%s' -> '%s': got %s, want %s", from, to, pd_status_str(st),
                  pd_status_str(want));
    ck_assert_uint_eq(g_be->bytes_in_use, 0);
    ck_assert_int_eq(tu_write_file(path, orig, len), 0);
    free(orig), free(mod), free(hdr);
}

START_TEST(test_bad_model_files)
{
    char *dir = tu_make_model("--preset tiny --arch llama --layers 1");
    ck_assert_ptr_nonnull(dir);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(dir, g_be, &m), PD_OK);
    pd_model_free(m);
    ck_assert_uint_eq(g_be->bytes_in_use, 0);

    /* truncated file: the data area is shorter than the offsets say */
    corrupt_and_expect(dir, "model.safetensors", 0, NULL, 0, 5000, PD_ERR_PARSE);
    /* shorter than the 8-byte length */
    corrupt_and_expect(dir, "model.safetensors", 0, NULL, 0, 5, PD_ERR_PARSE);
    /* header length beyond the file */
    unsigned char huge[8] = {0xff, 0xff, 0xff, 0x00, 0, 0, 0, 0};
    corrupt_and_expect(dir, "model.safetensors", 0, huge, 8, -1, PD_ERR_PARSE);
    unsigned char max8[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    corrupt_and_expect(dir, "model.safetensors", 0, max8, 8, -1, PD_ERR_PARSE);
    /* header that is not JSON */
    corrupt_and_expect(dir, "model.safetensors", 8, "#", 1, -1, PD_ERR_PARSE);
    /* tensor offsets out of range, wrong dtype, shape/offset disagreement, shape vs config */
    header_edit_and_expect(dir, "\"model.norm.weight\":{\"data_offsets\":[",
                           "\"model.norm.weight\":{\"data_offsets\":[99999999", PD_ERR_PARSE);
    header_edit_and_expect(dir, "\"dtype\":\"F32\"", "\"dtype\":\"I64\"", PD_ERR_PARSE);
    header_edit_and_expect(dir, "\"dtype\":\"F32\"", "\"dtype\":\"F16\"", PD_ERR_PARSE);
    header_edit_and_expect(dir, "\"model.norm.weight\"", "\"model.norm.weigh7\"", PD_ERR_NOT_FOUND);
    header_edit_and_expect(dir, "\"shape\":[64]", "\"shape\":[-64]", PD_ERR_PARSE);
    header_edit_and_expect(dir, "\"shape\":[64]", "\"shape\":[8,8]",
                           PD_ERR_PARSE); /* matches bytes, not config */

    /* config.json: malformed JSON, unknown architecture, inconsistent sizes */
    char path[1024];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    size_t len = 0;
    char *cfg = tu_read_file(path, &len);
    corrupt_and_expect(dir, "config.json", 0, NULL, 0, (long)len / 2, PD_ERR_PARSE);
    char *arch = strstr(cfg, "LlamaForCausalLM");
    ck_assert_ptr_nonnull(arch);
    corrupt_and_expect(dir, "config.json", (long)(arch - cfg), "MambaForCausalLM", 16, -1,
                       PD_ERR_UNSUPPORTED);
    char *heads = strstr(cfg, "\"num_key_value_heads\": 2");
    ck_assert_ptr_nonnull(heads);
    corrupt_and_expect(dir, "config.json", (long)(heads - cfg), "\"num_key_value_heads\": 3", 24, -1,
                       PD_ERR_PARSE);
    char *hid = strstr(cfg, "\"hidden_size\": 64");
    ck_assert_ptr_nonnull(hid);
    corrupt_and_expect(dir, "config.json", (long)(hid - cfg), "\"hidden_size\": 96", 17, -1, PD_ERR_PARSE);
    free(cfg);
    /* rope_scaling types that are not run are refused by name, before any weight is read */
    static const struct {
        const char *scaling;
        pd_status_t want;
    } rs[] = {{"{\"rope_type\": \"longrope\", \"factor\": 4}", PD_ERR_UNSUPPORTED},
              {"{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, \"high_freq_factor\": 1}",
               PD_ERR_PARSE},
              {"{\"type\": \"linear\", \"factor\": 0.5}", PD_ERR_PARSE},
              {"[1, 2]", PD_ERR_PARSE}};
    for (size_t i = 0; i < sizeof(rs) / sizeof(rs[0]); i++) {
        json_t *c = json_load_file(path, 0, NULL);
        json_object_set_new(c, "rope_scaling", json_loads(rs[i].scaling, JSON_DECODE_ANY, NULL));
        pd_model_config_t mc;
        ck_assert_int_eq(pd_model_config_parse(c, "config.json", &mc), rs[i].want);
        json_decref(c);
    }
    /* Gemma3: the layer pattern is read (layer_types over sliding_window_pattern); what is not run
     * (soft-capping, another activation, bidirectional attention, a wrong layer list) is refused */
    static const struct {
        const char *key, *value;
        pd_status_t want;
    } gm[] = {{NULL, NULL, PD_OK},
              {"attn_logit_softcapping", "50.0", PD_ERR_UNSUPPORTED},
              {"final_logit_softcapping", "30.0", PD_ERR_UNSUPPORTED},
              {"hidden_activation", "\"silu\"", PD_ERR_UNSUPPORTED},
              {"use_bidirectional_attention", "true", PD_ERR_UNSUPPORTED},
              {"layer_types", "[\"sliding_attention\"]", PD_ERR_PARSE},
              {"layer_types", "[\"full_attention\", \"sliding_attention\"]", PD_OK}};
    for (size_t i = 0; i < sizeof(gm) / sizeof(gm[0]); i++) {
        json_t *c = json_load_file(path, 0, NULL);
        json_array_set_new(json_object_get(c, "architectures"), 0, json_string("Gemma3ForCausalLM"));
        json_object_set_new(c, "sliding_window_pattern", json_integer(2));
        json_object_set_new(c, "num_hidden_layers", json_integer(2)); /* parsing only: no weights read */
        if (gm[i].key != NULL) {
            json_object_set_new(c, gm[i].key, json_loads(gm[i].value, JSON_DECODE_ANY, NULL));
        }
        pd_model_config_t mc;
        ck_assert_int_eq(pd_model_config_parse(c, "config.json", &mc), gm[i].want);
        if (gm[i].want == PD_OK) {
            bool layer_types = gm[i].key != NULL; /* pattern 2: layer 0 local, 1 global */
            ck_assert(mc.gemma && mc.qk_norm && mc.tie_word_embeddings == false);
            ck_assert_int_eq(mc.sliding_layer[0], !layer_types);
            ck_assert_int_eq(mc.sliding_layer[1], layer_types);
            ck_assert_int_eq(mc.sliding_window, 4096);
        }
        json_decref(c);
    }

    /* nothing there at all */
    ck_assert_int_eq(pd_model_load("/nonexistent-pd-model", g_be, &m), PD_ERR_NOT_FOUND);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* config.json of the small models people serve first (tests/model/configs, as published): each
 * parses to the shape and options it describes, and its rotary table builds. */
START_TEST(test_published_configs)
{
    static const struct {
        const char *file;
        int layers, head_size, kv_heads, window, sliding_layers, num_eos;
        pd_rope_type_t rope;
        bool tie, qk_norm, gemma;
    } want[] = {
        {"Llama-3.2-1B-Instruct", 16, 64, 8, 0, 0, 3, PD_ROPE_LLAMA3, true, false, false},
        {"Llama-3.1-8B-Instruct", 32, 128, 8, 0, 0, 3, PD_ROPE_LLAMA3, false, false, false},
        {"SmolLM2-135M-Instruct", 30, 64, 3, 0, 0, 1, PD_ROPE_DEFAULT, true, false, false},
        {"Qwen2.5-0.5B-Instruct", 24, 64, 2, 0, 0, 1, PD_ROPE_DEFAULT, true, false, false},
        {"Qwen3-0.6B", 28, 128, 8, 0, 0, 1, PD_ROPE_DEFAULT, true, true, false},
        {"Mistral-7B-v0.1", 32, 128, 8, 4096, 32, 1, PD_ROPE_DEFAULT, false, false, false},
        {"Mistral-7B-Instruct-v0.3", 32, 128, 8, 0, 0, 1, PD_ROPE_DEFAULT, false, false, false},
        {"gemma-3-1b-it", 26, 256, 1, 512, 22, 2, PD_ROPE_DEFAULT, true, true, true},
        {"gemma-3-270m", 18, 256, 1, 512, 15, 1, PD_ROPE_DEFAULT, true, true, true},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        char path[1024];
        snprintf(path, sizeof(path), "%s/tests/model/configs/%s.json", tu_source_dir(), want[i].file);
        json_t *root = json_load_file(path, 0, NULL);
        ck_assert_msg(root != NULL, "%s", path);
        pd_model_config_t c;
        ck_assert_msg(pd_model_config_parse(root, path, &c) == PD_OK, "%s does not parse", want[i].file);
        int sliding = 0;
        for (int l = 0; l < c.num_layers; l++) {
            sliding += c.sliding_layer[l];
        }
        ck_assert_msg(c.num_layers == want[i].layers && c.head_size == want[i].head_size &&
                          c.num_kv_heads == want[i].kv_heads && c.sliding_window == want[i].window &&
                          sliding == want[i].sliding_layers && c.num_eos == want[i].num_eos &&
                          c.rope_scaling.type == want[i].rope && c.tie_word_embeddings == want[i].tie &&
                          c.qk_norm == want[i].qk_norm && c.gemma == want[i].gemma,
                      "%s: layers %d head %d kv %d window %d sliding %d eos %d rope %d tie %d qk %d gemma %d",
                      want[i].file, c.num_layers, c.head_size, c.num_kv_heads, c.sliding_window, sliding,
                      c.num_eos, (int)c.rope_scaling.type, c.tie_word_embeddings, c.qk_norm, c.gemma);
        if (c.gemma) { /* every 6th layer global; 1/√256 attention scale; local base 10000 */
            ck_assert(!c.sliding_layer[5] && c.sliding_layer[4] && c.sliding_layer[6]);
            ck_assert_float_eq(c.attn_scale, 0.0625f);
            ck_assert_float_eq(c.rope_local_theta, 10000.0f);
        }
        pd_rope_t rope;
        ck_assert_int_eq(pd_rope_table(&c, &rope), PD_OK);
        /* a Gemma 2 config and a multimodal Gemma 3 are refused by name */
        json_array_set_new(json_object_get(root, "architectures"), 0,
                           json_string(i % 2 ? "Gemma2ForCausalLM" : "Gemma3ForConditionalGeneration"));
        ck_assert_int_eq(pd_model_config_parse(root, path, &c), PD_ERR_UNSUPPORTED);
        json_decref(root);
    }
}
END_TEST

START_TEST(test_safetensors_roundtrip)
{
    char *dir = tu_mkdtemp("st");
    char path[512];
    snprintf(path, sizeof(path), "%s/x.safetensors", dir);
    float a[6] = {1.5f, -2, 3, 4, 5, 6.25f};
    uint16_t b[3] = {0x3f80, 0xc000, 0x4040}; /* bf16 1, -2, 3 */
    pd_st_write_tensor_t ts[2] = {{"a", PD_DTYPE_F32, 2, {2, 3}, a}, {"b.c", PD_DTYPE_BF16, 1, {3}, b}};
    ck_assert_int_eq(pd_st_write(path, ts, 2), PD_OK);
    pd_st_file_t *f = NULL;
    ck_assert_int_eq(pd_st_file_open(path, &f), PD_OK);
    ck_assert_int_eq(pd_st_file_count(f), 2);
    int found = 0;
    for (int i = 0; i < 2; i++) {
        const pd_st_tensor_t *t = pd_st_file_tensor(f, i);
        if (strcmp(t->name, "a") == 0) {
            ck_assert_int_eq(t->ndim, 2);
            ck_assert_int_eq(t->shape[1], 3);
            ck_assert_float_eq(pd_dtype_load(t->data, 5, t->dtype), 6.25f);
            found++;
        } else {
            ck_assert_str_eq(t->name, "b.c");
            ck_assert_float_eq(pd_dtype_load(t->data, 1, t->dtype), -2.0f);
            found++;
        }
    }
    ck_assert_int_eq(found, 2);
    pd_st_file_close(f);
    /* hostile files (issue 51): tensors that overlap are refused; so is a FIFO, at once (opening it
     * for reading used to wait for a writer: start-up hung) */
    static const char hdr[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                              "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}";
    unsigned char buf[8 + sizeof(hdr) - 1 + 16] = {0};
    buf[0] = (unsigned char)(sizeof(hdr) - 1);
    memcpy(buf + 8, hdr, sizeof(hdr) - 1);
    ck_assert_int_eq(tu_write_file(path, buf, sizeof(buf)), 0);
    f = NULL;
    ck_assert_int_eq(pd_st_file_open(path, &f), PD_ERR_PARSE);
    ck_assert_ptr_null(f);
    char fifo[600];
    snprintf(fifo, sizeof(fifo), "%s/model.safetensors", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    double t0 = tu_now();
    ck_assert_int_eq(pd_st_file_open(fifo, &f), PD_ERR_PARSE);
    ck_assert(tu_now() - t0 < 5);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

int main(void)
{
    tu_probe_tools(TU_NUMPY);
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_WARN);
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("model");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_safetensors_roundtrip);
    tcase_add_test(tc, test_gpt2_matches_numpy);
    tcase_add_test(tc, test_weight_dtypes);
    tcase_add_test(tc, test_int8_quantization);
    tcase_add_test(tc, test_llama_matches_numpy);
    tcase_add_test(tc, test_qwen2_matches_numpy);
    tcase_add_test(tc, test_qwen3_matches_numpy);
    tcase_add_test(tc, test_mistral_window_matches_numpy);
    tcase_add_test(tc, test_gemma3_matches_numpy);
    tcase_add_test(tc, test_published_configs);
    tcase_add_test(tc, test_bf16_sharded_matches_numpy);
    tcase_add_test(tc, test_rope_scaling_matches_numpy);
    tcase_add_test(tc, test_cache_equivalence_llama);
    tcase_add_test(tc, test_cache_equivalence_gpt2);
    tcase_add_test(tc, test_cache_equivalence_sliding_window);
    tcase_add_test(tc, test_cache_equivalence_bf16_cache);
    tcase_add_test(tc, test_batched_equals_alone_and_hooks);
    tcase_add_test(tc, test_forward_rejects_bad_input);
    tcase_add_test(tc, test_bad_model_files);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
