/* server/tool_calls.h — tool calls parsed out of a chat reply's text, as vLLM's tool parsers read
 * them (--enable-auto-tool-choice --tool-call-parser NAME), for requests with tools and
 * tool_choice "auto":
 *
 *   hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more, after any
 *                text (Hermes 2/3, Qwen 2.5/3); the text before the first is the content
 *   llama3_json  a reply that starts with {"name": ..., "parameters"|"arguments": {...}} (or with
 *                <|python_tag|>), several separated by ";" (Llama 3.1-3.3); no content
 *   mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] after any text (Mistral,
 *                Mistral-Nemo), or the v11 tokenizers' [TOOL_CALLS]name[ARGS]{...} per call; the text
 *                before the first is the content
 *
 * A reply whose calls do not parse is text, as in vLLM. Each call gets an id
 * ("chatcmpl-tool-" + 32 hex digits) and its arguments as a JSON string (json.dumps's spacing, not
 * ASCII-escaped, as vLLM writes them). */
#ifndef PD_SERVER_TOOL_CALLS_H
#define PD_SERVER_TOOL_CALLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum pd_tool_parser {
    PD_TOOL_PARSER_NONE = 0,
    PD_TOOL_PARSER_HERMES,
    PD_TOOL_PARSER_LLAMA3_JSON,
    PD_TOOL_PARSER_MISTRAL,
    /* tool_choice forced, the reply written under a grammar (no server flag needed, as in vLLM):
     * "required": a JSON list of {"name", "parameters"}; a named function: its arguments */
    PD_TOOL_PARSER_REQUIRED,
    PD_TOOL_PARSER_NAMED,
} pd_tool_parser_t;

/* The parser of that name (vLLM's names), or PD_TOOL_PARSER_NONE when there is none. */
pd_tool_parser_t pd_tool_parser_by_name(const char *name);

/* The names this build knows, for --help and errors ("hermes|llama3_json|mistral"). */
const char *pd_tool_parser_names(void);

/* The tool calls in text[len] as an OpenAI tool_calls array (owned by the caller), with
 * *content_len the bytes of text before them (the reply's content); NULL when the text holds no
 * call that parses (then the whole text is content). */
json_t *pd_tool_calls_parse(pd_tool_parser_t p, const char *text, size_t len, size_t *content_len);

/* A JSON value re-dumped as it arrives, as Python's json.dumps writes it (pd_json_dumps_py: ", " and
 * ": ", UTF-8 kept, scalars as their parsed values print, reals as repr), so pieces joined equal the
 * whole value's dump. raw_top: a
 * top-level string is written as its decoded text (call_json keeps arguments given as a string). */
typedef struct pd_json_redump {
    int st, depth;
    char stack[64];
    bool in_str, is_key, esc, raw, raw_top, bad;
    int nhex;         /* digits of a \uXXXX read so far, -1 outside one */
    uint32_t hex, hi; /* its value; a high surrogate waiting for its pair */
    char utf8[4];     /* a decoded character's bytes so far */
    int nutf8;
    char tok[48]; /* a scalar so far */
    int ntok;
} pd_json_redump_t;

void pd_json_redump_init(pd_json_redump_t *d, bool raw_top_string);

/* Where re-dumped bytes go: s[n] (NUL-terminated, malloc'd, grown); failed when out of memory. */
typedef struct pd_redump_out {
    char *s;
    size_t n, cap;
    bool failed;
} pd_redump_out_t;

/* Reads s[n] until the value ends; the bytes read (a scalar's end is the byte after it, not read).
 * out: where its dump goes, or NULL (the value is only followed). d->bad when it is not JSON. */
size_t pd_json_redump_feed(pd_json_redump_t *d, const char *s, size_t n, pd_redump_out_t *out);
bool pd_json_redump_done(const pd_json_redump_t *d);

/* tool_choice "required": where a reader stands in the reply, the list [{"name": ..., "parameters":
 * ...}, ...] its grammar writes (zeroed to start). */
typedef struct pd_required_reader {
    size_t pos; /* bytes read */
    int state;
    bool esc;
    size_t name_from;    /* where the name's string began */
    int32_t calls;       /* calls opened so far */
    pd_json_redump_t rd; /* the parameters value, re-dumped as it is read */
} pd_required_reader_t;

/* The tool_calls deltas that text[r->pos, len) completes: a call opens ({"index", "id", "type",
 * "function": {"name", "arguments": ""}}) once its name is read, and its arguments (the "parameters"
 * value re-dumped as vLLM's json.dumps writes them: ", " and ": ", UTF-8 kept) grow as it is read;
 * NULL when there are none. The whole reply's calls are
 * these deltas joined (pd_tool_calls_parse), so a stream and its whole answer agree. */
json_t *pd_tool_calls_required_read(pd_required_reader_t *r, const char *text, size_t len);

/* The one call of a named tool choice: name, and the reply text as its arguments (as vLLM). */
json_t *pd_tool_calls_named(const char *name, const char *text, size_t len);

/* Streaming: how many leading bytes of text[len] are content for sure — the rest may be (the start
 * of) a tool call, held back until more text or the end decides. text[0, from) is what an earlier
 * call returned (only the text after it is looked at: a stream costs one pass, not one per token). */
size_t pd_tool_calls_safe_prefix(pd_tool_parser_t p, const char *text, size_t len, size_t from);

/* A fresh tool-call id: "chatcmpl-tool-" and 32 hex digits. */
void pd_tool_call_id(char id[64]);

/* ------------------------------------------------------------------ tool_choice "auto", streamed
 * (tool_stream.c) */

#define PD_AUTO_MAX_CALLS 64

/* Where a streamed reply's calls stand (zeroed to start; pd_auto_reader_free at the end). */
typedef struct pd_auto_reader {
    size_t pos; /* bytes read */
    int state;
    bool marker_read, in_list, named, in_args, v11, v11_form, esc;
    int key;           /* the key being read: 1 name, 2 arguments/parameters, 0 another */
    size_t key_from;   /* where a key, a name or a v11 name began */
    size_t marker_end; /* where the text after the last call marker begins */
    pd_json_redump_t rd;
    int32_t calls; /* calls opened */
    char *names[PD_AUTO_MAX_CALLS], *args[PD_AUTO_MAX_CALLS];
    size_t args_len[PD_AUTO_MAX_CALLS];
} pd_auto_reader_t;

/* The tool_calls deltas that text[r->pos, len) completes (parser p: hermes, llama3_json, mistral): a
 * call opens once its name is read, its arguments grow as written (re-dumped); NULL when none. */
json_t *pd_tool_calls_auto_read(pd_tool_parser_t p, pd_auto_reader_t *r, const char *text, size_t len);

/* At the reply's end, the deltas that bring what was streamed to the whole reply's calls
 * (pd_tool_calls_parse): the rest of each call's arguments, the calls not opened yet; NULL: none. */
json_t *pd_tool_calls_auto_finish(pd_auto_reader_t *r, const json_t *calls);

void pd_auto_reader_free(pd_auto_reader_t *r);

#endif
