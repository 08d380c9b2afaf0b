/* engine/kv_offload.h — the KV offload tier (--kv-offload-tier host|disk): a block the prefix cache
 * evicts is copied here first, keyed by its prefix-cache hash, and a later request whose prefix
 * misses the pool but hits the tier loads it back instead of recomputing it (vLLM's
 * OffloadingConnector CPU/file tiers, SGLang HiCache's L2/L3 with its write-back policy).
 *
 * Storage: slots of one block each, bounded by --kv-offload-size, least recently used evicted. A
 * slot is every KV tensor's page of the block, in tensor order, then a 64-byte header (magic,
 * fingerprint, key, checksum of the data, write sequence, checksum of the header), rounded up to
 * 4 KiB (the pages start page-aligned in the file).
 *   host: one arena on huge pages (a slot copied with streaming stores; a device KV's by the
 *         backend, into the arena page-locked).
 *   disk: one file, --kv-offload-path, read and written with preadv/pwritev straight between the
 *         file and the KV pages (writes land in the page cache: the device write-back is the
 *         kernel's, off the engine thread). The file is flock'ed (two nodes never share one) and
 *         kept across restarts: open reads every slot header back (a fingerprint of the model's
 *         files, the KV dtype and the geometry must match, else the file starts empty). A slot
 *         whose header or data checksum fails when it is loaded (a torn write, a stale or corrupt
 *         file) is dropped and the load fails: its tokens are recomputed, never served.
 *
 * What is checked on each load is the slot's header and, on disk, its data checksum (the host tier's
 * memory neither tears nor goes stale: its data is not checksummed); the key is the block's chained hash,
 * which covers every token before it (and the cache salt), so equal keys hold equal KV.
 *
 * A device KV (the cuda backend's) has a host tier only: its arena is page-locked by the backend
 * (pin_host), and a slot's pages move with the backend's gather_pages / scatter_pages (one async
 * copy per page on the compute stream, so after the kernels that wrote them, then one sync); its
 * header is the CPU's. A disk tier behind a device KV would need a bounce buffer: not built.
 *
 * Engine thread only (the scheduler reaches it through pd_kv_tier_t), but for pd_kv_offload_read,
 * which a loader thread may run on a pinned slot (host-memory KV only: a device KV's copies run
 * on the engine's stream, so its loads are inline). */
#ifndef PD_ENGINE_KV_OFFLOAD_H
#define PD_ENGINE_KV_OFFLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/hash.h"
#include "common/status.h"
#include "model/model.h" /* PD_MAX_LAYERS */

typedef enum pd_kv_offload_medium {
    PD_KV_OFFLOAD_HOST,
    PD_KV_OFFLOAD_DISK,
} pd_kv_offload_medium_t;

typedef struct pd_kv_offload_config {
    pd_kv_offload_medium_t medium;
    size_t size_bytes; /* the tier's capacity: size_bytes / slot bytes slots (at least 1) */
    const char *path;  /* disk: the file */
    uint64_t fingerprint;
    /* the KV region: block id b's page of tensor t is at base + tensor_offset[t] + b × page_bytes */
    uint8_t *base;
    int32_t num_tensors;
    size_t tensor_offset[PD_MAX_LAYERS];
    size_t page_bytes;
    uint32_t num_blocks;
    /* NULL: base is host memory, copied by the CPU. Else the backend that owns base (device memory):
     * slots move with its gather_pages / scatter_pages, and its pin_host locks the arena (host
     * medium only) */
    struct pd_backend *device;
} pd_kv_offload_config_t;

