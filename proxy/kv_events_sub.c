/* proxy/kv_events_sub.c — pd-proxy subscribes to every node's KV cache events (--kv-events; the
 * endpoints come from the node's /pd/info) and keeps px->kv_index, the nodes each block key is
 * cached on. Batches are applied in sequence order: a subscription starts with a replay from 0,
 * live batches wait while a replay runs, a gap asks for a replay from the first missing batch,
 * and a number that goes back (a restarted node on the same endpoint) clears the node first.
 * What the node's replay buffer no longer holds is lost: the index is then stale, never wrong
 * about a node for long (BlockRemoved and AllBlocksCleared correct it). Loop thread only; the ZMQ
 * sockets are watched through their ZMQ_FD, which is edge-triggered: every callback drains the
 * socket until ZMQ_EVENTS says it is empty. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <errno.h>
#include <event2/event.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"

#define PENDING_MAX      4096 /* live batches kept while a replay runs */
#define REPLAY_TIMEOUT_S 5.0  /* a replay not ended by then is given up (what waited is applied) */

typedef struct pending {
    uint64_t seq;
    char *data;
    size_t len;
} pending_t;

struct px_kv_sub {
    proxy_t *px;
    int node;
    void *sub, *dealer;
    struct event *ev_sub, *ev_dealer;
    char ep[192], replay_ep[192];
    int64_t last_seq; /* last batch applied, -1 none */
    bool replaying;
    double replay_since; /* when the running replay was asked for */
    pending_t pending[PENDING_MAX];
    int num_pending;
    pd_metric_t *blocks_g;
};

/* ------------------------------------------------------------------ batches */

static bool str_is(const msgpack_object *o, const char *s)
{
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

/* Applies one batch's events to the index; false (nothing or part applied) when malformed. */
static bool apply_payload(px_kv_sub_t *s, const char *data, size_t len)
{
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    bool ok = msgpack_unpack_next(&u, data, len, NULL) == MSGPACK_UNPACK_SUCCESS;
    const msgpack_object *b = &u.data;
    ok = ok && b->type == MSGPACK_OBJECT_ARRAY && b->via.array.size >= 2 &&
         b->via.array.ptr[1].type == MSGPACK_OBJECT_ARRAY;
    px_kv_index_t *idx = &s->px->kv_index;
    for (uint32_t i = 0; ok && i < b->via.array.ptr[1].via.array.size; i++) {
        const msgpack_object *e = &b->via.array.ptr[1].via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size < 1) {
            ok = false;
            break;
        }
        const msgpack_object *f = e->via.array.ptr;
        if (str_is(&f[0], "AllBlocksCleared")) {
            px_kv_index_clear_node(idx, s->node);
            continue;
        }
        bool stored = str_is(&f[0], "BlockStored");
        if ((!stored && !str_is(&f[0], "BlockRemoved")) || e->via.array.size < 2 ||
            f[1].type != MSGPACK_OBJECT_ARRAY) {
            continue; /* an event kind this proxy does not index */
        }
        if (stored && e->via.array.size >= 5 && f[4].type == MSGPACK_OBJECT_POSITIVE_INTEGER &&
            f[4].via.u64 > 0 && f[4].via.u64 <= 4096) {
            s->px->kv_block_size = (int)f[4].via.u64; /* one model behind a proxy: one block size */
        }
        /* the medium, last: a node's offload tier ("CPU_TIER", "DISK") is indexed apart from its pool */
        const msgpack_object *m = &f[e->via.array.size - 1];
        bool tier = e->via.array.size >= 3 && (str_is(m, "CPU_TIER") || str_is(m, "DISK"));
        for (uint32_t k = 0; k < f[1].via.array.size; k++) {
            const msgpack_object *h = &f[1].via.array.ptr[k];
            if (h->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
                continue;
            }
            uint64_t key = tier ? px_kv_tier_key(h->via.u64) : h->via.u64;
            if (stored) {
                px_kv_index_add(idx, key, s->node);
            } else {
                px_kv_index_remove(idx, key, s->node);
            }
        }
    }
    msgpack_unpacked_destroy(&u);
    return ok;
}

