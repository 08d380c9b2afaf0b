/* connector/kv_ctl.c — the P/D connector's control thread: the control listener, dialled and
 * accepted peers (handshake, region exchange, heartbeats), every transfer's progress on the
 * pipe, the notifications (READ_DONE / ACK / WRITE_DONE / ABORT) and every timeout.
 *
 * One tick: poll (listener, wake eventfd, peers) → accept → [mu] read frames, progress the pipe,
 * start handed-over transfers, post write jobs, send notices, run timers [/mu]. Blocking dials
 * and handshakes run outside mu, bounded by --kv-handshake-timeout. Pipe callbacks run inside
 * pd_pipe_progress, with mu held. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "connector/kv_internal.h"

#define KV_MAX_BACKLOG (4u << 20) /* control bytes queued to a peer that does not read */

void kv_ctl_wake(kv_conn_t *k)
{
    if (k->wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t w = write(k->wake_fd, &one, sizeof(one));
        (void)w;
    }
}

static int ms_of(double s)
{
    return (int)(s * 1000.0 + 0.5);
}

/* ------------------------------------------------------------------ peers */

static int count_ready(const kv_conn_t *k)
{
    int n = 0;
    for (const kv_peer_t *p = k->peers; p != NULL; p = p->next) {
        n += p->state == KV_PEER_READY;
    }
    return n;
}

static void peer_dead(kv_conn_t *k, kv_peer_t *p, const char *why);
static void parse_frames(kv_conn_t *k, kv_peer_t *p);

/* Writes what p's output queue holds without waiting; a peer whose queue outgrows
 * KV_MAX_BACKLOG (it stopped reading) or whose socket fails is dead. */
static pd_status_t flush_peer(kv_conn_t *k, kv_peer_t *p)
{
    while (p->out_len > 0 && p->state != KV_PEER_DEAD) {
        ssize_t w = send(p->fd, p->out, p->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            break;
        }
        if (w <= 0) {
            peer_dead(k, p, "control connection closed");
            return PD_ERR_PEER_GONE;
        }
        memmove(p->out, p->out + w, p->out_len - (size_t)w);
        p->out_len -= (size_t)w;
    }
    if (p->out_len > KV_MAX_BACKLOG) {
        peer_dead(k, p, "it stopped reading control messages");
        return PD_ERR_PEER_GONE;
    }
    return p->state == KV_PEER_DEAD ? PD_ERR_PEER_GONE : PD_OK;
}

/* Queues one control message to p and writes what the socket takes now (never waits). */
static pd_status_t peer_send(kv_conn_t *k, kv_peer_t *p, pd_msg_type_t type, const ProtobufCMessage *msg)
{
    if (p->state == KV_PEER_DEAD) {
        return PD_ERR_PEER_GONE;
    }
    uint8_t *f = NULL;
    size_t len = 0;
    pd_status_t st = pd_ctl_encode(type, msg, &f, &len);
    if (st != PD_OK) {
        return st;
    }
    if (p->out_len + len > p->out_cap) {
        size_t cap = p->out_cap ? p->out_cap : 4096;
        while (cap < p->out_len + len) {
            cap *= 2;
        }
        uint8_t *o = realloc(p->out, cap);
        if (o == NULL) {
            free(f);
            return PD_ERR_NO_MEMORY;
        }
        p->out = o;
        p->out_cap = cap;
    }
    memcpy(p->out + p->out_len, f, len);
    p->out_len += len;
    free(f);
    return flush_peer(k, p);
}

static void fail_xfer(kv_conn_t *k, kv_xfer_t *x, const char *why);

static void peer_dead(kv_conn_t *k, kv_peer_t *p, const char *why)
{
    if (p->state == KV_PEER_DEAD) {
        return;
    }
    bool was_ready = p->state == KV_PEER_READY;
    p->state = KV_PEER_DEAD;
    pd_log_warn("kv connector: peer %s (%s) is gone: %s", p->engine_id, p->dial[0] ? p->dial : "inbound",
                why);
    if (p->fd >= 0) {
        close(p->fd);
        p->fd = -1;
    }
    free(p->out);
    p->out = NULL;
    p->out_len = p->out_cap = 0;
    if (p->pp != NULL) {
        k->pipe->ops->fail_peer(k->pipe, p->pp, PD_ERR_PEER_GONE); /* in-flight pages complete with errors */
    }
    if (was_ready) {
        pd_metric_set(k->m.peers, count_ready(k));
    }
    /* transfers not on the pipe fail now; posted ones fail through their completions */
    for (kv_xfer_t *x = k->xfers; x != NULL; x = x->next) {
        if (x->peer == p && x->state != KV_XS_POSTED && x->state != KV_XS_DONE) {
            fail_xfer(k, x, why);
        }
    }
    for (kv_resv_t *rv = k->resvs; rv != NULL; rv = rv->next) {
        if (rv->peer == p) {
            rv->dead = true;
            if (!rv->taken) {
                rv->released = true;
            }
        }
    }
}

/* Exports our KV region to p and sends the Regions message. */
static pd_status_t send_regions(kv_conn_t *k, kv_peer_t *p)
{
    uint8_t blob[PD_PIPE_RKEY_MAX];
    size_t bl = sizeof(blob);
    bool writable = k->push && !k->is_prefill; /* push: the prefill writes into the decode */
    pd_status_t st = k->pipe->ops->export_region(k->pipe, k->region, p->pp, writable, blob, &bl);
    if (st != PD_OK) {
        return st;
    }
    Pd__RegionDesc rd = PD__REGION_DESC__INIT;
    rd.region_id = 0;
    rd.base_addr = (uint64_t)(uintptr_t)k->region->base;
    rd.length = k->geom.length;
    rd.rkey.data = blob;
    rd.rkey.len = bl;
    rd.page_bytes = k->geom.page_bytes;
    rd.num_blocks = k->geom.num_blocks;
    rd.layer_offsets = (uint64_t *)k->geom.layer_offset;
    rd.n_layer_offsets = k->geom.num_layers;
    Pd__RegionDesc *rds[1] = {&rd};
    Pd__Regions msg = PD__REGIONS__INIT;
    msg.regions = rds;
    msg.n_regions = 1;
    return peer_send(k, p, PD_MSG_REGIONS, &msg.base);
}

