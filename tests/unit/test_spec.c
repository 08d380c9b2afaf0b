/* tests/unit/test_spec.c — speculative decoding (--speculative-config): the n-gram proposer against
 * its definition; the verifier's rules (greedy: the matching prefix and a bonus token; sampling: the
 * output follows the target distribution whatever the draft, by a chi-square test); and the engine:
 * greedy outputs token for token those of the engine without speculation (chunked prefill with
 * drafts cut by the budget, preemption, prefix caching, stop strings inside accepted drafts,
 * max_tokens, logprobs), seeded runs reproducible, the token distribution at temperature 1 the
 * same with and without speculation, no block leaked and no cached block holding a rejected token. */
#include "test_util.h"

#include <check.h>
#include <math.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/rng.h"
#include "engine/engine.h"
#include "engine/spec_decode.h"
#include "engine/spec_verify.h"
#include "kernels/sample.h"
#include "model/config.h"
#include "scheduler/block_pool.h"

#include "engine_driver.h"
#include "grammar/grammar.h"

static char *g_model, *g_draft; /* the target; a smaller draft with its vocabulary */
static int32_t g_vocab;         /* the target's vocabulary size */

/* ------------------------------------------------------------------ proposer and verifier */

START_TEST(test_ngram_matches_reference)
{
    int32_t a[] = {1, 2, 3, 4, 1, 2}, out[8], ref[8];
    ck_assert_int_eq(pd_ngram_propose(a, 6, 2, 2, 3, out), 3); /* [1 2] at 0 → 3 4 1 */
    ck_assert(out[0] == 3 && out[1] == 4 && out[2] == 1);
    int32_t b[] = {5, 1, 2, 9, 1, 2, 7, 1, 2};                 /* [1 2] twice before: the earliest */
    ck_assert_int_eq(pd_ngram_propose(b, 9, 1, 3, 2, out), 2); /* [2 9]; [9 1 2] is not longer */
    ck_assert(out[0] == 9 && out[1] == 1);
    ck_assert_int_eq(pd_ngram_propose(b, 9, 3, 3, 2, out), 0); /* no earlier 3-gram [7 1 2] */
    pd_rng_t r;
    pd_rng_seed(&r, 7);
    int32_t t[100];
    long found = 0;
    for (int it = 0; it < 20000; it++) {
        int n = 1 + (int)pd_rng_below(&r, 99), alpha = 2 + (int)pd_rng_below(&r, 5);
        for (int i = 0; i < n; i++) {
            t[i] = (int32_t)pd_rng_below(&r, (uint64_t)alpha);
        }
        int lo = 1 + (int)pd_rng_below(&r, 3), hi = lo + (int)pd_rng_below(&r, 4),
            k = 1 + (int)pd_rng_below(&r, 6);
        int32_t c1 = pd_ngram_propose(t, n, lo, hi, k, out), c2 = pd_ngram_propose_ref(t, n, lo, hi, k, ref);
        ck_assert_msg(c1 == c2, "n %d alpha %d [%d, %d] k %d: %d vs %d", n, alpha, lo, hi, k, c1, c2);
        ck_assert_int_eq(memcmp(out, ref, (size_t)c1 * sizeof(int32_t)), 0);
        found += c1 > 0;
    }
    ck_assert_int_gt(found, 10000); /* the cases are not all misses */
}
END_TEST

