/* connector/kv_mail.h — the connector's mailbox, the only state its two threads share, and the
 * objects that travel through it.
 *
 * Commands go one way, to the control thread: a load to start, a cancelled load, a lease, a late
 * whole-prompt write, a reservation taken, a layer's write job, a stream's end, a release (from the
 * HTTP thread, answered), stop. Events go the other way, to the engine thread: a finished transfer
 * (kv_report_t), a write job back with its status, a reservation offered, a reservation gone. Every
 * message is the object itself (a kv_msg_t heads it): whoever sends one gives it away, whoever
 * takes it owns it. Messages are allocated by the side that can refuse its caller cleanly when
 * memory runs out (the engine thread, for its commands and for the reports of what it starts; the
 * control thread for a reservation, which it then rejects): so a send or an emit never fails.
 *
 * Three functions take the mutex (kv_mb_send, kv_mb_emit, kv_mb_take); nothing else does. */
#ifndef PD_CONNECTOR_KV_MAIL_H
#define PD_CONNECTOR_KV_MAIL_H

#define KV_MAX_GRAMMAR_STATE 65536 /* bytes of a grammar state WRITE_DONE may carry (pd_gmatcher_export) */

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "common/list.h"
#include "pipe/pipe.h"
#include "scheduler/request.h"

typedef enum kv_msg_kind {
    /* commands: to the control thread */
    KV_CMD_LOAD = 0,   /* kv_xfer_t: a decode load to start (start_load_kv) */
    KV_CMD_CANCEL,     /* kv_cancel_t: a decode request ended while its load was handed over */
    KV_CMD_LEASE,      /* kv_lease_t: a pull prefill holds a finished request's blocks */
    KV_CMD_PUSH_SAVE,  /* kv_xfer_t: a push prefill's whole-prompt write (its reservation was late) */
    KV_CMD_TAKE_RESV,  /* kv_resv_ref_t: the engine streams a request's layers into this reservation */
    KV_CMD_WRITE_JOB,  /* kv_write_job_t: one layer's pages of a streamed push */
    KV_CMD_WRITE_DONE, /* kv_notice_t: a stream ended (WRITE_DONE to the decode) */
    KV_CMD_RELEASE,    /* kv_release_t: POST /pd/release (a call: the sender waits for the answer) */
    KV_CMD_DRAIN,      /* kv_drain_t: a node's HTTP drain has nothing in flight (a call) */
    KV_CMD_STOP,       /* the control thread returns (kv_ctl_t.stop_cmd) */
    /* events: to the engine thread */
    KV_EV_REPORT,    /* kv_report_t: finished sending or receiving */
    KV_EV_JOB_DONE,  /* kv_write_job_t: back, with its status */
    KV_EV_OFFER,     /* kv_offer_t: a decode's reservation arrived (push prefill) */
    KV_EV_RESV_GONE, /* kv_resv_ref_t: a reservation takes no more writes (ended, expired, its decode died) */
} kv_msg_kind_t;

typedef enum kv_call {
    KV_CALL_NONE = 0, /* a plain message */
    KV_CALL_WAITING,  /* the sender waits for the answer (kv_mb_emit answers) */
    KV_CALL_ANSWERED, /* the sender owns it again */
    KV_CALL_ABANDONED /* the sender gave up waiting: the answerer frees it */
} kv_call_t;

typedef struct kv_msg {
    kv_msg_kind_t kind;
    kv_call_t call;      /* mailbox mutex */
    pd_list_link_t link; /* on a mailbox queue, then on its owner's list */
} kv_msg_t;

typedef struct kv_mb {
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* an event queued, a call answered */
    pd_list_link_t cmds;   /* kv_msg_t to the control thread, in sending order */
    pd_list_link_t events; /* kv_msg_t to the engine thread, in emitting order */
    bool closed;           /* the control thread is gone: calls are answered at once */
    int wake_fd;           /* eventfd the control loop polls (-1 until it starts); set before it does */
    /* the engine's wake-up (pd_connector_t.wake), called after an event is queued */
    void (*wake)(void *arg);
    void *wake_arg;
} kv_mb_t;

void kv_mb_init(kv_mb_t *mb);
/* Frees whatever is still queued (after the control thread returned). */
void kv_mb_destroy(kv_mb_t *mb);

