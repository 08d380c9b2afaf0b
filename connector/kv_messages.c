/* connector/kv_messages.c — what the control thread does with each control message a peer
 * sends (regions, reservations, READ_DONE / ACK, WRITE_DONE, ABORT, heartbeats). Control thread,
 * Every id a peer names is validated before use. */
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
#include "common/sha256.h"
#include "common/time.h"
#include "connector/kv_ctl.h"

static kv_xfer_t *find_waiting(kv_conn_t *k, kv_peer_t *p, kv_xfer_kind_t kind, const char *rid,
                               uint64_t lease);
static void send_ack(kv_conn_t *k, kv_peer_t *p, const char *rid, uint64_t lease,
                     Pd__TransferAck__Result res);
static void on_read_done_msg(kv_conn_t *k, kv_peer_t *p, const Pd__ReadDone *m);
static void on_reservation(kv_conn_t *k, kv_peer_t *p, const Pd__Reservation *m);

static kv_xfer_t *find_waiting(kv_conn_t *k, kv_peer_t *p, kv_xfer_kind_t kind, const char *rid,
                               uint64_t lease)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
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
    kv_peer_send(k, p, PD_MSG_TRANSFER_ACK, &a.base);
}

/* The lease request_id holds under lease_id (expired ones too: they answer STALE), or NULL. A
 * lease is granted by a command: one not found yet may be waiting in the mailbox (the decode read
 * and answered faster than this loop took it), so the commands are taken before giving up. */
static kv_lease_t *find_lease(kv_conn_t *k, const char *request_id, uint64_t lease_id)
{
    for (int pass = 0; pass < 2; pass++) {
        kv_lease_t *l;
        pd_list_for_each (l, &k->c->leases, link) {
            if (l->lease_id == lease_id && request_id != NULL && strcmp(l->req_id, request_id) == 0) {
                return l;
            }
        }
        if (pass == 0) {
            kv_ctl_commands(k);
        }
    }
    return NULL;
}

static void on_read_done_msg(kv_conn_t *k, kv_peer_t *p, const Pd__ReadDone *m)
{
    double now = pd_time_now_s();
    kv_lease_t *l = find_lease(k, m->request_id, m->lease_id);
    pd_log_debug("kv connector: peer %s read the KV of %s (lease %s)", p->engine_id,
                 m->request_id != NULL ? m->request_id : "?",
                 l == NULL                        ? "unknown"
                 : l->expired || now > l->expires ? "stale"
                                                  : "held");
    if (l != NULL) {
        if (l->expired || now > l->expires) {
            send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__STALE);
            pd_metric_inc(k->m.stale, 1);
            return; /* the timer releases (or released) the blocks */
        }
        send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__OK);
        l->expired = true; /* no longer held; kept briefly so a duplicate is answered STALE */
        l->expires = now;
        kv_report_sending(k, &l->report);
        pd_metric_inc(k->m.completed[KV_X_PULL_LOAD], 1);
        return;
    }
    send_ack(k, p, m->request_id, m->lease_id, PD__TRANSFER_ACK__RESULT__UNKNOWN);
    pd_metric_inc(k->m.stale, 1);
}

/* A reservation record with room for n block ids and its KV_EV_RESV_GONE; NULL when out of memory. */
static kv_resv_t *resv_new(size_t n)
{
    kv_resv_t *rv = calloc(1, sizeof(*rv));
    if (rv == NULL || (rv->blocks = malloc((n ? n : 1) * sizeof(uint32_t))) == NULL ||
        (rv->gone = calloc(1, sizeof(*rv->gone))) == NULL) {
        kv_resv_free(rv);
        return NULL;
    }
    rv->gone->msg.kind = KV_EV_RESV_GONE;
    return rv;
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
        kv_resv_t *rv;
        uint64_t held = 0; /* block ids this peer's open reservations name */
        pd_list_for_each (rv, &k->c->resvs, link) {
            if (why == NULL && !rv->released && strcmp(rv->transfer_id, m->request_id) == 0) {
                why = "duplicate transfer id";
            }
            held += rv->peer == p && !rv->released ? (uint64_t)rv->num_blocks : 0;
        }
        /* a decode reserves blocks it allocated, each to one request: its open reservations never
         * name more than its cache holds (twice that leaves room for retries); a peer that does is
         * refused instead of holding memory here until --kv-hold-timeout */
        if (why == NULL && held + m->n_block_ids > 2ull * p->geom.num_blocks) {
            why = "more blocks reserved than the decode's KV cache holds";
        }
    }
    /* the record, the engine's copy and its end, all or nothing: an emit cannot fail */
    kv_resv_t *rv = why == NULL ? resv_new(m->n_block_ids) : NULL;
    kv_offer_t *o = rv != NULL ? calloc(1, sizeof(*o)) : NULL;
    if (o != NULL && (o->blocks = malloc((m->n_block_ids ? m->n_block_ids : 1) * sizeof(uint32_t))) == NULL) {
        kv_offer_free(o);
        o = NULL;
    }
    if (rv != NULL && o == NULL) {
        kv_resv_free(rv);
        rv = NULL;
    }
    if (rv == NULL) {
        pd_log_warn("kv connector: rejected a reservation from %s: %s", p->engine_id,
                    why ? why : "out of memory");
        Pd__WriteDone wd = PD__WRITE_DONE__INIT;
        wd.request_id = m->request_id != NULL ? m->request_id : (char *)"";
        wd.lease_id = m->lease_id;
        wd.status = PD_ERR_OUT_OF_RANGE;
        kv_peer_send(k, p, PD_MSG_WRITE_DONE, &wd.base);
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
    rv->id = k->c->next_resv_id++;
    rv->gone->resv_id = rv->id;
    pd_list_add_tail(&k->c->resvs, &rv->link);
    o->msg.kind = KV_EV_OFFER;
    o->resv_id = rv->id;
    snprintf(o->transfer_id, sizeof(o->transfer_id), "%s", rv->transfer_id);
    if (m->n_block_ids > 0) {
        memcpy(o->blocks, rv->blocks, m->n_block_ids * sizeof(uint32_t));
    }
    o->num_blocks = rv->num_blocks;
    o->skip_blocks = rv->skip_blocks;
    o->page_bytes = p->geom.page_bytes;
    memcpy(o->layer_offset, p->geom.layer_offset, sizeof(o->layer_offset));
    kv_mb_emit(&k->mb, &o->msg);
}

