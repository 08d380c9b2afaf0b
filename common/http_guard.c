/* common/http_guard.c — see http_guard.h. Each accepted connection's bufferevent is made here and
 * holds one extra reference of ours, so the entry stays valid after evhttp frees the connection:
 * bufferevent_free() clears its callbacks, which is how a sweep tells a connection that went (the
 * reference is dropped then, every 0.1 s). The bufferevent closes its fd when that last reference
 * goes (BEV_OPT_CLOSE_ON_FREE), not when evhttp lets go: a bufferevent that is not yet finalized
 * keeps its read event registered, and had evhttp closed the fd, the next connection given the same
 * fd number would have its bytes read by the dead one (a request body that never arrived). */
#define _GNU_SOURCE
#include "common/http_guard.h"

#include <event2/bufferevent.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include "common/array.h"
#include "common/log.h"
#include "common/time.h"

typedef struct guard_conn {
    struct bufferevent *bev; /* our reference */
    double since;            /* accepted */
    bool served;             /* delivered a whole request */
    bool closing;            /* shut down by the guard; evhttp frees it on the error it sees */
} guard_conn_t;

struct pd_http_guard {
    struct event *timer;
    double timeout;
    int max_conns;
    guard_conn_t *conns; /* [num], in accept order */
    size_t num, cap;
    uint64_t closed;
    double logged; /* last time a cap or deadline close was logged (once per 10 s) */
};

int pd_http_guard_auto_max(void)
{
    struct rlimit rl;
    long n =
        getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (long)rl.rlim_cur / 2 : 4096;
    return n < 16 ? 16 : n > 65536 ? 65536 : (int)n;
}

/* Whether evhttp has freed c's connection (bufferevent_free clears the event callback evhttp keeps
 * set for the connection's whole life). */
static bool conn_gone(const guard_conn_t *c)
{
    bufferevent_event_cb ev = NULL;
    void *arg = NULL;
    bufferevent_getcb(c->bev, NULL, NULL, &ev, &arg);
    return ev == NULL && arg == NULL;
}

/* Ends c: a shutdown makes evhttp see the connection fail and free it (and close the fd). */
static void conn_close(pd_http_guard_t *g, guard_conn_t *c, const char *why)
{
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    if (c->closing || fd < 0) {
        return;
    }
    shutdown(fd, SHUT_RDWR);
    c->closing = true;
    g->closed++;
    if (pd_time_now_s() - g->logged > 10) {
        pd_log_warn("http: closing a client connection that %s (logged once per 10 s; %llu so far)", why,
                    (unsigned long long)g->closed);
        g->logged = pd_time_now_s();
    }
}

static void sweep(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    pd_http_guard_t *g = arg;
    double now = pd_time_now_s();
    size_t k = 0, waiting = 0;
    for (size_t i = 0; i < g->num; i++) {
        guard_conn_t *c = &g->conns[i];
        if (conn_gone(c)) {
            bufferevent_decref(c->bev);
            continue;
        }
        if (!c->served && now - c->since > g->timeout) {
            conn_close(g, c, "sent no complete request within --http-request-timeout");
        }
        waiting += !c->served && !c->closing;
        g->conns[k++] = *c;
    }
    g->num = k;
    /* at the cap (a new connection is about to join) or over it: the oldest waiting ones go first */
    size_t open = 0;
    for (size_t i = 0; i < g->num; i++) {
        open += !g->conns[i].closing;
    }
    for (size_t i = 0; i < g->num && open >= (size_t)g->max_conns && waiting > 0; i++) {
        guard_conn_t *c = &g->conns[i];
        if (!c->served && !c->closing) {
            conn_close(g, c,
                       "waited longest for its request while connections were at --http-max-connections");
            open--;
            waiting--;
        }
    }
}

static struct bufferevent *on_new_conn(struct event_base *base, void *arg)
{
    pd_http_guard_t *g = arg;
    if (g->num >= (size_t)g->max_conns) {
        sweep(-1, 0, g); /* make room now, before this one joins: the fds are what the cap protects */
    }
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    if (bev == NULL) {
        return NULL;
    }
    if (pd_array_reserve(&g->conns, &g->cap, g->num + 1) != PD_OK) {
        return bev; /* untracked (out of memory): evhttp still serves it */
    }
    bufferevent_incref(bev);
    g->conns[g->num++] = (guard_conn_t){bev, pd_time_now_s(), false, false};
    return bev;
}

pd_status_t pd_http_guard_create(struct event_base *base, struct evhttp *http, double request_timeout_s,
                                 int max_conns, pd_http_guard_t **guard_out)
{
    pd_http_guard_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        pd_log_error("http: cannot allocate the connection guard");
        return PD_ERR_NO_MEMORY;
    }
    g->timeout = request_timeout_s > 0 ? request_timeout_s : 30;
    g->max_conns = max_conns > 0 ? max_conns : pd_http_guard_auto_max();
    g->timer = event_new(base, -1, EV_PERSIST, sweep, g);
    double period = g->timeout / 4 < 0.1 ? g->timeout / 4 : 0.1;
    struct timeval tv = {0, (suseconds_t)(period * 1e6)};
    if (g->timer == NULL || event_add(g->timer, &tv) != 0) {
        pd_log_error("http: cannot start the connection guard's timer");
        if (g->timer != NULL) {
            event_free(g->timer);
        }
        free(g);
        return PD_ERR_NO_MEMORY;
    }
    evhttp_set_bevcb(http, on_new_conn, g);
    *guard_out = g;
    return PD_OK;
}

/* The entry of req's connection, or NULL (untracked). */
static guard_conn_t *entry_of(pd_http_guard_t *g, struct evhttp_request *req)
{
    struct evhttp_connection *conn = evhttp_request_get_connection(req);
    struct bufferevent *bev = conn != NULL ? evhttp_connection_get_bufferevent(conn) : NULL;
    for (size_t i = g->num; bev != NULL && i-- > 0;) { /* newest first: the usual case */
        if (g->conns[i].bev == bev) {
            return &g->conns[i];
        }
    }
    return NULL;
}

void pd_http_guard_request(pd_http_guard_t *g, struct evhttp_request *req)
{
    guard_conn_t *c = entry_of(g, req);
    if (c != NULL) {
        c->served = true;
    }
}

void pd_http_guard_reply_done(pd_http_guard_t *g, struct evhttp_request *req)
{
    guard_conn_t *c = entry_of(g, req);
    if (c != NULL) {
        c->served = false; /* waiting for its next request, from now */
        c->since = pd_time_now_s();
    }
}

int pd_http_guard_open(const pd_http_guard_t *g)
{
    int n = 0;
    for (size_t i = 0; i < g->num; i++) {
        n += !conn_gone(&g->conns[i]);
    }
    return n;
}

uint64_t pd_http_guard_closed(const pd_http_guard_t *g)
{
    return g->closed;
}

void pd_http_guard_destroy(pd_http_guard_t *g)
{
    if (g == NULL) {
        return;
    }
    event_free(g->timer);
    for (size_t i = 0; i < g->num; i++) {
        bufferevent_decref(g->conns[i].bev);
    }
    free(g->conns);
    free(g);
}
