/* tests/unit/test_common.c — status, hashing, arena, list, array, strmap, json helpers, flags, rng, copies,
 * the metrics registry. */
#include "test_util.h" /* first: it defines _GNU_SOURCE */

#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/arena.h"
#include "common/array.h"
#include "common/checksum.h"
#include "common/copy.h"
#include "common/flags.h"
#include "common/hash.h"
#include "common/huge_alloc.h"
#include "common/json.h"
#include "common/key_map.h"
#include "common/list.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rng.h"
#include "common/sha256.h"
#include "common/status.h"
#include "common/strmap.h"
#include "common/time.h"
#include "fail_alloc.h"

START_TEST(test_status_names)
{
    ck_assert_str_eq(pd_status_str(PD_OK), "PD_OK");
    ck_assert_str_eq(pd_status_str(PD_ERR_TIMEOUT), "PD_ERR_TIMEOUT");
    ck_assert_str_eq(pd_status_str(PD_ERR_OUT_OF_RANGE), "PD_ERR_OUT_OF_RANGE");
    ck_assert_str_eq(pd_status_str((pd_status_t)-999), "PD_ERR_UNKNOWN");
}
END_TEST

START_TEST(test_log_level_parse)
{
    ck_assert_int_eq(pd_log_level_parse("debug"), PD_LOG_DEBUG);
    ck_assert_int_eq(pd_log_level_parse("WARN"), PD_LOG_WARN);
    ck_assert_int_eq(pd_log_level_parse("off"), PD_LOG_OFF);
    ck_assert_int_eq(pd_log_level_parse("loud"), -1);
}
END_TEST

/* Every checksum variant this CPU runs equals the library's XXH3 on every length and alignment the
 * vector loops split differently (stripes of 64, blocks of 1024, tails); the others are named. */
START_TEST(test_checksum_variants)
{
    enum { MAX = 70000 };
    uint8_t *buf = malloc(MAX + 64);
    pd_rng_t r;
    pd_rng_seed(&r, 17);
    for (size_t i = 0; i < MAX + 64; i++) {
        buf[i] = (uint8_t)pd_rng_below(&r, 256);
    }
    static const char *names[] = {"sse2", "avx2", "avx512"};
    static const size_t lens[] = {0,   1,    3,    16,   17,   128,   129,   240,
                                  241, 1023, 1024, 1025, 8192, 65536, 69568, MAX};
    int ran = 0;
    for (int v = 0; v < 3; v++) {
        pd_checksum_fn f = pd_checksum64_variant(names[v]);
        if (f == NULL) {
            fprintf(stderr, "test_checksum_variants: %s not run (this CPU or build lacks it)\n", names[v]);
            continue;
        }
        ran++;
        for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
            for (size_t off = 0; off < 64; off += 13) {
                uint64_t seed = k * 1000 + off;
                ck_assert_msg(f(buf + off, lens[k], seed) == pd_hash64(buf + off, lens[k], seed),
                              "%s: len %zu off %zu", names[v], lens[k], off);
            }
        }
    }
    ck_assert_int_ge(ran, 1);
    ck_assert(pd_checksum64_variant("neon") == NULL);
    ck_assert_uint_eq(pd_checksum64(buf, 5000, 9), pd_hash64(buf, 5000, 9));
    ck_assert(pd_checksum64_variant(pd_checksum64_name()) != NULL);
    free(buf);
}
END_TEST

/* The 128-bit key map: inserts, lookups, removals that shift entries back over a full probe run. */
START_TEST(test_key_map)
{
    pd_key_map_t m;
    ck_assert_int_eq(pd_key_map_init(&m, 100), PD_OK);
    ck_assert_uint_eq(m.cap, 256);
    for (uint32_t i = 0; i < 100; i++) {
        /* low halves that collide in the home slot: one long probe run */
        ck_assert(pd_key_map_insert(&m, (pd_hash128_t){(uint64_t)i << 40, 0}, i));
    }
    ck_assert(!pd_key_map_insert(&m, (pd_hash128_t){5ull << 40, 0}, 7)); /* present */
    ck_assert(!pd_key_map_insert(&m, (pd_hash128_t){1, 1}, PD_KEY_MAP_NONE));
    ck_assert(!pd_key_map_remove(&m, (pd_hash128_t){5ull << 40, 0}, 6)); /* another value */
    for (uint32_t i = 0; i < 100; i += 2) {
        ck_assert(pd_key_map_remove(&m, (pd_hash128_t){(uint64_t)i << 40, 0}, i));
    }
    ck_assert_uint_eq(m.count, 50);
    for (uint32_t i = 0; i < 100; i++) {
        ck_assert_uint_eq(pd_key_map_get(&m, (pd_hash128_t){(uint64_t)i << 40, 0}),
                          i % 2 ? i : PD_KEY_MAP_NONE);
    }
    ck_assert(pd_key_map_remove(&m, (pd_hash128_t){3ull << 40, 0}, PD_KEY_MAP_NONE)); /* any value */
    ck_assert_uint_eq(pd_key_map_get(&m, (pd_hash128_t){3ull << 40, 0}), PD_KEY_MAP_NONE);
    pd_key_map_free(&m);
    ck_assert_uint_eq(pd_key_map_get(&m, (pd_hash128_t){1, 1}), PD_KEY_MAP_NONE);
}
END_TEST

