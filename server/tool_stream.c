/* server/tool_stream.c — tool_choice "auto" streamed: the calls of a reply (hermes, llama3_json,
 * mistral) read while it is written, as vLLM's streaming tool parsers send them. A call opens
 * ({"index", "id", "type", "function": {"name", "arguments": ""}}) once its name is read, and its
 * arguments grow as they are written, re-dumped on the fly as the whole reply's calls write them
 * (call_json: Python's json.dumps, pd_json_dumps_py; a string value as its text), so
 * that a stream's arguments joined equal the whole answer's. The whole reply's parse has the last
 * word (pd_tool_calls_auto_finish): what the stream did not send yet is sent at the end.
 *
 * Only the text from the first call's marker on is read here; the content before it streams as
 * pd_tool_calls_safe_prefix allows. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/json.h"
#include "common/log.h"
#include "server/tool_calls.h"

#define HERMES_START  "<tool_call>"
#define MISTRAL_START "[TOOL_CALLS]"
#define MISTRAL_ARGS  "[ARGS]"
#define PYTHON_TAG    "<|python_tag|>"

/* ------------------------------------------------------------------ the re-dumper */

enum { RD_VALUE, RD_VALUE_OR_END, RD_KEY_OR_END, RD_KEY, RD_COLON, RD_AFTER, RD_END };

typedef pd_redump_out_t out_buf_t;

static void out_add(out_buf_t *o, const char *s, size_t n)
{
    if (o == NULL || n == 0 || o->failed) {
        return;
    }
    if (pd_array_reserve(&o->s, &o->cap, o->n + n + 1) != PD_OK) {
        o->failed = true;
        return;
    }
    memcpy(o->s + o->n, s, n);
    o->n += n;
    o->s[o->n] = '\0';
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* A string's decoded bytes, as json.dumps escapes them (without the quotes); raw: as they are.
 * A character's UTF-8 bytes are put together (one cut off at the end waits in d->utf8). */
static void flush_decoded(pd_json_redump_t *d, out_buf_t *o, const char *buf, size_t k)
{
    if (o == NULL || k == 0) {
        return;
    }
    if (d->raw) {
        out_add(o, buf, k);
        return;
    }
    json_t *js = json_stringn(buf, k);
    char *q = js != NULL ? pd_json_dumps_py(js) : NULL;
    if (q == NULL) {
        d->bad = true; /* not UTF-8: the whole reply does not parse either */
    } else {
        out_add(o, q + 1, strlen(q) - 2);
    }
    free(q);
    json_decref(js);
}

static void put_decoded(pd_json_redump_t *d, out_buf_t *o, const char *s, size_t n)
{
    char buf[260];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        d->utf8[d->nutf8++] = s[i];
        unsigned char c0 = (unsigned char)d->utf8[0];
        int need = c0 >= 0xf0 ? 4 : c0 >= 0xe0 ? 3 : c0 >= 0xc0 ? 2 : 1;
        if (d->nutf8 < need) {
            continue;
        }
        memcpy(buf + k, d->utf8, (size_t)d->nutf8);
        k += (size_t)d->nutf8;
        d->nutf8 = 0;
        if (k + 4 > sizeof(buf)) {
            flush_decoded(d, o, buf, k);
            k = 0;
        }
    }
    flush_decoded(d, o, buf, k);
}

/* A scalar (number, true, false, null) ends: dumped as the whole answer's json.dumps writes it. */
static void end_scalar(pd_json_redump_t *d, out_buf_t *o)
{
    json_t *v = json_loadb(d->tok, (size_t)d->ntok, JSON_DECODE_ANY, NULL);
    char *q = v != NULL ? pd_json_dumps_py(v) : NULL;
    if (q == NULL) {
        d->bad = true;
    } else {
        out_add(o, q, strlen(q));
    }
    free(q);
    json_decref(v);
    d->ntok = 0;
    d->st = d->depth == 0 ? RD_END : RD_AFTER;
}

static void put_code_point(pd_json_redump_t *d, out_buf_t *o, uint32_t cp)
{
    char u[4];
    size_t n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    if (n == 1) {
        u[0] = (char)cp;
    } else if (n == 2) {
        u[0] = (char)(0xc0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3f));
    } else if (n == 3) {
        u[0] = (char)(0xe0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3f)),
        u[2] = (char)(0x80 | (cp & 0x3f));
    } else {
        u[0] = (char)(0xf0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3f)), u[3] = (char)(0x80 | (cp & 0x3f));
    }
    put_decoded(d, o, u, n);
}

