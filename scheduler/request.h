/* scheduler/request.h — one generation request and its states (DESIGN.md §3).
 *
 *   WAITING → RUNNING → FINISHED_{STOPPED, LENGTH, ABORTED, ERROR}
 *   RUNNING → PREEMPTED → WAITING (re-queued at the front, recomputed)
 *   WAITING → WAITING_FOR_REMOTE_KV → WAITING (KV arrived, or load failed with policy recompute)
 *                                  → FINISHED_ERROR (load failed with policy fail)
 * A request's tokens are its prompt followed by its output; blocks cover its computed tokens. */
#ifndef PD_SCHEDULER_REQUEST_H
#define PD_SCHEDULER_REQUEST_H

#include <stdbool.h>
#include <stdint.h>

#include "common/hash.h"
#include "common/rng.h"
#include "common/sampling.h"
#include "common/status.h"

typedef enum pd_request_state {
    PD_REQ_WAITING = 0,
    PD_REQ_WAITING_FOR_REMOTE_KV,
    PD_REQ_RUNNING,
    PD_REQ_PREEMPTED,
    PD_REQ_FINISHED_STOPPED,
    PD_REQ_FINISHED_LENGTH,
    PD_REQ_FINISHED_ABORTED,
    PD_REQ_FINISHED_ERROR,
} pd_request_state_t;

#define PD_REQ_ID_MAX         64
#define PD_MAX_STOP_TOKEN_IDS 16
#define PD_MAX_LOGIT_BIAS     300 /* entries of logit_bias (OpenAI's limit) */
#define PD_MAX_BAD_WORDS      32  /* token sequences of bad_words */
#define PD_MAX_BAD_WORD_IDS   256 /* their token ids, all sequences together */
#define PD_SPEC_MAX_TOKENS    32  /* draft tokens per request per step at most (--speculative-config) */

/* What a client asks for; copied into the request. */
typedef struct pd_request_params {
    int32_t max_tokens; /* output tokens at most (> 0) */
    bool ignore_eos;
    int32_t stop_token_ids[PD_MAX_STOP_TOKEN_IDS];
    int32_t num_stop_token_ids;
    pd_sampling_params_t sampling;
    bool has_seed;
    uint64_t seed;
    int32_t logprobs; /* top logprobs per sampled token (0 = none) */
    /* logits processing, applied in vLLM's order before sampling (engine/logits_process.c) */
    float presence_penalty;   /* 0 = off; output tokens */
    float frequency_penalty;  /* 0 = off; output tokens, by count */
    float repetition_penalty; /* 1 = off (0 is read as off too); prompt and output tokens */
    int32_t min_tokens;       /* EOS and stop_token_ids masked until this many outputs */
    int32_t num_logit_bias;
    int32_t logit_bias_ids[PD_MAX_LOGIT_BIAS];
    float logit_bias[PD_MAX_LOGIT_BIAS];
    int32_t num_bad_words; /* sequences: ids [end[i-1], end[i]) of bad_word_ids */
    int32_t bad_word_end[PD_MAX_BAD_WORDS];
    int32_t bad_word_ids[PD_MAX_BAD_WORD_IDS];
    bool include_stop_str_in_output;
    bool keep_special_tokens;  /* skip_special_tokens: false (vLLM's default drops special tokens) */
    bool want_prompt_logprobs; /* prompt_logprobs: the prompt's tokens scored (no prefix cache then) */
    int32_t prompt_logprobs;   /* top entries per prompt position beside the prompt token */
    /* cache_salt (vLLM's): its hash joins the first block's prefix-cache hash, so requests share
     * cached blocks only with requests of the same salt (tenants isolated in the prefix cache) */
    bool has_cache_salt;
    uint64_t cache_salt[2];
} pd_request_params_t;

/* Prompt tokens a prompt-logprobs request computes per step at most (each needs a logits row). */
#define PD_PROMPT_LOGPROBS_CHUNK 128

typedef struct pd_request pd_request_t;
struct pd_request {
    char id[PD_REQ_ID_MAX];
    uint64_t arrival_seq; /* admission order (FCFS) */
    pd_request_state_t state;
    pd_request_params_t params;
    uint64_t seed; /* its sampling seed (the client's, or drawn from the OS): output position i draws
                    * from pd_request_rng_at(r, i) alone, so seeded runs depend neither on batching
                    * nor on which node sampled the tokens before (a prefill's first token, a decode
                    * that resumes a stream another began) */

