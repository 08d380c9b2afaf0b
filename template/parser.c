/* template/parser.c — tokens → syntax tree, with Jinja2's statement set (if/elif/else, for with
 * filter and else, set incl. block set and namespace attributes, macro, break/continue,
 * generation) and its expression grammar and precedence. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/tpl_internal.h"

typedef struct parser {
    pd_template_t *t;
    const tpl_token_t *tk;
    size_t n, i;
    int depth;
    pd_template_error_t *err;
    pd_status_t st;
} parser_t;

static const tpl_token_t *peek(parser_t *P)
{
    return &P->tk[P->i < P->n ? P->i : P->n - 1];
}

static const tpl_token_t *peek2(parser_t *P)
{
    return &P->tk[P->i + 1 < P->n ? P->i + 1 : P->n - 1];
}

static const tpl_token_t *next(parser_t *P)
{
    const tpl_token_t *t = peek(P);
    if (P->i < P->n - 1) {
        P->i++;
    }
    return t;
}

static void *fail(parser_t *P, const tpl_token_t *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void *fail(parser_t *P, const tpl_token_t *at, const char *fmt, ...)
{
    if (P->st == PD_OK) {
        P->st = PD_ERR_PARSE;
        P->err->line = at->line;
        P->err->column = at->col;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(P->err->message, sizeof(P->err->message), fmt, ap);
        va_end(ap);
    }
    return NULL;
}

static bool is_op(const tpl_token_t *t, const char *op)
{
    return t->kind == TK_OP && strcmp(t->text, op) == 0;
}

static bool is_name(const tpl_token_t *t, const char *name)
{
    return t->kind == TK_NAME && strcmp(t->text, name) == 0;
}

static bool expect_op(parser_t *P, const char *op)
{
    if (!is_op(peek(P), op)) {
        const tpl_token_t *t = peek(P);
        fail(P, t, "expected '%s', got %s", op,
             t->kind == TK_BLOCK_END ? "the end of the tag"
             : t->kind == TK_VAR_END ? "'}}'"
             : t->kind == TK_EOF     ? "the end of the template"
                                     : (t->text != NULL ? t->text : "a literal"));
        return false;
    }
    next(P);
    return true;
}

static tpl_node_t *node(parser_t *P, nd_kind_t kind, const tpl_token_t *at)
{
    tpl_node_t *nd = pd_arena_calloc(&P->t->arena, 1, sizeof(*nd));
    if (nd == NULL) {
        P->st = PD_ERR_NO_MEMORY;
        snprintf(P->err->message, sizeof(P->err->message), "out of memory");
        return NULL;
    }
    nd->kind = kind;
    nd->line = at->line;
    nd->col = at->col;
    return nd;
}

/* A growable list of nodes (copied into the arena when done). */
typedef struct nlist {
    tpl_node_t **v;
    const char **names;
    size_t n, cap;
} nlist_t;

static bool nl_push(nlist_t *l, tpl_node_t *x, const char *name)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        tpl_node_t **v = realloc(l->v, cap * sizeof(*v));
        const char **nm = v != NULL ? realloc(l->names, cap * sizeof(*nm)) : NULL;
        if (v == NULL || nm == NULL) {
            if (v != NULL) {
                l->v = v;
            }
            return false;
        }
        l->v = v;
        l->names = nm;
        l->cap = cap;
    }
    l->v[l->n] = x;
    l->names[l->n] = name;
    l->n++;
    return true;
}

static bool nl_finish(parser_t *P, nlist_t *l, tpl_node_t *into, bool with_names)
{
    into->n_kids = l->n;
    into->kids = pd_arena_alloc(&P->t->arena, (l->n ? l->n : 1) * sizeof(tpl_node_t *), 8);
    if (with_names) {
        into->kwnames = pd_arena_alloc(&P->t->arena, (l->n ? l->n : 1) * sizeof(char *), 8);
    }
    bool ok = into->kids != NULL && (!with_names || into->kwnames != NULL);
    if (ok && l->n > 0) {
        memcpy(into->kids, l->v, l->n * sizeof(tpl_node_t *));
        if (with_names) {
            memcpy(into->kwnames, l->names, l->n * sizeof(char *));
        }
    }
    free(l->v);
    free(l->names);
    memset(l, 0, sizeof(*l));
    if (!ok) {
        P->st = PD_ERR_NO_MEMORY;
    }
    return ok;
}

static void nl_drop(nlist_t *l)
{
    free(l->v);
    free(l->names);
    memset(l, 0, sizeof(*l));
}

/* ------------------------------------------------------------------ expressions */

static tpl_node_t *parse_expr(parser_t *P);
static tpl_node_t *parse_or(parser_t *P);
static tpl_node_t *parse_unary(parser_t *P, bool with_filter);

static bool enter(parser_t *P)
{
    if (++P->depth > PD_TEMPLATE_MAX_NEST) {
        fail(P, peek(P), "expression nests deeper than %d levels", PD_TEMPLATE_MAX_NEST);
        return false;
    }
    return true;
}

