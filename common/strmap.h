/* common/strmap.h — open-addressing hash map from byte strings to int64 values.
 * Keys are copied into the map (one allocation each, freed on delete); lookups never allocate;
 * deletion shifts entries back (no tombstones), so a long-lived map with churn stays fast. */
#ifndef PD_COMMON_STRMAP_H
#define PD_COMMON_STRMAP_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct pd_strmap_slot {
    const char *key; /* NULL = empty */
    uint32_t len;
    uint32_t hash32;
    int64_t value;
} pd_strmap_slot_t;

typedef struct pd_strmap {
    pd_strmap_slot_t *slots;
    size_t cap; /* power of two */
    size_t count;
} pd_strmap_t;

/* Initialises an empty map sized for about expected entries. PD_ERR_NO_MEMORY on failure. */
pd_status_t pd_strmap_init(pd_strmap_t *map, size_t expected);

/* Inserts or replaces key[len] → value. PD_ERR_NO_MEMORY when growing fails (map unchanged). */
pd_status_t pd_strmap_put(pd_strmap_t *map, const char *key, size_t len, int64_t value);

/* Looks key[len] up; returns 1 and sets *value_out when present, else 0. */
int pd_strmap_get(const pd_strmap_t *map, const char *key, size_t len, int64_t *value_out);

/* Removes key[len]; returns 1 if it was present (its value in *value_out when not NULL). */
int pd_strmap_del(pd_strmap_t *map, const char *key, size_t len, int64_t *value_out);

/* Frees the table and the copied keys. */
void pd_strmap_destroy(pd_strmap_t *map);

#endif
