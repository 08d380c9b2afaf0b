/* engine/structured.c — see structured.h. Engine thread only (the grammar runtime's owner). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/structured.h"
#include "grammar/grammar.h"
#include "model/tokenizer.h"

/* The vocabulary's bytes for the mask walk: special tokens and ids the tokenizer lacks never match. */
static pd_status_t make_vocab(pd_model_runner_t *r)
{
    int32_t n = r->vocab;
    const uint8_t **bytes = calloc((size_t)n, sizeof(*bytes));
    uint32_t *lens = calloc((size_t)n, sizeof(*lens));
    bool *excl = calloc((size_t)n, sizeof(*excl));
    r->gmask = malloc((size_t)(n + 31) / 32 * sizeof(uint32_t));
    pd_status_t st = PD_ERR_NO_MEMORY;
    if (bytes != NULL && lens != NULL && excl != NULL && r->gmask != NULL) {
        int32_t nt = pd_tokenizer_vocab_size(r->tok);
        for (int32_t i = 0; i < n; i++) {
            size_t len = 0;
            bytes[i] = i < nt ? pd_tokenizer_token_bytes(r->tok, i, &len) : NULL;
            lens[i] = (uint32_t)len;
            excl[i] = bytes[i] == NULL || pd_tokenizer_is_special(r->tok, i);
        }
        st = pd_gvocab_create(n, bytes, lens, excl, &r->gvocab);
    }
    free(bytes);
    free(lens);
    free(excl);
    if (st != PD_OK) {
        pd_log_error("engine: no memory for the structured-output vocabulary (%d tokens)", n);
    }
    return st;
}

struct pd_gvocab *pd_structured_vocab(pd_model_runner_t *r)
{
    if (r->gvocab == NULL) {
        make_vocab(r);
    }
    return r->gvocab;
}

static bool is_end_id(const pd_model_runner_t *r, const pd_request_t *req, int32_t t)
{
    for (int32_t i = 0; i < r->num_eos; i++) {
        if (r->eos[i] == t) {
            return true;
        }
    }
    for (int32_t i = 0; i < req->params.num_stop_token_ids; i++) {
        if (req->params.stop_token_ids[i] == t) {
            return true;
        }
    }
    return false;
}

static bool accept_token(const pd_model_runner_t *r, pd_gmatcher_t *m, int32_t t)
{
    size_t len = 0;
    const uint8_t *b =
        t >= 0 && t < pd_tokenizer_vocab_size(r->tok) ? pd_tokenizer_token_bytes(r->tok, t, &len) : NULL;
    return b != NULL && len > 0 && pd_gmatcher_accept(m, b, len);
}

/* A decode's push handover: the matcher goes on from the grammar state the prefill sent with the first
 * token (WRITE_DONE, on the authenticated control channel); one that does not fit (another build's
 * grammar) is logged and the token replayed instead. */
static void resume(pd_model_runner_t *r, pd_request_t *req)
{
    pd_gmatcher_t m;
    char why[160];
    pd_status_t st = pd_gmatcher_import(&m, req->grammar->g, req->grammar_state, why, sizeof(why));
    if (st == PD_OK && m.consumed == 1) {
        pd_gmatcher_destroy(req->grammar);
        *req->grammar = m;
        r->grammar_resumed++;
    } else {
        if (st == PD_OK) {
            snprintf(why, sizeof(why), "it follows %d tokens, not the first one", m.consumed);
            pd_gmatcher_destroy(&m);
        }
        pd_log_warn("request %s: the grammar state its prefill handed over does not fit (%s); the first "
                    "token is replayed instead",
                    req->id, why);
    }
    free(req->grammar_state);
    req->grammar_state = NULL;
}

