/* proxy/route.c — pd-proxy's client routes and the per-request sequence: the prefill phase (pull:
 * its kv_transfer_params; push: at once with the decode), the decode phase streamed back, retries on
 * another node, releasing a prefill's KV when the decode leg fails, and forwarding the other routes. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <netdb.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "common/api_fields.h"
#include "common/hash.h"
#include "common/http_guard.h"
#include "common/http_reply.h"
#include "common/http_watch.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "common/version.h"

/* ------------------------------------------------------------------ client replies */

/* A chat request whose reply the decode reads tool calls out of: tools, and any tool_choice but
 * "none" ("auto", said or the default with tools as vLLM reads it; "required"; a named function). */
static bool reads_tool_calls(const json_t *body)
{
    const json_t *tc = json_object_get(body, "tool_choice");
    return json_object_get(body, "messages") != NULL && json_array_size(json_object_get(body, "tools")) > 0 &&
           !(json_is_string(tc) && strcmp(json_string_value(tc), "none") == 0);
}

void px_one_token_body(json_t *body)
{
    json_object_set_new(body, "max_tokens", json_integer(1));
    json_object_del(body, "max_completion_tokens");
    json_object_set_new(body, "stream", json_false());
    if (reads_tool_calls(body)) { /* its one token is no reply: only a decode needs a tool-call parser
                                   * (the tools render the same prompt either way) */
        json_object_set_new(body, "tool_choice", json_string("none"));
    }
    json_object_del(body, "stream_options");
    json_object_del(body, "logprobs");
    json_object_del(body, "top_logprobs");
    json_object_del(body, "min_tokens"); /* the prefill's one token; the decode applies it */
    json_object_del(body, "n");          /* one KV for the decode's choices to share */
}

static void reply_json(struct evhttp_request *req, int status, json_t *body)
{
    char *text = json_dumps(body, JSON_COMPACT);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    pd_http_send_reply(req, status, status == 200 ? "OK" : "Error", b);
    evbuffer_free(b);
    free(text);
}

static void reply_error(struct evhttp_request *req, int status, const char *type, const char *msg)
{
    json_t *j =
        json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", msg, "type", type, "param", "code", status);
    reply_json(req, status, j);
    json_decref(j);
}

static void on_client_close(struct evhttp_connection *conn, void *arg);
static void answer_client(preq_t *q, int code);

void px_preq_free(preq_t *q)
{
    proxy_t *px = q->px;
    if (q->prev != NULL) {
        q->prev->next = q->next;
    } else if (px->inflight == q) {
        px->inflight = q->next;
    }
    if (q->next != NULL) {
        q->next->prev = q->prev;
    }
    if (q->client_conn != NULL) {
        evhttp_connection_set_closecb(q->client_conn, NULL, NULL);
    }
    if (q->client_watch != NULL) {
        pd_client_watch_stop(q->client_watch);
    }
    if (q->tok_conn != NULL) {
        evhttp_connection_free(q->tok_conn); /* its callback does not run */
    }
    if (q->lend_conn != NULL) {
        evhttp_connection_free(q->lend_conn); /* the lender aborts it; a lease it granted meanwhile: */
    }
    px_fetch_end(q); /* ... released */
    px_migrate_end(q);
    json_decref(q->kv_prefix);
    free(q->toks);
    px_migrate_free(q);
    json_decref(q->body);
    json_decref(q->ktp);
    json_decref(q->plp_req);
    json_decref(q->plp_got);
    free(q->auth);
    free(q->keys);
    struct evbuffer *bufs[4] = {q->d_body, q->p_sse, q->d_sse, q->p_err};
    for (int i = 0; i < 4; i++) {
        if (bufs[i] != NULL) {
            evbuffer_free(bufs[i]);
        }
    }
    free(q);
}

