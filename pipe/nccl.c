/* pipe/nccl.c — the NCCL pipe (built with CUDA + NCCL): KV pages between GPU regions with grouped
 * ncclSend / ncclRecv, descriptors and acknowledgements on a TCP pipe beside it.
 *
 * Per peer, two 2-rank communicators, one per direction (this side sends on `send_comm` as rank
 * 0 and receives on `recv_comm` as rank 1), each bootstrapped from the sending side's
 * ncclUniqueId carried in the address blob, initialised non-blocking (ncclCommInitRankConfig
 * with blocking = 0) and polled by progress with a deadline; one stream per direction.
 *
 * Ordering rule (NCCL matches point-to-point operations by order): every batch of sends is first
 * announced on the TCP pipe (one tag, so announcements arrive in order) and issued on the send
 * stream in announcement order; the receiver posts the matching receives when the announcement
 * arrives. write_pages: WRITE_ANNOUNCE, sends; the target validates (region, bounds, write
 * permission), receives, records an event and answers WRITE_ACK when it completes.
 * read_pages: READ_REQUEST; the target validates and answers READ_ANNOUNCE (or an error), then
 * sends; the initiator receives and completes on its event. A peer announcing pages outside what
 * it may touch, an asynchronous NCCL error, or fail_peer aborts both communicators
 * (ncclCommAbort) and fails every pending operation with that peer.
 * Regions are device memory (cudaMalloc, or registered PD_MEM_CUDA). Tensors go over the TCP
 * pipe (host memory). */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/array.h"
#include "common/list.h"
#include "common/log.h"
#include "common/time.h"
#include "pipe/completion.h"
#include "pipe/pipe.h"

#define NCCL_ADDR_MAGIC 0x4c43434e64700001ull /* "pdNCCL" v1 */
#define TAG_DESC        (1ull << 46)          /* above every user tag the TCP pipe carries for us */
#define MAX_RANGES      (1 << 18)
#define INIT_TIMEOUT_S  30.0
#define TAG_USER_LIMIT  (1ull << 46)

enum { D_WRITE_ANNOUNCE = 1, D_WRITE_ACK = 2, D_READ_REQUEST = 3, D_READ_ANNOUNCE = 4 };

typedef struct ndesc {
    uint32_t kind;
    uint32_t region_id;
    uint64_t op_id;
    uint32_t n; /* ranges in the payload: (offset, length) pairs of uint64 */
    int32_t status;
} ndesc_t;

typedef struct nccl_pipe nccl_pipe_t;
typedef struct nop nop_t;

struct pd_pipe_peer {
    nccl_pipe_t *pipe;
    uint64_t id;
    pd_pipe_peer_t *inner; /* the TCP pipe's peer (opaque here) */
    ncclComm_t send_comm, recv_comm;
    cudaStream_t send_stream, recv_stream;
    bool send_ready, recv_ready, dead; /* each communicator's init confirmed */
    double init_deadline;
    pd_list_link_t recvq; /* nop_t (recv_link): receives waiting for recv_comm, in announcement order */
    ndesc_t rx_hdr;       /* the standing descriptor receive */
    uint64_t *rx_ranges;
    pd_list_link_t held; /* nop_t: sends waiting for the communicators, in announcement order */
    pd_list_link_t link; /* on nccl_pipe_t.peers */
};

typedef struct nregion {
    struct pd_pipe_region pub;
    uint32_t id;
    bool owned;
} nregion_t;

struct pd_pipe_remote {
    pd_pipe_peer_t *peer;
    uint32_t region_id;
    uint64_t len;
};

typedef struct nperm {
    uint32_t region_id;
    pd_pipe_peer_t *peer;
    bool write;
    pd_list_link_t link;
} nperm_t;

/* An operation in flight: ours (write waiting for its ack, read waiting for data) or a target's
 * receive waiting to be acknowledged. */
struct nop {
    enum { O_WRITE, O_READ, O_TARGET_RECV, O_HELD_SEND } kind;
    uint64_t id;
    pd_pipe_peer_t *peer;
    pd_pipe_done_cb cb;
    void *arg;
    nregion_t *local;
    uint64_t *ranges; /* (local offset, length) pairs */
    uint32_t n;
    cudaEvent_t ev;
    bool ev_armed;
    nregion_t *recv_region;   /* a receive waiting for recv_comm: into this region */
    pd_list_link_t recv_link; /* on its peer's recvq (while it is also on ops) */
    pd_list_link_t link;      /* on nccl_pipe_t.ops, or its peer's held (O_HELD_SEND) */
};

struct nccl_pipe {
    struct pd_pipe base;
    pd_pipe_t *ctl;
    uint64_t id;
    ncclUniqueId uid;
    pthread_mutex_t mu;
    pd_pipe_cq_t cq;
    pd_list_link_t peers; /* pd_pipe_peer_t */
    nregion_t **regions;
    size_t num_regions, cap_regions;
    pd_list_link_t perms; /* nperm_t */
    pd_list_link_t ops;   /* nop_t */
    uint64_t next_op;
    pd_pipe_peer_error_cb peer_cb;
    void *peer_cb_arg;
};

