/* server/direct_stream.c — the engine thread writes a plain stream's middle tokens (see the header). */
#define _GNU_SOURCE
#include "server/direct_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"
#include "common/time.h"

/* A chunk's template: literal bytes and the token's holes, in order. */
enum { SEG_LIT, SEG_TEXT, SEG_ID };
typedef struct seg {
    int kind;
    char *lit; /* SEG_LIT */
    size_t len;
} seg_t;
typedef struct tmpl {
    seg_t seg[5]; /* lit [text] lit [id] lit */
    int n;
} tmpl_t;

struct pd_direct_stream {
    bool chat;
    pthread_mutex_t mu;
    bool armed;      /* the engine may write: nothing waits in the loop or the connection */
    int32_t pending; /* outputs the engine left to the loop, not handled yet */
    int fd;          /* a dup of the client's socket, -1 before the first arming and once closed */
    bool closed;
    bool chunked;
    tmpl_t text, empty; /* a token's chunk, and chat's for a token without text (set at the first arming) */
};

/* Writers holding a dup now, and how many may (process-wide: one HTTP front per process). */
static atomic_int g_fds;
static atomic_int g_max_fds = 1024;

void pd_direct_set_max_fds(int n)
{
    atomic_store(&g_max_fds, n > 0 ? n : 1);
}

int pd_direct_fds(void)
{
    return atomic_load(&g_fds);
}

/* A dup of fd within the cap, or -1 (the stream then stays the loop's). */
static int take_fd(int fd)
{
    if (atomic_fetch_add(&g_fds, 1) >= atomic_load(&g_max_fds)) {
        atomic_fetch_sub(&g_fds, 1);
        static atomic_bool said;
        if (!atomic_exchange(&said, true)) {
            pd_log_info("direct stream: %d streams hold a second descriptor, the cap; further streams are "
                        "written by the HTTP loop until some end (said once)",
                        atomic_load(&g_max_fds));
        }
        return -1;
    }
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) {
        atomic_fetch_sub(&g_fds, 1);
    }
    return d;
}

pd_direct_stream_t *pd_direct_new(bool chat)
{
    pd_direct_stream_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return NULL;
    }
    d->chat = chat;
    d->fd = -1;
    pthread_mutex_init(&d->mu, NULL);
    return d;
}

bool pd_direct_counts(const pd_engine_output_t *o)
{
    return !o->delivered || o->rest != NULL;
}

/* A middle token of the stream, whose chunk is the template's. */
static bool plain_token(const pd_engine_output_t *o)
{
    return o->finish_reason == NULL && o->token >= 0 && !o->replayed && !o->handed_over &&
           o->prompt_logprobs == NULL && o->kv_transfer_params == NULL;
}

/* Keeps the bytes of iov[] after the first `sent` as o->rest. Out of memory, the connection is shut
 * down instead: a client that missed part of a chunk would read a broken stream. */
static void keep_rest(pd_engine_output_t *o, int fd, const struct iovec *iov, int n, size_t sent)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        total += iov[i].iov_len;
    }
    if (sent >= total) {
        return;
    }
    o->rest_len = total - sent;
    o->rest = malloc(o->rest_len);
    if (o->rest == NULL) {
        pd_log_error("direct stream: out of memory keeping %zu unsent bytes; closing the stream",
                     o->rest_len);
        o->rest_len = 0;
        shutdown(fd, SHUT_RDWR);
        return;
    }
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        size_t skip = sent < iov[i].iov_len ? sent : iov[i].iov_len;
        sent -= skip;
        memcpy(o->rest + at, (const char *)iov[i].iov_base + skip, iov[i].iov_len - skip);
        at += iov[i].iov_len - skip;
    }
}

/* The bytes of template t for o (enc: the JSON string of its text, id: its token id) as iov[]
 * after the chunk's head; returns the count of iov entries and adds their length to *len. */
static int fill(const tmpl_t *t, const char *enc, const char *id, struct iovec *iov, size_t *len)
{
    for (int i = 0; i < t->n; i++) {
        const seg_t *g = &t->seg[i];
        const char *p = g->kind == SEG_LIT ? g->lit : g->kind == SEG_TEXT ? enc : id;
        iov[i].iov_base = (void *)p;
        iov[i].iov_len = g->kind == SEG_LIT ? g->len : strlen(p);
        *len += iov[i].iov_len;
    }
    return t->n;
}

