/* engine/kv_tier_loader.c — see kv_tier_loader.h. */
#include "engine/kv_tier_loader.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"

struct pd_kv_tier_loader {
    pd_kv_tier_loader_config_t cfg;
    pd_kv_tier_t tier;
    pthread_mutex_t mu; /* guards the queues and stop */
    pthread_cond_t cv;
    pd_kv_tier_load_t *queued_head, *queued_tail; /* the thread's */
    pd_kv_tier_load_t *done_head, *done_tail;     /* ended, for finished */
    bool started, stop;
    pthread_t thread;
};

static void push(pd_kv_tier_load_t **head, pd_kv_tier_load_t **tail, pd_kv_tier_load_t *ld)
{
    ld->next = NULL;
    if (*tail != NULL) {
        (*tail)->next = ld;
    } else {
        *head = ld;
    }
    *tail = ld;
}

static pd_kv_tier_load_t *pop(pd_kv_tier_load_t **head, pd_kv_tier_load_t **tail)
{
    pd_kv_tier_load_t *ld = *head;
    if (ld != NULL) {
        *head = ld->next;
        *tail = *head == NULL ? NULL : *tail;
    }
    return ld;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Reads ld's pinned slots in order, up to the first it lacks (not pinned) or fails to read. */
static void read_load(const pd_kv_tier_loader_config_t *cfg, pd_kv_tier_load_t *ld)
{
    int32_t i = 0;
    ld->status = PD_OK;
    for (; i < ld->n; i++) {
        if (ld->slots[i] == PD_KV_OFFLOAD_NO_SLOT) {
            ld->status = PD_ERR_NOT_FOUND;
            break;
        }
        double t0 = pd_time_now_s();
        if (cfg->read_delay_s > 0) {
            sleep_s(cfg->read_delay_s);
        }
        ld->status = pd_kv_offload_read(cfg->offload, ld->slots[i], ld->keys[i], ld->blocks[i]);
        ld->seconds[i] = pd_time_now_s() - t0;
        if (ld->status != PD_OK) {
            break;
        }
    }
    ld->n_loaded = i;
}

static void *loader_thread(void *arg)
{
    pd_kv_tier_loader_t *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && l->queued_head == NULL) {
            pthread_cond_wait(&l->cv, &l->mu); /* woken by a load or by destroy */
        }
        if (l->stop) {
            break;
        }
        pd_kv_tier_load_t *ld = pop(&l->queued_head, &l->queued_tail);
        pthread_mutex_unlock(&l->mu);
        read_load(&l->cfg, ld);
        pthread_mutex_lock(&l->mu);
        push(&l->done_head, &l->done_tail, ld);
        pthread_mutex_unlock(&l->mu);
        l->cfg.done(l->cfg.arg);
        pthread_mutex_lock(&l->mu);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* ------------------------------------------------------------------ pd_kv_tier_t */

static bool tier_contains(void *ctx, pd_hash128_t key)
{
    return pd_kv_offload_contains(((pd_kv_tier_loader_t *)ctx)->cfg.offload, key);
}

static void tier_load(void *ctx, pd_kv_tier_load_t *ld)
{
    pd_kv_tier_loader_t *l = ctx;
    bool pinned = true;
    for (int32_t i = 0; i < ld->n; i++) { /* up to the first the tier lacks */
        ld->slots[i] = pinned ? pd_kv_offload_pin(l->cfg.offload, ld->keys[i]) : PD_KV_OFFLOAD_NO_SLOT;
        pinned = ld->slots[i] != PD_KV_OFFLOAD_NO_SLOT;
    }
    if (!l->cfg.thread) {
        read_load(&l->cfg, ld); /* inline: here, on the engine thread */
    }
    pthread_mutex_lock(&l->mu);
    if (l->cfg.thread) {
        push(&l->queued_head, &l->queued_tail, ld);
        pthread_cond_signal(&l->cv);
    } else {
        push(&l->done_head, &l->done_tail, ld);
    }
    pthread_mutex_unlock(&l->mu);
}

static pd_kv_tier_load_t *tier_finished(void *ctx)
{
    pd_kv_tier_loader_t *l = ctx;
    pthread_mutex_lock(&l->mu);
    pd_kv_tier_load_t *ld = pop(&l->done_head, &l->done_tail);
    pthread_mutex_unlock(&l->mu);
    for (int32_t i = 0; ld != NULL && i < ld->n && ld->slots[i] != PD_KV_OFFLOAD_NO_SLOT; i++) {
        pd_status_t st = i < ld->n_loaded ? PD_OK : i == ld->n_loaded ? ld->status : PD_ERR_CANCELLED;
        pd_kv_offload_unpin(l->cfg.offload, ld->slots[i], st, i <= ld->n_loaded ? ld->seconds[i] : 0);
        if (l->cfg.hist != NULL && i <= ld->n_loaded) {
            pd_metric_observe(l->cfg.hist, ld->seconds[i]);
        }
    }
    return ld;
}

static void tier_save(void *ctx, pd_hash128_t key, uint32_t block)
{
    /* a failed save was logged: the block is just not kept */
    pd_kv_offload_save(((pd_kv_tier_loader_t *)ctx)->cfg.offload, key, block);
}

/* ------------------------------------------------------------------ life */

pd_status_t pd_kv_tier_loader_create(const pd_kv_tier_loader_config_t *cfg, pd_kv_tier_loader_t **out)
{
    pd_kv_tier_loader_t *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    l->cfg = *cfg;
    l->tier = (pd_kv_tier_t){l, tier_contains, tier_load, tier_finished, tier_save};
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    if (l->cfg.thread) { /* at once: a node's thread count does not change under load */
        l->started = pthread_create(&l->thread, NULL, loader_thread, l) == 0;
        if (!l->started) {
            l->cfg.thread = false;
            pd_log_error("engine: cannot start the offload tier's loader thread; its loads run inline");
        }
    }
    *out = l;
    return PD_OK;
}

const pd_kv_tier_t *pd_kv_tier_loader_tier(pd_kv_tier_loader_t *l)
{
    return &l->tier;
}

const char *pd_kv_tier_loader_mode(const pd_kv_tier_loader_t *l)
{
    return l->cfg.thread ? "thread" : "inline";
}

void pd_kv_tier_loader_destroy(pd_kv_tier_loader_t *l)
{
    if (l == NULL) {
        return;
    }
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    if (l->started) {
        pthread_join(l->thread, NULL);
    }
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l);
}