/* Call arguments after '(' up to ')': positional and name=value. */
static bool parse_args(parser_t *P, tpl_node_t *into)
{
    nlist_t l = {0};
    bool kw_seen = false;
    while (!is_op(peek(P), ")")) {
        if (l.n > 0 && !expect_op(P, ",")) {
            nl_drop(&l);
            return false;
        }
        if (is_op(peek(P), ")")) {
            break; /* trailing comma */
        }
        const char *name = NULL;
        if (peek(P)->kind == TK_NAME && is_op(peek2(P), "=")) {
            name = next(P)->text;
            next(P);
            kw_seen = true;
        } else if (kw_seen) {
            nl_drop(&l);
            fail(P, peek(P), "positional argument after a keyword argument");
            return false;
        }
        tpl_node_t *e = parse_expr(P);
        if (e == NULL || !nl_push(&l, e, name)) {
            nl_drop(&l);
            if (e != NULL) {
                P->st = PD_ERR_NO_MEMORY;
            }
            return false;
        }
    }
    next(P); /* ')' */
    return nl_finish(P, &l, into, true);
}

static tpl_node_t *literal(parser_t *P, const tpl_token_t *at, tpl_value_t *v)
{
    tpl_node_t *nd = node(P, ND_LITERAL, at);
    if (nd != NULL) {
        nd->v = v;
    }
    return nd;
}

static tpl_value_t *const_value(parser_t *P, tv_kind_t kind)
{
    tpl_value_t *v = pd_arena_calloc(&P->t->arena, 1, sizeof(*v));
    if (v != NULL) {
        v->kind = kind;
    }
    return v;
}

static tpl_node_t *parse_primary(parser_t *P)
{
    const tpl_token_t *t = next(P);
    if (t->kind == TK_NAME) {
        tpl_value_t *v = NULL;
        if (strcmp(t->text, "true") == 0 || strcmp(t->text, "True") == 0 || strcmp(t->text, "false") == 0 ||
            strcmp(t->text, "False") == 0) {
            v = const_value(P, TV_BOOL);
            if (v != NULL) {
                v->u.b = t->text[0] == 't' || t->text[0] == 'T';
            }
            return v != NULL ? literal(P, t, v) : NULL;
        }
        if (strcmp(t->text, "none") == 0 || strcmp(t->text, "None") == 0) {
            v = const_value(P, TV_NONE);
            return v != NULL ? literal(P, t, v) : NULL;
        }
        tpl_node_t *nd = node(P, ND_NAME, t);
        if (nd != NULL) {
            nd->s = t->text;
            nd->slen = t->len;
        }
        return nd;
    }
    if (t->kind == TK_STRING) {
        /* adjacent string literals concatenate */
        size_t len = t->len;
        size_t j = P->i;
        while (j < P->n && P->tk[j].kind == TK_STRING) {
            len += P->tk[j++].len;
        }
        tpl_value_t *v = const_value(P, TV_STR);
        char *s = pd_arena_alloc(&P->t->arena, len + 1, 1);
        if (v == NULL || s == NULL) {
            return NULL;
        }
        memcpy(s, t->text, t->len);
        size_t k = t->len;
        while (peek(P)->kind == TK_STRING) {
            const tpl_token_t *u = next(P);
            memcpy(s + k, u->text, u->len);
            k += u->len;
        }
        s[k] = '\0';
        v->u.str.s = s;
        v->u.str.len = k;
        return literal(P, t, v);
    }
    if (t->kind == TK_INT || t->kind == TK_FLOAT) {
        tpl_value_t *v = const_value(P, t->kind == TK_INT ? TV_INT : TV_FLOAT);
        if (v == NULL) {
            return NULL;
        }
        if (t->kind == TK_INT) {
            v->u.i = t->ival;
        } else {
            v->u.f = t->fval;
        }
        return literal(P, t, v);
    }
    if (is_op(t, "(")) {
        if (is_op(peek(P), ")")) { /* () */
            next(P);
            tpl_node_t *nd = node(P, ND_TUPLE, t);
            nlist_t l = {0};
            return nd != NULL && nl_finish(P, &l, nd, false) ? nd : NULL;
        }
        tpl_node_t *e = parse_expr(P);
        if (e == NULL) {
            return NULL;
        }
        if (is_op(peek(P), ",")) { /* a tuple */
            nlist_t l = {0};
            nl_push(&l, e, NULL);
            while (is_op(peek(P), ",")) {
                next(P);
                if (is_op(peek(P), ")")) {
                    break;
                }
                tpl_node_t *x = parse_expr(P);
                if (x == NULL || !nl_push(&l, x, NULL)) {
                    nl_drop(&l);
                    return NULL;
                }
            }
            tpl_node_t *nd = node(P, ND_TUPLE, t);
            if (nd == NULL || !nl_finish(P, &l, nd, false)) {
                nl_drop(&l);
                return NULL;
            }
            e = nd;
        }
        return expect_op(P, ")") ? e : NULL;
    }
    if (is_op(t, "[") || is_op(t, "{")) {
        bool dict = t->text[0] == '{';
        const char *close = dict ? "}" : "]";
        nlist_t l = {0};
        while (!is_op(peek(P), close)) {
            if (l.n > 0 && !expect_op(P, ",")) {
                nl_drop(&l);
                return NULL;
            }
            if (is_op(peek(P), close)) {
                break;
            }
            tpl_node_t *x = parse_expr(P);
            if (x == NULL || !nl_push(&l, x, NULL)) {
                nl_drop(&l);
                return NULL;
            }
            if (dict) {
                if (!expect_op(P, ":")) {
                    nl_drop(&l);
                    return NULL;
                }
                x = parse_expr(P);
                if (x == NULL || !nl_push(&l, x, NULL)) {
                    nl_drop(&l);
                    return NULL;
                }
            }
        }
        next(P);
        tpl_node_t *nd = node(P, dict ? ND_DICT : ND_LIST, t);
        if (nd == NULL || !nl_finish(P, &l, nd, false)) {
            nl_drop(&l);
            return NULL;
        }
        return nd;
    }
    return fail(P, t, "unexpected %s",
                t->kind == TK_BLOCK_END ? "end of tag"
                : t->kind == TK_VAR_END ? "'}}'"
                : t->kind == TK_EOF     ? "end of template"
                : t->text != NULL       ? t->text
                                        : "token");
}

