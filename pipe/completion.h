/* pipe/completion.h — the completion queue every pipe backend uses: callbacks from transport
 * threads are queued (under the backend's own lock) and run by pd_pipe_progress on the caller's
 * thread, so user callbacks never run concurrently with the caller.
 *
 * Delivery cannot fail: every completion's node is reserved (pd_pipe_cq_reserve) where the
 * operation that will complete is posted, or where the peer whose death will be reported is
 * made, so running out of memory fails the post (PD_ERR_NO_MEMORY to its caller) and never drops
 * a completion later ("every posted operation completes exactly once"). */
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
    pd_pipe_completion_t *spare; /* reserved nodes, one per completion still owed */
    bool has_fd;                 /* efd is readable while the queue is not empty (pd_pipe_cq_open_fd) */
    bool signalled;              /* efd was written and not read since */
    bool quiet; /* the thread that takes next is inside its progress call, taking before it returns:
                 * a push that makes the queue non-empty needs not wake it (two syscalls saved on a
                 * round trip whose completion progress itself finds) */
    int efd;
} pd_pipe_cq_t;

/* Gives q an eventfd that polls readable from the push that makes the queue non-empty to the next
 * take (unless q->quiet was set for that push: the taker was already taking): what a backend whose bytes move on its own threads returns as its wait_fd, so a caller can
 * sleep until a completion is queued instead of napping. PD_ERR_IO (logged) when none can be made. */
pd_status_t pd_pipe_cq_open_fd(pd_pipe_cq_t *q);

/* Closes the eventfd, if any, and frees the reserved nodes (the queued entries are the backend's
 * to drain before). */
void pd_pipe_cq_close(pd_pipe_cq_t *q);

/* Reserves the node of one future completion (the caller holds the lock protecting q): call it
 * before posting an operation, or making a peer, whose end will be pushed. PD_ERR_NO_MEMORY: the
 * post must fail. A reservation whose operation ends without a completion (cancelled at destroy)
 * stays spare until pd_pipe_cq_close. */
pd_status_t pd_pipe_cq_reserve(pd_pipe_cq_t *q);

/* Appends a copy of c in a reserved node (the caller holds the lock protecting q). Cannot fail. */
void pd_pipe_cq_push(pd_pipe_cq_t *q, const pd_pipe_completion_t *c);

/* Takes the whole queue (the caller holds the lock); run it with pd_pipe_cq_run after unlocking. */
pd_pipe_completion_t *pd_pipe_cq_take(pd_pipe_cq_t *q);

/* Runs and frees a taken list; returns how many callbacks ran. */
int pd_pipe_cq_run(pd_pipe_completion_t *list);

#endif
