/* kernels/cpu/matmul_dnnl.c — bf16 × bf16 → fp32 matmul through oneDNN's C API (matmul_dnnl.h).
 *
 * One oneDNN engine per process, created on first use and kept. A matmul primitive's row count m
 * is a run-time dimension, so one primitive per (n, k, bias, b layout, accumulate) serves every
 * batch size: a fixed-m brgemm primitive would cost ~5 ms per new m, and prefill chunks come in
 * every length. Only the attention tiles' full items, whose row count recurs, ask for a fixed-m
 * primitive (brgemm: 10.6-11.0 against 11.4-13.0 µs for a 128-row tile). Each thread keeps the
 * primitives it made (prim_cache_t) with the memory objects of their last call and one stream: a
 * lookup in oneDNN's own cache still costs ~2 µs, making the four memory objects and a stream
 * another ~2 µs (13.6 against 11.4 µs for a 128 × 128 × 64 tile), and the bf16 attention tiles
 * make thousands of small calls per layer (measured on the 2-core EPYC VM). The weights are
 * described as the transposed [k][n] view of w[n][k] (format "ba"): no reorder, no second copy of
 * the weights. Streams and memory objects are per thread, so calls from several threads are
 * independent. oneDNN runs on OpenMP (Debian's build) with the caller's thread count. */
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "common/log.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/matmul_dnnl.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static dnnl_engine_t g_engine;    /* written once under g_once, then only read */
static pthread_key_t g_cache_key; /* a thread's prim_cache_t; created under g_once */
static int g_cache_key_ok;        /* written once under g_once */

/* A primitive and the memory objects of its last call (rows mem_m; re-pointed with
 * dnnl_memory_set_data_handle while the row count stays: creating four memory objects and a stream
 * per call cost more than a 128 × 128 × 64 attention tile's product). */
typedef struct prim_entry {
    int m_fixed; /* the primitive's row count, or 0: a run-time row count */
    int n, k;
    bool bias, accumulate;
    dnnl_format_tag_t b_tag;
    dnnl_primitive_t prim; /* NULL: a free entry */
    int64_t mem_m;         /* the rows mem[] describe; -1: none made */
    dnnl_memory_t mem[4];  /* src, weights, dst, bias (NULL without) */
} prim_entry_t;

/* The primitives one thread made, by shape, and its stream. oneDNN's default build shares one
 * scratchpad among primitives, so a primitive must run on the thread that created it: the cache is
 * per thread, touched only by its thread, and freed when the thread ends. Full, it replaces entries
 * in turn. */
#define PRIM_CACHE_SIZE 64 /* blocked weights: a primitive per shape and row count (matmul_dnnl.h) */
typedef struct prim_cache {
    prim_entry_t e[PRIM_CACHE_SIZE];
    int next;             /* the entry replaced next */
    dnnl_stream_t stream; /* NULL until the first call */
} prim_cache_t;

static void entry_clear(prim_entry_t *e)
{
    dnnl_primitive_destroy(e->prim);
    for (int i = 0; i < 4; i++) {
        dnnl_memory_destroy(e->mem[i]);
    }
    *e = (prim_entry_t){.mem_m = -1};
}

static void cache_free(void *p)
{
    prim_cache_t *c = p;
    for (int i = 0; i < PRIM_CACHE_SIZE; i++) {
        entry_clear(&c->e[i]);
    }
    dnnl_stream_destroy(c->stream);
    free(c);
}

static void engine_init(void)
{
    g_cache_key_ok = pthread_key_create(&g_cache_key, cache_free) == 0;
    /* the ISA cap (kernels/cpu/isa.h) holds for oneDNN too: set before its first primitive */
    static const dnnl_cpu_isa_t caps[] = {dnnl_cpu_isa_sse41, dnnl_cpu_isa_avx2, dnnl_cpu_isa_avx512_core,
                                          dnnl_cpu_isa_avx512_core_bf16, dnnl_cpu_isa_all};
    pd_cpu_isa_t cap = pd_cpu_isa_cap();
    if (cap < PD_ISA_AMX && dnnl_set_max_cpu_isa(caps[cap]) != dnnl_success) {
        pd_log_warn("matmul: oneDNN did not take the ISA cap %s", pd_cpu_isa_name(cap));
    }
    /* oneDNN's verbose mode is the library's business; errors are reported through statuses */
    if (dnnl_engine_create(&g_engine, dnnl_cpu, 0) != dnnl_success) {
        pd_log_error("matmul: oneDNN cannot create a CPU engine");
        g_engine = NULL;
    }
}

