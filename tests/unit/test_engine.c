/* tests/unit/test_engine.c — the engine core on a real (tiny) model: continuous batching gives each
 * request exactly the tokens it gets alone (greedy and seeded), preemption and prefix caching do
 * not change outputs, aborts free blocks, stop strings cut text, bad requests are refused, and
 * the threaded submit/output path delivers everything. */
#include "test_util.h"

#include <cblas.h>
#include <check.h>
#include <jansson.h>
#include <pthread.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rng.h"
#include "common/time.h"
#include "engine/engine.h"
#include "engine/kv_init.h"
#include "grammar/grammar.h"
#include "model/config.h"
#include "model/model.h"

#include "engine_driver.h"

#include "fail_alloc.h"

static char *g_model;

static const char *g_dtype = "auto";     /* --dtype of the engines the tests make */
static int g_logprobs;                   /* add_spec asks for the sampled tokens' logprobs */
static const char *g_precision = "fp32"; /* their --matmul-precision */
static bool g_batch_invariant;           /* their --batch-invariant */
static int g_batched_tokens = 256;       /* their --max-num-batched-tokens */
static double g_grammar_walk_delay;      /* their grammar walks start this much later (tests only) */

/* An engine on g_model with the tests' sizes; kv_dtype as --kv-cache-dtype. */
static pd_engine_t *make_engine_kv(int num_blocks_override, bool prefix, int max_seqs, const char *kv_dtype)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.kv_cache_dtype = kv_dtype;
    c.dtype = g_dtype;
    c.matmul_precision = g_precision;
    c.model_dir = g_model;
    c.threads = 2;
    c.kv_cache_memory = 256u << 20;
    c.max_num_batched_tokens = g_batched_tokens;
    c.batch_invariant = g_batch_invariant;
    c.grammar_walk_delay = g_grammar_walk_delay;
    c.max_num_seqs = max_seqs;
    c.max_model_len = 512;
    c.enable_prefix_caching = prefix;
    c.num_blocks_override = num_blocks_override;
    pd_engine_t *e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_OK);
    return e;
}

static pd_engine_t *make_engine(int num_blocks_override, bool prefix, int max_seqs)
{
    return make_engine_kv(num_blocks_override, prefix, max_seqs, "auto");
}

typedef struct spec {
    int32_t prompt[200];
    int32_t n;
    int32_t max_tokens;
    float temperature;
    uint64_t seed;
} spec_t;

static void make_specs(spec_t *s, int count, float temperature, int vocab)
{
    pd_rng_t r;
    pd_rng_seed(&r, 2024);
    for (int i = 0; i < count; i++) {
        /* lengths: tiny, under a block, exact block multiples, several blocks */
        int lens[] = {1, 5, 15, 16, 17, 32, 48, 63, 64, 100, 150};
        s[i].n = lens[i % 11] + (i / 11);
        for (int k = 0; k < s[i].n; k++) {
            s[i].prompt[k] = (int32_t)pd_rng_below(&r, (uint64_t)vocab - 2);
        }
        s[i].max_tokens = 1 + (int32_t)pd_rng_below(&r, 24);
        s[i].temperature = temperature;
        s[i].seed = 1000 + (uint64_t)i;
    }
}

static void add_spec(pd_engine_t *e, const spec_t *s, int i, gen_t *g, const char *const *stop, int nstop)
{
    char id[32], err[256];
    snprintf(id, sizeof(id), "req-%d", i);
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = id;
    rq.prompt = s->prompt;
    rq.num_prompt = s->n;
    rq.params.max_tokens = s->max_tokens;
    rq.params.logprobs = g_logprobs;
    rq.params.ignore_eos = true;
    rq.params.sampling = (pd_sampling_params_t){s->temperature, 0, s->temperature > 0 ? 0.9f : 1.0f, 0.0f};
    rq.params.has_seed = true;
    rq.params.seed = s->seed;
    for (int k = 0; k < nstop; k++) {
        rq.stop[k] = stop[k];
    }
    rq.num_stop = nstop;
    rq.user = g;
    ck_assert_msg(pd_engine_add(e, &rq, err, sizeof(err)) == PD_OK, "%s", err);
}

static void assert_same(const gen_t *a, const gen_t *b, int i)
{
    ck_assert_msg(a->n == b->n, "request %d: %d vs %d tokens", i, a->n, b->n);
    for (int k = 0; k < a->n; k++) {
        ck_assert_msg(a->tokens[k] == b->tokens[k], "request %d token %d: %d vs %d", i, k, a->tokens[k],
                      b->tokens[k]);
    }
    ck_assert_uint_eq(a->text_len, b->text_len);
    ck_assert_int_eq(memcmp(a->text, b->text, a->text_len), 0);
}

static void batch_vs_alone(float temperature)
{
    enum { N = 32 };
    spec_t *s = calloc(N, sizeof(spec_t));
    gen_t *alone = calloc(N, sizeof(gen_t)), *batched = calloc(N, sizeof(gen_t));
    pd_engine_t *e = make_engine(0, false, 32);
    make_specs(s, N, temperature, pd_engine_model_config(e)->vocab_size);
    for (int i = 0; i < N; i++) {
        add_spec(e, &s[i], i, &alone[i], NULL, 0);
        tu_engine_run_until_idle(e, 20000);
        ck_assert_str_eq(alone[i].finish, "length");
        ck_assert_int_eq(alone[i].n, s[i].max_tokens);
    }
    for (int i = 0; i < N; i++) {
        add_spec(e, &s[i], i, &batched[i], NULL, 0);
    }
    tu_engine_run_until_idle(e, 20000);
    for (int i = 0; i < N; i++) {
        assert_same(&batched[i], &alone[i], i);
        ck_assert_int_eq(batched[i].completion, s[i].max_tokens);
    }
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
    free(s), free(alone), free(batched);
}

START_TEST(test_batched_equals_alone_greedy)
{
    batch_vs_alone(0.0f);
}
END_TEST

