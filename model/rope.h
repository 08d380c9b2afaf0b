/* model/rope.h — a model's rotary table, computed once at load with its rope_scaling applied, as
 * transformers' ROPE_INIT_FUNCTIONS do (default, linear, llama3, yarn incl. its attention factor;
 * dynamic NTK as vLLM's static table for max_position_embeddings × factor). Every backend rotates
 * with it (kernels/rope_impl.h). */
#ifndef PD_MODEL_ROPE_H
#define PD_MODEL_ROPE_H

#include "common/status.h"
#include "kernels/rope_impl.h"
#include "model/config.h"

/* Fills *out for cfg's head size, rope_theta and rope_scaling. PD_ERR_UNSUPPORTED for a head size
 * that is odd or over 2 × PD_ROPE_MAX_HALF. */
pd_status_t pd_rope_table(const pd_model_config_t *cfg, pd_rope_t *out);

#endif
