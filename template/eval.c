/* template/eval.c — renders a parsed template: scopes, statements, expressions, macro calls, and
 * the limits (steps, output, memory, call depth) that bound every render. */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "template/tpl_internal.h"

typedef struct scope scope_t;
struct scope {
    scope_t *parent;
    const char **names;
    tpl_value_t **vals;
    size_t n, cap;
};

struct tpl_render {
    const pd_template_t *t;
    pd_template_limits_t lim;
    pd_arena_t arena;
    size_t mem;
    uint64_t steps;
    int call_depth;
    tpl_buf_t *out;
    size_t total_out;
    scope_t *scope;
    scope_t *root;
    pd_template_error_t *err;
    bool failed;
    int loop_ctl;                /* 1 break, 2 continue (pending until the enclosing loop takes it) */
    tpl_value_t *caller;         /* a call block's caller, for the macro call at caller_at */
    const tpl_node_t *caller_at; /* the call block's ND_CALL */
};

void pd_template_limits_default(pd_template_limits_t *lim)
{
    lim->max_steps = 10u * 1000 * 1000;
    lim->max_output = 16u << 20;
    lim->max_memory = 256u << 20;
    lim->max_call_depth = 64;
    lim->now = 0;
}

tpl_value_t *tpl_fail(tpl_render_t *r, const tpl_node_t *at, const char *fmt, ...)
{
    if (!r->failed) {
        r->failed = true;
        r->err->line = at != NULL ? at->line : 0;
        r->err->column = at != NULL ? at->col : 0;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err->message, sizeof(r->err->message), fmt, ap);
        va_end(ap);
    } else if (at != NULL && r->err->line == 0) {
        r->err->line = at->line; /* a helper failed without a position: the caller knows it */
        r->err->column = at->col;
    }
    return NULL;
}

bool tpl_failed(const tpl_render_t *r)
{
    return r->failed;
}

void *tpl_alloc(tpl_render_t *r, size_t bytes)
{
    if (r->failed) {
        return NULL;
    }
    if (bytes > r->lim.max_memory || r->mem + bytes > r->lim.max_memory) {
        return tpl_fail(r, NULL, "the template used more than %zu bytes of memory", r->lim.max_memory);
    }
    void *p = pd_arena_alloc(&r->arena, bytes ? bytes : 1, 8);
    if (p == NULL) {
        return tpl_fail(r, NULL, "out of memory");
    }
    r->mem += bytes;
    return p;
}

time_t tpl_now(const tpl_render_t *r)
{
    return r->lim.now != 0 ? r->lim.now : time(NULL);
}

bool tpl_step(tpl_render_t *r, const tpl_node_t *at)
{
    if (r->failed) {
        return false;
    }
    if (++r->steps > r->lim.max_steps) {
        tpl_fail(r, at, "the template ran more than %llu steps", (unsigned long long)r->lim.max_steps);
        return false;
    }
    return true;
}

static void emit(tpl_render_t *r, const tpl_node_t *at, const char *s, size_t n)
{
    r->total_out += n;
    if (r->total_out > r->lim.max_output) {
        tpl_fail(r, at, "the template produced more than %zu bytes", r->lim.max_output);
        return;
    }
    tb_put(r->out, s, n);
    if (r->out->failed) {
        tpl_fail(r, at, "out of memory");
    }
}

/* ------------------------------------------------------------------ scopes */

static scope_t *scope_new(tpl_render_t *r, scope_t *parent)
{
    scope_t *s = tpl_alloc(r, sizeof(*s));
    if (s != NULL) {
        memset(s, 0, sizeof(*s));
        s->parent = parent;
    }
    return s;
}

static bool scope_set(tpl_render_t *r, scope_t *s, const char *name, tpl_value_t *v)
{
    for (size_t i = 0; i < s->n; i++) {
        if (strcmp(s->names[i], name) == 0) {
            s->vals[i] = v;
            return true;
        }
    }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        const char **names = tpl_alloc(r, cap * sizeof(*names));
        tpl_value_t **vals = tpl_alloc(r, cap * sizeof(*vals));
        if (names == NULL || vals == NULL) {
            return false;
        }
        if (s->n > 0) {
            memcpy(names, s->names, s->n * sizeof(*names));
            memcpy(vals, s->vals, s->n * sizeof(*vals));
        }
        s->names = names;
        s->vals = vals;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
    return true;
}

