/* engine/engine.c — engine core: admission, the step, detokenization, stop strings, outputs. The
 * engine is built in engine_create.c and run on its own thread by engine_thread.c. */
#define _GNU_SOURCE
#include "engine/engine_impl.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/grammar_jobs.h"
#include "engine/model_runner.h"
#include "engine/structured.h"
#include "model/generation_config.h"
#include "scheduler/scheduler.h"

void eng_ctx_free(req_ctx_t *c)
{
    if (c == NULL) {
        return;
    }
    for (int32_t i = 0; i < c->num_stop; i++) {
        free(c->stop[i]);
    }
    free(c->text);
    free(c->plp);
    free(c->plp_done);
    if (c->gm.g != NULL) {
        pd_gmatcher_destroy(&c->gm);
    }
    free(c);
}

bool eng_admit_ready(void *arg, pd_request_t *r)
{
    pd_engine_t *e = arg;
    if (r->grammar == NULL) {
        return true;
    }
    struct pd_gvocab *v = pd_structured_vocab(&e->runner);
    if (v == NULL ||
        (e->gjobs == NULL && pd_grammar_jobs_create(v, PD_GRAMMAR_AHEAD_BUDGET_S, e->cfg.grammar_walk_delay,
                                                    eng_wake, e, &e->gjobs) != PD_OK)) {
        return true; /* out of memory: walked as it goes (or failed at its mask, logged there) */
    }
    if (pd_grammar_jobs_ready(e->gjobs, r->grammar->g)) {
        return true;
    }
    if (pd_request_num_output(r) > 0) {
        /* its client is in the middle of the stream (a migrated or resumed stream, a first token
         * from the prefill): waiting for the walk (0.1-1 s) would be a gap in it, so it walks as it
         * goes while the job runs (the walk stays queued, for later requests of the grammar) */
        return true;
    }
    req_ctx_t *c = r->user;
    if (pd_time_now_s() - r->arrival_time > PD_GRAMMAR_WAIT_MAX_S) {
        if (c != NULL && !c->grammar_waited_out) {
            c->grammar_waited_out = true;
            pd_log_warn("request %s: its grammar is not ready after %.1f s; it goes on, walking as it goes",
                        r->id, PD_GRAMMAR_WAIT_MAX_S);
        }
        return true;
    }
    return false;
}

void eng_on_release(void *arg, pd_request_t *r)
{
    (void)arg;
    eng_ctx_free(r->user);
    r->user = NULL;
}

void eng_cmd_free(cmd_t *c)
{
    if (c == NULL) {
        return;
    }
    free(c->prompt);
    for (int i = 0; i < PD_MAX_STOP_STRINGS; i++) {
        free(c->stop_buf[i]);
    }
    json_decref(c->req.kv_transfer_params);
    pd_grammar_unref(c->req.grammar);
    free(c);
}

/* ------------------------------------------------------------------ admission */

static void continue_from(pd_engine_t *e, pd_request_t *r, const int32_t *toks, int32_t n, bool replayed);
static pd_status_t resume_grammar(pd_engine_t *e, pd_request_t *r, req_ctx_t *ctx, int32_t first, char *err,
                                  size_t err_len);

/* Whether ids[n] (NULL when n is 0) are all in [0, vocab); else err names the first that is not. */
static bool ids_in_vocab(const int32_t *ids, int32_t n, int32_t vocab, const char *what, char *err,
                         size_t err_len)
{
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= vocab) {
            snprintf(err, err_len, "%stoken id %d at position %d is outside the vocabulary [0, %d)", what,
                     ids[i], i, vocab);
            return false;
        }
    }
    return true;
}