START_TEST(test_hash_chain)
{
    int32_t a[4] = {1, 2, 3, 4};
    int32_t b[4] = {1, 2, 3, 5};
    pd_hash128_t h1 = pd_hash128_chain(NULL, a, 4, NULL, 0);
    pd_hash128_t h2 = pd_hash128_chain(NULL, a, 4, NULL, 0);
    pd_hash128_t h3 = pd_hash128_chain(NULL, b, 4, NULL, 0);
    ck_assert(pd_hash128_eq(h1, h2));
    ck_assert(!pd_hash128_eq(h1, h3));
    /* the parent is part of the hash: same tokens under different parents differ */
    pd_hash128_t c1 = pd_hash128_chain(&h1, a, 4, NULL, 0);
    pd_hash128_t c3 = pd_hash128_chain(&h3, a, 4, NULL, 0);
    ck_assert(!pd_hash128_eq(c1, c3));
    /* extra keys (e.g. a LoRA id) separate otherwise equal blocks */
    uint32_t extra = 7;
    pd_hash128_t e1 = pd_hash128_chain(NULL, a, 4, &extra, sizeof(extra));
    ck_assert(!pd_hash128_eq(e1, h1));
    ck_assert_uint_ne(pd_hash64("abc", 3, 0), pd_hash64("abd", 3, 0));
    ck_assert_uint_eq(pd_hash64("abc", 3, 1), pd_hash64("abc", 3, 1));
}
END_TEST

START_TEST(test_arena)
{
    pd_arena_t a;
    pd_arena_init(&a, 256);
    char *prev = NULL;
    for (int i = 0; i < 1000; i++) {
        size_t align = (size_t)1 << (i % 7);
        char *p = pd_arena_alloc(&a, (size_t)(i % 50) + 1, align);
        ck_assert_ptr_nonnull(p);
        ck_assert_uint_eq((uintptr_t)p % align, 0);
        memset(p, i & 0xff, (size_t)(i % 50) + 1);
        if (prev != NULL) {
            ck_assert_int_eq((unsigned char)prev[0], (unsigned char)((i - 1) & 0xff));
        }
        prev = p;
    }
    char *big = pd_arena_alloc(&a, 10000, 64);
    ck_assert_ptr_nonnull(big);
    memset(big, 1, 10000);
    char *s = pd_arena_strndup(&a, "hello world", 5);
    ck_assert_str_eq(s, "hello");
    char *z3 = pd_arena_strndup(&a, "a\0b\0c", 5); /* exactly n bytes, NULs included (fuzz_template) */
    ck_assert_int_eq(memcmp(z3, "a\0b\0c", 6), 0);
    ck_assert_ptr_null(pd_arena_alloc(&a, 8, 3)); /* align must be a power of two */
    int *z = pd_arena_calloc(&a, 100, sizeof(int));
    for (int i = 0; i < 100; i++) {
        ck_assert_int_eq(z[i], 0);
    }
    pd_arena_reset(&a);
    ck_assert_uint_eq(a.bytes_used, 0);
    ck_assert_ptr_nonnull(pd_arena_alloc(&a, 16, 8));
    pd_arena_destroy(&a);
}
END_TEST

typedef struct item {
    int v;
    pd_list_link_t link;
} item_t;

/* The list's order as a string of digits, walked forwards and checked backwards too. */
static void expect_order(pd_list_link_t *head, const char *want)
{
    char got[32] = "";
    size_t n = 0;
    item_t *it;
    pd_list_for_each (it, head, link) {
        got[n++] = (char)('0' + it->v);
    }
    got[n] = '\0';
    ck_assert_str_eq(got, want);
    ck_assert_uint_eq(pd_list_length(head), strlen(want));
    n = strlen(want);
    for (pd_list_link_t *e = head->prev; e != head; e = e->prev) {
        ck_assert_int_eq(pd_container_of(e, item_t, link)->v, want[--n] - '0');
    }
}

START_TEST(test_list)
{
    pd_list_link_t a, b;
    pd_list_head_init(&a);
    pd_list_head_init(&b);
    ck_assert(pd_list_is_empty(&a));
    ck_assert_ptr_null(pd_list_pop_head(&a, item_t, link));
    item_t it[8];
    for (int i = 0; i < 8; i++) {
        it[i].v = i;
    }
    for (int i = 1; i < 5; i++) {
        pd_list_add_tail(&a, &it[i].link);
    }
    pd_list_add_head(&a, &it[0].link);
    expect_order(&a, "01234");
    ck_assert_int_eq(pd_list_head(&a, item_t, link)->v, 0);
    ck_assert_int_eq(pd_list_tail(&a, item_t, link)->v, 4);
    /* delete from the middle, the head and the tail while iterating */
    item_t *x, *tmp;
    pd_list_for_each_safe (x, tmp, &a, link) {
        if (x->v != 1 && x->v != 3) {
            pd_list_del(&x->link);
        }
    }
    expect_order(&a, "13");
    pd_list_del(&it[1].link); /* a second del of an unlinked element is harmless */
    pd_list_del(&it[1].link);
    expect_order(&a, "3");
    for (int i = 5; i < 8; i++) {
        pd_list_add_tail(&b, &it[i].link);
    }
    pd_list_splice_tail(&a, &b);
    expect_order(&a, "3567");
    ck_assert(pd_list_is_empty(&b));
    pd_list_splice_tail(&a, &b); /* an empty source changes nothing */
    expect_order(&a, "3567");
    item_t *h = pd_list_pop_head(&a, item_t, link);
    ck_assert_ptr_eq(h, &it[3]);
    expect_order(&a, "567");
}
END_TEST

