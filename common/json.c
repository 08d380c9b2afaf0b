/* common/json.c — jansson helpers. */
#include "common/json.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/utf8.h"

const char *pd_json_type_name(const json_t *v)
{
    if (v == NULL) {
        return "nothing";
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "object";
    case JSON_ARRAY: return "array";
    case JSON_STRING: return "string";
    case JSON_INTEGER: return "integer";
    case JSON_REAL: return "number";
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    }
    return "unknown";
}

pd_status_t pd_json_parse(const char *doc, const char *text, size_t len, json_t **root_out)
{
    json_error_t err;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (root == NULL) {
        pd_log_error("%s:%d:%d: invalid JSON: %s", doc, err.line, err.column, err.text);
        return PD_ERR_PARSE;
    }
    *root_out = root;
    return PD_OK;
}

pd_status_t pd_json_load_file(const char *path, size_t max_bytes, json_t **root_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        pd_log_error("cannot open %s: %s", path, strerror(errno));
        return errno == ENOENT ? PD_ERR_NOT_FOUND : PD_ERR_IO;
    }
    pd_status_t st = PD_OK;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0) {
        pd_log_error("cannot seek %s: %s", path, strerror(errno));
        st = PD_ERR_IO;
        goto out;
    }
    long size = ftell(f);
    if (size < 0 || (size_t)size > max_bytes) {
        pd_log_error("%s is %ld bytes, over the %zu byte limit", path, size, max_bytes);
        st = PD_ERR_NO_SPACE;
        goto out;
    }
    rewind(f);
    buf = malloc((size_t)size + 1);
    if (buf == NULL) {
        pd_log_error("cannot allocate %ld bytes to read %s", size, path);
        st = PD_ERR_NO_MEMORY;
        goto out;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) {
        pd_log_error("short read on %s", path);
        st = PD_ERR_IO;
        goto out;
    }
    st = pd_json_parse(path, buf, (size_t)size, root_out);
out:
    free(buf);
    fclose(f);
    return st;
}

json_t *pd_json_path(const json_t *root, const char *path)
{
    const json_t *cur = root;
    const char *p = path;
    char part[128];
    while (cur != NULL) {
        const char *dot = strchr(p, '.');
        size_t n = dot != NULL ? (size_t)(dot - p) : strlen(p);
        if (n >= sizeof(part) || !json_is_object(cur)) {
            return NULL;
        }
        memcpy(part, p, n);
        part[n] = '\0';
        cur = json_object_get(cur, part);
        if (dot == NULL) {
            return (json_t *)cur;
        }
        p = dot + 1;
    }
    return NULL;
}

static pd_status_t json_wrong(const char *doc, const char *path, const char *want, const json_t *v)
{
    pd_log_error("%s: field '%s': expected %s, got %s", doc, path, want, pd_json_type_name(v));
    return PD_ERR_PARSE;
}

static pd_status_t json_missing(const char *doc, const char *path)
{
    pd_log_error("%s: required field '%s' is missing", doc, path);
    return PD_ERR_NOT_FOUND;
}

pd_status_t pd_json_get_int(const json_t *root, const char *doc, const char *path, int64_t *out)
{
    json_t *v = pd_json_path(root, path);
    if (v == NULL) {
        return json_missing(doc, path);
    }
    if (json_is_real(v)) {
        /* HF configs sometimes write 1e-05 style values for ints; accept integral reals only */
        double d = json_real_value(v);
        if (!(d >= -9.2e18 && d <= 9.2e18) || d != (double)(int64_t)d) { /* range first: the cast is UB */
            return json_wrong(doc, path, "integer", v);
        }
        *out = (int64_t)d;
        return PD_OK;
    }
    if (!json_is_integer(v)) {
        return json_wrong(doc, path, "integer", v);
    }
    *out = json_integer_value(v);
    return PD_OK;
}

pd_status_t pd_json_get_double(const json_t *root, const char *doc, const char *path, double *out)
{
    json_t *v = pd_json_path(root, path);
    if (v == NULL) {
        return json_missing(doc, path);
    }
    if (!json_is_number(v)) {
        return json_wrong(doc, path, "number", v);
    }
    *out = json_number_value(v);
    return PD_OK;
}

