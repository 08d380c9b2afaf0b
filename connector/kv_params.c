/* connector/kv_params.c — what the engine reads from a request's kv_transfer_params: the parts of
 * the connector interface (connector.h) an engine without a connector library links (pd-serve). */
#include <jansson.h>
#include <stdint.h>

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
