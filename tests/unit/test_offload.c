/* tests/unit/test_offload.c — the KV offload tier (engine/kv_offload.h): a block saved comes back
 * byte for byte from memory and from a file, the least recently used block makes room, a corrupt or
 * torn slot is refused and dropped, a reopened file keeps its blocks (another model's does not), two
 * processes never share a file; and in the engine: a prefix the pool evicted is loaded from the tier
 * instead of recomputed, with outputs identical to an engine without a tier (greedy and seeded), the
 * pool's accounting whole, and a corrupted tier file costing a recompute, never a wrong answer. */
#include "test_util.h"

#include <check.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "common/rng.h"
#include "engine/engine.h"
#include "engine/kv_offload.h"
#include "kernels/backend.h"
#include "scheduler/block_pool.h"

#include "engine_driver.h"

#include "fail_alloc.h"

static char *g_model;
static char *g_dir; /* files of the disk tiers */

/* ------------------------------------------------------------------ the tier on a fake region */

enum { T = 3, PAGE = 1000, NB = 8 };

typedef struct region {
    uint8_t *base;
    pd_kv_offload_config_t cfg;
} region_t;

static void region_init(region_t *r, pd_kv_offload_medium_t medium, size_t slots, const char *file)
{
    r->base = calloc(T * PAGE, NB); /* tensor t at t × NB × PAGE */
    memset(&r->cfg, 0, sizeof(r->cfg));
    r->cfg.medium = medium;
    r->cfg.size_bytes = slots * 4096; /* 3000 bytes + a 64-byte header: one 4096-byte slot */
    static char path[512];
    snprintf(path, sizeof(path), "%s/%s", g_dir, file);
    r->cfg.path = path;
    r->cfg.fingerprint = 0x1234;
    r->cfg.base = r->base;
    r->cfg.num_tensors = T;
    r->cfg.page_bytes = PAGE;
    r->cfg.num_blocks = NB;
    for (int t = 0; t < T; t++) {
        r->cfg.tensor_offset[t] = (size_t)t * NB * PAGE;
    }
}

static uint8_t *page(region_t *r, int t, uint32_t block)
{
    return r->base + r->cfg.tensor_offset[t] + (size_t)block * PAGE;
}

static void fill(region_t *r, uint32_t block, uint8_t v)
{
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < PAGE; i++) {
            page(r, t, block)[i] = (uint8_t)(v + t * 7 + i);
        }
    }
}

static bool holds(region_t *r, uint32_t block, uint8_t v)
{
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < PAGE; i++) {
            if (page(r, t, block)[i] != (uint8_t)(v + t * 7 + i)) {
                return false;
            }
        }
    }
    return true;
}

static pd_hash128_t key(int i)
{
    return (pd_hash128_t){0x9e37u * (uint64_t)(i + 1), (uint64_t)i};
}

/* A device KV's tier (cfg.device): the CPU backend stands in for the device, its gather_pages /
 * scatter_pages counted, so the same cases run through the backend's page copies. */
static pd_backend_t *g_dev;
static pd_backend_ops_t g_dev_ops;
static const pd_backend_ops_t *g_cpu_ops;
static int g_gathers, g_scatters;

static pd_status_t count_gather(pd_backend_t *be, void *dst, const void *region, const pd_page_range_t *r,
                                int n)
{
    g_gathers++;
    return g_cpu_ops->gather_pages(be, dst, region, r, n);
}

static pd_status_t count_scatter(pd_backend_t *be, void *region, const void *src, const pd_page_range_t *r,
                                 int n)
{
    g_scatters++;
    return g_cpu_ops->scatter_pages(be, region, src, r, n);
}

static pd_backend_t *device(void)
{
    if (g_dev == NULL) {
        ck_assert_int_eq(pd_backend_create("cpu", 1, &g_dev), PD_OK);
        g_cpu_ops = g_dev->ops;
        g_dev_ops = *g_dev->ops;
        g_dev_ops.gather_pages = count_gather;
        g_dev_ops.scatter_pages = count_scatter;
        g_dev->ops = &g_dev_ops;
    }
    g_gathers = g_scatters = 0;
    return g_dev;
}

