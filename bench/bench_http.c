/* bench/bench_http.c — a blocking request on a libevent base (see bench_http.h). */
#include "bench/bench_http.h"

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/time.h"

static char g_auth[512]; /* "Bearer KEY" or "" */

void pd_bench_http_set_api_key(const char *key)
{
    snprintf(g_auth, sizeof(g_auth), key != NULL && key[0] ? "Bearer %s" : "%s", key != NULL ? key : "");
}

void pd_bench_http_add_auth(struct evkeyvalq *h)
{
    if (g_auth[0]) {
        evhttp_add_header(h, "Authorization", g_auth);
    }
}

typedef struct ctx {
    struct event_base *base;
    pd_bench_http_resp_t *out;
} ctx_t;

static void on_done(struct evhttp_request *hr, void *arg)
{
    ctx_t *c = arg;
    c->out->status = hr != NULL ? evhttp_request_get_response_code(hr) : 0;
    if (hr != NULL) {
        struct evbuffer *in = evhttp_request_get_input_buffer(hr);
        size_t n = evbuffer_get_length(in);
        c->out->body = malloc(n + 1);
        if (c->out->body != NULL) {
            evbuffer_remove(in, c->out->body, n);
            c->out->body[n] = '\0';
        }
    }
    event_base_loopexit(c->base, NULL); /* a kept-alive connection would hold the loop */
}

double pd_bench_http(struct event_base *base, const char *host, int port, enum evhttp_cmd_type method,
                     const char *path, const char *json_body, int timeout_s, pd_bench_http_resp_t *out)
{
    memset(out, 0, sizeof(*out));
    ctx_t c = {base, out};
    struct evhttp_connection *conn = evhttp_connection_base_new(base, NULL, host, (ev_uint16_t)port);
    if (conn == NULL) {
        return 0;
    }
    evhttp_connection_set_timeout(conn, timeout_s);
    struct evhttp_request *hr = evhttp_request_new(on_done, &c);
    struct evkeyvalq *h = evhttp_request_get_output_headers(hr);
    evhttp_add_header(h, "Host", host);
    pd_bench_http_add_auth(h);
    if (json_body != NULL) {
        evhttp_add_header(h, "Content-Type", "application/json");
        evbuffer_add(evhttp_request_get_output_buffer(hr), json_body, strlen(json_body));
    }
    double t0 = pd_time_now_s();
    if (evhttp_make_request(conn, hr, method, path) == 0) {
        event_base_dispatch(base);
    }
    double dt = pd_time_now_s() - t0;
    evhttp_connection_free(conn);
    return dt;
}
