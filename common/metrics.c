/* common/metrics.c — Prometheus registry. */
#define _GNU_SOURCE
#include "common/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"

const double PD_LATENCY_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
                                     0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};
const int PD_LATENCY_NUM_BUCKETS = (int)(sizeof(PD_LATENCY_BUCKETS) / sizeof(PD_LATENCY_BUCKETS[0]));

#define NELEMS(a) ((int)(sizeof(a) / sizeof((a)[0])))
const double PD_VLLM_TTFT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                       0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                       20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
const int PD_VLLM_TTFT_NUM_BUCKETS = NELEMS(PD_VLLM_TTFT_BUCKETS);
const double PD_VLLM_ITL_BUCKETS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                      0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const int PD_VLLM_ITL_NUM_BUCKETS = NELEMS(PD_VLLM_ITL_BUCKETS);
const double PD_VLLM_REQUEST_BUCKETS[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                          5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                          60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const int PD_VLLM_REQUEST_NUM_BUCKETS = NELEMS(PD_VLLM_REQUEST_BUCKETS);
const double PD_VLLM_ITERATION_BUCKETS[] = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
const int PD_VLLM_ITERATION_NUM_BUCKETS = NELEMS(PD_VLLM_ITERATION_BUCKETS);

#define MAX_BUCKETS 32
#define LABELS_MAX  512

int pd_metrics_buckets_125(double max, double *out, int cap)
{
    static const double mant[3] = {1, 2, 5};
    int n = 0;
    for (double exp = 1; n < cap; exp *= 10) {
        for (int i = 0; i < 3 && n < cap; i++) {
            if (mant[i] * exp > max) {
                return n;
            }
            out[n++] = mant[i] * exp;
        }
    }
    return n;
}

struct pd_metric {
    pd_metric_kind_t kind;
    char name[96];
    char help[160];
    char label[LABELS_MAX]; /* rendered: k="v",k2="v2" (or empty) */
    double value;           /* counter / gauge; histogram sum */
    double bounds[MAX_BUCKETS];
    uint64_t counts[MAX_BUCKETS + 1]; /* per bucket (not cumulative), last = +Inf */
    uint64_t total;
    int num_bounds;
    pd_metrics_t *owner;
};

/* mu guards everything: items, the series' values, the constant labels */
struct pd_metrics {
    pthread_mutex_t mu;
    pd_metric_t **items;
    int n;
    size_t cap;
    char const_prefix[32];
    char const_label[LABELS_MAX];
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

static int valid_label_key(const char *s)
{
    if (s == NULL || *s == '\0' || (*s >= '0' && *s <= '9')) {
        return 0;
    }
    for (; *s; s++) {
        char c = *s;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) {
            return 0;
        }
    }
    return 1;
}

/* Renders labels as k="v",... into out (cap bytes) with values escaped; -1 when a key is invalid
 * or the text does not fit. */
static int render_labels(const pd_metric_label_t *labels, int n, char *out, size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (!valid_label_key(labels[i].key)) {
            return -1;
        }
        int w = snprintf(out + len, cap - len, "%s%s=\"", i > 0 ? "," : "", labels[i].key);
        if (w < 0 || (size_t)w >= cap - len) {
            return -1;
        }
        len += (size_t)w;
        for (const char *v = labels[i].value != NULL ? labels[i].value : ""; *v; v++) {
            const char *esc = *v == '\\' ? "\\\\" : *v == '"' ? "\\\"" : *v == '\n' ? "\\n" : NULL;
            size_t need = esc != NULL ? 2 : 1;
            if (len + need + 2 >= cap) {
                return -1;
            }
            if (esc != NULL) {
                memcpy(out + len, esc, 2);
            } else {
                out[len] = *v;
            }
            len += need;
        }
        out[len++] = '"';
        out[len] = '\0';
    }
    return 0;
}

pd_metric_t *pd_metrics_add_labels(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                                   const pd_metric_label_t *labels, int num_labels, const double *buckets,
                                   int num_buckets)
{
    if (!valid_name(name) || num_buckets > MAX_BUCKETS || num_buckets < 0 || strlen(name) >= 96) {
        return NULL;
    }
    pd_metric_t *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        return NULL;
    }
    if (render_labels(labels, num_labels, x->label, sizeof(x->label)) != 0) {
        free(x);
        return NULL;
    }
    x->kind = kind;
    snprintf(x->name, sizeof(x->name), "%s", name);
    snprintf(x->help, sizeof(x->help), "%s", help);
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

pd_metric_t *pd_metrics_add(pd_metrics_t *m, pd_metric_kind_t kind, const char *name, const char *help,
                            const char *label, const double *buckets, int num_buckets)
{
    char key[64];
    pd_metric_label_t l = {key, NULL};
    const char *eq = label != NULL ? strchr(label, '=') : NULL;
    if (eq != NULL && (size_t)(eq - label) < sizeof(key)) {
        snprintf(key, sizeof(key), "%.*s", (int)(eq - label), label);
        l.value = eq + 1;
    }
    return pd_metrics_add_labels(m, kind, name, help, &l, l.value != NULL ? 1 : 0, buckets, num_buckets);
}

