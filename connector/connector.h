/* connector/connector.h — the KV connector interface (DESIGN.md §5; vLLM V1 KVConnector
 * semantics). One object has a scheduler half, called by the scheduler on the engine thread, and
 * a worker half, called by the model runner around and inside the forward. The scheduler runs
 * with no connector (NULL) and then never enters WAITING_FOR_REMOTE_KV.
 *
 * Contracts:
 *  - get_num_new_matched_tokens has no side effects and may be called repeatedly for a request;
 *    PD_ERR_REJECTED ends the request with an error before it is computed (a lend whose prefix this
 *    node no longer holds), any other error counts as no external tokens.
 *  - update_state_after_alloc follows a successful allocation for that request, with all its
 *    block ids and how many tokens the connector will load. It may refuse (out of memory, where
 *    vLLM's would raise): the scheduler then ends the request with an error rather than let it
 *    wait for a load nobody will report.
 *  - Block id lists (update_state_after_alloc, request_finished) are the scheduler's: with G KV
 *    cache groups, G ids per logical block interleaved (ids[b × G + g]), num_blocks = logical
 *    blocks × G; 0 is an entry a sliding-window group does not hold (outside its window).
 *  - request_finished is called exactly once per request; returning true (delay free) keeps the
 *    request's blocks until its id is reported in finished_sending.
 *  - get_finished reports ids whose sends/receives completed since the last call; blocks that
 *    failed to load are reported by get_block_ids_with_load_errors no later than the step in
 *    which their request appears in finished_recving. */
#ifndef PD_CONNECTOR_CONNECTOR_H
#define PD_CONNECTOR_CONNECTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "common/page_range.h"
#include "common/status.h"
#include "scheduler/request.h"

typedef struct pd_connector pd_connector_t;
struct pd_scheduler_output;
struct pd_prefill_cost;

/* Request ids completed since the last get_finished (arrays owned by the connector, valid until
 * the next call). */
typedef struct pd_connector_finished {
    const char *const *sending;
    int32_t num_sending;
    const char *const *recving;
    int32_t num_recving;
    const int32_t *recving_first_token;       /* [num_recving] first-token handover in push mode: the token
                                         * the prefill sampled (WRITE_DONE), else -1; NULL: none */
    const char *const *recving_grammar_state; /* [num_recving] with that token, a structured output's
                                               * grammar state after it (pd_gmatcher_export), else
                                               * NULL; valid until the next get_finished */
} pd_connector_finished_t;

/* A pipe that needs to own the KV memory (UCX shared-memory puts) provides these; the engine
 * allocates its KV region through them. */
typedef struct pd_kv_region_allocator {
    void *ctx;
    pd_status_t (*alloc)(void *ctx, size_t bytes, void **ptr_out);
    void (*free)(void *ctx, void *ptr);
} pd_kv_region_allocator_t;

/* How the connector moves pages between a device KV and its host mirror (vLLM's
 * set_host_xfer_buffer_ops): the engine passes its backend's copies, the connector knows no
 * backend. copy_pages copies ranges[n] between two regions of one layout at the same offsets
 * (to_host: device → host) and returns when the bytes have landed; pin_host / unpin_host
 * page-lock the mirror (NULL: nothing to do). */
typedef struct pd_kv_copy_ops {
    void *ctx;
    pd_status_t (*copy_pages)(void *ctx, void *dst, const void *src, const pd_page_range_t *ranges, int n,
                              bool to_host);
    pd_status_t (*pin_host)(void *ctx, void *ptr, size_t bytes);
    void (*unpin_host)(void *ctx, void *ptr);
} pd_kv_copy_ops_t;

/* Where the KV cache lives, for registration with a pipe (one region, per-layer views). */
typedef struct pd_kv_region_desc {
    void *base;
    pd_kv_copy_ops_t copy; /* the engine's copies, for staging a device KV (copy_pages NULL: none) */
    bool host_memory;      /* base is host memory (else device memory of the engine's backend) */
    size_t bytes;
    int32_t num_layers;
    size_t layer_offset[PD_MAX_LAYERS]; /* byte offset of each layer's view */
    size_t page_bytes;                  /* one (layer, block) page */
    uint32_t num_blocks;
    int32_t block_size;
    int32_t num_groups;                 /* KV cache groups (0 or 1: one) */
    int32_t layer_group[PD_MAX_LAYERS]; /* layer → its group: the entries of a block list it reads */
    char group_layout[128];             /* pd_kv_cache_config_layout: peers must agree on it */
} pd_kv_region_desc_t;

