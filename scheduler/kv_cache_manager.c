/* scheduler/kv_cache_manager.c — per-request block lists over the block pool. */
#include "scheduler/kv_cache_manager.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler/kv_events.h"

pd_status_t pd_kv_manager_init(pd_kv_cache_manager_t *m, uint32_t num_blocks, int32_t block_size,
                               bool enable_caching, int32_t num_groups, const int32_t *windows)
{
    memset(m, 0, sizeof(*m));
    if (block_size < 1 || num_groups < 1 || num_groups > PD_KV_MANAGER_MAX_GROUPS) {
        pd_log_error("kv cache manager: block size %d, %d groups", block_size, num_groups);
        return PD_ERR_INVALID_ARG;
    }
    m->block_size = block_size;
    m->caching = enable_caching;
    m->num_groups = num_groups;
    for (int32_t g = 0; g < num_groups; g++) {
        m->window[g] = windows != NULL && windows[g] > 0 ? windows[g] : 0;
    }
    return pd_block_pool_create(num_blocks, enable_caching, &m->pool);
}

void pd_kv_manager_destroy(pd_kv_cache_manager_t *m)
{
    pd_block_pool_destroy(m->pool);
    m->pool = NULL;
    for (pd_kv_tier_load_t *l = m->tier_loads, *n; l != NULL; l = n) { /* the tier has stopped */
        n = l->next_load;
        free(l);
    }
    m->tier_loads = NULL;
    pd_key_map_free(&m->tier_keys);
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
        /* a cache_salt joins the first block's hash (as vLLM's extra keys), so every later one differs */
        bool salted = b == 0 && req->params.has_cache_salt;
        req->block_hashes[b] = pd_hash128_chain(parent, req->tokens + (size_t)b * m->block_size,
                                                (size_t)m->block_size, salted ? req->params.cache_salt : NULL,
                                                salted ? sizeof(req->params.cache_salt) : 0);
    }
    req->num_hashes = n_blocks;
    return true;
}

/* Prefix-cache key of logical block b in group g: group 0 uses the block hash itself, the
 * others chain the group index onto it (one pool, so keys must differ per group). */
static pd_hash128_t group_hash(const pd_request_t *req, int32_t b, int32_t g)
{
    return g == 0 ? req->block_hashes[b] : pd_hash128_chain(&req->block_hashes[b], NULL, 0, &g, sizeof(g));
}

/* First logical block group g needs once the next position to compute is pos (0 for full
 * attention): positions below pos − window + 1 are outside every later query's window. */
static int32_t first_needed(const pd_kv_cache_manager_t *m, int32_t g, int32_t pos)
{
    int32_t lo = pos - m->window[g] + 1;
    return m->window[g] > 0 && lo > 0 ? lo / m->block_size : 0;
}

int32_t pd_kv_manager_get_computed_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, uint32_t *blocks_out,
                                          int32_t max, bool count_stats, int32_t *num_tokens_out)
{
    *num_tokens_out = 0;
    if (!m->caching) {
        return 0;
    }
    int32_t G = m->num_groups, bs = m->block_size;
    int32_t full = (req->num_tokens - 1) / bs; /* leave the last token to compute */
    if (full > max) {
        full = max;
    }
    if (!ensure_hashes(m, req, full)) {
        return 0;
    }
    /* full groups: the longest prefix every one of them holds */
    int32_t n = full;
    for (int32_t g = 0; g < G; g++) {
        if (m->window[g] > 0) {
            continue;
        }
        for (int32_t b = 0; b < n; b++) {
            int64_t id = pd_block_pool_lookup(m->pool, group_hash(req, b, g));
            if (id < 0) {
                n = b;
                break;
            }
            blocks_out[b * G + g] = (uint32_t)id;
        }
    }
    /* sliding groups: the window of position n × bs. A missing block b caps the hit at b (every
     * longer hit down to it needs b too); repeat until every group holds its window. */
    for (bool again = true; again && n > 0;) {
        again = false;
        for (int32_t g = 0; g < G && !again; g++) {
            if (m->window[g] == 0) {
                continue;
            }
            int32_t lo = first_needed(m, g, n * bs);
            for (int32_t b = n - 1; b >= lo; b--) {
                int64_t id = pd_block_pool_lookup(m->pool, group_hash(req, b, g));
                if (id < 0) {
                    n = b;
                    again = true;
                    break;
                }
                blocks_out[b * G + g] = (uint32_t)id;
            }
            for (int32_t b = 0; b < lo && b < n; b++) {
                blocks_out[b * G + g] = 0;
            }
        }
    }
    if (count_stats) {
        pd_kv_manager_count_lookup(m, req, n * bs);
    }
    *num_tokens_out = n * bs;
    return n;
}

