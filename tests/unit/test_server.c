#define _GNU_SOURCE /* strcasestr, strndup: before any system header */
/* tests/unit/test_server.c — the HTTP front on real pd-serve processes (loopback, ports from
 * --port-file, every process stopped at the end): completions equal the engine's offline output,
 * logprobs equal a log-softmax recomputed here, streaming concatenates to the same text, every
 * error code with its shape, the official openai npm client, 200 concurrent streams, 50 clients
 * disconnecting mid-stream leave the pool free, /metrics parses and counters only go up. */
#include "http_client.h"
#include "test_util.h"

#include <check.h>
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <sys/socket.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/rng.h"
#include "engine/engine.h"
#include "kernels/paged_impl.h"
#include "model/model.h"
#include "server/direct_stream.h"
#include "server/tool_calls.h"

static char *g_model;
static char *g_dir;
static pid_t g_pid = -1;
static int g_port = -1;

#define MAX_MODEL_LEN "512"
/* a model whose steps take long enough that a client can watch one request run */
#define SLOW_MODEL "--preset tiny --arch llama --hidden 512 --layers 6 --intermediate 1408"

static pid_t start_server_model(const char *model, const char *tag, char *const extra[], int *port_out);

static pid_t start_server(const char *tag, char *const extra[], int *port_out)
{
    return start_server_model(g_model, tag, extra, port_out);
}

static pid_t start_server_model(const char *model, const char *tag, char *const extra[], int *port_out)
{
    char port_file[512], log_file[512], bin[512];
    snprintf(port_file, sizeof(port_file), "%s/%s.port", g_dir, tag);
    snprintf(log_file, sizeof(log_file), "%s/%s.log", g_dir, tag);
    snprintf(bin, sizeof(bin), "%s/bin/pd-serve", tu_binary_dir());
    unlink(port_file);
    char *argv[40] = {bin,    "--model",         (char *)model, "--port",
                      "0",    "--port-file",     port_file,     "--kv-cache-memory",
                      "256M", "--max-model-len", MAX_MODEL_LEN, "--threads",
                      "2",    "--max-num-seqs",  "64",          "--max-num-batched-tokens",
                      "512"};
    int n = 17;
    for (int i = 0; extra != NULL && extra[i] != NULL; i++) {
        argv[n++] = extra[i];
    }
    argv[n] = NULL;
    pid_t pid = tu_spawn(argv, log_file);
    ck_assert_int_gt(pid, 0);
    *port_out = tu_wait_port(pid, port_file, 120);
    ck_assert_msg(*port_out > 0, "pd-serve (%s) did not start; see %s", tag, log_file);
    return pid;
}

static void suite_setup(void)
{
    pd_log_set_level(PD_LOG_WARN);
    g_model = tu_make_model("--preset tiny --arch llama");
    g_dir = tu_mkdtemp("server");
    ck_assert_ptr_nonnull(g_model);
    char *extra[] = {"--max-request-bytes", "65536", NULL};
    g_pid = start_server("main", extra, &g_port);
}

static void suite_teardown(void)
{
    int rc = tu_stop(g_pid, 30);
    if (rc != 0) {
        fprintf(stderr, "pd-serve exited with %d\n", rc);
    }
    tu_rmrf(g_model);
    tu_rmrf(g_dir);
}

static json_t *post_json(int port, const char *body, int *status)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", "/v1/completions", NULL, body, &r, 60000), 0);
    *status = r.status;
    json_t *j = json_loads(r.body, JSON_ALLOW_NUL, NULL); /* a token may decode to U+0000 */
    ck_assert_msg(j != NULL, "not JSON: %s", r.body);
    http_resp_free(&r);
    return j;
}

/* ------------------------------------------------------------------ equivalence */

/* Runs prompt through an in-process engine with the same settings (offline output). */
static void engine_offline(const int32_t *prompt, int n, int max_tokens, float temp, int64_t seed,
                           int32_t *ids, int *nids, char *text, size_t *tlen)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 2;
    c.kv_cache_memory = 256u << 20;
    c.max_model_len = 512;
    pd_engine_t *e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_OK);
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = "offline";
    rq.prompt = prompt;
    rq.num_prompt = n;
    rq.params.max_tokens = max_tokens;
    rq.params.sampling = (pd_sampling_params_t){temp, 0, 1.0f, 0.0f};
    rq.params.has_seed = seed >= 0;
    rq.params.seed = (uint64_t)seed;
    char err[128];
    ck_assert_int_eq(pd_engine_add(e, &rq, err, sizeof(err)), PD_OK);
    *nids = 0;
    *tlen = 0;
    while (pd_engine_has_work(e)) {
        pd_engine_output_t *o = NULL;
        pd_engine_step(e, &o);
        for (pd_engine_output_t *x = o; x != NULL; x = x->next) {
            if (x->token >= 0) {
                ids[(*nids)++] = x->token;
            }
            memcpy(text + *tlen, x->text, x->text_len);
            *tlen += x->text_len;
        }
        pd_engine_output_free(o);
    }
    text[*tlen] = '\0';
    pd_engine_destroy(e);
}

static void check_equivalence(float temp, int64_t seed)
{
    const char *prompt = "The prefill node computes the cache; the decode node streams tokens.";
    char body[1024];
    snprintf(
        body, sizeof(body),
        "{\"model\": \"%s\", \"prompt\": \"%s\", \"max_tokens\": 24, \"temperature\": %g, \"seed\": %lld, "
        "\"return_token_ids\": true}",
        strrchr(g_model, '/') + 1, prompt, temp, (long long)seed);
    int status;
    json_t *j = post_json(g_port, body, &status);
    ck_assert_int_eq(status, 200);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    json_t *pids = json_object_get(ch, "prompt_token_ids"), *tids = json_object_get(ch, "token_ids");
    int32_t prompt_ids[256], want[64];
    int np = (int)json_array_size(pids), nw = 0;
    for (int i = 0; i < np; i++) {
        prompt_ids[i] = (int32_t)json_integer_value(json_array_get(pids, i));
    }
    char text[4096];
    size_t tlen;
    engine_offline(prompt_ids, np, 24, temp, seed, want, &nw, text, &tlen);
    ck_assert_int_eq((int)json_array_size(tids), nw);
    for (int i = 0; i < nw; i++) {
        ck_assert_int_eq(json_integer_value(json_array_get(tids, i)), want[i]);
    }
    ck_assert_str_eq(json_string_value(json_object_get(ch, "text")), text);
    json_t *u = json_object_get(j, "usage");
    ck_assert_int_eq(json_integer_value(json_object_get(u, "prompt_tokens")), np);
    ck_assert_int_eq(json_integer_value(json_object_get(u, "completion_tokens")), nw);
    ck_assert_int_eq(json_integer_value(json_object_get(u, "total_tokens")), np + nw);
    ck_assert_str_eq(json_string_value(json_object_get(j, "object")), "text_completion");
    json_decref(j);

    /* the same request streamed: chunks concatenate to the same text, usage is exact */
    snprintf(
        body, sizeof(body),
        "{\"prompt\": \"%s\", \"max_tokens\": 24, \"temperature\": %g, \"seed\": %lld, \"stream\": true, "
        "\"stream_options\": {\"include_usage\": true}}",
        prompt, temp, (long long)seed);
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, body, &r, 60000), 0);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strcasestr(r.head, "text/event-stream"));
    char acc[4096] = {0};
    int chunks = 0, done = 0, usage_seen = 0;
    for (char *line = strtok(r.body, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: ", 6) != 0) {
            continue;
        }
        if (strcmp(line + 6, "[DONE]") == 0) {
            done++;
            continue;
        }
        json_t *c = json_loads(line + 6, JSON_ALLOW_NUL, NULL);
        ck_assert_ptr_nonnull(c);
        json_t *chs = json_object_get(c, "choices");
        if (json_array_size(chs) > 0) {
            strcat(acc, json_string_value(json_object_get(json_array_get(chs, 0), "text")));
            chunks++;
        }
        json_t *us = json_object_get(c, "usage");
        if (us != NULL && !json_is_null(us)) {
            usage_seen++;
            ck_assert_int_eq(json_integer_value(json_object_get(us, "completion_tokens")), nw);
        }
        json_decref(c);
    }
    ck_assert_str_eq(acc, text);
    ck_assert_int_eq(chunks, nw);
    ck_assert_int_eq(done, 1);
    ck_assert_int_eq(usage_seen, 1);
    http_resp_free(&r);
}

/* The SSE body of a streamed request, de-chunked, with every "created" zeroed (the only field that
 * may differ between two servers given the same X-Request-Id and seed). */
static char *stream_body(int port, const char *path, const char *body)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", path, "X-Request-Id: direct-1\r\n", body, &r, 60000), 0);
    ck_assert_int_eq(r.status, 200);
    for (char *p = r.body; (p = strstr(p, "\"created\":")) != NULL;) {
        for (p += 10; *p >= '0' && *p <= '9'; p++) {
            *p = '0';
        }
    }
    char *b = r.body;
    r.body = NULL;
    http_resp_free(&r);
    return b;
}

static double stream_chunks(int port, const char *writer)
{
    char name[96];
    snprintf(name, sizeof(name), "pd:stream_chunks_total{writer=\"%s\"}", writer);
    http_resp_t m;
    ck_assert_int_eq(http_request(port, "GET", "/metrics", NULL, NULL, &m, 5000), 0);
    double v = pd_metrics_text_value(m.body, name, -1);
    http_resp_free(&m);
    return v;
}

/* The texts of an SSE body's events concatenated (completions' "text"; a token may decode to U+0000,
 * so by length), and the number of [DONE]s; every event must be JSON (a broken chunk framing would
 * not be). */
static size_t stream_text(char *body, char *acc, size_t cap, int *done)
{
    *done = 0;
    size_t n = 0;
    for (char *line = strtok(body, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        ck_assert_msg(strncmp(line, "data: ", 6) == 0, "not an SSE event: %.80s", line);
        if (strcmp(line + 6, "[DONE]") == 0) {
            (*done)++;
            continue;
        }
        json_t *c = json_loads(line + 6, JSON_ALLOW_NUL, NULL);
        ck_assert_msg(c != NULL, "not JSON: %.120s", line + 6);
        json_t *t = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "text");
        size_t tl = json_string_length(t);
        ck_assert_msg(n + tl < cap, "text too long");
        memcpy(acc + n, json_string_value(t), tl);
        n += tl;
        json_decref(c);
    }
    return n;
}

/* Issue 53: the engine thread writes a plain stream's tokens itself (--direct-stream, the default).
 * Its chunks are the HTTP loop's byte for byte (completions with token ids and without, chat; against a --no-direct-stream
 * server), the metrics say which thread wrote them, and a client that reads nothing until the
 * request has ended still gets every token, in order, in well-formed chunks. */
START_TEST(test_direct_stream_bytes_and_slow_client)
{
    /* a model slow enough that the loop keeps up with the engine (with a tiny one it may be writing
     * the previous token when the next is made, and then it writes them all, rightly) */
    char *slow = tu_make_model(SLOW_MODEL);
    ck_assert_ptr_nonnull(slow);
    int port1, port2;
    char *extra[] = {"--no-direct-stream", NULL};
    pid_t pid1 = start_server_model(slow, "engine-writes", NULL, &port1);
    pid_t pid2 = start_server_model(slow, "loop-writes", extra, &port2);
    const char *paths[3] = {"/v1/completions", "/v1/chat/completions", "/v1/completions"};
    const char *bodies[3] = {
        "{\"prompt\": \"who writes\", \"max_tokens\": 40, \"ignore_eos\": true, \"temperature\": 1, "
        "\"seed\": 7, \"stream\": true, \"return_token_ids\": true}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"who writes\"}], \"max_tokens\": 40, "
        "\"ignore_eos\": true, \"temperature\": 1, \"seed\": 7, \"stream\": true, \"stream_options\": "
        "{\"include_usage\": true}}",
        "{\"prompt\": \"who writes\", \"max_tokens\": 40, \"ignore_eos\": true, \"temperature\": 0, "
        "\"stream\": true}"};
    double engine0 = stream_chunks(port1, "engine");
    for (int i = 0; i < 3; i++) {
        char *a = stream_body(port1, paths[i], bodies[i]), *b = stream_body(port2, paths[i], bodies[i]);
        ck_assert_str_eq(a, b);
        free(a), free(b);
    }
    ck_assert_msg(stream_chunks(port1, "engine") >= engine0 + 90, "the engine thread wrote %g of 120 chunks",
                  stream_chunks(port1, "engine") - engine0);
    ck_assert_double_eq(stream_chunks(port2, "engine"), 0);
    ck_assert_double_ge(stream_chunks(port2, "loop"), 120);
    ck_assert_int_eq(tu_stop(pid2, 30), 0);

    /* the slow client: a small receive buffer, and nothing read until every token is made */
    const char *req =
        "{\"prompt\": \"fill the socket\", \"max_tokens\": 400, \"ignore_eos\": true, \"temperature\": 1, "
        "\"seed\": 11, \"stream\": true}";
    double loop0 = stream_chunks(port1, "loop");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 2048;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    struct timeval tv = {60, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port1)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    char head[512];
    int hn = snprintf(head, sizeof(head),
                      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                      strlen(req), req);
    ck_assert_int_eq(write(fd, head, (size_t)hn), hn);
    double until = tu_now() + 20;
    while (tu_now() < until) { /* the request has finished when nothing runs */
        usleep(200 * 1000);
        http_resp_t m;
        ck_assert_int_eq(http_request(port1, "GET", "/metrics", NULL, NULL, &m, 5000), 0);
        double running = pd_metrics_text_value(m.body, "vllm:num_requests_running", -1);
        double gen =
            pd_metrics_text_value(m.body, "vllm:request_success_total{finished_reason=\"length\"}", 0);
        http_resp_free(&m);
        static double gen0 = -1;
        if (gen0 < 0) {
            gen0 = gen;
        }
        if (running == 0 && gen > gen0) {
            break;
        }
    }
    http_resp_t r;
    ck_assert_int_eq(http_read_response(fd, &r), 0);
    ck_assert_int_eq(r.status, 200);
    static char got[65536], want[65536];
    int done = 0;
    size_t got_len = stream_text(r.body, got, sizeof(got), &done);
    ck_assert_int_eq(done, 1);
    http_resp_free(&r);
    char plain[512];
    snprintf(
        plain, sizeof(plain),
        "{\"prompt\": \"fill the socket\", \"max_tokens\": 400, \"ignore_eos\": true, \"temperature\": 1, "
        "\"seed\": 11}");
    int status;
    json_t *j = post_json(port1, plain, &status);
    ck_assert_int_eq(status, 200);
    json_t *wt = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text");
    size_t want_len = json_string_length(wt);
    ck_assert_uint_lt(want_len, sizeof(want));
    memcpy(want, json_string_value(wt), want_len);
    json_decref(j);
    ck_assert_uint_eq(got_len, want_len);
    ck_assert_msg(memcmp(got, want, want_len) == 0, "the slow stream's text differs from the plain reply's");
    /* on loopback the kernel takes MBs before a send would block, so the chunks all fit; a full
     * socket is test_direct_stream_partial_writes' */
    ck_assert_double_le(stream_chunks(port1, "loop"), loop0 + 4);
    ck_assert_int_eq(tu_stop(pid1, 30), 0);
    tu_rmrf(slow);
    free(slow);
}
END_TEST

