/* connector/kv_connector.c — the P/D connector's scheduler and worker halves (engine thread),
 * its configuration and lifecycle. The control thread is in kv_ctl.c. */
#define _GNU_SOURCE
#include "connector/kv_connector.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "connector/kv_internal.h"
#include "kernels/backend.h"
#include "scheduler/scheduler.h"

/* ------------------------------------------------------------------ configuration */

void pd_kv_connector_config_defaults(pd_kv_connector_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->role = "decode";
    c->mode = "pull";
    c->pipe = "ucx";
    c->listen = "127.0.0.1:0";
    c->ucx_err_mode = "none";
    c->hold_timeout = 120;
    c->load_timeout = 60;
    c->handshake_timeout = 5;
    c->heartbeat_interval = 1;
    c->heartbeat_misses = 5;
    c->save_timeout = 30;
    c->load_failure_policy = "recompute";
    c->prefault = true;
    c->staging = "auto";
}

size_t pd_kv_connector_flags(pd_kv_connector_config_t *c, pd_flag_t *out, size_t max)
{
    const pd_flag_t f[] = {
        {"kv-transfer-mode", PD_FLAG_CHOICE, &c->mode,
         "pull: decode reads the prefill's held blocks; push: prefill writes each layer into the decode's "
         "reserved blocks",
         "pull|push"},
        {"kv-pipe", PD_FLAG_CHOICE, &c->pipe,
         "transport for KV pages (nccl: a GPU build with --device cuda; moves device KV in place)",
         "ucx|tcp|nccl"},
        {"kv-listen", PD_FLAG_STR, &c->listen, "HOST:PORT of the KV control listener (port 0 = any free)",
         NULL},
        {"kv-advertise-host", PD_FLAG_STR, &c->advertise_host,
         "host peers dial for this node's KV (default: the --kv-listen host)", NULL},
        {"kv-ucx-err-mode", PD_FLAG_CHOICE, &c->ucx_err_mode,
         "ucx: none = shared-memory RMA, dead peers found by heartbeat; peer = UCX error handling (TCP RMA, "
         "slower)",
         "none|peer"},
        {"kv-tcp-busy-poll-us", PD_FLAG_INT, &c->tcp_busy_poll_us,
         "tcp pipe: after serving a peer's request, its receiver thread polls this many µs before sleeping "
         "(spends a core while requests keep coming; saves a thread wake-up per page request)",
         NULL},
        {"cluster-token-file", PD_FLAG_STR, &c->cluster_token_file,
         "file holding the secret every node of the cluster shares (proved, never sent)", NULL},
        {"kv-hold-timeout", PD_FLAG_DOUBLE, &c->hold_timeout,
         "seconds a prefill holds a finished request's blocks for its reader (pull) or its reservation "
         "(push)",
         NULL},
        {"kv-load-timeout", PD_FLAG_DOUBLE, &c->load_timeout,
         "seconds a decode request waits in WAITING_FOR_REMOTE_KV before the failure policy applies", NULL},
        {"kv-handshake-timeout", PD_FLAG_DOUBLE, &c->handshake_timeout,
         "seconds to dial a peer, authenticate and exchange regions", NULL},
        {"kv-heartbeat-interval", PD_FLAG_DOUBLE, &c->heartbeat_interval, "seconds between heartbeats", NULL},
        {"kv-heartbeat-misses", PD_FLAG_INT, &c->heartbeat_misses,
         "silent heartbeat intervals before a peer is declared dead", NULL},
        {"kv-save-timeout", PD_FLAG_DOUBLE, &c->save_timeout,
         "seconds a prefill step waits for its layer writes (push)", NULL},
        {"kv-prefault", PD_FLAG_BOOL, &c->prefault,
         "touch every page of the KV region in a background thread at start (first-touch faults stay out of "
         "transfers)",
         NULL},
        {"kv-staging", PD_FLAG_CHOICE, &c->staging,
         "auto: copy KV through a host mirror only when the pipe cannot register the KV's memory (device KV "
         "over ucx/tcp); always: also for host KV (tests the GPU path's copies on a CPU)",
         "auto|always"},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    n = n < max ? n : max;
    memcpy(out, f, n * sizeof(f[0]));
    return n;
}

/* ------------------------------------------------------------------ helpers */

/* staging (host mirror of a device KV), defined below */
static bool stage_failed_take(kv_conn_t *k, const char *req_id);

static bool jbool(const json_t *o, const char *key)
{
    return json_is_true(json_object_get(o, key));
}

static const char *jstr(const json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));
}

static bool push_str(char ***arr, int32_t *n, int32_t *cap, const char *s)
{
    if (*n == *cap) {
        int32_t c = *cap ? 2 * *cap : 16;
        char **a = realloc(*arr, (size_t)c * sizeof(char *));
        if (a == NULL) {
            return false;
        }
        *arr = a;
        *cap = c;
    }
    char *d = strdup(s);
    if (d == NULL) {
        return false;
    }
    (*arr)[(*n)++] = d;
    return true;
}

void kv_report_sending(kv_conn_t *k, const char *req_id)
{
    push_str(&k->fin_sending, &k->num_fin_sending, &k->cap_fin_sending, req_id);
    if (k->pub.wake != NULL) {
        k->pub.wake(k->pub.wake_arg);
    }
}

void kv_report_recving(kv_conn_t *k, const char *req_id)
{
    push_str(&k->fin_recving, &k->num_fin_recving, &k->cap_fin_recving, req_id);
    if (k->pub.wake != NULL) {
        k->pub.wake(k->pub.wake_arg);
    }
}

void kv_report_load_errors(kv_conn_t *k, const uint32_t *blocks, int32_t n)
{
    if (k->num_load_errors + n > k->cap_load_errors) {
        int32_t c = (k->num_load_errors + n) * 2;
        uint32_t *a = realloc(k->load_errors, (size_t)c * sizeof(uint32_t));
        if (a == NULL) {
            return;
        }
        k->load_errors = a;
        k->cap_load_errors = c;
    }
    memcpy(k->load_errors + k->num_load_errors, blocks, (size_t)n * sizeof(uint32_t));
    k->num_load_errors += n;
    pd_metric_inc(strcmp(k->cfg.load_failure_policy, "fail") == 0 ? k->m.policy_fail : k->m.policy_recompute,
                  1);
}

void kv_xfer_free(kv_xfer_t *x)
{
    if (x != NULL) {
        free(x->local_blocks);
        free(x->remote_blocks);
        free(x);
    }
}

static uint64_t random_u52(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v)) {
        v = pd_time_now_ns() * 0x9E3779B97F4A7C15ull;
    }
    return (v & ((1ull << 52) - 1)) | 1; /* JSON-safe integer, never 0 */
}

/* The transfer mode of a request: its kv_transfer_params say, else the node's. */
static bool wants_push(const kv_conn_t *k, const json_t *p)
{
    const char *m = jstr(p, "transfer_mode");
    return m != NULL ? strcmp(m, "push") == 0 : k->push;
}

