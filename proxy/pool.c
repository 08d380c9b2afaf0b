/* proxy/pool.c — pd-proxy's node pools: static lists and DNS discovery, health, /pd/info and load
 * probes, the routing policies (round-robin, least-loaded, prefix-affinity) and upstream
 * connections. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <arpa/inet.h>
#include <errno.h>
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
    pd_metric_label_t server = {"server", url};
    n->router_healthy = pd_metrics_add_labels(px->metrics, PD_METRIC_GAUGE, "vllm:healthy_pods_total",
                                              "Number of healthy vLLM pods (the vLLM router's name; 1 per "
                                              "healthy node in the pool).",
                                              &server, 1, NULL, 0);
    n->router_prefill = pd_metrics_add_labels(px->metrics, PD_METRIC_GAUGE, "vllm:num_prefill_requests",
                                              "Number of Prefill Requests (the vLLM router's name: requests "
                                              "this proxy has in prefill at the server).",
                                              &server, 1, NULL, 0);
    n->router_decoding =
        pd_metrics_add_labels(px->metrics, PD_METRIC_GAUGE, "vllm:num_decoding_requests",
                              "Number of Decoding Requests (the vLLM router's name: requests "
                              "this proxy has in decode at the server).",
                              &server, 1, NULL, 0);
    px->num_nodes++;
    pd_log_info("proxy: %s node %s", prefill ? "prefill" : "decode", url);
    return n;
}

pd_status_t px_add_list(proxy_t *px, const char *list, bool prefill)
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

void px_set_health(node_t *n, bool ok, const char *why)
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

void px_refresh_router_gauges(proxy_t *px)
{
    int prefill[MAX_NODES] = {0}, decoding[MAX_NODES] = {0};
    for (const preq_t *q = px->inflight; q != NULL; q = q->next) {
        if (q->p != NULL && !q->p_done) {
            prefill[q->p - px->nodes]++;
        }
        if (q->d != NULL && q->t_d_sent > 0 && !q->d_done) {
            decoding[q->d - px->nodes]++;
        }
    }
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        pd_metric_set(n->router_prefill, prefill[i]);
        pd_metric_set(n->router_decoding, decoding[i]);
        pd_metric_set(n->router_healthy, n->healthy && !n->removed ? 1 : 0);
    }
}

/* Rendezvous hash of (node, key): the same prompt prefix keeps landing on the same node. */
static uint64_t node_score(const node_t *n, uint64_t key)
{
    return pd_hash64(n->url, strlen(n->url), key);
}

/* A node's load: the requests it runs and queues by its last /metrics probe, or this proxy's
 * requests there when they are more. The probe counts the proxy's requests too (adding both would
 * count them twice), but it is up to --health-interval old: a burst sent since shows only in
 * inflight. */
static double node_load(const node_t *n)
{
    return n->inflight > n->load ? n->inflight : n->load;
}

/* kv-aware: the share of the prompt's full blocks the node holds as a prefix (px_cached_prefix:
 * its events, or a recent route), minus --kv-aware-load-weight times node_load. */
static double kv_aware_score(const proxy_t *px, const node_t *n, const uint64_t *keys, int num_keys)
{
    double cached = num_keys > 0 ? (double)px_cached_prefix(px, n, keys, num_keys) / num_keys : 0;
    return cached - px->cfg.kv_aware_load_weight * node_load(n);
}

int px_cached_prefix(const proxy_t *px, const node_t *node, const uint64_t *keys, int n)
{
    if (px->zmq_ctx == NULL || n <= 0) {
        return 0;
    }
    int idx = (int)(node - px->nodes);
    int held = px_kv_index_prefix(&px->kv_index, keys, n, idx);
    if (px->cfg.kv_aware_recent_s > 0 && held < n) {
        int sent =
            px_kv_recent_prefix(&px->kv_recent, keys, n, idx, pd_time_now_s(), px->cfg.kv_aware_recent_s);
        held = sent > held ? sent : held;
    }
    return held;
}

void px_note_route(proxy_t *px, const node_t *node, const uint64_t *keys, int n)
{
    if (px->zmq_ctx != NULL && px->cfg.kv_aware_recent_s > 0 && n > 0) {
        px_kv_recent_add(&px->kv_recent, keys, n, (int)(node - px->nodes), pd_time_now_s());
    }
}

node_t *px_pick(proxy_t *px, bool prefill, const bool *tried, uint64_t affinity, const uint64_t *keys,
                int num_keys, bool need_info)
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
        double v = strcmp(px->cfg.policy, "least-loaded") == 0 ? -node_load(n)
                   : strcmp(px->cfg.policy, "kv-aware") == 0   ? kv_aware_score(px, n, keys, num_keys)
                                                               : (double)(node_score(n, affinity) >> 11);
        if (num_keys > 0 && strcmp(px->cfg.policy, "kv-aware") == 0 && pd_log_level() == PD_LOG_DEBUG) {
            /* PD_LOG_LEVEL=debug: each candidate's terms, to see why a node won */
            int idx = (int)(n - px->nodes);
            pd_log_debug("kv-aware pick %s %s: key0 %016llx index %d recent %d of %d, load %.0f (inflight "
                         "%d, probed %.0f) -> %.3f",
                         prefill ? "prefill" : "decode", n->url, (unsigned long long)keys[0],
                         px_kv_index_prefix(&px->kv_index, keys, num_keys, idx),
                         px_kv_recent_prefix(&px->kv_recent, keys, num_keys, idx, pd_time_now_s(),
                                             px->cfg.kv_aware_recent_s),
                         num_keys, node_load(n), n->inflight, n->load, v);
        }
        if (best == NULL || v > best_v) {
            best = n;
            best_v = v;
        }
    }
    return best;
}

