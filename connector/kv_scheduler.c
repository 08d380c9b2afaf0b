/* connector/kv_scheduler.c — the connector's scheduler half (engine thread): whether a decode
 * request loads its prompt's KV and from where, the load it starts after allocation, the step's
 * metadata for the worker half, and what a finished request leaves behind (decode: nothing;
 * prefill push: WRITE_DONE or a late whole-prompt write; prefill pull: a lease and the params). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/array.h"
#include "common/log.h"
#include "common/time.h"
#include "connector/kv_connector.h"
#include "connector/kv_engine.h"
#include "scheduler/scheduler.h"

static bool remote_prefill_ok(kv_conn_t *k, const pd_request_t *req, const json_t *p);
static bool finished_push(kv_conn_t *k, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                          bool ok);
static bool finished_pull(kv_conn_t *k, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                          void **params_out);

/* Why pull params p (a prefill's for a decode, or a peer's lend for a prefix) cannot load the KV
 * of the first num_hashed prompt tokens of req into need entries of its block list, or NULL: where
 * to read, what, and (kv_sign.c) issued by a node of this cluster for exactly those tokens. */
static const char *pull_params_why(const kv_conn_t *k, const pd_request_t *req, const json_t *p,
                                   int32_t num_hashed, int32_t need)
{
    const json_t *b = json_object_get(p, "remote_block_ids");
    const char *rid = kv_jstr(p, "remote_request_id");
    if (!json_is_array(b) || rid == NULL || strlen(rid) >= PD_REQ_ID_MAX) {
        return "remote_block_ids/remote_request_id missing";
    }
    for (size_t i = 0; i < json_array_size(b); i++) {
        json_int_t v = json_integer_value(json_array_get(b, i));
        if (!json_is_integer(json_array_get(b, i)) || v < 0 || v > UINT32_MAX) {
            return "remote_block_ids holds a non-block value";
        }
    }
    if ((int32_t)json_array_size(b) < need) {
        return "remote_block_ids has fewer blocks than the prompt needs";
    }
    return kv_params_verify(k, p, req->tokens, num_hashed);
}

/* Where p says to dial is a host and a port. */
static bool dial_ok(const json_t *p)
{
    json_int_t port = json_integer_value(json_object_get(p, "remote_port"));
    const char *host = kv_jstr(p, "remote_host");
    return host != NULL && host[0] != '\0' && port > 0 && port <= 65535;
}

static void params_refused(kv_conn_t *k, const pd_request_t *req, const char *what, const char *why)
{
    pd_metric_inc(k->m.params_refused, 1);
    pd_log_warn("kv connector: request %s: %s unusable (%s); computing the prompt locally", req->id, what,
                why);
}

/* A decode request's remote-prefill parameters are usable: where to load from and what. */
static bool remote_prefill_ok(kv_conn_t *k, const pd_request_t *req, const json_t *p)
{
    const char *why = NULL;
    if (!dial_ok(p)) {
        why = "remote_host/remote_port missing or invalid";
    } else if (kv_wants_push(k, p)) {
        const char *tid = kv_jstr(p, "transfer_id");
        if (tid == NULL || tid[0] == '\0' || strlen(tid) >= PD_REQ_ID_MAX) {
            why = "transfer_id missing or too long";
        }
    } else {
        /* the KV of the prompt, or of every token but the last: a handed-over request's last is its
         * first output, a migrated one's (resume_token_ids) the last its first decode sampled */
        json_int_t nt = json_integer_value(json_object_get(p, "remote_num_tokens"));
        if (nt != 0 && nt != req->num_prompt_tokens && nt != req->num_tokens - 1) {
            why = "the prefill computed a different prompt length";
        } else {
            int32_t need = kv_entry(&k->geom, (req->num_tokens - 1 + k->block_size - 1) / k->block_size);
            why = pull_params_why(k, req, p,
                                  nt > req->num_prompt_tokens ? (int32_t)nt : req->num_prompt_tokens, need);
        }
    }
    if (why != NULL) {
        params_refused(k, req, "kv_transfer_params", why);
        return false;
    }
    return true;
}

