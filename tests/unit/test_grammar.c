/* tests/unit/test_grammar.c — the constrained-decoding engine (grammar/) against references:
 * Python's re.fullmatch for regular expressions, python3-jsonschema for JSON Schemas (random
 * generations through the token masks must validate), and a token-by-token check of every mask. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "grammar/grammar.h"
#include "test_util.h"

static pd_grammar_t *compile(const char *gbnf)
{
    char err[256];
    pd_grammar_t *g = NULL;
    pd_status_t st = pd_grammar_from_gbnf(gbnf, strlen(gbnf), &g, err, sizeof(err));
    ck_assert_msg(st == PD_OK, "compile failed: %s\n%s", err, gbnf);
    return g;
}

/* Whether the grammar matches s in full. */
static bool matches(pd_grammar_t *g, const char *s, size_t n)
{
    pd_gmatcher_t m;
    ck_assert_int_eq(pd_gmatcher_init(&m, g), PD_OK);
    bool ok = pd_gmatcher_accept(&m, (const uint8_t *)s, n) && pd_gmatcher_can_end(&m);
    pd_gmatcher_destroy(&m);
    return ok;
}

#define MATCH(g, s) matches(g, s, strlen(s))

START_TEST(test_gbnf_matches)
{
    pd_grammar_t *g = compile("root ::= greeting \" \" name (\"!\" | \"?\")?\n"
                              "greeting ::= \"hello\" | \"hi\"\n"
                              "name ::= [a-z]+ # a comment\n");
    ck_assert(MATCH(g, "hello world"));
    ck_assert(MATCH(g, "hi bob!"));
    ck_assert(!MATCH(g, "hi bob!!"));
    ck_assert(!MATCH(g, "hey bob"));
    ck_assert(!MATCH(g, "hello "));
    pd_grammar_unref(g);
    g = compile("root ::= \"a\"{2,3} \"b\"{2} \"c\"{1,} \"d\"{0,1}\n");
    ck_assert(MATCH(g, "aabbc"));
    ck_assert(MATCH(g, "aaabbcccd"));
    ck_assert(!MATCH(g, "abbc"));
    ck_assert(!MATCH(g, "aaaabbc"));
    ck_assert(!MATCH(g, "aabbbc"));
    pd_grammar_unref(g);
    /* a rule over lines, leading `|`, nested groups, an empty alternative */
    g = compile("root ::= (\n  \"x\" (\"y\" | \"\")\n)*\n  | \"z\"\n");
    ck_assert(MATCH(g, ""));
    ck_assert(MATCH(g, "xyxx"));
    ck_assert(MATCH(g, "z"));
    ck_assert(!MATCH(g, "zx"));
    pd_grammar_unref(g);
    /* code points: negation, ranges beyond ASCII, escapes */
    g = compile("root ::= [^a\\n] [α-ω] \"\\u00e9\\x41\" .\n");
    ck_assert(MATCH(g, "bβéA😀"));
    ck_assert(MATCH(g, "日ωéAx"));
    ck_assert(!MATCH(g, "aβéAx"));
    ck_assert(!MATCH(g, "bbéAx"));
    ck_assert(!MATCH(g, "b\xce\xb2\xc3\xa9"
                        "A\xed\xa0\x80")); /* a UTF-8 surrogate is no character */
    pd_grammar_unref(g);
}
END_TEST

START_TEST(test_gbnf_errors)
{
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"\n", "left-recursive"},
        {"root ::= a\na ::= b? a \"x\"\nb ::= \"y\"\n", "left-recursive"},
        {"root ::= missing\n", "'missing' is used but not defined"},
        {"start ::= \"x\"\n", "no 'root' rule"},
        {"root ::= \"x\"\nroot ::= \"y\"\n", "defined twice"},
        {"root ::= \"\\q\"\n", "unknown escape"},
        {"root ::= [b-a]\n", "end before its start"},
        {"root ::= \"x\"{3,2}\n", "max below min"},
        {"root ::= (\"x\"\n", "expected ')'"},
        {"root ::= \"unterminated\n", "unterminated"},
        {"root ::= \"x\"{99999}\n", "over 10000"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char err[256];
        pd_grammar_t *g = (pd_grammar_t *)1;
        pd_status_t st = pd_grammar_from_gbnf(cases[i].src, strlen(cases[i].src), &g, err, sizeof(err));
        ck_assert_msg(st != PD_OK && g == NULL, "case %zu compiled", i);
        ck_assert_msg(strstr(err, cases[i].want) != NULL, "case %zu: '%s' lacks '%s'", i, err, cases[i].want);
    }
}
END_TEST

