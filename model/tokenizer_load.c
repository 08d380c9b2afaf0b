/* model/tokenizer_load.c — building a tokenizer: tokenizer.json (model, normalizer, pre-tokenizer,
 * decoder, post-processor, added tokens), vocab.json + merges.txt, and the special tokens of
 * tokenizer_config.json. Encoding and decoding are in tokenizer.c. */
#define _GNU_SOURCE
#include "model/tokenizer_impl.h"

#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <utf8proc.h>

#include "common/arena.h"
#include "common/json.h"
#include "common/log.h"
#include "common/strmap.h"
#include "common/utf8.h"

/* ------------------------------------------------------------------ loading */

static pd_tokenizer_t *tok_new(void)
{
    pd_tokenizer_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return NULL;
    }
    pd_arena_init(&t->arena, 1 << 20);
    init_byte_map(t);
    t->unk_id = -1;
    if (pd_strmap_init(&t->vocab, 1024) != PD_OK || pd_strmap_init(&t->merges, 1024) != PD_OK) {
        pd_tokenizer_free(t);
        return NULL;
    }
    return t;
}

void pd_tokenizer_free(pd_tokenizer_t *t)
{
    if (t == NULL) {
        return;
    }
    for (int i = 0; i < t->num_splits; i++) {
        pcre2_code_free(t->split[i]);
    }
    for (int i = 0; i < t->num_normalizers; i++) {
        pcre2_code_free(t->norm[i].re);
    }
    free(t->id_str);
    free(t->id_str_len);
    free(t->id_bytes);
    free(t->id_bytes_len);
    free(t->id_special);
    free(t->added);
    pd_strmap_destroy(&t->vocab);
    pd_strmap_destroy(&t->merges);
    pd_arena_destroy(&t->arena);
    free(t);
}

static pd_status_t tok_alloc_ids(pd_tokenizer_t *t, int32_t n)
{
    t->vocab_size = n;
    t->id_str = calloc((size_t)n, sizeof(char *));
    t->id_str_len = calloc((size_t)n, sizeof(uint32_t));
    t->id_bytes = calloc((size_t)n, sizeof(unsigned char *));
    t->id_bytes_len = calloc((size_t)n, sizeof(uint32_t));
    t->id_special = calloc((size_t)n, sizeof(bool));
    if (!t->id_str || !t->id_str_len || !t->id_bytes || !t->id_bytes_len || !t->id_special) {
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

static pd_status_t tok_set_token(pd_tokenizer_t *t, int32_t id, const char *s, size_t len)
{
    char *copy = pd_arena_strndup(&t->arena, s, len);
    if (copy == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    t->id_str[id] = copy;
    t->id_str_len[id] = (uint32_t)len;
    return pd_strmap_put(&t->vocab, s, len, id);
}

static pd_status_t tok_add_merge(pd_tokenizer_t *t, const char *doc, const char *a, size_t alen,
                                 const char *b, size_t blen, int64_t rank)
{
    int64_t ia, ib, im;
    char buf[1024];
    if (alen + blen >= sizeof(buf) || !pd_strmap_get(&t->vocab, a, alen, &ia) ||
        !pd_strmap_get(&t->vocab, b, blen, &ib)) {
        pd_log_error("%s: merge %lld ('%.*s' '%.*s') uses a token missing from the vocab", doc,
                     (long long)rank, (int)alen, a, (int)blen, b);
        return PD_ERR_PARSE;
    }
    memcpy(buf, a, alen);
    memcpy(buf + alen, b, blen);
    if (!pd_strmap_get(&t->vocab, buf, alen + blen, &im)) {
        pd_log_error("%s: merge %lld produces '%.*s', which is not in the vocab", doc, (long long)rank,
                     (int)(alen + blen), buf);
        return PD_ERR_PARSE;
    }
    uint32_t key[2] = {(uint32_t)ia, (uint32_t)ib};
    int64_t prev;
    if (pd_strmap_get(&t->merges, (const char *)key, sizeof(key), &prev)) {
        return PD_OK; /* the first (lowest rank) occurrence wins */
    }
    return pd_strmap_put(&t->merges, (const char *)key, sizeof(key), (rank << 32) | im);
}

static int added_cmp(const void *x, const void *y)
{
    const added_token_t *a = x, *b = y;
    return a->len != b->len ? (a->len > b->len ? -1 : 1) : (a->id - b->id);
}

/* The byte of a "<0xNN>" byte-fallback token, or -1. */
static int fallback_byte(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') {
        return -1;
    }
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0) {
            return -1;
        }
        v = v * 16 + d;
    }
    return v;
}

