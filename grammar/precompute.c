/* grammar/precompute.c — the walks of every cut stack a grammar can have, made before its first
 * token (pd_grammar_precompute), so that no mask of a generation walks the whole vocabulary.
 *
 * runtime.c cuts each stack of a state to its top GRAMMAR_CUT_DEPTH frames over OPEN (or over the
 * empty stack, when it is that short) and walks the vocabulary once per cut stack met. Which cut
 * stacks a grammar can have is known from its text: the top frame is a terminal position; the frame
 * below a frame of rule r is a position just past a reference to r (a reference that ends its
 * alternative leaves no frame: the frame below is then one below the referring rule's, a tail call),
 * or the empty stack when r is the root. So every cut stack is enumerated here, over the rules the
 * root reaches, and walked with a scratch runtime of its own; a walk is keyed by its positions,
 * which every runtime of the grammar shares (runtime.c looks it up before walking).
 *
 * This is xgrammar's compile step (its adaptive token mask cache, made per grammar position ahead of
 * the first token), here per cut stack. It takes a whole-vocabulary walk per cut stack: milliseconds
 * to a second at a 128 k vocabulary, so the engine runs it off its thread (engine/grammar_jobs.c).
 * A walk is kept as the accepted tokens' ids, or the others', or bits, whichever is smallest.
 *
 * Threads: pd_grammar_precompute runs on any thread (one per grammar and vocabulary at a time: the
 * engine's job thread) and reads only the grammar's immutable parts; its result is pushed onto
 * g->pre whole and never changes after. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/time.h"
#include "grammar/grammar_impl.h"

#define PRE_EMPTY      UINT32_MAX  /* the empty stack below a frame */
#define PRE_BITS       0           /* a walk's accepted tokens as a vocabulary's bits */
#define PRE_IDS        1           /* ... as their ids */
#define PRE_OTHERS     2           /* ... as the ids of the sorted tokens not accepted */
#define PRE_MAX_BYTES  (64u << 20) /* a grammar's walks at most (the rest are walked as met) */
#define PRE_MAX_STACKS (1u << 16)  /* cut stacks enumerated at most (a hostile grammar has billions) */
#define PRE_REFINE_UNC 64          /* opt->refine_over's default */

struct grammar_pre_walk {
    uint32_t pos[GRAMMAR_CUT_MAX_DEPTH];
    uint8_t n, open, kind, refined; /* refined: its cut stacks a frame deeper are in the table too */
    uint32_t *data;                 /* bits, or ids */
    uint32_t n_data;
    int32_t *unc; /* uncertain tokens' sorted positions */
    uint32_t n_unc;
};
typedef struct grammar_pre_walk pre_walk_t;

struct grammar_pre {
    grammar_pre_t *next;
    uint64_t vocab_id;
    pre_walk_t *w;
    size_t n, cap;
    grammar_idtab_t tab; /* hash → index in w */
    size_t bytes;
    bool full;       /* PRE_MAX_STACKS or the deadline reached while enumerating */
    double deadline; /* pd_time_now_s() past which the work stops (the budget) */
    bool complete;   /* every cut stack walked (else the budget ran out: the rest are walked when met) */
};

static uint64_t walk_hash(const uint32_t *pos, int n, bool open)
{
    uint32_t key[GRAMMAR_CUT_MAX_DEPTH + 1];
    memcpy(key, pos, (size_t)n * 4);
    key[n] = open ? 1u : 0u;
    return pd_hash64(key, (size_t)(n + 1) * 4, 0x9e3779b97f4a7c15ull);
}

static pre_walk_t *pre_find(const grammar_pre_t *p, uint64_t h, const uint32_t *pos, int n, bool open)
{
    const grammar_idtab_t *t = &p->tab;
    for (uint32_t j = t->cap ? (uint32_t)h & (t->cap - 1) : 0; t->cap && t->id[j] != GRAMMAR_ID_NONE;
         j = (j + 1) & (t->cap - 1)) {
        pre_walk_t *w = &p->w[t->id[j]];
        if (t->hash[j] == h && w->n == n && w->open == open && memcmp(w->pos, pos, (size_t)n * 4) == 0) {
            return w;
        }
    }
    return NULL;
}

