#define _GNU_SOURCE
/* tests/unit/test_bench.c — pd-bench: the metric formulas on hand-computed synthetic timestamps
 * (output_len 1, a failed request, goodput with each SLO kind, peak concurrency), the arrival
 * generator's mean and coefficient of variation for burstiness 1 and 0.5, the ShareGPT filter,
 * and an end-to-end run of 20 requests against a real pd-serve whose token counts are exact. */
#include "test_util.h"

#include <check.h>
#include <jansson.h>
#include <math.h>

#include "bench/bench_load.h"
#include "bench/bench_stats.h"
#include "common/log.h"

START_TEST(test_metric_formulas)
{
    double ta[] = {0.10, 0.15, 0.25}, tb[] = {1.2};
    pd_bench_record_t r[3];
    memset(r, 0, sizeof(r));
    r[0] = (pd_bench_record_t){true, 10, 3, 0.0, ta, 3, 0.25, "", 0};
    r[1] = (pd_bench_record_t){true, 5, 1, 1.0, tb, 1, 1.2, "", 0};
    r[2] = (pd_bench_record_t){false, 7, 0, 0.2, NULL, 0, 0.3, "HTTP 503", 0};
    double pct[] = {50, 99};
    pd_bench_summary_t s;
    pd_bench_summarize(r, 3, 2.0, NULL, pct, 2, &s);
    ck_assert_int_eq(s.completed, 2);
    ck_assert_int_eq(s.failed, 1);
    ck_assert_int_eq(s.total_input_tokens, 15);
    ck_assert_int_eq(s.total_output_tokens, 4);
    ck_assert_double_eq_tol(s.request_throughput, 1.0, 1e-12);
    ck_assert_double_eq_tol(s.output_throughput, 2.0, 1e-12);
    ck_assert_double_eq_tol(s.total_token_throughput, 9.5, 1e-12);
    /* ttft: 100 and 200 ms */
    ck_assert_double_eq_tol(s.ttft.mean, 150, 1e-9);
    ck_assert_double_eq_tol(s.ttft.median, 150, 1e-9);
    ck_assert_double_eq_tol(s.ttft.std, 50, 1e-9);
    ck_assert_double_eq_tol(s.ttft.pct[1], 199, 1e-9); /* numpy: 100 + 0.99 · 100 */
    /* tpot only for output_len > 1: (250 − 100) / 2 */
    ck_assert_int_eq(s.tpot.n, 1);
    ck_assert_double_eq_tol(s.tpot.mean, 75, 1e-9);
    /* itl pooled: 50 and 100 ms; the one-chunk request adds none */
    ck_assert_int_eq(s.itl.n, 2);
    ck_assert_double_eq_tol(s.itl.mean, 75, 1e-9);
    ck_assert_double_eq_tol(s.e2el.mean, 225, 1e-9);
    /* requests 0 and 2 overlap in [0.2, 0.25] */
    ck_assert_int_eq(s.max_concurrent_requests, 2);
    /* goodput, one SLO kind at a time */
    pd_bench_slo_t slo = {150, 0, 0};
    pd_bench_summarize(r, 3, 2.0, &slo, pct, 2, &s);
    ck_assert_int_eq(s.good, 1); /* A: 100 ≤ 150; B: 200 > 150 */
    ck_assert_double_eq_tol(s.request_goodput, 0.5, 1e-12);
    slo = (pd_bench_slo_t){0, 50, 0};
    pd_bench_summarize(r, 3, 2.0, &slo, pct, 2, &s);
    ck_assert_int_eq(s.good, 1); /* A: tpot 75 > 50; B has no tpot and passes */
    slo = (pd_bench_slo_t){0, 0, 220};
    pd_bench_summarize(r, 3, 2.0, &slo, pct, 2, &s);
    ck_assert_int_eq(s.good, 1); /* A: 250 > 220; B: 200 */
    slo = (pd_bench_slo_t){300, 80, 300};
    pd_bench_summarize(r, 3, 2.0, &slo, pct, 2, &s);
    ck_assert_int_eq(s.good, 2);
    /* duration derived from the records when not given: 0 → 1.2 s */
    pd_bench_summarize(r, 3, 0, NULL, pct, 2, &s);
    ck_assert_double_eq_tol(s.duration, 1.2, 1e-12);
    /* parsers */
    char err[128];
    ck_assert(pd_bench_parse_goodput("ttft:500 tpot:50", &slo, err, sizeof(err)));
    ck_assert_double_eq(slo.ttft_ms, 500);
    ck_assert_double_eq(slo.tpot_ms, 50);
    ck_assert(!pd_bench_parse_goodput("ttft:-1", &slo, err, sizeof(err)));
    ck_assert(!pd_bench_parse_goodput("latency:5", &slo, err, sizeof(err)));
    double p[8];
    ck_assert_int_eq(pd_bench_parse_percentiles("50,90,99", p), 3);
    ck_assert_int_eq(pd_bench_parse_percentiles("0", p), -1);
    ck_assert_int_eq(pd_bench_parse_percentiles("50,x", p), -1);
}
END_TEST

