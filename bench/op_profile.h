/* bench/op_profile.h — wall time per backend op (pd-bench-ops --op-profile): the backend's function
 * table is swapped for a copy whose ops time the real ones, so a decode step's time splits into
 * matmuls (by shape), attention, norms and the rest, and what is left outside the ops (the
 * caller's own serial work) shows as the difference. perf is no help for that on the 2-core KVM
 * guests: sampling there halved the throughput and put each OpenMP region's work on one thread.
 *
 * The timers are process globals written by the thread that calls the ops (one model at a time,
 * as pd-bench-ops runs it); an op's time includes its OpenMP fork, join and imbalance. */
#ifndef PD_BENCH_OP_PROFILE_H
#define PD_BENCH_OP_PROFILE_H

#include "kernels/backend.h"

/* Points be->ops at the timing copy of its table (idempotent). pd_op_profile_detach restores the
 * original; both leave the counters as they are. */
void pd_op_profile_attach(pd_backend_t *be);
void pd_op_profile_detach(pd_backend_t *be);

/* Zeroes every counter. */
void pd_op_profile_reset(void);

/* Prints, for what ran since the last reset over `steps` steps that took `total_s` seconds in
 * all, each op's (and each matmul shape's) calls and microseconds per step and its share of the
 * step, largest first, and the time outside the ops. */
void pd_op_profile_print(const char *title, double total_s, int steps);

#endif