/* x.name, x[...], x(...) */
static tpl_node_t *parse_postfix(parser_t *P, tpl_node_t *e)
{
    while (e != NULL) {
        const tpl_token_t *t = peek(P);
        if (is_op(t, ".")) {
            next(P);
            const tpl_token_t *name = next(P);
            tpl_node_t *nd = node(P, ND_ATTR, t);
            if (nd == NULL) {
                return NULL;
            }
            if (name->kind == TK_NAME) {
                nd->s = name->text;
                nd->slen = name->len;
            } else if (name->kind == TK_INT) { /* x.0 is x[0] */
                tpl_value_t *v = const_value(P, TV_INT);
                if (v == NULL) {
                    return NULL;
                }
                v->u.i = name->ival;
                nd->kind = ND_ITEM;
                nd->b = literal(P, name, v);
            } else {
                return fail(P, name, "expected an attribute name after '.'");
            }
            nd->a = e;
            e = nd;
        } else if (is_op(t, "[")) {
            next(P);
            tpl_node_t *parts[3] = {NULL, NULL, NULL};
            int k = 0;
            bool slice = false;
            while (!is_op(peek(P), "]")) {
                if (is_op(peek(P), ":")) {
                    next(P);
                    slice = true;
                    if (++k > 2) {
                        return fail(P, t, "a slice has at most two ':'");
                    }
                    continue;
                }
                if (parts[k] != NULL) {
                    return fail(P, peek(P), "expected ']'");
                }
                parts[k] = parse_expr(P);
                if (parts[k] == NULL) {
                    return NULL;
                }
            }
            next(P);
            tpl_node_t *nd = node(P, slice ? ND_SLICE : ND_ITEM, t);
            if (nd == NULL) {
                return NULL;
            }
            if (!slice && parts[0] == NULL) {
                return fail(P, t, "empty subscript");
            }
            nd->a = e;
            nd->b = parts[0];
            nd->c = parts[1];
            nd->d = parts[2];
            e = nd;
        } else if (is_op(t, "(")) {
            next(P);
            tpl_node_t *nd = node(P, ND_CALL, t);
            if (nd == NULL || !parse_args(P, nd)) {
                return NULL;
            }
            nd->a = e;
            e = nd;
        } else {
            break;
        }
    }
    return e;
}

/* The filter named by the next token, with its (args) when given, applied to input. */
static tpl_node_t *parse_filter_call(parser_t *P, tpl_node_t *input)
{
    const tpl_token_t *name = next(P);
    if (name->kind != TK_NAME) {
        return fail(P, name, "expected a filter name");
    }
    tpl_node_t *nd = node(P, ND_FILTER, name);
    if (nd == NULL) {
        return NULL;
    }
    nd->s = name->text;
    nd->a = input;
    if (is_op(peek(P), "(")) {
        next(P);
        return parse_args(P, nd) ? nd : NULL;
    }
    nlist_t l = {0};
    return nl_finish(P, &l, nd, true) ? nd : NULL;
}

