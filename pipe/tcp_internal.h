/* pipe/tcp_internal.h — the TCP pipe's representation and the helpers its three files share:
 * tcp_io.c (helpers under the pipe lock, socket I/O, the sender thread), tcp_rx.c (the receiver
 * thread: accepted connections, authenticated HELLOs, frames) and tcp.c (the pd_pipe_ops_t API).
 * Not a public header; the lock rule is written on tcp_pipe_t. */
#ifndef PD_PIPE_TCP_INTERNAL_H
#define PD_PIPE_TCP_INTERNAL_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/array.h"
#include "common/list.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/time.h"
#include "pipe/completion.h"
#include "pipe/pipe.h"

#define TCP_MAGIC           0x50445450u /* "PDTP" */
#define TCP_MAX_PAGES       (1u << 20)
#define TCP_RCV_TIMEOUT_S   30
#define TCP_HELLO_TIMEOUT_S 5   /* an accepted connection must send its HELLO within this */
#define TCP_HELLO_RACE_S    0.5 /* one whose MAC proves none of its id's sessions: the wait for its record */
#define TCP_CONNECT_TIMEOUT_MS                                                                               \
    2000                   /* a data connection's connect (no thread waits on it: its peer dies then) */
#define TCP_MAX_PENDING 64 /* accepted connections still without a HELLO; the oldest is dropped */

/* A HELLO (op_id: the dialer's pipe id) is followed by a nonce and
 * HMAC-SHA256(session, "pd-data" | dialer id | acceptor id | nonce): only a peer that completed the
 * control handshake with this node (and so holds the session secret) gets its connection read. */
#define TCP_HELLO_NONCE 16
#define TCP_HELLO_AUTH  (TCP_HELLO_NONCE + 32)
/* The wire protocol's version, in a HELLO's region_id (0 before it was sent). 2: a request's reply
 * comes back on the request's connection (issue 53). A HELLO of another version is refused with a
 * line that says so: the two nodes cannot move KV over tcp (a pool is upgraded together). */
#define TCP_WIRE_VERSION 2

enum { M_HELLO = 1, M_WRITE = 2, M_WRITE_ACK = 3, M_READ_REQ = 4, M_READ_RESP = 5, M_TENSOR = 6 };

typedef struct hdr {
    uint32_t magic;
    uint8_t type;
    uint8_t pad[3];
    uint64_t op_id;     /* HELLO: sender pipe id; TENSOR: tag */
    uint32_t region_id; /* WRITE / READ_REQ: the receiver's region */
    int32_t status;     /* WRITE_ACK / READ_RESP */
    uint32_t count;     /* WRITE / READ_REQ: descriptors; TENSOR: header bytes */
    uint32_t pad2;
    uint64_t len; /* data bytes that follow */
} hdr_t;

/* An accepted data connection whose HELLO has not arrived (rx thread only). Its epoll data is
 * the struct's address with bit 0 set, which tells it from a peer. The HELLO's bytes are taken off
 * the socket as they come (so a partial one does not keep the socket readable, and a close after
 * it is seen at once). */
typedef struct pending_in {
    int fd;
    double deadline;
    bool waiting;                                  /* its HELLO is in, for a peer not connected to yet */
    uint8_t hello[sizeof(hdr_t) + TCP_HELLO_AUTH]; /* header, nonce, MAC */
    size_t got;                                    /* bytes of hello received */
    pd_list_link_t link;                           /* on tcp_pipe_t.pending, oldest first */
} pending_in_t;

typedef struct desc {
    uint64_t off;
    uint64_t len;
} desc_t;

/* Bytes of replies progress reads from an outgoing connection at a time (64 acks; a read response's
 * pages past its header go straight to the region) */
#define TCP_REPLY_BUF (64 * sizeof(hdr_t))
/* Bytes progress moves from one peer's replies per call, so that a large read response does not
 * keep the caller (the connector's control thread) from its other work: the rest on the next call */
#define TCP_REPLY_BUDGET (4u << 20)

/* What the receiver peeks at before reading a frame: its header and up to 64 descriptors, so a
 * request of that many pages costs one readv (header, descriptors, pages) after the peek. */
#define TCP_PEEK_BYTES (sizeof(hdr_t) + 64 * sizeof(desc_t))

typedef struct tcp_region {
    struct pd_pipe_region pub;
    uint32_t id;
    bool owned;
} tcp_region_t;

struct pd_pipe_remote {
    pd_pipe_peer_t *peer;
    uint32_t region_id;
    uint64_t len;
};

