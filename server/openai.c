/* server/openai.c — /v1/completions request validation and JSON shapes. */
#include "server/openai.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"

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

json_t *pd_openai_error_json(const pd_http_error_t *err)
{
    return json_pack("{s:{s:s, s:s, s:s?, s:i}}", "error", "message", err->message, "type", err->type,
                     "param", err->param, "code", err->status);
}

json_t *pd_json_string_lossy(const char *s, size_t len)
{
    char *buf = malloc(len * 3 + 1);
    if (buf == NULL) {
        return json_string("");
    }
    size_t k = 0, i = 0;
    const unsigned char *u = (const unsigned char *)s;
    while (i < len) {
        unsigned char c = u[i];
        int n = c < 0x80                   ? 1
                : (c >= 0xc2 && c <= 0xdf) ? 2
                : (c >= 0xe0 && c <= 0xef) ? 3
                : (c >= 0xf0 && c <= 0xf4) ? 4
                                           : 0;
        int ok = n > 0 && i + (size_t)n <= len;
        for (int j = 1; ok && j < n; j++) {
            ok = (u[i + (size_t)j] & 0xc0) == 0x80;
        }
        if (ok && n == 3 && ((c == 0xe0 && u[i + 1] < 0xa0) || (c == 0xed && u[i + 1] > 0x9f))) {
            ok = 0;
        }
        if (ok && n == 4 && ((c == 0xf0 && u[i + 1] < 0x90) || (c == 0xf4 && u[i + 1] > 0x8f))) {
            ok = 0;
        }
        if (ok && c != 0) {
            memcpy(buf + k, s + i, (size_t)n);
            k += (size_t)n;
            i += (size_t)n;
        } else {
            memcpy(buf + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    json_t *j = json_stringn(buf, k);
    free(buf);
    return j != NULL ? j : json_string("");
}

/* Maximum nesting of objects/arrays, skipping strings (jansson's own limit is 2048). */
static int json_depth(const char *s, size_t len)
{
    int depth = 0, max = 0, in_str = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') {
                i++;
            } else if (c == '"') {
                in_str = 0;
            }
        } else if (c == '"') {
            in_str = 1;
        } else if (c == '{' || c == '[') {
            max = ++depth > max ? depth : max;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return max;
}

static bool want_type(pd_http_error_t *err, const char *field, json_t *v, int ok, const char *what)
{
    if (ok) {
        return true;
    }
    return pd_http_error_set(err, 400, "BadRequestError", field, "'%s' must be %s, got %s", field, what,
                             pd_json_type_name(v));
}

static bool get_num(json_t *root, const char *f, double lo, double hi, double *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!want_type(err, f, v, json_is_number(v), "a number")) {
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

static bool get_int(json_t *root, const char *f, int64_t lo, int64_t hi, int64_t *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!want_type(err, f, v, json_is_integer(v), "an integer")) {
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

static bool get_bool(json_t *root, const char *f, bool *out, pd_http_error_t *err)
{
    json_t *v = json_object_get(root, f);
    if (v == NULL || json_is_null(v)) {
        return true;
    }
    if (!want_type(err, f, v, json_is_boolean(v), "a boolean")) {
        return false;
    }
    *out = json_is_true(v);
    return true;
}

static bool parse_prompt(json_t *p, const pd_tokenizer_t *tok, const pd_openai_limits_t *lim,
                         pd_completion_req_t *out, pd_http_error_t *err)
{
    if (p == NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' is required");
    }
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0))) {
        p = json_array_get(p, 0); /* ["text"] */
    }
    if (json_is_string(p)) {
        size_t n = 0;
        int32_t *ids = NULL;
        pd_status_t st =
            pd_tokenizer_encode(tok, json_string_value(p), json_string_length(p), true, &ids, &n);
        if (st != PD_OK) {
            return pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                     "'prompt' could not be tokenized");
        }
        out->prompt = ids;
        out->num_prompt = (int32_t)n;
    } else if (json_is_array(p)) {
        size_t n = json_array_size(p);
        if (n > (size_t)lim->max_model_len) {
            return pd_http_error_set(
                err, 400, "BadRequestError", "prompt",
                "This model's maximum context length is %d tokens. However, you requested %zu "
                "tokens in the prompt",
                lim->max_model_len, n);
        }
        out->prompt = malloc((n ? n : 1) * sizeof(int32_t));
        if (out->prompt == NULL) {
            return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
        }
        for (size_t i = 0; i < n; i++) {
            json_t *v = json_array_get(p, i);
            if (!json_is_integer(v)) {
                return pd_http_error_set(
                    err, 400, "BadRequestError", "prompt",
                    "'prompt' must be a string or a list of token ids (element %zu is %s)", i,
                    pd_json_type_name(v));
            }
            json_int_t id = json_integer_value(v);
            if (id < 0 || id >= lim->vocab_size) {
                return pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                         "token id %lld at position %zu is outside the vocabulary [0, %d)",
                                         (long long)id, i, lim->vocab_size);
            }
            out->prompt[i] = (int32_t)id;
        }
        out->num_prompt = (int32_t)n;
    } else {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                 "'prompt' must be a string or a list of token ids, got %s",
                                 pd_json_type_name(p));
    }
    if (out->num_prompt == 0) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' is empty");
    }
    return true;
}