static void ask_replay(px_kv_sub_t *s, uint64_t from)
{
    unsigned char sq[8];
    for (int i = 0; i < 8; i++) {
        sq[i] = (unsigned char)(from >> (56 - 8 * i));
    }
    if (zmq_send(s->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(s->dealer, sq, 8, ZMQ_DONTWAIT) < 0) {
        pd_log_warn("proxy: kv events of %s: cannot ask for a replay (%s)", s->px->nodes[s->node].url,
                    zmq_strerror(errno));
        return;
    }
    s->replaying = true;
    s->replay_since = pd_time_now_s();
}

static void keep_pending(px_kv_sub_t *s, uint64_t seq, const void *data, size_t len)
{
    if (s->num_pending == PENDING_MAX) {
        return; /* dropped: found as a gap later */
    }
    pending_t *p = &s->pending[s->num_pending];
    if ((p->data = malloc(len > 0 ? len : 1)) == NULL) {
        return;
    }
    memcpy(p->data, data, len);
    p->len = len;
    p->seq = seq;
    s->num_pending++;
}

/* One batch in sequence order (live or replayed). */
static void take_batch(px_kv_sub_t *s, uint64_t seq, const char *data, size_t len, bool replayed)
{
    proxy_t *px = s->px;
    if (!replayed && s->replaying) {
        keep_pending(s, seq, data, len);
        return;
    }
    if (s->last_seq >= 0 && (int64_t)seq <= s->last_seq) {
        if (replayed || seq != 0) {
            if (!replayed && (int64_t)seq < s->last_seq) {
                /* the numbers went back: the node restarted on the same endpoint */
                pd_log_info("proxy: kv events of %s restarted at seq %llu; resynchronising",
                            px->nodes[s->node].url, (unsigned long long)seq);
                px_kv_index_clear_node(&px->kv_index, s->node);
                s->last_seq = -1;
                keep_pending(s, seq, data, len);
                ask_replay(s, 0);
            }
            return; /* already applied */
        }
        px_kv_index_clear_node(&px->kv_index, s->node); /* seq 0 again: restarted, empty */
    } else if (s->last_seq >= 0 && (int64_t)seq > s->last_seq + 1 && !replayed) {
        pd_metric_inc(px->m.kv_gaps, 1);
        pd_log_info("proxy: kv events of %s: batches %lld..%llu missing; asking for a replay",
                    px->nodes[s->node].url, (long long)s->last_seq + 1, (unsigned long long)seq - 1);
        keep_pending(s, seq, data, len);
        ask_replay(s, (uint64_t)s->last_seq + 1);
        return;
    }
    if (!apply_payload(s, data, len)) {
        pd_metric_inc(px->m.kv_malformed, 1);
    }
    s->last_seq = (int64_t)seq;
}

static int cmp_pending(const void *a, const void *b)
{
    const pending_t *x = a, *y = b;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* The replay ended: the live batches that waited, in order. */
static void replay_done(px_kv_sub_t *s)
{
    s->replaying = false;
    qsort(s->pending, (size_t)s->num_pending, sizeof(pending_t), cmp_pending);
    int n = s->num_pending;
    s->num_pending = 0;
    for (int i = 0; i < n; i++) {
        pending_t *p = &s->pending[i];
        if (s->last_seq >= 0 && (int64_t)p->seq > s->last_seq + 1) {
            s->last_seq = (int64_t)p->seq - 1; /* not in the node's buffer any more: stale, go on */
        }
        take_batch(s, p->seq, p->data, p->len, true);
        free(p->data);
    }
}

/* ------------------------------------------------------------------ sockets */

/* Receives one whole message of up to max frames; returns the frame count (0: none waiting), or -1
 * for a message with more frames (dropped). */
static int recv_frames(void *sock, zmq_msg_t *f, int max)
{
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < max) {
            f[n++] = m;
        } else {
            zmq_msg_close(&m);
            n = max + 1;
        }
    }
    if (n > max) {
        for (int i = 0; i < max; i++) {
            zmq_msg_close(&f[i]);
        }
        return -1;
    }
    return n;
}

