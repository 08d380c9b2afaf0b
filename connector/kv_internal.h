/* connector/kv_internal.h — state shared by the P/D connector's engine-thread half
 * (kv_connector.c) and its control thread (kv_ctl.c). Everything below `mu` is protected by it
 * unless marked "engine thread" or "ctl thread". */
#ifndef PD_CONNECTOR_KV_INTERNAL_H
#define PD_CONNECTOR_KV_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "common/list.h"
#include "common/metrics.h"
#include "common/strmap.h"
#include "connector/control.h"
#include "connector/kv_connector.h"
#include "pipe/pipe.h"

/* A peer engine's KV geometry, from its Regions message. */
typedef struct kv_geom {
    uint64_t length, page_bytes;
    uint32_t num_blocks;
    uint32_t num_layers;
    uint64_t layer_offset[PD_MAX_LAYERS];
    /* KV cache groups (local geometry only; a peer's equals ours, the fingerprint says so): block
     * lists hold num_groups ids per logical block, layer l reads entry b × num_groups + group */
    uint32_t num_groups;
    int32_t layer_group[PD_MAX_LAYERS];
} kv_geom_t;

typedef enum kv_peer_state {
    KV_PEER_WAIT_REGIONS = 0, /* handshake done, waiting for the peer's Regions */
    KV_PEER_READY,
    KV_PEER_DEAD,
} kv_peer_state_t;

/* An accepted connection still in the handshake (ctl thread only): driven by the poll loop one
 * frame at a time, so a silent or dribbling client costs its own deadline and nothing else. */
#define KV_MAX_HANDSHAKES 64 /* beyond this the oldest pending connection is dropped */
typedef struct kv_hs kv_hs_t;
struct kv_hs {
    int fd;
    pd_ctl_reader_t rd;
    pd_ctl_server_hs_t hs;
    double deadline;     /* accepted + --kv-handshake-timeout */
    pd_list_link_t link; /* on kv_conn_t.handshakes, oldest first */
};

/* A connection we dial, until its handshake completes (ctl thread only): non-blocking connect,
 * then the client handshake one frame at a time, bounded by its deadline. */
typedef struct kv_dial kv_dial_t;
struct kv_dial {
    char addr[128]; /* "host:port" */
    int fd;
    bool connected; /* the TCP connect finished and the Hello went out */
    pd_ctl_reader_t rd;
    pd_ctl_client_hs_t hs;
    double started, deadline;
    pd_list_link_t link;
};

/* A connected engine (ctl thread). */
typedef struct kv_peer kv_peer_t;
struct kv_peer {
    char dial[128]; /* "host:port" we dialled ("" for a peer that dialled us) */
    char engine_id[64];
    int fd;
    pd_ctl_reader_t rd;
    kv_peer_state_t state;
    pd_pipe_peer_t *pp;
    pd_pipe_remote_t *remote; /* its KV region, NULL until Regions */
    kv_geom_t geom;
    double last_rx, last_hb, since;
    uint64_t hb_seq;
    /* control frames not yet written (ctl thread only): peer_send queues, the loop flushes on
     * POLLOUT; nothing waits on the socket */
    uint8_t *out;
    size_t out_len, out_cap;
    pd_list_link_t link;
};

/* One finished request on its way to get_finished: a prefill's blocks that may be freed
 * (finished_sending) or a decode load that ended (finished_recving, with the blocks that did not
 * arrive). Allocated with the lease or transfer that will end in it, on the engine thread, where
 * running out of memory refuses the request cleanly; so an ending, on the control thread, is always
 * reported (kv_report_sending / kv_report_recving move the node, they allocate nothing). */
typedef struct kv_report kv_report_t;
struct kv_report {
    char req_id[PD_REQ_ID_MAX];
    bool recving;
    int32_t first_token; /* recving: the prefill's first token (push handover), else -1 */
    /* recving: the load's block list (taken from its transfer) and the entries [first, end) it
     * covered: failed → load errors; staged → copied from the host mirror in get_finished */
    uint32_t *blocks;
    int32_t first, end;
    bool failed, staged;
    int32_t errors_taken; /* failed: entries get_block_ids_with_load_errors returned so far */
    pd_list_link_t link;  /* on kv_conn_t.reports (mu), then .reported (engine thread) */
};

