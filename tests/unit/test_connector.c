/* tests/unit/test_connector.c — the P/D KV connector in one process: a prefill and a decode
 * connector over a real pipe (tcp and ucx, loopback), driven through the connector interface as
 * the scheduler and model runner drive it, with no engine, model or HTTP. Each case runs in well
 * under a second: pull and push move the right bytes into the right blocks; a lease that expired
 * is STALE and a released one frees at once; an unreachable or vanished prefill, a wrong token, a
 * block id outside the prefill's cache and an aborted request end the load as load errors (the
 * scheduler's failure policy then applies) without touching other blocks; everything is freed
 * (fd count back where it was). test_pd keeps the whole-cluster cases. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <check.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "connector/control.h"
#include "connector/kv_conn.h" /* kv_params_verify (the reason a decode refuses pull params), the mailbox */
#include "connector/kv_connector.h"
#include "http_client.h"
#include "pipe/pipe.h"
#include "scheduler/scheduler.h"
#include "test_util.h"

#include "fail_alloc.h"

#define LAYERS 2
#define BLOCKS 32
#define BS     4   /* tokens per block */
#define PAGE   256 /* bytes per (layer, block) page */
#define PROMPT 37  /* tokens: the decode loads ceil(36 / 4) = 9 blocks (the last token is recomputed) */
#define NEED   9

static const char *const PIPES[] = {"tcp", "ucx"};

typedef struct node {
    pd_connector_t *c;
    pd_metrics_t *m;
    uint8_t *kv;
    bool kv_from_pipe;
    char tag;
} node_t;

typedef struct opts {
    const char *mode, *pipe, *token_file;
    double hold_timeout, load_timeout;
    int advertise_port; /* 0: the listen port */
} opts_t;

static uint8_t *page(node_t *n, int layer, uint32_t block)
{
    return n->kv + ((size_t)layer * BLOCKS + block) * PAGE;
}

/* Every page of a node holds bytes that name the node, the layer and the block. */
static void fill(node_t *n)
{
    for (int l = 0; l < LAYERS; l++) {
        for (uint32_t b = 0; b < BLOCKS; b++) {
            for (int i = 0; i < PAGE; i++) {
                page(n, l, b)[i] = (uint8_t)(n->tag * 31 + l * 7 + b * 3 + i);
            }
        }
    }
}

static void node_stop(node_t *n);

/* A connector of role on a fresh KV region filled by fill(), started: PD_OK, or the status of the
 * step that failed with whatever was made undone (the failing-allocator scenario takes that). */
static pd_status_t node_try_make(node_t *n, const char *role, char tag, const opts_t *o, bool start);

static pd_status_t node_try_start(node_t *n, const char *role, char tag, const opts_t *o)
{
    return node_try_make(n, role, tag, o, true);
}

/* As node_try_start; !start: the KV caches registered and no control thread (the engine half
 * alone, its commands left in the mailbox). */
static pd_status_t node_try_make(node_t *n, const char *role, char tag, const opts_t *o, bool start)
{
    memset(n, 0, sizeof(*n));
    n->tag = tag;
    pd_kv_connector_config_t cfg;
    pd_kv_connector_config_defaults(&cfg);
    cfg.role = role;
    cfg.mode = o->mode;
    cfg.pipe = o->pipe;
    cfg.cluster_token_file = o->token_file;
    cfg.insecure_no_kv_auth = o->token_file == NULL; /* the cases without a token say so */
    cfg.advertise_port = o->advertise_port;
    cfg.hold_timeout = o->hold_timeout > 0 ? o->hold_timeout : 30;
    cfg.load_timeout = o->load_timeout > 0 ? o->load_timeout : 5;
    cfg.handshake_timeout = 1;
    cfg.heartbeat_interval = 0.1;
    cfg.heartbeat_misses = 5;
    cfg.prefault = false;
    pd_status_t st = pd_metrics_create(&n->m);
    if (st != PD_OK) {
        return st;
    }
    if ((st = pd_kv_connector_create(&cfg, n->m, &n->c)) != PD_OK) {
        pd_metrics_destroy(n->m);
        n->c = NULL;
        return st;
    }
    size_t bytes = (size_t)LAYERS * BLOCKS * PAGE;
    const pd_kv_region_allocator_t *a = pd_kv_connector_allocator(n->c);
    void *kv = NULL;
    st = a != NULL ? a->alloc(a->ctx, bytes, &kv) : (kv = malloc(bytes)) != NULL ? PD_OK : PD_ERR_NO_MEMORY;
    n->kv = kv;
    n->kv_from_pipe = a != NULL;
    if (st == PD_OK) {
        fill(n);
        pd_kv_region_desc_t rd;
        memset(&rd, 0, sizeof(rd));
        rd.base = n->kv;
        rd.host_memory = true;
        rd.bytes = bytes;
        rd.num_layers = LAYERS;
        for (int l = 0; l < LAYERS; l++) {
            rd.layer_offset[l] = (size_t)l * BLOCKS * PAGE;
        }
        rd.page_bytes = PAGE;
        rd.num_blocks = BLOCKS;
        rd.block_size = BS;
        st = n->c->ops->register_kv_caches(n->c, &rd);
    }
    if (st == PD_OK && start) {
        Pd__Fingerprint fp;
        pd_kv_fingerprint("test-model", "fp32", BS, 2, PAGE / (BS * 2 * 2 * 4), LAYERS, &fp);
        st = pd_kv_connector_start(n->c, &fp);
    }
    if (st != PD_OK) {
        node_stop(n);
    }
    return st;
}

static void node_start(node_t *n, const char *role, char tag, const opts_t *o)
{
    pd_status_t st = node_try_start(n, role, tag, o);
    ck_assert_msg(st == PD_OK, "%s connector: %s", role, pd_status_str(st));
}

static void node_stop(node_t *n)
{
    if (n->c == NULL) {
        return;
    }
    pd_kv_connector_stop(n->c);
    if (n->kv_from_pipe) {
        /* the pipe owned the memory: it went with the pipe */
    } else {
        free(n->kv);
    }
    pd_kv_connector_destroy(n->c);
    pd_metrics_destroy(n->m);
    n->c = NULL;
}

/* A prefill and a decode (dop NULL: the prefill's options). */
static void pair_start(node_t *p, node_t *d, const opts_t *po, const opts_t *dop)
{
    node_start(p, "prefill", 'p', po);
    node_start(d, "decode", 'd', dop != NULL ? dop : po);
}

static double metric(node_t *n, const char *series);
static int32_t would_load(node_t *d, json_t *params);

/* Stops both, once any handshake between them has settled on both sides (a node stopped while its
 * peer still imports its region makes UCX fail to attach memory that is gone: logged, harmless, but
 * noise in a sanitizer run). */
static void pair_stop(node_t *p, node_t *d)
{
    for (double end = tu_now() + 2; p->c != NULL && d->c != NULL && tu_now() < end; usleep(2000)) {
        if (metric(p, "pd:kv_peers") == metric(d, "pd:kv_peers")) {
            break;
        }
    }
    node_stop(d);
    node_stop(p);
}

/* The first token id of request()'s prompt (3, 4, ... by default); a case that pairs a prefill and
 * a decode request of different prompts sets it between them (each case runs in its own process). */
static int g_prompt_base = 3;

static void prompt_ids(int32_t *prompt)
{
    for (int i = 0; i < PROMPT; i++) {
        prompt[i] = g_prompt_base + i;
    }
}

static pd_request_t *request(const char *id, json_t *params)
{
    int32_t prompt[PROMPT];
    prompt_ids(prompt);
    pd_request_params_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.max_tokens = 4;
    pd_request_t *r = NULL;
    ck_assert_int_eq(pd_request_create(id, prompt, PROMPT, &rp, 128, &r), PD_OK);
    r->kv_transfer_params = params;
    return r;
}

/* Prefill: a finished request that held blocks[NEED + 1] (the whole prompt); returns the params it
 * hands on (pull) or NULL, and whether it delays freeing. */
static json_t *prefill_finish(node_t *p, const char *id, json_t *in_params, const uint32_t *blocks,
                              bool *hold)
{
    pd_request_t *r = request(id, in_params);
    r->state = PD_REQ_FINISHED_LENGTH;
    void *out = NULL;
    *hold = p->c->ops->request_finished(p->c, r, blocks, NEED + 1, &out);
    pd_request_free(r);
    return out;
}

/* Decode: schedules a request with these params into local blocks (as the scheduler would) and
 * starts its load. Returns the request (the caller frees it). */
static int32_t load_into(node_t *d, pd_request_t *r, const uint32_t *local, bool *async,
                         pd_status_t *alloc_st);

static pd_request_t *decode_load(node_t *d, const char *id, json_t *params, const uint32_t *local)
{
    pd_request_t *r = request(id, params);
    bool async;
    load_into(d, r, local, &async, NULL);
    return r;
}

/* Decode: request r (its params set) scheduled into local blocks[NEED + 1] as the scheduler would,
 * its load started; returns the tokens the connector said it loads (and whether asynchronously, and
 * what update_state_after_alloc answered when it ran). */
static int32_t load_into(node_t *d, pd_request_t *r, const uint32_t *local, bool *async,
                         pd_status_t *alloc_st)
{
    int32_t ext = 0;
    *async = false;
    ck_assert_int_eq(d->c->ops->get_num_new_matched_tokens(d->c, r, 0, &ext, async), PD_OK);
    if (ext > 0) {
        pd_status_t st = d->c->ops->update_state_after_alloc(d->c, r, local, NEED + 1, ext);
        if (alloc_st != NULL) {
            *alloc_st = st;
        }
    }
    pd_scheduler_output_t so;
    memset(&so, 0, sizeof(so));
    void *meta = d->c->ops->build_connector_meta(d->c, &so);
    ck_assert_int_eq(d->c->ops->bind_connector_metadata(d->c, meta), PD_OK);
    ck_assert_int_eq(d->c->ops->start_load_kv(d->c), PD_OK);
    return ext;
}

/* Polls get_finished (as the engine does each step) until id is reported (in sending when
 * sending, else in recving) or timeout_s passes; returns whether it was. Load errors reported
 * meanwhile are added to *errors. */
static bool wait_finished(node_t *n, const char *id, bool sending, double timeout_s, int *errors)
{
    double end = tu_now() + timeout_s;
    while (tu_now() < end) {
        pd_connector_finished_t f;
        ck_assert_int_eq(n->c->ops->get_finished(n->c, &f), PD_OK);
        uint32_t ids[64];
        int32_t ne = n->c->ops->get_block_ids_with_load_errors(n->c, ids, 64);
        if (errors != NULL) {
            *errors += ne;
        }
        const char *const *list = sending ? f.sending : f.recving;
        int32_t num = sending ? f.num_sending : f.num_recving;
        for (int32_t i = 0; i < num; i++) {
            if (strcmp(list[i], id) == 0) {
                return true;
            }
        }
        usleep(1000);
    }
    return false;
}

static json_t *pull_params_in(void)
{
    return json_pack("{s:b}", "do_remote_decode", 1);
}

