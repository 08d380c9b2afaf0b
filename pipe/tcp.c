/* pipe/tcp.c — the TCP pipe: two-sided emulation of page writes/reads over plain sockets.
 *
 * Each peer pair uses two connections, one per direction (A's outgoing socket is B's incoming
 * one). Per pipe, a receiver thread reads every incoming socket and never writes (so it always
 * drains, whatever the other side does), and a sender thread drains a queue of frames (API calls
 * and the receiver's replies enqueue; nothing else writes). The receiver validates every page of
 * a write — region exported to that peer with write permission, offset and length inside it —
 * before a byte lands; bad pages are consumed and refused with an error ack.
 *
 * Frame: hdr_t, then per type: WRITE count × desc_t + data; READ_REQ count × desc_t; READ_RESP
 * data; TENSOR hdr bytes + payload; HELLO / WRITE_ACK nothing. */
#define _GNU_SOURCE
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
#define TCP_HELLO_TIMEOUT_S 5  /* an accepted connection must send its HELLO within this */
#define TCP_MAX_PENDING     64 /* accepted connections still without a HELLO; the oldest is dropped */

/* An accepted data connection whose HELLO has not arrived (rx thread only). Its epoll data is
 * the struct's address with bit 0 set, which tells it from a peer. */
typedef struct pending_in {
    int fd;
    double deadline;
    bool waiting;        /* its HELLO is in, for a peer this side has not connected to yet */
    pd_list_link_t link; /* on tcp_pipe_t.pending, oldest first */
} pending_in_t;

/* A HELLO (op_id: the dialer's pipe id) is followed by a nonce and
 * HMAC-SHA256(session, "pd-data" | dialer id | acceptor id | nonce): only a peer that completed the
 * control handshake with this node (and so holds the session secret) gets its connection read. */
#define TCP_HELLO_NONCE 16
#define TCP_HELLO_AUTH  (TCP_HELLO_NONCE + 32)

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

typedef struct desc {
    uint64_t off;
    uint64_t len;
} desc_t;

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

static void unexpected_free(unexpected_t *u)
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
    bool dead;
    bool reading; /* a thread is reading a frame from in_fd (the receiver, or progress taking acks) */
    bool in_used; /* a frame has arrived on in_fd (else it may be a previous incarnation's) */
    uint8_t session[PD_PIPE_SESSION_BYTES]; /* from connect: what its data connection's HELLO is MACed with */
    bool released;             /* the user gave it up: the rx thread frees it once nothing uses it */
    pd_list_link_t unexpected; /* unexpected_t, in arrival order */
    pd_list_link_t link;
};

typedef struct job {
    pd_pipe_peer_t *peer;
    struct iovec *iov;
    int niov;
    int first;              /* iov entries before this one are written */
    void *owned;            /* freed after sending (header + descriptors) */
    op_t *complete_on_send; /* OP_SEND */
    pd_list_link_t link;
} job_t;

typedef struct tcp_pipe {
    pd_pipe_t base;
    uint64_t id;
    char host[64];
    int port;
    int listen_fd, epfd, wake_fd;
    size_t max_msg;
    int busy_poll_us;
    pthread_t rx, tx;
    bool threads;
    bool tx_busy;            /* the sender thread is writing a job (outside mu) */
    pd_pipe_peer_t *tx_peer; /* ... to this peer's out_fd */
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

/* ------------------------------------------------------------------ small helpers (mu held) */

static void complete(tcp_pipe_t *t, pd_pipe_completion_t c)
{
    pd_pipe_cq_push(&t->cq, &c);
}

static void complete_op(tcp_pipe_t *t, op_t *o, pd_status_t st, size_t hlen, size_t plen)
{
    pd_pipe_completion_t c = {o->done, o->recv_cb, NULL, NULL, o->arg, st, o->tag, hlen, plen, NULL};
    complete(t, c);
    t->writes -= o->kind == OP_WRITE;
    free(o->pages);
    free(o);
}

static op_t *take_op(tcp_pipe_t *t, uint64_t id, pd_pipe_peer_t *peer, int kind)
{
    op_t *o;
    pd_list_for_each (o, &t->ops, link) {
        if (o->id == id && o->peer == peer && o->kind == kind) {
            pd_list_del(&o->link);
            return o;
        }
    }
    return NULL;
}

/* Closes a dead peer's sockets as soon as no thread uses them (mu held): its out_fd once the sender
 * thread is not writing to it, its in_fd once nobody is reading it. Called where those uses end,
 * so a dead peer keeps no fd (a closed number could otherwise be reused under a writer). */
static void reap_fds(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    if (!peer->dead) {
        return;
    }
    if (peer->out_fd >= 0 && !(t->tx_busy && t->tx_peer == peer)) {
        close(peer->out_fd);
        peer->out_fd = -1;
    }
    if (peer->in_fd >= 0 && !peer->reading) {
        close(peer->in_fd); /* mark_dead took it out of the epoll set */
        peer->in_fd = -1;
    }
}

static void mark_dead(tcp_pipe_t *t, pd_pipe_peer_t *peer, pd_status_t st)
{
    if (peer->dead) {
        return;
    }
    peer->dead = true;
    pd_log_warn("tcp pipe: peer %016llx is gone (%s)", (unsigned long long)peer->id, pd_status_str(st));
    op_t *o, *tmp;
    pd_list_for_each_safe (o, tmp, &t->ops, link) {
        if (o->peer == peer) {
            pd_list_del(&o->link);
            complete_op(t, o, st, 0, 0);
        }
    }
    if (t->peer_cb != NULL) {
        pd_pipe_completion_t c = {NULL, NULL, t->peer_cb, peer, t->peer_cb_arg, st, 0, 0, 0, NULL};
        complete(t, c);
    }
    if (peer->out_fd >= 0) {
        shutdown(peer->out_fd, SHUT_RDWR);
    }
    if (peer->in_fd >= 0) {
        /* out of the receiver's epoll set first: a shut-down socket polls readable (EOF) forever,
         * and the receiver skips dead peers, so it would spin */
        epoll_ctl(t->epfd, EPOLL_CTL_DEL, peer->in_fd, NULL);
        shutdown(peer->in_fd, SHUT_RDWR);
    }
    reap_fds(t, peer);
}

/* Closes peer's incoming connection, leaving the peer alive without one until it connects
 * again (mu held; nobody is reading it). */
static void drop_in(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, peer->in_fd, NULL);
    close(peer->in_fd);
    peer->in_fd = -1;
}

static tcp_region_t *region_by_id(tcp_pipe_t *t, uint32_t id)
{
    return id < t->num_regions ? t->regions[id] : NULL;
}

static bool allowed(tcp_pipe_t *t, uint32_t region_id, pd_pipe_peer_t *peer, bool write)
{
    perm_t *p;
    pd_list_for_each (p, &t->perms, link) {
        if (p->region_id == region_id && p->peer == peer && (!write || p->write)) {
            return true;
        }
    }
    return false;
}

/* The live record of the peer pipe `id` (mu held), or with create a new one. A record declared
 * dead is never revived: callers may still hold it, and its operations have failed. When the
 * peer connects again (the connector's next handshake), a fresh record takes its place; dead ones
 * are freed with the pipe. */
static pd_pipe_peer_t *peer_by_id(tcp_pipe_t *t, uint64_t id, bool create)
{
    pd_pipe_peer_t *p;
    pd_list_for_each (p, &t->peers, link) {
        if (p->id == id && !p->dead) {
            return p;
        }
    }
    if (!create) {
        return NULL;
    }
    p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return NULL;
    }
    p->id = id;
    p->out_fd = p->in_fd = -1;
    pd_list_head_init(&p->unexpected);
    pd_list_add_tail(&t->peers, &p->link);
    return p;
}

