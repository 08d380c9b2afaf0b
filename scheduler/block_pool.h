/* scheduler/block_pool.h — fixed set of KV blocks with an LRU free queue and a prefix cache.
 *
 * All blocks exist from creation. A block is free when its ref count is 0; free blocks sit in an
 * intrusive doubly linked queue, least recently freed at the front (O(1) pop-front, remove,
 * append). A full block may carry a hash (xxh3-128 chain of its tokens): a free block keeps its
 * hash — it is "cached free" — until it is popped for reuse, when its hash is evicted. Block 0 is
 * the null block and is never handed out. Invariant once every request has ended:
 *   num_free + num_cached_free == num_blocks − 1. */
#ifndef PD_SCHEDULER_BLOCK_POOL_H
#define PD_SCHEDULER_BLOCK_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/hash.h"
#include "common/status.h"

typedef struct pd_block_pool pd_block_pool_t;

/* Creates a pool of num_blocks blocks (>= 2); with enable_caching false no hash is ever kept.
 * PD_ERR_NO_MEMORY if the bookkeeping cannot be allocated; *pool_out set only on PD_OK. */
pd_status_t pd_block_pool_create(uint32_t num_blocks, bool enable_caching, pd_block_pool_t **pool_out);
void pd_block_pool_destroy(pd_block_pool_t *pool);

/* Takes n blocks from the front of the free queue (evicting their cached hashes), ref count 1.
 * Fails with PD_ERR_NO_SPACE and takes nothing if fewer than n are free. */
pd_status_t pd_block_pool_take(pd_block_pool_t *pool, uint32_t n, uint32_t *ids_out);

/* Adds a reference to each of ids[n] (prefix-cache hits); a block at ref 0 leaves the free queue.
 * PD_ERR_OUT_OF_RANGE (nothing changed) for the null block or an id outside the pool. */
pd_status_t pd_block_pool_touch(pd_block_pool_t *pool, const uint32_t *ids, uint32_t n);

/* Drops one reference from each of ids[n] in the order given; blocks reaching 0 are appended to
 * the free queue in that order (callers pass a request's blocks tail first, so tails are evicted
 * first). PD_ERR_OUT_OF_RANGE for a bad id or a block already at 0 (nothing changed). */
pd_status_t pd_block_pool_free(pd_block_pool_t *pool, const uint32_t *ids, uint32_t n);

/* Records hash as the content of block id (a full block). If another block already holds the same
 * hash, the map keeps the first one; the block stays uncached. No-op without caching. Returns
 * whether the hash entered the cache. */
bool pd_block_pool_cache(pd_block_pool_t *pool, uint32_t id, pd_hash128_t hash);

struct pd_kv_event_log;
/* Hashes that leave the cache from now on are logged as BlockRemoved events (NULL: none). */
void pd_block_pool_set_event_log(pd_block_pool_t *pool, struct pd_kv_event_log *log);

/* Calls fn(arg, id, hash) when a cached block is popped for reuse, before its hash leaves the cache
 * and before anything overwrites its pages (the KV offload tier copies it out). NULL: none. */
void pd_block_pool_set_evict_hook(pd_block_pool_t *pool,
                                  void (*fn)(void *arg, uint32_t id, pd_hash128_t hash), void *arg);

/* Block id holding hash, or -1. */
int64_t pd_block_pool_lookup(const pd_block_pool_t *pool, pd_hash128_t hash);

/* Whether id currently carries a hash. */
bool pd_block_pool_is_cached(const pd_block_pool_t *pool, uint32_t id);

int32_t pd_block_pool_ref_count(const pd_block_pool_t *pool, uint32_t id);
uint32_t pd_block_pool_num_blocks(const pd_block_pool_t *pool);
/* Free blocks without a cached hash. */
uint32_t pd_block_pool_num_free(const pd_block_pool_t *pool);
/* Free blocks that still carry a cached hash (reusable as prefix hits until evicted). */
uint32_t pd_block_pool_num_cached_free(const pd_block_pool_t *pool);
/* Blocks in use (ref > 0), excluding the null block. */
uint32_t pd_block_pool_num_used(const pd_block_pool_t *pool);
/* Fraction of usable blocks in use. */
double pd_block_pool_usage(const pd_block_pool_t *pool);
/* Number of hash evictions so far (cached blocks reused for other content). */
uint64_t pd_block_pool_num_evictions(const pd_block_pool_t *pool);

/* Verifies the free queue, ref counts and hash map agree (tests). PD_ERR_INTERNAL on mismatch. */
pd_status_t pd_block_pool_check(const pd_block_pool_t *pool);

#endif