    int32_t *tokens; /* [cap_tokens]: prompt, then output */
    int32_t num_prompt_tokens;
    int32_t num_tokens;
    int32_t cap_tokens;
    int32_t num_computed_tokens; /* tokens whose KV is in the cache */
    int32_t num_spec_tokens;     /* draft tokens proposed for the next step, held at tokens[num_tokens,
                                  * num_tokens + num_spec_tokens) (never counted in num_tokens) */
    int32_t num_draft_computed;  /* tokens whose KV the draft model holds (draft_model speculation;
                                  * its pages share this request's block ids) */
    int32_t num_cached_tokens;   /* prefix-cache hit when first scheduled, -1 before */
    int32_t num_offload_tokens;  /* of the prefix hits: tokens the KV offload tier loaded into the pool */
    struct pd_kv_tier_load *tier_load; /* the offload tier's load in flight for it, or NULL: it waits */
    bool tier_counted;                 /* its prefix was looked up in the tier (counted once) */
    int32_t num_loaded_tokens;         /* prompt tokens whose KV a connector load brought from another node (a
                                  * decode's from its prefill, a prefill's prefix from a peer) */

    uint32_t *block_ids; /* [cap_blocks] this request's KV blocks in order */
    int32_t num_blocks, cap_blocks;
    pd_hash128_t *block_hashes; /* chained hashes of its full blocks, computed lazily */
    int32_t num_hashes;
    int32_t num_cached_blocks; /* leading blocks registered in the prefix cache */
    bool blocks_trimmed;       /* tail blocks went back to the pool since the input batch copied the
                                * block list (rejected drafts): it copies the whole row again */

    void *kv_transfer_params;       /* json_t*, owned (connector parameters), may be NULL */
    int32_t num_external_tokens;    /* tokens the connector loads from a remote peer */
    bool holds_blocks_after_finish; /* finished, blocks held for a remote reader (delay free) */
    bool prefix_counted;            /* its prefix-cache lookup is in the hit-rate stats */
    bool load_waited;               /* its remote load was put off for another's (counted once) */
    double load_wait_since;         /* when it was first put off (pd_time_now_s) */
    /* First-token handover (kv_transfer_params "first_token"): a prefill node's request ends after
     * its first output token unless that token ends it, and a decode node continues from there */
    bool handover_after_first;
    bool handed_over; /* it ended that way (FINISHED_LENGTH): its decode node goes on */
    /* Live migration (POST /admin/migrate, a drain): a decode node ends it (FINISHED_ABORTED) for
     * another to take over; its connector leases the KV of its computed tokens to that node */
    bool migrating;

    int32_t stop_token; /* the stop_token_ids entry that finished it (vLLM's stop_reason), or -1 */
    int32_t num_preemptions;
    double arrival_time, first_scheduled_time, first_token_time, finish_time;
    pd_request_t *prev, *next;   /* scheduler queue links */
    int32_t batch_slot;          /* persistent input batch slot, -1 when absent */
    struct pd_gmatcher *grammar; /* structured output: the matcher the engine's model runner masks
                                  * and advances (engine/structured.c; it lives in the engine's
                                  * request context), NULL when none */
    char *grammar_state;         /* a prefill's handover: the matcher's state after the first token
                                  * (pd_gmatcher_export), which its connector puts in the decode's
                                  * kv_transfer_params; malloc'd (engine thread), NULL when none */
    void *user;                  /* frontend context */
};

/* Creates a request with prompt[n] (n >= 1) whose tokens may grow to max_len (prompt + output).
 * The id is copied (truncated to PD_REQ_ID_MAX − 1). PD_ERR_INVALID_ARG for an empty prompt,
 * a prompt not shorter than max_len or max_tokens < 1. */
pd_status_t pd_request_create(const char *id, const int32_t *prompt, int32_t n,
                              const pd_request_params_t *params, int32_t max_len, pd_request_t **req_out);

/* Frees the request and its kv_transfer_params (its blocks must have been released already). */
void pd_request_free(pd_request_t *req);

/* Appends one output token. PD_ERR_NO_SPACE if the request is at its length limit. */
pd_status_t pd_request_append_token(pd_request_t *req, int32_t token);

/* The generator output position pos (0: the first output token) of r draws from. */
static inline void pd_request_rng_at(const pd_request_t *r, int32_t pos, pd_rng_t *out)
{
    pd_rng_seed_stream(out, r->seed, (uint64_t)pos);
}

static inline int32_t pd_request_num_output(const pd_request_t *req)
{
    return req->num_tokens - req->num_prompt_tokens;
}

static inline bool pd_request_is_finished(const pd_request_t *req)
{
    return req->state >= PD_REQ_FINISHED_STOPPED;
}

/* "stop", "length", "abort", "error" or NULL while not finished (OpenAI finish_reason names). */
const char *pd_request_finish_reason(const pd_request_t *req);

const char *pd_request_state_name(pd_request_state_t state);

#endif