#define NCCL_CHECK(call, what)                                                                               \
    do {                                                                                                     \
        ncclResult_t r_ = (call);                                                                            \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                                     \
            pd_log_error("nccl pipe: %s: %s", what, ncclGetErrorString(r_));                                 \
            return PD_ERR_IO;                                                                                \
        }                                                                                                    \
    } while (0)

static void complete(nccl_pipe_t *t, pd_pipe_done_cb cb, void *arg, pd_status_t st)
{
    pd_pipe_completion_t c = {cb, NULL, NULL, NULL, arg, st, 0, 0, 0, NULL};
    pd_pipe_cq_push(&t->cq, &c);
}

static void op_free(nop_t *o)
{
    if (o->ev_armed || o->ev != NULL) {
        cudaEventDestroy(o->ev);
    }
    free(o->ranges);
    free(o);
}

/* The peer is gone: abort its communicators, fail everything pending with it. mu held. */
static void peer_dead(nccl_pipe_t *t, pd_pipe_peer_t *pe, pd_status_t st)
{
    if (pe->dead) {
        return;
    }
    pe->dead = true;
    pd_log_warn("nccl pipe: peer %016llx is gone (%s); aborting its communicators",
                (unsigned long long)pe->id, pd_status_str(st));
    if (pe->send_comm != NULL) {
        ncclCommAbort(pe->send_comm);
        pe->send_comm = NULL;
    }
    if (pe->recv_comm != NULL) {
        ncclCommAbort(pe->recv_comm);
        pe->recv_comm = NULL;
    }
    nop_t *o, *tmp;
    pd_list_for_each_safe (o, tmp, &t->ops, link) {
        if (o->peer == pe) {
            pd_list_del(&o->link);
            if (o->cb != NULL) {
                complete(t, o->cb, o->arg, st);
            }
            op_free(o);
        }
    }
    while ((o = pd_list_pop_head(&pe->held, nop_t, link)) != NULL) {
        op_free(o);
    }
    pd_list_head_init(&pe->recvq); /* those ops were in t->ops, freed above */
    if (t->peer_cb != NULL) {
        pd_pipe_completion_t c = {NULL, NULL, t->peer_cb, pe, t->peer_cb_arg, st, 0, 0, 0, NULL};
        pd_pipe_cq_push(&t->cq, &c);
    }
    t->ctl->ops->fail_peer(t->ctl, pe->inner, st);
}

/* ------------------------------------------------------------------ data movement */

/* Issues one grouped batch of sends (pages of region r) on the peer's send stream. mu held. */
static pd_status_t issue_sends(pd_pipe_peer_t *pe, nregion_t *r, const uint64_t *ranges, uint32_t n)
{
    NCCL_CHECK(ncclGroupStart(), "group start");
    for (uint32_t i = 0; i < n; i++) {
        NCCL_CHECK(ncclSend((char *)r->pub.base + ranges[2 * i], ranges[2 * i + 1], ncclUint8, 1,
                            pe->send_comm, pe->send_stream),
                   "send");
    }
    NCCL_CHECK(ncclGroupEnd(), "group end");
    return PD_OK;
}

/* Posts receives into region r and arms o's event. mu held. */
static pd_status_t issue_recvs(pd_pipe_peer_t *pe, nregion_t *r, const uint64_t *ranges, uint32_t n, nop_t *o)
{
    NCCL_CHECK(ncclGroupStart(), "group start");
    for (uint32_t i = 0; i < n; i++) {
        NCCL_CHECK(ncclRecv((char *)r->pub.base + ranges[2 * i], ranges[2 * i + 1], ncclUint8, 0,
                            pe->recv_comm, pe->recv_stream),
                   "recv");
    }
    NCCL_CHECK(ncclGroupEnd(), "group end");
    if (cudaEventCreateWithFlags(&o->ev, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(o->ev, pe->recv_stream) != cudaSuccess) {
        pd_log_error("nccl pipe: cannot record a completion event");
        return PD_ERR_BACKEND;
    }
    o->ev_armed = true;
    return PD_OK;
}

/* Receives now, or once recv_comm is confirmed (order kept). mu held. */
static pd_status_t recv_or_hold(pd_pipe_peer_t *pe, nregion_t *r, nop_t *o)
{
    if (pe->recv_ready && pd_list_is_empty(&pe->recvq)) {
        return issue_recvs(pe, r, o->ranges, o->n, o);
    }
    o->recv_region = r;
    pd_list_add_tail(&pe->recvq, &o->recv_link);
    return PD_OK;
}

/* Receives queued while recv_comm was initialising. mu held. */
static void flush_held_recvs(nccl_pipe_t *t, pd_pipe_peer_t *pe)
{
    while (!pd_list_is_empty(&pe->recvq) && pe->recv_ready && !pe->dead) {
        nop_t *o = pd_list_pop_head(&pe->recvq, nop_t, recv_link);
        pd_status_t st = issue_recvs(pe, o->recv_region, o->ranges, o->n, o);
        if (st != PD_OK) {
            peer_dead(t, pe, st);
        }
    }
}

/* Sends queued while the communicators were initialising. mu held. */
static void flush_held(nccl_pipe_t *t, pd_pipe_peer_t *pe)
{
    while (!pd_list_is_empty(&pe->held) && pe->send_ready && !pe->dead) {
        nop_t *o = pd_list_pop_head(&pe->held, nop_t, link);
        pd_status_t st = issue_sends(pe, o->local, o->ranges, o->n);
        op_free(o);
        if (st != PD_OK) {
            peer_dead(t, pe, st);
        }
    }
}

/* Sends a batch now or, before the communicators are up, later (order kept). mu held. */
static pd_status_t send_or_hold(nccl_pipe_t *t, pd_pipe_peer_t *pe, nregion_t *r, uint64_t *ranges,
                                uint32_t n)
{
    if (pe->send_ready && pd_list_is_empty(&pe->held)) {
        pd_status_t st = issue_sends(pe, r, ranges, n);
        free(ranges);
        return st;
    }
    nop_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        free(ranges);
        return PD_ERR_NO_MEMORY;
    }
    o->kind = O_HELD_SEND;
    o->local = r;
    o->ranges = ranges;
    o->n = n;
    pd_list_add_tail(&pe->held, &o->link);
    (void)t;
    return PD_OK;
}

