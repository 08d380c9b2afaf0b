/* template/lexer.c — Jinja2's lexer under trim_blocks + lstrip_blocks: text, tags, whitespace
 * control ({%- -%} {%+ +%}), comments, raw blocks, and the tokens inside tags. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/tpl_internal.h"

typedef struct lexer {
    pd_arena_t *a;
    const char *s; /* normalised source (\r\n and \r → \n, one trailing \n dropped) */
    size_t n, pos;
    int line;
    size_t line_start;
    tpl_token_t *toks;
    size_t ntok, cap;
    pd_template_error_t *err;
} lexer_t;

static pd_status_t lex_fail(lexer_t *L, size_t at, const char *msg)
{
    int line = 1;
    size_t ls = 0;
    for (size_t i = 0; i < at && i < L->n; i++) {
        if (L->s[i] == '\n') {
            line++;
            ls = i + 1;
        }
    }
    L->err->line = line;
    L->err->column = (int)(at - ls) + 1;
    snprintf(L->err->message, sizeof(L->err->message), "%s", msg);
    return PD_ERR_PARSE;
}

static tpl_token_t *push(lexer_t *L, tk_kind_t kind, size_t at)
{
    if (L->ntok == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        tpl_token_t *t = pd_arena_alloc(L->a, cap * sizeof(*t), 8);
        if (t == NULL) {
            return NULL;
        }
        if (L->ntok > 0) {
            memcpy(t, L->toks, L->ntok * sizeof(*t));
        }
        L->toks = t;
        L->cap = cap;
    }
    tpl_token_t *t = &L->toks[L->ntok++];
    memset(t, 0, sizeof(*t));
    t->kind = kind;
    int line = 1;
    size_t ls = 0;
    /* positions are computed lazily from the start: tokens are few compared to the text */
    for (size_t i = L->line_start; i < at && i < L->n; i++) {
        if (L->s[i] == '\n') {
            L->line++;
            L->line_start = i + 1;
        }
    }
    line = L->line;
    ls = L->line_start;
    t->line = line;
    t->col = (int)(at - ls) + 1;
    return t;
}

