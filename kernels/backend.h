/* kernels/backend.h — one function table per compute backend (DESIGN.md §4), ggml-backend style.
 * The model calls only this table. Activations are plain fp32 pointers in the backend's memory;
 * weight matrices (pd_weight_t) and the KV cache may be fp32, fp16 or bf16 — compute and
 * accumulation are fp32 whatever the storage. Metadata arrays (positions, block tables, slot
 * mappings, sampling parameters) are host memory; a device backend copies what it needs.
 * Every op validates indices that could address memory (token ids, slots, block ids) and fails
 * with PD_ERR_OUT_OF_RANGE, logged once, without writing anything. */
#ifndef PD_KERNELS_BACKEND_H
#define PD_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/page_range.h"
#include "common/rng.h"
#include "common/sampling.h"
#include "common/status.h"
#include "kernels/dtype_impl.h"
#include "kernels/rope_impl.h"

typedef struct pd_backend pd_backend_t;

/* Math of matmul: fp32 inputs in memory, accumulation always fp32. BF16/FP16/TF32 let a device
 * round the inputs to that type for tensor-core math (cuBLAS COMPUTE_32F_FAST_*); relative error
 * ~1e-2 (bf16), ~1e-3 (fp16, tf32) instead of ~1e-6. */
typedef enum pd_matmul_precision {
    PD_MATMUL_FP32 = 0,
    PD_MATMUL_TF32,
    PD_MATMUL_BF16,
    PD_MATMUL_FP16,
} pd_matmul_precision_t;

/* Where element (r, c) of a [rows][cols] weight matrix lies in its data. */
typedef enum pd_weight_layout {
    PD_WEIGHT_ROWS = 0, /* data[r][c]: rows contiguous, as the checkpoint stores a Linear weight */
    /* bf16 only, cols even: the first packed_rows rows (a multiple of 32) in blocks of 32 rows, each
     * [cols / 2][32][2] — for every pair of columns (c, c + 1) the 32 rows' pairs in one 64-byte
     * line, so a kernel multiplies 32 outputs at once by broadcast inputs
     * (kernels/cpu/matmul_bf16p.h); the order of oneDNN's BA16a32b2a weights. The other rows
     * follow row-major, where they would be anyway. Chosen by the backend's prepare_weight. */
    PD_WEIGHT_PAIRS32 = 1,
    /* int8 or fp32: the first packed_rows rows (a multiple of 32) in blocks of 32 rows, each [cols][32]
     * — column c of the block's 32 rows in 32 bytes (int8: two columns per 64-byte line) or 128
     * bytes (fp32: two lines) (kernels/cpu/matmul_cols32.h). The other rows follow row-major. */
    PD_WEIGHT_COLS32 = 2,
} pd_weight_layout_t;

/* A weight matrix [rows][cols] in backend memory at its storage dtype (the checkpoint's precision:
 * fp32, bf16 or fp16; or int8 with --quantization int8), laid out as layout says. Element (r, c) is
 * that element widened to fp32, times scale[r] for int8 (symmetric per-output-channel scales). */
typedef struct pd_weight {
    const void *data;
    pd_dtype_t dtype;
    const float *scale;        /* int8: [rows]; NULL otherwise */
    pd_weight_layout_t layout; /* PD_WEIGHT_ROWS unless the backend rearranged the matrix */
    int64_t packed_rows;       /* PAIRS32 / COLS32: rows [0, packed_rows) are in blocks */
} pd_weight_t;

/* The weight from row `row` of w on, for a matrix `cols` wide (a slice of a fused weight). With a
 * blocked layout, row must be a multiple of 32 (a whole block: the same offset). */
static inline pd_weight_t pd_weight_rows(pd_weight_t w, int64_t row, int64_t cols)
{
    pd_weight_t r = {(const char *)w.data + row * cols * pd_dtype_size(w.dtype), w.dtype,
                     w.scale != NULL ? w.scale + row : NULL, w.layout,
                     w.packed_rows > row ? w.packed_rows - row : 0};
    return r;
}

/* The index in w's data of element (r, c) of w, a matrix cols wide. */
PD_HD static inline int64_t pd_weight_index(pd_weight_t w, int64_t r, int64_t c, int64_t cols)
{
    if (w.layout == PD_WEIGHT_PAIRS32 && r < w.packed_rows) {
        return (r & ~(int64_t)31) * cols + (c >> 1) * 64 + (r & 31) * 2 + (c & 1);
    }
    if (w.layout == PD_WEIGHT_COLS32 && r < w.packed_rows) {
        return (r & ~(int64_t)31) * cols + c * 32 + (r & 31);
    }
    return r * cols + c;
}

/* Element (r, c) of w (cols wide) as fp32, scale included: the reference ops' definition. */
PD_HD static inline float pd_weight_at(pd_weight_t w, int64_t r, int64_t c, int64_t cols)
{
    float v = pd_dtype_load(w.data, pd_weight_index(w, r, c, cols), w.dtype);
    return w.scale != NULL ? v * w.scale[r] : v;
}

