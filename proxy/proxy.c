/* proxy/proxy.c — pd-proxy's loop: routes, node pools and policies, the per-request P→D
 * sequence, health probing and DNS discovery. See proxy.h. */
#define _GNU_SOURCE
#include "proxy/proxy.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <netdb.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/hash.h"
#include "common/http_reply.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "common/version.h"

#define MAX_NODES 64

void pd_proxy_config_defaults(pd_proxy_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->port = 8000;
    c->policy = "round-robin";
    c->health_interval = 1.0;
    c->discover_interval = 5.0;
    c->upstream_timeout = 600;
    c->affinity_prefix_chars = 256;
    c->max_request_bytes = 16u << 20;
}

size_t pd_proxy_flags(pd_proxy_config_t *c, pd_flag_t *out, size_t max)
{
    const pd_flag_t f[] = {
        {"host", PD_FLAG_STR, &c->host, "address to listen on", NULL},
        {"port", PD_FLAG_INT, &c->port, "port to listen on (0 = any free)", NULL},
        {"port-file", PD_FLAG_STR, &c->port_file, "write the bound port to this file once listening", NULL},
        {"prefill", PD_FLAG_STR, &c->prefill, "prefill node URLs, comma-separated (http://HOST:PORT)", NULL},
        {"decode", PD_FLAG_STR, &c->decode, "decode node URLs, comma-separated", NULL},
        {"discover-prefill", PD_FLAG_STR, &c->discover_prefill,
         "NAME:PORT of a headless service whose A records are the prefill pool (re-resolved periodically)",
         NULL},
        {"discover-decode", PD_FLAG_STR, &c->discover_decode, "NAME:PORT for the decode pool", NULL},
        {"discover-interval", PD_FLAG_DOUBLE, &c->discover_interval, "seconds between DNS resolutions", NULL},
        {"policy", PD_FLAG_CHOICE, &c->policy, "how nodes are picked",
         "round-robin|least-loaded|prefix-affinity"},
        {"health-interval", PD_FLAG_DOUBLE, &c->health_interval, "seconds between node probes", NULL},
        {"upstream-timeout", PD_FLAG_DOUBLE, &c->upstream_timeout, "seconds an upstream request may take",
         NULL},
        {"affinity-prefix-chars", PD_FLAG_INT, &c->affinity_prefix_chars,
         "prompt characters hashed by prefix-affinity", NULL},
        {"max-request-bytes", PD_FLAG_SIZE, &c->max_request_bytes, "largest request body accepted", NULL},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    n = n < max ? n : max;
    memcpy(out, f, n * sizeof(f[0]));
    return n;
}

/* ------------------------------------------------------------------ state */

typedef struct node {
    char url[160];
    char host[128];
    int port;
    bool prefill;
    bool healthy, removed;
    int fails;
    int inflight;
    double load; /* running + waiting from its /metrics */
    bool info_ok;
    char engine_id[64], kv_host[64], mode[8];
    int kv_port;
    int probes; /* probes in flight */
    pd_metric_t *healthy_g;
} node_t;

typedef struct proxy proxy_t;

typedef struct preq preq_t;
struct preq {
    proxy_t *px;
    struct evhttp_request *client;         /* NULL once answered or the client went away */
    struct evhttp_connection *client_conn; /* its connection's close callback points at us */
    json_t *body;
    bool stream, push;
    const char *path; /* /v1/completions or /v1/chat/completions, sent to both nodes */
    char transfer_id[48];
    uint64_t affinity;
    node_t *p, *d;
    bool tried_p[MAX_NODES], tried_d[MAX_NODES];
    struct evhttp_connection *p_conn, *d_conn; /* upstream connections in use */
    json_t *ktp;                               /* pull: the prefill's kv_transfer_params */
    bool p_done, d_done, reply_started;
    bool released; /* the prefill was told to free the KV it held for this request */
    struct evbuffer *d_body;
    double t0, t_d_sent, t_first;
    preq_t *prev, *next;
};

typedef struct proxy_metrics {
    pd_metric_t *ok, *failed, *client_gone, *retry_p, *retry_d, *prefill_s, *decode_ttft_s, *e2e_s;
} proxy_metrics_t;

struct proxy {
    pd_proxy_config_t cfg;
    struct event_base *base;
    struct evhttp *http;
    struct event *tick, *sigterm, *sigint;
    node_t nodes[MAX_NODES];
    int num_nodes;
    uint64_t rr[2];
    preq_t *inflight;
    pd_metrics_t *metrics;
    proxy_metrics_t m;
    double last_discover;
    bool stopping;
};

/* ------------------------------------------------------------------ nodes */

static node_t *add_node(proxy_t *px, const char *url, bool prefill)
{
    for (int i = 0; i < px->num_nodes; i++) {
        if (strcmp(px->nodes[i].url, url) == 0 && px->nodes[i].prefill == prefill) {
            px->nodes[i].removed = false;
            return &px->nodes[i];
        }
    }
    if (px->num_nodes == MAX_NODES) {
        pd_log_error("proxy: more than %d nodes", MAX_NODES);
        return NULL;
    }
    node_t *n = &px->nodes[px->num_nodes];
    memset(n, 0, sizeof(*n));
    if (sscanf(url, "http://%127[^:/]:%d", n->host, &n->port) != 2 || n->port <= 0 || n->port > 65535) {
        pd_log_error("proxy: '%s' is not http://HOST:PORT", url);
        return NULL;
    }
    snprintf(n->url, sizeof(n->url), "%s", url);
    n->prefill = prefill;
    n->healthy = true; /* optimistic until a probe says otherwise */
    char label[200];
    snprintf(label, sizeof(label), "node=%s %s", prefill ? "prefill" : "decode", url);
    n->healthy_g = pd_metrics_add(px->metrics, PD_METRIC_GAUGE, "pd_proxy:node_healthy",
                                  "1 when the node answers its probes.", label, NULL, 0);
    pd_metric_set(n->healthy_g, 1);
    px->num_nodes++;
    pd_log_info("proxy: %s node %s", prefill ? "prefill" : "decode", url);
    return n;
}

static pd_status_t add_list(proxy_t *px, const char *list, bool prefill)
{
    if (list == NULL) {
        return PD_OK;
    }
    char *dup = strdup(list), *save = NULL;
    for (char *t = strtok_r(dup, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        if (add_node(px, t, prefill) == NULL) {
            free(dup);
            return PD_ERR_INVALID_ARG;
        }
    }
    free(dup);
    return PD_OK;
}

static void set_health(node_t *n, bool ok, const char *why)
{
    if (ok) {
        n->fails = 0;
        if (!n->healthy) {
            pd_log_info("proxy: node %s is healthy again", n->url);
        }
        n->healthy = true;
    } else if (++n->fails >= 2 || strcmp(why, "connection failed") == 0) {
        if (n->healthy) {
            pd_log_warn("proxy: node %s marked unhealthy (%s)", n->url, why);
        }
        n->healthy = false;
    }
    pd_metric_set(n->healthy_g, n->healthy ? 1 : 0);
}

/* Rendezvous hash of (node, key): the same prompt prefix keeps landing on the same node. */
static uint64_t node_score(const node_t *n, uint64_t key)
{
    return pd_hash64(n->url, strlen(n->url), key);
}

/* Picks a healthy node of the pool not yet tried; NULL when none is left. */
static node_t *pick(proxy_t *px, bool prefill, const bool *tried, uint64_t affinity, bool need_info)
{
    node_t *best = NULL;
    double best_v = 0;
    int cands[MAX_NODES], nc = 0;
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (n->prefill == prefill && n->healthy && !n->removed && !tried[i] && (!need_info || n->info_ok)) {
            cands[nc++] = i;
        }
    }
    if (nc == 0) {
        return NULL;
    }
    if (strcmp(px->cfg.policy, "round-robin") == 0) {
        return &px->nodes[cands[px->rr[prefill]++ % (uint64_t)nc]];
    }
    /* ties (idle nodes) rotate, so equal load spreads */
    uint64_t start = px->rr[prefill]++;
    for (int k = 0; k < nc; k++) {
        node_t *n = &px->nodes[cands[(start + (uint64_t)k) % (uint64_t)nc]];
        double v = strcmp(px->cfg.policy, "least-loaded") == 0 ? -(n->inflight + n->load)
                                                               : (double)(node_score(n, affinity) >> 11);
        if (best == NULL || v > best_v) {
            best = n;
            best_v = v;
        }
    }
    return best;
}

/* ------------------------------------------------------------------ upstream requests */

static void free_conn_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    evhttp_connection_free(arg);
}

