/* kernels/cpu/matmul_lowp_x86.c — GEMV and widener for 16-bit and int8 weights with AVX2/FMA/F16C
 * intrinsics, picked at run time (matmul_lowp.c dispatches).
 *
 * Decode at batch 1 is a chain of GEMVs bound by reading w: bf16/fp16 weights are read as they are
 * stored (half the bytes of fp32), int8 ones in a quarter, and widened in registers — bf16 by a
 * 16-bit shift into the high half, fp16 by F16C, int8 by sign extension and conversion — then
 * multiplied in fp32 (int8 sums times the row's scale at the end). bf16 reads 16 weights per load
 * and splits them into even and odd lanes without a shuffle; x is permuted to match once per matmul
 * (a widening shuffle per 8 weights held bf16 at 0.58x the read bandwidth, fp16 at 0.80x). Four
 * rows of w are streamed together against the same x vector (independent FMA chains, one x load
 * per four products); x rows go in pairs, so w's four rows are read from memory once and from
 * L1/L2 for the other pairs. The weight kinds are compile-time constants of always-inline code:
 * one specialised loop per kind. */
#include <immintrin.h>
#include <stdint.h>

#include "kernels/cpu/matmul_lowp.h"
#include "kernels/cpu/simd.h"

#define X86 __attribute__((target("avx2,fma,f16c")))
/* How far ahead of the FMAs each w row stream of the AVX-512 batch-1 GEMV is prefetched. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 512
#endif

#define X86_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

int pd_cpu_lowp_x86_usable(void)
{
    return pd_cpu_isa_cap() >= PD_ISA_AVX2 && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

enum { KIND_F16, KIND_BF16, KIND_I8 };

X86_INLINE int esize(int kind)
{
    return kind == KIND_I8 ? 1 : 2;
}

/* Eight weights from element idx of row (of the kind) as fp32 (exact; int8 unscaled). */
X86_INLINE __m256 widen8(const void *row, int idx, int kind)
{
    const char *p = (const char *)row + (size_t)idx * esize(kind);
    if (kind == KIND_I8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    }
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kind == KIND_BF16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtph_ps(h);
}

X86_INLINE float widen1(const void *row, int idx, int kind)
{
    if (kind == KIND_I8) {
        return (float)((const int8_t *)row)[idx];
    }
    uint16_t h = ((const uint16_t *)row)[idx];
    return kind == KIND_BF16 ? pd_bf16_to_f32(h) : pd_f16_to_f32(h);
}

X86_INLINE void prefetch_row(const void *row, int idx, int kind)
{
    _mm_prefetch((const char *)row + (size_t)idx * esize(kind) + PREFETCH_BYTES, _MM_HINT_T0);
}

/* The AVX2 blocks' prefetch: the next block of four rows, at the pace this block is read. A block's
 * four rows are contiguous (4·k elements) and a step over columns [p, p + cols) reads 4·cols of them,
 * so the same stretch of the next block, next + 4·p elements on, is asked for in that step: it is in
 * L1 when its turn comes, one sequential stream instead of four. Prefetching each row a fixed 512
 * bytes ahead (before) left the head of every next block's rows to demand misses (rows of 1.5–3 KiB
 * here), and a step of the pair loop had none: on a Zen 3 (AVX2 only) a 4-row int8 GEMV at batch 1
 * read 9.6–10.9 GB/s that way, 19.3–19.6 this way (2 threads, 16 GB/s plain read). */
X86_INLINE void prefetch_next(const char *next, int p, int cols, int kind)
{
    const char *a = next + (size_t)4 * (size_t)p * (size_t)esize(kind);
    for (int off = 0; off < 4 * cols * esize(kind); off += 64) {
        _mm_prefetch(a + off, _MM_HINT_T0);
    }
}

/* Blocks of up to this many bytes prefetch the next block (prefetch_next); longer ones, which with
 * the next block would not fit L1 together (bf16 rows of k = 5632: 45 KiB a block, 0.9–1.0x of the
 * per-row prefetch there), prefetch each row PREFETCH_BYTES ahead. */
#define NEXT_BLOCK_MAX (24 << 10)

/* A step's prefetch for the block whose rows start at w0, w1, w2, w3 (stride bytes apart). */
X86_INLINE void prefetch_step(const char *w0, const char *w1, const char *w2, const char *w3, size_t stride,
                              int p, int cols, int kind)
{
    if (4 * stride <= NEXT_BLOCK_MAX) {
        prefetch_next(w3 + stride, p, cols, kind);
    } else {
        prefetch_row(w0, p, kind);
        prefetch_row(w1, p, kind);
        prefetch_row(w2, p, kind);
        prefetch_row(w3, p, kind);
    }
}

