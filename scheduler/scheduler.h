/* scheduler/scheduler.h — continuous batching with a token budget, chunked prefill, preemption by
 * recompute, prefix caching, and the KV connector hooks at the points vLLM's V1 scheduler calls
 * them. One scheduler per engine; not thread-safe (the engine thread owns it).
 *
 * Step protocol:
 *   out = pd_scheduler_schedule(s)           — which requests run, how many new tokens each
 *   ... model runs out.items ...
 *   pd_scheduler_update(s, out, &model_out)  — append sampled tokens, stop checks, free blocks,
 *                                              connector completions; finished requests are
 *                                              listed in the update result */
#ifndef PD_SCHEDULER_SCHEDULER_H
#define PD_SCHEDULER_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/strmap.h"
#include "connector/connector.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/request.h"

typedef enum pd_load_failure_policy {
    PD_LOAD_FAILURE_RECOMPUTE = 0, /* compute locally what could not be loaded */
    PD_LOAD_FAILURE_FAIL = 1,      /* finish the request with an error */
} pd_load_failure_policy_t;

typedef struct pd_scheduler_config {
    int32_t max_num_seqs;
    int32_t max_num_batched_tokens;
    int32_t max_model_len;
    int32_t block_size;
    uint32_t num_blocks;
    bool enable_prefix_caching;
    bool enable_chunked_prefill;
    int32_t eos_token_ids[8];
    int32_t num_eos;
    pd_load_failure_policy_t load_failure_policy;
    /* > 0: a fresh request's remote load may wait up to this many seconds (from its first wait)
     * while another request loads the same prefix (scheduler.c: shares_inflight_load); 0: never */
    double load_share_wait;
    int32_t vocab_size; /* > 0: output tokens from outside (a prefill's first token) are checked */
    bool kv_events;     /* log the prefix cache's changes (pd_scheduler_kv_events) */
    /* KV cache groups (scheduler/kv_cache_manager.h): 0 or 1 = one full-attention group */
    int32_t num_kv_groups;
    int32_t kv_group_window
        [PD_KV_MANAGER_MAX_GROUPS]; /* per group: 0 = full attention, else the sliding window */
} pd_scheduler_config_t;

typedef struct pd_sched_item {
    pd_request_t *req;
    int32_t num_new_tokens; /* tokens computed this step, from req->num_computed_tokens on */
} pd_sched_item_t;

typedef struct pd_scheduler_output {
    pd_sched_item_t *items;
    int32_t num_items;
    int32_t total_tokens;
    pd_request_t **preempted; /* left the running set this step (drop them from the input batch) */
    int32_t num_preempted;
    void *connector_meta;
} pd_scheduler_output_t;

/* Per scheduled item: the sampled token, or -1 when the step computed only part of a prompt. With
 * draft tokens (speculative decoding) an item may carry several: the accepted drafts and the token
 * sampled after them, at sampled[i × stride ...]. */
typedef struct pd_model_output {
    const int32_t *sampled;            /* [num_items × stride] */
    const int32_t *num_sampled;        /* [num_items] tokens of item i (>= 1 when sampled); NULL: 1 each */
    int32_t stride;                    /* 0 means 1 */
    pd_connector_finished_t finished;  /* from the connector's get_finished, or empty */
    const uint32_t *load_error_blocks; /* from get_block_ids_with_load_errors */
    int32_t num_load_error_blocks;
} pd_model_output_t;

/* What an update changed, for the frontend. */
typedef struct pd_scheduler_update_result {
    pd_request_t **with_new_token; /* requests that got tokens this step */
    const int32_t *num_new_tokens; /* [num_with_new_token] how many each got (its last tokens) */
    int32_t num_with_new_token;
    pd_request_t **finished; /* requests that finished by this update and before it (the array moves
                              * when pd_scheduler_finish adds one: read pd_scheduler_finished then) */
    int32_t num_finished;
} pd_scheduler_update_result_t;

typedef struct pd_scheduler pd_scheduler_t;

/* Creates a scheduler; connector may be NULL. PD_ERR_INVALID_ARG for impossible limits. */
pd_status_t pd_scheduler_create(const pd_scheduler_config_t *cfg, pd_connector_t *connector,
                                pd_scheduler_t **sched_out);

/* Calls fn(arg, req) just before the scheduler frees a request (finished and released, or at
 * destroy), so a frontend can free what it attached to req->user. */
void pd_scheduler_set_release_hook(pd_scheduler_t *s, void (*fn)(void *arg, pd_request_t *req), void *arg);

/* A fresh waiting request is admitted only once ready(arg, req) says so (the engine: its structured
 * output's grammar is being made ready, vLLM's WAITING_FOR_FSM); requests behind it may go first. */
void pd_scheduler_set_admit_hook(pd_scheduler_t *s, bool (*ready)(void *arg, pd_request_t *req), void *arg);

