/* tests/unit/test_scheduler.c — block pool, prefix cache, KV cache specs/config, KV cache
 * manager, and the scheduler (token budget, chunked prefill, preemption, aborts, and the connector
 * hooks driven by a fake connector). No model runs here: "sampled" tokens come from the test. */
#include "test_util.h" /* first: it defines _GNU_SOURCE */

#include <check.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rng.h"
#include "scheduler/block_pool.h"
#include "scheduler/kv_cache_manager.h"
#include "scheduler/kv_cache_spec.h"
#include "scheduler/prefill_cost.h"
#include "scheduler/scheduler.h"

/* ------------------------------------------------------------------ block pool */

START_TEST(test_block_pool_basic)
{
    pd_block_pool_t *p = NULL;
    ck_assert_int_eq(pd_block_pool_create(10, true, &p), PD_OK);
    ck_assert_uint_eq(pd_block_pool_num_free(p), 9);
    uint32_t ids[9];
    ck_assert_int_eq(pd_block_pool_take(p, 3, ids), PD_OK);
    ck_assert_uint_eq(ids[0], 1);
    ck_assert_uint_eq(ids[2], 3);
    ck_assert_uint_eq(pd_block_pool_num_used(p), 3);
    ck_assert_int_eq(pd_block_pool_take(p, 7, ids + 3), PD_ERR_NO_SPACE); /* only 6 left: nothing taken */
    ck_assert_uint_eq(pd_block_pool_num_free(p), 6);
    pd_hash128_t h = {11, 22};
    pd_block_pool_cache(p, 2, h);
    ck_assert_int_eq(pd_block_pool_lookup(p, h), 2);
    uint32_t rev[3] = {3, 2, 1};
    ck_assert_int_eq(pd_block_pool_free(p, rev, 3), PD_OK);
    ck_assert_uint_eq(pd_block_pool_num_free(p) + pd_block_pool_num_cached_free(p), 9);
    ck_assert_uint_eq(pd_block_pool_num_cached_free(p), 1);
    ck_assert_int_eq(pd_block_pool_lookup(p, h), 2); /* free but still cached */
    /* a prefix hit revives the cached free block */
    uint32_t two = 2;
    ck_assert_int_eq(pd_block_pool_touch(p, &two, 1), PD_OK);
    ck_assert_int_eq(pd_block_pool_ref_count(p, 2), 1);
    ck_assert_uint_eq(pd_block_pool_num_cached_free(p), 0);
    ck_assert_int_eq(pd_block_pool_free(p, &two, 1), PD_OK);
    /* taking every block reuses block 2 last-ish and evicts its hash when it is popped */
    ck_assert_int_eq(pd_block_pool_take(p, 9, ids), PD_OK);
    ck_assert_int_eq(pd_block_pool_lookup(p, h), -1);
    ck_assert_uint_eq(pd_block_pool_num_evictions(p), 1);
    ck_assert_int_eq(pd_block_pool_check(p), PD_OK);
    /* bad ids are refused and change nothing */
    uint32_t bad[2] = {4, 0};
    ck_assert_int_eq(pd_block_pool_free(p, bad, 2), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(pd_block_pool_ref_count(p, 4), 1);
    uint32_t big = 10;
    ck_assert_int_eq(pd_block_pool_touch(p, &big, 1), PD_ERR_OUT_OF_RANGE);
    ck_assert_int_eq(pd_block_pool_free(p, ids, 9), PD_OK);
    ck_assert_int_eq(pd_block_pool_free(p, ids, 1), PD_ERR_OUT_OF_RANGE); /* double free */
    ck_assert_uint_eq(pd_block_pool_num_free(p) + pd_block_pool_num_cached_free(p), 9);
    pd_block_pool_destroy(p);
}
END_TEST

/* The pool against a plain model: ref counts, a free list (LRU order) and a hash map. */
START_TEST(test_block_pool_random_vs_model)
{
    enum { N = 64 };
    pd_block_pool_t *p = NULL;
    ck_assert_int_eq(pd_block_pool_create(N, true, &p), PD_OK);
    int32_t ref[N] = {0};
    int64_t hash_of[N]; /* model: content hash of a block, -1 none */
    uint32_t order[N];  /* model free queue */
    int nq = 0;
    for (int i = 1; i < N; i++) {
        order[nq++] = (uint32_t)i;
        hash_of[i] = -1;
    }
    pd_rng_t r;
    pd_rng_seed(&r, 77);
    for (int op = 0; op < 30000; op++) {
        int kind = (int)pd_rng_below(&r, 4);
        if (kind == 0) { /* take k */
            uint32_t k = (uint32_t)pd_rng_below(&r, 5), ids[5];
            pd_status_t st = pd_block_pool_take(p, k, ids);
            if ((int)k > nq) {
                ck_assert_int_eq(st, PD_ERR_NO_SPACE);
                continue;
            }
            ck_assert_int_eq(st, PD_OK);
            for (uint32_t i = 0; i < k; i++) {
                ck_assert_uint_eq(ids[i], order[i]); /* LRU: front of the queue */
                ref[ids[i]] = 1;
                hash_of[ids[i]] = -1;
            }
            memmove(order, order + k, (size_t)(nq - (int)k) * sizeof(uint32_t));
            nq -= (int)k;
        } else if (kind == 1) { /* free one in-use block */
            uint32_t id = 1 + (uint32_t)pd_rng_below(&r, N - 1);
            if (ref[id] == 0) {
                ck_assert_int_eq(pd_block_pool_free(p, &id, 1), PD_ERR_OUT_OF_RANGE);
                continue;
            }
            ck_assert_int_eq(pd_block_pool_free(p, &id, 1), PD_OK);
            if (--ref[id] == 0) {
                order[nq++] = id;
            }
        } else if (kind == 2) { /* cache a block under one of 40 contents */
            uint32_t id = 1 + (uint32_t)pd_rng_below(&r, N - 1);
            int64_t content = (int64_t)pd_rng_below(&r, 40);
            pd_hash128_t h = {(uint64_t)content, 99};
            bool taken = false;
            for (int i = 1; i < N; i++) {
                taken |= hash_of[i] == content;
            }
            pd_block_pool_cache(p, id, h);
            if (hash_of[id] < 0 && !taken) {
                hash_of[id] = content;
            }
        } else { /* prefix hit: look a content up and touch it */
            int64_t content = (int64_t)pd_rng_below(&r, 40);
            pd_hash128_t h = {(uint64_t)content, 99};
            int64_t want = -1;
            for (int i = 1; i < N; i++) {
                if (hash_of[i] == content) {
                    want = i;
                }
            }
            int64_t got = pd_block_pool_lookup(p, h);
            ck_assert_int_eq(got, want);
            if (got > 0) {
                uint32_t id = (uint32_t)got;
                ck_assert_int_eq(pd_block_pool_touch(p, &id, 1), PD_OK);
                if (ref[id]++ == 0) {
                    int j = 0;
                    while (order[j] != id) {
                        j++;
                    }
                    memmove(order + j, order + j + 1, (size_t)(nq - j - 1) * sizeof(uint32_t));
                    nq--;
                }
            }
        }
        int cached_free = 0;
        for (int i = 0; i < nq; i++) {
            cached_free += hash_of[order[i]] >= 0;
        }
        ck_assert_uint_eq(pd_block_pool_num_free(p) + pd_block_pool_num_cached_free(p), (uint32_t)nq);
        ck_assert_uint_eq(pd_block_pool_num_cached_free(p), (uint32_t)cached_free);
        if (op % 1000 == 0) {
            ck_assert_int_eq(pd_block_pool_check(p), PD_OK);
        }
    }
    for (uint32_t id = 1; id < N; id++) {
        while (ref[id] > 0) {
            ck_assert_int_eq(pd_block_pool_free(p, &id, 1), PD_OK);
            ref[id]--;
        }
    }
    ck_assert_uint_eq(pd_block_pool_num_free(p) + pd_block_pool_num_cached_free(p), N - 1);
    ck_assert_int_eq(pd_block_pool_check(p), PD_OK);
    pd_block_pool_destroy(p);
}
END_TEST

/* ------------------------------------------------------------------ KV cache manager */

static pd_request_t *make_req(const char *id, const int32_t *toks, int32_t n, int32_t max_tokens)
{
    pd_request_params_t params;
    memset(&params, 0, sizeof(params));
    params.max_tokens = max_tokens;
    params.sampling.top_p = 1.0f;
    pd_request_t *r = NULL;
    ck_assert_int_eq(pd_request_create(id, toks, n, &params, 4096, &r), PD_OK);
    return r;
}

START_TEST(test_prefix_hit_after_repeat)
{
    /* Two requests with the same 3-block prompt: the second reuses the 2 cacheable full blocks
     * (the last token is always recomputed) and allocates only its tail. */
    enum { BLOCK = 4, NUM_BLOCKS = 16 };
    pd_kv_cache_manager_t m;
    ck_assert_int_eq(pd_kv_manager_init(&m, NUM_BLOCKS, BLOCK, true, 1, NULL), PD_OK);
    int32_t prompt[12] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    pd_request_t *a = make_req("a", prompt, 12, 4);
    uint32_t hits[8];
    int32_t hit_tokens = -1;
    ck_assert_int_eq(pd_kv_manager_get_computed_blocks(&m, a, hits, 8, true, &hit_tokens), 0);
    ck_assert(pd_kv_manager_allocate_slots(&m, a, 12, NULL, 0, 0, false));
    ck_assert_int_eq(a->num_blocks, 3);
    uint32_t a_blocks[3];
    memcpy(a_blocks, a->block_ids, sizeof(a_blocks));
    pd_kv_manager_free(&m, a);
    pd_request_t *b = make_req("b", prompt, 12, 4);
    int32_t n = pd_kv_manager_get_computed_blocks(&m, b, hits, 8, true, &hit_tokens);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(hit_tokens, 2 * BLOCK);
    ck_assert_uint_eq(hits[0], a_blocks[0]);
    ck_assert_uint_eq(hits[1], a_blocks[1]);
    b->num_computed_tokens = 0;
    ck_assert(pd_kv_manager_allocate_slots(&m, b, 12 - hit_tokens, hits, n, 0, false));
    ck_assert_int_eq(b->num_blocks, 3);
    ck_assert_uint_eq(b->block_ids[0], a_blocks[0]);
    /* a different third block: prefix shared, tail not */
    int32_t other[12] = {5, 6, 7, 8, 9, 10, 11, 12, 99, 98, 97, 96};
    pd_request_t *c = make_req("c", other, 12, 4);
    ck_assert_int_eq(pd_kv_manager_get_computed_blocks(&m, c, hits, 8, true, &hit_tokens), 2);
    int32_t first[12] = {1, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}; /* differs in block 0: no hit */
    pd_request_t *d = make_req("d", first, 12, 4);
    ck_assert_int_eq(pd_kv_manager_get_computed_blocks(&m, d, hits, 8, true, &hit_tokens), 0);
    pd_kv_manager_free(&m, b);
    ck_assert_uint_eq(pd_block_pool_num_free(m.pool) + pd_block_pool_num_cached_free(m.pool), NUM_BLOCKS - 1);
    ck_assert_uint_eq(m.prefix_hits, 2 * 2 * BLOCK); /* b and c hit 8 tokens each */
    pd_request_free(a), pd_request_free(b), pd_request_free(c), pd_request_free(d);
    pd_kv_manager_destroy(&m);
}
END_TEST

/* ------------------------------------------------------------------ KV specs and config */

static pd_kv_spec_t full_spec(int32_t heads, int32_t hd, int32_t bytes, int32_t bs)
{
    pd_kv_spec_t s = {PD_KV_FULL, bs, heads, hd, bytes, 0, -1};
    return s;
}

START_TEST(test_kv_config_llama31_8b)
{
    /* 32 layers, 8 kv heads, head 128, bf16, block 16: 64 KiB per layer per block, 2 MiB per block
     * over all layers; "Available KV cache memory: 4.93 GiB" ⇒ "KV cache size: 40,416 tokens". */
    pd_kv_spec_t specs[32];
    for (int i = 0; i < 32; i++) {
        specs[i] = full_spec(8, 128, 2, 16);
    }
    ck_assert_uint_eq(pd_kv_spec_page_bytes(&specs[0]), 64 * 1024);
    size_t mib2 = 2u << 20;
    size_t probes[] = {2526 * mib2, 2526 * mib2 + 1, 2526 * mib2 + mib2 / 2, 2527 * mib2 - 1};
    for (int i = 0; i < 4; i++) {
        pd_kv_cache_config_t c;
        ck_assert_int_eq(pd_kv_cache_config_compute(specs, 32, probes[i], 8192, 0, &c), PD_OK);
        ck_assert_uint_eq(c.num_blocks, 2526);
        ck_assert_int_eq((int64_t)c.num_blocks * c.block_size, 40416);
        ck_assert_int_eq(c.num_tensors, 32);
        ck_assert_uint_eq(c.region_bytes, (size_t)2526 * mib2);
        ck_assert_uint_eq(c.tensors[31].offset, (size_t)31 * 2526 * 64 * 1024);
        ck_assert_int_eq(c.num_groups, 1);
        ck_assert_int_eq(c.groups[0].num_layers, 32);
    }
    pd_kv_cache_config_t c;
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 32, 2527 * mib2, 8192, 0, &c), PD_OK);
    ck_assert_uint_eq(c.num_blocks, 2527);
    /* a 128k-token context does not fit in 2526 blocks: refused, not silently truncated */
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 32, 2526 * mib2, 131072, 0, &c), PD_ERR_NO_SPACE);
}
END_TEST