typedef enum kv_xfer_kind {
    KV_X_PULL_LOAD = 0, /* decode: read from the prefill, then READ_DONE */
    KV_X_PUSH_LOAD,     /* decode: reserve, wait for WRITE_DONE */
    KV_X_PUSH_SAVE,     /* prefill: write into a reservation after the request finished */
} kv_xfer_kind_t;

typedef enum kv_xfer_state {
    KV_XS_QUEUED = 0, /* not started (needs a peer) */
    KV_XS_POSTED,     /* pages in flight on the pipe */
    KV_XS_WAIT_PEER,  /* waiting for the peer's ACK / WRITE_DONE */
    KV_XS_DONE,
} kv_xfer_state_t;

/* One transfer the control thread drives. */
typedef struct kv_xfer kv_xfer_t;
struct kv_xfer {
    kv_xfer_kind_t kind;
    kv_xfer_state_t state;
    char req_id[PD_REQ_ID_MAX];     /* local request id */
    char remote_req[PD_REQ_ID_MAX]; /* pull: the prefill's request id; push: the transfer id */
    char dial[128];                 /* decode side: the prefill's control address */
    char remote_engine[64];         /* expected engine id ("" = any) */
    uint64_t lease_id;
    uint32_t *local_blocks;
    int32_t num_local;
    uint32_t *remote_blocks;
    int32_t num_remote;
    int32_t first_block, end_block; /* block indexes to move: [first, end) */
    int32_t num_tokens;
    double started, deadline;
    double t_posted, t_moved; /* pages posted (or reservation sent), pages landed */
    kv_peer_t *peer;
    bool cancelled;     /* the request was aborted: no load errors, just release */
    bool redialed;      /* the cached peer had another engine id: dialled once more */
    bool overdue;       /* posted past its deadline: its peer was killed, its completion ends it */
    bool start_counted; /* push save continuing a stream whose start the metrics already counted */
    /* first-token handover, push: the token the prefill sampled (save: sent with WRITE_DONE; load:
     * received with it and reported with the load's end) */
    bool has_first_token;
    int32_t first_token;
    /* push: the prompt's kv_prompt_hash (save: sent with WRITE_DONE; load: what WRITE_DONE must name) */
    uint8_t prompt_hash[32];
    struct kv_conn *conn;
    kv_report_t *report;  /* its end, for get_finished (NULL once reported) */
    struct kv_resv *resv; /* push save: the reservation written into */
    size_t bytes;
    int32_t pages;
    pd_list_link_t link;
};

/* Prefill, pull: blocks held for a reader. */
typedef struct kv_lease kv_lease_t;
struct kv_lease {
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX]; /* the proxy's id for the request ("" = none): releases it too */
    uint64_t lease_id;
    double expires;
    bool expired;        /* blocks released; kept a while to answer STALE */
    kv_report_t *report; /* the blocks' release, for get_finished (NULL once reported) */
    pd_list_link_t link;
};

/* Decode: an ABORT owed to a prefill that was unreachable when the load ended (kv_aborts.c). */
typedef struct kv_abort kv_abort_t;
struct kv_abort {
    char dial[128];     /* the prefill's control address */
    char engine_id[64]; /* the engine that granted the lease ("" = whichever answers there) */
    char req_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    double expires; /* the prefill's hold timeout has ended the lease by then */
    double next_dial, backoff;
    pd_list_link_t link; /* on kv_conn_t.aborts, oldest first */
};

/* Prefill, push: a decode's reservation (from the network; validated). */
typedef struct kv_resv kv_resv_t;
struct kv_resv {
    char transfer_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    kv_peer_t *peer;
    uint32_t *blocks;
    int32_t num_blocks;
    int32_t skip_blocks;
    int32_t num_tokens;
    double expires;
    bool taken;    /* bound to a local request (engine thread) */
    bool released; /* the request is done with it: the ctl thread frees it */
    bool dead;     /* its peer died: nothing may be written */
    pd_list_link_t link;
};

/* Prefill, push: one request being saved (engine thread, except `job` counters under mu). */
typedef struct kv_push kv_push_t;
struct kv_push {
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX];
    kv_resv_t *resv; /* bound reservation, NULL until one arrived */
    bool streaming;  /* every step so far wrote its layers */
    bool failed;
    int32_t next_block; /* first block not yet completely written */
    int32_t steps;
    pd_list_link_t link;
};

