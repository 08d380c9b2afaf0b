/* scheduler/prefill_cost.c — the prompt-compute cost fit (see prefill_cost.h). */
#include "scheduler/prefill_cost.h"

#include <string.h>

void pd_prefill_cost_init(pd_prefill_cost_t *c, double gamma, int32_t window, double slide_share)
{
    memset(c, 0, sizeof(*c));
    c->gamma = gamma > 0 ? gamma : 0;
    c->window = window > 0 ? window : 0;
    c->slide_share = c->window > 0 && slide_share > 0 ? (slide_share < 1 ? slide_share : 1) : 0;
}

double pd_prefill_cost_flop_ratio(int32_t num_heads, int32_t head_size, double linear_macs)
{
    return linear_macs > 0 ? 2.0 * num_heads * head_size / linear_macs : 0;
}

/* The sum of p + 1 over p in [from, to): a token at position p attends to p + 1 positions. */
static double span_sum(double from, double to)
{
    return to > from ? (to - from) * (from + to + 1) / 2 : 0;
}

double pd_prefill_cost_positions(const pd_prefill_cost_t *c, int64_t from, int64_t to)
{
    if (to <= from) {
        return 0;
    }
    double full = span_sum((double)from, (double)to);
    if (c->slide_share <= 0) {
        return full;
    }
    /* a sliding layer: p + 1 below the window, the window from position window - 1 on */
    double w = c->window, edge = from > w - 1 ? (double)from : w - 1;
    double slide = span_sum((double)from, edge < (double)to ? edge : (double)to);
    slide += (double)to > edge ? ((double)to - edge) * w : 0;
    return (1 - c->slide_share) * full + c->slide_share * slide;
}

void pd_prefill_cost_observe(pd_prefill_cost_t *c, double tokens, double positions, double seconds)
{
    if (tokens <= 0 || positions <= 0 || seconds <= 0) {
        return;
    }
    double d = PD_PREFILL_COST_DECAY, n = tokens, a = positions;
    c->snn = d * c->snn + n * n;
    c->sna = d * c->sna + n * a;
    c->saa = d * c->saa + a * a;
    c->sns = d * c->sns + n * seconds;
    c->sas = d * c->sas + a * seconds;
    c->steps++;
    double det = c->snn * c->saa - c->sna * c->sna;
    if (det > (1 - PD_PREFILL_COST_MAX_CORR2) * c->snn * c->saa) {
        /* the steps differ in shape: both terms from them */
        double alpha = (c->sns * c->saa - c->sas * c->sna) / det;
        double beta = (c->sas * c->snn - c->sns * c->sna) / det;
        if (alpha > 0 && beta >= 0) {
            c->alpha = alpha, c->beta = beta;
            c->gamma = beta / alpha;
            c->learned = true;
            return;
        }
    }
    /* one shape (or a fit outside the physical range): the scale along the ratio known */
    double g = c->gamma, uu = c->snn + 2 * g * c->sna + g * g * c->saa;
    c->alpha = (c->sns + g * c->sas) / uu;
    c->beta = g * c->alpha;
}

bool pd_prefill_cost_step(const pd_prefill_cost_t *c, double tokens, double positions, double *seconds)
{
    *seconds = c->alpha * tokens + c->beta * positions;
    return c->alpha > 0;
}

bool pd_prefill_cost_estimate(const pd_prefill_cost_t *c, int64_t from, int64_t to, double *seconds)
{
    double n = to > from ? (double)(to - from) : 0;
    return pd_prefill_cost_step(c, n, pd_prefill_cost_positions(c, from, to), seconds);
}