static void on_regions(kv_conn_t *k, kv_peer_t *p, const Pd__Regions *m)
{
    if (p->state != KV_PEER_WAIT_REGIONS || m->n_regions != 1) {
        peer_dead(k, p, "unexpected Regions message");
        return;
    }
    const Pd__RegionDesc *rd = m->regions[0];
    kv_geom_t *g = &p->geom;
    const char *why = NULL;
    if (rd->page_bytes != k->geom.page_bytes || rd->n_layer_offsets != k->geom.num_layers) {
        why = "its KV pages or layer count differ from ours";
    } else {
        g->length = rd->length;
        g->page_bytes = rd->page_bytes;
        g->num_blocks = rd->num_blocks;
        g->num_layers = (uint32_t)rd->n_layer_offsets;
        for (uint32_t l = 0; l < g->num_layers; l++) {
            g->layer_offset[l] = rd->layer_offsets[l];
            /* every page of the layer lies inside the region, without overflow */
            if (g->layer_offset[l] > g->length ||
                (g->num_blocks > 0 && (g->length - g->layer_offset[l]) / g->page_bytes < g->num_blocks)) {
                why = "its region descriptor puts pages outside the region";
            }
        }
    }
    if (why == NULL &&
        k->pipe->ops->import_region(k->pipe, p->pp, rd->rkey.data, rd->rkey.len, &p->remote) != PD_OK) {
        why = "its region key cannot be imported";
    }
    if (why != NULL) {
        pd_log_error("kv connector: peer %s: %s", p->engine_id, why);
        peer_dead(k, p, why);
        return;
    }
    p->state = KV_PEER_READY;
    pd_metric_set(k->m.peers, count_ready(k));
    pd_log_info("kv connector: peer %s ready (%u blocks, %.1f MiB of KV)", p->engine_id, g->num_blocks,
                (double)g->length / (1 << 20));
}

static pd_ctl_identity_t identity(kv_conn_t *k, uint8_t *addr, size_t *addr_len)
{
    pd_ctl_identity_t me;
    memset(&me, 0, sizeof(me));
    me.engine_id = k->engine_id;
    me.role = k->is_prefill ? PD__ROLE__ROLE_PREFILL : PD__ROLE__ROLE_DECODE;
    me.fingerprint = &k->fp;
    me.pipe_kind = k->pipe_kind;
    if (k->pipe->ops->address(k->pipe, addr, addr_len) != PD_OK) {
        *addr_len = 0;
    }
    me.pipe_address = addr;
    me.pipe_address_len = *addr_len;
    me.token = k->token;
    me.token_len = k->token_len;
    return me;
}

/* After a handshake: connect the pipe to the peer's address and send our regions. */
static kv_peer_t *peer_new(kv_conn_t *k, int fd, pd_ctl_reader_t *rd, const char *dial, const char *engine_id,
                           Pd__PipeKind kind, const uint8_t *addr, size_t addr_len)
{
    if (kind != k->pipe_kind) {
        pd_log_error("kv connector: peer %s uses a different --kv-pipe; both sides must use %s", engine_id,
                     k->cfg.pipe);
        return NULL;
    }
    kv_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return NULL;
    }
    if (k->pipe->ops->connect(k->pipe, addr, addr_len, &p->pp) != PD_OK) {
        pd_log_error("kv connector: cannot connect the %s pipe to peer %s", k->cfg.pipe, engine_id);
        free(p);
        return NULL;
    }
    p->fd = fd;
    p->rd = *rd;
    snprintf(p->dial, sizeof(p->dial), "%s", dial);
    snprintf(p->engine_id, sizeof(p->engine_id), "%s", engine_id);
    p->state = KV_PEER_WAIT_REGIONS;
    p->since = p->last_rx = p->last_hb = pd_time_now_s();
    p->next = k->peers;
    k->peers = p;
    if (send_regions(k, p) != PD_OK) {
        peer_dead(k, p, "cannot export our KV region");
    }
    return p;
}

/* A non-blocking connect to host:port; -1 when it failed at once. */
static int dial_tcp(const char *host, int port)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        pd_log_error("kv connector: '%s' is not an IPv4 address", host);
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

static kv_dial_t *find_dial(kv_conn_t *k, const char *addr)
{
    for (kv_dial_t *d = k->dials; d != NULL; d = d->next) {
        if (strcmp(d->addr, addr) == 0) {
            return d;
        }
    }
    return NULL;
}

/* Starts dialling addr ("host:port"); false when that failed at once (logged). mu held. */
static bool dial_start(kv_conn_t *k, const char *addr)
{
    char host[64];
    int port = 0;
    if (sscanf(addr, "%63[^:]:%d", host, &port) != 2 || port <= 0 || port > 65535) {
        pd_log_error("kv connector: bad peer address '%s'", addr);
        return false;
    }
    int fd = dial_tcp(host, port);
    kv_dial_t *d = fd >= 0 ? calloc(1, sizeof(*d)) : NULL;
    if (d == NULL) {
        pd_log_warn("kv connector: cannot reach the KV control port %s: %s", addr, strerror(errno));
        pd_metric_inc(k->m.handshakes_failed, 1);
        if (fd >= 0) {
            close(fd);
        }
        return false;
    }
    snprintf(d->addr, sizeof(d->addr), "%s", addr);
    d->fd = fd;
    pd_ctl_reader_init(&d->rd, 0);
    pd_ctl_client_hs_init(&d->hs);
    d->started = pd_time_now_s();
    d->deadline = d->started + k->cfg.handshake_timeout;
    d->next = k->dials;
    k->dials = d;
    return true;
}

/* Dial *dp failed: its queued transfers fail (they will not find a peer), it goes. mu held. */
static void dial_fail(kv_conn_t *k, kv_dial_t **dp, const char *why)
{
    kv_dial_t *d = *dp;
    *dp = d->next;
    pd_log_error("kv connector: handshake with %s failed: %s", d->addr, why);
    pd_metric_inc(k->m.handshakes_failed, 1);
    for (kv_xfer_t *y = k->xfers; y != NULL; y = y->next) {
        if (y->state == KV_XS_QUEUED && y->peer == NULL && strcmp(y->dial, d->addr) == 0) {
            fail_xfer(k, y, "cannot connect to the prefill");
        }
    }
    pd_ctl_client_hs_destroy(&d->hs);
    pd_ctl_reader_destroy(&d->rd);
    close(d->fd);
    free(d);
}

/* Dial *dp's socket is ready: finish the connect and send the Hello, or take the server's
 * frames; an authenticated server becomes a kv_peer_t. mu held. */
