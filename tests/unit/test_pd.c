#define _GNU_SOURCE /* strndup: before any system header */
/* tests/unit/test_pd.c — disaggregated serving on real processes (loopback, ports from
 * --port-file, every process stopped at the end): pd-proxy → pd-prefill → pd-decode answers
 * token-for-token like pd-serve for 64 prompts (greedy and seeded), in pull and push modes, over
 * tcp and ucx; a decode-side prefix hit moves only the missing blocks (none for a full hit);
 * fault paths (prefill gone before the read, killed under load, lease expired → STALE, decode
 * killed holding a reservation, wrong cluster token, different model) complete by recompute or
 * fail cleanly per policy; afterwards every surviving node's block pool is free. */
#include "http_client.h"
#include "test_util.h"

#include <arpa/inet.h>
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "common/log.h"
#include "common/metrics.h"

#define NUM_PROMPTS 64
#define MAX_TOKENS  8
#define MODEL_NAME  "m"

static char *g_model, *g_model2, *g_dir;
static int32_t *g_prompts[NUM_PROMPTS];
static int g_lens[NUM_PROMPTS];
static char *g_ref[2][NUM_PROMPTS]; /* pd-serve's token ids: [greedy|seeded][prompt] */

/* ------------------------------------------------------------------ processes */

typedef struct node {
    pid_t pid;
    int port;
    char log[512];
} node_t;

/* Starts bin on HTTP port (0: any free one) with the test's model flags (model NULL: none) and
 * extra; fails the test when it does not start. */
static void start_at(node_t *n, const char *bin, const char *tag, const char *model, char *const extra[],
                     int port)
{
    char port_file[512], path[512], port_s[16];
    snprintf(port_file, sizeof(port_file), "%s/%s.port", g_dir, tag);
    static int started; /* each start its own log (PD_TEST_KEEP_LOGS keeps them all; a test is a process) */
    snprintf(n->log, sizeof(n->log), "%s/%d-%03d-%s.log", g_dir, (int)getpid(), started++, tag);
    snprintf(path, sizeof(path), "%s/bin/%s", tu_binary_dir(), bin);
    snprintf(port_s, sizeof(port_s), "%d", port);
    unlink(port_file);
    char *argv[64] = {path, "--port", port_s, "--port-file", port_file};
    int k = 5;
    if (model != NULL) {
        char *more[] = {"--model",
                        (char *)model,
                        "--served-model-name",
                        MODEL_NAME,
                        "--kv-cache-memory",
                        "256M",
                        "--threads",
                        "1",
                        "--max-model-len",
                        "512",
                        "--max-num-batched-tokens",
                        "64",
                        "--max-num-seqs",
                        "32",
                        NULL};
        for (int i = 0; more[i] != NULL; i++) {
            argv[k++] = more[i];
        }
    }
    bool token = false;
    for (int i = 0; extra != NULL && extra[i] != NULL; i++) {
        token |=
            strcmp(extra[i], "--cluster-token-file") == 0 || strcmp(extra[i], "--insecure-no-kv-auth") == 0;
        argv[k++] = extra[i];
    }
    char token_file[600];
    if (!token && (strcmp(bin, "pd-prefill") == 0 || strcmp(bin, "pd-decode") == 0)) {
        /* nodes need a cluster token (or --insecure-no-kv-auth): the suite's own, unless a case names one */
        snprintf(token_file, sizeof(token_file), "%s/cluster-token", g_dir);
        argv[k++] = "--cluster-token-file";
        argv[k++] = token_file;
    }
    argv[k] = NULL;
    n->pid = tu_spawn(argv, n->log);
    ck_assert_int_gt(n->pid, 0);
    n->port = tu_wait_port(n->pid, port_file, 120);
    ck_assert_msg(n->port > 0 && (port == 0 || n->port == port), "%s did not start (on port %d); see %s", bin,
                  port, n->log);
}

static void start(node_t *n, const char *bin, const char *tag, const char *model, char *const extra[])
{
    start_at(n, bin, tag, model, extra, 0);
}

static void stop(node_t *n)
{
    if (n->pid > 0) {
        tu_stop(n->pid, 30);
        n->pid = -1;
    }
}

typedef struct cluster {
    node_t p, d, x;
} cluster_t;

/* --kv-events-config: events and replay on free loopback ports (named in /pd/info) */
#define EVENTS_CFG                                                                                           \
    "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:*\", "                               \
    "\"replay_endpoint\": \"tcp://127.0.0.1:*\"}"

#define FAST_TIMEOUTS                                                                                        \
    "--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",           \
        "--kv-load-timeout", "10", "--no-kv-prefault"

static void start_proxy(cluster_t *c, const char *policy)
{
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", c->p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c->d.port);
    char *x[] = {"--prefill", pre,        "--decode",     dec, "--health-interval",
                 "0.2",       "--policy", (char *)policy, NULL};
    start(&c->x, "pd-proxy", "proxy", NULL, x);
    /* the proxy learns the prefill's KV address from its first probe round */
    usleep(600 * 1000);
}

static void cluster_start(cluster_t *c, const char *mode, const char *pipe, char *const pext[],
                          char *const dext[])
{
    memset(c, 0, sizeof(*c));
    char *common[32] = {"--kv-transfer-mode", (char *)mode, "--kv-pipe", (char *)pipe, FAST_TIMEOUTS};
    int n = 13;
    char *pa[40], *da[40];
    memcpy(pa, common, sizeof(common));
    memcpy(da, common, sizeof(common));
    int np = n, nd = n;
    for (int i = 0; pext != NULL && pext[i] != NULL; i++) {
        pa[np++] = pext[i];
    }
    for (int i = 0; dext != NULL && dext[i] != NULL; i++) {
        da[nd++] = dext[i];
    }
    pa[np] = da[nd] = NULL;
    start(&c->p, "pd-prefill", "prefill", g_model, pa);
    start(&c->d, "pd-decode", "decode", g_model, da);
    start_proxy(c, "round-robin");
}

static void cluster_stop(cluster_t *c)
{
    stop(&c->x);
    stop(&c->d);
    stop(&c->p);
}

/* ------------------------------------------------------------------ HTTP helpers */

/* A series' value from a node's /metrics ("name" or "name{label=\"v\"}"); -1 when absent. */
static double metric(int port, const char *series)
{
    http_resp_t r;
    if (http_request(port, "GET", "/metrics", NULL, NULL, &r, 5000) != 0 || r.status != 200) {
        http_resp_free(&r);
        return -1;
    }
    double v = pd_metrics_text_value(r.body, series, -1);
    http_resp_free(&r);
    return v;
}

/* Every "node" series of tests/reference/vllm_metrics.txt is on the node's /metrics with its type
 * and the engine="0" label. */
static void assert_vllm_node_series(int port)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "GET", "/metrics", NULL, NULL, &r, 5000), 0);
    char path[4096], line[256];
    snprintf(path, sizeof(path), "%s/tests/reference/vllm_metrics.txt", tu_source_dir());
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        char name[128], type[32], where[16], want[256], series[256];
        if (line[0] == '#' || sscanf(line, "%127s %31s %15s", name, type, where) != 3) {
            continue;
        }
        snprintf(want, sizeof(want), "# TYPE %s %s\n", name, type);
        ck_assert_msg(strstr(r.body, want) != NULL, "no '%s' on :%d", want, port);
        snprintf(series, sizeof(series), "%s%s{engine=\"0\"}", name,
                 strcmp(type, "histogram") == 0 ? "_count" : "");
        ck_assert_msg(pd_metrics_text_value(r.body, series, -1) >= 0, "no %s on :%d", series, port);
        n++;
    }
    fclose(f);
    ck_assert_int_ge(n, 30);
    http_resp_free(&r);
}

/* Waits until a node's pool holds no block for any request (finished holds included). */
static void assert_pool_free(int port, const char *who)
{
    double used = -1, hold = -1;
    double end = tu_now() + 15;
    while (tu_now() < end) {
        used = metric(port, "pd:kv_blocks_used");
        /* vllm:num_requests_waiting counts those waiting for remote KV too */
        hold = metric(port, "vllm:num_requests_running") + metric(port, "vllm:num_requests_waiting");
        if (used == 0 && hold == 0) {
            return;
        }
        usleep(50 * 1000);
    }
    ck_abort_msg("%s's block pool is not free: %.0f blocks used, %.0f requests live", who, used, hold);
}

/* Waits (up to 15 s) until every KV transfer the node started has ended (completed or failed), so
 * its page counts are final: a push still being written when a decode gave up on it (under a
 * loaded make check) would otherwise land in the next measurement. */
static void await_transfers_ended(int port, const char *who)
{
    static const char *const kinds[3] = {"pull_load", "push_load", "push_save"};
    double open = -1;
    for (double end = tu_now() + 15; tu_now() < end; usleep(50 * 1000)) {
        open = 0;
        for (int i = 0; i < 3; i++) {
            char s[96], c[96], f[96];
            snprintf(s, sizeof(s), "pd:kv_transfers_started_total{kind=\"%s\"}", kinds[i]);
            snprintf(c, sizeof(c), "pd:kv_transfers_completed_total{kind=\"%s\"}", kinds[i]);
            snprintf(f, sizeof(f), "pd:kv_transfers_failed_total{kind=\"%s\"}", kinds[i]);
            open += metric(port, s) - metric(port, c) - metric(port, f);
        }
        if (open <= 0) {
            return;
        }
    }
    ck_abort_msg("%s: %.0f KV transfers still open", who, open);
}

static char *body_for(int i, bool seeded)
{
    json_t *ids = json_array();
    for (int t = 0; t < g_lens[i]; t++) {
        json_array_append_new(ids, json_integer(g_prompts[i][t]));
    }
    json_t *b = json_pack("{s:s, s:o, s:i, s:b, s:b}", "model", MODEL_NAME, "prompt", ids, "max_tokens",
                          MAX_TOKENS, "return_token_ids", 1, "ignore_eos", 1);
    if (seeded) {
        json_object_set_new(b, "temperature", json_real(0.9));
        json_object_set_new(b, "top_p", json_real(0.95));
        json_object_set_new(b, "seed", json_integer(1000 + i));
    } else {
        json_object_set_new(b, "temperature", json_real(0));
    }
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* POSTs a completion; returns the token ids as compact JSON (caller frees) or NULL with *status. */
static char *complete(int port, const char *body, int *status)
{
    http_resp_t r;
    int rc =
        http_request(port, "POST", "/v1/completions", "Content-Type: application/json\r\n", body, &r, 60000);
    *status = rc == 0 ? r.status : -1;
    char *out = NULL;
    if (rc == 0 && r.status == 200) {
        json_t *j = json_loads(r.body, JSON_ALLOW_NUL, NULL); /* a token may decode to U+0000 */
        json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
        out = ids != NULL ? json_dumps(ids, JSON_COMPACT) : NULL;
        if (out == NULL) {
            fprintf(stderr, "HTTP 200 without token ids: %.500s\n", r.body);
        }
        json_decref(j);
    }
    http_resp_free(&r);
    return out;
}

/* Prompt i through port must equal pd-serve's answer. */
static void expect_same(int port, int i, bool seeded)
{
    char *b = body_for(i, seeded);
    int st;
    char *got = complete(port, b, &st);
    free(b);
    ck_assert_msg(got != NULL, "prompt %d (len %d, %s): HTTP %d", i, g_lens[i], seeded ? "seeded" : "greedy",
                  st);
    ck_assert_msg(strcmp(got, g_ref[seeded][i]) == 0, "prompt %d (len %d, %s): %s != pd-serve %s", i,
                  g_lens[i], seeded ? "seeded" : "greedy", got, g_ref[seeded][i]);
    free(got);
}

/* ------------------------------------------------------------------ fixture */

/* pd-serve's answers on model to the first n prompts, greedy (ref[0]) and seeded (ref[1]). */
static void reference_answers(const char *model, int n, char *ref[2][NUM_PROMPTS])
{
    node_t serve;
    start(&serve, "pd-serve", "serve", model, NULL);
    for (int seeded = 0; seeded < 2; seeded++) {
        for (int i = 0; i < n; i++) {
            char *b = body_for(i, seeded);
            int st;
            ref[seeded][i] = complete(serve.port, b, &st);
            free(b);
            ck_assert_msg(ref[seeded][i] != NULL, "pd-serve on %s failed prompt %d: HTTP %d", model, i, st);
        }
    }
    stop(&serve);
}

static void suite_setup(void)
{
    g_dir = tu_mkdtemp("pd");
    char tok[600];
    snprintf(tok, sizeof(tok), "%s/cluster-token", g_dir);
    ck_assert_int_eq(tu_write_file(tok, "test-pd-cluster\n", 16), 0);
    g_model = tu_make_model("--preset tiny --arch llama --seed 3");
    g_model2 = tu_make_model("--preset tiny --arch llama --seed 4");
    ck_assert(g_dir != NULL && g_model != NULL && g_model2 != NULL);
    /* lengths: below one block, exact multiples of 16, around the 64-token step budget, long */
    static const int lens[] = {1,  2,  3,  7,  15, 16, 17, 31,  32,  33,  47,
                               48, 49, 63, 64, 65, 80, 96, 127, 128, 129, 200};
    uint64_t s = 42;
    for (int i = 0; i < NUM_PROMPTS; i++) {
        g_lens[i] = lens[i % (int)(sizeof(lens) / sizeof(lens[0]))] + (i / 22) * 3;
        g_prompts[i] = malloc((size_t)g_lens[i] * sizeof(int32_t));
        for (int t = 0; t < g_lens[i]; t++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            g_prompts[i][t] = 3 + (int32_t)((s >> 33) % 250);
        }
    }
    reference_answers(g_model, NUM_PROMPTS, g_ref);
}

static void suite_teardown(void)
{
    for (int i = 0; i < NUM_PROMPTS; i++) {
        free(g_prompts[i]);
        free(g_ref[0][i]), free(g_ref[1][i]);
    }
    tu_rmrf(g_model), tu_rmrf(g_model2);
    if (getenv("PD_TEST_KEEP_LOGS") != NULL) { /* the nodes' logs, to read after a failure */
        fprintf(stderr, "test_pd: the nodes' logs are kept in %s\n", g_dir);
    } else {
        tu_rmrf(g_dir);
    }
    free(g_model), free(g_model2), free(g_dir);
}

/* ------------------------------------------------------------------ equivalence */

static void equivalence(const char *mode, const char *pipe, bool staged)
{
    cluster_t c;
    /* the staged tcp run also has the tcp receivers busy-polling (--kv-tcp-busy-poll-us): progress
     * and the receiver thread then both read acks off the sockets */
    char *st_args[] = {"--kv-staging", "always", "--kv-tcp-busy-poll-us", "500", NULL};
    if (strcmp(pipe, "tcp") != 0) {
        st_args[2] = NULL;
    }
    cluster_start(&c, mode, pipe, staged ? st_args : NULL, staged ? st_args : NULL);
    if (staged) {
        /* plain requests to the prefill first: later P/D requests hit prefix blocks that no staged
         * request computed, so the mirror must be filled for cache hits too */
        for (int i = 0; i < 16; i++) {
            char *b = body_for(i, false);
            int st;
            char *out = complete(c.p.port, b, &st);
            ck_assert_msg(out != NULL, "direct prefill request %d: HTTP %d", i, st);
            free(out), free(b);
        }
    }
    for (int seeded = 0; seeded < 2; seeded++) {
        for (int i = 0; i < NUM_PROMPTS; i++) {
            expect_same(c.x.port, i, seeded);
        }
    }
    const char *kind = strcmp(mode, "pull") == 0 ? "pd:kv_transfers_completed_total{kind=\"pull_load\"}"
                                                 : "pd:kv_transfers_completed_total{kind=\"push_load\"}";
    double done = metric(c.d.port, kind);
    ck_assert_msg(done == 2 * NUM_PROMPTS,
                  "%s/%s: %.0f transfers completed, want %d (%.0f failed, %.0f params refused)", mode, pipe,
                  done, 2 * NUM_PROMPTS,
                  metric(c.d.port, strstr(kind, "pull") ? "pd:kv_transfers_failed_total{kind=\"pull_load\"}"
                                                        : "pd:kv_transfers_failed_total{kind=\"push_load\"}"),
                  metric(c.d.port, "pd:kv_params_refused_total"));
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"pull_load\"}"), 0);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"push_load\"}"), 0);
    ck_assert_msg(metric(c.d.port, "pd:kv_transfer_bytes_total") > 0 || strcmp(mode, "push") == 0,
                  "no bytes were read");
    /* the same loads under vLLM's NixlConnector names (its P/D dashboards), and the node series of
     * tests/reference/vllm_metrics.txt on both nodes */
    ck_assert_int_eq((int)metric(c.d.port, "vllm:nixl_xfer_time_seconds_count"), 2 * NUM_PROMPTS);
    ck_assert_int_eq((int)metric(c.d.port, "vllm:nixl_num_descriptors_count"), 2 * NUM_PROMPTS);
    ck_assert_int_eq((int)metric(c.d.port, "vllm:nixl_num_failed_transfers_total"), 0);
    ck_assert_msg(metric(c.d.port, "vllm:nixl_bytes_transferred_sum") > 0 || strcmp(mode, "push") == 0,
                  "no bytes under vllm:nixl_bytes_transferred");
    ck_assert_int_eq((int)metric(c.d.port, "vllm:request_success_total"), 2 * NUM_PROMPTS);
    if (!staged) {
        assert_vllm_node_series(c.p.port);
        assert_vllm_node_series(c.d.port);
    }
    if (staged) {
        /* the KV went through the mirrors: every moved byte was copied out on the prefill and in on
         * the decode */
        double d2h = metric(c.p.port, "pd:kv_staging_bytes_total{dir=\"d2h\"}");
        double h2d = metric(c.d.port, "pd:kv_staging_bytes_total{dir=\"h2d\"}");
        double moved = metric(c.d.port, "pd:kv_transfer_bytes_total");
        ck_assert_msg(h2d > 0 && d2h >= h2d, "staging copies: d2h %.0f, h2d %.0f", d2h, h2d);
        ck_assert_msg(strcmp(mode, "push") == 0 || h2d == moved, "decode copied %.0f B in, read %.0f B", h2d,
                      moved);
    }
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}