/* The pool's eviction hook: the block's pages go to the tier before they are overwritten. */
static void save_evicted(void *arg, uint32_t id, pd_hash128_t hash)
{
    const pd_kv_tier_t *t = ((pd_kv_cache_manager_t *)arg)->tier;
    t->save(t->ctx, hash, id);
}

pd_status_t pd_kv_manager_set_tier(pd_kv_cache_manager_t *m, const pd_kv_tier_t *tier)
{
    if (tier != NULL && (!m->caching || m->num_groups != 1)) {
        pd_log_error("kv offload: needs prefix caching and one KV cache group (this cache has %d%s)",
                     m->num_groups, m->caching ? "" : ", prefix caching off");
        return PD_ERR_UNSUPPORTED;
    }
    /* the keys of loads in flight: at most one per pool block */
    if (tier != NULL && m->tier_keys.slots == NULL &&
        pd_key_map_init(&m->tier_keys, pd_block_pool_num_blocks(m->pool)) != PD_OK) {
        pd_log_error("kv offload: cannot allocate the index of loads in flight");
        return PD_ERR_NO_MEMORY;
    }
    m->tier = tier;
    pd_block_pool_set_evict_hook(m->pool, tier != NULL ? save_evicted : NULL, m);
    return PD_OK;
}

/* A load of n blocks after n_hits held ones, its arrays in one allocation. */
static pd_kv_tier_load_t *load_new(int32_t n_hits, int32_t n, int32_t bs)
{
    size_t sz = sizeof(pd_kv_tier_load_t) + (size_t)n * (sizeof(pd_hash128_t) + sizeof(double)) +
                ((size_t)n_hits + 2 * (size_t)n + (size_t)n * (size_t)bs) * sizeof(uint32_t);
    pd_kv_tier_load_t *l = calloc(1, sz);
    if (l == NULL) {
        return NULL;
    }
    l->keys = (pd_hash128_t *)(l + 1);
    l->seconds = (double *)(l->keys + n);
    l->hits = (uint32_t *)(l->seconds + n);
    l->blocks = l->hits + n_hits;
    l->slots = l->blocks + n;
    l->tokens = (int32_t *)(l->slots + n);
    return l;
}

static bool tier_loading(const pd_kv_cache_manager_t *m, pd_hash128_t key)
{
    return pd_key_map_get(&m->tier_keys, key) != PD_KEY_MAP_NONE;
}

