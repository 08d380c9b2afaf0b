/* bench/bench_stats.h — pd-bench's serving metrics, defined as vLLM's serving benchmark defines
 * them (names included):
 *   ttft  = first content chunk − send                  (per request)
 *   tpot  = (e2el − ttft) / (output_len − 1)            (only requests with output_len > 1)
 *   itl   = gaps between consecutive content chunks     (pooled over all requests)
 *   e2el  = last chunk − send
 *   request_throughput = completed / duration; output_throughput = Σ output tokens / duration;
 *   total_token_throughput = (Σ input + Σ output tokens) / duration;
 *   request_goodput = requests meeting every given SLO (ttft, tpot, e2el in ms) / duration.
 * Times in seconds in records, milliseconds in the summary. */
#ifndef PD_BENCH_BENCH_STATS_H
#define PD_BENCH_BENCH_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pd_bench_record {
    bool success;
    int32_t input_len;
    int32_t output_len;  /* tokens the server generated (usage.completion_tokens) */
    double send;         /* s, on one monotonic clock */
    double *chunk_times; /* arrival of each content chunk */
    int32_t num_chunks;
    double end; /* last byte */
    char error[128];
    int32_t cached_len; /* prompt tokens the server found cached (usage.prompt_tokens_details) */
} pd_bench_record_t;

typedef struct pd_bench_slo {
    double ttft_ms, tpot_ms, e2el_ms; /* 0 = not given */
} pd_bench_slo_t;

#define PD_BENCH_MAX_PCT 8

typedef struct pd_bench_dist {
    double mean, median, std;
    double pct[PD_BENCH_MAX_PCT]; /* at the requested percentiles */
    int64_t n;
} pd_bench_dist_t;

typedef struct pd_bench_summary {
    int64_t completed, failed;
    int64_t total_input_tokens, total_output_tokens;
    double duration; /* s: first send to last end */
    double request_throughput, output_throughput, total_token_throughput, request_goodput;
    int64_t good;
    int64_t max_concurrent_requests;
    pd_bench_dist_t ttft, tpot, itl, e2el; /* ms */
    double percentiles[PD_BENCH_MAX_PCT];
    int num_percentiles;
} pd_bench_summary_t;

/* Computes the summary of n records over duration_s (the benchmark's wall time; 0 = derive it
 * from the records). percentiles[num_pct] in (0, 100]. Linear interpolation between order
 * statistics, as numpy.percentile does. */
void pd_bench_summarize(const pd_bench_record_t *recs, size_t n, double duration_s, const pd_bench_slo_t *slo,
                        const double *percentiles, int num_pct, pd_bench_summary_t *out);

/* The percentile p (0..100) of sorted[n], numpy's default (linear) method; 0 when n == 0. */
double pd_bench_percentile(const double *sorted, size_t n, double p);

/* Parses "ttft:500 tpot:50 e2el:2000" (any subset). false (message in err) on bad input. */
bool pd_bench_parse_goodput(const char *s, pd_bench_slo_t *slo, char *err, size_t err_len);

/* Parses "50,90,99" into out (at most PD_BENCH_MAX_PCT); returns the count or -1. */
int pd_bench_parse_percentiles(const char *s, double *out);

#endif
