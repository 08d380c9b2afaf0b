/* server/openai.c — /v1/completions and /v1/chat/completions request validation and JSON shapes. */
#include "server/openai.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/json.h"
#include "model/generation_config.h"
#include "server/chat.h"
#include "server/structured_output.h"
#include "server/tool_calls.h"

json_t *pd_openai_error_json(const pd_http_error_t *err)
{
    return pd_http_error_json(err);
}

/* Maximum nesting of objects/arrays, skipping strings (jansson's own limit is 2048). */
static int json_depth(const char *s, size_t len)
{
    int depth = 0, max = 0, in_str = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') {
                i++;
            } else if (c == '"') {
                in_str = 0;
            }
        } else if (c == '"') {
            in_str = 1;
        } else if (c == '{' || c == '[') {
            max = ++depth > max ? depth : max;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return max;
}

/* Appends a prompt (ids taken over) to out. */
static bool add_prompt(pd_completion_req_t *out, int32_t *ids, int32_t n, pd_http_error_t *err)
{
    if (out->num_prompts == PD_MAX_PROMPTS) {
        free(ids);
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "at most %d prompts per request",
                                 PD_MAX_PROMPTS);
    }
    if (out->prompts == NULL) {
        out->prompts = calloc(PD_MAX_PROMPTS, sizeof(pd_prompt_t));
        if (out->prompts == NULL) {
            free(ids);
            return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
        }
    }
    out->prompts[out->num_prompts].ids = ids;
    out->prompts[out->num_prompts].len = n;
    out->num_prompts++;
    if (n == 0) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' is empty");
    }
    return true;
}

static bool prompt_from_text(json_t *p, const pd_tokenizer_t *tok, bool add_special, pd_completion_req_t *out,
                             pd_http_error_t *err)
{
    size_t n = 0;
    int32_t *ids = NULL;
    if (pd_tokenizer_encode(tok, json_string_value(p), json_string_length(p), add_special, &ids, &n) !=
        PD_OK) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' could not be tokenized");
    }
    if (!add_prompt(out, ids, (int32_t)n, err)) {
        return false;
    }
    pd_prompt_t *pr = &out->prompts[out->num_prompts - 1];
    pr->text = malloc(json_string_length(p) + 1);
    if (pr->text != NULL) {
        memcpy(pr->text, json_string_value(p), json_string_length(p) + 1);
        pr->text_len = json_string_length(p);
    }
    return true;
}

static bool prompt_from_ids(json_t *p, const pd_openai_limits_t *lim, pd_completion_req_t *out,
                            pd_http_error_t *err)
{
    size_t n = json_array_size(p);
    if (n > (size_t)lim->max_model_len) {
        return pd_http_error_set(
            err, 400, "BadRequestError", "prompt",
            "This model's maximum context length is %d tokens. However, you requested %zu "
            "tokens in the prompt",
            lim->max_model_len, n);
    }
    int32_t *ids = malloc((n ? n : 1) * sizeof(int32_t));
    if (ids == NULL) {
        return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(p, i);
        if (!json_is_integer(v)) {
            free(ids);
            return pd_http_error_set(
                err, 400, "BadRequestError", "prompt",
                "'prompt' must be a string, a list of strings, a list of token ids or a list "
                "of such lists (element %zu is %s)",
                i, pd_json_type_name(v));
        }
        json_int_t id = json_integer_value(v);
        if (id < 0 || id >= lim->vocab_size) {
            free(ids);
            return pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                     "token id %lld at position %zu is outside the vocabulary [0, %d)",
                                     (long long)id, i, lim->vocab_size);
        }
        ids[i] = (int32_t)id;
    }
    return add_prompt(out, ids, (int32_t)n, err);
}

/* prompt: "text", ["text", ...], [ids...] or [[ids...], ...] (vLLM's batched prompts). */
/* add_special: the tokenizer's BOS/EOS around text prompts (vLLM's add_special_tokens, default true) */
static bool parse_prompt(json_t *p, const pd_tokenizer_t *tok, bool add_special,
                         const pd_openai_limits_t *lim, pd_completion_req_t *out, pd_http_error_t *err)
{
    if (p == NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' is required");
    }
    if (json_is_string(p)) {
        return prompt_from_text(p, tok, add_special, out, err);
    }
    if (!json_is_array(p)) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                 "'prompt' must be a string or a list of token ids, got %s",
                                 pd_json_type_name(p));
    }
    if (json_array_size(p) == 0) {
        return pd_http_error_set(err, 400, "BadRequestError", "prompt", "'prompt' is empty");
    }
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) {
        return prompt_from_ids(p, lim, out, err);
    }
    size_t i;
    json_t *v;
    json_array_foreach(p, i, v)
    {
        bool ok;
        if (json_is_string(first) && json_is_string(v)) {
            ok = prompt_from_text(v, tok, add_special, out, err);
        } else if (json_is_array(first) && json_is_array(v)) {
            ok = prompt_from_ids(v, lim, out, err);
        } else {
            ok = pd_http_error_set(err, 400, "BadRequestError", "prompt",
                                   "'prompt' mixes kinds of prompts (element %zu is %s)", i,
                                   pd_json_type_name(v));
        }
        if (!ok) {
            return false;
        }
    }
    return true;
}

