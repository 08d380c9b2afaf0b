/* engine/grammar_jobs.c — see grammar_jobs.h. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "common/log.h"
#include "engine/grammar_jobs.h"

#define JOBS_MAX_FAILED 64 /* grammars given up on, remembered (their requests go on with lazy walks) */

typedef struct job {
    struct job *next;
    pd_grammar_t *g; /* a reference */
} job_t;

struct pd_grammar_jobs {
    const pd_gvocab_t *v;
    double budget_s;
    double delay_s; /* tests: each walk starts this much later */
    void (*done)(void *arg);
    void *arg;
    pthread_mutex_t mu; /* guards everything below */
    pthread_cond_t cv;
    job_t *head, *tail;
    pd_grammar_t *running;                 /* the walk in progress (not a reference: the job's) */
    pd_grammar_t *failed[JOBS_MAX_FAILED]; /* references */
    int n_failed, next_failed;
    bool started, stop;
    pthread_t thread;
    atomic_bool cancel;
    uint64_t walked, gave_up;
    double seconds;
};

static void *jobs_thread(void *arg)
{
    pd_grammar_jobs_t *j = arg;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        while (!j->stop && j->head == NULL) {
            pthread_cond_wait(&j->cv, &j->mu); /* woken by a job or by destroy */
        }
        if (j->delay_s > 0) { /* destroy still ends the wait at once */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            long ns = until.tv_nsec + (long)((j->delay_s - (double)(long)j->delay_s) * 1e9);
            until.tv_sec += (time_t)j->delay_s + ns / 1000000000L;
            until.tv_nsec = ns % 1000000000L;
            while (!j->stop && pthread_cond_timedwait(&j->cv, &j->mu, &until) != ETIMEDOUT) {
            }
        }
        if (j->stop) {
            break;
        }
        job_t *jb = j->head;
        j->head = jb->next;
        j->tail = j->head == NULL ? NULL : j->tail;
        j->running = jb->g;
        pthread_mutex_unlock(&j->mu);
        pd_grammar_precompute_opts_t opt = {.budget_s = j->budget_s};
        pd_grammar_precompute_stats_t st;
        pd_status_t s = pd_grammar_precompute(jb->g, j->v, &opt, &j->cancel, &st);
        if (s == PD_OK) {
            pd_log_info("grammar %016llx: %zu cut stacks walked ahead in %.1f ms (%.2f MiB)%s",
                        (unsigned long long)pd_grammar_hash(jb->g), st.walked, st.seconds * 1e3,
                        (double)st.bytes / (1 << 20), st.complete ? "" : "; the budget ran out");
        } else if (s != PD_ERR_CANCELLED) {
            pd_log_warn(
                "grammar %016llx: its walks could not be made ahead (%s); its requests walk as they go",
                (unsigned long long)pd_grammar_hash(jb->g), pd_status_str(s));
        }
        pthread_mutex_lock(&j->mu);
        j->running = NULL;
        if (s == PD_OK) {
            j->walked++;
            j->seconds += st.seconds;
            pd_grammar_unref(jb->g);
        } else {
            j->gave_up++;
            pd_grammar_unref(j->failed[j->next_failed]); /* the oldest one given up on is tried again */
            j->failed[j->next_failed] = jb->g;
            j->next_failed = (j->next_failed + 1) % JOBS_MAX_FAILED;
            j->n_failed += j->n_failed < JOBS_MAX_FAILED;
        }
        free(jb);
        pthread_mutex_unlock(&j->mu);
        j->done(j->arg);
        pthread_mutex_lock(&j->mu);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

pd_status_t pd_grammar_jobs_create(const pd_gvocab_t *v, double budget_s, double delay_s,
                                   void (*done)(void *arg), void *arg, pd_grammar_jobs_t **out)
{
    pd_grammar_jobs_t *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    j->v = v;
    j->budget_s = budget_s;
    j->delay_s = delay_s;
    j->done = done;
    j->arg = arg;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    atomic_init(&j->cancel, false);
    *out = j;
    return PD_OK;
}

static bool listed(const pd_grammar_jobs_t *j, const pd_grammar_t *g)
{
    if (j->running == g) {
        return true;
    }
    for (const job_t *jb = j->head; jb != NULL; jb = jb->next) {
        if (jb->g == g) {
            return true;
        }
    }
    for (int i = 0; i < j->n_failed; i++) {
        if (j->failed[i] == g) {
            return true;
        }
    }
    return false;
}

bool pd_grammar_jobs_ready(pd_grammar_jobs_t *j, pd_grammar_t *g)
{
    if (pd_grammar_precomputed(g, j->v)) {
        return true;
    }
    pthread_mutex_lock(&j->mu);
    bool ready = false;
    for (int i = 0; i < j->n_failed && !ready; i++) {
        ready = j->failed[i] == g; /* given up on: lazy walks */
    }
    if (!ready && !listed(j, g)) {
        job_t *jb = malloc(sizeof(*jb));
        if (!j->started && jb != NULL) {
            j->started = pthread_create(&j->thread, NULL, jobs_thread, j) == 0;
            if (!j->started) {
                pd_log_error("engine: cannot start the grammar job thread; grammars are walked as they go");
            }
        }
        if (jb == NULL || !j->started) {
            free(jb);
            ready = true;
        } else {
            jb->g = pd_grammar_ref(g);
            jb->next = NULL;
            if (j->tail != NULL) {
                j->tail->next = jb;
            } else {
                j->head = jb;
            }
            j->tail = jb;
            pthread_cond_signal(&j->cv);
        }
    }
    pthread_mutex_unlock(&j->mu);
    return ready;
}

void pd_grammar_jobs_stats(pd_grammar_jobs_t *j, uint64_t *walked, double *seconds, uint64_t *failed)
{
    pthread_mutex_lock(&j->mu);
    *walked = j->walked;
    *seconds = j->seconds;
    *failed = j->gave_up;
    pthread_mutex_unlock(&j->mu);
}

void pd_grammar_jobs_destroy(pd_grammar_jobs_t *j)
{
    if (j == NULL) {
        return;
    }
    pthread_mutex_lock(&j->mu);
    j->stop = true;
    atomic_store(&j->cancel, true);
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (j->started) {
        pthread_join(j->thread, NULL);
    }
    for (job_t *jb = j->head, *n; jb != NULL; jb = n) {
        n = jb->next;
        pd_grammar_unref(jb->g);
        free(jb);
    }
    for (int i = 0; i < JOBS_MAX_FAILED; i++) {
        pd_grammar_unref(j->failed[i]);
    }
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}
