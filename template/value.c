/* template/value.c — Jinja values: constructors, dicts, conversion from JSON, truthiness, equality,
 * and the string forms Python gives them (str, repr, float repr, transformers' tojson). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/json.h"
#include "template/tpl_internal.h"

tpl_value_t TPL_UNDEF = {.kind = TV_UNDEF};
tpl_value_t TPL_NONE = {.kind = TV_NONE};
tpl_value_t TPL_TRUE = {.kind = TV_BOOL, .u.b = true};
tpl_value_t TPL_FALSE = {.kind = TV_BOOL, .u.b = false};

static tpl_value_t *tv_new(tpl_render_t *r, tv_kind_t kind)
{
    tpl_value_t *v = tpl_alloc(r, sizeof(*v));
    if (v != NULL) {
        memset(v, 0, sizeof(*v));
        v->kind = kind;
    }
    return v;
}

tpl_value_t *tv_int(tpl_render_t *r, int64_t i)
{
    tpl_value_t *v = tv_new(r, TV_INT);
    if (v != NULL) {
        v->u.i = i;
    }
    return v;
}

tpl_value_t *tv_float(tpl_render_t *r, double f)
{
    tpl_value_t *v = tv_new(r, TV_FLOAT);
    if (v != NULL) {
        v->u.f = f;
    }
    return v;
}

tpl_value_t *tv_bool(bool b)
{
    return b ? &TPL_TRUE : &TPL_FALSE;
}

tpl_value_t *tv_str_nocopy(tpl_render_t *r, const char *s, size_t len)
{
    tpl_value_t *v = tv_new(r, TV_STR);
    if (v != NULL) {
        v->u.str.s = s;
        v->u.str.len = len;
    }
    return v;
}

tpl_value_t *tv_str(tpl_render_t *r, const char *s, size_t len)
{
    char *c = tpl_alloc(r, len + 1);
    if (c == NULL) {
        return NULL;
    }
    if (len > 0) {
        memcpy(c, s, len);
    }
    c[len] = '\0';
    return tv_str_nocopy(r, c, len);
}

tpl_value_t *tv_list(tpl_render_t *r, size_t n)
{
    tpl_value_t *v = tv_new(r, TV_LIST);
    if (v == NULL) {
        return NULL;
    }
    v->u.list.items = tpl_alloc(r, (n ? n : 1) * sizeof(tpl_value_t *));
    if (v->u.list.items == NULL) {
        return NULL;
    }
    memset(v->u.list.items, 0, (n ? n : 1) * sizeof(tpl_value_t *));
    v->u.list.n = n;
    return v;
}

tpl_value_t *tv_dict(tpl_render_t *r)
{
    tpl_value_t *v = tv_new(r, TV_DICT);
    if (v == NULL) {
        return NULL;
    }
    v->u.dict = tpl_alloc(r, sizeof(tpl_dict_t));
    if (v->u.dict == NULL) {
        return NULL;
    }
    memset(v->u.dict, 0, sizeof(tpl_dict_t));
    return v;
}

tpl_value_t *tv_undef(tpl_render_t *r, const char *name)
{
    tpl_value_t *v = tv_new(r, TV_UNDEF);
    if (v != NULL) {
        v->undef_name = name;
    }
    return v;
}

tpl_value_t *tv_dict_get(const tpl_dict_t *d, const tpl_value_t *k)
{
    for (size_t i = 0; i < d->n; i++) {
        if (tv_equal(d->keys[i], k)) {
            return d->vals[i];
        }
    }
    return NULL;
}

tpl_value_t *tv_dict_get_str(const tpl_dict_t *d, const char *k, size_t len)
{
    for (size_t i = 0; i < d->n; i++) {
        const tpl_value_t *key = d->keys[i];
        if (key->kind == TV_STR && key->u.str.len == len && memcmp(key->u.str.s, k, len) == 0) {
            return d->vals[i];
        }
    }
    return NULL;
}

bool tv_dict_set(tpl_render_t *r, tpl_dict_t *d, tpl_value_t *k, tpl_value_t *v)
{
    for (size_t i = 0; i < d->n; i++) {
        if (tv_equal(d->keys[i], k)) {
            d->vals[i] = v;
            return true;
        }
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        tpl_value_t **keys = tpl_alloc(r, cap * sizeof(*keys));
        tpl_value_t **vals = tpl_alloc(r, cap * sizeof(*vals));
        if (keys == NULL || vals == NULL) {
            return false;
        }
        if (d->n > 0) {
            memcpy(keys, d->keys, d->n * sizeof(*keys));
            memcpy(vals, d->vals, d->n * sizeof(*vals));
        }
        d->keys = keys;
        d->vals = vals;
        d->cap = cap;
    }
    d->keys[d->n] = k;
    d->vals[d->n] = v;
    d->n++;
    return true;
}

tpl_value_t *tv_from_json(tpl_render_t *r, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        tpl_value_t *d = tv_dict(r);
        const char *k;
        json_t *v;
        if (d == NULL) {
            return NULL;
        }
        json_object_foreach((json_t *)j, k, v)
        {
            tpl_value_t *kv = tv_str(r, k, strlen(k));
            tpl_value_t *vv = tv_from_json(r, v);
            if (kv == NULL || vv == NULL || !tv_dict_set(r, d->u.dict, kv, vv)) {
                return NULL;
            }
        }
        return d;
    }
    case JSON_ARRAY: {
        tpl_value_t *l = tv_list(r, json_array_size(j));
        if (l == NULL) {
            return NULL;
        }
        for (size_t i = 0; i < json_array_size(j); i++) {
            l->u.list.items[i] = tv_from_json(r, json_array_get(j, i));
            if (l->u.list.items[i] == NULL) {
                return NULL;
            }
        }
        return l;
    }
    case JSON_STRING: return tv_str(r, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return tv_int(r, json_integer_value(j));
    case JSON_REAL: return tv_float(r, json_real_value(j));
    case JSON_TRUE: return &TPL_TRUE;
    case JSON_FALSE: return &TPL_FALSE;
    default: return &TPL_NONE;
    }
}

bool tv_truthy(const tpl_value_t *v)
{
    switch (v->kind) {
    case TV_UNDEF:
    case TV_NONE: return false;
    case TV_BOOL: return v->u.b;
    case TV_INT: return v->u.i != 0;
    case TV_FLOAT: return v->u.f != 0.0;
    case TV_STR: return v->u.str.len > 0;
    case TV_LIST: return v->u.list.n > 0;
    case TV_DICT: return v->u.dict->n > 0;
    default: return true;
    }
}

bool tv_is_number(const tpl_value_t *v)
{
    return v->kind == TV_INT || v->kind == TV_FLOAT || v->kind == TV_BOOL;
}

double tv_as_double(const tpl_value_t *v)
{
    return v->kind == TV_FLOAT  ? v->u.f
           : v->kind == TV_INT  ? (double)v->u.i
           : v->kind == TV_BOOL ? v->u.b
                                : 0;
}

bool tv_equal(const tpl_value_t *a, const tpl_value_t *b)
{
    if (tv_is_number(a) && tv_is_number(b)) {
        if (a->kind != TV_FLOAT && b->kind != TV_FLOAT) {
            int64_t x = a->kind == TV_BOOL ? a->u.b : a->u.i, y = b->kind == TV_BOOL ? b->u.b : b->u.i;
            return x == y;
        }
        return tv_as_double(a) == tv_as_double(b);
    }
    if (a->kind != b->kind) {
        return false;
    }
    switch (a->kind) {
    case TV_UNDEF:
    case TV_NONE: return true;
    case TV_STR: return a->u.str.len == b->u.str.len && memcmp(a->u.str.s, b->u.str.s, a->u.str.len) == 0;
    case TV_LIST:
        if (a->is_tuple != b->is_tuple || a->u.list.n != b->u.list.n) {
            return false;
        }
        for (size_t i = 0; i < a->u.list.n; i++) {
            if (!tv_equal(a->u.list.items[i], b->u.list.items[i])) {
                return false;
            }
        }
        return true;
    case TV_DICT:
        if (a->u.dict->n != b->u.dict->n) {
            return false;
        }
        for (size_t i = 0; i < a->u.dict->n; i++) {
            tpl_value_t *o = tv_dict_get(b->u.dict, a->u.dict->keys[i]);
            if (o == NULL || !tv_equal(a->u.dict->vals[i], o)) {
                return false;
            }
        }
        return true;
    case TV_NS: return a->u.dict == b->u.dict;
    case TV_MACRO: return a->u.macro.node == b->u.macro.node;
    case TV_FUNC:
    case TV_METHOD: return strcmp(a->u.fn.name, b->u.fn.name) == 0 && a->u.fn.self == b->u.fn.self;
    default: return a == b;
    }
}

const char *tv_type_name(const tpl_value_t *v)
{
    static const char *const names[] = {"Undefined", "NoneType", "bool",       "int",       "float",
                                        "str",       "list",     "dict",       "Namespace", "Macro",
                                        "function",  "method",   "LoopContext"};
    if (v->kind == TV_LIST && v->is_tuple) {
        return "tuple";
    }
    return names[v->kind];
}

/* ------------------------------------------------------------------ buffers */

