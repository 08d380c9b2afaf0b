/* connector/kv_xfers.c — transfers on the control thread: queued ones find (or dial) their peer
 * and start on the pipe; page completions lead to READ_DONE / WRITE_DONE; write jobs of layer-wise
 * pushes are posted and come back to the engine thread; failures end loads as load errors. Control
 * thread (pipe callbacks run inside pd_pipe_progress, on it). */
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

static void on_pages_done(void *arg, pd_status_t st);
static void after_pages(kv_conn_t *k, kv_xfer_t *x);
static void start_xfer(kv_conn_t *k, kv_xfer_t *x);
static bool bind_resv(kv_conn_t *k, kv_xfer_t *x);
static void on_job_done(void *arg, pd_status_t st);

void kv_observe_done(kv_conn_t *k, kv_xfer_t *x)
{
    double now = pd_time_now_s();
    if (x->kind != KV_X_PUSH_SAVE && x->t_posted > 0) {
        pd_metric_observe(k->m.phase_queue, x->t_posted - x->started);
        if (x->kind == KV_X_PULL_LOAD && x->t_moved > 0) {
            pd_metric_observe(k->m.phase_transfer, x->t_moved - x->t_posted);
            pd_metric_observe(k->m.phase_notify, now - x->t_moved);
            kv_cost_observe(k, x->bytes, x->t_moved - x->t_posted, now - x->started);
        } else if (x->kind == KV_X_PUSH_LOAD) {
            pd_metric_observe(k->m.phase_remote, now - x->t_posted);
        }
        bool moved = x->kind == KV_X_PUSH_LOAD || x->t_moved > 0;
        pd_metric_observe(k->m.nixl_post_s, x->t_posted - x->started);
        if (moved) {
            pd_metric_observe(k->m.nixl_xfer_s, (x->kind == KV_X_PULL_LOAD ? x->t_moved : now) - x->t_posted);
        }
        pd_metric_observe(k->m.nixl_bytes, (double)x->bytes);
        pd_metric_observe(k->m.nixl_descs, (double)x->pages);
    }
    pd_metric_inc(k->m.completed[x->kind], 1);
    pd_metric_observe(k->m.latency, pd_time_now_s() - x->started);
    if (x->migration) { /* a few per drain: each one's load is the floor of its stream's pause */
        pd_metric_observe(k->m.migration_load_s, now - x->started);
        pd_log_info(
            "kv connector: request %s: its migrated KV is in: %d pages (%.1f MiB) in %.1f ms, of which "
            "%.1f ms queued",
            x->req_id, x->pages, (double)x->bytes / (1 << 20), 1e3 * (now - x->started),
            x->t_posted > 0 ? 1e3 * (x->t_posted - x->started) : 0.0);
    }
    pd_metric_observe(k->m.pages, (double)x->pages);
    pd_metric_inc(k->m.bytes, (double)x->bytes);
}

/* A pull load that ends before its READ_DONE went out (failed, timed out, or its request aborted):
 * the prefill still holds the blocks under the lease; tell it (ABORT) so it frees them now instead of
 * at --kv-hold-timeout. A push load that ends before its reservation went out: the prefill holds the
 * finished request's blocks for a reservation that will not come; the ABORT names the transfer id.
 * Without a live control connection the ABORT is deferred (kv_aborts.c) until one is back. */
static void abort_lease(kv_conn_t *k, kv_xfer_t *x, const char *why)
{
    bool pull = x->kind == KV_X_PULL_LOAD;
    if ((!pull && !(x->kind == KV_X_PUSH_LOAD && x->state == KV_XS_QUEUED)) || x->state == KV_XS_DONE) {
        return;
    }
    if (x->peer == NULL || x->peer->state == KV_PEER_DEAD) {
        kv_abort_defer(k, x); /* also after READ_DONE: it may have been lost with the connection */
        return;
    }
    if (x->state != KV_XS_QUEUED && x->state != KV_XS_POSTED) {
        return; /* READ_DONE went out: the prefill's answer ends the lease */
    }
    Pd__Abort a = PD__ABORT__INIT;
    a.request_id = x->remote_req;
    a.lease_id = x->lease_id;
    a.reason = (char *)why;
    kv_peer_send(k, x->peer, PD_MSG_ABORT, &a.base);
}

/* A decode load ended: the scheduler hears of it (and of the blocks that did not arrive). */
void kv_end_load(kv_conn_t *k, kv_xfer_t *x, bool ok)
{
    if (!ok) {
        abort_lease(k, x, x->cancelled ? "the request was aborted" : "the load failed");
    }
    kv_report_recving(k, x, ok);
    x->state = KV_XS_DONE;
}

void kv_fail_xfer(kv_conn_t *k, kv_xfer_t *x, const char *why)
{
    if (x->state == KV_XS_DONE) {
        return;
    }
    pd_log_warn("kv connector: transfer for request %s failed: %s", x->req_id, why);
    pd_metric_inc(k->m.failed[x->kind], 1);
    if (x->kind != KV_X_PUSH_SAVE) {
        pd_metric_inc(k->m.nixl_failed, 1);
    }
    if (x->kind == KV_X_PUSH_SAVE) {
        kv_report_sending(k, &x->report);
        x->state = KV_XS_DONE;
        return;
    }
    kv_end_load(k, x, false);
}

