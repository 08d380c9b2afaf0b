/* bench/pd-bench.c — a load generator for any OpenAI-compatible /v1/completions endpoint
 * (pd-proxy, pd-serve, vLLM ...): streaming requests over libevent's HTTP client, many
 * connections from one thread, timestamps taken at chunk arrival; vLLM's serving-benchmark
 * metrics, summary table and result JSON (bench_stats.h), datasets and arrivals (bench_load.h).
 *   pd-bench --base-url http://127.0.0.1:8000 --dataset-name random --num-prompts 200 \
 *            --random-input-len 512 --random-output-len 64 --request-rate 4 --save-result
 *   pd-bench plot OUT_DIR RESULT.json...      (PNG charts with gnuplot) */
#define _GNU_SOURCE
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_http.h"
#include "bench/bench_load.h"
#include "bench/bench_stats.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"
#include "model/tokenizer.h"

typedef struct cfg {
    const char *base_url;
    const char *endpoint;
    const char *model;
    const char *dataset_name;
    const char *dataset_path;
    int num_prompts;
    int random_input_len, random_output_len, random_prefix_len;
    double random_range_ratio;
    int pr_prefix_len, pr_suffix_len, pr_num_prefixes, pr_output_len;
    double mixed_fresh_share;
    int repeat_phrase_len;
    int sharegpt_output_len;
    int vocab_size;
    double request_rate, burstiness;
    int max_concurrency;
    int64_t seed;
    int num_warmups;
    bool ignore_eos;
    double temperature;
    const char *goodput;
    const char *metric_percentiles;
    bool save_result;
    const char *result_filename;
    const char *label;
    const char *api_key; /* --api-key, else $OPENAI_API_KEY */
    bool no_progress;
    double wait_ready_s;
    const char *kv_metrics_url;
    const char *tokenizer; /* --tokenizer DIR: count ShareGPT tokens locally */
    int mt_turns, mt_system_len, mt_user_len;
    double mt_think_time;
} cfg_t;

typedef struct run run_t;

typedef struct req {
    run_t *run;
    int idx;
    pd_bench_record_t *rec;
    struct evhttp_connection *conn;
    struct evbuffer *sse; /* unparsed stream bytes */
    int32_t cap_chunks;
    int32_t server_prompt_tokens;
    bool got_done;
    int status;
    int32_t *sent_ids, num_sent; /* multi-turn: the prompt as sent, and the answer's ids */
    int32_t *out_ids, num_out, cap_out;
    char *sent_text, *out_text; /* multi-turn over text (ShareGPT): the prompt sent, the answer's text */
    size_t out_len, out_cap;
} req_t;

struct run {
    cfg_t *cfg;
    struct event_base *base;
    char host[128];
    int port;
    pd_bench_dataset_t data;
    pd_bench_record_t *recs;
    size_t n, next, done, in_flight;
    double *arrivals; /* when each request may be sent, offsets from t0 (s); a later turn of a
                       * conversation: INFINITY until the turn before it ends */
    bool *sent;
    bool multi;       /* some prompts follow others (multi-turn) */
    int32_t **hist;   /* [n] multi-turn: the history a following prompt continues, once known */
    char **hist_text; /* [n] the same for text prompts (ShareGPT conversations) */
    int32_t *num_hist;
    double t0;
    struct event *arrival_ev, *progress_ev;
    bool warmup;
    int64_t server_prompt_tokens; /* Σ usage.prompt_tokens, a cross-check of input lengths */
};

static void start_next(run_t *r);

/* ------------------------------------------------------------------ one request */

static void handle_event(req_t *q, const char *data, size_t len)
{
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0) {
        q->got_done = true;
        return;
    }
    json_t *j = json_loadb(data, len, JSON_ALLOW_NUL, NULL); /* a token may decode to U+0000 */
    if (j == NULL) {
        return;
    }
    json_t *choices = json_object_get(j, "choices");
    if (json_is_array(choices) && json_array_size(choices) > 0) {
        pd_bench_record_t *rec = q->rec;
        if (rec->num_chunks == q->cap_chunks) {
            q->cap_chunks = q->cap_chunks ? 2 * q->cap_chunks : 64;
            rec->chunk_times = realloc(rec->chunk_times, (size_t)q->cap_chunks * sizeof(double));
        }
        rec->chunk_times[rec->num_chunks++] = pd_time_now_s();
    }
    const char *piece = json_string_value(json_object_get(json_array_get(choices, 0), "text"));
    if (q->run->multi && q->sent_text != NULL && piece != NULL) { /* the answer continues the history */
        size_t n = strlen(piece);
        if (q->out_len + n + 1 > q->out_cap) {
            q->out_cap = (q->out_len + n + 1) * 2;
            q->out_text = realloc(q->out_text, q->out_cap);
        }
        memcpy(q->out_text + q->out_len, piece, n + 1);
        q->out_len += n;
    }
    json_t *ids = json_object_get(json_array_get(choices, 0), "token_ids");
    for (size_t k = 0; q->run->multi && k < json_array_size(ids); k++) {
        if (q->num_out == q->cap_out) {
            q->cap_out = q->cap_out ? 2 * q->cap_out : 256;
            q->out_ids = realloc(q->out_ids, (size_t)q->cap_out * sizeof(int32_t));
        }
        q->out_ids[q->num_out++] = (int32_t)json_integer_value(json_array_get(ids, k));
    }
    json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage)) {
        q->rec->cached_len = (int32_t)json_integer_value(
            json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens"));
        q->rec->output_len = (int32_t)json_integer_value(json_object_get(usage, "completion_tokens"));
        q->server_prompt_tokens = (int32_t)json_integer_value(json_object_get(usage, "prompt_tokens"));
    }
    json_t *err = json_object_get(j, "error");
    if (json_is_object(err)) {
        snprintf(q->rec->error, sizeof(q->rec->error), "%s",
                 json_string_value(json_object_get(err, "message")));
    }
    json_decref(j);
}

static void on_chunk(struct evhttp_request *hr, void *arg)
{
    req_t *q = arg;
    evbuffer_add_buffer(q->sse, evhttp_request_get_input_buffer(hr));
    for (;;) {
        struct evbuffer_ptr p = evbuffer_search(q->sse, "\n\n", 2, NULL);
        if (p.pos < 0) {
            return;
        }
        size_t n = (size_t)p.pos;
        char *ev = malloc(n + 1);
        evbuffer_remove(q->sse, ev, n);
        evbuffer_drain(q->sse, 2);
        ev[n] = '\0';
        for (char *line = ev, *nl; line != NULL; line = nl) {
            nl = strchr(line, '\n');
            if (nl != NULL) {
                *nl++ = '\0';
            }
            if (strncmp(line, "data:", 5) == 0) {
                char *d = line + 5;
                while (*d == ' ') {
                    d++;
                }
                handle_event(q, d, strlen(d));
            }
        }
        free(ev);
    }
}

static void free_conn(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    evhttp_connection_free(arg);
}

/* Multi-turn: when q's turn ended, the conversation's next turn may be sent --multi-turn-think-time
 * later, continuing the prompt q sent and the answer it got; after a failed turn the conversation's
 * remaining turns fail unsent. */
