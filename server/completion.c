/* server/completion.c — generation requests on the HTTP front: /v1/completions and
 * /v1/chat/completions. A request fans out into one engine request per choice (each prompt of a
 * batched completion × n, seeds seed + j as vLLM's children); the choices of one prompt share its
 * KV blocks through the prefix cache (submitted together, the later ones hit the blocks the first
 * one caches in the same step; on a decode node that loads the prompt's KV, the siblings wait for
 * the first choice's first token, so they hit the loaded blocks). Outputs are streamed as SSE
 * chunks per choice index, or answered as one JSON body once every choice has finished. */
#define _GNU_SOURCE
#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/api_fields.h"
#include "common/http_reply.h"
#include "common/log.h"
#include "common/time.h"
#include "connector/connector.h"
#include "server/direct_stream.h"
#include "server/http_internal.h"
#include "server/tool_calls.h"

typedef struct choice {
    creq_t *parent;
    int32_t index;  /* OpenAI choice index: prompt × n + j */
    int32_t prompt; /* which prompt */
    char id[PD_REQ_ID_MAX];
    bool submitted, done, opened; /* opened: its first stream chunk (role / echo) was sent */
    char *text;
    size_t text_len, text_cap;
    int32_t *ids;
    int32_t num_ids, cap_ids;
    json_t *lp;        /* non-streaming logprobs being built (completions object / chat content list) */
    json_t *plp;       /* prompt_logprobs: [null, {id: {logprob, rank, decoded_token}}, ...] or NULL */
    bool echo_scored;  /* echo + logprobs: the prompt's entries were added */
    size_t echo_chars; /* their text length in characters (text_offset of the first output) */
    double first_token, last_token;
    /* the final output */
    const char *finish_reason;
    char *stop_str;
    int32_t stop_token;
    int32_t completion_tokens, cached_tokens;
    char *kv_transfer_params;
    char *error; /* the engine's reason when it ended with "error" and no token */
    bool oom;    /* an id or text could not be kept (out of memory): the reply is a 500, not a short text */
    bool handed_over; /* a prefill's first-token handover: a decode node goes on (no finish_reason) */
    bool migrated;    /* ended by a live migration ("abort" while migrating): another node goes on */
    size_t streamed;  /* tool parsing, streaming: bytes of text sent as content (or as a named tool
                       * choice's arguments) so far */
    bool call_opened; /* a named tool choice, streaming: the call's first delta (id, name) was sent */
    pd_required_reader_t required; /* tool_choice "required", streaming: where its calls stand */
    pd_auto_reader_t calls;        /* tool_choice "auto", streaming: where its calls stand */
} choice_t;

struct creq {
    pd_http_server_t *srv;
    struct evhttp_request *req; /* NULL once answered or the client went away */
    char id[48];                /* the engine requests' ids (one per choice derive from it) */
    char resp_id[72];           /* the answer's id: id, or the prefix + the client's X-Request-Id (vLLM) */
    pd_completion_req_t in;
    bool started;             /* the SSE reply was started */
    bool deferred;            /* siblings wait for the lead choice's first token */
    int32_t lead;             /* the first choice that runs (a resumed stream's finished ones do not): it
                               * carries the request's kv_transfer_params */
    pd_client_watch_t *watch; /* EOF on the client's socket while the request runs (http_watch.h) */
    int32_t num_choices, num_done;
    choice_t *ch;
    double arrival;
    int64_t created;
    bool resumable; /* pd-proxy resumes this stream elsewhere if it ends early (PD_RESUMABLE_HEADER) */
    bool migrating; /* ended for another node to take over: the stream ends with the engine's final
                     * output (its KV lease for that node, when it could lend) */
    pd_direct_stream_t *direct; /* the engine thread writes this plain stream's tokens (direct_stream.h), or
                                 * NULL; set before the request is submitted */
    creq_t *prev, *next;        /* in-flight list */
};

/* ------------------------------------------------------------------ lifetime */

/* The request is answered or its client is gone: its socket needs no watching any more. */
static void unwatch(creq_t *c)
{
    pd_client_watch_stop(c->watch);
    c->watch = NULL;
}

static void creq_free(creq_t *c)
{
    unwatch(c);
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
    for (int32_t i = 0; i < c->num_choices; i++) {
        choice_t *h = &c->ch[i];
        json_decref(h->lp);
        json_decref(h->plp);
        free(h->text), free(h->ids), free(h->stop_str), free(h->kv_transfer_params), free(h->error);
        pd_auto_reader_free(&h->calls);
    }
    free(c->ch);
    pd_completion_req_free(&c->in);
    pd_direct_free(c->direct);
    free(c);
}

static void abort_choices(creq_t *c)
{
    for (int32_t i = 0; i < c->num_choices; i++) {
        choice_t *h = &c->ch[i];
        if (h->submitted && !h->done) {
            pd_engine_abort_async(c->srv->engine, h->id);
        } else if (!h->submitted && !h->done) { /* deferred, never sent */
            h->done = true;
            h->finish_reason = "abort";
            c->num_done++;
        }
    }
}