/* Decoded bytes of every id; byte ids; sorted added tokens. Called once all tokens are known. */
static pd_status_t tok_finish(pd_tokenizer_t *t, const char *doc)
{
    for (int32_t id = 0; id < t->vocab_size; id++) {
        const char *s = t->id_str[id];
        if (s == NULL) {
            continue;
        }
        uint32_t len = t->id_str_len[id];
        unsigned char *out = pd_arena_alloc(&t->arena, len + 1, 1);
        if (out == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        uint32_t n = 0;
        bool added = t->id_special[id];
        for (int i = 0; i < t->num_added && !added; i++) {
            added = t->added[i].id == id;
        }
        bool byte_level = t->byte_level && !added;
        int fb = -1;
        if (!t->byte_level && !added && t->byte_fallback) {
            fb = fallback_byte(s, len);
        }
        if (fb >= 0) { /* <0xNN>: one raw byte */
            out[0] = (unsigned char)fb;
            t->id_bytes[id] = out;
            t->id_bytes_len[id] = 1;
            t->max_token_bytes = t->max_token_bytes > 1 ? t->max_token_bytes : 1;
            continue;
        }
        if (!t->byte_level && t->num_dec_replace > 0) { /* the decoder's replacements (▁ → ' '), added
                                                          * tokens included, as HF decodes every token */
            unsigned char *o2 = pd_arena_alloc(&t->arena, len * 4 + 1, 1);
            if (o2 == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            size_t k = 0, j = 0;
            while (j < len) {
                int r = 0;
                for (; r < t->num_dec_replace; r++) {
                    size_t fl = strlen(t->dec_from[r]);
                    if (fl > 0 && j + fl <= len && memcmp(s + j, t->dec_from[r], fl) == 0) {
                        size_t tl = strlen(t->dec_to[r]);
                        memcpy(o2 + k, t->dec_to[r], tl);
                        k += tl;
                        j += fl;
                        break;
                    }
                }
                if (r == t->num_dec_replace) {
                    o2[k++] = (unsigned char)s[j++];
                }
            }
            t->id_bytes[id] = o2;
            t->id_bytes_len[id] = (uint32_t)k;
            t->max_token_bytes = k > t->max_token_bytes ? k : t->max_token_bytes;
            continue;
        }
        size_t i = 0;
        while (i < len) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, len - i, &cp);
            if (l <= 0) {
                pd_log_error("%s: token %d is not valid UTF-8", doc, id);
                return PD_ERR_PARSE;
            }
            if (byte_level && cp < 324 && t->cp_byte[cp] >= 0) {
                out[n++] = (unsigned char)t->cp_byte[cp];
            } else {
                memcpy(out + n, s + i, (size_t)l);
                n += (uint32_t)l;
            }
            i += (size_t)l;
        }
        t->id_bytes[id] = out;
        t->id_bytes_len[id] = n;
        t->max_token_bytes = n > t->max_token_bytes ? n : t->max_token_bytes;
    }
    for (int b = 0; b < 256 && t->byte_level; b++) {
        unsigned char u[4];
        int l = utf8_put(t->byte_cp[b], u);
        int64_t id;
        if (!pd_strmap_get(&t->vocab, (const char *)u, (size_t)l, &id)) {
            pd_log_error("%s: the vocab has no byte-level token for byte 0x%02x; not a byte-level BPE vocab",
                         doc, b);
            return PD_ERR_PARSE;
        }
        t->byte_id[b] = (int32_t)id;
    }
    for (int b = 0; b < 256 && t->byte_fallback; b++) {
        char name[16];
        snprintf(name, sizeof(name), "<0x%02X>", b & 0xff);
        int64_t id;
        if (!pd_strmap_get(&t->vocab, name, 6, &id)) {
            pd_log_error("%s: byte_fallback BPE without the byte token %s", doc, name);
            return PD_ERR_PARSE;
        }
        t->fallback_id[b] = (int32_t)id;
    }
    qsort(t->added, (size_t)t->num_added, sizeof(added_token_t), added_cmp);
    for (int i = 0; i < t->num_added; i++) {
        t->added_first_byte[(unsigned char)t->added[i].content[0]] = true;
    }
    return PD_OK;
}

/* Unicode's White_Space, as the Oniguruma regexes of HF tokenizers read \s (PCRE2's \s in UCP mode
 * also takes U+180E, which Unicode stopped calling a space in 6.3). */
#define UNICODE_SPACE                                                                                        \
    "\\x{9}-\\x{d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{" \
    "3000}"

