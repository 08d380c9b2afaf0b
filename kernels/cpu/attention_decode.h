/* kernels/cpu/attention_decode.h — split-K paged attention decode: work items, per-partition
 * online-softmax state, and the merge. Private to kernels/cpu. */
#ifndef PD_KERNELS_CPU_ATTENTION_DECODE_H
#define PD_KERNELS_CPU_ATTENTION_DECODE_H

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/isa.h"
#include "kernels/paged_impl.h"

#define PD_ATTN_MAX_HEAD  256 /* head sizes the vector kernel handles (multiples of 8) */
#define PD_ATTN_MAX_GROUP 16  /* query heads per kv head */
#define PD_ATTN_MAX_BLOCK 256 /* tokens per block */
/* --batch-invariant: blocks per decode partition, whatever the batch (otherwise the batch's total
 * blocks over 4 items per thread, at least 8) */
#define PD_ATTN_INV_PART_BLOCKS 8

/* A contiguous range of one sequence's blocks, all heads. */
typedef struct pd_attn_decode_item {
    int seq;
    int64_t block_begin, block_end; /* block-table indices [begin, end) */
} pd_attn_decode_item_t;

/* Online softmax state of one item: per query head, running max, sum and weighted V sum. */
typedef struct pd_attn_partial {
    float *m;   /* [num_heads] */
    float *l;   /* [num_heads] */
    float *acc; /* [num_heads][head_size], not yet divided by l */
} pd_attn_partial_t;

/* The keys of block-table entry b that the new token at pos sees (first: its first visible key),
 * as [*lo, *hi] within the block; false when it sees none there. */
static inline bool pd_attn_block_keys(int64_t b, int block_size, int64_t first, int64_t pos, int *lo, int *hi)
{
    int64_t j0 = b * block_size;
    *lo = first > j0 ? (int)(first - j0) : 0;
    *hi = pos < j0 + block_size - 1 ? (int)(pos - j0) : block_size - 1; /* inclusive */
    return *hi >= *lo;
}

/* Where plane (0 = K, 1 = V) of sequence s's block-table entry b starts in the cache. */
static inline const char *pd_attn_block_plane(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int s,
                                              int64_t b, int plane)
{
    int64_t block = meta->block_tables[(int64_t)s * meta->max_blocks_per_seq + b];
    return (const char *)kv->base +
           (size_t)pd_kv_index(block, plane, 0, 0, kv->block_size, kv->num_kv_heads, kv->head_size) *
               (size_t)pd_dtype_size(kv->dtype);
}

/* Prefetches the whole pages of an item's first n blocks (into L1, or L2 when !l1), which no
 * earlier block of the item prefetched: asked for all at once rather than line by line as the
 * loads reach them. Each item does so for itself as it starts, and the decode loop for the item
 * its thread most likely takes next. Short sequences are mostly first blocks (batch 32 of the
 * demo model at 64-128 keys: 13 % and then another ~10 % less time in attention,
 * bench/RESULTS.md 2026-11-27). */
static inline void pd_attn_prefetch_first_pages(const pd_attn_decode_item_t *it, const pd_kv_view_t *kv,
                                                const pd_attn_meta_t *meta, int n, bool l1)
{
    size_t page_bytes =
        (size_t)2 * kv->block_size * kv->num_kv_heads * kv->head_size * pd_dtype_size(kv->dtype);
    for (int64_t b = it->block_begin; b < it->block_end && b < it->block_begin + n; b++) {
        const char *page = pd_attn_block_plane(kv, meta, it->seq, b, 0);
        for (size_t off = 0; off < page_bytes; off += 64) {
            if (l1) {
                __builtin_prefetch(page + off, 0, 3);
            } else {
                __builtin_prefetch(page + off, 0, 2);
            }
        }
    }
}

/* An item's state before its first key: m = −∞, l = 0, acc = 0 for every head. */
static inline void pd_attn_partial_reset(pd_attn_partial_t *part, int num_heads, int head_size)
{
    for (int h = 0; h < num_heads; h++) {
        part->m[h] = -INFINITY;
        part->l[h] = 0;
    }
    memset(part->acc, 0, (size_t)num_heads * head_size * sizeof(float));
}

/* Whether the AVX2/FMA/F16C kernel runs here for this shape. */
int pd_cpu_attn_decode_x86_usable(int head_size, int group);

/* Runs one item with AVX2 intrinsics, reading the pages in place (16-bit caches are widened in
 * registers); with bf16 set (a bf16 cache), in bf16 attention math (attention_bf16.h): m and l are
 * then log2-domain. scratch is the portable kernel's and is not used here. */
void pd_cpu_attn_decode_x86_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                 const pd_attn_meta_t *meta, int num_heads, float scale, int bf16,
                                 pd_attn_partial_t *part, float *scratch);

/* Whether the AVX-512 kernel (attention_decode_x512.c) runs here for this shape. */
int pd_cpu_attn_decode_x512_usable(int head_size, int group);

/* Runs one item with AVX-512, the query heads of each kv head's group in register tiles of four;
 * the same contract as pd_cpu_attn_decode_x86_item, except that scratch must hold num_heads ×
 * head_size floats (the pre-scaled queries). */
void pd_cpu_attn_decode_x512_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                  const pd_attn_meta_t *meta, int num_heads, float scale, int bf16,
                                  pd_attn_partial_t *part, float *scratch);

/* Whether the AVX512-BF16 item below runs here for this shape (a multiple of 32 wide heads). */
int pd_cpu_attn_decode_dot_usable(int head_size, int group);

/* Runs one item of a bf16 cache under bf16 attention math (m and l log2-domain) with vdpbf16ps
 * for both products (attention_decode_x512.c); the contract of pd_cpu_attn_decode_x512_item. */
void pd_cpu_attn_decode_dot_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                 const pd_attn_meta_t *meta, int num_heads, float scale,
                                 pd_attn_partial_t *part, float *scratch);

/* The decode item kernels as a variant table (issue 45; the matmul's is matmul_variants.h): each
 * entry names a kernel, the instruction-set level it needs, the caches it serves (dtype, head size,
 * group, block size; bf16: under bf16 attention math) and its function with one signature.
 * pd_cpu_paged_attention_decode runs the first entry the host can run that serves the call. */
typedef struct pd_cpu_attn_decode_variant {
    const char *name;
    pd_cpu_isa_t isa;
    bool (*serves)(const pd_kv_view_t *kv, int bf16, int group);
    void (*run)(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                const pd_attn_meta_t *meta, int num_heads, float scale, int bf16, pd_attn_partial_t *part,
                float *scratch);
    const char *what;
} pd_cpu_attn_decode_variant_t;

extern const pd_cpu_attn_decode_variant_t pd_cpu_attn_decode_variants[];
extern const int pd_cpu_num_attn_decode_variants;

/* The entry the decode runs for this cache (never NULL: the portable one serves every cache). */
const pd_cpu_attn_decode_variant_t *pd_cpu_attn_decode_choose(const pd_kv_view_t *kv, int bf16, int group);

/* Test hook: pd_cpu_paged_attention_decode runs entry `variant` of the table (the caller checked
 * that the host can run it and that it serves the cache); -1 (the default): the table's choice. */
void pd_cpu_attn_decode_force(int variant);

#endif
