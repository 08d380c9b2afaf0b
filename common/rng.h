/* common/rng.h — small deterministic PRNG (xoshiro256**, seeded with splitmix64).
 * Same seed, same sequence, on every machine: used for seeded sampling and generated models. */
#ifndef PD_COMMON_RNG_H
#define PD_COMMON_RNG_H

#include <stdint.h>

typedef struct pd_rng {
    uint64_t s[4];
} pd_rng_t;

/* Seeds the generator; any seed (including 0) is valid. */
void pd_rng_seed(pd_rng_t *rng, uint64_t seed);

/* Seeds the generator from (seed, stream): distinct streams of one seed are independent sequences
 * (seeded sampling draws each output position from its own stream: scheduler/request.h). */
void pd_rng_seed_stream(pd_rng_t *rng, uint64_t seed, uint64_t stream);

/* Next 64 random bits. */
uint64_t pd_rng_next(pd_rng_t *rng);

/* Uniform double in [0, 1) with 53 random bits. */
double pd_rng_uniform(pd_rng_t *rng);

/* Uniform float in [lo, hi). */
float pd_rng_uniform_f(pd_rng_t *rng, float lo, float hi);

/* Standard normal (Box-Muller). */
double pd_rng_normal(pd_rng_t *rng);

/* Uniform integer in [0, n); n > 0. */
uint64_t pd_rng_below(pd_rng_t *rng, uint64_t n);

#endif
