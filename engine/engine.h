/* engine/engine.h — the engine core of one node (DESIGN.md §3): model, KV cache, scheduler,
 * model runner, optional KV connector, and the request/output plumbing to a frontend.
 *
 * Two ways to drive it:
 *   - synchronously (offline CLI, tests): pd_engine_add, then pd_engine_step until idle;
 *   - from a frontend thread: pd_engine_start runs the step loop on its own thread;
 *     pd_engine_submit / pd_engine_abort_async queue work (thread-safe, bounded by --max-queue)
 *     and pd_engine_take_outputs collects results after the notify callback fires.
 * Every step does bounded work: at most max_num_batched_tokens tokens, max_num_seqs sequences. */
#ifndef PD_ENGINE_ENGINE_H
#define PD_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/flags.h"
#include "common/metrics.h"
#include "connector/connector.h"
#include "engine/kv_init.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "scheduler/request.h"

typedef struct pd_engine_config {
    const char *model_dir;
    const char *device;           /* "cpu" */
    const char *matmul_precision; /* fp32 | tf32 | bf16 | fp16 (--matmul-precision) */
    const char *cpu_isa;          /* --cpu-isa: auto (PD_CPU_ISA or none) | portable | ... | amx */
    bool batch_invariant;         /* --batch-invariant (or PD_BATCH_INVARIANT=1): kernels chosen so a
                                   * request's bits do not depend on its batch or chunking (CPU) */
    int threads;                  /* 0 = all cores */
    int block_size;
    int max_num_seqs;
    int max_num_batched_tokens;
    int max_model_len;          /* 0 = the model's max_position_embeddings */
    const char *kv_cache_dtype; /* auto (= the model's torch_dtype, fp32 if none) | fp32 | fp16 | bf16 */
    double memory_utilization;
    int tensor_parallel_size; /* vLLM's --tensor-parallel-size: only 1 (one device per engine) */
    const char *dtype;        /* vLLM's --dtype: auto | bfloat16 | float16 | half | float32 | float */
    const char *quantization; /* --quantization: none | int8 (linear layers, per-channel scales, CPU) */
    size_t kv_cache_memory;   /* CPU: bytes to plan the KV cache in; 0 = physical RAM */
    bool enable_prefix_caching;
    const char *kv_offload_tier;  /* --kv-offload-tier: none | host | disk (engine/kv_offload.h) */
    size_t kv_offload_size;       /* its capacity in bytes */
    const char *kv_offload_path;  /* disk: the file */
    const char *kv_offload_load;  /* --kv-offload-load: auto | thread | inline (engine/kv_tier_loader.h) */
    double kv_offload_read_delay; /* tests (no flag): each tier block's read takes this much longer */
    double grammar_walk_delay;    /* tests (no flag): each grammar's walk ahead starts this much later */
    bool enable_chunked_prefill;
    const char *load_failure_policy; /* recompute | fail */
    double load_share_wait;          /* s a pull load may wait for another's of its prefix; 0 = never */
    const char *generation_config;   /* auto (the model's generation_config.json) | vllm (ignore it) */
    int max_queue;                   /* submitted-but-not-admitted requests before 503s */
    int num_blocks_override;         /* > 0: KV blocks regardless of profiling (vLLM's override) */
    const char *speculative_config;  /* vLLM's --speculative-config JSON (engine/spec_decode.h), or NULL */
    const char *kv_events_config;    /* vLLM's --kv-events-config JSON (engine/kv_events_pub.h), or NULL */
    pd_connector_t *connector;       /* NULL: no KV transfer (pd-serve) */
    const pd_kv_region_allocator_t *kv_allocator;
    pd_metrics_t *metrics; /* optional: the engine adds its step-duration histogram */
} pd_engine_config_t;

/* vLLM-like defaults (block 16, 256 seqs → 64 on CPU, 2048 batched tokens, prefix caching on). */
void pd_engine_config_defaults(pd_engine_config_t *cfg);

/* The engine's flags (vLLM names) for a binary's flag table: writes at most max entries to out
 * and returns how many there are (more than max: the caller's array is short). */
size_t pd_engine_flags(pd_engine_config_t *cfg, pd_flag_t *out, size_t max);

#define PD_MAX_STOP_STRINGS 8

/* A request as a frontend submits it (copied by the engine). */
typedef struct pd_engine_request {
    const char *id;
    const int32_t *prompt;
    int32_t num_prompt;
    pd_request_params_t params; /* max_tokens 0 = up to max_model_len */
    const char *stop[PD_MAX_STOP_STRINGS];
    int32_t num_stop;
    void *kv_transfer_params;   /* json_t* (a reference is taken), may be NULL */
    struct pd_grammar *grammar; /* structured output (grammar/grammar.h; a reference is taken), or NULL */
    const int32_t *resume;      /* [num_resume] output tokens sampled on another node that this request
                                 * goes on from (resume_token_ids), or NULL: appended at admission, their
                                 * outputs marked replayed, their KV recomputed with the prompt's */
    int32_t num_resume;
    void *user;
} pd_engine_request_t;