static void next_turn(run_t *r, req_t *q)
{
    size_t i = (size_t)q->idx + 1;
    if (!r->multi || i >= r->n || !r->data.prompts[i].follows) {
        return;
    }
    double now = pd_time_now_s();
    if (q->rec->success && q->sent_text != NULL) {
        size_t a = strlen(q->sent_text);
        r->hist_text[i] = malloc(a + q->out_len + 1);
        memcpy(r->hist_text[i], q->sent_text, a);
        memcpy(r->hist_text[i] + a, q->out_text != NULL ? q->out_text : "", q->out_len + 1);
        r->arrivals[i] = now - r->t0 + r->cfg->mt_think_time;
        return;
    }
    if (q->rec->success) {
        r->num_hist[i] = q->num_sent + q->num_out;
        r->hist[i] = malloc((size_t)(r->num_hist[i] > 0 ? r->num_hist[i] : 1) * sizeof(int32_t));
        memcpy(r->hist[i], q->sent_ids, (size_t)q->num_sent * sizeof(int32_t));
        if (q->num_out > 0) {
            memcpy(r->hist[i] + q->num_sent, q->out_ids, (size_t)q->num_out * sizeof(int32_t));
        }
        r->arrivals[i] = now - r->t0 + r->cfg->mt_think_time;
        return;
    }
    for (; i < r->n && r->data.prompts[i].follows; i++) {
        r->sent[i] = true;
        r->recs[i].send = r->recs[i].end = now;
        snprintf(r->recs[i].error, sizeof(r->recs[i].error), "an earlier turn of its conversation failed");
        r->done++;
    }
}

static void on_done(struct evhttp_request *hr, void *arg)
{
    req_t *q = arg;
    run_t *r = q->run;
    pd_bench_record_t *rec = q->rec;
    rec->end = pd_time_now_s();
    q->status = hr != NULL ? evhttp_request_get_response_code(hr) : 0;
    if (hr != NULL && q->status == 200) {
        on_chunk(hr, q);
    } else if (hr != NULL && rec->error[0] == '\0') {
        struct evbuffer *in = evhttp_request_get_input_buffer(hr);
        size_t len = evbuffer_get_length(in);
        json_t *j = json_loadb((const char *)evbuffer_pullup(in, (ev_ssize_t)len), len, JSON_ALLOW_NUL, NULL);
        const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        snprintf(rec->error, sizeof(rec->error), "HTTP %d: %s", q->status, m != NULL ? m : "(no message)");
        json_decref(j);
    }
    rec->success = q->status == 200 && q->got_done && rec->error[0] == '\0';
    if (q->status == 0) {
        snprintf(rec->error, sizeof(rec->error), "connection failed or timed out");
    } else if (q->status == 200 && !q->got_done && rec->error[0] == '\0') {
        snprintf(rec->error, sizeof(rec->error), "the stream ended without [DONE]");
    }
    if (rec->success) {
        r->server_prompt_tokens += q->server_prompt_tokens;
        if (q->sent_text != NULL && q->server_prompt_tokens > 0) {
            rec->input_len = q->server_prompt_tokens; /* a text history: the server's count */
        }
    }
    next_turn(r, q);
    struct timeval tv = {0, 0};
    event_base_once(r->base, -1, EV_TIMEOUT, free_conn, q->conn, &tv);
    evbuffer_free(q->sse);
    free(q->sent_ids);
    free(q->out_ids);
    free(q->sent_text);
    free(q->out_text);
    free(q);
    r->done++;
    r->in_flight--;
    start_next(r);
    if (r->done == r->n) {
        event_base_loopexit(r->base, NULL);
    }
}

static void send_request(run_t *r, size_t i)
{
    const cfg_t *c = r->cfg;
    const pd_bench_prompt_t *p = &r->data.prompts[i];
    req_t *q = calloc(1, sizeof(*q));
    q->run = r;
    q->idx = (int)i;
    q->rec = &r->recs[i];
    q->rec->input_len = p->input_len;
    q->sse = evbuffer_new();
    json_t *prompt;
    if (r->multi && p->text != NULL) { /* text: the history, a newline, this turn's message */
        const char *h = p->follows && r->hist_text[i] != NULL ? r->hist_text[i] : "";
        size_t hl = strlen(h), tl = strlen(p->text);
        q->sent_text = malloc(hl + tl + 2);
        memcpy(q->sent_text, h, hl);
        size_t o = hl;
        if (hl > 0) {
            q->sent_text[o++] = '\n';
        }
        memcpy(q->sent_text + o, p->text, tl + 1);
        free(r->hist_text[i]);
        r->hist_text[i] = NULL;
        prompt = json_string(q->sent_text);
    } else if (
        r->multi) { /* the history first (a later turn), then this turn's ids; kept for the next turn */
        int32_t h = p->follows ? r->num_hist[i] : 0;
        q->num_sent = h + p->num_ids;
        q->sent_ids = malloc((size_t)q->num_sent * sizeof(int32_t));
        if (h > 0) {
            memcpy(q->sent_ids, r->hist[i], (size_t)h * sizeof(int32_t));
        }
        memcpy(q->sent_ids + h, p->ids, (size_t)p->num_ids * sizeof(int32_t));
        free(r->hist[i]);
        r->hist[i] = NULL;
        q->rec->input_len = q->num_sent;
        prompt = json_array();
        for (int32_t t = 0; t < q->num_sent; t++) {
            json_array_append_new(prompt, json_integer(q->sent_ids[t]));
        }
    } else if (p->ids != NULL) {
        prompt = json_array();
        for (int32_t t = 0; t < p->num_ids; t++) {
            json_array_append_new(prompt, json_integer(p->ids[t]));
        }
    } else {
        prompt = json_string(p->text);
    }
    json_t *body = json_pack("{s:s, s:o, s:i, s:f, s:b, s:b, s:{s:b}}", "model", c->model, "prompt", prompt,
                             "max_tokens", p->output_len, "temperature", c->temperature, "stream", 1,
                             "ignore_eos", c->ignore_eos, "stream_options", "include_usage", 1);
    if (r->multi) { /* vLLM's return_token_ids: the answer's ids continue the conversation exactly */
        json_object_set_new(body, "return_token_ids", json_true());
    }
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    q->conn = evhttp_connection_base_new(r->base, NULL, r->host, (ev_uint16_t)r->port);
    evhttp_connection_set_timeout(q->conn, 3600);
    struct evhttp_request *hr = evhttp_request_new(on_done, q);
    evhttp_request_set_chunked_cb(hr, on_chunk);
    struct evkeyvalq *h = evhttp_request_get_output_headers(hr);
    char hostport[160];
    snprintf(hostport, sizeof(hostport), "%s:%d", r->host, r->port);
    evhttp_add_header(h, "Host", hostport);
    evhttp_add_header(h, "Content-Type", "application/json");
    pd_bench_http_add_auth(h);
    evbuffer_add(evhttp_request_get_output_buffer(hr), text, strlen(text));
    free(text);
    r->in_flight++;
    q->rec->send = pd_time_now_s();
    if (evhttp_make_request(q->conn, hr, EVHTTP_REQ_POST, c->endpoint) != 0) {
        q->rec->end = q->rec->send;
        snprintf(q->rec->error, sizeof(q->rec->error), "cannot send the request");
        r->in_flight--;
        r->done++;
        next_turn(r, q);
        evbuffer_free(q->sse);
        evhttp_connection_free(q->conn);
        free(q->sent_ids);
        free(q->sent_text);
        free(q);
    }
}

/* Sends every request whose arrival time has come, within --max-concurrency; re-arms the timer. */
static void start_next(run_t *r)
{
    double now = pd_time_now_s() - r->t0;
    size_t cap = r->cfg->max_concurrency > 0 ? (size_t)r->cfg->max_concurrency : (size_t)-1;
    /* in index order, the first unsent request whose time has come; without multi-turn the times
     * grow with the index, so the scan stops at the first that has not come */
    double first = INFINITY;
    for (size_t i = r->next; i < r->n && r->in_flight < cap; i++) {
        if (r->sent[i]) {
            continue;
        }
        if (r->arrivals[i] > now + 1e-6) {
            first = r->arrivals[i] < first ? r->arrivals[i] : first;
            if (!r->multi) {
                break;
            }
            continue;
        }
        r->sent[i] = true;
        send_request(r, i);
    }
    while (r->next < r->n && r->sent[r->next]) {
        r->next++;
    }
    if (isfinite(first) && r->in_flight < cap) {
        double wait = first - now > 0 ? first - now : 0;
        struct timeval tv = {(time_t)wait, (suseconds_t)((wait - floor(wait)) * 1e6)};
        evtimer_add(r->arrival_ev, &tv);
    }
    if (r->done == r->n) {
        event_base_loopexit(r->base, NULL);
    }
}

