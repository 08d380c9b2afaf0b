/* tools/pd-mkmodel.c — writes a random-weight HF-style model directory: config.json,
 * model.safetensors (or shards + model.safetensors.index.json) and tokenizer.json with a small
 * byte-level BPE vocab trained on a generated corpus. Deterministic for a given --seed.
 *
 *   pd-mkmodel --preset tiny --arch gpt2 --out /tmp/tiny-gpt2
 *   pd-mkmodel --preset demo --out build/models/demo      (llama-style, GQA, bf16) */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/flags.h"
#include "common/log.h"
#include "common/rng.h"
#include "common/strmap.h"
#include "model/safetensors.h"

typedef struct mk_opts {
    const char *preset;
    const char *arch;
    const char *out;
    const char *dtype;
    int hidden, layers, heads, kv_heads, intermediate, vocab, max_pos, shards;
    int64_t seed;
    double rope_theta;
    bool tie;
} mk_opts_t;

/* The chat template generated Llama-family models carry (pd-mkmodel writes it into
 * tokenizer_config.json): system / user / assistant / tool turns, tools as JSON in a system turn. */
#define PD_MKMODEL_CHAT_TEMPLATE                                                                             \
    "{{- bos_token }}\n"                                                                                     \
    "{%- if tools %}\n"                                                                                      \
    "{{- '<|im_start|>tools\\n' }}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ '<|im_end|>\\n' }}\n" \
    "{%- endif %}\n"                                                                                         \
    "{%- for m in messages %}\n"                                                                             \
    "{{- '<|im_start|>' + m.role + '\\n' }}\n"                                                               \
    "{%- if m.content is string %}{{ m.content }}{% endif %}\n"                                              \
    "{%- if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}"                          \
    "{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{% endfor %}{% endif %}\n"                  \
    "{{- '<|im_end|>\\n' }}\n"                                                                               \
    "{%- endfor %}\n"                                                                                        \
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n"

/* ------------------------------------------------------------------ corpus + BPE training */

// clang-format off
static const char *WORDS[] = {
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
    "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would",
    "who", "so", "no", "prefill", "decode", "cache", "block", "token", "tokens", "request", "server", "model",
    "layer", "attention", "memory", "network", "transfer", "latency", "throughput", "batch", "queue", "kernel",
    "vector", "matrix", "tensor", "page", "pages", "node", "nodes", "pool", "engine", "schedule", "scheduler",
    "stream", "packet", "socket", "buffer", "region", "remote", "local", "peer", "lease", "timeout", "error",
    "status", "system", "design", "value", "number", "string", "function", "return", "struct", "static", "const",
    "while", "break", "continue", "switch", "case", "default", "include", "define", "void", "float", "double",
    "integer", "pointer", "array", "list", "table", "index", "offset", "length", "size", "count", "time", "day",
    "year", "people", "world", "life", "hand", "part", "child", "eye", "woman", "place", "work", "week", "case",
    "point", "government", "company", "question", "problem", "fact", "good", "new", "first", "last", "long",
    "great", "little", "own", "other", "old", "right", "big", "high", "different", "small", "large", "next",
    "early", "young", "important", "few", "public", "bad", "same", "able", "river", "mountain", "forest", "ocean",
    "city", "village", "garden", "window", "door", "kitchen", "morning", "evening", "night", "summer", "winter",
    "music", "story", "letter", "paper", "book", "science", "history", "language", "computer", "machine",
    "learning", "research", "energy", "light", "water", "fire", "earth", "air", "stone", "metal", "glass",
    "caf\xc3\xa9", "na\xc3\xafve", "stra\303\237e", "\xc3\xa9t\xc3\xa9", "\xe6\x97\xa5\xe6\x9c\xac",
    "\xe4\xb8\xad\xe6\x96\x87", "\xd0\xbc\xd0\xb8\xd1\x80", "\xce\xbb\xcf\x8c\xce\xb3\xce\xbf\xcf\x82",
    "\xf0\x9f\x99\x82", "\xf0\x9f\x9a\x80",
};
static const char *PUNCT[] = {".", ",", "!", "?", ";", ":", "()", "{}", "==", "->", "'s", "'t", "'ll", "\"", "..."};
// clang-format on

/* Words (pre-tokens) of the corpus: " word", " 123", ".", "\n" — the shapes the GPT-2 and
 * Llama-3 pre-tokenizer regexes produce for this text. */
