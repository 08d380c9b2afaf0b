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

#include "common/key_map.h"
#include "scheduler/block_pool.h"
#include "scheduler/request.h"

#define PD_KV_MANAGER_MAX_GROUPS 32

/* A load from the tier in flight: pool blocks taken for the next blocks of a request's prompt, which
 * the tier fills. The manager owns it (pd_kv_manager_promote makes it, pd_kv_manager_poll_tier ends
 * it); the tier writes only n_loaded, status and its own fields, and hands it back through
 * finished. Its blocks are out of the pool (neither free nor cached) until it ends, when those
 * loaded are cached under their keys and all go back to the free queue. */
typedef struct pd_kv_tier_load {
    struct pd_kv_tier_load *next;      /* the tier's queues */
    struct pd_kv_tier_load *next_load; /* the manager's loads in flight */
    pd_request_t *req;                 /* the request it is for; NULL once that request has ended */
    uint32_t *hits;                    /* [n_hits] the request's pool hit, held until it ends */
    int32_t n_hits;                    /* = the prompt's logical block that blocks[0] holds */
    int32_t n;                         /* blocks */
    pd_hash128_t *keys;                /* [n] the blocks' prefix-cache hashes */
    uint32_t *blocks;                  /* [n] pool blocks */
    int32_t *tokens;                   /* [n × block_size] their token ids (the KV events') */
    pd_hash128_t parent;               /* n_hits > 0: block n_hits − 1's hash */
    /* the tier's: */
    int32_t n_loaded;   /* when it ends: blocks [0, n_loaded) hold their keys' KV; it stops at the
                         * first block it lacks or fails to load */
    uint32_t *slots;    /* [n] */
    double *seconds;    /* [n] per block read */
    pd_status_t status; /* of block n_loaded when that failed */
} pd_kv_tier_load_t;

/* A second tier behind the pool (engine/kv_offload.h, --kv-offload-tier): a cached block the pool
 * evicts is saved to it first, and a prefix that misses the pool continues from it
 * (pd_kv_manager_promote). The callbacks run on the scheduler's thread. */
typedef struct pd_kv_tier {
    void *ctx;
    bool (*contains)(void *ctx, pd_hash128_t key);
    /* Starts filling load's blocks with its keys' KV, in order, on any thread; a load may also end
     * before this returns. Either way it is reported by finished. */
    void (*load)(void *ctx, pd_kv_tier_load_t *load);
    /* A load that has ended (n_loaded set), or NULL; each is returned once. */
    pd_kv_tier_load_t *(*finished)(void *ctx);
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
    pd_kv_tier_load_t *tier_loads;            /* in flight */
    pd_key_map_t tier_keys;                   /* their keys → their block ids (each key in one load) */
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
 * from the tier: for the next full blocks the tier holds, up to max logical blocks and leaving the
 * last prompt token to compute, pool blocks are taken and the tier's load into them starts
 * (req->tier_load); it stops before a block another load in flight brings (read once: req looks up
 * again after its load). Takes no block the rest of the prompt needs. Returns the number of blocks whose
 * load started; PD_KV_PROMOTE_WAIT when another request's load in flight brings req's next block
 * (req then waits for it rather than read it twice). The pool hit is held until the load ends. */
#define PD_KV_PROMOTE_WAIT (-1)
int32_t pd_kv_manager_promote(pd_kv_cache_manager_t *m, pd_request_t *req, const uint32_t *hits,
                              int32_t n_hits, int32_t max);

/* Ends the tier's finished loads: the blocks loaded are cached under their keys (BlockStored), then
 * every block goes back to the free queue (the prompt's tail first, so evicted first; the pool hit
 * last), and the load's request (if any) is no longer loading: its lookup now finds them. A load
 * ends whether or not its request is still there. */
void pd_kv_manager_poll_tier(pd_kv_cache_manager_t *m);

/* req ends while its tier load is in flight: the load goes on without it. */
void pd_kv_manager_tier_orphan(pd_request_t *req);

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
