/* connector/kv_ctl.c — the P/D connector's control thread: the control listener, dialled and
 * accepted peers (handshake, region exchange, heartbeats), every transfer's progress on the
 * pipe, the notifications (READ_DONE / ACK / WRITE_DONE / ABORT) and every timeout.
 *
 * The loop lives here; commands (kv_commands.c), peers (kv_peers.c), transfers (kv_xfers.c),
 * messages (kv_messages.c) and deadlines (kv_timers.c) are its parts. It owns kv_ctl_t and takes
 * no lock but the mailbox's (in kv_mb_take / kv_mb_emit).
 *
 * One tick: poll (listener, wake eventfd, pipe, peers, pending handshakes, dials) until the
 * nearest deadline → the mailbox's commands → pending handshakes, accept → dials, flush and read
 * peers → progress the pipe (its callbacks run here) → start queued transfers → timers. Nothing
 * waits on a socket. */
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

static void on_pipe_peer_error(void *arg, pd_pipe_peer_t *pp, pd_status_t st);
static void *ctl_main(void *arg);

void kv_ctl_init(kv_ctl_t *c)
{
    pd_list_link_t *heads[] = {&c->peers, &c->handshakes, &c->dials, &c->aborts,
                               &c->xfers, &c->leases,     &c->resvs};
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        pd_list_head_init(heads[i]);
    }
    c->listen_fd = -1;
    c->next_resv_id = 1;
}

int kv_ms_of(double s)
{
    return (int)(s * 1000.0 + 0.5);
}

static void on_pipe_peer_error(void *arg, pd_pipe_peer_t *pp, pd_status_t st)
{
    kv_conn_t *k = arg;
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->pp == pp && p->state != KV_PEER_DEAD) {
            kv_peer_dead(k, p, pd_status_str(st));
        }
    }
}

/* One tick's poll set: listener, wake eventfd, pipe wait fd, then peers (pp[i] is pf[i]'s peer),
 * from hs0 the pending handshakes and from d0 our dials, each in list order. */
typedef struct ctl_poll {
    struct pollfd *pf;
    kv_peer_t **pp;
    size_t pf_cap, pp_cap, n, hs0, d0;
} ctl_poll_t;

/* Fills cp for this tick; false when it cannot grow (out of memory, logged). */
static bool poll_build(kv_conn_t *k, ctl_poll_t *cp, int pipe_fd)
{
    size_t n = 3 + (size_t)k->c->num_handshakes;
    kv_dial_t *d;
    pd_list_for_each (d, &k->c->dials, link) {
        n++;
    }
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        n += p->fd >= 0;
    }
    if (pd_array_reserve(&cp->pf, &cp->pf_cap, n) != PD_OK ||
        pd_array_reserve(&cp->pp, &cp->pp_cap, n) != PD_OK) {
        pd_log_error("kv connector: out of memory in the control thread");
        return false;
    }
    struct pollfd *pf = cp->pf;
    /* out of fds: the listener sits out until accept_resume (the loop wakes at least every 50 ms) */
    bool paused = k->c->accept_resume > 0 && pd_time_now_s() < k->c->accept_resume;
    pf[0] = (struct pollfd){paused ? -1 : k->c->listen_fd, POLLIN, 0};
    pf[1] = (struct pollfd){k->mb.wake_fd, POLLIN, 0};
    pf[2] = (struct pollfd){pipe_fd, POLLIN, 0}; /* ignored by poll when -1 */
    size_t i = 3;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->fd >= 0) {
            cp->pp[i] = p;
            pf[i++] = (struct pollfd){p->fd, (short)(POLLIN | (p->out_len > 0 ? POLLOUT : 0)), 0};
        }
    }
    cp->hs0 = i;
    kv_hs_t *h;
    pd_list_for_each (h, &k->c->handshakes, link) {
        pf[i++] = (struct pollfd){h->fd, POLLIN, 0};
    }
    cp->d0 = i; /* the dial list changes only on this thread */
    pd_list_for_each (d, &k->c->dials, link) {
        pf[i++] = (struct pollfd){d->fd, d->connected ? POLLIN : POLLOUT, 0};
    }
    cp->n = i;
    return true;
}