static tpl_value_t *scope_get(const scope_t *s, const char *name)
{
    for (; s != NULL; s = s->parent) {
        for (size_t i = s->n; i-- > 0;) {
            if (strcmp(s->names[i], name) == 0) {
                return s->vals[i];
            }
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ expressions */

static tpl_value_t *eval(tpl_render_t *r, const tpl_node_t *e);
static void exec_body(tpl_render_t *r, const tpl_node_t *body);

static tpl_value_t *undefined_error(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *u)
{
    return tpl_fail(r, at, "%s", u->undef_name != NULL ? u->undef_name : "undefined value");
}

static tpl_value_t *undef_msg(tpl_render_t *r, const char *fmt, const char *a, const char *b)
{
    char buf[200];
    snprintf(buf, sizeof(buf), fmt, a, b);
    char *m = tpl_alloc(r, strlen(buf) + 1);
    if (m == NULL) {
        return NULL;
    }
    strcpy(m, buf);
    return tv_undef(r, m);
}

static tpl_value_t *loop_attr(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *lv, const char *name)
{
    const tpl_loop_t *l = lv->u.loop;
    if (strcmp(name, "index") == 0) {
        return tv_int(r, l->index0 + 1);
    }
    if (strcmp(name, "index0") == 0) {
        return tv_int(r, l->index0);
    }
    if (strcmp(name, "revindex") == 0) {
        return tv_int(r, l->length - l->index0);
    }
    if (strcmp(name, "revindex0") == 0) {
        return tv_int(r, l->length - l->index0 - 1);
    }
    if (strcmp(name, "first") == 0) {
        return tv_bool(l->index0 == 0);
    }
    if (strcmp(name, "last") == 0) {
        return tv_bool(l->index0 == l->length - 1);
    }
    if (strcmp(name, "length") == 0) {
        return tv_int(r, l->length);
    }
    if (strcmp(name, "depth") == 0 || strcmp(name, "depth0") == 0) {
        return tv_int(r, l->depth0 + (name[5] == '0' ? 0 : 1));
    }
    if (strcmp(name, "previtem") == 0) {
        return l->prev != NULL ? l->prev : undef_msg(r, "there is no previous item%s%s", "", "");
    }
    if (strcmp(name, "nextitem") == 0) {
        return l->next != NULL ? l->next : undef_msg(r, "there is no next item%s%s", "", "");
    }
    if (strcmp(name, "cycle") == 0) {
        tpl_value_t *m = tpl_method(r, lv, name, strlen(name));
        return m != NULL ? m : tpl_fail(r, at, "out of memory");
    }
    return undef_msg(r, "'LoopContext object' has no attribute '%s'%s", name, "");
}

/* obj.name: methods first (Python's getattr), then dict items, namespace and loop attributes. */
static tpl_value_t *get_attr(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *obj, const char *name,
                             size_t len)
{
    if (obj->kind == TV_UNDEF) {
        return undefined_error(r, at, obj);
    }
    if (obj->kind == TV_NS) {
        tpl_value_t *v = tv_dict_get_str(obj->u.dict, name, len);
        return v != NULL ? v : undef_msg(r, "'Namespace' object has no attribute '%s'%s", name, "");
    }
    if (obj->kind == TV_LOOP) {
        return loop_attr(r, at, obj, name);
    }
    tpl_value_t *m = tpl_method(r, obj, name, len);
    if (m != NULL || r->failed) {
        return m;
    }
    if (obj->kind == TV_DICT) {
        tpl_value_t *v = tv_dict_get_str(obj->u.dict, name, len);
        if (v != NULL) {
            return v;
        }
    }
    char tn[64];
    snprintf(tn, sizeof(tn), "%s object", obj->kind == TV_NONE ? "None" : tv_type_name(obj));
    return undef_msg(r, "'%s' has no attribute '%s'", tn, name);
}

static bool as_index(const tpl_value_t *k, int64_t *out)
{
    if (k->kind == TV_INT) {
        *out = k->u.i;
        return true;
    }
    if (k->kind == TV_BOOL) {
        *out = k->u.b;
        return true;
    }
    return false;
}

/* obj[key]: items first (Python's getitem), then attributes for string keys. */
static tpl_value_t *get_item(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *obj, tpl_value_t *key)
{
    if (obj->kind == TV_UNDEF) {
        return undefined_error(r, at, obj);
    }
    int64_t idx;
    if ((obj->kind == TV_LIST || obj->kind == TV_STR) && as_index(key, &idx)) {
        int64_t n = obj->kind == TV_LIST ? (int64_t)obj->u.list.n
                                         : (int64_t)tv_utf8_count(obj->u.str.s, obj->u.str.len);
        if (idx < 0) {
            idx += n;
        }
        if (idx < 0 || idx >= n) {
            return undef_msg(r, "%s index out of range%s", obj->kind == TV_LIST ? "list" : "string", "");
        }
        if (obj->kind == TV_LIST) {
            return obj->u.list.items[idx];
        }
        size_t b = tv_utf8_offset(obj->u.str.s, obj->u.str.len, (size_t)idx);
        size_t e = tv_utf8_offset(obj->u.str.s, obj->u.str.len, (size_t)idx + 1);
        return tv_str(r, obj->u.str.s + b, e - b);
    }
    if (obj->kind == TV_DICT) {
        tpl_value_t *v = tv_dict_get(obj->u.dict, key);
        if (v != NULL) {
            return v;
        }
    }
    if (key->kind == TV_STR) {
        if (obj->kind == TV_DICT) {
            tpl_value_t *m = tpl_method(r, obj, key->u.str.s, key->u.str.len);
            if (m != NULL || r->failed) {
                return m;
            }
            return undef_msg(r, "'dict object' has no attribute '%s'%s", key->u.str.s, "");
        }
        return get_attr(r, at, obj, key->u.str.s, key->u.str.len);
    }
    char tn[64];
    snprintf(tn, sizeof(tn), "%s object", obj->kind == TV_NONE ? "None" : tv_type_name(obj));
    return undef_msg(r, "'%s' has no item of that key%s", tn, "");
}

/* Python slice indices for a sequence of n elements. */
static bool slice_bounds(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *lo, tpl_value_t *hi,
                         tpl_value_t *st, int64_t n, int64_t *start, int64_t *stop, int64_t *step)
{
    *step = 1;
    if (st != NULL && st->kind != TV_NONE && !as_index(st, step)) {
        tpl_fail(r, at, "slice indices must be integers or None");
        return false;
    }
    if (*step == 0) {
        tpl_fail(r, at, "slice step cannot be zero");
        return false;
    }
    int64_t def_lo = *step > 0 ? 0 : n - 1, def_hi = *step > 0 ? n : -n - 1;
    tpl_value_t *b[2] = {lo, hi};
    int64_t *o[2] = {start, stop};
    int64_t d[2] = {def_lo, def_hi};
    for (int k = 0; k < 2; k++) {
        if (b[k] == NULL || b[k]->kind == TV_NONE) {
            *o[k] = d[k];
            if (*step < 0 && k == 1) {
                *o[k] = -1;
            }
            continue;
        }
        int64_t v;
        if (!as_index(b[k], &v)) {
            tpl_fail(r, at, "slice indices must be integers or None");
            return false;
        }
        if (v < 0) {
            v += n;
            if (v < 0) {
                v = *step < 0 ? -1 : 0;
            }
        } else if (v >= n) {
            v = *step < 0 ? n - 1 : n;
        }
        *o[k] = v;
    }
    return true;
}

static tpl_value_t *eval_slice(tpl_render_t *r, const tpl_node_t *e)
{
    tpl_value_t *obj = eval(r, e->a);
    tpl_value_t *lo = e->b != NULL ? eval(r, e->b) : NULL;
    tpl_value_t *hi = e->c != NULL ? eval(r, e->c) : NULL;
    tpl_value_t *st = e->d != NULL ? eval(r, e->d) : NULL;
    if (r->failed) {
        return NULL;
    }
    if (obj->kind == TV_UNDEF) {
        return undefined_error(r, e, obj);
    }
    if (obj->kind != TV_LIST && obj->kind != TV_STR) {
        return tpl_fail(r, e, "'%s' object is not subscriptable", tv_type_name(obj));
    }
    bool is_str = obj->kind == TV_STR;
    int64_t n = is_str ? (int64_t)tv_utf8_count(obj->u.str.s, obj->u.str.len) : (int64_t)obj->u.list.n;
    int64_t start, stop, step;
    if (!slice_bounds(r, e, lo, hi, st, n, &start, &stop, &step)) {
        return NULL;
    }
    int64_t cnt = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        cnt++;
    }
    if (!is_str) {
        tpl_value_t *out = tv_list(r, (size_t)cnt);
        if (out == NULL) {
            return NULL;
        }
        out->is_tuple = obj->is_tuple;
        int64_t k = 0;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            out->u.list.items[k++] = obj->u.list.items[i];
        }
        return out;
    }
    /* strings: by code point */
    size_t *offs = tpl_alloc(r, (size_t)(n + 1) * sizeof(size_t));
    char *buf = tpl_alloc(r, obj->u.str.len + 1);
    if (offs == NULL || buf == NULL) {
        return NULL;
    }
    size_t p = 0;
    for (int64_t i = 0; i <= n; i++) {
        offs[i] = p;
        if (p < obj->u.str.len) {
            p++;
            while (p < obj->u.str.len && ((unsigned char)obj->u.str.s[p] & 0xc0) == 0x80) {
                p++;
            }
        }
    }
    size_t k = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        size_t w = offs[i + 1] - offs[i];
        memcpy(buf + k, obj->u.str.s + offs[i], w);
        k += w;
    }
    buf[k] = '\0';
    return tv_str_nocopy(r, buf, k);
}

