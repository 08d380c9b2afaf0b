/* proxy/migrate.c — requests that outlive their decode node (--migration-limit): what the client has
 * had of a stream (the token ids of every event relayed, asked of the nodes with return_token_ids and
 * taken out again when the client did not ask for them), and the resumption of a request whose
 * decode leg broke (its connection failed, or its stream ended without [DONE]: a node killed or
 * draining) on another decode node. A stream goes on there after the tokens the client has
 * (resume_token_ids: that node sends only what follows). A draining decode migrates its streams
 * live: each ends with an event {"pd_migrate": params}, a lease on the KV of its prompt and tokens,
 * which the next node reads instead of recomputing (the event is not the client's; the lease is
 * released if that node never took it over). After a kill the prefill that computed the prompt is
 * asked to lend its KV (kv_fetch.c px_fetch_resume): the next node reads the prompt from it and
 * recomputes only the tokens (all of it when the lend is refused or fails). A request
 * whose answer had not started is sent again whole. Seeded sampling draws per output position, so
 * the continuation is the one the first node would have sampled. A stream of several choices (n > 1,
 * a batch of prompts) resumes choice by choice: each goes on after its own tokens, a finished one is
 * not generated again; a draining node's event then holds a lease per choice ({"choices": [...]},
 * passed on as they are), and after a kill its prompt's KV is lent by the prefill when it has one
 * prompt. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/http_reply.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"

/* The nodes' cap on a request's choices (prompts x n; server/openai.h PD_MAX_CHOICES). */
#define PX_MAX_CHOICES 128

void px_migrate_prepare(preq_t *q)
{
    json_t *n = json_object_get(q->body, "n");
    json_int_t choices = n == NULL || json_is_null(n) ? 1 : json_is_integer(n) ? json_integer_value(n) : 0;
    if (q->batched && choices >= 1 && choices <= PX_MAX_CHOICES) { /* the client's n: no overflow */
        choices *= (json_int_t)json_array_size(json_object_get(q->body, "prompt"));
    }
    /* several choices with echo: the ones that had not started would lose their prompt's text */
    q->resumable = q->px->cfg.migration_limit > 0 && q->stream && choices >= 1 && choices <= PX_MAX_CHOICES &&
                   (choices == 1 || !json_is_true(json_object_get(q->body, "echo")));
    if (q->resumable) {
        q->ch = calloc((size_t)choices, sizeof(px_choice_t));
        q->resumable = q->ch != NULL;
        q->num_ch = q->ch != NULL ? (int32_t)choices : 0;
    }
    if (!q->resumable) {
        return;
    }
    q->strip_ids = !json_is_true(json_object_get(q->body, "return_token_ids"));
    json_object_set_new(q->body, "return_token_ids", json_true());
}

size_t px_gen_total(const preq_t *q)
{
    size_t n = 0;
    for (int32_t k = 0; k < q->num_ch; k++) {
        n += q->ch[k].num_gen;
    }
    return n;
}

void px_migrate_free(preq_t *q)
{
    for (int32_t k = 0; k < q->num_ch; k++) {
        free(q->ch[k].gen);
    }
    free(q->ch);
    q->ch = NULL;
    q->num_ch = 0;
}

/* Whether the client has had anything of the answer but role events: a token or a finish. */
static bool answer_started(const preq_t *q)
{
    for (int32_t k = 0; k < q->num_ch; k++) {
        if (q->ch[k].num_gen > 0 || q->ch[k].finish_sent) {
            return true;
        }
    }
    return false;
}

static bool all_finished(const preq_t *q)
{
    for (int32_t k = 0; k < q->num_ch; k++) {
        if (!q->ch[k].finish_sent) {
            return false;
        }
    }
    return q->num_ch > 0;
}

/* Records what an event tells the client of one choice: its token ids, chat's role, a finish reason.
 * False for a choice index the request does not have, or out of memory. */