START_TEST(test_spec_config_parse)
{
    pd_spec_config_t c;
    char err[256];
    ck_assert_int_eq(pd_spec_config_parse(NULL, &c, err, sizeof(err)), PD_OK);
    ck_assert_int_eq(c.method, PD_SPEC_NONE);
    ck_assert_int_eq(
        pd_spec_config_parse("{\"method\": \"ngram\", \"num_speculative_tokens\": 4}", &c, err, sizeof(err)),
        PD_OK);
    ck_assert(c.method == PD_SPEC_NGRAM && c.num_tokens == 4 && c.lookup_min == 5 && c.lookup_max == 5);
    ck_assert_int_eq(pd_spec_config_parse("{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                                          "\"prompt_lookup_max\": 4}",
                                          &c, err, sizeof(err)),
                     PD_OK);
    ck_assert(c.lookup_min == 4 && c.lookup_max == 4);
    ck_assert_int_eq(pd_spec_config_parse("{\"method\": \"draft_model\", \"model\": \"/m\", "
                                          "\"num_speculative_tokens\": 2}",
                                          &c, err, sizeof(err)),
                     PD_OK);
    ck_assert(c.method == PD_SPEC_DRAFT_MODEL && c.num_tokens == 2 && strcmp(c.draft_model, "/m") == 0);
    ck_assert_int_eq(
        pd_spec_config_parse("{\"model\": \"/m\", \"num_speculative_tokens\": 2}", &c, err, sizeof(err)),
        PD_OK); /* vLLM infers the method from "model" */
    ck_assert_int_eq(c.method, PD_SPEC_DRAFT_MODEL);
    ck_assert_int_eq(pd_spec_config_parse("{\"method\": \"ngram\", \"num_speculative_tokens\": 2, "
                                          "\"disable_by_batch_size\": 4}",
                                          &c, err, sizeof(err)),
                     PD_OK);
    ck_assert_int_eq(c.disable_by_batch_size, 4);
    const char *bad[] = {
        "{\"method\": \"ngram\"}",
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 0}",
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 2, \"prompt_lookup_min\": 3, "
        "\"prompt_lookup_max\": 2}",
        "{\"method\": \"eagle\", \"num_speculative_tokens\": 2}",
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 2, \"draft_tensor_parallel_size\": 1}",
        "{\"method\": \"ngram\", \"num_speculative_tokens\": \"2\"}",
        "{\"method\": \"draft_model\", \"num_speculative_tokens\": 2}",
        "{\"method\": \"ngram\", \"model\": \"/m\", \"num_speculative_tokens\": 2}",
        "{\"model\": \"/m\", \"num_speculative_tokens\": 2, \"prompt_lookup_max\": 3}",
        "{\"model\": 3, \"num_speculative_tokens\": 2}",
        "{\"method\": \"ngram\", \"num_speculative_tokens\": 2, \"disable_by_batch_size\": 1}",
        "[1]",
        "{",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        ck_assert_msg(pd_spec_config_parse(bad[i], &c, err, sizeof(err)) == PD_ERR_INVALID_ARG, "%s", bad[i]);
        ck_assert_msg(strstr(err, "--speculative-config") != NULL, "%s: %s", bad[i], err);
    }
}
END_TEST

START_TEST(test_verify_greedy)
{
    enum { V = 5 };
    /* row j's argmax: 2, 3, 1, 4 */
    float rows[4][V] = {{0, 1, 9, 2, 0}, {0, 1, 2, 9, 0}, {0, 9, 2, 3, 0}, {0, 1, 2, 3, 9}};
    pd_sampling_params_t p = {0, 0, 1, 0};
    pd_sample_cand_t c[V];
    pd_rng_t r[4];
    for (int j = 0; j < 4; j++) {
        pd_rng_seed_stream(&r[j], 1, (uint64_t)j);
    }
    int32_t out[4];
    int32_t all[] = {2, 3, 1};
    ck_assert_int_eq(pd_spec_verify(&rows[0][0], V, all, 3, &p, r, c, out), 4); /* all + the bonus */
    ck_assert(out[0] == 2 && out[1] == 3 && out[2] == 1 && out[3] == 4);
    int32_t second_wrong[] = {2, 0, 1};
    ck_assert_int_eq(pd_spec_verify(&rows[0][0], V, second_wrong, 3, &p, r, c, out), 2);
    ck_assert(out[0] == 2 && out[1] == 3);
    ck_assert_int_eq(pd_spec_verify(&rows[0][0], V, NULL, 0, &p, r, c, out), 1); /* no drafts */
    ck_assert_int_eq(out[0], 2);
}
END_TEST

/* Chi-square of counts against probabilities (cells with expectation >= 5). */
static double chi2(const long *count, const double *prob, int n, long total, int *df)
{
    double x = 0;
    *df = -1;
    for (int i = 0; i < n; i++) {
        double e = prob[i] * (double)total;
        if (e >= 5) {
            x += (count[i] - e) * (count[i] - e) / e;
            (*df)++;
        } else {
            ck_assert_msg(e > 0 || count[i] == 0, "token %d drawn with probability 0", i);
        }
    }
    return x;
}

/* The verifier's first output for one draft follows p, and after an accepted draft the second
 * follows the next row's p: checked for drafts of high, low and zero probability, with and without
 * top-k / top-p. Critical values at p = 0.001: the seeds are fixed, so the test is deterministic. */
