/* grammar/json_schema.c — a JSON Schema → GBNF.
 *
 * The subset (what vLLM's and OpenAI's structured outputs take):
 *   type (a name or a list), enum, const, anyOf / oneOf (as anyOf), allOf of one schema, $ref to
 *   "#", "#/$defs/..." and "#/definitions/..." (recursive schemas too);
 *   object: properties (written in the schema's order, each required one present), required,
 *   additionalProperties (false, true, absent = true, or a schema; an extra key is any string);
 *   array: items, prefixItems, minItems, maxItems;
 *   string: minLength, maxLength, pattern (regex.c), format date, time, date-time, uuid, ipv4;
 *   integer: minimum, maximum, exclusiveMinimum, exclusiveMaximum (digit ranges);
 *   number: no bounds; boolean, null; {} or true: any JSON value.
 * Annotations (title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
 * writeOnly, strict) are ignored; any other keyword is refused by name, so a schema is never
 * followed only in part.
 *
 * Dates are valid calendar dates of the years 0001-9999 (February 29 is never written: the year is
 * free; year 0000, which RFC 3339 allows, is not, as Python's date and most checkers refuse it).
 * The JSON written: whitespace between tokens is none, one space, or a newline and up to 20 spaces
 * or tabs (llama.cpp's); an integer has at most 16 digits and a fraction or exponent at most 16 and
 * 3 (so a generation from a model that never closes a number still ends). */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "grammar/grammar_impl.h"
#include "grammar/regex.h"

#define JS_MAX_RULES 4096

typedef struct js {
    const json_t *root;
    char *out; /* the body of the rule being written */
    size_t len, cap;
    char *rules; /* the finished rules */
    size_t rules_len, rules_cap;
    int n_rules;
    struct {
        const char *ref;
        int rule;
    } refs[256];
    int n_refs;
    char *err;
    size_t err_len;
    bool failed;
    int depth;
} js_t;

static bool js_fail(js_t *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static bool js_fail(js_t *j, const char *fmt, ...)
{
    if (!j->failed && j->err_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err, j->err_len, fmt, ap);
        va_end(ap);
    }
    j->failed = true;
    return false;
}

