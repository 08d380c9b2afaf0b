/* model/fingerprint.c — what identifies a model's weights, for engines that must agree on them
 * (the KV connector compares it; it does not read model files itself). */
#include <stdio.h>
#include <string.h>

#include "common/hash.h"
#include "common/log.h"
#include "model/model.h"
#include "model/safetensors.h"

pd_status_t pd_model_fingerprint(const char *model_dir, char *buf, size_t cap)
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
    snprintf(buf, cap, "%s:%016llx", model_type, (unsigned long long)h);
    return PD_OK;
}