static void on_arrival(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    start_next(arg);
}

static void on_progress(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    run_t *r = arg;
    double el = pd_time_now_s() - r->t0;
    if (!isatty(2)) {
        /* a log, not a terminal: one line every 5 s and at the end */
        static double last;
        if (r->done < r->n && el - last < 5) {
            return;
        }
        last = r->done < r->n ? el : 0;
        fprintf(stderr, "%s%zu/%zu requests, %.1f s, %.2f req/s, %zu in flight\n", r->warmup ? "warmup " : "",
                r->done, r->n, el, el > 0 ? (double)r->done / el : 0.0, r->in_flight);
        return;
    }
    int w = 30, filled = r->n ? (int)(w * r->done / r->n) : w;
    char bar[64];
    for (int i = 0; i < w; i++) {
        bar[i] = i < filled ? '#' : '.';
    }
    bar[w] = '\0';
    fprintf(stderr, "\r%s[%s] %zu/%zu requests, %.1f s, %.2f req/s, %zu in flight   ",
            r->warmup ? "warmup " : "", bar, r->done, r->n, el, el > 0 ? (double)r->done / el : 0.0,
            r->in_flight);
    fflush(stderr);
}

static void print_dist(const char *title, const char *name, const pd_bench_dist_t *d,
                       const pd_bench_summary_t *s);
static void put_dist(json_t *o, const char *name, const pd_bench_dist_t *d, const pd_bench_summary_t *s);

/* Frees what run_load allocated but the records. */
static void run_free_bufs(run_t *r)
{
    for (size_t i = 0; i < r->n; i++) {
        free(r->hist[i]);
        free(r->hist_text[i]);
    }
    free(r->recs), free(r->arrivals), free(r->sent), free(r->hist), free(r->num_hist), free(r->hist_text);
}

/* Multi-turn: what the later turns of a conversation got from the prefix cache, and their TTFT
 * (the figure an offload tier or a peer's prefix moves); also into the result JSON when o. */
static void print_turns(const run_t *r, const double *pcts, int npct, json_t *o)
{
    pd_bench_record_t *later = calloc(r->n + 1, sizeof(*later));
    size_t m = 0;
    int64_t in_later = 0, cached_later = 0, in_all = 0, cached_all = 0;
    for (size_t i = 0; i < r->n; i++) {
        const pd_bench_record_t *rec = &r->recs[i];
        if (!rec->success) {
            continue;
        }
        in_all += rec->input_len;
        cached_all += rec->cached_len;
        if (r->data.prompts[i].follows) {
            later[m++] = *rec;
            in_later += rec->input_len;
            cached_later += rec->cached_len;
        }
    }
    pd_bench_summary_t s;
    pd_bench_summarize(later, m, 0, NULL, pcts, npct, &s);
    if (o == NULL) {
        print_dist("TTFT of turns >= 2", "TTFT", &s.ttft, &s);
        printf("%-40s %-10lld\n", "Turns >= 2 completed:", (long long)m);
        printf("%-40s %-10lld\n", "Input tokens, turns >= 2:", (long long)in_later);
        printf("%-40s %-10lld\n", "Cached input tokens, turns >= 2:", (long long)cached_later);
        printf("%-40s %-10lld\n", "Computed input tokens (all turns):", (long long)(in_all - cached_all));
        printf("%-40s %-10.3f\n",
               "Prefix hit rate (all turns):", in_all > 0 ? (double)cached_all / (double)in_all : 0.0);
        printf("%s\n", "==================================================");
    } else {
        json_t *t = json_object();
        put_dist(t, "ttft", &s.ttft, &s);
        json_object_set_new(t, "completed", json_integer((json_int_t)m));
        json_object_set_new(t, "input_tokens", json_integer(in_later));
        json_object_set_new(t, "cached_input_tokens", json_integer(cached_later));
        json_object_set_new(o, "later_turns", t);
        json_object_set_new(o, "computed_input_tokens", json_integer(in_all - cached_all));
        json_object_set_new(o, "cached_input_tokens", json_integer(cached_all));
    }
    free(later);
}

/* Runs the requests of r->data; fills r->recs. */
static double run_load(run_t *r, bool progress)
{
    const cfg_t *c = r->cfg;
    r->n = r->data.n;
    r->recs = calloc(r->n + 1, sizeof(pd_bench_record_t));
    r->arrivals = calloc(r->n + 1, sizeof(double));
    r->sent = calloc(r->n + 1, sizeof(bool));
    r->hist = calloc(r->n + 1, sizeof(int32_t *));
    r->num_hist = calloc(r->n + 1, sizeof(int32_t));
    r->hist_text = calloc(r->n + 1, sizeof(char *));
    pd_rng_t rng;
    pd_rng_seed(&rng, (uint64_t)c->seed ^ 0xA5A5u);
    double t = 0;
    for (size_t i = 0; i < r->n; i++) { /* multi-turn: the rate is the conversations' */
        r->arrivals[i] = r->data.prompts[i].follows ? INFINITY : t;
        t += r->data.prompts[i].follows ? 0 : pd_bench_next_gap(&rng, c->request_rate, c->burstiness);
    }
    r->next = r->done = r->in_flight = 0;
    r->arrival_ev = evtimer_new(r->base, on_arrival, r);
    r->progress_ev = event_new(r->base, -1, EV_PERSIST, on_progress, r);
    struct timeval half = {0, 500000};
    if (progress) {
        event_add(r->progress_ev, &half);
    }
    r->t0 = pd_time_now_s();
    start_next(r);
    if (r->done < r->n) {
        event_base_dispatch(r->base);
    }
    double dur = pd_time_now_s() - r->t0;
    if (progress) {
        on_progress(-1, 0, r);
        if (isatty(2)) {
            fprintf(stderr, "\n");
        }
    }
    event_free(r->arrival_ev);
    event_free(r->progress_ev);
    return dur;
}

/* ------------------------------------------------------------------ output */

static void print_dist(const char *title, const char *name, const pd_bench_dist_t *d,
                       const pd_bench_summary_t *s)
{
    int pad = (50 - (int)strlen(title)) / 2;
    printf("%.*s%s%.*s\n", pad, "--------------------------------------------------", title,
           50 - pad - (int)strlen(title), "--------------------------------------------------");
    char k[64];
    snprintf(k, sizeof(k), "Mean %s (ms):", name);
    printf("%-40s %-10.2f\n", k, d->mean);
    snprintf(k, sizeof(k), "Median %s (ms):", name);
    printf("%-40s %-10.2f\n", k, d->median);
    for (int i = 0; i < s->num_percentiles; i++) {
        snprintf(k, sizeof(k), "P%g %s (ms):", s->percentiles[i], name);
        printf("%-40s %-10.2f\n", k, d->pct[i]);
    }
}