/* The sums of the 8 lanes of a0..a3, in that order. */
X86_INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

X86_INLINE float hsum1(__m256 a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The end of a 4-column block: columns p0..k-1 (the tail the vector loop left) of the four w rows
 * w0..w3 in scalar code, added to the vector sums sa (x row i) and sb (row i + 1, when pair), times
 * the rows' scales (int8: scale[j..j+3]), plus the bias, stored at y[i][j..j+3] (and y[i + 1]). */
X86_INLINE void finish4(float *y, const float *x0, const float *x1, const void *const wr[4],
                        const float *scale, const float *bias, int n, int k, int p0, int i, int j, int pair,
                        int kind, __m128 sa, __m128 sb)
{
    float ta[4] = {0, 0, 0, 0}, tb[4] = {0, 0, 0, 0};
    for (int p = p0; p < k; p++) {
        for (int r = 0; r < 4; r++) {
            float wv = widen1(wr[r], p, kind);
            ta[r] += wv * x0[p];
            if (pair) {
                tb[r] += wv * x1[p];
            }
        }
    }
    __m128 sc = scale != NULL ? _mm_loadu_ps(scale + j) : _mm_set1_ps(1.0f);
    __m128 bv = bias != NULL ? _mm_loadu_ps(bias + j) : _mm_setzero_ps();
    _mm_storeu_ps(y + (size_t)i * n + j, _mm_fmadd_ps(_mm_add_ps(sa, _mm_loadu_ps(ta)), sc, bv));
    if (pair) {
        _mm_storeu_ps(y + (size_t)(i + 1) * n + j, _mm_fmadd_ps(_mm_add_ps(sb, _mm_loadu_ps(tb)), sc, bv));
    }
}

/* bf16 without shuffles: 16 weights in one 256-bit load; the even-indexed ones widen by a shift
 * left, the odd ones by masking off the low halves. x is read in the matching order from xp, a
 * copy of x with each 16-float group split into its even then odd elements
 * (pd_cpu_gemv_lowp_permute_x); the k tail (k % 16) comes from x itself. */
X86_INLINE void widen16_eo(const uint16_t *p, __m256 *even, __m256 *odd)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

X86_INLINE void block4_bf16(float *y, const float *x, const float *xp, const uint16_t *w, const float *bias,
                            int n, int k, int i, int j, int pair, int alike)
{
    const uint16_t *w0 = w + (size_t)j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const void *const wr[4] = {w0, w1, w2, w3};
    const float *p0 = xp + (size_t)i * k, *p1 = p0 + k;
    const float *x0 = x + (size_t)i * k, *x1 = x0 + k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int k16 = k & ~15;
    for (int p = 0; p < k16; p += 16) {
        prefetch_step((const char *)w0, (const char *)w1, (const char *)w2, (const char *)w3, (size_t)k * 2,
                      p, 16, KIND_BF16);
        __m256 xe = _mm256_loadu_ps(p0 + p), xo = _mm256_loadu_ps(p0 + p + 8);
        __m256 e0, o0, e1, o1, e2, o2, e3, o3;
        widen16_eo(w0 + p, &e0, &o0);
        widen16_eo(w1 + p, &e1, &o1);
        widen16_eo(w2 + p, &e2, &o2);
        widen16_eo(w3 + p, &e3, &o3);
        if (pair || alike) { /* 8 chains: a (x row i), b (x row i + 1); alike: a lone row as row i */
            a0 = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, a0));
            a1 = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, a1));
            a2 = _mm256_fmadd_ps(o2, xo, _mm256_fmadd_ps(e2, xe, a2));
            a3 = _mm256_fmadd_ps(o3, xo, _mm256_fmadd_ps(e3, xe, a3));
            if (!pair) {
                continue;
            }
            __m256 ye = _mm256_loadu_ps(p1 + p), yo = _mm256_loadu_ps(p1 + p + 8);
            b0 = _mm256_fmadd_ps(o0, yo, _mm256_fmadd_ps(e0, ye, b0));
            b1 = _mm256_fmadd_ps(o1, yo, _mm256_fmadd_ps(e1, ye, b1));
            b2 = _mm256_fmadd_ps(o2, yo, _mm256_fmadd_ps(e2, ye, b2));
            b3 = _mm256_fmadd_ps(o3, yo, _mm256_fmadd_ps(e3, ye, b3));
        } else { /* 8 chains: a (even lanes), b (odd lanes), summed at the end: FMA latency, not
                  * throughput, bounded two dependent FMAs per chain (half the L2-resident speed) */
            a0 = _mm256_fmadd_ps(e0, xe, a0);
            a1 = _mm256_fmadd_ps(e1, xe, a1);
            a2 = _mm256_fmadd_ps(e2, xe, a2);
            a3 = _mm256_fmadd_ps(e3, xe, a3);
            b0 = _mm256_fmadd_ps(o0, xo, b0);
            b1 = _mm256_fmadd_ps(o1, xo, b1);
            b2 = _mm256_fmadd_ps(o2, xo, b2);
            b3 = _mm256_fmadd_ps(o3, xo, b3);
        }
    }
    if (!pair && !alike) {
        a0 = _mm256_add_ps(a0, b0);
        a1 = _mm256_add_ps(a1, b1);
        a2 = _mm256_add_ps(a2, b2);
        a3 = _mm256_add_ps(a3, b3);
    }
    finish4(y, x0, x1, wr, NULL, bias, n, k, k16, i, j, pair, KIND_BF16, hsum4(a0, a1, a2, a3),
            hsum4(b0, b1, b2, b3));
}