/* pattern with \s and \S spelled as Unicode's White_Space (malloc'd). */
static char *rewrite_spaces(const char *pattern)
{
    size_t n = strlen(pattern), cap = n * 8 + 256, k = 0;
    char *out = malloc(cap);
    if (out == NULL) {
        return NULL;
    }
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = pattern[i];
        if (c == '\\' && i + 1 < n) {
            char e = pattern[i + 1];
            const char *rep = NULL;
            if (e == 's') {
                rep = in_class ? UNICODE_SPACE : "[" UNICODE_SPACE "]";
            } else if (e == 'S' && !in_class) {
                rep = "[^" UNICODE_SPACE "]";
            }
            if (rep != NULL) {
                size_t rl = strlen(rep);
                memcpy(out + k, rep, rl);
                k += rl;
            } else {
                out[k++] = c;
                out[k++] = e;
            }
            i++;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = true;
            out[k++] = c;
            if (i + 1 < n && pattern[i + 1] == '^') {
                out[k++] = pattern[++i];
            }
            if (i + 1 < n && pattern[i + 1] == ']') { /* a literal ] first in a class */
                out[k++] = pattern[++i];
            }
            continue;
        }
        if (c == ']' && in_class) {
            in_class = false;
        }
        out[k++] = c;
    }
    out[k] = '\0';
    return out;
}

static pcre2_code *compile_regex(const char *doc, const char *pattern, uint32_t extra)
{
    char *rw = (extra & PCRE2_LITERAL) ? NULL : rewrite_spaces(pattern);
    int err;
    PCRE2_SIZE off;
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)(rw != NULL ? rw : pattern), PCRE2_ZERO_TERMINATED,
                      PCRE2_UTF | ((extra & PCRE2_LITERAL) ? 0 : PCRE2_UCP) | extra, &err, &off, NULL);
    free(rw);
    if (re == NULL) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        pd_log_error("%s: regex '%s' does not compile at offset %zu: %s", doc, pattern, (size_t)off, msg);
        return NULL;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort; the interpreter is the fallback */
    return re;
}

static pd_status_t add_split_regex(pd_tokenizer_t *t, const char *doc, const char *pattern, uint32_t extra,
                                   split_behavior_t behavior)
{
    if (t->num_splits == TOK_MAX_STEPS) {
        pd_log_error("%s: more than %d pre-tokenizer splits", doc, TOK_MAX_STEPS);
        return PD_ERR_UNSUPPORTED;
    }
    pcre2_code *re = compile_regex(doc, pattern, extra);
    if (re == NULL) {
        return PD_ERR_PARSE;
    }
    t->split_behavior[t->num_splits] = behavior;
    t->split[t->num_splits++] = re;
    return PD_OK;
}

/* A {"String": ...} or {"Regex": ...} pattern as a literal (*lit) or a compiled regex (*re). */
static pd_status_t parse_pattern(pd_tokenizer_t *t, const char *doc, const char *what, json_t *pat,
                                 const char **lit, size_t *lit_len, pcre2_code **re)
{
    *lit = NULL;
    *re = NULL;
    json_t *str = json_object_get(pat, "String"), *rx = json_object_get(pat, "Regex");
    if (json_is_string(str)) {
        *lit = pd_arena_strndup(&t->arena, json_string_value(str), json_string_length(str));
        *lit_len = json_string_length(str);
        return *lit != NULL ? PD_OK : PD_ERR_NO_MEMORY;
    }
    if (json_is_string(rx)) {
        *re = compile_regex(doc, json_string_value(rx), 0);
        return *re != NULL ? PD_OK : PD_ERR_PARSE;
    }
    pd_log_error("%s: %s pattern must be {\"String\": ...} or {\"Regex\": ...}", doc, what);
    return PD_ERR_PARSE;
}

