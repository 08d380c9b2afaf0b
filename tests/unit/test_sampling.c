/* tests/unit/test_sampling.c — the sampling surface with vLLM's semantics: the logits processors'
 * exact arithmetic (bad_words, logit_bias, min_tokens, repetition / frequency / presence penalties,
 * in vLLM's order), then each parameter end to end on an in-process engine (CPU backend, tiny
 * model) with a check that fails when the parameter is ignored: logit_bias forces a token at
 * temperature 0, bad_words bans the greedy choice, repetition and frequency/presence penalties
 * change a greedy continuation that repeats, min_p 1 makes sampling greedy, min_tokens suppresses
 * an early EOS, stop_token_ids finish with the token as stop reason, include_stop_str_in_output. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/engine.h"
#include "engine/logits_process.h"
#include "test_util.h"

static char *g_model;
static pd_engine_t *g_engine;
static int32_t g_prompt[64];
static int g_prompt_len;

static void setup(void)
{
    pd_log_set_level(PD_LOG_WARN);
    g_model = tu_make_model("--preset tiny --arch llama");
    ck_assert_ptr_nonnull(g_model);
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 1;
    c.kv_cache_memory = 128u << 20;
    c.max_model_len = 256;
    ck_assert_int_eq(pd_engine_create(&c, &g_engine), PD_OK);
    /* a short prompt whose greedy continuation repeats tokens (checked by the penalty test) */
    int32_t *ids = NULL;
    size_t n = 0;
    const char *text = "the the the cache cache";
    ck_assert_int_eq(pd_tokenizer_encode(pd_engine_tokenizer(g_engine), text, strlen(text), true, &ids, &n),
                     PD_OK);
    memcpy(g_prompt, ids, n * sizeof(int32_t));
    g_prompt_len = (int)n;
    free(ids);
}

static void teardown(void)
{
    pd_engine_destroy(g_engine);
    tu_rmrf(g_model);
}

typedef struct result {
    int32_t ids[256];
    int n;
    char text[4096];
    char finish[16];
    char stop_str[64];
    int32_t stop_token;
} result_t;

static void run(const pd_request_params_t *p, const char *const *stops, int nstops, result_t *res)
{
    static int seq;
    char id[32];
    snprintf(id, sizeof(id), "r%d", seq++);
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = id;
    rq.prompt = g_prompt;
    rq.num_prompt = g_prompt_len;
    rq.params = *p;
    for (int i = 0; i < nstops; i++) {
        rq.stop[i] = stops[i];
    }
    rq.num_stop = nstops;
    char err[256];
    ck_assert_int_eq(pd_engine_add(g_engine, &rq, err, sizeof(err)), PD_OK);
    memset(res, 0, sizeof(*res));
    res->stop_token = -2;
    while (pd_engine_has_work(g_engine)) {
        pd_engine_output_t *o = NULL;
        ck_assert_int_eq(pd_engine_step(g_engine, &o), PD_OK);
        for (pd_engine_output_t *x = o; x != NULL; x = x->next) {
            if (x->token >= 0) {
                res->ids[res->n++] = x->token;
            }
            strncat(res->text, x->text, sizeof(res->text) - strlen(res->text) - 1);
            if (x->finish_reason != NULL) {
                snprintf(res->finish, sizeof(res->finish), "%s", x->finish_reason);
                snprintf(res->stop_str, sizeof(res->stop_str), "%s", x->stop_str != NULL ? x->stop_str : "");
                res->stop_token = x->stop_token;
            }
        }
        pd_engine_output_free(o);
    }
}

static pd_request_params_t greedy(int max_tokens)
{
    pd_request_params_t p;
    memset(&p, 0, sizeof(p));
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    p.repetition_penalty = 1.0f;
    p.sampling = (pd_sampling_params_t){0.0f, 0, 1.0f, 0.0f};
    return p;
}

