/* grammar/runtime.c — the grammar's automaton, built lazily as generations walk it, and the token
 * masks of its states.
 *
 * A parse is a set of stacks (the grammar may be ambiguous). A stack is a node: a position in the
 * grammar (an element to match next) and its parent, the node to return to when the position's
 * alternative ends. Nodes are interned, so equal stacks are one id and stacks share their tails;
 * node 0 is the empty stack (the grammar has matched in full). The closure of a node (the terminal
 * positions it can reach by entering rules and leaving ended alternatives) is computed once per node.
 *
 * A state is an interned, sorted set of terminal nodes; state 0 is dead (no stack left). A state's
 * transition on a byte is computed once and remembered, so the automaton becomes a DFA over the
 * states generations have visited. A token mask is a walk of the vocabulary in sorted order, each
 * token starting from the states of the bytes it shares with the previous one, a dead prefix
 * skipping every token that shares it; masks are cached per state (a string's interior, for
 * instance, is one state whatever was generated inside it).
 *
 * A new state mostly differs from one seen before only deep in its stacks (the same string inside
 * another object), and whether a token fits rarely depends on more than the top frames: as in
 * xgrammar's adaptive token mask cache, each stack of a state is cut to its top GRAMMAR_CUT_DEPTH
 * frames over node 1, OPEN (an unknown rest: any byte, for ever), and that one-stack state's walk
 * sorts tokens into accepted whatever lies below (a path stayed in the top frames), refused
 * whatever lies below (dead even over OPEN), and uncertain (only OPEN survived). The walks are
 * cached per cut stack (a string's characters are the same cut stacks in every string); a state's
 * mask is the union of its stacks' accepted sets plus their uncertain tokens walked from the state
 * itself. When the grammar's walks were made ahead (precompute.c: every cut stack it can have, some
 * refined to deeper cuts with fewer uncertain tokens), a stack's walk is the deepest cut of it found
 * there, and no mask walks the whole vocabulary; what is not found there is walked here.
 *
 * Everything here is the engine thread's. When the runtime outgrows RT_MAX_BYTES it is emptied at
 * the next matcher call (a new epoch); matchers of the old epoch are stale and are replayed. */
#define _GNU_SOURCE /* qsort_r */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/hash.h"
#include "common/log.h"
#include "grammar/grammar_impl.h"

#define RT_MAX_BYTES   (256u << 20)
#define RT_MASK_SLOTS  64
#define RT_NONE        UINT32_MAX
#define RT_MAX_DEPTH   10000 /* closure recursion: a stack this deep ends its generation */
#define RT_OPEN        1u    /* the node standing for a cut-off rest of a stack */
#define RT_TRUNC_SLOTS 256   /* cached walks of cut stacks */

struct grammar_rt {
    uint32_t epoch;
    uint32_t start; /* the start state */
    /* nodes (0: the empty stack) */
    uint32_t *npos, *npar, *clos_off, *clos_len;
    uint8_t *busy;
    size_t n_nodes, cap_nodes, cap_npar, cap_off, cap_len, cap_busy;
    grammar_idtab_t node_tab;
    uint32_t *clos; /* closures' node lists */
    size_t n_clos, cap_clos;
    /* states (0: dead) */
    uint32_t *set_off, *set_len;
    int32_t *mask_slot;
    uint8_t *flags;      /* ST_CAN_END | ST_MUST_END | ST_OPEN_ONLY */
    int32_t *trunc_slot; /* a one-stack cut state's slot in tmasks, or -1 */
    size_t n_states, cap_soff, cap_slen, cap_mslot, cap_flags, cap_tslot;
    uint32_t *set_nodes;
    size_t n_set_nodes, cap_set_nodes;
    grammar_idtab_t state_tab;
    uint32_t **dense; /* [state] its transitions by byte (RT_NONE: not known yet), made at its first */
    size_t cap_dense, n_dense;
    uint32_t *tmp;
    size_t cap_tmp;
    /* masks */
    uint64_t vocab_id; /* the vocabulary the masks are of (pd_gvocab.id; never a pointer: a grammar
                        * outlives an engine and its vocabulary), 0 before the first */
    int32_t vocab_n;
    uint32_t *masks[RT_MASK_SLOTS]; /* [words] each, allocated when first used */
    int32_t slot_state[RT_MASK_SLOTS];
    uint64_t slot_used[RT_MASK_SLOTS], tick;
    uint32_t *walk; /* [max token length + 1] states of the walk */
    /* truncated states' walks: accepted tokens' bits and the uncertain tokens (sorted positions) */
    uint32_t *tmasks[RT_TRUNC_SLOTS]; /* [words] each, allocated when first used */
    int32_t *tuncertain[RT_TRUNC_SLOTS];
    size_t tn_uncertain[RT_TRUNC_SLOTS], tcap_uncertain[RT_TRUNC_SLOTS];
    int32_t tslot_state[RT_TRUNC_SLOTS];
    uint64_t tslot_used[RT_TRUNC_SLOTS];
    int32_t *unc;      /* a mask's uncertain tokens, merged */
    uint32_t *scratch; /* [words] for grammar_pre_union */
    size_t cap_unc;
    const grammar_pre_t *pre; /* the walks made ahead for vocab_id (NULL: none yet; looked up again) */
    uint64_t masks_computed, masks_cached, masks_truncated, uncertain_walked, resets, walks_ahead;
    size_t n_mask_bufs; /* masks and cut-stack walks allocated (each a vocabulary's bits) */
    bool failed;        /* out of memory or too deep: the current operation fails */
};

#define ST_CAN_END   1
#define ST_MUST_END  2
#define ST_OPEN_ONLY 4

/* ------------------------------------------------------------------ id table */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

bool grammar_idtab_grow(grammar_idtab_t *t)
{
    uint32_t cap = t->cap ? t->cap * 2 : 1024;
    uint64_t *h = calloc(cap, sizeof(*h));
    uint32_t *id = malloc((size_t)cap * sizeof(*id));
    if (h == NULL || id == NULL) {
        free(h);
        free(id);
        return false;
    }
    memset(id, 0xff, (size_t)cap * sizeof(*id));
    for (uint32_t i = 0; i < t->cap; i++) {
        if (t->id[i] != GRAMMAR_ID_NONE) {
            uint32_t j = (uint32_t)t->hash[i] & (cap - 1);
            while (id[j] != GRAMMAR_ID_NONE) {
                j = (j + 1) & (cap - 1);
            }
            h[j] = t->hash[i];
            id[j] = t->id[i];
        }
    }
    free(t->hash);
    free(t->id);
    t->hash = h;
    t->id = id;
    t->cap = cap;
    return true;
}

