/* common/hash.h — xxHash wrappers: 64-bit for tables and checksums, 128-bit for block hashes. */
#ifndef PD_COMMON_HASH_H
#define PD_COMMON_HASH_H

#include <stddef.h>
#include <stdint.h>

typedef struct pd_hash128 {
    uint64_t lo;
    uint64_t hi;
} pd_hash128_t;

/* XXH3-64 of len bytes at data (len may be 0). */
uint64_t pd_hash64(const void *data, size_t len, uint64_t seed);

/* XXH3-128 of len bytes at data. */
pd_hash128_t pd_hash128(const void *data, size_t len, uint64_t seed);

/* Chained block hash: XXH3-128 over (parent, tokens[n], extra[extra_len]); parent NULL for the
 * first block. Equal inputs give equal hashes on every node (byte order is little-endian). */
pd_hash128_t pd_hash128_chain(const pd_hash128_t *parent, const int32_t *tokens, size_t n, const void *extra,
                              size_t extra_len);

static inline int pd_hash128_eq(pd_hash128_t a, pd_hash128_t b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

#endif
