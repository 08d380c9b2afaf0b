/* server/http_server.c — libevent HTTP front: routing, OpenAI completions, SSE, metrics, drain. */
#define _GNU_SOURCE
#include "server/http_server.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/thread.h>
#include <event2/util.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "common/log.h"
#include "common/strmap.h"
#include "common/time.h"
#include "server/openai.h"

/* One in-flight completion. */
typedef struct creq creq_t;
struct creq {
    pd_http_server_t *srv;
    struct evhttp_request *req; /* NULL once the client went away */
    char id[48];
    pd_completion_req_t in;
    bool started, done;
    char *text;
    size_t text_len, text_cap;
    int32_t *ids;
    int32_t num_ids, cap_ids;
    json_t *lp; /* OpenAI logprobs object being built, or NULL */
    double arrival, first_token, last_token;
    int64_t created;
    creq_t *prev, *next; /* in-flight list */
};

typedef struct srv_metrics {
    pd_metric_t *running, *waiting, *waiting_remote, *kv_usage, *blocks_free, *blocks_cached, *blocks_used;
    pd_metric_t *prefix_queries, *prefix_hits, *prompt_tokens, *generation_tokens, *preemptions;
    pd_metric_t *ttft, *itl, *e2e, *queue, *step;
    pd_metric_t *success[4]; /* stop, length, abort, error */
    pd_metric_t *http_errors;
    uint64_t seen_prefix_queries, seen_prefix_hits, seen_prompt, seen_gen, seen_preempt, seen_steps;
} srv_metrics_t;

struct pd_http_server {
    pd_http_config_t cfg;
    char model_name[256];
    pd_engine_t *engine;
    pd_metrics_t *metrics;
    srv_metrics_t m;
    struct event_base *base;
    struct evhttp *http;
    struct event *wake, *sigterm, *sigint, *drain_timer;
    int port;
    uint64_t next_id;
    creq_t *inflight;
    int num_inflight;
    int unsent; /* replies handed to libevent and not yet written out */
    bool draining;
    double drain_deadline;
    bool aborted_rest;
    int64_t started_at;
};

void pd_http_config_defaults(pd_http_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->max_request_bytes = 4u << 20;
    c->drain_timeout = 30.0;
    c->max_json_depth = 32;
}

