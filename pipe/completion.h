/* pipe/completion.h — the completion queue every pipe backend uses: callbacks from transport
 * threads are queued (under the backend's own lock) and run by pd_pipe_progress on the caller's
 * thread, so user callbacks never run concurrently with the caller. */
#ifndef PD_PIPE_COMPLETION_H
#define PD_PIPE_COMPLETION_H

#include "pipe/pipe.h"

#include <stdbool.h>

typedef struct pd_pipe_completion pd_pipe_completion_t;
struct pd_pipe_completion {
    pd_pipe_done_cb done; /* one of done / recv_cb / peer_cb is set */
    pd_pipe_recv_cb recv_cb;
    pd_pipe_peer_error_cb peer_cb;
    pd_pipe_peer_t *peer;
    void *arg;
    pd_status_t st;
    uint64_t tag;
    size_t hlen, plen;
    pd_pipe_completion_t *next;
};

typedef struct pd_pipe_cq {
    pd_pipe_completion_t *head, *tail;
    bool has_fd; /* efd is readable while the queue is not empty (pd_pipe_cq_open_fd) */
    int efd;
} pd_pipe_cq_t;

/* Gives q an eventfd that polls readable from the push that makes the queue non-empty to the next
 * take: what a backend whose bytes move on its own threads returns as its wait_fd, so a caller can
 * sleep until a completion is queued instead of napping. PD_ERR_IO (logged) when none can be made. */
pd_status_t pd_pipe_cq_open_fd(pd_pipe_cq_t *q);

/* Closes the eventfd, if any (the queue's entries are the backend's to drain). */
void pd_pipe_cq_close_fd(pd_pipe_cq_t *q);

/* Appends a copy of c (the caller holds the lock protecting q). Drops it if memory runs out. */
void pd_pipe_cq_push(pd_pipe_cq_t *q, const pd_pipe_completion_t *c);

/* Takes the whole queue (the caller holds the lock); run it with pd_pipe_cq_run after unlocking. */
pd_pipe_completion_t *pd_pipe_cq_take(pd_pipe_cq_t *q);

/* Runs and frees a taken list; returns how many callbacks ran. */
int pd_pipe_cq_run(pd_pipe_completion_t *list);

#endif
