/* tests/fuzz/fuzz_safetensors.c — a .safetensors file as hostile input: its header is validated
 * (length, JSON, dtypes, shapes, offsets inside the data) and every tensor it admits is read end to
 * end, so an accepted header can never point outside the mapping. */
#define _GNU_SOURCE
#include <string.h>

#include "fuzz.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (4u << 20)) {
        return 0;
    }
    char *path = fuzz_to_file(data, size, ".safetensors");
    if (path == NULL) {
        return 0;
    }
    pd_st_file_t *f = NULL;
    if (pd_st_file_open(path, &f) == PD_OK) {
        volatile uint8_t sum = 0;
        for (int i = 0; i < pd_st_file_count(f); i++) {
            const pd_st_tensor_t *t = pd_st_file_tensor(f, i);
            const uint8_t *p = t->data;
            for (size_t k = 0; k < t->nbytes; k++) {
                sum ^= p[k];
            }
        }
        (void)sum;
        pd_st_file_close(f);
    }
    unlink(path);
    free(path);
    return 0;
}