static pd_status_t send_desc(nccl_pipe_t *t, pd_pipe_peer_t *pe, const ndesc_t *d, const uint64_t *ranges)
{
    return t->ctl->ops->send_tensor(t->ctl, pe->inner, TAG_DESC, d, sizeof(*d), ranges,
                                    (size_t)d->n * 2 * sizeof(uint64_t), NULL, NULL);
}

static nregion_t *region_by_id(nccl_pipe_t *t, uint32_t id)
{
    return id < t->num_regions ? t->regions[id] : NULL;
}

static bool allowed(nccl_pipe_t *t, uint32_t region_id, pd_pipe_peer_t *pe, bool write)
{
    nperm_t *p;
    pd_list_for_each (p, &t->perms, link) {
        if (p->region_id == region_id && p->peer == pe && (p->write || !write)) {
            return true;
        }
    }
    return false;
}

/* Every range inside region r, without overflow. */
static bool ranges_ok(const nregion_t *r, const uint64_t *ranges, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = ranges[2 * i], len = ranges[2 * i + 1];
        if (len == 0 || off > r->pub.len || len > r->pub.len - off) {
            return false;
        }
    }
    return true;
}

static void post_desc_recv(nccl_pipe_t *t, pd_pipe_peer_t *pe);

/* D_WRITE_ANNOUNCE: pe's sends into region r are already on the wire; post the matching receives.
 * Takes ownership of ranges. Returns non-OK when pe must be dropped. Called with t->mu held. */
static pd_status_t on_write_announce(nccl_pipe_t *t, pd_pipe_peer_t *pe, const ndesc_t *d, uint64_t *ranges)
{
    nregion_t *r = region_by_id(t, d->region_id);
    if (r == NULL || !allowed(t, d->region_id, pe, true) || !ranges_ok(r, ranges, d->n)) {
        /* its sends are already on the wire: the only safe answer is to drop the peer */
        pd_log_error("nccl pipe: peer %016llx announced a write outside what it may touch",
                     (unsigned long long)pe->id);
        free(ranges);
        return PD_ERR_OUT_OF_RANGE;
    }
    nop_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        free(ranges);
        return PD_ERR_NO_MEMORY;
    }
    o->kind = O_TARGET_RECV;
    o->id = d->op_id;
    o->peer = pe;
    o->ranges = ranges;
    o->n = d->n;
    pd_list_add_tail(&t->ops, &o->link);
    return recv_or_hold(pe, r, o);
}

/* D_WRITE_ACK or D_READ_ANNOUNCE: pe answers one of our own writes or reads. A write ack or a refused read
 * completes the op; an accepted read posts the receives for the data that follows. Called with t->mu held. */
static pd_status_t on_op_reply(nccl_pipe_t *t, pd_pipe_peer_t *pe, const ndesc_t *d)
{
    nop_t *o = NULL, *x;
    pd_list_for_each (x, &t->ops, link) {
        if (x->peer == pe && x->id == d->op_id && (x->kind == O_WRITE || x->kind == O_READ)) {
            o = x;
            break;
        }
    }
    if (o == NULL || (d->kind == D_WRITE_ACK) != (o->kind == O_WRITE)) {
        return PD_ERR_PARSE;
    }
    if (d->kind == D_WRITE_ACK || d->status != PD_OK) {
        pd_list_del(&o->link);
        complete(t, o->cb, o->arg, (pd_status_t)d->status);
        op_free(o);
        return PD_OK;
    }
    return recv_or_hold(pe, o->local, o); /* the data follows this announcement */
}

