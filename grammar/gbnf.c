/* grammar/gbnf.c — GBNF text → a grammar over bytes.
 *
 * The syntax is llama.cpp's: `name ::= alternatives`, one rule per line (a rule goes on over new
 * lines inside parentheses and after `|`), `#` comments; elements are "literals", [character
 * classes] (ranges, `^` negation), `.` (any character), rule names and ( groups ), each with an
 * optional `*`, `+`, `?`, `{m}`, `{m,}` or `{m,n}`. Escapes: \n \r \t \\ \" \[ \] \- \^ \xHH \uHHHH
 * \UHHHHHHHH. The start rule is `root`.
 *
 * Characters are code points; a class of non-ASCII code points becomes a rule whose alternatives
 * are its UTF-8 byte sequences (the byte-range split of Russ Cox's utf8-ranges), so the automaton
 * reads bytes. Repetitions become right-recursive helper rules. Left recursion (which a top-down
 * automaton cannot follow) and undefined rules are refused with the rule's name. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/hash.h"
#include "grammar/grammar_impl.h"

typedef struct u32vec {
    uint32_t *v;
    size_t n, cap;
} u32vec_t;

typedef struct brule {
    char *name; /* NULL: a helper rule */
    u32vec_t *alts;
    size_t n_alts, cap_alts;
    bool defined;
    int line; /* first reference or definition */
} brule_t;

typedef struct builder {
    const char *src, *p, *end;
    int line;
    brule_t *rules;
    size_t n_rules, cap_rules;
    uint64_t (*sets)[4];
    size_t n_sets, cap_sets;
    size_t n_elems; /* across every alternative, against PD_GRAMMAR_MAX_ELEMS */
    char *err;
    size_t err_len;
    bool failed;
    int depth;
} builder_t;