START_TEST(test_kv_config_kinds_and_sharing)
{
    /* layer 0 full fp16, layer 1 full, layer 2 MLA (one vector), layer 3 shares layer 0 */
    pd_kv_spec_t specs[4] = {
        {PD_KV_FULL, 16, 4, 64, 2, 0, -1},
        {PD_KV_FULL, 16, 4, 64, 2, 0, -1},
        {PD_KV_MLA, 16, 1, 576, 2, 0, -1},
        {PD_KV_SHARED, 16, 4, 64, 2, 0, 0},
    };
    ck_assert_uint_eq(pd_kv_spec_page_bytes(&specs[0]), 2 * 16 * 4 * 64 * 2);
    ck_assert_uint_eq(pd_kv_spec_page_bytes(&specs[2]), 1 * 16 * 1 * 576 * 2);
    ck_assert_uint_eq(pd_kv_spec_page_bytes(&specs[3]), 0);
    size_t per_block = 2 * 16384 + 18432;    /* the shared layer costs nothing */
    size_t avail = per_block * 1000 + 12345; /* an odd size: rounds down */
    pd_kv_cache_config_t c;
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 4, avail, 4096, 0, &c), PD_OK);
    ck_assert_uint_eq(c.num_blocks, 1000);
    ck_assert_int_eq(c.num_tensors, 3);
    ck_assert_int_eq(c.layer_tensor[3], c.layer_tensor[0]);
    ck_assert_int_eq(c.tensors[0].num_shared, 2);
    ck_assert_int_eq(c.tensors[0].shared_by[0], 0);
    ck_assert_int_eq(c.tensors[0].shared_by[1], 3);
    ck_assert_uint_eq(c.region_bytes, per_block * 1000);
    ck_assert_int_eq(c.num_groups, 1); /* one kind of attention: one block table */
    ck_assert_int_eq(c.groups[0].num_layers, 3);
    ck_assert_int_eq(c.layer_group[3], 0);
    /* a sliding-window layer beside layers of another page size: hybrid groups need one page size */
    specs[1].kind = PD_KV_SLIDING_WINDOW, specs[1].sliding_window = 128;
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 4, avail, 4096, 0, &c), PD_ERR_INVALID_ARG);
    specs[1].kind = PD_KV_FULL, specs[1].sliding_window = 0;
    /* too little memory for one max-length request */
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 4, per_block * 10, 4096, 0, &c), PD_ERR_NO_SPACE);
    /* sharing a layer that itself shares, or a missing layer */
    pd_kv_spec_t bad[3] = {
        full_spec(4, 64, 2, 16), {PD_KV_SHARED, 16, 4, 64, 2, 0, 2}, {PD_KV_SHARED, 16, 4, 64, 2, 0, 0}};
    ck_assert_int_eq(pd_kv_cache_config_compute(bad, 3, avail, 64, 0, &c), PD_ERR_INVALID_ARG);
    bad[1].shared_with = 7;
    ck_assert_int_eq(pd_kv_cache_config_compute(bad, 3, avail, 64, 0, &c), PD_ERR_INVALID_ARG);
    /* block sizes must agree */
    pd_kv_spec_t mixed[2] = {full_spec(4, 64, 2, 16), full_spec(4, 64, 2, 32)};
    ck_assert_int_eq(pd_kv_cache_config_compute(mixed, 2, avail, 64, 0, &c), PD_ERR_INVALID_ARG);
}
END_TEST

