/* model/tokenizer_impl.h — the tokenizer's representation, shared by its loader
 * (tokenizer_load.c: tokenizer.json, vocab.json + merges.txt, tokenizer_config.json) and its
 * encoder/decoder (tokenizer.c). Not a public header. */
#ifndef PD_MODEL_TOKENIZER_IMPL_H
#define PD_MODEL_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/arena.h"
#include "common/strmap.h"
#include "model/tokenizer.h"

#define TOK_MAX_STEPS 8
#define TOK_MAX_AFFIX 4

/* GPT-2's pre-tokenizer regex (ByteLevel with use_regex = true). */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef enum norm_kind { NORM_FORM, NORM_REPLACE, NORM_PREPEND, NORM_LOWERCASE, NORM_STRIP } norm_kind_t;

typedef struct norm_step {
    norm_kind_t kind;
    int options;      /* NORM_FORM: utf8proc options */
    const char *from; /* NORM_REPLACE: literal pattern (arena) */
    size_t from_len;
    pcre2_code *re; /* NORM_REPLACE with a Regex pattern */
    const char *to; /* NORM_REPLACE: content; NORM_PREPEND: prefix */
    size_t to_len;
    bool left, right; /* NORM_STRIP */
} norm_step_t;

typedef enum split_behavior {
    SPLIT_ISOLATED,
    SPLIT_MERGED_PREV,
    SPLIT_MERGED_NEXT,
    SPLIT_REMOVED
} split_behavior_t;

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
    norm_step_t norm[TOK_MAX_STEPS]; /* normalizers applied in order */
    int num_normalizers;
    pcre2_code *split[TOK_MAX_STEPS]; /* pre-tokenizer splits applied in order */
    split_behavior_t split_behavior[TOK_MAX_STEPS];
    int num_splits;
    bool add_prefix_space;
    bool ignore_merges;
    bool byte_level;    /* ByteLevel pre-tokenizer: BPE over the GPT-2 byte alphabet */
    bool byte_fallback; /* SentencePiece-style BPE over characters, unknown ones as <0xNN> tokens */
    int32_t fallback_id[256];
    int32_t unk_id; /* -1: none */
    bool fuse_unk;
    /* Metaspace pre-tokenizer: spaces become the replacement, prepended per prepend_scheme */
    bool metaspace;
    char meta_rep[8];
    int meta_rep_len;
    int meta_prepend; /* 0 never, 1 first section, 2 always */
    /* decoder: token strings → bytes (replacements), leading spaces stripped from a whole decode */
    char dec_from[4][8], dec_to[4][8];
    int num_dec_replace;
    int dec_strip_start;
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
static inline int utf8_char_len(const unsigned char *s, size_t n)
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

static inline int utf8_valid(const unsigned char *s, size_t n)
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

static inline int utf8_put(uint32_t cp, unsigned char *out)
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
static inline void init_byte_map(pd_tokenizer_t *t)
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

#endif