static pd_status_t corpus_words(pd_rng_t *rng, pd_strmap_t *words)
{
    const int nwords = (int)(sizeof(WORDS) / sizeof(WORDS[0]));
    const int npunct = (int)(sizeof(PUNCT) / sizeof(PUNCT[0]));
    char buf[64];
    for (int i = 0; i < 60000; i++) {
        uint64_t r = pd_rng_below(rng, 100);
        int len;
        if (r < 78) {
            /* Zipf-ish: low indices are more frequent */
            double u = pd_rng_uniform(rng);
            int w = (int)(pow(u, 2.0) * nwords);
            len = snprintf(buf, sizeof(buf), "%s%s", pd_rng_below(rng, 8) ? " " : "", WORDS[w]);
        } else if (r < 86) {
            len = snprintf(buf, sizeof(buf), " %llu", (unsigned long long)pd_rng_below(rng, 2000));
        } else if (r < 97) {
            len = snprintf(buf, sizeof(buf), "%s", PUNCT[pd_rng_below(rng, (uint64_t)npunct)]);
        } else {
            len = snprintf(buf, sizeof(buf), "%s", pd_rng_below(rng, 2) ? "\n" : "\n\n");
        }
        int64_t c = 0;
        pd_strmap_get(words, buf, (size_t)len, &c);
        if (pd_strmap_put(words, buf, (size_t)len, c + 1) != PD_OK) {
            return PD_ERR_NO_MEMORY;
        }
    }
    return PD_OK;
}

typedef struct bpe_state {
    char **tok; /* token strings (byte-level alphabet), index = id */
    int ntok, cap;
    char **merges; /* "a b" */
    int nmerges;
    int32_t **word_syms; /* per distinct word, its current symbol ids */
    int *word_len;
    int64_t *word_count;
    int nwords;
    pd_strmap_t tok_ids;
} bpe_state_t;

static void byte_to_cp_init(uint16_t *map)
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
    for (int b = 0; b < 256; b++) {
        map[b] = (uint16_t)(direct[b] ? b : 256 + n++);
    }
}

static char *cp_str(uint16_t cp)
{
    char *s = calloc(4, 1);
    if (cp < 0x80) {
        s[0] = (char)cp;
    } else {
        s[0] = (char)(0xc0 | (cp >> 6));
        s[1] = (char)(0x80 | (cp & 0x3f));
    }
    return s;
}

static int bpe_add_token(bpe_state_t *b, char *s)
{
    if (b->ntok == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 1024;
        b->tok = realloc(b->tok, (size_t)b->cap * sizeof(char *));
    }
    b->tok[b->ntok] = s;
    pd_strmap_put(&b->tok_ids, s, strlen(s), b->ntok);
    return b->ntok++;
}

static void bpe_add_merge(bpe_state_t *b, int x, int y)
{
    size_t lx = strlen(b->tok[x]), ly = strlen(b->tok[y]);
    char *m = malloc(lx + ly + 2);
    memcpy(m, b->tok[x], lx);
    m[lx] = ' ';
    memcpy(m + lx + 1, b->tok[y], ly + 1);
    b->merges = realloc(b->merges, (size_t)(b->nmerges + 1) * sizeof(char *));
    b->merges[b->nmerges++] = m;
    char *t = malloc(lx + ly + 1);
    memcpy(t, b->tok[x], lx);
    memcpy(t + lx, b->tok[y], ly + 1);
    bpe_add_token(b, t);
}

/* Trains merges until the vocab has target tokens (bytes + merges); when the corpus has no pair
 * left, adds merges of random existing pairs (still a valid BPE vocab). */