pd_status_t pd_engine_add(pd_engine_t *e, const pd_engine_request_t *rq, char *err, size_t err_len)
{
    const pd_model_config_t *mc = pd_model_config(e->model);
    pd_request_params_t p = rq->params;
    if (rq->num_prompt < 1) {
        snprintf(err, err_len, "the prompt is empty");
        return PD_ERR_INVALID_ARG;
    }
    if (rq->num_prompt >= e->max_model_len) {
        snprintf(err, err_len,
                 "This model's maximum context length is %d tokens. However, you requested %d tokens in the "
                 "prompt",
                 e->max_model_len, rq->num_prompt);
        return PD_ERR_INVALID_ARG;
    }
    if (!ids_in_vocab(rq->prompt, rq->num_prompt, mc->vocab_size, "", err, err_len) ||
        !ids_in_vocab(rq->resume, rq->resume != NULL ? rq->num_resume : 0, mc->vocab_size,
                      "resume_token_ids: ", err, err_len)) {
        return PD_ERR_INVALID_ARG;
    }
    if (p.max_tokens <= 0) {
        p.max_tokens = e->max_model_len - rq->num_prompt;
    }
    /* resumed with KV: a live migration's lease on the node that ran it, for all but the last token,
     * or a prompt prefix a prefill lent after the first decode died */
    bool leased = rq->kv_transfer_params != NULL &&
                  pd_kv_params_resumes(rq->kv_transfer_params, rq->num_prompt + rq->num_resume - 1);
    if (rq->num_resume > 0 &&
        (rq->resume == NULL || (rq->kv_transfer_params != NULL && !leased) ||
         rq->num_resume >= p.max_tokens || rq->num_prompt + rq->num_resume >= e->max_model_len)) {
        if (rq->kv_transfer_params != NULL && !leased) {
            snprintf(err, err_len,
                     "resume_token_ids goes with kv_transfer_params only as a live migration's lease (pull "
                     "parameters for the prompt and every resumed token but the last: remote_num_tokens %d) "
                     "or as a prompt prefix to fetch ({\"kv_prefix\": ...} alone)",
                     rq->num_prompt + rq->num_resume - 1);
        } else {
            snprintf(err, err_len,
                     "resume_token_ids: %d tokens leave nothing to generate (max_tokens %d, context %d)",
                     rq->num_resume, p.max_tokens, e->max_model_len);
        }
        return PD_ERR_INVALID_ARG;
    }
    if (p.sampling.temperature < 0 || !(p.sampling.top_p > 0 && p.sampling.top_p <= 1) ||
        p.sampling.top_k < -1 || p.logprobs < 0 || p.logprobs > PD_MAX_LOGPROBS) {
        snprintf(err, err_len,
                 "invalid sampling parameters (temperature >= 0, 0 < top_p <= 1, top_k >= -1, "
                 "0 <= logprobs <= 20)");
        return PD_ERR_INVALID_ARG;
    }
    if (rq->grammar != NULL && p.ignore_eos) {
        snprintf(err, err_len,
                 "ignore_eos cannot be combined with a structured output (the grammar ends "
                 "the reply with EOS)");
        return PD_ERR_INVALID_ARG;
    }
    const char *role_err = pd_engine_params_error(e, rq->kv_transfer_params);
    if (role_err != NULL) {
        snprintf(err, err_len, "%s", role_err);
        return PD_ERR_INVALID_ARG;
    }
    req_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    ctx->user = rq->user;
    ctx->stop_hit = -1;
    for (int32_t i = 0; i < rq->num_stop && i < PD_MAX_STOP_STRINGS; i++) {
        if (rq->stop[i] == NULL || rq->stop[i][0] == '\0') {
            continue;
        }
        ctx->stop[ctx->num_stop] = strdup(rq->stop[i]);
        size_t l = strlen(rq->stop[i]);
        ctx->max_stop_len = l > ctx->max_stop_len ? l : ctx->max_stop_len;
        ctx->num_stop++;
    }
    pd_request_t *r = NULL;
    pd_status_t st = pd_request_create(rq->id, rq->prompt, rq->num_prompt, &p, e->max_model_len, &r);
    if (st != PD_OK) {
        snprintf(err, err_len, "invalid request");
        eng_ctx_free(ctx);
        return st;
    }
    r->user = ctx;
    if (rq->grammar != NULL) {
        if (pd_gmatcher_init(&ctx->gm, rq->grammar) != PD_OK) {
            snprintf(err, err_len, "out of memory for the request's grammar");
            r->user = NULL;
            eng_ctx_free(ctx);
            pd_request_free(r);
            return PD_ERR_NO_MEMORY;
        }
        r->grammar = &ctx->gm;
    }
    int32_t first = -1;
    if (rq->kv_transfer_params != NULL) {
        r->kv_transfer_params = json_incref(rq->kv_transfer_params);
        if (e->cfg.connector != NULL) {
            r->handover_after_first = pd_kv_params_hands_over(r->kv_transfer_params);
            first = pd_kv_params_first_token(r->kv_transfer_params);
        }
    }
    if (first >= mc->vocab_size) {
        snprintf(err, err_len, "kv_transfer_params.first_token_id %d is outside the vocabulary [0, %d)",
                 first, mc->vocab_size);
        eng_ctx_free(ctx);
        r->user = NULL;
        pd_request_free(r);
        return PD_ERR_INVALID_ARG;
    }
    if ((st = resume_grammar(e, r, ctx, first, err, err_len)) != PD_OK) {
        eng_ctx_free(ctx);
        r->user = NULL;
        pd_request_free(r);
        return st;
    }
    st = pd_scheduler_add_request(e->sched, r);
    if (st != PD_OK) {
        snprintf(err, err_len, "request id '%s' is already in use", rq->id);
        eng_ctx_free(ctx);
        r->user = NULL;
        pd_request_free(r);
        return st;
    }
    e->prompt_tokens += (uint64_t)rq->num_prompt;
    if (first >= 0) {
        continue_from(e, r, &first, 1, false);
    } else if (rq->num_resume > 0) {
        continue_from(e, r, rq->resume, rq->num_resume, true);
    }
    return PD_OK;
}

