/* kernels/cpu/backend_cpu.c — the CPU backends' memory functions and their two tables:
 * "cpu" (optimized ops) and "cpu-ref" (the reference ops, for tests and as a specification). */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/huge_alloc.h"
#include "common/log.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/matmul_bf16.h"  /* pd_cpu_bf16dot_usable */
#include "kernels/cpu/matmul_bf16p.h" /* pd_cpu_amx_usable */
#include "kernels/cpu/matmul_lowp.h"  /* pd_cpu_lowp_x86_usable */
#include "kernels/cpu/matmul_variants.h"
#include "kernels/cpu/simd.h" /* pd_cpu_avx512_usable */

int pd_cpu_isa_usable(pd_cpu_isa_t isa)
{
    switch (isa) {
    case PD_ISA_PORTABLE: return 1;
    case PD_ISA_AVX2: return pd_cpu_lowp_x86_usable();
    case PD_ISA_AVX512: return pd_cpu_avx512_usable();
    case PD_ISA_AVX512_BF16: return pd_cpu_bf16dot_usable();
    case PD_ISA_AMX: return pd_cpu_amx_usable() && pd_cpu_bf16dot_usable();
    }
    return 0;
}

pd_cpu_isa_t pd_cpu_isa_level(void)
{
    pd_cpu_isa_t level = PD_ISA_PORTABLE;
    for (int i = PD_ISA_AVX2; i <= PD_ISA_AMX && pd_cpu_isa_usable((pd_cpu_isa_t)i); i++) {
        level = (pd_cpu_isa_t)i;
    }
    return level;
}

/* The start-up line: the level the kernels run at, and which matmul variants run here. Once per
 * process (the answer cannot change). */
static void log_kernels(void)
{
    static int logged;
    if (__atomic_exchange_n(&logged, 1, __ATOMIC_ACQ_REL)) {
        return;
    }
    char on[512] = "", off[512] = "";
    size_t a = 0, b = 0;
    for (int i = 0; i < pd_cpu_num_matmul_variants; i++) {
        const pd_cpu_matmul_variant_t *v = &pd_cpu_matmul_variants[i];
        if (pd_cpu_matmul_variant_usable(v)) {
            a += (size_t)snprintf(on + a, a < sizeof(on) ? sizeof(on) - a : 0, "%s%s", a ? " " : "", v->name);
        } else {
            b += (size_t)snprintf(off + b, b < sizeof(off) ? sizeof(off) - b : 0, "%s%s", b ? " " : "",
                                  v->name);
        }
    }
    pd_log_info("cpu kernels: %s (cap %s, --cpu-isa / PD_CPU_ISA); matmul variants: %s; not here: %s",
                pd_cpu_isa_name(pd_cpu_isa_level()), pd_cpu_isa_name(pd_cpu_isa_cap()), on, b ? off : "none");
}
/* Every allocation carries a 64-byte header holding its size, for the peak accounting that the
 * memory profiler reads (bytes_in_use / bytes_peak). */
#define CPU_ALLOC_HEADER 64

/* Allocations of at least PD_HUGE_PAGE are asked to be backed by transparent huge pages (weights,
 * KV cache, big workspaces; common/huge_alloc.h): a batch-1 decode streams every weight once per
 * token, and with 4 KiB pages the TLB misses of four interleaved row streams cost ~10 % of the
 * bandwidth. */
static pd_status_t cpu_alloc(pd_backend_t *be, size_t bytes, void **ptr_out)
{
    void *p = bytes > SIZE_MAX - CPU_ALLOC_HEADER ? NULL : pd_huge_alloc(bytes + CPU_ALLOC_HEADER, 64);
    if (p == NULL) {
        pd_log_error("cpu backend: cannot allocate %zu bytes", bytes);
        return PD_ERR_NO_MEMORY;
    }
    *(size_t *)p = bytes;
    size_t in_use = __atomic_add_fetch(&be->bytes_in_use, bytes, __ATOMIC_RELAXED);
    size_t peak = __atomic_load_n(&be->bytes_peak, __ATOMIC_RELAXED);
    while (in_use > peak && !__atomic_compare_exchange_n(&be->bytes_peak, &peak, in_use, 1, __ATOMIC_RELAXED,
                                                         __ATOMIC_RELAXED)) {
    }
    *ptr_out = (char *)p + CPU_ALLOC_HEADER;
    return PD_OK;
}

static void cpu_free(pd_backend_t *be, void *ptr)
{
    if (ptr == NULL) {
        return;
    }
    void *p = (char *)ptr - CPU_ALLOC_HEADER;
    __atomic_sub_fetch(&be->bytes_in_use, *(size_t *)p, __ATOMIC_RELAXED);
    free(p);
}

