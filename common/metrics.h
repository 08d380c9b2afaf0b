/* common/metrics.h — a Prometheus metrics registry: counters, gauges, histograms (fixed buckets),
 * labelled series, constant labels per name prefix (vLLM's model_name/engine on every vllm: series);
 * rendered in the text exposition format (version 0.0.4), one family's series together.
 * Thread-safe: every update and the render take the registry's mutex (updates are O(buckets)). */
#ifndef PD_COMMON_METRICS_H
#define PD_COMMON_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct pd_metrics pd_metrics_t;
typedef struct pd_metric pd_metric_t;

typedef enum pd_metric_kind {
    PD_METRIC_COUNTER,
    PD_METRIC_GAUGE,
    PD_METRIC_HISTOGRAM,
} pd_metric_kind_t;

pd_status_t pd_metrics_create(pd_metrics_t **out);
void pd_metrics_destroy(pd_metrics_t *m);

/* One label of a series; value is escaped when rendered (backslash, quote, newline). */
typedef struct pd_metric_label {
    const char *key; /* [a-zA-Z_][a-zA-Z0-9_]* */
    const char *value;
} pd_metric_label_t;

/* Registers a series. name must match [a-zA-Z_:][a-zA-Z0-9_:]*; label "key=value" or NULL;
 * buckets (histograms only): upper bounds in increasing order, +Inf is implicit. Series with the
 * same name share HELP/TYPE lines. Returns NULL when out of memory or the name is invalid. */
pd_metric_t *pd_metrics_add(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                            const char *label, const double *buckets, int num_buckets);

/* As pd_metrics_add with any number of labels (num_labels 0: none). NULL also when a key is invalid
 * or the rendered labels exceed 512 bytes. */
pd_metric_t *pd_metrics_add_labels(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                                   const pd_metric_label_t *labels, int num_labels, const double *buckets,
                                   int num_buckets);

/* Constant labels rendered first on every series whose name starts with prefix, registered before
 * or after this call (vLLM's {model_name, engine} on "vllm:"; the model name is known after the
 * connector registered its series). One prefix per registry; a later call replaces it. */
pd_status_t pd_metrics_set_const_labels(pd_metrics_t *m, const char *prefix, const pd_metric_label_t *labels,
                                        int num_labels);

/* Counter += v (v >= 0 enforced by ignoring negatives); gauge = v; histogram observe v. */
void pd_metric_inc(pd_metric_t *c, double v);
void pd_metric_set(pd_metric_t *g, double v);
void pd_metric_observe(pd_metric_t *h, double v);

/* Renders every series; the caller frees the returned NUL-terminated text. */
char *pd_metrics_render(pd_metrics_t *m, size_t *len_out);

/* The sum of the samples in Prometheus text whose name is series' name and whose labels include
 * every label series gives: "pd:kv_peers" sums every pd:kv_peers sample whatever its labels,
 * "vllm:request_success_total{finished_reason=\"abort\"}" the abort ones of every model and engine
 * (as a PromQL sum() would); def when no sample matches. */
double pd_metrics_text_value(const char *text, const char *series, double def);

/* Latency buckets in seconds used by the pd: latency histograms (KV phases, steps). */
extern const double PD_LATENCY_BUCKETS[];
extern const int PD_LATENCY_NUM_BUCKETS;

/* vLLM's buckets (v1 PrometheusStatLogger), so that dashboards' histogram_quantile reads the same:
 * TTFT; inter-token latency and time per output token; request latencies (e2e, queue, inference,
 * prefill, decode); tokens per engine step. */
extern const double PD_VLLM_TTFT_BUCKETS[];
extern const int PD_VLLM_TTFT_NUM_BUCKETS;
extern const double PD_VLLM_ITL_BUCKETS[];
extern const int PD_VLLM_ITL_NUM_BUCKETS;
extern const double PD_VLLM_REQUEST_BUCKETS[];
extern const int PD_VLLM_REQUEST_NUM_BUCKETS;
extern const double PD_VLLM_ITERATION_BUCKETS[];
extern const int PD_VLLM_ITERATION_NUM_BUCKETS;

/* vLLM's 1-2-5 series up to max (1, 2, 5, 10, 20, 50, ... <= max) for token-count histograms;
 * writes at most cap bounds to out and returns how many. */
int pd_metrics_buckets_125(double max, double *out, int cap);

#endif
