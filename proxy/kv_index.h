/* proxy/kv_index.h — which nodes hold which KV blocks, as their KV cache events say: block key
 * (pd_kv_event_hash) → a bitmask of node indexes. Bounded: past max_entries new keys are not
 * recorded (the index is then stale, and routing only less precise). Loop thread only. */
#ifndef PD_PROXY_KV_INDEX_H
#define PD_PROXY_KV_INDEX_H

#include <stdbool.h>
#include <stdint.h>

#define PX_KV_INDEX_NODES 64

typedef struct px_kv_index {
    uint64_t *keys, *masks; /* [cap] open addressing, linear probing; mask 0 = empty slot */
    uint32_t cap, used, max_entries;
    uint32_t per_node[PX_KV_INDEX_NODES]; /* keys each node holds */
    uint64_t dropped;                     /* stores not recorded because the index was full */
} px_kv_index_t;

/* An index of at most max_entries keys (>= 1). False when out of memory. */
bool px_kv_index_init(px_kv_index_t *idx, uint32_t max_entries);
void px_kv_index_free(px_kv_index_t *idx);

/* node (< PX_KV_INDEX_NODES) holds / no longer holds the block with this key. */
void px_kv_index_add(px_kv_index_t *idx, uint64_t key, int node);
void px_kv_index_remove(px_kv_index_t *idx, uint64_t key, int node);
/* node holds nothing (AllBlocksCleared, a restart, a node that left). O(capacity). */
void px_kv_index_clear_node(px_kv_index_t *idx, int node);

/* The key a block held in a node's offload tier (events of medium "CPU_TIER" or "DISK") is recorded
 * under: the node may hold a block in its pool, its tier, or both, and each leaves on its own. */
static inline uint64_t px_kv_tier_key(uint64_t key)
{
    return key ^ 0x7469657221b10c5full;
}

/* How many of keys[0..n) node holds as an unbroken prefix, each block in its pool or its offload
 * tier (a tier's blocks load back instead of being recomputed). */
int px_kv_index_prefix(const px_kv_index_t *idx, const uint64_t *keys, int n, int node);

#endif
