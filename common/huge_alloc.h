/* common/huge_alloc.h — big buffers on transparent huge pages.
 *
 * A KV pool, a host offload tier or a model's weights is read a 4 KiB page at a time in no
 * particular order (a block's page in each of the pool's tensors; block tables). On 4 KiB pages
 * every such page costs a TLB miss, and a page walk; on 2 MiB pages one entry covers 512 of them.
 * The kernel's THP mode is often "madvise" (Debian's default), so the buffer must ask. */
#ifndef PD_COMMON_HUGE_ALLOC_H
#define PD_COMMON_HUGE_ALLOC_H

#include <stddef.h>

#define PD_HUGE_PAGE ((size_t)2 << 20)

/* Allocates bytes, to be freed with free(). From PD_HUGE_PAGE bytes up the buffer is 2 MiB-aligned
 * and advised MADV_HUGEPAGE; a smaller one is aligned to small_align (a power of two, at least
 * sizeof(void *)). NULL when out of memory (nothing logged). */
void *pd_huge_alloc(size_t bytes, size_t small_align);

#endif
