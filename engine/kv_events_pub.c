/* engine/kv_events_pub.c — vLLM's KV cache events on ZMQ (see kv_events_pub.h). The engine thread
 * encodes each step's events and queues the batch; the publisher thread sends it, keeps the last
 * buffer_steps batches and answers replay requests. mu guards head/tail/len/stop; the sockets and
 * the replay ring are the publisher thread's (created before it starts, closed after it ends). */
#define _GNU_SOURCE
#include "engine/kv_events_pub.h"

#include <errno.h>
#include <jansson.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/time.h"

typedef struct batch {
    uint64_t seq;
    char *data;
    size_t len;
    struct batch *next;
} batch_t;

struct pd_kv_events_pub {
    pd_kv_events_config_t cfg;
    char medium[8];
    void *ctx, *pub, *replay;
    char ep[256], replay_ep[256];
    int wake_fd; /* eventfd: a batch was queued, or stop */
    pthread_t thread;
    bool started;
    uint64_t next_seq, dropped; /* engine thread */
    pthread_mutex_t mu;
    batch_t *head, *tail;
    int32_t len;
    bool stop;
    batch_t **ring; /* [buffer_steps] sent batches, oldest at ring_first (publisher thread) */
    int32_t ring_first, ring_n;
};

/* ------------------------------------------------------------------ config */

static bool str_member(const json_t *v, char *dst, size_t cap)
{
    const char *s = json_string_value(v);
    if (s == NULL || strlen(s) >= cap) {
        return false;
    }
    snprintf(dst, cap, "%s", s);
    return true;
}

pd_status_t pd_kv_events_config_parse(const char *text, pd_kv_events_config_t *out, char *why, size_t why_len)
{
    memset(out, 0, sizeof(*out));
    snprintf(out->endpoint, sizeof(out->endpoint), "tcp://*:5557");
    out->buffer_steps = 10000;
    out->hwm = 100000;
    out->max_queue_size = 100000;
    if (text == NULL || text[0] == '\0') {
        return PD_OK;
    }
    json_error_t je;
    json_t *o = json_loads(text, 0, &je);
    if (!json_is_object(o)) {
        snprintf(why, why_len, "--kv-events-config is not a JSON object: %s", o == NULL ? je.text : "");
        json_decref(o);
        return PD_ERR_INVALID_ARG;
    }
    const char *key, *bad = NULL;
    json_t *v;
    bool zmq_pub = true;
    json_object_foreach(o, key, v)
    {
        bool ok = true;
        if (strcmp(key, "enable_kv_cache_events") == 0) {
            ok = json_is_boolean(v);
            out->enabled = json_is_true(v);
        } else if (strcmp(key, "publisher") == 0) {
            const char *p = json_string_value(v);
            ok = p != NULL && (strcmp(p, "zmq") == 0 || strcmp(p, "null") == 0);
            zmq_pub = ok && strcmp(p, "zmq") == 0;
        } else if (strcmp(key, "endpoint") == 0) {
            ok = str_member(v, out->endpoint, sizeof(out->endpoint));
        } else if (strcmp(key, "replay_endpoint") == 0) {
            ok = json_is_null(v) || str_member(v, out->replay_endpoint, sizeof(out->replay_endpoint));
        } else if (strcmp(key, "topic") == 0) {
            ok = str_member(v, out->topic, sizeof(out->topic));
        } else if (strcmp(key, "buffer_steps") == 0 || strcmp(key, "hwm") == 0 ||
                   strcmp(key, "max_queue_size") == 0) {
            json_int_t n = json_integer_value(v);
            ok = json_is_integer(v) && n >= 1 && n <= 10000000;
            int32_t *dst = key[0] == 'b'   ? &out->buffer_steps
                           : key[0] == 'h' ? &out->hwm
                                           : &out->max_queue_size;
            *dst = (int32_t)n;
        } else {
            snprintf(why, why_len, "--kv-events-config: unknown key '%s'", key);
            json_decref(o);
            return PD_ERR_INVALID_ARG;
        }
        if (!ok && bad == NULL) {
            bad = key;
        }
    }
    json_decref(o);
    if (bad != NULL) {
        snprintf(why, why_len, "--kv-events-config: '%s' has a bad value", bad);
        return PD_ERR_INVALID_ARG;
    }
    out->enabled = out->enabled && zmq_pub;
    return PD_OK;
}

/* ------------------------------------------------------------------ encoding */