static bool emit(js_t *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static bool emit(js_t *j, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || pd_array_reserve(&j->out, &j->cap, j->len + (size_t)n + 1) != PD_OK) {
        return js_fail(j, "out of memory");
    }
    va_start(ap, fmt);
    vsnprintf(j->out + j->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    j->len += (size_t)n;
    return true;
}

static const char BASE_RULES[] =
    "ws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"
    "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n"
    "json-string ::= \"\\\"\" json-char* \"\\\"\"\n"
    "json-int ::= \"-\"? ([0-9] | [1-9] [0-9]{1,15})\n"
    "json-number ::= json-int (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "json-value ::= json-object | json-array | json-string | json-number | \"true\" | \"false\" | \"null\"\n"
    "json-object ::= \"{\" ws (json-string ws \":\" ws json-value ws (\",\" ws json-string ws \":\" ws "
    "json-value "
    "ws)*)? \"}\"\n"
    "json-array ::= \"[\" ws (json-value ws (\",\" ws json-value ws)*)? \"]\"\n"
    "json-digit ::= [0-9]\n"
    "json-d2 ::= [0-9] [0-9]\n"
    "json-date ::= json-year \"-\" ((\"0\" [13578] | \"1\" [02]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" "
    "[01]) | "
    "(\"0\" [469] | \"11\") \"-\" (\"0\" [1-9] | [12] [0-9] | \"30\") | \"02-\" (\"0\" [1-9] | \"1\" [0-9] | "
    "\"2\" [0-8]))\n"
    "json-year ::= [1-9] [0-9]{3} | \"0\" ([1-9] [0-9]{2} | \"0\" ([1-9] [0-9] | \"0\" [1-9]))\n"
    "json-time ::= ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]{1,6})? "
    "(\"Z\" | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])\n"
    "json-uuid ::= [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" "
    "[0-9a-fA-F]{12}\n"
    "json-octet ::= [0-9] | [1-9] [0-9] | \"1\" [0-9] [0-9] | \"2\" [0-4] [0-9] | \"25\" [0-5]\n"
    "json-ipv4 ::= json-octet \".\" json-octet \".\" json-octet \".\" json-octet\n";

static int new_rule(js_t *j)
{
    if (j->n_rules >= JS_MAX_RULES) {
        js_fail(j, "the schema needs over %d grammar rules", JS_MAX_RULES);
        return -1;
    }
    return j->n_rules++;
}

/* A JSON value's compact text as a GBNF literal appended to the output. */
static bool emit_json_literal(js_t *j, const json_t *v)
{
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (s == NULL) {
        return js_fail(j, "out of memory");
    }
    bool ok = pd_gbnf_append_literal(&j->out, &j->len, &j->cap, s, strlen(s));
    free(s);
    return ok || js_fail(j, "out of memory");
}

static int visit(js_t *j, const json_t *s);

/* Rules are written one at a time: a rule's body goes to a buffer of its own (begin_rule), the rules
 * its body needs are finished meanwhile, and end_rule moves "rN ::= body" to the finished rules. */
typedef struct js_body {
    char *out;
    size_t len, cap;
} js_body_t;

static void begin_rule(js_t *j, js_body_t *saved)
{
    *saved = (js_body_t){j->out, j->len, j->cap};
    j->out = NULL, j->len = j->cap = 0;
}

static bool end_rule(js_t *j, js_body_t *saved, int rule)
{
    char head[32];
    int hn = snprintf(head, sizeof(head), "r%d ::= ", rule);
    bool ok = !j->failed &&
              pd_array_reserve(&j->rules, &j->rules_cap, j->rules_len + (size_t)hn + j->len + 2) == PD_OK;
    if (ok) {
        memcpy(j->rules + j->rules_len, head, (size_t)hn);
        memcpy(j->rules + j->rules_len + hn, j->out != NULL ? j->out : "", j->len);
        j->rules_len += (size_t)hn + j->len;
        j->rules[j->rules_len++] = '\n';
        j->rules[j->rules_len] = '\0';
    }
    free(j->out);
    j->out = saved->out, j->len = saved->len, j->cap = saved->cap;
    return ok || js_fail(j, "out of memory");
}

static const char *const ANNOTATIONS[] = {"title",  "description", "default",     "examples", "$schema",
                                          "$id",    "$comment",    "deprecated",  "readOnly", "writeOnly",
                                          "strict", "$defs",       "definitions", "type",     "name"};

static bool known_keyword(const char *k, const char *const *extra)
{
    for (size_t i = 0; i < sizeof(ANNOTATIONS) / sizeof(ANNOTATIONS[0]); i++) {
        if (strcmp(k, ANNOTATIONS[i]) == 0) {
            return true;
        }
    }
    for (; extra != NULL && *extra != NULL; extra++) {
        if (strcmp(k, *extra) == 0) {
            return true;
        }
    }
    return false;
}

/* Refuses keywords of s outside the annotations and extra. */
static bool check_keywords(js_t *j, const json_t *s, const char *const *extra, const char *what)
{
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)s, k, v)
    {
        (void)v;
        if (!known_keyword(k, extra)) {
            return js_fail(j, "JSON Schema keyword '%s' is not supported%s%s", k, what ? " for " : "",
                           what ? what : "");
        }
    }
    return true;
}

/* ------------------------------------------------------------------ integer ranges */

/* Digits lo[i..n) to hi[i..n) (equal lengths) as a GBNF sequence appended. */
static bool digit_range(js_t *j, const char *lo, const char *hi, size_t n)
{
    if (n == 0) {
        return emit(j, "\"\"");
    }
    bool lo_zeros = strspn(lo + 1, "0") == n - 1, hi_nines = strspn(hi + 1, "9") == n - 1;
    if (lo[0] == hi[0]) {
        return emit(j, "\"%c\" (", lo[0]) && digit_range(j, lo + 1, hi + 1, n - 1) && emit(j, ")");
    }
    if (lo_zeros && hi_nines) {
        return emit(j, "[%c-%c] [0-9]{%zu}", lo[0], hi[0], n - 1);
    }
    char nines[24], zeros[24];
    memset(nines, '9', n), memset(zeros, '0', n);
    nines[n] = zeros[n] = 0;
    bool ok = emit(j, "(\"%c\" (", lo[0]) && digit_range(j, lo + 1, nines, n - 1) && emit(j, ")");
    if (ok && hi[0] - lo[0] > 1) {
        ok = emit(j, " | [%c-%c] [0-9]{%zu}", lo[0] + 1, hi[0] - 1, n - 1);
    }
    return ok && emit(j, " | \"%c\" (", hi[0]) && digit_range(j, zeros, hi + 1, n - 1) && emit(j, "))");
}