/* One byte inside a string (d->in_str). */
static void string_byte(pd_json_redump_t *d, out_buf_t *o, char c)
{
    if (d->nhex >= 0) { /* \uXXXX */
        int v = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (v < 0) {
            d->bad = true;
            return;
        }
        d->hex = d->hex << 4 | (uint32_t)v;
        if (++d->nhex < 4) {
            return;
        }
        uint32_t cp = d->hex;
        d->nhex = -1;
        if (d->hi != 0) { /* the second half of a surrogate pair */
            if (cp < 0xdc00 || cp > 0xdfff) {
                d->bad = true;
                return;
            }
            cp = 0x10000 + ((d->hi - 0xd800) << 10) + (cp - 0xdc00);
            d->hi = 0;
        } else if (cp >= 0xd800 && cp <= 0xdbff) {
            d->hi = cp;
            return;
        } else if (cp >= 0xdc00 && cp <= 0xdfff) {
            d->bad = true;
            return;
        }
        if (cp == 0) {
            d->bad = true; /* jansson refuses NUL in strings */
            return;
        }
        put_code_point(d, o, cp);
        return;
    }
    if (d->hi != 0 && !(d->esc || c == '\\')) {
        d->bad = true; /* a lone high surrogate */
        return;
    }
    if (d->esc) {
        d->esc = false;
        static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
        const char *at = c != '\0' ? strchr(from, c) : NULL;
        if (c == 'u') {
            d->nhex = 0;
            d->hex = 0;
        } else if (at != NULL) {
            put_decoded(d, o, to + (at - from), 1);
        } else {
            d->bad = true;
        }
        if (d->hi != 0 && c != 'u') {
            d->bad = true;
        }
        return;
    }
    if (c == '\\') {
        d->esc = true;
    } else if (c == '"') {
        d->in_str = false;
        if (d->nutf8 > 0) {
            d->bad = true; /* a character cut off */
            return;
        }
        if (!d->raw) {
            out_add(o, "\"", 1);
        }
        d->st = d->is_key ? RD_COLON : d->depth == 0 ? RD_END : RD_AFTER;
    } else if ((unsigned char)c < 0x20) {
        d->bad = true; /* a raw control character: not JSON */
    } else {
        put_decoded(d, o, &c, 1);
    }
}

size_t pd_json_redump_feed(pd_json_redump_t *d, const char *s, size_t n, pd_redump_out_t *o)
{
    size_t i = 0;
    for (; i < n && !d->bad && d->st != RD_END; i++) {
        char c = s[i];
        if (d->in_str) {
            string_byte(d, o, c);
            continue;
        }
        if (d->ntok > 0) {
            bool more = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        c == '.' || c == '+' || c == '-';
            if (more && d->ntok < (int)sizeof(d->tok)) {
                d->tok[d->ntok++] = c;
                continue;
            }
            if (more) {
                d->bad = true;
                break;
            }
            end_scalar(d, o);
            if (d->st == RD_END) {
                break; /* this byte follows the value */
            }
        }
        if (is_ws(c)) {
            continue;
        }
        switch (d->st) {
        case RD_VALUE_OR_END:
            if (c == ']') {
                goto close;
            }
            __attribute__((fallthrough));
        case RD_VALUE:
            if (c == '{' || c == '[') {
                if (d->depth >= (int)sizeof(d->stack)) {
                    d->bad = true;
                    break;
                }
                d->stack[d->depth++] = c;
                out_add(o, &c, 1);
                d->st = c == '{' ? RD_KEY_OR_END : RD_VALUE_OR_END;
            } else if (c == '"') {
                d->in_str = true;
                d->is_key = false;
                d->raw = d->depth == 0 && d->raw_top;
                if (!d->raw) {
                    out_add(o, "\"", 1);
                }
            } else if ((c >= '0' && c <= '9') || c == '-' || c == 't' || c == 'f' || c == 'n') {
                d->tok[d->ntok++] = c;
            } else {
                d->bad = true;
            }
            break;
        case RD_KEY_OR_END:
            if (c == '}') {
                goto close;
            }
            __attribute__((fallthrough));
        case RD_KEY:
            if (c != '"') {
                d->bad = true;
                break;
            }
            d->in_str = d->is_key = true;
            d->raw = false;
            out_add(o, "\"", 1);
            break;
        case RD_COLON:
            if (c != ':') {
                d->bad = true;
                break;
            }
            out_add(o, ": ", 2);
            d->st = RD_VALUE;
            break;
        case RD_AFTER:
            if (c == ',') {
                out_add(o, ", ", 2);
                d->st = d->stack[d->depth - 1] == '{' ? RD_KEY : RD_VALUE;
                break;
            }
            if (c != '}' && c != ']') {
                d->bad = true;
                break;
            }
        close:
            if (d->depth == 0 || (c == '}') != (d->stack[d->depth - 1] == '{')) {
                d->bad = true;
                break;
            }
            d->depth--;
            out_add(o, &c, 1);
            d->st = d->depth == 0 ? RD_END : RD_AFTER;
            break;
        }
    }
    return i;
}