static void dial_io(kv_conn_t *k, kv_dial_t **dp)
{
    kv_dial_t *d = *dp;
    char reason[256] = "";
    uint8_t a[PD_PIPE_ADDR_MAX];
    size_t al = sizeof(a);
    pd_ctl_identity_t me = identity(k, a, &al);
    pd_status_t st;
    if (!d->connected) {
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(d->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
            snprintf(reason, sizeof(reason), "cannot reach the KV control port: %s",
                     strerror(err ? err : errno));
            dial_fail(k, dp, reason);
            return;
        }
        int one = 1;
        setsockopt(d->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        d->connected = true;
        st = pd_ctl_client_hs_start(&d->hs, d->fd, &me, 100, reason, sizeof(reason));
        if (st != PD_OK) {
            dial_fail(k, dp, reason);
        }
        return;
    }
    st = pd_ctl_fill(d->fd, &d->rd, 0);
    if (st == PD_ERR_TIMEOUT) {
        return;
    }
    pd_ctl_msg_t ack = {0, NULL};
    if (st != PD_OK) {
        snprintf(reason, sizeof(reason), "handshake: %s", pd_status_str(st));
    } else if ((st = pd_ctl_client_hs_step(&d->hs, d->fd, &d->rd, &me, 100, &ack, reason, sizeof(reason))) ==
               PD_ERR_NOT_FOUND) {
        return;
    }
    if (st != PD_OK) {
        dial_fail(k, dp, reason);
        return;
    }
    const Pd__HelloAck *h = (const Pd__HelloAck *)ack.msg;
    kv_peer_t *p = peer_new(k, d->fd, &d->rd, d->addr, h->engine_id, h->pipe_kind, h->pipe_address.data,
                            h->pipe_address.len);
    bool prefill = h->role == PD__ROLE__ROLE_PREFILL;
    pd_ctl_msg_free(&ack);
    if (p == NULL) {
        dial_fail(k, dp, "cannot set up the peer");
        return;
    }
    *dp = d->next; /* the peer owns the fd and the reader now */
    pd_metric_inc(k->m.handshakes_ok, 1);
    pd_metric_observe(k->m.handshake_s, pd_time_now_s() - d->started);
    pd_log_info("kv connector: connected to %s engine %s at %s", prefill ? "prefill" : "decode", p->engine_id,
                d->addr);
    parse_frames(k, p);
    pd_ctl_client_hs_destroy(&d->hs);
    free(d);
}

/* Dials past their deadline fail. mu held. */
static void dial_expire(kv_conn_t *k)
{
    double now = pd_time_now_s();
    for (kv_dial_t **dp = &k->dials; *dp != NULL;) {
        if ((*dp)->deadline <= now) {
            dial_fail(k, dp, "timed out waiting for the peer");
        } else {
            dp = &(*dp)->next;
        }
    }
}

static void hs_free(kv_hs_t *h)
{
    pd_ctl_server_hs_destroy(&h->hs);
    pd_ctl_reader_destroy(&h->rd);
    close(h->fd);
    free(h);
}

/* Drops pending handshake *hp (unlinks it), counting it as failed. */
static void hs_drop(kv_conn_t *k, kv_hs_t **hp, const char *why)
{
    kv_hs_t *h = *hp;
    *hp = h->next;
    k->num_handshakes--;
    pd_log_warn("kv connector: refused a peer: %s", why);
    pd_metric_inc(k->m.handshakes_failed, 1);
    hs_free(h);
}

/* A new connection on the listener joins the pending handshakes (never waits for its bytes). */
static void accept_peer(kv_conn_t *k)
{
    int fd = accept4(k->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    kv_hs_t *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        close(fd);
        return;
    }
    h->fd = fd;
    pd_ctl_reader_init(&h->rd, 0);
    pd_ctl_server_hs_init(&h->hs);
    h->deadline = pd_time_now_s() + k->cfg.handshake_timeout;
    h->next = k->handshakes;
    k->handshakes = h;
    if (++k->num_handshakes > KV_MAX_HANDSHAKES) { /* the oldest is the list's last */
        kv_hs_t **hp = &k->handshakes;
        while ((*hp)->next != NULL) {
            hp = &(*hp)->next;
        }
        hs_drop(k, hp, "too many connections in the handshake (the oldest is dropped)");
    }
}

/* Pending handshake *hp's socket is readable: take its bytes and advance it; an authenticated
 * peer becomes a kv_peer_t. */
static void hs_read(kv_conn_t *k, kv_hs_t **hp)
{
    kv_hs_t *h = *hp;
    pd_status_t st = pd_ctl_fill(h->fd, &h->rd, 0);
    if (st == PD_ERR_TIMEOUT) {
        return; /* a spurious wake-up */
    }
    char reason[256] = "";
    pd_ctl_msg_t hello = {0, NULL};
    if (st != PD_OK) {
        snprintf(reason, sizeof(reason), "handshake: %s", pd_status_str(st));
    } else {
        uint8_t a[PD_PIPE_ADDR_MAX];
        size_t al = sizeof(a);
        pd_ctl_identity_t me = identity(k, a, &al);
        st = pd_ctl_server_hs_step(&h->hs, h->fd, &h->rd, &me, 100, &hello, reason, sizeof(reason));
        if (st == PD_ERR_NOT_FOUND) {
            return;
        }
    }
    if (st != PD_OK) {
        hs_drop(k, hp, reason);
        return;
    }
    *hp = h->next;
    k->num_handshakes--;
    const Pd__Hello *m = (const Pd__Hello *)hello.msg;
    pthread_mutex_lock(&k->mu);
    kv_peer_t *p =
        peer_new(k, h->fd, &h->rd, "", m->engine_id, m->pipe_kind, m->pipe_address.data, m->pipe_address.len);
    pthread_mutex_unlock(&k->mu);
    if (p == NULL) {
        pd_metric_inc(k->m.handshakes_failed, 1);
        hs_free(h);
    } else { /* the peer owns the fd and the reader (with any bytes that followed) now */
        pd_ctl_server_hs_destroy(&h->hs);
        free(h);
        pd_metric_inc(k->m.handshakes_ok, 1);
        pd_log_info("kv connector: accepted engine %s", p->engine_id);
    }
    pd_ctl_msg_free(&hello);
}

/* Pending handshakes past their deadline are dropped. */
static void hs_expire(kv_conn_t *k)
{
    double now = pd_time_now_s();
    for (kv_hs_t **hp = &k->handshakes; *hp != NULL;) {
        if ((*hp)->deadline <= now) {
            hs_drop(k, hp, "handshake: timed out waiting for the peer");
        } else {
            hp = &(*hp)->next;
        }
    }
}

/* ------------------------------------------------------------------ transfers */

static void observe_done(kv_conn_t *k, kv_xfer_t *x)
{
    double now = pd_time_now_s();
    if (x->kind != KV_X_PUSH_SAVE && x->t_posted > 0) {
        pd_metric_observe(k->m.phase_queue, x->t_posted - x->started);
        if (x->kind == KV_X_PULL_LOAD && x->t_moved > 0) {
            pd_metric_observe(k->m.phase_transfer, x->t_moved - x->t_posted);
            pd_metric_observe(k->m.phase_notify, now - x->t_moved);
        } else if (x->kind == KV_X_PUSH_LOAD) {
            pd_metric_observe(k->m.phase_remote, now - x->t_posted);
        }
    }
    pd_metric_inc(k->m.completed[x->kind], 1);
    pd_metric_observe(k->m.latency, pd_time_now_s() - x->started);
    pd_metric_observe(k->m.pages, (double)x->pages);
    pd_metric_inc(k->m.bytes, (double)x->bytes);
}

/* A decode load ended: the scheduler hears of it (and of the blocks that did not arrive). */
static void end_load(kv_conn_t *k, kv_xfer_t *x, bool ok)
{
    if (!ok && !x->cancelled && x->end_block > x->first_block) {
        kv_report_load_errors(k, x->local_blocks + x->first_block, x->end_block - x->first_block);
    }
    if (ok && !x->cancelled && k->staged && x->end_block > x->first_block) {
        kv_stage_load_done(k, x->local_blocks, x->first_block, x->end_block);
    }
    kv_report_recving(k, x->req_id);
    x->state = KV_XS_DONE;
}

static void fail_xfer(kv_conn_t *k, kv_xfer_t *x, const char *why)
{
    if (x->state == KV_XS_DONE) {
        return;
    }
    pd_log_warn("kv connector: transfer for request %s failed: %s", x->req_id, why);
    pd_metric_inc(k->m.failed[x->kind], 1);
    if (x->kind == KV_X_PUSH_SAVE) {
        kv_report_sending(k, x->req_id);
        x->state = KV_XS_DONE;
        return;
    }
    end_load(k, x, false);
}

static void after_pages(kv_conn_t *k, kv_xfer_t *x);

static void on_pages_done(void *arg, pd_status_t st)
{
    kv_xfer_t *x = arg;
    if (x->state != KV_XS_POSTED) {
        return;
    }
    if (st != PD_OK) {
        fail_xfer(x->conn, x, pd_status_str(st));
        return;
    }
    x->t_moved = pd_time_now_s();
    pd_log_debug("kv connector: request %s: %d pages moved %.3f ms after the transfer was queued", x->req_id,
                 x->pages, (pd_time_now_s() - x->started) * 1e3);
    after_pages(x->conn, x);
}

/* The pages moved: pull → READ_DONE and wait for the ACK; push save → WRITE_DONE, done. */
static void after_pages(kv_conn_t *k, kv_xfer_t *x)
{
    if (x->kind == KV_X_PULL_LOAD) {
        Pd__ReadDone rd = PD__READ_DONE__INIT;
        rd.request_id = x->remote_req;
        rd.lease_id = x->lease_id;
        rd.status = 0;
        x->state = KV_XS_WAIT_PEER;
        if (peer_send(k, x->peer, PD_MSG_READ_DONE, &rd.base) != PD_OK) {
            fail_xfer(k, x, "cannot send READ_DONE");
        }
        return;
    }
    Pd__WriteDone wd = PD__WRITE_DONE__INIT;
    wd.request_id = x->remote_req;
    wd.lease_id = x->resv->lease_id;
    wd.status = 0;
    wd.layers_written = k->geom.num_layers;
    x->resv->released = true;
    if (peer_send(k, x->peer, PD_MSG_WRITE_DONE, &wd.base) != PD_OK) {
        fail_xfer(k, x, "cannot send WRITE_DONE");
        return;
    }
    observe_done(k, x);
    kv_report_sending(k, x->req_id);
    x->state = KV_XS_DONE;
}

/* Starts a decode load (pull: read; push: reserve) or a prefill save on a ready peer. */
static void start_xfer(kv_conn_t *k, kv_xfer_t *x)
{
    kv_peer_t *p = x->peer;
    const kv_geom_t *rg = &p->geom;
    if (x->kind == KV_X_PUSH_LOAD) {
        Pd__Reservation r = PD__RESERVATION__INIT;
        r.request_id = x->remote_req;
        x->lease_id = ((pd_time_now_ns() * 0x9E3779B97F4A7C15ull) ^ (uintptr_t)x) & ((1ull << 52) - 1);
        r.lease_id = x->lease_id;
        r.expires_unix_ms = (uint64_t)time(NULL) * 1000 + (uint64_t)ms_of(x->deadline - pd_time_now_s());
        r.block_ids = x->local_blocks;
        r.n_block_ids = (size_t)(x->end_block < x->num_local ? x->end_block : x->num_local);
        r.num_tokens = (uint32_t)x->num_tokens;
        r.skip_blocks = (uint32_t)x->first_block;
        pd_metric_inc(k->m.started[KV_X_PUSH_LOAD], 1);
        x->state = KV_XS_WAIT_PEER;
        x->t_posted = pd_time_now_s();
        if (peer_send(k, p, PD_MSG_RESERVATION, &r.base) != PD_OK) {
            fail_xfer(k, x, "cannot send the reservation");
        }
        return;
    }
    /* pull load (read remote → local) or push save (write local → remote): every layer's pages
     * of blocks [first, end) */
    if (x->end_block > x->num_remote || x->end_block > x->num_local) {
        fail_xfer(k, x, "fewer blocks than the prompt needs");
        return;
    }
    for (int32_t b = x->first_block; b < x->end_block; b++) {
        if (x->remote_blocks[b] >= rg->num_blocks) {
            fail_xfer(k, x, "a remote block id is outside the peer's KV cache");
            return;
        }
        /* the side that loads must find every entry it holds on the other side (a sliding-window
         * group's null entries are outside the window) */
        uint32_t want = x->kind == KV_X_PULL_LOAD ? x->local_blocks[b] : x->remote_blocks[b];
        uint32_t have = x->kind == KV_X_PULL_LOAD ? x->remote_blocks[b] : x->local_blocks[b];
        if (want != 0 && have == 0) {
            fail_xfer(k, x, "the peer no longer holds a block inside the sliding window");
            return;
        }
    }
    pd_metric_inc(k->m.started[x->kind], 1);
    pd_log_debug("kv connector: request %s: starting %s of blocks [%d, %d) %.3f ms after it was queued",
                 x->req_id, x->kind == KV_X_PULL_LOAD ? "a read" : "a write", x->first_block, x->end_block,
                 (pd_time_now_s() - x->started) * 1e3);
    x->state = KV_XS_POSTED;
    x->t_posted = pd_time_now_s();
    int32_t n_blocks = x->end_block - x->first_block;
    if (n_blocks <= 0) {
        x->t_moved = x->t_posted;
        after_pages(k, x); /* a full local hit: nothing to move, just notify */
        return;
    }
    size_t n = (size_t)n_blocks * k->geom.num_layers;
    pd_page_xfer_t *pages = malloc(n * sizeof(*pages));
    if (pages == NULL) {
        fail_xfer(k, x, "out of memory");
        return;
    }
    size_t i = 0;
    for (uint32_t l = 0; l < k->geom.num_layers; l++) {
        for (int32_t b = x->first_block; b < x->end_block; b++) {
            if (!kv_entry_of_layer(&k->geom, b, (int32_t)l) || x->local_blocks[b] == 0 ||
                x->remote_blocks[b] == 0) {
                continue; /* another group's entry, or one outside a sliding window */
            }
            pages[i++] = (pd_page_xfer_t){
                k->geom.layer_offset[l] + (uint64_t)x->local_blocks[b] * k->geom.page_bytes,
                rg->layer_offset[l] + (uint64_t)x->remote_blocks[b] * rg->page_bytes, k->geom.page_bytes};
        }
    }
    n = i;
    if (n == 0) { /* every entry outside the window or a local hit: nothing to move */
        free(pages);
        x->t_moved = x->t_posted;
        after_pages(k, x);
        return;
    }
    x->pages = (int32_t)n;
    x->bytes = n * k->geom.page_bytes;
    pd_status_t st =
        x->kind == KV_X_PULL_LOAD
            ? pd_pipe_read_pages(k->pipe, p->pp, k->region, p->remote, pages, (int)n, on_pages_done, x)
            : pd_pipe_write_pages(k->pipe, p->pp, k->region, p->remote, pages, (int)n, on_pages_done, x);
    free(pages);
    if (st != PD_OK) {
        fail_xfer(k, x, pd_status_str(st));
    }
}

/* A push save binds the reservation for its transfer id (when one has arrived). */
static bool bind_resv(kv_conn_t *k, kv_xfer_t *x)
{
    for (kv_resv_t *rv = k->resvs; rv != NULL; rv = rv->next) {
        if (rv->taken || rv->released || rv->dead || strcmp(rv->transfer_id, x->remote_req) != 0) {
            continue;
        }
        rv->taken = true;
        x->resv = rv;
        x->peer = rv->peer;
        x->remote_blocks = malloc((size_t)(rv->num_blocks > 0 ? rv->num_blocks : 1) * sizeof(uint32_t));
        if (x->remote_blocks == NULL) {
            return false;
        }
        memcpy(x->remote_blocks, rv->blocks, (size_t)rv->num_blocks * sizeof(uint32_t));
        x->num_remote = rv->num_blocks;
        x->first_block = rv->skip_blocks;
        int32_t need = kv_entry(&k->geom, (x->num_tokens - 1 + k->block_size - 1) / k->block_size);
        x->end_block = need < rv->num_blocks ? need : rv->num_blocks;
        x->end_block = x->end_block < x->num_local ? x->end_block : x->num_local;
        if (x->first_block > x->end_block) {
            x->first_block = x->end_block;
        }
        return true;
    }
    return false;
}

static kv_peer_t *find_peer(kv_conn_t *k, const char *dial)
{
    for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
        if (p->state != KV_PEER_DEAD && strcmp(p->dial, dial) == 0) {
            return p;
        }
    }
    return NULL;
}

