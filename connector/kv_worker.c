/* connector/kv_worker.c — the connector's worker half (engine thread, around and inside the
 * forward): registering the KV region, handing loads to the control thread, posting a push's
 * layer pages as each layer is saved, waiting for a step's writes, and reporting finished
 * transfers and failed blocks to the scheduler. */
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
#include "connector/kv_internal.h"
#include "scheduler/scheduler.h"

static void post_layer_pages(kv_conn_t *k, kv_push_t *ps, const kv_save_item_t *s, int32_t layer, int32_t b0,
                             int32_t b1);

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
    k->meta_bound = meta;
    return meta != NULL && ((kv_meta_t *)meta)->incomplete ? PD_ERR_NO_MEMORY : PD_OK;
}

pd_status_t kv_start_load_kv(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    if (k->meta_bound == NULL || pd_list_is_empty(&k->meta_bound->loads)) {
        return PD_OK;
    }
    pthread_mutex_lock(&k->mu);
    pd_list_splice_tail(&k->handoff, &k->meta_bound->loads);
    pthread_mutex_unlock(&k->mu);
    kv_ctl_wake(k);
    return PD_OK;
}

pd_status_t kv_wait_for_layer_load(pd_connector_t *c, int32_t layer)
{
    (void)c, (void)layer;
    return PD_OK; /* loads complete before a request is scheduled (see the file comment) */
}

/* Posts this layer's pages of blocks [b0, b1) of save item s into its reservation. */
static void post_layer_pages(kv_conn_t *k, kv_push_t *ps, const kv_save_item_t *s, int32_t layer, int32_t b0,
                             int32_t b1)
{
    kv_resv_t *rv = ps->resv;
    const kv_geom_t *rg = &rv->peer->geom;
    if (b1 > rv->num_blocks) {
        b1 = rv->num_blocks;
    }
    if (b1 > s->num_blocks) {
        b1 = s->num_blocks;
    }
    if (b0 < rv->skip_blocks) {
        b0 = rv->skip_blocks;
    }
    if (b0 >= b1) {
        return;
    }
    kv_write_job_t *j = calloc(1, sizeof(*j));
    if (j == NULL || (j->pages = malloc((size_t)(b1 - b0) * sizeof(pd_page_xfer_t))) == NULL) {
        free(j);
        ps->failed = true;
        return;
    }
    int32_t np = 0;
    for (int32_t b = b0; b < b1; b++) {
        /* this layer's group; an entry the decode does not hold (outside its window) stays */
        if (!kv_entry_of_layer(&k->geom, b, layer) || rv->blocks[b] == 0 || s->blocks[b] == 0) {
            continue;
        }
        j->pages[np++] = (pd_page_xfer_t){
            k->geom.layer_offset[layer] + (uint64_t)s->blocks[b] * k->geom.page_bytes,
            rg->layer_offset[layer] + (uint64_t)rv->blocks[b] * rg->page_bytes, k->geom.page_bytes};
    }
    if (np == 0) {
        free(j->pages), free(j);
        return;
    }
    j->num_pages = np;
    j->bytes = (size_t)j->num_pages * k->geom.page_bytes;
    j->peer = rv->peer;
    j->conn = k;
    pthread_mutex_lock(&k->mu);
    j->gen = k->gen;
    pd_list_add_tail(&k->jobs, &j->link);
    pthread_mutex_unlock(&k->mu);
    k->step_jobs++;
    kv_ctl_wake(k);
}

pd_status_t kv_save_kv_layer(pd_connector_t *c, int32_t layer)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->meta_bound;
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
            ps = calloc(1, sizeof(*ps));
            if (ps == NULL) { /* its layers would go unrecorded: the step fails instead */
                pd_log_error("kv connector: request %s: out of memory starting its push; failing the step",
                             s->req_id);
                return PD_ERR_NO_MEMORY;
            }
            snprintf(ps->req_id, sizeof(ps->req_id), "%s", s->req_id);
            snprintf(ps->transfer_id, sizeof(ps->transfer_id), "%s", s->transfer_id);
            ps->streaming = true;
            pd_list_add_tail(&k->pushes, &ps->link);
        }
        if (layer == 0) {
            if (ps->resv == NULL) {
                /* the transfer id is in the request's params; find its reservation */
                pthread_mutex_lock(&k->mu);
                kv_resv_t *rv;
                pd_list_for_each (rv, &k->resvs, link) {
                    if (!rv->taken && !rv->released && !rv->dead &&
                        strcmp(rv->transfer_id, ps->transfer_id) == 0) {
                        rv->taken = true;
                        ps->resv = rv;
                        pd_metric_inc(k->m.started[KV_X_PUSH_SAVE], 1); /* the stream starts */
                        break;
                    }
                }
                pthread_mutex_unlock(&k->mu);
            }
            pthread_mutex_lock(&k->mu);
            ps->streaming = ps->streaming && ps->resv != NULL && !ps->resv->dead;
            pthread_mutex_unlock(&k->mu);
            ps->steps++;
        }
        ps->failed |= !staged_ok;
        if (ps->streaming && !ps->failed) {
            int32_t end_block = kv_entry(&k->geom, (s->end_token + k->block_size - 1) / k->block_size);
            post_layer_pages(k, ps, s, layer, ps->next_block, end_block);
        }
    }
    return PD_OK;
}

