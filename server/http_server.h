/* server/http_server.h — the HTTP front every node runs (DESIGN.md §7): an OpenAI-compatible
 * /v1/completions (JSON or SSE streaming), /v1/models, /health and /metrics (Prometheus text),
 * on a libevent loop in the calling thread, talking to the engine thread through its submit /
 * abort / output queues (engine outputs wake the loop with event_active; no polling).
 * SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish or are aborted at
 * --drain-timeout, then pd_http_server_run returns. */
#ifndef PD_SERVER_HTTP_SERVER_H
#define PD_SERVER_HTTP_SERVER_H

#include <stddef.h>

#include "common/flags.h"
#include "common/metrics.h"
#include "engine/engine.h"

typedef struct pd_http_config {
    const char *host;                  /* default 127.0.0.1 */
    int port;                          /* 0 = any free port (see port_file) */
    const char *port_file;             /* written with the bound port once listening */
    const char *api_key;               /* when set, /v1/ requests need "Authorization: Bearer KEY" */
    size_t max_request_bytes;          /* bodies above get 413 */
    double drain_timeout;              /* seconds in-flight requests get after SIGTERM */
    double request_timeout;            /* s a connection has to deliver a whole request (slowloris) */
    int max_connections;               /* client connections at most (0: half the fd limit) */
    pd_flag_strs_t served_model_names; /* the first names the model in answers, all are accepted
                                        * (default: the model directory's name) */
    int max_json_depth;
    const char *info_json;        /* P/D nodes: served at GET /pd/info (role, engine id, KV address) */
    const char *chat_template;    /* --chat-template: a file or the template text (NULL: the model's) */
    bool enable_auto_tool_choice; /* --enable-auto-tool-choice: tool_choice "auto" reads tool calls */
    bool direct_stream;           /* --direct-stream: the engine thread writes plain streams (issue 53) */
    const char *tool_call_parser; /* --tool-call-parser: which format (tool_calls.h) */
    /* P/D prefill nodes: POST /pd/release {"remote_request_id", "lease_id"} or {"transfer_id"} gives
     * up the KV held for a decode that will not come (pd_kv_connector_release); NULL: no route */
    bool (*release_kv)(void *ctx, const char *request_id, uint64_t lease_id, const char *transfer_id);
    void *release_ctx;
    /* P/D prefill nodes: what a drain still waits for after the last reply (the KV it holds for
     * decodes: leases not yet read or expired, pushes not yet written), or NULL */
    int (*drain_pending)(void *ctx);
} pd_http_config_t;

void pd_http_config_defaults(pd_http_config_t *cfg);

/* Flags for a binary's table (--host, --port, --port-file, --api-key, --max-request-bytes,
 * --drain-timeout, --served-model-name): writes at most max, returns how many there are. */
size_t pd_http_flags(pd_http_config_t *cfg, pd_flag_t *out, size_t max);

typedef struct pd_http_server pd_http_server_t;

/* Binds host:port and prepares routes; the engine must not be started yet (the server starts
 * it). Loads the chat template (chat.h): PD_ERR_PARSE when it does not parse. PD_ERR_IO when the
 * address cannot be bound. */
pd_status_t pd_http_server_create(const pd_http_config_t *cfg, pd_engine_t *engine, pd_metrics_t *metrics,
                                  pd_http_server_t **srv_out);

/* Serves until SIGTERM/SIGINT (or pd_http_server_shutdown) and the drain completes. */
pd_status_t pd_http_server_run(pd_http_server_t *srv);

/* Starts the drain from inside the loop's thread (tests, embedding). */
void pd_http_server_shutdown(pd_http_server_t *srv);

/* The bound port. */
int pd_http_server_port(const pd_http_server_t *srv);

void pd_http_server_destroy(pd_http_server_t *srv);

#endif