/* Peer-to-peer prefix fetch (issue 52). Two kv_transfer_params, both set by pd-proxy:
 *  - "kv_lend": true, with do_remote_decode and transfer_mode pull, on any node (prefill or decode):
 *    the request's prompt is a prefix another node wants; its answer carries pull params leasing
 *    the prompt's blocks, as a prefill's do, and it computes only what its prefix cache (and tier)
 *    lacks. With "kv_lend_min_tokens": M it is refused (ends with an error, nothing computed) when
 *    its cache holds fewer than M of the prompt's tokens: the asker then computes them itself.
 *  - "kv_prefix": {a lend's params}, on a prefill's request, or on a decode's resumed one (issue 48:
 *    resume_token_ids after its first decode died; the lend is of its prompt, by the prefill that
 *    computed it): the lend's prompt is this prompt's first remote_num_tokens tokens (the signature
 *    binds them); the node loads the full blocks of it past its own prefix hit from that peer when
 *    kv_cost says fetching beats computing, then computes the rest. A failed fetch is a failed
 *    load: the failure policy recomputes. */

/* Where the part of req's prompt a kv_prefix of nt tokens provides ends: full blocks only, and the
 * last prompt token is computed here for its logits. */
static int32_t prefix_end(const kv_conn_t *k, const pd_request_t *req, json_int_t nt)
{
    int32_t end = (int32_t)(nt < req->num_tokens - 1 ? nt : req->num_tokens - 1);
    return end / k->block_size * k->block_size;
}

/* The tokens of req's prompt a node loads from the peer its kv_prefix names, past its local hit
 * of num_computed tokens; 0 when none (no kv_prefix, nothing past the hit, unusable params, or
 * computing is cheaper: logged). */
static int32_t prefix_fetch_tokens(kv_conn_t *k, const pd_request_t *req, int32_t num_computed)
{
    const json_t *x = json_object_get(req->kv_transfer_params, "kv_prefix");
    if (!json_is_object(x)) {
        return 0;
    }
    json_int_t nt = json_integer_value(json_object_get(x, "remote_num_tokens"));
    if (nt <= 0 || nt > req->num_prompt_tokens) {
        params_refused(k, req, "kv_transfer_params.kv_prefix", "remote_num_tokens is not a prefix's length");
        return 0;
    }
    int32_t end = prefix_end(k, req, nt);
    if (end <= num_computed) {
        return 0; /* this node's own prefix cache has it all */
    }
    const char *why = dial_ok(x)
                          ? pull_params_why(k, req, x, (int32_t)nt, kv_entry(&k->geom, end / k->block_size))
                          : "remote_host/remote_port missing or invalid";
    if (why != NULL) {
        params_refused(k, req, "kv_transfer_params.kv_prefix", why);
        return 0;
    }
    double fetch_s, compute_s;
    if (!kv_cost_fetch(k, num_computed, end, &fetch_s, &compute_s)) {
        pd_log_debug(
            "kv connector: request %s: %d prefix tokens held by %s:%lld: fetch ~%.2f ms, compute ~%.2f "
            "ms: computing them",
            req->id, end - num_computed, kv_jstr(x, "remote_host"),
            (long long)json_integer_value(json_object_get(x, "remote_port")), fetch_s * 1e3, compute_s * 1e3);
        return 0;
    }
    return end - num_computed;
}

/* A lend asked for at least kv_lend_min_tokens of cached prefix: PD_ERR_REJECTED when the node's
 * cache holds fewer (num_computed), so it computes nothing for it. */
static pd_status_t lend_check(const pd_request_t *req, const json_t *p, int32_t num_computed)
{
    json_int_t min = json_integer_value(json_object_get(p, "kv_lend_min_tokens"));
    if (num_computed < min) {
        pd_log_info("kv connector: request %s: asked to lend a prefix of at least %lld cached tokens; this "
                    "node holds %d: refused (the asker computes it)",
                    req->id, (long long)min, num_computed);
        return PD_ERR_REJECTED;
    }
    return PD_OK;
}

