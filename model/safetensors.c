/* model/safetensors.c — safetensors reader (mmap + bounds checks) and writer. */
#define _GNU_SOURCE
#include "model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"

struct pd_st_file {
    char *path;
    void *map;
    size_t size;
    json_t *header; /* owns the name strings */
    pd_st_tensor_t *tensors;
    int count;
};

int pd_st_dtype_parse(const char *s)
{
    if (strcmp(s, "F32") == 0) {
        return PD_DTYPE_F32;
    }
    if (strcmp(s, "F16") == 0) {
        return PD_DTYPE_F16;
    }
    if (strcmp(s, "BF16") == 0) {
        return PD_DTYPE_BF16;
    }
    return -1;
}

const char *pd_st_dtype_name(pd_dtype_t dt)
{
    return dt == PD_DTYPE_F32 ? "F32" : dt == PD_DTYPE_F16 ? "F16" : "BF16";
}

static pd_status_t st_parse_tensor(const char *path, const char *name, json_t *desc,
                                   const unsigned char *data, size_t data_len, pd_st_tensor_t *t)
{
    if (!json_is_object(desc)) {
        pd_log_error("%s: tensor '%s': descriptor is a %s, not an object", path, name,
                     pd_json_type_name(desc));
        return PD_ERR_PARSE;
    }
    json_t *dt = json_object_get(desc, "dtype");
    json_t *shape = json_object_get(desc, "shape");
    json_t *offs = json_object_get(desc, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs) || json_array_size(offs) != 2) {
        pd_log_error("%s: tensor '%s': needs string dtype, array shape and [begin, end] data_offsets", path,
                     name);
        return PD_ERR_PARSE;
    }
    int dtype = pd_st_dtype_parse(json_string_value(dt));
    if (dtype < 0) {
        pd_log_error("%s: tensor '%s': dtype %s is not supported (F32, F16, BF16)", path, name,
                     json_string_value(dt));
        return PD_ERR_PARSE;
    }
    size_t ndim = json_array_size(shape);
    if (ndim > PD_ST_MAX_DIMS) {
        pd_log_error("%s: tensor '%s': %zu dimensions, at most %d supported", path, name, ndim,
                     PD_ST_MAX_DIMS);
        return PD_ERR_PARSE;
    }
    int64_t numel = 1;
    for (size_t i = 0; i < ndim; i++) {
        json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0 ||
            (json_integer_value(d) > 0 && numel > INT64_MAX / 8 / json_integer_value(d))) {
            pd_log_error("%s: tensor '%s': shape[%zu] is not a valid dimension", path, name, i);
            return PD_ERR_PARSE;
        }
        t->shape[i] = json_integer_value(d);
        numel *= t->shape[i];
    }
    json_t *b = json_array_get(offs, 0), *e = json_array_get(offs, 1);
    if (!json_is_integer(b) || !json_is_integer(e)) {
        pd_log_error("%s: tensor '%s': data_offsets must be integers", path, name);
        return PD_ERR_PARSE;
    }
    json_int_t begin = json_integer_value(b), end = json_integer_value(e);
    if (begin < 0 || end < begin || (uint64_t)end > data_len) {
        pd_log_error("%s: tensor '%s': data_offsets [%lld, %lld] outside the %zu-byte data area", path, name,
                     (long long)begin, (long long)end, data_len);
        return PD_ERR_PARSE;
    }
    size_t want = (size_t)numel * (size_t)pd_dtype_size((pd_dtype_t)dtype);
    if ((size_t)(end - begin) != want) {
        pd_log_error("%s: tensor '%s': %lld bytes of data for a %s tensor of %lld elements (%zu bytes)", path,
                     name, (long long)(end - begin), json_string_value(dt), (long long)numel, want);
        return PD_ERR_PARSE;
    }
    t->name = name;
    t->dtype = (pd_dtype_t)dtype;
    t->ndim = (int)ndim;
    t->numel = numel;
    t->data = data + begin;
    t->nbytes = want;
    return PD_OK;
}

static int cmp_by_data(const void *a, const void *b)
{
    const pd_st_tensor_t *x = *(const pd_st_tensor_t *const *)a, *y = *(const pd_st_tensor_t *const *)b;
    uintptr_t p = (uintptr_t)x->data, q = (uintptr_t)y->data;
    return p < q ? -1 : p > q;
}

/* No two tensors share a byte (a file whose tensors overlap writes one weight through another, and
 * the safetensors format refuses it); empty tensors take no bytes. */
static pd_status_t st_check_overlaps(const char *path, const pd_st_file_t *f)
{
    size_t n = f->count > 0 ? (size_t)f->count : 0;
    const pd_st_tensor_t **by = malloc((n ? n : 1) * sizeof(*by));
    if (by == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < n; i++) {
        by[i] = &f->tensors[i];
    }
    qsort(by, n, sizeof(*by), cmp_by_data);
    pd_status_t st = PD_OK;
    const pd_st_tensor_t *prev = NULL;
    for (size_t i = 0; i < n && st == PD_OK; i++) {
        if (by[i]->nbytes == 0) {
            continue;
        }
        if (prev != NULL && (uintptr_t)prev->data + prev->nbytes > (uintptr_t)by[i]->data) {
            pd_log_error("%s: tensors '%s' and '%s' overlap in the data area", path, prev->name, by[i]->name);
            st = PD_ERR_PARSE;
        }
        prev = by[i];
    }
    free(by);
    return st;
}

