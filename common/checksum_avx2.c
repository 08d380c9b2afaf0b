/* common/checksum_avx2.c — the AVX2 build of the checksum (compiled with -mavx2). */
#define PD_CHECKSUM_FN pd_checksum64_avx2
#include "common/checksum_impl.h"