pd_status_t kv_get_num_new_matched_tokens(pd_connector_t *c, const pd_request_t *req, int32_t num_computed,
                                          int32_t *num_external_out, bool *load_async_out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    *num_external_out = 0;
    *load_async_out = false;
    const json_t *p = req->kv_transfer_params;
    if (p != NULL && kv_jbool(p, "kv_lend")) {
        return lend_check(req, p, num_computed);
    }
    if (k->is_prefill || (p != NULL && json_object_get(p, "kv_prefix") != NULL)) {
        int32_t n = p != NULL ? prefix_fetch_tokens(k, req, num_computed) : 0;
        *num_external_out = n;
        *load_async_out = n > 0;
        return PD_OK;
    }
    if (p == NULL || !kv_jbool(p, "do_remote_prefill") || num_computed >= req->num_tokens) {
        return PD_OK;
    }
    if (!remote_prefill_ok(k, req, p)) {
        return PD_OK;
    }
    *num_external_out = req->num_tokens - num_computed;
    *load_async_out = true;
    return PD_OK;
}

/* The connector's params_error (connector.h): each role refuses the other's parameters; a lend is
 * any node's, a prefix fetch a prefill's or a decode's without a remote prefill (a resumed request). */
const char *kv_params_error(pd_connector_t *c, const void *kv_transfer_params)
{
    const kv_conn_t *k = (const kv_conn_t *)c;
    const json_t *p = kv_transfer_params;
    bool lend = kv_jbool(p, "kv_lend");
    if (lend) {
        const json_t *min = json_object_get(p, "kv_lend_min_tokens");
        if (!kv_jbool(p, "do_remote_decode") || kv_wants_push(k, p) || kv_jbool(p, "first_token")) {
            return "kv_transfer_params.kv_lend leases a prompt's KV for a peer to read: it needs "
                   "do_remote_decode and transfer_mode pull, without first_token";
        }
        if (min != NULL && (!json_is_integer(min) || json_integer_value(min) < 0)) {
            return "kv_transfer_params.kv_lend_min_tokens must be a non-negative integer";
        }
        if (!k->is_prefill && k->staged) {
            return "kv_transfer_params.kv_lend: this decode's KV is staged through a host mirror that holds "
                   "only what it loaded; it cannot lend";
        }
    }
    if (!k->is_prefill && !lend && kv_jbool(p, "do_remote_decode")) {
        return "kv_transfer_params.do_remote_decode asks for a prefill, and this node is a decode "
               "(kv_consumer)";
    }
    if (k->is_prefill && kv_jbool(p, "do_remote_prefill")) {
        return "kv_transfer_params.do_remote_prefill asks for a decode, and this node is a prefill "
               "(kv_producer)";
    }
    const json_t *x = json_object_get(p, "kv_prefix");
    if (x != NULL && (lend || !json_is_object(x) || kv_jbool(p, "do_remote_prefill"))) {
        return "kv_transfer_params.kv_prefix (a prefix to fetch from a peer: the kv_transfer_params of its "
               "kv_lend answer) is for a prefill's request or a decode's without a remote prefill";
    }
    return NULL;
}

/* A pull load reads from the prefill's leased blocks whenever the decode starts it (by default the
 * lease, hold_timeout 120 s, outlasts a load, load_timeout 60 s; a load started after its lease
 * ended fails and the prompt is computed here); a push load's blocks are the target of the
 * prefill's writes, reserved when the request is admitted, so it never waits. A prefill's prefix
 * fetch is a pull. */
bool kv_load_may_wait(pd_connector_t *c, const pd_request_t *req)
{
    kv_conn_t *k = (kv_conn_t *)c;
    const json_t *p = req->kv_transfer_params;
    if (k->is_prefill || (p != NULL && json_object_get(p, "kv_prefix") != NULL)) {
        return p != NULL && json_is_object(json_object_get(p, "kv_prefix"));
    }
    return p != NULL && kv_jbool(p, "do_remote_prefill") && !kv_wants_push(k, p);
}

/* Whether pull params src load req's outputs too (a live migration's lease: remote_num_tokens past
 * the prompt), on a decode. */