/* Python's str.isspace for the code point starting at s (len bytes available); *w = its length. */
static bool py_space(const unsigned char *s, size_t len, size_t *w)
{
    *w = 1;
    unsigned char c = s[0];
    if (c < 0x80) {
        return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20);
    }
    uint32_t cp = 0;
    if ((c & 0xe0) == 0xc0 && len >= 2) {
        cp = ((uint32_t)(c & 0x1f) << 6) | (s[1] & 0x3f);
        *w = 2;
    } else if ((c & 0xf0) == 0xe0 && len >= 3) {
        cp = ((uint32_t)(c & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f);
        *w = 3;
    } else {
        return false;
    }
    return cp == 0x85 || cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* Bytes of whitespace (Python's sense) that end s[0..n). */
static size_t trailing_space(const char *s, size_t n)
{
    size_t end = n;
    while (end > 0) {
        /* step back one code point */
        size_t b = end - 1;
        while (b > 0 && ((unsigned char)s[b] & 0xc0) == 0x80 && end - b < 4) {
            b--;
        }
        size_t w;
        if (!py_space((const unsigned char *)s + b, end - b, &w) || b + w != end) {
            break;
        }
        end = b;
    }
    return n - end;
}

static size_t leading_space(const char *s, size_t n)
{
    size_t i = 0, w;
    while (i < n && py_space((const unsigned char *)s + i, n - i, &w)) {
        i += w;
    }
    return i;
}

static pd_status_t emit_text(lexer_t *L, const char *text, size_t len, size_t at)
{
    if (len == 0) {
        return PD_OK;
    }
    tpl_token_t *t = push(L, TK_TEXT, at);
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    t->text = pd_arena_strndup(L->a, text, len);
    t->len = len;
    return t->text != NULL ? PD_OK : PD_ERR_NO_MEMORY;
}

/* Decodes a quoted string at s[pos] (Python escapes). Sets *end past the closing quote. */
static pd_status_t lex_string(lexer_t *L, size_t pos, size_t *end)
{
    char q = L->s[pos];
    size_t i = pos + 1;
    char *out = pd_arena_alloc(L->a, L->n - pos + 1, 1);
    if (out == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0;
    while (i < L->n && L->s[i] != q) {
        char c = L->s[i];
        if (c != '\\' || i + 1 >= L->n) {
            out[k++] = c;
            i++;
            continue;
        }
        char e = L->s[i + 1];
        i += 2;
        switch (e) {
        case 'n': out[k++] = '\n'; break;
        case 't': out[k++] = '\t'; break;
        case 'r': out[k++] = '\r'; break;
        case 'a': out[k++] = '\a'; break;
        case 'b': out[k++] = '\b'; break;
        case 'f': out[k++] = '\f'; break;
        case 'v': out[k++] = '\v'; break;
        case '\\': out[k++] = '\\'; break;
        case '\'': out[k++] = '\''; break;
        case '"': out[k++] = '"'; break;
        case '\n': break; /* line continuation */
        case 'x':
        case 'u':
        case 'U': {
            int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int d = 0; d < digits; d++) {
                char h = i < L->n ? L->s[i] : 0;
                int v = h >= '0' && h <= '9'   ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
                if (v < 0) {
                    return lex_fail(L, i, "truncated \\x, \\u or \\U escape in a string");
                }
                cp = cp * 16 + (uint32_t)v;
                i++;
            }
            if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
                return lex_fail(L, i, "escape is not a valid code point");
            }
            if (cp < 0x80) {
                out[k++] = (char)cp;
            } else if (cp < 0x800) {
                out[k++] = (char)(0xc0 | (cp >> 6));
                out[k++] = (char)(0x80 | (cp & 0x3f));
            } else if (cp < 0x10000) {
                out[k++] = (char)(0xe0 | (cp >> 12));
                out[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                out[k++] = (char)(0x80 | (cp & 0x3f));
            } else {
                out[k++] = (char)(0xf0 | (cp >> 18));
                out[k++] = (char)(0x80 | ((cp >> 12) & 0x3f));
                out[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                out[k++] = (char)(0x80 | (cp & 0x3f));
            }
            break;
        }
        default:
            if (e >= '0' && e <= '7') { /* octal, up to 3 digits */
                uint32_t v = (uint32_t)(e - '0');
                for (int d = 0; d < 2 && i < L->n && L->s[i] >= '0' && L->s[i] <= '7'; d++) {
                    v = v * 8 + (uint32_t)(L->s[i++] - '0');
                }
                if (v < 0x80) {
                    out[k++] = (char)v;
                } else {
                    out[k++] = (char)(0xc0 | (v >> 6));
                    out[k++] = (char)(0x80 | (v & 0x3f));
                }
            } else { /* unknown escapes keep their backslash */
                out[k++] = '\\';
                out[k++] = e;
            }
        }
    }
    if (i >= L->n) {
        return lex_fail(L, pos, "unterminated string");
    }
    tpl_token_t *t = push(L, TK_STRING, pos);
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    out[k] = '\0';
    t->text = out;
    t->len = k;
    *end = i + 1;
    return PD_OK;
}

static bool is_name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

/* Tokens inside a tag, up to its end delimiter (recognised only outside brackets). Sets *end past
 * the delimiter and *strip_after / *keep_after from its '-' / '+' modifier. */
static pd_status_t lex_tag(lexer_t *L, size_t pos, bool block, size_t *end, bool *strip_after,
                           bool *plus_after)
{
    const char close = block ? '%' : '}';
    int depth = 0;
    size_t i = pos;
    while (i < L->n) {
        char c = L->s[i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            i++;
            continue;
        }
        if (depth == 0) {
            if ((c == '-' || c == '+') && i + 2 < L->n && L->s[i + 1] == close && L->s[i + 2] == '}') {
                *strip_after = c == '-';
                *plus_after = c == '+';
                *end = i + 3;
                goto done;
            }
            if (c == close && i + 1 < L->n && L->s[i + 1] == '}') {
                *end = i + 2;
                goto done;
            }
        }
        if (c == '\'' || c == '"') {
            pd_status_t st = lex_string(L, i, &i);
            if (st != PD_OK) {
                return st;
            }
            continue;
        }
        if (is_name_start(c)) {
            size_t j = i + 1;
            while (j < L->n && (is_name_start(L->s[j]) || is_digit(L->s[j]))) {
                j++;
            }
            tpl_token_t *t = push(L, TK_NAME, i);
            if (t == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            t->text = pd_arena_strndup(L->a, L->s + i, j - i);
            t->len = j - i;
            i = j;
            continue;
        }
        if (is_digit(c)) {
            size_t j = i;
            while (j < L->n && (is_digit(L->s[j]) || L->s[j] == '_')) {
                j++;
            }
            bool is_float = false;
            if (j + 1 < L->n && L->s[j] == '.' && is_digit(L->s[j + 1]) &&
                !(L->ntok > 0 && L->toks[L->ntok - 1].kind == TK_OP && L->toks[L->ntok - 1].text[0] == '.')) {
                is_float = true;
                j++;
                while (j < L->n && (is_digit(L->s[j]) || L->s[j] == '_')) {
                    j++;
                }
            }
            if (j < L->n && (L->s[j] == 'e' || L->s[j] == 'E')) {
                size_t k = j + 1;
                if (k < L->n && (L->s[k] == '+' || L->s[k] == '-')) {
                    k++;
                }
                if (k < L->n && is_digit(L->s[k])) {
                    is_float = true;
                    j = k;
                    while (j < L->n && is_digit(L->s[j])) {
                        j++;
                    }
                }
            }
            char buf[64];
            size_t k = 0;
            for (size_t p = i; p < j && k < sizeof(buf) - 1; p++) {
                if (L->s[p] != '_') {
                    buf[k++] = L->s[p];
                }
            }
            buf[k] = '\0';
            tpl_token_t *t = push(L, is_float ? TK_FLOAT : TK_INT, i);
            if (t == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            if (is_float) {
                t->fval = strtod(buf, NULL);
            } else {
                char *e = NULL;
                unsigned long long v = strtoull(buf, &e, 10);
                if (k > 18 || v > (unsigned long long)INT64_MAX) {
                    return lex_fail(L, i, "integer literal too large");
                }
                t->ival = (int64_t)v;
            }
            i = j;
            continue;
        }
        static const char *const ops2[] = {"//", "**", "==", "!=", "<=", ">="};
        size_t oplen = 0;
        for (size_t k = 0; k < sizeof(ops2) / sizeof(ops2[0]); k++) {
            if (i + 1 < L->n && L->s[i] == ops2[k][0] && L->s[i + 1] == ops2[k][1]) {
                oplen = 2;
                break;
            }
        }
        if (oplen == 0 && strchr("+-*/%~<>=()[]{},.:|;", c) != NULL) {
            oplen = 1;
        }
        if (oplen == 0) {
            char msg[64];
            snprintf(msg, sizeof(msg), "unexpected character '%c' in a tag", c);
            return lex_fail(L, i, msg);
        }
        if (c == '(' || c == '[' || c == '{') {
            depth++;
        } else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
            depth--;
        }
        tpl_token_t *t = push(L, TK_OP, i);
        if (t == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        t->text = pd_arena_strndup(L->a, L->s + i, oplen);
        t->len = oplen;
        i += oplen;
    }
    return lex_fail(L, pos,
                    block ? "unterminated block tag (missing '%}')" : "unterminated '{{' (missing '}}')");
done:
    return PD_OK;
}

/* {% raw %}: if the block tag at pos (just after "{%" and its modifier) is "raw", emits the raw
 * text up to {% endraw %} and sets *end; returns false when it is not a raw tag. */
static bool try_raw(lexer_t *L, size_t pos, size_t *end, pd_status_t *st, bool *strip_after)
{
    size_t i = pos;
    while (i < L->n && (L->s[i] == ' ' || L->s[i] == '\t' || L->s[i] == '\n')) {
        i++;
    }
    if (L->n - i < 3 || memcmp(L->s + i, "raw", 3) != 0) {
        return false;
    }
    i += 3;
    while (i < L->n && (L->s[i] == ' ' || L->s[i] == '\t' || L->s[i] == '\n')) {
        i++;
    }
    bool strip_in = false;
    if (i < L->n && (L->s[i] == '-' || L->s[i] == '+')) {
        strip_in = L->s[i] == '-';
        i++;
    }
    if (L->n - i < 2 || L->s[i] != '%' || L->s[i + 1] != '}') {
        return false;
    }
    i += 2;
    size_t body = i;
    for (size_t j = i; j + 1 < L->n; j++) {
        if (L->s[j] != '{' || L->s[j + 1] != '%') {
            continue;
        }
        size_t k = j + 2;
        bool strip_before = false;
        if (k < L->n && (L->s[k] == '-' || L->s[k] == '+')) {
            strip_before = L->s[k] == '-';
            k++;
        }
        while (k < L->n && (L->s[k] == ' ' || L->s[k] == '\t' || L->s[k] == '\n')) {
            k++;
        }
        if (L->n - k < 6 || memcmp(L->s + k, "endraw", 6) != 0) {
            continue;
        }
        k += 6;
        while (k < L->n && (L->s[k] == ' ' || L->s[k] == '\t' || L->s[k] == '\n')) {
            k++;
        }
        bool strip_end = false;
        if (k < L->n && (L->s[k] == '-' || L->s[k] == '+')) {
            strip_end = L->s[k] == '-';
            k++;
        }
        if (L->n - k < 2 || L->s[k] != '%' || L->s[k + 1] != '}') {
            continue;
        }
        size_t b0 = body, b1 = j;
        if (strip_in) {
            b0 += leading_space(L->s + b0, b1 - b0);
        }
        if (strip_before) {
            b1 -= trailing_space(L->s + b0, b1 - b0);
        }
        *st = emit_text(L, L->s + b0, b1 - b0, b0);
        *end = k + 2;
        *strip_after = strip_end;
        return true;
    }
    *st = lex_fail(L, pos, "unterminated {% raw %} block");
    return true;
}

pd_status_t tpl_lex(pd_arena_t *a, const char *src, size_t len, tpl_token_t **toks_out, size_t *n_out,
                    pd_template_error_t *err)
{
    lexer_t L;
    memset(&L, 0, sizeof(L));
    L.a = a;
    L.err = err;
    L.line = 1;
    char *s = pd_arena_alloc(a, len + 1, 1);
    if (s == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t n = 0;
    for (size_t i = 0; i < len; i++) { /* Jinja2 normalises newlines before lexing */
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') {
                i++;
            }
        } else {
            s[n++] = src[i];
        }
    }
    if (n > 0 && s[n - 1] == '\n') {
        n--; /* keep_trailing_newline = False */
    }
    s[n] = '\0';
    L.s = s;
    L.n = n;
    bool line_starting = true;
    size_t pos = 0;
    bool strip_next = false; /* the previous tag ended with '-' */
    while (pos <= n) {
        size_t i = pos;
        while (i + 1 < n && !(s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#'))) {
            i++;
        }
        if (i + 1 >= n) {
            i = n;
        }
        const char *text = s + pos;
        size_t tl = i - pos;
        if (strip_next) {
            size_t w = leading_space(text, tl);
            text += w;
            tl -= w;
            strip_next = false;
        }
        if (i == n) {
            pd_status_t st = emit_text(&L, text, tl, pos);
            if (st != PD_OK) {
                return st;
            }
            break;
        }
        char kind = s[i + 1];
        char mod = i + 2 < n ? s[i + 2] : 0;
        bool has_mod = mod == '-' || mod == '+';
        if (mod == '-') {
            tl -= trailing_space(text, tl);
        } else if (mod != '+' && (kind == '%' || kind == '#')) {
            /* lstrip_blocks: spaces and tabs between the line start and the tag go */
            size_t l_pos = tl;
            while (l_pos > 0 && text[l_pos - 1] != '\n') {
                l_pos--;
            }
            if (l_pos > 0 || line_starting) {
                bool only_blank = true;
                for (size_t k = l_pos; k < tl && only_blank; k++) {
                    only_blank = text[k] == ' ' || text[k] == '\t';
                }
                if (only_blank) {
                    tl = l_pos;
                }
            }
        }
        pd_status_t st = emit_text(&L, text, tl, pos);
        if (st != PD_OK) {
            return st;
        }
        size_t body = i + 2 + (has_mod ? 1 : 0);
        bool strip_after = false, plus_after = false;
        size_t end = 0;
        if (kind == '#') {
            size_t j = body;
            while (j + 1 < n && !(s[j] == '#' && s[j + 1] == '}')) {
                j++;
            }
            if (j + 1 >= n) {
                return lex_fail(&L, i, "unterminated comment (missing '#}')");
            }
            strip_after = j > body && s[j - 1] == '-';
            plus_after = j > body && s[j - 1] == '+';
            end = j + 2;
        } else if (kind == '%') {
            bool raw_strip = false;
            if (try_raw(&L, body, &end, &st, &raw_strip)) {
                if (st != PD_OK) {
                    return st;
                }
                strip_after = raw_strip;
            } else {
                tpl_token_t *t = push(&L, TK_BLOCK_BEGIN, i);
                if (t == NULL) {
                    return PD_ERR_NO_MEMORY;
                }
                st = lex_tag(&L, body, true, &end, &strip_after, &plus_after);
                if (st != PD_OK) {
                    return st;
                }
                if (push(&L, TK_BLOCK_END, end - 2) == NULL) {
                    return PD_ERR_NO_MEMORY;
                }
            }
        } else {
            tpl_token_t *t = push(&L, TK_VAR_BEGIN, i);
            if (t == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            st = lex_tag(&L, body, false, &end, &strip_after, &plus_after);
            if (st != PD_OK) {
                return st;
            }
            if (push(&L, TK_VAR_END, end - 2) == NULL) {
                return PD_ERR_NO_MEMORY;
            }
        }
        line_starting = false;
        if (strip_after) {
            strip_next = true;
            /* the match ends with the whitespace it ate: a line start if that held a newline */
            size_t w = leading_space(s + end, n - end);
            line_starting = w > 0 && s[end + w - 1] == '\n';
            end += w;
            strip_next = false;
        } else if (kind != '{' && !plus_after && end < n && s[end] == '\n') {
            end++; /* trim_blocks */
            line_starting = true;
        }
        pos = end;
    }
    tpl_token_t *t = push(&L, TK_EOF, n);
    if (t == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    *toks_out = L.toks;
    *n_out = L.ntok;
    return PD_OK;
}