/* y rows i (and i + 1 when pair), columns j..j+3: four rows of w (fp16 or int8) against one or two
 * rows of x. */
X86_INLINE void block4(float *y, const float *x, const void *w, const float *scale, const float *bias, int n,
                       int k, int i, int j, int pair, int kind, int alike)
{
    size_t stride = (size_t)k * esize(kind);
    const char *w0 = (const char *)w + (size_t)j * stride, *w1 = w0 + stride, *w2 = w1 + stride,
               *w3 = w2 + stride;
    const void *const wr[4] = {w0, w1, w2, w3};
    const float *x0 = x + (size_t)i * k, *x1 = x0 + k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int k8 = k & ~7, p0 = 0;
    if (!pair && !alike) { /* two sets of 4 chains over alternate 8-wide steps (FMA latency, as above) */
        for (; p0 + 16 <= k8; p0 += 16) {
            prefetch_step(w0, w1, w2, w3, stride, p0, 16, kind);
            __m256 xv = _mm256_loadu_ps(x0 + p0), xw = _mm256_loadu_ps(x0 + p0 + 8);
            a0 = _mm256_fmadd_ps(widen8(w0, p0, kind), xv, a0);
            a1 = _mm256_fmadd_ps(widen8(w1, p0, kind), xv, a1);
            a2 = _mm256_fmadd_ps(widen8(w2, p0, kind), xv, a2);
            a3 = _mm256_fmadd_ps(widen8(w3, p0, kind), xv, a3);
            b0 = _mm256_fmadd_ps(widen8(w0, p0 + 8, kind), xw, b0);
            b1 = _mm256_fmadd_ps(widen8(w1, p0 + 8, kind), xw, b1);
            b2 = _mm256_fmadd_ps(widen8(w2, p0 + 8, kind), xw, b2);
            b3 = _mm256_fmadd_ps(widen8(w3, p0 + 8, kind), xw, b3);
        }
        a0 = _mm256_add_ps(a0, b0);
        a1 = _mm256_add_ps(a1, b1);
        a2 = _mm256_add_ps(a2, b2);
        a3 = _mm256_add_ps(a3, b3);
    }
    for (int p = p0; p < k8; p += 8) {
        prefetch_step(w0, w1, w2, w3, stride, p, 8, kind);
        __m256 xv = _mm256_loadu_ps(x0 + p);
        __m256 v0 = widen8(w0, p, kind), v1 = widen8(w1, p, kind);
        __m256 v2 = widen8(w2, p, kind), v3 = widen8(w3, p, kind);
        a0 = _mm256_fmadd_ps(v0, xv, a0);
        a1 = _mm256_fmadd_ps(v1, xv, a1);
        a2 = _mm256_fmadd_ps(v2, xv, a2);
        a3 = _mm256_fmadd_ps(v3, xv, a3);
        if (pair) {
            __m256 xw = _mm256_loadu_ps(x1 + p);
            b0 = _mm256_fmadd_ps(v0, xw, b0);
            b1 = _mm256_fmadd_ps(v1, xw, b1);
            b2 = _mm256_fmadd_ps(v2, xw, b2);
            b3 = _mm256_fmadd_ps(v3, xw, b3);
        }
    }
    finish4(y, x0, x1, wr, scale, bias, n, k, k8, i, j, pair, kind, hsum4(a0, a1, a2, a3),
            hsum4(b0, b1, b2, b3));
}

