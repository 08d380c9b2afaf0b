/* engine/spec_draft.c — the draft-model proposer (see spec_draft.h). */
#include "engine/spec_draft.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/sample.h"

pd_status_t pd_spec_draft_init(pd_spec_draft_t *d, pd_model_t *model, pd_kv_cache_t *kv, int32_t max_reqs,
                               int32_t max_tokens, int32_t max_blocks)
{
    memset(d, 0, sizeof(*d));
    d->model = model;
    d->kv = kv;
    d->vocab = pd_model_config(model)->vocab_size;
    d->block_size = kv->cfg.block_size;
    d->max_reqs = max_reqs;
    d->max_tokens = max_tokens > max_reqs ? max_tokens : max_reqs; /* a pass has one token a request */
    d->max_blocks = max_blocks;
    size_t T = (size_t)d->max_tokens, R = (size_t)max_reqs;
    d->tok = malloc(T * sizeof(int32_t));
    d->pos = malloc(T * sizeof(int32_t));
    d->slot = malloc(T * sizeof(int32_t));
    d->cu = malloc((R + 1) * sizeof(int32_t));
    d->seq_lens = malloc(R * sizeof(int32_t));
    d->tables = malloc(R * (size_t)max_blocks * sizeof(int32_t));
    d->lidx = malloc(R * sizeof(int32_t));
    d->logits = malloc(R * (size_t)d->vocab * sizeof(float));
    d->done = malloc(R * sizeof(int32_t));
    d->piece_req = malloc(R * sizeof(pd_request_t *));
    d->piece_start = malloc(R * sizeof(int32_t));
    d->piece_len = malloc(R * sizeof(int32_t));
    if (!d->tok || !d->pos || !d->slot || !d->cu || !d->seq_lens || !d->tables || !d->lidx || !d->logits ||
        !d->done || !d->piece_req || !d->piece_start || !d->piece_len) {
        pd_spec_draft_destroy(d);
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

void pd_spec_draft_destroy(pd_spec_draft_t *d)
{
    free(d->tok), free(d->pos), free(d->slot), free(d->cu), free(d->seq_lens), free(d->tables);
    free(d->lidx), free(d->logits), free(d->done), free(d->piece_req), free(d->piece_start);
    free(d->piece_len);
    memset(d, 0, sizeof(*d));
}

/* One draft forward over the n pieces set in d->piece_*: tokens [start, start + len) of each
 * request, at their positions, their KV written through the request's block ids; with logits, the
 * rows of each piece's last token land in d->logits in piece order. */
static pd_status_t run_pieces(pd_spec_draft_t *d, int32_t n, bool logits)
{
    int32_t t = 0, bs = d->block_size;
    d->cu[0] = 0;
    for (int32_t i = 0; i < n; i++) {
        const pd_request_t *r = d->piece_req[i];
        int32_t start = d->piece_start[i], len = d->piece_len[i];
        if (r->num_blocks > d->max_blocks || (start + len + bs - 1) / bs > r->num_blocks) {
            pd_log_error("draft model: request %s holds %d blocks for positions up to %d", r->id,
                         r->num_blocks, start + len);
            return PD_ERR_INTERNAL;
        }
        for (int32_t k = 0; k < len; k++) {
            int32_t p = start + k;
            d->tok[t] = r->tokens[p];
            d->pos[t] = p;
            d->slot[t] = (int32_t)r->block_ids[p / bs] * bs + p % bs;
            t++;
        }
        d->cu[i + 1] = t;
        d->seq_lens[i] = start + len;
        int32_t *row = d->tables + (size_t)i * d->max_blocks;
        for (int32_t b = 0; b < r->num_blocks; b++) {
            row[b] = (int32_t)r->block_ids[b];
        }
        d->lidx[i] = t - 1;
    }
    pd_batch_t batch = {t, d->tok, d->pos};
    pd_attn_meta_t meta = {n, t, d->cu, d->seq_lens, d->tables, d->max_blocks, d->slot, 0, NULL};
    return pd_model_forward(d->model, &batch, d->kv->views, &meta, d->lidx, logits ? n : 0, NULL, d->logits);
}

/* Brings the draft's KV of every request up to (not including) its last token, in forwards of at
 * most max_tokens tokens. */
static pd_status_t catch_up(pd_spec_draft_t *d, pd_request_t **reqs, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        int32_t c = reqs[i]->num_draft_computed;
        d->done[i] = c < 0 ? 0 : c > reqs[i]->num_tokens - 1 ? reqs[i]->num_tokens - 1 : c;
    }
    for (int32_t i = 0; i < n;) {
        int32_t np = 0, budget = d->max_tokens;
        for (; i < n && budget > 0 && np < d->max_reqs; i++) {
            int32_t left = reqs[i]->num_tokens - 1 - d->done[i];
            if (left <= 0) {
                continue;
            }
            int32_t len = left < budget ? left : budget;
            d->piece_req[np] = reqs[i];
            d->piece_start[np] = d->done[i];
            d->piece_len[np++] = len;
            d->done[i] += len;
            budget -= len;
            if (d->done[i] < reqs[i]->num_tokens - 1) {
                break; /* the rest of this one in the next forward */
            }
        }
        if (np > 0) {
            pd_status_t st = run_pieces(d, np, false);
            if (st != PD_OK) {
                return st;
            }
        }
    }
    return PD_OK;
}

pd_status_t pd_spec_draft_propose(pd_spec_draft_t *d, pd_request_t **reqs, const int32_t *want, int32_t n)
{
    int32_t most = 0;
    for (int32_t i = 0; i < n; i++) {
        reqs[i]->num_spec_tokens = 0;
        most = want[i] > most ? want[i] : most;
    }
    if (n > d->max_reqs) {
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = catch_up(d, reqs, n);
    /* pass j feeds each request's token at num_tokens − 1 + j (its last token, then its drafts) */
    for (int32_t j = 0; st == PD_OK && j < most; j++) {
        int32_t np = 0;
        for (int32_t i = 0; i < n; i++) {
            if (j < want[i]) {
                d->piece_req[np] = reqs[i];
                d->piece_start[np] = reqs[i]->num_tokens - 1 + j;
                d->piece_len[np++] = 1;
            }
        }
        st = run_pieces(d, np, true);
        for (int32_t k = 0; st == PD_OK && k < np; k++) {
            pd_request_t *r = d->piece_req[k];
            r->tokens[r->num_tokens + j] = pd_sample_argmax(d->logits + (size_t)k * d->vocab, d->vocab);
        }
    }
    for (int32_t i = 0; i < n; i++) {
        pd_request_t *r = reqs[i];
        if (st == PD_OK) {
            r->num_spec_tokens = want[i];
            r->num_draft_computed = r->num_tokens - 1 + want[i];
        } else {
            r->num_draft_computed = 0; /* what the draft wrote is not trusted: recompute it */
        }
    }
    if (st != PD_OK) {
        pd_log_warn("draft model: proposing failed (%s); no drafts this step", pd_status_str(st));
    }
    return st;
}
