/* scheduler/kv_cache_manager.c — per-request block lists over the block pool. */
#include "scheduler/kv_cache_manager.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

pd_status_t pd_kv_manager_init(pd_kv_cache_manager_t *m, uint32_t num_blocks, int32_t block_size,
                               bool enable_caching)
{
    memset(m, 0, sizeof(*m));
    if (block_size < 1) {
        pd_log_error("kv cache manager: block size %d", block_size);
        return PD_ERR_INVALID_ARG;
    }
    m->block_size = block_size;
    m->caching = enable_caching;
    return pd_block_pool_create(num_blocks, enable_caching, &m->pool);
}

void pd_kv_manager_destroy(pd_kv_cache_manager_t *m)
{
    pd_block_pool_destroy(m->pool);
    m->pool = NULL;
}

static bool grow(void **p, int32_t *cap, int32_t need, size_t elem)
{
    if (need <= *cap) {
        return true;
    }
    int32_t c = *cap ? *cap : 8;
    while (c < need) {
        c *= 2;
    }
    void *q = realloc(*p, (size_t)c * elem);
    if (q == NULL) {
        return false;
    }
    *p = q;
    *cap = c;
    return true;
}

/* Extends req's memoized hash chain to cover its first n_blocks full blocks. */
static bool ensure_hashes(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t n_blocks)
{
    if (req->num_hashes >= n_blocks) {
        return true;
    }
    int32_t cap = req->num_hashes; /* hashes array is sized to the token capacity once */
    if (req->block_hashes == NULL) {
        cap = 0;
        int32_t full = req->cap_tokens / m->block_size + 1;
        if (!grow((void **)&req->block_hashes, &cap, full, sizeof(pd_hash128_t))) {
            return false;
        }
    }
    for (int32_t b = req->num_hashes; b < n_blocks; b++) {
        const pd_hash128_t *parent = b > 0 ? &req->block_hashes[b - 1] : NULL;
        req->block_hashes[b] =
            pd_hash128_chain(parent, req->tokens + (size_t)b * m->block_size, (size_t)m->block_size, NULL, 0);
    }
    req->num_hashes = n_blocks;
    return true;
}

int32_t pd_kv_manager_get_computed_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, uint32_t *blocks_out,
                                          int32_t max, bool count_stats, int32_t *num_tokens_out)
{
    *num_tokens_out = 0;
    if (!m->caching) {
        return 0;
    }
    int32_t full = (req->num_tokens - 1) / m->block_size; /* leave the last token to compute */
    if (full > max) {
        full = max;
    }
    if (!ensure_hashes(m, req, full)) {
        return 0;
    }
    int32_t n = 0;
    for (; n < full; n++) {
        int64_t id = pd_block_pool_lookup(m->pool, req->block_hashes[n]);
        if (id < 0) {
            break;
        }
        blocks_out[n] = (uint32_t)id;
    }
    if (count_stats) {
        m->prefix_queries += (uint64_t)req->num_tokens;
        m->prefix_hits += (uint64_t)n * (uint64_t)m->block_size;
    }
    *num_tokens_out = n * m->block_size;
    return n;
}

int32_t pd_kv_manager_blocks_needed(const pd_kv_cache_manager_t *m, const pd_request_t *req,
                                    int32_t total_tokens)
{
    int32_t need = (total_tokens + m->block_size - 1) / m->block_size - req->num_blocks;
    return need > 0 ? need : 0;
}

void pd_kv_manager_cache_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens)
{
    if (!m->caching) {
        return;
    }
    int32_t full = num_tokens / m->block_size;
    if (full > req->num_blocks) {
        full = req->num_blocks;
    }
    if (full <= req->num_cached_blocks || !ensure_hashes(m, req, full)) {
        return;
    }
    for (int32_t b = req->num_cached_blocks; b < full; b++) {
        pd_block_pool_cache(m->pool, req->block_ids[b], req->block_hashes[b]);
    }
    req->num_cached_blocks = full;
}

bool pd_kv_manager_allocate_slots(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_new_tokens,
                                  const uint32_t *new_computed, int32_t n_computed,
                                  int32_t num_external_tokens, bool delay_cache)
{
    int32_t computed = req->num_computed_tokens + n_computed * m->block_size;
    int32_t total = computed + num_external_tokens + num_new_tokens;
    if (total > req->cap_tokens) {
        total = req->cap_tokens;
    }
    int32_t need = (total + m->block_size - 1) / m->block_size - req->num_blocks - n_computed;
    if (need < 0) {
        need = 0;
    }
    /* prefix hits sitting in the free queue stop being free once touched */
    int32_t evictable_hits = 0;
    for (int32_t i = 0; i < n_computed; i++) {
        evictable_hits += pd_block_pool_ref_count(m->pool, new_computed[i]) == 0;
    }
    uint32_t free_now = pd_block_pool_num_free(m->pool) + pd_block_pool_num_cached_free(m->pool);
    if ((uint32_t)(need + evictable_hits) > free_now) {
        return false;
    }
    if (!grow((void **)&req->block_ids, &req->cap_blocks, req->num_blocks + n_computed + need,
              sizeof(uint32_t))) {
        return false;
    }
    if (n_computed > 0) {
        pd_block_pool_touch(m->pool, new_computed, (uint32_t)n_computed);
        memcpy(req->block_ids + req->num_blocks, new_computed, (size_t)n_computed * sizeof(uint32_t));
        req->num_blocks += n_computed;
        req->num_cached_blocks = req->num_blocks; /* hits are cached by definition */
    }
    if (need > 0) {
        pd_block_pool_take(m->pool, (uint32_t)need, req->block_ids + req->num_blocks);
        req->num_blocks += need;
    }
    if (!delay_cache) {
        int32_t upto = computed + num_external_tokens + num_new_tokens;
        pd_kv_manager_cache_blocks(m, req, upto < req->num_tokens ? upto : req->num_tokens);
    }
    return true;
}

void pd_kv_manager_free(pd_kv_cache_manager_t *m, pd_request_t *req)
{
    if (req->num_blocks == 0) {
        return;
    }
    /* reverse order: the tail blocks go to the back of the free queue first... appended in
     * reverse means the request's last block is appended first and so is evicted first */
    for (int32_t i = 0, j = req->num_blocks - 1; i < j; i++, j--) {
        uint32_t t = req->block_ids[i];
        req->block_ids[i] = req->block_ids[j];
        req->block_ids[j] = t;
    }
    pd_block_pool_free(m->pool, req->block_ids, (uint32_t)req->num_blocks);
    req->num_blocks = 0;
    req->num_cached_blocks = 0;
}

double pd_kv_manager_usage(const pd_kv_cache_manager_t *m)
{
    return pd_block_pool_usage(m->pool);
}