/* Consumes `done` bytes from the front of iov[*n]: entries fully done are skipped, a partly done
 * one is trimmed. */
static void iov_advance(struct iovec **iov, int *n, size_t done)
{
    while (*n > 0 && done >= (*iov)->iov_len) {
        done -= (*iov)->iov_len;
        (*iov)++;
        (*n)--;
    }
    if (*n > 0) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + done;
        (*iov)->iov_len -= done;
    }
}

/* Writes as much of j as the socket takes now, without blocking; advances j. Returns 1 when
 * all of it is written, 0 when some remains, -1 when the connection failed. */
static int write_some(int fd, job_t *j)
{
    while (j->first < j->niov) {
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = j->iov + j->first;
        m.msg_iovlen = (size_t)(j->niov - j->first > IOV_MAX ? IOV_MAX : j->niov - j->first);
        ssize_t w = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
        }
        struct iovec *v = j->iov + j->first;
        int left = j->niov - j->first;
        iov_advance(&v, &left, (size_t)w);
        j->first = j->niov - left;
    }
    return 1;
}

static void job_free(job_t *j);

/* Sends j (mu held). When nothing is queued and the sender thread is idle, the frame is written
 * inline, without blocking (saves two thread hand-offs per operation); whatever the socket does
 * not take at once goes to the sender thread, which keeps the order. */
static void enqueue(tcp_pipe_t *t, job_t *j)
{
    if (pd_list_is_empty(&t->jobs) && !t->tx_busy && !j->peer->dead && j->peer->out_fd >= 0) {
        int r = write_some(j->peer->out_fd, j);
        if (r != 0) {
            if (r < 0) {
                mark_dead(t, j->peer, PD_ERR_PEER_GONE);
            }
            if (j->complete_on_send != NULL) {
                complete_op(t, j->complete_on_send, r > 0 ? PD_OK : PD_ERR_PEER_GONE, 0, 0);
            }
            job_free(j);
            return;
        }
    }
    pd_list_add_tail(&t->jobs, &j->link);
    pthread_cond_signal(&t->tx_cv);
}

static job_t *job_new(pd_pipe_peer_t *peer, int niov, size_t owned_bytes)
{
    job_t *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        return NULL;
    }
    j->peer = peer;
    j->iov = calloc((size_t)niov, sizeof(struct iovec));
    j->owned = owned_bytes > 0 ? calloc(1, owned_bytes) : NULL;
    if (j->iov == NULL || (owned_bytes > 0 && j->owned == NULL)) {
        free(j->iov);
        free(j->owned);
        free(j);
        return NULL;
    }
    j->niov = niov;
    return j;
}

static void job_free(job_t *j)
{
    free(j->iov);
    free(j->owned);
    free(j);
}

/* ------------------------------------------------------------------ socket I/O */

static int read_full(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (r > 0) {
            p += r;
            n -= (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else {
            return -1;
        }
    }
    return 0;
}

/* Reads the pages d[n] (offsets into base) in order, up to 64 pages per readv: one syscall per
 * batch instead of per page (a 16 KiB page per read() costs ~30% of the stream rate here). */
static int read_pages(int fd, char *base, const desc_t *d, uint32_t n)
{
    struct iovec iov[64];
    for (uint32_t i = 0; i < n;) {
        int k = 0;
        for (; k < 64 && i + (uint32_t)k < n; k++) {
            iov[k] = (struct iovec){base + d[i + (uint32_t)k].off, d[i + (uint32_t)k].len};
        }
        i += (uint32_t)k;
        struct iovec *v = iov;
        while (k > 0) {
            ssize_t r = readv(fd, v, k);
            if (r < 0 && errno == EINTR) {
                continue;
            }
            if (r <= 0) {
                return -1;
            }
            iov_advance(&v, &k, (size_t)r);
        }
    }
    return 0;
}

static int discard(int fd, uint64_t n)
{
    char buf[65536];
    while (n > 0) {
        size_t k = n > sizeof(buf) ? sizeof(buf) : (size_t)n;
        if (read_full(fd, buf, k) != 0) {
            return -1;
        }
        n -= k;
    }
    return 0;
}

static int writev_full(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n > IOV_MAX ? IOV_MAX : n);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        iov_advance(&iov, &n, (size_t)w);
    }
    return 0;
}

static void tune_socket(int fd)
{
    int one = 1, buf = 8 << 20;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

/* ------------------------------------------------------------------ sender thread */

static void *tx_main(void *arg)
{
    tcp_pipe_t *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && pd_list_is_empty(&t->jobs)) {
            pthread_cond_wait(&t->tx_cv, &t->mu);
        }
        if (t->stop) {
            break;
        }
        job_t *j = pd_list_pop_head(&t->jobs, job_t, link);
        pd_pipe_peer_t *peer = j->peer;
        int fd = peer->out_fd;
        bool dead = peer->dead || fd < 0;
        t->tx_busy = true;
        t->tx_peer = peer;
        pthread_mutex_unlock(&t->mu);
        int rc = dead ? -1 : writev_full(fd, j->iov + j->first, j->niov - j->first);
        pthread_mutex_lock(&t->mu);
        t->tx_busy = false;
        t->tx_peer = NULL;
        reap_fds(t, peer); /* it died while we wrote */
        if (rc != 0) {
            mark_dead(t, peer, PD_ERR_PEER_GONE);
            if (j->complete_on_send != NULL) {
                complete_op(t, j->complete_on_send, PD_ERR_PEER_GONE, 0, 0);
            }
        } else if (j->complete_on_send != NULL) {
            complete_op(t, j->complete_on_send, PD_OK, 0, 0);
        }
        job_free(j);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ------------------------------------------------------------------ receiver thread */

static void send_reply(tcp_pipe_t *t, pd_pipe_peer_t *peer, int type, uint64_t op_id, int32_t status,
                       const tcp_region_t *r, const desc_t *d, uint32_t n, uint64_t total)
{
    job_t *j = job_new(peer, 1 + (int)n, sizeof(hdr_t));
    if (j == NULL) {
        return;
    }
    hdr_t *h = j->owned;
    *h = (hdr_t){TCP_MAGIC, (uint8_t)type, {0}, op_id, 0, status, 0, 0, r != NULL ? total : 0};
    j->iov[0] = (struct iovec){h, sizeof(*h)};
    j->niov = 1;
    for (uint32_t i = 0; r != NULL && i < n; i++) {
        j->iov[j->niov++] = (struct iovec){(char *)r->pub.base + d[i].off, d[i].len};
    }
    enqueue(t, j);
}

/* Validates descriptors against a region: all inside, sum equal to expected (when non-zero). */
static bool descs_ok(const tcp_region_t *r, const desc_t *d, uint32_t n, uint64_t expect_total)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (d[i].len > r->pub.len || d[i].off > r->pub.len - d[i].len) {
            return false;
        }
        sum += d[i].len;
    }
    return expect_total == UINT64_MAX || sum == expect_total;
}

/* Frame handlers (rx thread). Each is called without t->mu and returns without it, holding t->mu
 * only around the op list, the region table and replies — never while reading the socket.
 * Returns 0, or -1 when the connection must be dropped. */