/* Frees an upstream connection after the current callback returns. */
static void release_conn(proxy_t *px, struct evhttp_connection *c)
{
    if (c != NULL) {
        struct timeval tv = {0, 0};
        event_base_once(px->base, -1, EV_TIMEOUT, free_conn_cb, c, &tv);
    }
}

typedef void (*up_done_cb)(struct evhttp_request *, void *);

static struct evhttp_connection *upstream(proxy_t *px, node_t *n, enum evhttp_cmd_type method,
                                          const char *path, const json_t *body, up_done_cb done,
                                          void (*chunk)(struct evhttp_request *, void *),
                                          int (*header)(struct evhttp_request *, void *), void *arg)
{
    struct evhttp_connection *c = evhttp_connection_base_new(px->base, NULL, n->host, (ev_uint16_t)n->port);
    if (c == NULL) {
        return NULL;
    }
    evhttp_connection_set_timeout(c, (int)px->cfg.upstream_timeout);
    struct evhttp_request *r = evhttp_request_new(done, arg);
    if (chunk != NULL) {
        evhttp_request_set_chunked_cb(r, chunk);
    }
    if (header != NULL) {
        evhttp_request_set_header_cb(r, header);
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(r);
    char hostport[160];
    snprintf(hostport, sizeof(hostport), "%s:%d", n->host, n->port);
    evhttp_add_header(h, "Host", hostport);
    if (body != NULL) {
        char *text = json_dumps(body, JSON_COMPACT);
        evhttp_add_header(h, "Content-Type", "application/json");
        evbuffer_add(evhttp_request_get_output_buffer(r), text, strlen(text));
        free(text);
    }
    if (evhttp_make_request(c, r, method, path) != 0) {
        evhttp_connection_free(c);
        return NULL;
    }
    return c;
}

/* ------------------------------------------------------------------ client replies */

static void reply_json(struct evhttp_request *req, int status, json_t *body)
{
    char *text = json_dumps(body, JSON_COMPACT);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    pd_http_send_reply(req, status, status == 200 ? "OK" : "Error", b);
    evbuffer_free(b);
    free(text);
}

static void reply_error(struct evhttp_request *req, int status, const char *type, const char *msg)
{
    json_t *j =
        json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", msg, "type", type, "param", "code", status);
    reply_json(req, status, j);
    json_decref(j);
}

static void on_client_close(struct evhttp_connection *conn, void *arg);

static void preq_free(preq_t *q)
{
    proxy_t *px = q->px;
    if (q->prev != NULL) {
        q->prev->next = q->next;
    } else if (px->inflight == q) {
        px->inflight = q->next;
    }
    if (q->next != NULL) {
        q->next->prev = q->prev;
    }
    if (q->client_conn != NULL) {
        evhttp_connection_set_closecb(q->client_conn, NULL, NULL);
    }
    json_decref(q->body);
    json_decref(q->ktp);
    if (q->d_body != NULL) {
        evbuffer_free(q->d_body);
    }
    free(q);
}

/* Ends a request whose decode phase will not run: an error for the client (if still there). */
static void fail_request(preq_t *q, int status, const char *msg)
{
    pd_log_warn("proxy: request failed: %s", msg);
    pd_metric_inc(q->px->m.failed, 1);
    if (q->client != NULL) {
        if (q->reply_started) {
            evhttp_send_reply_end(q->client);
        } else {
            reply_error(q->client, status, status == 503 ? "ServiceUnavailableError" : "BadGatewayError",
                        msg);
        }
    }
    q->client = NULL;
    if (q->p_conn == NULL && q->d_conn == NULL) {
        preq_free(q);
    }
}

/* ------------------------------------------------------------------ releasing a prefill's KV */

typedef struct release_ctx {
    proxy_t *px;
    struct evhttp_connection *conn;
} release_ctx_t;

static void on_release_done(struct evhttp_request *r, void *arg)
{
    release_ctx_t *c = arg;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code != 200) {
        pd_log_warn("proxy: releasing a prefill's KV answered %d (its lease frees it at the timeout)", code);
    }
    release_conn(c->px, c->conn);
    free(c);
}

