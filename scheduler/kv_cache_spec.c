/* scheduler/kv_cache_spec.c — specs → config. */
#include "scheduler/kv_cache_spec.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

size_t pd_kv_spec_page_bytes(const pd_kv_spec_t *s)
{
    if (s->kind == PD_KV_SHARED) {
        return 0;
    }
    size_t planes = s->kind == PD_KV_MLA ? 1 : 2;
    return planes * (size_t)s->block_size * (size_t)s->num_kv_heads * (size_t)s->head_size *
           (size_t)s->dtype_bytes;
}

/* The attention kind of an owning layer: its window (0 = sees every token: FULL and MLA). */
static int32_t spec_window(const pd_kv_spec_t *s)
{
    return s->kind == PD_KV_SLIDING_WINDOW ? s->sliding_window : 0;
}

/* Checks specs; *block_size_out is the one block size. */
static pd_status_t check_specs(const pd_kv_spec_t *specs, int32_t num_layers, int32_t *block_size_out)
{
    int32_t block_size = -1;
    for (int32_t l = 0; l < num_layers; l++) {
        const pd_kv_spec_t *s = &specs[l];
        if (s->kind == PD_KV_SHARED) {
            int32_t t = s->shared_with;
            if (t < 0 || t >= num_layers || t == l || specs[t].kind == PD_KV_SHARED) {
                pd_log_error(
                    "kv cache config: layer %d shares the cache of layer %d, which has none of its own", l,
                    t);
                return PD_ERR_INVALID_ARG;
            }
            continue;
        }
        if (s->block_size < 1 || s->num_kv_heads < 1 || s->head_size < 1 || s->dtype_bytes < 1 ||
            (s->kind == PD_KV_SLIDING_WINDOW && s->sliding_window < 1)) {
            pd_log_error("kv cache config: layer %d has an invalid spec", l);
            return PD_ERR_INVALID_ARG;
        }
        if (block_size >= 0 && s->block_size != block_size) {
            pd_log_error("kv cache config: layer %d uses block size %d, others %d; one block size per model",
                         l, s->block_size, block_size);
            return PD_ERR_INVALID_ARG;
        }
        block_size = s->block_size;
    }
    if (block_size < 0) {
        pd_log_error("kv cache config: no layer owns a cache");
        return PD_ERR_INVALID_ARG;
    }
    *block_size_out = block_size;
    return PD_OK;
}

/* Forms the groups of c from specs: one per distinct window, or (hybrid) chunks of group_size
 * layers of each kind in layer order. Returns group_size (0 when not hybrid), -1 on error. */
static int32_t form_groups(const pd_kv_spec_t *specs, int32_t num_layers, pd_kv_cache_config_t *c)
{
    int32_t windows[PD_MAX_LAYERS] = {0}, counts[PD_MAX_LAYERS] = {0}, nk = 0;
    size_t page = 0;
    bool one_page = true;
    for (int32_t l = 0; l < num_layers; l++) {
        if (specs[l].kind == PD_KV_SHARED) {
            continue;
        }
        size_t pb = pd_kv_spec_page_bytes(&specs[l]);
        one_page &= page == 0 || pb == page;
        page = pb;
        int32_t k = 0;
        while (k < nk && windows[k] != spec_window(&specs[l])) {
            k++;
        }
        if (k == nk) {
            windows[nk] = spec_window(&specs[l]), counts[nk++] = 0;
        }
        counts[k]++;
    }
    if (nk == 1) { /* one kind: one group of every owning layer */
        pd_kv_group_t *g = &c->groups[c->num_groups++];
        g->kind = windows[0] > 0 ? PD_KV_SLIDING_WINDOW : PD_KV_FULL;
        g->sliding_window = windows[0];
        for (int32_t l = 0; l < num_layers; l++) {
            if (specs[l].kind != PD_KV_SHARED) {
                c->layer_group[l] = 0;
                g->layers[g->num_layers++] = l;
            }
        }
        return 0;
    }
    if (!one_page) {
        pd_log_error("kv cache config: layers of different attention kinds need one page size");
        return -1;
    }
    int32_t lo = counts[0], hi = counts[0];
    for (int32_t k = 1; k < nk; k++) {
        lo = counts[k] < lo ? counts[k] : lo;
        hi = counts[k] > hi ? counts[k] : hi;
    }
    int32_t size = (int64_t)hi * 4 < (int64_t)lo * 5 ? hi : lo; /* vLLM: avoid padding when close */
    for (int32_t k = 0; k < nk; k++) {
        int32_t n = 0;
        for (int32_t l = 0; l < num_layers; l++) {
            if (specs[l].kind == PD_KV_SHARED || spec_window(&specs[l]) != windows[k]) {
                continue;
            }
            if (n++ % size == 0) {
                if (c->num_groups == PD_KV_MAX_GROUPS) {
                    pd_log_error("kv cache config: more than %d KV cache groups", PD_KV_MAX_GROUPS);
                    return -1;
                }
                pd_kv_group_t *g = &c->groups[c->num_groups++];
                g->kind = windows[k] > 0 ? PD_KV_SLIDING_WINDOW : PD_KV_FULL;
                g->sliding_window = windows[k];
            }
            pd_kv_group_t *g = &c->groups[c->num_groups - 1];
            c->layer_group[l] = c->num_groups - 1;
            g->layers[g->num_layers++] = l;
        }
    }
    return size;
}

/* Adds layer l to tensor t's users; false when the tensor has no room. */
static bool tensor_add_user(pd_kv_tensor_t *t, int32_t l)
{
    if (t->num_shared == (int32_t)(sizeof(t->shared_by) / sizeof(t->shared_by[0]))) {
        pd_log_error("kv cache config: too many layers share one KV tensor (layer %d)", l);
        return false;
    }
    t->shared_by[t->num_shared++] = l;
    return true;
}