static void on_client_close(struct evhttp_connection *conn, void *arg)
{
    creq_t *c = arg;
    if (c->req == NULL || c->num_done == c->num_choices) {
        return;
    }
    pd_log_info("client of %s disconnected; aborting it", c->id);
    if (c->direct != NULL) {
        pd_direct_close(c->direct); /* before evhttp closes the socket */
    }
    c->req = NULL;
    unwatch(c);
    abort_choices(c);
    if (c->num_done == c->num_choices) {
        creq_free(c);
    }
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

/* The stream's reply is written to its end (the caller sent [DONE] or, handing it off, did not):
 * the request no longer has a client. */
static void end_stream(creq_t *c)
{
    if (c->direct != NULL) {
        pd_direct_close(c->direct);
    }
    detach_close_cb(c);
    pd_http_track_reply(c->srv, c->req);
    evhttp_send_reply_end(c->req);
    c->req = NULL;
    unwatch(c);
}

/* A handed-off stream that had sent nothing starts bare (no role event): the proxy resumes from what
 * the prefill gave. */
static void start_bare(creq_t *c)
{
    if (!c->started) {
        struct evkeyvalq *h = evhttp_request_get_output_headers(c->req);
        evhttp_add_header(h, "Content-Type", "text/event-stream");
        evhttp_add_header(h, "Cache-Control", "no-cache");
        evhttp_send_reply_start(c->req, 200, "OK");
        c->started = true;
    }
}

int pd_http_hand_off_inflight(pd_http_server_t *s, int max)
{
    int n = 0;
    for (creq_t *c = s->inflight, *next; c != NULL && (max <= 0 || n < max); c = next) {
        next = c->next; /* newest first: the least KV to move */
        if (!c->resumable || c->req == NULL || c->num_done == c->num_choices || c->migrating ||
            (max > 0 && !c->started)) { /* a partial migration takes streams that are decoding */
            continue;
        }
        pd_metric_inc(s->m.handoffs, 1);
        n++;
        if (c->ch[c->lead].submitted) {
            /* live migration: the engine ends each running choice after its connector leased the KV
             * (if it can lend), and the last final output ends the stream with the leases
             * (end_migrated); a sibling still deferred has nothing to move: it starts on the next node */
            pd_log_info("drain: migrating stream %s (pd-proxy resumes it on another node, which reads its KV "
                        "from here)",
                        c->id);
            c->migrating = true;
            for (int32_t k = 0; k < c->num_choices; k++) {
                choice_t *h = &c->ch[k];
                if (h->submitted && !h->done) {
                    pd_engine_migrate_async(s->engine, h->id);
                } else if (!h->done) {
                    h->done = h->migrated = true;
                    h->finish_reason = "abort";
                    c->num_done++;
                }
            }
            continue;
        }
        pd_log_info("drain: ending stream %s early (pd-proxy resumes it on another node)", c->id);
        start_bare(c);
        end_stream(c); /* no [DONE]: the proxy's sign that it ended early */
        abort_choices(c);
        if (c->num_done == c->num_choices) {
            creq_free(c);
        }
    }
    return n;
}

void pd_http_abort_inflight(pd_http_server_t *s)
{
    for (creq_t *c = s->inflight; c != NULL; c = c->next) {
        abort_choices(c);
    }
}

void pd_http_free_inflight(pd_http_server_t *s)
{
    while (s->inflight != NULL) {
        s->inflight->req = NULL;
        creq_free(s->inflight);
    }
}

/* ------------------------------------------------------------------ JSON pieces */

static json_t *ids_json(const int32_t *ids, int32_t n)
{
    json_t *a = json_array();
    for (int32_t i = 0; i < n; i++) {
        json_array_append_new(a, json_integer(ids[i]));
    }
    return a;
}

static json_t *usage_json(const creq_t *c)
{
    int32_t prompt = 0, completion = 0, cached = 0;
    for (int32_t i = 0; i < c->in.num_prompts; i++) {
        prompt += c->in.prompts[i].len;
    }
    for (int32_t i = 0; i < c->num_choices; i++) {
        const choice_t *h = &c->ch[i];
        completion += h->finish_reason != NULL ? h->completion_tokens : h->num_ids;
        if (h->index % c->in.n == 0) {
            cached += h->cached_tokens;
        }
    }
    json_t *u = json_pack("{s:i, s:i, s:i}", "prompt_tokens", prompt, "completion_tokens", completion,
                          "total_tokens", prompt + completion);
    if (cached > 0) {
        json_object_set_new(u, "prompt_tokens_details", json_pack("{s:i}", "cached_tokens", cached));
    }
    return u;
}

/* A finished choice's finish_reason: null when a decode node goes on (first-token handover). */
static json_t *finish_reason_json(const choice_t *h)
{
    return h->handed_over ? json_null() : json_string(h->finish_reason);
}

/* vLLM's stop_reason: the stop string or stop token id that finished the choice, else null. */
static json_t *stop_reason_json(const choice_t *h)
{
    if (h->finish_reason == NULL || strcmp(h->finish_reason, "stop") != 0) {
        return json_null();
    }
    if (h->stop_str != NULL) {
        return pd_json_string_lossy(h->stop_str, strlen(h->stop_str));
    }
    return h->stop_token >= 0 ? json_integer(h->stop_token) : json_null();
}

static char *token_text(const pd_tokenizer_t *tok, int32_t id, size_t *len)
{
    char *t = NULL;
    if (pd_tokenizer_decode(tok, &id, 1, false, &t, len) != PD_OK) {
        t = strdup("");
        *len = 0;
    }
    return t;
}

/* Completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset} entries of one output. */
static json_t *new_logprobs(void)
{
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* Adds token id's text → logprob to a completions top_logprobs object unless its text is there
 * already. Keys keep their length: a token whose text is U+0000 is "\u0000", not "". */
static void top_add(const pd_tokenizer_t *tok, json_t *top, int32_t id, double logprob)
{
    size_t tl = 0;
    char *t = token_text(tok, id, &tl);
    json_t *key = pd_json_string_lossy(t, tl);
    const char *kv = json_string_value(key);
    size_t kl = json_string_length(key);
    if (json_object_getn(top, kv, kl) == NULL) {
        json_object_setn_new(top, kv, kl, json_real(logprob));
    }
    json_decref(key);
    free(t);
}

/* A completions top_logprobs entry: the chosen token first, then the top ones (OpenAI and vLLM
 * always include the chosen token: up to logprobs + 1 entries). */
static json_t *top_json(const pd_tokenizer_t *tok, int32_t chosen, double chosen_lp, const int32_t *ids,
                        const float *lps, int32_t n)
{
    json_t *top = json_object();
    top_add(tok, top, chosen, chosen_lp);
    for (int32_t k = 0; k < n; k++) {
        top_add(tok, top, ids[k], lps[k]);
    }
    return top;
}

static void logprobs_append(const pd_tokenizer_t *tok, json_t *lp, const pd_engine_output_t *o, size_t offset)
{
    size_t tl = 0;
    char *t = token_text(tok, o->token, &tl);
    json_array_append_new(json_object_get(lp, "tokens"), pd_json_string_lossy(t, tl));
    json_array_append_new(json_object_get(lp, "token_logprobs"), json_real(o->logprob));
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)offset));
    json_array_append_new(json_object_get(lp, "top_logprobs"),
                          top_json(tok, o->token, o->logprob, o->top_ids, o->top_logprobs, o->num_top));
    free(t);
}

static size_t utf8_chars(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        k += ((unsigned char)s[i] & 0xc0) != 0x80;
    }
    return k;
}

/* echo + logprobs: the prompt's tokens first in the completions logprobs (vLLM): the first token with
 * null scores, the others with their prompt logprob and top entries; text_offset in characters.
 * Returns the prompt tokens' text length in characters. */
static size_t echo_logprobs_append(const pd_tokenizer_t *tok, json_t *lp, const pd_prompt_t *pr,
                                   const pd_engine_output_t *o)
{
    size_t off = 0;
    for (int32_t i = 0; i < pr->len; i++) {
        size_t tl = 0;
        char *t = token_text(tok, pr->ids[i], &tl);
        json_array_append_new(json_object_get(lp, "tokens"), pd_json_string_lossy(t, tl));
        json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)off));
        off += utf8_chars(t, tl);
        const pd_prompt_logprob_t *p = i > 0 && o->prompt_logprobs != NULL && i - 1 < o->num_prompt_logprobs
                                           ? &o->prompt_logprobs[i - 1]
                                           : NULL;
        if (p == NULL) {
            json_array_append_new(json_object_get(lp, "token_logprobs"), json_null());
            json_array_append_new(json_object_get(lp, "top_logprobs"), json_null());
            free(t);
            continue;
        }
        json_array_append_new(json_object_get(lp, "token_logprobs"),
                              json_real(p->logprob > -9999 ? p->logprob : -9999));
        json_array_append_new(json_object_get(lp, "top_logprobs"),
                              top_json(tok, pr->ids[i], p->logprob > -9999 ? p->logprob : -9999, p->top_ids,
                                       p->top_logprobs, p->num_top));
        free(t);
    }
    return off;
}