/* The decode leg failed (or the client left) after the prefill held KV for it: tell the prefill
 * to free it now instead of at --kv-hold-timeout (pull: its lease; push: the transfer waiting for
 * a reservation). Fire and forget. */
static void release_prefill(preq_t *q)
{
    if (q->p == NULL || q->released) {
        return;
    }
    json_t *body = NULL;
    if (q->push) {
        body = json_pack("{s:s}", "transfer_id", q->transfer_id);
    } else if (q->ktp != NULL) {
        const char *rid = json_string_value(json_object_get(q->ktp, "remote_request_id"));
        json_t *lid = json_object_get(q->ktp, "lease_id");
        if (rid != NULL && json_is_integer(lid)) {
            body = json_pack("{s:s, s:O}", "remote_request_id", rid, "lease_id", lid);
        }
    }
    release_ctx_t *c = body != NULL ? calloc(1, sizeof(*c)) : NULL;
    if (c != NULL) {
        c->px = q->px;
        c->conn = upstream(q->px, q->p, EVHTTP_REQ_POST, "/pd/release", body, on_release_done, NULL, NULL, c);
        if (c->conn == NULL) {
            free(c);
        }
        q->released = true;
    }
    json_decref(body);
}

/* ------------------------------------------------------------------ the decode phase */

static void start_decode(preq_t *q);

static int on_d_header(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    int code = evhttp_request_get_response_code(r);
    if (q->client != NULL && code == 200 && q->stream) {
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type", "text/event-stream");
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Cache-Control", "no-cache");
        evhttp_send_reply_start(q->client, 200, "OK");
        q->reply_started = true;
    }
    return 0;
}

static void on_d_chunk(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    if (q->t_first == 0 && evbuffer_get_length(in) > 0) {
        q->t_first = pd_time_now_s();
        pd_metric_observe(q->px->m.decode_ttft_s, q->t_first - q->t_d_sent);
    }
    if (q->client != NULL && q->reply_started) {
        evhttp_send_reply_chunk(q->client, in);
    } else {
        evbuffer_add_buffer(q->d_body, in);
    }
}

