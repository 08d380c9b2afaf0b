/* kernels/paged_impl.h — paged KV cache index math shared by kernels/cpu and kernels/cuda.
 *
 * Layer layout (DESIGN.md §3): [num_blocks][2][block_size][num_kv_heads][head_size]; plane 0 is K,
 * plane 1 is V, so one (layer, block) page — K and V together — is one contiguous transfer unit.
 * A slot is block_id × block_size + offset; slot < 0 marks a padding token. */
#ifndef PD_KERNELS_PAGED_IMPL_H
#define PD_KERNELS_PAGED_IMPL_H

#include <stdint.h>

#include "kernels/pd_hd.h"

/* Elements in one page of one layer: K and V planes of block_size tokens. */
PD_HD static inline int64_t pd_page_elems(int block_size, int num_kv_heads, int head_size)
{
    return 2 * (int64_t)block_size * num_kv_heads * head_size;
}

PD_HD static inline int64_t pd_slot_block(int64_t slot, int block_size)
{
    return slot / block_size;
}

PD_HD static inline int pd_slot_offset_in_block(int64_t slot, int block_size)
{
    return (int)(slot % block_size);
}

/* Element index of (block, plane 0=K/1=V, token offset, kv head, dim 0) in a layer view. */
PD_HD static inline int64_t pd_kv_index(int64_t block, int plane, int offset, int kv_head, int block_size,
                                        int num_kv_heads, int head_size)
{
    return (((block * 2 + plane) * block_size + offset) * num_kv_heads + kv_head) * (int64_t)head_size;
}

/* Element index of the K row (plane 0) or V row (plane 1) that slot writes for kv_head. */
PD_HD static inline int64_t pd_slot_kv_index(int64_t slot, int plane, int kv_head, int block_size,
                                             int num_kv_heads, int head_size)
{
    return pd_kv_index(pd_slot_block(slot, block_size), plane, pd_slot_offset_in_block(slot, block_size),
                       kv_head, block_size, num_kv_heads, head_size);
}

/* GQA: the kv head that query head q_head reads (num_heads is a multiple of num_kv_heads). */
PD_HD static inline int pd_gqa_kv_head(int q_head, int num_heads, int num_kv_heads)
{
    return q_head / (num_heads / num_kv_heads);
}

/* Block id holding token position pos of sequence seq, from a [num_seqs][max_blocks] table. */
PD_HD static inline int32_t pd_block_table_lookup(const int32_t *block_tables, int max_blocks_per_seq,
                                                  int seq, int64_t pos, int block_size)
{
    return block_tables[(int64_t)seq * max_blocks_per_seq + pos / block_size];
}

/* Slot of token position pos of sequence seq (the value slot_mapping holds for it). */
PD_HD static inline int64_t pd_block_table_slot(const int32_t *block_tables, int max_blocks_per_seq, int seq,
                                                int64_t pos, int block_size)
{
    return (int64_t)pd_block_table_lookup(block_tables, max_blocks_per_seq, seq, pos, block_size) *
               block_size +
           pos % block_size;
}

/* Number of blocks needed to hold n tokens. */
PD_HD static inline int64_t pd_blocks_for_tokens(int64_t n, int block_size)
{
    return (n + block_size - 1) / block_size;
}

/* Absolute position of the i-th new token of a sequence with seq_len tokens of context
 * (including its q_len new ones): new tokens are the last q_len positions. */
PD_HD static inline int64_t pd_query_pos(int64_t seq_len, int q_len, int i)
{
    return seq_len - q_len + i;
}

/* First key position visible to a query at pos: 0, or pos - window + 1 with a sliding window. */
PD_HD static inline int64_t pd_attn_first_key(int64_t pos, int sliding_window)
{
    int64_t first = sliding_window > 0 ? pos - sliding_window + 1 : 0;
    return first > 0 ? first : 0;
}

#endif