/* ------------------------------------------------------------------ scheduler half */

/* A decode request's remote-prefill parameters are usable: where to load from and what. */
static bool remote_prefill_ok(const kv_conn_t *k, const pd_request_t *req, const json_t *p)
{
    json_int_t port = json_integer_value(json_object_get(p, "remote_port"));
    const char *host = jstr(p, "remote_host");
    const char *why = NULL;
    if (host == NULL || host[0] == '\0' || port <= 0 || port > 65535) {
        why = "remote_host/remote_port missing or invalid";
    } else if (wants_push(k, p)) {
        const char *tid = jstr(p, "transfer_id");
        if (tid == NULL || tid[0] == '\0' || strlen(tid) >= PD_REQ_ID_MAX) {
            why = "transfer_id missing or too long";
        }
    } else {
        const json_t *b = json_object_get(p, "remote_block_ids");
        const char *rid = jstr(p, "remote_request_id");
        json_int_t nt = json_integer_value(json_object_get(p, "remote_num_tokens"));
        if (!json_is_array(b) || rid == NULL || strlen(rid) >= PD_REQ_ID_MAX) {
            why = "remote_block_ids/remote_request_id missing";
        } else if (nt != 0 && nt != req->num_prompt_tokens) {
            why = "the prefill computed a different prompt length";
        } else {
            for (size_t i = 0; i < json_array_size(b); i++) {
                json_int_t v = json_integer_value(json_array_get(b, i));
                if (!json_is_integer(json_array_get(b, i)) || v < 0 || v > UINT32_MAX) {
                    why = "remote_block_ids holds a non-block value";
                    break;
                }
            }
            int32_t need =
                kv_entry(&k->geom, (req->num_prompt_tokens - 1 + k->block_size - 1) / k->block_size);
            if (why == NULL && (int32_t)json_array_size(b) < need) {
                why = "remote_block_ids has fewer blocks than the prompt needs";
            }
        }
    }
    if (why != NULL) {
        pd_log_warn(
            "kv connector: request %s: kv_transfer_params unusable (%s); computing the prompt locally",
            req->id, why);
        return false;
    }
    return true;
}

static pd_status_t kv_get_num_new_matched_tokens(pd_connector_t *c, const pd_request_t *req,
                                                 int32_t num_computed, int32_t *num_external_out,
                                                 bool *load_async_out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    *num_external_out = 0;
    *load_async_out = false;
    const json_t *p = req->kv_transfer_params;
    if (k->is_prefill || p == NULL || !jbool(p, "do_remote_prefill") || num_computed >= req->num_tokens) {
        return PD_OK;
    }
    if (!remote_prefill_ok(k, req, p)) {
        return PD_OK;
    }
    *num_external_out = req->num_tokens - num_computed;
    *load_async_out = true;
    return PD_OK;
}

static void kv_update_state_after_alloc(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                        int32_t num_blocks, int32_t num_external)
{
    kv_conn_t *k = (kv_conn_t *)c;
    json_t *p = req->kv_transfer_params;
    if (k->is_prefill || p == NULL || num_external <= 0 || !jbool(p, "do_remote_prefill")) {
        return;
    }
    json_object_set_new(p, "do_remote_prefill", json_false()); /* loaded at most once */
    kv_xfer_t *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        return;
    }
    bool push = wants_push(k, p);
    x->kind = push ? KV_X_PUSH_LOAD : KV_X_PULL_LOAD;
    snprintf(x->req_id, sizeof(x->req_id), "%s", req->id);
    snprintf(x->remote_req, sizeof(x->remote_req), "%s",
             push ? jstr(p, "transfer_id") : jstr(p, "remote_request_id"));
    snprintf(x->dial, sizeof(x->dial), "%s:%lld", jstr(p, "remote_host"),
             (long long)json_integer_value(json_object_get(p, "remote_port")));
    const char *eng = jstr(p, "remote_engine_id");
    snprintf(x->remote_engine, sizeof(x->remote_engine), "%s", eng != NULL ? eng : "");
    x->lease_id = (uint64_t)json_integer_value(json_object_get(p, "lease_id"));
    x->num_tokens = req->num_tokens;
    x->local_blocks = malloc((size_t)(num_blocks > 0 ? num_blocks : 1) * sizeof(uint32_t));
    if (x->local_blocks == NULL) {
        free(x);
        return;
    }
    memcpy(x->local_blocks, block_ids, (size_t)num_blocks * sizeof(uint32_t));
    x->num_local = num_blocks;
    int32_t local = req->num_tokens - num_external;             /* block-aligned prefix hit */
    x->first_block = kv_entry(&k->geom, local / k->block_size); /* entries of the block list */
    x->end_block = kv_entry(&k->geom, (req->num_tokens - 1 + k->block_size - 1) / k->block_size);
    if (!push) {
        const json_t *b = json_object_get(p, "remote_block_ids");
        x->num_remote = (int32_t)json_array_size(b);
        x->remote_blocks = malloc((size_t)(x->num_remote > 0 ? x->num_remote : 1) * sizeof(uint32_t));
        if (x->remote_blocks == NULL) {
            kv_xfer_free(x);
            return;
        }
        for (int32_t i = 0; i < x->num_remote; i++) {
            x->remote_blocks[i] = (uint32_t)json_integer_value(json_array_get(b, (size_t)i));
        }
    }
    x->started = pd_time_now_s();
    x->deadline = x->started + k->cfg.load_timeout;
    x->next = k->sched_pending;
    k->sched_pending = x;
}

static void *kv_build_connector_meta(pd_connector_t *c, const pd_scheduler_output_t *out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = &k->meta_build;
    m->loads = k->sched_pending;
    k->sched_pending = NULL;
    m->num_saves = 0;
    if (!k->is_prefill) {
        return m;
    }
    for (int32_t i = 0; i < out->num_items; i++) {
        const pd_request_t *r = out->items[i].req;
        const json_t *p = r->kv_transfer_params;
        bool remote_decode = p != NULL && jbool(p, "do_remote_decode");
        bool push = remote_decode && wants_push(k, p) && jstr(p, "transfer_id") != NULL;
        if (!push && !(remote_decode && k->staged)) {
            continue;
        }
        if (m->num_saves == m->cap_saves) {
            int32_t cap = m->cap_saves ? 2 * m->cap_saves : 16;
            kv_save_item_t *a = realloc(m->saves, (size_t)cap * sizeof(*a));
            if (a == NULL) {
                break;
            }
            m->saves = a;
            m->cap_saves = cap;
        }
        kv_save_item_t *s = &m->saves[m->num_saves++];
        snprintf(s->req_id, sizeof(s->req_id), "%s", r->id);
        snprintf(s->transfer_id, sizeof(s->transfer_id), "%s", push ? jstr(p, "transfer_id") : "");
        s->push = push;
        s->cached_tokens = r->num_cached_tokens;
        s->blocks = r->block_ids;
        s->num_blocks = kv_entry(&k->geom, r->num_blocks);
        s->start_token = r->num_computed_tokens;
        s->end_token = r->num_computed_tokens + out->items[i].num_new_tokens;
        s->prompt_len = r->num_prompt_tokens;
    }
    return m;
}

