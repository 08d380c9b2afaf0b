/* common/http_guard.h — an HTTP listener that slow clients cannot fill (slowloris).
 *
 * libevent 2.1 gives an evhttp no deadline for a whole request (its timeout restarts with every
 * byte) and no connection limit, so 1,100 clients that each send a byte every 2 s held every fd of
 * a node or of pd-proxy under a 1024-fd limit and legitimate requests hung (issue 51). The guard
 * tracks every accepted connection (through evhttp_set_bevcb) and, from a timer on the loop:
 *   - closes a connection that has not delivered a complete request (headers and body) within
 *     request_timeout_s of its accept: a slow client spends its own time, not the node's fds;
 *   - keeps at most max_conns connections: past that, the oldest one still waiting for its first
 *     request is closed first (connections that delivered a request are never dropped for room).
 * A closed connection's fd is released at the next sweep (0.1 s), not at once (http_guard.c says why).
 * While a request is being served its connection is exempt; once the owner reports the reply written
 * (pd_http_guard_reply_done) it waits under the deadline again, so a client that sends one request
 * quickly and dribbles the next on the same keep-alive connection is closed as well.
 * Loop thread only. The server and pd-proxy use it (`--http-request-timeout`,
 * `--http-max-connections`). */
#ifndef PD_COMMON_HTTP_GUARD_H
#define PD_COMMON_HTTP_GUARD_H

#include <event2/event.h>
#include <event2/http.h>
#include <stdint.h>

#include "common/status.h"

typedef struct pd_http_guard pd_http_guard_t;

/* The help of the flags the server and pd-proxy both take (--http-request-timeout,
 * --http-max-connections). */
#define PD_HTTP_GUARD_TIMEOUT_HELP                                                                           \
    "seconds a client connection has to deliver a whole request (headers and body) before it is closed"
#define PD_HTTP_GUARD_MAX_CONNS_HELP                                                                         \
    "client connections at most; past it the oldest still waiting for its request is closed (0: half the "   \
    "open-file limit"

/* The connection cap for max_conns 0: half the soft RLIMIT_NOFILE (the rest for the process's own
 * files, upstream and KV sockets), at least 16. */
int pd_http_guard_auto_max(void);

/* Installs the guard on http (its bevcb; call before any connection is accepted). max_conns 0: auto.
 * PD_ERR_NO_MEMORY (logged) if it cannot. */
pd_status_t pd_http_guard_create(struct event_base *base, struct evhttp *http, double request_timeout_s,
                                 int max_conns, pd_http_guard_t **guard_out);

/* The owner's request callback calls this first: req's connection delivered a whole request. */
void pd_http_guard_request(pd_http_guard_t *g, struct evhttp_request *req);

/* req's reply is written out (its on-complete callback): its connection waits for its next request
 * from now on, under the same deadline as a new one (an idle keep-alive connection is closed after
 * request_timeout_s, as uvicorn closes one after its keep-alive timeout). */
void pd_http_guard_reply_done(pd_http_guard_t *g, struct evhttp_request *req);

/* Connections open now, and those closed by the guard so far (deadline, cap). */
int pd_http_guard_open(const pd_http_guard_t *g);
uint64_t pd_http_guard_closed(const pd_http_guard_t *g);

/* Stops the timer and lets go of every tracked connection (evhttp still owns them: free the evhttp
 * after this). */
void pd_http_guard_destroy(pd_http_guard_t *g);

#endif