bool pd_cpu_dnnl_bf16_native(void)
{
    /* the ISA values are nested bit sets: avx512_core_bf16 ⊂ avx512_core_amx */
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    return (isa & (unsigned)dnnl_cpu_isa_avx512_core_bf16) == (unsigned)dnnl_cpu_isa_avx512_core_bf16;
}

bool pd_cpu_dnnl_amx(void)
{
    static _Atomic int known = -1; /* asked on every matmul: the answer is kept */
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        unsigned isa = (unsigned)dnnl_get_effective_cpu_isa(), amx = (unsigned)dnnl_cpu_isa_avx512_core_amx;
        v = (isa & amx) == amx;
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v == 1;
}

/* The primitive for [m × k] · [k × n] (+ [1 × n]) (+ the destination's old values when
 * accumulate), m = m_fixed or a run-time value (0), b stored as b_tag says (ab: [k][n] row-major;
 * ba: [n][k], the transposed view). */
static dnnl_status_t make_primitive(int m_fixed, int n, int k, bool bias, dnnl_format_tag_t b_tag,
                                    bool accumulate, dnnl_primitive_t *prim_out)
{
    dnnl_memory_desc_t src, wei, bia, dst;
    dnnl_dim_t m = m_fixed > 0 ? m_fixed : DNNL_RUNTIME_DIM_VAL;
    dnnl_dims_t src_dims = {m, k}, wei_dims = {k, n}, bia_dims = {1, n}, dst_dims = {m, n};
    dnnl_status_t s = dnnl_memory_desc_init_by_tag(&src, 2, src_dims, dnnl_bf16, dnnl_ab);
    if (s == dnnl_success) {
        s = dnnl_memory_desc_init_by_tag(&wei, 2, wei_dims, dnnl_bf16, b_tag);
    }
    if (s == dnnl_success) {
        s = dnnl_memory_desc_init_by_tag(&bia, 2, bia_dims, dnnl_f32, dnnl_ab);
    }
    if (s == dnnl_success) {
        s = dnnl_memory_desc_init_by_tag(&dst, 2, dst_dims, dnnl_f32, dnnl_ab);
    }
    dnnl_matmul_desc_t md;
    if (s == dnnl_success) {
        s = dnnl_matmul_desc_init(&md, &src, &wei, bias ? &bia : NULL, &dst);
    }
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t ops = NULL;
    if (s == dnnl_success && accumulate) { /* dst = 1 · dst + a · b */
        s = dnnl_primitive_attr_create(&attr);
        if (s == dnnl_success) {
            s = dnnl_post_ops_create(&ops);
        }
        if (s == dnnl_success) {
            s = dnnl_post_ops_append_sum(ops, 1.0f);
        }
        if (s == dnnl_success) {
            s = dnnl_primitive_attr_set_post_ops(attr, ops);
        }
    }
    dnnl_primitive_desc_t pd = NULL;
    if (s == dnnl_success) {
        s = dnnl_primitive_desc_create(&pd, &md, attr, g_engine, NULL);
    }
    const char *impl = "";
    if (s == dnnl_success && b_tag == dnnl_BA16a32b2a &&
        dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
        strncmp(impl, "ref", 3) == 0) {
        s = dnnl_unimplemented; /* blocked weights with a run-time row count: ref:any, seconds per call */
    }
    if (s == dnnl_success) {
        s = dnnl_primitive_create(prim_out, pd);
    }
    dnnl_primitive_desc_destroy(pd);
    dnnl_post_ops_destroy(ops);
    dnnl_primitive_attr_destroy(attr);
    return s;
}

/* The calling thread's cache, made on first use; NULL when it cannot be (then every call makes and
 * destroys its own objects). */
static prim_cache_t *thread_cache(void)
{
    prim_cache_t *c = g_cache_key_ok ? pthread_getspecific(g_cache_key) : NULL;
    if (c == NULL && g_cache_key_ok && (c = calloc(1, sizeof(*c))) != NULL) {
        for (int i = 0; i < PRIM_CACHE_SIZE; i++) {
            c->e[i].mem_m = -1;
        }
        if (pthread_setspecific(g_cache_key, c) != 0) {
            free(c);
            c = NULL;
        }
    }
    return c;
}

/* The entry of the calling thread's primitive for the shape, from cache c or made (and cached);
 * without a cache, made into *tmp, which the caller clears after the call. */