node_t *px_pick_least_loaded(proxy_t *px, bool prefill, const bool *tried)
{
    node_t *best = NULL;
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (n->prefill == prefill && n->healthy && !n->removed && !tried[i] &&
            (best == NULL || node_load(n) < node_load(best))) {
            best = n;
        }
    }
    return best;
}

/* ------------------------------------------------------------------ upstream requests */

/* Upstream keep-alive: a connection whose request ended goes back to its node's idle list (the
 * newest last), and the node's next request takes it instead of connecting (a connection costs
 * ~0.1 ms on loopback). libevent keeps it usable whatever became of it: one the node closed
 * meanwhile is seen closed and reconnects on its next request, one whose request failed was reset.
 * A connection is kept PX_IDLE_SECS at most (the tick closes older ones), far inside libevent's
 * server-side idle close (50 s), so a node does not close one as the proxy reuses it. A connection
 * whose request is cut short (a client gone, a stream given up) is freed where that happens, as
 * before: its close is what tells the node to abort. Event-loop thread only. */

typedef struct release {
    proxy_t *px;
    struct evhttp_connection *c;
} release_t;

static node_t *conn_node(proxy_t *px, struct evhttp_connection *c)
{
    char *host = NULL;
    ev_uint16_t port = 0;
    evhttp_connection_get_peer(c, &host, &port);
    for (int i = 0; host != NULL && i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (!n->removed && n->port == port && strcmp(n->host, host) == 0) {
            return n;
        }
    }
    return NULL;
}

static void release_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    release_t *rl = arg;
    proxy_t *px = rl->px;
    node_t *n = px->stopping ? NULL : conn_node(px, rl->c);
    if (n != NULL && n->num_idle < px->cfg.idle_connections) {
        n->idle[n->num_idle] = rl->c;
        n->idle_since[n->num_idle++] = pd_time_now_s();
    } else {
        evhttp_connection_free(rl->c);
    }
    free(rl);
}

/* Releases an upstream connection whose request ended, after the current callback returns: kept
 * for its node's next request, or freed. */
void px_release_conn(proxy_t *px, struct evhttp_connection *c)
{
    if (c == NULL) {
        return;
    }
    release_t *rl = malloc(sizeof(*rl));
    struct timeval tv = {0, 0};
    if (rl == NULL) {
        evhttp_connection_free(c); /* no callback of c's is running when it is released */
        return;
    }
    rl->px = px;
    rl->c = c;
    if (event_base_once(px->base, -1, EV_TIMEOUT, release_cb, rl, &tv) != 0) {
        free(rl);
        evhttp_connection_free(c);
    }
}

void px_idle_close(proxy_t *px, double max_age)
{
    double now = pd_time_now_s();
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        int kept = 0;
        for (int k = 0; k < n->num_idle; k++) {
            if (max_age > 0 && !n->removed && now - n->idle_since[k] < max_age) {
                n->idle[kept] = n->idle[k];
                n->idle_since[kept++] = n->idle_since[k];
            } else {
                evhttp_connection_free(n->idle[k]);
            }
        }
        n->num_idle = kept;
    }
}

/* The node's newest idle connection still young enough, or a new one. */
static struct evhttp_connection *take_conn(proxy_t *px, node_t *n)
{
    while (n->num_idle > 0) {
        n->num_idle--;
        struct evhttp_connection *c = n->idle[n->num_idle];
        if (pd_time_now_s() - n->idle_since[n->num_idle] < PX_IDLE_SECS) {
            pd_metric_inc(px->m.upstream[1], 1);
            return c;
        }
        evhttp_connection_free(c);
    }
    pd_metric_inc(px->m.upstream[0], 1);
    return evhttp_connection_base_new(px->base, NULL, n->host, (ev_uint16_t)n->port);
}

struct evhttp_connection *px_upstream(proxy_t *px, node_t *n, enum evhttp_cmd_type method, const char *path,
                                      const char *client_auth, const char *request_id, const json_t *body,
                                      up_done_cb done, void (*chunk)(struct evhttp_request *, void *),
                                      int (*header)(struct evhttp_request *, void *), void *arg)
{
    return px_upstream_leg(px, n, method, path, client_auth, request_id, false, body, done, chunk, header,
                           arg);
}