pd_status_t pd_json_get_bool(const json_t *root, const char *doc, const char *path, bool *out)
{
    json_t *v = pd_json_path(root, path);
    if (v == NULL) {
        return json_missing(doc, path);
    }
    if (!json_is_boolean(v)) {
        return json_wrong(doc, path, "boolean", v);
    }
    *out = json_is_true(v);
    return PD_OK;
}

pd_status_t pd_json_get_str(const json_t *root, const char *doc, const char *path, const char **out)
{
    json_t *v = pd_json_path(root, path);
    if (v == NULL) {
        return json_missing(doc, path);
    }
    if (!json_is_string(v)) {
        return json_wrong(doc, path, "string", v);
    }
    *out = json_string_value(v);
    return PD_OK;
}

static int json_absent(const json_t *root, const char *path)
{
    json_t *v = pd_json_path(root, path);
    return v == NULL || json_is_null(v);
}

pd_status_t pd_json_opt_int(const json_t *root, const char *doc, const char *path, int64_t def, int64_t *out)
{
    if (json_absent(root, path)) {
        *out = def;
        return PD_OK;
    }
    return pd_json_get_int(root, doc, path, out);
}

pd_status_t pd_json_opt_double(const json_t *root, const char *doc, const char *path, double def, double *out)
{
    if (json_absent(root, path)) {
        *out = def;
        return PD_OK;
    }
    return pd_json_get_double(root, doc, path, out);
}

pd_status_t pd_json_opt_bool(const json_t *root, const char *doc, const char *path, bool def, bool *out)
{
    if (json_absent(root, path)) {
        *out = def;
        return PD_OK;
    }
    return pd_json_get_bool(root, doc, path, out);
}

pd_status_t pd_json_opt_str(const json_t *root, const char *doc, const char *path, const char *def,
                            const char **out)
{
    if (json_absent(root, path)) {
        *out = def;
        return PD_OK;
    }
    return pd_json_get_str(root, doc, path, out);
}

json_t *pd_json_string_lossy(const char *s, size_t len)
{
    char *buf = malloc(len * 3 + 1);
    if (buf == NULL) {
        return json_string("");
    }
    size_t k = 0, i = 0;
    const unsigned char *u = (const unsigned char *)s;
    while (i < len) {
        size_t w = 0;
        if (pd_utf8_scan(u + i, len - i, &w) == 1) {
            memcpy(buf + k, s + i, w);
            k += w;
        } else { /* one U+FFFD per invalid (or truncated) sequence, as Python's errors="replace" */
            memcpy(buf + k, "\xef\xbf\xbd", 3);
            k += 3;
        }
        i += w;
    }
    json_t *j = json_stringn(buf, k); /* NUL bytes survive: "\u0000" */
    free(buf);
    return j != NULL ? j : json_string("");
}

/* ------------------------------------------------------------------ Python's json.dumps */

