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

typedef struct grammar_rt grammar_rt_t; /* runtime.c */

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
};

static inline bool ge_set_has(const pd_grammar_t *g, uint32_t set, uint8_t b)
{
    return (g->sets[set][b >> 6] >> (b & 63)) & 1;
}

void grammar_rt_free(grammar_rt_t *rt);

#endif
