/* engine/kv_offload.c — the KV offload tier: slots of one block, an LRU over them, a host arena
 * or a file behind them. */
#define _GNU_SOURCE /* preadv, pwritev */
#include "engine/kv_offload.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/checksum.h"
#include "common/copy.h"
#include "common/huge_alloc.h"
#include "common/key_map.h"
#include "common/log.h"
#include "common/time.h"
#include "kernels/backend.h"

#define NIL               UINT32_MAX
#define SLOT_MAGIC        0x424b4450u /* "PDKB" */
#define FORMAT_VERSION    2u          /* 2: the header after the pages */
#define FILE_HEADER_BYTES 4096u
#define SLOT_ALIGN        4096u

/* A slot's header, written in front of its pages (one write with them). */
typedef struct slot_header {
    uint32_t magic;
    uint32_t version;
    uint64_t fingerprint;
    uint64_t key_lo, key_hi;
    uint64_t data_sum; /* checksum of the pages (data_checksum) */
    uint64_t seq;      /* write order: the LRU order a reopened file starts from */
    uint64_t reserved;
    uint64_t header_sum; /* pd_hash64 of the bytes above */
} slot_header_t;
_Static_assert(sizeof(slot_header_t) == 64, "slot header is 64 bytes");

/* The file's first FILE_HEADER_BYTES: what a reopened file must match to be kept. */
typedef struct file_header {
    char magic[8]; /* "PDKVTIER" */
    uint32_t version;
    uint32_t reserved;
    uint64_t fingerprint;
    uint64_t slot_bytes;
    uint64_t num_slots;
    uint64_t header_sum;
} file_header_t;

typedef struct slot {
    pd_hash128_t key;
    uint64_t seq;
    uint32_t prev, next; /* LRU links when used and not pinned, the free list (next) when not used */
    uint32_t pins;       /* loads in flight (pd_kv_offload_pin): out of the LRU, never reused */
    bool used;
    bool forgotten; /* out of the index while pinned (its read failed): freed at the last unpin */
} slot_t;

struct pd_kv_offload {
    pd_kv_offload_config_t cfg;
    size_t data_bytes; /* num_tensors × page_bytes */
    size_t slot_bytes; /* header + data, rounded up to SLOT_ALIGN */
    uint32_t num_slots;
    slot_t *slots;
    pd_key_map_t index; /* key → slot */
    uint32_t lru_head;  /* least recently used */
    uint32_t lru_tail;  /* most recently used */
    uint32_t free_head;
    uint64_t next_seq;
    uint8_t *arena; /* host: num_slots × slot_bytes */
    bool pinned;    /* the arena is page-locked by cfg.device */
    int fd;         /* disk: the file, flock'ed; -1 */
    bool warned_write;
    atomic_bool warned_read; /* pd_kv_offload_read runs on a loader thread */
    void (*listener)(void *arg, pd_hash128_t key, bool stored);
    void *listener_arg;
    pd_kv_offload_stats_t st;
};

pd_kv_offload_medium_t pd_kv_offload_medium(const pd_kv_offload_t *o)
{
    return o->cfg.medium;
}

const char *pd_kv_offload_medium_name(pd_kv_offload_medium_t m)
{
    return m == PD_KV_OFFLOAD_DISK ? "disk" : "host";
}

/* ------------------------------------------------------------------ LRU and free list */

static void lru_unlink(pd_kv_offload_t *o, uint32_t i)
{
    slot_t *s = &o->slots[i];
    if (s->prev != NIL) {
        o->slots[s->prev].next = s->next;
    } else {
        o->lru_head = s->next;
    }
    if (s->next != NIL) {
        o->slots[s->next].prev = s->prev;
    } else {
        o->lru_tail = s->prev;
    }
    s->prev = s->next = NIL;
}

static void lru_append(pd_kv_offload_t *o, uint32_t i)
{
    slot_t *s = &o->slots[i];
    s->next = NIL;
    s->prev = o->lru_tail;
    if (o->lru_tail != NIL) {
        o->slots[o->lru_tail].next = i;
    } else {
        o->lru_head = i;
    }
    o->lru_tail = i;
}