void tb_put(tpl_buf_t *b, const char *s, size_t n)
{
    if (b->failed || n == 0) {
        return;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) {
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->failed = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

void tb_puts(tpl_buf_t *b, const char *s)
{
    tb_put(b, s, strlen(s));
}

void tb_free(tpl_buf_t *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

/* ------------------------------------------------------------------ UTF-8 */

size_t tv_utf8_next(const char *s, size_t len, size_t i, int32_t *cp)
{
    utf8proc_int32_t c;
    utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &c);
    if (l <= 0) {
        *cp = (unsigned char)s[i];
        return 1;
    }
    *cp = c;
    return (size_t)l;
}

size_t tv_utf8_count(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        n += ((unsigned char)s[i] & 0xc0) != 0x80;
    }
    return n;
}

size_t tv_utf8_offset(const char *s, size_t len, size_t cp_index)
{
    size_t i = 0, k = 0;
    while (i < len && k < cp_index) {
        i++;
        while (i < len && ((unsigned char)s[i] & 0xc0) == 0x80) {
            i++;
        }
        k++;
    }
    return i;
}

/* ------------------------------------------------------------------ str / repr */

void tv_float_repr(char *out, size_t cap, double f)
{
    pd_py_float_repr(out, cap, f);
}

static bool py_printable(int32_t cp)
{
    if (cp == ' ') {
        return true;
    }
    utf8proc_category_t c = utf8proc_category(cp);
    return !(c == UTF8PROC_CATEGORY_CC || c == UTF8PROC_CATEGORY_CF || c == UTF8PROC_CATEGORY_CS ||
             c == UTF8PROC_CATEGORY_CO || c == UTF8PROC_CATEGORY_CN || c == UTF8PROC_CATEGORY_ZL ||
             c == UTF8PROC_CATEGORY_ZP || c == UTF8PROC_CATEGORY_ZS);
}

static void repr_str(tpl_buf_t *b, const char *s, size_t len)
{
    bool has_sq = memchr(s, '\'', len) != NULL, has_dq = memchr(s, '"', len) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    tb_put(b, &q, 1);
    size_t i = 0;
    while (i < len) {
        int32_t cp;
        size_t w = tv_utf8_next(s, len, i, &cp);
        char esc[16];
        if (cp == q || cp == '\\') {
            esc[0] = '\\';
            esc[1] = (char)cp;
            tb_put(b, esc, 2);
        } else if (cp == '\n') {
            tb_puts(b, "\\n");
        } else if (cp == '\r') {
            tb_puts(b, "\\r");
        } else if (cp == '\t') {
            tb_puts(b, "\\t");
        } else if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && !py_printable(cp))) {
            snprintf(esc, sizeof(esc), cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", cp);
            tb_puts(b, esc);
        } else {
            tb_put(b, s + i, w);
        }
        i += w;
    }
    tb_put(b, &q, 1);
}

