/* engine/kv_init.c — specs → profile → config → allocate → bind. */
#include "engine/kv_init.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/time.h"
#include "kernels/paged_impl.h"

size_t pd_sys_physical_ram(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 0;
}

size_t pd_sys_rss(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (f == NULL) {
        return 0;
    }
    unsigned long size = 0, resident = 0;
    int n = fscanf(f, "%lu %lu", &size, &resident);
    fclose(f);
    return n == 2 ? (size_t)resident * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

pd_status_t pd_kv_specs_from_model(const pd_model_config_t *mc, int32_t block_size, pd_dtype_t dtype,
                                   pd_kv_spec_t *specs_out)
{
    if (mc->num_layers > PD_MAX_LAYERS) {
        pd_log_error("kv init: %d layers, at most %d supported", mc->num_layers, PD_MAX_LAYERS);
        return PD_ERR_UNSUPPORTED;
    }
    for (int32_t l = 0; l < mc->num_layers; l++) {
        pd_kv_spec_t *s = &specs_out[l];
        memset(s, 0, sizeof(*s));
        bool sliding = mc->sliding_window > 0 && mc->sliding_layer[l];
        s->kind = sliding ? PD_KV_SLIDING_WINDOW : PD_KV_FULL;
        s->block_size = block_size;
        s->num_kv_heads = mc->num_kv_heads;
        s->head_size = mc->head_size;
        s->dtype_bytes = pd_dtype_size(dtype);
        s->sliding_window = sliding ? mc->sliding_window : 0;
    }
    return PD_OK;
}

/* The profile batch: max_num_batched_tokens tokens in sequences of at most max_model_len (and at
 * most max_num_seqs sequences), each with a block table in a scratch cache. */
pd_status_t pd_kv_profile_available(pd_model_t *model, pd_backend_t *be, const pd_kv_init_params_t *p,
                                    pd_kv_profile_t *prof_out)
{
    uint64_t t0 = pd_time_now_ns();
    const pd_model_config_t *mc = pd_model_config(model);
    pd_kv_profile_t prof;
    memset(&prof, 0, sizeof(prof));
    size_t rss0 = pd_sys_rss(), be0 = be->bytes_in_use;
    prof.weight_bytes = pd_model_weight_bytes(model);
    /* a device's own memory (vLLM's gpu_memory_utilization × total), never the host's RAM */
    prof.total_bytes = p->kv_cache_memory > 0 ? p->kv_cache_memory
                       : be->memory_bytes > 0 ? be->memory_bytes
                                              : pd_sys_physical_ram();
    prof.requested_bytes = (size_t)((double)prof.total_bytes * p->memory_utilization);

    int32_t T = p->max_num_batched_tokens, bs = p->block_size;
    int32_t per_seq = p->max_model_len < T ? p->max_model_len : T;
    int32_t S = (T + per_seq - 1) / per_seq;
    if (S > p->max_num_seqs) {
        S = p->max_num_seqs;
        T = S * per_seq < T ? S * per_seq : T;
    }
    int32_t max_blocks = (int32_t)pd_blocks_for_tokens(per_seq, bs);
    int32_t nblocks = S * max_blocks + 1;
    pd_log_info("profile run: %d tokens in %d sequences (max_num_batched_tokens %d)", T, S,
                p->max_num_batched_tokens);
    pd_status_t st = PD_OK;
    pd_kv_view_t *views = calloc((size_t)mc->num_layers, sizeof(pd_kv_view_t));
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *slots = malloc((size_t)T * 4);
    int32_t *cu = malloc((size_t)(S + 1) * 4), *lens = malloc((size_t)S * 4), *lidx = malloc((size_t)S * 4);
    int32_t *tables = malloc((size_t)S * max_blocks * 4);
    float *logits = malloc((size_t)S * mc->vocab_size * sizeof(float));
    if (!views || !ids || !pos || !slots || !cu || !lens || !lidx || !tables || !logits) {
        st = PD_ERR_NO_MEMORY;
        goto out;
    }
    for (int32_t l = 0; l < mc->num_layers && st == PD_OK; l++) {
        views[l] = (pd_kv_view_t){NULL, p->cache_dtype, nblocks, bs, mc->num_kv_heads, mc->head_size};
        size_t bytes = (size_t)pd_page_elems(bs, mc->num_kv_heads, mc->head_size) * (size_t)nblocks *
                       (size_t)pd_dtype_size(p->cache_dtype);
        st = be->ops->alloc(be, bytes, &views[l].base);
    }
    if (st != PD_OK) {
        goto out;
    }
    cu[0] = 0;
    for (int32_t s = 0, t = 0; s < S; s++) {
        int32_t len = T - t < per_seq ? T - t : per_seq;
        for (int32_t b = 0; b < max_blocks; b++) {
            tables[s * max_blocks + b] = 1 + s * max_blocks + b;
        }
        for (int32_t i = 0; i < len; i++, t++) {
            ids[t] = (int32_t)((t * 7919) % mc->vocab_size);
            pos[t] = i;
            slots[t] = (int32_t)pd_block_table_slot(tables, max_blocks, s, i, bs);
        }
        cu[s + 1] = t;
        lens[s] = len;
        lidx[s] = t - 1;
    }
    /* everything the forward allocates from here on is activation memory */
    size_t be_before = be->bytes_in_use;
    pd_backend_reset_peak(be);
    pd_batch_t batch = {T, ids, pos};
    pd_attn_meta_t meta = {S, T, cu, lens, tables, max_blocks, slots, mc->sliding_window, NULL};
    uint64_t tf = pd_time_now_ns();
    st = pd_model_forward(model, &batch, views, &meta, lidx, S, NULL, logits);
    if (st != PD_OK) {
        pd_log_error("profile run failed: %s", pd_status_str(st));
        goto out;
    }
    prof.forward_s = (double)(pd_time_now_ns() - tf) * 1e-9;
    prof.forward_seqs = S, prof.forward_seq_len = per_seq, prof.forward_tokens = T;
    prof.peak_activation_bytes = be->bytes_peak - be_before;
out:
    for (int32_t l = 0; views != NULL && l < mc->num_layers; l++) {
        be->ops->free(be, views[l].base);
    }
    free(views), free(ids), free(pos), free(slots), free(cu), free(lens), free(lidx), free(tables),
        free(logits);
    if (st != PD_OK) {
        return st;
    }
    /* RSS growth the backend did not allocate: BLAS buffers, thread stacks, libraries */
    size_t rss1 = pd_sys_rss(), be1 = be->bytes_in_use;
    size_t grew = rss1 > rss0 ? rss1 - rss0 : 0, be_grew = be1 > be0 ? be1 - be0 : 0;
    prof.non_allocator_bytes = grew > be_grew ? grew - be_grew : 0;
    size_t used = prof.weight_bytes + prof.peak_activation_bytes + prof.non_allocator_bytes;
    prof.available_bytes = prof.requested_bytes > used ? prof.requested_bytes - used : 0;
    prof.seconds = (double)(pd_time_now_ns() - t0) * 1e-9;
    pd_log_info(
        "memory profile: total %.2f GiB × %.2f = %.2f GiB requested; weights %.2f GiB, peak activations "
        "%.3f GiB, non-allocator %.3f GiB (%.2f s)",
        (double)prof.total_bytes / (1u << 30), p->memory_utilization,
        (double)prof.requested_bytes / (1u << 30), (double)prof.weight_bytes / (1u << 30),
        (double)prof.peak_activation_bytes / (1u << 30), (double)prof.non_allocator_bytes / (1u << 30),
        prof.seconds);
    *prof_out = prof;
    return PD_OK;
}

/* The bytes one block id costs with these layer specs: a plan with a huge budget, read back
 * (0 when the specs cannot be planned). */
static size_t specs_block_bytes(const pd_kv_spec_t *specs, int32_t num_layers, const pd_kv_init_params_t *p)
{
    pd_kv_cache_config_t *probe = malloc(sizeof(*probe));
    size_t per_block = 0;
    if (probe != NULL && pd_kv_cache_config_compute(specs, num_layers, (size_t)1 << 50, p->max_model_len,
                                                    p->max_num_batched_tokens, probe) == PD_OK) {
        per_block = probe->region_bytes / probe->num_blocks;
    }
    free(probe);
    return per_block;
}

pd_status_t pd_kv_cache_init(pd_model_t *model, pd_backend_t *be, const pd_kv_init_params_t *p,
                             pd_kv_cache_t **kv_out)
{
    const pd_model_config_t *mc = pd_model_config(model);
    if (p->memory_utilization <= 0 || p->memory_utilization > 1) {
        pd_log_error("--memory-utilization %.3f must be in (0, 1]", p->memory_utilization);
        return PD_ERR_INVALID_ARG;
    }
    pd_kv_cache_t *kv = calloc(1, sizeof(*kv));
    if (kv == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    kv->be = be;
    kv->allocator = p->allocator;
    pd_status_t st = pd_kv_specs_from_model(mc, p->block_size, p->cache_dtype, kv->specs);
    if (st == PD_OK && !(p->skip_profile && p->num_blocks_override > 0)) {
        st = pd_kv_profile_available(model, be, p, &kv->profile);
    }
    /* the bytes one block id costs, when the plan needs them */
    bool per_block_needed = p->num_blocks_override > 0 || p->companion_block_bytes > 0;
    size_t per_block = st == PD_OK && per_block_needed ? specs_block_bytes(kv->specs, mc->num_layers, p) : 0;
    if (st == PD_OK && per_block_needed && per_block == 0) {
        st = PD_ERR_INVALID_ARG;
    }
    if (st != PD_OK) {
        free(kv);
        return st;
    }
    if (!p->skip_profile) {
        pd_log_info("Available KV cache memory: %.2f GiB", (double)kv->profile.available_bytes / (1u << 30));
    }
    size_t plan_bytes = kv->profile.available_bytes;
    if (p->num_blocks_override > 0) {
        pd_log_info("overriding the profiled number of KV blocks with %u", p->num_blocks_override);
        plan_bytes = per_block * p->num_blocks_override;
    } else if (p->companion_block_bytes > 0) { /* the draft's pages take their share of every block */
        plan_bytes =
            (size_t)((double)plan_bytes * (double)per_block / (double)(per_block + p->companion_block_bytes));
        pd_log_info("KV cache memory for the target model: %.2f GiB (the draft model's pages take %.2f GiB)",
                    (double)plan_bytes / (1u << 30),
                    (double)(kv->profile.available_bytes - plan_bytes) / (1u << 30));
    }
    st = pd_kv_cache_config_compute(kv->specs, mc->num_layers, plan_bytes, p->max_model_len,
                                    p->max_num_batched_tokens, &kv->cfg);
    if (st != PD_OK) {
        free(kv);
        return st;
    }
    /* vLLM's numbers: tokens = blocks / groups × block size; concurrency from what one request of
     * max_model_len holds in every group (a sliding group: its window plus a step's chunk) */
    int32_t tokens = (int32_t)((int64_t)kv->cfg.num_blocks / kv->cfg.num_groups * kv->cfg.block_size);
    int32_t chunk =
        p->max_num_batched_tokens < p->max_model_len ? p->max_num_batched_tokens : p->max_model_len;
    int64_t per_req = pd_kv_cache_config_blocks_per_request(&kv->cfg, p->max_model_len, chunk);
    char layout[256];
    pd_kv_cache_config_layout(&kv->cfg, layout, sizeof(layout));
    pd_log_info("KV cache groups: %d (%s), %d tensors of %u blocks", kv->cfg.num_groups, layout,
                kv->cfg.num_tensors, kv->cfg.num_blocks);
    pd_log_info("KV cache size: %d tokens", tokens);
    pd_log_info("Maximum concurrency for %d tokens per request: %.2fx", p->max_model_len,
                (double)kv->cfg.num_blocks / (double)per_req);
    st = p->allocator != NULL ? p->allocator->alloc(p->allocator->ctx, kv->cfg.region_bytes, &kv->region)
                              : be->ops->alloc(be, kv->cfg.region_bytes, &kv->region);
    if (st != PD_OK) {
        pd_log_error("kv init: cannot allocate the %.2f GiB KV region",
                     (double)kv->cfg.region_bytes / (1u << 30));
        free(kv);
        return st;
    }
    kv->views = calloc((size_t)mc->num_layers, sizeof(pd_kv_view_t));
    if (kv->views == NULL) {
        pd_kv_cache_free(kv);
        return PD_ERR_NO_MEMORY;
    }
    /* bind in layer-index order; a shared layer gets its target's view */
    for (int32_t l = 0; l < mc->num_layers; l++) {
        const pd_kv_tensor_t *t = &kv->cfg.tensors[kv->cfg.layer_tensor[l]];
        kv->views[l] = (pd_kv_view_t){(char *)kv->region + t->offset,
                                      p->cache_dtype,
                                      (int32_t)kv->cfg.num_blocks,
                                      p->block_size,
                                      mc->num_kv_heads,
                                      mc->head_size};
    }
    *kv_out = kv;
    return PD_OK;
}

size_t pd_kv_block_bytes(const pd_model_config_t *mc, int32_t block_size, pd_dtype_t dtype,
                         int32_t max_model_len, int32_t max_num_batched_tokens)
{
    pd_kv_spec_t *specs = malloc(PD_MAX_LAYERS * sizeof(pd_kv_spec_t));
    pd_kv_init_params_t p = {.block_size = block_size,
                             .max_model_len = max_model_len,
                             .max_num_batched_tokens = max_num_batched_tokens};
    size_t per_block = specs != NULL && pd_kv_specs_from_model(mc, block_size, dtype, specs) == PD_OK
                           ? specs_block_bytes(specs, mc->num_layers, &p)
                           : 0;
    free(specs);
    return per_block;
}

void pd_kv_cache_free(pd_kv_cache_t *kv)
{
    if (kv == NULL) {
        return;
    }
    if (kv->region != NULL) {
        if (kv->allocator != NULL) {
            kv->allocator->free(kv->allocator->ctx, kv->region);
        } else {
            kv->be->ops->free(kv->be, kv->region);
        }
    }
    free(kv->views);
    free(kv);
}