/* Takes slot i's key out of the index (contains and pin no longer find it). */
static void slot_forget(pd_kv_offload_t *o, uint32_t i)
{
    slot_t *s = &o->slots[i];
    pd_key_map_remove(&o->index, s->key, i);
    if (o->listener != NULL) {
        o->listener(o->listener_arg, s->key, false);
    }
}

/* Slot i (used, forgotten, unlinked) → the free list. */
static void slot_free(pd_kv_offload_t *o, uint32_t i)
{
    slot_t *s = &o->slots[i];
    s->used = false;
    s->next = o->free_head;
    o->free_head = i;
    o->st.used_slots--;
}

/* Forgets unpinned slot i's block (used → free). */
static void slot_drop(pd_kv_offload_t *o, uint32_t i)
{
    slot_forget(o, i);
    lru_unlink(o, i);
    slot_free(o, i);
}

/* A slot to write: a free one, else the least recently used one's (evicted); NIL when every slot
 * is pinned. */
static uint32_t slot_take(pd_kv_offload_t *o)
{
    if (o->free_head == NIL) {
        if (o->lru_head == NIL) {
            return NIL;
        }
        o->st.evicted++;
        slot_drop(o, o->lru_head);
    }
    uint32_t i = o->free_head;
    o->free_head = o->slots[i].next;
    return i;
}

/* Records slot i as holding key (most recently used). */
static void slot_set(pd_kv_offload_t *o, uint32_t i, pd_hash128_t key, uint64_t seq)
{
    slot_t *s = &o->slots[i];
    s->key = key;
    s->seq = seq;
    s->used = true;
    pd_key_map_insert(&o->index, key, i);
    lru_append(o, i);
    o->st.used_slots++;
    if (o->listener != NULL) {
        o->listener(o->listener_arg, key, true);
    }
}

/* ------------------------------------------------------------------ I/O */

static uint64_t header_sum(const slot_header_t *h)
{
    return pd_hash64(h, offsetof(slot_header_t, header_sum), 0);
}

/* The checksum of block's pages (after a load: of what arrived). The host tier's is 0: its slots
 * live in this process's memory, which neither tears nor goes stale, and the checksum cost as much
 * as the copy (a file's slots are always checked). */
static uint64_t data_checksum(const pd_kv_offload_t *o, pd_hash128_t key, uint32_t block)
{
    if (o->arena != NULL) {
        return 0;
    }
    uint64_t c = o->cfg.fingerprint ^ key.lo;
    for (int32_t t = 0; t < o->cfg.num_tensors; t++) {
        c = pd_checksum64(o->cfg.base + o->cfg.tensor_offset[t] + (size_t)block * o->cfg.page_bytes,
                          o->cfg.page_bytes, c);
    }
    return c;
}

static off_t slot_offset(const pd_kv_offload_t *o, uint32_t i)
{
    return (off_t)FILE_HEADER_BYTES + (off_t)i * (off_t)o->slot_bytes;
}

/* Points iov at block's pages, then hdr: the pages start the slot, aligned as the file's pages are
 * (an unaligned start made every page-cache copy straddle two pages: 40 % slower reads). */
static int build_iov(const pd_kv_offload_t *o, struct iovec *iov, slot_header_t *hdr, uint32_t block)
{
    for (int32_t t = 0; t < o->cfg.num_tensors; t++) {
        iov[t] = (struct iovec){o->cfg.base + o->cfg.tensor_offset[t] + (size_t)block * o->cfg.page_bytes,
                                o->cfg.page_bytes};
    }
    iov[o->cfg.num_tensors] = (struct iovec){hdr, sizeof(*hdr)};
    return 1 + o->cfg.num_tensors;
}

/* A device KV's slot i (iov[n]: its pages in the device region, then the header): the backend
 * gathers the pages into the arena slot back to back (write) or scatters them from it, and the
 * CPU copies the header. */