void grammar_idtab_free(grammar_idtab_t *t)
{
    free(t->hash);
    free(t->id);
    memset(t, 0, sizeof(*t));
}

/* ------------------------------------------------------------------ nodes */

static void rt_clear(grammar_rt_t *rt)
{
    free(rt->npos), free(rt->npar), free(rt->clos_off), free(rt->clos_len), free(rt->busy), free(rt->clos);
    free(rt->set_off), free(rt->set_len), free(rt->mask_slot), free(rt->flags), free(rt->set_nodes);
    free(rt->tmp), free(rt->walk), free(rt->trunc_slot);
    for (int i = 0; i < RT_TRUNC_SLOTS; i++) {
        free(rt->tuncertain[i]);
        free(rt->tmasks[i]);
    }
    for (int i = 0; i < RT_MASK_SLOTS; i++) {
        free(rt->masks[i]);
    }
    free(rt->unc);
    free(rt->scratch);
    grammar_idtab_free(&rt->node_tab);
    grammar_idtab_free(&rt->state_tab);
    for (size_t i = 0; i < rt->n_states && rt->dense != NULL; i++) {
        free(rt->dense[i]);
    }
    free(rt->dense);
    uint32_t epoch = rt->epoch;
    uint64_t c = rt->masks_computed, h = rt->masks_cached, r = rt->resets, tr = rt->masks_truncated,
             uw = rt->uncertain_walked, wa = rt->walks_ahead;
    memset(rt, 0, sizeof(*rt));
    rt->epoch = epoch;
    rt->masks_computed = c, rt->masks_cached = h, rt->resets = r, rt->masks_truncated = tr,
    rt->uncertain_walked = uw, rt->walks_ahead = wa;
}

void grammar_rt_free(grammar_rt_t *rt)
{
    if (rt != NULL) {
        rt_clear(rt);
        free(rt);
    }
}

size_t grammar_rt_bytes(const grammar_rt_t *rt)
{
    return rt->n_nodes * 24 + rt->n_clos * 4 + rt->n_states * 20 + rt->n_set_nodes * 4 + rt->n_dense * 1024 +
           (size_t)rt->node_tab.cap * 12 + (size_t)rt->state_tab.cap * 12 +
           rt->n_mask_bufs * (size_t)(rt->vocab_n + 31) / 8;
}

static uint32_t node_get(grammar_rt_t *rt, uint32_t pos, uint32_t par)
{
    uint64_t key = (uint64_t)pos << 32 | par, h = mix64(key);
    grammar_idtab_t *t = &rt->node_tab;
    uint32_t j = t->cap ? (uint32_t)h & (t->cap - 1) : 0;
    for (; t->cap && t->id[j] != RT_NONE; j = (j + 1) & (t->cap - 1)) {
        uint32_t n = t->id[j];
        if (t->hash[j] == h && rt->npos[n] == pos && rt->npar[n] == par) {
            return n; /* found: never allocates */
        }
    }
    if ((t->count + 1) * 2 > t->cap) {
        if (!grammar_idtab_grow(t)) {
            rt->failed = true;
            return RT_NONE;
        }
        for (j = (uint32_t)h & (t->cap - 1); t->id[j] != RT_NONE; j = (j + 1) & (t->cap - 1)) {
        }
    }
    size_t n = rt->n_nodes;
    if (pd_array_reserve(&rt->npos, &rt->cap_nodes, n + 1) != PD_OK ||
        pd_array_reserve(&rt->npar, &rt->cap_npar, n + 1) != PD_OK ||
        pd_array_reserve(&rt->clos_off, &rt->cap_off, n + 1) != PD_OK ||
        pd_array_reserve(&rt->clos_len, &rt->cap_len, n + 1) != PD_OK ||
        pd_array_reserve(&rt->busy, &rt->cap_busy, n + 1) != PD_OK) {
        rt->failed = true;
        return RT_NONE;
    }
    rt->npos[n] = pos;
    rt->npar[n] = par;
    rt->clos_len[n] = RT_NONE;
    rt->busy[n] = 0;
    rt->n_nodes++;
    t->hash[j] = h;
    t->id[j] = (uint32_t)n;
    t->count++;
    return (uint32_t)n;
}

static int u32_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Sorts and dedups v[n] in place; the new length. */
static size_t sort_unique(uint32_t *v, size_t n)
{
    if (n < 2) {
        return n;
    }
    qsort(v, n, sizeof(*v), u32_cmp);
    size_t m = 1;
    for (size_t i = 1; i < n; i++) {
        if (v[i] != v[m - 1]) {
            v[m++] = v[i];
        }
    }
    return m;
}