/* Adds the (unwalked) cut stack to p unless it is there; false when out of memory. */
static bool pre_add(grammar_pre_t *p, const uint32_t *pos, int n, bool open)
{
    uint64_t h = walk_hash(pos, n, open);
    if (pre_find(p, h, pos, n, open) != NULL) {
        return true;
    }
    if (p->n >= PRE_MAX_STACKS) {
        p->full = true; /* the ones enumerated are walked; the rest as generations meet them */
        return true;
    }
    grammar_idtab_t *t = &p->tab;
    if (((t->count + 1) * 2 > t->cap && !grammar_idtab_grow(t)) ||
        pd_array_reserve(&p->w, &p->cap, p->n + 1) != PD_OK) {
        return false;
    }
    pre_walk_t *w = &p->w[p->n];
    memset(w, 0, sizeof(*w));
    memcpy(w->pos, pos, (size_t)n * 4);
    w->n = (uint8_t)n;
    w->open = open;
    uint32_t j = (uint32_t)h & (t->cap - 1);
    while (t->id[j] != GRAMMAR_ID_NONE) {
        j = (j + 1) & (t->cap - 1);
    }
    t->hash[j] = h;
    t->id[j] = (uint32_t)p->n++;
    t->count++;
    return true;
}

/* ------------------------------------------------------------------ which cut stacks */

/* The grammar's rules as the enumeration needs them: each position's rule, the rules the root
 * reaches, and per rule the frames below it (positions past a reference to it) and the rules that
 * refer to it as their alternative's last element (tail calls: the frame below is theirs). */
typedef struct shape {
    const pd_grammar_t *g;
    uint32_t *rule_of;           /* [num_elems] */
    uint8_t *reach;              /* [num_rules] */
    uint32_t *below_off, *below; /* CSR: frames below rule r (PRE_EMPTY: the empty stack) */
    uint32_t *tail_off, *tail;   /* CSR: rules that end an alternative with a reference to r */
    uint32_t *seen, stamp;       /* [num_rules] a DFS's visit marks */
    uint32_t *work;              /* [num_rules] */
} shape_t;

static void shape_free(shape_t *s)
{
    if (s->g == NULL) {
        return;
    }
    free(s->rule_of), free(s->reach), free(s->below_off), free(s->below), free(s->tail_off), free(s->tail);
    free(s->seen), free(s->work);
}

static bool shape_make(shape_t *s, const pd_grammar_t *g)
{
    memset(s, 0, sizeof(*s));
    s->g = g;
    uint32_t R = g->num_rules, E = g->num_elems;
    s->rule_of = malloc(((size_t)E + 1) * 4);
    s->reach = calloc((size_t)R + 1, 1);
    s->below_off = calloc((size_t)R + 2, 4);
    s->tail_off = calloc((size_t)R + 2, 4);
    s->below = malloc(((size_t)E + 2) * 4);
    s->tail = malloc(((size_t)E + 1) * 4);
    s->seen = calloc((size_t)R + 1, 4);
    s->work = malloc(((size_t)R + 1) * 4);
    if (s->rule_of == NULL || s->reach == NULL || s->below_off == NULL || s->tail_off == NULL ||
        s->below == NULL || s->tail == NULL || s->seen == NULL || s->work == NULL) {
        return false;
    }
    for (uint32_t r = 0; r < R; r++) {
        for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
            for (uint32_t p = g->alts[a]; p < E; p++) {
                s->rule_of[p] = r;
                if (g->elems[p] == GE_END) {
                    break;
                }
            }
        }
    }
    size_t nt = 0;
    s->work[nt++] = g->root; /* the rules the root reaches */
    s->reach[g->root] = 1;
    while (nt > 0) {
        uint32_t r = s->work[--nt];
        for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
            for (uint32_t p = g->alts[a]; g->elems[p] != GE_END; p++) {
                uint32_t e = g->elems[p];
                if (GE_IS_RULE(e) && !s->reach[GE_RULE_ID(e)]) {
                    s->reach[GE_RULE_ID(e)] = 1;
                    s->work[nt++] = GE_RULE_ID(e);
                }
            }
        }
    }
    /* count, then fill, each rule's frames below and tail callers (reached referrers only) */
    for (int fill = 0; fill < 2; fill++) {
        uint32_t *bc = calloc((size_t)R + 1, 4), *tc = calloc((size_t)R + 1, 4);
        if (bc == NULL || tc == NULL) {
            free(bc), free(tc);
            return false;
        }
        if (fill) {
            s->below[s->below_off[g->root] + bc[g->root]++] = PRE_EMPTY;
        } else {
            bc[g->root]++;
        }
        for (uint32_t p = 0; p < E; p++) {
            uint32_t e = g->elems[p];
            if (!GE_IS_RULE(e) || !s->reach[s->rule_of[p]]) {
                continue;
            }
            uint32_t r = GE_RULE_ID(e);
            if (g->elems[p + 1] != GE_END) {
                if (fill) {
                    s->below[s->below_off[r] + bc[r]] = p + 1;
                }
                bc[r]++;
            } else {
                if (fill) {
                    s->tail[s->tail_off[r] + tc[r]] = s->rule_of[p];
                }
                tc[r]++;
            }
        }
        if (!fill) {
            for (uint32_t r = 0; r < R; r++) {
                s->below_off[r + 1] = s->below_off[r] + bc[r];
                s->tail_off[r + 1] = s->tail_off[r] + tc[r];
            }
        }
        free(bc), free(tc);
    }
    return true;
}

