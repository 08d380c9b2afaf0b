/* common/api_fields.h — OpenAI-API request fields as both the nodes (server/openai.c) and pd-proxy
 * check them: the client-facing error, typed field getters with vLLM's ranges, and the fields the
 * proxy rewrites before it sends a request to a prefill. */
#ifndef PD_COMMON_API_FIELDS_H
#define PD_COMMON_API_FIELDS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* An error as the client sees it: HTTP status + {"error": {message, type, param, code}}. */
typedef struct pd_http_error {
    int status;
    char message[512];
    const char *type;  /* "BadRequestError", "NotFoundError", ... */
    const char *param; /* offending field or NULL */
} pd_http_error_t;

/* Fills err (printf-style message) and returns false, so a check can `return pd_http_error_set(...)`. */
bool pd_http_error_set(pd_http_error_t *err, int status, const char *type, const char *param, const char *fmt,
                       ...) __attribute__((format(printf, 5, 6)));

/* {"error": {"message", "type", "param", "code"}} (the caller owns it). */
json_t *pd_http_error_json(const pd_http_error_t *err);

/* root[f] when present and not null: a number in [lo, hi] / an integer in [lo, hi] / a boolean into
 * *out (left alone when absent or null). False with err naming the field otherwise. */
bool pd_api_get_num(json_t *root, const char *f, double lo, double hi, double *out, pd_http_error_t *err);
bool pd_api_get_int(json_t *root, const char *f, int64_t lo, int64_t hi, int64_t *out, pd_http_error_t *err);
bool pd_api_get_bool(json_t *root, const char *f, bool *out, pd_http_error_t *err);
/* "'field' must be <what>, got <type>" unless ok. */
bool pd_api_want_type(pd_http_error_t *err, const char *field, json_t *v, int ok, const char *what);

/* The fields pd-proxy rewrites before it sends a request to a prefill — max_tokens,
 * max_completion_tokens (chat), stream, stream_options, logprobs, top_logprobs (chat), min_tokens,
 * n — checked as the nodes check them (the nodes run this function too). A client error in one of
 * them is then answered by the proxy before any prefill computes KV that the decode would refuse,
 * and holds for nothing. */
bool pd_api_check_rewritten_fields(json_t *root, bool chat, pd_http_error_t *err);

/* Whether an Authorization header value is "Bearer KEY" (compared in constant time). NULL or empty
 * key: no key required, always true. */
bool pd_api_bearer_ok(const char *authorization, const char *key);

/* An API key from the environment variable var (VLLM_API_KEY, PD_PROXY_API_KEY) copied into buf
 * (cap bytes) without trailing whitespace (a Secret file written by `base64` ends in a newline);
 * NULL when unset, empty or longer than cap - 1. */
const char *pd_api_key_from_env(const char *var, char *buf, size_t cap);

/* Whether an X-Request-Id header value (may be NULL) can become a response id: 1..48 characters of
 * [A-Za-z0-9-_.:]. */
#define PD_REQUEST_ID_MAX 48
bool pd_api_request_id_ok(const char *id);

/* pd-proxy's header on a decode leg it can resume elsewhere (--migration-limit): a node that drains
 * ends such a stream at once, without [DONE], instead of making its client wait for the generation
 * (the proxy resumes it on another decode node after the tokens its client has). */
#define PD_RESUMABLE_HEADER "X-PD-Resumable"

#endif