/* The score of one prompt token (prompt_logprobs): its logprob and rank, and the top entries. */
typedef struct pd_prompt_logprob {
    float logprob;
    int32_t rank;
    int32_t num_top;
    int32_t top_ids[20];
    float top_logprobs[20];
} pd_prompt_logprob_t;

/* One request's progress in one step. */
typedef struct pd_engine_output pd_engine_output_t;
struct pd_engine_output {
    char id[PD_REQ_ID_MAX];
    void *user;
    int32_t token; /* the new token, or -1 (finished without one) */
    char *text;    /* new text (NUL-terminated, may be empty) */
    size_t text_len;
    const char *finish_reason; /* "stop" | "length" | "abort" | "error", NULL while running */
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    float logprob; /* of token, when logprobs were asked */
    int32_t num_top;
    int32_t top_ids[20];
    float top_logprobs[20];
    double queue_time, ttft, e2e;         /* seconds (finished outputs) */
    char *kv_transfer_params;             /* JSON text (finished outputs of a connector), or NULL */
    char *stop_str;                       /* finished by this stop string (vLLM's stop_reason), or NULL */
    int32_t stop_token;                   /* finished by this stop_token_ids entry, or -1 (EOS: -1) */
    pd_prompt_logprob_t *prompt_logprobs; /* [num_prompt_logprobs] scores of prompt tokens 1.., on the
                                           * request's first output (prompt_logprobs), else NULL */
    int32_t num_prompt_logprobs;
    bool handed_over; /* first-token handover on a prefill node: the request ends here (finish_reason
                       * "length", kv_transfer_params set) and a decode node continues it */
    bool replayed;    /* a resumed token (pd_engine_request_t.resume): its client has it and the text
                       * before text, so a frontend records it without sending it (never on the
                       * output that finishes the request) */
    /* Set on the engine thread by the output sink (pd_engine_set_output_sink), when it wrote this
     * output to its client itself: the frontend records it without sending it. rest/rest_len are the
     * bytes of it the client's socket did not take (a client that is behind): the frontend sends
     * them before anything else of that stream. delivered_at: when it was written (seconds). */
    bool delivered;
    double delivered_at;
    char *rest;
    size_t rest_len;
    pd_engine_output_t *next;
};

void pd_engine_output_free(pd_engine_output_t *list);

typedef struct pd_engine pd_engine_t;

/* Loads the model and tokenizer, initialises the KV cache (profiling), creates the scheduler.
 * Fails with the status of whichever step failed (logged there). */
pd_status_t pd_engine_create(const pd_engine_config_t *cfg, pd_engine_t **engine_out);

/* Stops the engine thread if running and frees everything. */
void pd_engine_destroy(pd_engine_t *e);

const pd_tokenizer_t *pd_engine_tokenizer(const pd_engine_t *e);
const pd_model_config_t *pd_engine_model_config(const pd_engine_t *e);
int32_t pd_engine_max_model_len(const pd_engine_t *e);

/* Why this node cannot serve a request with these kv_transfer_params (json_t*, may be NULL): a role
 * it does not play (the connector's params_error), or NULL when it can. Any thread. */
const char *pd_engine_params_error(const pd_engine_t *e, const void *kv_transfer_params);
const pd_kv_cache_t *pd_engine_kv(const pd_engine_t *e);
const char *pd_engine_model_name(const pd_engine_t *e);
/* The KV cache's storage dtype as resolved from --kv-cache-dtype: "fp32" | "fp16" | "bf16". */
const char *pd_engine_kv_dtype_name(const pd_engine_t *e);

/* The storage dtype of the model's matrices after --dtype ("bfloat16", "float16", "float32"), with
 * "+int8" when --quantization int8 stores the linear layers in int8. */
const char *pd_engine_weight_dtype_name(const pd_engine_t *e);
/* The configuration the engine was created with (its strings are the caller's). */
const pd_engine_config_t *pd_engine_config(const pd_engine_t *e);
/* The KV cache events' PUB and replay endpoints as bound ("" when --kv-events-config is off). */
const char *pd_engine_kv_events_endpoint(const pd_engine_t *e);
const char *pd_engine_kv_events_replay_endpoint(const pd_engine_t *e);
/* The model directory the engine loaded (--model). */
const char *pd_engine_model_dir(const pd_engine_t *e);
/* The model's generation_config.json as the engine uses it (empty with --generation-config vllm). */
const struct pd_generation_config *pd_engine_generation_config(const pd_engine_t *e);

