/* bench/bench_load.c — pd-bench's datasets and arrival process (see bench_load.h). */
#include "bench/bench_load.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

void pd_bench_dataset_free(pd_bench_dataset_t *d)
{
    for (size_t i = 0; d->prompts != NULL && i < d->n; i++) {
        free(d->prompts[i].ids);
        free(d->prompts[i].text);
    }
    free(d->prompts);
    memset(d, 0, sizeof(*d));
}

static int32_t scaled(pd_rng_t *rng, int32_t base, double r)
{
    double lo = floor(base * (1 - r)), hi = ceil(base * (1 + r));
    int32_t v = (int32_t)lo + (int32_t)pd_rng_below(rng, (uint64_t)(hi - lo) + 1);
    return v < 1 ? 1 : v;
}

pd_status_t pd_bench_dataset_random(uint64_t seed, size_t n, int32_t input_len, int32_t output_len, double r,
                                    int32_t prefix_len, int32_t vocab, pd_bench_dataset_t *out)
{
    if (n == 0 || input_len < 1 || output_len < 1 || r < 0 || r >= 1 || prefix_len < 0 || vocab < 2) {
        pd_log_error("random dataset: need input/output lengths >= 1, 0 <= range ratio < 1, vocab >= 2");
        return PD_ERR_INVALID_ARG;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed);
    out->prompts = calloc(n, sizeof(pd_bench_prompt_t));
    int32_t *prefix = malloc((size_t)(prefix_len > 0 ? prefix_len : 1) * sizeof(int32_t));
    if (out->prompts == NULL || prefix == NULL) {
        free(prefix);
        return PD_ERR_NO_MEMORY;
    }
    out->n = n;
    for (int32_t t = 0; t < prefix_len; t++) {
        prefix[t] = (int32_t)pd_rng_below(&rng, (uint64_t)vocab);
    }
    for (size_t i = 0; i < n; i++) {
        pd_bench_prompt_t *p = &out->prompts[i];
        int32_t in = scaled(&rng, input_len, r);
        p->output_len = scaled(&rng, output_len, r);
        p->num_ids = prefix_len + in;
        p->input_len = p->num_ids;
        p->ids = malloc((size_t)p->num_ids * sizeof(int32_t));
        if (p->ids == NULL) {
            free(prefix);
            pd_bench_dataset_free(out);
            return PD_ERR_NO_MEMORY;
        }
        memcpy(p->ids, prefix, (size_t)prefix_len * sizeof(int32_t));
        /* vLLM offsets each request's ids so prompts differ: (offset + i + j) % vocab */
        uint64_t off = pd_rng_below(&rng, (uint64_t)vocab);
        for (int32_t t = 0; t < in; t++) {
            p->ids[prefix_len + t] = (int32_t)((off + i + (uint64_t)t) % (uint64_t)vocab);
        }
    }
    free(prefix);
    return PD_OK;
}