static void round_trip_and_lru(pd_kv_offload_medium_t medium, pd_backend_t *dev)
{
    region_t r;
    region_init(&r, medium, 3, "lru.kv");
    r.cfg.device = dev;
    unlink(r.cfg.path);
    pd_kv_offload_t *o = NULL;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    pd_kv_offload_stats_t st;
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.num_slots, 3);
    ck_assert_uint_eq(st.slot_bytes, 4096);
    for (int i = 0; i < 3; i++) {
        fill(&r, 1 + (uint32_t)i, (uint8_t)(10 * i));
        ck_assert_int_eq(pd_kv_offload_save(o, key(i), 1 + (uint32_t)i), PD_OK);
    }
    ck_assert_int_eq(pd_kv_offload_save(o, key(0), 1), PD_OK); /* held: only used again (0 is newest) */
    memset(r.base, 0, (size_t)T * PAGE * NB);
    ck_assert_int_eq(pd_kv_offload_load(o, key(1), 5), PD_OK);
    ck_assert(holds(&r, 5, 10));
    ck_assert(!holds(&r, 6, 10));
    /* full: a fourth block evicts the least recently used, key 2 (0 saved again, 1 loaded) */
    fill(&r, 7, 77);
    ck_assert_int_eq(pd_kv_offload_save(o, key(3), 7), PD_OK);
    ck_assert(!pd_kv_offload_contains(o, key(2)));
    ck_assert(pd_kv_offload_contains(o, key(0)) && pd_kv_offload_contains(o, key(1)));
    ck_assert_int_eq(pd_kv_offload_load(o, key(2), 5), PD_ERR_NOT_FOUND);
    ck_assert_int_eq(pd_kv_offload_load(o, key(0), 6), PD_OK);
    ck_assert(holds(&r, 6, 0));
    ck_assert_int_eq(pd_kv_offload_load(o, key(3), 4), PD_OK);
    ck_assert(holds(&r, 4, 77));
    ck_assert_int_eq(pd_kv_offload_save(o, key(9), 0), PD_ERR_OUT_OF_RANGE);  /* the null block */
    ck_assert_int_eq(pd_kv_offload_load(o, key(0), NB), PD_ERR_OUT_OF_RANGE); /* outside the pool */
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.saved, 4);
    ck_assert_uint_eq(st.already, 1);
    ck_assert_uint_eq(st.loaded, 3);
    ck_assert_uint_eq(st.evicted, 1);
    ck_assert_uint_eq(st.used_slots, 3);
    ck_assert_uint_eq(st.bytes_written, 4 * T * PAGE);
    if (dev != NULL) { /* every save and load went through the backend */
        ck_assert_int_eq(g_gathers, 4);
        ck_assert_int_eq(g_scatters, 3);
    }
    pd_kv_offload_destroy(o);
    free(r.base);
    unlink(r.cfg.path);
}

/* A load's pin keeps its slot: no save reuses it (a save with every slot pinned is skipped), a failed
 * read drops it from the index at once but frees it only at its last unpin. */
static void pins(pd_kv_offload_medium_t medium, pd_backend_t *dev)
{
    region_t r;
    region_init(&r, medium, 2, "pins.kv");
    r.cfg.device = dev;
    unlink(r.cfg.path);
    pd_kv_offload_t *o = NULL;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    fill(&r, 1, 10);
    fill(&r, 2, 20);
    ck_assert_int_eq(pd_kv_offload_save(o, key(0), 1), PD_OK);
    ck_assert_int_eq(pd_kv_offload_save(o, key(1), 2), PD_OK);
    uint32_t s0 = pd_kv_offload_pin(o, key(0));
    ck_assert_uint_ne(s0, PD_KV_OFFLOAD_NO_SLOT);
    ck_assert_uint_eq(pd_kv_offload_pin(o, key(7)), PD_KV_OFFLOAD_NO_SLOT);
    /* key 0 is the least recently used, but pinned: key 2 takes key 1's slot */
    fill(&r, 3, 30);
    ck_assert_int_eq(pd_kv_offload_save(o, key(2), 3), PD_OK);
    ck_assert(pd_kv_offload_contains(o, key(0)) && !pd_kv_offload_contains(o, key(1)));
    uint32_t s2 = pd_kv_offload_pin(o, key(2));
    fill(&r, 4, 40);
    ck_assert_int_eq(pd_kv_offload_save(o, key(3), 4), PD_ERR_CANCELLED); /* every slot pinned */
    ck_assert(!pd_kv_offload_contains(o, key(3)));
    ck_assert_int_eq(pd_kv_offload_save(o, key(0), 1), PD_OK); /* held: only counted */
    memset(r.base, 0, (size_t)T * PAGE * NB);
    ck_assert_int_eq(pd_kv_offload_read(o, s0, key(0), 5), PD_OK);
    ck_assert(holds(&r, 5, 10));
    pd_kv_offload_unpin(o, s0, PD_OK, 0.001);
    /* a read under another key fails its header check: dropped from the index now, its slot
     * kept while a second pin holds it */
    ck_assert_uint_eq(pd_kv_offload_pin(o, key(2)), s2);
    ck_assert_int_eq(pd_kv_offload_read(o, s2, key(5), 6), PD_ERR_PARSE);
    pd_kv_offload_unpin(o, s2, PD_ERR_PARSE, 0.001);
    ck_assert(!pd_kv_offload_contains(o, key(2)));
    ck_assert_uint_eq(pd_kv_offload_pin(o, key(2)), PD_KV_OFFLOAD_NO_SLOT);
    pd_kv_offload_stats_t st;
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.used_slots, 2);
    pd_kv_offload_unpin(o, s2, PD_ERR_CANCELLED, 0); /* the last pin: the slot is free */
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.used_slots, 1);
    fill(&r, 4, 40);
    ck_assert_int_eq(pd_kv_offload_save(o, key(3), 4), PD_OK); /* into the freed slot, no eviction */
    memset(r.base, 0, (size_t)T * PAGE * NB);
    ck_assert_int_eq(pd_kv_offload_load(o, key(3), 6), PD_OK);
    ck_assert(holds(&r, 6, 40));
    ck_assert_int_eq(pd_kv_offload_load(o, key(0), 5), PD_OK); /* key 0 back in the LRU, unharmed */
    ck_assert(holds(&r, 5, 10));
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.skipped, 1);
    ck_assert_uint_eq(st.evicted, 1);
    ck_assert_uint_eq(st.corrupt, 1);
    ck_assert_uint_eq(st.loaded, 3);
    ck_assert_uint_eq(st.already, 1);
    pd_kv_offload_destroy(o);
    free(r.base);
    unlink(r.cfg.path);
}

