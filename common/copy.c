/* common/copy.c — the streaming copy (see copy.h). The plain reference is memcpy; tests compare
 * the two over every alignment and length class. */
#include "common/copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

/* Bytes below this go through memcpy: the head/tail handling would cost more than it saves. */
#define STREAM_SMALL 256

/* dst 32-byte aligned, n a multiple of 128. */
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}

/* dst 32-byte aligned, n a multiple of 128 (the same contract as stream_avx2). */
static void stream_sse2(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

enum { K_UNSET = -1, K_MEMCPY, K_SSE2, K_AVX2 };
static int g_kind = K_UNSET; /* atomic; every thread that races to set it computes the same value */

static int kind(void)
{
    int v = __atomic_load_n(&g_kind, __ATOMIC_RELAXED);
    if (v == K_UNSET) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") ? K_AVX2 : K_SSE2;
        __atomic_store_n(&g_kind, v, __ATOMIC_RELAXED);
    }
    return v;
}

void pd_copy_stream(void *dst, const void *src, size_t n)
{
    char *d = dst;
    const char *s = src;
    int k = kind();
    if (n < STREAM_SMALL || k == K_MEMCPY) {
        memcpy(d, s, n);
        return;
    }
    size_t head = (32 - ((uintptr_t)d & 31)) & 31; /* up to dst's first 32-byte boundary */
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)127;
    if (k == K_AVX2) {
        stream_avx2(d, s, body);
    } else {
        stream_sse2(d, s, body);
    }
    memcpy(d + body, s + body, n - body);
    _mm_sfence(); /* streaming stores are weakly ordered: order them before what follows */
}

const char *pd_copy_stream_kind(void)
{
    static const char *names[] = {"memcpy", "sse2", "avx2"};
    return names[kind()];
}

int pd_copy_stream_select(const char *name)
{
    int v = strcmp(name, "memcpy") == 0 ? K_MEMCPY : strcmp(name, "sse2") == 0 ? K_SSE2 : K_UNSET;
    if (strcmp(name, "avx2") == 0) {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx2")) {
            return -1;
        }
        v = K_AVX2;
    }
    if (v == K_UNSET) {
        return -1;
    }
    __atomic_store_n(&g_kind, v, __ATOMIC_RELAXED);
    return 0;
}

#else

void pd_copy_stream(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
}

const char *pd_copy_stream_kind(void)
{
    return "memcpy";
}

int pd_copy_stream_select(const char *name)
{
    return strcmp(name, "memcpy") == 0 ? 0 : -1;
}

#endif