/* Moves queued transfers on: find or dial their peer, start them when it is ready. Called with
 * mu held; drops it around a dial. */
static void drive_queued(kv_conn_t *k)
{
    for (kv_xfer_t *x = k->xfers; x != NULL; x = x->next) {
        if (x->state != KV_XS_QUEUED) {
            continue;
        }
        if (x->kind == KV_X_PUSH_SAVE) {
            if (x->resv == NULL && !bind_resv(k, x)) {
                for (kv_resv_t *rv = k->resvs; rv != NULL; rv = rv->next) {
                    if (rv->dead && strcmp(rv->transfer_id, x->remote_req) == 0) {
                        fail_xfer(k, x, "the decode that reserved blocks for it is gone");
                        break;
                    }
                }
                continue; /* the reservation has not arrived */
            }
            if (x->peer->state == KV_PEER_READY) {
                start_xfer(k, x);
            }
            continue;
        }
        if (x->peer == NULL) {
            kv_peer_t *p = find_peer(k, x->dial);
            if (p != NULL && p->state == KV_PEER_READY && x->remote_engine[0] &&
                strcmp(p->engine_id, x->remote_engine) != 0 && !x->redialed) {
                /* the prefill behind this address restarted: refresh the connection once */
                x->redialed = true;
                peer_dead(k, p, "it restarted with a new engine id");
                p = NULL;
            }
            if (p == NULL) { /* dial (once per address); the transfer waits for the handshake */
                if (find_dial(k, x->dial) == NULL && !dial_start(k, x->dial)) {
                    fail_xfer(k, x, "cannot connect to the prefill");
                }
                continue;
            }
            x->peer = p;
        }
        if (x->peer->state == KV_PEER_DEAD) {
            fail_xfer(k, x, "peer gone");
        } else if (x->peer->state == KV_PEER_READY) {
            if (x->remote_engine[0] && strcmp(x->peer->engine_id, x->remote_engine) != 0) {
                fail_xfer(k, x, "the prefill that computed this KV no longer runs at that address");
            } else {
                start_xfer(k, x);
            }
        }
    }
}

