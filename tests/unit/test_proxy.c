/* tests/unit/test_proxy.c — pd-proxy's pieces that run without processes: the KV block index
 * (proxy/kv_index.c) against a plain reference under random stores, removals, node clears and a
 * full table. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/kv_index.h"
#include "proxy/kv_recent.h"
#include "test_util.h"

#define KEYS  600
#define NODES 5

/* The reference: which of KEYS keys each node holds (keys are spread over the 64-bit range and
 * also crowded into one probe run by sharing their hash's high bits). */
static uint64_t key_of(int k)
{
    return k % 3 == 0 ? (uint64_t)k : (uint64_t)k * 0x9e3779b97f4a7c15ull ^ 0x5555;
}

START_TEST(test_kv_index_random_vs_reference)
{
    for (int cap_case = 0; cap_case < 2; cap_case++) {
        uint32_t max_entries = cap_case == 0 ? 4096 : 200; /* the second one fills up */
        px_kv_index_t idx;
        ck_assert(px_kv_index_init(&idx, max_entries));
        static bool ref[NODES][KEYS];
        memset(ref, 0, sizeof(ref));
        uint32_t seed = 7 + (uint32_t)cap_case;
        for (int step = 0; step < 200000; step++) {
            seed = seed * 1103515245u + 12345u;
            int op = (int)(seed >> 16) % 100, node = (int)(seed >> 8) % NODES;
            seed = seed * 1103515245u + 12345u;
            int k = (int)(seed >> 12) % KEYS;
            if (op < 55) {
                /* a new key is refused when the table is full, unless another node has it already */
                bool present = false;
                for (int n = 0; n < NODES; n++) {
                    present |= ref[n][k];
                }
                bool fits = present || idx.used < max_entries;
                px_kv_index_add(&idx, key_of(k), node);
                uint64_t key = key_of(k);
                ck_assert_int_eq(px_kv_index_prefix(&idx, &key, 1, node), fits || ref[node][k]);
                ref[node][k] = fits || ref[node][k];
            } else if (op < 98) {
                px_kv_index_remove(&idx, key_of(k), node);
                ref[node][k] = false;
            } else if (op == 98) {
                px_kv_index_clear_node(&idx, node);
                memset(ref[node], 0, sizeof(ref[node]));
            }
            if (step % 997 == 0) {
                uint32_t used = 0;
                for (int kk = 0; kk < KEYS; kk++) {
                    bool any = false;
                    for (int n = 0; n < NODES; n++) {
                        uint64_t key = key_of(kk);
                        ck_assert_int_eq(px_kv_index_prefix(&idx, &key, 1, n), ref[n][kk]);
                        any |= ref[n][kk];
                    }
                    used += any;
                }
                ck_assert_uint_eq(idx.used, used);
                ck_assert_uint_le(idx.used, max_entries);
                for (int n = 0; n < NODES; n++) {
                    uint32_t c = 0;
                    for (int kk = 0; kk < KEYS; kk++) {
                        c += ref[n][kk];
                    }
                    ck_assert_uint_eq(idx.per_node[n], c);
                }
            }
        }
        if (cap_case == 1) {
            ck_assert_uint_gt(idx.dropped, 0);
        }
        px_kv_index_free(&idx);
    }
}
END_TEST

START_TEST(test_kv_index_prefix)
{
    px_kv_index_t idx;
    ck_assert(px_kv_index_init(&idx, 64));
    uint64_t chain[4] = {11, 22, 33, 44};
    px_kv_index_add(&idx, 11, 2);
    px_kv_index_add(&idx, 22, 2);
    px_kv_index_add(&idx, 44, 2); /* a hole at 33: the prefix stops before it */
    px_kv_index_add(&idx, 11, 3);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 2), 2);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 3), 1);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 0), 0);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 64), 0); /* out of range: nothing */
    px_kv_index_clear_node(&idx, 2);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 2), 0);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 3), 1);
    ck_assert_uint_eq(idx.used, 1);
    /* a node's offload tier continues its pool: 11 pooled, 22 and 33 in the tier, 44 pooled */
    px_kv_index_add(&idx, 11, 5);
    px_kv_index_add(&idx, px_kv_tier_key(22), 5);
    px_kv_index_add(&idx, px_kv_tier_key(33), 5);
    px_kv_index_add(&idx, 44, 5);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 5), 4);
    px_kv_index_remove(&idx, 33, 5); /* the pool never held it: the tier still does */
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 5), 4);
    px_kv_index_remove(&idx, px_kv_tier_key(33), 5);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 5), 2);
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 3), 1); /* another node's tier is not this one's */
    px_kv_index_clear_node(&idx, 5);                            /* a restart empties both */
    ck_assert_int_eq(px_kv_index_prefix(&idx, chain, 4, 5), 0);
    ck_assert_uint_eq(idx.used, 1);
    px_kv_index_free(&idx);
}
END_TEST

/* Recent routes: the longest prefix sent to a node within the ttl; the ring forgets the oldest. */
START_TEST(test_kv_recent_prefix)
{
    px_kv_recent_t r;
    memset(&r, 0, sizeof(r));
    uint64_t a[4] = {1, 2, 3, 4}, b[3] = {1, 2, 9}, q[4] = {1, 2, 3, 7};
    px_kv_recent_add(&r, a, 4, 0, 10.0);
    px_kv_recent_add(&r, b, 3, 1, 11.0);
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 0, 11.5, 5), 3);
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 1, 11.5, 5), 2);
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 2, 0, 11.5, 5), 2); /* no further than the query */
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 0, 15.5, 5), 0); /* older than the ttl */
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 2, 11.5, 5), 0);
    for (int i = 0; i < PX_KV_RECENT; i++) { /* a full ring later, the first routes are gone */
        uint64_t other[2] = {100 + (uint64_t)i, 5};
        px_kv_recent_add(&r, other, 2, 0, 12.0);
    }
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 0, 12.0, 5), 0);
    ck_assert_int_eq(px_kv_recent_prefix(&r, q, 4, 1, 12.0, 5), 0);
    px_kv_recent_add(&r, a, 0, 0, 12.0); /* nothing to record */
    px_kv_recent_free(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("proxy");
    TCase *tc = tcase_create("kv_index");
    tcase_add_test(tc, test_kv_index_random_vs_reference);
    tcase_add_test(tc, test_kv_index_prefix);
    tcase_add_test(tc, test_kv_recent_prefix);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
