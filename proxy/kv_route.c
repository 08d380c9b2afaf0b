/* proxy/kv_route.c — what the proxy learns of a prompt before it picks nodes, and the choice it
 * makes from that: the prompt's tokens (a token-id prompt as sent; a text or chat prompt through a
 * node's /tokenize, which renders and tokenizes it as that node's completion route would), their
 * full blocks' keys chained as the nodes' prefix caches chain them (pd_hash128_chain,
 * pd_kv_event_hash), and whether the decode should prefill the prompt itself
 * (--pd-local-prefill-threshold, --pd-local-prefill-hit-ratio) instead of a prefill node computing
 * it and moving its KV. Loop thread only. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "scheduler/kv_events.h" /* pd_kv_event_hash: the nodes' block keys */

/* Some prompt knowledge is wanted: the kv-aware policy scores blocks, the local-prefill rules count
 * tokens. */
static bool wants_tokens(const proxy_t *px)
{
    return strcmp(px->cfg.policy, "kv-aware") == 0 || px->cfg.local_prefill_threshold > 0 ||
           px->cfg.local_prefill_hit_ratio > 0 || px->cfg.prefix_fetch_min_blocks > 0;
}

/* q's prompt is toks[n]: its length and (block size known from the events) its full blocks' keys. */
static void set_tokens(preq_t *q, const int32_t *toks, size_t n)
{
    q->num_tokens = (int32_t)n;
    if (q->px->cfg.prefix_fetch_min_blocks > 0 && (q->toks = malloc(n * sizeof(int32_t))) != NULL) {
        memcpy(q->toks, toks, n * sizeof(int32_t)); /* a lend asks for a prefix of them (kv_fetch.c) */
    }
    int bs = q->px->kv_block_size;
    if (bs <= 0 || n < (size_t)bs) {
        return;
    }
    int nb = (int)(n / (size_t)bs);
    q->keys = malloc((size_t)nb * sizeof(uint64_t));
    if (q->keys == NULL) {
        return;
    }
    pd_hash128_t prev;
    for (int b = 0; b < nb; b++) {
        prev = pd_hash128_chain(b > 0 ? &prev : NULL, toks + (size_t)b * bs, (size_t)bs, NULL, 0);
        q->keys[b] = pd_kv_event_hash(prev);
    }
    q->num_keys = nb;
}

/* A JSON array of token ids (int32 range) as a malloc'd array; NULL when it is not one (or empty). */
static int32_t *ids_of(const json_t *a, size_t *n_out)
{
    size_t n = json_array_size(a);
    int32_t *ids = n > 0 ? malloc(n * sizeof(int32_t)) : NULL;
    for (size_t i = 0; ids != NULL && i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            free(ids);
            return NULL;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    *n_out = n;
    return ids;
}

/* ------------------------------------------------------------------ the decision */

/* The decode node that should prefill q itself, or NULL (disaggregate): the prompt's part that node
 * does not hold (by the index) is under --pd-local-prefill-threshold tokens, or it holds at least
 * --pd-local-prefill-hit-ratio of the prompt. Unknown tokens: NULL. */
static node_t *local_decode(preq_t *q)
{
    proxy_t *px = q->px;
    if (q->num_tokens <= 0 ||
        (px->cfg.local_prefill_threshold <= 0 && px->cfg.local_prefill_hit_ratio <= 0)) {
        return NULL;
    }
    bool none[MAX_NODES] = {false};
    uint64_t rr = px->rr[0];
    node_t *d = px_pick(px, false, none, q->affinity, q->keys, q->num_keys, false);
    if (d == NULL) {
        return NULL;
    }
    int32_t cached = px_cached_prefix(px, d, q->keys, q->num_keys) * px->kv_block_size;
    int32_t uncached = q->num_tokens - cached;
    bool local = uncached < px->cfg.local_prefill_threshold ||
                 (px->cfg.local_prefill_hit_ratio > 0 &&
                  (double)cached >= px->cfg.local_prefill_hit_ratio * (double)q->num_tokens);
    if (!local) {
        /* only a look: the decode leg picks again later, and a rotation advanced twice per
         * request would send every disaggregated request of a 2-decode pool to one decode */
        px->rr[0] = rr;
    }
    return local ? d : NULL;
}

/* Starts q's legs: on one decode node alone, or prefill then (or, push, with) decode. */
static void route_go(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *d = local_decode(q);
    if (d != NULL) {
        q->local = true;
        q->ft = false; /* one node: its stream is the answer */
        q->push = false;
        q->d_hint = d;
        pd_metric_inc(px->m.routed_local, 1);
        px_start_decode(q);
        return;
    }
    pd_metric_inc(px->m.routed_remote, 1);
    if (px_start_prefill(q) && q->push) {
        px_start_decode(q);
    }
}

/* ------------------------------------------------------------------ tokenizing through a node */

static void on_tokenized(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    px_release_conn(px, q->tok_conn);
    q->tok_conn = NULL;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    json_t *resp = NULL;
    if (code == 200) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t len = evbuffer_get_length(in);
        resp = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, 0, NULL);
    }
    size_t n = 0;
    int32_t *ids = ids_of(json_object_get(resp, "tokens"), &n);
    if (ids != NULL) {
        set_tokens(q, ids, n);
    } else {
        /* routed by the load alone; the node's own answer to the request tells the client why */
        pd_log_debug("proxy: /tokenize on %s answered %d; routing without the prompt's tokens",
                     q->tok_node->url, code);
        pd_metric_inc(px->m.tokenize_failed, 1);
    }
    free(ids);
    json_decref(resp);
    pd_metric_observe(px->m.tokenize_s, pd_time_now_s() - q->t0);
    route_go(q);
}

