/* engine/kv_tier_loader.h — the offload tier (engine/kv_offload.h) as the scheduler sees it
 * (pd_kv_tier_t), with its loads off the engine thread: a request whose prefix continues in the
 * tier waits (req->tier_load) while a loader thread reads its blocks, and the engine steps the
 * other requests meanwhile (vLLM's OffloadingConnector loads asynchronously the same way, its
 * request in WAITING_FOR_REMOTE_KV). Or inline: the reads run at admission, on the engine thread.
 *
 * A load's slots are pinned in the tier when it starts (engine thread), read on the loader thread,
 * and unpinned when the scheduler takes the finished load (engine thread again), so the tier's
 * index, LRU and stats stay the engine thread's alone, and a save never reuses a slot being read.
 *
 * Threads: create, destroy and the pd_kv_tier_t callbacks are the engine thread's; the loader
 * thread runs one load at a time and calls done(arg) after each (the engine's wake-up). */
#ifndef PD_ENGINE_KV_TIER_LOADER_H
#define PD_ENGINE_KV_TIER_LOADER_H

#include <stdbool.h>

#include "common/metrics.h"
#include "common/status.h"
#include "engine/kv_offload.h"
#include "scheduler/kv_cache_manager.h"

typedef struct pd_kv_tier_loader_config {
    pd_kv_offload_t *offload; /* outlives the loader */
    bool thread;              /* loads on the loader thread; false: inline, at admission */
    void (*done)(void *arg);  /* a load on the thread ended */
    void *arg;
    /* per block: its read and checksum, in seconds (pd:kv_offload_load_seconds), or NULL */
    pd_metric_t *hist;
    double read_delay_s; /* tests: every block's read takes this much longer */
} pd_kv_tier_loader_config_t;

typedef struct pd_kv_tier_loader pd_kv_tier_loader_t;

/* With cfg->thread the loader thread starts now (if it cannot, loads run inline, logged). */
pd_status_t pd_kv_tier_loader_create(const pd_kv_tier_loader_config_t *cfg, pd_kv_tier_loader_t **out);

/* The callbacks to hand to pd_kv_manager_set_tier (valid while l lives). */
const pd_kv_tier_t *pd_kv_tier_loader_tier(pd_kv_tier_loader_t *l);

/* "thread" or "inline". */
const char *pd_kv_tier_loader_mode(const pd_kv_tier_loader_t *l);

/* Stops the thread after the read in progress. Loads not yet taken stay the manager's (freed by its
 * destroy); their slots stay pinned, which only the tier's destroy that follows sees. */
void pd_kv_tier_loader_destroy(pd_kv_tier_loader_t *l);

#endif