START_TEST(test_batched_equals_alone_seeded)
{
    batch_vs_alone(0.8f);
}
END_TEST

START_TEST(test_preemption_keeps_outputs)
{
    enum { N = 8 };
    spec_t *s = calloc(N, sizeof(spec_t));
    gen_t *ref = calloc(N, sizeof(gen_t)), *tight = calloc(N, sizeof(gen_t));
    pd_engine_t *big = make_engine(0, false, 16);
    make_specs(s, N, 0.0f, pd_engine_model_config(big)->vocab_size);
    for (int i = 0; i < N; i++) {
        s[i].n = 60 + i;
        s[i].max_tokens = 40;
        add_spec(big, &s[i], i, &ref[i], NULL, 0);
    }
    tu_engine_run_until_idle(big, 20000);
    pd_engine_destroy(big);
    /* 40 blocks × 16 tokens = 640 slots for 8 × 100 tokens: requests must be preempted */
    pd_engine_t *e = make_engine(40, false, 16);
    for (int i = 0; i < N; i++) {
        add_spec(e, &s[i], i, &tight[i], NULL, 0);
    }
    tu_engine_run_until_idle(e, 20000);
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert_uint_gt(st.preemptions, 0);
    for (int i = 0; i < N; i++) {
        assert_same(&tight[i], &ref[i], i);
    }
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
    free(s), free(ref), free(tight);
}
END_TEST

START_TEST(test_prefix_cache_reuse)
{
    pd_engine_t *e = make_engine(0, true, 8);
    spec_t s;
    make_specs(&s, 1, 0.0f, pd_engine_model_config(e)->vocab_size);
    s.n = 80;
    s.max_tokens = 10;
    gen_t a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    add_spec(e, &s, 0, &a, NULL, 0);
    tu_engine_run_until_idle(e, 20000);
    add_spec(e, &s, 1, &b, NULL, 0);
    tu_engine_run_until_idle(e, 20000);
    ck_assert_int_eq(a.cached, 0);
    ck_assert_int_eq(b.cached, 64); /* (80 − 1) / 16 full blocks */
    assert_same(&b, &a, 0);
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.prefix_hits, 64);
    ck_assert_uint_eq(st.prefix_queries, 160);
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
}
END_TEST

START_TEST(test_abort_and_stop_strings)
{
    pd_engine_t *e = make_engine(0, true, 2);
    spec_t s[4];
    make_specs(s, 4, 0.0f, pd_engine_model_config(e)->vocab_size);
    gen_t g[4];
    memset(g, 0, sizeof(g));
    for (int i = 0; i < 4; i++) {
        s[i].max_tokens = 50;
        add_spec(e, &s[i], i, &g[i], NULL, 0);
    }
    for (int k = 0; k < 3; k++) { /* max_num_seqs 2: two run, two wait */
        pd_engine_output_t *outs = NULL;
        pd_engine_step(e, &outs);
        tu_engine_collect(outs);
        pd_engine_output_free(outs);
    }
    ck_assert(pd_engine_abort(e, "req-0")); /* running */
    ck_assert(pd_engine_abort(e, "req-3")); /* waiting */
    ck_assert(!pd_engine_abort(e, "req-3"));
    ck_assert(!pd_engine_abort(e, "nope"));
    tu_engine_run_until_idle(e, 20000);
    ck_assert_str_eq(g[0].finish, "abort");
    ck_assert_str_eq(g[3].finish, "abort");
    ck_assert_int_eq(g[3].n, 0);
    ck_assert_str_eq(g[1].finish, "length");
    tu_engine_assert_pool_free(e);

    /* stop strings: take a piece of a greedy completion's text; the same request with that stop
     * string ends just before it, with finish_reason "stop" */
    gen_t full, cut;
    memset(&full, 0, sizeof(full));
    memset(&cut, 0, sizeof(cut));
    s[1].max_tokens = 30;
    add_spec(e, &s[1], 10, &full, NULL, 0);
    tu_engine_run_until_idle(e, 20000);
    ck_assert_uint_gt(full.text_len, 12);
    /* a 3-byte stop string starting at a character boundary near the middle */
    size_t at = full.text_len / 2;
    while (at > 0 && ((unsigned char)full.text[at] & 0xc0) == 0x80) {
        at--;
    }
    char stop[4];
    memcpy(stop, full.text + at, 3);
    stop[3] = '\0';
    const char *first = strstr(full.text, stop);
    ck_assert_ptr_nonnull(first);
    const char *stops[1] = {stop};
    add_spec(e, &s[1], 11, &cut, stops, 1);
    tu_engine_run_until_idle(e, 20000);
    ck_assert_str_eq(cut.finish, "stop");
    ck_assert_uint_eq(cut.text_len, (size_t)(first - full.text));
    ck_assert_int_eq(memcmp(cut.text, full.text, cut.text_len), 0);
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
}
END_TEST

START_TEST(test_bad_requests)
{
    pd_engine_t *e = make_engine(0, true, 4);
    int32_t vocab = pd_engine_model_config(e)->vocab_size;
    int32_t prompt[600];
    for (int i = 0; i < 600; i++) {
        prompt[i] = i % vocab;
    }
    char err[256];
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = "x";
    rq.prompt = prompt;
    rq.num_prompt = 512; /* == max_model_len */
    rq.params.sampling.top_p = 1;
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err, "maximum context length is 512"));
    rq.num_prompt = 0;
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_ERR_INVALID_ARG);
    rq.num_prompt = 3;
    prompt[1] = vocab;
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err, "outside the vocabulary"));
    prompt[1] = 1;
    rq.params.sampling.temperature = -1;
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_ERR_INVALID_ARG);
    rq.params.sampling.temperature = 0;
    gen_t g;
    memset(&g, 0, sizeof(g));
    rq.user = &g;
    rq.num_prompt = 400; /* max_tokens 0: room for 112 more tokens */
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_OK);
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_ERR_INVALID_ARG); /* duplicate id */
    tu_engine_run_until_idle(e, 20000);
    /* max_tokens 0 means "up to max_model_len", and the request ends with "length" there */
    ck_assert_str_eq(g.finish, g.completion == 512 - 400 ? "length" : "stop");
    ck_assert_int_le(g.completion, 112);
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
}
END_TEST

