/* proxy/proxy.h — pd-proxy: the OpenAI front of a disaggregated deployment (DESIGN.md §7).
 *
 * For each /v1/completions it picks a prefill and a decode node and runs the mode's sequence:
 *   pull  POST the prompt to the prefill (max_tokens 1, kv_transfer_params.do_remote_decode),
 *         then POST the original request plus the prefill's kv_transfer_params to the decode and
 *         stream its answer back;
 *   push  POST both at once: the decode gets {do_remote_prefill, transfer_mode push, transfer_id,
 *         the prefill's KV address}, the prefill {do_remote_decode, transfer_mode push,
 *         transfer_id}; the decode's answer streams back.
 * A prefill that fails before producing KV (connection refused, 5xx) is retried on another
 * prefill; in pull mode a decode that cannot be reached is retried on another decode. A client
 * disconnect closes the upstream connections, so both nodes abort. Nodes are probed every
 * --health-interval (/health, /pd/info, /metrics) and marked unhealthy and back.
 * Everything runs on one libevent loop. */
#ifndef PD_PROXY_PROXY_H
#define PD_PROXY_PROXY_H

#include <stdbool.h>

#include "common/flags.h"
#include "common/status.h"

typedef struct pd_proxy_config {
    const char *host;
    int port;
    const char *port_file;
    const char *prefill; /* comma-separated base URLs: http://127.0.0.1:8100,... */
    const char *decode;
    const char *discover_prefill; /* DNS name:port of a headless service (A records) */
    const char *discover_decode;
    const char *discover_prefill_file; /* a file of prefill URLs, one a line (re-read each interval) */
    const char *discover_decode_file;
    double discover_interval;
    const char *policy;             /* round-robin | least-loaded | prefix-affinity | kv-aware */
    bool first_token_from_prefill;  /* streamed requests: the prefill's first token is streamed at once */
    int migration_limit;            /* times a request is resumed on another decode node (0: never) */
    int rebalance_threshold;        /* a decode running this many more resumable streams than another
                                     * migrates half the difference live (0: never) */
    bool kv_events;                 /* subscribe to the nodes' KV cache events and index their blocks */
    int kv_index_max_blocks;        /* block keys the index holds at most */
    double kv_aware_load_weight;    /* kv-aware: what one request of load costs against a full prefix hit */
    double kv_aware_recent_s;       /* a prompt sent to a node counts as held there this long (0: off) */
    int local_prefill_threshold;    /* the decode prefills prompts with fewer uncached tokens (0: never) */
    double local_prefill_hit_ratio; /* ... or of which it holds this share (0: off) */
    int prefix_fetch_min_blocks;    /* another node holds this many more prefix blocks than the chosen
                                     * prefill: it lends them (kv_fetch.c; 0: off) */
    double prefix_fetch_timeout;    /* s a lend may take before the prefill leg goes without it */
    double health_interval;
    double upstream_timeout; /* s an upstream request may take */
    int idle_connections;    /* idle upstream connections kept per node for the next request (0: none) */
    int affinity_prefix_chars;
    size_t max_request_bytes;
    double request_timeout;   /* s a client connection has to deliver a whole request (slowloris) */
    int max_connections;      /* client connections at most (0: half the fd limit) */
    const char *api_key;      /* when set, /v1/ and tokenizer routes need "Authorization: Bearer KEY" */
    const char *node_api_key; /* sent to the nodes; unset: the client's Authorization is forwarded */
} pd_proxy_config_t;

void pd_proxy_config_defaults(pd_proxy_config_t *cfg);
/* Writes up to max of pd-proxy's flags (bound to cfg) to out; returns how many there are, which
 * may be more than max. */
size_t pd_proxy_flags(pd_proxy_config_t *cfg, pd_flag_t *out, size_t max);

/* Serves until SIGTERM/SIGINT. PD_ERR_INVALID_ARG for a bad node list, PD_ERR_IO when the port
 * cannot be bound. */
pd_status_t pd_proxy_run(const pd_proxy_config_t *cfg);

#endif