START_TEST(test_array_reserve)
{
    uint32_t *a = NULL;
    size_t cap = 0;
    for (uint32_t i = 0; i < 1000; i++) {
        ck_assert_int_eq(pd_array_reserve(&a, &cap, (size_t)i + 1), PD_OK);
        ck_assert_uint_ge(cap, (size_t)i + 1);
        a[i] = i * 7;
    }
    ck_assert_uint_lt(cap, 2048); /* doubling, not one element at a time nor far beyond */
    for (uint32_t i = 0; i < 1000; i++) {
        ck_assert_uint_eq(a[i], i * 7);
    }
    size_t before = cap;
    ck_assert_int_eq(pd_array_reserve(&a, &cap, 10), PD_OK); /* never shrinks */
    ck_assert_uint_eq(cap, before);
    /* an impossible size fails and leaves the array as it was */
    uint32_t *keep = a;
    ck_assert_int_eq(pd_array_reserve(&a, &cap, SIZE_MAX / 2), PD_ERR_NO_MEMORY);
    ck_assert_ptr_eq(a, keep);
    ck_assert_uint_eq(cap, before);
    ck_assert_uint_eq(a[999], 999 * 7);
    free(a);
}
END_TEST

START_TEST(test_strmap)
{
    pd_strmap_t m;
    ck_assert_int_eq(pd_strmap_init(&m, 4), PD_OK);
    char key[32];
    for (int i = 0; i < 5000; i++) {
        int n = snprintf(key, sizeof(key), "key-%d", i);
        ck_assert_int_eq(pd_strmap_put(&m, key, (size_t)n, i * 3), PD_OK);
    }
    ck_assert_uint_eq(m.count, 5000);
    for (int i = 0; i < 5000; i++) {
        int n = snprintf(key, sizeof(key), "key-%d", i);
        int64_t v = -1;
        ck_assert_int_eq(pd_strmap_get(&m, key, (size_t)n, &v), 1);
        ck_assert_int_eq(v, i * 3);
    }
    int64_t v = 0;
    ck_assert_int_eq(pd_strmap_get(&m, "key-5000", 8, &v), 0);
    /* keys are byte strings: embedded NULs are part of the key */
    ck_assert_int_eq(pd_strmap_put(&m, "a\0b", 3, 42), PD_OK);
    ck_assert_int_eq(pd_strmap_get(&m, "a\0b", 3, &v), 1);
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(pd_strmap_get(&m, "a", 1, &v), 0);
    ck_assert_int_eq(pd_strmap_put(&m, "key-7", 5, -1), PD_OK); /* replace keeps count */
    ck_assert_uint_eq(m.count, 5001);
    ck_assert_int_eq(pd_strmap_get(&m, "key-7", 5, &v), 1);
    ck_assert_int_eq(v, -1);
    /* delete every third key; the rest stay reachable (backward shift keeps probe runs intact) */
    for (int i = 0; i < 5000; i += 3) {
        int n = snprintf(key, sizeof(key), "key-%d", i);
        ck_assert_int_eq(pd_strmap_del(&m, key, (size_t)n, NULL), 1);
        ck_assert_int_eq(pd_strmap_del(&m, key, (size_t)n, NULL), 0);
    }
    for (int i = 0; i < 5000; i++) {
        int n = snprintf(key, sizeof(key), "key-%d", i);
        int present = pd_strmap_get(&m, key, (size_t)n, &v);
        ck_assert_int_eq(present, i % 3 != 0);
        if (present && i != 7) {
            ck_assert_int_eq(v, i * 3);
        }
    }
    ck_assert_uint_eq(m.count, 5001 - 1667);
    /* churn: insert/delete many distinct keys; the table does not fill up */
    for (int i = 0; i < 100000; i++) {
        int n = snprintf(key, sizeof(key), "churn-%d", i);
        ck_assert_int_eq(pd_strmap_put(&m, key, (size_t)n, i), PD_OK);
        ck_assert_int_eq(pd_strmap_del(&m, key, (size_t)n, &v), 1);
        ck_assert_int_eq(v, i);
    }
    ck_assert_uint_eq(m.count, 5001 - 1667);
    pd_strmap_destroy(&m);
}
END_TEST

