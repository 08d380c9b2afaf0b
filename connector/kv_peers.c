/* connector/kv_peers.c — the control thread's peers: the listener's pending handshakes and our
 * dials (non-blocking, one frame at a time, a deadline each), authenticated peers and their region
 * exchange, the per-peer output queue, reading frames, and a peer's death. Control thread. */
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

#include "common/array.h"
#include "common/log.h"
#include "common/time.h"
#include "connector/kv_ctl.h"

#define KV_MAX_BACKLOG (4u << 20) /* control bytes queued to a peer that does not read */

static int count_ready(const kv_conn_t *k);
static pd_status_t send_regions(kv_conn_t *k, kv_peer_t *p);
static pd_ctl_identity_t identity(kv_conn_t *k, uint8_t *addr, size_t *addr_len);
static kv_peer_t *peer_new(kv_conn_t *k, int fd, pd_ctl_reader_t *rd, const char *dial,
                           const Pd__Identity *id, const uint8_t *session);
static int dial_tcp(const char *host, int port);
static void dial_fail(kv_conn_t *k, kv_dial_t *d, const char *why);
static void hs_drop(kv_conn_t *k, kv_hs_t *h, const char *why);

static int count_ready(const kv_conn_t *k)
{
    int n = 0;
    const kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        n += p->state == KV_PEER_READY;
    }
    return n;
}

/* Writes what p's output queue holds without waiting; a peer whose queue outgrows
 * KV_MAX_BACKLOG (it stopped reading) or whose socket fails is dead. */
pd_status_t kv_flush_peer(kv_conn_t *k, kv_peer_t *p)
{
    while (p->out_len > 0 && p->state != KV_PEER_DEAD) {
        ssize_t w = send(p->fd, p->out, p->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            break;
        }
        if (w <= 0) {
            kv_peer_dead(k, p, "control connection closed");
            return PD_ERR_PEER_GONE;
        }
        memmove(p->out, p->out + w, p->out_len - (size_t)w);
        p->out_len -= (size_t)w;
    }
    if (p->out_len > KV_MAX_BACKLOG) {
        kv_peer_dead(k, p, "it stopped reading control messages");
        return PD_ERR_PEER_GONE;
    }
    return p->state == KV_PEER_DEAD ? PD_ERR_PEER_GONE : PD_OK;
}

/* Queues one control message to p and writes what the socket takes now (never waits). */
pd_status_t kv_peer_send(kv_conn_t *k, kv_peer_t *p, pd_msg_type_t type, const ProtobufCMessage *msg)
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
    if (pd_array_reserve(&p->out, &p->out_cap, p->out_len + len) != PD_OK) {
        free(f);
        return PD_ERR_NO_MEMORY;
    }
    memcpy(p->out + p->out_len, f, len);
    p->out_len += len;
    free(f);
    return kv_flush_peer(k, p);
}

void kv_peer_dead(kv_conn_t *k, kv_peer_t *p, const char *why)
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
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->peer == p && x->state != KV_XS_POSTED && x->state != KV_XS_DONE) {
            kv_fail_xfer(k, x, why);
        }
    }
    kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        if (rv->peer == p) {
            kv_resv_end(k, rv, true);
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
    return kv_peer_send(k, p, PD_MSG_REGIONS, &msg.base);
}