size_t pd_http_flags(pd_http_config_t *c, pd_flag_t *out, size_t max)
{
    pd_flag_t f[] = {
        {"host", PD_FLAG_STR, &c->host, "address to listen on", NULL},
        {"port", PD_FLAG_INT, &c->port, "HTTP port (0 = any free port, see --port-file)", NULL},
        {"port-file", PD_FLAG_STR, &c->port_file, "write the bound port to this file", NULL},
        {"api-key", PD_FLAG_STR, &c->api_key, "require 'Authorization: Bearer KEY' on /v1/ routes", NULL},
        {"max-request-bytes", PD_FLAG_SIZE, &c->max_request_bytes, "largest request body accepted", NULL},
        {"drain-timeout", PD_FLAG_DOUBLE, &c->drain_timeout, "seconds in-flight requests get after SIGTERM",
         NULL},
        {"served-model-name", PD_FLAG_STR, &c->served_model_name, "model name in the API (default: dir name)",
         NULL},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    n = n < max ? n : max;
    memcpy(out, f, n * sizeof(pd_flag_t));
    return n;
}

/* ------------------------------------------------------------------ replies */

static void on_reply_sent(struct evhttp_request *req, void *arg)
{
    pd_http_server_t *s = arg;
    s->unsent--;
}

/* Every reply is counted until libevent has written it, so a drain does not exit with replies
 * still sitting in a connection's output buffer. */
static void track_reply(pd_http_server_t *s, struct evhttp_request *req)
{
    s->unsent++;
    evhttp_request_set_on_complete_cb(req, on_reply_sent, s);
}

static void send_json(pd_http_server_t *s, struct evhttp_request *req, int status, json_t *body)
{
    track_reply(s, req);
    char *text = json_dumps(body, JSON_COMPACT);
    struct evbuffer *buf = evbuffer_new();
    evbuffer_add(buf, text, strlen(text));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    const char *reason = status == 200   ? "OK"
                         : status == 400 ? "Bad Request"
                         : status == 401 ? "Unauthorized"
                         : status == 404 ? "Not Found"
                         : status == 405 ? "Method Not Allowed"
                         : status == 413 ? "Payload Too Large"
                         : status == 503 ? "Service Unavailable"
                                         : "Internal Server Error";
    evhttp_send_reply(req, status, reason, buf);
    evbuffer_free(buf);
    free(text);
}

static void send_error(pd_http_server_t *s, struct evhttp_request *req, const pd_http_error_t *err)
{
    json_t *j = pd_openai_error_json(err);
    send_json(s, req, err->status, j);
    json_decref(j);
    pd_metric_inc(s->m.http_errors, 1);
}

static void reply_error(pd_http_server_t *s, struct evhttp_request *req, int status, const char *type,
                        const char *param, const char *msg)
{
    pd_http_error_t e;
    pd_http_error_set(&e, status, type, param, "%s", msg);
    send_error(s, req, &e);
}

/* ------------------------------------------------------------------ completions: state */

static void creq_free(creq_t *c)
{
    pd_http_server_t *s = c->srv;
    if (c->prev != NULL) {
        c->prev->next = c->next;
    } else if (s->inflight == c) {
        s->inflight = c->next;
    }
    if (c->next != NULL) {
        c->next->prev = c->prev;
    }
    s->num_inflight--;
    pd_completion_req_free(&c->in);
    json_decref(c->lp);
    free(c->text);
    free(c->ids);
    free(c);
}

static void on_client_close(struct evhttp_connection *conn, void *arg)
{
    creq_t *c = arg;
    if (c->done || c->req == NULL) {
        return;
    }
    pd_log_info("client of %s disconnected; aborting it", c->id);
    c->req = NULL;
    pd_engine_abort_async(c->srv->engine, c->id);
}

static void detach_close_cb(creq_t *c)
{
    if (c->req != NULL) {
        struct evhttp_connection *conn = evhttp_request_get_connection(c->req);
        if (conn != NULL) {
            evhttp_connection_set_closecb(conn, NULL, NULL);
        }
    }
}

static json_t *usage_json(const pd_engine_output_t *o, const creq_t *c)
{
    int32_t completion = o->finish_reason != NULL ? o->completion_tokens : c->num_ids;
    json_t *u = json_pack("{s:i, s:i, s:i}", "prompt_tokens", c->in.num_prompt, "completion_tokens",
                          completion, "total_tokens", c->in.num_prompt + completion);
    if (o->cached_tokens > 0) {
        json_object_set_new(u, "prompt_tokens_details",
                            json_pack("{s:i}", "cached_tokens", o->cached_tokens));
    }
    return u;
}

static json_t *ids_json(const int32_t *ids, int32_t n)
{
    json_t *a = json_array();
    for (int32_t i = 0; i < n; i++) {
        json_array_append_new(a, json_integer(ids[i]));
    }
    return a;
}

/* The logprobs entries of one output appended to lp (OpenAI completions format). */
static void logprobs_append(pd_http_server_t *s, json_t *lp, const pd_engine_output_t *o, size_t text_offset)
{
    const pd_tokenizer_t *tok = pd_engine_tokenizer(s->engine);
    char *t = NULL;
    size_t tl = 0;
    if (pd_tokenizer_decode(tok, &o->token, 1, false, &t, &tl) != PD_OK) {
        t = strdup("");
        tl = 0;
    }
    json_array_append_new(json_object_get(lp, "tokens"), pd_json_string_lossy(t, tl));
    json_array_append_new(json_object_get(lp, "token_logprobs"), json_real(o->logprob));
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)text_offset));
    json_t *top = json_object();
    for (int32_t k = 0; k < o->num_top; k++) {
        char *tt = NULL;
        size_t ttl = 0;
        if (pd_tokenizer_decode(tok, &o->top_ids[k], 1, false, &tt, &ttl) == PD_OK) {
            json_t *key = pd_json_string_lossy(tt, ttl);
            if (json_object_get(top, json_string_value(key)) == NULL) {
                json_object_set_new(top, json_string_value(key), json_real(o->top_logprobs[k]));
            }
            json_decref(key);
            free(tt);
        }
    }
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
    free(t);
}

