/* connector/kv_staging.c — the host mirror of a device KV (engine thread): page ranges of block
 * lists, device→host copies of the layers a prefill step wrote, host→device copies of finished
 * loads before the scheduler hears of them, and the mirror's registration with the pipe. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "connector/kv_connector.h"
#include "connector/kv_engine.h"
#include "scheduler/scheduler.h"

static int32_t stage_ranges(const kv_conn_t *k, int32_t l0, int32_t l1, const uint32_t *list, int32_t e0,
                            int32_t e1, pd_page_range_t **out);
static pd_status_t stage_copy(kv_conn_t *k, const pd_page_range_t *r, int32_t n, bool to_host);

/* Page ranges of block-list entries [e0, e1) of list in layers [l0, l1) of the KV layout (each
 * layer its group's entries, null entries skipped), adjacent pages merged; *out is malloc'd.
 * Returns the count, -1 when out of memory. */
static int32_t stage_ranges(const kv_conn_t *k, int32_t l0, int32_t l1, const uint32_t *list, int32_t e0,
                            int32_t e1, pd_page_range_t **out)
{
    int32_t n = e1 - e0;
    pd_page_range_t *r = malloc(((size_t)(l1 - l0) * (size_t)n + 1) * sizeof(*r));
    *out = r;
    if (r == NULL) {
        return -1;
    }
    int32_t m = 0;
    for (int32_t l = l0; l < l1; l++) {
        for (int32_t b = e0; b < e1; b++) {
            if (list[b] == 0 || !kv_entry_of_layer(&k->geom, b, l)) {
                continue;
            }
            uint64_t off = k->geom.layer_offset[l] + (uint64_t)list[b] * k->geom.page_bytes;
            if (m > 0 && r[m - 1].offset + r[m - 1].length == off) {
                r[m - 1].length += k->geom.page_bytes;
            } else {
                r[m++] = (pd_page_range_t){off, k->geom.page_bytes};
            }
        }
    }
    return m;
}

/* Copies ranges between the engine's KV and the host mirror (to_host: device→host). */
static pd_status_t stage_copy(kv_conn_t *k, const pd_page_range_t *r, int32_t n, bool to_host)
{
    double t0 = pd_time_now_s();
    pd_status_t st = to_host ? k->copy.copy_pages(k->copy.ctx, k->region->base, k->kv_base, r, n, true)
                             : k->copy.copy_pages(k->copy.ctx, k->kv_base, k->region->base, r, n, false);
    if (st != PD_OK) {
        pd_log_warn("kv connector: staging copy %s failed: %s", to_host ? "device→host" : "host→device",
                    pd_status_str(st));
        return st;
    }
    uint64_t bytes = 0;
    for (int32_t i = 0; i < n; i++) {
        bytes += r[i].length;
    }
    pd_metric_inc(to_host ? k->m.staged_d2h : k->m.staged_h2d, (double)bytes);
    pd_metric_observe(k->m.staged_seconds, pd_time_now_s() - t0);
    return PD_OK;
}

/* Prefill: copies the pages layer `layer` wrote this step for save item s into the mirror. The
 * first step also copies the prefix-cache hit's pages (another request computed them, maybe one
 * that was never staged). */
pd_status_t kv_stage_save_layer(kv_conn_t *k, const kv_save_item_t *s, int32_t layer)
{
    int32_t b0 = s->start_token <= s->cached_tokens ? 0 : kv_entry(&k->geom, s->start_token / k->block_size);
    int32_t b1 = kv_entry(&k->geom, (s->end_token + k->block_size - 1) / k->block_size);
    b1 = b1 < s->num_blocks ? b1 : s->num_blocks;
    if (b0 >= b1) {
        return PD_OK;
    }
    pd_page_range_t *r;
    int32_t n = stage_ranges(k, layer, layer + 1, s->blocks, b0, b1, &r);
    pd_status_t st = n < 0 ? PD_ERR_NO_MEMORY : stage_copy(k, r, n, true);
    free(r);
    return st;
}

/* Pull-mode requests whose staging failed (engine thread): request_finished offers no KV. */
pd_status_t kv_stage_failed_add(kv_conn_t *k, const char *req_id)
{
    if ((k->e->stage_failed.slots == NULL && pd_strmap_init(&k->e->stage_failed, 16) != PD_OK) ||
        pd_strmap_put(&k->e->stage_failed, req_id, strlen(req_id), 1) != PD_OK) {
        /* unrecorded, its request would offer a mirror that lacks its pages: fail the step */
        pd_log_error("kv connector: request %s: out of memory recording that its KV was not staged", req_id);
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

bool kv_stage_failed_take(kv_conn_t *k, const char *req_id)
{
    return k->e->stage_failed.slots != NULL &&
           pd_strmap_del(&k->e->stage_failed, req_id, strlen(req_id), NULL) == 1;
}

void kv_stage_finish_loads(kv_conn_t *k, pd_list_link_t *reports)
{
    kv_report_t *rep;
    pd_list_for_each (rep, reports, msg.link) {
        if (!rep->staged || rep->failed) {
            continue;
        }
        pd_page_range_t *r = NULL;
        int32_t n = stage_ranges(k, 0, (int32_t)k->geom.num_layers, rep->blocks, rep->first, rep->end, &r);
        if (n < 0 || stage_copy(k, r, n, false) != PD_OK) {
            pd_log_error("kv connector: request %s: its KV could not be copied from the host mirror; its "
                         "blocks are load errors",
                         rep->req_id);
            rep->failed = true;
            kv_count_policy_action(k);
        }
        free(r);
    }
}

/* Mirrors the engine's KV in host memory the pipe allocates (same layout, so peers see the usual
 * geometry), page-locked by the backend when it can; pages are copied through it (see the file
 * comment of kv_connector.h). */
pd_status_t kv_stage_kv(kv_conn_t *k, const pd_kv_region_desc_t *rd)
{
    if (k->region != NULL || rd->copy.copy_pages == NULL) {
        pd_log_error("kv connector: cannot stage the KV region (it was allocated by the pipe, or the backend "
                     "cannot copy pages)");
        return PD_ERR_INVALID_ARG;
    }
    pd_status_t st = k->pipe->ops->alloc_region(k->pipe, rd->bytes, &k->region);
    if (st != PD_OK) {
        pd_log_error("kv connector: the %s pipe cannot allocate a %.1f MiB host mirror of the KV",
                     k->cfg.pipe, (double)rd->bytes / (1 << 20));
        return st;
    }
    k->staged = true;
    k->kv_base = rd->base;
    k->copy = rd->copy;
    const char *pin = "pageable";
    if (k->copy.pin_host != NULL) {
        if (k->copy.pin_host(k->copy.ctx, k->region->base, k->region->len) == PD_OK) {
            k->pinned = true;
            pin = "pinned";
        } else {
            pd_log_warn("kv connector: cannot page-lock the KV host mirror; copies run from pageable memory");
        }
    }
    pd_log_info("kv connector: %s; staging KV through a %.1f MiB %s host mirror registered with the %s pipe "
                "(prefill: device→host after each layer; decode: host→device after each load)",
                rd->host_memory ? "--kv-staging always"
                                : "the KV is in device memory, which this pipe cannot register",
                (double)rd->bytes / (1 << 20), pin, k->cfg.pipe);
    kv_start_prefault(k);
    return PD_OK;
}