/* Every mode × pipe, plus the device-KV path (host mirror + page copies) with the CPU backend
 * standing in for the GPU (--kv-staging always; with tcp, also busy-polling receivers). */
static const struct {
    const char *mode, *pipe;
    bool staged;
} EQUIV[] = {{"pull", "tcp", false}, {"push", "tcp", false}, {"pull", "ucx", false},
             {"push", "ucx", false}, {"pull", "ucx", true},  {"push", "tcp", true}};

START_TEST(test_equivalence)
{
    equivalence(EQUIV[_i].mode, EQUIV[_i].pipe, EQUIV[_i].staged);
}
END_TEST

/* ------------------------------------------------------------------ first-token handover */

typedef struct transcript {
    char *text;      /* every event with ids, times and numbers taken out, in order */
    double lp[4096]; /* the numbers (logprobs), in order */
    int n_lp;
    char id[96]; /* the events' id (all must share it: "" if they do not) */
    int events;
} transcript_t;

/* Moves every real number of j (logprobs) into t->lp, leaving nulls. */
static void take_reals(json_t *j, transcript_t *t)
{
    if (json_is_object(j)) {
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v)
        {
            if (json_is_real(v)) {
                t->lp[t->n_lp < 4096 ? t->n_lp++ : 4095] = json_real_value(v);
                json_object_set_new(j, k, json_null());
            } else {
                take_reals(v, t);
            }
        }
    } else if (json_is_array(j)) {
        for (size_t i = 0; i < json_array_size(j); i++) {
            json_t *v = json_array_get(j, i);
            if (json_is_real(v)) {
                t->lp[t->n_lp < 4096 ? t->n_lp++ : 4095] = json_real_value(v);
                json_array_set_new(j, i, json_null());
            } else {
                take_reals(v, t);
            }
        }
    }
}

/* POSTs a streamed request and canonicalises its events; false when it did not answer 200. */
static bool stream_transcript(int port, const char *path, const char *body, transcript_t *t)
{
    memset(t, 0, sizeof(*t));
    http_resp_t r;
    if (http_request(port, "POST", path, "Content-Type: application/json\r\n", body, &r, 60000) != 0 ||
        r.status != 200) {
        fprintf(stderr, "stream to :%d answered %d: %.300s\n", port, r.status, r.body ? r.body : "");
        http_resp_free(&r);
        return false;
    }
    size_t cap = r.body_len * 2 + 64, len = 0;
    t->text = calloc(1, cap);
    bool first = true;
    for (char *ev = r.body, *end; ev != NULL && *ev != '\0'; ev = end) {
        end = strstr(ev, "\n\n");
        if (end != NULL) {
            *end = '\0';
            end += 2;
        }
        if (strncmp(ev, "data: ", 6) != 0) {
            continue;
        }
        t->events++;
        json_t *j = json_loads(ev + 6, JSON_ALLOW_NUL | JSON_DECODE_ANY, NULL);
        if (json_is_object(j)) {
            const char *id = json_string_value(json_object_get(j, "id"));
            if (id != NULL && (first || strcmp(id, t->id) != 0)) {
                snprintf(t->id, sizeof(t->id), "%s", first ? id : "");
                first = false;
            }
            json_object_del(j, "id");
            json_object_del(j, "created");
            /* cached_tokens may differ: a decode going on from the first output token can hold the
             * prompt's last full block in its prefix cache, which pd-serve recomputes */
            json_object_del(json_object_get(j, "usage"), "prompt_tokens_details");
            take_reals(j, t);
        }
        char *s = j != NULL ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY) : strdup(ev + 6);
        len += (size_t)snprintf(t->text + len, cap - len, "%s\n", s);
        free(s);
        json_decref(j);
    }
    http_resp_free(&r);
    return true;
}

/* The proxy's stream of body equals pd-serve's: events, text, tokens, reasons, usage, logprobs. */
static void expect_same_stream(int serve, int proxy, const char *path, const char *body, const char *what)
{
    transcript_t *a = malloc(sizeof(*a)), *b = malloc(sizeof(*b));
    ck_assert_msg(stream_transcript(serve, path, body, a), "%s: pd-serve failed", what);
    ck_assert_msg(stream_transcript(proxy, path, body, b), "%s: the proxy failed", what);
    ck_assert_msg(strcmp(a->text, b->text) == 0, "%s: the streams differ\npd-serve:\n%s\nproxy:\n%s", what,
                  a->text, b->text);
    ck_assert_int_eq(a->n_lp, b->n_lp);
    for (int i = 0; i < a->n_lp; i++) {
        ck_assert_msg(fabs(a->lp[i] - b->lp[i]) < 2e-3, "%s: logprob %d: %f vs %f", what, i, a->lp[i],
                      b->lp[i]);
    }
    ck_assert_msg(b->id[0] != '\0', "%s: the proxy's events do not share one id", what);
    free(a->text), free(b->text), free(a), free(b);
}

/* A streamed body for prompt i with extra fields (a JSON object's members, or NULL). */
static char *stream_body(int i, bool seeded, const char *extra)
{
    char *plain = body_for(i, seeded);
    json_t *b = json_loads(plain, 0, NULL);
    free(plain);
    json_object_set_new(b, "stream", json_true());
    json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (extra != NULL) {
        json_t *x = json_loads(extra, 0, NULL);
        ck_assert_ptr_nonnull(x);
        json_object_update(b, x);
        json_decref(x);
    }
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* The text pd-serve gives prompt i's first token and the first non-empty text after it (greedy). */
static void first_texts(int serve, int i, char *t0, char *t1, size_t cap, int *tok0)
{
    char *b = stream_body(i, false, NULL);
    http_resp_t r;
    ck_assert_int_eq(
        http_request(serve, "POST", "/v1/completions", "Content-Type: application/json\r\n", b, &r, 60000),
        0);
    free(b);
    t1[0] = '\0';
    int k = 0;
    for (char *e = strstr(r.body, "data: {"); e != NULL && t1[0] == '\0'; e = strstr(e + 6, "data: {"), k++) {
        json_t *j = json_loadb(e + 6, (size_t)(strstr(e, "\n\n") - e - 6), JSON_ALLOW_NUL, NULL);
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        const char *text = json_string_value(json_object_get(c0, "text"));
        if (k == 0) {
            snprintf(t0, cap, "%s", text);
            *tok0 = (int)json_integer_value(json_array_get(json_object_get(c0, "token_ids"), 0));
        } else if (text != NULL) {
            snprintf(t1, cap, "%s", text);
        }
        json_decref(j);
    }
    http_resp_free(&r);
}

/* First-token handover (pd-proxy --first-token-from-prefill, the default for streamed requests with
 * one choice): the prefill's first token is streamed at once and the decode continues from it. The
 * proxy's streams equal pd-serve's event for event (text, token ids, finish and stop reasons, usage,
 * logprobs to 2e-3) for greedy and seeded prompts of every length class, a stop string that spans
 * the first token, one that is the first token, a stop token id that is it (the prefill's stream is
 * then the whole answer), max_tokens 1, min_tokens over a stop id, echo, penalties and a chat
 * request with logprobs; the decode went on from the prefill's token (the proxy's handover counter),
 * no load failed and both pools are free. */
static const struct {
    const char *mode, *pipe;
} FT[] = {{"pull", "tcp"}, {"push", "ucx"}, {"pull", "ucx"}, {"push", "tcp"}};

START_TEST(test_first_token_handover)
{
    node_t serve;
    start(&serve, "pd-serve", "serve-ft", g_model, NULL);
    cluster_t c;
    cluster_start(&c, FT[_i].mode, FT[_i].pipe, NULL, NULL);
    char what[96];
    int handed = 0;
    for (int seeded = 0; seeded < 2; seeded++) {
        for (int i = seeded; i < NUM_PROMPTS; i += 3) {
            char *b = stream_body(i, seeded, NULL);
            snprintf(what, sizeof(what), "%s/%s prompt %d (len %d) %s", FT[_i].mode, FT[_i].pipe, i,
                     g_lens[i], seeded ? "seeded" : "greedy");
            expect_same_stream(serve.port, c.x.port, "/v1/completions", b, what);
            free(b);
            handed++;
        }
    }
    char t0[256], t1[256], extra[1024];
    int tok0 = -1, pi = 5;
    size_t l0 = 0;
    /* a prompt whose first token ends in an ASCII character and whose next text starts with one: the
     * stop string of those two spans the first token */
    for (; pi < NUM_PROMPTS; pi++) {
        first_texts(serve.port, pi, t0, t1, sizeof(t0), &tok0);
        l0 = strlen(t0);
        if (l0 > 0 && (unsigned char)t0[l0 - 1] < 0x80 && t1[0] != '\0' && (unsigned char)t1[0] < 0x80) {
            break;
        }
    }
    ck_assert_int_lt(pi, NUM_PROMPTS);
    char two[3] = {t0[l0 - 1], t1[0], '\0'};
    json_t *span = json_pack("{s:[s]}", "stop", two);
    json_t *whole = json_pack("{s:[s]}", "stop", t0);
    char *span_s = json_dumps(span, JSON_COMPACT), *whole_s = json_dumps(whole, JSON_COMPACT);
    struct {
        const char *extra;
        bool hands_over; /* the first token does not end it */
    } cases[] = {
        {"{\"logprobs\": 2}", true},
        {"{\"max_tokens\": 1}", false},
        {span_s, strstr(t0, two) == NULL}, /* ends after the first token, whose text is held back */
        {whole_s, false},
        {NULL, false}, /* stop_token_ids: [the first token] */
        {NULL, true},  /* the same under min_tokens 3 */
        {"{\"echo\": true}", true},
        {"{\"temperature\": 0.8, \"seed\": 11, \"frequency_penalty\": 1.5, \"presence_penalty\": 0.5}", true},
    };
    char stop_id[64], min_stop[96];
    snprintf(stop_id, sizeof(stop_id), "{\"stop_token_ids\": [%d], \"ignore_eos\": false}", tok0);
    snprintf(min_stop, sizeof(min_stop), "{\"stop_token_ids\": [%d], \"min_tokens\": 3}", tok0);
    cases[4].extra = stop_id;
    cases[5].extra = min_stop;
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        char *b = stream_body(pi, false, cases[k].extra);
        snprintf(what, sizeof(what), "%s/%s %s", FT[_i].mode, FT[_i].pipe, cases[k].extra);
        expect_same_stream(serve.port, c.x.port, "/v1/completions", b, what);
        free(b);
        handed += cases[k].hands_over;
    }
    snprintf(extra, sizeof(extra), "%s", "");
    const char *chat =
        "{\"model\": \"" MODEL_NAME "\", \"messages\": [{\"role\": \"user\", \"content\": \"hi there\"}], "
        "\"max_tokens\": 6, \"stream\": true, \"temperature\": 0, \"logprobs\": true, "
        "\"top_logprobs\": 2, \"stream_options\": {\"include_usage\": true}}";
    expect_same_stream(serve.port, c.x.port, "/v1/chat/completions", chat, "chat");
    handed++;
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:first_token_handovers_total"), handed);
    /* a first token outside the vocabulary is refused before anything is loaded */
    char *bad = stream_body(0, false,
                            "{\"kv_transfer_params\": {\"do_remote_prefill\": true, \"first_token_id\": "
                            "1000000, \"remote_host\": \"127.0.0.1\", \"remote_port\": 1}}");
    http_resp_t br;
    ck_assert_int_eq(http_request(c.d.port, "POST", "/v1/completions", "Content-Type: application/json\r\n",
                                  bad, &br, 10000),
                     0);
    ck_assert_msg(br.status == 400 && strstr(br.body, "first_token_id") != NULL, "HTTP %d: %s", br.status,
                  br.body);
    http_resp_free(&br);
    free(bad);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"pull_load\"}"), 0);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"push_load\"}"), 0);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    free(span_s), free(whole_s);
    json_decref(span), json_decref(whole);
    cluster_stop(&c);
    stop(&serve);
}
END_TEST

/* prompt_logprobs through P/D (proxy/prompt_scores.c): the prefill scores the prompt it computes
 * and the proxy puts the scores into the decode's answer. Equal to pd-serve's (entries, ranks,
 * decoded tokens; logprobs to 2e-3) for one prompt, n = 2 seeded (each choice its prompt's scores),
 * a batch of two prompts and a chat request (in the choice and at the top level); in push mode the
 * decode's answer waits for the prefill's. Streamed it is refused (vLLM's 400), and a decode node
 * asked for it directly says the prefill scores the prompt. Both pools end free. */
static json_t *post_expect(int port, const char *path, const char *body, int want_status)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", path, "Content-Type: application/json\r\n", body, &r, 60000),
                     0);
    ck_assert_msg(r.status == want_status, ":%d %s answered %d, want %d: %.300s", port, path, r.status,
                  want_status, r.body);
    json_t *j = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    ck_assert_ptr_nonnull(j);
    http_resp_free(&r);
    return j;
}

/* Every prompt_logprobs of an answer (each choice's, chat's top level), canonicalised into t. */
static void prompt_scores(json_t *resp, transcript_t *t)
{
    memset(t, 0, sizeof(*t));
    json_t *all = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(resp, "choices"), i, c)
    {
        json_array_append(all, json_object_get(c, "prompt_logprobs"));
    }
    if (json_object_get(resp, "prompt_logprobs") != NULL) {
        json_array_append(all, json_object_get(resp, "prompt_logprobs"));
    }
    json_t *copy = json_deep_copy(all);
    take_reals(copy, t);
    t->text = json_dumps(copy, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(copy);
    json_decref(all);
}

START_TEST(test_prompt_logprobs_through_proxy)
{
    node_t serve;
    start(&serve, "pd-serve", "serve-plp", g_model, NULL);
    cluster_t c;
    cluster_start(&c, FT[_i].mode, FT[_i].pipe, NULL, NULL);
    const struct {
        const char *path, *body;
        size_t entries; /* prompt_logprobs arrays in the answer (a chat choice has none) */
    } cases[] = {
        {"/v1/completions",
         "{\"model\": \"" MODEL_NAME "\", \"prompt\": \"The cache line size of\", \"max_tokens\": 4, "
         "\"temperature\": 0, \"prompt_logprobs\": 2}",
         1},
        {"/v1/completions",
         "{\"model\": \"" MODEL_NAME "\", \"prompt\": \"Two choices share a prompt\", \"n\": 2, "
         "\"max_tokens\": 3, \"temperature\": 0.9, \"seed\": 5, \"prompt_logprobs\": 1}",
         2},
        {"/v1/completions",
         "{\"model\": \"" MODEL_NAME "\", \"prompt\": [\"First prompt here\", \"And a second, longer "
         "prompt\"], \"max_tokens\": 2, \"temperature\": 0, \"prompt_logprobs\": 0}",
         2},
        {"/v1/chat/completions",
         "{\"model\": \"" MODEL_NAME "\", \"messages\": [{\"role\": \"user\", \"content\": "
         "\"hi there\"}], \"max_tokens\": 3, \"temperature\": 0, \"prompt_logprobs\": 1}",
         1}, /* chat: at the top level */
    };
    transcript_t *a = malloc(sizeof(*a)), *b = malloc(sizeof(*b));
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        json_t *ra = post_expect(serve.port, cases[k].path, cases[k].body, 200);
        json_t *rb = post_expect(c.x.port, cases[k].path, cases[k].body, 200);
        prompt_scores(ra, a);
        prompt_scores(rb, b);
        ck_assert_msg(strcmp(a->text, b->text) == 0,
                      "%s/%s case %zu: prompt_logprobs differ\npd-serve: %s\nproxy: %s", FT[_i].mode,
                      FT[_i].pipe, k, a->text, b->text);
        json_t *parsed = json_loads(b->text, 0, NULL);
        ck_assert_int_eq(json_array_size(parsed), cases[k].entries);
        json_decref(parsed);
        ck_assert_int_eq(a->n_lp, b->n_lp);
        ck_assert_int_gt(b->n_lp, 2);
        for (int i = 0; i < a->n_lp; i++) {
            ck_assert_msg(fabs(a->lp[i] - b->lp[i]) < 2e-3, "case %zu: logprob %d: %f vs %f", k, i, a->lp[i],
                          b->lp[i]);
        }
        free(a->text), free(b->text);
        json_decref(ra), json_decref(rb);
    }
    free(a), free(b);
    json_t *e = post_expect(
        c.x.port, "/v1/completions",
        "{\"model\": \"" MODEL_NAME "\", \"prompt\": \"x\", \"stream\": true, \"prompt_logprobs\": 0}", 400);
    ck_assert_ptr_nonnull(
        strstr(json_string_value(json_object_get(json_object_get(e, "error"), "message")), "stream"));
    json_decref(e);
    e = post_expect(c.d.port, "/v1/completions",
                    "{\"model\": \"" MODEL_NAME
                    "\", \"prompt\": \"x\", \"prompt_logprobs\": 0, \"kv_transfer_params\": "
                    "{\"do_remote_prefill\": true, \"remote_host\": \"127.0.0.1\", \"remote_port\": 1}}",
                    400);
    ck_assert_ptr_nonnull(
        strstr(json_string_value(json_object_get(json_object_get(e, "error"), "message")), "prefill"));
    json_decref(e);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
    stop(&serve);
}
END_TEST

