/* common/http_watch.h — noticing a client that leaves while its request is in flight.
 * libevent's HTTP server stops reading a connection once its request is in, so a client that
 * closes is only seen at the first write: for a non-streamed request, after all the work is done.
 * A watch polls the client's socket for EOF or a reset and then frees the connection, which runs
 * the connection's close callback (where the owner aborts the request). Bytes of a pipelined next
 * request are not a close: the watch ends there. Header-only (libevent), as http_reply.h; the HTTP
 * front (server/completion.c) and pd-proxy (proxy/route.c) both use it. Loop thread only. */
#ifndef PD_COMMON_HTTP_WATCH_H
#define PD_COMMON_HTTP_WATCH_H

#include <errno.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <stdlib.h>
#include <sys/socket.h>

typedef struct pd_client_watch {
    struct event *ev;
    struct evhttp_connection *conn;
} pd_client_watch_t;

static inline void pd_client_watch_on_readable(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    pd_client_watch_t *w = arg;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        event_add(w->ev, NULL);
        return;
    }
    if (n <= 0 && w->conn != NULL) {
        struct evhttp_connection *conn = w->conn;
        w->conn = NULL;
        evhttp_connection_free(conn); /* runs the close callback; its owner stops (frees) w */
    }
}

/* Starts watching conn's socket (the connection's close callback must be set: it is what runs).
 * Returns NULL when it cannot (the close is then seen at the first write, as without a watch).
 * The owner calls pd_client_watch_stop once the request is answered or gone, and in the close
 * callback; the watch never outlives the request. */
static inline pd_client_watch_t *pd_client_watch_start(struct event_base *base,
                                                       struct evhttp_connection *conn)
{
    struct bufferevent *bev = conn != NULL ? evhttp_connection_get_bufferevent(conn) : NULL;
    evutil_socket_t fd = bev != NULL ? bufferevent_getfd(bev) : -1;
    pd_client_watch_t *w = fd >= 0 ? calloc(1, sizeof(*w)) : NULL;
    if (w == NULL) {
        return NULL;
    }
    w->conn = conn;
    w->ev = event_new(base, fd, EV_READ, pd_client_watch_on_readable, w);
    if (w->ev == NULL || event_add(w->ev, NULL) != 0) {
        if (w->ev != NULL) {
            event_free(w->ev);
        }
        free(w);
        return NULL;
    }
    return w;
}

/* Stops and frees w (NULL: nothing); safe from the close callback the watch itself ran. */
static inline void pd_client_watch_stop(pd_client_watch_t *w)
{
    if (w == NULL) {
        return;
    }
    event_free(w->ev);
    free(w);
}

#endif
