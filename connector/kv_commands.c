/* connector/kv_commands.c — what the control thread does with the engine thread's commands (and
 * the HTTP thread's release), and the events it sends back: a transfer's or a lease's end
 * (kv_report_t), a reservation that takes no more writes. Control thread. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "connector/kv_ctl.h"

/* ------------------------------------------------------------------ events */

void kv_report_sending(kv_conn_t *k, kv_report_t **report)
{
    if (*report != NULL) {
        kv_mb_emit(&k->mb, &(*report)->msg);
        *report = NULL;
    }
}

void kv_report_recving(kv_conn_t *k, kv_xfer_t *x, bool ok)
{
    kv_report_t *r = x->report;
    if (r == NULL) {
        return;
    }
    x->report = NULL;
    r->first_token = x->has_first_token && !x->cancelled ? x->first_token : -1;
    if (r->first_token >= 0) {
        r->grammar_state = x->grammar_state;
        x->grammar_state = NULL;
    }
    /* a cancelled load's blocks are its request's no more: neither load errors nor copied */
    if (!x->cancelled && x->end_block > x->first_block && (!ok || k->staged)) {
        r->blocks = x->local_blocks;
        x->local_blocks = NULL;
        r->first = x->first_block;
        r->end = x->end_block;
        r->failed = !ok;
        r->staged = ok;
    }
    if (r->failed) {
        kv_count_policy_action(k);
    }
    kv_mb_emit(&k->mb, &r->msg);
}

kv_resv_t *kv_resv_find(kv_conn_t *k, uint64_t id)
{
    kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        if (rv->id == id) {
            return rv;
        }
    }
    return NULL;
}

void kv_resv_end(kv_conn_t *k, kv_resv_t *rv, bool dead)
{
    rv->dead = rv->dead || dead;
    if (!dead || !rv->taken) { /* a dead one a stream writes into is released by its WRITE_DONE */
        rv->released = true;
    }
    if (rv->gone != NULL) {
        kv_mb_emit(&k->mb, &rv->gone->msg);
        rv->gone = NULL;
    }
}

void kv_resv_refuse(kv_conn_t *k, kv_resv_t *rv, int32_t status)
{
    Pd__WriteDone wd = PD__WRITE_DONE__INIT;
    wd.request_id = rv->transfer_id;
    wd.lease_id = rv->lease_id;
    wd.status = status;
    kv_peer_send(k, rv->peer, PD_MSG_WRITE_DONE, &wd.base);
    kv_resv_end(k, rv, false);
}

void kv_resv_free(kv_resv_t *rv)
{
    if (rv != NULL) {
        free(rv->gone);
        free(rv->blocks);
        free(rv);
    }
}

/* ------------------------------------------------------------------ commands */

/* Whether transfer_id was released before its request finished (and forgets it). */
static bool take_released(kv_conn_t *k, const char *transfer_id)
{
    return transfer_id[0] != '\0' && k->c->released.slots != NULL &&
           pd_strmap_del(&k->c->released, transfer_id, strlen(transfer_id), NULL) == 1;
}

/* Decode: the request of a load it started ended; the load ends as cancelled (no load errors: its
 * blocks are freed once get_finished reports it). */
static void on_cancel(kv_conn_t *k, const char *req_id)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->kind != KV_X_PUSH_SAVE && x->state != KV_XS_DONE && strcmp(x->req_id, req_id) == 0) {
            x->cancelled = true;
            if (x->state == KV_XS_QUEUED && x->peer == NULL) {
                kv_end_load(k, x, false); /* still dialling: nothing to wait for */
            }
            return;
        }
    }
}

/* Prefill, pull: a lease starts, unless the proxy released its transfer id while the request ran
 * (its client left): then its blocks go back at once. */
static void on_lease(kv_conn_t *k, kv_lease_t *l)
{
    if (take_released(k, l->transfer_id)) {
        pd_log_info("kv connector: request %s: released by the proxy before it finished; its KV is freed",
                    l->req_id);
        l->expired = true;
        l->expires = pd_time_now_s();
        kv_report_sending(k, &l->report);
    }
    pd_list_add_tail(&k->c->leases, &l->link);
}

