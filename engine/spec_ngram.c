/* engine/spec_ngram.c — the n-gram (prompt lookup) proposer, and its reference. */
#include <string.h>

#include "engine/spec_decode.h"

/* For each end e of a candidate occurrence [e − L, e) (e ≤ n − 1, so a token follows it) the
 * length of the common suffix of tokens[0, e) and tokens[0, n), capped at max_n: the best is the
 * longest, its earliest start on ties. O(n × max_n). */
int32_t pd_ngram_propose(const int32_t *tokens, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                         int32_t *out)
{
    if (n < min_n || k <= 0 || min_n < 1) {
        return 0;
    }
    int32_t best = 0, best_e = 0;
    for (int32_t e = 1; e <= n - 1; e++) {
        int32_t m = 0;
        while (m < max_n && m < e && tokens[e - 1 - m] == tokens[n - 1 - m]) {
            m++;
        }
        if (m > best) { /* a later end with the same length starts later: the first stays */
            best = m;
            best_e = e;
        }
    }
    if (best < min_n) {
        return 0;
    }
    int32_t cnt = n - best_e < k ? n - best_e : k;
    memcpy(out, tokens + best_e, (size_t)cnt * sizeof(int32_t));
    return cnt;
}

int32_t pd_ngram_propose_ref(const int32_t *tokens, int32_t n, int32_t min_n, int32_t max_n, int32_t k,
                             int32_t *out)
{
    if (k <= 0 || min_n < 1) {
        return 0;
    }
    for (int32_t len = max_n; len >= min_n; len--) {
        if (len > n - 1) {
            continue;
        }
        const int32_t *suffix = tokens + n - len;
        for (int32_t j = 0; j + len <= n - 1; j++) {
            if (memcmp(tokens + j, suffix, (size_t)len * sizeof(int32_t)) == 0) {
                int32_t cnt = n - (j + len) < k ? n - (j + len) : k;
                memcpy(out, tokens + j + len, (size_t)cnt * sizeof(int32_t));
                return cnt;
            }
        }
    }
    return 0;
}
