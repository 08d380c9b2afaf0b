/* common/page_range.h — a run of bytes inside a region, the unit page copies are described in
 * (backends gather/scatter/copy them, the KV connector stages them). */
#ifndef PD_COMMON_PAGE_RANGE_H
#define PD_COMMON_PAGE_RANGE_H

#include <stdint.h>

/* A run of bytes to gather from / scatter into a region: (region offset, length). */
typedef struct pd_page_range {
    uint64_t offset;
    uint64_t length;
} pd_page_range_t;

#endif