struct evhttp_connection *px_upstream_leg(proxy_t *px, node_t *n, enum evhttp_cmd_type method,
                                          const char *path, const char *client_auth, const char *request_id,
                                          bool resumable, const json_t *body, up_done_cb done,
                                          void (*chunk)(struct evhttp_request *, void *),
                                          int (*header)(struct evhttp_request *, void *), void *arg)
{
    struct evhttp_connection *c = take_conn(px, n);
    if (c == NULL) {
        return NULL;
    }
    evhttp_connection_set_timeout(c, (int)px->cfg.upstream_timeout); /* a probe's shorter one, reused */
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
    if (px->cfg.node_api_key != NULL && px->cfg.node_api_key[0]) {
        char auth[512];
        snprintf(auth, sizeof(auth), "Bearer %s", px->cfg.node_api_key);
        evhttp_add_header(h, "Authorization", auth);
    } else if (client_auth != NULL) {
        evhttp_add_header(h, "Authorization", client_auth);
    }
    if (request_id != NULL) {
        evhttp_add_header(h, "X-Request-Id", request_id);
    }
    if (resumable) { /* a draining node may end this stream early: the proxy resumes it elsewhere */
        evhttp_add_header(h, PD_RESUMABLE_HEADER, "1");
    }
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

bool px_pool_ok(const proxy_t *px, bool prefill)
{
    for (int i = 0; i < px->num_nodes; i++) {
        if (px->nodes[i].prefill == prefill && px->nodes[i].healthy && !px->nodes[i].removed) {
            return true;
        }
    }
    return false;
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
        px_set_health(n, code == 200, code == 0 ? "connection failed" : "health probe failed");
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
            json_int_t bs = json_integer_value(json_object_get(j, "block_size"));
            if (pr->px->kv_block_size == 0 && bs > 0 && bs <= 1 << 16) {
                /* before the first event: the first requests' blocks are hashed too */
                pr->px->kv_block_size = (int)bs;
            }
            px_kv_events_node_info(pr->px, (int)(n - pr->px->nodes),
                                   json_string_value(json_object_get(j, "kv_events_endpoint")),
                                   json_string_value(json_object_get(j, "kv_events_replay_endpoint")));
        }
        json_decref(j);
    } else if (pr->kind == 2 && code == 200 && text != NULL) {
        n->load = pd_metrics_text_value(text, "vllm:num_requests_running", 0) +
                  pd_metrics_text_value(text, "vllm:num_requests_waiting", 0);
    }
    free(text);
    n->probes--;
    px_release_conn(pr->px, pr->conn);
    free(pr);
}

void px_probe(proxy_t *px, node_t *n, int kind)
{
    static const char *const paths[3] = {"/health", "/pd/info", "/metrics"};
    probe_t *pr = calloc(1, sizeof(*pr));
    pr->px = px;
    pr->n = n;
    pr->kind = kind;
    pr->conn = px_upstream(px, n, EVHTTP_REQ_GET, paths[kind], NULL, NULL, NULL, on_probe, NULL, NULL, pr);
    if (pr->conn == NULL) {
        free(pr);
        return;
    }
    evhttp_connection_set_timeout(pr->conn, (int)(px->cfg.health_interval * 3 + 1));
    n->probes++;
}

/* Marks the pool's nodes that seen does not hold removed (they take no new requests). */
static void remove_unseen(proxy_t *px, const bool *seen, bool prefill, const char *source)
{
    for (int i = 0; i < px->num_nodes; i++) {
        if (px->nodes[i].prefill == prefill && !seen[i] && !px->nodes[i].removed) {
            pd_log_info("proxy: %s left %s", px->nodes[i].url, source);
            px->nodes[i].removed = true;
        }
    }
}

void px_count_pools(proxy_t *px)
{
    int n[2] = {0, 0};
    for (int i = 0; i < px->num_nodes; i++) {
        n[px->nodes[i].prefill] += !px->nodes[i].removed;
    }
    pd_metric_set(px->m.pool_nodes[0], n[0]);
    pd_metric_set(px->m.pool_nodes[1], n[1]);
}

void px_discover_file(proxy_t *px, const char *path, bool prefill)
{
    if (path == NULL) {
        return;
    }
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        pd_log_warn("proxy: cannot read %s: %s (the %s pool stays as it is)", path, strerror(errno),
                    prefill ? "prefill" : "decode");
        return;
    }
    bool seen[MAX_NODES] = {false};
    char line[512];
    while (fgets(line, sizeof(line), f) != NULL) {
        char url[256];
        if (sscanf(line, " %255s", url) != 1 || url[0] == '#') {
            continue;
        }
        node_t *n = add_node(px, url, prefill);
        if (n != NULL) {
            seen[n - px->nodes] = true;
        }
    }
    fclose(f);
    char source[300];
    snprintf(source, sizeof(source), "the file %s", path);
    remove_unseen(px, seen, prefill, source);
}

/* Re-resolves NAME:PORT and makes the pool match its A records. */
void px_discover(proxy_t *px, const char *spec, bool prefill)
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
    char source[300];
    snprintf(source, sizeof(source), "the DNS answer for %s", name);
    remove_unseen(px, seen, prefill, source);
}