static int count_repeats(const result_t *r)
{
    int rep = 0;
    for (int i = 0; i < r->n; i++) {
        for (int j = 0; j < i; j++) {
            if (r->ids[i] == r->ids[j]) {
                rep++;
                break;
            }
        }
    }
    return rep;
}

/* ------------------------------------------------------------------ processors, exactly */

static pd_request_t *make_req(const int32_t *prompt, int np, const int32_t *out, int no,
                              const pd_request_params_t *p)
{
    pd_request_t *r = NULL;
    ck_assert_int_eq(pd_request_create("x", prompt, np, p, 64, &r), PD_OK);
    for (int i = 0; i < no; i++) {
        ck_assert_int_eq(pd_request_append_token(r, out[i]), PD_OK);
    }
    return r;
}

START_TEST(test_processors_arithmetic)
{
    enum { V = 10 };
    pd_logits_scratch_t sc;
    ck_assert_int_eq(pd_logits_scratch_init(&sc, V), PD_OK);
    float base[V] = {1.0f, -1.0f, 2.0f, -2.0f, 0.5f, 3.0f, -0.5f, 0.0f, 4.0f, 1.5f};
    int32_t prompt[3] = {0, 1, 1};
    int32_t out[4] = {2, 2, 3, 9};
    pd_request_params_t p = greedy(10);
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    p.num_logit_bias = 2;
    p.logit_bias_ids[0] = 4, p.logit_bias[0] = 10.0f;
    p.logit_bias_ids[1] = 5, p.logit_bias[1] = -100.0f;
    pd_request_t *r = make_req(prompt, 3, out, 4, &p);
    float row[V];
    memcpy(row, base, sizeof(row));
    pd_logits_process(row, V, r, NULL, 0, &sc);
    /* repetition (prompt ∪ output: 0 1 2 3 9), then frequency (counts 2:2, 3:1, 9:1) and presence */
    ck_assert_float_eq_tol(row[0], 1.0f / 2, 1e-6);
    ck_assert_float_eq_tol(row[1], -1.0f * 2, 1e-6);
    ck_assert_float_eq_tol(row[2], 2.0f / 2 - 0.5f * 2 - 0.25f, 1e-6);
    ck_assert_float_eq_tol(row[3], -2.0f * 2 - 0.5f - 0.25f, 1e-6);
    ck_assert_float_eq_tol(row[9], 1.5f / 2 - 0.5f - 0.25f, 1e-6);
    ck_assert_float_eq_tol(row[4], 0.5f + 10, 1e-6); /* logit_bias, not penalised */
    ck_assert_float_eq_tol(row[5], 3.0f - 100, 1e-5);
    ck_assert_float_eq(row[7], 0.0f);
    ck_assert_float_eq(row[8], 4.0f);
    /* the scratch is left clean: a second run gives the same row */
    float again[V];
    memcpy(again, base, sizeof(again));
    pd_logits_process(again, V, r, NULL, 0, &sc);
    ck_assert_mem_eq(again, row, sizeof(row));
    for (int i = 0; i < V; i++) {
        ck_assert_uint_eq(sc.count[i], 0);
        ck_assert_uint_eq(sc.seen[i], 0);
    }
    pd_request_free(r);
    /* min_tokens masks EOS and stop ids while fewer outputs exist; bad_words bans a last token */
    pd_request_params_t q = greedy(10);
    q.min_tokens = 5;
    q.num_stop_token_ids = 1;
    q.stop_token_ids[0] = 6;
    q.num_bad_words = 2;
    q.bad_word_ids[0] = 7;                        /* a one-token word: always banned */
    q.bad_word_ids[1] = 3, q.bad_word_ids[2] = 8; /* "3 8": 8 banned right after 3 */
    q.bad_word_end[0] = 1, q.bad_word_end[1] = 3;
    int32_t eos = 9;
    r = make_req(prompt, 3, out, 3, &q); /* output 2 2 3 */
    memcpy(row, base, sizeof(row));
    pd_logits_process(row, V, r, &eos, 1, &sc);
    ck_assert(isinf(row[9]) && row[9] < 0);
    ck_assert(isinf(row[6]) && row[6] < 0);
    ck_assert(isinf(row[7]) && row[7] < 0);
    ck_assert(isinf(row[8]) && row[8] < 0);
    ck_assert_float_eq(row[2], base[2]);
    pd_request_free(r);
    r = make_req(prompt, 3, out, 2, &q); /* output 2 2: "3 8" does not apply */
    ck_assert_int_eq(pd_request_append_token(r, 4), PD_OK);
    ck_assert_int_eq(pd_request_append_token(r, 4), PD_OK);
    ck_assert_int_eq(pd_request_append_token(r, 4), PD_OK); /* 5 outputs: min_tokens reached */
    memcpy(row, base, sizeof(row));
    pd_logits_process(row, V, r, &eos, 1, &sc);
    ck_assert_float_eq(row[8], base[8]);
    ck_assert_float_eq(row[9], base[9]);
    ck_assert_float_eq(row[6], base[6]);
    ck_assert(isinf(row[7]));
    pd_request_free(r);
    pd_logits_scratch_destroy(&sc);
}
END_TEST

