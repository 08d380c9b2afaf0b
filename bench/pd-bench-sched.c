/* bench/pd-bench-sched.c — scheduler overhead with the model forward left out:
 *   1. µs per step (schedule + update) with 16 / 256 / 1024 running decode requests
 *   2. block pool take+free operations per second (single blocks and runs of 16)
 * Baseline in the same run: the cost of touching the same number of requests' state with a
 * plain loop (what any scheduler must at least do), to read the ratio against.
 * Goal (issue #3): < 20 µs per step at 256 running requests. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "common/flags.h"
#include "common/log.h"
#include "common/time.h"
#include "scheduler/scheduler.h"

static double step_us(int32_t n_running, int32_t steps, double *baseline_us)
{
    pd_scheduler_config_t c;
    memset(&c, 0, sizeof(c));
    c.max_num_seqs = n_running;
    c.max_num_batched_tokens = 64 * n_running; /* every prompt in one step */
    c.max_model_len = 4096;
    c.block_size = 16;
    c.num_blocks = (uint32_t)(n_running * 40 + 16);
    c.enable_prefix_caching = true;
    c.enable_chunked_prefill = true;
    pd_scheduler_t *s = NULL;
    if (pd_scheduler_create(&c, NULL, &s) != PD_OK) {
        return -1;
    }
    int32_t prompt[64];
    for (int32_t r = 0; r < n_running; r++) {
        for (int i = 0; i < 64; i++) {
            prompt[i] = 1 + (r * 64 + i) % 30000; /* distinct prompts: no prefix sharing */
        }
        pd_request_params_t p;
        memset(&p, 0, sizeof(p));
        p.max_tokens = 4000;
        p.sampling.top_p = 1;
        pd_request_t *req = NULL;
        char id[32];
        snprintf(id, sizeof(id), "r%d", r);
        pd_request_create(id, prompt, 64, &p, 4096, &req);
        pd_scheduler_add_request(s, req);
    }
    int32_t *sampled = malloc((size_t)n_running * sizeof(int32_t));
    for (int32_t i = 0; i < n_running; i++) {
        sampled[i] = 7;
    }
    pd_model_output_t mo;
    memset(&mo, 0, sizeof(mo));
    mo.sampled = sampled;
    pd_scheduler_update_result_t res;
    /* prefill step, then steady decode */
    const pd_scheduler_output_t *o = pd_scheduler_schedule(s);
    pd_scheduler_update(s, o, &mo, &res);
    double t0 = pd_time_now_s();
    for (int32_t k = 0; k < steps; k++) {
        o = pd_scheduler_schedule(s);
        pd_scheduler_update(s, o, &mo, &res);
    }
    double per = (pd_time_now_s() - t0) / steps * 1e6;
    /* baseline: visit each running request and append a token, nothing else */
    pd_scheduler_stats_t st;
    pd_scheduler_get_stats(s, &st);
    int32_t *toks = calloc((size_t)n_running * 4096, sizeof(int32_t));
    int32_t *lens = calloc((size_t)n_running, sizeof(int32_t));
    t0 = pd_time_now_s();
    for (int32_t k = 0; k < steps; k++) {
        for (int32_t r = 0; r < n_running; r++) {
            toks[(size_t)r * 4096 + lens[r] % 4096] = sampled[r];
            lens[r]++;
        }
    }
    *baseline_us = (pd_time_now_s() - t0) / steps * 1e6;
    volatile int32_t sink = toks[lens[0] % 4096];
    (void)sink;
    free(toks), free(lens), free(sampled);
    pd_scheduler_destroy(s);
    return per;
}

static double pool_mops(uint32_t run, uint64_t iters)
{
    pd_block_pool_t *p = NULL;
    pd_block_pool_create(100000, true, &p);
    uint32_t ids[16];
    double t0 = pd_time_now_s();
    for (uint64_t i = 0; i < iters; i++) {
        pd_block_pool_take(p, run, ids);
        pd_block_pool_free(p, ids, run);
    }
    double dt = pd_time_now_s() - t0;
    pd_block_pool_destroy(p);
    return (double)iters * run * 2 / dt / 1e6; /* take + free per block */
}

int main(int argc, char **argv)
{
    const char *results = NULL;
    pd_flag_t flags[] = {{"results", PD_FLAG_STR, &results, "append the table to this markdown file", NULL}};
    pd_status_t st =
        pd_flags_parse(flags, 1, argc, argv, "usage: pd-bench-sched [--results bench/RESULTS.md]", NULL);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    pd_log_set_level(PD_LOG_WARN);
    char rows[8][160];
    int nrows = 0;
    printf("%-44s %14s %28s %8s\n", "benchmark", "result", "baseline (same run)", "ratio");
    int32_t sizes[3] = {16, 256, 1024};
    for (int i = 0; i < 3; i++) {
        double base = 0, us = step_us(sizes[i], sizes[i] >= 1024 ? 400 : 2000, &base);
        snprintf(rows[nrows], sizeof(rows[0]),
                 "| scheduler step, %d running decodes | %.2f µs | plain token append %.2f µs | %.1fx |",
                 sizes[i], us, base, us / base);
        char name[64];
        snprintf(name, sizeof(name), "scheduler step, %d running decodes", sizes[i]);
        printf("%-44s %11.2f us %21.2f us %7.1fx\n", name, us, base, us / base);
        nrows++;
    }
    double m1 = pool_mops(1, 5000000), m16 = pool_mops(16, 500000);
    snprintf(rows[nrows++], sizeof(rows[0]), "| block pool take+free, 1 block | %.1f M ops/s | | |", m1);
    snprintf(rows[nrows++], sizeof(rows[0]), "| block pool take+free, runs of 16 | %.1f M ops/s | | |", m16);
    printf("%-44s %9.1f Mop/s\n%-44s %9.1f Mop/s\n", "block pool take+free, 1 block", m1,
           "block pool take+free, runs of 16", m16);
    if (results != NULL) {
        FILE *f = fopen(results, "a");
        if (f == NULL) {
            pd_log_error("cannot append to %s", results);
            return 1;
        }
        time_t now = time(NULL);
        char date[64];
        strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
        struct utsname u;
        uname(&u);
        fprintf(f, "\n## pd-bench-sched — %s\n\nCommand: `", date);
        for (int i = 0; i < argc; i++) {
            fprintf(f, "%s%s", i ? " " : "", argv[i]);
        }
        fprintf(f, "`  \nMachine: %s %s, %ld cores. Goal: < 20 µs per step at 256 running requests.\n\n",
                u.sysname, u.machine, sysconf(_SC_NPROCESSORS_ONLN));
        fprintf(f, "| benchmark | result | baseline (same run) | ratio |\n|---|---|---|---|\n");
        for (int i = 0; i < nrows; i++) {
            fprintf(f, "%s\n", rows[i]);
        }
        fclose(f);
    }
    return 0;
}