void tv_repr_into(tpl_buf_t *b, const tpl_value_t *v)
{
    switch (v->kind) {
    case TV_STR: repr_str(b, v->u.str.s, v->u.str.len); return;
    case TV_UNDEF: tb_puts(b, "Undefined"); return;
    case TV_LIST:
        tb_puts(b, v->is_tuple ? "(" : "[");
        for (size_t i = 0; i < v->u.list.n; i++) {
            if (i > 0) {
                tb_puts(b, ", ");
            }
            tv_repr_into(b, v->u.list.items[i]);
        }
        tb_puts(b, v->is_tuple ? (v->u.list.n == 1 ? ",)" : ")") : "]");
        return;
    case TV_DICT:
    case TV_NS:
        if (v->kind == TV_NS) {
            tb_puts(b, "<Namespace ");
        }
        tb_puts(b, "{");
        for (size_t i = 0; i < v->u.dict->n; i++) {
            if (i > 0) {
                tb_puts(b, ", ");
            }
            tv_repr_into(b, v->u.dict->keys[i]);
            tb_puts(b, ": ");
            tv_repr_into(b, v->u.dict->vals[i]);
        }
        tb_puts(b, v->kind == TV_NS ? "}>" : "}");
        return;
    default: tv_str_into(b, v);
    }
}