static bool fail(builder_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static bool fail(builder_t *b, const char *fmt, ...)
{
    if (!b->failed && b->err_len > 0) {
        int n = snprintf(b->err, b->err_len, "grammar line %d: ", b->line);
        va_list ap;
        va_start(ap, fmt);
        if (n >= 0 && (size_t)n < b->err_len) {
            vsnprintf(b->err + n, b->err_len - (size_t)n, fmt, ap);
        }
        va_end(ap);
    }
    b->failed = true;
    return false;
}

static bool vec_push(builder_t *b, u32vec_t *v, uint32_t x)
{
    if (++b->n_elems > PD_GRAMMAR_MAX_ELEMS) {
        return fail(b, "the grammar is too large (over %u elements)", PD_GRAMMAR_MAX_ELEMS);
    }
    if (pd_array_reserve(&v->v, &v->cap, v->n + 1) != PD_OK) {
        return fail(b, "out of memory");
    }
    v->v[v->n++] = x;
    return true;
}

/* A new rule (named, or a helper when name is NULL); its id, or UINT32_MAX. */
static uint32_t rule_new(builder_t *b, const char *name, size_t len)
{
    if (b->n_rules >= GE_RULE - 1 || pd_array_reserve(&b->rules, &b->cap_rules, b->n_rules + 1) != PD_OK) {
        fail(b, "out of memory");
        return UINT32_MAX;
    }
    brule_t *r = &b->rules[b->n_rules];
    memset(r, 0, sizeof(*r));
    r->line = b->line;
    if (name != NULL && (r->name = strndup(name, len)) == NULL) {
        fail(b, "out of memory");
        return UINT32_MAX;
    }
    return (uint32_t)b->n_rules++;
}

static uint32_t rule_by_name(builder_t *b, const char *name, size_t len)
{
    for (size_t i = 0; i < b->n_rules; i++) {
        if (b->rules[i].name != NULL && strlen(b->rules[i].name) == len &&
            memcmp(b->rules[i].name, name, len) == 0) {
            return (uint32_t)i;
        }
    }
    return rule_new(b, name, len);
}

/* A new, empty alternative of rule r (NULL on failure). The pointer is valid until r gets another. */
static u32vec_t *alt_new(builder_t *b, uint32_t r)
{
    brule_t *ru = &b->rules[r];
    if (pd_array_reserve(&ru->alts, &ru->cap_alts, ru->n_alts + 1) != PD_OK) {
        fail(b, "out of memory");
        return NULL;
    }
    memset(&ru->alts[ru->n_alts], 0, sizeof(u32vec_t));
    return &ru->alts[ru->n_alts++];
}

static uint32_t set_add(builder_t *b, const uint64_t s[4])
{
    for (size_t i = 0; i < b->n_sets; i++) {
        if (memcmp(b->sets[i], s, sizeof(b->sets[i])) == 0) {
            return (uint32_t)i;
        }
    }
    if (pd_array_reserve(&b->sets, &b->cap_sets, b->n_sets + 1) != PD_OK) {
        fail(b, "out of memory");
        return UINT32_MAX;
    }
    memcpy(b->sets[b->n_sets], s, sizeof(b->sets[0]));
    return (uint32_t)b->n_sets++;
}

static uint32_t set_range(builder_t *b, unsigned lo, unsigned hi)
{
    uint64_t s[4] = {0};
    for (unsigned c = lo; c <= hi; c++) {
        s[c >> 6] |= 1ull << (c & 63);
    }
    return set_add(b, s);
}

/* ------------------------------------------------------------------ code point ranges → UTF-8 */

typedef struct cprange {
    uint32_t lo, hi;
} cprange_t;

static int cp_len(uint32_t c)
{
    return c < 0x80 ? 1 : c < 0x800 ? 2 : c < 0x10000 ? 3 : 4;
}

static void cp_enc(uint32_t c, uint8_t *o)
{
    int n = cp_len(c);
    if (n == 1) {
        o[0] = (uint8_t)c;
        return;
    }
    for (int i = n - 1; i > 0; i--) {
        o[i] = (uint8_t)(0x80 | (c & 0x3f));
        c >>= 6;
    }
    o[0] = (uint8_t)((n == 2 ? 0xc0 : n == 3 ? 0xe0 : 0xf0) | c);
}

/* Appends to rule r the alternatives (byte-range sequences) for code points [lo, hi], all of one
 * encoded length (the utf8-ranges split). */
static bool utf8_seqs(builder_t *b, uint32_t r, uint32_t lo, uint32_t hi)
{
    int n = cp_len(lo);
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                return utf8_seqs(b, r, lo, lo | m) && utf8_seqs(b, r, (lo | m) + 1, hi);
            }
            if ((hi & m) != m) {
                return utf8_seqs(b, r, lo, (hi & ~m) - 1) && utf8_seqs(b, r, hi & ~m, hi);
            }
        }
    }
    uint8_t a[4], z[4];
    cp_enc(lo, a);
    cp_enc(hi, z);
    u32vec_t *alt = alt_new(b, r);
    for (int i = 0; alt != NULL && i < n; i++) {
        uint32_t s = set_range(b, a[i], z[i]);
        if (s == UINT32_MAX || !vec_push(b, alt, s)) {
            return false;
        }
    }
    return alt != NULL && vec_push(b, alt, GE_END);
}

/* The element for a set of code point ranges (sorted, disjoint, surrogates removed): one byte set
 * when every code point is ASCII, else a helper rule of byte sequences. UINT32_MAX on failure. */
static uint32_t class_elem(builder_t *b, const cprange_t *rg, size_t n)
{
    uint64_t ascii[4] = {0};
    bool wide = false, any_ascii = false;
    for (size_t i = 0; i < n; i++) {
        for (uint32_t c = rg[i].lo; c <= rg[i].hi && c < 0x80; c++) {
            ascii[c >> 6] |= 1ull << (c & 63);
            any_ascii = true;
        }
        wide |= rg[i].hi >= 0x80;
    }
    if (!wide) {
        return any_ascii ? set_add(b, ascii) : (fail(b, "an empty character class"), UINT32_MAX);
    }
    uint32_t r = rule_new(b, NULL, 0);
    if (r == UINT32_MAX) {
        return r;
    }
    if (any_ascii) {
        uint32_t s = set_add(b, ascii);
        u32vec_t *alt = alt_new(b, r);
        if (s == UINT32_MAX || alt == NULL || !vec_push(b, alt, s) || !vec_push(b, alt, GE_END)) {
            return UINT32_MAX;
        }
    }
    static const uint32_t bounds[] = {0x80, 0x800, 0x10000, 0x110000};
    for (size_t i = 0; i < n; i++) {
        uint32_t lo = rg[i].lo < 0x80 ? 0x80 : rg[i].lo;
        for (int k = 1; k < 4 && lo <= rg[i].hi; k++) {
            if (lo >= bounds[k]) {
                continue;
            }
            uint32_t hi = rg[i].hi < bounds[k] - 1 ? rg[i].hi : bounds[k] - 1;
            if (!utf8_seqs(b, r, lo, hi)) {
                return UINT32_MAX;
            }
            lo = hi + 1;
        }
    }
    return GE_RULE | r;
}