static pd_status_t parse_normalizer(pd_tokenizer_t *t, const char *doc, json_t *n)
{
    if (n == NULL || json_is_null(n)) {
        return PD_OK;
    }
    const char *type = json_string_value(json_object_get(n, "type"));
    if (type == NULL) {
        pd_log_error("%s: normalizer without a type", doc);
        return PD_ERR_PARSE;
    }
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(n, "normalizers"), i, v)
        {
            pd_status_t st = parse_normalizer(t, doc, v);
            if (st != PD_OK) {
                return st;
            }
        }
        return PD_OK;
    }
    static const struct {
        const char *name;
        int options;
    } forms[] = {
        {"NFC", UTF8PROC_STABLE | UTF8PROC_COMPOSE},
        {"NFD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE},
        {"NFKC", UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT},
        {"NFKD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT},
    };
    if (t->num_normalizers == TOK_MAX_STEPS) {
        pd_log_error("%s: more than %d normalizers", doc, TOK_MAX_STEPS);
        return PD_ERR_UNSUPPORTED;
    }
    norm_step_t *step = &t->norm[t->num_normalizers];
    memset(step, 0, sizeof(*step));
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        if (strcmp(type, forms[i].name) == 0) {
            step->kind = NORM_FORM;
            step->options = forms[i].options;
            t->num_normalizers++;
            return PD_OK;
        }
    }
    if (strcmp(type, "Replace") == 0) {
        json_t *content = json_object_get(n, "content");
        if (!json_is_string(content)) {
            pd_log_error("%s: Replace normalizer without a content string", doc);
            return PD_ERR_PARSE;
        }
        step->kind = NORM_REPLACE;
        pd_status_t st = parse_pattern(t, doc, "Replace", json_object_get(n, "pattern"), &step->from,
                                       &step->from_len, &step->re);
        step->to = pd_arena_strndup(&t->arena, json_string_value(content), json_string_length(content));
        step->to_len = json_string_length(content);
        if (st == PD_OK && step->from != NULL && step->from_len == 0) {
            pd_log_error("%s: Replace normalizer with an empty pattern", doc);
            st = PD_ERR_PARSE;
        }
        if (st == PD_OK) {
            t->num_normalizers++;
        } else {
            pcre2_code_free(step->re);
            step->re = NULL;
        }
        return st;
    }
    if (strcmp(type, "Prepend") == 0) {
        json_t *pre = json_object_get(n, "prepend");
        if (!json_is_string(pre)) {
            pd_log_error("%s: Prepend normalizer without a prepend string", doc);
            return PD_ERR_PARSE;
        }
        step->kind = NORM_PREPEND;
        step->to = pd_arena_strndup(&t->arena, json_string_value(pre), json_string_length(pre));
        step->to_len = json_string_length(pre);
        t->num_normalizers++;
        return PD_OK;
    }
    if (strcmp(type, "Lowercase") == 0) {
        step->kind = NORM_LOWERCASE;
        t->num_normalizers++;
        return PD_OK;
    }
    if (strcmp(type, "Strip") == 0) {
        step->kind = NORM_STRIP;
        step->left = json_is_true(json_object_get(n, "strip_left"));
        step->right = json_is_true(json_object_get(n, "strip_right"));
        t->num_normalizers++;
        return PD_OK;
    }
    pd_log_error("%s: normalizer '%s' is not supported (NFC, NFD, NFKC, NFKD, Replace, Prepend, Lowercase, "
                 "Strip, Sequence)",
                 doc, type);
    return PD_ERR_UNSUPPORTED;
}

static pd_status_t parse_pretokenizer(pd_tokenizer_t *t, const char *doc, json_t *p, int *byte_level)
{
    if (p == NULL || json_is_null(p)) {
        return PD_OK;
    }
    const char *type = json_string_value(json_object_get(p, "type"));
    if (type == NULL) {
        pd_log_error("%s: pre_tokenizer without a type", doc);
        return PD_ERR_PARSE;
    }
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(p, "pretokenizers"), i, v)
        {
            pd_status_t st = parse_pretokenizer(t, doc, v, byte_level);
            if (st != PD_OK) {
                return st;
            }
        }
        return PD_OK;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        bool use_regex = true, prefix = false;
        pd_status_t st = pd_json_opt_bool(p, doc, "use_regex", true, &use_regex);
        if (st == PD_OK) {
            st = pd_json_opt_bool(p, doc, "add_prefix_space", false, &prefix);
        }
        if (st != PD_OK) {
            return st;
        }
        t->add_prefix_space = prefix;
        t->byte_level = true;
        *byte_level = 1;
        return use_regex ? add_split_regex(t, doc, GPT2_PATTERN, 0, SPLIT_ISOLATED) : PD_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const char *behavior = json_string_value(json_object_get(p, "behavior"));
        json_t *inv = json_object_get(p, "invert");
        static const struct {
            const char *name;
            split_behavior_t b;
        } behaviors[] = {{"Isolated", SPLIT_ISOLATED},
                         {"MergedWithPrevious", SPLIT_MERGED_PREV},
                         {"MergedWithNext", SPLIT_MERGED_NEXT},
                         {"Removed", SPLIT_REMOVED}};
        int bi = -1;
        for (int i = 0; behavior != NULL && i < 4; i++) {
            if (strcmp(behavior, behaviors[i].name) == 0) {
                bi = i;
            }
        }
        if (bi < 0 || json_is_true(inv)) {
            pd_log_error("%s: Split pre-tokenizer with behavior '%s'%s is not supported (Isolated, "
                         "MergedWithPrevious, MergedWithNext, Removed)",
                         doc, behavior ? behavior : "?", json_is_true(inv) ? " inverted" : "");
            return PD_ERR_UNSUPPORTED;
        }
        json_t *pat = json_object_get(p, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        if (re != NULL) {
            return add_split_regex(t, doc, re, 0, behaviors[bi].b);
        }
        if (lit != NULL) {
            return add_split_regex(t, doc, lit, PCRE2_LITERAL, behaviors[bi].b);
        }
        pd_log_error("%s: Split pattern must be {\"Regex\": ...} or {\"String\": ...}", doc);
        return PD_ERR_PARSE;
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *rep = json_string_value(json_object_get(p, "replacement"));
        const char *scheme = json_string_value(json_object_get(p, "prepend_scheme"));
        json_t *aps = json_object_get(p, "add_prefix_space");
        if (rep == NULL || strlen(rep) >= sizeof(t->meta_rep)) {
            pd_log_error("%s: Metaspace pre-tokenizer without a replacement", doc);
            return PD_ERR_PARSE;
        }
        t->metaspace = true;
        snprintf(t->meta_rep, sizeof(t->meta_rep), "%s", rep);
        t->meta_rep_len = (int)strlen(rep);
        t->meta_prepend = scheme == NULL                  ? (aps == NULL || json_is_true(aps) ? 2 : 0)
                          : strcmp(scheme, "first") == 0  ? 1
                          : strcmp(scheme, "always") == 0 ? 2
                                                          : 0;
        json_t *split = json_object_get(p, "split");
        if (split == NULL || json_is_true(split)) { /* each word starts at a replacement character */
            return add_split_regex(t, doc, rep, PCRE2_LITERAL, SPLIT_MERGED_NEXT);
        }
        return PD_OK;
    }
    pd_log_error("%s: pre_tokenizer '%s' is not supported (ByteLevel, Split, Metaspace, Sequence)", doc,
                 type);
    return PD_ERR_UNSUPPORTED;
}

