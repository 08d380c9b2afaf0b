/* grammar/regex.c — a regular expression (Python re syntax) → a GBNF expression matching it in full.
 *
 * The subset: literals and escapes (\n \t \r \f \v \0 \xHH \uHHHH and escaped punctuation), `.`
 * (anything but a newline), classes [...] with ranges, negation and \d \w \s \D \W \S (also outside
 * classes), groups (...), (?:...), (?P<name>...), (?<name>...), alternation, the quantifiers * + ?
 * {m} {m,} {m,n} (lazy and possessive forms match the same strings), ^ at the start and $ at the end.
 * \d \w \s are ASCII classes (ECMA-262's, which JSON Schema patterns follow; Python's re.ASCII).
 * Refused with the construct named: backreferences, lookarounds, \b \B \A \Z, inline flags.
 *
 * json_string (for a JSON Schema `pattern`): the expression describes a JSON string's text, so `"`
 * and `\` are written escaped and a class never matches them or a control character raw. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "grammar/grammar_impl.h"
#include "grammar/regex.h"

typedef struct rx {
    const char *p, *end, *start;
    bool json;
    char *out;
    size_t len, cap;
    char *err;
    size_t err_len;
    bool failed;
    int depth;
} rx_t;

static bool rx_fail(rx_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static bool rx_fail(rx_t *r, const char *fmt, ...)
{
    if (!r->failed && r->err_len > 0) {
        int n = snprintf(r->err, r->err_len, "pattern at offset %d: ", (int)(r->p - r->start));
        va_list ap;
        va_start(ap, fmt);
        if (n >= 0 && (size_t)n < r->err_len) {
            vsnprintf(r->err + n, r->err_len - (size_t)n, fmt, ap);
        }
        va_end(ap);
    }
    r->failed = true;
    return false;
}

static bool put(rx_t *r, const char *s)
{
    size_t n = strlen(s);
    if (pd_array_reserve(&r->out, &r->cap, r->len + n + 1) != PD_OK) {
        return rx_fail(r, "out of memory");
    }
    memcpy(r->out + r->len, s, n + 1);
    r->len += n;
    return true;
}

typedef struct range {
    uint32_t lo, hi;
} range_t;

typedef struct cls {
    range_t *v;
    size_t n, cap;
} cls_t;

static bool cls_add(rx_t *r, cls_t *c, uint32_t lo, uint32_t hi)
{
    if (pd_array_reserve(&c->v, &c->cap, c->n + 1) != PD_OK) {
        return rx_fail(r, "out of memory");
    }
    c->v[c->n++] = (range_t){lo, hi};
    return true;
}

static int range_cmp(const void *a, const void *b)
{
    const range_t *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorted, merged; negated over all code points when asked; in json mode without `"`, `\` and the
 * control characters. */
static bool cls_finish(rx_t *r, cls_t *c, bool negate)
{
    qsort(c->v, c->n, sizeof(*c->v), range_cmp);
    size_t m = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (m > 0 && c->v[i].lo <= c->v[m - 1].hi + 1) {
            c->v[m - 1].hi = c->v[i].hi > c->v[m - 1].hi ? c->v[i].hi : c->v[m - 1].hi;
        } else {
            c->v[m++] = c->v[i];
        }
    }
    c->n = m;
    cls_t out = {0};
    if (negate) {
        uint32_t next = 0;
        for (size_t i = 0; i < c->n; i++) {
            if (c->v[i].lo > next && !cls_add(r, &out, next, c->v[i].lo - 1)) {
                goto err;
            }
            next = c->v[i].hi + 1;
        }
        if (next <= 0x10ffff && !cls_add(r, &out, next, 0x10ffff)) {
            goto err;
        }
        free(c->v);
        *c = out;
        out = (cls_t){0};
    }
    if (r->json) { /* cut 0x00-0x1F, '"' and '\\' */
        static const range_t cut[] = {{0, 0x1f}, {'"', '"'}, {'\\', '\\'}};
        for (size_t k = 0; k < 3; k++) {
            cls_t keep = {0};
            for (size_t i = 0; i < c->n; i++) {
                range_t x = c->v[i];
                if (x.hi < cut[k].lo || x.lo > cut[k].hi) {
                    if (!cls_add(r, &keep, x.lo, x.hi)) {
                        free(keep.v);
                        goto err;
                    }
                    continue;
                }
                if ((x.lo < cut[k].lo && !cls_add(r, &keep, x.lo, cut[k].lo - 1)) ||
                    (x.hi > cut[k].hi && !cls_add(r, &keep, cut[k].hi + 1, x.hi))) {
                    free(keep.v);
                    goto err;
                }
            }
            free(c->v);
            *c = keep;
        }
    }
    return true;
