/* grammar/grammar_impl.h — the compiled grammar, shared by its compiler (gbnf.c) and its runtime
 * (runtime.c). Not a public header.
 *
 * A grammar is rules of alternatives of elements. An element is a byte set (a terminal: one byte out
 * of a 256-bit set), a reference to a rule, or the end of an alternative. Positions index `elems`;
 * an alternative is the positions from its start to its GE_END. */
#ifndef PD_GRAMMAR_GRAMMAR_IMPL_H
#define PD_GRAMMAR_GRAMMAR_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "grammar/grammar.h"

#define GE_END  0xffffffffu
#define GE_RULE 0x80000000u /* | rule id; below it: a byte set's index */

#define GE_IS_RULE(e) ((e) != GE_END && ((e)&GE_RULE) != 0)
#define GE_RULE_ID(e) ((e) & ~GE_RULE)

/* Bounds on what one grammar may compile to (a schema or pattern beyond them is refused). */
#define PD_GRAMMAR_MAX_ELEMS  (1u << 20)
#define PD_GRAMMAR_MAX_REPEAT 10000

/* A growing open-addressing table of uint32 ids keyed by 64-bit hashes (runtime.c's nodes and
 * states, precompute.c's cut stacks); equal hashes are told apart by the caller's check. A slot is
 * free when its id is GRAMMAR_ID_NONE; grow when count + 1 exceeds half of cap. */
#define GRAMMAR_ID_NONE UINT32_MAX
typedef struct grammar_idtab {
    uint64_t *hash;
    uint32_t *id;
    uint32_t cap, count;
} grammar_idtab_t;
bool grammar_idtab_grow(grammar_idtab_t *t); /* doubles cap (1024 at first); false when out of memory */
void grammar_idtab_free(grammar_idtab_t *t);

typedef struct grammar_rt grammar_rt_t;             /* runtime.c */
typedef struct grammar_pre grammar_pre_t;           /* precompute.c */
typedef struct grammar_pre_walk grammar_pre_walk_t; /* one cut stack's, in a grammar_pre_t */

/* A state's stacks are cut to their top GRAMMAR_CUT_DEPTH frames for the mask's walks (runtime.c's
 * header says why); precompute.c makes the walks of every cut stack a grammar can have ahead. */
#define GRAMMAR_CUT_DEPTH     3
#define GRAMMAR_CUT_MAX_DEPTH 8 /* refined cut stacks (precompute.c) */

struct pd_grammar {
    atomic_int refs;
    uint64_t hash;
    uint32_t *elems; /* [num_elems] */
    uint32_t num_elems;
    uint32_t *alts;     /* alternative start positions, rule by rule */
    uint32_t *rule_alt; /* [num_rules + 1]: rule r's alternatives are alts[rule_alt[r], rule_alt[r + 1]) */
    uint32_t num_rules;
    uint64_t (*sets)[4]; /* [num_sets] byte sets */
    uint32_t num_sets;
    uint32_t root;
    grammar_rt_t *rt; /* engine thread only (lazily made) */
    /* cut stacks' walks made ahead, one list entry per vocabulary (precompute.c): pushed by any
     * thread (release), read by the engine thread (acquire); immutable once pushed */
    _Atomic(grammar_pre_t *) pre;
};

/* The tokens' bytes sorted for the mask walk (pd_gvocab_create). */
struct pd_gvocab {
    uint64_t id; /* unique in the process (vocab_ids) */
    int32_t n;   /* vocabulary size */
    int32_t n_sorted;
    int32_t *order; /* [n_sorted] token ids by their bytes */
    uint32_t *lcp;  /* [n_sorted] bytes shared with the previous token */
#define VOCAB_JUMPS 4
    int32_t *jump[VOCAB_JUMPS + 1]; /* jump[d][i]: the first sorted position after i that does not share
                                     * i's first d bytes (d = 1..VOCAB_JUMPS): a prefix refused at
                                     * depth d skips every token that shares it in one step */
    const uint8_t **bytes;
    uint32_t *lens;
    uint32_t max_len;
    uint8_t *blob;
    uint32_t *sorted_bits; /* [(n + 31) / 32] the tokens in order (the ones a grammar can allow) */
};

static inline bool ge_set_has(const pd_grammar_t *g, uint32_t set, uint8_t b)
{
    return (g->sets[set][b >> 6] >> (b & 63)) & 1;
}

void grammar_rt_free(grammar_rt_t *rt);

/* A runtime of g for walking cut stacks over v off the engine thread (precompute.c); NULL when out
 * of memory. Freed with grammar_rt_free. */
grammar_rt_t *grammar_rt_scratch(const pd_grammar_t *g, const pd_gvocab_t *v);
/* Bytes rt holds (a scratch runtime is made anew past a bound). */
size_t grammar_rt_bytes(const grammar_rt_t *rt);

/* Walks the whole vocabulary from the one-stack state pos[0] (top), ..., pos[n - 1] over OPEN (open)
 * or the empty stack: the accepted tokens' bits are set in accepted (zeroed by the caller), the
 * uncertain ones' sorted positions appended to *unc. false when out of memory. */
bool grammar_rt_walk_cut(grammar_rt_t *rt, const pd_grammar_t *g, const pd_gvocab_t *v, const uint32_t *pos,
                         int n, bool open, uint32_t *accepted, int32_t **unc, size_t *n_unc, size_t *cap_unc);

/* The walk made ahead of the cut stack pos[0, n) over OPEN (open) or the empty stack, or NULL. */
const grammar_pre_walk_t *grammar_pre_find(const grammar_pre_t *p, const uint32_t *pos, int n, bool open);
/* Whether the walks made ahead hold w's cut stacks one frame deeper too (sharper walks for a stack
 * that is deeper). */
bool grammar_pre_refined(const grammar_pre_walk_t *w);
/* Adds w's accepted tokens to mask and appends its uncertain ones (sorted positions) to *unc;
 * scratch: a vocabulary's bits to work in. false when out of memory. */
bool grammar_pre_union(const grammar_pre_walk_t *w, const pd_gvocab_t *v, uint32_t *mask, uint32_t *scratch,
                       int32_t **unc, size_t *n_unc, size_t *cap_unc);
/* g's walks made ahead for v, or NULL. */
const grammar_pre_t *grammar_pre_of(const pd_grammar_t *g, const pd_gvocab_t *v);
void grammar_pre_free_all(grammar_pre_t *p);

#endif
