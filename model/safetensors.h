/* model/safetensors.h — safetensors files: mmap'd, every header field bounds-checked; a set of
 * shards addressed by tensor name; and a writer (used by pd-mkmodel and tests).
 * Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
 * then the data area; offsets are relative to the data area. */
#ifndef PD_MODEL_SAFETENSORS_H
#define PD_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strmap.h"
#include "kernels/dtype_impl.h"

#define PD_ST_MAX_DIMS   8
#define PD_ST_MAX_HEADER (100u << 20) /* the format's own limit on the JSON header */

typedef struct pd_st_tensor {
    const char *name;
    pd_dtype_t dtype;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    int64_t numel;
    const void *data; /* inside the mapping; valid until the file is closed */
    size_t nbytes;
} pd_st_tensor_t;

typedef struct pd_st_file pd_st_file_t;

/* Maps path and validates its header: header length within the file, JSON object, known dtypes
 * (F32, F16, BF16), shapes non-negative without overflow, data_offsets ordered, inside the data
 * area and equal to numel × dtype size. PD_ERR_PARSE (logged with the tensor name) on any
 * violation, PD_ERR_IO/NOT_FOUND when unreadable. The caller closes *file_out. */
pd_status_t pd_st_file_open(const char *path, pd_st_file_t **file_out);
void pd_st_file_close(pd_st_file_t *file);
int pd_st_file_count(const pd_st_file_t *file);
const pd_st_tensor_t *pd_st_file_tensor(const pd_st_file_t *file, int i);

/* All tensors of a model directory: model.safetensors, or the shards that
 * model.safetensors.index.json names (its weight_map is checked against the shards' contents). */
typedef struct pd_st_set {
    pd_st_file_t **files;
    int num_files;
    pd_strmap_t by_name; /* name → (file index << 32 | tensor index) */
} pd_st_set_t;

/* Opens the weights of model directory dir. PD_ERR_NOT_FOUND when neither form exists. */
pd_status_t pd_st_set_open_dir(const char *dir, pd_st_set_t *set);
void pd_st_set_close(pd_st_set_t *set);

/* Finds a tensor by exact name; NULL when absent. */
const pd_st_tensor_t *pd_st_set_find(const pd_st_set_t *set, const char *name);

/* A tensor to write: data holds numel × dtype-size bytes. */
typedef struct pd_st_write_tensor {
    const char *name;
    pd_dtype_t dtype;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    const void *data;
} pd_st_write_tensor_t;

/* Writes tensors[n] to path as one safetensors file (offsets in the order given, 8-byte aligned
 * header). PD_ERR_IO when the file cannot be written. */
pd_status_t pd_st_write(const char *path, const pd_st_write_tensor_t *tensors, int n);

/* "F32"/"F16"/"BF16" ↔ dtype; returns -1 for names this build does not load. */
int pd_st_dtype_parse(const char *s);
const char *pd_st_dtype_name(pd_dtype_t dt);

#endif
