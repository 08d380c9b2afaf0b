/* scheduler/scheduler.c — the V1-style scheduler: running first, then waiting (FCFS). */
#include "scheduler/scheduler.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "scheduler/kv_events.h"

struct pd_scheduler {
    pd_scheduler_config_t cfg;
    pd_connector_t *conn;
    pd_kv_cache_manager_t kv;
    pd_strmap_t by_id;     /* id → pd_request_t* of every live request */
    pd_strmap_t recv_done; /* ids the connector reported in finished_recving, not yet applied */
    pd_request_t *wait_head, *wait_tail;
    int32_t num_waiting;
    pd_request_t **running; /* [max_num_seqs] in admission order */
    int32_t num_running;
    int32_t num_holding;
    uint64_t arrivals, preemptions, load_waits;
    /* per-step buffers */
    pd_sched_item_t *items;
    pd_request_t **preempted;
    pd_request_t **with_token; /* [cap_with] requests that got tokens in the update, and how many */
    int32_t *with_count;
    int32_t cap_with;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted, spec_accepted_per_pos[PD_SPEC_MAX_TOKENS];
    pd_request_t **finished;
    int32_t num_finished, cap_finished;
    pd_request_t **release; /* finished this step and not holding: freed at the next schedule */
    int32_t num_release, cap_release;
    uint32_t *hits; /* [max blocks per request] prefix-hit scratch */
    void (*on_release)(void *, pd_request_t *);
    void *on_release_arg;
    bool (*admit_ready)(void *, pd_request_t *); /* pd_scheduler_set_admit_hook, or NULL */
    void *admit_arg;
    int32_t max_blocks_per_req;
    pd_scheduler_output_t out;
    pd_kv_event_log_t events; /* cfg.kv_events */
};

/* ------------------------------------------------------------------ queues */

static void wait_push_back(pd_scheduler_t *s, pd_request_t *r)
{
    r->next = NULL;
    r->prev = s->wait_tail;
    if (s->wait_tail != NULL) {
        s->wait_tail->next = r;
    } else {
        s->wait_head = r;
    }
    s->wait_tail = r;
    s->num_waiting++;
}

static void wait_push_front(pd_scheduler_t *s, pd_request_t *r)
{
    r->prev = NULL;
    r->next = s->wait_head;
    if (s->wait_head != NULL) {
        s->wait_head->prev = r;
    } else {
        s->wait_tail = r;
    }
    s->wait_head = r;
    s->num_waiting++;
}

static void wait_remove(pd_scheduler_t *s, pd_request_t *r)
{
    if (r->prev != NULL) {
        r->prev->next = r->next;
    } else {
        s->wait_head = r->next;
    }
    if (r->next != NULL) {
        r->next->prev = r->prev;
    } else {
        s->wait_tail = r->prev;
    }
    r->prev = r->next = NULL;
    s->num_waiting--;
}

static bool running_remove(pd_scheduler_t *s, pd_request_t *r)
{
    for (int32_t i = 0; i < s->num_running; i++) {
        if (s->running[i] == r) {
            memmove(&s->running[i], &s->running[i + 1],
                    (size_t)(s->num_running - i - 1) * sizeof(pd_request_t *));
            s->num_running--;
            return true;
        }
    }
    return false;
}

static bool push_ptr(pd_request_t ***arr, int32_t *n, int32_t *cap, pd_request_t *r)
{
    if (*n == *cap) {
        int32_t c = *cap ? 2 * *cap : 64;
        pd_request_t **a = realloc(*arr, (size_t)c * sizeof(pd_request_t *));
        if (a == NULL) {
            return false;
        }
        *arr = a;
        *cap = c;
    }
    (*arr)[(*n)++] = r;
    return true;
}

/* ------------------------------------------------------------------ lifecycle */

