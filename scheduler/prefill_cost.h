/* scheduler/prefill_cost.h — what computing prompt tokens costs this node, learned from its own
 * steps (issue 52's fetch-or-compute choice, connector/kv_cost.c, is its reader).
 *
 * A step of N tokens whose attention spans A positions in all takes about
 *
 *     alpha · N + beta · A  seconds
 *
 * where A sums, over the step's tokens, the positions each token attends to, averaged over the
 * layers (a sliding-window layer counts at most its window). alpha is the per-token part (the
 * matmuls), beta the attention's growth with context: at an 8 k context the second term is most
 * of a step on the demo model (bench/RESULTS.md), so a plain tokens-per-second rate measured at
 * short contexts under-estimates a long prefix several times over.
 *
 * The fit is least squares over recent prompt-heavy steps (sums decayed by PD_PREFILL_COST_DECAY
 * per step). When those steps cannot tell the two terms apart (every one the same shape: their N
 * and A nearly proportional), the ratio beta / alpha last learned is kept and only the scale is
 * fitted; before any learned ratio it is the model's FLOP ratio (pd_prefill_cost_init's gamma).
 * One engine thread writes and reads it (the connector's scheduler half runs on that thread). */
#ifndef PD_SCHEDULER_PREFILL_COST_H
#define PD_SCHEDULER_PREFILL_COST_H

#include <stdbool.h>
#include <stdint.h>

#define PD_PREFILL_COST_DECAY     0.9  /* weight of the older steps at each new one */
#define PD_PREFILL_COST_MAX_CORR2 0.98 /* above this squared correlation of N and A: keep the ratio */

typedef struct pd_prefill_cost {
    int32_t window;                 /* the sliding window of the layers that have one (0: none) */
    double slide_share;             /* the share of the layers that attend within window */
    double gamma;                   /* beta / alpha: the model's FLOP ratio until steps teach it */
    double snn, sna, saa, sns, sas; /* decayed sums of N², N·A, A², N·s, A·s */
    int64_t steps;                  /* steps observed */
    bool learned;                   /* gamma came from steps, not from the model's shape */
    double alpha, beta;             /* seconds per token and per attended position; 0: unknown */
} pd_prefill_cost_t;

/* Starts with nothing measured. gamma: the model's attention work per attended position over its
 * per-token work (pd_prefill_cost_flop_ratio); window and slide_share as in the struct. */
void pd_prefill_cost_init(pd_prefill_cost_t *c, double gamma, int32_t window, double slide_share);

/* The FLOP ratio of a decoder layer stack: each token's attention does 2 · heads · head_size
 * multiply-adds per position it attends to (q·k and p·v); its matmuls do linear_macs per token
 * (all projections and the MLP, per layer). */
double pd_prefill_cost_flop_ratio(int32_t num_heads, int32_t head_size, double linear_macs);

/* A: the positions tokens at positions [from, to) attend to, summed (each attends to itself and
 * every earlier position, a sliding layer to at most window of them). */
double pd_prefill_cost_positions(const pd_prefill_cost_t *c, int64_t from, int64_t to);

/* One step: tokens tokens spanning positions (pd_prefill_cost_positions, summed over its
 * requests) took seconds. Non-positive figures are ignored. */
void pd_prefill_cost_observe(pd_prefill_cost_t *c, double tokens, double positions, double seconds);

/* The seconds of a step of tokens tokens spanning positions; false (and 0) before any step. */
bool pd_prefill_cost_step(const pd_prefill_cost_t *c, double tokens, double positions, double *seconds);

/* The seconds computing a prompt's positions [from, to) takes at this cost; false (and 0) before
 * any step was observed. */
bool pd_prefill_cost_estimate(const pd_prefill_cost_t *c, int64_t from, int64_t to, double *seconds);

#endif