static void pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* The end of the run of events starting at i that forms one event on the wire: stored pool blocks
 * that chain onto each other, a tier's consecutive stores, consecutive removals from one medium, or
 * one clear. */
static size_t run_end(const pd_kv_event_log_t *log, size_t i)
{
    size_t j = i + 1;
    const pd_kv_event_t *e = &log->ev[i];
    if (e->kind == PD_KV_EV_STORED) {
        while (j < log->num && log->ev[j].kind == PD_KV_EV_STORED && log->ev[j].medium == e->medium &&
               (e->medium != PD_KV_MEDIUM_POOL ||
                (log->ev[j].has_parent && log->ev[j].parent == log->ev[j - 1].hash))) {
            j++;
        }
    } else if (e->kind == PD_KV_EV_REMOVED) {
        while (j < log->num && log->ev[j].kind == PD_KV_EV_REMOVED && log->ev[j].medium == e->medium) {
            j++;
        }
    }
    return j;
}

static void pack_run(msgpack_packer *pk, const pd_kv_event_log_t *log, size_t i, size_t j, const char *medium)
{
    const pd_kv_event_t *e = &log->ev[i];
    if (e->kind == PD_KV_EV_CLEARED) {
        msgpack_pack_array(pk, 1);
        pack_str(pk, "AllBlocksCleared");
        return;
    }
    bool stored = e->kind == PD_KV_EV_STORED, pool = e->medium == PD_KV_MEDIUM_POOL;
    msgpack_pack_array(pk, stored ? 7 : 3);
    pack_str(pk, stored ? "BlockStored" : "BlockRemoved");
    msgpack_pack_array(pk, (uint32_t)(j - i));
    for (size_t k = i; k < j; k++) {
        msgpack_pack_uint64(pk, log->ev[k].hash);
    }
    if (stored) {
        if (e->has_parent) {
            msgpack_pack_uint64(pk, e->parent);
        } else {
            msgpack_pack_nil(pk);
        }
        size_t bs = pool ? (size_t)log->block_size : 0; /* a tier's stores carry no token ids */
        msgpack_pack_array(pk, (uint32_t)((j - i) * bs));
        for (size_t k = i; k < j && bs > 0; k++) {
            for (size_t t = 0; t < bs; t++) {
                msgpack_pack_int32(pk, log->tokens[log->ev[k].token_off + t]);
            }
        }
        msgpack_pack_int32(pk, log->block_size);
        msgpack_pack_nil(pk); /* lora_id */
    }
    pack_str(pk, pool ? medium : e->medium == PD_KV_MEDIUM_HOST_TIER ? "CPU_TIER" : "DISK");
}

/* [ts, [event, ...]] into a malloc'd buffer. */
static char *encode(const pd_kv_event_log_t *log, const char *medium, size_t *len)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint32_t runs = 0;
    for (size_t i = 0; i < log->num; i = run_end(log, i)) {
        runs++;
    }
    struct timeval tv;
    gettimeofday(&tv, NULL);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_double(&pk, (double)tv.tv_sec + tv.tv_usec * 1e-6);
    msgpack_pack_array(&pk, runs);
    for (size_t i = 0, j; i < log->num; i = j) {
        j = run_end(log, i);
        pack_run(&pk, log, i, j, medium);
    }
    *len = sb.size;
    return msgpack_sbuffer_release(&sb);
}

/* ------------------------------------------------------------------ publisher thread */

static void seq_bytes(uint64_t seq, unsigned char out[8])
{
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(seq >> (56 - 8 * i));
    }
}

static void remember(pd_kv_events_pub_t *p, batch_t *b)
{
    int32_t cap = p->cfg.buffer_steps;
    if (p->ring_n == cap) {
        batch_t *old = p->ring[p->ring_first];
        free(old->data);
        free(old);
        p->ring[p->ring_first] = b;
        p->ring_first = (p->ring_first + 1) % cap;
    } else {
        p->ring[(p->ring_first + p->ring_n++) % cap] = b;
    }
}

static void send_batch(pd_kv_events_pub_t *p, batch_t *b)
{
    unsigned char sq[8];
    seq_bytes(b->seq, sq);
    /* PUB never blocks: past the high-water mark a slow subscriber loses batches (a seq gap) */
    zmq_send(p->pub, p->cfg.topic, strlen(p->cfg.topic), ZMQ_SNDMORE);
    zmq_send(p->pub, sq, 8, ZMQ_SNDMORE);
    zmq_send(p->pub, b->data, b->len, 0);
}