/* Validates and admits a request (engine thread / offline). PD_ERR_INVALID_ARG with a message for
 * the client in err (empty prompt, prompt ≥ max_model_len, token id outside the vocabulary, bad
 * sampling values, duplicate id). */
pd_status_t pd_engine_add(pd_engine_t *e, const pd_engine_request_t *req, char *err, size_t err_len);

/* Aborts a request (engine thread / offline); its final output says "abort". */
bool pd_engine_abort(pd_engine_t *e, const char *id);
/* pd_engine_abort for a live migration (pd_engine_migrate_async, on the engine's own thread). */
bool pd_engine_migrate(pd_engine_t *e, const char *id);

/* Runs one step; appends this step's outputs to *outputs (caller frees with pd_engine_output_free). */
pd_status_t pd_engine_step(pd_engine_t *e, pd_engine_output_t **outputs);

/* Whether any request is waiting, running or holding blocks. */
bool pd_engine_has_work(const pd_engine_t *e);

/* --- threaded use --- */

/* Starts the engine thread; notify(ctx) is called from it whenever outputs are ready. */
pd_status_t pd_engine_start(pd_engine_t *e, void (*notify)(void *ctx), void *ctx);

/* A frontend that writes streamed tokens to its clients from the engine thread (issue 53): before
 * pd_engine_start, sink(ctx, o) is set to be called on the engine thread for each output of a step,
 * in order, before the outputs are queued. It returns true when it wrote o to the client itself
 * (and set o->delivered). Every output is queued either way, in order; but a step whose outputs
 * were all delivered does not call notify, so the frontend is not woken per token: it takes the
 * delivered outputs with the next notify, which comes with the first output not delivered (every
 * request ends with one), or after 32 delivered outputs, or 50 ms after the last notify. */
void pd_engine_set_output_sink(pd_engine_t *e, bool (*sink)(void *ctx, pd_engine_output_t *o), void *ctx);

/* Stops and joins the engine thread (in-flight requests stay as they are). */
void pd_engine_stop(pd_engine_t *e);

/* Queues a request (copied). PD_ERR_NO_SPACE when --max-queue requests are already queued. */
pd_status_t pd_engine_submit(pd_engine_t *e, const pd_engine_request_t *req);

/* Queues an abort by id. */
void pd_engine_abort_async(pd_engine_t *e, const char *id);

/* Queues a live migration by id: the request ends as an abort, but a decode node's connector first
 * leases the KV of its computed tokens to whichever node takes it over; its final output's
 * kv_transfer_params say where (pull parameters covering prompt and outputs but the last), or are
 * absent when it could not lend (not decoding yet, a staged KV cache, no connector): then that node
 * recomputes. */
void pd_engine_migrate_async(pd_engine_t *e, const char *id);

/* Takes every output produced since the last call (NULL if none). */
pd_engine_output_t *pd_engine_take_outputs(pd_engine_t *e);

typedef struct pd_engine_stats {
    int32_t num_running, num_waiting, num_waiting_for_remote_kv, num_holding, num_queued;
    double kv_usage;
    uint32_t blocks_free, blocks_cached_free, blocks_used, num_blocks;
    uint64_t prefix_queries, prefix_hits, preemptions;
    uint64_t load_waits; /* remote loads put off for another request's (scheduler stats) */
    uint64_t prompt_tokens, generation_tokens, steps, requests_finished;
    uint64_t grammar_states_handed, grammar_states_resumed; /* first-token handovers of structured
                                                             * outputs: prefill, decode side */
    uint64_t grammars_walked_ahead;    /* grammars made ready off the engine thread (grammar_jobs.h) */
    double grammar_walk_ahead_seconds; /* the time it took them */
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted; /* speculative decoding (scheduler stats) */
    /* --kv-offload-tier: blocks looked up past a pool hit and found (loaded), saved, refused by a
     * checksum, written and read bytes, slots in use of how many */
    bool offload;
    uint64_t offload_queries, offload_hits, offload_saved, offload_corrupt, offload_bytes_written,
        offload_bytes_read;
    double offload_read_seconds;
    uint32_t offload_used, offload_slots;
    double last_step_s, last_forward_s;
    /* what prompt tokens cost here (scheduler/prefill_cost.h): seconds per token and per attended
     * position, 0 before the first measured step */
    double prefill_s_per_token, prefill_s_per_position;
} pd_engine_stats_t;

/* A consistent snapshot (thread-safe). */
void pd_engine_get_stats(pd_engine_t *e, pd_engine_stats_t *out);

struct pd_block_pool;
/* The KV block pool (tests inspect the prefix cache through it; engine thread or offline only). */
const struct pd_block_pool *pd_engine_block_pool(pd_engine_t *e);

#endif