/* ------------------------------------------------------------------ regex against Python */

START_TEST(test_regex_against_python)
{
    static const char *pats[] = {
        "[a-z]+@[a-z]+\\.(com|org)",
        "\\d{3}-\\d{4}",
        "(ab|cd)*e?",
        "[^0-9\\s]{2,4}",
        "a.c",
        "\\w+(?:\\s\\w+)*",
        "(?P<year>\\d{4})-(?P<m>\\d\\d)",
        "x{2,}y{,}z{a}w{,2}",
        "[\\]\\-a]+",
        "^colou?r$",
        "\\x41\\u00e9+",
        "[\\D]+",
        "|a",
        "(a|b|)c",
        "é[à-ü]*",
    };
    static const char *strs[] = {"",       "bob@mail.com", "bob@mail.net", "123-4567", "12-4567", "ababe",
                                 "cde",    "abab",         "xy",           "xyz",      "ab ",     "abc",
                                 "a\nc",   "hello world",  "hello  world", "2024-05",  "2024-5",  "xx",
                                 "xxy{,}", "]-a",          "color",        "colour",   "Aéé",     "A",
                                 "é",      "éàü",          "éa",           "a",        "c",       "ac",
                                 "x{,}",   "xxyz{a}w",     "abcd",         "-",        "--",      "!!"};
    size_t np = sizeof(pats) / sizeof(pats[0]), ns = sizeof(strs) / sizeof(strs[0]);
    char *dir = tu_mkdtemp("grammar-re");
    char path[512];
    snprintf(path, sizeof(path), "%s/cases.json", dir);
    json_t *cases = json_array();
    for (size_t i = 0; i < np; i++) {
        char err[256];
        char *gb = pd_regex_to_gbnf(pats[i], strlen(pats[i]), err, sizeof(err));
        ck_assert_msg(gb != NULL, "%s: %s", pats[i], err);
        pd_grammar_t *g = compile(gb);
        free(gb);
        json_t *ours = json_array();
        for (size_t k = 0; k < ns; k++) {
            json_array_append_new(ours, json_boolean(MATCH(g, strs[k])));
        }
        pd_grammar_unref(g);
        json_array_append_new(cases, json_pack("{s:s, s:o}", "pattern", pats[i], "ours", ours));
    }
    json_t *doc = json_pack("{s:o, s:o}", "cases", cases, "strings", json_array());
    for (size_t k = 0; k < ns; k++) {
        json_array_append_new(json_object_get(doc, "strings"), json_string(strs[k]));
    }
    ck_assert_int_eq(json_dump_file(doc, path, 0), 0);
    json_decref(doc);
    int rc =
        tu_run(60, "/usr/bin/python3 %s/tests/reference/grammar_check.py regex %s", tu_source_dir(), path);
    ck_assert_msg(rc == 0, "regex matches differ from Python's re.fullmatch");
    static const char *bad[][2] = {{"(a", "missing ')'"},    {"a)", "unmatched ')'"},
                                   {"(?=a)", "lookarounds"}, {"(a)\\1", "backreferences"},
                                   {"\\bfoo", "anchor"},     {"a**", "quantifier after a quantifier"},
                                   {"[z-a]", "bad range"},   {"a$b", "inside the pattern"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[256];
        char *gb = pd_regex_to_gbnf(bad[i][0], strlen(bad[i][0]), err, sizeof(err));
        ck_assert_msg(gb == NULL && strstr(err, bad[i][1]) != NULL, "%s: %s", bad[i][0], gb ? gb : err);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ------------------------------------------------------------------ JSON Schema, generated and validated */

/* A vocabulary of every byte as a token plus multi-byte tokens (JSON fragments, words, UTF-8), so
 * walks cross token boundaries everywhere; the last id is the end token. */
typedef struct test_vocab {
    pd_gvocab_t *v;
    int32_t n, end_id;
    char **tok;
    uint32_t *len;
} test_vocab_t;

static void vocab_make(test_vocab_t *tv)
{
    static const char *multi[] = {"{\"",   "\":",   "\",",     "\"}",  "true", "false",    "null", "\": \"",
                                  "[{",    "}]",    "12",      "-3",   ".5",   "e+",       "name", "age",
                                  "\\n",   "\\u00", "é",       "日本", "\xe6", "\xe6\x97", ", ",   "\n  ",
                                  "  ",    "ab",    "abc",     "0",    "00",   "2024-",    "T1",   ":0",
                                  "\"a\"", "\"b\"", "\"red\"", "{}",   "[]",   "]]",       "\\\""};
    size_t nm = sizeof(multi) / sizeof(multi[0]);
    tv->n = 256 + (int32_t)nm + 1;
    tv->tok = calloc((size_t)tv->n, sizeof(char *));
    tv->len = calloc((size_t)tv->n, sizeof(uint32_t));
    bool *excl = calloc((size_t)tv->n, 1);
    for (int i = 0; i < 256; i++) {
        tv->tok[i] = malloc(1);
        tv->tok[i][0] = (char)i;
        tv->len[i] = 1;
    }
    for (size_t i = 0; i < nm; i++) {
        tv->tok[256 + i] = strdup(multi[i]);
        tv->len[256 + i] = (uint32_t)strlen(multi[i]);
    }
    tv->end_id = tv->n - 1;
    tv->tok[tv->end_id] = strdup("</s>");
    tv->len[tv->end_id] = 4;
    excl[tv->end_id] = true; /* a special token: allowed only as the end */
    ck_assert_int_eq(pd_gvocab_create(tv->n, (const uint8_t *const *)tv->tok, tv->len, excl, &tv->v), PD_OK);
    free(excl);
}

static void vocab_free(test_vocab_t *tv)
{
    for (int32_t i = 0; i < tv->n; i++) {
        free(tv->tok[i]);
    }
    free(tv->tok);
    free(tv->len);
    pd_gvocab_free(tv->v);
}

/* Checks mask against each token's bytes accepted from m one by one. */
static void check_mask(pd_gmatcher_t *m, const test_vocab_t *tv, const uint32_t *mask)
{
    for (int32_t t = 0; t < tv->n; t++) {
        bool want;
        if (t == tv->end_id) {
            want = pd_gmatcher_can_end(m);
        } else {
            pd_gmatcher_t c = *m;
            want = pd_gmatcher_accept(&c, (const uint8_t *)tv->tok[t], tv->len[t]);
        }
        bool got = (mask[t >> 5] >> (t & 31)) & 1;
        ck_assert_msg(got == want, "token %d ('%.*s'): mask %d, bytes %d", t, (int)tv->len[t], tv->tok[t],
                      got, want);
    }
}

/* A random generation through the masks (uniform over allowed tokens, the end with probability
 * 1/4 when allowed); its text, or NULL when it did not end within max bytes. */
static char *walk(pd_grammar_t *g, const test_vocab_t *tv, pd_rng_t *rng, size_t max, bool check)
{
    pd_gmatcher_t m;
    ck_assert_int_eq(pd_gmatcher_init(&m, g), PD_OK);
    uint32_t *mask = malloc((size_t)(tv->n + 31) / 32 * 4);
    int32_t *allowed = malloc((size_t)tv->n * sizeof(int32_t));
    char *out = malloc(max + 64);
    size_t len = 0;
    bool ended = false;
    while (len < max) {
        ck_assert_int_eq(pd_gmatcher_fill_mask(&m, tv->v, &tv->end_id, 1, mask), PD_OK);
        if (check) {
            check_mask(&m, tv, mask);
        }
        int32_t n = 0;
        for (int32_t t = 0; t < tv->n; t++) {
            if ((mask[t >> 5] >> (t & 31)) & 1) {
                allowed[n++] = t;
            }
        }
        ck_assert_msg(n > 0, "an empty mask after '%.*s'", (int)len, out);
        bool can_end = pd_gmatcher_can_end(&m);
        if (can_end && (n == 1 || pd_rng_uniform(rng) < 0.25)) {
            ended = true;
            break;
        }
        int32_t t;
        do {
            t = allowed[(int32_t)(pd_rng_uniform(rng) * n) % n];
        } while (t == tv->end_id);
        ck_assert(pd_gmatcher_accept(&m, (const uint8_t *)tv->tok[t], tv->len[t]));
        memcpy(out + len, tv->tok[t], tv->len[t]);
        len += tv->len[t];
    }
    out[len] = '\0';
    free(mask);
    free(allowed);
    pd_gmatcher_destroy(&m);
    if (!ended) {
        free(out);
        return NULL;
    }
    return out;
}

/* Schemas in the shapes of the JSON Schema Test Suite's, bounded so random walks end. */
static const char *SCHEMAS[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150}},\"required\":[\"name\",\"age\"],"
    "\"additionalProperties\":false}",
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"},\"b\":{\"type\":\"null\"},"
    "\"c\":{\"enum\":[\"red\",\"green\",1,null]}},\"additionalProperties\":false}",
    "{\"type\":\"array\",\"items\":{\"type\":\"integer\",\"minimum\":-20,\"exclusiveMaximum\":7},"
    "\"minItems\":1,\"maxItems\":4}",
    "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":3},{\"type\":\"number\"},{\"const\":{\"k\":[1,2]}}]}",
    "{\"type\":[\"string\",\"null\"],\"minLength\":2,\"maxLength\":5}",
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":9},\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},"
    "\"required\":[\"v\",\"next\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
    "{\"type\":\"object\",\"properties\":{\"d\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"t\":{\"type\":\"string\",\"format\":\"date-time\"},\"u\":{\"type\":\"string\",\"format\":\"uuid\"},"
    "\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"}},\"required\":[\"d\",\"t\",\"u\",\"ip\"],"
    "\"additionalProperties\":false}",
    "{\"type\":\"object\",\"properties\":{\"code\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3}$\"},"
    "\"q\":{\"type\":\"string\",\"pattern\":\"^(\\\"|x)+$\"}},\"required\":[\"code\",\"q\"],"
    "\"additionalProperties\":false}",
    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\",\"minimum\":100,\"maximum\":12345},"
    "{\"type\":\"string\",\"maxLength\":2},{\"type\":\"boolean\"}],\"items\":false}",
    "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\",\"maximum\":-5}},"
    "\"additionalProperties\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":3}}",
    "{\"type\":\"object\",\"maxProperties\":3}",
    "{\"type\":\"object\",\"properties\":{\"opt1\":{\"type\":\"integer\",\"minimum\":10},"
    "\"req\":{\"type\":\"string\",\"maxLength\":1},\"opt2\":{\"type\":\"array\",\"maxItems\":2,"
    "\"items\":{\"type\":\"number\"}}},\"required\":[\"req\"],\"additionalProperties\":false}",
    "{}",
};

