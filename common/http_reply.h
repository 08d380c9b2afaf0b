/* common/http_reply.h — evhttp_send_reply that answers HEAD as HTTP says: the GET's status and
 * headers (Content-Length included), no body. libevent 2.1 would write the body after the headers
 * of a HEAD response. Replies without Nagle's delay, and streamed chunks written at once. Header-only: the HTTP front and the proxy
 * both use it (with libevent). */
#ifndef PD_COMMON_HTTP_REPLY_H
#define PD_COMMON_HTTP_REPLY_H

#include <sys/queue.h> /* TAILQ_FOREACH, before libevent's keyvalq_struct.h */

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

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

/* req's connection's bufferevent, or NULL when it has none (the client is gone). */
static inline struct bufferevent *pd_http_bev(struct evhttp_request *req)
{
    struct evhttp_connection *conn = evhttp_request_get_connection(req);
    return conn != NULL ? evhttp_connection_get_bufferevent(conn) : NULL;
}

/* Turns Nagle's algorithm off on req's connection (TCP_NODELAY), as uvicorn does for vLLM's
 * server: a streamed token is one small write, and under Nagle a write waits while the previous
 * one is unacknowledged, so with a delayed ACK a token can reach the client only with the next.
 * libevent does not set it on accepted sockets. Call it when a request arrives. */
static inline void pd_http_no_delay(struct evhttp_request *req)
{
    struct bufferevent *bev = pd_http_bev(req);
    evutil_socket_t fd = bev != NULL ? bufferevent_getfd(bev) : -1;
    if (fd >= 0) {
        int one = 1;
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* fails only off TCP */
    }
}

/* Bytes already framed as pd_http_send_chunk frames them (what the engine thread's writer could not
 * send, server/direct_stream.h), queued in order on req's connection. */
static inline void pd_http_send_framed(struct evhttp_request *req, const char *data, size_t len)
{
    struct bufferevent *bev = pd_http_bev(req);
    if (bev != NULL && len > 0) {
        bufferevent_write(bev, data, len);
    }
}

/* Whether req's connection has nothing queued to write (false without a connection). */
static inline bool pd_http_drained(struct evhttp_request *req)
{
    struct bufferevent *bev = pd_http_bev(req);
    return bev != NULL && bufferevent_getfd(bev) >= 0 &&
           evbuffer_get_length(bufferevent_get_output(bev)) == 0;
}

/* req's socket, or -1 without one. */
static inline evutil_socket_t pd_http_socket(struct evhttp_request *req)
{
    struct bufferevent *bev = pd_http_bev(req);
    return bev != NULL ? bufferevent_getfd(bev) : -1;
}

/* Whether req's started reply is chunked (evhttp_send_reply_start said so in Transfer-Encoding:
 * HTTP/1.1 without Content-Length). */
static inline bool pd_http_reply_chunked(struct evhttp_request *req)
{
    const char *te = evhttp_find_header(evhttp_request_get_output_headers(req), "Transfer-Encoding");
    return te != NULL && evutil_ascii_strcasecmp(te, "chunked") == 0;
}

/* One chunk of a started streaming reply (evhttp_send_reply_start), written to the socket at once
 * when nothing is queued before it. evhttp_send_reply_chunk only queues its bytes and arms the
 * socket's write event, so each streamed token would cost the loop an epoll_ctl to arm it, an
 * epoll_wait that returns at once, the writev and an epoll_ctl to disarm it (issue 53); here it is
 * one sendmsg. The framing is evhttp's: "<hex size>\r\n<data>\r\n" when the reply is chunked
 * (evhttp_send_reply_start said so in Transfer-Encoding), the bare data when it is not (HTTP/1.0).
 * What the socket does not take (a client that is behind) is queued in the connection's output
 * buffer, and later chunks queue behind it (and as much as the socket takes is written at once):
 * the loop writes the rest together as the client drains.
 * A failed send queues everything, so the bufferevent meets the same error and evhttp reports it
 * through its error callback, as before. Loop thread only, as every evhttp call. */
static inline void pd_http_send_chunk(struct evhttp_request *req, const char *data, size_t len)
{
    struct bufferevent *bev = pd_http_bev(req);
    evutil_socket_t fd = bev != NULL ? bufferevent_getfd(bev) : -1;
    if (fd < 0 || len == 0 || evhttp_request_get_command(req) == EVHTTP_REQ_HEAD ||
        evbuffer_get_length(bufferevent_get_output(bev)) > 0) {
        struct evbuffer *b = evbuffer_new(); /* evhttp's own path: it queues behind what waits */
        if (b != NULL) {
            evbuffer_add(b, data, len);
            evhttp_send_reply_chunk(req, b);
            evbuffer_free(b);
        }
        if (fd >= 0) { /* and what the socket takes now (the headers, say) is not left for later */
            (void)evbuffer_write(bufferevent_get_output(bev), fd);
        }
        return;
    }
    bool chunked = pd_http_reply_chunked(req);
    char head[24];
    int hl = chunked ? snprintf(head, sizeof(head), "%zx\r\n", len) : 0;
    struct iovec iov[3] = {{head, (size_t)hl}, {(void *)data, len}, {(void *)"\r\n", chunked ? 2u : 0u}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 3};
    ssize_t w = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    size_t done = w > 0 ? (size_t)w : 0;
    for (int i = 0; i < 3; i++) { /* the rest, in order, for the bufferevent to write */
        size_t skip = done < iov[i].iov_len ? done : iov[i].iov_len;
        done -= skip;
        if (iov[i].iov_len > skip) {
            bufferevent_write(bev, (const char *)iov[i].iov_base + skip, iov[i].iov_len - skip);
        }
    }
}

/* One server-sent event of a started streaming reply, "data: <data>\n\n", as pd_http_send_chunk
 * sends it (out of memory: no event rather than a broken one). */
static inline void pd_http_send_sse(struct evhttp_request *req, const char *data)
{
    size_t n = strlen(data);
    char *ev = (char *)malloc(n + 9);
    if (ev == NULL) {
        return;
    }
    memcpy(ev, "data: ", 6);
    memcpy(ev + 6, data, n);
    memcpy(ev + 6 + n, "\n\n", 3);
    pd_http_send_chunk(req, ev, n + 8);
    free(ev);
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
