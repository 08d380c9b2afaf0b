/* connector/kv_connector.h — the P/D KV connector over a pipe (DESIGN.md §5): moves a request's
 * prompt KV from a prefill engine to a decode engine, in one of two modes.
 *
 *   pull  the prefill finishes (max_tokens 1), holds its blocks under a lease and returns
 *         kv_transfer_params naming them; the decode allocates, waits in WAITING_FOR_REMOTE_KV,
 *         reads only the blocks it lacks (one-sided on UCX), sends READ_DONE; the prefill answers
 *         ACK while the lease holds (else STALE: the decode discards the KV) and frees the blocks.
 *   push  the decode reserves blocks and sends the prefill a Reservation; the prefill writes each
 *         layer's pages into them as soon as that layer is computed (wait_for_save bounds the
 *         step) and sends WRITE_DONE; a reservation that arrives after the prefill ran is served
 *         from the held blocks.
 *
 * Threads: the scheduler and worker halves run on the engine thread; one control thread
 * ("kv-ctl") owns the pipe, the control connections (handshake, heartbeats, notifications) and
 * every timeout. They share nothing but a mailbox (kv_mail.h: commands one way, events the
 * other; kv_conn.h names each thread's state); the control thread wakes the engine through
 * pd_connector_t.wake when it queues an event (a transfer finished).
 *
 * Staging: when the pipe cannot register the KV's memory (device KV over ucx/tcp), or with
 * --kv-staging always, the pipe allocates a host mirror of the KV region (same layout, page-locked
 * by the backend when it can) and the connector copies pages through it: the prefill copies each
 * layer's new pages device→host in save_kv_layer, right after the layer wrote them; the decode
 * copies a finished load's pages host→device in get_finished, before the scheduler hears of it.
 * Peers see only the mirror, so the wire protocol does not change.
 *
 * Load-wise, not layer-wise: a decode's load completes before the request is scheduled, so
 * wait_for_layer_load has nothing to wait for (as vLLM's NIXL connector). */
#ifndef PD_CONNECTOR_KV_CONNECTOR_H
#define PD_CONNECTOR_KV_CONNECTOR_H

#include <jansson.h>
#include <stddef.h>

#include "common/flags.h"
#include "common/metrics.h"
#include "connector/connector.h"
#include "pd.pb-c.h"

typedef struct pd_kv_connector_config {
    const char *role;                /* prefill | decode */
    const char *mode;                /* pull | push (--kv-transfer-mode) */
    const char *pipe;                /* ucx | tcp | nccl (--kv-pipe) */
    const char *listen;              /* HOST:PORT of the control listener (port 0 = any free) */
    const char *advertise_host;      /* host peers dial (default: the listen host) */
    int advertise_port;              /* port peers dial (0 = the listen port: behind a NAT or a relay) */
    int data_port;                   /* tcp pipe: the data listener's port (0 = any free) */
    const char *ucx_err_mode;        /* none | peer */
    const char *cluster_token_file;  /* secret shared by the cluster (required unless insecure_no_kv_auth) */
    bool insecure_no_kv_auth;        /* --insecure-no-kv-auth: run without a token, any peer accepted */
    double hold_timeout;             /* s a prefill holds blocks for a reader / a reservation */
    double load_timeout;             /* s a decode waits for remote KV */
    double handshake_timeout;        /* s for dial + handshake + region exchange */
    double heartbeat_interval;       /* s between heartbeats */
    int heartbeat_misses;            /* silent intervals before a peer is declared dead */
    int tcp_busy_poll_us;            /* tcp pipe: receiver polling window after a request (0 = off) */
    double save_timeout;             /* s wait_for_save waits for one step's writes */
    const char *load_failure_policy; /* the engine's (for the policy-action metric) */
    bool prefault;                   /* touch the KV region's pages in a background thread */
    const char *staging;             /* auto | always (--kv-staging) */
    const char *transfer_config;     /* vLLM's --kv-transfer-config JSON (pd_kv_transfer_config_apply) */
    const char *prefix_fetch;        /* auto | always | never (--kv-prefix-fetch, kv_cost.c) */
} pd_kv_connector_config_t;

void pd_kv_connector_config_defaults(pd_kv_connector_config_t *cfg);

/* The connector's flags (--kv-transfer-mode, --kv-pipe, --kv-listen, ...) for a binary's table:
 * writes at most max, returns how many there are. */
size_t pd_kv_connector_flags(pd_kv_connector_config_t *cfg, pd_flag_t *out, size_t max);