static void print_summary(const cfg_t *c, const pd_bench_summary_t *s, bool goodput)
{
    printf("%s\n", "============ Serving Benchmark Result ============");
    printf("%-40s %-10lld\n", "Successful requests:", (long long)s->completed);
    printf("%-40s %-10lld\n", "Failed requests:", (long long)s->failed);
    if (c->max_concurrency > 0) {
        printf("%-40s %-10d\n", "Maximum request concurrency:", c->max_concurrency);
    }
    printf("%-40s %-10lld\n", "Peak concurrent requests:", (long long)s->max_concurrent_requests);
    printf("%-40s %-10.2f\n", "Benchmark duration (s):", s->duration);
    printf("%-40s %-10lld\n", "Total input tokens:", (long long)s->total_input_tokens);
    printf("%-40s %-10lld\n", "Total generated tokens:", (long long)s->total_output_tokens);
    printf("%-40s %-10.2f\n", "Request throughput (req/s):", s->request_throughput);
    if (goodput) {
        printf("%-40s %-10.2f\n", "Request goodput (req/s):", s->request_goodput);
    }
    printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", s->output_throughput);
    printf("%-40s %-10.2f\n", "Total Token throughput (tok/s):", s->total_token_throughput);
    print_dist("Time to First Token", "TTFT", &s->ttft, s);
    print_dist("Time per Output Token (excl. 1st token)", "TPOT", &s->tpot, s);
    print_dist("Inter-token Latency", "ITL", &s->itl, s);
    print_dist("End-to-end Latency", "E2EL", &s->e2el, s);
    printf("%s\n", "==================================================");
}

static void put_dist(json_t *o, const char *name, const pd_bench_dist_t *d, const pd_bench_summary_t *s)
{
    char k[64];
    snprintf(k, sizeof(k), "mean_%s_ms", name);
    json_object_set_new(o, k, json_real(d->mean));
    snprintf(k, sizeof(k), "median_%s_ms", name);
    json_object_set_new(o, k, json_real(d->median));
    snprintf(k, sizeof(k), "std_%s_ms", name);
    json_object_set_new(o, k, json_real(d->std));
    for (int i = 0; i < s->num_percentiles; i++) {
        snprintf(k, sizeof(k), "p%g_%s_ms", s->percentiles[i], name);
        json_object_set_new(o, k, json_real(d->pct[i]));
    }
}

static int save_result(const cfg_t *c, const run_t *r, const pd_bench_summary_t *s)
{
    json_t *o = json_object();
    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof(date), "%Y%m%d-%H%M%S", gmtime(&now));
    json_object_set_new(o, "date", json_string(date));
    json_object_set_new(o, "backend", json_string("openai"));
    json_object_set_new(o, "label", c->label != NULL ? json_string(c->label) : json_null());
    json_object_set_new(o, "model_id", json_string(c->model));
    json_object_set_new(o, "num_prompts", json_integer((json_int_t)r->n));
    json_object_set_new(o, "request_rate",
                        isinf(c->request_rate) ? json_string("inf") : json_real(c->request_rate));
    json_object_set_new(o, "burstiness", json_real(c->burstiness));
    json_object_set_new(o, "max_concurrency",
                        c->max_concurrency > 0 ? json_integer(c->max_concurrency) : json_null());
    json_object_set_new(o, "duration", json_real(s->duration));
    json_object_set_new(o, "completed", json_integer(s->completed));
    json_object_set_new(o, "failed", json_integer(s->failed));
    json_object_set_new(o, "total_input_tokens", json_integer(s->total_input_tokens));
    json_object_set_new(o, "server_input_tokens", json_integer(r->server_prompt_tokens));
    json_object_set_new(o, "total_output_tokens", json_integer(s->total_output_tokens));
    json_object_set_new(o, "request_throughput", json_real(s->request_throughput));
    json_object_set_new(o, "request_goodput",
                        c->goodput != NULL ? json_real(s->request_goodput) : json_null());
    json_object_set_new(o, "output_throughput", json_real(s->output_throughput));
    json_object_set_new(o, "total_token_throughput", json_real(s->total_token_throughput));
    json_object_set_new(o, "max_concurrent_requests", json_integer(s->max_concurrent_requests));
    put_dist(o, "ttft", &s->ttft, s);
    put_dist(o, "tpot", &s->tpot, s);
    put_dist(o, "itl", &s->itl, s);
    put_dist(o, "e2el", &s->e2el, s);
    json_t *in = json_array(), *out = json_array(), *ttfts = json_array(), *itls = json_array(),
           *e2els = json_array(), *errs = json_array();
    for (size_t i = 0; i < r->n; i++) {
        const pd_bench_record_t *rec = &r->recs[i];
        json_array_append_new(in, json_integer(rec->input_len));
        json_array_append_new(out, json_integer(rec->success ? rec->output_len : 0));
        double first = rec->num_chunks > 0 ? rec->chunk_times[0] : rec->end;
        json_array_append_new(ttfts, json_real(rec->success ? first - rec->send : 0));
        json_array_append_new(e2els, json_real(rec->success ? rec->end - rec->send : 0));
        json_t *il = json_array();
        for (int32_t k = 1; rec->success && k < rec->num_chunks; k++) {
            json_array_append_new(il, json_real(rec->chunk_times[k] - rec->chunk_times[k - 1]));
        }
        json_array_append_new(itls, il);
        json_array_append_new(errs, json_string(rec->error));
    }
    json_object_set_new(o, "input_lens", in);
    json_object_set_new(o, "output_lens", out);
    json_object_set_new(o, "ttfts", ttfts);
    json_object_set_new(o, "itls", itls);
    json_object_set_new(o, "e2els", e2els);
    json_object_set_new(o, "errors", errs);
    if (r->multi) {
        print_turns(r, s->percentiles, s->num_percentiles, o);
    }
    char name[512];
    if (c->result_filename != NULL) {
        snprintf(name, sizeof(name), "%s", c->result_filename);
    } else {
        snprintf(name, sizeof(name), "pd-bench-%s.json", date);
    }
    int rc = json_dump_file(o, name, JSON_INDENT(1));
    json_decref(o);
    if (rc != 0) {
        pd_log_error("cannot write %s", name);
        return 1;
    }
    fprintf(stderr, "pd-bench: result saved to %s\n", name);
    return 0;
}

/* ------------------------------------------------------------------ plot */

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* Eight colours told apart in colour-blind vision and print (Okabe–Ito, yellow swapped for grey)
 * and eight marker shapes: series s gets both; a ninth series would repeat the first's, so the
 * plot warns. */
static const char *const PLOT_COLOURS[8] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                            "#E69F00", "#56B4E9", "#000000", "#999999"};
static const int PLOT_MARKERS[8] = {7, 5, 9, 11, 13, 4, 6, 1}; /* ● ■ ▲ ▼ ◆ □ ○ + (pngcairo) */

/* pd-bench plot OUT_DIR RESULT.json...: latency percentiles vs request rate, one series per
 * result label (e.g. "colocated long", "pull long"; the file name without one), p50 solid and
 * p99 dashed in the label's colour and marker; and the TTFT / E2EL CDF of each file in its label's
 * colour (E2EL dashed). Axes are padded so that end points are not drawn on the frame. Data
 * files and the gnuplot script stay in OUT_DIR. */
