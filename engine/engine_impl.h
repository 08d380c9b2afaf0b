/* engine/engine_impl.h — the engine's state, shared by engine_create.c (configuration, flags,
 * building and freeing an engine), engine.c (admission, the step, outputs) and engine_thread.c (the
 * engine thread and the calls other threads make). Not a public header. */
#ifndef PD_ENGINE_ENGINE_IMPL_H
#define PD_ENGINE_ENGINE_IMPL_H

#include <pthread.h>

#include "engine/engine.h"
#include "engine/kv_events_pub.h"
#include "engine/kv_offload.h"
#include "engine/model_runner.h"
#include "engine/spec_decode.h"
#include "engine/spec_draft.h"
#include "grammar/grammar.h"
#include "model/generation_config.h"
#include "scheduler/prefill_cost.h"
#include "scheduler/scheduler.h"

/* Engine-side state of a request (req->user points here). */
typedef struct req_ctx {
    void *user;
    pd_detok_t detok;
    char *text; /* output text so far (for stop strings) */
    size_t text_len, text_cap, emitted;
    char *stop[PD_MAX_STOP_STRINGS];
    int32_t num_stop;
    int32_t stop_hit; /* index of the stop string that ended the request, or -1 */
    size_t max_stop_len;
    pd_prompt_logprob_t *plp; /* [num_prompt − 1] prompt_logprobs being gathered, or NULL */
    bool *plp_done;           /* [num_prompt − 1] which are (a preempted request computes again) */
    bool plp_sent;            /* handed to an output */
    pd_gmatcher_t gm;         /* structured output's matcher (gm.g NULL: none); the request's grammar
                               * field points here */
    bool grammar_waited_out;  /* admitted before its grammar's walks were made ahead (logged once) */
} req_ctx_t;

/* A structured output's grammar is walked ahead for at most PD_GRAMMAR_AHEAD_BUDGET_S (the rest as
 * its generations go) while its requests wait, at most PD_GRAMMAR_WAIT_MAX_S from their arrival. */
#define PD_GRAMMAR_AHEAD_BUDGET_S 2.0
#define PD_GRAMMAR_WAIT_MAX_S     5.0

/* A queued command from another thread. */
enum { CMD_ABORT = 1, CMD_MIGRATE = 2 };
typedef struct cmd {
    int is_abort; /* CMD_ABORT or CMD_MIGRATE (an abort whose KV is leased on); 0: a submission */
    pd_engine_request_t req;
    int32_t *prompt;
    char id[PD_REQ_ID_MAX];
    char *stop_buf[PD_MAX_STOP_STRINGS];
    struct cmd *next;
} cmd_t;

struct pd_engine {
    pd_engine_config_t cfg;
    pd_dtype_t kv_dtype;   /* --kv-cache-dtype resolved (auto: the model's) */
    char weights_name[32]; /* pd_engine_weight_dtype_name, set when the model loads */
    char model_name[256];
    pd_backend_t *be;
    pd_model_t *model;
    pd_tokenizer_t *tok;
    pd_generation_config_t gen;
    int32_t eos[PD_MAX_EOS]; /* config.json's EOS ids and generation_config.json's */
    int32_t num_eos;
    pd_kv_cache_t *kv;
    pd_scheduler_t *sched;
    pd_model_runner_t runner;
    pd_spec_config_t spec; /* --speculative-config */
    pd_kv_events_config_t kv_events_cfg;
    pd_kv_events_pub_t *kv_pub; /* --kv-events-config: the prefix cache's events after each step */
    pd_model_t *draft_model;    /* method draft_model: the draft, its KV (the target's block ids) */
    pd_kv_cache_t *draft_kv;
    struct pd_kv_offload
        *offload; /* --kv-offload-tier, or NULL; the scheduler reaches it through the loader */
    struct pd_kv_tier_loader *tier_loader;
    pd_spec_draft_t draft;
    pd_request_t **spec_reqs; /* [max_num_seqs] requests the draft model proposes for, and how many */
    int32_t *spec_want;
    pd_request_t **spec_next; /* [max_num_seqs] requests that got tokens in the last step: drafts next */
    int32_t num_spec_next;
    pd_scheduler_stats_t spec_seen; /* spec counters already added to the metrics */
    pd_metric_t *spec_m[3];         /* vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total */
    pd_metric_t *spec_pos[PD_SPEC_MAX_TOKENS]; /* ..._num_accepted_tokens_per_pos_total{position} */
    int32_t max_model_len;
    size_t max_token_bytes;
    uint64_t prompt_tokens, generation_tokens, steps, finished;
    uint64_t grammar_handed;          /* grammar states this prefill wrote for its decodes */
    struct pd_grammar_jobs *gjobs;    /* grammars made ready off this thread (made at the first one) */
    pd_engine_output_t *aborted_head; /* outputs made between steps: aborts' closing outputs, the
                                       * first token of a request a prefill handed over */
    pd_engine_output_t **aborted_tail;
    double last_step_s;
    pd_prefill_cost_t prefill_cost; /* what prompt tokens cost here, from the prompt-heavy steps (the
                                     * connector's fetch-or-compute reads it) */
    pd_metric_t *step_hist,
        *iteration_tokens; /* pd:engine_step_duration_seconds, vllm:iteration_tokens_total */
    /* threading: mu guards the inbox, the output queue, running/stop/woken and the stats snapshot;
     * everything above is the engine thread's (or the caller's, unthreaded) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cmd_t *inbox_head, *inbox_tail;
    int32_t inbox_len;
    pd_engine_output_t *out_head, *out_tail;
    pthread_t thread;
    bool running, stop;
    bool woken;         /* the connector has news since the engine last looked */
    int32_t last_items; /* requests the last step ran, +1 when it applied connector news */
    void (*notify)(void *);
    void *notify_ctx;
    bool (*sink)(void *, pd_engine_output_t *); /* the frontend's output sink, or NULL (engine thread) */
    void *sink_ctx;
    int32_t unnotified;      /* delivered outputs queued since the last notify (engine thread) */
    double notified_at;      /* when notify was last called (engine thread) */
    pd_engine_stats_t stats; /* snapshot under mu */
};

/* engine.c */
/* Frees a request's engine-side state. */
void eng_ctx_free(req_ctx_t *c);
/* The scheduler's release hook: a finished request's blocks are gone, so is its state. */
void eng_on_release(void *arg, pd_request_t *r);
/* The scheduler's admit hook: a structured output waits until its grammar's walks are made ahead
 * (engine/grammar_jobs.c), at most PD_GRAMMAR_WAIT_MAX_S from its arrival. */
bool eng_admit_ready(void *arg, pd_request_t *r);
/* Wakes the engine thread to step again (the connector's and the grammar jobs' hook). */
void eng_wake(void *arg);
/* Frees a queued command and what it owns. */
void eng_cmd_free(cmd_t *c);
/* Appends o to an output list through its tail pointer. */
void eng_push_output(pd_engine_output_t ***tail, pd_engine_output_t *o);

#endif
