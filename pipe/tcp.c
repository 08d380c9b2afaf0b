/* pipe/tcp.c — the TCP pipe: two-sided emulation of page writes/reads over plain sockets.
 *
 * Each peer pair uses two connections, one per direction (A's outgoing socket is B's incoming
 * one). Per pipe, a receiver thread reads every incoming socket and never blocks on a write (so it
 * always drains, whatever the other side does). A frame is written by the thread that makes it when
 * the socket takes it at once; what it does not take goes to a sender thread's queue, which keeps
 * each peer's order. A request's reply (a write's ack, a read's pages) goes back on the connection
 * the request came in on, and the requester's progress reads it there (the caller's wait fd polls
 * that socket): the reply wakes the caller itself, not the receiver thread and then the caller.
 * The receiver validates every page of a write — region exported to that peer with write
 * permission, offset and length inside it — before a byte lands; bad pages are consumed and
 * refused with an error ack.
 *
 * Frame: hdr_t, then per type: WRITE count × desc_t + data; READ_REQ count × desc_t; READ_RESP
 * data; TENSOR hdr bytes + payload; HELLO a nonce and its session MAC; WRITE_ACK nothing.
 *
 * This file is the pd_pipe_ops_t API; tcp_io.c holds the helpers under the lock, socket I/O and the
 * sender thread, tcp_rx.c the receiver thread, tcp_internal.h the representation. */
#define _GNU_SOURCE
#include "common/huge_alloc.h"
#include "pipe/tcp_internal.h"

/* ------------------------------------------------------------------ API */

static pd_status_t tcp_create(const pd_pipe_config_t *cfg, pd_pipe_t **out)
{
    tcp_pipe_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    t->base.ops = &pd_pipe_tcp_ops;
    t->listen_fd = t->epfd = t->wake_fd = t->wait_ep = -1;
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
    t->wait_ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event cev = {EPOLLIN, {.ptr = NULL}};
    if (t->epfd < 0 || t->wake_fd < 0 || t->wait_ep < 0 || pd_pipe_cq_open_fd(&t->cq) != PD_OK ||
        epoll_ctl(t->wait_ep, EPOLL_CTL_ADD, t->cq.efd, &cev) != 0) {
        pd_log_error("tcp pipe: cannot create its epoll/eventfd descriptors: %s", strerror(errno));
        pd_pipe_tcp_ops.destroy(&t->base);
        return PD_ERR_IO;
    }
    struct epoll_event ev = {EPOLLIN, {.ptr = NULL}};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->listen_fd, &ev);
    struct epoll_event wev = {EPOLLIN, {.ptr = t}};
    epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->wake_fd, &wev);
    t->rx_started = pthread_create(&t->rx, NULL, tcpi_rx_main, t) == 0;
    t->tx_started = t->rx_started && pthread_create(&t->tx, NULL, tcpi_tx_main, t) == 0;
    if (!t->tx_started) { /* destroy joins the one that did start */
        pd_log_error("tcp pipe: cannot start its %s thread", t->rx_started ? "sender" : "receiver");
        pd_pipe_tcp_ops.destroy(&t->base);
        return PD_ERR_INTERNAL;
    }
    *out = &t->base;
    return PD_OK;
}

/* Moves the current read response's position n bytes on, past exhausted and empty pages. */
static void resp_advance(pd_pipe_peer_t *peer, size_t n)
{
    const op_t *o = peer->resp_op;
    peer->resp_left -= n;
    for (;;) {
        while (peer->resp_page < (uint32_t)o->n && peer->resp_off == o->pages[peer->resp_page].len) {
            peer->resp_page++, peer->resp_off = 0;
        }
        if (n == 0 || peer->resp_page == (uint32_t)o->n) {
            return;
        }
        uint64_t room = o->pages[peer->resp_page].len - peer->resp_off;
        uint64_t step = room < n ? room : n;
        peer->resp_off += step;
        n -= (size_t)step;
    }
}

/* Copies n bytes (no more than the response has left) into the current read response's pages. */
static void resp_put(pd_pipe_peer_t *peer, const uint8_t *src, size_t n)
{
    const op_t *o = peer->resp_op;
    while (n > 0) {
        resp_advance(peer, 0);
        const desc_t *d = &o->pages[peer->resp_page];
        size_t k = d->len - peer->resp_off < n ? (size_t)(d->len - peer->resp_off) : n;
        memcpy((char *)o->local->pub.base + d->off + peer->resp_off, src, k);
        src += k, n -= k;
        resp_advance(peer, k);
    }
}