static bool loads_outputs(const kv_conn_t *k, const pd_request_t *req, const json_t *src, bool push)
{
    return !k->is_prefill && !push &&
           json_integer_value(json_object_get(src, "remote_num_tokens")) > req->num_prompt_tokens;
}

/* Queues the load of req's tokens [from, to) into its blocks block_ids[num_blocks] from the peer src
 * names (pull: its leased blocks; push: the prefill writes into ours). PD_ERR_NO_MEMORY (logged). */
static pd_status_t queue_load(kv_conn_t *k, pd_request_t *req, const json_t *src, bool push,
                              const uint32_t *block_ids, int32_t num_blocks, int32_t from, int32_t to)
{
    kv_xfer_t *x = calloc(1, sizeof(*x));
    if (x == NULL || (x->report = kv_report_new(req->id, true)) == NULL ||
        (x->cancel = calloc(1, sizeof(*x->cancel))) == NULL) {
        goto err_nomem;
    }
    x->msg.kind = KV_CMD_LOAD;
    x->cancel->msg.kind = KV_CMD_CANCEL;
    snprintf(x->cancel->req_id, sizeof(x->cancel->req_id), "%s", req->id);
    x->kind = push ? KV_X_PUSH_LOAD : KV_X_PULL_LOAD;
    snprintf(x->req_id, sizeof(x->req_id), "%s", req->id);
    snprintf(x->remote_req, sizeof(x->remote_req), "%s",
             push ? kv_jstr(src, "transfer_id") : kv_jstr(src, "remote_request_id"));
    snprintf(x->dial, sizeof(x->dial), "%s:%lld", kv_jstr(src, "remote_host"),
             (long long)json_integer_value(json_object_get(src, "remote_port")));
    const char *eng = kv_jstr(src, "remote_engine_id");
    snprintf(x->remote_engine, sizeof(x->remote_engine), "%s", eng != NULL ? eng : "");
    x->lease_id = (uint64_t)json_integer_value(json_object_get(src, "lease_id"));
    x->migration = loads_outputs(k, req, src, push);
    x->num_tokens = req->num_tokens;
    kv_prompt_hash(req->tokens, req->num_prompt_tokens, x->prompt_hash); /* push: WRITE_DONE must name it */
    x->local_blocks = malloc((size_t)(num_blocks > 0 ? num_blocks : 1) * sizeof(uint32_t));
    if (x->local_blocks == NULL) {
        goto err_nomem;
    }
    memcpy(x->local_blocks, block_ids, (size_t)num_blocks * sizeof(uint32_t));
    x->num_local = num_blocks;
    x->first_block = kv_entry(&k->geom, from / k->block_size); /* entries of the block list */
    x->end_block = kv_entry(&k->geom, (to + k->block_size - 1) / k->block_size);
    if (!push) {
        const json_t *b = json_object_get(src, "remote_block_ids");
        x->num_remote = (int32_t)json_array_size(b);
        x->remote_blocks = malloc((size_t)(x->num_remote > 0 ? x->num_remote : 1) * sizeof(uint32_t));
        if (x->remote_blocks == NULL) {
            goto err_nomem;
        }
        for (int32_t i = 0; i < x->num_remote; i++) {
            x->remote_blocks[i] = (uint32_t)json_integer_value(json_array_get(b, (size_t)i));
        }
    }
    x->started = pd_time_now_s();
    x->deadline = x->started + k->cfg.load_timeout;
    pd_list_add_tail(&k->e->sched_pending, &x->link);
    return PD_OK;

err_nomem:
    pd_log_error("kv connector: request %s: out of memory starting its KV load", req->id);
    kv_xfer_free(x);
    return PD_ERR_NO_MEMORY;
}