/* A push prefill request's params (it writes into the reservation of transfer tid). */
static json_t *push_params_in(const char *tid)
{
    return json_pack("{s:b, s:s, s:s}", "do_remote_decode", 1, "transfer_mode", "push", "transfer_id", tid);
}

/* A push decode request's params: transfer tid from the prefill whose control port is port. */
static json_t *push_params_out(const char *tid, int port)
{
    return json_pack("{s:b, s:s, s:s, s:s, s:i}", "do_remote_prefill", 1, "transfer_mode", "push",
                     "transfer_id", tid, "remote_host", "127.0.0.1", "remote_port", port);
}

static const uint32_t P_BLOCKS[NEED + 1] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
static const uint32_t D_BLOCKS[NEED + 1] = {20, 21, 22, 23, 24, 25, 26, 27, 28, 29};

/* The decode's first NEED blocks hold the prefill's pages, layer by layer; the block after them
 * (recomputed locally) and every other block are untouched. */
static void expect_moved(node_t *p, node_t *d)
{
    node_t fresh = *d;
    uint8_t *orig = malloc((size_t)LAYERS * BLOCKS * PAGE);
    fresh.kv = orig;
    fill(&fresh);
    for (int l = 0; l < LAYERS; l++) {
        for (uint32_t b = 0; b < BLOCKS; b++) {
            int k = -1;
            for (int i = 0; i < NEED; i++) {
                k = D_BLOCKS[i] == b ? i : k;
            }
            const uint8_t *want = k >= 0 ? page(p, l, P_BLOCKS[k]) : page(&fresh, l, b);
            ck_assert_msg(memcmp(page(d, l, b), want, PAGE) == 0, "layer %d block %u: wrong bytes", l, b);
        }
    }
    free(orig);
}

/* ------------------------------------------------------------------ cases */

START_TEST(test_pull_moves_the_right_pages)
{
    int fds = tu_count_fds();
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    ck_assert(hold);
    ck_assert_ptr_nonnull(params);
    ck_assert(json_is_true(json_object_get(params, "do_remote_prefill")));
    ck_assert_int_eq(json_integer_value(json_object_get(params, "remote_port")), pd_kv_connector_port(p.c));
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    expect_moved(&p, &d);
    /* READ_DONE → ACK: the prefill frees its blocks */
    ck_assert(wait_finished(&p, "req-p", true, 3, NULL));
    void *out = NULL;
    r->state = PD_REQ_FINISHED_LENGTH;
    ck_assert(!d.c->ops->request_finished(d.c, r, D_BLOCKS, NEED + 1, &out)); /* nothing left to hold */
    json_decref(out);
    pd_request_free(r);
    pair_stop(&p, &d);
    ck_assert_int_eq(tu_count_fds(), fds);
}
END_TEST

START_TEST(test_push_into_a_late_reservation)
{
    int fds = tu_count_fds();
    opts_t o = {"push", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    /* the prefill finishes before the decode's reservation arrives: it keeps its blocks and writes
     * them when the reservation comes */
    bool hold = false;
    json_t *out = prefill_finish(&p, "req-p", push_params_in("x-1"), P_BLOCKS, &hold);
    ck_assert(hold);
    json_decref(out);
    json_t *dp = push_params_out("x-1", pd_kv_connector_port(p.c));
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", dp, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    expect_moved(&p, &d);
    ck_assert(wait_finished(&p, "req-p", true, 3, NULL));
    ck_assert_int_eq((int)metric(&p, "pd:kv_transfers_started_total{kind=\"push_save\"}"), 1);
    ck_assert_int_eq((int)metric(&p, "pd:kv_transfers_completed_total{kind=\"push_save\"}"), 1);
    pd_request_free(r);
    pair_stop(&p, &d);
    ck_assert_int_eq(tu_count_fds(), fds);
}
END_TEST

/* A series' value in a node's metrics (-1 when absent). */
static double metric(node_t *n, const char *series)
{
    size_t len = 0;
    char *text = pd_metrics_render(n->m, &len);
    double v = pd_metrics_text_value(text, series, -1);
    free(text);
    return v;
}

/* Push as it usually goes: the decode's reservation arrives before the prefill computes, each
 * layer's pages are written into it right after the layer (save_kv_layer, over two steps of a
 * chunked prefill), wait_for_save bounds the step, and request_finished sends WRITE_DONE without
 * holding anything. */
START_TEST(test_push_streams_layers)
{
    int fds = tu_count_fds();
    opts_t o = {"push", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    json_t *dp = push_params_out("x-2", pd_kv_connector_port(p.c));
    pd_request_t *r = decode_load(&d, "req-d", dp, D_BLOCKS);
    double end = tu_now() + 3;
    while (metric(&p, "pd:kv_reservations") != 1 && tu_now() < end) {
        usleep(1000);
    }
    ck_assert_int_eq((int)metric(&p, "pd:kv_reservations"), 1);
    pd_request_t *pr = request("req-p", json_pack("{s:b, s:s, s:s}", "do_remote_decode", 1, "transfer_mode",
                                                  "push", "transfer_id", "x-2"));
    pr->block_ids = malloc(sizeof(P_BLOCKS));
    memcpy(pr->block_ids, P_BLOCKS, sizeof(P_BLOCKS));
    pr->num_blocks = NEED + 1;
    for (int step = 0; step < 2; step++) { /* 20 tokens, then the other 17 */
        pd_sched_item_t item = {pr, step == 0 ? 20 : PROMPT - 20};
        pd_scheduler_output_t so;
        memset(&so, 0, sizeof(so));
        so.items = &item;
        so.num_items = 1;
        ck_assert_int_eq(p.c->ops->bind_connector_metadata(p.c, p.c->ops->build_connector_meta(p.c, &so)),
                         PD_OK);
        for (int l = 0; l < LAYERS; l++) {
            ck_assert_int_eq(p.c->ops->save_kv_layer(p.c, l), PD_OK);
        }
        ck_assert_int_eq(p.c->ops->wait_for_save(p.c), PD_OK);
        pr->num_computed_tokens += item.num_new_tokens;
    }
    pr->state = PD_REQ_FINISHED_LENGTH;
    void *out = NULL;
    ck_assert(!p.c->ops->request_finished(p.c, pr, P_BLOCKS, NEED + 1, &out)); /* streamed: nothing held */
    json_decref(out);
    int errors = 0;
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    expect_moved(&p, &d);
    ck_assert_int_eq((int)metric(&d, "pd:kv_transfers_completed_total{kind=\"push_load\"}"), 1);
    /* one save, started and completed once (issue 51: the streamed path completed without a start) */
    ck_assert_int_eq((int)metric(&p, "pd:kv_transfers_started_total{kind=\"push_save\"}"), 1);
    ck_assert_int_eq((int)metric(&p, "pd:kv_transfers_completed_total{kind=\"push_save\"}"), 1);
    pd_request_free(pr); /* and its block list */
    pd_request_free(r);
    pair_stop(&p, &d);
    ck_assert_int_eq(tu_count_fds(), fds);
}
END_TEST

/* A lease that expired before the decode read it: the prefill frees the blocks at the expiry and
 * answers the late READ_DONE with STALE; the decode reports every block as a load error. */
START_TEST(test_expired_lease_is_stale)
{
    opts_t po = {"pull", PIPES[_i], NULL, 0.15, 0, 0};
    opts_t dop = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &po, &dop);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    ck_assert(hold);
    ck_assert(wait_finished(&p, "req-p", true, 2, NULL)); /* expired: freed */
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, NEED);
    pd_request_free(r);
    pair_stop(&p, &d);
}
END_TEST

/* pd_kv_connector_release (the proxy's POST /pd/release) frees a lease at once; a wrong lease id
 * releases nothing. */
START_TEST(test_release_frees_at_once)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p;
    node_start(&p, "prefill", 'p', &o);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    ck_assert(hold);
    uint64_t lease = (uint64_t)json_integer_value(json_object_get(params, "lease_id"));
    ck_assert(!pd_kv_connector_release(p.c, "req-p", lease + 1, NULL));
    ck_assert(!pd_kv_connector_release(p.c, "other", lease, NULL));
    ck_assert(!wait_finished(&p, "req-p", true, 0.05, NULL));
    ck_assert(pd_kv_connector_release(p.c, "req-p", lease, NULL));
    ck_assert(wait_finished(&p, "req-p", true, 0.5, NULL));
    ck_assert(!pd_kv_connector_release(p.c, "req-p", lease, NULL)); /* once */
    json_decref(params);
    node_stop(&p);
}
END_TEST

/* Loads that cannot succeed end as load errors of exactly the blocks to load, quickly, and leave
 * the decode's other blocks alone: nobody listens on the port; the prefill went away after it
 * handed the params out; the tokens differ; a block id is outside the prefill's cache. */
START_TEST(test_failed_loads_are_load_errors)
{
    const char *dir = tu_mkdtemp("conn");
    char tok_a[600], tok_b[600];
    snprintf(tok_a, sizeof(tok_a), "%s/a", dir);
    snprintf(tok_b, sizeof(tok_b), "%s/b", dir);
    ck_assert_int_eq(tu_write_file(tok_a, "secret-a\n", 9), 0);
    ck_assert_int_eq(tu_write_file(tok_b, "secret-b\n", 9), 0);
    for (int k = 0; k < 4; k++) {
        opts_t po = {"pull", PIPES[_i], k == 2 ? tok_a : NULL, 0, 0, 0};
        opts_t dop = {"pull", PIPES[_i], k == 2 ? tok_b : NULL, 0, 0, 0};
        node_t p, d;
        pair_start(&p, &d, &po, &dop);
        bool hold = false;
        json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
        if (k == 2) { /* signed under another token: refused before any dial (the handshake would fail) */
            ck_assert_int_eq(would_load(&d, params), 0);
            ck_assert_int_eq((int)metric(&d, "pd:kv_params_refused_total"), 1);
            json_decref(params);
            pair_stop(&p, &d);
            continue;
        }
        if (k == 0) {
            json_object_set_new(params, "remote_port", json_integer(1)); /* nothing listens there */
        } else if (k == 1) {
            node_stop(&p);
        } else if (k == 3) {
            json_array_set_new(json_object_get(params, "remote_block_ids"), 3, json_integer(BLOCKS + 5));
        }
        double t0 = tu_now();
        int errors = 0;
        pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
        ck_assert_msg(wait_finished(&d, "req-d", false, 3, &errors), "case %d: the load never ended", k);
        ck_assert_msg(errors == NEED, "case %d: %d load errors, want %d", k, errors, NEED);
        ck_assert_msg(tu_now() - t0 < 2.5, "case %d: took %.2f s (the load timeout is 5 s)", k,
                      tu_now() - t0);
        if (k == 3) { /* the prefill was reachable: the decode's ABORT frees the lease now, not at 30 s */
            ck_assert_msg(wait_finished(&p, "req-p", true, 1, NULL), "the failed load left the lease held");
        }
        /* the blocks the load was not to touch are as they were */
        node_t fresh = d;
        fresh.kv = malloc((size_t)LAYERS * BLOCKS * PAGE);
        fill(&fresh);
        for (int l = 0; l < LAYERS; l++) {
            for (uint32_t b = 0; b < BLOCKS; b++) {
                ck_assert(b >= D_BLOCKS[0] && b < D_BLOCKS[NEED]
                              ? 1
                              : memcmp(page(&d, l, b), page(&fresh, l, b), PAGE) == 0);
            }
        }
        free(fresh.kv);
        pd_request_free(r);
        pair_stop(&p, &d);
    }
    tu_rmrf(dir);
    free((void *)dir);
}
END_TEST

