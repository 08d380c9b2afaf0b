/* engine/spec_draft.h — the draft-model proposer (--speculative-config method draft_model): a
 * second, smaller model with the target's vocabulary proposes k tokens greedily, one forward per
 * token, batched over the requests (vLLM's draft-model proposer drafts greedily too, so the
 * verifier treats its drafts as one-hot proposals, as it does the n-gram ones).
 *
 * Its KV cache has the target's block count and block size and is indexed by the target's block
 * ids (vLLM v1 puts draft layers in the same KV cache groups): a request's blocks hold both models'
 * pages, so allocation, rollback, preemption and freeing need nothing more; the memory plan counts
 * the draft's pages per block (pd_kv_init_params_t.companion_block_bytes). req->num_draft_computed
 * says how far the draft's KV goes; the draft computes what it lacks (a prompt, the accepted
 * tokens) before proposing — including on a decode node, whose prompt KV came for the target only:
 * the draft's prompt KV is computed locally, a small model's prefill, instead of a second transfer. */
#ifndef PD_ENGINE_SPEC_DRAFT_H
#define PD_ENGINE_SPEC_DRAFT_H

#include <stdint.h>

#include "engine/kv_init.h"
#include "model/model.h"
#include "scheduler/request.h"

typedef struct pd_spec_draft {
    pd_model_t *model;
    pd_kv_cache_t *kv;
    int32_t vocab, block_size, max_tokens, max_reqs, max_blocks;
    int32_t *tok, *pos, *slot; /* [max_tokens] */
    int32_t *cu, *seq_lens;    /* [max_reqs + 1], [max_reqs] */
    int32_t *tables;           /* [max_reqs][max_blocks] */
    int32_t *lidx;             /* [max_reqs] rows that propose */
    float *logits;             /* [max_reqs][vocab] */
    int32_t *done;             /* [max_reqs] catch-up progress */
    pd_request_t **piece_req;  /* [max_reqs] the pieces of one forward: tokens [start, start + len) */
    int32_t *piece_start, *piece_len;
} pd_spec_draft_t;

/* Scratch for batches of at most max_tokens tokens over max_reqs requests whose block lists are at
 * most max_blocks long; model and kv are the draft's (owned by the caller). */
pd_status_t pd_spec_draft_init(pd_spec_draft_t *d, pd_model_t *model, pd_kv_cache_t *kv, int32_t max_reqs,
                               int32_t max_tokens, int32_t max_blocks);
void pd_spec_draft_destroy(pd_spec_draft_t *d);

/* Proposes want[i] draft tokens for reqs[i] (running, want[i] >= 1, blocks held for positions up to
 * num_tokens + want[i] − 2): brings the draft's KV up to the request's last token, then drafts one
 * token per forward. Writes them to tokens[num_tokens, ...), sets num_spec_tokens and
 * num_draft_computed. On an error nothing is proposed (num_spec_tokens 0) and the status returned. */
pd_status_t pd_spec_draft_propose(pd_spec_draft_t *d, pd_request_t **reqs, const int32_t *want, int32_t n);

#endif