static void on_d_done(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    release_conn(px, q->d_conn);
    q->d_conn = NULL;
    q->d->inflight--;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code == 0 && !q->reply_started) {
        set_health(q->d, false, "connection failed");
        if (!q->push && q->client != NULL) {
            /* pull: the prefill still holds the KV under its lease; another decode may read it */
            pd_metric_inc(px->m.retry_d, 1);
            start_decode(q);
            return;
        }
        release_prefill(q);
        fail_request(q, 502, "the decode node failed");
        return;
    }
    if (code != 200) {
        release_prefill(q); /* the decode refused it: nobody will read the prefill's KV */
    }
    if (r != NULL) {
        evbuffer_add_buffer(q->d_body, evhttp_request_get_input_buffer(r));
    }
    if (q->client != NULL) {
        if (q->reply_started) {
            evhttp_send_reply_end(q->client);
        } else {
            evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type",
                              "application/json");
            pd_http_send_reply(q->client, code, code == 200 ? "OK" : "Error", q->d_body);
        }
        pd_metric_inc(code == 200 ? px->m.ok : px->m.failed, 1);
        pd_metric_observe(px->m.e2e_s, pd_time_now_s() - q->t0);
    }
    q->client = NULL;
    q->d_done = true;
    if (q->p_conn == NULL) {
        preq_free(q);
    }
}

static void start_decode(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *d = pick(px, false, q->tried_d, q->affinity, false);
    if (d == NULL) {
        release_prefill(q);
        fail_request(q, 503, "no healthy decode node");
        return;
    }
    q->tried_d[d - px->nodes] = true;
    q->d = d;
    json_t *body = json_deep_copy(q->body);
    if (q->push) {
        json_object_set_new(body, "kv_transfer_params",
                            json_pack("{s:b, s:b, s:s, s:s, s:s, s:i, s:s}", "do_remote_prefill", 1,
                                      "do_remote_decode", 0, "transfer_mode", "push", "transfer_id",
                                      q->transfer_id, "remote_host", q->p->kv_host, "remote_port",
                                      q->p->kv_port, "remote_engine_id", q->p->engine_id));
    } else {
        json_object_set(body, "kv_transfer_params", q->ktp);
    }
    q->t_d_sent = pd_time_now_s();
    q->d_conn = upstream(px, d, EVHTTP_REQ_POST, q->path, body, on_d_done, on_d_chunk, on_d_header, q);
    json_decref(body);
    if (q->d_conn == NULL) {
        release_prefill(q);
        fail_request(q, 502, "cannot reach the decode node");
        return;
    }
    d->inflight++;
}

/* ------------------------------------------------------------------ the prefill phase */

static bool start_prefill(preq_t *q);

static void on_p_done(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    release_conn(px, q->p_conn);
    q->p_conn = NULL;
    q->p->inflight--;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    json_t *resp = NULL;
    if (r != NULL && code == 200) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t len = evbuffer_get_length(in);
        resp = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, 0, NULL);
    }
    q->p_done = true;
    if (q->push) {
        /* the decode is already waiting for the writes; a failed prefill shows up there as a load
         * failure (policy) after its timeout or at once if the prefill died */
        if (code != 200) {
            pd_log_warn("proxy: push prefill on %s answered %d", q->p->url, code);
            if (code == 0) {
                set_health(q->p, false, "connection failed");
            }
        }
        json_decref(resp);
        if (q->d_conn == NULL) {
            preq_free(q); /* the decode phase is over (answered or failed) */
        }
        return;
    }
    if (q->client == NULL) {
        json_decref(resp);
        preq_free(q); /* the client left during prefill (the prefill lease frees its blocks) */
        return;
    }
    pd_metric_observe(px->m.prefill_s, pd_time_now_s() - q->t0);
    if (code == 0 || code >= 500) {
        set_health(q->p, false, code == 0 ? "connection failed" : "server error");
        pd_metric_inc(px->m.retry_p, 1);
        start_prefill(q); /* no KV was produced: another prefill may do it */
        return;
    }
    if (code != 200) {
        /* the request itself is bad (4xx): relay the prefill's error */
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type", "application/json");
        pd_http_send_reply(q->client, code, "Error", evhttp_request_get_input_buffer(r));
        pd_metric_inc(px->m.failed, 1);
        q->client = NULL;
        preq_free(q);
        return;
    }
    json_t *ktp = json_object_get(resp, "kv_transfer_params");
    if (!json_is_object(ktp)) {
        json_decref(resp);
        fail_request(q, 502, "the prefill node returned no kv_transfer_params");
        return;
    }
    q->ktp = json_incref(ktp);
    json_decref(resp);
    start_decode(q);
}

