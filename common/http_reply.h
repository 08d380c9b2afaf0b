/* common/http_reply.h — evhttp_send_reply that answers HEAD as HTTP says: the GET's status and
 * headers (Content-Length included), no body. libevent 2.1 would write the body after the headers
 * of a HEAD response. Header-only: the HTTP front and the proxy both use it (with libevent). */
#ifndef PD_COMMON_HTTP_REPLY_H
#define PD_COMMON_HTTP_REPLY_H

#include <event2/buffer.h>
#include <event2/http.h>
#include <stdio.h>

static inline void pd_http_send_reply(struct evhttp_request *req, int status, const char *reason,
                                      struct evbuffer *body)
{
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD && body != NULL) {
        char len[32];
        snprintf(len, sizeof(len), "%zu", evbuffer_get_length(body));
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Length", len);
        evbuffer_drain(body, evbuffer_get_length(body));
    }
    evhttp_send_reply(req, status, reason, body);
}

#endif
