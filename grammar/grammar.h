/* grammar/grammar.h — constrained decoding: a grammar over bytes, a matcher that follows a generation
 * through it, and the token mask of the next step.
 *
 * Every source is compiled to one GBNF text (llama.cpp's grammar syntax, which xgrammar's EBNF also
 * reads) and that text to a pushdown automaton over bytes: JSON Schema (json_schema.c), regular
 * expressions (regex.c), choices, and GBNF itself (gbnf.c). Code points outside ASCII are compiled
 * into their UTF-8 byte sequences, so the matcher sees bytes only and a token that ends inside a
 * character is matched as far as it goes.
 *
 * Threads: a pd_grammar_t is built on any thread and is immutable afterwards, except its runtime
 * (the lazily built automaton states and the mask cache, runtime.c), which only the engine thread
 * touches (one engine thread at a time: a process with two engines gives each its own grammars),
 * and its walks made ahead (pd_grammar_precompute), which any thread pushes whole, once per
 * vocabulary, and the engine thread then reads; references are counted atomically. A matcher
 * belongs to its request (engine thread). */
#ifndef PD_GRAMMAR_GRAMMAR_H
#define PD_GRAMMAR_GRAMMAR_H

#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct pd_grammar pd_grammar_t;

/* Compiles GBNF text (root rule "root"). On failure *out is NULL and err says why (line, rule). */
pd_status_t pd_grammar_from_gbnf(const char *text, size_t len, pd_grammar_t **out, char *err, size_t err_len);

/* GBNF for a JSON Schema (the subset in json_schema.c's header), malloc'd; NULL with err on an
 * unsupported or invalid schema. schema NULL: any JSON object (response_format json_object). */
char *pd_json_schema_to_gbnf(const json_t *schema, char *err, size_t err_len);

/* GBNF for a regular expression (Python re syntax, the subset in regex.c's header), matched in full;
 * malloc'd, NULL with err. */
char *pd_regex_to_gbnf(const char *re, size_t len, char *err, size_t err_len);

/* The GBNF literal for bytes s[len] ("..." with escapes), appended to *buf (malloc'd, grown). */
bool pd_gbnf_append_literal(char **buf, size_t *len, size_t *cap, const char *s, size_t n);

pd_grammar_t *pd_grammar_ref(pd_grammar_t *g);
void pd_grammar_unref(pd_grammar_t *g);

/* XXH3 of the GBNF text the grammar was compiled from (P/D nodes compare it). */
uint64_t pd_grammar_hash(const pd_grammar_t *g);
size_t pd_grammar_num_rules(const pd_grammar_t *g);

/* ------------------------------------------------------------------ vocabulary */

/* The tokens' bytes sorted for the mask walk. excluded[i] (special tokens, holes) are never allowed
 * by the grammar; end ids (EOS, stop tokens) are allowed only where the grammar may end. */
typedef struct pd_gvocab pd_gvocab_t;

pd_status_t pd_gvocab_create(int32_t n, const uint8_t *const *bytes, const uint32_t *lens,
                             const bool *excluded, pd_gvocab_t **out);
void pd_gvocab_free(pd_gvocab_t *v);
int32_t pd_gvocab_size(const pd_gvocab_t *v);

/* ------------------------------------------------------------------ matcher */

/* Where a generation stands in its grammar: one automaton state (small, copied freely). */
typedef struct pd_gmatcher {
    pd_grammar_t *g;
    uint32_t state;   /* 0: dead (the generation left the grammar) */
    uint32_t epoch;   /* the runtime's epoch the state belongs to (a reset renumbers states) */
    int32_t consumed; /* output tokens followed so far (the engine's catch-up counter) */
} pd_gmatcher_t;

/* A matcher at the grammar's start (takes a reference). */
pd_status_t pd_gmatcher_init(pd_gmatcher_t *m, pd_grammar_t *g);
void pd_gmatcher_destroy(pd_gmatcher_t *m);

/* Follows bytes b[n]; false (state unchanged) when the grammar does not allow them here. */
bool pd_gmatcher_accept(pd_gmatcher_t *m, const uint8_t *b, size_t n);