static bool parse_stop(json_t *s, pd_completion_req_t *out, pd_http_error_t *err)
{
    if (s == NULL || json_is_null(s)) {
        return true;
    }
    if (json_is_string(s)) {
        if (json_string_length(s) == 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop",
                                     "stop cannot contain an empty string");
        }
        out->stop[out->num_stop++] = strdup(json_string_value(s));
        return true;
    }
    if (!json_is_array(s) || json_array_size(s) > PD_MAX_STOP_STRINGS) {
        return pd_http_error_set(err, 400, "BadRequestError", "stop",
                                 "'stop' must be a string or a list of at most %d strings",
                                 PD_MAX_STOP_STRINGS);
    }
    size_t i;
    json_t *v;
    json_array_foreach(s, i, v)
    {
        if (!json_is_string(v)) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop", "'stop' must contain only strings");
        }
        if (json_string_length(v) == 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop",
                                     "stop cannot contain an empty string");
        }
        out->stop[out->num_stop++] = strdup(json_string_value(v));
    }
    return true;
}

/* Parameters vLLM or OpenAI define that pdserve does not implement yet: a request that sets one to
 * anything but its neutral value gets a 400 naming it, never a silent 200. */
static bool refuse_unimplemented(json_t *root, bool chat, pd_http_error_t *err)
{
    static const struct {
        const char *name;
        const char *neutral; /* JSON of the value that changes nothing, or NULL (only null/absent) */
    } params[] = {
        {"best_of", "1"},
        {"use_beam_search", "false"},
        {"length_penalty", "1"},
        {"allowed_token_ids", NULL},
        {"guided_decoding_backend", NULL},   /* one engine: grammar/ */
        {"guided_whitespace_pattern", NULL}, /* whitespace is grammar/json_schema.c's */
        {"truncate_prompt_tokens", NULL},
        {"logits_processors", NULL},
        {"spaces_between_special_tokens", "true"},
        {"return_tokens_as_token_ids", "false"},
        {"suffix", NULL},
        {"prompt_embeds", NULL},
        {"functions", NULL},
        {"function_call", NULL},
        {"audio", NULL},
        {"modalities", NULL},
        {"prediction", NULL},
        {"priority", "0"},           /* no priority scheduling (vLLM refuses it under fcfs too) */
        {"logprob_token_ids", NULL}, /* logprobs of chosen ids */
        {"chat_template", NULL},     /* a template from the request (vLLM: --trust-request-chat-template) */
    };
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        json_t *v = json_object_get(root, params[i].name);
        if (v == NULL || json_is_null(v)) {
            continue;
        }
        if (params[i].neutral != NULL) {
            json_t *n = json_loads(params[i].neutral, JSON_DECODE_ANY, NULL);
            bool same = json_equal(v, n) || (json_is_number(v) && json_is_number(n) &&
                                             json_number_value(v) == json_number_value(n));
            json_decref(n);
            if (same) {
                continue;
            }
        }
        return pd_http_error_set(err, 400, "BadRequestError", params[i].name,
                                 "'%s' is not supported by pdserve yet", params[i].name);
    }
    json_t *so = json_object_get(root, "stream_options");
    if (json_is_true(json_object_get(so, "continuous_usage_stats"))) {
        return pd_http_error_set(err, 400, "BadRequestError", "stream_options",
                                 "'stream_options.continuous_usage_stats' is not supported by pdserve yet");
    }
    if (chat) {
        json_t *tc = json_object_get(root, "tool_choice");
        const char *tcs = json_string_value(tc);
        bool named =
            json_is_object(tc) && json_is_string(json_object_get(json_object_get(tc, "function"), "name"));
        if (tc != NULL && !json_is_null(tc) && !named &&
            (tcs == NULL ||
             (strcmp(tcs, "none") != 0 && strcmp(tcs, "auto") != 0 && strcmp(tcs, "required") != 0))) {
            return pd_http_error_set(err, 400, "BadRequestError", "tool_choice",
                                     "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                                     "\"function\", \"function\": {\"name\": ...}}");
        }
        if (json_is_true(json_object_get(root, "echo"))) {
            return pd_http_error_set(err, 400, "BadRequestError", "echo",
                                     "'echo' is not supported for chat by pdserve yet");
        }
    }
    return true;
}

/* One choice's list of token ids in resume_token_ids (name: how the error names it). */
static bool resume_ids(const json_t *list, const char *name, const pd_openai_limits_t *lim,
                       pd_resume_choice_t *rc, pd_http_error_t *err)
{
    size_t n = json_array_size(list);
    if (!json_is_array(list) || n >= (size_t)lim->max_model_len) {
        return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids",
                                 "'%s' must be a list of token ids, shorter than the model's context (%d)",
                                 name, lim->max_model_len);
    }
    rc->ids = n > 0 ? malloc(n * sizeof(int32_t)) : NULL;
    if (n > 0 && rc->ids == NULL) {
        return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(list, i);
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= lim->vocab_size) {
            return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids",
                                     "%s[%zu] is not a token id in [0, %d)", name, i, lim->vocab_size);
        }
        rc->ids[rc->num_ids++] = (int32_t)id;
    }
    return true;
}