/* Non-negative integers [lo, hi] (hi < 0: unbounded, up to 16 digits) without sign or leading zeros. */
static bool uint_range(js_t *j, int64_t lo, int64_t hi)
{
    bool first = true;
    if (!emit(j, "(")) {
        return false;
    }
    for (int64_t d = 1, pow10 = 1; d <= 16; d++, pow10 *= 10) { /* the d-digit numbers: [10^(d-1), 10^d) */
        int64_t dlo = d == 1 ? 0 : pow10, dhi = pow10 * 10 - 1;
        int64_t a = lo > dlo ? lo : dlo, b = hi >= 0 && hi < dhi ? hi : dhi;
        if (a > b) {
            continue;
        }
        char sa[24], sb[24];
        snprintf(sa, sizeof(sa), "%" PRId64, a);
        snprintf(sb, sizeof(sb), "%" PRId64, b);
        if ((!first && !emit(j, " | ")) || !emit(j, "(") || !digit_range(j, sa, sb, strlen(sa)) ||
            !emit(j, ")")) {
            return false;
        }
        first = false;
    }
    if (first) {
        return js_fail(j, "an integer range with no value");
    }
    return emit(j, ")");
}

static bool int_bound(js_t *j, const json_t *s, const char *key, int64_t *v, bool *has)
{
    const json_t *x = json_object_get(s, key);
    if (x == NULL) {
        return true;
    }
    if (!json_is_number(x)) {
        return js_fail(j, "'%s' must be a number", key);
    }
    double d = json_number_value(x);
    if (d < -1e15 || d > 1e15) {
        return js_fail(j, "'%s' %g is outside the integers this grammar writes (16 digits)", key, d);
    }
    int64_t i = (int64_t)d;
    bool lower = strstr(key, "inimum") != NULL, excl = strncmp(key, "exclusive", 9) == 0;
    if ((double)i != d) { /* a fractional bound: the nearest integer inside it */
        i = lower ? (d > 0 ? i + 1 : i) : (d < 0 ? i - 1 : i);
        excl = false;
    }
    i += excl ? (lower ? 1 : -1) : 0;
    if (!*has || (lower ? i > *v : i < *v)) {
        *v = i;
    }
    *has = true;
    return true;
}