START_TEST(test_host_pins)
{
    pins(PD_KV_OFFLOAD_HOST, NULL);
}
END_TEST

START_TEST(test_disk_pins)
{
    pins(PD_KV_OFFLOAD_DISK, NULL);
}
END_TEST

START_TEST(test_host_round_trip_and_lru)
{
    round_trip_and_lru(PD_KV_OFFLOAD_HOST, NULL);
}
END_TEST

/* A device KV's host tier: the same cases through the backend's page copies (a read under another
 * key is still refused: the header is checked on the CPU); a disk tier behind it is refused. */
START_TEST(test_device_host_tier)
{
    round_trip_and_lru(PD_KV_OFFLOAD_HOST, device());
    pins(PD_KV_OFFLOAD_HOST, device());
    ck_assert_int_gt(g_gathers, 0);
    ck_assert_int_gt(g_scatters, 0);
    region_t r;
    region_init(&r, PD_KV_OFFLOAD_DISK, 4, "device.kv");
    r.cfg.device = device();
    pd_kv_offload_t *o = NULL;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_ERR_UNSUPPORTED);
    ck_assert_ptr_null(o);
    free(r.base);
    g_dev->ops = g_cpu_ops;
    pd_backend_destroy(g_dev);
    g_dev = NULL;
}
END_TEST

START_TEST(test_disk_round_trip_and_lru)
{
    round_trip_and_lru(PD_KV_OFFLOAD_DISK, NULL);
}
END_TEST