/* One plain token for the direct writer: `len` bytes of text. */
static pd_engine_output_t *direct_token(size_t len, char fill)
{
    pd_engine_output_t *o = calloc(1, sizeof(*o));
    o->token = 100 + (int32_t)len;
    o->stop_token = -1;
    o->text = malloc(len + 1);
    memset(o->text, fill, len);
    o->text[len] = '\0';
    o->text_len = len;
    return o;
}

/* The frame the writer sends for o: "<hex>\r\ndata: {"t":"<text>","i":[<id>]}\n\n\r\n". */
static size_t direct_frame(const pd_engine_output_t *o, char *out)
{
    char body[8192];
    int bl = snprintf(body, sizeof(body), "data: {\"t\":\"%s\",\"i\":[%d]}\n\n", o->text, (int)o->token);
    return (size_t)sprintf(out, "%x\r\n%s\r\n", bl, body);
}

/* server/direct_stream.c alone, on a socket that fills: a chunk the socket takes only in part is
 * delivered with its unsent rest for the loop, the writer disarms and counts what the loop must
 * handle, refuses everything until the loop has handled it and armed it again, never writes a
 * final output, and writes nothing once closed. What the peer reads plus the rest is every frame,
 * whole and in order. */
START_TEST(test_direct_stream_partial_writes)
{
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    int small = 4096;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    pd_direct_stream_t *d = pd_direct_new(false);
    ck_assert_ptr_nonnull(d);
    pd_engine_output_t *first = direct_token(4, 'a');
    ck_assert(!pd_direct_send(d, first)); /* not armed yet: the loop writes it */
    ck_assert(pd_direct_counts(first));
    pd_direct_handled(d);
    char chunk[64];
    snprintf(chunk, sizeof(chunk), "{\"t\":\"\\u0001pd-direct\\u0002\",\"i\":[%d]}", PD_DIRECT_ID_MARKER);
    pd_direct_arm(d, true, sv[0], true, chunk, NULL);
    static char want[1 << 20], got[1 << 20];
    size_t want_len = 0, got_len = 0;
    pd_engine_output_t *partial = NULL;
    for (int i = 0; i < 200 && partial == NULL; i++) {
        pd_engine_output_t *o = direct_token(1000, (char)('b' + i % 20));
        ck_assert(pd_direct_send(d, o));
        ck_assert(o->delivered);
        want_len += direct_frame(o, want + want_len);
        if (o->rest != NULL) {
            partial = o;
        } else {
            ck_assert(!pd_direct_counts(o));
            pd_engine_output_free(o);
        }
    }
    ck_assert_msg(partial != NULL, "the socket never filled");
    ck_assert(pd_direct_counts(partial));
    pd_engine_output_t *next = direct_token(10, 'z');
    ck_assert(!pd_direct_send(d, next)); /* disarmed: the loop has the rest to send first */
    ck_assert(!next->delivered);
    for (;;) { /* the client reads what was sent */
        ssize_t r = recv(sv[1], got + got_len, sizeof(got) - got_len, MSG_DONTWAIT);
        if (r <= 0) {
            break;
        }
        got_len += (size_t)r;
    }
    memcpy(got + got_len, partial->rest, partial->rest_len); /* the loop's part, queued first */
    got_len += partial->rest_len;
    ck_assert_uint_eq(got_len, want_len);
    ck_assert(memcmp(got, want, want_len) == 0);
    pd_direct_arm(d, true, sv[0], true, NULL, NULL);
    pd_engine_output_t *late = direct_token(3, 'y');
    ck_assert(!pd_direct_send(d, late)); /* two outputs are still the loop's (and now late too) */
    pd_direct_handled(d), pd_direct_handled(d);
    pd_direct_arm(d, true, sv[0], true, NULL, NULL);
    pd_engine_output_t *probe = direct_token(3, 'p');
    ck_assert(!pd_direct_send(d, probe)); /* late is not handled yet */
    pd_direct_handled(d), pd_direct_handled(d);
    pd_direct_arm(d, false, sv[0], true, NULL, NULL); /* the loop says its connection is busy */
    ck_assert(!pd_direct_send(d, probe));
    pd_direct_handled(d);
    pd_direct_arm(d, true, sv[0], true, NULL, NULL);
    pd_engine_output_t *fin = direct_token(3, 'f');
    fin->finish_reason = "length";
    ck_assert(!pd_direct_send(d, fin)); /* a final output is always the loop's */
    pd_direct_handled(d);
    pd_direct_arm(d, true, sv[0], true, NULL, NULL);
    pd_engine_output_t *again = direct_token(5, 'g');
    ck_assert(pd_direct_send(d, again));
    ck_assert_ptr_null(again->rest);
    char frame[64], in[64];
    size_t fl = direct_frame(again, frame);
    ck_assert_int_eq(recv(sv[1], in, sizeof(in), MSG_DONTWAIT), (ssize_t)fl);
    ck_assert(memcmp(in, frame, fl) == 0);
    pd_direct_close(d);
    pd_engine_output_t *after = direct_token(5, 'h');
    ck_assert(!pd_direct_send(d, after));
    ck_assert_int_eq(recv(sv[1], in, sizeof(in), MSG_DONTWAIT), -1); /* nothing more came */
    pd_engine_output_free(first), pd_engine_output_free(partial), pd_engine_output_free(next);
    pd_engine_output_free(late), pd_engine_output_free(fin), pd_engine_output_free(again);
    pd_engine_output_free(after), pd_engine_output_free(probe);
    pd_direct_free(d);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

/* The writers' descriptor cap: past it a stream is not armed (the loop writes it), and a writer
 * that ends gives its place back. */
START_TEST(test_direct_stream_fd_cap)
{
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    char chunk[64];
    snprintf(chunk, sizeof(chunk), "{\"t\":\"\\u0001pd-direct\\u0002\",\"i\":[%d]}", PD_DIRECT_ID_MARKER);
    pd_direct_set_max_fds(1);
    int base = pd_direct_fds();
    ck_assert_int_eq(base, 0);
    pd_direct_stream_t *a = pd_direct_new(false), *b = pd_direct_new(false);
    pd_direct_arm(a, true, sv[0], true, chunk, NULL);
    pd_direct_arm(b, true, sv[0], true, chunk, NULL);
    ck_assert_int_eq(pd_direct_fds(), 1);
    pd_engine_output_t *o = direct_token(3, 'a');
    ck_assert(pd_direct_send(a, o));
    pd_engine_output_t *p = direct_token(3, 'b');
    ck_assert(!pd_direct_send(b, p)); /* over the cap: the loop's */
    pd_direct_handled(b);
    pd_direct_close(a);
    ck_assert_int_eq(pd_direct_fds(), 0);
    pd_direct_arm(b, true, sv[0], true, chunk, NULL); /* a's place is free now */
    ck_assert_int_eq(pd_direct_fds(), 1);
    pd_engine_output_t *q = direct_token(3, 'c');
    ck_assert(pd_direct_send(b, q));
    pd_direct_free(b);
    ck_assert_int_eq(pd_direct_fds(), 0);
    pd_direct_free(a);
    ck_assert_int_eq(pd_direct_fds(), 0);
    pd_engine_output_free(o), pd_engine_output_free(p), pd_engine_output_free(q);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(test_completion_equals_engine_greedy)
{
    check_equivalence(0.0f, 0);
}
END_TEST

START_TEST(test_completion_equals_engine_seeded)
{
    check_equivalence(0.9f, 1234);
}
END_TEST

/* Completions top_logprobs always hold the chosen token, under its own text, with its logprob: at a
 * high temperature most chosen tokens are outside the top 1, and with logprobs 1 an entry has 1 or 2
 * keys (issue 51: the chosen one was missing). A token whose text is U+0000 is keyed "\u0000" (it
 * was ""). */
START_TEST(test_top_logprobs_hold_the_chosen_token)
{
    int status;
    json_t *j = post_json(g_port,
                          "{\"prompt\": [5, 77, 300], \"max_tokens\": 12, \"temperature\": 2.0, \"seed\": 3, "
                          "\"logprobs\": 1, \"ignore_eos\": true}",
                          &status);
    ck_assert_int_eq(status, 200);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    size_t n = json_array_size(json_object_get(lp, "tokens"));
    ck_assert_uint_eq(n, 12);
    int outside = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *tok = json_array_get(json_object_get(lp, "tokens"), i);
        json_t *top = json_array_get(json_object_get(lp, "top_logprobs"), i);
        json_t *v = json_object_getn(top, json_string_value(tok), json_string_length(tok));
        ck_assert_msg(v != NULL, "entry %zu lacks the chosen token", i);
        ck_assert(fabs(json_real_value(v) -
                       json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), i))) < 1e-6);
        ck_assert_uint_le(json_object_size(top), 2);
        outside += json_object_size(top) == 2;
    }
    ck_assert_int_gt(outside, 0); /* the case the fix is about did occur */
    json_decref(j);
    /* the token that decodes to U+0000, forced */
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "POST", "/tokenize", NULL,
                                  "{\"prompt\": \"\\u0000\", \"add_special_tokens\": false}", &r, 10000),
                     0);
    json_t *t = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    json_t *ids = json_object_get(t, "tokens");
    ck_assert_uint_eq(json_array_size(ids), 1);
    char body[256];
    snprintf(body, sizeof(body),
             "{\"prompt\": [5, 77], \"max_tokens\": 1, \"logprobs\": 1, \"logit_bias\": {\"%lld\": 100}}",
             (long long)json_integer_value(json_array_get(ids, 0)));
    json_decref(t);
    /* (jansson parses no NUL in object keys: the text is checked as it is) */
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, body, &r, 60000), 0);
    ck_assert_int_eq(r.status, 200);
    ck_assert_msg(strstr(r.body, "\"tokens\":[\"\\u0000\"]") != NULL, "%s", r.body);
    ck_assert_msg(strstr(r.body, "\"top_logprobs\":[{\"\\u0000\":") != NULL, "%s", r.body);
    ck_assert_msg(strstr(r.body, "{\"\":") == NULL, "an empty key: %s", r.body);
    http_resp_free(&r);
}
END_TEST