static void on_pages_done(void *arg, pd_status_t st)
{
    kv_xfer_t *x = arg;
    if (x->state != KV_XS_POSTED) {
        return;
    }
    if (st != PD_OK) {
        kv_fail_xfer(x->conn, x, pd_status_str(st));
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
        if (kv_peer_send(k, x->peer, PD_MSG_READ_DONE, &rd.base) != PD_OK) {
            kv_fail_xfer(k, x, "cannot send READ_DONE");
        }
        return;
    }
    Pd__WriteDone wd = PD__WRITE_DONE__INIT;
    wd.request_id = x->remote_req;
    wd.lease_id = x->resv->lease_id;
    wd.status = 0;
    wd.layers_written = k->geom.num_layers;
    wd.has_first_token = x->has_first_token;
    wd.first_token = x->first_token;
    if (x->grammar_state != NULL) {
        wd.grammar_state = x->grammar_state;
    }
    wd.prompt_sha256.data = x->prompt_hash;
    wd.prompt_sha256.len = sizeof(x->prompt_hash);
    kv_resv_end(k, x->resv, false);
    if (kv_peer_send(k, x->peer, PD_MSG_WRITE_DONE, &wd.base) != PD_OK) {
        kv_fail_xfer(k, x, "cannot send WRITE_DONE");
        return;
    }
    kv_observe_done(k, x);
    kv_report_sending(k, &x->report);
    x->state = KV_XS_DONE;
}

/* Push load: reserve our blocks with the prefill and wait for its WRITE_DONE. */
static void start_reservation(kv_conn_t *k, kv_xfer_t *x)
{
    Pd__Reservation r = PD__RESERVATION__INIT;
    r.request_id = x->remote_req;
    x->lease_id = ((pd_time_now_ns() * 0x9E3779B97F4A7C15ull) ^ (uintptr_t)x) & ((1ull << 52) - 1);
    r.lease_id = x->lease_id;
    r.expires_unix_ms = (uint64_t)time(NULL) * 1000 + (uint64_t)kv_ms_of(x->deadline - pd_time_now_s());
    r.block_ids = x->local_blocks;
    r.n_block_ids = (size_t)(x->end_block < x->num_local ? x->end_block : x->num_local);
    r.num_tokens = (uint32_t)x->num_tokens;
    r.skip_blocks = (uint32_t)x->first_block;
    pd_metric_inc(k->m.started[KV_X_PUSH_LOAD], 1);
    x->state = KV_XS_WAIT_PEER;
    x->t_posted = pd_time_now_s();
    if (kv_peer_send(k, x->peer, PD_MSG_RESERVATION, &r.base) != PD_OK) {
        kv_fail_xfer(k, x, "cannot send the reservation");
    }
}

/* Why entries [first, end) of x's block lists cannot move, or NULL: both lists cover them, every
 * remote id lies in the peer's cache, and the loading side finds each entry it holds on the other
 * (a sliding-window group's null entries are outside the window). */
static const char *check_blocks(const kv_xfer_t *x, const kv_geom_t *rg)
{
    if (x->end_block > x->num_remote || x->end_block > x->num_local) {
        return "fewer blocks than the prompt needs";
    }
    for (int32_t b = x->first_block; b < x->end_block; b++) {
        if (x->remote_blocks[b] >= rg->num_blocks) {
            return "a remote block id is outside the peer's KV cache";
        }
        uint32_t want = x->kind == KV_X_PULL_LOAD ? x->local_blocks[b] : x->remote_blocks[b];
        uint32_t have = x->kind == KV_X_PULL_LOAD ? x->remote_blocks[b] : x->local_blocks[b];
        if (want != 0 && have == 0) {
            return "the peer no longer holds a block inside the sliding window";
        }
    }
    return NULL;
}

/* Every layer's pages of entries [first, end) both sides hold, each layer its group's entries, into
 * pages (room for entries × layers); returns the count. */
static size_t list_pages(const kv_conn_t *k, const kv_xfer_t *x, const kv_geom_t *rg, pd_page_xfer_t *pages)
{
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
    return i;
}