/* ------------------------------------------------------------------ messages */

static kv_xfer_t *find_waiting(kv_conn_t *k, kv_peer_t *p, kv_xfer_kind_t kind, const char *rid,
                               uint64_t lease)
{
    for (kv_xfer_t *x = k->xfers; x != NULL; x = x->next) {
        if (x->kind == kind && x->state == KV_XS_WAIT_PEER && x->peer == p && x->lease_id == lease &&
            strcmp(x->remote_req, rid) == 0) {
            return x;
        }
    }
    return NULL;
}

static void send_ack(kv_conn_t *k, kv_peer_t *p, const char *rid, uint64_t lease, Pd__TransferAck__Result res)
{
    Pd__TransferAck a = PD__TRANSFER_ACK__INIT;
    a.request_id = (char *)rid;
    a.lease_id = lease;
    a.result = res;
    peer_send(k, p, PD_MSG_TRANSFER_ACK, &a.base);
}

static void on_read_done_msg(kv_conn_t *k, kv_peer_t *p, const Pd__ReadDone *m)
{
    double now = pd_time_now_s();
    for (kv_lease_t *l = k->leases; l != NULL; l = l->next) {
        if (l->lease_id != m->lease_id || strcmp(l->req_id, m->request_id) != 0) {
            continue;
        }
        if (l->expired || now > l->expires) {
            send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__STALE);
            pd_metric_inc(k->m.stale, 1);
            return; /* the timer releases (or released) the blocks */
        }
        send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__OK);
        l->expired = true; /* no longer held; kept briefly so a duplicate is answered STALE */
        l->expires = now;
        kv_report_sending(k, l->req_id);
        pd_metric_inc(k->m.completed[KV_X_PULL_LOAD], 1);
        return;
    }
    send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__UNKNOWN);
    pd_metric_inc(k->m.stale, 1);
}

static void on_reservation(kv_conn_t *k, kv_peer_t *p, const Pd__Reservation *m)
{
    const char *why = NULL;
    if (!k->is_prefill) {
        why = "this engine is not a prefill";
    } else if (m->request_id == NULL || m->request_id[0] == '\0' || strlen(m->request_id) >= PD_REQ_ID_MAX) {
        why = "bad transfer id";
    } else if (m->n_block_ids > 1u << 20 || m->skip_blocks > m->n_block_ids) {
        why = "block list out of range";
    } else {
        for (size_t i = 0; i < m->n_block_ids && why == NULL; i++) {
            if (m->block_ids[i] >= p->geom.num_blocks) {
                why = "a block id is outside the decode's KV cache";
            }
        }
        for (kv_resv_t *rv = k->resvs; rv != NULL && why == NULL; rv = rv->next) {
            if (!rv->released && strcmp(rv->transfer_id, m->request_id) == 0) {
                why = "duplicate transfer id";
            }
        }
    }
    kv_resv_t *rv = why == NULL ? calloc(1, sizeof(*rv)) : NULL;
    if (rv != NULL &&
        (rv->blocks = malloc((m->n_block_ids ? m->n_block_ids : 1) * sizeof(uint32_t))) == NULL) {
        free(rv);
        rv = NULL;
        why = "out of memory";
    }
    if (rv == NULL) {
        pd_log_warn("kv connector: rejected a reservation from %s: %s", p->engine_id,
                    why ? why : "out of memory");
        Pd__WriteDone wd = PD__WRITE_DONE__INIT;
        wd.request_id = m->request_id != NULL ? m->request_id : (char *)"";
        wd.lease_id = m->lease_id;
        wd.status = PD_ERR_OUT_OF_RANGE;
        peer_send(k, p, PD_MSG_WRITE_DONE, &wd.base);
        return;
    }
    snprintf(rv->transfer_id, sizeof(rv->transfer_id), "%s", m->request_id);
    rv->lease_id = m->lease_id;
    rv->peer = p;
    if (m->n_block_ids > 0) {
        memcpy(rv->blocks, m->block_ids, m->n_block_ids * sizeof(uint32_t));
    }
    rv->num_blocks = (int32_t)m->n_block_ids;
    rv->skip_blocks = (int32_t)m->skip_blocks;
    rv->num_tokens = (int32_t)m->num_tokens;
    rv->expires = pd_time_now_s() + k->cfg.hold_timeout;
    rv->next = k->resvs;
    k->resvs = rv;
}