pd_status_t pd_st_file_open(const char *path, pd_st_file_t **file_out)
{
    pd_status_t st = PD_OK;
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer (start-up hung); a regular file
     * ignores the flag */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        pd_log_error("cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? PD_ERR_NOT_FOUND : PD_ERR_IO;
    }
    pd_st_file_t *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        close(fd);
        return PD_ERR_NO_MEMORY;
    }
    f->path = strdup(path);
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        pd_log_error("cannot stat %s: %s", path, strerror(errno));
        st = PD_ERR_IO;
        goto err_close;
    }
    if (!S_ISREG(sb.st_mode)) {
        pd_log_error("%s is not a regular file (a FIFO, a device or a directory): not a safetensors file",
                     path);
        st = PD_ERR_PARSE;
        goto err_close;
    }
    f->size = (size_t)sb.st_size;
    if (f->size < 8) {
        pd_log_error("%s: %zu bytes is too short for a safetensors file (truncated?)", path, f->size);
        st = PD_ERR_PARSE;
        goto err_close;
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        pd_log_error("cannot mmap %s: %s", path, strerror(errno));
        st = PD_ERR_IO;
        goto err_close;
    }
    close(fd);
    fd = -1;
    const unsigned char *bytes = f->map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) {
        hlen = (hlen << 8) | bytes[i];
    }
    if (hlen > PD_ST_MAX_HEADER || hlen > f->size - 8) {
        pd_log_error("%s: header length %llu runs past the end of the %zu-byte file (truncated or not "
                     "safetensors)",
                     path, (unsigned long long)hlen, f->size);
        st = PD_ERR_PARSE;
        goto err_close;
    }
    st = pd_json_parse(path, (const char *)bytes + 8, (size_t)hlen, &f->header);
    if (st != PD_OK) {
        goto err_close;
    }
    if (!json_is_object(f->header)) {
        pd_log_error("%s: header is a %s, not an object", path, pd_json_type_name(f->header));
        st = PD_ERR_PARSE;
        goto err_close;
    }
    size_t n = json_object_size(f->header);
    f->tensors = calloc(n ? n : 1, sizeof(pd_st_tensor_t));
    if (f->tensors == NULL) {
        st = PD_ERR_NO_MEMORY;
        goto err_close;
    }
    const unsigned char *data = bytes + 8 + hlen;
    size_t data_len = f->size - 8 - (size_t)hlen;
    const char *key;
    json_t *val;
    json_object_foreach(f->header, key, val)
    {
        if (strcmp(key, "__metadata__") == 0) {
            continue;
        }
        st = st_parse_tensor(path, key, val, data, data_len, &f->tensors[f->count]);
        if (st != PD_OK) {
            goto err_close;
        }
        f->count++;
    }
    st = st_check_overlaps(path, f);
    if (st != PD_OK) {
        goto err_close;
    }
    *file_out = f;
    return PD_OK;

err_close:
    if (fd >= 0) {
        close(fd);
    }
    pd_st_file_close(f);
    return st;
}

void pd_st_file_close(pd_st_file_t *f)
{
    if (f == NULL) {
        return;
    }
    free(f->tensors);
    json_decref(f->header);
    if (f->map != NULL) {
        munmap(f->map, f->size);
    }
    free(f->path);
    free(f);
}

int pd_st_file_count(const pd_st_file_t *f)
{
    return f->count;
}

const pd_st_tensor_t *pd_st_file_tensor(const pd_st_file_t *f, int i)
{
    return i >= 0 && i < f->count ? &f->tensors[i] : NULL;
}

