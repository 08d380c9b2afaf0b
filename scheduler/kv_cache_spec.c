/* scheduler/kv_cache_spec.c — specs → config. */
#include "scheduler/kv_cache_spec.h"

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

pd_status_t pd_kv_cache_config_compute(const pd_kv_spec_t *specs, int32_t num_layers, size_t available_bytes,
                                       int32_t max_model_len, pd_kv_cache_config_t *cfg_out)
{
    if (num_layers < 1 || num_layers > PD_KV_MAX_LAYERS) {
        pd_log_error("kv cache config: %d layers (1 .. %d supported)", num_layers, PD_KV_MAX_LAYERS);
        return PD_ERR_INVALID_ARG;
    }
    int32_t block_size = -1;
    size_t bytes_per_block = 0; /* all owning layers' pages of one block id */
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
        bytes_per_block += pd_kv_spec_page_bytes(s);
    }
    if (block_size < 0) {
        pd_log_error("kv cache config: no layer owns a cache");
        return PD_ERR_INVALID_ARG;
    }
    pd_kv_cache_config_t c;
    memset(&c, 0, sizeof(c));
    c.num_layers = num_layers;
    c.block_size = block_size;
    uint64_t blocks = available_bytes / bytes_per_block;
    uint64_t needed =
        (uint64_t)(max_model_len + block_size - 1) / (uint64_t)block_size + 1; /* + null block */
    if (blocks < needed) {
        pd_log_error(
            "kv cache config: %.3f GiB holds %llu blocks of %zu bytes (all layers), but one request of "
            "%d tokens needs %llu; lower --max-model-len or give the cache more memory",
            (double)available_bytes / (1u << 30), (unsigned long long)blocks, bytes_per_block, max_model_len,
            (unsigned long long)needed);
        return PD_ERR_NO_SPACE;
    }
    if (blocks > (1u << 30)) {
        blocks = 1u << 30;
    }
    c.num_blocks = (uint32_t)blocks;
    size_t offset = 0;
    for (int32_t l = 0; l < num_layers; l++) {
        if (specs[l].kind == PD_KV_SHARED) {
            continue;
        }
        pd_kv_tensor_t *t = &c.tensors[c.num_tensors];
        t->page_bytes = pd_kv_spec_page_bytes(&specs[l]);
        t->size = t->page_bytes * c.num_blocks;
        t->offset = offset;
        t->shared_by[t->num_shared++] = l;
        offset += t->size;
        c.layer_tensor[l] = c.num_tensors++;
        int32_t g = 0;
        while (g < c.num_groups && c.groups[g].page_bytes != t->page_bytes) {
            g++;
        }
        if (g == c.num_groups) {
            if (c.num_groups == 8) {
                pd_log_error("kv cache config: more than 8 distinct page sizes");
                return PD_ERR_INVALID_ARG;
            }
            c.groups[c.num_groups++].page_bytes = t->page_bytes;
        }
        c.groups[g].layers[c.groups[g].num_layers++] = l;
    }
    for (int32_t l = 0; l < num_layers; l++) {
        if (specs[l].kind != PD_KV_SHARED) {
            continue;
        }
        int32_t ti = c.layer_tensor[specs[l].shared_with];
        pd_kv_tensor_t *t = &c.tensors[ti];
        if (t->num_shared == 8) {
            pd_log_error("kv cache config: more than 7 layers share layer %d's cache", specs[l].shared_with);
            return PD_ERR_INVALID_ARG;
        }
        t->shared_by[t->num_shared++] = l;
        c.layer_tensor[l] = ti;
    }
    c.region_bytes = offset;
    *cfg_out = c;
    return PD_OK;
}