pd_status_t pd_scheduler_create(const pd_scheduler_config_t *cfg, pd_connector_t *connector,
                                pd_scheduler_t **sched_out)
{
    if (cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < 1 || cfg->max_model_len < 2 ||
        cfg->block_size < 1 || cfg->num_blocks < 2) {
        pd_log_error(
            "scheduler: invalid limits (max_num_seqs %d, max_num_batched_tokens %d, max_model_len %d, "
            "block_size %d, blocks %u)",
            cfg->max_num_seqs, cfg->max_num_batched_tokens, cfg->max_model_len, cfg->block_size,
            cfg->num_blocks);
        return PD_ERR_INVALID_ARG;
    }
    if (!cfg->enable_chunked_prefill && cfg->max_num_batched_tokens < cfg->max_model_len) {
        pd_log_error("scheduler: without chunked prefill --max-num-batched-tokens (%d) must be >= "
                     "--max-model-len (%d)",
                     cfg->max_num_batched_tokens, cfg->max_model_len);
        return PD_ERR_INVALID_ARG;
    }
    pd_scheduler_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    s->cfg = *cfg;
    s->conn = connector;
    s->max_blocks_per_req = (cfg->max_model_len + cfg->block_size - 1) / cfg->block_size + 1;
    int32_t groups = cfg->num_kv_groups > 0 ? cfg->num_kv_groups : 1;
    pd_status_t st = pd_kv_manager_init(&s->kv, cfg->num_blocks, cfg->block_size, cfg->enable_prefix_caching,
                                        groups, cfg->kv_group_window);
    if (st != PD_OK) {
        free(s);
        return st;
    }
    s->running = calloc((size_t)cfg->max_num_seqs, sizeof(pd_request_t *));
    s->items = calloc((size_t)cfg->max_num_seqs, sizeof(pd_sched_item_t));
    s->preempted = calloc((size_t)cfg->max_num_seqs, sizeof(pd_request_t *));
    s->with_token = calloc((size_t)cfg->max_num_seqs, sizeof(pd_request_t *));
    s->with_count = calloc((size_t)cfg->max_num_seqs, sizeof(int32_t));
    s->cap_with = cfg->max_num_seqs;
    if (cfg->kv_events) {
        s->events.block_size = cfg->block_size;
        s->kv.events = &s->events;
        pd_block_pool_set_event_log(s->kv.pool, &s->events);
        pd_kv_event_cleared(&s->events);
    }
    s->hits = calloc((size_t)s->max_blocks_per_req * (size_t)groups, sizeof(uint32_t));
    if (s->running == NULL || s->items == NULL || s->preempted == NULL || s->with_token == NULL ||
        s->with_count == NULL || s->hits == NULL || pd_strmap_init(&s->by_id, 256) != PD_OK ||
        pd_strmap_init(&s->recv_done, 16) != PD_OK) {
        pd_scheduler_destroy(s);
        return PD_ERR_NO_MEMORY;
    }
    *sched_out = s;
    return PD_OK;
}

void pd_scheduler_set_release_hook(pd_scheduler_t *s, void (*fn)(void *arg, pd_request_t *req), void *arg)
{
    s->on_release = fn;
    s->on_release_arg = arg;
}

void pd_scheduler_set_admit_hook(pd_scheduler_t *s, bool (*ready)(void *arg, pd_request_t *req), void *arg)
{
    s->admit_ready = ready;
    s->admit_arg = arg;
}

static void release_now(pd_scheduler_t *s, pd_request_t *r)
{
    pd_strmap_del(&s->by_id, r->id, strlen(r->id), NULL);
    if (s->on_release != NULL) {
        s->on_release(s->on_release_arg, r);
    }
    pd_request_free(r);
}

void pd_scheduler_destroy(pd_scheduler_t *s)
{
    if (s == NULL) {
        return;
    }
    for (size_t i = 0; s->by_id.slots != NULL && i < s->by_id.cap; i++) {
        if (s->by_id.slots[i].key != NULL) {
            pd_request_t *r = (pd_request_t *)(intptr_t)s->by_id.slots[i].value;
            pd_kv_manager_tier_orphan(r);
            pd_kv_manager_free(&s->kv, r);
            if (s->on_release != NULL) {
                s->on_release(s->on_release_arg, r);
            }
            pd_request_free(r);
        }
    }
    pd_strmap_destroy(&s->by_id);
    pd_strmap_destroy(&s->recv_done);
    pd_kv_manager_destroy(&s->kv);
    pd_kv_event_log_free(&s->events);
    free(s->running), free(s->items), free(s->preempted), free(s->with_token), free(s->with_count),
        free(s->hits);
    free(s->finished), free(s->release);
    free(s);
}

