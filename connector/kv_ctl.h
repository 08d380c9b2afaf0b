/* connector/kv_ctl.h — the connector's control-thread state (kv_conn.h names the owners): its
 * loop (kv_ctl.c), the commands it takes (kv_commands.c), peers (kv_peers.c), transfers
 * (kv_xfers.c), control messages (kv_messages.c), deadlines (kv_timers.c) and deferred aborts
 * (kv_aborts.c). Every field is the control thread's (before it starts and after it returned: the
 * thread that starts and stops it); it hears from the engine thread only by commands and tells it
 * only by events (kv_mail.h). No lock is taken here. */
#ifndef PD_CONNECTOR_KV_CTL_H
#define PD_CONNECTOR_KV_CTL_H

#include "common/strmap.h"
#include "connector/kv_conn.h"

typedef enum kv_peer_state {
    KV_PEER_WAIT_REGIONS = 0, /* handshake done, waiting for the peer's Regions */
    KV_PEER_READY,
    KV_PEER_DEAD,
} kv_peer_state_t;

/* An accepted connection still in the handshake: driven by the poll loop one frame at a time, so a
 * silent or dribbling client costs its own deadline and nothing else. */
#define KV_MAX_HANDSHAKES 64 /* beyond this the oldest pending connection is dropped */
typedef struct kv_hs {
    int fd;
    pd_ctl_reader_t rd;
    pd_ctl_server_hs_t hs;
    double deadline;     /* accepted + --kv-handshake-timeout */
    pd_list_link_t link; /* on kv_ctl_t.handshakes, oldest first */
} kv_hs_t;

/* A connection we dial, until its handshake completes: non-blocking connect, then the client
 * handshake one frame at a time, bounded by its deadline. */
typedef struct kv_dial {
    char addr[128]; /* "host:port" */
    int fd;
    bool connected; /* the TCP connect finished and the Hello went out */
    pd_ctl_reader_t rd;
    pd_ctl_client_hs_t hs;
    double started, deadline;
    pd_list_link_t link;
} kv_dial_t;

/* A connected engine. */
typedef struct kv_peer {
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
    /* control frames not yet written: peer_send queues, the loop flushes on POLLOUT; nothing waits
     * on the socket */
    uint8_t *out;
    size_t out_len, out_cap;
    pd_list_link_t link;
} kv_peer_t;

/* Decode: an ABORT owed to a prefill that was unreachable when the load ended (kv_aborts.c). */
typedef struct kv_abort {
    char dial[128];     /* the prefill's control address */
    char engine_id[64]; /* the engine that granted the lease ("" = whichever answers there) */
    char req_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    double expires; /* the prefill's hold timeout has ended the lease by then */
    double next_dial, backoff;
    pd_list_link_t link; /* on kv_ctl_t.aborts, oldest first */
} kv_abort_t;

/* Prefill, push: a decode's reservation (from the network; validated). The engine thread has a
 * copy (kv_offer_t); this one decides whether a write may still land. */
typedef struct kv_resv {
    uint64_t id; /* this node's, named by the engine's commands */
    char transfer_id[PD_REQ_ID_MAX];
    uint64_t lease_id;
    kv_peer_t *peer;
    uint32_t *blocks;
    int32_t num_blocks;
    int32_t skip_blocks;
    int32_t num_tokens;
    double expires;
    bool taken;          /* a stream (KV_CMD_TAKE_RESV) or a push save writes into it */
    bool released;       /* done with: freed by the sweep */
    bool dead;           /* its peer died: nothing may be written */
    kv_resv_ref_t *gone; /* KV_EV_RESV_GONE, emitted once when it takes no more writes */
    pd_list_link_t link;
} kv_resv_t;