/* Sorts and merges ranges, negates them when asked, removes the surrogates. *n updated; the array
 * must have room for n + 2 entries. */
static int cprange_cmp(const void *a, const void *b)
{
    const cprange_t *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static size_t class_normalise(cprange_t *rg, size_t n, bool negate, cprange_t *out)
{
    qsort(rg, n, sizeof(*rg), cprange_cmp);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m > 0 && rg[i].lo <= out[m - 1].hi + 1) {
            out[m - 1].hi = rg[i].hi > out[m - 1].hi ? rg[i].hi : out[m - 1].hi;
        } else {
            out[m++] = rg[i];
        }
    }
    if (negate) {
        size_t k = 0;
        uint32_t next = 0;
        cprange_t *tmp = rg; /* reuse the input: it has n + 2 entries of room */
        for (size_t i = 0; i < m; i++) {
            if (out[i].lo > next) {
                tmp[k++] = (cprange_t){next, out[i].lo - 1};
            }
            next = out[i].hi + 1;
        }
        if (next <= 0x10ffff) {
            tmp[k++] = (cprange_t){next, 0x10ffff};
        }
        memcpy(out, tmp, k * sizeof(*out));
        m = k;
    }
    size_t k = 0; /* cut the surrogates D800-DFFF out (a range may split in two) */
    cprange_t *res = rg;
    for (size_t i = 0; i < m; i++) {
        cprange_t x = out[i];
        if (x.hi < 0xd800 || x.lo > 0xdfff) {
            res[k++] = x;
            continue;
        }
        if (x.lo < 0xd800) {
            res[k++] = (cprange_t){x.lo, 0xd7ff};
        }
        if (x.hi > 0xdfff) {
            res[k++] = (cprange_t){0xe000, x.hi};
        }
    }
    memcpy(out, res, k * sizeof(*out));
    return k;
}

/* ------------------------------------------------------------------ lexing */

static void skip_space(builder_t *b, bool newlines)
{
    while (b->p < b->end) {
        char c = *b->p;
        if (c == '#') {
            while (b->p < b->end && *b->p != '\n') {
                b->p++;
            }
        } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
            b->line += c == '\n';
            b->p++;
        } else {
            break;
        }
    }
}

static bool is_name_char(char c)
{
    return isalnum((unsigned char)c) || c == '-' || c == '_';
}

static int hexval(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* One character (code point) of a literal or class, escapes decoded; *raw_byte set for \xHH (a raw
 * byte in a literal, a code point in a class). Returns false at the end or on a bad escape. */
static bool read_char(builder_t *b, uint32_t *cp, bool *raw_byte)
{
    *raw_byte = false;
    if (b->p >= b->end) {
        return fail(b, "unexpected end of grammar");
    }
    unsigned char c = (unsigned char)*b->p;
    if (c == '\\') {
        b->p++;
        if (b->p >= b->end) {
            return fail(b, "unexpected end of grammar after \\");
        }
        char e = *b->p++;
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits > 0) {
            uint32_t v = 0;
            for (int i = 0; i < digits; i++) {
                int h = b->p < b->end ? hexval(*b->p) : -1;
                if (h < 0) {
                    return fail(b, "\\%c needs %d hex digits", e, digits);
                }
                v = v * 16 + (uint32_t)h;
                b->p++;
            }
            if (v > 0x10ffff) {
                return fail(b, "\\%c%X is not a code point", e, v);
            }
            *cp = v;
            *raw_byte = e == 'x';
            return true;
        }
        switch (e) {
        case 'n': *cp = '\n'; return true;
        case 'r': *cp = '\r'; return true;
        case 't': *cp = '\t'; return true;
        case '0': *cp = 0; return true;
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '\'':
        case '/':
        case '.': *cp = (uint32_t)e; return true;
        default: return fail(b, "unknown escape \\%c", e);
        }
    }
    if (c < 0x80) {
        *cp = c;
        b->p++;
        return true;
    }
    int n = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (n == 0 || b->p + n > b->end) {
        return fail(b, "invalid UTF-8 in the grammar");
    }
    uint32_t v = c & (0x7f >> n);
    for (int i = 1; i < n; i++) {
        unsigned char d = (unsigned char)b->p[i];
        if ((d & 0xc0) != 0x80) {
            return fail(b, "invalid UTF-8 in the grammar");
        }
        v = (v << 6) | (d & 0x3f);
    }
    b->p += n;
    *cp = v;
    return true;
}

