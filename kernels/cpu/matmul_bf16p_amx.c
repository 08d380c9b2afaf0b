/* kernels/cpu/matmul_bf16p_amx.c — bf16 weights in PD_WEIGHT_PAIRS32 (matmul_bf16p.h) multiplied
 * on AMX tiles (Sapphire Rapids and newer); int8 weights in PD_WEIGHT_COLS32 through bf16 panels
 * widened per block (pd_cpu_i8p_amx); and any B operand in bf16 pairs (pd_cpu_amx_gemm_pairs: the
 * prefill attention tile). matmul.c decides the row counts that come here.
 *
 * The layout is already what `tdpbf16ps` wants for its B operand: a B tile is 16 rows of 64 bytes,
 * row p holding the pair (x[2p], x[2p + 1]) for 16 outputs — and in PAIRS32 the pair p of a
 * block's 32 outputs is one 128-byte run. So the tile of outputs j .. j + 16 and columns
 * c .. c + 32 is a tile load at w + j·k + c·32 with a 128-byte stride, and its neighbour
 * (outputs j + 16 .. j + 32) 64 bytes on: no reorder, no copy. A tile (A) is 16 rows of x, 32
 * columns of bf16; C is 16 × 16 fp32. Each block of 32 outputs × 32 rows of x keeps four C tiles,
 * two A and two B: per step of 32 columns, four loads and four `tdpbf16ps`.
 *
 * x comes in `parts` bf16 copies (matmul_bf16p.h): one for --matmul-precision bf16 (x rounded), or
 * three whose sum is x exactly for fp32 math (matmul_bf16.h's split: every product with a bf16
 * weight is exact in fp32), all accumulated into the same C tiles.
 *
 * Order of sums: each output starts from its bias (or 0) and adds, per 32 columns from column 0,
 * the tile product of each part in turn; a row's result depends neither on the rows beside it nor
 * on how many there are, nor on the threads' split. It could serve every row count alike, but at
 * one row it was slower in the model than the `vdpbf16ps` kernel, and at 2-16 rows it rounds
 * differently from it (matmul_bf16p.h, PD_BF16P_AMX_MIN_M), so the batches that come here do not
 * round as a lone sequence does.
 *
 * Measured alone (2 threads, 2-core AMX Xeon, 4608 × 1536, weights ≫ L3): reads w at 24-25 GB/s
 * from 1 to 16 rows and 22-23 at 32 (oneDNN's brgemm on the same weights: 15-16.5); from L3, 1.8-1.9
 * TFLOP/s at 128-512 rows (oneDNN: brgemm 815-846, gemm:jit on row-major weights 1180-1455). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/cpu/matmul_bf16p.h"
#include "kernels/cpu/simd.h"

#if defined(__x86_64__) && defined(__GNUC__)

#define AMX_ISA    "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl"
#define AMX        __attribute__((target(AMX_ISA)))
#define AMX_INLINE __attribute__((target(AMX_ISA), always_inline)) static inline

/* Linux: a process asks before its threads may use the tile data state (arch/x86 xstate). */
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

/* Tiles: C[row block][column half] in 0-3, A in 4-5, B in 6-7 (macros: the intrinsics paste the
 * number into the instruction). */
#define T_C00 0
#define T_C01 1
#define T_C10 2
#define T_C11 3
#define T_A0  4
#define T_A1  5
#define T_B0  6
#define T_B1  7

/* How far ahead of the B loads the weights are prefetched: one step of 32 columns is 2 KiB. */
enum { AMX_PREFETCH_BYTES = 4096 };

/* The tile configuration (palette 1): every tile 16 rows of 64 bytes. */
typedef struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