/* D_READ_REQUEST: pe asks for ranges of region r. Answer with a D_READ_ANNOUNCE (refused when outside what pe
 * may read) and send the data. Takes ownership of ranges. Called with t->mu held. */
static pd_status_t on_read_request(nccl_pipe_t *t, pd_pipe_peer_t *pe, const ndesc_t *d, uint64_t *ranges)
{
    nregion_t *r = region_by_id(t, d->region_id);
    ndesc_t a = {D_READ_ANNOUNCE, d->region_id, d->op_id, 0, PD_OK};
    if (r == NULL || !allowed(t, d->region_id, pe, false) || !ranges_ok(r, ranges, d->n)) {
        pd_log_warn("nccl pipe: refused a read from peer %016llx outside its regions",
                    (unsigned long long)pe->id);
        a.status = PD_ERR_OUT_OF_RANGE;
        free(ranges);
        return send_desc(t, pe, &a, NULL) == PD_OK ? PD_OK : PD_ERR_PEER_GONE;
    }
    if (send_desc(t, pe, &a, NULL) != PD_OK) {
        free(ranges);
        return PD_ERR_PEER_GONE;
    }
    return send_or_hold(t, pe, r, ranges, d->n);
}

/* Copy of the received page list of descriptor d (NULL when it has none); *st says why it failed. */
static uint64_t *desc_ranges(pd_pipe_peer_t *pe, const ndesc_t *d, size_t hlen, size_t plen, pd_status_t *st)
{
    *st = PD_OK;
    if (hlen != sizeof(*d) || plen != (size_t)d->n * 2 * sizeof(uint64_t) || d->n > MAX_RANGES) {
        pd_log_error("nccl pipe: malformed descriptor from peer %016llx", (unsigned long long)pe->id);
        *st = PD_ERR_PARSE;
        return NULL;
    }
    if (d->n == 0) {
        return NULL;
    }
    uint64_t *ranges = malloc(plen);
    if (ranges == NULL) {
        *st = PD_ERR_NO_MEMORY;
        return NULL;
    }
    memcpy(ranges, pe->rx_ranges, plen);
    return ranges;
}

/* A descriptor from pe arrived (TCP pipe callback, inside progress). */
static void on_desc(void *arg, pd_status_t st, uint64_t tag, size_t hlen, size_t plen)
{
    (void)tag;
    pd_pipe_peer_t *pe = arg;
    nccl_pipe_t *t = pe->pipe;
    pthread_mutex_lock(&t->mu);
    if (st != PD_OK || pe->dead) {
        if (!pe->dead) {
            peer_dead(t, pe, st);
        }
        pthread_mutex_unlock(&t->mu);
        return;
    }
    ndesc_t d = pe->rx_hdr;
    pd_status_t res;
    uint64_t *ranges = desc_ranges(pe, &d, hlen, plen, &res);
    if (res == PD_OK) {
        switch (d.kind) {
        case D_WRITE_ANNOUNCE: res = on_write_announce(t, pe, &d, ranges); break;
        case D_WRITE_ACK:
        case D_READ_ANNOUNCE:
            free(ranges);
            res = on_op_reply(t, pe, &d);
            break;
        case D_READ_REQUEST: res = on_read_request(t, pe, &d, ranges); break;
        default:
            free(ranges);
            res = PD_ERR_PARSE;
            break;
        }
    }
    if (res != PD_OK) {
        peer_dead(t, pe, res);
    }
    bool dead = pe->dead;
    pthread_mutex_unlock(&t->mu);
    if (!dead) {
        post_desc_recv(t, pe);
    }
}

static void post_desc_recv(nccl_pipe_t *t, pd_pipe_peer_t *pe)
{
    if (t->ctl->ops->recv_tensor(t->ctl, pe->inner, TAG_DESC, &pe->rx_hdr, sizeof(pe->rx_hdr), pe->rx_ranges,
                                 (size_t)MAX_RANGES * 2 * sizeof(uint64_t), on_desc, pe) != PD_OK) {
        pthread_mutex_lock(&t->mu);
        peer_dead(t, pe, PD_ERR_NO_MEMORY);
        pthread_mutex_unlock(&t->mu);
    }
}

/* ------------------------------------------------------------------ progress */

/* Ops whose event fired complete: a target's receive is acknowledged to the writer, ours call back.
 * Returns how many ended. mu held. */
