/* common/time.h — monotonic clock helpers. */
#ifndef PD_COMMON_TIME_H
#define PD_COMMON_TIME_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on CLOCK_MONOTONIC; only differences are meaningful. */
static inline uint64_t pd_time_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Seconds (double) on CLOCK_MONOTONIC. */
static inline double pd_time_now_s(void)
{
    return (double)pd_time_now_ns() * 1e-9;
}

#endif