/* logprobs: recompute the logits of prompt + generated tokens with one forward here */
START_TEST(test_logprobs_match_recomputed)
{
    int status;
    json_t *j = post_json(g_port,
                          "{\"prompt\": [5, 77, 300, 12, 9, 100, 41], \"max_tokens\": 6, \"temperature\": 0, "
                          "\"logprobs\": 3, \"return_token_ids\": true}",
                          &status);
    ck_assert_int_eq(status, 200);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    json_t *lp = json_object_get(ch, "logprobs");
    json_t *tids = json_object_get(ch, "token_ids");
    int n = (int)json_array_size(tids);
    ck_assert_int_eq(n, 6);
    int32_t all[32] = {5, 77, 300, 12, 9, 100, 41};
    int np = 7;
    for (int i = 0; i < n; i++) {
        all[np + i] = (int32_t)json_integer_value(json_array_get(tids, i));
    }
    pd_backend_t *be = NULL;
    ck_assert_int_eq(pd_backend_create("cpu", 2, &be), PD_OK);
    pd_model_t *m = NULL;
    ck_assert_int_eq(pd_model_load(g_model, be, &m), PD_OK);
    const pd_model_config_t *mc = pd_model_config(m);
    int T = np + n - 1, V = mc->vocab_size, bs = 16, nb = (T + bs - 1) / bs + 1;
    pd_kv_view_t *views = calloc((size_t)mc->num_layers, sizeof(pd_kv_view_t));
    for (int l = 0; l < mc->num_layers; l++) {
        views[l] = (pd_kv_view_t){NULL, PD_DTYPE_F32, nb, bs, mc->num_kv_heads, mc->head_size};
        be->ops->alloc(be, (size_t)pd_page_elems(bs, mc->num_kv_heads, mc->head_size) * nb * 4,
                       &views[l].base);
    }
    int32_t pos[32], slots[32], lidx[32], table[8], cu[2] = {0, T}, lens[1] = {T};
    for (int b = 0; b < nb; b++) {
        table[b] = b + 1;
    }
    for (int t = 0; t < T; t++) {
        pos[t] = t;
        slots[t] = table[t / bs] * bs + t % bs;
        lidx[t] = t;
    }
    float *logits = malloc((size_t)T * V * sizeof(float));
    pd_batch_t batch = {T, all, pos};
    pd_attn_meta_t meta = {1, T, cu, lens, table, nb, slots, 0, NULL};
    ck_assert_int_eq(pd_model_forward(m, &batch, views, &meta, lidx, T, NULL, logits), PD_OK);
    for (int i = 0; i < n; i++) {
        const float *row = logits + (size_t)(np - 1 + i) * V; /* predicts token np + i */
        double mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) {
            mx = row[v] > mx ? row[v] : mx;
        }
        for (int v = 0; v < V; v++) {
            sum += exp(row[v] - mx);
        }
        double want = row[all[np + i]] - mx - log(sum);
        double got = json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), (size_t)i));
        ck_assert_msg(fabs(got - want) < 1e-4, "token %d: logprob %g vs recomputed %g", i, got, want);
        /* greedy: the sampled token is the most likely one. top_logprobs is keyed by token text
         * (OpenAI's format), so byte tokens that render alike (U+FFFD) share a key: 1..3 keys */
        json_t *top = json_array_get(json_object_get(lp, "top_logprobs"), (size_t)i);
        ck_assert_uint_ge(json_object_size(top), 1);
        ck_assert_uint_le(json_object_size(top), 3);
        const char *k;
        json_t *v;
        double best = -INFINITY;
        json_object_foreach(top, k, v)
        {
            best = json_real_value(v) > best ? json_real_value(v) : best;
        }
        ck_assert(fabs(best - want) < 1e-4);
    }
    ck_assert_uint_eq(json_array_size(json_object_get(lp, "text_offset")), (size_t)n);
    ck_assert_int_eq(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 0)), 0);
    for (int l = 0; l < mc->num_layers; l++) {
        be->ops->free(be, views[l].base);
    }
    free(views), free(logits);
    pd_model_free(m);
    pd_backend_destroy(be);
    json_decref(j);
}
END_TEST

/* ------------------------------------------------------------------ errors */

static void expect_error(int port, const char *method, const char *path, const char *headers,
                         const char *body, int status, const char *type, const char *msg_part)
{
    http_resp_t r;
    int fd = http_send(port, method, path, headers, body, body ? strlen(body) : 0, 30000);
    ck_assert_int_ge(fd, 0);
    ck_assert_msg(http_read_response(fd, &r) == 0, "%s %s: no answer (body %.40s)", method, path,
                  body != NULL ? body : "");
    ck_assert_msg(r.status == status, "%s %s: status %d, want %d (%s)", method, path, r.status, status,
                  r.body);
    json_t *j = json_loads(r.body, 0, NULL);
    ck_assert_msg(j != NULL, "error body is not JSON: %s", r.body);
    json_t *e = json_object_get(j, "error");
    ck_assert(json_is_object(e));
    ck_assert(json_is_string(json_object_get(e, "message")));
    ck_assert_str_eq(json_string_value(json_object_get(e, "type")), type);
    ck_assert(json_object_get(e, "param") != NULL);
    ck_assert_int_eq(json_integer_value(json_object_get(e, "code")), status);
    if (msg_part != NULL) {
        ck_assert_msg(strstr(json_string_value(json_object_get(e, "message")), msg_part) != NULL,
                      "message: %s", json_string_value(json_object_get(e, "message")));
    }
    json_decref(j);
    http_resp_free(&r);
}

START_TEST(test_error_codes)
{
    const char *P = "/v1/completions";
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": ", 400, "BadRequestError", "invalid JSON");
    expect_error(g_port, "POST", P, NULL, "[1, 2]", 400, "BadRequestError", "JSON object");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": \"x\", \"max_tokens\": \"ten\"}", 400,
                 "BadRequestError", "max_tokens");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": \"x\", \"temperature\": 9}", 400, "BadRequestError",
                 "temperature");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": \"x\", \"n\": 3, \"temperature\": 0}", 400,
                 "BadRequestError", "greedy");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": 17}", 400, "BadRequestError", "prompt");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": [1, 2, 999999]}", 400, "BadRequestError",
                 "outside the vocabulary");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": [1, 2, -1]}", 400, "BadRequestError",
                 "outside the vocabulary");
    char *longp = malloc(40000);
    strcpy(longp, "{\"prompt\": [");
    for (int i = 0; i < 600; i++) {
        strcat(longp, i ? ",7" : "7");
    }
    strcat(longp, "]}");
    expect_error(g_port, "POST", P, NULL, longp, 400, "BadRequestError", "maximum context length is 512");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": [1, 2], \"max_tokens\": 600}", 400, "BadRequestError",
                 "maximum context length");
    /* deep nesting is refused before parsing */
    char deep[400] = "{\"prompt\": \"x\", \"a\": ";
    for (int i = 0; i < 100; i++) {
        strcat(deep, "[");
    }
    for (int i = 0; i < 100; i++) {
        strcat(deep, "]");
    }
    strcat(deep, "}");
    expect_error(g_port, "POST", P, NULL, deep, 400, "BadRequestError", "nests deeper");
    expect_error(g_port, "POST", P, NULL, "{\"prompt\": \"x\", \"model\": \"gpt-17\"}", 404, "NotFoundError",
                 "does not exist");
    expect_error(g_port, "GET", "/v2/whatever", NULL, NULL, 404, "NotFoundError", NULL);
    expect_error(g_port, "GET", P, NULL, NULL, 405, "MethodNotAllowedError", NULL);
    expect_error(g_port, "POST", "/v1/models", NULL, "{}", 405, "MethodNotAllowedError", NULL);
    /* 413: over --max-request-bytes (64 KiB here) */
    size_t big = 70000;
    char *huge = malloc(big + 64);
    snprintf(huge, 32, "{\"prompt\": \"");
    memset(huge + strlen(huge), 'a', big - 20);
    strcpy(huge + big - 20 + 12, "\"}");
    expect_error(g_port, "POST", P, NULL, huge, 413, "RequestTooLargeError", "exceeds");
    free(huge);
    free(longp);
    /* the server is still fine */
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "GET", "/health", NULL, NULL, &r, 10000), 0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
}
END_TEST

/* cached_tokens of a completion (0 when the usage has no prompt_tokens_details). */
static int cached_tokens(const char *body)
{
    int status;
    json_t *j = post_json(g_port, body, &status);
    ck_assert_msg(status == 200, "HTTP %d", status);
    int n = (int)json_integer_value(json_object_get(
        json_object_get(json_object_get(j, "usage"), "prompt_tokens_details"), "cached_tokens"));
    json_decref(j);
    return n;
}

/* Fields a client sets are honoured or refused, never ignored (issue 51): cache_salt isolates the
 * prefix cache (the same prompt under another salt, or none, finds nothing cached; the same salt
 * does); add_special_tokens false drops the BOS of a text prompt; priority, logprob_token_ids and a
 * request's own chat_template get a 400 naming them. */
START_TEST(test_request_fields_honoured_or_refused)
{
    char body[1024], ids[600] = "";
    for (int i = 0, k = 0; i < 100; i++) { /* 100 tokens: several full blocks */
        k += snprintf(ids + k, sizeof(ids) - (size_t)k, "%s%d", i ? "," : "", 7 + (i * 13) % 200);
    }
    snprintf(body, sizeof(body), "{\"prompt\": [%s], \"max_tokens\": 1, \"cache_salt\": \"tenant-a\"}", ids);
    cached_tokens(body);
    ck_assert_int_gt(cached_tokens(body), 0); /* the same salt: cached */
    snprintf(body, sizeof(body), "{\"prompt\": [%s], \"max_tokens\": 1, \"cache_salt\": \"tenant-b\"}", ids);
    ck_assert_int_eq(cached_tokens(body), 0); /* another salt: nothing */
    snprintf(body, sizeof(body), "{\"prompt\": [%s], \"max_tokens\": 1}", ids);
    ck_assert_int_eq(cached_tokens(body), 0); /* no salt: nothing either */
    expect_error(g_port, "POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"cache_salt\": \"\"}", 400,
                 "BadRequestError", "cache_salt");
    int status;
    json_t *a =
        post_json(g_port, "{\"prompt\": \"hello\", \"max_tokens\": 1, \"return_token_ids\": true}", &status);
    json_t *b = post_json(g_port,
                          "{\"prompt\": \"hello\", \"max_tokens\": 1, \"return_token_ids\": true, "
                          "\"add_special_tokens\": false}",
                          &status);
    json_t *pa = json_object_get(json_array_get(json_object_get(a, "choices"), 0), "prompt_token_ids");
    json_t *pb = json_object_get(json_array_get(json_object_get(b, "choices"), 0), "prompt_token_ids");
    ck_assert_uint_eq(json_array_size(pa), json_array_size(pb) + 1); /* the BOS */
    ck_assert(json_equal(json_array_get(pa, 1), json_array_get(pb, 0)));
    json_decref(a), json_decref(b);
    expect_error(g_port, "POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"priority\": 5}", 400,
                 "BadRequestError", "priority");
    expect_error(g_port, "POST", "/v1/completions", NULL, "{\"prompt\": \"x\", \"logprob_token_ids\": [5]}",
                 400, "BadRequestError", "logprob_token_ids");
    expect_error(g_port, "POST", "/v1/chat/completions", NULL,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template\": \"{{ 1 }}\"}",
                 400, "BadRequestError", "chat_template");
}
END_TEST

/* Open fds of process pid. */
static int fds_of(pid_t pid)
{
    char dir[64];
    snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
    return tu_count_entries(dir);
}

/* Slow clients against a listener started with --http-request-timeout 1 --http-max-connections 24
 * (issue 51: 1,100 connections sending a byte every 2 s held every fd and legitimate requests hung):
 * 40 connections stuck in their headers, 8 of them dribbling a byte every 0.2 s. The listener never
 * holds more than the cap (plus its own fds), a legitimate GET is answered at once meanwhile, and
 * every slow connection is closed by the deadline. */