/* The decoder chain, as far as it maps single tokens to bytes (ByteLevel, ByteFallback, Replace of a
 * string, Metaspace) or trims a whole decode (Strip of leading spaces, Metaspace's first space). */
static pd_status_t parse_decoder(pd_tokenizer_t *t, const char *doc, json_t *d)
{
    if (d == NULL || json_is_null(d)) {
        return PD_OK;
    }
    const char *type = json_string_value(json_object_get(d, "type"));
    if (type == NULL) {
        pd_log_error("%s: decoder without a type", doc);
        return PD_ERR_PARSE;
    }
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(d, "decoders"), i, v)
        {
            pd_status_t st = parse_decoder(t, doc, v);
            if (st != PD_OK) {
                return st;
            }
        }
        return PD_OK;
    }
    if (strcmp(type, "ByteLevel") == 0 || strcmp(type, "ByteFallback") == 0 || strcmp(type, "Fuse") == 0) {
        return PD_OK; /* byte-level tokens and <0xNN> tokens are mapped by the model's kind */
    }
    if (strcmp(type, "Replace") == 0 || strcmp(type, "Metaspace") == 0) {
        const char *from, *to;
        if (type[0] == 'R') {
            from = json_string_value(json_object_get(json_object_get(d, "pattern"), "String"));
            to = json_string_value(json_object_get(d, "content"));
        } else {
            from = json_string_value(json_object_get(d, "replacement"));
            to = " ";
            const char *scheme = json_string_value(json_object_get(d, "prepend_scheme"));
            json_t *aps = json_object_get(d, "add_prefix_space");
            bool prepends =
                scheme != NULL ? strcmp(scheme, "never") != 0 : (aps == NULL || json_is_true(aps));
            if (prepends) {
                t->dec_strip_start = 1;
            }
        }
        if (from == NULL || to == NULL || from[0] == '\0' || strlen(from) >= 8 || strlen(to) >= 8 ||
            t->num_dec_replace == 4) {
            pd_log_error("%s: decoder %s must replace a short string by a short string", doc, type);
            return PD_ERR_UNSUPPORTED;
        }
        snprintf(t->dec_from[t->num_dec_replace], 8, "%s", from);
        snprintf(t->dec_to[t->num_dec_replace], 8, "%s", to);
        t->num_dec_replace++;
        return PD_OK;
    }
    if (strcmp(type, "Strip") == 0) {
        const char *content = json_string_value(json_object_get(d, "content"));
        json_int_t start = json_integer_value(json_object_get(d, "start"));
        json_int_t stop = json_integer_value(json_object_get(d, "stop"));
        if (content == NULL || strcmp(content, " ") != 0 || stop != 0 || start < 0 || start > 8) {
            pd_log_error("%s: Strip decoder other than leading spaces is not supported", doc);
            return PD_ERR_UNSUPPORTED;
        }
        t->dec_strip_start = (int)start;
        return PD_OK;
    }
    pd_log_error(
        "%s: decoder '%s' is not supported (ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace, "
        "Sequence)",
        doc, type);
    return PD_ERR_UNSUPPORTED;
}

