/* connector/kv_engine.h — the connector's engine-thread state (kv_conn.h names the owners): the
 * scheduler half (kv_scheduler.c), the worker half (kv_worker.c) and the host mirror
 * (kv_staging.c). Every field is the engine thread's; it reaches the control thread only by
 * commands, and hears from it only by events (kv_mail.h). */
#ifndef PD_CONNECTOR_KV_ENGINE_H
#define PD_CONNECTOR_KV_ENGINE_H

#include "common/strmap.h"
#include "connector/kv_conn.h"

/* Prefill, push: one request being saved. */
typedef struct kv_push {
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX];
    kv_offer_t *offer;   /* the reservation bound, NULL until one arrived */
    kv_resv_ref_t *take; /* KV_CMD_TAKE_RESV, sent when it binds one (allocated with the push) */
    kv_notice_t *done;   /* KV_CMD_WRITE_DONE, sent when a stream ends (allocated with the push) */
    bool streaming;      /* every step so far wrote its layers */
    bool failed;
    int32_t next_block; /* first block not yet completely written */
    int32_t steps;
    pd_list_link_t link;
} kv_push_t;

/* One step's connector metadata (scheduler half → worker half). */
typedef struct kv_save_item {
    char req_id[PD_REQ_ID_MAX];
    char transfer_id[PD_REQ_ID_MAX];
    const uint32_t *blocks; /* the request's block ids (valid during the step) */
    int32_t num_blocks;
    int32_t start_token, end_token; /* tokens computed this step */
    int32_t prompt_len;
    int32_t cached_tokens; /* prefix-cache hit when first scheduled (staged: those pages may lack a
                            * mirror copy) */
    bool push;             /* false: staged only (pull mode) */
} kv_save_item_t;

typedef struct kv_meta {
    pd_list_link_t loads; /* kv_xfer_t: loads to start */
    kv_save_item_t *saves;
    int32_t num_saves;
    size_t cap_saves;
    bool incomplete; /* out of memory building saves: bind fails the step (a skipped save would
                      * leave a staged mirror without the step's pages) */
} kv_meta_t;

typedef struct kv_eng {
    kv_meta_t meta_build, *meta_bound;
    pd_list_link_t
        sched_pending;       /* kv_xfer_t: built in update_state_after_alloc, handed over in build_meta */
    pd_list_link_t loading;  /* kv_cancel_t (msg.link): loads sent, not reported yet (decode) */
    pd_list_link_t pushes;   /* kv_push_t */
    pd_list_link_t offers;   /* kv_offer_t (msg.link): reservations offered, not bound, not gone */
    pd_list_link_t ready;    /* kv_report_t (msg.link): taken from the mailbox, for get_finished */
    pd_list_link_t reported; /* kv_report_t (msg.link): what get_finished returned last, and failed
                                   * loads whose errors get_block_ids_with_load_errors has not returned */
    const char **rep_sending, **rep_recving; /* what get_finished returned last (into reported) */
    int32_t *rep_first;                      /* beside rep_recving */
    char **rep_grammar;                      /* beside rep_recving: its report's grammar state */
    size_t cap_rep_sending, cap_rep_recving, cap_rep_first, cap_rep_grammar;
    int32_t num_rep_sending, num_rep_recving;
    /* write jobs of this step: posted, and back (KV_EV_JOB_DONE of this generation) */
    uint64_t gen;
    int32_t step_jobs, jobs_done, jobs_failed;
    pd_strmap_t stage_failed; /* prefill, pull: requests whose staging failed */
} kv_eng_t;

void kv_eng_init(kv_eng_t *e);
/* Frees what the engine thread holds (after the control thread returned). */
void kv_eng_free(kv_eng_t *e);
/* Takes the events the control thread emitted (waits for one until deadline; 0: no wait) and
 * applies them: reports join ready, job completions count, offers join offers, gone offers go. */
void kv_eng_take_events(kv_conn_t *k, double deadline);

bool kv_wants_push(const kv_conn_t *k, const json_t *p);
kv_push_t *kv_push_find(kv_conn_t *k, const char *req_id, bool unlink);
void kv_push_free(kv_push_t *ps);
void kv_start_prefault(kv_conn_t *k);

/* kv_scheduler.c */
pd_status_t kv_get_num_new_matched_tokens(pd_connector_t *c, const pd_request_t *req, int32_t num_computed,
                                          int32_t *num_external_out, bool *load_async_out);
pd_status_t kv_update_state_after_alloc(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids,
                                        int32_t num_blocks, int32_t num_external);
bool kv_load_may_wait(pd_connector_t *c, const pd_request_t *req);
const char *kv_params_error(pd_connector_t *c, const void *kv_transfer_params);
void *kv_build_connector_meta(pd_connector_t *c, const struct pd_scheduler_output *out);
bool kv_request_finished(pd_connector_t *c, pd_request_t *req, const uint32_t *block_ids, int32_t num_blocks,
                         void **params_out);

/* kv_worker.c */
pd_status_t kv_register_kv_caches(pd_connector_t *c, const pd_kv_region_desc_t *rd);
pd_status_t kv_bind_connector_metadata(pd_connector_t *c, void *meta);
pd_status_t kv_start_load_kv(pd_connector_t *c);
pd_status_t kv_wait_for_layer_load(pd_connector_t *c, int32_t layer);
pd_status_t kv_save_kv_layer(pd_connector_t *c, int32_t layer);
pd_status_t kv_wait_for_save(pd_connector_t *c);
pd_status_t kv_get_finished(pd_connector_t *c, pd_connector_finished_t *out);
int32_t kv_get_block_ids_with_load_errors(pd_connector_t *c, uint32_t *ids, int32_t max);

/* kv_staging.c */
pd_status_t kv_stage_save_layer(kv_conn_t *k, const kv_save_item_t *s, int32_t layer);
/* PD_ERR_NO_MEMORY (logged) when it cannot be recorded: the step must fail. */
pd_status_t kv_stage_failed_add(kv_conn_t *k, const char *req_id);
bool kv_stage_failed_take(kv_conn_t *k, const char *req_id);
/* Decode: copies the pages of loads that landed in the host mirror (reports marked staged) into
 * the engine's KV; a failed copy turns the load into load errors. reports: kv_report_t on msg.link. */
void kv_stage_finish_loads(kv_conn_t *k, pd_list_link_t *reports);
pd_status_t kv_stage_kv(kv_conn_t *k, const pd_kv_region_desc_t *rd);

#endif