static int plot(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: pd-bench plot OUT_DIR RESULT.json...\n");
        return 2;
    }
    const char *dir = argv[0];
    mkdir(dir, 0755);
    char path[4096];
    snprintf(path, sizeof(path), "%s/latency_vs_rate.dat", dir);
    FILE *dat = fopen(path, "w");
    if (dat == NULL) {
        pd_log_error("cannot write %s", path);
        return 1;
    }
    fprintf(dat, "# label rate p50_ttft p99_ttft p50_tpot p99_tpot p50_itl p99_itl goodput\n");
    enum { MAX_SERIES = 16 };
    char series[MAX_SERIES][128];
    char *titles[256];
    int file_series[256] = {0}; /* each file's series (its colour in the CDF) */
    int nseries = 0, nfiles = 0;
    FILE *sdat[MAX_SERIES] = {NULL};
    bool bad = false;
    for (int i = 1; i < argc; i++) {
        json_error_t e;
        json_t *j = json_load_file(argv[i], 0, &e);
        if (j == NULL) {
            pd_log_error("%s:%d: %s", argv[i], e.line, e.text);
            bad = true;
            break;
        }
        json_t *rr = json_object_get(j, "request_rate");
        double rate = json_is_number(rr) ? json_number_value(rr) : 0;
        const char *label = json_string_value(json_object_get(j, "label"));
        label = label != NULL && label[0] != '\0' ? label : argv[i];
        int s = 0;
        while (s < nseries && strcmp(series[s], label) != 0) {
            s++;
        }
        if (s == nseries && nseries < MAX_SERIES) {
            snprintf(series[nseries], sizeof(series[0]), "%s", label);
            snprintf(path, sizeof(path), "%s/rate_%d.dat", dir, nseries);
            sdat[nseries++] = fopen(path, "w");
        }
        char row[512];
        snprintf(row, sizeof(row), "\"%s\" %g %g %g %g %g %g %g %g\n", label, rate,
                 json_number_value(json_object_get(j, "median_ttft_ms")),
                 json_number_value(json_object_get(j, "p99_ttft_ms")),
                 json_number_value(json_object_get(j, "median_tpot_ms")),
                 json_number_value(json_object_get(j, "p99_tpot_ms")),
                 json_number_value(json_object_get(j, "median_itl_ms")),
                 json_number_value(json_object_get(j, "p99_itl_ms")),
                 json_number_value(json_object_get(j, "request_goodput")));
        fputs(row, dat);
        if (s < nseries && sdat[s] != NULL) {
            fputs(row, sdat[s]);
        }
        if (nfiles < 256) {
            file_series[nfiles] = s;
            char t[200];
            snprintf(t, sizeof(t), "%s @ %g req/s", label, rate);
            titles[nfiles] = strdup(t);
        }
        /* CDF of this file's TTFT and E2EL */
        snprintf(path, sizeof(path), "%s/cdf_%d.dat", dir, nfiles);
        FILE *cdf = fopen(path, "w");
        json_t *tt = json_object_get(j, "ttfts"), *ee = json_object_get(j, "e2els");
        size_t n = json_array_size(tt);
        double *a = calloc(n + 1, sizeof(double)), *b = calloc(n + 1, sizeof(double));
        size_t m = 0;
        for (size_t k = 0; k < n; k++) {
            if (json_number_value(json_array_get(ee, k)) > 0) {
                a[m] = json_number_value(json_array_get(tt, k)) * 1e3;
                b[m++] = json_number_value(json_array_get(ee, k)) * 1e3;
            }
        }
        qsort(a, m, sizeof(double), cmp_double);
        qsort(b, m, sizeof(double), cmp_double);
        for (size_t k = 0; cdf != NULL && k < m; k++) {
            fprintf(cdf, "%g %g %g\n", a[k], b[k], (double)(k + 1) / (double)m);
        }
        if (cdf != NULL) {
            fclose(cdf);
        }
        free(a), free(b);
        json_decref(j);
        nfiles++;
    }
    fclose(dat);
    for (int s = 0; s < nseries; s++) {
        if (sdat[s] != NULL) {
            fclose(sdat[s]);
        }
    }
    snprintf(path, sizeof(path), "%s/plot.gp", dir);
    FILE *gp = bad ? NULL : fopen(path, "w");
    if (gp == NULL) {
        for (int f = 0; f < nfiles && f < 256; f++) {
            free(titles[f]);
        }
        return 1;
    }
    if (nseries > 8) {
        pd_log_warn("pd-bench plot: %d series; colours repeat after 8 (plot fewer labels at once)", nseries);
    }
    fprintf(gp, "set terminal pngcairo size 1200,900 noenhanced\nset grid\nset key outside right\n");
    /* room around the data: a point at the largest rate or latency stays inside the frame */
    fprintf(gp, "set offsets graph 0.04, graph 0.04, graph 0.08, graph 0.04\nset yrange [0:*]\n");
    fprintf(gp,
            "set output '%s/latency_vs_rate.png'\nset multiplot layout 3,1 title 'latency vs request rate'\n",
            dir);
    fprintf(gp, "set xlabel 'request rate (req/s)'\n");
    const char *names[3] = {"TTFT", "TPOT", "ITL"};
    for (int k = 0; k < 3; k++) {
        fprintf(gp, "set ylabel '%s (ms)'\nplot ", names[k]);
        for (int s = 0; s < nseries; s++) {
            const char *c = PLOT_COLOURS[s % 8];
            int pt = PLOT_MARKERS[s % 8];
            fprintf(gp,
                    "%s'%s/rate_%d.dat' using 2:%d with linespoints lc rgb '%s' pt %d ps 1.3 lw 2 dt 1 "
                    "title '%s p50', '' using 2:%d with linespoints lc rgb '%s' pt %d ps 1.3 lw 2 dt 2 "
                    "title '%s p99'",
                    s ? ", " : "", dir, s, 3 + 2 * k, c, pt, series[s], 4 + 2 * k, c, pt, series[s]);
        }
        fprintf(gp, "\n");
    }
    fprintf(gp, "unset multiplot\n");
    fprintf(gp,
            "set output '%s/latency_cdf.png'\nset xlabel 'latency (ms)'\nset ylabel 'fraction of requests'\n",
            dir);
    fprintf(gp, "set yrange [0:1.05]\nset offsets graph 0.02, graph 0.02, 0, 0\nplot ");
    for (int f = 0; f < nfiles; f++) {
        const char *c = PLOT_COLOURS[file_series[f] % 8];
        fprintf(gp,
                "%s'%s/cdf_%d.dat' using 1:3 with lines lc rgb '%s' lw 2 dt 1 title '%s TTFT', "
                "'' using 2:3 with lines lc rgb '%s' lw 2 dt 2 title '%s E2EL'",
                f ? ", " : "", dir, f, c, f < 256 ? titles[f] : argv[1 + f], c,
                f < 256 ? titles[f] : argv[1 + f]);
    }
    fprintf(gp, "\n");
    for (int f = 0; f < nfiles && f < 256; f++) {
        free(titles[f]);
    }
    fclose(gp);
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "gnuplot '%s/plot.gp'", dir);
    int rc = system(cmd);
    if (rc != 0) {
        pd_log_error("gnuplot failed (%d); the data files are in %s", rc, dir);
        return 1;
    }
    fprintf(stderr, "pd-bench: wrote %s/latency_vs_rate.png and %s/latency_cdf.png\n", dir, dir);
    return 0;
}

/* ------------------------------------------------------------------ token counts */

/* Where ShareGPT prompts are counted: the model's tokenizer loaded here (--tokenizer DIR), or the
 * server's POST /tokenize (vLLM's; same count as the prompt_tokens it reports). */
typedef struct counter {
    pd_tokenizer_t *tok;
    run_t *run;
    const char *model;
} counter_t;

static int32_t count_local(void *ctx, const char *text)
{
    counter_t *c = ctx;
    int32_t *ids = NULL;
    size_t n = 0;
    if (pd_tokenizer_encode(c->tok, text, strlen(text), true, &ids, &n) != PD_OK) {
        return -1;
    }
    free(ids);
    return (int32_t)n;
}

static int32_t count_remote(void *ctx, const char *text)
{
    counter_t *c = ctx;
    json_t *req = json_pack("{s:s, s:s, s:b}", "model", c->model, "prompt", text, "add_special_tokens", 1);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    pd_bench_http_resp_t g;
    pd_bench_http(c->run->base, c->run->host, c->run->port, EVHTTP_REQ_POST, "/tokenize", body, 30, &g);
    free(body);
    json_t *j = g.status == 200 && g.body != NULL ? json_loads(g.body, 0, NULL) : NULL;
    json_t *count = json_object_get(j, "count");
    int32_t n = json_is_integer(count) ? (int32_t)json_integer_value(count) : -1;
    json_decref(j);
    free(g.body);
    return n;
}

