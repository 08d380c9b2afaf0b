/* template/tpl_internal.h — the template module's shared types: tokens (lexer.c), the syntax tree
 * (parser.c), values (value.c), the render state (eval.c) and the builtins table (builtins.c). */
#ifndef PD_TEMPLATE_INTERNAL_H
#define PD_TEMPLATE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/arena.h"
#include "template/template.h"

/* ------------------------------------------------------------------ tokens (lexer.c) */

typedef enum tk_kind {
    TK_EOF = 0,
    TK_TEXT,        /* literal template text (already whitespace-controlled) */
    TK_VAR_BEGIN,   /* {{ */
    TK_VAR_END,     /* }} */
    TK_BLOCK_BEGIN, /* {% */
    TK_BLOCK_END,   /* %} */
    TK_NAME,
    TK_STRING, /* text holds the decoded value */
    TK_INT,
    TK_FLOAT,
    TK_OP, /* text holds the operator: + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : | */
} tk_kind_t;

typedef struct tpl_token {
    tk_kind_t kind;
    const char *text; /* arena copy (TEXT, NAME, STRING, OP) */
    size_t len;
    int64_t ival;
    double fval;
    int line, col;
} tpl_token_t;

/* Splits src into tokens (arena-allocated array ending with TK_EOF) with Jinja2's whitespace control
 * under trim_blocks + lstrip_blocks. PD_ERR_PARSE with err on an unterminated tag, string or
 * comment, or a character that starts no token. */
pd_status_t tpl_lex(pd_arena_t *a, const char *src, size_t len, tpl_token_t **toks_out, size_t *n_out,
                    pd_template_error_t *err);

/* ------------------------------------------------------------------ syntax tree (parser.c) */

typedef enum nd_kind {
    /* statements */
    ND_BODY, /* kids[n] */
    ND_TEXT, /* s */
    ND_OUTPUT,
    ND_IF,        /* a = cond, b = then body, c = else (body or another IF) */
    ND_FOR,       /* names[n_names], a = iter, b = body, c = else body, d = filter cond */
    ND_SET,       /* names[n_names] or attr target (s = attr of names[0]), a = value */
    ND_SET_BLOCK, /* names[0], b = body */
    ND_MACRO,     /* s = name, names[] params, kids[] defaults (NULL = none), b = body */
    ND_BREAK,
    ND_CONTINUE,
    ND_WITH,         /* names[n_names] = kids[i] (evaluated outside), b = body in a scope of its own */
    ND_CALL_BLOCK,   /* a = the macro call, c = the caller (an ND_MACRO named "caller": params, body) */
    ND_FILTER_BLOCK, /* b = body; a = the filter chain, whose innermost input is TPL_FILTER_BODY */
    /* expressions */
    ND_LITERAL, /* v */
    ND_NAME,    /* s */
    ND_LIST,    /* kids */
    ND_TUPLE,   /* kids */
    ND_DICT,    /* kids: key, value, key, value... */
    ND_ATTR,    /* a.s */
    ND_ITEM,    /* a[b] */
    ND_SLICE,   /* a[b:c:d] (each may be NULL) */
    ND_CALL,    /* a(kids...; kwnames) */
    ND_FILTER,  /* s = name, a = input, kids = args, kwnames */
    ND_TEST,    /* s = name, a = input, kids = args; neg */
    ND_UNARY,   /* op, a */
    ND_BINARY,  /* op, a, b */
    ND_AND,
    ND_OR,
    ND_NOT,
    ND_COND,    /* a if b else c */
    ND_COMPARE, /* a then (ops[i], kids[i]) chain */
} nd_kind_t;

typedef struct tpl_value tpl_value_t;