static void bpe_train(bpe_state_t *b, pd_strmap_t *words, int target, pd_rng_t *rng)
{
    uint16_t b2c[256];
    byte_to_cp_init(b2c);
    pd_strmap_init(&b->tok_ids, 4096);
    for (int i = 0; i < 256; i++) {
        bpe_add_token(b, cp_str(b2c[i]));
    }
    b->word_syms = calloc(words->count, sizeof(int32_t *));
    b->word_len = calloc(words->count, sizeof(int));
    b->word_count = calloc(words->count, sizeof(int64_t));
    for (size_t i = 0; i < words->cap; i++) {
        const pd_strmap_slot_t *s = &words->slots[i];
        if (s->key == NULL) {
            continue;
        }
        int w = b->nwords++;
        b->word_syms[w] = malloc(s->len * sizeof(int32_t));
        for (uint32_t k = 0; k < s->len; k++) {
            b->word_syms[w][k] = (unsigned char)s->key[k];
        }
        b->word_len[w] = (int)s->len;
        b->word_count[w] = s->value;
    }
    /* the strmap iterates in hash order: sort words by content for determinism across builds */
    pd_strmap_t pairs;
    while (b->ntok < target) {
        pd_strmap_init(&pairs, 4096);
        int64_t best = 0;
        uint32_t best_key[2] = {0, 0};
        for (int w = 0; w < b->nwords; w++) {
            for (int k = 0; k + 1 < b->word_len[w]; k++) {
                uint32_t key[2] = {(uint32_t)b->word_syms[w][k], (uint32_t)b->word_syms[w][k + 1]};
                int64_t c = 0;
                pd_strmap_get(&pairs, (const char *)key, sizeof(key), &c);
                c += b->word_count[w];
                pd_strmap_put(&pairs, (const char *)key, sizeof(key), c);
                if (c > best || (c == best &&
                                 (key[0] < best_key[0] || (key[0] == best_key[0] && key[1] < best_key[1])))) {
                    best = c;
                    best_key[0] = key[0];
                    best_key[1] = key[1];
                }
            }
        }
        pd_strmap_destroy(&pairs);
        if (best < 2) {
            break;
        }
        int x = (int)best_key[0], y = (int)best_key[1];
        bpe_add_merge(b, x, y);
        int32_t nid = b->ntok - 1;
        for (int w = 0; w < b->nwords; w++) {
            int o = 0;
            for (int k = 0; k < b->word_len[w]; k++) {
                if (k + 1 < b->word_len[w] && b->word_syms[w][k] == x && b->word_syms[w][k + 1] == y) {
                    b->word_syms[w][o++] = nid;
                    k++;
                } else {
                    b->word_syms[w][o++] = b->word_syms[w][k];
                }
            }
            b->word_len[w] = o;
        }
    }
    while (b->ntok < target) {
        int x = (int)pd_rng_below(rng, (uint64_t)b->ntok), y = (int)pd_rng_below(rng, (uint64_t)b->ntok);
        size_t lx = strlen(b->tok[x]), ly = strlen(b->tok[y]);
        if (lx + ly > 48) {
            continue;
        }
        char cat[128];
        memcpy(cat, b->tok[x], lx);
        memcpy(cat + lx, b->tok[y], ly + 1);
        int64_t dummy;
        if (pd_strmap_get(&b->tok_ids, cat, lx + ly, &dummy)) {
            continue;
        }
        bpe_add_merge(b, x, y);
    }
}

static void bpe_free(bpe_state_t *b)
{
    for (int i = 0; i < b->ntok; i++) {
        free(b->tok[i]);
    }
    for (int i = 0; i < b->nmerges; i++) {
        free(b->merges[i]);
    }
    for (int w = 0; w < b->nwords; w++) {
        free(b->word_syms[w]);
    }
    free(b->tok), free(b->merges), free(b->word_syms), free(b->word_len), free(b->word_count);
    pd_strmap_destroy(&b->tok_ids);
}

/* ------------------------------------------------------------------ files */