typedef struct pd_kv_offload_stats {
    uint64_t saved;        /* blocks written to the tier */
    uint64_t already;      /* evicted blocks the tier held already (nothing written) */
    uint64_t loaded;       /* blocks loaded back (prefix hits served by the tier) */
    uint64_t corrupt;      /* loads refused by a checksum (the slot dropped) */
    uint64_t evicted;      /* tier slots reused for another block */
    uint64_t write_errors; /* saves that failed (full disk, I/O error): the block is just gone */
    uint64_t skipped;      /* saves not made: every slot was pinned by a load */
    uint64_t bytes_written, bytes_read;
    double read_seconds; /* time spent in loads */
    uint32_t used_slots, num_slots;
    size_t slot_bytes;
    uint32_t kept; /* disk: blocks found in the file at open */
} pd_kv_offload_stats_t;

typedef struct pd_kv_offload pd_kv_offload_t;

/* Opens the tier. PD_ERR_INVALID_ARG (logged) for a size under one slot or a disk tier without a
 * path; PD_ERR_IO for a file that cannot be opened, sized or locked (another process holds it). */
pd_status_t pd_kv_offload_create(const pd_kv_offload_config_t *cfg, pd_kv_offload_t **out);
void pd_kv_offload_destroy(pd_kv_offload_t *o);

/* Whether the tier holds key (no side effects). */
bool pd_kv_offload_contains(const pd_kv_offload_t *o, pd_hash128_t key);

/* Copies block's pages into the tier under key (most recently used; the least recently used slot
 * is reused when the tier is full). A key the tier holds already is only marked used. PD_ERR_IO
 * (logged once per kind of failure) when the write fails: the tier simply does not hold it;
 * PD_ERR_CANCELLED (counted in skipped) when every slot is pinned by a load. */
pd_status_t pd_kv_offload_save(pd_kv_offload_t *o, pd_hash128_t key, uint32_t block);

/* Copies key's pages into block and marks it used (pin, read and unpin in a row). PD_ERR_NOT_FOUND
 * when the tier does not hold it; PD_ERR_PARSE when its checksum fails (the slot is dropped; block's
 * pages are garbage); PD_ERR_IO when the read fails (dropped too). */
pd_status_t pd_kv_offload_load(pd_kv_offload_t *o, pd_hash128_t key, uint32_t block);

/* A load in three parts, for a loader thread (engine/kv_tier_loader.h):
 *   pin (engine thread): key's slot, kept from reuse and eviction until its unpin (a save that
 *     needs a slot while every slot is pinned is skipped); PD_KV_OFFLOAD_NO_SLOT when the tier
 *     does not hold key.
 *   read (any thread, while pinned): the slot's pages into block's, checked; PD_ERR_PARSE or
 *     PD_ERR_IO (logged) as pd_kv_offload_load. It reads nothing the engine thread writes while the
 *     slot is pinned, and writes only block's pages.
 *   unpin (engine thread): with read's status and time (PD_ERR_CANCELLED: not read). A slot read
 *     whole is the most recently used; one that failed is dropped (contains no longer finds it,
 *     its slot is reused after its last unpin). The stats count here. */
#define PD_KV_OFFLOAD_NO_SLOT UINT32_MAX
uint32_t pd_kv_offload_pin(pd_kv_offload_t *o, pd_hash128_t key);
pd_status_t pd_kv_offload_read(pd_kv_offload_t *o, uint32_t slot, pd_hash128_t key, uint32_t block);
void pd_kv_offload_unpin(pd_kv_offload_t *o, uint32_t slot, pd_status_t read_status, double seconds);

/* Calls fn(arg, key, stored) whenever the tier starts holding a block (a save of a new key) or stops
 * (an eviction, a slot dropped by its checksum or a failed read), and at once for every block it
 * holds now (a reopened file's): the KV events' tier medium. fn NULL: none. */
void pd_kv_offload_set_listener(pd_kv_offload_t *o, void (*fn)(void *arg, pd_hash128_t key, bool stored),
                                void *arg);

void pd_kv_offload_get_stats(const pd_kv_offload_t *o, pd_kv_offload_stats_t *out);

pd_kv_offload_medium_t pd_kv_offload_medium(const pd_kv_offload_t *o);

/* "host" or "disk". */
const char *pd_kv_offload_medium_name(pd_kv_offload_medium_t m);

#endif