void tv_str_into(tpl_buf_t *b, const tpl_value_t *v)
{
    char num[64];
    switch (v->kind) {
    case TV_UNDEF: return;
    case TV_NONE: tb_puts(b, "None"); return;
    case TV_BOOL: tb_puts(b, v->u.b ? "True" : "False"); return;
    case TV_INT:
        snprintf(num, sizeof(num), "%lld", (long long)v->u.i);
        tb_puts(b, num);
        return;
    case TV_FLOAT:
        tv_float_repr(num, sizeof(num), v->u.f);
        tb_puts(b, num);
        return;
    case TV_STR: tb_put(b, v->u.str.s, v->u.str.len); return;
    case TV_MACRO:
        tb_puts(b, "<Macro '");
        tb_puts(b, v->u.macro.node->s);
        tb_puts(b, "'>");
        return;
    case TV_FUNC:
    case TV_METHOD:
        tb_puts(b, "<built-in function ");
        tb_puts(b, v->u.fn.name);
        tb_puts(b, ">");
        return;
    case TV_LOOP: tb_puts(b, "<LoopContext>"); return;
    default: tv_repr_into(b, v);
    }
}

tpl_value_t *tv_to_str(tpl_render_t *r, const tpl_value_t *v)
{
    if (v->kind == TV_STR) {
        return (tpl_value_t *)v;
    }
    tpl_buf_t b = {0};
    tv_str_into(&b, v);
    if (b.failed) {
        tb_free(&b);
        return tpl_fail(r, NULL, "out of memory");
    }
    tpl_value_t *s = tv_str(r, b.p != NULL ? b.p : "", b.n);
    tb_free(&b);
    return s;
}

/* ------------------------------------------------------------------ tojson */

static void json_str(tpl_buf_t *b, const char *s, size_t len, bool ensure_ascii)
{
    tb_puts(b, "\"");
    size_t i = 0;
    while (i < len) {
        int32_t cp;
        size_t w = tv_utf8_next(s, len, i, &cp);
        char esc[16];
        switch (cp) {
        case '"': tb_puts(b, "\\\""); break;
        case '\\': tb_puts(b, "\\\\"); break;
        case '\n': tb_puts(b, "\\n"); break;
        case '\r': tb_puts(b, "\\r"); break;
        case '\t': tb_puts(b, "\\t"); break;
        case '\b': tb_puts(b, "\\b"); break;
        case '\f': tb_puts(b, "\\f"); break;
        default:
            if (cp < 0x20) {
                snprintf(esc, sizeof(esc), "\\u%04x", cp);
                tb_puts(b, esc);
            } else if (ensure_ascii && cp >= 0x7f) {
                if (cp == 0x7f) {
                    tb_put(b, s + i, w);
                } else if (cp < 0x10000) {
                    snprintf(esc, sizeof(esc), "\\u%04x", cp);
                    tb_puts(b, esc);
                } else {
                    int32_t c = cp - 0x10000;
                    snprintf(esc, sizeof(esc), "\\u%04x\\u%04x", 0xd800 | (c >> 10), 0xdc00 | (c & 0x3ff));
                    tb_puts(b, esc);
                }
            } else {
                tb_put(b, s + i, w);
            }
        }
        i += w;
    }
    tb_puts(b, "\"");
}

static void json_newline(tpl_buf_t *b, int indent, int depth)
{
    tb_puts(b, "\n");
    for (int i = 0; i < indent * depth; i++) {
        tb_puts(b, " ");
    }
}

/* Python's json key coercion: str as is; int, float, bool, None to their JSON spelling. */
static bool json_key(tpl_render_t *r, tpl_buf_t *b, const tpl_value_t *k, bool ensure_ascii)
{
    char num[64];
    switch (k->kind) {
    case TV_STR: json_str(b, k->u.str.s, k->u.str.len, ensure_ascii); return true;
    case TV_INT:
        snprintf(num, sizeof(num), "\"%lld\"", (long long)k->u.i);
        tb_puts(b, num);
        return true;
    case TV_BOOL: tb_puts(b, k->u.b ? "\"true\"" : "\"false\""); return true;
    case TV_NONE: tb_puts(b, "\"null\""); return true;
    case TV_FLOAT:
        tv_float_repr(num, sizeof(num), k->u.f);
        tb_puts(b, "\"");
        tb_puts(b, num);
        tb_puts(b, "\"");
        return true;
    default:
        tpl_fail(r, NULL, "keys must be str, int, float, bool or None, not %s", tv_type_name(k));
        return false;
    }
}