/* Chat logprobs: {"token", "logprob", "bytes", "top_logprobs": [...]}. */
static json_t *chat_token_json(const pd_tokenizer_t *tok, int32_t id, float logprob, bool with_top)
{
    size_t tl = 0;
    char *t = token_text(tok, id, &tl);
    json_t *bytes = json_array();
    for (size_t i = 0; i < tl; i++) {
        json_array_append_new(bytes, json_integer((unsigned char)t[i]));
    }
    json_t *e = json_pack("{s:o, s:f, s:o}", "token", pd_json_string_lossy(t, tl), "logprob", (double)logprob,
                          "bytes", bytes);
    if (with_top) {
        json_object_set_new(e, "top_logprobs", json_array());
    }
    free(t);
    return e;
}

static void chat_logprobs_append(const pd_tokenizer_t *tok, json_t *content, int32_t top_n,
                                 const pd_engine_output_t *o)
{
    json_t *e = chat_token_json(tok, o->token, o->logprob, true);
    json_t *top = json_object_get(e, "top_logprobs");
    for (int32_t k = 0; k < o->num_top && k < top_n; k++) {
        json_array_append_new(top, chat_token_json(tok, o->top_ids[k], o->top_logprobs[k], false));
    }
    json_array_append_new(content, e);
}

/* vLLM's prompt_logprobs: null for the first prompt token, then per token {"id": {logprob, rank,
 * decoded_token}} with the prompt's own token first and the top entries after it. */
static json_t *prompt_logprobs_json(const pd_tokenizer_t *tok, const pd_prompt_t *pr,
                                    const pd_engine_output_t *o)
{
    json_t *list = json_array();
    json_array_append_new(list, json_null());
    for (int32_t i = 0; i < o->num_prompt_logprobs && i + 1 < pr->len; i++) {
        const pd_prompt_logprob_t *p = &o->prompt_logprobs[i];
        json_t *d = json_object();
        char key[16];
        size_t tl = 0;
        int32_t id = pr->ids[i + 1];
        char *t = token_text(tok, id, &tl);
        snprintf(key, sizeof(key), "%d", id);
        json_object_set_new(d, key,
                            json_pack("{s:f, s:i, s:o}", "logprob", (double)p->logprob, "rank", p->rank,
                                      "decoded_token", pd_json_string_lossy(t, tl)));
        free(t);
        for (int32_t k = 0; k < p->num_top; k++) {
            snprintf(key, sizeof(key), "%d", p->top_ids[k]);
            if (json_object_get(d, key) != NULL) {
                continue;
            }
            t = token_text(tok, p->top_ids[k], &tl);
            json_object_set_new(d, key,
                                json_pack("{s:f, s:i, s:o}", "logprob", (double)p->top_logprobs[k], "rank",
                                          k + 1, "decoded_token", pd_json_string_lossy(t, tl)));
            free(t);
        }
        json_array_append_new(list, d);
    }
    return list;
}

/* ------------------------------------------------------------------ streaming */

static void stream_chunk(creq_t *c, json_t *chunk)
{
    char *text = json_dumps(chunk, JSON_COMPACT);
    if (text != NULL) { /* out of memory: no chunk rather than a broken one */
        pd_http_send_sse(c->req, text);
        pd_metric_inc(c->srv->m.stream_chunks[0], 1);
    }
    free(text);
}

static json_t *chunk_envelope(const creq_t *c, json_t *choices)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", c->resp_id, "object",
                     c->in.chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)c->created, "model", c->srv->model_name, "choices", choices);
}

/* The first chunk of a choice: chat names the role; completions with echo carry the prompt. */
static void open_choice(creq_t *c, choice_t *h)
{
    h->opened = true;
    if (c->in.chat) {
        json_t *ch = json_pack("{s:i, s:{s:s, s:s}, s:n, s:n}", "index", h->index, "delta", "role",
                               "assistant", "content", "", "logprobs", "finish_reason");
        json_t *chunk = chunk_envelope(c, json_pack("[o]", ch));
        stream_chunk(c, chunk);
        json_decref(chunk);
    }
}

static void start_stream(creq_t *c)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(c->req);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(c->req, 200, "OK");
    c->started = true;
    for (int32_t i = 0; i < c->num_choices; i++) { /* vLLM: every choice's role first */
        if (c->in.chat && c->in.resume == NULL) {  /* a resumed stream's client had it */
            open_choice(c, &c->ch[i]);
        }
    }
}

/* The tool calls choice h's reply holds (NULL: none; *content_len the text before them). */
static json_t *reply_calls(const creq_t *c, const choice_t *h, size_t *content_len)
{
    *content_len = h->text_len;
    if (c->in.tool_parser == PD_TOOL_PARSER_NAMED) {
        json_t *calls = pd_tool_calls_named(c->in.tool_name, h->text, h->text_len);
        *content_len = calls != NULL ? 0 : h->text_len;
        return calls;
    }
    return c->in.tool_parser != PD_TOOL_PARSER_NONE
               ? pd_tool_calls_parse((pd_tool_parser_t)c->in.tool_parser, h->text, h->text_len, content_len)
               : NULL;
}

/* finish_reason "tool_calls" for calls the server read or "required" forced; a named function
 * keeps the generation's own (OpenAI's and vLLM's "stop"). */
static bool calls_finish(const creq_t *c)
{
    return c->in.tool_parser != PD_TOOL_PARSER_NAMED;
}

/* Tool parsing (c->in.tool_parser), streaming: the delta of this output — the content that cannot
 * be part of a tool call any more; at the end the rest, and the calls the whole reply holds
 * (then *finish is "tool_calls", as vLLM reports them). */