/* M_WRITE: pages for one of our regions; refused (and drained) unless the peer may write there. */
static int rx_write(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const hdr_t *h, const desc_t *d)
{
    pthread_mutex_lock(&t->mu);
    tcp_region_t *r = region_by_id(t, h->region_id);
    bool ok = r != NULL && allowed(t, h->region_id, peer, true) && descs_ok(r, d, h->count, h->len);
    pthread_mutex_unlock(&t->mu);
    int rc;
    if (!ok) {
        pd_log_warn(
            "tcp pipe: refused a write of %u pages from peer %016llx (region %u not writable by it or "
            "pages outside it)",
            h->count, (unsigned long long)peer->id, h->region_id);
        rc = discard(fd, h->len);
    } else {
        rc = read_pages(fd, r->pub.base, d, h->count);
    }
    if (rc == 0) {
        pthread_mutex_lock(&t->mu);
        send_reply(t, peer, M_WRITE_ACK, h->op_id, ok ? PD_OK : PD_ERR_OUT_OF_RANGE, NULL, NULL, 0, 0);
        pthread_mutex_unlock(&t->mu);
    }
    return rc;
}

/* M_READ_REQ: the peer reads pages of one of our regions (answered with the pages, or refused). */
static int rx_read_req(tcp_pipe_t *t, pd_pipe_peer_t *peer, const hdr_t *h, const desc_t *d)
{
    pthread_mutex_lock(&t->mu);
    tcp_region_t *r = region_by_id(t, h->region_id);
    bool ok = r != NULL && allowed(t, h->region_id, peer, false) && descs_ok(r, d, h->count, UINT64_MAX);
    uint64_t total = 0;
    for (uint32_t i = 0; ok && i < h->count; i++) {
        total += d[i].len;
    }
    send_reply(t, peer, M_READ_RESP, h->op_id, ok ? PD_OK : PD_ERR_OUT_OF_RANGE, ok ? r : NULL, d, h->count,
               total);
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        pd_log_warn("tcp pipe: refused a read of region %u by peer %016llx", h->region_id,
                    (unsigned long long)peer->id);
    }
    return 0;
}

/* M_WRITE_ACK: our write to the peer landed (or was refused). */
static int rx_write_ack(tcp_pipe_t *t, pd_pipe_peer_t *peer, const hdr_t *h)
{
    pthread_mutex_lock(&t->mu);
    op_t *o = take_op(t, h->op_id, peer, OP_WRITE);
    if (o != NULL) {
        complete_op(t, o, (pd_status_t)h->status, 0, 0);
    }
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* M_READ_RESP: the pages of our read, straight into the local region (or drained on a mismatch). */
static int rx_read_resp(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const hdr_t *h)
{
    pthread_mutex_lock(&t->mu);
    op_t *o = take_op(t, h->op_id, peer, OP_READ);
    pthread_mutex_unlock(&t->mu);
    pd_status_t st = (pd_status_t)h->status;
    int rc = 0;
    if (o == NULL || (st == PD_OK && h->len != o->total) || (st != PD_OK && h->len != 0)) {
        rc = discard(fd, h->len);
        st = PD_ERR_PARSE;
    } else if (st == PD_OK) {
        rc = read_pages(fd, o->local->pub.base, o->pages, (uint32_t)o->n);
    }
    if (o != NULL) {
        pthread_mutex_lock(&t->mu);
        complete_op(t, o, rc == 0 ? st : PD_ERR_PEER_GONE, 0, 0);
        pthread_mutex_unlock(&t->mu);
    }
    return rc;
}

/* The posted receive from peer for tag, unlinked from the op list (NULL: none). t->mu held. */
static op_t *take_recv(tcp_pipe_t *t, pd_pipe_peer_t *peer, uint64_t tag)
{
    op_t *o;
    pd_list_for_each (o, &t->ops, link) {
        if (o->kind == OP_RECV && o->peer == peer && o->tag == tag) {
            pd_list_del(&o->link);
            return o;
        }
    }
    return NULL;
}

/* M_TENSOR with no receive posted for it: buffered on the peer, or handed to a receive posted
 * while its payload was arriving. */
static int rx_tensor_unexpected(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const hdr_t *h)
{
    unexpected_t *u = calloc(1, sizeof(*u));
    if (u != NULL) {
        u->tag = h->op_id;
        u->hdr = malloc(h->count + 1);
        u->payload = malloc(h->len + 1);
        u->hdr_len = h->count;
        u->payload_len = h->len;
    }
    if (u == NULL || u->hdr == NULL || u->payload == NULL || read_full(fd, u->hdr, h->count) != 0 ||
        read_full(fd, u->payload, h->len) != 0) {
        if (u != NULL) {
            unexpected_free(u);
        }
        return -1;
    }
    pthread_mutex_lock(&t->mu);
    op_t *o = take_recv(t, peer, u->tag);
    if (o != NULL) {
        pd_status_t st = PD_ERR_NO_SPACE;
        if (u->hdr_len <= o->hcap && u->payload_len <= o->pcap) {
            memcpy(o->hbuf, u->hdr, u->hdr_len);
            memcpy(o->pbuf, u->payload, u->payload_len);
            st = PD_OK;
        }
        complete_op(t, o, st, u->hdr_len, u->payload_len);
        unexpected_free(u);
    } else {
        pd_list_add_tail(&peer->unexpected, &u->link);
    }
    pthread_mutex_unlock(&t->mu);
    return 0;
}

/* M_TENSOR: a tagged message (header + payload) into the posted receive for its tag. */
static int rx_tensor(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const hdr_t *h)
{
    if (h->count > t->max_msg || h->len > t->max_msg) {
        return -1;
    }
    pthread_mutex_lock(&t->mu);
    op_t *o = take_recv(t, peer, h->op_id);
    pthread_mutex_unlock(&t->mu);
    if (o == NULL) {
        return rx_tensor_unexpected(t, peer, fd, h);
    }
    int rc;
    pd_status_t st;
    if (h->count <= o->hcap && h->len <= o->pcap) {
        rc = read_full(fd, o->hbuf, h->count);
        if (rc == 0) {
            rc = read_full(fd, o->pbuf, h->len);
        }
        st = rc == 0 ? PD_OK : PD_ERR_PEER_GONE;
    } else {
        rc = discard(fd, (uint64_t)h->count + h->len);
        st = PD_ERR_NO_SPACE;
    }
    pthread_mutex_lock(&t->mu);
    complete_op(t, o, st, h->count, h->len);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Reads one frame from peer's connection fd and dispatches it by type. */
static int rx_frame(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd)
{
    hdr_t h;
    if (read_full(fd, &h, sizeof(h)) != 0) {
        return -1;
    }
    if (h.magic != TCP_MAGIC) {
        pd_log_warn("tcp pipe: bad frame magic from peer %016llx", (unsigned long long)peer->id);
        return -1;
    }
    desc_t *d = NULL;
    if (h.type == M_WRITE || h.type == M_READ_REQ) {
        if (h.count > TCP_MAX_PAGES || h.len > t->max_msg) {
            pd_log_warn("tcp pipe: frame of %u pages / %llu bytes over the limits", h.count,
                        (unsigned long long)h.len);
            return -1;
        }
        d = malloc((size_t)h.count * sizeof(desc_t) + 1);
        if (d == NULL || read_full(fd, d, (size_t)h.count * sizeof(desc_t)) != 0) {
            free(d);
            return -1;
        }
    }
    int rc;
    switch (h.type) {
    case M_WRITE: rc = rx_write(t, peer, fd, &h, d); break;
    case M_READ_REQ: rc = rx_read_req(t, peer, &h, d); break;
    case M_WRITE_ACK: rc = rx_write_ack(t, peer, &h); break;
    case M_READ_RESP: rc = rx_read_resp(t, peer, fd, &h); break;
    case M_TENSOR: rc = rx_tensor(t, peer, fd, &h); break;
    default:
        pd_log_warn("tcp pipe: unknown frame type %u from peer %016llx", h.type,
                    (unsigned long long)peer->id);
        rc = -1;
    }
    free(d);
    return rc;
}

/* fd sent HELLO h: it becomes the incoming connection of the peer h names (by pipe id). */
static void hello_to_peer(tcp_pipe_t *t, int fd, const hdr_t *h)
{
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *peer = peer_by_id(t, h->op_id, false); /* connect made it: a HELLO creates none */
    if (peer != NULL && peer->in_fd >= 0 && !peer->in_used && !peer->reading) {
        /* a connection that never carried a frame, superseded: the peer connects again only after
         * declaring us dead, so the older one is its previous incarnation's (accepted late, after
         * we had declared that one dead too) */
        pd_log_info("tcp pipe: peer %016llx connected again; its earlier, unused connection is dropped",
                    (unsigned long long)peer->id);
        drop_in(t, peer);
    }
    if (peer == NULL || peer->in_fd >= 0) {
        pthread_mutex_unlock(&t->mu);
        close(fd);
        return;
    }
    peer->in_fd = fd;
    struct epoll_event ev = {EPOLLIN, {.ptr = peer}};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev); /* under mu: mark_dead removes it again */
    pthread_mutex_unlock(&t->mu);
}

/* Unlinks pending connection c and closes it. */
static void pending_drop(tcp_pipe_t *t, pending_in_t *c)
{
    pd_list_del(&c->link);
    t->num_pending--;
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c);
}

