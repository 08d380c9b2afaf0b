/* kernels/cpu/transpose_x512.h — a 16 × 16 matrix of 32-bit words transposed in AVX-512 registers:
 * bf16 pairs turned from rows into columns (matmul_bf16p_dot.c's x as column pairs,
 * attention_prefill_tiled.c's K as pairs along d). Private to kernels/cpu; the including file must
 * be x86-64 GCC. */
#ifndef PD_KERNELS_CPU_TRANSPOSE_X512_H
#define PD_KERNELS_CPU_TRANSPOSE_X512_H

#include <immintrin.h>

/* r[i] holds row i (word c in lane c); afterwards r[c] holds column c (row i's word in lane i).
 * 32- then 64-bit unpacks within 128-bit lanes, then two rounds of 128-bit lane shuffles: 64
 * instructions with immediate controls, no index vectors. */
static inline __attribute__((target("avx512f"), always_inline)) void pd_transpose16_epi32(__m512i r[16])
{
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) { /* lane L of t[2i]: r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1] */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* lane L of r[4i + c]: rows 4i .. 4i + 3 of column 4L + c */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) { /* t[c]: rows 0-3 of columns c and 8 + c, then rows 4-7 of both */
        t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) { /* the four row quarters of columns c, 8 + c, 4 + c and 12 + c */
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xdd);
    }
}

#endif
