/* engine/input_batch.h — the persistent input batch (vLLM's InputBatch): request slots with their
 * block-table rows kept across steps (only new block ids are appended each step), condensed when
 * requests leave; and the per-step arrays the forward needs, built in slot order:
 *   token_ids, positions (offset by computed tokens), slot_mapping [num_tokens]
 *   cu_seqlens_q [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs][max_blocks]
 *   logits_indices: the last new token of every sequence whose step completes its tokens, and
 *   each of its draft tokens (speculative decoding: the tokens past req->num_tokens), in order. */
#ifndef PD_ENGINE_INPUT_BATCH_H
#define PD_ENGINE_INPUT_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "model/model.h"
#include "scheduler/scheduler.h"

typedef struct pd_input_batch {
    int32_t max_reqs;
    int32_t max_blocks;         /* per request, logical (per group) */
    int32_t num_groups;         /* KV cache groups G: rows hold G ids per logical block, as requests do */
    int32_t row_width;          /* max_blocks × G */
    const int32_t *layer_group; /* layer → group (G > 1), for the attention metadata; set by the owner */
    int32_t max_tokens;         /* per step */
    int32_t block_size;
    pd_request_t **slots; /* [max_reqs]; NULL = hole */
    int32_t *row_len;     /* [max_reqs] logical blocks copied into the row */
    int32_t *block_table; /* [max_reqs][row_width] */
    int32_t num_slots;    /* slots in use are within [0, num_slots) */
    bool has_holes;
    /* per step */
    int32_t *token_ids, *positions;   /* [max_tokens] */
    int32_t *slot_mapping;            /* [G][max_tokens] */
    int32_t *cu_seqlens_q, *seq_lens; /* [max_reqs + 1], [max_reqs] */
    int32_t *gathered_table;          /* [G][max_reqs][max_blocks] when slots are skipped or G > 1 */
    int32_t *logits_indices;          /* [max_reqs + 2 max_tokens] rows of the batch that need logits */
    int32_t *logits_item;             /* [max_reqs + max_tokens] scheduler item of each logits row */
    /* prompt logprobs: rows after the sampling rows that score the next prompt token */
    int32_t *plp_indices; /* [max_tokens] batch rows */
    int32_t *plp_item;    /* [max_tokens] scheduler item */
    int32_t *plp_pos;     /* [max_tokens] position p of the row (it predicts prompt token p + 1) */
    int32_t num_plp;
    int32_t *item_of_seq; /* [max_reqs] scheduler item of each slot (-1: none) */
    int32_t num_seqs, num_tokens, num_logits;
    pd_batch_t batch;
    pd_attn_meta_t meta;
} pd_input_batch_t;

pd_status_t pd_input_batch_init(pd_input_batch_t *b, int32_t max_reqs, int32_t max_blocks, int32_t max_tokens,
                                int32_t block_size, int32_t num_groups);
void pd_input_batch_destroy(pd_input_batch_t *b);

/* Drops req from its slot (no-op when absent); the hole is filled by pd_input_batch_condense. */
void pd_input_batch_remove(pd_input_batch_t *b, pd_request_t *req);

/* Moves the last slots into holes so slots [0, num_slots) are all used (rows move with them). */
void pd_input_batch_condense(pd_input_batch_t *b);

/* Applies a scheduler output: drops preempted requests, adds new ones, appends new block ids,
 * condenses, and builds the step arrays (batch, meta, logits rows). PD_ERR_NO_SPACE if a limit of
 * the batch would be exceeded (a scheduler/engine configuration bug; logged). */
pd_status_t pd_input_batch_prepare(pd_input_batch_t *b, const pd_scheduler_output_t *out,
                                   int32_t sliding_window);

#endif