static uint64_t be64(const void *p)
{
    const unsigned char *b = p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) {
        v = v << 8 | b[i];
    }
    return v;
}

static bool readable(void *sock)
{
    int ev = 0;
    size_t l = sizeof(ev);
    return zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &l) == 0 && (ev & ZMQ_POLLIN);
}

static void on_sub(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    px_kv_sub_t *s = arg;
    while (readable(s->sub)) {
        zmq_msg_t f[3];
        int n = recv_frames(s->sub, f, 3);
        if (n == 3 && zmq_msg_size(&f[1]) == 8) {
            take_batch(s, be64(zmq_msg_data(&f[1])), zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), false);
        } else if (n != 0) {
            pd_metric_inc(s->px->m.kv_malformed, 1);
        }
        for (int i = 0; i < n && i < 3; i++) {
            zmq_msg_close(&f[i]);
        }
    }
}

static void on_dealer(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    px_kv_sub_t *s = arg;
    while (readable(s->dealer)) {
        zmq_msg_t f[3];
        int n = recv_frames(s->dealer, f, 3);
        if (n == 3 && zmq_msg_size(&f[1]) == 8) {
            uint64_t seq = be64(zmq_msg_data(&f[1]));
            if (seq == UINT64_MAX) { /* -1: the end of the replay */
                replay_done(s);
            } else if (s->replaying) {
                take_batch(s, seq, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]), true);
            }
        } else if (n != 0) {
            pd_metric_inc(s->px->m.kv_malformed, 1);
        }
        for (int i = 0; i < n && i < 3; i++) {
            zmq_msg_close(&f[i]);
        }
    }
}

static void sub_close(px_kv_sub_t *s)
{
    if (s->ev_sub != NULL) {
        event_free(s->ev_sub);
    }
    if (s->ev_dealer != NULL) {
        event_free(s->ev_dealer);
    }
    if (s->sub != NULL) {
        zmq_close(s->sub);
    }
    if (s->dealer != NULL) {
        zmq_close(s->dealer);
    }
    for (int i = 0; i < s->num_pending; i++) {
        free(s->pending[i].data);
    }
    s->ev_sub = s->ev_dealer = NULL;
    s->sub = s->dealer = NULL;
    s->num_pending = 0;
}

/* An endpoint as this proxy dials it: a wildcard host is the node's own. */
static void dial_endpoint(const node_t *n, const char *ep, char *out, size_t cap)
{
    const char *host = strstr(ep, "://");
    const char *colon = strrchr(ep, ':');
    if (host != NULL && colon != NULL && colon > host + 3 &&
        (strncmp(host + 3, "0.0.0.0:", 8) == 0 || strncmp(host + 3, "*:", 2) == 0)) {
        snprintf(out, cap, "tcp://%s%s", n->host, colon);
    } else {
        snprintf(out, cap, "%s", ep);
    }
}

