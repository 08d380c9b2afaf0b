/* connector/kv_conn.h — the P/D connector object as both of its threads see it. Three owners:
 *
 *   kv_eng_t (kv_engine.h)  the engine thread: the scheduler and worker halves (kv_scheduler.c,
 *                           kv_worker.c, kv_staging.c): pending loads and pushes, step metadata,
 *                           reservations offered, what get_finished reported
 *   kv_ctl_t (kv_ctl.h)     the control thread ("kv-ctl"): peers, dials, handshakes, transfers,
 *                           leases, reservations, deferred aborts, timers (kv_ctl.c, kv_commands.c,
 *                           kv_peers.c, kv_xfers.c, kv_messages.c, kv_timers.c, kv_aborts.c)
 *   kv_mb_t  (kv_mail.h)    the mailbox: the only state both touch, under its own mutex
 *
 * A file includes the header of the owner it runs as; kv_conn_t points at each owner's state
 * through an opaque pointer, so a file cannot reach into the other's fields. What kv_conn_t holds
 * itself is set before the control thread starts and read-only after (configuration, identity,
 * this engine's KV geometry, the pipe and its region, the metrics, which are atomic); the facade
 * (kv_connector.c) creates, starts, stops and frees it. */
#ifndef PD_CONNECTOR_KV_CONN_H
#define PD_CONNECTOR_KV_CONN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "common/list.h"
#include "common/metrics.h"
#include "connector/control.h"
#include "connector/kv_connector.h"
#include "connector/kv_mail.h"
#include "pipe/pipe.h"

typedef struct kv_metrics {
    pd_metric_t *started[3], *completed[3], *failed[3]; /* pull_load, push_load, push_save */
    pd_metric_t *bytes, *latency, *pages, *leases_held, *leases_now, *resvs_now, *leases_expired,
        *handshakes_ok, *handshakes_failed, *params_refused, *imported, *prefix_fetches, *migrations_lent,
        *migrations_loaded, *migration_load_s;
    pd_metric_t *policy_recompute, *policy_fail, *stale, *peers;
    pd_metric_t *phase_queue, *phase_transfer, *phase_notify, *phase_remote, *handshake_s;
    pd_metric_t *staged_d2h, *staged_h2d, *staged_seconds;
    /* vLLM's NixlConnector names (its dashboards read them), per completed load on the decode */
    pd_metric_t *nixl_xfer_s, *nixl_post_s, *nixl_bytes, *nixl_descs, *nixl_failed, *nixl_expired;
} kv_metrics_t;

typedef struct kv_conn {
    pd_connector_t pub;
    pd_kv_connector_config_t cfg;
    bool is_prefill, push;
    char engine_id[64];
    char listen_host[64];
    int listen_port;
    char advertise_host[64];
    int advertise_port;      /* 0 until the listener is bound: then --kv-advertise-port or the listen port */
    char advertise_addr[80]; /* "advertise_host:advertise_port", set with it (handshake proofs cover it) */
    uint8_t token[256];
    size_t token_len;
    Pd__Fingerprint fp;
    char fp_model[160], fp_dtype[16], fp_layout[160];
    char group_layout[128]; /* from register_kv_caches (pd_kv_cache_config_layout) */
    kv_metrics_t m;
    /* kv_cost.c: the pull loads' measured cost (written by the control thread, read by the scheduler
     * half: atomics, relaxed) and --kv-prefix-fetch */
    _Atomic double cost_bw, cost_overhead_s;
    _Atomic uint64_t cost_loads;
    enum { KV_PREFIX_FETCH_AUTO, KV_PREFIX_FETCH_ALWAYS, KV_PREFIX_FETCH_NEVER } prefix_fetch;

    /* the pipe and this engine's KV region (the pipe is the control thread's once it runs: the
     * engine thread only registered the region before) */
    pd_pipe_t *pipe;
    Pd__PipeKind pipe_kind;
    pd_pipe_region_t *region; /* the KV region, or its host mirror when staged */
    pd_kv_region_allocator_t alloc;
    bool staged;           /* region is a mirror of the engine's KV at kv_base */
    void *kv_base;         /* the engine's KV region (staged) */
    pd_kv_copy_ops_t copy; /* the engine's page copies (staged) */
    bool pinned;           /* region is page-locked by be */
    kv_geom_t geom;
    int32_t block_size;

    pthread_t prefault_thread;
    bool prefault_started, prefault_stop;

    kv_mb_t mb;
    struct kv_eng *e; /* engine thread (kv_engine.h) */
    struct kv_ctl *c; /* control thread (kv_ctl.h) */
} kv_conn_t;

/* Block lists here are the scheduler's (connector/connector.h): G entries per logical block. The
 * entry index of logical block b (entries before it), and whether entry i of a list is layer l's. */
static inline int32_t kv_entry(const kv_geom_t *g, int32_t b)
{
    return b * (int32_t)(g->num_groups > 0 ? g->num_groups : 1);
}

static inline bool kv_entry_of_layer(const kv_geom_t *g, int32_t i, int32_t l)
{
    return g->num_groups <= 1 || i % (int32_t)g->num_groups == g->layer_group[l];
}

/* A load failed: counts the action the engine's --kv-load-failure-policy takes (any thread). */
void kv_count_policy_action(kv_conn_t *k);
bool kv_jbool(const json_t *o, const char *key);
const char *kv_jstr(const json_t *o, const char *key);
uint64_t kv_random_u52(void);

/* kv_cost.c: a completed pull load moved bytes in moved_s, in total_s from its start (control
 * thread); whether fetching a prompt's positions [from, to) from a peer beats computing them here,
 * with both estimates (engine thread; compute 0: unknown). */
void kv_cost_observe(kv_conn_t *k, size_t bytes, double moved_s, double total_s);
bool kv_cost_fetch(const kv_conn_t *k, int32_t from, int32_t to, double *fetch_s, double *compute_s);

/* kv_sign.c: SHA-256 of a prompt's token ids (int32 little-endian). */
void kv_prompt_hash(const int32_t *tokens, int32_t n, uint8_t out[32]);
/* Adds prompt_sha256 and (with a token) pd_sig to pull params p that are otherwise complete. */
pd_status_t kv_params_sign(const kv_conn_t *k, json_t *p, const int32_t *prompt, int32_t num_prompt);
/* Why pull params p cannot load prompt[num_prompt] (static text), or NULL: the hash, the MAC. */
const char *kv_params_verify(const kv_conn_t *k, const json_t *p, const int32_t *prompt, int32_t num_prompt);

#endif
