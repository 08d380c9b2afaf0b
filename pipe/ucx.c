/* pipe/ucx.c — the UCX pipe (UCP nbx API, UCX 1.13): one-sided page writes/reads with
 * ucp_put_nbx / ucp_get_nbx on memory mapped with ucp_mem_map (allocated by UCX when the pipe
 * owns the region, so shared-memory transports can put without the target progressing), packed
 * rkeys, completion on ucp_ep_flush_nbx — or, when UCX maps the peer's region here (ucp_rkey_ptr,
 * shared memory), copies through that mapping in bounded slices per progress call; tensors as two
 * tagged messages (lengths + header, then payload). A progress thread sleeps on the worker's
 * event fd (ucp_worker_get_efd / arm: no spin when idle); callbacks only queue completions, which
 * pd_pipe_progress delivers.
 *
 * Error mode (pd_pipe_config_t.ucx_err_mode): "none" (default) lets UCX use shared memory but a
 * dead peer is noticed only through fail_peer (the control channel's heartbeat); "peer" enables
 * UCP_ERR_HANDLING_MODE_PEER, which on UCX 1.13 excludes shared memory (emulated RMA over TCP,
 * ~0.9 GB/s here) but reports peer failures itself. Caveat measured here: in that emulated RMA
 * the target answers every put/get; when the initiator's endpoint disappears mid-transfer UCX 1.13
 * treats the failed answer as fatal and aborts the target process. pd_pipe_destroy therefore
 * flushes endpoints before closing them; a SIGKILLed initiator can still take a peer-mode target
 * down, which "none" mode (one-sided shared memory) does not risk. Tensor tags: 47 bits. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include "common/copy.h"
#include "common/hash.h"
#include "common/list.h"
#include "common/log.h"
#include "common/time.h"
#include "pipe/completion.h"
#include "pipe/pipe.h"

#define TAG_USER_MASK ((1ull << 47) - 1)

typedef struct ucx_pipe ucx_pipe_t;

struct pd_pipe_peer {
    ucx_pipe_t *pipe;
    uint64_t id;
    uint16_t hash16; /* this peer's tag prefix */
    ucp_ep_h ep;
    bool dead;
    bool released;       /* the user gave it up: freed once no op or copy refers to it */
    pd_list_link_t link; /* on ucx_pipe_t.peers */
};

typedef struct ucx_region {
    struct pd_pipe_region pub;
    ucp_mem_h memh;
    bool owned;
    pd_list_link_t link; /* on ucx_pipe_t.regions, unmapped at destroy */
} ucx_region_t;

struct pd_pipe_remote {
    pd_pipe_peer_t *peer;
    uint64_t base;
    uint64_t len;
    ucp_rkey_h rkey;
    /* shared-memory rkeys map the peer's region here (ucp_rkey_ptr): host pages are copied
     * straight through it, without a UCX operation per page (NULL: puts/gets + flush). A thread
     * touches every page once so transfers do not pay a first-access fault per 4 KiB (measured:
     * ~5 µs each on this VM, which held reads of fresh KV blocks to ~1 GB/s). */
    char *direct;
    pthread_t warm;
    bool warming, warm_stop;
};

static void *warm_main(void *arg)
{
    pd_pipe_remote_t *rr = arg;
    volatile const char *p = rr->direct;
    double t0 = pd_time_now_s();
    uint64_t off = 0;
    for (; off < rr->len && !__atomic_load_n(&rr->warm_stop, __ATOMIC_RELAXED); off += 4096) {
        (void)p[off];
    }
    if (off >= rr->len) {
        pd_log_info("ucx pipe: mapped %.2f GiB of a peer's region in %.1f s", (double)rr->len / (1u << 30),
                    pd_time_now_s() - t0);
    }
    return NULL;
}

enum { OP_PAGES, OP_SEND, OP_RECV };

typedef struct op op_t;

/* One posted tagged receive of a RECV op; req is kept (under mu) until the callback, so a
 * receive nobody matched can be cancelled at destroy. */
typedef struct recv_part {
    op_t *op;
    void *req;
    bool done;
} recv_part_t;
struct op {
    int kind;
    pd_pipe_peer_t *peer;
    pd_pipe_done_cb done;
    pd_pipe_recv_cb recv_cb;
    void *arg;
    int pending;   /* UCX callbacks still to come */
    bool reported; /* the user was told (fail_peer / destroy can report first) */
    pd_status_t st;
    uint64_t tag;
    uint8_t *hdr_msg; /* SEND: [u64 payload len][hdr]; RECV: receive buffer */
    size_t hdr_msg_len;
    void *hbuf;
    size_t hcap, hlen, plen;
    recv_part_t parts[2];
    pd_list_link_t link; /* on ucx_pipe_t.ops */
};

/* A page list copied through a peer region mapped here (shared memory), a bounded slice per
 * progress call so a caller that holds its own lock around progress (the connector's control
 * thread) releases it between slices, as it would between UCX progress calls. */
typedef struct copy_job {
    pd_pipe_peer_t *peer;
    pd_pipe_remote_t *remote;
    bool write;
    char *local_base;
    pd_page_xfer_t *pages; /* coalesced */
    int n, next;           /* page count; the first page not yet fully copied */
    uint64_t next_done;    /* bytes of pages[next] already copied */
    bool stream;           /* the request is >= PD_COPY_STREAM_MIN: copy past the cache */
    pd_pipe_done_cb cb;
    void *arg;
    struct copy_job *link;
} copy_job_t;

