/* server/structured_output.h — a request's structured-output fields, as vLLM and OpenAI name them,
 * compiled to a grammar (grammar/):
 *
 *   response_format      {"type": "text"} (none), {"type": "json_object"} (any JSON object),
 *                        {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
 *   structured_outputs   {"json": schema (object or JSON text)}, {"regex": "..."},
 *                        {"choice": ["...", ...]}, {"grammar": "GBNF"}, {"json_object": true}
 *   guided_json, guided_regex, guided_choice, guided_grammar   (vLLM's older names)
 *
 * At most one may be given. Compiled grammars are cached by their GBNF text (64, LRU), so requests
 * with the same schema share one automaton and its masks. */
#ifndef PD_SERVER_STRUCTURED_OUTPUT_H
#define PD_SERVER_STRUCTURED_OUTPUT_H

#include <jansson.h>
#include <stdbool.h>

#include "common/api_fields.h"
#include "grammar/grammar.h"

/* *out: the request's grammar (a reference for the caller) or NULL when it asks for none. false
 * with err (400 naming the field and why) on a bad or unsupported one. */
bool pd_structured_output_parse(const json_t *root, pd_grammar_t **out, pd_http_error_t *err);

/* Drops the cache's grammars (tests, shutdown). */
void pd_structured_output_cache_clear(void);

#endif
