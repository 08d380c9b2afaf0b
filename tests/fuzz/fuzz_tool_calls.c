/* tests/fuzz/fuzz_tool_calls.c — a model's reply as hostile input to the tool-call parsers. The
 * first byte picks the parser ('h' hermes, 'l' llama3_json, anything else mistral); the rest is the
 * reply. It is parsed whole, and streamed (pd_tool_calls_auto_read) in pieces whose sizes come from
 * the input's hash, then finished against the whole parse (pd_tool_calls_auto_finish): never a
 * crash, every delta valid, and where the whole reply holds calls and the stream opened each in
 * order, the stream's names and arguments joined equal the whole parse's. */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdbool.h>
#include <string.h>

#include "common/hash.h"
#include "fuzz.h"
#include "server/tool_calls.h"

#define MAX_CALLS 8

/* Joins the deltas d into names/args; false when one is malformed or out of order. */
static bool join(json_t *d, int *opened, char **names, char **args)
{
    size_t i;
    json_t *e;
    json_array_foreach(d, i, e)
    {
        json_int_t idx = json_integer_value(json_object_get(e, "index"));
        json_t *fn = json_object_get(e, "function");
        const char *a = json_string_value(json_object_get(fn, "arguments"));
        if (idx < 0 || idx >= MAX_CALLS || a == NULL) {
            return idx >= MAX_CALLS; /* (more calls than this target follows: not a defect) */
        }
        if (json_object_get(e, "id") != NULL) {
            if (idx != *opened || json_string_value(json_object_get(fn, "name")) == NULL) {
                return false;
            }
            names[idx] = strdup(json_string_value(json_object_get(fn, "name")));
            args[idx] = calloc(1, 1);
            (*opened)++;
        } else if (idx >= *opened) {
            return false; /* arguments for a call not opened */
        }
        size_t have = strlen(args[idx]);
        args[idx] = realloc(args[idx], have + strlen(a) + 1);
        strcpy(args[idx] + have, a);
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 16)) {
        return 0;
    }
    pd_log_set_level(PD_LOG_ERROR);
    pd_tool_parser_t p = data[0] == 'h'   ? PD_TOOL_PARSER_HERMES
                         : data[0] == 'l' ? PD_TOOL_PARSER_LLAMA3_JSON
                                          : PD_TOOL_PARSER_MISTRAL;
    const char *text = (const char *)data + 1;
    size_t len = size - 1, content_len = 0;
    json_t *whole = pd_tool_calls_parse(p, text, len, &content_len);
    if (whole != NULL && content_len > len) {
        abort();
    }
    pd_auto_reader_t r = {0};
    char *names[MAX_CALLS] = {0}, *args[MAX_CALLS] = {0};
    int opened = 0;
    bool ok = true;
    uint64_t h = pd_hash64(data, size, 11);
    for (size_t upto = 0; upto < len;) {
        h = h * 6364136223846793005ull + 1442695040888963407ull;
        upto += 1 + (size_t)((h >> 33) % 16);
        upto = upto < len ? upto : len;
        json_t *d = pd_tool_calls_auto_read(p, &r, text, upto);
        ok = ok && join(d, &opened, names, args);
        json_decref(d);
    }
    int streamed = opened;
    if (whole != NULL) {
        json_t *d = pd_tool_calls_auto_finish(&r, whole);
        ok = ok && join(d, &opened, names, args);
        json_decref(d);
    }
    if (!ok) {
        abort(); /* a malformed delta */
    }
    int arg_keys = 0; /* a call object with two argument keys: the whole parse keeps the last (logged) */
    for (const char *s = text; (s = memmem(s, len - (size_t)(s - text), "arguments\"", 10)) != NULL; s++) {
        arg_keys++;
    }
    for (const char *s = text; (s = memmem(s, len - (size_t)(s - text), "parameters\"", 11)) != NULL; s++) {
        arg_keys++;
    }
    if (whole != NULL && (size_t)opened == json_array_size(whole) && streamed <= opened &&
        opened <= MAX_CALLS) {
        for (int i = 0; i < opened; i++) {
            json_t *fn = json_object_get(json_array_get(whole, (size_t)i), "function");
            if (strcmp(names[i], json_string_value(json_object_get(fn, "name"))) != 0) {
                abort(); /* the stream named another call than the whole reply */
            }
            if (strcmp(args[i], json_string_value(json_object_get(fn, "arguments"))) != 0 &&
                arg_keys <= opened) {
                fprintf(stderr, "streamed '%s' whole '%s'\n", args[i],
                        json_string_value(json_object_get(fn, "arguments")));
                abort();
            }
        }
    }
    for (int i = 0; i < MAX_CALLS; i++) {
        free(names[i]);
        free(args[i]);
    }
    pd_auto_reader_free(&r);
    json_decref(whole);
    return 0;
}