/* bytes one progress call copies at most (~0.5 ms at this host's memcpy rate) */
#define UCX_COPY_SLICE (4u << 20)

struct ucx_pipe {
    pd_pipe_t base;
    uint64_t id;
    uint16_t hash16;
    bool err_peer;
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd, wake_fd;
    pthread_t progress_thread;
    bool thread_started;
    pthread_mutex_t mu; /* ops, completions, peers */
    bool stop;
    pd_list_link_t peers;          /* pd_pipe_peer_t */
    pd_list_link_t regions;        /* ucx_region_t */
    pd_list_link_t ops;            /* op_t */
    copy_job_t *cj_head, *cj_tail; /* direct copies, in posting order */
    bool copying;                  /* a progress call is copying cj_head's slice (outside mu) */
    uint64_t copies_done;
    pd_pipe_cq_t cq;
    pd_pipe_peer_error_cb peer_cb;
    void *peer_cb_arg;
};

static pd_status_t from_ucs(ucs_status_t s)
{
    switch (s) {
    case UCS_OK: return PD_OK;
    case UCS_ERR_CANCELED: return PD_ERR_CANCELLED;
    case UCS_ERR_MESSAGE_TRUNCATED: return PD_ERR_NO_SPACE;
    case UCS_ERR_NO_MEMORY: return PD_ERR_NO_MEMORY;
    case UCS_ERR_TIMED_OUT: return PD_ERR_TIMEOUT;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE: return PD_ERR_PEER_GONE;
    default: return PD_ERR_IO;
    }
}

/* ------------------------------------------------------------------ completions (mu held) */

static void queue_completion(ucx_pipe_t *u, pd_pipe_completion_t c)
{
    pd_pipe_cq_push(&u->cq, &c);
}

/* Frees peer if the user released it and no op or copy job refers to it any more (mu held). */
static void free_if_released(ucx_pipe_t *u, pd_pipe_peer_t *peer)
{
    if (peer == NULL || !peer->released) {
        return;
    }
    op_t *o;
    pd_list_for_each (o, &u->ops, link) {
        if (o->peer == peer) {
            return;
        }
    }
    for (copy_job_t *j = u->cj_head; j != NULL; j = j->link) {
        if (j->peer == peer) {
            return;
        }
    }
    pd_list_del(&peer->link);
    free(peer);
}

static void op_report(ucx_pipe_t *u, op_t *o, pd_status_t st)
{
    if (o->reported) {
        return;
    }
    o->reported = true;
    pd_pipe_completion_t c = {o->done, o->recv_cb, NULL, NULL, o->arg, st, o->tag, o->hlen, o->plen, NULL};
    queue_completion(u, c);
}

/* One UCX callback of o arrived with status s. */
static void op_step(ucx_pipe_t *u, op_t *o, ucs_status_t s)
{
    if (s != UCS_OK && o->st == PD_OK) {
        /* pages are bounds-checked and local regions stay mapped, so an RMA op can only fail
         * because of the peer — whatever status UCX picks while purging a failed endpoint (cancel,
         * I/O error, reset); destroy has already reported its own CANCELLED (o->reported) */
        o->st = o->kind == OP_PAGES || (o->peer != NULL && o->peer->dead) ? PD_ERR_PEER_GONE : from_ucs(s);
    }
    if (--o->pending > 0) {
        return;
    }
    op_report(u, o, o->st);
    pd_list_del(&o->link);
    pd_pipe_peer_t *peer = o->peer;
    free(o->hdr_msg);
    free(o);
    free_if_released(u, peer);
}

/* The posting function keeps one reference on its op until it has finished posting, so a
 * callback on the progress thread cannot complete and free the op under it. */
static void release_hold(ucx_pipe_t *u, op_t *o)
{
    pthread_mutex_lock(&u->mu);
    op_step(u, o, UCS_OK);
    pthread_mutex_unlock(&u->mu);
}

static op_t *op_new(ucx_pipe_t *u, int kind, pd_pipe_peer_t *peer, int pending)
{
    op_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return NULL;
    }
    o->kind = kind;
    o->peer = peer;
    o->pending = pending;
    pd_list_add_tail(&u->ops, &o->link);
    return o;
}

/* ------------------------------------------------------------------ UCX callbacks */

static void cb_send(void *request, ucs_status_t status, void *user_data)
{
    op_t *o = user_data;
    ucx_pipe_t *u = o->peer->pipe;
    pthread_mutex_lock(&u->mu);
    op_step(u, o, status);
    pthread_mutex_unlock(&u->mu);
    if (request != NULL) {
        ucp_request_free(request);
    }
}

static void cb_recv(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info, void *user_data)
{
    recv_part_t *part = user_data;
    op_t *o = part->op;
    ucx_pipe_t *u = o->peer->pipe;
    pthread_mutex_lock(&u->mu);
    part->done = true;
    part->req = NULL;
    if (status == UCS_OK) {
        if ((info->sender_tag & 1) == 0) { /* part 0: lengths + header */
            uint64_t plen = 0;
            if (info->length >= 8) {
                memcpy(&plen, o->hdr_msg, 8);
                o->hlen = info->length - 8;
                memcpy(o->hbuf, o->hdr_msg + 8, o->hlen);
            }
            (void)plen;
        } else {
            o->plen = info->length;
        }
    }
    op_step(u, o, status);
    pthread_mutex_unlock(&u->mu);
    if (request != NULL) {
        ucp_request_free(request);
    }
}