/* pd-proxy --kv-events: the proxy subscribes to both nodes' KV cache events (--kv-events-config,
 * endpoints from /pd/info) and indexes which node caches which block. Distinct prompts of 2 full
 * blocks each: both nodes hold 2 blocks per prompt (the prefill computed them, the decode loaded
 * them). A proxy started after the requests learns the same from the nodes' replay buffers. With
 * a pool of 40 blocks, evictions keep every node's count within its pool, no batch is missing and
 * none is malformed. */
static double node_blocks(int proxy_port, int node_port)
{
    char series[128];
    snprintf(series, sizeof(series), "pd_proxy:kv_index_blocks{node=\"http://127.0.0.1:%d\"}", node_port);
    return metric(proxy_port, series);
}

/* Polls until the proxy indexes at least (exact: exactly) want blocks on the node, or 10 s pass;
 * returns the last count. */
static double await_blocks(int proxy_port, int node_port, double want, bool exact)
{
    double v = -1, end = tu_now() + 10;
    while (tu_now() < end) {
        v = node_blocks(proxy_port, node_port);
        if (exact ? v == want : v >= want) {
            break;
        }
        usleep(50 * 1000);
    }
    return v;
}

static void start_events_proxy(cluster_t *c)
{
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", c->p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c->d.port);
    char *x[] = {"--prefill", pre, "--decode", dec, "--health-interval", "0.2", "--kv-events", NULL};
    start(&c->x, "pd-proxy", "proxy-events", NULL, x);
}

/* Polls until both nodes' index counts equal want (or 10 s pass). */
static void expect_index(int proxy_port, const cluster_t *c, double want, const char *what)
{
    double p = -1, d = -1, end = tu_now() + 10;
    while (tu_now() < end) {
        p = node_blocks(proxy_port, c->p.port);
        d = node_blocks(proxy_port, c->d.port);
        if (p == want && d == want) {
            return;
        }
        usleep(100 * 1000);
    }
    ck_abort_msg("%s: the proxy indexes %.0f blocks on the prefill and %.0f on the decode, want %.0f", what,
                 p, d, want);
}

START_TEST(test_proxy_kv_events_index)
{
    char *ev[] = {"--kv-events-config", EVENTS_CFG, "--num-blocks-override", "40", NULL};
    cluster_t c;
    cluster_start(&c, "pull", "tcp", ev, ev);
    stop(&c.x);
    start_events_proxy(&c);
    usleep(600 * 1000); /* the first probe round subscribes */
    for (int k = 0; k < 4; k++) {
        char body[1024];
        int n =
            snprintf(body, sizeof(body), "{\"model\": \"" MODEL_NAME "\", \"max_tokens\": 2, \"prompt\": [");
        for (int t = 0; t < 40; t++) {
            n += snprintf(body + n, sizeof(body) - (size_t)n, "%s%d", t ? "," : "",
                          3 + (k * 37 + t * 11) % 240);
        }
        snprintf(body + n, sizeof(body) - (size_t)n, "]}");
        int st;
        char *out = complete(c.x.port, body, &st);
        ck_assert_msg(st == 200, "HTTP %d", st);
        free(out);
    }
    expect_index(c.x.port, &c, 8, "live");
    /* a proxy that starts later learns the same from the replay buffers */
    stop(&c.x);
    start_events_proxy(&c);
    expect_index(c.x.port, &c, 8, "replayed");
    /* 39 usable blocks per node: the counts follow the evictions */
    for (int i = 0; i < 24; i++) {
        expect_same(c.x.port, i, false);
    }
    usleep(500 * 1000);
    double p = node_blocks(c.x.port, c.p.port), d = node_blocks(c.x.port, c.d.port);
    ck_assert_msg(p > 0 && p <= 39 && d > 0 && d <= 39, "index counts %.0f / %.0f for 39-block pools", p, d);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:kv_events_gaps_total"), 0);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:kv_events_malformed_total"), 0);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

/* A free loopback TCP port (bound and released: a node binds it next). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    ck_assert(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
              getsockname(fd, (struct sockaddr *)&sa, &sl) == 0);
    close(fd);
    return ntohs(sa.sin_port);
}

/* A node restarts behind the proxy's back: the prefill is killed and started again on the same HTTP,
 * KV ports and event sockets (so the proxy's subscription reconnects by itself). Its new process numbers
 * its batches from 0 again: the proxy forgets what the old one held, and after one new prompt of 8
 * blocks it indexes exactly those 8 and 2 again, not the old 4 as well. Until then its index is stale and the
 * answers are still right. */
START_TEST(test_proxy_index_after_node_restart)
{
    char evcfg[1400], kvl[64]; /* ipc endpoints are bound (a tcp one without '*' is connected) */
    snprintf(evcfg, sizeof(evcfg),
             "{\"enable_kv_cache_events\": true, \"endpoint\": \"ipc://%s/ev.sock\", "
             "\"replay_endpoint\": \"ipc://%s/replay.sock\"}",
             g_dir, g_dir);
    snprintf(kvl, sizeof(kvl), "127.0.0.1:%d", free_port());
    char *pev[] = {"--kv-events-config", evcfg, "--kv-listen", kvl, NULL};
    cluster_t c;
    cluster_start(&c, "pull", "tcp", pev, NULL);
    stop(&c.x);
    start_events_proxy(&c);
    usleep(600 * 1000);
    expect_same(c.x.port, 8, false); /* 32 and 33 tokens: 2 full blocks each */
    expect_same(c.x.port, 9, false);
    ck_assert_int_eq((int)await_blocks(c.x.port, c.p.port, 4, true), 4);
    int http_port = c.p.port;
    kill(c.p.pid, SIGKILL);
    waitpid(c.p.pid, NULL, 0);
    char *common[] = {"--kv-transfer-mode", "pull", "--kv-pipe",   "tcp", FAST_TIMEOUTS,
                      "--kv-events-config", evcfg,  "--kv-listen", kvl,   NULL};
    start_at(&c.p, "pd-prefill", "prefill-again", g_model, common, http_port);
    usleep(800 * 1000);               /* healthy again in the proxy's probes */
    expect_same(c.x.port, 8, false);  /* the stale index may still name it: the answer is right */
    expect_same(c.x.port, 19, false); /* 128 tokens: 8 blocks */
    double got = await_blocks(c.x.port, c.p.port, 10, true);
    ck_assert_msg(got == 10,
                  "after the restart the proxy indexes %.0f blocks on the prefill, want 10 (2 + 8)", got);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:kv_events_malformed_total"), 0);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

/* Speculative decoding (--speculative-config) on pd-serve and on the decode node: n-gram drafts in
 * pull over tcp and push over ucx, a draft model in pull over ucx and push over tcp: greedy answers equal pd-serve's without it, drafts were proposed
 * and some accepted (vLLM's spec_decode counters), and no block is left held. */
START_TEST(test_speculative_equivalence)
{
    char *spec[] = {"--speculative-config",
                    "{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_min\": 1, "
                    "\"prompt_lookup_max\": 3}",
                    NULL};
    node_t serve;
    start(&serve, "pd-serve", "serve-spec", g_model, spec);
    for (int i = 0; i < NUM_PROMPTS; i++) {
        expect_same(serve.port, i, false);
    }
    ck_assert_double_gt(metric(serve.port, "vllm:spec_decode_num_drafts_total"), 0);
    ck_assert_double_gt(metric(serve.port, "vllm:spec_decode_num_accepted_tokens_total"), 0);
    ck_assert_double_ge(
        metric(serve.port, "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}"),
        metric(serve.port, "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"}"));
    assert_pool_free(serve.port, "pd-serve");
    stop(&serve);
    /* then a draft model (the target itself: every draft accepted), on pd-serve and on the decode,
     * which computes the draft's prompt KV locally (only the target's came over the wire) */
    char draft_cfg[1200];
    snprintf(draft_cfg, sizeof(draft_cfg),
             "{\"method\": \"draft_model\", \"model\": \"%s\", \"num_speculative_tokens\": 3}", g_model);
    char *draft[] = {"--speculative-config", draft_cfg, NULL};
    start(&serve, "pd-serve", "serve-draft", g_model, draft);
    for (int i = 0; i < NUM_PROMPTS; i++) {
        expect_same(serve.port, i, false);
    }
    ck_assert_double_eq(metric(serve.port, "vllm:spec_decode_num_accepted_tokens_total"),
                        metric(serve.port, "vllm:spec_decode_num_draft_tokens_total"));
    stop(&serve);
    static const char *modes[4][2] = {{"pull", "tcp"}, {"push", "ucx"}, {"pull", "ucx"}, {"push", "tcp"}};
    for (int m = 0; m < 4; m++) {
        cluster_t c;
        cluster_start(&c, modes[m][0], modes[m][1], NULL, m < 2 ? spec : draft);
        for (int i = 0; i < NUM_PROMPTS; i++) {
            expect_same(c.x.port, i, false);
        }
        double drafts = metric(c.d.port, "vllm:spec_decode_num_drafts_total");
        double accepted = metric(c.d.port, "vllm:spec_decode_num_accepted_tokens_total");
        fprintf(stderr, "speculative P/D %s/%s: %.0f drafts, %.0f tokens accepted\n", modes[m][0],
                modes[m][1], drafts, accepted);
        ck_assert(drafts > 0 && accepted > 0);
        if (m >= 2) { /* the target drafting for itself */
            ck_assert_double_eq(accepted, metric(c.d.port, "vllm:spec_decode_num_draft_tokens_total"));
        }
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

/* Bytes of KV a decode needs moved for a prompt of n tokens (block 16, the last token recomputed):
 * every block of a full-attention layer, a sliding layer's blocks from the window of position
 * n − 1 on (KV cache groups: the rest is never allocated on the decode). */
static double kv_bytes_needed(int n, int page, int full_layers, int sliding_layers, int window)
{
    int nb = (n - 1 + 15) / 16, first = n - window > 0 ? (n - window) / 16 : 0;
    first = first < nb ? first : nb;
    return (double)page * (full_layers * nb + sliding_layers * (nb - first));
}

/* Qwen3 (per-head q/k norms, head_dim != hidden / heads), Mistral with a 16-token sliding
 * window, Gemma3 (local 16-token and global layers) and Llama-3.1's rope_scaling (prompts up to
 * 200 tokens, past the window and original_max_position_embeddings) through P/D equal pd-serve on
 * the same model, greedy and seeded; a sliding-window layer moves only the blocks inside the
 * window (the bytes moved are counted). */
START_TEST(test_families_equivalence)
{
#define LLAMA31_SCALING                                                                                      \
    "--rope-scaling "                                                                                        \
    "{\\\"rope_type\\\":\\\"llama3\\\",\\\"factor\\\":8.0,\\\"low_freq_factor\\\":1.0,"                      \
    "\\\"high_freq_factor\\\":4.0,\\\"original_max_position_embeddings\\\":32}"
#define GEMMA3_SHAPE "--preset tiny --arch gemma3 --layers 4 --sliding-window 16 --sliding-pattern 2 --seed 7"
    static const struct {
        const char *mk, *mode, *pipe;
        int page, full_layers,
            sliding_layers; /* bytes of a page of block 16 (fp32 KV but the last); window 16 */
    } fam[] = {{"--preset tiny --arch qwen3 --head-dim 32 --seed 5", "pull", "tcp", 8192, 2, 0},
               {"--preset tiny --arch mistral --sliding-window 16 --seed 6", "push", "ucx", 4096, 0, 2},
               {GEMMA3_SHAPE, "pull", "ucx", 4096, 2, 2},
               {GEMMA3_SHAPE, "push", "tcp", 4096, 2, 2},
               /* Llama-3.1-shaped: llama3 rope_scaling, prompts past original_max_position_embeddings */
               {"--preset tiny --arch llama --seed 8 " LLAMA31_SCALING, "push", "tcp", 4096, 2, 0},
               {"--preset tiny --arch llama --seed 8 " LLAMA31_SCALING, "pull", "ucx", 4096, 2, 0},
               /* a bf16 checkpoint: --kv-cache-dtype auto keeps a bf16 cache on both pools, pages of
                * half the bytes */
               {"--preset tiny --arch llama --dtype bf16 --seed 9", "pull", "tcp", 2048, 2, 0}};
    enum { N = 24 };
    char *saved = g_model;
    for (size_t f = 0; f < sizeof(fam) / sizeof(fam[0]); f++) {
        g_model = tu_make_model(fam[f].mk);
        ck_assert_ptr_nonnull(g_model);
        char *ref[2][NUM_PROMPTS];
        reference_answers(g_model, N, ref);
        cluster_t c;
        cluster_start(&c, fam[f].mode, fam[f].pipe, NULL, NULL);
        double want_bytes = 0;
        for (int seeded = 0; seeded < 2; seeded++) {
            if (seeded == 1) { /* the greedy round moved exactly what the decode needs */
                double moved = metric(c.d.port, "pd:kv_transfer_bytes_total");
                ck_assert_msg(moved == want_bytes, "%s: %.0f bytes of KV moved, the decode needs %.0f",
                              fam[f].mk, moved, want_bytes);
                if (strcmp(fam[f].mode, "push") == 0) { /* and the prefill wrote no more than that */
                    /* a late whole-prompt write counts its bytes just after its WRITE_DONE went out: the
                     * decode may answer first (the count only grows; wait for it to settle) */
                    double wrote = metric(c.p.port, "pd:kv_transfer_bytes_total");
                    for (double end = tu_now() + 5; wrote < want_bytes && tu_now() < end; usleep(10000)) {
                        wrote = metric(c.p.port, "pd:kv_transfer_bytes_total");
                    }
                    ck_assert_msg(wrote == want_bytes,
                                  "%s: the prefill wrote %.0f bytes, the decode needs %.0f", fam[f].mk, wrote,
                                  want_bytes);
                }
            }
            for (int i = 0; i < N; i++) {
                want_bytes +=
                    kv_bytes_needed(g_lens[i], fam[f].page, fam[f].full_layers, fam[f].sliding_layers, 16);
                char *b = body_for(i, seeded);
                int st;
                char *got = complete(c.x.port, b, &st);
                free(b);
                ck_assert_msg(got != NULL && strcmp(got, ref[seeded][i]) == 0,
                              "%s prompt %d (len %d, %s): %s != pd-serve %s (HTTP %d)", fam[f].mk, i,
                              g_lens[i], seeded ? "seeded" : "greedy", got != NULL ? got : "-",
                              ref[seeded][i], st);
                free(got), free(ref[seeded][i]);
            }
        }
        const char *kind = strcmp(fam[f].mode, "pull") == 0
                               ? "pd:kv_transfers_completed_total{kind=\"pull_load\"}"
                               : "pd:kv_transfers_completed_total{kind=\"push_load\"}";
        ck_assert_int_eq((int)metric(c.d.port, kind), 2 * N);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
        tu_rmrf(g_model);
        free(g_model);
    }
    g_model = saved;
}
END_TEST

/* A node whose KV cannot use the pipe refuses to start with a reason (no crash, no half-started
 * server): nccl with a host KV (or, without NCCL in the build, nccl at all). */
START_TEST(test_nccl_with_host_kv_refused)
{
    char log[600];
    snprintf(log, sizeof(log), "%s/nccl.log", g_dir);
    int rc =
        tu_run(60,
               "%s/bin/pd-prefill --model %s --device cpu --kv-pipe nccl --port 0 --kv-listen 127.0.0.1:0 "
               "--no-kv-prefault --insecure-no-kv-auth >%s 2>&1",
               tu_binary_dir(), g_model, log);
    size_t n = 0;
    char *text = tu_read_file(log, &n);
    ck_assert_msg(rc == 1, "pd-prefill --kv-pipe nccl on a CPU KV exited %d, want 1", rc);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, "moves GPU memory") != NULL ||
                      strstr(text, "cannot create a nccl pipe") != NULL,
                  "no reason in the log:\n%s", text);
    free(text);
}
END_TEST

/* A request the decode refuses after the prefill computed its KV ("max_tokens": 100000, past the
 * decode's context: the proxy sends the prefill max_tokens 1 and knows no context length) is
 * answered 400, and the proxy has the prefill free that KV at once (POST /pd/release) instead of at
 * --kv-hold-timeout (120 s here): after 10 of them both pools are free within assert_pool_free's
 * 15 s. Fields the proxy rewrites for the prefill ("max_tokens": "5", "logprobs": 100, "stream":
 * "yes", min_tokens above max_tokens) are refused by the proxy itself, naming the field, before any
 * prefill computes. Pull over tcp (10 leases granted: the KV was really held) and push over ucx. */
START_TEST(test_refused_decode_releases_prefill)
{
    static const char *const modes[2][2] = {{"pull", "tcp"}, {"push", "ucx"}};
    for (int m = 0; m < 2; m++) {
        cluster_t c;
        cluster_start(&c, modes[m][0], modes[m][1], NULL, NULL);
        for (int i = 0; i < 10; i++) {
            char *b = body_for(i, false);
            json_t *j = json_loads(b, 0, NULL);
            free(b);
            json_object_set_new(j, "max_tokens", json_integer(100000));
            char *body = json_dumps(j, JSON_COMPACT);
            json_decref(j);
            int st;
            char *got = complete(c.x.port, body, &st);
            free(body);
            ck_assert_msg(got == NULL && st == 400, "%s: a request the decode refuses got HTTP %d",
                          modes[m][0], st);
        }
        if (m == 0) {
            ck_assert_int_eq((int)metric(c.p.port, "pd:kv_leases_granted_total"), 10);
        }
        static const char *bad[][2] = {
            {"max_tokens", "\"5\""}, {"logprobs", "100"}, {"stream", "\"yes\""}, {"min_tokens", "9"}};
        for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
            char *b = body_for(k, false);
            json_t *j = json_loads(b, 0, NULL);
            free(b);
            json_object_set_new(j, bad[k][0], json_loads(bad[k][1], JSON_DECODE_ANY, NULL));
            char *body = json_dumps(j, JSON_COMPACT);
            json_decref(j);
            http_resp_t r;
            ck_assert_int_eq(http_request(c.x.port, "POST", "/v1/completions",
                                          "Content-Type: application/json\r\n", body, &r, 10000),
                             0);
            free(body);
            ck_assert_msg(r.status == 400 && strstr(r.body, bad[k][0]) != NULL, "%s: HTTP %d %.200s",
                          bad[k][0], r.status, r.body);
            http_resp_free(&r);
        }
        if (m == 0) { /* none of those reached the prefill */
            ck_assert_int_eq((int)metric(c.p.port, "pd:kv_leases_granted_total"), 10);
        }
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        expect_same(c.x.port, 3, false); /* and the cluster still serves */
        cluster_stop(&c);
    }
}
END_TEST

/* ------------------------------------------------------------------ hostile connections */

/* A node's KV control port from /pd/info. */
static int kv_port_of(int http_port)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(http_port, "GET", "/pd/info", NULL, NULL, &r, 5000), 0);
    json_t *info = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    int port = (int)json_integer_value(json_object_get(info, "kv_port"));
    json_decref(info);
    ck_assert_int_gt(port, 0);
    return port;
}

