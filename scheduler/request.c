/* scheduler/request.c — request lifetime and token storage. */
#include "scheduler/request.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/log.h"
#include "common/time.h"

pd_status_t pd_request_create(const char *id, const int32_t *prompt, int32_t n,
                              const pd_request_params_t *params, int32_t max_len, pd_request_t **req_out)
{
    if (n < 1 || n >= max_len || params->max_tokens < 1) {
        pd_log_warn("request %s: prompt of %d tokens, max_tokens %d, limit %d tokens", id, n,
                    params->max_tokens, max_len);
        return PD_ERR_INVALID_ARG;
    }
    pd_request_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    int64_t cap = (int64_t)n + params->max_tokens;
    r->cap_tokens = (int32_t)(cap < max_len ? cap : max_len);
    r->tokens = malloc((size_t)r->cap_tokens * sizeof(int32_t));
    if (r->tokens == NULL) {
        free(r);
        return PD_ERR_NO_MEMORY;
    }
    snprintf(r->id, sizeof(r->id), "%s", id);
    memcpy(r->tokens, prompt, (size_t)n * sizeof(int32_t));
    r->num_prompt_tokens = r->num_tokens = n;
    r->params = *params;
    uint64_t seed = params->seed;
    if (!params->has_seed) { /* an unseeded request draws its seed from the OS (vLLM: a fresh generator) */
        if (getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed)) {
            seed = pd_time_now_ns() ^ (uint64_t)(uintptr_t)r;
        }
    }
    r->seed = seed;
    r->num_cached_tokens = -1;
    r->stop_token = -1;
    r->batch_slot = -1;
    r->state = PD_REQ_WAITING;
    *req_out = r;
    return PD_OK;
}

void pd_request_free(pd_request_t *r)
{
    if (r == NULL) {
        return;
    }
    json_decref(r->kv_transfer_params);
    free(r->grammar_state);
    free(r->tokens);
    free(r->block_ids);
    free(r->block_hashes);
    free(r);
}

pd_status_t pd_request_append_token(pd_request_t *r, int32_t token)
{
    if (r->num_tokens >= r->cap_tokens) {
        return PD_ERR_NO_SPACE;
    }
    r->tokens[r->num_tokens++] = token;
    return PD_OK;
}

const char *pd_request_finish_reason(const pd_request_t *r)
{
    switch (r->state) {
    case PD_REQ_FINISHED_STOPPED: return "stop";
    case PD_REQ_FINISHED_LENGTH: return "length";
    case PD_REQ_FINISHED_ABORTED: return "abort";
    case PD_REQ_FINISHED_ERROR: return "error";
    default: return NULL;
    }
}

const char *pd_request_state_name(pd_request_state_t s)
{
    static const char *names[] = {"WAITING",          "WAITING_FOR_REMOTE_KV", "RUNNING",
                                  "PREEMPTED",        "FINISHED_STOPPED",      "FINISHED_LENGTH",
                                  "FINISHED_ABORTED", "FINISHED_ERROR"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "UNKNOWN";
}