static bool note_ids(preq_t *q, json_t *choice)
{
    json_t *index = json_object_get(choice, "index");
    json_int_t k = index == NULL ? 0 : json_is_integer(index) ? json_integer_value(index) : -1;
    if (k < 0 || k >= q->num_ch) {
        return false;
    }
    px_choice_t *h = &q->ch[k];
    json_t *ids = json_object_get(choice, "token_ids");
    size_t i;
    json_t *v;
    json_array_foreach(ids, i, v)
    {
        if (!json_is_integer(v) || pd_array_reserve(&h->gen, &h->cap_gen, h->num_gen + 1) != PD_OK) {
            return false;
        }
        h->gen[h->num_gen++] = (int32_t)json_integer_value(v);
    }
    q->roles_sent += json_object_get(json_object_get(choice, "delta"), "role") != NULL;
    h->finish_sent |= json_is_string(json_object_get(choice, "finish_reason"));
    return true;
}

/* Releases the lease pull parameters p name on node n. */
static void release_lease(preq_t *q, node_t *n, const json_t *p)
{
    json_t *rid = json_object_get(p, "remote_request_id"), *lid = json_object_get(p, "lease_id");
    json_t *body = json_is_string(rid) && json_is_integer(lid)
                       ? json_pack("{s:O, s:O}", "remote_request_id", rid, "lease_id", lid)
                       : NULL; /* no lease named: nothing to release (it expires) */
    if (body != NULL) {
        px_post_release(q->px, n, q->auth, body);
    }
    json_decref(body);
}

void px_migrate_end(preq_t *q)
{
    if (q->mig == NULL) {
        return;
    }
    json_t *each = json_object_get(q->mig, "choices"); /* several choices: a lease each (or null) */
    size_t k;
    json_t *p;
    json_array_foreach(each, k, p)
    {
        release_lease(q, q->mig_node, p);
    }
    if (each == NULL) {
        release_lease(q, q->mig_node, q->mig);
    }
    json_decref(q->mig);
    q->mig = NULL;
}

/* A draining decode's last event, {"pd_migrate": params}: the lease on the stream's KV, which the
 * next leg reads (px_resume_decode). Not for the client. */
static bool take_migration(preq_t *q, json_t *j)
{
    json_t *p = json_object_get(j, "pd_migrate");
    if (p == NULL) {
        return false;
    }
    px_migrate_end(q); /* an earlier migration's lease, read long ago */
    if (json_is_object(p)) {
        q->mig = json_incref(p);
        q->mig_node = q->d;
    }
    return true;
}

bool px_is_migration_event(const char *ev)
{
    if (strstr(ev, "\"pd_migrate\"") == NULL) {
        return false; /* the common case: no parse */
    }
    json_t *j = json_loads(ev, JSON_ALLOW_NUL, NULL);
    bool mig = json_object_get(j, "pd_migrate") != NULL;
    json_decref(j);
    return mig;
}

void px_relay_event(preq_t *q, const char *ev)
{
    if (!q->resumable) {
        pd_http_send_sse(q->client, ev);
        return;
    }
    bool done = strcmp(ev, "[DONE]") == 0;
    json_t *j = done ? NULL : json_loads(ev, JSON_ALLOW_NUL, NULL); /* a token's text may hold a NUL */
    if (j != NULL && take_migration(q, j)) {
        json_decref(j);
        return;
    }
    double now = pd_time_now_s();
    if (q->pause_open) {
        q->pause_open = false;
        /* the node that took it over sent a token: it read the leased KV (the read freed it) or
         * recomputed, so the lease is not released (its node may have exited, a drain done) */
        json_decref(q->mig);
        q->mig = NULL;
        pd_metric_observe(q->px->m.migration_pause_s, now - q->t_last_event);
        pd_log_info("proxy: request %s: resumed on %s, %.1f ms after its last event%s", q->req_id, q->d->url,
                    1e3 * (now - q->t_last_event),
                    q->resume_lend && q->kv_prefix != NULL ? " (its prompt's KV read from its prefill)" : "");
        if (q->resume_lend) {
            px_fetch_end(q); /* read already, or computed: the prefill's lease is not needed */
        }
    }
    q->t_last_event = now;
    if (done) {
        q->d_ended = true;
        pd_http_send_sse(q->client, ev);
        return;
    }
    json_t *choices = json_object_get(j, "choices");
    size_t i;
    json_t *c;
    bool ok = j != NULL;
    json_array_foreach(choices, i, c)
    {
        ok = ok && note_ids(q, c);
        if (q->strip_ids) {
            json_object_del(c, "token_ids");
            json_object_del(c, "prompt_token_ids");
        }
    }
    if (!ok) {
        pd_log_warn(
            "proxy: request %s: cannot keep its token ids (%s); it is not resumed if its decode fails",
            q->req_id,
            j == NULL ? "an event that is not JSON" : "a choice it does not have, or out of memory");
        q->resumable = false;
    }
    char *text = j != NULL && q->strip_ids && choices != NULL ? json_dumps(j, JSON_COMPACT) : NULL;
    pd_http_send_sse(q->client, text != NULL ? text : ev);
    free(text);
    json_decref(j);
}

