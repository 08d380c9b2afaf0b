/* engine/grammar_jobs.h — a structured output's grammar made ready before its first token: its cut
 * stacks' walks (pd_grammar_precompute) run on a thread of the engine's own while the requests that
 * use it wait in the scheduler (vLLM's WAITING_FOR_FSM); other requests go on meanwhile, and so does
 * one whose client is already in its stream (engine.c eng_admit_ready), walking as it goes. A grammar
 * is walked once per vocabulary and kept with it (the server caches compiled grammars by text, so a
 * schema's later requests find it ready).
 *
 * Threads: pd_grammar_jobs_ready is the engine thread's; the job thread runs one walk at a time and
 * calls done(arg) after each (the engine's wake-up). destroy cancels a running walk and joins. */
#ifndef PD_ENGINE_GRAMMAR_JOBS_H
#define PD_ENGINE_GRAMMAR_JOBS_H

#include <stdbool.h>

#include "common/status.h"
#include "grammar/grammar.h"

typedef struct pd_grammar_jobs pd_grammar_jobs_t;

/* Jobs for vocabulary v (which outlives them), each walk at most budget_s seconds and started delay_s
 * seconds after the job thread takes it (tests; 0 otherwise); the thread starts with the first job. */
pd_status_t pd_grammar_jobs_create(const pd_gvocab_t *v, double budget_s, double delay_s,
                                   void (*done)(void *arg), void *arg, pd_grammar_jobs_t **out);

/* Whether g's walks are made (or given up on: out of memory, no thread); when not, they are queued
 * (once per grammar) and false. */
bool pd_grammar_jobs_ready(pd_grammar_jobs_t *j, pd_grammar_t *g);

/* Grammars walked ahead and the seconds they took (metrics), and those given up on. */
void pd_grammar_jobs_stats(pd_grammar_jobs_t *j, uint64_t *walked, double *seconds, uint64_t *failed);

void pd_grammar_jobs_destroy(pd_grammar_jobs_t *j);

#endif