START_TEST(test_kv_config_hybrid_groups)
{
    /* Gemma-3-1B: 26 layers, every 6th global (5, 11, 17, 23), the rest a 512-token window; 1 kv
     * head of 256, bf16, block 16 (16 KiB pages). vLLM's hybrid allocator: groups of 4 layers (the
     * global count) over 4 shared tensors: 6 sliding groups (the last padded) and 1 full group. */
    pd_kv_spec_t specs[26];
    for (int l = 0; l < 26; l++) {
        specs[l] = full_spec(1, 256, 2, 16);
        if ((l + 1) % 6 != 0) {
            specs[l].kind = PD_KV_SLIDING_WINDOW, specs[l].sliding_window = 512;
        }
    }
    size_t page = 2 * 16 * 256 * 2;
    pd_kv_cache_config_t *c = malloc(sizeof(*c));
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 26, 1000 * 4 * page + 77, 4096, 256, c), PD_OK);
    ck_assert_uint_eq(c->num_blocks, 1000); /* a block id costs 4 pages, not 26 */
    ck_assert_int_eq(c->num_tensors, 4);
    ck_assert_uint_eq(c->region_bytes, 1000 * 4 * page);
    ck_assert_int_eq(c->num_groups, 7);
    for (int g = 0; g < 6; g++) {
        ck_assert_int_eq(c->groups[g].kind, PD_KV_SLIDING_WINDOW);
        ck_assert_int_eq(c->groups[g].num_layers, g < 5 ? 4 : 2);
    }
    ck_assert_int_eq(c->groups[6].kind, PD_KV_FULL);
    ck_assert_int_eq(c->groups[6].num_layers, 4);
    ck_assert_int_eq(c->groups[6].layers[2], 17);
    for (int l = 0; l < 26; l++) { /* each layer is in its group's list at its tensor's index */
        const pd_kv_group_t *g = &c->groups[c->layer_group[l]];
        ck_assert_int_eq(g->layers[c->layer_tensor[l]], l);
    }
    ck_assert_int_eq(c->tensors[0].num_shared, 7);
    ck_assert_int_eq(c->tensors[3].num_shared, 6); /* the padded group has no 4th layer */
    char layout[128];
    pd_kv_cache_config_layout(c, layout, sizeof(layout));
    ck_assert_str_eq(layout, "g4:swa512x6,fullx1");
    /* one request of 4096 tokens: 256 blocks in the full group, 512/16 + 1 (+ the chunk) in each
     * sliding group; never more than the full count */
    ck_assert_int_eq(pd_kv_cache_config_blocks_per_request(c, 4096, 256), 256 + 6 * (32 + 16 + 1));
    ck_assert_int_eq(pd_kv_cache_config_blocks_per_request(c, 100, 100), 7 * 7);
    /* Mistral: every layer sliding: one group, one tensor per layer */
    for (int l = 0; l < 26; l++) {
        specs[l].kind = PD_KV_SLIDING_WINDOW, specs[l].sliding_window = 4096;
    }
    ck_assert_int_eq(pd_kv_cache_config_compute(specs, 26, 1000 * 26 * page, 4096, 0, c), PD_OK);
    ck_assert_int_eq(c->num_groups, 1);
    ck_assert_int_eq(c->groups[0].kind, PD_KV_SLIDING_WINDOW);
    ck_assert_int_eq(c->num_tensors, 26);
    ck_assert_uint_eq(c->num_blocks, 1000);
    free(c);
}
END_TEST

START_TEST(test_prefix_hit_sliding_group)
{
    /* Two groups, block 4: group 0 a 4-token window, group 1 full. A repeat of a 12-token prompt
     * hits blocks 0 and 1; the window of position 8 starts at 5, so group 0 needs only block 1
     * (its entry for block 0 is null and never adopted). */
    enum { BLOCK = 4, NUM_BLOCKS = 32 };
    int32_t windows[2] = {4, 0};
    pd_kv_cache_manager_t m;
    ck_assert_int_eq(pd_kv_manager_init(&m, NUM_BLOCKS, BLOCK, true, 2, windows), PD_OK);
    int32_t prompt[12] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    pd_request_t *a = make_req("a", prompt, 12, 4);
    ck_assert(pd_kv_manager_allocate_slots(&m, a, 12, NULL, 0, 0, false));
    ck_assert_int_eq(a->num_blocks, 3);
    ck_assert_int_eq(pd_kv_manager_held_blocks(&m, a), 6);
    /* decoding from position 12: the window [9, 12] needs block 2 of group 0 only */
    a->num_computed_tokens = 12;
    ck_assert_int_eq(pd_request_append_token(a, 77), PD_OK);
    ck_assert(pd_kv_manager_allocate_slots(&m, a, 1, NULL, 0, 0, false));
    ck_assert_int_eq(a->num_blocks, 4);
    ck_assert_uint_eq(a->block_ids[0 * 2 + 0], 0);
    ck_assert_uint_eq(a->block_ids[1 * 2 + 0], 0);
    ck_assert_uint_ne(a->block_ids[2 * 2 + 0], 0);
    ck_assert_uint_ne(a->block_ids[0 * 2 + 1], 0);
    ck_assert_int_eq(pd_kv_manager_held_blocks(&m, a), 4 + 2);
    pd_kv_manager_free(&m, a);
    ck_assert_uint_eq(pd_block_pool_num_free(m.pool) + pd_block_pool_num_cached_free(m.pool), NUM_BLOCKS - 1);
    pd_request_t *b = make_req("b", prompt, 12, 4);
    uint32_t hits[16];
    int32_t hit_tokens = -1;
    int32_t n = pd_kv_manager_get_computed_blocks(&m, b, hits, 8, true, &hit_tokens);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(hit_tokens, 8);
    ck_assert_uint_eq(hits[0 * 2 + 0], 0); /* outside the window of position 8 */
    ck_assert_uint_ne(hits[1 * 2 + 0], 0);
    ck_assert_uint_ne(hits[0 * 2 + 1], 0);
    ck_assert_uint_ne(hits[1 * 2 + 1], 0);
    ck_assert(pd_kv_manager_allocate_slots(&m, b, 12 - hit_tokens, hits, n, 0, false));
    ck_assert_uint_eq(b->block_ids[0], 0);
    ck_assert_uint_eq(b->block_ids[2], hits[2]);
    ck_assert_int_eq(pd_kv_manager_held_blocks(&m, b), 2 + 3);
    pd_kv_manager_free(&m, b);
    /* a prompt sharing blocks 0 and 1 only: group 0's window block (1) was freed by a's decode but
     * stays cached, so the hit is the shared prefix */
    int32_t other[12] = {5, 6, 7, 8, 9, 10, 11, 12, 99, 98, 97, 96};
    pd_request_t *c = make_req("c", other, 12, 4);
    n = pd_kv_manager_get_computed_blocks(&m, c, hits, 8, true, &hit_tokens);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(pd_block_pool_check(m.pool), PD_OK);
    ck_assert_uint_eq(pd_block_pool_num_free(m.pool) + pd_block_pool_num_cached_free(m.pool), NUM_BLOCKS - 1);
    pd_request_free(a), pd_request_free(b), pd_request_free(c);
    pd_kv_manager_destroy(&m);
}
END_TEST

/* ------------------------------------------------------------------ a fake connector */

typedef struct fake_conn {
    pd_connector_t base;
    int matched_calls, finished_calls, alloc_calls;
    char recving[8][PD_REQ_ID_MAX];
    const char *recv_ptrs[8];
    int num_recving;
    char sending[8][PD_REQ_ID_MAX];
    const char *send_ptrs[8];
    int num_sending;
    uint32_t bad_blocks[8];
    int num_bad;
    int32_t external_tokens; /* what "remote-" requests get from the peer */
    bool no_wait;            /* load_may_wait answers false */
    bool refuse;             /* update_state_after_alloc answers PD_ERR_NO_MEMORY */
} fake_conn_t;

static pd_status_t fake_matched(pd_connector_t *c, const pd_request_t *r, int32_t local, int32_t *ext,
                                bool *async)
{
    fake_conn_t *f = (fake_conn_t *)c;
    f->matched_calls++;
    *ext = 0;
    *async = false;
    if (strncmp(r->id, "remote-", 7) == 0 && r->num_preemptions == 0) {
        *ext = r->num_prompt_tokens - local;
        *async = true;
    }
    return PD_OK;
}

static pd_status_t fake_after_alloc(pd_connector_t *c, pd_request_t *r, const uint32_t *ids, int32_t n,
                                    int32_t ext)
{
    fake_conn_t *f = (fake_conn_t *)c;
    f->alloc_calls++;
    if (f->refuse) {
        return PD_ERR_NO_MEMORY;
    }
    if (strncmp(r->id, "remote-", 7) == 0) {
        ck_assert_int_le(ext, r->num_prompt_tokens); /* less after a prefix hit */
        ck_assert_int_ge(n * 4, ext);                /* blocks for every external token (block size 4) */
        f->external_tokens = ext;
    }
    return PD_OK;
}

static void *fake_meta(pd_connector_t *c, const struct pd_scheduler_output *o)
{
    return c;
}

static bool fake_finished(pd_connector_t *c, pd_request_t *r, const uint32_t *ids, int32_t n, void **params)
{
    fake_conn_t *f = (fake_conn_t *)c;
    f->finished_calls++;
    *params = json_pack("{s:s}", "remote_engine_id", "fake");
    /* hold the blocks of "hold-" requests (a peer will read them) and of aborted remote loads */
    return strncmp(r->id, "hold-", 5) == 0 ||
           (strncmp(r->id, "remote-", 7) == 0 && r->state == PD_REQ_FINISHED_ABORTED);
}

/* "remote-" loads may wait for another's unless the test turned it off (push). */
static bool fake_may_wait(pd_connector_t *c, const pd_request_t *r)
{
    return !((fake_conn_t *)c)->no_wait;
}

static const pd_connector_ops_t fake_ops = {
    .name = "fake",
    .get_num_new_matched_tokens = fake_matched,
    .update_state_after_alloc = fake_after_alloc,
    .load_may_wait = fake_may_wait,
    .build_connector_meta = fake_meta,
    .request_finished = fake_finished,
};