/* Applies vLLM's --kv-transfer-config JSON text (NULL or "": nothing) to cfg, whose role is set:
 * kv_connector (PdConnector; NixlConnector = the ucx pipe, P2pNcclConnector = nccl), kv_role
 * (kv_producer for a prefill, kv_consumer for a decode), kv_ip/kv_port (the control listener; the
 * one not given keeps --kv-listen's value) and
 * kv_connector_extra_config (transfer_mode, pipe, advertise_host, advertise_port, data_port, ucx_err_mode,
 * cluster_token_file, hold/load/handshake_timeout, heartbeat_interval/misses, staging). Its values
 * win over the flags. PD_ERR_INVALID_ARG (logged, naming the key) for anything else. *keep_out
 * holds the JSON cfg's strings now point into: decref it after the connector is destroyed. */
pd_status_t pd_kv_transfer_config_apply(const char *text, pd_kv_connector_config_t *cfg, json_t **keep_out);

/* Creates the connector and its pipe (not yet listening). Metrics are registered in m (may be
 * NULL). PD_ERR_INVALID_ARG for a bad role/mode/listen address, PD_ERR_NOT_FOUND for a pipe kind
 * this build lacks, PD_ERR_IO for an unreadable token file, PD_ERR_INVALID_ARG without a token unless
 * insecure_no_kv_auth. */
pd_status_t pd_kv_connector_create(const pd_kv_connector_config_t *cfg, pd_metrics_t *m,
                                   pd_connector_t **out);

/* The allocator the engine must use for a host KV region (the pipe owns the memory, so UCX can put
 * into it over shared memory); NULL with --kv-staging always (the backend allocates the KV and the
 * pipe a mirror). The engine ignores it for device KV. Valid for the connector's lifetime. */
const pd_kv_region_allocator_t *pd_kv_connector_allocator(pd_connector_t *c);

/* Binds the control listener and starts the control thread; fp is copied. Call after the engine
 * registered its KV caches. PD_ERR_IO when the address cannot be bound. */
pd_status_t pd_kv_connector_start(pd_connector_t *c, const Pd__Fingerprint *fp);

/* The bound control port (after start). */
int pd_kv_connector_port(const pd_connector_t *c);

/* This engine's id (random per process start). */
const char *pd_kv_connector_engine_id(const pd_connector_t *c);

/* {role, engine_id, kv_host, kv_port, transfer_mode, pipe} for /pd/info (caller owns). */
json_t *pd_kv_connector_info(const pd_connector_t *c);

/* A node's drain once no HTTP request is in flight (pd_http_config_t.drain_pending, ctx the
 * connector). A prefill: the reservations no prompt will take now end (their decodes recompute at
 * once), and the answer is the KV it still holds for decodes (leases not read or expired, writes in
 * flight). A decode: its leases not read or expired (live migrations to the decodes that took its
 * requests over, prefix lends). Asks the control thread and waits for it (1 s at most). */
int pd_kv_connector_drain_pending(void *c);

/* Stops the control thread and destroys the pipe (pending transfers complete as cancelled); the
 * engine may then free its KV region. Idempotent. */
void pd_kv_connector_stop(pd_connector_t *c);

/* Stops (if needed) and frees everything (also via ops->destroy). */
void pd_kv_connector_destroy(pd_connector_t *c);

/* Prefill: gives up what it holds for a decode that will not come (the proxy calls it, through
 * POST /pd/release, when the decode leg failed or its client left): the pull lease of request_id
 * with lease_id, or whatever it holds for transfer_id (the proxy's random id, in the request's
 * kv_transfer_params): a pull lease, the push transfer waiting for its reservation, or — not
 * finished yet — nothing when it finishes. Its blocks are freed at the next step. The ids are the
 * capability (random, known only to the proxy and the params' receiver). Returns whether something
 * was released (an id not seen yet counts: it is remembered). */
bool pd_kv_connector_release(pd_connector_t *c, const char *request_id, uint64_t lease_id,
                             const char *transfer_id);

/* The fetch-or-compute choice (kv_cost.c): fetching bytes of a prefix costs overhead_s + bytes /
 * bytes_per_s (written to *fetch_s; bandwidth 0: unknown, taken as endless); true when that beats
 * computing it, compute_s (scheduler/prefill_cost.h's estimate; 0: unknown, so fetch). */
bool pd_kv_fetch_pays(double bytes, double overhead_s, double bytes_per_s, double compute_s, double *fetch_s);

/* The compatibility fingerprint of a model (model_id from pd_model_fingerprint; the strings are
 * referenced, not copied) served with these KV settings. pd_kv_connector_start adds the KV cache
 * group layout to its layout field. */
void pd_kv_fingerprint(const char *model_id, const char *kv_dtype, int32_t block_size, int32_t num_kv_heads,
                       int32_t head_size, int32_t num_layers, Pd__Fingerprint *fp_out);

#endif