static pd_status_t slot_io_device(const pd_kv_offload_t *o, uint32_t i, const struct iovec *iov, int n,
                                  bool write)
{
    pd_backend_t *be = o->cfg.device;
    uint8_t *p = o->arena + (size_t)i * o->slot_bytes;
    pd_page_range_t r[PD_MAX_LAYERS];
    for (int k = 0; k < n - 1; k++) {
        r[k] = (pd_page_range_t){(uint64_t)((uint8_t *)iov[k].iov_base - o->cfg.base), iov[k].iov_len};
    }
    pd_status_t st = write ? be->ops->gather_pages(be, p, o->cfg.base, r, n - 1)
                           : be->ops->scatter_pages(be, o->cfg.base, p, r, n - 1);
    if (st != PD_OK) {
        errno = EIO;
        return PD_ERR_IO;
    }
    write ? memcpy(p + o->data_bytes, iov[n - 1].iov_base, iov[n - 1].iov_len)
          : memcpy(iov[n - 1].iov_base, p + o->data_bytes, iov[n - 1].iov_len);
    return PD_OK;
}

/* Moves iov[n] to (write) or from slot i. Host: streaming stores (pd_copy_stream), both ways: a
 * block's pages are scattered over the pool's tensors, a page apiece (4 KiB on the demo model), and
 * memcpy read each destination line before writing it; on a Zen 3 such page copies ran at 4.1–5.1
 * GB/s that way and 8.2–10.1 streamed, against 9–11.7 for one 256 MiB memcpy. Disk: preadv/pwritev
 * until every byte moved (a short transfer that makes no progress — end of file, full disk — is an
 * error). */
static pd_status_t slot_io(const pd_kv_offload_t *o, uint32_t i, struct iovec *iov, int n, bool write)
{
    if (o->arena != NULL && o->cfg.device != NULL) {
        return slot_io_device(o, i, iov, n, write);
    }
    if (o->arena != NULL) {
        uint8_t *p = o->arena + (size_t)i * o->slot_bytes;
        for (int k = 0; k < n; k++) {
            write ? pd_copy_stream(p, iov[k].iov_base, iov[k].iov_len)
                  : pd_copy_stream(iov[k].iov_base, p, iov[k].iov_len);
            p += iov[k].iov_len;
        }
        return PD_OK;
    }
    off_t off = slot_offset(o, i);
    while (n > 0) {
        ssize_t r = write ? pwritev(o->fd, iov, n, off) : preadv(o->fd, iov, n, off);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            if (r == 0) {
                errno = write ? ENOSPC : ENODATA;
            }
            return PD_ERR_IO;
        }
        off += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { /* skip what moved */
            r -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + r;
            iov->iov_len -= (size_t)r;
        }
    }
    return PD_OK;
}

bool pd_kv_offload_contains(const pd_kv_offload_t *o, pd_hash128_t key)
{
    return pd_key_map_get(&o->index, key) != PD_KEY_MAP_NONE;
}

pd_status_t pd_kv_offload_save(pd_kv_offload_t *o, pd_hash128_t key, uint32_t block)
{
    if (block == 0 || block >= o->cfg.num_blocks) {
        return PD_ERR_OUT_OF_RANGE;
    }
    uint32_t i = pd_key_map_get(&o->index, key);
    if (i != PD_KEY_MAP_NONE) {      /* equal keys hold equal KV: only its recency changes */
        if (o->slots[i].pins == 0) { /* (a pinned one is the most recent at its unpin) */
            lru_unlink(o, i);
            lru_append(o, i);
        }
        o->st.already++;
        return PD_OK;
    }
    i = slot_take(o);
    if (i == NIL) {
        o->st.skipped++;
        return PD_ERR_CANCELLED;
    }
    slot_header_t hdr = {SLOT_MAGIC, FORMAT_VERSION, o->cfg.fingerprint, key.lo, key.hi, 0, o->next_seq++, 0,
                         0};
    hdr.data_sum = data_checksum(o, key, block);
    hdr.header_sum = header_sum(&hdr);
    struct iovec iov[PD_MAX_LAYERS + 1];
    int n = build_iov(o, iov, &hdr, block);
    if (slot_io(o, i, iov, n, true) != PD_OK) {
        if (!o->warned_write) {
            o->warned_write = true;
            pd_log_warn("kv offload: writing a block to %s failed (%s); blocks that cannot be written are "
                        "dropped (logged once)",
                        o->cfg.path, strerror(errno));
        }
        o->st.write_errors++;
        o->slots[i].next = o->free_head;
        o->free_head = i;
        return PD_ERR_IO;
    }
    slot_set(o, i, key, hdr.seq);
    o->st.saved++;
    o->st.bytes_written += o->data_bytes;
    return PD_OK;
}