/* Frees the scheduler and every request it still owns. */
void pd_scheduler_destroy(pd_scheduler_t *s);

/* Hands req (state WAITING) to the scheduler, which owns it from now on. PD_ERR_INVALID_ARG on a
 * duplicate id (the caller keeps ownership then). */
pd_status_t pd_scheduler_add_request(pd_scheduler_t *s, pd_request_t *req);

/* Aborts a request in any state: it finishes as ABORTED, its blocks are freed (or held while the
 * connector says a peer may still use them). Returns the request (valid until the next schedule,
 * so a frontend can drop it from its batch) or NULL for an unknown or already finished id. */
pd_request_t *pd_scheduler_abort(pd_scheduler_t *s, const char *id);

/* Finishes a running request from outside the stop checks (stop strings found by the frontend).
 * Same lifetime rules as abort. */
void pd_scheduler_finish(pd_scheduler_t *s, pd_request_t *req, pd_request_state_t state);

/* The requests finished since the last schedule (by the update, aborts, pd_scheduler_finish or
 * pd_scheduler_add_output_token); the array is valid until the next call that finishes one. */
pd_request_t *const *pd_scheduler_finished(const pd_scheduler_t *s, int32_t *num_out);

struct pd_kv_event_log;
/* The prefix cache's events since the engine last reset the log (config.kv_events; else NULL). It
 * starts with AllBlocksCleared: a subscriber learns that this cache begins empty. */
struct pd_kv_event_log *pd_scheduler_kv_events(pd_scheduler_t *s);

/* Output tokens sampled on another node: a prefill's first token (first-token handover), or the
 * tokens a decode node streamed before it died or handed the request on (resume_token_ids).
 * Appends toks[n] to req as if sampled here: the stop checks run after each (one may finish req, and
 * the rest are dropped), and the first token time is set. Seeded sampling needs nothing more: each
 * output position draws from its own generator (request.h). Only before req has outputs. Returns
 * how many were appended, or -1 (nothing changed) for n < 1, a token outside the vocabulary, or a
 * request that has outputs or has finished. */
int32_t pd_scheduler_add_output_tokens(pd_scheduler_t *s, pd_request_t *req, const int32_t *toks, int32_t n);

/* The same for one token (the first-token handover): whether it was appended. */
bool pd_scheduler_add_output_token(pd_scheduler_t *s, pd_request_t *req, int32_t token);

/* Plans one step. The output is owned by the scheduler and valid until the next schedule. */
const pd_scheduler_output_t *pd_scheduler_schedule(pd_scheduler_t *s);

/* Applies the step's results. *result is owned by the scheduler, valid until the next schedule. */
void pd_scheduler_update(pd_scheduler_t *s, const pd_scheduler_output_t *out,
                         const pd_model_output_t *model_out, pd_scheduler_update_result_t *result);

/* Makes r (running) hold blocks for its first num_tokens positions, for a draft model that writes
 * its KV ahead of the target's (vLLM's lookahead slots); they are not prefix-cached, and the next
 * update's rollback gives back what the tokens do not cover. false when the pool cannot supply
 * them (nothing allocated; nothing is preempted for drafts). */
bool pd_scheduler_reserve_lookahead(pd_scheduler_t *s, pd_request_t *r, int32_t num_tokens);

/* Looks a live (not yet released) request up by id. */
pd_request_t *pd_scheduler_find(const pd_scheduler_t *s, const char *id);

typedef struct pd_scheduler_stats {
    int32_t num_running;
    int32_t num_waiting;
    int32_t num_waiting_for_remote_kv;
    int32_t num_holding; /* finished, blocks held for a remote reader */
    uint64_t num_preemptions;
    uint64_t num_load_waits; /* remote loads put off while another request loaded the same prefix */
    uint64_t prefix_queries, prefix_hits;
    double kv_usage;
    uint32_t blocks_free, blocks_cached_free, blocks_used;
    /* speculative decoding (vLLM's spec_decode counters): items that carried drafts, their draft
     * tokens, the drafts accepted, and accepted drafts by position */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_accepted_per_pos[PD_SPEC_MAX_TOKENS];
} pd_scheduler_stats_t;

void pd_scheduler_get_stats(const pd_scheduler_t *s, pd_scheduler_stats_t *out);

/* Only the spec_* fields of the stats (cheap: no queue walk); the rest of out is left as it is. */
void pd_scheduler_get_spec_stats(const pd_scheduler_t *s, pd_scheduler_stats_t *out);

/* Requests in the running set now. */
int32_t pd_scheduler_num_running(const pd_scheduler_t *s);

/* True when nothing is waiting, running or held, and no offload tier load is in flight. */
bool pd_scheduler_idle(const pd_scheduler_t *s);

/* The KV cache manager (tests and metrics read the pool through it). */
pd_kv_cache_manager_t *pd_scheduler_kv(pd_scheduler_t *s);

#endif