/* Overwrites one byte of the file at off. */
static void poke(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint8_t b;
    ck_assert_int_eq(pread(fd, &b, 1, off), 1);
    b ^= 0x5a;
    ck_assert_int_eq(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

START_TEST(test_disk_checksums_and_restart)
{
    region_t r;
    region_init(&r, PD_KV_OFFLOAD_DISK, 4, "restart.kv");
    unlink(r.cfg.path);
    pd_kv_offload_t *o = NULL;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    for (int i = 0; i < 4; i++) {
        fill(&r, 1 + (uint32_t)i, (uint8_t)(3 * i + 1));
        ck_assert_int_eq(pd_kv_offload_save(o, key(i), 1 + (uint32_t)i), PD_OK);
    }
    /* a second process cannot open the file while this one has it */
    pid_t pid = fork();
    if (pid == 0) {
        pd_kv_offload_t *o2 = NULL;
        _exit(pd_kv_offload_create(&r.cfg, &o2) == PD_ERR_IO ? 0 : 1);
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pd_kv_offload_destroy(o);

    /* reopened: every block is there, in the same LRU order; slot 1's data and slot 2's header are
     * then corrupted (a torn write, a bit flip) */
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    pd_kv_offload_stats_t st;
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.kept, 4);
    for (int i = 0; i < 4; i++) {
        ck_assert(pd_kv_offload_contains(o, key(i)));
    }
    poke(r.cfg.path, 4096 + 1 * 4096 + 2500);     /* slot 1: a byte of its third page */
    poke(r.cfg.path, 4096 + 2 * 4096 + 3000 + 8); /* slot 2: its header's fingerprint */
    memset(r.base, 0, (size_t)T * PAGE * NB);
    ck_assert_int_eq(pd_kv_offload_load(o, key(0), 5), PD_OK);
    ck_assert(holds(&r, 5, 1));
    ck_assert_int_eq(pd_kv_offload_load(o, key(1), 5), PD_ERR_PARSE);
    ck_assert(!pd_kv_offload_contains(o, key(1))); /* dropped */
    ck_assert_int_eq(pd_kv_offload_load(o, key(2), 5), PD_ERR_PARSE);
    ck_assert_int_eq(pd_kv_offload_load(o, key(3), 6), PD_OK);
    ck_assert(holds(&r, 6, 10));
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.corrupt, 2);
    ck_assert_uint_eq(st.used_slots, 2);
    /* the freed slots take new blocks before anything is evicted */
    fill(&r, 7, 99);
    ck_assert_int_eq(pd_kv_offload_save(o, key(8), 7), PD_OK);
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.evicted, 0);
    pd_kv_offload_destroy(o);

    /* a restart with a bad header skips that slot; another model's file starts empty */
    poke(r.cfg.path, 4096 + 0 * 4096 + 3000 + 60);
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    ck_assert(!pd_kv_offload_contains(o, key(0)));
    ck_assert(pd_kv_offload_contains(o, key(3)) && pd_kv_offload_contains(o, key(8)));
    pd_kv_offload_destroy(o);
    r.cfg.fingerprint = 0x4321;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_OK);
    pd_kv_offload_get_stats(o, &st);
    ck_assert_uint_eq(st.kept, 0);
    ck_assert(!pd_kv_offload_contains(o, key(3)));
    pd_kv_offload_destroy(o);
    free(r.base);
    unlink(r.cfg.path);
}
END_TEST

START_TEST(test_bad_configs)
{
    region_t r;
    region_init(&r, PD_KV_OFFLOAD_HOST, 0, "none.kv");
    pd_kv_offload_t *o = NULL;
    r.cfg.size_bytes = 4095; /* under one slot */
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_ERR_INVALID_ARG);
    r.cfg.size_bytes = 1 << 20;
    r.cfg.medium = PD_KV_OFFLOAD_DISK;
    r.cfg.path = NULL;
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_ERR_INVALID_ARG);
    r.cfg.path = "/nonexistent-dir/x.kv";
    ck_assert_int_eq(pd_kv_offload_create(&r.cfg, &o), PD_ERR_IO);
    ck_assert_ptr_null(o);
    free(r.base);
}
END_TEST

/* ------------------------------------------------------------------ the engine */

typedef struct prompt {
    int32_t ids[120];
    int32_t n;
} prompt_t;

static bool g_invariant;    /* the engines' --batch-invariant */
static const char *g_load;  /* their --kv-offload-load */
static double g_read_delay; /* their tier reads' added time */

static pd_engine_t *make_engine(int num_blocks, const char *tier, const char *path)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 2;
    c.kv_cache_memory = 256u << 20;
    c.max_num_batched_tokens = 256;
    c.max_num_seqs = 4;
    c.max_model_len = 128;
    c.num_blocks_override = num_blocks;
    c.kv_offload_tier = tier;
    c.kv_offload_size = 4u << 20;
    c.kv_offload_path = path;
    c.batch_invariant = g_invariant;
    c.kv_offload_load = g_load != NULL ? g_load : "auto";
    c.kv_offload_read_delay = g_read_delay;
    pd_engine_t *e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_OK);
    return e;
}

static void submit(pd_engine_t *e, const prompt_t *p, int i, float temperature, gen_t *g)
{
    char id[32], err[256];
    snprintf(id, sizeof(id), "r%d", i);
    memset(g, 0, sizeof(*g));
    pd_engine_request_t rq;
    memset(&rq, 0, sizeof(rq));
    rq.id = id;
    rq.prompt = p->ids;
    rq.num_prompt = p->n;
    rq.params.max_tokens = 12;
    rq.params.ignore_eos = true;
    rq.params.sampling = (pd_sampling_params_t){temperature, 0, 1.0f, 0.0f};
    rq.params.has_seed = true;
    rq.params.seed = 77 + (uint64_t)i;
    rq.user = g;
    ck_assert_msg(pd_engine_add(e, &rq, err, sizeof(err)) == PD_OK, "%s", err);
}

