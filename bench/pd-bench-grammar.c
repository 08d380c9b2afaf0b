/* bench/pd-bench-grammar.c — the structured-output token mask's cost on a real vocabulary:
 *
 *   pd-bench-grammar TOKENIZER.json
 *
 * A JSON Schema's grammar follows a fixed JSON text byte by byte; each step's mask is timed, first
 * with every state new (cold: the automaton and the masks are built) and then again over the same
 * states (the masks come from the per-state cache). Prints mean, p50, p99 and max per pass, and what
 * the automaton and its caches hold. */
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

static int dbl_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    pd_tokenizer_t *tok = NULL;
    if (argc != 2 || pd_tokenizer_load_json(argv[1], &tok) != PD_OK) {
        fprintf(stderr, "usage: pd-bench-grammar TOKENIZER.json\n");
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
    pd_grammar_stats_t st;
    pd_grammar_get_stats(g, &st);
    printf("automaton: %llu nodes, %llu states; masks computed %llu (truncated-state walks %llu, uncertain "
           "tokens walked %llu), from the cache %llu\n",
           (unsigned long long)st.nodes, (unsigned long long)st.states, (unsigned long long)st.masks_computed,
           (unsigned long long)st.masks_truncated, (unsigned long long)st.uncertain_walked,
           (unsigned long long)st.masks_cached);
    pd_grammar_unref(g);
    pd_gvocab_free(v);
    free(gb);
    json_decref(schema);
    free(bytes), free(lens), free(excl), free(mask);
    pd_tokenizer_free(tok);
    return 0;
}