typedef struct pd_connector_ops {
    const char *name;
    /* --- scheduler half --- */
    /* Optional (NULL: any). Why this node cannot serve a request with these kv_transfer_params
     * (json_t*, not NULL), or NULL when it can: a decode asked to prefill for another node
     * (do_remote_decode), a prefill asked to load (do_remote_prefill). The engine refuses such a
     * request (400) instead of running it in a role the node does not play. No side effects. */
    const char *(*params_error)(pd_connector_t *c, const void *kv_transfer_params);
    pd_status_t (*get_num_new_matched_tokens)(pd_connector_t *c, const pd_request_t *req,
                                              int32_t num_computed, int32_t *num_external_out,
                                              bool *load_async_out);
    pd_status_t (*update_state_after_alloc)(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                            int32_t num_blocks, int32_t num_external_tokens);
    /* Optional (NULL: never). Whether req's asynchronous load, not started yet, may be put off while
     * another request loads the same prefix (the scheduler then finds those blocks in its prefix
     * cache and loads less): true for loads this node reads (pull), false where a peer writes into
     * blocks this request reserves (push). No side effects. */
    bool (*load_may_wait)(pd_connector_t *c, const pd_request_t *req);
    /* Builds this step's metadata for the worker half; owned by the connector. */
    void *(*build_connector_meta)(pd_connector_t *c, const struct pd_scheduler_output *out);
    /* Returns delay_free; may set *kv_transfer_params_out (json_t*, ownership to the caller). */
    bool (*request_finished)(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                             int32_t num_blocks, void **kv_transfer_params_out);
    /* --- worker half --- */
    pd_status_t (*register_kv_caches)(pd_connector_t *c, const pd_kv_region_desc_t *region);
    pd_status_t (*bind_connector_metadata)(pd_connector_t *c, void *meta);
    pd_status_t (*start_load_kv)(pd_connector_t *c);
    pd_status_t (*wait_for_layer_load)(pd_connector_t *c, int32_t layer);
    pd_status_t (*save_kv_layer)(pd_connector_t *c, int32_t layer);
    pd_status_t (*wait_for_save)(pd_connector_t *c);
    pd_status_t (*get_finished)(pd_connector_t *c, pd_connector_finished_t *out);
    /* Writes up to max block ids whose load failed since the last call; returns the count. */
    int32_t (*get_block_ids_with_load_errors)(pd_connector_t *c, uint32_t *ids_out, int32_t max);
    void (*destroy)(pd_connector_t *c);
} pd_connector_ops_t;

/* First-token handover (the proxy sets kv_transfer_params "first_token": true on both legs): a
 * prefill node's request ends after its first output token unless that token ends it, its
 * kv_transfer_params name that token ("first_token_id"; push: WRITE_DONE carries it), and the
 * decode node continues from it with the KV of every prompt token. */

/* Whether a request with these kv_transfer_params (json_t*, may be NULL) is a prefill's that hands
 * over after its first token. */
bool pd_kv_params_hands_over(const void *kv_transfer_params);

/* The first output token a decode node's request continues from ("first_token_id" of a pull
 * handover), or -1 (none, or not a non-negative integer). */
int32_t pd_kv_params_first_token(const void *kv_transfer_params);

/* Live migration: whether these kv_transfer_params (json_t*) are a decode's lease of a running
 * request's KV (POST /admin/migrate, a drain), to go with resume_token_ids: pull parameters for the
 * first num_tokens tokens of prompt and resumed outputs (all but the last), no first token. */
bool pd_kv_params_migrates(const void *kv_transfer_params, int32_t num_tokens);

/* Resumption after a decode died: whether kv_transfer_params go with resume_token_ids as a live
 * migration's lease (pd_kv_params_migrates) or as only a prompt prefix to fetch ({"kv_prefix": a
 * lend's params}: the prefill that computed the prompt lent it; the resumed tokens are computed). */
bool pd_kv_params_resumes(const void *kv_transfer_params, int32_t num_tokens);

struct pd_connector {
    const pd_connector_ops_t *ops;
    void *impl;
    /* Set by the engine: a connector thread calls wake(wake_arg) when get_finished has news, so an
     * engine with nothing runnable sleeps instead of polling. */
    void (*wake)(void *arg);
    void *wake_arg;
    /* Set by the engine: what computing prompt tokens costs on this node, which the engine thread
     * fits to its steps (scheduler/prefill_cost.h; NULL: unknown). The connector's scheduler half
     * (same thread) weighs fetching a prefix from a peer against computing it. */
    const struct pd_prefill_cost *compute_cost;
};

#endif