/* A connection on the data listener waits, without blocking the receiver, for its HELLO. */
static void rx_accept(tcp_pipe_t *t)
{
    int fd = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* the connection stays queued and the listener readable: stop polling it for a while
             * instead of spinning on the error */
            if (pd_time_now_s() - t->accept_logged > 10) { /* once per episode, not 10 lines a second */
                pd_log_warn("tcp pipe: cannot accept a data connection (%s); pausing accepts for 100 ms at a "
                            "time",
                            strerror(errno));
                t->accept_logged = pd_time_now_s();
            }
            struct epoll_event ev = {0, {.ptr = NULL}};
            epoll_ctl(t->epfd, EPOLL_CTL_MOD, t->listen_fd, &ev);
            t->accept_resume = pd_time_now_s() + 0.1;
        }
        return;
    }
    tune_socket(fd);
    struct timeval tv = {TCP_RCV_TIMEOUT_S, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    pending_in_t *c = calloc(1, sizeof(*c));
    struct epoll_event ev = {EPOLLIN, {.ptr = (void *)((uintptr_t)c | 1u)}};
    if (c == NULL || epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        free(c);
        close(fd);
        return;
    }
    c->fd = fd;
    c->deadline = pd_time_now_s() + TCP_HELLO_TIMEOUT_S;
    pd_list_add_tail(&t->pending, &c->link);
    if (++t->num_pending > TCP_MAX_PENDING) {
        pending_drop(t, pd_list_head(&t->pending, pending_in_t, link)); /* the oldest */
    }
}

/* HMAC-SHA256(session, "pd-data" | from | to | nonce): a data connection's proof that its dialer
 * (pipe id from) holds the session secret it shares with the acceptor (pipe id to). */
static void hello_mac(const uint8_t *session, uint64_t from, uint64_t to, const uint8_t *nonce,
                      uint8_t out[32])
{
    uint8_t msg[7 + 8 + 8 + TCP_HELLO_NONCE];
    memcpy(msg, "pd-data", 7);
    memcpy(msg + 7, &from, 8);
    memcpy(msg + 15, &to, 8);
    memcpy(msg + 23, nonce, TCP_HELLO_NONCE);
    pd_hmac_sha256(session, PD_PIPE_SESSION_BYTES, msg, sizeof(msg), out);
}

/* A pending connection whose HELLO is in but whose peer this side has not connected to yet: out of
 * the readable set (its bytes stay buffered; a hang-up is still reported) until connect adds a peer. */
static void pending_wait(tcp_pipe_t *t, pending_in_t *c)
{
    c->waiting = true;
    struct epoll_event ev = {EPOLLRDHUP, {.ptr = (void *)((uintptr_t)c | 1u)}}; /* its close still counts */
    epoll_ctl(t->epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* The HELLO buffered on c (header + authentication, peeked) is usable: the magic, a peer this side
 * connected to, and a MAC under that peer's session. 1 yes (*h filled), 0 not yet (more bytes, or
 * the peer unknown so far: c waits), -1 drop it. */
static int hello_check(tcp_pipe_t *t, pending_in_t *c, hdr_t *h)
{
    uint8_t buf[sizeof(hdr_t) + TCP_HELLO_AUTH];
    ssize_t k = recv(c->fd, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return 0;
    }
    if (k > 0 && k < (ssize_t)sizeof(buf)) {
        return 0; /* the rest of the HELLO is on its way */
    }
    memcpy(h, buf, sizeof(*h));
    if (k != (ssize_t)sizeof(buf) || h->magic != TCP_MAGIC || h->type != M_HELLO ||
        h->len != TCP_HELLO_AUTH) {
        return -1;
    }
    uint8_t want[32];
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *peer = peer_by_id(t, h->op_id, false);
    if (peer != NULL) {
        hello_mac(peer->session, h->op_id, t->id, buf + sizeof(*h), want);
    }
    pthread_mutex_unlock(&t->mu);
    if (peer == NULL) {
        struct pollfd pf = {c->fd, POLLRDHUP, 0};
        if (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            return -1; /* the dialer gave up waiting */
        }
        pending_wait(t, c);
        return 0;
    }
    if (!pd_ct_equal(want, buf + sizeof(*h) + TCP_HELLO_NONCE, 32)) {
        pd_log_warn("tcp pipe: refused a data connection claiming to be peer %016llx (wrong session proof)",
                    (unsigned long long)h->op_id);
        return -1;
    }
    return 1;
}

/* Pending connection c is readable: once its whole, authenticated HELLO is there it goes to its
 * peer; a closed, garbled or unauthenticated one is dropped; a partial one keeps waiting (until its
 * deadline), as does one for a peer this side has not connected to yet. */
static void rx_pending(tcp_pipe_t *t, pending_in_t *c)
{
    pending_in_t *x;
    bool listed = false;
    pd_list_for_each (x, &t->pending, link) {
        listed = listed || x == c;
    }
    if (!listed) {
        return; /* dropped earlier in this batch of events */
    }
    hdr_t h;
    int ok = hello_check(t, c, &h);
    if (ok <= 0) {
        if (ok < 0) {
            pending_drop(t, c);
        }
        return;
    }
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *peer = peer_by_id(t, h.op_id, false);
    bool wait = peer != NULL && peer->in_fd >= 0 && !peer->in_used && peer->reading;
    pthread_mutex_unlock(&t->mu);
    if (wait) {
        /* the peer's earlier, unused connection (a previous incarnation's) is being read this
         * instant (progress taking a frame, a few µs): decide which connection stays once that is
         * over; the HELLO stays buffered, so epoll reports this connection again */
        sched_yield();
        return;
    }
    uint8_t auth[TCP_HELLO_AUTH];
    if (read_full(c->fd, &h, sizeof(h)) != 0 || read_full(c->fd, auth, sizeof(auth)) != 0) {
        pending_drop(t, c);
        return;
    }
    int fd = c->fd;
    pd_list_del(&c->link);
    t->num_pending--;
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, fd, NULL);
    free(c);
    hello_to_peer(t, fd, &h);
}

