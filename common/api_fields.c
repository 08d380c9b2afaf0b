/* common/api_fields.c — see api_fields.h. */
#include "common/api_fields.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/sha256.h"

bool pd_http_error_set(pd_http_error_t *err, int status, const char *type, const char *param, const char *fmt,
                       ...)
{
    err->status = status;
    err->type = type;
    err->param = param;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return false;
}

json_t *pd_http_error_json(const pd_http_error_t *err)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:i}}", "error", "message", err->message, "type", err->type,
                     "param", err->param, "code", err->status);
}

bool pd_api_want_type(pd_http_error_t *err, const char *field, json_t *v, int ok, const char *what)
{
    if (ok) {
        return true;
    }
    return pd_http_error_set(err, 400, "BadRequestError", field, "'%s' must be %s, got %s", field, what,
                             pd_json_type_name(v));
}

bool pd_api_get_num(json_t *root, const char *f, double lo, double hi, double *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!pd_api_want_type(err, f, v, json_is_number(v), "a number")) {
        return false;
    }
    double d = json_number_value(v);
    if (!(d >= lo && d <= hi)) {
        return pd_http_error_set(err, 400, "BadRequestError", f, "'%s' must be in [%g, %g], got %g", f, lo,
                                 hi, d);
    }
    *out = d;
    return true;
}

bool pd_api_get_int(json_t *root, const char *f, int64_t lo, int64_t hi, int64_t *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!pd_api_want_type(err, f, v, json_is_integer(v), "an integer")) {
        return false;
    }
    int64_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        return pd_http_error_set(err, 400, "BadRequestError", f, "'%s' must be in [%lld, %lld], got %lld", f,
                                 (long long)lo, (long long)hi, (long long)x);
    }
    *out = x;
    return true;
}

bool pd_api_get_bool(json_t *root, const char *f, bool *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!pd_api_want_type(err, f, v, json_is_boolean(v), "a boolean")) {
        return false;
    }
    *out = json_is_true(v);
    return true;
}

bool pd_api_check_rewritten_fields(json_t *root, bool chat, pd_http_error_t *err)
{
    int64_t max_tokens = chat ? -1 : 16, n = 1, min_tokens = 0, logprobs = -1, top_logprobs = 0;
    bool stream = false, want_lp = false, include_usage = false;
    if (!pd_api_get_int(root, "max_tokens", 1, INT32_MAX, &max_tokens, err) ||
        (chat && !pd_api_get_int(root, "max_completion_tokens", 1, INT32_MAX, &max_tokens, err)) ||
        !pd_api_get_bool(root, "stream", &stream, err) || !pd_api_get_int(root, "n", 1, 1000, &n, err) ||
        !pd_api_get_int(root, "min_tokens", 0, INT32_MAX, &min_tokens, err)) {
        return false;
    }
    if (chat) {
        if (!pd_api_get_bool(root, "logprobs", &want_lp, err) ||
            !pd_api_get_int(root, "top_logprobs", 0, 20, &top_logprobs, err)) {
            return false;
        }
        if (top_logprobs > 0 && !want_lp) {
            return pd_http_error_set(err, 400, "BadRequestError", "top_logprobs",
                                     "'top_logprobs' needs 'logprobs' set to true");
        }
    } else if (!pd_api_get_int(root, "logprobs", 0, 20, &logprobs, err)) {
        return false;
    }
    json_t *so = json_object_get(root, "stream_options");
    if (so != NULL && !json_is_null(so)) {
        if (!json_is_object(so)) {
            return pd_api_want_type(err, "stream_options", so, 0, "an object");
        }
        if (!pd_api_get_bool(so, "include_usage", &include_usage, err)) {
            return false;
        }
    }
    if (max_tokens >= 0 && min_tokens > max_tokens) { /* chat without max_tokens: the node knows the rest */
        return pd_http_error_set(err, 400, "BadRequestError", "min_tokens",
                                 "min_tokens must be less than or equal to max_tokens=%lld, got %lld",
                                 (long long)max_tokens, (long long)min_tokens);
    }
    return true;
}

bool pd_api_bearer_ok(const char *authorization, const char *key)
{
    if (key == NULL || key[0] == '\0') {
        return true;
    }
    if (authorization == NULL || strncmp(authorization, "Bearer ", 7) != 0) {
        return false;
    }
    const char *got = authorization + 7;
    size_t n = strlen(key);
    return strlen(got) == n && pd_ct_equal((const uint8_t *)got, (const uint8_t *)key, n) == 1;
}

const char *pd_api_key_from_env(const char *var, char *buf, size_t cap)
{
    const char *v = getenv(var);
    size_t n = v != NULL ? strlen(v) : 0;
    while (n > 0 && (v[n - 1] == '\n' || v[n - 1] == '\r' || v[n - 1] == ' ' || v[n - 1] == '\t')) {
        n--;
    }
    if (n == 0 || n >= cap) {
        return NULL;
    }
    memcpy(buf, v, n);
    buf[n] = '\0';
    return buf;
}

bool pd_api_request_id_ok(const char *id)
{
    static const char ok[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:";
    size_t n = id != NULL ? strlen(id) : 0;
    return n > 0 && n <= PD_REQUEST_ID_MAX && strspn(id, ok) == n;
}