/* Reads more of the current read response straight into its pages, without blocking: one readv of
 * up to 64 pages, at most `budget` bytes. Returns bytes read, 0 when none are there, -1 when the
 * connection failed or closed. */
static ssize_t resp_readv(pd_pipe_peer_t *peer, size_t budget)
{
    const op_t *o = peer->resp_op;
    struct iovec iov[64];
    int k = 0;
    size_t want = 0;
    uint64_t off = peer->resp_off;
    for (uint32_t i = peer->resp_page; i < (uint32_t)o->n && k < 64 && want < budget; i++, off = 0) {
        size_t len = (size_t)(o->pages[i].len - off);
        len = len < budget - want ? len : budget - want;
        if (len > 0) {
            iov[k++] = (struct iovec){(char *)o->local->pub.base + o->pages[i].off + off, len};
            want += len;
        }
    }
    ssize_t r = readv(peer->out_fd, iov, k);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return 0;
    }
    if (r <= 0) {
        return -1;
    }
    resp_advance(peer, (size_t)r);
    return r;
}

/* One reply's header, in the reader (mu not held). 0 handled, -1 a protocol violation (logged). A
 * write's ack completes its write; a read response's header starts the response (its pages follow)
 * or, refused, completes the read with the responder's status. Only replies to operations this side
 * posted, of the size they asked for, are taken: anything else drops the peer. */
static int reply_header(tcp_pipe_t *t, pd_pipe_peer_t *peer, const hdr_t *h)
{
    int kind = h->type == M_WRITE_ACK ? OP_WRITE : h->type == M_READ_RESP ? OP_READ : -1;
    pthread_mutex_lock(&t->mu);
    op_t *o = h->magic == TCP_MAGIC && kind >= 0 ? tcpi_take_op(t, h->op_id, peer, kind) : NULL;
    pd_status_t st = (pd_status_t)h->status;
    bool ok = o != NULL && (kind == OP_WRITE ? h->len == 0 : st == PD_OK ? h->len == o->total : h->len == 0);
    if (ok && (kind == OP_WRITE || st != PD_OK || h->len == 0)) {
        tcpi_complete_op(t, o, st, 0, 0);
    } else if (ok) {
        peer->resp_op = o;
        peer->resp_left = h->len;
        peer->resp_page = 0;
        peer->resp_off = 0;
    } else if (o != NULL) {
        tcpi_complete_op(t, o, PD_ERR_PARSE, 0, 0);
    }
    pthread_mutex_unlock(&t->mu);
    if (!ok) {
        pd_log_warn("tcp pipe: peer %016llx sent a reply (type %u, %llu bytes) to no request of ours of "
                    "that size; dropping it",
                    (unsigned long long)peer->id, h->type, (unsigned long long)h->len);
        return -1;
    }
    return 0;
}

/* Reads what has come back on peer's outgoing connection (claimed by this progress call: mu not
 * held; out_fd does not block): write acks, read responses whose pages go straight to the region,
 * up to TCP_REPLY_BUDGET bytes. 0, or -1 when the peer must be dropped (its connection closed or
 * failed, or it sent what nobody asked for). */
