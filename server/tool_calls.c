/* server/tool_calls.c — tool calls parsed out of a chat reply (tool_calls.h). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/json.h"
#include "common/time.h"
#include "server/tool_calls.h"

#define HERMES_START  "<tool_call>"
#define HERMES_END    "</tool_call>"
#define MISTRAL_START "[TOOL_CALLS]"
#define MISTRAL_ARGS  "[ARGS]"
#define PYTHON_TAG    "<|python_tag|>"

pd_tool_parser_t pd_tool_parser_by_name(const char *name)
{
    if (name == NULL) {
        return PD_TOOL_PARSER_NONE;
    }
    if (strcmp(name, "hermes") == 0) {
        return PD_TOOL_PARSER_HERMES;
    }
    if (strcmp(name, "llama3_json") == 0) {
        return PD_TOOL_PARSER_LLAMA3_JSON;
    }
    if (strcmp(name, "mistral") == 0) {
        return PD_TOOL_PARSER_MISTRAL;
    }
    return PD_TOOL_PARSER_NONE;
}

const char *pd_tool_parser_names(void)
{
    return "hermes|llama3_json|mistral";
}

static const char *find(const char *s, size_t len, const char *what)
{
    return memmem(s, len, what, strlen(what));
}

void pd_tool_call_id(char id[64])
{
    uint8_t r[16];
    if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
        uint64_t t = pd_time_now_ns() * 0x9E3779B97F4A7C15ull;
        memcpy(r, &t, 8), memcpy(r + 8, &t, 8);
    }
    strcpy(id, "chatcmpl-tool-");
    for (int i = 0; i < 16; i++) {
        snprintf(id + 14 + 2 * i, 3, "%02x", r[i]);
    }
}

/* One OpenAI tool call of the object {"name", "arguments" (or "parameters")}; NULL when it is not one. */
static json_t *call_json(const json_t *obj)
{
    const char *name = json_string_value(json_object_get(obj, "name")); /* NULL for a non-object too */
    if (name == NULL) {
        return NULL;
    }
    const json_t *args = json_object_get(obj, "arguments");
    if (args == NULL) {
        args = json_object_get(obj, "parameters"); /* Llama 3's name for them */
    }
    /* as vLLM: json.dumps(arguments, ensure_ascii=False) — ", " and ": " separators, UTF-8 kept,
     * reals as Python's repr; a string is kept as it came (a model that wrote the arguments as a JSON
     * string) */
    char *a = json_is_string(args) ? strdup(json_string_value(args))
              : args != NULL       ? pd_json_dumps_py(args)
                                   : strdup("{}");
    char id[64];
    pd_tool_call_id(id);
    json_t *c = a != NULL ? json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function", "function",
                                      "name", name, "arguments", a)
                          : NULL;
    free(a);
    return c;
}

/* Appends the call of JSON text[len] to calls; false when it does not parse as one. */
static bool add_call(json_t *calls, const char *text, size_t len)
{
    json_t *obj = json_loadb(text, len, JSON_DECODE_ANY, NULL);
    json_t *c = obj != NULL ? call_json(obj) : NULL;
    json_decref(obj);
    return c != NULL && json_array_append_new(calls, c) == 0;
}

static json_t *parse_hermes(const char *text, size_t len, size_t *content_len)
{
    const char *first = find(text, len, HERMES_START);
    if (first == NULL) {
        return NULL;
    }
    json_t *calls = json_array();
    const char *p = first, *end = text + len;
    while (calls != NULL && p != NULL) {
        const char *body = p + strlen(HERMES_START);
        const char *close = find(body, (size_t)(end - body), HERMES_END);
        const char *body_end = close != NULL ? close : end; /* the last may be cut off at the stop */
        if (!add_call(calls, body, (size_t)(body_end - body))) {
            json_decref(calls); /* as vLLM: a call that does not parse leaves the reply text */
            return NULL;
        }
        p = close != NULL ? find(close, (size_t)(end - close), HERMES_START) : NULL;
    }
    *content_len = (size_t)(first - text);
    return calls;
}