/* x | filter(args), x is [not] test args */
static tpl_node_t *parse_filters(parser_t *P, tpl_node_t *e)
{
    while (e != NULL) {
        const tpl_token_t *t = peek(P);
        if (is_op(t, "|")) {
            next(P);
            tpl_node_t *nd = parse_filter_call(P, e);
            if (nd == NULL) {
                return NULL;
            }
            e = parse_postfix(P, nd);
        } else if (is_name(t, "is")) {
            next(P);
            bool neg = false;
            if (is_name(peek(P), "not")) {
                next(P);
                neg = true;
            }
            const tpl_token_t *name = next(P);
            if (name->kind != TK_NAME) {
                return fail(P, name, "expected a test name after 'is'");
            }
            tpl_node_t *nd = node(P, ND_TEST, name);
            if (nd == NULL) {
                return NULL;
            }
            nd->s = name->text;
            nd->a = e;
            nd->neg = neg;
            const tpl_token_t *u = peek(P);
            if (is_op(u, "(")) {
                next(P);
                if (!parse_args(P, nd)) {
                    return NULL;
                }
            } else if (u->kind == TK_STRING || u->kind == TK_INT || u->kind == TK_FLOAT ||
                       (u->kind == TK_NAME && !is_name(u, "and") && !is_name(u, "or") &&
                        !is_name(u, "else") && !is_name(u, "if") && !is_name(u, "is") && !is_name(u, "in") &&
                        !is_name(u, "not")) ||
                       is_op(u, "[") || is_op(u, "{")) {
                /* one argument without parentheses: x is divisibleby 3, x is sameas none */
                tpl_node_t *arg = parse_primary(P);
                arg = parse_postfix(P, arg);
                if (arg == NULL) {
                    return NULL;
                }
                nd->kids = pd_arena_alloc(&P->t->arena, sizeof(tpl_node_t *), 8);
                nd->kwnames = pd_arena_calloc(&P->t->arena, 1, sizeof(char *));
                if (nd->kids == NULL || nd->kwnames == NULL) {
                    P->st = PD_ERR_NO_MEMORY;
                    return NULL;
                }
                nd->kids[0] = arg;
                nd->n_kids = 1;
            } else {
                nlist_t l = {0};
                if (!nl_finish(P, &l, nd, true)) {
                    return NULL;
                }
            }
            e = nd;
        } else {
            break;
        }
    }
    return e;
}

static tpl_node_t *parse_unary(parser_t *P, bool with_filter)
{
    if (!enter(P)) {
        return NULL;
    }
    const tpl_token_t *t = peek(P);
    tpl_node_t *e;
    if (is_op(t, "-") || is_op(t, "+")) {
        next(P);
        e = node(P, ND_UNARY, t);
        if (e != NULL) {
            e->op = t->text[0] == '-' ? OP_NEG : OP_POS;
            e->a = parse_unary(P, false);
            if (e->a == NULL) {
                e = NULL;
            }
        }
    } else {
        e = parse_postfix(P, parse_primary(P));
    }
    if (with_filter) {
        e = parse_filters(P, e);
    }
    P->depth--;
    return e;
}

static tpl_node_t *binary(parser_t *P, const tpl_token_t *at, int op, tpl_node_t *a, tpl_node_t *b)
{
    if (a == NULL || b == NULL) {
        return NULL;
    }
    tpl_node_t *nd = node(P, ND_BINARY, at);
    if (nd != NULL) {
        nd->op = op;
        nd->a = a;
        nd->b = b;
    }
    return nd;
}

static tpl_node_t *parse_pow(parser_t *P)
{
    tpl_node_t *e = parse_unary(P, true);
    while (e != NULL && is_op(peek(P), "**")) {
        const tpl_token_t *t = next(P);
        e = binary(P, t, OP_POW, e, parse_unary(P, true));
    }
    return e;
}

static tpl_node_t *parse_math2(parser_t *P)
{
    tpl_node_t *e = parse_pow(P);
    for (;;) {
        const tpl_token_t *t = peek(P);
        int op = is_op(t, "*")    ? OP_MUL
                 : is_op(t, "/")  ? OP_DIV
                 : is_op(t, "//") ? OP_FLOORDIV
                 : is_op(t, "%")  ? OP_MOD
                                  : 0;
        if (op == 0 || e == NULL) {
            return e;
        }
        next(P);
        e = binary(P, t, op, e, parse_pow(P));
    }
}

static tpl_node_t *parse_concat(parser_t *P)
{
    tpl_node_t *e = parse_math2(P);
    while (e != NULL && is_op(peek(P), "~")) {
        const tpl_token_t *t = next(P);
        e = binary(P, t, OP_CONCAT, e, parse_math2(P));
    }
    return e;
}

static tpl_node_t *parse_math1(parser_t *P)
{
    tpl_node_t *e = parse_concat(P);
    for (;;) {
        const tpl_token_t *t = peek(P);
        int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : 0;
        if (op == 0 || e == NULL) {
            return e;
        }
        next(P);
        e = binary(P, t, op, e, parse_concat(P));
    }
}

