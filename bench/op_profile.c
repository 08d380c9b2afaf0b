/* bench/op_profile.c — the timing copy of a backend's function table (op_profile.h). */
#include "bench/op_profile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/time.h"

#define PROF_MAX 64 /* distinct counters: the ops below plus a model's matmul shapes */

typedef struct prof_entry {
    char name[64];
    long calls;
    double seconds;
} prof_entry_t;

/* Written by the thread that calls the ops (op_profile.h). */
static prof_entry_t g_entries[PROF_MAX];
static int g_count;
static const pd_backend_ops_t *g_real; /* the table the copy forwards to */
static pd_backend_ops_t g_timed;

/* The counter named `name`, made on first use; the last one when the table is full. */
static prof_entry_t *entry(const char *name)
{
    for (int i = 0; i < g_count; i++) {
        if (strcmp(g_entries[i].name, name) == 0) {
            return &g_entries[i];
        }
    }
    if (g_count == PROF_MAX) {
        return &g_entries[PROF_MAX - 1];
    }
    prof_entry_t *e = &g_entries[g_count++];
    snprintf(e->name, sizeof(e->name), "%s", name);
    return e;
}

static void charge(const char *name, double t0)
{
    prof_entry_t *e = entry(name);
    e->calls++;
    e->seconds += pd_time_now_s() - t0;
}

/* A wrapper that times g_real->op under the op's own name. */
#define TIMED(op, params, args)                                                                              \
    static pd_status_t timed_##op params                                                                     \
    {                                                                                                        \
        double t0 = pd_time_now_s();                                                                         \
        pd_status_t st = g_real->op args;                                                                    \
        charge(#op, t0);                                                                                     \
        return st;                                                                                           \
    }

TIMED(embed, (pd_backend_t * be, float *out, pd_weight_t t, float s, const int32_t *ids, int n, int d, int v),
      (be, out, t, s, ids, n, d, v))
TIMED(add, (pd_backend_t * be, float *y, const float *x, size_t n), (be, y, x, n))
TIMED(rmsnorm, (pd_backend_t * be, float *out, const float *x, const float *w, int rows, int dim, float eps),
      (be, out, x, w, rows, dim, eps))
TIMED(layernorm,
      (pd_backend_t * be, float *out, const float *x, const float *w, const float *b, int rows, int dim,
       float eps),
      (be, out, x, w, b, rows, dim, eps))
TIMED(rope,
      (pd_backend_t * be, float *x, const int32_t *pos, int tokens, int heads, int hs, const pd_rope_t *rope),
      (be, x, pos, tokens, heads, hs, rope))
TIMED(gelu, (pd_backend_t * be, float *x, size_t n), (be, x, n))
TIMED(silu_mul, (pd_backend_t * be, float *out, const float *gu, int rows, int inter),
      (be, out, gu, rows, inter))
TIMED(gelu_mul, (pd_backend_t * be, float *out, const float *gu, int rows, int inter),
      (be, out, gu, rows, inter))
TIMED(softmax, (pd_backend_t * be, float *x, int rows, int cols), (be, x, rows, cols))
TIMED(reshape_and_cache,
      (pd_backend_t * be, const pd_kv_view_t *kv, const float *k, const float *v, const int32_t *slots,
       int n),
      (be, kv, k, v, slots, n))
TIMED(paged_attention_prefill,
      (pd_backend_t * be, float *out, const float *q, const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
       int heads, float scale),
      (be, out, q, kv, meta, heads, scale))
TIMED(paged_attention_decode,
      (pd_backend_t * be, float *out, const float *q, const pd_kv_view_t *kv, const pd_attn_meta_t *meta,
       int heads, float scale),
      (be, out, q, kv, meta, heads, scale))
TIMED(sample,
      (pd_backend_t * be, int32_t *out, float *logits, int n, int vocab, const pd_sampling_params_t *p,
       pd_rng_t *rngs),
      (be, out, logits, n, vocab, p, rngs))
TIMED(copy, (pd_backend_t * be, void *dst, const void *src, size_t bytes, pd_copy_kind_t kind),
      (be, dst, src, bytes, kind))

/* Matmuls are counted per shape: a layer's q, k, v, o, gate-up and down apart. */
static pd_status_t timed_matmul(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias,
                                int m, int n, int k)
{
    double t0 = pd_time_now_s();
    pd_status_t st = g_real->matmul(be, y, x, w, bias, m, n, k);
    char name[64];
    snprintf(name, sizeof(name), "matmul %d x %d (%s)", n, k,
             w.layout == PD_WEIGHT_ROWS ? "row-major" : "32-row blocks");
    charge(name, t0);
    return st;
}

void pd_op_profile_attach(pd_backend_t *be)
{
    if (be->ops == &g_timed) {
        return;
    }
    g_real = be->ops;
    g_timed = *be->ops;
    g_timed.embed = timed_embed;
    g_timed.matmul = timed_matmul;
    g_timed.add = timed_add;
    g_timed.rmsnorm = timed_rmsnorm;
    g_timed.layernorm = timed_layernorm;
    g_timed.rope = timed_rope;
    g_timed.gelu = timed_gelu;
    g_timed.silu_mul = timed_silu_mul;
    g_timed.gelu_mul = timed_gelu_mul;
    g_timed.softmax = timed_softmax;
    g_timed.reshape_and_cache = timed_reshape_and_cache;
    g_timed.paged_attention_prefill = timed_paged_attention_prefill;
    g_timed.paged_attention_decode = timed_paged_attention_decode;
    g_timed.sample = timed_sample;
    g_timed.copy = timed_copy;
    be->ops = &g_timed;
}

void pd_op_profile_detach(pd_backend_t *be)
{
    if (be->ops == &g_timed) {
        be->ops = g_real;
    }
}

void pd_op_profile_reset(void)
{
    g_count = 0;
    memset(g_entries, 0, sizeof(g_entries));
}

static int by_seconds(const void *a, const void *b)
{
    double d = ((const prof_entry_t *)b)->seconds - ((const prof_entry_t *)a)->seconds;
    return (d > 0) - (d < 0);
}

void pd_op_profile_print(const char *title, double total_s, int steps)
{
    prof_entry_t sorted[PROF_MAX];
    memcpy(sorted, g_entries, sizeof(prof_entry_t) * (size_t)g_count);
    qsort(sorted, (size_t)g_count, sizeof(prof_entry_t), by_seconds);
    double in_ops = 0;
    int n = steps > 0 ? steps : 1;
    printf("\nop profile: %s, %d steps, %.1f us per step\n", title, steps, total_s / n * 1e6);
    printf("  %-44s %12s %14s %8s\n", "op", "calls/step", "us/step", "share");
    for (int i = 0; i < g_count; i++) {
        in_ops += sorted[i].seconds;
        printf("  %-44s %12.1f %14.1f %7.1f%%\n", sorted[i].name, (double)sorted[i].calls / n,
               sorted[i].seconds / n * 1e6, 100 * sorted[i].seconds / total_s);
    }
    printf("  %-44s %12s %14.1f %7.1f%%\n", "outside the ops (the caller's own work)", "",
           (total_s - in_ops) / n * 1e6, 100 * (total_s - in_ops) / total_s);
    fflush(stdout);
}