/* ------------------------------------------------------------------ parsing */

static bool parse_alternatives(builder_t *b, uint32_t r, bool nested);

/* The element standing for alt[from, n): the one element itself, or a helper rule holding them. */
static uint32_t slice_elem(builder_t *b, u32vec_t *alt, size_t from)
{
    if (alt->n - from == 1) {
        return alt->v[from];
    }
    uint32_t r = rule_new(b, NULL, 0);
    u32vec_t *a = r == UINT32_MAX ? NULL : alt_new(b, r);
    for (size_t i = from; a != NULL && i < alt->n; i++) {
        if (!vec_push(b, a, alt->v[i])) {
            return UINT32_MAX;
        }
    }
    return a != NULL && vec_push(b, a, GE_END) ? GE_RULE | r : UINT32_MAX;
}

/* A helper rule: X R | ε (X*) — or, when bounded, k nested optionals: R_k ::= X R_{k-1} | ε. */
static uint32_t star_rule(builder_t *b, uint32_t x)
{
    uint32_t r = rule_new(b, NULL, 0);
    if (r == UINT32_MAX) {
        return r;
    }
    u32vec_t *a = alt_new(b, r);
    if (a == NULL || !vec_push(b, a, x) || !vec_push(b, a, GE_RULE | r) || !vec_push(b, a, GE_END)) {
        return UINT32_MAX;
    }
    a = alt_new(b, r);
    return a != NULL && vec_push(b, a, GE_END) ? GE_RULE | r : UINT32_MAX;
}

static uint32_t upto_rule(builder_t *b, uint32_t x, long k) /* k >= 1 */
{
    uint32_t prev = GE_END; /* R_0 = ε: nothing to append */
    for (long i = 0; i < k; i++) {
        uint32_t r = rule_new(b, NULL, 0);
        u32vec_t *a = r == UINT32_MAX ? NULL : alt_new(b, r);
        if (a == NULL || !vec_push(b, a, x) || (prev != GE_END && !vec_push(b, a, prev)) ||
            !vec_push(b, a, GE_END)) {
            return UINT32_MAX;
        }
        a = alt_new(b, r);
        if (a == NULL || !vec_push(b, a, GE_END)) {
            return UINT32_MAX;
        }
        prev = GE_RULE | r;
    }
    return prev;
}

static bool read_count(builder_t *b, long *v)
{
    skip_space(b, true);
    if (b->p >= b->end || !isdigit((unsigned char)*b->p)) {
        return fail(b, "expected a number in {m,n}");
    }
    *v = 0;
    while (b->p < b->end && isdigit((unsigned char)*b->p)) {
        *v = *v * 10 + (*b->p++ - '0');
        if (*v > PD_GRAMMAR_MAX_REPEAT) {
            return fail(b, "a repetition count over %d", PD_GRAMMAR_MAX_REPEAT);
        }
    }
    skip_space(b, true);
    return true;
}