static void cb_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    pd_pipe_peer_t *peer = arg;
    ucx_pipe_t *u = peer->pipe;
    pthread_mutex_lock(&u->mu);
    if (!peer->dead) {
        peer->dead = true;
        pd_log_warn("ucx pipe: peer %016llx failed: %s", (unsigned long long)peer->id,
                    ucs_status_string(status));
        if (u->peer_cb != NULL) {
            pd_pipe_completion_t c = {NULL, NULL, u->peer_cb, peer, u->peer_cb_arg, PD_ERR_PEER_GONE,
                                      0,    0,    0,          NULL};
            queue_completion(u, c);
        }
    }
    pthread_mutex_unlock(&u->mu);
}

/* ------------------------------------------------------------------ progress */

static void *progress_main(void *arg)
{
    ucx_pipe_t *u = arg;
    for (;;) {
        pthread_mutex_lock(&u->mu);
        bool stop = u->stop;
        pthread_mutex_unlock(&u->mu);
        if (stop) {
            break;
        }
        while (ucp_worker_progress(u->worker) != 0) {
        }
        ucs_status_t s = ucp_worker_arm(u->worker);
        if (s == UCS_ERR_BUSY) {
            continue; /* events arrived meanwhile */
        }
        struct pollfd p[2] = {{u->efd, POLLIN, 0}, {u->wake_fd, POLLIN, 0}};
        poll(p, 2, 100);
        if (p[1].revents & POLLIN) {
            uint64_t v;
            ssize_t r = read(u->wake_fd, &v, sizeof(v));
            (void)r;
        }
    }
    return NULL;
}

/* Unlinks copy job j (queued after prev, NULL for the head) and completes it with st (mu held). */
static void copy_job_end(ucx_pipe_t *u, copy_job_t *prev, copy_job_t *j, pd_status_t st)
{
    *(prev != NULL ? &prev->link : &u->cj_head) = j->link;
    if (u->cj_tail == j) {
        u->cj_tail = prev;
    }
    pd_pipe_completion_t c = {j->cb, NULL, NULL, NULL, j->arg, st, 0, 0, 0, NULL};
    queue_completion(u, c);
    pd_pipe_peer_t *peer = j->peer;
    free(j->pages);
    free(j);
    free_if_released(u, peer);
}

/* Copies up to UCX_COPY_SLICE bytes of the queued direct copies, oldest first; a job whose last
 * byte is copied completes (after a full barrier: its bytes are visible before whatever the
 * caller sends next). Jobs of a peer declared dead end with PD_ERR_PEER_GONE. */
static void run_copies(ucx_pipe_t *u)
{
    uint64_t budget = UCX_COPY_SLICE;
    pthread_mutex_lock(&u->mu);
    if (u->copying) {
        pthread_mutex_unlock(&u->mu);
        return;
    }
    while (budget > 0 && u->cj_head != NULL) {
        copy_job_t *j = u->cj_head;
        if (j->peer->dead) {
            copy_job_end(u, NULL, j, PD_ERR_PEER_GONE);
            continue;
        }
        u->copying = true;
        pthread_mutex_unlock(&u->mu);
        while (budget > 0 && j->next < j->n) {
            const pd_page_xfer_t *pg = &j->pages[j->next];
            uint64_t len = pg->len - j->next_done;
            len = len < budget ? len : budget;
            char *lp = j->local_base + pg->local_off + j->next_done;
            char *rp = j->remote->direct + pg->remote_off + j->next_done;
            if (j->stream) {
                pd_copy_stream(j->write ? rp : lp, j->write ? lp : rp, len);
            } else {
                memcpy(j->write ? rp : lp, j->write ? lp : rp, len);
            }
            budget -= len;
            j->next_done += len;
            if (j->next_done == pg->len) {
                j->next++;
                j->next_done = 0;
            }
        }
        pthread_mutex_lock(&u->mu);
        u->copying = false;
        if (j->next == j->n) {
            /* a full barrier (a locked RMW; TSan supports it where it rejects bare fences) */
            __atomic_fetch_add(&u->copies_done, 1, __ATOMIC_SEQ_CST);
            copy_job_end(u, NULL, j, PD_OK);
        }
    }
    pthread_mutex_unlock(&u->mu);
}

/* Ends with st every queued copy job of `peer` and of `remote` (NULL: any), except one a progress
 * call is copying right now, which ends after its slice (mu held). */
static void end_copies(ucx_pipe_t *u, pd_pipe_peer_t *peer, pd_pipe_remote_t *remote, pd_status_t st)
{
    copy_job_t *prev = NULL;
    for (copy_job_t *j = u->cj_head, *next; j != NULL; j = next) {
        next = j->link;
        bool busy = u->copying && j == u->cj_head;
        if (!busy && (peer == NULL || j->peer == peer) && (remote == NULL || j->remote == remote)) {
            copy_job_end(u, prev, j, st);
        } else {
            prev = j;
        }
    }
}