static void check_slow_clients(int port, pid_t pid, const char *get_path)
{
    int base = fds_of(pid);
    int slow[40];
    for (int i = 0; i < 40; i++) {
        slow[i] = http_connect(port, 2000);
        ck_assert_int_ge(slow[i], 0);
        const char part[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n";
        ck_assert_int_eq(write(slow[i], part, sizeof(part) - 1), (ssize_t)(sizeof(part) - 1));
    }
    usleep(300 * 1000);
    ck_assert_msg(fds_of(pid) <= base + 24 + 2, "%d fds with 40 slow clients, %d before (cap 24)",
                  fds_of(pid), base);
    double t0 = tu_now();
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "GET", get_path, NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    ck_assert_msg(tu_now() - t0 < 1.0, "a GET took %.2f s beside the slow clients", tu_now() - t0);
    for (int k = 0; k < 10; k++) { /* 2 s of dribbling */
        for (int i = 32; i < 40; i++) {
            ssize_t w = send(slow[i], "X", 1, MSG_NOSIGNAL);
            (void)w;
        }
        usleep(200 * 1000);
    }
    for (int i = 0; i < 40; i++) {
        char buf[256];
        struct timeval tv = {3, 0};
        setsockopt(slow[i], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        ssize_t n;
        while ((n = recv(slow[i], buf, sizeof(buf), 0)) > 0) {
        }
        ck_assert_msg(n == 0 || (n < 0 && errno == ECONNRESET), "slow client %d still open (%zd, %s)", i, n,
                      strerror(errno));
        close(slow[i]);
    }
    usleep(300 * 1000);
    ck_assert_msg(fds_of(pid) <= base + 1, "%d fds after the slow clients left, %d before", fds_of(pid),
                  base);
    /* keep-alive: one request answered at once, then a second dribbled on the same connection is
     * held to the same deadline (from the end of the first reply) */
    int ka = http_connect(port, 3000);
    ck_assert_int_ge(ka, 0);
    char req[256];
    int rl = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", get_path);
    ck_assert_int_eq(write(ka, req, (size_t)rl), rl);
    char buf[4096];
    ssize_t got = recv(ka, buf, sizeof(buf) - 1, 0);
    ck_assert_msg(got > 12 && memcmp(buf, "HTTP/1.1 200", 12) == 0,
                  "keep-alive: no answer to the first request");
    const char part[] = "GET / HTTP/1.1\r\nHo";
    ck_assert_int_eq(send(ka, part, sizeof(part) - 1, MSG_NOSIGNAL), (ssize_t)(sizeof(part) - 1));
    double t1 = tu_now();
    ssize_t n;
    while ((n = recv(ka, buf, sizeof(buf), 0)) > 0) {
    }
    ck_assert_msg(n == 0 || (n < 0 && errno == ECONNRESET),
                  "keep-alive: the dribbling connection stayed open");
    ck_assert_msg(tu_now() - t1 < 2.9, "keep-alive: closed only after %.2f s", tu_now() - t1);
    close(ka);
}

START_TEST(test_slow_clients_cannot_fill_the_listener)
{
    int port;
    char *extra[] = {"--http-request-timeout", "1", "--http-max-connections", "24", NULL};
    pid_t pid = start_server("slow", extra, &port);
    check_slow_clients(port, pid, "/health");
    tu_stop(pid, 30);
    /* pd-proxy's listener: the same guard (no nodes needed for /version) */
    char port_file[512], log_file[512], bin[512];
    snprintf(port_file, sizeof(port_file), "%s/slowproxy.port", g_dir);
    snprintf(log_file, sizeof(log_file), "%s/slowproxy.log", g_dir);
    snprintf(bin, sizeof(bin), "%s/bin/pd-proxy", tu_binary_dir());
    char *argv[] = {bin,
                    "--port",
                    "0",
                    "--port-file",
                    port_file,
                    "--prefill",
                    "http://127.0.0.1:9",
                    "--decode",
                    "http://127.0.0.1:9",
                    "--http-request-timeout",
                    "1",
                    "--http-max-connections",
                    "24",
                    NULL};
    pid = tu_spawn(argv, log_file);
    port = tu_wait_port(pid, port_file, 60);
    ck_assert_int_gt(port, 0);
    check_slow_clients(port, pid, "/version");
    tu_stop(pid, 30);
}
END_TEST

/* A model whose own chat template uses a construct pdserve's Jinja lacks ({% include %}: templates
 * are one file here) still starts (issue 51: such a template stopped the node): completions are
 * served, chat requests get a 400 that names the problem and the way out. */
START_TEST(test_unparsable_model_template_serves_completions)
{
    char *model = tu_make_model("--preset tiny --arch llama");
    ck_assert_ptr_nonnull(model);
    char path[600];
    snprintf(path, sizeof(path), "%s/chat_template.jinja", model);
    const char *tpl = "{% for m in messages %}{% include 'message.jinja' %}{% endfor %}";
    ck_assert_int_eq(tu_write_file(path, tpl, strlen(tpl)), 0);
    int port;
    pid_t pid = start_server_model(model, "badtpl", NULL, &port);
    int status;
    json_t *j = post_json(port, "{\"prompt\": [5, 6], \"max_tokens\": 2}", &status);
    ck_assert_int_eq(status, 200);
    json_decref(j);
    expect_error(port, "POST", "/v1/chat/completions", NULL,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", 400, "BadRequestError",
                 "--chat-template");
    tu_stop(pid, 30);
    tu_rmrf(model);
    free(model);
}
END_TEST

/* --served-model-name takes several names, as vLLM's: /v1/models lists each, a request may name any,
 * answers carry the first (issue 51: the second name and every flag after it became offline prompts
 * and pd-serve exited 0). */
START_TEST(test_served_model_name_aliases)
{
    int port;
    char *extra[] = {"--served-model-name", "alpha", "beta", "--max-queue", "4", NULL};
    pid_t pid = start_server("alias", extra, &port);
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "GET", "/v1/models", NULL, NULL, &r, 10000), 0);
    json_t *j = json_loads(r.body, 0, NULL);
    http_resp_free(&r);
    json_t *data = json_object_get(j, "data");
    ck_assert_uint_eq(json_array_size(data), 2);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(data, 0), "id")), "alpha");
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(data, 1), "id")), "beta");
    json_decref(j);
    int status;
    j = post_json(port, "{\"model\": \"beta\", \"prompt\": [5, 6], \"max_tokens\": 2}", &status);
    ck_assert_int_eq(status, 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "model")), "alpha");
    json_decref(j);
    expect_error(port, "POST", "/v1/completions", NULL, "{\"model\": \"gamma\", \"prompt\": \"x\"}", 404,
                 "NotFoundError", "gamma");
    ck_assert_int_eq(http_request(port, "GET", "/v1/models/beta", NULL, NULL, &r, 10000), 0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    tu_stop(pid, 30);
}
END_TEST

START_TEST(test_api_key_and_queue_limit)
{
    int port;
    char *extra[] = {"--api-key", "sekret", "--max-queue", "1", "--max-num-seqs", "1", NULL};
    pid_t pid = start_server("auth", extra, &port);
    expect_error(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"x\"}", 401, "AuthenticationError",
                 NULL);
    expect_error(port, "POST", "/v1/completions", "Authorization: Bearer wrong\r\n", "{\"prompt\": \"x\"}",
                 401, "AuthenticationError", NULL);
    expect_error(port, "GET", "/v1/models", NULL, NULL, 401, "AuthenticationError", NULL);
    /* the tokenizer routes need the key too (issue 51: they did not), and the key given twice is
     * none (the first header decided) */
    expect_error(port, "POST", "/tokenize", NULL, "{\"prompt\": \"x\"}", 401, "AuthenticationError", NULL);
    expect_error(port, "POST", "/detokenize", NULL, "{\"tokens\": [5]}", 401, "AuthenticationError", NULL);
    expect_error(port, "GET", "/v1/models", "Authorization: Bearer sekret\r\nAuthorization: Bearer wrong\r\n",
                 NULL, 401, "AuthenticationError", NULL);
    expect_error(port, "GET", "/v1/models", "Authorization: Bearer wrong\r\nauthorization: Bearer sekret\r\n",
                 NULL, 401, "AuthenticationError", NULL);
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", "/tokenize", "Authorization: Bearer sekret\r\n",
                                  "{\"prompt\": \"x\"}", &r, 10000),
                     0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    ck_assert_int_eq(
        http_request(port, "GET", "/v1/models", "Authorization: Bearer sekret\r\n", NULL, &r, 10000), 0);
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(port, "GET", "/health", NULL, NULL, &r, 10000),
                     0); /* /health needs no key */
    ck_assert_int_eq(r.status, 200);
    http_resp_free(&r);
    /* one seat, a queue of one: a burst of 12 long requests sees 503s, the rest complete */
    int fds[12];
    const char *body = "{\"prompt\": \"queue\", \"max_tokens\": 200, \"ignore_eos\": true}";
    for (int i = 0; i < 12; i++) {
        fds[i] = http_send(port, "POST", "/v1/completions", "Authorization: Bearer sekret\r\n", body,
                           strlen(body), 120000);
        ck_assert_int_ge(fds[i], 0);
    }
    int ok = 0, busy = 0;
    for (int i = 0; i < 12; i++) {
        ck_assert_int_eq(http_read_response(fds[i], &r), 0);
        if (r.status == 503) {
            busy++;
            ck_assert_ptr_nonnull(strstr(r.body, "ServiceUnavailableError"));
        } else {
            ck_assert_int_eq(r.status, 200);
            ok++;
        }
        http_resp_free(&r);
    }
    ck_assert_int_gt(busy, 0);
    ck_assert_int_gt(ok, 0);
    ck_assert_int_eq(tu_stop(pid, 60), 0);
}
END_TEST

/* SIGTERM: /health turns 503, new requests get 503, the in-flight one completes, exit code 0 */
typedef struct bg_req {
    int port;
    const char *body;
    http_resp_t resp;
    int rc;
    const char *headers; /* extra request headers, or NULL */
} bg_req_t;

static void *bg_post(void *arg)
{
    bg_req_t *b = arg;
    b->rc = http_request(b->port, "POST", "/v1/completions", b->headers, b->body, &b->resp, 120000);
    return NULL;
}

/* A model slow enough (~100+ ms per 20 tokens here) that a long request is still generating
 * while a test acts on it. */
/* Waits (bounded by secs) until the server at port runs exactly n requests. */
static bool wait_running(int port, int n, double secs)
{
    double until = tu_now() + secs;
    while (tu_now() < until) {
        http_resp_t m;
        http_request(port, "GET", "/metrics", NULL, NULL, &m, 5000);
        bool one = m.body != NULL && pd_metrics_text_value(m.body, "vllm:num_requests_running", 0) == n;
        http_resp_free(&m);
        if (one) {
            return true;
        }
        usleep(10000);
    }
    return false;
}

static bool wait_one_running(int port, double secs)
{
    return wait_running(port, 1, secs);
}

START_TEST(test_graceful_drain)
{
    /* the request is still generating when SIGTERM and the late request arrive */
    char *slow = tu_make_model(SLOW_MODEL);
    ck_assert_ptr_nonnull(slow);
    int port;
    char *extra[] = {"--drain-timeout", "60", "--threads", "1", NULL};
    pid_t pid = start_server_model(slow, "drain", extra, &port);
    bg_req_t b = {
        port, "{\"prompt\": \"drain me\", \"max_tokens\": 300, \"ignore_eos\": true}", {0}, -1, NULL};
    pthread_t t;
    pthread_create(&t, NULL, bg_post, &b);
    /* SIGTERM must find it in flight */
    ck_assert_msg(wait_one_running(port, 60), "the long request never started running");
    kill(pid, SIGTERM);
    usleep(100000);
    expect_error(port, "POST", "/v1/completions", NULL, "{\"prompt\": \"late\"}", 503,
                 "ServiceUnavailableError", NULL);
    http_resp_t h;
    ck_assert_int_eq(http_request(port, "GET", "/health", NULL, NULL, &h, 5000), 0);
    ck_assert_int_eq(h.status, 503);
    http_resp_free(&h);
    pthread_join(t, NULL);
    ck_assert_int_eq(b.rc, 0);
    ck_assert_int_eq(b.resp.status, 200);
    ck_assert_ptr_nonnull(strstr(b.resp.body, "\"completion_tokens\":300"));
    http_resp_free(&b.resp);
    ck_assert_int_eq(tu_wait_exit(pid, 30), 0);
    tu_rmrf(slow);
    free(slow);
}
END_TEST

/* Streams pd-proxy can resume (its X-PD-Resumable header, set on decode legs under --migration-limit):
 * POST /admin/migrate ends them (once the engine took the migration: pd-serve has no connector, so no
 * KV lease goes with them), 200 without [DONE] (the proxy's sign to resume one elsewhere),
 * and the node stays up; SIGTERM does the same for the next one, while a stream without the header
 * runs to its end; the node then exits (0) in about the time that stream needs, not the 300 tokens
 * the handed-off ones asked for. */
START_TEST(test_drain_hands_off_resumable_streams)
{
    char *slow = tu_make_model(SLOW_MODEL);
    ck_assert_ptr_nonnull(slow);
    int port;
    char *extra[] = {"--drain-timeout", "60", "--threads", "1", NULL};
    pid_t pid = start_server_model(slow, "handoff", extra, &port);
    const char *long_body =
        "{\"prompt\": \"hand me off\", \"max_tokens\": 300, \"ignore_eos\": true, \"stream\": true}";
    bg_req_t res[2] = {{port, long_body, {0}, -1, "X-PD-Resumable: 1\r\n"},
                       {port, long_body, {0}, -1, "X-PD-Resumable: 1\r\n"}};
    bg_req_t own = {port,
                    "{\"prompt\": \"keep me\", \"max_tokens\": 400, \"ignore_eos\": true, \"stream\": true}",
                    {0},
                    -1,
                    NULL};
    pthread_t t[2], t_own;
    /* the body is nothing, {} or {"max": N >= 1} */
    static const char *bad[] = {"{\"max\": 0}", "{\"max\": \"1\"}", "{\"max\": 1, \"all\": true}", "[1]",
                                "x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        http_resp_t m;
        ck_assert_int_eq(http_request(port, "POST", "/admin/migrate", NULL, bad[i], &m, 10000), 0);
        ck_assert_msg(m.status == 400, "%s: HTTP %d", bad[i], m.status);
        http_resp_free(&m);
    }
    pthread_create(&t_own, NULL, bg_post, &own);
    for (int round = 0; round < 2; round++) { /* 0: POST /admin/migrate, 1: SIGTERM */
        /* only the stream without the header runs (round 1: the first handed-off one has left the
         * engine's batch), so that two running ones below are it and this round's */
        ck_assert_msg(wait_running(port, 1, 60), "round %d: the other stream is not running alone", round);
        pthread_create(&t[round], NULL, bg_post, &res[round]);
        ck_assert_msg(wait_running(port, 2, 60), "round %d: the two streams never ran together", round);
        double t0 = tu_now();
        if (round == 0) {
            http_resp_t m;
            ck_assert_int_eq(http_request(port, "POST", "/admin/migrate", NULL, "", &m, 10000), 0);
            ck_assert_int_eq(m.status, 200);
            ck_assert_ptr_nonnull(strstr(m.body, "\"handed_off\":1"));
            http_resp_free(&m);
        } else {
            kill(pid, SIGTERM);
        }
        pthread_join(t[round], NULL);
        double handed = tu_now() - t0;
        ck_assert_int_eq(res[round].rc, 0);
        ck_assert_int_eq(res[round].resp.status, 200);
        ck_assert_msg(strstr(res[round].resp.body, "[DONE]") == NULL, "round %d ended with [DONE]", round);
        ck_assert_msg(handed < 5.0, "round %d: the resumable stream ended %.1f s after", round, handed);
        http_resp_free(&res[round].resp);
    }
    pthread_join(t_own, NULL);
    ck_assert_int_eq(own.rc, 0);
    ck_assert_int_eq(own.resp.status, 200);
    ck_assert_ptr_nonnull(strstr(own.resp.body, "[DONE]"));
    ck_assert_ptr_null(strstr(own.resp.body, "\"error\""));
    int events = 0;
    for (const char *p = own.resp.body; (p = strstr(p, "\"finish_reason\":")) != NULL; p++) {
        events++;
    }
    ck_assert_int_eq(events, 400); /* every token of the stream without the header */
    http_resp_free(&own.resp);
    /* drained: it exits by itself (a second SIGTERM could land while it tears down, after its
     * handler is gone, and kill it) */
    ck_assert_int_eq(tu_wait_exit(pid, 30), 0);
    tu_rmrf(slow);
    free(slow);
}
END_TEST