/* ------------------------------------------------------------------ scheduler driving */

typedef struct driver {
    pd_scheduler_t *s;
    fake_conn_t *conn;
    int32_t budget, max_seqs;
    int finished;
    int steps;
} driver_t;

static pd_scheduler_config_t sched_cfg(int32_t seqs, int32_t budget, uint32_t blocks)
{
    pd_scheduler_config_t c;
    memset(&c, 0, sizeof(c));
    c.max_num_seqs = seqs;
    c.max_num_batched_tokens = budget;
    c.max_model_len = 1024;
    c.block_size = 4;
    c.num_blocks = blocks;
    c.enable_prefix_caching = true;
    c.enable_chunked_prefill = true;
    c.eos_token_ids[0] = 0;
    c.num_eos = 1;
    c.load_share_wait = 1.0; /* the engine's default */
    return c;
}

/* One step; the token "sampled" for a request is 1000 + its number of tokens (never EOS). */
static const pd_scheduler_output_t *drive_step(driver_t *d, pd_scheduler_update_result_t *res)
{
    const pd_scheduler_output_t *o = pd_scheduler_schedule(d->s);
    ck_assert_int_le(o->total_tokens, d->budget);
    ck_assert_int_le(o->num_items, d->max_seqs);
    int32_t sampled[64];
    int32_t sum = 0;
    for (int32_t i = 0; i < o->num_items; i++) {
        pd_request_t *r = o->items[i].req;
        ck_assert_int_gt(o->items[i].num_new_tokens, 0);
        sum += o->items[i].num_new_tokens;
        /* every scheduled token has a block */
        ck_assert_int_ge(r->num_blocks * 4, r->num_computed_tokens + o->items[i].num_new_tokens);
        sampled[i] = 1000 + r->num_tokens;
    }
    ck_assert_int_eq(sum, o->total_tokens);
    pd_model_output_t mo;
    memset(&mo, 0, sizeof(mo));
    mo.sampled = sampled;
    if (d->conn != NULL) {
        mo.finished.recving = d->conn->recv_ptrs;
        mo.finished.num_recving = d->conn->num_recving;
        mo.finished.sending = d->conn->send_ptrs;
        mo.finished.num_sending = d->conn->num_sending;
        mo.load_error_blocks = d->conn->bad_blocks;
        mo.num_load_error_blocks = d->conn->num_bad;
    }
    pd_scheduler_update(d->s, o, &mo, res);
    if (d->conn != NULL) {
        d->conn->num_recving = d->conn->num_sending = d->conn->num_bad = 0;
    }
    d->finished += res->num_finished;
    d->steps++;
    return o;
}

static void add(pd_scheduler_t *s, const char *id, int32_t prompt_len, int32_t max_tokens, int32_t salt)
{
    int32_t toks[1024];
    for (int32_t i = 0; i < prompt_len; i++) {
        toks[i] = 1 + (i * 31 + salt * 7) % 500;
    }
    ck_assert_int_eq(pd_scheduler_add_request(s, make_req(id, toks, prompt_len, max_tokens)), PD_OK);
}

static void assert_pool_clean(pd_scheduler_t *s)
{
    pd_block_pool_t *p = pd_scheduler_kv(s)->pool;
    ck_assert_int_eq(pd_block_pool_check(p), PD_OK);
    ck_assert_uint_eq(pd_block_pool_num_free(p) + pd_block_pool_num_cached_free(p),
                      pd_block_pool_num_blocks(p) - 1);
}

/* Steps until idle (bounded), then checks the pool is clean and destroys the scheduler. */
static void drain_and_destroy(driver_t *d)
{
    pd_scheduler_update_result_t res;
    while (!pd_scheduler_idle(d->s)) {
        drive_step(d, &res);
        ck_assert_int_lt(d->steps, 100);
    }
    pd_scheduler_schedule(d->s);
    assert_pool_clean(d->s);
    pd_scheduler_destroy(d->s);
}

START_TEST(test_budget_and_max_seqs_random)
{
    driver_t d = {NULL, NULL, 48, 6, 0, 0};
    pd_scheduler_config_t c = sched_cfg(6, 48, 200);
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    pd_rng_t r;
    pd_rng_seed(&r, 5);
    int added = 0;
    char id[32];
    pd_scheduler_update_result_t res;
    while (d.finished < 60) {
        if (added < 60 && pd_rng_below(&r, 3) == 0) {
            snprintf(id, sizeof(id), "r%d", added);
            add(d.s, id, 1 + (int32_t)pd_rng_below(&r, 120), 1 + (int32_t)pd_rng_below(&r, 12), added);
            added++;
        }
        drive_step(&d, &res);
        for (int32_t i = 0; i < res.num_finished; i++) {
            pd_request_t *q = res.finished[i];
            ck_assert_int_eq(q->state, PD_REQ_FINISHED_LENGTH);
            ck_assert_int_eq(pd_request_num_output(q), q->params.max_tokens);
            /* outputs are exactly the tokens the driver sampled, in order */
            for (int32_t k = q->num_prompt_tokens; k < q->num_tokens; k++) {
                ck_assert_int_eq(q->tokens[k], 1000 + k);
            }
        }
        ck_assert_int_lt(d.steps, 5000);
    }
    pd_scheduler_schedule(d.s); /* releases the last finished */
    ck_assert(pd_scheduler_idle(d.s));
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* Pool blocks a request holds in group g (of G). */
static int32_t group_blocks(const pd_request_t *r, int32_t G, int32_t g)
{
    int32_t n = 0;
    for (int32_t b = 0; b < r->num_blocks; b++) {
        n += r->block_ids[b * G + g] != 0;
    }
    return n;
}

/* A request of 10× the window holds at most window/block_size + 2 blocks in a sliding group while
 * decoding (a full group: all of them), and the pool is whole again when it ends; a second one
 * with the same prompt hits the prefix cache within the window. Both hybrid (a sliding and a full
 * group) and all-sliding (one group). */
START_TEST(test_sliding_window_block_bound)
{
    enum { WINDOW = 16, BS = 4 };
    for (int hybrid = 1; hybrid >= 0; hybrid--) {
        driver_t d = {NULL, NULL, 32, 4, 0, 0};
        pd_scheduler_config_t c = sched_cfg(4, 32, 200);
        c.num_kv_groups = hybrid ? 2 : 1;
        c.kv_group_window[0] = WINDOW;
        int32_t G = c.num_kv_groups;
        ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
        for (int rep = 0; rep < 2; rep++) {
            char id[8];
            snprintf(id, sizeof(id), "r%d", rep);
            add(d.s, id, 40, 10 * WINDOW - 40, 3);
            pd_scheduler_update_result_t res;
            int32_t decode_steps = 0, finished0 = d.finished;
            while (d.finished == finished0) {
                const pd_scheduler_output_t *o = drive_step(&d, &res);
                if (o->num_items == 0) {
                    continue;
                }
                const pd_request_t *r = o->items[0].req;
                if (pd_request_is_finished(r)) {
                    continue;
                }
                if (o->items[0].num_new_tokens == 1) { /* decoding */
                    decode_steps++;
                    ck_assert_int_le(group_blocks(r, G, 0), WINDOW / BS + 2);
                    if (hybrid) {
                        ck_assert_int_eq(group_blocks(r, G, 1), r->num_blocks); /* every block */
                        ck_assert_int_ge(r->num_blocks * BS, r->num_computed_tokens);
                    }
                }
            }
            ck_assert_int_eq(decode_steps, 10 * WINDOW - 40 - 2); /* all but the prompt's and the last */
            pd_scheduler_schedule(d.s);
            assert_pool_clean(d.s);
        }
        pd_scheduler_stats_t st;
        pd_scheduler_get_stats(d.s, &st);
        ck_assert_uint_ge(st.prefix_hits, 32); /* the repeat reused the prompt's cached blocks */
        pd_scheduler_destroy(d.s);
    }
}
END_TEST

START_TEST(test_chunked_prefill)
{
    driver_t d = {NULL, NULL, 32, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 32, 100);
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    add(d.s, "long", 100, 3, 1);
    pd_scheduler_update_result_t res;
    int32_t chunks[4] = {32, 32, 32, 4};
    for (int i = 0; i < 4; i++) {
        const pd_scheduler_output_t *o = drive_step(&d, &res);
        ck_assert_int_eq(o->num_items, 1);
        ck_assert_int_eq(o->items[0].num_new_tokens, chunks[i]);
        ck_assert_int_eq(res.num_with_new_token, i == 3 ? 1 : 0); /* no token until the prompt is done */
    }
    /* a second request arriving mid-prefill shares the budget: running first, then waiting */
    add(d.s, "short", 10, 2, 2);
    const pd_scheduler_output_t *o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 2);
    ck_assert_int_eq(o->items[0].num_new_tokens, 1);  /* long: decode */
    ck_assert_int_eq(o->items[1].num_new_tokens, 10); /* short: whole prompt */
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
    }
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* The admit hook holds a fresh request back (a grammar being made ready) while the one behind it
 * runs; once it says ready, the held one runs, and nothing leaks. */