static tpl_value_t *type_error(tpl_render_t *r, const tpl_node_t *at, const char *op, tpl_value_t *a,
                               tpl_value_t *b)
{
    if (a->kind == TV_UNDEF) {
        return undefined_error(r, at, a);
    }
    if (b != NULL && b->kind == TV_UNDEF) {
        return undefined_error(r, at, b);
    }
    if (b == NULL) {
        return tpl_fail(r, at, "bad operand type for unary %s: '%s'", op, tv_type_name(a));
    }
    return tpl_fail(r, at, "unsupported operand type(s) for %s: '%s' and '%s'", op, tv_type_name(a),
                    tv_type_name(b));
}

static int64_t ival(const tpl_value_t *v)
{
    return v->kind == TV_BOOL ? v->u.b : v->u.i;
}

static tpl_value_t *repeat(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *seq, int64_t times)
{
    if (times < 0) {
        times = 0;
    }
    size_t unit = seq->kind == TV_STR ? seq->u.str.len : seq->u.list.n;
    if (unit > 0 && (uint64_t)times > (uint64_t)(r->lim.max_memory / unit)) {
        return tpl_fail(r, at, "repetition result too large");
    }
    if (seq->kind == TV_STR) {
        size_t len = unit * (size_t)times;
        char *s = tpl_alloc(r, len + 1);
        if (s == NULL) {
            return NULL;
        }
        for (int64_t i = 0; i < times; i++) {
            memcpy(s + (size_t)i * unit, seq->u.str.s, unit);
        }
        s[len] = '\0';
        return tv_str_nocopy(r, s, len);
    }
    tpl_value_t *out = tv_list(r, unit * (size_t)times);
    if (out == NULL) {
        return NULL;
    }
    out->is_tuple = seq->is_tuple;
    for (int64_t i = 0; i < times; i++) {
        memcpy(out->u.list.items + (size_t)i * unit, seq->u.list.items, unit * sizeof(tpl_value_t *));
    }
    return out;
}

static tpl_value_t *arith(tpl_render_t *r, const tpl_node_t *at, int op, tpl_value_t *a, tpl_value_t *b)
{
    static const char *const names[] = {"", "+", "-", "*", "/", "//", "%", "**"};
    bool nums = tv_is_number(a) && tv_is_number(b);
    bool ints = nums && a->kind != TV_FLOAT && b->kind != TV_FLOAT;
    if (op == OP_ADD) {
        if (a->kind == TV_STR && b->kind == TV_STR) {
            char *s = tpl_alloc(r, a->u.str.len + b->u.str.len + 1);
            if (s == NULL) {
                return NULL;
            }
            memcpy(s, a->u.str.s, a->u.str.len);
            memcpy(s + a->u.str.len, b->u.str.s, b->u.str.len);
            s[a->u.str.len + b->u.str.len] = '\0';
            return tv_str_nocopy(r, s, a->u.str.len + b->u.str.len);
        }
        if (a->kind == TV_LIST && b->kind == TV_LIST && a->is_tuple == b->is_tuple) {
            tpl_value_t *out = tv_list(r, a->u.list.n + b->u.list.n);
            if (out == NULL) {
                return NULL;
            }
            out->is_tuple = a->is_tuple;
            memcpy(out->u.list.items, a->u.list.items, a->u.list.n * sizeof(tpl_value_t *));
            memcpy(out->u.list.items + a->u.list.n, b->u.list.items, b->u.list.n * sizeof(tpl_value_t *));
            return out;
        }
    }
    if (op == OP_MOD && a->kind == TV_STR) { /* "%s and %d" % (x, 3) */
        return tpl_percent(r, at, a, b);
    }
    if (op == OP_MUL) {
        if ((a->kind == TV_STR || a->kind == TV_LIST) && (b->kind == TV_INT || b->kind == TV_BOOL)) {
            return repeat(r, at, a, ival(b));
        }
        if ((b->kind == TV_STR || b->kind == TV_LIST) && (a->kind == TV_INT || a->kind == TV_BOOL)) {
            return repeat(r, at, b, ival(a));
        }
    }
    if (!nums) {
        return type_error(r, at, names[op], a, b);
    }
    if (ints) {
        int64_t x = ival(a), y = ival(b), z = 0;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(x, y, &z)) {
                return tpl_fail(r, at, "integer overflow");
            }
            return tv_int(r, z);
        case OP_SUB:
            if (__builtin_sub_overflow(x, y, &z)) {
                return tpl_fail(r, at, "integer overflow");
            }
            return tv_int(r, z);
        case OP_MUL:
            if (__builtin_mul_overflow(x, y, &z)) {
                return tpl_fail(r, at, "integer overflow");
            }
            return tv_int(r, z);
        case OP_DIV:
            if (y == 0) {
                return tpl_fail(r, at, "division by zero");
            }
            return tv_float(r, (double)x / (double)y);
        case OP_FLOORDIV:
        case OP_MOD: {
            if (y == 0) {
                return tpl_fail(r, at, "integer division or modulo by zero");
            }
            if (x == INT64_MIN && y == -1) {
                return tpl_fail(r, at, "integer overflow");
            }
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            return tv_int(r, op == OP_FLOORDIV ? q : m);
        }
        case OP_POW:
            if (y < 0) {
                return tv_float(r, pow((double)x, (double)y));
            }
            z = 1;
            for (int64_t i = 0; i < y; i++) {
                if (__builtin_mul_overflow(z, x, &z)) {
                    return tpl_fail(r, at, "integer overflow");
                }
                if (z == 0 || z == 1) {
                    break;
                }
            }
            if (z == 1 && x == -1 && (y % 2) == 1) {
                z = -1;
            }
            return tv_int(r, z);
        }
    }
    double x = tv_as_double(a), y = tv_as_double(b);
    switch (op) {
    case OP_ADD: return tv_float(r, x + y);
    case OP_SUB: return tv_float(r, x - y);
    case OP_MUL: return tv_float(r, x * y);
    case OP_DIV:
        if (y == 0) {
            return tpl_fail(r, at, "float division by zero");
        }
        return tv_float(r, x / y);
    case OP_FLOORDIV:
        if (y == 0) {
            return tpl_fail(r, at, "float floor division by zero");
        }
        return tv_float(r, floor(x / y));
    case OP_MOD: {
        if (y == 0) {
            return tpl_fail(r, at, "float modulo");
        }
        double m = fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) {
            m += y;
        }
        return tv_float(r, m);
    }
    default: return tv_float(r, pow(x, y));
    }
}