static void run(pd_engine_t *e, const prompt_t *p, int i, float temperature, gen_t *g)
{
    submit(e, p, i, temperature, g);
    tu_engine_run_until_idle(e, 5000);
    ck_assert_str_eq(g->finish, "length");
}

static void assert_same(const gen_t *a, const gen_t *b, const char *what)
{
    ck_assert_msg(a->n == b->n, "%s: %d vs %d tokens", what, a->n, b->n);
    for (int k = 0; k < a->n; k++) {
        ck_assert_msg(a->tokens[k] == b->tokens[k], "%s: token %d: %d vs %d", what, k, a->tokens[k],
                      b->tokens[k]);
    }
}

/* Prompts A, B, C of 113 tokens (7 full blocks + 1) in a pool of 12 usable blocks: each evicts the
 * one before, so A's second turn (A + its reply + a question) finds its prefix only in the tier. */
static void turns(pd_engine_t *e, prompt_t *p, float temperature, gen_t *out /* [4] */)
{
    for (int i = 0; i < 3; i++) {
        run(e, &p[i], i, temperature, &out[i]);
    }
    prompt_t next = p[0];
    for (int k = 0; k < out[0].n && next.n < 120; k++) {
        next.ids[next.n++] = out[0].tokens[k];
    }
    run(e, &next, 3, temperature, &out[3]);
}

static void make_prompts(prompt_t *p, int vocab)
{
    pd_rng_t r;
    pd_rng_seed(&r, 99);
    for (int i = 0; i < 3; i++) {
        p[i].n = 100;
        for (int k = 0; k < p[i].n; k++) {
            p[i].ids[k] = (int32_t)pd_rng_below(&r, (uint64_t)vocab - 2);
        }
    }
}

static void engine_tier(const char *tier, float temperature)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/engine.kv", g_dir);
    unlink(path);
    pd_engine_t *plain = make_engine(13, "none", NULL);
    prompt_t p[3];
    make_prompts(p, pd_engine_model_config(plain)->vocab_size);
    gen_t ref[4], got[4];
    turns(plain, p, temperature, ref);
    ck_assert_int_eq(ref[3].cached, 0); /* the pool alone lost A */
    tu_engine_assert_pool_free(plain);
    pd_engine_destroy(plain);

    pd_engine_t *e = make_engine(13, tier, path);
    turns(e, p, temperature, got);
    for (int i = 0; i < 4; i++) {
        assert_same(&got[i], &ref[i], "tier vs none");
    }
    ck_assert_int_eq(got[3].cached, 6 * 16); /* A's 6 full prompt blocks, from the tier */
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert(st.offload);
    ck_assert_uint_eq(st.offload_hits, 6);
    ck_assert_uint_ge(st.offload_saved, 6);
    ck_assert_uint_eq(st.offload_corrupt, 0);
    ck_assert_uint_eq(st.prefix_hits, 6 * 16);
    tu_engine_assert_pool_free(e);
    ck_assert_int_eq(pd_block_pool_check(pd_engine_block_pool(e)), PD_OK);
    pd_engine_destroy(e);
    if (strcmp(tier, "disk") != 0) {
        return;
    }
    /* a restarted node keeps its file: A's next turn loads from it at once; then every slot's data
     * is corrupted and the same turn is recomputed, still identical */
    e = make_engine(13, tier, path);
    run(e, &p[0], 0, temperature, &got[0]);
    assert_same(&got[0], &ref[0], "restart");
    ck_assert_int_eq(got[0].cached, 6 * 16);
    pd_engine_destroy(e);
    /* a node with --batch-invariant computes other last bits: it does not take this file's blocks
     * (the file is put back after it for the rest) */
    size_t keep_len = 0;
    uint8_t *keep = tu_read_file(path, &keep_len);
    ck_assert_ptr_nonnull(keep);
    g_invariant = true;
    e = make_engine(13, tier, path);
    run(e, &p[0], 0, temperature, &got[0]);
    ck_assert_int_eq(got[0].cached, 0);
    pd_engine_destroy(e);
    g_invariant = false;
    ck_assert_int_eq(tu_write_file(path, keep, keep_len), 0);
    free(keep);
    size_t len = 0;
    uint8_t *f = tu_read_file(path, &len);
    ck_assert_ptr_nonnull(f);
    for (size_t off = 4096 + 64; off < len; off += 4096) {
        f[off] ^= 0xff; /* 64 bytes into each 4 KiB of the slots: every slot's first page is hit (its
                         * header sits at 8192 of a 12288-byte slot, untouched) */
    }
    ck_assert_int_eq(tu_write_file(path, f, len), 0);
    free(f);
    e = make_engine(13, tier, path);
    run(e, &p[0], 0, temperature, &got[0]);
    assert_same(&got[0], &ref[0], "corrupt file");
    ck_assert_int_eq(got[0].cached, 0);
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.offload_corrupt, 1); /* the first block failed: nothing past it was tried */
    tu_engine_assert_pool_free(e);
    pd_engine_destroy(e);
    unlink(path);
}