/* connect added a peer: pending connections that waited for one look again. */
static void pending_recheck(tcp_pipe_t *t)
{
    pthread_mutex_lock(&t->mu);
    bool again = t->recheck;
    t->recheck = false;
    pthread_mutex_unlock(&t->mu);
    pending_in_t *c, *tmp;
    pd_list_for_each_safe (c, tmp, &t->pending, link) {
        if (again && c->waiting) {
            c->waiting = false;
            struct epoll_event ev = {EPOLLIN, {.ptr = (void *)((uintptr_t)c | 1u)}};
            epoll_ctl(t->epfd, EPOLL_CTL_MOD, c->fd, &ev);
            rx_pending(t, c); /* may free c */
        }
    }
}

/* Pending connections past their deadline are dropped. */
static void pending_expire(tcp_pipe_t *t)
{
    double now = pd_time_now_s();
    pending_in_t *c, *tmp;
    pd_list_for_each_safe (c, tmp, &t->pending, link) {
        if (c->deadline <= now) {
            pending_drop(t, c);
        }
    }
}

/* peer's incoming connection is readable: serve one frame (unless progress is reading it or the
 * peer died meanwhile). Returns whether it was a request (busy polling follows those). */
static bool rx_peer(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    pthread_mutex_lock(&t->mu);
    bool dead = peer->dead || peer->in_fd < 0; /* declared dead, or its connection dropped, since
                                                * this event was reported */
    bool busy = peer->reading;
    if (!dead && !busy) {
        peer->reading = true; /* claimed: progress leaves this socket alone */
    }
    pthread_mutex_unlock(&t->mu);
    if (dead) {
        return false;
    }
    if (busy) { /* progress is taking an ack from this socket: a few µs */
        sched_yield();
        return false;
    }
    /* the socket may have been drained by progress since epoll reported it */
    hdr_t peek;
    ssize_t k = recv(peer->in_fd, &peek, sizeof(peek), MSG_PEEK | MSG_DONTWAIT);
    int rc = k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                 ? 0
                 : rx_frame(t, peer, peer->in_fd);
    pthread_mutex_lock(&t->mu);
    peer->reading = false;
    reap_fds(t, peer); /* it died while we read */
    if (rc != 0 && !peer->in_used && !peer->dead) {
        /* closed before its first frame: a previous incarnation's connection, accepted after we had
         * declared that one dead (the connector then handshook again). Not this peer's death: a
         * real one is found by writes failing and the heartbeat. */
        pd_log_info(
            "tcp pipe: an incoming connection from peer %016llx closed before its first frame; dropped",
            (unsigned long long)peer->id);
        drop_in(t, peer);
    } else if (rc != 0) {
        mark_dead(t, peer, PD_ERR_PEER_GONE);
    } else if (k > 0) {
        peer->in_used = true;
    }
    pthread_mutex_unlock(&t->mu);
    return k == (ssize_t)sizeof(peek) &&
           (peek.type == M_WRITE || peek.type == M_READ_REQ || peek.type == M_TENSOR);
}

/* The receiver thread: the data listener and every peer's incoming connection (epoll). */
static void peer_free(pd_pipe_peer_t *pe);

/* Whether a released peer is still used: by a thread (sending to it, reading from it), a socket, a
 * queued job or a pending op. mu held. */
static bool peer_in_use(tcp_pipe_t *t, const pd_pipe_peer_t *pe)
{
    if (pe->out_fd >= 0 || pe->in_fd >= 0 || pe->reading || (t->tx_busy && t->tx_peer == pe)) {
        return true;
    }
    const job_t *j;
    pd_list_for_each (j, &t->jobs, link) {
        if (j->peer == pe) {
            return true;
        }
    }
    const op_t *o;
    pd_list_for_each (o, &t->ops, link) {
        if (o->peer == pe) {
            return true;
        }
    }
    return false;
}

/* Released peers nobody uses any more go, with the permissions granted to them (a later peer must
 * not inherit them through a reused address). Called by the rx thread between two batches of epoll
 * events, so no event it is about to handle names a freed peer. */
static void free_released(tcp_pipe_t *t)
{
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *pe, *tmp;
    pd_list_for_each_safe (pe, tmp, &t->peers, link) {
        if (!pe->released || peer_in_use(t, pe)) {
            continue;
        }
        perm_t *pm, *pt;
        pd_list_for_each_safe (pm, pt, &t->perms, link) {
            if (pm->peer == pe) {
                pd_list_del(&pm->link);
                free(pm);
            }
        }
        pd_list_del(&pe->link);
        peer_free(pe);
    }
    pthread_mutex_unlock(&t->mu);
}

static void *rx_main(void *arg)
{
    tcp_pipe_t *t = arg;
    struct epoll_event evs[32];
    double poll_until = 0; /* busy_poll_us after the last request served: poll instead of sleeping */
    for (;;) {
        free_released(t);
        int wait_ms = poll_until > 0 && pd_time_now_s() < poll_until ? 0 : 1000;
        if (t->accept_resume > 0) { /* accepts paused (out of fds): resume them on time */
            double left = t->accept_resume - pd_time_now_s();
            if (left <= 0) {
                struct epoll_event ev = {EPOLLIN, {.ptr = NULL}};
                epoll_ctl(t->epfd, EPOLL_CTL_MOD, t->listen_fd, &ev);
                t->accept_resume = 0;
            } else if (wait_ms > (int)(left * 1000) + 1) {
                wait_ms = (int)(left * 1000) + 1;
            }
        }
        int n = epoll_wait(t->epfd, evs, 32, wait_ms);
        pthread_mutex_lock(&t->mu);
        bool stop = t->stop;
        pthread_mutex_unlock(&t->mu);
        if (stop) {
            break;
        }
        pending_expire(t);
        pending_recheck(t);
        for (int i = 0; i < n; i++) {
            void *ptr = evs[i].data.ptr;
            if (ptr == NULL) { /* the listener */
                rx_accept(t);
            } else if ((uintptr_t)ptr & 1u) {
                rx_pending(t, (pending_in_t *)((uintptr_t)ptr & ~(uintptr_t)1u));
            } else if (ptr == (void *)t) { /* the wake eventfd (connect added a peer, or stop) */
                uint64_t v;
                ssize_t r = read(t->wake_fd, &v, sizeof(v));
                (void)r;
            } else if (rx_peer(t, ptr) && t->busy_poll_us > 0) {
                /* after a request, not after acks: the requester's side stays asleep */
                poll_until = pd_time_now_s() + t->busy_poll_us * 1e-6;
            }
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ API */

static pd_status_t tcp_create(const pd_pipe_config_t *cfg, pd_pipe_t **out)
{
    tcp_pipe_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    t->base.ops = &pd_pipe_tcp_ops;
    t->listen_fd = t->epfd = t->wake_fd = -1;
    pd_list_head_init(&t->peers);
    pd_list_head_init(&t->perms);
    pd_list_head_init(&t->ops);
    pd_list_head_init(&t->jobs);
    pd_list_head_init(&t->pending);
    t->max_msg = cfg->max_message_bytes ? cfg->max_message_bytes : (1ull << 30);
    t->busy_poll_us = cfg->tcp_busy_poll_us > 0 ? cfg->tcp_busy_poll_us : 0;
    snprintf(t->host, sizeof(t->host), "%s", cfg->host != NULL ? cfg->host : "127.0.0.1");
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->tx_cv, NULL);
    if (getrandom(&t->id, sizeof(t->id), 0) != (ssize_t)sizeof(t->id)) {
        t->id = (uint64_t)(uintptr_t)t ^ 0x9e3779b97f4a7c15ull;
    }
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)cfg->port);
    t->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(t->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    socklen_t sl = sizeof(a);
    if (t->listen_fd < 0 || inet_pton(AF_INET, t->host, &a.sin_addr) != 1 ||
        bind(t->listen_fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(t->listen_fd, 64) != 0 ||
        getsockname(t->listen_fd, (struct sockaddr *)&a, &sl) != 0) {
        pd_log_error("tcp pipe: cannot listen on %s:%d: %s", t->host, cfg->port, strerror(errno));
        pd_pipe_tcp_ops.destroy(&t->base);
        return PD_ERR_IO;
    }
    t->port = ntohs(a.sin_port);
    t->epfd = epoll_create1(EPOLL_CLOEXEC);
    t->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (t->epfd < 0 || t->wake_fd < 0 || pd_pipe_cq_open_fd(&t->cq) != PD_OK) {
        pd_log_error("tcp pipe: cannot create its epoll/eventfd descriptors: %s", strerror(errno));
        pd_pipe_tcp_ops.destroy(&t->base);
        return PD_ERR_IO;
    }
    struct epoll_event ev = {EPOLLIN, {.ptr = NULL}};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->listen_fd, &ev);
    struct epoll_event wev = {EPOLLIN, {.ptr = t}};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->wake_fd, &wev);
    if (pthread_create(&t->rx, NULL, rx_main, t) != 0 || pthread_create(&t->tx, NULL, tx_main, t) != 0) {
        pd_log_error("tcp pipe: cannot start its threads");
        pd_pipe_tcp_ops.destroy(&t->base);
        return PD_ERR_INTERNAL;
    }
    t->threads = true;
    *out = &t->base;
    return PD_OK;
}

