/* scheduler/kv_cache_spec.h — per-layer KV cache specs and the cache config computed from them
 * (vLLM v1: get_kv_cache_spec → get_kv_cache_config). Pure arithmetic, no allocation of cache
 * memory here: engine/kv_init.c allocates one region from the config and views it per layer. */
#ifndef PD_SCHEDULER_KV_CACHE_SPEC_H
#define PD_SCHEDULER_KV_CACHE_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/limits.h"
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

#define PD_KV_MAX_GROUPS 32

/* One allocated tensor: a region slice of num_blocks pages, used by shared_by[num_shared] layers
 * (the owner first). A hybrid model's tensor holds one layer of every KV cache group: a block id
 * belongs to one group at a time, so its page in tensor j is layer j of that group. */
typedef struct pd_kv_tensor {
    size_t offset; /* bytes from the region start */
    size_t size;   /* num_blocks × page bytes */
    size_t page_bytes;
    int32_t shared_by[PD_KV_MAX_GROUPS + 8];
    int32_t num_shared;
} pd_kv_tensor_t;

/* A KV cache group: layers of one attention kind that share one block table per request (vLLM's
 * KVCacheGroupSpec). A model whose layers are all of one kind has one group; a hybrid model
 * (Gemma 3: sliding-window and full layers) has groups of group_size layers each (the last of a
 * kind padded), as vLLM's hybrid allocator forms them. */
typedef struct pd_kv_group {
    pd_kv_spec_kind_t kind; /* FULL (also MLA) or SLIDING_WINDOW */
    int32_t sliding_window; /* SLIDING_WINDOW: attention sees this many tokens */
    int32_t layers[PD_MAX_LAYERS];
    int32_t num_layers;
} pd_kv_group_t;

typedef struct pd_kv_cache_config {
    uint32_t num_blocks; /* blocks in the pool, every group's (block 0 is the null block) */
    int32_t block_size;
    size_t region_bytes; /* Σ tensor sizes: one allocation for every layer */
    pd_kv_tensor_t tensors[PD_MAX_LAYERS];
    int32_t num_tensors;
    int32_t layer_tensor[PD_MAX_LAYERS]; /* layer → tensor index */
    pd_kv_group_t groups[PD_KV_MAX_GROUPS];
    int32_t num_groups;
    int32_t layer_group[PD_MAX_LAYERS]; /* layer → group index */
    int32_t num_layers;
} pd_kv_cache_config_t;

/* Computes the config for specs[num_layers] from available_bytes:
 *   one kind of attention: num_blocks = available / Σ_owning-layers page bytes, one group;
 *   hybrid: groups of group_size layers over group_size shared tensors (vLLM's rule: the smallest
 *   kind's layer count, or the largest when within 25 %), num_blocks = available / (group_size ×
 *   page bytes); every owning layer must then have the same page size.
 * Fails with PD_ERR_INVALID_ARG on inconsistent specs (a shared layer pointing at a shared or
 * missing layer, block sizes that differ, a hybrid model with several page sizes or more than
 * PD_KV_MAX_GROUPS groups) and PD_ERR_NO_SPACE (logged with the numbers) when the memory cannot
 * hold one request of max_model_len tokens computed in steps of at most max_chunk tokens (0 =
 * max_model_len; a sliding group holds its window plus a chunk) (+ the null block). */
pd_status_t pd_kv_cache_config_compute(const pd_kv_spec_t *specs, int32_t num_layers, size_t available_bytes,
                                       int32_t max_model_len, int32_t max_chunk,
                                       pd_kv_cache_config_t *cfg_out);

/* Blocks of every group one request of num_tokens holds at most while it runs, when a step
 * computes at most chunk tokens of it: full groups ⌈num_tokens / bs⌉, sliding groups the window
 * plus the chunk (never more than the full count). */
int64_t pd_kv_cache_config_blocks_per_request(const pd_kv_cache_config_t *c, int32_t num_tokens,
                                              int32_t chunk);

/* A one-line description of the group layout ("full" for one full-attention group, else e.g.
 * "g4:full,swa512x5"): what two engines exchanging KV must agree on. */
void pd_kv_cache_config_layout(const pd_kv_cache_config_t *c, char *buf, size_t cap);

#endif