bool pd_direct_send(pd_direct_stream_t *d, pd_engine_output_t *o)
{
    char *enc = NULL;
    bool with_text = !d->chat || o->text_len > 0; /* chat without text: {"delta":{}} */
    if (plain_token(o) && with_text) {
        json_t *t = pd_json_string_lossy(o->text, o->text_len); /* as the loop's chunk has it */
        enc = t != NULL ? json_dumps(t, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
        json_decref(t);
    }
    char id[16];
    snprintf(id, sizeof(id), "%d", (int)o->token);
    bool sent = false;
    pthread_mutex_lock(&d->mu);
    if (d->armed && d->pending == 0 && plain_token(o) && (enc != NULL || !with_text)) {
        struct iovec iov[8];
        size_t body = 0;
        int n = 1 + fill(with_text ? &d->text : &d->empty, enc, id, iov + 1, &body);
        char head[24];
        int hl = d->chunked ? snprintf(head, sizeof(head), "%zx\r\n", body) : 0;
        iov[0] = (struct iovec){head, (size_t)hl};
        iov[n++] = (struct iovec){(void *)"\r\n", d->chunked ? 2u : 0u};
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(d->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        size_t done = w > 0 ? (size_t)w : 0;
        if (done < (size_t)hl + body + (d->chunked ? 2 : 0)) {
            /* a client that is behind (or gone): the loop queues the rest, and writes from now on
             * until its connection has drained; an error meets the loop's bufferevent there too */
            keep_rest(o, d->fd, iov, n, done);
            d->armed = false;
            d->pending += o->rest != NULL; /* the loop sends it, then may arm again */
        }
        o->delivered = true;
        o->delivered_at = pd_time_now_s();
        sent = true;
    } else {
        d->pending++;
    }
    pthread_mutex_unlock(&d->mu);
    free(enc);
    return sent;
}

static bool lit(tmpl_t *t, const char *a, size_t n)
{
    seg_t *g = &t->seg[t->n++];
    g->kind = SEG_LIT;
    g->len = n;
    g->lit = malloc(n + 1);
    if (g->lit != NULL) {
        memcpy(g->lit, a, n);
        g->lit[n] = '\0';
    }
    return g->lit != NULL;
}

/* The last occurrence of needle in [from, to), or NULL. */
static const char *last_of(const char *from, const char *to, const char *needle)
{
    const char *at = NULL;
    size_t nl = strlen(needle);
    for (const char *p = from; (p = memmem(p, (size_t)(to - p), needle, nl)) != NULL; p++) {
        at = p;
    }
    return at;
}

/* Splits chunk (a middle token's chunk as JSON, made with PD_DIRECT_TEXT_MARKER as its text when
 * text is true and PD_DIRECT_ID_MARKER as its id when it has one) into t, with the event's
 * "data: " and "\n\n". The holes are the markers' last occurrences (the text comes before the
 * token ids, and both after every field a client names). */
static bool split(tmpl_t *t, const char *chunk, bool text)
{
    static const char text_json[] = "\"\\u0001pd-direct\\u0002\"";
    char id_json[24];
    snprintf(id_json, sizeof(id_json), "[%d]", (int)PD_DIRECT_ID_MARKER);
    size_t n = strlen(chunk);
    char *ev = malloc(n + 9);
    if (ev == NULL) {
        return false;
    }
    memcpy(ev, "data: ", 6);
    memcpy(ev + 6, chunk, n);
    memcpy(ev + 6 + n, "\n\n", 3);
    const char *end = ev + n + 8, *at = ev, *th = text ? last_of(ev, end, text_json) : NULL;
    const char *ih = last_of(th != NULL ? th : ev, end, id_json);
    bool ok = !text || th != NULL;
    t->n = 0;
    if (ok && th != NULL) {
        ok = lit(t, at, (size_t)(th - at));
        t->seg[t->n++].kind = SEG_TEXT;
        at = th + strlen(text_json);
    }
    if (ok && ih != NULL) {
        ok = lit(t, at, (size_t)(ih + 1 - at)); /* through the '[' */
        t->seg[t->n++].kind = SEG_ID;
        at = ih + strlen(id_json) - 1; /* from the ']' */
    }
    ok = ok && lit(t, at, (size_t)(end - at));
    free(ev);
    return ok;
}

static void tmpl_free(tmpl_t *t)
{
    for (int i = 0; i < t->n; i++) {
        free(t->seg[i].lit);
    }
    t->n = 0;
}

void pd_direct_handled(pd_direct_stream_t *d)
{
    pthread_mutex_lock(&d->mu);
    if (d->pending > 0) {
        d->pending--;
    }
    d->armed = false;
    pthread_mutex_unlock(&d->mu);
}

void pd_direct_arm(pd_direct_stream_t *d, bool arm, int fd, bool chunked, const char *chunk,
                   const char *empty)
{
    pthread_mutex_lock(&d->mu);
    if (d->pending > 0 || d->closed || !arm) {
        d->armed = false;
        pthread_mutex_unlock(&d->mu);
        return;
    }
    if (d->fd < 0 && chunk != NULL && (!d->chat || empty != NULL)) { /* the first arming */
        tmpl_free(&d->text);
        tmpl_free(&d->empty);
        bool ok = split(&d->text, chunk, true) && (!d->chat || split(&d->empty, empty, false));
        d->fd = ok ? take_fd(fd) : -1;
        d->chunked = chunked;
    }
    d->armed = d->fd >= 0;
    pthread_mutex_unlock(&d->mu);
}

bool pd_direct_has_template(pd_direct_stream_t *d)
{
    pthread_mutex_lock(&d->mu);
    bool has = d->fd >= 0 || d->closed;
    pthread_mutex_unlock(&d->mu);
    return has;
}

void pd_direct_close(pd_direct_stream_t *d)
{
    pthread_mutex_lock(&d->mu);
    d->armed = false;
    d->closed = true;
    if (d->fd >= 0) {
        close(d->fd);
        d->fd = -1;
        atomic_fetch_sub(&g_fds, 1);
    }
    pthread_mutex_unlock(&d->mu);
}

void pd_direct_free(pd_direct_stream_t *d)
{
    if (d == NULL) {
        return;
    }
    pd_direct_close(d);
    pthread_mutex_destroy(&d->mu);
    tmpl_free(&d->text);
    tmpl_free(&d->empty);
    free(d);
}