/* One layer's view of the paged KV cache. */
typedef struct pd_kv_view {
    void *base; /* [num_blocks][2][block_size][num_kv_heads][head_size] of dtype */
    pd_dtype_t dtype;
    int32_t num_blocks;
    int32_t block_size;
    int32_t num_kv_heads;
    int32_t head_size;
} pd_kv_view_t;

/* Attention metadata of one step (varlen: sequences of different query and context lengths). */
typedef struct pd_attn_meta {
    int32_t num_seqs;
    int32_t num_tokens;          /* = cu_seqlens_q[num_seqs] */
    const int32_t *cu_seqlens_q; /* [num_seqs + 1] prefix sums of new tokens per sequence */
    const int32_t *seq_lens;     /* [num_seqs] context length including the new tokens */
    const int32_t *block_tables; /* [num_seqs][max_blocks_per_seq] block ids */
    int32_t max_blocks_per_seq;
    const int32_t *slot_mapping; /* [num_tokens] cache slot of each new token; < 0 = padding */
    int32_t sliding_window;      /* 0 = full attention */
    /* KV cache groups (hybrid models): layer l reads group g = layer_group[l]'s block tables at
     * block_tables + g × num_seqs × max_blocks_per_seq and slots at slot_mapping + g × num_tokens;
     * NULL = one group. The model resolves this per layer; kernels see one group's view. */
    const int32_t *layer_group;
} pd_attn_meta_t;

typedef enum pd_copy_kind {
    PD_COPY_H2D,
    PD_COPY_D2H,
    PD_COPY_D2D,
} pd_copy_kind_t;

typedef struct pd_backend_ops {
    const char *name;

    /* --- memory --- */
    /* Allocates bytes (64-byte aligned) of backend memory. PD_ERR_NO_MEMORY when it cannot. */
    pd_status_t (*alloc)(pd_backend_t *be, size_t bytes, void **ptr_out);
    /* Frees what alloc returned; NULL is a no-op. */
    void (*free)(pd_backend_t *be, void *ptr);
    /* Copies bytes between host and backend memory (blocking). */
    pd_status_t (*copy)(pd_backend_t *be, void *dst, const void *src, size_t bytes, pd_copy_kind_t kind);
    /* Waits for every queued op. */
    pd_status_t (*synchronize)(pd_backend_t *be);
    /* Optional (NULL: weights stay as loaded). Called once per matrix the model multiplies by
     * (linear layers, lm_head), after loading and before any op reads it, with w in
     * PD_WEIGHT_ROWS: may rearrange w's data in place into a layout this backend's matmul reads
     * faster, and set w->layout. pd_weight_at(w, r, c) is unchanged. slice_rows: the model also
     * multiplies by slices of it starting at multiples of this row (pd_weight_rows; 0: none), so
     * a layout must keep those rows at their row-major offsets. */
    pd_status_t (*prepare_weight)(pd_backend_t *be, pd_weight_t *w, int64_t rows, int64_t cols,
                                  int64_t slice_rows);

    /* --- ops (shapes in brackets; rows are contiguous) --- */
    /* out[n][dim] = table[ids[i]][dim] · scale (fp32; Gemma scales by √hidden); any id outside
     * [0, vocab) fails. */
    pd_status_t (*embed)(pd_backend_t *be, float *out, pd_weight_t table, float scale, const int32_t *ids,
                         int n, int dim, int vocab);
    /* y[m][n] = x[m][k] · w[n][k]ᵀ (+ bias[n]); w is a Linear weight [out][in] of any storage
     * dtype, widened to fp32 (fp32 accumulate; a device may round x per matmul_precision). */
    pd_status_t (*matmul)(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias, int m,
                          int n, int k);
    /* y[n] += x[n] (residual). */
    pd_status_t (*add)(pd_backend_t *be, float *y, const float *x, size_t n);
    /* out[rows][dim] = x / sqrt(mean(x²) + eps) · w. out may alias x. */
    pd_status_t (*rmsnorm)(pd_backend_t *be, float *out, const float *x, const float *w, int rows, int dim,
                           float eps);
    /* out[rows][dim] = (x − mean) / sqrt(var + eps) · w + b. out may alias x. */
    pd_status_t (*layernorm)(pd_backend_t *be, float *out, const float *x, const float *w, const float *b,
                             int rows, int dim, float eps);
    /* In place on x[num_tokens][num_heads][head_size]: HF rotate-half RoPE at positions[num_tokens]
     * with the model's rotary table (rope->half == head_size / 2; kernels/rope_impl.h). */
    pd_status_t (*rope)(pd_backend_t *be, float *x, const int32_t *positions, int num_tokens, int num_heads,
                        int head_size, const pd_rope_t *rope);
    /* In place x[n] = GELU(x) (tanh approximation, "gelu_new"). */
    pd_status_t (*gelu)(pd_backend_t *be, float *x, size_t n);
    /* out[rows][inter] = silu(gate_up[r][0:inter]) · gate_up[r][inter:2·inter]. */
    pd_status_t (*silu_mul)(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter);
    /* out[rows][inter] = GELU-tanh(gate_up[r][0:inter]) · gate_up[r][inter:2·inter] (Gemma's MLP). */
    pd_status_t (*gelu_mul)(pd_backend_t *be, float *out, const float *gate_up, int rows, int inter);
    /* In place row-wise softmax of x[rows][cols]. */
    pd_status_t (*softmax)(pd_backend_t *be, float *x, int rows, int cols);
    /* Writes k, v [num_tokens][num_kv_heads][head_size] into kv at slot_mapping[num_tokens]
     * (slot < 0 skipped; a slot beyond the cache fails before anything is written). */
    pd_status_t (*reshape_and_cache)(pd_backend_t *be, const pd_kv_view_t *kv, const float *k, const float *v,
                                     const int32_t *slot_mapping, int num_tokens);
    /* Varlen paged attention: out, q [num_tokens][num_heads][head_size]. Query i of sequence s sits
     * at position seq_lens[s] − q_len + i and attends keys up to itself (causal, optional window),
     * read through block_tables. Works for any mix of prefill chunks and decode tokens. */
    pd_status_t (*paged_attention_prefill)(pd_backend_t *be, float *out, const float *q,
                                           const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                           float scale);
    /* Same contract for a batch where every sequence has exactly one new token. */
    pd_status_t (*paged_attention_decode)(pd_backend_t *be, float *out, const float *q,
                                          const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                          float scale);
    /* Samples one token per row of logits[n][vocab] (overwritten as scratch) with params[n] and
     * per-sequence generators rngs[n] (advanced once per sampled row; greedy rows draw nothing). */
    pd_status_t (*sample)(pd_backend_t *be, int32_t *tokens_out, float *logits, int n, int vocab,
                          const pd_sampling_params_t *params, pd_rng_t *rngs);
    /* Copies ranges[n] of region into dst back to back (gather) / from src into region (scatter). */
    pd_status_t (*gather_pages)(pd_backend_t *be, void *dst, const void *region,
                                const pd_page_range_t *ranges, int n);
    pd_status_t (*scatter_pages)(pd_backend_t *be, void *region, const void *src,
                                 const pd_page_range_t *ranges, int n);
    /* Copies ranges[n] from src to dst at the same offsets (two regions of one layout, e.g. the
     * KV cache and its host staging mirror); kind says which side is backend memory. Returns
     * when the bytes have landed. */
    pd_status_t (*copy_pages)(pd_backend_t *be, void *dst, const void *src, const pd_page_range_t *ranges,
                              int n, pd_copy_kind_t kind);
    /* Page-locks host memory the backend copies to/from often (a pipe's staging region), so copies
     * run at full speed; NULL when the backend has no use for it. unpin before freeing. */
    pd_status_t (*pin_host)(pd_backend_t *be, void *ptr, size_t bytes);
    void (*unpin_host)(pd_backend_t *be, void *ptr);
} pd_backend_ops_t;