static kv_push_t *push_find(kv_conn_t *k, const char *req_id, bool unlink)
{
    for (kv_push_t **pp = &k->pushes; *pp != NULL; pp = &(*pp)->next) {
        if (strcmp((*pp)->req_id, req_id) == 0) {
            kv_push_t *p = *pp;
            if (unlink) {
                *pp = p->next;
            }
            return p;
        }
    }
    return NULL;
}

/* Queues a notification for the ctl thread (mu held). */
static void notice(kv_conn_t *k, pd_msg_type_t type, kv_peer_t *peer, const char *rid, uint64_t lease,
                   int32_t status)
{
    kv_notice_t *n = calloc(1, sizeof(*n));
    if (n == NULL) {
        return;
    }
    n->type = type;
    n->peer = peer;
    snprintf(n->request_id, sizeof(n->request_id), "%s", rid);
    n->lease_id = lease;
    n->status = status;
    n->next = k->notices;
    k->notices = n;
}

/* Decode: a load of req that has not finished; marks it cancelled. Returns whether blocks may
 * still be written or read by the peer (delay free). mu held. */
static bool cancel_load(kv_conn_t *k, const char *req_id)
{
    kv_xfer_t *lists[2] = {k->handoff, k->xfers};
    for (int l = 0; l < 2; l++) {
        for (kv_xfer_t *x = lists[l]; x != NULL; x = x->next) {
            if (x->kind != KV_X_PUSH_SAVE && strcmp(x->req_id, req_id) == 0 && x->state != KV_XS_DONE) {
                x->cancelled = true;
                return true;
            }
        }
    }
    return false;
}

static bool kv_request_finished(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                int32_t num_blocks, void **params_out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    json_t *p = req->kv_transfer_params;
    bool ok = req->state == PD_REQ_FINISHED_STOPPED || req->state == PD_REQ_FINISHED_LENGTH;
    if (!k->is_prefill) {
        /* a load not yet handed over dies with the request; one in flight keeps the blocks */
        for (kv_xfer_t **xp = &k->sched_pending; *xp != NULL; xp = &(*xp)->next) {
            if (strcmp((*xp)->req_id, req->id) == 0) {
                kv_xfer_t *x = *xp;
                *xp = x->next;
                kv_xfer_free(x);
                break;
            }
        }
        pthread_mutex_lock(&k->mu);
        bool hold = cancel_load(k, req->id);
        pthread_mutex_unlock(&k->mu);
        if (p != NULL) {
            *params_out = json_null(); /* a decode hands nothing on (as vLLM's decode answers) */
        }
        return hold;
    }
    if (p == NULL || !jbool(p, "do_remote_decode")) {
        return false;
    }
    if (wants_push(k, p)) {
        kv_push_t *ps = push_find(k, req->id, true);
        const char *tid = jstr(p, "transfer_id");
        bool hold = false;
        pthread_mutex_lock(&k->mu);
        if (ps != NULL && ps->resv != NULL && (ps->streaming || !ok)) {
            /* every layer of every step was written (or the request died): tell the decode */
            int32_t status = ok && !ps->failed ? 0 : (ok ? PD_ERR_IO : PD_ERR_CANCELLED);
            notice(k, PD_MSG_WRITE_DONE, ps->resv->peer, ps->transfer_id, ps->resv->lease_id, status);
            ps->resv->released = true;
            pd_metric_inc(status == 0 ? k->m.completed[KV_X_PUSH_SAVE] : k->m.failed[KV_X_PUSH_SAVE], 1);
        } else if (ok && tid != NULL && num_blocks > 0) {
            /* the reservation is late (or came mid-prefill): write everything when it is here */
            kv_xfer_t *x = calloc(1, sizeof(*x));
            if (x != NULL && (x->local_blocks = malloc((size_t)num_blocks * sizeof(uint32_t))) != NULL) {
                x->kind = KV_X_PUSH_SAVE;
                snprintf(x->req_id, sizeof(x->req_id), "%s", req->id);
                snprintf(x->remote_req, sizeof(x->remote_req), "%s", tid);
                memcpy(x->local_blocks, block_ids, (size_t)num_blocks * sizeof(uint32_t));
                x->num_local = num_blocks;
                x->num_tokens = req->num_prompt_tokens;
                x->started = pd_time_now_s();
                x->deadline = x->started + k->cfg.hold_timeout;
                if (ps != NULL && ps->resv != NULL) {
                    ps->resv->taken = false; /* the transfer takes it over */
                }
                x->next = k->handoff;
                k->handoff = x;
                hold = true;
            } else {
                free(x);
            }
        }
        pthread_mutex_unlock(&k->mu);
        free(ps);
        if (hold) {
            kv_ctl_wake(k);
        }
        return hold;
    }
    if (stage_failed_take(k, req->id)) {
        pd_log_warn("kv connector: request %s: its KV could not be staged to host memory; no KV is "
                    "offered (no kv_transfer_params: the request fails cleanly instead of decoding garbage)",
                    req->id);
        return false;
    }
    if (!ok || num_blocks == 0) {
        return false;
    }
    /* pull: hold the blocks under a lease and tell the decode where they are */
    kv_lease_t *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return false;
    }
    snprintf(l->req_id, sizeof(l->req_id), "%s", req->id);
    l->lease_id = random_u52();
    l->expires = pd_time_now_s() + k->cfg.hold_timeout;
    json_t *blocks = json_array();
    for (int32_t i = 0; i < num_blocks; i++) {
        json_array_append_new(blocks, json_integer(block_ids[i]));
    }
    json_t *out = json_pack(
        "{s:b, s:b, s:s, s:o, s:s, s:i, s:s, s:I, s:I, s:i, s:s}", "do_remote_prefill", 1, "do_remote_decode",
        0, "remote_engine_id", k->engine_id, "remote_block_ids", blocks, "remote_host", k->advertise_host,
        "remote_port", k->listen_port, "remote_request_id", req->id, "lease_id", (json_int_t)l->lease_id,
        "lease_expires_unix_ms", (json_int_t)((double)time(NULL) * 1000 + k->cfg.hold_timeout * 1000),
        "remote_num_tokens", req->num_prompt_tokens, "transfer_mode", "pull");
    if (out == NULL) {
        free(l);
        return false;
    }
    pthread_mutex_lock(&k->mu);
    l->next = k->leases;
    k->leases = l;
    pthread_mutex_unlock(&k->mu);
    pd_metric_inc(k->m.leases_held, 1);
    *params_out = out;
    return true;
}

/* ------------------------------------------------------------------ staging (host mirror) */

