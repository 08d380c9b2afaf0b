/* engine/logits_process.c — vLLM's logits processors (see logits_process.h). */
#include "engine/logits_process.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

pd_status_t pd_logits_scratch_init(pd_logits_scratch_t *s, int32_t vocab)
{
    s->vocab = vocab;
    s->count = calloc((size_t)vocab, sizeof(uint32_t));
    s->seen = calloc((size_t)vocab, 1);
    if (s->count == NULL || s->seen == NULL) {
        pd_logits_scratch_destroy(s);
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

void pd_logits_scratch_destroy(pd_logits_scratch_t *s)
{
    free(s->count);
    free(s->seen);
    s->count = NULL;
    s->seen = NULL;
}

bool pd_logits_needs_processing(const pd_request_params_t *p)
{
    return p->presence_penalty != 0 || p->frequency_penalty != 0 ||
           (p->repetition_penalty != 0 && p->repetition_penalty != 1) || p->min_tokens > 0 ||
           p->num_logit_bias > 0 || p->num_bad_words > 0;
}

/* bad_words: a word's last token is banned when the output so far ends with the word's other tokens. */
static void apply_bad_words(float *row, int32_t vocab, const pd_request_t *req)
{
    const pd_request_params_t *p = &req->params;
    const int32_t *out = req->tokens + req->num_prompt_tokens;
    int32_t n_out = pd_request_num_output(req);
    for (int32_t w = 0, b = 0; w < p->num_bad_words; b = p->bad_word_end[w], w++) {
        int32_t len = p->bad_word_end[w] - b;
        int32_t prefix = len - 1;
        if (len < 1 || prefix > n_out) {
            continue;
        }
        if (prefix > 0 &&
            memcmp(out + n_out - prefix, p->bad_word_ids + b, (size_t)prefix * sizeof(int32_t)) != 0) {
            continue;
        }
        int32_t last = p->bad_word_ids[b + prefix];
        if (last >= 0 && last < vocab) {
            row[last] = -INFINITY;
        }
    }
}

static void apply_penalties(float *row, int32_t vocab, const pd_request_t *req, pd_logits_scratch_t *s)
{
    const pd_request_params_t *p = &req->params;
    float rep = p->repetition_penalty;
    bool use_rep = rep != 0 && rep != 1;
    int32_t n_prompt = req->num_prompt_tokens, n = req->num_tokens;
    for (int32_t i = n_prompt; i < n; i++) { /* output counts */
        int32_t t = req->tokens[i];
        if (t >= 0 && t < vocab) {
            s->count[t]++;
        }
    }
    if (use_rep) { /* every distinct token of prompt and output, once */
        for (int32_t i = 0; i < n; i++) {
            int32_t t = req->tokens[i];
            if (t >= 0 && t < vocab && !s->seen[t]) {
                s->seen[t] = 1;
                row[t] = row[t] > 0 ? row[t] / rep : row[t] * rep;
            }
        }
    }
    for (int32_t i = n_prompt; i < n; i++) { /* frequency, presence: once per distinct output token */
        int32_t t = req->tokens[i];
        if (t < 0 || t >= vocab || s->count[t] == 0) {
            continue;
        }
        row[t] -= p->frequency_penalty * (float)s->count[t] + p->presence_penalty;
        s->count[t] = 0;
    }
    for (int32_t i = 0; use_rep && i < n; i++) { /* leave the scratch zeroed */
        int32_t t = req->tokens[i];
        if (t >= 0 && t < vocab) {
            s->seen[t] = 0;
        }
    }
}

void pd_logits_process(float *row, int32_t vocab, const pd_request_t *req, const int32_t *eos, int32_t n_eos,
                       pd_logits_scratch_t *scratch)
{
    const pd_request_params_t *p = &req->params;
    if (p->num_bad_words > 0) {
        apply_bad_words(row, vocab, req);
    }
    for (int32_t i = 0; i < p->num_logit_bias; i++) {
        int32_t t = p->logit_bias_ids[i];
        if (t >= 0 && t < vocab) {
            row[t] += p->logit_bias[i];
        }
    }
    if (pd_request_num_output(req) < p->min_tokens) {
        for (int32_t i = 0; i < n_eos; i++) {
            if (eos[i] >= 0 && eos[i] < vocab) {
                row[eos[i]] = -INFINITY;
            }
        }
        for (int32_t i = 0; i < p->num_stop_token_ids; i++) {
            int32_t t = p->stop_token_ids[i];
            if (t >= 0 && t < vocab) {
                row[t] = -INFINITY;
            }
        }
    }
    if (p->presence_penalty != 0 || p->frequency_penalty != 0 ||
        (p->repetition_penalty != 0 && p->repetition_penalty != 1)) {
        apply_penalties(row, vocab, req, scratch);
    }
}