/* Ends a request whose decode phase will not run: an error for the client (if still there). */
void px_fail_request(preq_t *q, int status, const char *msg)
{
    pd_log_warn("proxy: request failed: %s", msg);
    pd_metric_inc(q->px->m.failed, 1);
    if (q->client != NULL) {
        if (q->reply_started) {
            evhttp_send_reply_end(q->client);
        } else {
            reply_error(q->client, status, status == 503 ? "ServiceUnavailableError" : "BadGatewayError",
                        msg);
        }
    }
    q->client = NULL;
    if (q->p_conn == NULL && q->d_conn == NULL) {
        px_preq_free(q);
    }
}

/* ------------------------------------------------------------------ releasing a prefill's KV */

typedef struct release_ctx {
    proxy_t *px;
    struct evhttp_connection *conn;
} release_ctx_t;

static void on_release_done(struct evhttp_request *r, void *arg)
{
    release_ctx_t *c = arg;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code != 200) {
        pd_log_warn("proxy: releasing held KV answered %d (its lease frees it at the timeout)", code);
    }
    px_release_conn(c->px, c->conn);
    free(c);
}

bool px_post_release(proxy_t *px, node_t *n, const char *auth, const json_t *body)
{
    release_ctx_t *c = body != NULL ? calloc(1, sizeof(*c)) : NULL;
    if (c == NULL) {
        return false;
    }
    c->px = px;
    c->conn =
        px_upstream(px, n, EVHTTP_REQ_POST, "/pd/release", auth, NULL, body, on_release_done, NULL, NULL, c);
    if (c->conn == NULL) {
        free(c); /* the lease ends at the node's --kv-hold-timeout */
    }
    return true;
}

/* The decode leg failed (or the client left) after the prefill held KV for it: tell the prefill
 * to free it now instead of at --kv-hold-timeout (pull: its lease; push: the transfer waiting for
 * a reservation). Fire and forget. */
void px_release_prefill(preq_t *q)
{
    if (q->p == NULL || q->released) {
        return;
    }
    json_t *body = NULL;
    const char *rid = json_string_value(json_object_get(q->ktp, "remote_request_id"));
    json_t *lid = json_object_get(q->ktp, "lease_id");
    if (!q->push && rid != NULL && json_is_integer(lid)) {
        body = json_pack("{s:s, s:O}", "remote_request_id", rid, "lease_id", lid);
    } else { /* push, or a pull prefill that has not answered yet: the id the proxy gave the request */
        body = json_pack("{s:s}", "transfer_id", q->transfer_id);
    }
    q->released = px_post_release(q->px, q->p, q->auth, body);
    json_decref(body);
}

/* ------------------------------------------------------------------ the decode phase */