static json_t *tool_delta(const creq_t *c, choice_t *h, bool finished, const char **finish)
{
    pd_tool_parser_t p = (pd_tool_parser_t)c->in.tool_parser;
    if (p == PD_TOOL_PARSER_NAMED) { /* the reply is the arguments: streamed as they are written (vLLM) */
        json_t *delta = json_object(), *calls = NULL;
        if (!h->call_opened) { /* the first delta: id, type, name and the arguments so far */
            calls = pd_tool_calls_named(c->in.tool_name, h->text, h->text_len);
            json_object_set_new(json_array_get(calls, 0), "index", json_integer(0));
            h->call_opened = true;
        } else if (h->text_len > h->streamed) {
            calls = json_pack("[{s:i, s:{s:s%}}]", "index", 0, "function", "arguments", h->text + h->streamed,
                              h->text_len - h->streamed);
        }
        h->streamed = h->text_len;
        if (calls != NULL) {
            json_object_set_new(delta, "tool_calls", calls);
        }
        return delta;
    }
    if (p == PD_TOOL_PARSER_REQUIRED) { /* calls open as their names are read, arguments grow */
        json_t *delta = json_object(),
               *calls = pd_tool_calls_required_read(&h->required, h->text, h->text_len);
        if (calls != NULL) {
            json_object_set_new(delta, "tool_calls", calls);
        }
        if (finished && h->required.calls > 0) {
            *finish = "tool_calls";
        }
        return delta;
    }
    /* "auto": content until a call's marker; calls open as their names are read and their arguments
     * grow as written; at the end the whole reply's parse sends what the stream did not */
    size_t upto = pd_tool_calls_safe_prefix(p, h->text, h->text_len, h->streamed);
    json_t *whole = finished ? reply_calls(c, h, &upto) : NULL;
    json_t *delta = json_object();
    if (upto > h->streamed) {
        json_object_set_new(delta, "content",
                            pd_json_string_lossy(h->text + h->streamed, upto - h->streamed));
        h->streamed = upto;
    }
    json_t *calls = finished ? (whole != NULL ? pd_tool_calls_auto_finish(&h->calls, whole) : NULL)
                             : pd_tool_calls_auto_read(p, &h->calls, h->text, h->text_len);
    if (calls != NULL) {
        json_object_set_new(delta, "tool_calls", calls);
    }
    if (whole != NULL) {
        *finish = calls_finish(c) ? "tool_calls" : *finish;
    } else if (finished && h->calls.calls > 0) {
        pd_log_warn("request %s: %d tool calls were streamed, but the whole reply does not parse as calls "
                    "(its text is sent as content)",
                    c->id, h->calls.calls);
    }
    json_decref(whole);
    return delta;
}

/* The SSE chunk of one engine output of choice h. */
static json_t *output_chunk(creq_t *c, choice_t *h, const pd_engine_output_t *o, size_t offset, bool finished)
{
    const pd_tokenizer_t *tok = pd_engine_tokenizer(c->srv->engine);
    json_t *choice;
    if (c->in.chat) {
        json_t *lp = json_null();
        if (c->in.logprobs >= 0 && o->token >= 0) {
            json_t *content = json_array();
            chat_logprobs_append(tok, content, c->in.logprobs, o);
            json_decref(lp);
            lp = json_pack("{s:o}", "content", content);
        }
        const char *finish = o->finish_reason;
        json_t *delta = c->in.tool_parser != PD_TOOL_PARSER_NONE ? tool_delta(c, h, finished, &finish)
                        : o->text_len > 0
                            ? json_pack("{s:o}", "content", pd_json_string_lossy(o->text, o->text_len))
                            : json_object();
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", h->index, "delta", delta, "logprobs", lp,
                           "finish_reason", finished ? json_string(finish) : json_null());
    } else {
        json_t *lp = json_null();
        if (c->in.logprobs >= 0) {
            json_decref(lp);
            lp = new_logprobs();
            if (c->in.echo && !h->echo_scored) { /* the first chunk carries the prompt's entries */
                h->echo_chars = echo_logprobs_append(tok, lp, &c->in.prompts[h->prompt], o);
                h->echo_scored = true;
                offset += h->echo_chars;
            }
            if (o->token >= 0) {
                logprobs_append(tok, lp, o, offset);
            }
        }
        json_t *text;
        const pd_prompt_t *pr = &c->in.prompts[h->prompt];
        if (!h->opened && c->in.echo && pr->text != NULL) { /* echo: the prompt starts the first chunk */
            size_t n = pr->text_len + o->text_len;
            char *buf = malloc(n + 1);
            memcpy(buf, pr->text, pr->text_len);
            memcpy(buf + pr->text_len, o->text, o->text_len);
            text = pd_json_string_lossy(buf, n);
            free(buf);
        } else {
            text = pd_json_string_lossy(o->text, o->text_len);
        }
        h->opened = true;
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", h->index, "text", text, "logprobs", lp,
                           "finish_reason", finished ? json_string(o->finish_reason) : json_null());
    }
    if (c->in.return_token_ids) { /* chat and completions streams alike (issue 51: chat left them out) */
        const pd_prompt_t *pr = &c->in.prompts[h->prompt];
        json_object_set_new(choice, "token_ids", o->token >= 0 ? ids_json(&o->token, 1) : json_array());
        if (h->num_ids <= 1 && o->token >= 0) {
            json_object_set_new(choice, "prompt_token_ids", ids_json(pr->ids, pr->len));
        }
    }
    if (finished) {
        json_object_set_new(choice, "stop_reason", stop_reason_json(h));
    }
    json_t *chunk = chunk_envelope(c, json_pack("[o]", choice));
    if (finished && o->kv_transfer_params != NULL) {
        json_object_set_new(chunk, "kv_transfer_params", json_loads(o->kv_transfer_params, 0, NULL));
    }
    return chunk;
}

/* The direct writer's template (direct_stream.h): the JSON of the chunk output_chunk makes for a
 * middle token (with PD_DIRECT_TEXT_MARKER as its text and PD_DIRECT_ID_MARKER as its id), and for
 * chat the same for a token without text. NULL when out of memory. */
static char *direct_template(creq_t *c, bool with_text)
{
    pd_engine_output_t o;
    memset(&o, 0, sizeof(o));
    o.text = with_text ? (char *)PD_DIRECT_TEXT_MARKER : (char *)"";
    o.text_len = strlen(o.text);
    o.token = PD_DIRECT_ID_MARKER;
    o.stop_token = -1;
    choice_t *h = &c->ch[0];
    int32_t ids = h->num_ids;
    h->num_ids = ids > 2 ? ids : 2; /* a middle token's chunk: prompt_token_ids are the first's */
    json_t *chunk = output_chunk(c, h, &o, 0, false);
    h->num_ids = ids;
    char *text = chunk != NULL ? json_dumps(chunk, JSON_COMPACT) : NULL;
    json_decref(chunk);
    return text;
}

/* After the loop wrote an output of a stream the engine thread may write: hands the stream (back)
 * to the engine's writer when nothing waits before it, else leaves the writer disarmed. */
static void arm_direct(creq_t *c)
{
    if (c->direct == NULL) {
        return;
    }
    bool arm = c->req != NULL && c->started && !c->migrating && c->ch[0].opened && pd_http_drained(c->req);
    int fd = arm ? pd_http_socket(c->req) : -1;
    char *chunk = NULL, *empty = NULL;
    if (arm && !pd_direct_has_template(c->direct)) {
        chunk = direct_template(c, true);
        empty = c->in.chat ? direct_template(c, false) : NULL;
    }
    pd_direct_arm(c->direct, arm && fd >= 0, fd, arm && pd_http_reply_chunked(c->req), chunk, empty);
    free(chunk), free(empty);
}

