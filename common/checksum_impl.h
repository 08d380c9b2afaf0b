/* common/checksum_impl.h — one checksum variant: included by a file compiled for its ISA (-mavx2,
 * -mavx512f), which defines PD_CHECKSUM_FN to the variant's name. xxHash inlined, so XXH3 takes the
 * widest vector code the compiler may use there. */
#define XXH_INLINE_ALL
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

uint64_t PD_CHECKSUM_FN(const void *data, size_t len, uint64_t seed);

uint64_t PD_CHECKSUM_FN(const void *data, size_t len, uint64_t seed)
{
    return XXH3_64bits_withSeed(data, len, seed);
}
