/* engine/model_runner.c — one step of the model with the connector's worker hooks. */
#include "engine/model_runner.h"
#include "engine/structured.h"
#include "grammar/grammar.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/spec_verify.h"

pd_status_t pd_model_runner_init(pd_model_runner_t *r, pd_model_t *model, pd_backend_t *be, pd_kv_cache_t *kv,
                                 pd_connector_t *conn, int32_t max_reqs, int32_t max_tokens,
                                 int32_t max_model_len, int32_t max_spec_tokens)
{
    memset(r, 0, sizeof(*r));
    r->model = model;
    r->be = be;
    r->kv = kv;
    r->conn = conn;
    r->vocab = pd_model_config(model)->vocab_size;
    int32_t bs = kv->cfg.block_size;
    pd_status_t st = pd_input_batch_init(&r->batch, max_reqs, (max_model_len + bs - 1) / bs + 1, max_tokens,
                                         bs, kv->cfg.num_groups);
    if (st != PD_OK) {
        return st;
    }
    r->batch.layer_group = kv->cfg.layer_group;
    r->stride = 1 + (max_spec_tokens > 0 ? max_spec_tokens : 0);
    int64_t rows = (int64_t)max_reqs * r->stride;
    r->max_rows = (int32_t)(rows < (int64_t)max_reqs + max_tokens ? rows : (int64_t)max_reqs + max_tokens);
    size_t R = (size_t)max_reqs, RS = R * (size_t)r->stride, MR = (size_t)r->max_rows;
    r->logits = malloc(MR * (size_t)r->vocab * sizeof(float));
    r->params = malloc(MR * sizeof(pd_sampling_params_t));
    r->rngs = malloc(MR * sizeof(pd_rng_t));
    r->row_tokens = malloc(MR * sizeof(int32_t));
    r->sampled = malloc(RS * sizeof(int32_t));
    r->num_sampled = malloc(R * sizeof(int32_t));
    r->sampled_logprob = malloc(RS * sizeof(float));
    r->top_ids = malloc(RS * PD_MAX_LOGPROBS * sizeof(int32_t));
    r->top_logprobs = malloc(RS * PD_MAX_LOGPROBS * sizeof(float));
    r->cands = r->stride > 1 ? malloc((size_t)r->vocab * sizeof(pd_sample_cand_t)) : NULL;
    size_t T = (size_t)max_tokens;
    r->plp_logprob = malloc(T * sizeof(float));
    r->plp_rank = malloc(T * sizeof(int32_t));
    r->plp_top_ids = malloc(T * PD_MAX_LOGPROBS * sizeof(int32_t));
    r->plp_top_lp = malloc(T * PD_MAX_LOGPROBS * sizeof(float));
    const pd_model_config_t *mc = pd_model_config(model);
    r->num_eos = mc->num_eos < 8 ? mc->num_eos : 8;
    memcpy(r->eos, mc->eos_token_ids, (size_t)r->num_eos * sizeof(int32_t));
    if (!r->logits || !r->params || !r->rngs || !r->row_tokens || !r->sampled || !r->num_sampled ||
        !r->sampled_logprob || (r->stride > 1 && !r->cands) || !r->top_ids || !r->top_logprobs ||
        !r->plp_logprob || !r->plp_rank || !r->plp_top_ids || !r->plp_top_lp ||
        pd_logits_scratch_init(&r->lp_scratch, r->vocab) != PD_OK) {
        pd_model_runner_destroy(r);
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

void pd_model_runner_destroy(pd_model_runner_t *r)
{
    pd_input_batch_destroy(&r->batch);
    free(r->logits), free(r->params), free(r->rngs), free(r->row_tokens), free(r->sampled);
    free(r->num_sampled), free(r->cands);
    free(r->sampled_logprob), free(r->top_ids), free(r->top_logprobs);
    pd_logits_scratch_destroy(&r->lp_scratch);
    pd_gvocab_free(r->gvocab);
    free(r->gmask);
    r->gvocab = NULL, r->gmask = NULL;
    free(r->plp_logprob), free(r->plp_rank), free(r->plp_top_ids), free(r->plp_top_lp);
    r->logits = NULL;
}

static pd_status_t hook_save(void *ctx, int layer)
{
    pd_connector_t *c = ctx;
    return c->ops->save_kv_layer(c, layer);
}

static pd_status_t hook_wait(void *ctx, int layer)
{
    pd_connector_t *c = ctx;
    return c->ops->wait_for_layer_load(c, layer);
}

/* log-softmax of row: the sampled token's logprob and the top n (ties: lower id first). */
static void logprobs_row(const float *row, int32_t vocab, int32_t tok, int32_t n, float *tok_lp, int32_t *ids,
                         float *lps)
{
    float m = -INFINITY;
    for (int32_t v = 0; v < vocab; v++) {
        m = row[v] > m ? row[v] : m;
    }
    double sum = 0;
    for (int32_t v = 0; v < vocab; v++) {
        sum += exp((double)row[v] - m);
    }
    float lse = m + (float)log(sum);
    *tok_lp = row[tok] - lse;
    for (int32_t k = 0; k < n; k++) {
        ids[k] = -1;
    }
    for (int32_t v = 0; v < vocab; v++) {
        /* insertion into a sorted top-n list */
        int32_t k = n;
        while (k > 0 && (ids[k - 1] < 0 || row[v] > row[ids[k - 1]])) {
            k--;
        }
        if (k < n) {
            memmove(ids + k + 1, ids + k, (size_t)(n - k - 1) * sizeof(int32_t));
            ids[k] = v;
        }
    }
    for (int32_t k = 0; k < n; k++) {
        lps[k] = row[ids[k]] - lse;
    }
}

/* Prompt logprobs of the step's plp rows: the next prompt token's logprob and rank (1 + the number of
 * tokens more likely), and the top entries (vLLM's prompt_logprobs, from the raw logits). */
static void score_prompt(pd_model_runner_t *r, const pd_scheduler_output_t *out, const float *rows)
{
    const pd_input_batch_t *b = &r->batch;
    for (int32_t k = 0; k < b->num_plp; k++) {
        const pd_request_t *req = out->items[b->plp_item[k]].req;
        const float *row = rows + (size_t)k * r->vocab;
        int32_t next = req->tokens[b->plp_pos[k] + 1];
        int32_t n = req->params.prompt_logprobs;
        n = n > PD_MAX_LOGPROBS ? PD_MAX_LOGPROBS : n < 1 ? 1 : n;
        logprobs_row(row, r->vocab, next, n, &r->plp_logprob[k], r->plp_top_ids + (size_t)k * PD_MAX_LOGPROBS,
                     r->plp_top_lp + (size_t)k * PD_MAX_LOGPROBS);
        int32_t rank = 1;
        for (int32_t v = 0; v < r->vocab; v++) {
            rank += row[v] > row[next];
        }
        r->plp_rank[k] = rank;
    }
}

/* The end of the logits rows of the item whose first row is k0 (its drafts' rows follow it). */
static int32_t rows_end(const pd_input_batch_t *b, int32_t k0)
{
    int32_t k = k0;
    while (k < b->num_logits && b->logits_item[k] == b->logits_item[k0]) {
        k++;
    }
    return k;
}

/* Sampling of the step's logits rows (processed in place): one token per item through the backend's
 * sample op, or when some item carries drafts, every item through the verifier (spec_verify.h; for
 * an item without drafts it draws as the op does). Logprobs of each output token from its raw row. */
static pd_status_t sample_rows(pd_model_runner_t *r, const pd_scheduler_output_t *out)
{
    const pd_input_batch_t *b = &r->batch;
    size_t V = (size_t)r->vocab;
    bool any_lp = false, spec = false;
    for (int32_t k = 0; k < b->num_logits; k++) {
        any_lp |= out->items[b->logits_item[k]].req->params.logprobs > 0;
        spec |= k > 0 && b->logits_item[k] == b->logits_item[k - 1];
    }
    float *lp_rows = NULL; /* logprobs first: processing and sampling overwrite the logits */
    if (any_lp) {
        lp_rows = malloc((size_t)b->num_logits * V * sizeof(float));
        if (lp_rows == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        memcpy(lp_rows, r->logits, (size_t)b->num_logits * V * sizeof(float));
    }
    /* logits processors after the logprobs copy (vLLM reports raw logprobs), before sampling; the
     * row after draft j sees drafts [0, j) as output tokens (they sit past num_tokens) */
    for (int32_t k0 = 0, k1; k0 < b->num_logits; k0 = k1) {
        k1 = rows_end(b, k0);
        const pd_request_t *req = out->items[b->logits_item[k0]].req;
        for (int32_t k = k0; k < k1 && pd_logits_needs_processing(&req->params); k++) {
            pd_request_t view = *req;
            view.num_tokens += k - k0;
            pd_logits_process(r->logits + (size_t)k * V, r->vocab, &view, r->eos, r->num_eos, &r->lp_scratch);
        }
    }
    pd_status_t st = PD_OK;
    for (int32_t k0 = 0, k1; st == PD_OK && k0 < b->num_logits; k0 = k1) { /* structured outputs last */
        k1 = rows_end(b, k0);
        pd_request_t *req = out->items[b->logits_item[k0]].req;
        if (req->grammar != NULL) {
            st = pd_structured_mask_rows(r, req, r->logits + (size_t)k0 * V, k1 - k0);
        }
    }
    if (st != PD_OK) {
        free(lp_rows);
        return st;
    }
    if (!spec) {
        for (int32_t k = 0; k < b->num_logits; k++) {
            const pd_request_t *req = out->items[b->logits_item[k]].req;
            r->params[k] = req->params.sampling;
            pd_request_rng_at(req, pd_request_num_output(req), &r->rngs[k]);
        }
        st = r->be->ops->sample(r->be, r->row_tokens, r->logits, b->num_logits, r->vocab, r->params, r->rngs);
        for (int32_t k = 0; st == PD_OK && k < b->num_logits; k++) {
            int32_t item = b->logits_item[k];
            r->sampled[(size_t)item * r->stride] = r->row_tokens[k];
            r->num_sampled[item] = 1;
        }
    } else {
        for (int32_t k0 = 0, k1; k0 < b->num_logits; k0 = k1) {
            k1 = rows_end(b, k0);
            int32_t item = b->logits_item[k0], s = k1 - k0 - 1;
            pd_request_t *req = out->items[item].req;
            if (s >= r->stride || s > PD_SPEC_MAX_TOKENS) {
                pd_log_error("model runner: request %s carries %d drafts, at most %d", req->id, s,
                             r->stride - 1);
                st = PD_ERR_INVALID_ARG;
                break;
            }
            pd_rng_t rngs[PD_SPEC_MAX_TOKENS + 1];
            for (int32_t j = 0; j <= s; j++) {
                pd_request_rng_at(req, pd_request_num_output(req) + j, &rngs[j]);
            }
            r->num_sampled[item] =
                pd_spec_verify(r->logits + (size_t)k0 * V, r->vocab, req->tokens + req->num_tokens, s,
                               &req->params.sampling, rngs, r->cands, r->sampled + (size_t)item * r->stride);
        }
    }
    for (int32_t k0 = 0, k1; any_lp && st == PD_OK && k0 < b->num_logits; k0 = k1) {
        k1 = rows_end(b, k0);
        int32_t item = b->logits_item[k0];
        int32_t n = out->items[item].req->params.logprobs;
        n = n > PD_MAX_LOGPROBS ? PD_MAX_LOGPROBS : n;
        for (int32_t j = 0; n > 0 && j < r->num_sampled[item]; j++) {
            size_t o = (size_t)item * r->stride + j;
            logprobs_row(lp_rows + (size_t)(k0 + j) * V, r->vocab, r->sampled[o], n, &r->sampled_logprob[o],
                         r->top_ids + o * PD_MAX_LOGPROBS, r->top_logprobs + o * PD_MAX_LOGPROBS);
        }
    }
    free(lp_rows);
    return st;
}

pd_status_t pd_model_runner_execute(pd_model_runner_t *r, const pd_scheduler_output_t *out,
                                    pd_model_output_t *mo)
{
    memset(mo, 0, sizeof(*mo));
    for (int32_t i = 0; i < out->num_items; i++) {
        r->sampled[(size_t)i * r->stride] = -1;
        r->num_sampled[i] = 0;
    }
    mo->sampled = r->sampled;
    mo->num_sampled = r->num_sampled;
    mo->stride = r->stride;
    pd_input_batch_t *b = &r->batch;
    pd_status_t st = pd_input_batch_prepare(b, out, pd_model_config(r->model)->sliding_window);
    if (st == PD_OK && b->num_logits > r->max_rows) {
        pd_log_error("model runner: %d logits rows in one step, room for %d", b->num_logits, r->max_rows);
        st = PD_ERR_NO_SPACE;
    }
    if (st != PD_OK) {
        return st;
    }
    pd_forward_hooks_t hooks = {r->conn, hook_save, hook_wait};
    if (r->conn != NULL) {
        st = r->conn->ops->bind_connector_metadata(r->conn, out->connector_meta);
        if (st == PD_OK) {
            st = r->conn->ops->start_load_kv(r->conn);
        }
        if (st != PD_OK) {
            pd_log_warn("model runner: connector failed to start loading: %s", pd_status_str(st));
        }
    }
    double t0 = pd_time_now_s();
    float *plp_rows = NULL; /* [num_plp][vocab] after the sampling rows */
    if (b->num_tokens > 0 && st == PD_OK) {
        float *dst = r->logits;
        if (b->num_plp > 0) {
            dst = malloc((size_t)(b->num_logits + b->num_plp) * (size_t)r->vocab * sizeof(float));
            if (dst == NULL) {
                st = PD_ERR_NO_MEMORY;
            }
        }
        if (st == PD_OK) {
            st = pd_model_forward(r->model, &b->batch, r->kv->views, &b->meta, b->logits_indices,
                                  b->num_logits + b->num_plp, r->conn != NULL ? &hooks : NULL, dst);
        }
        if (dst != r->logits && dst != NULL) {
            memcpy(r->logits, dst, (size_t)b->num_logits * (size_t)r->vocab * sizeof(float));
            plp_rows = dst;
        }
    }
    r->last_forward_s = pd_time_now_s() - t0;
    if (r->conn != NULL) {
        pd_status_t ws = r->conn->ops->wait_for_save(r->conn);
        if (ws != PD_OK) {
            pd_log_warn("model runner: connector wait_for_save: %s", pd_status_str(ws));
        }
        r->conn->ops->get_finished(r->conn, &mo->finished);
        mo->num_load_error_blocks =
            r->conn->ops->get_block_ids_with_load_errors(r->conn, r->load_errors, 1024);
        mo->load_error_blocks = r->load_errors;
    }
    if (st == PD_OK && plp_rows != NULL) {
        score_prompt(r, out, plp_rows + (size_t)b->num_logits * (size_t)r->vocab);
    }
    free(plp_rows);
    if (st != PD_OK) {
        return st;
    }
    r->steps++;
    return b->num_logits > 0 ? sample_rows(r, out) : PD_OK;
}