/* The attacker (a child process, killed by the caller): per port, `silent` connections that send
 * nothing and `dribble` that send one byte every second, each reopened as soon as the node drops
 * it, until killed. */
static pid_t hostile_start(const int *ports, int nports, int silent, int dribble)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid > 0) {
        return pid;
    }
    enum { MAX = 512 };
    int fds[MAX], port[MAX], n = 0;
    for (int p = 0; p < nports; p++) {
        for (int i = 0; i < silent + dribble && n < MAX; i++, n++) {
            port[n] = ports[p];
            fds[n] = http_connect(ports[p], 1000);
        }
    }
    signal(SIGPIPE, SIG_IGN);
    for (unsigned tick = 0;; tick++) {
        for (int i = 0; i < n; i++) {
            bool dribbler = i % (silent + dribble) >= silent;
            char c;
            bool closed = fds[i] < 0 || recv(fds[i], &c, 1, MSG_DONTWAIT) == 0;
            if (!closed && dribbler && tick % 4 == 0) {
                closed = send(fds[i], "\0", 1, MSG_NOSIGNAL) != 1;
            }
            if (closed) {
                if (fds[i] >= 0) {
                    close(fds[i]);
                }
                fds[i] = http_connect(port[i], 1000);
            }
        }
        usleep(250 * 1000);
    }
}

/* 64 silent and 64 dribbling connections to each node's --kv-listen, held (and reopened when
 * dropped) through a load run: every request still moves its KV (zero failed transfers, nothing
 * recomputed), no peer is declared dead (one handshake, never redone), answers unchanged. */
START_TEST(test_silent_kv_connections_harmless)
{
    enum { N = 24 };
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    expect_same(c.x.port, 0, false); /* the decode dials the prefill before the attack */
    int ports[2] = {kv_port_of(c.p.port), kv_port_of(c.d.port)};
    pid_t attacker = hostile_start(ports, 2, 64, 64);
    usleep(3000 * 1000); /* past the handshake timeout (2 s): connections dropped and reopened */
    for (int seeded = 0; seeded < 2; seeded++) {
        for (int i = 0; i < N; i++) {
            expect_same(c.x.port, i, seeded);
        }
    }
    kill(attacker, SIGKILL);
    waitpid(attacker, NULL, 0);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_completed_total{kind=\"pull_load\"}"), 2 * N + 1);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"pull_load\"}"), 0);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_handshakes_total{result=\"ok\"}"), 1);
    ck_assert_int_eq((int)metric(c.p.port, "pd:kv_handshakes_total{result=\"ok\"}"), 1);
    ck_assert_int_gt(metric(c.p.port, "pd:kv_handshakes_total{result=\"failed\"}"), 64);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

/* A decode told to load from a KV port that accepts TCP but never answers (a request's push
 * kv_transfer_params name it: pull ones are signed by the prefill) dials it without stopping its
 * control loop: while that handshake
 * waits out its 2 s, heartbeats go on and every other request moves its KV (no peer declared
 * dead, one handshake); the bogus request recomputes its prompt. */
START_TEST(test_silent_prefill_dial_harmless)
{
    enum { N = 12 };
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    expect_same(c.x.port, 0, false); /* the decode's one real handshake */
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof(a);
    ck_assert_int_eq(bind(lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    ck_assert_int_eq(listen(lfd, 8), 0); /* the kernel completes connects; nobody ever answers */
    ck_assert_int_eq(getsockname(lfd, (struct sockaddr *)&a, &al), 0);
    char *b = body_for(1, false);
    json_t *j = json_loads(b, 0, NULL);
    free(b);
    json_object_set_new(j, "kv_transfer_params",
                        json_pack("{s:b, s:s, s:s, s:s, s:i, s:s}", "do_remote_prefill", 1, "transfer_mode",
                                  "push", "transfer_id", "bogus", "remote_host", "127.0.0.1", "remote_port",
                                  (int)ntohs(a.sin_port), "remote_engine_id", "nobody"));
    char *body = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    int fd = http_send(c.d.port, "POST", "/v1/completions", "Content-Type: application/json\r\n", body,
                       strlen(body), 5000);
    free(body);
    ck_assert_int_ge(fd, 0);
    usleep(100 * 1000); /* the decode is dialling the silent port now */
    for (int i = 0; i < N; i++) {
        expect_same(c.x.port, i, false);
    }
    char resp[8192];
    ssize_t got = 0, r;
    while ((r = recv(fd, resp + got, sizeof(resp) - 1 - (size_t)got, 0)) > 0) {
        got += r;
    }
    resp[got] = '\0';
    close(fd);
    close(lfd);
    ck_assert_msg(strstr(resp, " 200 ") != NULL, "the bogus-KV request did not recompute: %s", resp);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"push_load\"}"), 1);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_completed_total{kind=\"pull_load\"}"), N + 1);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_handshakes_total{result=\"ok\"}"), 1);
    ck_assert_int_eq((int)metric(c.p.port, "pd:kv_handshakes_total{result=\"ok\"}"), 1);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

/* ------------------------------------------------------------------ prefix hits */

static char *ids_body(const int32_t *ids, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) {
        json_array_append_new(a, json_integer(ids[i]));
    }
    json_t *b = json_pack("{s:s, s:o, s:i, s:f, s:b, s:b}", "model", MODEL_NAME, "prompt", a, "max_tokens", 4,
                          "temperature", 0.0, "return_token_ids", 1, "ignore_eos", 1);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

