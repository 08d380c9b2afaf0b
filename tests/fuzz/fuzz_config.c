/* tests/fuzz/fuzz_config.c — config.json as hostile input: any JSON document is parsed into a model
 * config or refused with an error, never crashes (sizes, rope_scaling, layer types, EOS lists). */
#define _GNU_SOURCE
#include <jansson.h>
#include <string.h>

#include "fuzz.h"
#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 20)) {
        return 0;
    }
    json_error_t je;
    json_t *root = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        return 0;
    }
    pd_model_config_t cfg;
    pd_model_config_parse(root, "config.json", &cfg);
    json_decref(root);
    return 0;
}