static json_t *new_logprobs(void)
{
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

static json_t *choice_json(const creq_t *c, const char *text, size_t len, json_t *lp, const char *finish)
{
    json_t *ch = json_pack("{s:i, s:o, s:o, s:o, s:n}", "index", 0, "text", pd_json_string_lossy(text, len),
                           "logprobs", lp != NULL ? json_incref(lp) : json_null(), "finish_reason",
                           finish != NULL ? json_string(finish) : json_null(), "stop_reason");
    return ch;
}

/* ------------------------------------------------------------------ completions: outputs */

static void observe_token(pd_http_server_t *s, creq_t *c)
{
    double now = pd_time_now_s();
    if (c->first_token == 0) {
        c->first_token = now;
        pd_metric_observe(s->m.ttft, now - c->arrival);
    } else {
        pd_metric_observe(s->m.itl, now - c->last_token);
    }
    c->last_token = now;
}

static void finish_metrics(pd_http_server_t *s, const pd_engine_output_t *o)
{
    static const char *reasons[4] = {"stop", "length", "abort", "error"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(o->finish_reason, reasons[i]) == 0) {
            pd_metric_inc(s->m.success[i], 1);
        }
    }
    pd_metric_observe(s->m.e2e, o->e2e);
    pd_metric_observe(s->m.queue, o->queue_time);
}

static void stream_chunk(creq_t *c, json_t *chunk)
{
    char *text = json_dumps(chunk, JSON_COMPACT);
    struct evbuffer *buf = evbuffer_new();
    evbuffer_add_printf(buf, "data: %s\n\n", text);
    evhttp_send_reply_chunk(c->req, buf);
    evbuffer_free(buf);
    free(text);
}