START_TEST(test_prefix_hit_moves_only_missing_blocks)
{
    const char *pages = "pd:kv_transfer_pages_sum";
    for (int m = 0; m < 2; m++) {
        const char *mode = m == 0 ? "pull" : "push";
        cluster_t c;
        cluster_start(&c, mode, "tcp", NULL, NULL);
        int layers = 2; /* the tiny preset */
        int32_t a[97], b[97];
        for (int i = 0; i < 97; i++) {
            a[i] = b[i] = 5 + (i * 7) % 200;
        }
        for (int i = 48; i < 97; i++) {
            b[i] = 9 + (i * 3) % 180; /* b shares a's first 48 tokens = 3 blocks */
        }
        int st;
        char *body = ids_body(a, 97);
        free(complete(c.x.port, body, &st)); /* cold: 96 tokens' KV = 6 blocks move */
        ck_assert_int_eq(st, 200);
        double p0 = metric(c.d.port, pages);
        ck_assert_msg(p0 == 6 * layers, "%s cold: %.0f pages moved, want %d", mode, p0, 6 * layers);
        free(complete(c.x.port, body, &st)); /* full hit: the decode has all 6 blocks */
        free(body);
        double p1 = metric(c.d.port, pages);
        ck_assert_msg(p1 == p0, "%s full hit moved %.0f pages", mode, p1 - p0);
        body = ids_body(b, 97);
        free(complete(c.x.port, body, &st)); /* partial: blocks 3..5 move */
        free(body);
        double p2 = metric(c.d.port, pages);
        ck_assert_msg(p2 - p1 == 3 * layers, "%s partial hit: %.0f pages moved, want %d", mode, p2 - p1,
                      3 * layers);
        const char *kind = m == 0 ? "pd:kv_transfers_completed_total{kind=\"pull_load\"}"
                                  : "pd:kv_transfers_completed_total{kind=\"push_load\"}";
        ck_assert_int_eq((int)metric(c.d.port, kind), 3);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

/* A decode node with an offload tier (its pool of 39 blocks holds 5 of these prompts' 7 blocks): a
 * prompt whose blocks the decode's pool evicted is found in its tier, so its KV moves from the
 * prefill once; the answer equals the first one (pull with the tier's loads inline, push with them on
 * the loader thread). */
START_TEST(test_decode_offload_tier_saves_transfers)
{
    const char *pages = "pd:kv_transfer_pages_sum";
    for (int m = 0; m < 2; m++) {
        const char *mode = m == 0 ? "pull" : "push";
        cluster_t c;
        char *dext[] = {"--num-blocks-override",
                        "40",
                        "--kv-offload-tier",
                        "host",
                        "--kv-offload-size",
                        "16M",
                        "--kv-offload-load",
                        m == 0 ? "inline" : "thread",
                        NULL};
        cluster_start(&c, mode, "tcp", NULL, dext);
        int32_t a[97];
        for (int i = 0; i < 97; i++) {
            a[i] = 5 + (i * 7) % 200;
        }
        int st;
        char *body = ids_body(a, 97);
        char *first = complete(c.x.port, body, &st);
        ck_assert_int_eq(st, 200);
        for (int k = 0; k < 6; k++) { /* 6 × 7 blocks through 39: a's blocks leave the decode's pool */
            int32_t o[97];
            for (int i = 0; i < 97; i++) {
                o[i] = 3 + (i * 11 + k * 37) % 190;
            }
            char *ob = ids_body(o, 97);
            free(complete(c.x.port, ob, &st));
            free(ob);
            ck_assert_int_eq(st, 200);
        }
        double moved = metric(c.d.port, pages);
        char *again = complete(c.x.port, body, &st);
        free(body);
        ck_assert_int_eq(st, 200);
        ck_assert_msg(metric(c.d.port, pages) == moved,
                      "%s: a's KV moved again though the decode's tier has it", mode);
        ck_assert_msg(metric(c.d.port, "pd:kv_offload_hits_total") >= 6, "%s: no tier hits", mode);
        json_t *ids = json_loads(first, 0, NULL);
        ck_assert_msg(json_array_size(ids) == 4 && strcmp(first, again) == 0, "%s: %s vs %s", mode, first,
                      again);
        json_decref(ids);
        free(first), free(again);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

/* ------------------------------------------------------------------ faults */

/* POSTs body (a JSON object, consumed) to port; returns the HTTP status and the parsed answer. */
static int post_json(int port, json_t *body, json_t **resp_out)
{
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    http_resp_t r;
    int rc =
        http_request(port, "POST", "/v1/completions", "Content-Type: application/json\r\n", text, &r, 60000);
    free(text);
    ck_assert_int_eq(rc, 0);
    int status = r.status;
    *resp_out = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    if (*resp_out == NULL) {
        *resp_out = json_string(r.body);
    }
    http_resp_free(&r);
    return status;
}

/* Prompt i as a JSON body of max_tokens tokens with kv_transfer_params ktp (consumed). */
static json_t *body_with(int i, int max_tokens, json_t *ktp)
{
    char *b = body_for(i, false);
    json_t *j = json_loads(b, 0, NULL);
    free(b);
    json_object_set_new(j, "max_tokens", json_integer(max_tokens));
    json_object_set_new(j, "kv_transfer_params", ktp);
    return j;
}

/* ------------------------------------------------------------------ peer-to-peer prefix fetch */

/* A greedy completion of ids[n] (max_tokens, ignore_eos) with kv_transfer_params ktp (consumed; NULL:
 * none). */
static json_t *ids_req(const int32_t *ids, int n, int max_tokens, json_t *ktp)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) {
        json_array_append_new(a, json_integer(ids[i]));
    }
    json_t *b = json_pack("{s:s, s:o, s:i, s:f, s:b, s:b}", "model", MODEL_NAME, "prompt", a, "max_tokens",
                          max_tokens, "temperature", 0.0, "return_token_ids", 1, "ignore_eos", 1);
    if (ktp != NULL) {
        json_object_set_new(b, "kv_transfer_params", ktp);
    }
    return b;
}

/* The token ids of a completion answer (compact JSON, caller frees), or NULL. */
static char *answer_ids(const json_t *resp)
{
    json_t *ids = json_object_get(json_array_get(json_object_get(resp, "choices"), 0), "token_ids");
    return ids != NULL ? json_dumps(ids, JSON_COMPACT) : NULL;
}

/* Asks port to lend the KV of ids[n] (kv_lend, at least min cached tokens); its status, and its
 * kv_transfer_params (a new reference, or NULL). */
static int lend(int port, const int32_t *ids, int n, int min, const char *tid, json_t **params)
{
    json_t *resp = NULL;
    int st = post_json(port,
                       ids_req(ids, n, 1,
                               json_pack("{s:b, s:b, s:s, s:b, s:i, s:s}", "do_remote_decode", 1,
                                         "do_remote_prefill", 0, "transfer_mode", "pull", "kv_lend", 1,
                                         "kv_lend_min_tokens", min, "transfer_id", tid)),
                       &resp);
    json_t *p = json_object_get(resp, "kv_transfer_params");
    *params = json_is_object(p) ? json_incref(p) : NULL;
    json_decref(resp);
    return st;
}

/* Prompt ids[n] in P/D by hand: the prefill (with kv_prefix when not NULL: consumed) then the decode
 * (pull); the decode's token ids. */
static char *pd_with_prefix(int pport, int dport, const int32_t *ids, int n, json_t *kv_prefix, int want_peer)
{
    json_t *ktp =
        json_pack("{s:b, s:b, s:s}", "do_remote_decode", 1, "do_remote_prefill", 0, "transfer_mode", "pull");
    if (kv_prefix != NULL) {
        json_object_set_new(ktp, "kv_prefix", kv_prefix);
    }
    json_t *resp = NULL;
    int st = post_json(pport, ids_req(ids, n, 1, ktp), &resp);
    ck_assert_msg(st == 200, "prefill: HTTP %d: %s", st,
                  json_string_value(resp) ? json_string_value(resp) : "");
    json_t *dk = json_incref(json_object_get(resp, "kv_transfer_params"));
    json_decref(resp);
    ck_assert_ptr_nonnull(dk);
    /* where the prefill's KV came from: peer tokens read, the rest computed (nothing cached here) */
    json_t *src = json_object_get(dk, "prefix_source");
    ck_assert_msg(json_integer_value(json_object_get(src, "peer")) == want_peer &&
                      json_integer_value(json_object_get(src, "computed")) == n - want_peer,
                  "prefix_source %s, want %d from the peer", json_dumps(src, JSON_COMPACT), want_peer);
    st = post_json(dport, ids_req(ids, n, 8, dk), &resp);
    ck_assert_int_eq(st, 200);
    char *out = answer_ids(resp);
    json_decref(resp);
    ck_assert_ptr_nonnull(out);
    return out;
}

/* Peer-to-peer prefix fetch (kv_transfer_params kv_lend / kv_prefix), in pull- and push-mode clusters
 * (the fetch itself is a read). A decode that computed prompt a lends b's first 49 tokens (a's first
 * 48, its 3 cached blocks, then one token it computes), as pd-proxy asks; a prefill asked to compute
 * b with that lend as kv_prefix reads the 3 blocks (6 pages) instead of computing them, and the
 * answer for b equals pd-serve's. A node that
 * holds less than asked refuses to lend and computes nothing; a lend of another prompt's tokens is
 * refused by the prefill (b computed, nothing read) and released by its transfer id; a lender that
 * stops before the read fails it, and the prompt is recomputed, still right; afterwards every pool is free and
 * no lease is held. */
START_TEST(test_prefix_fetch_by_hand)
{
    int32_t a[97], b[97];
    for (int i = 0; i < 97; i++) {
        a[i] = b[i] = 5 + (i * 7) % 200;
    }
    for (int i = 48; i < 97; i++) {
        b[i] = 9 + (i * 3) % 180;
    }
    int32_t e[113]; /* a's 6 blocks, then others: the prefill will hold only its first 3 */
    memcpy(e, a, sizeof(a));
    for (int i = 97; i < 113; i++) {
        e[i] = 11 + (i * 5) % 170;
    }
    node_t serve;
    start(&serve, "pd-serve", "serve", g_model, NULL);
    json_t *resp = NULL;
    ck_assert_int_eq(post_json(serve.port, ids_req(b, 97, 8, NULL), &resp), 200);
    char *ref = answer_ids(resp);
    json_decref(resp);
    ck_assert_int_eq(post_json(serve.port, ids_req(e, 113, 8, NULL), &resp), 200);
    char *ref_e = answer_ids(resp);
    json_decref(resp);
    stop(&serve);
    const char *pages = "pd:kv_transfer_pages_sum";
    for (int m = 0; m < 2; m++) {
        const char *mode = m == 0 ? "pull" : "push";
        cluster_t c;
        char *fetch[] = {"--kv-prefix-fetch", "always", NULL};
        cluster_start(&c, mode, "tcp", fetch, NULL);
        /* the decode computes a itself (no kv_transfer_params): its pool caches a's 6 full blocks */
        ck_assert_int_eq(post_json(c.d.port, ids_req(a, 97, 4, NULL), &resp), 200);
        json_decref(resp);
        /* the prefill holds none of a: asked to lend 48 cached tokens, it refuses and computes nothing */
        json_t *lent = NULL;
        int st = lend(c.p.port, b, 49, 48, "t-refused", &lent);
        ck_assert_msg(st != 200 && lent == NULL, "%s: a node without the prefix lent it (HTTP %d)", mode, st);
        ck_assert_msg(metric(c.p.port, "pd:kv_blocks_used") == 0, "%s: the refused lend holds blocks", mode);
        /* the decode lends b's first 49 tokens: 3 blocks cached (a's), one it computes */
        st = lend(c.d.port, b, 49, 48, "t-lend-1", &lent);
        ck_assert_msg(st == 200 && lent != NULL, "%s: the decode did not lend (HTTP %d)", mode, st);
        ck_assert_int_eq(json_integer_value(json_object_get(lent, "remote_num_tokens")), 49);
        double held = -1; /* the control thread takes the lease a moment after the answer */
        for (double end = tu_now() + 5;
             tu_now() < end && (held = metric(c.d.port, "pd:kv_leases_held")) != 1;) {
            usleep(20 * 1000);
        }
        ck_assert_msg(held == 1, "%s: the decode holds %.0f leases, want 1", mode, held);
        double p0 = metric(c.p.port, pages);
        char *got = pd_with_prefix(c.p.port, c.d.port, b, 97, lent, 48);
        ck_assert_msg(metric(c.p.port, pages) - p0 == 3 * 2, "%s: the prefill read %.0f pages, want 6", mode,
                      metric(c.p.port, pages) - p0);
        ck_assert_msg(strcmp(got, ref) == 0, "%s: b through a fetched prefix: %s != pd-serve %s", mode, got,
                      ref);
        free(got);
        /* a lend of b's prefix is not another prompt's: the prefill refuses it (signed for b's tokens) */
        int32_t other[97];
        memcpy(other, b, sizeof(other));
        other[3] = 250; /* b with one token of its first block changed */
        st = lend(c.d.port, b, 49, 48, "t-lend-2", &lent);
        ck_assert_int_eq(st, 200);
        double refused = metric(c.p.port, "pd:kv_params_refused_total");
        p0 = metric(c.p.port, pages);
        free(pd_with_prefix(c.p.port, c.d.port, other, 97, lent, 0));
        ck_assert_msg(metric(c.p.port, "pd:kv_params_refused_total") == refused + 1,
                      "%s: a prefix of other tokens was not refused", mode);
        ck_assert_msg(metric(c.p.port, pages) == p0, "%s: the refused prefix was read", mode);
        /* the unread lend is released by its transfer id, as pd-proxy releases one */
        http_resp_t r;
        ck_assert_int_eq(http_request(c.d.port, "POST", "/pd/release", "Content-Type: application/json\r\n",
                                      "{\"transfer_id\": \"t-lend-2\"}", &r, 5000),
                         0);
        ck_assert_msg(r.status == 200 && strstr(r.body, "true") != NULL, "%s: release: %d %s", mode, r.status,
                      r.body);
        http_resp_free(&r);
        /* the lender stops (SIGSTOP, a peer dying as far as anyone can tell) before the prefill reads
         * e's blocks 3..5 (it holds 0..2, a's): the read fails when its heartbeats stop, the failure
         * policy recomputes e on the prefill, and once the decode runs again its answer is pd-serve's */
        st = lend(c.d.port, e, 97, 96, "t-lend-3", &lent);
        ck_assert_int_eq(st, 200);
        const char *recomputed = "pd:kv_load_failure_policy_actions_total{policy=\"recompute\"}";
        double rc0 = metric(c.p.port, recomputed);
        kill(c.d.pid, SIGSTOP);
        json_t *ktp = json_pack("{s:b, s:b, s:s, s:o}", "do_remote_decode", 1, "do_remote_prefill", 0,
                                "transfer_mode", "pull", "kv_prefix", lent);
        st = post_json(c.p.port, ids_req(e, 113, 1, ktp), &resp);
        kill(c.d.pid, SIGCONT);
        ck_assert_msg(st == 200, "%s: the prefill failed with its lender stopped: %d", mode, st);
        ck_assert_msg(metric(c.p.port, recomputed) == rc0 + 1, "%s: the failed read was not recomputed",
                      mode);
        json_t *dk = json_incref(json_object_get(resp, "kv_transfer_params"));
        json_decref(resp);
        ck_assert_int_eq(post_json(c.d.port, ids_req(e, 113, 8, dk), &resp), 200);
        got = answer_ids(resp);
        json_decref(resp);
        ck_assert_msg(got != NULL && strcmp(got, ref_e) == 0, "%s: e after a failed fetch: %s != pd-serve %s",
                      mode, got, ref_e);
        free(got);
        ck_assert_int_eq(http_request(c.d.port, "POST", "/pd/release", "Content-Type: application/json\r\n",
                                      "{\"transfer_id\": \"t-lend-3\"}", &r, 5000),
                         0);
        http_resp_free(&r);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        ck_assert_int_eq(metric(c.d.port, "pd:kv_leases_held"), 0);
        cluster_stop(&c);
    }
    free(ref), free(ref_e);
}
END_TEST

/* The token ids of a completion of ids[n] (max_tokens; greedy, or seeded sampling) through port;
 * *len_out: how many. */
static int32_t *complete_ids(int port, const int32_t *ids, int n, int max_tokens, bool seeded, int *len_out)
{
    json_t *resp = NULL, *body = ids_req(ids, n, max_tokens, NULL);
    if (seeded) {
        json_object_set_new(body, "temperature", json_real(0.9));
        json_object_set_new(body, "top_p", json_real(0.95));
        json_object_set_new(body, "seed", json_integer(1234));
    }
    int st = post_json(port, body, &resp);
    ck_assert_msg(st == 200, "HTTP %d on :%d", st, port);
    json_t *a = json_object_get(json_array_get(json_object_get(resp, "choices"), 0), "token_ids");
    int k = (int)json_array_size(a);
    int32_t *out = malloc((size_t)(k > 0 ? k : 1) * sizeof(int32_t));
    for (int i = 0; i < k; i++) {
        out[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    }
    json_decref(resp);
    *len_out = k;
    return out;
}

/* Sends a pull prefill directly and returns its kv_transfer_params (JSON text). */
static char *prefill_only(int port, int i)
{
    json_t *resp = NULL;
    ck_assert_int_eq(post_json(port, body_with(i, 1, json_pack("{s:b}", "do_remote_decode", 1)), &resp), 200);
    char *ktp = json_dumps(json_object_get(resp, "kv_transfer_params"), JSON_COMPACT);
    json_decref(resp);
    ck_assert_ptr_nonnull(ktp);
    return ktp;
}

/* Sends prompt i to a decode node directly with the given kv_transfer_params. */
static char *decode_with(int port, int i, const char *ktp, int *status)
{
    char *b = body_for(i, false);
    json_t *j = json_loads(b, 0, NULL);
    free(b);
    json_object_set_new(j, "kv_transfer_params", json_loads(ktp, 0, NULL));
    char *body = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    char *out = complete(port, body, status);
    free(body);
    return out;
}

START_TEST(test_prefill_gone_before_read)
{
    cluster_t c;
    char *fail[] = {"--kv-load-failure-policy", "fail", NULL};
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    node_t d2;
    char *d2a[] = {"--kv-transfer-mode", "pull", "--kv-pipe", "tcp", FAST_TIMEOUTS, fail[0], fail[1], NULL};
    start(&d2, "pd-decode", "decode-fail", g_model, d2a);
    char *ktp1 = prefill_only(c.p.port, 20);
    char *ktp2 = prefill_only(c.p.port, 21);
    kill(c.p.pid, SIGKILL);
    waitpid(c.p.pid, NULL, 0);
    c.p.pid = -1;
    int st;
    double t0 = tu_now();
    char *got = decode_with(c.d.port, 20, ktp1, &st); /* recompute: same answer */
    ck_assert_msg(got != NULL && strcmp(got, g_ref[0][20]) == 0, "recompute gave %s (HTTP %d)", got, st);
    ck_assert_msg(tu_now() - t0 < 10, "recovery took %.1f s", tu_now() - t0);
    free(got);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_load_failure_policy_actions_total{policy=\"recompute\"}"),
                     1);
    got = decode_with(d2.port, 21, ktp2, &st); /* policy fail: the client sees an error */
    ck_assert_ptr_null(got);
    ck_assert_msg(st == 200 || st >= 500, "HTTP %d", st);
    assert_pool_free(c.d.port, "the decode");
    assert_pool_free(d2.port, "the failing decode");
    free(ktp1), free(ktp2);
    stop(&d2);
    cluster_stop(&c);
}
END_TEST

START_TEST(test_lease_expiry_is_stale)
{
    cluster_t c;
    char *pe[] = {"--kv-hold-timeout", "0.3", NULL};
    cluster_start(&c, "pull", "tcp", pe, NULL);
    char *ktp = prefill_only(c.p.port, 30);
    usleep(900 * 1000); /* the lease expires; the prefill frees the blocks */
    assert_pool_free(c.p.port, "the prefill");
    int st;
    char *got = decode_with(c.d.port, 30, ktp, &st);
    ck_assert_msg(got != NULL && strcmp(got, g_ref[0][30]) == 0, "after STALE: %s (HTTP %d)", got, st);
    free(got);
    free(ktp);
    ck_assert_int_eq((int)metric(c.p.port, "pd:kv_leases_expired_total"), 1);
    ck_assert_int_eq((int)metric(c.p.port, "pd:kv_stale_reads_total"), 1);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"pull_load\"}"), 1);
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

START_TEST(test_wrong_token_and_other_model_recompute)
{
    char tok_a[600], tok_b[600];
    snprintf(tok_a, sizeof(tok_a), "%s/token-a", g_dir);
    snprintf(tok_b, sizeof(tok_b), "%s/token-b", g_dir);
    ck_assert_int_eq(tu_write_file(tok_a, "secret-a\n", 9), 0);
    ck_assert_int_eq(tu_write_file(tok_b, "secret-b\n", 9), 0);
    for (int which = 0; which < 2; which++) {
        cluster_t c;
        memset(&c, 0, sizeof(c));
        /* nobody can read the prefill's KV: it frees its blocks when the (short) leases end */
        char *pa[] = {"--kv-transfer-mode",   "pull", "--kv-pipe",         "tcp", FAST_TIMEOUTS,
                      "--cluster-token-file", tok_b,  "--kv-hold-timeout", "1",   NULL};
        char *da[] = {"--kv-transfer-mode",   "pull", "--kv-pipe",         "tcp", FAST_TIMEOUTS,
                      "--cluster-token-file", tok_a,  "--kv-hold-timeout", "1",   NULL};
        /* 0: same model, wrong token; 1: right token, different model */
        start(&c.p, "pd-prefill", "prefill", which == 0 ? g_model : g_model2, which == 0 ? pa : da);
        start(&c.d, "pd-decode", "decode", g_model, da);
        start_proxy(&c, "round-robin");
        for (int i = 0; i < 3; i++) {
            expect_same(c.x.port, i + 10, false);
        }
        /* another token: the prefill's signature does not verify, so the decode dials nothing; another
         * model: the handshake refuses it */
        ck_assert_int_ge((int)metric(c.d.port, which == 0 ? "pd:kv_params_refused_total"
                                                          : "pd:kv_handshakes_total{result=\"failed\"}"),
                         1);
        ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_completed_total{kind=\"pull_load\"}"), 0);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

typedef struct load_arg {
    int port, first, n, ok, errors, wrong;
} load_arg_t;

static void *load_thread(void *arg)
{
    load_arg_t *a = arg;
    for (int k = 0; k < a->n; k++) {
        int i = (a->first + k) % NUM_PROMPTS;
        char *b = body_for(i, false);
        int st;
        char *got = complete(a->port, b, &st);
        free(b);
        if (got == NULL) {
            a->errors += st >= 500 ? 1 : 100; /* a clean 5xx, or something worse */
        } else {
            a->ok++;
            a->wrong += strcmp(got, g_ref[0][i]) != 0;
        }
        free(got);
    }
    return NULL;
}

/* A prefill that stalls past the heartbeat timeout (SIGSTOP: a swap storm, a debugger, a VM
 * pause) is declared dead by the decode; when it runs again both sides handshake again and KV
 * moves over the pipe once more, over the same pipe addresses (no recompute fallback): tcp in
 * both modes, ucx. */
START_TEST(test_stalled_prefill_reconnects)
{
    static const char *pipes[] = {"tcp", "tcp", "ucx"}, *modes[] = {"pull", "push", "pull"};
    for (int pi = 0; pi < 3; pi++) {
        cluster_t c;
        cluster_start(&c, modes[pi], pipes[pi], NULL, NULL);
        const char *done = strcmp(modes[pi], "pull") == 0
                               ? "pd:kv_transfers_completed_total{kind=\"pull_load\"}"
                               : "pd:kv_transfers_completed_total{kind=\"push_load\"}";
        expect_same(c.x.port, 0, false);
        ck_assert_int_eq((int)metric(c.d.port, done), 1);
        kill(c.p.pid, SIGSTOP);
        /* 5 missed heartbeats of 0.2 s: the decode declares it dead */
        double peers_stalled = -1;
        for (double end = tu_now() + 5; peers_stalled != 0 && tu_now() < end;) {
            usleep(50 * 1000);
            peers_stalled = metric(c.d.port, "pd:kv_peers");
        }
        usleep(300 * 1000); /* the prefill stays stopped past its own deadline for the decode too */
        kill(c.p.pid, SIGCONT);
        /* the proxy also marked the prefill unhealthy: it answers 503 until a probe passes */
        int st = 503, answered = 0;
        for (double end = tu_now() + 15; st == 503 && tu_now() < end;) {
            char *b = body_for(1, false);
            char *got = complete(c.x.port, b, &st);
            answered += got != NULL && strcmp(got, g_ref[0][1]) == 0;
            free(b), free(got);
            if (st == 503) {
                usleep(200 * 1000);
            }
        }
        ck_assert_msg(answered == 1, "%s/%s: no right answer after the stall (HTTP %d)", modes[pi], pipes[pi],
                      st);
        for (int i = 2; i <= 4; i++) {
            expect_same(c.x.port, i, false);
        }
        double moved = metric(c.d.port, done);
        ck_assert_msg(peers_stalled == 0, "%s/%s: the decode still counted %.0f ready peers during the stall",
                      modes[pi], pipes[pi], peers_stalled);
        ck_assert_msg(moved == 5, "%s/%s: %.0f of 5 requests moved KV over the pipe", modes[pi], pipes[pi],
                      moved);
        assert_pool_free(c.p.port, "the prefill");
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

START_TEST(test_prefill_killed_under_load)
{
    for (int m = 0; m < 2; m++) {
        cluster_t c;
        cluster_start(&c, m == 0 ? "pull" : "push", "tcp", NULL, NULL);
        load_arg_t a[4];
        pthread_t th[4];
        for (int t = 0; t < 4; t++) {
            a[t] = (load_arg_t){c.x.port, t * 16, 16, 0, 0, 0};
            pthread_create(&th[t], NULL, load_thread, &a[t]);
        }
        usleep(150 * 1000);
        kill(c.p.pid, SIGKILL); /* mid-flight: some requests are prefilling, loading or decoding */
        waitpid(c.p.pid, NULL, 0);
        c.p.pid = -1;
        int ok = 0, err = 0, wrong = 0;
        for (int t = 0; t < 4; t++) {
            pthread_join(th[t], NULL);
            ok += a[t].ok, err += a[t].errors, wrong += a[t].wrong;
        }
        ck_assert_msg(err < 100, "a request ended in something other than an answer or a clean 5xx");
        ck_assert_msg(wrong == 0, "%d completed answers differ from pd-serve's", wrong);
        ck_assert_msg(ok + err == 64, "%d answers + %d errors", ok, err);
        assert_pool_free(c.d.port, "the decode");
        cluster_stop(&c);
    }
}
END_TEST

/* A process's resident memory in KiB (-1 when unreadable). */
static long rss_kib_of(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "VmRSS:", 6) == 0) {
            v = atol(line + 6);
        }
    }
    if (f != NULL) {
        fclose(f);
    }
    return v;
}

/* Prompt i by hand, no proxy: the prefill's answer's kv_transfer_params go to the decode, whose
 * answer must equal pd-serve's (mode: the transfer_mode the prefill is asked for, or NULL for the
 * node's own). */
static void pd_by_hand(int pport, int dport, int i, const char *mode)
{
    char *b = body_for(i, false);
    json_t *j = json_loads(b, 0, NULL);
    free(b);
    json_object_set_new(j, "max_tokens", json_integer(1));
    json_t *pk = json_pack("{s:b}", "do_remote_decode", 1);
    if (mode != NULL) {
        json_object_set_new(pk, "transfer_mode", json_string(mode));
    }
    json_object_set_new(j, "kv_transfer_params", pk);
    char *body = json_dumps(j, JSON_COMPACT);
    http_resp_t r;
    ck_assert_int_eq(
        http_request(pport, "POST", "/v1/completions", "Content-Type: application/json\r\n", body, &r, 60000),
        0);
    ck_assert_int_eq(r.status, 200);
    json_t *pr = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    free(body);
    json_t *ktp = json_object_get(pr, "kv_transfer_params");
    ck_assert_ptr_nonnull(ktp);
    json_object_set_new(j, "max_tokens", json_integer(MAX_TOKENS));
    json_object_set(j, "kv_transfer_params", ktp);
    body = json_dumps(j, JSON_COMPACT);
    int st;
    char *got = complete(dport, body, &st);
    ck_assert_msg(got != NULL && strcmp(got, g_ref[0][i]) == 0, "prompt %d by hand: HTTP %d", i, st);
    free(got), free(body);
    json_decref(pr), json_decref(j);
}

/* A node serves a request in the role it plays only: a decode asked to prefill for another
 * (do_remote_decode: a restarted proxy that did not know the pool's mode yet sent the prefill's
 * echoed push parameters on to a decode, which prefilled and "handed over" with none) and a prefill
 * asked to load answer 400. A request that names its mode runs in it: pull on push nodes. */
START_TEST(test_roles_refused_and_named_mode)
{
    cluster_t c;
    cluster_start(&c, "push", "tcp", NULL, NULL);
    const char *bodies[2] = {
        "{\"prompt\": [5, 6, 7], \"max_tokens\": 2, \"kv_transfer_params\": {\"do_remote_decode\": true, "
        "\"first_token\": true, \"transfer_mode\": \"push\", \"transfer_id\": \"xfer-1\"}}",
        "{\"prompt\": [5, 6, 7], \"max_tokens\": 2, \"kv_transfer_params\": {\"do_remote_prefill\": true, "
        "\"remote_host\": \"127.0.0.1\", \"remote_port\": 9, \"transfer_mode\": \"pull\", "
        "\"remote_request_id\": \"r\", \"remote_block_ids\": [0], \"remote_num_tokens\": 3}}"};
    const int ports[2] = {c.d.port, c.p.port};
    const char *role[2] = {"kv_consumer", "kv_producer"};
    for (int k = 0; k < 2; k++) {
        http_resp_t r;
        ck_assert_int_eq(http_request(ports[k], "POST", "/v1/completions",
                                      "Content-Type: application/json\r\n", bodies[k], &r, 10000),
                         0);
        ck_assert_msg(r.status == 400 && strstr(r.body, role[k]) != NULL, "%s: HTTP %d %s", role[k], r.status,
                      r.body);
        http_resp_free(&r);
    }
    pd_by_hand(c.p.port, c.d.port, 3, "pull");
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_completed_total{kind=\"pull_load\"}"), 1);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_started_total{kind=\"push_load\"}"), 0);
    assert_pool_free(c.p.port, "prefill");
    assert_pool_free(c.d.port, "decode");
    cluster_stop(&c);
}
END_TEST

