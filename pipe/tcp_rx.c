/* pipe/tcp_rx.c — the TCP pipe's receiver thread: accepted data connections wait for an
 * authenticated HELLO (session MAC) before they are bound to a peer; then one frame at a time per
 * readable socket (writes land after every page was validated, reads are answered through the sender
 * thread, tensors matched to posted receives). Released peers are freed between event batches. */
#define _GNU_SOURCE
#include "pipe/tcp_internal.h"

/* ------------------------------------------------------------------ receiver thread */

/* Queues the answer to a peer's request (mu held). -1 when it cannot be made (out of memory,
 * logged): the caller drops the connection, so the peer's operation fails (PD_ERR_PEER_GONE) at
 * once instead of waiting for an answer that never comes. */
static int send_reply(tcp_pipe_t *t, pd_pipe_peer_t *peer, int type, uint64_t op_id, int32_t status,
                      const tcp_region_t *r, const desc_t *d, uint32_t n, uint64_t total)
{
    job_t *j = tcpi_job_new(peer, 1 + (int)n, sizeof(hdr_t));
    if (j == NULL) {
        pd_log_error("tcp pipe: out of memory answering peer %016llx; dropping its connection",
                     (unsigned long long)peer->id);
        return -1;
    }
    j->on_in = true; /* back on the request's connection, to the requester's progress */
    hdr_t *h = j->owned;
    *h = (hdr_t){TCP_MAGIC, (uint8_t)type, {0}, op_id, 0, status, 0, 0, r != NULL ? total : 0};
    j->iov[0] = (struct iovec){h, sizeof(*h)};
    j->niov = 1;
    for (uint32_t i = 0; r != NULL && i < n; i++) {
        j->iov[j->niov++] = (struct iovec){(char *)r->pub.base + d[i].off, d[i].len};
    }
    tcpi_enqueue(t, j);
    return 0;
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

/* M_WRITE: pages for one of our regions; refused (and drained) unless the peer may write there.
 * pre: bytes of the frame's header and descriptors still on fd, read (into skip) with the pages. */
static int rx_write(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const hdr_t *h, const desc_t *d, void *skip,
                    size_t pre)
{
    pthread_mutex_lock(&t->mu);
    tcp_region_t *r = tcpi_region_by_id(t, h->region_id);
    bool ok = r != NULL && tcpi_allowed(t, h->region_id, peer, true) && descs_ok(r, d, h->count, h->len);
    pthread_mutex_unlock(&t->mu);
    int rc;
    if (!ok) {
        pd_log_warn(
            "tcp pipe: refused a write of %u pages from peer %016llx (region %u not writable by it or "
            "pages outside it)",
            h->count, (unsigned long long)peer->id, h->region_id);
        rc = tcpi_discard(fd, pre + h->len);
    } else {
        rc = tcpi_read_pages(fd, skip, pre, r->pub.base, d, h->count);
    }
    if (rc == 0) {
        pthread_mutex_lock(&t->mu);
        rc = send_reply(t, peer, M_WRITE_ACK, h->op_id, ok ? PD_OK : PD_ERR_OUT_OF_RANGE, NULL, NULL, 0, 0);
        pthread_mutex_unlock(&t->mu);
    }
    return rc;
}

/* M_READ_REQ: the peer reads pages of one of our regions (answered with the pages, or refused). */
static int rx_read_req(tcp_pipe_t *t, pd_pipe_peer_t *peer, const hdr_t *h, const desc_t *d)
{
    pthread_mutex_lock(&t->mu);
    tcp_region_t *r = tcpi_region_by_id(t, h->region_id);
    bool ok = r != NULL && tcpi_allowed(t, h->region_id, peer, false) && descs_ok(r, d, h->count, UINT64_MAX);
    uint64_t total = 0;
    for (uint32_t i = 0; ok && i < h->count; i++) {
        total += d[i].len;
    }
    int rc = send_reply(t, peer, M_READ_RESP, h->op_id, ok ? PD_OK : PD_ERR_OUT_OF_RANGE, ok ? r : NULL, d,
                        h->count, total);
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        pd_log_warn("tcp pipe: refused a read of region %u by peer %016llx", h->region_id,
                    (unsigned long long)peer->id);
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
    pthread_mutex_lock(&t->mu);
    size_t buffered = peer->unexpected_bytes;
    pthread_mutex_unlock(&t->mu);
    if (buffered + h->count + h->len > t->max_msg) {
        pd_log_warn("tcp pipe: peer %016llx sent %zu bytes of tensors nobody has asked for; dropping it",
                    (unsigned long long)peer->id, buffered + (size_t)h->count + (size_t)h->len);
        return -1;
    }
    unexpected_t *u = calloc(1, sizeof(*u));
    if (u != NULL) {
        u->tag = h->op_id;
        u->hdr = malloc(h->count + 1);
        u->payload = malloc(h->len + 1);
        u->hdr_len = h->count;
        u->payload_len = h->len;
    }
    if (u == NULL || u->hdr == NULL || u->payload == NULL || tcpi_read_full(fd, u->hdr, h->count) != 0 ||
        tcpi_read_full(fd, u->payload, h->len) != 0) {
        if (u != NULL) {
            tcpi_unexpected_free(u);
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
        tcpi_complete_op(t, o, st, u->hdr_len, u->payload_len);
        tcpi_unexpected_free(u);
    } else {
        pd_list_add_tail(&peer->unexpected, &u->link);
        peer->unexpected_bytes += u->hdr_len + u->payload_len;
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
        rc = tcpi_read_full(fd, o->hbuf, h->count);
        if (rc == 0) {
            rc = tcpi_read_full(fd, o->pbuf, h->len);
        }
        st = rc == 0 ? PD_OK : PD_ERR_PEER_GONE;
    } else {
        rc = tcpi_discard(fd, (uint64_t)h->count + h->len);
        st = PD_ERR_NO_SPACE;
    }
    pthread_mutex_lock(&t->mu);
    tcpi_complete_op(t, o, st, h->count, h->len);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Reads one request frame (a write, a read request, a tensor) from peer's connection fd and
 * dispatches it by type; replies never come this way (the requester's progress reads them on its
 * own connection), so one here is a protocol violation. `peek` holds the first npeek bytes waiting
 * on fd (a MSG_PEEK, or nothing): when they hold a write's header and descriptors, those are read
 * with its pages, in one readv. */
int tcpi_rx_frame(tcp_pipe_t *t, pd_pipe_peer_t *peer, int fd, const void *peek, size_t npeek)
{
    hdr_t h;
    uint8_t skip[TCP_PEEK_BYTES]; /* where the known bytes go when read */
    size_t pre = 0;               /* bytes at the head of fd known from the peek, not read yet */
    npeek = npeek < sizeof(skip) ? npeek : sizeof(skip);
    if (npeek >= sizeof(h)) {
        memcpy(&h, peek, sizeof(h));
        pre = sizeof(h);
    } else if (tcpi_read_full(fd, &h, sizeof(h)) != 0) {
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
        size_t dbytes = (size_t)h.count * sizeof(desc_t);
        d = malloc(dbytes + 1);
        if (d == NULL) {
            return -1;
        }
        if (pre > 0 && npeek >= pre + dbytes) {
            memcpy(d, (const char *)peek + pre, dbytes);
            pre += dbytes;
        } else if ((pre > 0 && tcpi_discard(fd, pre) != 0) || tcpi_read_full(fd, d, dbytes) != 0) {
            free(d);
            return -1;
        } else {
            pre = 0;
        }
    }
    /* a write's known bytes go with its pages; the other frames take them now */
    if (pre > 0 && h.type != M_WRITE) {
        if (tcpi_discard(fd, pre) != 0) {
            free(d);
            return -1;
        }
        pre = 0;
    }
    int rc;
    switch (h.type) {
    case M_WRITE: rc = rx_write(t, peer, fd, &h, d, skip, pre); break;
    case M_READ_REQ: rc = rx_read_req(t, peer, &h, d); break;
    case M_TENSOR: rc = rx_tensor(t, peer, fd, &h); break;
    default: /* (replies come back on the request's connection, read by progress: not here) */
        pd_log_warn("tcp pipe: unexpected frame type %u from peer %016llx", h.type,
                    (unsigned long long)peer->id);
        rc = -1;
    }
    free(d);
    return rc;
}

/* fd sent HELLO h, authenticated for peer (whose session its MAC matched): it becomes that peer's
 * incoming connection, unless the peer died meanwhile. */
static void hello_to_peer(tcp_pipe_t *t, int fd, const hdr_t *h, pd_pipe_peer_t *peer)
{
    (void)h;
    pthread_mutex_lock(&t->mu);
    if (peer->dead) {
        peer = NULL;
    }
    if (peer != NULL && peer->in_fd >= 0 && !peer->in_used && !peer->reading) {
        /* a connection that never carried a frame, superseded: the peer connects again only after
         * declaring us dead, so the older one is its previous incarnation's (accepted late, after
         * we had declared that one dead too). This relies on each incarnation having its own
         * session, as the connector's handshakes give it: under one session an old connection
         * accepted after the new one would displace it (test_pipe reconnect_after_fail hung so,
         * 1 in ~300 under load, until it used a new session as the connector does) */
        pd_log_info("tcp pipe: peer %016llx connected again; its earlier, unused connection is dropped",
                    (unsigned long long)peer->id);
        tcpi_drop_in(t, peer);
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
void tcpi_pending_drop(tcp_pipe_t *t, pending_in_t *c)
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
    tcpi_tune_socket(fd);
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
        tcpi_pending_drop(t, pd_list_head(&t->pending, pending_in_t, link)); /* the oldest */
    }
}

/* HMAC-SHA256(session, "pd-data" | from | to | nonce): a data connection's proof that its dialer
 * (pipe id from) holds the session secret it shares with the acceptor (pipe id to). */
void tcpi_hello_mac(const uint8_t *session, uint64_t from, uint64_t to, const uint8_t *nonce, uint8_t out[32])
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

/* c's HELLO (header + authentication, read into c->hello as it arrives) is usable: the magic, a
 * peer this side connected to, and a MAC under that peer's session (of the live records claiming
 * its pipe id, the one whose session the MAC matches: *peer_out). 1 yes (*h filled), 0 not yet (more
 * bytes to come, or no record whose session it proves so far: c waits, until its deadline drops an
 * unauthenticated one), -1 drop it (garbled, or closed first). */
static int hello_check(tcp_pipe_t *t, pending_in_t *c, hdr_t *h, pd_pipe_peer_t **peer_out)
{
    while (c->got < sizeof(c->hello)) {
        ssize_t k = recv(c->fd, c->hello + c->got, sizeof(c->hello) - c->got, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return 0; /* the rest of the HELLO is on its way */
        }
        if (k <= 0) {
            return -1; /* closed (or failed) before the HELLO was complete */
        }
        c->got += (size_t)k;
        memcpy(h, c->hello, c->got < sizeof(*h) ? c->got : sizeof(*h));
        if (c->got >= sizeof(h->magic) && h->magic != TCP_MAGIC) {
            return -1; /* not our protocol: no need to wait for the rest */
        }
    }
    const uint8_t *buf = c->hello;
    memcpy(h, buf, sizeof(*h));
    if (h->magic != TCP_MAGIC || h->type != M_HELLO || h->len != TCP_HELLO_AUTH) {
        return -1;
    }
    uint8_t want[32];
    pd_pipe_peer_t *peer = NULL, *p;
    bool claimed = false; /* a live record has this id */
    pthread_mutex_lock(&t->mu);
    pd_list_for_each (p, &t->peers, link) {
        if (p->id != h->op_id || p->dead) {
            continue;
        }
        claimed = true;
        tcpi_hello_mac(p->session, h->op_id, t->id, buf + sizeof(*h), want);
        if (pd_ct_equal(want, buf + sizeof(*h) + TCP_HELLO_NONCE, 32)) {
            peer = p;
            break;
        }
    }
    pthread_mutex_unlock(&t->mu);
    if (peer == NULL) {
        /* no record of this id yet, or none whose session the MAC matches: two engines that each
         * dial the other at once (a prefill reading a decode's lent prefix while that decode
         * reserves blocks with it) hold two records of one id, and a HELLO may come a moment before
         * its own record; it waits for the next connect, an impostor's at most TCP_HELLO_RACE_S */
        struct pollfd pf = {c->fd, POLLRDHUP, 0};
        if (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
            return -1; /* the dialer gave up waiting */
        }
        if (claimed && !c->waiting) {
            double race = pd_time_now_s() + TCP_HELLO_RACE_S;
            c->deadline = c->deadline < race ? c->deadline : race;
        }
        pending_wait(t, c);
        return 0;
    }
    if (h->region_id != TCP_WIRE_VERSION) { /* (told only to a peer that proved its session) */
        pd_log_error("tcp pipe: peer %016llx speaks tcp wire version %u and this node %u: no KV can move "
                     "between them over tcp (upgrade the pool together); its data connection is refused",
                     (unsigned long long)h->op_id, h->region_id, TCP_WIRE_VERSION);
        return -1;
    }
    *peer_out = peer;
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
    pd_pipe_peer_t *peer = NULL; /* records are freed on this thread only: valid through this call */
    int ok = hello_check(t, c, &h, &peer);
    if (ok <= 0) {
        if (ok < 0) {
            tcpi_pending_drop(t, c);
        }
        return;
    }
    int fd = c->fd;
    pd_list_del(&c->link);
    t->num_pending--;
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, fd, NULL);
    free(c);
    hello_to_peer(t, fd, &h, peer);
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
            tcpi_pending_drop(t, c);
        }
    }
}

