/* engine/kv_events_pub.h — vLLM's KV cache events (--kv-events-config) on a ZMQ PUB socket: each
 * engine step's prefix-cache changes (scheduler/kv_events.h) as one msgpack batch, with a sequence
 * number, and a ROUTER socket that replays buffered batches from a given number.
 *
 * Wire format (vLLM's ZmqEventPublisher, msgspec array_like encoding):
 *   PUB multipart:   [topic, seq (8-byte big-endian), payload]
 *   payload:         [ts (float64 s since the epoch), [event, ...]]
 *   event:           ["BlockStored", [hash, ...], parent_hash | nil, [token id, ...], block_size,
 *                     nil (lora_id), medium]
 *                    ["BlockRemoved", [hash, ...], medium]
 *                    ["AllBlocksCleared"]
 *   replay request:  [start_seq (8-byte big-endian)] on a DEALER/REQ socket (ROUTER side: identity,
 *                    empty delimiter, start_seq); answers [seq, payload] per buffered batch from
 *                    start_seq on, then [-1 (8 bytes), ""].
 * Hashes are pd_kv_event_hash keys (the low 64 bits of the chained xxh3-128 block hash). The first
 * batch (seq 0) of a process is AllBlocksCleared. */
#ifndef PD_ENGINE_KV_EVENTS_PUB_H
#define PD_ENGINE_KV_EVENTS_PUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "scheduler/kv_events.h"

typedef struct pd_kv_events_config {
    bool enabled;              /* enable_kv_cache_events */
    char endpoint[256];        /* PUB: bound when it has '*' or is ipc:// / inproc://, else connected */
    char replay_endpoint[256]; /* ROUTER, bound ("" = no replay) */
    int32_t buffer_steps;      /* batches kept for replay */
    int32_t hwm;               /* the PUB socket's send high-water mark */
    int32_t max_queue_size;    /* batches waiting for the publisher thread; more are dropped */
    char topic[128];
} pd_kv_events_config_t;

/* Parses vLLM's --kv-events-config JSON (enable_kv_cache_events, publisher "zmq" | "null",
 * endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic). NULL or "" = disabled.
 * PD_ERR_INVALID_ARG with a message naming the flag for unknown keys and bad values. */
pd_status_t pd_kv_events_config_parse(const char *json, pd_kv_events_config_t *out, char *why,
                                      size_t why_len);

typedef struct pd_kv_events_pub pd_kv_events_pub_t;

/* Binds or connects the sockets and starts the publisher thread. medium: "CPU" or "GPU". */
pd_status_t pd_kv_events_pub_create(const pd_kv_events_config_t *cfg, const char *medium,
                                    pd_kv_events_pub_t **out);

/* Encodes log's events as one batch and queues it (engine thread; never blocks: a full queue drops
 * the batch, which subscribers see as a sequence gap). Nothing for an empty log. */
void pd_kv_events_pub_publish(pd_kv_events_pub_t *pub, const pd_kv_event_log_t *log);

/* The endpoints actually bound (a wildcard port resolved), for /pd/info and the log. */
const char *pd_kv_events_pub_endpoint(const pd_kv_events_pub_t *pub);
const char *pd_kv_events_pub_replay_endpoint(const pd_kv_events_pub_t *pub);

/* Sends what is queued (up to a second), stops the thread, closes the sockets. */
void pd_kv_events_pub_destroy(pd_kv_events_pub_t *pub);

#endif