static int complete_landed(nccl_pipe_t *t)
{
    int n = 0;
    for (bool again = true; again;) {
        again = false;
        nop_t *o, *tmp;
        pd_list_for_each_safe (o, tmp, &t->ops, link) {
            cudaError_t e = o->ev_armed ? cudaEventQuery(o->ev) : cudaErrorNotReady;
            if (e == cudaErrorNotReady) {
                continue;
            }
            pd_list_del(&o->link);
            pd_status_t st = e == cudaSuccess ? PD_OK : PD_ERR_BACKEND;
            n++;
            if (o->kind == O_TARGET_RECV) {
                ndesc_t ack = {D_WRITE_ACK, 0, o->id, 0, st};
                if (send_desc(t, o->peer, &ack, NULL) != PD_OK) {
                    pd_pipe_peer_t *pe = o->peer;
                    op_free(o);
                    peer_dead(t, pe, PD_ERR_PEER_GONE); /* frees that peer's ops (maybe tmp): walk again */
                    again = true;
                    break;
                }
            } else if (o->cb != NULL) {
                complete(t, o->cb, o->arg, st);
            }
            op_free(o);
        }
    }
    return n;
}

static int nccl_progress(pd_pipe_t *p)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    int n = pd_pipe_progress(t->ctl); /* descriptors, acks, tensors */
    pthread_mutex_lock(&t->mu);
    double now = pd_time_now_s();
    pd_pipe_peer_t *pe;
    pd_list_for_each (pe, &t->peers, link) {
        if (pe->dead) {
            continue;
        }
        ncclResult_t a = ncclSuccess, b = ncclSuccess;
        ncclCommGetAsyncError(pe->send_comm, &a);
        ncclCommGetAsyncError(pe->recv_comm, &b);
        if ((a != ncclSuccess && a != ncclInProgress) || (b != ncclSuccess && b != ncclInProgress)) {
            pd_log_error("nccl pipe: %s with peer %016llx: %s",
                         pe->send_ready && pe->recv_ready ? "asynchronous error" : "communicator init failed",
                         (unsigned long long)pe->id,
                         ncclGetErrorString(a != ncclSuccess && a != ncclInProgress ? a : b));
            peer_dead(t, pe, PD_ERR_PEER_GONE);
            continue;
        }
        if (!pe->send_ready && a == ncclSuccess) {
            pe->send_ready = true;
            flush_held(t, pe);
        }
        if (!pe->recv_ready && b == ncclSuccess) {
            pe->recv_ready = true;
            flush_held_recvs(t, pe);
        }
        if ((!pe->send_ready || !pe->recv_ready) && now > pe->init_deadline) {
            pd_log_error("nccl pipe: communicator init with peer %016llx timed out",
                         (unsigned long long)pe->id);
            peer_dead(t, pe, PD_ERR_TIMEOUT);
        }
    }
    n += complete_landed(t);
    pd_pipe_completion_t *c = pd_pipe_cq_take(&t->cq);
    pthread_mutex_unlock(&t->mu);
    return n + pd_pipe_cq_run(c);
}

/* ------------------------------------------------------------------ lifecycle */

static pd_status_t nccl_create(const pd_pipe_config_t *cfg, pd_pipe_t **out)
{
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        pd_log_error("nccl pipe: no CUDA device");
        return PD_ERR_UNSUPPORTED;
    }
    nccl_pipe_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    t->base.ops = &pd_pipe_nccl_ops;
    pd_list_head_init(&t->peers);
    pd_list_head_init(&t->perms);
    pd_list_head_init(&t->ops);
    pthread_mutex_init(&t->mu, NULL);
    if (getrandom(&t->id, sizeof(t->id), 0) != (ssize_t)sizeof(t->id)) {
        t->id = pd_time_now_ns();
    }
    ncclResult_t r = ncclGetUniqueId(&t->uid);
    pd_pipe_config_t tc = *cfg;
    tc.kind = "tcp";
    pd_status_t st = r == ncclSuccess ? pd_pipe_tcp_ops.create(&tc, &t->ctl) : PD_ERR_IO;
    if (st != PD_OK) {
        pd_log_error("nccl pipe: cannot create its unique id or side channel");
        pthread_mutex_destroy(&t->mu);
        free(t);
        return st;
    }
    *out = &t->base;
    return PD_OK;
}

static void nccl_destroy(pd_pipe_t *p)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    pd_pipe_peer_t *pe;
    pd_list_for_each (pe, &t->peers, link) {
        peer_dead(t, pe, PD_ERR_CANCELLED);
    }
    nop_t *o;
    while ((o = pd_list_pop_head(&t->ops, nop_t, link)) != NULL) {
        if (o->cb != NULL) {
            complete(t, o->cb, o->arg, PD_ERR_CANCELLED);
        }
        op_free(o);
    }
    t->peer_cb = NULL;
    pd_pipe_completion_t *c = pd_pipe_cq_take(&t->cq);
    pthread_mutex_unlock(&t->mu);
    pd_pipe_cq_run(c);
    pd_pipe_destroy(t->ctl); /* cancels the standing descriptor receives */
    while ((pe = pd_list_pop_head(&t->peers, pd_pipe_peer_t, link)) != NULL) {
        if (pe->send_stream != NULL) {
            cudaStreamDestroy(pe->send_stream);
        }
        if (pe->recv_stream != NULL) {
            cudaStreamDestroy(pe->recv_stream);
        }
        free(pe->rx_ranges);
        free(pe);
    }
    for (uint32_t i = 0; i < t->num_regions; i++) {
        if (t->regions[i] != NULL) {
            if (t->regions[i]->owned) {
                cudaFree(t->regions[i]->pub.base);
            }
            free(t->regions[i]);
        }
    }
    free(t->regions);
    nperm_t *pm;
    while ((pm = pd_list_pop_head(&t->perms, nperm_t, link)) != NULL) {
        free(pm);
    }
    pd_pipe_cq_close(&t->cq);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* Address: magic | id | ncclUniqueId (for the comm this side sends on) | TCP pipe address. */
