/* scheduler/block_pool.c — block pool: intrusive LRU free queue + hash → block map. */
#include "scheduler/block_pool.h"

#include <stdlib.h>
#include <string.h>

#include "common/key_map.h"
#include "common/log.h"
#include "scheduler/kv_events.h"

#define NIL UINT32_MAX

typedef struct block {
    int32_t ref_cnt;
    bool has_hash;
    uint32_t prev, next; /* free queue links (NIL when not queued) */
    pd_hash128_t hash;
} block_t;

struct pd_block_pool {
    block_t *blocks;
    uint32_t num_blocks;
    bool caching;
    uint32_t head, tail; /* free queue */
    uint32_t num_free_total;
    uint32_t num_cached_free;
    pd_key_map_t table; /* hash → block id of every cached block */
    uint64_t evictions;
    pd_kv_event_log_t *events; /* BlockRemoved of evicted hashes, or NULL */
    void (*on_evict)(void *arg, uint32_t id, pd_hash128_t hash);
    void *on_evict_arg;
};

pd_status_t pd_block_pool_create(uint32_t num_blocks, bool enable_caching, pd_block_pool_t **pool_out)
{
    if (num_blocks < 2 || num_blocks > (1u << 30)) {
        pd_log_error("block pool: %u blocks is not a usable size (2 .. 2^30)", num_blocks);
        return PD_ERR_INVALID_ARG;
    }
    pd_block_pool_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    p->blocks = calloc(num_blocks, sizeof(block_t));
    if (p->blocks == NULL || pd_key_map_init(&p->table, num_blocks) != PD_OK) {
        pd_block_pool_destroy(p);
        pd_log_error("block pool: cannot allocate bookkeeping for %u blocks", num_blocks);
        return PD_ERR_NO_MEMORY;
    }
    p->num_blocks = num_blocks;
    p->caching = enable_caching;
    /* block 0 is the null block: permanently referenced, never queued */
    p->blocks[0].ref_cnt = 1;
    p->blocks[0].prev = p->blocks[0].next = NIL;
    p->head = num_blocks > 1 ? 1 : NIL;
    p->tail = num_blocks - 1;
    for (uint32_t i = 1; i < num_blocks; i++) {
        p->blocks[i].prev = i > 1 ? i - 1 : NIL;
        p->blocks[i].next = i + 1 < num_blocks ? i + 1 : NIL;
    }
    p->num_free_total = num_blocks - 1;
    *pool_out = p;
    return PD_OK;
}

void pd_block_pool_destroy(pd_block_pool_t *p)
{
    if (p == NULL) {
        return;
    }
    free(p->blocks);
    pd_key_map_free(&p->table);
    free(p);
}

static void queue_remove(pd_block_pool_t *p, uint32_t id)
{
    block_t *b = &p->blocks[id];
    if (b->prev != NIL) {
        p->blocks[b->prev].next = b->next;
    } else {
        p->head = b->next;
    }
    if (b->next != NIL) {
        p->blocks[b->next].prev = b->prev;
    } else {
        p->tail = b->prev;
    }
    b->prev = b->next = NIL;
    p->num_free_total--;
    if (b->has_hash) {
        p->num_cached_free--;
    }
}

static void queue_append(pd_block_pool_t *p, uint32_t id)
{
    block_t *b = &p->blocks[id];
    b->next = NIL;
    b->prev = p->tail;
    if (p->tail != NIL) {
        p->blocks[p->tail].next = id;
    } else {
        p->head = id;
    }
    p->tail = id;
    p->num_free_total++;
    if (b->has_hash) {
        p->num_cached_free++;
    }
}

static void evict_hash(pd_block_pool_t *p, uint32_t id)
{
    block_t *b = &p->blocks[id];
    if (!b->has_hash) {
        return;
    }
    if (p->on_evict != NULL) { /* the content is still there: the block is reused after this */
        p->on_evict(p->on_evict_arg, id, b->hash);
    }
    if (pd_key_map_remove(&p->table, b->hash, id)) {
        if (p->events != NULL) {
            pd_kv_event_removed(p->events, pd_kv_event_hash(b->hash));
        }
    }
    b->has_hash = false;
    p->evictions++;
}

pd_status_t pd_block_pool_take(pd_block_pool_t *p, uint32_t n, uint32_t *ids_out)
{
    if (n > p->num_free_total) {
        return PD_ERR_NO_SPACE;
    }
    for (uint32_t k = 0; k < n; k++) {
        uint32_t id = p->head;
        queue_remove(p, id);
        evict_hash(p, id);
        p->blocks[id].ref_cnt = 1;
        ids_out[k] = id;
    }
    return PD_OK;
}