/* First-token handover, decode side: a structured output resumes the grammar's state after the first
 * token that its prefill handed over (kv_transfer_params.grammar_state, signed with the rest); without
 * one the matcher replays the token (engine/structured.c). */
static pd_status_t resume_grammar(pd_engine_t *e, pd_request_t *r, req_ctx_t *ctx, int32_t first, char *err,
                                  size_t err_len)
{
    const json_t *gs = json_object_get(r->kv_transfer_params, "grammar_state");
    if (gs == NULL) {
        return PD_OK;
    }
    if (!json_is_string(gs) || r->grammar == NULL || first < 0) {
        snprintf(err, err_len, "kv_transfer_params.grammar_state %s",
                 !json_is_string(gs)  ? "must be a string (as a prefill writes it)"
                 : r->grammar == NULL ? "is given, but the request asks for no structured output"
                                      : "comes only with a first_token_id (a pull prefill's handover)");
        return PD_ERR_INVALID_ARG;
    }
    pd_gmatcher_t m;
    char why[160];
    pd_status_t st = pd_gmatcher_import(&m, ctx->gm.g, json_string_value(gs), why, sizeof(why));
    if (st == PD_OK && m.consumed != 1) {
        snprintf(why, sizeof(why), "the state follows %d tokens, not the first one", m.consumed);
        pd_gmatcher_destroy(&m);
        st = PD_ERR_INVALID_ARG;
    }
    if (st != PD_OK) {
        snprintf(err, err_len, "kv_transfer_params.grammar_state: %s", why);
        return st == PD_ERR_NO_MEMORY ? st : PD_ERR_INVALID_ARG;
    }
    pd_gmatcher_destroy(&ctx->gm);
    ctx->gm = m; /* r->grammar points at it */
    e->runner.grammar_resumed++;
    return PD_OK;
}

static pd_engine_output_t *output_new(const pd_request_t *r);
static void emit_text(req_ctx_t *c, pd_engine_output_t *o, bool finished);
static void output_finish_fields(pd_engine_output_t *o, const pd_request_t *r);
static bool emit_token(pd_engine_t *e, pd_request_t *r, int32_t pos, bool last, int64_t lp_at, char *buf,
                       pd_engine_output_t ***tail);

/* r goes on from n tokens sampled on another node: a decode's first-token handover (pull: the token
 * its prefill sampled) or a resumed stream (resume_token_ids, replayed). They are appended as if
 * sampled here and their outputs made now (text, stop strings; no logprobs: the other node's outputs
 * carried them), ahead of any later token's. A handed-over token's output is sent (the decode's
 * stream repeats it, the proxy drops the repeat); replayed ones are marked so, as the client has them,
 * unless one finishes r. The tokens count as generated where they were sampled. */