/* ------------------------------------------------------------------ end to end */

START_TEST(test_logit_bias_forces_a_token)
{
    pd_request_params_t p = greedy(6);
    result_t a, b;
    run(&p, NULL, 0, &a);
    int32_t forced = (a.ids[0] + 7) % 300 + 1;
    p.num_logit_bias = 1;
    p.logit_bias_ids[0] = forced;
    p.logit_bias[0] = 100.0f;
    run(&p, NULL, 0, &b);
    for (int i = 0; i < b.n; i++) {
        ck_assert_int_eq(b.ids[i], forced);
    }
    ck_assert_int_ne(a.ids[0], forced);
}
END_TEST

START_TEST(test_bad_words_ban_the_greedy_token)
{
    pd_request_params_t p = greedy(4);
    result_t a, b;
    run(&p, NULL, 0, &a);
    p.num_bad_words = 1;
    p.bad_word_ids[0] = a.ids[0];
    p.bad_word_end[0] = 1;
    run(&p, NULL, 0, &b);
    for (int i = 0; i < b.n; i++) {
        ck_assert_int_ne(b.ids[i], a.ids[0]);
    }
}
END_TEST

START_TEST(test_penalties_change_a_repeating_continuation)
{
    pd_request_params_t p = greedy(24);
    result_t plain, rep, freq;
    run(&p, NULL, 0, &plain);
    ck_assert_msg(count_repeats(&plain) >= 4, "the greedy continuation should repeat (it repeated %d tokens)",
                  count_repeats(&plain));
    p.repetition_penalty = 3.0f;
    run(&p, NULL, 0, &rep);
    ck_assert(memcmp(plain.ids, rep.ids, sizeof(int32_t) * 24) != 0);
    ck_assert_int_lt(count_repeats(&rep), count_repeats(&plain));
    p.repetition_penalty = 1.0f;
    p.frequency_penalty = 2.0f;
    p.presence_penalty = 2.0f;
    run(&p, NULL, 0, &freq);
    ck_assert(memcmp(plain.ids, freq.ids, sizeof(int32_t) * 24) != 0);
    ck_assert_int_lt(count_repeats(&freq), count_repeats(&plain));
    /* a repetition penalty below 1 rewards repeats instead */
    p.frequency_penalty = p.presence_penalty = 0;
    p.repetition_penalty = 0.2f;
    result_t more;
    run(&p, NULL, 0, &more);
    ck_assert_int_ge(count_repeats(&more), count_repeats(&plain));
}
END_TEST