static int ucx_progress(pd_pipe_t *p)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    run_copies(u);
    ucp_worker_progress(u->worker);
    pthread_mutex_lock(&u->mu);
    pd_pipe_completion_t *c = pd_pipe_cq_take(&u->cq);
    pthread_mutex_unlock(&u->mu);
    return pd_pipe_cq_run(c);
}

/* ------------------------------------------------------------------ lifecycle */

static void ucx_destroy(pd_pipe_t *p);

static pd_status_t ucx_create(const pd_pipe_config_t *cfg, pd_pipe_t **out)
{
    ucx_pipe_t *u = calloc(1, sizeof(*u));
    if (u == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    u->base.ops = &pd_pipe_ucx_ops;
    u->efd = u->wake_fd = -1;
    pd_list_head_init(&u->peers);
    pd_list_head_init(&u->regions);
    pd_list_head_init(&u->ops);
    pthread_mutex_init(&u->mu, NULL);
    u->err_peer = cfg->ucx_err_mode != NULL && strcmp(cfg->ucx_err_mode, "peer") == 0;
    if (getrandom(&u->id, sizeof(u->id), 0) != (ssize_t)sizeof(u->id)) {
        u->id = (uint64_t)(uintptr_t)u;
    }
    u->hash16 = (uint16_t)pd_hash64(&u->id, sizeof(u->id), 0);
    ucp_config_t *config = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &config);
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    if (s == UCS_OK) {
        s = ucp_init(&params, config, &u->ctx);
        ucp_config_release(config);
    }
    if (s != UCS_OK) {
        pd_log_error("ucx pipe: ucp_init failed: %s", ucs_status_string(s));
        free(u);
        return PD_ERR_IO;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI; /* the progress thread and the caller */
    s = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (s == UCS_OK) {
        s = ucp_worker_get_efd(u->worker, &u->efd);
    }
    if (s != UCS_OK) {
        pd_log_error("ucx pipe: worker setup failed: %s", ucs_status_string(s));
        ucx_destroy(&u->base);
        return PD_ERR_IO;
    }
    u->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (u->wake_fd < 0) {
        pd_log_error("ucx pipe: cannot create its wake-up eventfd: %s", strerror(errno));
        ucx_destroy(&u->base);
        return PD_ERR_IO;
    }
    int err = pthread_create(&u->progress_thread, NULL, progress_main, u);
    if (err != 0) {
        pd_log_error("ucx pipe: cannot start its progress thread: %s", strerror(err));
        ucx_destroy(&u->base);
        return PD_ERR_INTERNAL;
    }
    u->thread_started = true;
    pd_log_debug("ucx pipe %016llx ready (error mode %s)", (unsigned long long)u->id,
                 u->err_peer ? "peer" : "none");
    *out = &u->base;
    return PD_OK;
}

static void ep_close(ucx_pipe_t *u, pd_pipe_peer_t *peer)
{
    if (peer->ep == NULL) {
        return;
    }
    if (!peer->dead) {
        /* let in-flight RMA finish first (bounded): UCX 1.13's emulated RMA (error mode peer)
         * aborts the *target* process when an initiator's endpoint vanishes mid-transfer */
        ucp_request_param_t fp;
        memset(&fp, 0, sizeof(fp));
        ucs_status_ptr_t f = ucp_ep_flush_nbx(peer->ep, &fp);
        if (UCS_PTR_IS_PTR(f)) {
            uint64_t end = pd_time_now_ns() + 10000000000ull;
            while (ucp_request_check_status(f) == UCS_INPROGRESS && pd_time_now_ns() < end) {
                ucp_worker_progress(u->worker);
            }
            ucp_request_free(f);
        }
    }
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer->ep, &prm);
    if (UCS_PTR_IS_PTR(r)) {
        uint64_t end = pd_time_now_ns() + 5000000000ull; /* bounded */
        while (ucp_request_check_status(r) == UCS_INPROGRESS && pd_time_now_ns() < end) {
            ucp_worker_progress(u->worker);
        }
        ucp_request_free(r);
    }
    peer->ep = NULL;
}

