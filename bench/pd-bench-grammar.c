/* bench/pd-bench-grammar.c — the structured-output token mask's cost on a real vocabulary:
 *
 *   pd-bench-grammar TOKENIZER.json [--no-precompute] [--schemas FILE.json]
 *
 * A JSON Schema's grammar is compiled and its cut stacks walked ahead (pd_grammar_precompute, as the
 * engine's job thread does before a grammar's first token; timed, not in the masks' figures; not
 * with --no-precompute). Then it follows a fixed JSON text byte by byte; each step's mask is timed,
 * first with every state new (cold: the automaton and the masks are built) and then again over the
 * same states (the masks come from the per-state cache), then over 20 other replies. The cold reply
 * is timed again on 7 fresh compiles, each step's least time kept (the machine's interruptions
 * left out). Prints mean, p50, p99 and max per pass, and what the automaton and its caches hold.
 *
 * With --schemas FILE (a JSON list of schemas, e.g. tools/structured_validity.py --dump-schemas):
 * each schema is compiled, walked ahead (timed) and followed by one seeded random generation through
 * its masks (a token drawn uniformly among the allowed ones), every mask of it timed: the first reply
 * of every schema, the case a server meets when a schema is new. Done 7 times (the same
 * generations); printed for the first run and with each step's least time. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/time.h"
#include "grammar/grammar.h"
#include "model/tokenizer.h"

static const char SCHEMA[] =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
    "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}}},"
    "\"required\":[\"name\",\"age\",\"tags\"],\"additionalProperties\":false}";
static const char TEXT[] = "{\"name\": \"Alice Smith the third of her name\", \"age\": 42, \"tags\": [\"x\", "
                           "\"yz\", \"hello world\"]}";

#define COLD_RUNS 7

static int dbl_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
#define GEN_TOKENS 200

/* --schemas: the first reply of each schema in file; 0 or 1. */
static int many_schemas(const char *file, pd_tokenizer_t *tok, const pd_gvocab_t *v, int32_t n, bool ahead)
{
    json_error_t je;
    json_t *doc = json_load_file(file, 0, &je);
    if (!json_is_array(doc)) {
        fprintf(stderr, "pd-bench-grammar: %s: not a JSON list (%s)\n", file, je.text);
        return 1;
    }
    size_t ns = json_array_size(doc), k = 0, cap = ns * GEN_TOKENS + 1, stacks = 0, bytes = 0;
    double *t = malloc(cap * sizeof(double)), *best = malloc(cap * sizeof(double)),
           *pre = calloc(ns + 1, sizeof(double));
    uint32_t *mask = malloc((size_t)(n + 31) / 32 * sizeof(uint32_t));
    int32_t *allowed = malloc((size_t)n * sizeof(int32_t)), eos = 0;
    for (int run = 0; run < COLD_RUNS; run++) { /* the same generations each run (seeded, masks exact) */
        uint64_t rng = 42;
        k = 0;
        for (size_t i = 0; i < ns; i++) {
            char err[256];
            char *gb = pd_json_schema_to_gbnf(json_array_get(doc, i), err, sizeof(err));
            pd_grammar_t *g = NULL;
            if (gb == NULL || pd_grammar_from_gbnf(gb, strlen(gb), &g, err, sizeof(err)) != PD_OK) {
                fprintf(stderr, "pd-bench-grammar: schema %zu: %s\n", i, err);
                return 1;
            }
            pd_grammar_precompute_opts_t po = {.budget_s = 60.0};
            pd_grammar_precompute_stats_t ps;
            if (ahead && pd_grammar_precompute(g, v, &po, NULL, &ps) != PD_OK) {
                fprintf(stderr, "pd-bench-grammar: schema %zu: the precompute failed\n", i);
                return 1;
            }
            if (ahead && run == 0) {
                pre[i] = ps.seconds;
                stacks += ps.cut_stacks;
                bytes += ps.bytes;
            }
            pd_gmatcher_t m;
            pd_gmatcher_init(&m, g);
            for (int step = 0; step < GEN_TOKENS; step++, k++) {
                double t0 = pd_time_now_s();
                pd_gmatcher_fill_mask(&m, v, &eos, 1, mask);
                double d = pd_time_now_s() - t0;
                t[k] = run == 0 ? d : t[k];
                best[k] = run == 0 || d < best[k] ? d : best[k];
                int32_t na = 0;
                for (int32_t id = 1; id < n; id++) { /* 0 is the end id here */
                    if ((mask[id >> 5] >> (id & 31)) & 1) {
                        allowed[na++] = id;
                    }
                }
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                if (na == 0 || (pd_gmatcher_can_end(&m) && (rng >> 33) % 4 == 0)) {
                    k++;
                    break;
                }
                size_t len = 0;
                const uint8_t *b = pd_tokenizer_token_bytes(tok, allowed[(rng >> 33) % (uint64_t)na], &len);
                if (!pd_gmatcher_accept(&m, b, len)) {
                    fprintf(stderr, "pd-bench-grammar: schema %zu: a token its mask allowed was refused\n",
                            i);
                    return 1;
                }
            }
            pd_gmatcher_destroy(&m);
            pd_grammar_unref(g);
            free(gb);
        }
    }
    for (int pass = 0; pass < 2; pass++) { /* the first run's times, then each step's least of the runs */
        double *x = pass == 0 ? t : best, sum = 0;
        size_t over = 0;
        for (size_t i = 0; i < k; i++) {
            sum += x[i];
            over += x[i] > 50e-6;
        }
        qsort(x, k, sizeof(double), dbl_cmp);
        printf("vocab %d, %zu schemas' first replies%s%s: %zu masks, mean %.1f us, p50 %.1f us, p99 %.1f us, "
               "p99.9 %.1f us, max %.1f us, %zu over 50 us\n",
               n, ns, ahead ? "" : " (no walks ahead)", pass == 0 ? "" : ", least of 7 runs per step", k,
               sum / (double)k * 1e6, x[k / 2] * 1e6, x[(size_t)((double)k * 0.99)] * 1e6,
               x[(size_t)((double)k * 0.999)] * 1e6, x[k - 1] * 1e6, over);
    }
    qsort(pre, ns, sizeof(double), dbl_cmp);
    if (ahead) {
        printf("vocab %d, walked ahead per schema: p50 %.1f ms, max %.1f ms; %.0f cut stacks and %.2f MiB on "
               "average\n",
               n, pre[ns / 2] * 1e3, pre[ns - 1] * 1e3, (double)stacks / (double)ns,
               (double)bytes / (double)ns / (1 << 20));
    }
    free(t), free(best), free(pre), free(mask), free(allowed);
    json_decref(doc);
    return 0;
}

