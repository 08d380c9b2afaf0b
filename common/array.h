/* common/array.h — growing a heap array by doubling, with the failure checked once here.
 *
 *     uint32_t *ids = NULL; size_t n = 0, cap = 0;
 *     if (pd_array_reserve(&ids, &cap, n + 1) != PD_OK) return PD_ERR_NO_MEMORY;
 *     ids[n++] = id;
 */
#ifndef PD_COMMON_ARRAY_H
#define PD_COMMON_ARRAY_H

#include <stddef.h>

#include "common/status.h"

/* Makes *arr (elements of elem_size bytes, room for *cap of them) hold at least need elements:
 * grows to max(need, 2 × *cap, 8). On PD_ERR_NO_MEMORY (also when the size overflows) *arr and
 * *cap are unchanged and still valid. Never shrinks. */
pd_status_t pd_array_reserve_(void **arr, size_t elem_size, size_t *cap, size_t need);

/* Typed form: arr is a `T **`, cap a `size_t *`. */
#define pd_array_reserve(arr, cap, need) pd_array_reserve_((void **)(arr), sizeof(**(arr)), (cap), (need))

#endif