START_TEST(test_json_getters)
{
    const char *text = "{\"a\": 3, \"b\": {\"c\": 2.5, \"d\": \"x\", \"e\": true}, \"f\": 1e3, \"n\": null}";
    json_t *root = NULL;
    ck_assert_int_eq(pd_json_parse("doc", text, strlen(text), &root), PD_OK);
    int64_t i = 0;
    double d = 0;
    bool b = false;
    const char *s = NULL;
    ck_assert_int_eq(pd_json_get_int(root, "doc", "a", &i), PD_OK);
    ck_assert_int_eq(i, 3);
    ck_assert_int_eq(pd_json_get_int(root, "doc", "f", &i), PD_OK); /* integral real */
    ck_assert_int_eq(i, 1000);
    ck_assert_int_eq(pd_json_get_double(root, "doc", "b.c", &d), PD_OK);
    ck_assert_double_eq(d, 2.5);
    ck_assert_int_eq(pd_json_get_str(root, "doc", "b.d", &s), PD_OK);
    ck_assert_str_eq(s, "x");
    ck_assert_int_eq(pd_json_get_bool(root, "doc", "b.e", &b), PD_OK);
    ck_assert(b);
    i = 77;
    ck_assert_int_eq(pd_json_get_int(root, "doc", "b.d", &i), PD_ERR_PARSE);
    ck_assert_int_eq(i, 77); /* untouched on error */
    ck_assert_int_eq(pd_json_get_int(root, "doc", "b.c", &i), PD_ERR_PARSE);
    ck_assert_int_eq(pd_json_get_int(root, "doc", "zz", &i), PD_ERR_NOT_FOUND);
    ck_assert_int_eq(pd_json_get_int(root, "doc", "a.b", &i), PD_ERR_NOT_FOUND);
    ck_assert_int_eq(pd_json_opt_int(root, "doc", "zz", 9, &i), PD_OK);
    ck_assert_int_eq(i, 9);
    ck_assert_int_eq(pd_json_opt_int(root, "doc", "n", 8, &i), PD_OK);
    ck_assert_int_eq(i, 8);
    ck_assert_int_eq(pd_json_opt_double(root, "doc", "b.d", 1.0, &d), PD_ERR_PARSE);
    json_decref(root);
    root = NULL;
    ck_assert_int_eq(pd_json_parse("doc", "{\"a\": ", 6, &root), PD_ERR_PARSE);
    ck_assert_ptr_null(root);
    ck_assert_int_eq(pd_json_parse("doc", "{\"a\":1,\"a\":2}", 13, &root), PD_ERR_PARSE);
}
END_TEST