static pd_status_t cpu_copy(pd_backend_t *be, void *dst, const void *src, size_t bytes, pd_copy_kind_t kind)
{
    memmove(dst, src, bytes);
    return PD_OK;
}

static pd_status_t cpu_synchronize(pd_backend_t *be)
{
    return PD_OK;
}

static const pd_backend_ops_t cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .synchronize = cpu_synchronize,
    .prepare_weight = pd_cpu_prepare_weight,
    .embed = pd_cpu_embed,
    .matmul = pd_cpu_matmul,
    .add = pd_cpu_add,
    .rmsnorm = pd_cpu_rmsnorm,
    .layernorm = pd_cpu_layernorm,
    .rope = pd_cpu_rope,
    .gelu = pd_cpu_gelu,
    .silu_mul = pd_cpu_silu_mul,
    .gelu_mul = pd_cpu_gelu_mul,
    .softmax = pd_cpu_softmax,
    .reshape_and_cache = pd_cpu_reshape_and_cache,
    .paged_attention_prefill = pd_cpu_paged_attention_prefill,
    .paged_attention_decode = pd_cpu_paged_attention_decode,
    .sample = pd_cpu_sample,
    .gather_pages = pd_cpu_gather_pages,
    .scatter_pages = pd_cpu_scatter_pages,
    .copy_pages = pd_cpu_copy_pages,
};

static const pd_backend_ops_t cpu_ref_ops = {
    .name = "cpu-ref",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy = cpu_copy,
    .synchronize = cpu_synchronize,
    .embed = pd_cpu_embed_ref,
    .matmul = pd_cpu_matmul_ref,
    .add = pd_cpu_add_ref,
    .rmsnorm = pd_cpu_rmsnorm_ref,
    .layernorm = pd_cpu_layernorm_ref,
    .rope = pd_cpu_rope_ref,
    .gelu = pd_cpu_gelu_ref,
    .silu_mul = pd_cpu_silu_mul_ref,
    .gelu_mul = pd_cpu_gelu_mul_ref,
    .softmax = pd_cpu_softmax_ref,
    .reshape_and_cache = pd_cpu_reshape_and_cache_ref,
    .paged_attention_prefill = pd_cpu_paged_attention_prefill_ref,
    .paged_attention_decode = pd_cpu_paged_attention_decode_ref,
    .sample = pd_cpu_sample_ref,
    .gather_pages = pd_cpu_gather_pages_ref,
    .scatter_pages = pd_cpu_scatter_pages_ref,
    .copy_pages = pd_cpu_copy_pages,
};

pd_status_t pd_cpu_backend_init(pd_backend_t *be, int num_threads, bool reference)
{
    be->ops = reference ? &cpu_ref_ops : &cpu_ops;
    be->num_threads = num_threads > 0 ? num_threads : omp_get_num_procs();
    be->host_memory = true;
    /* without bf16 arithmetic the fallback kernels sum each row count in its own fp32 order, which
     * bf16 rounding of the next layer's input turns into visible differences between a request
     * alone and batched (issue 45); the reference backend is the specification of bf16 math */
    be->bf16_math_native = reference || pd_cpu_bf16dot_usable();
#if defined(__SANITIZE_THREAD__)
    /* libgomp and OpenBLAS are not TSan-instrumented: their internal synchronisation shows up as
     * false races. TSan builds run ops on one thread and check pdserve's own threads. */
    if (be->num_threads > 1) {
        pd_log_info(
            "cpu backend: TSan build, ops run single-threaded (OpenMP/OpenBLAS are not instrumented)");
        be->num_threads = 1;
    }
#endif
    /* one thread pool (OpenMP): OpenBLAS runs single-threaded inside it (kernels/cpu/matmul.c) */
    openblas_set_num_threads(1);
    if (reference) {
        return PD_OK;
    }
    log_kernels();
    pd_cpu_state_t *state = calloc(1, sizeof(*state));
    if (state == NULL) {
        pd_log_error("cpu backend: cannot allocate its state");
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = pd_cpu_rope_cache_create(&state->rope);
    if (st != PD_OK) {
        free(state);
        return st;
    }
    be->impl = state;
    return PD_OK;
}

void pd_cpu_backend_fini(pd_backend_t *be)
{
    pd_cpu_state_t *state = be->impl;
    if (state != NULL) {
        pd_cpu_rope_cache_destroy(state->rope);
        free(state);
        be->impl = NULL;
    }
}

void pd_backend_reset_peak(pd_backend_t *be)
{
    __atomic_store_n(&be->bytes_peak, __atomic_load_n(&be->bytes_in_use, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}