static void on_message(kv_conn_t *k, kv_peer_t *p, const pd_ctl_msg_t *msg)
{
    switch (msg->type) {
    case PD_MSG_HEARTBEAT: break;
    case PD_MSG_REGIONS: on_regions(k, p, (const Pd__Regions *)msg->msg); break;
    case PD_MSG_READ_DONE:
        if (k->is_prefill) {
            on_read_done_msg(k, p, (const Pd__ReadDone *)msg->msg);
        }
        break;
    case PD_MSG_TRANSFER_ACK: {
        const Pd__TransferAck *a = (const Pd__TransferAck *)msg->msg;
        kv_xfer_t *x = find_waiting(k, p, KV_X_PULL_LOAD, a->request_id, a->lease_id);
        if (x == NULL) {
            break;
        }
        if (a->result == PD__TRANSFER_ACK__RESULT__OK) {
            observe_done(k, x);
            end_load(k, x, true);
        } else {
            fail_xfer(k, x,
                      a->result == PD__TRANSFER_ACK__RESULT__STALE
                          ? "the prefill's lease expired before the read completed (STALE): KV discarded"
                          : "the prefill does not know this request or lease: KV discarded");
        }
        break;
    }
    case PD_MSG_RESERVATION: on_reservation(k, p, (const Pd__Reservation *)msg->msg); break;
    case PD_MSG_WRITE_DONE: {
        const Pd__WriteDone *w = (const Pd__WriteDone *)msg->msg;
        kv_xfer_t *x = find_waiting(k, p, KV_X_PUSH_LOAD, w->request_id, w->lease_id);
        if (x == NULL) {
            break;
        }
        if (w->status == 0) {
            /* the pages the prefill wrote: each layer's entries this decode holds */
            x->pages = 0;
            for (uint32_t l = 0; l < k->geom.num_layers; l++) {
                for (int32_t b = x->first_block; b < x->end_block && b < x->num_local; b++) {
                    x->pages += kv_entry_of_layer(&k->geom, b, (int32_t)l) && x->local_blocks[b] != 0;
                }
            }
            x->bytes = (size_t)x->pages * k->geom.page_bytes;
            observe_done(k, x);
            end_load(k, x, true);
        } else {
            char why[96];
            snprintf(why, sizeof(why), "the prefill reports %s", pd_status_str((pd_status_t)w->status));
            fail_xfer(k, x, why);
        }
        break;
    }
    case PD_MSG_ABORT: {
        const Pd__Abort *a = (const Pd__Abort *)msg->msg;
        for (kv_lease_t *l = k->leases; l != NULL; l = l->next) {
            if (!l->expired && l->lease_id == a->lease_id && strcmp(l->req_id, a->request_id) == 0) {
                l->expired = true;
                l->expires = pd_time_now_s();
                kv_report_sending(k, l->req_id);
            }
        }
        break;
    }
    case PD_MSG_REJECT: peer_dead(k, p, "it rejected us"); break;
    default: peer_dead(k, p, "unexpected message type"); break;
    }
}

/* Handles every complete frame already buffered (a handshake may have read past its end). */
static void parse_frames(kv_conn_t *k, kv_peer_t *p)
{
    while (p->state != KV_PEER_DEAD) {
        pd_ctl_msg_t m = {0, NULL};
        pd_status_t st = pd_ctl_reader_next(&p->rd, &m);
        if (st == PD_ERR_NOT_FOUND) {
            return;
        }
        if (st != PD_OK) {
            peer_dead(k, p, "malformed control frame");
            return;
        }
        on_message(k, p, &m);
        pd_ctl_msg_free(&m);
    }
}

static void read_peer(kv_conn_t *k, kv_peer_t *p)
{
    uint8_t buf[16384];
    for (;;) {
        ssize_t n = recv(p->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            peer_dead(k, p, "control connection closed");
            return;
        }
        if (n < 0) {
            break;
        }
        if (pd_ctl_reader_feed(&p->rd, buf, (size_t)n) != PD_OK) {
            peer_dead(k, p, "control stream overflow");
            return;
        }
        p->last_rx = pd_time_now_s();
    }
    parse_frames(k, p);
}

/* ------------------------------------------------------------------ write jobs and notices */

static void on_job_done(void *arg, pd_status_t st)
{
    kv_write_job_t *j = arg;
    kv_conn_t *k = j->conn;
    k->jobs_posted--;
    if (j->gen == k->gen) {
        if (st == PD_OK) {
            k->jobs_done++;
        } else {
            k->jobs_failed++;
        }
        pthread_cond_broadcast(&k->cv);
    }
    if (st == PD_OK) {
        pd_metric_inc(k->m.bytes, (double)j->bytes);
        pd_metric_observe(k->m.pages, (double)j->num_pages);
    }
    free(j->pages);
    free(j);
}

static void post_jobs(kv_conn_t *k)
{
    kv_write_job_t *j = k->jobs;
    k->jobs = NULL;
    while (j != NULL) {
        kv_write_job_t *next = j->next;
        pd_status_t st = PD_ERR_PEER_GONE;
        k->jobs_posted++;
        if (j->peer->state == KV_PEER_READY) {
            st = pd_pipe_write_pages(k->pipe, j->peer->pp, k->region, j->peer->remote, j->pages, j->num_pages,
                                     on_job_done, j);
        }
        if (st != PD_OK) {
            on_job_done(j, st);
        }
        j = next;
    }
}

static void send_notices(kv_conn_t *k)
{
    kv_notice_t *n = k->notices;
    k->notices = NULL;
    while (n != NULL) {
        kv_notice_t *next = n->next;
        if (n->type == PD_MSG_WRITE_DONE) {
            Pd__WriteDone wd = PD__WRITE_DONE__INIT;
            wd.request_id = n->request_id;
            wd.lease_id = n->lease_id;
            wd.status = n->status;
            wd.layers_written = k->geom.num_layers;
            peer_send(k, n->peer, PD_MSG_WRITE_DONE, &wd.base);
        } else if (n->type == PD_MSG_ABORT) {
            Pd__Abort a = PD__ABORT__INIT;
            a.request_id = n->request_id;
            a.lease_id = n->lease_id;
            a.reason = (char *)"request aborted";
            peer_send(k, n->peer, PD_MSG_ABORT, &a.base);
        }
        free(n);
        n = next;
    }
}

