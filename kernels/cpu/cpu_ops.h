/* kernels/cpu/cpu_ops.h — the CPU backend's ops: a plain reference (_ref) and an optimized
 * version of each, with the signatures of pd_backend_ops_t (kernels/backend.h). The reference is
 * the specification; tests compare the optimized op against it on random inputs. */
#ifndef PD_KERNELS_CPU_OPS_H
#define PD_KERNELS_CPU_OPS_H

#include "kernels/backend.h"
#include "kernels/cpu/isa.h"

#define PD_CPU_OP_PAIR(ret, name, ...)                                                                       \
    ret pd_cpu_##name##_ref(pd_backend_t *be, __VA_ARGS__);                                                  \
    ret pd_cpu_##name(pd_backend_t *be, __VA_ARGS__)

PD_CPU_OP_PAIR(pd_status_t, embed, float *out, pd_weight_t table, float scale, const int32_t *ids, int n,
               int dim, int vocab);
PD_CPU_OP_PAIR(pd_status_t, matmul, float *y, const float *x, pd_weight_t w, const float *bias, int m, int n,
               int k);
PD_CPU_OP_PAIR(pd_status_t, add, float *y, const float *x, size_t n);
PD_CPU_OP_PAIR(pd_status_t, rmsnorm, float *out, const float *x, const float *w, int rows, int dim,
               float eps);
PD_CPU_OP_PAIR(pd_status_t, layernorm, float *out, const float *x, const float *w, const float *b, int rows,
               int dim, float eps);
PD_CPU_OP_PAIR(pd_status_t, rope, float *x, const int32_t *positions, int num_tokens, int num_heads,
               int head_size, const pd_rope_t *rope);
PD_CPU_OP_PAIR(pd_status_t, gelu, float *x, size_t n);
PD_CPU_OP_PAIR(pd_status_t, silu_mul, float *out, const float *gate_up, int rows, int inter);
PD_CPU_OP_PAIR(pd_status_t, gelu_mul, float *out, const float *gate_up, int rows, int inter);
PD_CPU_OP_PAIR(pd_status_t, softmax, float *x, int rows, int cols);
PD_CPU_OP_PAIR(pd_status_t, reshape_and_cache, const pd_kv_view_t *kv, const float *k, const float *v,
               const int32_t *slot_mapping, int num_tokens);
PD_CPU_OP_PAIR(pd_status_t, paged_attention_prefill, float *out, const float *q, const pd_kv_view_t *kv,
               const pd_attn_meta_t *meta, int num_heads, float scale);
PD_CPU_OP_PAIR(pd_status_t, paged_attention_decode, float *out, const float *q, const pd_kv_view_t *kv,
               const pd_attn_meta_t *meta, int num_heads, float scale);
PD_CPU_OP_PAIR(pd_status_t, sample, int32_t *tokens_out, float *logits, int n, int vocab,
               const pd_sampling_params_t *params, pd_rng_t *rngs);
PD_CPU_OP_PAIR(pd_status_t, gather_pages, void *dst, const void *region, const pd_page_range_t *ranges,
               int n);
PD_CPU_OP_PAIR(pd_status_t, scatter_pages, void *region, const void *src, const pd_page_range_t *ranges,
               int n);
/* prepare_weight of the optimized backend (pd_backend_ops_t), on an AVX-512 CPU: bf16 weights of a
 * shape that fits go to PD_WEIGHT_PAIRS32 (matmul_bf16p.h: fp32 math; bf16 math when k % 32 == 0,
 * for the packed dot kernels, and oneDNN when every row is in a block), int8 and fp32 ones to
 * PD_WEIGHT_COLS32 (matmul_cols32.h); others stay row-major. PD_CPU_WEIGHT_PACKING=0 keeps all
 * row-major. */
pd_status_t pd_cpu_prepare_weight(pd_backend_t *be, pd_weight_t *w, int64_t rows, int64_t cols,
                                  int64_t slice_rows);

/* Mirror copy (pd_backend_ops_t.copy_pages): host to host, so one version. */
pd_status_t pd_cpu_copy_pages(pd_backend_t *be, void *dst, const void *src, const pd_page_range_t *ranges,
                              int n, pd_copy_kind_t kind);

/* paged_attention_prefill in bf16 attention math (kernels/cpu/attention_bf16.h), plainly: one
 * query row at a time, double sums, libm's exp2. The oracle of the optimized paths when
 * be->matmul_precision is bf16 and the cache is bf16 (the ops follow it then); kv must be bf16. */
pd_status_t pd_cpu_paged_attention_bf16_ref(pd_backend_t *be, float *out, const float *q,
                                            const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                            float scale);

/* Checks attention metadata against the view: query/context lengths consistent, every block id the
 * step will read inside [0, num_blocks), tables wide enough. Logs the first problem found. */
pd_status_t pd_cpu_attn_validate(const pd_kv_view_t *kv, const pd_attn_meta_t *meta, int num_heads,
                                 int decode_only);

/* The "cpu" backend's private state (be->impl; NULL for "cpu-ref", whose ops keep nothing, and for a
 * backend object made by hand: the ops then run uncached). */
typedef struct pd_cpu_rope_cache pd_cpu_rope_cache_t; /* rope.c: the last batch's cos/sin */
typedef struct pd_cpu_state {
    pd_cpu_rope_cache_t *rope;
} pd_cpu_state_t;

pd_status_t pd_cpu_rope_cache_create(pd_cpu_rope_cache_t **out);
void pd_cpu_rope_cache_destroy(pd_cpu_rope_cache_t *c);

/* Sets be up as the CPU backend (reference: the plain ops; num_threads <= 0: all cores); fini frees
 * what init made (be->impl), not the object. */
pd_status_t pd_cpu_backend_init(pd_backend_t *be, int num_threads, bool reference);
void pd_cpu_backend_fini(pd_backend_t *be);

/* The greedy argmax's variant table (sample.c; the first entry the host can run is used): the first
 * index of a row's maximum, NaN never winning (pd_sample_argmax). */
typedef struct pd_cpu_argmax_variant {
    const char *name;
    pd_cpu_isa_t isa;
    int32_t (*run)(const float *z, int vocab);
} pd_cpu_argmax_variant_t;
extern const pd_cpu_argmax_variant_t pd_cpu_argmax_variants[];
extern const int pd_cpu_num_argmax_variants;

#endif