bool pd_json_redump_done(const pd_json_redump_t *d)
{
    return d->st == RD_END;
}

void pd_json_redump_init(pd_json_redump_t *d, bool raw_top_string)
{
    memset(d, 0, sizeof(*d));
    d->nhex = -1;
    d->raw_top = raw_top_string;
}

/* ------------------------------------------------------------------ the calls */

enum {
    AU_SEEK,    /* before a call: its marker, separators, the object's '{' */
    AU_KEY,     /* in a call object: the next key (or its end) */
    AU_KEYSTR,  /* reading a key */
    AU_COLON,   /* after a key */
    AU_NAMESTR, /* reading the name's string */
    AU_VALUE,   /* a value through the re-dumper: the arguments (streamed) or another key's (skipped) */
    AU_AFTER,   /* after a value: ',' or the object's end */
    AU_V11NAME, /* mistral v11: the name before [ARGS] */
    AU_STOP,    /* nothing more is streamed: the whole reply's parse sends the rest */
};

/* The deltas of this read, the entry for call i (made on first use). */
static json_t *entry(json_t *deltas, json_t **cur, int32_t i)
{
    if (*cur == NULL || json_integer_value(json_object_get(*cur, "index")) != i) {
        *cur = json_pack("{s:i, s:{s:s}}", "index", (int)i, "function", "arguments", "");
        json_array_append_new(deltas, *cur);
    }
    return json_object_get(*cur, "function");
}

static void open_call(pd_auto_reader_t *r, json_t *deltas, json_t **cur, const char *name)
{
    if (r->calls >= PD_AUTO_MAX_CALLS) {
        r->state = AU_STOP;
        return;
    }
    char id[64];
    pd_tool_call_id(id);
    json_t *jn = json_string(name); /* (NULL: not UTF-8; json_pack would leak its inner object then) */
    json_t *c = jn != NULL ? json_pack("{s:i, s:s, s:s, s:{s:o, s:s}}", "index", (int)r->calls, "id", id,
                                       "type", "function", "function", "name", jn, "arguments", "")
                           : NULL;
    r->names[r->calls] = strdup(name);
    r->args[r->calls] = calloc(1, 1);
    if (c == NULL || r->names[r->calls] == NULL || r->args[r->calls] == NULL) { /* (a name not UTF-8) */
        json_decref(c);
        free(r->names[r->calls]), free(r->args[r->calls]);
        r->names[r->calls] = r->args[r->calls] = NULL;
        r->state = AU_STOP;
        return;
    }
    *cur = c;
    json_array_append_new(deltas, c);
    r->args_len[r->calls] = 0;
    r->calls++;
    r->named = true;
}

/* Appends re-dumped bytes to the arguments of the call being written (the stream's and r's copy). */
static void args_out(pd_auto_reader_t *r, json_t *deltas, json_t **cur, const char *s, size_t n)
{
    if (n == 0 || r->calls == 0) {
        return;
    }
    int32_t i = r->calls - 1;
    char *a = realloc(r->args[i], r->args_len[i] + n + 1);
    if (a == NULL) {
        r->state = AU_STOP;
        return;
    }
    memcpy(a + r->args_len[i], s, n);
    r->args_len[i] += n;
    a[r->args_len[i]] = '\0';
    r->args[i] = a;
    json_t *fn = entry(deltas, cur, i);
    const char *have = json_string_value(json_object_get(fn, "arguments"));
    size_t hl = have != NULL ? strlen(have) : 0;
    char *joined = malloc(hl + n + 1);
    if (joined != NULL) {
        memcpy(joined, have, hl);
        memcpy(joined + hl, s, n);
        joined[hl + n] = '\0';
        json_object_set_new(fn, "arguments", json_string(joined));
        free(joined);
    }
}

/* Moves r->pos past the next marker at or after it; false while there is none yet (r->pos then
 * stays where one may still begin). */
static bool past_marker(pd_auto_reader_t *r, const char *text, size_t len, const char *marker)
{
    size_t ml = strlen(marker);
    const char *at = memmem(text + r->pos, len - r->pos, marker, ml);
    if (at == NULL) {
        r->pos = len >= ml && len - ml + 1 > r->pos ? len - ml + 1 : r->pos;
        return false;
    }
    r->pos = r->marker_end = (size_t)(at - text) + ml;
    r->marker_read = true;
    return true;
}