static tpl_node_t *parse_compare(parser_t *P)
{
    const tpl_token_t *start = peek(P);
    tpl_node_t *e = parse_math1(P);
    if (e == NULL) {
        return NULL;
    }
    nlist_t l = {0};
    int ops[64];
    for (;;) {
        const tpl_token_t *t = peek(P);
        int op = is_op(t, "==")     ? OP_EQ
                 : is_op(t, "!=")   ? OP_NE
                 : is_op(t, "<")    ? OP_LT
                 : is_op(t, "<=")   ? OP_LE
                 : is_op(t, ">")    ? OP_GT
                 : is_op(t, ">=")   ? OP_GE
                 : is_name(t, "in") ? OP_IN
                                    : 0;
        if (op == 0 && is_name(t, "not") && is_name(peek2(P), "in")) {
            next(P);
            op = OP_NOTIN;
        }
        if (op == 0) {
            break;
        }
        if (l.n == 64) {
            nl_drop(&l);
            return fail(P, t, "comparison chain too long");
        }
        next(P);
        tpl_node_t *x = parse_math1(P);
        if (x == NULL || !nl_push(&l, x, NULL)) {
            nl_drop(&l);
            return NULL;
        }
        ops[l.n - 1] = op;
    }
    if (l.n == 0) {
        return e;
    }
    tpl_node_t *nd = node(P, ND_COMPARE, start);
    size_t cnt = l.n;
    if (nd == NULL || !nl_finish(P, &l, nd, false)) {
        nl_drop(&l);
        return NULL;
    }
    nd->a = e;
    nd->ops = pd_arena_alloc(&P->t->arena, cnt * sizeof(int), 8);
    if (nd->ops == NULL) {
        P->st = PD_ERR_NO_MEMORY;
        return NULL;
    }
    memcpy(nd->ops, ops, cnt * sizeof(int));
    return nd;
}

static tpl_node_t *parse_not(parser_t *P)
{
    if (is_name(peek(P), "not")) {
        const tpl_token_t *t = next(P);
        if (!enter(P)) {
            return NULL;
        }
        tpl_node_t *nd = node(P, ND_NOT, t);
        if (nd != NULL) {
            nd->a = parse_not(P);
        }
        P->depth--;
        return nd != NULL && nd->a != NULL ? nd : NULL;
    }
    return parse_compare(P);
}

static tpl_node_t *parse_and(parser_t *P)
{
    tpl_node_t *e = parse_not(P);
    while (e != NULL && is_name(peek(P), "and")) {
        const tpl_token_t *t = next(P);
        tpl_node_t *nd = node(P, ND_AND, t);
        if (nd == NULL) {
            return NULL;
        }
        nd->a = e;
        nd->b = parse_not(P);
        e = nd->b != NULL ? nd : NULL;
    }
    return e;
}

static tpl_node_t *parse_or(parser_t *P)
{
    tpl_node_t *e = parse_and(P);
    while (e != NULL && is_name(peek(P), "or")) {
        const tpl_token_t *t = next(P);
        tpl_node_t *nd = node(P, ND_OR, t);
        if (nd == NULL) {
            return NULL;
        }
        nd->a = e;
        nd->b = parse_and(P);
        e = nd->b != NULL ? nd : NULL;
    }
    return e;
}

/* a if cond [else b] — the full expression */
static tpl_node_t *parse_expr(parser_t *P)
{
    if (!enter(P)) {
        return NULL;
    }
    tpl_node_t *e = parse_or(P);
    while (e != NULL && is_name(peek(P), "if")) {
        const tpl_token_t *t = next(P);
        tpl_node_t *nd = node(P, ND_COND, t);
        if (nd == NULL) {
            e = NULL;
            break;
        }
        nd->a = e;
        nd->b = parse_or(P);
        if (nd->b == NULL) {
            e = NULL;
            break;
        }
        if (is_name(peek(P), "else")) {
            next(P);
            nd->c = parse_expr(P);
            if (nd->c == NULL) {
                e = NULL;
                break;
            }
        }
        e = nd;
    }
    P->depth--;
    return e;
}

/* ------------------------------------------------------------------ statements */

static tpl_node_t *parse_body(parser_t *P, const char *const *ends, const char **ended);

static bool end_tag(parser_t *P)
{
    if (peek(P)->kind != TK_BLOCK_END) {
        fail(P, peek(P), "expected the end of the tag, got '%s'", peek(P)->text ? peek(P)->text : "?");
        return false;
    }
    next(P);
    return true;
}

/* The body of a block that ends in one tag ({% endwith %}, ...) and that end tag; NULL on an error. */
static tpl_node_t *parse_block_body(parser_t *P, const char *end)
{
    const char *const ends[] = {end, NULL};
    const char *ended = NULL;
    tpl_node_t *b = parse_body(P, ends, &ended);
    return b != NULL && end_tag(P) ? b : NULL;
}

/* Names of a for/set target: a, or a, b (optionally in parentheses). */
static bool parse_targets(parser_t *P, tpl_node_t *nd)
{
    const char *names[16];
    size_t n = 0;
    bool paren = is_op(peek(P), "(");
    if (paren) {
        next(P);
    }
    for (;;) {
        const tpl_token_t *t = next(P);
        if (t->kind != TK_NAME) {
            fail(P, t, "expected a variable name");
            return false;
        }
        if (n == 16) {
            fail(P, t, "too many names to unpack");
            return false;
        }
        names[n++] = t->text;
        if (!is_op(peek(P), ",")) {
            break;
        }
        next(P);
    }
    if (paren && !expect_op(P, ")")) {
        return false;
    }
    nd->names = pd_arena_alloc(&P->t->arena, n * sizeof(char *), 8);
    if (nd->names == NULL) {
        P->st = PD_ERR_NO_MEMORY;
        return false;
    }
    memcpy(nd->names, names, n * sizeof(char *));
    nd->n_names = n;
    return true;
}

