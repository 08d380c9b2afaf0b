/* connector/fingerprint.c — what two engines must share to exchange KV pages. */
#include <stdio.h>
#include <string.h>

#include "common/hash.h"
#include "common/log.h"
#include "connector/kv_connector.h"
#include "model/safetensors.h"
#include "pipe/control.h"

pd_status_t pd_kv_fingerprint(const char *model_dir, const char *kv_dtype, int32_t block_size,
                              int32_t num_kv_heads, int32_t head_size, int32_t num_layers,
                              Pd__Fingerprint *fp, char *model_buf, size_t model_buf_len)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", model_dir);
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        pd_log_error("fingerprint: cannot read %s", path);
        return PD_ERR_IO;
    }
    char cfg[65536];
    size_t n = fread(cfg, 1, sizeof(cfg), f);
    fclose(f);
    uint64_t h = pd_hash64(cfg, n, 0x7064);
    char model_type[64] = "model";
    const char *mt = strstr(cfg, "\"model_type\"");
    if (mt != NULL) {
        sscanf(mt, "\"model_type\"%*[ \t:]\"%63[^\"]", model_type);
    }
    pd_st_set_t set;
    pd_status_t st = pd_st_set_open_dir(model_dir, &set);
    if (st != PD_OK) {
        return st;
    }
    /* tensors in file order: name, dtype, shape and the first and last 4 KiB of data */
    for (int fi = 0; fi < set.num_files; fi++) {
        for (int i = 0; i < pd_st_file_count(set.files[fi]); i++) {
            const pd_st_tensor_t *t = pd_st_file_tensor(set.files[fi], i);
            h = pd_hash64(t->name, strlen(t->name), h);
            h = pd_hash64(&t->dtype, sizeof(t->dtype), h);
            h = pd_hash64(t->shape, (size_t)t->ndim * sizeof(int64_t), h);
            size_t w = t->nbytes < 4096 ? t->nbytes : 4096;
            h = pd_hash64(t->data, w, h);
            h = pd_hash64((const char *)t->data + t->nbytes - w, w, h);
        }
    }
    pd_st_set_close(&set);
    snprintf(model_buf, model_buf_len, "%s:%016llx", model_type, (unsigned long long)h);
    Pd__Fingerprint init = PD__FINGERPRINT__INIT;
    *fp = init;
    fp->model = model_buf;
    fp->kv_dtype = (char *)kv_dtype;
    fp->block_size = (uint32_t)block_size;
    fp->layout = (char *)"NB2BSHD";
    fp->num_kv_heads = (uint32_t)num_kv_heads;
    fp->head_size = (uint32_t)head_size;
    fp->num_layers = (uint32_t)num_layers;
    fp->protocol_version = PD_PROTOCOL_VERSION;
    return PD_OK;
}
