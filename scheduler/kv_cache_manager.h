/* scheduler/kv_cache_manager.h — a request's KV blocks: prefix-cache lookup, slot allocation,
 * caching of full blocks, release (DESIGN.md §3, vLLM v1 KVCacheManager semantics). */
#ifndef PD_SCHEDULER_KV_CACHE_MANAGER_H
#define PD_SCHEDULER_KV_CACHE_MANAGER_H

#include <stdbool.h>
#include <stdint.h>

#include "scheduler/block_pool.h"
#include "scheduler/request.h"

typedef struct pd_kv_cache_manager {
    pd_block_pool_t *pool;
    int32_t block_size;
    bool caching;
    uint64_t prefix_queries; /* prompt tokens looked up */
    uint64_t prefix_hits;    /* of which found in the cache */
} pd_kv_cache_manager_t;

pd_status_t pd_kv_manager_init(pd_kv_cache_manager_t *m, uint32_t num_blocks, int32_t block_size,
                               bool enable_caching);
void pd_kv_manager_destroy(pd_kv_cache_manager_t *m);

/* Longest cached prefix of req's full blocks, capped at num_tokens − 1 tokens (the last token is
 * always computed, for its logits). Writes up to max block ids to blocks_out and returns their
 * count; *num_tokens_out = count × block_size. No side effects on the pool (hashes are memoized
 * in req). Counts the lookup in prefix_queries/prefix_hits when count_stats. */
int32_t pd_kv_manager_get_computed_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, uint32_t *blocks_out,
                                          int32_t max, bool count_stats, int32_t *num_tokens_out);

/* Makes room for num_new_tokens after req's num_computed_tokens, plus new_computed[n_computed]
 * (prefix hits, adopted first) and num_external_tokens (to be loaded by a connector). Returns
 * false and changes nothing if the pool cannot supply the blocks. Unless delay_cache, full blocks
 * up to the tokens computed by this step are registered in the prefix cache. */
bool pd_kv_manager_allocate_slots(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_new_tokens,
                                  const uint32_t *new_computed, int32_t n_computed,
                                  int32_t num_external_tokens, bool delay_cache);

/* Registers req's full blocks covering its first num_tokens tokens in the prefix cache. */
void pd_kv_manager_cache_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens);

/* Releases req's blocks (tail first, so tails are evicted first) and forgets them. */
void pd_kv_manager_free(pd_kv_cache_manager_t *m, pd_request_t *req);

/* Blocks needed for n more tokens of req beyond what it holds (no prefix hits). */
int32_t pd_kv_manager_blocks_needed(const pd_kv_cache_manager_t *m, const pd_request_t *req,
                                    int32_t total_tokens);

double pd_kv_manager_usage(const pd_kv_cache_manager_t *m);

#endif