static void handle_output(pd_http_server_t *s, const pd_engine_output_t *o)
{
    creq_t *c = o->user;
    if (c == NULL || c->done) {
        return;
    }
    size_t offset = c->text_len;
    if (o->token >= 0) {
        observe_token(s, c);
        if (c->num_ids == c->cap_ids) {
            c->cap_ids = c->cap_ids ? 2 * c->cap_ids : 64;
            c->ids = realloc(c->ids, (size_t)c->cap_ids * sizeof(int32_t));
        }
        c->ids[c->num_ids++] = o->token;
        if (c->lp != NULL) {
            logprobs_append(s, c->lp, o, offset);
        }
    }
    if (o->text_len > 0) {
        if (c->text_len + o->text_len + 1 > c->text_cap) {
            c->text_cap = (c->text_len + o->text_len + 1) * 2;
            c->text = realloc(c->text, c->text_cap);
        }
        memcpy(c->text + c->text_len, o->text, o->text_len);
        c->text_len += o->text_len;
        c->text[c->text_len] = '\0';
    }
    bool finished = o->finish_reason != NULL;
    if (finished) {
        c->done = true;
        finish_metrics(s, o);
    }
    if (c->req == NULL) { /* client gone: only wait for the final output */
        if (finished) {
            creq_free(c);
        }
        return;
    }
    if (c->in.stream) {
        if (!c->started) {
            struct evkeyvalq *h = evhttp_request_get_output_headers(c->req);
            evhttp_add_header(h, "Content-Type", "text/event-stream");
            evhttp_add_header(h, "Cache-Control", "no-cache");
            evhttp_send_reply_start(c->req, 200, "OK");
            c->started = true;
        }
        if (finished && strcmp(o->finish_reason, "error") == 0 && o->completion_tokens == 0 &&
            o->text_len > 0) {
            pd_http_error_t e;
            pd_http_error_set(&e, 500, "InternalServerError", NULL, "%s", o->text);
            json_t *ej = pd_openai_error_json(&e);
            stream_chunk(c, ej);
            json_decref(ej);
        } else if (o->token >= 0 || o->text_len > 0 || finished) {
            json_t *lp = NULL;
            if (c->lp != NULL) { /* this chunk's entries only */
                lp = new_logprobs();
                if (o->token >= 0) {
                    logprobs_append(s, lp, o, offset);
                }
            }
            json_t *choice = choice_json(c, o->text, o->text_len, lp, o->finish_reason);
            json_decref(lp);
            if (c->in.return_token_ids) {
                json_object_set_new(choice, "token_ids",
                                    o->token >= 0 ? ids_json(&o->token, 1) : json_array());
                if (c->num_ids <= 1 && o->token >= 0) {
                    json_object_set_new(choice, "prompt_token_ids", ids_json(c->in.prompt, c->in.num_prompt));
                }
            }
            json_t *chunk =
                json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", c->id, "object", "text_completion", "created",
                          (json_int_t)c->created, "model", s->model_name, "choices", choice);
            if (finished && o->kv_transfer_params != NULL) {
                json_object_set_new(chunk, "kv_transfer_params", json_loads(o->kv_transfer_params, 0, NULL));
            }
            stream_chunk(c, chunk);
            json_decref(chunk);
        }
        if (finished) {
            if (c->in.include_usage) {
                json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", c->id, "object",
                                      "text_completion", "created", (json_int_t)c->created, "model",
                                      s->model_name, "choices", "usage", usage_json(o, c));
                stream_chunk(c, u);
                json_decref(u);
            }
            struct evbuffer *buf = evbuffer_new();
            evbuffer_add_printf(buf, "data: [DONE]\n\n");
            evhttp_send_reply_chunk(c->req, buf);
            evbuffer_free(buf);
            detach_close_cb(c);
            track_reply(s, c->req);
            evhttp_send_reply_end(c->req);
            c->req = NULL;
            creq_free(c);
        }
        return;
    }
    if (!finished) {
        return;
    }
    detach_close_cb(c);
    if (strcmp(o->finish_reason, "error") == 0 && c->num_ids == 0) {
        reply_error(s, c->req, 500, "InternalServerError", NULL,
                    o->text_len > 0 ? o->text : "generation failed");
    } else {
        json_t *choice = choice_json(c, c->text, c->text_len, c->lp, o->finish_reason);
        if (c->in.return_token_ids) {
            json_object_set_new(choice, "prompt_token_ids", ids_json(c->in.prompt, c->in.num_prompt));
            json_object_set_new(choice, "token_ids", ids_json(c->ids, c->num_ids));
        }
        json_t *body = json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", c->id, "object", "text_completion",
                                 "created", (json_int_t)c->created, "model", s->model_name, "choices", choice,
                                 "usage", usage_json(o, c));
        if (o->kv_transfer_params != NULL) {
            json_object_set_new(body, "kv_transfer_params", json_loads(o->kv_transfer_params, 0, NULL));
        } else {
            json_object_set_new(body, "kv_transfer_params", json_null());
        }
        send_json(s, c->req, 200, body);
        json_decref(body);
    }
    c->req = NULL;
    creq_free(c);
}

/* Engine thread → loop thread. */
static void on_engine_notify(void *ctx)
{
    pd_http_server_t *s = ctx;
    event_active(s->wake, EV_READ, 0);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    pd_http_server_t *s = arg;
    pd_engine_output_t *outs = pd_engine_take_outputs(s->engine);
    for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
        handle_output(s, o);
    }
    pd_engine_output_free(outs);
}

/* ------------------------------------------------------------------ routes */

static bool authorized(pd_http_server_t *s, struct evhttp_request *req)
{
    if (s->cfg.api_key == NULL || s->cfg.api_key[0] == '\0') {
        return true;
    }
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    return h != NULL && strncmp(h, "Bearer ", 7) == 0 && strcmp(h + 7, s->cfg.api_key) == 0;
}