static bool hold_ready;

static bool hold_hook(void *arg, pd_request_t *r)
{
    (void)arg;
    return hold_ready || strcmp(r->id, "held") != 0;
}

START_TEST(test_admit_hook_holds_one_request)
{
    driver_t d = {NULL, NULL, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 100);
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    pd_scheduler_set_admit_hook(d.s, hold_hook, NULL);
    hold_ready = false;
    add(d.s, "held", 10, 2, 1);
    add(d.s, "behind", 10, 2, 2);
    pd_scheduler_update_result_t res;
    const pd_scheduler_output_t *o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 1);
    ck_assert_str_eq(o->items[0].req->id, "behind");
    ck_assert_int_eq(pd_scheduler_find(d.s, "held")->state, PD_REQ_WAITING);
    ck_assert_int_eq(pd_scheduler_find(d.s, "held")->num_blocks, 0);
    hold_ready = true;
    o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 2);
    ck_assert_str_eq(o->items[1].req->id, "held");
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
    }
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

START_TEST(test_preemption_recomputes)
{
    /* 15 usable blocks of 4 tokens: three 16-token prompts fit (12 blocks) but cannot all grow, so
     * the newest running request is preempted, re-queued at the front and recomputed later */
    driver_t d = {NULL, NULL, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 16);
    c.max_model_len = 48;
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    add(d.s, "a", 16, 12, 1);
    add(d.s, "b", 16, 12, 2);
    add(d.s, "c", 16, 12, 3);
    pd_scheduler_update_result_t res;
    int preempted = 0;
    pd_request_t *victim = NULL;
    while (!pd_scheduler_idle(d.s)) {
        const pd_scheduler_output_t *o = drive_step(&d, &res);
        if (o->num_preempted > 0) {
            preempted += o->num_preempted;
            victim = o->preempted[0];
            ck_assert_str_eq(victim->id, "c"); /* newest first */
            ck_assert_int_eq(victim->num_computed_tokens, 0);
            ck_assert_int_eq(victim->num_blocks, 0);
            ck_assert_int_eq(victim->state, PD_REQ_WAITING);
        }
        for (int32_t i = 0; i < res.num_finished; i++) {
            pd_request_t *q = res.finished[i];
            ck_assert_int_eq(pd_request_num_output(q), 12);
            for (int32_t k = q->num_prompt_tokens; k < q->num_tokens; k++) {
                ck_assert_int_eq(q->tokens[k], 1000 + k); /* identical to an unpreempted run */
            }
        }
        ck_assert_int_lt(d.steps, 500);
    }
    ck_assert_int_gt(preempted, 0);
    pd_scheduler_stats_t st;
    pd_scheduler_get_stats(d.s, &st);
    ck_assert_uint_eq(st.num_preemptions, (uint64_t)preempted);
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

START_TEST(test_abort_in_every_state)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(2, 64, 64);
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "run", 20, 50, 1);
    add(d.s, "remote-x", 12, 5, 2);
    add(d.s, "wait", 8, 5, 3);
    pd_scheduler_update_result_t res;
    drive_step(&d, &res);
    /* run is RUNNING, remote-x WAITING_FOR_REMOTE_KV, wait is WAITING (2 seqs max incl. remote? no:
     * remote-x does not count as running) */
    ck_assert_int_eq(pd_scheduler_find(d.s, "run")->state, PD_REQ_RUNNING);
    ck_assert_int_eq(pd_scheduler_find(d.s, "remote-x")->state, PD_REQ_WAITING_FOR_REMOTE_KV);
    pd_request_t *w = pd_scheduler_find(d.s, "wait");
    ck_assert(w->state == PD_REQ_RUNNING || w->state == PD_REQ_WAITING);
    add(d.s, "queued", 8, 5, 4);
    ck_assert_int_eq(pd_scheduler_find(d.s, "queued")->state, PD_REQ_WAITING);

    ck_assert_ptr_nonnull(pd_scheduler_abort(d.s, "queued")); /* WAITING */
    ck_assert_ptr_nonnull(pd_scheduler_abort(d.s, "run"));    /* RUNNING */
    pd_request_t *rx = pd_scheduler_abort(d.s, "remote-x");   /* WAITING_FOR_REMOTE_KV */
    ck_assert_ptr_nonnull(rx);
    ck_assert(rx->holds_blocks_after_finish);           /* a peer may still write them: held */
    ck_assert_ptr_null(pd_scheduler_abort(d.s, "run")); /* already finished */
    ck_assert_ptr_null(pd_scheduler_abort(d.s, "nope"));
    ck_assert_int_eq(f.finished_calls, 3); /* exactly once each */
    drive_step(&d, &res);
    pd_scheduler_stats_t st;
    pd_scheduler_get_stats(d.s, &st);
    ck_assert_int_eq(st.num_holding, 1);
    ck_assert_uint_gt(st.blocks_used, 0);
    /* the peer's transfer ends: the held blocks come back */
    snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-x");
    f.recv_ptrs[0] = f.recving[0];
    f.num_recving = 1;
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
        ck_assert_int_lt(d.steps, 200);
    }
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    ck_assert_int_eq(f.finished_calls, 4);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* ------------------------------------------------------------------ the offload tier's loads */

/* A tier that holds every key the pool evicted into it and ends a load only when the test says so. */
typedef struct fake_tier {
    pd_kv_tier_t t;
    pd_hash128_t held[256];
    int n_held;
    pd_kv_tier_load_t *started[8];
    int n_started;
    pd_kv_tier_load_t *done[8];
    int n_done;
} fake_tier_t;

static bool ft_contains(void *ctx, pd_hash128_t key)
{
    fake_tier_t *f = ctx;
    for (int i = 0; i < f->n_held; i++) {
        if (pd_hash128_eq(f->held[i], key)) {
            return true;
        }
    }
    return false;
}

static void ft_load(void *ctx, pd_kv_tier_load_t *l)
{
    fake_tier_t *f = ctx;
    ck_assert_int_lt(f->n_started, 8);
    f->started[f->n_started++] = l;
}

static pd_kv_tier_load_t *ft_finished(void *ctx)
{
    fake_tier_t *f = ctx;
    return f->n_done > 0 ? f->done[--f->n_done] : NULL;
}

static void ft_save(void *ctx, pd_hash128_t key, uint32_t block)
{
    fake_tier_t *f = ctx;
    (void)block;
    if (!ft_contains(f, key)) {
        ck_assert_int_lt(f->n_held, 256);
        f->held[f->n_held++] = key;
    }
}

/* A request whose prefix continues in the tier waits while its load runs, and others run; a second
 * request for the same prefix waits for that load rather than start its own; a load whose request
 * is aborted goes on, and when it ends its blocks are cached for the one still waiting; the
 * scheduler is not idle while a load is in flight, and the pool is whole at the end. */
START_TEST(test_tier_loads_wait_share_and_outlive_their_request)
{
    fake_tier_t f;
    memset(&f, 0, sizeof(f));
    f.t = (pd_kv_tier_t){&f, ft_contains, ft_load, ft_finished, ft_save};
    driver_t d = {NULL, NULL, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 12); /* 11 blocks of 4 tokens */
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    ck_assert_int_eq(pd_kv_manager_set_tier(pd_scheduler_kv(d.s), &f.t), PD_OK);
    pd_scheduler_update_result_t res;
    const char *fill[] = {"a", "b", "c", "d", "e"}; /* a, then 4 × 5 blocks through 11: a's go to the tier */
    for (int i = 0; i < 5; i++) {
        add(d.s, fill[i], 17, 1, 1 + i);
        while (!pd_scheduler_idle(d.s)) {
            drive_step(&d, &res);
            ck_assert_int_lt(d.steps, 100);
        }
    }
    ck_assert_int_ge(f.n_held, 4);
    ck_assert_int_eq(f.n_started, 0);
    add(d.s, "a2", 17, 2, 1); /* a's prompt twice, and another request */
    add(d.s, "a3", 17, 2, 1);
    add(d.s, "x", 8, 3, 9);
    const pd_scheduler_output_t *o = drive_step(&d, &res);
    ck_assert_int_eq(f.n_started, 1); /* one load, for a2; a3 waits for it */
    pd_kv_tier_load_t *l = f.started[0];
    ck_assert_int_eq(l->n_hits + l->n, 4);
    pd_request_t *a2 = pd_scheduler_find(d.s, "a2"), *a3 = pd_scheduler_find(d.s, "a3");
    ck_assert_ptr_eq(a2->tier_load, l);
    ck_assert_ptr_eq(l->req, a2);
    ck_assert_ptr_null(a3->tier_load);
    ck_assert_int_eq(a2->state, PD_REQ_WAITING);
    ck_assert_int_eq(a3->state, PD_REQ_WAITING);
    ck_assert_int_eq(o->num_items, 1); /* x runs meanwhile */
    ck_assert_str_eq(o->items[0].req->id, "x");
    drive_step(&d, &res);
    ck_assert_int_eq(f.n_started, 1);
    ck_assert_ptr_nonnull(pd_scheduler_abort(d.s, "a2"));
    ck_assert_ptr_null(l->req); /* the load goes on without it */
    drive_step(&d, &res);       /* x's last token */
    o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 0); /* a3 still waits: nothing runs, but the scheduler is not idle */
    ck_assert_int_eq(f.n_started, 1);
    ck_assert(!pd_scheduler_idle(d.s));
    int32_t n_load = l->n;
    l->n_loaded = n_load; /* the tier ends the load (and the scheduler frees it) */
    f.done[f.n_done++] = l;
    o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 1); /* a3 finds every block in the pool: one token to compute */
    ck_assert_ptr_eq(o->items[0].req, a3);
    ck_assert_int_eq(o->items[0].num_new_tokens, 1);
    ck_assert_int_eq(a3->num_cached_tokens, 16);
    ck_assert_uint_eq(pd_scheduler_kv(d.s)->tier_hits, (uint64_t)n_load);
    ck_assert_int_eq(f.n_started, 1);
    drain_and_destroy(&d);
}
END_TEST

