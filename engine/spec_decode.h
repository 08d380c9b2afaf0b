/* engine/spec_decode.h — speculative decoding's configuration and proposers. The engine proposes
 * draft tokens for each running request after a step (they wait at tokens[num_tokens, ...) as
 * req->num_spec_tokens), the scheduler budgets them, the model runner scores all of them in one
 * forward and verifies them (spec_verify.h), and the scheduler rolls the KV of rejected ones back. */
#ifndef PD_ENGINE_SPEC_DECODE_H
#define PD_ENGINE_SPEC_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum pd_spec_method {
    PD_SPEC_NONE = 0,
    PD_SPEC_NGRAM,       /* prompt lookup: the tokens that followed the last n-gram's earlier occurrence */
    PD_SPEC_DRAFT_MODEL, /* a smaller model sharing the vocabulary proposes greedily (spec_draft.h) */
} pd_spec_method_t;

typedef struct pd_spec_config {
    pd_spec_method_t method;
    int32_t num_tokens; /* num_speculative_tokens: drafts per request per step at most */
    int32_t lookup_min; /* prompt_lookup_min / prompt_lookup_max: n-gram lengths tried */
    int32_t lookup_max;
    char draft_model[1024];        /* draft_model: the draft's HF directory ("model") */
    int32_t disable_by_batch_size; /* > 0: no drafts in a step that starts with this many requests
                                    * running or more (vLLM's disable_by_batch_size); 0: always */
} pd_spec_config_t;

/* Parses --speculative-config, vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k,
 * "prompt_lookup_min": a, "prompt_lookup_max": b} (a missing bound takes the other's value, both
 * missing: 5, as vLLM), or {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}
 * ("model" without "method" means draft_model, as vLLM infers it); either may add
 * "disable_by_batch_size": n (>= 2). NULL or "" is no speculation.
 * Unknown keys, other methods and values out of range are refused with PD_ERR_INVALID_ARG and the
 * reason in err. */
pd_status_t pd_spec_config_parse(const char *json, pd_spec_config_t *out, char *err, size_t err_len);

/* The n-gram proposer (vLLM's NgramProposer): the longest suffix of tokens[n] of length in
 * [min_n, max_n] that occurred earlier, taking the earliest occurrence among the longest; proposes
 * the up to k tokens that followed it. Writes them to out and returns how many (0: no match). */
int32_t pd_ngram_propose(const int32_t *tokens, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                         int32_t *out);

/* The same by its definition (lengths from max_n down, occurrences from the left): the oracle. */
int32_t pd_ngram_propose_ref(const int32_t *tokens, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                             int32_t *out);

#endif
