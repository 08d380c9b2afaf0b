/* template/builtins.c — Jinja2's filters and tests, the globals chat templates call (range,
 * namespace, dict, raise_exception, strftime_now) and the str / dict methods the sandbox allows. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "template/tpl_internal.h"

/* ------------------------------------------------------------------ arguments */

typedef struct argv_ {
    tpl_value_t **v;
    size_t n;
    const char **kw;
} args_t;

/* The argument at position pos or named name; NULL when absent. */
static tpl_value_t *arg(const args_t *a, size_t pos, const char *name)
{
    size_t p = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw != NULL && a->kw[i] != NULL) {
            if (name != NULL && strcmp(a->kw[i], name) == 0) {
                return a->v[i];
            }
        } else if (p++ == pos) {
            return a->v[i];
        }
    }
    return NULL;
}

static size_t npositional(const args_t *a)
{
    size_t p = 0;
    for (size_t i = 0; i < a->n; i++) {
        p += a->kw == NULL || a->kw[i] == NULL;
    }
    return p;
}

static bool arg_bool(const args_t *a, size_t pos, const char *name, bool def)
{
    tpl_value_t *v = arg(a, pos, name);
    return v != NULL ? tv_truthy(v) : def;
}

static bool need_str(tpl_render_t *r, const tpl_node_t *at, const char *what, tpl_value_t *v)
{
    if (v->kind != TV_STR) {
        tpl_fail(r, at, "%s expects a string, got %s", what, tv_type_name(v));
        return false;
    }
    return true;
}

/* ------------------------------------------------------------------ unicode helpers */

static bool py_space_cp(int32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000;
}

static bool cp_in(int32_t cp, const tpl_value_t *chars)
{
    if (chars == NULL || chars->kind != TV_STR) {
        return py_space_cp(cp);
    }
    size_t i = 0;
    while (i < chars->u.str.len) {
        int32_t c;
        i += tv_utf8_next(chars->u.str.s, chars->u.str.len, i, &c);
        if (c == cp) {
            return true;
        }
    }
    return false;
}

/* Python's str.strip family: which = 1 left, 2 right, 3 both. */
static tpl_value_t *strip(tpl_render_t *r, tpl_value_t *s, const tpl_value_t *chars, int which)
{
    size_t b = 0, e = s->u.str.len;
    if (which & 1) {
        while (b < e) {
            int32_t cp;
            size_t w = tv_utf8_next(s->u.str.s, e, b, &cp);
            if (!cp_in(cp, chars)) {
                break;
            }
            b += w;
        }
    }
    if (which & 2) {
        while (e > b) {
            size_t p = e - 1;
            while (p > b && ((unsigned char)s->u.str.s[p] & 0xc0) == 0x80) {
                p--;
            }
            int32_t cp;
            tv_utf8_next(s->u.str.s, e, p, &cp);
            if (!cp_in(cp, chars)) {
                break;
            }
            e = p;
        }
    }
    return tv_str_nocopy(r, s->u.str.s + b, e - b);
}

