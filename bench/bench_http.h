/* bench/bench_http.h — one blocking HTTP request on a libevent base, for the benchmark tools'
 * set-up and scraping (model names, /health, /metrics, timed 1-token completions). */
#ifndef PD_BENCH_BENCH_HTTP_H
#define PD_BENCH_BENCH_HTTP_H

#include <event2/event.h>
#include <event2/http.h>

typedef struct pd_bench_http_resp {
    int status; /* 0: no answer (connection failed or timed out) */
    char *body; /* NUL-terminated, caller frees; NULL without an answer */
} pd_bench_http_resp_t;

/* Sends method path (with json_body as application/json when not NULL) to host:port and runs base
 * until the answer or timeout_s. Returns the seconds it took. */
/* The key every request of this process sends as "Authorization: Bearer KEY" (NULL or "": none). */
void pd_bench_http_set_api_key(const char *key);
/* Adds that header to h (nothing without a key). */
void pd_bench_http_add_auth(struct evkeyvalq *h);

double pd_bench_http(struct event_base *base, const char *host, int port, enum evhttp_cmd_type method,
                     const char *path, const char *json_body, int timeout_s, pd_bench_http_resp_t *out);

#endif