static tpl_node_t *parse_if(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_IF, at);
    if (nd == NULL || (nd->a = parse_expr(P)) == NULL || !end_tag(P)) {
        return NULL;
    }
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    const char *ended = NULL;
    nd->b = parse_body(P, ends, &ended);
    if (nd->b == NULL) {
        return NULL;
    }
    if (strcmp(ended, "elif") == 0) {
        nd->c = parse_if(P, at);
        return nd->c != NULL ? nd : NULL;
    }
    if (strcmp(ended, "else") == 0) {
        static const char *const ends2[] = {"endif", NULL};
        if (!end_tag(P) || (nd->c = parse_body(P, ends2, &ended)) == NULL) {
            return NULL;
        }
    }
    return end_tag(P) ? nd : NULL;
}

static bool is_content_access(const tpl_node_t *e)
{
    if (e == NULL) {
        return false;
    }
    if (e->kind == ND_ATTR && e->s != NULL && strcmp(e->s, "content") == 0) {
        return true;
    }
    if (e->kind == ND_ITEM && e->b != NULL && e->b->kind == ND_LITERAL && e->b->v->kind == TV_STR &&
        strcmp(e->b->v->u.str.s, "content") == 0) {
        return true;
    }
    if (e->kind == ND_FILTER || e->kind == ND_SLICE) {
        return is_content_access(e->a);
    }
    return false;
}

static tpl_node_t *parse_for(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_FOR, at);
    if (nd == NULL || !parse_targets(P, nd)) {
        return NULL;
    }
    if (!is_name(peek(P), "in")) {
        return fail(P, peek(P), "expected 'in' in a for loop");
    }
    next(P);
    nd->a = parse_or(P); /* not a full expression: 'if' introduces the loop filter */
    if (nd->a == NULL) {
        return NULL;
    }
    if (is_content_access(nd->a)) {
        P->t->iterates_content = true;
    }
    if (is_name(peek(P), "if")) {
        next(P);
        if ((nd->d = parse_expr(P)) == NULL) {
            return NULL;
        }
    }
    if (is_name(peek(P), "recursive")) { /* loop(items) renders the body over items, one level deeper */
        next(P);
        nd->neg = true;
    }
    if (!end_tag(P)) {
        return NULL;
    }
    static const char *const ends[] = {"else", "endfor", NULL};
    const char *ended = NULL;
    if ((nd->b = parse_body(P, ends, &ended)) == NULL) {
        return NULL;
    }
    if (strcmp(ended, "else") == 0) {
        static const char *const ends2[] = {"endfor", NULL};
        if (!end_tag(P) || (nd->c = parse_body(P, ends2, &ended)) == NULL) {
            return NULL;
        }
    }
    return end_tag(P) ? nd : NULL;
}

static tpl_node_t *parse_set(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_SET, at);
    if (nd == NULL) {
        return NULL;
    }
    if (peek(P)->kind == TK_NAME && is_op(peek2(P), ".")) { /* ns.attr = value */
        const tpl_token_t *obj = next(P);
        next(P);
        const tpl_token_t *attr = next(P);
        if (attr->kind != TK_NAME) {
            return fail(P, attr, "expected an attribute name");
        }
        nd->names = pd_arena_alloc(&P->t->arena, sizeof(char *), 8);
        if (nd->names == NULL) {
            P->st = PD_ERR_NO_MEMORY;
            return NULL;
        }
        nd->names[0] = obj->text;
        nd->n_names = 1;
        nd->s = attr->text;
    } else if (!parse_targets(P, nd)) {
        return NULL;
    }
    if (peek(P)->kind == TK_BLOCK_END && nd->s == NULL && nd->n_names == 1) { /* {% set x %}...{% endset %} */
        next(P);
        nd->kind = ND_SET_BLOCK;
        return (nd->b = parse_block_body(P, "endset")) != NULL ? nd : NULL;
    }
    if (!expect_op(P, "=")) {
        return NULL;
    }
    const tpl_token_t *vt = peek(P);
    nd->a = parse_expr(P);
    if (nd->a != NULL && is_op(peek(P), ",")) { /* set a, b = 1, 2 */
        nlist_t l = {0};
        nl_push(&l, nd->a, NULL);
        while (is_op(peek(P), ",")) {
            next(P);
            tpl_node_t *x = parse_expr(P);
            if (x == NULL || !nl_push(&l, x, NULL)) {
                nl_drop(&l);
                return NULL;
            }
        }
        tpl_node_t *tup = node(P, ND_TUPLE, vt);
        if (tup == NULL || !nl_finish(P, &l, tup, false)) {
            nl_drop(&l);
            return NULL;
        }
        nd->a = tup;
    }
    return nd->a != NULL && end_tag(P) ? nd : NULL;
}