static json_t *tokenizer_json(const bpe_state_t *b, int is_gpt2, int is_llama, int32_t *bos, int32_t *eos)
{
    json_t *vocab = json_object(), *merges = json_array(), *added = json_array();
    for (int i = 0; i < b->ntok; i++) {
        json_object_set_new(vocab, b->tok[i], json_integer(i));
    }
    for (int i = 0; i < b->nmerges; i++) {
        json_array_append_new(merges, json_string(b->merges[i]));
    }
    const char *specials[2];
    int nspecial;
    if (is_gpt2) {
        specials[0] = "<|endoftext|>";
        nspecial = 1;
    } else {
        specials[0] = "<|begin_of_text|>";
        specials[1] = "<|end_of_text|>";
        nspecial = 2;
    }
    for (int i = 0; i < nspecial; i++) {
        json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", b->ntok + i,
                                               "content", specials[i], "single_word", 0, "lstrip", 0,
                                               "rstrip", 0, "normalized", 0, "special", 1));
    }
    *bos = b->ntok;
    *eos = b->ntok + nspecial - 1;
    json_t *model =
        json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:o}", "type", "BPE", "dropout", "unk_token",
                  "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0, "byte_fallback", 0,
                  "ignore_merges", !is_gpt2, "vocab", vocab, "merges", merges);
    json_t *pre, *norm, *post;
    if (is_gpt2) {
        pre = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                        "use_regex", 1);
        norm = json_null();
        post = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1, "trim_offsets",
                         0, "use_regex", 1);
    } else {
        const char *re = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                         "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        pre = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence",
                        "pretokenizers", "type", "Split", "pattern", "Regex", re, "behavior", "Isolated",
                        "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                        "use_regex", 0);
        norm = json_pack("{s:s}", "type", "NFC");
        if (is_llama) {
            post = json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:[], s:{s:{s:s, s:[i], s:[s]}}}",
                             "type", "TemplateProcessing", "single", "SpecialToken", "id",
                             "<|begin_of_text|>", "type_id", 0, "Sequence", "id", "A", "type_id", 0, "pair",
                             "special_tokens", "<|begin_of_text|>", "id", "<|begin_of_text|>", "ids", *bos,
                             "tokens", "<|begin_of_text|>");
        } else {
            post = json_null();
        }
    }
    return json_pack("{s:s, s:n, s:n, s:o, s:o, s:o, s:o, s:{s:s, s:b, s:b, s:b}, s:o}", "version", "1.0",
                     "truncation", "padding", "added_tokens", added, "normalizer", norm, "pre_tokenizer", pre,
                     "post_processor", post, "decoder", "type", "ByteLevel", "add_prefix_space", 1,
                     "trim_offsets", 1, "use_regex", 1, "model", model);
}

typedef struct tensor_list {
    pd_st_write_tensor_t *t;
    int n, cap;
    size_t bytes;
} tensor_list_t;

/* Adds a tensor of shape dims filled with N(mean, std) (never exactly zero), stored as dtype. */
static void add_tensor(tensor_list_t *l, pd_rng_t *rng, const char *name, pd_dtype_t dt, int ndim, int64_t d0,
                       int64_t d1, double mean, double std)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->t = realloc(l->t, (size_t)l->cap * sizeof(*l->t));
    }
    int64_t numel = ndim == 1 ? d0 : d0 * d1;
    void *data = malloc((size_t)numel * (size_t)pd_dtype_size(dt));
    for (int64_t i = 0; i < numel; i++) {
        float v = (float)(mean + std * pd_rng_normal(rng));
        if (v == 0.0f) {
            v = (float)(std * 1e-3 + 1e-6);
        }
        pd_dtype_store(data, i, dt, v);
    }
    pd_st_write_tensor_t *t = &l->t[l->n++];
    t->name = strdup(name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->data = data;
    l->bytes += (size_t)numel * (size_t)pd_dtype_size(dt);
}

static void tensor_list_free(tensor_list_t *l)
{
    for (int i = 0; i < l->n; i++) {
        free((char *)l->t[i].name);
        free((void *)l->t[i].data);
    }
    free(l->t);
}

static pd_status_t write_json(const char *dir, const char *file, json_t *j)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    int rc = json_dump_file(j, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(j);
    if (rc != 0) {
        pd_log_error("cannot write %s", path);
        return PD_ERR_IO;
    }
    return PD_OK;
}

static pd_status_t write_weights(const mk_opts_t *o, tensor_list_t *l)
{
    char path[4096];
    if (o->shards <= 1) {
        snprintf(path, sizeof(path), "%s/model.safetensors", o->out);
        return pd_st_write(path, l->t, l->n);
    }
    json_t *map = json_object();
    for (int s = 0; s < o->shards; s++) {
        char fname[128];
        snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, o->shards);
        pd_st_write_tensor_t *part = malloc((size_t)l->n * sizeof(*part));
        int np = 0;
        for (int i = s; i < l->n; i += o->shards) {
            part[np++] = l->t[i];
            json_object_set_new(map, l->t[i].name, json_string(fname));
        }
        snprintf(path, sizeof(path), "%s/%s", o->out, fname);
        pd_status_t st = pd_st_write(path, part, np);
        free(part);
        if (st != PD_OK) {
            json_decref(map);
            return st;
        }
    }
    return write_json(
        o->out, "model.safetensors.index.json",
        json_pack("{s:{s:I}, s:o}", "metadata", "total_size", (json_int_t)l->bytes, "weight_map", map));
}