static void ucx_destroy(pd_pipe_t *p)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    pthread_mutex_lock(&u->mu);
    u->stop = true;
    pthread_mutex_unlock(&u->mu);
    if (u->thread_started) {
        uint64_t one = 1;
        ssize_t w = write(u->wake_fd, &one, sizeof(one));
        (void)w;
        pthread_join(u->progress_thread, NULL);
    }
    /* cancel receives nobody matched (their callbacks run with UCS_ERR_CANCELED) */
    for (;;) {
        void *req = NULL;
        pthread_mutex_lock(&u->mu);
        op_t *o;
        pd_list_for_each (o, &u->ops, link) {
            if (req != NULL) {
                break;
            }
            for (int k = 0; o->kind == OP_RECV && k < 2 && req == NULL; k++) {
                req = o->parts[k].req;
                o->parts[k].req = NULL;
            }
        }
        pthread_mutex_unlock(&u->mu);
        if (req == NULL) {
            break;
        }
        ucp_request_cancel(u->worker, req);
        ucp_worker_progress(u->worker);
    }
    /* force-close endpoints: UCX cancels their outstanding requests (callbacks run here) */
    pd_pipe_peer_t *pe;
    pd_list_for_each (pe, &u->peers, link) {
        ep_close(u, pe);
    }
    if (u->worker != NULL) {
        ucp_worker_progress(u->worker);
    }
    pthread_mutex_lock(&u->mu);
    u->peer_cb = NULL;
    op_t *o;
    pd_list_for_each (o, &u->ops, link) {
        op_report(u, o, PD_ERR_CANCELLED);
    }
    end_copies(u, NULL, NULL, PD_ERR_CANCELLED);
    pthread_mutex_unlock(&u->mu);
    ucx_progress(p); /* deliver every pending completion before returning */
    while ((o = pd_list_pop_head(&u->ops, op_t, link)) != NULL) {
        free(o->hdr_msg);
        free(o);
    }
    while ((pe = pd_list_pop_head(&u->peers, pd_pipe_peer_t, link)) != NULL) {
        free(pe);
    }
    ucx_region_t *r;
    while ((r = pd_list_pop_head(&u->regions, ucx_region_t, link)) != NULL) {
        ucp_mem_unmap(u->ctx, r->memh);
        free(r);
    }
    if (u->worker != NULL) {
        ucp_worker_destroy(u->worker);
    }
    if (u->ctx != NULL) {
        ucp_cleanup(u->ctx);
    }
    if (u->wake_fd >= 0) {
        close(u->wake_fd);
    }
    pd_pipe_cq_close(&u->cq);
    pthread_mutex_destroy(&u->mu);
    free(u);
}

static pd_status_t ucx_address(pd_pipe_t *p, uint8_t *buf, size_t *len)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    ucp_address_t *a = NULL;
    size_t al = 0;
    ucs_status_t s = ucp_worker_get_address(u->worker, &a, &al);
    if (s != UCS_OK) {
        return PD_ERR_IO;
    }
    pd_status_t st = PD_OK;
    if (8 + al > *len) {
        st = PD_ERR_NO_SPACE;
    } else {
        memcpy(buf, &u->id, 8);
        memcpy(buf + 8, a, al);
        *len = 8 + al;
    }
    ucp_worker_release_address(u->worker, a);
    return st;
}

static pd_status_t ucx_connect(pd_pipe_t *p, const uint8_t *addr, size_t len, const uint8_t *session,
                               pd_pipe_peer_t **peer_out)
{
    (void)session; /* the worker address came over the authenticated control channel */
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    if (len <= 8) {
        return PD_ERR_INVALID_ARG;
    }
    pd_pipe_peer_t *peer = calloc(1, sizeof(*peer));
    if (peer == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pthread_mutex_lock(&u->mu);
    pd_status_t st = pd_pipe_cq_reserve(&u->cq); /* the node of its failure's completion */
    pthread_mutex_unlock(&u->mu);
    if (st != PD_OK) {
        free(peer);
        return st;
    }
    peer->pipe = u;
    memcpy(&peer->id, addr, 8);
    peer->hash16 = (uint16_t)pd_hash64(&peer->id, sizeof(peer->id), 0);
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = (const ucp_address_t *)(addr + 8);
    ep.err_mode = u->err_peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (u->err_peer) {
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_handler.cb = cb_ep_error;
        ep.err_handler.arg = peer;
    }
    ucs_status_t s = ucp_ep_create(u->worker, &ep, &peer->ep);
    if (s != UCS_OK) {
        pd_log_error("ucx pipe: cannot create an endpoint: %s", ucs_status_string(s));
        free(peer);
        return PD_ERR_PEER_GONE;
    }
    pthread_mutex_lock(&u->mu);
    pd_list_add_tail(&u->peers, &peer->link);
    pthread_mutex_unlock(&u->mu);
    *peer_out = peer;
    return PD_OK;
}

/* ------------------------------------------------------------------ memory */

static pd_status_t map_region(ucx_pipe_t *u, void *base, size_t len, bool allocate, pd_mem_type_t mem,
                              pd_pipe_region_t **out)
{
    ucx_region_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask =
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = allocate ? NULL : base;
    mp.length = len > 0 ? len : 1;
    mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    if (mem == PD_MEM_CUDA) {
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ucs_status_t s = ucp_mem_map(u->ctx, &mp, &r->memh);
    if (s != UCS_OK) {
        pd_log_error("ucx pipe: ucp_mem_map of %zu bytes failed: %s", len, ucs_status_string(s));
        free(r);
        return PD_ERR_NO_MEMORY;
    }
    if (allocate) {
        ucp_mem_attr_t attr;
        attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
        ucp_mem_query(r->memh, &attr);
        base = attr.address;
    }
    r->pub = (struct pd_pipe_region){base, len, mem};
    r->owned = allocate;
    pthread_mutex_lock(&u->mu);
    pd_list_add_tail(&u->regions, &r->link);
    pthread_mutex_unlock(&u->mu);
    *out = &r->pub;
    return PD_OK;
}

static pd_status_t ucx_alloc_region(pd_pipe_t *p, size_t len, pd_pipe_region_t **out)
{
    return map_region((ucx_pipe_t *)p, NULL, len, true, PD_MEM_HOST, out);
}

static pd_status_t ucx_register_region(pd_pipe_t *p, void *base, size_t len, pd_mem_type_t mem,
                                       pd_pipe_region_t **out)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    if (mem == PD_MEM_CUDA) {
        /* only a UCX built with CUDA support (cuda_copy/cuda_ipc, GPUDirect RDMA) can move device
         * memory; Debian's cannot, and the caller then stages through host memory */
        ucp_context_attr_t attr;
        attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
        if (ucp_context_query(u->ctx, &attr) != UCS_OK ||
            !(attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA))) {
            pd_log_debug("ucx pipe: this UCX build has no CUDA memory support");
            return PD_ERR_UNSUPPORTED;
        }
    }
    return map_region(u, base, len, false, mem, out);
}