/* -1, 0, 1, or 2 when the values cannot be ordered. */
static int order(const tpl_value_t *a, const tpl_value_t *b)
{
    if (tv_is_number(a) && tv_is_number(b)) {
        double x = tv_as_double(a), y = tv_as_double(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a->kind == TV_STR && b->kind == TV_STR) {
        size_t m = a->u.str.len < b->u.str.len ? a->u.str.len : b->u.str.len;
        int c = memcmp(a->u.str.s, b->u.str.s, m);
        if (c != 0) {
            return c < 0 ? -1 : 1;
        }
        return a->u.str.len < b->u.str.len ? -1 : a->u.str.len > b->u.str.len;
    }
    if (a->kind == TV_LIST && b->kind == TV_LIST && a->is_tuple == b->is_tuple) {
        size_t m = a->u.list.n < b->u.list.n ? a->u.list.n : b->u.list.n;
        for (size_t i = 0; i < m; i++) {
            if (!tv_equal(a->u.list.items[i], b->u.list.items[i])) {
                return order(a->u.list.items[i], b->u.list.items[i]);
            }
        }
        return a->u.list.n < b->u.list.n ? -1 : a->u.list.n > b->u.list.n;
    }
    return 2;
}

/* Exposed for sort/max/min filters. */
int tpl_order(const tpl_value_t *a, const tpl_value_t *b)
{
    return order(a, b);
}

/* x in container: 1 / 0, -1 on error. */
static int contains(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *x, tpl_value_t *c)
{
    switch (c->kind) {
    case TV_STR:
        if (x->kind != TV_STR) {
            tpl_fail(r, at, "'in <string>' requires string as left operand, not %s", tv_type_name(x));
            return -1;
        }
        if (x->u.str.len == 0) {
            return 1;
        }
        return memmem(c->u.str.s, c->u.str.len, x->u.str.s, x->u.str.len) != NULL;
    case TV_LIST:
        for (size_t i = 0; i < c->u.list.n; i++) {
            if (tv_equal(x, c->u.list.items[i])) {
                return 1;
            }
        }
        return 0;
    case TV_DICT:
    case TV_NS: return tv_dict_get(c->u.dict, x) != NULL;
    case TV_UNDEF: return 0;
    default: tpl_fail(r, at, "argument of type '%s' is not iterable", tv_type_name(c)); return -1;
    }
}

static tpl_value_t *eval_compare(tpl_render_t *r, const tpl_node_t *e)
{
    tpl_value_t *left = eval(r, e->a);
    for (size_t i = 0; i < e->n_kids && left != NULL; i++) {
        tpl_value_t *right = eval(r, e->kids[i]);
        if (right == NULL) {
            return NULL;
        }
        int op = e->ops[i];
        bool ok;
        if (op == OP_EQ || op == OP_NE) {
            ok = tv_equal(left, right) == (op == OP_EQ);
        } else if (op == OP_IN || op == OP_NOTIN) {
            int c = contains(r, e, left, right);
            if (c < 0) {
                return NULL;
            }
            ok = (c == 1) == (op == OP_IN);
        } else {
            int c = order(left, right);
            if (c == 2) {
                if (left->kind == TV_UNDEF || right->kind == TV_UNDEF) {
                    return undefined_error(r, e, left->kind == TV_UNDEF ? left : right);
                }
                static const char *const sym[] = {"<", "<=", ">", ">="};
                return tpl_fail(r, e, "'%s' not supported between instances of '%s' and '%s'",
                                sym[op - OP_LT], tv_type_name(left), tv_type_name(right));
            }
            ok = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        }
        if (!ok) {
            return &TPL_FALSE;
        }
        left = right;
    }
    return left != NULL ? &TPL_TRUE : NULL;
}

/* Evaluates kids (arguments) into a fresh array. */
static tpl_value_t **eval_args(tpl_render_t *r, const tpl_node_t *e)
{
    tpl_value_t **args = tpl_alloc(r, (e->n_kids ? e->n_kids : 1) * sizeof(tpl_value_t *));
    for (size_t i = 0; args != NULL && i < e->n_kids; i++) {
        args[i] = eval(r, e->kids[i]);
        if (args[i] == NULL) {
            return NULL;
        }
    }
    return args;
}

static tpl_value_t *eval(tpl_render_t *r, const tpl_node_t *e)
{
    if (!tpl_step(r, e)) {
        return NULL;
    }
    switch (e->kind) {
    case ND_LITERAL: return e->v;
    case ND_NAME: {
        tpl_value_t *v = scope_get(r->scope, e->s);
        if (v == NULL) {
            v = tpl_global(r, e->s);
        }
        if (v == NULL && !r->failed) {
            v = undef_msg(r, "'%s' is undefined%s", e->s, "");
        }
        return v;
    }
    case ND_LIST:
    case ND_TUPLE: {
        tpl_value_t **items = eval_args(r, e);
        tpl_value_t *l = items != NULL ? tv_list(r, e->n_kids) : NULL;
        if (l != NULL) {
            memcpy(l->u.list.items, items, e->n_kids * sizeof(tpl_value_t *));
            l->is_tuple = e->kind == ND_TUPLE;
        }
        return l;
    }
    case ND_DICT: {
        tpl_value_t *d = tv_dict(r);
        for (size_t i = 0; d != NULL && i + 1 < e->n_kids; i += 2) {
            tpl_value_t *k = eval(r, e->kids[i]);
            tpl_value_t *v = k != NULL ? eval(r, e->kids[i + 1]) : NULL;
            if (v == NULL || !tv_dict_set(r, d->u.dict, k, v)) {
                return NULL;
            }
        }
        return d;
    }
    case ND_ATTR: {
        tpl_value_t *obj = eval(r, e->a);
        return obj != NULL ? get_attr(r, e, obj, e->s, strlen(e->s)) : NULL;
    }
    case ND_ITEM: {
        tpl_value_t *obj = eval(r, e->a);
        tpl_value_t *key = obj != NULL ? eval(r, e->b) : NULL;
        return key != NULL ? get_item(r, e, obj, key) : NULL;
    }
    case ND_SLICE: return eval_slice(r, e);
    case ND_CALL: {
        tpl_value_t *fn = eval(r, e->a);
        if (fn == NULL) {
            return NULL;
        }
        tpl_value_t **args = eval_args(r, e);
        return args != NULL ? tpl_call_value(r, e, fn, args, e->n_kids, e->kwnames) : NULL;
    }
    case ND_FILTER: {
        tpl_value_t *in = eval(r, e->a);
        tpl_value_t **args = in != NULL ? eval_args(r, e) : NULL;
        return args != NULL ? tpl_filter(r, e, e->s, in, args, e->n_kids, e->kwnames) : NULL;
    }
    case ND_TEST: {
        tpl_value_t *in = eval(r, e->a);
        tpl_value_t **args = in != NULL ? eval_args(r, e) : NULL;
        if (args == NULL) {
            return NULL;
        }
        int t = tpl_test(r, e, e->s, in, args, e->n_kids);
        return t < 0 ? NULL : tv_bool((t == 1) != e->neg);
    }
    case ND_UNARY: {
        tpl_value_t *a = eval(r, e->a);
        if (a == NULL) {
            return NULL;
        }
        if (!tv_is_number(a)) {
            return type_error(r, e, e->op == OP_NEG ? "-" : "+", a, NULL);
        }
        if (e->op == OP_POS) {
            return a->kind == TV_BOOL ? tv_int(r, a->u.b) : a;
        }
        if (a->kind == TV_FLOAT) {
            return tv_float(r, -a->u.f);
        }
        if (ival(a) == INT64_MIN) {
            return tpl_fail(r, e, "integer overflow");
        }
        return tv_int(r, -ival(a));
    }
    case ND_BINARY: {
        tpl_value_t *a = eval(r, e->a);
        tpl_value_t *b = a != NULL ? eval(r, e->b) : NULL;
        if (b == NULL) {
            return NULL;
        }
        if (e->op == OP_CONCAT) {
            tpl_buf_t buf = {0};
            tv_str_into(&buf, a);
            tv_str_into(&buf, b);
            tpl_value_t *s =
                buf.failed ? tpl_fail(r, e, "out of memory") : tv_str(r, buf.p ? buf.p : "", buf.n);
            tb_free(&buf);
            return s;
        }
        return arith(r, e, e->op, a, b);
    }
    case ND_AND: {
        tpl_value_t *a = eval(r, e->a);
        return a == NULL ? NULL : !tv_truthy(a) ? a : eval(r, e->b);
    }
    case ND_OR: {
        tpl_value_t *a = eval(r, e->a);
        return a == NULL ? NULL : tv_truthy(a) ? a : eval(r, e->b);
    }
    case ND_NOT: {
        tpl_value_t *a = eval(r, e->a);
        return a != NULL ? tv_bool(!tv_truthy(a)) : NULL;
    }
    case ND_COND: {
        tpl_value_t *c = eval(r, e->b);
        if (c == NULL) {
            return NULL;
        }
        if (tv_truthy(c)) {
            return eval(r, e->a);
        }
        return e->c != NULL ? eval(r, e->c) : undef_msg(r, "the inline if had no else%s%s", "", "");
    }
    case ND_COMPARE: return eval_compare(r, e);
    default: return tpl_fail(r, e, "not an expression");
    }
}

/* ------------------------------------------------------------------ calls */

static tpl_value_t *loop_again(tpl_render_t *r, const tpl_node_t *at, const tpl_loop_t *l, tpl_value_t *it);
static void emit_value(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *v);

/* A macro's body rendered with its arguments: in a scope over the globals, or for a call block's
 * caller over the scope of the call site; the macro a call block calls gets the caller as caller. */
static tpl_value_t *call_macro(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *fn,
                               tpl_value_t **args, size_t n, const char **kwnames)
{
    const tpl_node_t *m = fn->u.macro.node;
    if (r->call_depth >= r->lim.max_call_depth) {
        return tpl_fail(r, at, "macro calls nest deeper than %d", r->lim.max_call_depth);
    }
    scope_t *s = scope_new(r, fn->u.macro.closure != NULL ? fn->u.macro.closure : r->root);
    if (s == NULL) {
        return NULL;
    }
    if (r->caller != NULL && at == r->caller_at) {
        tpl_value_t *c = r->caller;
        r->caller = NULL; /* for this call only, not for calls its arguments made */
        if (!scope_set(r, s, "caller", c)) {
            return NULL;
        }
    }
    size_t npos = 0;
    for (size_t i = 0; i < n; i++) {
        if (kwnames == NULL || kwnames[i] == NULL) {
            if (npos >= m->n_names) {
                return tpl_fail(r, at, "macro '%s' takes not more than %zu argument(s)", m->s, m->n_names);
            }
            if (!scope_set(r, s, m->names[npos++], args[i])) {
                return NULL;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (kwnames == NULL || kwnames[i] == NULL) {
            continue;
        }
        size_t p = 0;
        while (p < m->n_names && strcmp(m->names[p], kwnames[i]) != 0) {
            p++;
        }
        if (p == m->n_names) {
            return tpl_fail(r, at, "macro '%s' has no parameter named '%s'", m->s, kwnames[i]);
        }
        if (p < npos) {
            return tpl_fail(r, at, "macro '%s' got multiple values for '%s'", m->s, kwnames[i]);
        }
        if (!scope_set(r, s, m->names[p], args[i])) {
            return NULL;
        }
    }
    scope_t *saved_scope = r->scope;
    tpl_buf_t *saved_out = r->out;
    tpl_buf_t body = {0};
    r->scope = s;
    for (size_t p = 0; p < m->n_names; p++) { /* defaults, in the macro's scope */
        bool bound = false;
        for (size_t k = 0; k < s->n; k++) {
            bound |= strcmp(s->names[k], m->names[p]) == 0;
        }
        if (!bound) {
            tpl_value_t *d = m->kids[p] != NULL ? eval(r, m->kids[p])
                                                : undef_msg(r, "'%s' is undefined%s", m->names[p], "");
            if (d == NULL || !scope_set(r, s, m->names[p], d)) {
                r->scope = saved_scope;
                return NULL;
            }
        }
    }
    r->out = &body;
    r->call_depth++;
    int saved_ctl = r->loop_ctl;
    exec_body(r, m->b);
    r->loop_ctl = saved_ctl;
    r->call_depth--;
    r->out = saved_out;
    r->scope = saved_scope;
    tpl_value_t *res = r->failed ? NULL : tv_str(r, body.p != NULL ? body.p : "", body.n);
    tb_free(&body);
    return res;
}

tpl_value_t *tpl_call_value(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fn, tpl_value_t **args,
                            size_t n_args, const char **kwnames)
{
    switch (fn->kind) {
    case TV_MACRO: return call_macro(r, at, fn, args, n_args, kwnames);
    case TV_LOOP:
        if (fn->u.loop->recursive != NULL && n_args == 1 && (kwnames == NULL || kwnames[0] == NULL)) {
            return loop_again(r, at, fn->u.loop, args[0]);
        }
        return tpl_fail(r, at, "%s",
                        fn->u.loop->recursive != NULL ? "loop() takes one iterable"
                                                      : "the loop is not recursive: loop() is "
                                                        "callable only in a 'for ... recursive' loop");
    case TV_FUNC:
    case TV_METHOD: return tpl_call_builtin(r, at, fn->u.fn.name, fn->u.fn.self, args, n_args, kwnames);
    case TV_UNDEF: return undefined_error(r, at, fn);
    default: return tpl_fail(r, at, "'%s' object is not callable", tv_type_name(fn));
    }
}

/* ------------------------------------------------------------------ statements */

/* Items a for loop walks: list/tuple items, dict keys, string characters; undefined is empty. */
static tpl_value_t *iterable_items(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *v)
{
    switch (v->kind) {
    case TV_LIST: return v;
    case TV_UNDEF: return tv_list(r, 0);
    case TV_DICT: {
        tpl_value_t *l = tv_list(r, v->u.dict->n);
        if (l != NULL) {
            memcpy(l->u.list.items, v->u.dict->keys, v->u.dict->n * sizeof(tpl_value_t *));
        }
        return l;
    }
    case TV_STR: {
        size_t n = tv_utf8_count(v->u.str.s, v->u.str.len);
        tpl_value_t *l = tv_list(r, n);
        size_t p = 0;
        for (size_t i = 0; l != NULL && i < n; i++) {
            size_t q = p + 1;
            while (q < v->u.str.len && ((unsigned char)v->u.str.s[q] & 0xc0) == 0x80) {
                q++;
            }
            l->u.list.items[i] = tv_str(r, v->u.str.s + p, q - p);
            if (l->u.list.items[i] == NULL) {
                return NULL;
            }
            p = q;
        }
        return l;
    }
    default: return tpl_fail(r, at, "'%s' object is not iterable", tv_type_name(v));
    }
}

tpl_value_t *tpl_iterable(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *v)
{
    return iterable_items(r, at, v);
}

static bool bind_targets(tpl_render_t *r, const tpl_node_t *at, scope_t *s, const char **names, size_t n,
                         tpl_value_t *v)
{
    if (n == 1) {
        return scope_set(r, s, names[0], v);
    }
    tpl_value_t *items = v->kind == TV_LIST ? v : iterable_items(r, at, v);
    if (items == NULL) {
        return false;
    }
    if (items->u.list.n != n) {
        tpl_fail(r, at, "cannot unpack %zu values into %zu names", items->u.list.n, n);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!scope_set(r, s, names[i], items->u.list.items[i])) {
            return false;
        }
    }
    return true;
}

/* The for loop st over items (its filter, body, else) in scope outer, at recursion depth depth0. */
static void run_for(tpl_render_t *r, const tpl_node_t *st, tpl_value_t *items, scope_t *outer, int64_t depth0)
{
    if (st->d != NULL) { /* the loop filter runs before the loop (loop.length counts kept items) */
        tpl_value_t *kept = tv_list(r, items->u.list.n);
        if (kept == NULL) {
            return;
        }
        size_t k = 0;
        for (size_t i = 0; i < items->u.list.n; i++) {
            scope_t *s = scope_new(r, outer);
            if (s == NULL || !bind_targets(r, st, s, st->names, st->n_names, items->u.list.items[i])) {
                return;
            }
            scope_t *saved = r->scope;
            r->scope = s;
            tpl_value_t *c = eval(r, st->d);
            r->scope = saved;
            if (c == NULL) {
                return;
            }
            if (tv_truthy(c)) {
                kept->u.list.items[k++] = items->u.list.items[i];
            }
        }
        kept->u.list.n = k;
        items = kept;
    }
    scope_t *saved = r->scope;
    size_t n = items->u.list.n;
    for (size_t i = 0; i < n && !r->failed; i++) {
        if (!tpl_step(r, st)) {
            return;
        }
        scope_t *s = scope_new(r, outer);
        tpl_value_t *lv = tpl_alloc(r, sizeof(tpl_value_t));
        tpl_loop_t *loop = tpl_alloc(r, sizeof(tpl_loop_t));
        if (s == NULL || lv == NULL || loop == NULL) {
            return;
        }
        memset(lv, 0, sizeof(*lv));
        memset(loop, 0, sizeof(*loop));
        lv->kind = TV_LOOP;
        lv->u.loop = loop;
        loop->index0 = (int64_t)i;
        loop->length = (int64_t)n;
        loop->prev = i > 0 ? items->u.list.items[i - 1] : NULL;
        loop->next = i + 1 < n ? items->u.list.items[i + 1] : NULL;
        loop->depth0 = depth0;
        loop->recursive = st->neg ? st : NULL;
        loop->outer = outer;
        if (!scope_set(r, s, "loop", lv) ||
            !bind_targets(r, st, s, st->names, st->n_names, items->u.list.items[i])) {
            return;
        }
        r->scope = s;
        exec_body(r, st->b);
        r->scope = saved;
        int ctl = r->loop_ctl;
        r->loop_ctl = 0;
        if (ctl == 1) {
            break;
        }
    }
    if (n == 0 && st->c != NULL) {
        exec_body(r, st->c);
    }
}

static void exec_for(tpl_render_t *r, const tpl_node_t *st)
{
    tpl_value_t *it = eval(r, st->a);
    tpl_value_t *items = it != NULL ? iterable_items(r, st, it) : NULL;
    if (items != NULL) {
        run_for(r, st, items, r->scope, 0);
    }
}

/* loop(items) in a recursive for loop: its body over items one level deeper, as a string. */
static tpl_value_t *loop_again(tpl_render_t *r, const tpl_node_t *at, const tpl_loop_t *l, tpl_value_t *it)
{
    if (r->call_depth >= r->lim.max_call_depth) {
        return tpl_fail(r, at, "recursive loops nest deeper than %d", r->lim.max_call_depth);
    }
    tpl_value_t *items = iterable_items(r, at, it);
    if (items == NULL) {
        return NULL;
    }
    tpl_buf_t *saved_out = r->out;
    tpl_buf_t body = {0};
    r->out = &body;
    r->call_depth++;
    int saved_ctl = r->loop_ctl;
    r->loop_ctl = 0;
    run_for(r, l->recursive, items, l->outer, l->depth0 + 1);
    r->loop_ctl = saved_ctl;
    r->call_depth--;
    r->out = saved_out;
    tpl_value_t *res = r->failed ? NULL : tv_str(r, body.p != NULL ? body.p : "", body.n);
    tb_free(&body);
    return res;
}

/* {% call %}: the macro call with caller() bound to the block (rendered in this scope), written out. */
static void exec_call_block(tpl_render_t *r, const tpl_node_t *st)
{
    tpl_value_t *c = tpl_alloc(r, sizeof(tpl_value_t));
    if (c == NULL) {
        return;
    }
    memset(c, 0, sizeof(*c));
    c->kind = TV_MACRO;
    c->u.macro.node = st->c;
    c->u.macro.closure = r->scope;
    tpl_value_t *saved = r->caller;
    const tpl_node_t *saved_at = r->caller_at;
    r->caller = c;
    r->caller_at = st->a;
    tpl_value_t *v = eval(r, st->a);
    r->caller = saved;
    r->caller_at = saved_at;
    if (v != NULL) {
        emit_value(r, st, v);
    }
}

static scope_t *find_scope(scope_t *s, const char *name)
{
    for (; s != NULL; s = s->parent) {
        for (size_t i = 0; i < s->n; i++) {
            if (strcmp(s->names[i], name) == 0) {
                return s;
            }
        }
    }
    return NULL;
}

/* body rendered apart, as a string (NULL when the render failed). */
static tpl_value_t *render_apart(tpl_render_t *r, const tpl_node_t *body)
{
    tpl_buf_t *saved = r->out;
    tpl_buf_t b = {0};
    r->out = &b;
    exec_body(r, body);
    r->out = saved;
    tpl_value_t *v = r->failed ? NULL : tv_str(r, b.p != NULL ? b.p : "", b.n);
    tb_free(&b);
    return v;
}

static void exec_set(tpl_render_t *r, const tpl_node_t *st)
{
    if (st->kind == ND_SET_BLOCK) {
        tpl_value_t *v = render_apart(r, st->b);
        if (v != NULL) {
            scope_set(r, r->scope, st->names[0], v);
        }
        return;
    }
    tpl_value_t *v = eval(r, st->a);
    if (v == NULL) {
        return;
    }
    if (st->s != NULL) { /* ns.attr = v */
        tpl_value_t *ns = scope_get(r->scope, st->names[0]);
        if (ns == NULL || ns->kind != TV_NS) {
            tpl_fail(r, st, "cannot assign attribute on non-namespace object '%s'", st->names[0]);
            return;
        }
        tpl_value_t *k = tv_str(r, st->s, strlen(st->s));
        if (k != NULL) {
            tv_dict_set(r, ns->u.dict, k, v);
        }
        return;
    }
    (void)find_scope;
    bind_targets(r, st, r->scope, st->names, st->n_names, v);
}

/* Writes v's str() to the output, as {{ v }} does. */
static void emit_value(tpl_render_t *r, const tpl_node_t *at, const tpl_value_t *v)
{
    if (v->kind == TV_STR) {
        emit(r, at, v->u.str.s, v->u.str.len);
        return;
    }
    tpl_buf_t b = {0};
    tv_str_into(&b, v);
    emit(r, at, b.p != NULL ? b.p : "", b.n);
    tb_free(&b);
}

/* {% with %}: the values in the enclosing scope, the body in a scope of its own (its sets stay in). */
static void exec_with(tpl_render_t *r, const tpl_node_t *st)
{
    scope_t *outer = r->scope;
    scope_t *s = scope_new(r, outer);
    for (size_t i = 0; s != NULL && i < st->n_names; i++) {
        tpl_value_t *v = eval(r, st->kids[i]);
        if (v == NULL || !scope_set(r, s, st->names[i], v)) {
            return;
        }
    }
    if (s == NULL) {
        return;
    }
    r->scope = s;
    exec_body(r, st->b);
    r->scope = outer;
}

/* {% filter %}: the body rendered apart, then the chain applied to it and written out. */
static void exec_filter_block(tpl_render_t *r, const tpl_node_t *st)
{
    tpl_value_t *text = render_apart(r, st->b);
    scope_t *outer = r->scope;
    scope_t *s = text != NULL ? scope_new(r, outer) : NULL;
    if (s == NULL || !scope_set(r, s, TPL_FILTER_BODY, text)) {
        return;
    }
    r->scope = s;
    tpl_value_t *v = eval(r, st->a);
    r->scope = outer;
    if (v != NULL) {
        emit_value(r, st, v);
    }
}

static void exec_body(tpl_render_t *r, const tpl_node_t *body)
{
    for (size_t i = 0; i < body->n_kids && !r->failed && r->loop_ctl == 0; i++) {
        const tpl_node_t *st = body->kids[i];
        if (!tpl_step(r, st)) {
            return;
        }
        switch (st->kind) {
        case ND_TEXT: emit(r, st, st->s, st->slen); break;
        case ND_OUTPUT: {
            tpl_value_t *v = eval(r, st->a);
            if (v != NULL) {
                emit_value(r, st, v);
            }
            break;
        }
        case ND_IF: {
            const tpl_node_t *n = st;
            while (n != NULL && n->kind == ND_IF) {
                tpl_value_t *c = eval(r, n->a);
                if (c == NULL) {
                    return;
                }
                if (tv_truthy(c)) {
                    exec_body(r, n->b);
                    break;
                }
                n = n->c;
            }
            if (n != NULL && n->kind == ND_BODY) {
                exec_body(r, n);
            }
            break;
        }
        case ND_FOR: exec_for(r, st); break;
        case ND_SET:
        case ND_SET_BLOCK: exec_set(r, st); break;
        case ND_MACRO: {
            tpl_value_t *m = tpl_alloc(r, sizeof(tpl_value_t));
            if (m != NULL) {
                memset(m, 0, sizeof(*m));
                m->kind = TV_MACRO;
                m->u.macro.node = st;
                scope_set(r, r->scope, st->s, m);
            }
            break;
        }
        case ND_WITH: exec_with(r, st); break;
        case ND_CALL_BLOCK: exec_call_block(r, st); break;
        case ND_FILTER_BLOCK: exec_filter_block(r, st); break;
        case ND_BREAK: r->loop_ctl = 1; break;
        case ND_CONTINUE: r->loop_ctl = 2; break;
        case ND_BODY: exec_body(r, st); break;
        default: tpl_fail(r, st, "not a statement");
        }
    }
}

/* ------------------------------------------------------------------ public */

pd_status_t pd_template_parse(const char *src, size_t len, pd_template_t **tpl_out, pd_template_error_t *err)
{
    memset(err, 0, sizeof(*err));
    pd_template_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        snprintf(err->message, sizeof(err->message), "out of memory");
        return PD_ERR_NO_MEMORY;
    }
    pd_arena_init(&t->arena, 64 << 10);
    tpl_token_t *toks = NULL;
    size_t n = 0;
    pd_status_t st = tpl_lex(&t->arena, src, len, &toks, &n, err);
    if (st == PD_OK) {
        st = tpl_parse(t, toks, n, err);
    }
    if (st != PD_OK) {
        if (err->message[0] == '\0') {
            snprintf(err->message, sizeof(err->message), "out of memory");
        }
        pd_template_free(t);
        return st;
    }
    *tpl_out = t;
    return PD_OK;
}

void pd_template_free(pd_template_t *t)
{
    if (t == NULL) {
        return;
    }
    pd_arena_destroy(&t->arena);
    free(t);
}

bool pd_template_iterates_content(const pd_template_t *t)
{
    return t->iterates_content;
}

pd_status_t pd_template_render(const pd_template_t *t, const json_t *ctx, const pd_template_limits_t *lim,
                               char **out_out, size_t *len_out, pd_template_error_t *err)
{
    memset(err, 0, sizeof(*err));
    tpl_render_t r;
    memset(&r, 0, sizeof(r));
    r.t = t;
    if (lim != NULL) {
        r.lim = *lim;
    } else {
        pd_template_limits_default(&r.lim);
    }
    r.err = err;
    pd_arena_init(&r.arena, 64 << 10);
    tpl_buf_t out = {0};
    r.out = &out;
    r.root = scope_new(&r, NULL);
    r.scope = r.root;
    if (r.root != NULL && ctx != NULL) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)ctx, k, v)
        {
            tpl_value_t *tv = tv_from_json(&r, v);
            char *name = tpl_alloc(&r, strlen(k) + 1);
            if (tv == NULL || name == NULL) {
                break;
            }
            strcpy(name, k);
            if (!scope_set(&r, r.root, name, tv)) {
                break;
            }
        }
    }
    if (!r.failed) {
        exec_body(&r, t->root);
    }
    pd_status_t st = PD_OK;
    if (r.failed) {
        st = PD_ERR_INVALID_ARG;
        tb_free(&out);
    } else {
        if (out.p == NULL) {
            out.p = calloc(1, 1);
            if (out.p == NULL) {
                st = PD_ERR_NO_MEMORY;
                snprintf(err->message, sizeof(err->message), "out of memory");
            }
        }
        if (st == PD_OK) {
            *out_out = out.p;
            *len_out = out.n;
        }
    }
    pd_arena_destroy(&r.arena);
    return st;
}
