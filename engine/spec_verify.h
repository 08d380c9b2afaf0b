/* engine/spec_verify.h — verification of draft tokens (speculative decoding) against the target
 * model's logits, with vLLM's rules:
 *   greedy (temperature < 1e-5): accept drafts while each equals the argmax of its row; the first
 *     mismatch is replaced by that argmax; if every draft holds, the last row adds a bonus token.
 *   sampling: rejection sampling (Leviathan et al. 2023) for a proposer that puts all its mass on
 *     its draft (n-gram lookup: q = one-hot): draft d is accepted with probability p(d); a
 *     rejected one is replaced by a draw from p with d removed (max(p − q, 0), renormalised);
 *     after all accepted, the bonus token is drawn from the last row. Each output token then
 *     follows the target distribution p exactly, whatever the drafts were.
 * p is the sampling op's distribution (kernels/sample.h: temperature, top-k, min-p, top-p). Draws
 * come from the request's generator in a fixed order (per draft: one u to accept, one more to
 * replace; then one for the bonus), so seeded requests are reproducible. */
#ifndef PD_ENGINE_SPEC_VERIFY_H
#define PD_ENGINE_SPEC_VERIFY_H

#include <stdint.h>

#include "common/rng.h"
#include "common/sampling.h"
#include "kernels/sample.h"

/* rows[s + 1][vocab]: processed logits, row j scoring the token after drafts[0, j) (row 0: after
 * the request's last real token). Writes the output tokens to out (room for s + 1) and returns how
 * many (1 + the accepted drafts; out[0, n − 1) are those drafts). Row j draws from rngs[j] only (its
 * output position's generator: the same draws whether the position is verified here or sampled
 * alone). scratch holds vocab entries. */
int32_t pd_spec_verify(const float *rows, int32_t vocab, const int32_t *drafts, int32_t s,
                       const pd_sampling_params_t *p, pd_rng_t *rngs, pd_sample_cand_t *scratch,
                       int32_t *out);

#endif