/* The frames that can be below a frame of rule r (positions, or PRE_EMPTY) into *out (grown). */
static bool frames_below(shape_t *s, uint32_t r, uint32_t **out, size_t *n, size_t *cap)
{
    *n = 0;
    s->stamp++;
    size_t nt = 0;
    s->work[nt++] = r;
    s->seen[r] = s->stamp;
    while (nt > 0) {
        uint32_t x = s->work[--nt];
        size_t k = s->below_off[x + 1] - s->below_off[x];
        if (k > 0 && pd_array_reserve(out, cap, *n + k) != PD_OK) {
            return false;
        }
        if (k > 0) {
            memcpy(*out + *n, s->below + s->below_off[x], k * 4);
            *n += k;
        }
        for (uint32_t i = s->tail_off[x]; i < s->tail_off[x + 1]; i++) {
            uint32_t y = s->tail[i];
            if (s->seen[y] != s->stamp) {
                s->seen[y] = s->stamp;
                s->work[nt++] = y;
            }
        }
    }
    return true;
}

/* Adds every cut stack with top frames pos[0, depth) (the last of rule r) and at most limit frames
 * to p. */
static bool enumerate_from(shape_t *s, grammar_pre_t *p, uint32_t *pos, int depth, uint32_t r, int limit)
{
    if (pd_time_now_s() > p->deadline) {
        p->full = true;
        return true;
    }
    uint32_t *fr = NULL;
    size_t n = 0, cap = 0;
    if (!frames_below(s, r, &fr, &n, &cap)) {
        free(fr);
        return false;
    }
    bool ok = true, added_open = false;
    for (size_t i = 0; i < n && ok && !p->full; i++) {
        if (fr[i] == PRE_EMPTY) {
            ok = pre_add(p, pos, depth, false);
        } else if (depth == limit) {
            ok = added_open || pre_add(p, pos, depth, true); /* cut: whatever is below */
            added_open = true;
        } else {
            pos[depth] = fr[i];
            ok = enumerate_from(s, p, pos, depth + 1, s->rule_of[fr[i]], limit);
        }
    }
    free(fr);
    return ok;
}

static bool enumerate(shape_t *s, grammar_pre_t *p)
{
    const pd_grammar_t *g = s->g;
    bool ok = true;
    for (uint32_t e = 0; ok && !p->full && e < g->num_elems; e++) {
        if (g->elems[e] != GE_END && !GE_IS_RULE(g->elems[e]) && s->reach[s->rule_of[e]]) {
            uint32_t pos[GRAMMAR_CUT_MAX_DEPTH] = {e};
            ok = enumerate_from(s, p, pos, 1, s->rule_of[e], GRAMMAR_CUT_DEPTH);
        }
    }
    return ok;
}

/* Adds the cut stacks one frame deeper than p->w[i] (which is cut over OPEN) to p. */
static bool refine(shape_t *s, grammar_pre_t *p, size_t i)
{
    uint32_t pos[GRAMMAR_CUT_MAX_DEPTH];
    int n = p->w[i].n;
    memcpy(pos, p->w[i].pos, (size_t)n * 4);
    uint32_t *fr = NULL;
    size_t nf = 0, cap = 0;
    bool ok = frames_below(s, s->rule_of[pos[n - 1]], &fr, &nf, &cap);
    for (size_t k = 0; k < nf && ok && !p->full; k++) {
        if (fr[k] != PRE_EMPTY) {
            pos[n] = fr[k];
            ok = enumerate_from(s, p, pos, n + 1, s->rule_of[fr[k]], n + 1);
        }
    }
    free(fr);
    p->w[i].refined = ok;
    return ok;
}

/* ------------------------------------------------------------------ walks */