/* Issue 51's KV poisoning, as a client with the API would try it against the nodes directly, with a
 * cluster token: prompt B's pull params (from a prefill, asked with do_remote_decode) sent to the
 * decode with prompt A, and A's own params with another request's block id, are not used (the
 * decode computes A itself, pd:kv_params_refused_total) instead of loading B's KV as A's, which the
 * decode then cached: the victim's A through the proxy answered wrongly, 3 of 3. A push transfer id
 * shared by B on the prefill and A on the decode loads nothing either (the decode recomputes A).
 * Every answer equals pd-serve's, the victim's through the proxy too (twice: the second a prefix hit
 * on what the decode cached). */
START_TEST(test_kv_params_from_clients_refused)
{
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL); /* with the suite's cluster token */
    const int A = 19; /* 128 tokens; B: A with another last token (the same length, 7 shared blocks) */
    json_t *bb = body_with(A, 1, json_pack("{s:b}", "do_remote_decode", 1));
    json_t *bp = json_object_get(bb, "prompt");
    json_array_set_new(bp, 127, json_integer(json_integer_value(json_array_get(bp, 127)) == 5 ? 6 : 5));
    json_t *pb = NULL, *resp = NULL;
    ck_assert_int_eq(post_json(c.p.port, json_deep_copy(bb), &pb), 200);
    json_t *ktp_b = json_object_get(pb, "kv_transfer_params");
    ck_assert(json_is_string(json_object_get(ktp_b, "pd_sig")));
    json_t *pa = NULL;
    ck_assert_int_eq(post_json(c.p.port, body_with(A, 1, json_pack("{s:b}", "do_remote_decode", 1)), &pa),
                     200);
    json_t *ktp_a = json_deep_copy(json_object_get(pa, "kv_transfer_params"));
    json_array_set(json_object_get(ktp_a, "remote_block_ids"), 0,
                   json_array_get(json_object_get(ktp_b, "remote_block_ids"), 7)); /* B's own last block */
    json_t *attempts[3] = {
        json_deep_copy(ktp_b), /* B's params with A */
        ktp_a,                 /* A's own with one of B's blocks */
        json_pack("{s:b, s:s, s:s, s:s, s:i}", "do_remote_prefill", 1, "transfer_mode", "push", "transfer_id",
                  "poison-1", "remote_host", "127.0.0.1", "remote_port", kv_port_of(c.p.port)),
    };
    json_t *pp = NULL; /* push: B waits on the prefill under the transfer id A's decode request names */
    json_object_set_new(bb, "kv_transfer_params",
                        json_pack("{s:b, s:s, s:s}", "do_remote_decode", 1, "transfer_mode", "push",
                                  "transfer_id", "poison-1"));
    ck_assert_int_eq(post_json(c.p.port, bb, &pp), 200);
    json_decref(pp);
    for (int k = 0; k < 3; k++) {
        int st = post_json(c.d.port, body_with(A, MAX_TOKENS, attempts[k]), &resp);
        ck_assert_int_eq(st, 200);
        char *ids = json_dumps(
            json_object_get(json_array_get(json_object_get(resp, "choices"), 0), "token_ids"), JSON_COMPACT);
        ck_assert_msg(strcmp(ids, g_ref[0][A]) == 0, "attempt %d: %s != pd-serve %s", k, ids, g_ref[0][A]);
        free(ids), json_decref(resp);
    }
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_params_refused_total"), 2);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_started_total{kind=\"pull_load\"}"), 0);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_failed_total{kind=\"push_load\"}"), 1);
    /* the victim: A through the proxy, twice */
    expect_same(c.x.port, A, false);
    expect_same(c.x.port, A, false);
    json_decref(pb), json_decref(pa);
    cluster_stop(&c); /* the prefill's held leases would end at --kv-hold-timeout */
}
END_TEST

/* Decodes that die (SIGKILL) and come back leave nothing behind on the prefill: each death used to
 * keep the dead decode's whole KV region mapped through its UCX rkey (+235 MiB per death with 256M
 * of KV), and every pipe kept the dead peer's endpoint and record. Prefill RSS and fds stay flat
 * over three deaths, and every new decode still moves its KV. */
START_TEST(test_decode_deaths_release_prefill_memory)
{
    static const char *pipes[] = {"ucx", "tcp"};
    for (int pi = 0; pi < 2; pi++) {
        char *common[] = {"--kv-transfer-mode", "pull", "--kv-pipe", (char *)pipes[pi], FAST_TIMEOUTS, NULL};
        cluster_t c;
        memset(&c, 0, sizeof(c));
        start(&c.p, "pd-prefill", "prefill", g_model, common);
        long rss0 = -1;
        int fds0 = -1;
        for (int round = 0; round < 4; round++) {
            start(&c.d, "pd-decode", "decode", g_model, common);
            pd_by_hand(c.p.port, c.d.port, 20 + round, NULL);
            kill(c.d.pid, SIGKILL);
            waitpid(c.d.pid, NULL, 0);
            c.d.pid = -1;
            for (double end = tu_now() + 5; metric(c.p.port, "pd:kv_peers") != 0 && tu_now() < end;) {
                usleep(50 * 1000);
            }
            usleep(300 * 1000); /* the dead peer's records are swept on the next ticks */
            char dir[64];
            snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)c.p.pid);
            int fds = tu_count_entries(dir);
            long rss = rss_kib_of(c.p.pid);
            if (round == 0) {
                rss0 = rss, fds0 = fds;
            } else {
                ck_assert_msg(fds == fds0, "%s: the prefill has %d fds after %d decode deaths, %d after one",
                              pipes[pi], fds, round + 1, fds0);
                ck_assert_msg(rss - rss0 < 32 * 1024, "%s: the prefill grew %ld KiB over %d decode deaths",
                              pipes[pi], rss - rss0, round);
            }
        }
        assert_pool_free(c.p.port, "the prefill");
        cluster_stop(&c);
    }
}
END_TEST

START_TEST(test_decode_killed_holding_reservation)
{
    cluster_t c;
    cluster_start(&c, "push", "tcp", NULL, NULL);
    /* the decode reserves blocks and sends the reservation; then it dies */
    char *b = body_for(40, false);
    json_t *j = json_loads(b, 0, NULL);
    free(b);
    json_t *pinfo = NULL;
    http_resp_t r;
    ck_assert_int_eq(http_request(c.p.port, "GET", "/pd/info", NULL, NULL, &r, 5000), 0);
    pinfo = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    json_object_set_new(j, "kv_transfer_params",
                        json_pack("{s:b, s:s, s:s, s:O, s:O}", "do_remote_prefill", 1, "transfer_mode",
                                  "push", "transfer_id", "xfer-test-1", "remote_host",
                                  json_object_get(pinfo, "kv_host"), "remote_port",
                                  json_object_get(pinfo, "kv_port")));
    char *body = json_dumps(j, JSON_COMPACT);
    int fd = http_send(c.d.port, "POST", "/v1/completions", "Content-Type: application/json\r\n", body,
                       strlen(body), 5000);
    ck_assert_int_ge(fd, 0);
    usleep(400 * 1000);
    kill(c.d.pid, SIGKILL);
    waitpid(c.d.pid, NULL, 0);
    c.d.pid = -1;
    close(fd);
    /* the prefill request for that transfer finishes and must not hold its blocks */
    json_object_set_new(j, "max_tokens", json_integer(1));
    json_object_set_new(j, "kv_transfer_params",
                        json_pack("{s:b, s:s, s:s}", "do_remote_decode", 1, "transfer_mode", "push",
                                  "transfer_id", "xfer-test-1"));
    free(body);
    body = json_dumps(j, JSON_COMPACT);
    int st;
    free(complete(c.p.port, body, &st));
    ck_assert_int_eq(st, 200);
    assert_pool_free(c.p.port, "the prefill");
    free(body);
    json_decref(j);
    json_decref(pinfo);
    cluster_stop(&c);
}
END_TEST

/* ------------------------------------------------------------------ the proxy */

/* Proxy over two prefills and one decode. */
typedef struct pool2 {
    node_t p[2], d, x;
} pool2_t;

static void pool2_start(pool2_t *c, const char *policy)
{
    memset(c, 0, sizeof(*c));
    bool kv = strcmp(policy, "kv-aware") == 0; /* the nodes publish their KV cache events */
    char *a[] = {
        "--kv-transfer-mode", "pull", "--kv-pipe", "tcp", FAST_TIMEOUTS, kv ? "--kv-events-config" : NULL,
        EVENTS_CFG,           NULL};
    start(&c->p[0], "pd-prefill", "prefill0", g_model, a);
    start(&c->p[1], "pd-prefill", "prefill1", g_model, a);
    start(&c->d, "pd-decode", "decode", g_model, a);
    char pre[160], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d,http://127.0.0.1:%d", c->p[0].port, c->p[1].port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c->d.port);
    char *x[] = {"--prefill", pre,        "--decode",     dec, "--health-interval",
                 "0.2",       "--policy", (char *)policy, NULL};
    start(&c->x, "pd-proxy", "proxy", NULL, x);
    usleep(600 * 1000);
}

static void pool2_stop(pool2_t *c)
{
    stop(&c->x);
    stop(&c->d);
    stop(&c->p[1]);
    stop(&c->p[0]);
}

static double served(int port)
{
    return metric(port, "vllm:request_success_total{finished_reason=\"length\"}");
}

/* Through pd-proxy (--pd-prefix-fetch-min-blocks 1, round-robin over 2 prefills, every node
 * publishing its KV events), pull and push: turn 2 of a conversation (turn 1, its 40-token answer,
 * 10 new tokens) goes to a prefill; the decode that produced turn 1's answer holds its blocks (6),
 * more than either prefill, so it lends them and that prefill reads them instead of computing them.
 * Both turns equal pd-serve's answers (turn 1 greedy, turn 2 seeded sampling); afterwards every pool is free and the decode holds no lease. */
START_TEST(test_prefix_fetch_through_proxy)
{
    int32_t t[128];
    for (int i = 0; i < 60; i++) {
        t[i] = 4 + (i * 13) % 230;
    }
    node_t serve;
    start(&serve, "pd-serve", "serve", g_model, NULL);
    int n1 = 0, n2 = 0;
    int32_t *ref1 = complete_ids(serve.port, t, 60, 40, false, &n1);
    ck_assert_int_eq(n1, 40);
    memcpy(t + 60, ref1, 40 * sizeof(int32_t));
    for (int i = 100; i < 110; i++) {
        t[i] = 7 + (i * 5) % 200;
    }
    int32_t *ref2 = complete_ids(serve.port, t, 110, 8, true, &n2);
    stop(&serve);
    for (int m = 0; m < 2; m++) {
        const char *mode = m == 0 ? "pull" : "push";
        pool2_t c;
        memset(&c, 0, sizeof(c));
        char *a[] = {"--kv-transfer-mode", (char *)mode, "--kv-pipe",         "tcp",    FAST_TIMEOUTS,
                     "--kv-events-config", EVENTS_CFG,   "--kv-prefix-fetch", "always", NULL};
        start(&c.p[0], "pd-prefill", "prefill0", g_model, a);
        start(&c.p[1], "pd-prefill", "prefill1", g_model, a);
        start(&c.d, "pd-decode", "decode", g_model, a);
        char pre[160], dec[64];
        snprintf(pre, sizeof(pre), "http://127.0.0.1:%d,http://127.0.0.1:%d", c.p[0].port, c.p[1].port);
        snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c.d.port);
        char *x[] = {"--prefill",
                     pre,
                     "--decode",
                     dec,
                     "--health-interval",
                     "0.2",
                     "--policy",
                     "round-robin",
                     "--pd-prefix-fetch-min-blocks",
                     "1",
                     NULL};
        start(&c.x, "pd-proxy", "proxy", NULL, x);
        usleep(600 * 1000);
        int k1 = 0, k2 = 0;
        int32_t *got1 = complete_ids(c.x.port, t, 60, 40, false, &k1);
        ck_assert_msg(k1 == 40 && memcmp(got1, ref1, sizeof(int32_t) * 40) == 0, "%s: turn 1 differs", mode);
        /* the decode computed turn 1's answer: 99 tokens' KV, 6 full blocks, in its events */
        ck_assert_msg(await_blocks(c.x.port, c.d.port, 6, false) >= 6,
                      "%s: the decode's blocks are not indexed", mode);
        await_transfers_ended(c.p[0].port, "prefill 0");
        await_transfers_ended(c.p[1].port, "prefill 1");
        double pages0 =
            metric(c.p[0].port, "pd:kv_transfer_pages_sum") + metric(c.p[1].port, "pd:kv_transfer_pages_sum");
        int32_t *got2 = complete_ids(c.x.port, t, 110, 8, true, &k2);
        ck_assert_msg(k2 == n2 && memcmp(got2, ref2, sizeof(int32_t) * (size_t)n2) == 0,
                      "%s: turn 2 through a fetched prefix differs from pd-serve's", mode);
        double pages = metric(c.p[0].port, "pd:kv_transfer_pages_sum") +
                       metric(c.p[1].port, "pd:kv_transfer_pages_sum") - pages0;
        ck_assert_msg(metric(c.x.port, "pd_proxy:prefix_fetches_total{result=\"lent\"}") == 1,
                      "%s: no lend was asked of the decode", mode);
        /* the prefill held 0 or 3 of turn 2's blocks (which one got it) and read the rest of the 6 in
         * one load (push: it also wrote the 7th block to the decode) */
        const char *loads = "pd:kv_transfer_phase_seconds_count{phase=\"transfer\"}"; /* reads it made */
        ck_assert_msg(metric(c.p[0].port, loads) + metric(c.p[1].port, loads) == 1, "%s: no prefix load",
                      mode);
        ck_assert_msg(pages - (m == 1 ? 2 : 0) == 6 * 2 || pages - (m == 1 ? 2 : 0) == 3 * 2,
                      "%s: the prefills moved %.0f pages", mode, pages);
        free(got1), free(got2);
        assert_pool_free(c.p[0].port, "prefill 0");
        assert_pool_free(c.p[1].port, "prefill 1");
        assert_pool_free(c.d.port, "the decode");
        ck_assert_int_eq(metric(c.d.port, "pd:kv_leases_held"), 0);
        pool2_stop(&c);
    }
    free(ref1), free(ref2);
}
END_TEST

START_TEST(test_proxy_prefix_affinity_and_failover)
{
    pool2_t c;
    pool2_start(&c, "prefix-affinity");
    for (int k = 0; k < 6; k++) {
        expect_same(c.x.port, 50, false); /* one prompt: one prefill serves it every time */
    }
    double a = served(c.p[0].port), b = served(c.p[1].port);
    ck_assert_msg((a == 6 && b == 0) || (a == 0 && b == 6), "prefix-affinity split one prompt %g/%g", a, b);
    for (int i = 0; i < 16; i++) {
        expect_same(c.x.port, i, false); /* different prompts spread over both */
    }
    ck_assert_msg(served(c.p[0].port) > a && served(c.p[1].port) > b, "16 prompts all went to one prefill");
    /* kill the prefill that owns prompt 50: its requests fail over to the other */
    int victim = a == 6 ? 0 : 1;
    kill(c.p[victim].pid, SIGKILL);
    waitpid(c.p[victim].pid, NULL, 0);
    c.p[victim].pid = -1;
    for (int k = 0; k < 3; k++) {
        expect_same(c.x.port, 50, false);
    }
    usleep(800 * 1000);
    char series[160];
    snprintf(series, sizeof(series), "pd_proxy:node_healthy{node=\"prefill http://127.0.0.1:%d\"}",
             c.p[victim].port);
    ck_assert_msg(metric(c.x.port, series) == 0, "the dead prefill is not marked unhealthy");
    ck_assert_int_ge((int)metric(c.x.port, "pd_proxy:requests_total{result=\"ok\"}"), 6 + 16 + 3);
    assert_pool_free(c.p[1 - victim].port, "the surviving prefill");
    assert_pool_free(c.d.port, "the decode");
    pool2_stop(&c);
}
END_TEST