/* A batch of page writes posted by save_kv_layer (engine thread → ctl thread). */
typedef struct kv_write_job kv_write_job_t;
struct kv_write_job {
    kv_peer_t *peer;
    pd_page_xfer_t *pages;
    int32_t num_pages;
    size_t bytes;
    uint64_t gen; /* the step that posted it (completions of older steps are not counted) */
    struct kv_conn *conn;
    pd_list_link_t link;
};

/* Notification the ctl thread must send (engine thread → ctl thread). */
typedef struct kv_notice kv_notice_t;
struct kv_notice {
    pd_msg_type_t type; /* WRITE_DONE or ABORT */
    kv_peer_t *peer;
    char request_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    int32_t status;
    int32_t first_token;     /* WRITE_DONE of a first-token handover: the prefill's first token, else -1 */
    uint8_t prompt_hash[32]; /* WRITE_DONE: the prompt's kv_prompt_hash */
    pd_list_link_t link;
};

/* One step's connector metadata (scheduler half → worker half). */
typedef struct kv_save_item {
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX];
    const uint32_t *blocks; /* the request's block ids (valid during the step) */
    int32_t num_blocks;
    int32_t start_token, end_token; /* tokens computed this step */
    int32_t prompt_len;
    int32_t
        cached_tokens; /* prefix-cache hit when first scheduled (staged: those pages may lack a mirror copy) */
    bool push;         /* false: staged only (pull mode) */
} kv_save_item_t;

typedef struct kv_meta {
    pd_list_link_t loads; /* kv_xfer_t: loads to start */
    kv_save_item_t *saves;
    int32_t num_saves;
    size_t cap_saves;
    bool incomplete; /* out of memory building saves: bind fails the step (a skipped save would
                      * leave a staged mirror without the step's pages) */
} kv_meta_t;

typedef struct kv_metrics {
    pd_metric_t *started[3], *completed[3], *failed[3]; /* pull_load, push_load, push_save */
    pd_metric_t *bytes, *latency, *pages, *leases_held, *leases_now, *resvs_now, *leases_expired,
        *handshakes_ok, *handshakes_failed, *params_refused, *imported;
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

    /* the pipe and this engine's KV region */
    pd_pipe_t *pipe;
    Pd__PipeKind pipe_kind;
    pd_pipe_region_t *region; /* the KV region, or its host mirror when staged */
    pd_kv_region_allocator_t alloc;
    bool staged;              /* region is a mirror of the engine's KV at kv_base */
    void *kv_base;            /* the engine's KV region (staged) */
    pd_kv_copy_ops_t copy;    /* the engine's page copies (staged) */
    bool pinned;              /* region is page-locked by be */
    pd_strmap_t stage_failed; /* prefill, pull: requests whose staging failed (engine thread) */
    pd_strmap_t released;     /* prefill, push, under mu: transfer ids the proxy released before the
                           * request finished (request_finished then holds nothing) */
    kv_geom_t geom;
    int32_t block_size;

    /* engine thread only */
    kv_meta_t meta_build, *meta_bound;
    pd_list_link_t
        sched_pending;       /* kv_xfer_t: built in update_state_after_alloc, handed over in build_meta */
    pd_list_link_t pushes;   /* kv_push_t */
    pd_list_link_t reported; /* kv_report_t: what get_finished returned last, and failed loads whose
                              * errors get_block_ids_with_load_errors has not returned yet */
    const char **rep_sending, **rep_recving; /* what get_finished returned last (into reported) */
    int32_t *rep_first;                      /* beside rep_recving */
    size_t cap_rep_sending, cap_rep_recving, cap_rep_first;
    int32_t num_rep_sending, num_rep_recving;
    int32_t step_jobs; /* write jobs posted this step */

    pthread_t prefault_thread;
    bool prefault_started, prefault_stop;

    /* control thread */
    pthread_t thread;
    bool thread_started;
    int listen_fd, wake_fd;
    pd_list_link_t peers;      /* kv_peer_t, under mu */
    pd_list_link_t handshakes; /* kv_hs_t, ctl thread only: accepted, not yet authenticated (oldest first) */
    int num_handshakes;
    double accept_resume, accept_logged; /* ctl thread only: out of fds, accepts paused until then */
    pd_list_link_t dials;  /* kv_dial_t, ctl thread only, under mu: dialled, not yet authenticated */
    pd_list_link_t aborts; /* kv_abort_t, ctl thread only, under mu: owed to unreachable prefills */
    int num_aborts;

    pthread_mutex_t mu;
    pthread_cond_t cv; /* write jobs completing (wait_for_save) */
    bool stop;
    pd_list_link_t xfers;           /* kv_xfer_t: started transfers */
    pd_list_link_t handoff;         /* kv_xfer_t: loads handed to the ctl thread, not yet started */
    pd_list_link_t leases;          /* kv_lease_t */
    pd_list_link_t resvs;           /* kv_resv_t */
    pd_list_link_t jobs;            /* kv_write_job_t, in posting order */
    pd_list_link_t notices;         /* kv_notice_t, in queueing order */
    uint64_t gen;                   /* step generation of write jobs */
    int32_t jobs_posted;            /* write jobs on the pipe (ctl thread) */
    int32_t jobs_done, jobs_failed; /* of this step's jobs */
    pd_list_link_t reports;         /* kv_report_t: ended, for the next get_finished, in ending order */
} kv_conn_t;