static bool emit_integer(js_t *j, const json_t *s)
{
    int64_t lo = 0, hi = 0;
    bool has_lo = false, has_hi = false;
    if (!int_bound(j, s, "minimum", &lo, &has_lo) || !int_bound(j, s, "exclusiveMinimum", &lo, &has_lo) ||
        !int_bound(j, s, "maximum", &hi, &has_hi) || !int_bound(j, s, "exclusiveMaximum", &hi, &has_hi)) {
        return false;
    }
    if (!has_lo && !has_hi) {
        return emit(j, "json-int");
    }
    if (has_lo && has_hi && lo > hi) {
        return js_fail(j, "integer bounds [%" PRId64 ", %" PRId64 "] hold no value", lo, hi);
    }
    bool ok = emit(j, "(");
    bool any = false;
    if (!has_lo || lo < 0) { /* negatives: "-" then |x| in [max(1, -hi), -lo] */
        int64_t a = has_hi && hi < 0 ? -hi : 1, b = has_lo ? -lo : -1;
        ok = ok && emit(j, "\"-\" ") && uint_range(j, a, b);
        any = true;
    }
    if (!has_hi || hi >= 0) {
        ok = ok && (!any || emit(j, " | ")) && uint_range(j, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
    }
    return ok && emit(j, ")");
}

/* ------------------------------------------------------------------ types */

static bool emit_string(js_t *j, const json_t *s)
{
    const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    const json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
    if (pat != NULL) {
        if (!json_is_string(pat)) {
            return js_fail(j, "'pattern' must be a string");
        }
        if (mn != NULL || mx != NULL || fmt != NULL) {
            return js_fail(j, "'pattern' with minLength, maxLength or format is not supported");
        }
        char err[200];
        const char *re = json_string_value(pat);
        size_t n = json_string_length(pat);
        if (n > 0 && re[0] != '^') { /* JSON Schema's pattern is a search; the grammar matches in full */
            return js_fail(j, "'pattern' must start with ^ and end with $ (it is matched in full)");
        }
        if (n < 2 || re[n - 1] != '$' || (n > 2 && re[n - 2] == '\\')) {
            return js_fail(j, "'pattern' must start with ^ and end with $ (it is matched in full)");
        }
        char *e = pd_regex_to_gbnf_expr(re, n, true, err, sizeof(err));
        if (e == NULL) {
            return js_fail(j, "'pattern': %s", err);
        }
        bool ok = emit(j, "\"\\\"\" %s \"\\\"\"", e);
        free(e);
        return ok;
    }
    if (fmt != NULL) {
        const char *f = json_string_value(fmt);
        static const char *const fmts[][2] = {
            {"date", "json-date"}, {"time", "json-time"}, {"date-time", "json-date \"T\" json-time"},
            {"uuid", "json-uuid"}, {"ipv4", "json-ipv4"},
        };
        for (size_t i = 0; f != NULL && i < sizeof(fmts) / sizeof(fmts[0]); i++) {
            if (strcmp(f, fmts[i][0]) == 0) {
                if (mn != NULL || mx != NULL) {
                    return js_fail(j, "'format' with minLength or maxLength is not supported");
                }
                return emit(j, "\"\\\"\" %s \"\\\"\"", fmts[i][1]);
            }
        }
        return js_fail(j, "string format '%s' is not supported (date, time, date-time, uuid, ipv4 are)",
                       f != NULL ? f : "?");
    }
    json_int_t lo = 0, hi = -1;
    if ((mn != NULL && !json_is_integer(mn)) || (mx != NULL && !json_is_integer(mx))) {
        return js_fail(j, "minLength and maxLength must be integers");
    }
    lo = mn != NULL ? json_integer_value(mn) : 0;
    hi = mx != NULL ? json_integer_value(mx) : -1;
    if (lo < 0 || hi > PD_GRAMMAR_MAX_REPEAT || lo > PD_GRAMMAR_MAX_REPEAT || (hi >= 0 && hi < lo)) {
        return js_fail(j, "string lengths [%lld, %lld] out of bounds", (long long)lo, (long long)hi);
    }
    if (lo == 0 && hi < 0) {
        return emit(j, "json-string");
    }
    if (hi < 0) {
        return emit(j, "\"\\\"\" json-char{%lld,} \"\\\"\"", (long long)lo);
    }
    return emit(j, "\"\\\"\" json-char{%lld,%lld} \"\\\"\"", (long long)lo, (long long)hi);
}

static bool emit_array(js_t *j, const json_t *s)
{
    const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    const json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    if ((mn != NULL && !json_is_integer(mn)) || (mx != NULL && !json_is_integer(mx))) {
        return js_fail(j, "minItems and maxItems must be integers");
    }
    json_int_t lo = mn != NULL ? json_integer_value(mn) : 0, hi = mx != NULL ? json_integer_value(mx) : -1;
    if (lo < 0 || lo > 1000 || hi > 1000 || (hi >= 0 && hi < lo)) {
        return js_fail(j, "array sizes [%lld, %lld] out of bounds (at most 1000)", (long long)lo,
                       (long long)hi);
    }
    if (prefix != NULL) {
        if (!json_is_array(prefix) || json_array_size(prefix) == 0) {
            return js_fail(j, "'prefixItems' must be a non-empty array");
        }
        if (!json_is_false(items) || mn != NULL || mx != NULL) {
            return js_fail(j, "'prefixItems' is supported with \"items\": false only (a fixed tuple)");
        }
        size_t n = json_array_size(prefix);
        int *r = calloc(n, sizeof(int));
        if (r == NULL) {
            return js_fail(j, "out of memory");
        }
        bool ok = true;
        for (size_t i = 0; ok && i < n; i++) {
            r[i] = visit(j, json_array_get(prefix, i));
            ok = r[i] >= 0;
        }
        ok = ok && emit(j, "\"[\" ws");
        for (size_t i = 0; ok && i < n; i++) {
            ok = emit(j, "%s r%d ws", i ? " \",\" ws" : "", r[i]);
        }
        free(r);
        return ok && emit(j, " \"]\"");
    }
    int item = items == NULL || json_is_true(items) ? -2 : visit(j, items);
    if (item == -1) {
        return false;
    }
    char iname[32];
    snprintf(iname, sizeof(iname), item == -2 ? "json-value" : "r%d", item);
    if (hi == 0) {
        return emit(j, "\"[\" ws \"]\"");
    }
    if (!emit(j, "\"[\" ws ")) {
        return false;
    }
    bool ok = true;
    if (lo == 0) {
        ok = emit(j, "(");
    }
    ok = ok && emit(j, "%s ws", iname);
    long more_lo = lo > 0 ? (long)lo - 1 : 0;
    if (hi < 0) {
        ok = ok && emit(j, " (\",\" ws %s ws){%ld,}", iname, more_lo);
    } else if (hi > 1) {
        ok = ok && emit(j, " (\",\" ws %s ws){%ld,%lld}", iname, more_lo, (long long)hi - 1);
    }
    if (lo == 0) {
        ok = ok && emit(j, ")?");
    }
    return ok && emit(j, " \"]\"");
}

static bool emit_object(js_t *j, const json_t *s)
{
    const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    const json_t *add = json_object_get(s, "additionalProperties");
    if ((props != NULL && !json_is_object(props)) || (req != NULL && !json_is_array(req))) {
        return js_fail(j, "'properties' must be an object and 'required' an array");
    }
    size_t n = json_object_size(props), nreq = json_array_size(req);
    const char **names = calloc(n + nreq + 1, sizeof(char *));
    int *rules = calloc(n + nreq + 1, sizeof(int));
    bool *required = calloc(n + nreq + 1, sizeof(bool));
    bool ok = names != NULL && rules != NULL && required != NULL;
    size_t m = 0;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)props, k, v)
    {
        if (!ok) {
            break;
        }
        names[m] = k;
        rules[m] = visit(j, v);
        ok = rules[m] >= 0;
        m++;
    }
    for (size_t i = 0; ok && i < nreq; i++) {
        const char *r = json_string_value(json_array_get(req, i));
        if (r == NULL) {
            ok = js_fail(j, "'required' must list strings");
            break;
        }
        size_t at = 0;
        while (at < m && strcmp(names[at], r) != 0) {
            at++;
        }
        if (at == m) { /* required but not described: any value */
            names[m] = r;
            rules[m] = -2;
            m++;
        }
        required[at] = true;
    }
    int extra = -3; /* -3: none; -2: any value; else a rule */
    if (ok && (add == NULL || json_is_true(add))) {
        extra = -2;
    } else if (ok && json_is_object(add)) {
        extra = visit(j, add);
        ok = extra >= 0;
    } else if (ok && !json_is_false(add)) {
        ok = js_fail(j, "'additionalProperties' must be a boolean or a schema");
    }
    /* rest_i(first): properties i.. after none (first) or some were written, as rules
     * base + 2i (first) and base + 2i + 1; i == m: the extra properties */
    int base = -1;
    if (ok) {
        base = j->n_rules;
        for (size_t i = 0; i < 2 * (m + 1) && ok; i++) {
            ok = new_rule(j) >= 0;
        }
    }
    ok = ok && emit(j, "\"{\" ws r%d \"}\"", base);
    for (size_t i = 0; ok && i <= m; i++) {
        for (int first = 1; ok && first >= 0; first--) {
            int me = base + 2 * (int)i + (first ? 0 : 1), next_after = base + 2 * ((int)i + 1) + 1,
                next_same = base + 2 * ((int)i + 1) + (first ? 0 : 1);
            js_body_t saved;
            begin_rule(j, &saved);
            char val[32];
            if (i == m) { /* the extra properties */
                snprintf(val, sizeof(val), extra == -2 ? "json-value" : "r%d", extra);
                ok =
                    extra == -3
                        ? emit(j, "\"\"")
                        : emit(j,
                               "(%sjson-string ws \":\" ws %s ws (\",\" ws json-string ws \":\" ws %s ws)*)?",
                               first ? "" : "\",\" ws ", val, val);
            } else {
                snprintf(val, sizeof(val), rules[i] == -2 ? "json-value" : "r%d", rules[i]);
                json_t *kj = json_string(names[i]);
                ok = kj != NULL && emit(j, "%s", first ? "" : "\",\" ws ") && emit_json_literal(j, kj) &&
                     emit(j, " ws \":\" ws %s ws r%d", val, next_after);
                json_decref(kj);
                if (ok && !required[i]) {
                    ok = emit(j, " | r%d", next_same);
                }
            }
            ok = end_rule(j, &saved, me) && ok;
        }
    }
    free(names);
    free(rules);
    free(required);
    return ok;
}