/* Sends the prefill request; false when q ended (and was freed) instead. */
static bool start_prefill(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *p = pick(px, true, q->tried_p, q->affinity, q->push);
    if (p == NULL) {
        fail_request(q, 503, "no healthy prefill node");
        return false;
    }
    q->tried_p[p - px->nodes] = true;
    q->p = p;
    json_t *body = json_deep_copy(q->body);
    json_object_set_new(body, "max_tokens", json_integer(1));
    json_object_del(body, "max_completion_tokens");
    json_object_set_new(body, "stream", json_false());
    json_object_del(body, "stream_options");
    json_object_del(body, "logprobs");
    json_object_del(body, "top_logprobs");
    json_object_del(body, "min_tokens"); /* the prefill's one token; the decode applies it */
    json_object_del(body, "n");          /* one KV for the decode's choices to share */
    json_t *ktp = json_pack("{s:b, s:b}", "do_remote_decode", 1, "do_remote_prefill", 0);
    if (q->push) {
        json_object_set_new(ktp, "transfer_mode", json_string("push"));
        json_object_set_new(ktp, "transfer_id", json_string(q->transfer_id));
    }
    json_object_set_new(body, "kv_transfer_params", ktp);
    q->p_conn = upstream(px, p, EVHTTP_REQ_POST, q->path, body, on_p_done, NULL, NULL, q);
    json_decref(body);
    if (q->p_conn == NULL) {
        fail_request(q, 502, "cannot reach the prefill node");
        return false;
    }
    p->inflight++;
    return true;
}

/* ------------------------------------------------------------------ client routes */

static void on_client_close(struct evhttp_connection *conn, void *arg)
{
    (void)conn;
    preq_t *q = arg;
    pd_log_info("proxy: client went away; closing its upstream requests");
    pd_metric_inc(q->px->m.client_gone, 1);
    q->client = NULL;
    q->client_conn = NULL;
    /* closing the upstream connections makes both nodes abort the request */
    if (q->p_conn != NULL) {
        q->p->inflight--;
        evhttp_connection_free(q->p_conn);
        q->p_conn = NULL;
    }
    if (q->d_conn != NULL) {
        q->d->inflight--;
        evhttp_connection_free(q->d_conn);
        q->d_conn = NULL;
    }
    preq_free(q);
}

static void handle_completions(proxy_t *px, struct evhttp_request *req, const char *path)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > px->cfg.max_request_bytes) {
        reply_error(req, 413, "RequestTooLargeError", "request body too large");
        return;
    }
    json_error_t jerr;
    json_t *body = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, 0, &jerr);
    if (!json_is_object(body)) {
        char msg[256];
        snprintf(msg, sizeof(msg), "the body is not a JSON object (%s)",
                 body == NULL ? jerr.text : "wrong type");
        json_decref(body);
        reply_error(req, 400, "BadRequestError", msg);
        return;
    }
    json_t *plp = json_object_get(body, "prompt_logprobs");
    json_t *lps = json_object_get(body, "logprobs");
    if ((plp != NULL && !json_is_null(plp)) ||
        (json_is_true(json_object_get(body, "echo")) && lps != NULL && !json_is_null(lps))) {
        /* refused before any node holds KV for it: both score the prompt */
        reply_error(req, 400, "BadRequestError",
                    "'prompt_logprobs' is not supported through the P/D proxy yet (send it to pd-serve)");
        json_decref(body);
        return;
    }
    preq_t *q = calloc(1, sizeof(*q));
    q->px = px;
    q->client = req;
    q->body = body;
    q->stream = json_is_true(json_object_get(body, "stream"));
    q->path = path;
    q->d_body = evbuffer_new();
    q->t0 = pd_time_now_s();
    json_object_del(body, "kv_transfer_params"); /* the proxy owns the transfer */
    /* affinity key: the start of the prompt (text or token ids) or of the chat messages */
    json_t *prompt = json_object_get(body, "prompt");
    if (prompt == NULL) {
        prompt = json_object_get(body, "messages");
    }
    char *ptext = json_dumps(prompt != NULL ? prompt : json_null(), JSON_COMPACT | JSON_ENCODE_ANY);
    size_t plen = ptext != NULL ? strlen(ptext) : 0;
    size_t lim = (size_t)(px->cfg.affinity_prefix_chars > 0 ? px->cfg.affinity_prefix_chars : 1);
    q->affinity = pd_hash64(ptext, plen < lim ? plen : lim, 0x6166);
    free(ptext);
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        rnd = pd_time_now_ns();
    }
    snprintf(q->transfer_id, sizeof(q->transfer_id), "xfer-%016llx", (unsigned long long)rnd);
    q->next = px->inflight;
    if (px->inflight != NULL) {
        px->inflight->prev = q;
    }
    px->inflight = q;
    q->client_conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(q->client_conn, on_client_close, q);
    /* the mode is the prefill pool's (from /pd/info); push needs a prefill whose KV address is known */
    for (int i = 0; i < px->num_nodes; i++) {
        const node_t *n = &px->nodes[i];
        if (n->prefill && n->healthy && !n->removed && n->info_ok) {
            q->push = strcmp(n->mode, "push") == 0;
            break;
        }
    }
    if (start_prefill(q) && q->push) {
        start_decode(q);
    }
}

