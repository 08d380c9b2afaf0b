/* engine/logits_process.h — the logits processors vLLM applies before sampling, in its order:
 * bad_words, logit_bias, min_tokens, then the penalties (repetition over prompt + output tokens,
 * frequency and presence over output tokens). They run on the host logits every backend samples
 * from, so the CPU and CUDA paths share them; temperature, min_p, top-k and top-p are the sampling
 * op's (kernels/). Logprobs are taken before these run (vLLM's raw_logprobs). */
#ifndef PD_ENGINE_LOGITS_PROCESS_H
#define PD_ENGINE_LOGITS_PROCESS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "scheduler/request.h"

/* Per-vocabulary scratch reused across rows; zero between uses. */
typedef struct pd_logits_scratch {
    int32_t vocab;
    uint32_t *count; /* [vocab] output-token counts of the current row */
    uint8_t *seen;   /* [vocab] prompt-or-output marks of the current row */
} pd_logits_scratch_t;

pd_status_t pd_logits_scratch_init(pd_logits_scratch_t *s, int32_t vocab);
void pd_logits_scratch_destroy(pd_logits_scratch_t *s);

/* Whether req asks for any processing (so rows that do not are left untouched). */
bool pd_logits_needs_processing(const pd_request_params_t *p);

/* Applies req's processors to row[vocab] (its next-token logits), given the request's tokens so
 * far (prompt, then output). eos[n_eos] are the model's EOS ids, masked with stop_token_ids while
 * fewer than min_tokens outputs exist (vLLM masks EOS then even with ignore_eos). Ids outside the
 * vocabulary are skipped (the API refuses them first). */
void pd_logits_process(float *row, int32_t vocab, const pd_request_t *req, const int32_t *eos, int32_t n_eos,
                       pd_logits_scratch_t *scratch);

#endif