void px_start_client_stream(preq_t *q)
{
    if (q->client == NULL || q->reply_started) {
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type", "text/event-stream");
    evhttp_add_header(evhttp_request_get_output_headers(q->client), "Cache-Control", "no-cache");
    evhttp_send_reply_start(q->client, 200, "OK");
    q->reply_started = true;
}

int px_on_d_header(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    int code = evhttp_request_get_response_code(r);
    if (code == 200 && q->stream && !q->ft) { /* first-token handover: the stream starts with an event */
        px_start_client_stream(q);
    }
    return 0;
}

void px_on_d_chunk(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    if (q->t_first == 0 && evbuffer_get_length(in) > 0) {
        q->t_first = pd_time_now_s();
        pd_metric_observe(q->px->m.decode_ttft_s, q->t_first - q->t_d_sent);
        if (q->stream &&
            !q->ft) { /* the decode's first event carries the first token (chat: with its role) */
            pd_metric_observe(q->px->m.first_token_s, q->t_first - q->t0);
        }
    }
    if ((q->ft || q->resumable) && evhttp_request_get_response_code(r) == 200) {
        evbuffer_add_buffer(q->d_sse, in); /* relayed event by event */
        px_relay_decode(q);
    } else if (q->client != NULL && q->reply_started && !q->ft) {
        size_t len = evbuffer_get_length(in); /* relayed as it came, in one sendmsg when it can be */
        pd_http_send_chunk(q->client, (const char *)evbuffer_pullup(in, (ev_ssize_t)len), len);
        evbuffer_drain(in, len);
    } else {
        evbuffer_add_buffer(q->d_body, in);
    }
}

void px_on_d_done(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    px_release_conn(px, q->d_conn);
    q->d_conn = NULL;
    q->d->inflight--;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (q->ft && code == 0 && q->d_events == 0 && !q->push && q->client != NULL && q->migrations == 0) {
        /* nothing of this decode reached the client: the prefill's lease lets another one read */
        px_set_health(q->d, false, "connection failed");
        pd_metric_inc(px->m.retry_d, 1);
        px_start_decode(q);
        return;
    }
    if (q->ft) {
        if (code != 200) {
            if (code == 0) {
                px_set_health(q->d, false, "connection failed");
            }
            px_release_prefill(q);
        }
        if (r != NULL && code != 200) {
            evbuffer_add_buffer(q->d_body, evhttp_request_get_input_buffer(r));
        } else if (r != NULL) {
            evbuffer_add_buffer(q->d_sse, evhttp_request_get_input_buffer(r));
        }
        q->d_code = code;
        q->d_done = true;
        if (q->p_done) {
            px_ft_end(q); /* push: else when the prefill's stream ends */
        }
        return;
    }
    if (r != NULL && code == 200 && q->resumable) { /* what the last chunk callback did not see */
        evbuffer_add_buffer(q->d_sse, evhttp_request_get_input_buffer(r));
        px_relay_decode(q);
    }
    if (code == 0) {
        px_set_health(q->d, false, "connection failed");
    }
    if (code == 0 && !q->reply_started && !q->push && q->client != NULL && q->migrations == 0) {
        /* pull: the prefill still holds the KV under its lease; another decode may read it */
        pd_metric_inc(px->m.retry_d, 1);
        px_start_decode(q);
        return;
    }
    if (px_should_resume(q, code)) {
        if (code == 503) {
            px_set_health(q->d, false, "answered 503");
        }
        px_resume_decode(q);
        return;
    }
    if (code == 0 && !q->reply_started) {
        px_release_prefill(q);
        px_fail_request(q, 502, "the decode node failed");
        return;
    }
    if (code != 200) {
        px_release_prefill(q); /* the decode refused it: nobody will read the prefill's KV */
    }
    if (r != NULL) {
        evbuffer_add_buffer(q->d_body, evhttp_request_get_input_buffer(r));
    }
    if (code == 200 && q->plp_req != NULL && !q->local && !q->p_done && q->client != NULL) {
        /* push: the prompt's scores come with the prefill's answer, still on its way */
        q->d_code = code;
        q->d_held = true;
        return;
    }
    answer_client(q, code);
}

/* Sends the decode's answer (q->d_body, status code) to the client, if still there, and ends q's
 * decode phase (q is freed when its prefill leg is over too). */
static void answer_client(preq_t *q, int code)
{
    proxy_t *px = q->px;
    q->d_held = false;
    if (q->client != NULL) {
        if (q->reply_started) {
            evhttp_send_reply_end(q->client);
        } else {
            if (code == 200 && q->plp_req != NULL && !px_plp_merge(q)) {
                code = 502;
                reply_error(q->client, code, "BadGatewayError",
                            "the prefill node's answer had no prompt_logprobs for this request");
            } else {
                evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type",
                                  "application/json");
                pd_http_send_reply(q->client, code, code == 200 ? "OK" : "Error", q->d_body);
            }
        }
        pd_metric_inc(code == 200 ? px->m.ok : px->m.failed, 1);
        pd_metric_observe(px->m.e2e_s, pd_time_now_s() - q->t0);
    }
    q->client = NULL;
    q->d_done = true;
    if (q->p_conn == NULL) {
        px_preq_free(q);
    }
}