/* ------------------------------------------------------------------ main */

/* Asks the server for its first model's name (when --model is not given). */
static char *fetch_model(run_t *r)
{
    pd_bench_http_resp_t g;
    pd_bench_http(r->base, r->host, r->port, EVHTTP_REQ_GET, "/v1/models", NULL, 10, &g);
    char *model = NULL;
    if (g.status == 200 && g.body != NULL) {
        json_t *j = json_loads(g.body, 0, NULL);
        const char *id =
            json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        model = id != NULL ? strdup(id) : NULL;
        json_decref(j);
    }
    free(g.body);
    return model;
}

/* Polls base/health until it answers 200 (the proxy needs both pools healthy). */
static bool wait_ready(run_t *r, double timeout_s)
{
    double end = pd_time_now_s() + timeout_s;
    int dots = 0;
    while (pd_time_now_s() < end) {
        pd_bench_http_resp_t g;
        pd_bench_http(r->base, r->host, r->port, EVHTTP_REQ_GET, "/health", NULL, 10, &g);
        free(g.body);
        if (g.status == 200) {
            if (dots > 0) {
                fprintf(stderr, " ready\n");
            }
            return true;
        }
        if (dots++ == 0) {
            fprintf(stderr, "pd-bench: waiting for %s:%d/health ", r->host, r->port);
        } else if (dots % 5 == 0) {
            fprintf(stderr, ".");
        }
        usleep(200 * 1000);
    }
    fprintf(stderr, "\n");
    return false;
}

/* A P/D node's KV transfer counters (its /metrics) at one moment. */
typedef struct kv_snap {
    bool ok;
    double done, failed, bytes, secs, n, pages;
} kv_snap_t;

static kv_snap_t read_kv_metrics(struct event_base *base, const char *url)
{
    kv_snap_t k = {0};
    char host[128];
    int port;
    if (sscanf(url, "http://%127[^:/]:%d", host, &port) != 2) {
        pd_log_error("--kv-metrics-url '%s' is not http://HOST:PORT", url);
        return k;
    }
    pd_bench_http_resp_t g;
    pd_bench_http(base, host, port, EVHTTP_REQ_GET, "/metrics", NULL, 10, &g);
    if (g.status != 200 || g.body == NULL) {
        pd_log_error("cannot read %s/metrics", url);
        free(g.body);
        return k;
    }
    /* every kind (pull_load, push_load, push_save) summed */
    k.done = pd_metrics_text_value(g.body, "pd:kv_transfers_completed_total", 0);
    k.failed = pd_metrics_text_value(g.body, "pd:kv_transfers_failed_total", 0);
    k.bytes = pd_metrics_text_value(g.body, "pd:kv_transfer_bytes_total", 0);
    k.secs = pd_metrics_text_value(g.body, "pd:kv_transfer_seconds_sum", 0);
    k.n = pd_metrics_text_value(g.body, "pd:kv_transfer_seconds_count", 0);
    k.pages = pd_metrics_text_value(g.body, "pd:kv_transfer_pages_sum", 0);
    k.ok = true;
    free(g.body);
    return k;
}

/* The KV transfers of this run: the node's counters after minus before (a node's lifetime totals
 * would count every earlier run and the warm-ups). */
static void print_kv_metrics(const kv_snap_t *before, const kv_snap_t *after)
{
    if (!before->ok || !after->ok) {
        return;
    }
    double bytes = after->bytes - before->bytes, secs = after->secs - before->secs, n = after->n - before->n;
    printf("%s\n", "---------KV transfers (node, during this run)-----");
    printf("%-40s %-10.0f\n", "Transfers completed:", after->done - before->done);
    printf("%-40s %-10.0f\n", "Transfers failed:", after->failed - before->failed);
    printf("%-40s %-10.2f\n", "KV moved (MiB):", bytes / (1 << 20));
    printf("%-40s %-10.0f\n", "Pages moved:", after->pages - before->pages);
    printf("%-40s %-10.3f\n", "Mean transfer latency (ms):", n > 0 ? secs / n * 1e3 : 0.0);
    printf("%-40s %-10.3f\n", "Transfer throughput (GB/s):", secs > 0 ? bytes / secs / 1e9 : 0.0);
    printf("%s\n", "==================================================");
}

/* pd-bench table RESULT.json...: one markdown row per result (for bench/RESULTS.md); the goodput
 * column only when a result was run with --goodput ("-" for the others). */