static pd_status_t nccl_address(pd_pipe_t *p, uint8_t *buf, size_t *len)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    size_t head = 16 + sizeof(ncclUniqueId);
    if (*len < head + 1) {
        return PD_ERR_NO_SPACE;
    }
    uint64_t magic = NCCL_ADDR_MAGIC;
    memcpy(buf, &magic, 8);
    memcpy(buf + 8, &t->id, 8);
    memcpy(buf + 16, &t->uid, sizeof(ncclUniqueId));
    size_t tl = *len - head;
    pd_status_t st = t->ctl->ops->address(t->ctl, buf + head, &tl);
    *len = head + tl;
    return st;
}

static pd_status_t nccl_connect(pd_pipe_t *p, const uint8_t *addr, size_t len, const uint8_t *session,
                                pd_pipe_peer_t **peer_out)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    size_t head = 16 + sizeof(ncclUniqueId);
    uint64_t magic = 0, id = 0;
    if (len <= head || (memcpy(&magic, addr, 8), magic != NCCL_ADDR_MAGIC)) {
        pd_log_error("nccl pipe: not an nccl pipe address");
        return PD_ERR_INVALID_ARG;
    }
    memcpy(&id, addr + 8, 8);
    ncclUniqueId peer_uid;
    memcpy(&peer_uid, addr + 16, sizeof(peer_uid));
    pd_pipe_peer_t *pe = calloc(1, sizeof(*pe));
    if (pe == NULL || (pe->rx_ranges = malloc((size_t)MAX_RANGES * 2 * sizeof(uint64_t))) == NULL) {
        free(pe);
        return PD_ERR_NO_MEMORY;
    }
    pthread_mutex_lock(&t->mu);
    pd_status_t rst = pd_pipe_cq_reserve(&t->cq); /* the node of its death's completion */
    pthread_mutex_unlock(&t->mu);
    if (rst != PD_OK) {
        free(pe->rx_ranges);
        free(pe);
        return rst;
    }
    pe->pipe = t;
    pe->id = id;
    pd_list_head_init(&pe->recvq);
    pd_list_head_init(&pe->held);
    pd_status_t st = t->ctl->ops->connect(t->ctl, addr + head, len - head, session, &pe->inner);
    if (st == PD_OK && (cudaStreamCreateWithFlags(&pe->send_stream, cudaStreamNonBlocking) != cudaSuccess ||
                        cudaStreamCreateWithFlags(&pe->recv_stream, cudaStreamNonBlocking) != cudaSuccess)) {
        st = PD_ERR_BACKEND;
    }
    if (st == PD_OK) {
        /* both communicators start non-blocking; progress polls them until the peer joins */
        ncclConfig_t c1 = NCCL_CONFIG_INITIALIZER, c2 = NCCL_CONFIG_INITIALIZER;
        c1.blocking = 0;
        c2.blocking = 0;
        ncclResult_t a = ncclCommInitRankConfig(&pe->send_comm, 2, t->uid, 0, &c1);
        ncclResult_t b = ncclCommInitRankConfig(&pe->recv_comm, 2, peer_uid, 1, &c2);
        if ((a != ncclSuccess && a != ncclInProgress) || (b != ncclSuccess && b != ncclInProgress)) {
            pd_log_error("nccl pipe: cannot start the communicators: %s",
                         ncclGetErrorString(a != ncclSuccess && a != ncclInProgress ? a : b));
            st = PD_ERR_IO;
        }
    }
    if (st != PD_OK) {
        if (pe->send_stream != NULL) {
            cudaStreamDestroy(pe->send_stream);
        }
        if (pe->recv_stream != NULL) {
            cudaStreamDestroy(pe->recv_stream);
        }
        free(pe->rx_ranges);
        free(pe);
        return st;
    }
    pe->init_deadline = pd_time_now_s() + INIT_TIMEOUT_S;
    pthread_mutex_lock(&t->mu);
    pd_list_add_tail(&t->peers, &pe->link);
    pthread_mutex_unlock(&t->mu);
    post_desc_recv(t, pe);
    *peer_out = pe;
    return PD_OK;
}

static pd_status_t add_region(nccl_pipe_t *t, void *base, size_t len, bool owned, pd_pipe_region_t **out)
{
    nregion_t *r = calloc(1, sizeof(*r));
    if (r == NULL || t->num_regions >= UINT32_MAX ||
        pd_array_reserve(&t->regions, &t->cap_regions, t->num_regions + 1) != PD_OK) {
        free(r);
        return PD_ERR_NO_MEMORY;
    }
    r->pub = (struct pd_pipe_region){base, len, PD_MEM_CUDA};
    r->id = (uint32_t)t->num_regions;
    r->owned = owned;
    t->regions[t->num_regions++] = r;
    *out = &r->pub;
    return PD_OK;
}