static void continue_from(pd_engine_t *e, pd_request_t *r, const int32_t *toks, int32_t n, bool replayed)
{
    char *buf = malloc(e->max_token_bytes + 64);
    int32_t added = buf != NULL ? pd_scheduler_add_output_tokens(e->sched, r, toks, n) : -1;
    pd_engine_output_t **tail = e->aborted_tail;
    for (int32_t j = 0; j < added; j++) {
        bool goes_on = emit_token(e, r, r->num_prompt_tokens + j, j == added - 1, -1, buf, &e->aborted_tail);
        if (tail != e->aborted_tail) { /* its output was made */
            (*tail)->replayed = replayed && goes_on && !pd_request_is_finished(r);
            tail = e->aborted_tail;
        }
        if (!goes_on) {
            break;
        }
    }
    if (!replayed && added > 0) {
        e->generation_tokens += (uint64_t)added;
    }
    free(buf);
}

/* First-token handover, prefill side: r got its first token and goes on, on a decode node. It ends
 * here (its connector holds or writes the KV); the held-back text stays unsent, as the decode node
 * holds it back too. The closing output says so and carries the kv_transfer_params. */
static void hand_over(pd_engine_t *e, pd_request_t *r, pd_engine_output_t ***tail)
{
    r->handed_over = true;
    if (r->grammar != NULL) { /* the decode goes on from the grammar's state after the first token */
        pd_structured_hand_over(&e->runner, r);
        e->grammar_handed += r->grammar_state != NULL;
    }
    pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_LENGTH);
    if (!json_is_object((json_t *)r->kv_transfer_params)) { /* the proxy fails such a handover */
        pd_log_warn("engine: request %s hands over without kv_transfer_params (its connector ended it as "
                    "the last token)",
                    r->id);
    }
    pd_input_batch_remove(&e->runner.batch, r);
    pd_engine_output_t *o = output_new(r);
    if (o == NULL) {
        return;
    }
    o->text = calloc(1, 1);
    o->handed_over = true;
    output_finish_fields(o, r);
    eng_push_output(tail, o);
}

/* Ends request id as aborted; migrate: its connector leases its KV to the node that takes it over
 * first (connector/kv_scheduler.c), and the final output carries the parameters. */
static bool abort_request(pd_engine_t *e, const char *id, bool migrate)
{
    pd_request_t *r = pd_scheduler_find(e->sched, id);
    if (r == NULL || pd_request_is_finished(r)) {
        return false;
    }
    r->migrating = migrate;
    pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_ABORTED);
    pd_input_batch_remove(&e->runner.batch, r);
    e->finished++;
    pd_engine_output_t *o = output_new(r); /* r stays valid until the next schedule */
    if (o != NULL) {
        emit_text(r->user, o, true);
        output_finish_fields(o, r);
        *e->aborted_tail = o;
        e->aborted_tail = &o->next;
    }
    return true;
}

bool pd_engine_abort(pd_engine_t *e, const char *id)
{
    return abort_request(e, id, false);
}

bool pd_engine_migrate(pd_engine_t *e, const char *id)
{
    return abort_request(e, id, true);
}

bool pd_engine_has_work(const pd_engine_t *e)
{
    return !pd_scheduler_idle(e->sched);
}

/* ------------------------------------------------------------------ outputs */

void pd_engine_output_free(pd_engine_output_t *o)
{
    while (o != NULL) {
        pd_engine_output_t *n = o->next;
        free(o->text);
        free(o->kv_transfer_params);
        free(o->stop_str);
        free(o->prompt_logprobs);
        free(o->rest);
        free(o);
        o = n;
    }
}

static bool text_append(req_ctx_t *c, const char *s, size_t n)
{
    if (c->text_len + n + 1 > c->text_cap) {
        size_t cap = c->text_cap ? c->text_cap * 2 : 256;
        while (cap < c->text_len + n + 1) {
            cap *= 2;
        }
        char *t = realloc(c->text, cap);
        if (t == NULL) {
            return false;
        }
        c->text = t;
        c->text_cap = cap;
    }
    memcpy(c->text + c->text_len, s, n);
    c->text_len += n;
    c->text[c->text_len] = '\0';
    return true;
}

/* Finds the earliest stop string that ends in the new text; returns its start or -1 (and which
 * string in *which). */
static long find_stop(const req_ctx_t *c, size_t new_from, int32_t *which)
{
    long best = -1;
    for (int32_t i = 0; i < c->num_stop; i++) {
        size_t l = strlen(c->stop[i]);
        size_t from = new_from >= l ? new_from - l + 1 : 0;
        const char *hit = memmem(c->text + from, c->text_len - from, c->stop[i], l);
        if (hit != NULL && (best < 0 || hit - c->text < best)) {
            best = hit - c->text;
            *which = i;
        }
    }
    return best;
}

