/* engine/spec_config.c — --speculative-config, vLLM's JSON spelling. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "engine/spec_decode.h"
#include "scheduler/request.h"

/* An optional integer member: *v stays as it is when absent; false when present but not an integer. */
static bool opt_int(const json_t *o, const char *key, int32_t *v, bool *given)
{
    const json_t *x = json_object_get(o, key);
    if (x == NULL || json_is_null(x)) {
        return true;
    }
    if (!json_is_integer(x) || json_integer_value(x) < -1000000 || json_integer_value(x) > 1000000) {
        return false;
    }
    *v = (int32_t)json_integer_value(x);
    *given = true;
    return true;
}

pd_status_t pd_spec_config_parse(const char *text, pd_spec_config_t *out, char *err, size_t err_len)
{
    memset(out, 0, sizeof(*out));
    if (text == NULL || text[0] == '\0') {
        return PD_OK;
    }
    json_error_t je;
    json_t *o = json_loads(text, 0, &je);
    pd_status_t st = PD_ERR_INVALID_ARG;
    if (!json_is_object(o)) {
        snprintf(err, err_len, "--speculative-config is not a JSON object: %s", o == NULL ? je.text : "");
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(o, key, val)
    {
        if (strcmp(key, "method") != 0 && strcmp(key, "num_speculative_tokens") != 0 &&
            strcmp(key, "prompt_lookup_min") != 0 && strcmp(key, "prompt_lookup_max") != 0 &&
            strcmp(key, "model") != 0 && strcmp(key, "disable_by_batch_size") != 0) {
            snprintf(err, err_len,
                     "--speculative-config: '%s' is not supported (method, model, num_speculative_tokens, "
                     "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size are)",
                     key);
            goto out;
        }
    }
    const char *method = json_string_value(json_object_get(o, "method"));
    const char *model = json_string_value(json_object_get(o, "model"));
    if (json_object_get(o, "model") != NULL && (model == NULL || model[0] == '\0' || strlen(model) >= 1024)) {
        snprintf(err, err_len, "--speculative-config: model must be a directory path");
        goto out;
    }
    if (method == NULL && model != NULL) {
        method = "draft_model";
    }
    bool ngram = method != NULL && (strcmp(method, "ngram") == 0 || strcmp(method, "[ngram]") == 0);
    bool draft = method != NULL && strcmp(method, "draft_model") == 0;
    if (!ngram && !draft) {
        snprintf(err, err_len, "--speculative-config: method '%s' is not supported (ngram, draft_model are)",
                 method != NULL ? method : "(missing)");
        goto out;
    }
    if (draft != (model != NULL)) {
        snprintf(err, err_len, "--speculative-config: %s",
                 draft ? "draft_model needs \"model\": a directory" : "\"model\" is for method draft_model");
        goto out;
    }
    bool has_k = false, has_min = false, has_max = false, has_dis = false;
    int32_t k = 0, lo = 0, hi = 0, dis = 0;
    if (!opt_int(o, "num_speculative_tokens", &k, &has_k) ||
        !opt_int(o, "prompt_lookup_min", &lo, &has_min) || !opt_int(o, "prompt_lookup_max", &hi, &has_max) ||
        !opt_int(o, "disable_by_batch_size", &dis, &has_dis)) {
        snprintf(err, err_len, "--speculative-config: the numbers must be integers");
        goto out;
    }
    if (!has_k || k < 1 || k > PD_SPEC_MAX_TOKENS) {
        snprintf(err, err_len, "--speculative-config: num_speculative_tokens must be given, in [1, %d]",
                 PD_SPEC_MAX_TOKENS);
        goto out;
    }
    if (has_dis && dis < 2) {
        snprintf(err, err_len, "--speculative-config: disable_by_batch_size must be >= 2 (got %d)", dis);
        goto out;
    }
    if (draft) {
        if (has_min || has_max) {
            snprintf(err, err_len, "--speculative-config: prompt_lookup_min/max are for method ngram");
            goto out;
        }
        *out = (pd_spec_config_t){PD_SPEC_DRAFT_MODEL, k, 0, 0, {0}, dis};
        snprintf(out->draft_model, sizeof(out->draft_model), "%s", model);
        st = PD_OK;
        goto out;
    }
    if (!has_min && !has_max) {
        lo = hi = 5;
    } else if (!has_min) {
        lo = hi;
    } else if (!has_max) {
        hi = lo;
    }
    if (lo < 1 || hi < lo || hi > 1024) {
        snprintf(
            err, err_len,
            "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 1024 (got %d, %d)", lo,
            hi);
        goto out;
    }
    *out = (pd_spec_config_t){PD_SPEC_NGRAM, k, lo, hi, {0}, dis};
    st = PD_OK;
out:
    json_decref(o);
    return st;
}
