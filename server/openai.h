/* server/openai.h — OpenAI /v1/completions: request validation into an engine request, and the
 * response, stream-chunk and error JSON (field names as OpenAI and vLLM use them). */
#ifndef PD_SERVER_OPENAI_H
#define PD_SERVER_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "model/tokenizer.h"

/* An error as the client sees it: HTTP status + {"error": {message, type, param, code}}. */
typedef struct pd_http_error {
    int status;
    char message[512];
    const char *type;  /* "BadRequestError", "NotFoundError", ... */
    const char *param; /* offending field or NULL */
} pd_http_error_t;

typedef struct pd_completion_req {
    int32_t *prompt; /* malloc'd token ids */
    int32_t num_prompt;
    pd_request_params_t params;
    char *stop[PD_MAX_STOP_STRINGS];
    int32_t num_stop;
    bool stream;
    bool include_usage;
    bool return_token_ids;
    int32_t logprobs;           /* -1 = none (null) */
    json_t *kv_transfer_params; /* owned reference or NULL */
} pd_completion_req_t;

typedef struct pd_openai_limits {
    const char *model_name;
    int32_t vocab_size;
    int32_t max_model_len;
    int max_depth; /* JSON nesting limit */
} pd_openai_limits_t;

/* Parses and validates a request body. Returns false with *err filled (status 400/404) on any
 * problem: bad JSON (with position), wrong field types, n != 1, echo, prompt too long, unknown
 * token ids, sampling values out of range. On true the caller frees with pd_completion_req_free. */
bool pd_openai_parse_completion(const char *body, size_t len, const pd_tokenizer_t *tok,
                                const pd_openai_limits_t *lim, pd_completion_req_t *out,
                                pd_http_error_t *err);

void pd_completion_req_free(pd_completion_req_t *r);

/* {"error": {...}} for err (caller decrefs). */
json_t *pd_openai_error_json(const pd_http_error_t *err);

/* Fills err and returns false (shorthand for validation paths). */
bool pd_http_error_set(pd_http_error_t *err, int status, const char *type, const char *param, const char *fmt,
                       ...) __attribute__((format(printf, 5, 6)));

/* Makes a UTF-8-valid JSON string of arbitrary bytes (invalid sequences become U+FFFD). */
json_t *pd_json_string_lossy(const char *s, size_t len);

#endif