typedef struct sse_events {
    int n;
    char *text[512];  /* each event's text (completions) or content (chat), malloc'd */
    int32_t ids[512]; /* each event's token id, -1 when it carries none */
    bool role, done;
} sse_events_t;

static void sse_free(sse_events_t *ev)
{
    for (int i = 0; i < ev->n; i++) {
        free(ev->text[i]);
    }
}

/* The events of a streamed request of several choices, per choice index: each event's token id
 * (-1: none) and text, whether a role event came, the usage's completion tokens. */
typedef struct choice_events {
    sse_events_t ch[8];
    int num_choices;
    int roles;
    json_int_t usage_completion; /* -1: no usage chunk */
    bool done;
} choice_events_t;

static void choice_events_parse(const char *body, bool chat, choice_events_t *ev)
{
    memset(ev, 0, sizeof(*ev));
    ev->usage_completion = -1;
    char *copy = strdup(body);
    for (char *line = strtok(copy, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: ", 6) != 0) {
            continue;
        }
        if (strcmp(line + 6, "[DONE]") == 0) {
            ev->done = true;
            continue;
        }
        json_t *j = json_loads(line + 6, JSON_ALLOW_NUL, NULL);
        ck_assert_ptr_nonnull(j);
        json_t *u = json_object_get(j, "usage");
        if (json_is_object(u)) {
            ev->usage_completion = json_integer_value(json_object_get(u, "completion_tokens"));
        }
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(j, "choices"), i, c)
        {
            int idx = (int)json_integer_value(json_object_get(c, "index"));
            ck_assert(idx >= 0 && idx < 8);
            ev->num_choices = idx + 1 > ev->num_choices ? idx + 1 : ev->num_choices;
            sse_events_t *e = &ev->ch[idx];
            json_t *d = json_object_get(c, "delta");
            if (chat && json_object_get(d, "role") != NULL) {
                ev->roles++;
                continue;
            }
            ck_assert_int_lt(e->n, 512);
            const char *t =
                json_string_value(chat ? json_object_get(d, "content") : json_object_get(c, "text"));
            e->text[e->n] = strdup(t != NULL ? t : "");
            json_t *ids = json_object_get(c, "token_ids");
            e->ids[e->n] =
                json_array_size(ids) == 1 ? (int32_t)json_integer_value(json_array_get(ids, 0)) : -1;
            e->n++;
        }
        json_decref(j);
    }
    free(copy);
}

static void choice_events_free(choice_events_t *ev)
{
    for (int k = 0; k < 8; k++) {
        sse_free(&ev->ch[k]);
    }
}

/* The events of a streamed completion of one choice (one token id per event). */
static void sse_parse(const char *body, bool chat, sse_events_t *ev)
{
    choice_events_t *all = malloc(sizeof(*all));
    ck_assert_ptr_nonnull(all);
    choice_events_parse(body, chat, all);
    *ev = all->ch[0]; /* its texts move to ev */
    ev->role = all->roles > 0;
    ev->done = all->done;
    for (int k = 1; k < 8; k++) {
        sse_free(&all->ch[k]);
    }
    free(all);
}

/* resume_token_ids (what pd-proxy sends when a decode node dies mid-stream): a stream resumed after
 * its first k tokens is, event for event, the rest of the whole stream (token ids and text, stop
 * strings and held-back text included), for greedy and seeded sampling with penalties, completions
 * and chat (no second role event); what it cannot continue is a 400 naming the field. */
START_TEST(test_resume_token_ids)
{
    const char *bodies[][2] = {
        {"/v1/completions",
         "{\"prompt\": \"The decode node died\", \"max_tokens\": 40, \"ignore_eos\": true, "
         "\"temperature\": 0"},
        {"/v1/completions",
         "{\"prompt\": \"The decode node died\", \"max_tokens\": 40, \"ignore_eos\": true, "
         "\"temperature\": 0.9, \"seed\": 77, \"frequency_penalty\": 0.4, \"stop\": [\"zq\", \"e t\"]"},
        {"/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"go on\"}], "
         "\"max_tokens\": 30, \"ignore_eos\": true, \"temperature\": 0.7, \"seed\": 5"},
    };
    for (size_t b = 0; b < sizeof(bodies) / sizeof(bodies[0]); b++) {
        bool chat = strstr(bodies[b][0], "chat") != NULL;
        char body[1024];
        snprintf(body, sizeof(body), "%s, \"stream\": true, \"return_token_ids\": true}", bodies[b][1]);
        http_resp_t r;
        ck_assert_int_eq(http_request(g_port, "POST", bodies[b][0], NULL, body, &r, 60000), 0);
        ck_assert_int_eq(r.status, 200);
        sse_events_t whole;
        sse_parse(r.body, chat, &whole);
        http_resp_free(&r);
        ck_assert(whole.done);
        ck_assert_int_ge(whole.n, 8);
        int ks[] = {1, 5, whole.n - 2};
        for (size_t ki = 0; ki < 3; ki++) {
            int k = ks[ki];
            char ids[2048] = "";
            for (int i = 0; i < k; i++) {
                snprintf(ids + strlen(ids), sizeof(ids) - strlen(ids), "%s%d", i ? ", " : "", whole.ids[i]);
            }
            snprintf(body, sizeof(body),
                     "%s, \"stream\": true, \"return_token_ids\": true, \"resume_token_ids\": [%s]}",
                     bodies[b][1], ids);
            ck_assert_int_eq(http_request(g_port, "POST", bodies[b][0], NULL, body, &r, 60000), 0);
            ck_assert_int_eq(r.status, 200);
            sse_events_t rest;
            sse_parse(r.body, chat, &rest);
            http_resp_free(&r);
            ck_assert(rest.done && !rest.role);
            ck_assert_msg(rest.n == whole.n - k, "body %zu after %d: %d events, the whole stream %d", b, k,
                          rest.n, whole.n);
            for (int i = 0; i < rest.n; i++) {
                ck_assert_int_eq(rest.ids[i], whole.ids[k + i]);
                ck_assert_str_eq(rest.text[i], whole.text[k + i]);
            }
            sse_free(&rest);
        }
        sse_free(&whole);
    }
    static const char *bad[] = {
        "{\"prompt\": \"x\", \"max_tokens\": 9, \"resume_token_ids\": [5]}", /* not streamed */
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": [5]}",
        "{\"prompt\": \"x\", \"stream\": true, \"echo\": true, \"resume_token_ids\": [5]}",
        "{\"prompt\": \"x\", \"stream\": true, \"resume_token_ids\": [5], \"kv_transfer_params\": {}}",
        /* a live migration's lease covers the prompt and every resumed token but the last */
        "{\"prompt\": [7, 8], \"stream\": true, \"resume_token_ids\": [5, 6], \"kv_transfer_params\": "
        "{\"do_remote_prefill\": true, \"transfer_mode\": \"pull\", \"remote_num_tokens\": 4}}",
        "{\"prompt\": \"x\", \"stream\": true, \"resume_token_ids\": [99999999]}",
        "{\"prompt\": \"x\", \"stream\": true, \"resume_token_ids\": []}",
        "{\"prompt\": \"x\", \"stream\": true, \"resume_token_ids\": \"5\"}",
        "{\"prompt\": [\"x\", \"y\"], \"stream\": true, \"resume_token_ids\": [5]}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        http_resp_t e;
        ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, bad[i], &e, 30000), 0);
        ck_assert_msg(e.status == 400 && strstr(e.body, "resume_token_ids") != NULL, "%s: HTTP %d %s", bad[i],
                      e.status, e.body);
        http_resp_free(&e);
    }
    /* as many tokens as max_tokens leave nothing to generate: an error, not an empty success */
    http_resp_t e;
    ck_assert_int_eq(
        http_request(g_port, "POST", "/v1/completions", NULL,
                     "{\"prompt\": \"x\", \"stream\": true, \"max_tokens\": 2, \"resume_token_ids\": [5, 6]}",
                     &e, 30000),
        0);
    ck_assert_msg(strstr(e.body, "nothing to generate") != NULL, "HTTP %d %s", e.status, e.body);
    http_resp_free(&e);
}
END_TEST

/* resume_token_ids for several choices (n > 1, a batch of prompts): one entry per choice, its tokens
 * or {"finished": true, "completion_tokens": K}. Each choice's events after the resumption are, event
 * for event, the rest of its events in the whole stream (seeded sampling: seed + j per choice); a
 * finished choice sends nothing, a choice with [] starts from its first token; no role events; the
 * usage counts every choice's tokens. What the node cannot continue is a 400 naming the field, and
 * so are leases of a live migration (kv_transfer_params.choices) that do not fit their choices. */
