/* tests/fuzz/fuzz_openai.c — a /v1/completions body as hostile input: any bytes are parsed and
 * validated into a request or refused with a 4xx naming the problem, never crash (JSON nesting,
 * field types, prompts as text / token ids / lists, stop lists, logit_bias, sampling ranges,
 * kv_transfer_params), and pd-proxy's check of the fields it rewrites agrees. The tokenizer is
 * the committed tokenizer corpus's tiny BPE (FUZZ_TOKENIZER). The HTTP framing itself is
 * libevent's parser (evhttp), not ours. */
#define _GNU_SOURCE
#include <jansson.h>
#include <string.h>

#include "common/api_fields.h"
#include "fuzz.h"
#include "model/tokenizer.h"
#include "server/openai.h"

static pd_tokenizer_t *g_tok;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_tok == NULL) {
        pd_log_set_level(PD_LOG_OFF);
        if (pd_tokenizer_load_json(FUZZ_TOKENIZER, &g_tok) != PD_OK) {
            fprintf(stderr, "fuzz_openai: cannot load %s\n", FUZZ_TOKENIZER);
            abort();
        }
    }
    if (size > (1u << 20)) {
        return 0;
    }
    static const char *const names[] = {"m"};
    pd_openai_limits_t lim = {names, 1, pd_tokenizer_vocab_size(g_tok), 256, 32, NULL, 0};
    pd_completion_req_t req;
    pd_http_error_t err;
    memset(&req, 0, sizeof(req));
    bool ok = pd_openai_parse_completion((const char *)data, size, g_tok, &lim, &req, &err);
    if (ok) {
        pd_completion_req_free(&req);
    }
    json_t *body = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, NULL);
    if (json_is_object(body)) {
        pd_http_error_t perr;
        if (!pd_api_check_rewritten_fields(body, false, &perr) && ok) {
            fprintf(stderr, "fuzz_openai: a node accepts what pd-proxy refuses: %s\n", perr.message);
            abort();
        }
    }
    json_decref(body);
    return 0;
}