static pd_status_t affix_token(pd_tokenizer_t *t, const char *doc, json_t *special_tokens, const char *name,
                               int32_t *list, int *count)
{
    int64_t id = -1;
    json_t *st = json_object_get(special_tokens, name);
    json_t *ids = json_object_get(st, "ids");
    if (json_is_array(ids) && json_array_size(ids) == 1) {
        id = json_integer_value(json_array_get(ids, 0));
    } else if (!pd_strmap_get(&t->vocab, name, strlen(name), &id)) {
        pd_log_error("%s: post_processor names special token '%s' that the tokenizer does not know", doc,
                     name);
        return PD_ERR_PARSE;
    }
    if (*count == TOK_MAX_AFFIX || id < 0 || id >= t->vocab_size) {
        pd_log_error("%s: post_processor token '%s' unusable", doc, name);
        return PD_ERR_PARSE;
    }
    list[(*count)++] = (int32_t)id;
    return PD_OK;
}

static pd_status_t parse_postprocessor(pd_tokenizer_t *t, const char *doc, json_t *p)
{
    if (p == NULL || json_is_null(p)) {
        return PD_OK;
    }
    const char *type = json_string_value(json_object_get(p, "type"));
    if (type == NULL || strcmp(type, "ByteLevel") == 0) {
        return PD_OK;
    }
    if (strcmp(type, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(p, "processors"), i, v)
        {
            pd_status_t st = parse_postprocessor(t, doc, v);
            if (st != PD_OK) {
                return st;
            }
        }
        return PD_OK;
    }
    if (strcmp(type, "TemplateProcessing") == 0) {
        json_t *single = json_object_get(p, "single");
        json_t *specials = json_object_get(p, "special_tokens");
        int seen_seq = 0;
        size_t i;
        json_t *v;
        json_array_foreach(single, i, v)
        {
            json_t *sp = json_object_get(v, "SpecialToken");
            if (json_object_get(v, "Sequence") != NULL) {
                seen_seq = 1;
            } else if (sp != NULL) {
                const char *name = json_string_value(json_object_get(sp, "id"));
                pd_status_t st = name == NULL ? PD_ERR_PARSE
                                 : seen_seq   ? affix_token(t, doc, specials, name, t->suffix, &t->num_suffix)
                                            : affix_token(t, doc, specials, name, t->prefix, &t->num_prefix);
                if (st != PD_OK) {
                    return st;
                }
            }
        }
        return PD_OK;
    }
    pd_log_warn("%s: post_processor '%s' ignored (no special tokens are added by it)", doc, type);
    return PD_OK;
}

