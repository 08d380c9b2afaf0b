/* engine/spec_verify.c — accepting or replacing draft tokens (see spec_verify.h). */
#include "engine/spec_verify.h"

#include <stdbool.h>
#include <stddef.h>

/* The unnormalised probability of tok in a distribution listed by ascending id (0 if not kept). */
static float prob_of(const pd_sample_cand_t *c, int n, int32_t tok)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (c[mid].id < tok) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < n && c[lo].id == tok ? c[lo].z : 0.0f;
}

int32_t pd_spec_verify(const float *rows, int32_t vocab, const int32_t *drafts, int32_t s,
                       const pd_sampling_params_t *p, pd_rng_t *rngs, pd_sample_cand_t *c, int32_t *out)
{
    bool greedy = p->temperature < PD_SAMPLING_EPS;
    for (int32_t j = 0; j <= s; j++) {
        const float *row = rows + (size_t)j * (size_t)vocab;
        if (greedy) {
            out[j] = pd_sample_argmax(row, vocab);
            if (j == s || out[j] != drafts[j]) {
                return j + 1;
            }
            continue;
        }
        pd_rng_t *rng = &rngs[j];
        double total;
        int n = pd_sample_dist(row, vocab, p, c, &total);
        if (j == s) { /* every draft held: the bonus token */
            out[j] = pd_sample_draw(c, n, total, pd_rng_uniform(rng));
            return j + 1;
        }
        double w = prob_of(c, n, drafts[j]);
        if (pd_rng_uniform(rng) * total < w) {
            out[j] = drafts[j];
            continue;
        }
        /* rejected: draw from p without the draft (its weight set to zero) */
        for (int i = 0; i < n; i++) {
            if (c[i].id == drafts[j]) {
                c[i].z = 0;
            }
        }
        out[j] = pd_sample_draw(c, n, total - w, pd_rng_uniform(rng));
        return j + 1;
    }
    return s + 1; /* not reached */
}
