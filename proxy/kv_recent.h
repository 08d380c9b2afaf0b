/* proxy/kv_recent.h — the prompts the proxy routed in the last seconds, per node: blocks a node
 * will hold once it computes them, before its KV cache events say so. Without it, a burst of
 * requests over one new prefix spreads over every prefill while the first is still queued there
 * (each finds the index empty), and each prefill computes the prefix. A ring of the last
 * PX_KV_RECENT routes; entries older than the ttl count for nothing. Loop thread only. */
#ifndef PD_PROXY_KV_RECENT_H
#define PD_PROXY_KV_RECENT_H

#include <stdint.h>

#define PX_KV_RECENT 256

typedef struct px_kv_recent {
    struct {
        uint64_t *keys; /* the prompt's block keys (owned) */
        int num_keys;
        int node;
        double t; /* when it was routed */
    } e[PX_KV_RECENT];
    int next;
} px_kv_recent_t;

/* Records that keys[0..n) were sent to node at time now (a copy; the oldest entry goes). Out of
 * memory records nothing. */
void px_kv_recent_add(px_kv_recent_t *r, const uint64_t *keys, int n, int node, double now);
/* The longest prefix of keys[0..n) sent to node within ttl seconds before now. */
int px_kv_recent_prefix(const px_kv_recent_t *r, const uint64_t *keys, int n, int node, double now,
                        double ttl);
void px_kv_recent_free(px_kv_recent_t *r);

#endif
