/* tests/fuzz/fuzz_tokenizer.c — tokenizer.json as a hostile file: loaded, and when it loads, text
 * encoded (plain, with added tokens, invalid UTF-8) and decoded back, whole and incrementally. */
#define _GNU_SOURCE
#include <string.h>

#include "fuzz.h"
#include "model/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 20)) {
        return 0;
    }
    char *path = fuzz_to_file(data, size, ".json");
    if (path == NULL) {
        return 0;
    }
    pd_tokenizer_t *t = NULL;
    if (pd_tokenizer_load_json(path, &t) == PD_OK) {
        static const char *texts[] = {"Hello, world! 123",        "  spaced\tand\nnew lines ",
                                      "\xff\xfe bad utf8",        "<|endoftext|><s>[INST]",
                                      "日本語のテキスト ünïcödé", ""};
        for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
            int32_t *ids = NULL;
            size_t n = 0;
            if (pd_tokenizer_encode(t, texts[i], strlen(texts[i]), true, &ids, &n) == PD_OK) {
                char *text = NULL;
                size_t len = 0;
                if (pd_tokenizer_decode(t, ids, n, false, &text, &len) == PD_OK) {
                    free(text);
                }
                pd_detok_t st;
                memset(&st, 0, sizeof(st));
                char out[1024];
                size_t w = 0;
                for (size_t k = 0; k < n; k++) {
                    pd_detok_step(t, &st, ids[k], true, out, sizeof(out), &w);
                }
                pd_detok_finish(&st, out, sizeof(out));
                free(ids);
            }
        }
        pd_tokenizer_free(t);
    }
    unlink(path);
    free(path);
    return 0;
}