pd_status_t kv_update_state_after_alloc(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                        int32_t num_blocks, int32_t num_external)
{
    kv_conn_t *k = (kv_conn_t *)c;
    json_t *p = req->kv_transfer_params;
    if (p == NULL || num_external <= 0) {
        return PD_OK;
    }
    int32_t local = req->num_tokens - num_external; /* decode: the block-aligned prefix hit */
    if (k->is_prefill || json_object_get(p, "kv_prefix") != NULL) {
        json_t *x = json_incref(json_object_get(p, "kv_prefix"));
        if (!json_is_object(x)) {
            json_decref(x);
            return PD_OK;
        }
        /* the prefix's full blocks past the local hit, as prefix_fetch_tokens counted them */
        int32_t end = prefix_end(k, req, json_integer_value(json_object_get(x, "remote_num_tokens")));
        local = end - num_external;
        pd_status_t st = queue_load(k, req, x, false, block_ids, num_blocks, local, end);
        if (st == PD_OK) {
            pd_metric_inc(k->m.prefix_fetches, 1);
            pd_log_debug("kv connector: request %s: fetching prefix tokens [%d, %d) from %s:%lld (engine %s)",
                         req->id, local, end, kv_jstr(x, "remote_host"),
                         (long long)json_integer_value(json_object_get(x, "remote_port")),
                         kv_jstr(x, "remote_engine_id") ? kv_jstr(x, "remote_engine_id") : "?");
            json_object_del(p, "kv_prefix"); /* loaded at most once */
        }
        json_decref(x);
        return st;
    }
    if (!kv_jbool(p, "do_remote_prefill")) {
        return PD_OK;
    }
    bool push = kv_wants_push(k, p);
    /* the KV of every token but the last, which is computed here for its logits; a push handover's
     * first token arrives with WRITE_DONE, so every prompt token's KV comes */
    int32_t moved = req->num_tokens - (push && kv_jbool(p, "first_token") ? 0 : 1);
    pd_status_t st = queue_load(k, req, p, push, block_ids, num_blocks, local, moved);
    if (st == PD_OK) {
        if (loads_outputs(k, req, p, push)) {
            pd_metric_inc(k->m.migrations_loaded, 1); /* a migrated request: its outputs' KV comes too */
            pd_log_info(
                "kv connector: request %s: taken over with its KV: reading tokens [%d, %d) from %s:%lld",
                req->id, local, moved, kv_jstr(p, "remote_host"),
                (long long)json_integer_value(json_object_get(p, "remote_port")));
        }
        json_object_set_new(p, "do_remote_prefill", json_false()); /* loaded at most once */
    }
    return st;
}

