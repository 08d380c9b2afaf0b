/* connector/kv_worker.c — the connector's worker half (engine thread, around and inside the
 * forward): registering the KV region, sending loads to the control thread, posting a push's
 * layer pages as each layer is saved, waiting for a step's writes, taking the control thread's
 * events, and reporting finished transfers and failed blocks to the scheduler. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/array.h"
#include "common/log.h"
#include "common/time.h"
#include "connector/kv_connector.h"
#include "connector/kv_engine.h"
#include "scheduler/scheduler.h"

static pd_status_t post_layer_pages(kv_conn_t *k, kv_push_t *ps, const kv_save_item_t *s, int32_t layer,
                                    int32_t b0, int32_t b1);

pd_status_t kv_register_kv_caches(pd_connector_t *c, const pd_kv_region_desc_t *rd)
{
    kv_conn_t *k = (kv_conn_t *)c;
    if (rd->num_layers > PD_MAX_LAYERS) {
        pd_log_error("kv connector: %d layers, at most %d supported", rd->num_layers, PD_MAX_LAYERS);
        return PD_ERR_UNSUPPORTED;
    }
    bool nccl = k->pipe_kind == PD__PIPE_KIND__PIPE_NCCL;
    pd_status_t st;
    if (rd->host_memory && nccl) {
        pd_log_error(
            "kv connector: --kv-pipe nccl moves GPU memory and this node's KV cache is in host memory "
            "(--device cpu): use --kv-pipe ucx or tcp, or --device cuda");
        return PD_ERR_UNSUPPORTED;
    } else if (rd->host_memory && strcmp(k->cfg.staging, "always") != 0) {
        st = k->region != NULL && k->region->base == rd->base
                 ? PD_OK /* the pipe allocated it (pd_kv_connector_allocator) */
                 : k->pipe->ops->register_region(k->pipe, rd->base, rd->bytes, PD_MEM_HOST, &k->region);
        if (st != PD_OK) {
            pd_log_error("kv connector: cannot register the KV region with the %s pipe", k->cfg.pipe);
        }
    } else if (!rd->host_memory && (nccl || k->pipe_kind == PD__PIPE_KIND__PIPE_UCX) &&
               (st = k->pipe->ops->register_region(k->pipe, rd->base, rd->bytes, PD_MEM_CUDA, &k->region)) ==
                   PD_OK) {
        /* NCCL, or a UCX built with CUDA support, moves the device KV in place: no mirror */
        pd_log_info("kv connector: the device KV is registered with the %s pipe in place (no staging)",
                    k->cfg.pipe);
    } else if (nccl) {
        pd_log_error("kv connector: cannot register the device KV region with the nccl pipe");
    } else {
        st = kv_stage_kv(k, rd);
    }
    if (st != PD_OK) {
        return st;
    }
    k->geom.length = rd->bytes;
    k->geom.page_bytes = rd->page_bytes;
    k->geom.num_blocks = rd->num_blocks;
    k->geom.num_layers = (uint32_t)rd->num_layers;
    for (int32_t l = 0; l < rd->num_layers; l++) {
        k->geom.layer_offset[l] = rd->layer_offset[l];
    }
    k->block_size = rd->block_size;
    k->geom.num_groups = rd->num_groups > 0 ? (uint32_t)rd->num_groups : 1;
    for (int32_t l = 0; l < rd->num_layers; l++) {
        k->geom.layer_group[l] = rd->num_groups > 1 ? rd->layer_group[l] : 0;
    }
    snprintf(k->group_layout, sizeof(k->group_layout), "%s",
             rd->group_layout[0] ? rd->group_layout : "g1:full");
    pd_log_info(
        "kv connector: registered %.1f MiB of KV (%u blocks × %d layers × %zu B pages) with the %s pipe",
        (double)rd->bytes / (1 << 20), rd->num_blocks, rd->num_layers, rd->page_bytes, k->cfg.pipe);
    return PD_OK;
}

pd_status_t kv_bind_connector_metadata(pd_connector_t *c, void *meta)
{
    kv_conn_t *k = (kv_conn_t *)c;
    k->e->meta_bound = meta;
    return meta != NULL && ((kv_meta_t *)meta)->incomplete ? PD_ERR_NO_MEMORY : PD_OK;
}

pd_status_t kv_start_load_kv(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    if (k->e->meta_bound == NULL) {
        return PD_OK;
    }
    kv_xfer_t *x;
    while ((x = pd_list_pop_head(&k->e->meta_bound->loads, kv_xfer_t, link)) != NULL) {
        /* its cancel stays here until get_finished reports the load (finished_decode sends it) */
        pd_list_add_tail(&k->e->loading, &x->cancel->msg.link);
        x->cancel = NULL;
        kv_mb_send(&k->mb, &x->msg, 0);
    }
    return PD_OK;
}

