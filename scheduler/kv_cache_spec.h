/* scheduler/kv_cache_spec.h — per-layer KV cache specs and the cache config computed from them
 * (vLLM v1: get_kv_cache_spec → get_kv_cache_config). Pure arithmetic, no allocation of cache
 * memory here: engine/kv_init.c allocates one region from the config and views it per layer. */
#ifndef PD_SCHEDULER_KV_CACHE_SPEC_H
#define PD_SCHEDULER_KV_CACHE_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum pd_kv_spec_kind {
    PD_KV_FULL = 0,       /* K and V for every token */
    PD_KV_SLIDING_WINDOW, /* K and V; attention sees the last `sliding_window` tokens */
    PD_KV_MLA,            /* one latent vector per token instead of K + V */
    PD_KV_SHARED,         /* no cache of its own: reads the cache of layer `shared_with` */
} pd_kv_spec_kind_t;

typedef struct pd_kv_spec {
    pd_kv_spec_kind_t kind;
    int32_t block_size;
    int32_t num_kv_heads;
    int32_t head_size;
    int32_t dtype_bytes;
    int32_t sliding_window; /* SLIDING_WINDOW only */
    int32_t shared_with;    /* SHARED only: the layer whose cache this layer uses */
} pd_kv_spec_t;

/* Bytes of one block of one layer: 2 (1 for MLA) × block_size × kv heads × head size × dtype;
 * 0 for a shared layer. */
size_t pd_kv_spec_page_bytes(const pd_kv_spec_t *spec);

#define PD_KV_MAX_LAYERS 256

/* One allocated tensor: a region slice of num_blocks pages, used by shared_by[num_shared] layers
 * (the owner first). */
typedef struct pd_kv_tensor {
    size_t offset; /* bytes from the region start */
    size_t size;   /* num_blocks × page bytes */
    size_t page_bytes;
    int32_t shared_by[8];
    int32_t num_shared;
} pd_kv_tensor_t;

/* Layers grouped by page size (a group shares one block table in the scheduler). */
typedef struct pd_kv_group {
    size_t page_bytes;
    int32_t layers[PD_KV_MAX_LAYERS];
    int32_t num_layers;
} pd_kv_group_t;

typedef struct pd_kv_cache_config {
    uint32_t num_blocks; /* blocks per layer (block 0 is the null block) */
    int32_t block_size;
    size_t region_bytes; /* Σ tensor sizes: one allocation for every layer */
    pd_kv_tensor_t tensors[PD_KV_MAX_LAYERS];
    int32_t num_tensors;
    int32_t layer_tensor[PD_KV_MAX_LAYERS]; /* layer → tensor index */
    pd_kv_group_t groups[8];
    int32_t num_groups;
    int32_t num_layers;
} pd_kv_cache_config_t;

/* Computes the config for specs[num_layers] from available_bytes:
 *   num_blocks = available / Σ_owning-layers page bytes  (= available / page / layers when uniform).
 * Fails with PD_ERR_INVALID_ARG on inconsistent specs (a shared layer pointing at a shared or
 * missing layer, block sizes that differ) and PD_ERR_NO_SPACE (logged with the numbers) when
 * the memory cannot hold one request of max_model_len tokens (+ the null block). */
pd_status_t pd_kv_cache_config_compute(const pd_kv_spec_t *specs, int32_t num_layers, size_t available_bytes,
                                       int32_t max_model_len, pd_kv_cache_config_t *cfg_out);

#endif