static bool parse_stop(json_t *s, pd_completion_req_t *out, pd_http_error_t *err)
{
    if (s == NULL || json_is_null(s)) {
        return true;
    }
    if (json_is_string(s)) {
        out->stop[out->num_stop++] = strdup(json_string_value(s));
        return true;
    }
    if (!json_is_array(s) || json_array_size(s) > PD_MAX_STOP_STRINGS) {
        return pd_http_error_set(err, 400, "BadRequestError", "stop",
                                 "'stop' must be a string or a list of at most %d strings",
                                 PD_MAX_STOP_STRINGS);
    }
    size_t i;
    json_t *v;
    json_array_foreach(s, i, v)
    {
        if (!json_is_string(v)) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop", "'stop' must contain only strings");
        }
        out->stop[out->num_stop++] = strdup(json_string_value(v));
    }
    return true;
}

bool pd_openai_parse_completion(const char *body, size_t len, const pd_tokenizer_t *tok,
                                const pd_openai_limits_t *lim, pd_completion_req_t *out, pd_http_error_t *err)
{
    memset(out, 0, sizeof(*out));
    out->logprobs = -1;
    if (json_depth(body, len) > lim->max_depth) {
        return pd_http_error_set(err, 400, "BadRequestError", NULL,
                                 "request JSON nests deeper than %d levels", lim->max_depth);
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", NULL, "invalid JSON at line %d column %d: %s",
                                 je.line, je.column, je.text);
    }
    bool ok = false;
    if (!json_is_object(root)) {
        pd_http_error_set(err, 400, "BadRequestError", NULL, "the request body must be a JSON object");
        goto done;
    }
    json_t *model = json_object_get(root, "model");
    if (model != NULL && !json_is_null(model)) {
        if (!json_is_string(model)) {
            want_type(err, "model", model, 0, "a string");
            goto done;
        }
        if (strcmp(json_string_value(model), lim->model_name) != 0) {
            pd_http_error_set(err, 404, "NotFoundError", "model", "The model `%s` does not exist.",
                              json_string_value(model));
            goto done;
        }
    }
    int64_t n = 1, max_tokens = 16, top_k = -1, seed = -1, logprobs = -1;
    double temperature = 1.0, top_p = 1.0;
    bool echo = false;
    pd_request_params_t *p = &out->params;
    if (!get_int(root, "n", 1, 1000, &n, err) ||
        !get_int(root, "max_tokens", 1, INT32_MAX, &max_tokens, err) ||
        !get_int(root, "top_k", -1, INT32_MAX, &top_k, err) ||
        !get_int(root, "seed", INT64_MIN, INT64_MAX, &seed, err) ||
        !get_int(root, "logprobs", 0, 20, &logprobs, err) ||
        !get_num(root, "temperature", 0, 2, &temperature, err) ||
        !get_num(root, "top_p", 1e-9, 1, &top_p, err) || !get_bool(root, "echo", &echo, err) ||
        !get_bool(root, "stream", &out->stream, err) || !get_bool(root, "ignore_eos", &p->ignore_eos, err) ||
        !get_bool(root, "return_token_ids", &out->return_token_ids, err)) {
        goto done;
    }
    if (n != 1) {
        pd_http_error_set(err, 400, "BadRequestError", "n", "only n = 1 is supported");
        goto done;
    }
    if (echo) {
        pd_http_error_set(err, 400, "BadRequestError", "echo", "echo is not supported");
        goto done;
    }
    json_t *so = json_object_get(root, "stream_options");
    if (so != NULL && !json_is_null(so)) {
        if (!json_is_object(so)) {
            want_type(err, "stream_options", so, 0, "an object");
            goto done;
        }
        if (!get_bool(so, "include_usage", &out->include_usage, err)) {
            goto done;
        }
    }
    json_t *sti = json_object_get(root, "stop_token_ids");
    if (sti != NULL && !json_is_null(sti)) {
        if (!json_is_array(sti) || json_array_size(sti) > PD_MAX_STOP_TOKEN_IDS) {
            pd_http_error_set(err, 400, "BadRequestError", "stop_token_ids",
                              "'stop_token_ids' must be a list of at most %d token ids",
                              PD_MAX_STOP_TOKEN_IDS);
            goto done;
        }
        size_t i;
        json_t *v;
        json_array_foreach(sti, i, v)
        {
            if (!json_is_integer(v)) {
                want_type(err, "stop_token_ids", v, 0, "a list of integers");
                goto done;
            }
            p->stop_token_ids[p->num_stop_token_ids++] = (int32_t)json_integer_value(v);
        }
    }
    if (!parse_stop(json_object_get(root, "stop"), out, err)) {
        goto done;
    }
    json_t *ktp = json_object_get(root, "kv_transfer_params");
    if (ktp != NULL && !json_is_null(ktp)) {
        if (!json_is_object(ktp)) {
            want_type(err, "kv_transfer_params", ktp, 0, "an object");
            goto done;
        }
        out->kv_transfer_params = json_incref(ktp);
    }
    if (!parse_prompt(json_object_get(root, "prompt"), tok, lim, out, err)) {
        goto done;
    }
    if (out->num_prompt >= lim->max_model_len || (int64_t)out->num_prompt + max_tokens > lim->max_model_len) {
        pd_http_error_set(
            err, 400, "BadRequestError", "max_tokens",
            "This model's maximum context length is %d tokens. However, you requested %lld tokens (%d "
            "in the prompt, %lld in the completion). Please reduce the length of the prompt or "
            "completion.",
            lim->max_model_len, (long long)(out->num_prompt + max_tokens), out->num_prompt,
            (long long)max_tokens);
        goto done;
    }
    p->max_tokens = (int32_t)max_tokens;
    p->sampling.temperature = (float)temperature;
    p->sampling.top_p = (float)top_p;
    p->sampling.top_k = (int32_t)(top_k > 0 ? top_k : 0);
    p->has_seed = seed >= 0;
    p->seed = (uint64_t)(seed >= 0 ? seed : 0);
    out->logprobs = (int32_t)logprobs;
    p->logprobs =
        logprobs > 0 ? (int32_t)logprobs : (logprobs == 0 ? 1 : 0); /* 0: the sampled token's only */
    ok = true;
done:
    json_decref(root);
    if (!ok) {
        pd_completion_req_free(out);
    }
    return ok;
}

void pd_completion_req_free(pd_completion_req_t *r)
{
    free(r->prompt);
    for (int32_t i = 0; i < r->num_stop; i++) {
        free(r->stop[i]);
    }
    json_decref(r->kv_transfer_params);
    memset(r, 0, sizeof(*r));
    r->logprobs = -1;
}