/* Stores this step's prompt-token scores into their requests (positions already scored, by a run
 * before a preemption, are kept). */
static void gather_prompt_logprobs(pd_engine_t *e, const pd_scheduler_output_t *so)
{
    const pd_input_batch_t *b = &e->runner.batch;
    for (int32_t k = 0; k < b->num_plp; k++) {
        pd_request_t *r = so->items[b->plp_item[k]].req;
        req_ctx_t *c = r->user;
        int32_t n = r->num_prompt_tokens - 1, at = b->plp_pos[k];
        if (c == NULL || n < 1 || at < 0 || at >= n) {
            continue;
        }
        if (c->plp == NULL) {
            c->plp = calloc((size_t)n, sizeof(pd_prompt_logprob_t));
            c->plp_done = calloc((size_t)n, sizeof(bool));
            if (c->plp == NULL || c->plp_done == NULL) {
                free(c->plp), free(c->plp_done);
                c->plp = NULL, c->plp_done = NULL;
                continue;
            }
        }
        if (c->plp_done[at]) {
            continue;
        }
        pd_prompt_logprob_t *p = &c->plp[at];
        p->logprob = e->runner.plp_logprob[k];
        p->rank = e->runner.plp_rank[k];
        p->num_top =
            r->params.prompt_logprobs < PD_MAX_LOGPROBS ? r->params.prompt_logprobs : PD_MAX_LOGPROBS;
        memcpy(p->top_ids, e->runner.plp_top_ids + (size_t)k * PD_MAX_LOGPROBS,
               (size_t)p->num_top * sizeof(int32_t));
        memcpy(p->top_logprobs, e->runner.plp_top_lp + (size_t)k * PD_MAX_LOGPROBS,
               (size_t)p->num_top * sizeof(float));
        c->plp_done[at] = true;
    }
}

/* Moves a request's gathered prompt scores onto its first output. */
static void attach_prompt_logprobs(const pd_request_t *r, pd_engine_output_t *o)
{
    req_ctx_t *c = r->user;
    if (c == NULL || c->plp_sent || !r->params.want_prompt_logprobs) {
        return;
    }
    c->plp_sent = true;
    int32_t n = r->num_prompt_tokens - 1;
    if (n < 1) {
        return;
    }
    o->prompt_logprobs = c->plp;
    o->num_prompt_logprobs = c->plp != NULL ? n : 0;
    c->plp = NULL;
}

static pd_engine_output_t *output_new(const pd_request_t *r)
{
    pd_engine_output_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return NULL;
    }
    snprintf(o->id, sizeof(o->id), "%s", r->id);
    req_ctx_t *c = r->user;
    o->user = c != NULL ? c->user : NULL;
    o->token = -1;
    o->stop_token = -1;
    return o;
}

/* The text to emit now: all of it when finished, else all but a tail that could still become a
 * stop string (cut back to a UTF-8 character boundary). */
static void emit_text(req_ctx_t *c, pd_engine_output_t *o, bool finished)
{
    size_t upto = c->text_len;
    if (!finished && c->max_stop_len > 1) {
        size_t hold = c->max_stop_len - 1;
        upto = c->text_len > hold ? c->text_len - hold : 0;
        while (upto > c->emitted && ((unsigned char)c->text[upto] & 0xc0) == 0x80) {
            upto--;
        }
    }
    if (upto < c->emitted) {
        upto = c->emitted;
    }
    o->text_len = upto - c->emitted;
    o->text = malloc(o->text_len + 1);
    if (o->text != NULL) {
        if (o->text_len > 0) { /* c->text is NULL until the first text arrives */
            memcpy(o->text, c->text + c->emitted, o->text_len);
        }
        o->text[o->text_len] = '\0';
    } else {
        o->text_len = 0;
    }
    c->emitted = upto;
}

