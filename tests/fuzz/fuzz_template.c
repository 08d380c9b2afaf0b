/* tests/fuzz/fuzz_template.c — a chat template as hostile source: parsed, and when it parses,
 * rendered against a chat-shaped context under tight limits (steps, output, memory, call depth),
 * so loops, recursion and huge strings end as errors rather than hangs or crashes. */
#define _GNU_SOURCE
#include <jansson.h>
#include <string.h>

#include "fuzz.h"
#include "template/template.h"

static json_t *context(void)
{
    return json_pack("{s:[{s:s, s:s}, {s:s, s:s}, {s:s, s:[{s:s, s:s}]}], s:b, s:s, s:s, s:[{s:s}]}",
                     "messages", "role", "system", "content", "Be brief.", "role", "user", "content", "Hi <3",
                     "role", "user", "content", "type", "text", "text", "parts", "add_generation_prompt", 1,
                     "bos_token", "<s>", "eos_token", "</s>", "tools", "name", "get_weather");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 16)) {
        return 0;
    }
    pd_template_t *tpl = NULL;
    pd_template_error_t err;
    if (pd_template_parse((const char *)data, size, &tpl, &err) != PD_OK) {
        return 0;
    }
    pd_template_limits_t lim;
    pd_template_limits_default(&lim);
    lim.max_steps = 200000;
    lim.max_output = 1 << 20;
    lim.max_memory = 32 << 20;
    lim.max_call_depth = 32;
    lim.now = 1700000000;
    json_t *ctx = context();
    char *out = NULL;
    size_t len = 0;
    if (pd_template_render(tpl, ctx, &lim, &out, &len, &err) == PD_OK) {
        free(out);
    }
    pd_template_iterates_content(tpl);
    json_decref(ctx);
    pd_template_free(tpl);
    return 0;
}