pd_status_t kv_wait_for_layer_load(pd_connector_t *c, int32_t layer)
{
    (void)c, (void)layer;
    return PD_OK; /* loads complete before a request is scheduled (see the file comment) */
}

/* Posts this layer's pages of blocks [b0, b1) of save item s into its reservation (a write job for
 * the control thread). PD_ERR_NO_MEMORY: the push failed (its WRITE_DONE says so). */
static pd_status_t post_layer_pages(kv_conn_t *k, kv_push_t *ps, const kv_save_item_t *s, int32_t layer,
                                    int32_t b0, int32_t b1)
{
    const kv_offer_t *o = ps->offer;
    if (b1 > o->num_blocks) {
        b1 = o->num_blocks;
    }
    if (b1 > s->num_blocks) {
        b1 = s->num_blocks;
    }
    if (b0 < o->skip_blocks) {
        b0 = o->skip_blocks;
    }
    if (b0 >= b1) {
        return PD_OK;
    }
    kv_write_job_t *j = calloc(1, sizeof(*j));
    if (j == NULL || (j->pages = malloc((size_t)(b1 - b0) * sizeof(pd_page_xfer_t))) == NULL) {
        free(j);
        return PD_ERR_NO_MEMORY;
    }
    int32_t np = 0;
    for (int32_t b = b0; b < b1; b++) {
        /* this layer's group; an entry the decode does not hold (outside its window) stays */
        if (!kv_entry_of_layer(&k->geom, b, layer) || o->blocks[b] == 0 || s->blocks[b] == 0) {
            continue;
        }
        j->pages[np++] = (pd_page_xfer_t){
            k->geom.layer_offset[layer] + (uint64_t)s->blocks[b] * k->geom.page_bytes,
            o->layer_offset[layer] + (uint64_t)o->blocks[b] * o->page_bytes, k->geom.page_bytes};
    }
    if (np == 0) {
        kv_write_job_free(j);
        return PD_OK;
    }
    j->msg.kind = KV_CMD_WRITE_JOB;
    j->resv_id = o->resv_id;
    j->num_pages = np;
    j->bytes = (size_t)j->num_pages * k->geom.page_bytes;
    j->gen = k->e->gen;
    k->e->step_jobs++;
    kv_mb_send(&k->mb, &j->msg, 0);
    return PD_OK;
}

/* A push's first layer of a step: the reservation offered for its transfer id binds (the control
 * thread hears it is taken), and the push streams on while its reservation takes writes. */
static void push_step_starts(kv_conn_t *k, kv_push_t *ps)
{
    if (ps->offer == NULL) {
        kv_eng_take_events(k, 0); /* reservations that arrived meanwhile */
        kv_offer_t *o;
        pd_list_for_each (o, &k->e->offers, msg.link) {
            if (!o->gone && strcmp(o->transfer_id, ps->transfer_id) == 0) {
                pd_list_del(&o->msg.link);
                ps->offer = o;
                ps->take->resv_id = o->resv_id;
                kv_mb_send(&k->mb, &ps->take->msg, 0);
                ps->take = NULL;
                pd_metric_inc(k->m.started[KV_X_PUSH_SAVE], 1); /* the stream starts */
                break;
            }
        }
    }
    ps->streaming = ps->streaming && ps->offer != NULL && !ps->offer->gone;
    ps->steps++;
}

/* A push for save item s, with the two commands it may send (a stream that can say neither would
 * hold a reservation it never ends); NULL when out of memory. */
static kv_push_t *push_new(const kv_save_item_t *s)
{
    kv_push_t *ps = calloc(1, sizeof(*ps));
    if (ps == NULL || (ps->take = calloc(1, sizeof(*ps->take))) == NULL ||
        (ps->done = calloc(1, sizeof(*ps->done))) == NULL) {
        kv_push_free(ps);
        return NULL;
    }
    ps->take->msg.kind = KV_CMD_TAKE_RESV;
    ps->done->msg.kind = KV_CMD_WRITE_DONE;
    snprintf(ps->req_id, sizeof(ps->req_id), "%s", s->req_id);
    snprintf(ps->transfer_id, sizeof(ps->transfer_id), "%s", s->transfer_id);
    ps->streaming = true;
    return ps;
}