void px_start_decode(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *d = q->d_hint != NULL && !q->tried_d[q->d_hint - px->nodes]
                    ? q->d_hint
                    : px_pick(px, false, q->tried_d, q->affinity, q->keys, q->num_keys, false);
    q->d_hint = NULL;
    if (d == NULL) {
        px_release_prefill(q);
        px_fail_request(q, 503, "no healthy decode node");
        return;
    }
    q->tried_d[d - px->nodes] = true;
    q->d = d;
    px_note_route(px, d, q->keys, q->num_keys);
    q->d_skip = q->p_events;
    q->d_events = 0;
    evbuffer_drain(q->d_sse, evbuffer_get_length(q->d_sse));
    /* the client's body with the transfer's parameters: set while px_upstream serialises it */
    json_t *body = q->body;
    if (q->push) {
        json_t *ktp =
            json_pack("{s:b, s:b, s:s, s:s, s:s, s:i, s:s}", "do_remote_prefill", 1, "do_remote_decode", 0,
                      "transfer_mode", "push", "transfer_id", q->transfer_id, "remote_host", q->p->kv_host,
                      "remote_port", q->p->kv_port, "remote_engine_id", q->p->engine_id);
        if (q->ft) { /* the prefill's first token comes with its WRITE_DONE */
            json_object_set_new(ktp, "first_token", json_true());
        }
        json_object_set_new(body, "kv_transfer_params", ktp);
    } else if (!q->local) {
        json_object_set(body, "kv_transfer_params", q->ktp);
    } else {
        px_plp_add(q, body); /* it computes the prompt itself */
    }
    q->t_d_sent = pd_time_now_s();
    q->d_conn = px_upstream_leg(px, d, EVHTTP_REQ_POST, q->path, q->auth, q->req_id, q->resumable, body,
                                px_on_d_done, px_on_d_chunk, px_on_d_header, q);
    json_object_del(body, "kv_transfer_params");
    json_object_del(body, "prompt_logprobs");
    if (q->d_conn == NULL) {
        px_release_prefill(q);
        px_fail_request(q, 502, "cannot reach the decode node");
        return;
    }
    d->inflight++;
}

/* ------------------------------------------------------------------ the prefill phase */

static void on_p_done(struct evhttp_request *r, void *arg)
{
    preq_t *q = arg;
    proxy_t *px = q->px;
    px_release_conn(px, q->p_conn);
    q->p_conn = NULL;
    q->p->inflight--;
    px_fetch_end(q); /* the prefill read the lent prefix at admission, or never will */
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (q->ft) {
        if (r != NULL) { /* what the last chunk callback did not see */
            px_ft_on_p_chunk(r, q);
        }
        px_ft_on_p_done(q, code);
        return;
    }
    json_t *resp = NULL;
    if (r != NULL && code == 200) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t len = evbuffer_get_length(in);
        resp = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, NULL);
    }
    q->p_done = true;
    if (q->push) {
        /* the decode is already waiting for the writes; a failed prefill shows up there as a load
         * failure (policy) after its timeout or at once if the prefill died */
        if (code != 200) {
            pd_log_warn("proxy: push prefill on %s answered %d", q->p->url, code);
            if (code == 0) {
                px_set_health(q->p, false, "connection failed");
            }
        }
        px_plp_take(q, resp);
        json_decref(resp);
        if (q->d_held) {
            answer_client(q, q->d_code); /* the decode's answer waited for the prompt's scores */
        } else if (q->d_conn == NULL) {
            px_preq_free(q); /* the decode phase is over (answered or failed) */
        }
        return;
    }
    if (q->client == NULL) {
        json_decref(resp);
        px_preq_free(q); /* the client left during prefill (on_client_close released what it holds) */
        return;
    }
    pd_metric_observe(px->m.prefill_s, pd_time_now_s() - q->t0);
    if (code == 0 || code >= 500) {
        px_set_health(q->p, false, code == 0 ? "connection failed" : "server error");
        pd_metric_inc(px->m.retry_p, 1);
        px_start_prefill(q); /* no KV was produced: another prefill may do it */
        return;
    }
    if (code != 200) {
        /* the request itself is bad (4xx): relay the prefill's error */
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type", "application/json");
        pd_http_send_reply(q->client, code, "Error", evhttp_request_get_input_buffer(r));
        pd_metric_inc(px->m.failed, 1);
        q->client = NULL;
        px_preq_free(q);
        return;
    }
    json_t *ktp = json_object_get(resp, "kv_transfer_params");
    if (!json_is_object(ktp)) {
        struct evbuffer *in = evhttp_request_get_input_buffer(r);
        size_t len = evbuffer_get_length(in);
        pd_log_warn("proxy: prefill %s answered 200 with %s (%zu bytes): %.200s", q->p->url,
                    resp == NULL ? "a body that is not JSON" : "no kv_transfer_params", len,
                    (const char *)evbuffer_pullup(in, (ev_ssize_t)len));
        json_decref(resp);
        px_fail_request(q, 502, "the prefill node returned no kv_transfer_params");
        return;
    }
    q->ktp = json_incref(ktp);
    px_plp_take(q, resp);
    json_decref(resp);
    px_start_decode(q);
}