/* Takes the write acks already waiting on the incoming sockets, in the caller's thread (mu held
 * on entry and exit). A caller that polls progress then sees its writes complete without the
 * receiver thread waking up for each ack: on this VM a wake-up costs more than the transfer of a
 * page. Only whole ack frames (a header, nothing after it) are taken: everything else, and any
 * socket the receiver thread is reading, is left to the receiver thread. */
static void take_acks(tcp_pipe_t *t)
{
    pd_pipe_peer_t *peer;
    pd_list_for_each (peer, &t->peers, link) {
        if (t->writes == 0) {
            break;
        }
        if (peer->dead || peer->reading || peer->in_fd < 0) {
            continue;
        }
        peer->reading = true;
        pthread_mutex_unlock(&t->mu);
        int rc = 0, taken = 0;
        for (; taken < 64; taken++) { /* bounded work per call */
            hdr_t h;
            ssize_t k = recv(peer->in_fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT);
            if (k != (ssize_t)sizeof(h) || h.magic != TCP_MAGIC || h.type != M_WRITE_ACK) {
                break; /* nothing whole, or a frame for the receiver thread (which also reports errors) */
            }
            rc = rx_frame(t, peer, peer->in_fd); /* reads the header that is there: does not block */
            if (rc != 0) {
                break;
            }
        }
        pthread_mutex_lock(&t->mu);
        peer->reading = false;
        peer->in_used |= taken > 0;
        if (rc != 0) {
            mark_dead(t, peer, PD_ERR_PEER_GONE);
        }
        reap_fds(t, peer);
    }
}

static int tcp_progress(pd_pipe_t *p)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    if (t->cq.head == NULL && t->writes > 0) {
        take_acks(t);
    }
    pd_pipe_completion_t *c = pd_pipe_cq_take(&t->cq);
    pthread_mutex_unlock(&t->mu);
    return pd_pipe_cq_run(c);
}

static int tcp_wait_fd(pd_pipe_t *p)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    return t->cq.has_fd ? t->cq.efd : -1;
}

/* Stop the sender and receiver threads: shut every socket down so that a thread stuck on one returns. */
static void stop_threads(tcp_pipe_t *t)
{
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->tx_cv);
    pd_pipe_peer_t *pe;
    pd_list_for_each (pe, &t->peers, link) {
        if (pe->out_fd >= 0) {
            shutdown(pe->out_fd, SHUT_RDWR); /* unblocks a sender stuck on a full socket */
        }
        if (pe->in_fd >= 0) {
            shutdown(pe->in_fd, SHUT_RDWR);
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (t->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(t->wake_fd, &one, sizeof(one));
        (void)w;
    }
    if (t->threads) {
        pthread_join(t->tx, NULL);
        pthread_join(t->rx, NULL);
    }
}

/* Every pending operation and queued send ends with PD_ERR_CANCELLED; no peer callback runs after this. The
 * threads are stopped. */
static void cancel_all(tcp_pipe_t *t)
{
    while (!pd_list_is_empty(&t->pending)) {
        pending_drop(t, pd_list_head(&t->pending, pending_in_t, link));
    }
    pthread_mutex_lock(&t->mu);
    op_t *o;
    while ((o = pd_list_pop_head(&t->ops, op_t, link)) != NULL) {
        complete_op(t, o, PD_ERR_CANCELLED, 0, 0);
    }
    job_t *j;
    while ((j = pd_list_pop_head(&t->jobs, job_t, link)) != NULL) {
        if (j->complete_on_send != NULL) {
            complete_op(t, j->complete_on_send, PD_ERR_CANCELLED, 0, 0);
        }
        job_free(j);
    }
    t->peer_cb = NULL;
    pthread_mutex_unlock(&t->mu);
}

/* Close a peer's sockets and free its record and its unclaimed messages. */
static void peer_free(pd_pipe_peer_t *pe)
{
    if (pe->out_fd >= 0) {
        close(pe->out_fd);
    }
    if (pe->in_fd >= 0) {
        close(pe->in_fd);
    }
    unexpected_t *u;
    while ((u = pd_list_pop_head(&pe->unexpected, unexpected_t, link)) != NULL) {
        unexpected_free(u);
    }
    free(pe);
}

static void regions_free(tcp_pipe_t *t)
{
    for (uint32_t i = 0; i < t->num_regions; i++) {
        if (t->regions[i] != NULL) {
            if (t->regions[i]->owned) {
                free(t->regions[i]->pub.base);
            }
            free(t->regions[i]);
        }
    }
    free(t->regions);
    perm_t *pm;
    while ((pm = pd_list_pop_head(&t->perms, perm_t, link)) != NULL) {
        free(pm);
    }
}

static void tcp_destroy(pd_pipe_t *p)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    stop_threads(t);
    cancel_all(t);
    tcp_progress(p); /* runs the cancelled completions */
    pd_pipe_peer_t *pe;
    while ((pe = pd_list_pop_head(&t->peers, pd_pipe_peer_t, link)) != NULL) {
        peer_free(pe);
    }
    regions_free(t);
    if (t->listen_fd >= 0) {
        close(t->listen_fd);
    }
    if (t->epfd >= 0) {
        close(t->epfd);
    }
    if (t->wake_fd >= 0) {
        close(t->wake_fd);
    }
    pd_pipe_cq_close_fd(&t->cq);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->tx_cv);
    free(t);
}