void kv_on_regions(kv_conn_t *k, kv_peer_t *p, const Pd__Regions *m)
{
    if (p->state != KV_PEER_WAIT_REGIONS || m->n_regions != 1) {
        kv_peer_dead(k, p, "unexpected Regions message");
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
        kv_peer_dead(k, p, why);
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
    me.server_addr = k->advertise_addr; /* as a server; a dial names the address it dialled */
    return me;
}

/* After a handshake: connect the pipe to the peer's address (with the session secret the handshake
 * derived) and send our regions. */
static kv_peer_t *peer_new(kv_conn_t *k, int fd, pd_ctl_reader_t *rd, const char *dial,
                           const Pd__Identity *id, const uint8_t *session)
{
    const char *engine_id = id->engine_id;
    Pd__PipeKind kind = id->pipe_kind;
    const uint8_t *addr = id->pipe_address.data;
    size_t addr_len = id->pipe_address.len;
    if (kind != k->pipe_kind) {
        pd_log_error("kv connector: peer %s uses a different --kv-pipe; both sides must use %s", engine_id,
                     k->cfg.pipe);
        return NULL;
    }
    kv_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return NULL;
    }
    if (k->pipe->ops->connect(k->pipe, addr, addr_len, session, &p->pp) != PD_OK) {
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
    pd_list_add_tail(&k->c->peers, &p->link);
    if (send_regions(k, p) != PD_OK) {
        kv_peer_dead(k, p, "cannot export our KV region");
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

kv_dial_t *kv_find_dial(kv_conn_t *k, const char *addr)
{
    kv_dial_t *d;
    pd_list_for_each (d, &k->c->dials, link) {
        if (strcmp(d->addr, addr) == 0) {
            return d;
        }
    }
    return NULL;
}

/* Starts dialling addr ("host:port"); false when that failed at once (logged). */
bool kv_dial_start(kv_conn_t *k, const char *addr)
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
    pd_list_add_tail(&k->c->dials, &d->link);
    return true;
}

/* Dial d failed: its queued transfers fail (they will not find a peer), it goes. */
static void dial_fail(kv_conn_t *k, kv_dial_t *d, const char *why)
{
    pd_list_del(&d->link);
    pd_log_error("kv connector: handshake with %s failed: %s", d->addr, why);
    pd_metric_inc(k->m.handshakes_failed, 1);
    kv_xfer_t *y;
    pd_list_for_each (y, &k->c->xfers, link) {
        if (y->state == KV_XS_QUEUED && y->peer == NULL && strcmp(y->dial, d->addr) == 0) {
            kv_fail_xfer(k, y, "cannot connect to the prefill");
        }
    }
    pd_ctl_client_hs_destroy(&d->hs);
    pd_ctl_reader_destroy(&d->rd);
    close(d->fd);
    free(d);
}

/* Dial d's socket is ready: finish the connect and send the Hello, or take the server's frames;
 * an authenticated server becomes a kv_peer_t (d leaves the dials and is freed). */
void kv_dial_io(kv_conn_t *k, kv_dial_t *d)
{
    char reason[256] = "";
    uint8_t a[PD_PIPE_ADDR_MAX];
    size_t al = sizeof(a);
    pd_ctl_identity_t me = identity(k, a, &al);
    me.server_addr = d->addr; /* the server proves it is the one at this address */
    pd_status_t st;
    if (!d->connected) {
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(d->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
            snprintf(reason, sizeof(reason), "cannot reach the KV control port: %s",
                     strerror(err ? err : errno));
            dial_fail(k, d, reason);
            return;
        }
        int one = 1;
        setsockopt(d->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        d->connected = true;
        st = pd_ctl_client_hs_start(&d->hs, d->fd, &me, 100, reason, sizeof(reason));
        if (st != PD_OK) {
            dial_fail(k, d, reason);
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
        dial_fail(k, d, reason);
        return;
    }
    const Pd__Identity *h = pd_ctl_peer_identity(&ack); /* checked by the handshake */
    kv_peer_t *p = peer_new(k, d->fd, &d->rd, d->addr, h, d->hs.session);
    bool prefill = h->role == PD__ROLE__ROLE_PREFILL;
    pd_ctl_msg_free(&ack);
    if (p == NULL) {
        dial_fail(k, d, "cannot set up the peer");
        return;
    }
    pd_list_del(&d->link); /* the peer owns the fd and the reader now */
    pd_metric_inc(k->m.handshakes_ok, 1);
    pd_metric_observe(k->m.handshake_s, pd_time_now_s() - d->started);
    pd_log_info("kv connector: connected to %s engine %s at %s", prefill ? "prefill" : "decode", p->engine_id,
                d->addr);
    kv_aborts_deliver(k, p);
    kv_parse_frames(k, p);
    pd_ctl_client_hs_destroy(&d->hs);
    free(d);
}

/* Dials past their deadline fail. */
void kv_dial_expire(kv_conn_t *k)
{
    double now = pd_time_now_s();
    kv_dial_t *d, *tmp;
    pd_list_for_each_safe (d, tmp, &k->c->dials, link) {
        if (d->deadline <= now) {
            dial_fail(k, d, "timed out waiting for the peer");
        }
    }
}

void kv_hs_free(kv_hs_t *h)
{
    pd_ctl_server_hs_destroy(&h->hs);
    pd_ctl_reader_destroy(&h->rd);
    close(h->fd);
    free(h);
}

/* Drops pending handshake h (unlinks it), counting it as failed. */
static void hs_drop(kv_conn_t *k, kv_hs_t *h, const char *why)
{
    pd_list_del(&h->link);
    k->c->num_handshakes--;
    pd_log_warn("kv connector: refused a peer: %s", why);
    pd_metric_inc(k->m.handshakes_failed, 1);
    kv_hs_free(h);
}

/* A new connection on the listener joins the pending handshakes (never waits for its bytes). */
void kv_accept_peer(kv_conn_t *k)
{
    int fd = accept4(k->c->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* the listener stays readable: leave it out of the poll set for a while (poll_build)
             * instead of spinning on the error */
            if (pd_time_now_s() - k->c->accept_logged > 10) { /* once per episode */
                pd_log_warn("kv connector: cannot accept a control connection (%s); pausing accepts for "
                            "100 ms at a time",
                            strerror(errno));
                k->c->accept_logged = pd_time_now_s();
            }
            k->c->accept_resume = pd_time_now_s() + 0.1;
        }
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
    pd_list_add_tail(&k->c->handshakes, &h->link);
    if (++k->c->num_handshakes > KV_MAX_HANDSHAKES) {
        hs_drop(k, pd_list_head(&k->c->handshakes, kv_hs_t, link),
                "too many connections in the handshake (the oldest is dropped)");
    }
}

/* Pending handshake h's socket is readable: take its bytes and advance it; an authenticated peer
 * becomes a kv_peer_t (h leaves the handshakes and is freed). */
void kv_hs_read(kv_conn_t *k, kv_hs_t *h)
{
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
        hs_drop(k, h, reason);
        return;
    }
    pd_list_del(&h->link);
    k->c->num_handshakes--;
    const Pd__Identity *m = pd_ctl_peer_identity(&hello); /* checked by the handshake */
    kv_peer_t *p = peer_new(k, h->fd, &h->rd, "", m, h->hs.session);
    if (p == NULL) {
        pd_metric_inc(k->m.handshakes_failed, 1);
        kv_hs_free(h);
    } else { /* the peer owns the fd and the reader (with any bytes that followed) now */
        pd_ctl_server_hs_destroy(&h->hs);
        free(h);
        pd_metric_inc(k->m.handshakes_ok, 1);
        char from[64] = "?";
        struct sockaddr_in a;
        socklen_t al = sizeof(a);
        if (getpeername(p->fd, (struct sockaddr *)&a, &al) == 0 && a.sin_family == AF_INET) {
            char ip[INET_ADDRSTRLEN];
            snprintf(from, sizeof(from), "%s:%d", inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip)),
                     ntohs(a.sin_port));
        }
        pd_log_info("kv connector: accepted %s engine %s from %s (%s)",
                    m->role == PD__ROLE__ROLE_PREFILL ? "prefill" : "decode", p->engine_id, from,
                    k->token_len > 0 ? "proved the cluster token" : "no cluster token: not authenticated");
    }
    pd_ctl_msg_free(&hello);
}

/* Pending handshakes past their deadline are dropped. */
void kv_hs_expire(kv_conn_t *k)
{
    double now = pd_time_now_s();
    kv_hs_t *h, *tmp;
    pd_list_for_each_safe (h, tmp, &k->c->handshakes, link) {
        if (h->deadline <= now) {
            hs_drop(k, h, "handshake: timed out waiting for the peer");
        }
    }
}

kv_peer_t *kv_find_peer(kv_conn_t *k, const char *dial)
{
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->state != KV_PEER_DEAD && strcmp(p->dial, dial) == 0) {
            return p;
        }
    }
    return NULL;
}

