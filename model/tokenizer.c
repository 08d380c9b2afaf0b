/* model/tokenizer.c — byte-level BPE: load tokenizer.json / vocab.json+merges.txt, encode, decode. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

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

#define TOK_MAX_STEPS 8
#define TOK_MAX_AFFIX 4

/* GPT-2's pre-tokenizer regex (ByteLevel with use_regex = true). */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct added_token {
    const char *content;
    uint32_t len;
    int32_t id;
    bool special;
} added_token_t;

struct pd_tokenizer {
    int32_t vocab_size;
    const char **id_str; /* [vocab_size] token string as in the vocab (NULL = hole) */
    uint32_t *id_str_len;
    const unsigned char **id_bytes; /* [vocab_size] decoded bytes */
    uint32_t *id_bytes_len;
    bool *id_special;
    size_t max_token_bytes;
    pd_strmap_t vocab;    /* token string → id */
    pd_strmap_t merges;   /* (left id, right id) as 8 bytes → rank << 32 | merged id */
    added_token_t *added; /* sorted longest first */
    int num_added;
    bool added_first_byte[256];
    int normalize_options[TOK_MAX_STEPS]; /* utf8proc option sets applied in order */
    int num_normalizers;
    pcre2_code *split[TOK_MAX_STEPS]; /* Isolated splits applied in order */
    int num_splits;
    bool add_prefix_space;
    bool ignore_merges;
    int32_t prefix[TOK_MAX_AFFIX], suffix[TOK_MAX_AFFIX];
    int num_prefix, num_suffix;
    int32_t byte_id[256];  /* id of the one-byte token for each byte */
    uint16_t byte_cp[256]; /* byte → code point (GPT-2 bytes_to_unicode) */
    int16_t cp_byte[324];  /* code point → byte, -1 if not a byte-level char */
    pd_arena_t arena;
};

/* ------------------------------------------------------------------ UTF-8 */

/* Length of the valid UTF-8 character at s[0..n): 1..4; 0 if s is a valid but truncated prefix;
 * -1 if invalid (overlong, surrogate, > U+10FFFF, bad continuation). */
static int utf8_char_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    int len;
    uint32_t min;
    if (c < 0x80) {
        return 1;
    } else if (c >= 0xc2 && c <= 0xdf) {
        len = 2, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4, min = 0x10000;
    } else {
        return -1;
    }
    uint32_t cp = c & (0x7f >> len);
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) {
            /* check what we have is a plausible prefix */
            if (len == 3 && i == 2 && ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] > 0x9f))) {
                return -1;
            }
            if (len == 4 && i >= 2 && ((c == 0xf0 && s[1] < 0x90) || (c == 0xf4 && s[1] > 0x8f))) {
                return -1;
            }
            return 0;
        }
        if ((s[i] & 0xc0) != 0x80) {
            return -1;
        }
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
        return -1;
    }
    return len;
}

static int utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        int l = utf8_char_len(s + i, n - i);
        if (l <= 0) {
            return 0;
        }
        i += (size_t)l;
    }
    return 1;
}