/* Sends the prefill request; false when q ended (and was freed) instead. */
bool px_start_prefill(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *p = px_pick(px, true, q->tried_p, q->affinity, q->keys, q->num_keys, q->push);
    if (p == NULL) {
        px_fail_request(q, 503, "no healthy prefill node");
        return false;
    }
    q->tried_p[p - px->nodes] = true;
    q->p = p;
    px_note_route(px, p, q->keys, q->num_keys);
    if (px_fetch_begin(q)) {
        return true; /* a node holding more of the prompt lends it first; then px_send_prefill */
    }
    return px_send_prefill(q);
}

bool px_send_prefill(preq_t *q)
{
    proxy_t *px = q->px;
    node_t *p = q->p;
    /* first-token handover: the client's body as it is (the parameters set while px_upstream
     * serialises it); else a copy with the fields a 1-token prefill must not see */
    json_t *body = q->ft ? q->body : json_deep_copy(q->body);
    json_t *ktp = json_pack("{s:b, s:b}", "do_remote_decode", 1, "do_remote_prefill", 0);
    if (q->ft) {
        /* first-token handover: the client's request as it is; the prefill stops after the first
         * token unless that token ends it, and the decode goes on from it */
        json_object_set_new(ktp, "first_token", json_true());
    } else {
        px_one_token_body(body);
        px_plp_add(q, body); /* the prompt is scored where it is computed */
    }
    /* the mode is always named: a node's own default may differ from the proxy's choice (the pool's
     * mode is unknown until a prefill's /pd/info answers, and then this request goes as pull) */
    json_object_set_new(ktp, "transfer_mode", json_string(q->push ? "push" : "pull"));
    /* push: the decode names it in its reservation; both: the proxy releases what the prefill holds
     * for the request with it, even before the prefill answered (its client left) */
    json_object_set_new(ktp, "transfer_id", json_string(q->transfer_id));
    if (q->kv_prefix != NULL) { /* kv_fetch.c: the prefix a peer lent, for the prefill to read */
        json_object_set(ktp, "kv_prefix", q->kv_prefix);
    }
    json_object_set_new(body, "kv_transfer_params", ktp);
    q->p_conn = px_upstream(px, p, EVHTTP_REQ_POST, q->path, q->auth, q->req_id, body, on_p_done,
                            q->ft ? px_ft_on_p_chunk : NULL, NULL, q);
    if (q->ft) {
        json_object_del(body, "kv_transfer_params");
    } else {
        json_decref(body);
    }
    if (q->p_conn == NULL) {
        px_fail_request(q, 502, "cannot reach the prefill node");
        return false;
    }
    p->inflight++;
    return true;
}

/* ------------------------------------------------------------------ client routes */

static void on_client_close(struct evhttp_connection *conn, void *arg)
{
    (void)conn;
    preq_t *q = arg;
    pd_log_info("proxy: client went away; closing its upstream requests");
    pd_metric_inc(q->px->m.client_gone, 1);
    q->client = NULL;
    q->client_conn = NULL;
    if (q->p != NULL && !q->d_done && !q->local) {
        /* the prefill holds (or, still computing, may finish holding) KV for a decode that may not
         * have reached it yet (still queued there: its abort tells the prefill nothing); a lease
         * already read releases nothing, and a prefill that aborts the request holds nothing */
        px_release_prefill(q);
    }
    /* closing the upstream connections makes both nodes abort the request */
    if (q->p_conn != NULL) {
        q->p->inflight--;
        evhttp_connection_free(q->p_conn);
        q->p_conn = NULL;
    }
    if (q->d_conn != NULL) {
        q->d->inflight--;
        evhttp_connection_free(q->d_conn);
        q->d_conn = NULL;
    }
    px_preq_free(q);
}