/* Makes node n's closure known (clos_off/clos_len). */
static void closure(grammar_rt_t *rt, const pd_grammar_t *g, uint32_t n, int depth)
{
    if (rt->failed || rt->clos_len[n] != RT_NONE) {
        return;
    }
    if (rt->busy[n] || depth > RT_MAX_DEPTH) { /* a cycle (refused at compile) or too deep a stack */
        pd_log_warn("grammar: a stack %s; the generation is stopped", rt->busy[n] ? "loops" : "is too deep");
        rt->failed = true;
        return;
    }
    uint32_t pos = rt->npos[n], e = n <= RT_OPEN ? GE_END : g->elems[pos];
    if (n <= RT_OPEN || !GE_IS_RULE(e)) {
        if (n > RT_OPEN && e == GE_END) { /* the alternative ended: go on in the parent */
            uint32_t par = rt->npar[n];
            rt->busy[n] = 1;
            closure(rt, g, par, depth + 1);
            rt->busy[n] = 0;
            if (!rt->failed) {
                rt->clos_off[n] = rt->clos_off[par];
                rt->clos_len[n] = rt->clos_len[par];
            }
            return;
        }
        if (pd_array_reserve(&rt->clos, &rt->cap_clos, rt->n_clos + 1) != PD_OK) {
            rt->failed = true;
            return;
        }
        rt->clos_off[n] = (uint32_t)rt->n_clos;
        rt->clos_len[n] = 1;
        rt->clos[rt->n_clos++] = n; /* a terminal, the empty stack or OPEN */
        return;
    }
    /* the frame to return to; a reference that ends its alternative returns straight to the parent
     * (a tail call: X* as R ::= X R then keeps one frame, so a string's interior is one state) */
    uint32_t r = GE_RULE_ID(e),
             ret = g->elems[pos + 1] == GE_END ? rt->npar[n] : node_get(rt, pos + 1, rt->npar[n]);
    if (ret == RT_NONE) {
        return;
    }
    rt->busy[n] = 1;
    size_t total = 0;
    for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1] && !rt->failed; a++) {
        uint32_t c = node_get(rt, g->alts[a], ret);
        if (c != RT_NONE) {
            closure(rt, g, c, depth + 1);
            total += rt->failed ? 0 : rt->clos_len[c];
        }
    }
    rt->busy[n] = 0;
    if (rt->failed || pd_array_reserve(&rt->clos, &rt->cap_clos, rt->n_clos + total) != PD_OK) {
        rt->failed = true;
        return;
    }
    size_t off = rt->n_clos;
    for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
        uint32_t c = node_get(rt, g->alts[a], ret); /* found: no allocation */
        memcpy(rt->clos + rt->n_clos, rt->clos + rt->clos_off[c], rt->clos_len[c] * sizeof(uint32_t));
        rt->n_clos += rt->clos_len[c];
    }
    size_t m = sort_unique(rt->clos + off, rt->n_clos - off);
    rt->n_clos = off + m;
    rt->clos_off[n] = (uint32_t)off;
    rt->clos_len[n] = (uint32_t)m;
}

/* ------------------------------------------------------------------ states */

/* The state of the sorted node set v[n] (interned); RT_NONE on failure. */
static uint32_t state_get(grammar_rt_t *rt, const uint32_t *v, size_t n)
{
    if (n == 0) {
        return 0;
    }
    uint64_t h = pd_hash64(v, n * sizeof(*v), 0);
    grammar_idtab_t *t = &rt->state_tab;
    if ((t->count + 1) * 2 > t->cap && !grammar_idtab_grow(t)) {
        rt->failed = true;
        return RT_NONE;
    }
    uint32_t j = (uint32_t)h & (t->cap - 1);
    for (; t->id[j] != RT_NONE; j = (j + 1) & (t->cap - 1)) {
        uint32_t s = t->id[j];
        if (t->hash[j] == h && rt->set_len[s] == n && memcmp(rt->set_nodes + rt->set_off[s], v, n * 4) == 0) {
            return s;
        }
    }
    size_t s = rt->n_states;
    if (pd_array_reserve(&rt->set_off, &rt->cap_soff, s + 1) != PD_OK ||
        pd_array_reserve(&rt->set_len, &rt->cap_slen, s + 1) != PD_OK ||
        pd_array_reserve(&rt->mask_slot, &rt->cap_mslot, s + 1) != PD_OK ||
        pd_array_reserve(&rt->flags, &rt->cap_flags, s + 1) != PD_OK ||
        pd_array_reserve(&rt->trunc_slot, &rt->cap_tslot, s + 1) != PD_OK ||
        pd_array_reserve(&rt->dense, &rt->cap_dense, s + 1) != PD_OK ||
        pd_array_reserve(&rt->set_nodes, &rt->cap_set_nodes, rt->n_set_nodes + n) != PD_OK) {
        rt->failed = true;
        return RT_NONE;
    }
    rt->set_off[s] = (uint32_t)rt->n_set_nodes;
    rt->set_len[s] = (uint32_t)n;
    memcpy(rt->set_nodes + rt->n_set_nodes, v, n * 4);
    rt->n_set_nodes += n;
    rt->mask_slot[s] = -1;
    rt->trunc_slot[s] = -1;
    rt->dense[s] = NULL;
    rt->flags[s] = v[0] == 0 ? (uint8_t)(ST_CAN_END | (n == 1 ? ST_MUST_END : 0)) : 0;
    rt->flags[s] |= n == 1 && v[0] == RT_OPEN ? ST_OPEN_ONLY : 0;
    rt->n_states++;
    t->hash[j] = h;
    t->id[j] = (uint32_t)s;
    t->count++;
    return (uint32_t)s;
}

static bool tmp_reserve(grammar_rt_t *rt, size_t n)
{
    if (pd_array_reserve(&rt->tmp, &rt->cap_tmp, n) != PD_OK) {
        rt->failed = true;
        return false;
    }
    return true;
}

/* The state after byte b from state s (0: dead); RT_NONE on failure. */
static uint32_t advance(grammar_rt_t *rt, const pd_grammar_t *g, uint32_t s, uint8_t b)
{
    if (s == 0) {
        return 0;
    }
    if (rt->dense[s] != NULL && rt->dense[s][b] != RT_NONE) {
        return rt->dense[s][b];
    }
    size_t n = 0;
    const uint32_t *set = rt->set_nodes + rt->set_off[s];
    uint32_t len = rt->set_len[s];
    for (uint32_t i = 0; i < len && !rt->failed; i++) {
        uint32_t nd = set[i];
        if (nd == RT_OPEN) { /* an unknown rest takes any byte */
            if (!tmp_reserve(rt, n + 1)) {
                break;
            }
            rt->tmp[n++] = RT_OPEN;
            continue;
        }
        if (nd == 0 || !ge_set_has(g, g->elems[rt->npos[nd]], b)) {
            continue;
        }
        uint32_t nx = node_get(rt, rt->npos[nd] + 1, rt->npar[nd]);
        if (nx == RT_NONE) {
            break;
        }
        closure(rt, g, nx, 0);
        if (rt->failed || !tmp_reserve(rt, n + rt->clos_len[nx])) {
            break;
        }
        set = rt->set_nodes + rt->set_off[s]; /* closure does not move set_nodes, but be plain */
        memcpy(rt->tmp + n, rt->clos + rt->clos_off[nx], rt->clos_len[nx] * 4);
        n += rt->clos_len[nx];
    }
    if (rt->failed) {
        return RT_NONE;
    }
    n = sort_unique(rt->tmp, n);
    uint32_t to = state_get(rt, rt->tmp, n);
    if (to == RT_NONE) {
        return RT_NONE;
    }
    if (rt->dense[s] == NULL && (rt->dense[s] = malloc(256 * sizeof(uint32_t))) != NULL) {
        memset(rt->dense[s], 0xff, 256 * sizeof(uint32_t));
        rt->n_dense++;
    }
    if (rt->dense[s] != NULL) { /* else uncached: computed again next time */
        rt->dense[s][b] = to;
    }
    return to;
}

