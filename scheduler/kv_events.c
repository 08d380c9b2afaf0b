/* scheduler/kv_events.c — the prefix cache's event log (see kv_events.h). */
#include "scheduler/kv_events.h"

#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/log.h"

static pd_kv_event_t *add(pd_kv_event_log_t *log, pd_kv_event_kind_t kind)
{
    if (pd_array_reserve(&log->ev, &log->cap, log->num + 1) != PD_OK) {
        if (!log->overflowed) {
            pd_log_error("kv events: out of memory; subscribers will see a gap");
        }
        log->overflowed = true;
        return NULL;
    }
    pd_kv_event_t *e = &log->ev[log->num++];
    memset(e, 0, sizeof(*e));
    e->kind = kind;
    return e;
}

void pd_kv_event_stored(pd_kv_event_log_t *log, uint64_t hash, bool has_parent, uint64_t parent,
                        const int32_t *tokens)
{
    size_t bs = (size_t)log->block_size;
    if (pd_array_reserve(&log->tokens, &log->cap_tokens, log->num_tokens + bs) != PD_OK) {
        log->overflowed = true;
        return;
    }
    pd_kv_event_t *e = add(log, PD_KV_EV_STORED);
    if (e == NULL) {
        return;
    }
    e->hash = hash;
    e->parent = parent;
    e->has_parent = has_parent;
    e->token_off = log->num_tokens;
    memcpy(log->tokens + log->num_tokens, tokens, bs * sizeof(int32_t));
    log->num_tokens += bs;
}

void pd_kv_event_removed(pd_kv_event_log_t *log, uint64_t hash)
{
    pd_kv_event_t *e = add(log, PD_KV_EV_REMOVED);
    if (e != NULL) {
        e->hash = hash;
    }
}

void pd_kv_event_tier(pd_kv_event_log_t *log, pd_kv_medium_t medium, uint64_t hash, bool stored)
{
    pd_kv_event_t *e = add(log, stored ? PD_KV_EV_STORED : PD_KV_EV_REMOVED);
    if (e != NULL) {
        e->hash = hash;
        e->medium = medium;
    }
}

void pd_kv_event_cleared(pd_kv_event_log_t *log)
{
    add(log, PD_KV_EV_CLEARED);
}

void pd_kv_event_log_reset(pd_kv_event_log_t *log)
{
    log->num = 0;
    log->num_tokens = 0;
    log->overflowed = false;
}

void pd_kv_event_log_free(pd_kv_event_log_t *log)
{
    free(log->ev);
    free(log->tokens);
    memset(log, 0, sizeof(*log));
}