static void handle_completions(proxy_t *px, struct evhttp_request *req, const char *path)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > px->cfg.max_request_bytes) {
        reply_error(req, 413, "RequestTooLargeError", "request body too large");
        return;
    }
    json_error_t jerr;
    json_t *body = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, &jerr);
    if (!json_is_object(body)) {
        char msg[256];
        snprintf(msg, sizeof(msg), "the body is not a JSON object (%s)",
                 body == NULL ? jerr.text : "wrong type");
        json_decref(body);
        reply_error(req, 400, "BadRequestError", msg);
        return;
    }
    json_t *lps = json_object_get(body, "logprobs");
    if (json_is_true(json_object_get(body, "echo")) && lps != NULL && !json_is_null(lps)) {
        /* refused before any node holds KV for it: the prompt's scores would go in the decode's
         * logprobs arrays (prompt_logprobs goes through, prompt_scores.c) */
        reply_error(req, 400, "BadRequestError",
                    "'echo' with 'logprobs' is not supported through the P/D proxy yet (use prompt_logprobs, "
                    "or send it to pd-serve)");
        json_decref(body);
        return;
    }
    pd_http_error_t verr;
    if (!pd_api_check_rewritten_fields(body, strstr(path, "chat") != NULL, &verr)) {
        /* the fields rewritten for the prefill are checked here, as the nodes check them: a prefill
         * never computes (and holds) KV for a request its decode would refuse */
        json_t *ej = pd_http_error_json(&verr);
        reply_json(req, verr.status, ej);
        json_decref(ej);
        json_decref(body);
        return;
    }
    preq_t *q = calloc(1, sizeof(*q));
    const char *auth = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    if (q == NULL || (auth != NULL && (q->auth = strdup(auth)) == NULL)) {
        free(q);
        json_decref(body);
        reply_error(req, 503, "ServiceUnavailableError", "out of memory");
        return;
    }
    q->px = px;
    q->client = req;
    q->body = body;
    q->stream = json_is_true(json_object_get(body, "stream"));
    q->path = path;
    q->d_body = evbuffer_new();
    q->p_sse = evbuffer_new();
    q->d_sse = evbuffer_new();
    q->p_err = evbuffer_new();
    q->t0 = pd_time_now_s();
    /* first-token handover: streamed, one choice (n > 1 and batched prompts sample one first token
     * per choice: the decode does, from a prefill that computed the prompt once) */
    json_t *nc = json_object_get(body, "n");
    json_t *pr = json_object_get(body, "prompt");
    bool batched = json_is_array(pr) && json_array_size(pr) > 0 && !json_is_integer(json_array_get(pr, 0)) &&
                   json_array_size(pr) != 1;
    /* ... and no tool calls to read: a decode reads them out of the whole reply (server/tool_calls.h),
     * so it samples the first token itself */
    q->batched = batched;
    q->ft = px->cfg.first_token_from_prefill && q->stream &&
            (nc == NULL || json_is_null(nc) || json_integer_value(nc) == 1) && !batched &&
            !reads_tool_calls(body);
    json_object_del(body, "kv_transfer_params"); /* the proxy owns the transfer */
    if (json_object_get(body, "resume_token_ids") != NULL) {
        /* the proxy sets it on a resumed leg; a client's would be relayed with the proxy's ids */
        reply_error(req, 400, "BadRequestError",
                    "'resume_token_ids' is set by the proxy when a decode node fails; send it to a node");
        px_preq_free(q);
        return;
    }
    const char *plp_err = px_plp_prepare(q);
    if (plp_err != NULL) {
        reply_error(req, 400, "BadRequestError", plp_err);
        px_preq_free(q);
        return;
    }
    px_migrate_prepare(q);
    /* affinity key (prefix-affinity only): the start of the prompt (text or token ids) or of the
     * chat messages */
    json_t *prompt = json_object_get(body, "prompt");
    if (prompt == NULL) {
        prompt = json_object_get(body, "messages");
    }
    char *ptext = strcmp(px->cfg.policy, "prefix-affinity") == 0
                      ? json_dumps(prompt != NULL ? prompt : json_null(), JSON_COMPACT | JSON_ENCODE_ANY)
                      : NULL;
    size_t plen = ptext != NULL ? strlen(ptext) : 0;
    size_t lim = (size_t)(px->cfg.affinity_prefix_chars > 0 ? px->cfg.affinity_prefix_chars : 1);
    q->affinity = ptext != NULL ? pd_hash64(ptext, plen < lim ? plen : lim, 0x6166) : 0;
    free(ptext);
    uint64_t rnd = 0;
    if (getrandom(&rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        rnd = pd_time_now_ns();
    }
    snprintf(q->transfer_id, sizeof(q->transfer_id), "xfer-%016llx", (unsigned long long)rnd);
    const char *xid = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Request-Id");
    snprintf(q->req_id, sizeof(q->req_id), "%s", pd_api_request_id_ok(xid) ? xid : q->transfer_id + 5);
    q->next = px->inflight;
    if (px->inflight != NULL) {
        px->inflight->prev = q;
    }
    px->inflight = q;
    q->client_conn = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(q->client_conn, on_client_close, q);
    q->client_watch = pd_client_watch_start(q->px->base, q->client_conn);
    /* the mode is the prefill pool's (from /pd/info); push needs a prefill whose KV address is known */
    for (int i = 0; i < px->num_nodes; i++) {
        const node_t *n = &px->nodes[i];
        if (n->prefill && n->healthy && !n->removed && n->info_ok) {
            q->push = strcmp(n->mode, "push") == 0;
            break;
        }
    }
    px_route_begin(q);
}

