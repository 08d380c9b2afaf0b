/* common/sampling.h — per-sequence sampling parameters (vLLM semantics), shared by the request
 * type (scheduler/) and the sampling op (kernels/). */
#ifndef PD_COMMON_SAMPLING_H
#define PD_COMMON_SAMPLING_H

#include <stdint.h>

typedef struct pd_sampling_params {
    float temperature; /* 0 = greedy (argmax, lowest id on ties) */
    int32_t top_k;     /* <= 0 = off */
    float top_p;       /* >= 1 = off */
    float min_p;       /* keep tokens with p >= min_p * p_max after temperature; 0 = off */
} pd_sampling_params_t;

/* A temperature below this is greedy: argmax, no draw from the request's generator (every sampler
 * and the speculative verifier agree on it). */
#define PD_SAMPLING_EPS 1e-5f

#endif