static void ucx_deregister_region(pd_pipe_t *p, pd_pipe_region_t *r)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    ucx_region_t *ur = (ucx_region_t *)r;
    pthread_mutex_lock(&u->mu);
    pd_list_del(&ur->link);
    pthread_mutex_unlock(&u->mu);
    ucp_mem_unmap(u->ctx, ur->memh);
    free(ur);
}

static pd_status_t ucx_export_region(pd_pipe_t *p, pd_pipe_region_t *r, pd_pipe_peer_t *peer,
                                     bool allow_write, uint8_t *buf, size_t *len)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    ucx_region_t *ur = (ucx_region_t *)r;
    void *rk = NULL;
    size_t rkl = 0;
    ucs_status_t s = ucp_rkey_pack(u->ctx, ur->memh, &rk, &rkl);
    if (s != UCS_OK) {
        return PD_ERR_IO;
    }
    pd_status_t st = PD_OK;
    if (16 + rkl > *len) {
        st = PD_ERR_NO_SPACE;
    } else {
        uint64_t base = (uint64_t)(uintptr_t)r->base, l = r->len;
        memcpy(buf, &base, 8);
        memcpy(buf + 8, &l, 8);
        memcpy(buf + 16, rk, rkl);
        *len = 16 + rkl;
    }
    ucp_rkey_buffer_release(rk);
    return st;
}

static pd_status_t ucx_import_region(pd_pipe_t *p, pd_pipe_peer_t *peer, const uint8_t *buf, size_t len,
                                     pd_pipe_remote_t **out)
{
    if (len <= 16) {
        return PD_ERR_PARSE;
    }
    pd_pipe_remote_t *rr = calloc(1, sizeof(*rr));
    if (rr == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    rr->peer = peer;
    memcpy(&rr->base, buf, 8);
    memcpy(&rr->len, buf + 8, 8);
    ucs_status_t s = ucp_ep_rkey_unpack(peer->ep, buf + 16, &rr->rkey);
    if (s != UCS_OK) {
        pd_log_error("ucx pipe: cannot unpack a remote key: %s", ucs_status_string(s));
        free(rr);
        return PD_ERR_PARSE;
    }
    void *lp = NULL;
#if defined(__SANITIZE_THREAD__)
    /* the warm-up reads race with the peer's writes by design (the value is discarded); TSan builds
     * skip it rather than report it */
    bool warm = false;
#else
    bool warm = true;
#endif
    if (ucp_rkey_ptr(rr->rkey, rr->base, &lp) == UCS_OK && lp != NULL) {
        rr->direct = lp;
    }
    if (warm && rr->len >= (1u << 20) && rr->direct != NULL) {
        int err = pthread_create(&rr->warm, NULL, warm_main, rr);
        rr->warming = err == 0;
        if (err != 0) { /* only a speed-up: the region works unwarmed */
            pd_log_warn("ucx pipe: cannot start a thread to warm a %zu-byte region: %s (it stays cold)",
                        (size_t)rr->len, strerror(err));
        }
    }
    *out = rr;
    return PD_OK;
}

static void ucx_release_remote(pd_pipe_t *p, pd_pipe_remote_t *rr)
{
    if (rr != NULL) {
        ucx_pipe_t *u = (ucx_pipe_t *)p;
        pthread_mutex_lock(&u->mu);
        end_copies(u, NULL, rr, PD_ERR_CANCELLED); /* the mapping goes with the rkey */
        pthread_mutex_unlock(&u->mu);
        if (rr->warming) {
            __atomic_store_n(&rr->warm_stop, true, __ATOMIC_RELAXED);
            pthread_join(rr->warm, NULL);
        }
        ucp_rkey_destroy(rr->rkey);
        free(rr);
    }
}

/* ------------------------------------------------------------------ data */

static void fail_at_once(ucx_pipe_t *u, pd_pipe_done_cb cb, pd_pipe_recv_cb rcb, void *arg, uint64_t tag)
{
    pd_pipe_completion_t c = {cb, rcb, NULL, NULL, arg, PD_ERR_PEER_GONE, tag, 0, 0, NULL};
    queue_completion(u, c);
}

static pd_status_t post_pages(bool write, pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                              pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                              pd_pipe_done_cb cb, void *arg)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    pd_status_t st = pd_pipe_check_pages(pages, n, local->len, remote->len);
    if (st != PD_OK) {
        return st;
    }
    pthread_mutex_lock(&u->mu);
    if (pd_pipe_cq_reserve(&u->cq) != PD_OK) {
        pthread_mutex_unlock(&u->mu);
        return PD_ERR_NO_MEMORY;
    }
    if (peer->dead || peer->ep == NULL) {
        fail_at_once(u, cb, NULL, arg, 0);
        pthread_mutex_unlock(&u->mu);
        return PD_OK;
    }
    if (remote->direct != NULL && local->mem == PD_MEM_HOST) {
        /* shared memory mapped here (ucp_rkey_ptr), host memory on this side: what ucp_put_nbx /
         * ucp_get_nbx would do for each page (a copy), minus UCX's cost per operation — 64
         * scattered 16 KiB pages ran at ~0.8x memcpy through puts. The copies run in progress
         * calls (run_copies). */
        copy_job_t *j = calloc(1, sizeof(*j));
        pd_page_xfer_t *pg = j != NULL ? malloc((size_t)(n > 0 ? n : 1) * sizeof(*pg)) : NULL;
        if (pg == NULL) {
            free(j);
            pthread_mutex_unlock(&u->mu);
            return PD_ERR_NO_MEMORY;
        }
        memcpy(pg, pages, (size_t)n * sizeof(*pg));
        uint64_t total = 0;
        for (int i = 0; i < n; i++) {
            total += pages[i].len;
        }
        *j = (copy_job_t){peer, remote, write, (char *)local->base, pg, n, 0, 0, total >= PD_COPY_STREAM_MIN,
                          cb,   arg,    NULL};
        if (u->cj_tail != NULL) {
            u->cj_tail->link = j;
        } else {
            u->cj_head = j;
        }
        u->cj_tail = j;
        pthread_mutex_unlock(&u->mu);
        return PD_OK;
    }
    op_t *o = op_new(u, OP_PAGES, peer, 2); /* the flush callback + this function's hold */
    if (o == NULL) {
        pthread_mutex_unlock(&u->mu);
        return PD_ERR_NO_MEMORY;
    }
    o->done = cb;
    o->arg = arg;
    pthread_mutex_unlock(&u->mu);
    /* puts/gets without callbacks (their requests are freed at once); the flush completes them */
    ucp_request_param_t none;
    memset(&none, 0, sizeof(none));
    ucs_status_t bad = UCS_OK;
    for (int i = 0; i < n && bad == UCS_OK; i++) {
        void *lp = (char *)local->base + pages[i].local_off;
        uint64_t ra = remote->base + pages[i].remote_off;
        ucs_status_ptr_t r = write ? ucp_put_nbx(peer->ep, lp, pages[i].len, ra, remote->rkey, &none)
                                   : ucp_get_nbx(peer->ep, lp, pages[i].len, ra, remote->rkey, &none);
        if (UCS_PTR_IS_ERR(r)) {
            bad = UCS_PTR_STATUS(r);
        } else if (r != NULL) {
            ucp_request_free(r);
        }
    }
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = cb_send;
    prm.user_data = o;
    ucs_status_ptr_t f = bad == UCS_OK ? ucp_ep_flush_nbx(peer->ep, &prm) : UCS_STATUS_PTR(bad);
    if (!UCS_PTR_IS_PTR(f)) {
        cb_send(NULL, UCS_PTR_STATUS(f), o); /* completed (or failed) at once */
    }
    release_hold(u, o);
    return PD_OK;
}

