/* common/array.c — see array.h. */
#include "common/array.h"

#include <stdint.h>
#include <stdlib.h>

pd_status_t pd_array_reserve_(void **arr, size_t elem_size, size_t *cap, size_t need)
{
    if (need <= *cap) {
        return PD_OK;
    }
    size_t c = *cap > SIZE_MAX / 2 ? SIZE_MAX : *cap * 2;
    c = c < 8 ? 8 : c;
    c = c < need ? need : c;
    if (elem_size != 0 && c > SIZE_MAX / elem_size) {
        return PD_ERR_NO_MEMORY;
    }
    void *a = realloc(*arr, c * elem_size);
    if (a == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    *arr = a;
    *cap = c;
    return PD_OK;
}