int main(int argc, char **argv)
{
    pd_tokenizer_t *tok = NULL;
    bool ahead = true, usage = argc < 2;
    const char *schemas = NULL;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--no-precompute") == 0) {
            ahead = false;
        } else if (strcmp(argv[i], "--schemas") == 0 && i + 1 < argc) {
            schemas = argv[++i];
        } else {
            usage = true;
        }
    }
    if (usage || pd_tokenizer_load_json(argv[1], &tok) != PD_OK) {
        fprintf(stderr, "usage: pd-bench-grammar TOKENIZER.json [--no-precompute] [--schemas FILE.json]\n");
        return 2;
    }
    int32_t n = pd_tokenizer_vocab_size(tok);
    const uint8_t **bytes = calloc((size_t)n, sizeof(*bytes));
    uint32_t *lens = calloc((size_t)n, sizeof(*lens));
    bool *excl = calloc((size_t)n, sizeof(*excl));
    uint32_t *mask = malloc((size_t)(n + 31) / 32 * sizeof(uint32_t));
    for (int32_t i = 0; i < n; i++) {
        size_t len = 0;
        bytes[i] = pd_tokenizer_token_bytes(tok, i, &len);
        lens[i] = (uint32_t)len;
        excl[i] = bytes[i] == NULL || pd_tokenizer_is_special(tok, i);
    }
    pd_gvocab_t *v = NULL;
    json_t *schema = json_loads(SCHEMA, 0, NULL);
    char err[256];
    char *gb = pd_json_schema_to_gbnf(schema, err, sizeof(err));
    pd_grammar_t *g = NULL;
    if (pd_gvocab_create(n, bytes, lens, excl, &v) != PD_OK || gb == NULL ||
        pd_grammar_from_gbnf(gb, strlen(gb), &g, err, sizeof(err)) != PD_OK) {
        fprintf(stderr, "pd-bench-grammar: setup failed: %s\n", err);
        return 1;
    }
    int rc = 0;
    if (schemas != NULL) {
        rc = many_schemas(schemas, tok, v, n, ahead);
        goto out;
    }
    if (ahead) {
        pd_grammar_precompute_stats_t ps;
        pd_grammar_precompute_opts_t po = {.budget_s = 60.0};
        if (pd_grammar_precompute(g, v, &po, NULL, &ps) != PD_OK) {
            fprintf(stderr, "pd-bench-grammar: the precompute failed\n");
            return 1;
        }
        printf("vocab %d, walked ahead: %zu of %zu cut stacks (%zu refined a frame deeper) in %.1f ms, "
               "%.1f MiB\n",
               n, ps.walked, ps.cut_stacks, ps.refined, ps.seconds * 1e3, (double)ps.bytes / (1 << 20));
    }
    int32_t eos = 0;
    double t[sizeof(TEXT)], cold[sizeof(TEXT)];
    size_t n_cold = 0;
    for (int pass = 0; pass < 2; pass++) {
        pd_gmatcher_t m;
        pd_gmatcher_init(&m, g);
        double sum = 0;
        size_t k = 0;
        for (size_t i = 0; i < strlen(TEXT); i++, k++) {
            double t0 = pd_time_now_s();
            pd_gmatcher_fill_mask(&m, v, &eos, 1, mask);
            t[k] = pd_time_now_s() - t0;
            sum += t[k];
            pd_gmatcher_accept(&m, (const uint8_t *)TEXT + i, 1);
        }
        if (pass == 0) { /* kept for the whole run's distribution */
            memcpy(cold, t, k * sizeof(double));
            n_cold = k;
        }
        qsort(t, k, sizeof(double), dbl_cmp);
        size_t over = 0;
        for (size_t i = 0; i < k; i++) {
            over += t[i] > 50e-6;
        }
        printf(
            "vocab %d, %s: %zu masks, mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us, %zu over 50 us\n",
            n, pass ? "states seen (cached)" : "cold", k, sum / (double)k * 1e6, t[k / 2] * 1e6,
            t[(size_t)((double)k * 0.99)] * 1e6, t[k - 1] * 1e6, over);
        pd_gmatcher_destroy(&m);
    }
    /* then 20 different replies of the same schema: the masks a server computes once the grammar has
     * served a request (its first string walked) */
    static const char *names[] = {"Bob", "Ünal Şahin", "李雷", "x\\ty", "Zoë \\\"Z\\\"", "a b c d e f g h"};
    static const char *tags[] = {"[]", "[\"one\"]", "[\"α\", \"β γ\", \"\"]", "[\"long tag text here\"]"};
    size_t k = 0, cap = 8192;
    double *ts = malloc(cap * sizeof(double));
    for (int r = 0; r < 20; r++) {
        char text[512];
        snprintf(text, sizeof(text), "{\"name\": \"%s\", \"age\": %d, \"tags\": %s}", names[r % 6],
                 7 * r - 30, tags[r % 4]);
        pd_gmatcher_t m;
        pd_gmatcher_init(&m, g);
        for (size_t i = 0; i < strlen(text) && k < cap; i++, k++) {
            double t0 = pd_time_now_s();
            pd_gmatcher_fill_mask(&m, v, &eos, 1, mask);
            ts[k] = pd_time_now_s() - t0;
            if (!pd_gmatcher_accept(&m, (const uint8_t *)text + i, 1)) {
                fprintf(stderr, "pd-bench-grammar: '%s' left the grammar at %zu\n", text, i);
                return 1;
            }
        }
        pd_gmatcher_destroy(&m);
    }
    double sum = 0;
    for (size_t i = 0; i < k; i++) {
        sum += ts[i];
    }
    qsort(ts, k, sizeof(double), dbl_cmp);
    printf("vocab %d, 20 more replies: %zu masks, mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us\n", n,
           k, sum / (double)k * 1e6, ts[k / 2] * 1e6, ts[(size_t)((double)k * 0.99)] * 1e6, ts[k - 1] * 1e6);
    /* the schema's first 21 replies together (the first one cold): the distribution a server sees */
    double *all = malloc((k + n_cold) * sizeof(double));
    memcpy(all, ts, k * sizeof(double));
    memcpy(all + k, cold, n_cold * sizeof(double));
    size_t na = k + n_cold, over = 0;
    qsort(all, na, sizeof(double), dbl_cmp);
    for (size_t i = 0; i < na; i++) {
        over += all[i] > 50e-6;
    }
    printf("vocab %d, all 21 replies (the first cold): %zu masks, p99 %.1f us, p99.9 %.1f us, max %.1f us, "
           "%zu over "
           "50 us\n",
           n, na, all[(size_t)((double)na * 0.99)] * 1e6, all[(size_t)((double)na * 0.999)] * 1e6,
           all[na - 1] * 1e6, over);
    free(all);
    free(ts);
    /* the cold reply again on fresh compiles of the schema, each step's least time over COLD_RUNS: a
     * step's work is the same in every run, so the least is it without the machine's interruptions
     * (a VM's steal time reaches 50-300 us every few ms) */
    double best[sizeof(TEXT)];
    for (size_t i = 0; i < n_cold; i++) {
        best[i] = 1e9;
    }
    for (int run = 0; run < COLD_RUNS; run++) {
        pd_grammar_t *h = NULL;
        pd_grammar_precompute_opts_t po = {.budget_s = 60.0};
        if (pd_grammar_from_gbnf(gb, strlen(gb), &h, err, sizeof(err)) != PD_OK ||
            (ahead && pd_grammar_precompute(h, v, &po, NULL, NULL) != PD_OK)) {
            fprintf(stderr, "pd-bench-grammar: compile failed: %s\n", err);
            return 1;
        }
        pd_gmatcher_t m;
        pd_gmatcher_init(&m, h);
        for (size_t i = 0; i < n_cold; i++) {
            double t0 = pd_time_now_s();
            pd_gmatcher_fill_mask(&m, v, &eos, 1, mask);
            double d = pd_time_now_s() - t0;
            best[i] = d < best[i] ? d : best[i];
            pd_gmatcher_accept(&m, (const uint8_t *)TEXT + i, 1);
        }
        pd_gmatcher_destroy(&m);
        pd_grammar_unref(h);
    }
    double bsum = 0;
    for (size_t i = 0; i < n_cold; i++) {
        bsum += best[i];
    }
    qsort(best, n_cold, sizeof(double), dbl_cmp);
    size_t bover = 0;
    for (size_t i = 0; i < n_cold; i++) {
        bover += best[i] > 50e-6;
    }
    printf(
        "vocab %d, cold, least of %d fresh compiles per step: %zu masks, mean %.1f us, p99 %.1f us, max %.1f "
        "us, %zu over 50 us\n",
        n, COLD_RUNS, n_cold, bsum / (double)n_cold * 1e6, best[(size_t)((double)n_cold * 0.99)] * 1e6,
        best[n_cold - 1] * 1e6, bover);
    pd_grammar_stats_t st;
    pd_grammar_get_stats(g, &st);
    printf("automaton: %llu nodes, %llu states; masks computed %llu (truncated-state walks %llu, taken from "
           "the walks made ahead %llu, uncertain tokens walked %llu), from the cache %llu\n",
           (unsigned long long)st.nodes, (unsigned long long)st.states, (unsigned long long)st.masks_computed,
           (unsigned long long)st.masks_truncated, (unsigned long long)st.walks_ahead_used,
           (unsigned long long)st.uncertain_walked, (unsigned long long)st.masks_cached);
out:
    pd_grammar_unref(g);
    pd_gvocab_free(v);
    free(gb);
    json_decref(schema);
    free(bytes), free(lens), free(excl), free(mask);
    pd_tokenizer_free(tok);
    return rc;
}