uint32_t pd_kv_offload_pin(pd_kv_offload_t *o, pd_hash128_t key)
{
    uint32_t i = pd_key_map_get(&o->index, key);
    if (i == PD_KEY_MAP_NONE) {
        return PD_KV_OFFLOAD_NO_SLOT;
    }
    if (o->slots[i].pins++ == 0) {
        lru_unlink(o, i);
    }
    return i;
}

pd_status_t pd_kv_offload_read(pd_kv_offload_t *o, uint32_t slot, pd_hash128_t key, uint32_t block)
{
    if (block == 0 || block >= o->cfg.num_blocks || slot >= o->num_slots) {
        return PD_ERR_OUT_OF_RANGE;
    }
    slot_header_t hdr;
    struct iovec iov[PD_MAX_LAYERS + 1];
    int n = build_iov(o, iov, &hdr, block);
    if (slot_io(o, slot, iov, n, false) != PD_OK) {
        if (!atomic_exchange(&o->warned_read, true)) {
            pd_log_warn("kv offload: reading a block from %s failed (%s); its tokens are recomputed (logged "
                        "once)",
                        o->cfg.path, strerror(errno));
        }
        return PD_ERR_IO;
    }
    if (hdr.magic != SLOT_MAGIC || hdr.version != FORMAT_VERSION || hdr.fingerprint != o->cfg.fingerprint ||
        hdr.key_lo != key.lo || hdr.key_hi != key.hi || hdr.header_sum != header_sum(&hdr) ||
        hdr.data_sum != data_checksum(o, key, block)) {
        pd_log_warn(
            "kv offload: slot %u of the %s tier failed its checksum (torn, stale or corrupt); dropped, "
            "its tokens are recomputed",
            slot, pd_kv_offload_medium_name(o->cfg.medium));
        return PD_ERR_PARSE;
    }
    return PD_OK;
}

void pd_kv_offload_unpin(pd_kv_offload_t *o, uint32_t slot, pd_status_t read_status, double seconds)
{
    slot_t *s = &o->slots[slot];
    if (read_status == PD_OK) {
        o->st.loaded++;
        o->st.bytes_read += o->data_bytes;
        o->st.read_seconds += seconds; /* the read and its checksum */
    } else if (read_status == PD_ERR_PARSE || read_status == PD_ERR_IO) {
        o->st.read_seconds += seconds;
        o->st.corrupt += read_status == PD_ERR_PARSE;
        if (!s->forgotten) { /* never served again; its slot is reused once no read holds it */
            s->forgotten = true;
            slot_forget(o, slot);
        }
    }
    if (--s->pins > 0) {
        return;
    }
    if (s->forgotten) {
        s->forgotten = false;
        slot_free(o, slot);
    } else {
        lru_append(o, slot); /* the most recently used */
    }
}

pd_status_t pd_kv_offload_load(pd_kv_offload_t *o, pd_hash128_t key, uint32_t block)
{
    if (block == 0 || block >= o->cfg.num_blocks) {
        return PD_ERR_OUT_OF_RANGE;
    }
    uint32_t i = pd_kv_offload_pin(o, key);
    if (i == PD_KV_OFFLOAD_NO_SLOT) {
        return PD_ERR_NOT_FOUND;
    }
    double t0 = pd_time_now_s();
    pd_status_t st = pd_kv_offload_read(o, i, key, block);
    pd_kv_offload_unpin(o, i, st, pd_time_now_s() - t0);
    return st;
}

void pd_kv_offload_set_listener(pd_kv_offload_t *o, void (*fn)(void *arg, pd_hash128_t key, bool stored),
                                void *arg)
{
    o->listener = fn;
    o->listener_arg = arg;
    for (uint32_t i = o->lru_head; fn != NULL && i != NIL; i = o->slots[i].next) {
        fn(arg, o->slots[i].key, true);
    }
}

void pd_kv_offload_get_stats(const pd_kv_offload_t *o, pd_kv_offload_stats_t *out)
{
    *out = o->st;
}