static int read_replies(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    size_t budget = TCP_REPLY_BUDGET;
    for (;;) {
        if (peer->resp_op != NULL) { /* a response's pages: from the buffer, then the socket */
            size_t n = peer->rbuf_len < peer->resp_left ? peer->rbuf_len : (size_t)peer->resp_left;
            if (n > 0) {
                resp_put(peer, peer->rbuf, n);
                memmove(peer->rbuf, peer->rbuf + n, peer->rbuf_len - n);
                peer->rbuf_len -= n;
            } else {
                ssize_t r = resp_readv(peer, budget);
                if (r <= 0) {
                    return (int)r;
                }
                budget -= budget < (size_t)r ? budget : (size_t)r;
            }
            if (peer->resp_left == 0) {
                pthread_mutex_lock(&t->mu);
                tcpi_complete_op(t, peer->resp_op, PD_OK, 0, 0);
                peer->resp_op = NULL;
                pthread_mutex_unlock(&t->mu);
            }
            if (budget == 0) {
                return 0; /* the rest at the next call (the wait fd stays readable) */
            }
            continue;
        }
        if (peer->rbuf_len >= sizeof(hdr_t)) {
            hdr_t h;
            memcpy(&h, peer->rbuf, sizeof(h));
            memmove(peer->rbuf, peer->rbuf + sizeof(h), peer->rbuf_len - sizeof(h));
            peer->rbuf_len -= sizeof(h);
            if (reply_header(t, peer, &h) != 0) {
                return -1;
            }
            continue;
        }
        ssize_t k = recv(peer->out_fd, peer->rbuf + peer->rbuf_len, sizeof(peer->rbuf) - peer->rbuf_len,
                         MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return 0;
        }
        if (k <= 0) {
            return -1;
        }
        peer->rbuf_len += (size_t)k;
    }
}

/* Takes the replies to our requests, in the caller's thread: a caller sleeping on the wait fd is
 * woken by the reply's arrival itself, and one polling progress finds it, without the receiver
 * thread waking up in between (on this VM a wake-up costs more than the transfer of a page). One
 * epoll_wait names the peers with bytes waiting; each is claimed (out_reading: its record is not
 * freed nor its socket closed meanwhile) and read without mu. mu held on entry and exit. */
static void take_replies(tcp_pipe_t *t)
{
    struct epoll_event evs[32];
    pd_pipe_peer_t *ready[32];
    int n = epoll_wait(t->wait_ep, evs, 32, 0), m = 0;
    for (int i = 0; i < n; i++) {
        pd_pipe_peer_t *peer = evs[i].data.ptr; /* (NULL: the completion eventfd, taken by cq_take) */
        if (peer == NULL || peer->dead || peer->out_fd < 0 || peer->out_reading) {
            continue;
        }
        if (peer->connecting) { /* only its failure is reported while it connects */
            if (tcpi_out_ready(peer) < 0) {
                tcpi_mark_dead(t, peer, PD_ERR_PEER_GONE);
            }
            continue;
        }
        peer->out_reading = true;
        ready[m++] = peer;
    }
    for (int i = 0; i < m; i++) {
        pd_pipe_peer_t *peer = ready[i];
        pthread_mutex_unlock(&t->mu);
        int rc = read_replies(t, peer);
        pthread_mutex_lock(&t->mu);
        peer->out_reading = false;
        if (rc != 0) {
            tcpi_mark_dead(t, peer, PD_ERR_PEER_GONE);
        }
        tcpi_resp_fail(t, peer, PD_ERR_PEER_GONE); /* a response cut short by its death */
        tcpi_reap_fds(t, peer);
    }
}

static int tcp_progress(pd_pipe_t *p)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    t->cq.quiet = true; /* what take_replies pushes is taken below: no eventfd round */
    take_replies(t);
    t->cq.quiet = false;
    pd_pipe_completion_t *c = pd_pipe_cq_take(&t->cq);
    pthread_mutex_unlock(&t->mu);
    return pd_pipe_cq_run(c);
}

static int tcp_wait_fd(pd_pipe_t *p)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    return t->wait_ep;
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
    if (t->tx_started) {
        pthread_join(t->tx, NULL);
    }
    if (t->rx_started) {
        pthread_join(t->rx, NULL);
    }
}

/* Every pending operation and queued send ends with PD_ERR_CANCELLED; no peer callback runs after this. The
 * threads are stopped. */
static void cancel_all(tcp_pipe_t *t)
{
    while (!pd_list_is_empty(&t->pending)) {
        tcpi_pending_drop(t, pd_list_head(&t->pending, pending_in_t, link));
    }
    pthread_mutex_lock(&t->mu);
    op_t *o;
    while ((o = pd_list_pop_head(&t->ops, op_t, link)) != NULL) {
        tcpi_complete_op(t, o, PD_ERR_CANCELLED, 0, 0);
    }
    pd_pipe_peer_t *pe;
    pd_list_for_each (pe, &t->peers, link) {
        if (pe->resp_op != NULL) { /* a read whose response was arriving */
            tcpi_complete_op(t, pe->resp_op, PD_ERR_CANCELLED, 0, 0);
            pe->resp_op = NULL;
        }
    }
    job_t *j;
    while ((j = pd_list_pop_head(&t->jobs, job_t, link)) != NULL) {
        if (j->complete_on_send != NULL) {
            tcpi_complete_op(t, j->complete_on_send, PD_ERR_CANCELLED, 0, 0);
        }
        tcpi_job_free(j);
    }
    t->peer_cb = NULL;
    pthread_mutex_unlock(&t->mu);
}

