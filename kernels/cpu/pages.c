/* kernels/cpu/pages.c — gather/scatter of page ranges between a KV region and a staging buffer. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

pd_status_t pd_cpu_gather_pages_ref(pd_backend_t *be, void *dst, const void *region,
                                    const pd_page_range_t *ranges, int n)
{
    char *d = dst;
    for (int i = 0; i < n; i++) {
        memcpy(d, (const char *)region + ranges[i].offset, ranges[i].length);
        d += ranges[i].length;
    }
    return PD_OK;
}

pd_status_t pd_cpu_scatter_pages_ref(pd_backend_t *be, void *region, const void *src,
                                     const pd_page_range_t *ranges, int n)
{
    const char *s = src;
    for (int i = 0; i < n; i++) {
        memcpy((char *)region + ranges[i].offset, s, ranges[i].length);
        s += ranges[i].length;
    }
    return PD_OK;
}

/* Ranges are independent; threads split them (memcpy of a page is already bandwidth bound). */
pd_status_t pd_cpu_gather_pages(pd_backend_t *be, void *dst, const void *region,
                                const pd_page_range_t *ranges, int n)
{
    if (n < 64) {
        return pd_cpu_gather_pages_ref(be, dst, region, ranges, n);
    }
    uint64_t *dst_off = malloc((size_t)n * sizeof(uint64_t));
    if (dst_off == NULL) {
        return pd_cpu_gather_pages_ref(be, dst, region, ranges, n);
    }
    uint64_t acc = 0;
    for (int i = 0; i < n; i++) {
        dst_off[i] = acc;
        acc += ranges[i].length;
    }
#pragma omp parallel for num_threads(be->num_threads) schedule(static)
    for (int i = 0; i < n; i++) {
        memcpy((char *)dst + dst_off[i], (const char *)region + ranges[i].offset, ranges[i].length);
    }
    free(dst_off);
    return PD_OK;
}

pd_status_t pd_cpu_scatter_pages(pd_backend_t *be, void *region, const void *src,
                                 const pd_page_range_t *ranges, int n)
{
    if (n < 64) {
        return pd_cpu_scatter_pages_ref(be, region, src, ranges, n);
    }
    uint64_t *src_off = malloc((size_t)n * sizeof(uint64_t));
    if (src_off == NULL) {
        return pd_cpu_scatter_pages_ref(be, region, src, ranges, n);
    }
    uint64_t acc = 0;
    for (int i = 0; i < n; i++) {
        src_off[i] = acc;
        acc += ranges[i].length;
    }
#pragma omp parallel for num_threads(be->num_threads) schedule(static)
    for (int i = 0; i < n; i++) {
        memcpy((char *)region + ranges[i].offset, (const char *)src + src_off[i], ranges[i].length);
    }
    free(src_off);
    return PD_OK;
}

pd_status_t pd_cpu_copy_pages(pd_backend_t *be, void *dst, const void *src, const pd_page_range_t *ranges,
                              int n, pd_copy_kind_t kind)
{
    (void)kind;
#pragma omp parallel for num_threads(n >= 64 ? be->num_threads : 1) schedule(static)
    for (int i = 0; i < n; i++) {
        memcpy((char *)dst + ranges[i].offset, (const char *)src + ranges[i].offset, ranges[i].length);
    }
    return PD_OK;
}