int64_t pd_kv_cache_config_blocks_per_request(const pd_kv_cache_config_t *c, int32_t num_tokens,
                                              int32_t chunk)
{
    int64_t bs = c->block_size, full = ((int64_t)num_tokens + bs - 1) / bs, n = 0;
    for (int32_t g = 0; g < c->num_groups; g++) {
        int64_t w = c->groups[g].kind == PD_KV_SLIDING_WINDOW
                        ? ((int64_t)c->groups[g].sliding_window - 1 + chunk + bs - 1) / bs + 1
                        : full;
        n += w < full ? w : full;
    }
    return n;
}

void pd_kv_cache_config_layout(const pd_kv_cache_config_t *c, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "g%d:", c->num_groups > 0 ? c->groups[0].num_layers : 0);
    for (int32_t g = 0; g < c->num_groups && n < cap; g++) {
        int32_t run = 1;
        while (g + run < c->num_groups && c->groups[g + run].sliding_window == c->groups[g].sliding_window) {
            run++;
        }
        const char *sep = g > 0 ? "," : "";
        n += c->groups[g].sliding_window > 0
                 ? (size_t)snprintf(buf + n, cap - n, "%sswa%dx%d", sep, c->groups[g].sliding_window, run)
                 : (size_t)snprintf(buf + n, cap - n, "%sfullx%d", sep, run);
        g += run - 1;
    }
}

pd_status_t pd_kv_cache_config_compute(const pd_kv_spec_t *specs, int32_t num_layers, size_t available_bytes,
                                       int32_t max_model_len, int32_t max_chunk,
                                       pd_kv_cache_config_t *cfg_out)
{
    if (num_layers < 1 || num_layers > PD_MAX_LAYERS) {
        pd_log_error("kv cache config: %d layers (1 .. %d supported)", num_layers, PD_MAX_LAYERS);
        return PD_ERR_INVALID_ARG;
    }
    int32_t block_size;
    pd_status_t st = check_specs(specs, num_layers, &block_size);
    if (st != PD_OK) {
        return st;
    }
    pd_kv_cache_config_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    c->num_layers = num_layers;
    c->block_size = block_size;
    int32_t group_size = form_groups(specs, num_layers, c);
    if (group_size < 0) {
        free(c);
        return PD_ERR_INVALID_ARG;
    }
    /* bytes of one block id: every owning layer's page, or (hybrid) group_size shared pages */
    size_t bytes_per_block = 0;
    for (int32_t l = 0; l < num_layers; l++) {
        bytes_per_block += pd_kv_spec_page_bytes(&specs[l]);
    }
    if (group_size > 0) {
        bytes_per_block = (size_t)group_size * pd_kv_spec_page_bytes(&specs[c->groups[0].layers[0]]);
    }
    uint64_t blocks = available_bytes / bytes_per_block;
    uint64_t needed =
        (uint64_t)pd_kv_cache_config_blocks_per_request(
            c, max_model_len, max_chunk > 0 && max_chunk < max_model_len ? max_chunk : max_model_len) +
        1;
    if (blocks < needed) {
        pd_log_error(
            "kv cache config: %.3f GiB holds %llu blocks of %zu bytes (all layers), but one request of "
            "%d tokens needs %llu; lower --max-model-len or give the cache more memory",
            (double)available_bytes / (1u << 30), (unsigned long long)blocks, bytes_per_block, max_model_len,
            (unsigned long long)needed);
        free(c);
        return PD_ERR_NO_SPACE;
    }
    if (blocks > (1u << 30)) {
        blocks = 1u << 30;
    }
    c->num_blocks = (uint32_t)blocks;
    /* tensors: one per owning layer, or (hybrid) group_size shared by the j-th layer of each group */
    size_t offset = 0;
    int32_t ntensors = group_size > 0 ? group_size : 0;
    for (int32_t j = 0; j < ntensors; j++) {
        pd_kv_tensor_t *t = &c->tensors[c->num_tensors++];
        t->page_bytes = pd_kv_spec_page_bytes(&specs[c->groups[0].layers[0]]);
        t->size = t->page_bytes * c->num_blocks;
        t->offset = offset;
        offset += t->size;
    }
    for (int32_t l = 0; l < num_layers; l++) {
        if (specs[l].kind == PD_KV_SHARED) {
            continue;
        }
        int32_t ti;
        if (group_size > 0) {
            const pd_kv_group_t *g = &c->groups[c->layer_group[l]];
            ti = 0;
            while (g->layers[ti] != l) {
                ti++;
            }
        } else {
            pd_kv_tensor_t *t = &c->tensors[c->num_tensors];
            t->page_bytes = pd_kv_spec_page_bytes(&specs[l]);
            t->size = t->page_bytes * c->num_blocks;
            t->offset = offset;
            offset += t->size;
            ti = c->num_tensors++;
        }
        if (!tensor_add_user(&c->tensors[ti], l)) {
            free(c);
            return PD_ERR_INVALID_ARG;
        }
        c->layer_tensor[l] = ti;
    }
    for (int32_t l = 0; l < num_layers; l++) { /* a shared layer: its target's tensor and group */
        if (specs[l].kind != PD_KV_SHARED) {
            continue;
        }
        int32_t ti = c->layer_tensor[specs[l].shared_with];
        if (!tensor_add_user(&c->tensors[ti], l)) {
            free(c);
            return PD_ERR_INVALID_ARG;
        }
        c->layer_tensor[l] = ti;
        c->layer_group[l] = c->layer_group[specs[l].shared_with];
    }
    c->region_bytes = offset;
    *cfg_out = *c;
    free(c);
    return PD_OK;
}