START_TEST(test_json_file_limits)
{
    char path[] = "/tmp/pd_json_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const char *body = "{\"hidden_size\": 64}";
    ck_assert_int_eq(write(fd, body, strlen(body)), (int)strlen(body));
    close(fd);
    json_t *root = NULL;
    ck_assert_int_eq(pd_json_load_file(path, 4, &root), PD_ERR_NO_SPACE);
    ck_assert_int_eq(pd_json_load_file(path, 1 << 20, &root), PD_OK);
    int64_t h = 0;
    ck_assert_int_eq(pd_json_get_int(root, path, "hidden_size", &h), PD_OK);
    ck_assert_int_eq(h, 64);
    json_decref(root);
    unlink(path);
    ck_assert_int_eq(pd_json_load_file(path, 1 << 20, &root), PD_ERR_NOT_FOUND);
}
END_TEST

START_TEST(test_flags)
{
    int block = 16;
    double util = 0.9;
    bool prefix = true;
    bool verbose = false;
    size_t mem = 0;
    const char *mode = "pull";
    const char *model = NULL;
    pd_flag_t flags[] = {
        {"block-size", PD_FLAG_INT, &block, "tokens per KV block", NULL},
        {"memory-utilization", PD_FLAG_DOUBLE, &util, "fraction of memory", NULL},
        {"enable-prefix-caching", PD_FLAG_BOOL, &prefix, "prefix cache", NULL},
        {"verbose", PD_FLAG_BOOL, &verbose, "talk more", NULL},
        {"kv-cache-memory", PD_FLAG_SIZE, &mem, "KV budget", NULL},
        {"kv-transfer-mode", PD_FLAG_CHOICE, &mode, "transfer mode", "pull|push"},
        {"model", PD_FLAG_STR, &model, "model dir", NULL},
    };
    char *argv[] = {"prog",
                    "--block-size",
                    "32",
                    "--memory-utilization=0.5",
                    "--no-enable-prefix-caching",
                    "--verbose",
                    "--kv-cache-memory",
                    "1.5GiB",
                    "--kv-transfer-mode",
                    "push",
                    "--model",
                    "/m",
                    "rest"};
    int first = 0;
    ck_assert_int_eq(pd_flags_parse(flags, 7, 13, argv, "usage", &first), PD_OK);
    ck_assert_int_eq(block, 32);
    ck_assert_double_eq(util, 0.5);
    ck_assert(!prefix);
    ck_assert(verbose);
    ck_assert_uint_eq(mem, (size_t)(1.5 * 1024 * 1024 * 1024));
    ck_assert_str_eq(mode, "push");
    ck_assert_str_eq(model, "/m");
    ck_assert_int_eq(first, 12);

    char *bad1[] = {"prog", "--block-size", "12x"};
    ck_assert_int_eq(pd_flags_parse(flags, 7, 3, bad1, "usage", NULL), PD_ERR_INVALID_ARG);
    char *bad2[] = {"prog", "--kv-transfer-mode", "teleport"};
    ck_assert_int_eq(pd_flags_parse(flags, 7, 3, bad2, "usage", NULL), PD_ERR_INVALID_ARG);
    char *bad3[] = {"prog", "--nope"};
    ck_assert_int_eq(pd_flags_parse(flags, 7, 2, bad3, "usage", NULL), PD_ERR_INVALID_ARG);
    char *bad4[] = {"prog", "--block-size"};
    ck_assert_int_eq(pd_flags_parse(flags, 7, 2, bad4, "usage", NULL), PD_ERR_INVALID_ARG);
    ck_assert_str_eq(mode, "push");

    size_t sz = 0;
    ck_assert_int_eq(pd_flags_parse_size("64K", &sz), PD_OK);
    ck_assert_uint_eq(sz, 65536);
    ck_assert_int_eq(pd_flags_parse_size("2M", &sz), PD_OK);
    ck_assert_uint_eq(sz, 2u << 20);
    ck_assert_int_eq(pd_flags_parse_size("-1", &sz), PD_ERR_INVALID_ARG);
    ck_assert_int_eq(pd_flags_parse_size("5Q", &sz), PD_ERR_INVALID_ARG);

    /* --help prints the table (with defaults) and asks the caller to exit */
    FILE *saved = stdout;
    char buf[4096] = {0};
    stdout = fmemopen(buf, sizeof(buf) - 1, "w");
    char *help[] = {"prog", "--help"};
    pd_status_t st = pd_flags_parse(flags, 7, 2, help, "usage: prog", NULL);
    fclose(stdout);
    stdout = saved;
    ck_assert_int_eq(st, PD_ERR_CANCELLED);
    ck_assert_ptr_nonnull(strstr(buf, "--block-size VALUE"));
    ck_assert_ptr_nonnull(strstr(buf, "(default: 32)"));
    ck_assert_ptr_nonnull(strstr(buf, "--kv-transfer-mode {pull|push}"));

    /* sections: a group entry titles the flags after it and is no option; a key is never shown */
    const char *key = "s3cr3t";
    pd_flag_t grouped[] = {
        {"Scheduler", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"block-size", PD_FLAG_INT, &block, "tokens per KV block", NULL},
        {"HTTP", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"api-key", PD_FLAG_STR, &key, "the key", NULL},
    };
    char *g1[] = {"prog", "--block-size", "48", "--api-key", "k2"};
    ck_assert_int_eq(pd_flags_parse(grouped, 4, 5, g1, "usage", NULL), PD_OK);
    ck_assert_int_eq(block, 48);
    ck_assert_str_eq(key, "k2");
    char *g2[] = {"prog", "--Scheduler"};
    ck_assert_int_eq(pd_flags_parse(grouped, 4, 2, g2, "usage", NULL), PD_ERR_INVALID_ARG);
    memset(buf, 0, sizeof(buf));
    stdout = fmemopen(buf, sizeof(buf) - 1, "w");
    st = pd_flags_parse(grouped, 4, 2, help, "usage: prog", NULL);
    fclose(stdout);
    stdout = saved;
    ck_assert_int_eq(st, PD_ERR_CANCELLED);
    ck_assert_msg(strstr(buf, "usage: prog\n\nScheduler:\n  --block-size VALUE") != NULL, "%s", buf);
    ck_assert_msg(strstr(buf, "\nHTTP:\n  --api-key VALUE") != NULL, "%s", buf);
    ck_assert_msg(strstr(buf, "k2") == NULL && strstr(buf, "(set, not shown)") != NULL, "%s", buf);
}
END_TEST

START_TEST(test_rng)
{
    pd_rng_t a, b;
    pd_rng_seed(&a, 1234);
    pd_rng_seed(&b, 1234);
    for (int i = 0; i < 100; i++) {
        ck_assert_uint_eq(pd_rng_next(&a), pd_rng_next(&b));
    }
    double sum = 0, sum2 = 0;
    int below[10] = {0};
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        double u = pd_rng_uniform(&a);
        ck_assert(u >= 0.0 && u < 1.0);
        sum += u;
        double z = pd_rng_normal(&a);
        sum2 += z * z;
        below[pd_rng_below(&a, 10)]++;
    }
    ck_assert(sum / n > 0.49 && sum / n < 0.51);
    ck_assert(sum2 / n > 0.97 && sum2 / n < 1.03);
    for (int i = 0; i < 10; i++) {
        ck_assert(below[i] > n / 10 - 600 && below[i] < n / 10 + 600);
    }
}
END_TEST

START_TEST(test_time_monotonic)
{
    uint64_t t0 = pd_time_now_ns();
    usleep(2000);
    uint64_t t1 = pd_time_now_ns();
    ck_assert_uint_gt(t1, t0 + 1000000);
}
END_TEST