/* Applies a postfix operator to alt[from, n) (rule r's alternative number ai). */
static bool apply_postfix(builder_t *b, uint32_t r, size_t ai, size_t from)
{
    char op = *b->p++;
    long lo = 0, hi = -1; /* hi -1: unbounded */
    if (op == '*') {
        lo = 0;
    } else if (op == '+') {
        lo = 1;
    } else if (op == '?') {
        hi = 1;
    } else { /* { */
        if (!read_count(b, &lo)) {
            return false;
        }
        hi = lo;
        if (b->p < b->end && *b->p == ',') {
            b->p++;
            skip_space(b, true);
            hi = -1;
            if (b->p < b->end && *b->p != '}' && !read_count(b, &hi)) {
                return false;
            }
        }
        if (b->p >= b->end || *b->p != '}') {
            return fail(b, "expected } after a repetition count");
        }
        b->p++;
        if (hi >= 0 && hi < lo) {
            return fail(b, "a repetition {%ld,%ld} with max below min", lo, hi);
        }
    }
    u32vec_t *alt = &b->rules[r].alts[ai];
    if (from == alt->n) {
        return fail(b, "'%c' follows nothing", op);
    }
    uint32_t x = slice_elem(b, alt, from);
    alt = &b->rules[r].alts[ai]; /* rule_new may have moved the rules */
    if (x == UINT32_MAX) {
        return false;
    }
    b->n_elems -= alt->n - from;
    alt->n = from;
    for (long i = 0; i < lo; i++) {
        if (!vec_push(b, alt, x)) {
            return false;
        }
    }
    if (hi == lo) {
        return true;
    }
    uint32_t tail = hi < 0 ? star_rule(b, x) : upto_rule(b, x, hi - lo);
    alt = &b->rules[r].alts[ai];
    return tail != UINT32_MAX && vec_push(b, alt, tail);
}

