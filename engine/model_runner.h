/* engine/model_runner.h — runs one scheduled step: input batch → connector start_load_kv →
 * forward (per layer: save_kv_layer after the cache write, wait_for_layer_load before attention)
 * → wait_for_save → get_finished → sampling (+ logprobs) for the sequences that completed, or, for
 * sequences that carry draft tokens, their verification (engine/spec_verify.h).
 *
 * Outputs are by scheduler item with a stride of 1 + the most draft tokens an item may carry:
 * item i's tokens (and their logprobs) sit at i × stride + j. */
#ifndef PD_ENGINE_MODEL_RUNNER_H
#define PD_ENGINE_MODEL_RUNNER_H

#include "connector/connector.h"
#include "engine/input_batch.h"
#include "engine/kv_init.h"
#include "engine/logits_process.h"
#include "kernels/sample.h"
#include "model/model.h"
#include "scheduler/scheduler.h"

#define PD_MAX_LOGPROBS 20

typedef struct pd_model_runner {
    pd_model_t *model;
    pd_backend_t *be;
    pd_kv_cache_t *kv;
    pd_connector_t *conn;
    pd_input_batch_t batch;
    int32_t vocab;
    int32_t stride;                 /* 1 + the draft tokens an item may carry */
    int32_t max_rows;               /* logits rows per step at most */
    float *logits;                  /* [max_rows][vocab] */
    pd_sampling_params_t *params;   /* [max_rows] */
    pd_rng_t *rngs;                 /* [max_rows] */
    int32_t *row_tokens;            /* [max_rows] */
    int32_t *sampled;               /* [max_reqs × stride] by scheduler item */
    int32_t *num_sampled;           /* [max_reqs] tokens each item produced */
    float *sampled_logprob;         /* [max_reqs × stride] (when the request asked for logprobs) */
    int32_t *top_ids;               /* [max_reqs × stride][PD_MAX_LOGPROBS] */
    float *top_logprobs;            /* [max_reqs × stride][PD_MAX_LOGPROBS] */
    pd_sample_cand_t *cands;        /* [vocab] the verifier's scratch (when stride > 1) */
    pd_logits_scratch_t lp_scratch; /* logits processors' per-vocabulary scratch */
    int32_t eos[8];                 /* the model's EOS ids (min_tokens masks them) */
    /* structured outputs (engine/structured.c): the vocabulary's bytes for the masks, made at the
     * first request with a grammar, and one row's mask */
    const struct pd_tokenizer *tok;
    struct pd_gvocab *gvocab;
    uint32_t *gmask;          /* [(vocab + 31) / 32] */
    uint64_t grammar_resumed; /* structured outputs resumed at a prefill's handed-over grammar state */
    int32_t num_eos;
    /* prompt logprobs of this step, by plp row: the prompt token's logprob and rank, and the top */
    float *plp_logprob;   /* [max_tokens] */
    int32_t *plp_rank;    /* [max_tokens] */
    int32_t *plp_top_ids; /* [max_tokens][PD_MAX_LOGPROBS] */
    float *plp_top_lp;    /* [max_tokens][PD_MAX_LOGPROBS] */
    uint32_t load_errors[1024];
    uint64_t steps;
    double last_forward_s;
} pd_model_runner_t;

/* max_spec_tokens: draft tokens an item may carry (0 without speculative decoding). */
pd_status_t pd_model_runner_init(pd_model_runner_t *r, pd_model_t *model, pd_backend_t *be, pd_kv_cache_t *kv,
                                 pd_connector_t *conn, int32_t max_reqs, int32_t max_tokens,
                                 int32_t max_model_len, int32_t max_spec_tokens);
void pd_model_runner_destroy(pd_model_runner_t *r);

/* Executes out and fills mo (pointers into the runner, valid until the next execute). A failing
 * forward (bad ids, a hook error) returns its status with nothing sampled. */
pd_status_t pd_model_runner_execute(pd_model_runner_t *r, const pd_scheduler_output_t *out,
                                    pd_model_output_t *mo);

#endif