START_TEST(test_connector_remote_load_and_delay_free)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 64);
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "remote-a", 14, 3, 1);
    add(d.s, "local", 6, 2, 2);
    pd_scheduler_update_result_t res;
    const pd_scheduler_output_t *o = drive_step(&d, &res);
    pd_request_t *ra = pd_scheduler_find(d.s, "remote-a");
    ck_assert_int_eq(ra->state, PD_REQ_WAITING_FOR_REMOTE_KV);
    ck_assert_int_eq(ra->num_blocks, 4); /* 14 tokens in blocks of 4 */
    ck_assert_int_eq(o->num_items, 1);   /* only "local" computes; the remote one does not block it */
    ck_assert_str_eq(o->items[0].req->id, "local");
    int calls = f.matched_calls;
    drive_step(&d, &res);
    ck_assert_int_eq(f.matched_calls, calls); /* not asked again while loading */
    pd_scheduler_stats_t st;
    pd_scheduler_get_stats(d.s, &st);
    ck_assert_int_eq(st.num_waiting_for_remote_kv, 1);
    /* KV arrived: the request computes only its last prompt token, then decodes */
    snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-a");
    f.recv_ptrs[0] = f.recving[0];
    f.num_recving = 1;
    drive_step(&d, &res); /* update applies recving */
    o = drive_step(&d, &res);
    ck_assert_int_eq(ra->state, PD_REQ_RUNNING);
    ck_assert_int_eq(o->num_items, 1);
    ck_assert_int_eq(o->items[0].num_new_tokens, 1);
    ck_assert_int_eq(ra->num_tokens, 15); /* and got its first token */
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
        ck_assert_int_lt(d.steps, 100);
    }
    ck_assert_str_eq(json_string_value(json_object_get(ra->kv_transfer_params, "remote_engine_id")), "fake");

    /* delay free: a finished "hold-" request keeps its blocks until finished_sending names it */
    add(d.s, "hold-p", 9, 1, 7);
    drive_step(&d, &res);
    ck_assert_int_eq(res.num_finished, 1);
    pd_request_t *hp = res.finished[0];
    ck_assert(hp->holds_blocks_after_finish);
    drive_step(&d, &res);
    drive_step(&d, &res);
    pd_scheduler_get_stats(d.s, &st);
    ck_assert_int_eq(st.num_holding, 1);
    ck_assert_uint_eq(st.blocks_used, 3);
    ck_assert(!pd_scheduler_idle(d.s));
    snprintf(f.sending[0], PD_REQ_ID_MAX, "hold-p");
    f.send_ptrs[0] = f.sending[0];
    f.num_sending = 1;
    drive_step(&d, &res);
    ck_assert(pd_scheduler_idle(d.s));
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* A request that cannot get its blocks keeps fresh requests behind it waiting (FCFS), but not the
 * requests behind it that already hold theirs: remote-a and remote-b loaded their KV into 8 of 15
 * blocks, and c, preempted to the front of the queue with 8 blocks' worth of tokens, fits only once
 * they finished. Before, the queue stopped at c and nothing freed a block again (seen in the fault
 * suite with small pools: a decode request waited for its client's timeout). */
START_TEST(test_blocked_request_lets_loaded_ones_run)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 16); /* 15 usable blocks of 4 tokens */
    c.max_model_len = 64;
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "remote-a", 14, 3, 1);
    add(d.s, "remote-b", 14, 3, 2);
    add(d.s, "c", 16, 40, 3);
    pd_scheduler_update_result_t res;
    int preempted = 0;
    for (int k = 0; k < 40 && preempted == 0; k++) { /* c grows into the free blocks, then is preempted */
        preempted += drive_step(&d, &res)->num_preempted;
    }
    ck_assert_int_eq(preempted, 1);
    pd_request_t *cr = pd_scheduler_find(d.s, "c");
    ck_assert_int_eq(cr->state, PD_REQ_WAITING);
    ck_assert_int_gt(cr->num_tokens, 28); /* more than the 7 free blocks hold */
    for (int i = 0; i < 2; i++) {         /* both loads end */
        snprintf(f.recving[i], PD_REQ_ID_MAX, "remote-%c", 'a' + i);
        f.recv_ptrs[i] = f.recving[i];
    }
    f.num_recving = 2;
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
        ck_assert_msg(d.steps < 200, "the queue is stuck behind c");
    }
    ck_assert_int_eq(d.finished, 3);
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* A connector that cannot start a request's load (out of memory) refuses it: the request ends
 * with an error at once, its blocks freed, instead of waiting for a load nobody will report; the
 * others go on. */
START_TEST(test_connector_refused_load_fails_the_request)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    f.refuse = true;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 64);
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "remote-a", 14, 3, 1);
    pd_scheduler_update_result_t res;
    drive_step(&d, &res);
    ck_assert_int_eq(res.num_finished, 1);
    ck_assert_str_eq(res.finished[0]->id, "remote-a");
    ck_assert_int_eq(res.finished[0]->state, PD_REQ_FINISHED_ERROR);
    f.refuse = false;
    add(d.s, "local", 6, 2, 2);
    drain_and_destroy(&d);
}
END_TEST

/* Two requests with one prompt arrive together on a decode (pull): the second waits while the first
 * loads, then finds the loaded blocks in its prefix cache and loads only the rest (the last, partial
 * block); a request with another prompt does not wait. None waits when load_may_wait is false
 * (push) or load_share_wait is 0 (off); with a 50 ms cap the second loads for itself once the
 * first has loaded for longer. */
START_TEST(test_connector_shared_inflight_load)
{
    for (int mode = 0; mode < 4; mode++) {
        bool push = mode == 1 || mode == 2, capped = mode == 3; /* "push": nothing waits */
        fake_conn_t f;
        memset(&f, 0, sizeof(f));
        f.base.ops = &fake_ops;
        f.no_wait = mode == 1;
        driver_t d = {NULL, &f, 64, 4, 0, 0};
        pd_scheduler_config_t c = sched_cfg(4, 64, 64);
        c.load_share_wait = mode == 2 ? 0.0 : capped ? 0.05 : 1.0;
        ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
        add(d.s, "remote-a", 14, 2, 1);
        add(d.s, "remote-b", 14, 2, 1); /* the same 14 tokens */
        add(d.s, "remote-c", 14, 2, 3); /* others */
        pd_scheduler_update_result_t res;
        drive_step(&d, &res);
        pd_request_t *ra = pd_scheduler_find(d.s, "remote-a"), *rb = pd_scheduler_find(d.s, "remote-b");
        pd_request_t *rc = pd_scheduler_find(d.s, "remote-c");
        ck_assert_int_eq(ra->state, PD_REQ_WAITING_FOR_REMOTE_KV);
        ck_assert_int_eq(rc->state, PD_REQ_WAITING_FOR_REMOTE_KV);
        pd_scheduler_stats_t st;
        pd_scheduler_get_stats(d.s, &st);
        if (push) {
            ck_assert_int_eq(rb->state, PD_REQ_WAITING_FOR_REMOTE_KV);
            ck_assert_int_eq(rb->num_external_tokens, 14);
            ck_assert_uint_eq(st.num_load_waits, 0);
        } else {
            ck_assert_int_eq(rb->state, PD_REQ_WAITING); /* put off: holds nothing */
            ck_assert_int_eq(rb->num_blocks, 0);
            ck_assert_uint_eq(st.num_load_waits, 1);
            drive_step(&d, &res); /* still loading: b still waits, counted once */
            ck_assert_int_eq(rb->state, PD_REQ_WAITING);
            pd_scheduler_get_stats(d.s, &st);
            ck_assert_uint_eq(st.num_load_waits, 1);
        }
        if (capped) { /* past the cap b loads the whole prompt itself */
            usleep(80 * 1000);
            drive_step(&d, &res);
            ck_assert_int_eq(rb->state, PD_REQ_WAITING_FOR_REMOTE_KV);
            ck_assert_int_eq(rb->num_external_tokens, 14);
            push = true; /* from here on as if it never waited */
        }
        snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-a"); /* a's KV arrived */
        f.recv_ptrs[0] = f.recving[0];
        f.num_recving = 1;
        drive_step(&d, &res); /* the update applies it */
        drive_step(&d, &res); /* a computes its last token (its blocks cached), then b is looked up */
        ck_assert_int_eq(ra->state, PD_REQ_RUNNING);
        if (!push) {
            /* 3 full blocks (12 tokens) of a's load are b's now; it loads the last 2 tokens' block */
            ck_assert_int_eq(rb->state, PD_REQ_WAITING_FOR_REMOTE_KV);
            ck_assert_int_eq(rb->num_computed_tokens, 12);
            ck_assert_int_eq(rb->num_external_tokens, 2);
            ck_assert_int_eq(f.external_tokens, 2);
            ck_assert_int_eq(rb->num_cached_tokens, 12);
        }
        /* the stats count each request's one admitting lookup: b's 12-token hit once, no retries */
        pd_scheduler_get_stats(d.s, &st);
        ck_assert_uint_eq(st.prefix_queries, 3 * 14);
        ck_assert_uint_eq(st.prefix_hits, push ? 0 : 12);
        ck_assert_uint_eq(st.num_load_waits, mode == 0 || capped ? 1 : 0);
        snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-b");
        snprintf(f.recving[1], PD_REQ_ID_MAX, "remote-c");
        f.recv_ptrs[0] = f.recving[0];
        f.recv_ptrs[1] = f.recving[1];
        f.num_recving = 2;
        while (!pd_scheduler_idle(d.s)) {
            drive_step(&d, &res);
            ck_assert_int_lt(d.steps, 100);
        }
        ck_assert_int_eq(d.finished, 3);
        pd_scheduler_schedule(d.s);
        assert_pool_clean(d.s);
        pd_scheduler_destroy(d.s);
    }
}
END_TEST