static pd_status_t parse_tokenizer_json(pd_tokenizer_t *t, const char *doc, json_t *root)
{
    json_t *model = json_object_get(root, "model");
    const char *mtype = json_string_value(json_object_get(model, "type"));
    if (mtype == NULL || strcmp(mtype, "BPE") != 0) {
        pd_log_error("%s: model type '%s' is not supported (byte-level BPE)", doc, mtype ? mtype : "?");
        return PD_ERR_UNSUPPORTED;
    }
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(vocab) || !json_is_array(merges)) {
        pd_log_error("%s: model.vocab must be an object and model.merges a list", doc);
        return PD_ERR_PARSE;
    }
    t->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    if (json_string_length(json_object_get(model, "continuing_subword_prefix")) > 0 ||
        json_string_length(json_object_get(model, "end_of_word_suffix")) > 0) {
        pd_log_error("%s: BPE with a continuing_subword_prefix or end_of_word_suffix is not supported", doc);
        return PD_ERR_UNSUPPORTED;
    }
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val)
    {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) > (1 << 24)) {
            pd_log_error("%s: vocab entry '%s' has no valid id", doc, key);
            return PD_ERR_PARSE;
        }
        max_id = json_integer_value(val) > max_id ? json_integer_value(val) : max_id;
    }
    size_t i;
    json_array_foreach(added, i, val)
    {
        json_t *id = json_object_get(val, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > (1 << 24) ||
            !json_is_string(json_object_get(val, "content")) ||
            json_string_length(json_object_get(val, "content")) == 0) {
            pd_log_error("%s: added_tokens[%zu] needs an id and a non-empty content", doc, i);
            return PD_ERR_PARSE;
        }
        max_id = json_integer_value(id) > max_id ? json_integer_value(id) : max_id;
    }
    pd_status_t st = tok_alloc_ids(t, (int32_t)(max_id + 1));
    if (st != PD_OK) {
        return st;
    }
    json_object_foreach(vocab, key, val)
    {
        st = tok_set_token(t, (int32_t)json_integer_value(val), key, strlen(key));
        if (st != PD_OK) {
            return st;
        }
    }
    t->added = calloc(json_array_size(added) + 1, sizeof(added_token_t));
    if (t->added == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    json_array_foreach(added, i, val)
    {
        int32_t id = (int32_t)json_integer_value(json_object_get(val, "id"));
        json_t *c = json_object_get(val, "content");
        st = tok_set_token(t, id, json_string_value(c), json_string_length(c));
        if (st != PD_OK) {
            return st;
        }
        added_token_t *a = &t->added[t->num_added++];
        a->content = t->id_str[id];
        a->len = t->id_str_len[id];
        a->id = id;
        a->special = json_is_true(json_object_get(val, "special"));
        t->id_special[id] = a->special;
    }
    json_array_foreach(merges, i, val)
    {
        if (json_is_string(val)) {
            const char *s = json_string_value(val);
            const char *sp = strchr(s + (s[0] == ' ' ? 1 : 0), ' ');
            if (sp == NULL) {
                pd_log_error("%s: merge %zu '%s' is not 'left right'", doc, i, s);
                return PD_ERR_PARSE;
            }
            st = tok_add_merge(t, doc, s, (size_t)(sp - s), sp + 1, strlen(sp + 1), (int64_t)i);
        } else if (json_is_array(val) && json_array_size(val) == 2 &&
                   json_is_string(json_array_get(val, 0)) && json_is_string(json_array_get(val, 1))) {
            json_t *a = json_array_get(val, 0), *b = json_array_get(val, 1);
            st = tok_add_merge(t, doc, json_string_value(a), json_string_length(a), json_string_value(b),
                               json_string_length(b), (int64_t)i);
        } else {
            pd_log_error("%s: merge %zu must be a string or a pair of strings", doc, i);
            st = PD_ERR_PARSE;
        }
        if (st != PD_OK) {
            return st;
        }
    }
    st = parse_normalizer(t, doc, json_object_get(root, "normalizer"));
    int byte_level = 0;
    if (st == PD_OK) {
        st = parse_pretokenizer(t, doc, json_object_get(root, "pre_tokenizer"), &byte_level);
    }
    if (st == PD_OK) {
        st = parse_decoder(t, doc, json_object_get(root, "decoder"));
    }
    if (st == PD_OK && !byte_level && !t->byte_fallback) {
        pd_log_error("%s: neither byte-level BPE (a ByteLevel pre-tokenizer) nor byte_fallback BPE "
                     "(SentencePiece-style); other tokenizer models are not supported",
                     doc);
        st = PD_ERR_UNSUPPORTED;
    }
    if (st == PD_OK && byte_level && t->byte_fallback) {
        pd_log_error("%s: byte-level BPE with byte_fallback is not supported", doc);
        st = PD_ERR_UNSUPPORTED;
    }
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    int64_t unk_id;
    if (st == PD_OK && unk != NULL && pd_strmap_get(&t->vocab, unk, strlen(unk), &unk_id)) {
        t->unk_id = (int32_t)unk_id;
    }
    if (st == PD_OK) {
        st = tok_finish(t, doc);
    }
    if (st == PD_OK) {
        st = parse_postprocessor(t, doc, json_object_get(root, "post_processor"));
    }
    return st;
}

pd_status_t pd_tokenizer_load_json(const char *path, pd_tokenizer_t **tok_out)
{
    json_t *root = NULL;
    pd_status_t st = pd_json_load_file(path, 256u << 20, &root);
    if (st != PD_OK) {
        return st;
    }
    pd_tokenizer_t *t = tok_new();
    if (t == NULL) {
        json_decref(root);
        return PD_ERR_NO_MEMORY;
    }
    st = parse_tokenizer_json(t, path, root);
    json_decref(root);
    if (st != PD_OK) {
        pd_tokenizer_free(t);
        return st;
    }
    pd_log_debug("tokenizer %s: %d ids, %zu merges, %d added tokens", path, t->vocab_size, t->merges.count,
                 t->num_added);
    *tok_out = t;
    return PD_OK;
}