typedef struct tpl_node tpl_node_t;
struct tpl_node {
    nd_kind_t kind;
    int line, col;
    int op; /* operator code (see OP_* in parser.c) */
    bool neg;
    const char *s;
    size_t slen;
    tpl_node_t *a, *b, *c, *d;
    tpl_node_t **kids;
    size_t n_kids;
    const char **names; /* FOR/SET targets, MACRO params */
    size_t n_names;
    const char **kwnames; /* CALL/FILTER: name of kids[i] or NULL (positional) */
    int *ops;             /* COMPARE */
    tpl_value_t *v;       /* LITERAL */
};

/* The name under which a {% filter %} block's rendered body reaches its filter chain (no template
 * can name it: it is not an identifier). */
#define TPL_FILTER_BODY "\x01filter-body"

/* Operator codes of ND_UNARY / ND_BINARY / ND_COMPARE. */
enum {
    OP_ADD = 1,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_CONCAT,
    OP_NEG,
    OP_POS,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN,
};

struct pd_template {
    pd_arena_t arena;
    tpl_node_t *root;
    bool iterates_content;
};

pd_status_t tpl_parse(pd_template_t *t, const tpl_token_t *toks, size_t n, pd_template_error_t *err);

/* ------------------------------------------------------------------ values (value.c) */

typedef enum tv_kind {
    TV_UNDEF = 0,
    TV_NONE,
    TV_BOOL,
    TV_INT,
    TV_FLOAT,
    TV_STR,
    TV_LIST, /* also tuples (is_tuple) */
    TV_DICT,
    TV_NS,     /* namespace(): a mutable dict */
    TV_MACRO,  /* node */
    TV_FUNC,   /* builtin global function: name */
    TV_METHOD, /* bound method: self + name */
    TV_LOOP,   /* the loop variable */
} tv_kind_t;

typedef struct tpl_dict {
    tpl_value_t **keys, **vals;
    size_t n, cap;
} tpl_dict_t;

typedef struct tpl_loop {
    int64_t index0, length;
    tpl_value_t *prev, *next;
    int64_t depth0;              /* recursive loops: 0 at the top, +1 per loop(...) call */
    const tpl_node_t *recursive; /* the {% for ... recursive %} node (callable: loop(items)), or NULL */
    struct scope *outer;         /* the scope the loop runs in */
} tpl_loop_t;

struct tpl_value {
    tv_kind_t kind;
    bool is_tuple;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *s;
            size_t len;
        } str;
        struct {
            tpl_value_t **items;
            size_t n;
        } list;
        tpl_dict_t *dict; /* DICT, NS */
        struct {
            const tpl_node_t *node;
            struct scope *closure; /* the scope a call block's caller renders in (NULL: globals) */
        } macro;
        struct {
            const char *name;
            tpl_value_t *self;
        } fn;
        tpl_loop_t *loop;
    } u;
    const char *undef_name; /* UNDEF: what was looked up, for the error message */
};

/* The render state every evaluation function takes. */
typedef struct tpl_render tpl_render_t;

extern tpl_value_t TPL_UNDEF, TPL_NONE, TPL_TRUE, TPL_FALSE;

/* Constructors (arena of the render; NULL only when the memory limit is hit, which also sets the
 * render's error). */
tpl_value_t *tv_int(tpl_render_t *r, int64_t i);
tpl_value_t *tv_float(tpl_render_t *r, double f);
tpl_value_t *tv_bool(bool b);
tpl_value_t *tv_str(tpl_render_t *r, const char *s, size_t len); /* copies */
tpl_value_t *tv_str_nocopy(tpl_render_t *r, const char *s, size_t len);
tpl_value_t *tv_list(tpl_render_t *r, size_t n); /* items zeroed */
tpl_value_t *tv_dict(tpl_render_t *r);
tpl_value_t *tv_undef(tpl_render_t *r, const char *name);
bool tv_dict_set(tpl_render_t *r, tpl_dict_t *d, tpl_value_t *k, tpl_value_t *v);
tpl_value_t *tv_dict_get(const tpl_dict_t *d, const tpl_value_t *k);
tpl_value_t *tv_dict_get_str(const tpl_dict_t *d, const char *k, size_t len);
tpl_value_t *tv_from_json(tpl_render_t *r, const json_t *j);