/* Every wait of a push decode ends, as load errors of the blocks it reserved: the prefill never
 * gets the request (its --kv-hold-timeout expires the reservation: WRITE_DONE with a timeout); the
 * decode's own --kv-load-timeout passes first; the prefill goes away while the decode waits (its
 * control connection closes). */
START_TEST(test_push_waits_end)
{
    for (int k = 0; k < 3; k++) {
        opts_t po = {"push", PIPES[_i], NULL, k == 0 ? 0.2 : 30, 0, 0};
        opts_t dop = {"push", PIPES[_i], NULL, 0, k == 1 ? 0.3 : 5, 0};
        node_t p, d;
        pair_start(&p, &d, &po, &dop);
        json_t *dp = push_params_out("x-3", pd_kv_connector_port(p.c));
        double t0 = tu_now();
        pd_request_t *r = decode_load(&d, "req-d", dp, D_BLOCKS);
        if (k == 2) {
            double end = tu_now() + 3;
            while (metric(&p, "pd:kv_reservations") != 1 && tu_now() < end) {
                usleep(1000);
            }
            node_stop(&p);
        }
        int errors = 0;
        ck_assert_msg(wait_finished(&d, "req-d", false, 3, &errors), "case %d: the load never ended", k);
        ck_assert_msg(errors == NEED, "case %d: %d load errors, want %d", k, errors, NEED);
        ck_assert_msg(tu_now() - t0 < 2.5, "case %d: took %.2f s (the load timeout is 5 s)", k,
                      tu_now() - t0);
        pd_request_free(r);
        pair_stop(&p, &d);
    }
}
END_TEST

/* A peer that holds the token (here: none configured, so anyone) but plays no fair part: it
 * completes the handshake with its own pipe and then sends raw control messages. */
typedef struct rogue {
    int fd;
    pd_ctl_reader_t rd;
    pd_pipe_t *pipe;
} rogue_t;

static void rogue_connect(rogue_t *r, node_t *target, const char *pipe)
{
    pd_pipe_config_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.kind = pipe;
    ck_assert_int_eq(pd_pipe_create(&pc, &r->pipe), PD_OK);
    uint8_t addr[PD_PIPE_ADDR_MAX];
    size_t al = sizeof(addr);
    ck_assert_int_eq(r->pipe->ops->address(r->pipe, addr, &al), PD_OK);
    Pd__Fingerprint fp;
    pd_kv_fingerprint("test-model", "fp32", BS, 2, PAGE / (BS * 2 * 2 * 4), LAYERS, &fp);
    fp.layout = "NB2BSHD;g1:full"; /* as pd_kv_connector_start completes it */
    pd_ctl_identity_t me = {
        "rogue", PD__ROLE__ROLE_DECODE,
        &fp,     strcmp(pipe, "tcp") == 0 ? PD__PIPE_KIND__PIPE_TCP : PD__PIPE_KIND__PIPE_UCX,
        addr,    al,
        NULL,    0,
        NULL};
    char server_addr[32];
    snprintf(server_addr, sizeof(server_addr), "127.0.0.1:%d", pd_kv_connector_port(target->c));
    me.server_addr = server_addr; /* the address it dials: both proofs cover it */
    r->fd = http_connect(pd_kv_connector_port(target->c), 1000);
    ck_assert_int_ge(r->fd, 0);
    pd_ctl_reader_init(&r->rd, 0);
    pd_ctl_msg_t peer = {0, NULL};
    char reason[256] = "";
    ck_assert_msg(pd_ctl_handshake_client(r->fd, &r->rd, &me, 2000, &peer, reason, sizeof(reason)) == PD_OK,
                  "rogue handshake: %s", reason);
    pd_ctl_msg_free(&peer);
}

/* The next message of type `type` from the node (others skipped), or a zero message after timeout_ms. */
static pd_ctl_msg_t rogue_expect(rogue_t *r, pd_msg_type_t type, int timeout_ms)
{
    double end = tu_now() + timeout_ms / 1000.0;
    while (tu_now() < end) {
        pd_ctl_msg_t m = {0, NULL};
        if (pd_ctl_recv(r->fd, &r->rd, &m, 50) != PD_OK) {
            continue;
        }
        if (m.type == type) {
            return m;
        }
        pd_ctl_msg_free(&m);
    }
    return (pd_ctl_msg_t){0, NULL};
}

static void rogue_close(rogue_t *r)
{
    close(r->fd);
    pd_ctl_reader_destroy(&r->rd);
    pd_pipe_destroy(r->pipe);
}

/* An authenticated peer that names leases, requests and transfers it was never given, or blocks
 * outside what it offered, gets a clean refusal (UNKNOWN; WRITE_DONE out of range) and changes
 * nothing: the real request's lease still holds, and the real decode then loads it intact. */
START_TEST(test_hostile_authenticated_peer)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    uint64_t lease = (uint64_t)json_integer_value(json_object_get(params, "lease_id"));
    rogue_t r;
    rogue_connect(&r, &p, PIPES[_i]);
    struct {
        const char *rid;
        uint64_t lease;
    } reads[] = {{"req-p", lease + 1}, {"req-p", 0}, {"no-such-request", lease}};
    for (size_t i = 0; i < sizeof(reads) / sizeof(reads[0]); i++) {
        Pd__ReadDone rd = PD__READ_DONE__INIT;
        rd.request_id = (char *)reads[i].rid;
        rd.lease_id = reads[i].lease;
        ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_READ_DONE, &rd.base, 500), PD_OK);
        pd_ctl_msg_t m = rogue_expect(&r, PD_MSG_TRANSFER_ACK, 2000);
        ck_assert_msg(m.msg != NULL, "READ_DONE %zu: no answer", i);
        ck_assert_int_eq(((Pd__TransferAck *)m.msg)->result, PD__TRANSFER_ACK__RESULT__UNKNOWN);
        pd_ctl_msg_free(&m);
    }
    Pd__Abort ab = PD__ABORT__INIT; /* the right request, a wrong lease */
    ab.request_id = "req-p";
    ab.lease_id = lease ^ 1;
    ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_ABORT, &ab.base, 500), PD_OK);
    Pd__WriteDone wd = PD__WRITE_DONE__INIT; /* for a push this engine never started */
    wd.request_id = "x-never";
    ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_WRITE_DONE, &wd.base, 500), PD_OK);
    Pd__TransferAck ta = PD__TRANSFER_ACK__INIT; /* for a load this prefill never made */
    ta.request_id = "req-p";
    ta.lease_id = lease;
    ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_TRANSFER_ACK, &ta.base, 500), PD_OK);
    uint32_t far[2] = {1, BLOCKS + 100};
    Pd__Reservation rv = PD__RESERVATION__INIT; /* blocks outside what it offered (no Regions at all) */
    rv.request_id = "x-evil";
    rv.block_ids = far;
    rv.n_block_ids = 2;
    ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_RESERVATION, &rv.base, 500), PD_OK);
    pd_ctl_msg_t m = rogue_expect(&r, PD_MSG_WRITE_DONE, 2000);
    ck_assert_ptr_nonnull(m.msg);
    ck_assert_int_ne(((Pd__WriteDone *)m.msg)->status, 0);
    pd_ctl_msg_free(&m);
    /* three large legal frames in one burst (3 MB, each just under the 1 MiB frame limit) are each
     * refused, and the peer stays (issue 51: they overflowed the reader before any was parsed and the
     * peer was dropped for a "control stream overflow") */
    size_t nbig = 250000;
    uint32_t *big = malloc(nbig * sizeof(uint32_t));
    for (size_t i = 0; i < nbig; i++) {
        big[i] = 3000000 + (uint32_t)i; /* 4-byte varints, outside any cache */
    }
    Pd__Reservation brv = PD__RESERVATION__INIT;
    brv.request_id = "x-big";
    brv.block_ids = big;
    brv.n_block_ids = nbig;
    uint8_t *burst = NULL;
    size_t burst_len = 0;
    for (int k = 0; k < 3; k++) {
        uint8_t *f = NULL;
        size_t fl = 0;
        ck_assert_int_eq(pd_ctl_encode(PD_MSG_RESERVATION, &brv.base, &f, &fl), PD_OK);
        ck_assert_uint_lt(fl, PD_CTL_DEFAULT_MAX_FRAME);
        burst = realloc(burst, burst_len + fl);
        memcpy(burst + burst_len, f, fl);
        burst_len += fl;
        free(f);
    }
    for (size_t off = 0; off < burst_len;) {
        ssize_t w = write(r.fd, burst + off, burst_len - off);
        ck_assert_int_gt(w, 0);
        off += (size_t)w;
    }
    free(burst), free(big);
    for (int k = 0; k < 3; k++) {
        pd_ctl_msg_t bm = rogue_expect(&r, PD_MSG_WRITE_DONE, 3000);
        ck_assert_msg(bm.msg != NULL, "large reservation %d: no answer (the peer was dropped?)", k);
        ck_assert_int_ne(((Pd__WriteDone *)bm.msg)->status, 0);
        pd_ctl_msg_free(&bm);
    }
    Pd__ReadDone still = PD__READ_DONE__INIT; /* and the connection still answers */
    still.request_id = "no-such-request";
    ck_assert_int_eq(pd_ctl_send(r.fd, PD_MSG_READ_DONE, &still.base, 500), PD_OK);
    pd_ctl_msg_t sm = rogue_expect(&r, PD_MSG_TRANSFER_ACK, 2000);
    ck_assert_ptr_nonnull(sm.msg);
    pd_ctl_msg_free(&sm);
    ck_assert(!wait_finished(&p, "req-p", true, 0.2, NULL)); /* still held */
    ck_assert_int_eq((int)metric(&p, "pd:kv_reservations"), 0);
    /* the real decode reads it intact */
    int errors = 0;
    pd_request_t *req = decode_load(&d, "req-d", params, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    expect_moved(&p, &d);
    ck_assert(wait_finished(&p, "req-p", true, 3, NULL));
    pd_request_free(req);
    rogue_close(&r);
    pair_stop(&p, &d);
}
END_TEST

/* Peers come and go (decodes restart) around one prefill: each one's control connection, pipe
 * endpoint, imported region and record are freed when it dies, so the prefill's fds stay flat and
 * every new decode still moves its KV. (Memory is measured across processes, where UCX maps a peer's
 * region: test_pd test_decode_deaths_release_prefill_memory.) */
