/* pipe/completion.c — completion queue shared by the pipe backends. */
#include "pipe/completion.h"

#include <stdlib.h>

void pd_pipe_cq_push(pd_pipe_cq_t *q, const pd_pipe_completion_t *c)
{
    pd_pipe_completion_t *n = malloc(sizeof(*n));
    if (n == NULL) {
        return;
    }
    *n = *c;
    n->next = NULL;
    if (q->tail != NULL) {
        q->tail->next = n;
    } else {
        q->head = n;
    }
    q->tail = n;
}

pd_pipe_completion_t *pd_pipe_cq_take(pd_pipe_cq_t *q)
{
    pd_pipe_completion_t *c = q->head;
    q->head = q->tail = NULL;
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