static void gap_stats(double rate, double burst, double *mean, double *cv)
{
    pd_rng_t rng;
    pd_rng_seed(&rng, 1234);
    int n = 40000;
    double s = 0, ss = 0;
    for (int i = 0; i < n; i++) {
        double g = pd_bench_next_gap(&rng, rate, burst);
        s += g;
        ss += g * g;
    }
    *mean = s / n;
    double var = ss / n - *mean * *mean;
    *cv = sqrt(var) / *mean;
}

START_TEST(test_arrivals)
{
    double mean, cv;
    gap_stats(10, 1.0, &mean, &cv);
    ck_assert_msg(fabs(mean - 0.1) < 0.003, "Poisson mean gap %g", mean);
    ck_assert_msg(fabs(cv - 1.0) < 0.03, "Poisson CV %g", cv);
    gap_stats(10, 0.5, &mean, &cv);
    ck_assert_msg(fabs(mean - 0.1) < 0.004, "burstiness 0.5 mean gap %g", mean);
    ck_assert_msg(fabs(cv - sqrt(2.0)) < 0.06, "burstiness 0.5 CV %g (want 1.414)", cv);
    gap_stats(10, 4.0, &mean, &cv);
    ck_assert_msg(fabs(cv - 0.5) < 0.02, "burstiness 4 CV %g", cv);
    pd_rng_t rng;
    pd_rng_seed(&rng, 1);
    ck_assert_double_eq(pd_bench_next_gap(&rng, INFINITY, 1), 0);
}
END_TEST