/* Handles every complete frame already buffered (a handshake may have read past its end). */
void kv_parse_frames(kv_conn_t *k, kv_peer_t *p)
{
    while (p->state != KV_PEER_DEAD) {
        pd_ctl_msg_t m = {0, NULL};
        pd_status_t st = pd_ctl_reader_next(&p->rd, &m);
        if (st == PD_ERR_NOT_FOUND) {
            return;
        }
        if (st != PD_OK) {
            kv_peer_dead(k, p, "malformed control frame");
            return;
        }
        kv_on_message(k, p, &m);
        pd_ctl_msg_free(&m);
    }
}

/* Takes what p's control socket has, each slice's whole frames handled before the next is read: the
 * reader holds at most one partial frame, so any number of legal frames in a row fit its bound
 * (issue 51: several large ones read before any was parsed overflowed it and killed the peer). At
 * most 64 slices (1 MiB) a call, so one peer cannot hold the control loop. */
void kv_read_peer(kv_conn_t *k, kv_peer_t *p)
{
    uint8_t buf[16384];
    for (int slice = 0; slice < 64 && p->state != KV_PEER_DEAD; slice++) {
        ssize_t n = recv(p->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            kv_peer_dead(k, p, "control connection closed");
            return;
        }
        if (n < 0) {
            break;
        }
        if (pd_ctl_reader_feed(&p->rd, buf, (size_t)n) != PD_OK) {
            kv_peer_dead(k, p, "control stream overflow");
            return;
        }
        p->last_rx = pd_time_now_s();
        kv_parse_frames(k, p);
    }
}
