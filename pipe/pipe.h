/* pipe/pipe.h — a channel between two engines for KV pages and tensors (DESIGN.md §6), one
 * function table per backend (tcp, ucx; nccl with CUDA).
 *
 * Model: a pd_pipe_t is this engine's transport endpoint (listener / worker, registered
 * regions). Peers connect symmetrically: each side passes the other's address blob (exchanged on
 * the control channel) to pd_pipe_connect. Regions are registered locally, exported to a given
 * peer (with or without write permission) and imported on the other side.
 *
 * Sessions: connect takes the session secret both sides derived from their authenticated control
 * handshake (the same PD_PIPE_SESSION_BYTES on both; NULL = all zero bytes, for tests). The tcp
 * pipe accepts a data connection only when its HELLO is MACed under the secret of a peer this side
 * itself connected to (a pipe id alone identifies nobody); ucx and nccl peers are reached through
 * addresses exchanged on the authenticated control channel and ignore it.
 *
 * Completion: every operation reports exactly once through its callback, always from inside
 * pd_pipe_progress on the caller's thread (backends with internal threads queue completions).
 * An operation on a dead peer completes with PD_ERR_PEER_GONE; pd_pipe_destroy completes every
 * pending operation with PD_ERR_CANCELLED before it returns. Page lists are coalesced (adjacent
 * local and remote ranges merged) before they are posted. A tensor send may not complete until
 * the peer posts the matching receive (large UCX messages use rendezvous, as MPI does); tensors
 * with the same tag from one peer are matched in order. */
#ifndef PD_PIPE_PIPE_H
#define PD_PIPE_PIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum pd_mem_type {
    PD_MEM_HOST = 0,
    PD_MEM_CUDA = 1,
} pd_mem_type_t;

typedef struct pd_pipe pd_pipe_t;
typedef struct pd_pipe_peer pd_pipe_peer_t;
typedef struct pd_pipe_region pd_pipe_region_t; /* local registered memory */
typedef struct pd_pipe_remote pd_pipe_remote_t; /* a peer's exported region */

typedef struct pd_pipe_config {
    const char *kind;         /* "tcp" | "ucx" | "nccl" */
    const char *host;         /* tcp: listen address (default 127.0.0.1) */
    int port;                 /* tcp: 0 = any free port */
    const char *ucx_err_mode; /* ucx: "none" (shared memory, default) | "peer" (error handling; TCP RMA) */
    size_t max_message_bytes; /* largest tensor/page batch accepted from a peer (default 1 GiB) */
    int tcp_busy_poll_us;     /* tcp: after serving a peer's request, the receiver thread polls its
                               * sockets this long before sleeping (0 = sleep at once). Spends a core
                               * to save the wake-up per request (~40 µs on this VM's vCPUs) */
} pd_pipe_config_t;

/* One range to move: local region offset, remote region offset, bytes. */
typedef struct pd_page_xfer {
    uint64_t local_off;
    uint64_t remote_off;
    uint64_t len;
} pd_page_xfer_t;

typedef void (*pd_pipe_done_cb)(void *arg, pd_status_t st);
/* A received tensor: header and payload sizes actually written to the posted buffers. */
typedef void (*pd_pipe_recv_cb)(void *arg, pd_status_t st, uint64_t tag, size_t hdr_len, size_t payload_len);
typedef void (*pd_pipe_peer_error_cb)(void *arg, pd_pipe_peer_t *peer, pd_status_t st);

#define PD_PIPE_ADDR_MAX      4096
#define PD_PIPE_SESSION_BYTES 32
#define PD_PIPE_RKEY_MAX      1024