pd_status_t pd_metrics_set_const_labels(pd_metrics_t *m, const char *prefix, const pd_metric_label_t *labels,
                                        int num_labels)
{
    char text[LABELS_MAX];
    if (prefix == NULL || strlen(prefix) >= sizeof(m->const_prefix) ||
        render_labels(labels, num_labels, text, sizeof(text)) != 0) {
        return PD_ERR_INVALID_ARG;
    }
    pthread_mutex_lock(&m->mu);
    snprintf(m->const_prefix, sizeof(m->const_prefix), "%s", prefix);
    memcpy(m->const_label, text, sizeof(text));
    pthread_mutex_unlock(&m->mu);
    return PD_OK;
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

/* One series' lines; labels are the constant labels (when the prefix matches) then its own. */
static void render_series(sbuf_t *b, const pd_metrics_t *m, const pd_metric_t *x)
{
    char lab[2 * LABELS_MAX + 2];
    bool konst = m->const_prefix[0] != '\0' && m->const_label[0] != '\0' &&
                 strncmp(x->name, m->const_prefix, strlen(m->const_prefix)) == 0;
    snprintf(lab, sizeof(lab), "%s%s%s", konst ? m->const_label : "", konst && x->label[0] ? "," : "",
             x->label);
    char v[48];
    if (x->kind != PD_METRIC_HISTOGRAM) {
        fmt_value(v, sizeof(v), x->value);
        if (lab[0]) {
            sb_printf(b, "%s{%s} %s\n", x->name, lab, v);
        } else {
            sb_printf(b, "%s %s\n", x->name, v);
        }
        return;
    }
    const char *sep = lab[0] ? "," : "";
    uint64_t cum = 0;
    for (int k = 0; k <= x->num_bounds; k++) {
        cum += x->counts[k];
        char le[48];
        fmt_value(le, sizeof(le), k < x->num_bounds ? x->bounds[k] : INFINITY);
        sb_printf(b, "%s_bucket{%s%sle=\"%s\"} %llu\n", x->name, lab, sep, le, (unsigned long long)cum);
    }
    fmt_value(v, sizeof(v), x->value);
    if (lab[0]) {
        sb_printf(b, "%s_sum{%s} %s\n%s_count{%s} %llu\n", x->name, lab, v, x->name, lab,
                  (unsigned long long)x->total);
    } else {
        sb_printf(b, "%s_sum %s\n%s_count %llu\n", x->name, v, x->name, (unsigned long long)x->total);
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
    /* a family's series together (the exposition format wants them contiguous), in the order
     * their names were first registered */
    for (int i = 0; i < m->n; i++) {
        pd_metric_t *x = m->items[i];
        int first = 1;
        for (int j = 0; j < i && first; j++) {
            first = strcmp(m->items[j]->name, x->name) != 0;
        }
        if (!first) {
            continue;
        }
        sb_printf(&b, "# HELP %s %s\n# TYPE %s %s\n", x->name, x->help, x->name, types[x->kind]);
        for (int j = i; j < m->n; j++) {
            if (strcmp(m->items[j]->name, x->name) == 0) {
                render_series(&b, m, m->items[j]);
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    *len_out = b.len;
    return b.p;
}

/* Whether the label text of a sample (between its braces, len bytes) holds the item k="v" whole. */
static bool has_label(const char *labels, size_t len, const char *item, size_t item_len)
{
    for (size_t i = 0; i + item_len <= len; i++) {
        if ((i == 0 || labels[i - 1] == ',') && memcmp(labels + i, item, item_len) == 0 &&
            (i + item_len == len || labels[i + item_len] == ',')) {
            return true;
        }
    }
    return false;
}

/* Whether every k="v" item of want (want_len bytes, comma-separated, quotes may hold commas) is
 * among the sample's labels. */
static bool has_labels(const char *labels, size_t len, const char *want, size_t want_len)
{
    size_t i = 0;
    while (i < want_len) {
        size_t j = i;
        bool quoted = false;
        for (; j < want_len && (quoted || want[j] != ','); j++) {
            if (want[j] == '\\' && j + 1 < want_len) {
                j++;
            } else if (want[j] == '"') {
                quoted = !quoted;
            }
        }
        if (!has_label(labels, len, want + i, j - i)) {
            return false;
        }
        i = j + 1;
    }
    return true;
}

double pd_metrics_text_value(const char *text, const char *series, double def)
{
    const char *brace = strchr(series, '{');
    size_t name_len = brace != NULL ? (size_t)(brace - series) : strlen(series);
    const char *want = brace != NULL ? brace + 1 : "";
    size_t want_len = brace != NULL ? strlen(want) : 0;
    if (want_len > 0 && want[want_len - 1] == '}') {
        want_len--;
    }
    double sum = 0;
    bool found = false;
    for (const char *line = text; line != NULL && *line != '\0';) {
        const char *eol = strchr(line, '\n');
        if (line[0] != '#' && strncmp(line, series, name_len) == 0 &&
            (line[name_len] == ' ' || line[name_len] == '{')) {
            const char *value = line + name_len;
            bool match = true;
            if (*value == '{') {
                const char *close = value + 1;
                bool quoted = false;
                for (; *close != '\0' && *close != '\n' && (quoted || *close != '}'); close++) {
                    if (*close == '\\' && close[1] != '\0') {
                        close++;
                    } else if (*close == '"') {
                        quoted = !quoted;
                    }
                }
                match = *close == '}' && has_labels(value + 1, (size_t)(close - value - 1), want, want_len);
                value = *close == '}' ? close + 1 : close;
            } else {
                match = want_len == 0;
            }
            if (match && *value == ' ') {
                sum += strtod(value + 1, NULL);
                found = true;
            }
        }
        line = eol != NULL ? eol + 1 : NULL;
    }
    return found ? sum : def;
}