/* mode: 0 lower, 1 upper, 2 capitalize, 3 title (Jinja's filter), 4 str.title */
static tpl_value_t *recase(tpl_render_t *r, const tpl_value_t *s, int mode)
{
    char *out = tpl_alloc(r, s->u.str.len * 2 + 4);
    if (out == NULL) {
        return NULL;
    }
    size_t i = 0, k = 0;
    bool word_start = true, first = true;
    while (i < s->u.str.len) {
        int32_t cp;
        i += tv_utf8_next(s->u.str.s, s->u.str.len, i, &cp);
        int32_t o;
        if (mode == 0) {
            o = utf8proc_tolower(cp);
        } else if (mode == 1) {
            o = utf8proc_toupper(cp);
        } else if (mode == 2) {
            o = first ? utf8proc_totitle(cp) : utf8proc_tolower(cp);
        } else {
            o = word_start ? utf8proc_totitle(cp) : utf8proc_tolower(cp);
            if (mode == 3) {
                word_start = py_space_cp(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
            } else {
                utf8proc_category_t c = utf8proc_category(cp);
                word_start =
                    !(c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT ||
                      c == UTF8PROC_CATEGORY_LM || c == UTF8PROC_CATEGORY_LO);
            }
        }
        first = false;
        unsigned char buf[4];
        utf8proc_ssize_t w = utf8proc_encode_char(o, buf);
        if ((size_t)w + k > s->u.str.len * 2 + 3) {
            break;
        }
        memcpy(out + k, buf, (size_t)w);
        k += (size_t)w;
    }
    out[k] = '\0';
    return tv_str_nocopy(r, out, k);
}

static tpl_value_t *replace(tpl_render_t *r, tpl_value_t *s, tpl_value_t *old, tpl_value_t *nw, int64_t count)
{
    tpl_buf_t b = {0};
    size_t i = 0;
    int64_t done = 0;
    const char *S = s->u.str.s;
    size_t n = s->u.str.len, ol = old->u.str.len;
    while (i <= n) {
        if (count >= 0 && done >= count) {
            break;
        }
        if (ol == 0) { /* Python inserts the replacement between characters */
            tb_put(&b, nw->u.str.s, nw->u.str.len);
            done++;
            if (i == n) {
                i = n + 1;
                break;
            }
            int32_t cp;
            size_t w = tv_utf8_next(S, n, i, &cp);
            tb_put(&b, S + i, w);
            i += w;
            continue;
        }
        const char *hit = memmem(S + i, n - i, old->u.str.s, ol);
        if (hit == NULL) {
            break;
        }
        tb_put(&b, S + i, (size_t)(hit - (S + i)));
        tb_put(&b, nw->u.str.s, nw->u.str.len);
        i = (size_t)(hit - S) + ol;
        done++;
    }
    if (i < n) {
        tb_put(&b, S + i, n - i);
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, NULL, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *split(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *s, tpl_value_t *sep,
                          int64_t maxsplit)
{
    tpl_value_t *parts[4096];
    size_t np = 0;
    const char *S = s->u.str.s;
    size_t n = s->u.str.len, i = 0;
    tpl_value_t *out;
    if (sep == NULL || sep->kind == TV_NONE) {
        while (i < n) {
            int32_t cp;
            while (i < n && (tv_utf8_next(S, n, i, &cp), py_space_cp(cp))) {
                i += tv_utf8_next(S, n, i, &cp);
            }
            if (i >= n) {
                break;
            }
            size_t b = i;
            if (maxsplit >= 0 && (int64_t)np >= maxsplit) {
                /* the rest, with trailing whitespace stripped */
                size_t e = n;
                while (e > b) {
                    size_t p = e - 1;
                    while (p > b && ((unsigned char)S[p] & 0xc0) == 0x80) {
                        p--;
                    }
                    tv_utf8_next(S, e, p, &cp);
                    if (!py_space_cp(cp)) {
                        break;
                    }
                    e = p;
                }
                if (np == 4096) {
                    return tpl_fail(r, at, "split: too many parts");
                }
                parts[np++] = tv_str(r, S + b, e - b);
                break;
            }
            while (i < n && (tv_utf8_next(S, n, i, &cp), !py_space_cp(cp))) {
                i += tv_utf8_next(S, n, i, &cp);
            }
            if (np == 4096) {
                return tpl_fail(r, at, "split: too many parts");
            }
            parts[np++] = tv_str(r, S + b, i - b);
        }
    } else {
        if (!need_str(r, at, "split", sep)) {
            return NULL;
        }
        if (sep->u.str.len == 0) {
            return tpl_fail(r, at, "empty separator");
        }
        for (;;) {
            const char *hit = (maxsplit >= 0 && (int64_t)np >= maxsplit)
                                  ? NULL
                                  : memmem(S + i, n - i, sep->u.str.s, sep->u.str.len);
            if (np == 4096) {
                return tpl_fail(r, at, "split: too many parts");
            }
            if (hit == NULL) {
                parts[np++] = tv_str(r, S + i, n - i);
                break;
            }
            parts[np++] = tv_str(r, S + i, (size_t)(hit - (S + i)));
            i = (size_t)(hit - S) + sep->u.str.len;
        }
    }
    out = tv_list(r, np);
    for (size_t k = 0; out != NULL && k < np; k++) {
        if (parts[k] == NULL) {
            return NULL;
        }
        out->u.list.items[k] = parts[k];
    }
    return out;
}

/* Code points in s[0, n), and the byte offset of code point k (n when past the end). */
static size_t cp_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        k += ((unsigned char)s[i] & 0xc0) != 0x80;
    }
    return k;
}

static size_t cp_offset(const char *s, size_t n, size_t k)
{
    size_t i = 0;
    for (int32_t cp; i < n && k > 0; k--) {
        i += tv_utf8_next(s, n, i, &cp);
    }
    return i;
}

/* Python's str.center(width, fillchar) (the extra fill of an odd margin goes left when width is odd,
 * as CPython's pad()), str.zfill(width). */
static tpl_value_t *pad(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *s, const tpl_value_t *width,
                        const tpl_value_t *fill, bool zfill)
{
    if (width == NULL || width->kind != TV_INT) {
        return tpl_fail(r, at, "%s: the width must be an integer", zfill ? "zfill" : "center");
    }
    const char *f = " ";
    size_t fl = 1;
    if (fill != NULL) {
        if (fill->kind != TV_STR || cp_count(fill->u.str.s, fill->u.str.len) != 1) {
            return tpl_fail(r, at, "center: the fill character must be exactly one character long");
        }
        f = fill->u.str.s;
        fl = fill->u.str.len;
    }
    size_t len = cp_count(s->u.str.s, s->u.str.len);
    if (width->u.i <= (int64_t)len) {
        return tv_str(r, s->u.str.s, s->u.str.len);
    }
    if (width->u.i > (1 << 20)) {
        return tpl_fail(r, at, "%s: width %lld is too large", zfill ? "zfill" : "center",
                        (long long)width->u.i);
    }
    size_t marg = (size_t)width->u.i - len;
    size_t left = zfill ? marg : marg / 2 + (marg & (size_t)width->u.i & 1);
    tpl_buf_t b = {0};
    size_t sign = zfill && s->u.str.len > 0 && (s->u.str.s[0] == '+' || s->u.str.s[0] == '-');
    tb_put(&b, s->u.str.s, sign);
    for (size_t i = 0; i < left; i++) {
        tb_put(&b, zfill ? "0" : f, zfill ? 1 : fl);
    }
    tb_put(&b, s->u.str.s + sign, s->u.str.len - sign);
    for (size_t i = left; i < marg; i++) {
        tb_put(&b, f, fl);
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

/* Python's str.rsplit(sep, maxsplit): split's parts, taken from the right when maxsplit is set. */
#define ASCII_SPACE(c) ((unsigned char)(c) < 0x80 && py_space_cp((unsigned char)(c)))

/* (with maxsplit and no separator, only ASCII whitespace separates: a multi-byte space does not) */
static tpl_value_t *rsplit(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *s, tpl_value_t *sep,
                           int64_t maxsplit)
{
    if (maxsplit < 0) {
        return split(r, at, s, sep, -1);
    }
    if (sep != NULL && sep->kind != TV_NONE && (!need_str(r, at, "rsplit", sep) || sep->u.str.len == 0)) {
        return sep->kind == TV_STR ? tpl_fail(r, at, "empty separator") : NULL;
    }
    tpl_value_t *parts[4096];
    size_t np = 0;
    const char *S = s->u.str.s;
    size_t e = s->u.str.len; /* the unsplit part is S[0, e) */
    bool ws = sep == NULL || sep->kind == TV_NONE;
    while (np < 4096) {
        if (ws) {
            while (e > 0 && ASCII_SPACE(S[e - 1])) { /* whitespace from the right */
                e--;
            }
            if (e == 0) {
                break;
            }
            size_t b = e;
            while (b > 0 && !ASCII_SPACE(S[b - 1])) {
                b--;
            }
            if ((int64_t)np == maxsplit || b == 0) { /* the rest, its leading whitespace kept */
                parts[np++] = tv_str(r, S, e);
                break;
            }
            parts[np++] = tv_str(r, S + b, e - b);
            e = b;
        } else {
            const char *hit = NULL;
            size_t L = sep->u.str.len;
            for (size_t i = e >= L ? e - L + 1 : 0; (int64_t)np < maxsplit && i-- > 0;) {
                if (memcmp(S + i, sep->u.str.s, L) == 0) {
                    hit = S + i;
                    break;
                }
            }
            if (hit == NULL) {
                parts[np++] = tv_str(r, S, e);
                break;
            }
            parts[np++] = tv_str(r, hit + L, e - (size_t)(hit - S) - L);
            e = (size_t)(hit - S);
        }
    }
    if (np == 4096) {
        return tpl_fail(r, at, "rsplit: too many parts");
    }
    tpl_value_t *out = tv_list(r, np);
    for (size_t k = 0; out != NULL && k < np; k++) {
        if (parts[np - 1 - k] == NULL) {
            return NULL;
        }
        out->u.list.items[k] = parts[np - 1 - k];
    }
    return out;
}

/* Python's str.splitlines(): lines end at \n, \r, \r\n (one break), \v, \f, \x1c-\x1e, U+0085,
 * U+2028 and U+2029; the break is not kept and a break at the end starts no line. */
static tpl_value_t *splitlines(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *s)
{
    tpl_value_t *parts[4096];
    size_t np = 0;
    const char *S = s->u.str.s;
    size_t n = s->u.str.len, b = 0;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        size_t len = tv_utf8_next(S, n, i, &cp);
        bool brk = cp == '\n' || cp == '\r' || cp == 0x0b || cp == 0x0c || (cp >= 0x1c && cp <= 0x1e) ||
                   cp == 0x85 || cp == 0x2028 || cp == 0x2029;
        if (!brk) {
            i += len;
            continue;
        }
        if (np == 4096) {
            return tpl_fail(r, at, "splitlines: too many lines");
        }
        parts[np++] = tv_str(r, S + b, i - b);
        i += len + (cp == '\r' && i + len < n && S[i + len] == '\n'); /* \r\n is one break */
        b = i;
    }
    if (b < n) {
        if (np == 4096) {
            return tpl_fail(r, at, "splitlines: too many lines");
        }
        parts[np++] = tv_str(r, S + b, n - b);
    }
    tpl_value_t *out = tv_list(r, np);
    for (size_t k = 0; out != NULL && k < np; k++) {
        if (parts[k] == NULL) {
            return NULL;
        }
        out->u.list.items[k] = parts[k];
    }
    return out;
}

static int prefix_test(const tpl_value_t *s, const tpl_value_t *p, bool suffix)
{
    if (p->kind == TV_LIST) {
        for (size_t i = 0; i < p->u.list.n; i++) {
            int t = prefix_test(s, p->u.list.items[i], suffix);
            if (t != 0) {
                return t;
            }
        }
        return 0;
    }
    if (p->kind != TV_STR) {
        return -1;
    }
    if (p->u.str.len > s->u.str.len) {
        return 0;
    }
    const char *at = suffix ? s->u.str.s + s->u.str.len - p->u.str.len : s->u.str.s;
    return memcmp(at, p->u.str.s, p->u.str.len) == 0;
}

/* ------------------------------------------------------------------ conversions */

static tpl_value_t *to_int(tpl_render_t *r, tpl_value_t *v, tpl_value_t *def)
{
    switch (v->kind) {
    case TV_INT: return v;
    case TV_BOOL: return tv_int(r, v->u.b);
    case TV_FLOAT:
        if (!isfinite(v->u.f) || fabs(v->u.f) > 9.2e18) {
            return def;
        }
        return tv_int(r, (int64_t)v->u.f);
    case TV_STR: {
        char buf[128];
        size_t n = v->u.str.len < sizeof(buf) - 1 ? v->u.str.len : sizeof(buf) - 1;
        memcpy(buf, v->u.str.s, n);
        buf[n] = '\0';
        char *e = NULL;
        errno = 0;
        long long x = strtoll(buf, &e, 10);
        bool range = errno == ERANGE;
        while (e != NULL && (*e == ' ' || *e == '\t' || *e == '\n')) {
            e++;
        }
        if (e != buf && e != NULL && *e == '\0') {
            /* Python's int is unbounded: a clamped number would be a wrong answer */
            return range ? tpl_fail(r, NULL, "int: %s is past the 64-bit integers pdserve computes with", buf)
                         : tv_int(r, x);
        }
        double d = strtod(buf, &e);
        while (e != NULL && (*e == ' ' || *e == '\t' || *e == '\n')) {
            e++;
        }
        if (e != buf && e != NULL && *e == '\0' && isfinite(d) && fabs(d) < 9.2e18) {
            return tv_int(r, (int64_t)d);
        }
        return def;
    }
    default: return def;
    }
}

static tpl_value_t *to_float(tpl_render_t *r, tpl_value_t *v, tpl_value_t *def)
{
    if (tv_is_number(v)) {
        return tv_float(r, tv_as_double(v));
    }
    if (v->kind == TV_STR) {
        char buf[128];
        size_t n = v->u.str.len < sizeof(buf) - 1 ? v->u.str.len : sizeof(buf) - 1;
        memcpy(buf, v->u.str.s, n);
        buf[n] = '\0';
        char *e = NULL;
        double d = strtod(buf, &e);
        if (e != buf && e != NULL && *e == '\0') {
            return tv_float(r, d);
        }
    }
    return def;
}

/* Attribute lookup used by map/selectattr/sort(attribute=): "a.b" walks items, then attributes. */
static tpl_value_t *lookup_path(tpl_render_t *r, tpl_value_t *v, tpl_value_t *path)
{
    if (path->kind == TV_INT) {
        if (v->kind == TV_LIST && path->u.i >= 0 && (size_t)path->u.i < v->u.list.n) {
            return v->u.list.items[path->u.i];
        }
        return tv_undef(r, "no such item");
    }
    if (path->kind != TV_STR) {
        return tv_undef(r, "bad attribute");
    }
    const char *s = path->u.str.s;
    size_t n = path->u.str.len, i = 0;
    while (i <= n && v != NULL) {
        const char *dot = memchr(s + i, '.', n - i);
        size_t e = dot != NULL ? (size_t)(dot - s) : n;
        tpl_value_t *next = NULL;
        if (v->kind == TV_DICT || v->kind == TV_NS) {
            next = tv_dict_get_str(v->u.dict, s + i, e - i);
        }
        if (next == NULL) {
            return tv_undef(r, "no such attribute");
        }
        v = next;
        if (dot == NULL) {
            break;
        }
        i = e + 1;
    }
    return v;
}

/* Lower-cased copy for case-insensitive comparisons (non-strings unchanged). */
static tpl_value_t *fold(tpl_render_t *r, tpl_value_t *v, bool case_sensitive)
{
    return !case_sensitive && v->kind == TV_STR ? recase(r, v, 0) : v;
}

static tpl_value_t *list_of(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *v)
{
    tpl_value_t *items = tpl_iterable(r, at, v);
    if (items == NULL || !items->is_tuple) {
        return items;
    }
    tpl_value_t *l = tv_list(r, items->u.list.n);
    if (l != NULL) {
        memcpy(l->u.list.items, items->u.list.items, items->u.list.n * sizeof(tpl_value_t *));
    }
    return l;
}

/* ------------------------------------------------------------------ tests */

static const char *const TESTS[] = {"defined",  "undefined", "none",   "boolean", "false",       "true",
                                    "integer",  "float",     "number", "string",  "mapping",     "iterable",
                                    "sequence", "callable",  "odd",    "even",    "divisibleby", "eq",
                                    "equalto",  "==",        "ne",     "!=",      "lt",          "lessthan",
                                    "<",        "le",        "<=",     "gt",      "greaterthan", ">",
                                    "ge",       ">=",        "in",     "lower",   "upper",       "sameas",
                                    "escaped",  NULL};

bool tpl_test_exists(const char *name)
{
    for (int i = 0; TESTS[i] != NULL; i++) {
        if (strcmp(TESTS[i], name) == 0) {
            return true;
        }
    }
    return false;
}

int tpl_test(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *v, tpl_value_t **args,
             size_t n)
{
    tpl_value_t *a0 = n > 0 ? args[0] : NULL;
#define IS(s) (strcmp(name, s) == 0)
    if (IS("defined")) {
        return v->kind != TV_UNDEF;
    }
    if (IS("undefined")) {
        return v->kind == TV_UNDEF;
    }
    if (IS("none")) {
        return v->kind == TV_NONE;
    }
    if (IS("boolean")) {
        return v->kind == TV_BOOL;
    }
    if (IS("false")) {
        return v->kind == TV_BOOL && !v->u.b;
    }
    if (IS("true")) {
        return v->kind == TV_BOOL && v->u.b;
    }
    if (IS("integer")) {
        return v->kind == TV_INT;
    }
    if (IS("float")) {
        return v->kind == TV_FLOAT;
    }
    if (IS("number")) {
        return tv_is_number(v);
    }
    if (IS("string")) {
        return v->kind == TV_STR;
    }
    if (IS("mapping")) {
        return v->kind == TV_DICT;
    }
    if (IS("iterable")) {
        return v->kind == TV_LIST || v->kind == TV_DICT || v->kind == TV_STR || v->kind == TV_UNDEF;
    }
    if (IS("sequence")) {
        return v->kind == TV_LIST || v->kind == TV_DICT || v->kind == TV_STR;
    }
    if (IS("callable")) {
        return v->kind == TV_MACRO || v->kind == TV_FUNC || v->kind == TV_METHOD;
    }
    if (IS("escaped")) {
        return 0;
    }
    if (IS("lower") || IS("upper")) {
        if (v->kind != TV_STR) {
            tpl_fail(r, at, "test '%s' needs a string", name);
            return -1;
        }
        tpl_value_t *c = recase(r, v, IS("lower") ? 0 : 1);
        return c != NULL ? tv_equal(c, v) : -1;
    }
    if (IS("odd") || IS("even") || IS("divisibleby")) {
        if (v->kind != TV_INT && v->kind != TV_BOOL) {
            tpl_fail(r, at, "test '%s' needs an integer", name);
            return -1;
        }
        int64_t x = v->kind == TV_BOOL ? v->u.b : v->u.i;
        if (IS("divisibleby")) {
            if (a0 == NULL || a0->kind != TV_INT || a0->u.i == 0) {
                tpl_fail(r, at, "divisibleby needs a non-zero integer");
                return -1;
            }
            return x % a0->u.i == 0;
        }
        return (x % 2 != 0) == IS("odd");
    }
    if (a0 == NULL) {
        if (tpl_test_exists(name)) {
            tpl_fail(r, at, "test '%s' needs an argument", name);
        } else {
            tpl_fail(r, at, "no test named '%s'", name);
        }
        return -1;
    }
    if (IS("eq") || IS("equalto") || IS("==")) {
        return tv_equal(v, a0);
    }
    if (IS("ne") || IS("!=")) {
        return !tv_equal(v, a0);
    }
    if (IS("sameas")) {
        return v == a0 ||
               (v->kind == a0->kind && (v->kind == TV_NONE || v->kind == TV_BOOL) && tv_equal(v, a0));
    }
    if (IS("in")) {
        if (a0->kind == TV_STR) {
            if (v->kind != TV_STR) {
                tpl_fail(r, at, "'in <string>' requires string as left operand");
                return -1;
            }
            return memmem(a0->u.str.s, a0->u.str.len, v->u.str.s, v->u.str.len) != NULL || v->u.str.len == 0;
        }
        if (a0->kind == TV_DICT) {
            return tv_dict_get(a0->u.dict, v) != NULL;
        }
        if (a0->kind == TV_LIST) {
            for (size_t i = 0; i < a0->u.list.n; i++) {
                if (tv_equal(v, a0->u.list.items[i])) {
                    return 1;
                }
            }
            return 0;
        }
        tpl_fail(r, at, "test 'in' needs a container");
        return -1;
    }
    int c = tpl_order(v, a0);
    if (c == 2) {
        if (tpl_test_exists(name)) {
            tpl_fail(r, at, "test '%s': values of types %s and %s cannot be compared", name, tv_type_name(v),
                     tv_type_name(a0));
        } else {
            tpl_fail(r, at, "no test named '%s'", name);
        }
        return -1;
    }
    if (IS("lt") || IS("lessthan") || IS("<")) {
        return c < 0;
    }
    if (IS("le") || IS("<=")) {
        return c <= 0;
    }
    if (IS("gt") || IS("greaterthan") || IS(">")) {
        return c > 0;
    }
    if (IS("ge") || IS(">=")) {
        return c >= 0;
    }
#undef IS
    tpl_fail(r, at, "no test named '%s'", name);
    return -1;
}

/* ------------------------------------------------------------------ filters */

/* select / reject / selectattr / rejectattr */
static tpl_value_t *select_items(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a,
                                 bool by_attr, bool keep)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    size_t first_arg = by_attr ? 1 : 0;
    tpl_value_t *attr = by_attr ? arg(a, 0, NULL) : NULL;
    if (by_attr && attr == NULL) {
        return tpl_fail(r, at, "selectattr/rejectattr need an attribute name");
    }
    tpl_value_t *test = arg(a, first_arg, NULL);
    if (test != NULL && test->kind != TV_STR) {
        return tpl_fail(r, at, "the test name must be a string");
    }
    size_t np = npositional(a);
    size_t nta = np > first_arg + 1 ? np - first_arg - 1 : 0;
    tpl_value_t **targs = a->v + first_arg + 1;
    tpl_value_t *out = tv_list(r, items->u.list.n);
    if (out == NULL) {
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < items->u.list.n; i++) {
        tpl_value_t *x = items->u.list.items[i];
        tpl_value_t *v = by_attr ? lookup_path(r, x, attr) : x;
        if (v == NULL) {
            return NULL;
        }
        int t;
        if (test == NULL) {
            t = tv_truthy(v);
        } else {
            t = tpl_test(r, at, test->u.str.s, v, targs, nta);
            if (t < 0) {
                return NULL;
            }
        }
        if ((t == 1) == keep) {
            out->u.list.items[k++] = x;
        }
    }
    out->u.list.n = k;
    return out;
}

static tpl_value_t *map_items(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    tpl_value_t *attr = arg(a, (size_t)-1, "attribute");
    tpl_value_t *def = arg(a, (size_t)-1, "default");
    tpl_value_t *out = tv_list(r, items->u.list.n);
    if (out == NULL) {
        return NULL;
    }
    tpl_value_t *fname = attr == NULL ? arg(a, 0, NULL) : NULL;
    if (attr == NULL && (fname == NULL || fname->kind != TV_STR)) {
        return tpl_fail(r, at, "map needs attribute= or a filter name");
    }
    for (size_t i = 0; i < items->u.list.n; i++) {
        tpl_value_t *x = items->u.list.items[i];
        tpl_value_t *v;
        if (attr != NULL) {
            v = lookup_path(r, x, attr);
            if (v != NULL && v->kind == TV_UNDEF && def != NULL) {
                v = def;
            }
        } else {
            size_t np = npositional(a);
            v = tpl_filter(r, at, fname->u.str.s, x, a->v + 1, np > 0 ? np - 1 : 0, NULL);
        }
        if (v == NULL) {
            return NULL;
        }
        out->u.list.items[i] = v;
    }
    return out;
}

static int cmp_keys(const tpl_value_t *a, const tpl_value_t *b, bool *bad)
{
    int c = tpl_order(a, b);
    if (c == 2) {
        *bad = true;
        return 0;
    }
    return c;
}

static tpl_value_t *sort_items(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    bool rev = arg_bool(a, 0, "reverse", false);
    bool cs = arg_bool(a, 1, "case_sensitive", false);
    tpl_value_t *attr = arg(a, 2, "attribute");
    size_t n = items->u.list.n;
    tpl_value_t *out = tv_list(r, n);
    tpl_value_t **keys = tpl_alloc(r, (n ? n : 1) * sizeof(tpl_value_t *));
    if (out == NULL || keys == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        tpl_value_t *x = items->u.list.items[i];
        tpl_value_t *k = attr != NULL ? lookup_path(r, x, attr) : x;
        keys[i] = k != NULL ? fold(r, k, cs) : NULL;
        out->u.list.items[i] = x;
        if (keys[i] == NULL) {
            return NULL;
        }
    }
    bool bad = false;
    for (size_t i = 1; i < n; i++) { /* stable insertion sort */
        tpl_value_t *x = out->u.list.items[i], *kx = keys[i];
        size_t j = i;
        while (j > 0) {
            int c = cmp_keys(keys[j - 1], kx, &bad);
            if (rev ? c >= 0 : c <= 0) {
                break;
            }
            out->u.list.items[j] = out->u.list.items[j - 1];
            keys[j] = keys[j - 1];
            j--;
        }
        out->u.list.items[j] = x;
        keys[j] = kx;
    }
    if (bad) {
        return tpl_fail(r, at, "sort: the items cannot be compared");
    }
    return out;
}

static tpl_value_t *minmax(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a, bool max)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    tpl_value_t *attr = arg(a, 1, "attribute");
    tpl_value_t *best = NULL, *bestk = NULL;
    bool bad = false;
    for (size_t i = 0; i < items->u.list.n; i++) {
        tpl_value_t *x = items->u.list.items[i];
        tpl_value_t *k = attr != NULL ? lookup_path(r, x, attr) : x;
        k = k != NULL ? fold(r, k, cs) : NULL;
        if (k == NULL) {
            return NULL;
        }
        if (best == NULL || (max ? cmp_keys(k, bestk, &bad) > 0 : cmp_keys(k, bestk, &bad) < 0)) {
            best = x;
            bestk = k;
        }
    }
    if (bad) {
        return tpl_fail(r, at, "%s: the items cannot be compared", max ? "max" : "min");
    }
    return best != NULL ? best : tv_undef(r, "No aggregated item, sequence was empty.");
}