static void start_prefault(kv_conn_t *k);

/* Page ranges of block-list entries [e0, e1) of list in layers [l0, l1) of the KV layout (each
 * layer its group's entries, null entries skipped), adjacent pages merged; *out is malloc'd.
 * Returns the count, -1 when out of memory. */
static int32_t stage_ranges(const kv_conn_t *k, int32_t l0, int32_t l1, const uint32_t *list, int32_t e0,
                            int32_t e1, pd_page_range_t **out)
{
    int32_t n = e1 - e0;
    pd_page_range_t *r = malloc(((size_t)(l1 - l0) * (size_t)n + 1) * sizeof(*r));
    *out = r;
    if (r == NULL) {
        return -1;
    }
    int32_t m = 0;
    for (int32_t l = l0; l < l1; l++) {
        for (int32_t b = e0; b < e1; b++) {
            if (list[b] == 0 || !kv_entry_of_layer(&k->geom, b, l)) {
                continue;
            }
            uint64_t off = k->geom.layer_offset[l] + (uint64_t)list[b] * k->geom.page_bytes;
            if (m > 0 && r[m - 1].offset + r[m - 1].length == off) {
                r[m - 1].length += k->geom.page_bytes;
            } else {
                r[m++] = (pd_page_range_t){off, k->geom.page_bytes};
            }
        }
    }
    return m;
}

/* Copies ranges between the engine's KV and the host mirror (to_host: device→host). */
static pd_status_t stage_copy(kv_conn_t *k, const pd_page_range_t *r, int32_t n, bool to_host)
{
    double t0 = pd_time_now_s();
    pd_status_t st = to_host ? k->be->ops->copy_pages(k->be, k->region->base, k->kv_base, r, n, PD_COPY_D2H)
                             : k->be->ops->copy_pages(k->be, k->kv_base, k->region->base, r, n, PD_COPY_H2D);
    if (st != PD_OK) {
        pd_log_warn("kv connector: staging copy %s failed: %s", to_host ? "device→host" : "host→device",
                    pd_status_str(st));
        return st;
    }
    uint64_t bytes = 0;
    for (int32_t i = 0; i < n; i++) {
        bytes += r[i].length;
    }
    pd_metric_inc(to_host ? k->m.staged_d2h : k->m.staged_h2d, (double)bytes);
    pd_metric_observe(k->m.staged_seconds, pd_time_now_s() - t0);
    return PD_OK;
}

/* Prefill: copies the pages layer `layer` wrote this step for save item s into the mirror. The
 * first step also copies the prefix-cache hit's pages (another request computed them, maybe one
 * that was never staged). */
static pd_status_t stage_save_layer(kv_conn_t *k, const kv_save_item_t *s, int32_t layer)
{
    int32_t b0 = s->start_token <= s->cached_tokens ? 0 : kv_entry(&k->geom, s->start_token / k->block_size);
    int32_t b1 = kv_entry(&k->geom, (s->end_token + k->block_size - 1) / k->block_size);
    b1 = b1 < s->num_blocks ? b1 : s->num_blocks;
    if (b0 >= b1) {
        return PD_OK;
    }
    pd_page_range_t *r;
    int32_t n = stage_ranges(k, layer, layer + 1, s->blocks, b0, b1, &r);
    pd_status_t st = n < 0 ? PD_ERR_NO_MEMORY : stage_copy(k, r, n, true);
    free(r);
    return st;
}

/* Pull-mode requests whose staging failed (engine thread): request_finished offers no KV. */
static void stage_failed_add(kv_conn_t *k, const char *req_id)
{
    if (k->stage_failed.slots != NULL || pd_strmap_init(&k->stage_failed, 16) == PD_OK) {
        pd_strmap_put(&k->stage_failed, req_id, strlen(req_id), 1);
    }
}

static bool stage_failed_take(kv_conn_t *k, const char *req_id)
{
    return k->stage_failed.slots != NULL &&
           pd_strmap_del(&k->stage_failed, req_id, strlen(req_id), NULL) == 1;
}

void kv_stage_load_done(kv_conn_t *k, const uint32_t *list, int32_t first, int32_t end)
{
    kv_staged_load_t *sl = calloc(1, sizeof(*sl));
    if (sl == NULL || (sl->blocks = malloc((size_t)(end > 0 ? end : 1) * sizeof(uint32_t))) == NULL) {
        free(sl);
        kv_report_load_errors(k, list + first, end - first);
        return;
    }
    memcpy(sl->blocks, list, (size_t)end * sizeof(uint32_t));
    sl->first = first;
    sl->num_blocks = end;
    sl->next = k->staged_loads;
    k->staged_loads = sl;
}

/* Decode: copies finished loads from the mirror into the engine's KV (engine thread, mu not held);
 * a failed copy turns into load errors reported in this same step. */
static void stage_finish_loads(kv_conn_t *k, kv_staged_load_t *sl)
{
    while (sl != NULL) {
        kv_staged_load_t *next = sl->next;
        pd_page_range_t *r;
        int32_t n =
            stage_ranges(k, 0, (int32_t)k->geom.num_layers, sl->blocks, sl->first, sl->num_blocks, &r);
        if (n < 0 || stage_copy(k, r, n, false) != PD_OK) {
            pthread_mutex_lock(&k->mu);
            kv_report_load_errors(k, sl->blocks + sl->first, sl->num_blocks - sl->first);
            pthread_mutex_unlock(&k->mu);
        }
        free(r);
        free(sl->blocks);
        free(sl);
        sl = next;
    }
}

/* ------------------------------------------------------------------ worker half */

/* Mirrors the engine's KV in host memory the pipe allocates (same layout, so peers see the usual
 * geometry), page-locked by the backend when it can; pages are copied through it (see the file
 * comment of kv_connector.h). */
