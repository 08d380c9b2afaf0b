/* engine/engine_thread.c — the engine on its own thread: other threads submit and abort through an
 * inbox and take outputs from a queue (both under the engine's mutex); the thread steps while there
 * is work and sleeps otherwise, woken by submissions and the connector. */
#define _GNU_SOURCE
#include "engine/engine_impl.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/grammar_jobs.h"
#include "engine/model_runner.h"
#include "model/generation_config.h"
#include "scheduler/scheduler.h"

/* ------------------------------------------------------------------ threaded use */

static void snapshot_stats(pd_engine_t *e)
{
    pd_scheduler_stats_t ss;
    pd_scheduler_get_stats(e->sched, &ss);
    pd_engine_stats_t *o = &e->stats;
    o->num_running = ss.num_running;
    o->num_waiting = ss.num_waiting;
    o->num_waiting_for_remote_kv = ss.num_waiting_for_remote_kv;
    o->num_holding = ss.num_holding;
    o->num_queued = e->inbox_len;
    o->kv_usage = ss.kv_usage;
    o->blocks_free = ss.blocks_free;
    o->blocks_cached_free = ss.blocks_cached_free;
    o->blocks_used = ss.blocks_used;
    o->num_blocks = e->kv->cfg.num_blocks;
    o->prefix_queries = ss.prefix_queries;
    o->prefix_hits = ss.prefix_hits;
    o->preemptions = ss.num_preemptions;
    o->load_waits = ss.num_load_waits;
    o->spec_drafts = ss.spec_drafts;
    o->spec_draft_tokens = ss.spec_draft_tokens;
    o->spec_accepted = ss.spec_accepted;
    if (e->offload != NULL) {
        const pd_kv_cache_manager_t *kvm = pd_scheduler_kv(e->sched);
        pd_kv_offload_stats_t os;
        pd_kv_offload_get_stats(e->offload, &os);
        o->offload = true;
        o->offload_queries = kvm->tier_queries;
        o->offload_hits = kvm->tier_hits;
        o->offload_saved = os.saved;
        o->offload_corrupt = os.corrupt;
        o->offload_bytes_written = os.bytes_written;
        o->offload_bytes_read = os.bytes_read;
        o->offload_read_seconds = os.read_seconds;
        o->offload_used = os.used_slots;
        o->offload_slots = os.num_slots;
    }
    o->prefill_s_per_token = e->prefill_cost.alpha;
    o->prefill_s_per_position = e->prefill_cost.beta;
    o->prompt_tokens = e->prompt_tokens;
    o->generation_tokens = e->generation_tokens;
    o->steps = e->steps;
    o->requests_finished = e->finished;
    o->grammar_states_handed = e->grammar_handed;
    o->grammar_states_resumed = e->runner.grammar_resumed;
    if (e->gjobs != NULL) {
        uint64_t failed;
        pd_grammar_jobs_stats(e->gjobs, &o->grammars_walked_ahead, &o->grammar_walk_ahead_seconds, &failed);
    }
    o->last_step_s = e->last_step_s;
    o->last_forward_s = e->runner.last_forward_s;
}

