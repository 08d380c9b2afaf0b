/* tests/fuzz/fuzz_grammar.c — grammars as hostile input. The first byte picks the source: 'g' GBNF,
 * 'r' a regular expression, 'j' a JSON Schema (any other: GBNF); the rest is the text. It compiles
 * or is refused with an error, never crashes, and a compiled grammar is then walked: up to 64 steps,
 * each a mask over a vocabulary of every byte and a few multi-byte tokens, then one allowed token
 * (chosen by the input's hash), checking that every allowed token is accepted and that the end is
 * allowed exactly where the matcher says the grammar may end. Each step's state is also handed over
 * (pd_gmatcher_export, then pd_gmatcher_import) and must read back the same, and an edited copy of
 * it (one byte changed, chosen by the hash) is imported as a hostile peer's: refused or walked one
 * mask, never a crash. A second compile of the text, its masks' walks made ahead
 * (pd_grammar_precompute, refining every walk with an uncertain token), is walked alongside: its
 * masks must equal the first's at every step. */
#define _GNU_SOURCE
#include <jansson.h>
#include <stdbool.h>
#include <string.h>

#include "common/hash.h"
#include "fuzz.h"
#include "grammar/grammar.h"

static pd_gvocab_t *vocab(void)
{
    static pd_gvocab_t *v;
    static uint8_t bytes[256];
    if (v == NULL) {
        static const char *multi[] = {"{\"", "\":", "true", "null", "12", "é", "\xe6\x97", "ab", "\"}", "  "};
        enum { N = 256 + 10 + 1 };
        const uint8_t *p[N];
        uint32_t l[N];
        bool ex[N];
        for (int i = 0; i < 256; i++) {
            bytes[i] = (uint8_t)i;
            p[i] = bytes + i, l[i] = 1, ex[i] = false;
        }
        for (int i = 0; i < 10; i++) {
            p[256 + i] = (const uint8_t *)multi[i], l[256 + i] = (uint32_t)strlen(multi[i]),
                    ex[256 + i] = false;
        }
        p[N - 1] = (const uint8_t *)"</s>", l[N - 1] = 4, ex[N - 1] = true; /* the end */
        if (pd_gvocab_create(N, p, l, ex, &v) != PD_OK) {
            abort();
        }
    }
    return v;
}

static const uint8_t *token_bytes(int32_t t, uint32_t *len)
{
    static const char *multi[] = {"{\"", "\":", "true", "null", "12", "é", "\xe6\x97", "ab", "\"}", "  "};
    static uint8_t b[256];
    if (t < 256) {
        b[t] = (uint8_t)t;
        *len = 1;
        return b + t;
    }
    *len = (uint32_t)strlen(multi[t - 256]);
    return (const uint8_t *)multi[t - 256];
}

/* m's state handed over and read back; then an edited copy, as a hostile peer might send. */
static void handover(pd_grammar_t *g, const pd_gmatcher_t *m, pd_gvocab_t *v, uint64_t h)
{
    char *text = pd_gmatcher_export(m), err[256];
    if (text == NULL) {
        return;
    }
    pd_gmatcher_t o;
    if (pd_gmatcher_import(&o, g, text, err, sizeof(err)) != PD_OK) {
        abort(); /* a state this runtime wrote does not read back */
    }
    char *again = pd_gmatcher_export(&o);
    if (again == NULL || strcmp(again, text) != 0 || pd_gmatcher_can_end(&o) != pd_gmatcher_can_end(m)) {
        abort();
    }
    free(again);
    pd_gmatcher_destroy(&o);
    size_t len = strlen(text);
    static const char subst[] = "0123456789,;:9x";
    text[(h >> 17) % len] = subst[(h >> 40) % (sizeof(subst) - 1)];
    if (pd_gmatcher_import(&o, g, text, err, sizeof(err)) == PD_OK) {
        int32_t end = pd_gvocab_size(v) - 1;
        uint32_t mask[(256 + 11 + 31) / 32];
        (void)pd_gmatcher_fill_mask(&o, v, &end, 1, mask);
        pd_gmatcher_destroy(&o);
    }
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 16)) {
        return 0;
    }
    pd_log_set_level(PD_LOG_ERROR);
    char mode = (char)data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    char err[256];
    char *gbnf = NULL;
    if (mode == 'r') {
        gbnf = pd_regex_to_gbnf(text, len, err, sizeof(err));
    } else if (mode == 'j') {
        json_t *schema = json_loadb(text, len, JSON_REJECT_DUPLICATES, NULL);
        if (schema != NULL) {
            gbnf = pd_json_schema_to_gbnf(schema, err, sizeof(err));
            json_decref(schema);
        }
    } else {
        gbnf = strndup(text, len);
    }
    if (gbnf == NULL) {
        return 0;
    }
    pd_grammar_t *g = NULL, *ga = NULL;
    if (pd_grammar_from_gbnf(gbnf, strlen(gbnf), &g, err, sizeof(err)) != PD_OK) {
        free(gbnf);
        return 0;
    }
    if (pd_grammar_from_gbnf(gbnf, strlen(gbnf), &ga, err, sizeof(err)) != PD_OK) {
        abort(); /* the same text compiled once */
    }
    free(gbnf);
    pd_gvocab_t *v = vocab();
    pd_grammar_precompute_opts_t opt = {.budget_s = 0.5, .refine_over = 1};
    if (pd_grammar_precompute(ga, v, &opt, NULL, NULL) != PD_OK) {
        abort(); /* only out of memory or a cancel fail it */
    }
    int32_t n = pd_gvocab_size(v), end = n - 1;
    uint32_t mask[(256 + 11 + 31) / 32], mask_a[(256 + 11 + 31) / 32];
    pd_gmatcher_t m = {0}, ma = {0};
    uint64_t h = pd_hash64(data, size, 7);
    if (pd_gmatcher_init(&m, g) == PD_OK && pd_gmatcher_init(&ma, ga) == PD_OK) {
        for (int step = 0; step < 64; step++) {
            pd_status_t st = pd_gmatcher_fill_mask(&m, v, &end, 1, mask),
                        sa = pd_gmatcher_fill_mask(&ma, v, &end, 1, mask_a);
            if (st != PD_OK || sa != PD_OK) {
                break;
            }
            if (memcmp(mask, mask_a, sizeof(mask)) != 0) {
                abort(); /* the walks made ahead disagree with the walks made as it goes */
            }
            bool end_ok = (mask[end >> 5] >> (end & 31)) & 1;
            if (end_ok != pd_gmatcher_can_end(&m)) {
                abort(); /* the mask and the matcher disagree on the end */
            }
            int32_t allowed[256 + 11], k = 0;
            for (int32_t t = 0; t < end; t++) {
                if ((mask[t >> 5] >> (t & 31)) & 1) {
                    allowed[k++] = t;
                }
            }
            if (k == 0) {
                break;
            }
            h = h * 6364136223846793005ull + 1442695040888963407ull;
            int32_t t = allowed[(h >> 33) % (uint64_t)k];
            uint32_t tl;
            const uint8_t *tb = token_bytes(t, &tl);
            if (!pd_gmatcher_accept(&m, tb, tl) || !pd_gmatcher_accept(&ma, tb, tl)) {
                abort(); /* the mask allowed a token the matcher refuses */
            }
            handover(g, &m, v, h);
        }
    }
    pd_gmatcher_destroy(&m);
    pd_gmatcher_destroy(&ma);
    pd_grammar_unref(g);
    pd_grammar_unref(ga);
    return 0;
}
