/* connector/kv_aborts.c — ABORTs a decode owes a prefill it cannot reach now. A pull load that
 * fails or is cancelled before its READ_DONE is answered tells the prefill at once (kv_xfers.c), so
 * the lease's blocks go back to its pool; when the prefill is unreachable at that moment (the control
 * connection was reset, a dial failed, the peer was declared dead) the ABORT waits here, keyed by the
 * prefill's control address and engine id. The control thread redials such an address with backoff;
 * once connected to the same engine the ABORTs go out; an engine with another id restarted and took
 * its leases with it, so they are dropped. Each expires after --kv-hold-timeout, when the prefill's
 * own timer has ended the lease anyway. Bounded: beyond KV_MAX_DEFERRED_ABORTS the oldest is
 * dropped (its lease then ends at the timeout). Control thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "connector/kv_ctl.h"

#define KV_MAX_DEFERRED_ABORTS 1024
#define KV_ABORT_BACKOFF_MIN   0.25 /* s before the first redial; doubles up to the max */
#define KV_ABORT_BACKOFF_MAX   5.0

static void abort_free(kv_conn_t *k, kv_abort_t *a)
{
    pd_list_del(&a->link);
    k->c->num_aborts--;
    free(a);
}

void kv_abort_defer(kv_conn_t *k, const kv_xfer_t *x)
{
    if (x->dial[0] == '\0' || x->remote_req[0] == '\0') {
        return;
    }
    kv_abort_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        return; /* the lease ends at the prefill's hold timeout */
    }
    snprintf(a->dial, sizeof(a->dial), "%s", x->dial);
    snprintf(a->engine_id, sizeof(a->engine_id), "%s",
             x->peer != NULL && x->peer->engine_id[0] ? x->peer->engine_id : x->remote_engine);
    snprintf(a->req_id, sizeof(a->req_id), "%s", x->remote_req);
    a->lease_id = x->lease_id;
    double now = pd_time_now_s();
    a->expires = now + k->cfg.hold_timeout;
    a->backoff = KV_ABORT_BACKOFF_MIN;
    a->next_dial = now + a->backoff;
    pd_list_add_tail(&k->c->aborts, &a->link);
    if (++k->c->num_aborts > KV_MAX_DEFERRED_ABORTS) {
        abort_free(k, pd_list_head(&k->c->aborts, kv_abort_t, link));
    }
    pd_log_info("kv connector: request %s: the prefill at %s is unreachable; its lease's ABORT waits for a "
                "reconnect",
                x->req_id, x->dial);
}

void kv_aborts_deliver(kv_conn_t *k, kv_peer_t *p)
{
    int sent = 0, dropped = 0;
    kv_abort_t *a, *tmp;
    pd_list_for_each_safe (a, tmp, &k->c->aborts, link) {
        if (p->state == KV_PEER_DEAD || strcmp(a->dial, p->dial) != 0) {
            continue;
        }
        if (a->engine_id[0] == '\0' || strcmp(a->engine_id, p->engine_id) == 0) {
            Pd__Abort m = PD__ABORT__INIT;
            m.request_id = a->req_id;
            m.lease_id = a->lease_id;
            m.reason = (char *)"the decode's load failed while the prefill was unreachable";
            kv_peer_send(k, p, PD_MSG_ABORT, &m.base);
            sent++;
        } else {
            dropped++; /* another engine at that address: the one that granted the lease is gone */
        }
        abort_free(k, a);
    }
    if (sent + dropped > 0) {
        pd_log_info("kv connector: %d deferred ABORT(s) sent to %s at %s, %d dropped (it restarted)", sent,
                    p->engine_id, p->dial, dropped);
    }
}

void kv_aborts_tick(kv_conn_t *k, double now)
{
    kv_abort_t *a, *tmp;
    pd_list_for_each_safe (a, tmp, &k->c->aborts, link) {
        if (now > a->expires) {
            abort_free(k, a); /* the prefill's hold timeout has ended the lease */
            continue;
        }
        if (now < a->next_dial) {
            continue;
        }
        a->backoff = a->backoff * 2 < KV_ABORT_BACKOFF_MAX ? a->backoff * 2 : KV_ABORT_BACKOFF_MAX;
        a->next_dial = now + a->backoff;
        kv_peer_t *p = kv_find_peer(k, a->dial);
        if (p != NULL) {
            kv_aborts_deliver(k, p); /* connected meanwhile (frees a and maybe tmp's siblings) */
            return;                  /* the list changed under the iteration: next tick */
        }
        if (kv_find_dial(k, a->dial) == NULL) {
            kv_dial_start(k, a->dial); /* kv_dial_io delivers once it is authenticated */
        }
    }
}

void kv_aborts_free(kv_conn_t *k)
{
    kv_abort_t *a;
    while ((a = pd_list_pop_head(&k->c->aborts, kv_abort_t, link)) != NULL) {
        free(a);
    }
    k->c->num_aborts = 0;
}