/* Brings req's matcher to its last token; false when a token left the grammar (logged). */
static bool catch_up(pd_model_runner_t *r, pd_request_t *req)
{
    pd_gmatcher_t *m = req->grammar;
    if (pd_gmatcher_stale(m)) { /* the automaton was emptied: replay the output from the start */
        pd_grammar_t *g = pd_grammar_ref(m->g);
        pd_gmatcher_destroy(m);
        pd_status_t st = pd_gmatcher_init(m, g);
        pd_grammar_unref(g);
        if (st != PD_OK) {
            return false;
        }
    }
    int32_t out = pd_request_num_output(req);
    if (req->grammar_state != NULL && m->consumed == 0 && out >= 1) { /* a push prefill's handover */
        resume(r, req);
    }
    for (; m->consumed < out; m->consumed++) {
        int32_t t = req->tokens[req->num_prompt_tokens + m->consumed];
        if (is_end_id(r, req, t)) {
            continue; /* the end: nothing follows it */
        }
        if (!accept_token(r, m, t)) {
            pd_log_error("request %s: output token %d (at %d) is outside its grammar (a prefill that did not "
                         "follow it?); the request is ended",
                         req->id, t, m->consumed);
            m->consumed = out;
            m->state = 0;
            return false;
        }
    }
    return true;
}

void pd_structured_hand_over(pd_model_runner_t *r, pd_request_t *req)
{
    free(req->grammar_state);
    req->grammar_state = catch_up(r, req) ? pd_gmatcher_export(req->grammar) : NULL;
    if (req->grammar_state == NULL) {
        pd_log_warn("request %s: its grammar state could not be written for the decode node, which "
                    "replays the first token instead",
                    req->id);
    }
}

static void apply(pd_model_runner_t *r, const uint32_t *mask, float *row)
{
    bool any = false;
    int32_t V = r->vocab;
    for (int32_t w = 0; w * 32 < V; w++) { /* a word at a time: masks are mostly runs of 0s or 1s */
        uint32_t m = mask[w];
        int32_t t0 = w * 32, n = V - t0 < 32 ? V - t0 : 32;
        if (m == 0) {
            for (int32_t j = 0; j < n; j++) {
                row[t0 + j] = -INFINITY;
            }
            continue;
        }
        for (int32_t j = 0; j < n; j++) {
            if (!((m >> j) & 1)) {
                row[t0 + j] = -INFINITY;
            } else {
                any |= row[t0 + j] > -INFINITY;
            }
        }
    }
    if (!any && r->num_eos > 0) { /* nothing allowed (min_tokens masked the end): the end */
        row[r->eos[0]] = 0.0f;
    }
}

pd_status_t pd_structured_mask_rows(pd_model_runner_t *r, pd_request_t *req, float *rows, int32_t n_rows)
{
    if (r->gvocab == NULL) {
        PD_TRY(make_vocab(r));
    }
    int32_t ends[8 + PD_MAX_STOP_TOKEN_IDS], n_end = 0;
    for (int32_t i = 0; i < r->num_eos; i++) {
        ends[n_end++] = r->eos[i];
    }
    for (int32_t i = 0; i < req->params.num_stop_token_ids; i++) {
        ends[n_end++] = req->params.stop_token_ids[i];
    }
    size_t V = (size_t)r->vocab;
    if (!catch_up(r, req)) {
        memset(r->gmask, 0, (V + 31) / 32 * sizeof(uint32_t)); /* only the end */
        for (int32_t j = 0; j < n_rows; j++) {
            apply(r, r->gmask, rows + (size_t)j * V);
        }
        return PD_OK;
    }
    pd_gmatcher_t m = *req->grammar; /* a copy walks the drafts */
    for (int32_t j = 0, retried = 0; j < n_rows; j++) {
        if (j > 0) {
            int32_t d = req->tokens[req->num_tokens + j - 1];
            if (is_end_id(r, req, d) || !accept_token(r, &m, d)) {
                if (!pd_gmatcher_stale(&m)) {
                    break; /* the verifier stops at that draft: the rows after it are not read */
                }
            }
        }
        pd_status_t st = pd_gmatcher_stale(&m) ? PD_ERR_STALE
                                               : pd_gmatcher_fill_mask(&m, r->gvocab, ends, n_end, r->gmask);
        if (st == PD_ERR_STALE && !retried++) { /* the automaton was emptied: replay, walk again */
            if (!catch_up(r, req)) {
                return PD_ERR_NO_MEMORY;
            }
            m = *req->grammar;
            j = -1;
            continue;
        }
        if (st != PD_OK) {
            pd_log_error("request %s: its grammar's mask could not be made: %s", req->id, pd_status_str(st));
            return st;
        }
        apply(r, r->gmask, rows + (size_t)j * V);
    }
    return PD_OK;
}
