/* tests/unit/fail_alloc.c — a failing allocator for the unit suites (issue 46). A suite links it
 * with -Wl,--wrap=malloc,... (CMake: pd_add_fail_alloc), so every allocation made by the suite
 * and by the project libraries linked statically into it comes here; libraries linked as shared
 * objects (libc itself, UCX, protobuf-c) keep their own. Jansson is pointed here while armed
 * (json_set_alloc_funcs), as its values are allocated for our code.
 *
 * Off until armed. Armed at n, the nth allocation from then on returns NULL (once, then
 * allocations succeed again), as a system out of memory would: fail_alloc.h's loop arms
 * n = 1, 2, ... in fresh processes until a run allocates fewer than n times. PD_FAIL_ALLOC_TRACE=1
 * prints the failing call's stack (backtrace_symbols_fd; addr2line -e BINARY names the lines).
 *
 * By call site (PD_FAIL_ALLOC_SITES set, possibly empty: the sites already failed, hex offsets in
 * the executable, comma-separated): the first allocation from the nth on whose call site is not in
 * the list fails, and its number and site are written to stderr ("FAIL-ALLOC-SITE n site"). A
 * site is the first two frames of the stack inside this executable and outside this file, so an
 * allocation jansson makes counts where our code called jansson. A run with thousands of
 * allocations (the engine's) then costs one run per site, not per allocation. */
#define _GNU_SOURCE
#include "fail_alloc.h"

#include <errno.h>
#include <execinfo.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);

/* this file's functions, left out of call sites */
#define FA_TEXT __attribute__((noinline, section("pd_failalloc_text")))
extern char __start_pd_failalloc_text[], __stop_pd_failalloc_text[];
extern char __executable_start[], etext[];

static atomic_long g_at;    /* the allocation that fails (0: none) */
static atomic_long g_count; /* allocations since armed */
static atomic_bool g_hit;   /* the armed one happened */
#define FA_MAX_SITES 8192
static uintptr_t g_sites[FA_MAX_SITES]; /* by site: the ones already failed */
static int g_num_sites = -1;            /* -1: not by site */

/* The first two frames inside this executable and outside this file, as offsets (the caller's
 * caller too: every pd_array_reserve or json_* call would otherwise be one site). */
FA_TEXT static uintptr_t site_of(void)
{
    void *f[48];
    int n = backtrace(f, 48);
    uintptr_t site = 0;
    for (int i = 0, found = 0; i < n && found < 2; i++) {
        char *a = f[i];
        if (a >= __executable_start && a < etext &&
            !(a >= __start_pd_failalloc_text && a < __stop_pd_failalloc_text)) {
            site = site << 32 | (uintptr_t)(a - __executable_start);
            found++;
        }
    }
    return site;
}

FA_TEXT static int fails_by_site(long n, long at)
{
    if (n < at || atomic_load(&g_hit)) {
        return 0;
    }
    uintptr_t site = site_of();
    for (int i = 0; i < g_num_sites; i++) {
        if (g_sites[i] == site) {
            return 0;
        }
    }
    bool no = false;
    if (!atomic_compare_exchange_strong(&g_hit, &no, true)) {
        return 0; /* another thread's allocation failed first */
    }
    char line[96];
    int len = snprintf(line, sizeof(line), "FAIL-ALLOC-SITE %ld %lx\n", n, (unsigned long)site);
    ssize_t w = write(2, line, (size_t)len);
    (void)w;
    return 1;
}

FA_TEXT static int fails(void)
{
    long at = atomic_load_explicit(&g_at, memory_order_relaxed);
    if (at <= 0) {
        return 0;
    }
    long n = atomic_fetch_add(&g_count, 1) + 1;
    if (g_num_sites >= 0) {
        return fails_by_site(n, at);
    }
    if (n != at) {
        return 0;
    }
    atomic_store(&g_hit, true);
    if (getenv("PD_FAIL_ALLOC_TRACE") != NULL) { /* where it failed (addr2line -e the binary) */
        void *frames[24];
        backtrace_symbols_fd(frames, backtrace(frames, 24), 2);
    }
    return 1;
}

FA_TEXT void *__wrap_malloc(size_t n)
{
    return fails() ? NULL : __real_malloc(n);
}

FA_TEXT void *__wrap_calloc(size_t n, size_t size)
{
    return fails() ? NULL : __real_calloc(n, size);
}

FA_TEXT void *__wrap_realloc(void *p, size_t n)
{
    return fails() ? NULL : __real_realloc(p, n);
}

FA_TEXT char *__wrap_strdup(const char *s)
{
    return fails() ? NULL : __real_strdup(s);
}

FA_TEXT char *__wrap_strndup(const char *s, size_t n)
{
    return fails() ? NULL : __real_strndup(s, n);
}

FA_TEXT int __wrap_posix_memalign(void **p, size_t align, size_t n)
{
    return fails() ? ENOMEM : __real_posix_memalign(p, align, n);
}

FA_TEXT void *__wrap_aligned_alloc(size_t align, size_t n)
{
    return fails() ? NULL : __real_aligned_alloc(align, n);
}

FA_TEXT static void *json_alloc(size_t n)
{
    return __wrap_malloc(n);
}

void tu_fail_alloc_arm(long at)
{
    const char *sites = getenv("PD_FAIL_ALLOC_SITES");
    g_num_sites = -1;
    if (at > 0 && sites != NULL) {
        g_num_sites = 0;
        for (const char *p = sites; *p != '\0' && g_num_sites < FA_MAX_SITES;) {
            char *end = NULL;
            unsigned long v = strtoul(p, &end, 16);
            if (end == p) {
                break;
            }
            g_sites[g_num_sites++] = v;
            p = *end == ',' ? end + 1 : end;
        }
        void *f[4];
        backtrace(f, 4); /* loads the unwinder now, not inside a failing allocation */
    }
    atomic_store(&g_count, 0);
    atomic_store(&g_hit, false);
    atomic_store(&g_at, at);
    json_set_alloc_funcs(at > 0 ? json_alloc : __real_malloc, free);
}

bool tu_fail_alloc_hit(void)
{
    return atomic_load(&g_hit);
}

long tu_fail_alloc_count(void)
{
    return atomic_load(&g_count);
}