/* ------------------------------------------------------------------ threaded */

typedef struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int signals;
} waiter_t;

static void notify(void *ctx)
{
    waiter_t *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->signals++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

START_TEST(test_threaded_submit)
{
    enum { N = 16 };
    spec_t *s = calloc(N, sizeof(spec_t));
    gen_t *sync = calloc(N, sizeof(gen_t)), *thr = calloc(N, sizeof(gen_t));
    pd_engine_t *e = make_engine(0, true, 8);
    make_specs(s, N, 0.0f, pd_engine_model_config(e)->vocab_size);
    for (int i = 0; i < N; i++) {
        add_spec(e, &s[i], i, &sync[i], NULL, 0);
    }
    tu_engine_run_until_idle(e, 20000);
    waiter_t w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    ck_assert_int_eq(pd_engine_start(e, notify, &w), PD_OK);
    for (int i = 0; i < N; i++) {
        char id[32];
        snprintf(id, sizeof(id), "t-%d", i);
        pd_engine_request_t rq;
        memset(&rq, 0, sizeof(rq));
        rq.id = id;
        rq.prompt = s[i].prompt;
        rq.num_prompt = s[i].n;
        rq.params.max_tokens = s[i].max_tokens;
        rq.params.ignore_eos = true;
        rq.params.sampling = (pd_sampling_params_t){0, 0, 1, 0};
        rq.user = &thr[i];
        ck_assert_int_eq(pd_engine_submit(e, &rq), PD_OK);
    }
    pd_engine_abort_async(e, "never-existed");
    int done = 0;
    double deadline = pd_time_now_s() + 120;
    while (done < N) {
        pthread_mutex_lock(&w.mu);
        while (w.signals == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&w.cv, &w.mu, &ts);
            ck_assert(pd_time_now_s() < deadline);
        }
        w.signals = 0;
        pthread_mutex_unlock(&w.mu);
        pd_engine_output_t *outs = pd_engine_take_outputs(e);
        for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
            done += o->finish_reason != NULL;
        }
        tu_engine_collect(outs);
        pd_engine_output_free(outs);
    }
    pd_engine_stop(e);
    for (int i = 0; i < N; i++) {
        assert_same(&thr[i], &sync[i], i);
    }
    pd_engine_destroy(e);
    free(s), free(sync), free(thr);
}
END_TEST

/* Building an engine runs OpenMP regions (weight layout, the profile run). libgomp keeps a thread
 * pool for every thread that opened one, and with more pool threads than CPUs every barrier of a
 * step sleeps on a futex (issue 53: pd-serve's steps 4x slower). pd_engine_create builds on a thread
 * that ends, so nothing of it stays; the thread that steps then holds the only pool: the engine
 * thread and one OpenMP worker at --threads 2. */
#define TASKS "/proc/self/task" /* this process's threads */

START_TEST(test_create_leaves_no_thread)
{
    /* OpenBLAS's own server thread (not OpenMP's) starts here, as in the backend */
    openblas_set_num_threads(1);
    int before = tu_count_entries(TASKS);
    pd_engine_t *e = make_engine(0, false, 4);
    int after = tu_count_entries(TASKS);
    for (double end = pd_time_now_s() + 3; after != before && pd_time_now_s() < end;
         after = tu_count_entries(TASKS)) {
        usleep(10 * 1000); /* the ended pool's workers leave on their own */
    }
    ck_assert_msg(after == before, "building the engine left %d threads behind", after - before);
    waiter_t w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    ck_assert_int_eq(pd_engine_start(e, notify, &w), PD_OK);
    int32_t prompt[24];
    for (int i = 0; i < 24; i++) {
        prompt[i] = 3 + i;
    }
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = "pool";
    rq.prompt = prompt;
    rq.num_prompt = 24;
    rq.params.max_tokens = 8;
    rq.params.ignore_eos = true;
    rq.params.sampling = (pd_sampling_params_t){0, 0, 1, 0};
    ck_assert_int_eq(pd_engine_submit(e, &rq), PD_OK);
    bool done = false;
    for (double end = pd_time_now_s() + 60; !done && pd_time_now_s() < end;) {
        pd_engine_output_t *outs = pd_engine_take_outputs(e);
        for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
            done = done || o->finish_reason != NULL;
        }
        pd_engine_output_free(outs);
        usleep(5 * 1000);
    }
    ck_assert_msg(done, "the request did not finish");
    int running = tu_count_entries(TASKS);
#if defined(__SANITIZE_THREAD__)
    int workers = 0; /* TSan builds run ops on one thread */
#else
    int workers = 1;
#endif
    ck_assert_msg(running == before + 1 + workers,
                  "stepping on the engine thread: %d threads, expected %d (the engine thread and %d OpenMP "
                  "worker)",
                  running, before + 1 + workers, workers);
    pd_engine_stop(e);
    pd_engine_destroy(e);
}
END_TEST
#undef TASKS

/* Sliding-window KV cache groups: on a Gemma-3-shaped model (local and global layers: two groups)
 * and a Mistral-shaped one (every layer sliding: one group), with a 16-token window and requests
 * 9-16x as long, a small pool (blocks outside the window freed and reused by other requests at
 * once, preemption) and a roomy one (windowed prefix hits on a repeated wave) give every request
 * the tokens it gets alone in a big pool without prefix caching, and the pool is whole after. */
