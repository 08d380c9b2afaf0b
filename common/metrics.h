/* common/metrics.h — a Prometheus metrics registry: counters, gauges, histograms (fixed buckets),
 * optional single label per series; rendered in the text exposition format (version 0.0.4).
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

/* Registers a series. name must match [a-zA-Z_:][a-zA-Z0-9_:]*; label "key=value" or NULL;
 * buckets (histograms only): upper bounds in increasing order, +Inf is implicit. Series with the
 * same name share HELP/TYPE lines. Returns NULL when out of memory or the name is invalid. */
pd_metric_t *pd_metrics_add(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                            const char *label, const double *buckets, int num_buckets);

/* Counter += v (v >= 0 enforced by ignoring negatives); gauge = v; histogram observe v. */
void pd_metric_inc(pd_metric_t *c, double v);
void pd_metric_set(pd_metric_t *g, double v);
void pd_metric_observe(pd_metric_t *h, double v);

/* Renders every series; the caller frees the returned NUL-terminated text. */
char *pd_metrics_render(pd_metrics_t *m, size_t *len_out);

/* The value of one series in Prometheus text: the line "SERIES VALUE", where series is a name or
 * name{labels} exactly as rendered ("pd:kv_peers", "pd:x_total{kind=\"pull\"}"); def when absent. */
double pd_metrics_text_value(const char *text, const char *series, double def);

/* Latency buckets in seconds used by the TTFT / ITL / e2e / queue / step histograms. */
extern const double PD_LATENCY_BUCKETS[];
extern const int PD_LATENCY_NUM_BUCKETS;

#endif