static void handle_completions(pd_http_server_t *s, struct evhttp_request *req)
{
    if (s->draining) {
        reply_error(s, req, 503, "ServiceUnavailableError", NULL, "the server is shutting down");
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > s->cfg.max_request_bytes) {
        char msg[128];
        snprintf(msg, sizeof(msg), "request body of %zu bytes exceeds the %zu byte limit", len,
                 s->cfg.max_request_bytes);
        reply_error(s, req, 413, "RequestTooLargeError", NULL, msg);
        return;
    }
    char *body = malloc(len + 1);
    if (body == NULL) {
        reply_error(s, req, 500, "InternalServerError", NULL, "out of memory");
        return;
    }
    evbuffer_copyout(in, body, len);
    body[len] = '\0';
    creq_t *c = calloc(1, sizeof(*c));
    pd_http_error_t err;
    const pd_model_config_t *mc = pd_engine_model_config(s->engine);
    pd_openai_limits_t lim = {s->model_name, mc->vocab_size, pd_engine_max_model_len(s->engine),
                              s->cfg.max_json_depth};
    bool ok = c != NULL &&
              pd_openai_parse_completion(body, len, pd_engine_tokenizer(s->engine), &lim, &c->in, &err);
    free(body);
    if (!ok) {
        free(c);
        send_error(s, req, &err);
        return;
    }
    c->srv = s;
    c->req = req;
    c->arrival = pd_time_now_s();
    c->created = (int64_t)time(NULL);
    snprintf(c->id, sizeof(c->id), "cmpl-%llx%08llx", (unsigned long long)s->started_at,
             (unsigned long long)++s->next_id);
    if (c->in.logprobs >= 0) {
        c->lp = new_logprobs();
    }
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = c->id;
    rq.prompt = c->in.prompt;
    rq.num_prompt = c->in.num_prompt;
    rq.params = c->in.params;
    for (int32_t i = 0; i < c->in.num_stop; i++) {
        rq.stop[i] = c->in.stop[i];
    }
    rq.num_stop = c->in.num_stop;
    rq.kv_transfer_params = c->in.kv_transfer_params;
    rq.user = c;
    if (pd_engine_submit(s->engine, &rq) != PD_OK) {
        pd_completion_req_free(&c->in);
        json_decref(c->lp);
        free(c);
        reply_error(s, req, 503, "ServiceUnavailableError", NULL, "the engine's queue is full; retry later");
        return;
    }
    c->next = s->inflight;
    if (s->inflight != NULL) {
        s->inflight->prev = c;
    }
    s->inflight = c;
    s->num_inflight++;
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_client_close, c);
}

static void handle_models(pd_http_server_t *s, struct evhttp_request *req)
{
    json_t *j = json_pack("{s:s, s:[{s:s, s:s, s:I, s:s, s:i}]}", "object", "list", "data", "id",
                          s->model_name, "object", "model", "created", (json_int_t)s->started_at, "owned_by",
                          "pdserve", "max_model_len", pd_engine_max_model_len(s->engine));
    send_json(s, req, 200, j);
    json_decref(j);
}

static void refresh_gauges(pd_http_server_t *s)
{
    pd_engine_stats_t st;
    pd_engine_get_stats(s->engine, &st);
    srv_metrics_t *m = &s->m;
    pd_metric_set(m->running, st.num_running);
    pd_metric_set(m->waiting, st.num_waiting + st.num_queued);
    pd_metric_set(m->waiting_remote, st.num_waiting_for_remote_kv);
    pd_metric_set(m->kv_usage, st.kv_usage);
    pd_metric_set(m->blocks_free, st.blocks_free);
    pd_metric_set(m->blocks_cached, st.blocks_cached_free);
    pd_metric_set(m->blocks_used, st.blocks_used);
    /* engine counters are monotonic: add what is new since the last scrape */
    pd_metric_inc(m->prefix_queries, (double)(st.prefix_queries - m->seen_prefix_queries));
    pd_metric_inc(m->prefix_hits, (double)(st.prefix_hits - m->seen_prefix_hits));
    pd_metric_inc(m->prompt_tokens, (double)(st.prompt_tokens - m->seen_prompt));
    pd_metric_inc(m->generation_tokens, (double)(st.generation_tokens - m->seen_gen));
    pd_metric_inc(m->preemptions, (double)(st.preemptions - m->seen_preempt));
    m->seen_prefix_queries = st.prefix_queries;
    m->seen_prefix_hits = st.prefix_hits;
    m->seen_prompt = st.prompt_tokens;
    m->seen_gen = st.generation_tokens;
    m->seen_preempt = st.preemptions;
}