/* One sequence into rule r's alternative ai, up to `|`, `)` or (at the top level) a line's end. */
static bool parse_sequence(builder_t *b, uint32_t r, size_t ai, bool nested)
{
    for (;;) {
        skip_space(b, nested);
        if (b->p >= b->end) {
            return true;
        }
        char c = *b->p;
        if (c == '|' || c == ')' || c == '\n') {
            return true;
        }
        size_t from = b->rules[r].alts[ai].n;
        if (c == '"') {
            b->p++;
            while (b->p < b->end && *b->p != '"') {
                uint32_t cp;
                bool raw;
                if (!read_char(b, &cp, &raw)) {
                    return false;
                }
                uint8_t enc[4];
                int n = raw ? 1 : cp_len(cp);
                if (raw) {
                    enc[0] = (uint8_t)cp;
                } else {
                    cp_enc(cp, enc);
                }
                for (int i = 0; i < n; i++) {
                    uint32_t s = set_range(b, enc[i], enc[i]);
                    if (s == UINT32_MAX || !vec_push(b, &b->rules[r].alts[ai], s)) {
                        return false;
                    }
                }
            }
            if (b->p >= b->end) {
                return fail(b, "unterminated string literal");
            }
            b->p++;
            if (from == b->rules[r].alts[ai].n) { /* "" is ε: a helper rule with one empty alternative */
                uint32_t e = rule_new(b, NULL, 0);
                u32vec_t *a = e == UINT32_MAX ? NULL : alt_new(b, e);
                if (a == NULL || !vec_push(b, a, GE_END) ||
                    !vec_push(b, &b->rules[r].alts[ai], GE_RULE | e)) {
                    return false;
                }
            }
        } else if (c == '[' || c == '.') {
            cprange_t *rg = NULL, *out = NULL;
            size_t n = 0, cap = 0;
            bool negate = false;
            if (c == '.') {
                b->p++;
                negate = true; /* the complement of nothing */
            } else {
                b->p++;
                if (b->p < b->end && *b->p == '^') {
                    negate = true;
                    b->p++;
                }
                while (b->p < b->end && *b->p != ']') {
                    uint32_t lo, hi;
                    bool raw;
                    if (!read_char(b, &lo, &raw)) {
                        free(rg);
                        return false;
                    }
                    hi = lo;
                    if (b->p + 1 < b->end && *b->p == '-' && b->p[1] != ']') {
                        b->p++;
                        if (!read_char(b, &hi, &raw)) {
                            free(rg);
                            return false;
                        }
                        if (hi < lo) {
                            free(rg);
                            return fail(b, "a character range with its end before its start");
                        }
                    }
                    if (pd_array_reserve(&rg, &cap, n + 3) != PD_OK) {
                        free(rg);
                        return fail(b, "out of memory");
                    }
                    rg[n++] = (cprange_t){lo, hi};
                }
                if (b->p >= b->end) {
                    free(rg);
                    return fail(b, "unterminated character class");
                }
                b->p++;
            }
            if (pd_array_reserve(&rg, &cap, n + 3) != PD_OK ||
                (out = malloc((n + 3) * sizeof(*out))) == NULL) {
                free(rg);
                return fail(b, "out of memory");
            }
            size_t m = class_normalise(rg, n, negate, out);
            uint32_t e = m == 0 ? (fail(b, "an empty character class"), UINT32_MAX) : class_elem(b, out, m);
            free(rg);
            free(out);
            if (e == UINT32_MAX || !vec_push(b, &b->rules[r].alts[ai], e)) {
                return false;
            }
        } else if (c == '(') {
            b->p++;
            if (++b->depth > 64) {
                return fail(b, "groups nest deeper than 64");
            }
            uint32_t g = rule_new(b, NULL, 0);
            if (g == UINT32_MAX || !parse_alternatives(b, g, true)) {
                return false;
            }
            b->depth--;
            skip_space(b, true);
            if (b->p >= b->end || *b->p != ')') {
                return fail(b, "expected ')'");
            }
            b->p++;
            if (!vec_push(b, &b->rules[r].alts[ai], GE_RULE | g)) {
                return false;
            }
        } else if (is_name_char(c)) {
            const char *s = b->p;
            while (b->p < b->end && is_name_char(*b->p)) {
                b->p++;
            }
            const char *save = b->p;
            int save_line = b->line;
            skip_space(b, true);
            if (!nested && b->p + 3 <= b->end && memcmp(b->p, "::=", 3) == 0) {
                b->p = s; /* the next rule's name: this sequence ended at a line break */
                b->line = save_line;
                return fail(b, "a rule definition inside another rule's line");
            }
            b->p = save;
            b->line = save_line;
            uint32_t ref = rule_by_name(b, s, (size_t)(b->p - s));
            if (ref == UINT32_MAX || !vec_push(b, &b->rules[r].alts[ai], GE_RULE | ref)) {
                return false;
            }
        } else {
            return fail(b, "unexpected '%c'", c);
        }
        if (b->p < b->end && (*b->p == '*' || *b->p == '+' || *b->p == '?' || *b->p == '{') &&
            !apply_postfix(b, r, ai, from)) {
            return false;
        }
    }
}

static bool parse_alternatives(builder_t *b, uint32_t r, bool nested)
{
    for (;;) {
        size_t ai = b->rules[r].n_alts;
        if (alt_new(b, r) == NULL || !parse_sequence(b, r, ai, nested) ||
            !vec_push(b, &b->rules[r].alts[ai], GE_END)) {
            return false;
        }
        const char *save = b->p;
        int save_line = b->line;
        skip_space(b, true); /* a `|` may open the next line */
        if (b->p < b->end && *b->p == '|') {
            b->p++;
            skip_space(b, true);
            continue;
        }
        b->p = save;
        b->line = save_line;
        return true;
    }
}

/* ------------------------------------------------------------------ checks */

/* Whether each rule can match the empty string (fixpoint). */
static void nullable_rules(const builder_t *b, bool *nul)
{
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t r = 0; r < b->n_rules; r++) {
            for (size_t a = 0; !nul[r] && a < b->rules[r].n_alts; a++) {
                const u32vec_t *alt = &b->rules[r].alts[a];
                bool all = true;
                for (size_t i = 0; all && i < alt->n && alt->v[i] != GE_END; i++) {
                    all = GE_IS_RULE(alt->v[i]) && nul[GE_RULE_ID(alt->v[i])];
                }
                if (all) {
                    nul[r] = changed = true;
                }
            }
        }
    }
}