/* Mistral's v11 form: [TOOL_CALLS]name[ARGS]{json}, one per call (the first [TOOL_CALLS] skipped). */
static json_t *parse_mistral_args(const char *body, const char *end)
{
    json_t *calls = json_array();
    while (calls != NULL && body < end) {
        const char *args = find(body, (size_t)(end - body), MISTRAL_ARGS);
        const char *next = args != NULL ? find(args, (size_t)(end - args), MISTRAL_START) : NULL;
        const char *stop = next != NULL ? next : end;
        size_t nl = args != NULL ? (size_t)(args - body) : 0;
        json_t *obj = nl > 0 && nl < 256 ? json_object() : NULL;
        char name[256];
        if (obj != NULL) {
            memcpy(name, body, nl);
            name[nl] = '\0';
            const char *a = args + strlen(MISTRAL_ARGS);
            json_t *av = json_loadb(a, (size_t)(stop - a), JSON_DECODE_ANY, NULL);
            if (av == NULL || json_object_set_new(obj, "name", json_string(name)) != 0) { /* (not UTF-8) */
                json_decref(av);
                json_decref(obj);
                obj = NULL;
            } else if (json_object_set_new(obj, "arguments", av) != 0) {
                json_decref(obj);
                obj = NULL;
            }
        }
        json_t *c = obj != NULL ? call_json(obj) : NULL;
        json_decref(obj);
        if (c == NULL || json_array_append_new(calls, c) != 0) {
            json_decref(calls);
            return NULL;
        }
        body = next != NULL ? next + strlen(MISTRAL_START) : end;
    }
    return calls;
}

static json_t *parse_mistral(const char *text, size_t len, size_t *content_len)
{
    const char *at = find(text, len, MISTRAL_START);
    if (at == NULL) {
        return NULL;
    }
    const char *body = at + strlen(MISTRAL_START);
    if (body < text + len && *body != '[' && *body != '{') { /* v11: name[ARGS]{...} */
        json_t *calls = parse_mistral_args(body, text + len);
        if (calls != NULL) {
            *content_len = (size_t)(at - text);
        }
        return calls;
    }
    json_t *list = json_loadb(body, (size_t)(text + len - body), JSON_DECODE_ANY, NULL);
    json_t *calls = json_array();
    if (list != NULL && json_is_object(list)) { /* a single call without its list */
        json_t *one = json_pack("[O]", list);
        json_decref(list);
        list = one;
    }
    size_t i;
    json_t *obj;
    bool ok = json_is_array(list) && json_array_size(list) > 0 && calls != NULL;
    json_array_foreach(list, i, obj)
    {
        json_t *c = ok ? call_json(obj) : NULL;
        ok = c != NULL && json_array_append_new(calls, c) == 0;
    }
    json_decref(list);
    if (!ok) {
        json_decref(calls);
        return NULL;
    }
    *content_len = (size_t)(at - text);
    return calls;
}

/* Llama 3: the reply is the calls — one JSON object, or several separated by ";" (vLLM decodes
 * them one after another). */
static json_t *parse_llama3(const char *text, size_t len, size_t *content_len)
{
    size_t off = 0;
    if (len >= strlen(PYTHON_TAG) && memcmp(text, PYTHON_TAG, strlen(PYTHON_TAG)) == 0) {
        off = strlen(PYTHON_TAG);
    } else if (len == 0 || text[0] != '{') {
        return NULL;
    }
    json_t *calls = json_array();
    while (calls != NULL && off < len) {
        while (off < len &&
               (text[off] == ' ' || text[off] == '\n' || text[off] == '\t' || text[off] == ';')) {
            off++;
        }
        if (off == len) {
            break;
        }
        json_error_t je;
        json_t *obj = json_loadb(text + off, len - off, JSON_DISABLE_EOF_CHECK, &je);
        json_t *c = obj != NULL ? call_json(obj) : NULL;
        json_decref(obj);
        if (c == NULL || json_array_append_new(calls, c) != 0) {
            json_decref(calls);
            return NULL;
        }
        off += (size_t)je.position; /* DISABLE_EOF_CHECK: where the object ended */
    }
    if (calls != NULL && json_array_size(calls) == 0) {
        json_decref(calls);
        return NULL;
    }
    *content_len = 0;
    return calls;
}

enum { RQ_LIST, RQ_NAME_KEY, RQ_NAME_WAIT, RQ_NAME, RQ_PARAMS_KEY, RQ_VALUE_WAIT, RQ_VALUE, RQ_OBJ_END };