START_TEST(test_datasets)
{
    ck_assert(pd_bench_sharegpt_keep(4, 4));
    ck_assert(!pd_bench_sharegpt_keep(3, 100));
    ck_assert(!pd_bench_sharegpt_keep(100, 3));
    ck_assert(pd_bench_sharegpt_keep(1024, 1024));
    ck_assert(!pd_bench_sharegpt_keep(1025, 10));
    ck_assert(!pd_bench_sharegpt_keep(1000, 1049));
    char *dir = tu_mkdtemp("bench");
    char path[512];
    snprintf(path, sizeof(path), "%s/sharegpt.json", dir);
    char *long_prompt = malloc(5000);
    memset(long_prompt, 'x', 4999);
    long_prompt[4999] = '\0';
    json_t *a = json_pack(
        "[{s:[{s:s,s:s}]}, {s:[{s:s,s:s},{s:s,s:s}]}, {s:[{s:s,s:s},{s:s,s:s}]}, {s:[{s:s,s:s},{s:s,s:s}]},"
        " {s:[{s:s,s:s},{s:s,s:s}]}]",
        "conversations", "from", "human", "value", "only one turn", /* dropped: one turn */
        "conversations", "from", "human", "value", "hi", "from", "gpt", "value", "a long enough answer here",
        "conversations", "from", "human", "value", "a question of enough length", "from", "gpt", "value",
        "an answer of enough length too", "conversations", "from", "human", "value", long_prompt, "from",
        "gpt", "value", "an answer of enough length", "conversations", "from", "human", "value",
        "another question, long enough", "from", "gpt", "value", "and its answer, long enough");
    ck_assert_ptr_nonnull(a);
    ck_assert_int_eq(json_dump_file(a, path, 0), 0);
    json_decref(a);
    free(long_prompt);
    pd_bench_dataset_t d;
    ck_assert_int_eq(pd_bench_dataset_sharegpt(path, 7, 100, 0, NULL, NULL, &d), PD_OK);
    ck_assert_int_eq(d.n, 2); /* one turn, a 1-token prompt and a 1250-token prompt are filtered */
    for (size_t i = 0; i < d.n; i++) {
        ck_assert(strstr(d.prompts[i].text, "question") != NULL);
        ck_assert_int_ge(d.prompts[i].output_len, 4);
    }
    pd_bench_dataset_free(&d);
    ck_assert_int_eq(pd_bench_dataset_sharegpt(path, 7, 100, 16, NULL, NULL, &d), PD_OK);
    ck_assert_int_eq(d.prompts[0].output_len, 16);
    pd_bench_dataset_free(&d);
    /* a malformed file is an error */
    ck_assert_int_eq(tu_write_file(path, "{\"not\": \"a list\"}", 17), 0);
    ck_assert_int_eq(pd_bench_dataset_sharegpt(path, 7, 100, 0, NULL, NULL, &d), PD_ERR_PARSE);
    /* random: lengths in range, a shared prefix */
    ck_assert_int_eq(pd_bench_dataset_random(3, 50, 100, 20, 0.5, 8, 500, &d), PD_OK);
    for (size_t i = 0; i < d.n; i++) {
        ck_assert_int_ge(d.prompts[i].input_len, 8 + 50);
        ck_assert_int_le(d.prompts[i].input_len, 8 + 150);
        ck_assert_int_ge(d.prompts[i].output_len, 10);
        ck_assert_int_le(d.prompts[i].output_len, 30);
        ck_assert_int_eq(memcmp(d.prompts[i].ids, d.prompts[0].ids, 8 * sizeof(int32_t)), 0);
        for (int32_t t = 0; t < d.prompts[i].num_ids; t++) {
            ck_assert(d.prompts[i].ids[t] >= 0 && d.prompts[i].ids[t] < 500);
        }
    }
    pd_bench_dataset_free(&d);
    /* prefix repetition: every prompt starts with one of 3 prefixes */
    ck_assert_int_eq(pd_bench_dataset_prefix_repetition(3, 30, 16, 8, 3, 4, 500, &d), PD_OK);
    int distinct = 0;
    for (size_t i = 0; i < d.n; i++) {
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++) {
            seen = memcmp(d.prompts[i].ids, d.prompts[j].ids, 16 * sizeof(int32_t)) == 0;
        }
        distinct += !seen;
    }
    ck_assert_int_eq(distinct, 3);
    pd_bench_dataset_free(&d);
    /* repeat: each prompt is its first 5 ids over and over */
    ck_assert_int_eq(pd_bench_dataset_repeat(4, 6, 23, 5, 9, 500, &d), PD_OK);
    for (size_t i = 0; i < d.n; i++) {
        ck_assert_int_eq(d.prompts[i].num_ids, 23);
        ck_assert_int_eq(d.prompts[i].output_len, 9);
        for (int32_t t = 5; t < 23; t++) {
            ck_assert_int_eq(d.prompts[i].ids[t], d.prompts[i].ids[t % 5]);
        }
    }
    ck_assert_int_ne(memcmp(d.prompts[0].ids, d.prompts[1].ids, 5 * sizeof(int32_t)), 0);
    pd_bench_dataset_free(&d);
    /* mixed: 200 prompts, about a quarter the random ones (40 ids), the rest 24-id repetitions */
    pd_bench_dataset_t pa, pb;
    ck_assert_int_eq(pd_bench_dataset_prefix_repetition(5, 200, 16, 8, 3, 4, 500, &pa), PD_OK);
    ck_assert_int_eq(pd_bench_dataset_random(6, 200, 40, 7, 0, 0, 500, &pb), PD_OK);
    ck_assert_int_eq(pd_bench_dataset_mix(7, &pa, &pb, 0.25, &d), PD_OK);
    ck_assert_ptr_null(pa.prompts);
    ck_assert_ptr_null(pb.prompts);
    ck_assert_int_eq((int)d.n, 200);
    int fresh = 0;
    for (size_t i = 0; i < d.n; i++) {
        ck_assert(d.prompts[i].num_ids == 40 || d.prompts[i].num_ids == 24);
        ck_assert_int_eq(d.prompts[i].output_len, d.prompts[i].num_ids == 40 ? 7 : 4);
        fresh += d.prompts[i].num_ids == 40;
    }
    ck_assert_msg(fresh > 30 && fresh < 70, "%d of 200 fresh prompts for a share of 0.25", fresh);
    pd_bench_dataset_free(&d);
    /* multi-turn: 3 conversations × 4 turns; each opens with the one 10-id system prompt and a 6-id
     * user message, later turns carry only their user message */
    ck_assert_int_eq(pd_bench_dataset_multi_turn(8, 3, 4, 10, 6, 5, 500, &d), PD_OK);
    ck_assert_int_eq((int)d.n, 12);
    for (size_t i = 0; i < d.n; i++) {
        bool first = i % 4 == 0;
        ck_assert_int_eq(d.prompts[i].follows, !first);
        ck_assert_int_eq(d.prompts[i].num_ids, first ? 16 : 6);
        ck_assert_int_eq(d.prompts[i].output_len, 5);
        if (first && i > 0) {
            ck_assert_int_eq(memcmp(d.prompts[i].ids, d.prompts[0].ids, 10 * sizeof(int32_t)), 0);
            ck_assert_int_ne(memcmp(d.prompts[i].ids + 10, d.prompts[0].ids + 10, 6 * sizeof(int32_t)), 0);
        }
    }
    pd_bench_dataset_free(&d);
    ck_assert_int_eq(pd_bench_dataset_multi_turn(8, 3, 0, 10, 6, 5, 500, &d), PD_ERR_INVALID_ARG);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(test_end_to_end_against_pd_serve)
{
    char *model = tu_make_model("--preset tiny --arch llama");
    char *dir = tu_mkdtemp("bench-e2e");
    ck_assert(model != NULL && dir != NULL);
    char port_file[512], log[512], bin[512], result[512];
    snprintf(port_file, sizeof(port_file), "%s/serve.port", dir);
    snprintf(log, sizeof(log), "%s/serve.log", dir);
    snprintf(bin, sizeof(bin), "%s/bin/pd-serve", tu_binary_dir());
    snprintf(result, sizeof(result), "%s/result.json", dir);
    char *argv[] = {bin,       "--model",           model,  "--port",    "0", "--port-file",
                    port_file, "--kv-cache-memory", "256M", "--threads", "1", NULL};
    pid_t pid = tu_spawn(argv, log);
    int port = tu_wait_port(pid, port_file, 120);
    ck_assert_msg(port > 0, "pd-serve did not start; see %s", log);
    int rc =
        tu_run(120,
               "%s/bin/pd-bench --base-url http://127.0.0.1:%d --num-prompts 20 --random-input-len 32 "
               "--random-output-len 8 --ignore-eos --request-rate 50 --max-concurrency 8 --seed 5 "
               "--num-warmups 2 --no-progress --save-result --result-filename %s --metric-percentiles 50,99 "
               "--goodput ttft:60000 > %s/bench.out 2>&1",
               tu_binary_dir(), port, result, dir);
    /* ShareGPT lengths counted exactly: by the server's /tokenize, or by --tokenizer with the model
     * directory; either way the input tokens pd-bench reports are the server's prompt_tokens */
    char sg[600];
    snprintf(sg, sizeof(sg), "%s/sharegpt.json", dir);
    json_t *conv = json_array();
    for (int i = 0; i < 12; i++) {
        char q[200], a[200];
        snprintf(q, sizeof(q), "Question %d: how do prefill and decode pools share %d KV blocks, über-fast?",
                 i, i * 7);
        snprintf(a, sizeof(a), "Answer %d: the decode reads the prefill's pages once the lease is granted.",
                 i);
        json_array_append_new(conv, json_pack("{s:[{s:s,s:s},{s:s,s:s}]}", "conversations", "from", "human",
                                              "value", q, "from", "gpt", "value", a));
    }
    ck_assert_int_eq(json_dump_file(conv, sg, 0), 0);
    json_decref(conv);
    for (int local = 0; local < 2; local++) {
        char res[600], tokflag[600] = "";
        snprintf(res, sizeof(res), "%s/sharegpt%d.json", dir, local);
        if (local) {
            snprintf(tokflag, sizeof(tokflag), "--tokenizer %s", model);
        }
        int src =
            tu_run(120,
                   "%s/bin/pd-bench --base-url http://127.0.0.1:%d --dataset-name sharegpt --dataset-path %s "
                   "%s --num-prompts 10 --sharegpt-output-len 4 --ignore-eos --no-progress --save-result "
                   "--result-filename %s > %s/sharegpt%d.out 2>&1",
                   tu_binary_dir(), port, sg, tokflag, res, dir, local);
        ck_assert_msg(src == 0, "pd-bench sharegpt failed; see %s/sharegpt%d.out", dir, local);
        json_t *sj = json_load_file(res, 0, NULL);
        ck_assert_ptr_nonnull(sj);
        ck_assert_int_eq(json_integer_value(json_object_get(sj, "completed")), 10);
        json_int_t mine = json_integer_value(json_object_get(sj, "total_input_tokens"));
        json_int_t server = json_integer_value(json_object_get(sj, "server_input_tokens"));
        ck_assert_msg(mine == server && mine > 0, "%s: pd-bench counted %lld input tokens, the server %lld",
                      local ? "--tokenizer" : "/tokenize", (long long)mine, (long long)server);
        json_decref(sj);
    }
    /* multi-turn: each turn continues the previous prompt and the ids the server answered (its
     * return_token_ids), so turn k sends 48 + 24·k tokens, all the server's count; the later
     * turns find their history in the prefix cache */
    char mt[600];
    snprintf(mt, sizeof(mt), "%s/mt.json", dir);
    int mrc =
        tu_run(120,
               "%s/bin/pd-bench --base-url http://127.0.0.1:%d --dataset-name multi-turn --num-prompts 3 "
               "--multi-turn-turns 3 --multi-turn-system-len 32 --multi-turn-user-len 16 "
               "--random-output-len 8 --multi-turn-think-time 0.05 --ignore-eos --no-progress --save-result "
               "--result-filename %s > %s/mt.out 2>&1",
               tu_binary_dir(), port, mt, dir);
    ck_assert_msg(mrc == 0, "pd-bench multi-turn failed; see %s/mt.out", dir);
    json_t *mj = json_load_file(mt, 0, NULL);
    ck_assert_ptr_nonnull(mj);
    ck_assert_int_eq(json_integer_value(json_object_get(mj, "completed")), 9);
    for (size_t i = 0; i < 9; i++) {
        ck_assert_int_eq(json_integer_value(json_array_get(json_object_get(mj, "input_lens"), i)),
                         48 + 24 * (json_int_t)(i % 3));
    }
    ck_assert_int_eq(json_integer_value(json_object_get(mj, "server_input_tokens")),
                     json_integer_value(json_object_get(mj, "total_input_tokens")));
    json_t *later = json_object_get(mj, "later_turns");
    ck_assert_int_eq(json_integer_value(json_object_get(later, "completed")), 6);
    ck_assert_int_ge(json_integer_value(json_object_get(later, "cached_input_tokens")), 6 * 48);
    json_decref(mj);
    /* multi-turn over ShareGPT conversations: their human turns in order with the server's answers
     * between them, as text; each turn's prompt holds the one before, so it is longer and later
     * turns find the history cached; a conversation of one gpt turn first is skipped to its human */
    json_t *convs = json_array();
    for (int i = 0; i < 3; i++) {
        json_t *turns = json_array();
        if (i == 2) {
            json_array_append_new(turns,
                                  json_pack("{s:s,s:s}", "from", "gpt", "value", "Hello, how can I help?"));
        }
        for (int t = 0; t < 3; t++) {
            char q[200];
            snprintf(q, sizeof(q),
                     "Conversation %d, question %d: why do prefill and decode pools share KV blocks?", i, t);
            json_array_append_new(turns, json_pack("{s:s,s:s}", "from", "human", "value", q));
            json_array_append_new(turns,
                                  json_pack("{s:s,s:s}", "from", "gpt", "value", "Because of leases."));
        }
        json_array_append_new(convs, json_pack("{s:o}", "conversations", turns));
    }
    snprintf(mt, sizeof(mt), "%s/mt-sharegpt.json", dir);
    ck_assert_int_eq(json_dump_file(convs, mt, 0), 0);
    json_decref(convs);
    char mtr[600];
    snprintf(mtr, sizeof(mtr), "%s/mt-sharegpt-result.json", dir);
    mrc = tu_run(120,
                 "%s/bin/pd-bench --base-url http://127.0.0.1:%d --dataset-name multi-turn --dataset-path %s "
                 "--num-prompts 3 --multi-turn-turns 3 --sharegpt-output-len 6 --multi-turn-think-time 0.05 "
                 "--ignore-eos --no-progress --save-result --result-filename %s > %s/mt-sharegpt.out 2>&1",
                 tu_binary_dir(), port, mt, mtr, dir);
    ck_assert_msg(mrc == 0, "pd-bench multi-turn ShareGPT failed; see %s/mt-sharegpt.out", dir);
    mj = json_load_file(mtr, 0, NULL);
    ck_assert_ptr_nonnull(mj);
    ck_assert_int_eq(json_integer_value(json_object_get(mj, "completed")), 9);
    for (size_t c = 0; c < 3; c++) {
        json_t *lens = json_object_get(mj, "input_lens");
        for (size_t t = 1; t < 3; t++) {
            ck_assert_int_gt(json_integer_value(json_array_get(lens, c * 3 + t)),
                             json_integer_value(json_array_get(lens, c * 3 + t - 1)) + 6);
        }
    }
    ck_assert_int_eq(json_integer_value(json_object_get(mj, "server_input_tokens")),
                     json_integer_value(json_object_get(mj, "total_input_tokens")));
    ck_assert_int_gt(
        json_integer_value(json_object_get(json_object_get(mj, "later_turns"), "cached_input_tokens")), 0);
    json_decref(mj);
    ck_assert_int_eq(tu_stop(pid, 30), 0);
    ck_assert_msg(rc == 0, "pd-bench failed; see %s/bench.out", dir);
    json_error_t e;
    json_t *j = json_load_file(result, 0, &e);
    ck_assert_ptr_nonnull(j);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "completed")), 20);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "failed")), 0);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_input_tokens")), 20 * 32);
    ck_assert_int_eq(json_integer_value(json_object_get(j, "total_output_tokens")), 20 * 8);
    json_t *outs = json_object_get(j, "output_lens");
    ck_assert_int_eq(json_array_size(outs), 20);
    for (size_t i = 0; i < 20; i++) {
        ck_assert_int_eq(json_integer_value(json_array_get(outs, i)), 8);
        ck_assert_int_eq(json_array_size(json_array_get(json_object_get(j, "itls"), i)), 7);
    }
    ck_assert(json_real_value(json_object_get(j, "request_goodput")) > 0);
    ck_assert_int_le(json_integer_value(json_object_get(j, "max_concurrent_requests")), 8);
    ck_assert(json_real_value(json_object_get(j, "p99_ttft_ms")) >=
              json_real_value(json_object_get(j, "median_ttft_ms")));
    json_decref(j);
    char out[600];
    snprintf(out, sizeof(out), "%s/bench.out", dir);
    size_t len = 0;
    char *text = tu_read_file(out, &len);
    ck_assert(text != NULL && strstr(text, "Serving Benchmark Result") != NULL);
    ck_assert(strstr(text, "Successful requests:                     20") != NULL);
    free(text);
    tu_rmrf(dir), tu_rmrf(model);
    free(dir), free(model);
}
END_TEST