static void handle_metrics(pd_http_server_t *s, struct evhttp_request *req)
{
    refresh_gauges(s);
    size_t len = 0;
    char *text = pd_metrics_render(s->metrics, &len);
    struct evbuffer *buf = evbuffer_new();
    evbuffer_add(buf, text, len);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    track_reply(s, req);
    evhttp_send_reply(req, 200, "OK", buf);
    evbuffer_free(buf);
    free(text);
}

static void on_request(struct evhttp_request *req, void *arg)
{
    pd_http_server_t *s = arg;
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri != NULL ? evhttp_uri_get_path(uri) : NULL;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    if (path == NULL) {
        reply_error(s, req, 400, "BadRequestError", NULL, "malformed request URI");
        return;
    }
    struct route {
        const char *path;
        enum evhttp_cmd_type method;
        void (*fn)(pd_http_server_t *, struct evhttp_request *);
    };
    static const struct route routes[] = {
        {"/v1/completions", EVHTTP_REQ_POST, handle_completions},
        {"/v1/models", EVHTTP_REQ_GET, handle_models},
        {"/metrics", EVHTTP_REQ_GET, handle_metrics},
    };
    if (strcmp(path, "/pd/info") == 0 && s->cfg.info_json != NULL && cmd == EVHTTP_REQ_GET) {
        struct evbuffer *buf = evbuffer_new();
        evbuffer_add(buf, s->cfg.info_json, strlen(s->cfg.info_json));
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
        track_reply(s, req);
        evhttp_send_reply(req, 200, "OK", buf);
        evbuffer_free(buf);
        return;
    }
    if (strcmp(path, "/health") == 0) {
        if (cmd != EVHTTP_REQ_GET) {
            reply_error(s, req, 405, "MethodNotAllowedError", NULL, "use GET");
            return;
        }
        json_t *j = json_pack("{s:s}", "status", s->draining ? "draining" : "ok");
        send_json(s, req, s->draining ? 503 : 200, j);
        json_decref(j);
        return;
    }
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        if (strcmp(path, routes[i].path) != 0) {
            continue;
        }
        if (cmd != routes[i].method) {
            reply_error(s, req, 405, "MethodNotAllowedError", NULL,
                        routes[i].method == EVHTTP_REQ_POST ? "use POST" : "use GET");
            return;
        }
        if (strncmp(path, "/v1/", 4) == 0 && !authorized(s, req)) {
            reply_error(s, req, 401, "AuthenticationError", NULL, "invalid or missing API key");
            return;
        }
        routes[i].fn(s, req);
        return;
    }
    reply_error(s, req, 404, "NotFoundError", NULL, "no such route");
}

/* ------------------------------------------------------------------ lifecycle */

static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    pd_http_server_t *s = arg;
    if (s->num_inflight == 0 && s->unsent <= 0) {
        pd_log_info("drain complete");
        event_base_loopexit(s->base, NULL);
        return;
    }
    if (s->num_inflight == 0) {
        if (pd_time_now_s() >= s->drain_deadline) {
            pd_log_warn("drain: %d replies not written by the deadline; exiting", s->unsent);
            event_base_loopexit(s->base, NULL);
        }
        return;
    }
    if (!s->aborted_rest && pd_time_now_s() >= s->drain_deadline) {
        pd_log_warn("drain timeout: aborting %d in-flight requests", s->num_inflight);
        for (creq_t *c = s->inflight; c != NULL; c = c->next) {
            pd_engine_abort_async(s->engine, c->id);
        }
        s->aborted_rest = true;
        s->drain_deadline = pd_time_now_s() + 5.0; /* bounded wait for the abort outputs */
    } else if (s->aborted_rest && pd_time_now_s() >= s->drain_deadline) {
        pd_log_error("drain: %d requests did not end after abort; exiting anyway", s->num_inflight);
        event_base_loopexit(s->base, NULL);
    }
}