/* y[i][j] for one row j of w (the columns left over after blocks of four). */
X86_INLINE void row1(float *y, const float *x, const void *w, const float *scale, const float *bias, int n,
                     int k, int i, int j, int kind)
{
    const char *wr = (const char *)w + (size_t)j * k * esize(kind);
    const float *xr = x + (size_t)i * k;
    __m256 a = _mm256_setzero_ps();
    int k8 = k & ~7;
    for (int p = 0; p < k8; p += 8) {
        a = _mm256_fmadd_ps(widen8(wr, p, kind), _mm256_loadu_ps(xr + p), a);
    }
    float s = hsum1(a);
    for (int p = k8; p < k; p++) {
        s += widen1(wr, p, kind) * xr[p];
    }
    y[(size_t)i * n + j] = s * (scale != NULL ? scale[j] : 1.0f) + (bias != NULL ? bias[j] : 0.0f);
}

X86_INLINE void gemv(float *y, const float *x, const float *xp, const void *w, const float *scale,
                     const float *bias, int m, int n, int k, int n0, int n1, int kind, int alike)
{
    int j = n0;
    for (; j + 4 <= n1; j += 4) {
        int i = 0;
        for (; i + 2 <= m; i += 2) {
            if (kind == KIND_BF16) {
                block4_bf16(y, x, xp, w, bias, n, k, i, j, 1, alike);
            } else {
                block4(y, x, w, scale, bias, n, k, i, j, 1, kind, alike);
            }
        }
        if (i < m) {
            if (kind == KIND_BF16) {
                block4_bf16(y, x, xp, w, bias, n, k, i, j, 0, alike);
            } else {
                block4(y, x, w, scale, bias, n, k, i, j, 0, kind, alike);
            }
        }
    }
    for (; j < n1; j++) {
        for (int i = 0; i < m; i++) {
            row1(y, x, w, scale, bias, n, k, i, j, kind);
        }
    }
}

X86 static void gemv_bf16(float *y, const float *x, const float *xp, const void *w, const float *bias, int m,
                          int n, int k, int n0, int n1, int alike)
{
    gemv(y, x, xp, w, NULL, bias, m, n, k, n0, n1, KIND_BF16, alike);
}

X86 static void gemv_f16(float *y, const float *x, const void *w, const float *bias, int m, int n, int k,
                         int n0, int n1, int alike)
{
    gemv(y, x, NULL, w, NULL, bias, m, n, k, n0, n1, KIND_F16, alike);
}

X86 static void gemv_i8(float *y, const float *x, const void *w, const float *scale, const float *bias, int m,
                        int n, int k, int n0, int n1, int alike)
{
    gemv(y, x, NULL, w, scale, bias, m, n, k, n0, n1, KIND_I8, alike);
}

#define X512_ISA    "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define X512        __attribute__((target(X512_ISA)))
#define X512_INLINE __attribute__((target(X512_ISA), always_inline)) static inline

/* Sixteen weights from element idx of row as fp32 (AVX-512; int8 unscaled). */
X512_INLINE __m512 widen16(const void *row, int idx, int kind)
{
    const char *p = (const char *)row + (size_t)idx * esize(kind);
    if (kind == KIND_I8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    }
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kind == KIND_BF16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtph_ps(h);
}