/* The lease on choice h's KV its final output named (a live migration), or NULL. */
static json_t *migrated_lease(const choice_t *h)
{
    json_t *p =
        h->migrated && h->kv_transfer_params != NULL ? json_loads(h->kv_transfer_params, 0, NULL) : NULL;
    if (json_is_object(p) && json_is_array(json_object_get(p, "remote_block_ids"))) {
        return p;
    }
    json_decref(p);
    return NULL;
}

/* A migrating stream's engine requests ended: the stream ends without [DONE] (pd-proxy's sign to
 * resume it elsewhere), its last event {"pd_migrate": params} naming the lease on its KV when the
 * connector could lend it; with several choices {"pd_migrate": {"choices": [...]}}, one lease per
 * choice, null for a choice that finished, was not running or could not be lent (the next node
 * recomputes it). The final outputs' text (what a stop string held back) is not sent: the node that
 * takes over replays the tokens and holds back the same text. */
static void end_migrated(creq_t *c)
{
    start_bare(c);
    json_t *params = NULL;
    if (c->num_choices == 1) {
        params = migrated_lease(&c->ch[0]);
    } else {
        json_t *each = json_array();
        int leased = 0;
        for (int32_t k = 0; each != NULL && k < c->num_choices; k++) {
            json_t *p = migrated_lease(&c->ch[k]);
            leased += p != NULL;
            json_array_append_new(each, p != NULL ? p : json_null());
        }
        params = leased > 0 ? json_pack("{s:o}", "choices", each) : NULL;
        if (leased == 0) {
            json_decref(each);
        }
    }
    if (params != NULL) {
        json_t *ev = json_pack("{s:o}", "pd_migrate", params);
        if (ev != NULL) {
            stream_chunk(c, ev);
        }
        json_decref(ev);
    } else {
        pd_log_info("drain: stream %s ends without its KV (not decoding yet, or this node cannot lend it); "
                    "its next node recomputes it",
                    c->id);
    }
    end_stream(c);
    creq_free(c);
}

/* Whether a choice of migrating stream c ended for another node to go on (end_migrated ends it). */
static bool any_migrated(const creq_t *c)
{
    for (int32_t k = 0; c->migrating && k < c->num_choices; k++) {
        if (c->ch[k].migrated) {
            return true;
        }
    }
    return false;
}

static void stream_output(creq_t *c, choice_t *h, const pd_engine_output_t *o, size_t offset, bool finished)
{
    if (!c->started) {
        start_stream(c);
    }
    if (finished && h->handed_over) {
        /* first-token handover: the stream so far is the request's start; the proxy takes the
         * parameters from this last chunk and the decode node's stream goes on (its usage) */
        json_t *chunk = chunk_envelope(c, json_array());
        json_object_set_new(chunk, "kv_transfer_params",
                            o->kv_transfer_params != NULL ? json_loads(o->kv_transfer_params, 0, NULL)
                                                          : json_null());
        stream_chunk(c, chunk);
        json_decref(chunk);
    } else if (finished && h->error != NULL && h->num_ids == 0) {
        pd_http_error_t e;
        pd_http_error_set(&e, 500, "InternalServerError", NULL, "%s", h->error);
        json_t *ej = pd_openai_error_json(&e);
        stream_chunk(c, ej);
        json_decref(ej);
    } else if (o->token >= 0 || o->text_len > 0 || finished) {
        json_t *chunk = output_chunk(c, h, o, offset, finished);
        stream_chunk(c, chunk);
        json_decref(chunk);
    }
    if (c->num_done < c->num_choices) {
        arm_direct(c);
        return;
    }
    if (any_migrated(c)) { /* the last choice running finished here, the others go on elsewhere */
        end_migrated(c);
        return;
    }
    if (c->in.include_usage && !c->ch[0].handed_over) {
        json_t *u = chunk_envelope(c, json_array());
        json_object_set_new(u, "usage", usage_json(c));
        stream_chunk(c, u);
        json_decref(u);
    }
    pd_http_send_sse(c->req, "[DONE]");
    end_stream(c);
    creq_free(c);
}

/* ------------------------------------------------------------------ the whole answer */

static json_t *final_choice(const creq_t *c, const choice_t *h)
{
    json_t *choice;
    if (c->in.chat) {
        size_t content_len;
        json_t *calls = reply_calls(c, h, &content_len);
        /* with calls, the content is the text before them (null when none: vLLM's shape) */
        json_t *content =
            calls != NULL && content_len == 0 ? json_null() : pd_json_string_lossy(h->text, content_len);
        json_t *msg = json_pack("{s:s, s:o, s:o}", "role", "assistant", "content", content, "tool_calls",
                                calls != NULL ? calls : json_array());
        choice =
            json_pack("{s:i, s:o, s:o, s:o, s:o}", "index", h->index, "message", msg, "logprobs",
                      h->lp != NULL ? json_pack("{s:O}", "content", h->lp) : json_null(), "finish_reason",
                      calls != NULL && calls_finish(c) ? json_string("tool_calls") : finish_reason_json(h),
                      "stop_reason", stop_reason_json(h));
    } else {
        const pd_prompt_t *pr = &c->in.prompts[h->prompt];
        json_t *text;
        if (c->in.echo && pr->text != NULL) {
            size_t n = pr->text_len + h->text_len;
            char *buf = malloc(n + 1);
            memcpy(buf, pr->text, pr->text_len);
            if (h->text_len > 0) {
                memcpy(buf + pr->text_len, h->text, h->text_len);
            }
            text = pd_json_string_lossy(buf, n);
            free(buf);
        } else {
            text = pd_json_string_lossy(h->text, h->text_len);
        }
        choice = json_pack("{s:i, s:o, s:o, s:o, s:o}", "index", h->index, "text", text, "logprobs",
                           h->lp != NULL ? json_incref(h->lp) : json_null(), "finish_reason",
                           finish_reason_json(h), "stop_reason", stop_reason_json(h));
        json_object_set_new(choice, "prompt_logprobs", h->plp != NULL ? json_incref(h->plp) : json_null());
    }
    if (c->in.return_token_ids) {
        const pd_prompt_t *pr = &c->in.prompts[h->prompt];
        json_object_set_new(choice, "prompt_token_ids", ids_json(pr->ids, pr->len));
        json_object_set_new(choice, "token_ids", ids_json(h->ids, h->num_ids));
    }
    return choice;
}