static pd_status_t stage_kv(kv_conn_t *k, const pd_kv_region_desc_t *rd)
{
    if (k->region != NULL || rd->backend == NULL || rd->backend->ops->copy_pages == NULL) {
        pd_log_error("kv connector: cannot stage the KV region (it was allocated by the pipe, or the backend "
                     "cannot copy pages)");
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = k->pipe->ops->alloc_region(k->pipe, rd->bytes, &k->region);
    if (st != PD_OK) {
        pd_log_error("kv connector: the %s pipe cannot allocate a %.1f MiB host mirror of the KV",
                     k->cfg.pipe, (double)rd->bytes / (1 << 20));
        return st;
    }
    k->staged = true;
    k->kv_base = rd->base;
    k->be = rd->backend;
    const char *pin = "pageable";
    if (k->be->ops->pin_host != NULL) {
        if (k->be->ops->pin_host(k->be, k->region->base, k->region->len) == PD_OK) {
            k->pinned = true;
            pin = "pinned";
        } else {
            pd_log_warn("kv connector: cannot page-lock the KV host mirror; copies run from pageable memory");
        }
    }
    pd_log_info("kv connector: %s; staging KV through a %.1f MiB %s host mirror registered with the %s pipe "
                "(prefill: device→host after each layer; decode: host→device after each load)",
                rd->host_memory ? "--kv-staging always"
                                : "the KV is in device memory, which this pipe cannot register",
                (double)rd->bytes / (1 << 20), pin, k->cfg.pipe);
    start_prefault(k);
    return PD_OK;
}

static pd_status_t kv_register_kv_caches(pd_connector_t *c, const pd_kv_region_desc_t *rd)
{
    kv_conn_t *k = (kv_conn_t *)c;
    if (rd->num_layers > KV_MAX_LAYERS) {
        pd_log_error("kv connector: %d layers, at most %d supported", rd->num_layers, KV_MAX_LAYERS);
        return PD_ERR_UNSUPPORTED;
    }
    bool nccl = k->pipe_kind == PD__PIPE_KIND__PIPE_NCCL;
    pd_status_t st;
    if (rd->host_memory && nccl) {
        pd_log_error(
            "kv connector: --kv-pipe nccl moves GPU memory and this node's KV cache is in host memory "
            "(--device cpu): use --kv-pipe ucx or tcp, or --device cuda");
        return PD_ERR_UNSUPPORTED;
    } else if (rd->host_memory && strcmp(k->cfg.staging, "always") != 0) {
        st = k->region != NULL && k->region->base == rd->base
                 ? PD_OK /* the pipe allocated it (pd_kv_connector_allocator) */
                 : k->pipe->ops->register_region(k->pipe, rd->base, rd->bytes, PD_MEM_HOST, &k->region);
        if (st != PD_OK) {
            pd_log_error("kv connector: cannot register the KV region with the %s pipe", k->cfg.pipe);
        }
    } else if (!rd->host_memory && (nccl || k->pipe_kind == PD__PIPE_KIND__PIPE_UCX) &&
               (st = k->pipe->ops->register_region(k->pipe, rd->base, rd->bytes, PD_MEM_CUDA, &k->region)) ==
                   PD_OK) {
        /* NCCL, or a UCX built with CUDA support, moves the device KV in place: no mirror */
        pd_log_info("kv connector: the device KV is registered with the %s pipe in place (no staging)",
                    k->cfg.pipe);
    } else if (nccl) {
        pd_log_error("kv connector: cannot register the device KV region with the nccl pipe");
    } else {
        st = stage_kv(k, rd);
    }
    if (st != PD_OK) {
        return st;
    }
    k->geom.length = rd->bytes;
    k->geom.page_bytes = rd->page_bytes;
    k->geom.num_blocks = rd->num_blocks;
    k->geom.num_layers = (uint32_t)rd->num_layers;
    for (int32_t l = 0; l < rd->num_layers; l++) {
        k->geom.layer_offset[l] = rd->layer_offset[l];
    }
    k->block_size = rd->block_size;
    k->geom.num_groups = rd->num_groups > 0 ? (uint32_t)rd->num_groups : 1;
    for (int32_t l = 0; l < rd->num_layers; l++) {
        k->geom.layer_group[l] = rd->num_groups > 1 ? rd->layer_group[l] : 0;
    }
    snprintf(k->group_layout, sizeof(k->group_layout), "%s",
             rd->group_layout[0] ? rd->group_layout : "g1:full");
    pd_log_info(
        "kv connector: registered %.1f MiB of KV (%u blocks × %d layers × %zu B pages) with the %s pipe",
        (double)rd->bytes / (1 << 20), rd->num_blocks, rd->num_layers, rd->page_bytes, k->cfg.pipe);
    return PD_OK;
}

static pd_status_t kv_bind_connector_metadata(pd_connector_t *c, void *meta)
{
    kv_conn_t *k = (kv_conn_t *)c;
    k->meta_bound = meta;
    return PD_OK;
}

static pd_status_t kv_start_load_kv(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    if (k->meta_bound == NULL || k->meta_bound->loads == NULL) {
        return PD_OK;
    }
    kv_xfer_t *x = k->meta_bound->loads;
    k->meta_bound->loads = NULL;
    pthread_mutex_lock(&k->mu);
    while (x != NULL) {
        kv_xfer_t *next = x->next;
        x->next = k->handoff;
        k->handoff = x;
        x = next;
    }
    pthread_mutex_unlock(&k->mu);
    kv_ctl_wake(k);
    return PD_OK;
}

static pd_status_t kv_wait_for_layer_load(pd_connector_t *c, int32_t layer)
{
    (void)c, (void)layer;
    return PD_OK; /* loads complete before a request is scheduled (see the file comment) */
}

/* Posts this layer's pages of blocks [b0, b1) of save item s into its reservation. */
static void post_layer_pages(kv_conn_t *k, kv_push_t *ps, const kv_save_item_t *s, int32_t layer, int32_t b0,
                             int32_t b1)
{
    kv_resv_t *rv = ps->resv;
    const kv_geom_t *rg = &rv->peer->geom;
    if (b1 > rv->num_blocks) {
        b1 = rv->num_blocks;
    }
    if (b1 > s->num_blocks) {
        b1 = s->num_blocks;
    }
    if (b0 < rv->skip_blocks) {
        b0 = rv->skip_blocks;
    }
    if (b0 >= b1) {
        return;
    }
    kv_write_job_t *j = calloc(1, sizeof(*j));
    if (j == NULL || (j->pages = malloc((size_t)(b1 - b0) * sizeof(pd_page_xfer_t))) == NULL) {
        free(j);
        ps->failed = true;
        return;
    }
    int32_t np = 0;
    for (int32_t b = b0; b < b1; b++) {
        /* this layer's group; an entry the decode does not hold (outside its window) stays */
        if (!kv_entry_of_layer(&k->geom, b, layer) || rv->blocks[b] == 0 || s->blocks[b] == 0) {
            continue;
        }
        j->pages[np++] = (pd_page_xfer_t){
            k->geom.layer_offset[layer] + (uint64_t)s->blocks[b] * k->geom.page_bytes,
            rg->layer_offset[layer] + (uint64_t)rv->blocks[b] * rg->page_bytes, k->geom.page_bytes};
    }
    if (np == 0) {
        free(j->pages), free(j);
        return;
    }
    j->num_pages = np;
    j->bytes = (size_t)j->num_pages * k->geom.page_bytes;
    j->peer = rv->peer;
    j->conn = k;
    pthread_mutex_lock(&k->mu);
    j->gen = k->gen;
    j->next = k->jobs;
    k->jobs = j;
    pthread_mutex_unlock(&k->mu);
    k->step_jobs++;
    kv_ctl_wake(k);
}

static pd_status_t kv_save_kv_layer(pd_connector_t *c, int32_t layer)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->meta_bound;
    if (!k->is_prefill || m == NULL) {
        return PD_OK;
    }
    for (int32_t i = 0; i < m->num_saves; i++) {
        const kv_save_item_t *s = &m->saves[i];
        bool staged_ok = !k->staged || stage_save_layer(k, s, layer) == PD_OK;
        if (!s->push) {
            if (!staged_ok) {
                stage_failed_add(k, s->req_id);
            }
            continue;
        }
        kv_push_t *ps = push_find(k, s->req_id, false);
        if (ps == NULL) {
            ps = calloc(1, sizeof(*ps));
            if (ps == NULL) {
                continue;
            }
            snprintf(ps->req_id, sizeof(ps->req_id), "%s", s->req_id);
            snprintf(ps->transfer_id, sizeof(ps->transfer_id), "%s", s->transfer_id);
            ps->streaming = true;
            ps->next = k->pushes;
            k->pushes = ps;
        }
        if (layer == 0) {
            if (ps->resv == NULL) {
                /* the transfer id is in the request's params; find its reservation */
                pthread_mutex_lock(&k->mu);
                for (kv_resv_t *rv = k->resvs; rv != NULL; rv = rv->next) {
                    if (!rv->taken && !rv->released && !rv->dead &&
                        strcmp(rv->transfer_id, ps->transfer_id) == 0) {
                        rv->taken = true;
                        ps->resv = rv;
                        break;
                    }
                }
                pthread_mutex_unlock(&k->mu);
            }
            pthread_mutex_lock(&k->mu);
            ps->streaming = ps->streaming && ps->resv != NULL && !ps->resv->dead;
            pthread_mutex_unlock(&k->mu);
            ps->steps++;
        }
        ps->failed |= !staged_ok;
        if (ps->streaming && !ps->failed) {
            int32_t end_block = kv_entry(&k->geom, (s->end_token + k->block_size - 1) / k->block_size);
            post_layer_pages(k, ps, s, layer, ps->next_block, end_block);
        }
    }
    return PD_OK;
}