static pd_status_t tcp_address(pd_pipe_t *p, uint8_t *buf, size_t *len)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    int n = snprintf((char *)buf, *len, "tcp:%s:%d:%016llx", t->host, t->port, (unsigned long long)t->id);
    if (n < 0 || (size_t)n >= *len) {
        return PD_ERR_NO_SPACE;
    }
    *len = (size_t)n;
    return PD_OK;
}

/* A blocking connect to host:port with the authenticated HELLO written; -1 on failure (logged). */
static int dial_data(tcp_pipe_t *t, const char *host, int port, uint64_t to, const uint8_t *session)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (fd < 0 || inet_pton(AF_INET, host, &a.sin_addr) != 1 ||
        connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        pd_log_error("tcp pipe: cannot connect to %s:%d: %s", host, port, strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    tune_socket(fd);
    hdr_t h = {TCP_MAGIC, M_HELLO, {0}, t->id, 0, 0, 0, 0, TCP_HELLO_AUTH};
    uint8_t auth[TCP_HELLO_AUTH];
    if (getrandom(auth, TCP_HELLO_NONCE, 0) != TCP_HELLO_NONCE) {
        close(fd);
        return -1;
    }
    hello_mac(session, t->id, to, auth, auth + TCP_HELLO_NONCE);
    struct iovec iov[2] = {{&h, sizeof(h)}, {auth, sizeof(auth)}};
    if (writev_full(fd, iov, 2) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static pd_status_t tcp_connect(pd_pipe_t *p, const uint8_t *addr, size_t len, const uint8_t *session,
                               pd_pipe_peer_t **peer_out)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    char s[256], host[64];
    int port;
    unsigned long long id;
    if (len >= sizeof(s)) {
        return PD_ERR_INVALID_ARG;
    }
    memcpy(s, addr, len);
    s[len] = '\0';
    if (sscanf(s, "tcp:%63[^:]:%d:%llx", host, &port, &id) != 3 || port <= 0 || port > 65535) {
        pd_log_error("tcp pipe: '%s' is not a tcp pipe address", s);
        return PD_ERR_INVALID_ARG;
    }
    uint8_t key[PD_PIPE_SESSION_BYTES] = {0};
    if (session != NULL) {
        memcpy(key, session, sizeof(key));
    }
    int fd = dial_data(t, host, port, (uint64_t)id, key);
    if (fd < 0) {
        return PD_ERR_PEER_GONE;
    }
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *peer = peer_by_id(t, (uint64_t)id, true);
    if (peer == NULL || peer->out_fd >= 0) {
        pthread_mutex_unlock(&t->mu);
        close(fd);
        return peer == NULL ? PD_ERR_NO_MEMORY : PD_ERR_INVALID_ARG;
    }
    peer->out_fd = fd;
    memcpy(peer->session, key, sizeof(key));
    t->recheck = true; /* its data connection to us may be waiting already */
    pthread_mutex_unlock(&t->mu);
    if (t->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(t->wake_fd, &one, sizeof(one));
        (void)w;
    }
    *peer_out = peer;
    return PD_OK;
}

static pd_status_t add_region(tcp_pipe_t *t, void *base, size_t len, bool owned, pd_pipe_region_t **out)
{
    tcp_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    r->pub = (struct pd_pipe_region){base, len, PD_MEM_HOST};
    r->owned = owned;
    pthread_mutex_lock(&t->mu);
    if (t->num_regions >= UINT32_MAX ||
        pd_array_reserve(&t->regions, &t->cap_regions, t->num_regions + 1) != PD_OK) {
        pthread_mutex_unlock(&t->mu);
        free(r);
        return PD_ERR_NO_MEMORY;
    }
    r->id = (uint32_t)t->num_regions;
    t->regions[t->num_regions++] = r;
    pthread_mutex_unlock(&t->mu);
    *out = &r->pub;
    return PD_OK;
}

static pd_status_t tcp_alloc_region(pd_pipe_t *p, size_t len, pd_pipe_region_t **out)
{
    void *base = NULL;
    if (posix_memalign(&base, 4096, len ? len : 1) != 0) {
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = add_region((tcp_pipe_t *)p, base, len, true, out);
    if (st != PD_OK) {
        free(base);
    }
    return st;
}

static pd_status_t tcp_register_region(pd_pipe_t *p, void *base, size_t len, pd_mem_type_t mem,
                                       pd_pipe_region_t **out)
{
    if (mem != PD_MEM_HOST) {
        pd_log_error("tcp pipe: only host memory can be registered (stage device memory through host)");
        return PD_ERR_UNSUPPORTED;
    }
    return add_region((tcp_pipe_t *)p, base, len, false, out);
}

static void tcp_deregister_region(pd_pipe_t *p, pd_pipe_region_t *r)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    tcp_region_t *tr = (tcp_region_t *)r;
    pthread_mutex_lock(&t->mu);
    t->regions[tr->id] = NULL;
    perm_t *x, *tmp;
    pd_list_for_each_safe (x, tmp, &t->perms, link) {
        if (x->region_id == tr->id) {
            pd_list_del(&x->link);
            free(x);
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (tr->owned) {
        free(tr->pub.base);
    }
    free(tr);
}

static pd_status_t tcp_export_region(pd_pipe_t *p, pd_pipe_region_t *r, pd_pipe_peer_t *peer,
                                     bool allow_write, uint8_t *buf, size_t *len)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    tcp_region_t *tr = (tcp_region_t *)r;
    if (*len < 12) {
        return PD_ERR_NO_SPACE;
    }
    perm_t *pm = calloc(1, sizeof(*pm));
    if (pm == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pm->region_id = tr->id;
    pm->peer = peer;
    pm->write = allow_write;
    pthread_mutex_lock(&t->mu);
    pd_list_add_tail(&t->perms, &pm->link);
    pthread_mutex_unlock(&t->mu);
    uint64_t l = r->len;
    memcpy(buf, &tr->id, 4);
    memcpy(buf + 4, &l, 8);
    *len = 12;
    return PD_OK;
}

static pd_status_t tcp_import_region(pd_pipe_t *p, pd_pipe_peer_t *peer, const uint8_t *buf, size_t len,
                                     pd_pipe_remote_t **out)
{
    if (len != 12) {
        pd_log_error("tcp pipe: region descriptor of %zu bytes (want 12)", len);
        return PD_ERR_PARSE;
    }
    pd_pipe_remote_t *rr = calloc(1, sizeof(*rr));
    if (rr == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    rr->peer = peer;
    memcpy(&rr->region_id, buf, 4);
    memcpy(&rr->len, buf + 4, 8);
    *out = rr;
    return PD_OK;
}

static void tcp_release_remote(pd_pipe_t *p, pd_pipe_remote_t *rr)
{
    free(rr);
}

/* Queues an op whose peer is already dead: it completes at the next progress. */
static pd_status_t fail_now(tcp_pipe_t *t, pd_pipe_done_cb cb, pd_pipe_recv_cb rcb, void *arg, uint64_t tag)
{
    pd_pipe_completion_t c = {cb, rcb, NULL, NULL, arg, PD_ERR_PEER_GONE, tag, 0, 0, NULL};
    complete(t, c);
    return PD_OK;
}

static pd_status_t post_pages(bool write, pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                              pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                              pd_pipe_done_cb cb, void *arg)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pd_status_t st = pd_pipe_check_pages(pages, n, local->len, remote->len);
    if (st != PD_OK) {
        return st;
    }
    op_t *o = calloc(1, sizeof(*o));
    job_t *j = job_new(peer, 1 + (write ? n : 0), sizeof(hdr_t) + (size_t)n * sizeof(desc_t));
    if (o == NULL || j == NULL) {
        free(o);
        if (j != NULL) {
            job_free(j);
        }
        return PD_ERR_NO_MEMORY;
    }
    uint64_t total = 0;
    hdr_t *h = j->owned;
    desc_t *d = (desc_t *)(h + 1);
    for (int i = 0; i < n; i++) {
        d[i] = (desc_t){pages[i].remote_off, pages[i].len};
        total += pages[i].len;
    }
    o->kind = write ? OP_WRITE : OP_READ;
    o->peer = peer;
    o->done = cb;
    o->arg = arg;
    if (!write) {
        o->local = (tcp_region_t *)local;
        o->pages = malloc((size_t)(n > 0 ? n : 1) * sizeof(desc_t));
        if (o->pages == NULL) {
            free(o);
            job_free(j);
            return PD_ERR_NO_MEMORY;
        }
        for (int i = 0; i < n; i++) {
            o->pages[i] = (desc_t){pages[i].local_off, pages[i].len};
        }
        o->n = n;
        o->total = total;
    }
    pthread_mutex_lock(&t->mu);
    if (peer->dead || peer->out_fd < 0) {
        free(o->pages), free(o);
        job_free(j);
        fail_now(t, cb, NULL, arg, 0);
        pthread_mutex_unlock(&t->mu);
        return PD_OK;
    }
    o->id = ++t->next_op;
    *h = (hdr_t){TCP_MAGIC,
                 (uint8_t)(write ? M_WRITE : M_READ_REQ),
                 {0},
                 o->id,
                 remote->region_id,
                 0,
                 (uint32_t)n,
                 0,
                 write ? total : 0};
    j->iov[0] = (struct iovec){h, sizeof(*h) + (size_t)n * sizeof(desc_t)};
    for (int i = 0; write && i < n; i++) {
        j->iov[1 + i] = (struct iovec){(char *)local->base + pages[i].local_off, pages[i].len};
    }
    pd_list_add_tail(&t->ops, &o->link);
    t->writes += write;
    enqueue(t, j);
    pthread_mutex_unlock(&t->mu);
    return PD_OK;
}

static pd_status_t tcp_write_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                                   pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                   pd_pipe_done_cb cb, void *arg)
{
    return post_pages(true, p, peer, local, remote, pages, n, cb, arg);
}

static pd_status_t tcp_read_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                                  pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                  pd_pipe_done_cb cb, void *arg)
{
    return post_pages(false, p, peer, local, remote, pages, n, cb, arg);
}

static pd_status_t tcp_send_tensor(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, const void *hdr,
                                   size_t hdr_len, const void *payload, size_t payload_len,
                                   pd_pipe_done_cb cb, void *arg)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    if (hdr_len > UINT32_MAX || hdr_len > t->max_msg || payload_len > t->max_msg) {
        return PD_ERR_INVALID_ARG;
    }
    op_t *o = calloc(1, sizeof(*o));
    job_t *j = job_new(peer, 3, sizeof(hdr_t));
    if (o == NULL || j == NULL) {
        free(o);
        if (j != NULL) {
            job_free(j);
        }
        return PD_ERR_NO_MEMORY;
    }
    o->kind = OP_SEND;
    o->peer = peer;
    o->done = cb;
    o->arg = arg;
    hdr_t *h = j->owned;
    *h = (hdr_t){TCP_MAGIC, M_TENSOR, {0}, tag, 0, 0, (uint32_t)hdr_len, 0, payload_len};
    j->iov[0] = (struct iovec){h, sizeof(*h)};
    j->iov[1] = (struct iovec){(void *)hdr, hdr_len};
    j->iov[2] = (struct iovec){(void *)payload, payload_len};
    j->complete_on_send = o;
    pthread_mutex_lock(&t->mu);
    if (peer->dead || peer->out_fd < 0) {
        free(o);
        job_free(j);
        fail_now(t, cb, NULL, arg, tag);
    } else {
        enqueue(t, j);
    }
    pthread_mutex_unlock(&t->mu);
    return PD_OK;
}

static pd_status_t tcp_recv_tensor(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, void *hdr,
                                   size_t hdr_cap, void *payload, size_t payload_cap, pd_pipe_recv_cb cb,
                                   void *arg)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    unexpected_t *u;
    pd_list_for_each (u, &peer->unexpected, link) {
        if (u->tag != tag) {
            continue;
        }
        pd_list_del(&u->link);
        pd_status_t st = PD_OK;
        if (u->hdr_len <= hdr_cap && u->payload_len <= payload_cap) {
            memcpy(hdr, u->hdr, u->hdr_len);
            memcpy(payload, u->payload, u->payload_len);
        } else {
            st = PD_ERR_NO_SPACE;
        }
        pd_pipe_completion_t c = {NULL, cb, NULL, NULL, arg, st, tag, u->hdr_len, u->payload_len, NULL};
        complete(t, c);
        unexpected_free(u);
        pthread_mutex_unlock(&t->mu);
        return PD_OK;
    }
    if (peer->dead) {
        fail_now(t, NULL, cb, arg, tag);
        pthread_mutex_unlock(&t->mu);
        return PD_OK;
    }
    op_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        pthread_mutex_unlock(&t->mu);
        return PD_ERR_NO_MEMORY;
    }
    o->kind = OP_RECV;
    o->peer = peer;
    o->recv_cb = cb;
    o->arg = arg;
    o->tag = tag;
    o->hbuf = hdr;
    o->hcap = hdr_cap;
    o->pbuf = payload;
    o->pcap = payload_cap;
    pd_list_add_tail(&t->ops, &o->link); /* FIFO among posted receives of the same tag */
    pthread_mutex_unlock(&t->mu);
    return PD_OK;
}

