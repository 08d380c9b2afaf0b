/* engine/input_batch.c — persistent slots + per-step arrays. */
#include "engine/input_batch.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/paged_impl.h"

pd_status_t pd_input_batch_init(pd_input_batch_t *b, int32_t max_reqs, int32_t max_blocks, int32_t max_tokens,
                                int32_t block_size, int32_t num_groups)
{
    memset(b, 0, sizeof(*b));
    b->max_reqs = max_reqs;
    b->max_blocks = max_blocks;
    b->max_tokens = max_tokens;
    b->block_size = block_size;
    b->num_groups = num_groups > 0 ? num_groups : 1;
    b->row_width = max_blocks * b->num_groups;
    size_t R = (size_t)max_reqs, T = (size_t)max_tokens * (size_t)b->num_groups,
           tbl = R * (size_t)b->row_width;
    b->slots = calloc(R, sizeof(pd_request_t *));
    b->row_len = calloc(R, sizeof(int32_t));
    b->block_table = calloc(tbl, sizeof(int32_t));
    b->gathered_table = calloc(tbl, sizeof(int32_t));
    b->token_ids = malloc(T * 4);
    b->positions = malloc(T * 4);
    b->slot_mapping = malloc(T * 4);
    b->cu_seqlens_q = malloc((R + 1) * 4);
    b->seq_lens = malloc(R * 4);
    b->logits_indices = malloc((R + 2 * T) * 4); /* sampling rows, then prompt-logprob rows */
    b->logits_item = malloc((R + T) * 4);        /* a row per token when drafts are verified */
    b->plp_indices = malloc(T * 4);
    b->plp_item = malloc(T * 4);
    b->plp_pos = malloc(T * 4);
    b->item_of_seq = malloc(R * 4);
    if (!b->slots || !b->row_len || !b->block_table || !b->gathered_table || !b->token_ids || !b->positions ||
        !b->slot_mapping || !b->cu_seqlens_q || !b->seq_lens || !b->logits_indices || !b->logits_item ||
        !b->item_of_seq || !b->plp_indices || !b->plp_item || !b->plp_pos) {
        pd_input_batch_destroy(b);
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

void pd_input_batch_destroy(pd_input_batch_t *b)
{
    free(b->slots), free(b->row_len), free(b->block_table), free(b->gathered_table);
    free(b->token_ids), free(b->positions), free(b->slot_mapping), free(b->cu_seqlens_q), free(b->seq_lens);
    free(b->logits_indices), free(b->logits_item), free(b->item_of_seq);
    free(b->plp_indices), free(b->plp_item), free(b->plp_pos);
    memset(b, 0, sizeof(*b));
}

void pd_input_batch_remove(pd_input_batch_t *b, pd_request_t *req)
{
    int32_t s = req->batch_slot;
    if (s < 0 || s >= b->num_slots || b->slots[s] != req) {
        return;
    }
    b->slots[s] = NULL;
    b->row_len[s] = 0;
    req->batch_slot = -1;
    b->has_holes = true;
}

void pd_input_batch_condense(pd_input_batch_t *b)
{
    if (!b->has_holes) {
        return;
    }
    int32_t last = b->num_slots - 1;
    for (int32_t s = 0; s <= last; s++) {
        if (b->slots[s] != NULL) {
            continue;
        }
        while (last > s && b->slots[last] == NULL) {
            last--;
        }
        if (last <= s) {
            break;
        }
        b->slots[s] = b->slots[last];
        b->row_len[s] = b->row_len[last];
        memcpy(b->block_table + (size_t)s * b->row_width, b->block_table + (size_t)last * b->row_width,
               (size_t)b->row_len[last] * (size_t)b->num_groups * sizeof(int32_t));
        b->slots[s]->batch_slot = s;
        b->slots[last] = NULL;
        b->row_len[last] = 0;
        last--;
    }
    while (b->num_slots > 0 && b->slots[b->num_slots - 1] == NULL) {
        b->num_slots--;
    }
    b->has_holes = false;
}

static pd_status_t batch_add(pd_input_batch_t *b, pd_request_t *req)
{
    pd_input_batch_condense(b);
    if (b->num_slots == b->max_reqs) {
        pd_log_error("input batch: no slot for request %s (%d slots)", req->id, b->max_reqs);
        return PD_ERR_NO_SPACE;
    }
    int32_t s = b->num_slots++;
    b->slots[s] = req;
    b->row_len[s] = 0;
    req->batch_slot = s;
    return PD_OK;
}

pd_status_t pd_input_batch_prepare(pd_input_batch_t *b, const pd_scheduler_output_t *out,
                                   int32_t sliding_window)
{
    for (int32_t i = 0; i < out->num_preempted; i++) {
        pd_input_batch_remove(b, out->preempted[i]);
    }
    pd_input_batch_condense(b);
    /* slot → scheduler item (−1: in the batch but not scheduled this step) */
    for (int32_t s = 0; s < b->max_reqs; s++) {
        b->item_of_seq[s] = -1;
    }
    for (int32_t i = 0; i < out->num_items; i++) {
        pd_request_t *r = out->items[i].req;
        if (r->batch_slot < 0) {
            pd_status_t st = batch_add(b, r);
            if (st != PD_OK) {
                return st;
            }
        }
        int32_t s = r->batch_slot;
        if (r->num_blocks > b->max_blocks) {
            pd_log_error("input batch: request %s has %d blocks, rows hold %d", r->id, r->num_blocks,
                         b->max_blocks);
            return PD_ERR_NO_SPACE;
        }
        /* blocks only grow while a request stays in the batch: copy the new ids (a sliding
         * window's freed entries turn 0, and rejected drafts give tail blocks back, so then the
         * whole row is copied) */
        int32_t G = b->num_groups, from = sliding_window > 0 || r->blocks_trimmed ? 0 : b->row_len[s] * G;
        r->blocks_trimmed = false;
        for (int32_t k = from; k < r->num_blocks * G; k++) {
            b->block_table[(size_t)s * b->row_width + k] = (int32_t)r->block_ids[k];
        }
        b->row_len[s] = r->num_blocks;
        b->item_of_seq[s] = i;
    }
    /* sequences in slot order; when some slot is not scheduled its row is skipped, so the rows
     * of the scheduled ones are gathered into a dense table */
    bool contiguous = b->num_groups == 1;
    for (int32_t s = 0; s < b->num_slots; s++) {
        contiguous &= b->item_of_seq[s] >= 0;
    }
    int32_t G = b->num_groups, MB = b->max_blocks;
    int32_t n = 0, t = 0, nl = 0, np = 0;
    b->cu_seqlens_q[0] = 0;
    for (int32_t s = 0; s < b->num_slots; s++) {
        int32_t i = b->item_of_seq[s];
        if (i < 0) {
            continue;
        }
        pd_request_t *r = out->items[i].req;
        int32_t q = out->items[i].num_new_tokens;
        if (t + q > b->max_tokens) {
            pd_log_error("input batch: step of more than %d tokens", b->max_tokens);
            return PD_ERR_NO_SPACE;
        }
        /* group g's slots at [g × max_tokens], its table rows at [(g × max_reqs + n) × max_blocks];
         * both compacted after the loop (meta: group g at g × num_tokens, g × num_seqs rows) */
        const int32_t *row = b->block_table + (size_t)s * b->row_width;
        for (int32_t k = 0; k < q; k++) {
            int32_t p = r->num_computed_tokens + k;
            b->token_ids[t + k] = r->tokens[p];
            b->positions[t + k] = p;
            for (int32_t g = 0; g < G; g++) {
                b->slot_mapping[(size_t)g * b->max_tokens + t + k] =
                    row[(p / b->block_size) * G + g] * b->block_size + p % b->block_size;
            }
        }
        t += q;
        b->cu_seqlens_q[n + 1] = t;
        b->seq_lens[n] = r->num_computed_tokens + q;
        if (!contiguous && G == 1) {
            memcpy(b->gathered_table + (size_t)n * MB, row, (size_t)b->row_len[s] * sizeof(int32_t));
        }
        for (int32_t g = 0; G > 1 && g < G; g++) {
            int32_t *dst = b->gathered_table + ((size_t)g * b->max_reqs + n) * MB;
            for (int32_t k = 0; k < b->row_len[s]; k++) {
                dst[k] = row[k * G + g];
            }
        }
        /* the step completes the tokens: the last one's row samples; with draft tokens (past
         * num_tokens) every draft's row too, to verify it */
        for (int32_t k = r->num_tokens - 1 - r->num_computed_tokens; k < q; k++) {
            if (k >= 0) {
                b->logits_indices[nl] = t - q + k;
                b->logits_item[nl] = i;
                nl++;
            }
        }
        if (r->params.want_prompt_logprobs) { /* rows scoring the next prompt token */
            for (int32_t k = 0; k < q; k++) {
                int32_t p = r->num_computed_tokens + k;
                if (p + 1 < r->num_prompt_tokens) {
                    b->plp_indices[np] = t - q + k;
                    b->plp_item[np] = i;
                    b->plp_pos[np] = p;
                    np++;
                }
            }
        }
        n++;
    }
    b->num_seqs = n;
    b->num_tokens = t;
    b->num_logits = nl;
    b->num_plp = np;
    memcpy(b->logits_indices + nl, b->plp_indices, (size_t)np * sizeof(int32_t));
    for (int32_t g = 1; g < G; g++) { /* compact the groups' slots and tables */
        memmove(b->slot_mapping + (size_t)g * t, b->slot_mapping + (size_t)g * b->max_tokens,
                (size_t)t * sizeof(int32_t));
        memmove(b->gathered_table + (size_t)g * n * MB, b->gathered_table + (size_t)g * b->max_reqs * MB,
                (size_t)n * MB * sizeof(int32_t));
    }
    b->batch = (pd_batch_t){t, b->token_ids, b->positions};
    b->meta = (pd_attn_meta_t){n,
                               t,
                               b->cu_seqlens_q,
                               b->seq_lens,
                               contiguous ? b->block_table : b->gathered_table,
                               b->max_blocks,
                               b->slot_mapping,
                               sliding_window,
                               G > 1 ? b->layer_group : NULL};
    return PD_OK;
}
