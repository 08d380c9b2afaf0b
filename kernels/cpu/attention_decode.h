/* kernels/cpu/attention_decode.h — split-K paged attention decode: work items, per-partition
 * online-softmax state, and the merge. Private to kernels/cpu. */
#ifndef PD_KERNELS_CPU_ATTENTION_DECODE_H
#define PD_KERNELS_CPU_ATTENTION_DECODE_H

#include "kernels/backend.h"

#define PD_ATTN_MAX_HEAD  256 /* head sizes the vector kernel handles (multiples of 8) */
#define PD_ATTN_MAX_GROUP 16  /* query heads per kv head */
#define PD_ATTN_MAX_BLOCK 256 /* tokens per block */

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

/* Whether the AVX2/FMA/F16C kernel runs here for this shape. */
int pd_cpu_attn_decode_x86_usable(int head_size, int group);

/* Runs one item with AVX2 intrinsics, reading the pages in place (16-bit caches are widened in
 * registers); with bf16 set (a bf16 cache), in bf16 attention math (attention_bf16.h): m and l are
 * then log2-domain. scratch is the portable kernel's and is not used here. */
void pd_cpu_attn_decode_x86_item(const pd_attn_decode_item_t *it, const float *q, const pd_kv_view_t *kv,
                                 const pd_attn_meta_t *meta, int num_heads, float scale, int bf16,
                                 pd_attn_partial_t *part, float *scratch);

/* Test hook: 0 forces the portable item kernel even where AVX2 is available. */
void pd_cpu_attn_allow_x86(int allow);

#endif
