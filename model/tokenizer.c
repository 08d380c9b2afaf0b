/* model/tokenizer.c — encoding (normalizers, pre-tokenizer splits, byte-level and byte-fallback BPE,
 * added tokens) and decoding (whole and incremental) with a loaded tokenizer (tokenizer_load.c). */
#define _GNU_SOURCE
#include "model/tokenizer_impl.h"

#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/log.h"
#include "common/strmap.h"
#include "common/utf8.h"

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
/* Merges sym[n] (initial symbols) by rank, lowest first, leftmost on ties; O(n log n) with a heap
 * over a linked list of symbols, so a hostile 1 MB "word" stays cheap. Appends the result. */
static pd_status_t bpe_merge(const pd_tokenizer_t *t, int32_t *sym, size_t n, ids_buf_t *out)
{
    size_t bytes = n * (2 * sizeof(int32_t)) + 3 * n * sizeof(merge_cand_t);
    void *mem = malloc(bytes);
    if (mem == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    int32_t *prev = mem, *next = prev + n;
    merge_cand_t *heap = (merge_cand_t *)(next + n);
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
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
    for (int32_t i = 0; n > 0 && i >= 0 && st == PD_OK; i = next[i]) {
        st = push_id(out, sym[i]);
    }
    free(mem);
    return st;
}

/* Byte-level BPE of one pre-token (raw bytes mapped through the GPT-2 byte alphabet). */
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
    int32_t *sym = malloc(n * sizeof(int32_t));
    if (sym == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    for (size_t i = 0; i < n; i++) {
        sym[i] = t->byte_id[s[i]];
    }
    pd_status_t st = bpe_merge(t, sym, n, out);
    free(sym);
    return st;
}

/* SentencePiece-style BPE of one pre-token: characters are the initial symbols; a character the
 * vocabulary lacks becomes its UTF-8 bytes as <0xNN> tokens (byte_fallback) or the unknown token
 * (consecutive ones fused with fuse_unk). */
static pd_status_t bpe_piece_chars(const pd_tokenizer_t *t, const unsigned char *s, size_t n, ids_buf_t *out)
{
    if (n == 0) {
        return PD_OK;
    }
    int64_t id;
    if (t->ignore_merges && pd_strmap_get(&t->vocab, (const char *)s, n, &id)) {
        return push_id(out, (int32_t)id);
    }
    int32_t *sym = malloc(n * sizeof(int32_t)); /* at most one symbol per byte */
    if (sym == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0, i = 0;
    while (i < n) {
        int l = utf8_char_len(s + i, n - i);
        size_t w = l > 0 ? (size_t)l : 1;
        if (pd_strmap_get(&t->vocab, (const char *)s + i, w, &id)) {
            sym[k++] = (int32_t)id;
        } else if (t->byte_fallback) {
            for (size_t b = 0; b < w; b++) {
                sym[k++] = t->fallback_id[s[i + b]];
            }
        } else if (t->unk_id >= 0) {
            if (!(t->fuse_unk && k > 0 && sym[k - 1] == t->unk_id)) {
                sym[k++] = t->unk_id;
            }
        } else {
            free(sym);
            pd_log_warn("tokenizer: a character has no token and there is no unknown token");
            return PD_ERR_INVALID_ARG;
        }
        i += w;
    }
    pd_status_t st = bpe_merge(t, sym, k, out);
    free(sym);
    return st;
}

static pd_status_t model_piece(const pd_tokenizer_t *t, const unsigned char *s, size_t n, ids_buf_t *out)
{
    return t->byte_level ? bpe_piece(t, s, n, out) : bpe_piece_chars(t, s, n, out);
}

/* Applies split level k: Isolated (matches and the gaps between them are pieces), MergedWithPrevious
 * (a match ends the piece before it), MergedWithNext (a match starts the piece after it), Removed
 * (only the gaps remain). */
static pd_status_t split_level(const pd_tokenizer_t *t, int k, const unsigned char *s, size_t n,
                               ids_buf_t *out)
{
    if (n == 0) {
        return PD_OK;
    }
    if (k == t->num_splits) {
        return model_piece(t, s, n, out);
    }
    split_behavior_t how = t->split_behavior[k];
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->split[k], NULL);
    if (md == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    pd_status_t st = PD_OK;
    size_t pos = 0, piece = 0; /* piece: where the piece being built starts */
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
        switch (how) {
        case SPLIT_ISOLATED:
            st = split_level(t, k + 1, s + piece, ms - piece, out);
            if (st == PD_OK) {
                st = split_level(t, k + 1, s + ms, me - ms, out);
            }
            piece = me;
            break;
        case SPLIT_MERGED_PREV:
            st = split_level(t, k + 1, s + piece, me - piece, out);
            piece = me;
            break;
        case SPLIT_MERGED_NEXT:
            st = split_level(t, k + 1, s + piece, ms - piece, out);
            piece = ms;
            break;
        case SPLIT_REMOVED:
            st = split_level(t, k + 1, s + piece, ms - piece, out);
            piece = me;
            break;
        }
        pos = me;
    }
    if (st == PD_OK) {
        st = split_level(t, k + 1, s + piece, n - piece, out);
    }
    pcre2_match_data_free(md);
    return st;
}

/* Python's/Unicode's White_Space for a normalizer Strip. */
static bool is_white_space(int32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f || cp == 0x205f ||
           cp == 0x3000;
}

/* One normalizer step over s[n]; *out is malloc'd (NULL with PD_OK when the step leaves s as is). */
static pd_status_t normalize_step(const norm_step_t *step, const unsigned char *s, size_t n,
                                  unsigned char **out, size_t *out_len)
{
    *out = NULL;
    switch (step->kind) {
    case NORM_FORM: {
        utf8proc_uint8_t *mapped = NULL;
        utf8proc_ssize_t r = utf8proc_map(s, (utf8proc_ssize_t)n, &mapped, (utf8proc_option_t)step->options);
        if (r < 0) {
            pd_log_warn("tokenizer: normalization failed: %s", utf8proc_errmsg(r));
            return PD_ERR_INVALID_ARG;
        }
        *out = mapped;
        *out_len = (size_t)r;
        return PD_OK;
    }
    case NORM_PREPEND:
        if (n == 0) {
            return PD_OK;
        }
        *out = malloc(n + step->to_len + 1);
        if (*out == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        memcpy(*out, step->to, step->to_len);
        memcpy(*out + step->to_len, s, n);
        *out_len = n + step->to_len;
        return PD_OK;
    case NORM_LOWERCASE: {
        *out = malloc(n * 2 + 4);
        if (*out == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        size_t i = 0, k = 0;
        while (i < n) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t l = utf8proc_iterate(s + i, (utf8proc_ssize_t)(n - i), &cp);
            if (l <= 0) {
                (*out)[k++] = s[i++];
                continue;
            }
            utf8proc_uint8_t enc[4];
            utf8proc_ssize_t w = utf8proc_encode_char(utf8proc_tolower(cp), enc);
            if (k + (size_t)w > n * 2 + 3) {
                break;
            }
            memcpy(*out + k, enc, (size_t)w);
            k += (size_t)w;
            i += (size_t)l;
        }
        *out_len = k;
        return PD_OK;
    }
    case NORM_STRIP: {
        size_t b = 0, e = n;
        while (step->left && b < e) {
            utf8proc_int32_t cp;
            utf8proc_ssize_t l = utf8proc_iterate(s + b, (utf8proc_ssize_t)(e - b), &cp);
            if (l <= 0 || !is_white_space(cp)) {
                break;
            }
            b += (size_t)l;
        }
        while (step->right && e > b) {
            size_t p = e - 1;
            while (p > b && (s[p] & 0xc0) == 0x80) {
                p--;
            }
            utf8proc_int32_t cp;
            if (utf8proc_iterate(s + p, (utf8proc_ssize_t)(e - p), &cp) <= 0 || !is_white_space(cp)) {
                break;
            }
            e = p;
        }
        *out = malloc(e - b + 1);
        if (*out == NULL) {
            return PD_ERR_NO_MEMORY;
        }
        memcpy(*out, s + b, e - b);
        *out_len = e - b;
        return PD_OK;
    }
    case NORM_REPLACE: break;
    }
    if (step->re != NULL) {
        PCRE2_SIZE cap = n * 2 + step->to_len * 8 + 64;
        for (int attempt = 0; attempt < 8; attempt++) {
            *out = malloc(cap + 1);
            if (*out == NULL) {
                return PD_ERR_NO_MEMORY;
            }
            PCRE2_SIZE olen = cap;
            int rc = pcre2_substitute(step->re, s, n, 0,
                                      PCRE2_SUBSTITUTE_GLOBAL | PCRE2_SUBSTITUTE_LITERAL |
                                          PCRE2_SUBSTITUTE_OVERFLOW_LENGTH | PCRE2_NO_UTF_CHECK,
                                      NULL, NULL, (PCRE2_SPTR)step->to, step->to_len, *out, &olen);
            if (rc >= 0) {
                *out_len = olen;
                return PD_OK;
            }
            free(*out);
            *out = NULL;
            if (rc != PCRE2_ERROR_NOMEMORY) {
                pd_log_warn("tokenizer: Replace normalizer failed (%d)", rc);
                return PD_ERR_INVALID_ARG;
            }
            cap = olen;
        }
        return PD_ERR_NO_MEMORY;
    }
    size_t count = 0;
    for (const unsigned char *p = s; (p = memmem(p, n - (size_t)(p - s), step->from, step->from_len)) != NULL;
         p += step->from_len) {
        count++;
    }
    if (count == 0) {
        return PD_OK;
    }
    *out = malloc(n + count * step->to_len + 1);
    if (*out == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    size_t k = 0, i = 0;
    while (i < n) {
        if (i + step->from_len <= n && memcmp(s + i, step->from, step->from_len) == 0) {
            memcpy(*out + k, step->to, step->to_len);
            k += step->to_len;
            i += step->from_len;
        } else {
            (*out)[k++] = s[i++];
        }
    }
    *out_len = k;
    return PD_OK;
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
        unsigned char *next = NULL;
        size_t nl = 0;
        pd_status_t st = normalize_step(&t->norm[i], s, n, &next, &nl);
        if (st != PD_OK) {
            free(norm);
            return st;
        }
        if (next != NULL) {
            free(norm);
            norm = next;
            s = norm;
            n = nl;
        }
    }
    if (t->metaspace) { /* spaces become the replacement; prepended to the first or every section */
        size_t spaces = 0;
        for (size_t i = 0; i < n; i++) {
            spaces += s[i] == ' ';
        }
        size_t rl = (size_t)t->meta_rep_len;
        bool prepend = (t->meta_prepend == 2 || (t->meta_prepend == 1 && at_start)) &&
                       !(n >= rl && memcmp(s, t->meta_rep, rl) == 0);
        unsigned char *m = malloc(n + (spaces + 1) * rl + 1);
        if (m == NULL) {
            free(norm);
            return PD_ERR_NO_MEMORY;
        }
        size_t k = 0;
        if (prepend && n > 0) {
            memcpy(m, t->meta_rep, rl);
            k = rl;
        }
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ') {
                memcpy(m + k, t->meta_rep, rl);
                k += rl;
            } else {
                m[k++] = s[i];
            }
        }
        free(norm);
        norm = m;
        s = norm;
        n = k;
    }
    unsigned char *prefixed = NULL;
    if (t->byte_level && t->add_prefix_space && at_start && n > 0 && s[0] != ' ') {
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
    size_t strip = 0; /* the decoder's Strip (or Metaspace): leading spaces of the whole text */
    while ((int)strip < t->dec_strip_start && strip < k && s[strip] == ' ') {
        strip++;
    }
    if (strip > 0) {
        memmove(s, s + strip, k - strip + 1);
        k -= strip;
    }
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
        size_t l = 0;
        int r = pd_utf8_scan(win, avail, &l);
        if (r == 1) {
            memcpy(out + k, win, l);
            k += l;
            i += l;
        } else if (r == 0) {
            break; /* incomplete tail: hold it */
        } else {   /* one U+FFFD for the invalid sequence's maximal subpart */
            memcpy(out + k, REPLACEMENT, 3);
            k += 3;
            i += l;
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

const char *pd_tokenizer_token_str(const pd_tokenizer_t *t, int32_t id, size_t *len_out)
{
    if (id < 0 || id >= t->vocab_size || t->id_str[id] == NULL) {
        return NULL;
    }
    *len_out = t->id_str_len[id];
    return t->id_str[id];
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

const uint8_t *pd_tokenizer_token_bytes(const pd_tokenizer_t *t, int32_t id, size_t *len_out)
{
    *len_out = 0;
    if (!tok_known(t, id)) {
        return NULL;
    }
    *len_out = t->id_bytes_len[id];
    return t->id_bytes[id];
}