void pd_http_server_shutdown(pd_http_server_t *s)
{
    if (s->draining) {
        return;
    }
    s->draining = true;
    s->drain_deadline = pd_time_now_s() + s->cfg.drain_timeout;
    pd_log_info("draining: %d requests in flight, up to %.1f s", s->num_inflight, s->cfg.drain_timeout);
    struct timeval tv = {0, 50000};
    event_add(s->drain_timer, &tv);
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    pd_log_info("received %s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    pd_http_server_shutdown(arg);
}

static void metrics_register(pd_http_server_t *s)
{
    srv_metrics_t *m = &s->m;
    pd_metrics_t *r = s->metrics;
    const double *lb = PD_LATENCY_BUCKETS;
    int nb = PD_LATENCY_NUM_BUCKETS;
    m->running = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:num_requests_running", "Requests in the running set.",
                                NULL, NULL, 0);
    m->waiting = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:num_requests_waiting",
                                "Requests waiting to be scheduled.", NULL, NULL, 0);
    m->waiting_remote = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:num_requests_waiting_for_remote_kv",
                                       "Requests waiting for KV from a remote peer.", NULL, NULL, 0);
    m->kv_usage = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:kv_cache_usage_perc",
                                 "Fraction of KV blocks in use (0-1).", NULL, NULL, 0);
    m->blocks_free = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:kv_blocks_free",
                                    "Free KV blocks without cached content.", NULL, NULL, 0);
    m->blocks_cached = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:kv_blocks_cached_free",
                                      "Free KV blocks that still hold a cached prefix.", NULL, NULL, 0);
    m->blocks_used = pd_metrics_add(r, PD_METRIC_GAUGE, "pd:kv_blocks_used",
                                    "KV blocks referenced by requests.", NULL, NULL, 0);
    m->prefix_queries = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:prefix_cache_queries_total",
                                       "Prompt tokens looked up in the prefix cache.", NULL, NULL, 0);
    m->prefix_hits = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:prefix_cache_hits_total",
                                    "Prompt tokens found in the prefix cache.", NULL, NULL, 0);
    m->prompt_tokens = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:prompt_tokens_total",
                                      "Prompt tokens admitted.", NULL, NULL, 0);
    m->generation_tokens = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:generation_tokens_total",
                                          "Tokens generated.", NULL, NULL, 0);
    m->preemptions = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:num_preemptions_total",
                                    "Preemptions by recompute.", NULL, NULL, 0);
    m->ttft = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "pd:time_to_first_token_seconds", "Time to first token.",
                             NULL, lb, nb);
    m->itl = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "pd:inter_token_latency_seconds", "Time between tokens.",
                            NULL, lb, nb);
    m->e2e = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "pd:e2e_request_latency_seconds",
                            "Request latency end to end.", NULL, lb, nb);
    m->queue = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "pd:request_queue_time_seconds",
                              "Time from arrival to first schedule.", NULL, lb, nb);
    static const char *labels[4] = {"finished_reason=stop", "finished_reason=length", "finished_reason=abort",
                                    "finished_reason=error"};
    for (int i = 0; i < 4; i++) {
        m->success[i] = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:request_success_total",
                                       "Finished requests by reason.", labels[i], NULL, 0);
    }
    m->http_errors = pd_metrics_add(r, PD_METRIC_COUNTER, "pd:http_errors_total",
                                    "Requests answered with an error.", NULL, NULL, 0);
}