typedef struct fwd_ctx {
    proxy_t *px;
    struct evhttp_request *client;
    struct evhttp_connection *conn;
} fwd_ctx_t;

/* A forwarded request's answer, relayed as it is (status, JSON body). */
static void on_forward_done(struct evhttp_request *r, void *arg)
{
    fwd_ctx_t *m = arg;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code == 0) {
        reply_error(m->client, 502, "BadGatewayError", "the node did not answer");
    } else {
        evhttp_add_header(evhttp_request_get_output_headers(m->client), "Content-Type", "application/json");
        pd_http_send_reply(m->client, code, code == 200 ? "OK" : "Error", evhttp_request_get_input_buffer(r));
    }
    release_conn(m->px, m->conn);
    free(m);
}

/* Sends a request that any node answers the same (models, tokenize) to a healthy decode node. */
static void forward(proxy_t *px, struct evhttp_request *req, enum evhttp_cmd_type method, const char *path,
                    bool with_body)
{
    json_t *body = NULL;
    if (with_body) {
        struct evbuffer *in = evhttp_request_get_input_buffer(req);
        size_t len = evbuffer_get_length(in);
        json_error_t jerr;
        body =
            len <= px->cfg.max_request_bytes
                ? json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, &jerr)
                : NULL;
        if (!json_is_object(body)) {
            json_decref(body);
            reply_error(req, 400, "BadRequestError", "the body is not a JSON object (or too large)");
            return;
        }
    }
    bool none[MAX_NODES] = {false};
    node_t *d = pick(px, false, none, 0, false);
    fwd_ctx_t *m = d != NULL ? calloc(1, sizeof(*m)) : NULL;
    if (m == NULL) {
        json_decref(body);
        reply_error(req, 503, "ServiceUnavailableError", "no healthy decode node");
        return;
    }
    m->px = px;
    m->client = req;
    m->conn = upstream(px, d, method == EVHTTP_REQ_HEAD ? EVHTTP_REQ_GET : method, path, body,
                       on_forward_done, NULL, NULL, m);
    json_decref(body);
    if (m->conn == NULL) {
        free(m);
        reply_error(req, 502, "BadGatewayError", "cannot reach the decode node");
    }
}

static bool pool_ok(const proxy_t *px, bool prefill)
{
    for (int i = 0; i < px->num_nodes; i++) {
        if (px->nodes[i].prefill == prefill && px->nodes[i].healthy && !px->nodes[i].removed) {
            return true;
        }
    }
    return false;
}

static void handle_metrics(proxy_t *px, struct evhttp_request *req)
{
    size_t len = 0;
    char *text = pd_metrics_render(px->metrics, &len);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, text, len);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    pd_http_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
    free(text);
}

static void on_request(struct evhttp_request *req, void *arg)
{
    proxy_t *px = arg;
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri != NULL ? evhttp_uri_get_path(uri) : NULL;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    bool get = cmd == EVHTTP_REQ_GET || cmd == EVHTTP_REQ_HEAD; /* HEAD: same answer, no body */
    bool post = cmd == EVHTTP_REQ_POST;
    if (path == NULL) {
        reply_error(req, 400, "BadRequestError", "malformed request URI");
    } else if (strcmp(path, "/v1/completions") == 0 || strcmp(path, "/v1/chat/completions") == 0) {
        if (!post) {
            reply_error(req, 405, "MethodNotAllowedError", "use POST");
        } else if (px->stopping) {
            reply_error(req, 503, "ServiceUnavailableError", "the proxy is shutting down");
        } else {
            handle_completions(px, req,
                               path[4] == 'c' && path[5] == 'h' ? "/v1/chat/completions" : "/v1/completions");
        }
    } else if (strcmp(path, "/v1/models") == 0 || strncmp(path, "/v1/models/", 11) == 0) {
        if (!get) {
            reply_error(req, 405, "MethodNotAllowedError", "use GET");
        } else {
            forward(px, req, cmd, path, false);
        }
    } else if (strcmp(path, "/tokenize") == 0 || strcmp(path, "/detokenize") == 0) {
        if (!post) {
            reply_error(req, 405, "MethodNotAllowedError", "use POST");
        } else {
            forward(px, req, cmd, path, true);
        }
    } else if ((strcmp(path, "/health") == 0 && get) || (strcmp(path, "/ping") == 0 && (get || post))) {
        bool ok = pool_ok(px, true) && pool_ok(px, false) && !px->stopping;
        json_t *j = json_pack("{s:s, s:b, s:b}", "status", ok ? "ok" : "degraded", "prefill",
                              pool_ok(px, true), "decode", pool_ok(px, false));
        reply_json(req, ok ? 200 : 503, j);
        json_decref(j);
    } else if (strcmp(path, "/version") == 0 && get) {
        json_t *j = json_pack("{s:s}", "version", PD_VERSION);
        reply_json(req, 200, j);
        json_decref(j);
    } else if (strcmp(path, "/metrics") == 0 && get) {
        handle_metrics(px, req);
    } else if (strcmp(path, "/health") == 0 || strcmp(path, "/ping") == 0 || strcmp(path, "/version") == 0 ||
               strcmp(path, "/metrics") == 0) {
        reply_error(req, 405, "MethodNotAllowedError", "use GET");
    } else {
        reply_error(req, 404, "NotFoundError", "no such route");
    }
}