/* The grammar may end here (a complete match). */
bool pd_gmatcher_can_end(const pd_gmatcher_t *m);

/* The grammar must end here: complete and nothing more allowed. */
bool pd_gmatcher_must_end(const pd_gmatcher_t *m);

/* The next token's mask: bit i of mask[(V + 31) / 32] set when token i may come next. end ids
 * (EOS and stop tokens) are set when the grammar may end. */
pd_status_t pd_gmatcher_fill_mask(pd_gmatcher_t *m, const pd_gvocab_t *v, const int32_t *end_ids,
                                  int32_t n_end, uint32_t *mask);

/* Whether the runtime of m's grammar was reset since m's state was taken (the state is gone: the
 * caller replays its tokens from a fresh matcher). */
bool pd_gmatcher_stale(const pd_gmatcher_t *m);

/* The matcher's state as text for another node (P/D: a prefill hands its decode the state after
 * the first token): "g1:HASH:TOKENS:STACKS", the grammar's hash, m->consumed and the parse's stacks
 * (positions in the compiled grammar, which the other node compiles alike from the same request).
 * malloc'd; NULL when m is stale or dead, its stacks exceed 4096 positions, or out of memory (the
 * other node then replays the tokens instead). */
char *pd_gmatcher_export(const pd_gmatcher_t *m);

/* A matcher of g at the state text names (takes a reference; m->consumed from the text).
 * PD_ERR_REJECTED when the text is of another grammar, PD_ERR_PARSE / PD_ERR_OUT_OF_RANGE when it is
 * malformed or names positions where no stack can stand (err says which); m is then zeroed. */
pd_status_t pd_gmatcher_import(pd_gmatcher_t *m, pd_grammar_t *g, const char *text, char *err,
                               size_t err_len);

/* Runtime statistics of a grammar (tests, benchmarks). */
typedef struct pd_grammar_stats {
    uint64_t nodes, states;
    uint64_t masks_computed;   /* states whose mask was made (the others came from the cache) */
    uint64_t masks_cached;     /* masks served from the per-state cache */
    uint64_t masks_truncated;  /* truncated states walked whole (the rest of the computed masks reused one) */
    uint64_t uncertain_walked; /* uncertain tokens walked from full states */
    uint64_t resets;
    uint64_t walks_ahead_used; /* cut-stack walks taken from pd_grammar_precompute's (not walked here) */
} pd_grammar_stats_t;
void pd_grammar_get_stats(const pd_grammar_t *g, pd_grammar_stats_t *out);

/* ------------------------------------------------------------------ walks made ahead */

typedef struct pd_grammar_precompute_opts {
    double budget_s; /* at most this long: the cut stacks left are walked when a generation meets them */
    int refine_over; /* a walk leaving more uncertain tokens is refined a frame deeper (0: 64) */
} pd_grammar_precompute_opts_t;

typedef struct pd_grammar_precompute_stats {
    size_t cut_stacks; /* the grammar's cut stacks (precompute.c's header), refined ones included */
    size_t walked;     /* of them walked before the budget ran out */
    size_t refined;    /* walks refined a frame deeper */
    size_t bytes;      /* what the walks hold */
    bool complete;
    double seconds;
} pd_grammar_precompute_stats_t;

/* Walks the vocabulary v from every cut stack of g ahead of its generations, so that their masks
 * take no whole-vocabulary walk (xgrammar's compile; precompute.c). Any thread, reading only g's
 * compiled form; bounded by opt->budget_s and stopped by *cancel (PD_ERR_CANCELLED, nothing kept).
 * Done at most once per grammar and vocabulary: PD_OK at once when it was. stats may be NULL. */
pd_status_t pd_grammar_precompute(pd_grammar_t *g, const pd_gvocab_t *v,
                                  const pd_grammar_precompute_opts_t *opt, const atomic_bool *cancel,
                                  pd_grammar_precompute_stats_t *stats);

/* Whether pd_grammar_precompute finished for g and v (any thread). */
bool pd_grammar_precomputed(const pd_grammar_t *g, const pd_gvocab_t *v);

#endif