int32_t pd_kv_manager_promote(pd_kv_cache_manager_t *m, pd_request_t *req, const uint32_t *hits,
                              int32_t n_hits, int32_t max)
{
    const pd_kv_tier_t *t = m->tier;
    int32_t bs = m->block_size, full = (req->num_tokens - 1) / bs; /* the last token is computed */
    if (t == NULL || full > max) {
        full = t == NULL ? 0 : max;
    }
    if (n_hits >= full || !ensure_hashes(m, req, full)) {
        return 0;
    }
    if (tier_loading(m, req->block_hashes[n_hits])) {
        return PD_KV_PROMOTE_WAIT;
    }
    int32_t k = 0; /* up to a block the tier lacks, or one a load in flight brings */
    while (n_hits + k < full && t->contains(t->ctx, req->block_hashes[n_hits + k]) &&
           (k == 0 || !tier_loading(m, req->block_hashes[n_hits + k]))) {
        k++;
    }
    if (!req->tier_counted) { /* a request's first look in the tier (not the one after its load) */
        req->tier_counted = true;
        m->tier_queries += (uint64_t)(full - n_hits);
    }
    if (k == 0) {
        return 0;
    }
    /* the pool hit is held while the load runs (a take evicts from the front of the free queue, and
     * a hole in the hit would leave the loaded blocks unreachable), and the blocks the rest of the
     * prompt will need stay free */
    pd_block_pool_touch(m->pool, hits, (uint32_t)n_hits);
    int64_t room = (int64_t)pd_block_pool_num_free(m->pool) + pd_block_pool_num_cached_free(m->pool) -
                   ((int64_t)req->num_tokens - (int64_t)(n_hits + k) * bs + bs - 1) / bs;
    k = room < k ? (int32_t)(room > 0 ? room : 0) : k;
    pd_kv_tier_load_t *l = k > 0 ? load_new(n_hits, k, bs) : NULL;
    int32_t got = 0;
    for (; l != NULL && got < k; got++) {
        int32_t b = n_hits + got;
        /* a take may evict a cached block into the tier, which may evict this one from it */
        if (!t->contains(t->ctx, req->block_hashes[b]) ||
            pd_block_pool_take(m->pool, 1, &l->blocks[got]) != PD_OK) {
            break;
        }
        l->keys[got] = req->block_hashes[b];
        memcpy(l->tokens + (size_t)got * bs, req->tokens + (size_t)b * bs, (size_t)bs * sizeof(int32_t));
    }
    if (got == 0) {
        for (int32_t i = n_hits - 1; i >= 0; i--) {
            pd_block_pool_free(m->pool, &hits[i], 1);
        }
        free(l);
        return 0;
    }
    memcpy(l->hits, hits, (size_t)n_hits * sizeof(uint32_t));
    l->n_hits = n_hits;
    l->req = req;
    l->n = got;
    l->parent = n_hits > 0 ? req->block_hashes[n_hits - 1] : (pd_hash128_t){0, 0};
    for (int32_t i = 0; i < got; i++) { /* unique: a load stops before a key in flight */
        pd_key_map_insert(&m->tier_keys, l->keys[i], l->blocks[i]);
    }
    l->next_load = m->tier_loads;
    m->tier_loads = l;
    req->tier_load = l;
    t->load(t->ctx, l);
    return got;
}

void pd_kv_manager_poll_tier(pd_kv_cache_manager_t *m)
{
    const pd_kv_tier_t *t = m->tier;
    pd_kv_tier_load_t *l;
    while (t != NULL && (l = t->finished(t->ctx)) != NULL) {
        int32_t bs = m->block_size;
        for (int32_t i = 0; i < l->n_loaded; i++) {
            if (pd_block_pool_cache(m->pool, l->blocks[i], l->keys[i]) && m->events != NULL) {
                bool parent = i > 0 || l->n_hits > 0;
                pd_kv_event_stored(m->events, pd_kv_event_hash(l->keys[i]), parent,
                                   parent ? pd_kv_event_hash(i > 0 ? l->keys[i - 1] : l->parent) : 0,
                                   l->tokens + (size_t)i * bs);
            }
        }
        /* back to the free queue, the prompt's tail first (evicted first), the pool hit last */
        for (int32_t i = l->n - 1; i >= 0; i--) {
            pd_key_map_remove(&m->tier_keys, l->keys[i], l->blocks[i]);
            pd_block_pool_free(m->pool, &l->blocks[i], 1);
        }
        for (int32_t i = l->n_hits - 1; i >= 0; i--) {
            pd_block_pool_free(m->pool, &l->hits[i], 1);
        }
        m->tier_hits += (uint64_t)l->n_loaded;
        if (l->req != NULL) {
            l->req->tier_load = NULL;
            l->req->num_offload_tokens += l->n_loaded * bs;
        }
        pd_kv_tier_load_t **p = &m->tier_loads;
        while (*p != l) {
            p = &(*p)->next_load;
        }
        *p = l->next_load;
        free(l);
    }
}