START_TEST(test_resume_several_choices)
{
    const char *bodies[][2] = {
        {"/v1/completions",
         "{\"prompt\": \"The decode node died\", \"n\": 3, \"max_tokens\": 24, \"ignore_eos\": true, "
         "\"temperature\": 0.9, \"seed\": 11, \"presence_penalty\": 0.5"},
        {"/v1/completions",
         "{\"prompt\": [\"a b c\", \"The decode\"], \"n\": 2, \"max_tokens\": 20, \"ignore_eos\": true, "
         "\"temperature\": 0.7, \"seed\": 3"},
        {"/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"go on\"}], \"n\": 2, "
         "\"max_tokens\": 18, \"ignore_eos\": true, \"temperature\": 0.8, \"seed\": 5"},
    };
    for (size_t b = 0; b < sizeof(bodies) / sizeof(bodies[0]); b++) {
        bool chat = strstr(bodies[b][0], "chat") != NULL;
        char body[8192];
        snprintf(body, sizeof(body),
                 "%s, \"stream\": true, \"return_token_ids\": true, \"stream_options\": {\"include_usage\": "
                 "true}}",
                 bodies[b][1]);
        http_resp_t r;
        ck_assert_int_eq(http_request(g_port, "POST", bodies[b][0], NULL, body, &r, 60000), 0);
        ck_assert_int_eq(r.status, 200);
        choice_events_t whole;
        choice_events_parse(r.body, chat, &whole);
        http_resp_free(&r);
        ck_assert(whole.done && whole.num_choices >= 2 && whole.usage_completion > 0);
        ck_assert_int_eq(whole.roles, chat ? whole.num_choices : 0);
        /* cut 0: each choice at its own point, one of them at none of its tokens; cut 1: choice 0
         * finished, the others at their middle */
        for (int cut = 0; cut < 2; cut++) {
            int ks[8];
            char entries[6144] = "";
            for (int k = 0; k < whole.num_choices; k++) {
                const sse_events_t *e = &whole.ch[k];
                ck_assert_int_ge(e->n, 6);
                ks[k] = cut == 0 ? (k == 1 ? 0 : (3 * k + 2) % (e->n - 1) + 1) : (k == 0 ? e->n : e->n / 2);
                size_t at = strlen(entries);
                if (cut == 1 && k == 0) {
                    snprintf(entries + at, sizeof(entries) - at,
                             "{\"finished\": true, \"completion_tokens\": %d}", e->n);
                } else {
                    snprintf(entries + at, sizeof(entries) - at, "[");
                    for (int i = 0; i < ks[k]; i++) {
                        ck_assert_int_ge(e->ids[i], 0);
                        at = strlen(entries);
                        snprintf(entries + at, sizeof(entries) - at, "%s%d", i ? ", " : "", e->ids[i]);
                    }
                    at = strlen(entries);
                    snprintf(entries + at, sizeof(entries) - at, "]");
                }
                at = strlen(entries);
                snprintf(entries + at, sizeof(entries) - at, "%s", k + 1 < whole.num_choices ? ", " : "");
            }
            snprintf(
                body, sizeof(body),
                "%s, \"stream\": true, \"return_token_ids\": true, \"stream_options\": {\"include_usage\": "
                "true}, \"resume_token_ids\": [%s]}",
                bodies[b][1], entries);
            ck_assert_int_eq(http_request(g_port, "POST", bodies[b][0], NULL, body, &r, 60000), 0);
            ck_assert_msg(r.status == 200, "body %zu cut %d: HTTP %d %s", b, cut, r.status, r.body);
            choice_events_t rest;
            choice_events_parse(r.body, chat, &rest);
            http_resp_free(&r);
            ck_assert(rest.done);
            ck_assert_int_eq(rest.roles, 0);
            ck_assert_int_eq(rest.usage_completion, whole.usage_completion);
            for (int k = 0; k < whole.num_choices; k++) {
                const sse_events_t *w = &whole.ch[k], *g = &rest.ch[k];
                ck_assert_msg(g->n == w->n - ks[k],
                              "body %zu cut %d choice %d after %d: %d events, the whole %d", b, cut, k, ks[k],
                              g->n, w->n);
                for (int i = 0; i < g->n; i++) {
                    ck_assert_int_eq(g->ids[i], w->ids[ks[k] + i]);
                    ck_assert_str_eq(g->text[i], w->text[ks[k] + i]);
                }
            }
            choice_events_free(&rest);
        }
        choice_events_free(&whole);
    }
    static const char *bad[] = {
        /* one entry per choice */
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": [[5]]}",
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": [5, 6]}",
        "{\"prompt\": [\"x\", \"y\"], \"stream\": true, \"resume_token_ids\": [[5], [6], [7]]}",
        /* nothing to go on from, nothing left to generate */
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": [[], []]}",
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
        "[{\"finished\": true, \"completion_tokens\": 3}, {\"finished\": true, \"completion_tokens\": 1}]}",
        /* a finished entry's shape */
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
        "[{\"finished\": true}, [5]]}",
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
        "[{\"finished\": false, \"completion_tokens\": 2}, [5]]}",
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
        "[{\"finished\": true, \"completion_tokens\": -1}, [5]]}",
        "{\"prompt\": \"x\", \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
        "[[99999999], []]}",
        /* a batch's KV parameters, several choices' lease */
        "{\"prompt\": [\"x\", \"y\"], \"stream\": true, \"resume_token_ids\": [[5], []], "
        "\"kv_transfer_params\": "
        "{\"kv_prefix\": {}}}",
        "{\"prompt\": [7, 8], \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": [[5, 6], "
        "[5]], "
        "\"kv_transfer_params\": {\"do_remote_prefill\": true, \"transfer_mode\": \"pull\", "
        "\"remote_num_tokens\": "
        "3}}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        http_resp_t e;
        ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, bad[i], &e, 30000), 0);
        ck_assert_msg(e.status == 400 && strstr(e.body, "resume_token_ids") != NULL, "%s: HTTP %d %s", bad[i],
                      e.status, e.body);
        http_resp_free(&e);
    }
    /* a live migration's leases, one per choice: each the pull parameters of its prompt and its
     * resumed tokens but the last, or null; alone in kv_transfer_params */
#define LEASE(nt) "{\"do_remote_prefill\": true, \"transfer_mode\": \"pull\", \"remote_num_tokens\": " #nt "}"
    static const char *bad_leases[] = {
        "[" LEASE(3) "]",                          /* one entry for two choices */
        "[" LEASE(3) ", " LEASE(2) ", null]",      /* three */
        "[" LEASE(4) ", null]",                    /* prompt 2 + 2 tokens - 1 is 3 */
        "[null, " LEASE(2) "]",                    /* choice 1 has no tokens to go with a lease */
        "[{\"kv_prefix\": {}}, null]",             /* not a migration's lease */
        "[" LEASE(3) ", null], \"kv_prefix\": {}", /* not alone */
    };
#undef LEASE
    for (size_t i = 0; i < sizeof(bad_leases) / sizeof(bad_leases[0]); i++) {
        char body[1024];
        snprintf(body, sizeof(body),
                 "{\"prompt\": [7, 8], \"stream\": true, \"n\": 2, \"temperature\": 1, \"resume_token_ids\": "
                 "[[5, 6], []], \"kv_transfer_params\": {\"choices\": %s}}",
                 bad_leases[i]);
        http_resp_t e;
        ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, body, &e, 30000), 0);
        ck_assert_msg(e.status == 400 && strstr(e.body, "kv_transfer_params.choices") != NULL,
                      "%s: HTTP %d %s", body, e.status, e.body);
        http_resp_free(&e);
    }
    http_resp_t e;
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL,
                                  "{\"prompt\": [7, 8], \"stream\": true, \"n\": 2, \"temperature\": 1, "
                                  "\"kv_transfer_params\": {\"choices\": [null, null]}}",
                                  &e, 30000),
                     0);
    ck_assert_msg(e.status == 400 && strstr(e.body, "goes with resume_token_ids") != NULL, "HTTP %d %s",
                  e.status, e.body);
    http_resp_free(&e);
}
END_TEST

/* A non-streamed client that closes its connection mid-request: the server sees it at once (it
 * watches the socket; libevent alone would notice only when writing the answer, after all the
 * tokens) and aborts the request, freeing its blocks. The request would run ~7 s to its end. */
START_TEST(test_non_streamed_client_gone_aborts)
{
    char *slow = tu_make_model(SLOW_MODEL);
    ck_assert_ptr_nonnull(slow);
    int port;
    char *extra[] = {"--threads", "1", "--max-model-len", "2048", NULL};
    pid_t pid = start_server_model(slow, "gone", extra, &port);
    const char *body = "{\"prompt\": \"leave me\", \"max_tokens\": 1500, \"ignore_eos\": true}";
    int fd = http_send(port, "POST", "/v1/completions", NULL, body, strlen(body), 60000);
    ck_assert_int_ge(fd, 0);
    ck_assert_msg(wait_one_running(port, 60), "the long request never started running");
    close(fd);
    double running = -1, aborts = 0, used = -1, t0 = tu_now();
    double until = t0 + 2; /* well inside the request's own run time */
    while (tu_now() < until) {
        http_resp_t m;
        http_request(port, "GET", "/metrics", NULL, NULL, &m, 5000);
        aborts = pd_metrics_text_value(m.body, "vllm:request_success_total{finished_reason=\"abort\"}", 0);
        running = pd_metrics_text_value(m.body, "vllm:num_requests_running", -1);
        used = pd_metrics_text_value(m.body, "pd:kv_blocks_used", -1);
        http_resp_free(&m);
        if (aborts == 1 && running == 0 && used == 0) {
            break;
        }
        usleep(20000);
    }
    ck_assert_msg(aborts == 1 && running == 0 && used == 0,
                  "%.1f s after the close: %.0f aborted, %.0f running, %.0f blocks used", tu_now() - t0,
                  aborts, running, used);
    ck_assert_int_eq(tu_stop(pid, 30), 0);
    tu_rmrf(slow);
    free(slow);
}
END_TEST

/* ------------------------------------------------------------------ load and disconnects */

typedef struct stream_job {
    int port;
    int max_tokens;
    int disconnect_after; /* 0: read to the end */
    int tokens;
    int done;
    int status;
} stream_job_t;

static void *stream_worker(void *arg)
{
    stream_job_t *j = arg;
    char body[256];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"stream %p\", \"max_tokens\": %d, \"stream\": true, \"ignore_eos\": true}",
             (void *)j, j->max_tokens);
    int fd = http_send(j->port, "POST", "/v1/completions", NULL, body, strlen(body), 120000);
    if (fd < 0) {
        return NULL;
    }
    if (j->disconnect_after > 0) {
        char buf[4096];
        int seen = 0;
        while (seen < j->disconnect_after) {
            ssize_t r = read(fd, buf, sizeof(buf) - 1);
            if (r <= 0) {
                break;
            }
            buf[r] = 0;
            for (char *p = buf; (p = strstr(p, "data: {")) != NULL; p++) {
                seen++;
            }
        }
        j->tokens = seen;
        close(fd); /* gone mid-stream */
        return NULL;
    }
    http_resp_t r;
    if (http_read_response(fd, &r) == 0) {
        j->status = r.status;
        for (char *p = r.body; (p = strstr(p, "\"finish_reason\"")) != NULL; p++) {
            j->tokens++;
        }
        j->done = strstr(r.body, "data: [DONE]") != NULL;
        http_resp_free(&r);
    }
    return NULL;
}

START_TEST(test_200_concurrent_streams)
{
    enum { N = 200 };
    stream_job_t *jobs = calloc(N, sizeof(stream_job_t));
    pthread_t *t = calloc(N, sizeof(pthread_t));
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < N; i++) {
        jobs[i] = (stream_job_t){g_port, 8, 0, 0, 0, 0};
        ck_assert_int_eq(pthread_create(&t[i], &attr, stream_worker, &jobs[i]), 0);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        ok += jobs[i].status == 200 && jobs[i].done && jobs[i].tokens == 8;
    }
    ck_assert_int_eq(ok, N); /* no request lost */
    free(jobs), free(t);
}
END_TEST

START_TEST(test_disconnects_free_the_pool)
{
    enum { N = 50 };
    stream_job_t *jobs = calloc(N, sizeof(stream_job_t));
    pthread_t *t = calloc(N, sizeof(pthread_t));
    http_resp_t m;
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &m, 10000), 0);
    double aborts_before =
        pd_metrics_text_value(m.body, "vllm:request_success_total{finished_reason=\"abort\"}", NAN);
    http_resp_free(&m);
    for (int i = 0; i < N; i++) {
        jobs[i] = (stream_job_t){g_port, 400, 2, 0, 0, 0};
        pthread_create(&t[i], NULL, stream_worker, &jobs[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        ck_assert_int_ge(jobs[i].tokens, 1); /* each saw the stream start */
    }
    /* within a bounded time every aborted request is gone and every block is free again */
    double used = -1, running = -1, waiting = -1, aborts = 0, free_b = 0, cached = 0;
    double end = tu_now() + 60;
    while (tu_now() < end) {
        ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &m, 10000), 0);
        used = pd_metrics_text_value(m.body, "pd:kv_blocks_used", NAN);
        running = pd_metrics_text_value(m.body, "vllm:num_requests_running", NAN);
        waiting = pd_metrics_text_value(m.body, "vllm:num_requests_waiting", NAN);
        aborts = pd_metrics_text_value(m.body, "vllm:request_success_total{finished_reason=\"abort\"}", NAN);
        free_b = pd_metrics_text_value(m.body, "pd:kv_blocks_free", NAN);
        cached = pd_metrics_text_value(m.body, "pd:kv_blocks_cached_free", NAN);
        http_resp_free(&m);
        if (used == 0 && running == 0 && waiting == 0 && aborts - aborts_before >= N) {
            break;
        }
        usleep(50000);
    }
    ck_assert_double_eq(used, 0);
    ck_assert_double_eq(running, 0);
    ck_assert_double_eq(waiting, 0);
    ck_assert_double_ge(aborts - aborts_before, N);
    ck_assert_double_gt(free_b + cached, 0);
    free(jobs), free(t);
}
END_TEST

/* ------------------------------------------------------------------ metrics */

/* A small Prometheus text parser: every line is a comment (# HELP/# TYPE) or
 * name{labels} value; returns the number of samples, -1 on a malformed line. */
static int prom_parse(const char *text, json_t *samples)
{
    int n = 0;
    char *copy = strdup(text);
    for (char *line = strtok(copy, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (line[0] == '#') {
            if (strncmp(line, "# HELP ", 7) != 0 && strncmp(line, "# TYPE ", 7) != 0) {
                free(copy);
                return -1;
            }
            continue;
        }
        char *sp = strrchr(line, ' ');
        if (sp == NULL) {
            free(copy);
            return -1;
        }
        *sp = '\0';
        char *endp;
        double v = strtod(sp + 1, &endp);
        if (*endp != '\0' && strcmp(sp + 1, "+Inf") != 0) {
            free(copy);
            return -1;
        }
        for (char *c = line; *c && *c != '{'; c++) {
            if (!(isalnum((unsigned char)*c) || *c == '_' || *c == ':')) {
                free(copy);
                return -1;
            }
        }
        json_object_set_new(samples, line, json_real(v));
        n++;
    }
    free(copy);
    return n;
}

START_TEST(test_metrics_parse_and_monotonic)
{
    http_resp_t a, b;
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &a, 10000), 0);
    ck_assert_ptr_nonnull(strcasestr(a.head, "text/plain"));
    int status;
    json_t *j =
        post_json(g_port, "{\"prompt\": \"count me\", \"max_tokens\": 5, \"ignore_eos\": true}", &status);
    ck_assert_int_eq(status, 200);
    json_decref(j);
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &b, 10000), 0);
    json_t *sa = json_object(), *sb = json_object();
    ck_assert_int_gt(prom_parse(a.body, sa), 20);
    ck_assert_int_gt(prom_parse(b.body, sb), 20);
    const char *key;
    json_t *v;
    int counters = 0;
    json_object_foreach(sa, key, v)
    {
        bool counter = strstr(key, "_total") != NULL || strstr(key, "_bucket") != NULL ||
                       strstr(key, "_count") != NULL || strstr(key, "_sum") != NULL;
        if (!counter) {
            continue;
        }
        json_t *after = json_object_get(sb, key);
        ck_assert_msg(after != NULL, "%s disappeared", key);
        ck_assert_msg(json_real_value(after) >= json_real_value(v), "%s went down", key);
        counters++;
    }
    ck_assert_int_gt(counters, 30);
    ck_assert_double_ge(pd_metrics_text_value(b.body, "vllm:generation_tokens_total", 0) -
                            pd_metrics_text_value(a.body, "vllm:generation_tokens_total", 0),
                        5);
    ck_assert_double_ge(
        pd_metrics_text_value(b.body, "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"}", 0), 1);
    ck_assert_ptr_nonnull(json_object_get(sb, "pd:engine_step_duration_seconds_count"));
    /* the node's prefill cost is known from start-up (the memory profile's forward) */
    ck_assert_double_gt(pd_metrics_text_value(a.body, "pd:prefill_cost_seconds_per_token", 0), 0);
    ck_assert_double_gt(pd_metrics_text_value(a.body, "pd:prefill_cost_seconds_per_position", 0), 0);
    json_decref(sa), json_decref(sb);
    http_resp_free(&a), http_resp_free(&b);
}
END_TEST