/* ------------------------------------------------------------------ timers */

static void run_timers(kv_conn_t *k)
{
    double now = pd_time_now_s();
    int held = 0;
    for (kv_lease_t *l = k->leases; l != NULL; l = l->next) {
        held += !l->expired;
    }
    pd_metric_set(k->m.leases_now, held);
    double dead_after = k->cfg.heartbeat_interval * k->cfg.heartbeat_misses;
    for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
        if (p->state == KV_PEER_DEAD) {
            continue;
        }
        if (p->state == KV_PEER_WAIT_REGIONS && now - p->since > k->cfg.handshake_timeout) {
            peer_dead(k, p, "no region descriptor within --kv-handshake-timeout");
            continue;
        }
        if (now - p->last_rx > dead_after) {
            char why[96];
            snprintf(why, sizeof(why), "no heartbeat for %.1f s", now - p->last_rx);
            peer_dead(k, p, why);
            continue;
        }
        if (now - p->last_hb >= k->cfg.heartbeat_interval) {
            Pd__Heartbeat hb = PD__HEARTBEAT__INIT;
            hb.seq = ++p->hb_seq;
            hb.unix_ms = (uint64_t)time(NULL) * 1000;
            p->last_hb = now;
            peer_send(k, p, PD_MSG_HEARTBEAT, &hb.base);
        }
    }
    for (kv_xfer_t *x = k->xfers; x != NULL; x = x->next) {
        if (x->state == KV_XS_DONE || now < x->deadline) {
            continue;
        }
        if (x->kind == KV_X_PUSH_SAVE && x->state == KV_XS_QUEUED) {
            pd_log_warn(
                "kv connector: request %s: no reservation within --kv-hold-timeout; freeing its blocks",
                x->req_id);
            pd_metric_inc(k->m.leases_expired, 1);
            kv_report_sending(k, x->req_id);
            x->state = KV_XS_DONE;
        } else if (x->state == KV_XS_POSTED || (x->kind == KV_X_PUSH_LOAD && x->state == KV_XS_WAIT_PEER)) {
            /* pages may still move into our blocks: only a dead peer guarantees they stop */
            peer_dead(k, x->peer, "a transfer outlived --kv-load-timeout");
            if (x->state != KV_XS_DONE) {
                fail_xfer(k, x, "timed out");
            }
        } else {
            fail_xfer(k, x, "timed out");
        }
    }
    for (kv_lease_t **lp = &k->leases; *lp != NULL;) {
        kv_lease_t *l = *lp;
        if (!l->expired && now > l->expires) {
            pd_log_warn("kv connector: request %s: lease expired before a decode read it; freeing its blocks",
                        l->req_id);
            l->expired = true;
            pd_metric_inc(k->m.leases_expired, 1);
            kv_report_sending(k, l->req_id);
        }
        if (l->expired && now > l->expires + k->cfg.hold_timeout) {
            *lp = l->next;
            free(l);
        } else {
            lp = &l->next;
        }
    }
    for (kv_resv_t **rp = &k->resvs; *rp != NULL;) {
        kv_resv_t *rv = *rp;
        if (!rv->taken && !rv->released && now > rv->expires) {
            pd_log_warn("kv connector: reservation %s expired without a matching prefill request",
                        rv->transfer_id);
            Pd__WriteDone wd = PD__WRITE_DONE__INIT;
            wd.request_id = rv->transfer_id;
            wd.lease_id = rv->lease_id;
            wd.status = PD_ERR_TIMEOUT;
            peer_send(k, rv->peer, PD_MSG_WRITE_DONE, &wd.base);
            rv->released = true;
        }
        if (rv->released && !rv->taken && (!rv->dead || now > rv->expires)) {
            /* a dead peer's reservation stays until it would have expired, so a prefill request
             * for its transfer learns at once that nobody is waiting */
            *rp = rv->next;
            free(rv->blocks);
            free(rv);
        } else {
            rp = &rv->next;
        }
    }
    for (kv_xfer_t **xp = &k->xfers; *xp != NULL;) {
        kv_xfer_t *x = *xp;
        if (x->state == KV_XS_DONE) {
            if (x->resv != NULL) {
                x->resv->taken = false;
                x->resv->released = true;
            }
            *xp = x->next;
            kv_xfer_free(x);
        } else {
            xp = &x->next;
        }
    }
}

/* ------------------------------------------------------------------ the thread */

static void on_pipe_peer_error(void *arg, pd_pipe_peer_t *pp, pd_status_t st)
{
    kv_conn_t *k = arg;
    for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
        if (p->pp == pp && p->state != KV_PEER_DEAD) {
            peer_dead(k, p, pd_status_str(st));
        }
    }
}