void pd_kv_manager_tier_orphan(pd_request_t *req)
{
    if (req->tier_load != NULL) {
        req->tier_load->req = NULL;
        req->tier_load = NULL;
    }
}

void pd_kv_manager_count_lookup(pd_kv_cache_manager_t *m, const pd_request_t *req, int32_t hit_tokens)
{
    m->prefix_queries += (uint64_t)req->num_tokens;
    m->prefix_hits += (uint64_t)hit_tokens;
}

int32_t pd_kv_manager_held_blocks(const pd_kv_cache_manager_t *m, const pd_request_t *req)
{
    int32_t n = 0;
    for (int32_t i = 0; i < req->num_blocks * m->num_groups; i++) {
        n += req->block_ids[i] != 0;
    }
    return n;
}

void pd_kv_manager_cache_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens)
{
    if (!m->caching) {
        return;
    }
    int32_t full = num_tokens / m->block_size, G = m->num_groups;
    if (full > req->num_blocks) {
        full = req->num_blocks;
    }
    if (full <= req->num_cached_blocks || !ensure_hashes(m, req, full)) {
        return;
    }
    for (int32_t b = req->num_cached_blocks; b < full; b++) {
        for (int32_t g = 0; g < G; g++) {
            uint32_t id = req->block_ids[b * G + g];
            if (id != 0 && pd_block_pool_cache(m->pool, id, group_hash(req, b, g)) && g == 0 &&
                m->events != NULL) {
                /* events name group 0's keys: the block hashes a subscriber chains from tokens */
                pd_kv_event_stored(m->events, pd_kv_event_hash(req->block_hashes[b]), b > 0,
                                   b > 0 ? pd_kv_event_hash(req->block_hashes[b - 1]) : 0,
                                   req->tokens + (size_t)b * m->block_size);
            }
        }
    }
    req->num_cached_blocks = full;
}

/* Frees the sliding-window blocks before each group's first needed block when the next position
 * to compute is pos. Entries already freed are 0 and form a prefix, so the walk stops at one. */
static void remove_skipped_blocks(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t pos)
{
    int32_t G = m->num_groups;
    for (int32_t g = 0; g < G; g++) {
        int32_t lo = first_needed(m, g, pos);
        lo = lo < req->num_blocks ? lo : req->num_blocks;
        for (int32_t b = lo - 1; b >= 0 && req->block_ids[b * G + g] != 0; b--) {
            pd_block_pool_free(m->pool, &req->block_ids[b * G + g], 1);
            req->block_ids[b * G + g] = 0;
        }
    }
}