static void hex(const uint8_t *d, size_t n, char *out)
{
    for (size_t i = 0; i < n; i++) {
        sprintf(out + 2 * i, "%02x", d[i]);
    }
}

START_TEST(test_sha256_hmac_vectors)
{
    uint8_t d[32];
    char h[65];
    pd_sha256("abc", 3, d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    pd_sha256("", 0, d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    pd_sha256(two, strlen(two), d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* streaming in odd pieces equals one shot */
    pd_sha256_t s;
    pd_sha256_init(&s);
    for (size_t i = 0; i < strlen(two); i += 7) {
        pd_sha256_update(&s, two + i, strlen(two) - i < 7 ? strlen(two) - i : 7);
    }
    uint8_t d2[32];
    pd_sha256_final(&s, d2);
    ck_assert(pd_ct_equal(d, d2, 32));
    /* RFC 4231 test cases 1 and 2 */
    uint8_t key1[20];
    memset(key1, 0x0b, 20);
    pd_hmac_sha256(key1, 20, "Hi There", 8, d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    pd_hmac_sha256("Jefe", 4, "what do ya want for nothing?", 28, d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    /* RFC 4231 case 6: a key longer than the block is hashed first */
    uint8_t key6[131];
    memset(key6, 0xaa, sizeof(key6));
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    pd_hmac_sha256(key6, sizeof(key6), m6, strlen(m6), d);
    hex(d, 32, h);
    ck_assert_str_eq(h, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    ck_assert(!pd_ct_equal(d, d2, 32));
}
END_TEST

/* pd_huge_alloc: big buffers 2 MiB-aligned (advised to huge pages), small ones at the alignment
 * asked; all usable and freed with free(). Whether the kernel then backs the big one with a huge
 * page depends on its THP mode and free memory: printed, not asserted. */
START_TEST(test_huge_alloc)
{
    size_t big = 2 * PD_HUGE_PAGE;
    uint8_t *p = pd_huge_alloc(big, 64), *q = pd_huge_alloc(100, 4096), *z = pd_huge_alloc(0, 64);
    ck_assert_ptr_nonnull(p);
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_nonnull(z);
    ck_assert_uint_eq((uintptr_t)p % PD_HUGE_PAGE, 0);
    ck_assert_uint_eq((uintptr_t)q % 4096, 0);
    memset(p, 0x5a, big);
    memset(q, 0xa5, 100);
    ck_assert_uint_eq(p[big - 1], 0x5a);
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    bool in = false;
    long huge_kb = -1;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = lo <= (uintptr_t)p && (uintptr_t)p < hi;
        } else if (in && sscanf(line, "AnonHugePages: %ld kB", &huge_kb) == 1) {
            in = false;
        }
    }
    if (f != NULL) {
        fclose(f);
    }
    printf("test_huge_alloc: a %zu MiB buffer is backed by %ld kB of huge pages (kernel THP mode and "
           "free memory decide)\n",
           big >> 20, huge_kb);
    free(p), free(q), free(z);
}
END_TEST

/* pd_copy_stream against its reference, memcpy: every destination and source alignment within
 * a 32-byte line, lengths on both sides of the small-copy cut (256) and of the 128-byte body
 * unit; guard bytes on both sides of the destination must stay untouched. */
START_TEST(test_copy_stream)
{
    enum { GUARD = 64, MAX = 70000 };
    static const size_t lens[] = {0, 1, 31, 127, 255, 256, 257, 383, 384, 4095, 16384, 16384 + 31, 65537};
    uint8_t *src = malloc(MAX + 64), *dst = malloc(MAX + 2 * GUARD + 64),
            *want = malloc(MAX + 2 * GUARD + 64);
    ck_assert(src != NULL && dst != NULL && want != NULL);
    pd_rng_t rng;
    pd_rng_seed(&rng, 7);
    for (size_t i = 0; i < MAX + 64; i++) {
        src[i] = (uint8_t)pd_rng_next(&rng);
    }
    int checked = 0;
    static const char *kinds[] = {"sse2", "memcpy", "avx2"}; /* avx2 last: it is the default here */
    for (size_t ki = 0; ki < 3; ki++) {
        if (pd_copy_stream_select(kinds[ki]) != 0) {
            ck_assert_str_ne(kinds[ki], "memcpy"); /* every CPU has the reference */
            continue;
        }
        for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
            for (size_t da = 0; da < 33; da += 3) {
                for (size_t sa = 0; sa < 33; sa += 5) {
                    size_t n = lens[li];
                    memset(dst, 0xa5, MAX + 2 * GUARD + 64);
                    memset(want, 0xa5, MAX + 2 * GUARD + 64);
                    pd_copy_stream(dst + GUARD + da, src + sa, n);
                    memcpy(want + GUARD + da, src + sa, n);
                    if (memcmp(dst, want, MAX + 2 * GUARD + 64) != 0) {
                        ck_abort_msg("pd_copy_stream(%s) differs from memcpy: %zu bytes, dst +%zu, src +%zu",
                                     pd_copy_stream_kind(), n, da, sa);
                    }
                    checked++;
                }
            }
        }
    }
    ck_assert_int_ge(checked, 13 * 11 * 7); /* at least the reference ran */
    ck_assert_int_eq(pd_copy_stream_select("neon-on-x86"), -1);
    free(src), free(dst), free(want);
}
END_TEST

START_TEST(test_metrics_labels)
{
    pd_metrics_t *m = NULL;
    ck_assert_int_eq(pd_metrics_create(&m), PD_OK);
    static const double b[2] = {0.5, 1};
    pd_metric_t *ok = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:request_success_total", "Done.",
                                     "finished_reason=stop", NULL, 0);
    pd_metric_t *own = pd_metrics_add(m, PD_METRIC_GAUGE, "pd:kv_peers", "Peers.", NULL, NULL, 0);
    pd_metric_t *h =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "vllm:e2e_request_latency_seconds", "E2e.", NULL, b, 2);
    pd_metric_t *ab = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:request_success_total", "Done.",
                                     "finished_reason=abort", NULL, 0);
    ck_assert_ptr_nonnull(ok);
    ck_assert_ptr_nonnull(own);
    ck_assert_ptr_nonnull(h);
    ck_assert_ptr_nonnull(ab);
    pd_metric_label_t bad[1] = {{"9x", "v"}};
    ck_assert_ptr_null(pd_metrics_add_labels(m, PD_METRIC_GAUGE, "x", "X.", bad, 1, NULL, 0));
    /* the model name is set after the series exist; quotes and backslashes are escaped */
    pd_metric_label_t k[2] = {{"model_name", "org/m \"q\"\\"}, {"engine", "0"}};
    ck_assert_int_eq(pd_metrics_set_const_labels(m, "vllm:", k, 2), PD_OK);
    pd_metric_inc(ok, 3), pd_metric_inc(ab, 2), pd_metric_set(own, 4), pd_metric_observe(h, 0.7);
    size_t len = 0;
    char *t = pd_metrics_render(m, &len);
    ck_assert_ptr_nonnull(t);
    const char *want = "# HELP vllm:request_success_total Done.\n# TYPE vllm:request_success_total counter\n"
                       "vllm:request_success_total{model_name=\"org/m "
                       "\\\"q\\\"\\\\\",engine=\"0\",finished_reason=\"stop\"} 3\n"
                       "vllm:request_success_total{model_name=\"org/m "
                       "\\\"q\\\"\\\\\",engine=\"0\",finished_reason=\"abort\"} 2\n"
                       "# HELP pd:kv_peers Peers.\n# TYPE pd:kv_peers gauge\npd:kv_peers 4\n";
    ck_assert_msg(strncmp(t, want, strlen(want)) == 0, "rendered:\n%s", t);
    ck_assert_ptr_nonnull(strstr(t,
                                 "vllm:e2e_request_latency_seconds_bucket{model_name=\"org/m \\\"q\\\"\\\\\","
                                 "engine=\"0\",le=\"1\"} 1\n"));
    /* look-ups: a name sums every series, labels given select a subset */
    ck_assert(pd_metrics_text_value(t, "vllm:request_success_total", -1) == 5);
    ck_assert(pd_metrics_text_value(t, "vllm:request_success_total{finished_reason=\"abort\"}", -1) == 2);
    ck_assert(pd_metrics_text_value(t, "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"}",
                                    -1) == 3);
    ck_assert(pd_metrics_text_value(t, "vllm:request_success_total{finished_reason=\"ab\"}", -1) == -1);
    ck_assert(pd_metrics_text_value(t, "vllm:request_success", -1) == -1);
    ck_assert(pd_metrics_text_value(t, "pd:kv_peers", -1) == 4);
    ck_assert(pd_metrics_text_value(t, "vllm:e2e_request_latency_seconds_count", -1) == 1);
    ck_assert(pd_metrics_text_value(t, "vllm:e2e_request_latency_seconds_bucket{le=\"0.5\"}", -1) == 0);
    free(t);
    double b125[16];
    int n = pd_metrics_buckets_125(2048, b125, 16);
    ck_assert_int_eq(n, 11); /* 1 2 5 10 20 50 100 200 500 1000 2000 */
    ck_assert(b125[0] == 1 && b125[2] == 5 && b125[10] == 2000);
    pd_metrics_destroy(m);
}
END_TEST