/* The /tokenize body that renders q's prompt as its completion route would, or NULL (a batch of
 * prompts, or nothing to tokenize). */
static json_t *tokenize_body(const preq_t *q)
{
    json_t *b = q->body;
    if (strcmp(q->path, "/v1/chat/completions") == 0) {
        if (!json_is_array(json_object_get(b, "messages"))) {
            return NULL;
        }
        json_t *t = json_object();
        static const char *const fields[] = {"model",
                                             "messages",
                                             "tools",
                                             "chat_template_kwargs",
                                             "add_generation_prompt",
                                             "continue_final_message",
                                             "add_special_tokens"};
        for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
            json_t *v = json_object_get(b, fields[i]);
            if (v != NULL) {
                json_object_set(t, fields[i], v);
            }
        }
        return t;
    }
    json_t *p = json_object_get(b, "prompt");
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0))) {
        p = json_array_get(p, 0);
    }
    if (!json_is_string(p)) {
        return NULL;
    }
    json_t *t = json_pack("{s:O}", "prompt", p);
    static const char *const fields[] = {"model", "add_special_tokens"};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        json_t *v = json_object_get(b, fields[i]);
        if (v != NULL) {
            json_object_set(t, fields[i], v);
        }
    }
    return t;
}

/* A healthy node of either pool (rotating), for a request every node answers the same. */
static node_t *any_node(proxy_t *px)
{
    for (int k = 0; k < px->num_nodes; k++) {
        node_t *n = &px->nodes[(px->rr_tokenize + (uint64_t)k) % (uint64_t)px->num_nodes];
        if (n->healthy && !n->removed) {
            px->rr_tokenize += (uint64_t)k + 1;
            return n;
        }
    }
    return NULL;
}

void px_route_begin(preq_t *q)
{
    proxy_t *px = q->px;
    if (!wants_tokens(px)) {
        route_go(q);
        return;
    }
    json_t *prompt = json_object_get(q->body, "prompt");
    size_t n = 0;
    int32_t *ids = json_is_array(prompt) ? ids_of(prompt, &n) : NULL;
    if (ids != NULL) {
        set_tokens(q, ids, n);
        free(ids);
        route_go(q);
        return;
    }
    json_t *tb = tokenize_body(q);
    node_t *node = tb != NULL ? any_node(px) : NULL;
    if (node != NULL) {
        q->tok_node = node;
        q->tok_conn = px_upstream(px, node, EVHTTP_REQ_POST, "/tokenize", q->auth, q->req_id, tb,
                                  on_tokenized, NULL, NULL, q);
    }
    json_decref(tb);
    if (q->tok_conn == NULL) {
        route_go(q); /* nothing to tokenize (a batch), or no node to do it: the load decides */
    }
}
