/* proxy/rebalance.c — --rebalance-threshold N: the decode pool kept level by live migration. Each
 * tick, the healthy decode that runs the most of this proxy's resumable streams is compared with the
 * one that runs the fewest (streams its decode has answered: decoding, not waiting for their KV);
 * when it runs N or more streams more, it is asked to migrate half the difference (POST
 * /admin/migrate {"max": k}: its k newest decoding streams, the least KV to move). Each of them ends
 * with a lease on its KV, and migrate.c resumes it on another decode, which reads that KV: the one
 * with the least load at that moment (px_pick_least_loaded), so with more than two decodes the moved
 * streams spread over the lighter ones instead of following the policy's hash. One request at a time,
 * then a tick's pause so that the moved streams are counted where they landed. Loop thread only. A
 * decode that was just started (a scale-out, a restarted node) gets work this way without waiting
 * for the long streams elsewhere to end. */
#define _GNU_SOURCE
#include "proxy/proxy_impl.h"

#include <event2/buffer.h>
#include <event2/http.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/metrics.h"
#include "common/time.h"

static void on_rebalanced(struct evhttp_request *r, void *arg)
{
    proxy_t *px = arg;
    int code = r != NULL ? evhttp_request_get_response_code(r) : 0;
    if (code != 200) {
        pd_log_warn("proxy: rebalancing: /admin/migrate answered %d", code);
    }
    px_release_conn(px, px->rebalance_conn);
    px->rebalance_conn = NULL;
    px->last_rebalance = pd_time_now_s();
}

void px_rebalance(proxy_t *px)
{
    int threshold = px->cfg.rebalance_threshold;
    if (threshold <= 0 || px->rebalance_conn != NULL || px->stopping ||
        pd_time_now_s() - px->last_rebalance < px->cfg.health_interval) {
        return;
    }
    int streams[MAX_NODES] = {0};
    const char *auth[MAX_NODES] = {NULL}; /* a client's key the node takes, when no --node-api-key */
    for (const preq_t *q = px->inflight; q != NULL; q = q->next) {
        if (q->resumable && q->d != NULL && q->d_conn != NULL && q->client != NULL && q->d_events > 0) {
            int i = (int)(q->d - px->nodes);
            streams[i]++;
            auth[i] = q->auth;
        }
    }
    int hi = -1, lo = -1;
    for (int i = 0; i < px->num_nodes; i++) {
        const node_t *n = &px->nodes[i];
        if (n->prefill || !n->healthy || n->removed) {
            continue;
        }
        hi = hi < 0 || streams[i] > streams[hi] ? i : hi;
        lo = lo < 0 || streams[i] < streams[lo] ? i : lo;
    }
    if (hi < 0 || hi == lo || streams[hi] - streams[lo] < threshold) {
        return;
    }
    int k = (streams[hi] - streams[lo]) / 2;
    json_t *body = json_pack("{s:i}", "max", k);
    if (body == NULL) {
        return;
    }
    node_t *n = &px->nodes[hi];
    pd_log_info("proxy: rebalancing: %s runs %d resumable streams, %s %d: migrating its %d newest", n->url,
                streams[hi], px->nodes[lo].url, streams[lo], k);
    px->rebalance_conn = px_upstream(px, n, EVHTTP_REQ_POST, "/admin/migrate", auth[hi], NULL, body,
                                     on_rebalanced, NULL, NULL, px);
    json_decref(body);
    if (px->rebalance_conn != NULL) {
        pd_metric_inc(px->m.rebalances, 1);
    }
    px->last_rebalance = pd_time_now_s();
}