/* Sends command m to the control thread (any thread) and wakes it. wait_s > 0 makes it a call: it
 * waits up to wait_s for kv_mb_emit's answer and returns whether it came (then m is the caller's
 * again; else the control thread frees m when it gets to it). Always true for a plain command,
 * which is freed here when the control thread is gone (the mailbox closed). */
bool kv_mb_send(kv_mb_t *mb, kv_msg_t *m, double wait_s);

/* Control thread: queues event m for the engine thread and wakes it, or answers call m. */
void kv_mb_emit(kv_mb_t *mb, kv_msg_t *m);

/* Moves every queued command (events: false) or event (true) to out. An events take waits until one
 * is queued or until deadline (pd_time_now_s; 0: no wait). close (commands only): the control
 * thread is done: later calls are answered at once, and calls still queued are answered (left to
 * their senders, not moved to out). */
void kv_mb_take(kv_mb_t *mb, bool events, pd_list_link_t *out, double deadline, bool close);

/* Frees any message (by kind), with what it owns. */
void kv_msg_free(kv_msg_t *m);

/* ------------------------------------------------------------------ what travels */

/* A peer engine's KV geometry, from its Regions message (and this engine's, from register). */
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

/* One finished request on its way to get_finished: a prefill's blocks that may be freed
 * (finished_sending) or a decode load that ended (finished_recving, with the blocks that did not
 * arrive). Allocated with the lease or transfer that will end in it, on the engine thread, where
 * running out of memory refuses the request cleanly; so an ending, on the control thread, is always
 * reported (kv_report_sending / kv_report_recving emit the node, they allocate nothing). */
typedef struct kv_report {
    kv_msg_t msg; /* KV_EV_REPORT */
    char req_id[PD_REQ_ID_MAX];
    bool recving;
    int32_t first_token; /* recving: the prefill's first token (push handover), else -1 */
    char *grammar_state; /* with it: the grammar's state after it (malloc'd), or NULL */
    /* recving: the load's block list (taken from its transfer) and the entries [first, end) it
     * covered: failed → load errors; staged → copied from the host mirror in get_finished */
    uint32_t *blocks;
    int32_t first, end;
    bool failed, staged;
    int32_t errors_taken; /* failed: entries get_block_ids_with_load_errors returned so far */
} kv_report_t;

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

struct kv_peer;
struct kv_resv;
struct kv_conn;
typedef struct kv_cancel kv_cancel_t;

/* One transfer: built by the scheduler half, sent (KV_CMD_LOAD / KV_CMD_PUSH_SAVE), then the
 * control thread's. */
typedef struct kv_xfer {
    kv_msg_t msg;
    kv_xfer_kind_t kind;
    kv_xfer_state_t state;
    char req_id[PD_REQ_ID_MAX];     /* local request id */
    char remote_req[PD_REQ_ID_MAX]; /* pull: the prefill's request id; push: the transfer id */
    char dial[128];                 /* decode side: the prefill's control address */
    char remote_engine[64];         /* expected engine id ("" = any) */
    uint64_t lease_id;
    uint64_t resv_id; /* push save: the reservation its stream had bound (0: the first to arrive) */
    uint32_t *local_blocks;
    int32_t num_local;
    uint32_t *remote_blocks;
    int32_t num_remote;
    int32_t first_block, end_block; /* block indexes to move: [first, end) */
    int32_t num_tokens;
    double started, deadline;
    double t_posted, t_moved; /* pages posted (or reservation sent), pages landed */
    bool cancelled;           /* the request was aborted: no load errors, just release */
    bool redialed;            /* the cached peer had another engine id: dialled once more */
    bool overdue;             /* posted past its deadline: its peer was killed, its completion ends it */
    bool start_counted;       /* push save continuing a stream whose start the metrics already counted */
    /* first-token handover, push: the token the prefill sampled (save: sent with WRITE_DONE; load:
     * received with it and reported with the load's end) */
    bool migration; /* a decode's load of a live migration's KV (prompt and outputs) */
    bool has_first_token;
    int32_t first_token;
    char
        *grammar_state; /* with it, a structured output's: the grammar's state after it (malloc'd), or NULL */
    /* push: the prompt's kv_prompt_hash (save: sent with WRITE_DONE; load: what WRITE_DONE must name) */
    uint8_t prompt_hash[32];
    kv_report_t *report; /* its end, for get_finished (NULL once reported) */
    kv_cancel_t *cancel; /* decode, engine thread: its cancel command, until the load is sent */
    /* control thread */
    struct kv_conn *conn;
    struct kv_peer *peer;
    struct kv_resv *resv; /* push save: the reservation written into */
    size_t bytes;
    int32_t pages;
    pd_list_link_t link; /* engine: pending loads; control thread: transfers */
} kv_xfer_t;

