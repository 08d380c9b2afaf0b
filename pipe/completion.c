/* pipe/completion.c — completion queue shared by the pipe backends. */
#include "pipe/completion.h"

#include "common/log.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

pd_status_t pd_pipe_cq_open_fd(pd_pipe_cq_t *q)
{
    q->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (q->efd < 0) {
        pd_log_error("pipe: cannot create the completion eventfd: %s", strerror(errno));
        return PD_ERR_IO;
    }
    q->has_fd = true;
    return PD_OK;
}

void pd_pipe_cq_close(pd_pipe_cq_t *q)
{
    if (q->has_fd) {
        close(q->efd);
        q->has_fd = false;
    }
    pd_pipe_completion_t *n;
    while ((n = q->spare) != NULL) {
        q->spare = n->next;
        free(n);
    }
}

pd_status_t pd_pipe_cq_reserve(pd_pipe_cq_t *q)
{
    pd_pipe_completion_t *n = malloc(sizeof(*n));
    if (n == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    n->next = q->spare;
    q->spare = n;
    return PD_OK;
}

void pd_pipe_cq_push(pd_pipe_cq_t *q, const pd_pipe_completion_t *c)
{
    pd_pipe_completion_t *n = q->spare;
    if (n != NULL) {
        q->spare = n->next;
    } else if ((n = malloc(sizeof(*n))) == NULL) {
        /* a backend pushed a completion it did not reserve: a bug, not an out-of-memory case */
        pd_log_error("pipe: BUG: a completion without a reserved node was lost (status %s)",
                     pd_status_str(c->st));
        return;
    }
    *n = *c;
    n->next = NULL;
    if (q->tail != NULL) {
        q->tail->next = n;
    } else {
        q->head = n;
        if (q->has_fd && !q->quiet && !q->signalled) { /* empty -> not empty: wake a waiter */
            uint64_t one = 1;
            ssize_t r = write(q->efd, &one, sizeof(one));
            (void)r; /* EAGAIN only when the counter is already huge: still readable */
            q->signalled = true;
        }
    }
    q->tail = n;
}

pd_pipe_completion_t *pd_pipe_cq_take(pd_pipe_cq_t *q)
{
    pd_pipe_completion_t *c = q->head;
    q->head = q->tail = NULL;
    if (q->has_fd && q->signalled) {
        uint64_t v;
        ssize_t r = read(q->efd, &v, sizeof(v));
        (void)r; /* EAGAIN: nothing to drain */
        q->signalled = false;
    }
    return c;
}

int pd_pipe_cq_run(pd_pipe_completion_t *c)
{
    int n = 0;
    while (c != NULL) {
        pd_pipe_completion_t *next = c->next;
        if (c->peer_cb != NULL) {
            c->peer_cb(c->arg, c->peer, c->st);
        } else if (c->recv_cb != NULL) {
            c->recv_cb(c->arg, c->st, c->tag, c->hlen, c->plen);
        } else if (c->done != NULL) {
            c->done(c->arg, c->st);
        }
        free(c);
        c = next;
        n++;
    }
    return n;
}
