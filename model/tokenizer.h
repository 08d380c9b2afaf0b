/* model/tokenizer.h — HF byte-level BPE tokenizers (GPT-2, Llama-3, Qwen2 style), driven by what
 * tokenizer.json declares: normalizer (NFC/NFKC/NFD/NFKD via utf8proc, Sequence), pre_tokenizer
 * (ByteLevel with the GPT-2 regex, or Split{Regex, Isolated} + ByteLevel; PCRE2 with UTF + \p{..}),
 * BPE merges (ignore_merges honoured), added/special tokens, TemplateProcessing prefix tokens.
 * vocab.json + merges.txt (GPT-2 layout) load too. */
#ifndef PD_MODEL_TOKENIZER_H
#define PD_MODEL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct pd_tokenizer pd_tokenizer_t;

/* Loads dir/tokenizer.json, or dir/vocab.json + dir/merges.txt. PD_ERR_NOT_FOUND when neither
 * exists; PD_ERR_PARSE / PD_ERR_UNSUPPORTED (naming the component) for what it cannot run. */
pd_status_t pd_tokenizer_load_dir(const char *dir, pd_tokenizer_t **tok_out);
pd_status_t pd_tokenizer_load_json(const char *path, pd_tokenizer_t **tok_out);
pd_status_t pd_tokenizer_load_vocab_merges(const char *vocab_path, const char *merges_path,
                                           pd_tokenizer_t **tok_out);
void pd_tokenizer_free(pd_tokenizer_t *tok);

/* Number of ids (max id + 1) the tokenizer knows. */
int32_t pd_tokenizer_vocab_size(const pd_tokenizer_t *tok);

/* The token string of id as the vocabulary writes it (HF convert_ids_to_tokens, e.g. "Ġhello"),
 * *len_out bytes, not NUL-terminated; NULL for an unknown id. */
const char *pd_tokenizer_token_str(const pd_tokenizer_t *tok, int32_t id, size_t *len_out);

/* Id of an exact token string (vocab or added token), or -1. */
int32_t pd_tokenizer_token_id(const pd_tokenizer_t *tok, const char *token);

/* Encodes len bytes of UTF-8 text. add_special adds the post-processor's prefix tokens (e.g.
 * Llama-3's <|begin_of_text|>). Invalid UTF-8 is PD_ERR_INVALID_ARG. *ids_out is malloc'd; the
 * caller frees it. */
pd_status_t pd_tokenizer_encode(const pd_tokenizer_t *tok, const char *text, size_t len, bool add_special,
                                int32_t **ids_out, size_t *n_out);

/* Decodes ids[n] to bytes (malloc'd, NUL-terminated; the caller frees). skip_special drops special
 * tokens. Bytes that are not valid UTF-8 on their own are kept as they are. Unknown ids are
 * PD_ERR_OUT_OF_RANGE. */
pd_status_t pd_tokenizer_decode(const pd_tokenizer_t *tok, const int32_t *ids, size_t n, bool skip_special,
                                char **text_out, size_t *len_out);

/* Incremental detokenization for streaming: feed one id at a time and emit only complete UTF-8
 * characters; an incomplete sequence is held back until it completes, invalid bytes become
 * U+FFFD. */
typedef struct pd_detok {
    unsigned char pending[8];
    int num_pending;
} pd_detok_t;

/* Appends the text that id completes to out (cap bytes; needs room for the token's bytes + 8).
 * *len_out is the number of bytes written. */
pd_status_t pd_detok_step(const pd_tokenizer_t *tok, pd_detok_t *st, int32_t id, bool skip_special, char *out,
                          size_t cap, size_t *len_out);

/* Flushes held bytes at the end of a stream (as U+FFFD). */
size_t pd_detok_finish(pd_detok_t *st, char *out, size_t cap);

/* The bytes token id decodes to (byte-level and byte-fallback tokens as their bytes, a metaspace as
 * a space), *len_out of them, not NUL-terminated; NULL for an unknown id. The grammar masks match
 * these (engine/structured.c). */
const uint8_t *pd_tokenizer_token_bytes(const pd_tokenizer_t *tok, int32_t id, size_t *len_out);

/* Longest token, in bytes (sizing pd_detok_step buffers). */
size_t pd_tokenizer_max_token_bytes(const pd_tokenizer_t *tok);

/* Whether id is a special (added, special=true) token. */
bool pd_tokenizer_is_special(const pd_tokenizer_t *tok, int32_t id);

#endif