/* Every series of tests/reference/vllm_metrics.txt marked "all" is exported with its vLLM type and
 * the model_name/engine labels, with counts that follow a request; promtool parses the page and
 * finds nothing to lint but the colon that vLLM's own names carry. */
START_TEST(test_metrics_vllm_names)
{
    int status;
    json_t *j = post_json(
        g_port, "{\"prompt\": \"name me\", \"max_tokens\": 4, \"n\": 2, \"ignore_eos\": true}", &status);
    ck_assert_int_eq(status, 200);
    json_decref(j);
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &r, 10000), 0);
    char path[4096];
    snprintf(path, sizeof(path), "%s/tests/reference/vllm_metrics.txt", tu_source_dir());
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    char line[256], labels[300];
    snprintf(labels, sizeof(labels), "{model_name=\"%s\",engine=\"0\"}", strrchr(g_model, '/') + 1);
    int checked = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        char name[128], type[32], where[16];
        if (line[0] == '#' || sscanf(line, "%127s %31s %15s", name, type, where) != 3 ||
            strcmp(where, "all") != 0) {
            continue;
        }
        char want[256], series[512];
        snprintf(want, sizeof(want), "# TYPE %s %s\n", name, type);
        ck_assert_msg(strstr(r.body, want) != NULL, "no '%s' in /metrics", want);
        snprintf(series, sizeof(series), "%s%s%s", name, strcmp(type, "histogram") == 0 ? "_count" : "",
                 labels);
        ck_assert_msg(pd_metrics_text_value(r.body, series, -1) >= 0, "no %s sample", series);
        checked++;
    }
    fclose(f);
    ck_assert_int_ge(checked, 25);
    /* what one n=2, max_tokens=4 request adds up to */
    ck_assert_double_ge(pd_metrics_text_value(r.body, "vllm:request_params_n_bucket{le=\"2\"}", 0), 1);
    ck_assert_double_ge(pd_metrics_text_value(r.body, "vllm:request_generation_tokens_sum", 0), 8);
    ck_assert_double_ge(
        pd_metrics_text_value(r.body, "vllm:request_success_total{finished_reason=\"length\"}", 0), 2);
    ck_assert_ptr_nonnull(strstr(r.body, "vllm:cache_config_info{model_name="));
    ck_assert_ptr_nonnull(strstr(r.body, "block_size=\"16\""));
    /* promtool (Debian's prometheus): no parse error, no lint but the colon rule and vLLM's own
     * iteration_tokens_total histogram name */
    char tmpl[] = "/tmp/pd-metrics-XXXXXX";
    int fd = mkstemp(tmpl);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, r.body, r.body_len), (ssize_t)r.body_len);
    close(fd);
    char out[4096];
    snprintf(out, sizeof(out), "%s.lint", tmpl);
    int rc = tu_run(60, "promtool check metrics < %s > %s 2>&1", tmpl, out);
    FILE *lf = fopen(out, "r");
    ck_assert_ptr_nonnull(lf);
    int lints = 0;
    while (fgets(line, sizeof(line), lf) != NULL) {
        bool known =
            strstr(line, "metric names should not contain ':'") != NULL ||
            strncmp(line, "vllm:iteration_tokens_total non-counter metrics should not have", 63) == 0;
        ck_assert_msg(known, "promtool: %s", line);
        lints++;
    }
    fclose(lf);
    unlink(tmpl), unlink(out);
    ck_assert_msg(rc == 0 || (rc == 3 && lints > 0), "promtool check metrics exited %d (not installed?)", rc);
    http_resp_free(&r);
}
END_TEST

/* ------------------------------------------------------------------ the official openai client */

START_TEST(test_openai_npm_client)
{
    if (!tu_need(TU_NODE)) {
        return;
    }
    char dir[1024];
    ck_assert_msg(tu_npm_install("openai", "openai@4", dir, sizeof(dir)) == 0, "npm install openai@4 failed");
    char out[512];
    snprintf(out, sizeof(out), "%s/openai.json", g_dir);
    const char *model = strrchr(g_model, '/') + 1;
    ck_assert_int_eq(
        tu_run(120,
               "node %s/tests/reference/openai_client.mjs %s/node_modules http://127.0.0.1:%d/v1 %s "
               "\"Tell me about caches\" 12 > %s",
               tu_source_dir(), dir, g_port, model, out),
        0);
    json_t *res = json_load_file(out, 0, NULL);
    ck_assert_ptr_nonnull(res);
    /* the same request through our client */
    int status;
    char body[256];
    snprintf(body, sizeof(body),
             "{\"model\": \"%s\", \"prompt\": \"Tell me about caches\", \"max_tokens\": 12, "
             "\"temperature\": 0}",
             model);
    json_t *mine = post_json(g_port, body, &status);
    const char *text =
        json_string_value(json_object_get(json_array_get(json_object_get(mine, "choices"), 0), "text"));
    ck_assert_str_eq(json_string_value(json_object_get(res, "text")), text);
    ck_assert_str_eq(json_string_value(json_object_get(res, "stream_text")), text);
    ck_assert_str_eq(json_string_value(json_object_get(res, "finish")), "length");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(res, "usage"), "completion_tokens")),
                     12);
    ck_assert_int_eq(
        json_integer_value(json_object_get(json_object_get(res, "stream_usage"), "completion_tokens")), 12);
    json_decref(res), json_decref(mine);
}
END_TEST

/* ------------------------------------------------------------------ tool calls (server/tool_calls.h) */

static json_t *parse_calls(pd_tool_parser_t p, const char *text, size_t *content_len)
{
    return pd_tool_calls_parse(p, text, strlen(text), content_len);
}

static void expect_call(json_t *calls, size_t i, const char *name, const char *arguments)
{
    json_t *c = json_array_get(calls, i);
    ck_assert_ptr_nonnull(c);
    const char *id = json_string_value(json_object_get(c, "id"));
    ck_assert_msg(id != NULL && strncmp(id, "chatcmpl-tool-", 14) == 0 && strlen(id) == 14 + 32, "id %s", id);
    ck_assert_str_eq(json_string_value(json_object_get(c, "type")), "function");
    json_t *f = json_object_get(c, "function");
    ck_assert_str_eq(json_string_value(json_object_get(f, "name")), name);
    ck_assert_str_eq(json_string_value(json_object_get(f, "arguments")), arguments);
}

/* vLLM's three formats: Hermes/Qwen <tool_call> (text before the calls is the content, the last call
 * may be cut off by the stop), Llama 3 JSON (the reply is the calls; "parameters" or "arguments",
 * several separated by ";", an optional <|python_tag|>), Mistral [TOOL_CALLS] (a list); a call that
 * does not parse leaves the reply text; arguments are written as Python's json.dumps writes them
 * (", " and ": ", UTF-8 kept: checked against python3). While streaming, text that is or may become
 * a call is held back. */
/* tool_choice "required" streamed: fed a piece at a time (one byte, three, the whole), the reader
 * opens each call once its name is read and grows its arguments as the parameters arrive, re-dumped
 * as vLLM's json.dumps writes them (", " and ": ", escapes decoded, UTF-8 kept); joined, the deltas
 * are the whole reply's calls, whatever the pieces. */
START_TEST(test_required_tool_calls_stream)
{
    static const char reply[] =
        "[ {\"name\": \"get\\u005fweather\", \"parameters\": {\"c\":\"a}b\\\"[\\u00e9\" ,\"n\":[1,{\"x\" "
        ":2.50}]}}"
        ",\n {\"name\":\"add\",\"parameters\":7 } , {\"name\": \"s\", \"parameters\": \"x,}\"}]";
    size_t len = strlen(reply), content_len = 99;
    json_t *whole = pd_tool_calls_parse(PD_TOOL_PARSER_REQUIRED, reply, len, &content_len);
    ck_assert_ptr_nonnull(whole);
    ck_assert_uint_eq(content_len, 0);
    ck_assert_int_eq(json_array_size(whole), 3);
    static const char *names[] = {"get_weather", "add", "s"};
    static const char *args[] = {"{\"c\": \"a}b\\\"[é\", \"n\": [1, {\"x\": 2.5}]}", "7", "\"x,}\""};
    for (int k = 0; k < 3; k++) {
        json_t *fn = json_object_get(json_array_get(whole, (size_t)k), "function");
        ck_assert_str_eq(json_string_value(json_object_get(fn, "name")), names[k]);
        ck_assert_str_eq(json_string_value(json_object_get(fn, "arguments")), args[k]);
    }
    size_t steps[] = {1, 3, len};
    for (int s = 0; s < 3; s++) {
        pd_required_reader_t r = {0};
        char joined[3][128] = {"", "", ""};
        int opened = 0, pieces = 0;
        for (size_t upto = 0; upto < len;) {
            upto = upto + steps[s] < len ? upto + steps[s] : len;
            json_t *d = pd_tool_calls_required_read(&r, reply, upto);
            size_t i;
            json_t *e;
            json_array_foreach(d, i, e)
            {
                int idx = (int)json_integer_value(json_object_get(e, "index"));
                ck_assert_int_lt(idx, 3);
                json_t *fn = json_object_get(e, "function");
                if (json_object_get(e, "id") != NULL) {
                    ck_assert_int_eq(idx, opened++); /* calls open in order, each once */
                    ck_assert_str_eq(json_string_value(json_object_get(fn, "name")), names[idx]);
                }
                strcat(joined[idx], json_string_value(json_object_get(fn, "arguments")));
                pieces++;
            }
            json_decref(d);
        }
        ck_assert_int_eq(opened, 3);
        for (int k = 0; k < 3; k++) {
            ck_assert_str_eq(joined[k], args[k]);
        }
        if (steps[s] == 1) {
            ck_assert_int_gt(pieces, 20); /* the arguments grew byte by byte */
        }
    }
    json_decref(whole);
    ck_assert_ptr_null(pd_tool_calls_parse(PD_TOOL_PARSER_REQUIRED, "[]", 2, &content_len));
    ck_assert_ptr_null(pd_tool_calls_parse(PD_TOOL_PARSER_REQUIRED, "[{\"name\"", 8, &content_len));
}
END_TEST

/* tool_choice "auto" streamed: each parser's replies read in pieces (a byte, 3 bytes, random cuts)
 * open their calls once the names are read and grow the arguments, re-dumped as the whole reply's
 * parse writes them; with the end's deltas (pd_tool_calls_auto_finish) the joined stream equals
 * the whole parse: names, arguments, order. */