void pd_py_float_repr(char *out, size_t cap, double f)
{
    if (isnan(f)) {
        snprintf(out, cap, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(out, cap, f < 0 ? "-inf" : "inf");
        return;
    }
    /* shortest digits that round-trip, as Python's repr */
    char buf[40];
    int prec;
    for (prec = 0; prec < 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*e", prec, f);
        if (strtod(buf, NULL) == f) {
            break;
        }
    }
    snprintf(buf, sizeof(buf), "%.*e", prec, f);
    /* buf: [-]d[.ddd]e±XX */
    char digits[24];
    int nd = 0;
    bool neg = buf[0] == '-';
    const char *p = buf + (neg ? 1 : 0);
    for (; *p != 'e'; p++) {
        if (*p >= '0' && *p <= '9') {
            digits[nd++] = *p;
        }
    }
    int e = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') {
        nd--;
    }
    char o[64];
    size_t k = 0;
    if (neg) {
        o[k++] = '-';
    }
    if (e >= -5 + 1 && e < 16) { /* Python's repr: fixed notation for exponents in [-4, 16) */
        if (e < 0) {
            o[k++] = '0';
            o[k++] = '.';
            for (int i = 0; i < -e - 1; i++) {
                o[k++] = '0';
            }
            for (int i = 0; i < nd; i++) {
                o[k++] = digits[i];
            }
        } else {
            for (int i = 0; i <= e; i++) {
                o[k++] = i < nd ? digits[i] : '0';
            }
            o[k++] = '.';
            if (nd > e + 1) {
                for (int i = e + 1; i < nd; i++) {
                    o[k++] = digits[i];
                }
            } else {
                o[k++] = '0';
            }
        }
        o[k] = '\0';
    } else {
        o[k++] = digits[0];
        if (nd > 1) {
            o[k++] = '.';
            for (int i = 1; i < nd; i++) {
                o[k++] = digits[i];
            }
        }
        o[k] = '\0';
        char ex[16];
        snprintf(ex, sizeof(ex), "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
        snprintf(o + k, sizeof(o) - k, "%s", ex);
    }
    snprintf(out, cap, "%s", o);
}

static bool buf_add(char **b, size_t *n, size_t *cap, const char *s, size_t k)
{
    if (*n + k + 1 > *cap) {
        size_t c = (*n + k + 1) * 2;
        char *nb = realloc(*b, c);
        if (nb == NULL) {
            return false;
        }
        *b = nb;
        *cap = c;
    }
    memcpy(*b + *n, s, k);
    *n += k;
    (*b)[*n] = '\0';
    return true;
}

static bool dump_py(const json_t *v, char **b, size_t *n, size_t *cap, int depth)
{
    char num[64];
    if (depth > 2048) {
        return false;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        const char *key;
        json_t *x;
        bool first = true, ok = buf_add(b, n, cap, "{", 1);
        json_object_foreach((json_t *)v, key, x)
        {
            json_t *k = json_string(key);
            ok = ok && k != NULL && (first || buf_add(b, n, cap, ", ", 2)) &&
                 dump_py(k, b, n, cap, depth + 1) && buf_add(b, n, cap, ": ", 2) &&
                 dump_py(x, b, n, cap, depth + 1);
            json_decref(k);
            first = false;
        }
        return ok && buf_add(b, n, cap, "}", 1);
    }
    case JSON_ARRAY: {
        bool ok = buf_add(b, n, cap, "[", 1);
        for (size_t i = 0; ok && i < json_array_size(v); i++) {
            ok = (i == 0 || buf_add(b, n, cap, ", ", 2)) &&
                 dump_py(json_array_get(v, i), b, n, cap, depth + 1);
        }
        return ok && buf_add(b, n, cap, "]", 1);
    }
    case JSON_STRING: { /* ensure_ascii=False: only '"', '\\' and control characters are escaped */
        const char *s = json_string_value(v);
        size_t len = json_string_length(v), run = 0;
        bool ok = buf_add(b, n, cap, "\"", 1);
        for (size_t i = 0; ok && i <= len; i++) {
            unsigned char c = i < len ? (unsigned char)s[i] : 0;
            if (i < len && c >= 0x20 && c != '"' && c != '\\') {
                continue;
            }
            ok = buf_add(b, n, cap, s + run, i - run);
            run = i + 1;
            if (!ok || i == len) {
                break;
            }
            const char *e = c == '"'    ? "\\\""
                            : c == '\\' ? "\\\\"
                            : c == '\n' ? "\\n"
                            : c == '\r' ? "\\r"
                            : c == '\t' ? "\\t"
                            : c == '\b' ? "\\b"
                            : c == '\f' ? "\\f"
                                        : NULL;
            if (e == NULL) {
                snprintf(num, sizeof(num), "\\u%04x", c);
                e = num;
            }
            ok = buf_add(b, n, cap, e, strlen(e));
        }
        return ok && buf_add(b, n, cap, "\"", 1);
    }
    case JSON_INTEGER:
        snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        return buf_add(b, n, cap, num, strlen(num));
    case JSON_REAL: {
        double f = json_real_value(v);
        if (isnan(f) || isinf(f)) { /* Python's allow_nan spellings */
            snprintf(num, sizeof(num), "%s", isnan(f) ? "NaN" : f < 0 ? "-Infinity" : "Infinity");
        } else {
            pd_py_float_repr(num, sizeof(num), f);
        }
        return buf_add(b, n, cap, num, strlen(num));
    }
    case JSON_TRUE: return buf_add(b, n, cap, "true", 4);
    case JSON_FALSE: return buf_add(b, n, cap, "false", 5);
    default: return buf_add(b, n, cap, "null", 4);
    }
}

char *pd_json_dumps_py(const json_t *v)
{
    char *b = NULL;
    size_t n = 0, cap = 0;
    if (v == NULL || !buf_add(&b, &n, &cap, "", 0) || !dump_py(v, &b, &n, &cap, 0)) {
        free(b);
        return NULL;
    }
    return b;
}