bool px_should_resume(const preq_t *q, int code)
{
    if (q->client == NULL || q->migrations >= q->px->cfg.migration_limit) {
        return false;
    }
    if (code == 0 || code == 503) {
        /* the connection failed, or the node refused to start it (draining, its queue full): a stream
         * resumes, anything else is sent again whole */
        return !q->stream || q->resumable || !q->reply_started;
    }
    /* a stream that ended without [DONE] (a draining node): after its finish, only [DONE] is missing */
    return code == 200 && q->resumable && !q->d_ended;
}

/* The answer's last event had come; only [DONE] was missing (usage, when asked, is lost). */
static void end_after_finish(preq_t *q)
{
    proxy_t *px = q->px;
    pd_log_info(
        "proxy: request %s: its decode %s ended the stream after the finish without [DONE]; ending it",
        q->req_id, q->d->url);
    pd_http_send_sse(q->client, "[DONE]");
    evhttp_send_reply_end(q->client);
    pd_metric_inc(px->m.ok, 1);
    q->client = NULL;
    q->d_done = true;
    if (q->p_conn == NULL) {
        px_preq_free(q);
    }
}

/* q cannot be resumed: a stream already under way gets an error event and [DONE] (as a node's own
 * failure reads), anything else the error reply. */
static void end_with_error(preq_t *q, int status, const char *msg)
{
    if (q->client != NULL && q->reply_started) {
        json_t *err =
            json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", msg, "type",
                      status == 503 ? "ServiceUnavailableError" : "BadGatewayError", "param", "code", status);
        char *text = err != NULL ? json_dumps(err, JSON_COMPACT) : NULL;
        pd_http_send_sse(q->client, text != NULL ? text : "{}");
        pd_http_send_sse(q->client, "[DONE]");
        free(text);
        json_decref(err);
    }
    px_fail_request(q, status, msg);
}