void pd_engine_get_stats(pd_engine_t *e, pd_engine_stats_t *out)
{
    pthread_mutex_lock(&e->mu);
    if (!e->running) {
        snapshot_stats(e);
    }
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

/* Applies queued submissions and aborts (engine thread). A submission the engine refuses ends
 * at once with an error output that carries the reason as its text. */
static void drain_inbox(pd_engine_t *e, pd_engine_output_t **outs)
{
    pthread_mutex_lock(&e->mu);
    cmd_t *c = e->inbox_head;
    e->inbox_head = e->inbox_tail = NULL;
    e->inbox_len = 0;
    pthread_mutex_unlock(&e->mu);
    pd_engine_output_t **tail = outs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    while (c != NULL) {
        cmd_t *next = c->next;
        if (c->is_abort == CMD_MIGRATE) {
            pd_engine_migrate(e, c->id);
        } else if (c->is_abort) {
            pd_engine_abort(e, c->id);
        } else {
            char err[256];
            if (pd_engine_add(e, &c->req, err, sizeof(err)) != PD_OK) {
                pd_engine_output_t *o = calloc(1, sizeof(*o));
                if (o != NULL) {
                    snprintf(o->id, sizeof(o->id), "%s", c->id);
                    o->user = c->req.user;
                    o->token = -1;
                    o->stop_token = -1;
                    o->text = strdup(err);
                    o->text_len = strlen(err);
                    o->finish_reason = "error";
                    eng_push_output(&tail, o);
                }
            }
        }
        eng_cmd_free(c);
        c = next;
    }
}

static void *engine_thread(void *arg)
{
    pd_engine_t *e = arg;
    pd_log_info("engine thread started");
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->inbox_head == NULL && !pd_engine_has_work(e)) {
            /* idle: sleep until a submission arrives (bounded, so stop is always seen) */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        if (!e->stop && e->inbox_head == NULL && !e->woken && e->last_items == 0 && e->aborted_head == NULL) {
            /* work exists but nothing could run (remote KV loading, blocks held for a reader, no
             * free blocks): sleep until the connector or a submission wakes us, bounded */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        e->woken = false;
        bool stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) {
            break;
        }
        pd_engine_output_t *outs = NULL;
        drain_inbox(e, &outs);
        if (pd_engine_has_work(e) || e->aborted_head != NULL) {
            pd_engine_step(e, &outs);
        }
        bool wake = false; /* an output the frontend must see now */
        for (pd_engine_output_t *t = outs; t != NULL; t = t->next) {
            if (e->sink == NULL || !e->sink(e->sink_ctx, t)) {
                wake = true;
            } else {
                e->unnotified++;
            }
        }
        pthread_mutex_lock(&e->mu);
        snapshot_stats(e);
        if (outs != NULL) {
            if (e->out_tail == NULL) {
                e->out_head = outs;
            } else {
                e->out_tail->next = outs;
            }
            pd_engine_output_t *t = outs;
            while (t->next != NULL) {
                t = t->next;
            }
            e->out_tail = t;
        }
        pthread_mutex_unlock(&e->mu);
        if (outs != NULL && e->notify != NULL) {
            double now = pd_time_now_s();
            if (wake || e->unnotified >= 32 || now - e->notified_at >= 0.05) {
                e->unnotified = 0;
                e->notified_at = now;
                e->notify(e->notify_ctx);
            }
        }
    }
    pd_log_info("engine thread stopped");
    return NULL;
}

/* The connector's and the grammar jobs' wake hook: transfers finished or a grammar is ready, step
 * again now. */
