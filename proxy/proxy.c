/* proxy/proxy.c — pd-proxy's flags, metrics and event loop (timer: discovery and probes; signals:
 * drain, then exit). Pools are in pool.c, requests in route.c. See proxy.h. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

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
#include <zmq.h>

#include "common/api_fields.h"
#include "common/hash.h"
#include "common/http_guard.h"
#include "common/http_reply.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "common/version.h"

void pd_proxy_config_defaults(pd_proxy_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->port = 8000;
    c->policy = "round-robin";
    c->health_interval = 1.0;
    c->discover_interval = 5.0;
    c->upstream_timeout = 600;
    c->idle_connections = 4;
    c->prefix_fetch_timeout = 1.0;
    c->affinity_prefix_chars = 256;
    c->first_token_from_prefill = true;
    c->migration_limit = 3;
    c->kv_index_max_blocks = 1 << 20;
    c->kv_aware_load_weight = 0.1;
    c->kv_aware_recent_s = 5;
    c->max_request_bytes = 16u << 20;
    c->request_timeout = 30.0;
    /* keys from the environment (a Kubernetes Secret), so that they are not on the command line */
    static char client_key[512], node_key[512];
    c->api_key = pd_api_key_from_env("PD_PROXY_API_KEY", client_key, sizeof(client_key));
    c->node_api_key = pd_api_key_from_env("VLLM_API_KEY", node_key, sizeof(node_key));
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
        {"discover-prefill-file", PD_FLAG_STR, &c->discover_prefill_file,
         "a file of prefill node URLs, one a line, re-read every --discover-interval (pdctl scales pools "
         "through it)",
         NULL},
        {"discover-decode-file", PD_FLAG_STR, &c->discover_decode_file, "the same for the decode pool", NULL},
        {"discover-interval", PD_FLAG_DOUBLE, &c->discover_interval, "seconds between DNS resolutions", NULL},
        {"policy", PD_FLAG_CHOICE, &c->policy, "how nodes are picked",
         "round-robin|least-loaded|prefix-affinity|kv-aware"},
        {"first-token-from-prefill", PD_FLAG_BOOL, &c->first_token_from_prefill,
         "streamed requests with one choice: the prefill samples the first token, it is streamed to the "
         "client at once, and the decode continues from it (--no-first-token-from-prefill: the decode "
         "samples it, as vLLM's proxies do)",
         NULL},
        {"migration-limit", PD_FLAG_INT, &c->migration_limit,
         "a request whose decode node fails (its connection breaks, or its stream ends without [DONE]: "
         "killed, or draining) is resumed on another decode node up to this many times: a stream goes on "
         "after the tokens its client has (that node reads their KV from a draining node, which leases "
         "it, or recomputes it after a kill), other requests are sent again; the continuation is the one "
         "the first node would sample, up to the rounding of a recomputed KV (0: the client gets the "
         "error)",
         NULL},
        {"rebalance-threshold", PD_FLAG_INT, &c->rebalance_threshold,
         "keep the decode pool level by live migration: when the healthy decode running the most of this "
         "proxy's resumable streams runs this many more than the one running the fewest, it is asked to "
         "migrate half the difference (POST /admin/migrate {\"max\": k}: its newest streams, whose KV "
         "the next node reads; at most once per --health-interval; 0: never)",
         NULL},
        {"kv-events", PD_FLAG_BOOL, &c->kv_events,
         "subscribe to every node's KV cache events (the endpoints of its /pd/info: nodes started with "
         "--kv-events-config) and index which node caches which block (pd_proxy:kv_index_blocks)",
         NULL},
        {"kv-aware-load-weight", PD_FLAG_DOUBLE, &c->kv_aware_load_weight,
         "kv-aware: a node scores the share of the prompt's full blocks it holds as a prefix (0..1) minus "
         "this times its load (its running + waiting by the last probe, or the requests this proxy has "
         "there when they are more)",
         NULL},
        {"pd-local-prefill-threshold", PD_FLAG_INT, &c->local_prefill_threshold,
         "conditional disaggregation: a prompt whose part the chosen decode node does not hold (by the KV "
         "index; the whole prompt without one) is under this many tokens is prefilled by that decode "
         "node, with no prefill leg and no KV transfer (0: always disaggregate). Text and chat prompts "
         "are counted through a node's /tokenize; implies --kv-events",
         NULL},
        {"pd-local-prefill-hit-ratio", PD_FLAG_DOUBLE, &c->local_prefill_hit_ratio,
         "conditional disaggregation: the decode node also prefills locally when it holds at least this "
         "share (0..1] of the prompt's tokens as cached blocks (0: off); implies --kv-events",
         NULL},
        {"pd-prefix-fetch-min-blocks", PD_FLAG_INT, &c->prefix_fetch_min_blocks,
         "peer-to-peer prefix fetch: when another node (prefill or decode) holds at least this many more "
         "of the prompt's full blocks than the chosen prefill (by the KV index), that node lends them (a "
         "1-token request with kv_transfer_params.kv_lend) and the prefill reads them over the KV pipe "
         "before computing the rest, if its cost model says reading is faster (--kv-prefix-fetch); 0: off. "
         "Implies --kv-events",
         NULL},
        {"pd-prefix-fetch-timeout", PD_FLAG_DOUBLE, &c->prefix_fetch_timeout,
         "seconds a lend may take (a stopped or overloaded lender); past it the prefill computes the prefix",
         NULL},
        {"kv-aware-recent-seconds", PD_FLAG_DOUBLE, &c->kv_aware_recent_s,
         "kv-aware and the local-prefill rules: a prompt sent to a node counts as held there for this "
         "long, until its KV events say so (a burst over a new prefix then stays on one node; 0: the "
         "events alone)",
         NULL},
        {"kv-index-max-blocks", PD_FLAG_INT, &c->kv_index_max_blocks,
         "block keys the index holds at most (16 bytes each, plus the table's slack)", NULL},
        {"health-interval", PD_FLAG_DOUBLE, &c->health_interval, "seconds between node probes", NULL},
        {"upstream-timeout", PD_FLAG_DOUBLE, &c->upstream_timeout, "seconds an upstream request may take",
         NULL},
        {"upstream-idle-connections", PD_FLAG_INT, &c->idle_connections,
         "connections to a node kept open after their request ended, for the next one (HTTP keep-alive, "
         "at most 8, each for 2 s; 0: a new connection per request)",
         NULL},
        {"affinity-prefix-chars", PD_FLAG_INT, &c->affinity_prefix_chars,
         "prompt characters hashed by prefix-affinity", NULL},
        {"max-request-bytes", PD_FLAG_SIZE, &c->max_request_bytes, "largest request body accepted", NULL},
        {"http-request-timeout", PD_FLAG_DOUBLE, &c->request_timeout, PD_HTTP_GUARD_TIMEOUT_HELP, NULL},
        {"http-max-connections", PD_FLAG_INT, &c->max_connections,
         PD_HTTP_GUARD_MAX_CONNS_HELP ": upstream connections need the rest)", NULL},
        {"api-key", PD_FLAG_STR, &c->api_key,
         "require 'Authorization: Bearer KEY' from clients on /v1/ routes, /tokenize and /detokenize "
         "($PD_PROXY_API_KEY when not given)",
         NULL},
        {"node-api-key", PD_FLAG_STR, &c->node_api_key,
         "the key the nodes require (sent as 'Authorization: Bearer KEY'; $VLLM_API_KEY, the nodes' "
         "variable, "
         "when not given); unset: the client's Authorization header is forwarded",
         NULL},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    memcpy(out, f, (n < max ? n : max) * sizeof(f[0]));
    return n;
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    proxy_t *px = arg;
    double now = pd_time_now_s();
    if (px->zmq_ctx != NULL) {
        px_kv_events_poll(px);
    }
    if (now - px->last_discover >= px->cfg.discover_interval) {
        px->last_discover = now;
        px_discover(px, px->cfg.discover_prefill, true);
        px_discover(px, px->cfg.discover_decode, false);
        px_discover_file(px, px->cfg.discover_prefill_file, true);
        px_discover_file(px, px->cfg.discover_decode_file, false);
        px_count_pools(px);
    }
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (n->removed || n->probes > 0) {
            continue; /* one round at a time per node */
        }
        px_probe(px, n, 0);
        px_probe(px, n, 1);
        if (strcmp(px->cfg.policy, "least-loaded") == 0 || strcmp(px->cfg.policy, "kv-aware") == 0) {
            px_probe(px, n, 2);
        }
    }
    px_rebalance(px);
    px_idle_close(px, PX_IDLE_SECS);
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
    pm->pool_nodes[0] = pd_metrics_add(m, PD_METRIC_GAUGE, "pd_proxy:pool_nodes",
                                       "Nodes the pool routes to (listed, not removed by discovery).",
                                       "pool=decode", NULL, 0);
    pm->pool_nodes[1] = pd_metrics_add(m, PD_METRIC_GAUGE, "pd_proxy:pool_nodes",
                                       "Nodes the pool routes to (listed, not removed by discovery).",
                                       "pool=prefill", NULL, 0);
    pm->upstream[0] =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:upstream_connections_total",
                       "Upstream requests (legs, probes, releases) by how they got their "
                       "connection: a new one, or one kept alive (--upstream-idle-connections).",
                       "connection=new", NULL, 0);
    pm->upstream[1] =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:upstream_connections_total",
                       "Upstream requests (legs, probes, releases) by how they got their "
                       "connection: a new one, or one kept alive (--upstream-idle-connections).",
                       "connection=reused", NULL, 0);
    pm->retry_p = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:retries_total",
                                 "Requests re-sent to another node.", "phase=prefill", NULL, 0);
    pm->retry_d = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:retries_total",
                                 "Requests re-sent to another node.", "phase=decode", NULL, 0);
    pm->handovers = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:first_token_handovers_total",
                                   "Streamed requests whose first token came from the prefill and whose "
                                   "decode went on from it (--first-token-from-prefill).",
                                   NULL, NULL, 0);
    pm->migrations = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:migrations_total",
                                    "Decode legs resumed on another decode node after theirs failed "
                                    "(--migration-limit).",
                                    NULL, NULL, 0);
    pm->kv_migrations =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:kv_migrations_total",
                       "Of those, streams a draining decode handed over with a lease on their "
                       "KV, which the next decode reads instead of recomputing.",
                       NULL, NULL, 0);
    static const char *rh =
        "Decode legs resumed after their decode died (not a live migration) whose "
        "prefill was asked to lend the prompt's KV for the next decode: lent (it reads the "
        "prompt and computes only the resumed tokens), refused (no longer cached), failed.";
    static const char *rr[3] = {"result=lent", "result=refused", "result=failed"};
    for (int i = 0; i < 3; i++) {
        pm->resume_lends[i] =
            pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:resume_prompt_lends_total", rh, rr[i], NULL, 0);
    }
    pm->rebalances = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:rebalances_total",
                                    "Times a decode was asked to migrate streams to level the pool "
                                    "(--rebalance-threshold).",
                                    NULL, NULL, 0);
    pm->migration_pause_s =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:migration_pause_seconds",
                       "Resumed streams: the gap their client saw, from the last event before the decode "
                       "failed to the first one from the node that resumed it.",
                       NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    pm->first_token_s =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:first_token_seconds",
                       "Streamed requests: arrival to the first token's event sent to the client.", NULL,
                       PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    pm->routed_local = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:prefills_total",
                                      "Requests by where their prompt was computed: on the decode node "
                                      "(--pd-local-prefill-*) or on a prefill node.",
                                      "where=local", NULL, 0);
    pm->routed_remote = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:prefills_total",
                                       "Requests by where their prompt was computed: on the decode node "
                                       "(--pd-local-prefill-*) or on a prefill node.",
                                       "where=remote", NULL, 0);
    static const char *fh = "Peer-to-peer prefix fetches asked of a node holding a longer prefix than the "
                            "chosen prefill (--pd-prefix-fetch-min-blocks), by its answer: lent (pull "
                            "parameters for the prefill), refused (it no longer holds them), failed.";
    pm->fetch[0] =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:prefix_fetches_total", fh, "result=lent", NULL, 0);
    pm->fetch[1] =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:prefix_fetches_total", fh, "result=refused", NULL, 0);
    pm->fetch[2] =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:prefix_fetches_total", fh, "result=failed", NULL, 0);
    pm->fetch_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:prefix_lend_seconds",
                                 "A prefix fetch's lend request: sent to answered.", NULL, PD_LATENCY_BUCKETS,
                                 PD_LATENCY_NUM_BUCKETS);
    pm->tokenize_failed =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:tokenize_failures_total",
                       "Text or chat prompts a node's /tokenize did not tokenize (routed by the load alone).",
                       NULL, NULL, 0);
    pm->tokenize_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd_proxy:tokenize_seconds",
                                    "Text and chat prompts: arrival to their tokens from a node's /tokenize.",
                                    NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    pm->kv_gaps = pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:kv_events_gaps_total",
                                 "KV event batches found missing (a replay was asked for).", NULL, NULL, 0);
    pm->kv_malformed =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd_proxy:kv_events_malformed_total",
                       "KV event messages that could not be decoded (dropped).", NULL, NULL, 0);
    pm->kv_entries = pd_metrics_add(m, PD_METRIC_GAUGE, "pd_proxy:kv_index_entries",
                                    "Block keys in the KV index (any node).", NULL, NULL, 0);
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
    st = px_add_list(px, cfg->prefill, true);
    if (st == PD_OK) {
        st = px_add_list(px, cfg->decode, false);
    }
    if (st == PD_OK && cfg->prefill == NULL && cfg->discover_prefill == NULL &&
        cfg->discover_prefill_file == NULL) {
        pd_log_error(
            "proxy: give --prefill URLs, --discover-prefill NAME:PORT or --discover-prefill-file PATH");
        st = PD_ERR_INVALID_ARG;
    }
    if (st == PD_OK && cfg->decode == NULL && cfg->discover_decode == NULL &&
        cfg->discover_decode_file == NULL) {
        pd_log_error("proxy: give --decode URLs, --discover-decode NAME:PORT or --discover-decode-file PATH");
        st = PD_ERR_INVALID_ARG;
    }
    if (strcmp(cfg->policy, "kv-aware") == 0 || cfg->local_prefill_threshold > 0 ||
        cfg->local_prefill_hit_ratio > 0 || cfg->prefix_fetch_min_blocks > 0) {
        px->cfg.kv_events = true; /* the policy and the local-prefill rules read the index */
    }
    if (cfg->prefix_fetch_min_blocks < 0 || cfg->prefix_fetch_timeout <= 0) {
        pd_log_error("proxy: --pd-prefix-fetch-min-blocks must be >= 0 and --pd-prefix-fetch-timeout > 0");
        st = PD_ERR_INVALID_ARG;
    }
    if (cfg->idle_connections < 0 || cfg->idle_connections > PX_IDLE_MAX) {
        pd_log_error("proxy: --upstream-idle-connections must be in [0, %d]", PX_IDLE_MAX);
        st = PD_ERR_INVALID_ARG;
    }
    if (cfg->local_prefill_threshold < 0 || cfg->local_prefill_hit_ratio < 0 ||
        cfg->local_prefill_hit_ratio > 1) {
        pd_log_error(
            "proxy: --pd-local-prefill-threshold must be >= 0 and --pd-local-prefill-hit-ratio in [0, 1]");
        st = PD_ERR_INVALID_ARG;
    }
    if (st == PD_OK && px->cfg.kv_events) {
        px->zmq_ctx = zmq_ctx_new();
        if (px->zmq_ctx == NULL || cfg->kv_index_max_blocks < 1 ||
            !px_kv_index_init(&px->kv_index, (uint32_t)cfg->kv_index_max_blocks)) {
            pd_log_error("proxy: cannot set up the KV index (--kv-index-max-blocks %d)",
                         cfg->kv_index_max_blocks);
            st = PD_ERR_NO_MEMORY;
        }
    }
    if (st == PD_OK) { /* the files' first reading, before the first request */
        px_discover_file(px, cfg->discover_prefill_file, true);
        px_discover_file(px, cfg->discover_decode_file, false);
        px_count_pools(px);
    }
    struct evhttp_bound_socket *bs = NULL;
    if (st == PD_OK) {
        px->base = event_base_new();
        px->http = evhttp_new(px->base);
        evhttp_set_max_body_size(px->http, (ev_ssize_t)(cfg->max_request_bytes * 2 + 4096));
        evhttp_set_gencb(px->http, px_on_request, px);
        st = pd_http_guard_create(px->base, px->http, cfg->request_timeout, cfg->max_connections, &px->guard);
        bs = st == PD_OK ? evhttp_bind_socket_with_handle(px->http, cfg->host, (ev_uint16_t)cfg->port) : NULL;
        if (st == PD_OK && bs == NULL) {
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
        px_preq_free(q); /* and its /tokenize, if one runs */
    }
    if (px->rebalance_conn != NULL) {
        evhttp_connection_free(px->rebalance_conn); /* its callback does not run */
    }
    px_idle_close(px, 0);
    px_kv_events_close(px);
    if (px->tick != NULL) {
        event_free(px->tick);
    }
    if (px->sigterm != NULL) {
        event_free(px->sigterm), event_free(px->sigint);
    }
    pd_http_guard_destroy(px->guard); /* before the evhttp: its timer goes first */
    if (px->http != NULL) {
        evhttp_free(px->http);
    }
    if (px->base != NULL) {
        event_base_free(px->base);
    }
    if (px->zmq_ctx != NULL) {
        zmq_ctx_term(px->zmq_ctx);
    }
    px_kv_index_free(&px->kv_index);
    px_kv_recent_free(&px->kv_recent);
    pd_metrics_destroy(px->metrics);
    free(px);
    return st;
}