static pd_status_t ucx_write_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                                   pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                   pd_pipe_done_cb cb, void *arg)
{
    return post_pages(true, p, peer, local, remote, pages, n, cb, arg);
}

static pd_status_t ucx_read_pages(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_pipe_region_t *local,
                                  pd_pipe_remote_t *remote, const pd_page_xfer_t *pages, int n,
                                  pd_pipe_done_cb cb, void *arg)
{
    return post_pages(false, p, peer, local, remote, pages, n, cb, arg);
}

static uint64_t wire_tag(uint16_t sender_hash, uint64_t tag, int part)
{
    return ((uint64_t)sender_hash << 48) | ((tag & TAG_USER_MASK) << 1) | (uint64_t)part;
}

static pd_status_t ucx_send_tensor(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, const void *hdr,
                                   size_t hdr_len, const void *payload, size_t payload_len,
                                   pd_pipe_done_cb cb, void *arg)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    if (tag > TAG_USER_MASK) {
        return PD_ERR_INVALID_ARG;
    }
    uint8_t *msg = malloc(8 + hdr_len);
    if (msg == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    uint64_t pl = payload_len;
    memcpy(msg, &pl, 8);
    memcpy(msg + 8, hdr, hdr_len);
    pthread_mutex_lock(&u->mu);
    if (pd_pipe_cq_reserve(&u->cq) != PD_OK) {
        pthread_mutex_unlock(&u->mu);
        free(msg);
        return PD_ERR_NO_MEMORY;
    }
    if (peer->dead || peer->ep == NULL) {
        fail_at_once(u, cb, NULL, arg, tag);
        pthread_mutex_unlock(&u->mu);
        free(msg);
        return PD_OK;
    }
    op_t *o = op_new(u, OP_SEND, peer, 3); /* two parts + this function's hold */
    if (o == NULL) {
        pthread_mutex_unlock(&u->mu);
        free(msg);
        return PD_ERR_NO_MEMORY;
    }
    o->done = cb;
    o->arg = arg;
    o->tag = tag;
    o->hdr_msg = msg;
    pthread_mutex_unlock(&u->mu);
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = cb_send;
    prm.user_data = o;
    const void *bufs[2] = {msg, payload};
    size_t lens[2] = {8 + hdr_len, payload_len};
    for (int part = 0; part < 2; part++) {
        ucs_status_ptr_t r =
            ucp_tag_send_nbx(peer->ep, bufs[part], lens[part], wire_tag(u->hash16, tag, part), &prm);
        if (!UCS_PTR_IS_PTR(r)) {
            cb_send(NULL, UCS_PTR_STATUS(r), o);
        }
    }
    release_hold(u, o);
    return PD_OK;
}