/* Left recursion: a rule reachable from itself through leftmost (nullable-prefixed) references. */
static bool left_recursive(const builder_t *b, const bool *nul, uint32_t r, uint8_t *color)
{
    color[r] = 1;
    for (size_t a = 0; a < b->rules[r].n_alts; a++) {
        const u32vec_t *alt = &b->rules[r].alts[a];
        for (size_t i = 0; i < alt->n && GE_IS_RULE(alt->v[i]); i++) {
            uint32_t s = GE_RULE_ID(alt->v[i]);
            if (color[s] == 1 || (color[s] == 0 && left_recursive(b, nul, s, color))) {
                return true;
            }
            if (!nul[s]) {
                break;
            }
        }
    }
    color[r] = 2;
    return false;
}

static const char *rule_label(const builder_t *b, uint32_t r)
{
    for (uint32_t i = r + 1; i-- > 0;) { /* a helper is named after the rule that made it */
        if (b->rules[i].name != NULL) {
            return b->rules[i].name;
        }
    }
    return "?";
}

static void builder_free(builder_t *b)
{
    for (size_t r = 0; r < b->n_rules; r++) {
        for (size_t a = 0; a < b->rules[r].n_alts; a++) {
            free(b->rules[r].alts[a].v);
        }
        free(b->rules[r].alts);
        free(b->rules[r].name);
    }
    free(b->rules);
    free(b->sets);
}

static pd_status_t flatten(builder_t *b, pd_grammar_t *g)
{
    size_t n_alts = 0, n_elems = 0;
    for (size_t r = 0; r < b->n_rules; r++) {
        n_alts += b->rules[r].n_alts;
        for (size_t a = 0; a < b->rules[r].n_alts; a++) {
            n_elems += b->rules[r].alts[a].n;
        }
    }
    g->elems = malloc((n_elems + 1) * sizeof(uint32_t));
    g->alts = malloc((n_alts + 1) * sizeof(uint32_t));
    g->rule_alt = malloc((b->n_rules + 1) * sizeof(uint32_t));
    g->sets = malloc((b->n_sets + 1) * sizeof(g->sets[0]));
    if (g->elems == NULL || g->alts == NULL || g->rule_alt == NULL || g->sets == NULL) {
        fail(b, "out of memory");
        return PD_ERR_NO_MEMORY;
    }
    uint32_t e = 0, k = 0;
    for (size_t r = 0; r < b->n_rules; r++) {
        g->rule_alt[r] = k;
        for (size_t a = 0; a < b->rules[r].n_alts; a++) {
            g->alts[k++] = e;
            memcpy(g->elems + e, b->rules[r].alts[a].v, b->rules[r].alts[a].n * sizeof(uint32_t));
            e += (uint32_t)b->rules[r].alts[a].n;
        }
    }
    g->rule_alt[b->n_rules] = k;
    g->num_elems = e;
    g->num_rules = (uint32_t)b->n_rules;
    if (b->n_sets > 0) { /* a grammar of empty strings has none */
        memcpy(g->sets, b->sets, b->n_sets * sizeof(g->sets[0]));
    }
    g->num_sets = (uint32_t)b->n_sets;
    return PD_OK;
}

