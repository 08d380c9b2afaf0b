/* server/structured_output.c — see structured_output.h. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/array.h"
#include "common/hash.h"
#include "server/structured_output.h"

#define SO_CACHE 64

static struct {
    pthread_mutex_t mu;
    struct {
        uint64_t hash;
        char *text;
        pd_grammar_t *g;
        uint64_t used;
    } e[SO_CACHE];
    uint64_t tick;
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The grammar of GBNF text, from the cache or compiled (then cached). */
static pd_grammar_t *compile(const char *field, const char *text, pd_http_error_t *err)
{
    size_t len = strlen(text);
    uint64_t h = pd_hash64(text, len, 0);
    pthread_mutex_lock(&cache.mu);
    for (int i = 0; i < SO_CACHE; i++) {
        if (cache.e[i].g != NULL && cache.e[i].hash == h && strcmp(cache.e[i].text, text) == 0) {
            cache.e[i].used = ++cache.tick;
            pd_grammar_t *g = pd_grammar_ref(cache.e[i].g);
            pthread_mutex_unlock(&cache.mu);
            return g;
        }
    }
    pthread_mutex_unlock(&cache.mu);
    char msg[300];
    pd_grammar_t *g = NULL;
    if (pd_grammar_from_gbnf(text, len, &g, msg, sizeof(msg)) != PD_OK) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s: %s", field, msg);
        return NULL;
    }
    char *copy = strdup(text);
    if (copy == NULL) {
        return g; /* uncached */
    }
    pthread_mutex_lock(&cache.mu);
    int v = 0;
    for (int i = 1; i < SO_CACHE; i++) {
        v = cache.e[i].used < cache.e[v].used ? i : v;
    }
    pd_grammar_unref(cache.e[v].g);
    free(cache.e[v].text);
    cache.e[v].hash = h;
    cache.e[v].text = copy;
    cache.e[v].g = pd_grammar_ref(g);
    cache.e[v].used = ++cache.tick;
    pthread_mutex_unlock(&cache.mu);
    return g;
}

void pd_structured_output_cache_clear(void)
{
    pthread_mutex_lock(&cache.mu);
    for (int i = 0; i < SO_CACHE; i++) {
        pd_grammar_unref(cache.e[i].g);
        free(cache.e[i].text);
        memset(&cache.e[i], 0, sizeof(cache.e[i]));
    }
    pthread_mutex_unlock(&cache.mu);
}

/* GBNF of a schema given as an object or as JSON text. */
static char *schema_gbnf(const char *field, const json_t *v, pd_http_error_t *err)
{
    json_t *parsed = NULL;
    if (json_is_string(v)) {
        json_error_t je;
        parsed = json_loads(json_string_value(v), JSON_REJECT_DUPLICATES, &je);
        if (parsed == NULL) {
            pd_http_error_set(err, 400, "BadRequestError", field, "%s is not valid JSON: %s", field, je.text);
            return NULL;
        }
        v = parsed;
    }
    if (!json_is_object(v) && !json_is_true(v)) {
        json_decref(parsed);
        pd_http_error_set(err, 400, "BadRequestError", field, "%s must be a JSON Schema object", field);
        return NULL;
    }
    char msg[300];
    char *gb = pd_json_schema_to_gbnf(v, msg, sizeof(msg));
    json_decref(parsed);
    if (gb == NULL) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s: %s", field, msg);
    }
    return gb;
}

static char *regex_gbnf(const char *field, const json_t *v, pd_http_error_t *err)
{
    if (!json_is_string(v)) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s must be a string", field);
        return NULL;
    }
    char msg[300];
    char *gb = pd_regex_to_gbnf(json_string_value(v), json_string_length(v), msg, sizeof(msg));
    if (gb == NULL) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s: %s", field, msg);
    }
    return gb;
}

static char *choice_gbnf(const char *field, const json_t *v, pd_http_error_t *err)
{
    if (!json_is_array(v) || json_array_size(v) == 0) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s must be a non-empty list of strings",
                          field);
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    bool ok = pd_array_reserve(&buf, &cap, 16) == PD_OK;
    if (ok) {
        strcpy(buf, "root ::= ");
        len = 9;
    }
    for (size_t i = 0; ok && i < json_array_size(v); i++) {
        const json_t *c = json_array_get(v, i);
        if (!json_is_string(c)) {
            free(buf);
            pd_http_error_set(err, 400, "BadRequestError", field, "%s must be a non-empty list of strings",
                              field);
            return NULL;
        }
        if (i > 0 && (ok = pd_array_reserve(&buf, &cap, len + 4) == PD_OK)) {
            memcpy(buf + len, " | ", 4);
            len += 3;
        }
        ok = ok && pd_gbnf_append_literal(&buf, &len, &cap, json_string_value(c), json_string_length(c));
    }
    if (!ok) {
        free(buf);
        pd_http_error_set(err, 500, "InternalServerError", field, "out of memory");
        return NULL;
    }
    return buf;
}