/* resume_token_ids (pdserve's own field; pd-proxy sets it when a decode node dies mid-stream, see
 * README "Migration"): what the client has had of the reply from another node. This node recomputes
 * the prompt and those tokens, and streams what follows: the same tokens as one node would give
 * (seeded sampling draws per output position), without the role chunks or the text already sent.
 * - One choice: the list of its first tokens (non-empty).
 * - Several (n > 1, or a batch of prompts; choice index = prompt x n + j): one entry per choice in
 *   index order, the list of its tokens ([]: its client had none of them), or {"finished": true,
 *   "completion_tokens": K} for a choice whose client had its finish (nothing more is generated for
 *   it; its K tokens count in usage). At least one choice is left to generate.
 * Streamed only; not with echo (the prompt went out with the first tokens) or prompt_logprobs. With
 * kv_transfer_params only when they are a live migration's lease (the node that ran it leased the KV
 * of the prompt and every resumed token but the last; several choices: {"choices": [...]}, a lease
 * or null each) or a prefix lent by a prefill (completion.c checks them). */
static bool parse_resume(const json_t *rt, const pd_openai_limits_t *lim, pd_completion_req_t *out,
                         pd_http_error_t *err)
{
    if (rt == NULL || json_is_null(rt)) {
        return true;
    }
    int32_t choices = out->num_prompts * out->n;
    const char *why = !out->stream                       ? "needs stream: true"
                      : out->echo                        ? "cannot be combined with echo"
                      : out->params.want_prompt_logprobs ? "cannot be combined with prompt_logprobs"
                                                         : NULL;
    if (why != NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids", "'resume_token_ids' %s",
                                 why);
    }
    out->resume = calloc((size_t)choices, sizeof(pd_resume_choice_t));
    if (out->resume == NULL) {
        return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
    }
    if (choices == 1) {
        if (!resume_ids(rt, "resume_token_ids", lim, &out->resume[0], err)) {
            return false;
        }
        if (out->resume[0].num_ids == 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids",
                                     "'resume_token_ids' must be a non-empty list of token ids");
        }
        return true;
    }
    if (!json_is_array(rt) || json_array_size(rt) != (size_t)choices) {
        return pd_http_error_set(
            err, 400, "BadRequestError", "resume_token_ids",
            "'resume_token_ids' of a request of %d choices (%d prompts x n %d) is a list of "
            "%d entries, one per choice: its token ids, or {\"finished\": true, "
            "\"completion_tokens\": K}",
            choices, out->num_prompts, out->n, choices);
    }
    int32_t running = 0, had = 0; /* choices left to generate; choices the client had something of */
    for (int32_t k = 0; k < choices; k++) {
        const json_t *e = json_array_get(rt, (size_t)k);
        pd_resume_choice_t *rc = &out->resume[k];
        char name[40];
        snprintf(name, sizeof(name), "resume_token_ids[%d]", k);
        if (json_is_object(e)) {
            const json_t *ct = json_object_get(e, "completion_tokens");
            if (!json_is_true(json_object_get(e, "finished")) || json_object_size(e) != 2 ||
                !json_is_integer(ct) || json_integer_value(ct) < 0 ||
                json_integer_value(ct) >= lim->max_model_len) {
                return pd_http_error_set(
                    err, 400, "BadRequestError", "resume_token_ids",
                    "%s: a finished choice is {\"finished\": true, \"completion_tokens\": K} "
                    "with 0 <= K < %d",
                    name, lim->max_model_len);
            }
            rc->finished = true;
            rc->finished_tokens = (int32_t)json_integer_value(ct);
            had++;
            continue;
        }
        if (!resume_ids(e, name, lim, rc, err)) {
            return false;
        }
        running++;
        had += rc->num_ids > 0;
    }
    if (running == 0 || had == 0) {
        return pd_http_error_set(err, 400, "BadRequestError", "resume_token_ids",
                                 running == 0
                                     ? "'resume_token_ids': every choice is finished, nothing is left "
                                       "to generate"
                                     : "'resume_token_ids': no choice has a token or a finish to go "
                                       "on from (send the request without it)");
    }
    return true;
}

