/* proxy/proxy_impl.h — pd-proxy's state, shared by its three parts: pool.c (the node pools:
 * static lists, DNS discovery, health and load probes, the routing policies, upstream connections),
 * route.c (client routes and each request's prefill → decode sequence) and proxy.c (flags, metrics,
 * the event loop's timer and signals). One thread: everything runs on the libevent loop. */
#ifndef PD_PROXY_PROXY_IMPL_H
#define PD_PROXY_PROXY_IMPL_H

#include <event2/event.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/api_fields.h"
#include "common/http_watch.h"
#include "common/metrics.h"
#include "proxy/kv_index.h"
#include "proxy/kv_recent.h"
#include "proxy/proxy.h"

#define MAX_NODES 64

#define PX_IDLE_MAX  8   /* idle upstream connections kept per node at most (--upstream-idle-connections) */
#define PX_IDLE_SECS 2.0 /* ... for this long: far inside libevent's 50 s server-side idle close */

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
    /* upstream keep-alive (pool.c): connections whose request ended, newest last, and since when */
    struct evhttp_connection *idle[PX_IDLE_MAX];
    double idle_since[PX_IDLE_MAX];
    int num_idle;
    pd_metric_t *healthy_g;
    /* vLLM router (production-stack) equivalents, labelled server=URL */
    pd_metric_t *router_healthy, *router_prefill, *router_decoding;
} node_t;

typedef struct proxy proxy_t;

/* What the client has had of one choice of a resumable stream (migrate.c). */
typedef struct px_choice {
    int32_t *gen;
    size_t num_gen, cap_gen;
    bool finish_sent;
} px_choice_t;

typedef struct preq preq_t;
struct preq {
    proxy_t *px;
    struct evhttp_request *client;         /* NULL once answered or the client went away */
    struct evhttp_connection *client_conn; /* its connection's close callback points at us */
    pd_client_watch_t *client_watch;       /* EOF on the client's socket while we wait (http_watch.h) */
    json_t *body;
    char *auth; /* the client's Authorization header (forwarded when no --node-api-key), or NULL */
    bool stream, push;
    const char *path; /* /v1/completions or /v1/chat/completions, sent to both nodes */
    char transfer_id[48];
    char req_id[PD_REQUEST_ID_MAX +
                1]; /* X-Request-Id of both legs: the client's, or the transfer id's random part */
    uint64_t *keys; /* the prompt's full blocks' keys (pd_kv_event_hash chain), or NULL (kv_route.c) */
    int num_keys;
    int32_t num_tokens; /* the prompt's tokens (0: unknown) */
    int32_t *toks;      /* them, when known (malloc'd; kv_fetch.c asks for a prefix) */
    /* peer-to-peer prefix fetch (kv_fetch.c): the node asked to lend the prompt's prefix, its request
     * while it runs, its answer's kv_transfer_params (the prefill's kv_prefix) */
    node_t *lender;
    struct evhttp_connection *lend_conn;
    json_t *kv_prefix;
    bool fetch_asked;   /* one lend per request: a retried prefill leg goes without */
    bool lend_released; /* the lender was told to drop its lease */
    double t_lend;
    char lend_id[96]; /* the lend's transfer id (the lease is released by it) */
    bool resume_lend; /* the lend is for a resumed decode leg (kv_fetch.c px_fetch_resume) */
    bool mig_live;    /* the resumed leg reads a live migration's lease (q->mig) */
    struct evhttp_connection *tok_conn; /* the prompt's /tokenize while it runs */
    node_t *tok_node;                   /* where it runs */
    bool local;                         /* the decode prefills it itself (no prefill leg) */
    node_t *d_hint;                     /* the decode the local-prefill rule chose */
    uint64_t affinity;
    node_t *p, *d;
    bool tried_p[MAX_NODES], tried_d[MAX_NODES];
    struct evhttp_connection *p_conn, *d_conn; /* upstream connections in use */
    json_t *ktp;                               /* pull: the prefill's kv_transfer_params */
    bool p_done, d_done, reply_started;
    bool released; /* the prefill was told to free the KV it held for this request */
    struct evbuffer *d_body;
    /* first-token handover (a streamed request with one choice, --first-token-from-prefill): the
     * prefill's stream starts the answer, the decode's goes on after the events it repeats */
    bool ft;
    bool p_complete;                /* the prefill's stream ended the request (its first token did) */
    bool p_bad_handover;            /* the prefill's handover event carried no kv_transfer_params */
    struct evbuffer *p_sse, *d_sse; /* each leg's events not yet whole */
    struct evbuffer *p_err;         /* a prefill's answer other than 200 */
    int32_t p_events;               /* prefill events relayed (role, first token) */
    int32_t d_skip, d_events;       /* decode events still to drop (its own first ones), relayed */
    int d_code;                     /* the decode's status once it answered */
    bool first_sent;                /* the first token's event went to the client */
    bool batched;                   /* a batch of prompts (completions) */
    /* migration (migrate.c, --migration-limit): a stream is resumable; per choice the token ids of the
     * events the client has (the nodes are asked for them; strip_ids: taken out again, the client did
     * not ask) and whether its finish went out; the role events that went out (chat: one per choice);
     * whether the decode leg's stream ended with [DONE] */
    bool resumable, strip_ids, d_ended;
    px_choice_t *ch; /* [num_ch]: choice index = prompt x n + j */
    int32_t num_ch, roles_sent;
    int migrations;      /* decode legs resumed on another node so far */
    json_t *mig;         /* live migration: the lease on the KV a draining decode ended the stream with
                          * ({"pd_migrate": params}), for the next leg to read, then released */
    node_t *mig_node;    /* the decode that holds it */
    bool pause_open;     /* resumed: the next event relayed ends the pause (t_last_event: its start) */
    double t_last_event; /* when the last event went to the client */
    /* prompt_logprobs (prompt_scores.c): the client's value (taken out of body), the prefill's
     * scores ({"choices": [per prompt], "top": chat's}), and a push decode's answer waiting for them */
    json_t *plp_req, *plp_got;
    bool d_held;
    double t0, t_d_sent, t_first;
    preq_t *prev, *next;
};