/* A greedy completion of a 344-token text prompt (21 full blocks) (streamed or not), with its token ids. */
static char *long_text_body(bool stream)
{
    char prompt[2048];
    size_t n = 0;
    for (int w = 0; w < 60; w++) {
        n += (size_t)snprintf(prompt + n, sizeof(prompt) - n, "%sword%d", w ? " " : "", w * 7);
    }
    json_t *b =
        json_pack("{s:s, s:s, s:i, s:f, s:b, s:b}", "model", MODEL_NAME, "prompt", prompt, "max_tokens",
                  MAX_TOKENS, "temperature", 0.0, "return_token_ids", 1, "stream", stream);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* --policy kv-aware: a prompt goes to the prefill whose KV cache events say it holds the prompt's
 * blocks (all nodes idle, so the load ties); prompts nobody holds spread by the load's rotation;
 * when that prefill dies, the index still names it but the proxy fails over and answers right. */
START_TEST(test_proxy_kv_aware)
{
    pool2_t c;
    pool2_start(&c, "kv-aware");
    expect_same(c.x.port, 19, false); /* 128 tokens: 8 full blocks */
    char s0[128], s1[128];
    snprintf(s0, sizeof(s0), "pd_proxy:kv_index_blocks{node=\"http://127.0.0.1:%d\"}", c.p[0].port);
    snprintf(s1, sizeof(s1), "pd_proxy:kv_index_blocks{node=\"http://127.0.0.1:%d\"}", c.p[1].port);
    double end = tu_now() + 10;
    while (metric(c.x.port, s0) + metric(c.x.port, s1) < 8 && tu_now() < end) {
        usleep(50 * 1000);
    }
    int owner = metric(c.x.port, s0) >= 8 ? 0 : 1;
    ck_assert_msg(metric(c.x.port, owner == 0 ? s0 : s1) >= 8, "the index never learnt prompt 19's blocks");
    double a = served(c.p[owner].port), b = served(c.p[1 - owner].port);
    for (int k = 0; k < 5; k++) {
        expect_same(c.x.port, 19, false);
    }
    ck_assert_msg(served(c.p[owner].port) == a + 5 && served(c.p[1 - owner].port) == b,
                  "kv-aware sent the cached prompt elsewhere: %g/%g -> %g/%g", a, b, served(c.p[owner].port),
                  served(c.p[1 - owner].port));
    for (int i = 20; i < 28; i++) {
        expect_same(c.x.port, i, false); /* fresh prompts: both prefills get some */
    }
    ck_assert_msg(served(c.p[owner].port) > a + 5 && served(c.p[1 - owner].port) > b,
                  "8 fresh prompts all went to one prefill");
    /* a text prompt: tokenized through a node's /tokenize, then routed by its blocks as token ids are */
    char *tb = long_text_body(false);
    double t0 = served(c.p[0].port), w[2] = {metric(c.x.port, s0), metric(c.x.port, s1)};
    int st;
    free(complete(c.x.port, tb, &st));
    ck_assert_int_eq(st, 200);
    int town = served(c.p[0].port) > t0 ? 0 : 1;
    double before = served(c.p[town].port);
    await_blocks(c.x.port, c.p[town].port, w[town] + 21, false);
    double other = served(c.p[1 - town].port);
    for (int k = 0; k < 3; k++) {
        free(complete(c.x.port, tb, &st));
        ck_assert_int_eq(st, 200);
    }
    ck_assert_msg(served(c.p[town].port) == before + 3 && served(c.p[1 - town].port) == other,
                  "kv-aware sent a cached text prompt elsewhere (%g/%g of 3 went to its prefill)",
                  served(c.p[town].port) - before, served(c.p[1 - town].port) - other);
    free(tb);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:tokenize_failures_total"), 0);
    kill(c.p[owner].pid, SIGKILL); /* the index still names it */
    waitpid(c.p[owner].pid, NULL, 0);
    c.p[owner].pid = -1;
    for (int k = 0; k < 3; k++) {
        expect_same(c.x.port, 19, false);
    }
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:kv_events_malformed_total"), 0);
    assert_pool_free(c.p[1 - owner].port, "the surviving prefill");
    assert_pool_free(c.d.port, "the decode");
    pool2_stop(&c);
}
END_TEST

/* Round-robin over two decodes with --pd-local-prefill-threshold: the local-prefill rule only looks
 * at the decode the policy would pick, so six fresh long prompts (all disaggregated) still split
 * 3/3 over the decodes (the rule once advanced the rotation a second time per request and sent
 * every one to the same decode), and the short ones that stay local alternate too. */
START_TEST(test_proxy_local_prefill_round_robin)
{
    char *a[] = {"--kv-transfer-mode", "pull",     "--kv-pipe", "tcp", FAST_TIMEOUTS,
                 "--kv-events-config", EVENTS_CFG, NULL};
    node_t p, d[2], x;
    start(&p, "pd-prefill", "prefill", g_model, a);
    start(&d[0], "pd-decode", "decode0", g_model, a);
    start(&d[1], "pd-decode", "decode1", g_model, a);
    char pre[64], dec[160];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d,http://127.0.0.1:%d", d[0].port, d[1].port);
    char *xa[] = {
        "--prefill", pre, "--decode", dec, "--health-interval", "0.2", "--pd-local-prefill-threshold",
        "24",        NULL};
    start(&x, "pd-proxy", "proxy-rr-local", NULL, xa);
    usleep(600 * 1000);             /* the first probe round subscribes */
    for (int i = 14; i < 20; i++) { /* 64..128 tokens, none cached: remote */
        expect_same(x.port, i, false);
    }
    ck_assert_int_eq((int)served(p.port), 6);
    ck_assert_msg(served(d[0].port) == 3 && served(d[1].port) == 3, "decodes served %g and %g of 6",
                  served(d[0].port), served(d[1].port));
    for (int i = 0; i < 4; i++) { /* 1..7 tokens: local */
        expect_same(x.port, i, false);
    }
    ck_assert_int_eq((int)served(p.port), 6);
    ck_assert_msg(served(d[0].port) == 5 && served(d[1].port) == 5, "decodes served %g and %g of 10",
                  served(d[0].port), served(d[1].port));
    ck_assert_int_eq((int)metric(x.port, "pd_proxy:prefills_total{where=\"local\"}"), 4);
    ck_assert_int_eq((int)metric(x.port, "pd_proxy:prefills_total{where=\"remote\"}"), 6);
    assert_pool_free(p.port, "the prefill");
    assert_pool_free(d[0].port, "decode 0");
    assert_pool_free(d[1].port, "decode 1");
    stop(&x);
    stop(&d[1]);
    stop(&d[0]);
    stop(&p);
}
END_TEST

/* Conditional disaggregation (pd-proxy --pd-local-prefill-threshold 24, KV events on): a prompt
 * whose part the decode does not hold is under 24 tokens is prefilled by the decode alone (no
 * prefill leg: the prefill serves nothing), token ids, text and chat alike; a long fresh prompt goes
 * through the prefill, and the same prompt again, now held by the decode (it loaded the KV), stays
 * on the decode; so does a chat turn asked twice. Every answer equals pd-serve's (streams event for event). A request the nodes
 * refuse (an unknown model) is routed without tokens and refused as before. With
 * --pd-local-prefill-hit-ratio alone, a prompt the decode mostly holds stays there. Both pools end
 * free. */
START_TEST(test_proxy_local_prefill)
{
    char *ev[] = {"--kv-events-config", EVENTS_CFG, NULL};
    cluster_t c;
    cluster_start(&c, "pull", "tcp", ev, ev);
    stop(&c.x);
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", c.p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c.d.port);
    char *x[] = {
        "--prefill", pre, "--decode", dec, "--health-interval", "0.2", "--pd-local-prefill-threshold",
        "24",        NULL};
    start(&c.x, "pd-proxy", "proxy-local", NULL, x);
    node_t serve;
    start(&serve, "pd-serve", "serve-local", g_model, NULL);
    usleep(600 * 1000); /* the first probe round subscribes */
    http_resp_t info;   /* the block size a router hashes with, before any event */
    ck_assert_int_eq(http_request(c.d.port, "GET", "/pd/info", NULL, NULL, &info, 5000), 0);
    json_t *ij = json_loads(info.body, 0, NULL);
    ck_assert_int_eq((int)json_integer_value(json_object_get(ij, "block_size")), 16);
    json_decref(ij);
    http_resp_free(&info);
    const char *local = "pd_proxy:prefills_total{where=\"local\"}",
               *remote = "pd_proxy:prefills_total{where=\"remote\"}";
    /* short token-id prompts (1..17 tokens): the decode alone */
    for (int i = 0; i < 7; i++) {
        expect_same(c.x.port, i, false);
        expect_same(c.x.port, i, true);
    }
    ck_assert_int_eq((int)served(c.p.port), 0);
    ck_assert_int_eq((int)metric(c.x.port, local), 14);
    /* 128 tokens: through the prefill; again, the decode holds 7 of its 8 blocks: 16 uncached */
    expect_same(c.x.port, 19, false);
    ck_assert_int_eq((int)served(c.p.port), 1);
    await_blocks(c.x.port, c.d.port, 7, false);
    expect_same(c.x.port, 19, true);
    ck_assert_int_eq((int)served(c.p.port), 1);
    /* a long text prompt (tokenized by a node's /tokenize): remote, then local */
    char *tb = long_text_body(true);
    double held = node_blocks(c.x.port, c.d.port);
    expect_same_stream(serve.port, c.x.port, "/v1/completions", tb, "long text, first");
    ck_assert_int_eq((int)served(c.p.port), 2);
    await_blocks(c.x.port, c.d.port, held + 21, false);
    expect_same_stream(serve.port, c.x.port, "/v1/completions", tb, "long text, again");
    ck_assert_int_eq((int)served(c.p.port), 2);
    free(tb);
    /* a chat turn (42 tokens with the template's preamble): remote; again, 10 uncached: local */
    const char *chat =
        "{\"model\": \"" MODEL_NAME "\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
        "\"max_tokens\": 4, \"temperature\": 0, \"stream\": true}";
    held = node_blocks(c.x.port, c.d.port);
    expect_same_stream(serve.port, c.x.port, "/v1/chat/completions", chat, "chat, first");
    ck_assert_int_eq((int)served(c.p.port), 3);
    await_blocks(c.x.port, c.d.port, held + 2, false);
    expect_same_stream(serve.port, c.x.port, "/v1/chat/completions", chat, "chat, again");
    ck_assert_int_eq((int)served(c.p.port), 3);
    ck_assert_int_eq((int)metric(c.x.port, local), 14 + 1 + 1 + 1);
    ck_assert_int_eq((int)metric(c.x.port, remote), 3);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:tokenize_failures_total"), 0);
    /* prompt_logprobs on a short prompt: the decode prefills it locally and scores it itself
     * (prompt_scores.c), as pd-serve does */
    const char *plp = "{\"model\": \"" MODEL_NAME "\", \"prompt\": [5, 9, 11, 13, 17], \"max_tokens\": 2, "
                      "\"temperature\": 0, \"prompt_logprobs\": 1}";
    json_t *pa = post_expect(serve.port, "/v1/completions", plp, 200);
    json_t *pb = post_expect(c.x.port, "/v1/completions", plp, 200);
    transcript_t *sa = malloc(sizeof(*sa)), *sb = malloc(sizeof(*sb));
    prompt_scores(pa, sa);
    prompt_scores(pb, sb);
    ck_assert_msg(strcmp(sa->text, sb->text) == 0 && sa->n_lp == sb->n_lp && sb->n_lp >= 4,
                  "local prompt_logprobs differ\npd-serve: %s\nproxy: %s", sa->text, sb->text);
    for (int i = 0; i < sa->n_lp; i++) {
        ck_assert_msg(fabs(sa->lp[i] - sb->lp[i]) < 2e-3, "local prompt logprob %d: %f vs %f", i, sa->lp[i],
                      sb->lp[i]);
    }
    free(sa->text), free(sb->text), free(sa), free(sb);
    json_decref(pa), json_decref(pb);
    ck_assert_int_eq((int)served(c.p.port), 3);
    ck_assert_int_eq((int)metric(c.x.port, local), 14 + 1 + 1 + 1 + 1);
    /* an unknown model: /tokenize refuses it, the request goes the P/D way and is refused there */
    http_resp_t r;
    ck_assert_int_eq(
        http_request(c.x.port, "POST", "/v1/chat/completions", "Content-Type: application/json\r\n",
                     "{\"model\": \"nope\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", &r,
                     30000),
        0);
    ck_assert_int_eq(r.status, 404);
    http_resp_free(&r);
    ck_assert_int_eq((int)metric(c.x.port, "pd_proxy:tokenize_failures_total"), 1);
    /* --pd-local-prefill-hit-ratio 0.8 alone (a new proxy: it learns the index by replay): prompt 19,
     * of which the decode holds 112 of 128 tokens, stays on the decode; a fresh 200-token one not */
    stop(&c.x);
    char *xr[] = {
        "--prefill", pre, "--decode", dec, "--health-interval", "0.2", "--pd-local-prefill-hit-ratio",
        "0.8",       NULL};
    start(&c.x, "pd-proxy", "proxy-ratio", NULL, xr);
    usleep(600 * 1000);
    await_blocks(c.x.port, c.d.port, held + 2, false);
    expect_same(c.x.port, 19, false);
    ck_assert_int_eq((int)served(c.p.port), 3);
    expect_same(c.x.port, 21, false);
    ck_assert_int_eq((int)served(c.p.port), 4);
    ck_assert_int_eq((int)metric(c.x.port, local), 1);
    ck_assert_int_eq((int)metric(c.x.port, remote), 1);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    stop(&serve);
    cluster_stop(&c);
}
END_TEST

/* A token whose text is U+0000 ("\u0000" in the JSON) passes through the proxy: the prefill's answer
 * is parsed with NULs allowed. The soak found it: about 1 request in 500 of random prompts failed
 * with the proxy's 502 "no kv_transfer_params". logit_bias forces that token. */
START_TEST(test_proxy_relays_nul_text)
{
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    http_resp_t r;
    ck_assert_int_eq(http_request(c.d.port, "POST", "/tokenize", "Content-Type: application/json\r\n",
                                  "{\"model\":\"m\",\"prompt\":\"\\u0000\",\"add_special_tokens\":false}", &r,
                                  10000),
                     0);
    ck_assert_int_eq(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *toks = json_object_get(j, "tokens");
    ck_assert_msg(json_array_size(toks) == 1, "U+0000 is not one token: %s", r.body);
    int id = (int)json_integer_value(json_array_get(toks, 0));
    json_decref(j);
    http_resp_free(&r);
    char body[256], want[64];
    snprintf(body, sizeof(body),
             "{\"model\":\"m\",\"prompt\":[5,6,7,8],\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"logit_bias\":{\"%d\":100}}",
             id);
    snprintf(want, sizeof(want), "[%d,%d,%d]", id, id, id);
    int st = 0;
    char *got = complete(c.x.port, body, &st);
    ck_assert_msg(got != NULL && strcmp(got, want) == 0, "through the proxy: HTTP %d, %s (want %s)", st,
                  got ? got : "-", want);
    free(got);
    cluster_stop(&c);
}
END_TEST

/* pd-proxy keeps upstream connections alive (--upstream-idle-connections, pool.c): 12 sequential
 * requests through the default proxy take kept connections for nearly all of their 24 legs (the
 * probes share the idle lists, so a leg may still open one), and give pd-serve's answers; a second
 * proxy over the same nodes with --upstream-idle-connections 0 reuses none. A node that restarts
 * under the proxy (its kept connections closed) is reached again on new ones without a failed
 * request. */
static double upstream(int proxy, const char *how)
{
    char series[96];
    snprintf(series, sizeof(series), "pd_proxy:upstream_connections_total{connection=\"%s\"}", how);
    return metric(proxy, series);
}

START_TEST(test_proxy_keeps_connections_alive)
{
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    node_t fresh;
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", c.p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c.d.port);
    char *x0[] = {
        "--prefill", pre, "--decode", dec, "--health-interval", "0.2", "--upstream-idle-connections",
        "0",         NULL};
    start(&fresh, "pd-proxy", "proxy-fresh", NULL, x0);
    usleep(600 * 1000);
    const int proxies[2] = {c.x.port, fresh.port};
    for (int k = 0; k < 2; k++) {
        double new0 = upstream(proxies[k], "new"), reused0 = upstream(proxies[k], "reused");
        for (int i = 0; i < 12; i++) {
            char body[160];
            snprintf(body, sizeof(body),
                     "{\"model\":\"m\",\"prompt\":[%d,6,7,8],\"max_tokens\":2,\"temperature\":0,\"return_"
                     "token_ids\":true,"
                     "\"ignore_eos\":true}",
                     5 + i);
            int st = 0;
            char *got = complete(proxies[k], body, &st);
            ck_assert_msg(st == 200 && got != NULL, "request %d through proxy %d: HTTP %d", i, k, st);
            free(got);
        }
        double made = upstream(proxies[k], "new") - new0, reused = upstream(proxies[k], "reused") - reused0;
        if (k == 0) {
            ck_assert_msg(reused >= 18, "kept alive: %.0f of 24 legs reused a connection (%.0f new)", reused,
                          made);
        } else {
            ck_assert_msg(reused == 0 && made >= 24, "--upstream-idle-connections 0: %.0f reused, %.0f new",
                          reused, made);
        }
    }
    /* the decode restarts on the same port: the default proxy's kept connections to it were closed */
    int dport = c.d.port;
    stop(&c.d);
    char *dext[] = {"--kv-transfer-mode", "pull", "--kv-pipe", "tcp", FAST_TIMEOUTS, NULL};
    start_at(&c.d, "pd-decode", "decode2", g_model, dext, dport);
    usleep(800 * 1000); /* the proxy's probes see it healthy again */
    for (int i = 0; i < 4; i++) {
        int st = 0;
        char *got = complete(c.x.port,
                             "{\"model\":\"m\",\"prompt\":[9,8,7],\"max_tokens\":2,\"temperature\":0,"
                             "\"return_token_ids\":true,"
                             "\"ignore_eos\":true}",
                             &st);
        ck_assert_msg(st == 200 && got != NULL, "after the decode's restart, request %d: HTTP %d", i, st);
        free(got);
    }
    stop(&fresh);
    cluster_stop(&c);
}
END_TEST

START_TEST(test_proxy_least_loaded_and_client_disconnect)
{
    pool2_t c;
    pool2_start(&c, "least-loaded");
    for (int i = 0; i < 8; i++) {
        expect_same(c.x.port, i, true);
    }
    ck_assert_msg(served(c.p[0].port) > 0 && served(c.p[1].port) > 0, "least-loaded used one prefill only");
    /* clients that go away mid-stream: both nodes abort, nothing stays allocated */
    for (int k = 0; k < 10; k++) {
        char *b = body_for(k, false);
        json_t *j = json_loads(b, 0, NULL);
        free(b);
        json_object_set_new(j, "stream", json_true());
        json_object_set_new(j, "max_tokens", json_integer(400));
        char *body = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        int fd = http_send(c.x.port, "POST", "/v1/completions", "Content-Type: application/json\r\n", body,
                           strlen(body), 5000);
        free(body);
        ck_assert_int_ge(fd, 0);
        char buf[256];
        ssize_t n = read(fd, buf, sizeof(buf)); /* the first bytes of the stream */
        ck_assert_int_gt(n, 0);
        close(fd);
    }
    usleep(300 * 1000);
    ck_assert_int_ge((int)metric(c.x.port, "pd_proxy:requests_total{result=\"client_gone\"}"), 1);
    assert_pool_free(c.d.port, "the decode");
    assert_pool_free(c.p[0].port, "prefill 0");
    assert_pool_free(c.p[1].port, "prefill 1");
    /* bad input: not JSON, not an object */
    http_resp_t r;
    ck_assert_int_eq(http_request(c.x.port, "POST", "/v1/completions", NULL, "{oops", &r, 5000), 0);
    ck_assert_int_eq(r.status, 400);
    ck_assert(strstr(r.body, "\"error\"") != NULL);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(c.x.port, "GET", "/v1/completions", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 405);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(c.x.port, "GET", "/health", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(c.x.port, "GET", "/v1/models", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200);
    ck_assert(strstr(r.body, MODEL_NAME) != NULL);
    http_resp_free(&r);
    pool2_stop(&c);
}
END_TEST

/* A client that leaves before the decode took its request (here the decode is stopped; in life,
 * queued behind others: either way not yet in its connector, so its abort tells the prefill
 * nothing): pd-proxy releases the prefill's lease at once instead of leaving it to
 * --kv-hold-timeout (120 s here). So do clients that leave while the prefill computes. */
START_TEST(test_proxy_client_gone_before_decode)
{
    cluster_t c;
    cluster_start(&c, "pull", "tcp", NULL, NULL);
    expect_same(c.x.port, 0, false); /* connected and warm */
    kill(c.d.pid, SIGSTOP);
    char *b = body_for(1, false);
    int fb = http_send(c.x.port, "POST", "/v1/completions", "Content-Type: application/json\r\n", b,
                       strlen(b), 5000);
    free(b);
    ck_assert_int_ge(fb, 0);
    double end = tu_now() + 10;
    while (metric(c.p.port, "pd:kv_leases_held") < 1 && tu_now() < end) {
        usleep(5000);
    }
    bool held = metric(c.p.port, "pd:kv_leases_held") >= 1;
    close(fb);
    end = tu_now() + 3;
    while (held && metric(c.p.port, "pd:kv_leases_held") > 0 && tu_now() < end) {
        usleep(10000);
    }
    double left = metric(c.p.port, "pd:kv_leases_held");
    kill(c.d.pid, SIGCONT);
    ck_assert_msg(held, "the prefill never held a lease for the request");
    ck_assert_msg(left == 0, "the lease of a client that left is still held");
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    /* 40 clients that hang up right after sending, while the prefill computes (issue 51: leases 3 → 8,
     * blocks 102 → 267, held until --kv-hold-timeout): the proxy releases by the request's transfer
     * id, before or after the prefill finishes, and nothing stays held */
    for (int i = 0; i < 40; i++) {
        char *body = body_for(20 + i % 40, false);
        int fd = http_send(c.x.port, "POST", "/v1/completions", "Content-Type: application/json\r\n", body,
                           strlen(body), 5000);
        free(body);
        ck_assert_int_ge(fd, 0);
        usleep((useconds_t)(i % 8) * 3000); /* hang-ups at different points of the prefill */
        close(fd);
    }
    assert_pool_free(c.p.port, "the prefill after 40 early hang-ups");
    ck_assert_int_eq((int)metric(c.p.port, "pd:kv_leases_held"), 0);
    assert_pool_free(c.d.port, "the decode");
    expect_same(c.x.port, 2, false); /* still serving */
    cluster_stop(&c);
}
END_TEST

/* POSTs body to port with an Authorization header (NULL: none); returns the status (-1: no answer). */
static int post_keyed(int port, const char *path, const char *key, const char *body)
{
    char headers[256];
    snprintf(headers, sizeof(headers), "Content-Type: application/json\r\n%s%s%s",
             key != NULL ? "Authorization: Bearer " : "", key != NULL ? key : "", key != NULL ? "\r\n" : "");
    http_resp_t r;
    int st = http_request(port, "POST", path, headers, body, &r, 60000) == 0 ? r.status : -1;
    if (st == 200) {
        ck_assert_msg(strstr(r.body, "\"choices\"") != NULL, "200 without choices: %s", r.body);
    } else if (st == 401) {
        ck_assert_msg(strstr(r.body, "AuthenticationError") != NULL, "401 without the error shape: %s",
                      r.body);
    }
    http_resp_free(&r);
    return st;
}

/* Nodes that require a key behind pd-proxy: a proxy without keys forwards the client's
 * Authorization (the nodes judge it); one with --api-key judges the client itself and sends
 * --node-api-key to the nodes; the official openai client is served through it. */
START_TEST(test_proxy_keyed_cluster)
{
    cluster_t c;
    char *keyed[] = {"--api-key", "node-secret", NULL};
    cluster_start(&c, "pull", "tcp", keyed, keyed);
    const char *body = "{\"model\":\"m\",\"prompt\":[5,6,7,8],\"max_tokens\":3,\"temperature\":0}";
    ck_assert_int_eq(post_keyed(c.x.port, "/v1/completions", "node-secret", body), 200); /* forwarded */
    ck_assert_int_eq(post_keyed(c.x.port, "/v1/completions", NULL, body), 401);          /* the node's 401 */
    node_t x;
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", c.p.port);
    snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", c.d.port);
    char *xa[] = {"--prefill",         pre,           "--decode",  dec,
                  "--health-interval", "0.2",         "--api-key", "test-key",
                  "--node-api-key",    "node-secret", NULL};
    start(&x, "pd-proxy", "proxy-keyed", NULL, xa);
    usleep(600 * 1000);
    ck_assert_int_eq(post_keyed(x.port, "/v1/completions", NULL, body), 401);
    ck_assert_int_eq(post_keyed(x.port, "/v1/completions", "node-secret", body),
                     401); /* not the client key */
    ck_assert_int_eq(post_keyed(x.port, "/v1/completions", "test-keyX", body), 401);
    ck_assert_int_eq(post_keyed(x.port, "/v1/completions", "test-key", body), 200);
    http_resp_t r;
    ck_assert_int_eq(http_request(x.port, "GET", "/health", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200); /* probes need no key */
    http_resp_free(&r);
    ck_assert_int_eq(
        http_request(x.port, "GET", "/v1/models", "Authorization: Bearer test-key\r\n", NULL, &r, 5000), 0);
    ck_assert_msg(r.status == 200 && strstr(r.body, MODEL_NAME) != NULL, "/v1/models: %d %s", r.status,
                  r.body);
    http_resp_free(&r);
    /* pd-bench sends --api-key, else $OPENAI_API_KEY */
    for (int k = 0; k < 3; k++) {
        char res[600];
        snprintf(res, sizeof(res), "%s/bench-keyed-%d.json", g_dir, k);
        int rc =
            tu_run(120,
                   "%s%s/bin/pd-bench --base-url http://127.0.0.1:%d --model m --num-prompts 4 "
                   "--random-input-len 16 --random-output-len 4 --ignore-eos --vocab-size 200 --no-progress "
                   "--save-result --result-filename %s %s > %s.out 2>&1",
                   k == 1 ? "OPENAI_API_KEY=test-key " : "env -u OPENAI_API_KEY ", tu_binary_dir(), x.port,
                   res, k == 0 ? "--api-key test-key" : "", res);
        json_t *j = json_load_file(res, 0, NULL);
        int done = (int)json_integer_value(json_object_get(j, "completed"));
        json_decref(j);
        ck_assert_msg(k < 2 ? rc == 0 && done == 4 : rc != 0 && done == 0,
                      "pd-bench run %d: exit %d, %d completed", k, rc, done);
    }
    if (tu_need(TU_NODE)) {
        char dir[1024], out[600];
        ck_assert_msg(tu_npm_install("openai", "openai@4", dir, sizeof(dir)) == 0,
                      "npm install openai@4 failed");
        snprintf(out, sizeof(out), "%s/openai-keyed.json", g_dir);
        ck_assert_int_eq(
            tu_run(120,
                   "node %s/tests/reference/openai_client.mjs %s/node_modules http://127.0.0.1:%d/v1 "
                   "m \"Tell me about caches\" 6 test-key > %s",
                   tu_source_dir(), dir, x.port, out),
            0);
        json_t *res = json_load_file(out, 0, NULL);
        ck_assert_ptr_nonnull(res);
        json_t *u = json_object_get(res, "usage"), *su = json_object_get(res, "stream_usage");
        ck_assert_int_eq(json_integer_value(json_object_get(u, "completion_tokens")), 6);
        ck_assert_int_eq(json_integer_value(json_object_get(su, "completion_tokens")), 6);
        ck_assert_str_eq(json_string_value(json_object_get(res, "text")),
                         json_string_value(json_object_get(res, "stream_text")));
        json_decref(res);
        ck_assert_int_ne(
            tu_run(120,
                   "node %s/tests/reference/openai_client.mjs %s/node_modules http://127.0.0.1:%d/v1 "
                   "m hi 2 wrong-key > /dev/null 2>&1",
                   tu_source_dir(), dir, x.port),
            0); /* the client raises AuthenticationError */
    }
    stop(&x);
    cluster_stop(&c);
}
END_TEST

START_TEST(test_dns_discovery_and_prefill_restart)
{
    /* pools from DNS ("localhost" resolves to 127.0.0.1), and a prefill that restarts on the same
     * addresses with a new engine id: the decode's cached connection is refreshed */
    cluster_t c;
    memset(&c, 0, sizeof(c));
    char *a[] = {"--kv-transfer-mode", "pull", "--kv-pipe", "tcp", FAST_TIMEOUTS, NULL};
    start(&c.p, "pd-prefill", "prefill", g_model, a);
    start(&c.d, "pd-decode", "decode", g_model, a);
    char pre[64], dec[64];
    snprintf(pre, sizeof(pre), "localhost:%d", c.p.port);
    snprintf(dec, sizeof(dec), "localhost:%d", c.d.port);
    char *x[] = {"--discover-prefill",
                 pre,
                 "--discover-decode",
                 dec,
                 "--discover-interval",
                 "0.5",
                 "--health-interval",
                 "0.2",
                 NULL};
    start(&c.x, "pd-proxy", "proxy", NULL, x);
    usleep(800 * 1000);
    expect_same(c.x.port, 5, false);
    http_resp_t r;
    ck_assert_int_eq(http_request(c.p.port, "GET", "/pd/info", NULL, NULL, &r, 5000), 0);
    json_t *info = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    char kv[64], old_id[80];
    snprintf(kv, sizeof(kv), "127.0.0.1:%lld",
             (long long)json_integer_value(json_object_get(info, "kv_port")));
    snprintf(old_id, sizeof(old_id), "%s", json_string_value(json_object_get(info, "engine_id")));
    json_decref(info);
    kill(c.p.pid, SIGKILL);
    waitpid(c.p.pid, NULL, 0);
    /* same HTTP and KV ports, new process */
    char *again[] = {"--kv-transfer-mode", "pull",        "--kv-pipe", "tcp",
                     FAST_TIMEOUTS,        "--kv-listen", kv,          NULL};
    start_at(&c.p, "pd-prefill", "prefill2", g_model, again, c.p.port);
    usleep(800 * 1000); /* the proxy's probes see it healthy again */
    for (int i = 0; i < 3; i++) {
        expect_same(c.x.port, 6 + i, false);
    }
    ck_assert_int_eq(http_request(c.p.port, "GET", "/pd/info", NULL, NULL, &r, 5000), 0);
    ck_assert(strstr(r.body, old_id) == NULL);
    http_resp_free(&r);
    ck_assert_int_eq((int)metric(c.d.port, "pd:kv_transfers_completed_total{kind=\"pull_load\"}"), 4);
    ck_assert_int_ge((int)metric(c.d.port, "pd:kv_handshakes_total{result=\"ok\"}"), 2);
    assert_pool_free(c.p.port, "the prefill");
    assert_pool_free(c.d.port, "the decode");
    cluster_stop(&c);
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_OFF);
    Suite *s = suite_create("pd");
    /* five cases, each its own CTest entry (CK_RUN_CASE, CMakeLists.txt) so that they run side by side:
     * they mostly wait on processes */
    TCase *eq = tcase_create("equivalence");
    tcase_add_loop_test(eq, test_equivalence, 0, (int)(sizeof(EQUIV) / sizeof(EQUIV[0])));
    tcase_add_test(eq, test_families_equivalence);
    tcase_add_test(eq, test_speculative_equivalence);
    tcase_add_test(eq, test_nccl_with_host_kv_refused);
    tcase_add_test(eq, test_prefix_hit_moves_only_missing_blocks);
    tcase_add_test(eq, test_decode_offload_tier_saves_transfers);
    TCase *p2p = tcase_create("p2p");
    tcase_add_test(p2p, test_prefix_fetch_by_hand);
    tcase_add_test(p2p, test_prefix_fetch_through_proxy);
    TCase *handover = tcase_create("handover");
    tcase_add_loop_test(handover, test_first_token_handover, 0, (int)(sizeof(FT) / sizeof(FT[0])));
    tcase_add_loop_test(handover, test_prompt_logprobs_through_proxy, 0, 2); /* pull/tcp, push/ucx */
    TCase *faults = tcase_create("faults");
    tcase_add_test(faults, test_prefill_gone_before_read);
    tcase_add_test(faults, test_lease_expiry_is_stale);
    tcase_add_test(faults, test_stalled_prefill_reconnects);
    tcase_add_test(faults, test_prefill_killed_under_load);
    tcase_add_test(faults, test_decode_killed_holding_reservation);
    tcase_add_test(faults, test_decode_deaths_release_prefill_memory);
    TCase *hostile = tcase_create("hostile");
    tcase_add_test(hostile, test_wrong_token_and_other_model_recompute);
    tcase_add_test(hostile, test_silent_kv_connections_harmless);
    tcase_add_test(hostile, test_silent_prefill_dial_harmless);
    tcase_add_test(hostile, test_refused_decode_releases_prefill);
    tcase_add_test(hostile, test_roles_refused_and_named_mode);
    tcase_add_test(hostile, test_kv_params_from_clients_refused);
    TCase *proxy = tcase_create("proxy");
    tcase_add_test(proxy, test_proxy_prefix_affinity_and_failover);
    tcase_add_test(proxy, test_proxy_least_loaded_and_client_disconnect);
    tcase_add_test(proxy, test_proxy_relays_nul_text);
    tcase_add_test(proxy, test_proxy_keeps_connections_alive);
    tcase_add_test(proxy, test_proxy_client_gone_before_decode);
    tcase_add_test(proxy, test_proxy_keyed_cluster);
    tcase_add_test(proxy, test_proxy_kv_events_index);
    tcase_add_test(proxy, test_proxy_kv_aware);
    tcase_add_test(proxy, test_proxy_local_prefill);
    tcase_add_test(proxy, test_proxy_local_prefill_round_robin);
    tcase_add_test(proxy, test_proxy_index_after_node_restart);
    tcase_add_test(proxy, test_dns_discovery_and_prefill_restart);
    TCase *cases[] = {eq, handover, faults, hostile, proxy, p2p};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        tcase_add_unchecked_fixture(cases[i], suite_setup, suite_teardown);
        tcase_set_timeout(cases[i], 300);
        suite_add_tcase(s, cases[i]);
    }
    tu_probe_tools(TU_NODE); /* the keyed cluster serves the official openai client */
    return tu_run_suite(s);
}