void px_kv_events_node_info(proxy_t *px, int node, const char *ep, const char *replay_ep)
{
    if (!px->cfg.kv_events || ep == NULL || replay_ep == NULL || node < 0 || node >= PX_KV_INDEX_NODES) {
        return;
    }
    node_t *n = &px->nodes[node];
    px_kv_sub_t *s = px->kv_subs[node];
    char dial[192], dial_replay[192];
    dial_endpoint(n, ep, dial, sizeof(dial));
    dial_endpoint(n, replay_ep, dial_replay, sizeof(dial_replay));
    if (s != NULL && strcmp(s->ep, dial) == 0 && strcmp(s->replay_ep, dial_replay) == 0) {
        return; /* subscribed already */
    }
    if (s == NULL) {
        s = px->kv_subs[node] = calloc(1, sizeof(*s));
        if (s == NULL) {
            return;
        }
        s->px = px;
        s->node = node;
        char label[224];
        snprintf(label, sizeof(label), "node=%s", n->url);
        s->blocks_g =
            pd_metrics_add(px->metrics, PD_METRIC_GAUGE, "pd_proxy:kv_index_blocks",
                           "KV blocks the node's events say it has cached (--kv-events).", label, NULL, 0);
    }
    sub_close(s);
    px_kv_index_clear_node(&px->kv_index, node); /* a new endpoint: a new process */
    snprintf(s->ep, sizeof(s->ep), "%s", dial);
    snprintf(s->replay_ep, sizeof(s->replay_ep), "%s", dial_replay);
    s->last_seq = -1;
    s->replaying = false;
    s->sub = zmq_socket(px->zmq_ctx, ZMQ_SUB);
    s->dealer = zmq_socket(px->zmq_ctx, ZMQ_DEALER);
    int zero = 0, fd1 = -1, fd2 = -1;
    size_t l = sizeof(int);
    if (s->sub == NULL || s->dealer == NULL || zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "", 0) != 0 ||
        zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
        zmq_setsockopt(s->dealer, ZMQ_LINGER, &zero, sizeof(zero)) != 0 || zmq_connect(s->sub, dial) != 0 ||
        zmq_connect(s->dealer, dial_replay) != 0 || zmq_getsockopt(s->sub, ZMQ_FD, &fd1, &l) != 0 ||
        zmq_getsockopt(s->dealer, ZMQ_FD, &fd2, &l) != 0) {
        pd_log_warn("proxy: cannot subscribe to the kv events of %s at %s: %s", n->url, dial,
                    zmq_strerror(errno));
        sub_close(s);
        s->ep[0] = '\0';
        return;
    }
    s->ev_sub = event_new(px->base, fd1, EV_READ | EV_PERSIST, on_sub, s);
    s->ev_dealer = event_new(px->base, fd2, EV_READ | EV_PERSIST, on_dealer, s);
    event_add(s->ev_sub, NULL);
    event_add(s->ev_dealer, NULL);
    pd_log_info("proxy: subscribed to the kv events of %s at %s (replay %s)", n->url, dial, dial_replay);
    ask_replay(s, 0); /* what happened before this subscription (what the node still keeps) */
    on_sub(-1, 0, s);
    on_dealer(-1, 0, s);
}

void px_kv_events_poll(proxy_t *px)
{
    for (int i = 0; i < px->num_nodes && i < PX_KV_INDEX_NODES; i++) {
        px_kv_sub_t *s = px->kv_subs[i];
        if (s != NULL && s->sub != NULL) {
            on_sub(-1, 0, s); /* edge-triggered fds: a missed edge must not stall a socket */
            on_dealer(-1, 0, s);
            if (s->replaying && pd_time_now_s() - s->replay_since > REPLAY_TIMEOUT_S) {
                pd_log_warn("proxy: kv events of %s: no end of replay after %.0f s; going on without it",
                            px->nodes[i].url, REPLAY_TIMEOUT_S);
                replay_done(s);
            }
            pd_metric_set(s->blocks_g, px->kv_index.per_node[i]);
        }
    }
    pd_metric_set(px->m.kv_entries, px->kv_index.used);
}

void px_kv_events_close(proxy_t *px)
{
    for (int i = 0; i < PX_KV_INDEX_NODES; i++) {
        if (px->kv_subs[i] != NULL) {
            sub_close(px->kv_subs[i]);
            free(px->kv_subs[i]);
            px->kv_subs[i] = NULL;
        }
    }
}