static int amx_probe(void)
{
    unsigned a, b, c, d;
    if (!pd_cpu_avx512_usable() || __get_cpuid_max(0, NULL) < 7) {
        return 0;
    }
    __cpuid_count(7, 0, a, b, c, d);
    int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    return tile && bf16 && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int pd_cpu_amx_usable(void)
{
    static int usable = -1; /* a benign race: every thread gets the same answer */
    if (__atomic_load_n(&usable, __ATOMIC_ACQUIRE) < 0) {
        __atomic_store_n(&usable, pd_cpu_isa_cap() >= PD_ISA_AMX && amx_probe(), __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&usable, __ATOMIC_ACQUIRE);
}

/* One product C (+)= A · B as a block sees it. A: row i, part p at x + i·xrow + p·xpart (bf16; the
 * parts are summed). B: bf16 pairs; a block's tile of 16 outputs and columns c .. c + 32 at
 * its base + (c / 32)·bstep, 16 rows bstride bytes apart; the next 16 outputs 32 elements on. C: y
 * [.][ldy], from bias (NULL: 0) or, when accumulate, from y's values. */
typedef struct amx_product {
    float *y;
    long ldy;
    const float *bias;
    int accumulate;
    const uint16_t *x;
    long xrow, xpart;
    int parts;
    long bstep, bstride;
    int m, k;
} amx_product_t;

/* C tile `ct` (rows i0 .. i0 + 16, columns j .. j + 16) starts at y's values (rows past m as 0,
 * through spill), at the bias (16 equal rows: a 0 stride) or at 0. */
#define AMX_START(ct, P, spill, i0, j)                                                                       \
    do {                                                                                                     \
        if ((P)->accumulate && (i0) + 16 <= (P)->m) {                                                        \
            _tile_loadd(ct, (P)->y + (size_t)(i0) * (P)->ldy + (j), (P)->ldy * 4);                           \
        } else if ((P)->accumulate) {                                                                        \
            for (int r_ = 0; r_ < 16; r_++) {                                                                \
                if ((i0) + r_ < (P)->m) {                                                                    \
                    memcpy((spill) + r_ * 16, (P)->y + (size_t)((i0) + r_) * (P)->ldy + (j), 64);            \
                } else {                                                                                     \
                    memset((spill) + r_ * 16, 0, 64);                                                        \
                }                                                                                            \
            }                                                                                                \
            __asm__ volatile("" ::: "memory");                                                               \
            _tile_loadd(ct, spill, 64);                                                                      \
        } else if ((P)->bias != NULL) {                                                                      \
            _tile_loadd(ct, (P)->bias + (j), 0);                                                             \
        } else {                                                                                             \
            _tile_zero(ct);                                                                                  \
        }                                                                                                    \
    } while (0)

/* Rows i0 .. i0 + 16 of C tile `ct` into y's columns j .. j + 16: straight when all 16 rows are
 * below m, else through `spill` and only rows below m. */
#define AMX_STORE(ct, P, spill, i0, j)                                                                       \
    do {                                                                                                     \
        if ((i0) + 16 <= (P)->m) {                                                                           \
            _tile_stored(ct, (P)->y + (size_t)(i0) * (P)->ldy + (j), (P)->ldy * 4);                          \
        } else {                                                                                             \
            _tile_stored(ct, spill, 64);                                                                     \
            __asm__ volatile("" ::: "memory");                                                               \
            for (int r_ = 0; (i0) + r_ < (P)->m; r_++) {                                                     \
                memcpy((P)->y + (size_t)((i0) + r_) * (P)->ldy + (j), (spill) + r_ * 16, 64);                \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

/* C rows i0 .. min(i0 + 32, m), columns j .. j + 32, B's block for those columns at bj: two C
 * tile rows when more than 16 rows are left, one otherwise; prefetch whether this pass brings bj
 * in from memory. */
AMX_INLINE void block(const amx_product_t *P, const uint16_t *bj, int i0, int j, int prefetch)
{
    const int two = P->m - i0 > 16;
    const long xstride = P->xrow * 2; /* bytes from one row of A to the next */
    const uint16_t *x0 = P->x + (size_t)i0 * P->xrow, *x1 = x0 + (size_t)16 * P->xrow;
    float spill[16 * 16] __attribute__((aligned(64)));
    AMX_START(T_C00, P, spill, i0, j);
    AMX_START(T_C01, P, spill, i0, j + 16);
    if (two) {
        AMX_START(T_C10, P, spill, i0 + 16, j);
        AMX_START(T_C11, P, spill, i0 + 16, j + 16);
    }
    for (int c = 0; c < P->k; c += 32) {
        const uint16_t *b = bj + (size_t)(c / 32) * P->bstep;
        if (prefetch) {
            const char *pf = (const char *)b + AMX_PREFETCH_BYTES;
            for (int l = 0; l < 32; l++) {
                _mm_prefetch(pf + l * 64, _MM_HINT_T0);
            }
        }
        _tile_loadd(T_B0, b, P->bstride);
        _tile_loadd(T_B1, b + 32, P->bstride);
        for (int p = 0; p < P->parts; p++) {
            _tile_loadd(T_A0, x0 + (size_t)p * P->xpart + c, xstride);
            _tile_dpbf16ps(T_C00, T_A0, T_B0);
            _tile_dpbf16ps(T_C01, T_A0, T_B1);
            if (two) {
                _tile_loadd(T_A1, x1 + (size_t)p * P->xpart + c, xstride);
                _tile_dpbf16ps(T_C10, T_A1, T_B0);
                _tile_dpbf16ps(T_C11, T_A1, T_B1);
            }
        }
    }
    AMX_STORE(T_C00, P, spill, i0, j);
    AMX_STORE(T_C01, P, spill, i0, j + 16);
    if (two) {
        AMX_STORE(T_C10, P, spill, i0 + 16, j);
        AMX_STORE(T_C11, P, spill, i0 + 16, j + 16);
    }
}

int pd_cpu_bf16p_amx_chunk_rows(int k, int parts)
{
    int rows = (int)((1 << 20) / ((int64_t)2 * k * parts)) & ~31; /* x's chunk: ~1 MiB of L2 */
    return rows < 32 ? 32 : rows > 256 ? 256 : rows;
}

/* Every tile 16 rows of 64 bytes (palette 1), loaded on the calling thread. */
AMX_INLINE void tiles_configure(void)
{
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    __asm__ volatile("" ::: "memory"); /* the tile loads after this read x and bias, written before */
    _tile_loadconfig(&cfg);
}

/* PD_WEIGHT_PAIRS32 as a B operand: a block's 32 columns 32 × 32 elements on, its tile rows (column
 * pairs) 128 bytes apart. */
enum { PAIRS32_STEP = 32 * 32, PAIRS32_STRIDE = 128 };

AMX void pd_cpu_bf16p_amx(float *y, const uint16_t *xs, int parts, const uint16_t *w, const float *bias,
                          int m, int n, int k, int n0, int n1)
{
    amx_product_t P = {y, n, bias, 0, xs, (long)parts * k, k, parts, PAIRS32_STEP, PAIRS32_STRIDE, m, k};
    tiles_configure();
    int chunk = pd_cpu_bf16p_amx_chunk_rows(k, parts);
    for (int ic = 0; ic < m; ic += chunk) {
        P.m = m - ic < chunk ? m : ic + chunk;
        for (int j = n0; j < n1; j += 32) {
            for (int i0 = ic; i0 < P.m; i0 += 32) {
                block(&P, w + (size_t)j * k, i0, j, i0 == ic);
            }
        }
    }
    _tile_release();
    __asm__ volatile("" ::: "memory"); /* y was written by tile stores */
}

/* One PD_WEIGHT_COLS32 int8 block (32 rows, column c's 32 bytes at wb + 32c) as bf16 in the
 * PAIRS32 order of one block ([k/2][32][2]): the int8 values are exact in bf16 (≤ 8 significant
 * bits), so the float's top half is the value. k even. */
AMX_INLINE void i8_block_to_pairs(uint16_t *panel, const int8_t *wb, int k)
{
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    for (int c = 0; c < k; c += 2) {
        const int8_t *col = wb + (size_t)c * 32; /* column c, then column c + 1 */
        for (int h = 0; h < 32; h += 16) {       /* rows h .. h + 16 */
            __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(col + h))));
            __m512 f1 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(col + 32 + h))));
            __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(f0), 16),
                                           _mm512_and_si512(_mm512_castps_si512(f1), top));
            _mm512_storeu_si512(panel + (size_t)c * 32 + 2 * h, pair);
        }
    }
}

