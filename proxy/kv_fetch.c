/* proxy/kv_fetch.c — peer-to-peer prefix fetch (issue 52). Before a prefill leg, when the KV index
 * says another node (a prefill, or the decode that produced the last turn's answer) holds at least
 * --pd-prefix-fetch-min-blocks more of the prompt's full blocks than the chosen prefill, that node is
 * asked to lend them: a 1-token /v1/completions of the prompt's first held·block_size + 1 tokens
 * (so the lender computes one token at most) with kv_transfer_params {do_remote_decode, pull,
 * kv_lend, kv_lend_min_tokens}. Its answer's pull parameters (signed by the lender for exactly those
 * tokens, a lease on its blocks) go to the prefill as kv_transfer_params.kv_prefix; the prefill reads
 * the blocks past its own hit over the KV pipe, or computes them when its cost model says that is
 * faster (--kv-prefix-fetch). A refused lend (the lender no longer holds the prefix: it computes
 * nothing) or a failed one costs the round trip, and the prefill computes. When the prefill leg
 * ends the lease is released (a read has freed it already). Loop thread only. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"

static void on_lend_done(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    px_release_conn(px, q->lend_conn);
    q->lend_conn = NULL;
    pd_metric_observe(px->m.fetch_s, pd_time_now_s() - q->t_lend);
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    json_t *resp = NULL;
    if (code == 200) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t len = evbuffer_get_length(in);
        resp = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, NULL);
    }
    json_t *ktp = json_object_get(resp, "kv_transfer_params");
    pd_metric_t **res = q->resume_lend ? px->m.resume_lends : px->m.fetch;
    if (json_is_object(ktp) && json_is_array(json_object_get(ktp, "remote_block_ids"))) {
        json_decref(q->kv_prefix);
        q->kv_prefix = json_incref(ktp);
        pd_metric_inc(res[0], 1);
        pd_log_debug("proxy: %s lent %lld prefix tokens for the prefill on %s", q->lender->url,
                     (long long)json_integer_value(json_object_get(ktp, "remote_num_tokens")), q->p->url);
    } else {
        /* an answer without parameters: the lender holds less than asked (evicted since its events
         * said so) and computed nothing; no answer within --pd-prefix-fetch-timeout: it failed, and
         * may have leased the blocks meanwhile (px_fetch_end releases them) */
        pd_metric_inc(res[code == 0 ? 2 : 1], 1);
        pd_log_debug("proxy: %s did not lend the prefix (%d); it is computed", q->lender->url, code);
        q->lend_released = code != 0; /* answered: nothing held */
    }
    json_decref(resp);
    if (q->resume_lend) {
        px_send_resumed(q);
    } else {
        px_send_prefill(q);
    }
}

/* Sends the lend request body to lender (the request's id with -lend); false when it cannot. */
static bool send_lend(preq_t *q, node_t *lender, const char *path, json_t *body)
{
    proxy_t *px = q->px;
    char rid[PD_REQUEST_ID_MAX + 1];
    snprintf(rid, sizeof(rid), "%.*s-lend", PD_REQUEST_ID_MAX - 5, q->req_id);
    q->lender = lender;
    q->lend_released = false;
    q->t_lend = pd_time_now_s();
    q->lend_conn =
        px_upstream(px, lender, EVHTTP_REQ_POST, path, q->auth, rid, body, on_lend_done, NULL, NULL, q);
    if (q->lend_conn == NULL) {
        q->lend_released = true;
        return false;
    }
    /* a lend is one token over a cached prefix: a lender that takes longer (stopped, overloaded) is
     * not waited for */
    struct timeval tv = {
        (time_t)px->cfg.prefix_fetch_timeout,
        (suseconds_t)((px->cfg.prefix_fetch_timeout - (double)(time_t)px->cfg.prefix_fetch_timeout) * 1e6)};
    evhttp_connection_set_timeout_tv(q->lend_conn, &tv);
    return true;
}

