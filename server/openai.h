/* server/openai.h — OpenAI /v1/completions: request validation into an engine request, and the
 * response, stream-chunk and error JSON (field names as OpenAI and vLLM use them). */
#ifndef PD_SERVER_OPENAI_H
#define PD_SERVER_OPENAI_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/api_fields.h" /* pd_http_error_t */
#include "common/json.h"
#include "engine/engine.h"
#include "model/tokenizer.h"

#define PD_MAX_PROMPTS 64  /* prompts of one batched completion request */
#define PD_MAX_CHOICES 128 /* prompts x n */

typedef struct pd_prompt {
    int32_t *ids; /* malloc'd token ids */
    int32_t len;
    char *text; /* the prompt as given (string prompts), malloc'd, or NULL */
    size_t text_len;
} pd_prompt_t;

/* One choice of a resumed stream (resume_token_ids): the tokens its client had from another node,
 * after which this node goes on, or, finished, the count of a choice whose client had its finish
 * (nothing more is generated for it; its tokens count in usage). */
typedef struct pd_resume_choice {
    int32_t *ids; /* malloc'd, or NULL */
    int32_t num_ids;
    bool finished;
    int32_t finished_tokens;
} pd_resume_choice_t;

typedef struct pd_completion_req {
    pd_prompt_t *prompts; /* [num_prompts]: one for chat, several for batched completions */
    int32_t num_prompts;
    int32_t n; /* choices per prompt */
    bool echo; /* completions: the prompt text starts each choice's text */
    pd_request_params_t params;
    char *stop[PD_MAX_STOP_STRINGS];
    int32_t num_stop;
    bool stream;
    bool include_usage;
    bool return_token_ids;
    int32_t logprobs;           /* -1 = none (null); chat: top_logprobs when logprobs is true */
    bool chat;                  /* a /v1/chat/completions request (chat response shapes) */
    int tool_parser;            /* chat with tools and tool_choice "auto": the server's
                                 * pd_tool_parser_t, which reads tool calls out of the reply; "required"
                                 * or a named function: PD_TOOL_PARSER_REQUIRED / _NAMED; else 0 */
    char *tool_name;            /* a named tool choice's function (malloc'd), else NULL */
    json_t *kv_transfer_params; /* owned reference or NULL */
    struct pd_grammar *grammar; /* structured output (server/structured_output.h): owned reference or NULL */
    pd_resume_choice_t *resume; /* resume_token_ids (pdserve's): per choice (num_prompts x n, index
                                 * order), what its client had from another node; NULL: not resumed */
} pd_completion_req_t;

typedef struct pd_openai_limits {
    const char *const *model_names; /* [num_model_names] the names a request's "model" may give */
    int num_model_names;
    int32_t vocab_size;
    int32_t max_model_len;
    int max_depth;                          /* JSON nesting limit */
    const struct pd_generation_config *gen; /* defaults of omitted sampling fields, or NULL */
    int tool_parser; /* --enable-auto-tool-choice --tool-call-parser: a pd_tool_parser_t, 0 = none */
} pd_openai_limits_t;

/* Parses and validates a /v1/completions body. Returns false with *err filled (status 400/404) on any
 * problem: bad JSON (with position), wrong field types, n != 1, echo, a parameter pdserve does not
 * implement (named), prompt too long, unknown token ids, sampling values out of range, stop token
 * ids outside the vocabulary. On true the caller frees with pd_completion_req_free. */
bool pd_openai_parse_completion(const char *body, size_t len, const pd_tokenizer_t *tok,
                                const pd_openai_limits_t *lim, pd_completion_req_t *out,
                                pd_http_error_t *err);

typedef struct pd_chat pd_chat_t;

/* Parses and validates a /v1/chat/completions body: the same fields as completions where they are
 * shared (max_completion_tokens as max_tokens; logprobs as a boolean with top_logprobs), messages
 * rendered by the model's chat template (tools, add_generation_prompt, continue_final_message,
 * chat_template_kwargs) and tokenized without adding special tokens. max_tokens defaults to the
 * rest of the context. False with err (400/404) on any problem, as pd_openai_parse_completion. */
bool pd_openai_parse_chat(const char *body, size_t len, const pd_tokenizer_t *tok, const pd_chat_t *chat,
                          const pd_openai_limits_t *lim, pd_completion_req_t *out, pd_http_error_t *err);

void pd_completion_req_free(pd_completion_req_t *r);

/* {"error": {...}} for err (caller decrefs). */
json_t *pd_openai_error_json(const pd_http_error_t *err);

#endif