/* One replay request: [identity, "", start seq] → every buffered batch from it, then the end mark.
 * Anything else is dropped. */
static void serve_replay(pd_kv_events_pub_t *p)
{
    zmq_msg_t f[3];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, p->replay, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 3) {
            f[n++] = m;
        } else {
            zmq_msg_close(&m);
            n = 4; /* too many frames */
        }
    }
    if (n == 3 && zmq_msg_size(&f[1]) == 0 && zmq_msg_size(&f[2]) == 8) {
        const unsigned char *s = zmq_msg_data(&f[2]);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) {
            start = start << 8 | s[i];
        }
        for (int32_t k = 0; k < p->ring_n; k++) {
            batch_t *b = p->ring[(p->ring_first + k) % p->cfg.buffer_steps];
            if (b->seq < start) {
                continue;
            }
            unsigned char sq[8];
            seq_bytes(b->seq, sq);
            zmq_send(p->replay, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(p->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(p->replay, sq, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(p->replay, b->data, b->len, ZMQ_DONTWAIT);
        }
        unsigned char end[8];
        memset(end, 0xff, sizeof(end)); /* -1 */
        zmq_send(p->replay, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(p->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(p->replay, end, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(p->replay, "", 0, ZMQ_DONTWAIT);
    } else {
        pd_log_debug("kv events: dropped a malformed replay request (%d frames)", n);
    }
    for (int i = 0; i < n && i < 3; i++) {
        zmq_msg_close(&f[i]);
    }
}

static void *publisher_thread(void *arg)
{
    pd_kv_events_pub_t *p = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{NULL, p->wake_fd, ZMQ_POLLIN, 0}, {p->replay, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, p->replay != NULL ? 2 : 1, 1000) < 0 && errno != EINTR) {
            pd_log_error("kv events: zmq_poll failed: %s", zmq_strerror(errno));
            break;
        }
        if (items[0].revents & ZMQ_POLLIN) {
            uint64_t v;
            ssize_t r = read(p->wake_fd, &v, sizeof(v));
            (void)r;
        }
        pthread_mutex_lock(&p->mu);
        batch_t *b = p->head;
        p->head = p->tail = NULL;
        p->len = 0;
        bool stop = p->stop;
        pthread_mutex_unlock(&p->mu);
        while (b != NULL) {
            batch_t *next = b->next;
            send_batch(p, b);
            remember(p, b);
            b = next;
        }
        for (int k = 0; p->replay != NULL && k < 16 && (items[1].revents & ZMQ_POLLIN); k++) {
            int ev = 0;
            size_t evl = sizeof(ev);
            zmq_getsockopt(p->replay, ZMQ_EVENTS, &ev, &evl);
            if (!(ev & ZMQ_POLLIN)) {
                break;
            }
            serve_replay(p);
        }
        if (stop) {
            break;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ API */

static bool wants_bind(const char *ep)
{
    return strchr(ep, '*') != NULL || strstr(ep, "::") != NULL || strncmp(ep, "ipc://", 6) == 0 ||
           strncmp(ep, "inproc://", 9) == 0;
}

pd_status_t pd_kv_events_pub_create(const pd_kv_events_config_t *cfg, const char *medium,
                                    pd_kv_events_pub_t **out)
{
    *out = NULL;
    pd_kv_events_pub_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    p->cfg = *cfg;
    snprintf(p->medium, sizeof(p->medium), "%s", medium);
    pthread_mutex_init(&p->mu, NULL);
    p->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    p->ring = calloc((size_t)cfg->buffer_steps, sizeof(batch_t *));
    p->ctx = zmq_ctx_new();
    p->pub = p->ctx != NULL ? zmq_socket(p->ctx, ZMQ_PUB) : NULL;
    if (p->wake_fd < 0 || p->ring == NULL || p->pub == NULL) {
        pd_log_error("kv events: cannot create the publisher");
        pd_kv_events_pub_destroy(p);
        return PD_ERR_NO_MEMORY;
    }
    int hwm = cfg->hwm, zero = 0;
    zmq_setsockopt(p->pub, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(p->pub, ZMQ_LINGER, &zero, sizeof(zero));
    bool bind = wants_bind(cfg->endpoint);
    int rc = bind ? zmq_bind(p->pub, cfg->endpoint) : zmq_connect(p->pub, cfg->endpoint);
    if (rc != 0) {
        pd_log_error("kv events: cannot %s the PUB socket to %s: %s", bind ? "bind" : "connect",
                     cfg->endpoint, zmq_strerror(errno));
        pd_kv_events_pub_destroy(p);
        return PD_ERR_IO;
    }
    size_t l = sizeof(p->ep);
    if (!bind || zmq_getsockopt(p->pub, ZMQ_LAST_ENDPOINT, p->ep, &l) != 0) {
        snprintf(p->ep, sizeof(p->ep), "%s", cfg->endpoint);
    }
    if (cfg->replay_endpoint[0] != '\0') {
        p->replay = zmq_socket(p->ctx, ZMQ_ROUTER);
        if (p->replay != NULL) {
            zmq_setsockopt(p->replay, ZMQ_LINGER, &zero, sizeof(zero));
        }
        if (p->replay == NULL || zmq_bind(p->replay, cfg->replay_endpoint) != 0) {
            pd_log_error("kv events: cannot bind the replay socket to %s: %s", cfg->replay_endpoint,
                         zmq_strerror(errno));
            pd_kv_events_pub_destroy(p);
            return PD_ERR_IO;
        }
        l = sizeof(p->replay_ep);
        if (zmq_getsockopt(p->replay, ZMQ_LAST_ENDPOINT, p->replay_ep, &l) != 0) {
            snprintf(p->replay_ep, sizeof(p->replay_ep), "%s", cfg->replay_endpoint);
        }
    }
    if (pthread_create(&p->thread, NULL, publisher_thread, p) != 0) {
        pd_kv_events_pub_destroy(p);
        return PD_ERR_INTERNAL;
    }
    p->started = true;
    pd_log_info("KV cache events: publishing on %s (replay: %s, topic '%s', %d batches kept)", p->ep,
                p->replay_ep[0] ? p->replay_ep : "none", cfg->topic, cfg->buffer_steps);
    *out = p;
    return PD_OK;
}

void pd_kv_events_pub_publish(pd_kv_events_pub_t *p, const pd_kv_event_log_t *log)
{
    if (p == NULL || log == NULL || log->num == 0) {
        return;
    }
    batch_t *b = calloc(1, sizeof(*b));
    if (b == NULL || (b->data = encode(log, p->medium, &b->len)) == NULL) {
        free(b);
        p->next_seq++; /* a gap subscribers can see */
        return;
    }
    b->seq = p->next_seq++;
    pthread_mutex_lock(&p->mu);
    bool full = p->len >= p->cfg.max_queue_size;
    if (!full) {
        if (p->tail != NULL) {
            p->tail->next = b;
        } else {
            p->head = b;
        }
        p->tail = b;
        p->len++;
    }
    pthread_mutex_unlock(&p->mu);
    if (full) {
        if (p->dropped++ == 0) {
            pd_log_warn("kv events: the publisher's queue is full (%d batches); dropping (subscribers see "
                        "a sequence gap)",
                        p->cfg.max_queue_size);
        }
        free(b->data);
        free(b);
        return;
    }
    uint64_t one = 1;
    ssize_t r = write(p->wake_fd, &one, sizeof(one));
    (void)r;
}

const char *pd_kv_events_pub_endpoint(const pd_kv_events_pub_t *p)
{
    return p != NULL ? p->ep : "";
}

const char *pd_kv_events_pub_replay_endpoint(const pd_kv_events_pub_t *p)
{
    return p != NULL ? p->replay_ep : "";
}

void pd_kv_events_pub_destroy(pd_kv_events_pub_t *p)
{
    if (p == NULL) {
        return;
    }
    if (p->started) {
        pthread_mutex_lock(&p->mu);
        p->stop = true;
        pthread_mutex_unlock(&p->mu);
        uint64_t one = 1;
        ssize_t r = write(p->wake_fd, &one, sizeof(one));
        (void)r;
        pthread_join(p->thread, NULL);
    }
    for (batch_t *b = p->head, *n; b != NULL; b = n) {
        n = b->next;
        free(b->data);
        free(b);
    }
    for (int32_t k = 0; p->ring != NULL && k < p->ring_n; k++) {
        batch_t *b = p->ring[(p->ring_first + k) % p->cfg.buffer_steps];
        free(b->data);
        free(b);
    }
    free(p->ring);
    if (p->pub != NULL) {
        zmq_close(p->pub);
    }
    if (p->replay != NULL) {
        zmq_close(p->replay);
    }
    if (p->ctx != NULL) {
        zmq_ctx_term(p->ctx);
    }
    if (p->wake_fd >= 0) {
        close(p->wake_fd);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}