/* ------------------------------------------------------------------ failing allocations */

/* The allocating pieces of common/ from nothing back to nothing with any allocation failing
 * (fail_alloc.h): a metrics registry with labelled series rendered, a string map grown past its
 * first table, an arena, a grown array, a JSON document read through the path getters, and a
 * flag table parsed. Each step either works, and then answers right, or returns its error. */
static int fa_common(void)
{
    int wrong = 0;
    pd_metrics_t *m = NULL;
    if (pd_metrics_create(&m) == PD_OK) {
        pd_metric_label_t lab[2] = {{"model_name", "m\"1"}, {"engine", "0"}};
        if (pd_metrics_set_const_labels(m, "vllm:", lab, 2) != PD_OK) {
            /* a clean error: the series render without them */
        }
        double b[3] = {0.1, 1, 10};
        pd_metric_t *c = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:requests", "requests", "kind=a", NULL, 0);
        pd_metric_t *h = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:latency", "latency", NULL, b, 3);
        pd_metric_label_t two[2] = {{"a", "1"}, {"b", "2"}};
        pd_metric_t *g = pd_metrics_add_labels(m, PD_METRIC_GAUGE, "pd:g", "gauge", two, 2, NULL, 0);
        pd_metric_inc(c, 2), pd_metric_observe(h, 0.5), pd_metric_set(g, 7);
        size_t len = 0;
        char *text = pd_metrics_render(m, &len);
        if (text != NULL && c != NULL && pd_metrics_text_value(text, "vllm:requests", -1) != 2) {
            fprintf(stderr, "fa_common: rendered counter wrong:\n%s\n", text);
            wrong++;
        }
        if (text != NULL && g != NULL && pd_metrics_text_value(text, "pd:g{a=\"1\"}", -1) != 7) {
            fprintf(stderr, "fa_common: rendered gauge wrong:\n%s\n", text);
            wrong++;
        }
        free(text);
        pd_metrics_destroy(m);
    }
    pd_strmap_t map;
    if (pd_strmap_init(&map, 4) == PD_OK) {
        char key[32];
        int put = 0;
        for (int i = 0; i < 100; i++) {
            snprintf(key, sizeof(key), "key-%d", i);
            put += pd_strmap_put(&map, key, strlen(key), i) == PD_OK;
        }
        for (int i = 0; i < 100 && put == 100; i++) {
            int64_t v = -1;
            snprintf(key, sizeof(key), "key-%d", i);
            if (!pd_strmap_get(&map, key, strlen(key), &v) || v != i) {
                fprintf(stderr, "fa_common: strmap lost %s\n", key);
                wrong++;
            }
        }
        pd_strmap_destroy(&map);
    }
    pd_arena_t ar;
    pd_arena_init(&ar, 256);
    for (int i = 0; i < 20; i++) {
        char *t = pd_arena_strndup(&ar, "arena text", 10);
        if (t != NULL && strcmp(t, "arena text") != 0) {
            wrong++;
        }
    }
    pd_arena_destroy(&ar);
    int *arr = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < 1000; i++) {
        if (pd_array_reserve(&arr, &cap, i + 1) != PD_OK) {
            break;
        }
        arr[i] = (int)i;
    }
    free(arr);
    json_t *root = NULL;
    const char *doc = "{\"a\": {\"b\": [1, 2, {\"c\": \"x\"}]}, \"n\": 2.5}";
    if (pd_json_parse("doc", doc, strlen(doc), &root) == PD_OK) {
        const char *str = NULL;
        double n = 0;
        if (pd_json_get_str(root, "doc", "a.b[2].c", &str) == PD_OK && strcmp(str, "x") != 0) {
            wrong++;
        }
        if (pd_json_get_double(root, "doc", "n", &n) == PD_OK && n != 2.5) {
            wrong++;
        }
        json_decref(root);
    }
    int block = 16;
    const char *model = NULL;
    pd_flag_t flags[] = {{"block-size", PD_FLAG_INT, &block, "tokens per KV block", NULL},
                         {"model", PD_FLAG_STR, &model, "model dir", NULL}};
    char *argv[] = {"prog", "--block-size", "32", "--model", "/m"};
    if (pd_flags_parse(flags, 2, 5, argv, "usage", NULL) == PD_OK &&
        (block != 32 || strcmp(model, "/m") != 0)) {
        wrong++;
    }
    return wrong;
}