typedef struct perm {
    uint32_t region_id;
    pd_pipe_peer_t *peer;
    bool write;
    pd_list_link_t link;
} perm_t;

typedef struct unexpected {
    uint64_t tag;
    uint8_t *hdr;
    size_t hdr_len;
    uint8_t *payload;
    size_t payload_len;
    pd_list_link_t link;
} unexpected_t;

static inline void tcpi_unexpected_free(unexpected_t *u)
{
    free(u->hdr);
    free(u->payload);
    free(u);
}

enum { OP_WRITE, OP_READ, OP_SEND, OP_RECV };

typedef struct op op_t;
struct op {
    uint64_t id;
    int kind;
    pd_pipe_peer_t *peer;
    pd_pipe_done_cb done;
    pd_pipe_recv_cb recv_cb;
    void *arg;
    tcp_region_t *local; /* OP_READ: where the response lands */
    desc_t *pages;       /* OP_READ: local offsets and lengths */
    int n;
    uint64_t total;
    uint64_t tag; /* OP_RECV */
    void *hbuf, *pbuf;
    size_t hcap, pcap;
    pd_list_link_t link;
};

struct pd_pipe_peer {
    uint64_t id;
    int out_fd, in_fd;
    bool connecting;         /* out_fd's connect is in progress (tcpi_out_ready) */
    bool connect_failed;     /* ... and it failed (said once: SO_ERROR reads only once) */
    double connect_deadline; /* ... until then (TCP_CONNECT_TIMEOUT_MS after tcp_connect) */
    char dialled[80];        /* "host:port" of out_fd, for the log */
    bool dead;
    bool reading; /* the receiver thread is reading a frame from in_fd */
    bool in_used; /* a frame has arrived on in_fd (else it may be a previous incarnation's) */
    uint8_t session[PD_PIPE_SESSION_BYTES]; /* from connect: what its data connection's HELLO is MACed with */
    bool released;             /* the user gave it up: the rx thread frees it once nothing uses it */
    pd_list_link_t unexpected; /* unexpected_t, in arrival order */
    double tx_blocked_since;   /* sender thread: when its socket stopped taking its queued bytes (0: it
                                * takes them); past TCP_SEND_STALL_S the peer is dropped */
    uint64_t tx_blocked_pass;  /* sender thread: the pass of its queue in which its socket was full */
    size_t unexpected_bytes;   /* their headers and payloads: at most the pipe's max_msg, one
                                * message's worth (past it the peer is dropped: it sends what nobody
                                * asks for; issue 51 held +196 MiB that way) */
    /* The replies to our requests (write acks, read responses) come back on out_fd, and progress
     * reads them (tcp.c, read_replies): the fields below are the reader's, used by the one progress
     * call that set out_reading (under mu) until it clears it. */
    bool out_reading;
    uint8_t rbuf[TCP_REPLY_BUF]; /* bytes read from out_fd, not parsed yet */
    size_t rbuf_len;
    op_t *resp_op;      /* the read whose response's pages are arriving (unlinked from the op list: a
                          * death or destroy while it is set completes it, see tcpi_mark_dead) */
    uint64_t resp_left; /* bytes of it still to come */
    uint32_t resp_page; /* the page of resp_op the next byte goes to */
    uint64_t resp_off;  /* ... and where in it */
    pd_list_link_t link;
};

typedef struct job {
    pd_pipe_peer_t *peer;
    struct iovec *iov;
    int niov;
    int first;              /* iov entries before this one are written */
    void *owned;            /* freed after sending (header + descriptors) */
    op_t *complete_on_send; /* OP_SEND */
    bool on_in;             /* a write's ack: written on peer's in_fd, the connection its write came in on */
    pd_list_link_t link;
} job_t;

/* Seconds a peer's socket may take none of the bytes queued for it before the peer is dropped (it
 * stopped reading; the other peers' sends go on meanwhile). */
#define TCP_SEND_STALL_S 30.0

