/* common/copy.h — bulk memory copies: a streaming copy for transfers larger than the caches.
 *
 * memcpy writes through the cache: every destination line is first read (write-allocate), then
 * evicted again when the copy is larger than the cache. For a KV transfer of several MiB that is
 * a third of the memory traffic spent for nothing. pd_copy_stream writes with non-temporal stores
 * instead (what UCX's shared-memory transports and glibc do above their thresholds; glibc's is
 * 192 MiB on these VMs, so it never applies to a KV transfer). */
#ifndef PD_COMMON_COPY_H
#define PD_COMMON_COPY_H

#include <stddef.h>

/* A copy (a whole request, all its pages) at least this large goes to pd_copy_stream: beyond the
 * per-core L2 (1 MiB here) the destination would not stay cached anyway. */
#define PD_COPY_STREAM_MIN (4u << 20)

/* Copies n bytes from src to dst (regions must not overlap), like memcpy, bypassing the cache
 * for the destination where the CPU can (x86-64: AVX2 or SSE2 streaming stores; elsewhere plain
 * memcpy). Any alignment and length (0 included). When it returns, the bytes are ordered before
 * any later store of this thread (it ends with a store fence), so publishing them with a release
 * store or a lock is enough, as after memcpy. */
void pd_copy_stream(void *dst, const void *src, size_t n);

/* The implementation pd_copy_stream uses on this CPU: "avx2", "sse2" or "memcpy" (for logs and
 * benchmark headers). */
const char *pd_copy_stream_kind(void);

/* Selects the implementation by name ("avx2", "sse2", "memcpy") for the whole process: tests
 * cover every variant on one machine, benchmarks compare them. Returns 0, or -1 (nothing
 * changed) when the name is unknown or the CPU cannot run it. Call it before copies start. */
int pd_copy_stream_select(const char *name);

#endif