START_TEST(test_peer_deaths_leave_nothing)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p;
    node_start(&p, "prefill", 'p', &o);
    int fds0 = -1;
    for (int round = 0; round < 30; round++) {
        node_t d;
        node_start(&d, "decode", 'd', &o);
        bool hold = false;
        char rid[32];
        snprintf(rid, sizeof(rid), "req-p%d", round);
        json_t *params = prefill_finish(&p, rid, pull_params_in(), P_BLOCKS, &hold);
        int errors = 0;
        pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
        ck_assert_msg(wait_finished(&d, "req-d", false, 3, &errors), "round %d: the load never ended", round);
        ck_assert_int_eq(errors, 0);
        ck_assert(wait_finished(&p, rid, true, 3, NULL));
        pd_request_free(r);
        node_stop(&d);
        /* the prefill notices the death (its control connection closes) */
        double end = tu_now() + 3;
        while (metric(&p, "pd:kv_peers") != 0 && tu_now() < end) {
            usleep(2000);
        }
        usleep(50 * 1000);
        if (round == 4) {
            fds0 = tu_count_fds();
        }
    }
    ck_assert_int_eq(tu_count_fds(), fds0);
    node_stop(&p);
}
END_TEST

/* Out of file descriptors, the control listener backs off instead of spinning on EMFILE (a child
 * process holds 64 connections to it while this process may open no more fds), and once fds are
 * back a decode connects and loads as usual. */
START_TEST(test_control_listener_emfile_backoff)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p;
    node_start(&p, "prefill", 'p', &o);
    double cpu = tu_cpu_while_out_of_fds(pd_kv_connector_port(p.c));
    ck_assert_msg(cpu < 0.15, "%.2f s of CPU in 0.5 s while out of fds: the control thread spins", cpu);
    node_t d;
    node_start(&d, "decode", 'd', &o);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    pd_request_free(r);
    pair_stop(&p, &d);
}
END_TEST

/* A request aborted before its load was handed to the control thread holds nothing; one aborted
 * while its load is queued or in flight keeps its blocks (delay free) until the load ends, and is
 * then reported in finished_recving with no load error (cancelled, not failed). */
START_TEST(test_abort_during_load)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    /* before start_load_kv: nothing to hold */
    pd_request_t *r = request("req-a", json_deep_copy(params));
    int32_t ext = 0;
    bool async = false;
    ck_assert_int_eq(d.c->ops->get_num_new_matched_tokens(d.c, r, 0, &ext, &async), PD_OK);
    ck_assert(ext > 0 && async);
    d.c->ops->update_state_after_alloc(d.c, r, D_BLOCKS, NEED + 1, ext);
    r->state = PD_REQ_FINISHED_ABORTED;
    void *out = NULL;
    ck_assert(!d.c->ops->request_finished(d.c, r, D_BLOCKS, NEED + 1, &out));
    json_decref(out);
    pd_request_free(r);
    /* after start_load_kv: held until the load ends */
    r = decode_load(&d, "req-d", params, D_BLOCKS);
    r->state = PD_REQ_FINISHED_ABORTED;
    out = NULL;
    bool held = d.c->ops->request_finished(d.c, r, D_BLOCKS, NEED + 1, &out);
    json_decref(out);
    int errors = 0;
    if (held) {
        ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    }
    ck_assert_int_eq(errors, 0);
    pd_request_free(r);
    pair_stop(&p, &d);
}
END_TEST

/* A loopback forwarder: bound at once (so its port refuses connections), listening and relaying
 * each connection in turn to `to` once started. */
typedef struct fwd {
    int lfd, to;
    _Atomic bool stop; /* fwd_stop sets it, the forwarder thread reads it */
    pthread_t th;
} fwd_t;

static int fwd_bind(fwd_t *f, int to)
{
    memset(f, 0, sizeof(*f));
    f->to = to;
    f->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    ck_assert_int_eq(getsockname(f->lfd, (struct sockaddr *)&a, &al), 0);
    return ntohs(a.sin_port);
}

static void *fwd_main(void *arg)
{
    fwd_t *f = arg;
    while (!f->stop) {
        struct pollfd lp = {f->lfd, POLLIN, 0};
        if (poll(&lp, 1, 20) <= 0) {
            continue;
        }
        int c = accept(f->lfd, NULL, NULL);
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons((uint16_t)f->to),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        bool up = c >= 0 && s >= 0 && connect(s, (struct sockaddr *)&a, sizeof(a)) == 0;
        while (up && !f->stop) {
            struct pollfd p[2] = {{c, POLLIN, 0}, {s, POLLIN, 0}};
            if (poll(p, 2, 20) <= 0) {
                continue;
            }
            for (int i = 0; i < 2 && up; i++) {
                char buf[4096];
                ssize_t n = (p[i].revents != 0) ? read(p[i].fd, buf, sizeof(buf)) : 1;
                up = n > 0 && (p[i].revents == 0 || write(p[1 - i].fd, buf, (size_t)n) == n);
            }
        }
        if (c >= 0) {
            close(c);
        }
        if (s >= 0) {
            close(s);
        }
    }
    return NULL;
}

static void fwd_start(fwd_t *f)
{
    ck_assert_int_eq(listen(f->lfd, 8), 0);
    ck_assert_int_eq(pthread_create(&f->th, NULL, fwd_main, f), 0);
}

static void fwd_stop(fwd_t *f)
{
    f->stop = true;
    pthread_join(f->th, NULL);
    close(f->lfd);
}

/* A load that failed while the prefill was unreachable (its advertised control port refused the
 * dial) owes the prefill an ABORT: the decode keeps it, redials, and once the port answers (the
 * forwarder starts) the ABORT frees the prefill's blocks — long before the 30 s hold timeout. Pull:
 * the lease; push: the finished request waiting for a reservation (the ABORT names the transfer). */
START_TEST(test_abort_waits_for_the_reconnect)
{
    for (int push = 0; push < 2; push++) {
        fwd_t f;
        node_t p, d;
        const char *mode = push ? "push" : "pull";
        opts_t po = {mode, PIPES[_i], NULL, 0, 0, 0};
        int fport = fwd_bind(&f, 0);
        po.advertise_port = fport;
        opts_t dop = {mode, PIPES[_i], NULL, 0, 0, 0};
        pair_start(&p, &d, &po, &dop);
        f.to = pd_kv_connector_port(p.c);
        bool hold = false;
        json_t *in = push ? push_params_in("x-9") : pull_params_in();
        json_t *params = prefill_finish(&p, "req-p", in, P_BLOCKS, &hold);
        ck_assert(hold);
        if (push) {
            json_decref(params);
            params = push_params_out("x-9", fport);
        }
        ck_assert_int_eq((int)json_integer_value(json_object_get(params, "remote_port")), fport);
        int errors = 0;
        pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
        ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
        ck_assert_int_eq(errors, NEED);
        /* nobody could tell the prefill: it still holds the blocks */
        ck_assert(!wait_finished(&p, "req-p", true, 0.3, NULL));
        fwd_start(&f);
        ck_assert_msg(wait_finished(&p, "req-p", true, 5, NULL),
                      "%s: the blocks were not freed after the reconnect", mode);
        pd_request_free(r);
        pair_stop(&p, &d);
        fwd_stop(&f);
    }
}
END_TEST

/* Writes a cluster token file into dir (for both nodes of a pair); returns its path (malloc'd). */
static char *token_file(const char *dir, const char *token)
{
    char *path = malloc(600);
    snprintf(path, 600, "%s/token", dir);
    ck_assert_int_eq(tu_write_file(path, token, strlen(token)), 0);
    return path;
}

/* How many tokens the decode would load for a request of this node's prompt with these params (0:
 * it computes the prompt itself). */
static int32_t would_load(node_t *d, json_t *params)
{
    pd_request_t *r = request("probe", json_incref(params));
    int32_t ext = 0;
    bool async = false;
    ck_assert_int_eq(d->c->ops->get_num_new_matched_tokens(d->c, r, 0, &ext, &async), PD_OK);
    pd_request_free(r);
    return ext;
}

/* Pull parameters bind the prompt they were computed for and, with a cluster token, every field a
 * decode acts on (issue 51: a caller relaying prompt B's params with prompt A made the decode load
 * B's KV as A's and cache it; editing block ids read another request's KV). A decode refuses to
 * load with another prompt's, edited or unsigned params (it computes the prompt itself, counted in
 * pd:kv_params_refused_total); the genuine ones load. */