/* n prompts of num_ids ids (unset) and output_len output tokens each; out is empty on failure. */
static pd_status_t prompts_alloc(pd_bench_dataset_t *out, size_t n, int32_t num_ids, int32_t output_len)
{
    out->prompts = calloc(n, sizeof(pd_bench_prompt_t));
    if (out->prompts == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    out->n = n;
    for (size_t i = 0; i < n; i++) {
        pd_bench_prompt_t *p = &out->prompts[i];
        p->num_ids = p->input_len = num_ids;
        p->output_len = output_len;
        p->ids = malloc((size_t)num_ids * sizeof(int32_t));
        if (p->ids == NULL) {
            pd_bench_dataset_free(out);
            return PD_ERR_NO_MEMORY;
        }
    }
    return PD_OK;
}

pd_status_t pd_bench_dataset_repeat(uint64_t seed, size_t n, int32_t input_len, int32_t phrase_len,
                                    int32_t output_len, int32_t vocab, pd_bench_dataset_t *out)
{
    if (n == 0 || input_len < 1 || phrase_len < 1 || output_len < 1 || vocab < 2) {
        pd_log_error("repeat dataset: need input, phrase and output lengths >= 1");
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = prompts_alloc(out, n, input_len, output_len);
    if (st != PD_OK) {
        return st;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) {
        pd_bench_prompt_t *p = &out->prompts[i];
        for (int32_t t = 0; t < input_len; t++) {
            p->ids[t] =
                t < phrase_len ? (int32_t)pd_rng_below(&rng, (uint64_t)vocab) : p->ids[t - phrase_len];
        }
    }
    return PD_OK;
}

pd_status_t pd_bench_dataset_multi_turn(uint64_t seed, size_t n, int32_t turns, int32_t system_len,
                                        int32_t user_len, int32_t output_len, int32_t vocab,
                                        pd_bench_dataset_t *out)
{
    if (n == 0 || turns < 1 || system_len < 0 || user_len < 1 || output_len < 1 || vocab < 2) {
        pd_log_error("multi-turn dataset: need turns, user and output lengths >= 1");
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = prompts_alloc(out, n * (size_t)turns, system_len + user_len, output_len);
    if (st != PD_OK) {
        return st;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed ^ 0x6d756c7469ull);
    int32_t *system = out->prompts[0].ids;
    for (int32_t t = 0; t < system_len; t++) {
        system[t] = (int32_t)pd_rng_below(&rng, (uint64_t)vocab);
    }
    for (size_t i = 0; i < out->n; i++) {
        pd_bench_prompt_t *p = &out->prompts[i];
        p->follows = i % (size_t)turns != 0;
        int32_t off = p->follows ? 0 : system_len;
        if (off > 0 && i > 0) {
            memcpy(p->ids, system, (size_t)system_len * sizeof(int32_t));
        }
        for (int32_t t = 0; t < user_len; t++) {
            p->ids[off + t] = (int32_t)pd_rng_below(&rng, (uint64_t)vocab);
        }
        p->num_ids = p->input_len = off + user_len;
    }
    return PD_OK;
}

pd_status_t pd_bench_dataset_mix(uint64_t seed, pd_bench_dataset_t *a, pd_bench_dataset_t *b, double b_share,
                                 pd_bench_dataset_t *out)
{
    if (a->n != b->n || b_share < 0 || b_share > 1) {
        pd_log_error("mixed dataset: the two parts differ in size or the share is outside [0, 1]");
        pd_bench_dataset_free(a);
        pd_bench_dataset_free(b);
        return PD_ERR_INVALID_ARG;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed ^ 0x6d6978ull);
    for (size_t i = 0; i < a->n; i++) {
        if (pd_rng_uniform(&rng) < b_share) {
            pd_bench_prompt_t t = a->prompts[i];
            a->prompts[i] = b->prompts[i];
            b->prompts[i] = t;
        }
    }
    *out = *a;
    memset(a, 0, sizeof(*a));
    pd_bench_dataset_free(b);
    return PD_OK;
}

pd_status_t pd_bench_dataset_prefix_repetition(uint64_t seed, size_t n, int32_t prefix_len,
                                               int32_t suffix_len, int32_t num_prefixes, int32_t output_len,
                                               int32_t vocab, pd_bench_dataset_t *out)
{
    if (n == 0 || prefix_len < 0 || suffix_len < 1 || num_prefixes < 1 || output_len < 1 || vocab < 2) {
        pd_log_error("prefix-repetition dataset: need suffix/output lengths >= 1 and at least one prefix");
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = prompts_alloc(out, n, prefix_len + suffix_len, output_len);
    if (st != PD_OK) {
        return st;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed);
    int32_t *prefixes =
        malloc((size_t)num_prefixes * (size_t)(prefix_len > 0 ? prefix_len : 1) * sizeof(int32_t));
    if (prefixes == NULL) {
        pd_bench_dataset_free(out);
        return PD_ERR_NO_MEMORY;
    }
    for (int64_t t = 0; t < (int64_t)num_prefixes * prefix_len; t++) {
        prefixes[t] = (int32_t)pd_rng_below(&rng, (uint64_t)vocab);
    }
    for (size_t i = 0; i < n; i++) {
        pd_bench_prompt_t *p = &out->prompts[i];
        memcpy(p->ids, prefixes + (size_t)(i % (size_t)num_prefixes) * (size_t)prefix_len,
               (size_t)prefix_len * sizeof(int32_t));
        for (int32_t t = 0; t < suffix_len; t++) {
            p->ids[prefix_len + t] = (int32_t)pd_rng_below(&rng, (uint64_t)vocab);
        }
    }
    free(prefixes);
    for (size_t i = n - 1; i > 0; i--) { /* Fisher–Yates */
        size_t j = (size_t)pd_rng_below(&rng, i + 1);
        pd_bench_prompt_t t = out->prompts[i];
        out->prompts[i] = out->prompts[j];
        out->prompts[j] = t;
    }
    return PD_OK;
}

bool pd_bench_sharegpt_keep(int32_t prompt_len, int32_t output_len)
{
    return prompt_len >= 4 && output_len >= 4 && prompt_len <= 1024 && prompt_len + output_len <= 2048;
}

static int32_t estimate_tokens(const char *s)
{
    size_t n = strlen(s);
    return (int32_t)((n + 3) / 4);
}

/* order[total] := 0 .. total − 1 shuffled with seed (Fisher–Yates): the ShareGPT loaders' sample. */
static void shuffle_order(size_t *order, size_t total, uint64_t seed)
{
    for (size_t i = 0; i < total; i++) {
        order[i] = i;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, seed);
    for (size_t i = total; i > 1; i--) {
        size_t j = (size_t)pd_rng_below(&rng, i);
        size_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
}

pd_status_t pd_bench_dataset_sharegpt(const char *path, uint64_t seed, size_t n, int32_t output_len,
                                      pd_bench_count_fn count, void *count_ctx, pd_bench_dataset_t *out)
{
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!json_is_array(root)) {
        pd_log_error("%s:%d:%d: not a ShareGPT JSON list (%s)", path, err.line, err.column,
                     root == NULL ? err.text : "top level is not a list");
        json_decref(root);
        return PD_ERR_PARSE;
    }
    size_t total = json_array_size(root);
    size_t *order = malloc((total + 1) * sizeof(size_t));
    out->prompts = calloc(n + 1, sizeof(pd_bench_prompt_t));
    if (order == NULL || out->prompts == NULL) {
        free(order);
        json_decref(root);
        return PD_ERR_NO_MEMORY;
    }
    shuffle_order(order, total, seed);
    size_t kept = 0;
    for (size_t k = 0; k < total && kept < n; k++) {
        json_t *conv = json_object_get(json_array_get(root, order[k]), "conversations");
        if (!json_is_array(conv) || json_array_size(conv) < 2) {
            continue; /* vLLM drops conversations with fewer than two turns */
        }
        const char *q = json_string_value(json_object_get(json_array_get(conv, 0), "value"));
        const char *a = json_string_value(json_object_get(json_array_get(conv, 1), "value"));
        if (q == NULL || a == NULL) {
            continue;
        }
        int32_t pl = count != NULL ? count(count_ctx, q) : estimate_tokens(q);
        int32_t ol = output_len > 0 ? output_len : count != NULL ? count(count_ctx, a) : estimate_tokens(a);
        if (pl < 0 || ol < 0) {
            pd_log_error("%s: cannot count the tokens of conversation %zu", path, order[k]);
            free(order);
            json_decref(root);
            out->n = kept;
            pd_bench_dataset_free(out);
            return PD_ERR_IO;
        }
        if (!pd_bench_sharegpt_keep(pl, ol)) {
            continue;
        }
        pd_bench_prompt_t *p = &out->prompts[kept++];
        p->text = strdup(q);
        p->input_len = pl;
        p->output_len = ol;
    }
    out->n = kept;
    free(order);
    json_decref(root);
    if (kept == 0) {
        pd_log_error("%s: no conversation passed the ShareGPT filter", path);
        pd_bench_dataset_free(out);
        return PD_ERR_PARSE;
    }
    return PD_OK;
}

pd_status_t pd_bench_dataset_sharegpt_multi_turn(const char *path, uint64_t seed, size_t n, int32_t turns,
                                                 int32_t output_len, pd_bench_count_fn count, void *count_ctx,
                                                 pd_bench_dataset_t *out)
{
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!json_is_array(root) || turns < 1) {
        pd_log_error("%s:%d:%d: not a ShareGPT JSON list (%s)", path, err.line, err.column,
                     root == NULL ? err.text
                     : turns < 1  ? "turns < 1"
                                  : "top level is not a list");
        json_decref(root);
        return PD_ERR_PARSE;
    }
    size_t total = json_array_size(root), cap = n * (size_t)turns;
    size_t *order = malloc((total + 1) * sizeof(size_t));
    memset(out, 0, sizeof(*out));
    out->prompts = calloc(cap + 1, sizeof(pd_bench_prompt_t));
    if (order == NULL || out->prompts == NULL) {
        free(order);
        free(out->prompts);
        json_decref(root);
        return PD_ERR_NO_MEMORY;
    }
    shuffle_order(order, total, seed);
    pd_status_t st = PD_OK;
    size_t convs = 0;
    for (size_t k = 0; k < total && convs < n && st == PD_OK; k++) {
        json_t *conv = json_object_get(json_array_get(root, order[k]), "conversations");
        int32_t got = 0;
        for (size_t t = 0; t + 1 < json_array_size(conv) && got < turns; t++) {
            json_t *h = json_array_get(conv, t), *g = json_array_get(conv, t + 1);
            const char *q = json_string_value(json_object_get(h, "value"));
            const char *a = json_string_value(json_object_get(g, "value"));
            const char *from = json_string_value(json_object_get(h, "from"));
            if (q == NULL || a == NULL || from == NULL || strcmp(from, "human") != 0) {
                continue;
            }
            int32_t ol = output_len > 0  ? output_len
                         : count != NULL ? count(count_ctx, a)
                                         : estimate_tokens(a);
            int32_t ql = count != NULL ? count(count_ctx, q) : estimate_tokens(q);
            if (ol < 0 || ql < 0) {
                pd_log_error("%s: cannot count the tokens of conversation %zu", path, order[k]);
                st = PD_ERR_IO;
                break;
            }
            pd_bench_prompt_t *p = &out->prompts[out->n++];
            p->text = strdup(q);
            p->input_len = ql; /* this turn's message; the sent prompt's length is the server's count */
            p->output_len = ol < 4 ? 4 : ol > 1024 ? 1024 : ol;
            p->follows = got > 0;
            got++;
            t++; /* past the answer */
        }
        convs += got > 0;
    }
    free(order);
    json_decref(root);
    if (st == PD_OK && out->n == 0) {
        pd_log_error("%s: no conversation with a human turn and an answer", path);
        st = PD_ERR_PARSE;
    }
    if (st != PD_OK) {
        pd_bench_dataset_free(out);
    }
    return st;
}

double pd_bench_gamma(pd_rng_t *rng, double shape)
{
    if (shape < 1) {
        /* boost: gamma(a) = gamma(a + 1) · U^(1/a) */
        double u = pd_rng_uniform(rng);
        return pd_bench_gamma(rng, shape + 1) * pow(u > 0 ? u : 1e-300, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9 * d);
    for (;;) {
        double x = pd_rng_normal(rng), v = 1 + c * x;
        if (v <= 0) {
            continue;
        }
        v = v * v * v;
        double u = pd_rng_uniform(rng);
        if (u < 1 - 0.0331 * x * x * x * x || log(u > 0 ? u : 1e-300) < 0.5 * x * x + d * (1 - v + log(v))) {
            return d * v;
        }
    }
}

double pd_bench_next_gap(pd_rng_t *rng, double rate, double burstiness)
{
    if (!(rate > 0) || isinf(rate)) {
        return 0;
    }
    double theta = 1.0 / (rate * burstiness);
    return pd_bench_gamma(rng, burstiness) * theta;
}