/* A decode load's cancel (allocated with the load: a request that ends can always say so). */
struct kv_cancel {
    kv_msg_t msg; /* KV_CMD_CANCEL; until sent, on the engine's in-flight loads */
    char req_id[PD_REQ_ID_MAX];
};

/* Prefill, pull: blocks held for a reader (KV_CMD_LEASE, then the control thread's). */
typedef struct kv_lease {
    kv_msg_t msg;
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX]; /* the proxy's id for the request ("" = none): releases it too */
    uint64_t lease_id;
    double expires;
    bool expired;        /* blocks released; kept a while to answer STALE */
    bool lend;           /* a prefix lent to a peer (kv_lend): released unread as a matter of course */
    kv_report_t *report; /* the blocks' release, for get_finished (NULL once reported) */
    pd_list_link_t link;
} kv_lease_t;

/* A reservation named by its id (KV_CMD_TAKE_RESV, KV_EV_RESV_GONE). */
typedef struct kv_resv_ref {
    kv_msg_t msg;
    uint64_t resv_id;
} kv_resv_ref_t;

/* Prefill, push: a decode's reservation as the engine thread sees it (a copy: the control thread
 * keeps its own, and judges every write against it). */
typedef struct kv_offer {
    kv_msg_t msg; /* KV_EV_OFFER; then on the engine's offers (msg.link) until a push binds it */
    uint64_t resv_id;
    char transfer_id[PD_REQ_ID_MAX];
    uint32_t *blocks;
    int32_t num_blocks, skip_blocks;
    bool gone; /* KV_EV_RESV_GONE came: nothing more may be written */
    /* the decode's page geometry: where its pages lie in its region */
    uint64_t page_bytes;
    uint64_t layer_offset[PD_MAX_LAYERS];
} kv_offer_t;

/* A batch of page writes posted by save_kv_layer (KV_CMD_WRITE_JOB, back as KV_EV_JOB_DONE). */
typedef struct kv_write_job {
    kv_msg_t msg;
    uint64_t resv_id; /* the reservation written into: the control thread checks it still takes writes */
    pd_page_xfer_t *pages;
    int32_t num_pages;
    size_t bytes;
    uint64_t gen;       /* the step that posted it (completions of older steps are not counted) */
    pd_status_t status; /* KV_EV_JOB_DONE: how it ended */
    struct kv_conn *conn;
} kv_write_job_t;

/* A stream's end (KV_CMD_WRITE_DONE): WRITE_DONE to the reservation's decode, which ends it. */
typedef struct kv_notice {
    kv_msg_t msg;
    uint64_t resv_id;
    int32_t status;
    int32_t first_token;     /* a first-token handover: the prefill's first token, else -1 */
    char *grammar_state;     /* with it: the grammar's state after it (malloc'd), or NULL */
    uint8_t prompt_hash[32]; /* the prompt's kv_prompt_hash */
} kv_notice_t;

/* POST /pd/release (KV_CMD_RELEASE, a call): pd_kv_connector_release's arguments and answer. */
typedef struct kv_release {
    kv_msg_t msg;
    bool by_lease;
    char request_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    char transfer_id[PD_REQ_ID_MAX];
    bool released; /* the answer */
    bool lend;     /* what it released was a lend (control thread: for its log line) */
} kv_release_t;

/* A node's drain with no HTTP request in flight (KV_CMD_DRAIN, a call). A prefill: the reservations
 * no prompt will take now are ended, and the answer is what the node still holds for decodes. A
 * decode: what it leased to the decodes that took its requests over. */
typedef struct kv_drain {
    kv_msg_t msg;
    bool decode; /* a decode's drain: only its leases count (live migrations not read yet) */
    int pending; /* the answer: leases not read or expired, reservations taken, transfers in flight */
} kv_drain_t;

/* A report node for req_id (engine thread); NULL when out of memory (logged by the caller). */
kv_report_t *kv_report_new(const char *req_id, bool recving);
void kv_report_free(kv_report_t *r);
void kv_lease_free(kv_lease_t *l);
void kv_xfer_free(kv_xfer_t *x);
void kv_offer_free(kv_offer_t *o);
void kv_write_job_free(kv_write_job_t *j);

#endif