typedef struct kv_ctl {
    pthread_t thread;
    bool thread_started;
    int listen_fd;
    pd_list_link_t peers;      /* kv_peer_t */
    pd_list_link_t handshakes; /* kv_hs_t: accepted, not yet authenticated (oldest first) */
    int num_handshakes;
    double accept_resume, accept_logged; /* out of fds: accepts paused until then */
    pd_list_link_t dials;                /* kv_dial_t: dialled, not yet authenticated */
    pd_list_link_t aborts;               /* kv_abort_t: owed to unreachable prefills */
    int num_aborts;
    pd_list_link_t xfers;  /* kv_xfer_t: adopted transfers */
    pd_list_link_t leases; /* kv_lease_t */
    pd_list_link_t resvs;  /* kv_resv_t */
    pd_strmap_t released;  /* prefill: transfer ids the proxy or the decode released before their
                            * request finished (its lease or push save then holds nothing) */
    uint64_t next_resv_id;
    int32_t jobs_posted; /* write jobs on the pipe */
    kv_msg_t stop_cmd;   /* KV_CMD_STOP */
    bool stopping;       /* KV_CMD_STOP taken: the loop returns */
} kv_ctl_t;

void kv_ctl_init(kv_ctl_t *c);

/* --- kv_ctl.c --- */
pd_status_t kv_ctl_start(kv_conn_t *k);
/* Stops the thread (if it runs), destroys the pipe, frees what the control thread held. */
void kv_ctl_stop(kv_conn_t *k);
int kv_ms_of(double s);

/* --- kv_commands.c --- */
/* Takes the engine's (and the HTTP thread's) commands and applies them (KV_CMD_STOP sets
 * stopping). Each tick does, and so does a peer's message that names what only a command creates
 * (a lease): the peer may have sent it after the command was queued and before this tick read its
 * socket, since a read takes whatever has arrived by then. */
void kv_ctl_commands(kv_conn_t *k);
/* A prefill's blocks may be freed: *report (the lease's or transfer's) goes to get_finished and
 * *report becomes NULL; nothing when it already went. Cannot fail. */
void kv_report_sending(kv_conn_t *k, kv_report_t **report);
/* Decode load x ended (ok: its pages landed; else its blocks [first, end) are load errors, unless
 * it was cancelled): its report takes x's block list and the first token it carried (push
 * handover). Cannot fail. */
void kv_report_recving(kv_conn_t *k, kv_xfer_t *x, bool ok);
/* Reservation rv takes no more writes (released; dead: its decode died): the engine hears it
 * once. */
void kv_resv_end(kv_conn_t *k, kv_resv_t *rv, bool dead);
/* A reservation no prompt will take (expired; a draining prefill): its decode hears WRITE_DONE with
 * status (and recomputes), and it ends. */
void kv_resv_refuse(kv_conn_t *k, kv_resv_t *rv, int32_t status);
kv_resv_t *kv_resv_find(kv_conn_t *k, uint64_t id);
void kv_resv_free(kv_resv_t *rv);
/* Prefill, push: transfer_id's decode gave up before it reserved blocks: the held request frees
 * now, or (not finished yet) holds nothing when it finishes. */
bool kv_release_push(kv_conn_t *k, const char *transfer_id);

/* --- kv_peers.c --- */
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

/* --- kv_xfers.c --- */
void kv_observe_done(kv_conn_t *k, kv_xfer_t *x);
void kv_end_load(kv_conn_t *k, kv_xfer_t *x, bool ok);
void kv_fail_xfer(kv_conn_t *k, kv_xfer_t *x, const char *why);
void kv_drive_queued(kv_conn_t *k);
/* Posts a write job on the pipe, or returns it failed (KV_EV_JOB_DONE) when its reservation takes
 * no more writes. */
void kv_post_job(kv_conn_t *k, kv_write_job_t *j);

/* --- kv_messages.c --- */
void kv_on_message(kv_conn_t *k, kv_peer_t *p, const pd_ctl_msg_t *msg);

/* --- kv_timers.c --- */
void kv_run_timers(kv_conn_t *k);
/* The nearest deadline of any timer (pd_time_now_s), or now + max_s when none is nearer. */
double kv_next_deadline(kv_conn_t *k, double max_s);

/* --- kv_aborts.c --- */
/* Keeps x's ABORT for its prefill (x->dial, its engine) until a reconnect or the hold timeout. */
void kv_abort_defer(kv_conn_t *k, const kv_xfer_t *x);
/* p was just authenticated: the ABORTs owed to its address go out (or are dropped when another
 * engine answers there). */
void kv_aborts_deliver(kv_conn_t *k, kv_peer_t *p);
/* Expires deferred ABORTs and redials their addresses with backoff. */
void kv_aborts_tick(kv_conn_t *k, double now);
void kv_aborts_free(kv_conn_t *k);

#endif