bool tv_tojson_into(tpl_render_t *r, tpl_buf_t *b, const tpl_value_t *v, int indent, int depth,
                    const char *item_sep, const char *key_sep, bool sort_keys, bool ensure_ascii)
{
    char num[64];
    if (depth > PD_TEMPLATE_MAX_NEST) {
        tpl_fail(r, NULL, "tojson: value nests deeper than %d levels", PD_TEMPLATE_MAX_NEST);
        return false;
    }
    switch (v->kind) {
    case TV_NONE: tb_puts(b, "null"); return true;
    case TV_BOOL: tb_puts(b, v->u.b ? "true" : "false"); return true;
    case TV_INT:
        snprintf(num, sizeof(num), "%lld", (long long)v->u.i);
        tb_puts(b, num);
        return true;
    case TV_FLOAT:
        if (isnan(v->u.f)) {
            tb_puts(b, "NaN");
        } else if (isinf(v->u.f)) {
            tb_puts(b, v->u.f < 0 ? "-Infinity" : "Infinity");
        } else {
            tv_float_repr(num, sizeof(num), v->u.f);
            tb_puts(b, num);
        }
        return true;
    case TV_STR: json_str(b, v->u.str.s, v->u.str.len, ensure_ascii); return true;
    case TV_LIST:
        if (v->u.list.n == 0) {
            tb_puts(b, "[]");
            return true;
        }
        tb_puts(b, "[");
        for (size_t i = 0; i < v->u.list.n; i++) {
            if (i > 0) {
                tb_puts(b, item_sep);
            }
            if (indent >= 0) {
                json_newline(b, indent, depth + 1);
            }
            if (!tv_tojson_into(r, b, v->u.list.items[i], indent, depth + 1, item_sep, key_sep, sort_keys,
                                ensure_ascii)) {
                return false;
            }
        }
        if (indent >= 0) {
            json_newline(b, indent, depth);
        }
        tb_puts(b, "]");
        return true;
    case TV_DICT: {
        const tpl_dict_t *d = v->u.dict;
        if (d->n == 0) {
            tb_puts(b, "{}");
            return true;
        }
        size_t order[d->n > 0 ? d->n : 1];
        for (size_t i = 0; i < d->n; i++) {
            order[i] = i;
        }
        if (sort_keys) { /* insertion sort by key (strings; keys are few) */
            for (size_t i = 1; i < d->n; i++) {
                size_t x = order[i], j = i;
                while (j > 0) {
                    const tpl_value_t *ka = d->keys[order[j - 1]], *kb = d->keys[x];
                    if (ka->kind != TV_STR || kb->kind != TV_STR) {
                        tpl_fail(r, NULL, "tojson: sort_keys needs string keys");
                        return false;
                    }
                    size_t m = ka->u.str.len < kb->u.str.len ? ka->u.str.len : kb->u.str.len;
                    int c = memcmp(ka->u.str.s, kb->u.str.s, m);
                    if (c < 0 || (c == 0 && ka->u.str.len <= kb->u.str.len)) {
                        break;
                    }
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = x;
            }
        }
        tb_puts(b, "{");
        for (size_t i = 0; i < d->n; i++) {
            if (i > 0) {
                tb_puts(b, item_sep);
            }
            if (indent >= 0) {
                json_newline(b, indent, depth + 1);
            }
            if (!json_key(r, b, d->keys[order[i]], ensure_ascii)) {
                return false;
            }
            tb_puts(b, key_sep);
            if (!tv_tojson_into(r, b, d->vals[order[i]], indent, depth + 1, item_sep, key_sep, sort_keys,
                                ensure_ascii)) {
                return false;
            }
        }
        if (indent >= 0) {
            json_newline(b, indent, depth);
        }
        tb_puts(b, "}");
        return true;
    }
    default: tpl_fail(r, NULL, "Object of type %s is not JSON serializable", tv_type_name(v)); return false;
    }
}
