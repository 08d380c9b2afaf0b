/* common/hash.c — xxHash wrappers. */
#include "common/hash.h"

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

uint64_t pd_hash64(const void *data, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(data, len, seed);
}

pd_hash128_t pd_hash128(const void *data, size_t len, uint64_t seed)
{
    XXH128_hash_t h = XXH3_128bits_withSeed(data, len, seed);
    pd_hash128_t out = {h.low64, h.high64};
    return out;
}

pd_hash128_t pd_hash128_chain(const pd_hash128_t *parent, const int32_t *tokens, size_t n, const void *extra,
                              size_t extra_len)
{
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    uint64_t p[2] = {0, 0};
    uint8_t has_parent = parent != NULL;
    if (has_parent) {
        p[0] = parent->lo;
        p[1] = parent->hi;
    }
    XXH3_128bits_update(&st, &has_parent, 1);
    XXH3_128bits_update(&st, p, sizeof(p));
    XXH3_128bits_update(&st, tokens, n * sizeof(int32_t));
    if (extra_len > 0) {
        XXH3_128bits_update(&st, extra, extra_len);
    }
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    pd_hash128_t out = {h.low64, h.high64};
    return out;
}
