/* template/template.h — a Jinja2 interpreter sized to what Hugging Face chat templates use.
 *
 * Configured as transformers' apply_chat_template configures Jinja2 (ImmutableSandboxedEnvironment,
 * trim_blocks, lstrip_blocks, the loopcontrols extension, a tojson that does not escape HTML or
 * non-ASCII, raise_exception and strftime_now globals), so renders equal the reference byte for byte.
 * Lists and dicts are immutable; only namespace() attributes can be assigned.
 *
 * Bounded: a parse nests at most PD_TEMPLATE_MAX_NEST deep; a render stops with an error past its
 * limits (steps, output bytes, memory, call depth), so a hostile template or message cannot hang or
 * exhaust a node. */
#ifndef PD_TEMPLATE_TEMPLATE_H
#define PD_TEMPLATE_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/status.h"

#define PD_TEMPLATE_MAX_NEST 200

typedef struct pd_template pd_template_t;

/* Where and why a parse or a render failed. line/column are 1-based (0 when not known). */
typedef struct pd_template_error {
    int line, column;
    char message[256];
} pd_template_error_t;

typedef struct pd_template_limits {
    uint64_t max_steps; /* statements + expression nodes + loop iterations evaluated */
    size_t max_output;  /* bytes of rendered text */
    size_t max_memory;  /* bytes of values allocated during the render */
    int max_call_depth; /* nested macro calls */
    time_t now;         /* strftime_now's clock; 0 = time(NULL) */
} pd_template_limits_t;

/* Defaults: 10 M steps, 16 MiB output, 256 MiB of values, 64 nested calls. */
void pd_template_limits_default(pd_template_limits_t *lim);

/* Parses len bytes of template source. PD_ERR_PARSE with err (line, column, reason) on a syntax
 * error; PD_ERR_NO_MEMORY. *tpl_out is set only on PD_OK; free it with pd_template_free. */
pd_status_t pd_template_parse(const char *src, size_t len, pd_template_t **tpl_out, pd_template_error_t *err);

void pd_template_free(pd_template_t *tpl);

/* Renders tpl with the variables of ctx (a JSON object: strings, numbers, booleans, null, arrays,
 * objects become Jinja values). *out_out is malloc'd and NUL-terminated (it may contain NUL bytes:
 * use *len_out); the caller frees it. A template error (raise_exception, a type error, undefined
 * attribute of an undefined value, a limit) is PD_ERR_INVALID_ARG with err naming it; nothing is
 * written to the outputs then. The template is not modified: renders may run concurrently. */
pd_status_t pd_template_render(const pd_template_t *tpl, const json_t *ctx, const pd_template_limits_t *lim,
                               char **out_out, size_t *len_out, pd_template_error_t *err);

/* Whether the template iterates over a message's content (`for x in message['content']`): such a
 * template expects OpenAI-style content part lists; others expect content as a string (vLLM's
 * --chat-template-content-format auto). */
bool pd_template_iterates_content(const pd_template_t *tpl);

#endif