typedef struct fwd_ctx {
    proxy_t *px;
    struct evhttp_request *client;
    struct evhttp_connection *conn;
} fwd_ctx_t;

/* A forwarded request's answer, relayed as it is (status, JSON body). */
static void on_forward_done(struct evhttp_request *r, void *arg)
{
    fwd_ctx_t *m = arg;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code == 0) {
        reply_error(m->client, 502, "BadGatewayError", "the node did not answer");
    } else {
        evhttp_add_header(evhttp_request_get_output_headers(m->client), "Content-Type", "application/json");
        pd_http_send_reply(m->client, code, code == 200 ? "OK" : "Error", evhttp_request_get_input_buffer(r));
    }
    px_release_conn(m->px, m->conn);
    free(m);
}

/* Sends a request that any node answers the same (models, tokenize) to a healthy decode node. */
static void forward(proxy_t *px, struct evhttp_request *req, enum evhttp_cmd_type method, const char *path,
                    bool with_body)
{
    json_t *body = NULL;
    if (with_body) {
        struct evbuffer *in = evhttp_request_get_input_buffer(req);
        size_t len = evbuffer_get_length(in);
        json_error_t jerr;
        body =
            len <= px->cfg.max_request_bytes
                ? json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, &jerr)
                : NULL;
        if (!json_is_object(body)) {
            json_decref(body);
            reply_error(req, 400, "BadRequestError", "the body is not a JSON object (or too large)");
            return;
        }
    }
    bool none[MAX_NODES] = {false};
    node_t *d = px_pick(px, false, none, 0, NULL, 0, false);
    fwd_ctx_t *m = d != NULL ? calloc(1, sizeof(*m)) : NULL;
    if (m == NULL) {
        json_decref(body);
        reply_error(req, 503, "ServiceUnavailableError", "no healthy decode node");
        return;
    }
    m->px = px;
    m->client = req;
    m->conn = px_upstream(px, d, method == EVHTTP_REQ_HEAD ? EVHTTP_REQ_GET : method, path,
                          evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization"), NULL,
                          body, on_forward_done, NULL, NULL, m);
    json_decref(body);
    if (m->conn == NULL) {
        free(m);
        reply_error(req, 502, "BadGatewayError", "cannot reach the decode node");
    }
}