/* A fresh runtime at the grammar's start. */
static bool rt_start(grammar_rt_t *rt, const pd_grammar_t *g)
{
    rt->failed = false;
    if (node_get(rt, RT_NONE, 0) != 0 ||
        node_get(rt, RT_NONE - 1, 0) != RT_OPEN) { /* positions no element has */
        return false;
    }
    size_t n = 0;
    for (uint32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1]; a++) {
        uint32_t c = node_get(rt, g->alts[a], 0);
        if (c == RT_NONE) {
            return false;
        }
        closure(rt, g, c, 0);
        if (rt->failed || !tmp_reserve(rt, n + rt->clos_len[c])) {
            return false;
        }
        memcpy(rt->tmp + n, rt->clos + rt->clos_off[c], rt->clos_len[c] * 4);
        n += rt->clos_len[c];
    }
    n = sort_unique(rt->tmp, n);
    if (pd_array_reserve(&rt->set_off, &rt->cap_soff, 1) != PD_OK ||
        pd_array_reserve(&rt->set_len, &rt->cap_slen, 1) != PD_OK ||
        pd_array_reserve(&rt->mask_slot, &rt->cap_mslot, 1) != PD_OK ||
        pd_array_reserve(&rt->flags, &rt->cap_flags, 1) != PD_OK ||
        pd_array_reserve(&rt->trunc_slot, &rt->cap_tslot, 1) != PD_OK ||
        pd_array_reserve(&rt->dense, &rt->cap_dense, 1) != PD_OK) {
        return false;
    }
    rt->dense[0] = NULL;
    rt->set_off[0] = rt->set_len[0] = 0; /* state 0: dead */
    rt->mask_slot[0] = -1;
    rt->flags[0] = 0;
    rt->trunc_slot[0] = -1;
    rt->n_states = 1;
    rt->start = state_get(rt, rt->tmp, n);
    return rt->start != RT_NONE && !rt->failed;
}

/* The grammar's runtime, made or emptied as needed (a new epoch then); NULL when out of memory. */
static grammar_rt_t *rt_of(pd_grammar_t *g)
{
    if (g->rt == NULL) {
        g->rt = calloc(1, sizeof(*g->rt));
        if (g->rt == NULL) {
            return NULL;
        }
        g->rt->epoch = 1;
        if (!rt_start(g->rt, g)) {
            grammar_rt_free(g->rt);
            g->rt = NULL;
            return NULL;
        }
    } else if (grammar_rt_bytes(g->rt) > RT_MAX_BYTES || g->rt->failed) {
        grammar_rt_t *rt = g->rt;
        pd_log_info("grammar: its automaton reached %zu MiB; emptied (epoch %u)", grammar_rt_bytes(rt) >> 20,
                    rt->epoch + 1);
        rt_clear(rt);
        rt->epoch++;
        rt->resets++;
        if (!rt_start(rt, g)) {
            rt->failed = true;
            return NULL;
        }
    }
    return g->rt;
}

/* ------------------------------------------------------------------ matcher */

