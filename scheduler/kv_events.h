/* scheduler/kv_events.h — the prefix cache's changes as vLLM's KV cache events describe them
 * (BlockStored, BlockRemoved, AllBlocksCleared), logged in the order they happen by the block pool
 * and the KV cache manager, and drained by the engine after each step (engine/kv_events_pub.c
 * publishes them). Engine thread only. */
#ifndef PD_SCHEDULER_KV_EVENTS_H
#define PD_SCHEDULER_KV_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/hash.h"
#include "common/status.h"

typedef enum pd_kv_event_kind {
    PD_KV_EV_STORED,  /* a full block's hash entered the prefix cache */
    PD_KV_EV_REMOVED, /* a hash left it (its block was reused) */
    PD_KV_EV_CLEARED, /* every hash left it */
} pd_kv_event_kind_t;

/* Where a block is held (vLLM's medium field): the pool (named by the publisher: "CPU" or "GPU") or
 * a tier behind it (engine/kv_offload.h). */
typedef enum pd_kv_medium {
    PD_KV_MEDIUM_POOL = 0,
    PD_KV_MEDIUM_HOST_TIER, /* "CPU_TIER" */
    PD_KV_MEDIUM_DISK_TIER, /* "DISK" */
} pd_kv_medium_t;

typedef struct pd_kv_event {
    pd_kv_event_kind_t kind;
    pd_kv_medium_t medium;
    uint64_t hash;    /* the block's key: pd_kv_event_hash of its chained hash */
    uint64_t parent;  /* stored: the previous block's key (has_parent) */
    bool has_parent;  /* stored: false for a prompt's first block */
    size_t token_off; /* stored: its block_size tokens at log->tokens[token_off] */
} pd_kv_event_t;

typedef struct pd_kv_event_log {
    pd_kv_event_t *ev;
    size_t num, cap;
    int32_t *tokens;
    size_t num_tokens, cap_tokens;
    int32_t block_size;
    bool overflowed; /* an append failed (out of memory): consumers must resynchronise */
} pd_kv_event_log_t;

/* The 64-bit key events carry for a block's 128-bit chained hash (its low half), the same a
 * subscriber computes with pd_hash128_chain over a prompt's blocks. */
static inline uint64_t pd_kv_event_hash(pd_hash128_t h)
{
    return h.lo;
}

/* Records that a block of tokens[block_size] with key hash (after parent, when has_parent) was
 * cached. */
void pd_kv_event_stored(pd_kv_event_log_t *log, uint64_t hash, bool has_parent, uint64_t parent,
                        const int32_t *tokens);
void pd_kv_event_removed(pd_kv_event_log_t *log, uint64_t hash);
/* A tier behind the pool now holds / no longer holds the block with key hash (stored without its
 * parent or tokens, as vLLM's offloading connector reports its CPU tier). */
void pd_kv_event_tier(pd_kv_event_log_t *log, pd_kv_medium_t medium, uint64_t hash, bool stored);
void pd_kv_event_cleared(pd_kv_event_log_t *log);

/* Empties the log (after the engine published it). */
void pd_kv_event_log_reset(pd_kv_event_log_t *log);
void pd_kv_event_log_free(pd_kv_event_log_t *log);

#endif