START_TEST(test_verify_follows_target_distribution)
{
    enum { V = 8, N = 200000 };
    static const double crit[] = {0, 10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3};
    pd_rng_t r;
    pd_rng_seed(&r, 99);
    float rows[2][V];
    for (int i = 0; i < V; i++) {
        rows[0][i] = (float)pd_rng_normal(&r) * 1.5f;
        rows[1][i] = (float)pd_rng_normal(&r) * 1.5f;
    }
    pd_sampling_params_t ps[] = {{1.0f, 0, 1.0f, 0}, {0.7f, 5, 0.9f, 0}};
    for (size_t pi = 0; pi < 2; pi++) {
        const pd_sampling_params_t *p = &ps[pi];
        double prob[2][V] = {{0}};
        for (int j = 0; j < 2; j++) {
            pd_sample_cand_t c[V];
            double total;
            int n = pd_sample_dist(rows[j], V, p, c, &total);
            for (int i = 0; i < n; i++) {
                prob[j][c[i].id] = c[i].z / total;
            }
        }
        int hi = 0, lo = 0, zero = -1;
        for (int i = 0; i < V; i++) {
            hi = prob[0][i] > prob[0][hi] ? i : hi;
            lo = prob[0][i] > 0 && (prob[0][lo] == 0 || prob[0][i] < prob[0][lo]) ? i : lo;
            zero = prob[0][i] == 0 ? i : zero;
        }
        int drafts[3] = {hi, lo, zero >= 0 ? zero : hi};
        for (int d = 0; d < 3; d++) {
            long first[V] = {0}, second[V] = {0}, accepted = 0;
            pd_sample_cand_t c[V];
            for (int it = 0; it < N; it++) {
                int32_t draft[1] = {drafts[d]}, out[2];
                pd_rng_t pos[2]; /* the two positions' generators, fresh each round */
                pd_rng_seed_stream(&pos[0], pd_rng_next(&r), 0);
                pd_rng_seed_stream(&pos[1], pd_rng_next(&r), 1);
                int32_t n = pd_spec_verify(&rows[0][0], V, draft, 1, p, pos, c, out);
                first[out[0]]++;
                if (n == 2) {
                    ck_assert_int_eq(out[0], drafts[d]);
                    second[out[1]]++;
                    accepted++;
                }
            }
            int df;
            double x = chi2(first, prob[0], V, N, &df);
            ck_assert_msg(df >= 1 && x < crit[df], "params %zu draft %d: first token chi2 %.1f (df %d)", pi,
                          d, x, df);
            ck_assert_msg(fabs((double)accepted / N - prob[0][drafts[d]]) < 0.01, "acceptance %.4f vs p %.4f",
                          (double)accepted / N, prob[0][drafts[d]]);
            if (accepted > 1000) {
                x = chi2(second, prob[1], V, accepted, &df);
                ck_assert_msg(df >= 1 && x < crit[df], "params %zu draft %d: bonus token chi2 %.1f", pi, d,
                              x);
            }
        }
    }
}
END_TEST

/* ------------------------------------------------------------------ the engine */

static const char *NGRAM = "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 1, "
                           "\"prompt_lookup_max\": 3}";

static pd_engine_t *make_engine(const char *spec, int budget, int num_blocks, bool prefix)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 2;
    c.kv_cache_memory = 256u << 20;
    c.max_num_batched_tokens = budget;
    c.max_num_seqs = 64;
    c.max_model_len = 512;
    c.enable_prefix_caching = prefix;
    c.num_blocks_override = num_blocks;
    c.speculative_config = spec;
    pd_engine_t *e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_OK);
    return e;
}

typedef struct req {
    int32_t prompt[300];
    int32_t n;
    int32_t max_tokens;
    float temperature;
    int32_t top_k;
    uint64_t seed;
    int32_t logprobs;
    const char *stop;
    int32_t bias_ids[4]; /* logit_bias +bias on these (0 entries: none) */
    float bias;
    struct pd_grammar *grammar; /* a structured output (then EOS ends it), or NULL */
} req_t;

static void add(pd_engine_t *e, const req_t *q, int i, gen_t *g)
{
    char id[32], err[256];
    snprintf(id, sizeof(id), "r%d", i);
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = id;
    rq.prompt = q->prompt;
    rq.num_prompt = q->n;
    rq.params.max_tokens = q->max_tokens;
    rq.params.ignore_eos = q->grammar == NULL;
    rq.grammar = q->grammar;
    rq.params.sampling = (pd_sampling_params_t){q->temperature, q->top_k, 1.0f, 0.0f};
    rq.params.has_seed = true;
    rq.params.seed = q->seed;
    rq.params.logprobs = q->logprobs;
    for (int k = 0; k < 4 && q->bias != 0; k++) {
        rq.params.logit_bias_ids[k] = q->bias_ids[k];
        rq.params.logit_bias[k] = q->bias;
        rq.params.num_logit_bias = k + 1;
    }
    if (q->stop != NULL) {
        rq.stop[0] = q->stop;
        rq.num_stop = 1;
    }
    rq.user = g;
    ck_assert_msg(pd_engine_add(e, &rq, err, sizeof(err)) == PD_OK, "%s", err);
}