static void reply_final(creq_t *c)
{
    pd_http_server_t *s = c->srv;
    detach_close_cb(c);
    const choice_t *failed = NULL;
    bool any_ok = false, oom = false;
    for (int32_t i = 0; i < c->num_choices; i++) {
        const choice_t *h = &c->ch[i];
        oom |= h->oom;
        if (h->error != NULL && h->num_ids == 0) {
            failed = failed != NULL ? failed : h;
        } else {
            any_ok = true;
        }
    }
    if (oom) { /* never a silently shortened answer */
        pd_http_reply_error(s, c->req, 500, "InternalServerError", NULL,
                            "out of memory while collecting the output");
    } else if (failed != NULL && !any_ok) {
        pd_http_reply_error(s, c->req, 500, "InternalServerError", NULL, failed->error);
    } else {
        json_t *choices = json_array();
        for (int32_t i = 0; i < c->num_choices; i++) {
            json_array_append_new(choices, final_choice(c, &c->ch[i]));
        }
        json_t *body =
            json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", c->resp_id, "object",
                      c->in.chat ? "chat.completion" : "text_completion", "created", (json_int_t)c->created,
                      "model", s->model_name, "choices", choices, "usage", usage_json(c));
        if (c->in.chat) { /* chat: one prompt, its scores at the top level */
            json_object_set_new(body, "prompt_logprobs",
                                c->ch[0].plp != NULL ? json_incref(c->ch[0].plp) : json_null());
        }
        const char *ktp = c->ch[0].kv_transfer_params;
        json_object_set_new(body, "kv_transfer_params", ktp != NULL ? json_loads(ktp, 0, NULL) : json_null());
        pd_http_send_json(s, c->req, 200, body);
        json_decref(body);
    }
    c->req = NULL;
    unwatch(c);
    creq_free(c);
}

/* ------------------------------------------------------------------ outputs */

/* A token reached the client at `now` (the engine thread's writer notes when it wrote one). */
static void observe_token(pd_http_server_t *s, creq_t *c, choice_t *h, double now)
{
    pd_http_metrics_token(s, now - c->arrival, now - h->last_token, h->first_token == 0);
    if (h->first_token == 0) {
        h->first_token = now;
    }
    h->last_token = now;
}

static bool submit_choice(creq_t *c, int32_t k);

/* Records o into choice h: ids, logprobs, text and, when it finishes, the final fields. */
static void absorb(pd_http_server_t *s, creq_t *c, choice_t *h, const pd_engine_output_t *o, size_t offset)
{
    if (o->prompt_logprobs != NULL && h->plp == NULL) {
        h->plp = prompt_logprobs_json(pd_engine_tokenizer(s->engine), &c->in.prompts[h->prompt], o);
    }
    if (o->token >= 0) {
        if (!o->replayed) {
            observe_token(s, c, h, o->delivered ? o->delivered_at : pd_time_now_s());
        }
        if (h->num_ids == h->cap_ids) {
            int32_t cap = h->cap_ids ? 2 * h->cap_ids : 64;
            int32_t *ids = realloc(h->ids, (size_t)cap * sizeof(int32_t));
            if (ids != NULL) {
                h->ids = ids;
                h->cap_ids = cap;
            } else if (!h->oom) {
                pd_log_error("completion: out of memory keeping %d token ids; the request fails", cap);
                h->oom = true;
            }
        }
        if (h->num_ids < h->cap_ids) {
            h->ids[h->num_ids++] = o->token;
        }
        if (h->lp != NULL && !c->in.stream) {
            const pd_tokenizer_t *tok = pd_engine_tokenizer(s->engine);
            if (!c->in.chat && c->in.echo && !h->echo_scored) {
                h->echo_chars = echo_logprobs_append(tok, h->lp, &c->in.prompts[h->prompt], o);
                h->echo_scored = true;
                offset += h->echo_chars;
            }
            if (c->in.chat) {
                chat_logprobs_append(tok, h->lp, c->in.logprobs, o);
            } else {
                logprobs_append(tok, h->lp, o, offset);
            }
        }
    }
    if (o->text_len > 0 && h->text_len + o->text_len + 1 > h->text_cap) {
        size_t cap = (h->text_len + o->text_len + 1) * 2;
        char *t = realloc(h->text, cap);
        if (t != NULL) {
            h->text = t;
            h->text_cap = cap;
        } else if (!h->oom) {
            pd_log_error("completion: out of memory keeping %zu bytes of text; the request fails", cap);
            h->oom = true;
        }
    }
    if (o->text_len > 0 && h->text_len + o->text_len + 1 <= h->text_cap) {
        memcpy(h->text + h->text_len, o->text, o->text_len);
        h->text_len += o->text_len;
        h->text[h->text_len] = '\0';
    }
    if (o->finish_reason != NULL) {
        h->done = true;
        c->num_done++;
        h->finish_reason = o->finish_reason;
        h->stop_str = o->stop_str != NULL ? strdup(o->stop_str) : NULL;
        h->stop_token = o->stop_token;
        h->completion_tokens = o->completion_tokens;
        h->cached_tokens = o->cached_tokens;
        h->kv_transfer_params = o->kv_transfer_params != NULL ? strdup(o->kv_transfer_params) : NULL;
        h->handed_over = o->handed_over;
        if (strcmp(o->finish_reason, "error") == 0 && o->completion_tokens == 0) {
            h->error = strdup(o->text_len > 0 ? o->text : "generation failed");
        }
        pd_http_metrics_finished(s, o);
    }
}

/* A resumed stream's token (resume_token_ids), recorded by absorb: its client had the text before it
 * from the node that sampled it, so nothing is sent; a tool-call parser reads it as it would have,
 * so that what is streamed next starts where that node's stream stopped. */
static void replay_output(creq_t *c, choice_t *h)
{
    h->opened = true;
    if (c->in.chat && c->in.tool_parser != PD_TOOL_PARSER_NONE) {
        const char *finish = NULL;
        json_decref(tool_delta(c, h, false, &finish));
    }
}

static void handle_output(pd_http_server_t *s, const pd_engine_output_t *o)
{
    choice_t *h = o->user;
    if (h == NULL) {
        return;
    }
    creq_t *c = h->parent;
    if (c->direct != NULL && pd_direct_counts(o)) {
        pd_direct_handled(c->direct); /* the engine's writer waits until this one is written */
    }
    if (h->done) {
        return;
    }
    /* text_offset counts characters (as vLLM); with echo the prompt tokens' text comes first */
    size_t offset = utf8_chars(h->text, h->text_len) + h->echo_chars;
    absorb(s, c, h, o, offset);
    if (o->delivered) { /* the engine thread wrote it (direct_stream.h): recorded, and its rest sent */
        pd_metric_inc(s->m.stream_chunks[1], 1);
        if (o->rest != NULL && c->req != NULL) {
            pd_http_send_framed(c->req, o->rest, o->rest_len);
            arm_direct(c);
        }
        return;
    }
    bool finished = o->finish_reason != NULL;
    if (c->deferred && h->index == c->lead && (o->token >= 0 || finished)) {
        /* the lead choice has its prompt's KV (loaded or computed): the siblings now hit those blocks */
        c->deferred = false;
        for (int32_t k = c->lead + 1; k < c->num_choices; k++) {
            if (c->ch[k].done) {
                continue; /* finished before this node (resume_token_ids) */
            }
            if (c->req == NULL || !submit_choice(c, k)) {
                choice_t *g = &c->ch[k];
                g->done = true;
                g->finish_reason = c->req == NULL ? "abort" : "error";
                g->error = c->req == NULL ? NULL : strdup("the engine's queue is full");
                c->num_done++;
            }
        }
    }
    if (c->req == NULL) { /* client gone: only wait for the final outputs */
        if (c->num_done == c->num_choices) {
            creq_free(c);
        }
        return;
    }
    if (finished && c->migrating && strcmp(h->finish_reason, "abort") == 0) {
        h->migrated = true;
        if (c->num_done == c->num_choices) {
            end_migrated(c);
        }
    } else if (o->replayed) {
        replay_output(c, h);
    } else if (c->in.stream) {
        stream_output(c, h, o, offset, finished);
    } else if (c->num_done == c->num_choices) {
        reply_final(c);
    }
}

