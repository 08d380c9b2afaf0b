/* connector/kv_timers.c — the connector's deadlines, one sweep per list: peers' heartbeats and
 * silence, transfers' load and hold timeouts, leases, reservations. Control thread. */
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
#include "connector/kv_ctl.h"

/* Peers: no Regions within the handshake timeout or silent for heartbeat_interval × misses → dead;
 * a heartbeat to every live peer each interval. */
static void sweep_peers(kv_conn_t *k, double now)
{
    double dead_after = k->cfg.heartbeat_interval * k->cfg.heartbeat_misses;
    kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->state == KV_PEER_DEAD) {
            continue;
        }
        if (p->state == KV_PEER_WAIT_REGIONS && now - p->since > k->cfg.handshake_timeout) {
            kv_peer_dead(k, p, "no region descriptor within --kv-handshake-timeout");
            continue;
        }
        if (now - p->last_rx > dead_after) {
            char why[96];
            snprintf(why, sizeof(why), "no heartbeat for %.1f s", now - p->last_rx);
            kv_peer_dead(k, p, why);
            continue;
        }
        if (now - p->last_hb >= k->cfg.heartbeat_interval) {
            Pd__Heartbeat hb = PD__HEARTBEAT__INIT;
            hb.seq = ++p->hb_seq;
            hb.unix_ms = (uint64_t)time(NULL) * 1000;
            p->last_hb = now;
            kv_peer_send(k, p, PD_MSG_HEARTBEAT, &hb.base);
        }
    }
}

/* Transfers past their deadline: a push save without a reservation frees its blocks; one whose
 * pages may still move kills its peer first (only that guarantees they stop); others fail. A posted
 * one then ends through its completion, not here: until the pipe completes it, its pages may still
 * be landing (the TCP receiver writes a read's pages without the pipe's lock), and failing it now
 * would hand its blocks to a recompute under those writes. The pipe completes a dead peer's
 * operations at once; should it not within another --kv-load-timeout, the transfer fails anyway. */
static void sweep_xfer_deadlines(kv_conn_t *k, double now)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->state == KV_XS_DONE || now < x->deadline) {
            continue;
        }
        if (x->kind == KV_X_PUSH_SAVE && x->state == KV_XS_QUEUED) {
            pd_log_warn(
                "kv connector: request %s: no reservation within --kv-hold-timeout; freeing its blocks",
                x->req_id);
            pd_metric_inc(k->m.leases_expired, 1);
            pd_metric_inc(k->m.nixl_expired, 1);
            kv_report_sending(k, &x->report);
            x->state = KV_XS_DONE;
        } else if (x->state == KV_XS_POSTED && x->overdue) {
            pd_log_error("kv connector: request %s: the pipe did not complete a dead peer's transfer within "
                         "another --kv-load-timeout; failing it",
                         x->req_id);
            kv_fail_xfer(k, x, "timed out");
        } else if (x->state == KV_XS_POSTED || (x->kind == KV_X_PUSH_LOAD && x->state == KV_XS_WAIT_PEER)) {
            x->overdue = true;
            x->deadline = now + k->cfg.load_timeout;
            kv_peer_dead(k, x->peer, "a transfer outlived --kv-load-timeout"); /* fails the unposted */
        } else {
            kv_fail_xfer(k, x, "timed out");
        }
    }
}

/* Leases: an unread one expires (its blocks freed); its tombstone goes a hold timeout later. */
static void sweep_leases(kv_conn_t *k, double now)
{
    int held = 0;
    kv_lease_t *l, *tmp;
    pd_list_for_each_safe (l, tmp, &k->c->leases, link) {
        if (!l->expired && now > l->expires) {
            pd_log_warn("kv connector: request %s: lease expired before a decode read it; freeing its blocks",
                        l->req_id);
            l->expired = true;
            pd_metric_inc(k->m.leases_expired, 1);
            pd_metric_inc(k->m.nixl_expired, 1);
            kv_report_sending(k, &l->report);
        }
        if (l->expired && now > l->expires + k->cfg.hold_timeout) {
            pd_list_del(&l->link);
            kv_lease_free(l);
        } else {
            held += !l->expired;
        }
    }
    pd_metric_set(k->m.leases_now, held);
}

/* Reservations: one never taken expires (the decode hears WRITE_DONE with a timeout); released
 * ones go, a dead peer's only when it would have expired (so a prefill request for its transfer
 * learns at once that nobody waits). */
static void sweep_reservations(kv_conn_t *k, double now)
{
    int live = 0;
    kv_resv_t *rv, *tmp;
    pd_list_for_each_safe (rv, tmp, &k->c->resvs, link) {
        if (!rv->taken && !rv->released && now > rv->expires) {
            pd_log_warn("kv connector: reservation %s expired without a matching prefill request",
                        rv->transfer_id);
            kv_resv_refuse(k, rv, PD_ERR_TIMEOUT);
        }
        if (rv->released && !rv->taken && (!rv->dead || now > rv->expires)) {
            pd_list_del(&rv->link);
            kv_resv_free(rv);
        } else {
            live += !rv->released;
        }
    }
    pd_metric_set(k->m.resvs_now, live);
}