static tpl_value_t *f_tojson(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    /* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
    bool ensure_ascii = arg_bool(a, 0, "ensure_ascii", false);
    tpl_value_t *ind = arg(a, 1, "indent");
    tpl_value_t *seps = arg(a, 2, "separators");
    bool sort_keys = arg_bool(a, 3, "sort_keys", false);
    int indent = -1;
    if (ind != NULL && ind->kind != TV_NONE) {
        if (ind->kind != TV_INT || ind->u.i < 0 || ind->u.i > 64) {
            return tpl_fail(r, at, "tojson: indent must be an integer in [0, 64]");
        }
        indent = (int)ind->u.i;
    }
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    if (seps != NULL && seps->kind != TV_NONE) {
        if (seps->kind != TV_LIST || seps->u.list.n != 2 || seps->u.list.items[0]->kind != TV_STR ||
            seps->u.list.items[1]->kind != TV_STR) {
            return tpl_fail(r, at, "tojson: separators must be a pair of strings");
        }
        item_sep = seps->u.list.items[0]->u.str.s;
        key_sep = seps->u.list.items[1]->u.str.s;
    }
    tpl_buf_t b = {0};
    bool ok = tv_tojson_into(r, &b, in, indent, 0, item_sep, key_sep, sort_keys, ensure_ascii);
    tpl_value_t *v = NULL;
    if (ok && !b.failed) {
        v = tv_str(r, b.p != NULL ? b.p : "", b.n);
    } else if (ok) {
        tpl_fail(r, at, "out of memory");
    } else {
        tpl_fail(r, at, "tojson failed");
    }
    tb_free(&b);
    return v;
}

/* Jinja's truncate(s, length=255, killwords=False, end='...', leeway=5): a string within length +
 * leeway characters stays; else cut to length - len(end), at the last space unless killwords. */
static tpl_value_t *f_truncate(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *s = tv_to_str(r, in);
    tpl_value_t *length = arg(a, 0, "length"), *kill = arg(a, 1, "killwords"), *end = arg(a, 2, "end"),
                *leeway = arg(a, 3, "leeway");
    if (s == NULL) {
        return NULL;
    }
    if ((length != NULL && length->kind != TV_INT) || (end != NULL && end->kind != TV_STR) ||
        (leeway != NULL && leeway->kind != TV_INT && leeway->kind != TV_NONE)) {
        return tpl_fail(r, at, "truncate: length and leeway must be integers, end a string");
    }
    int64_t L = length != NULL ? length->u.i : 255;
    int64_t lw = leeway != NULL && leeway->kind == TV_INT ? leeway->u.i : 5;
    const char *e = end != NULL ? end->u.str.s : "...";
    size_t el = end != NULL ? end->u.str.len : 3;
    int64_t ecp = (int64_t)cp_count(e, el);
    if (L < ecp) {
        return tpl_fail(r, at, "expected length >= %lld, got %lld", (long long)ecp, (long long)L);
    }
    if (lw < 0) {
        return tpl_fail(r, at, "expected leeway >= 0, got %lld", (long long)lw);
    }
    size_t n = cp_count(s->u.str.s, s->u.str.len);
    if ((int64_t)n <= L + lw) {
        return s;
    }
    size_t cut = cp_offset(s->u.str.s, s->u.str.len, (size_t)(L - ecp));
    if (kill == NULL || !tv_truthy(kill)) { /* s[:cut].rsplit(" ", 1)[0] */
        for (size_t i = cut; i-- > 0;) {
            if (s->u.str.s[i] == ' ') {
                cut = i;
                break;
            }
        }
    }
    tpl_buf_t b = {0};
    tb_put(&b, s->u.str.s, cut);
    tb_put(&b, e, el);
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

/* Jinja's batch(value, linecount, fill_with=None): lists of linecount items, the last filled up with
 * fill_with when given. */
static tpl_value_t *f_batch(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *cnt = arg(a, 0, "linecount"), *fill = arg(a, 1, "fill_with");
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    if (cnt == NULL || cnt->kind != TV_INT || cnt->u.i <= 0) {
        return tpl_fail(r, at, "batch: linecount must be a positive integer");
    }
    size_t k = (size_t)cnt->u.i, n = items->u.list.n, nb = (n + k - 1) / k;
    tpl_value_t *out = tv_list(r, nb);
    for (size_t i = 0; out != NULL && i < nb; i++) {
        size_t m = n - i * k < k ? n - i * k : k;
        bool filled = fill != NULL && fill->kind != TV_NONE && m < k;
        tpl_value_t *row = tv_list(r, filled ? k : m);
        if (row == NULL) {
            return NULL;
        }
        for (size_t j = 0; j < row->u.list.n; j++) {
            row->u.list.items[j] = j < m ? items->u.list.items[i * k + j] : fill;
        }
        out->u.list.items[i] = row;
    }
    return out;
}

static tpl_value_t *f_indent(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *s = tv_to_str(r, in);
    if (s == NULL) {
        return NULL;
    }
    tpl_value_t *w = arg(a, 0, "width");
    bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
    char pad[256];
    size_t pl = 4;
    if (w != NULL && w->kind == TV_STR) {
        pl = w->u.str.len < sizeof(pad) ? w->u.str.len : sizeof(pad) - 1;
        memcpy(pad, w->u.str.s, pl);
    } else {
        int64_t width = w != NULL && w->kind == TV_INT ? w->u.i : 4;
        pl = width < 0 ? 0 : width > 255 ? 255 : (size_t)width;
        memset(pad, ' ', pl);
    }
    /* Jinja 3's: the lines of s + "\n" (str.splitlines: every line break), joined by "\n" and the pad
     * (blank: before every line; else before the non-empty ones after the first) */
    tpl_buf_t sn = {0};
    tb_put(&sn, s->u.str.s, s->u.str.len);
    tb_puts(&sn, "\n");
    tpl_value_t *whole = sn.failed ? NULL : tv_str(r, sn.p, sn.n);
    tb_free(&sn);
    tpl_value_t *lines = whole != NULL ? splitlines(r, at, whole) : NULL;
    if (lines == NULL) {
        return NULL; /* the limit or out of memory: the render failed with why */
    }
    tpl_buf_t b = {0};
    if (first) {
        tb_put(&b, pad, pl);
    }
    for (size_t k = 0; k < lines->u.list.n; k++) {
        const tpl_value_t *line = lines->u.list.items[k];
        if (k > 0) {
            tb_puts(&b, "\n");
            if (line->u.str.len > 0 || blank) {
                tb_put(&b, pad, pl);
            }
        }
        tb_put(&b, line->u.str.s, line->u.str.len);
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *f_join(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    tpl_value_t *sep = arg(a, 0, "d");
    tpl_value_t *attr = arg(a, 1, "attribute");
    tpl_buf_t b = {0};
    for (size_t i = 0; i < items->u.list.n; i++) {
        if (i > 0 && sep != NULL) {
            tv_str_into(&b, sep);
        }
        tpl_value_t *x = items->u.list.items[i];
        if (attr != NULL) {
            x = lookup_path(r, x, attr);
            if (x == NULL) {
                tb_free(&b);
                return NULL;
            }
        }
        tv_str_into(&b, x);
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *f_format(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fmt, tpl_value_t **args,
                             size_t n);

tpl_value_t *tpl_percent(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fmt, tpl_value_t *arg)
{
    if (arg->kind == TV_LIST && arg->is_tuple) {
        return f_format(r, at, fmt, arg->u.list.items, arg->u.list.n);
    }
    return f_format(r, at, fmt, &arg, 1);
}

static tpl_value_t *f_format(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fmt, tpl_value_t **args,
                             size_t n)
{
    if (!need_str(r, at, "format", fmt)) {
        return NULL;
    }
    tpl_buf_t b = {0};
    size_t ai = 0;
    const char *s = fmt->u.str.s;
    for (size_t i = 0; i < fmt->u.str.len; i++) {
        if (s[i] != '%' || i + 1 >= fmt->u.str.len) {
            tb_put(&b, s + i, 1);
            continue;
        }
        char c = s[++i];
        /* %[flags][width][.precision]conversion, as Python's printf-style formatting */
        char flags[8];
        size_t nf = 0;
        while (strchr("-+ 0#", c) != NULL && c != '\0' && nf < sizeof(flags) - 1 && i + 1 < fmt->u.str.len) {
            flags[nf++] = c;
            c = s[++i];
        }
        flags[nf] = '\0';
        int width = 0, prec = -1;
        while (c >= '0' && c <= '9' && i + 1 < fmt->u.str.len && width < 10000) {
            width = width * 10 + (c - '0');
            c = s[++i];
        }
        if (c == '.' && i + 1 < fmt->u.str.len) {
            prec = 0;
            c = s[++i];
            while (c >= '0' && c <= '9' && i + 1 < fmt->u.str.len && prec < 10000) {
                prec = prec * 10 + (c - '0');
                c = s[++i];
            }
        }
        if (c == '%') {
            tb_puts(&b, "%");
            continue;
        }
        if (ai >= n) {
            tb_free(&b);
            return tpl_fail(r, at, "not enough arguments for format string");
        }
        tpl_value_t *v = args[ai++];
        char spec[32], num[512];
        if (c == 's' || c == 'r') { /* the text, cut to precision characters, padded to width */
            tpl_buf_t t = {0};
            if (c == 's') {
                tv_str_into(&t, v);
            } else {
                tv_repr_into(&t, v);
            }
            size_t len = t.n, chars = cp_count(t.p != NULL ? t.p : "", t.n);
            if (prec >= 0 && (size_t)prec < chars) {
                len = cp_offset(t.p, t.n, (size_t)prec);
                chars = (size_t)prec;
            }
            bool left = strchr(flags, '-') != NULL;
            for (size_t k = chars; !left && k < (size_t)width; k++) {
                tb_puts(&b, " ");
            }
            tb_put(&b, t.p != NULL ? t.p : "", len);
            for (size_t k = chars; left && k < (size_t)width; k++) {
                tb_puts(&b, " ");
            }
            tb_free(&t);
        } else if ((c == 'd' || c == 'i' || c == 'u' || c == 'x' || c == 'X' || c == 'o' || c == 'c') &&
                   tv_is_number(v)) {
            long long x = v->kind == TV_INT ? (long long)v->u.i : (long long)tv_as_double(v);
            snprintf(spec, sizeof(spec), "%%%s%d%s%s", flags, width, prec >= 0 && c != 'c' ? "." : "", "");
            if (prec >= 0 && c != 'c') {
                snprintf(spec + strlen(spec), sizeof(spec) - strlen(spec), "%d", prec);
            }
            snprintf(spec + strlen(spec), sizeof(spec) - strlen(spec), "ll%c",
                     c == 'i' || c == 'u' ? 'd' : c);
            if (c == 'c') { /* a code point */
                if (x < 0 || x > 0x10ffff) {
                    tb_free(&b);
                    return tpl_fail(r, at, "%%c arg not in range(0x110000)");
                }
                uint8_t u8[4];
                utf8proc_ssize_t k = utf8proc_encode_char((utf8proc_int32_t)x, u8);
                tb_put(&b, (const char *)u8, (size_t)k);
                continue;
            }
            snprintf(num, sizeof(num), spec, x);
            tb_puts(&b, num);
        } else if (strchr("fFeEgG", c) != NULL && c != '\0' && tv_is_number(v)) {
            snprintf(spec, sizeof(spec), "%%%s%d.%d%c", flags, width, prec >= 0 ? prec : 6, c);
            snprintf(num, sizeof(num), spec, tv_as_double(v));
            tb_puts(&b, num);
        } else {
            tb_free(&b);
            return tpl_fail(r, at, "format: unsupported conversion '%%%c' for %s", c, tv_type_name(v));
        }
    }
    if (ai < n) {
        tb_free(&b);
        return tpl_fail(r, at, "not all arguments converted during string formatting");
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *f_escape(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in)
{
    tpl_value_t *s = tv_to_str(r, in);
    if (s == NULL) {
        return NULL;
    }
    tpl_buf_t b = {0};
    for (size_t i = 0; i < s->u.str.len; i++) {
        char c = s->u.str.s[i];
        const char *e = c == '&'    ? "&amp;"
                        : c == '<'  ? "&lt;"
                        : c == '>'  ? "&gt;"
                        : c == '"'  ? "&#34;"
                        : c == '\'' ? "&#39;"
                                    : NULL;
        if (e != NULL) {
            tb_puts(&b, e);
        } else {
            tb_put(&b, &c, 1);
        }
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *f_items(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in)
{
    if (in->kind == TV_UNDEF) {
        return tv_list(r, 0);
    }
    if (in->kind != TV_DICT && in->kind != TV_NS) {
        return tpl_fail(r, at, "Can only get item pairs from a mapping.");
    }
    tpl_value_t *out = tv_list(r, in->u.dict->n);
    for (size_t i = 0; out != NULL && i < in->u.dict->n; i++) {
        tpl_value_t *p = tv_list(r, 2);
        if (p == NULL) {
            return NULL;
        }
        p->is_tuple = true;
        p->u.list.items[0] = in->u.dict->keys[i];
        p->u.list.items[1] = in->u.dict->vals[i];
        out->u.list.items[i] = p;
    }
    return out;
}

static tpl_value_t *f_unique(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    tpl_value_t *attr = arg(a, 1, "attribute");
    size_t n = items->u.list.n;
    tpl_value_t *out = tv_list(r, n);
    tpl_value_t **seen = tpl_alloc(r, (n ? n : 1) * sizeof(tpl_value_t *));
    if (out == NULL || seen == NULL) {
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        tpl_value_t *x = items->u.list.items[i];
        tpl_value_t *key = attr != NULL ? lookup_path(r, x, attr) : x;
        key = key != NULL ? fold(r, key, cs) : NULL;
        if (key == NULL) {
            return NULL;
        }
        bool dup = false;
        for (size_t j = 0; j < k && !dup; j++) {
            dup = tv_equal(seen[j], key);
        }
        if (!dup) {
            seen[k] = key;
            out->u.list.items[k++] = x;
        }
    }
    out->u.list.n = k;
    return out;
}

static tpl_value_t *f_length(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in)
{
    switch (in->kind) {
    case TV_STR: return tv_int(r, (int64_t)tv_utf8_count(in->u.str.s, in->u.str.len));
    case TV_LIST: return tv_int(r, (int64_t)in->u.list.n);
    case TV_DICT:
    case TV_NS: return tv_int(r, (int64_t)in->u.dict->n);
    case TV_UNDEF: return tv_int(r, 0);
    default: return tpl_fail(r, at, "object of type '%s' has no len()", tv_type_name(in));
    }
}

static tpl_value_t *f_first_last(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, bool last)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    if (items->u.list.n == 0) {
        return tv_undef(r, last ? "No last item, sequence was empty." : "No first item, sequence was empty.");
    }
    return items->u.list.items[last ? items->u.list.n - 1 : 0];
}

static tpl_value_t *f_reverse(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in)
{
    if (in->kind == TV_STR) {
        size_t n = in->u.str.len;
        char *s = tpl_alloc(r, n + 1);
        if (s == NULL) {
            return NULL;
        }
        size_t i = 0;
        while (i < n) {
            size_t w = 1;
            while (i + w < n && ((unsigned char)in->u.str.s[i + w] & 0xc0) == 0x80) {
                w++;
            }
            memcpy(s + n - i - w, in->u.str.s + i, w);
            i += w;
        }
        s[n] = '\0';
        return tv_str_nocopy(r, s, n);
    }
    tpl_value_t *items = tpl_iterable(r, at, in);
    tpl_value_t *out = items != NULL ? tv_list(r, items->u.list.n) : NULL;
    for (size_t i = 0; out != NULL && i < items->u.list.n; i++) {
        out->u.list.items[i] = items->u.list.items[items->u.list.n - 1 - i];
    }
    return out;
}

static tpl_value_t *f_sum(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *items = tpl_iterable(r, at, in);
    if (items == NULL) {
        return NULL;
    }
    tpl_value_t *attr = arg(a, 0, "attribute");
    tpl_value_t *acc = arg(a, 1, "start");
    if (acc == NULL) {
        acc = tv_int(r, 0);
    }
    for (size_t i = 0; acc != NULL && i < items->u.list.n; i++) {
        tpl_value_t *x = attr != NULL ? lookup_path(r, items->u.list.items[i], attr) : items->u.list.items[i];
        if (x == NULL || !tv_is_number(x) || !tv_is_number(acc)) {
            return tpl_fail(r, at, "sum: unsupported operand types");
        }
        if (acc->kind != TV_FLOAT && x->kind != TV_FLOAT) {
            int64_t s;
            int64_t xa = acc->kind == TV_BOOL ? acc->u.b : acc->u.i,
                    xb = x->kind == TV_BOOL ? x->u.b : x->u.i;
            if (__builtin_add_overflow(xa, xb, &s)) {
                return tpl_fail(r, at, "integer overflow");
            }
            acc = tv_int(r, s);
        } else {
            acc = tv_float(r, tv_as_double(acc) + tv_as_double(x));
        }
    }
    return acc;
}

static tpl_value_t *f_dictsort(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *in, const args_t *a)
{
    tpl_value_t *pairs = f_items(r, at, in);
    if (pairs == NULL) {
        return NULL;
    }
    bool cs = arg_bool(a, 0, "case_sensitive", false);
    tpl_value_t *by = arg(a, 1, "by");
    bool rev = arg_bool(a, 2, "reverse", false);
    int pos = by != NULL && by->kind == TV_STR && strcmp(by->u.str.s, "value") == 0 ? 1 : 0;
    size_t n = pairs->u.list.n;
    bool bad = false;
    for (size_t i = 1; i < n; i++) {
        tpl_value_t *x = pairs->u.list.items[i];
        tpl_value_t *kx = fold(r, x->u.list.items[pos], cs);
        size_t j = i;
        while (j > 0 && kx != NULL) {
            tpl_value_t *ky = fold(r, pairs->u.list.items[j - 1]->u.list.items[pos], cs);
            if (ky == NULL) {
                return NULL;
            }
            int c = cmp_keys(ky, kx, &bad);
            if (rev ? c >= 0 : c <= 0) {
                break;
            }
            pairs->u.list.items[j] = pairs->u.list.items[j - 1];
            j--;
        }
        pairs->u.list.items[j] = x;
    }
    return bad ? tpl_fail(r, at, "dictsort: the keys cannot be compared") : pairs;
}

tpl_value_t *tpl_filter(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *in,
                        tpl_value_t **argv, size_t n, const char **kwnames)
{
    args_t a = {argv, n, kwnames};
    if (!tpl_step(r, at)) {
        return NULL;
    }
#define IS(s) (strcmp(name, s) == 0)
    if (IS("default") || IS("d")) {
        tpl_value_t *def = arg(&a, 0, "default_value");
        bool boolean = arg_bool(&a, 1, "boolean", false);
        if (in->kind == TV_UNDEF || (boolean && !tv_truthy(in))) {
            return def != NULL ? def : tv_str(r, "", 0);
        }
        return in;
    }
    if (IS("tojson")) {
        return f_tojson(r, at, in, &a);
    }
    if (IS("length") || IS("count")) {
        return f_length(r, at, in);
    }
    if (IS("string")) {
        return tv_to_str(r, in);
    }
    if (IS("safe") || (IS("list") && in->kind == TV_LIST && !in->is_tuple)) {
        return in;
    }
    if (IS("list")) {
        return list_of(r, at, in);
    }
    if (IS("items")) {
        return f_items(r, at, in);
    }
    if (IS("first") || IS("last")) {
        return f_first_last(r, at, in, IS("last"));
    }
    if (IS("join")) {
        return f_join(r, at, in, &a);
    }
    if (IS("select") || IS("reject") || IS("selectattr") || IS("rejectattr")) {
        return select_items(r, at, in, &a, IS("selectattr") || IS("rejectattr"),
                            IS("select") || IS("selectattr"));
    }
    if (IS("map")) {
        return map_items(r, at, in, &a);
    }
    if (IS("unique")) {
        return f_unique(r, at, in, &a);
    }
    if (IS("sort")) {
        return sort_items(r, at, in, &a);
    }
    if (IS("dictsort")) {
        return f_dictsort(r, at, in, &a);
    }
    if (IS("reverse")) {
        return f_reverse(r, at, in);
    }
    if (IS("max") || IS("min")) {
        return minmax(r, at, in, &a, IS("max"));
    }
    if (IS("sum")) {
        return f_sum(r, at, in, &a);
    }
    if (IS("int")) {
        tpl_value_t *def = arg(&a, 0, "default");
        return to_int(r, in, def != NULL ? def : tv_int(r, 0));
    }
    if (IS("float")) {
        tpl_value_t *def = arg(&a, 0, "default");
        return to_float(r, in, def != NULL ? def : tv_float(r, 0.0));
    }
    if (IS("abs")) {
        if (!tv_is_number(in)) {
            return tpl_fail(r, at, "bad operand type for abs(): '%s'", tv_type_name(in));
        }
        if (in->kind == TV_FLOAT) {
            return tv_float(r, fabs(in->u.f));
        }
        int64_t x = in->kind == TV_BOOL ? in->u.b : in->u.i;
        return x == INT64_MIN ? tpl_fail(r, at, "integer overflow") : tv_int(r, x < 0 ? -x : x);
    }
    if (IS("round")) {
        if (!tv_is_number(in)) {
            return tpl_fail(r, at, "round needs a number");
        }
        tpl_value_t *p = arg(&a, 0, "precision");
        tpl_value_t *m = arg(&a, 1, "method");
        int64_t prec = p != NULL && p->kind == TV_INT ? p->u.i : 0;
        double scale = pow(10.0, (double)prec), x = tv_as_double(in) * scale;
        const char *method = m != NULL && m->kind == TV_STR ? m->u.str.s : "common";
        double y = strcmp(method, "ceil") == 0    ? ceil(x)
                   : strcmp(method, "floor") == 0 ? floor(x)
                                                  : nearbyint(x);
        return tv_float(r, y / scale);
    }
    if (IS("attr")) {
        tpl_value_t *nm = arg(&a, 0, "name");
        if (nm == NULL || nm->kind != TV_STR) {
            return tpl_fail(r, at, "attr needs a name");
        }
        if (in->kind == TV_DICT || in->kind == TV_NS) {
            tpl_value_t *v = tv_dict_get_str(in->u.dict, nm->u.str.s, nm->u.str.len);
            if (v != NULL && in->kind == TV_NS) {
                return v;
            }
        }
        tpl_value_t *m = tpl_method(r, in, nm->u.str.s, nm->u.str.len);
        return m != NULL ? m : tv_undef(r, "no such attribute");
    }
    if (IS("indent")) {
        return f_indent(r, at, in, &a);
    }
    if (IS("e") || IS("escape") || IS("forceescape")) {
        return f_escape(r, at, in);
    }
    if (IS("format")) {
        return f_format(r, at, in, argv, n);
    }
    tpl_value_t *s = NULL;
    if (IS("trim") || IS("upper") || IS("lower") || IS("capitalize") || IS("title") || IS("replace") ||
        IS("wordcount") || IS("center")) {
        s = tv_to_str(r, in);
        if (s == NULL) {
            return NULL;
        }
    }
    if (IS("trim")) {
        return strip(r, s, arg(&a, 0, "chars"), 3);
    }
    if (IS("upper") || IS("lower") || IS("capitalize") || IS("title")) {
        return recase(r, s, IS("lower") ? 0 : IS("upper") ? 1 : IS("capitalize") ? 2 : 3);
    }
    if (IS("replace")) {
        tpl_value_t *old = arg(&a, 0, "old"), *nw = arg(&a, 1, "new"), *cnt = arg(&a, 2, "count");
        if (old == NULL || nw == NULL) {
            return tpl_fail(r, at, "replace needs old and new strings");
        }
        old = tv_to_str(r, old);
        nw = tv_to_str(r, nw);
        if (old == NULL || nw == NULL) {
            return NULL;
        }
        return replace(r, s, old, nw, cnt != NULL && cnt->kind == TV_INT ? cnt->u.i : -1);
    }
    if (IS("wordcount")) {
        tpl_value_t *w = split(r, at, s, NULL, -1);
        return w != NULL ? tv_int(r, (int64_t)w->u.list.n) : NULL;
    }
    if (IS("center")) { /* Jinja's center(width=80) */
        tpl_value_t *w = arg(&a, 0, "width");
        tpl_value_t w80 = {.kind = TV_INT, .u.i = 80};
        return pad(r, at, s, w != NULL ? w : &w80, NULL, false);
    }
    if (IS("truncate")) {
        return f_truncate(r, at, in, &a);
    }
    if (IS("batch")) {
        return f_batch(r, at, in, &a);
    }
#undef IS
    return tpl_fail(r, at, "no filter named '%s'", name);
}

/* ------------------------------------------------------------------ globals and methods */

static const char *const GLOBALS[] = {"range", "namespace", "dict", "raise_exception", "strftime_now", NULL};

tpl_value_t *tpl_global(tpl_render_t *r, const char *name)
{
    for (int i = 0; GLOBALS[i] != NULL; i++) {
        if (strcmp(GLOBALS[i], name) == 0) {
            tpl_value_t *v = tpl_alloc(r, sizeof(*v));
            if (v != NULL) {
                memset(v, 0, sizeof(*v));
                v->kind = TV_FUNC;
                v->u.fn.name = GLOBALS[i];
            }
            return v;
        }
    }
    return NULL;
}

static const char *const STR_METHODS[] = {
    "strip",   "lstrip",     "rstrip",     "split",   "startswith", "endswith", "upper",
    "lower",   "title",      "capitalize", "replace", "find",       "rfind",    "count",
    "join",    "splitlines", "isdigit",    "isalpha", "isspace",    "isalnum",  "islower",
    "isupper", "format",     "center",     "zfill",   "rsplit",     NULL};
static const char *const DICT_METHODS[] = {"items", "keys", "values", "get", NULL};

tpl_value_t *tpl_method(tpl_render_t *r, tpl_value_t *self, const char *name, size_t len)
{
    const char *const *table = self->kind == TV_STR    ? STR_METHODS
                               : self->kind == TV_DICT ? DICT_METHODS
                                                       : NULL;
    static const char *const LOOP_METHODS[] = {"cycle", NULL};
    if (self->kind == TV_LOOP) {
        table = LOOP_METHODS;
    }
    for (int i = 0; table != NULL && table[i] != NULL; i++) {
        if (strlen(table[i]) == len && memcmp(table[i], name, len) == 0) {
            tpl_value_t *v = tpl_alloc(r, sizeof(*v));
            if (v != NULL) {
                memset(v, 0, sizeof(*v));
                v->kind = TV_METHOD;
                v->u.fn.name = table[i];
                v->u.fn.self = self;
            }
            return v;
        }
    }
    return NULL;
}

static tpl_value_t *str_find(tpl_render_t *r, tpl_value_t *s, tpl_value_t *sub, bool rev)
{
    if (sub == NULL || sub->kind != TV_STR) {
        return tpl_fail(r, NULL, "find needs a string");
    }
    const char *hit = NULL;
    if (!rev) {
        hit =
            sub->u.str.len == 0 ? s->u.str.s : memmem(s->u.str.s, s->u.str.len, sub->u.str.s, sub->u.str.len);
    } else {
        for (size_t i = s->u.str.len + 1; i-- > 0 && hit == NULL;) {
            if (i + sub->u.str.len <= s->u.str.len &&
                memcmp(s->u.str.s + i, sub->u.str.s, sub->u.str.len) == 0) {
                hit = s->u.str.s + i;
            }
        }
    }
    if (hit == NULL) {
        return tv_int(r, -1);
    }
    return tv_int(r, (int64_t)tv_utf8_count(s->u.str.s, (size_t)(hit - s->u.str.s)));
}

/* str.format with {} / {0} / {name} fields (no format specs). */
static tpl_value_t *str_format(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fmt, const args_t *a)
{
    tpl_buf_t b = {0};
    size_t auto_i = 0;
    const char *s = fmt->u.str.s;
    size_t n = fmt->u.str.len;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '{' && i + 1 < n && s[i + 1] == '{') {
            tb_puts(&b, "{");
            i++;
            continue;
        }
        if (s[i] == '}' && i + 1 < n && s[i + 1] == '}') {
            tb_puts(&b, "}");
            i++;
            continue;
        }
        if (s[i] != '{') {
            tb_put(&b, s + i, 1);
            continue;
        }
        const char *close = memchr(s + i, '}', n - i);
        if (close == NULL) {
            tb_free(&b);
            return tpl_fail(r, at, "Single '{' encountered in format string");
        }
        char field[64];
        size_t fl = (size_t)(close - (s + i + 1));
        if (fl >= sizeof(field) || memchr(s + i + 1, ':', fl) != NULL || memchr(s + i + 1, '!', fl) != NULL) {
            tb_free(&b);
            return tpl_fail(r, at, "format: field specs are not supported");
        }
        memcpy(field, s + i + 1, fl);
        field[fl] = '\0';
        tpl_value_t *v = NULL;
        if (fl == 0) {
            v = arg(a, auto_i++, NULL);
        } else if (field[0] >= '0' && field[0] <= '9') {
            v = arg(a, (size_t)atoi(field), NULL);
        } else {
            v = arg(a, (size_t)-1, field);
        }
        if (v == NULL) {
            tb_free(&b);
            return tpl_fail(r, at, "format: no argument for field '{%s}'", field);
        }
        tv_str_into(&b, v);
        i = (size_t)(close - s);
    }
    tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static tpl_value_t *str_method(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *s,
                               const args_t *a)
{
#define IS(x) (strcmp(name, x) == 0)
    tpl_value_t *a0 = arg(a, 0, NULL);
    if (IS("strip") || IS("lstrip") || IS("rstrip")) {
        if (a0 != NULL && a0->kind != TV_STR && a0->kind != TV_NONE) {
            return tpl_fail(r, at, "%s arg must be None or str", name);
        }
        return strip(r, s, a0, IS("strip") ? 3 : IS("lstrip") ? 1 : 2);
    }
    if (IS("split") || IS("rsplit")) {
        tpl_value_t *sep = arg(a, 0, "sep"), *mx = arg(a, 1, "maxsplit");
        int64_t m = mx != NULL && mx->kind == TV_INT ? mx->u.i : -1;
        return IS("split") ? split(r, at, s, sep, m) : rsplit(r, at, s, sep, m);
    }
    if (IS("center") || IS("zfill")) {
        return pad(r, at, s, a0, IS("center") ? arg(a, 1, NULL) : NULL, IS("zfill"));
    }
    if (IS("startswith") || IS("endswith")) {
        int t = a0 != NULL ? prefix_test(s, a0, IS("endswith")) : -1;
        return t < 0 ? tpl_fail(r, at, "%s first arg must be str or a tuple of str", name) : tv_bool(t == 1);
    }
    if (IS("upper") || IS("lower") || IS("title") || IS("capitalize")) {
        return recase(r, s, IS("lower") ? 0 : IS("upper") ? 1 : IS("capitalize") ? 2 : 4);
    }
    if (IS("replace")) {
        tpl_value_t *a1 = arg(a, 1, NULL), *a2 = arg(a, 2, NULL);
        if (a0 == NULL || a1 == NULL || a0->kind != TV_STR || a1->kind != TV_STR) {
            return tpl_fail(r, at, "replace needs two strings");
        }
        return replace(r, s, a0, a1, a2 != NULL && a2->kind == TV_INT ? a2->u.i : -1);
    }
    if (IS("find") || IS("rfind")) {
        return str_find(r, s, a0, IS("rfind"));
    }
    if (IS("count")) {
        if (a0 == NULL || a0->kind != TV_STR) {
            return tpl_fail(r, at, "count needs a string");
        }
        int64_t c = 0;
        if (a0->u.str.len == 0) {
            return tv_int(r, (int64_t)tv_utf8_count(s->u.str.s, s->u.str.len) + 1);
        }
        for (const char *p = s->u.str.s, *end = s->u.str.s + s->u.str.len;
             (p = memmem(p, (size_t)(end - p), a0->u.str.s, a0->u.str.len)) != NULL; p += a0->u.str.len) {
            c++;
        }
        return tv_int(r, c);
    }
    if (IS("join")) {
        if (a0 == NULL) {
            return tpl_fail(r, at, "join needs an iterable");
        }
        tpl_value_t *items = tpl_iterable(r, at, a0);
        if (items == NULL) {
            return NULL;
        }
        tpl_buf_t b = {0};
        for (size_t i = 0; i < items->u.list.n; i++) {
            if (items->u.list.items[i]->kind != TV_STR) {
                tb_free(&b);
                return tpl_fail(r, at, "sequence item %zu: expected str instance, %s found", i,
                                tv_type_name(items->u.list.items[i]));
            }
            if (i > 0) {
                tb_put(&b, s->u.str.s, s->u.str.len);
            }
            tv_str_into(&b, items->u.list.items[i]);
        }
        tpl_value_t *v = b.failed ? tpl_fail(r, at, "out of memory") : tv_str(r, b.p ? b.p : "", b.n);
        tb_free(&b);
        return v;
    }
    if (IS("splitlines")) {
        return splitlines(r, at, s);
    }
    if (IS("format")) {
        return str_format(r, at, s, a);
    }
    /* is* predicates over every code point (False for the empty string) */
    if (s->u.str.len == 0) {
        return &TPL_FALSE;
    }
    bool all = true, cased = false;
    for (size_t i = 0; i < s->u.str.len && all;) {
        int32_t cp;
        i += tv_utf8_next(s->u.str.s, s->u.str.len, i, &cp);
        utf8proc_category_t c = utf8proc_category(cp);
        bool letter = c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT ||
                      c == UTF8PROC_CATEGORY_LM || c == UTF8PROC_CATEGORY_LO;
        bool digit = c == UTF8PROC_CATEGORY_ND;
        if (IS("isdigit")) {
            all = digit;
        } else if (IS("isalpha")) {
            all = letter;
        } else if (IS("isalnum")) {
            all = letter || digit || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
        } else if (IS("isspace")) {
            all = py_space_cp(cp);
        } else if (IS("islower")) {
            all = !(c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LT);
            cased |= c == UTF8PROC_CATEGORY_LL;
        } else if (IS("isupper")) {
            all = !(c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT);
            cased |= c == UTF8PROC_CATEGORY_LU;
        }
    }
    if (IS("islower") || IS("isupper")) {
        all = all && cased;
    }
    return tv_bool(all);
#undef IS
}

static tpl_value_t *dict_method(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *d,
                                const args_t *a)
{
    if (strcmp(name, "items") == 0) {
        return f_items(r, at, d);
    }
    if (strcmp(name, "get") == 0) {
        tpl_value_t *k = arg(a, 0, NULL), *def = arg(a, 1, NULL);
        if (k == NULL) {
            return tpl_fail(r, at, "get expected at least 1 argument");
        }
        tpl_value_t *v = tv_dict_get(d->u.dict, k);
        return v != NULL ? v : def != NULL ? def : &TPL_NONE;
    }
    bool keys = strcmp(name, "keys") == 0;
    tpl_value_t *out = tv_list(r, d->u.dict->n);
    if (out != NULL && d->u.dict->n > 0) {
        memcpy(out->u.list.items, keys ? d->u.dict->keys : d->u.dict->vals,
               d->u.dict->n * sizeof(tpl_value_t *));
    }
    return out;
}

static tpl_value_t *fn_range(tpl_render_t *r, const tpl_node_t *at, const args_t *a)
{
    int64_t v[3] = {0, 0, 1};
    size_t np = npositional(a);
    if (np < 1 || np > 3) {
        return tpl_fail(r, at, "range expected 1 to 3 arguments, got %zu", np);
    }
    for (size_t i = 0; i < np; i++) {
        tpl_value_t *x = arg(a, i, NULL);
        if (x->kind != TV_INT && x->kind != TV_BOOL) {
            return tpl_fail(r, at, "range: '%s' object cannot be interpreted as an integer", tv_type_name(x));
        }
        v[np == 1 ? 1 : i] = x->kind == TV_BOOL ? x->u.b : x->u.i;
    }
    if (v[2] == 0) {
        return tpl_fail(r, at, "range() arg 3 must not be zero");
    }
    double cnt = ceil(((double)v[1] - (double)v[0]) / (double)v[2]);
    if (cnt < 0) {
        cnt = 0;
    }
    if (cnt > 1e6) { /* the sandbox's MAX_RANGE is 100 000; stay within a bounded list */
        return tpl_fail(r, at, "range too big (%.0f items)", cnt);
    }
    tpl_value_t *out = tv_list(r, (size_t)cnt);
    for (size_t i = 0; out != NULL && i < (size_t)cnt; i++) {
        out->u.list.items[i] = tv_int(r, v[0] + (int64_t)i * v[2]);
        if (out->u.list.items[i] == NULL) {
            return NULL;
        }
    }
    return out;
}

tpl_value_t *tpl_call_builtin(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *self,
                              tpl_value_t **argv, size_t n, const char **kwnames)
{
    args_t a = {argv, n, kwnames};
    if (!tpl_step(r, at)) {
        return NULL;
    }
    if (self != NULL) {
        if (self->kind == TV_STR) {
            return str_method(r, at, name, self, &a);
        }
        if (self->kind == TV_DICT) {
            return dict_method(r, at, name, self, &a);
        }
        if (self->kind == TV_LOOP) { /* loop.cycle(a, b, ...) */
            if (n == 0) {
                return tpl_fail(r, at, "no items for cycling given");
            }
            return argv[self->u.loop->index0 % (int64_t)n];
        }
        return tpl_fail(r, at, "'%s' has no method '%s'", tv_type_name(self), name);
    }
    if (strcmp(name, "range") == 0) {
        return fn_range(r, at, &a);
    }
    if (strcmp(name, "namespace") == 0 || strcmp(name, "dict") == 0) {
        tpl_value_t *d = tv_dict(r);
        if (d == NULL) {
            return NULL;
        }
        d->kind = name[0] == 'n' ? TV_NS : TV_DICT;
        for (size_t i = 0; i < n; i++) {
            if (kwnames != NULL && kwnames[i] != NULL) {
                tpl_value_t *k = tv_str(r, kwnames[i], strlen(kwnames[i]));
                if (k == NULL || !tv_dict_set(r, d->u.dict, k, argv[i])) {
                    return NULL;
                }
            } else if (argv[i]->kind == TV_DICT) { /* namespace({...}) / dict({...}) */
                for (size_t j = 0; j < argv[i]->u.dict->n; j++) {
                    if (!tv_dict_set(r, d->u.dict, argv[i]->u.dict->keys[j], argv[i]->u.dict->vals[j])) {
                        return NULL;
                    }
                }
            } else {
                return tpl_fail(r, at, "%s() takes keyword arguments or a dict", name);
            }
        }
        return d;
    }
    if (strcmp(name, "raise_exception") == 0) {
        tpl_buf_t b = {0};
        if (n > 0) {
            tv_str_into(&b, argv[0]);
        }
        tpl_fail(r, at, "%s", b.p != NULL ? b.p : "raise_exception called");
        tb_free(&b);
        return NULL;
    }
    if (strcmp(name, "strftime_now") == 0) {
        if (n < 1 || argv[0]->kind != TV_STR) {
            return tpl_fail(r, at, "strftime_now needs a format string");
        }
        time_t now = tpl_now(r);
        struct tm tm;
        localtime_r(&now, &tm);
        char buf[512];
        size_t len = strftime(buf, sizeof(buf), argv[0]->u.str.s, &tm);
        return tv_str(r, buf, len);
    }
    return tpl_fail(r, at, "'%s' is not callable", name);
}
