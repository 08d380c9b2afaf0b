/* common/checksum_avx512.c — the AVX-512 build of the checksum (compiled with -mavx512f). */
#define PD_CHECKSUM_FN pd_checksum64_avx512
#include "common/checksum_impl.h"