static size_t popcount_words(const uint32_t *b, size_t words)
{
    size_t c = 0;
    for (size_t i = 0; i < words; i++) {
        c += (size_t)__builtin_popcount(b[i]);
    }
    return c;
}

/* Keeps the walk's accepted bits in w in its smallest form. */
static bool keep_walk(grammar_pre_t *p, pre_walk_t *w, const pd_gvocab_t *v, const uint32_t *bits,
                      const int32_t *unc, size_t n_unc)
{
    size_t words = (size_t)(v->n + 31) / 32, acc = popcount_words(bits, words),
           others = (size_t)v->n_sorted - acc;
    w->kind = acc < words && acc <= others ? PRE_IDS : others < words ? PRE_OTHERS : PRE_BITS;
    w->n_data = (uint32_t)(w->kind == PRE_IDS ? acc : w->kind == PRE_OTHERS ? others : words);
    w->data = malloc((size_t)w->n_data * 4 + 4);
    w->unc = malloc(n_unc * 4 + 4);
    if (w->data == NULL || w->unc == NULL) {
        return false;
    }
    if (w->kind == PRE_BITS) {
        memcpy(w->data, bits, words * 4);
    } else {
        size_t k = 0;
        for (size_t i = 0; i < words; i++) { /* others: sorted tokens whose bit is clear */
            uint32_t m = w->kind == PRE_IDS ? bits[i] : v->sorted_bits[i] & ~bits[i];
            for (; m != 0; m &= m - 1) {
                w->data[k++] = (uint32_t)(i * 32 + (size_t)__builtin_ctz(m));
            }
        }
    }
    if (n_unc > 0) {
        memcpy(w->unc, unc, n_unc * 4);
    }
    w->n_unc = (uint32_t)n_unc;
    p->bytes += sizeof(*w) + (size_t)w->n_data * 4 + n_unc * 4;
    return true;
}

static void walk_free(pre_walk_t *w)
{
    free(w->data);
    free(w->unc);
    w->data = NULL;
    w->unc = NULL;
}

static void pre_free(grammar_pre_t *p)
{
    for (size_t i = 0; p != NULL && i < p->n; i++) {
        walk_free(&p->w[i]);
    }
    if (p != NULL) {
        free(p->w);
        grammar_idtab_free(&p->tab);
        free(p);
    }
}

void grammar_pre_free_all(grammar_pre_t *p)
{
    while (p != NULL) {
        grammar_pre_t *next = p->next;
        pre_free(p);
        p = next;
    }
}

const grammar_pre_t *grammar_pre_of(const pd_grammar_t *g, const pd_gvocab_t *v)
{
    const grammar_pre_t *p = atomic_load_explicit(&((pd_grammar_t *)g)->pre, memory_order_acquire);
    while (p != NULL && p->vocab_id != v->id) {
        p = p->next;
    }
    return p;
}

bool pd_grammar_precomputed(const pd_grammar_t *g, const pd_gvocab_t *v)
{
    return grammar_pre_of(g, v) != NULL;
}

const grammar_pre_walk_t *grammar_pre_find(const grammar_pre_t *p, const uint32_t *pos, int n, bool open)
{
    const pre_walk_t *w = pre_find(p, walk_hash(pos, n, open), pos, n, open);
    return w != NULL && w->data != NULL ? w : NULL; /* NULL: the budget ran out before its walk */
}

bool grammar_pre_refined(const grammar_pre_walk_t *w)
{
    return w->refined;
}

bool grammar_pre_union(const grammar_pre_walk_t *w, const pd_gvocab_t *v, uint32_t *mask, uint32_t *scratch,
                       int32_t **unc, size_t *n_unc, size_t *cap_unc)
{
    if (pd_array_reserve(unc, cap_unc, *n_unc + w->n_unc) != PD_OK) {
        return false;
    }
    size_t words = (size_t)(v->n + 31) / 32;
    if (w->kind == PRE_BITS) {
        for (size_t i = 0; i < words; i++) {
            mask[i] |= w->data[i];
        }
    } else if (w->kind == PRE_IDS) {
        for (uint32_t i = 0; i < w->n_data; i++) {
            mask[w->data[i] >> 5] |= 1u << (w->data[i] & 31);
        }
    } else { /* every sorted token but the listed ones */
        memcpy(scratch, v->sorted_bits, words * 4);
        for (uint32_t i = 0; i < w->n_data; i++) {
            scratch[w->data[i] >> 5] &= ~(1u << (w->data[i] & 31));
        }
        for (size_t i = 0; i < words; i++) {
            mask[i] |= scratch[i];
        }
    }
    if (w->n_unc > 0) {
        memcpy(*unc + *n_unc, w->unc, (size_t)w->n_unc * 4);
        *n_unc += w->n_unc;
    }
    return true;
}