pd_status_t pd_gmatcher_init(pd_gmatcher_t *m, pd_grammar_t *g)
{
    memset(m, 0, sizeof(*m));
    grammar_rt_t *rt = rt_of(g);
    if (rt == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    m->g = pd_grammar_ref(g);
    m->state = rt->start;
    m->epoch = rt->epoch;
    return PD_OK;
}

void pd_gmatcher_destroy(pd_gmatcher_t *m)
{
    pd_grammar_unref(m->g);
    memset(m, 0, sizeof(*m));
}

bool pd_gmatcher_stale(const pd_gmatcher_t *m)
{
    return m->g == NULL || m->g->rt == NULL || m->g->rt->epoch != m->epoch || m->g->rt->failed;
}

bool pd_gmatcher_accept(pd_gmatcher_t *m, const uint8_t *b, size_t n)
{
    if (pd_gmatcher_stale(m)) {
        return false;
    }
    grammar_rt_t *rt = m->g->rt;
    uint32_t s = m->state;
    for (size_t i = 0; i < n && s != 0 && s != RT_NONE; i++) {
        s = advance(rt, m->g, s, b[i]);
    }
    if (s == 0 || s == RT_NONE) {
        return false;
    }
    m->state = s;
    return true;
}

bool pd_gmatcher_can_end(const pd_gmatcher_t *m)
{
    return !pd_gmatcher_stale(m) && (m->g->rt->flags[m->state] & ST_CAN_END);
}

bool pd_gmatcher_must_end(const pd_gmatcher_t *m)
{
    return !pd_gmatcher_stale(m) && (m->g->rt->flags[m->state] & ST_MUST_END);
}

/* ------------------------------------------------------------------ state handover */

/* A handed-over state is text: "g1:HASH:CONSUMED:STACK;STACK;..." with HASH the grammar's hash (16
 * hex digits), CONSUMED the output tokens it has followed and each STACK its positions from the top
 * frame down as decimal numbers joined by ',' (an empty STACK: the grammar matched in full). Stacks
 * are sorted as text, so a state reads the same from every runtime of the grammar, whatever its node
 * and state numbering. */
#define RT_HANDOVER_MAX_POSITIONS 4096

static int str_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

char *pd_gmatcher_export(const pd_gmatcher_t *m)
{
    if (pd_gmatcher_stale(m) || m->state == 0) {
        return NULL;
    }
    const grammar_rt_t *rt = m->g->rt;
    uint32_t len = rt->set_len[m->state];
    const uint32_t *set = rt->set_nodes + rt->set_off[m->state];
    char **stacks = calloc(len, sizeof(*stacks));
    char *out = NULL;
    size_t total = 0, positions = 0;
    bool ok = stacks != NULL;
    for (uint32_t i = 0; ok && i < len; i++) {
        size_t cap = 0, n = 0;
        char *s = NULL;
        ok = pd_array_reserve(&s, &cap, 1) == PD_OK;
        for (uint32_t nd = set[i]; ok && nd > RT_OPEN; nd = rt->npar[nd]) {
            char num[16];
            int w = snprintf(num, sizeof(num), "%s%u", n > 0 ? "," : "", rt->npos[nd]);
            ok = ++positions <= RT_HANDOVER_MAX_POSITIONS &&
                 pd_array_reserve(&s, &cap, n + (size_t)w + 1) == PD_OK;
            if (ok) {
                memcpy(s + n, num, (size_t)w);
                n += (size_t)w;
            }
        }
        if (s != NULL) {
            s[n] = '\0';
        }
        stacks[i] = s;
        total += n + 1;
    }
    if (ok && (out = malloc(total + 64)) != NULL) {
        qsort(stacks, len, sizeof(*stacks), str_cmp);
        size_t n = (size_t)snprintf(out, 64, "g1:%016llx:%d:", (unsigned long long)m->g->hash, m->consumed);
        for (uint32_t i = 0; i < len; i++) {
            size_t l = strlen(stacks[i]);
            memcpy(out + n, stacks[i], l);
            n += l;
            out[n++] = i + 1 < len ? ';' : '\0';
        }
    }
    for (uint32_t i = 0; stacks != NULL && i < len; i++) {
        free(stacks[i]);
    }
    free(stacks);
    return out;
}

/* Reads a decimal uint32 at *p (advanced); false when there is none or it overflows. */
static bool read_u32(const char **p, uint32_t *out)
{
    uint64_t v = 0;
    const char *s = *p;
    if (*s < '0' || *s > '9') {
        return false;
    }
    for (; *s >= '0' && *s <= '9'; s++) {
        v = v * 10 + (uint64_t)(*s - '0');
        if (v > UINT32_MAX) {
            return false;
        }
    }
    *p = s;
    *out = (uint32_t)v;
    return true;
}

pd_status_t pd_gmatcher_import(pd_gmatcher_t *m, pd_grammar_t *g, const char *text, char *err, size_t err_len)
{
    memset(m, 0, sizeof(*m));
    char hash[17];
    snprintf(hash, sizeof(hash), "%016llx", (unsigned long long)g->hash);
    if (strncmp(text, "g1:", 3) != 0 || strlen(text) < 21 || text[19] != ':') {
        snprintf(err, err_len, "not a grammar state (g1:HASH:TOKENS:STACKS)");
        return PD_ERR_PARSE;
    }
    if (strncmp(text + 3, hash, 16) != 0) {
        snprintf(err, err_len, "the state is of another grammar (hash %.16s, this request's %s)", text + 3,
                 hash);
        return PD_ERR_REJECTED;
    }
    const char *p = text + 20;
    uint32_t consumed = 0;
    if (!read_u32(&p, &consumed) || consumed > INT32_MAX || *p++ != ':') {
        snprintf(err, err_len, "the grammar state's token count is not a number");
        return PD_ERR_PARSE;
    }
    grammar_rt_t *rt = rt_of(g);
    if (rt == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    uint32_t *pos = NULL, *nodes = NULL;
    size_t cap_pos = 0, cap_nodes = 0, n_nodes = 0, total = 0;
    pd_status_t st = PD_OK;
    for (bool more = true; more && st == PD_OK;) {
        size_t n = 0; /* this stack's positions, top first */
        while (st == PD_OK && *p != ';' && *p != '\0') {
            uint32_t v;
            if ((n > 0 && *p++ != ',') || !read_u32(&p, &v) || ++total > RT_HANDOVER_MAX_POSITIONS) {
                snprintf(err, err_len, "the grammar state's stacks are malformed (at byte %zu)",
                         (size_t)(p - text));
                st = PD_ERR_PARSE;
            } else if (pd_array_reserve(&pos, &cap_pos, n + 1) != PD_OK) {
                st = PD_ERR_NO_MEMORY;
            } else {
                pos[n++] = v;
            }
        }
        more = *p == ';';
        p += more;
        /* the top frame is at a byte set; each frame below returns past a rule reference to an
         * element (a reference that ended its alternative left no frame: a tail call) */
        for (size_t i = 0; st == PD_OK && i < n; i++) {
            uint32_t v = pos[i], e = v < g->num_elems ? g->elems[v] : GE_END;
            bool fits =
                i == 0 ? e != GE_END && !GE_IS_RULE(e) : e != GE_END && v > 0 && GE_IS_RULE(g->elems[v - 1]);
            if (!fits) {
                snprintf(err, err_len, "the grammar state names position %u, where no %s", v,
                         i == 0 ? "byte is matched" : "rule returns");
                st = PD_ERR_OUT_OF_RANGE;
            }
        }
        uint32_t nd = 0;
        for (size_t i = n; st == PD_OK && i-- > 0;) {
            if ((nd = node_get(rt, pos[i], nd)) == RT_NONE) {
                st = PD_ERR_NO_MEMORY;
            }
        }
        if (st == PD_OK && pd_array_reserve(&nodes, &cap_nodes, n_nodes + 1) == PD_OK) {
            nodes[n_nodes++] = nd;
        } else if (st == PD_OK) {
            st = PD_ERR_NO_MEMORY;
        }
    }
    uint32_t s = 0;
    if (st == PD_OK) {
        n_nodes = sort_unique(nodes, n_nodes);
        s = state_get(rt, nodes, n_nodes);
        st = s == RT_NONE || rt->failed ? PD_ERR_NO_MEMORY : PD_OK;
    }
    free(pos);
    free(nodes);
    if (st != PD_OK) {
        if (st == PD_ERR_NO_MEMORY) {
            snprintf(err, err_len, "out of memory for the grammar state");
        }
        return st;
    }
    m->g = pd_grammar_ref(g);
    m->state = s;
    m->epoch = rt->epoch;
    m->consumed = (int32_t)consumed;
    return PD_OK;
}

/* ------------------------------------------------------------------ masks */

/* The bytes tokens at sorted positions a < b share. */
static uint32_t lcp_of(const pd_gvocab_t *v, int32_t a, int32_t b)
{
    int32_t x = v->order[a], y = v->order[b];
    uint32_t l = 0, m = v->lens[x] < v->lens[y] ? v->lens[x] : v->lens[y];
    while (l < m && v->bytes[x][l] == v->bytes[y][l]) {
        l++;
    }
    return l;
}

static bool unc_push(grammar_rt_t *rt, int32_t **unc, size_t *n, size_t *cap, int32_t i)
{
    if (pd_array_reserve(unc, cap, *n + 1) != PD_OK) {
        rt->failed = true;
        return false;
    }
    (*unc)[(*n)++] = i;
    return true;
}

/* Walks the tokens at sorted positions pos[0, n) (every token when pos is NULL) from state s and
 * sets the accepted ones' bits in mask. With unc (s a truncated state), a token only OPEN accepts
 * goes to *unc (its sorted position) instead; a prefix after which only OPEN lives sends every
 * token that shares it there unwalked, as a refused prefix skips them. */
static void walk_tokens(grammar_rt_t *rt, const pd_grammar_t *g, const pd_gvocab_t *v, uint32_t s,
                        const int32_t *pos, size_t n, uint32_t *mask, int32_t **unc, size_t *n_unc,
                        size_t *cap_unc)
{
    uint32_t *st = rt->walk;
    st[0] = s;
    uint32_t dead_len = UINT32_MAX, open_len = UINT32_MAX;
    int32_t prev = -1;
    for (size_t k = 0; k < n && !rt->failed; k++) {
        int32_t i = pos != NULL ? pos[k] : (int32_t)k;
        uint32_t l = prev < 0 ? 0 : prev == i - 1 ? v->lcp[i] : lcp_of(v, prev, i);
        prev = i;
        if (dead_len <= l) {
            continue; /* shares a prefix the grammar refused */
        }
        if (open_len <= l) {
            unc_push(rt, unc, n_unc, cap_unc, i);
            continue;
        }
        dead_len = open_len = UINT32_MAX;
        int32_t id = v->order[i];
        const uint8_t *b = v->bytes[id];
        uint32_t len = v->lens[id], d = l;
        for (; d < len; d++) {
            uint32_t nx = advance(rt, g, st[d], b[d]);
            if (nx == 0 || nx == RT_NONE) {
                dead_len = d + 1;
                break;
            }
            st[d + 1] = nx;
            if (unc != NULL && (rt->flags[nx] & ST_OPEN_ONLY)) {
                open_len = d + 1;
                break;
            }
        }
        if (open_len != UINT32_MAX) {
            unc_push(rt, unc, n_unc, cap_unc, i);
        } else if (d == len) {
            mask[id >> 5] |= 1u << (id & 31);
        }
        if (pos == NULL && dead_len <= VOCAB_JUMPS) { /* skip the tokens that share the refused prefix */
            int32_t end = v->jump[dead_len][i];
            k = (size_t)end - 1;
            prev = end - 1;
        }
    }
}

/* Node n's stack cut to its top depth frames over OPEN. */
static uint32_t trunc_node(grammar_rt_t *rt, uint32_t n, int depth)
{
    if (n <= RT_OPEN) {
        return n;
    }
    if (depth == 0) {
        return RT_OPEN;
    }
    uint32_t par = trunc_node(rt, rt->npar[n], depth - 1);
    return par == RT_NONE ? RT_NONE : node_get(rt, rt->npos[n], par);
}

static int32_t lru_pick(const uint64_t *used)
{
    int32_t slot = 0;
    for (int i = 1; i < RT_TRUNC_SLOTS; i++) {
        slot = used[i] < used[slot] ? i : slot;
    }
    return slot;
}

/* The walk of the one-stack state t (a stack cut to its top frames), cached: its slot, or -1. */
static int32_t trunc_walk(grammar_rt_t *rt, const pd_grammar_t *g, const pd_gvocab_t *v, uint32_t t)
{
    int32_t ts = rt->trunc_slot[t];
    if (ts >= 0) {
        return ts;
    }
    size_t words = (size_t)(v->n + 31) / 32;
    ts = lru_pick(rt->tslot_used);
    if (rt->tslot_state[ts] >= 0) {
        rt->trunc_slot[rt->tslot_state[ts]] = -1;
    }
    rt->tslot_state[ts] = -1;
    if (rt->tmasks[ts] == NULL) {
        if ((rt->tmasks[ts] = malloc(words * 4)) == NULL) {
            rt->failed = true;
            return -1;
        }
        rt->n_mask_bufs++;
    }
    uint32_t *tm = rt->tmasks[ts];
    memset(tm, 0, words * 4);
    rt->tn_uncertain[ts] = 0;
    walk_tokens(rt, g, v, t, NULL, (size_t)v->n_sorted, tm, &rt->tuncertain[ts], &rt->tn_uncertain[ts],
                &rt->tcap_uncertain[ts]);
    if (rt->failed) {
        return -1;
    }
    rt->tslot_state[ts] = (int32_t)t;
    rt->trunc_slot[t] = ts;
    rt->masks_truncated++;
    return ts;
}

/* The walk made ahead for stack nd: of its cut to the top GRAMMAR_CUT_DEPTH frames, or of the
 * deepest cut the walks made ahead refined it to (fewer uncertain tokens); NULL when they hold
 * none. */
static const grammar_pre_walk_t *stack_walk_ahead(const grammar_rt_t *rt, uint32_t nd)
{
    uint32_t pos[GRAMMAR_CUT_MAX_DEPTH + 1];
    int len = 0;
    for (uint32_t x = nd; x > RT_OPEN && len <= GRAMMAR_CUT_MAX_DEPTH; x = rt->npar[x]) {
        pos[len++] = rt->npos[x]; /* the stack's frames, top first (and one past the deepest cut) */
    }
    int d = len < GRAMMAR_CUT_DEPTH ? len : GRAMMAR_CUT_DEPTH;
    const grammar_pre_walk_t *w = grammar_pre_find(rt->pre, pos, d, len > d), *deeper;
    for (; w != NULL && grammar_pre_refined(w) && d < len && d < GRAMMAR_CUT_MAX_DEPTH; d++, w = deeper) {
        if ((deeper = grammar_pre_find(rt->pre, pos, d + 1, len > d + 1)) == NULL) {
            break; /* not made ahead (the budget ran out): the shallower walk serves */
        }
    }
    return w;
}

/* ------------------------------------------------------------------ walks for precompute.c */

grammar_rt_t *grammar_rt_scratch(const pd_grammar_t *g, const pd_gvocab_t *v)
{
    grammar_rt_t *rt = calloc(1, sizeof(*rt));
    if (rt == NULL || !rt_start(rt, g) || (rt->walk = malloc(((size_t)v->max_len + 1) * 4)) == NULL) {
        grammar_rt_free(rt);
        return NULL;
    }
    return rt;
}

bool grammar_rt_walk_cut(grammar_rt_t *rt, const pd_grammar_t *g, const pd_gvocab_t *v, const uint32_t *pos,
                         int n, bool open, uint32_t *accepted, int32_t **unc, size_t *n_unc, size_t *cap_unc)
{
    uint32_t nd = open ? RT_OPEN : 0;
    for (int i = n; i-- > 0 && nd != RT_NONE;) {
        nd = node_get(rt, pos[i], nd);
    }
    uint32_t t = nd == RT_NONE ? RT_NONE : state_get(rt, &nd, 1);
    if (t != RT_NONE && !rt->failed) {
        walk_tokens(rt, g, v, t, NULL, (size_t)v->n_sorted, accepted, unc, n_unc, cap_unc);
    }
    return t != RT_NONE && !rt->failed;
}

static int i32_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* State s's mask into mask. Each of its stacks, cut to its top frames, has a cached walk (tokens
 * accepted whatever lies below, and the uncertain ones); the mask is the union of the accepted
 * sets, and the uncertain tokens walked from s itself. */
static void compute_mask(grammar_rt_t *rt, const pd_grammar_t *g, const pd_gvocab_t *v, uint32_t s,
                         uint32_t *mask)
{
    size_t words = (size_t)(v->n + 31) / 32;
    memset(mask, 0, words * 4);
    size_t n_unc = 0;
    if (rt->pre == NULL) {
        rt->pre = grammar_pre_of(g, v); /* made ahead since the last look? */
    }
    for (uint32_t k = 0; k < rt->set_len[s] && !rt->failed; k++) {
        uint32_t nd = rt->set_nodes[rt->set_off[s] + k];
        if (nd == 0) {
            continue; /* the end: the caller adds the end ids */
        }
        const grammar_pre_walk_t *w = rt->pre != NULL ? stack_walk_ahead(rt, nd) : NULL;
        if (w != NULL) {
            if (rt->scratch == NULL && (rt->scratch = malloc(words * 4)) == NULL) {
                rt->failed = true;
                return;
            }
            if (!grammar_pre_union(w, v, mask, rt->scratch, &rt->unc, &n_unc, &rt->cap_unc)) {
                rt->failed = true;
                return;
            }
            rt->walks_ahead++;
            continue;
        }
        uint32_t tn = trunc_node(rt, nd, GRAMMAR_CUT_DEPTH);
        uint32_t t = tn == RT_NONE ? RT_NONE : state_get(rt, &tn, 1);
        int32_t ts = t == RT_NONE ? -1 : trunc_walk(rt, g, v, t);
        if (ts < 0) {
            return;
        }
        rt->tslot_used[ts] = ++rt->tick;
        const uint32_t *tm = rt->tmasks[ts];
        for (size_t i = 0; i < words; i++) {
            mask[i] |= tm[i];
        }
        if (pd_array_reserve(&rt->unc, &rt->cap_unc, n_unc + rt->tn_uncertain[ts]) != PD_OK) {
            rt->failed = true;
            return;
        }
        if (rt->tn_uncertain[ts] > 0) {
            memcpy(rt->unc + n_unc, rt->tuncertain[ts], rt->tn_uncertain[ts] * sizeof(int32_t));
            n_unc += rt->tn_uncertain[ts];
        }
    }
    if (n_unc == 0 || rt->failed) {
        return;
    }
    qsort(rt->unc, n_unc, sizeof(int32_t), i32_cmp);
    size_t m = 1;
    for (size_t k = 1; k < n_unc; k++) {
        if (rt->unc[k] != rt->unc[m - 1]) {
            rt->unc[m++] = rt->unc[k];
        }
    }
    walk_tokens(rt, g, v, s, rt->unc, m, mask, NULL, NULL, NULL);
    rt->uncertain_walked += m;
}

pd_status_t pd_gmatcher_fill_mask(pd_gmatcher_t *m, const pd_gvocab_t *v, const int32_t *end_ids,
                                  int32_t n_end, uint32_t *mask)
{
    if (pd_gmatcher_stale(m)) {
        return PD_ERR_STALE;
    }
    grammar_rt_t *rt = m->g->rt;
    if (grammar_rt_bytes(rt) > RT_MAX_BYTES) {
        rt->failed = true; /* emptied at the caller's next pd_gmatcher_init; it replays */
        return PD_ERR_STALE;
    }
    size_t words = (size_t)(v->n + 31) / 32;
    if (rt->vocab_id != v->id) { /* the first mask, or another vocabulary: the caches start over */
        for (int i = 0; i < RT_MASK_SLOTS; i++) {
            free(rt->masks[i]);
            rt->masks[i] = NULL;
        }
        for (int i = 0; i < RT_TRUNC_SLOTS; i++) {
            free(rt->tmasks[i]);
            rt->tmasks[i] = NULL;
        }
        rt->n_mask_bufs = 0;
        free(rt->scratch);
        rt->scratch = NULL;
        free(rt->walk);
        rt->walk = malloc(((size_t)v->max_len + 1) * 4);
        if (rt->walk == NULL) {
            rt->vocab_id = 0;
            return PD_ERR_NO_MEMORY;
        }
        for (int i = 0; i < RT_MASK_SLOTS; i++) {
            rt->slot_state[i] = -1;
            rt->slot_used[i] = 0;
        }
        for (int i = 0; i < RT_TRUNC_SLOTS; i++) {
            rt->tslot_state[i] = -1;
            rt->tslot_used[i] = 0;
        }
        for (size_t s = 0; s < rt->n_states; s++) {
            rt->mask_slot[s] = rt->trunc_slot[s] = -1;
        }
        rt->vocab_id = v->id;
        rt->vocab_n = v->n;
        rt->pre = NULL;
    }
    int32_t slot = rt->mask_slot[m->state];
    if (slot >= 0) {
        rt->masks_cached++;
    } else {
        slot = 0;
        for (int i = 1; i < RT_MASK_SLOTS; i++) {
            slot = rt->slot_used[i] < rt->slot_used[slot] ? i : slot;
        }
        if (rt->slot_state[slot] >= 0) {
            rt->mask_slot[rt->slot_state[slot]] = -1;
        }
        rt->slot_state[slot] = -1;
        if (rt->masks[slot] == NULL) {
            if ((rt->masks[slot] = malloc(words * 4)) == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            rt->n_mask_bufs++;
        }
        compute_mask(rt, m->g, v, m->state, rt->masks[slot]);
        if (rt->failed) {
            return PD_ERR_NO_MEMORY;
        }
        rt->slot_state[slot] = (int32_t)m->state;
        rt->mask_slot[m->state] = slot;
        rt->masks_computed++;
    }
    rt->slot_used[slot] = ++rt->tick;
    memcpy(mask, rt->masks[slot], words * 4);
    if (rt->flags[m->state] & ST_CAN_END) {
        for (int32_t i = 0; i < n_end; i++) {
            if (end_ids[i] >= 0 && end_ids[i] < v->n) {
                mask[end_ids[i] >> 5] |= 1u << (end_ids[i] & 31);
            }
        }
    }
    return PD_OK;
}

void pd_grammar_get_stats(const pd_grammar_t *g, pd_grammar_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    if (g->rt != NULL) {
        out->nodes = g->rt->n_nodes;
        out->states = g->rt->n_states;
        out->masks_computed = g->rt->masks_computed;
        out->masks_cached = g->rt->masks_cached;
        out->masks_truncated = g->rt->masks_truncated;
        out->uncertain_walked = g->rt->uncertain_walked;
        out->resets = g->rt->resets;
        out->walks_ahead_used = g->rt->walks_ahead;
    }
}

/* ------------------------------------------------------------------ vocabulary */

static int tok_cmp(const void *a, const void *b, void *ctx)
{
    const pd_gvocab_t *sort_vocab = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = sort_vocab->lens[x], ly = sort_vocab->lens[y];
    int c = memcmp(sort_vocab->bytes[x], sort_vocab->bytes[y], lx < ly ? lx : ly);
    return c != 0 ? c : lx < ly ? -1 : lx > ly ? 1 : (x > y) - (x < y);
}

pd_status_t pd_gvocab_create(int32_t n, const uint8_t *const *bytes, const uint32_t *lens,
                             const bool *excluded, pd_gvocab_t **out)
{
    *out = NULL;
    pd_gvocab_t *v = calloc(1, sizeof(*v));
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        total += bytes[i] != NULL ? lens[i] : 0;
    }
    if (v == NULL || (v->order = malloc((size_t)n * sizeof(int32_t) + 1)) == NULL ||
        (v->lcp = calloc((size_t)n + 1, sizeof(uint32_t))) == NULL ||
        (v->bytes = calloc((size_t)n + 1, sizeof(*v->bytes))) == NULL ||
        (v->lens = calloc((size_t)n + 1, sizeof(uint32_t))) == NULL ||
        (v->blob = malloc(total + 1)) == NULL) {
        pd_gvocab_free(v);
        return PD_ERR_NO_MEMORY;
    }
    static atomic_uint_fast64_t vocab_ids;
    v->id = atomic_fetch_add(&vocab_ids, 1) + 1;
    v->n = n;
    size_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        v->bytes[i] = v->blob + off;
        if (bytes[i] != NULL) {
            memcpy(v->blob + off, bytes[i], lens[i]);
            v->lens[i] = lens[i];
            off += lens[i];
        }
        if (bytes[i] != NULL && lens[i] > 0 && (excluded == NULL || !excluded[i])) {
            v->order[v->n_sorted++] = i;
            v->max_len = lens[i] > v->max_len ? lens[i] : v->max_len;
        }
    }
    qsort_r(v->order, (size_t)v->n_sorted, sizeof(int32_t), tok_cmp, v);
    if ((v->sorted_bits = calloc((size_t)(n + 31) / 32 + 1, sizeof(uint32_t))) == NULL) {
        pd_gvocab_free(v);
        return PD_ERR_NO_MEMORY;
    }
    for (int32_t i = 0; i < v->n_sorted; i++) {
        v->sorted_bits[v->order[i] >> 5] |= 1u << (v->order[i] & 31);
    }
    for (int32_t i = 1; i < v->n_sorted; i++) {
        int32_t a = v->order[i - 1], b = v->order[i];
        uint32_t l = 0, m = v->lens[a] < v->lens[b] ? v->lens[a] : v->lens[b];
        while (l < m && v->bytes[a][l] == v->bytes[b][l]) {
            l++;
        }
        v->lcp[i] = l;
    }
    for (int d = 1; d <= VOCAB_JUMPS; d++) {
        v->jump[d] = malloc(((size_t)v->n_sorted + 1) * sizeof(int32_t));
        if (v->jump[d] == NULL) {
            pd_gvocab_free(v);
            return PD_ERR_NO_MEMORY;
        }
        for (int32_t i = v->n_sorted - 1; i >= 0; i--) {
            v->jump[d][i] = i + 1 < v->n_sorted && v->lcp[i + 1] >= (uint32_t)d ? v->jump[d][i + 1] : i + 1;
        }
    }
    *out = v;
    return PD_OK;
}

void pd_gvocab_free(pd_gvocab_t *v)
{
    if (v != NULL) {
        free(v->order);
        free(v->lcp);
        free(v->bytes);
        free(v->lens);
        free(v->blob);
        free(v->sorted_bits);
        for (int d = 1; d <= VOCAB_JUMPS; d++) {
            free(v->jump[d]);
        }
        free(v);
    }
}

int32_t pd_gvocab_size(const pd_gvocab_t *v)
{
    return v->n;
}