static const tu_fa_scenario_t FA_SCENARIOS[] = {{"common", fa_common, NULL}};

START_TEST(test_fail_alloc)
{
    tu_fail_alloc_loop("common", 2000, 30);
}
END_TEST

int main(void)
{
    tu_fail_alloc_child(FA_SCENARIOS, 1);
    Suite *s = suite_create("common");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_status_names);
    tcase_add_test(tc, test_log_level_parse);
    tcase_add_test(tc, test_hash_chain);
    tcase_add_test(tc, test_checksum_variants);
    tcase_add_test(tc, test_key_map);
    tcase_add_test(tc, test_arena);
    tcase_add_test(tc, test_list);
    tcase_add_test(tc, test_array_reserve);
    tcase_add_test(tc, test_strmap);
    tcase_add_test(tc, test_json_getters);
    tcase_add_test(tc, test_json_file_limits);
    tcase_add_test(tc, test_flags);
    tcase_add_test(tc, test_rng);
    tcase_add_test(tc, test_time_monotonic);
    tcase_add_test(tc, test_sha256_hmac_vectors);
    tcase_add_test(tc, test_copy_stream);
    tcase_add_test(tc, test_huge_alloc);
    tcase_add_test(tc, test_metrics_labels);
    suite_add_tcase(s, tc);
    tu_fail_alloc_add(s, test_fail_alloc, 1);
    return tu_run_suite(s);
}