/* peer's incoming connection is readable: serve one frame (unless the peer died meanwhile). Returns whether it was a request (busy polling follows those). */
static bool rx_peer(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    pthread_mutex_lock(&t->mu);
    bool dead = peer->dead || peer->in_fd < 0; /* declared dead, or its connection dropped, since
                                                * this event was reported */
    if (!dead) {
        peer->reading = true; /* nobody closes in_fd meanwhile (tcpi_reap_fds) */
    }
    pthread_mutex_unlock(&t->mu);
    if (dead) {
        return false;
    }
    /* one peek: whether a frame is there (an EAGAIN after all is harmless), and its header and
     * descriptors, so that the frame costs one more syscall (the readv of it) */
    union {
        hdr_t h;
        uint8_t b[TCP_PEEK_BYTES];
    } peek;
    ssize_t k = recv(peer->in_fd, peek.b, sizeof(peek.b), MSG_PEEK | MSG_DONTWAIT);
    int rc = k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                 ? 0
                 : tcpi_rx_frame(t, peer, peer->in_fd, peek.b, k > 0 ? (size_t)k : 0);
    pthread_mutex_lock(&t->mu);
    peer->reading = false;
    tcpi_reap_fds(t, peer); /* it died while we read */
    if (rc != 0 && !peer->in_used && !peer->dead) {
        /* closed before its first frame: a previous incarnation's connection, accepted after we had
         * declared that one dead (the connector then handshook again). Not this peer's death: a
         * real one is found by writes failing and the heartbeat. */
        pd_log_info(
            "tcp pipe: an incoming connection from peer %016llx closed before its first frame; dropped",
            (unsigned long long)peer->id);
        tcpi_drop_in(t, peer);
    } else if (rc != 0) {
        tcpi_mark_dead(t, peer, PD_ERR_PEER_GONE);
    } else if (k > 0) {
        peer->in_used = true;
    }
    pthread_mutex_unlock(&t->mu);
    return k >= (ssize_t)sizeof(peek.h) &&
           (peek.h.type == M_WRITE || peek.h.type == M_READ_REQ || peek.h.type == M_TENSOR);
}

/* The receiver thread: the data listener and every peer's incoming connection (epoll). */

/* Whether a released peer is still used: by a thread (sending to it, reading from it), a socket, a
 * queued job or a pending op. mu held. */
static bool peer_in_use(tcp_pipe_t *t, const pd_pipe_peer_t *pe)
{
    if (pe->out_fd >= 0 || pe->in_fd >= 0 || pe->reading || pe->out_reading || pe->resp_op != NULL ||
        (t->tx_busy && t->tx_peer == pe)) {
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
        tcpi_peer_free(pe);
    }
    pthread_mutex_unlock(&t->mu);
}

void *tcpi_rx_main(void *arg)
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