static void *ctl_main(void *arg)
{
    kv_conn_t *k = arg;
    struct pollfd *pf = NULL;
    kv_peer_t **pp = NULL;
    size_t cap = 0;
    int pipe_fd = pd_pipe_wait_fd(k->pipe); /* -1: the pipe moves bytes inside progress */
    for (;;) {
        size_t n = 3 + (size_t)k->num_handshakes;
        for (kv_dial_t *d = k->dials; d != NULL; d = d->next) {
            n++;
        }
        for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
            n += p->fd >= 0;
        }
        if (n > cap) {
            cap = n * 2;
            pf = realloc(pf, cap * sizeof(*pf));
            pp = realloc(pp, cap * sizeof(*pp));
            if (pf == NULL || pp == NULL) {
                pd_log_error("kv connector: out of memory in the control thread");
                break;
            }
        }
        pf[0] = (struct pollfd){k->listen_fd, POLLIN, 0};
        pf[1] = (struct pollfd){k->wake_fd, POLLIN, 0};
        pf[2] = (struct pollfd){pipe_fd, POLLIN, 0}; /* ignored by poll when -1 */
        size_t i = 3;
        for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
            if (p->fd >= 0) {
                pp[i] = p;
                pf[i++] = (struct pollfd){p->fd, (short)(POLLIN | (p->out_len > 0 ? POLLOUT : 0)), 0};
            }
        }
        size_t hs0 = i; /* then the pending handshakes, in list order */
        for (kv_hs_t *h = k->handshakes; h != NULL; h = h->next) {
            pf[i++] = (struct pollfd){h->fd, POLLIN, 0};
        }
        size_t d0 = i; /* then our dials, in list order (the list changes only on this thread) */
        for (kv_dial_t *d = k->dials; d != NULL; d = d->next) {
            pf[i++] = (struct pollfd){d->fd, d->connected ? POLLIN : POLLOUT, 0};
        }
        pthread_mutex_lock(&k->mu);
        bool busy = k->jobs != NULL || k->handoff != NULL || k->notices != NULL;
        bool moving = k->jobs_posted > 0;
        for (kv_xfer_t *x = k->xfers; x != NULL && !moving; x = x->next) {
            moving = x->state == KV_XS_POSTED;
            /* queued work polls fast, except a transfer that waits for its dial (its fd wakes us) */
            busy = busy || (x->state == KV_XS_QUEUED && (x->peer != NULL || find_dial(k, x->dial) == NULL));
        }
        bool stop = k->stop;
        pthread_mutex_unlock(&k->mu);
        if (stop) {
            break;
        }
        /* the pipe's completions arrive through progress. UCX (and NCCL's event checks) want it
         * called continuously while pages move (a bounded number of operations advance per call):
         * spin until they land. The TCP pipe moves bytes on its own threads and its wait fd turns
         * readable when a completion is queued: sleep on it (a spin would take a core from those
         * threads; 2 cores here), with a 10 ms bound as a backstop. */
        bool spin = moving && pipe_fd < 0;
        struct timespec ts = {0, spin ? 0 : moving ? 10 * 1000 * 1000 : busy ? 200 * 1000 : 50 * 1000 * 1000};
        int rc = ppoll(pf, i, &ts, NULL);
        if (rc > 0 && (pf[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(k->wake_fd, &v, sizeof(v));
            (void)r;
        }
        /* handshakes first (their list changes as they finish), then new connections */
        size_t hj = hs0;
        for (kv_hs_t **hp = &k->handshakes; rc > 0 && *hp != NULL && hj < i; hj++) {
            kv_hs_t *h = *hp;
            if (pf[hj].revents != 0) {
                hs_read(k, hp);
            }
            if (*hp == h) {
                hp = &h->next; /* still pending */
            }
        }
        hs_expire(k);
        if (rc > 0 && (pf[0].revents & POLLIN)) {
            accept_peer(k);
        }
        pthread_mutex_lock(&k->mu);
        size_t dj = d0;
        for (kv_dial_t **dp = &k->dials; rc > 0 && *dp != NULL && dj < i; dj++) {
            kv_dial_t *d = *dp;
            if (pf[dj].revents != 0) {
                dial_io(k, dp);
            }
            if (*dp == d) {
                dp = &d->next;
            }
        }
        dial_expire(k);
        for (size_t j = 3; rc > 0 && j < hs0; j++) {
            if ((pf[j].revents & POLLOUT) && pp[j]->state != KV_PEER_DEAD) {
                flush_peer(k, pp[j]);
            }
            if ((pf[j].revents & ~POLLOUT) != 0 && pp[j]->state != KV_PEER_DEAD) {
                read_peer(k, pp[j]);
            }
        }
        for (kv_peer_t *p = k->peers; p != NULL; p = p->next) {
            if (p->state != KV_PEER_DEAD && p->rd.len > 0) {
                parse_frames(k, p); /* frames that arrived with a handshake */
            }
        }
        pd_pipe_progress(k->pipe);
        while (k->handoff != NULL) {
            kv_xfer_t *x = k->handoff;
            k->handoff = x->next;
            x->conn = k;
            x->next = k->xfers;
            k->xfers = x;
            if (x->cancelled && x->kind != KV_X_PUSH_SAVE) {
                end_load(k, x, false); /* aborted before it started */
            }
        }
        post_jobs(k);
        send_notices(k);
        drive_queued(k);
        run_timers(k);
        pthread_mutex_unlock(&k->mu);
    }
    free(pf);
    free(pp);
    return NULL;
}

pd_status_t kv_ctl_start(kv_conn_t *k)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)k->listen_port);
    int one = 1;
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    }
    if (fd < 0 || inet_pton(AF_INET, k->listen_host, &a.sin_addr) != 1 ||
        bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 64) != 0) {
        pd_log_error("kv connector: cannot listen on %s:%d: %s", k->listen_host, k->listen_port,
                     strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return PD_ERR_IO;
    }
    socklen_t al = sizeof(a);
    getsockname(fd, (struct sockaddr *)&a, &al);
    k->listen_port = ntohs(a.sin_port);
    k->listen_fd = fd;
    k->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (k->wake_fd < 0) {
        return PD_ERR_IO;
    }
    k->pipe->ops->set_peer_error_cb(k->pipe, on_pipe_peer_error, k);
    if (pthread_create(&k->thread, NULL, ctl_main, k) != 0) {
        pd_log_error("kv connector: cannot start the control thread");
        return PD_ERR_INTERNAL;
    }
    k->thread_started = true;
    pd_log_info("kv connector: control plane listening on %s:%d (advertised as %s:%d)", k->listen_host,
                k->listen_port, k->advertise_host, k->listen_port);
    return PD_OK;
}

void kv_ctl_stop(kv_conn_t *k)
{
    if (k->thread_started) {
        pthread_mutex_lock(&k->mu);
        k->stop = true;
        pthread_mutex_unlock(&k->mu);
        kv_ctl_wake(k);
        pthread_join(k->thread, NULL);
        k->thread_started = false;
    }
    /* the pipe completes every pending operation (CANCELLED) before it goes */
    pthread_mutex_lock(&k->mu);
    for (kv_peer_t *p = k->peers; p != NULL && k->pipe != NULL; p = p->next) {
        if (p->remote != NULL) {
            k->pipe->ops->release_remote(k->pipe, p->remote);
            p->remote = NULL;
        }
    }
    pd_pipe_destroy(k->pipe);
    k->pipe = NULL;
    k->region = NULL;
    pthread_mutex_unlock(&k->mu);
    while (k->dials != NULL) {
        kv_dial_t *d = k->dials;
        k->dials = d->next;
        pd_ctl_client_hs_destroy(&d->hs);
        pd_ctl_reader_destroy(&d->rd);
        close(d->fd);
        free(d);
    }
    while (k->handshakes != NULL) {
        kv_hs_t *h = k->handshakes;
        k->handshakes = h->next;
        hs_free(h);
    }
    k->num_handshakes = 0;
    while (k->peers != NULL) {
        kv_peer_t *p = k->peers;
        k->peers = p->next;
        if (p->fd >= 0) {
            close(p->fd);
        }
        pd_ctl_reader_destroy(&p->rd);
        free(p->out);
        free(p);
    }
    while (k->xfers != NULL) {
        kv_xfer_t *x = k->xfers;
        k->xfers = x->next;
        kv_xfer_free(x);
    }
    while (k->handoff != NULL) {
        kv_xfer_t *x = k->handoff;
        k->handoff = x->next;
        kv_xfer_free(x);
    }
    while (k->leases != NULL) {
        kv_lease_t *l = k->leases;
        k->leases = l->next;
        free(l);
    }
    while (k->resvs != NULL) {
        kv_resv_t *rv = k->resvs;
        k->resvs = rv->next;
        free(rv->blocks);
        free(rv);
    }
    while (k->jobs != NULL) {
        kv_write_job_t *j = k->jobs;
        k->jobs = j->next;
        free(j->pages);
        free(j);
    }
    while (k->notices != NULL) {
        kv_notice_t *n = k->notices;
        k->notices = n->next;
        free(n);
    }
    if (k->listen_fd >= 0) {
        close(k->listen_fd);
        k->listen_fd = -1;
    }
    if (k->wake_fd >= 0) {
        close(k->wake_fd);
        k->wake_fd = -1;
    }
}