/* Prefill, push: a finished request's whole-prompt write waits for its reservation (or takes over
 * the one its stream had bound), unless its decode or the proxy gave up on it already. */
static void on_push_save(kv_conn_t *k, kv_xfer_t *x)
{
    x->conn = k;
    pd_list_add_tail(&k->c->xfers, &x->link);
    if (take_released(k, x->remote_req)) {
        x->state = KV_XS_DONE; /* no reservation will come */
        kv_report_sending(k, &x->report);
        return;
    }
    kv_resv_t *rv = x->resv_id != 0 ? kv_resv_find(k, x->resv_id) : NULL;
    if (rv != NULL) {
        rv->taken = false; /* the transfer takes it over (bind_resv) */
    }
}

/* Prefill, push: a stream's end. WRITE_DONE tells the decode (not a dead one) and ends the
 * reservation. */
static void on_write_done(kv_conn_t *k, const kv_notice_t *n)
{
    kv_resv_t *rv = kv_resv_find(k, n->resv_id);
    if (rv == NULL) {
        return; /* it expired before the request finished: the decode heard WRITE_DONE(timeout) */
    }
    if (!rv->dead && !rv->released) {
        Pd__WriteDone wd = PD__WRITE_DONE__INIT;
        wd.request_id = rv->transfer_id;
        wd.lease_id = rv->lease_id;
        wd.status = n->status;
        wd.layers_written = k->geom.num_layers;
        wd.has_first_token = n->first_token >= 0;
        wd.first_token = n->first_token;
        if (n->grammar_state != NULL) {
            wd.grammar_state = n->grammar_state;
        }
        wd.prompt_sha256.data = (uint8_t *)n->prompt_hash;
        wd.prompt_sha256.len = sizeof(n->prompt_hash);
        kv_peer_send(k, rv->peer, PD_MSG_WRITE_DONE, &wd.base);
    }
    rv->taken = false;
    kv_resv_end(k, rv, false);
}

bool kv_release_push(kv_conn_t *k, const char *transfer_id)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->kind == KV_X_PUSH_SAVE && x->state == KV_XS_QUEUED && x->resv == NULL &&
            strcmp(x->remote_req, transfer_id) == 0) {
            x->state = KV_XS_DONE; /* no reservation will come */
            kv_report_sending(k, &x->report);
            return true;
        }
    }
    /* the decode (push) or the proxy (pull: its client left) gave up before this prefill finished; its
     * request_finished holds nothing (bounded: a flood of unknown ids only resets the set) */
    if (k->c->released.slots == NULL || k->c->released.count >= 4096) {
        if (k->c->released.slots != NULL) {
            pd_strmap_destroy(&k->c->released);
        }
        if (pd_strmap_init(&k->c->released, 64) != PD_OK) {
            k->c->released.slots = NULL;
        }
    }
    if (k->c->released.slots == NULL ||
        pd_strmap_put(&k->c->released, transfer_id, strlen(transfer_id), 1) != PD_OK) {
        pd_log_error("kv connector: out of memory remembering the release of %s; its blocks are held until "
                     "--kv-hold-timeout",
                     transfer_id);
        return false;
    }
    return true;
}

/* POST /pd/release: the pull lease of request_id with lease_id, or whatever is held for
 * transfer_id (pd_kv_connector_release). */
static bool on_release(kv_conn_t *k, kv_release_t *r)
{
    kv_lease_t *l;
    pd_list_for_each (l, &k->c->leases, link) {
        bool by_lease = r->by_lease && l->lease_id == r->lease_id && strcmp(l->req_id, r->request_id) == 0;
        bool by_transfer = r->transfer_id[0] && strcmp(l->transfer_id, r->transfer_id) == 0;
        if (!l->expired && (by_lease || by_transfer)) {
            l->expired = true; /* a late READ_DONE is answered STALE */
            kv_report_sending(k, &l->report);
            r->lend = l->lend;
            return true;
        }
    }
    return r->transfer_id[0] && k->is_prefill && kv_release_push(k, r->transfer_id);
}

