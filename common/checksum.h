/* common/checksum.h — XXH3-64 over bulk data with the widest vector unit the CPU has: the KV offload
 * tier checksums every block it writes and loads, and the library's portable build (SSE2, about
 * 19 GB/s here) cost as much as the copy itself; the AVX2 build runs at about 53 GB/s and AVX-512 at
 * 66 (in cache, an AMD EPYC). Every variant returns what pd_hash64 returns for the same input. */
#ifndef PD_COMMON_CHECKSUM_H
#define PD_COMMON_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*pd_checksum_fn)(const void *data, size_t len, uint64_t seed);

/* XXH3-64 of len bytes at data with seed, by the best variant this CPU runs (chosen once). */
uint64_t pd_checksum64(const void *data, size_t len, uint64_t seed);

/* The variant named "sse2" | "avx2" | "avx512", or NULL when this build or CPU cannot run it (tests
 * compare each against pd_hash64). */
pd_checksum_fn pd_checksum64_variant(const char *name);

/* The name of the variant pd_checksum64 uses. */
const char *pd_checksum64_name(void);

#endif
