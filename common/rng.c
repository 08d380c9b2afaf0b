/* common/rng.c — xoshiro256** (Blackman & Vigna), seeded by splitmix64. */
#include "common/rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void pd_rng_seed(pd_rng_t *rng, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) {
        rng->s[i] = splitmix64(&x);
    }
}

void pd_rng_seed_stream(pd_rng_t *rng, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed;
    uint64_t y = splitmix64(&x) ^ (stream * 0xd1b54a32d192ed03ull); /* an odd multiplier: streams apart */
    for (int i = 0; i < 4; i++) {
        rng->s[i] = splitmix64(&y);
    }
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t pd_rng_next(pd_rng_t *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double pd_rng_uniform(pd_rng_t *rng)
{
    return (double)(pd_rng_next(rng) >> 11) * 0x1.0p-53;
}

float pd_rng_uniform_f(pd_rng_t *rng, float lo, float hi)
{
    return lo + (hi - lo) * (float)pd_rng_uniform(rng);
}

double pd_rng_normal(pd_rng_t *rng)
{
    double u1 = pd_rng_uniform(rng);
    double u2 = pd_rng_uniform(rng);
    if (u1 < 1e-300) {
        u1 = 1e-300;
    }
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t pd_rng_below(pd_rng_t *rng, uint64_t n)
{
    /* rejection sampling removes modulo bias */
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do {
        x = pd_rng_next(rng);
    } while (x >= limit);
    return x % n;
}