pd_status_t kv_save_kv_layer(pd_connector_t *c, int32_t layer)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->e->meta_bound;
    if (!k->is_prefill || m == NULL) {
        return PD_OK;
    }
    for (int32_t i = 0; i < m->num_saves; i++) {
        const kv_save_item_t *s = &m->saves[i];
        bool staged_ok = !k->staged || kv_stage_save_layer(k, s, layer) == PD_OK;
        if (!s->push) {
            if (!staged_ok && kv_stage_failed_add(k, s->req_id) != PD_OK) {
                return PD_ERR_NO_MEMORY;
            }
            continue;
        }
        kv_push_t *ps = kv_push_find(k, s->req_id, false);
        if (ps == NULL) {
            if ((ps = push_new(s)) == NULL) { /* its layers would go unrecorded: the step fails instead */
                pd_log_error("kv connector: request %s: out of memory starting its push; failing the step",
                             s->req_id);
                return PD_ERR_NO_MEMORY;
            }
            pd_list_add_tail(&k->e->pushes, &ps->link);
        }
        if (layer == 0) {
            push_step_starts(k, ps);
        }
        ps->failed |= !staged_ok;
        if (ps->streaming && !ps->failed) {
            int32_t end_block = kv_entry(&k->geom, (s->end_token + k->block_size - 1) / k->block_size);
            if (post_layer_pages(k, ps, s, layer, ps->next_block, end_block) != PD_OK) {
                pd_log_error(
                    "kv connector: request %s: out of memory posting layer %d's pages; its push fails",
                    s->req_id, layer);
                ps->failed = true;
            }
        }
    }
    return PD_OK;
}

pd_status_t kv_wait_for_save(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->e->meta_bound;
    if (!k->is_prefill || m == NULL) {
        return PD_OK;
    }
    bool failed = false;
    kv_eng_t *e = k->e;
    if (e->step_jobs > 0) {
        double until = pd_time_now_s() + k->cfg.save_timeout;
        while (e->jobs_done + e->jobs_failed < e->step_jobs && pd_time_now_s() < until) {
            kv_eng_take_events(k, until);
        }
        failed = e->jobs_failed > 0 || e->jobs_done + e->jobs_failed < e->step_jobs;
        if (failed) {
            pd_log_warn("kv connector: %d of %d layer writes of this step failed or timed out",
                        e->step_jobs - e->jobs_done, e->step_jobs);
        }
        e->gen++; /* completions still to come belong to a finished step */
        e->jobs_done = e->jobs_failed = e->step_jobs = 0;
    }
    for (int32_t i = 0; i < m->num_saves; i++) {
        kv_push_t *ps = kv_push_find(k, m->saves[i].req_id, false);
        if (ps == NULL) {
            continue;
        }
        if (ps->streaming) {
            ps->failed |= failed;
            ps->next_block = kv_entry(&k->geom, m->saves[i].end_token / k->block_size);
        }
    }
    k->e->meta_bound = NULL;
    return failed ? PD_ERR_IO : PD_OK;
}

/* Reports that have nothing more to give: returned by the last get_finished, their load errors
 * (if any) all taken. */
static void reported_sweep(kv_eng_t *e)
{
    kv_report_t *r, *tmp;
    pd_list_for_each_safe (r, tmp, &e->reported, msg.link) {
        if (!r->failed || r->errors_taken >= r->end - r->first) {
            pd_list_del(&r->msg.link);
            kv_report_free(r);
        }
    }
}

/* A reservation is gone: an offer not bound yet goes, a bound one stops its stream. */
static void on_resv_gone(kv_eng_t *e, uint64_t id)
{
    kv_offer_t *o, *tmp;
    pd_list_for_each_safe (o, tmp, &e->offers, msg.link) {
        if (o->resv_id == id) {
            pd_list_del(&o->msg.link);
            kv_offer_free(o);
            return;
        }
    }
    kv_push_t *ps;
    pd_list_for_each (ps, &e->pushes, link) {
        if (ps->offer != NULL && ps->offer->resv_id == id) {
            ps->offer->gone = true;
            return;
        }
    }
}

void kv_eng_take_events(kv_conn_t *k, double deadline)
{
    kv_eng_t *e = k->e;
    pd_list_link_t in;
    pd_list_head_init(&in);
    kv_mb_take(&k->mb, true, &in, deadline, false);
    kv_msg_t *m;
    while ((m = pd_list_pop_head(&in, kv_msg_t, link)) != NULL) {
        switch (m->kind) {
        case KV_EV_REPORT: pd_list_add_tail(&e->ready, &m->link); break;
        case KV_EV_OFFER: pd_list_add_tail(&e->offers, &m->link); break;
        case KV_EV_JOB_DONE: {
            kv_write_job_t *j = pd_container_of(m, kv_write_job_t, msg);
            if (j->gen == e->gen) {
                e->jobs_done += j->status == PD_OK;
                e->jobs_failed += j->status != PD_OK;
            }
            kv_msg_free(m);
            break;
        }
        case KV_EV_RESV_GONE:
            on_resv_gone(e, pd_container_of(m, kv_resv_ref_t, msg)->resv_id);
            kv_msg_free(m);
            break;
        default:
            pd_log_error("BUG: kv connector: command %d among the events", (int)m->kind);
            kv_msg_free(m);
            break;
        }
    }
}