START_TEST(test_tool_calls_auto_streamed)
{
    static const struct {
        pd_tool_parser_t p;
        const char *reply;
        int calls;
    } cases[] = {
        {PD_TOOL_PARSER_HERMES,
         "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Par\\u00eds\", "
         "\"days\" :3,\"units\":[\"c\" , \"f\"],\"x\":1.50,\"y\":-0,\"z\":1e2,\"ok\":true,\"n\":null,"
         "\"e\":\"\\ud83d\\ude00 tab\\t \\\"q\\\" \\/ "
         "\\u001f\"}}\n</tool_call>\n<tool_call>\n{\"arguments\": "
         "{}, \"name\": \"late\"}\n</tool_call>\n<tool_call>{\"name\": \"s\", \"arguments\": \"raw "
         "\\\"text\\\"\"}",
         3},
        {PD_TOOL_PARSER_LLAMA3_JSON,
         "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"q\": \"日本 and more text here\", \"k\": [1, "
         "{\"d\": []}]}}; "
         "{\"name\": \"b\", \"parameters\": {}}",
         2},
        {PD_TOOL_PARSER_LLAMA3_JSON, "{\"name\":\"only\",\"parameters\":{\"v\":12345678901,\"w\":0.1}}", 1},
        {PD_TOOL_PARSER_MISTRAL,
         "Sure. [TOOL_CALLS][{\"name\": \"m1\", \"arguments\": {\"a\": 1}}, {\"name\": \"m2\", "
         "\"arguments\": "
         "{\"b\": [true, false]}}]",
         2},
        {PD_TOOL_PARSER_MISTRAL, "[TOOL_CALLS]{\"name\": \"one\", \"arguments\": {\"c\": \"d\"}}", 1},
        {PD_TOOL_PARSER_MISTRAL, "[TOOL_CALLS]v11a[ARGS]{\"p\": 1}[TOOL_CALLS]v11b[ARGS]{\"q\": [2, 3]}", 2},
    };
    pd_rng_t rng;
    pd_rng_seed(&rng, 5);
    int total_pieces = 0, total_early = 0;
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        const char *reply = cases[ci].reply;
        size_t len = strlen(reply), content_len = 0;
        json_t *whole = pd_tool_calls_parse(cases[ci].p, reply, len, &content_len);
        ck_assert_msg(whole != NULL && (int)json_array_size(whole) == cases[ci].calls, "case %zu", ci);
        for (int s = 0; s < 4; s++) {
            pd_auto_reader_t r = {0};
            char names[4][64] = {"", "", "", ""}, args[4][512] = {"", "", "", ""};
            int opened = 0, arg_pieces = 0, opened_early = 0;
            for (size_t upto = 0; upto < len;) {
                size_t step = s == 0   ? 1
                              : s == 1 ? 3
                              : s == 2 ? 1 + (size_t)(pd_rng_uniform(&rng) * 12)
                                       : len;
                upto = upto + step < len ? upto + step : len;
                json_t *d = pd_tool_calls_auto_read(cases[ci].p, &r, reply, upto);
                size_t i;
                json_t *e;
                json_array_foreach(d, i, e)
                {
                    int idx = (int)json_integer_value(json_object_get(e, "index"));
                    ck_assert_int_lt(idx, 4);
                    json_t *fn = json_object_get(e, "function");
                    if (json_object_get(e, "id") != NULL) {
                        ck_assert_int_eq(idx, opened++); /* calls open in order, each once */
                        snprintf(names[idx], sizeof(names[idx]), "%s",
                                 json_string_value(json_object_get(fn, "name")));
                        opened_early += upto < len;
                    }
                    const char *a = json_string_value(json_object_get(fn, "arguments"));
                    ck_assert_ptr_nonnull(a);
                    strcat(args[idx], a);
                    arg_pieces += a[0] != '\0';
                }
                json_decref(d);
            }
            json_t *d = pd_tool_calls_auto_finish(&r, whole);
            size_t i;
            json_t *e;
            json_array_foreach(d, i, e)
            {
                int idx = (int)json_integer_value(json_object_get(e, "index"));
                json_t *fn = json_object_get(e, "function");
                if (json_object_get(e, "id") != NULL) {
                    ck_assert_int_eq(idx, opened++);
                    snprintf(names[idx], sizeof(names[idx]), "%s",
                             json_string_value(json_object_get(fn, "name")));
                }
                strcat(args[idx], json_string_value(json_object_get(fn, "arguments")));
            }
            json_decref(d);
            ck_assert_int_eq(opened, cases[ci].calls);
            json_array_foreach(whole, i, e)
            {
                json_t *fn = json_object_get(e, "function");
                ck_assert_str_eq(names[i], json_string_value(json_object_get(fn, "name")));
                ck_assert_msg(strcmp(args[i], json_string_value(json_object_get(fn, "arguments"))) == 0,
                              "case %zu call %zu: streamed '%s', whole '%s'", ci, i, args[i],
                              json_string_value(json_object_get(fn, "arguments")));
            }
            total_pieces += arg_pieces;
            total_early += opened_early;
            if (s == 0) { /* byte by byte: the first call opened before the end, its arguments grew */
                ck_assert_msg(opened_early > 0 && arg_pieces > 2, "case %zu: %d opened early, %d pieces", ci,
                              opened_early, arg_pieces);
            }
            pd_auto_reader_free(&r);
        }
        json_decref(whole);
    }
    fprintf(stderr,
            "auto tool calls streamed: %d calls opened before their reply ended, %d argument pieces\n",
            total_early, total_pieces);
}
END_TEST

START_TEST(test_tool_call_parsers)
{
    ck_assert_int_eq(pd_tool_parser_by_name("hermes"), PD_TOOL_PARSER_HERMES);
    ck_assert_int_eq(pd_tool_parser_by_name("llama3_json"), PD_TOOL_PARSER_LLAMA3_JSON);
    ck_assert_int_eq(pd_tool_parser_by_name("mistral"), PD_TOOL_PARSER_MISTRAL);
    ck_assert_int_eq(pd_tool_parser_by_name("pythonic"), PD_TOOL_PARSER_NONE);
    size_t cl = 0;
    json_t *calls =
        parse_calls(PD_TOOL_PARSER_HERMES,
                    "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                    "\"Zürich\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>{\"name\": \"now\", "
                    "\"arguments\": {}}",
                    &cl);
    ck_assert_uint_eq(json_array_size(calls), 2);
    ck_assert_uint_eq(cl, strlen("Let me check.\n"));
    expect_call(calls, 0, "get_weather", "{\"city\": \"Zürich\", \"days\": [1, 2]}");
    expect_call(calls, 1, "now", "{}");
    ck_assert_str_ne(json_string_value(json_object_get(json_array_get(calls, 0), "id")),
                     json_string_value(json_object_get(json_array_get(calls, 1), "id")));
    json_decref(calls);
    /* the same arguments as Python writes them */
    char out[256] = "";
    FILE *py =
        popen("python3 -c 'import json; print(json.dumps({\"city\": \"Z\\u00fcrich\", \"days\": [1, 2]}, "
              "ensure_ascii=False))'",
              "r");
    ck_assert_ptr_nonnull(py);
    ck_assert_ptr_nonnull(fgets(out, sizeof(out), py));
    pclose(py);
    out[strcspn(out, "\n")] = '\0';
    ck_assert_str_eq(out, "{\"city\": \"Zürich\", \"days\": [1, 2]}");
    /* reals, escapes and key order as Python's json.dumps(json.loads(arguments), ensure_ascii=False)
     * writes them (vLLM's), whole and streamed (the stream's pieces joined) */
    static const char args_text[] = "{\"x\": 0.1, \"y\": 1e2, \"z\": 2.50, \"w\": 1e16, \"v\": -1.5e-7, "
                                    "\"s\": \"a\\u001fb\\\"\\/\\n\\u00e9\", \"b\": {\"k\": [1, -0.0, "
                                    "123456789.125, 1e-5, 0.0001, 5e-324]}, \"a\": true}";
    char path[] = "/tmp/pd-test-args-XXXXXX", cmd[256], want[512] = "";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, args_text, strlen(args_text)), (ssize_t)strlen(args_text));
    close(fd);
    snprintf(cmd, sizeof(cmd),
             "python3 -c 'import json; print(json.dumps(json.load(open(\"%s\")), ensure_ascii=False))'",
             path);
    py = popen(cmd, "r");
    ck_assert_ptr_nonnull(py);
    ck_assert_ptr_nonnull(fgets(want, sizeof(want), py));
    pclose(py);
    unlink(path);
    want[strcspn(want, "\n")] = '\0';
    char reply[768];
    snprintf(reply, sizeof(reply), "<tool_call>{\"name\": \"f\", \"arguments\": %s}</tool_call>", args_text);
    calls = parse_calls(PD_TOOL_PARSER_HERMES, reply, &cl);
    ck_assert_ptr_nonnull(calls);
    expect_call(calls, 0, "f", want);
    json_decref(calls);
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_HERMES, "no calls here", &cl));
    ck_assert_uint_eq(cl, strlen("no calls here"));
    ck_assert_ptr_null(
        parse_calls(PD_TOOL_PARSER_HERMES, "<tool_call>{\"name\": \"f\", \"argu</tool_call>", &cl));
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_HERMES, "<tool_call>{\"arguments\": {}}</tool_call>", &cl));

    calls =
        parse_calls(PD_TOOL_PARSER_LLAMA3_JSON,
                    "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"arguments\": {\"y\": "
                    "\"z\"}}",
                    &cl);
    ck_assert_uint_eq(json_array_size(calls), 2);
    ck_assert_uint_eq(cl, 0);
    expect_call(calls, 0, "a", "{\"x\": 1}");
    expect_call(calls, 1, "b", "{\"y\": \"z\"}");
    json_decref(calls);
    calls =
        parse_calls(PD_TOOL_PARSER_LLAMA3_JSON, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}", &cl);
    ck_assert_uint_eq(json_array_size(calls), 1);
    json_decref(calls);
    ck_assert_ptr_null(
        parse_calls(PD_TOOL_PARSER_LLAMA3_JSON, "Sure: {\"name\": \"a\", \"parameters\": {}}", &cl));
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_LLAMA3_JSON, "{{{{", &cl));
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_LLAMA3_JSON, "{\"name\": \"a\"} trailing words", &cl));

    calls = parse_calls(
        PD_TOOL_PARSER_MISTRAL,
        "Checking. [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"q\": \"v\"}}, {\"name\": \"g\", "
        "\"arguments\": {}}]",
        &cl);
    ck_assert_uint_eq(json_array_size(calls), 2);
    ck_assert_uint_eq(cl, strlen("Checking. "));
    expect_call(calls, 0, "f", "{\"q\": \"v\"}");
    expect_call(calls, 1, "g", "{}");
    json_decref(calls);
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_MISTRAL, "[TOOL_CALLS][]", &cl));
    /* the v11 tokenizers' form: [TOOL_CALLS]name[ARGS]{...} per call */
    calls = parse_calls(PD_TOOL_PARSER_MISTRAL,
                        "ok[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}", &cl);
    ck_assert_uint_eq(json_array_size(calls), 2);
    ck_assert_uint_eq(cl, 2);
    expect_call(calls, 0, "get_weather", "{\"city\": \"Paris\"}");
    expect_call(calls, 1, "now", "{}");
    json_decref(calls);
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_MISTRAL, "[TOOL_CALLS]f[ARGS]{\"a\": ", &cl));
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_MISTRAL, "[TOOL_CALLS]no args here", &cl));
    ck_assert_ptr_null(parse_calls(PD_TOOL_PARSER_NONE, "<tool_call>{\"name\": \"f\"}</tool_call>", &cl));

    /* streaming: what may still become a call is held back */
    const char *t = "Hello <tool_ca";
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_HERMES, t, strlen(t), 0), strlen("Hello "));
    t = "Hello <tool_call>{\"na";
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_HERMES, t, strlen(t), 0), strlen("Hello "));
    t = "Hello <b>";
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_HERMES, t, strlen(t), 0), strlen(t));
    t = "ok [TOOL";
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_MISTRAL, t, strlen(t), 0), 3);
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_LLAMA3_JSON, "", 0, 0), 0);
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_LLAMA3_JSON, "{\"na", 4, 0), 0);
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_LLAMA3_JSON, "<|pyth", 6, 0), 0);
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_LLAMA3_JSON, "Sure", 4, 0), 4);
    /* from an earlier answer on: only the text after it is looked at */
    t = "Hello <b> and <tool_ca";
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_HERMES, t, strlen(t), 9),
                      strlen("Hello <b> and "));
    ck_assert_uint_eq(pd_tool_calls_safe_prefix(PD_TOOL_PARSER_LLAMA3_JSON, "Sure {", 6, 4), 6);
}
END_TEST

int main(void)
{
    tu_probe_tools(TU_NODE);
    Suite *s = suite_create("server");
    TCase *tc = tcase_create("http");
    tcase_add_unchecked_fixture(tc, suite_setup, suite_teardown);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_tool_call_parsers);
    tcase_add_test(tc, test_tool_calls_auto_streamed);
    tcase_add_test(tc, test_required_tool_calls_stream);
    tcase_add_test(tc, test_completion_equals_engine_greedy);
    tcase_add_test(tc, test_direct_stream_bytes_and_slow_client);
    tcase_add_test(tc, test_direct_stream_partial_writes);
    tcase_add_test(tc, test_direct_stream_fd_cap);
    tcase_add_test(tc, test_completion_equals_engine_seeded);
    tcase_add_test(tc, test_logprobs_match_recomputed);
    tcase_add_test(tc, test_top_logprobs_hold_the_chosen_token);
    tcase_add_test(tc, test_served_model_name_aliases);
    tcase_add_test(tc, test_request_fields_honoured_or_refused);
    tcase_add_test(tc, test_slow_clients_cannot_fill_the_listener);
    tcase_add_test(tc, test_unparsable_model_template_serves_completions);
    tcase_add_test(tc, test_error_codes);
    tcase_add_test(tc, test_metrics_parse_and_monotonic);
    tcase_add_test(tc, test_metrics_vllm_names);
    tcase_add_test(tc, test_200_concurrent_streams);
    tcase_add_test(tc, test_disconnects_free_the_pool);
    tcase_add_test(tc, test_non_streamed_client_gone_aborts);
    tcase_add_test(tc, test_openai_npm_client);
    tcase_add_test(tc, test_api_key_and_queue_limit);
    tcase_add_test(tc, test_graceful_drain);
    tcase_add_test(tc, test_drain_hands_off_resumable_streams);
    tcase_add_test(tc, test_resume_token_ids);
    tcase_add_test(tc, test_resume_several_choices);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
