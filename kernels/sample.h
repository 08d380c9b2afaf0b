/* kernels/sample.h — the sampling op's distribution on host logits, for callers that need more than
 * one draw from it (the speculative verifier's rejection sampling, engine/spec_verify.c). These are
 * the pieces pd_cpu_sample is made of (kernels/cpu/sample.c), so a draw through them equals the
 * op's draw with the same u; the CUDA backend samples host logits with the CPU op too. */
#ifndef PD_KERNELS_SAMPLE_H
#define PD_KERNELS_SAMPLE_H

#include <stdint.h>

#include "common/sampling.h"

typedef struct pd_sample_cand {
    float z; /* a logit / temperature while sorting, then the unnormalised probability */
    int32_t id;
} pd_sample_cand_t;

/* The greedy token of a row: the argmax, lowest id on ties (temperature < 1e-5 rows). */
int32_t pd_sample_argmax(const float *logits, int vocab);

/* The distribution one non-greedy row is drawn from (temperature, top-k, min-p, top-p applied):
 * writes the kept tokens to c[0, n) in ascending id order with their unnormalised probabilities,
 * their sum to *total, and returns n (>= 1). c has room for vocab entries. */
int pd_sample_dist(const float *logits, int vocab, const pd_sampling_params_t *p, pd_sample_cand_t *c,
                   double *total);

/* The op's draw from such a distribution with u in [0, 1): the first token, in ascending id order,
 * whose cumulative mass exceeds u × total. */
int32_t pd_sample_draw(const pd_sample_cand_t *c, int n, double total, double u);

#endif
