/* proxy/kv_index.c — block key → nodes (see kv_index.h): open addressing with linear probing and
 * backward-shift deletion, as the block pool's map, so churn never degrades lookups. */
#include "proxy/kv_index.h"

#include <stdlib.h>
#include <string.h>

static uint32_t home(const px_kv_index_t *idx, uint64_t key)
{
    return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 32) & (idx->cap - 1);
}

/* The slot holding key, or the empty slot where it would go. */
static uint32_t find(const px_kv_index_t *idx, uint64_t key)
{
    uint32_t i = home(idx, key);
    while (idx->masks[i] != 0 && idx->keys[i] != key) {
        i = (i + 1) & (idx->cap - 1);
    }
    return i;
}

bool px_kv_index_init(px_kv_index_t *idx, uint32_t max_entries)
{
    memset(idx, 0, sizeof(*idx));
    idx->max_entries = max_entries > 0 ? max_entries : 1;
    idx->cap = 16;
    while (idx->cap < 2 * idx->max_entries) {
        idx->cap *= 2;
    }
    idx->keys = calloc(idx->cap, sizeof(uint64_t));
    idx->masks = calloc(idx->cap, sizeof(uint64_t));
    if (idx->keys == NULL || idx->masks == NULL) {
        px_kv_index_free(idx);
        return false;
    }
    return true;
}

void px_kv_index_free(px_kv_index_t *idx)
{
    free(idx->keys);
    free(idx->masks);
    memset(idx, 0, sizeof(*idx));
}

void px_kv_index_add(px_kv_index_t *idx, uint64_t key, int node)
{
    if (node < 0 || node >= PX_KV_INDEX_NODES || idx->cap == 0) {
        return;
    }
    uint32_t i = find(idx, key);
    uint64_t bit = 1ull << node;
    if (idx->masks[i] == 0) {
        if (idx->used >= idx->max_entries) {
            idx->dropped++;
            return;
        }
        idx->keys[i] = key;
        idx->used++;
    }
    if (!(idx->masks[i] & bit)) {
        idx->masks[i] |= bit;
        idx->per_node[node]++;
    }
}

/* Empties slot i and shifts later members of its probe run back (no tombstones). */
static void delete_slot(px_kv_index_t *idx, uint32_t i)
{
    uint32_t m = idx->cap - 1, j = i;
    idx->masks[i] = 0;
    idx->used--;
    for (;;) {
        j = (j + 1) & m;
        if (idx->masks[j] == 0) {
            return;
        }
        uint32_t h = home(idx, idx->keys[j]);
        /* j's entry may move to the hole at i unless its home lies cyclically in (i, j] */
        bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            idx->keys[i] = idx->keys[j];
            idx->masks[i] = idx->masks[j];
            idx->masks[j] = 0;
            i = j;
        }
    }
}

void px_kv_index_remove(px_kv_index_t *idx, uint64_t key, int node)
{
    if (node < 0 || node >= PX_KV_INDEX_NODES || idx->cap == 0) {
        return;
    }
    uint32_t i = find(idx, key);
    uint64_t bit = 1ull << node;
    if (!(idx->masks[i] & bit)) {
        return;
    }
    idx->masks[i] &= ~bit;
    idx->per_node[node]--;
    if (idx->masks[i] == 0) {
        idx->masks[i] = bit; /* delete_slot expects an occupied slot */
        delete_slot(idx, i);
    }
}

void px_kv_index_clear_node(px_kv_index_t *idx, int node)
{
    if (node < 0 || node >= PX_KV_INDEX_NODES || idx->per_node[node] == 0) {
        return;
    }
    uint64_t bit = 1ull << node;
    for (uint32_t i = 0; i < idx->cap;) {
        if (idx->masks[i] & bit) {
            idx->masks[i] &= ~bit;
            if (idx->masks[i] == 0) {
                idx->masks[i] = bit;
                delete_slot(idx, i);
                continue; /* another entry may have shifted into slot i */
            }
        }
        i++;
    }
    idx->per_node[node] = 0;
}

int px_kv_index_prefix(const px_kv_index_t *idx, const uint64_t *keys, int n, int node)
{
    if (node < 0 || node >= PX_KV_INDEX_NODES || idx->cap == 0) {
        return 0;
    }
    uint64_t bit = 1ull << node;
    int k = 0;
    while (k < n && ((idx->masks[find(idx, keys[k])] & bit) ||
                     (idx->masks[find(idx, px_kv_tier_key(keys[k]))] & bit))) {
        k++;
    }
    return k;
}