START_TEST(test_pull_params_bound)
{
    const char *dir = tu_mkdtemp("conn");
    char *tok = token_file(dir, "pull-secret");
    opts_t o = {"pull", PIPES[_i], tok, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *params = prefill_finish(&p, "req-p", pull_params_in(), P_BLOCKS, &hold);
    ck_assert(hold);
    ck_assert_uint_eq(strlen(json_string_value(json_object_get(params, "prompt_sha256"))), 64);
    ck_assert_uint_eq(strlen(json_string_value(json_object_get(params, "pd_sig"))), 64);
    int32_t prompt[PROMPT], other[PROMPT];
    prompt_ids(prompt);
    memcpy(other, prompt, sizeof(other));
    other[PROMPT - 1] += 1; /* the same length, one token apart */
    kv_conn_t *dk = (kv_conn_t *)d.c;
    const char *e = kv_params_verify(dk, params, prompt, PROMPT);
    ck_assert_msg(e == NULL, "genuine params refused: %s", e);
    e = kv_params_verify(dk, params, other, PROMPT);
    ck_assert_ptr_nonnull(e);
    ck_assert_ptr_nonnull(strstr(e, "another prompt"));
    ck_assert_ptr_nonnull(kv_params_verify(dk, params, prompt, PROMPT - 1));
    ck_assert_int_eq(would_load(&d, params), PROMPT); /* the decode's prompt is the prefill's */
    g_prompt_base = 4;                                /* another prompt of the same length */
    ck_assert_int_eq(would_load(&d, params), 0);
    g_prompt_base = 3;
    ck_assert_int_eq((int)metric(&d, "pd:kv_params_refused_total"), 1);
    /* each field the decode acts on, edited; then the signature left out */
    for (int k = 0; k < 8; k++) {
        json_t *t = json_deep_copy(params);
        switch (k) {
        case 0: json_array_set_new(json_object_get(t, "remote_block_ids"), 2, json_integer(3)); break;
        case 1: json_array_append_new(json_object_get(t, "remote_block_ids"), json_integer(3)); break;
        case 2: json_object_set_new(t, "remote_port", json_integer(1)); break;
        case 3: json_object_set_new(t, "remote_host", json_string("127.0.0.2")); break;
        case 4: json_object_set_new(t, "lease_id", json_integer(12345)); break;
        case 5: json_object_set_new(t, "first_token_id", json_integer(7)); break;
        case 6: json_object_del(t, "pd_sig"); break;
        case 7: json_object_set_new(t, "grammar_state", json_string("g1:0123456789abcdef:1:4")); break;
        }
        e = kv_params_verify(dk, t, prompt, PROMPT);
        ck_assert_msg(e != NULL, "edit %d accepted", k);
        ck_assert_msg(strstr(e, k == 6 ? "not signed" : "does not verify") != NULL, "edit %d: %s", k, e);
        ck_assert_msg(would_load(&d, t) == 0, "edit %d: would load", k);
        json_decref(t);
    }
    ck_assert_int_eq((int)metric(&d, "pd:kv_params_refused_total"), 9);
    /* a prompt hash made to match another prompt is caught by the signature */
    json_t *t = json_deep_copy(params);
    json_object_set_new(t, "prompt_sha256",
                        json_string("00000000000000000000000000000000000000000000000000000"
                                    "00000000000"));
    ck_assert_ptr_nonnull(kv_params_verify(dk, t, prompt, PROMPT));
    json_decref(t);
    /* the genuine params load (the signature survives a JSON round trip, as through pd-proxy) */
    char *text = json_dumps(params, 0);
    json_decref(params);
    params = json_loads(text, 0, NULL);
    free(text);
    ck_assert_ptr_null(kv_params_verify(dk, params, prompt, PROMPT));
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    expect_moved(&p, &d);
    pd_request_free(r);
    pair_stop(&p, &d);
    tu_rmrf(dir);
    free((void *)dir);
    free(tok);
}
END_TEST

/* Live migration (issue 48): a decode ending a running request for another decode to take over
 * (req->migrating) leases the KV of its computed tokens, prompt and outputs but the last, with
 * params signed for exactly those tokens; nothing is lent by a request that is not decoding yet or
 * not migrating. The taker, a request of the same prompt with those outputs resumed, loads every
 * token but the last into its blocks, as a handed-over request loads its prompt; one output apart,
 * it refuses the params and computes. */
#define MIG_OUT 4 /* outputs: 37 + 4 tokens, 40 computed = 10 blocks of 4 */

static pd_request_t *migrating(const char *id, json_t *params, int32_t computed)
{
    pd_request_t *r = request(id, params);
    for (int i = 0; i < MIG_OUT; i++) {
        ck_assert_int_eq(pd_request_append_token(r, 100 + i), PD_OK);
    }
    r->num_computed_tokens = computed;
    return r;
}

START_TEST(test_live_migration_lease)
{
    const char *dir = tu_mkdtemp("conn");
    char *tok = token_file(dir, "migration-secret");
    opts_t o = {"pull", PIPES[_i], tok, 0, 0, 0};
    node_t s, t;
    node_start(&s, "decode", 's', &o);
    node_start(&t, "decode", 't', &o);
    /* the source: an abort that is no migration, and a migration before decoding, lend nothing */
    for (int k = 0; k < 2; k++) {
        pd_request_t *r =
            migrating("run-s", json_pack("{s:b}", "do_remote_prefill", 0), PROMPT + MIG_OUT - 1 - k);
        r->migrating = k == 1;
        r->state = PD_REQ_FINISHED_ABORTED;
        void *out = NULL;
        ck_assert(!s.c->ops->request_finished(s.c, r, P_BLOCKS, NEED + 1, &out));
        ck_assert(out == NULL || json_is_null((json_t *)out));
        json_decref(out);
        pd_request_free(r);
    }
    pd_request_t *r = migrating("run-s", NULL, PROMPT + MIG_OUT - 1);
    r->migrating = true;
    r->state = PD_REQ_FINISHED_ABORTED;
    void *out = NULL;
    ck_assert(s.c->ops->request_finished(s.c, r, P_BLOCKS, NEED + 1, &out));
    json_t *params = out;
    ck_assert_ptr_nonnull(params);
    ck_assert_int_eq(json_integer_value(json_object_get(params, "remote_num_tokens")), PROMPT + MIG_OUT - 1);
    ck_assert(json_object_get(params, "first_token_id") == NULL);
    ck_assert(pd_kv_params_migrates(params, PROMPT + MIG_OUT - 1));
    ck_assert(!pd_kv_params_migrates(params, PROMPT + MIG_OUT));
    ck_assert_ptr_null(kv_params_verify((kv_conn_t *)t.c, params, r->tokens, PROMPT + MIG_OUT - 1));
    ck_assert_ptr_nonnull(kv_params_verify((kv_conn_t *)t.c, params, r->tokens, PROMPT));
    pd_request_free(r);
    ck_assert_int_eq((int)metric(&s, "pd:kv_migrations_lent_total"), 1);
    /* the taker with another output: refused, computed */
    pd_request_t *x = migrating("run-x", json_incref(params), 0);
    x->tokens[PROMPT + 1] += 1;
    int32_t ext = -1;
    bool async = true;
    ck_assert_int_eq(t.c->ops->get_num_new_matched_tokens(t.c, x, 0, &ext, &async), PD_OK);
    ck_assert_int_eq(ext, 0);
    ck_assert_int_eq((int)metric(&t, "pd:kv_params_refused_total"), 1);
    pd_request_free(x);
    /* the taker: every token's KV but the last, into its 10 blocks */
    pd_request_t *d = migrating("run-t", params, 0);
    pd_status_t alloc_st = PD_ERR_INTERNAL;
    ck_assert_int_eq(load_into(&t, d, D_BLOCKS, &async, &alloc_st), PROMPT + MIG_OUT);
    ck_assert(async);
    ck_assert_int_eq(alloc_st, PD_OK);
    int errors = 0;
    ck_assert(wait_finished(&t, "run-t", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    ck_assert(wait_finished(&s, "run-s", true, 3, NULL)); /* the read freed the source's blocks */
    for (int l = 0; l < LAYERS; l++) {
        for (int b = 0; b < NEED + 1; b++) {
            ck_assert_msg(memcmp(page(&t, l, D_BLOCKS[b]), page(&s, l, P_BLOCKS[b]), PAGE) == 0,
                          "layer %d block %d: not the source's bytes", l, b);
        }
    }
    ck_assert_int_eq((int)metric(&t, "pd:kv_migrations_loaded_total"), 1);
    pd_request_free(d);
    pair_stop(&s, &t);
    tu_rmrf(dir);
    free((void *)dir);
    free(tok);
}
END_TEST

/* Push: a decode request paired with a prefill request of another prompt under one transfer id (a
 * caller sending prompt B to the prefill and A to the decode) gets no KV: the prefill's WRITE_DONE
 * names its prompt's hash and the decode discards what was written (load errors: the failure policy
 * recomputes). Before issue 51 the decode took B's KV as A's. */
START_TEST(test_push_bound_to_prompt)
{
    opts_t o = {"push", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *out = prefill_finish(&p, "req-p", push_params_in("x-7"), P_BLOCKS, &hold);
    ck_assert(hold);
    json_decref(out);
    g_prompt_base = 4; /* the decode's request: another prompt of the same length */
    json_t *dp = push_params_out("x-7", pd_kv_connector_port(p.c));
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", dp, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, NEED);
    pd_request_free(r);
    pair_stop(&p, &d);
}
END_TEST

/* A relay at another address cannot put itself between two nodes (issue 51: a caller naming its own
 * host:port as remote_host/remote_port relayed the handshake to the real prefill, read both
 * identities and could inject frames). Both proofs cover the address the decode dialled and the one
 * the prefill advertises, so through the relay the handshake fails and the load ends as load errors,
 * while a relay the prefill itself advertises (a NAT, a Service) works
 * (test_abort_waits_for_the_reconnect). */
START_TEST(test_relay_cannot_join)
{
    const char *dir = tu_mkdtemp("conn");
    char *tok = token_file(dir, "relay-secret");
    for (int push = 0; push < 2; push++) {
        opts_t o = {push ? "push" : "pull", PIPES[_i], tok, 0, 0, 0};
        node_t p, d;
        pair_start(&p, &d, &o, NULL);
        fwd_t f;
        int fport = fwd_bind(&f, pd_kv_connector_port(p.c));
        fwd_start(&f);
        bool hold = false;
        json_t *in = push ? push_params_in("x-8") : pull_params_in();
        json_t *params = prefill_finish(&p, "req-p", in, P_BLOCKS, &hold);
        ck_assert(hold);
        if (push) {
            json_decref(params);
            params = push_params_out("x-8", fport);
        }
        json_object_set_new(params, "remote_host", json_string("127.0.0.1"));
        json_object_set_new(params, "remote_port", json_integer(fport)); /* the relay */
        if (!push) { /* pull: the port is signed; the decode does not even dial */
            ck_assert_int_eq(would_load(&d, params), 0);
            json_decref(params);
            fwd_stop(&f);
            pair_stop(&p, &d);
            continue;
        }
        int errors = 0;
        pd_request_t *r = decode_load(&d, "req-d", params, D_BLOCKS);
        ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
        ck_assert_msg(errors == NEED, "%s: the load through the relay succeeded", o.mode);
        ck_assert(metric(&d, "pd:kv_peers") <= 0);
        pd_request_free(r);
        fwd_stop(&f);
        pair_stop(&p, &d);
    }
    tu_rmrf(dir);
    free((void *)dir);
    free(tok);
}
END_TEST

/* A push decode that dies leaves its KV region imported on the prefill only while a transfer can
 * address it: its reservation's tombstone keeps the peer record until --kv-hold-timeout (30 s here),
 * but the region (UCX: the decode's whole KV cache mapped into the prefill) goes at once (issue 51:
 * +32 MiB of prefill RSS per decode death). */
START_TEST(test_dead_push_decode_region_released)
{
    opts_t o = {"push", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    bool hold = false;
    json_t *out = prefill_finish(&p, "req-p", push_params_in("x-3"), P_BLOCKS, &hold);
    json_decref(out);
    json_t *dp = push_params_out("x-3", pd_kv_connector_port(p.c));
    int errors = 0;
    pd_request_t *r = decode_load(&d, "req-d", dp, D_BLOCKS);
    ck_assert(wait_finished(&d, "req-d", false, 3, &errors));
    ck_assert_int_eq(errors, 0);
    ck_assert(wait_finished(&p, "req-p", true, 3, NULL));
    double end = tu_now() + 2;
    while (metric(&p, "pd:kv_imported_regions") != 1 && tu_now() < end) {
        usleep(2000);
    }
    ck_assert_int_eq((int)metric(&p, "pd:kv_imported_regions"), 1);
    pd_request_free(r);
    node_stop(&d); /* the decode dies */
    end = tu_now() + 3;
    while ((metric(&p, "pd:kv_peers") != 0 || metric(&p, "pd:kv_imported_regions") != 0) && tu_now() < end) {
        usleep(5000);
    }
    ck_assert_int_eq((int)metric(&p, "pd:kv_peers"), 0);
    ck_assert_msg(metric(&p, "pd:kv_imported_regions") == 0, "the dead decode's region is still imported");
    node_stop(&p);
}
END_TEST

/* A decode's open reservations may name at most twice its KV cache's blocks on a prefill (issue 51:
 * reservations from one peer were held without bound until --kv-hold-timeout): with 32 blocks, seven
 * reservations of 9 wait for their prefill requests, the eighth is refused at once (its load ends as
 * load errors) and the seven still wait. */
START_TEST(test_reservations_bounded_per_peer)
{
    opts_t o = {"push", PIPES[_i], NULL, 0, 0, 0};
    node_t p, d;
    pair_start(&p, &d, &o, NULL);
    pd_request_t *r[8];
    for (int i = 0; i < 8; i++) {
        char tid[16], rid[16];
        snprintf(tid, sizeof(tid), "r-%d", i);
        snprintf(rid, sizeof(rid), "req-d%d", i);
        json_t *dp = push_params_out(tid, pd_kv_connector_port(p.c));
        r[i] = decode_load(&d, rid, dp, D_BLOCKS);
        if (i < 7) { /* in order: each reservation is on the prefill before the next */
            double end = tu_now() + 2;
            while (metric(&p, "pd:kv_reservations") < i + 1 && tu_now() < end) {
                usleep(2000);
            }
            ck_assert_int_eq((int)metric(&p, "pd:kv_reservations"), i + 1);
        }
    }
    int errors = 0;
    ck_assert_msg(wait_finished(&d, "req-d7", false, 2, &errors), "the eighth reservation was not refused");
    ck_assert_int_eq(errors, NEED);
    ck_assert_int_eq((int)metric(&p, "pd:kv_reservations"), 7);
    ck_assert(!wait_finished(&d, "req-d0", false, 0.1, NULL));
    for (int i = 0; i < 8; i++) {
        pd_request_free(r[i]);
    }
    pair_stop(&p, &d);
}
END_TEST

/* vLLM's --kv-transfer-config maps onto the flags: connector names to pipes, kv_ip/kv_port to the
 * listener, extra keys to settings; a role the binary does not play, kv_both, an unknown connector,
 * key or extra key, or a wrong type is refused (nothing applied to the caller's keep). */
START_TEST(test_kv_transfer_config)
{
    pd_kv_connector_config_t c;
    json_t *keep = NULL;
    pd_kv_connector_config_defaults(&c);
    c.role = "prefill";
    ck_assert_int_eq(pd_kv_transfer_config_apply(NULL, &c, &keep), PD_OK);
    ck_assert_ptr_null(keep);
    ck_assert_int_eq(
        pd_kv_transfer_config_apply("{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\","
                                    "\"kv_ip\":\"127.0.0.1\",\"kv_port\":14579,"
                                    "\"kv_connector_extra_config\":{\"transfer_mode\":\"push\","
                                    "\"hold_timeout\":7.5,\"heartbeat_misses\":3}}",
                                    &c, &keep),
        PD_OK);
    ck_assert_str_eq(c.pipe, "ucx");
    ck_assert_str_eq(c.mode, "push");
    ck_assert_str_eq(c.listen, "127.0.0.1:14579");
    ck_assert(c.hold_timeout == 7.5 && c.heartbeat_misses == 3);
    json_decref(keep);
    pd_kv_connector_config_defaults(&c);
    c.role = "decode";
    ck_assert_int_eq(pd_kv_transfer_config_apply(
                         "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"kv_consumer\"}", &c, &keep),
                     PD_OK);
    ck_assert_str_eq(c.pipe, "nccl");
    json_decref(keep);
    c.listen = "10.1.2.3:9100"; /* kv_port alone keeps the listen host (never widens it to 0.0.0.0) */
    ck_assert_int_eq(pd_kv_transfer_config_apply("{\"kv_role\":\"kv_consumer\",\"kv_port\":9200}", &c, &keep),
                     PD_OK);
    ck_assert_str_eq(c.listen, "10.1.2.3:9200");
    json_decref(keep);
    const char *bad[] = {
        "{\"kv_role\":\"kv_producer\"}", /* a decode is a kv_consumer */
        "{\"kv_role\":\"kv_both\"}",     /* no such process here */
        "{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_consumer\"}", /* not implemented */
        "{\"kv_role\":\"kv_consumer\",\"kv_rank\":1}",                           /* an unsupported key */
        "{\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":{\"backends\":[\"UCX\"]}}",
        "{\"kv_role\":\"kv_consumer\",\"kv_connector_extra_config\":{\"hold_timeout\":\"5\"}}",
        "{\"kv_role\":\"kv_consumer\",\"kv_port\":70000}",
        "{\"kv_role\":\"kv_consumer\",\"kv_connector\":3}",
        "[1]",
        "{oops",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        keep = NULL;
        ck_assert_msg(pd_kv_transfer_config_apply(bad[i], &c, &keep) == PD_ERR_INVALID_ARG, "accepted %s",
                      bad[i]);
        ck_assert_ptr_null(keep);
    }
}
END_TEST

/* ------------------------------------------------------------------ failing allocations */

static int g_fa_pipe;  /* PIPES[g_fa_pipe] */
static bool g_fa_push; /* push mode (the prefill finishes first: the late-reservation path) */

/* Polls get_finished until id is reported or timeout_s passes (no assertions); load errors are
 * added to *errors. -1: get_finished failed. */
static int fa_wait_finished(node_t *n, const char *id, bool sending, double timeout_s, int *errors)
{
    for (double end = tu_now() + timeout_s; tu_now() < end; usleep(1000)) {
        pd_connector_finished_t f;
        if (n->c->ops->get_finished(n->c, &f) != PD_OK) {
            return -1;
        }
        uint32_t ids[64];
        *errors += n->c->ops->get_block_ids_with_load_errors(n->c, ids, 64);
        for (int32_t i = 0; i < (sending ? f.num_sending : f.num_recving); i++) {
            if (strcmp((sending ? f.sending : f.recving)[i], id) == 0) {
                return 1;
            }
        }
    }
    return 0;
}

/* A prefill and a decode connector over PIPES[g_fa_pipe] from nothing back to nothing, one pull
 * (or push) transfer between them, with any allocation failing (fail_alloc.h). Whatever failed: a
 * pull prefill that holds blocks handed on params; the decode's load ends (finished_recving, with
 * or without load errors) within its timeout, unless the connector refused to start it (the
 * scheduler then fails the request); a load reported without errors moved the right bytes; the
 * prefill's held blocks are reported in finished_sending (READ_DONE/WRITE_DONE or the hold
 * timeout); and with nothing failing, all of it worked. */
static int fa_connector(void)
{
    int wrong = 0, errors = 0;
    node_t p = {0}, d = {0};
    pd_request_t *rp = NULL, *rd = NULL;
    json_t *params = NULL;
    int32_t prompt[PROMPT];
    prompt_ids(prompt);
    pd_request_params_t rpar;
    memset(&rpar, 0, sizeof(rpar));
    rpar.max_tokens = 4;
    opts_t o = {g_fa_push ? "push" : "pull", PIPES[g_fa_pipe], NULL, 1, 1, 0};
    if (node_try_start(&p, "prefill", 'p', &o) != PD_OK || node_try_start(&d, "decode", 'd', &o) != PD_OK ||
        pd_request_create("req-p", prompt, PROMPT, &rpar, 128, &rp) != PD_OK) {
        goto out;
    }
    rp->kv_transfer_params = g_fa_push ? push_params_in("x-1") : pull_params_in();
    if (rp->kv_transfer_params == NULL) {
        goto out;
    }
    rp->state = PD_REQ_FINISHED_LENGTH;
    void *outp = NULL;
    bool hold = p.c->ops->request_finished(p.c, rp, P_BLOCKS, NEED + 1, &outp);
    params = outp;
    if (g_fa_push) { /* push: the proxy hands the decode its own params */
        json_decref(params);
        params = hold ? push_params_out("x-1", pd_kv_connector_port(p.c)) : NULL;
    } else if (hold && params == NULL) {
        fprintf(stderr, "fa_connector: the prefill holds blocks but handed on no params\n");
        wrong++;
    }
    if (params == NULL || pd_request_create("req-d", prompt, PROMPT, &rpar, 128, &rd) != PD_OK) {
        goto out_prefill;
    }
    rd->kv_transfer_params = json_incref(params);
    int32_t ext = 0;
    bool async = false;
    if (d.c->ops->get_num_new_matched_tokens(d.c, rd, 0, &ext, &async) != PD_OK || ext <= 0) {
        goto out_prefill; /* nothing to load: the scheduler prefills it locally */
    }
    if (d.c->ops->update_state_after_alloc(d.c, rd, D_BLOCKS, NEED + 1, ext) != PD_OK) {
        goto out_decode; /* refused: the scheduler ends the request with an error */
    }
    pd_scheduler_output_t so;
    memset(&so, 0, sizeof(so));
    void *meta = d.c->ops->build_connector_meta(d.c, &so);
    if (d.c->ops->bind_connector_metadata(d.c, meta) == PD_OK) {
        d.c->ops->start_load_kv(d.c);
    }
    /* the load must end: with its bytes, or with load errors (the scheduler's policy then runs) */
    int got = fa_wait_finished(&d, "req-d", false, 1 + 2, &errors);
    if (got == 0) {
        fprintf(stderr, "fa_connector: the decode's load neither finished nor failed in its timeout\n");
        wrong++;
    } else if (got == 1 && errors == 0) {
        for (int l = 0; l < LAYERS; l++) {
            for (int i = 0; i < NEED; i++) {
                if (memcmp(page(&d, l, D_BLOCKS[i]), page(&p, l, P_BLOCKS[i]), PAGE) != 0) {
                    fprintf(stderr, "fa_connector: a load without errors left wrong bytes (layer %d)\n", l);
                    wrong++;
                    l = LAYERS;
                    break;
                }
            }
        }
    }
    if (!tu_fail_alloc_hit() && (got != 1 || errors != 0)) {
        fprintf(stderr, "fa_connector: with no allocation failing, the load did not work\n");
        wrong++;
    }
out_decode:
    rd->state = PD_REQ_FINISHED_LENGTH;
    void *dout = NULL;
    d.c->ops->request_finished(d.c, rd, D_BLOCKS, NEED + 1, &dout);
    json_decref(dout);
out_prefill:
    if (hold) { /* READ_DONE or the decode's ABORT frees them; the hold timeout (1 s) at the latest */
        int e2 = 0;
        if (fa_wait_finished(&p, "req-p", true, 1 + 2, &e2) == 0) {
            fprintf(stderr, "fa_connector: the prefill's held blocks were never reported free\n");
            wrong++;
        }
    }
out:
    json_decref(params);
    if (rd != NULL) {
        json_decref(rd->kv_transfer_params), rd->kv_transfer_params = NULL;
        pd_request_free(rd);
    }
    if (rp != NULL) {
        json_decref(rp->kv_transfer_params), rp->kv_transfer_params = NULL;
        pd_request_free(rp);
    }
    node_stop(&d);
    node_stop(&p);
    return wrong;
}

static int fa_pull_tcp(void)
{
    g_fa_pipe = 0;
    return fa_connector();
}

static int fa_pull_ucx(void)
{
    g_fa_pipe = 1;
    return fa_connector();
}

static int fa_push_tcp(void)
{
    g_fa_pipe = 0, g_fa_push = true;
    return fa_connector();
}

static int fa_push_ucx(void)
{
    g_fa_pipe = 1, g_fa_push = true;
    return fa_connector();
}

/* ------------------------------------------------------------------ each half alone */

/* Takes the commands the engine half sent (no control thread runs: the node was not started). */
static int take_commands(node_t *n, pd_list_link_t *out)
{
    pd_list_head_init(out);
    kv_mb_take(&((kv_conn_t *)n->c)->mb, false, out, 0, false);
    return (int)pd_list_length(out);
}

static kv_msg_t *pop_command(pd_list_link_t *in, kv_msg_kind_t want)
{
    kv_msg_t *m = pd_list_pop_head(in, kv_msg_t, link);
    ck_assert_ptr_nonnull(m);
    ck_assert_int_eq(m->kind, want);
    return m;
}

/* The engine half of a decode, with no control thread: the load it starts is a command naming the
 * entries to move; a request that ends while it loads holds its blocks and sends a cancel; the
 * load's end, emitted as the control thread would, is reported once by get_finished (with the
 * first token it carried), after which the request no longer holds anything. */
START_TEST(test_decode_engine_half_alone)
{
    opts_t o = {"push", "tcp", NULL, 0, 0, 0};
    node_t d;
    ck_assert_int_eq(node_try_make(&d, "decode", 'd', &o, false), PD_OK);
    kv_conn_t *k = (kv_conn_t *)d.c;
    pd_request_t *r = decode_load(&d, "req-a", push_params_out("t-a", 9), D_BLOCKS);
    pd_list_link_t in;
    ck_assert_int_eq(take_commands(&d, &in), 1);
    kv_xfer_t *x = pd_container_of(pop_command(&in, KV_CMD_LOAD), kv_xfer_t, msg);
    ck_assert_int_eq(x->kind, KV_X_PUSH_LOAD);
    ck_assert_str_eq(x->req_id, "req-a");
    ck_assert_str_eq(x->remote_req, "t-a");
    ck_assert_str_eq(x->dial, "127.0.0.1:9");
    ck_assert_int_eq(x->first_block, 0);
    ck_assert_int_eq(x->end_block, NEED);
    ck_assert_ptr_null(x->cancel); /* the engine keeps it */

    void *out = NULL;
    r->state = PD_REQ_FINISHED_ABORTED;
    ck_assert(d.c->ops->request_finished(d.c, r, D_BLOCKS, NEED + 1, &out)); /* a peer may still write */
    json_decref(out);
    ck_assert_int_eq(take_commands(&d, &in), 1);
    kv_cancel_t *cn = pd_container_of(pop_command(&in, KV_CMD_CANCEL), kv_cancel_t, msg);
    ck_assert_str_eq(cn->req_id, "req-a");
    kv_msg_free(&cn->msg);

    /* the control thread ends the load (cancelled: no load errors) and emits its report */
    x->report->recving = true;
    x->report->first_token = 7;
    kv_mb_emit(&k->mb, &x->report->msg);
    x->report = NULL;
    kv_xfer_free(x);
    pd_connector_finished_t f;
    ck_assert_int_eq(d.c->ops->get_finished(d.c, &f), PD_OK);
    ck_assert_int_eq(f.num_recving, 1);
    ck_assert_int_eq(f.num_sending, 0);
    ck_assert_str_eq(f.recving[0], "req-a");
    ck_assert_int_eq(f.recving_first_token[0], 7);
    uint32_t ids[8];
    ck_assert_int_eq(d.c->ops->get_block_ids_with_load_errors(d.c, ids, 8), 0);
    ck_assert_int_eq(d.c->ops->get_finished(d.c, &f), PD_OK);
    ck_assert_int_eq(f.num_recving, 0);
    /* reported: ending it again holds nothing and sends nothing */
    ck_assert(!d.c->ops->request_finished(d.c, r, D_BLOCKS, NEED + 1, &out));
    json_decref(out);
    ck_assert_int_eq(take_commands(&d, &in), 0);
    pd_request_free(r);
    node_stop(&d);
}
END_TEST

/* Peer-to-peer prefix fetch: which node takes which kv_transfer_params (a lend is any node's, pull
 * only; a kv_prefix a prefill's, or a decode's without a remote prefill: a stream resumed after its
 * decode died), and the fetch-or-compute model's arithmetic. */
START_TEST(test_prefix_fetch_params)
{
    opts_t o = {"pull", "tcp", NULL, 0, 0, 0};
    node_t p, d;
    ck_assert_int_eq(node_try_make(&p, "prefill", 'p', &o, false), PD_OK);
    ck_assert_int_eq(node_try_make(&d, "decode", 'd', &o, false), PD_OK);
    struct {
        const char *params;
        bool prefill_ok, decode_ok;
    } cases[] = {
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"kv_lend_min_tokens\": 32}", true, true},
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"transfer_mode\": \"push\"}", false, false},
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"first_token\": true}", false, false},
        {"{\"kv_lend\": true}", false, false},
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"kv_lend_min_tokens\": -1}", false, false},
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"kv_lend_min_tokens\": \"32\"}", false, false},
        {"{\"do_remote_decode\": true, \"kv_prefix\": {\"remote_host\": \"127.0.0.1\"}}", true, false},
        {"{\"do_remote_decode\": true, \"kv_prefix\": 7}", false, false},
        {"{\"do_remote_decode\": true, \"kv_lend\": true, \"kv_prefix\": {}}", false, false},
        {"{\"do_remote_prefill\": true, \"kv_prefix\": {}}", false, false},
        {"{\"kv_prefix\": {\"remote_host\": \"127.0.0.1\"}}", true, true},
        {"{\"do_remote_decode\": true}", true, false},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *j = json_loads(cases[i].params, 0, NULL);
        ck_assert_ptr_nonnull(j);
        const char *pe = p.c->ops->params_error(p.c, j), *de = d.c->ops->params_error(d.c, j);
        ck_assert_msg((pe == NULL) == cases[i].prefill_ok, "prefill, %s: %s", cases[i].params,
                      pe ? pe : "ok");
        ck_assert_msg((de == NULL) == cases[i].decode_ok, "decode, %s: %s", cases[i].params, de ? de : "ok");
        json_decref(j);
    }
    /* a lend the node's cache cannot cover is refused before anything is computed */
    pd_request_t *r = request("lend-a", json_pack("{s:b, s:b, s:s, s:i}", "do_remote_decode", 1, "kv_lend", 1,
                                                  "transfer_mode", "pull", "kv_lend_min_tokens", 48));
    int32_t ext = -1;
    bool async = true;
    ck_assert_int_eq(d.c->ops->get_num_new_matched_tokens(d.c, r, 32, &ext, &async), PD_ERR_REJECTED);
    ck_assert_int_eq(d.c->ops->get_num_new_matched_tokens(d.c, r, 48, &ext, &async), PD_OK);
    ck_assert(ext == 0 && !async);
    pd_request_free(r);
    /* fetch = overhead + bytes / bandwidth against the engine's compute estimate */
    double f;
    ck_assert(pd_kv_fetch_pays(64e6, 1e-3, 10e9, 0.205, &f)); /* 7.4 ms vs 205 ms */
    ck_assert_double_eq_tol(f, 1e-3 + 6.4e-3, 1e-12);
    ck_assert(!pd_kv_fetch_pays(64e6, 1e-3, 1e9, 64e-6, &f)); /* 65 ms vs 64 µs */
    ck_assert(pd_kv_fetch_pays(1e6, 1e-3, 1e9, 0, &f));       /* compute unknown: fetch */
    ck_assert(!pd_kv_fetch_pays(1e6, 1e-3, 0, 1.0, &f));      /* bandwidth unknown */
    node_stop(&d);
    node_stop(&p);
}
END_TEST

/* The engine half of a push prefill, with no control thread: a reservation offered before the
 * request's first step binds at layer 0 (a take command), each layer's pages go out as write jobs
 * addressed into the offer's blocks, wait_for_save returns once the step's jobs come back done, and
 * the finished request ends its stream (WRITE_DONE, status 0, its prompt's hash) and frees its
 * blocks at once. A request without a reservation by its end holds them for a late write. */
START_TEST(test_prefill_engine_half_alone)
{
    opts_t o = {"push", "tcp", NULL, 0, 0, 0};
    node_t p;
    ck_assert_int_eq(node_try_make(&p, "prefill", 'p', &o, false), PD_OK);
    kv_conn_t *k = (kv_conn_t *)p.c;
    kv_offer_t *of = calloc(1, sizeof(*of));
    of->msg.kind = KV_EV_OFFER;
    of->resv_id = 42;
    snprintf(of->transfer_id, sizeof(of->transfer_id), "t-s");
    of->blocks = malloc((NEED + 1) * sizeof(uint32_t));
    memcpy(of->blocks, D_BLOCKS, sizeof(D_BLOCKS));
    of->num_blocks = NEED;
    of->page_bytes = PAGE;
    for (int l = 0; l < LAYERS; l++) {
        of->layer_offset[l] = (uint64_t)l * BLOCKS * PAGE + 1000000; /* the decode's layout */
    }
    kv_mb_emit(&k->mb, &of->msg);

    pd_request_t *r = request("req-s", push_params_in("t-s"));
    r->block_ids = malloc((NEED + 1) * sizeof(uint32_t));
    memcpy(r->block_ids, P_BLOCKS, sizeof(P_BLOCKS));
    r->num_blocks = NEED + 1;
    pd_sched_item_t item = {r, PROMPT};
    pd_scheduler_output_t so;
    memset(&so, 0, sizeof(so));
    so.items = &item;
    so.num_items = 1;
    so.total_tokens = PROMPT;
    ck_assert_int_eq(p.c->ops->bind_connector_metadata(p.c, p.c->ops->build_connector_meta(p.c, &so)), PD_OK);
    pd_list_link_t in;
    for (int l = 0; l < LAYERS; l++) {
        ck_assert_int_eq(p.c->ops->save_kv_layer(p.c, l), PD_OK);
        ck_assert_int_eq(take_commands(&p, &in), l == 0 ? 2 : 1);
        if (l == 0) {
            kv_msg_t *t = pop_command(&in, KV_CMD_TAKE_RESV);
            ck_assert_int_eq(pd_container_of(t, kv_resv_ref_t, msg)->resv_id, 42);
            kv_msg_free(t);
        }
        kv_write_job_t *j = pd_container_of(pop_command(&in, KV_CMD_WRITE_JOB), kv_write_job_t, msg);
        ck_assert_int_eq(j->resv_id, 42);
        ck_assert_int_eq(j->num_pages, NEED); /* the last token's block stays */
        for (int i = 0; i < NEED; i++) {
            ck_assert_uint_eq(j->pages[i].local_off,
                              (uint64_t)l * BLOCKS * PAGE + (uint64_t)P_BLOCKS[i] * PAGE);
            ck_assert_uint_eq(j->pages[i].remote_off,
                              (uint64_t)l * BLOCKS * PAGE + 1000000 + (uint64_t)D_BLOCKS[i] * PAGE);
        }
        j->status = PD_OK; /* written, as the control thread reports it */
        j->msg.kind = KV_EV_JOB_DONE;
        kv_mb_emit(&k->mb, &j->msg);
    }
    ck_assert_int_eq(p.c->ops->wait_for_save(p.c), PD_OK);

    r->state = PD_REQ_FINISHED_LENGTH;
    r->num_computed_tokens = PROMPT;
    void *out = NULL;
    ck_assert(!p.c->ops->request_finished(p.c, r, P_BLOCKS, NEED + 1, &out)); /* streamed: nothing held */
    ck_assert_int_eq(take_commands(&p, &in), 1);
    kv_notice_t *n = pd_container_of(pop_command(&in, KV_CMD_WRITE_DONE), kv_notice_t, msg);
    ck_assert_int_eq(n->resv_id, 42);
    ck_assert_int_eq(n->status, 0);
    ck_assert_int_eq(n->first_token, -1);
    uint8_t hash[32];
    kv_prompt_hash(r->tokens, r->num_prompt_tokens, hash);
    ck_assert(memcmp(n->prompt_hash, hash, 32) == 0);
    kv_msg_free(&n->msg);
    pd_request_free(r);

    /* no reservation by its end: a late whole-prompt write holds the blocks */
    bool hold = false;
    json_decref(prefill_finish(&p, "req-late", push_params_in("t-late"), P_BLOCKS, &hold));
    ck_assert(hold);
    ck_assert_int_eq(take_commands(&p, &in), 1);
    kv_xfer_t *x = pd_container_of(pop_command(&in, KV_CMD_PUSH_SAVE), kv_xfer_t, msg);
    ck_assert_str_eq(x->remote_req, "t-late");
    ck_assert_int_eq(x->resv_id, 0);
    kv_xfer_free(x);
    node_stop(&p);
}
END_TEST

/* Takes the events the control thread emitted, waiting up to 2 s for the first. */
static int take_events(node_t *n, pd_list_link_t *out)
{
    pd_list_head_init(out);
    kv_mb_take(&((kv_conn_t *)n->c)->mb, true, out, tu_now() + 2, false);
    return (int)pd_list_length(out);
}

/* The control half of a prefill, driven by commands alone (no scheduler or worker call): a lease
 * sent to it is released by the proxy's call and its report comes back as an event; a write job
 * for a reservation it never had comes back failed; a cancel of a load it does not know, and a
 * stream's end for an unknown reservation, change nothing. */
START_TEST(test_prefill_control_half_alone)
{
    opts_t o = {"pull", PIPES[_i], NULL, 0, 0, 0};
    node_t p;
    node_start(&p, "prefill", 'p', &o);
    kv_conn_t *k = (kv_conn_t *)p.c;
    kv_lease_t *l = calloc(1, sizeof(*l));
    l->msg.kind = KV_CMD_LEASE;
    snprintf(l->req_id, sizeof(l->req_id), "req-l");
    snprintf(l->transfer_id, sizeof(l->transfer_id), "t-l");
    l->lease_id = 77;
    l->expires = tu_now() + 30;
    l->report = kv_report_new("req-l", false);
    kv_mb_send(&k->mb, &l->msg, 0);
    kv_cancel_t *cn = calloc(1, sizeof(*cn));
    cn->msg.kind = KV_CMD_CANCEL;
    snprintf(cn->req_id, sizeof(cn->req_id), "nobody");
    kv_mb_send(&k->mb, &cn->msg, 0);
    kv_notice_t *nd = calloc(1, sizeof(*nd));
    nd->msg.kind = KV_CMD_WRITE_DONE;
    nd->resv_id = 12345;
    kv_mb_send(&k->mb, &nd->msg, 0);
    ck_assert(!pd_kv_connector_release(p.c, "req-l", 78, NULL)); /* another lease id */
    ck_assert(pd_kv_connector_release(p.c, "req-l", 77, NULL));
    pd_list_link_t in;
    ck_assert_int_eq(take_events(&p, &in), 1);
    kv_msg_t *m = pd_list_pop_head(&in, kv_msg_t, link);
    ck_assert_int_eq(m->kind, KV_EV_REPORT);
    kv_report_t *r = pd_container_of(m, kv_report_t, msg);
    ck_assert_str_eq(r->req_id, "req-l");
    ck_assert(!r->recving);
    kv_report_free(r);

    kv_write_job_t *j = calloc(1, sizeof(*j));
    j->msg.kind = KV_CMD_WRITE_JOB;
    j->resv_id = 999;
    j->pages = calloc(1, sizeof(*j->pages));
    j->num_pages = 1;
    kv_mb_send(&k->mb, &j->msg, 0);
    ck_assert_int_eq(take_events(&p, &in), 1);
    m = pd_list_pop_head(&in, kv_msg_t, link);
    ck_assert_int_eq(m->kind, KV_EV_JOB_DONE);
    ck_assert_int_eq(pd_container_of(m, kv_write_job_t, msg)->status, PD_ERR_PEER_GONE);
    kv_msg_free(m);
    ck_assert_int_eq(take_events(&p, &in), 0); /* nothing else came */
    node_stop(&p);
}
END_TEST

/* ------------------------------------------------------------------ the mailbox (kv_mail.h) */

/* Answers every call (releases) it takes until a STOP, as the control thread does. */
static void *mb_answerer(void *arg)
{
    kv_mb_t *mb = arg;
    for (;;) {
        pd_list_link_t in;
        pd_list_head_init(&in);
        kv_mb_take(mb, false, &in, 0, false);
        kv_msg_t *m;
        while ((m = pd_list_pop_head(&in, kv_msg_t, link)) != NULL) {
            if (m->kind == KV_CMD_STOP) {
                return NULL;
            }
            pd_container_of(m, kv_release_t, msg)->released = true;
            kv_mb_emit(mb, m);
        }
        struct timespec nap = {0, 1000 * 1000};
        nanosleep(&nap, NULL);
    }
}

/* Commands and events keep their order; a call is answered; one nobody answers in time is
 * abandoned (the answerer frees it: no leak, no double free under ASan); closing answers the calls
 * still queued and every later call at once. */
START_TEST(test_mailbox)
{
    kv_mb_t mb;
    kv_mb_init(&mb);
    for (int i = 0; i < 3; i++) {
        kv_report_t *r = kv_report_new(i == 0 ? "a" : i == 1 ? "b" : "c", false);
        ck_assert_ptr_nonnull(r);
        kv_mb_emit(&mb, &r->msg);
    }
    pd_list_link_t got;
    pd_list_head_init(&got);
    kv_mb_take(&mb, true, &got, pd_time_now_s() + 1, false);
    ck_assert_int_eq((int)pd_list_length(&got), 3);
    const char *want[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
        kv_report_t *r = pd_container_of(pd_list_pop_link(&got), kv_report_t, msg.link);
        ck_assert_str_eq(r->req_id, want[i]);
        kv_report_free(r);
    }
    double t0 = pd_time_now_s();
    kv_mb_take(&mb, true, &got, t0 + 0.05, false); /* nothing queued: waits until the deadline */
    ck_assert(pd_list_is_empty(&got) && pd_time_now_s() - t0 >= 0.04);

    /* a call nobody answers is abandoned; answered later, it is freed by the answerer */
    kv_release_t *late = calloc(1, sizeof(*late));
    late->msg.kind = KV_CMD_RELEASE;
    ck_assert(!kv_mb_send(&mb, &late->msg, 0.02));
    kv_mb_take(&mb, false, &got, 0, false);
    ck_assert_int_eq((int)pd_list_length(&got), 1);
    ck_assert_ptr_eq(pd_list_pop_link(&got), &late->msg.link);
    kv_mb_emit(&mb, &late->msg);

    /* answered by another thread */
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, mb_answerer, &mb), 0);
    for (int i = 0; i < 20; i++) {
        kv_release_t *r = calloc(1, sizeof(*r));
        r->msg.kind = KV_CMD_RELEASE;
        ck_assert(kv_mb_send(&mb, &r->msg, 5.0));
        ck_assert(r->released);
        free(r);
    }
    kv_msg_t stop = {KV_CMD_STOP, KV_CALL_NONE, {NULL, NULL}};
    kv_mb_send(&mb, &stop, 0);
    pthread_join(th, NULL);

    /* closed: queued calls and later ones are answered at once, unreleased */
    kv_release_t *r = calloc(1, sizeof(*r));
    r->msg.kind = KV_CMD_RELEASE;
    kv_mb_take(&mb, false, &got, 0, true);
    ck_assert(pd_list_is_empty(&got));
    ck_assert(kv_mb_send(&mb, &r->msg, 5.0));
    ck_assert(!r->released);
    free(r);
    kv_mb_destroy(&mb);
}
END_TEST