static int utf8_put(uint32_t cp, unsigned char *out)
{
    if (cp < 0x80) {
        out[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (unsigned char)(0xc0 | (cp >> 6));
        out[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    out[0] = (unsigned char)(0xe0 | (cp >> 12));
    out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    out[2] = (unsigned char)(0x80 | (cp & 0x3f));
    return 3;
}

/* GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256 + n. */
static void init_byte_map(pd_tokenizer_t *t)
{
    bool direct[256] = {false};
    for (int b = '!'; b <= '~'; b++) {
        direct[b] = true;
    }
    for (int b = 0xa1; b <= 0xac; b++) {
        direct[b] = true;
    }
    for (int b = 0xae; b <= 0xff; b++) {
        direct[b] = true;
    }
    int n = 0;
    for (int i = 0; i < 324; i++) {
        t->cp_byte[i] = -1;
    }
    for (int b = 0; b < 256; b++) {
        t->byte_cp[b] = (uint16_t)(direct[b] ? b : 256 + n++);
        t->cp_byte[t->byte_cp[b]] = (int16_t)b;
    }
}

/* ------------------------------------------------------------------ loading */

static pd_tokenizer_t *tok_new(void)
{
    pd_tokenizer_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return NULL;
    }
    pd_arena_init(&t->arena, 1 << 20);
    init_byte_map(t);
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
        bool byte_level = !t->id_special[id];
        for (int i = 0; i < t->num_added && byte_level; i++) {
            byte_level = t->added[i].id != id;
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
    for (int b = 0; b < 256; b++) {
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
    qsort(t->added, (size_t)t->num_added, sizeof(added_token_t), added_cmp);
    for (int i = 0; i < t->num_added; i++) {
        t->added_first_byte[(unsigned char)t->added[i].content[0]] = true;
    }
    return PD_OK;
}

static pd_status_t add_split_regex(pd_tokenizer_t *t, const char *doc, const char *pattern, uint32_t extra)
{
    if (t->num_splits == TOK_MAX_STEPS) {
        pd_log_error("%s: more than %d pre-tokenizer splits", doc, TOK_MAX_STEPS);
        return PD_ERR_UNSUPPORTED;
    }
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | extra,
                                   &err, &off, NULL);
    if (re == NULL) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        pd_log_error("%s: pre-tokenizer regex does not compile at offset %zu: %s", doc, (size_t)off, msg);
        return PD_ERR_PARSE;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort; the interpreter is the fallback */
    t->split[t->num_splits++] = re;
    return PD_OK;
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
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        if (strcmp(type, forms[i].name) == 0) {
            if (t->num_normalizers == TOK_MAX_STEPS) {
                return PD_ERR_UNSUPPORTED;
            }
            t->normalize_options[t->num_normalizers++] = forms[i].options;
            return PD_OK;
        }
    }
    pd_log_error("%s: normalizer '%s' is not supported (NFC, NFD, NFKC, NFKD, Sequence)", doc, type);
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
        *byte_level = 1;
        return use_regex ? add_split_regex(t, doc, GPT2_PATTERN, 0) : PD_OK;
    }
    if (strcmp(type, "Split") == 0) {
        const char *behavior = json_string_value(json_object_get(p, "behavior"));
        json_t *inv = json_object_get(p, "invert");
        if (behavior == NULL || strcmp(behavior, "Isolated") != 0 || json_is_true(inv)) {
            pd_log_error("%s: Split pre-tokenizer with behavior '%s'%s is not supported (Isolated)", doc,
                         behavior ? behavior : "?", json_is_true(inv) ? " inverted" : "");
            return PD_ERR_UNSUPPORTED;
        }
        json_t *pat = json_object_get(p, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = json_string_value(json_object_get(pat, "String"));
        if (re != NULL) {
            return add_split_regex(t, doc, re, 0);
        }
        if (lit != NULL) {
            return add_split_regex(t, doc, lit, PCRE2_LITERAL);
        }
        pd_log_error("%s: Split pattern must be {\"Regex\": ...} or {\"String\": ...}", doc);
        return PD_ERR_PARSE;
    }
    pd_log_error("%s: pre_tokenizer '%s' is not supported (ByteLevel, Split, Sequence)", doc, type);
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
    if (json_is_true(json_object_get(model, "byte_fallback"))) {
        pd_log_error("%s: byte_fallback BPE (sentencepiece-style) is not supported", doc);
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
    if (st == PD_OK && !byte_level) {
        pd_log_error("%s: the pre_tokenizer has no ByteLevel step; only byte-level BPE is supported", doc);
        st = PD_ERR_UNSUPPORTED;
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

pd_status_t pd_tokenizer_load_dir(const char *dir, pd_tokenizer_t **tok_out)
{
    char a[4096], b[4096];
    snprintf(a, sizeof(a), "%s/tokenizer.json", dir);
    if (access(a, R_OK) == 0) {
        return pd_tokenizer_load_json(a, tok_out);
    }
    snprintf(a, sizeof(a), "%s/vocab.json", dir);
    snprintf(b, sizeof(b), "%s/merges.txt", dir);
    if (access(a, R_OK) == 0 && access(b, R_OK) == 0) {
        return pd_tokenizer_load_vocab_merges(a, b, tok_out);
    }
    pd_log_error("%s: no tokenizer.json (or vocab.json + merges.txt)", dir);
    return PD_ERR_NOT_FOUND;
}

/* ------------------------------------------------------------------ encode */

typedef struct ids_buf {
    int32_t *ids;
    size_t n, cap;
} ids_buf_t;

static pd_status_t push_id(ids_buf_t *b, int32_t id)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        int32_t *p = realloc(b->ids, cap * sizeof(int32_t));
        if (p == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        b->ids = p;
        b->cap = cap;
    }
    b->ids[b->n++] = id;
    return PD_OK;
}

typedef struct merge_cand {
    uint32_t rank;
    uint32_t pos;
    int32_t left, right, merged;
} merge_cand_t;

static int cand_less(const merge_cand_t *a, const merge_cand_t *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(merge_cand_t *h, size_t *n, merge_cand_t c)
{
    size_t i = (*n)++;
    h[i] = c;
    while (i > 0 && cand_less(&h[i], &h[(i - 1) / 2])) {
        merge_cand_t t = h[i];
        h[i] = h[(i - 1) / 2];
        h[(i - 1) / 2] = t;
        i = (i - 1) / 2;
    }
}

static merge_cand_t heap_pop(merge_cand_t *h, size_t *n)
{
    merge_cand_t top = h[0];
    h[0] = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < *n && cand_less(&h[l], &h[m])) {
            m = l;
        }
        if (r < *n && cand_less(&h[r], &h[m])) {
            m = r;
        }
        if (m == i) {
            break;
        }
        merge_cand_t t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
    return top;
}

static int lookup_merge(const pd_tokenizer_t *t, int32_t a, int32_t b, uint32_t pos, merge_cand_t *out)
{
    uint32_t key[2] = {(uint32_t)a, (uint32_t)b};
    int64_t v;
    if (!pd_strmap_get(&t->merges, (const char *)key, sizeof(key), &v)) {
        return 0;
    }
    *out = (merge_cand_t){(uint32_t)(v >> 32), pos, a, b, (int32_t)(v & 0xffffffff)};
    return 1;
}

/* BPE of one pre-token (raw bytes): lowest-rank pair first, leftmost on ties; O(n log n) with a
 * heap over a linked list of symbols, so a hostile 1 MB "word" stays cheap. */
static pd_status_t bpe_piece(const pd_tokenizer_t *t, const unsigned char *s, size_t n, ids_buf_t *out)
{
    if (n == 0) {
        return PD_OK;
    }
    if (t->ignore_merges || n == 1) {
        unsigned char stackbuf[256];
        unsigned char *w = 2 * n <= sizeof(stackbuf) ? stackbuf : malloc(2 * n);
        if (w == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        size_t wl = 0;
        for (size_t i = 0; i < n; i++) {
            wl += (size_t)utf8_put(t->byte_cp[s[i]], w + wl);
        }
        int64_t id;
        int hit = pd_strmap_get(&t->vocab, (const char *)w, wl, &id);
        if (w != stackbuf) {
            free(w);
        }
        if (hit) {
            return push_id(out, (int32_t)id);
        }
    }
    size_t bytes = n * (3 * sizeof(int32_t)) + 3 * n * sizeof(merge_cand_t);
    void *mem = malloc(bytes);
    if (mem == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    int32_t *sym = mem, *prev = sym + n, *next = prev + n;
    merge_cand_t *heap = (merge_cand_t *)(next + n);
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = t->byte_id[s[i]];
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    merge_cand_t c;
    for (size_t i = 0; i + 1 < n; i++) {
        if (lookup_merge(t, sym[i], sym[i + 1], (uint32_t)i, &c)) {
            heap_push(heap, &hn, c);
        }
    }
    while (hn > 0) {
        c = heap_pop(heap, &hn);
        int32_t p = (int32_t)c.pos, q = next[p];
        if (sym[p] != c.left || q < 0 || sym[q] != c.right) {
            continue; /* stale: one side was merged since */
        }
        sym[p] = c.merged;
        sym[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0) {
            prev[next[q]] = p;
        }
        if (prev[p] >= 0 && lookup_merge(t, sym[prev[p]], sym[p], (uint32_t)prev[p], &c)) {
            heap_push(heap, &hn, c);
        }
        if (next[p] >= 0 && lookup_merge(t, sym[p], sym[next[p]], (uint32_t)p, &c)) {
            heap_push(heap, &hn, c);
        }
    }
    pd_status_t st = PD_OK;
    for (int32_t i = 0; i >= 0 && st == PD_OK; i = next[i]) {
        st = push_id(out, sym[i]);
    }
    free(mem);
    return st;
}

/* Applies split level k (Isolated: matches and the gaps between them are pieces). */
static pd_status_t split_level(const pd_tokenizer_t *t, int k, const unsigned char *s, size_t n,
                               ids_buf_t *out)
{
    if (n == 0) {
        return PD_OK;
    }
    if (k == t->num_splits) {
        return bpe_piece(t, s, n, out);
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->split[k], NULL);
    if (md == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = PD_OK;
    size_t pos = 0, gap = 0;
    while (pos < n && st == PD_OK) {
        int rc = pcre2_match(t->split[k], s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) {
            break;
        }
        if (rc < 0) {
            pd_log_error("tokenizer: regex match failed (%d)", rc);
            st = PD_ERR_INTERNAL;
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: step over one character */
            int l = utf8_char_len(s + pos, n - pos);
            pos += l > 0 ? (size_t)l : 1;
            continue;
        }
        st = split_level(t, k + 1, s + gap, ms - gap, out);
        if (st == PD_OK) {
            st = split_level(t, k + 1, s + ms, me - ms, out);
        }
        pos = gap = me;
    }
    if (st == PD_OK) {
        st = split_level(t, k + 1, s + gap, n - gap, out);
    }
    pcre2_match_data_free(md);
    return st;
}

static pd_status_t encode_segment(const pd_tokenizer_t *t, const char *text, size_t len, bool at_start,
                                  ids_buf_t *out)
{
    if (len == 0) {
        return PD_OK;
    }
    unsigned char *norm = NULL;
    const unsigned char *s = (const unsigned char *)text;
    size_t n = len;
    for (int i = 0; i < t->num_normalizers; i++) {
        utf8proc_uint8_t *mapped = NULL;
        utf8proc_ssize_t r =
            utf8proc_map(s, (utf8proc_ssize_t)n, &mapped, (utf8proc_option_t)t->normalize_options[i]);
        if (r < 0) {
            free(norm);
            pd_log_warn("tokenizer: normalization failed: %s", utf8proc_errmsg(r));
            return PD_ERR_INVALID_ARG;
        }
        free(norm);
        norm = mapped;
        s = norm;
        n = (size_t)r;
    }
    unsigned char *prefixed = NULL;
    if (t->add_prefix_space && at_start && n > 0 && s[0] != ' ') {
        prefixed = malloc(n + 1);
        if (prefixed == NULL) {
            free(norm);
            return PD_ERR_NO_MEMORY;
        }
        prefixed[0] = ' ';
        memcpy(prefixed + 1, s, n);
        s = prefixed;
        n++;
    }
    pd_status_t st = split_level(t, 0, s, n, out);
    free(prefixed);
    free(norm);
    return st;
}

pd_status_t pd_tokenizer_encode(const pd_tokenizer_t *t, const char *text, size_t len, bool add_special,
                                int32_t **ids_out, size_t *n_out)
{
    if (!utf8_valid((const unsigned char *)text, len)) {
        pd_log_warn("tokenizer: input of %zu bytes is not valid UTF-8", len);
        return PD_ERR_INVALID_ARG;
    }
    ids_buf_t out = {NULL, 0, 0};
    pd_status_t st = PD_OK;
    for (int i = 0; add_special && st == PD_OK && i < t->num_prefix; i++) {
        st = push_id(&out, t->prefix[i]);
    }
    size_t seg = 0, i = 0;
    while (i < len && st == PD_OK) {
        const added_token_t *hit = NULL;
        if (t->added_first_byte[(unsigned char)text[i]]) {
            for (int a = 0; a < t->num_added; a++) {
                if (t->added[a].len <= len - i &&
                    memcmp(text + i, t->added[a].content, t->added[a].len) == 0) {
                    hit = &t->added[a];
                    break;
                }
            }
        }
        if (hit == NULL) {
            i++;
            continue;
        }
        st = encode_segment(t, text + seg, i - seg, seg == 0, &out);
        if (st == PD_OK) {
            st = push_id(&out, hit->id);
        }
        i += hit->len;
        seg = i;
    }
    if (st == PD_OK) {
        st = encode_segment(t, text + seg, len - seg, seg == 0, &out);
    }
    for (int k = 0; add_special && st == PD_OK && k < t->num_suffix; k++) {
        st = push_id(&out, t->suffix[k]);
    }
    if (st != PD_OK) {
        free(out.ids);
        return st;
    }
    if (out.ids == NULL) {
        out.ids = malloc(sizeof(int32_t));
        if (out.ids == NULL) {
            return PD_ERR_NO_MEMORY;
        }
    }
    *ids_out = out.ids;
    *n_out = out.n;
    return PD_OK;
}

/* ------------------------------------------------------------------ decode */

static int tok_known(const pd_tokenizer_t *t, int32_t id)
{
    return id >= 0 && id < t->vocab_size && t->id_bytes[id] != NULL;
}

pd_status_t pd_tokenizer_decode(const pd_tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                                char **text_out, size_t *len_out)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!tok_known(t, ids[i])) {
            pd_log_warn("tokenizer: cannot decode unknown token id %d", ids[i]);
            return PD_ERR_OUT_OF_RANGE;
        }
        if (!(skip_special && t->id_special[ids[i]])) {
            total += t->id_bytes_len[ids[i]];
        }
    }
    char *s = malloc(total + 1);
    if (s == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(skip_special && t->id_special[ids[i]])) {
            memcpy(s + k, t->id_bytes[ids[i]], t->id_bytes_len[ids[i]]);
            k += t->id_bytes_len[ids[i]];
        }
    }
    s[k] = '\0';
    *text_out = s;
    *len_out = k;
    return PD_OK;
}

static const unsigned char REPLACEMENT[3] = {0xef, 0xbf, 0xbd};

pd_status_t pd_detok_step(const pd_tokenizer_t *t, pd_detok_t *st, int32_t id, bool skip_special, char *out,
                          size_t cap, size_t *len_out)
{
    if (!tok_known(t, id)) {
        pd_log_warn("tokenizer: cannot decode unknown token id %d", id);
        return PD_ERR_OUT_OF_RANGE;
    }
    size_t k = 0;
    if (skip_special && t->id_special[id]) {
        *len_out = 0;
        return PD_OK;
    }
    const unsigned char *b = t->id_bytes[id];
    size_t bl = t->id_bytes_len[id];
    if (cap < bl + (size_t)st->num_pending * 3 + 1) {
        return PD_ERR_NO_SPACE;
    }
    /* work over pending ‖ token bytes without copying the token */
    size_t total = (size_t)st->num_pending + bl, i = 0;
    unsigned char win[8];
    while (i < total) {
        size_t avail = total - i < sizeof(win) ? total - i : sizeof(win);
        for (size_t j = 0; j < avail; j++) {
            size_t p = i + j;
            win[j] = p < (size_t)st->num_pending ? st->pending[p] : b[p - (size_t)st->num_pending];
        }
        int l = utf8_char_len(win, avail);
        if (l > 0) {
            memcpy(out + k, win, (size_t)l);
            k += (size_t)l;
            i += (size_t)l;
        } else if (l == 0) {
            break; /* incomplete tail: hold it */
        } else {
            memcpy(out + k, REPLACEMENT, 3);
            k += 3;
            i += 1;
        }
    }
    unsigned char rest[8];
    int nrest = 0;
    for (size_t p = i; p < total; p++) {
        rest[nrest++] = p < (size_t)st->num_pending ? st->pending[p] : b[p - (size_t)st->num_pending];
    }
    memcpy(st->pending, rest, (size_t)nrest);
    st->num_pending = nrest;
    *len_out = k;
    return PD_OK;
}

size_t pd_detok_finish(pd_detok_t *st, char *out, size_t cap)
{
    size_t k = 0;
    if (st->num_pending > 0 && cap >= 3) {
        memcpy(out, REPLACEMENT, 3);
        k = 3;
    }
    st->num_pending = 0;
    return k;
}

int32_t pd_tokenizer_vocab_size(const pd_tokenizer_t *t)
{
    return t->vocab_size;
}

int32_t pd_tokenizer_token_id(const pd_tokenizer_t *t, const char *token)
{
    int64_t id;
    return pd_strmap_get(&t->vocab, token, strlen(token), &id) ? (int32_t)id : -1;
}

size_t pd_tokenizer_max_token_bytes(const pd_tokenizer_t *t)
{
    return t->max_token_bytes;
}

bool pd_tokenizer_is_special(const pd_tokenizer_t *t, int32_t id)
{
    return id >= 0 && id < t->vocab_size && t->id_special[id];
}