static void apply_preset(mk_opts_t *o)
{
    int gpt2 = strcmp(o->arch, "gpt2") == 0;
    if (strcmp(o->preset, "tiny") == 0) {
        o->hidden = o->hidden ? o->hidden : 64;
        o->layers = o->layers ? o->layers : 2;
        o->heads = o->heads ? o->heads : 4;
        o->kv_heads = o->kv_heads ? o->kv_heads : (gpt2 ? 4 : 2);
        o->intermediate = o->intermediate ? o->intermediate : (gpt2 ? 256 : 160);
        o->vocab = o->vocab ? o->vocab : 512;
        o->max_pos = o->max_pos ? o->max_pos : 1024;
        o->dtype = o->dtype ? o->dtype : "f32";
    } else if (strcmp(o->preset, "demo") == 0) {
        o->hidden = o->hidden ? o->hidden : 512;
        o->layers = o->layers ? o->layers : 8;
        o->heads = o->heads ? o->heads : 8;
        o->kv_heads = o->kv_heads ? o->kv_heads : (gpt2 ? 8 : 2);
        o->intermediate = o->intermediate ? o->intermediate : (gpt2 ? 2048 : 1408);
        o->vocab = o->vocab ? o->vocab : 2048;
        o->max_pos = o->max_pos ? o->max_pos : 8192;
        o->dtype = o->dtype ? o->dtype : "bf16";
    }
    o->dtype = o->dtype ? o->dtype : "f32";
}