pd_status_t pd_block_pool_touch(pd_block_pool_t *p, const uint32_t *ids, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++) {
        if (ids[k] == 0 || ids[k] >= p->num_blocks) {
            pd_log_error("block pool: touch of invalid block id %u", ids[k]);
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    for (uint32_t k = 0; k < n; k++) {
        block_t *b = &p->blocks[ids[k]];
        if (b->ref_cnt == 0) {
            queue_remove(p, ids[k]);
        }
        b->ref_cnt++;
    }
    return PD_OK;
}

pd_status_t pd_block_pool_free(pd_block_pool_t *p, const uint32_t *ids, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++) {
        if (ids[k] == 0 || ids[k] >= p->num_blocks || p->blocks[ids[k]].ref_cnt <= 0) {
            pd_log_error("block pool: free of block %u which is %s", ids[k],
                         ids[k] == 0 || ids[k] >= p->num_blocks ? "not a usable id" : "not in use");
            return PD_ERR_OUT_OF_RANGE;
        }
    }
    for (uint32_t k = 0; k < n; k++) {
        block_t *b = &p->blocks[ids[k]];
        if (--b->ref_cnt == 0) {
            queue_append(p, ids[k]);
        }
    }
    return PD_OK;
}

void pd_block_pool_set_event_log(pd_block_pool_t *p, pd_kv_event_log_t *log)
{
    p->events = log;
}

void pd_block_pool_set_evict_hook(pd_block_pool_t *p, void (*fn)(void *arg, uint32_t id, pd_hash128_t hash),
                                  void *arg)
{
    p->on_evict = fn;
    p->on_evict_arg = arg;
}

bool pd_block_pool_cache(pd_block_pool_t *p, uint32_t id, pd_hash128_t hash)
{
    if (!p->caching || id == 0 || id >= p->num_blocks || p->blocks[id].has_hash) {
        return false;
    }
    if (!pd_key_map_insert(&p->table, hash, id)) {
        return false; /* the same content is cached in another block already */
    }
    block_t *b = &p->blocks[id];
    b->hash = hash;
    b->has_hash = true;
    if (b->ref_cnt == 0) {
        p->num_cached_free++;
    }
    return true;
}

int64_t pd_block_pool_lookup(const pd_block_pool_t *p, pd_hash128_t hash)
{
    if (!p->caching) {
        return -1;
    }
    uint32_t id = pd_key_map_get(&p->table, hash);
    return id == PD_KEY_MAP_NONE ? -1 : (int64_t)id;
}

bool pd_block_pool_is_cached(const pd_block_pool_t *p, uint32_t id)
{
    return id < p->num_blocks && p->blocks[id].has_hash;
}

int32_t pd_block_pool_ref_count(const pd_block_pool_t *p, uint32_t id)
{
    return id < p->num_blocks ? p->blocks[id].ref_cnt : -1;
}

uint32_t pd_block_pool_num_blocks(const pd_block_pool_t *p)
{
    return p->num_blocks;
}

uint32_t pd_block_pool_num_free(const pd_block_pool_t *p)
{
    return p->num_free_total - p->num_cached_free;
}

uint32_t pd_block_pool_num_cached_free(const pd_block_pool_t *p)
{
    return p->num_cached_free;
}

uint32_t pd_block_pool_num_used(const pd_block_pool_t *p)
{
    return p->num_blocks - 1 - p->num_free_total;
}

double pd_block_pool_usage(const pd_block_pool_t *p)
{
    return (double)pd_block_pool_num_used(p) / (double)(p->num_blocks - 1);
}

uint64_t pd_block_pool_num_evictions(const pd_block_pool_t *p)
{
    return p->evictions;
}

pd_status_t pd_block_pool_check(const pd_block_pool_t *p)
{
    uint32_t n = 0, cached = 0, prev = NIL;
    for (uint32_t id = p->head; id != NIL; id = p->blocks[id].next) {
        if (p->blocks[id].ref_cnt != 0 || p->blocks[id].prev != prev || ++n > p->num_blocks) {
            return PD_ERR_INTERNAL;
        }
        cached += p->blocks[id].has_hash;
        prev = id;
    }
    if (prev != p->tail || n != p->num_free_total || cached != p->num_cached_free) {
        return PD_ERR_INTERNAL;
    }
    uint32_t zero = 0, hashed = 0, in_table = 0;
    for (uint32_t id = 1; id < p->num_blocks; id++) {
        zero += p->blocks[id].ref_cnt == 0;
        if (p->blocks[id].ref_cnt < 0) {
            return PD_ERR_INTERNAL;
        }
        if (p->blocks[id].has_hash) {
            hashed++;
            if (pd_key_map_get(&p->table, p->blocks[id].hash) != id) {
                return PD_ERR_INTERNAL;
            }
        }
    }
    in_table = p->table.count;
    return zero == n && hashed == in_table ? PD_OK : PD_ERR_INTERNAL;
}
