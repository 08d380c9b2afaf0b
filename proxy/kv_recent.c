/* proxy/kv_recent.c — the last routes' block keys per node (see kv_recent.h). */
#include "proxy/kv_recent.h"

#include <stdlib.h>
#include <string.h>

void px_kv_recent_add(px_kv_recent_t *r, const uint64_t *keys, int n, int node, double now)
{
    if (n <= 0) {
        return;
    }
    uint64_t *copy = malloc((size_t)n * sizeof(uint64_t));
    if (copy == NULL) {
        return;
    }
    memcpy(copy, keys, (size_t)n * sizeof(uint64_t));
    int i = r->next;
    free(r->e[i].keys);
    r->e[i].keys = copy;
    r->e[i].num_keys = n;
    r->e[i].node = node;
    r->e[i].t = now;
    r->next = (i + 1) % PX_KV_RECENT;
}

int px_kv_recent_prefix(const px_kv_recent_t *r, const uint64_t *keys, int n, int node, double now,
                        double ttl)
{
    int best = 0;
    for (int i = 0; i < PX_KV_RECENT; i++) {
        if (r->e[i].keys == NULL || r->e[i].node != node || now - r->e[i].t > ttl) {
            continue;
        }
        int m = r->e[i].num_keys < n ? r->e[i].num_keys : n, k = 0;
        while (k < m && r->e[i].keys[k] == keys[k]) {
            k++;
        }
        best = k > best ? k : best;
    }
    return best;
}

void px_kv_recent_free(px_kv_recent_t *r)
{
    for (int i = 0; i < PX_KV_RECENT; i++) {
        free(r->e[i].keys);
    }
    memset(r, 0, sizeof(*r));
}
