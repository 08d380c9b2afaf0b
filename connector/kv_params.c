/* connector/kv_params.c — what the engine reads from a request's kv_transfer_params: the parts of
 * the connector interface (connector.h) an engine without a connector library links (pd-serve). */
#include <jansson.h>
#include <stdint.h>
#include <string.h>

#include "connector/connector.h"

bool pd_kv_params_hands_over(const void *kv_transfer_params)
{
    const json_t *p = kv_transfer_params;
    return json_is_true(json_object_get(p, "do_remote_decode")) &&
           json_is_true(json_object_get(p, "first_token"));
}

int32_t pd_kv_params_first_token(const void *kv_transfer_params)
{
    const json_t *p = kv_transfer_params;
    const json_t *t = json_object_get(p, "first_token_id");
    if (!json_is_true(json_object_get(p, "do_remote_prefill")) || !json_is_integer(t) ||
        json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX) {
        return -1;
    }
    return (int32_t)json_integer_value(t);
}

bool pd_kv_params_resumes(const void *kv_transfer_params, int32_t num_tokens)
{
    const json_t *p = kv_transfer_params;
    if (pd_kv_params_migrates(p, num_tokens)) {
        return true;
    }
    return json_is_object(p) && json_object_size(p) == 1 && json_is_object(json_object_get(p, "kv_prefix"));
}

bool pd_kv_params_migrates(const void *kv_transfer_params, int32_t num_tokens)
{
    const json_t *p = kv_transfer_params;
    const json_t *nt = json_object_get(p, "remote_num_tokens");
    const json_t *mode = json_object_get(p, "transfer_mode");
    return json_is_true(json_object_get(p, "do_remote_prefill")) && json_is_integer(nt) &&
           json_integer_value(nt) == num_tokens && json_object_get(p, "first_token_id") == NULL &&
           json_object_get(p, "grammar_state") == NULL && json_is_string(mode) &&
           strcmp(json_string_value(mode), "pull") == 0;
}