static void output_finish_fields(pd_engine_output_t *o, const pd_request_t *r)
{
    o->finish_reason = pd_request_finish_reason(r);
    o->prompt_tokens = r->num_prompt_tokens;
    o->completion_tokens = pd_request_num_output(r);
    o->cached_tokens = r->num_cached_tokens > 0 ? r->num_cached_tokens : 0;
    double first_sched = r->first_scheduled_time > 0 ? r->first_scheduled_time : r->finish_time;
    o->queue_time = first_sched - r->arrival_time;
    o->ttft = r->first_token_time > 0 ? r->first_token_time - r->arrival_time : 0;
    o->e2e = r->finish_time - r->arrival_time;
    if (r->kv_transfer_params != NULL) {
        o->kv_transfer_params = json_dumps(r->kv_transfer_params, JSON_COMPACT);
    }
    const req_ctx_t *c = r->user;
    if (c != NULL && c->stop_hit >= 0) {
        o->stop_str = strdup(c->stop[c->stop_hit]);
    } else if (r->state == PD_REQ_FINISHED_STOPPED) {
        o->stop_token = r->stop_token;
    }
}

void eng_push_output(pd_engine_output_t ***tail, pd_engine_output_t *o)
{
    **tail = o;
    *tail = &o->next;
}

/* The output of r's token at tokens[pos] (last: the step's last token for r): detokenized, stop
 * strings checked, logprobs from the runner's slot lp_at (-1: none). A stop string that ends in
 * this token finishes r and drops the tokens after it (accepted drafts past the stop). Returns
 * whether r goes on. */
static bool emit_token(pd_engine_t *e, pd_request_t *r, int32_t pos, bool last, int64_t lp_at, char *buf,
                       pd_engine_output_t ***tail)
{
    req_ctx_t *c = r->user;
    int32_t tok = r->tokens[pos];
    pd_engine_output_t *o = output_new(r);
    if (o == NULL) {
        return false;
    }
    o->token = tok;
    attach_prompt_logprobs(r, o);
    size_t n = 0;
    size_t before = c->text_len;
    if (pd_detok_step(e->tok, &c->detok, tok, !r->params.keep_special_tokens, buf, e->max_token_bytes + 64,
                      &n) == PD_OK) {
        text_append(c, buf, n);
    }
    bool finished = last && pd_request_is_finished(r);
    int32_t num_output = pos + 1 - r->num_prompt_tokens;
    if (c->num_stop > 0 && num_output > r->params.min_tokens) {
        int32_t which = -1;
        long at = find_stop(c, before, &which);
        if (at >= 0) {
            /* the stop string is not part of the output unless the request asks for it */
            size_t cut = (size_t)at + (r->params.include_stop_str_in_output ? strlen(c->stop[which]) : 0);
            c->text_len = cut;
            c->text[cut] = '\0';
            c->stop_hit = which;
            r->num_tokens = pos + 1; /* tokens accepted after this one are not part of the output */
            if (!pd_request_is_finished(r)) {
                pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_STOPPED);
                pd_input_batch_remove(&e->runner.batch, r);
            } else {
                /* a later token of this step hit a limit or EOS: the stop string came first */
                r->state = PD_REQ_FINISHED_STOPPED;
                r->stop_token = -1;
            }
            finished = true;
        }
    }
    if (finished) {
        char tailbuf[8];
        size_t tn = pd_detok_finish(&c->detok, tailbuf, sizeof(tailbuf));
        text_append(c, tailbuf, tn);
    }
    emit_text(c, o, finished);
    if (lp_at >= 0 && r->params.logprobs > 0) {
        o->logprob = e->runner.sampled_logprob[lp_at];
        o->num_top = r->params.logprobs;
        memcpy(o->top_ids, e->runner.top_ids + lp_at * PD_MAX_LOGPROBS, (size_t)o->num_top * 4);
        memcpy(o->top_logprobs, e->runner.top_logprobs + lp_at * PD_MAX_LOGPROBS, (size_t)o->num_top * 4);
    }
    if (finished) {
        output_finish_fields(o, r);
    }
    eng_push_output(tail, o);
    return !finished;
}

/* Draft tokens (--speculative-config) for the requests that got tokens in the last step and go on
 * (e->spec_next), at the start of the next step so that the last step's outputs are out first (a
 * draft model's catch-up over a prompt takes a while): at most num_speculative_tokens, and never so
 * many that accepting them all and the token after them would pass max_tokens or the context. */