static pd_status_t kv_wait_for_save(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->meta_bound;
    if (!k->is_prefill || m == NULL) {
        return PD_OK;
    }
    bool failed = false;
    if (k->step_jobs > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double until = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + k->cfg.save_timeout;
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        pthread_mutex_lock(&k->mu);
        int rc = 0;
        while (k->jobs_done + k->jobs_failed < k->step_jobs && rc == 0) {
            rc = pthread_cond_timedwait(&k->cv, &k->mu, &ts);
        }
        failed = k->jobs_failed > 0 || k->jobs_done + k->jobs_failed < k->step_jobs;
        if (failed) {
            pd_log_warn("kv connector: %d of %d layer writes of this step failed or timed out",
                        k->step_jobs - k->jobs_done, k->step_jobs);
        }
        k->gen++;
        k->jobs_done = k->jobs_failed = 0;
        pthread_mutex_unlock(&k->mu);
        k->step_jobs = 0;
    }
    for (int32_t i = 0; i < m->num_saves; i++) {
        kv_push_t *ps = push_find(k, m->saves[i].req_id, false);
        if (ps == NULL) {
            continue;
        }
        if (ps->streaming) {
            ps->failed |= failed;
            ps->next_block = kv_entry(&k->geom, m->saves[i].end_token / k->block_size);
        }
    }
    k->meta_bound = NULL;
    return failed ? PD_ERR_IO : PD_OK;
}

static pd_status_t kv_get_finished(pd_connector_t *c, pd_connector_finished_t *out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    for (int32_t i = 0; i < k->num_rep_sending; i++) {
        free((char *)k->rep_sending[i]);
    }
    for (int32_t i = 0; i < k->num_rep_recving; i++) {
        free((char *)k->rep_recving[i]);
    }
    free(k->rep_sending);
    free(k->rep_recving);
    pthread_mutex_lock(&k->mu);
    k->rep_sending = (const char **)k->fin_sending;
    k->num_rep_sending = k->num_fin_sending;
    k->rep_recving = (const char **)k->fin_recving;
    k->num_rep_recving = k->num_fin_recving;
    k->fin_sending = k->fin_recving = NULL;
    k->num_fin_sending = k->cap_fin_sending = k->num_fin_recving = k->cap_fin_recving = 0;
    kv_staged_load_t *staged = k->staged_loads;
    k->staged_loads = NULL;
    pthread_mutex_unlock(&k->mu);
    stage_finish_loads(k, staged); /* the KV is on the device before the scheduler hears of it */
    out->sending = k->rep_sending;
    out->num_sending = k->num_rep_sending;
    out->recving = k->rep_recving;
    out->num_recving = k->num_rep_recving;
    return PD_OK;
}

static int32_t kv_get_block_ids_with_load_errors(pd_connector_t *c, uint32_t *ids, int32_t max)
{
    kv_conn_t *k = (kv_conn_t *)c;
    pthread_mutex_lock(&k->mu);
    int32_t n = k->num_load_errors < max ? k->num_load_errors : max;
    if (n > 0) {
        memcpy(ids, k->load_errors, (size_t)n * sizeof(uint32_t));
        memmove(k->load_errors, k->load_errors + n, (size_t)(k->num_load_errors - n) * sizeof(uint32_t));
        k->num_load_errors -= n;
    }
    pthread_mutex_unlock(&k->mu);
    return n;
}

static void kv_destroy_op(pd_connector_t *c)
{
    pd_kv_connector_destroy(c);
}

static const pd_connector_ops_t KV_OPS = {
    "pd-kv",
    kv_get_num_new_matched_tokens,
    kv_update_state_after_alloc,
    kv_build_connector_meta,
    kv_request_finished,
    kv_register_kv_caches,
    kv_bind_connector_metadata,
    kv_start_load_kv,
    kv_wait_for_layer_load,
    kv_save_kv_layer,
    kv_wait_for_save,
    kv_get_finished,
    kv_get_block_ids_with_load_errors,
    kv_destroy_op,
};

/* ------------------------------------------------------------------ lifecycle */

static void *prefault_main(void *arg)
{
    kv_conn_t *k = arg;
    char *p = k->region->base;
    size_t len = k->region->len;
    double t0 = pd_time_now_s();
    for (size_t off = 0; off < len && !__atomic_load_n(&k->prefault_stop, __ATOMIC_RELAXED); off += 4096) {
        /* an atomic add of 0 is a write access (the page is faulted in writable) that cannot lose a
         * value the engine stores into the same byte meanwhile (a locked RMW is indivisible) */
        __atomic_fetch_add(p + off, 0, __ATOMIC_RELAXED);
    }
    pd_log_info("kv connector: pre-faulted the %.2f GiB KV region in %.1f s (background)",
                (double)len / (1u << 30), pd_time_now_s() - t0);
    return NULL;
}

