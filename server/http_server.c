/* server/http_server.c — libevent HTTP front: routes, replies, the API endpoints around generation
 * (models, tokenize, detokenize, version, ping, health, metrics), drain. Generation requests are
 * completion.c's. */
#define _GNU_SOURCE
#include "server/http_server.h"

#include <arpa/inet.h>
#include <errno.h>
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
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/api_fields.h"
#include "common/http_guard.h"
#include "common/http_reply.h"
#include "common/log.h"
#include "common/strmap.h"
#include "common/time.h"
#include "common/version.h"
#include "model/generation_config.h"
#include "server/direct_stream.h"
#include "server/http_internal.h"
#include "server/tool_calls.h"

void pd_http_config_defaults(pd_http_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "127.0.0.1";
    c->port = 8000; /* vLLM's */
    c->max_request_bytes = 4u << 20;
    c->drain_timeout = 30.0;
    c->request_timeout = 30.0;
    c->max_json_depth = 32;
    c->direct_stream = true;
    static char env_key[512]; /* as vLLM: a Secret in the environment, not on the command line */
    c->api_key = pd_api_key_from_env("VLLM_API_KEY", env_key, sizeof(env_key));
}

size_t pd_http_flags(pd_http_config_t *c, pd_flag_t *out, size_t max)
{
    pd_flag_t f[] = {
        {"HTTP server (the OpenAI API)", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"host", PD_FLAG_STR, &c->host, "address to listen on", NULL},
        {"port", PD_FLAG_INT, &c->port, "HTTP port (vLLM's default; 0 = any free port, see --port-file)",
         NULL},
        {"port-file", PD_FLAG_STR, &c->port_file, "write the bound port to this file", NULL},
        {"api-key", PD_FLAG_STR, &c->api_key,
         "require 'Authorization: Bearer KEY' on /v1/ routes ($VLLM_API_KEY when not given, as vLLM)", NULL},
        {"max-request-bytes", PD_FLAG_SIZE, &c->max_request_bytes, "largest request body accepted", NULL},
        {"drain-timeout", PD_FLAG_DOUBLE, &c->drain_timeout, "seconds in-flight requests get after SIGTERM",
         NULL},
        {"http-request-timeout", PD_FLAG_DOUBLE, &c->request_timeout, PD_HTTP_GUARD_TIMEOUT_HELP, NULL},
        {"http-max-connections", PD_FLAG_INT, &c->max_connections, PD_HTTP_GUARD_MAX_CONNS_HELP ")", NULL},
        {"direct-stream", PD_FLAG_BOOL, &c->direct_stream,
         "the engine thread writes a plain stream's tokens to the client's socket as its step ends (one "
         "choice, no logprobs, tool parsing or echo); the HTTP loop writes everything else",
         NULL},
        {"served-model-name", PD_FLAG_STRS, &c->served_model_names,
         "model name(s) in the API: requests may name any, answers and metrics carry the first (default: "
         "dir name)",
         NULL},
        {"chat-template", PD_FLAG_STR, &c->chat_template,
         "chat template: a file, or the template text (default: chat_template.jinja, then "
         "tokenizer_config.json in the model directory)",
         NULL},
        {"enable-auto-tool-choice", PD_FLAG_BOOL, &c->enable_auto_tool_choice,
         "chat requests with tools and tool_choice \"auto\" (the default with tools) get the tool calls of "
         "the reply as tool_calls (needs --tool-call-parser; without it they are a 400)",
         NULL},
        {"tool-call-parser", PD_FLAG_CHOICE, &c->tool_call_parser,
         "the format the model writes tool calls in: hermes (<tool_call>, Hermes/Qwen), llama3_json (Llama "
         "3.x JSON), mistral ([TOOL_CALLS])",
         "hermes|llama3_json|mistral"},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    memcpy(out, f, (n < max ? n : max) * sizeof(f[0]));
    return n; /* all of them: more than max tells the caller its array is short */
}

/* ------------------------------------------------------------------ replies */

static void on_reply_sent(struct evhttp_request *req, void *arg)
{
    pd_http_server_t *s = arg;
    s->unsent--;
    pd_http_guard_reply_done(s->guard, req); /* the connection waits for its next request now */
}

/* Every reply is counted until libevent has written it, so a drain does not exit with replies
 * still sitting in a connection's output buffer. */
void pd_http_track_reply(pd_http_server_t *s, struct evhttp_request *req)
{
    s->unsent++;
    evhttp_request_set_on_complete_cb(req, on_reply_sent, s);
}

void pd_http_send_json(pd_http_server_t *s, struct evhttp_request *req, int status, json_t *body)
{
    pd_http_track_reply(s, req);
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
    pd_http_send_reply(req, status, reason, buf);
    evbuffer_free(buf);
    free(text);
}

void pd_http_send_error(pd_http_server_t *s, struct evhttp_request *req, const pd_http_error_t *err)
{
    json_t *j = pd_openai_error_json(err);
    pd_http_send_json(s, req, err->status, j);
    json_decref(j);
    pd_metric_inc(s->m.http_errors, 1);
}

void pd_http_reply_error(pd_http_server_t *s, struct evhttp_request *req, int status, const char *type,
                         const char *param, const char *msg)
{
    pd_http_error_t e;
    pd_http_error_set(&e, status, type, param, "%s", msg);
    pd_http_send_error(s, req, &e);
}

/* Engine thread → loop thread, after a step that made outputs: one write to an eventfd, and only
 * when the loop has taken the previous one. event_active would do the same under libevent's base
 * lock, and the loop, woken by its write, preempts the engine thread and then blocks on that lock:
 * two context switches of each per step instead of one of the loop's (issue 53). */
static void on_engine_notify(void *ctx)
{
    pd_http_server_t *s = ctx;
    if (!atomic_exchange(&s->wake_pending, true)) {
        uint64_t one = 1;
        ssize_t w = write(s->wake_fd, &one, sizeof(one)); /* nonblocking; a full counter still wakes */
        (void)w;
    }
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    pd_http_server_t *s = arg;
    (void)what;
    uint64_t n;
    ssize_t r = read(fd, &n, sizeof(n));
    (void)r;
    /* cleared before the outputs are taken: a step that ends after the take writes again */
    atomic_store(&s->wake_pending, false);
    pd_http_dispatch_outputs(s);
}

char *pd_http_read_body(pd_http_server_t *s, struct evhttp_request *req, size_t *len_out)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > s->cfg.max_request_bytes) {
        char msg[128];
        snprintf(msg, sizeof(msg), "request body of %zu bytes exceeds the %zu byte limit", len,
                 s->cfg.max_request_bytes);
        pd_http_reply_error(s, req, 413, "RequestTooLargeError", NULL, msg);
        return NULL;
    }
    char *body = malloc(len + 1);
    if (body == NULL) {
        pd_http_reply_error(s, req, 500, "InternalServerError", NULL, "out of memory");
        return NULL;
    }
    evbuffer_copyout(in, body, len);
    body[len] = '\0';
    *len_out = len;
    return body;
}

