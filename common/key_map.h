/* common/key_map.h — fixed-capacity open-addressing map from 128-bit hashes to uint32 values (the
 * prefix cache's block hash → block id, the offload tier's block hash → slot). Linear probing,
 * backward-shift deletion (no tombstones, so churn does not degrade lookups). The capacity is fixed
 * at init: callers size it at least twice the entries they will ever hold. Not thread-safe. */
#ifndef PD_COMMON_KEY_MAP_H
#define PD_COMMON_KEY_MAP_H

#include <stdbool.h>
#include <stdint.h>

#include "common/hash.h"
#include "common/status.h"

#define PD_KEY_MAP_NONE UINT32_MAX

typedef struct pd_key_map_slot {
    pd_hash128_t key;
    uint32_t value; /* PD_KEY_MAP_NONE: empty */
} pd_key_map_slot_t;

typedef struct pd_key_map {
    pd_key_map_slot_t *slots;
    uint32_t cap; /* power of two */
    uint32_t count;
} pd_key_map_t;

/* An empty map for up to max_entries (capacity: the power of two >= 2 × max_entries, at least 16).
 * PD_ERR_NO_MEMORY (map zeroed) on failure. */
pd_status_t pd_key_map_init(pd_key_map_t *m, uint32_t max_entries);
void pd_key_map_free(pd_key_map_t *m);

/* The value of key, or PD_KEY_MAP_NONE. */
uint32_t pd_key_map_get(const pd_key_map_t *m, pd_hash128_t key);

/* Inserts key → value (value != PD_KEY_MAP_NONE). Returns false, changing nothing, when key is
 * present already or the map holds cap − 1 entries. */
bool pd_key_map_insert(pd_key_map_t *m, pd_hash128_t key, uint32_t value);

/* Removes key when it maps to value (any value: PD_KEY_MAP_NONE). Returns whether it removed. */
bool pd_key_map_remove(pd_key_map_t *m, pd_hash128_t key, uint32_t value);

#endif