/* ------------------------------------------------------------------ open */

static uint64_t file_header_sum(const file_header_t *h)
{
    return pd_hash64(h, offsetof(file_header_t, header_sum), 0);
}

static int by_seq(const void *a, const void *b)
{
    const slot_t *x = *(slot_t *const *)a, *y = *(slot_t *const *)b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* A file that matches this tier keeps its blocks: every valid slot header enters the index, in
 * write order (the LRU order it had). */
static pd_status_t read_back(pd_kv_offload_t *o)
{
    slot_t **order = malloc((size_t)o->num_slots * sizeof(*order));
    if (order == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < o->num_slots; i++) {
        slot_header_t h;
        if (pread(o->fd, &h, sizeof(h), slot_offset(o, i) + (off_t)o->data_bytes) != (ssize_t)sizeof(h) ||
            h.magic != SLOT_MAGIC || h.version != FORMAT_VERSION || h.fingerprint != o->cfg.fingerprint ||
            h.header_sum != header_sum(&h)) {
            continue;
        }
        o->slots[i].key = (pd_hash128_t){h.key_lo, h.key_hi};
        o->slots[i].seq = h.seq;
        order[n++] = &o->slots[i];
    }
    qsort(order, n, sizeof(*order), by_seq);
    o->free_head = NIL;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = (uint32_t)(order[k] - o->slots);
        if (!pd_key_map_insert(&o->index, order[k]->key, i)) {
            continue; /* a key twice (an older copy): that slot stays free */
        }
        order[k]->used = true;
        lru_append(o, i);
        o->st.used_slots++;
        o->next_seq = order[k]->seq + 1;
    }
    for (uint32_t i = o->num_slots; i-- > 0;) {
        if (!o->slots[i].used) {
            o->slots[i].next = o->free_head;
            o->free_head = i;
        }
    }
    free(order);
    o->st.kept = o->st.used_slots;
    return PD_OK;
}

