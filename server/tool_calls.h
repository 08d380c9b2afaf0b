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

/* tool_choice "required": where a reader stands in the reply, the list [{"name": ..., "parameters":
 * ...}, ...] its grammar writes (zeroed to start). */
typedef struct pd_required_reader {
    size_t pos; /* bytes read */
    int state;
    int depth; /* brackets open inside the parameters value */
    bool in_str, esc, scalar;
    size_t name_from; /* where the name's string began */
    int32_t calls;    /* calls opened so far */
} pd_required_reader_t;

/* The tool_calls deltas that text[r->pos, len) completes: a call opens ({"index", "id", "type",
 * "function": {"name", "arguments": ""}}) once its name is read, and its arguments (the "parameters"
 * value as written) grow by the bytes read; NULL when there are none. The whole reply's calls are
 * these deltas joined (pd_tool_calls_parse), so a stream and its whole answer agree. */
json_t *pd_tool_calls_required_read(pd_required_reader_t *r, const char *text, size_t len);

/* The one call of a named tool choice: name, and the reply text as its arguments (as vLLM). */
json_t *pd_tool_calls_named(const char *name, const char *text, size_t len);

/* Streaming: how many leading bytes of text[len] are content for sure — the rest may be (the start
 * of) a tool call, held back until more text or the end decides. text[0, from) is what an earlier
 * call returned (only the text after it is looked at: a stream costs one pass, not one per token). */
size_t pd_tool_calls_safe_prefix(pd_tool_parser_t p, const char *text, size_t len, size_t from);

#endif