pd_status_t pd_http_server_create(const pd_http_config_t *cfg, pd_engine_t *engine, pd_metrics_t *metrics,
                                  pd_http_server_t **srv_out)
{
    static bool threads_enabled;
    if (!threads_enabled) {
        evthread_use_pthreads(); /* event_active from the engine thread */
        threads_enabled = true;
    }
    pd_http_server_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    s->cfg = *cfg;
    s->engine = engine;
    s->metrics = metrics;
    s->started_at = (int64_t)time(NULL);
    snprintf(s->model_name, sizeof(s->model_name), "%s",
             cfg->served_model_name != NULL ? cfg->served_model_name : pd_engine_model_name(engine));
    metrics_register(s);
    s->base = event_base_new();
    s->http = s->base != NULL ? evhttp_new(s->base) : NULL;
    if (s->http == NULL) {
        pd_http_server_destroy(s);
        return PD_ERR_NO_MEMORY;
    }
    /* libevent answers bodies far over the limit itself; between the limit and 4× it we answer
     * with an OpenAI-shaped 413 */
    evhttp_set_max_body_size(s->http, (ev_ssize_t)(cfg->max_request_bytes * 4 + 4096));
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_PUT |
                                            EVHTTP_REQ_DELETE | EVHTTP_REQ_HEAD | EVHTTP_REQ_OPTIONS |
                                            EVHTTP_REQ_PATCH);
    evhttp_set_gencb(s->http, on_request, s);
    struct evhttp_bound_socket *bs =
        evhttp_bind_socket_with_handle(s->http, cfg->host, (ev_uint16_t)cfg->port);
    if (bs == NULL) {
        pd_log_error("http: cannot listen on %s:%d", cfg->host, cfg->port);
        pd_http_server_destroy(s);
        return PD_ERR_IO;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl);
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    s->wake = event_new(s->base, -1, 0, on_wake, s);
    s->sigterm = evsignal_new(s->base, SIGTERM, on_signal, s);
    s->sigint = evsignal_new(s->base, SIGINT, on_signal, s);
    s->drain_timer = event_new(s->base, -1, EV_PERSIST, on_drain_tick, s);
    event_add(s->sigterm, NULL);
    event_add(s->sigint, NULL);
    signal(SIGPIPE, SIG_IGN);
    *srv_out = s;
    return PD_OK;
}

int pd_http_server_port(const pd_http_server_t *s)
{
    return s->port;
}

pd_status_t pd_http_server_run(pd_http_server_t *s)
{
    pd_status_t st = pd_engine_start(s->engine, on_engine_notify, s);
    if (st != PD_OK) {
        return st;
    }
    if (s->cfg.port_file != NULL) {
        char tmp[4096];
        snprintf(tmp, sizeof(tmp), "%s.tmp", s->cfg.port_file);
        FILE *f = fopen(tmp, "w");
        if (f == NULL || fprintf(f, "%d\n", s->port) < 0 || fclose(f) != 0 ||
            rename(tmp, s->cfg.port_file) != 0) {
            pd_log_error("cannot write the port file %s", s->cfg.port_file);
        }
    }
    pd_log_info("serving %s on http://%s:%d", s->model_name, s->cfg.host, s->port);
    event_base_dispatch(s->base);
    pd_engine_stop(s->engine);
    return PD_OK;
}

void pd_http_server_destroy(pd_http_server_t *s)
{
    if (s == NULL) {
        return;
    }
    while (s->inflight != NULL) {
        s->inflight->req = NULL;
        creq_free(s->inflight);
    }
    if (s->wake != NULL) {
        event_free(s->wake);
    }
    if (s->sigterm != NULL) {
        event_free(s->sigterm);
    }
    if (s->sigint != NULL) {
        event_free(s->sigint);
    }
    if (s->drain_timer != NULL) {
        event_free(s->drain_timer);
    }
    if (s->http != NULL) {
        evhttp_free(s->http);
    }
    if (s->base != NULL) {
        event_base_free(s->base);
    }
    free(s);
}