bool px_fetch_begin(preq_t *q)
{
    proxy_t *px = q->px;
    int bs = px->kv_block_size;
    if (px->cfg.prefix_fetch_min_blocks <= 0 || q->fetch_asked || q->toks == NULL || q->num_keys <= 0 ||
        bs <= 0) {
        return false;
    }
    q->fetch_asked = true; /* a retried prefill leg goes without */
    /* by the nodes' events alone: a recent route (px_note_route) is a guess, and the chosen prefill's
     * includes this very request */
    int mine = px_kv_index_prefix(&px->kv_index, q->keys, q->num_keys, (int)(q->p - px->nodes)), best = mine;
    node_t *lender = NULL;
    for (int i = 0; i < px->num_nodes; i++) {
        node_t *n = &px->nodes[i];
        if (n == q->p || !n->healthy || n->removed) {
            continue;
        }
        int held = px_kv_index_prefix(&px->kv_index, q->keys, q->num_keys, i); /* events, not guesses */
        if (held > best) {
            best = held;
            lender = n;
        }
    }
    if (lender == NULL || best - mine < px->cfg.prefix_fetch_min_blocks) {
        return false;
    }
    int32_t want = best * bs + 1 < q->num_tokens ? best * bs + 1 : q->num_tokens;
    json_t *ids = json_array();
    for (int32_t i = 0; ids != NULL && i < want; i++) {
        json_array_append_new(ids, json_integer(q->toks[i]));
    }
    snprintf(q->lend_id, sizeof(q->lend_id), "%s-lend", q->transfer_id);
    json_t *body =
        json_pack("{s:O?, s:o, s:i, s:f, s:{s:b, s:b, s:s, s:b, s:i, s:s}}", "model",
                  json_object_get(q->body, "model"), "prompt", ids, "max_tokens", 1, "temperature", 0.0,
                  "kv_transfer_params", "do_remote_decode", 1, "do_remote_prefill", 0, "transfer_mode",
                  "pull", "kv_lend", 1, "kv_lend_min_tokens", (mine + 1) * bs, "transfer_id", q->lend_id);
    if (body == NULL) {
        return false;
    }
    q->resume_lend = false;
    bool sent = send_lend(q, lender, "/v1/completions", body);
    json_decref(body);
    if (!sent) {
        pd_metric_inc(px->m.fetch[2], 1);
        return false;
    }
    pd_log_debug("proxy: asking %s to lend %d prefix blocks (the prefill on %s holds %d)", lender->url, best,
                 q->p->url, mine);
    return true;
}

void px_fetch_end(preq_t *q)
{
    if (q->lender == NULL || q->lend_released) {
        return;
    }
    q->lend_released = true;
    json_t *body = json_pack("{s:s}", "transfer_id", q->lend_id);
    px_post_release(q->px, q->lender, q->auth, body);
    json_decref(body);
}

bool px_fetch_resume(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *p = q->p;
    if (p == NULL || !p->healthy || p->removed || q->body == NULL) {
        return false;
    }
    px_fetch_end(q); /* a prefix fetch's lend for the prefill leg (read, or not wanted now) */
    /* the prefill leg's body (the same prompt, one token), as a lend of at least a block of it */
    json_t *body = json_deep_copy(q->body);
    if (body == NULL) {
        return false;
    }
    px_one_token_body(body);
    static const char *drop[] = {
        "echo",        "prompt_logprobs", "resume_token_ids", "response_format", "structured_outputs",
        "guided_json", "guided_regex",    "guided_choice",    "guided_grammar"};
    for (size_t i = 0; i < sizeof(drop) / sizeof(drop[0]); i++) {
        json_object_del(body, drop[i]);
    }
    snprintf(q->lend_id, sizeof(q->lend_id), "%s-rlend%d", q->transfer_id, q->migrations);
    int bs = px->kv_block_size > 0 ? px->kv_block_size : 1;
    json_object_set_new(body, "kv_transfer_params",
                        json_pack("{s:b, s:b, s:s, s:b, s:i, s:s}", "do_remote_decode", 1,
                                  "do_remote_prefill", 0, "transfer_mode", "pull", "kv_lend", 1,
                                  "kv_lend_min_tokens", bs, "transfer_id", q->lend_id));
    q->resume_lend = true;
    bool sent = send_lend(q, p, q->path, body);
    json_decref(body);
    if (!sent) {
        pd_metric_inc(px->m.resume_lends[2], 1);
        return false;
    }
    pd_log_debug("proxy: request %s: asking its prefill %s to lend its prompt for the resumed leg", q->req_id,
                 p->url);
    return true;
}