START_TEST(test_sliding_groups_keep_outputs)
{
    static const struct {
        const char *mk;
        int blocks;
    } models[] = {
        {"--preset tiny --arch gemma3 --layers 4 --sliding-window 16 --sliding-pattern 2 --seed 3", 52},
        {"--preset tiny --arch mistral --sliding-window 16 --seed 4", 24}};
    enum { N = 8 };
    char *saved = g_model;
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        g_model = tu_make_model(models[m].mk);
        ck_assert_ptr_nonnull(g_model);
        spec_t *s = calloc(N, sizeof(spec_t));
        gen_t *ref = calloc(N, sizeof(gen_t)), *tight = calloc(2 * N, sizeof(gen_t));
        pd_engine_t *big = make_engine(0, false, 16);
        make_specs(s, N, m == 0 ? 0.0f : 0.8f, pd_engine_model_config(big)->vocab_size);
        for (int i = 0; i < N; i++) {
            s[i].n = 60 + 7 * i;
            s[i].max_tokens = 80 + 10 * i;
            for (int k = 0; k < s[i].n; k++) {
                s[i].prompt[k] = 1 + (i * 131 + k * 17) % (pd_engine_model_config(big)->vocab_size - 2);
            }
        }
        memcpy(s[N - 1].prompt, s[0].prompt, sizeof(s[0].prompt)); /* a shared prefix */
        for (int i = 0; i < N; i++) {
            add_spec(big, &s[i], i, &ref[i], NULL, 0);
            tu_engine_run_until_idle(big, 20000);
        }
        pd_engine_destroy(big);
        /* a tight pool (preemption, freed blocks reused at once), then a roomy one whose second
         * wave hits the prefix cache inside the window */
        for (int roomy = 0; roomy < 2; roomy++) {
            pd_engine_t *e = make_engine(roomy ? 400 : models[m].blocks, true, 16);
            memset(tight, 0, 2 * N * sizeof(gen_t));
            for (int wave = 0; wave < 2; wave++) {
                for (int i = 0; i < N; i++) {
                    add_spec(e, &s[i], wave * N + i, &tight[wave * N + i], NULL, 0);
                }
                tu_engine_run_until_idle(e, 20000);
            }
            for (int i = 0; i < 2 * N; i++) {
                assert_same(&tight[i], &ref[i % N], i);
            }
            pd_engine_stats_t st;
            pd_engine_get_stats(e, &st);
            if (roomy) {
                ck_assert_uint_gt(st.prefix_hits, 0);
            } else if (m == 0) { /* all-sliding requests hold a few blocks each: no pressure */
                ck_assert_uint_gt(st.preemptions, 0);
            }
            tu_engine_assert_pool_free(e);
            pd_engine_destroy(e);
        }
        free(s), free(ref), free(tight);
        tu_rmrf(g_model);
        free(g_model);
    }
    g_model = saved;
}
END_TEST

/* A structured output waits for its grammar's walk ahead (vLLM's WAITING_FOR_FSM), but not a request
 * whose client is already in its stream (resume_token_ids: a stream migrated or resumed from another
 * node): that one goes on at once while the walk runs, walking as it goes, and its tokens are those
 * of the same request on an engine whose walk was made ahead. */
static void add_structured(pd_engine_t *e, const char *id, const int32_t *prompt, int32_t n, pd_grammar_t *g,
                           const int32_t *resume, int32_t num_resume, gen_t *out)
{
    char err[256];
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = id;
    rq.prompt = prompt;
    rq.num_prompt = n;
    rq.params.max_tokens = 14;
    rq.params.sampling = (pd_sampling_params_t){0.0f, 0, 1.0f, 0.0f};
    rq.grammar = g;
    rq.resume = resume;
    rq.num_resume = num_resume;
    rq.user = out;
    ck_assert_msg(pd_engine_add(e, &rq, err, sizeof(err)) == PD_OK, "%s", err);
}

START_TEST(test_resumed_stream_does_not_wait_for_its_grammar)
{
    static const char gbnf[] = "root ::= [a-z]{6,12}\n";
    const double delay = 3.0;
    char err[256];
    pd_grammar_t *g = NULL;
    ck_assert_msg(pd_grammar_from_gbnf(gbnf, strlen(gbnf), &g, err, sizeof(err)) == PD_OK, "%s", err);
    int32_t prompt[20], other[20];
    for (int i = 0; i < 20; i++) {
        prompt[i] = 5 + 3 * i;
        other[i] = 7 + 2 * i;
    }
    gen_t ref, fresh, resumed;
    memset(&ref, 0, sizeof(ref));
    memset(&fresh, 0, sizeof(fresh));
    memset(&resumed, 0, sizeof(resumed));
    pd_engine_t *e = make_engine(0, false, 8);
    add_structured(e, "ref", prompt, 20, g, NULL, 0, &ref);
    tu_engine_run_until_idle(e, 20000);
    pd_engine_destroy(e);
    ck_assert_int_ge(ref.n, 6);

    g_grammar_walk_delay = delay; /* a new engine's vocabulary: the grammar is walked again, late */
    e = make_engine(0, false, 8);
    g_grammar_walk_delay = 0;
    double t0 = pd_time_now_s();
    add_structured(e, "fresh", other, 20, g, NULL, 0, &fresh);
    add_structured(e, "resumed", prompt, 20, g, ref.tokens, 2, &resumed);
    while (resumed.finish == NULL && pd_time_now_s() - t0 < 30) {
        pd_engine_output_t *outs = NULL;
        ck_assert_int_eq(pd_engine_step(e, &outs), PD_OK);
        bool idle = outs == NULL;
        tu_engine_collect(outs);
        pd_engine_output_free(outs);
        usleep(idle ? 200 : 0);
    }
    double took = pd_time_now_s() - t0;
    ck_assert_msg(resumed.finish != NULL && took < delay, "the resumed stream took %.2f s (walk at %.1f s)",
                  took, delay);
    ck_assert_msg(fresh.n == 0 && fresh.finish == NULL, "the fresh request did not wait for the walk");
    tu_engine_run_until_idle(e, 1000000);
    ck_assert_str_eq(fresh.finish, "stop");
    ck_assert_msg(pd_time_now_s() - t0 >= delay, "the fresh request ran before its grammar's walk");
    assert_same(&resumed, &ref, 0); /* the resumed tokens are replayed, then the rest as on an engine that
                                     * walked ahead */
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
    pd_grammar_unref(g);
}
END_TEST