START_TEST(test_engine_host_tier_greedy)
{
    engine_tier("host", 0.0f); /* loads inline (auto) */
}
END_TEST

START_TEST(test_engine_disk_tier_seeded)
{
    engine_tier("disk", 0.9f); /* loads on the loader thread (auto) */
}
END_TEST

START_TEST(test_engine_host_tier_thread)
{
    g_load = "thread";
    engine_tier("host", 0.9f);
    g_load = NULL;
}
END_TEST

START_TEST(test_engine_disk_tier_inline)
{
    g_load = "inline";
    engine_tier("disk", 0.0f);
    g_load = NULL;
}
END_TEST

/* A load on the loader thread holds up only its own request: with every block's read 100 ms longer
 * (6 blocks), a short request sent after it has 4 tokens before the loaded one has any (inline, both
 * would have their first in the same step; under a loaded machine's slow steps, 4 of them fit), and
 * the loaded one's answer is still the one computed without a tier. A second request for the same
 * prefix waits for that load instead of reading the blocks again. A request aborted while its load
 * runs leaves the load to end: its blocks are cached, the pool's accounting whole. */
START_TEST(test_engine_threaded_load_overlaps_and_aborts)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/overlap.kv", g_dir);
    unlink(path);
    g_load = "thread";
    g_read_delay = 0.1;
    pd_engine_t *e = make_engine(13, "disk", path);
    prompt_t p[3], b = {.n = 12};
    make_prompts(p, pd_engine_model_config(e)->vocab_size);
    for (int k = 0; k < b.n; k++) {
        b.ids[k] = p[1].ids[k] ^ 1;
    }
    gen_t g[3], ga, ga2, gb;
    for (int i = 0; i < 3; i++) { /* A, then B and C: A's blocks go to the tier */
        run(e, &p[i], i, 0.0f, &g[i]);
    }
    submit(e, &p[0], 10, 0.0f, &ga);
    submit(e, &p[0], 14, 0.0f, &ga2);
    submit(e, &b, 11, 0.0f, &gb);
    bool b_first = false;
    for (int steps = 0; pd_engine_has_work(e); steps++) {
        pd_engine_output_t *outs = NULL;
        ck_assert_int_eq(pd_engine_step(e, &outs), PD_OK);
        if (outs == NULL) {
            usleep(200);
        }
        tu_engine_collect(outs);
        pd_engine_output_free(outs);
        b_first = b_first || (gb.n >= 4 && ga.n == 0);
        ck_assert_int_lt(steps, 20000);
    }
    ck_assert_msg(b_first, "the short request waited for the other's tier load");
    ck_assert_str_eq(gb.finish, "length");
    assert_same(&ga, &g[0], "loaded on the thread vs computed");
    assert_same(&ga2, &g[0], "the load's second request");
    ck_assert_int_eq(ga.cached, 6 * 16);
    ck_assert_int_eq(ga2.cached, 6 * 16);
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.offload_hits, 6); /* once, for both */
    tu_engine_assert_pool_free(e);

    run(e, &p[1], 1, 0.0f, &g[1]); /* A's blocks out of the pool again (the tier still holds them) */
    run(e, &p[2], 2, 0.0f, &g[2]);
    pd_engine_get_stats(e, &st);
    uint64_t hits = st.offload_hits;
    submit(e, &p[0], 12, 0.0f, &ga);
    pd_engine_output_t *outs = NULL;
    ck_assert_int_eq(pd_engine_step(e, &outs), PD_OK); /* its load starts; it waits */
    ck_assert_ptr_null(outs);
    ck_assert(pd_engine_abort(e, "r12"));
    tu_engine_run_until_idle(e, 5000);
    ck_assert_str_eq(ga.finish, "abort");
    ck_assert_int_eq(ga.n, 0);
    tu_engine_assert_pool_free(e);
    ck_assert_int_eq(pd_block_pool_check(pd_engine_block_pool(e)), PD_OK);
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.offload_hits, hits + 6); /* the load went on without its request */
    run(e, &p[0], 13, 0.0f, &ga);                 /* and left A's blocks in the pool */
    ck_assert_int_eq(ga.cached, 6 * 16);
    assert_same(&ga, &g[0], "after the aborted load");
    pd_engine_get_stats(e, &st);
    ck_assert_uint_eq(st.offload_hits, hits + 6);
    pd_engine_destroy(e);
    g_load = NULL;
    g_read_delay = 0;
    unlink(path);
}
END_TEST