struct pd_backend {
    const pd_backend_ops_t *ops;
    int num_threads;  /* CPU worker threads for ops (OpenMP) */
    bool host_memory; /* alloc returns memory the CPU (and so a host pipe) can address */
    /* the backend multiplies bf16 in hardware or as its specification (CPU: AVX512-BF16 or AMX, under
     * the PD_CPU_ISA cap; cpu-ref and CUDA: yes); the engine runs --matmul-precision bf16 as fp32 math
     * where it does not */
    bool bf16_math_native;
    pd_matmul_precision_t matmul_precision; /* set before the first op; the CPU backend is always fp32 */
    /* --batch-invariant (set before the first op): every op gives a row, a query, a token the same bits
     * whatever else is in its batch, however its prompt was chunked, prefill or decode (the CPU
     * backends; cuda refuses it) */
    bool batch_invariant;
    size_t memory_bytes; /* the device's memory the engine plans weights + KV in (0: host RAM, the CPU) */
    size_t bytes_in_use; /* allocator accounting, for memory profiling */
    size_t bytes_peak;
    void *impl; /* backend private state */
};

/* Creates a backend by name (kernels/registry.c): "auto" (the first of cuda, cpu with a device),
 * "cuda" (GPU builds), "cpu" (optimized) or "cpu-ref" (plain reference ops, for tests).
 * num_threads <= 0 means all cores. PD_ERR_NOT_FOUND for a name this build does not have. */
pd_status_t pd_backend_create(const char *name, int num_threads, pd_backend_t **be_out);

/* The backend "auto" stands for in this build on this machine (other names are returned as they
 * are), and how many devices a backend sees (0: none, or not in this build). */
const char *pd_backend_resolve(const char *name);
int pd_backend_device_count(const char *name);

/* Frees the backend object (not memory it handed out; free that first). */
void pd_backend_destroy(pd_backend_t *be);

/* Resets bytes_peak to bytes_in_use (start of a profile window). */
void pd_backend_reset_peak(pd_backend_t *be);

#endif
