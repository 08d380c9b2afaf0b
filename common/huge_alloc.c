/* common/huge_alloc.c — big buffers on transparent huge pages (see huge_alloc.h). */
#define _GNU_SOURCE
#include "common/huge_alloc.h"

#include <stdlib.h>
#include <sys/mman.h>

void *pd_huge_alloc(size_t bytes, size_t small_align)
{
    void *p = NULL;
    size_t align = bytes >= PD_HUGE_PAGE ? PD_HUGE_PAGE : small_align;
    if (posix_memalign(&p, align, bytes ? bytes : 1) != 0) {
        return NULL;
    }
#ifdef MADV_HUGEPAGE
    if (align == PD_HUGE_PAGE) { /* a refusal (THP off) leaves 4 KiB pages: still a buffer */
        (void)madvise(p, (bytes + PD_HUGE_PAGE - 1) & ~(PD_HUGE_PAGE - 1), MADV_HUGEPAGE);
    }
#endif
    return p;
}
