/* kernels/registry.c — the backend registry (ggml-backend's device registry, small): every backend
 * this build has, in preference order, with how many devices it sees; pd_backend_create("auto")
 * takes the first that has one. Callers never include a backend's own header. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_ops.h"
#ifdef PD_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

typedef struct backend_entry {
    const char *name;
    int (*device_count)(void);
    pd_status_t (*init)(pd_backend_t *be, int num_threads);
    void (*fini)(pd_backend_t *be); /* NULL: nothing beyond freeing the object */
} backend_entry_t;

static int one_device(void)
{
    return 1;
}

static pd_status_t cpu_init(pd_backend_t *be, int num_threads)
{
    return pd_cpu_backend_init(be, num_threads, false);
}

static pd_status_t cpu_ref_init(pd_backend_t *be, int num_threads)
{
    return pd_cpu_backend_init(be, num_threads, true);
}

#ifdef PD_HAVE_CUDA
static pd_status_t cuda_init(pd_backend_t *be, int num_threads)
{
    (void)num_threads;
    be->num_threads = 1;
    return pd_cuda_backend_init(be, 0);
}
#endif

static const backend_entry_t REGISTRY[] = {
#ifdef PD_HAVE_CUDA
    {"cuda", pd_cuda_device_count, cuda_init, pd_cuda_backend_fini},
#endif
    {"cpu", one_device, cpu_init, pd_cpu_backend_fini},
    {"cpu-ref", one_device, cpu_ref_init, NULL},
};
#define NUM_BACKENDS (sizeof(REGISTRY) / sizeof(REGISTRY[0]))

static const backend_entry_t *find(const char *name)
{
    for (size_t i = 0; i < NUM_BACKENDS; i++) {
        if (strcmp(REGISTRY[i].name, name) == 0) {
            return &REGISTRY[i];
        }
    }
    return NULL;
}

int pd_backend_device_count(const char *name)
{
    const backend_entry_t *e = find(name);
    return e != NULL ? e->device_count() : 0;
}

const char *pd_backend_resolve(const char *name)
{
    if (strcmp(name, "auto") != 0) {
        return name;
    }
    for (size_t i = 0; i < NUM_BACKENDS; i++) {
        if (REGISTRY[i].device_count() > 0) {
            return REGISTRY[i].name;
        }
    }
    return "cpu";
}

pd_status_t pd_backend_create(const char *name, int num_threads, pd_backend_t **be_out)
{
    const backend_entry_t *e = find(pd_backend_resolve(name));
    if (e == NULL) {
        char have[128] = "";
        for (size_t i = 0; i < NUM_BACKENDS; i++) {
            strncat(have, i > 0 ? ", " : "", sizeof(have) - strlen(have) - 1);
            strncat(have, REGISTRY[i].name, sizeof(have) - strlen(have) - 1);
        }
        pd_log_error("unknown backend '%s' (this build has: auto, %s)", name, have);
        return PD_ERR_NOT_FOUND;
    }
    pd_backend_t *be = calloc(1, sizeof(*be));
    if (be == NULL) {
        pd_log_error("cannot allocate the backend object");
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = e->init(be, num_threads);
    if (st != PD_OK) {
        free(be);
        return st;
    }
    *be_out = be;
    return PD_OK;
}

void pd_backend_destroy(pd_backend_t *be)
{
    if (be == NULL) {
        return;
    }
    for (size_t i = 0; i < NUM_BACKENDS; i++) {
        if (REGISTRY[i].fini != NULL && be->ops != NULL && strcmp(be->ops->name, REGISTRY[i].name) == 0) {
            REGISTRY[i].fini(be);
        }
    }
    free(be);
}
