/* engine/kv_init.h — KV cache initialisation, mirroring vLLM v1 (DESIGN.md §3):
 *   1. specs: one per attention layer from the model config
 *   2. profile: snapshot, one forward at --max-num-batched-tokens measuring peak activation bytes
 *      through the backend allocator; available = total × utilization − (weights + peak
 *      activations + non-allocator growth); CPU total = --kv-cache-memory, else physical RAM
 *   3. config: num_blocks = available / Σ page bytes of all layers (scheduler/kv_cache_spec.h)
 *   4. one region for every layer (from the backend, or from a pipe that must own it), viewed
 *      per layer, bound in layer order
 * and logs "Available KV cache memory: %.2f GiB", "KV cache size: %d tokens",
 * "Maximum concurrency for %d tokens per request: %.2fx". */
#ifndef PD_ENGINE_KV_INIT_H
#define PD_ENGINE_KV_INIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "connector/connector.h" /* pd_kv_region_allocator_t */
#include "kernels/backend.h"
#include "model/model.h"
#include "scheduler/kv_cache_spec.h"

typedef struct pd_kv_init_params {
    int32_t block_size;
    pd_dtype_t cache_dtype;
    double memory_utilization; /* (0, 1] */
    size_t kv_cache_memory;    /* CPU: total bytes to plan with; 0 = physical RAM */
    int32_t max_num_batched_tokens;
    int32_t max_num_seqs;
    int32_t max_model_len;
    const pd_kv_region_allocator_t *allocator; /* NULL: the backend allocates */
    uint32_t num_blocks_override; /* > 0: use this many blocks whatever the profile says (tests) */
    size_t companion_block_bytes; /* bytes per block id of a second cache indexed by the same block ids
                                   * (a draft model's): the plan shares the memory with it */
    bool skip_profile;            /* with num_blocks_override: no profile run (the companion itself) */
} pd_kv_init_params_t;

typedef struct pd_kv_profile {
    size_t total_bytes, requested_bytes;
    size_t weight_bytes, peak_activation_bytes, non_allocator_bytes;
    size_t available_bytes;
    double seconds;
    /* the profile's forward: forward_seqs prompts of forward_seq_len tokens (the last one shorter:
     * forward_tokens in all) from position 0 took forward_s (0: no profile run) */
    int32_t forward_seqs, forward_seq_len, forward_tokens;
    double forward_s;
} pd_kv_profile_t;

typedef struct pd_kv_cache {
    pd_kv_cache_config_t cfg;
    pd_kv_spec_t specs[PD_MAX_LAYERS];
    pd_kv_view_t *views; /* [num_layers], bound in layer order */
    void *region;        /* cfg.region_bytes */
    pd_kv_profile_t profile;
    pd_backend_t *be;
    const pd_kv_region_allocator_t *allocator;
} pd_kv_cache_t;

/* Per-layer specs of model (FULL, or SLIDING_WINDOW when the config sets a window). */
pd_status_t pd_kv_specs_from_model(const pd_model_config_t *mc, int32_t block_size, pd_dtype_t dtype,
                                   pd_kv_spec_t *specs_out);

/* Measures what the KV cache may use (step 2). Runs one forward on the model. */
pd_status_t pd_kv_profile_available(pd_model_t *model, pd_backend_t *be, const pd_kv_init_params_t *p,
                                    pd_kv_profile_t *prof_out);

/* Steps 1–4. The caller frees *kv_out with pd_kv_cache_free. PD_ERR_NO_SPACE (logged with the
 * numbers) when the memory cannot hold one request of max_model_len. */
pd_status_t pd_kv_cache_init(pd_model_t *model, pd_backend_t *be, const pd_kv_init_params_t *p,
                             pd_kv_cache_t **kv_out);

void pd_kv_cache_free(pd_kv_cache_t *kv);

/* The bytes one block id costs across every layer of model (pages of all its KV tensors), as the
 * plan lays them out with block_size and dtype. 0 when the model cannot be planned. */
size_t pd_kv_block_bytes(const pd_model_config_t *mc, int32_t block_size, pd_dtype_t dtype,
                         int32_t max_model_len, int32_t max_num_batched_tokens);

/* Physical RAM in bytes, and this process's resident set in bytes. */
size_t pd_sys_physical_ram(void);
size_t pd_sys_rss(void);

#endif
