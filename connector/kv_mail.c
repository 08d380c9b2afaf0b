/* connector/kv_mail.c — the connector's mailbox (kv_mail.h): two queues, an eventfd and the three
 * functions that take its mutex; and freeing what travels through it. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common/time.h"
#include "connector/kv_mail.h"

void kv_mb_init(kv_mb_t *mb)
{
    pthread_mutex_init(&mb->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines are pd_time_now_s (monotonic) */
    pthread_cond_init(&mb->cv, &ca);
    pthread_condattr_destroy(&ca);
    pd_list_head_init(&mb->cmds);
    pd_list_head_init(&mb->events);
    mb->closed = false;
    mb->wake_fd = -1;
    mb->wake = NULL;
    mb->wake_arg = NULL;
}

void kv_mb_destroy(kv_mb_t *mb)
{
    pd_list_link_t *queues[2] = {&mb->cmds, &mb->events};
    for (int i = 0; i < 2; i++) {
        kv_msg_t *m;
        while ((m = pd_list_pop_head(queues[i], kv_msg_t, link)) != NULL) {
            if (m->call != KV_CALL_WAITING) { /* a waiting sender still owns its call (kv_mb_take closed) */
                kv_msg_free(m);
            }
        }
    }
    pthread_mutex_destroy(&mb->mu);
    pthread_cond_destroy(&mb->cv);
}

static struct timespec abs_monotonic(double deadline)
{
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

bool kv_mb_send(kv_mb_t *mb, kv_msg_t *m, double wait_s)
{
    bool answered = true, dropped = false;
    pthread_mutex_lock(&mb->mu);
    m->call = wait_s > 0 ? KV_CALL_WAITING : KV_CALL_NONE;
    if (mb->closed) { /* nobody will take it (and wake_fd may be closed) */
        if (m->call == KV_CALL_WAITING) {
            m->call = KV_CALL_ANSWERED; /* the caller reads its default */
        } else {
            dropped = true;
        }
    } else {
        pd_list_add_tail(&mb->cmds, &m->link);
        if (mb->wake_fd >= 0) {
            uint64_t one = 1;
            ssize_t w = write(mb->wake_fd, &one, sizeof(one)); /* never blocks (EFD_NONBLOCK) */
            (void)w;
        }
    }
    if (m->call != KV_CALL_NONE) {
        struct timespec ts = abs_monotonic(pd_time_now_s() + wait_s);
        int rc = 0;
        while (m->call == KV_CALL_WAITING && rc == 0) {
            rc = pthread_cond_timedwait(&mb->cv, &mb->mu, &ts);
        }
        if (m->call == KV_CALL_WAITING) { /* still queued or being handled: the answerer frees it */
            m->call = KV_CALL_ABANDONED;
            answered = false;
        }
    }
    pthread_mutex_unlock(&mb->mu);
    if (dropped) {
        kv_msg_free(m);
    }
    return answered;
}

void kv_mb_emit(kv_mb_t *mb, kv_msg_t *m)
{
    bool event = m->kind >= KV_EV_REPORT;
    bool orphan = false;
    pthread_mutex_lock(&mb->mu);
    if (event) {
        pd_list_add_tail(&mb->events, &m->link);
    } else if (m->call == KV_CALL_ABANDONED) {
        orphan = true;
    } else {
        m->call = KV_CALL_ANSWERED;
    }
    pthread_cond_broadcast(&mb->cv);
    pthread_mutex_unlock(&mb->mu);
    if (orphan) {
        kv_msg_free(m);
    } else if (event && mb->wake != NULL) {
        mb->wake(mb->wake_arg);
    }
}

void kv_mb_take(kv_mb_t *mb, bool events, pd_list_link_t *out, double deadline, bool close)
{
    pd_list_link_t *q = events ? &mb->events : &mb->cmds;
    pthread_mutex_lock(&mb->mu);
    if (events && deadline > 0) {
        struct timespec ts = abs_monotonic(deadline);
        int rc = 0;
        while (pd_list_is_empty(q) && rc == 0) {
            rc = pthread_cond_timedwait(&mb->cv, &mb->mu, &ts);
        }
    }
    if (close && !events) {
        mb->closed = true;
        kv_msg_t *m, *tmp;
        pd_list_for_each_safe (m, tmp, q, link) {
            if (m->call == KV_CALL_WAITING) { /* answered with its default: the sender frees it */
                pd_list_del(&m->link);
                m->call = KV_CALL_ANSWERED;
            }
        }
        pthread_cond_broadcast(&mb->cv);
    }
    pd_list_splice_tail(out, q);
    pthread_mutex_unlock(&mb->mu);
}

/* ------------------------------------------------------------------ freeing */

kv_report_t *kv_report_new(const char *req_id, bool recving)
{
    kv_report_t *r = calloc(1, sizeof(*r));
    if (r != NULL) {
        r->msg.kind = KV_EV_REPORT;
        snprintf(r->req_id, sizeof(r->req_id), "%s", req_id);
        r->recving = recving;
        r->first_token = -1;
    }
    return r;
}

void kv_report_free(kv_report_t *r)
{
    if (r != NULL) {
        free(r->blocks);
        free(r->grammar_state);
        free(r);
    }
}

void kv_lease_free(kv_lease_t *l)
{
    if (l != NULL) {
        kv_report_free(l->report);
        free(l);
    }
}

void kv_xfer_free(kv_xfer_t *x)
{
    if (x != NULL) {
        kv_report_free(x->report);
        free(x->cancel);
        free(x->local_blocks);
        free(x->remote_blocks);
        free(x->grammar_state);
        free(x);
    }
}

void kv_offer_free(kv_offer_t *o)
{
    if (o != NULL) {
        free(o->blocks);
        free(o);
    }
}

void kv_write_job_free(kv_write_job_t *j)
{
    if (j != NULL) {
        free(j->pages);
        free(j);
    }
}

void kv_msg_free(kv_msg_t *m)
{
    if (m == NULL) {
        return;
    }
    switch (m->kind) {
    case KV_CMD_LOAD:
    case KV_CMD_PUSH_SAVE: kv_xfer_free(pd_container_of(m, kv_xfer_t, msg)); break;
    case KV_CMD_LEASE: kv_lease_free(pd_container_of(m, kv_lease_t, msg)); break;
    case KV_CMD_WRITE_JOB:
    case KV_EV_JOB_DONE: kv_write_job_free(pd_container_of(m, kv_write_job_t, msg)); break;
    case KV_EV_REPORT: kv_report_free(pd_container_of(m, kv_report_t, msg)); break;
    case KV_EV_OFFER: kv_offer_free(pd_container_of(m, kv_offer_t, msg)); break;
    case KV_CMD_STOP: break; /* kv_ctl_t's own */
    case KV_CMD_WRITE_DONE:
        free(pd_container_of(m, kv_notice_t, msg)->grammar_state);
        free(m);
        break;
    case KV_CMD_CANCEL:
    case KV_CMD_TAKE_RESV:
    case KV_CMD_RELEASE:
    case KV_CMD_DRAIN:
    case KV_EV_RESV_GONE: free(m); break; /* each heads its allocation and owns nothing else */
    }
}