typedef struct proxy_metrics {
    pd_metric_t *ok, *failed, *client_gone, *retry_p, *retry_d, *prefill_s, *decode_ttft_s, *e2e_s;
    pd_metric_t *handovers, *first_token_s, *migrations, *kv_migrations, *migration_pause_s, *rebalances;
    pd_metric_t *resume_lends[3]; /* pd_proxy:resume_prompt_lends_total{result=lent|refused|failed} */
    pd_metric_t *routed_local, *routed_remote, *tokenize_failed, *tokenize_s; /* kv_route.c */
    pd_metric_t *fetch[3], *fetch_s;                  /* kv_fetch.c: lent, refused, failed */
    pd_metric_t *kv_gaps, *kv_malformed, *kv_entries; /* --kv-events */
    pd_metric_t *pool_nodes[2];                       /* decode, prefill */
    pd_metric_t *upstream[2];                         /* pool.c: connections made, reused */
} proxy_metrics_t;

struct proxy {
    pd_proxy_config_t cfg;
    struct event_base *base;
    struct evhttp *http;
    struct pd_http_guard *guard; /* slow clients' deadline and the connection cap */
    struct event *tick, *sigterm, *sigint;
    node_t nodes[MAX_NODES];
    int num_nodes;
    uint64_t rr[2];
    uint64_t rr_tokenize; /* the next node to ask for a /tokenize */
    preq_t *inflight;
    pd_metrics_t *metrics;
    proxy_metrics_t m;
    double last_discover;
    bool stopping;
    /* --kv-events: every node's KV cache events (kv_events_sub.c) and the block index they keep */
    void *zmq_ctx;
    px_kv_index_t kv_index;
    px_kv_recent_t kv_recent; /* prompts routed in the last --kv-aware-recent-seconds */
    int kv_block_size;        /* from the nodes' /pd/info or BlockStored events (0: not known yet) */
    struct px_kv_sub *kv_subs[MAX_NODES];
    /* --rebalance-threshold (rebalance.c): the /admin/migrate in flight, when the last one was sent or
     * answered */
    struct evhttp_connection *rebalance_conn;
    double last_rebalance;
};

/* --- route.c: the per-request sequence --- */
/* Ends a request whose decode phase will not run: an error for the client (if still there). */
void px_fail_request(preq_t *q, int status, const char *msg);
/* The decode leg failed (or the client left) after the prefill held KV for it: tells the prefill
 * to free it now (pull: its lease; push: the transfer waiting for a reservation). Once. */
void px_release_prefill(preq_t *q);
/* POSTs body to node n's /pd/release without waiting for the answer (a failure is logged: the lease
 * then ends at the node's hold timeout); false when out of memory, nothing sent. */
bool px_post_release(proxy_t *px, node_t *n, const char *auth, const json_t *body);
/* Sends the decode leg to a healthy decode node (fails q when there is none). */
void px_start_decode(preq_t *q);
/* Sends the prefill leg; false when q ended (and was freed) instead. */
bool px_start_prefill(preq_t *q);
/* The client's body made a prefill leg's one-token request (no stream, logprobs, n or min_tokens;
 * tool_choice none where the decode reads tool calls: the same prompt). */