/* ------------------------------------------------------------------ probes and discovery */

typedef struct probe {
    proxy_t *px;
    node_t *n;
    int kind; /* 0 health, 1 info, 2 metrics */
    struct evhttp_connection *conn;
} probe_t;

static void on_probe(struct evhttp_request *r, void *arg)
{
    probe_t *pr = arg;
    node_t *n = pr->n;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    struct evbuffer *in = r != NULL ? evhttp_request_get_input_buffer(r) : NULL;
    size_t len = in != NULL ? evbuffer_get_length(in) : 0;
    char *text = len > 0 ? strndup((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len) : NULL;
    if (pr->kind == 0) {
        set_health(n, code == 200, code == 0 ? "connection failed" : "health probe failed");
    } else if (pr->kind == 1 && code == 200 && text != NULL) {
        json_t *j = json_loads(text, 0, NULL);
        const char *eid = json_string_value(json_object_get(j, "engine_id"));
        const char *kh = json_string_value(json_object_get(j, "kv_host"));
        const char *mode = json_string_value(json_object_get(j, "transfer_mode"));
        json_int_t kp = json_integer_value(json_object_get(j, "kv_port"));
        if (eid != NULL && kh != NULL && mode != NULL && kp > 0) {
            if (n->info_ok && strcmp(n->engine_id, eid) != 0) {
                pd_log_info("proxy: node %s restarted (engine %s)", n->url, eid);
            }
            snprintf(n->engine_id, sizeof(n->engine_id), "%s", eid);
            snprintf(n->kv_host, sizeof(n->kv_host), "%s", kh);
            snprintf(n->mode, sizeof(n->mode), "%s", mode);
            n->kv_port = (int)kp;
            n->info_ok = true;
        }
        json_decref(j);
    } else if (pr->kind == 2 && code == 200 && text != NULL) {
        n->load = pd_metrics_text_value(text, "pd:num_requests_running", 0) +
                  pd_metrics_text_value(text, "pd:num_requests_waiting", 0);
    }
    free(text);
    n->probes--;
    release_conn(pr->px, pr->conn);
    free(pr);
}

static void probe(proxy_t *px, node_t *n, int kind)
{
    static const char *const paths[3] = {"/health", "/pd/info", "/metrics"};
    probe_t *pr = calloc(1, sizeof(*pr));
    pr->px = px;
    pr->n = n;
    pr->kind = kind;
    pr->conn = upstream(px, n, EVHTTP_REQ_GET, paths[kind], NULL, on_probe, NULL, NULL, pr);
    if (pr->conn == NULL) {
        free(pr);
        return;
    }
    evhttp_connection_set_timeout(pr->conn, (int)(px->cfg.health_interval * 3 + 1));
    n->probes++;
}

/* Re-resolves NAME:PORT and makes the pool match its A records. */
static void discover(proxy_t *px, const char *spec, bool prefill)
{
    char name[256];
    int port = 0;
    if (spec == NULL || sscanf(spec, "%255[^:]:%d", name, &port) != 2) {
        return;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(name, NULL, &hints, &res);
    if (rc != 0) {
        pd_log_warn("proxy: cannot resolve %s: %s", name, gai_strerror(rc));
        return;
    }
    bool seen[MAX_NODES] = {false};
    for (struct addrinfo *a = res; a != NULL; a = a->ai_next) {
        char ip[64], url[160];
        inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof(ip));
        snprintf(url, sizeof(url), "http://%s:%d", ip, port);
        node_t *n = add_node(px, url, prefill);
        if (n != NULL) {
            seen[n - px->nodes] = true;
        }
    }
    freeaddrinfo(res);
    for (int i = 0; i < px->num_nodes; i++) {
        if (px->nodes[i].prefill == prefill && !seen[i] && !px->nodes[i].removed) {
            pd_log_info("proxy: %s left the DNS answer for %s", px->nodes[i].url, name);
            px->nodes[i].removed = true;
        }
    }
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    proxy_t *px = arg;
    double now = pd_time_now_s();
    if (now - px->last_discover >= px->cfg.discover_interval) {
        px->last_discover = now;
        discover(px, px->cfg.discover_prefill, true);
        discover(px, px->cfg.discover_decode, false);
    }
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (n->removed || n->probes > 0) {
            continue; /* one round at a time per node */
        }
        probe(px, n, 0);
        probe(px, n, 1);
        if (strcmp(px->cfg.policy, "least-loaded") == 0) {
            probe(px, n, 2);
        }
    }
    if (px->stopping && px->inflight == NULL) {
        event_base_loopexit(px->base, NULL);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    proxy_t *px = arg;
    pd_log_info("proxy: signal %d: finishing %s in-flight requests, then exiting", (int)sig,
                px->inflight != NULL ? "the" : "no");
    px->stopping = true;
    if (px->inflight == NULL) {
        event_base_loopexit(px->base, NULL);
    }
}

static void metrics_register(proxy_t *px)
{
    pd_metrics_t *m = px->metrics;
    proxy_metrics_t *pm = &px->m;
    pm->ok = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:requests_total", "Requests by outcome.",
                            "result=ok", NULL, 0);
    pm->failed = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:requests_total", "Requests by outcome.",
                                "result=failed", NULL, 0);
    pm->client_gone = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:requests_total", "Requests by outcome.",
                                     "result=client_gone", NULL, 0);
    pm->retry_p = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:retries_total",
                                 "Requests re-sent to another node.", "phase=prefill", NULL, 0);
    pm->retry_d = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:retries_total",
                                 "Requests re-sent to another node.", "phase=decode", NULL, 0);
    pm->prefill_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:prefill_seconds",
                                   "Prefill phase: request arrival to the prefill's answer (pull).", NULL,
                                   PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    pm->decode_ttft_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:decode_first_byte_seconds",
                                       "Decode phase: request sent to the decode's first response bytes.",
                                       NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    pm->e2e_s =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:e2e_seconds", "Request arrival to the last byte.",
                       NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
}