static dnnl_status_t get_primitive(prim_cache_t *c, prim_entry_t *tmp, int m_fixed, int n, int k, bool bias,
                                   dnnl_format_tag_t b_tag, bool accumulate, prim_entry_t **entry)
{
    for (int i = 0; c != NULL && i < PRIM_CACHE_SIZE; i++) {
        prim_entry_t *e = &c->e[i];
        if (e->prim != NULL && e->m_fixed == m_fixed && e->n == n && e->k == k && e->bias == bias &&
            e->b_tag == b_tag && e->accumulate == accumulate) {
            *entry = e;
            return dnnl_success;
        }
    }
    dnnl_primitive_t prim = NULL;
    dnnl_status_t s = make_primitive(m_fixed, n, k, bias, b_tag, accumulate, &prim);
    if (s != dnnl_success) {
        return s;
    }
    prim_entry_t *e = tmp;
    if (c != NULL) {
        e = &c->e[c->next];
        c->next = (c->next + 1) % PRIM_CACHE_SIZE;
        entry_clear(e);
    }
    *e = (prim_entry_t){m_fixed, n, k, bias, accumulate, b_tag, prim, -1, {NULL, NULL, NULL, NULL}};
    *entry = e;
    return dnnl_success;
}

/* A memory object over caller-owned data of dims rows × cols, row-major (or column-major: ba). */
static dnnl_status_t wrap(dnnl_memory_t *mem, int64_t rows, int64_t cols, dnnl_data_type_t dt,
                          dnnl_format_tag_t tag, const void *data)
{
    dnnl_memory_desc_t d;
    dnnl_dims_t dims = {rows, cols};
    dnnl_status_t s = dnnl_memory_desc_init_by_tag(&d, 2, dims, dt, tag);
    return s == dnnl_success ? dnnl_memory_create(mem, &d, g_engine, (void *)data) : s;
}

/* e's memory objects over y[m][n], xb[m][k], b and bias: re-pointed when they describe m rows
 * already, else made anew. */
static dnnl_status_t bind(prim_entry_t *e, float *y, const uint16_t *xb, const uint16_t *b, const float *bias,
                          int64_t m)
{
    const void *data[4] = {xb, b, y, bias};
    dnnl_status_t s = dnnl_success;
    if (e->mem_m == m) {
        for (int i = 0; i < 4 && s == dnnl_success; i++) {
            s = e->mem[i] != NULL ? dnnl_memory_set_data_handle(e->mem[i], (void *)data[i]) : s;
        }
        return s;
    }
    for (int i = 0; i < 4; i++) {
        dnnl_memory_destroy(e->mem[i]);
        e->mem[i] = NULL;
    }
    e->mem_m = -1;
    s = wrap(&e->mem[0], m, e->k, dnnl_bf16, dnnl_ab, xb);
    if (s == dnnl_success) {
        s = wrap(&e->mem[1], e->k, e->n, dnnl_bf16, e->b_tag, b);
    }
    if (s == dnnl_success) {
        s = wrap(&e->mem[2], m, e->n, dnnl_f32, dnnl_ab, y);
    }
    if (s == dnnl_success && e->bias) {
        s = wrap(&e->mem[3], 1, e->n, dnnl_f32, dnnl_ab, bias);
    }
    e->mem_m = s == dnnl_success ? m : -1;
    return s;
}

/* y[m][n] (+)= xb[m][k] · b (+ bias[n]), b as b_tag says, through a primitive made for m rows when
 * m_fixed, else for a run-time row count; the two public entry points. */