static void tcp_set_peer_error_cb(pd_pipe_t *p, pd_pipe_peer_error_cb cb, void *arg)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    t->peer_cb = cb;
    t->peer_cb_arg = arg;
    pthread_mutex_unlock(&t->mu);
}

static void tcp_fail_peer(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_status_t st)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    mark_dead(t, peer, st);
    pthread_mutex_unlock(&t->mu);
}

static void tcp_release_peer(pd_pipe_t *p, pd_pipe_peer_t *peer)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    mark_dead(t, peer, PD_ERR_PEER_GONE);
    peer->released = true;
    pthread_mutex_unlock(&t->mu);
    if (t->wake_fd >= 0) { /* the rx thread frees it between two batches of events */
        uint64_t one = 1;
        ssize_t w = write(t->wake_fd, &one, sizeof(one));
        (void)w;
    }
}

const pd_pipe_ops_t pd_pipe_tcp_ops = {
    .name = "tcp",
    .create = tcp_create,
    .destroy = tcp_destroy,
    .address = tcp_address,
    .connect = tcp_connect,
    .alloc_region = tcp_alloc_region,
    .register_region = tcp_register_region,
    .deregister_region = tcp_deregister_region,
    .export_region = tcp_export_region,
    .import_region = tcp_import_region,
    .release_remote = tcp_release_remote,
    .write_pages = tcp_write_pages,
    .read_pages = tcp_read_pages,
    .send_tensor = tcp_send_tensor,
    .recv_tensor = tcp_recv_tensor,
    .progress = tcp_progress,
    .wait_fd = tcp_wait_fd,
    .set_peer_error_cb = tcp_set_peer_error_cb,
    .fail_peer = tcp_fail_peer,
    .release_peer = tcp_release_peer,
};