/* The request body as a JSON object (depth-limited, duplicates refused, NUL bytes in strings kept). */
static json_t *parse_root(const char *body, size_t len, const pd_openai_limits_t *lim, pd_http_error_t *err)
{
    if (json_depth(body, len) > lim->max_depth) {
        pd_http_error_set(err, 400, "BadRequestError", NULL, "request JSON nests deeper than %d levels",
                          lim->max_depth);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (root == NULL) {
        pd_http_error_set(err, 400, "BadRequestError", NULL, "invalid JSON at line %d column %d: %s", je.line,
                          je.column, je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        pd_http_error_set(err, 400, "BadRequestError", NULL, "the request body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    json_t *model = json_object_get(root, "model");
    if (model != NULL && !json_is_null(model)) {
        if (!json_is_string(model)) {
            pd_api_want_type(err, "model", model, 0, "a string");
            json_decref(root);
            return NULL;
        }
        bool known = false;
        for (int i = 0; i < lim->num_model_names && !known; i++) {
            known = strcmp(json_string_value(model), lim->model_names[i]) == 0;
        }
        if (!known) {
            pd_http_error_set(err, 404, "NotFoundError", "model", "The model `%s` does not exist.",
                              json_string_value(model));
            json_decref(root);
            return NULL;
        }
    }
    return root;
}

/* logit_bias: {"token id": bias} with ids in the vocabulary, biases clamped to [-100, 100]. */
static bool parse_logit_bias(json_t *lb, const pd_openai_limits_t *lim, pd_request_params_t *p,
                             pd_http_error_t *err)
{
    if (lb == NULL || json_is_null(lb)) {
        return true;
    }
    if (!json_is_object(lb) || json_object_size(lb) > PD_MAX_LOGIT_BIAS) {
        return pd_http_error_set(err, 400, "BadRequestError", "logit_bias",
                                 "'logit_bias' must be an object of at most %d token ids to biases",
                                 PD_MAX_LOGIT_BIAS);
    }
    const char *k;
    json_t *v;
    json_object_foreach(lb, k, v)
    {
        char *end = NULL;
        long long id = strtoll(k, &end, 10);
        if (end == k || *end != '\0') {
            return pd_http_error_set(err, 400, "BadRequestError", "logit_bias",
                                     "logit_bias key '%s' cannot be converted to an integer token id", k);
        }
        if (id < 0 || id >= lim->vocab_size) {
            return pd_http_error_set(err, 400, "BadRequestError", "logit_bias",
                                     "token id %lld in logit_bias is outside the vocabulary [0, %d)", id,
                                     lim->vocab_size);
        }
        if (!json_is_number(v)) {
            return pd_api_want_type(err, "logit_bias", v, 0, "an object of numbers");
        }
        double b = json_number_value(v);
        b = b < -100 ? -100 : b > 100 ? 100 : b;
        p->logit_bias_ids[p->num_logit_bias] = (int32_t)id;
        p->logit_bias[p->num_logit_bias++] = (float)b;
    }
    return true;
}

/* bad_words as vLLM tokenizes them: each word (left-stripped) alone and with a leading space, the
 * spaced form kept when it is a different token sequence of the same length. */
static bool parse_bad_words(json_t *bw, const pd_tokenizer_t *tok, pd_request_params_t *p,
                            pd_http_error_t *err)
{
    if (bw == NULL || json_is_null(bw)) {
        return true;
    }
    if (!json_is_array(bw)) {
        return pd_api_want_type(err, "bad_words", bw, 0, "a list of strings");
    }
    int32_t used = 0;
    size_t i;
    json_t *v;
    json_array_foreach(bw, i, v)
    {
        if (!json_is_string(v) || json_string_length(v) == 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "bad_words",
                                     "bad_words must be non-empty strings (element %zu)", i);
        }
        const char *w = json_string_value(v);
        size_t wl = json_string_length(v);
        while (wl > 0 && (*w == ' ' || *w == '\t' || *w == '\n' || *w == '\r')) {
            w++, wl--;
        }
        int32_t first_len = -1, first0 = -1;
        for (int spaced = 0; spaced < 2; spaced++) {
            char *text = malloc(wl + 2);
            if (text == NULL) {
                return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
            }
            size_t tl = 0;
            if (spaced) {
                text[tl++] = ' ';
            }
            memcpy(text + tl, w, wl);
            tl += wl;
            int32_t *ids = NULL;
            size_t n = 0;
            pd_status_t st = pd_tokenizer_encode(tok, text, tl, false, &ids, &n);
            free(text);
            if (st != PD_OK) {
                return pd_http_error_set(err, 400, "BadRequestError", "bad_words",
                                         "bad_words[%zu] cannot be tokenized", i);
            }
            bool keep = n > 0 && (!spaced || (ids[0] != first0 && (int32_t)n == first_len));
            if (keep) {
                if (p->num_bad_words == PD_MAX_BAD_WORDS || used + (int32_t)n > PD_MAX_BAD_WORD_IDS) {
                    free(ids);
                    return pd_http_error_set(err, 400, "BadRequestError", "bad_words",
                                             "bad_words is too long (at most %d token sequences, %d tokens)",
                                             PD_MAX_BAD_WORDS, PD_MAX_BAD_WORD_IDS);
                }
                memcpy(p->bad_word_ids + used, ids, n * sizeof(int32_t));
                used += (int32_t)n;
                p->bad_word_end[p->num_bad_words++] = used;
            }
            if (!spaced) {
                first_len = (int32_t)n;
                first0 = n > 0 ? ids[0] : -1;
            }
            free(ids);
        }
    }
    return true;
}

static bool get_skip_special(json_t *root, pd_request_params_t *p, pd_http_error_t *err)
{
    bool skip = true;
    if (!pd_api_get_bool(root, "skip_special_tokens", &skip, err)) {
        return false;
    }
    p->keep_special_tokens = !skip;
    return true;
}

/* Penalties, min_p, min_tokens, logit_bias, bad_words, include_stop_str_in_output (vLLM's ranges). */
static bool parse_processors(json_t *root, const pd_tokenizer_t *tok, const pd_openai_limits_t *lim,
                             pd_request_params_t *p, pd_http_error_t *err)
{
    double pres = 0, freq = 0, rep = 1, min_p = 0;
    const pd_generation_config_t *g = lim->gen;
    if (g != NULL && g->has_repetition_penalty) { /* the model's defaults for omitted fields */
        rep = g->repetition_penalty;
    }
    if (g != NULL && g->has_min_p) {
        min_p = g->min_p;
    }
    int64_t min_tokens = 0;
    if (!pd_api_get_num(root, "presence_penalty", -2, 2, &pres, err) ||
        !pd_api_get_num(root, "frequency_penalty", -2, 2, &freq, err) ||
        !pd_api_get_num(root, "repetition_penalty", 1e-6, 1e6, &rep, err) ||
        !pd_api_get_num(root, "min_p", 0, 1, &min_p, err) ||
        !pd_api_get_int(root, "min_tokens", 0, INT32_MAX, &min_tokens, err) ||
        !pd_api_get_bool(root, "include_stop_str_in_output", &p->include_stop_str_in_output, err) ||
        !get_skip_special(root, p, err) ||
        !parse_logit_bias(json_object_get(root, "logit_bias"), lim, p, err) ||
        !parse_bad_words(json_object_get(root, "bad_words"), tok, p, err)) {
        return false;
    }
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    p->repetition_penalty = (float)rep;
    p->sampling.min_p = (float)min_p;
    p->min_tokens = (int32_t)min_tokens;
    return true;
}

/* Everything but the prompt: sampling, stops, streaming, logprobs, KV parameters. */
static bool parse_params(json_t *root, bool chat, const pd_tokenizer_t *tok, const pd_openai_limits_t *lim,
                         int64_t *max_tokens, pd_completion_req_t *out, pd_http_error_t *err)
{
    int64_t n = 1, top_k = -1, logprobs = -1, top_logprobs = 0;
    double temperature = 1.0, top_p = 1.0;
    bool echo = false, want_lp = false;
    const pd_generation_config_t *g = lim->gen;
    if (g != NULL) { /* the model's generation_config.json: defaults of omitted fields (vLLM's auto) */
        temperature = g->has_temperature ? g->temperature : temperature;
        top_p = g->has_top_p ? g->top_p : top_p;
        top_k = g->has_top_k ? g->top_k : top_k;
    }
    json_t *seed = json_object_get(root, "seed");
    pd_request_params_t *p = &out->params;
    if (!refuse_unimplemented(root, chat, err) || !pd_api_check_rewritten_fields(root, chat, err) ||
        !parse_processors(root, tok, lim, p, err) || !pd_api_get_int(root, "n", 1, 1000, &n, err) ||
        !pd_api_get_int(root, "max_tokens", 1, INT32_MAX, max_tokens, err) ||
        (chat && !pd_api_get_int(root, "max_completion_tokens", 1, INT32_MAX, max_tokens, err)) ||
        !pd_api_get_int(root, "top_k", -1, INT32_MAX, &top_k, err) ||
        !pd_api_get_num(root, "temperature", 0, 2, &temperature, err) ||
        !pd_api_get_num(root, "top_p", 1e-9, 1, &top_p, err) ||
        !pd_api_get_bool(root, "stream", &out->stream, err) ||
        !pd_api_get_bool(root, "ignore_eos", &p->ignore_eos, err) ||
        !pd_api_get_bool(root, "return_token_ids", &out->return_token_ids, err) ||
        !pd_structured_output_parse(root, &out->grammar, err)) {
        return false;
    }
    if (out->grammar != NULL && p->ignore_eos) {
        return pd_http_error_set(err, 400, "BadRequestError", "ignore_eos",
                                 "ignore_eos cannot be combined with a structured output (the grammar ends "
                                 "the reply with EOS)");
    }
    if (seed != NULL && !json_is_null(seed) &&
        !pd_api_want_type(err, "seed", seed, json_is_integer(seed), "an integer")) {
        return false;
    }
    if (chat) {
        if (!pd_api_get_bool(root, "logprobs", &want_lp, err) ||
            !pd_api_get_int(root, "top_logprobs", 0, 20, &top_logprobs, err)) {
            return false;
        }
        logprobs =
            want_lp ? top_logprobs : -1; /* top_logprobs without logprobs: pd_api_check_rewritten_fields */
    } else if (!pd_api_get_int(root, "logprobs", 0, 20, &logprobs, err) ||
               !pd_api_get_bool(root, "echo", &echo, err)) {
        return false;
    }
    if (n > 1 && temperature < 1e-5) {
        return pd_http_error_set(err, 400, "BadRequestError", "n",
                                 "n must be 1 when using greedy sampling, got %lld", (long long)n);
    }
    json_t *plp = json_object_get(root, "prompt_logprobs");
    if (plp != NULL && !json_is_null(plp)) {
        if (!json_is_integer(plp) || json_integer_value(plp) < 0 || json_integer_value(plp) > 20) {
            return pd_http_error_set(err, 400, "BadRequestError", "prompt_logprobs",
                                     "'prompt_logprobs' must be an integer in [0, 20]");
        }
        if (out->stream) {
            return pd_http_error_set(err, 400, "BadRequestError", "prompt_logprobs",
                                     "`prompt_logprobs` are not available when `stream=True`.");
        }
        /* a prefill (do_remote_decode) scores the prompt it computes, and pd-proxy puts the scores
         * into the decode's answer; a decode does not compute the prompt */
        json_t *kv = json_object_get(root, "kv_transfer_params");
        if (json_is_true(json_object_get(kv, "do_remote_prefill"))) {
            return pd_http_error_set(err, 400, "BadRequestError", "prompt_logprobs",
                                     "'prompt_logprobs' cannot be computed by a decode node: the prompt's KV "
                                     "comes from another node (the prefill scores it: send the request to "
                                     "pd-proxy or pd-serve)");
        }
        p->want_prompt_logprobs = true;
        p->prompt_logprobs = (int32_t)json_integer_value(plp);
    }
    if (echo && logprobs >= 0) { /* the prompt's tokens are scored too (vLLM's echo + logprobs) */
        json_t *kv = json_object_get(root, "kv_transfer_params");
        if (json_is_true(json_object_get(kv, "do_remote_prefill")) ||
            json_is_true(json_object_get(kv, "do_remote_decode"))) {
            return pd_http_error_set(err, 400, "BadRequestError", "echo",
                                     "'echo' with 'logprobs' scores the prompt, which is not supported for a "
                                     "disaggregated request yet (send it to pd-serve)");
        }
        p->want_prompt_logprobs = true;
        p->prompt_logprobs = p->prompt_logprobs > logprobs ? p->prompt_logprobs : (int32_t)logprobs;
    }
    out->n = (int32_t)n;
    out->echo = echo;
    json_t *so = json_object_get(root, "stream_options");
    if (so != NULL && !json_is_null(so)) {
        if (!json_is_object(so)) {
            return pd_api_want_type(err, "stream_options", so, 0, "an object");
        }
        if (!pd_api_get_bool(so, "include_usage", &out->include_usage, err)) {
            return false;
        }
    }
    json_t *salt = json_object_get(root, "cache_salt");
    if (salt != NULL && !json_is_null(salt)) {
        if (!json_is_string(salt) || json_string_length(salt) == 0) {
            return pd_http_error_set(err, 400, "BadRequestError", "cache_salt",
                                     "'cache_salt' must be a non-empty string");
        }
        pd_hash128_t h = pd_hash128(json_string_value(salt), json_string_length(salt), 0x73616c74);
        p->has_cache_salt = true;
        p->cache_salt[0] = h.lo;
        p->cache_salt[1] = h.hi;
    }
    json_t *sti = json_object_get(root, "stop_token_ids");
    if (sti != NULL && !json_is_null(sti)) {
        if (!json_is_array(sti) || json_array_size(sti) > PD_MAX_STOP_TOKEN_IDS) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop_token_ids",
                                     "'stop_token_ids' must be a list of at most %d token ids",
                                     PD_MAX_STOP_TOKEN_IDS);
        }
        size_t i;
        json_t *v;
        json_array_foreach(sti, i, v)
        {
            if (!json_is_integer(v)) {
                return pd_api_want_type(err, "stop_token_ids", v, 0, "a list of integers");
            }
            json_int_t id = json_integer_value(v); /* checked whole: 4294967698 is not token 402 */
            if (id < 0 || id >= lim->vocab_size) {
                return pd_http_error_set(err, 400, "BadRequestError", "stop_token_ids",
                                         "stop token id %lld is outside the vocabulary [0, %d)",
                                         (long long)id, lim->vocab_size);
            }
            p->stop_token_ids[p->num_stop_token_ids++] = (int32_t)id;
        }
    }
    if (!parse_stop(json_object_get(root, "stop"), out, err)) {
        return false;
    }
    json_t *ktp = json_object_get(root, "kv_transfer_params");
    if (ktp != NULL && !json_is_null(ktp)) {
        if (!json_is_object(ktp)) {
            return pd_api_want_type(err, "kv_transfer_params", ktp, 0, "an object");
        }
        /* first-token handover: the token the decode continues from is one of the vocabulary */
        json_t *ft = json_object_get(ktp, "first_token_id");
        if (ft != NULL && !json_is_null(ft) &&
            (!json_is_integer(ft) || json_integer_value(ft) < 0 ||
             json_integer_value(ft) >= lim->vocab_size)) {
            return pd_http_error_set(err, 400, "BadRequestError", "kv_transfer_params",
                                     "kv_transfer_params.first_token_id must be a token id in [0, %d)",
                                     lim->vocab_size);
        }
        out->kv_transfer_params = json_incref(ktp);
    }
    /* vLLM raises temperatures in (0, 0.01) to 0.01 (numerics), and treats seed -1 as no seed */
    p->sampling.temperature = (float)(temperature > 0 && temperature < 0.01 ? 0.01 : temperature);
    p->sampling.top_p = (float)top_p;
    p->sampling.top_k = (int32_t)(top_k > 0 ? top_k : 0);
    p->has_seed = seed != NULL && json_is_integer(seed) && json_integer_value(seed) != -1;
    p->seed = p->has_seed ? (uint64_t)json_integer_value(seed) : 0;
    out->logprobs = (int32_t)logprobs;
    p->logprobs =
        logprobs > 0 ? (int32_t)logprobs : (logprobs == 0 ? 1 : 0); /* 0: the sampled token's only */
    out->chat = chat;
    return true;
}

/* The prompt + max_tokens against max_model_len, then the engine fields. */
static bool finish_request(const json_t *root, const pd_openai_limits_t *lim, int64_t max_tokens,
                           pd_completion_req_t *out, pd_http_error_t *err)
{
    for (int32_t i = 0; i < out->num_prompts; i++) {
        int32_t np = out->prompts[i].len;
        if (np >= lim->max_model_len || (int64_t)np + max_tokens > lim->max_model_len) {
            return pd_http_error_set(
                err, 400, "BadRequestError", "max_tokens",
                "This model's maximum context length is %d tokens. However, you requested %lld tokens (%d "
                "in the prompt, %lld in the completion). Please reduce the length of the prompt or "
                "completion.",
                lim->max_model_len, (long long)(np + max_tokens), np, (long long)max_tokens);
        }
    }
    if ((int64_t)out->num_prompts * out->n > PD_MAX_CHOICES) {
        return pd_http_error_set(err, 400, "BadRequestError", "n",
                                 "at most %d choices per request (%d prompts x n %d)", PD_MAX_CHOICES,
                                 out->num_prompts, out->n);
    }
    for (int32_t i = 0; i < out->params.num_stop_token_ids; i++) {
        int32_t id = out->params.stop_token_ids[i];
        if (id < 0 || id >= lim->vocab_size) {
            return pd_http_error_set(err, 400, "BadRequestError", "stop_token_ids",
                                     "stop token id %d is outside the vocabulary [0, %d)", id,
                                     lim->vocab_size);
        }
    }
    if (out->params.min_tokens > max_tokens) {
        return pd_http_error_set(err, 400, "BadRequestError", "min_tokens",
                                 "min_tokens must be less than or equal to max_tokens=%lld, got %d",
                                 (long long)max_tokens, out->params.min_tokens);
    }
    out->params.max_tokens = (int32_t)max_tokens;
    return parse_resume(json_object_get(root, "resume_token_ids"), lim, out, err);
}

bool pd_openai_parse_completion(const char *body, size_t len, const pd_tokenizer_t *tok,
                                const pd_openai_limits_t *lim, pd_completion_req_t *out, pd_http_error_t *err)
{
    memset(out, 0, sizeof(*out));
    out->logprobs = -1;
    json_t *root = parse_root(body, len, lim, err);
    if (root == NULL) {
        return false;
    }
    int64_t max_tokens = 16;
    bool add_special = true;
    bool ok = parse_params(root, false, tok, lim, &max_tokens, out, err) &&
              pd_api_get_bool(root, "add_special_tokens", &add_special, err) &&
              parse_prompt(json_object_get(root, "prompt"), tok, add_special, lim, out, err) &&
              finish_request(root, lim, max_tokens, out, err);
    json_decref(root);
    if (!ok) {
        pd_completion_req_free(out);
    }
    return ok;
}

/* tool_choice "auto" — what a request with tools means when it names no choice, as vLLM reads it —
 * asks the server to read tool calls out of the reply: with a parser (--enable-auto-tool-choice
 * --tool-call-parser) the request gets it (out->tool_parser, and the special tokens the calls are
 * written with are kept in the text for hermes and mistral, as vLLM's parsers ask); without one it
 * is refused, as vLLM refuses it, rather than answered with the calls left in the text. "none"
 * renders the tools into the prompt and leaves the reply as text. Checked after the tools
 * themselves were validated (pd_chat_render). */
static bool auto_tool_choice_refused(const json_t *root, const pd_openai_limits_t *lim,
                                     pd_completion_req_t *out, pd_http_error_t *err)
{
    const json_t *tools = json_object_get(root, "tools");
    const json_t *tc = json_object_get(root, "tool_choice");
    bool choice_auto =
        tc == NULL || json_is_null(tc) || (json_is_string(tc) && strcmp(json_string_value(tc), "auto") == 0);
    if (json_array_size(tools) == 0 || !choice_auto) {
        return false;
    }
    if (lim->tool_parser == PD_TOOL_PARSER_NONE) {
        pd_http_error_set(err, 400, "BadRequestError", "tool_choice",
                          "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to "
                          "be set (it is the default with tools): send \"tool_choice\": \"none\" to have "
                          "the tools rendered into the prompt and the reply returned as text");
        return true;
    }
    /* through P/D with the first-token handover, this node sees only part of the reply (the prefill
     * streams the first token, the decode the rest): no node could read the calls whole */
    if (json_is_true(json_object_get(json_object_get(root, "kv_transfer_params"), "first_token"))) {
        pd_http_error_set(
            err, 400, "BadRequestError", "tool_choice",
            "tool calls are read out of a whole reply, and with the first-token handover no node "
            "generates the whole reply: run pd-proxy with --no-first-token-from-prefill for "
            "requests with tools and tool_choice \"auto\"");
        return true;
    }
    out->tool_parser = lim->tool_parser;
    if (lim->tool_parser != PD_TOOL_PARSER_LLAMA3_JSON) {
        out->params.keep_special_tokens = true; /* <tool_call> / [TOOL_CALLS] may be special tokens */
    }
    return false;
}

/* tool_choice "required" or a named function, as vLLM serves them (no server flag needed): the reply
 * is written under a grammar — for "required" a JSON list of {"name": one of the tools, "parameters":
 * its schema}, for a named function that function's parameters — and read back as the tool calls.
 * Checked after the tools were validated (pd_chat_render). */
static bool forced_tool_choice(const json_t *root, pd_completion_req_t *out, pd_http_error_t *err)
{
    const json_t *tools = json_object_get(root, "tools"), *tc = json_object_get(root, "tool_choice");
    bool required = json_is_string(tc) && strcmp(json_string_value(tc), "required") == 0;
    const char *name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
    if (!required && name == NULL) {
        return true;
    }
    if (json_array_size(tools) == 0) {
        return pd_http_error_set(err, 400, "BadRequestError", "tool_choice",
                                 "tool_choice \"required\" or a named function needs \"tools\"");
    }
    if (json_is_true(json_object_get(json_object_get(root, "kv_transfer_params"), "first_token"))) {
        return pd_http_error_set(
            err, 400, "BadRequestError", "tool_choice",
            "tool calls are read out of a whole reply, and with the first-token handover "
            "no node generates the whole reply: pd-proxy sends such requests without it");
    }
    if (out->grammar != NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "tool_choice",
                                 "a forced tool choice writes the reply under its own grammar: it cannot be "
                                 "combined with response_format, structured_outputs or guided_*");
    }
    json_t *schema = NULL, *branches = json_array(), *defs = json_object();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        const json_t *fn = json_object_get(t, "function");
        const char *tn = json_string_value(json_object_get(fn, "name"));
        json_t *params = json_deep_copy(json_object_get(fn, "parameters"));
        if (params == NULL) { /* a function without parameters takes an empty object */
            params = json_pack("{s:s, s:{}}", "type", "object", "properties");
        }
        json_t *pdefs = json_object_get(params, "$defs"); /* lifted to the root, where $refs point */
        const char *k;
        json_t *v;
        json_object_foreach(pdefs, k, v)
        {
            json_t *have = json_object_get(defs, k);
            if (have != NULL && !json_equal(have, v)) {
                json_decref(params), json_decref(branches), json_decref(defs), json_decref(schema);
                return pd_http_error_set(err, 400, "BadRequestError", "tools",
                                         "tools define $defs '%s' differently", k);
            }
            json_object_set(defs, k, v);
        }
        json_object_del(params, "$defs");
        if (name != NULL && tn != NULL && strcmp(tn, name) == 0) {
            json_decref(schema);
            schema = params;
            params = NULL;
        } else if (required) {
            json_array_append_new(branches,
                                  json_pack("{s:s, s:{s:{s:s, s:[s]}, s:o}, s:[s, s], s:b}", "type", "object",
                                            "properties", "name", "type", "string", "enum",
                                            tn != NULL ? tn : "", "parameters", params, "required", "name",
                                            "parameters", "additionalProperties", 0));
            params = NULL;
        }
        json_decref(params);
    }
    if (name != NULL && schema == NULL) {
        json_decref(branches), json_decref(defs);
        return pd_http_error_set(err, 400, "BadRequestError", "tool_choice",
                                 "tool_choice names function '%s', which is not in \"tools\"", name);
    }
    if (required) {
        schema = json_pack("{s:s, s:i, s:{s:o}}", "type", "array", "minItems", 1, "items", "anyOf", branches);
        branches = NULL;
    }
    json_decref(branches);
    if (json_object_size(defs) > 0) {
        json_object_set(schema, "$defs", defs);
    }
    json_decref(defs);
    json_t *body = json_pack("{s:O}", "guided_json", schema);
    json_decref(schema);
    bool ok = pd_structured_output_parse(body, &out->grammar, err);
    json_decref(body);
    if (!ok) {
        err->param = "tools"; /* the schema came from there */
        return false;
    }
    out->tool_parser = required ? PD_TOOL_PARSER_REQUIRED : PD_TOOL_PARSER_NAMED;
    if (name != NULL && (out->tool_name = strdup(name)) == NULL) {
        return pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
    }
    return true;
}

