/* common/json.h — jansson helpers: strict file loading with error positions and typed getters
 * whose errors name the document and the field path ("config.json: field 'rope_scaling.factor':
 * expected number, got string"). Keys may be dotted paths into nested objects. */
#ifndef PD_COMMON_JSON_H
#define PD_COMMON_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"

/* Loads and parses a JSON file of at most max_bytes. Logs "path:line:col: reason" and returns
 * PD_ERR_PARSE on syntax errors, PD_ERR_IO when unreadable, PD_ERR_NO_SPACE when too big.
 * The caller owns *root_out (json_decref). */
pd_status_t pd_json_load_file(const char *path, size_t max_bytes, json_t **root_out);

/* Parses len bytes of JSON text (depth and size limited by jansson's own limits); doc names the
 * text in error messages. The caller owns *root_out. */
pd_status_t pd_json_parse(const char *doc, const char *text, size_t len, json_t **root_out);

/* Looks a dotted path up; returns NULL when any component is missing or not an object. */
json_t *pd_json_path(const json_t *root, const char *path);

/* Required typed getters: PD_ERR_NOT_FOUND when the field is absent, PD_ERR_PARSE when its type
 * (or integer range) is wrong; both logged with doc and path. Outputs are set only on PD_OK. */
pd_status_t pd_json_get_int(const json_t *root, const char *doc, const char *path, int64_t *out);
pd_status_t pd_json_get_double(const json_t *root, const char *doc, const char *path, double *out);
pd_status_t pd_json_get_bool(const json_t *root, const char *doc, const char *path, bool *out);
pd_status_t pd_json_get_str(const json_t *root, const char *doc, const char *path, const char **out);

/* Optional getters: an absent (or JSON null) field yields def and PD_OK; a wrong type is an error. */
pd_status_t pd_json_opt_int(const json_t *root, const char *doc, const char *path, int64_t def, int64_t *out);
pd_status_t pd_json_opt_double(const json_t *root, const char *doc, const char *path, double def,
                               double *out);
pd_status_t pd_json_opt_bool(const json_t *root, const char *doc, const char *path, bool def, bool *out);
pd_status_t pd_json_opt_str(const json_t *root, const char *doc, const char *path, const char *def,
                            const char **out);

/* A UTF-8-valid JSON string of arbitrary bytes: each invalid sequence (its maximal subpart) becomes
 * one U+FFFD, as Python's errors="replace" and so Hugging Face's detokenizers do; NUL bytes are kept
 * (they serialise as \u0000). Never NULL. */
json_t *pd_json_string_lossy(const char *s, size_t len);

/* f as Python's repr() writes it: the shortest digits that read back as f, fixed notation for
 * exponents in [-4, 16), else d.ddde±XX ("0.1", "100.0", "1e+16", "-1.5e-07", "nan", "inf"). */
void pd_py_float_repr(char *out, size_t cap, double f);

/* v as Python's json.dumps(v, ensure_ascii=False) writes it (vLLM's tool-call arguments): ", " and
 * ": " separators, keys in v's order, reals as repr(), strings with only '"', '\\' and control
 * characters escaped (\n, \u001f). malloc'd; NULL when out of memory or nested over 2048 deep. */
char *pd_json_dumps_py(const json_t *v);

/* Name of a JSON value's type for messages ("string", "array", ...). */
const char *pd_json_type_name(const json_t *v);

#endif