static pd_status_t nccl_alloc_region(pd_pipe_t *p, size_t len, pd_pipe_region_t **out)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    void *d = NULL;
    if (cudaMalloc(&d, len) != cudaSuccess) {
        pd_log_error("nccl pipe: cudaMalloc of %zu bytes failed", len);
        return PD_ERR_NO_MEMORY;
    }
    pthread_mutex_lock(&t->mu);
    pd_status_t st = add_region(t, d, len, true, out);
    pthread_mutex_unlock(&t->mu);
    if (st != PD_OK) {
        cudaFree(d);
    }
    return st;
}

static pd_status_t nccl_register_region(pd_pipe_t *p, void *base, size_t len, pd_mem_type_t mem,
                                        pd_pipe_region_t **out)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    if (mem != PD_MEM_CUDA) {
        pd_log_error("nccl pipe: regions must be CUDA device memory (stage host KV through another pipe)");
        return PD_ERR_UNSUPPORTED;
    }
    pthread_mutex_lock(&t->mu);
    pd_status_t st = add_region(t, base, len, false, out);
    pthread_mutex_unlock(&t->mu);
    return st;
}

static void nccl_deregister_region(pd_pipe_t *p, pd_pipe_region_t *r)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    nregion_t *nr = (nregion_t *)r;
    pthread_mutex_lock(&t->mu);
    t->regions[nr->id] = NULL;
    pthread_mutex_unlock(&t->mu);
    if (nr->owned) {
        cudaFree(nr->pub.base);
    }
    free(nr);
}

/* Export blob: region id and length; permission is recorded for that peer. */
static pd_status_t nccl_export_region(pd_pipe_t *p, pd_pipe_region_t *r, pd_pipe_peer_t *pe, bool allow_write,
                                      uint8_t *buf, size_t *len)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    nregion_t *nr = (nregion_t *)r;
    if (*len < 12) {
        return PD_ERR_NO_SPACE;
    }
    nperm_t *pm = calloc(1, sizeof(*pm));
    if (pm == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pm->region_id = nr->id;
    pm->peer = pe;
    pm->write = allow_write;
    pthread_mutex_lock(&t->mu);
    pd_list_add_tail(&t->perms, &pm->link);
    pthread_mutex_unlock(&t->mu);
    uint64_t l = nr->pub.len;
    memcpy(buf, &nr->id, 4);
    memcpy(buf + 4, &l, 8);
    *len = 12;
    return PD_OK;
}

static pd_status_t nccl_import_region(pd_pipe_t *p, pd_pipe_peer_t *pe, const uint8_t *buf, size_t len,
                                      pd_pipe_remote_t **out)
{
    (void)p;
    if (len != 12) {
        return PD_ERR_INVALID_ARG;
    }
    pd_pipe_remote_t *rr = calloc(1, sizeof(*rr));
    if (rr == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    rr->peer = pe;
    memcpy(&rr->region_id, buf, 4);
    memcpy(&rr->len, buf + 4, 8);
    *out = rr;
    return PD_OK;
}

static void nccl_release_remote(pd_pipe_t *p, pd_pipe_remote_t *rr)
{
    (void)p;
    free(rr);
}

static pd_status_t post_pages(bool write, pd_pipe_t *p, pd_pipe_peer_t *pe, pd_pipe_region_t *local,
                              pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                              pd_pipe_done_cb cb, void *arg)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    pd_status_t st = pd_pipe_check_pages(pages, n, local->len, remote->len);
    if (st != PD_OK) {
        return st;
    }
    if (n > MAX_RANGES) {
        pd_log_error("nccl pipe: %d ranges in one operation, at most %d", n, MAX_RANGES);
        return PD_ERR_NO_SPACE;
    }
    uint64_t *rem = malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(uint64_t));
    uint64_t *loc = malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(uint64_t));
    nop_t *o = calloc(1, sizeof(*o));
    if (rem == NULL || loc == NULL || o == NULL) {
        free(rem), free(loc), free(o);
        return PD_ERR_NO_MEMORY;
    }
    for (int i = 0; i < n; i++) {
        rem[2 * i] = pages[i].remote_off;
        rem[2 * i + 1] = pages[i].len;
        loc[2 * i] = pages[i].local_off;
        loc[2 * i + 1] = pages[i].len;
    }
    pthread_mutex_lock(&t->mu);
    if (pd_pipe_cq_reserve(&t->cq) != PD_OK) {
        pthread_mutex_unlock(&t->mu);
        free(rem), free(loc), free(o);
        return PD_ERR_NO_MEMORY;
    }
    if (pe->dead) {
        complete(t, cb, arg, PD_ERR_PEER_GONE);
        pthread_mutex_unlock(&t->mu);
        free(rem), free(loc), free(o);
        return PD_OK;
    }
    o->kind = write ? O_WRITE : O_READ;
    o->id = ++t->next_op;
    o->peer = pe;
    o->cb = cb;
    o->arg = arg;
    o->local = (nregion_t *)local;
    o->ranges = loc;
    o->n = (uint32_t)n;
    pd_list_add_tail(&t->ops, &o->link);
    ndesc_t d = {write ? D_WRITE_ANNOUNCE : D_READ_REQUEST, remote->region_id, o->id, (uint32_t)n, PD_OK};
    st = send_desc(t, pe, &d, rem);
    free(rem);
    if (st == PD_OK && write) {
        uint64_t *copy = malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(uint64_t));
        if (copy == NULL) {
            st = PD_ERR_NO_MEMORY;
        } else {
            memcpy(copy, loc, (size_t)n * 2 * sizeof(uint64_t));
            st = send_or_hold(t, pe, o->local, copy, (uint32_t)n); /* completes on the target's ack */
        }
    }
    if (st != PD_OK) {
        peer_dead(t, pe, st); /* the announcement may be out: the streams cannot be trusted */
    }
    pthread_mutex_unlock(&t->mu);
    return PD_OK;
}