void px_resume_decode(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *dead = q->d;
    if (all_finished(q)) {
        end_after_finish(q);
        return;
    }
    px_release_prefill(q); /* read already, or nobody will now */
    q->migrations++;
    pd_metric_inc(px->m.migrations, 1);
    memset(q->tried_d, 0, sizeof(q->tried_d)); /* every healthy node but the one that failed */
    q->tried_d[dead - px->nodes] = true;
    /* a stream handed over with its KV (a drain, /admin/migrate, a rebalance) goes to the decode with
     * the least load: it reads its KV from the lease wherever it lands, and with more than two decodes
     * the policy's pick (an affinity hash) could put it on one as busy as the node it left (a
     * rebalance would then move streams again); after a kill the policy picks, as for a new request */
    bool live = q->mig != NULL && q->mig_node == dead;
    node_t *d = live ? px_pick_least_loaded(px, false, q->tried_d)
                     : px_pick(px, false, q->tried_d, q->affinity, q->keys, q->num_keys, false);
    if (d == NULL) {
        pd_log_warn("proxy: request %s: its decode %s failed after %zu tokens and no other decode node is "
                    "healthy",
                    q->req_id, dead->url, px_gen_total(q));
        q->d_done = true;
        end_with_error(q, 503, "the decode node failed and no other is healthy");
        return;
    }
    char several[64] = "";
    if (q->num_ch > 1) {
        int32_t done = 0;
        for (int32_t k = 0; k < q->num_ch; k++) {
            done += q->ch[k].finish_sent;
        }
        snprintf(several, sizeof(several), " (%d of its %d choices finished)", done, q->num_ch);
    }
    pd_log_info(
        "proxy: request %s: its decode %s %s after %zu tokens%s; resuming it on %s (migration %d of %d)",
        q->req_id, dead->url, q->mig != NULL && q->mig_node == dead ? "handed it over with its KV" : "failed",
        px_gen_total(q), several, d->url, q->migrations, px->cfg.migration_limit);
    q->tried_d[d - px->nodes] = true;
    q->d = d;
    q->local = true; /* no prefill leg from now on */
    q->d_done = false;
    q->d_ended = false;
    q->d_code = 0;
    evbuffer_drain(q->d_sse, evbuffer_get_length(q->d_sse)); /* an event cut short went nowhere */
    evbuffer_drain(q->d_body, evbuffer_get_length(q->d_body));
    json_decref(q->kv_prefix);
    q->kv_prefix = NULL;
    q->t_d_sent = 0; /* not in decode on d until its leg goes (px_refresh_router_gauges, rebalance.c) */
    q->mig_live = live;
    /* a batch's lend would be of its first prompt only (one engine request carries the parameters) */
    if (!live && answer_started(q) && !q->batched && px_fetch_resume(q)) {
        return; /* the prefill that computed the prompt is asked to lend it; its answer sends the leg */
    }
    px_send_resumed(q);
}

/* resume_token_ids: one choice's tokens; several choices' entries, each its tokens or, finished,
 * {"finished": true, "completion_tokens": K} (server/openai.c parse_resume). */
static json_t *resume_ids_json(const preq_t *q)
{
    json_t *all = q->num_ch > 1 ? json_array() : NULL;
    for (int32_t k = 0; k < q->num_ch; k++) {
        const px_choice_t *h = &q->ch[k];
        json_t *e;
        if (q->num_ch > 1 && h->finish_sent) {
            e = json_pack("{s:b, s:I}", "finished", 1, "completion_tokens", (json_int_t)h->num_gen);
        } else {
            e = json_array();
            for (size_t i = 0; i < h->num_gen; i++) {
                json_array_append_new(e, json_integer(h->gen[i]));
            }
        }
        if (all == NULL) {
            return e;
        }
        json_array_append_new(all, e);
    }
    return all;
}

void px_send_resumed(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *d = q->d;
    json_t *body = q->body;
    json_object_del(body, "kv_transfer_params");
    if (answer_started(q)) { /* the node sends what follows the client's tokens, without role events */
        json_object_set_new(body, "resume_token_ids", resume_ids_json(q));
        if (q->mig_live) { /* live migration: it reads the KV from there */
            json_object_set(body, "kv_transfer_params", q->mig);
            pd_metric_inc(px->m.kv_migrations, 1);
        } else if (q->kv_prefix != NULL) { /* after a kill: the prompt's KV, lent by its prefill */
            json_object_set_new(body, "kv_transfer_params", json_pack("{s:O}", "kv_prefix", q->kv_prefix));
        }
        json_object_del(body, "echo"); /* the prompt's text went out with the first event */
        q->d_skip = 0;
    } else {
        q->d_skip = q->roles_sent; /* a chat stream's role events, sent again by the new node */
    }
    q->pause_open = q->t_last_event > 0;
    q->t_d_sent = pd_time_now_s();
    q->d_conn = px_upstream_leg(px, d, EVHTTP_REQ_POST, q->path, q->auth, q->req_id, q->resumable, body,
                                px_on_d_done, px_on_d_chunk, px_on_d_header, q);
    if (q->d_conn == NULL) {
        q->d_done = true;
        end_with_error(q, 502, "cannot reach the decode node");
        return;
    }
    d->inflight++;
}
