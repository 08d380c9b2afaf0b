/* grammar/regex.h — regular expressions as GBNF expressions (regex.c), for the JSON Schema compiler. */
#ifndef PD_GRAMMAR_REGEX_H
#define PD_GRAMMAR_REGEX_H

#include <stdbool.h>
#include <stddef.h>

/* A parenthesised GBNF expression matching re in full, malloc'd; NULL with err. json_string: the
 * expression matches the JSON-escaped text of such a string (a schema's `pattern`). */
char *pd_regex_to_gbnf_expr(const char *re, size_t len, bool json_string, char *err, size_t err_len);

#endif
