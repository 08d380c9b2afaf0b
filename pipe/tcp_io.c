/* pipe/tcp_io.c — the TCP pipe's helpers under its lock (completions, ops, peers and their death,
 * permissions, the job queue), blocking socket I/O, and the sender thread. See tcp_internal.h. */
#define _GNU_SOURCE
#include "pipe/tcp_internal.h"

/* ------------------------------------------------------------------ small helpers (mu held) */

void tcpi_complete(tcp_pipe_t *t, pd_pipe_completion_t c)
{
    pd_pipe_cq_push(&t->cq, &c);
}

void tcpi_complete_op(tcp_pipe_t *t, op_t *o, pd_status_t st, size_t hlen, size_t plen)
{
    pd_pipe_completion_t c = {o->done, o->recv_cb, NULL, NULL, o->arg, st, o->tag, hlen, plen, NULL};
    tcpi_complete(t, c);
    t->writes -= o->kind == OP_WRITE;
    free(o->pages);
    free(o);
}

op_t *tcpi_take_op(tcp_pipe_t *t, uint64_t id, pd_pipe_peer_t *peer, int kind)
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
void tcpi_reap_fds(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    if (!peer->dead) {
        return;
    }
    if (peer->out_fd >= 0 && !peer->out_reading && !(t->tx_busy && t->tx_peer == peer)) {
        close(peer->out_fd);
        peer->out_fd = -1;
    }
    if (peer->in_fd >= 0 && !peer->reading && !(t->tx_busy && t->tx_peer == peer)) {
        close(peer->in_fd); /* mark_dead took it out of the epoll set */
        peer->in_fd = -1;
    }
}

void tcpi_resp_fail(tcp_pipe_t *t, pd_pipe_peer_t *peer, pd_status_t st)
{
    if (peer->dead && peer->resp_op != NULL && !peer->out_reading) {
        tcpi_complete_op(t, peer->resp_op, st, 0, 0);
        peer->resp_op = NULL;
    }
}

void tcpi_mark_dead(tcp_pipe_t *t, pd_pipe_peer_t *peer, pd_status_t st)
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
            tcpi_complete_op(t, o, st, 0, 0);
        }
    }
    tcpi_resp_fail(t, peer, st);
    if (t->peer_cb != NULL) {
        pd_pipe_completion_t c = {NULL, NULL, t->peer_cb, peer, t->peer_cb_arg, st, 0, 0, 0, NULL};
        tcpi_complete(t, c);
    }
    if (peer->out_fd >= 0) {
        epoll_ctl(t->wait_ep, EPOLL_CTL_DEL, peer->out_fd, NULL); /* (or progress would spin on it) */
        shutdown(peer->out_fd, SHUT_RDWR);
    }
    if (peer->in_fd >= 0) {
        /* out of the receiver's epoll set first: a shut-down socket polls readable (EOF) forever,
         * and the receiver skips dead peers, so it would spin */
        epoll_ctl(t->epfd, EPOLL_CTL_DEL, peer->in_fd, NULL);
        shutdown(peer->in_fd, SHUT_RDWR);
    }
    tcpi_reap_fds(t, peer);
}

/* Closes peer's incoming connection, leaving the peer alive without one until it connects
 * again (mu held; nobody is reading it). */
void tcpi_drop_in(tcp_pipe_t *t, pd_pipe_peer_t *peer)
{
    epoll_ctl(t->epfd, EPOLL_CTL_DEL, peer->in_fd, NULL);
    close(peer->in_fd);
    peer->in_fd = -1;
}

tcp_region_t *tcpi_region_by_id(tcp_pipe_t *t, uint32_t id)
{
    return id < t->num_regions ? t->regions[id] : NULL;
}

