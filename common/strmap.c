/* common/strmap.c — string → int64 hash map (linear probing, load <= 0.5). */
#include "common/strmap.h"

#include <stdlib.h>
#include <string.h>

#include "common/hash.h"

static pd_status_t strmap_alloc(pd_strmap_t *map, size_t cap)
{
    map->slots = calloc(cap, sizeof(pd_strmap_slot_t));
    if (map->slots == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    map->cap = cap;
    return PD_OK;
}

pd_status_t pd_strmap_init(pd_strmap_t *map, size_t expected)
{
    size_t cap = 16;
    while (cap < expected * 2) {
        cap <<= 1;
    }
    map->count = 0;
    return strmap_alloc(map, cap);
}

static size_t strmap_find(const pd_strmap_slot_t *slots, size_t cap, const char *key, uint32_t len,
                          uint32_t h)
{
    size_t i = h & (cap - 1);
    for (;;) {
        const pd_strmap_slot_t *s = &slots[i];
        if (s->key == NULL || (s->hash32 == h && s->len == len && memcmp(s->key, key, len) == 0)) {
            return i;
        }
        i = (i + 1) & (cap - 1);
    }
}

static pd_status_t strmap_grow(pd_strmap_t *map)
{
    pd_strmap_slot_t *old = map->slots;
    size_t old_cap = map->cap;
    if (strmap_alloc(map, old_cap * 2) != PD_OK) {
        map->slots = old;
        map->cap = old_cap;
        return PD_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].key != NULL) {
            size_t j = strmap_find(map->slots, map->cap, old[i].key, old[i].len, old[i].hash32);
            map->slots[j] = old[i];
        }
    }
    free(old);
    return PD_OK;
}

pd_status_t pd_strmap_put(pd_strmap_t *map, const char *key, size_t len, int64_t value)
{
    if (len > UINT32_MAX) {
        return PD_ERR_INVALID_ARG;
    }
    if ((map->count + 1) * 2 > map->cap && strmap_grow(map) != PD_OK) {
        return PD_ERR_NO_MEMORY;
    }
    uint32_t h = (uint32_t)pd_hash64(key, len, 0);
    size_t i = strmap_find(map->slots, map->cap, key, (uint32_t)len, h);
    pd_strmap_slot_t *s = &map->slots[i];
    if (s->key == NULL) {
        char *copy = malloc(len + 1);
        if (copy == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        memcpy(copy, key, len);
        copy[len] = '\0';
        s->key = copy;
        s->len = (uint32_t)len;
        s->hash32 = h;
        map->count++;
    }
    s->value = value;
    return PD_OK;
}

int pd_strmap_get(const pd_strmap_t *map, const char *key, size_t len, int64_t *value_out)
{
    if (len > UINT32_MAX || map->slots == NULL) {
        return 0;
    }
    uint32_t h = (uint32_t)pd_hash64(key, len, 0);
    size_t i = strmap_find(map->slots, map->cap, key, (uint32_t)len, h);
    if (map->slots[i].key == NULL) {
        return 0;
    }
    *value_out = map->slots[i].value;
    return 1;
}

int pd_strmap_del(pd_strmap_t *map, const char *key, size_t len, int64_t *value_out)
{
    if (len > UINT32_MAX || map->slots == NULL) {
        return 0;
    }
    uint32_t h = (uint32_t)pd_hash64(key, len, 0);
    size_t mask = map->cap - 1;
    size_t i = strmap_find(map->slots, map->cap, key, (uint32_t)len, h);
    if (map->slots[i].key == NULL) {
        return 0;
    }
    if (value_out != NULL) {
        *value_out = map->slots[i].value;
    }
    free((char *)map->slots[i].key);
    map->slots[i].key = NULL;
    map->count--;
    /* backward shift: pull later entries of the probe run into the hole when their home slot
     * is not between the hole and them */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (map->slots[j].key == NULL) {
            break;
        }
        size_t home = map->slots[j].hash32 & mask;
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
            map->slots[i] = map->slots[j];
            map->slots[j].key = NULL;
            i = j;
        }
    }
    return 1;
}

void pd_strmap_destroy(pd_strmap_t *map)
{
    for (size_t i = 0; map->slots != NULL && i < map->cap; i++) {
        free((char *)map->slots[i].key);
    }
    free(map->slots);
    map->slots = NULL;
    map->cap = 0;
    map->count = 0;
}