/* ------------------------------------------------------------------ schemas */

/* The schema at a local reference ("#", "#/$defs/x", "#/definitions/x", JSON-pointer escaped). */
static const json_t *resolve(js_t *j, const char *ref)
{
    if (strcmp(ref, "#") == 0) {
        return j->root;
    }
    if (strncmp(ref, "#/", 2) != 0) {
        js_fail(j, "$ref '%s' is not supported (only local references: #/$defs/...)", ref);
        return NULL;
    }
    const json_t *at = j->root;
    const char *p = ref + 2;
    while (at != NULL && *p != '\0') {
        const char *e = strchr(p, '/');
        size_t n = e != NULL ? (size_t)(e - p) : strlen(p);
        char key[256];
        size_t k = 0;
        for (size_t i = 0; i < n && k + 1 < sizeof(key); i++) {
            if (p[i] == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1')) {
                key[k++] = p[i + 1] == '0' ? '~' : '/';
                i++;
            } else {
                key[k++] = p[i];
            }
        }
        key[k] = '\0';
        at = json_object_get(at, key);
        p += n + (e != NULL);
    }
    if (at == NULL) {
        js_fail(j, "$ref '%s' points at nothing", ref);
    }
    return at;
}

static const char *const OBJ_KW[] = {"properties", "required", "additionalProperties", NULL};
static const char *const ARR_KW[] = {"items", "prefixItems", "minItems", "maxItems", NULL};
static const char *const STR_KW[] = {"minLength", "maxLength", "pattern", "format", NULL};
static const char *const INT_KW[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};