pd_status_t pd_grammar_precompute(pd_grammar_t *g, const pd_gvocab_t *v,
                                  const pd_grammar_precompute_opts_t *opt, const atomic_bool *cancel,
                                  pd_grammar_precompute_stats_t *stats)
{
    double budget_s = opt->budget_s;
    size_t refine_over = opt->refine_over > 0 ? (size_t)opt->refine_over : PRE_REFINE_UNC, refined = 0;
    double t0 = pd_time_now_s();
    if (stats != NULL) {
        memset(stats, 0, sizeof(*stats));
    }
    if (grammar_pre_of(g, v) != NULL) {
        return PD_OK;
    }
    grammar_pre_t *p = calloc(1, sizeof(*p));
    size_t words = (size_t)(v->n + 31) / 32;
    uint32_t *bits = malloc(words * 4 + 4);
    int32_t *unc = NULL;
    size_t n_unc = 0, cap_unc = 0, walked = 0;
    grammar_rt_t *rt = NULL;
    shape_t shape = {0};
    pd_status_t st = PD_ERR_NO_MEMORY;
    if (p != NULL) {
        p->deadline = t0 + budget_s;
    }
    if (p == NULL || bits == NULL || !shape_make(&shape, g) || !enumerate(&shape, p)) {
        goto out;
    }
    p->vocab_id = v->id;
    p->complete = !p->full;
    for (size_t i = 0; i < p->n; i++) {
        if ((cancel != NULL && atomic_load(cancel)) || pd_time_now_s() > p->deadline ||
            p->bytes > PRE_MAX_BYTES) {
            p->complete = false; /* the rest are walked when a generation meets them */
            break;
        }
        if (rt != NULL && grammar_rt_bytes(rt) > PRE_MAX_BYTES / 4) {
            grammar_rt_free(rt); /* states of walks done: a fresh scratch runtime */
            rt = NULL;
        }
        if (rt == NULL && (rt = grammar_rt_scratch(g, v)) == NULL) {
            goto out;
        }
        pre_walk_t *w = &p->w[i];
        memset(bits, 0, words * 4);
        n_unc = 0;
        if (!grammar_rt_walk_cut(rt, g, v, w->pos, w->n, w->open, bits, &unc, &n_unc, &cap_unc) ||
            !keep_walk(p, w, v, bits, unc, n_unc)) {
            walk_free(w);
            goto out;
        }
        walked++;
        /* many uncertain tokens would each be walked from a state in every mask that has this cut
         * stack: walk its stacks a frame deeper too (runtime.c takes the deepest it finds) */
        if (w->open && w->n_unc > refine_over && w->n < GRAMMAR_CUT_MAX_DEPTH) {
            if (!refine(&shape, p, i)) {
                goto out;
            }
            refined++;
        }
    }
    if (cancel != NULL && atomic_load(cancel)) {
        st = PD_ERR_CANCELLED;
        goto out;
    }
    p->complete = p->complete && !p->full; /* refinements may have reached PRE_MAX_STACKS */
    /* push it (another thread may have pushed one for v meanwhile: then both are kept, the first found
     * serves, as they are equal) */
    grammar_pre_t *head = atomic_load_explicit(&g->pre, memory_order_relaxed);
    do {
        p->next = head;
    } while (!atomic_compare_exchange_weak_explicit(&g->pre, &head, p, memory_order_release,
                                                    memory_order_relaxed));
    st = PD_OK;
out:
    if (stats != NULL) {
        stats->cut_stacks = p != NULL ? p->n : 0;
        stats->walked = walked;
        stats->refined = refined;
        stats->bytes = p != NULL ? p->bytes : 0;
        stats->complete = st == PD_OK && p->complete;
        stats->seconds = pd_time_now_s() - t0;
    }
    if (st != PD_OK) {
        pre_free(p);
    } else if (!p->complete) {
        pd_log_warn(
            "grammar %016llx: %zu of its %zu cut stacks walked ahead in %.2f s (the budget); the rest "
            "are walked when a generation meets them",
            (unsigned long long)g->hash, walked, p->n, pd_time_now_s() - t0);
    }
    grammar_rt_free(rt);
    shape_free(&shape);
    free(bits);
    free(unc);
    return st;
}
