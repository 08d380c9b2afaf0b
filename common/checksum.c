/* common/checksum.c — the portable checksum and the choice among the variants. */
#define PD_CHECKSUM_FN pd_checksum64_sse2
#include "common/checksum_impl.h"

#include <pthread.h>
#include <string.h>

#include "common/checksum.h"

#if defined(__x86_64__) && defined(PD_CHECKSUM_X86_VARIANTS)
uint64_t pd_checksum64_avx2(const void *data, size_t len, uint64_t seed);
uint64_t pd_checksum64_avx512(const void *data, size_t len, uint64_t seed);
#endif

static pd_checksum_fn g_fn = pd_checksum64_sse2;
static const char *g_name = "sse2";
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

pd_checksum_fn pd_checksum64_variant(const char *name)
{
    if (strcmp(name, "sse2") == 0) {
        return pd_checksum64_sse2;
    }
#if defined(__x86_64__) && defined(PD_CHECKSUM_X86_VARIANTS)
    __builtin_cpu_init();
    if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) {
        return pd_checksum64_avx2;
    }
    if (strcmp(name, "avx512") == 0 && __builtin_cpu_supports("avx512f")) {
        return pd_checksum64_avx512;
    }
#endif
    return NULL;
}

static void choose(void)
{
    static const char *order[] = {"avx512", "avx2"};
    for (int i = 0; i < 2; i++) {
        pd_checksum_fn f = pd_checksum64_variant(order[i]);
        if (f != NULL) {
            g_fn = f;
            g_name = order[i];
            return;
        }
    }
}

uint64_t pd_checksum64(const void *data, size_t len, uint64_t seed)
{
    pthread_once(&g_once, choose);
    return g_fn(data, len, seed);
}

const char *pd_checksum64_name(void)
{
    pthread_once(&g_once, choose);
    return g_name;
}