/* --kv-cache-dtype auto is the checkpoint's dtype (vLLM's meaning): a bf16 model gets a bf16 cache
 * (twice the blocks of an fp32 one in the same memory), an fp32 model an fp32 one; an explicit
 * dtype wins. Greedy outputs on the bf16 cache stay what the engine makes alone vs batched. */
START_TEST(test_kv_cache_dtype_auto_is_the_models)
{
    char *saved = g_model;
    g_model = tu_make_model("--preset tiny --arch llama --dtype bf16");
    ck_assert_ptr_nonnull(g_model);
    pd_engine_t *e = make_engine(0, true, 8);
    ck_assert_str_eq(pd_engine_kv_dtype_name(e), "bf16");
    uint32_t bf16_blocks = pd_engine_kv(e)->cfg.num_blocks;
    pd_engine_destroy(e);
    e = make_engine_kv(0, true, 8, "fp32");
    ck_assert_str_eq(pd_engine_kv_dtype_name(e), "fp32");
    uint32_t fp32_blocks = pd_engine_kv(e)->cfg.num_blocks;
    pd_engine_destroy(e);
    ck_assert_msg(bf16_blocks > fp32_blocks * 19 / 10, "bf16 cache %u blocks, fp32 %u", bf16_blocks,
                  fp32_blocks);
    tu_rmrf(g_model);
    free(g_model);
    g_model = saved; /* the tiny fp32 model */
    e = make_engine(0, true, 8);
    ck_assert_str_eq(pd_engine_kv_dtype_name(e), "fp32");
    pd_engine_destroy(e);
}
END_TEST

/* --dtype: a bf16 checkpoint keeps bf16 matrices under auto and gives, through the whole engine
 * (chunked prefill, batching, bf16 KV), the greedy tokens of the same checkpoint widened to fp32;
 * an fp32 checkpoint can be narrowed (bfloat16, float16); an unknown name is refused. */
START_TEST(test_dtype_keeps_checkpoint_precision)
{
    char *saved = g_model;
    g_model = tu_make_model("--preset tiny --arch llama --dtype bf16");
    ck_assert_ptr_nonnull(g_model);
    enum { N = 16 };
    static spec_t specs[N];
    static gen_t lo[N], hi[N];
    memset(lo, 0, sizeof(lo));
    memset(hi, 0, sizeof(hi));
    make_specs(specs, N, 0.0f, 512);
    const char *names[2] = {"auto", "float32"};
    const char *want[2] = {"bfloat16", "float32"};
    gen_t *outs[2] = {lo, hi};
    for (int d = 0; d < 2; d++) {
        g_dtype = names[d];
        pd_engine_t *e = make_engine_kv(0, true, 8, "bf16");
        ck_assert_str_eq(pd_engine_weight_dtype_name(e), want[d]);
        for (int i = 0; i < N; i++) {
            add_spec(e, &specs[i], i, &outs[d][i], NULL, 0);
        }
        tu_engine_run_until_idle(e, 20000);
        pd_engine_destroy(e);
    }
    for (int i = 0; i < N; i++) {
        assert_same(&lo[i], &hi[i], i);
    }
    /* --quantization int8: the engine serves (outputs are not the unquantized ones: test_model
     * measures how far they are) and names its weights for the P/D fingerprint */
    pd_engine_config_t qc;
    pd_engine_config_defaults(&qc);
    qc.model_dir = g_model;
    qc.threads = 2;
    qc.kv_cache_memory = 64u << 20;
    qc.quantization = "int8";
    pd_engine_t *qe = NULL;
    qc.load_share_wait = -1; /* refused with the flag's name, nothing made */
    ck_assert_int_eq(pd_engine_create(&qc, &qe), PD_ERR_INVALID_ARG);
    ck_assert_ptr_null(qe);
    qc.load_share_wait = 1.0;
    ck_assert_int_eq(pd_engine_create(&qc, &qe), PD_OK);
    ck_assert_str_eq(pd_engine_weight_dtype_name(qe), "bfloat16+int8");
    static gen_t qg[4];
    memset(qg, 0, sizeof(qg));
    for (int i = 0; i < 4; i++) {
        add_spec(qe, &specs[i], i, &qg[i], NULL, 0);
    }
    tu_engine_run_until_idle(qe, 20000);
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(qg[i].n, specs[i].max_tokens);
        ck_assert_str_eq(qg[i].finish, "length");
    }
    pd_engine_destroy(qe);
    tu_rmrf(g_model);
    free(g_model);
    g_model = saved; /* the tiny fp32 model */
    g_dtype = "float16";
    pd_engine_t *e = make_engine(0, true, 8);
    ck_assert_str_eq(pd_engine_weight_dtype_name(e), "float16");
    pd_engine_destroy(e);
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.dtype = "int3";
    e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_ERR_INVALID_ARG);
    ck_assert_ptr_null(e);
    g_dtype = "auto";
}
END_TEST

/* --matmul-precision bf16 on a bf16 checkpoint: 16 greedy requests batched together (their rows
 * above 8 go through oneDNN) equal the same requests run one at a time (short prompts and decode
 * steps take the GEMV), because every path rounds x to bf16 the same way. On a CPU without bf16
 * arithmetic (AVX512-BF16 or AMX; test_engine@avx2 and @avx512 cap it away) the engine runs fp32 math
 * instead, which holds the same bound (issue 45: the fallback kernels' per-row-count fp32 orders, bf16
 * rounded, differed by 5e-3). Checkpoints the CPU cannot do bf16 math on (fp32, int8) and the
 * tensor-core modes are refused at start. */
