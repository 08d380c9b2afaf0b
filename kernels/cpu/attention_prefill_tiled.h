/* kernels/cpu/attention_prefill_tiled.h — the GEMM-tiled prefill attention item
 * (attention_prefill_tiled.c), which attention.c's prefill uses for sequences with at least
 * ATTN_MM_MIN_Q new tokens (shorter ones — decode tokens, small chunks — keep the per-key item). */
#ifndef PD_KERNELS_CPU_ATTENTION_PREFILL_TILED_H
#define PD_KERNELS_CPU_ATTENTION_PREFILL_TILED_H

#include <stddef.h>

#include "kernels/backend.h"
#include "kernels/cpu/isa.h"

#define ATTN_MM_TQ    64  /* query tokens per item (× the GQA group = the GEMMs' M) */
#define ATTN_MM_KT    128 /* keys per tile (the S GEMM's N, the P·V GEMM's K) */
#define ATTN_MM_MIN_Q 32  /* sequences with fewer new tokens use the per-key item */

/* Test and benchmark hook: 0 sends every sequence to the per-key item (the tiled item's
 * predecessor), 1 (default) uses the tiled item from ATTN_MM_MIN_Q new tokens on. */
void pd_cpu_attn_allow_tiled(int allow);

/* The tiled item's product engines as a variant table (issue 45; the decode items' is
 * attention_decode.h): each entry names the engine that computes S = Q·Kᵀ and O += P·V, the
 * instruction-set level it needs and the calls it serves (bf16: under bf16 attention math; the
 * head size). pd_cpu_attn_tiled_run uses the first entry the host can run that serves the call;
 * the plain-sgemm one serves every call (bf16 math on it: the bf16-rounded values in fp32 GEMMs). */
typedef enum pd_attn_mm_engine {
    PD_ATTN_MM_AMX = 0,   /* bf16 tiles (both products) */
    PD_ATTN_MM_DNNL_BF16, /* oneDNN bf16 GEMMs where the CPU has native bf16 */
    PD_ATTN_MM_SGEMM,     /* OpenBLAS sgemm on fp32 copies */
} pd_attn_mm_engine_t;

typedef struct pd_cpu_attn_mm_variant {
    const char *name;
    pd_cpu_isa_t isa;
    pd_attn_mm_engine_t engine;
    int (*serves)(int bf16, int head_size); /* besides the level: what the engine itself needs */
    const char *what;
} pd_cpu_attn_mm_variant_t;

extern const pd_cpu_attn_mm_variant_t pd_cpu_attn_mm_variants[];
extern const int pd_cpu_num_attn_mm_variants;

/* The entry the tiled item uses for this call (never NULL). */
const pd_cpu_attn_mm_variant_t *pd_cpu_attn_mm_choose(int bf16, int head_size);

/* Test hook: the tiled item uses entry `variant` (the caller checked the host can run it and it
 * serves the call); -1 (the default): the table's choice. */
void pd_cpu_attn_mm_force(int variant);

/* Floats of per-thread scratch one item needs. */
size_t pd_cpu_attn_tiled_scratch_floats(int group, int head_size);

/* Computes out rows of query tokens [q_begin, q_end) (at most ATTN_MM_TQ) of sequence seq for the
 * query heads of kv_head's group, as paged_attention_prefill defines them; with bf16 set, in bf16
 * attention math (attention_bf16.h; the cache is bf16). meta was validated. PD_OK, or oneDNN's
 * failure status (logged there). */
pd_status_t pd_cpu_attn_tiled_run(float *out, const float *q, const pd_kv_view_t *kv,
                                  const pd_attn_meta_t *meta, int num_heads, float scale, int bf16, int seq,
                                  int kv_head, int q_begin, int q_end, float *scratch);

#endif