bool tv_truthy(const tpl_value_t *v);
bool tv_equal(const tpl_value_t *a, const tpl_value_t *b);
bool tv_is_number(const tpl_value_t *v); /* int, float, bool */
double tv_as_double(const tpl_value_t *v);
const char *tv_type_name(const tpl_value_t *v);

/* String forms: str() and repr() as Python prints them; tojson as transformers' filter. */
typedef struct tpl_buf {
    char *p;
    size_t n, cap;
    bool failed;
} tpl_buf_t;
void tb_put(tpl_buf_t *b, const char *s, size_t n);
void tb_puts(tpl_buf_t *b, const char *s);
void tb_free(tpl_buf_t *b);
void tv_str_into(tpl_buf_t *b, const tpl_value_t *v);
void tv_repr_into(tpl_buf_t *b, const tpl_value_t *v);
void tv_float_repr(char *out, size_t cap, double f);
bool tv_tojson_into(tpl_render_t *r, tpl_buf_t *b, const tpl_value_t *v, int indent, int depth,
                    const char *item_sep, const char *key_sep, bool sort_keys, bool ensure_ascii);
tpl_value_t *tv_to_str(tpl_render_t *r, const tpl_value_t *v); /* a TV_STR of str(v) */

/* UTF-8 helpers: code points of s, byte offset of code point i, the code point at byte i (*cp; an
 * invalid byte is read as itself) and its length. */
size_t tv_utf8_next(const char *s, size_t len, size_t i, int32_t *cp);
size_t tv_utf8_count(const char *s, size_t len);
size_t tv_utf8_offset(const char *s, size_t len, size_t cp_index);

/* ------------------------------------------------------------------ render (eval.c) */

/* Fails the render with a message (the first failure wins); returns NULL for use in returns. */
tpl_value_t *tpl_fail(tpl_render_t *r, const tpl_node_t *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
bool tpl_failed(const tpl_render_t *r);
void *tpl_alloc(tpl_render_t *r, size_t bytes);
time_t tpl_now(const tpl_render_t *r);
/* Calls a callable value (macro, builtin function or bound method) with evaluated arguments. */
tpl_value_t *tpl_call_value(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fn, tpl_value_t **args,
                            size_t n_args, const char **kwnames);
/* Python's ordering of two values: -1, 0, 1, or 2 when they cannot be ordered. */
int tpl_order(const tpl_value_t *a, const tpl_value_t *b);
/* The items a for loop walks (list items, dict keys, string characters; undefined: none). */
tpl_value_t *tpl_iterable(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *v);
/* Python's fmt % arg: printf-style with a tuple's items, or arg alone (the format filter's rules). */
tpl_value_t *tpl_percent(tpl_render_t *r, const tpl_node_t *at, tpl_value_t *fmt, tpl_value_t *arg);
/* Counts one unit of work; false (and the render failed) past max_steps. */
bool tpl_step(tpl_render_t *r, const tpl_node_t *at);

/* ------------------------------------------------------------------ builtins (builtins.c) */

/* Arguments: args[n] with kwnames[i] naming keyword arguments (NULL for positional ones). */
tpl_value_t *tpl_filter(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *in,
                        tpl_value_t **args, size_t n, const char **kwnames);
/* Returns 1 / 0, or -1 when the render failed (unknown test, bad argument). */
int tpl_test(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *in, tpl_value_t **args,
             size_t n);
bool tpl_test_exists(const char *name);
tpl_value_t *tpl_global(tpl_render_t *r, const char *name); /* builtin global or NULL */
tpl_value_t *tpl_call_builtin(tpl_render_t *r, const tpl_node_t *at, const char *name, tpl_value_t *self,
                              tpl_value_t **args, size_t n, const char **kwnames);
/* The bound method self.name, or NULL when the type has no such method. */
tpl_value_t *tpl_method(tpl_render_t *r, tpl_value_t *self, const char *name, size_t len);

#endif