pd_status_t pd_tokenizer_load_vocab_merges(const char *vocab_path, const char *merges_path,
                                           pd_tokenizer_t **tok_out)
{
    json_t *vocab = NULL;
    pd_status_t st = pd_json_load_file(vocab_path, 64u << 20, &vocab);
    if (st != PD_OK) {
        return st;
    }
    FILE *f = fopen(merges_path, "r");
    if (f == NULL) {
        pd_log_error("cannot open %s", merges_path);
        json_decref(vocab);
        return PD_ERR_NOT_FOUND;
    }
    /* Build the equivalent tokenizer.json: GPT-2's ByteLevel pre-tokenizer, <|endoftext|> special. */
    json_t *merges = json_array();
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) {
            line[--n] = '\0';
        }
        if (n == 0 || strncmp(line, "#version", 8) == 0) {
            continue;
        }
        json_array_append_new(merges, json_stringn(line, (size_t)n));
    }
    free(line);
    fclose(f);
    json_t *root = json_pack("{s:{s:s, s:O, s:o}, s:{s:s, s:b, s:b}, s:[]}", "model", "type", "BPE", "vocab",
                             vocab, "merges", merges, "pre_tokenizer", "type", "ByteLevel",
                             "add_prefix_space", 0, "use_regex", 1, "added_tokens");
    json_t *eot = json_object_get(vocab, "<|endoftext|>");
    if (json_is_integer(eot)) {
        json_array_append_new(
            json_object_get(root, "added_tokens"),
            json_pack("{s:O, s:s, s:b}", "id", eot, "content", "<|endoftext|>", "special", 1));
    }
    json_decref(vocab);
    pd_tokenizer_t *t = tok_new();
    if (t == NULL || root == NULL) {
        json_decref(root);
        pd_tokenizer_free(t);
        return PD_ERR_NO_MEMORY;
    }
    st = parse_tokenizer_json(t, vocab_path, root);
    json_decref(root);
    if (st != PD_OK) {
        pd_tokenizer_free(t);
        return st;
    }
    *tok_out = t;
    return PD_OK;
}

/* A special token of tokenizer_config.json (a string or an AddedToken object) as an id, or -1. */
static int32_t config_token(const pd_tokenizer_t *t, const json_t *cfg, const char *key)
{
    json_t *v = json_object_get(cfg, key);
    const char *s =
        json_is_string(v) ? json_string_value(v) : json_string_value(json_object_get(v, "content"));
    int64_t id;
    return s != NULL && pd_strmap_get(&t->vocab, s, strlen(s), &id) ? (int32_t)id : -1;
}

/* tokenizer_config.json's add_bos_token / add_eos_token decide the prefix and suffix tokens when
 * present (transformers rebuilds the post-processor from them for Llama and Gemma tokenizers). */
static pd_status_t apply_tokenizer_config(pd_tokenizer_t *t, const char *dir)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    if (access(path, R_OK) != 0) {
        return PD_OK;
    }
    json_error_t je;
    json_t *cfg = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je); /* model_max_length can be 1e30 */
    if (cfg == NULL) {
        pd_log_error("%s:%d:%d: invalid JSON: %s", path, je.line, je.column, je.text);
        return PD_ERR_PARSE;
    }
    pd_status_t st = PD_OK;
    static const char *const keys[2] = {"add_bos_token", "add_eos_token"};
    static const char *const toks[2] = {"bos_token", "eos_token"};
    for (int i = 0; i < 2 && st == PD_OK; i++) {
        json_t *flag = json_object_get(cfg, keys[i]);
        if (!json_is_boolean(flag)) {
            continue;
        }
        int32_t *list = i == 0 ? t->prefix : t->suffix;
        int *count = i == 0 ? &t->num_prefix : &t->num_suffix;
        *count = 0;
        if (json_is_true(flag)) {
            int32_t id = config_token(t, cfg, toks[i]);
            if (id < 0) {
                pd_log_error("%s: %s is true but %s names no token of the vocabulary", path, keys[i],
                             toks[i]);
                st = PD_ERR_PARSE;
            } else {
                list[(*count)++] = id;
            }
        }
    }
    json_decref(cfg);
    return st;
}

pd_status_t pd_tokenizer_load_dir(const char *dir, pd_tokenizer_t **tok_out)
{
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/tokenizer.json", dir);
    if (access(a, R_OK) == 0) {
        pd_tokenizer_t *t = NULL;
        pd_status_t st = pd_tokenizer_load_json(a, &t);
        if (st == PD_OK) {
            st = apply_tokenizer_config(t, dir);
        }
        if (st != PD_OK) {
            pd_tokenizer_free(t);
            return st;
        }
        *tok_out = t;
        return PD_OK;
    }
    snprintf(a, sizeof(a), "%s/vocab.json", dir);
    snprintf(b, sizeof(b), "%s/merges.txt", dir);
    if (access(a, R_OK) == 0 && access(b, R_OK) == 0) {
        return pd_tokenizer_load_vocab_merges(a, b, tok_out);
    }
    pd_log_error("%s: no tokenizer.json (or vocab.json + merges.txt)", dir);
    return PD_ERR_NOT_FOUND;
}
