/* common/metrics.c — Prometheus registry. */
#define _GNU_SOURCE
#include "common/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"

const double PD_LATENCY_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
                                     0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};
const int PD_LATENCY_NUM_BUCKETS = (int)(sizeof(PD_LATENCY_BUCKETS) / sizeof(PD_LATENCY_BUCKETS[0]));

#define MAX_BUCKETS 32

struct pd_metric {
    pd_metric_kind_t kind;
    char name[96];
    char help[160];
    char label[96];
    double value; /* counter / gauge; histogram sum */
    double bounds[MAX_BUCKETS];
    uint64_t counts[MAX_BUCKETS + 1]; /* per bucket (not cumulative), last = +Inf */
    uint64_t total;
    int num_bounds;
    pd_metrics_t *owner;
};

struct pd_metrics {
    pthread_mutex_t mu;
    pd_metric_t **items;
    int n;
    size_t cap;
};

pd_status_t pd_metrics_create(pd_metrics_t **out)
{
    pd_metrics_t *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return PD_OK;
}

void pd_metrics_destroy(pd_metrics_t *m)
{
    if (m == NULL) {
        return;
    }
    for (int i = 0; i < m->n; i++) {
        free(m->items[i]);
    }
    free(m->items);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static int valid_name(const char *s)
{
    if (s == NULL || *s == '\0' || (*s >= '0' && *s <= '9')) {
        return 0;
    }
    for (; *s; s++) {
        char c = *s;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == ':')) {
            return 0;
        }
    }
    return 1;
}

pd_metric_t *pd_metrics_add(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                            const char *label, const double *buckets, int num_buckets)
{
    if (!valid_name(name) || num_buckets > MAX_BUCKETS || strlen(name) >= 96) {
        return NULL;
    }
    pd_metric_t *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        return NULL;
    }
    x->kind = kind;
    snprintf(x->name, sizeof(x->name), "%s", name);
    snprintf(x->help, sizeof(x->help), "%s", help);
    if (label != NULL) {
        /* key=value → key="value" */
        const char *eq = strchr(label, '=');
        if (eq != NULL) {
            snprintf(x->label, sizeof(x->label), "%.*s=\"%s\"", (int)(eq - label), label, eq + 1);
        }
    }
    for (int i = 0; i < num_buckets; i++) {
        x->bounds[i] = buckets[i];
    }
    x->num_bounds = kind == PD_METRIC_HISTOGRAM ? num_buckets : 0;
    x->owner = m;
    pthread_mutex_lock(&m->mu);
    if (pd_array_reserve(&m->items, &m->cap, (size_t)m->n + 1) != PD_OK) {
        pthread_mutex_unlock(&m->mu);
        free(x);
        return NULL;
    }
    m->items[m->n++] = x;
    pthread_mutex_unlock(&m->mu);
    return x;
}

void pd_metric_inc(pd_metric_t *c, double v)
{
    if (c == NULL || !(v >= 0)) {
        return;
    }
    pthread_mutex_lock(&c->owner->mu);
    c->value += v;
    pthread_mutex_unlock(&c->owner->mu);
}

void pd_metric_set(pd_metric_t *g, double v)
{
    if (g == NULL) {
        return;
    }
    pthread_mutex_lock(&g->owner->mu);
    g->value = v;
    pthread_mutex_unlock(&g->owner->mu);
}

void pd_metric_observe(pd_metric_t *h, double v)
{
    if (h == NULL || isnan(v)) {
        return;
    }
    pthread_mutex_lock(&h->owner->mu);
    int b = 0;
    while (b < h->num_bounds && v > h->bounds[b]) {
        b++;
    }
    h->counts[b]++;
    h->total++;
    h->value += v;
    pthread_mutex_unlock(&h->owner->mu);
}

typedef struct sbuf {
    char *p;
    size_t len, cap;
} sbuf_t;

static void sb_printf(sbuf_t *b, const char *fmt, ...)
{
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *q = realloc(b->p, cap);
        if (q == NULL) {
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static void fmt_value(char *buf, size_t len, double v)
{
    if (isinf(v)) {
        snprintf(buf, len, v > 0 ? "+Inf" : "-Inf");
    } else if (v == (double)(int64_t)v && fabs(v) < 1e15) {
        snprintf(buf, len, "%lld", (long long)v);
    } else {
        snprintf(buf, len, "%.9g", v);
    }
}

char *pd_metrics_render(pd_metrics_t *m, size_t *len_out)
{
    sbuf_t b = {malloc(4096), 0, 4096};
    if (b.p == NULL) {
        return NULL;
    }
    b.p[0] = '\0';
    static const char *types[] = {"counter", "gauge", "histogram"};
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n; i++) {
        pd_metric_t *x = m->items[i];
        int first = 1;
        for (int j = 0; j < i; j++) {
            first &= strcmp(m->items[j]->name, x->name) != 0;
        }
        if (first) {
            sb_printf(&b, "# HELP %s %s\n# TYPE %s %s\n", x->name, x->help, x->name, types[x->kind]);
        }
        char v[48];
        const char *sep = x->label[0] ? "," : "";
        if (x->kind != PD_METRIC_HISTOGRAM) {
            fmt_value(v, sizeof(v), x->value);
            if (x->label[0]) {
                sb_printf(&b, "%s{%s} %s\n", x->name, x->label, v);
            } else {
                sb_printf(&b, "%s %s\n", x->name, v);
            }
            continue;
        }
        uint64_t cum = 0;
        for (int k = 0; k <= x->num_bounds; k++) {
            cum += x->counts[k];
            char le[48];
            fmt_value(le, sizeof(le), k < x->num_bounds ? x->bounds[k] : INFINITY);
            sb_printf(&b, "%s_bucket{%s%sle=\"%s\"} %llu\n", x->name, x->label, sep, le,
                      (unsigned long long)cum);
        }
        fmt_value(v, sizeof(v), x->value);
        if (x->label[0]) {
            sb_printf(&b, "%s_sum{%s} %s\n%s_count{%s} %llu\n", x->name, x->label, v, x->name, x->label,
                      (unsigned long long)x->total);
        } else {
            sb_printf(&b, "%s_sum %s\n%s_count %llu\n", x->name, v, x->name, (unsigned long long)x->total);
        }
    }
    pthread_mutex_unlock(&m->mu);
    *len_out = b.len;
    return b.p;
}

double pd_metrics_text_value(const char *text, const char *series, double def)
{
    size_t n = strlen(series);
    for (const char *line = text; line != NULL && *line != '\0';) {
        if (strncmp(line, series, n) == 0 && line[n] == ' ') {
            return strtod(line + n + 1, NULL);
        }
        line = strchr(line, '\n');
        line = line != NULL ? line + 1 : NULL;
    }
    return def;
}
