/* common/key_map.c — open addressing over 128-bit keys. */
#include "common/key_map.h"

#include <stdlib.h>

static uint32_t home_of(const pd_key_map_t *m, pd_hash128_t h)
{
    return (uint32_t)(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull)) & (m->cap - 1);
}

/* The slot holding key, or the empty slot where it would go. */
static uint32_t find(const pd_key_map_t *m, pd_hash128_t h)
{
    uint32_t i = home_of(m, h);
    while (m->slots[i].value != PD_KEY_MAP_NONE && !pd_hash128_eq(m->slots[i].key, h)) {
        i = (i + 1) & (m->cap - 1);
    }
    return i;
}

pd_status_t pd_key_map_init(pd_key_map_t *m, uint32_t max_entries)
{
    m->count = 0;
    m->cap = 16;
    while (m->cap < 2ull * max_entries) {
        m->cap <<= 1;
    }
    m->slots = malloc((size_t)m->cap * sizeof(*m->slots));
    if (m->slots == NULL) {
        m->cap = 0;
        return PD_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < m->cap; i++) {
        m->slots[i].value = PD_KEY_MAP_NONE;
    }
    return PD_OK;
}

void pd_key_map_free(pd_key_map_t *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}

uint32_t pd_key_map_get(const pd_key_map_t *m, pd_hash128_t key)
{
    return m->cap == 0 ? PD_KEY_MAP_NONE : m->slots[find(m, key)].value;
}

bool pd_key_map_insert(pd_key_map_t *m, pd_hash128_t key, uint32_t value)
{
    if (m->cap == 0 || value == PD_KEY_MAP_NONE || m->count + 1 >= m->cap) {
        return false;
    }
    uint32_t i = find(m, key);
    if (m->slots[i].value != PD_KEY_MAP_NONE) {
        return false;
    }
    m->slots[i].key = key;
    m->slots[i].value = value;
    m->count++;
    return true;
}

bool pd_key_map_remove(pd_key_map_t *m, pd_hash128_t key, uint32_t value)
{
    if (m->cap == 0) {
        return false;
    }
    uint32_t i = find(m, key), mask = m->cap - 1;
    if (m->slots[i].value == PD_KEY_MAP_NONE || (value != PD_KEY_MAP_NONE && m->slots[i].value != value)) {
        return false;
    }
    m->slots[i].value = PD_KEY_MAP_NONE;
    m->count--;
    for (uint32_t j = i;;) {
        j = (j + 1) & mask;
        if (m->slots[j].value == PD_KEY_MAP_NONE) {
            return true;
        }
        uint32_t home = home_of(m, m->slots[j].key);
        /* move j back to i if its home is not in the cyclic range (i, j] */
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
            m->slots[i] = m->slots[j];
            m->slots[j].value = PD_KEY_MAP_NONE;
            i = j;
        }
    }
}
