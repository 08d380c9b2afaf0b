/* kernels/rope_impl.h — rotary position embedding math shared by kernels/cpu and kernels/cuda.
 *
 * A model computes its rotary table once (model/rope.c: the inverse frequencies with its
 * rope_scaling applied, and YaRN's attention factor) and every backend rotates with it: pair
 * (i, i + head_size/2) of each head turns by position × inv_freq[i] (HF rotate_half), with cos and
 * sin multiplied by scale. Angles are taken in double. */
#ifndef PD_KERNELS_ROPE_IMPL_H
#define PD_KERNELS_ROPE_IMPL_H

#include <math.h>

#include "kernels/pd_hd.h"

#define PD_ROPE_MAX_HALF 512

typedef struct pd_rope {
    int half;                          /* head_size / 2 */
    double inv_freq[PD_ROPE_MAX_HALF]; /* [half] */
    float scale;                       /* multiplies cos and sin (YaRN's attention factor; else 1) */
} pd_rope_t;

/* cos and sin of position pos for frequency i, scaled. */
PD_HD static inline void pd_rope_cos_sin(const pd_rope_t *r, int i, int pos, float *c, float *s)
{
    double ang = (double)pos * r->inv_freq[i];
    *c = (float)cos(ang) * r->scale;
    *s = (float)sin(ang) * r->scale;
}

/* Rotates the pair (v[i], v[i + half]) by (c, s). */
PD_HD static inline void pd_rope_rotate(float *v, int i, int half, float c, float s)
{
    float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
}

#endif