bool pd_http_output_sink(void *ctx, pd_engine_output_t *o)
{
    (void)ctx;
    const choice_t *h = o->user;
    return h != NULL && h->parent->direct != NULL && pd_direct_send(h->parent->direct, o);
}

void pd_http_dispatch_outputs(pd_http_server_t *s)
{
    pd_engine_output_t *outs = pd_engine_take_outputs(s->engine);
    for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
        handle_output(s, o);
    }
    pd_engine_output_free(outs);
}

/* ------------------------------------------------------------------ submission */

/* kv_transfer_params {"choices": [...]} beside resume_token_ids: a live migration of a stream of
 * several choices, one entry per choice, the lease on its KV (prompt and every resumed token but the
 * last, as for one choice) or null (recomputed: it finished, was not running, could not be lent). */
static bool per_choice_leases_ok(const pd_completion_req_t *in, const json_t *each, pd_http_error_t *err)
{
    int32_t choices = in->num_prompts * in->n;
    if (json_object_size(in->kv_transfer_params) != 1 || !json_is_array(each) ||
        json_array_size(each) != (size_t)choices) {
        return pd_http_error_set(
            err, 400, "BadRequestError", "kv_transfer_params",
            "kv_transfer_params.choices (a live migration's leases) is alone and has one "
            "entry per choice (%d), a lease or null",
            choices);
    }
    for (int32_t k = 0; k < choices; k++) {
        const json_t *e = json_array_get(each, (size_t)k);
        const pd_resume_choice_t *rc = &in->resume[k];
        int32_t num = in->prompts[k / in->n].len + rc->num_ids - 1;
        if (!json_is_null(e) && (rc->finished || rc->num_ids == 0 || !pd_kv_params_migrates(e, num))) {
            return pd_http_error_set(
                err, 400, "BadRequestError", "kv_transfer_params",
                "kv_transfer_params.choices[%d] is not a live migration's lease of choice "
                "%d's prompt and resumed tokens but the last (pull parameters, "
                "remote_num_tokens %d)",
                k, k, num);
        }
    }
    return true;
}

/* kv_transfer_params beside resume_token_ids: one choice reads a live migration's lease (the KV of
 * the prompt and every resumed token but the last) or a prompt prefix a prefill lent; several choices
 * of one prompt only the prefix (its lead choice loads it, the others hit it); a batch of prompts
 * none (one engine request carries the parameters, and the prefix is one prompt's). */
static bool resume_kv_ok(const pd_completion_req_t *in, pd_http_error_t *err)
{
    const json_t *p = in->kv_transfer_params;
    const json_t *each = json_object_get(p, "choices");
    if (each != NULL) {
        return per_choice_leases_ok(in, each, err);
    }
    if (in->num_prompts > 1) {
        return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids",
                                 "'resume_token_ids' of a batch of prompts goes without kv_transfer_params");
    }
    if (in->n > 1) {
        return (pd_kv_params_resumes(p, 0) && !pd_kv_params_migrates(p, 0)) ||
               pd_http_error_set(
                   err, 400, "BadRequestError", "resume_token_ids",
                   "'resume_token_ids' of several choices goes with kv_transfer_params only as a "
                   "prompt prefix to fetch ({\"kv_prefix\": ...} alone)");
    }
    int32_t num = in->prompts[0].len + in->resume[0].num_ids - 1;
    return pd_kv_params_resumes(p, num) ||
           pd_http_error_set(
               err, 400, "BadRequestError", "resume_token_ids",
               "'resume_token_ids' goes with kv_transfer_params only as a live migration's lease "
               "(pull parameters for the prompt and every resumed token but the last: "
               "remote_num_tokens %d) or as a prompt prefix to fetch ({\"kv_prefix\": ...} alone)",
               num);
}

/* A request id unique across processes: prefix + 128 random bits in hex (vLLM's are random too). */
static void random_id(const char *prefix, char *out, size_t cap)
{
    uint64_t r[2] = {0, 0};
    if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
        r[0] = pd_time_now_ns();
        r[1] = (uint64_t)(uintptr_t)out ^ ((uint64_t)getpid() << 32);
    }
    snprintf(out, cap, "%s%016llx%016llx", prefix, (unsigned long long)r[0], (unsigned long long)r[1]);
}

static bool submit_choice(creq_t *c, int32_t k)
{
    choice_t *h = &c->ch[k];
    const pd_prompt_t *pr = &c->in.prompts[h->prompt];
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = h->id;
    rq.prompt = pr->ids;
    rq.num_prompt = pr->len;
    rq.params = c->in.params;
    int32_t j = h->index % c->in.n;
    if (rq.params.has_seed) {
        rq.params.seed += (uint64_t)j; /* vLLM's children: seed + index */
    }
    for (int32_t i = 0; i < c->in.num_stop; i++) {
        rq.stop[i] = c->in.stop[i];
    }
    rq.num_stop = c->in.num_stop;
    /* the KV parameters belong to one engine request: the first choice that runs (of the first prompt
     * but for a resumed stream of one prompt whose first choices had finished); a live migration's
     * leases, one per choice, each to its own (the engine copies them) */
    json_t *each = json_object_get(c->in.kv_transfer_params, "choices");
    json_t *mine = json_array_get(each, (size_t)k);
    rq.kv_transfer_params = json_is_array(each) ? (json_is_object(mine) ? mine : NULL)
                            : k == c->lead      ? c->in.kv_transfer_params
                                                : NULL;
    rq.grammar = c->in.grammar;
    if (c->in.resume != NULL && c->in.resume[k].num_ids > 0) {
        rq.resume = c->in.resume[k].ids;
        rq.num_resume = c->in.resume[k].num_ids;
    }
    rq.user = h;
    if (pd_engine_submit(c->srv->engine, &rq) != PD_OK) {
        return false;
    }
    h->submitted = true;
    return true;
}