/* A node's drain, nothing in flight on its HTTP side; returns what still holds KV for a decode. A
 * prefill: no prompt will take a reservation now, so each untaken one ends at once with a WRITE_DONE
 * that tells its decode to recompute (rather than wait its --kv-load-timeout). A decode: its leases
 * (live migrations, lends) not read yet. */
static int on_drain(kv_conn_t *k, bool decode)
{
    int pending = 0;
    kv_lease_t *l;
    pd_list_for_each (l, &k->c->leases, link) {
        pending += !l->expired;
    }
    if (decode) {
        return pending; /* its own loads ended with their requests */
    }
    kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        if (rv->released || rv->dead) {
            continue;
        }
        if (rv->taken) {
            pending++;
            continue;
        }
        pd_log_info("kv connector: draining: reservation %s will not be written (its prompt went to another "
                    "prefill); its decode recomputes",
                    rv->transfer_id);
        kv_resv_refuse(k, rv, PD_ERR_CANCELLED);
    }
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        pending += x->state != KV_XS_DONE;
    }
    return pending;
}

void kv_ctl_commands(kv_conn_t *k)
{
    pd_list_link_t in;
    pd_list_head_init(&in);
    kv_mb_take(&k->mb, false, &in, 0, false);
    kv_msg_t *m;
    while ((m = pd_list_pop_head(&in, kv_msg_t, link)) != NULL) {
        switch (m->kind) {
        case KV_CMD_LOAD: {
            kv_xfer_t *x = pd_container_of(m, kv_xfer_t, msg);
            x->conn = k;
            pd_list_add_tail(&k->c->xfers, &x->link);
            break;
        }
        case KV_CMD_PUSH_SAVE: on_push_save(k, pd_container_of(m, kv_xfer_t, msg)); break;
        case KV_CMD_LEASE: on_lease(k, pd_container_of(m, kv_lease_t, msg)); break;
        case KV_CMD_CANCEL:
            on_cancel(k, pd_container_of(m, kv_cancel_t, msg)->req_id);
            kv_msg_free(m);
            break;
        case KV_CMD_TAKE_RESV: {
            kv_resv_t *rv = kv_resv_find(k, pd_container_of(m, kv_resv_ref_t, msg)->resv_id);
            if (rv != NULL && !rv->released && !rv->dead) {
                rv->taken = true; /* else the engine hears (heard) it is gone: its writes fail */
            }
            kv_msg_free(m);
            break;
        }
        case KV_CMD_WRITE_JOB: kv_post_job(k, pd_container_of(m, kv_write_job_t, msg)); break;
        case KV_CMD_WRITE_DONE:
            on_write_done(k, pd_container_of(m, kv_notice_t, msg));
            kv_msg_free(m);
            break;
        case KV_CMD_RELEASE: {
            kv_release_t *r = pd_container_of(m, kv_release_t, msg);
            r->released = on_release(k, r);
            if (r->released && r->lend) { /* pd-proxy releases every lend once its prefill answered */
                pd_log_debug("kv connector: released the lend %s (its prefill did not read it)",
                             r->transfer_id);
            } else if (r->released) {
                pd_log_info(
                    "kv connector: released the KV of %s at the proxy's request (its decode failed or "
                    "its client left)",
                    r->by_lease ? r->request_id : r->transfer_id);
            }
            kv_mb_emit(&k->mb, m); /* the answer (or, abandoned, freed) */
            break;
        }
        case KV_CMD_DRAIN:
            pd_container_of(m, kv_drain_t, msg)->pending =
                on_drain(k, pd_container_of(m, kv_drain_t, msg)->decode);
            kv_mb_emit(&k->mb, m); /* the answer (or, abandoned, freed) */
            break;
        case KV_CMD_STOP: k->c->stopping = true; break;
        default: /* an event kind never arrives here */
            pd_log_error("BUG: kv connector: event %d among the commands", (int)m->kind);
            kv_msg_free(m);
            break;
        }
    }
}