void eng_wake(void *arg)
{
    pd_engine_t *e = arg;
    pthread_mutex_lock(&e->mu);
    e->woken = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void pd_engine_set_output_sink(pd_engine_t *e, bool (*sink)(void *ctx, pd_engine_output_t *o), void *ctx)
{
    e->sink = sink;
    e->sink_ctx = ctx;
}

pd_status_t pd_engine_start(pd_engine_t *e, void (*notify)(void *ctx), void *ctx)
{
    if (e->cfg.connector != NULL) {
        e->cfg.connector->wake = eng_wake;
        e->cfg.connector->wake_arg = e;
    }
    e->notify = notify;
    e->notify_ctx = ctx;
    pthread_mutex_lock(&e->mu);
    snapshot_stats(e);
    e->stop = false;
    e->running = true;
    pthread_mutex_unlock(&e->mu);
    if (pthread_create(&e->thread, NULL, engine_thread, e) != 0) {
        e->running = false;
        pd_log_error("engine: cannot start the engine thread");
        return PD_ERR_INTERNAL;
    }
    return PD_OK;
}

void pd_engine_stop(pd_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    bool running = e->running;
    e->stop = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (running) {
        pthread_join(e->thread, NULL);
        pthread_mutex_lock(&e->mu);
        e->running = false;
        pthread_mutex_unlock(&e->mu);
    }
}

pd_status_t pd_engine_submit(pd_engine_t *e, const pd_engine_request_t *rq)
{
    cmd_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    c->req = *rq;
    snprintf(c->id, sizeof(c->id), "%s", rq->id);
    c->req.id = c->id;
    int32_t num_resume = rq->resume != NULL && rq->num_resume > 0 ? rq->num_resume : 0;
    size_t n = (size_t)(rq->num_prompt > 0 ? rq->num_prompt : 0) + (size_t)num_resume; /* resumed after it */
    c->prompt = malloc((n > 0 ? n : 1) * sizeof(int32_t));
    if (c->prompt == NULL) {
        free(c);
        return PD_ERR_NO_MEMORY;
    }
    memcpy(c->prompt, rq->prompt, (size_t)rq->num_prompt * sizeof(int32_t));
    c->req.prompt = c->prompt;
    c->req.resume = NULL;
    c->req.num_resume = 0;
    if (num_resume > 0 && rq->num_prompt >= 0) {
        memcpy(c->prompt + rq->num_prompt, rq->resume, (size_t)num_resume * sizeof(int32_t));
        c->req.resume = c->prompt + rq->num_prompt;
        c->req.num_resume = num_resume;
    }
    for (int32_t i = 0; i < rq->num_stop && i < PD_MAX_STOP_STRINGS; i++) {
        c->stop_buf[i] = rq->stop[i] != NULL ? strdup(rq->stop[i]) : NULL;
        c->req.stop[i] = c->stop_buf[i];
    }
    /* the engine's own copy: its connector edits the params (a load starts once), and a jansson
     * object's reference count is no lock for two threads (TSan saw the HTTP thread's decref race
     * the engine's) */
    c->req.kv_transfer_params = NULL;
    if (rq->kv_transfer_params != NULL &&
        (c->req.kv_transfer_params = json_deep_copy(rq->kv_transfer_params)) == NULL) {
        c->req.grammar = NULL; /* not referenced yet */
        eng_cmd_free(c);
        return PD_ERR_NO_MEMORY;
    }
    pd_grammar_ref(rq->grammar); /* eng_cmd_free drops it */
    pthread_mutex_lock(&e->mu);
    int32_t backlog = e->inbox_len + e->stats.num_waiting;
    if (backlog >= e->cfg.max_queue) {
        pthread_mutex_unlock(&e->mu);
        eng_cmd_free(c);
        return PD_ERR_NO_SPACE;
    }
    if (e->inbox_tail != NULL) {
        e->inbox_tail->next = c;
    } else {
        e->inbox_head = c;
    }
    e->inbox_tail = c;
    e->inbox_len++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return PD_OK;
}

static void queue_abort(pd_engine_t *e, const char *id, int kind)
{
    cmd_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        pd_log_error("engine: out of memory queueing the %s of %s",
                     kind == CMD_MIGRATE ? "migration" : "abort", id);
        return;
    }
    c->is_abort = kind;
    snprintf(c->id, sizeof(c->id), "%s", id);
    pthread_mutex_lock(&e->mu);
    if (e->inbox_tail != NULL) {
        e->inbox_tail->next = c;
    } else {
        e->inbox_head = c;
    }
    e->inbox_tail = c;
    e->inbox_len++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void pd_engine_abort_async(pd_engine_t *e, const char *id)
{
    queue_abort(e, id, CMD_ABORT);
}

void pd_engine_migrate_async(pd_engine_t *e, const char *id)
{
    queue_abort(e, id, CMD_MIGRATE);
}

pd_engine_output_t *pd_engine_take_outputs(pd_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    pd_engine_output_t *o = e->out_head;
    e->out_head = e->out_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    return o;
}