static const tu_fa_scenario_t FA_SCENARIOS[] = {
    {"connector_pull_tcp", fa_pull_tcp, NULL},
    {"connector_pull_ucx", fa_pull_ucx, NULL},
    {"connector_push_tcp", fa_push_tcp, NULL},
    {"connector_push_ucx", fa_push_ucx, NULL},
};
#define FA_NUM ((int)(sizeof(FA_SCENARIOS) / sizeof(FA_SCENARIOS[0])))

START_TEST(test_fail_alloc)
{
    tu_fail_alloc_loop(FA_SCENARIOS[_i].name, 5000, 60);
}
END_TEST

int main(void)
{
    tu_fail_alloc_child(FA_SCENARIOS, FA_NUM);
    pd_log_set_level(getenv("PD_LOG_LEVEL") ? pd_log_level() : PD_LOG_OFF);
    Suite *s = suite_create("connector");
    TCase *tc = tcase_create("connector");
    tcase_set_timeout(tc, 60);
    int np = (int)(sizeof(PIPES) / sizeof(PIPES[0]));
    tcase_add_loop_test(tc, test_pull_moves_the_right_pages, 0, np);
    tcase_add_loop_test(tc, test_push_into_a_late_reservation, 0, np);
    tcase_add_loop_test(tc, test_push_streams_layers, 0, np);
    tcase_add_loop_test(tc, test_expired_lease_is_stale, 0, np);
    tcase_add_loop_test(tc, test_release_frees_at_once, 0, np);
    tcase_add_loop_test(tc, test_failed_loads_are_load_errors, 0, np);
    tcase_add_loop_test(tc, test_push_waits_end, 0, np);
    tcase_add_loop_test(tc, test_abort_during_load, 0, np);
    tcase_add_loop_test(tc, test_abort_waits_for_the_reconnect, 0, np);
    tcase_add_test(tc, test_kv_transfer_config);
    tcase_add_loop_test(tc, test_pull_params_bound, 0, np);
    tcase_add_loop_test(tc, test_live_migration_lease, 0, np);
    tcase_add_loop_test(tc, test_push_bound_to_prompt, 0, np);
    tcase_add_loop_test(tc, test_relay_cannot_join, 0, np);
    tcase_add_loop_test(tc, test_dead_push_decode_region_released, 0, np);
    tcase_add_loop_test(tc, test_reservations_bounded_per_peer, 0, np);
    tcase_add_loop_test(tc, test_hostile_authenticated_peer, 0, np);
    tcase_add_loop_test(tc, test_peer_deaths_leave_nothing, 0, np);
    tcase_add_loop_test(tc, test_control_listener_emfile_backoff, 0, np);
    tcase_add_test(tc, test_mailbox);
    tcase_add_test(tc, test_decode_engine_half_alone);
    tcase_add_test(tc, test_prefill_engine_half_alone);
    tcase_add_test(tc, test_prefix_fetch_params);
    tcase_add_loop_test(tc, test_prefill_control_half_alone, 0, np);
    suite_add_tcase(s, tc);
    tu_fail_alloc_add(s, test_fail_alloc, FA_NUM);
    return tu_run_suite(s);
}