/* How long this tick may sleep in poll (Redis ae.c's rule: to the nearest timer; commands and
 * sockets wake it). The pipe's completions arrive through progress. UCX (and NCCL's event checks)
 * want it called continuously while pages move (a bounded number of operations advance per call):
 * spin until they land. The TCP pipe moves bytes on its own threads and its wait fd turns readable
 * when a completion is queued: sleep on it (a spin would take a core from those threads; 2 cores
 * here), with a 10 ms bound as a backstop. Otherwise: until the nearest deadline, at most 1 s;
 * a pipe that moves bytes only inside progress (UCX, NCCL: no wait fd) also serves its peers' reads
 * and writes there (UCX over TCP emulates RMA with messages the target must progress), so its
 * progress is a 50 ms timer of its own. */
static long poll_timeout_ns(kv_conn_t *k, int pipe_fd)
{
    bool moving = k->c->jobs_posted > 0;
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (moving) {
            break;
        }
        moving = x->state == KV_XS_POSTED;
    }
    if (moving) {
        return pipe_fd < 0 ? 0 : 10 * 1000 * 1000;
    }
    double wait = kv_next_deadline(k, pipe_fd < 0 ? 0.05 : 1.0) - pd_time_now_s();
    return wait <= 0 ? 0 : (long)(wait * 1e9) + 1000; /* 1 µs past it: the timer is due when we wake */
}

/* Pending handshakes with events advance (the list shrinks as they finish), expired ones go, and
 * a new connection joins them. */
static void on_listener_events(kv_conn_t *k, const ctl_poll_t *cp, int rc)
{
    size_t j = cp->hs0;
    kv_hs_t *h, *tmp;
    pd_list_for_each_safe (h, tmp, &k->c->handshakes, link) {
        if (rc <= 0 || j >= cp->d0) {
            break; /* joined after the poll set was built */
        }
        if (cp->pf[j++].revents != 0) {
            kv_hs_read(k, h); /* may unlink and free h */
        }
    }
    kv_hs_expire(k);
    if (rc > 0 && (cp->pf[0].revents & POLLIN)) {
        kv_accept_peer(k);
    }
}

/* Our dials and the peers' sockets with events: connect/handshake steps, flushes, reads. */
static void on_peer_events(kv_conn_t *k, const ctl_poll_t *cp, int rc)
{
    size_t j = cp->d0;
    kv_dial_t *d, *tmp;
    pd_list_for_each_safe (d, tmp, &k->c->dials, link) {
        if (rc <= 0 || j >= cp->n) {
            break; /* started after the poll set was built (dials join at the tail) */
        }
        if (cp->pf[j++].revents != 0) {
            kv_dial_io(k, d); /* may unlink and free d */
        }
    }
    kv_dial_expire(k);
    for (j = 3; rc > 0 && j < cp->hs0; j++) {
        kv_peer_t *p = cp->pp[j];
        if ((cp->pf[j].revents & POLLOUT) && p->state != KV_PEER_DEAD) {
            kv_flush_peer(k, p);
        }
        if ((cp->pf[j].revents & ~POLLOUT) != 0 && p->state != KV_PEER_DEAD) {
            kv_read_peer(k, p);
        }
    }
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->state != KV_PEER_DEAD && p->rd.len > 0) {
            kv_parse_frames(k, p); /* frames that arrived with a handshake */
        }
    }
}