void px_one_token_body(json_t *body);
/* Sends q's prefill leg to q->p (chosen by px_start_prefill); false when q ended instead. */
bool px_send_prefill(preq_t *q);
/* kv_fetch.c: asks a node holding a longer prefix of q's prompt than q->p to lend it; true when the
 * ask went out (its answer sends the prefill leg). px_fetch_end: the prefill leg ended (or q ends):
 * the lend's lease is released. */
bool px_fetch_begin(preq_t *q);
void px_fetch_end(preq_t *q);
/* After q's decode died (not a live migration): asks q->p, the prefill that computed the prompt, to
 * lend it (its prefix cache likely still holds it), so that the next decode reads the prompt's KV
 * (kv_transfer_params.kv_prefix) and computes only the resumed tokens; true when the ask went out
 * (its answer, lent or not, sends the resumed leg: px_send_resumed). */
bool px_fetch_resume(preq_t *q);
/* migrate.c: sends q's resumed decode leg to q->d (chosen by px_resume_decode). */
void px_send_resumed(preq_t *q);
/* Starts the client's event stream (once; nothing when the client is gone). */
void px_start_client_stream(preq_t *q);

/* --- kv_route.c: what the prompt is, and whether it needs a prefill node --- */
/* Learns q's tokens and block keys (token ids as sent; text and chat through a node's /tokenize)
 * when the policy or the local-prefill rules need them, then starts q's legs: the decode alone
 * when the rules say it should prefill locally, else prefill → decode. q may end (and be freed). */
void px_route_begin(preq_t *q);

/* --- handover.c: the first-token handover (q->ft) --- */
/* The prefill leg's chunk callback: relays its events, keeps the handover event's params. */
void px_ft_on_p_chunk(struct evhttp_request *r, void *arg);
/* The prefill leg ended with status code: continue on the decode, end the answer, retry or fail. */
void px_ft_on_p_done(preq_t *q, int code);
/* Relays the decode's whole events (first-token handover: once the prefill's are out), dropping the
 * first d_skip. */
void px_relay_decode(preq_t *q);
/* Ends the answer once both legs are done (the decode's status in q->d_code); may free q. */
void px_ft_end(preq_t *q);

/* --- rebalance.c: --rebalance-threshold --- */
/* Each tick: the busiest decode migrates streams when it leads the least busy by the threshold. */
void px_rebalance(proxy_t *px);

/* --- migrate.c: requests that outlive their decode node (--migration-limit) --- */
/* At admission: whether q can be resumed, and the nodes asked for token ids. */
void px_migrate_prepare(preq_t *q);
/* The tokens its client has had, over every choice. */
size_t px_gen_total(const preq_t *q);
/* q's keeping of what its client had (px_preq_free). */
void px_migrate_free(preq_t *q);
/* Sends one of q's events to its client (started stream), noting the token ids, role and finish it
 * carries and taking the ids out when the client did not ask for them. */
void px_relay_event(preq_t *q, const char *ev);
/* q ends before the node that took it over sent a token: the lease of a live migration is released
 * on the node that held it (nobody will read it now). */
void px_migrate_end(preq_t *q);
/* Whether event ev is a draining decode's {"pd_migrate": ...} (never one of the events a leg skips). */
bool px_is_migration_event(const char *ev);
/* Whether q's decode leg, ended with status code (0: the connection failed), is resumed elsewhere. */
bool px_should_resume(const preq_t *q, int code);
/* Resumes q on another healthy decode node (after the tokens its client has); fails q without one. */
void px_resume_decode(preq_t *q);
/* --- prompt_scores.c: prompt_logprobs through P/D (the prefill's scores in the decode's answer) --- */
/* At admission: the client's prompt_logprobs taken out of q->body; a 400's message when refused. */
const char *px_plp_prepare(preq_t *q);
/* Sets it on a leg's body that computes the prompt (the prefill's, a local decode's). */
void px_plp_add(const preq_t *q, json_t *body);
/* Keeps the prefill's scores from its 200 answer. */
void px_plp_take(preq_t *q, const json_t *resp);
/* Puts them into the decode's 200 answer (q->d_body); false when they do not fit it. */
bool px_plp_merge(preq_t *q);
/* route.c's decode-leg callbacks (a resumed leg uses them too). */
int px_on_d_header(struct evhttp_request *r, void *arg);
void px_on_d_chunk(struct evhttp_request *r, void *arg);
void px_on_d_done(struct evhttp_request *r, void *arg);

/* --- kv_events_sub.c (--kv-events) --- */
typedef struct px_kv_sub px_kv_sub_t;
/* A node's /pd/info named its KV events endpoints: subscribe (again, when they changed: a new
 * process), starting with a replay of what the node still buffers. */