err:
    free(out.v);
    return false;
}

static bool put_class(rx_t *r, const cls_t *c)
{
    if (c->n == 0) {
        return rx_fail(r, "a character class that matches nothing");
    }
    if (!put(r, "[")) {
        return false;
    }
    char buf[32];
    for (size_t i = 0; i < c->n; i++) {
        if (c->v[i].lo == c->v[i].hi) {
            snprintf(buf, sizeof(buf), "\\U%08X", c->v[i].lo);
        } else {
            snprintf(buf, sizeof(buf), "\\U%08X-\\U%08X", c->v[i].lo, c->v[i].hi);
        }
        if (!put(r, buf)) {
            return false;
        }
    }
    return put(r, "]");
}

/* The ranges of \d \w \s (upper case: negated by the caller). */
static bool shorthand(rx_t *r, cls_t *c, char e)
{
    switch (e) {
    case 'd': return cls_add(r, c, '0', '9');
    case 'w':
        return cls_add(r, c, '0', '9') && cls_add(r, c, 'A', 'Z') && cls_add(r, c, 'a', 'z') &&
               cls_add(r, c, '_', '_');
    case 's': return cls_add(r, c, '\t', '\r') && cls_add(r, c, ' ', ' ');
    default: return false;
    }
}

static int hexv(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* One character after a backslash (p at the character after it): its code point, or -1 with *sh set
 * to the shorthand letter (d w s D W S). */
static int64_t escape(rx_t *r, char *sh)
{
    *sh = 0;
    if (r->p >= r->end) {
        rx_fail(r, "a trailing backslash");
        return -2;
    }
    char e = *r->p++;
    int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
    if (digits > 0) {
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = r->p < r->end ? hexv(*r->p) : -1;
            if (h < 0) {
                rx_fail(r, "\\%c needs %d hex digits", e, digits);
                return -2;
            }
            v = v * 16 + (uint32_t)h;
            r->p++;
        }
        return v <= 0x10ffff ? (int64_t)v : (rx_fail(r, "not a code point"), -2);
    }
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case 'a': return 7;
    case '0': return 0;
    case 'd':
    case 'w':
    case 's':
    case 'D':
    case 'W':
    case 'S': *sh = e; return -1;
    case 'b':
    case 'B':
    case 'A':
    case 'Z':
    case 'z':
    case 'G': rx_fail(r, "\\%c (an anchor) is not supported", e); return -2;
    default:
        if (e >= '1' && e <= '9') {
            rx_fail(r, "backreferences are not supported");
            return -2;
        }
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
            rx_fail(r, "unknown escape \\%c", e);
            return -2;
        }
        return (unsigned char)e;
    }
}

/* One code point of the pattern's UTF-8 text. */
static int64_t utf8_next(rx_t *r)
{
    unsigned char c = (unsigned char)*r->p;
    int n = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (n == 0 || r->p + n > r->end) {
        rx_fail(r, "invalid UTF-8");
        return -2;
    }
    uint32_t v = n == 1 ? c : c & (0x7f >> n);
    for (int i = 1; i < n; i++) {
        v = (v << 6) | ((unsigned char)r->p[i] & 0x3f);
    }
    r->p += n;
    return v;
}

/* A literal code point as GBNF (JSON-escaped in json mode). */
static bool put_char(rx_t *r, uint32_t cp)
{
    char buf[32];
    if (r->json && (cp == '"' || cp == '\\')) {
        snprintf(buf, sizeof(buf), "\"\\\\\\%c\"", (char)cp);
    } else if (r->json && cp < 0x20) {
        static const char *names[32] = {[8] = "b", [9] = "t", [10] = "n", [12] = "f", [13] = "r"};
        if (names[cp] != NULL) {
            snprintf(buf, sizeof(buf), "\"\\\\%s\"", names[cp]);
        } else {
            snprintf(buf, sizeof(buf), "\"\\\\u%04x\"", cp);
        }
    } else {
        snprintf(buf, sizeof(buf), "[\\U%08X]", cp);
    }
    return put(r, buf);
}