static char *grammar_text(const char *field, const json_t *v, pd_http_error_t *err)
{
    if (!json_is_string(v) || json_string_length(v) == 0) {
        pd_http_error_set(err, 400, "BadRequestError", field, "%s must be a GBNF grammar (a string)", field);
        return NULL;
    }
    char *s = strdup(json_string_value(v));
    if (s == NULL) {
        pd_http_error_set(err, 500, "InternalServerError", field, "out of memory");
    }
    return s;
}

typedef char *(*to_gbnf_fn)(const char *field, const json_t *v, pd_http_error_t *err);

bool pd_structured_output_parse(const json_t *root, pd_grammar_t **out, pd_http_error_t *err)
{
    *out = NULL;
    const char *field = NULL;
    const json_t *spec = NULL;
    to_gbnf_fn fn = NULL;
    int given = 0;
    static const struct {
        const char *name;
        to_gbnf_fn fn;
    } guided[] = {{"guided_json", schema_gbnf},
                  {"guided_regex", regex_gbnf},
                  {"guided_choice", choice_gbnf},
                  {"guided_grammar", grammar_text}};
    for (size_t i = 0; i < sizeof(guided) / sizeof(guided[0]); i++) {
        const json_t *v = json_object_get(root, guided[i].name);
        if (v != NULL && !json_is_null(v)) {
            field = guided[i].name, spec = v, fn = guided[i].fn;
            given++;
        }
    }
    const json_t *so = json_object_get(root, "structured_outputs");
    if (so != NULL && !json_is_null(so)) {
        if (!json_is_object(so)) {
            return pd_http_error_set(err, 400, "BadRequestError", "structured_outputs",
                                     "structured_outputs must be an object");
        }
        static const struct {
            const char *name;
            to_gbnf_fn fn;
        } keys[] = {
            {"json", schema_gbnf}, {"regex", regex_gbnf}, {"choice", choice_gbnf}, {"grammar", grammar_text}};
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)so, k, v)
        {
            if (json_is_null(v) || json_is_false(v)) {
                continue;
            }
            bool known = false;
            for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
                if (strcmp(k, keys[i].name) == 0) {
                    field = keys[i].name, spec = v, fn = keys[i].fn;
                    known = true;
                    given++;
                }
            }
            if (strcmp(k, "json_object") == 0 && json_is_true(v)) {
                field = "json_object", spec = NULL, fn = schema_gbnf;
                known = true;
                given++;
            }
            if (!known) {
                return pd_http_error_set(err, 400, "BadRequestError", "structured_outputs",
                                         "structured_outputs.%s is not supported by pdserve (json, regex, "
                                         "choice, grammar and json_object are)",
                                         k);
            }
        }
    }
    const json_t *rf = json_object_get(root, "response_format");
    if (rf != NULL && !json_is_null(rf)) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (t == NULL || !json_is_object(rf)) {
            return pd_http_error_set(err, 400, "BadRequestError", "response_format",
                                     "response_format must be an object with a \"type\"");
        }
        if (strcmp(t, "json_object") == 0) {
            field = "response_format", spec = NULL, fn = schema_gbnf;
            given++;
        } else if (strcmp(t, "json_schema") == 0) {
            const json_t *js = json_object_get(rf, "json_schema");
            const json_t *s = json_object_get(js, "schema");
            if (!json_is_object(js) || s == NULL) {
                return pd_http_error_set(err, 400, "BadRequestError", "response_format",
                                         "response_format json_schema needs \"json_schema\": {\"name\": ..., "
                                         "\"schema\": {...}}");
            }
            field = "response_format", spec = s, fn = schema_gbnf;
            given++;
        } else if (strcmp(t, "text") != 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "response_format",
                                     "response_format type '%s' is not supported (text, json_object and "
                                     "json_schema are)",
                                     t);
        }
    }
    if (given == 0) {
        return true;
    }
    if (given > 1) {
        return pd_http_error_set(err, 400, "BadRequestError", field,
                                 "give one structured output (response_format, structured_outputs or a "
                                 "guided_* field), not %d",
                                 given);
    }
    char *text = NULL;
    if (spec == NULL) { /* any JSON object */
        char msg[200];
        text = pd_json_schema_to_gbnf(NULL, msg, sizeof(msg));
        if (text == NULL) {
            return pd_http_error_set(err, 500, "InternalServerError", field, "%s", msg);
        }
    } else if ((text = fn(field, spec, err)) == NULL) {
        return false;
    }
    *out = compile(field, text, err);
    free(text);
    return *out != NULL;
}