START_TEST(test_schema_generations_validate)
{
    if (system("/usr/bin/python3 -c 'import jsonschema' >/dev/null 2>&1") != 0) {
        ck_assert_msg(getenv("CI") == NULL,
                      "python3-jsonschema is required (tools/install-deps.sh installs it)");
        fprintf(stderr, "SKIP %s: python3-jsonschema is missing\n", __func__);
        return;
    }
    test_vocab_t tv;
    vocab_make(&tv);
    pd_rng_t rng;
    pd_rng_seed(&rng, 1234);
    char *dir = tu_mkdtemp("grammar-js");
    char path[512];
    snprintf(path, sizeof(path), "%s/gen.json", dir);
    json_t *doc = json_array();
    int total = 0, unfinished = 0, refused = 0;
    for (size_t i = 0; i < sizeof(SCHEMAS) / sizeof(SCHEMAS[0]); i++) {
        json_t *schema = json_loads(SCHEMAS[i], 0, NULL);
        ck_assert_msg(schema != NULL, "schema %zu", i);
        char err[256];
        char *gb = pd_json_schema_to_gbnf(schema, err, sizeof(err));
        if (strstr(SCHEMAS[i], "maxProperties") != NULL) { /* unsupported keywords are refused by name */
            ck_assert_msg(gb == NULL && strstr(err, "maxProperties") != NULL, "schema %zu: %s", i, err);
            refused++;
            json_decref(schema);
            continue;
        }
        ck_assert_msg(gb != NULL, "schema %zu: %s", i, err);
        pd_grammar_t *g = compile(gb);
        json_t *outs = json_array();
        for (int k = 0; k < 40; k++) {
            char *s = walk(g, &tv, &rng, 4000, k < 2);
            total++;
            if (s == NULL) {
                unfinished++;
                continue;
            }
            json_array_append_new(outs, json_string(s));
            free(s);
        }
        pd_grammar_unref(g);
        free(gb);
        json_array_append_new(doc, json_pack("{s:o, s:o}", "schema", schema, "outputs", outs));
    }
    ck_assert_int_eq(refused, 1);
    ck_assert_msg(unfinished * 10 < total, "%d of %d walks did not end", unfinished, total);
    ck_assert_int_eq(json_dump_file(doc, path, 0), 0);
    json_decref(doc);
    int rc =
        tu_run(120, "/usr/bin/python3 %s/tests/reference/grammar_check.py schema %s", tu_source_dir(), path);
    ck_assert_msg(rc == 0, "generations under JSON Schemas do not validate (python3-jsonschema)");
    tu_rmrf(dir);
    free(dir);
    vocab_free(&tv);
}
END_TEST

