/* scheduler/kv_cache_manager.h — a request's KV blocks: prefix-cache lookup, slot allocation,
 * caching of full blocks, release (DESIGN.md §3, vLLM v1 KVCacheManager semantics).
 *
 * KV cache groups (vLLM's hybrid allocator): with G groups a request's block_ids hold G ids per
 * logical block, interleaved: block_ids[b × G + g] is logical block b of group g, and num_blocks
 * counts logical blocks. Every group draws from the one pool. A sliding-window group never
 * allocates, and frees as soon as they fall out of the window, the blocks no position still to be
 * computed can attend to; those entries are 0 (the null block, never handed out). With one
 * full-attention group this is the plain per-request block list. */
#ifndef PD_SCHEDULER_KV_CACHE_MANAGER_H
#define PD_SCHEDULER_KV_CACHE_MANAGER_H

#include <stdbool.h>
#include <stdint.h>

#include "scheduler/block_pool.h"
#include "scheduler/request.h"

#define PD_KV_MANAGER_MAX_GROUPS 32

/* A second tier behind the pool (engine/kv_offload.h, --kv-offload-tier): a cached block the pool
 * evicts is saved to it first, and a prefix that misses the pool continues from it
 * (pd_kv_manager_promote). The callbacks run on the scheduler's thread. */
typedef struct pd_kv_tier {
    void *ctx;
    bool (*contains)(void *ctx, pd_hash128_t key);
    /* Fills block's pages with key's KV; any failure (missing, corrupt, I/O) leaves the tokens to
     * be recomputed. */
    pd_status_t (*load)(void *ctx, pd_hash128_t key, uint32_t block);
    /* Copies block's pages out under key; called before the block is overwritten. */
    void (*save)(void *ctx, pd_hash128_t key, uint32_t block);
} pd_kv_tier_t;

typedef struct pd_kv_cache_manager {
    pd_block_pool_t *pool;
    int32_t block_size;
    bool caching;
    int32_t num_groups;                       /* G */
    int32_t window[PD_KV_MANAGER_MAX_GROUPS]; /* per group: 0 = full attention, else its window */
    uint64_t prefix_queries;                  /* prompt tokens looked up */
    uint64_t prefix_hits;                     /* of which found in the cache */
    struct pd_kv_event_log *events;           /* BlockStored of group 0's new hashes, or NULL */
    const pd_kv_tier_t *tier;                 /* pd_kv_manager_set_tier, or NULL */
    uint64_t tier_queries;                    /* blocks looked up in the tier past a pool hit */
    uint64_t tier_hits;                       /* of which loaded into the pool */
    uint32_t *tier_ids;                       /* promote's scratch */
    int32_t cap_tier_ids;
} pd_kv_cache_manager_t;

/* num_groups groups with windows[g] (0 = full attention); windows NULL = one full group. */
pd_status_t pd_kv_manager_init(pd_kv_cache_manager_t *m, uint32_t num_blocks, int32_t block_size,
                               bool enable_caching, int32_t num_groups, const int32_t *windows);
void pd_kv_manager_destroy(pd_kv_cache_manager_t *m);

/* Longest cached prefix of req's full blocks, capped at num_tokens − 1 tokens (the last token is
 * always computed, for its logits) and at max logical blocks: every full group holds all of its
 * blocks, every sliding group those inside the window of the first position after it. Writes
 * count × G ids to blocks_out (0 for sliding entries not needed) and returns the logical count;
 * *num_tokens_out = count × block_size. No side effects on the pool (hashes are memoized in req).
 * Counts the lookup in prefix_queries/prefix_hits when count_stats. */
int32_t pd_kv_manager_get_computed_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, uint32_t *blocks_out,
                                          int32_t max, bool count_stats, int32_t *num_tokens_out);
/* Puts tier behind the pool (NULL: none): every cached block the pool evicts from now on is saved
 * to it. PD_ERR_UNSUPPORTED (logged) without prefix caching or with more than one KV cache group
 * (a sliding-window group's blocks are not offloaded). */
pd_status_t pd_kv_manager_set_tier(pd_kv_cache_manager_t *m, const pd_kv_tier_t *tier);

/* Continues req's pool hit of n_hits blocks (hits[n_hits], from pd_kv_manager_get_computed_blocks)
 * from the tier: the next full blocks the tier holds, up to max logical blocks and leaving the last
 * prompt token to compute, are loaded into pool blocks and cached there (free, at the back of the
 * LRU queue, so the request's lookup that follows finds them as prefix hits). Takes no block the
 * rest of the prompt needs; stops at the first block the tier lacks or fails to load. Returns the
 * number of blocks loaded. */
int32_t pd_kv_manager_promote(pd_kv_cache_manager_t *m, pd_request_t *req, const uint32_t *hits,
                              int32_t n_hits, int32_t max);

/* Counts one lookup of req that found hit_tokens cached in prefix_queries/prefix_hits (for a caller
 * that decides after the lookup whether it counts: the scheduler counts the one that admits). */
void pd_kv_manager_count_lookup(pd_kv_cache_manager_t *m, const pd_request_t *req, int32_t hit_tokens);

/* Makes room for num_new_tokens after req's num_computed_tokens, plus new_computed[n_computed × G]
 * (prefix hits, adopted first) and num_external_tokens (to be loaded by a connector; the last of
 * them may be recomputed). First frees the sliding-window blocks no position from there on can
 * see. Returns false and allocates nothing if the pool cannot supply the blocks. Unless
 * delay_cache, full blocks up to the tokens computed by this step are registered in the prefix
 * cache. */
bool pd_kv_manager_allocate_slots(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_new_tokens,
                                  const uint32_t *new_computed, int32_t n_computed,
                                  int32_t num_external_tokens, bool delay_cache);

/* Registers req's full blocks covering its first num_tokens tokens in the prefix cache. */
void pd_kv_manager_cache_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens);

/* Gives back req's logical blocks past the first ceil(num_tokens / block_size): the tail that holds
 * only positions >= num_tokens (KV of rejected draft tokens). Never touches a cached block (those
 * are full blocks of real tokens). Sets req->blocks_trimmed when it frees anything. */
void pd_kv_manager_trim(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens);

/* Releases req's blocks (tail first, so tails are evicted first) and forgets them. */
void pd_kv_manager_free(pd_kv_cache_manager_t *m, pd_request_t *req);

/* Pool blocks req holds now (non-null entries of every group). */
int32_t pd_kv_manager_held_blocks(const pd_kv_cache_manager_t *m, const pd_request_t *req);

double pd_kv_manager_usage(const pd_kv_cache_manager_t *m);

#endif