void kv_on_message(kv_conn_t *k, kv_peer_t *p, const pd_ctl_msg_t *msg)
{
    switch (msg->type) {
    case PD_MSG_HEARTBEAT: break;
    case PD_MSG_REGIONS: kv_on_regions(k, p, (const Pd__Regions *)msg->msg); break;
    case PD_MSG_READ_DONE: /* a prefill's lease, or any node's prefix lend (kv_lend) */
        on_read_done_msg(k, p, (const Pd__ReadDone *)msg->msg);
        break;
    case PD_MSG_TRANSFER_ACK: {
        const Pd__TransferAck *a = (const Pd__TransferAck *)msg->msg;
        kv_xfer_t *x = find_waiting(k, p, KV_X_PULL_LOAD, a->request_id, a->lease_id);
        if (x == NULL) {
            pd_log_debug("kv connector: peer %s acknowledged a read of %s that no load waits for",
                         p->engine_id, a->request_id != NULL ? a->request_id : "?");
            break;
        }
        if (a->result == PD__TRANSFER_ACK__RESULT__OK) {
            kv_observe_done(k, x);
            kv_end_load(k, x, true);
        } else {
            kv_fail_xfer(k, x,
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
        /* first-token handover: the decode goes on from the prefill's token even when it must
         * recompute the prompt, since a client may have it already (the scheduler checks its range) */
        x->has_first_token = w->has_first_token;
        x->first_token = w->first_token;
        free(x->grammar_state); /* (a structured output's; a copy that fails is replayed instead) */
        x->grammar_state = w->has_first_token && w->grammar_state != NULL && w->grammar_state[0] != '\0' &&
                                   strlen(w->grammar_state) <= KV_MAX_GRAMMAR_STATE
                               ? strdup(w->grammar_state)
                               : NULL;
        if (w->status == 0 && (w->prompt_sha256.len != sizeof(x->prompt_hash) ||
                               !pd_ct_equal(w->prompt_sha256.data, x->prompt_hash, sizeof(x->prompt_hash)))) {
            /* the prefill computed another prompt under this transfer id (a caller paired two
             * requests): what it wrote is not this request's KV */
            x->has_first_token = false;
            kv_fail_xfer(k, x,
                         "the prefill wrote KV for another prompt under this transfer id: KV discarded");
        } else if (w->status == 0) {
            /* the pages the prefill wrote: each layer's entries this decode holds */
            x->pages = 0;
            for (uint32_t l = 0; l < k->geom.num_layers; l++) {
                for (int32_t b = x->first_block; b < x->end_block && b < x->num_local; b++) {
                    x->pages += kv_entry_of_layer(&k->geom, b, (int32_t)l) && x->local_blocks[b] != 0;
                }
            }
            x->bytes = (size_t)x->pages * k->geom.page_bytes;
            kv_observe_done(k, x);
            kv_end_load(k, x, true);
        } else {
            char why[96];
            snprintf(why, sizeof(why), "the prefill reports %s", pd_status_str((pd_status_t)w->status));
            kv_fail_xfer(k, x, why);
        }
        break;
    }
    case PD_MSG_ABORT: {
        const Pd__Abort *a = (const Pd__Abort *)msg->msg;
        kv_lease_t *l = find_lease(k, a->request_id, a->lease_id); /* a decode's too: its lends */
        bool lease = l != NULL;
        if (l != NULL && !l->expired) {
            l->expired = true;
            l->expires = pd_time_now_s();
            kv_report_sending(k, &l->report);
        }
        if (!lease && k->is_prefill && k->push && a->request_id != NULL && a->request_id[0] &&
            strlen(a->request_id) < PD_REQ_ID_MAX) {
            kv_release_push(k, a->request_id); /* push: the transfer id of a decode that gave up */
        }
        break;
    }
    case PD_MSG_REJECT: kv_peer_dead(k, p, "it rejected us"); break;
    default: kv_peer_dead(k, p, "unexpected message type"); break;
    }
}