static pd_status_t nccl_write_pages(pd_pipe_t *p, pd_pipe_peer_t *pe, pd_pipe_region_t *local,
                                    pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                    pd_pipe_done_cb cb, void *arg)
{
    return post_pages(true, p, pe, local, remote, pages, n, cb, arg);
}

static pd_status_t nccl_read_pages(pd_pipe_t *p, pd_pipe_peer_t *pe, pd_pipe_region_t *local,
                                   pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                   pd_pipe_done_cb cb, void *arg)
{
    return post_pages(false, p, pe, local, remote, pages, n, cb, arg);
}

static pd_status_t nccl_send_tensor(pd_pipe_t *p, pd_pipe_peer_t *pe, uint64_t tag, const void *hdr,
                                    size_t hdr_len, const void *payload, size_t payload_len,
                                    pd_pipe_done_cb cb, void *arg)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    if (tag >= TAG_USER_LIMIT) {
        return PD_ERR_INVALID_ARG;
    }
    return t->ctl->ops->send_tensor(t->ctl, pe->inner, tag, hdr, hdr_len, payload, payload_len, cb, arg);
}

static pd_status_t nccl_recv_tensor(pd_pipe_t *p, pd_pipe_peer_t *pe, uint64_t tag, void *hdr, size_t hdr_cap,
                                    void *payload, size_t payload_cap, pd_pipe_recv_cb cb, void *arg)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    if (tag >= TAG_USER_LIMIT) {
        return PD_ERR_INVALID_ARG;
    }
    return t->ctl->ops->recv_tensor(t->ctl, pe->inner, tag, hdr, hdr_cap, payload, payload_cap, cb, arg);
}

static void nccl_set_peer_error_cb(pd_pipe_t *p, pd_pipe_peer_error_cb cb, void *arg)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    t->peer_cb = cb;
    t->peer_cb_arg = arg;
    pthread_mutex_unlock(&t->mu);
}

static void nccl_fail_peer(pd_pipe_t *p, pd_pipe_peer_t *pe, pd_status_t st)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    peer_dead(t, pe, st);
    pthread_mutex_unlock(&t->mu);
}

/* Its communicators were aborted at death; the tensor channel's peer (the inner tcp pipe) is given
 * back. The nccl record itself (streams, a few hundred bytes) stays until the pipe goes: the
 * standing descriptor receive may still name it. */
static void nccl_release_peer(pd_pipe_t *p, pd_pipe_peer_t *pe)
{
    nccl_pipe_t *t = (nccl_pipe_t *)p;
    nccl_fail_peer(p, pe, PD_ERR_PEER_GONE);
    if (pe->inner != NULL && t->ctl->ops->release_peer != NULL) {
        t->ctl->ops->release_peer(t->ctl, pe->inner);
        pe->inner = NULL;
    }
}

const pd_pipe_ops_t pd_pipe_nccl_ops = {
    .name = "nccl",
    .create = nccl_create,
    .destroy = nccl_destroy,
    .address = nccl_address,
    .connect = nccl_connect,
    .alloc_region = nccl_alloc_region,
    .register_region = nccl_register_region,
    .deregister_region = nccl_deregister_region,
    .export_region = nccl_export_region,
    .import_region = nccl_import_region,
    .release_remote = nccl_release_remote,
    .write_pages = nccl_write_pages,
    .read_pages = nccl_read_pages,
    .send_tensor = nccl_send_tensor,
    .recv_tensor = nccl_recv_tensor,
    .progress = nccl_progress,
    .set_peer_error_cb = nccl_set_peer_error_cb,
    .fail_peer = nccl_fail_peer,
    .release_peer = nccl_release_peer,
};