static void handle_metrics(proxy_t *px, struct evhttp_request *req)
{
    px_refresh_router_gauges(px);
    if (px->zmq_ctx != NULL) {
        px_kv_events_poll(px); /* the index gauges as of now */
    }
    size_t len = 0;
    char *text = pd_metrics_render(px->metrics, &len);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, text, len);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    pd_http_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
    free(text);
}

/* A client's reply is written out: its connection waits for its next request (http_guard.h). */
static void on_reply_written(struct evhttp_request *req, void *arg)
{
    proxy_t *px = arg;
    pd_http_guard_reply_done(px->guard, req);
}

void px_on_request(struct evhttp_request *req, void *arg)
{
    proxy_t *px = arg;
    pd_http_guard_request(px->guard, req); /* a whole request arrived on its connection */
    evhttp_request_set_on_complete_cb(req, on_reply_written, px);
    pd_http_no_delay(req);
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri != NULL ? evhttp_uri_get_path(uri) : NULL;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    bool get = cmd == EVHTTP_REQ_GET || cmd == EVHTTP_REQ_HEAD; /* HEAD: same answer, no body */
    bool post = cmd == EVHTTP_REQ_POST;
    bool keyed = path != NULL && (strncmp(path, "/v1/", 4) == 0 || strcmp(path, "/tokenize") == 0 ||
                                  strcmp(path, "/detokenize") == 0);
    if (path == NULL) {
        reply_error(req, 400, "BadRequestError", "malformed request URI");
    } else if (keyed && !pd_api_bearer_ok(pd_http_sole_header(req, "Authorization"), px->cfg.api_key)) {
        reply_error(req, 401, "AuthenticationError", "invalid or missing API key");
    } else if (strcmp(path, "/v1/completions") == 0 || strcmp(path, "/v1/chat/completions") == 0) {
        if (!post) {
            reply_error(req, 405, "MethodNotAllowedError", "use POST");
        } else if (px->stopping) {
            reply_error(req, 503, "ServiceUnavailableError", "the proxy is shutting down");
        } else {
            handle_completions(px, req,
                               path[4] == 'c' && path[5] == 'h' ? "/v1/chat/completions" : "/v1/completions");
        }
    } else if (strcmp(path, "/v1/models") == 0 || strncmp(path, "/v1/models/", 11) == 0) {
        if (!get) {
            reply_error(req, 405, "MethodNotAllowedError", "use GET");
        } else {
            forward(px, req, cmd, path, false);
        }
    } else if (strcmp(path, "/tokenize") == 0 || strcmp(path, "/detokenize") == 0) {
        if (!post) {
            reply_error(req, 405, "MethodNotAllowedError", "use POST");
        } else {
            forward(px, req, cmd, path, true);
        }
    } else if ((strcmp(path, "/health") == 0 && get) || (strcmp(path, "/ping") == 0 && (get || post))) {
        bool ok = px_pool_ok(px, true) && px_pool_ok(px, false) && !px->stopping;
        json_t *j = json_pack("{s:s, s:b, s:b}", "status", ok ? "ok" : "degraded", "prefill",
                              px_pool_ok(px, true), "decode", px_pool_ok(px, false));
        reply_json(req, ok ? 200 : 503, j);
        json_decref(j);
    } else if (strcmp(path, "/version") == 0 && get) {
        json_t *j = json_pack("{s:s}", "version", PD_VERSION);
        reply_json(req, 200, j);
        json_decref(j);
    } else if (strcmp(path, "/metrics") == 0 && get) {
        handle_metrics(px, req);
    } else if (strcmp(path, "/health") == 0 || strcmp(path, "/ping") == 0 || strcmp(path, "/version") == 0 ||
               strcmp(path, "/metrics") == 0) {
        reply_error(req, 405, "MethodNotAllowedError", "use GET");
    } else {
        reply_error(req, 404, "NotFoundError", "no such route");
    }
}