/* --- kv_ctl.c --- */
pd_status_t kv_ctl_start(kv_conn_t *k);
void kv_ctl_stop(kv_conn_t *k);
/* Wakes the control thread (any thread). */
void kv_ctl_wake(kv_conn_t *k);

/* --- kv_connector.c, called with mu held --- */
/* A report node for req_id (engine thread); NULL when out of memory (logged by the caller). */
kv_report_t *kv_report_new(const char *req_id, bool recving);
void kv_report_free(kv_report_t *r);
/* A prefill's blocks may be freed: *report (the lease's or transfer's) goes to get_finished and
 * *report becomes NULL; nothing when it already went. Cannot fail. */
void kv_report_sending(kv_conn_t *k, kv_report_t **report);
/* Decode load x ended (ok: its pages landed; else its blocks [first, end) are load errors, unless
 * it was cancelled): its report takes x's block list and the first token it carried (push
 * handover). Cannot fail. */
void kv_report_recving(kv_conn_t *k, kv_xfer_t *x, bool ok);
void kv_lease_free(kv_lease_t *l);
/* A load failed: counts the action the engine's --kv-load-failure-policy takes (any thread). */
void kv_count_policy_action(kv_conn_t *k);
/* Prefill, push: transfer_id's decode gave up before it reserved blocks: the held request frees
 * now, or (not finished yet) holds nothing when it finishes. mu held. */
bool kv_release_push(kv_conn_t *k, const char *transfer_id);

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
void kv_xfer_free(kv_xfer_t *x);

/* ------------------------------------------------------------------ engine-thread internals
 * (contracts at the definitions) */

/* kv_connector.c */
bool kv_jbool(const json_t *o, const char *key);
/* kv_sign.c: SHA-256 of a prompt's token ids (int32 little-endian). */
void kv_prompt_hash(const int32_t *tokens, int32_t n, uint8_t out[32]);
/* Adds prompt_sha256 and (with a token) pd_sig to pull params p that are otherwise complete. */
pd_status_t kv_params_sign(const kv_conn_t *k, json_t *p, const int32_t *prompt, int32_t num_prompt);
/* Why pull params p cannot load prompt[num_prompt] (static text), or NULL: the hash, the MAC. */
const char *kv_params_verify(const kv_conn_t *k, const json_t *p, const int32_t *prompt, int32_t num_prompt);
const char *kv_jstr(const json_t *o, const char *key);
uint64_t kv_random_u52(void);
bool kv_wants_push(const kv_conn_t *k, const json_t *p);
kv_push_t *kv_push_find(kv_conn_t *k, const char *req_id, bool unlink);
/* first_token: WRITE_DONE of a first-token handover (the prefill's first token), else -1. */
void kv_notice(kv_conn_t *k, pd_msg_type_t type, kv_peer_t *peer, const char *rid, uint64_t lease,
               int32_t status, int32_t first_token, const uint8_t *prompt_hash /* [32] or NULL */);
void kv_start_prefault(kv_conn_t *k);

/* kv_scheduler.c */
pd_status_t kv_get_num_new_matched_tokens(pd_connector_t *c, const pd_request_t *req, int32_t num_computed,
                                          int32_t *num_external_out, bool *load_async_out);
pd_status_t kv_update_state_after_alloc(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                        int32_t num_blocks, int32_t num_external);
bool kv_load_may_wait(pd_connector_t *c, const pd_request_t *req);
const char *kv_params_error(pd_connector_t *c, const void *kv_transfer_params);
void *kv_build_connector_meta(pd_connector_t *c, const struct pd_scheduler_output *out);
bool kv_request_finished(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                         void **params_out);