START_TEST(test_min_p_one_is_greedy)
{
    pd_request_params_t p = greedy(12);
    result_t g, hot, minp;
    run(&p, NULL, 0, &g);
    p.sampling.temperature = 1.5f;
    p.has_seed = true;
    p.seed = 1234;
    run(&p, NULL, 0, &hot);
    ck_assert_msg(memcmp(g.ids, hot.ids, sizeof(int32_t) * 12) != 0, "temperature 1.5 matched greedy");
    p.sampling.min_p = 1.0f; /* only tokens as likely as the best one survive */
    run(&p, NULL, 0, &minp);
    ck_assert_mem_eq(g.ids, minp.ids, sizeof(int32_t) * 12);
}
END_TEST

START_TEST(test_min_tokens_suppresses_early_eos)
{
    const pd_model_config_t *mc = pd_engine_model_config(g_engine);
    ck_assert_int_ge(mc->num_eos, 1);
    pd_request_params_t p = greedy(20);
    p.ignore_eos = false;
    p.num_logit_bias = 1;
    p.logit_bias_ids[0] = mc->eos_token_ids[0];
    p.logit_bias[0] = 100.0f; /* EOS is the greedy choice at every step */
    result_t early, held;
    run(&p, NULL, 0, &early);
    ck_assert_int_eq(early.n, 1);
    ck_assert_str_eq(early.finish, "stop");
    ck_assert_int_eq(early.stop_token, -1); /* EOS is no stop_reason */
    p.min_tokens = 6;
    run(&p, NULL, 0, &held);
    ck_assert_int_eq(held.n, 7); /* 6 outputs without EOS, then EOS */
    ck_assert_str_eq(held.finish, "stop");
    for (int i = 0; i < 6; i++) {
        ck_assert_int_ne(held.ids[i], mc->eos_token_ids[0]);
    }
    ck_assert_int_eq(held.ids[6], mc->eos_token_ids[0]);
}
END_TEST

START_TEST(test_stop_reasons)
{
    pd_request_params_t p = greedy(12);
    result_t plain, tok;
    run(&p, NULL, 0, &plain);
    /* stop_token_ids: the third greedy token ends the request and is its stop reason */
    p.num_stop_token_ids = 1;
    p.stop_token_ids[0] = plain.ids[2];
    run(&p, NULL, 0, &tok);
    int first = 0;
    while (plain.ids[first] != plain.ids[2]) {
        first++;
    }
    ck_assert_int_eq(tok.n, first + 1);
    ck_assert_str_eq(tok.finish, "stop");
    ck_assert_int_eq(tok.stop_token, plain.ids[2]);
    /* stop strings: cut before the string, or kept with include_stop_str_in_output */
    ck_assert_uint_ge(strlen(plain.text), 6);
    char stop[8];
    memcpy(stop, plain.text + 3, 2);
    stop[2] = '\0';
    const char *stops[1] = {stop};
    p.num_stop_token_ids = 0;
    result_t cut, kept;
    run(&p, stops, 1, &cut);
    ck_assert_str_eq(cut.finish, "stop");
    ck_assert_str_eq(cut.stop_str, stop);
    const char *at = strstr(plain.text, stop);
    ck_assert_uint_eq(strlen(cut.text), (size_t)(at - plain.text));
    p.include_stop_str_in_output = true;
    run(&p, stops, 1, &kept);
    ck_assert_uint_eq(strlen(kept.text), (size_t)(at - plain.text) + 2);
    ck_assert_int_eq(strncmp(kept.text + strlen(kept.text) - 2, stop, 2), 0);
    /* min_tokens also defers stop strings */
    p.include_stop_str_in_output = false;
    p.min_tokens = 10;
    result_t late;
    run(&p, stops, 1, &late);
    ck_assert_int_ge(late.n, 10);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("sampling");
    TCase *tc = tcase_create("params");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_processors_arithmetic);
    tcase_add_test(tc, test_logit_bias_forces_a_token);
    tcase_add_test(tc, test_bad_words_ban_the_greedy_token);
    tcase_add_test(tc, test_penalties_change_a_repeating_continuation);
    tcase_add_test(tc, test_min_p_one_is_greedy);
    tcase_add_test(tc, test_min_tokens_suppresses_early_eos);
    tcase_add_test(tc, test_stop_reasons);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
