/* connector/kv_cost.c — fetch or compute: whether a prompt prefix that another node holds is
 * cheaper to read from it than to compute here (issue 52's peer-to-peer prefix fetch). The model:
 *
 *   fetch   = overhead + bytes / bandwidth   (what this node's completed pull loads measured: an
 *                                             EWMA of their latency outside the page transfer, and
 *                                             of bytes per second while pages moved; before the
 *                                             first, 5 ms and 1 GB/s)
 *   compute = alpha · tokens + beta · the positions those tokens attend to
 *                                            (the engine's fit of its own prompt-heavy steps,
 *                                             pd_connector.compute_cost, scheduler/prefill_cost.h:
 *                                             a prefix's tokens cost more the deeper they sit;
 *                                             unknown: fetch)
 *
 * The control thread records loads (kv_cost_observe), the scheduler half reads the estimate; the two
 * figures are atomics in kv_conn_t, so neither waits. --kv-prefix-fetch always|never overrides. */
#define _GNU_SOURCE
#include <stdatomic.h>

#include "connector/kv_conn.h"
#include "scheduler/prefill_cost.h"

#define KV_COST_ALPHA 0.25 /* EWMA weight of the newest load */

bool pd_kv_fetch_pays(double bytes, double overhead_s, double bytes_per_s, double compute_s, double *fetch_s)
{
    *fetch_s = overhead_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 1e9);
    return compute_s <= 0 || *fetch_s < compute_s;
}

void kv_cost_observe(kv_conn_t *k, size_t bytes, double moved_s, double total_s)
{
    if (bytes < 65536 || moved_s <= 0 || total_s < moved_s) {
        return; /* a tiny load measures its round trips, not the pipe */
    }
    double bw = (double)bytes / moved_s, over = total_s - moved_s;
    bool first = atomic_load_explicit(&k->cost_loads, memory_order_relaxed) == 0;
    double was_bw = atomic_load_explicit(&k->cost_bw, memory_order_relaxed);
    double was_over = atomic_load_explicit(&k->cost_overhead_s, memory_order_relaxed);
    atomic_store_explicit(&k->cost_bw, first ? bw : was_bw + KV_COST_ALPHA * (bw - was_bw),
                          memory_order_relaxed);
    atomic_store_explicit(&k->cost_overhead_s, first ? over : was_over + KV_COST_ALPHA * (over - was_over),
                          memory_order_relaxed);
    atomic_fetch_add_explicit(&k->cost_loads, 1, memory_order_relaxed);
}

bool kv_cost_fetch(const kv_conn_t *k, int32_t from, int32_t to, double *fetch_s, double *compute_s)
{
    int32_t tokens = to - from;
    double blocks = (double)((tokens + k->block_size - 1) / k->block_size);
    double bytes = blocks * (double)k->geom.num_layers * (double)k->geom.page_bytes;
    bool measured = atomic_load_explicit(&k->cost_loads, memory_order_relaxed) > 0;
    double over = measured ? atomic_load_explicit(&k->cost_overhead_s, memory_order_relaxed) : 5e-3;
    double bw = measured ? atomic_load_explicit(&k->cost_bw, memory_order_relaxed) : 1e9;
    if (k->pub.compute_cost == NULL || !pd_prefill_cost_estimate(k->pub.compute_cost, from, to, compute_s)) {
        *compute_s = 0; /* unknown */
    }
    bool pays = pd_kv_fetch_pays(bytes, over, bw, *compute_s, fetch_s);
    if (k->prefix_fetch != KV_PREFIX_FETCH_AUTO) {
        return k->prefix_fetch == KV_PREFIX_FETCH_ALWAYS;
    }
    return pays;
}