/* Moves r->pos to where the next call begins (its object's '{'; r->state AU_V11NAME: a mistral v11
 * name); false while the text does not tell yet, or (r->state AU_STOP) tells that no call follows. */
static bool seek(pd_tool_parser_t p, pd_auto_reader_t *r, const char *text, size_t len)
{
    if (p == PD_TOOL_PARSER_LLAMA3_JSON && r->pos == 0) { /* calls only from the reply's start */
        size_t tl = strlen(PYTHON_TAG);
        if (len < tl && memcmp(text, PYTHON_TAG, len) == 0) {
            return false;
        }
        r->pos = len >= tl && memcmp(text, PYTHON_TAG, tl) == 0 ? tl : 0;
        r->marker_read = true;
    }
    for (;;) {
        if (!r->marker_read &&
            !past_marker(r, text, len, p == PD_TOOL_PARSER_HERMES ? HERMES_START : MISTRAL_START)) {
            return false;
        }
        if (p == PD_TOOL_PARSER_MISTRAL && !r->in_list && r->pos < len && r->pos == r->marker_end &&
            (r->v11_form || (text[r->pos] != '[' && text[r->pos] != '{'))) {
            /* v11: [TOOL_CALLS]name[ARGS]{...}, every call once the first is (as the whole parse reads) */
            r->v11_form = true;
            r->state = AU_V11NAME;
            r->key_from = r->pos;
            return false;
        }
        while (r->pos < len &&
               (is_ws(text[r->pos]) || (p == PD_TOOL_PARSER_LLAMA3_JSON && text[r->pos] == ';') ||
                (r->in_list && text[r->pos] == ','))) {
            r->pos++;
        }
        if (r->pos >= len) {
            return false;
        }
        char c = text[r->pos];
        if (c == '{') {
            return true;
        }
        if (p == PD_TOOL_PARSER_MISTRAL && !r->in_list && c == '[') {
            r->in_list = true;
            r->pos++;
            continue;
        }
        r->state = AU_STOP; /* (a list's ']', or text where a call must be) */
        return false;
    }
}