void *kv_build_connector_meta(pd_connector_t *c, const pd_scheduler_output_t *out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = &k->e->meta_build;
    pd_list_splice_tail(&m->loads, &k->e->sched_pending);
    m->num_saves = 0;
    m->incomplete = false;
    if (!k->is_prefill) {
        return m;
    }
    if (pd_array_reserve(&m->saves, &m->cap_saves, (size_t)(out->num_items > 0 ? out->num_items : 1)) !=
        PD_OK) {
        pd_log_error("kv connector: out of memory building the step's saves; failing the step");
        m->incomplete = true;
        return m;
    }
    for (int32_t i = 0; i < out->num_items; i++) {
        const pd_request_t *r = out->items[i].req;
        const json_t *p = r->kv_transfer_params;
        bool remote_decode = p != NULL && kv_jbool(p, "do_remote_decode");
        bool push = remote_decode && kv_wants_push(k, p) && kv_jstr(p, "transfer_id") != NULL;
        if (!push && !(remote_decode && k->staged)) {
            continue;
        }
        kv_save_item_t *s = &m->saves[m->num_saves++];
        snprintf(s->req_id, sizeof(s->req_id), "%s", r->id);
        snprintf(s->transfer_id, sizeof(s->transfer_id), "%s", push ? kv_jstr(p, "transfer_id") : "");
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

/* A load not yet handed over dies with the request; one sent keeps the blocks until get_finished
 * reports it (the control thread ends it as cancelled, or it had ended already): returns whether
 * req's blocks must wait for that (a decode's load, or a prefill's prefix fetch). */
static bool cancel_load(kv_conn_t *k, const pd_request_t *req)
{
    kv_xfer_t *x;
    pd_list_for_each (x, &k->e->sched_pending, link) {
        if (strcmp(x->req_id, req->id) == 0) {
            pd_list_del(&x->link);
            kv_xfer_free(x);
            break;
        }
    }
    kv_cancel_t *cn;
    pd_list_for_each (cn, &k->e->loading, msg.link) {
        if (strcmp(cn->req_id, req->id) == 0) {
            pd_list_del(&cn->msg.link);
            kv_mb_send(&k->mb, &cn->msg, 0);
            return true;
        }
    }
    return false;
}

/* A copy of a prefill's grammar state for the decode, or NULL (none, or out of memory: the decode then
 * replays the first token). */
static char *handed_state(const char *grammar_state)
{
    char *s = grammar_state != NULL ? strdup(grammar_state) : NULL;
    if (grammar_state != NULL && s == NULL) {
        pd_log_warn(
            "kv connector: out of memory copying a grammar state; its decode replays the first token");
    }
    return s;
}

/* Prefill, push: the stream of ps ends with status (its WRITE_DONE; the control thread ends the
 * reservation). */
static void push_end(kv_conn_t *k, kv_push_t *ps, int32_t status, int32_t first, const char *grammar_state,
                     const uint8_t hash[32])
{
    kv_notice_t *n = ps->done;
    ps->done = NULL;
    n->resv_id = ps->offer->resv_id;
    n->status = status;
    n->first_token = first;
    n->grammar_state = first >= 0 ? handed_state(grammar_state) : NULL;
    memcpy(n->prompt_hash, hash, sizeof(n->prompt_hash));
    pd_metric_inc(status == 0 ? k->m.completed[KV_X_PUSH_SAVE] : k->m.failed[KV_X_PUSH_SAVE], 1);
    kv_mb_send(&k->mb, &n->msg, 0);
}

/* Prefill, push: a streamed request tells the decode it is complete (or died); one whose
 * reservation is late keeps its blocks and becomes a whole-prompt write for the control thread
 * (which frees them at once when the proxy or the decode released its transfer id meanwhile). */
static bool finished_push(kv_conn_t *k, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                          bool ok)
{
    kv_push_t *ps = kv_push_find(k, req->id, true);
    const char *tid = kv_jstr(req->kv_transfer_params, "transfer_id");
    bool hold = false;
    /* first-token handover: the decode goes on from this request's first output token */
    int32_t first = kv_jbool(req->kv_transfer_params, "first_token") && pd_request_num_output(req) >= 1
                        ? req->tokens[req->num_prompt_tokens]
                        : -1;
    uint8_t hash[32]; /* the decode checks it names its own prompt */
    kv_prompt_hash(req->tokens, req->num_prompt_tokens, hash);
    if (ps != NULL && ps->offer != NULL && (ps->streaming || !ok)) {
        /* every layer of every step was written (or the request died): tell the decode */
        push_end(k, ps, ok && !ps->failed && !ps->offer->gone ? 0 : (ok ? PD_ERR_IO : PD_ERR_CANCELLED),
                 first, req->grammar_state, hash);
    } else if (ok && tid != NULL && tid[0] != '\0' && strlen(tid) < PD_REQ_ID_MAX && num_blocks > 0) {
        kv_xfer_t *x = calloc(1, sizeof(*x));
        if (x != NULL && (x->local_blocks = malloc((size_t)num_blocks * sizeof(uint32_t))) != NULL &&
            (x->report = kv_report_new(req->id, false)) != NULL) {
            x->msg.kind = KV_CMD_PUSH_SAVE;
            x->kind = KV_X_PUSH_SAVE;
            snprintf(x->req_id, sizeof(x->req_id), "%s", req->id);
            snprintf(x->remote_req, sizeof(x->remote_req), "%s", tid);
            memcpy(x->local_blocks, block_ids, (size_t)num_blocks * sizeof(uint32_t));
            x->num_local = num_blocks;
            x->num_tokens = req->num_prompt_tokens + (first >= 0 ? 1 : 0); /* the last token's KV stays */
            x->has_first_token = first >= 0;
            x->first_token = first;
            x->grammar_state = first >= 0 ? handed_state(req->grammar_state) : NULL;
            memcpy(x->prompt_hash, hash, sizeof(hash));
            x->started = pd_time_now_s();
            x->deadline = x->started + k->cfg.hold_timeout;
            if (ps != NULL && ps->offer != NULL) {
                x->resv_id = ps->offer->resv_id; /* the transfer takes it over */
                x->start_counted = true;         /* as the stream's continuation */
            }
            kv_mb_send(&k->mb, &x->msg, 0);
            hold = true;
        } else { /* its blocks are freed now; the decode's load times out (its failure policy runs) */
            pd_log_error("kv connector: request %s: out of memory holding its KV for a late reservation",
                         req->id);
            kv_xfer_free(x);
        }
    }
    if (!hold && ps != NULL && ps->offer != NULL && ps->done != NULL) {
        push_end(k, ps, PD_ERR_NO_MEMORY, -1, NULL, hash); /* nothing will write into its reservation */
    }
    kv_push_free(ps);
    return hold;
}

/* Prefill, pull: hold the blocks under a lease and tell the decode where they are. Decode, a live
 * migration (req->migrating): the same for the KV of its computed tokens (prompt and outputs but the
 * last), which the node that takes the request over reads; the lease has no transfer id (the proxy
 * releases it by lease id) and says nothing of a first token or of where the prompt's KV came from. */
static bool finished_pull(kv_conn_t *k, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                          void **params_out)
{
    bool mig = req->migrating;
    int32_t num_tokens = mig ? req->num_computed_tokens : req->num_prompt_tokens;
    bool first_token = !mig && kv_jbool(req->kv_transfer_params, "first_token");
    const char *tid = mig ? NULL : kv_jstr(req->kv_transfer_params, "transfer_id");
    kv_lease_t *l = calloc(1, sizeof(*l));
    if (l == NULL || (l->report = kv_report_new(req->id, false)) == NULL) {
        pd_log_error("kv connector: request %s: out of memory holding its KV; no kv_transfer_params",
                     req->id);
        kv_lease_free(l);
        return false;
    }
    l->msg.kind = KV_CMD_LEASE;
    snprintf(l->req_id, sizeof(l->req_id), "%s", req->id);
    /* (an id too long to keep whole names no lease: a release by a truncated one could match another) */
    snprintf(l->transfer_id, sizeof(l->transfer_id), "%s",
             tid != NULL && strlen(tid) < PD_REQ_ID_MAX ? tid : "");
    l->lend = kv_jbool(req->kv_transfer_params, "kv_lend");
    l->lease_id = kv_random_u52();
    l->expires = pd_time_now_s() + k->cfg.hold_timeout;
    json_t *blocks = json_array();
    for (int32_t i = 0; blocks != NULL && i < num_blocks; i++) {
        if (json_array_append_new(blocks, json_integer(block_ids[i])) != 0) { /* a shorter list would
                                                                              * name the wrong blocks */
            json_decref(blocks);
            blocks = NULL;
        }
    }
    json_t *out = json_pack(
        "{s:b, s:b, s:s, s:o, s:s, s:i, s:s, s:I, s:I, s:i, s:s}", "do_remote_prefill", 1, "do_remote_decode",
        0, "remote_engine_id", k->engine_id, "remote_block_ids", blocks, "remote_host", k->advertise_host,
        "remote_port", k->advertise_port, "remote_request_id", req->id, "lease_id", (json_int_t)l->lease_id,
        "lease_expires_unix_ms", (json_int_t)((double)time(NULL) * 1000 + k->cfg.hold_timeout * 1000),
        "remote_num_tokens", num_tokens, "transfer_mode", "pull");
    if (out == NULL || (first_token && /* the decode continues from it */
                        json_object_set_new(out, "first_token_id",
                                            json_integer(req->tokens[req->num_prompt_tokens])) != 0)) {
        pd_log_error("kv connector: request %s: out of memory building its kv_transfer_params", req->id);
        json_decref(out);
        kv_lease_free(l);
        return false;
    }
    if (first_token && req->grammar_state != NULL && /* the decode resumes the grammar's state */
        json_object_set_new(out, "grammar_state", json_string(req->grammar_state)) != 0) {
        pd_log_error("kv connector: request %s: out of memory building its kv_transfer_params", req->id);
        json_decref(out);
        kv_lease_free(l);
        return false;
    }
    /* where its prompt's KV came from (not signed: for a reader to see, no node acts on it) */
    int32_t cached = req->num_cached_tokens > 0 ? req->num_cached_tokens : 0;
    json_t *src = mig ? NULL
                      : json_pack("{s:i, s:i, s:i, s:i}", "pool", cached - req->num_offload_tokens,
                                  "offload_tier", req->num_offload_tokens, "peer", req->num_loaded_tokens,
                                  "computed", req->num_prompt_tokens - cached - req->num_loaded_tokens);
    if (!mig && (src == NULL || json_object_set_new(out, "prefix_source", src) != 0)) {
        pd_log_error("kv connector: request %s: out of memory building its kv_transfer_params", req->id);
        json_decref(out);
        kv_lease_free(l);
        return false;
    }
    if (kv_params_sign(k, out, req->tokens, num_tokens) != PD_OK) {
        pd_log_error("kv connector: request %s: cannot sign its kv_transfer_params (out of memory)", req->id);
        json_decref(out);
        kv_lease_free(l);
        return false;
    }
    /* the control thread checks that the proxy did not release its transfer id while it ran (then
     * it frees the blocks at once); in one thread, a release either finds the lease or is found */
    kv_mb_send(&k->mb, &l->msg, 0);
    pd_metric_inc(k->m.leases_held, 1);
    if (mig) {
        pd_metric_inc(k->m.migrations_lent, 1);
        pd_log_info("kv connector: request %s: migrating: the KV of its %d computed tokens (%d blocks) is "
                    "leased for %.0f s to the decode that takes it over",
                    req->id, num_tokens, num_blocks, k->cfg.hold_timeout);
    }
    *params_out = out;
    return true;
}

/* Decode, live migration: whether req's KV can be leased to the node that takes it over: it was
 * decoding (every token but the last sampled one computed), and this node's KV is its own to read
 * (not a host mirror of device memory that holds only what it loaded). */
static bool migration_lendable(const kv_conn_t *k, const pd_request_t *req, int32_t num_blocks)
{
    return req->migrating && !k->staged && num_blocks > 0 && req->num_computed_tokens > 0 &&
           req->num_computed_tokens == req->num_tokens - 1 && req->num_tokens > req->num_prompt_tokens;
}

bool kv_request_finished(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                         void **params_out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    const json_t *p = req->kv_transfer_params;
    bool ok = req->state == PD_REQ_FINISHED_STOPPED || req->state == PD_REQ_FINISHED_LENGTH;
    bool loading = cancel_load(k, req);
    bool lend = p != NULL && kv_jbool(p, "kv_lend");
    if (!k->is_prefill && !lend) {
        if (!loading && migration_lendable(k, req, num_blocks)) {
            return finished_pull(k, req, block_ids, num_blocks, params_out);
        }
        if (p != NULL) {
            *params_out = json_null(); /* a decode hands nothing on (as vLLM's decode answers) */
        }
        return loading;
    }
    if (loading) {
        return true; /* a prefill's prefix fetch was in flight: it ended before any KV to hand on */
    }
    if (p == NULL || !kv_jbool(p, "do_remote_decode")) {
        return false;
    }
    bool ended_here = kv_jbool(p, "first_token") && !req->handed_over;
    if (ended_here) {
        *params_out = json_null(); /* its first token ended it: no decode goes on from here */
    }
    if (kv_wants_push(k, p)) {
        return finished_push(k, req, block_ids, num_blocks, ok); /* WRITE_DONE still carries the token */
    }
    if (ended_here) {
        return false; /* pull: nothing to hold */
    }
    if (kv_stage_failed_take(k, req->id)) {
        pd_log_warn("kv connector: request %s: its KV could not be staged to host memory; no KV is "
                    "offered (no kv_transfer_params: the request fails cleanly instead of decoding garbage)",
                    req->id);
        return false;
    }
    return ok && num_blocks > 0 && finished_pull(k, req, block_ids, num_blocks, params_out);
}