/* Appends text[from, to) to the arguments of the call being written (a new delta entry for it
 * when this read has none yet). */
static void args_append(json_t *deltas, json_t **cur, int32_t index, const char *text, size_t from, size_t to)
{
    if (to <= from) {
        return;
    }
    if (*cur == NULL) {
        *cur = json_pack("{s:i, s:{s:s}}", "index", (int)index, "function", "arguments", "");
        json_array_append_new(deltas, *cur);
    }
    json_t *fn = json_object_get(*cur, "function");
    const char *have = json_string_value(json_object_get(fn, "arguments"));
    size_t hl = have != NULL ? strlen(have) : 0;
    char *joined = malloc(hl + (to - from) + 1);
    if (joined != NULL) {
        memcpy(joined, have, hl);
        memcpy(joined + hl, text + from, to - from);
        joined[hl + (to - from)] = '\0';
        json_object_set_new(fn, "arguments", json_string(joined));
        free(joined);
    }
}

json_t *pd_tool_calls_required_read(pd_required_reader_t *r, const char *text, size_t len)
{
    json_t *deltas = json_array(), *cur = NULL;
    pd_redump_out_t o = {0};
    while (deltas != NULL && r->pos < len) {
        char c = text[r->pos];
        bool ws = c == ' ' || c == '\t' || c == '\n' || c == '\r';
        switch (r->state) {
        case RQ_LIST: r->state = c == '{' ? RQ_NAME_KEY : RQ_LIST; break;
        case RQ_NAME_KEY: r->state = c == ':' ? RQ_NAME_WAIT : RQ_NAME_KEY; break; /* past "name" */
        case RQ_NAME_WAIT:
            if (c == '"') {
                r->name_from = r->pos;
                r->esc = false;
                r->state = RQ_NAME;
            }
            break;
        case RQ_NAME:
            if (r->esc) {
                r->esc = false;
            } else if (c == '\\') {
                r->esc = true;
            } else if (c == '"') { /* the name is read: the call opens */
                json_t *name =
                    json_loadb(text + r->name_from, r->pos + 1 - r->name_from, JSON_DECODE_ANY, NULL);
                char id[64];
                pd_tool_call_id(id);
                cur = json_pack("{s:i, s:s, s:s, s:{s:s, s:s}}", "index", (int)r->calls, "id", id, "type",
                                "function", "function", "name",
                                json_is_string(name) ? json_string_value(name) : "", "arguments", "");
                json_decref(name);
                json_array_append_new(deltas, cur);
                r->calls++;
                r->state = RQ_PARAMS_KEY;
            }
            break;
        case RQ_PARAMS_KEY:
            r->state = c == ':' ? RQ_VALUE_WAIT : RQ_PARAMS_KEY;
            break; /* past "parameters" */
        case RQ_VALUE_WAIT:
            if (ws) {
                break;
            }
            pd_json_redump_init(&r->rd, false); /* as vLLM: json.dumps(parameters) */
            r->state = RQ_VALUE;
            continue; /* this byte is the value's first */
        case RQ_VALUE: {
            o.n = 0;
            size_t used = pd_json_redump_feed(&r->rd, text + r->pos, len - r->pos, &o);
            args_append(deltas, &cur, r->calls - 1, o.s, 0, o.n);
            r->pos += used;
            if (pd_json_redump_done(&r->rd) || r->rd.bad) { /* (a value the grammar allowed is JSON) */
                r->state = RQ_OBJ_END;
            }
            continue;
        }
        case RQ_OBJ_END: r->state = c == '}' ? RQ_LIST : RQ_OBJ_END; break;
        }
        r->pos++;
    }
    free(o.s);
    if (json_array_size(deltas) == 0) {
        json_decref(deltas);
        return NULL;
    }
    return deltas;
}