json_t *pd_tool_calls_auto_read(pd_tool_parser_t p, pd_auto_reader_t *r, const char *text, size_t len)
{
    json_t *deltas = json_array(), *cur = NULL;
    out_buf_t o = {0};
    while (deltas != NULL && r->pos < len && r->state != AU_STOP) {
        char c = text[r->pos];
        switch (r->state) {
        case AU_SEEK:
            if (!seek(p, r, text, len)) {
                if (r->state == AU_V11NAME) {
                    continue;
                }
                goto out;
            }
            r->pos++; /* the object's '{' */
            r->state = AU_KEY;
            r->named = r->in_args = r->v11 = false;
            r->marker_read = p == PD_TOOL_PARSER_LLAMA3_JSON || r->in_list; /* else one call per marker */
            continue;
        case AU_V11NAME: {
            const char *at =
                memmem(text + r->key_from, len - r->key_from, MISTRAL_ARGS, strlen(MISTRAL_ARGS));
            if (at == NULL) {
                if (len - r->key_from > 256) {
                    r->state = AU_STOP;
                }
                goto out;
            }
            size_t nl = (size_t)(at - text) - r->key_from;
            if (nl == 0 || nl >= 256) { /* as the whole parse: no call */
                r->state = AU_STOP;
                goto out;
            }
            char name[256];
            memcpy(name, text + r->key_from, nl);
            name[nl] = '\0';
            open_call(r, deltas, &cur, name);
            r->pos = (size_t)(at - text) + strlen(MISTRAL_ARGS);
            pd_json_redump_init(&r->rd, true);
            r->in_args = true;
            r->v11 = true;
            r->state = r->state == AU_STOP ? AU_STOP : AU_VALUE;
            continue;
        }
        case AU_KEY:
            if (is_ws(c) || c == ',') {
                break;
            }
            if (c == '}') {
                r->state = r->named ? AU_SEEK : AU_STOP; /* a call without a name: the whole parse decides */
                break;
            }
            if (c != '"') {
                r->state = AU_STOP;
                break;
            }
            r->key_from = r->pos + 1;
            r->state = AU_KEYSTR;
            break;
        case AU_KEYSTR:
            if (c == '\\') {
                r->state = AU_STOP; /* an escaped key: left to the whole parse */
            } else if (c == '"') {
                size_t kl = r->pos - r->key_from;
                const char *k = text + r->key_from;
                r->key = kl == 4 && memcmp(k, "name", 4) == 0 ? 1
                         : (kl == 9 && memcmp(k, "arguments", 9) == 0) ||
                                 (kl == 10 && memcmp(k, "parameters", 10) == 0)
                             ? 2
                             : 0;
                r->state = AU_COLON;
            }
            break;
        case AU_COLON:
            if (is_ws(c)) {
                break;
            }
            if (c != ':') {
                r->state = AU_STOP;
                break;
            }
            if (r->key == 1) {
                r->state = AU_NAMESTR;
                r->key_from = 0;
                r->esc = false;
            } else {
                pd_json_redump_init(&r->rd, true);
                r->in_args = r->key == 2;
                if (r->in_args && !r->named) {
                    r->state = AU_STOP; /* arguments before the name: sent whole at the end */
                    break;
                }
                r->state = AU_VALUE;
            }
            break;
        case AU_NAMESTR:
            if (r->key_from == 0) {
                if (is_ws(c)) {
                    break;
                }
                if (c != '"' || r->named) {
                    r->state = AU_STOP;
                    break;
                }
                r->key_from = r->pos;
            } else if (c == '\\') {
                r->esc = !r->esc;
            } else if (c == '"' && !r->esc) {
                json_t *name =
                    json_loadb(text + r->key_from, r->pos + 1 - r->key_from, JSON_DECODE_ANY, NULL);
                if (!json_is_string(name)) {
                    r->state = AU_STOP;
                } else {
                    open_call(r, deltas, &cur, json_string_value(name));
                    r->state = r->state == AU_STOP ? AU_STOP : AU_AFTER;
                }
                json_decref(name);
            } else {
                r->esc = false;
            }
            break;
        case AU_VALUE: {
            o.n = 0;
            size_t used = pd_json_redump_feed(&r->rd, text + r->pos, len - r->pos, r->in_args ? &o : NULL);
            if (r->in_args && o.n > 0) {
                args_out(r, deltas, &cur, o.s, o.n);
            }
            r->pos += used;
            if (r->rd.bad || o.failed) {
                r->state = AU_STOP;
            } else if (pd_json_redump_done(&r->rd)) {
                r->state = r->v11 ? AU_SEEK : AU_AFTER;
                r->marker_read = r->marker_read && !r->v11;
            }
            continue;
        }
        case AU_AFTER:
            if (is_ws(c)) {
                break;
            }
            if (c == ',') {
                r->state = AU_KEY;
            } else if (c == '}') {
                r->state = AU_SEEK;
            } else {
                r->state = AU_STOP;
            }
            break;
        }
        r->pos++;
    }
out:
    free(o.s);
    if (json_array_size(deltas) == 0) {
        json_decref(deltas);
        return NULL;
    }
    return deltas;
}

json_t *pd_tool_calls_auto_finish(pd_auto_reader_t *r, const json_t *calls)
{
    json_t *deltas = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(calls, i, c)
    {
        const json_t *fn = json_object_get(c, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        if (name == NULL || args == NULL) {
            continue;
        }
        if ((int32_t)i >= r->calls) { /* not opened while streaming: the whole call now */
            json_t *d = json_deep_copy(c);
            json_object_set_new(d, "index", json_integer((json_int_t)i));
            json_array_append_new(deltas, d);
            continue;
        }
        size_t al = strlen(args);
        if (strcmp(r->names[i], name) != 0 || r->args_len[i] > al ||
            memcmp(r->args[i], args, r->args_len[i]) != 0) {
            pd_log_warn("tool calls: call %zu as streamed (%s(%s)) is not the start of the whole reply's "
                        "(%s(%s)); the stream keeps what it sent",
                        i, r->names[i], r->args[i], name, args);
            continue;
        }
        if (al > r->args_len[i]) {
            json_array_append_new(deltas, json_pack("{s:i, s:{s:s}}", "index", (int)i, "function",
                                                    "arguments", args + r->args_len[i]));
        }
    }
    if ((size_t)r->calls > json_array_size(calls)) {
        pd_log_warn("tool calls: %d calls were streamed, the whole reply holds %zu", r->calls,
                    json_array_size(calls));
    }
    if (json_array_size(deltas) == 0) {
        json_decref(deltas);
        return NULL;
    }
    return deltas;
}

void pd_auto_reader_free(pd_auto_reader_t *r)
{
    for (int32_t i = 0; i < r->calls; i++) {
        free(r->names[i]);
        free(r->args[i]);
    }
    memset(r, 0, sizeof(*r));
}