/* pd-bench plot: one series per result label (eight labels × two rates here), each with its own
 * data file, colour and marker, legend entries, and a CDF per file titled by label and rate;
 * padded axes; PNGs written. pd-bench table: a goodput column only when a result has one. */
START_TEST(test_plot_series_per_label)
{
    char *dir = tu_mkdtemp("bench-plot");
    ck_assert_ptr_nonnull(dir);
    const char *labels[8] = {"colocated long", "pull long", "push long", "pull short",
                             "push short",     "ucx",       "tcp",       "kv-aware"};
    char files[4096] = "";
    for (int i = 0; i < 16; i++) {
        json_t *j =
            json_pack("{s:s, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:[f,f,f], s:[f,f,f]}", "label",
                      labels[i / 2], "request_rate", (double)(1 + i % 2), "median_ttft_ms", 100.0 + i,
                      "p99_ttft_ms", 200.0 + i, "median_tpot_ms", 10.0, "p99_tpot_ms", 20.0, "median_itl_ms",
                      10.0, "p99_itl_ms", 30.0, "ttfts", 0.1, 0.2, 0.3, "e2els", 1.0, 2.0, 3.0);
        if (i == 3) { /* one run with --goodput */
            json_object_set_new(j, "request_goodput", json_real(1.5));
        } else {
            json_object_set_new(j, "request_goodput", json_null());
        }
        char f[600];
        snprintf(f, sizeof(f), "%s/r%d.json", dir, i);
        ck_assert_int_eq(json_dump_file(j, f, 0), 0);
        json_decref(j);
        strcat(files, " "), strcat(files, f);
    }
    int rc = tu_run(60, "%s/bin/pd-bench plot %s/out%s > %s/plot.log 2>&1", tu_binary_dir(), dir, files, dir);
    ck_assert_msg(rc == 0, "pd-bench plot failed: see %s/plot.log", dir);
    char p[700];
    size_t n = 0;
    snprintf(p, sizeof(p), "%s/out/plot.gp", dir);
    char *gp = tu_read_file(p, &n);
    ck_assert_ptr_nonnull(gp);
    ck_assert_msg(strstr(gp, "title 'colocated long p50'") && strstr(gp, "title 'pull long p99'") &&
                      strstr(gp, "rate_7.dat") && !strstr(gp, "rate_8.dat") &&
                      strstr(gp, "title 'pull long @ 2 req/s TTFT'") && strstr(gp, "set offsets graph"),
                  "plot.gp lacks the per-label series or the padding:\n%s", gp);
    /* eight series, eight colours, eight markers in the latency-vs-rate plot */
    char seen_c[8][16] = {{0}};
    int seen_pt[8], nc = 0, npt = 0;
    for (const char *q = strstr(gp, "lc rgb '"); q != NULL && strstr(q, "pt ") != NULL;
         q = strstr(q + 1, "lc rgb '")) {
        char col[16] = "";
        int pt = -1;
        if (sscanf(q, "lc rgb '%15[^']' pt %d", col, &pt) != 2) {
            continue; /* a CDF line (no marker) */
        }
        bool dup = false;
        for (int k = 0; k < nc; k++) {
            dup |= strcmp(seen_c[k], col) == 0;
        }
        if (!dup && nc < 8) {
            snprintf(seen_c[nc++], sizeof(seen_c[0]), "%s", col);
        }
        dup = false;
        for (int k = 0; k < npt; k++) {
            dup |= seen_pt[k] == pt;
        }
        if (!dup && npt < 8) {
            seen_pt[npt++] = pt;
        }
    }
    ck_assert_int_eq(nc, 8);
    ck_assert_int_eq(npt, 8);
    free(gp);
    snprintf(p, sizeof(p), "%s/out/rate_1.dat", dir);
    char *d1 = tu_read_file(p, &n);
    ck_assert_ptr_nonnull(d1);
    ck_assert_msg(strstr(d1, "\"pull long\" 1 ") && strstr(d1, "\"pull long\" 2 ") &&
                      !strstr(d1, "colocated"),
                  "rate_1.dat:\n%s", d1);
    free(d1);
    const char *pngs[2] = {"latency_vs_rate.png", "latency_cdf.png"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof(p), "%s/out/%s", dir, pngs[i]);
        char *png = tu_read_file(p, &n);
        ck_assert_msg(png != NULL && n > 1000 && memcmp(png, "\x89PNG", 4) == 0, "%s missing or not a PNG",
                      p);
        free(png);
    }
    /* table: no goodput column without --goodput runs; "-" for the runs that had none */
    char f0[600], f3[600];
    snprintf(f0, sizeof(f0), "%s/r0.json", dir);
    snprintf(f3, sizeof(f3), "%s/r3.json", dir);
    ck_assert_int_eq(tu_run(30, "%s/bin/pd-bench table %s > %s/t1.md", tu_binary_dir(), f0, dir), 0);
    ck_assert_int_eq(tu_run(30, "%s/bin/pd-bench table %s %s > %s/t2.md", tu_binary_dir(), f0, f3, dir), 0);
    snprintf(p, sizeof(p), "%s/t1.md", dir);
    char *t1 = tu_read_file(p, &n);
    snprintf(p, sizeof(p), "%s/t2.md", dir);
    char *t2 = tu_read_file(p, &n);
    ck_assert(t1 != NULL && t2 != NULL);
    ck_assert_msg(strstr(t1, "goodput") == NULL, "t1:\n%s", t1);
    ck_assert_msg(strstr(t2, "goodput (req/s)") && strstr(t2, "| - |") && strstr(t2, "| 1.50 |"), "t2:\n%s",
                  t2);
    free(t1), free(t2);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_OFF);
    Suite *s = suite_create("bench");
    TCase *tc = tcase_create("bench");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_metric_formulas);
    tcase_add_test(tc, test_arrivals);
    tcase_add_test(tc, test_datasets);
    tcase_add_test(tc, test_end_to_end_against_pd_serve);
    tcase_add_test(tc, test_plot_series_per_label);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