X512_INLINE __m256 half512(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* AVX-512 batch-1 GEMV (m = 1): 16 weights per widening, four rows × two 16-wide steps = 8
 * independent FMA chains. At AVX2 width int8 decode was bound by the widening rate, not by memory
 * (0.55–0.70× the read bandwidth on a 512 MiB GEMV); here int8 runs 1.5× faster from L2. bf16
 * widens by a 16-bit zero extension and shift (one shuffle per 16 weights), so x needs no
 * permutation on this path. */
X512_INLINE void gemv1_512(float *y, const float *x, const void *w, const float *scale, const float *bias,
                           int k, int n0, int n1, int kind)
{
    int k32 = k & ~31, j = n0;
    size_t stride = (size_t)k * esize(kind);
    for (; j + 4 <= n1; j += 4) {
        const char *w0 = (const char *)w + (size_t)j * stride, *w1 = w0 + stride, *w2 = w1 + stride,
                   *w3 = w2 + stride;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int p = 0; p < k32; p += 32) {
            prefetch_row(w0, p, kind);
            prefetch_row(w1, p, kind);
            prefetch_row(w2, p, kind);
            prefetch_row(w3, p, kind);
            __m512 xv = _mm512_loadu_ps(x + p), xw = _mm512_loadu_ps(x + p + 16);
            a0 = _mm512_fmadd_ps(widen16(w0, p, kind), xv, a0);
            a1 = _mm512_fmadd_ps(widen16(w1, p, kind), xv, a1);
            a2 = _mm512_fmadd_ps(widen16(w2, p, kind), xv, a2);
            a3 = _mm512_fmadd_ps(widen16(w3, p, kind), xv, a3);
            b0 = _mm512_fmadd_ps(widen16(w0, p + 16, kind), xw, b0);
            b1 = _mm512_fmadd_ps(widen16(w1, p + 16, kind), xw, b1);
            b2 = _mm512_fmadd_ps(widen16(w2, p + 16, kind), xw, b2);
            b3 = _mm512_fmadd_ps(widen16(w3, p + 16, kind), xw, b3);
        }
        __m128 sa = hsum4(half512(_mm512_add_ps(a0, b0)), half512(_mm512_add_ps(a1, b1)),
                          half512(_mm512_add_ps(a2, b2)), half512(_mm512_add_ps(a3, b3)));
        const void *const wr[4] = {w0, w1, w2, w3};
        finish4(y, x, x, wr, scale, bias, 0, k, k32, 0, j, 0, kind, sa, _mm_setzero_ps());
    }
    for (; j < n1; j++) {
        row1(y, x, w, scale, bias, 0, k, 0, j, kind);
    }
}

X512 static void gemv1_512_i8(float *y, const float *x, const void *w, const float *scale, const float *bias,
                              int k, int n0, int n1)
{
    gemv1_512(y, x, w, scale, bias, k, n0, n1, KIND_I8);
}

X512 static void gemv1_512_bf16(float *y, const float *x, const void *w, const float *bias, int k, int n0,
                                int n1)
{
    gemv1_512(y, x, w, NULL, bias, k, n0, n1, KIND_BF16);
}

int pd_cpu_gemv_lowp_x86_wants_xp(pd_dtype_t dt, int m, bool invariant)
{
    return dt == PD_DTYPE_BF16 &&
           !(m == 1 && !invariant && pd_cpu_avx512_usable()); /* gemv1_512 reads x as it is */
}

X86 void pd_cpu_gemv_lowp_x86(float *y, const float *x, const float *xp, pd_weight_t w, const float *bias,
                              int m, int n, int k, int n0, int n1, bool invariant)
{
    bool one_row = m == 1 && !invariant;
    /* batch 1 with AVX-512 for int8 and bf16 (L2-resident gate_up: int8 76 → 114, bf16 66–82 → 104
     * GFLOP/s; from DRAM about equal); fp16 stays on F16C at AVX2 width, whose 512 MiB GEMV was
     * as fast or faster (pd-bench-ops A/B, 2026-11-24). bf16 reaches here only on a CPU without
     * AVX512-BF16: with it, matmul.c sends bf16 at small m to the split-x bf16 GEMV (matmul_bf16.h) */
    if (one_row && w.dtype == PD_DTYPE_I8 && pd_cpu_avx512_usable()) {
        gemv1_512_i8(y, x, w.data, w.scale, bias, k, n0, n1);
    } else if (one_row && w.dtype == PD_DTYPE_BF16 && pd_cpu_avx512_usable()) {
        gemv1_512_bf16(y, x, w.data, bias, k, n0, n1);
    } else if (w.dtype == PD_DTYPE_BF16) {
        gemv_bf16(y, x, xp, w.data, bias, m, n, k, n0, n1, invariant);
    } else if (w.dtype == PD_DTYPE_I8) {
        gemv_i8(y, x, w.data, w.scale, bias, m, n, k, n0, n1, invariant);
    } else {
        gemv_f16(y, x, w.data, bias, m, n, k, n0, n1, invariant);
    }
}

X86_INLINE void widen(float *dst, const void *src, size_t n, float scale, int kind)
{
    size_t n8 = n & ~(size_t)7;
    __m256 sc = _mm256_set1_ps(scale);
    for (size_t i = 0; i < n8; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(widen8(src, (int)i, kind), sc));
    }
    for (size_t i = n8; i < n; i++) {
        dst[i] = widen1(src, (int)i, kind) * scale;
    }
}

X86 void pd_cpu_widen_x86(float *dst, const void *src, pd_dtype_t dt, size_t n, float scale)
{
    if (dt == PD_DTYPE_BF16) {
        widen(dst, src, n, scale, KIND_BF16);
    } else if (dt == PD_DTYPE_I8) {
        widen(dst, src, n, scale, KIND_I8);
    } else {
        widen(dst, src, n, scale, KIND_F16);
    }
}