/* First-token handover on a decode: the prefill's token arrives with the load (push: the connector's
 * recving_first_token) and the request goes on from it as if it had sampled it: an output of this
 * update, the KV of every prompt token loaded, the token's own KV computed next, a seeded sampler one
 * draw on; out-of-vocabulary tokens are refused, and a token that stops the request ends it. */
START_TEST(test_first_token_handover)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 64);
    c.vocab_size = 2000;
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "remote-a", 14, 3, 1);
    pd_scheduler_update_result_t res;
    drive_step(&d, &res);
    pd_request_t *ra = pd_scheduler_find(d.s, "remote-a");
    ck_assert_int_eq(ra->state, PD_REQ_WAITING_FOR_REMOTE_KV);
    ck_assert(!pd_scheduler_add_output_token(d.s, ra, 2000)); /* outside the vocabulary */
    ck_assert(!pd_scheduler_add_output_token(d.s, ra, -1));
    ck_assert_int_eq(ra->num_tokens, 14);
    int32_t first[1] = {777};
    snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-a");
    f.recv_ptrs[0] = f.recving[0];
    f.num_recving = 1;
    const pd_scheduler_output_t *o = pd_scheduler_schedule(d.s);
    pd_model_output_t mo;
    memset(&mo, 0, sizeof(mo));
    mo.finished.recving = f.recv_ptrs;
    mo.finished.num_recving = 1;
    mo.finished.recving_first_token = first;
    pd_scheduler_update(d.s, o, &mo, &res);
    ck_assert_int_eq(res.num_with_new_token, 1);
    ck_assert_ptr_eq(res.with_new_token[0], ra);
    ck_assert_int_eq(res.num_new_tokens[0], 1);
    ck_assert_int_eq(ra->num_tokens, 15);
    ck_assert_int_eq(ra->tokens[14], 777);
    ck_assert(ra->first_token_time > 0);
    f.num_recving = 0;
    o = drive_step(&d, &res);
    ck_assert_int_eq(o->num_items, 1); /* computes the first token's KV (all 14 prompt tokens loaded) */
    ck_assert_int_eq(o->items[0].num_new_tokens, 1);
    ck_assert_int_eq(ra->num_tokens, 16);
    ck_assert_int_eq(ra->tokens[15], 1000 + 15);
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
        ck_assert_int_lt(d.steps, 100);
    }
    ck_assert_int_eq(ra->num_tokens, 14 + 3); /* max_tokens counts the prefill's token */

    /* a sampling request draws each output position from that position's own generator: one that got
     * its first token elsewhere samples its second from the generator a single node would use */
    int32_t toks[5] = {1, 2, 3, 4, 5};
    pd_request_params_t p;
    memset(&p, 0, sizeof(p));
    p.max_tokens = 4;
    p.sampling.top_p = 1.0f;
    p.sampling.temperature = 0.7f;
    p.has_seed = true;
    p.seed = 99;
    pd_request_t *rs = NULL, *twin = NULL;
    ck_assert_int_eq(pd_request_create("s", toks, 5, &p, 64, &rs), PD_OK);
    ck_assert_int_eq(pd_request_create("twin", toks, 5, &p, 64, &twin), PD_OK);
    ck_assert_int_eq(pd_scheduler_add_request(d.s, rs), PD_OK);
    ck_assert(pd_scheduler_add_output_token(d.s, rs, 9));
    ck_assert(!pd_scheduler_add_output_token(d.s, rs, 9)); /* only the first output */
    pd_rng_t g0, g1, t1;
    pd_request_rng_at(rs, 0, &g0);
    pd_request_rng_at(rs, 1, &g1);
    pd_request_rng_at(twin, 1, &t1);
    uint64_t v1 = pd_rng_next(&g1);
    ck_assert(v1 == pd_rng_next(&t1));
    ck_assert(v1 != pd_rng_next(&g0));
    pd_request_free(twin);
    /* several tokens (a resumed stream): appended with the stop checks, the rest dropped after a stop */
    add(d.s, "m", 5, 8, 3);
    pd_request_t *rm = pd_scheduler_find(d.s, "m");
    int32_t bad[2] = {7, 5000};
    ck_assert_int_eq(pd_scheduler_add_output_tokens(d.s, rm, bad, 2), -1); /* nothing appended */
    ck_assert_int_eq(rm->num_tokens, 5);
    int32_t three[3] = {7, 8, 9};
    ck_assert_int_eq(pd_scheduler_add_output_tokens(d.s, rm, three, 3), 3);
    ck_assert_int_eq(rm->num_tokens, 8);
    ck_assert_int_eq(rm->tokens[7], 9);
    ck_assert_int_eq(pd_scheduler_add_output_tokens(d.s, rm, three, 1), -1); /* it has outputs */
    add(d.s, "ms", 5, 8, 3);
    pd_request_t *ms = pd_scheduler_find(d.s, "ms");
    int32_t with_eos[3] = {7, 0, 9}; /* EOS (0) ends it: 9 is dropped */
    ck_assert_int_eq(pd_scheduler_add_output_tokens(d.s, ms, with_eos, 3), 2);
    ck_assert_int_eq(ms->state, PD_REQ_FINISHED_STOPPED);
    /* EOS as the first token ends the request at once */
    add(d.s, "e", 5, 4, 3);
    pd_request_t *re = pd_scheduler_find(d.s, "e");
    ck_assert(pd_scheduler_add_output_token(d.s, re, 0));
    ck_assert_int_eq(re->state, PD_REQ_FINISHED_STOPPED);
    int32_t n_fin = 0;
    pd_request_t *const *fin = pd_scheduler_finished(d.s, &n_fin);
    ck_assert_int_ge(n_fin, 1);
    ck_assert_ptr_eq(fin[n_fin - 1], re);
    pd_scheduler_abort(d.s, "s");
    pd_scheduler_abort(d.s, "m");
    for (int i = 0; i < 3; i++) {
        drive_step(&d, &res);
    }
    ck_assert(pd_scheduler_idle(d.s));
    pd_scheduler_schedule(d.s);
    assert_pool_clean(d.s);
    pd_scheduler_destroy(d.s);
}
END_TEST

static void load_error_case(pd_load_failure_policy_t policy)
{
    fake_conn_t f;
    memset(&f, 0, sizeof(f));
    f.base.ops = &fake_ops;
    driver_t d = {NULL, &f, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 64);
    c.load_failure_policy = policy;
    ck_assert_int_eq(pd_scheduler_create(&c, &f.base, &d.s), PD_OK);
    add(d.s, "remote-e", 16, 2, 1);
    pd_scheduler_update_result_t res;
    drive_step(&d, &res);
    pd_request_t *r = pd_scheduler_find(d.s, "remote-e");
    ck_assert_int_eq(r->state, PD_REQ_WAITING_FOR_REMOTE_KV);
    /* block 2 (tokens 8..11) failed; reported with the completion, as the contract requires */
    f.bad_blocks[0] = r->block_ids[2];
    f.num_bad = 1;
    snprintf(f.recving[0], PD_REQ_ID_MAX, "remote-e");
    f.recv_ptrs[0] = f.recving[0];
    f.num_recving = 1;
    drive_step(&d, &res);
    if (policy == PD_LOAD_FAILURE_FAIL) {
        ck_assert_int_eq(res.num_finished, 1);
        ck_assert_int_eq(res.finished[0]->state, PD_REQ_FINISHED_ERROR);
    } else {
        const pd_scheduler_output_t *o = drive_step(&d, &res);
        ck_assert_int_eq(o->num_items, 1);
        ck_assert_int_eq(r->state, PD_REQ_RUNNING);
        ck_assert_int_eq(o->items[0].num_new_tokens, 8); /* recomputes blocks 2 and 3 */
    }
    drain_and_destroy(&d);
}