bool tcpi_allowed(tcp_pipe_t *t, uint32_t region_id, pd_pipe_peer_t *peer, bool write)
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
pd_pipe_peer_t *tcpi_peer_by_id(tcp_pipe_t *t, uint64_t id, const uint8_t *session, bool create)
{
    pd_pipe_peer_t *p;
    pd_list_for_each (p, &t->peers, link) {
        if (p->id == id && !p->dead &&
            (session == NULL || memcmp(p->session, session, PD_PIPE_SESSION_BYTES) == 0)) {
            return p;
        }
    }
    if (!create) {
        return NULL;
    }
    p = calloc(1, sizeof(*p));
    if (p == NULL || pd_pipe_cq_reserve(&t->cq) != PD_OK) { /* the node of its death's completion */
        free(p);
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

int tcpi_out_ready(pd_pipe_peer_t *peer)
{
    if (!peer->connecting) {
        return 1;
    }
    if (peer->connect_failed) {
        return -1;
    }
    struct pollfd pf = {peer->out_fd, POLLOUT, 0};
    if (poll(&pf, 1, 0) > 0) {
        int err = 0;
        socklen_t el = sizeof(err);
        if (getsockopt(peer->out_fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0 || err != 0) {
            pd_log_error("tcp pipe: cannot connect to peer %016llx at %s: %s", (unsigned long long)peer->id,
                         peer->dialled, strerror(err != 0 ? err : errno));
            peer->connect_failed = true;
            return -1;
        }
        peer->connecting = false;
        return 1;
    }
    if (pd_time_now_s() > peer->connect_deadline) {
        pd_log_error("tcp pipe: cannot connect to peer %016llx at %s: no answer in %d ms",
                     (unsigned long long)peer->id, peer->dialled, TCP_CONNECT_TIMEOUT_MS);
        peer->connect_failed = true;
        return -1;
    }
    return 0;
}

/* Sends j (mu held). When nothing is queued and the sender thread is idle, the frame is written
 * inline, without blocking (saves two thread hand-offs per operation); whatever the socket does
 * not take at once goes to the sender thread, which keeps the order. */
/* The socket job j goes out on, or -1 when it cannot be written (yet: *ready 0 while out_fd
 * connects; -1 for good). mu held. */
static int job_fd(const job_t *j, int *ready)
{
    pd_pipe_peer_t *peer = j->peer;
    int fd = j->on_in ? peer->in_fd : peer->out_fd;
    *ready = peer->dead || fd < 0 ? -1 : j->on_in ? 1 : tcpi_out_ready(peer);
    return fd;
}

void tcpi_enqueue(tcp_pipe_t *t, job_t *j)
{
    int ready, fd = job_fd(j, &ready);
    if (pd_list_is_empty(&t->jobs) && !t->tx_busy && ready == 1) {
        int r = write_some(fd, j);
        if (r != 0) {
            if (r < 0) {
                tcpi_mark_dead(t, j->peer, PD_ERR_PEER_GONE);
            }
            if (j->complete_on_send != NULL) {
                tcpi_complete_op(t, j->complete_on_send, r > 0 ? PD_OK : PD_ERR_PEER_GONE, 0, 0);
            }
            tcpi_job_free(j);
            return;
        }
    }
    pd_list_add_tail(&t->jobs, &j->link);
    pthread_cond_signal(&t->tx_cv);
}

job_t *tcpi_job_new(pd_pipe_peer_t *peer, int niov, size_t owned_bytes)
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

void tcpi_job_free(job_t *j)
{
    free(j->iov);
    free(j->owned);
    free(j);
}

/* ------------------------------------------------------------------ socket I/O */

int tcpi_read_full(int fd, void *buf, size_t n)
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

/* Reads `skip` bytes into skip_buf (what is left of the frame's header and descriptors, already
 * known from a peek: one syscall fewer per frame), then the pages d[n] (offsets into base) in order,
 * up to 64 pages per readv: one syscall per batch instead of per page (a 16 KiB page per read()
 * costs ~30% of the stream rate here). */
int tcpi_read_pages(int fd, void *skip_buf, size_t skip, char *base, const desc_t *d, uint32_t n)
{
    struct iovec iov[65];
    int k0 = 0;
    if (skip > 0) {
        iov[k0++] = (struct iovec){skip_buf, skip};
    }
    for (uint32_t i = 0; i < n || k0 > 0;) {
        int k = k0;
        for (; k < 65 && i < n; k++, i++) {
            iov[k] = (struct iovec){base + d[i].off, d[i].len};
        }
        k0 = 0;
        struct iovec *v = iov;
        iov_advance(&v, &k, 0); /* empty pages first: a readv of nothing reads as a closed socket */
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

int tcpi_discard(int fd, uint64_t n)
{
    char buf[65536];
    while (n > 0) {
        size_t k = n > sizeof(buf) ? sizeof(buf) : (size_t)n;
        if (tcpi_read_full(fd, buf, k) != 0) {
            return -1;
        }
        n -= k;
    }
    return 0;
}

int tcpi_writev_full(int fd, struct iovec *iov, int n)
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

void tcpi_tune_socket(int fd)
{
    int one = 1, buf = 8 << 20;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
}

/* ------------------------------------------------------------------ sender thread */

/* The sender thread: the queued jobs in order per peer, each written without blocking, so a peer
 * whose socket takes nothing (it stopped reading) delays only its own jobs (issue 51: one such peer
 * held the single sender and every other peer's transfers); while every job left waits on a full
 * socket, it polls those sockets (5 ms at a time, so new jobs for other peers are not kept waiting
 * long). A peer whose socket takes nothing for TCP_SEND_STALL_S is dropped. */
void *tcpi_tx_main(void *arg)
{
    enum { MAX_BLOCKED = 64 };
    tcp_pipe_t *t = arg;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        if (pd_list_is_empty(&t->jobs)) {
            pthread_cond_wait(&t->tx_cv, &t->mu);
            continue;
        }
        uint64_t pass = ++t->tx_pass;
        struct pollfd bfd[MAX_BLOCKED]; /* the first blocked sockets (past them the poll's 5 ms wake) */
        int nb = 0;
        job_t *j, *tmp;
        pd_list_for_each_safe (j, tmp, &t->jobs, link) {
            pd_pipe_peer_t *peer = j->peer;
            if (peer->tx_blocked_pass == pass) {
                continue; /* an earlier job of this peer is waiting: keep the order */
            }
            int ready, rc = -1, fd = job_fd(j, &ready);
            if (ready == 0) {
                rc = 0; /* still connecting: polled for POLLOUT below */
            } else if (ready > 0) {
                t->tx_busy = true;
                t->tx_peer = peer;
                pthread_mutex_unlock(&t->mu);
                rc = write_some(fd, j);
                pthread_mutex_lock(&t->mu);
                t->tx_busy = false;
                t->tx_peer = NULL;
                tcpi_reap_fds(t, peer); /* it died while we wrote */
            }
            double now = pd_time_now_s();
            if (rc == 0 && peer->tx_blocked_since > 0 && now - peer->tx_blocked_since > TCP_SEND_STALL_S) {
                pd_log_warn("tcp pipe: peer %016llx took none of its queued bytes for %.0f s; dropping it",
                            (unsigned long long)peer->id, TCP_SEND_STALL_S);
                rc = -1;
            }
            if (rc == 0) {
                if (peer->tx_blocked_since == 0) {
                    peer->tx_blocked_since = now;
                }
                peer->tx_blocked_pass = pass;
                if (nb < MAX_BLOCKED) {
                    bfd[nb++] = (struct pollfd){fd, POLLOUT, 0};
                }
                continue;
            }
            peer->tx_blocked_since = 0;
            pd_list_del(&j->link);
            if (rc < 0) {
                tcpi_mark_dead(t, peer, PD_ERR_PEER_GONE);
            }
            if (j->complete_on_send != NULL) {
                tcpi_complete_op(t, j->complete_on_send, rc > 0 ? PD_OK : PD_ERR_PEER_GONE, 0, 0);
            }
            tcpi_job_free(j);
        }
        bool runnable = false; /* a job of a peer whose socket was not full */
        pd_list_for_each (j, &t->jobs, link) {
            runnable |= j->peer->tx_blocked_pass != pass;
        }
        if (nb > 0 && !runnable && !t->stop) {
            /* (a socket closed meanwhile only wakes the poll: nothing is written without mu) */
            pthread_mutex_unlock(&t->mu);
            poll(bfd, (nfds_t)nb, 5);
            pthread_mutex_lock(&t->mu);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}