/* Starts a decode load (pull: read; push: reserve) or a prefill save on a ready peer. */
static void start_xfer(kv_conn_t *k, kv_xfer_t *x)
{
    if (x->kind == KV_X_PUSH_LOAD) {
        start_reservation(k, x);
        return;
    }
    /* pull load (read remote → local) or push save (write local → remote) */
    kv_peer_t *p = x->peer;
    const char *why = check_blocks(x, &p->geom);
    if (why != NULL) {
        kv_fail_xfer(k, x, why);
        return;
    }
    if (!x->start_counted) {
        pd_metric_inc(k->m.started[x->kind], 1);
    }
    pd_log_debug("kv connector: request %s: starting %s of blocks [%d, %d) %.3f ms after it was queued",
                 x->req_id, x->kind == KV_X_PULL_LOAD ? "a read" : "a write", x->first_block, x->end_block,
                 (pd_time_now_s() - x->started) * 1e3);
    x->state = KV_XS_POSTED;
    x->t_posted = pd_time_now_s();
    int32_t n_entries = x->end_block - x->first_block;
    pd_page_xfer_t *pages =
        n_entries > 0 ? malloc((size_t)n_entries * k->geom.num_layers * sizeof(*pages)) : NULL;
    if (n_entries > 0 && pages == NULL) {
        kv_fail_xfer(k, x, "out of memory");
        return;
    }
    size_t n = n_entries > 0 ? list_pages(k, x, &p->geom, pages) : 0;
    if (n == 0) { /* a full local hit, or every entry outside the window: nothing to move */
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
        kv_fail_xfer(k, x, pd_status_str(st));
    }
}

/* A push save binds the reservation its stream had taken (x->resv_id), else the first for its
 * transfer id that arrived and nothing writes into. */
static bool bind_resv(kv_conn_t *k, kv_xfer_t *x)
{
    kv_resv_t *rv;
    pd_list_for_each (rv, &k->c->resvs, link) {
        bool mine = x->resv_id != 0 ? rv->id == x->resv_id : !rv->taken;
        if (!mine || rv->released || rv->dead || strcmp(rv->transfer_id, x->remote_req) != 0) {
            continue;
        }
        /* the copy first: a transfer bound without its block list would write nothing and report
         * WRITE_DONE (it waits for the next tick instead) */
        x->remote_blocks = malloc((size_t)(rv->num_blocks > 0 ? rv->num_blocks : 1) * sizeof(uint32_t));
        if (x->remote_blocks == NULL) {
            return false;
        }
        rv->taken = true;
        x->resv = rv;
        x->peer = rv->peer;
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

/* Moves queued transfers on: find or dial their peer, start them when it is ready. */
void kv_drive_queued(kv_conn_t *k)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->c->xfers, link) {
        if (x->state != KV_XS_QUEUED) {
            continue;
        }
        if (x->kind == KV_X_PUSH_SAVE) {
            if (x->resv == NULL && !bind_resv(k, x)) {
                kv_resv_t *rv;
                pd_list_for_each (rv, &k->c->resvs, link) {
                    if (rv->dead && strcmp(rv->transfer_id, x->remote_req) == 0) {
                        kv_fail_xfer(k, x, "the decode that reserved blocks for it is gone");
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
            kv_peer_t *p = kv_find_peer(k, x->dial);
            if (p != NULL && p->state == KV_PEER_READY && x->remote_engine[0] &&
                strcmp(p->engine_id, x->remote_engine) != 0 && !x->redialed) {
                /* the prefill behind this address restarted: refresh the connection once */
                x->redialed = true;
                kv_peer_dead(k, p, "it restarted with a new engine id");
                p = NULL;
            }
            if (p == NULL) { /* dial (once per address); the transfer waits for the handshake */
                if (kv_find_dial(k, x->dial) == NULL && !kv_dial_start(k, x->dial)) {
                    kv_fail_xfer(k, x, "cannot connect to the prefill");
                }
                continue;
            }
            x->peer = p;
        }
        if (x->peer->state == KV_PEER_DEAD) {
            kv_fail_xfer(k, x, "peer gone");
        } else if (x->peer->state == KV_PEER_READY) {
            if (x->cancelled && x->kind == KV_X_PULL_LOAD) {
                kv_end_load(k, x, false); /* aborted while queued: no read, the lease goes back (ABORT) */
            } else if (x->remote_engine[0] && strcmp(x->peer->engine_id, x->remote_engine) != 0) {
                kv_fail_xfer(k, x, "the prefill that computed this KV no longer runs at that address");
            } else {
                start_xfer(k, x);
            }
        }
    }
}

static void on_job_done(void *arg, pd_status_t st)
{
    kv_write_job_t *j = arg;
    kv_conn_t *k = j->conn;
    k->c->jobs_posted--;
    if (st == PD_OK) {
        pd_metric_inc(k->m.bytes, (double)j->bytes);
        pd_metric_observe(k->m.pages, (double)j->num_pages);
    }
    j->status = st;
    j->msg.kind = KV_EV_JOB_DONE;
    kv_mb_emit(&k->mb, &j->msg); /* the engine thread's wait_for_save counts it */
}

void kv_post_job(kv_conn_t *k, kv_write_job_t *j)
{
    kv_resv_t *rv = kv_resv_find(k, j->resv_id);
    pd_status_t st = PD_ERR_PEER_GONE;
    j->conn = k;
    k->c->jobs_posted++;
    /* a reservation ended (expired, released, its decode died) takes no more writes: its blocks may
     * be another request's by now */
    if (rv != NULL && rv->taken && !rv->released && !rv->dead && rv->peer->state == KV_PEER_READY) {
        st = pd_pipe_write_pages(k->pipe, rv->peer->pp, k->region, rv->peer->remote, j->pages, j->num_pages,
                                 on_job_done, j);
    }
    if (st != PD_OK) {
        on_job_done(j, st);
    }
}