static bool parse_alt(rx_t *r);

static bool parse_class(rx_t *r)
{
    cls_t c = {0};
    bool negate = false;
    if (r->p < r->end && *r->p == '^') {
        negate = true;
        r->p++;
    }
    bool first = true;
    while (r->p < r->end && (*r->p != ']' || first)) {
        first = false;
        int64_t lo;
        char sh = 0;
        if (*r->p == '\\') {
            r->p++;
            lo = escape(r, &sh);
        } else {
            lo = utf8_next(r);
        }
        if (lo == -2) {
            goto err;
        }
        if (sh != 0) {
            if (sh >= 'a') {
                if (!shorthand(r, &c, sh)) {
                    goto err;
                }
            } else { /* \D \W \S inside a class: the complement's ranges */
                cls_t t = {0};
                if (!shorthand(r, &t, (char)(sh + 32))) {
                    free(t.v);
                    goto err;
                }
                bool json = r->json;
                r->json = false;
                bool ok = cls_finish(r, &t, true);
                r->json = json;
                for (size_t i = 0; ok && i < t.n; i++) {
                    ok = cls_add(r, &c, t.v[i].lo, t.v[i].hi);
                }
                free(t.v);
                if (!ok) {
                    goto err;
                }
            }
            continue;
        }
        int64_t hi = lo;
        if (r->p + 1 < r->end && *r->p == '-' && r->p[1] != ']') {
            r->p++;
            if (*r->p == '\\') {
                r->p++;
                hi = escape(r, &sh);
            } else {
                hi = utf8_next(r);
            }
            if (hi == -2 || sh != 0 || hi < lo) {
                rx_fail(r, "a bad range in a character class");
                goto err;
            }
        }
        if (!cls_add(r, &c, (uint32_t)lo, (uint32_t)hi)) {
            goto err;
        }
    }
    if (r->p >= r->end) {
        rx_fail(r, "an unterminated character class");
        goto err;
    }
    r->p++;
    if (!cls_finish(r, &c, negate) || !put_class(r, &c)) {
        goto err;
    }
    free(c.v);
    return true;
err:
    free(c.v);
    return false;
}

static bool parse_atom(rx_t *r)
{
    char c = *r->p;
    if (c == '(') {
        r->p++;
        if (r->p < r->end && *r->p == '?') {
            r->p++;
            if (r->p < r->end && *r->p == ':') {
                r->p++;
            } else if (r->p < r->end && (*r->p == 'P' || *r->p == '<') &&
                       !(r->p + 1 < r->end && *r->p == '<' && (r->p[1] == '=' || r->p[1] == '!'))) {
                r->p += *r->p == 'P' ? 2 : 1;
                while (r->p < r->end && *r->p != '>') {
                    r->p++;
                }
                if (r->p >= r->end) {
                    return rx_fail(r, "an unterminated group name");
                }
                r->p++;
            } else {
                return rx_fail(r, "(?%c...) groups (lookarounds, flags) are not supported",
                               r->p < r->end ? *r->p : ' ');
            }
        }
        if (++r->depth > 64) {
            return rx_fail(r, "groups nest deeper than 64");
        }
        if (!put(r, "(") || !parse_alt(r)) {
            return false;
        }
        r->depth--;
        if (r->p >= r->end || *r->p != ')') {
            return rx_fail(r, "a missing ')'");
        }
        r->p++;
        return put(r, ")");
    }
    if (c == '[') {
        r->p++;
        return parse_class(r);
    }
    if (c == '.') {
        r->p++;
        cls_t cl = {0};
        bool ok = cls_add(r, &cl, '\n', '\n') && cls_finish(r, &cl, true) && put_class(r, &cl);
        free(cl.v);
        return ok;
    }
    if (c == '\\') {
        r->p++;
        char sh;
        int64_t v = escape(r, &sh);
        if (v == -2) {
            return false;
        }
        if (sh != 0) {
            cls_t cl = {0};
            bool ok = shorthand(r, &cl, (char)(sh | 32)) && cls_finish(r, &cl, sh < 'a') && put_class(r, &cl);
            free(cl.v);
            return ok;
        }
        return put_char(r, (uint32_t)v);
    }
    if (c == '*' || c == '+' || c == '?') {
        return rx_fail(r, "'%c' follows nothing", c);
    }
    int64_t v = utf8_next(r);
    return v >= 0 && put_char(r, (uint32_t)v);
}