/* The body for schema s restricted to one type name. */
static bool emit_type(js_t *j, const json_t *s, const char *t)
{
    if (strcmp(t, "object") == 0) {
        return emit_object(j, s);
    }
    if (strcmp(t, "array") == 0) {
        return emit_array(j, s);
    }
    if (strcmp(t, "string") == 0) {
        return emit_string(j, s);
    }
    if (strcmp(t, "integer") == 0) {
        return emit_integer(j, s);
    }
    if (strcmp(t, "number") == 0) {
        if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
            json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum")) {
            return js_fail(j, "bounds on a \"number\" are not supported (on an \"integer\" they are)");
        }
        return emit(j, "json-number");
    }
    if (strcmp(t, "boolean") == 0) {
        return emit(j, "(\"true\" | \"false\")");
    }
    if (strcmp(t, "null") == 0) {
        return emit(j, "\"null\"");
    }
    return js_fail(j, "unknown type '%s'", t);
}

/* Writes a rule for schema s; its number, or -1. */
static int visit(js_t *j, const json_t *s)
{
    if (j->failed) {
        return -1;
    }
    if (++j->depth > 64) {
        js_fail(j, "the schema nests deeper than 64");
        return -1;
    }
    int me = -1;
    const json_t *ref = json_object_get(s, "$ref");
    if (json_is_string(ref)) { /* one rule per reference: recursion refers back to it */
        for (int i = 0; i < j->n_refs; i++) {
            if (strcmp(j->refs[i].ref, json_string_value(ref)) == 0) {
                j->depth--;
                return j->refs[i].rule;
            }
        }
        static const char *const kw[] = {"$ref", NULL};
        if (!check_keywords(j, s, kw, "$ref")) {
            return -1;
        }
        const json_t *target = resolve(j, json_string_value(ref));
        if (target == NULL || j->n_refs == 256) {
            js_fail(j, "too many $refs");
            return -1;
        }
        me = new_rule(j);
        if (me < 0) {
            return -1;
        }
        j->refs[j->n_refs].ref = json_string_value(ref);
        j->refs[j->n_refs++].rule = me;
        js_body_t saved;
        begin_rule(j, &saved);
        int inner = visit(j, target);
        bool ok = inner >= 0 && emit(j, "r%d", inner);
        j->depth--;
        return end_rule(j, &saved, me) && ok ? me : -1;
    }
    me = new_rule(j);
    if (me < 0) {
        return -1;
    }
    js_body_t saved;
    begin_rule(j, &saved);
    bool ok = true;
    const json_t *any = json_object_get(s, "anyOf"), *one = json_object_get(s, "oneOf"),
                 *all = json_object_get(s, "allOf"), *en = json_object_get(s, "enum"),
                 *cn = json_object_get(s, "const"), *ty = json_object_get(s, "type");
    if (json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        ok = emit(j, "json-value");
    } else if (!json_is_object(s)) {
        ok = js_fail(j, "a schema must be an object or a boolean true");
    } else if (any != NULL || one != NULL) {
        const json_t *list = any != NULL ? any : one;
        static const char *const kw[] = {"anyOf", "oneOf", NULL};
        ok = check_keywords(j, s, kw, "anyOf/oneOf") && json_is_array(list) && json_array_size(list) > 0;
        if (!ok) {
            js_fail(j, "'anyOf'/'oneOf' must be a non-empty array, alone in its schema");
        }
        for (size_t i = 0; ok && i < json_array_size(list); i++) {
            int r = visit(j, json_array_get(list, i));
            ok = r >= 0 && emit(j, "%sr%d", i ? " | " : "", r);
        }
    } else if (all != NULL) {
        static const char *const kw[] = {"allOf", NULL};
        ok = check_keywords(j, s, kw, "allOf") && json_is_array(all) && json_array_size(all) == 1;
        if (!ok) {
            js_fail(j, "'allOf' is supported with one schema only");
        }
        int r = ok ? visit(j, json_array_get(all, 0)) : -1;
        ok = ok && r >= 0 && emit(j, "r%d", r);
    } else if (en != NULL || cn != NULL) {
        static const char *const kw[] = {"enum", "const", NULL};
        ok = check_keywords(j, s, kw, "enum/const");
        if (en != NULL && (!json_is_array(en) || json_array_size(en) == 0)) {
            ok = js_fail(j, "'enum' must be a non-empty array");
        }
        if (ok && cn != NULL) {
            ok = emit_json_literal(j, cn);
        }
        for (size_t i = 0; ok && en != NULL && cn == NULL && i < json_array_size(en); i++) {
            ok = emit(j, "%s", i ? " | " : "") && emit_json_literal(j, json_array_get(en, i));
        }
    } else {
        const char *const *kws[] = {OBJ_KW, ARR_KW, STR_KW, INT_KW};
        const char *k;
        const json_t *v;
        json_object_foreach((json_t *)s, k, v)
        {
            (void)v;
            bool known = known_keyword(k, NULL);
            for (size_t i = 0; !known && i < 4; i++) {
                known = known_keyword(k, kws[i]);
            }
            if (!known) {
                ok = js_fail(j, "JSON Schema keyword '%s' is not supported", k);
                break;
            }
        }
        if (ok && ty == NULL) { /* the type implied by the keywords */
            ok = json_object_get(s, "properties") || json_object_get(s, "required") ||
                         json_object_get(s, "additionalProperties")
                     ? emit_object(j, s)
                 : json_object_get(s, "items") || json_object_get(s, "prefixItems") ? emit_array(j, s)
                                                                                    : emit(j, "json-value");
        } else if (ok && json_is_string(ty)) {
            ok = emit_type(j, s, json_string_value(ty));
        } else if (ok && json_is_array(ty) && json_array_size(ty) > 0) {
            for (size_t i = 0; ok && i < json_array_size(ty); i++) {
                const char *t = json_string_value(json_array_get(ty, i));
                ok = t != NULL ? emit(j, "%s(", i ? " | " : "") && emit_type(j, s, t) && emit(j, ")")
                               : js_fail(j, "'type' must list type names");
            }
        } else if (ok) {
            ok = js_fail(j, "'type' must be a type name or a list of them");
        }
    }
    j->depth--;
    return end_rule(j, &saved, me) && ok ? me : -1;
}

char *pd_json_schema_to_gbnf(const json_t *schema, char *err, size_t err_len)
{
    js_t j = {.root = schema, .err = err, .err_len = err_len};
    if (err_len > 0) {
        err[0] = '\0';
    }
    const char *root_body = "json-object";
    char buf[32];
    if (schema != NULL) {
        int r = visit(&j, schema);
        if (r < 0) {
            free(j.rules);
            free(j.out);
            return NULL;
        }
        snprintf(buf, sizeof(buf), "r%d", r);
        root_body = buf;
    }
    size_t n = strlen(BASE_RULES) + j.rules_len + 64;
    char *out = malloc(n);
    if (out != NULL) {
        snprintf(out, n, "root ::= %s\n%s%s", root_body, BASE_RULES, j.rules != NULL ? j.rules : "");
    } else {
        snprintf(err, err_len, "out of memory");
    }
    free(j.rules);
    free(j.out);
    return out;
}
