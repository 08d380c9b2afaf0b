/* bench/bench_stats.c — pd-bench's metric formulas (see bench_stats.h). */
#include "bench/bench_stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double pd_bench_percentile(const double *s, size_t n, double p)
{
    if (n == 0) {
        return 0;
    }
    double r = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(r);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    return s[lo] + (s[hi] - s[lo]) * (r - (double)lo);
}

/* Sorts v[n] in place and fills d (values already in ms). */
static void dist(double *v, size_t n, const double *pcts, int np, pd_bench_dist_t *d)
{
    memset(d, 0, sizeof(*d));
    d->n = (int64_t)n;
    if (n == 0) {
        return;
    }
    qsort(v, n, sizeof(double), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        sum += v[i];
    }
    d->mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++) {
        ss += (v[i] - d->mean) * (v[i] - d->mean);
    }
    d->std = sqrt(ss / (double)n); /* population std, as numpy.std */
    d->median = pd_bench_percentile(v, n, 50);
    for (int i = 0; i < np; i++) {
        d->pct[i] = pd_bench_percentile(v, n, pcts[i]);
    }
}

void pd_bench_summarize(const pd_bench_record_t *recs, size_t n, double duration_s, const pd_bench_slo_t *slo,
                        const double *pcts, int np, pd_bench_summary_t *o)
{
    memset(o, 0, sizeof(*o));
    o->num_percentiles = np < PD_BENCH_MAX_PCT ? np : PD_BENCH_MAX_PCT;
    memcpy(o->percentiles, pcts, (size_t)o->num_percentiles * sizeof(double));
    size_t n_itl = 0;
    double t_first = INFINITY, t_last = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        n_itl += recs[i].success && recs[i].num_chunks > 1 ? (size_t)recs[i].num_chunks - 1 : 0;
    }
    double *ttft = malloc((n + 1) * sizeof(double)), *tpot = malloc((n + 1) * sizeof(double));
    double *e2el = malloc((n + 1) * sizeof(double)), *itl = malloc((n_itl + 1) * sizeof(double));
    size_t nt = 0, np2 = 0, ne = 0, ni = 0;
    for (size_t i = 0; i < n; i++) {
        const pd_bench_record_t *r = &recs[i];
        if (r->send < t_first) {
            t_first = r->send;
        }
        if (r->end > t_last) {
            t_last = r->end;
        }
        if (!r->success) {
            o->failed++;
            continue;
        }
        o->completed++;
        o->total_input_tokens += r->input_len;
        o->total_output_tokens += r->output_len;
        double first = r->num_chunks > 0 ? r->chunk_times[0] : r->end;
        double t_ttft = (first - r->send) * 1e3;
        double t_e2el = (r->end - r->send) * 1e3;
        ttft[nt++] = t_ttft;
        e2el[ne++] = t_e2el;
        double t_tpot = 0;
        bool has_tpot = r->output_len > 1;
        if (has_tpot) {
            t_tpot = (t_e2el - t_ttft) / (double)(r->output_len - 1);
            tpot[np2++] = t_tpot;
        }
        for (int32_t c = 1; c < r->num_chunks; c++) {
            itl[ni++] = (r->chunk_times[c] - r->chunk_times[c - 1]) * 1e3;
        }
        bool good = true;
        if (slo != NULL) {
            good = (slo->ttft_ms <= 0 || t_ttft <= slo->ttft_ms) &&
                   (slo->e2el_ms <= 0 || t_e2el <= slo->e2el_ms) &&
                   (slo->tpot_ms <= 0 || !has_tpot || t_tpot <= slo->tpot_ms);
        }
        o->good += good;
    }
    /* max concurrency: sort start/end events; a start and an end at the same instant do not overlap */
    double *starts = malloc((n + 1) * sizeof(double)), *ends = malloc((n + 1) * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        starts[i] = recs[i].send;
        ends[i] = recs[i].end;
    }
    qsort(starts, n, sizeof(double), cmp_double);
    qsort(ends, n, sizeof(double), cmp_double);
    int64_t cur = 0;
    for (size_t a = 0, b = 0; a < n;) {
        if (b < n && ends[b] <= starts[a]) {
            cur--, b++;
        } else {
            cur++, a++;
            o->max_concurrent_requests = cur > o->max_concurrent_requests ? cur : o->max_concurrent_requests;
        }
    }
    free(starts), free(ends);
    o->duration = duration_s > 0 ? duration_s : (n > 0 ? t_last - t_first : 0);
    if (o->duration > 0) {
        o->request_throughput = (double)o->completed / o->duration;
        o->output_throughput = (double)o->total_output_tokens / o->duration;
        o->total_token_throughput = (double)(o->total_input_tokens + o->total_output_tokens) / o->duration;
        o->request_goodput = (double)o->good / o->duration;
    }
    dist(ttft, nt, pcts, o->num_percentiles, &o->ttft);
    dist(tpot, np2, pcts, o->num_percentiles, &o->tpot);
    dist(itl, ni, pcts, o->num_percentiles, &o->itl);
    dist(e2el, ne, pcts, o->num_percentiles, &o->e2el);
    free(ttft), free(tpot), free(e2el), free(itl);
}

bool pd_bench_parse_goodput(const char *s, pd_bench_slo_t *slo, char *err, size_t err_len)
{
    memset(slo, 0, sizeof(*slo));
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    char *save = NULL;
    for (char *t = strtok_r(buf, " ,", &save); t != NULL; t = strtok_r(NULL, " ,", &save)) {
        char name[16];
        double v;
        if (sscanf(t, "%15[a-z]:%lf", name, &v) != 2 || v <= 0) {
            snprintf(err, err_len, "--goodput: '%s' is not NAME:MS with a positive MS", t);
            return false;
        }
        if (strcmp(name, "ttft") == 0) {
            slo->ttft_ms = v;
        } else if (strcmp(name, "tpot") == 0) {
            slo->tpot_ms = v;
        } else if (strcmp(name, "e2el") == 0) {
            slo->e2el_ms = v;
        } else {
            snprintf(err, err_len, "--goodput: unknown metric '%s' (ttft, tpot, e2el)", name);
            return false;
        }
    }
    return true;
}

int pd_bench_parse_percentiles(const char *s, double *out)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        char *end;
        double v = strtod(t, &end);
        if (*end != '\0' || !(v > 0 && v <= 100) || n == PD_BENCH_MAX_PCT) {
            return -1;
        }
        out[n++] = v;
    }
    return n;
}