/* Starts the pre-fault thread over k->region (when --kv-prefault). */
static void start_prefault(kv_conn_t *k)
{
#if defined(__SANITIZE_THREAD__)
    k->cfg.prefault = false; /* its atomic touches of pages the engine writes plainly would be reported */
#endif
    if (k->cfg.prefault && !k->prefault_started) {
        /* touch every page in the background: a first-touch fault per 4 KiB page inside a transfer
         * costs more than the copy (measured here: ~18 µs per fault; 4 MiB of fresh blocks read in
         * ~8 ms instead of ~3 ms) */
        k->prefault_started = pthread_create(&k->prefault_thread, NULL, prefault_main, k) == 0;
    }
}

static pd_status_t region_alloc(void *ctx, size_t bytes, void **ptr_out)
{
    kv_conn_t *k = ctx;
    if (k->region != NULL) {
        return PD_ERR_INVALID_ARG; /* one KV region per engine */
    }
    pd_status_t st = k->pipe->ops->alloc_region(k->pipe, bytes, &k->region);
    if (st != PD_OK) {
        pd_log_error("kv connector: the %s pipe cannot allocate %.2f GiB for the KV cache", k->cfg.pipe,
                     (double)bytes / (1u << 30));
        return st;
    }
    *ptr_out = k->region->base;
    start_prefault(k);
    return PD_OK;
}

static void region_free(void *ctx, void *ptr)
{
    kv_conn_t *k = ctx;
    if (k->pipe != NULL && k->region != NULL && k->region->base == ptr) {
        k->pipe->ops->deregister_region(k->pipe, k->region);
        k->region = NULL;
    }
}

static void metrics_register(kv_conn_t *k, pd_metrics_t *m)
{
    if (m == NULL) {
        return;
    }
    static const char *const kinds[3] = {"kind=pull_load", "kind=push_load", "kind=push_save"};
    static const double pages_b[] = {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536};
    for (int i = 0; i < 3; i++) {
        k->m.started[i] = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_started_total",
                                         "KV transfers started, by kind.", kinds[i], NULL, 0);
        k->m.completed[i] =
            pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_completed_total",
                           "KV transfers completed successfully, by kind.", kinds[i], NULL, 0);
        k->m.failed[i] = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_failed_total",
                                        "KV transfers that failed (peer gone, timeout, stale, rejected).",
                                        kinds[i], NULL, 0);
    }
    k->m.bytes = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfer_bytes_total",
                                "Bytes of KV pages moved by this node's transfers.", NULL, NULL, 0);
    k->m.latency = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_seconds",
                                  "Latency of one KV transfer (start to completion).", NULL,
                                  PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.pages = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_pages", "Pages per KV transfer.",
                                NULL, pages_b, 9);
    k->m.leases_held = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_leases_granted_total",
                                      "Leases granted on held prefill blocks (pull).", NULL, NULL, 0);
    k->m.leases_expired =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_leases_expired_total",
                       "Holds that ended at --kv-hold-timeout with no reader or reservation.", NULL, NULL, 0);
    k->m.stale =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_stale_reads_total",
                       "READ_DONEs answered STALE or UNKNOWN (the KV was discarded).", NULL, NULL, 0);
    k->m.handshakes_ok = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_handshakes_total",
                                        "Control-plane handshakes, by result.", "result=ok", NULL, 0);
    k->m.handshakes_failed = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_handshakes_total",
                                            "Control-plane handshakes, by result.", "result=failed", NULL, 0);
    k->m.policy_recompute =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_load_failure_policy_actions_total",
                       "KV load failures handed to the failure policy.", "policy=recompute", NULL, 0);
    k->m.policy_fail =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_load_failure_policy_actions_total",
                       "KV load failures handed to the failure policy.", "policy=fail", NULL, 0);
    k->m.peers = pd_metrics_add(m, PD_METRIC_GAUGE, "pd:kv_peers", "Connected KV peers.", NULL, NULL, 0);
    static const char *help =
        "Phases of a completed decode-side transfer: queue (scheduled to posted, incl. a "
        "handshake), transfer (pages moving), notify (pages landed to ACK), remote (push: "
        "reservation sent to WRITE_DONE).";
    k->m.phase_queue = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                      "phase=queue", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_transfer = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                         "phase=transfer", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_notify = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                       "phase=notify", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_remote = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                       "phase=remote", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.handshake_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_handshake_seconds",
                                      "Dial + authenticate + region exchange start, per outbound handshake.",
                                      NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    const char *sh = "Bytes copied between the KV cache and its host staging mirror (--kv-staging).";
    k->m.staged_d2h =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_staging_bytes_total", sh, "dir=d2h", NULL, 0);
    k->m.staged_h2d =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_staging_bytes_total", sh, "dir=h2d", NULL, 0);
    k->m.staged_seconds =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_staging_copy_seconds",
                       "One staging copy (a layer's new pages on a prefill, a load's pages on a decode).",
                       NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
}

static pd_status_t read_token(kv_conn_t *k, const char *path)
{
    if (path == NULL || path[0] == '\0') {
        return PD_OK;
    }
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        pd_log_error("kv connector: cannot read the cluster token file %s: %s", path, strerror(errno));
        return PD_ERR_IO;
    }
    size_t n = fread(k->token, 1, sizeof(k->token), f);
    bool more = fgetc(f) != EOF;
    fclose(f);
    if (more) {
        pd_log_error("kv connector: the cluster token in %s is longer than %zu bytes", path,
                     sizeof(k->token));
        return PD_ERR_INVALID_ARG;
    }
    while (n > 0 && (k->token[n - 1] == '\n' || k->token[n - 1] == '\r')) {
        n--; /* a trailing newline is not part of the secret */
    }
    k->token_len = n;
    return PD_OK;
}