static void *ctl_main(void *arg)
{
    kv_conn_t *k = arg;
    ctl_poll_t cp = {NULL, NULL, 0, 0, 0, 0, 0};
    int pipe_fd = pd_pipe_wait_fd(k->pipe); /* -1: the pipe moves bytes inside progress */
    while (!k->c->stopping) {
        long ns = poll_timeout_ns(k, pipe_fd);
        struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
        int rc = 0;
        if (poll_build(k, &cp, pipe_fd)) {
            rc = ppoll(cp.pf, cp.n, &ts, NULL);
        } else { /* out of memory (logged): no socket this tick; progress and timers still run */
            struct timespec nap = {0, 10 * 1000 * 1000};
            nanosleep(&nap, NULL);
        }
        if (rc > 0 && (cp.pf[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(k->mb.wake_fd, &v, sizeof(v));
            (void)r;
        }
        kv_ctl_commands(k);
        on_listener_events(k, &cp, rc);
        on_peer_events(k, &cp, rc);
        pd_pipe_progress(k->pipe);
        kv_drive_queued(k);
        kv_run_timers(k);
    }
    free(cp.pf);
    free(cp.pp);
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
    k->advertise_port = k->cfg.advertise_port > 0 ? k->cfg.advertise_port : k->listen_port;
    snprintf(k->advertise_addr, sizeof(k->advertise_addr), "%s:%d", k->advertise_host, k->advertise_port);
    k->c->listen_fd = fd;
    int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd < 0) {
        pd_log_error("kv connector: cannot create the control thread's eventfd: %s", strerror(errno));
        return PD_ERR_IO;
    }
    k->mb.wake_fd = wake_fd; /* before the thread starts; senders read it under the mailbox's mutex */
    k->pipe->ops->set_peer_error_cb(k->pipe, on_pipe_peer_error, k);
    if (pthread_create(&k->c->thread, NULL, ctl_main, k) != 0) {
        pd_log_error("kv connector: cannot start the control thread");
        return PD_ERR_INTERNAL;
    }
    k->c->thread_started = true;
    pd_log_info("kv connector: control plane listening on %s:%d (advertised as %s:%d)", k->listen_host,
                k->listen_port, k->advertise_host, k->advertise_port);
    return PD_OK;
}

/* Frees what the control thread's connections held: dials, pending handshakes, peers. */
static void free_connections(kv_conn_t *k)
{
    kv_dial_t *d;
    while ((d = pd_list_pop_head(&k->c->dials, kv_dial_t, link)) != NULL) {
        pd_ctl_client_hs_destroy(&d->hs);
        pd_ctl_reader_destroy(&d->rd);
        close(d->fd);
        free(d);
    }
    kv_hs_t *h;
    while ((h = pd_list_pop_head(&k->c->handshakes, kv_hs_t, link)) != NULL) {
        kv_hs_free(h);
    }
    k->c->num_handshakes = 0;
    kv_peer_t *p;
    while ((p = pd_list_pop_head(&k->c->peers, kv_peer_t, link)) != NULL) {
        if (p->fd >= 0) {
            close(p->fd);
        }
        pd_ctl_reader_destroy(&p->rd);
        free(p->out);
        free(p);
    }
}

/* Frees the transfer-side lists: transfers, leases, reservations, deferred aborts. */
static void free_work(kv_conn_t *k)
{
    kv_xfer_t *x;
    while ((x = pd_list_pop_head(&k->c->xfers, kv_xfer_t, link)) != NULL) {
        kv_xfer_free(x);
    }
    kv_lease_t *l;
    while ((l = pd_list_pop_head(&k->c->leases, kv_lease_t, link)) != NULL) {
        kv_lease_free(l);
    }
    kv_resv_t *rv;
    while ((rv = pd_list_pop_head(&k->c->resvs, kv_resv_t, link)) != NULL) {
        kv_resv_free(rv);
    }
    if (k->c->released.slots != NULL) {
        pd_strmap_destroy(&k->c->released);
    }
    kv_aborts_free(k);
}

void kv_ctl_stop(kv_conn_t *k)
{
    if (k->c->thread_started) {
        k->c->stop_cmd.kind = KV_CMD_STOP;
        kv_mb_send(&k->mb, &k->c->stop_cmd, 0);
        pthread_join(k->c->thread, NULL);
        k->c->thread_started = false;
    }
    /* commands the thread did not take go (calls among them are answered: nothing released) */
    pd_list_link_t left;
    pd_list_head_init(&left);
    kv_mb_take(&k->mb, false, &left, 0, true);
    kv_msg_t *m;
    while ((m = pd_list_pop_head(&left, kv_msg_t, link)) != NULL) {
        kv_msg_free(m);
    }
    /* the pipe completes every pending operation (CANCELLED) before it goes */
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->remote != NULL && k->pipe != NULL) {
            k->pipe->ops->release_remote(k->pipe, p->remote);
            p->remote = NULL;
        }
    }
    pd_pipe_destroy(k->pipe);
    k->pipe = NULL;
    k->region = NULL;
    free_connections(k);
    free_work(k);
    if (k->c->listen_fd >= 0) {
        close(k->c->listen_fd);
        k->c->listen_fd = -1;
    }
    if (k->mb.wake_fd >= 0) {
        close(k->mb.wake_fd);
        k->mb.wake_fd = -1;
    }
}