pd_status_t pd_grammar_from_gbnf(const char *text, size_t len, pd_grammar_t **out, char *err, size_t err_len)
{
    *out = NULL;
    builder_t b = {.src = text, .p = text, .end = text + len, .line = 1, .err = err, .err_len = err_len};
    if (err_len > 0) {
        err[0] = '\0';
    }
    pd_status_t st = PD_ERR_PARSE;
    for (;;) {
        skip_space(&b, true);
        if (b.p >= b.end) {
            break;
        }
        const char *s = b.p;
        while (b.p < b.end && is_name_char(*b.p)) {
            b.p++;
        }
        if (b.p == s) {
            fail(&b, "expected a rule name, found '%c'", *b.p);
            goto out;
        }
        size_t nlen = (size_t)(b.p - s);
        skip_space(&b, false);
        if (b.p + 3 > b.end || memcmp(b.p, "::=", 3) != 0) {
            fail(&b, "expected '::=' after rule name '%.*s'", (int)nlen, s);
            goto out;
        }
        b.p += 3;
        skip_space(&b, true);
        uint32_t r = rule_by_name(&b, s, nlen);
        if (r == UINT32_MAX) {
            goto out;
        }
        if (b.rules[r].defined) {
            fail(&b, "rule '%.*s' is defined twice", (int)nlen, s);
            goto out;
        }
        b.rules[r].defined = true;
        if (!parse_alternatives(&b, r, false)) {
            goto out;
        }
        skip_space(&b, false);
        if (b.p < b.end && *b.p != '\n') {
            fail(&b, "unexpected '%c' after rule '%.*s'", *b.p, (int)nlen, s);
            goto out;
        }
    }
    uint32_t root = UINT32_MAX;
    for (size_t r = 0; r < b.n_rules; r++) {
        if (b.rules[r].name == NULL) {
            continue;
        }
        if (!b.rules[r].defined) {
            b.line = b.rules[r].line;
            fail(&b, "rule '%s' is used but not defined", b.rules[r].name);
            goto out;
        }
        if (strcmp(b.rules[r].name, "root") == 0) {
            root = (uint32_t)r;
        }
    }
    if (root == UINT32_MAX) {
        fail(&b, "the grammar has no 'root' rule");
        goto out;
    }
    bool *nul = calloc(b.n_rules + 1, 1);
    uint8_t *color = calloc(b.n_rules + 1, 1);
    if (nul == NULL || color == NULL) {
        free(nul);
        free(color);
        fail(&b, "out of memory");
        st = PD_ERR_NO_MEMORY;
        goto out;
    }
    nullable_rules(&b, nul);
    for (size_t r = 0; r < b.n_rules && !b.failed; r++) {
        if (color[r] == 0 && left_recursive(&b, nul, (uint32_t)r, color)) {
            uint32_t at = 0;
            for (size_t i = 0; i < b.n_rules; i++) {
                at = color[i] == 1 ? (uint32_t)i : at;
            }
            fail(&b, "rule '%s' is left-recursive (a rule that can begin with itself)", rule_label(&b, at));
        }
    }
    free(nul);
    free(color);
    if (b.failed) {
        goto out;
    }
    pd_grammar_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        st = PD_ERR_NO_MEMORY;
        goto out;
    }
    atomic_init(&g->refs, 1);
    g->hash = pd_hash64(text, len, 0);
    g->root = root;
    st = flatten(&b, g);
    if (st != PD_OK) {
        pd_grammar_unref(g);
        goto out;
    }
    *out = g;
out:
    builder_free(&b);
    return *out != NULL ? PD_OK : st == PD_OK ? PD_ERR_PARSE : st;
}

pd_grammar_t *pd_grammar_ref(pd_grammar_t *g)
{
    if (g != NULL) {
        atomic_fetch_add(&g->refs, 1);
    }
    return g;
}

void pd_grammar_unref(pd_grammar_t *g)
{
    if (g == NULL || atomic_fetch_sub(&g->refs, 1) != 1) {
        return;
    }
    grammar_rt_free(g->rt);
    grammar_pre_free_all(atomic_load(&g->pre));
    free(g->elems);
    free(g->alts);
    free(g->rule_alt);
    free(g->sets);
    free(g);
}

uint64_t pd_grammar_hash(const pd_grammar_t *g)
{
    return g->hash;
}

size_t pd_grammar_num_rules(const pd_grammar_t *g)
{
    return g->num_rules;
}

bool pd_gbnf_append_literal(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (pd_array_reserve(buf, cap, *len + 4 * n + 3) != PD_OK) {
        return false;
    }
    char *o = *buf + *len;
    *o++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = (char)c;
        } else if (c == '\n') {
            *o++ = '\\', *o++ = 'n';
        } else if (c == '\r') {
            *o++ = '\\', *o++ = 'r';
        } else if (c == '\t') {
            *o++ = '\\', *o++ = 't';
        } else if (c < 0x20 || c == 0x7f) {
            o += sprintf(o, "\\x%02X", c);
        } else {
            *o++ = (char)c; /* UTF-8 passes through as characters */
        }
    }
    *o++ = '"';
    *o = '\0';
    *len = (size_t)(o - *buf);
    return true;
}