static void propose_drafts(pd_engine_t *e)
{
    bool draft = e->spec.method == PD_SPEC_DRAFT_MODEL;
    int32_t n = 0, count = e->num_spec_next;
    e->num_spec_next = 0;
    if (e->spec.disable_by_batch_size > 0 &&
        pd_scheduler_num_running(e->sched) >= e->spec.disable_by_batch_size) {
        return; /* a full batch keeps the cores busy already: verify rows would cost more than they give */
    }
    for (int32_t i = 0; i < count; i++) {
        pd_request_t *r = e->spec_next[i];
        int32_t room = r->cap_tokens - r->num_tokens - 1;
        int32_t k = e->spec.num_tokens < room ? e->spec.num_tokens : room;
        if (pd_request_is_finished(r) || k <= 0) {
            continue;
        }
        if (!draft) {
            r->num_spec_tokens = pd_ngram_propose(r->tokens, r->num_tokens, e->spec.lookup_min,
                                                  e->spec.lookup_max, k, r->tokens + r->num_tokens);
        } else if (pd_scheduler_reserve_lookahead(e->sched, r, r->num_tokens + k - 1)) {
            e->spec_reqs[n] = r; /* the draft writes positions up to num_tokens + k − 2 */
            e->spec_want[n++] = k;
        }
    }
    if (n > 0) {
        pd_spec_draft_propose(&e->draft, e->spec_reqs, e->spec_want, n);
    }
}

/* Adds the scheduler's spec_decode counters since the last step to vLLM's metrics. */
static void count_spec(pd_engine_t *e)
{
    if (e->spec.method == PD_SPEC_NONE || e->spec_m[0] == NULL) {
        return;
    }
    pd_scheduler_stats_t now;
    pd_scheduler_get_spec_stats(e->sched, &now);
    pd_scheduler_stats_t *was = &e->spec_seen;
    pd_metric_inc(e->spec_m[0], (double)(now.spec_drafts - was->spec_drafts));
    pd_metric_inc(e->spec_m[1], (double)(now.spec_draft_tokens - was->spec_draft_tokens));
    pd_metric_inc(e->spec_m[2], (double)(now.spec_accepted - was->spec_accepted));
    for (int32_t j = 0; j < e->spec.num_tokens; j++) {
        pd_metric_inc(e->spec_pos[j], (double)(now.spec_accepted_per_pos[j] - was->spec_accepted_per_pos[j]));
    }
    *was = now;
}

/* What prompt tokens cost here (pd_prefill_cost, fitted to the steps that were mostly prompt tokens;
 * the connector weighs fetching a prefix from a peer against it; tools/bench-prefill-cost.sh reads
 * the debug line). so is the step that took s, before the scheduler's update (its requests'
 * computed counts are the step's start). */
static void note_prefill_cost(pd_engine_t *e, pd_status_t st, const pd_scheduler_output_t *so, double s)
{
    if (st != PD_OK || s <= 0) {
        return;
    }
    int32_t prompt_tokens = 0;
    for (int32_t i = 0; i < so->num_items; i++) {
        const pd_request_t *r = so->items[i].req;
        prompt_tokens += r->num_computed_tokens < r->num_prompt_tokens ? so->items[i].num_new_tokens : 0;
    }
    if (prompt_tokens < 32 || 2 * prompt_tokens < so->total_tokens) {
        return; /* decode steps (most steps) stop here */
    }
    double positions = 0;
    for (int32_t i = 0; i < so->num_items; i++) {
        int32_t from = so->items[i].req->num_computed_tokens;
        positions += pd_prefill_cost_positions(&e->prefill_cost, from, from + so->items[i].num_new_tokens);
    }
    double predicted;
    bool known = pd_prefill_cost_step(&e->prefill_cost, so->total_tokens, positions, &predicted);
    pd_prefill_cost_observe(&e->prefill_cost, so->total_tokens, positions, s);
    pd_log_debug("engine: prefill cost: a step of %d tokens over %.0f attended positions took %.2f ms, "
                 "predicted %.2f ms; now %.3g s/token + %.3g s/position",
                 so->total_tokens, positions, s * 1e3, known ? predicted * 1e3 : -1.0, e->prefill_cost.alpha,
                 e->prefill_cost.beta);
}