START_TEST(test_bf16_math_batch_invariant)
{
    char *saved = g_model;
    g_model = tu_make_model("--preset tiny --arch llama --dtype bf16");
    ck_assert_ptr_nonnull(g_model);
    enum { N = 16 };
    static spec_t specs[N];
    static gen_t together[N], alone[N];
    memset(together, 0, sizeof(together));
    memset(alone, 0, sizeof(alone));
    make_specs(specs, N, 0.0f, 512);
    g_precision = "bf16";
    g_logprobs = 1;
    pd_engine_t *e = make_engine(0, false, 8);
    for (int i = 0; i < N; i++) {
        add_spec(e, &specs[i], i, &together[i], NULL, 0);
    }
    tu_engine_run_until_idle(e, 20000);
    pd_engine_destroy(e);
    e = make_engine(0, false, 1);
    for (int i = 0; i < N; i++) {
        add_spec(e, &specs[i], i, &alone[i], NULL, 0);
        tu_engine_run_until_idle(e, 20000);
    }
    pd_engine_destroy(e);
    /* the same tokens, and the same logprobs up to fp32 summation order: chunks of 32 tokens or more
     * take the attention tiles and oneDNN, shorter ones the per-key item and the GEMV, decode steps
     * the split-K kernel, and every one rounds alike (per-key items in fp32 moved them by 3e-2) */
    double worst = 0;
    for (int i = 0; i < N; i++) {
        assert_same(&together[i], &alone[i], i);
        ck_assert_int_eq(together[i].n, specs[i].max_tokens);
        for (int k = 0; k < together[i].n; k++) {
            double d = fabs((double)together[i].logprob[k] - alone[i].logprob[k]);
            worst = d > worst ? d : worst;
        }
    }
    ck_assert_msg(worst < 2e-3, "batched and alone logprobs differ by %g", worst); /* 7e-5 measured */
    g_logprobs = 0;
    pd_engine_config_t c;
    const char *dtypes[] = {"float32", "auto", "auto"}, *quants[] = {NULL, "int8", NULL};
    const char *precs[] = {"bf16", "bf16", "tf32"};
    for (int i = 0; i < 3; i++) {
        pd_engine_config_defaults(&c);
        c.model_dir = g_model;
        c.threads = 2;
        c.kv_cache_memory = 64u << 20;
        c.dtype = dtypes[i];
        c.quantization = quants[i];
        c.matmul_precision = precs[i];
        e = NULL;
        ck_assert_int_eq(pd_engine_create(&c, &e), PD_ERR_UNSUPPORTED);
        ck_assert_ptr_null(e);
    }
    g_precision = "fp32";
    tu_rmrf(g_model);
    free(g_model);
    g_model = saved;
}
END_TEST

/* --batch-invariant (vLLM's VLLM_BATCH_INVARIANT): each request's tokens and logprobs are bitwise the
 * same in a batch of 16 with 256-token steps (prefill chunks beside decode rows, 1-256 matmul rows) as
 * alone with 16-token prefill chunks, greedy and seeded, for fp32 and bf16 weights (fp32 and bf16
 * math, a bf16 cache), Qwen3's q/k norms, GPT-2's GELU and Gemma 3's sliding window, at every ISA
 * level the suite runs this test at. Without the mode the same runs may differ in the last bits
 * (printed: how far, where the kernels part by row count). */
START_TEST(test_batch_invariant_mode)
{
    char *saved = g_model;
    const struct {
        const char *mk, *precision;
    } models[] = {
        {"--preset tiny --arch llama", "fp32"},
        {"--preset tiny --arch llama --dtype bf16", "fp32"},
        {"--preset tiny --arch llama --dtype bf16", "bf16"},
        {"--preset tiny --arch qwen3 --head-dim 32 --dtype bf16", "fp32"},
        {"--preset tiny --arch gpt2 --dtype f16", "fp32"},
        {"--preset tiny --arch gemma3 --layers 2 --head-dim 32", "fp32"},
    };
    enum { N = 16 };
    static spec_t specs[N];
    static gen_t together[N], alone[N];
    for (size_t m = 0; m < sizeof(models) / sizeof(models[0]); m++) {
        g_model = tu_make_model(models[m].mk);
        ck_assert_ptr_nonnull(g_model);
        g_precision = models[m].precision;
        g_logprobs = 1;
        for (int inv = 1; inv >= 0; inv--) {
            memset(together, 0, sizeof(together));
            memset(alone, 0, sizeof(alone));
            g_batch_invariant = inv;
            g_batched_tokens = 256;
            pd_engine_t *e = make_engine(0, false, N);
            make_specs(specs, N, 0.8f, pd_engine_model_config(e)->vocab_size);
            for (int i = 0; i < N; i++) {
                specs[i].temperature = i % 2 ? 0.8f : 0.0f; /* greedy and seeded */
                add_spec(e, &specs[i], i, &together[i], NULL, 0);
            }
            tu_engine_run_until_idle(e, 20000);
            tu_engine_assert_pool_free(e);
            pd_engine_destroy(e);
            g_batched_tokens = 16; /* every prompt over 16 tokens prefilled in chunks */
            e = make_engine(0, false, 1);
            for (int i = 0; i < N; i++) {
                add_spec(e, &specs[i], i, &alone[i], NULL, 0);
                tu_engine_run_until_idle(e, 20000);
            }
            pd_engine_destroy(e);
            int parted = 0;
            double worst = 0;
            for (int i = 0; i < N; i++) {
                ck_assert_int_eq(together[i].n, specs[i].max_tokens);
                bool same =
                    together[i].n == alone[i].n &&
                    memcmp(together[i].tokens, alone[i].tokens, (size_t)alone[i].n * sizeof(int32_t)) == 0 &&
                    memcmp(together[i].logprob, alone[i].logprob, (size_t)alone[i].n * sizeof(float)) == 0;
                for (int k = 0; k < together[i].n && k < alone[i].n; k++) {
                    double d = fabs((double)together[i].logprob[k] - alone[i].logprob[k]);
                    worst = d > worst ? d : worst;
                }
                parted += !same;
                ck_assert_msg(same || !inv,
                              "%s (%s math), --batch-invariant: request %d (prompt %d, %s) differs "
                              "batched and alone (logprobs up to %g apart)",
                              models[m].mk, models[m].precision, i, specs[i].n, i % 2 ? "seeded" : "greedy",
                              worst);
            }
            printf("batch-invariant %s: %s (%s math): %d of %d requests differ batched vs alone, logprobs up "
                   "to %g apart\n",
                   inv ? "on " : "off", models[m].mk, models[m].precision, parted, N, worst);
        }
        tu_rmrf(g_model);
        free(g_model);
    }
    g_batch_invariant = false;
    g_batched_tokens = 256;
    g_precision = "fp32";
    g_logprobs = 0;
    g_model = saved;
}
END_TEST