/* ------------------------------------------------------------------ routes */

static bool authorized(pd_http_server_t *s, struct evhttp_request *req)
{
    return pd_api_bearer_ok(pd_http_sole_header(req, "Authorization"), s->cfg.api_key);
}

static void handle_completions(pd_http_server_t *s, struct evhttp_request *req)
{
    pd_http_handle_generate(s, req, false);
}

static void handle_chat(pd_http_server_t *s, struct evhttp_request *req)
{
    pd_http_handle_generate(s, req, true);
}

/* Whether name is one of the --served-model-name aliases. */
static bool model_known(const pd_http_server_t *s, const char *name)
{
    for (int i = 0; i < s->num_aliases; i++) {
        if (strcmp(name, s->aliases[i]) == 0) {
            return true;
        }
    }
    return false;
}

static json_t *model_card(const pd_http_server_t *s, const char *id)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:i}", "id", id, "object", "model", "created",
                     (json_int_t)s->started_at, "owned_by", "pdserve", "root", pd_engine_model_dir(s->engine),
                     "max_model_len", pd_engine_max_model_len(s->engine));
}

static void handle_models(pd_http_server_t *s, struct evhttp_request *req)
{
    json_t *data = json_array(); /* every alias, as vLLM lists its served model names */
    for (int i = 0; i < s->num_aliases; i++) {
        json_array_append_new(data, model_card(s, s->aliases[i]));
    }
    json_t *j = json_pack("{s:s, s:o}", "object", "list", "data", data);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

/* GET /v1/models/{id} */
static void handle_model(pd_http_server_t *s, struct evhttp_request *req, const char *id)
{
    char *dec = evhttp_uridecode(id, 0, NULL);
    if (dec == NULL || !model_known(s, dec)) {
        pd_http_error_t e;
        pd_http_error_set(&e, 404, "NotFoundError", "model", "The model `%s` does not exist.",
                          dec ? dec : id);
        pd_http_send_error(s, req, &e);
    } else {
        json_t *j = model_card(s, dec);
        pd_http_send_json(s, req, 200, j);
        json_decref(j);
    }
    free(dec);
}

static json_t *ids_json(const int32_t *ids, int32_t n)
{
    json_t *a = json_array();
    for (int32_t i = 0; i < n; i++) {
        json_array_append_new(a, json_integer(ids[i]));
    }
    return a;
}

/* POST /tokenize (vLLM's shapes): {"prompt"} or {"messages", ...} → {count, max_model_len, tokens,
 * token_strs}. add_special_tokens defaults to true for a prompt and false for messages. */
static void handle_tokenize(pd_http_server_t *s, struct evhttp_request *req)
{
    size_t len = 0;
    char *body = pd_http_read_body(s, req, &len);
    if (body == NULL) {
        return;
    }
    pd_http_error_t err;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    free(body);
    const pd_tokenizer_t *tok = pd_engine_tokenizer(s->engine);
    char *text = NULL;
    size_t tl = 0;
    bool ok = true, chat = false, add_special = true, token_strs = false;
    if (!json_is_object(root)) {
        ok = pd_http_error_set(&err, 400, "BadRequestError", NULL, "the body must be a JSON object%s%s",
                               root == NULL ? ": " : "", root == NULL ? je.text : "");
    } else {
        json_t *model = json_object_get(root, "model");
        chat = json_object_get(root, "messages") != NULL;
        add_special = !chat;
        json_t *as = json_object_get(root, "add_special_tokens"),
               *rts = json_object_get(root, "return_token_strs");
        if (as != NULL && !json_is_null(as)) {
            add_special = json_is_true(as);
        }
        token_strs = json_is_true(rts);
        if (model != NULL && !json_is_null(model) &&
            (!json_is_string(model) || !model_known(s, json_string_value(model)))) {
            ok = pd_http_error_set(&err, 404, "NotFoundError", "model", "The model `%s` does not exist.",
                                   json_is_string(model) ? json_string_value(model) : "?");
        } else if (chat) {
            pd_chat_request_t cr;
            pd_chat_request_init(&cr, root);
            ok = pd_chat_render(s->chat, &cr, &text, &tl, &err);
        } else if (json_is_string(json_object_get(root, "prompt"))) {
            json_t *p = json_object_get(root, "prompt");
            text = malloc(json_string_length(p) + 1);
            memcpy(text, json_string_value(p), json_string_length(p) + 1);
            tl = json_string_length(p);
        } else {
            ok = pd_http_error_set(&err, 400, "BadRequestError", "prompt",
                                   "give 'prompt' (a string) or 'messages'");
        }
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (ok && pd_tokenizer_encode(tok, text, tl, add_special, &ids, &n) != PD_OK) {
        ok = pd_http_error_set(&err, 400, "BadRequestError", "prompt", "the text could not be tokenized");
    }
    free(text);
    json_decref(root);
    if (!ok) {
        pd_http_send_error(s, req, &err);
        return;
    }
    json_t *strs = token_strs ? json_array() : json_null();
    for (size_t i = 0; token_strs && i < n; i++) {
        size_t sl = 0;
        const char *ts = pd_tokenizer_token_str(tok, ids[i], &sl);
        json_array_append_new(strs, pd_json_string_lossy(ts != NULL ? ts : "", ts != NULL ? sl : 0));
    }
    json_t *j = json_pack("{s:i, s:i, s:o, s:o}", "count", (int)n, "max_model_len",
                          pd_engine_max_model_len(s->engine), "tokens", ids_json(ids, (int32_t)n),
                          "token_strs", strs);
    free(ids);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

/* POST /detokenize: {"tokens": [ids]} → {"prompt": text} (special tokens kept, as vLLM). */
static void handle_detokenize(pd_http_server_t *s, struct evhttp_request *req)
{
    size_t len = 0;
    char *body = pd_http_read_body(s, req, &len);
    if (body == NULL) {
        return;
    }
    pd_http_error_t err;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, NULL);
    free(body);
    json_t *toks = json_object_get(root, "tokens");
    json_t *model = json_object_get(root, "model");
    const pd_tokenizer_t *tok = pd_engine_tokenizer(s->engine);
    int32_t vocab = pd_tokenizer_vocab_size(tok);
    size_t n = json_array_size(toks);
    int32_t *ids = malloc((n ? n : 1) * sizeof(int32_t));
    bool ok = ids != NULL || pd_http_error_set(&err, 500, "InternalServerError", NULL, "out of memory");
    if (ok && !json_is_array(toks)) {
        ok =
            pd_http_error_set(&err, 400, "BadRequestError", "tokens", "'tokens' must be a list of token ids");
    } else if (ok && model != NULL && !json_is_null(model) &&
               (!json_is_string(model) || !model_known(s, json_string_value(model)))) {
        ok = pd_http_error_set(&err, 404, "NotFoundError", "model", "The model `%s` does not exist.",
                               json_is_string(model) ? json_string_value(model) : "?");
    }
    for (size_t i = 0; ok && i < n; i++) {
        json_t *v = json_array_get(toks, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab) {
            ok = pd_http_error_set(&err, 400, "BadRequestError", "tokens",
                                   "tokens[%zu] is not a token id in [0, %d)", i, vocab);
        } else {
            ids[i] = (int32_t)json_integer_value(v);
        }
    }
    char *text = NULL;
    size_t tl = 0;
    if (ok && pd_tokenizer_decode(tok, ids, n, false, &text, &tl) != PD_OK) {
        ok = pd_http_error_set(&err, 400, "BadRequestError", "tokens", "the tokens could not be decoded");
    }
    free(ids);
    json_decref(root);
    if (!ok) {
        pd_http_send_error(s, req, &err);
        return;
    }
    json_t *j = json_pack("{s:o}", "prompt", pd_json_string_lossy(text, tl));
    free(text);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

static void handle_version(pd_http_server_t *s, struct evhttp_request *req)
{
    json_t *j = json_pack("{s:s}", "version", PD_VERSION);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

static void handle_health(pd_http_server_t *s, struct evhttp_request *req)
{
    json_t *j = json_pack("{s:s}", "status", s->draining ? "draining" : "ok");
    pd_http_send_json(s, req, s->draining ? 503 : 200, j);
    json_decref(j);
}

static void handle_info(pd_http_server_t *s, struct evhttp_request *req)
{
    struct evbuffer *buf = evbuffer_new();
    evbuffer_add(buf, s->cfg.info_json, strlen(s->cfg.info_json));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    pd_http_track_reply(s, req);
    pd_http_send_reply(req, 200, "OK", buf);
    evbuffer_free(buf);
}

/* POST /pd/release: the proxy gives up a prefill's held KV whose decode leg failed, or a node's
 * prefix lend the prefill did not read. */
static void handle_release(pd_http_server_t *s, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    json_t *body =
        len <= 4096 ? json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, 0, NULL) : NULL;
    const json_t *lid = json_object_get(body, "lease_id");
    const char *rid = json_string_value(json_object_get(body, "remote_request_id"));
    const char *tid = json_string_value(json_object_get(body, "transfer_id"));
    if (!json_is_object(body) || (rid == NULL && tid == NULL) || (rid != NULL && !json_is_integer(lid))) {
        json_decref(body);
        pd_http_reply_error(s, req, 400, "BadRequestError", NULL,
                            "want {\"remote_request_id\", \"lease_id\"} or {\"transfer_id\"}");
        return;
    }
    bool done = s->cfg.release_kv(s->cfg.release_ctx, rid, (uint64_t)json_integer_value(lid), tid);
    json_decref(body);
    json_t *j = json_pack("{s:b}", "released", done);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

/* POST /admin/migrate: every stream pd-proxy can resume elsewhere (X-PD-Resumable) migrates now, as
 * in a drain, and the node stays up: an operator emptying a node before maintenance without restarting
 * it. With {"max": N} only the N newest do (pd-proxy's --rebalance-threshold, or an operator
 * rebalancing the pool by hand). Answers how many streams it handed off. */
static void handle_migrate(pd_http_server_t *s, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    json_t *body = len > 0 && len <= 4096
                       ? json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, 0, NULL)
                       : NULL;
    const json_t *mx = json_object_get(body, "max");
    bool ok = len == 0 || (json_is_object(body) && json_object_size(body) == (mx != NULL ? 1u : 0u) &&
                           (mx == NULL || (json_is_integer(mx) && json_integer_value(mx) >= 1 &&
                                           json_integer_value(mx) <= INT32_MAX)));
    int max = ok && mx != NULL ? (int)json_integer_value(mx) : 0;
    json_decref(body);
    if (!ok) {
        pd_http_reply_error(
            s, req, 400, "BadRequestError", NULL,
            "want no body, {} (every resumable stream) or {\"max\": N} (the N newest, N >= 1)");
        return;
    }
    int n = pd_http_hand_off_inflight(s, max);
    pd_log_info("POST /admin/migrate: %d streams ended for pd-proxy to resume on other nodes", n);
    json_t *j = json_pack("{s:i}", "handed_off", n);
    pd_http_send_json(s, req, 200, j);
    json_decref(j);
}

static void handle_metrics(pd_http_server_t *s, struct evhttp_request *req)
{
    pd_http_metrics_refresh(s);
    size_t len = 0;
    char *text = pd_metrics_render(s->metrics, &len);
    struct evbuffer *buf = evbuffer_new();
    evbuffer_add(buf, text, len);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4");
    pd_http_track_reply(s, req);
    pd_http_send_reply(req, 200, "OK", buf);
    evbuffer_free(buf);
    free(text);
}

static void on_request(struct evhttp_request *req, void *arg)
{
    pd_http_server_t *s = arg;
    pd_http_guard_request(s->guard, req); /* a whole request arrived on its connection */
    pd_http_no_delay(req);
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri != NULL ? evhttp_uri_get_path(uri) : NULL;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    if (path == NULL) {
        pd_http_reply_error(s, req, 400, "BadRequestError", NULL, "malformed request URI");
        return;
    }
    enum { GET = EVHTTP_REQ_GET | EVHTTP_REQ_HEAD, POST = EVHTTP_REQ_POST };
    struct route {
        const char *path;
        int methods; /* HEAD answers every GET route: the same status and headers, no body */
        void (*fn)(pd_http_server_t *, struct evhttp_request *);
    };
    static const struct route routes[] = {
        {"/v1/completions", POST, handle_completions},
        {"/v1/chat/completions", POST, handle_chat},
        {"/v1/models", GET, handle_models},
        {"/metrics", GET, handle_metrics},
        {"/health", GET, handle_health},
        {"/ping", GET | POST, handle_health},
        {"/version", GET, handle_version},
        {"/tokenize", POST, handle_tokenize},
        {"/detokenize", POST, handle_detokenize},
        {"/pd/info", GET, handle_info},
        {"/pd/release", POST, handle_release},
        {"/admin/migrate", POST, handle_migrate},
    };
    /* the key guards every route that tells about the model or runs it (the proxy's too) */
    bool keyed = strncmp(path, "/v1/", 4) == 0 || strcmp(path, "/tokenize") == 0 ||
                 strcmp(path, "/detokenize") == 0 || strncmp(path, "/admin/", 7) == 0;
    if (keyed && !authorized(s, req)) {
        pd_http_reply_error(s, req, 401, "AuthenticationError", NULL, "invalid or missing API key");
        return;
    }
    if (strncmp(path, "/v1/models/", 11) == 0 && path[11] != '\0') {
        if ((cmd & GET) == 0) {
            pd_http_reply_error(s, req, 405, "MethodNotAllowedError", NULL, "use GET");
            return;
        }
        handle_model(s, req, path + 11);
        return;
    }
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        if (strcmp(path, routes[i].path) != 0 || (routes[i].fn == handle_info && s->cfg.info_json == NULL) ||
            (routes[i].fn == handle_release && s->cfg.release_kv == NULL)) {
            continue;
        }
        if (((int)cmd & routes[i].methods) == 0) {
            pd_http_reply_error(s, req, 405, "MethodNotAllowedError", NULL,
                                routes[i].methods == POST ? "use POST" : "use GET");
            return;
        }
        routes[i].fn(s, req);
        return;
    }
    pd_http_reply_error(s, req, 404, "NotFoundError", NULL, "no such route");
}

/* ------------------------------------------------------------------ lifecycle */

static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    pd_http_server_t *s = arg;
    int pending =
        s->num_inflight == 0 && s->cfg.drain_pending != NULL ? s->cfg.drain_pending(s->cfg.release_ctx) : 0;
    if (s->num_inflight == 0 && s->unsent <= 0 && pending == 0) {
        pd_log_info("drain complete");
        event_base_loopexit(s->base, NULL);
        return;
    }
    if (s->num_inflight == 0) {
        if (pd_time_now_s() >= s->drain_deadline) {
            if (s->unsent > 0) {
                pd_log_warn("drain: %d replies not written by the deadline; exiting", s->unsent);
            } else {
                pd_log_warn("drain: %d KV holds for decode nodes not read by the deadline; exiting", pending);
            }
            event_base_loopexit(s->base, NULL);
        } else if (pending > 0 && !s->said_pending) {
            s->said_pending = true;
            pd_log_info("drain: replies done; waiting for %d KV holds to be read or expire", pending);
        }
        return;
    }
    if (!s->aborted_rest && pd_time_now_s() >= s->drain_deadline) {
        pd_log_warn("drain timeout: aborting %d in-flight requests", s->num_inflight);
        pd_http_abort_inflight(s);
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
    int handed = pd_http_hand_off_inflight(s, 0);
    pd_log_info(
        "draining: %d requests in flight (%d streams ended early for pd-proxy to resume), up to %.1f s",
        s->num_inflight, handed, s->cfg.drain_timeout);
    struct timeval tv = {0, 50000};
    event_add(s->drain_timer, &tv);
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    pd_log_info("received %s", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    pd_http_server_shutdown(arg);
}

pd_status_t pd_http_server_create(const pd_http_config_t *cfg, pd_engine_t *engine, pd_metrics_t *metrics,
                                  pd_http_server_t **srv_out)
{
    static bool threads_enabled;
    if (!threads_enabled) {
        evthread_use_pthreads(); /* event_active from the engine thread */
        threads_enabled = true;
    }
    if (cfg->enable_auto_tool_choice &&
        pd_tool_parser_by_name(cfg->tool_call_parser) == PD_TOOL_PARSER_NONE) {
        pd_log_error("--enable-auto-tool-choice requires --tool-call-parser (%s)", pd_tool_parser_names());
        return PD_ERR_INVALID_ARG;
    }
    pd_http_server_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    s->cfg = *cfg;
    s->wake_fd = -1;
    /* as vLLM: the parser reads calls only with --enable-auto-tool-choice (alone it is inert) */
    s->tool_parser = cfg->enable_auto_tool_choice ? (int)pd_tool_parser_by_name(cfg->tool_call_parser) : 0;
    if (s->tool_parser != PD_TOOL_PARSER_NONE) {
        pd_log_info("chat: tool_choice \"auto\" reads tool calls out of replies (--tool-call-parser %s)",
                    cfg->tool_call_parser);
    }
    s->engine = engine;
    s->metrics = metrics;
    s->started_at = (int64_t)time(NULL);
    snprintf(s->model_name, sizeof(s->model_name), "%s",
             cfg->served_model_names.n > 0 ? cfg->served_model_names.v[0] : pd_engine_model_name(engine));
    s->aliases[0] = s->model_name;
    s->num_aliases = 1;
    for (int i = 1; i < cfg->served_model_names.n; i++) {
        s->aliases[s->num_aliases++] = cfg->served_model_names.v[i];
    }
    pd_status_t st = pd_chat_load(pd_engine_model_dir(engine), cfg->chat_template, &s->chat);
    if (st != PD_OK) {
        free(s);
        return st;
    }
    const pd_generation_config_t *g = pd_engine_generation_config(engine);
    char defaults[256] = "";
    size_t dl = 0;
    if (g->has_temperature) {
        dl += (size_t)snprintf(defaults + dl, sizeof(defaults) - dl, " temperature=%g", g->temperature);
    }
    if (g->has_top_p && dl < sizeof(defaults)) {
        dl += (size_t)snprintf(defaults + dl, sizeof(defaults) - dl, " top_p=%g", g->top_p);
    }
    if (g->has_top_k && dl < sizeof(defaults)) {
        dl += (size_t)snprintf(defaults + dl, sizeof(defaults) - dl, " top_k=%lld", (long long)g->top_k);
    }
    if (g->has_min_p && dl < sizeof(defaults)) {
        dl += (size_t)snprintf(defaults + dl, sizeof(defaults) - dl, " min_p=%g", g->min_p);
    }
    if (g->has_repetition_penalty && dl < sizeof(defaults)) {
        snprintf(defaults + dl, sizeof(defaults) - dl, " repetition_penalty=%g", g->repetition_penalty);
    }
    if (defaults[0] != '\0') {
        pd_log_info("default sampling parameters from the model's generation_config.json (requests that omit "
                    "them get these; --generation-config vllm ignores the file):%s",
                    defaults);
    }
    pd_http_metrics_register(s);
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
    if (pd_http_guard_create(s->base, s->http, cfg->request_timeout, cfg->max_connections, &s->guard) !=
        PD_OK) {
        pd_http_server_destroy(s);
        return PD_ERR_NO_MEMORY;
    }
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
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->wake = s->wake_fd >= 0 ? event_new(s->base, s->wake_fd, EV_READ | EV_PERSIST, on_wake, s) : NULL;
    if (s->wake == NULL || event_add(s->wake, NULL) != 0) {
        pd_log_error("http: cannot create the engine's wake-up eventfd: %s", strerror(errno));
        pd_http_server_destroy(s);
        return PD_ERR_IO;
    }
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
    pd_engine_set_output_sink(s->engine, s->cfg.direct_stream ? pd_http_output_sink : NULL, s);
    pd_direct_set_max_fds(pd_http_guard_auto_max() / 2); /* a quarter of the open-file limit */
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
    pd_http_free_inflight(s);
    if (s->wake != NULL) {
        event_free(s->wake);
    }
    if (s->wake_fd >= 0) {
        close(s->wake_fd);
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
    pd_http_guard_destroy(s->guard); /* before the evhttp: its timer goes first */
    if (s->http != NULL) {
        evhttp_free(s->http);
    }
    if (s->base != NULL) {
        event_base_free(s->base);
    }
    pd_chat_free(s->chat);
    free(s);
}