pd_status_t pd_engine_step(pd_engine_t *e, pd_engine_output_t **outputs)
{
    double t0 = pd_time_now_s();
    pd_engine_output_t **tail = outputs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    if (e->aborted_head != NULL) {
        *tail = e->aborted_head;
        while (*tail != NULL) {
            tail = &(*tail)->next;
        }
        e->aborted_head = NULL;
        e->aborted_tail = &e->aborted_head;
    }
    propose_drafts(e); /* before the schedule releases the last step's finished requests */
    const pd_scheduler_output_t *so = pd_scheduler_schedule(e->sched);
    e->last_items = so->num_items;
    double t_run = pd_time_now_s();
    pd_model_output_t mo;
    pd_status_t st = pd_model_runner_execute(&e->runner, so, &mo);
    note_prefill_cost(e, st, so, pd_time_now_s() - t_run);
    if (st != PD_OK) {
        /* the step failed as a whole: its requests end with an error, the engine goes on */
        pd_log_error("engine: step failed (%s); failing its %d requests", pd_status_str(st), so->num_items);
        for (int32_t i = 0; i < so->num_items; i++) {
            pd_request_t *r = so->items[i].req;
            if (!pd_request_is_finished(r)) {
                pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_ERROR);
            }
        }
        memset(&mo, 0, sizeof(mo));
    }
    pd_scheduler_update_result_t res;
    pd_scheduler_update(e->sched, so, &mo, &res);
    if (mo.finished.num_recving > 0 || mo.finished.num_sending > 0 || mo.num_load_error_blocks > 0) {
        /* the connector's news is applied after scheduling: a load that just finished makes its request
         * runnable in the next step, so that step must come now, not after the idle wait */
        e->last_items++;
    }
    e->steps++;

    gather_prompt_logprobs(e, so);
    /* new tokens: detokenize, stop strings (one output per token) */
    char *buf = malloc(e->max_token_bytes + 64);
    for (int32_t i = 0; i < res.num_with_new_token && buf != NULL; i++) {
        pd_request_t *r = res.with_new_token[i];
        int32_t cnt = res.num_new_tokens[i], first = r->num_tokens - cnt, item = -1;
        for (int32_t k = 0; k < so->num_items && item < 0; k++) {
            item = so->items[k].req == r ? k : -1;
        }
        bool more = true;
        for (int32_t j = 0; j < cnt && more; j++) {
            int64_t lp_at = item >= 0 ? (int64_t)item * e->runner.stride + j : -1;
            more = emit_token(e, r, first + j, j == cnt - 1, lp_at, buf, &tail);
            e->generation_tokens++;
        }
        if (more && r->handover_after_first) {
            hand_over(e, r, &tail);
        }
    }
    free(buf);
    for (int32_t i = 0; e->spec.method != PD_SPEC_NONE && i < res.num_with_new_token; i++) {
        e->spec_next[e->num_spec_next++] = res.with_new_token[i]; /* drafted at the next step's start */
    }
    count_spec(e);
    /* requests that finished without a new token this step (aborts, errors, stop strings are
     * covered above): a closing output each */
    int32_t num_finished;
    pd_request_t *const *finished = pd_scheduler_finished(e->sched, &num_finished);
    for (int32_t i = 0; i < num_finished; i++) {
        pd_request_t *r = finished[i];
        pd_input_batch_remove(&e->runner.batch, r);
        bool had_token = false;
        for (int32_t k = 0; k < res.num_with_new_token; k++) {
            had_token |= res.with_new_token[k] == r;
        }
        e->finished++;
        if (had_token) {
            continue;
        }
        pd_engine_output_t *o = output_new(r);
        if (o != NULL) {
            req_ctx_t *c = r->user;
            emit_text(c, o, true);
            output_finish_fields(o, r);
            eng_push_output(&tail, o);
        }
    }
    if (e->kv_pub != NULL) { /* this step's prefix-cache changes, as one batch */
        pd_kv_event_log_t *log = pd_scheduler_kv_events(e->sched);
        pd_kv_events_pub_publish(e->kv_pub, log);
        pd_kv_event_log_reset(log);
    }
    e->last_step_s = pd_time_now_s() - t0;
    if (so->num_items > 0) {
        pd_metric_observe(e->step_hist, e->last_step_s);
        pd_metric_observe(e->iteration_tokens, so->total_tokens);
    }
    return st;
}