int main(int argc, char **argv)
{
    mk_opts_t o = {"tiny", "llama", NULL, NULL, 0, 0, 0, 0, 0, 0, 0, 1, 0, 10000.0, false};
    bool untie = false;
    const char *rope_scaling = NULL;
    int head_dim = 0, sliding_window = 0, sliding_pattern = 6;
    pd_flag_t flags[] = {
        {"preset", PD_FLAG_CHOICE, &o.preset, "size preset (none: give every size)", "tiny|demo|none"},
        {"arch", PD_FLAG_CHOICE, &o.arch, "architecture", "gpt2|llama|qwen2|qwen3|mistral|gemma3"},
        {"head-dim", PD_FLAG_INT, &head_dim, "head size (0 = hidden / heads; qwen3 writes head_dim)", NULL},
        {"sliding-window", PD_FLAG_INT, &sliding_window,
         "mistral: sliding_window (0 = none); gemma3: its local layers' window (0 = 512)", NULL},
        {"sliding-pattern", PD_FLAG_INT, &sliding_pattern, "gemma3: every N-th layer is global (default 6)",
         NULL},
        {"out", PD_FLAG_STR, &o.out, "output directory (created)", NULL},
        {"dtype", PD_FLAG_CHOICE, &o.dtype, "weight dtype (preset default: tiny f32, demo bf16)",
         "f32|f16|bf16"},
        {"hidden", PD_FLAG_INT, &o.hidden, "hidden size (0 = preset)", NULL},
        {"layers", PD_FLAG_INT, &o.layers, "layers (0 = preset)", NULL},
        {"heads", PD_FLAG_INT, &o.heads, "attention heads (0 = preset)", NULL},
        {"kv-heads", PD_FLAG_INT, &o.kv_heads, "key/value heads (0 = preset)", NULL},
        {"intermediate", PD_FLAG_INT, &o.intermediate, "MLP width (0 = preset)", NULL},
        {"vocab", PD_FLAG_INT, &o.vocab, "BPE tokens before special tokens (0 = preset)", NULL},
        {"max-pos", PD_FLAG_INT, &o.max_pos, "max_position_embeddings (0 = preset)", NULL},
        {"rope-theta", PD_FLAG_DOUBLE, &o.rope_theta, "RoPE base (llama, qwen2)", NULL},
        {"rope-scaling", PD_FLAG_STR, &rope_scaling,
         "config.json rope_scaling as JSON, e.g. '{\"rope_type\": \"llama3\", \"factor\": 8, ...}'", NULL},
        {"untie", PD_FLAG_BOOL, &untie, "write a separate lm_head (llama default; gpt2/qwen2 tie)", NULL},
        {"shards", PD_FLAG_INT, &o.shards, "number of safetensors shards (> 1 writes an index)", NULL},
        {"seed", PD_FLAG_INT64, &o.seed, "random seed", NULL},
    };
    pd_status_t st =
        pd_flags_parse(flags, sizeof(flags) / sizeof(flags[0]), argc, argv,
                       "usage: pd-mkmodel --out DIR [--preset tiny|demo] [--arch gpt2|llama|qwen2]", NULL);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    if (o.out == NULL) {
        pd_log_error("--out is required");
        return 2;
    }
    apply_preset(&o);
    int gpt2 = strcmp(o.arch, "gpt2") == 0, qwen3 = strcmp(o.arch, "qwen3") == 0;
    int mistral = strcmp(o.arch, "mistral") == 0, gemma3 = strcmp(o.arch, "gemma3") == 0;
    int llama = strcmp(o.arch, "llama") == 0 || qwen3 || mistral || gemma3; /* no q/k/v biases */
    o.tie = gpt2 || gemma3 || !llama ? !untie : false;
    if (gemma3 && sliding_window <= 0) {
        sliding_window = 512;
    }
    if (sliding_pattern < 1) {
        fprintf(stderr, "pd-mkmodel: --sliding-pattern must be positive\n");
        return 2;
    }
    if (o.hidden <= 0 || o.layers <= 0 || o.heads <= 0 || o.kv_heads <= 0 || o.intermediate <= 0 ||
        o.vocab < 257 || o.max_pos <= 0 || o.hidden % o.heads != 0 || o.heads % o.kv_heads != 0 ||
        (gpt2 && o.kv_heads != o.heads) || o.shards < 1) {
        pd_log_error(
            "inconsistent sizes: hidden %d, layers %d, heads %d, kv heads %d, intermediate %d, vocab %d "
            "(>= 257), max-pos %d, shards %d (gpt2 needs kv heads == heads)",
            o.hidden, o.layers, o.heads, o.kv_heads, o.intermediate, o.vocab, o.max_pos, o.shards);
        return 2;
    }
    pd_dtype_t dt = strcmp(o.dtype, "bf16") == 0  ? PD_DTYPE_BF16
                    : strcmp(o.dtype, "f16") == 0 ? PD_DTYPE_F16
                                                  : PD_DTYPE_F32;
    if (mkdir(o.out, 0755) != 0 && errno != EEXIST) {
        pd_log_error("cannot create %s: %s", o.out, strerror(errno));
        return 1;
    }
    pd_rng_t rng;
    pd_rng_seed(&rng, (uint64_t)o.seed);

    /* tokenizer */
    pd_strmap_t words;
    pd_strmap_init(&words, 4096);
    corpus_words(&rng, &words);
    bpe_state_t bpe;
    memset(&bpe, 0, sizeof(bpe));
    bpe_train(&bpe, &words, o.vocab, &rng);
    int32_t bos, eos;
    json_t *tok = tokenizer_json(&bpe, gpt2, llama, &bos, &eos);
    int vocab = eos + 1, nmerges = bpe.nmerges;
    bpe_free(&bpe);
    pd_strmap_destroy(&words);
    if (write_json(o.out, "tokenizer.json", tok) != PD_OK) {
        return 1;
    }
    /* tokenizer_config.json: the special tokens and, for the Llama-family presets, a chat template
     * (ChatML-like, with tools) so chat completions work on generated models */
    json_t *tcfg = gpt2 ? json_pack("{s:s, s:s, s:s}", "bos_token", "<|endoftext|>", "eos_token",
                                    "<|endoftext|>", "tokenizer_class", "GPT2Tokenizer")
                        : json_pack("{s:s, s:s, s:b, s:s, s:s}", "bos_token", "<|begin_of_text|>",
                                    "eos_token", "<|end_of_text|>", "add_bos_token", 1, "tokenizer_class",
                                    "PreTrainedTokenizerFast", "chat_template", PD_MKMODEL_CHAT_TEMPLATE);
    if (write_json(o.out, "tokenizer_config.json", tcfg) != PD_OK) {
        return 1;
    }

    /* weights */
    int H = o.hidden, hd = head_dim > 0 ? head_dim : o.hidden / o.heads, I = o.intermediate;
    int qd = o.heads * hd, kvd = o.kv_heads * hd;
    double ws = 1.0 / sqrt((double)H), ds = 1.0 / sqrt((double)I);
    tensor_list_t l = {NULL, 0, 0, 0};
    char n[160];
    if (gpt2) {
        add_tensor(&l, &rng, "wte.weight", dt, 2, vocab, H, 0, 0.5);
        add_tensor(&l, &rng, "wpe.weight", dt, 2, o.max_pos, H, 0, 0.2);
        for (int i = 0; i < o.layers; i++) {
#define T1(suffix, d0, mean, std)                                                                            \
    snprintf(n, sizeof(n), "h.%d.%s", i, suffix);                                                            \
    add_tensor(&l, &rng, n, dt, 1, d0, 0, mean, std)
#define T2(suffix, d0, d1, std)                                                                              \
    snprintf(n, sizeof(n), "h.%d.%s", i, suffix);                                                            \
    add_tensor(&l, &rng, n, dt, 2, d0, d1, 0, std)
            T1("ln_1.weight", H, 1.0, 0.1);
            T1("ln_1.bias", H, 0.0, 0.05);
            T2("attn.c_attn.weight", H, 3 * H, ws); /* Conv1D: [in][out] */
            T1("attn.c_attn.bias", 3 * H, 0.0, 0.05);
            T2("attn.c_proj.weight", H, H, ws);
            T1("attn.c_proj.bias", H, 0.0, 0.05);
            T1("ln_2.weight", H, 1.0, 0.1);
            T1("ln_2.bias", H, 0.0, 0.05);
            T2("mlp.c_fc.weight", H, I, ws);
            T1("mlp.c_fc.bias", I, 0.0, 0.05);
            T2("mlp.c_proj.weight", I, H, ds);
            T1("mlp.c_proj.bias", H, 0.0, 0.05);
#undef T1
#undef T2
        }
        add_tensor(&l, &rng, "ln_f.weight", dt, 1, H, 0, 1.0, 0.1);
        add_tensor(&l, &rng, "ln_f.bias", dt, 1, H, 0, 0.0, 0.05);
        if (!o.tie) {
            add_tensor(&l, &rng, "lm_head.weight", dt, 2, vocab, H, 0, 0.5);
        }
    } else {
        add_tensor(&l, &rng, "model.embed_tokens.weight", dt, 2, vocab, H, 0, 0.5);
        for (int i = 0; i < o.layers; i++) {
#define T1(suffix, d0, mean, std)                                                                            \
    snprintf(n, sizeof(n), "model.layers.%d.%s", i, suffix);                                                 \
    add_tensor(&l, &rng, n, dt, 1, d0, 0, mean, std)
#define T2(suffix, d0, d1, std)                                                                              \
    snprintf(n, sizeof(n), "model.layers.%d.%s", i, suffix);                                                 \
    add_tensor(&l, &rng, n, dt, 2, d0, d1, 0, std)
            double nm = gemma3 ? 0.0 : 1.0; /* Gemma stores w of its (1 + w) norms */
            T1("input_layernorm.weight", H, nm, 0.1);
            T2("self_attn.q_proj.weight", qd, H, ws);
            T2("self_attn.k_proj.weight", kvd, H, ws);
            T2("self_attn.v_proj.weight", kvd, H, ws);
            if (!llama) {
                T1("self_attn.q_proj.bias", qd, 0.0, 0.05);
                T1("self_attn.k_proj.bias", kvd, 0.0, 0.05);
                T1("self_attn.v_proj.bias", kvd, 0.0, 0.05);
            }
            T2("self_attn.o_proj.weight", H, qd, 1.0 / sqrt((double)qd));
            if (qwen3 || gemma3) {
                T1("self_attn.q_norm.weight", hd, nm, 0.1);
                T1("self_attn.k_norm.weight", hd, nm, 0.1);
            }
            T1("post_attention_layernorm.weight", H, nm, 0.1);
            if (gemma3) {
                T1("pre_feedforward_layernorm.weight", H, nm, 0.1);
                T1("post_feedforward_layernorm.weight", H, nm, 0.1);
            }
            T2("mlp.gate_proj.weight", I, H, ws);
            T2("mlp.up_proj.weight", I, H, ws);
            T2("mlp.down_proj.weight", H, I, ds);
#undef T1
#undef T2
        }
        add_tensor(&l, &rng, "model.norm.weight", dt, 1, H, 0, gemma3 ? 0.0 : 1.0, 0.1);
        if (!o.tie) {
            add_tensor(&l, &rng, "lm_head.weight", dt, 2, vocab, H, 0, 0.5);
        }
    }
    size_t weight_bytes = l.bytes;
    st = write_weights(&o, &l);
    tensor_list_free(&l);
    if (st != PD_OK) {
        return 1;
    }

    /* config */
    json_t *cfg;
    const char *torch_dtype = dt == PD_DTYPE_BF16 ? "bfloat16" : dt == PD_DTYPE_F16 ? "float16" : "float32";
    if (gpt2) {
        cfg = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:b, s:i, s:i, s:s}",
                        "architectures", "GPT2LMHeadModel", "model_type", "gpt2", "n_embd", H, "n_layer",
                        o.layers, "n_head", o.heads, "n_inner", I, "n_positions", o.max_pos, "vocab_size",
                        vocab, "layer_norm_epsilon", 1e-5, "activation_function", "gelu_new",
                        "tie_word_embeddings", o.tie, "bos_token_id", bos, "eos_token_id", eos, "torch_dtype",
                        torch_dtype);
    } else {
        cfg = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:b, s:i, s:i, s:s, s:s}",
                        "architectures",
                        gemma3    ? "Gemma3ForCausalLM"
                        : qwen3   ? "Qwen3ForCausalLM"
                        : mistral ? "MistralForCausalLM"
                        : llama   ? "LlamaForCausalLM"
                                  : "Qwen2ForCausalLM",
                        "model_type",
                        gemma3    ? "gemma3_text"
                        : qwen3   ? "qwen3"
                        : mistral ? "mistral"
                        : llama   ? "llama"
                                  : "qwen2",
                        "hidden_size", H, "num_hidden_layers", o.layers, "num_attention_heads", o.heads,
                        "num_key_value_heads", o.kv_heads, "intermediate_size", I, "max_position_embeddings",
                        o.max_pos, "vocab_size", vocab, "rms_norm_eps", 1e-5, "rope_theta", o.rope_theta,
                        "tie_word_embeddings", o.tie, "bos_token_id", bos, "eos_token_id", eos, "torch_dtype",
                        torch_dtype, "hidden_act", "silu");
    }
    if (gemma3) { /* query_pre_attn_scalar hidden / heads as Gemma-3-27B: apart from head_dim */
        json_object_set_new(cfg, "head_dim", json_integer(hd));
        json_object_set_new(cfg, "query_pre_attn_scalar", json_integer(H / o.heads));
        json_object_set_new(cfg, "sliding_window", json_integer(sliding_window));
        json_object_set_new(cfg, "sliding_window_pattern", json_integer(sliding_pattern));
        json_object_set_new(cfg, "rope_local_base_freq", json_real(10000.0));
        json_object_set_new(cfg, "rope_theta", json_real(o.rope_theta == 10000.0 ? 1000000.0 : o.rope_theta));
        json_object_set_new(cfg, "hidden_activation", json_string("gelu_pytorch_tanh"));
        json_object_set_new(cfg, "final_logit_softcapping", json_null());
        json_object_set_new(cfg, "attn_logit_softcapping", json_null());
        json_object_set_new(cfg, "rms_norm_eps", json_real(1e-6));
        json_object_del(cfg, "hidden_act");
    }
    if (!gpt2 && (qwen3 || head_dim > 0)) {
        json_object_set_new(cfg, "head_dim", json_integer(hd));
    }
    if (qwen3) {
        json_object_set_new(cfg, "attention_bias", json_false());
    }
    if (mistral) {
        json_object_set_new(cfg, "sliding_window",
                            sliding_window > 0 ? json_integer(sliding_window) : json_null());
    }
    if (rope_scaling != NULL && !gpt2) {
        json_error_t je;
        json_t *rs = json_loads(rope_scaling, 0, &je);
        if (!json_is_object(rs)) {
            pd_log_error("--rope-scaling is not a JSON object: %s", rs == NULL ? je.text : "wrong type");
            json_decref(rs);
            return 2;
        }
        json_object_set_new(cfg, "rope_scaling", rs);
    }
    if (write_json(o.out, "config.json", cfg) != PD_OK) {
        return 1;
    }
    pd_log_info(
        "wrote %s model to %s: %d layers, hidden %d, %d heads (%d kv), vocab %d (%d merges), %.1f MiB "
        "of %s weights",
        o.arch, o.out, o.layers, H, o.heads, o.kv_heads, vocab, nmerges, (double)weight_bytes / (1 << 20),
        o.dtype);
    return 0;
}
