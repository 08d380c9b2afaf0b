/* server/http_internal.h — state shared by the HTTP front's files: the server (http_server.c:
 * routes, endpoints, metrics, lifecycle) and the generation requests (completion.c: completions and
 * chat completions, their choices, SSE and JSON answers). Everything here runs on the loop thread. */
#ifndef PD_SERVER_HTTP_INTERNAL_H
#define PD_SERVER_HTTP_INTERNAL_H

#include <event2/event.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "common/http_watch.h"
#include "common/metrics.h"
#include "server/chat.h"
#include "server/http_server.h"
#include "server/openai.h"

typedef struct creq creq_t; /* one in-flight generation request (completion.c) */

/* The front's series (server_metrics.c); vllm: ones carry {model_name, engine}. */
typedef struct srv_metrics {
    pd_metric_t *running, *waiting, *kv_usage, *gpu_usage;
    pd_metric_t *prefix_queries, *prefix_hits, *prompt_tokens, *generation_tokens, *preemptions;
    pd_metric_t *success[4]; /* stop, length, abort, error */
    pd_metric_t *req_prompt, *req_gen, *req_max_gen, *req_n, *req_max_tokens;
    pd_metric_t *ttft, *itl, *tpot, *e2e, *queue, *inference, *prefill, *decode;
    pd_metric_t *waiting_remote, *blocks_free, *blocks_cached, *blocks_used, *http_errors, *load_waits,
        *grammar_handed, *grammar_resumed, *handoffs, *resumed, *grammar_ahead, *grammar_ahead_s; /* pd: */
    pd_metric_t *stream_chunks[2]; /* pd:stream_chunks_total{writer="loop"|"engine"} */
    pd_metric_t *prefill_cost[2];  /* pd:prefill_cost_seconds_per_{token,position} */
    uint64_t seen_prefix_queries, seen_prefix_hits, seen_prompt, seen_gen, seen_preempt, seen_load_waits,
        seen_grammar_handed, seen_grammar_resumed, seen_grammar_ahead;
    double seen_grammar_ahead_s;
    /* --kv-offload-tier: pd:kv_offload_{queries,hits,saved_blocks,corrupt_blocks,bytes_written,
     * bytes_read,read_seconds}_total, then the blocks held and the capacity (NULL without a tier) */
    pd_metric_t *offload[9];
    double seen_offload[7];
} srv_metrics_t;

struct pd_http_server {
    pd_http_config_t cfg;
    char model_name[256];
    const char *aliases[PD_FLAG_STRS_MAX]; /* every --served-model-name (aliases[0] = model_name) */
    int num_aliases;
    pd_engine_t *engine;
    pd_chat_t *chat; /* the model's chat template (may have none) */
    int tool_parser; /* --enable-auto-tool-choice --tool-call-parser: a pd_tool_parser_t, 0 = none */
    pd_metrics_t *metrics;
    srv_metrics_t m;
    struct event_base *base;
    struct evhttp *http;
    struct pd_http_guard *guard; /* slow clients' deadline and the connection cap */
    struct event *wake, *sigterm, *sigint, *drain_timer;
    int wake_fd;              /* the engine's outputs wake the loop through this eventfd */
    atomic_bool wake_pending; /* written by the engine thread, cleared by the loop before it takes */
    int port;
    creq_t *inflight; /* generation requests with engine work outstanding */
    int num_inflight;
    int unsent; /* replies handed to libevent and not yet written out */
    bool draining;
    double drain_deadline;
    bool aborted_rest;
    bool said_pending; /* the drain logged that it waits for KV holds */
    int64_t started_at;
};

/* http_server.c: replies (every reply is counted until libevent has written it out). */
void pd_http_track_reply(pd_http_server_t *s, struct evhttp_request *req);
void pd_http_send_json(pd_http_server_t *s, struct evhttp_request *req, int status, json_t *body);
void pd_http_send_error(pd_http_server_t *s, struct evhttp_request *req, const pd_http_error_t *err);
void pd_http_reply_error(pd_http_server_t *s, struct evhttp_request *req, int status, const char *type,
                         const char *param, const char *msg);
/* The body as a NUL-terminated malloc'd copy, or NULL after answering 413/500. */
char *pd_http_read_body(pd_http_server_t *s, struct evhttp_request *req, size_t *len_out);

/* server_metrics.c */
/* Registers the series (after the model name is known) and vllm:cache_config_info. */
void pd_http_metrics_register(pd_http_server_t *s);
/* Gauges and engine counters from a stats snapshot (before a scrape). */
void pd_http_metrics_refresh(pd_http_server_t *s);
/* One admitted generation request: its n and max_tokens (resolved, > 0). */
void pd_http_metrics_admitted(pd_http_server_t *s, int32_t n, int32_t max_tokens);
/* One generated token of a choice: the first (TTFT since arrival) or a later one (ITL). */
void pd_http_metrics_token(pd_http_server_t *s, double since_arrival, double since_last, bool first);
/* One finished engine request (a choice): reason, latencies, token counts. */
void pd_http_metrics_finished(pd_http_server_t *s, const pd_engine_output_t *o);

/* completion.c */
/* POST /v1/completions (chat false) or /v1/chat/completions: validates, submits one engine request
 * per choice (prompts x n) and answers as the outputs arrive. */
void pd_http_handle_generate(pd_http_server_t *s, struct evhttp_request *req, bool chat);
/* Takes the engine's outputs and advances their requests (the wake event's callback). */
void pd_http_dispatch_outputs(pd_http_server_t *s);
/* The engine's output sink (engine thread): writes a plain stream's middle token to its client
 * (server/direct_stream.h). */
bool pd_http_output_sink(void *ctx, pd_engine_output_t *o);
/* Drain start, POST /admin/migrate: migrates every stream pd-proxy can resume elsewhere
 * (PD_RESUMABLE_HEADER), or the max newest (max > 0): each ends without [DONE] once the engine ended
 * it, after leasing its KV for the next node when it can (a stream not submitted yet ends at once).
 * Returns how many. */
int pd_http_hand_off_inflight(pd_http_server_t *s, int max);
/* Drain timeout: aborts the engine work of every in-flight request. */
void pd_http_abort_inflight(pd_http_server_t *s);
/* Shutdown: frees every in-flight request without answering. */
void pd_http_free_inflight(pd_http_server_t *s);

#endif