/* Decode: a load's end is reported: its cancel is not needed any more. */
static void load_reported(kv_eng_t *e, const char *req_id)
{
    kv_cancel_t *cn;
    pd_list_for_each (cn, &e->loading, msg.link) {
        if (strcmp(cn->req_id, req_id) == 0) {
            pd_list_del(&cn->msg.link);
            free(cn);
            return;
        }
    }
}

pd_status_t kv_get_finished(pd_connector_t *c, pd_connector_finished_t *out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_eng_t *e = k->e;
    memset(out, 0, sizeof(*out));
    e->num_rep_sending = e->num_rep_recving = 0;
    reported_sweep(e);
    kv_eng_take_events(k, 0);
    size_t n = pd_list_length(&e->ready);
    if (n == 0) {
        return PD_OK;
    }
    /* room for every ready report before taking them: running out of memory leaves them ready for
     * the next step, nothing is lost */
    if (pd_array_reserve(&e->rep_sending, &e->cap_rep_sending, n) != PD_OK ||
        pd_array_reserve(&e->rep_recving, &e->cap_rep_recving, n) != PD_OK ||
        pd_array_reserve(&e->rep_first, &e->cap_rep_first, n) != PD_OK ||
        pd_array_reserve(&e->rep_grammar, &e->cap_rep_grammar, n) != PD_OK) {
        pd_log_error("kv connector: out of memory taking %zu finished transfers; they wait for the next step",
                     n);
        return PD_ERR_NO_MEMORY;
    }
    pd_list_link_t taken;
    pd_list_head_init(&taken);
    pd_list_splice_tail(&taken, &e->ready);
    kv_stage_finish_loads(k, &taken); /* the KV is on the device before the scheduler hears of it */
    kv_report_t *r;
    pd_list_for_each (r, &taken, msg.link) {
        if (r->recving) {
            load_reported(e, r->req_id);
            e->rep_first[e->num_rep_recving] = r->first_token;
            e->rep_grammar[e->num_rep_recving] = r->grammar_state; /* the report lives until the next call */
            e->rep_recving[e->num_rep_recving++] = r->req_id;
        } else {
            e->rep_sending[e->num_rep_sending++] = r->req_id;
        }
    }
    pd_list_splice_tail(&e->reported, &taken);
    out->sending = e->rep_sending;
    out->num_sending = e->num_rep_sending;
    out->recving = e->rep_recving;
    out->num_recving = e->num_rep_recving;
    out->recving_first_token = e->rep_first;
    out->recving_grammar_state = (const char *const *)e->rep_grammar;
    return PD_OK;
}

/* The blocks of loads get_finished reported failed. */
int32_t kv_get_block_ids_with_load_errors(pd_connector_t *c, uint32_t *ids, int32_t max)
{
    kv_conn_t *k = (kv_conn_t *)c;
    int32_t n = 0;
    kv_report_t *r;
    pd_list_for_each (r, &k->e->reported, msg.link) {
        for (; r->failed && r->errors_taken < r->end - r->first && n < max; r->errors_taken++) {
            ids[n++] = r->blocks[r->first + r->errors_taken];
        }
    }
    return n;
}

void kv_eng_init(kv_eng_t *e)
{
    pd_list_link_t *heads[] = {&e->meta_build.loads, &e->sched_pending, &e->loading, &e->pushes,
                               &e->offers,           &e->ready,         &e->reported};
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        pd_list_head_init(heads[i]);
    }
}

void kv_push_free(kv_push_t *ps)
{
    if (ps != NULL) {
        kv_offer_free(ps->offer);
        free(ps->take);
        if (ps->done != NULL) {
            free(ps->done->grammar_state);
        }
        free(ps->done);
        free(ps);
    }
}

void kv_eng_free(kv_eng_t *e)
{
    kv_xfer_t *x;
    while ((x = pd_list_pop_head(&e->sched_pending, kv_xfer_t, link)) != NULL) {
        kv_xfer_free(x);
    }
    while ((x = pd_list_pop_head(&e->meta_build.loads, kv_xfer_t, link)) != NULL) {
        kv_xfer_free(x);
    }
    free(e->meta_build.saves);
    kv_push_t *p;
    while ((p = pd_list_pop_head(&e->pushes, kv_push_t, link)) != NULL) {
        kv_push_free(p);
    }
    pd_list_link_t *msgs[4] = {&e->loading, &e->offers, &e->ready, &e->reported};
    for (int i = 0; i < 4; i++) {
        kv_msg_t *m;
        while ((m = pd_list_pop_head(msgs[i], kv_msg_t, link)) != NULL) {
            kv_msg_free(m);
        }
    }
    free(e->rep_sending), free(e->rep_recving), free(e->rep_first), free(e->rep_grammar);
    if (e->stage_failed.slots != NULL) {
        pd_strmap_destroy(&e->stage_failed);
    }
}