AMX void pd_cpu_i8p_amx(float *y, const uint16_t *xs, const int8_t *w, const float *scale, const float *bias,
                        int m, int n, int k, int n0, int n1, uint16_t *panel)
{
    amx_product_t P = {y, n, NULL, 0, xs, (long)3 * k, k, 3, PAIRS32_STEP, PAIRS32_STRIDE, m, k};
    tiles_configure();
    int chunk = pd_cpu_bf16p_amx_chunk_rows(k, 3);
    for (int ic = 0; ic < m; ic += chunk) {
        P.m = m - ic < chunk ? m : ic + chunk;
        for (int j = n0; j < n1; j += 32) {
            i8_block_to_pairs(panel, w + (size_t)j * k, k);
            __asm__ volatile("" ::: "memory"); /* the tile loads read the panel */
            for (int i0 = ic; i0 < P.m; i0 += 32) {
                block(&P, panel, i0, j, 0);
            }
            __asm__ volatile("" ::: "memory"); /* y was written by tile stores */
            const __m512 s0 = _mm512_loadu_ps(scale + j), s1 = _mm512_loadu_ps(scale + j + 16);
            const __m512 b0 = bias != NULL ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
            const __m512 b1 = bias != NULL ? _mm512_loadu_ps(bias + j + 16) : _mm512_setzero_ps();
            for (int i = ic; i < P.m; i++) {
                float *yr = y + (size_t)i * n + j;
                _mm512_storeu_ps(yr, _mm512_fmadd_ps(_mm512_loadu_ps(yr), s0, b0));
                _mm512_storeu_ps(yr + 16, _mm512_fmadd_ps(_mm512_loadu_ps(yr + 16), s1, b1));
            }
        }
    }
    _tile_release();
}