/* The memory plan without loading (issue 18): what the loader allocates is what
 * pd_model_plan_weight_bytes says, for every architecture and dtype; by that plan a 7–8 B bf16
 * model fits a 24 GiB node with a KV cache for at least one 32k-token request (the engine's own
 * KV layout computation), and its fp32 widening does not fit at all. */
START_TEST(test_memory_plan_8b_fits_24gib)
{
    pd_backend_t *be = NULL;
    ck_assert_int_eq(pd_backend_create("cpu", 2, &be), PD_OK);
    const char *tiny[] = {"--preset tiny --arch llama --untie", "--preset tiny --arch qwen2 --dtype bf16",
                          "--preset tiny --arch qwen3 --head-dim 32", "--preset tiny --arch gpt2 --dtype f16",
                          "--preset tiny --arch gemma3 --layers 2 --head-dim 32"};
    const char *dts[] = {"float32", "bfloat16", "auto"}, *quants[] = {NULL, "none", "int8"};
    for (size_t i = 0; i < sizeof(tiny) / sizeof(tiny[0]); i++) {
        char *dir = tu_make_model(tiny[i]);
        ck_assert_ptr_nonnull(dir);
        for (int d = 0; d < 3; d++) {
            pd_model_t *m = NULL;
            ck_assert_int_eq(pd_model_load_dtype(dir, be, dts[d], quants[d], &m), PD_OK);
            size_t plan = pd_model_plan_weight_bytes(pd_model_config(m), pd_model_weight_dtype(m),
                                                     pd_model_linear_dtype(m));
            ck_assert_msg(plan == pd_model_weight_bytes(m), "%s as %s: plan %zu bytes, loaded %zu", tiny[i],
                          dts[d], plan, pd_model_weight_bytes(m));
            pd_model_free(m);
        }
        tu_rmrf(dir);
        free(dir);
    }
    pd_backend_destroy(be);

    const char *configs[] = {"Llama-3.1-8B-Instruct", "Mistral-7B-Instruct-v0.3"};
    const size_t node = (size_t)24 << 30;
    const double gib = (double)(1u << 30);
    for (size_t i = 0; i < 2; i++) {
        char path[1024];
        snprintf(path, sizeof(path), "%s/tests/model/configs/%s.json", tu_source_dir(), configs[i]);
        json_t *root = json_load_file(path, 0, NULL);
        ck_assert_ptr_nonnull(root);
        pd_model_config_t c;
        ck_assert_int_eq(pd_model_config_parse(root, path, &c), PD_OK);
        json_decref(root);
        size_t w16 = pd_model_plan_weight_bytes(&c, PD_DTYPE_BF16, PD_DTYPE_BF16),
               w32 = pd_model_plan_weight_bytes(&c, PD_DTYPE_F32, PD_DTYPE_F32),
               w8 = pd_model_plan_weight_bytes(&c, PD_DTYPE_BF16, PD_DTYPE_I8);
        size_t act = pd_model_workspace_bytes(&c, 2048, 256); /* --max-num-batched-tokens, --max-num-seqs */
        size_t budget = (size_t)((double)node * 0.9);         /* --memory-utilization 0.9 */
        ck_assert_msg(w32 + act > budget, "%s: fp32 weights %.2f GiB fit", configs[i], (double)w32 / gib);
        ck_assert_uint_gt(budget, w16 + act);
        pd_kv_spec_t specs[PD_MAX_LAYERS];
        ck_assert_int_eq(pd_kv_specs_from_model(&c, 16, PD_DTYPE_BF16, specs), PD_OK);
        pd_kv_cache_config_t kc;
        ck_assert_int_eq(
            pd_kv_cache_config_compute(specs, c.num_layers, budget - w16 - act, 32768, 2048, &kc), PD_OK);
        size_t tokens = (size_t)(kc.num_blocks - 1) * 16;
        fprintf(
            stderr,
            "memory plan, %s on 24 GiB × 0.9: bf16 weights %.2f GiB (fp32 would be %.2f), activations %.2f "
            "GiB, KV %.2f GiB = %zu tokens of bf16 KV (%.1f requests of 32k); --quantization int8: weights "
            "%.2f GiB\n",
            configs[i], (double)w16 / gib, (double)w32 / gib, (double)act / gib,
            (double)kc.region_bytes / gib, tokens, (double)tokens / 32768, (double)w8 / gib);
        ck_assert(w8 < w16 * 6 / 10); /* linear layers at half of bf16, embeddings at bf16 */
        ck_assert_uint_ge(tokens, 32768);
        ck_assert(w16 > (size_t)13 << 30 && w16 < (size_t)16 << 30); /* 7.2–8.0 B parameters */
    }
}
END_TEST

/* ------------------------------------------------------------------ failing allocations */

/* Three requests (two sharing a prefix, one sampled) on an engine with prefix caching, from
 * creating the engine to destroying it, with any allocation failing (fail_alloc.h). Whatever
 * failed: every request added ends exactly once; one that ended "length" with every token has the
 * tokens of the same run with nothing failing (g_fa_ref, made before arming); the pool is whole
 * after the run; and with nothing failing, all three ran to their length. */
enum { FA_REQS = 3 };
static gen_t g_fa_ref[FA_REQS];

