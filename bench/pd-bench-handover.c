/* bench/pd-bench-handover.c — what disaggregation adds to time-to-first-token (issue #8, item 2).
 * For each prompt length: TTFT of the prefill node alone (a 1-token completion sent straight to
 * it) and TTFT through the proxy (prefill + handover + the decode's first step), one request at
 * a time, fresh prompts (no prefix hits); the difference is the handover overhead, split with
 * the decode node's pd:kv_transfer_phase_seconds (queue, transfer, notify) and handshake
 * histograms. Baseline in the same run: the pipe's own read bandwidth between two endpoints
 * of this process (pages of the same size), giving "transfer time at the pipe's bandwidth";
 * goal: overhead ≤ that + 2 ms. A second same-run baseline: one memcpy of the same bytes between
 * buffers filled when the run began and idle until that prompt's P/D requests finished (this
 * VM's idle memory is slow to touch: see idle_pair_t).
 *   pd-bench-handover --proxy http://127.0.0.1:8000 --prefill http://127.0.0.1:8100 \
 *       --decode http://127.0.0.1:8200 --lens 512,2048,8192 --kv-bytes-per-token 8192 --pipe ucx */
#define _GNU_SOURCE
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_http.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rng.h"
#include "common/time.h"
#include "pipe/pipe.h"

typedef struct url {
    char host[128];
    int port;
} url_t;

static bool parse_url(const char *s, url_t *u)
{
    return s != NULL && sscanf(s, "http://%127[^:/]:%d", u->host, &u->port) == 2;
}

typedef pd_bench_http_resp_t resp_t;

/* One blocking request; returns the seconds it took (status in *r). */
static double request(struct event_base *b, const url_t *u, enum evhttp_cmd_type m, const char *path,
                      const char *body, resp_t *r)
{
    return pd_bench_http(b, u->host, u->port, m, path, body, 600, r);
}

typedef struct phases {
    double sum[5], count[5]; /* queue, transfer, notify, remote, handshake */
    double bytes;
} phases_t;

static void scrape(struct event_base *b, const url_t *dec, phases_t *p)
{
    static const char *names[5] = {"pd:kv_transfer_phase_seconds_sum{phase=\"queue\"}",
                                   "pd:kv_transfer_phase_seconds_sum{phase=\"transfer\"}",
                                   "pd:kv_transfer_phase_seconds_sum{phase=\"notify\"}",
                                   "pd:kv_transfer_phase_seconds_sum{phase=\"remote\"}",
                                   "pd:kv_handshake_seconds_sum"};
    static const char *counts[5] = {"pd:kv_transfer_phase_seconds_count{phase=\"queue\"}",
                                    "pd:kv_transfer_phase_seconds_count{phase=\"transfer\"}",
                                    "pd:kv_transfer_phase_seconds_count{phase=\"notify\"}",
                                    "pd:kv_transfer_phase_seconds_count{phase=\"remote\"}",
                                    "pd:kv_handshake_seconds_count"};
    resp_t r;
    request(b, dec, EVHTTP_REQ_GET, "/metrics", NULL, &r);
    memset(p, 0, sizeof(*p));
    if (r.status == 200) {
        for (int i = 0; i < 5; i++) {
            p->sum[i] = pd_metrics_text_value(r.body, names[i], 0);
            p->count[i] = pd_metrics_text_value(r.body, counts[i], 0);
        }
        p->bytes = pd_metrics_text_value(r.body, "pd:kv_transfer_bytes_total", 0);
    }
    free(r.body);
}

/* Mean seconds of the proxy's decode phase (decode request sent → its answer's first bytes). */
static void scrape_proxy(struct event_base *b, const url_t *px, double *sum, double *count)
{
    resp_t r;
    request(b, px, EVHTTP_REQ_GET, "/metrics", NULL, &r);
    *sum = *count = 0;
    if (r.status == 200) {
        *sum = pd_metrics_text_value(r.body, "pd_proxy:decode_first_byte_seconds_sum", 0);
        *count = pd_metrics_text_value(r.body, "pd_proxy:decode_first_byte_seconds_count", 0);
    }
    free(r.body);
}