AMX void pd_cpu_amx_gemm_pairs(float *c, long ldc, const uint16_t *a, long lda, const uint32_t *b, long ldb,
                               int m, int n, int k, int accumulate)
{
    /* B's word (p, j) at b[p·ldb + j]: outputs j's tile rows ldb words apart, 32 columns 16 rows on */
    amx_product_t P = {c, ldc, NULL, accumulate, a, lda, 0, 1, 32 * ldb, ldb * 4, m, k};
    const uint16_t *b16 = (const uint16_t *)b;
    tiles_configure();
    for (int j = 0; j < n; j += 32) {
        for (int i0 = 0; i0 < m; i0 += 32) {
            block(&P, b16 + (size_t)j * 2, i0, j, 0);
        }
    }
    _tile_release();
    __asm__ volatile("" ::: "memory"); /* c was written by tile stores */
}

#else

int pd_cpu_amx_usable(void)
{
    return 0;
}

int pd_cpu_bf16p_amx_chunk_rows(int k, int parts)
{
    (void)k, (void)parts;
    return 32;
}

void pd_cpu_bf16p_amx(float *y, const uint16_t *xs, int parts, const uint16_t *w, const float *bias, int m,
                      int n, int k, int n0, int n1)
{
    (void)y, (void)xs, (void)parts, (void)w, (void)bias, (void)m, (void)n, (void)k, (void)n0, (void)n1;
}

void pd_cpu_i8p_amx(float *y, const uint16_t *xs, const int8_t *w, const float *scale, const float *bias,
                    int m, int n, int k, int n0, int n1, uint16_t *panel)
{
    (void)y, (void)xs, (void)w, (void)scale, (void)bias, (void)m, (void)n, (void)k, (void)n0, (void)n1;
    (void)panel;
}

void pd_cpu_amx_gemm_pairs(float *c, long ldc, const uint16_t *a, long lda, const uint32_t *b, long ldb,
                           int m, int n, int k, int accumulate)
{
    (void)c, (void)ldc, (void)a, (void)lda, (void)b, (void)ldb, (void)m, (void)n, (void)k, (void)accumulate;
}

#endif
