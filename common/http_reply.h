/* common/http_reply.h — evhttp_send_reply that answers HEAD as HTTP says: the GET's status and
 * headers (Content-Length included), no body. libevent 2.1 would write the body after the headers
 * of a HEAD response. And replies without Nagle's delay. Header-only: the HTTP front and the proxy
 * both use it (with libevent). */
#ifndef PD_COMMON_HTTP_REPLY_H
#define PD_COMMON_HTTP_REPLY_H

#include <sys/queue.h> /* TAILQ_FOREACH, before libevent's keyvalq_struct.h */

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <sys/socket.h>

/* The value of req's header `name` when it has exactly one (NULL when none or several): an
 * Authorization header given twice is no credential, whichever of them a check would read first. */
static inline const char *pd_http_sole_header(struct evhttp_request *req, const char *name)
{
    const struct evkeyval *h, *found = NULL;
    TAILQ_FOREACH(h, evhttp_request_get_input_headers(req), next)
    {
        if (evutil_ascii_strcasecmp(h->key, name) == 0) {
            if (found != NULL) {
                return NULL;
            }
            found = h;
        }
    }
    return found != NULL ? found->value : NULL;
}

/* Turns Nagle's algorithm off on req's connection (TCP_NODELAY), as uvicorn does for vLLM's
 * server: a streamed token is one small write, and under Nagle a write waits while the previous
 * one is unacknowledged, so with a delayed ACK a token can reach the client only with the next.
 * libevent does not set it on accepted sockets. Call it when a request arrives. */
static inline void pd_http_no_delay(struct evhttp_request *req)
{
    struct evhttp_connection *conn = evhttp_request_get_connection(req);
    struct bufferevent *bev = conn != NULL ? evhttp_connection_get_bufferevent(conn) : NULL;
    evutil_socket_t fd = bev != NULL ? bufferevent_getfd(bev) : -1;
    if (fd >= 0) {
        int one = 1;
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* fails only off TCP */
    }
}

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