/* A macro's parameter list after its '(' (names, defaults in kids) into nd, through the ')'. */
static bool parse_params(parser_t *P, tpl_node_t *nd);

static tpl_node_t *parse_macro(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_MACRO, at);
    const tpl_token_t *name = next(P);
    if (nd == NULL || name->kind != TK_NAME) {
        return nd != NULL ? fail(P, name, "expected a macro name") : NULL;
    }
    nd->s = name->text;
    if (!expect_op(P, "(") || !parse_params(P, nd) || !end_tag(P)) {
        return NULL;
    }
    return (nd->b = parse_block_body(P, "endmacro")) != NULL ? nd : NULL;
}

/* {% call(params) macro(args) %} body {% endcall %}: the macro's caller() renders body. */
static tpl_node_t *parse_call_block(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_CALL_BLOCK, at);
    tpl_node_t *caller = node(P, ND_MACRO, at);
    if (nd == NULL || caller == NULL) {
        return NULL;
    }
    caller->s = "caller";
    if (is_op(peek(P), "(")) {
        next(P);
        if (!parse_params(P, caller)) {
            return NULL;
        }
    } else {
        nlist_t l = {0};
        if (!nl_finish(P, &l, caller, true)) {
            return NULL;
        }
        caller->names = caller->kwnames;
        caller->n_names = 0;
    }
    const tpl_token_t *ct = peek(P);
    if ((nd->a = parse_expr(P)) == NULL) {
        return NULL;
    }
    if (nd->a->kind != ND_CALL) {
        return fail(P, ct, "a call block needs a macro call");
    }
    if (!end_tag(P)) {
        return NULL;
    }
    nd->c = caller;
    return (caller->b = parse_block_body(P, "endcall")) != NULL ? nd : NULL;
}

static bool parse_params(parser_t *P, tpl_node_t *nd)
{
    nlist_t l = {0};
    bool default_seen = false;
    while (!is_op(peek(P), ")")) {
        if (l.n > 0 && !expect_op(P, ",")) {
            nl_drop(&l);
            return false;
        }
        const tpl_token_t *p = next(P);
        if (p->kind != TK_NAME) {
            nl_drop(&l);
            fail(P, p, "expected a parameter name");
            return false;
        }
        tpl_node_t *def = NULL;
        if (is_op(peek(P), "=")) {
            next(P);
            if ((def = parse_expr(P)) == NULL) {
                nl_drop(&l);
                return false;
            }
            default_seen = true;
        } else if (default_seen) {
            nl_drop(&l);
            fail(P, p, "parameter without a default after one with a default");
            return false;
        }
        if (!nl_push(&l, def, p->text)) {
            nl_drop(&l);
            P->st = PD_ERR_NO_MEMORY;
            return false;
        }
    }
    next(P);
    size_t n = l.n;
    if (!nl_finish(P, &l, nd, true)) {
        return false;
    }
    nd->names = nd->kwnames;
    nd->n_names = n;
    return true;
}

/* {% with a = x, b = y %} ... {% endwith %} */
static tpl_node_t *parse_with(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_WITH, at);
    if (nd == NULL) {
        return NULL;
    }
    nlist_t l = {0};
    while (peek(P)->kind != TK_BLOCK_END) {
        if (l.n > 0 && !expect_op(P, ",")) {
            nl_drop(&l);
            return NULL;
        }
        const tpl_token_t *t = next(P);
        if (t->kind != TK_NAME) {
            nl_drop(&l);
            return fail(P, t, "expected a variable name");
        }
        if (!expect_op(P, "=")) {
            nl_drop(&l);
            return NULL;
        }
        tpl_node_t *v = parse_expr(P);
        if (v == NULL || !nl_push(&l, v, t->text)) {
            nl_drop(&l);
            if (v != NULL) {
                P->st = PD_ERR_NO_MEMORY;
            }
            return NULL;
        }
    }
    size_t n = l.n;
    if (!nl_finish(P, &l, nd, true) || !end_tag(P)) {
        return NULL;
    }
    nd->names = nd->kwnames;
    nd->n_names = n;
    return (nd->b = parse_block_body(P, "endwith")) != NULL ? nd : NULL;
}

/* {% filter name(args) | more %} ... {% endfilter %}: the chain applied to the rendered body. */
static tpl_node_t *parse_filter_block(parser_t *P, const tpl_token_t *at)
{
    tpl_node_t *nd = node(P, ND_FILTER_BLOCK, at);
    tpl_node_t *body = node(P, ND_NAME, at);
    if (nd == NULL || body == NULL) {
        return NULL;
    }
    body->s = TPL_FILTER_BODY;
    tpl_node_t *f = parse_filter_call(P, body);
    if (f == NULL || (nd->a = parse_filters(P, f)) == NULL || !end_tag(P)) {
        return NULL;
    }
    return (nd->b = parse_block_body(P, "endfilter")) != NULL ? nd : NULL;
}