static pd_status_t run_matmul(float *y, const uint16_t *xb, const uint16_t *b, const float *bias, int m,
                              int n, int k, dnnl_format_tag_t b_tag, bool accumulate, int num_threads,
                              bool m_fixed)
{
    static int unimplemented_logged; /* each log line once per process */
    pthread_once(&g_once, engine_init);
    if (g_engine == NULL) {
        return PD_ERR_BACKEND;
    }
    prim_cache_t *c = thread_cache();
    prim_entry_t tmp = {.mem_m = -1}, *e = NULL;
    dnnl_status_t s = get_primitive(c, &tmp, m_fixed ? m : 0, n, k, bias != NULL, b_tag, accumulate, &e);
    if (s == dnnl_unimplemented) {
        if (!__atomic_exchange_n(&unimplemented_logged, 1, __ATOMIC_RELAXED)) {
            pd_log_warn("matmul: oneDNN has no bf16 matmul on this CPU; bf16 math runs through fp32 sgemm");
        }
        return PD_ERR_UNSUPPORTED;
    }
    static int impl_logged;
    if (s == dnnl_success && !__atomic_exchange_n(&impl_logged, 1, __ATOMIC_RELAXED)) {
        const_dnnl_primitive_desc_t pd = NULL;
        const char *impl = "?";
        if (dnnl_primitive_get_primitive_desc(e->prim, &pd) == dnnl_success) {
            (void)dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
        }
        if (pd_cpu_dnnl_bf16_native()) {
            pd_log_info("matmul: bf16 GEMM through oneDNN (%s, AVX512-BF16)", impl);
        } else {
            pd_log_warn("matmul: bf16 GEMM through oneDNN (%s) on a CPU without AVX512-BF16: emulated, "
                        "likely slower than fp32",
                        impl);
        }
    }
    if (s == dnnl_success) {
        s = bind(e, y, xb, b, bias, m);
    }
    dnnl_stream_t own_stream = NULL, stream = c != NULL ? c->stream : NULL;
    if (s == dnnl_success && stream == NULL) {
        s = dnnl_stream_create(&stream, g_engine, dnnl_stream_default_flags);
        if (c != NULL) {
            c->stream = stream;
        } else {
            own_stream = stream;
        }
    }
    if (s == dnnl_success) {
        dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->mem[0]},
                                   {DNNL_ARG_WEIGHTS, e->mem[1]},
                                   {DNNL_ARG_DST, e->mem[2]},
                                   {DNNL_ARG_BIAS, e->mem[3]}};
        /* oneDNN's OpenMP regions take the calling thread's max threads: the backend's count */
        int saved = omp_get_max_threads();
        omp_set_num_threads(num_threads);
        s = dnnl_primitive_execute(e->prim, stream, bias != NULL ? 4 : 3, args);
        if (s == dnnl_success) {
            s = dnnl_stream_wait(stream);
        }
        omp_set_num_threads(saved);
    }
    dnnl_stream_destroy(own_stream);
    if (e == &tmp) {
        entry_clear(&tmp);
    }
    if (s != dnnl_success) {
        pd_log_error("matmul: oneDNN bf16 matmul [%d x %d] x [%d x %d] failed (dnnl status %d)", m, k, k, n,
                     (int)s);
        return PD_ERR_BACKEND;
    }
    return PD_OK;
}

pd_status_t pd_cpu_dnnl_matmul_bf16(float *y, const uint16_t *xb, const uint16_t *w, const float *bias, int m,
                                    int n, int k, int num_threads)
{
    return run_matmul(y, xb, w, bias, m, n, k, dnnl_ba, false, num_threads, false);
}

pd_status_t pd_cpu_dnnl_matmul_bf16_blocked(float *y, const uint16_t *xb, const uint16_t *w,
                                            const float *bias, int m, int n, int k, int num_threads)
{
    static _Atomic int unsupported; /* once refused, never asked again (making one costs ms) */
    if (atomic_load_explicit(&unsupported, memory_order_relaxed)) {
        return PD_ERR_UNSUPPORTED;
    }
    uint16_t *xp = NULL;
    float *yp = NULL;
    pd_status_t st = PD_OK;
    for (int i0 = 0; st == PD_OK && i0 < m; i0 += PD_DNNL_BLOCKED_CHUNK) {
        int rows = m - i0 < PD_DNNL_BLOCKED_CHUNK ? m - i0 : PD_DNNL_BLOCKED_CHUNK;
        int mp = rows <= 64 ? (rows + 15) & ~15 : (rows + 63) & ~63; /* the primitive's row count */
        const uint16_t *xs = xb + (size_t)i0 * k;
        float *ys = y + (size_t)i0 * n;
        if (mp != rows) { /* the last chunk only: rows of zeros below x, their outputs dropped */
            xp = calloc((size_t)mp * k, sizeof(uint16_t));
            yp = malloc((size_t)mp * n * sizeof(float));
            if (xp == NULL || yp == NULL) {
                pd_log_error("matmul: cannot allocate %d x %d padded bf16 inputs", mp, k);
                st = PD_ERR_NO_MEMORY;
                break;
            }
            memcpy(xp, xs, (size_t)rows * k * sizeof(uint16_t));
            xs = xp;
            ys = yp;
        }
        st = run_matmul(ys, xs, w, bias, mp, n, k, dnnl_BA16a32b2a, false, num_threads, true);
        if (st == PD_OK && ys == yp) {
            memcpy(y + (size_t)i0 * n, yp, (size_t)rows * n * sizeof(float));
        }
    }
    if (st == PD_ERR_UNSUPPORTED) {
        atomic_store_explicit(&unsupported, 1, memory_order_relaxed);
    }
    free(xp), free(yp);
    return st;
}

pd_status_t pd_cpu_dnnl_gemm_bf16_1t(float *c, const uint16_t *a, const uint16_t *b, int m, int n, int k,
                                     bool b_is_nk, bool accumulate, bool m_fixed)
{
    return run_matmul(c, a, b, NULL, m, n, k, b_is_nk ? dnnl_ba : dnnl_ab, accumulate, 1, m_fixed);
}