static pd_status_t ucx_recv_tensor(pd_pipe_t *p, pd_pipe_peer_t *peer, uint64_t tag, void *hdr,
                                   size_t hdr_cap, void *payload, size_t payload_cap, pd_pipe_recv_cb cb,
                                   void *arg)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    if (tag > TAG_USER_MASK) {
        return PD_ERR_INVALID_ARG;
    }
    uint8_t *buf = malloc(8 + hdr_cap);
    if (buf == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pthread_mutex_lock(&u->mu);
    if (pd_pipe_cq_reserve(&u->cq) != PD_OK) {
        pthread_mutex_unlock(&u->mu);
        free(buf);
        return PD_ERR_NO_MEMORY;
    }
    if (peer->dead) {
        fail_at_once(u, NULL, cb, arg, tag);
        pthread_mutex_unlock(&u->mu);
        free(buf);
        return PD_OK;
    }
    op_t *o = op_new(u, OP_RECV, peer, 3); /* two parts + this function's hold */
    if (o == NULL) {
        pthread_mutex_unlock(&u->mu);
        free(buf);
        return PD_ERR_NO_MEMORY;
    }
    o->recv_cb = cb;
    o->arg = arg;
    o->tag = tag;
    o->hdr_msg = buf;
    o->hbuf = hdr;
    o->hcap = hdr_cap;
    pthread_mutex_unlock(&u->mu);
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    /* a receive matched from the unexpected queue may complete inside the call without its
     * callback: deny immediate completion so every part reports through cb_recv */
    prm.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.cb.recv = cb_recv;
    void *bufs[2] = {buf, payload};
    size_t caps[2] = {8 + hdr_cap, payload_cap};
    for (int part = 0; part < 2; part++) {
        recv_part_t *rp = &o->parts[part];
        rp->op = o;
        prm.user_data = rp;
        ucs_status_ptr_t r = ucp_tag_recv_nbx(u->worker, bufs[part], caps[part],
                                              wire_tag(peer->hash16, tag, part), UINT64_MAX, &prm);
        if (UCS_PTR_IS_ERR(r)) {
            cb_recv(NULL, UCS_PTR_STATUS(r), NULL, rp);
        } else {
            pthread_mutex_lock(&u->mu);
            if (!rp->done) {
                rp->req = r; /* the callback has not run yet: it clears this when it does */
            }
            pthread_mutex_unlock(&u->mu);
        }
    }
    release_hold(u, o);
    return PD_OK;
}

static void ucx_set_peer_error_cb(pd_pipe_t *p, pd_pipe_peer_error_cb cb, void *arg)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    pthread_mutex_lock(&u->mu);
    u->peer_cb = cb;
    u->peer_cb_arg = arg;
    pthread_mutex_unlock(&u->mu);
}

static void ucx_fail_peer(pd_pipe_t *p, pd_pipe_peer_t *peer, pd_status_t st)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    pthread_mutex_lock(&u->mu);
    peer->dead = true;
    /* report now; the UCX requests stay owned by UCX until it calls back or the ep closes */
    op_t *o;
    pd_list_for_each (o, &u->ops, link) {
        if (o->peer == peer) {
            op_report(u, o, st);
        }
    }
    end_copies(u, peer, NULL, st);
    pthread_mutex_unlock(&u->mu);
}

static void ucx_release_peer(pd_pipe_t *p, pd_pipe_peer_t *peer)
{
    ucx_pipe_t *u = (ucx_pipe_t *)p;
    ucx_fail_peer(p, peer, PD_ERR_PEER_GONE);
    ep_close(u, peer); /* forced (dead): UCX cancels what is outstanding, the callbacks run */
    pthread_mutex_lock(&u->mu);
    peer->released = true;
    free_if_released(u, peer);
    pthread_mutex_unlock(&u->mu);
}

const pd_pipe_ops_t pd_pipe_ucx_ops = {
    .name = "ucx",
    .create = ucx_create,
    .destroy = ucx_destroy,
    .address = ucx_address,
    .connect = ucx_connect,
    .alloc_region = ucx_alloc_region,
    .register_region = ucx_register_region,
    .deregister_region = ucx_deregister_region,
    .export_region = ucx_export_region,
    .import_region = ucx_import_region,
    .release_remote = ucx_release_remote,
    .write_pages = ucx_write_pages,
    .read_pages = ucx_read_pages,
    .send_tensor = ucx_send_tensor,
    .recv_tensor = ucx_recv_tensor,
    .progress = ucx_progress,
    .set_peer_error_cb = ucx_set_peer_error_cb,
    .fail_peer = ucx_fail_peer,
    .release_peer = ucx_release_peer,
};