/* kv_worker.c */
pd_status_t kv_register_kv_caches(pd_connector_t *c, const pd_kv_region_desc_t *rd);
pd_status_t kv_bind_connector_metadata(pd_connector_t *c, void *meta);
pd_status_t kv_start_load_kv(pd_connector_t *c);
pd_status_t kv_wait_for_layer_load(pd_connector_t *c, int32_t layer);
pd_status_t kv_save_kv_layer(pd_connector_t *c, int32_t layer);
pd_status_t kv_wait_for_save(pd_connector_t *c);
pd_status_t kv_get_finished(pd_connector_t *c, pd_connector_finished_t *out);
int32_t kv_get_block_ids_with_load_errors(pd_connector_t *c, uint32_t *ids, int32_t max);

/* kv_staging.c */
pd_status_t kv_stage_save_layer(kv_conn_t *k, const kv_save_item_t *s, int32_t layer);
/* PD_ERR_NO_MEMORY (logged) when it cannot be recorded: the step must fail. */
pd_status_t kv_stage_failed_add(kv_conn_t *k, const char *req_id);
bool kv_stage_failed_take(kv_conn_t *k, const char *req_id);
/* Decode: copies the pages of loads that landed in the host mirror (reports marked staged) into
 * the engine's KV; a failed copy turns the load into load errors (engine thread, mu not held). */
void kv_stage_finish_loads(kv_conn_t *k, pd_list_link_t *reports);
pd_status_t kv_stage_kv(kv_conn_t *k, const pd_kv_region_desc_t *rd);

/* ------------------------------------------------------------------ control thread internals
 * (their contracts are at the definitions) */

/* kv_ctl.c */
int kv_ms_of(double s);

/* kv_peers.c */
pd_status_t kv_flush_peer(kv_conn_t *k, kv_peer_t *p);
pd_status_t kv_peer_send(kv_conn_t *k, kv_peer_t *p, pd_msg_type_t type, const ProtobufCMessage *msg);
void kv_peer_dead(kv_conn_t *k, kv_peer_t *p, const char *why);
void kv_on_regions(kv_conn_t *k, kv_peer_t *p, const Pd__Regions *m);
kv_dial_t *kv_find_dial(kv_conn_t *k, const char *addr);
bool kv_dial_start(kv_conn_t *k, const char *addr);
void kv_dial_io(kv_conn_t *k, kv_dial_t *d);
void kv_dial_expire(kv_conn_t *k);
void kv_hs_free(kv_hs_t *h);
void kv_accept_peer(kv_conn_t *k);
void kv_hs_read(kv_conn_t *k, kv_hs_t *h);
void kv_hs_expire(kv_conn_t *k);
kv_peer_t *kv_find_peer(kv_conn_t *k, const char *dial);
void kv_parse_frames(kv_conn_t *k, kv_peer_t *p);
void kv_read_peer(kv_conn_t *k, kv_peer_t *p);

/* kv_xfers.c */
void kv_observe_done(kv_conn_t *k, kv_xfer_t *x);
void kv_end_load(kv_conn_t *k, kv_xfer_t *x, bool ok);
void kv_fail_xfer(kv_conn_t *k, kv_xfer_t *x, const char *why);
void kv_drive_queued(kv_conn_t *k);
void kv_post_jobs(kv_conn_t *k);
void kv_send_notices(kv_conn_t *k);

/* kv_messages.c */
void kv_on_message(kv_conn_t *k, kv_peer_t *p, const pd_ctl_msg_t *msg);

/* kv_timers.c */
void kv_run_timers(kv_conn_t *k);

/* kv_aborts.c */
/* Keeps x's ABORT for its prefill (x->dial, its engine) until a reconnect or the hold timeout. */
void kv_abort_defer(kv_conn_t *k, const kv_xfer_t *x);
/* p was just authenticated: the ABORTs owed to its address go out (or are dropped when another
 * engine answers there). */
void kv_aborts_deliver(kv_conn_t *k, kv_peer_t *p);
/* Expires deferred ABORTs and redials their addresses with backoff. */
void kv_aborts_tick(kv_conn_t *k, double now);
void kv_aborts_free(kv_conn_t *k);

#endif