/* Close a peer's sockets and free its record and its unclaimed messages. */
void tcpi_peer_free(pd_pipe_peer_t *pe)
{
    if (pe->out_fd >= 0) {
        close(pe->out_fd);
    }
    if (pe->in_fd >= 0) {
        close(pe->in_fd);
    }
    unexpected_t *u;
    while ((u = pd_list_pop_head(&pe->unexpected, unexpected_t, link)) != NULL) {
        tcpi_unexpected_free(u);
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
        tcpi_peer_free(pe);
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
    if (t->wait_ep >= 0) {
        close(t->wait_ep);
    }
    pd_pipe_cq_close(&t->cq);
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

/* Starts a connect to host:port without waiting (the caller is the connector's control thread:
 * a stalled connect held it, and every transfer, up to TCP_CONNECT_TIMEOUT_MS) and builds the
 * authenticated HELLO, the first job of the connection; the sender thread writes it once the
 * socket connects (tcpi_out_ready). The fd, or -1 (logged); *connecting: still in progress. */
static int dial_data(tcp_pipe_t *t, const char *host, int port, uint64_t to, const uint8_t *session,
                     bool *connecting, job_t **hello_out)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    int rc = -1;
    errno = EINVAL; /* a host inet_pton refuses */
    if (fd >= 0 && inet_pton(AF_INET, host, &a.sin_addr) == 1) {
        rc = connect(fd, (const struct sockaddr *)&a, sizeof(a));
        rc = rc != 0 && errno == EINPROGRESS ? 1 : rc;
    }
    if (rc < 0) {
        pd_log_error("tcp pipe: cannot connect to %s:%d: %s", host, port, strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    *connecting = rc == 1;
    tcpi_tune_socket(fd);
    job_t *j = tcpi_job_new(NULL, 1, sizeof(hdr_t) + TCP_HELLO_AUTH);
    if (j == NULL) {
        close(fd);
        return -1;
    }
    hdr_t *h = j->owned;
    *h = (hdr_t){TCP_MAGIC, M_HELLO, {0}, t->id, TCP_WIRE_VERSION, 0, 0, 0, TCP_HELLO_AUTH};
    uint8_t *auth = (uint8_t *)(h + 1);
    if (getrandom(auth, TCP_HELLO_NONCE, 0) != TCP_HELLO_NONCE) {
        tcpi_job_free(j);
        close(fd);
        return -1;
    }
    tcpi_hello_mac(session, t->id, to, auth, auth + TCP_HELLO_NONCE);
    j->iov[0] = (struct iovec){h, sizeof(*h) + TCP_HELLO_AUTH};
    *hello_out = j;
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
    bool connecting = false;
    job_t *hello = NULL;
    int fd = dial_data(t, host, port, (uint64_t)id, key, &connecting, &hello);
    if (fd < 0) {
        return PD_ERR_PEER_GONE;
    }
    pthread_mutex_lock(&t->mu);
    /* a record per (id, session): another peer claiming this id (issue 51: it locked the real one
     * out) has its own record, and each HELLO is matched by its MAC */
    pd_pipe_peer_t *peer = tcpi_peer_by_id(t, (uint64_t)id, key, true);
    if (peer == NULL || peer->out_fd >= 0) {
        pthread_mutex_unlock(&t->mu);
        tcpi_job_free(hello);
        close(fd);
        return peer == NULL ? PD_ERR_NO_MEMORY : PD_ERR_INVALID_ARG;
    }
    struct epoll_event ev = {EPOLLIN, {.ptr = peer}}; /* its acks (and a failed connect) wake the caller */
    if (epoll_ctl(t->wait_ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        pd_log_error("tcp pipe: cannot watch the connection to %s:%d: %s", host, port, strerror(errno));
        pthread_mutex_unlock(&t->mu);
        tcpi_job_free(hello);
        close(fd);
        return PD_ERR_IO;
    }
    peer->out_fd = fd;
    peer->connecting = connecting;
    peer->connect_deadline = pd_time_now_s() + TCP_CONNECT_TIMEOUT_MS / 1000.0;
    snprintf(peer->dialled, sizeof(peer->dialled), "%s:%d", host, port);
    memcpy(peer->session, key, sizeof(key));
    hello->peer = peer;
    tcpi_enqueue(t, hello); /* first on the connection: jobs of one peer keep their order */
    t->recheck = true;      /* its data connection to us may be waiting already */
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
    void *base = pd_huge_alloc(len, 4096); /* a KV pool: its pages are read in no order */
    if (base == NULL) {
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

/* Queues an op whose peer is already dead: it completes at the next progress (its node is
 * reserved). */
static pd_status_t fail_now(tcp_pipe_t *t, pd_pipe_done_cb cb, pd_pipe_recv_cb rcb, void *arg, uint64_t tag)
{
    pd_pipe_completion_t c = {cb, rcb, NULL, NULL, arg, PD_ERR_PEER_GONE, tag, 0, 0, NULL};
    tcpi_complete(t, c);
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
    job_t *j = tcpi_job_new(peer, 1 + (write ? n : 0), sizeof(hdr_t) + (size_t)n * sizeof(desc_t));
    if (o == NULL || j == NULL) {
        free(o);
        if (j != NULL) {
            tcpi_job_free(j);
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
            tcpi_job_free(j);
            return PD_ERR_NO_MEMORY;
        }
        for (int i = 0; i < n; i++) {
            o->pages[i] = (desc_t){pages[i].local_off, pages[i].len};
        }
        o->n = n;
        o->total = total;
    }
    pthread_mutex_lock(&t->mu);
    if (pd_pipe_cq_reserve(&t->cq) != PD_OK) {
        pthread_mutex_unlock(&t->mu);
        free(o->pages), free(o);
        tcpi_job_free(j);
        return PD_ERR_NO_MEMORY;
    }
    if (peer->dead || peer->out_fd < 0) {
        free(o->pages), free(o);
        tcpi_job_free(j);
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
    tcpi_enqueue(t, j);
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
    job_t *j = tcpi_job_new(peer, 3, sizeof(hdr_t));
    if (o == NULL || j == NULL) {
        free(o);
        if (j != NULL) {
            tcpi_job_free(j);
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
    if (pd_pipe_cq_reserve(&t->cq) != PD_OK) {
        pthread_mutex_unlock(&t->mu);
        free(o);
        tcpi_job_free(j);
        return PD_ERR_NO_MEMORY;
    }
    if (peer->dead || peer->out_fd < 0) {
        free(o);
        tcpi_job_free(j);
        fail_now(t, cb, NULL, arg, tag);
    } else {
        tcpi_enqueue(t, j);
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
    if (pd_pipe_cq_reserve(&t->cq) != PD_OK) {
        pthread_mutex_unlock(&t->mu);
        return PD_ERR_NO_MEMORY;
    }
    unexpected_t *u;
    pd_list_for_each (u, &peer->unexpected, link) {
        if (u->tag != tag) {
            continue;
        }
        pd_list_del(&u->link);
        peer->unexpected_bytes -= u->hdr_len + u->payload_len;
        pd_status_t st = PD_OK;
        if (u->hdr_len <= hdr_cap && u->payload_len <= payload_cap) {
            memcpy(hdr, u->hdr, u->hdr_len);
            memcpy(payload, u->payload, u->payload_len);
        } else {
            st = PD_ERR_NO_SPACE;
        }
        pd_pipe_completion_t c = {NULL, cb, NULL, NULL, arg, st, tag, u->hdr_len, u->payload_len, NULL};
        tcpi_complete(t, c);
        tcpi_unexpected_free(u);
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
    tcpi_mark_dead(t, peer, st);
    pthread_mutex_unlock(&t->mu);
}

static void tcp_release_peer(pd_pipe_t *p, pd_pipe_peer_t *peer)
{
    tcp_pipe_t *t = (tcp_pipe_t *)p;
    pthread_mutex_lock(&t->mu);
    tcpi_mark_dead(t, peer, PD_ERR_PEER_GONE);
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
