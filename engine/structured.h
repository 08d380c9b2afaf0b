/* engine/structured.h — structured outputs in the model runner: a grammar request's matcher follows
 * its output tokens, and its next-token mask is applied to the request's logits rows after the
 * logits processors, before sampling (so every backend samples under it, and the speculative
 * verifier sees draft tokens the grammar refuses at probability zero). */
#ifndef PD_ENGINE_STRUCTURED_H
#define PD_ENGINE_STRUCTURED_H

#include "common/status.h"
#include "engine/model_runner.h"
#include "scheduler/request.h"

/* Masks rows[n_rows][vocab] of req (req->grammar set): row 0 from the matcher after the request's
 * tokens (caught up here: a handed-over first token, a replay after the automaton was emptied),
 * row j after drafts [0, j) (at req->tokens[num_tokens..]). A row the grammar leaves nothing in
 * keeps EOS only. PD_ERR_NO_MEMORY when the vocabulary or a mask cannot be made. */
pd_status_t pd_structured_mask_rows(pd_model_runner_t *r, pd_request_t *req, float *rows, int32_t n_rows);

/* The runner's vocabulary for grammars, made at the first call; NULL when out of memory (logged). */
struct pd_gvocab *pd_structured_vocab(pd_model_runner_t *r);

/* A prefill's handover: req's matcher caught up on its output (the first token) and exported
 * (pd_gmatcher_export) into req->grammar_state; left NULL when the state cannot be written (its
 * decode then replays the token). */
void pd_structured_hand_over(pd_model_runner_t *r, pd_request_t *req);

#endif