typedef struct tcp_pipe {
    pd_pipe_t base;
    uint64_t id;
    char host[64];
    int port;
    int listen_fd, epfd, wake_fd;
    int wait_ep; /* the caller's wait fd: an epoll set of cq.efd and every peer's out_fd, on which the
                  * acks of our writes come back (progress reads them: nothing else reads out_fd) */
    size_t max_msg;
    int busy_poll_us;
    pthread_t rx, tx;
    bool rx_started, tx_started; /* each recorded as it starts: destroy is safe after any prefix of create */
    bool tx_busy;                /* the sender thread is writing a job (outside mu) */
    uint64_t tx_pass;            /* sender thread: passes over the job queue */
    pd_pipe_peer_t *tx_peer;     /* ... to this peer's out_fd */
    /* mu guards everything below it: stop, the peer list (and each peer's unexpected queue), the
     * region table and permissions, the op list and its counters, the job queue and the completion
     * queue. The rx thread reads a frame's bytes and the tx thread writes a job's bytes without it:
     * an op is unlinked (rx) or owned by its job (tx) before its bytes move, and a region's memory
     * is used unlocked, so a caller must not deregister a region that transfers may still touch
     * (the connector deregisters only after failing every peer). Nothing blocks while holding mu:
     * replies are jobs queued for the tx thread. */
    pthread_mutex_t mu;
    pthread_cond_t tx_cv;
    bool stop;
    pd_list_link_t peers; /* pd_pipe_peer_t */
    tcp_region_t **regions;
    size_t num_regions, cap_regions;
    pd_list_link_t perms; /* perm_t */
    pd_list_link_t ops;   /* op_t, pending: waiting for an ack, a response or a matching tensor */
    uint32_t writes;      /* of them, page writes waiting for their ack */
    uint64_t next_op;
    pd_list_link_t jobs; /* job_t, the sender thread's queue */
    pd_pipe_cq_t cq;
    pd_list_link_t pending; /* pending_in_t, rx thread only (and tcp_destroy after it stopped) */
    bool recheck;           /* a peer appeared (connect): waiting pending connections look again */
    double accept_resume;   /* rx thread: out of fds, the listener is out of the epoll set until then */
    double accept_logged;   /* rx thread: when that was last logged */
    int num_pending;
    pd_pipe_peer_error_cb peer_cb;
    void *peer_cb_arg;
} tcp_pipe_t;

/* Shared helpers (contracts at their definitions; "mu held" where a section says so). */
bool tcpi_allowed(tcp_pipe_t *t, uint32_t region_id, pd_pipe_peer_t *peer, bool write);
void tcpi_complete(tcp_pipe_t *t, pd_pipe_completion_t c);
void tcpi_complete_op(tcp_pipe_t *t, op_t *o, pd_status_t st, size_t hlen, size_t plen);
int tcpi_discard(int fd, uint64_t n);
void tcpi_drop_in(tcp_pipe_t *t, pd_pipe_peer_t *peer);
void tcpi_enqueue(tcp_pipe_t *t, job_t *j);
/* Whether peer's data connection, dialled without waiting (tcp_connect), is up (mu held, no
 * blocking): 1 yes, 0 still connecting, -1 it failed or passed its deadline (logged). */
int tcpi_out_ready(pd_pipe_peer_t *peer);
void tcpi_hello_mac(const uint8_t *session, uint64_t from, uint64_t to, const uint8_t *nonce,
                    uint8_t out[32]);
void tcpi_job_free(job_t *j);
job_t *tcpi_job_new(pd_pipe_peer_t *peer, int niov, size_t owned_bytes);
void tcpi_mark_dead(tcp_pipe_t *t, pd_pipe_peer_t *peer, pd_status_t st);
/* A dead peer's read whose response was arriving fails with st, unless progress is reading it (it
 * calls this when done) (mu held). */
void tcpi_resp_fail(tcp_pipe_t *t, pd_pipe_peer_t *peer, pd_status_t st);
/* The live peer with pipe id `id` (and, session not NULL, that session secret), or a new record
 * (create). A pipe id is only a claim: records are told apart by the session their control handshake
 * derived, so a peer that claims another's id cannot take its place (mu held). */
pd_pipe_peer_t *tcpi_peer_by_id(tcp_pipe_t *t, uint64_t id, const uint8_t *session, bool create);
void tcpi_peer_free(pd_pipe_peer_t *pe);
void tcpi_pending_drop(tcp_pipe_t *t, pending_in_t *c);
int tcpi_read_full(int fd, void *buf, size_t n);
int tcpi_read_pages(int fd, void *skip_buf, size_t skip, char *base, const desc_t *d, uint32_t n);
void tcpi_reap_fds(tcp_pipe_t *t, pd_pipe_peer_t *peer);
tcp_region_t *tcpi_region_by_id(tcp_pipe_t *t, uint32_t id);
int tcpi_rx_frame(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const void *peek, size_t npeek);
op_t *tcpi_take_op(tcp_pipe_t *t, uint64_t id, pd_pipe_peer_t *peer, int kind);
void tcpi_tune_socket(int fd);
int tcpi_writev_full(int fd, struct iovec *iov, int n);
void *tcpi_tx_main(void *arg);
void *tcpi_rx_main(void *arg);

#endif