/* One {% ... %} statement after its keyword was read. */
static tpl_node_t *parse_statement(parser_t *P, const tpl_token_t *kw)
{
    const char *k = kw->text;
    if (strcmp(k, "if") == 0) {
        return parse_if(P, kw);
    }
    if (strcmp(k, "for") == 0) {
        return parse_for(P, kw);
    }
    if (strcmp(k, "set") == 0) {
        return parse_set(P, kw);
    }
    if (strcmp(k, "macro") == 0) {
        return parse_macro(P, kw);
    }
    if (strcmp(k, "with") == 0) {
        return parse_with(P, kw);
    }
    if (strcmp(k, "call") == 0) {
        return parse_call_block(P, kw);
    }
    if (strcmp(k, "filter") == 0) {
        return parse_filter_block(P, kw);
    }
    if (strcmp(k, "break") == 0 || strcmp(k, "continue") == 0) {
        tpl_node_t *nd = node(P, k[0] == 'b' ? ND_BREAK : ND_CONTINUE, kw);
        return nd != NULL && end_tag(P) ? nd : NULL;
    }
    if (strcmp(k, "generation") == 0) { /* transformers' assistant-mask tag: renders its body */
        return end_tag(P) ? parse_block_body(P, "endgeneration") : NULL;
    }
    return fail(P, kw, "unknown or unsupported tag '%s'", k);
}

/* Statements until one of ends (NULL-terminated; NULL = until EOF). *ended names the end keyword
 * found; its tag's remaining tokens are left for the caller. */
static tpl_node_t *parse_body(parser_t *P, const char *const *ends, const char **ended)
{
    if (!enter(P)) {
        return NULL;
    }
    const tpl_token_t *start = peek(P);
    nlist_t l = {0};
    tpl_node_t *result = NULL;
    for (;;) {
        const tpl_token_t *t = peek(P);
        tpl_node_t *s = NULL;
        if (t->kind == TK_EOF) {
            if (ends != NULL) {
                size_t last = 0;
                while (ends[last + 1] != NULL) {
                    last++;
                }
                fail(P, t, "unexpected end of template: expected '%s'", ends[last]);
                goto out;
            }
            break;
        }
        if (t->kind == TK_TEXT) {
            next(P);
            s = node(P, ND_TEXT, t);
            if (s != NULL) {
                s->s = t->text;
                s->slen = t->len;
            }
        } else if (t->kind == TK_VAR_BEGIN) {
            next(P);
            s = node(P, ND_OUTPUT, t);
            if (s != NULL) {
                s->a = parse_expr(P);
                if (s->a == NULL) {
                    goto out;
                }
                if (peek(P)->kind != TK_VAR_END) {
                    fail(P, peek(P), "expected '}}', got '%s'", peek(P)->text ? peek(P)->text : "?");
                    goto out;
                }
                next(P);
            }
        } else if (t->kind == TK_BLOCK_BEGIN) {
            const tpl_token_t *kw = peek2(P);
            if (kw->kind != TK_NAME) {
                fail(P, kw, "expected a statement name after '{%%'");
                goto out;
            }
            for (int e = 0; ends != NULL && ends[e] != NULL; e++) {
                if (strcmp(kw->text, ends[e]) == 0) {
                    next(P);
                    next(P);
                    *ended = ends[e];
                    goto done;
                }
            }
            if (strncmp(kw->text, "end", 3) == 0 || strcmp(kw->text, "elif") == 0 ||
                strcmp(kw->text, "else") == 0) {
                fail(P, kw, "unexpected '%s'%s%s", kw->text, ends != NULL ? ": expected '" : "",
                     ends != NULL ? ends[0] : "");
                if (ends != NULL) {
                    size_t l0 = strlen(P->err->message);
                    snprintf(P->err->message + l0, sizeof(P->err->message) - l0, "'");
                }
                goto out;
            }
            next(P);
            next(P);
            s = parse_statement(P, kw);
        } else {
            fail(P, t, "unexpected token");
            goto out;
        }
        if (s == NULL) {
            goto out;
        }
        if (!nl_push(&l, s, NULL)) {
            P->st = PD_ERR_NO_MEMORY;
            goto out;
        }
    }
done:
    result = node(P, ND_BODY, start);
    if (result != NULL && !nl_finish(P, &l, result, false)) {
        result = NULL;
    }
out:
    nl_drop(&l);
    P->depth--;
    return P->st == PD_OK ? result : NULL;
}

pd_status_t tpl_parse(pd_template_t *t, const tpl_token_t *toks, size_t n, pd_template_error_t *err)
{
    parser_t P = {t, toks, n, 0, 0, err, PD_OK};
    t->root = parse_body(&P, NULL, NULL);
    if (t->root == NULL && P.st == PD_OK) {
        P.st = PD_ERR_NO_MEMORY;
    }
    return P.st;
}
