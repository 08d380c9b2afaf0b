/* kernels/cpu/matmul_variants.h — the CPU matmul's variant table (issue 45, ggml-backend's
 * supports_op by table): each entry names a kernel, the instruction-set level it needs, the weights
 * and row counts it serves (in words and as a predicate) and its function. pd_cpu_matmul runs the
 * first entry, in table order, that the host can run and that serves the call; nothing else chooses
 * a matmul kernel. The order is the preference: measured fastest first (bench/RESULTS.md).
 *
 * tests/unit/test_kernels.c runs every entry the host can run on every shape it serves, against
 * pd_cpu_matmul_ref and the dispatcher's choice, and names each entry it cannot run. */
#ifndef PD_KERNELS_CPU_MATMUL_VARIANTS_H
#define PD_KERNELS_CPU_MATMUL_VARIANTS_H

#include <stdbool.h>

#include "kernels/backend.h"
#include "kernels/cpu/isa.h"

/* inv_rows of an entry that hands its rows to other entries (which batch-invariant mode chunks) */
#define PD_INV_ROWS_ANY (1 << 30)

typedef struct pd_cpu_matmul_variant {
    const char *name;
    pd_cpu_isa_t isa; /* the level it needs (pd_cpu_isa_usable) */
    bool bf16_math;   /* --matmul-precision bf16 on bf16 weights; else fp32 math (every other case) */
    /* another capability it needs beyond the level (oneDNN's own detection), or NULL */
    bool (*needs)(void);
    /* whether it serves w (dtype, layout) at m rows; be for the precision and thread count */
    bool (*serves)(const pd_backend_t *be, const pd_weight_t *w, int m, int n, int k);
    pd_status_t (*run)(pd_backend_t *be, float *y, const float *x, pd_weight_t w, const float *bias, int m,
                       int n, int k);
    /* --batch-invariant: the most rows one call may have for which every row comes out bitwise as it
     * does alone (this entry at one row: same products, same order of sums), or 0 when a row's bits
     * depend on its batch (sgemm, oneDNN, AMX tiles). test_matmul_row_invariant holds each entry to it. */
    int inv_rows;
    const char *what; /* what it serves and how, for logs and test output */
} pd_cpu_matmul_variant_t;

extern const pd_cpu_matmul_variant_t pd_cpu_matmul_variants[];
extern const int pd_cpu_num_matmul_variants;

/* Whether this host (and the ISA cap) can run v. */
bool pd_cpu_matmul_variant_usable(const pd_cpu_matmul_variant_t *v);

/* The entry pd_cpu_matmul runs for these arguments, or NULL (none serves them: PD_ERR_UNSUPPORTED).
 * Under be->batch_invariant it is chosen without looking at m: the first entry with inv_rows that
 * serves one row and inv_rows rows, which pd_cpu_matmul then runs on at most inv_rows rows at a time,
 * so a row's result is the same in every batch, chunk and step (vLLM's VLLM_BATCH_INVARIANT). */
const pd_cpu_matmul_variant_t *pd_cpu_matmul_choose(const pd_backend_t *be, const pd_weight_t *w, int m,
                                                    int n, int k);

#endif