/* Prompts the n-gram lookup finds something in: a random phrase repeated, then a random tail. */
static void make_reqs(req_t *q, int count, uint64_t seed)
{
    int32_t vocab = g_vocab;
    pd_rng_t r;
    pd_rng_seed(&r, seed);
    memset(q, 0, (size_t)count * sizeof(req_t));
    for (int i = 0; i < count; i++) {
        int phrase = 3 + (int)pd_rng_below(&r, 10), reps = 1 + (int)pd_rng_below(&r, 6);
        int tail = (int)pd_rng_below(&r, 20);
        int32_t ph[16];
        for (int k = 0; k < phrase; k++) {
            ph[k] = 3 + (int32_t)pd_rng_below(&r, (uint64_t)vocab - 3);
        }
        for (int rep = 0; rep < reps; rep++) {
            for (int k = 0; k < phrase; k++) {
                q[i].prompt[q[i].n++] = ph[k];
            }
        }
        for (int k = 0; k < tail; k++) {
            q[i].prompt[q[i].n++] = 3 + (int32_t)pd_rng_below(&r, (uint64_t)vocab - 3);
        }
        q[i].max_tokens = 1 + (int32_t)pd_rng_below(&r, 60);
        q[i].seed = 500 + (uint64_t)i;
        q[i].logprobs = i % 3 == 0 ? 2 : 0;
    }
}

static void run_all(pd_engine_t *e, const req_t *q, int n, gen_t *g)
{
    memset(g, 0, (size_t)n * sizeof(gen_t));
    for (int i = 0; i < n; i++) {
        add(e, &q[i], i, &g[i]);
    }
    tu_engine_run_until_idle(e, 100000);
}

/* The outputs of q[n] on an engine without speculation. */
static void reference(const req_t *q, int n, gen_t *ref)
{
    pd_engine_t *plain = make_engine(NULL, 512, 0, false);
    run_all(plain, q, n, ref);
    pd_engine_destroy(plain);
}

static void assert_same(const gen_t *a, const gen_t *b, int i)
{
    ck_assert_msg(a->n == b->n, "request %d: %d vs %d tokens", i, a->n, b->n);
    for (int k = 0; k < a->n; k++) {
        ck_assert_msg(a->tokens[k] == b->tokens[k], "request %d token %d: %d vs %d", i, k, a->tokens[k],
                      b->tokens[k]);
        ck_assert_msg(fabsf(a->logprob[k] - b->logprob[k]) < 1e-3f, "request %d token %d: logprob %g vs %g",
                      i, k, a->logprob[k], b->logprob[k]);
    }
    ck_assert_str_eq(a->finish, b->finish);
    ck_assert_int_eq(a->completion, b->completion);
    ck_assert_uint_eq(a->text_len, b->text_len);
    ck_assert_int_eq(memcmp(a->text, b->text, a->text_len), 0);
}

/* Every block the prefix cache holds is a full block of some request's real tokens (prompt and
 * output): a block with a rejected draft's KV would carry a hash no real sequence has. Blocks
 * all free again. */
static void assert_cache_clean(pd_engine_t *e, const req_t *q, const gen_t *g, int n)
{
    const pd_block_pool_t *pool = pd_engine_block_pool(e);
    ck_assert_uint_eq(pd_block_pool_num_used(pool), 0);
    ck_assert_int_eq(pd_block_pool_check(pool), PD_OK);
    uint32_t cached = pd_block_pool_num_cached_free(pool), nb = pd_block_pool_num_blocks(pool);
    ck_assert_uint_eq(cached + pd_block_pool_num_free(pool), nb - 1);
    bool *seen = calloc(nb, 1);
    uint32_t accounted = 0;
    int32_t all[600];
    for (int i = 0; i < n; i++) {
        memcpy(all, q[i].prompt, (size_t)q[i].n * sizeof(int32_t));
        memcpy(all + q[i].n, g[i].tokens, (size_t)g[i].n * sizeof(int32_t));
        int32_t len = q[i].n + g[i].n;
        pd_hash128_t h;
        for (int32_t b = 0; (b + 1) * 16 <= len; b++) {
            h = pd_hash128_chain(b > 0 ? &h : NULL, all + b * 16, 16, NULL, 0);
            int64_t id = pd_block_pool_lookup(pool, h);
            if (id > 0 && !seen[id]) {
                seen[id] = true;
                accounted++;
            }
        }
    }
    free(seen);
    ck_assert_uint_gt(cached, 0);
    ck_assert_msg(accounted == cached, "%u cached blocks, %u of them hold real tokens", cached, accounted);
}

