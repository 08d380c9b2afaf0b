/* model/generation_config.h — a model directory's generation_config.json: the EOS ids that end a
 * generation (an int or a list; every one stops) and the sampling defaults the model ships, which
 * vLLM applies to requests that omit them (--generation-config auto). */
#ifndef PD_MODEL_GENERATION_CONFIG_H
#define PD_MODEL_GENERATION_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "model/config.h"

typedef struct pd_generation_config {
    int32_t eos_token_ids[PD_MAX_EOS];
    int32_t num_eos;
    bool has_temperature, has_top_p, has_top_k, has_min_p, has_repetition_penalty, has_max_tokens;
    double temperature, top_p, min_p, repetition_penalty;
    int64_t top_k, max_tokens; /* max_tokens from max_new_tokens */
} pd_generation_config_t;

/* Reads DIR/generation_config.json into *out (zeroed first). A missing file is PD_OK with nothing
 * set; malformed JSON or a field of the wrong type is PD_ERR_PARSE, logged with the field. */
pd_status_t pd_generation_config_load(const char *dir, pd_generation_config_t *out);

/* Adds gen's EOS ids that ids[*n] lacks (up to PD_MAX_EOS). */
void pd_generation_config_merge_eos(const pd_generation_config_t *gen, int32_t *ids, int32_t *n);

#endif