START_TEST(test_engine_refusals)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 1;
    c.kv_cache_memory = 256u << 20;
    c.max_model_len = 128;
    c.num_blocks_override = 13;
    c.kv_offload_tier = "host"; /* no size */
    pd_engine_t *e = NULL;
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_ERR_INVALID_ARG);
    c.kv_offload_size = 1 << 20;
    c.enable_prefix_caching = false; /* nothing to key blocks by */
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_ERR_UNSUPPORTED);
    c.enable_prefix_caching = true;
    c.kv_offload_tier = "disk"; /* no path */
    ck_assert_int_eq(pd_engine_create(&c, &e), PD_ERR_INVALID_ARG);
    ck_assert_ptr_null(e);
}
END_TEST

/* ------------------------------------------------------------------ allocation failures */

/* Both tiers from nothing back to nothing, any allocation failing: create fails cleanly or the tier
 * works (a save that worked loads back byte for byte); a disk tier reopened keeps what was saved. */
static int fa_tiers(void)
{
    int wrong = 0;
    for (int m = 0; m < 2; m++) {
        region_t r;
        region_init(&r, m == 0 ? PD_KV_OFFLOAD_HOST : PD_KV_OFFLOAD_DISK, 3, "fa.kv");
        if (r.base == NULL) {
            continue; /* the fake region itself */
        }
        unlink(r.cfg.path);
        for (int round = 0; round < 2; round++) { /* the disk tier: created, then reopened */
            pd_kv_offload_t *o = NULL;
            if (pd_kv_offload_create(&r.cfg, &o) != PD_OK) {
                if (o != NULL) {
                    fprintf(stderr, "fa_tiers: a failed create set its output\n");
                    wrong++;
                }
                continue;
            }
            fill(&r, 1, 42);
            if (pd_kv_offload_save(o, key(1), 1) == PD_OK) {
                memset(page(&r, 0, 2), 0, PAGE);
                if (pd_kv_offload_load(o, key(1), 2) != PD_OK || !holds(&r, 2, 42)) {
                    fprintf(stderr, "fa_tiers: %s round %d: a saved block did not load back\n",
                            m == 0 ? "host" : "disk", round);
                    wrong++;
                }
            }
            pd_kv_offload_destroy(o);
        }
        unlink(r.cfg.path);
        free(r.base);
    }
    return wrong;
}

/* An engine with a host tier, a prompt evicted and asked again: any allocation failing, the engine
 * fails to start cleanly or answers, and a request that ran to its length got the tokens it gets
 * without failures; the pool ends whole. */
static gen_t g_fa_ref;

/* tu_engine_collect without Check's asserts (a fail-alloc child runs outside a test). */
static void fa_collect(pd_engine_output_t *outs)
{
    for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
        gen_t *g = o->user;
        if (o->token >= 0 && g->n < 256) {
            g->tokens[g->n++] = o->token;
        }
        if (o->finish_reason != NULL) {
            g->finish = o->finish_reason;
            g->cached = o->cached_tokens;
        }
    }
}

static int fa_engine_run(gen_t *out)
{
    pd_engine_config_t c;
    pd_engine_config_defaults(&c);
    c.model_dir = g_model;
    c.threads = 1;
    c.kv_cache_memory = 256u << 20;
    c.max_num_batched_tokens = 256;
    c.max_num_seqs = 4;
    c.max_model_len = 128;
    c.num_blocks_override = 13;
    c.kv_offload_tier = "host";
    c.kv_offload_size = 1u << 20;
    pd_engine_t *e = NULL;
    if (pd_engine_create(&c, &e) != PD_OK) {
        return 0;
    }
    prompt_t p[3];
    make_prompts(p, pd_engine_model_config(e)->vocab_size);
    int wrong = 0;
    for (int i = 0; i < 4; i++) {
        char id[16], err[256];
        snprintf(id, sizeof(id), "r%d", i);
        gen_t scratch;
        gen_t *g = i == 3 ? out : &scratch;
        memset(g, 0, sizeof(*g));
        pd_engine_request_t rq;
        memset(&rq, 0, sizeof(rq));
        rq.id = id;
        rq.prompt = p[i % 3].ids;
        rq.num_prompt = p[i % 3].n;
        rq.params.max_tokens = 4;
        rq.params.ignore_eos = true;
        rq.params.sampling = (pd_sampling_params_t){0.0f, 0, 1.0f, 0.0f};
        rq.user = g;
        if (pd_engine_add(e, &rq, err, sizeof(err)) != PD_OK) {
            continue;
        }
        for (int steps = 0; steps < 2000; steps++) { /* then once more: it releases the request */
            bool more = pd_engine_has_work(e);
            pd_engine_output_t *outs = NULL;
            pd_engine_step(e, &outs); /* a failed step fails its requests: they end "error" */
            fa_collect(outs);
            pd_engine_output_free(outs);
            if (!more) {
                break;
            }
        }
    }
    pd_engine_stats_t st;
    pd_engine_get_stats(e, &st);
    if (pd_engine_has_work(e) || st.blocks_used != 0 ||
        st.blocks_free + st.blocks_cached_free != st.num_blocks - 1) {
        fprintf(stderr, "fa_engine: after the run: work left %d, blocks used %u\n", pd_engine_has_work(e),
                (unsigned)st.blocks_used);
        wrong++;
    }
    pd_engine_destroy(e);
    return wrong;
}