/* A quantifier after an atom, copied as GBNF; lazy `?` and possessive `+` suffixes dropped. */
static bool parse_quant(rx_t *r)
{
    if (r->p >= r->end) {
        return true;
    }
    char c = *r->p;
    if (c == '*' || c == '+' || c == '?') {
        r->p++;
        char q[2] = {c, 0};
        if (!put(r, q)) {
            return false;
        }
    } else if (c == '{') { /* {m} {m,} {,n} {m,n} {,}; anything else is a literal '{' (as in Python) */
        const char *q = r->p + 1;
        long lo = 0, hi = -2;
        bool has_lo = false;
        while (q < r->end && *q >= '0' && *q <= '9' && lo <= PD_GRAMMAR_MAX_REPEAT) {
            lo = lo * 10 + (*q++ - '0');
            has_lo = true;
        }
        if (q < r->end && *q == ',') {
            q++;
            hi = -1;
            if (q < r->end && *q >= '0' && *q <= '9') {
                hi = 0;
                while (q < r->end && *q >= '0' && *q <= '9' && hi <= PD_GRAMMAR_MAX_REPEAT) {
                    hi = hi * 10 + (*q++ - '0');
                }
            }
        } else if (!has_lo) {
            return true;
        }
        if (q >= r->end || *q != '}') {
            return true;
        }
        r->p = q + 1;
        if (lo > PD_GRAMMAR_MAX_REPEAT || hi > PD_GRAMMAR_MAX_REPEAT || (hi >= 0 && hi < lo)) {
            return rx_fail(r, "a repetition {%ld,%ld} out of bounds", lo, hi);
        }
        char buf[64];
        if (hi == -2) {
            snprintf(buf, sizeof(buf), "{%ld}", lo);
        } else if (hi == -1) {
            snprintf(buf, sizeof(buf), "{%ld,}", lo);
        } else {
            snprintf(buf, sizeof(buf), "{%ld,%ld}", lo, hi);
        }
        if (!put(r, buf)) {
            return false;
        }
    } else {
        return true;
    }
    if (r->p < r->end && (*r->p == '?' || *r->p == '+')) {
        r->p++;
    }
    if (r->p < r->end && (*r->p == '*' || *r->p == '+' || *r->p == '?')) {
        return rx_fail(r, "a quantifier after a quantifier");
    }
    return true;
}

static bool parse_seq(rx_t *r)
{
    bool any = false;
    while (r->p < r->end && *r->p != '|' && *r->p != ')') {
        if (*r->p == '^' && r->p == r->start) {
            r->p++;
            continue;
        }
        if (*r->p == '$' && r->p + 1 == r->end) {
            r->p++;
            continue;
        }
        if (*r->p == '^' || *r->p == '$') {
            return rx_fail(r, "'%c' inside the pattern is not supported", *r->p);
        }
        if ((any && !put(r, " ")) || !put(r, "(") || !parse_atom(r) || !put(r, ")") || !parse_quant(r)) {
            return false;
        }
        any = true;
    }
    return any || put(r, "\"\"");
}

static bool parse_alt(rx_t *r)
{
    if (!parse_seq(r)) {
        return false;
    }
    while (r->p < r->end && *r->p == '|') {
        r->p++;
        if (!put(r, " | ") || !parse_seq(r)) {
            return false;
        }
    }
    return true;
}

char *pd_regex_to_gbnf_expr(const char *re, size_t len, bool json_string, char *err, size_t err_len)
{
    rx_t r = {.p = re, .end = re + len, .start = re, .json = json_string, .err = err, .err_len = err_len};
    if (!put(&r, "(") || !parse_alt(&r) || !put(&r, ")")) {
        free(r.out);
        return NULL;
    }
    if (r.p < r.end) {
        rx_fail(&r, "an unmatched ')'");
        free(r.out);
        return NULL;
    }
    return r.out;
}

char *pd_regex_to_gbnf(const char *re, size_t len, char *err, size_t err_len)
{
    char *e = pd_regex_to_gbnf_expr(re, len, false, err, err_len);
    if (e == NULL) {
        return NULL;
    }
    size_t n = strlen(e);
    char *out = malloc(n + 16);
    if (out != NULL) {
        snprintf(out, n + 16, "root ::= %s\n", e);
    }
    free(e);
    return out;
}