bool pd_kv_manager_allocate_slots(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_new_tokens,
                                  const uint32_t *new_computed, int32_t n_computed,
                                  int32_t num_external_tokens, bool delay_cache)
{
    int32_t G = m->num_groups, bs = m->block_size;
    int32_t computed = req->num_computed_tokens + n_computed * bs;
    int32_t total = computed + num_external_tokens + num_new_tokens;
    if (total > req->cap_tokens) {
        total = req->cap_tokens;
    }
    int32_t nb0 = req->num_blocks;
    int32_t add = (total + bs - 1) / bs - nb0 - n_computed; /* new logical blocks */
    if (add < 0) {
        add = 0;
    }
    /* the next position this or a later step computes (a loaded last token may be recomputed) */
    int32_t pos = computed + num_external_tokens - (num_external_tokens > 0);
    int32_t lo[PD_KV_MANAGER_MAX_GROUPS];
    for (int32_t g = 0; g < G; g++) {
        lo[g] = first_needed(m, g, pos);
    }
    remove_skipped_blocks(m, req, pos);
    /* prefix hits sitting in the free queue stop being free once touched */
    int32_t need = 0, evictable_hits = 0;
    for (int32_t i = 0; i < n_computed * G; i++) {
        bool wanted = new_computed[i] != 0 && nb0 + i / G >= lo[i % G];
        evictable_hits += wanted && pd_block_pool_ref_count(m->pool, new_computed[i]) == 0;
    }
    for (int32_t b = nb0 + n_computed; b < nb0 + n_computed + add; b++) {
        for (int32_t g = 0; g < G; g++) {
            need += b >= lo[g];
        }
    }
    uint32_t free_now = pd_block_pool_num_free(m->pool) + pd_block_pool_num_cached_free(m->pool);
    if ((uint32_t)(need + evictable_hits) > free_now) {
        return false;
    }
    if (!grow((void **)&req->block_ids, &req->cap_blocks, (nb0 + n_computed + add) * G, sizeof(uint32_t))) {
        return false;
    }
    uint32_t *ids = req->block_ids;
    for (int32_t i = 0; i < n_computed * G; i++) {
        bool wanted = new_computed[i] != 0 && nb0 + i / G >= lo[i % G];
        ids[nb0 * G + i] = wanted ? new_computed[i] : 0;
        if (wanted) {
            pd_block_pool_touch(m->pool, &new_computed[i], 1);
        }
    }
    if (n_computed > 0) {
        req->num_blocks += n_computed;
        req->num_cached_blocks = req->num_blocks; /* hits are cached by definition */
    }
    int32_t base = req->num_blocks * G;
    if (need == add * G) { /* nothing skipped: one run */
        pd_block_pool_take(m->pool, (uint32_t)need, ids + base);
    } else {
        for (int32_t i = 0; i < add * G; i++) {
            ids[base + i] = 0;
            if (req->num_blocks + i / G >= lo[i % G]) {
                pd_block_pool_take(m->pool, 1, &ids[base + i]);
            }
        }
    }
    req->num_blocks += add;
    if (!delay_cache) {
        int32_t upto = computed + num_external_tokens + num_new_tokens;
        pd_kv_manager_cache_blocks(m, req, upto < req->num_tokens ? upto : req->num_tokens);
    }
    return true;
}

void pd_kv_manager_trim(pd_kv_cache_manager_t *m, pd_request_t *req, int32_t num_tokens)
{
    int32_t keep = (num_tokens + m->block_size - 1) / m->block_size, G = m->num_groups;
    if (keep < req->num_cached_blocks) {
        keep = req->num_cached_blocks;
    }
    for (int32_t b = req->num_blocks - 1; b >= keep; b--) { /* the last block is freed first */
        for (int32_t g = 0; g < G; g++) {
            if (req->block_ids[b * G + g] != 0) {
                pd_block_pool_free(m->pool, &req->block_ids[b * G + g], 1);
            }
        }
        req->num_blocks = b;
        req->blocks_trimmed = true;
    }
}

void pd_kv_manager_free(pd_kv_cache_manager_t *m, pd_request_t *req)
{
    if (req->num_blocks == 0) {
        return;
    }
    /* reverse order: the tail blocks go to the back of the free queue first... appended in
     * reverse means the request's last block is appended first and so is evicted first; the null
     * entries of sliding groups are dropped */
    int32_t n = req->num_blocks * m->num_groups;
    for (int32_t i = 0, j = n - 1; i < j; i++, j--) {
        uint32_t t = req->block_ids[i];
        req->block_ids[i] = req->block_ids[j];
        req->block_ids[j] = t;
    }
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        if (req->block_ids[i] != 0) {
            req->block_ids[k++] = req->block_ids[i];
        }
    }
    if (k > 0) {
        pd_block_pool_free(m->pool, req->block_ids, (uint32_t)k);
    }
    req->num_blocks = 0;
    req->num_cached_blocks = 0;
}

double pd_kv_manager_usage(const pd_kv_cache_manager_t *m)
{
    return pd_block_pool_usage(m->pool);
}