static int fa_engine_prepare(void)
{
    memset(&g_fa_ref, 0, sizeof(g_fa_ref));
    /* without failures the evicted prompt's 6 full blocks come from the tier */
    return fa_engine_run(&g_fa_ref) != 0 || g_fa_ref.n != 4 || g_fa_ref.cached != 6 * 16;
}

static int fa_engine(void)
{
    gen_t got;
    memset(&got, 0, sizeof(got));
    int wrong = fa_engine_run(&got);
    bool whole = got.finish != NULL && strcmp(got.finish, "length") == 0 && got.n == 4;
    if (whole && memcmp(got.tokens, g_fa_ref.tokens, sizeof(int32_t) * 4) != 0) {
        fprintf(stderr, "fa_engine: the evicted prompt ran to its length with other tokens\n");
        wrong++;
    }
    if (!tu_fail_alloc_hit() && !whole) {
        fprintf(stderr, "fa_engine: with nothing failing, the evicted prompt did not run to its length\n");
        wrong++;
    }
    return wrong;
}

static const tu_fa_scenario_t FA_SCENARIOS[] = {{"tiers", fa_tiers, NULL},
                                                {"engine", fa_engine, fa_engine_prepare}};

START_TEST(test_fail_alloc)
{
    setenv("PD_FAIL_ALLOC_DIR", g_dir, 1);
    if (_i == 0) {
        tu_fail_alloc_loop("tiers", 200, 30); /* every allocation of both tiers */
    } else {
        setenv("PD_FAIL_ALLOC_MODEL", g_model, 1); /* the children use this process's model */
        tu_fail_alloc_sites("engine", 2000, 60);   /* one run per call site */
    }
}
END_TEST

int main(void)
{
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_ERROR);
    if (getenv("PD_FAIL_ALLOC_SCENARIO") != NULL) { /* a child: this process's model and directory */
        g_model = getenv("PD_FAIL_ALLOC_MODEL");
        g_dir = getenv("PD_FAIL_ALLOC_DIR");
        tu_fail_alloc_child(FA_SCENARIOS, 2);
    }
    g_model = tu_make_model("--preset tiny --arch llama");
    g_dir = tu_mkdtemp("offload");
    if (g_model == NULL || g_dir == NULL) {
        fprintf(stderr, "cannot make the tiny model or a directory\n");
        return 1;
    }
    Suite *s = suite_create("offload");
    TCase *tc = tcase_create("offload");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_host_round_trip_and_lru);
    tcase_add_test(tc, test_device_host_tier);
    tcase_add_test(tc, test_disk_round_trip_and_lru);
    tcase_add_test(tc, test_host_pins);
    tcase_add_test(tc, test_disk_pins);
    tcase_add_test(tc, test_disk_checksums_and_restart);
    tcase_add_test(tc, test_bad_configs);
    tcase_add_test(tc, test_engine_host_tier_greedy);
    tcase_add_test(tc, test_engine_disk_tier_seeded);
    tcase_add_test(tc, test_engine_host_tier_thread);
    tcase_add_test(tc, test_engine_disk_tier_inline);
    tcase_add_test(tc, test_engine_threaded_load_overlaps_and_aborts);
    tcase_add_test(tc, test_engine_refusals);
    suite_add_tcase(s, tc);
    tu_fail_alloc_add(s, test_fail_alloc, 2);
    int rc = tu_run_suite(s);
    tu_rmrf(g_model);
    tu_rmrf(g_dir);
    free(g_model);
    free(g_dir);
    return rc;
}