static char *prompt_body(pd_rng_t *rng, int len, int vocab, int max_tokens, bool remote_decode)
{
    json_t *ids = json_array();
    for (int i = 0; i < len; i++) {
        json_array_append_new(ids, json_integer((json_int_t)pd_rng_below(rng, (uint64_t)vocab)));
    }
    json_t *b = json_pack("{s:o, s:i, s:f, s:b}", "prompt", ids, "max_tokens", max_tokens, "temperature", 0.0,
                          "ignore_eos", 1);
    if (remote_decode) {
        json_object_set_new(b, "kv_transfer_params", json_pack("{s:b}", "do_remote_decode", 1));
    }
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* ------------------------------------------------------------------ streamed requests */

/* One streamed completion: the arrival times of its first three token events. */
typedef struct stream_ctx {
    struct event_base *base;
    struct evbuffer *acc;
    double t_tok[3];
    int n_tok, status;
} stream_ctx_t;

static void on_stream_chunk(struct evhttp_request *hr, void *arg)
{
    stream_ctx_t *c = arg;
    double now = pd_time_now_s();
    evbuffer_add_buffer(c->acc, evhttp_request_get_input_buffer(hr));
    struct evbuffer_ptr end;
    while ((end = evbuffer_search(c->acc, "\n\n", 2, NULL)).pos >= 0) {
        size_t n = (size_t)end.pos;
        char *ev = malloc(n + 1);
        evbuffer_remove(c->acc, ev, n);
        evbuffer_drain(c->acc, 2);
        ev[n] = '\0';
        if (strncmp(ev, "data: {", 7) == 0 && strstr(ev, "\"text\":") != NULL && c->n_tok < 3) {
            c->t_tok[c->n_tok++] = now; /* a token's event (not the usage one) */
        }
        free(ev);
    }
}

static void on_stream_done(struct evhttp_request *hr, void *arg)
{
    stream_ctx_t *c = arg;
    c->status = hr != NULL ? evhttp_request_get_response_code(hr) : 0;
    event_base_loopexit(c->base, NULL);
}

/* Sends body streamed; *ttft, *itl2 and *itl3: seconds to the first token's event, from it to the
 * second's and from that to the third's (0 when missing). Returns the status. */
static int stream_request(struct event_base *b, const url_t *u, const char *body, double *ttft, double *itl2,
                          double *itl3)
{
    stream_ctx_t c = {b, evbuffer_new(), {0, 0, 0}, 0, 0};
    struct evhttp_connection *conn = evhttp_connection_base_new(b, NULL, u->host, (ev_uint16_t)u->port);
    evhttp_connection_set_timeout(conn, 600);
    struct evhttp_request *hr = evhttp_request_new(on_stream_done, &c);
    evhttp_request_set_chunked_cb(hr, on_stream_chunk);
    struct evkeyvalq *h = evhttp_request_get_output_headers(hr);
    evhttp_add_header(h, "Host", u->host);
    evhttp_add_header(h, "Content-Type", "application/json");
    evbuffer_add(evhttp_request_get_output_buffer(hr), body, strlen(body));
    double t0 = pd_time_now_s();
    if (evhttp_make_request(conn, hr, EVHTTP_REQ_POST, "/v1/completions") == 0) {
        event_base_dispatch(b);
    }
    *ttft = c.n_tok > 0 ? c.t_tok[0] - t0 : 0;
    *itl2 = c.n_tok > 1 ? c.t_tok[1] - c.t_tok[0] : 0;
    *itl3 = c.n_tok > 2 ? c.t_tok[2] - c.t_tok[1] : 0;
    evhttp_connection_free(conn);
    evbuffer_free(c.acc);
    return c.status;
}

/* The prefill's own TTFT sum (vllm:time_to_first_token_seconds, arrival to its first output). */
static double server_ttft_sum(struct event_base *b, const url_t *u)
{
    resp_t r;
    request(b, u, EVHTTP_REQ_GET, "/metrics", NULL, &r);
    double v = r.status == 200 ? pd_metrics_text_value(r.body, "vllm:time_to_first_token_seconds_sum", 0) : 0;
    free(r.body);
    return v;
}

static char *stream_body(pd_rng_t *rng, int len, int vocab, int max_tokens)
{
    char *plain = prompt_body(rng, len, vocab, max_tokens, false);
    json_t *j = json_loads(plain, 0, NULL);
    free(plain);
    json_object_set_new(j, "stream", json_true());
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[n] (sorts v). */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* First-token handover (pd-proxy --first-token-from-prefill) against the decode sampling it
 * (--no-first-token-from-prefill, a second proxy over the same nodes): streamed 3-token requests
 * one at a time, fresh prompts. The prefill's own TTFT for each request (its /metrics) is taken
 * out of the client's, so what is left is what the path adds: HTTP hops, the proxy and, without
 * the handover, the KV move and the decode's first step. The gaps between tokens are medians:
 * on this VM a thread woken on an idle vCPU can wait a few ms to run, which delivers a token
 * together with the next now and then (a gap of 0 and one twice as long), and a mean mixes those
 * in. The third token's gap is the decode's steady step, for comparison with the second's. */
static void handover_section(struct event_base *b, const url_t *px, const url_t *legacy, const url_t *pf,
                             const char *lens, int repeat, int vocab, pd_rng_t *rng, char *table, size_t cap)
{
    size_t tl = strlen(table);
    tl += (size_t)snprintf(
        table + tl, cap - tl,
        "\n| prompt | path | TTFT (ms) | prefill's own TTFT (ms) | added by the path (ms) | added minus the "
        "prefill alone's (ms) | goal ≤ 2 ms | second token − first, p50 (ms) | third − second, p50 (ms) | "
        "second token from arrival (ms) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n");
    char *list = strdup(lens), *save = NULL;
    for (char *t = strtok_r(list, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        int len = atoi(t);
        const url_t *paths[3] = {pf, px, legacy};
        const char *names[3] = {"prefill alone", "P/D, first token from the prefill",
                                "P/D, decode samples it"};
        double added[3] = {0, 0, 0};
        double *i2s = calloc((size_t)repeat, sizeof(double)), *i3s = calloc((size_t)repeat, sizeof(double));
        for (int p = 0; p < 3 && i2s != NULL && i3s != NULL; p++) {
            double ttft = 0, own = 0;
            int ok = 0;
            char *w = stream_body(rng, len, vocab, 3); /* untimed: workspaces, first contact */
            double a, c2, c3;
            stream_request(b, paths[p], w, &a, &c2, &c3);
            free(w);
            for (int k = 0; k < repeat; k++) {
                char *body = stream_body(rng, len, vocab, 3);
                double s0 = server_ttft_sum(b, pf), t1;
                ok += stream_request(b, paths[p], body, &t1, &i2s[k], &i3s[k]) == 200 && t1 > 0;
                own += server_ttft_sum(b, pf) - s0;
                ttft += t1;
                free(body);
            }
            if (ok != repeat) {
                pd_log_error("handover section, %d tokens, %s: %d of %d requests failed", len, names[p],
                             repeat - ok, repeat);
            }
            ttft = ttft / repeat * 1e3, own = own / repeat * 1e3;
            double itl = median(i2s, repeat) * 1e3, itl3 = median(i3s, repeat) * 1e3;
            added[p] = ttft - own;
            double rel = added[p] - added[0];
            fprintf(stderr,
                    "pd-bench-handover: %d tokens, %s: TTFT %.1f ms (prefill's own %.1f), second token +%.1f "
                    "ms, third +%.1f ms (p50)\n",
                    len, names[p], ttft, own, itl, itl3);
            char goal[32] = "";
            if (p == 1) {
                snprintf(goal, sizeof(goal), "%s", rel <= 2 ? "met" : "NOT met");
            }
            tl += (size_t)snprintf(table + tl, cap - tl,
                                   "| %d | %s | %.1f | %.1f | %.2f | %s%.2f | %s | %.1f | %.1f | %.1f |\n",
                                   len, names[p], ttft, own, added[p], p == 0 ? "(baseline) " : "",
                                   p == 0 ? 0.0 : rel, goal, itl, itl3, ttft + itl);
        }
        free(i2s);
        free(i3s);
    }
    free(list);
}

static void done_cb(void *arg, pd_status_t st)
{
    *(int *)arg = st == PD_OK ? 1 : -1;
}

/* A buffer pair of `bytes` filled now and left alone until idle_copy_ms copies it: the same-run
 * baseline for this VM's memory, which gets slower to touch the longer it sits idle (a 64 MiB
 * memcpy between buffers idle for 120 s took 10-105 ms here vs 8 ms fresh), as a decode's
 * free KV blocks and a prefill's finished ones do while a long prefill runs. Shared anonymous
 * memory, like the nodes' shared-memory KV regions. */
typedef struct idle_pair {
    uint8_t *src, *dst;
    size_t bytes;
    double since;
} idle_pair_t;

static void idle_pair_init(idle_pair_t *ip, size_t bytes)
{
    memset(ip, 0, sizeof(*ip));
    void *s = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    void *d = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED || d == MAP_FAILED) {
        return;
    }
    ip->src = s, ip->dst = d, ip->bytes = bytes;
    memset(ip->src, 1, bytes);
    memset(ip->dst, 2, bytes);
    __asm__ volatile("" : : "r"(ip->src), "r"(ip->dst) : "memory");
    ip->since = pd_time_now_s();
}

/* Copies the pair once (ms; 0 when it could not be allocated) and frees it; *idle_s: how long it sat. */
static double idle_copy_ms(idle_pair_t *ip, double *idle_s)
{
    *idle_s = 0;
    if (ip->src == NULL) {
        return 0;
    }
    *idle_s = pd_time_now_s() - ip->since;
    double t0 = pd_time_now_s();
    memcpy(ip->dst, ip->src, ip->bytes);
    __asm__ volatile("" : : "r"(ip->dst) : "memory");
    double ms = (pd_time_now_s() - t0) * 1e3;
    munmap(ip->src, ip->bytes), munmap(ip->dst, ip->bytes);
    ip->src = ip->dst = NULL;
    return ms;
}

/* The pipe's read bandwidth for page-sized ranges between two endpoints of this process. */
static double pipe_read_gbps(const char *kind, size_t page, size_t bytes)
{
    pd_pipe_config_t c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    pd_pipe_t *a = NULL, *b = NULL;
    if (pd_pipe_create(&c, &a) != PD_OK || pd_pipe_create(&c, &b) != PD_OK) {
        pd_pipe_destroy(a);
        return 0;
    }
    uint8_t aa[PD_PIPE_ADDR_MAX], ba[PD_PIPE_ADDR_MAX], d[PD_PIPE_RKEY_MAX];
    size_t al = sizeof(aa), bl = sizeof(ba), dl = sizeof(d);
    pd_pipe_peer_t *ab = NULL, *bpa = NULL;
    pd_pipe_region_t *ra = NULL, *rb = NULL;
    pd_pipe_remote_t *rr = NULL;
    double gbps = 0;
    if (a->ops->address(a, aa, &al) == PD_OK && b->ops->address(b, ba, &bl) == PD_OK &&
        a->ops->connect(a, ba, bl, NULL, &ab) == PD_OK && b->ops->connect(b, aa, al, NULL, &bpa) == PD_OK &&
        a->ops->alloc_region(a, bytes, &ra) == PD_OK && b->ops->alloc_region(b, bytes, &rb) == PD_OK &&
        b->ops->export_region(b, rb, bpa, false, d, &dl) == PD_OK &&
        a->ops->import_region(a, ab, d, dl, &rr) == PD_OK) {
        memset(ra->base, 1, bytes);
        memset(rb->base, 2, bytes);
        int n = (int)(bytes / page);
        pd_page_xfer_t *pg = malloc((size_t)n * sizeof(*pg));
        for (int i = 0; i < n; i++) {
            /* remote pages in another order: ranges do not coalesce (the worst case for a block list) */
            int j = (i * 2) % n + (i * 2 >= n);
            pg[i] = (pd_page_xfer_t){(uint64_t)i * page, (uint64_t)j * page, page};
        }
        double best = 0;
        for (int rep = 0; rep < 5; rep++) {
            int done = 0;
            double t0 = pd_time_now_s();
            if (pd_pipe_read_pages(a, ab, ra, rr, pg, n, done_cb, &done) != PD_OK) {
                break;
            }
            while (done == 0) {
                pd_pipe_progress(a);
                pd_pipe_progress(b);
            }
            double dt = pd_time_now_s() - t0;
            double g = (double)bytes / dt / 1e9;
            best = g > best ? g : best;
        }
        gbps = best;
        free(pg);
    }
    pd_pipe_destroy(a);
    pd_pipe_destroy(b);
    return gbps;
}

int main(int argc, char **argv)
{
    const char *proxy = "http://127.0.0.1:8000", *prefill = NULL, *decode = NULL, *lens = "512,2048,8192";
    const char *proxy_legacy = NULL, *stream_lens = NULL;
    const char *pipe = "ucx", *results = NULL, *label = "";
    int repeat = 3, vocab = 256, kv_bytes_per_token = 0, page_bytes = 16384;
    int64_t seed = 1;
    const pd_flag_t flags[] = {
        {"proxy", PD_FLAG_STR, &proxy, "pd-proxy URL", NULL},
        {"proxy-legacy", PD_FLAG_STR, &proxy_legacy,
         "a second pd-proxy over the same nodes with --no-first-token-from-prefill: adds the streamed "
         "first-token handover section",
         NULL},
        {"stream-lens", PD_FLAG_STR, &stream_lens, "prompt lengths of that section (default: --lens)", NULL},
        {"prefill", PD_FLAG_STR, &prefill, "the prefill node behind it", NULL},
        {"decode", PD_FLAG_STR, &decode, "the decode node behind it (its /metrics)", NULL},
        {"lens", PD_FLAG_STR, &lens, "prompt lengths, comma-separated", NULL},
        {"repeat", PD_FLAG_INT, &repeat, "requests per length and path", NULL},
        {"vocab-size", PD_FLAG_INT, &vocab, "prompt ids are drawn below this", NULL},
        {"kv-bytes-per-token", PD_FLAG_INT, &kv_bytes_per_token, "KV bytes one token occupies (all layers)",
         NULL},
        {"page-bytes", PD_FLAG_INT, &page_bytes, "one (layer, block) page, for the pipe baseline", NULL},
        {"pipe", PD_FLAG_STR, &pipe, "pipe kind the nodes use (for the baseline)", NULL},
        {"seed", PD_FLAG_INT64, &seed, "prompt seed", NULL},
        {"label", PD_FLAG_STR, &label, "a name for this run (mode, pipe)", NULL},
        {"results", PD_FLAG_STR, &results, "append the table to this markdown file", NULL},
    };
    int first = 0;
    pd_status_t st =
        pd_flags_parse(flags, sizeof(flags) / sizeof(flags[0]), argc, argv,
                       "usage: pd-bench-handover --proxy URL --prefill URL --decode URL [options]\n"
                       "TTFT through a P/D pair minus TTFT of the prefill alone, by phase.",
                       &first);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    url_t px, pf, dc;
    if (st != PD_OK || !parse_url(proxy, &px) || !parse_url(prefill, &pf) || !parse_url(decode, &dc) ||
        kv_bytes_per_token <= 0) {
        pd_log_error("give --proxy, --prefill, --decode as http://HOST:PORT and --kv-bytes-per-token");
        return 2;
    }
    pd_log_set_level(PD_LOG_WARN);
    struct event_base *b = event_base_new();
    pd_rng_t rng;
    pd_rng_seed(&rng, (uint64_t)seed);
    char table[24576];
    size_t tl = 0;
    tl += (size_t)snprintf(table + tl, sizeof(table) - tl,
                           "| prompt | KV MiB | TTFT prefill alone (ms) | TTFT via P/D (ms) | difference "
                           "(ms) | decode phase (ms) | "
                           "KV handover (ms) | queue | transfer | notify | remote (push) | pipe-bandwidth "
                           "time + 2 ms | goal (KV "
                           "handover) | memcpy of idle memory (ms, idle s) | KV handover ≤ that + 2 ms |\n"
                           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    /* one warm-up through the proxy: the decode's first handshake is reported separately */
    char *w = prompt_body(&rng, 64, vocab, 1, false);
    resp_t r;
    request(b, &px, EVHTTP_REQ_POST, "/v1/completions", w, &r);
    free(w), free(r.body);
    phases_t h0;
    scrape(b, &dc, &h0);
    char *list = strdup(lens), *save = NULL;
    bool all_ok = true;
    idle_pair_t idle[16];
    int nidle = 0;
    {
        char *l2 = strdup(lens), *s2 = NULL;
        for (char *t = strtok_r(l2, ",", &s2); t != NULL && nidle < 16; t = strtok_r(NULL, ",", &s2)) {
            idle_pair_init(&idle[nidle++], (size_t)atoi(t) * (size_t)kv_bytes_per_token);
        }
        free(l2);
    }
    int li = 0;
    for (char *t = strtok_r(list, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        int len = atoi(t);
        double alone = 0, pd = 0;
        int ok = 0;
        phases_t before, after;
        /* untimed: the first request of a new length grows the engines' workspaces */
        for (int w2 = 0; w2 < 2; w2++) {
            char *body = prompt_body(&rng, len, vocab, 1, false);
            request(b, w2 == 0 ? &pf : &px, EVHTTP_REQ_POST, "/v1/completions", body, &r);
            free(body), free(r.body);
        }
        for (int k = 0; k < repeat; k++) {
            char *body = prompt_body(&rng, len, vocab, 1, false);
            alone += request(b, &pf, EVHTTP_REQ_POST, "/v1/completions", body, &r);
            ok += r.status == 200;
            free(body), free(r.body);
        }
        scrape(b, &dc, &before);
        double ds0, dc0, ds1, dc1;
        scrape_proxy(b, &px, &ds0, &dc0);
        for (int k = 0; k < repeat; k++) {
            char *body = prompt_body(&rng, len, vocab, 1, false);
            pd += request(b, &px, EVHTTP_REQ_POST, "/v1/completions", body, &r);
            ok += r.status == 200;
            free(body), free(r.body);
        }
        scrape(b, &dc, &after);
        scrape_proxy(b, &px, &ds1, &dc1);
        double idle_s = 0, idle_ms = li < nidle ? idle_copy_ms(&idle[li], &idle_s) : 0;
        li++;
        double dphase = dc1 > dc0 ? (ds1 - ds0) / (dc1 - dc0) * 1e3 : 0;
        if (ok != 2 * repeat) {
            pd_log_error("prompt %d: %d of %d requests failed", len, 2 * repeat - ok, 2 * repeat);
            all_ok = false;
        }
        alone = alone / repeat * 1e3;
        pd = pd / repeat * 1e3;
        double ph[4];
        for (int i = 0; i < 4; i++) {
            double n = after.count[i] - before.count[i];
            ph[i] = n > 0 ? (after.sum[i] - before.sum[i]) / n * 1e3 : 0;
        }
        double kv = (double)len * kv_bytes_per_token;
        double gbps = pipe_read_gbps(pipe, (size_t)page_bytes, (size_t)(kv < 1 << 20 ? 1 << 20 : kv));
        double bound = gbps > 0 ? kv / (gbps * 1e9) * 1e3 + 2 : 0;
        double over = pd - alone;
        double handover = ph[0] + ph[1] + ph[2] + ph[3];
        fprintf(stderr,
                "pd-bench-handover: %d tokens: alone %.1f ms, P/D %.1f ms, decode phase %.1f ms, KV handover "
                "%.2f ms "
                "(bound %.1f ms at %.2f GB/s; memcpy of the same bytes idle %.0f s: %.1f ms)\n",
                len, alone, pd, dphase, handover, bound, gbps, idle_s, idle_ms);
        tl += (size_t)snprintf(
            table + tl, sizeof(table) - tl,
            "| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f (%.2f "
            "GB/s) | %s | %.1f (%.0f s) | %s |\n",
            len, kv / (1 << 20), alone, pd, over, dphase, handover, ph[0], ph[1], ph[2], ph[3], bound, gbps,
            after.count[0] + after.count[3] <= before.count[0] + before.count[3]
                ? "n/a: no transfer completed"
            : ph[3] > 0         ? "n/a (push: contains the prefill; read the TTFT difference)"
            : handover <= bound ? "met"
                                : "NOT met",
            idle_ms, idle_s,
            idle_ms <= 0 || ph[3] > 0 ? "n/a"
            : handover <= idle_ms + 2 ? "yes"
                                      : "no");
    }
    free(list);
    url_t lg;
    if (proxy_legacy != NULL && parse_url(proxy_legacy, &lg)) {
        handover_section(b, &px, &lg, &pf, stream_lens != NULL ? stream_lens : lens, repeat, vocab, &rng,
                         table, sizeof(table));
    }
    phases_t end;
    scrape(b, &dc, &end);
    double hs = end.count[4] > 0 ? end.sum[4] / end.count[4] * 1e3 : 0;
    printf("%s\nhandshake (first contact, once per peer): %.2f ms mean over %.0f\n", table, hs, end.count[4]);
    if (results != NULL) {
        FILE *f = fopen(results, "a");
        if (f != NULL) {
            char date[64];
            time_t now = time(NULL);
            strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
            long cores = sysconf(_SC_NPROCESSORS_ONLN);
            fprintf(f, "\n## pd-bench-handover %s — %s\n\n", label, date);
            fprintf(
                f,
                "Command: `pd-bench-handover --proxy %s --prefill %s --decode %s --lens %s --repeat %d "
                "--kv-bytes-per-token %d --pipe %s` (via tools/bench-pd.sh). Machine: %ld cores.\n"
                "TTFT columns are means of 1-token completions sent one at a time (fresh prompts); their "
                "difference mixes in the prefill's run-to-run noise. The decode phase is the proxy's "
                "decode request to answer (pd_proxy:decode_first_byte_seconds): KV handover plus the "
                "decode's own first forward step and two HTTP hops. KV handover = queue + transfer + "
                "notify (+ remote for push), the decode's mean ms per transfer "
                "(pd:kv_transfer_phase_seconds); the goal compares it with the same bytes read in "
                "%d-byte pages between two %s endpoints of one process, + 2 ms. Handshake on first "
                "contact: %.2f ms. In push mode the decode's request goes out with the prefill's, so its "
                "decode phase and the remote column (reservation to WRITE_DONE) contain the prefill's "
                "compute: "
                "read the TTFT difference there. Last column: one memcpy of the same bytes between two "
                "buffers filled when the run began and left idle until that prompt's P/D requests "
                "finished (this VM's idle memory is slow to touch).%s\n\n%s",
                proxy, prefill, decode, lens, repeat, kv_bytes_per_token, pipe, cores, page_bytes, pipe, hs,
                proxy_legacy == NULL
                    ? ""
                    : "\nSecond table (--proxy-legacy): streamed 3-token completions one at a time, fresh "
                      "prompts, through the prefill alone, the proxy (first token from the prefill) and a "
                      "second proxy over the same nodes with --no-first-token-from-prefill (the decode "
                      "samples the first token, as before). 'Added by the path' = client TTFT − the "
                      "prefill's own TTFT for the same requests (its vllm:time_to_first_token_seconds), so "
                      "the prefill's compute and its noise cancel; the goal compares it with the same "
                      "figure for the prefill alone (one HTTP hop). Gaps between tokens are medians over "
                      "the requests (a thread woken on an idle vCPU of this VM can wait a few ms, which "
                      "now and then delivers a token together with the next); the third token's gap is "
                      "the path's steady decode step.",
                table);
            fclose(f);
        }
    }
    event_base_free(b);
    return all_ok ? 0 : 1;
}