pd_status_t pd_proxy_run(const pd_proxy_config_t *cfg)
{
    proxy_t *px = calloc(1, sizeof(*px));
    if (px == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    px->cfg = *cfg;
    pd_status_t st = pd_metrics_create(&px->metrics);
    if (st != PD_OK) {
        free(px);
        return st;
    }
    metrics_register(px);
    st = add_list(px, cfg->prefill, true);
    if (st == PD_OK) {
        st = add_list(px, cfg->decode, false);
    }
    if (st == PD_OK && cfg->prefill == NULL && cfg->discover_prefill == NULL) {
        pd_log_error("proxy: give --prefill URLs or --discover-prefill NAME:PORT");
        st = PD_ERR_INVALID_ARG;
    }
    if (st == PD_OK && cfg->decode == NULL && cfg->discover_decode == NULL) {
        pd_log_error("proxy: give --decode URLs or --discover-decode NAME:PORT");
        st = PD_ERR_INVALID_ARG;
    }
    struct evhttp_bound_socket *bs = NULL;
    if (st == PD_OK) {
        px->base = event_base_new();
        px->http = evhttp_new(px->base);
        evhttp_set_max_body_size(px->http, (ev_ssize_t)(cfg->max_request_bytes * 2 + 4096));
        evhttp_set_gencb(px->http, on_request, px);
        bs = evhttp_bind_socket_with_handle(px->http, cfg->host, (ev_uint16_t)cfg->port);
        if (bs == NULL) {
            pd_log_error("proxy: cannot listen on %s:%d", cfg->host, cfg->port);
            st = PD_ERR_IO;
        }
    }
    if (st == PD_OK) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof(sa);
        getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&sa, &sl);
        int port = ntohs(sa.sin_port);
        signal(SIGPIPE, SIG_IGN);
        px->sigterm = evsignal_new(px->base, SIGTERM, on_signal, px);
        px->sigint = evsignal_new(px->base, SIGINT, on_signal, px);
        event_add(px->sigterm, NULL);
        event_add(px->sigint, NULL);
        px->tick = event_new(px->base, -1, EV_PERSIST, on_tick, px);
        struct timeval tv = {(time_t)cfg->health_interval,
                             (suseconds_t)((cfg->health_interval - (int)cfg->health_interval) * 1e6)};
        event_add(px->tick, &tv);
        on_tick(-1, 0, px);
        if (cfg->port_file != NULL) {
            char tmp[4096];
            snprintf(tmp, sizeof(tmp), "%s.tmp", cfg->port_file);
            FILE *f = fopen(tmp, "w");
            if (f == NULL || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0 ||
                rename(tmp, cfg->port_file) != 0) {
                pd_log_error("proxy: cannot write the port file %s", cfg->port_file);
            }
        }
        pd_log_info("proxy: serving on http://%s:%d (policy %s)", cfg->host, port, cfg->policy);
        event_base_dispatch(px->base);
    }
    while (px->inflight != NULL) {
        preq_t *q = px->inflight;
        q->client = NULL;
        if (q->p_conn != NULL) {
            evhttp_connection_free(q->p_conn);
        }
        if (q->d_conn != NULL) {
            evhttp_connection_free(q->d_conn);
        }
        preq_free(q);
    }
    if (px->tick != NULL) {
        event_free(px->tick);
    }
    if (px->sigterm != NULL) {
        event_free(px->sigterm), event_free(px->sigint);
    }
    if (px->http != NULL) {
        evhttp_free(px->http);
    }
    if (px->base != NULL) {
        event_base_free(px->base);
    }
    pd_metrics_destroy(px->metrics);
    free(px);
    return st;
}
