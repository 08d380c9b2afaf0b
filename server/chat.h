/* server/chat.h — a model's chat template and special tokens, and the rendering of an OpenAI chat
 * request's messages into a prompt as vLLM does it (transformers' apply_chat_template semantics,
 * through our own Jinja interpreter in template/). */
#ifndef PD_SERVER_CHAT_H
#define PD_SERVER_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "server/openai.h"

typedef struct pd_chat pd_chat_t;

/* Loads the chat template in vLLM's order: override (--chat-template: a file path, or the template
 * text itself when no such file exists), DIR/chat_template.jinja, then tokenizer_config.json's
 * chat_template (a string, or a list of named templates of which "default" is used). Also reads
 * tokenizer_config.json's special tokens (bos/eos/unk/pad, strings or AddedToken objects). A model
 * without any template loads fine (pd_chat_has_template is false: chat requests get a 400). A
 * template that does not parse is PD_ERR_PARSE, logged with its source, line and column. */
pd_status_t pd_chat_load(const char *model_dir, const char *override, pd_chat_t **chat_out);

void pd_chat_free(pd_chat_t *chat);

bool pd_chat_has_template(const pd_chat_t *chat);

/* Where the template came from ("--chat-template", "chat_template.jinja", "tokenizer_config.json"). */
const char *pd_chat_template_source(const pd_chat_t *chat);

/* The chat-specific fields of a request (borrowed from its JSON). */
typedef struct pd_chat_request {
    const json_t *messages;             /* required: a non-empty list of message objects */
    const json_t *tools;                /* or NULL */
    const json_t *chat_template_kwargs; /* or NULL */
    const json_t *documents;            /* or NULL: a list of objects, the template's `documents` (RAG) */
    const json_t *reasoning_effort;     /* or NULL: "low" | "medium" | "high", the template's variable */
    bool add_generation_prompt;         /* default true */
    bool continue_final_message;        /* default false */
} pd_chat_request_t;

/* The chat fields of request root (chat completions, /tokenize), with the defaults above; the two
 * booleans are taken when they are JSON booleans (the caller validates their types). */
void pd_chat_request_init(pd_chat_request_t *cr, const json_t *root);

/* Validates and normalises the messages as vLLM does (content as a string or as text parts, per the
 * template's content format, but a tool result's text parts joined into a string; tool-call
 * arguments given as JSON strings become objects; an empty tool_calls list dropped; an assistant's
 * `reasoning` or `reasoning_content` given to the template as both), renders
 * the template and, with continue_final_message, cuts the prompt after the final message's text.
 * *prompt_out is malloc'd (the caller frees; it may contain NUL bytes: use *len_out). Returns false
 * with a 400 in err naming the problem: a malformed message, unsupported content parts, no
 * template, a template error (raise_exception, a type error, a limit). */
bool pd_chat_render(const pd_chat_t *chat, const pd_chat_request_t *req, char **prompt_out, size_t *len_out,
                    pd_http_error_t *err);

#endif