static int fa_engine_run(gen_t *got, bool *added)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 2;
    c.kv_cache_memory = 8u << 20;
    c.max_num_batched_tokens = 64;
    c.max_num_seqs = 4;
    c.max_model_len = 256;
    c.enable_prefix_caching = true;
    pd_engine_t *e = NULL;
    if (pd_engine_create(&c, &e) != PD_OK) {
        return 0;
    }
    int wrong = 0;
    for (int i = 0; i < FA_REQS; i++) {
        spec_t s;
        memset(&s, 0, sizeof(s));
        s.n = 20 + i;
        for (int k = 0; k < s.n; k++) {
            s.prompt[k] = (int32_t)(k * 7 + (i == 2 ? 3 : 1)) % 200 + 2; /* 0 and 1 share 20 tokens */
        }
        s.max_tokens = 6;
        s.temperature = i == 1 ? 0.8f : 0.0f;
        s.seed = 77;
        char id[32], err[256];
        snprintf(id, sizeof(id), "req-%d", i);
        pd_engine_request_t rq;
        memset(&rq, 0, sizeof(rq));
        rq.id = id;
        rq.prompt = s.prompt;
        rq.num_prompt = s.n;
        rq.params.max_tokens = s.max_tokens;
        rq.params.ignore_eos = true;
        rq.params.sampling = (pd_sampling_params_t){s.temperature, 0, s.temperature > 0 ? 0.9f : 1.0f, 0.0f};
        rq.params.has_seed = true;
        rq.params.seed = s.seed;
        rq.user = &got[i];
        added[i] = pd_engine_add(e, &rq, err, sizeof(err)) == PD_OK;
    }
    for (int steps = 0; pd_engine_has_work(e) && steps < 500; steps++) {
        pd_engine_output_t *outs = NULL;
        pd_engine_step(e, &outs); /* a failed step fails its requests: they end "error" */
        for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
            gen_t *g = o->user;
            if (o->token >= 0 && g->n < 256) {
                g->tokens[g->n++] = o->token;
            }
            if (o->finish_reason != NULL) {
                if (g->finish != NULL) {
                    fprintf(stderr, "fa_engine: %s ended twice\n", o->id);
                    wrong++;
                }
                g->finish = o->finish_reason;
            }
        }
        pd_engine_output_free(outs);
    }
    pd_engine_output_t *outs = NULL; /* releases the last finished requests */
    pd_engine_step(e, &outs);
    pd_engine_output_free(outs);
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    if (pd_engine_has_work(e) || st.blocks_used != 0 ||
        st.blocks_free + st.blocks_cached_free != st.num_blocks - 1) {
        fprintf(stderr, "fa_engine: after the run: work left %d, blocks used %u\n", pd_engine_has_work(e),
                (unsigned)st.blocks_used);
        wrong++;
    }
    pd_engine_destroy(e);
    return wrong;
}

static int fa_engine_prepare(void)
{
    bool added[FA_REQS];
    memset(g_fa_ref, 0, sizeof(g_fa_ref));
    return fa_engine_run(g_fa_ref, added);
}

static int fa_engine(void)
{
    gen_t got[FA_REQS];
    bool added[FA_REQS] = {false};
    memset(got, 0, sizeof(got));
    int wrong = fa_engine_run(got, added);
    for (int i = 0; i < FA_REQS; i++) {
        if (added[i] && got[i].finish == NULL) {
            fprintf(stderr, "fa_engine: req-%d never ended\n", i);
            wrong++;
        }
        bool whole = got[i].finish != NULL && strcmp(got[i].finish, "length") == 0 && got[i].n == 6;
        if (whole && memcmp(got[i].tokens, g_fa_ref[i].tokens, sizeof(int32_t) * 6) != 0) {
            fprintf(stderr, "fa_engine: req-%d ran to its length with other tokens than without failures\n",
                    i);
            wrong++;
        }
        if (!tu_fail_alloc_hit() && !whole) {
            fprintf(stderr, "fa_engine: with nothing failing, req-%d did not run to its length\n", i);
            wrong++;
        }
    }
    return wrong;
}

static const tu_fa_scenario_t FA_SCENARIOS[] = {{"engine", fa_engine, fa_engine_prepare}};

START_TEST(test_fail_alloc)
{
    setenv("PD_FAIL_ALLOC_MODEL", g_model, 1); /* the children use this process's model */
    tu_fail_alloc_sites("engine", 2000, 60);   /* ~4000 allocations: one run per call site */
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_WARN);
    if (getenv("PD_FAIL_ALLOC_MODEL") != NULL) {
        g_model = strdup(getenv("PD_FAIL_ALLOC_MODEL"));
        tu_fail_alloc_child(FA_SCENARIOS, 1);
    }
    g_model = tu_make_model("--preset tiny --arch llama");
    if (g_model == NULL) {
        fprintf(stderr, "cannot make the tiny model\n");
        return 1;
    }
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("engine");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_batched_equals_alone_greedy);
    tcase_add_test(tc, test_batched_equals_alone_seeded);
    tcase_add_test(tc, test_preemption_keeps_outputs);
    tcase_add_test(tc, test_prefix_cache_reuse);
    tcase_add_test(tc, test_abort_and_stop_strings);
    tcase_add_test(tc, test_bad_requests);
    tcase_add_test(tc, test_threaded_submit);
    tcase_add_test(tc, test_create_leaves_no_thread);
    tcase_add_test(tc, test_sliding_groups_keep_outputs);
    tcase_add_test(tc, test_resumed_stream_does_not_wait_for_its_grammar);
    tcase_add_test(tc, test_kv_cache_dtype_auto_is_the_models);
    tcase_add_test(tc, test_dtype_keeps_checkpoint_precision);
    tcase_add_test(tc, test_memory_plan_8b_fits_24gib);
    tcase_add_test(tc, test_bf16_math_batch_invariant);
    tcase_add_test(tc, test_batch_invariant_mode);
    suite_add_tcase(s, tc);
    tu_fail_alloc_add(s, test_fail_alloc, 1);
    int rc = tu_run_suite(s);
    tu_rmrf(g_model);
    free(g_model);
    return rc;
}