static void assert_speculated_all(pd_engine_t *e, bool all_accepted)
{
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    fprintf(stderr, "spec: %lu steps, %lu drafts, %lu draft tokens, %lu accepted (%.0f%%)\n",
            (unsigned long)st.steps, (unsigned long)st.spec_drafts, (unsigned long)st.spec_draft_tokens,
            (unsigned long)st.spec_accepted, 100.0 * (double)st.spec_accepted / (double)st.spec_draft_tokens);
    ck_assert_uint_gt(st.spec_drafts, 20);
    ck_assert_uint_gt(st.spec_accepted, 0);
    if (all_accepted) {
        ck_assert_uint_eq(st.spec_accepted, st.spec_draft_tokens);
    } else {
        ck_assert_uint_lt(st.spec_accepted, st.spec_draft_tokens); /* some were rejected too */
    }
}

static void assert_speculated(pd_engine_t *e)
{
    assert_speculated_all(e, false);
}

/* Greedy outputs with drafts equal those without, alone and batched, with a budget that cuts
 * drafts and chunks prompts, and with prefix caching. */
START_TEST(test_greedy_identical)
{
    enum { N = 40 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *ref = malloc(N * sizeof(gen_t)), *got = malloc(N * sizeof(gen_t));
    make_reqs(q, N, 11);
    reference(q, N, ref);
    int budgets[] = {256, 48, 7}; /* 7: most steps cut some request's drafts short */
    for (int b = 0; b < 3; b++) {
        pd_engine_t *e = make_engine(NGRAM, budgets[b], 0, true);
        run_all(e, q, N, got);
        for (int i = 0; i < N; i++) {
            assert_same(&got[i], &ref[i], i);
        }
        assert_speculated(e);
        assert_cache_clean(e, q, got, N);
        pd_engine_destroy(e);
    }
    free(q), free(ref), free(got);
}
END_TEST

/* Structured outputs with drafts: the verifier sees the grammar's masks on every draft row, so a
 * draft the grammar refuses is rejected and greedy outputs equal those without drafts; every
 * output, greedy or seeded, is in the grammar. */
START_TEST(test_grammar_with_drafts)
{
    enum { N = 24 };
    static const char gbnf[] = "root ::= [a-z ]{1,200}\n";
    char err[256];
    pd_grammar_t *g = NULL;
    ck_assert_msg(pd_grammar_from_gbnf(gbnf, strlen(gbnf), &g, err, sizeof(err)) == PD_OK, "%s", err);
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *ref = malloc(N * sizeof(gen_t)), *got = malloc(N * sizeof(gen_t));
    make_reqs(q, N, 23);
    for (int i = 0; i < N; i++) {
        q[i].grammar = g;
        q[i].logprobs = 0;
        q[i].temperature = i % 2 ? 0.8f : 0.0f;
    }
    reference(q, N, ref);
    pd_engine_t *e = make_engine(NGRAM, 256, 0, true);
    run_all(e, q, N, got);
    for (int i = 0; i < N; i++) {
        for (const gen_t *x = &got[i]; x != NULL; x = x == &got[i] ? &ref[i] : NULL) {
            ck_assert_msg(x->text_len > 0, "request %d: empty", i);
            for (size_t k = 0; k < x->text_len; k++) {
                ck_assert_msg((x->text[k] >= 'a' && x->text[k] <= 'z') || x->text[k] == ' ',
                              "request %d: '%.*s' leaves the grammar", i, (int)x->text_len, x->text);
            }
        }
        if (q[i].temperature == 0) {
            assert_same(&got[i], &ref[i], i);
        }
    }
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    fprintf(stderr, "grammar + ngram: %lu drafts, %lu draft tokens, %lu accepted\n",
            (unsigned long)st.spec_drafts, (unsigned long)st.spec_draft_tokens,
            (unsigned long)st.spec_accepted);
    ck_assert_uint_gt(st.spec_draft_tokens, 0);
    ck_assert_uint_lt(st.spec_accepted, st.spec_draft_tokens); /* the grammar refused some */
    pd_engine_destroy(e);
    pd_grammar_unref(g);
    free(q), free(ref), free(got);
}
END_TEST

/* Too few blocks for everyone: preemption (drafts dropped, and a draft model's KV with the blocks,
 * all recomputed) keeps the outputs, and every block comes back. */
static void greedy_identical_under_preemption(const char *spec, uint64_t seed)
{
    enum { N = 12 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *ref = malloc(N * sizeof(gen_t)), *got = malloc(N * sizeof(gen_t));
    make_reqs(q, N, seed);
    for (int i = 0; i < N; i++) {
        q[i].max_tokens = 60;
    }
    reference(q, N, ref);
    pd_engine_t *e = make_engine(spec, 256, 40, false);
    run_all(e, q, N, got);
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert_uint_gt(st.preemptions, 0);
    for (int i = 0; i < N; i++) {
        assert_same(&got[i], &ref[i], i);
    }
    assert_speculated(e);
    ck_assert_uint_eq(st.blocks_used, 0);
    ck_assert_uint_eq(st.blocks_free + st.blocks_cached_free, st.num_blocks - 1);
    pd_engine_destroy(e);
    free(q), free(ref), free(got);
}

START_TEST(test_greedy_identical_under_preemption)
{
    greedy_identical_under_preemption(NGRAM, 12);
}
END_TEST

/* Stop strings taken from the middle of the greedy outputs: the request ends at the same token and
 * text with drafts accepted past it; max_tokens is never passed. */
START_TEST(test_stop_strings_and_limits)
{
    enum { N = 30 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *full = malloc(N * sizeof(gen_t)), *ref = malloc(N * sizeof(gen_t)),
          *got = malloc(N * sizeof(gen_t));
    char stops[N][8];
    make_reqs(q, N, 13);
    for (int i = 0; i < N; i++) {
        q[i].max_tokens = 40;
    }
    reference(q, N, full);
    int with_stop = 0;
    for (int i = 0; i < N; i++) { /* 2 bytes at a character boundary past the middle */
        size_t at = full[i].text_len / 2;
        while (at < full[i].text_len && ((unsigned char)full[i].text[at] & 0xc0) == 0x80) {
            at++;
        }
        if (at + 2 <= full[i].text_len && (full[i].text[at + 1] & 0xc0) != 0x80) {
            memcpy(stops[i], full[i].text + at, 2);
            stops[i][2] = '\0';
            q[i].stop = stops[i];
            with_stop++;
        }
    }
    ck_assert_int_gt(with_stop, N / 2);
    reference(q, N, ref);
    pd_engine_t *e = make_engine(NGRAM, 256, 0, true);
    run_all(e, q, N, got);
    int stopped = 0;
    for (int i = 0; i < N; i++) {
        assert_same(&got[i], &ref[i], i);
        ck_assert_int_le(got[i].n, q[i].max_tokens);
        stopped += strcmp(got[i].finish, "stop") == 0;
    }
    ck_assert_int_gt(stopped, N / 2);
    assert_speculated(e);
    assert_cache_clean(e, q, got, N);
    pd_engine_destroy(e);
    free(q), free(full), free(ref), free(got);
}
END_TEST

/* Seeded sampling with drafts: the same requests with the same seeds give the same outputs. (Not
 * batched vs alone: a step's other sequences change the verify forward's shapes and so the logits
 * in their last bits, which moves a seeded draw that falls on a boundary.) */
START_TEST(test_seeded_reproducible)
{
    enum { N = 16 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *a = malloc(N * sizeof(gen_t)), *b = calloc(N, sizeof(gen_t));
    pd_engine_t *e = make_engine(NGRAM, 256, 0, false);
    make_reqs(q, N, 14);
    for (int i = 0; i < N; i++) {
        q[i].temperature = 0.8f;
        q[i].logprobs = 1;
        q[i].bias = 6.0f; /* a few likely tokens, so drafts are accepted now and then */
        for (int k = 0; k < 4; k++) {
            q[i].bias_ids[k] = q[i].prompt[k];
        }
    }
    run_all(e, q, N, a);
    run_all(e, q, N, b);
    for (int i = 0; i < N; i++) {
        assert_same(&b[i], &a[i], i);
    }
    assert_speculated(e);
    pd_engine_destroy(e);
    free(q), free(a), free(b);
}
END_TEST

/* At temperature 1 the tokens after the first (the ones drafts can supply) have the same joint
 * distribution with and without speculation: a chi-square test of homogeneity over the (2nd, 3rd)
 * output tokens of 3000 seeded requests each. The prompt ends in the model's own greedy
 * continuation, so the n-gram lookup proposes tokens the model finds likely, and top_k 3 keeps
 * the support small: drafts are accepted and rejected both. */
START_TEST(test_distribution_unchanged)
{
    enum { N = 3000 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *g = malloc(N * sizeof(gen_t));
    int32_t V = g_vocab;
    req_t base;
    make_reqs(&base, 1, 15);
    base.n = 8;
    base.max_tokens = 24;
    base.logprobs = 0;
    reference(&base, 1, g);
    memcpy(base.prompt + base.n, g[0].tokens, (size_t)g[0].n * sizeof(int32_t));
    base.n += g[0].n;
    long *cells = calloc(2 * (size_t)V * (size_t)V, sizeof(long));
    for (int run = 0; run < 2; run++) {
        pd_engine_t *e = make_engine(run == 0 ? NULL : NGRAM, 512, 0, false);
        for (int i = 0; i < N; i++) {
            q[i] = base;
            q[i].max_tokens = 3;
            q[i].temperature = 1.0f;
            q[i].top_k = 3;
            q[i].seed = 1000000 * (uint64_t)run + (uint64_t)i;
        }
        for (int at = 0; at < N; at += 500) {
            run_all(e, q + at, 500, g + at);
        }
        for (int i = 0; i < N; i++) {
            ck_assert_int_eq(g[i].n, 3);
            cells[(size_t)run * V * V + (size_t)g[i].tokens[1] * V + g[i].tokens[2]]++;
        }
        if (run == 1) {
            assert_speculated(e);
        }
        pd_engine_destroy(e);
    }
    double x2 = 0;
    int df = -1;
    long rare = 0;
    for (size_t c = 0; c < (size_t)V * V; c++) {
        long a = cells[c], b = cells[(size_t)V * V + c];
        if (a + b < 10) {
            rare += a + b;
            continue;
        }
        df++;
        double e = (double)(a + b) / 2;
        x2 += (a - e) * (a - e) / e + (b - e) * (b - e) / e;
    }
    fprintf(stderr, "distribution: chi2 %.1f, df %d, %ld samples in rare cells\n", x2, df, rare);
    ck_assert_int_ge(df, 3);
    ck_assert_int_lt(rare, N / 20);
    /* chi-square critical values at p = 0.001 for df = 1..30 */
    static const double crit[] = {10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6,
                                  31.3, 32.9, 34.5, 36.1, 37.7, 39.3, 40.8, 42.3, 43.8, 45.3,
                                  46.8, 48.3, 49.7, 51.2, 52.6, 54.1, 55.5, 56.9, 58.3, 59.7};
    ck_assert_msg(df <= 30 && x2 < crit[df - 1], "chi2 %.1f with df %d", x2, df);
    free(cells), free(q), free(g);
}
END_TEST

/* disable_by_batch_size: no drafts in steps that start with that many requests running; the tail of
 * a batch (fewer left) drafts again. Greedy outputs are the same either way. */
START_TEST(test_disable_by_batch_size)
{
    enum { N = 16 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *ref = malloc(N * sizeof(gen_t)), *got = malloc(N * sizeof(gen_t));
    make_reqs(q, N, 18);
    for (int i = 0; i < N; i++) {
        q[i].max_tokens = 20 + 3 * i; /* they finish one by one: the batch shrinks below the limit */
    }
    reference(q, N, ref);
    uint64_t drafts[2];
    const char *cfgs[2] = {NGRAM,
                           "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 1, "
                           "\"prompt_lookup_max\": 3, \"disable_by_batch_size\": 4}"};
    for (int c = 0; c < 2; c++) {
        pd_engine_t *e = make_engine(cfgs[c], 512, 0, false);
        run_all(e, q, N, got);
        for (int i = 0; i < N; i++) {
            assert_same(&got[i], &ref[i], i);
        }
        pd_engine_stats_t st;
        pd_engine_get_stats(e, &st);
        drafts[c] = st.spec_drafts;
        pd_engine_destroy(e);
    }
    fprintf(stderr, "disable_by_batch_size 4: %lu drafts, without it %lu\n", (unsigned long)drafts[1],
            (unsigned long)drafts[0]);
    ck_assert_uint_gt(drafts[1], 0);             /* the last three requests drafted */
    ck_assert_uint_lt(drafts[1], drafts[0] / 2); /* the full batch did not */
    free(q), free(ref), free(got);
}
END_TEST

static char *draft_config(const char *dir, int k)
{
    char *s = malloc(1200);
    snprintf(s, 1200, "{\"method\": \"draft_model\", \"model\": \"%s\", \"num_speculative_tokens\": %d}", dir,
             k);
    return s;
}

/* A draft model: the target itself (every draft accepted) and a smaller random one (some accepted):
 * greedy outputs equal the engine's without speculation, with budgets that cut drafts and chunk
 * prompts, prefix caching (a hit leaves the draft to compute the prefix itself), and blocks clean. */
START_TEST(test_draft_model_greedy_identical)
{
    enum { N = 24 };
    req_t *q = malloc(N * sizeof(req_t));
    gen_t *ref = malloc(N * sizeof(gen_t)), *got = malloc(N * sizeof(gen_t));
    make_reqs(q, N, 16);
    reference(q, N, ref);
    const char *drafts[2] = {g_model, g_draft};
    int budgets[2] = {256, 9};
    for (int m = 0; m < 2; m++) {
        for (int b = 0; b < 2; b++) {
            char *cfg = draft_config(drafts[m], 3);
            pd_engine_t *e = make_engine(cfg, budgets[b], 0, true);
            run_all(e, q, N, got);
            run_all(e, q, N, got); /* again: prefix hits this time */
            for (int i = 0; i < N; i++) {
                assert_same(&got[i], &ref[i], i);
            }
            assert_speculated_all(e, m == 0); /* the target drafting for itself: all accepted */
            assert_cache_clean(e, q, got, N);
            pd_engine_destroy(e);
            free(cfg);
        }
    }
    free(q), free(ref), free(got);
}
END_TEST

/* The draft model under preemption. */
START_TEST(test_draft_model_under_preemption)
{
    char *cfg = draft_config(g_draft, 4);
    greedy_identical_under_preemption(cfg, 17);
    free(cfg);
}
END_TEST

/* A draft model with another vocabulary is refused at startup, as one that is not a model. */
START_TEST(test_draft_model_refused)
{
    char *other = tu_make_model("--preset tiny --arch llama --vocab 300");
    ck_assert_ptr_nonnull(other);
    const char *dirs[2] = {other, "/nonexistent-draft"};
    for (int i = 0; i < 2; i++) {
        pd_engine_config_t c;
        pd_engine_config_defaults(&c);
        c.model_dir = g_model;
        c.threads = 1;
        c.kv_cache_memory = 64u << 20;
        c.max_model_len = 512;
        char *cfg = draft_config(dirs[i], 2);
        c.speculative_config = cfg;
        pd_engine_t *e = NULL;
        ck_assert_int_ne(pd_engine_create(&c, &e), PD_OK);
        ck_assert_ptr_null(e);
        free(cfg);
    }
    tu_rmrf(other);
    free(other);
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_WARN);
    g_model = tu_make_model("--preset tiny --arch llama");
    /* the draft: the target cut after its first layer (its config says 1 layer; the second layer's
     * tensors are left unread), an early-exit draft that agrees with the target now and then */
    g_draft = tu_mkdtemp("draft");
    if (g_model != NULL && g_draft != NULL &&
        tu_run(30,
               "cp -r %s/. %s/ && sed -i \"s/num_hidden_layers.: *[0-9]*/num_hidden_layers\\\": 1/\" "
               "%s/config.json",
               g_model, g_draft, g_draft) != 0) {
        free(g_draft);
        g_draft = NULL;
    }
    pd_model_config_t mc;
    if (g_model == NULL || g_draft == NULL || pd_model_config_load(g_model, &mc) != PD_OK) {
        fprintf(stderr, "cannot make the tiny model\n");
        return 1;
    }
    g_vocab = mc.vocab_size;
    Suite *s = suite_create("spec");
    TCase *tc = tcase_create("spec");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_ngram_matches_reference);
    tcase_add_test(tc, test_spec_config_parse);
    tcase_add_test(tc, test_verify_greedy);
    tcase_add_test(tc, test_verify_follows_target_distribution);
    tcase_add_test(tc, test_greedy_identical);
    tcase_add_test(tc, test_grammar_with_drafts);
    tcase_add_test(tc, test_greedy_identical_under_preemption);
    tcase_add_test(tc, test_stop_strings_and_limits);
    tcase_add_test(tc, test_seeded_reproducible);
    tcase_add_test(tc, test_distribution_unchanged);
    tcase_add_test(tc, test_disable_by_batch_size);
    tcase_add_test(tc, test_draft_model_greedy_identical);
    tcase_add_test(tc, test_draft_model_under_preemption);
    tcase_add_test(tc, test_draft_model_refused);
    suite_add_tcase(s, tc);
    int rc = tu_run_suite(s);
    tu_rmrf(g_model), tu_rmrf(g_draft);
    free(g_model), free(g_draft);
    return rc;
}