/* tool_choice "required": the calls of the whole reply, as its stream's deltas joined. */
static json_t *parse_required(const char *text, size_t len, size_t *content_len)
{
    json_t *list = json_loadb(text, len, JSON_DECODE_ANY, NULL);
    bool is_list = json_is_array(list) && json_array_size(list) > 0;
    json_decref(list);
    pd_required_reader_t r = {0};
    json_t *deltas = is_list ? pd_tool_calls_required_read(&r, text, len) : NULL;
    json_t *calls = deltas != NULL ? json_array() : NULL;
    size_t i;
    json_t *d;
    json_array_foreach(deltas, i, d)
    {
        json_int_t idx = json_integer_value(json_object_get(d, "index"));
        json_t *args = json_object_get(json_object_get(d, "function"), "arguments");
        if (json_object_get(d, "id") != NULL) { /* an opening entry: the call itself */
            json_object_del(d, "index");
            json_array_append(calls, d);
        } else if ((size_t)idx < json_array_size(calls)) {
            json_t *fn = json_object_get(json_array_get(calls, (size_t)idx), "function");
            const char *have = json_string_value(json_object_get(fn, "arguments"));
            size_t hl = strlen(have), al = strlen(json_string_value(args));
            char *joined = malloc(hl + al + 1);
            if (joined != NULL) {
                memcpy(joined, have, hl);
                memcpy(joined + hl, json_string_value(args), al + 1);
                json_object_set_new(fn, "arguments", json_string(joined));
                free(joined);
            }
        }
    }
    json_decref(deltas);
    if (calls != NULL && json_array_size(calls) == 0) {
        json_decref(calls);
        calls = NULL;
    }
    if (calls != NULL) {
        *content_len = 0;
    }
    return calls;
}

json_t *pd_tool_calls_parse(pd_tool_parser_t p, const char *text, size_t len, size_t *content_len)
{
    *content_len = len;
    switch (p) {
    case PD_TOOL_PARSER_HERMES: return parse_hermes(text, len, content_len);
    case PD_TOOL_PARSER_LLAMA3_JSON: return parse_llama3(text, len, content_len);
    case PD_TOOL_PARSER_MISTRAL: return parse_mistral(text, len, content_len);
    case PD_TOOL_PARSER_REQUIRED: return parse_required(text, len, content_len);
    case PD_TOOL_PARSER_NAMED: /* pd_tool_calls_named: the name is the request's */
    case PD_TOOL_PARSER_NONE: break;
    }
    return NULL;
}

/* Bytes of text before marker, or before the longest tail of text that begins it. */
static size_t before_marker(const char *text, size_t len, const char *marker)
{
    const char *at = find(text, len, marker);
    if (at != NULL) {
        return (size_t)(at - text);
    }
    size_t m = strlen(marker);
    for (size_t k = m - 1 < len ? m - 1 : len; k > 0; k--) {
        if (memcmp(text + len - k, marker, k) == 0) {
            return len - k;
        }
    }
    return len;
}

size_t pd_tool_calls_safe_prefix(pd_tool_parser_t p, const char *text, size_t len, size_t from)
{
    /* a marker cannot begin before from: the text up to there held no marker nor the start of one */
    switch (p) {
    case PD_TOOL_PARSER_HERMES: return from + before_marker(text + from, len - from, HERMES_START);
    case PD_TOOL_PARSER_MISTRAL: return from + before_marker(text + from, len - from, MISTRAL_START);
    case PD_TOOL_PARSER_LLAMA3_JSON: {
        /* calls only at the very start: hold the reply while it is (or may become) one */
        if (from > 0) {
            return len; /* it began as text */
        }
        size_t t = strlen(PYTHON_TAG);
        bool may_be_tag = memcmp(text, PYTHON_TAG, len < t ? len : t) == 0;
        return len == 0 || text[0] == '{' || may_be_tag ? 0 : len;
    }
    case PD_TOOL_PARSER_REQUIRED:
    case PD_TOOL_PARSER_NAMED: return 0; /* the whole reply is the calls */
    case PD_TOOL_PARSER_NONE: break;
    }
    return len;
}

json_t *pd_tool_calls_named(const char *name, const char *text, size_t len)
{
    json_t *obj = json_object();
    json_t *calls = json_array();
    char *args = strndup(text, len);
    /* the arguments as written (a string keeps them verbatim in call_json) */
    if (obj == NULL || calls == NULL || args == NULL ||
        json_object_set_new(obj, "name", json_string(name)) != 0 ||
        json_object_set_new(obj, "arguments", json_string(args)) != 0) {
        json_decref(obj), json_decref(calls), free(args);
        return NULL;
    }
    free(args);
    json_t *c = call_json(obj);
    json_decref(obj);
    if (c == NULL || json_array_append_new(calls, c) != 0) {
        json_decref(calls);
        return NULL;
    }
    return calls;
}