START_TEST(test_schema_refusals)
{
    static const char *bad[][2] = {
        {"{\"type\":\"object\",\"patternProperties\":{}}", "patternProperties"},
        {"{\"type\":\"number\",\"minimum\":1}", "bounds on a \"number\""},
        {"{\"type\":\"string\",\"format\":\"email\"}", "format 'email'"},
        {"{\"$ref\":\"http://x/y\"}", "only local references"},
        {"{\"$ref\":\"#/$defs/none\"}", "points at nothing"},
        {"{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "hold no value"},
        {"{\"type\":\"strin\"}", "unknown type"},
        {"{\"allOf\":[{},{}]}", "one schema only"},
        {"{\"type\":\"string\",\"pattern\":\"a+\"}", "matched in full"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", "uniqueItems"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        json_t *s = json_loads(bad[i][0], 0, NULL);
        char err[256];
        char *gb = pd_json_schema_to_gbnf(s, err, sizeof(err));
        ck_assert_msg(gb == NULL && strstr(err, bad[i][1]) != NULL, "%s: %s", bad[i][0], gb ? gb : err);
        json_decref(s);
    }
}
END_TEST

/* Masks match the token-by-token check at every step of walks through a JSON grammar and a
 * choice-like grammar; states repeat, so most masks come from the cache. */
START_TEST(test_masks_exact)
{
    test_vocab_t tv;
    vocab_make(&tv);
    pd_rng_t rng;
    pd_rng_seed(&rng, 7);
    char err[256];
    char *gb = pd_json_schema_to_gbnf(NULL, err, sizeof(err));
    ck_assert(gb != NULL);
    pd_grammar_t *g = compile(gb);
    free(gb);
    for (int k = 0; k < 20; k++) {
        free(walk(g, &tv, &rng, 300, true));
    }
    pd_grammar_stats_t st;
    pd_grammar_get_stats(g, &st);
    ck_assert(st.masks_cached > 0 && st.masks_computed > 0);
    pd_grammar_unref(g);
    g = compile("root ::= \"abc\" | \"ab\" | \"日本\" | \"true\" \"\"\n");
    for (int k = 0; k < 10; k++) {
        char *s = walk(g, &tv, &rng, 100, true);
        ck_assert(s != NULL);
        ck_assert(!strcmp(s, "abc") || !strcmp(s, "ab") || !strcmp(s, "日本") || !strcmp(s, "true"));
        free(s);
    }
    pd_grammar_unref(g);
    vocab_free(&tv);
}
END_TEST

/* The walks made ahead (pd_grammar_precompute: every cut stack, refined ones too) give the same masks
 * as walking as the generation goes, at every step of random walks through every schema above, the
 * any-JSON grammar, a recursive GBNF and a regex: masks of a grammar walked ahead (refining any walk
 * with an uncertain token, so deep cuts are used too), of one walked ahead under a budget that ran out
 * at once (every walk made as it goes) and of one never walked ahead are equal, and exact against the
 * token-by-token check. */
START_TEST(test_masks_ahead)
{
    test_vocab_t tv;
    vocab_make(&tv);
    char err[256];
    size_t n_schemas = sizeof(SCHEMAS) / sizeof(SCHEMAS[0]);
    uint32_t *ma = malloc((size_t)(tv.n + 31) / 32 * 4), *mb = malloc((size_t)(tv.n + 31) / 32 * 4),
             *mc = malloc((size_t)(tv.n + 31) / 32 * 4);
    uint64_t refined_total = 0;
    for (size_t i = 0; i <= n_schemas + 2; i++) {
        char *gb = NULL;
        if (i < n_schemas) {
            if (strstr(SCHEMAS[i], "maxProperties") != NULL) {
                continue;
            }
            json_t *schema = json_loads(SCHEMAS[i], 0, NULL);
            gb = pd_json_schema_to_gbnf(schema, err, sizeof(err));
            json_decref(schema);
        } else if (i == n_schemas) {
            gb = pd_json_schema_to_gbnf(NULL, err, sizeof(err));
        } else if (i == n_schemas + 1) {
            gb = strdup("root ::= item (\",\" item){0,3}\nitem ::= \"[\" (item | [a-c]+ | \"\") \"]\" | "
                        "[0-9]{1,3}\n");
        } else {
            gb = pd_regex_to_gbnf("(ab|a\\\"b)*[x-z]{2,4}(\\.\\d+)?",
                                  strlen("(ab|a\\\"b)*[x-z]{2,4}(\\.\\d+)?"), err, sizeof(err));
        }
        ck_assert_msg(gb != NULL, "grammar %zu: %s", i, err);
        pd_grammar_t *ga = compile(gb), *gb2 = compile(gb), *gc = compile(gb);
        pd_grammar_precompute_opts_t deep = {.budget_s = 60, .refine_over = 1}, none = {.budget_s = 0};
        pd_grammar_precompute_stats_t st;
        ck_assert_int_eq(pd_grammar_precompute(ga, tv.v, &deep, NULL, &st), PD_OK);
        ck_assert_msg(st.complete && st.walked == st.cut_stacks && st.cut_stacks > 0, "grammar %zu", i);
        ck_assert(pd_grammar_precomputed(ga, tv.v));
        refined_total += st.refined;
        ck_assert_int_eq(pd_grammar_precompute(gb2, tv.v, &none, NULL, &st), PD_OK);
        ck_assert(!st.complete && st.walked == 0);
        pd_rng_t rng;
        pd_rng_seed(&rng, 99 + i);
        for (int k = 0; k < 12; k++) {
            pd_gmatcher_t a, b, c;
            ck_assert_int_eq(pd_gmatcher_init(&a, ga), PD_OK);
            ck_assert_int_eq(pd_gmatcher_init(&b, gb2), PD_OK);
            ck_assert_int_eq(pd_gmatcher_init(&c, gc), PD_OK);
            for (int step = 0; step < 60; step++) {
                ck_assert_int_eq(pd_gmatcher_fill_mask(&a, tv.v, &tv.end_id, 1, ma), PD_OK);
                ck_assert_int_eq(pd_gmatcher_fill_mask(&b, tv.v, &tv.end_id, 1, mb), PD_OK);
                ck_assert_int_eq(pd_gmatcher_fill_mask(&c, tv.v, &tv.end_id, 1, mc), PD_OK);
                ck_assert_msg(memcmp(ma, mc, (size_t)(tv.n + 31) / 32 * 4) == 0 &&
                                  memcmp(mb, mc, (size_t)(tv.n + 31) / 32 * 4) == 0,
                              "grammar %zu walk %d step %d: masks differ", i, k, step);
                if (k < 3) {
                    check_mask(&a, &tv, ma);
                }
                int32_t allowed[1024], n = 0;
                for (int32_t t = 0; t < tv.n && n < 1024; t++) {
                    if (((ma[t >> 5] >> (t & 31)) & 1) && t != tv.end_id) {
                        allowed[n++] = t;
                    }
                }
                if (n == 0 || (pd_gmatcher_can_end(&a) && pd_rng_uniform(&rng) < 0.2)) {
                    break;
                }
                int32_t t = allowed[(int32_t)(pd_rng_uniform(&rng) * n) % n];
                ck_assert(pd_gmatcher_accept(&a, (const uint8_t *)tv.tok[t], tv.len[t]));
                ck_assert(pd_gmatcher_accept(&b, (const uint8_t *)tv.tok[t], tv.len[t]));
                ck_assert(pd_gmatcher_accept(&c, (const uint8_t *)tv.tok[t], tv.len[t]));
            }
            pd_gmatcher_destroy(&a);
            pd_gmatcher_destroy(&b);
            pd_gmatcher_destroy(&c);
        }
        pd_grammar_stats_t sa, sc;
        pd_grammar_get_stats(ga, &sa);
        pd_grammar_get_stats(gc, &sc);
        ck_assert_msg(sa.masks_truncated == 0 && sa.walks_ahead_used > 0, "grammar %zu: %llu walked here", i,
                      (unsigned long long)sa.masks_truncated);
        ck_assert(sc.walks_ahead_used == 0 && sc.masks_truncated > 0);
        pd_grammar_unref(ga);
        pd_grammar_unref(gb2);
        pd_grammar_unref(gc);
        free(gb);
    }
    ck_assert_msg(refined_total > 0, "no walk was refined: the deep cuts went untested");
    /* a cancelled walk keeps nothing */
    char *gbo = pd_json_schema_to_gbnf(NULL, err, sizeof(err));
    pd_grammar_t *g = compile(gbo);
    atomic_bool cancel = true;
    pd_grammar_precompute_opts_t opt = {.budget_s = 60};
    ck_assert_int_eq(pd_grammar_precompute(g, tv.v, &opt, &cancel, NULL), PD_ERR_CANCELLED);
    ck_assert(!pd_grammar_precomputed(g, tv.v));
    pd_grammar_unref(g);
    free(gbo);
    free(ma), free(mb), free(mc);
    vocab_free(&tv);
}
END_TEST

/* A state handed to another runtime of the grammar (a decode node's, numbered differently) reads
 * back the same and gives the same masks at every step of random walks; another grammar's state,
 * malformed text and positions where no stack can stand are refused. */
START_TEST(test_state_handover)
{
    test_vocab_t tv;
    vocab_make(&tv);
    pd_rng_t rng;
    pd_rng_seed(&rng, 99);
    size_t words = (size_t)(tv.n + 31) / 32;
    uint32_t *m1 = malloc(words * 4), *m2 = malloc(words * 4);
    int steps = 0;
    for (size_t i = 0; i < sizeof(SCHEMAS) / sizeof(SCHEMAS[0]); i++) {
        json_t *schema = json_loads(SCHEMAS[i], 0, NULL);
        char err[256];
        char *gb = pd_json_schema_to_gbnf(schema, err, sizeof(err));
        json_decref(schema);
        if (gb == NULL) {
            continue; /* the refused one */
        }
        pd_grammar_t *a = compile(gb), *b = compile(gb);
        free(walk(b, &tv, &rng, 200, false)); /* b's runtime numbers its nodes and states otherwise */
        for (int k = 0; k < 4; k++) {
            pd_gmatcher_t ma;
            ck_assert_int_eq(pd_gmatcher_init(&ma, a), PD_OK);
            for (int step = 0; step < 60; step++, steps++) {
                char *text = pd_gmatcher_export(&ma);
                ck_assert_msg(text != NULL && strncmp(text, "g1:", 3) == 0, "schema %zu step %d", i, step);
                pd_gmatcher_t mb;
                ck_assert_int_eq(pd_gmatcher_import(&mb, b, text, err, sizeof(err)), PD_OK);
                ck_assert_int_eq(mb.consumed, ma.consumed);
                char *again = pd_gmatcher_export(&mb);
                ck_assert_str_eq(again, text);
                ck_assert_int_eq(pd_gmatcher_fill_mask(&ma, tv.v, &tv.end_id, 1, m1), PD_OK);
                ck_assert_int_eq(pd_gmatcher_fill_mask(&mb, tv.v, &tv.end_id, 1, m2), PD_OK);
                ck_assert_msg(memcmp(m1, m2, words * 4) == 0, "schema %zu: masks differ at %s", i, text);
                ck_assert_int_eq(pd_gmatcher_can_end(&ma), pd_gmatcher_can_end(&mb));
                free(again);
                free(text);
                pd_gmatcher_destroy(&mb);
                int32_t allowed[512], n = 0;
                for (int32_t t = 0; t < tv.end_id && n < 512; t++) {
                    n += (m1[t >> 5] >> (t & 31)) & 1 ? (allowed[n] = t, 1) : 0;
                }
                if (n == 0) {
                    break; /* only the end */
                }
                int32_t t = allowed[(int32_t)(pd_rng_uniform(&rng) * n) % n];
                ck_assert(pd_gmatcher_accept(&ma, (const uint8_t *)tv.tok[t], tv.len[t]));
                ma.consumed++;
            }
            pd_gmatcher_destroy(&ma);
        }
        pd_grammar_unref(a);
        pd_grammar_unref(b);
        free(gb);
    }
    ck_assert_int_gt(steps, 500);
    free(m1);
    free(m2);

    /* refusals: the state of another grammar, malformed text, impossible positions */
    pd_grammar_t *g = compile("root ::= \"a\" x \"b\"\nx ::= [0-9] | \"(\" x \")\"\n");
    pd_grammar_t *h = compile("root ::= \"a\"\n");
    pd_gmatcher_t m, o;
    char err[256];
    ck_assert_int_eq(pd_gmatcher_init(&m, g), PD_OK);
    ck_assert(pd_gmatcher_accept(&m, (const uint8_t *)"a((", 3));
    m.consumed = 3;
    char *text = pd_gmatcher_export(&m);
    ck_assert_int_eq(pd_gmatcher_import(&o, h, text, err, sizeof(err)), PD_ERR_REJECTED);
    ck_assert_msg(strstr(err, "another grammar") != NULL, "%s", err);
    ck_assert_ptr_null(o.g);
    ck_assert_int_eq(pd_gmatcher_import(&o, g, text, err, sizeof(err)), PD_OK);
    ck_assert(pd_gmatcher_accept(&o, (const uint8_t *)"7))b", 4) && pd_gmatcher_must_end(&o));
    pd_gmatcher_destroy(&o);
    char hdr[32];
    snprintf(hdr, sizeof(hdr), "%.20s", text); /* "g1:HASH:" */
    const char *bad[][2] = {
        {"", "not a grammar state"},
        {"g2:0000000000000000:1:", "not a grammar state"},
        {":x:", "token count"},
        {":3:1,,2", "malformed"},
        {":3:99999", "position 99999"},
        {":3:1", "position 1, where no byte"}, /* x's reference, not a byte set */
        {":3:0,0", "position 0, where no rule returns"},
        {":3:99999999999", "malformed"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char buf[128];
        if (bad[i][0][0] == ':') {
            snprintf(buf, sizeof(buf), "%s%s", hdr, bad[i][0] + 1);
        } else {
            snprintf(buf, sizeof(buf), "%s", bad[i][0]);
        }
        pd_status_t st = pd_gmatcher_import(&o, g, buf, err, sizeof(err));
        ck_assert_msg(st != PD_OK && strstr(err, bad[i][1]) != NULL, "'%s': %s (%s)", buf, err,
                      pd_status_str(st));
        ck_assert_ptr_null(o.g);
    }
    free(text);
    pd_gmatcher_destroy(&m);
    pd_grammar_unref(g);
    pd_grammar_unref(h);
    vocab_free(&tv);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("grammar");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_gbnf_matches);
    tcase_add_test(tc, test_gbnf_errors);
    tcase_add_test(tc, test_regex_against_python);
    tcase_add_test(tc, test_schema_generations_validate);
    tcase_add_test(tc, test_schema_refusals);
    tcase_add_test(tc, test_masks_exact);
    tcase_add_test(tc, test_masks_ahead);
    tcase_add_test(tc, test_state_handover);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