static pd_status_t st_set_add(pd_st_set_t *set, const char *path)
{
    pd_st_file_t **files = realloc(set->files, (size_t)(set->num_files + 1) * sizeof(*files));
    if (files == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    set->files = files;
    pd_st_file_t *f = NULL;
    pd_status_t st = pd_st_file_open(path, &f);
    if (st != PD_OK) {
        return st;
    }
    int fi = set->num_files++;
    set->files[fi] = f;
    for (int i = 0; i < f->count; i++) {
        const char *name = f->tensors[i].name;
        int64_t prev;
        if (pd_strmap_get(&set->by_name, name, strlen(name), &prev)) {
            pd_log_error("%s: tensor '%s' also appears in %s", path, name, set->files[prev >> 32]->path);
            return PD_ERR_PARSE;
        }
        st = pd_strmap_put(&set->by_name, name, strlen(name), ((int64_t)fi << 32) | i);
        if (st != PD_OK) {
            return st;
        }
    }
    return PD_OK;
}

pd_status_t pd_st_set_open_dir(const char *dir, pd_st_set_t *set)
{
    memset(set, 0, sizeof(*set));
    pd_status_t st = pd_strmap_init(&set->by_name, 1024);
    if (st != PD_OK) {
        return st;
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    if (access(path, F_OK) != 0) {
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        if (access(path, F_OK) != 0) {
            pd_log_error("%s: neither model.safetensors nor model.safetensors.index.json exists", dir);
            pd_st_set_close(set);
            return PD_ERR_NOT_FOUND;
        }
        st = st_set_add(set, path);
        if (st != PD_OK) {
            pd_st_set_close(set);
        }
        return st;
    }
    json_t *index = NULL;
    st = pd_json_load_file(path, 64u << 20, &index);
    if (st != PD_OK) {
        pd_st_set_close(set);
        return st;
    }
    json_t *map = json_object_get(index, "weight_map");
    if (!json_is_object(map)) {
        pd_log_error("%s: 'weight_map' is missing or not an object", path);
        st = PD_ERR_PARSE;
        goto out;
    }
    /* open each distinct shard once, in first-mention order */
    const char *name;
    json_t *file;
    pd_strmap_t shards;
    st = pd_strmap_init(&shards, 16);
    if (st != PD_OK) {
        goto out;
    }
    json_object_foreach(map, name, file)
    {
        if (!json_is_string(file) || strchr(json_string_value(file), '/') != NULL) {
            pd_log_error("%s: weight_map['%s'] must be a file name in the model directory", path, name);
            st = PD_ERR_PARSE;
            break;
        }
        const char *fname = json_string_value(file);
        int64_t seen;
        if (!pd_strmap_get(&shards, fname, strlen(fname), &seen)) {
            char shard[4096];
            snprintf(shard, sizeof(shard), "%s/%s", dir, fname);
            st = pd_strmap_put(&shards, fname, strlen(fname), 1);
            if (st == PD_OK) {
                st = st_set_add(set, shard);
            }
            if (st != PD_OK) {
                break;
            }
        }
    }
    pd_strmap_destroy(&shards);
    if (st == PD_OK) {
        json_object_foreach(map, name, file)
        {
            if (pd_st_set_find(set, name) == NULL) {
                pd_log_error("%s: weight_map names tensor '%s' but %s does not hold it", path, name,
                             json_string_value(file));
                st = PD_ERR_PARSE;
                break;
            }
        }
    }
out:
    json_decref(index);
    if (st != PD_OK) {
        pd_st_set_close(set);
    }
    return st;
}

void pd_st_set_close(pd_st_set_t *set)
{
    for (int i = 0; i < set->num_files; i++) {
        pd_st_file_close(set->files[i]);
    }
    free(set->files);
    set->files = NULL;
    set->num_files = 0;
    pd_strmap_destroy(&set->by_name);
}

const pd_st_tensor_t *pd_st_set_find(const pd_st_set_t *set, const char *name)
{
    int64_t v;
    if (!pd_strmap_get(&set->by_name, name, strlen(name), &v)) {
        return NULL;
    }
    return pd_st_file_tensor(set->files[v >> 32], (int)(v & 0xffffffff));
}

pd_status_t pd_st_write(const char *path, const pd_st_write_tensor_t *tensors, int n)
{
    json_t *hdr = json_object();
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const pd_st_write_tensor_t *t = &tensors[i];
        json_t *shape = json_array();
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            json_array_append_new(shape, json_integer(t->shape[d]));
            numel *= t->shape[d];
        }
        uint64_t bytes = (uint64_t)numel * (uint64_t)pd_dtype_size(t->dtype);
        json_object_set_new(hdr, t->name,
                            json_pack("{s:s, s:o, s:[I,I]}", "dtype", pd_st_dtype_name(t->dtype), "shape",
                                      shape, "data_offsets", (json_int_t)off, (json_int_t)(off + bytes)));
        off += bytes;
    }
    char *text = json_dumps(hdr, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(hdr);
    if (text == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t tlen = strlen(text);
    size_t padded = (tlen + 7) & ~(size_t)7; /* the data area starts 8-byte aligned */
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        pd_log_error("cannot create %s: %s", path, strerror(errno));
        free(text);
        return PD_ERR_IO;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) {
        len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    }
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(text, 1, tlen, f) == tlen;
    for (size_t i = tlen; ok && i < padded; i++) {
        ok = fputc(' ', f) != EOF;
    }
    for (int i = 0; ok && i < n; i++) {
        int64_t numel = 1;
        for (int d = 0; d < tensors[i].ndim; d++) {
            numel *= tensors[i].shape[d];
        }
        size_t bytes = (size_t)numel * (size_t)pd_dtype_size(tensors[i].dtype);
        ok = fwrite(tensors[i].data, 1, bytes, f) == bytes;
    }
    free(text);
    if (fclose(f) != 0 || !ok) {
        pd_log_error("short write on %s", path);
        return PD_ERR_IO;
    }
    return PD_OK;
}