static pd_status_t open_file(pd_kv_offload_t *o)
{
    o->fd = open(o->cfg.path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (o->fd < 0) {
        pd_log_error("kv offload: cannot open %s: %s", o->cfg.path, strerror(errno));
        return PD_ERR_IO;
    }
    if (flock(o->fd, LOCK_EX | LOCK_NB) != 0) {
        pd_log_error("kv offload: %s is in use by another process (%s); give each node its own "
                     "--kv-offload-path",
                     o->cfg.path, strerror(errno));
        return PD_ERR_IO;
    }
    file_header_t want;
    memset(&want, 0, sizeof(want));
    memcpy(want.magic, "PDKVTIER", 8);
    want.version = FORMAT_VERSION;
    want.fingerprint = o->cfg.fingerprint;
    want.slot_bytes = o->slot_bytes;
    want.num_slots = o->num_slots;
    want.header_sum = file_header_sum(&want);
    file_header_t have;
    off_t size = slot_offset(o, o->num_slots);
    struct stat sb;
    if (fstat(o->fd, &sb) == 0 && sb.st_size == size &&
        pread(o->fd, &have, sizeof(have), 0) == sizeof(have) && memcmp(&have, &want, sizeof(want)) == 0) {
        return read_back(o);
    }
    /* a new file, or one of another model or geometry: it starts empty (zeros: no valid header) */
    if (ftruncate(o->fd, 0) != 0 || ftruncate(o->fd, size) != 0 ||
        pwrite(o->fd, &want, sizeof(want), 0) != (ssize_t)sizeof(want)) {
        pd_log_error("kv offload: cannot size %s to %lld bytes: %s", o->cfg.path, (long long)size,
                     strerror(errno));
        return PD_ERR_IO;
    }
    return PD_OK;
}

pd_status_t pd_kv_offload_create(const pd_kv_offload_config_t *cfg, pd_kv_offload_t **out)
{
    if (cfg->num_tensors < 1 || cfg->num_tensors > PD_MAX_LAYERS || cfg->page_bytes == 0) {
        pd_log_error("kv offload: %d KV tensors of %zu-byte pages", cfg->num_tensors, cfg->page_bytes);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->medium == PD_KV_OFFLOAD_DISK && (cfg->path == NULL || cfg->path[0] == '\0')) {
        pd_log_error("kv offload: --kv-offload-tier disk needs --kv-offload-path (a file)");
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->device != NULL && (cfg->medium != PD_KV_OFFLOAD_HOST || cfg->device->ops->gather_pages == NULL ||
                                cfg->device->ops->scatter_pages == NULL)) {
        pd_log_error("kv offload: a %s KV's tier is page-locked host memory (--kv-offload-tier host); a disk "
                     "tier behind it would need a bounce buffer, which is not built",
                     cfg->device->ops->name);
        return PD_ERR_UNSUPPORTED;
    }
    size_t data = (size_t)cfg->num_tensors * cfg->page_bytes;
    size_t slot_bytes = (sizeof(slot_header_t) + data + SLOT_ALIGN - 1) / SLOT_ALIGN * SLOT_ALIGN;
    size_t num = cfg->size_bytes / slot_bytes;
    if (num < 1 || num >= (1u << 30)) {
        pd_log_error(
            "kv offload: --kv-offload-size %zu bytes holds %zu blocks of %zu bytes (1 .. 2^30 needed)",
            cfg->size_bytes, num, slot_bytes);
        return PD_ERR_INVALID_ARG;
    }
    pd_kv_offload_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    o->cfg = *cfg;
    o->fd = -1;
    o->data_bytes = data;
    o->slot_bytes = slot_bytes;
    o->num_slots = (uint32_t)num;
    o->lru_head = o->lru_tail = NIL;
    o->st.num_slots = o->num_slots;
    o->st.slot_bytes = slot_bytes;
    o->slots = calloc(num, sizeof(slot_t));
    atomic_init(&o->warned_read, false);
    pd_status_t st = PD_ERR_NO_MEMORY;
    if (o->slots == NULL || pd_key_map_init(&o->index, o->num_slots) != PD_OK) {
        pd_log_error("kv offload: cannot allocate the index of %zu slots", num);
        goto err;
    }
    for (uint32_t i = 0; i < o->num_slots; i++) {
        o->slots[i].prev = NIL;
        o->slots[i].next = i + 1 < o->num_slots ? i + 1 : NIL;
    }
    o->free_head = 0;
    if (cfg->medium == PD_KV_OFFLOAD_HOST) {
        o->arena = pd_huge_alloc(num * slot_bytes, 64); /* slot copies hop between 4 KiB pages */
        if (o->arena == NULL) {
            pd_log_error("kv offload: cannot allocate the %zu-byte host tier", num * slot_bytes);
            goto err;
        }
        pd_backend_t *be = cfg->device;
        if (be != NULL && be->ops->pin_host != NULL) { /* DMA to and from it at full speed */
            o->pinned = be->ops->pin_host(be, o->arena, num * slot_bytes) == PD_OK;
            if (!o->pinned) {
                pd_log_warn(
                    "kv offload: the %s backend cannot page-lock the %zu-byte host tier; its copies run "
                    "through the driver's staging (slower)",
                    be->ops->name, num * slot_bytes);
            }
        }
    } else if ((st = open_file(o)) != PD_OK) {
        goto err;
    }
    pd_log_info("kv offload: %s tier%s%s: %u blocks of %zu bytes (%.1f MiB), %s checksums",
                pd_kv_offload_medium_name(cfg->medium), o->fd >= 0 ? " " : "", o->fd >= 0 ? cfg->path : "",
                o->num_slots, slot_bytes, (double)num * (double)slot_bytes / 1048576.0, pd_checksum64_name());
    if (o->st.kept > 0) {
        pd_log_info("kv offload: %u blocks kept from the file's last run", o->st.kept);
    }
    *out = o;
    return PD_OK;
err:
    pd_kv_offload_destroy(o);
    return st;
}

void pd_kv_offload_destroy(pd_kv_offload_t *o)
{
    if (o == NULL) {
        return;
    }
    if (o->fd >= 0) {
        close(o->fd); /* drops the lock */
    }
    if (o->pinned) {
        o->cfg.device->ops->unpin_host(o->cfg.device, o->arena);
    }
    free(o->arena);
    free(o->slots);
    pd_key_map_free(&o->index);
    free(o);
}