pd_status_t pd_scheduler_add_request(pd_scheduler_t *s, pd_request_t *r)
{
    int64_t v;
    if (pd_strmap_get(&s->by_id, r->id, strlen(r->id), &v)) {
        pd_log_warn("scheduler: request id %s is already in use", r->id);
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = pd_strmap_put(&s->by_id, r->id, strlen(r->id), (int64_t)(intptr_t)r);
    if (st != PD_OK) {
        return st;
    }
    r->state = PD_REQ_WAITING;
    r->arrival_seq = s->arrivals++;
    if (r->arrival_time == 0) {
        r->arrival_time = pd_time_now_s();
    }
    wait_push_back(s, r);
    return PD_OK;
}

bool pd_scheduler_reserve_lookahead(pd_scheduler_t *s, pd_request_t *r, int32_t num_tokens)
{
    if (pd_request_is_finished(r)) {
        return false;
    }
    int32_t more = num_tokens - r->num_computed_tokens;
    return more <= 0 || pd_kv_manager_allocate_slots(&s->kv, r, more, NULL, 0, 0, true);
}

pd_request_t *pd_scheduler_find(const pd_scheduler_t *s, const char *id)
{
    int64_t v;
    return pd_strmap_get(&s->by_id, id, strlen(id), &v) ? (pd_request_t *)(intptr_t)v : NULL;
}

/* Ends r in state st: out of the queues, connector told once, blocks freed or held. */
static void finish_request(pd_scheduler_t *s, pd_request_t *r, pd_request_state_t st)
{
    if (pd_request_is_finished(r)) {
        return;
    }
    if (r->state == PD_REQ_RUNNING) {
        running_remove(s, r);
    } else {
        wait_remove(s, r);
    }
    r->state = st;
    r->finish_time = pd_time_now_s();
    pd_kv_manager_tier_orphan(r);
    bool delay = false;
    if (s->conn != NULL) {
        void *params = NULL;
        delay = s->conn->ops->request_finished(s->conn, r, r->block_ids, r->num_blocks * s->kv.num_groups,
                                               &params);
        if (params != NULL) {
            json_decref(r->kv_transfer_params);
            r->kv_transfer_params = params;
        }
    }
    push_ptr(&s->finished, &s->num_finished, &s->cap_finished, r);
    if (delay && r->num_blocks > 0) {
        r->holds_blocks_after_finish = true;
        s->num_holding++;
        return;
    }
    pd_kv_manager_free(&s->kv, r);
    push_ptr(&s->release, &s->num_release, &s->cap_release, r);
}

/* A held request's peer is done with its blocks: free them and release the request. */
static void end_hold(pd_scheduler_t *s, pd_request_t *r)
{
    if (!r->holds_blocks_after_finish) {
        return;
    }
    r->holds_blocks_after_finish = false;
    s->num_holding--;
    pd_kv_manager_free(&s->kv, r);
    push_ptr(&s->release, &s->num_release, &s->cap_release, r);
}

pd_request_t *pd_scheduler_abort(pd_scheduler_t *s, const char *id)
{
    pd_request_t *r = pd_scheduler_find(s, id);
    if (r == NULL || pd_request_is_finished(r)) {
        return NULL;
    }
    finish_request(s, r, PD_REQ_FINISHED_ABORTED);
    return r;
}

void pd_scheduler_finish(pd_scheduler_t *s, pd_request_t *r, pd_request_state_t st)
{
    finish_request(s, r, st);
}

pd_kv_event_log_t *pd_scheduler_kv_events(pd_scheduler_t *s)
{
    return s->cfg.kv_events ? &s->events : NULL;
}

pd_request_t *const *pd_scheduler_finished(const pd_scheduler_t *s, int32_t *num_out)
{
    *num_out = s->num_finished;
    return s->finished;
}

/* ------------------------------------------------------------------ schedule */

static void preempt(pd_scheduler_t *s, pd_request_t *r)
{
    pd_kv_manager_free(&s->kv, r);
    r->num_computed_tokens = 0;
    r->num_spec_tokens = 0;
    r->num_draft_computed = 0;
    r->num_preemptions++;
    r->state = PD_REQ_WAITING; /* PREEMPTED → WAITING at once: re-queued at the front */
    wait_push_front(s, r);
    s->preemptions++;
    s->out.preempted[s->out.num_preempted++] = r;
    pd_log_debug("scheduler: preempted %s (%d tokens) to free KV blocks", r->id, r->num_tokens);
}

/* Remote KV arrived (or ended): the request computes from what it has. */
static void finish_remote_wait(pd_scheduler_t *s, pd_request_t *r)
{
    int32_t computed = r->num_computed_tokens + r->num_external_tokens;
    if (computed >= r->num_tokens) {
        computed = r->num_tokens - 1; /* the last prompt token is recomputed for its logits */
    }
    r->num_loaded_tokens += computed > r->num_computed_tokens ? computed - r->num_computed_tokens : 0;
    r->num_computed_tokens = computed;
    r->num_external_tokens = 0;
    pd_kv_manager_cache_blocks(&s->kv, r, computed);
    r->state = PD_REQ_WAITING;
}

/* Whether a request waiting for its remote KV is loading, now, the full block of fresh request r
 * just past r's local prefix hit (local tokens), with the same chained hash (so the same tokens
 * before it too). r then waits for that load, whose blocks the prefix cache gets when it ends,
 * rather than reading the same KV from its own peer: concurrent requests with one new shared prefix
 * (kv-aware routing sends them to one decode) move it once. Only when the connector allows it
 * (pull); the wait ends with that load, or after cfg.load_share_wait seconds (--kv-load-share-wait),
 * when r loads for itself. */
static bool shares_inflight_load(pd_scheduler_t *s, const pd_request_t *r, int32_t local)
{
    if (!s->kv.caching || s->conn->ops->load_may_wait == NULL || !s->conn->ops->load_may_wait(s->conn, r)) {
        return false;
    }
    int32_t bs = s->kv.block_size, b = local / bs;
    if (b >= r->num_hashes) {
        return false; /* only a partial block past the hit: nothing a peer's load would cache */
    }
    for (const pd_request_t *a = s->wait_head; a != NULL; a = a->next) {
        if (a == r || a->state != PD_REQ_WAITING_FOR_REMOTE_KV) {
            continue;
        }
        int32_t end = a->num_computed_tokens + a->num_external_tokens; /* what finish_remote_wait caches */
        end = end < a->num_tokens - 1 ? end : a->num_tokens - 1;
        if (a->num_computed_tokens / bs <= b && b < end / bs && b < a->num_hashes &&
            pd_hash128_eq(a->block_hashes[b], r->block_hashes[b])) {
            return true;
        }
    }
    return false;
}

static void schedule_waiting(pd_scheduler_t *s, int32_t *budget)
{
    pd_request_t *r = s->wait_head;
    /* a fresh request that could not get its blocks: no fresh request behind it goes ahead of it
     * (FCFS), but those that already hold theirs (their remote KV arrived) still run, since theirs
     * are what it may be waiting for */
    bool fresh_blocked = false;
    while (r != NULL && *budget > 0 && s->num_running < s->cfg.max_num_seqs) {
        pd_request_t *next = r->next;
        if (r->tier_load != NULL) {
            r = next;
            continue; /* its prefix is loading from the offload tier: later requests may go ahead */
        }
        if (r->state == PD_REQ_WAITING_FOR_REMOTE_KV) {
            if (!pd_strmap_del(&s->recv_done, r->id, strlen(r->id), NULL)) {
                r = next;
                continue; /* still loading: later requests may go ahead */
            }
            finish_remote_wait(s, r);
        }
        bool fresh = r->num_blocks == 0;
        if (fresh && (fresh_blocked || (s->admit_ready != NULL && !s->admit_ready(s->admit_arg, r)))) {
            r = next;
            continue;
        }
        int32_t n_hits = 0, local = 0, external = 0;
        bool async = false;
        /* prompt logprobs need every prompt position computed here: no prefix hit, no remote KV */
        bool scored = r->params.want_prompt_logprobs;
        if (fresh && !scored) {
            n_hits =
                pd_kv_manager_get_computed_blocks(&s->kv, r, s->hits, s->max_blocks_per_req, false, &local);
            int32_t promoted = s->kv.tier != NULL
                                   ? pd_kv_manager_promote(&s->kv, r, s->hits, n_hits, s->max_blocks_per_req)
                                   : 0;
            if (promoted != 0) {
                pd_kv_manager_poll_tier(&s->kv); /* an inline tier has loaded them already */
                if (promoted == PD_KV_PROMOTE_WAIT || r->tier_load != NULL) {
                    r = next; /* until its load, or another's that brings its next block, ends */
                    continue;
                }
                /* the tier's blocks are in the pool now: the lookup finds them */
                n_hits = pd_kv_manager_get_computed_blocks(&s->kv, r, s->hits, s->max_blocks_per_req, false,
                                                           &local);
            }
            if (s->conn != NULL) {
                pd_status_t st =
                    s->conn->ops->get_num_new_matched_tokens(s->conn, r, local, &external, &async);
                if (st == PD_ERR_REJECTED) {
                    /* the connector refuses to run it here (a lend of a prefix this node no longer
                     * holds): it ends with an error before anything is computed (logged there) */
                    finish_request(s, r, PD_REQ_FINISHED_ERROR);
                    r = next;
                    continue;
                }
                if (st != PD_OK || external < 0) {
                    external = 0;
                    async = false;
                }
                if (local + external >= r->num_tokens && !async) {
                    external = r->num_tokens - 1 - local; /* keep one token to compute */
                    external = external > 0 ? external : 0;
                }
            }
        }
        /* a wait is bounded: a peer stuck in its load (a stopped prefill) would hold r up to the load
         * timeout, while r's own prefill may be healthy */
        bool may_wait = s->cfg.load_share_wait > 0 &&
                        (!r->load_waited || pd_time_now_s() - r->load_wait_since < s->cfg.load_share_wait);
        if (async && may_wait && shares_inflight_load(s, r, local)) {
            if (!r->load_waited) {
                r->load_waited = true;
                r->load_wait_since = pd_time_now_s();
                s->load_waits++;
                pd_log_debug("scheduler: %s waits for another request's load of its next %d-token block",
                             r->id, s->kv.block_size);
            }
            r = next;
            continue; /* looked up again next step, when that load may have ended */
        }
        if (fresh && !scored && s->kv.caching && !r->prefix_counted) { /* one lookup a request in the stats */
            r->prefix_counted = true;
            pd_kv_manager_count_lookup(&s->kv, r, local);
        }
        int32_t computed = fresh ? local + (async ? 0 : external) : r->num_computed_tokens;
        int32_t num_new = async ? 0 : r->num_tokens - computed;
        if (scored && s->cfg.enable_chunked_prefill && num_new > PD_PROMPT_LOGPROBS_CHUNK) {
            num_new = PD_PROMPT_LOGPROBS_CHUNK;
        }
        if (num_new > *budget) {
            if (!s->cfg.enable_chunked_prefill) {
                break;
            }
            num_new = *budget;
        }
        bool ok = fresh ? pd_kv_manager_allocate_slots(&s->kv, r, num_new, s->hits, n_hits, external, async)
                        : pd_kv_manager_allocate_slots(&s->kv, r, num_new, NULL, 0, 0, false);
        if (!ok) {
            if (!fresh) {
                break; /* FCFS: nothing behind it jumps the queue for space */
            }
            fresh_blocked = true;
            r = next;
            continue;
        }
        if (fresh && s->conn != NULL &&
            s->conn->ops->update_state_after_alloc(s->conn, r, r->block_ids, r->num_blocks * s->kv.num_groups,
                                                   external) != PD_OK) {
            /* out of memory: no load would ever be reported for it, so it ends now (an error) */
            pd_log_error("request %s: the KV connector cannot start its load; failing it", r->id);
            finish_request(s, r, PD_REQ_FINISHED_ERROR);
            r = next;
            continue;
        }
        if (r->num_cached_tokens < 0) {
            r->num_cached_tokens = local;
            if (fresh && !scored) { /* where its prefix comes from (PD_LOG_LEVEL=debug) */
                pd_log_debug(
                    "request %s: %d prompt tokens, prefix %d from the pool (%d of them loaded from the "
                    "offload tier), %d from a peer%s, %d to compute",
                    r->id, r->num_tokens, local, r->num_offload_tokens, external, async ? " (loading)" : "",
                    r->num_tokens - local - external);
            }
        }
        if (async) {
            r->num_computed_tokens = local;
            r->num_external_tokens = external;
            r->state = PD_REQ_WAITING_FOR_REMOTE_KV;
            r = next;
            continue;
        }
        wait_remove(s, r);
        r->num_computed_tokens = computed;
        r->state = PD_REQ_RUNNING;
        if (r->first_scheduled_time == 0) {
            r->first_scheduled_time = pd_time_now_s();
        }
        s->running[s->num_running++] = r;
        s->out.items[s->out.num_items++] = (pd_sched_item_t){r, num_new};
        *budget -= num_new;
        r = next;
    }
}

const pd_scheduler_output_t *pd_scheduler_schedule(pd_scheduler_t *s)
{
    for (int32_t i = 0; i < s->num_release; i++) {
        release_now(s, s->release[i]);
    }
    s->num_release = 0;
    s->num_finished = 0;
    s->out = (pd_scheduler_output_t){s->items, 0, 0, s->preempted, 0, NULL};
    int32_t budget = s->cfg.max_num_batched_tokens;
    pd_kv_manager_poll_tier(&s->kv); /* loads from the offload tier that ended */

    for (int32_t i = 0; i < s->num_running && budget > 0; i++) {
        pd_request_t *r = s->running[i];
        int32_t num_new = r->num_tokens - r->num_computed_tokens;
        if (r->num_spec_tokens > 0) { /* drafts ride along as far as the budget goes */
            int32_t room = budget - num_new;
            if (room < r->num_spec_tokens) {
                r->num_spec_tokens = room > 0 ? room : 0;
            }
            num_new += r->num_spec_tokens;
        }
        if (r->params.want_prompt_logprobs && s->cfg.enable_chunked_prefill &&
            num_new > PD_PROMPT_LOGPROBS_CHUNK) {
            num_new = PD_PROMPT_LOGPROBS_CHUNK;
        }
        if (num_new > budget) {
            if (!s->cfg.enable_chunked_prefill) {
                continue;
            }
            num_new = budget;
        }
        if (num_new <= 0) {
            continue;
        }
        bool ok = true;
        while (!pd_kv_manager_allocate_slots(&s->kv, r, num_new, NULL, 0, 0, false)) {
            pd_request_t *victim = s->running[s->num_running - 1]; /* newest first */
            s->num_running--;
            preempt(s, victim);
            if (victim == r) {
                ok = false;
                break;
            }
        }
        if (!ok) {
            break;
        }
        s->out.items[s->out.num_items++] = (pd_sched_item_t){r, num_new};
        budget -= num_new;
    }
    if (s->out.num_preempted == 0) {
        schedule_waiting(s, &budget);
    }
    s->out.total_tokens = s->cfg.max_num_batched_tokens - budget;
    if (s->conn != NULL) {
        s->out.connector_meta = s->conn->ops->build_connector_meta(s->conn, &s->out);
    }
    return &s->out;
}

/* ------------------------------------------------------------------ update */

/* vLLM's check_stop: the length limits first; then, once min_tokens outputs exist, EOS (unless
 * ignore_eos) and the request's stop_token_ids (recorded as its stop reason). */
static bool stop_check(const pd_scheduler_t *s, pd_request_t *r, int32_t tok, pd_request_state_t *st)
{
    if (pd_request_num_output(r) >= r->params.max_tokens || r->num_tokens >= s->cfg.max_model_len ||
        r->num_tokens >= r->cap_tokens) {
        *st = PD_REQ_FINISHED_LENGTH;
        return true;
    }
    if (pd_request_num_output(r) < r->params.min_tokens) {
        return false;
    }
    if (!r->params.ignore_eos) {
        for (int32_t i = 0; i < s->cfg.num_eos; i++) {
            if (tok == s->cfg.eos_token_ids[i]) {
                *st = PD_REQ_FINISHED_STOPPED;
                return true;
            }
        }
    }
    for (int32_t i = 0; i < r->params.num_stop_token_ids; i++) {
        if (tok == r->params.stop_token_ids[i]) {
            *st = PD_REQ_FINISHED_STOPPED;
            r->stop_token = tok;
            return true;
        }
    }
    return false;
}

/* Appends an item's tokens one by one with the stop checks after each, as vLLM does: the first
 * that finishes the request ends it and the rest are dropped. Returns how many were appended. */
static int32_t append_tokens(pd_scheduler_t *s, pd_request_t *r, const int32_t *toks, int32_t n)
{
    for (int32_t j = 0; j < n; j++) {
        if (pd_request_append_token(r, toks[j]) != PD_OK) {
            finish_request(s, r, PD_REQ_FINISHED_LENGTH);
            return j;
        }
        pd_request_state_t st;
        if (stop_check(s, r, toks[j], &st)) {
            finish_request(s, r, st);
            return j + 1;
        }
    }
    return n;
}

int32_t pd_scheduler_add_output_tokens(pd_scheduler_t *s, pd_request_t *r, const int32_t *toks, int32_t n)
{
    bool ok = n >= 1 && pd_request_num_output(r) == 0 && !pd_request_is_finished(r);
    for (int32_t j = 0; ok && j < n; j++) {
        ok = toks[j] >= 0 && (s->cfg.vocab_size <= 0 || toks[j] < s->cfg.vocab_size);
    }
    if (!ok) {
        pd_log_warn("request %s: %d output token(s) from another node are unusable (outside the vocabulary, "
                    "or the request has outputs); sampling here instead",
                    r->id, n);
        return -1;
    }
    r->first_token_time = pd_time_now_s();
    return append_tokens(s, r, toks, n);
}

bool pd_scheduler_add_output_token(pd_scheduler_t *s, pd_request_t *r, int32_t token)
{
    return pd_scheduler_add_output_tokens(s, r, &token, 1) == 1;
}

/* Records that r got n tokens in this update (the frontend's outputs). */
static void with_push(pd_scheduler_t *s, int32_t *n_tok, pd_request_t *r, int32_t n)
{
    if (*n_tok == s->cap_with) {
        int32_t cap = 2 * s->cap_with;
        pd_request_t **w = realloc(s->with_token, (size_t)cap * sizeof(*w));
        if (w != NULL) {
            s->with_token = w;
        }
        int32_t *c = w != NULL ? realloc(s->with_count, (size_t)cap * sizeof(*c)) : NULL;
        if (c == NULL) {
            pd_log_error("scheduler: out of memory; request %s's new token has no output", r->id);
            return;
        }
        s->with_count = c;
        s->cap_with = cap;
    }
    s->with_token[*n_tok] = r;
    s->with_count[(*n_tok)++] = n;
}

/* vLLM's spec_decode counters: one draft of n tokens, of which the first accepted were accepted. */
static void count_spec(pd_scheduler_t *s, int32_t n, int32_t accepted)
{
    s->spec_drafts++;
    s->spec_draft_tokens += (uint64_t)n;
    s->spec_accepted += (uint64_t)accepted;
    for (int32_t j = 0; j < accepted && j < PD_SPEC_MAX_TOKENS; j++) {
        s->spec_accepted_per_pos[j]++;
    }
}

/* Blocks that failed to load: the policy decides for each request waiting on them. */
static void apply_load_errors(pd_scheduler_t *s, const uint32_t *bad, int32_t n_bad)
{
    if (n_bad == 0) {
        return;
    }
    for (pd_request_t *r = s->wait_head, *next; r != NULL; r = next) {
        next = r->next;
        if (r->state != PD_REQ_WAITING_FOR_REMOTE_KV) {
            continue;
        }
        int32_t first_bad = -1, G = s->kv.num_groups;
        for (int32_t i = 0; i < r->num_blocks * G && first_bad < 0; i++) {
            for (int32_t k = 0; k < n_bad && r->block_ids[i] != 0; k++) {
                if (r->block_ids[i] == bad[k]) {
                    first_bad = i / G; /* the logical block */
                    break;
                }
            }
        }
        if (first_bad < 0) {
            continue;
        }
        if (s->cfg.load_failure_policy == PD_LOAD_FAILURE_FAIL) {
            pd_log_warn("request %s: remote KV load failed at block %d; policy fail", r->id, first_bad);
            pd_strmap_del(&s->recv_done, r->id, strlen(r->id), NULL);
            finish_request(s, r, PD_REQ_FINISHED_ERROR);
            continue;
        }
        /* recompute: keep what arrived before the first bad block */
        int32_t valid = first_bad * s->cfg.block_size - r->num_computed_tokens;
        r->num_external_tokens = valid > 0 ? valid : 0;
        pd_log_warn("request %s: remote KV load failed at block %d; recomputing from token %d", r->id,
                    first_bad, r->num_computed_tokens + r->num_external_tokens);
    }
}

void pd_scheduler_update(pd_scheduler_t *s, const pd_scheduler_output_t *out, const pd_model_output_t *mo,
                         pd_scheduler_update_result_t *res)
{
    int32_t n_tok = 0, stride = mo->stride > 0 ? mo->stride : 1;
    for (int32_t i = 0; i < out->num_items; i++) {
        pd_request_t *r = out->items[i].req;
        int32_t drafts = r->num_spec_tokens;
        r->num_spec_tokens = 0;
        if (pd_request_is_finished(r)) {
            continue; /* aborted between schedule and update */
        }
        r->num_computed_tokens += out->items[i].num_new_tokens;
        const int32_t *toks = mo->sampled != NULL ? mo->sampled + (size_t)i * stride : NULL;
        if (r->num_computed_tokens < r->num_tokens || toks == NULL || toks[0] < 0) {
            continue; /* a prompt chunk: no token yet */
        }
        int32_t n = mo->num_sampled != NULL ? mo->num_sampled[i] : 1;
        n = n < 1 ? 1 : n > drafts + 1 ? drafts + 1 : n;
        if (drafts > 0) {
            count_spec(s, drafts, n - 1);
        }
        if (r->first_token_time == 0) {
            r->first_token_time = pd_time_now_s();
        }
        with_push(s, &n_tok, r, append_tokens(s, r, toks, n));
        if (!pd_request_is_finished(r)) {
            /* KV rollback: only the accepted drafts' slots hold valid KV; the last token is computed
             * next step, and blocks past the tokens (rejected positions only) go back at once */
            r->num_computed_tokens = r->num_tokens - 1;
            pd_kv_manager_trim(&s->kv, r, r->num_tokens);         /* also a draft model's lookahead */
            if (r->num_draft_computed > r->num_computed_tokens) { /* the draft's KV rolls back too */
                r->num_draft_computed = r->num_computed_tokens;
            }
        }
    }
    apply_load_errors(s, mo->load_error_blocks, mo->num_load_error_blocks);
    for (int32_t i = 0; i < mo->finished.num_recving; i++) {
        pd_request_t *r = pd_scheduler_find(s, mo->finished.recving[i]);
        if (r == NULL) {
            continue;
        }
        if (r->holds_blocks_after_finish) {
            end_hold(s, r); /* aborted while loading: the transfer is over now */
        } else if (r->state == PD_REQ_WAITING_FOR_REMOTE_KV) {
            /* push with first-token handover: the prefill's first token came with its WRITE_DONE */
            const int32_t *first = mo->finished.recving_first_token;
            const char *const *gs = mo->finished.recving_grammar_state;
            if (first != NULL && first[i] >= 0 && pd_scheduler_add_output_token(s, r, first[i])) {
                with_push(s, &n_tok, r, 1);
                if (gs != NULL && gs[i] != NULL && r->grammar != NULL) { /* the matcher resumes it */
                    free(r->grammar_state);
                    r->grammar_state = strdup(gs[i]); /* (none: it replays the token) */
                }
            }
            if (!pd_request_is_finished(r)) {
                pd_strmap_put(&s->recv_done, r->id, strlen(r->id), 1);
            }
        }
    }
    for (int32_t i = 0; i < mo->finished.num_sending; i++) {
        pd_request_t *r = pd_scheduler_find(s, mo->finished.sending[i]);
        if (r != NULL) {
            end_hold(s, r);
        }
    }
    res->with_new_token = s->with_token;
    res->num_new_tokens = s->with_count;
    res->num_with_new_token = n_tok;
    res->finished = s->finished;
    res->num_finished = s->num_finished;
}

/* ------------------------------------------------------------------ stats */

void pd_scheduler_get_stats(const pd_scheduler_t *s, pd_scheduler_stats_t *o)
{
    memset(o, 0, sizeof(*o));
    o->num_running = s->num_running;
    for (const pd_request_t *r = s->wait_head; r != NULL; r = r->next) {
        if (r->state == PD_REQ_WAITING_FOR_REMOTE_KV) {
            o->num_waiting_for_remote_kv++;
        } else {
            o->num_waiting++;
        }
    }
    o->num_holding = s->num_holding;
    o->num_preemptions = s->preemptions;
    o->num_load_waits = s->load_waits;
    o->prefix_queries = s->kv.prefix_queries;
    o->prefix_hits = s->kv.prefix_hits;
    o->kv_usage = pd_kv_manager_usage(&s->kv);
    o->blocks_free = pd_block_pool_num_free(s->kv.pool);
    o->blocks_cached_free = pd_block_pool_num_cached_free(s->kv.pool);
    o->blocks_used = pd_block_pool_num_used(s->kv.pool);
    pd_scheduler_get_spec_stats(s, o);
}

void pd_scheduler_get_spec_stats(const pd_scheduler_t *s, pd_scheduler_stats_t *o)
{
    o->spec_drafts = s->spec_drafts;
    o->spec_draft_tokens = s->spec_draft_tokens;
    o->spec_accepted = s->spec_accepted;
    memcpy(o->spec_accepted_per_pos, s->spec_accepted_per_pos, sizeof(o->spec_accepted_per_pos));
}

int32_t pd_scheduler_num_running(const pd_scheduler_t *s)
{
    return s->num_running;
}

bool pd_scheduler_idle(const pd_scheduler_t *s)
{
    return s->num_running == 0 && s->num_waiting == 0 && s->num_holding == 0 && s->kv.tier_loads == NULL;
}

pd_kv_cache_manager_t *pd_scheduler_kv(pd_scheduler_t *s)
{
    return &s->kv;
}