pd_status_t pd_kv_connector_create(const pd_kv_connector_config_t *cfg, pd_metrics_t *m, pd_connector_t **out)
{
    bool prefill = strcmp(cfg->role, "prefill") == 0;
    if (!prefill && strcmp(cfg->role, "decode") != 0) {
        pd_log_error("kv connector: role '%s' is neither prefill nor decode", cfg->role);
        return PD_ERR_INVALID_ARG;
    }
    if (strcmp(cfg->mode, "pull") != 0 && strcmp(cfg->mode, "push") != 0) {
        pd_log_error("kv connector: --kv-transfer-mode '%s' is neither pull nor push", cfg->mode);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->hold_timeout <= 0 || cfg->load_timeout <= 0 || cfg->handshake_timeout <= 0 ||
        cfg->heartbeat_interval <= 0 || cfg->heartbeat_misses < 1 || cfg->save_timeout <= 0) {
        pd_log_error("kv connector: every --kv-*-timeout and the heartbeat settings must be positive");
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->tcp_busy_poll_us < 0 || cfg->tcp_busy_poll_us > 1000000) {
        pd_log_error("kv connector: --kv-tcp-busy-poll-us %d is outside [0, 1000000]", cfg->tcp_busy_poll_us);
        return PD_ERR_INVALID_ARG;
    }
    if (strcmp(cfg->pipe, "nccl") == 0 && strcmp(cfg->staging, "always") == 0) {
        pd_log_error("kv connector: --kv-pipe nccl moves device memory itself; --kv-staging always is for "
                     "host pipes (ucx, tcp)");
        return PD_ERR_INVALID_ARG;
    }
    kv_conn_t *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    k->pub.ops = &KV_OPS;
    k->pub.impl = k;
    k->cfg = *cfg;
    k->is_prefill = prefill;
    k->push = strcmp(cfg->mode, "push") == 0;
    k->listen_fd = k->wake_fd = -1;
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, NULL);
    char port[16] = "";
    if (sscanf(cfg->listen, "%63[^:]:%15s", k->listen_host, port) != 2 || atoi(port) < 0 ||
        atoi(port) > 65535) {
        pd_log_error("kv connector: --kv-listen '%s' is not HOST:PORT", cfg->listen);
        pd_kv_connector_destroy(&k->pub);
        return PD_ERR_INVALID_ARG;
    }
    k->listen_port = atoi(port);
    snprintf(k->advertise_host, sizeof(k->advertise_host), "%s",
             cfg->advertise_host != NULL && cfg->advertise_host[0] ? cfg->advertise_host : k->listen_host);
    uint64_t id = random_u52();
    snprintf(k->engine_id, sizeof(k->engine_id), "%s-%013llx", prefill ? "prefill" : "decode",
             (unsigned long long)id);
    pd_status_t st = read_token(k, cfg->cluster_token_file);
    if (st != PD_OK) {
        pd_kv_connector_destroy(&k->pub);
        return st;
    }
    pd_pipe_config_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.kind = cfg->pipe;
    pc.host = k->listen_host;
    pc.ucx_err_mode = cfg->ucx_err_mode;
    pc.tcp_busy_poll_us = cfg->tcp_busy_poll_us;
    st = pd_pipe_create(&pc, &k->pipe);
    if (st != PD_OK) {
        pd_log_error("kv connector: cannot create a %s pipe (this build has: %s)", cfg->pipe,
                     pd_pipe_kinds());
        pd_kv_connector_destroy(&k->pub);
        return st;
    }
    k->pipe_kind = strcmp(cfg->pipe, "tcp") == 0   ? PD__PIPE_KIND__PIPE_TCP
                   : strcmp(cfg->pipe, "ucx") == 0 ? PD__PIPE_KIND__PIPE_UCX
                                                   : PD__PIPE_KIND__PIPE_NCCL;
    k->alloc = (pd_kv_region_allocator_t){k, region_alloc, region_free};
    metrics_register(k, m);
    pd_log_info("kv connector: %s engine %s, %s mode over the %s pipe", cfg->role, k->engine_id, cfg->mode,
                cfg->pipe);
    *out = &k->pub;
    return PD_OK;
}

const pd_kv_region_allocator_t *pd_kv_connector_allocator(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    /* nccl: the pipe's regions are device memory, never a host engine's KV */
    return strcmp(k->cfg.staging, "always") == 0 || k->pipe_kind == PD__PIPE_KIND__PIPE_NCCL ? NULL
                                                                                             : &k->alloc;
}

pd_status_t pd_kv_connector_start(pd_connector_t *c, const Pd__Fingerprint *fp)
{
    kv_conn_t *k = (kv_conn_t *)c;
    k->fp = *fp;
    snprintf(k->fp_model, sizeof(k->fp_model), "%s", fp->model);
    snprintf(k->fp_dtype, sizeof(k->fp_dtype), "%s", fp->kv_dtype);
    /* the KV cache groups are part of the layout: two engines must interleave block lists alike */
    snprintf(k->fp_layout, sizeof(k->fp_layout), "%s;%s", fp->layout, k->group_layout);
    k->fp.model = k->fp_model;
    k->fp.kv_dtype = k->fp_dtype;
    k->fp.layout = k->fp_layout;
    if (k->region == NULL) {
        pd_log_error("kv connector: start before the engine registered its KV caches");
        return PD_ERR_INVALID_ARG;
    }
    return kv_ctl_start(k);
}

int pd_kv_connector_port(const pd_connector_t *c)
{
    return ((const kv_conn_t *)c)->listen_port;
}

const char *pd_kv_connector_engine_id(const pd_connector_t *c)
{
    return ((const kv_conn_t *)c)->engine_id;
}

json_t *pd_kv_connector_info(const pd_connector_t *c)
{
    const kv_conn_t *k = (const kv_conn_t *)c;
    return json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:b}", "role", k->cfg.role, "engine_id", k->engine_id,
                     "kv_host", k->advertise_host, "kv_port", k->listen_port, "transfer_mode", k->cfg.mode,
                     "pipe", k->cfg.pipe, "kv_staged", k->staged);
}

void pd_kv_connector_stop(pd_connector_t *c)
{
    if (c == NULL) {
        return;
    }
    kv_conn_t *k = (kv_conn_t *)c;
    if (k->prefault_started) {
        __atomic_store_n(&k->prefault_stop, true, __ATOMIC_RELAXED);
        pthread_join(k->prefault_thread, NULL);
        k->prefault_started = false;
    }
    if (k->pinned) {
        k->be->ops->unpin_host(k->be, k->region->base); /* before the pipe frees the mirror */
        k->pinned = false;
    }
    kv_ctl_stop(k);
}

void pd_kv_connector_destroy(pd_connector_t *c)
{
    if (c == NULL) {
        return;
    }
    kv_conn_t *k = (kv_conn_t *)c;
    pd_kv_connector_stop(c); /* destroys the pipe: every pending operation completes first */
    while (k->sched_pending != NULL) {
        kv_xfer_t *x = k->sched_pending;
        k->sched_pending = x->next;
        kv_xfer_free(x);
    }
    while (k->meta_build.loads != NULL) {
        kv_xfer_t *x = k->meta_build.loads;
        k->meta_build.loads = x->next;
        kv_xfer_free(x);
    }
    free(k->meta_build.saves);
    while (k->pushes != NULL) {
        kv_push_t *p = k->pushes;
        k->pushes = p->next;
        free(p);
    }
    for (int32_t i = 0; i < k->num_rep_sending; i++) {
        free((char *)k->rep_sending[i]);
    }
    for (int32_t i = 0; i < k->num_rep_recving; i++) {
        free((char *)k->rep_recving[i]);
    }
    free(k->rep_sending), free(k->rep_recving);
    for (int32_t i = 0; i < k->num_fin_sending; i++) {
        free(k->fin_sending[i]);
    }
    for (int32_t i = 0; i < k->num_fin_recving; i++) {
        free(k->fin_recving[i]);
    }
    free(k->fin_sending), free(k->fin_recving), free(k->load_errors);
    while (k->staged_loads != NULL) {
        kv_staged_load_t *sl = k->staged_loads;
        k->staged_loads = sl->next;
        free(sl->blocks);
        free(sl);
    }
    if (k->stage_failed.slots != NULL) {
        pd_strmap_destroy(&k->stage_failed);
    }
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k);
}