void px_kv_events_node_info(proxy_t *px, int node, const char *endpoint, const char *replay_endpoint);
/* Drains every subscription (their fds are edge-triggered) and refreshes the index gauges. */
void px_kv_events_poll(proxy_t *px);
void px_kv_events_close(proxy_t *px);

/* --- sse.c --- */
/* Takes the next whole event off buf and returns its data (malloc'd; the data lines joined), or
 * NULL when no whole event is buffered yet. */
char *px_sse_next(struct evbuffer *buf);

/* --- pool.c --- */
/* Adds the nodes of a comma-separated URL list (NULL: none) to a pool. */
pd_status_t px_add_list(proxy_t *px, const char *list, bool prefill);
/* Marks a node (un)healthy, logging the change once. */
void px_set_health(node_t *n, bool ok, const char *why);
/* How many of keys[0..n) node holds as a prefix: by its KV events, or (kv-aware) because a prompt
 * with that prefix was sent there in the last --kv-aware-recent-seconds. */
int px_cached_prefix(const proxy_t *px, const node_t *node, const uint64_t *keys, int n);
/* Remembers that q's prompt was sent to node (kv-aware: see px_cached_prefix). */
void px_note_route(proxy_t *px, const node_t *node, const uint64_t *keys, int n);
/* The node of a pool to send to by the policy, skipping tried[] ones (NULL: none). affinity is the
 * prompt-prefix key of prefix-affinity; keys[num_keys]: the prompt's block keys (kv-aware; NULL:
 * unknown, the load decides); need_info: only nodes whose /pd/info arrived. Advances the pool's
 * round-robin rotation. */
node_t *px_pick(proxy_t *px, bool prefill, const bool *tried, uint64_t affinity, const uint64_t *keys,
                int num_keys, bool need_info);
/* The healthy node of a pool with the least load (legs in flight, or its probed load when higher),
 * skipping tried[] ones; the first of equals (NULL: none). */
node_t *px_pick_least_loaded(proxy_t *px, bool prefill, const bool *tried);
typedef void (*up_done_cb)(struct evhttp_request *, void *);
/* Sends method path with a JSON body (NULL: none) to node n; done(req, arg) runs with the answer
 * (req NULL when the connection failed), chunk and header (may be NULL) as the body streams in.
 * Authorization: --node-api-key when set, else client_auth (the client's header, or NULL).
 * Returns the connection (give it back with px_release_conn) or NULL when it cannot be made. */
struct evhttp_connection *px_upstream(proxy_t *px, node_t *n, enum evhttp_cmd_type method, const char *path,
                                      const char *client_auth, const char *request_id, const json_t *body,
                                      up_done_cb done, void (*chunk)(struct evhttp_request *, void *),
                                      int (*header)(struct evhttp_request *, void *), void *arg);
/* The same for a decode leg: resumable adds PD_RESUMABLE_HEADER (api_fields.h), so that a draining
 * node ends the stream early instead of making its client wait (migrate.c resumes it). */
struct evhttp_connection *px_upstream_leg(proxy_t *px, node_t *n, enum evhttp_cmd_type method,
                                          const char *path, const char *client_auth, const char *request_id,
                                          bool resumable, const json_t *body, up_done_cb done,
                                          void (*chunk)(struct evhttp_request *, void *),
                                          int (*header)(struct evhttp_request *, void *), void *arg);
/* Frees an upstream connection after the current callback returns. */
void px_release_conn(proxy_t *px, struct evhttp_connection *c);
/* Closes every node's idle upstream connections older than max_age seconds (0: all). */
void px_idle_close(proxy_t *px, double max_age);
/* Some node of the pool is healthy. */
bool px_pool_ok(const proxy_t *px, bool prefill);
/* One probe of node n: 0 /health, 1 /pd/info, 2 /metrics (load). */
void px_probe(proxy_t *px, node_t *n, int kind);
/* Resolves spec ("NAME:PORT") and adds its addresses to a pool, marking vanished ones removed. */
void px_discover(proxy_t *px, const char *spec, bool prefill);
/* Reads path (node URLs, one a line; '#' comments) and makes the pool match it, as px_discover
 * does with DNS; an unreadable file leaves the pool as it is (logged once per change). */
void px_discover_file(proxy_t *px, const char *path, bool prefill);
/* Sets pd_proxy:pool_nodes{pool} to the nodes of each pool that are not removed. */
void px_count_pools(proxy_t *px);
/* Before a scrape: the vLLM router's per-server gauges from the in-flight requests and the nodes'
 * health (this is their only writer). */
void px_refresh_router_gauges(proxy_t *px);

/* --- route.c --- */
/* The HTTP server's callback (arg: the proxy). */
void px_on_request(struct evhttp_request *req, void *arg);
/* Frees a request (unlinking it from the in-flight list). */
void px_preq_free(preq_t *q);

#endif
