/* model/rope.c — rotary tables (see rope.h). Frequencies in double; the formulas follow
 * transformers' _compute_*_parameters. */
#include "model/rope.h"

#include <math.h>
#include <string.h>

#include "common/log.h"

static double yarn_get_mscale(double scale, double mscale)
{
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* Dimension index at which the wavelength completes num_rotations over max_pos positions. */
static double yarn_correction_dim(double num_rotations, int dim, double base, double max_pos)
{
    return (dim * log(max_pos / (num_rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

static void yarn(const pd_rope_scaling_t *s, int dim, double base, pd_rope_t *r)
{
    double factor = s->factor, omax = s->original_max_position_embeddings;
    double low = yarn_correction_dim(s->beta_fast, dim, base, omax);
    double high = yarn_correction_dim(s->beta_slow, dim, base, omax);
    if (s->truncate) {
        low = floor(low);
        high = ceil(high);
    }
    low = low > 0 ? low : 0;
    high = high < dim - 1 ? high : dim - 1;
    if (low == high) {
        high += 0.001; /* no division by zero */
    }
    for (int i = 0; i < r->half; i++) {
        double pos_freq = pow(base, (2.0 * i) / dim);
        double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
        double ramp = ((double)i - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double extra_factor = 1.0 - ramp; /* 1: keep the original frequency */
        r->inv_freq[i] = interpolation * (1.0 - extra_factor) + extrapolation * extra_factor;
    }
    double attn = s->attention_factor;
    if (attn < 0) {
        attn = s->mscale > 0 && s->mscale_all_dim > 0
                   ? yarn_get_mscale(factor, s->mscale) / yarn_get_mscale(factor, s->mscale_all_dim)
                   : yarn_get_mscale(factor, 1.0);
    }
    r->scale = (float)attn;
}

static void llama3(const pd_rope_scaling_t *s, pd_rope_t *r)
{
    double omax = s->original_max_position_embeddings;
    double low_wavelen = omax / s->low_freq_factor, high_wavelen = omax / s->high_freq_factor;
    for (int i = 0; i < r->half; i++) {
        double f = r->inv_freq[i], wavelen = 2.0 * M_PI / f;
        if (wavelen < high_wavelen) {
            continue; /* high frequencies stay */
        }
        if (wavelen > low_wavelen) {
            r->inv_freq[i] = f / s->factor; /* low frequencies are interpolated */
            continue;
        }
        double smooth = (omax / wavelen - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
        r->inv_freq[i] = (1.0 - smooth) * f / s->factor + smooth * f;
    }
}

pd_status_t pd_rope_table(const pd_model_config_t *c, pd_rope_t *r)
{
    int dim = c->head_size;
    if (dim <= 0 || dim % 2 != 0 || dim / 2 > PD_ROPE_MAX_HALF) {
        pd_log_error("rope: head size %d is not supported (even, at most %d)", dim, 2 * PD_ROPE_MAX_HALF);
        return PD_ERR_UNSUPPORTED;
    }
    memset(r, 0, sizeof(*r));
    r->half = dim / 2;
    r->scale = 1.0f;
    const pd_rope_scaling_t *s = &c->rope_scaling;
    double base = c->rope_theta;
    if (s->type == PD_ROPE_DYNAMIC) { /* vLLM: the NTK-aware base for the longest context, fixed */
        double max_len = (double)c->max_position_embeddings * s->factor;
        base = base * pow(s->factor * max_len / c->max_position_embeddings - (s->factor - 1.0),
                          (double)dim / (dim - 2));
    }
    if (s->type == PD_ROPE_YARN) {
        yarn(s, dim, base, r);
        return PD_OK;
    }
    for (int i = 0; i < r->half; i++) {
        r->inv_freq[i] = 1.0 / pow(base, (2.0 * i) / dim);
        if (s->type == PD_ROPE_LINEAR) {
            r->inv_freq[i] /= s->factor;
        }
    }
    if (s->type == PD_ROPE_LLAMA3) {
        llama3(s, r);
    }
    return PD_OK;
}