bool pd_openai_parse_chat(const char *body, size_t len, const pd_tokenizer_t *tok, const pd_chat_t *chat,
                          const pd_openai_limits_t *lim, pd_completion_req_t *out, pd_http_error_t *err)
{
    memset(out, 0, sizeof(*out));
    out->logprobs = -1;
    json_t *root = parse_root(body, len, lim, err);
    if (root == NULL) {
        return false;
    }
    int64_t max_tokens = 0; /* vLLM: up to the context length */
    pd_chat_request_t cr;
    pd_chat_request_init(&cr, root);
    char *prompt = NULL;
    size_t plen = 0;
    bool add_special = false; /* the template writes the special tokens itself (vLLM's default for chat) */
    bool ok = parse_params(root, true, tok, lim, &max_tokens, out, err) &&
              pd_api_get_bool(root, "add_special_tokens", &add_special, err) &&
              pd_api_get_bool(root, "add_generation_prompt", &cr.add_generation_prompt, err) &&
              pd_api_get_bool(root, "continue_final_message", &cr.continue_final_message, err);
    if (ok && cr.messages == NULL) {
        ok = pd_http_error_set(err, 400, "BadRequestError", "messages", "'messages' is required");
    }
    ok = ok && pd_chat_render(chat, &cr, &prompt, &plen, err) &&
         !auto_tool_choice_refused(root, lim, out, err) && forced_tool_choice(root, out, err);
    if (ok) {
        size_t n = 0;
        int32_t *ids = NULL;
        if (pd_tokenizer_encode(tok, prompt, plen, add_special, &ids, &n) != PD_OK) {
            ok = pd_http_error_set(err, 400, "BadRequestError", "messages",
                                   "the rendered chat could not be tokenized");
        } else if (n == 0) {
            free(ids);
            ok = pd_http_error_set(err, 400, "BadRequestError", "messages",
                                   "the rendered chat prompt is empty");
        } else {
            ok = add_prompt(out, ids, (int32_t)n, err);
        }
    }
    free(prompt);
    if (ok && max_tokens == 0) {
        max_tokens = lim->max_model_len - out->prompts[0].len;
        if (max_tokens < 1) {
            max_tokens = 1; /* finish_request reports the overflow */
        }
    }
    ok = ok && finish_request(root, lim, max_tokens, out, err);
    json_decref(root);
    if (!ok) {
        pd_completion_req_free(out);
    }
    return ok;
}

void pd_completion_req_free(pd_completion_req_t *r)
{
    for (int32_t i = 0; i < r->num_prompts; i++) {
        free(r->prompts[i].ids);
        free(r->prompts[i].text);
    }
    free(r->prompts);
    for (int32_t i = 0; i < r->num_stop; i++) {
        free(r->stop[i]);
    }
    json_decref(r->kv_transfer_params);
    pd_grammar_unref(r->grammar);
    free(r->tool_name);
    for (int32_t k = 0; r->resume != NULL && k < r->num_prompts * r->n; k++) {
        free(r->resume[k].ids);
    }
    free(r->resume);
    memset(r, 0, sizeof(*r));
    r->logprobs = -1;
}