static int table(int argc, char **argv)
{
    json_t **js = calloc((size_t)(argc > 0 ? argc : 1), sizeof(json_t *));
    bool any_goodput = false;
    int rc = 0;
    for (int i = 0; i < argc && rc == 0; i++) {
        json_error_t e;
        js[i] = json_load_file(argv[i], 0, &e);
        if (js[i] == NULL) {
            pd_log_error("%s:%d: %s", argv[i], e.line, e.text);
            rc = 1;
        } else {
            any_goodput |= json_is_number(json_object_get(js[i], "request_goodput"));
        }
    }
    if (rc == 0) {
        printf("| run | rate (req/s) | done/failed | req/s |%s out tok/s | TTFT p50 / p99 (ms) | "
               "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2EL p50 (ms) |\n",
               any_goodput ? " goodput (req/s) |" : "");
        printf("|---|---|---|---|%s---|---|---|---|---|\n", any_goodput ? "---|" : "");
    }
    for (int i = 0; i < argc && rc == 0; i++) {
        json_t *j = js[i];
#define NUM(k) json_number_value(json_object_get(j, k))
        const char *label = json_string_value(json_object_get(j, "label"));
        json_t *rr = json_object_get(j, "request_rate");
        char rate[32], good[40] = "";
        if (json_is_number(rr)) {
            snprintf(rate, sizeof(rate), "%g", json_number_value(rr));
        } else {
            snprintf(rate, sizeof(rate), "inf");
        }
        if (any_goodput) {
            json_t *g = json_object_get(j, "request_goodput");
            if (json_is_number(g)) {
                snprintf(good, sizeof(good), " %.2f |", json_number_value(g));
            } else {
                snprintf(good, sizeof(good), " - |");
            }
        }
        printf("| %s | %s | %lld/%lld | %.2f |%s %.1f | %.0f / %.0f | %.1f / %.1f | %.1f / %.1f | %.0f |\n",
               label != NULL ? label : argv[i], rate,
               (long long)json_integer_value(json_object_get(j, "completed")),
               (long long)json_integer_value(json_object_get(j, "failed")), NUM("request_throughput"), good,
               NUM("output_throughput"), NUM("median_ttft_ms"), NUM("p99_ttft_ms"), NUM("median_tpot_ms"),
               NUM("p99_tpot_ms"), NUM("median_itl_ms"), NUM("p99_itl_ms"), NUM("median_e2el_ms"));
#undef NUM
    }
    for (int i = 0; i < argc; i++) {
        json_decref(js[i]);
    }
    free(js);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "plot") == 0) {
        return plot(argc - 2, argv + 2);
    }
    if (argc > 1 && strcmp(argv[1], "table") == 0) {
        return table(argc - 2, argv + 2);
    }
    cfg_t c = {0};
    c.base_url = "http://127.0.0.1:8000";
    c.endpoint = "/v1/completions";
    c.dataset_name = "random";
    c.num_prompts = 1000;
    c.random_input_len = 1024;
    c.random_output_len = 128;
    c.pr_prefix_len = 256;
    c.pr_suffix_len = 256;
    c.pr_num_prefixes = 10;
    c.pr_output_len = 128;
    c.repeat_phrase_len = 8;
    c.mixed_fresh_share = 0.25;
    c.request_rate = INFINITY;
    c.burstiness = 1.0;
    c.metric_percentiles = "99";
    c.mt_turns = 4;
    c.mt_system_len = 512;
    c.mt_user_len = 128;
    c.mt_think_time = 1.0;
    const pd_flag_t flags[] = {
        {"base-url", PD_FLAG_STR, &c.base_url, "server to benchmark (http://HOST:PORT)", NULL},
        {"endpoint", PD_FLAG_STR, &c.endpoint, "completions path", NULL},
        {"model", PD_FLAG_STR, &c.model, "model name (default: the server's first)", NULL},
        {"dataset-name", PD_FLAG_CHOICE, &c.dataset_name, "workload",
         "random|prefix-repetition|repeat|sharegpt|mixed|multi-turn"},
        {"dataset-path", PD_FLAG_STR, &c.dataset_path,
         "ShareGPT JSON file (sharegpt; multi-turn: its conversations' human turns, the server's answers "
         "between them)",
         NULL},
        {"num-prompts", PD_FLAG_INT, &c.num_prompts, "requests to send", NULL},
        {"random-input-len", PD_FLAG_INT, &c.random_input_len, "random: prompt tokens", NULL},
        {"random-output-len", PD_FLAG_INT, &c.random_output_len, "random: output tokens", NULL},
        {"random-range-ratio", PD_FLAG_DOUBLE, &c.random_range_ratio,
         "random: lengths vary by ±this fraction", NULL},
        {"random-prefix-len", PD_FLAG_INT, &c.random_prefix_len,
         "random: a shared prefix of this many tokens", NULL},
        {"prefix-repetition-prefix-len", PD_FLAG_INT, &c.pr_prefix_len, "prefix-repetition: prefix tokens",
         NULL},
        {"prefix-repetition-suffix-len", PD_FLAG_INT, &c.pr_suffix_len, "prefix-repetition: suffix tokens",
         NULL},
        {"prefix-repetition-num-prefixes", PD_FLAG_INT, &c.pr_num_prefixes,
         "prefix-repetition: distinct prefixes", NULL},
        {"repeat-phrase-len", PD_FLAG_INT, &c.repeat_phrase_len,
         "repeat: prompts of --random-input-len ids are a phrase of this many repeated", NULL},
        {"prefix-repetition-output-len", PD_FLAG_INT, &c.pr_output_len, "prefix-repetition: output tokens",
         NULL},
        {"mixed-fresh-share", PD_FLAG_DOUBLE, &c.mixed_fresh_share,
         "mixed: the share of prompts that are random (--random-* lengths; fresh, long) among "
         "prefix-repetition ones (--prefix-repetition-*: chat turns over shared prefixes)",
         NULL},
        {"multi-turn-turns", PD_FLAG_INT, &c.mt_turns,
         "multi-turn: turns per conversation (--num-prompts conversations; each turn asks "
         "--random-output-len tokens)",
         NULL},
        {"multi-turn-system-len", PD_FLAG_INT, &c.mt_system_len,
         "multi-turn: tokens of the system prompt every conversation opens with", NULL},
        {"multi-turn-user-len", PD_FLAG_INT, &c.mt_user_len, "multi-turn: tokens of each user message", NULL},
        {"multi-turn-think-time", PD_FLAG_DOUBLE, &c.mt_think_time,
         "multi-turn: seconds between an answer and the next turn", NULL},
        {"sharegpt-output-len", PD_FLAG_INT, &c.sharegpt_output_len,
         "sharegpt: fixed output length (0 = dataset's)", NULL},
        {"vocab-size", PD_FLAG_INT, &c.vocab_size,
         "random token ids are drawn below this (0: --tokenizer's vocabulary, else 256)", NULL},
        {"tokenizer", PD_FLAG_STR, &c.tokenizer,
         "model directory whose tokenizer counts ShareGPT tokens (default: the server's /tokenize)", NULL},
        {"request-rate", PD_FLAG_DOUBLE, &c.request_rate, "requests/s (inf = all at once)", NULL},
        {"burstiness", PD_FLAG_DOUBLE, &c.burstiness, "gamma shape of the arrival gaps (1 = Poisson)", NULL},
        {"max-concurrency", PD_FLAG_INT, &c.max_concurrency, "requests in flight at most (0 = unbounded)",
         NULL},
        {"seed", PD_FLAG_INT64, &c.seed, "dataset and arrival seed", NULL},
        {"num-warmups", PD_FLAG_INT, &c.num_warmups, "requests sent (and not measured) before the run", NULL},
        {"ignore-eos", PD_FLAG_BOOL, &c.ignore_eos, "generate exactly the output length", NULL},
        {"temperature", PD_FLAG_DOUBLE, &c.temperature, "sampling temperature", NULL},
        {"goodput", PD_FLAG_STR, &c.goodput, "SLOs for goodput, e.g. 'ttft:500 tpot:50 e2el:5000' (ms)",
         NULL},
        {"metric-percentiles", PD_FLAG_STR, &c.metric_percentiles, "percentiles to report, e.g. 50,90,99",
         NULL},
        {"save-result", PD_FLAG_BOOL, &c.save_result, "write the result JSON", NULL},
        {"result-filename", PD_FLAG_STR, &c.result_filename, "result JSON path (default pd-bench-DATE.json)",
         NULL},
        {"label", PD_FLAG_STR, &c.label, "a name for this run in the result and plots", NULL},
        {"no-progress", PD_FLAG_BOOL, &c.no_progress, "no progress bar", NULL},
        {"wait-ready", PD_FLAG_DOUBLE, &c.wait_ready_s, "seconds to wait for GET /health to answer 200 first",
         NULL},
        {"kv-metrics-url", PD_FLAG_STR, &c.kv_metrics_url,
         "a P/D node (http://HOST:PORT) whose KV transfer totals are printed after the run", NULL},
        {"api-key", PD_FLAG_STR, &c.api_key,
         "sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, as the openai client)", NULL},
    };
    int first = 0;
    pd_status_t st = pd_flags_parse(
        flags, sizeof(flags) / sizeof(flags[0]), argc, argv,
        "usage: pd-bench [--base-url URL] [--dataset-name "
        "random|prefix-repetition|repeat|sharegpt|mixed|multi-turn] "
        "[options]\n       pd-bench plot OUT_DIR RESULT.json...\n       pd-bench table RESULT.json...\n"
        "Benchmarks an OpenAI-compatible completions server (vLLM's serving metrics).",
        &first);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK || first < argc) {
        return 2;
    }
    pd_bench_http_set_api_key(c.api_key != NULL ? c.api_key : getenv("OPENAI_API_KEY"));
    pd_bench_slo_t slo;
    char err[256];
    if (c.goodput != NULL && !pd_bench_parse_goodput(c.goodput, &slo, err, sizeof(err))) {
        pd_log_error("%s", err);
        return 2;
    }
    double pcts[PD_BENCH_MAX_PCT];
    int npct = pd_bench_parse_percentiles(c.metric_percentiles, pcts);
    if (npct < 0 || c.num_prompts < 1 || !(c.burstiness > 0) || c.request_rate <= 0) {
        pd_log_error(
            "--metric-percentiles must be up to %d values in (0, 100]; --num-prompts, --burstiness and "
            "--request-rate must be positive",
            PD_BENCH_MAX_PCT);
        return 2;
    }
    run_t r;
    memset(&r, 0, sizeof(r));
    r.cfg = &c;
    if (sscanf(c.base_url, "http://%127[^:/]:%d", r.host, &r.port) != 2) {
        pd_log_error("--base-url '%s' is not http://HOST:PORT", c.base_url);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    r.base = event_base_new();
    if (c.wait_ready_s > 0 && !wait_ready(&r, c.wait_ready_s)) {
        pd_log_error("%s/health did not answer 200 within %.0f s", c.base_url, c.wait_ready_s);
        return 1;
    }
    char *model = NULL;
    if (c.model == NULL) {
        model = fetch_model(&r);
        if (model == NULL) {
            pd_log_error("cannot read the model name from %s/v1/models; give --model", c.base_url);
            return 1;
        }
        c.model = model;
    }
    pd_tokenizer_t *tok = NULL;
    if (c.tokenizer != NULL && pd_tokenizer_load_dir(c.tokenizer, &tok) != PD_OK) {
        pd_log_error("--tokenizer: cannot load a tokenizer from %s", c.tokenizer);
        return 1;
    }
    if (c.vocab_size <= 0) { /* random ids over the model's whole vocabulary when it is known */
        c.vocab_size = tok != NULL ? pd_tokenizer_vocab_size(tok) : 256;
    }
    size_t n = (size_t)c.num_prompts + (size_t)c.num_warmups;
    if (strcmp(c.dataset_name, "random") == 0) {
        st = pd_bench_dataset_random((uint64_t)c.seed, n, c.random_input_len, c.random_output_len,
                                     c.random_range_ratio, c.random_prefix_len, c.vocab_size, &r.data);
    } else if (strcmp(c.dataset_name, "prefix-repetition") == 0) {
        st = pd_bench_dataset_prefix_repetition((uint64_t)c.seed, n, c.pr_prefix_len, c.pr_suffix_len,
                                                c.pr_num_prefixes, c.pr_output_len, c.vocab_size, &r.data);
    } else if (strcmp(c.dataset_name, "mixed") == 0) {
        pd_bench_dataset_t a = {0}, b = {0};
        st = pd_bench_dataset_prefix_repetition((uint64_t)c.seed, n, c.pr_prefix_len, c.pr_suffix_len,
                                                c.pr_num_prefixes, c.pr_output_len, c.vocab_size, &a);
        if (st == PD_OK) {
            st = pd_bench_dataset_random((uint64_t)c.seed + 1, n, c.random_input_len, c.random_output_len,
                                         c.random_range_ratio, 0, c.vocab_size, &b);
        }
        st = st == PD_OK ? pd_bench_dataset_mix((uint64_t)c.seed, &a, &b, c.mixed_fresh_share, &r.data) : st;
        if (st != PD_OK) {
            pd_bench_dataset_free(&a);
            pd_bench_dataset_free(&b);
        }
    } else if (strcmp(c.dataset_name, "multi-turn") == 0 && c.num_warmups > 0) { /* not silently dropped */
        pd_log_error("multi-turn: --num-warmups is not supported (a warm-up would cut conversations)");
        st = PD_ERR_INVALID_ARG;
    } else if (strcmp(c.dataset_name, "multi-turn") == 0 && c.dataset_path != NULL) {
        /* ShareGPT conversations: their human turns in order, the server's answers between them */
        counter_t cnt = {tok, &r, c.model};
        pd_bench_count_fn fn = tok != NULL ? count_local : count_remote;
        if (tok == NULL && count_remote(&cnt, "probe") < 0) {
            fn = NULL; /* the output lengths are estimated (4 bytes a token) */
        }
        st = pd_bench_dataset_sharegpt_multi_turn(c.dataset_path, (uint64_t)c.seed, (size_t)c.num_prompts,
                                                  c.mt_turns, c.sharegpt_output_len, fn, &cnt, &r.data);
        r.multi = true;
    } else if (strcmp(c.dataset_name, "multi-turn") == 0) {
        st = pd_bench_dataset_multi_turn((uint64_t)c.seed, (size_t)c.num_prompts, c.mt_turns, c.mt_system_len,
                                         c.mt_user_len, c.random_output_len, c.vocab_size, &r.data);
        r.multi = true;
    } else if (strcmp(c.dataset_name, "repeat") == 0) {
        st = pd_bench_dataset_repeat((uint64_t)c.seed, n, c.random_input_len, c.repeat_phrase_len,
                                     c.random_output_len, c.vocab_size, &r.data);
    } else if (c.dataset_path == NULL) {
        pd_log_error("--dataset-name sharegpt needs --dataset-path");
        st = PD_ERR_INVALID_ARG;
    } else {
        counter_t cnt = {tok, &r, c.model};
        pd_bench_count_fn fn = tok != NULL ? count_local : count_remote;
        if (tok == NULL && count_remote(&cnt, "probe") < 0) {
            pd_log_warn("pd-bench: %s has no /tokenize and no --tokenizer was given: ShareGPT lengths are "
                        "estimated (4 bytes a token) and will differ from the server's counts",
                        c.base_url);
            fn = NULL;
        }
        st = pd_bench_dataset_sharegpt(c.dataset_path, (uint64_t)c.seed, n, c.sharegpt_output_len, fn, &cnt,
                                       &r.data);
    }
    pd_tokenizer_free(tok);
    if (st != PD_OK) {
        return 1;
    }
    pd_bench_dataset_t all = r.data;
    if (c.num_warmups > 0 && all.n > (size_t)c.num_warmups) {
        /* warmups: the first prompts, at once, not measured */
        run_t w = r;
        w.data.prompts = all.prompts;
        w.data.n = (size_t)c.num_warmups;
        w.warmup = true;
        cfg_t wc = c;
        wc.request_rate = INFINITY;
        w.cfg = &wc;
        run_load(&w, !c.no_progress);
        for (size_t i = 0; i < w.n; i++) {
            free(w.recs[i].chunk_times);
        }
        run_free_bufs(&w);
        r.data.prompts = all.prompts + c.num_warmups;
        r.data.n = all.n - (size_t)c.num_warmups;
    }
    fprintf(stderr, "pd-bench: %zu %s requests to %s (rate %g req/s, burstiness %g, max concurrency %d)\n",
            r.data.n, c.dataset_name, c.base_url, c.request_rate, c.burstiness, c.max_concurrency);
    kv_snap_t kv0 = {0}, kv1 = {0};
    if (c.kv_metrics_url != NULL) {
        kv0 = read_kv_metrics(r.base, c.kv_metrics_url);
    }
    double dur = run_load(&r, !c.no_progress);
    pd_bench_summary_t s;
    pd_bench_summarize(r.recs, r.n, dur, c.goodput != NULL ? &slo : NULL, pcts, npct, &s);
    print_summary(&c, &s, c.goodput != NULL);
    if (r.multi) {
        print_turns(&r, pcts, npct, NULL);
    }
    if (c.kv_metrics_url != NULL) {
        kv1 = read_kv_metrics(r.base, c.kv_metrics_url);
        print_kv_metrics(&kv0, &kv1);
    }
    int shown = 0;
    for (size_t i = 0; i < r.n && shown < 3; i++) {
        if (!r.recs[i].success) {
            fprintf(stderr, "pd-bench: request %zu failed: %s\n", i, r.recs[i].error);
            shown++;
        }
    }
    if (r.server_prompt_tokens != s.total_input_tokens && s.completed > 0) {
        fprintf(stderr, "pd-bench: note: the server counted %lld prompt tokens, the dataset %lld\n",
                (long long)r.server_prompt_tokens, (long long)s.total_input_tokens);
    }
    int rc = c.save_result ? save_result(&c, &r, &s) : 0;
    for (size_t i = 0; i < r.n; i++) {
        free(r.recs[i].chunk_times);
    }
    run_free_bufs(&r);
    pd_bench_dataset_free(&all);
    event_base_free(r.base);
    free(model);
    return rc != 0 ? rc : (s.completed > 0 ? 0 : 1);
}