/* Finished transfers leave the list (releasing the reservation they took). */
static void sweep_done_xfers(kv_conn_t *k)
{
    kv_xfer_t *x, *tmp;
    pd_list_for_each_safe (x, tmp, &k->c->xfers, link) {
        if (x->state == KV_XS_DONE) {
            if (x->resv != NULL) {
                x->resv->taken = false;
                kv_resv_end(k, x->resv, false);
            }
            pd_list_del(&x->link);
            kv_xfer_free(x);
        }
    }
}

/* Whether a transfer of peer p may still address its imported region. */
static bool peer_region_used(kv_conn_t *k, const kv_peer_t *p)
{
    const kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->peer == p) {
            return true;
        }
    }
    return false; /* (write jobs are posted as they arrive: none waits with a peer) */
}

/* Whether anything still points at peer p: a transfer (peer_region_used) or a reservation. */
static bool peer_referenced(kv_conn_t *k, const kv_peer_t *p)
{
    if (peer_region_used(k, p)) {
        return true;
    }
    const kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        if (rv->peer == p) {
            return true;
        }
    }
    return false;
}

/* A dead peer's imported region goes back to the pipe (UCX: the rkey and any mapping of the peer's
 * memory: a decode's whole KV cache) as soon as no transfer can address it, even while its
 * reservation tombstones keep the record until --kv-hold-timeout (issue 51: +32 MiB of prefill RSS
 * per push decode death until then). A dead peer nothing refers to any more is freed: the pipe
 * releases its side (endpoint, sockets, record), then its reader and record go. Peers come and go
 * for weeks; their records must not pile up. */
static void sweep_dead_peers(kv_conn_t *k)
{
    kv_peer_t *p, *tmp;
    int64_t imported = 0;
    pd_list_for_each_safe (p, tmp, &k->c->peers, link) {
        /* (posted write jobs have left the list: none may be in flight, whoever they write to) */
        if (p->state == KV_PEER_DEAD && p->remote != NULL && k->c->jobs_posted == 0 &&
            !peer_region_used(k, p)) {
            k->pipe->ops->release_remote(k->pipe, p->remote);
            p->remote = NULL;
        }
        imported += p->remote != NULL;
        if (p->state != KV_PEER_DEAD || peer_referenced(k, p)) {
            continue;
        }
        if (p->remote != NULL) {
            k->pipe->ops->release_remote(k->pipe, p->remote);
        }
        if (p->pp != NULL) {
            k->pipe->ops->release_peer(k->pipe, p->pp); /* its endpoint, sockets and record */
        }
        pd_ctl_reader_destroy(&p->rd);
        pd_list_del(&p->link);
        free(p);
    }
    pd_metric_set(k->m.imported, (double)imported);
}

/* Every deadline of the connector, once per loop tick. */
void kv_run_timers(kv_conn_t *k)
{
    double now = pd_time_now_s();
    sweep_peers(k, now);
    sweep_xfer_deadlines(k, now);
    sweep_leases(k, now);
    sweep_reservations(k, now);
    sweep_done_xfers(k);
    sweep_dead_peers(k);
    kv_aborts_tick(k, now);
}

static double earlier(double a, double b)
{
    return b < a ? b : a;
}

double kv_next_deadline(kv_conn_t *k, double max_s)
{
    double now = pd_time_now_s();
    double t = now + max_s;
    double dead_after = k->cfg.heartbeat_interval * k->cfg.heartbeat_misses;
    const kv_peer_t *p;
    pd_list_for_each (p, &k->c->peers, link) {
        if (p->state != KV_PEER_DEAD) {
            t = earlier(t, p->last_hb + k->cfg.heartbeat_interval);
            t = earlier(t, p->last_rx + dead_after);
            if (p->state == KV_PEER_WAIT_REGIONS) {
                t = earlier(t, p->since + k->cfg.handshake_timeout);
            }
        }
    }
    const kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        t = x->state != KV_XS_DONE ? earlier(t, x->deadline) : now; /* a finished one is swept now */
    }
    const kv_lease_t *l;
    pd_list_for_each (l, &k->c->leases, link) {
        t = earlier(t, l->expired ? l->expires + k->cfg.hold_timeout : l->expires);
    }
    const kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        if (!rv->taken) { /* an open one expires; a dead one's record goes */
            t = earlier(t, rv->expires);
        }
    }
    const kv_hs_t *h;
    pd_list_for_each (h, &k->c->handshakes, link) {
        t = earlier(t, h->deadline);
    }
    const kv_dial_t *d;
    pd_list_for_each (d, &k->c->dials, link) {
        t = earlier(t, d->deadline);
    }
    const kv_abort_t *a;
    pd_list_for_each (a, &k->c->aborts, link) {
        t = earlier(t, earlier(a->next_dial, a->expires));
    }
    if (k->c->accept_resume > now) {
        t = earlier(t, k->c->accept_resume);
    }
    return t;
}