void pd_http_handle_generate(pd_http_server_t *s, struct evhttp_request *req, bool chat)
{
    if (s->draining) {
        pd_http_reply_error(s, req, 503, "ServiceUnavailableError", NULL, "the server is shutting down");
        return;
    }
    size_t len = 0;
    char *body = pd_http_read_body(s, req, &len);
    if (body == NULL) {
        return;
    }
    creq_t *c = calloc(1, sizeof(*c));
    pd_http_error_t err;
    pd_http_error_set(&err, 500, "InternalServerError", NULL, "out of memory");
    const pd_model_config_t *mc = pd_engine_model_config(s->engine);
    pd_openai_limits_t lim = {s->aliases,
                              s->num_aliases,
                              mc->vocab_size,
                              pd_engine_max_model_len(s->engine),
                              s->cfg.max_json_depth,
                              pd_engine_generation_config(s->engine),
                              s->tool_parser};
    const pd_tokenizer_t *tok = pd_engine_tokenizer(s->engine);
    bool ok = c != NULL && (chat ? pd_openai_parse_chat(body, len, tok, s->chat, &lim, &c->in, &err)
                                 : pd_openai_parse_completion(body, len, tok, &lim, &c->in, &err));
    free(body);
    const char *role_err = ok ? pd_engine_params_error(s->engine, c->in.kv_transfer_params) : NULL;
    const json_t *each = ok ? json_object_get(c->in.kv_transfer_params, "choices") : NULL;
    for (size_t k = 0; role_err == NULL && k < json_array_size(each); k++) { /* a migration's leases */
        const json_t *e = json_array_get(each, k);
        role_err = json_is_null(e) ? NULL : pd_engine_params_error(s->engine, e);
    }
    if (role_err != NULL) {
        pd_http_error_set(&err, 400, "BadRequestError", "kv_transfer_params", "%s", role_err);
        pd_completion_req_free(&c->in);
        ok = false;
    } else if (ok && c->in.resume == NULL && each != NULL) {
        pd_http_error_set(
            &err, 400, "BadRequestError", "kv_transfer_params",
            "kv_transfer_params.choices (a live migration's leases) goes with resume_token_ids");
        pd_completion_req_free(&c->in);
        ok = false;
    } else if (ok && c->in.resume != NULL && c->in.kv_transfer_params != NULL &&
               !json_is_null(c->in.kv_transfer_params) && !resume_kv_ok(&c->in, &err)) {
        pd_completion_req_free(&c->in);
        ok = false;
    }
    if (ok) {
        c->num_choices = c->in.num_prompts * c->in.n;
        c->ch = calloc((size_t)c->num_choices, sizeof(choice_t));
        ok = c->ch != NULL;
        if (!ok) {
            pd_completion_req_free(&c->in);
        }
    }
    if (!ok) {
        free(c);
        pd_http_send_error(s, req, &err);
        return;
    }
    c->srv = s;
    c->req = req;
    c->arrival = pd_time_now_s();
    c->created = (int64_t)time(NULL);
    int32_t max_tokens = c->in.params.max_tokens; /* 0: up to max_model_len */
    for (int32_t i = 0; max_tokens <= 0 && i < c->in.num_prompts; i++) {
        max_tokens = pd_engine_max_model_len(s->engine) - c->in.prompts[i].len;
    }
    pd_http_metrics_admitted(s, c->in.n, max_tokens);
    random_id(chat ? "chatcmpl-" : "cmpl-", c->id, sizeof(c->id));
    snprintf(c->resp_id, sizeof(c->resp_id), "%s", c->id);
    c->resumable = c->in.stream &&
                   evhttp_find_header(evhttp_request_get_input_headers(req), PD_RESUMABLE_HEADER) != NULL;
    if (c->in.resume != NULL) {
        pd_metric_inc(s->m.resumed, 1);
    }
    const char *xid = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Request-Id");
    if (pd_api_request_id_ok(xid)) {
        /* vLLM's X-Request-Id: the answer's id (the P/D proxy gives both legs one, so the chunks of
         * a handed-over stream share it); engine ids stay random, so a repeated header is harmless */
        snprintf(c->resp_id, sizeof(c->resp_id), "%s%s", chat ? "chatcmpl-" : "cmpl-", xid);
        evhttp_add_header(evhttp_request_get_output_headers(req), "X-Request-Id", xid);
    }
    for (int32_t i = 0; c->in.echo && i < c->in.num_prompts; i++) { /* echo of token ids: their text */
        pd_prompt_t *pr = &c->in.prompts[i];
        if (pr->text == NULL &&
            pd_tokenizer_decode(tok, pr->ids, (size_t)pr->len, false, &pr->text, &pr->text_len) != PD_OK) {
            pr->text = NULL;
            pr->text_len = 0;
        }
    }
    for (int32_t k = 0; k < c->num_choices; k++) {
        choice_t *h = &c->ch[k];
        h->parent = c;
        h->index = k;
        h->prompt = k / c->in.n;
        h->stop_token = -1;
        if (c->num_choices == 1) {
            snprintf(h->id, sizeof(h->id), "%s", c->id);
        } else {
            snprintf(h->id, sizeof(h->id), "%s-%d", c->id, k);
        }
        if (c->in.logprobs >= 0) {
            h->lp = chat ? json_array() : new_logprobs();
        }
    }
    int32_t runs = 0; /* choices left to generate */
    for (int32_t k = 0; k < c->num_choices; k++) {
        const pd_resume_choice_t *rc = c->in.resume != NULL ? &c->in.resume[k] : NULL;
        if (rc == NULL || !rc->finished) {
            c->lead = runs++ == 0 ? k : c->lead;
            continue;
        }
        choice_t *h = &c->ch[k]; /* its client had its finish from another node: nothing is sent */
        h->opened = h->done = true;
        h->finish_reason = "stop";
        h->completion_tokens = rc->finished_tokens;
        c->num_done++;
    }
    if (s->cfg.direct_stream && c->in.stream && c->num_choices == 1 && c->in.logprobs < 0 &&
        c->in.tool_parser == PD_TOOL_PARSER_NONE && !c->in.echo) {
        c->direct = pd_direct_new(c->in.chat); /* NULL (out of memory): the loop writes every chunk */
    }
    c->next = s->inflight;
    if (s->inflight != NULL) {
        s->inflight->prev = c;
    }
    s->inflight = c;
    s->num_inflight++;
    /* a decode node loading the prompt's KV: the siblings wait for it (they then hit its blocks) */
    c->deferred = c->in.kv_transfer_params != NULL && runs > 1 &&
                  json_object_get(c->in.kv_transfer_params, "choices") == NULL; /* each loads its own */
    for (int32_t k = c->lead; k < c->num_choices; k++) {
        if (c->ch[k].done || (c->deferred && k != c->lead)) {
            continue;
        }
        if (!submit_choice(c, k)) {
            if (k == c->lead) {
                c->req = NULL;
                unwatch(c);
                c->num_done = c->num_choices; /* nothing was sent */
                creq_free(c);
                pd_http_reply_error(s, req, 503, "ServiceUnavailableError", NULL,
                                    "the engine's queue is full; retry later");
                return;
            }
            choice_t *g = &c->ch[k];
            g->done = true;
            g->finish_reason = "error";
            g->error = strdup("the engine's queue is full");
            c->num_done++;
        }
    }
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_client_close, c);
    if (c->req != NULL) { /* a non-streamed client that leaves is seen now, not at the reply */
        c->watch = pd_client_watch_start(s->base, evhttp_request_get_connection(req));
    }
}
