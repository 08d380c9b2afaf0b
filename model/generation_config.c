/* model/generation_config.c — generation_config.json (see generation_config.h). */
#include "model/generation_config.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"

pd_status_t pd_generation_config_load(const char *dir, pd_generation_config_t *out)
{
    memset(out, 0, sizeof(*out));
    char path[4096];
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    if (access(path, R_OK) != 0) {
        return PD_OK;
    }
    json_t *root = NULL;
    pd_status_t st = pd_json_load_file(path, 1u << 20, &root);
    if (st != PD_OK) {
        return st;
    }
    json_t *eos = json_object_get(root, "eos_token_id");
    if (json_is_integer(eos)) {
        out->eos_token_ids[out->num_eos++] = (int32_t)json_integer_value(eos);
    } else if (json_is_array(eos)) {
        size_t i;
        json_t *v;
        json_array_foreach(eos, i, v)
        {
            if (!json_is_integer(v)) {
                pd_log_error("%s: eos_token_id[%zu] is not an integer", path, i);
                st = PD_ERR_PARSE;
                break;
            }
            if (out->num_eos < PD_MAX_EOS) {
                out->eos_token_ids[out->num_eos++] = (int32_t)json_integer_value(v);
            }
        }
    } else if (eos != NULL && !json_is_null(eos)) {
        pd_log_error("%s: eos_token_id must be an integer or a list of integers", path);
        st = PD_ERR_PARSE;
    }
    static const char *const nums[] = {"temperature", "top_p", "min_p", "repetition_penalty"};
    double *dst[] = {&out->temperature, &out->top_p, &out->min_p, &out->repetition_penalty};
    bool *has[] = {&out->has_temperature, &out->has_top_p, &out->has_min_p, &out->has_repetition_penalty};
    for (int i = 0; i < 4 && st == PD_OK; i++) {
        json_t *v = json_object_get(root, nums[i]);
        if (v == NULL || json_is_null(v)) {
            continue;
        }
        if (!json_is_number(v)) {
            pd_log_error("%s: field '%s' must be a number", path, nums[i]);
            st = PD_ERR_PARSE;
            break;
        }
        *dst[i] = json_number_value(v);
        *has[i] = true;
    }
    static const char *const ints[] = {"top_k", "max_new_tokens"};
    int64_t *idst[] = {&out->top_k, &out->max_tokens};
    bool *ihas[] = {&out->has_top_k, &out->has_max_tokens};
    for (int i = 0; i < 2 && st == PD_OK; i++) {
        json_t *v = json_object_get(root, ints[i]);
        if (v == NULL || json_is_null(v)) {
            continue;
        }
        if (!json_is_integer(v)) {
            pd_log_error("%s: field '%s' must be an integer", path, ints[i]);
            st = PD_ERR_PARSE;
            break;
        }
        *idst[i] = json_integer_value(v);
        *ihas[i] = true;
    }
    json_decref(root);
    if (st != PD_OK) {
        memset(out, 0, sizeof(*out));
    }
    return st;
}

void pd_generation_config_merge_eos(const pd_generation_config_t *gen, int32_t *ids, int32_t *n)
{
    for (int32_t i = 0; i < gen->num_eos; i++) {
        bool seen = false;
        for (int32_t k = 0; k < *n; k++) {
            seen |= ids[k] == gen->eos_token_ids[i];
        }
        if (!seen && *n < PD_MAX_EOS) {
            ids[(*n)++] = gen->eos_token_ids[i];
        }
    }
}