START_TEST(test_load_errors_recompute)
{
    load_error_case(PD_LOAD_FAILURE_RECOMPUTE);
}
END_TEST

START_TEST(test_load_errors_fail)
{
    load_error_case(PD_LOAD_FAILURE_FAIL);
}
END_TEST

START_TEST(test_stop_conditions)
{
    driver_t d = {NULL, NULL, 64, 4, 0, 0};
    pd_scheduler_config_t c = sched_cfg(4, 64, 64);
    ck_assert_int_eq(pd_scheduler_create(&c, NULL, &d.s), PD_OK);
    int32_t toks[5] = {3, 4, 5, 6, 7};
    pd_request_params_t p;
    memset(&p, 0, sizeof(p));
    p.max_tokens = 10;
    p.sampling.top_p = 1;
    p.stop_token_ids[0] = 1000 + 7; /* the driver samples 1000 + num_tokens: after 2 outputs */
    p.num_stop_token_ids = 1;
    pd_request_t *r = NULL;
    ck_assert_int_eq(pd_request_create("stopid", toks, 5, &p, 1024, &r), PD_OK);
    ck_assert_int_eq(pd_scheduler_add_request(d.s, r), PD_OK);
    pd_scheduler_update_result_t res;
    while (!pd_scheduler_idle(d.s)) {
        drive_step(&d, &res);
    }
    ck_assert_int_eq(r->state, PD_REQ_FINISHED_STOPPED);
    ck_assert_int_eq(pd_request_num_output(r), 3);
    ck_assert_str_eq(pd_request_finish_reason(r), "stop");
    pd_request_t *dup = make_req("stopid", toks, 5, 2); /* refused: the caller keeps ownership */
    ck_assert_int_eq(pd_scheduler_add_request(d.s, dup), PD_ERR_INVALID_ARG);
    pd_request_free(dup);
    pd_scheduler_destroy(d.s);
}
END_TEST

/* The positions a prompt's tokens attend to: p + 1 at position p, at most the window on a sliding
 * layer, averaged over the layers by their share; the closed forms equal a plain sum. */
START_TEST(test_prefill_cost_positions)
{
    pd_prefill_cost_t c;
    pd_prefill_cost_init(&c, 1e-3, 0, 0);
    ck_assert_double_eq(pd_prefill_cost_positions(&c, 0, 4), 10); /* 1 + 2 + 3 + 4 */
    ck_assert_double_eq(pd_prefill_cost_positions(&c, 2, 4), 7);
    ck_assert_double_eq(pd_prefill_cost_positions(&c, 4, 4), 0);
    pd_prefill_cost_init(&c, 1e-3, 4, 1);
    ck_assert_double_eq(pd_prefill_cost_positions(&c, 0, 8), 26); /* 1 + 2 + 3 + 4 × 5 */
    ck_assert_double_eq(pd_prefill_cost_positions(&c, 5, 8), 12);
    const int32_t windows[] = {1, 3, 16, 100};
    const double shares[] = {0.25, 0.5, 5.0 / 6, 1};
    for (int i = 0; i < 4; i++) {
        pd_prefill_cost_init(&c, 1e-3, windows[i], shares[i]);
        for (int64_t from = 0; from < 40; from += 3) {
            for (int64_t to = from; to < 130; to += 7) {
                double want = 0;
                for (int64_t p = from; p < to; p++) {
                    double slide = p + 1 < windows[i] ? (double)(p + 1) : windows[i];
                    want += (1 - shares[i]) * (double)(p + 1) + shares[i] * slide;
                }
                ck_assert_double_eq_tol(pd_prefill_cost_positions(&c, from, to), want, 1e-9 * (want + 1));
            }
        }
    }
}
END_TEST

/* The fit: steps of one shape keep the ratio and fit the scale; steps of different shapes (a long
 * prompt in chunks) teach both terms exactly; a fit with a negative term is not taken; nothing is
 * known before the first step. */
START_TEST(test_prefill_cost_fit)
{
    const double alpha = 4e-4, beta = 2e-7, prior = 3.6e-4; /* beta / alpha = 5e-4: the prior is off */
    pd_prefill_cost_t c;
    pd_prefill_cost_init(&c, prior, 0, 0);
    double s;
    ck_assert(!pd_prefill_cost_estimate(&c, 0, 100, &s));
    ck_assert_double_eq(s, 0);
    /* one shape (a 2048-token prompt from position 0, over and over): only the scale is learned */
    double n = 2048, a = pd_prefill_cost_positions(&c, 0, 2048);
    for (int i = 0; i < 5; i++) {
        pd_prefill_cost_observe(&c, n, a, alpha * n + beta * a);
    }
    ck_assert(!c.learned);
    ck_assert_double_eq_tol(c.beta / c.alpha, prior, 1e-12);
    ck_assert(pd_prefill_cost_step(&c, n, a, &s));
    ck_assert_double_eq_tol(s, alpha * n + beta * a, 1e-9); /* that shape is predicted right */
    /* an 8 k prompt in chunks of 2048: both terms, exactly */
    for (int64_t from = 0; from < 8192; from += 2048) {
        double pos = pd_prefill_cost_positions(&c, from, from + 2048);
        pd_prefill_cost_observe(&c, 2048, pos, alpha * 2048 + beta * pos);
    }
    ck_assert(c.learned);
    ck_assert_double_eq_tol(c.alpha, alpha, alpha * 1e-6);
    ck_assert_double_eq_tol(c.beta, beta, beta * 1e-6);
    /* the same 1024 tokens cost more deep in a prompt than at its start */
    double head, deep;
    ck_assert(pd_prefill_cost_estimate(&c, 0, 1024, &head));
    ck_assert(pd_prefill_cost_estimate(&c, 7168, 8192, &deep));
    ck_assert_double_eq_tol(deep, alpha * 1024 + beta * pd_prefill_cost_positions(&c, 7168, 8192), 1e-9);
    ck_assert(deep > 2.5 * head);
    /* the deeper chunk ran faster (noise, another load): a negative beta is not taken, the ratio
     * stays and the scale follows */
    pd_prefill_cost_t d;
    pd_prefill_cost_init(&d, prior, 0, 0);
    pd_prefill_cost_observe(&d, 2048, pd_prefill_cost_positions(&d, 0, 2048), 1.0);
    pd_prefill_cost_observe(&d, 2048, pd_prefill_cost_positions(&d, 2048, 4096), 0.5);
    ck_assert(!d.learned);
    ck_assert(d.alpha > 0);
    ck_assert_double_eq_tol(d.beta / d.alpha, prior, 1e-12);
    /* a zero or negative figure is no step */
    pd_prefill_cost_observe(&d, 0, 10, 1.0);
    pd_prefill_cost_observe(&d, 10, 10, -1.0);
    ck_assert_int_eq(d.steps, 2);
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_ERROR);
    Suite *s = suite_create("scheduler");
    TCase *tc = tcase_create("scheduler");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_block_pool_basic);
    tcase_add_test(tc, test_block_pool_random_vs_model);
    tcase_add_test(tc, test_prefix_hit_after_repeat);
    tcase_add_test(tc, test_kv_config_llama31_8b);
    tcase_add_test(tc, test_kv_config_kinds_and_sharing);
    tcase_add_test(tc, test_kv_config_hybrid_groups);
    tcase_add_test(tc, test_prefix_hit_sliding_group);
    tcase_add_test(tc, test_sliding_window_block_bound);
    tcase_add_test(tc, test_budget_and_max_seqs_random);
    tcase_add_test(tc, test_chunked_prefill);
    tcase_add_test(tc, test_admit_hook_holds_one_request);
    tcase_add_test(tc, test_preemption_recomputes);
    tcase_add_test(tc, test_blocked_request_lets_loaded_ones_run);
    tcase_add_test(tc, test_abort_in_every_state);
    tcase_add_test(tc, test_connector_remote_load_and_delay_free);
    tcase_add_test(tc, test_connector_refused_load_fails_the_request);
    tcase_add_test(tc, test_connector_shared_inflight_load);
    tcase_add_test(tc, test_first_token_handover);
    tcase_add_test(tc, test_load_errors_recompute);
    tcase_add_test(tc, test_load_errors_fail);
    tcase_add_test(tc, test_stop_conditions);
    tcase_add_test(tc, test_tier_loads_wait_share_and_outlive_their_request);
    tcase_add_test(tc, test_prefill_cost_positions);
    tcase_add_test(tc, test_prefill_cost_fit);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