typedef struct pd_pipe_ops {
    const char *name;
    pd_status_t (*create)(const pd_pipe_config_t *cfg, pd_pipe_t **pipe_out);
    void (*destroy)(pd_pipe_t *p);
    pd_status_t (*address)(pd_pipe_t *p, uint8_t *buf, size_t *len);
    pd_status_t (*connect)(pd_pipe_t *p, const uint8_t *addr, size_t len, const uint8_t *session,
                           pd_pipe_peer_t **peer_out);
    pd_status_t (*alloc_region)(pd_pipe_t *p, size_t len, pd_pipe_region_t **region_out);
    pd_status_t (*register_region)(pd_pipe_t *p, void *base, size_t len, pd_mem_type_t mem,
                                   pd_pipe_region_t **region_out);
    void (*deregister_region)(pd_pipe_t *p, pd_pipe_region_t *r);
    pd_status_t (*export_region)(pd_pipe_t *p, pd_pipe_region_t *r, pd_pipe_peer_t *peer, bool allow_write,
                                 uint8_t *buf, size_t *len);
    pd_status_t (*import_region)(pd_pipe_t *p, pd_pipe_peer_t *peer, const uint8_t *buf, size_t len,
                                 pd_pipe_remote_t **remote_out);
    void (*release_remote)(pd_pipe_t *p, pd_pipe_remote_t *rr);
    pd_status_t (*write_pages)(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                               pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                               pd_pipe_done_cb cb, void *arg);
    pd_status_t (*read_pages)(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                              pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                              pd_pipe_done_cb cb, void *arg);
    pd_status_t (*send_tensor)(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, const void *hdr,
                               size_t hdr_len, const void *payload, size_t payload_len, pd_pipe_done_cb cb,
                               void *arg);
    pd_status_t (*recv_tensor)(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, void *hdr, size_t hdr_cap,
                               void *payload, size_t payload_cap, pd_pipe_recv_cb cb, void *arg);
    int (*progress)(pd_pipe_t *p);
    /* Optional. An fd that polls readable while completions (or what progress turns into them: a
     * tcp write's ack on its socket) wait for progress, for backends that move bytes on their own
     * threads (tcp): a caller sleeps in poll() on it instead of napping
     * between progress calls. NULL (pd_pipe_wait_fd: -1) for backends that move bytes inside
     * progress (ucx): progress those continuously while operations are pending. */
    int (*wait_fd)(pd_pipe_t *p);
    void (*set_peer_error_cb)(pd_pipe_t *p, pd_pipe_peer_error_cb cb, void *arg);
    /* Declares peer dead (the control channel's heartbeat missed, or it closed): every pending
     * operation with it completes with st, later ones fail at once. Needed where the transport
     * cannot notice by itself (UCX without error handling). */
    void (*fail_peer)(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_status_t st);
    /* The caller is done with peer (dead, its remotes released): what it had pending fails as with
     * fail_peer, its connections close, and the pipe frees its record as soon as none of its own
     * work refers to it. The handle must not be used again. Peers come and go for weeks; without
     * this each one's endpoint (UCX: and the mappings of its memory) stays until the pipe goes. */
    void (*release_peer)(pd_pipe_t *p, pd_pipe_peer_t *peer);
} pd_pipe_ops_t;

/* Every backend's pipe object starts with this. */
struct pd_pipe {
    const pd_pipe_ops_t *ops;
};

/* Every backend's region object starts with this. */
struct pd_pipe_region {
    void *base;
    size_t len;
    pd_mem_type_t mem;
};

/* Creates a pipe of cfg->kind. PD_ERR_NOT_FOUND for a kind this build does not have. */
pd_status_t pd_pipe_create(const pd_pipe_config_t *cfg, pd_pipe_t **pipe_out);

/* Kinds this build supports, e.g. "tcp,ucx" (static string). */
const char *pd_pipe_kinds(void);

/* Sorts pages by local offset and merges runs contiguous on both sides into out[] (capacity n);
 * returns the count. Zero-length pages are dropped. */
int pd_pipe_coalesce(const pd_page_xfer_t *pages, int n, pd_page_xfer_t *out);

/* Validates that every page of pages[n] lies inside [0, local_len) and [0, remote_len) without
 * overflow. PD_ERR_OUT_OF_RANGE (logged) otherwise. */
pd_status_t pd_pipe_check_pages(const pd_page_xfer_t *pages, int n, size_t local_len, size_t remote_len);

static inline void pd_pipe_destroy(pd_pipe_t *p)
{
    if (p != NULL) {
        p->ops->destroy(p);
    }
}

static inline int pd_pipe_progress(pd_pipe_t *p)
{
    return p->ops->progress(p);
}

/* The backend's wait_fd, or -1 when it has none (see pd_pipe_ops_t). */
static inline int pd_pipe_wait_fd(pd_pipe_t *p)
{
    return p->ops->wait_fd != NULL ? p->ops->wait_fd(p) : -1;
}

/* Writes (or reads) the coalesced pages; see pd_pipe_ops_t. */
pd_status_t pd_pipe_write_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                                pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                pd_pipe_done_cb cb, void *arg);
pd_status_t pd_pipe_read_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                               pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                               pd_pipe_done_cb cb, void *arg);

/* Backends. */
extern const pd_pipe_ops_t pd_pipe_tcp_ops;
extern const pd_pipe_ops_t pd_pipe_ucx_ops;
extern const pd_pipe_ops_t pd_pipe_nccl_ops; /* builds with CUDA + NCCL (PD_HAVE_NCCL) */

#endif