pd_status_t kv_wait_for_save(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    kv_meta_t *m = k->meta_bound;
    if (!k->is_prefill || m == NULL) {
        return PD_OK;
    }
    bool failed = false;
    if (k->step_jobs > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double until = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + k->cfg.save_timeout;
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        pthread_mutex_lock(&k->mu);
        int rc = 0;
        while (k->jobs_done + k->jobs_failed < k->step_jobs && rc == 0) {
            rc = pthread_cond_timedwait(&k->cv, &k->mu, &ts);
        }
        failed = k->jobs_failed > 0 || k->jobs_done + k->jobs_failed < k->step_jobs;
        if (failed) {
            pd_log_warn("kv connector: %d of %d layer writes of this step failed or timed out",
                        k->step_jobs - k->jobs_done, k->step_jobs);
        }
        k->gen++;
        k->jobs_done = k->jobs_failed = 0;
        pthread_mutex_unlock(&k->mu);
        k->step_jobs = 0;
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
    k->meta_bound = NULL;
    return failed ? PD_ERR_IO : PD_OK;
}

/* Reports that have nothing more to give: returned by the last get_finished, their load errors
 * (if any) all taken. */
static void reported_sweep(kv_conn_t *k)
{
    kv_report_t *r, *tmp;
    pd_list_for_each_safe (r, tmp, &k->reported, link) {
        if (!r->failed || r->errors_taken >= r->end - r->first) {
            pd_list_del(&r->link);
            kv_report_free(r);
        }
    }
}

pd_status_t kv_get_finished(pd_connector_t *c, pd_connector_finished_t *out)
{
    kv_conn_t *k = (kv_conn_t *)c;
    memset(out, 0, sizeof(*out));
    k->num_rep_sending = k->num_rep_recving = 0;
    reported_sweep(k);
    pthread_mutex_lock(&k->mu);
    size_t n = pd_list_length(&k->reports);
    pthread_mutex_unlock(&k->mu);
    if (n == 0) {
        return PD_OK;
    }
    /* room for every report queued now, before taking them: running out of memory leaves them
     * queued for the next step, nothing is lost */
    if (pd_array_reserve(&k->rep_sending, &k->cap_rep_sending, n) != PD_OK ||
        pd_array_reserve(&k->rep_recving, &k->cap_rep_recving, n) != PD_OK ||
        pd_array_reserve(&k->rep_first, &k->cap_rep_first, n) != PD_OK) {
        pd_log_error("kv connector: out of memory taking %zu finished transfers; they wait for the next step",
                     n);
        return PD_ERR_NO_MEMORY;
    }
    pd_list_link_t taken;
    pd_list_head_init(&taken);
    pthread_mutex_lock(&k->mu);
    for (size_t i = 0; i < n; i++) { /* the ones counted; later ones wait for the next step */
        pd_list_add_tail(&taken, pd_list_pop_link(&k->reports));
    }
    pthread_mutex_unlock(&k->mu);
    kv_stage_finish_loads(k, &taken); /* the KV is on the device before the scheduler hears of it */
    kv_report_t *r;
    pd_list_for_each (r, &taken, link) {
        if (r->recving) {
            k->rep_first[k->num_rep_recving] = r->first_token;
            k->rep_recving[k->num_rep_recving++] = r->req_id;
        } else {
            k->rep_sending[k->num_rep_sending++] = r->req_id;
        }
    }
    pd_list_splice_tail(&k->reported, &taken);
    out->sending = k->rep_sending;
    out->num_sending = k->num_rep_sending;
    out->recving = k->rep_recving;
    out->num_recving = k->num_rep_recving;
    out->recving_first_token = k->rep_first;
    return PD_OK;
}

/* The blocks of loads get_finished reported failed (engine thread only: the reports are its). */
int32_t kv_get_block_ids_with_load_errors(pd_connector_t *c, uint32_t *ids, int32_t max)
{
    kv_conn_t *k = (kv_conn_t *)c;
    int32_t n = 0;
    kv_report_t *r;
    pd_list_for_each (r, &k->reported, link) {
        for (; r->failed && r->errors_taken < r->end - r->first && n < max; r->errors_taken++) {
            ids[n++] = r->blocks[r->first + r->errors_taken];
        }
    }
    return n;
}
