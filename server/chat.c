/* server/chat.c — chat template loading and message rendering (see chat.h). */
#define _GNU_SOURCE
#include "server/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"
#include "template/template.h"

struct pd_chat {
    pd_template_t *tpl; /* NULL: the model has no chat template, or one we cannot parse (error) */
    char error[512];    /* why the model's own template is unusable ("" = it is fine or absent) */
    char source[64];
    json_t *special; /* {"bos_token": "...", ...} for the render context */
};

/* A special token as tokenizer_config.json writes it: a string or {"content": "..."}. */
static const char *token_text(const json_t *v)
{
    if (json_is_string(v)) {
        return json_string_value(v);
    }
    if (json_is_object(v) && json_is_string(json_object_get(v, "content"))) {
        return json_string_value(json_object_get(v, "content"));
    }
    return NULL;
}

static char *read_text(const char *path, size_t max, size_t *len_out)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        return NULL;
    }
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && (size_t)n <= max && fseek(f, 0, SEEK_SET) == 0 &&
            (buf = malloc((size_t)n + 1)) != NULL) {
            if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
                free(buf);
                buf = NULL;
            } else {
                buf[n] = '\0';
                *len_out = (size_t)n;
            }
        }
    }
    fclose(f);
    return buf;
}

/* A --chat-template the operator gave must parse (the node does not start otherwise); the model's
 * own one that does not (a construct pdserve's Jinja lacks) leaves the node serving completions, and
 * chat requests get a 400 that says why. */
static pd_status_t parse_template(pd_chat_t *c, const char *src, size_t len, const char *where, bool fatal)
{
    pd_template_error_t err;
    pd_status_t st = pd_template_parse(src, len, &c->tpl, &err);
    if (st != PD_OK) {
        pd_log_error(
            "chat template from %s does not parse: line %d column %d: %s%s", where, err.line, err.column,
            err.message,
            fatal ? "" : " (serving on: /v1/chat/completions answers 400 until --chat-template is given)");
        if (fatal || st == PD_ERR_NO_MEMORY) {
            return st;
        }
        c->tpl = NULL;
        snprintf(
            c->error, sizeof(c->error),
            "this model's chat template (%s) cannot be rendered by pdserve: line %d column %d: %s; start "
            "the server with --chat-template, or use /v1/completions",
            where, err.line, err.column, err.message);
        return PD_OK;
    }
    snprintf(c->source, sizeof(c->source), "%s", where);
    return PD_OK;
}

pd_status_t pd_chat_load(const char *model_dir, const char *override, pd_chat_t **chat_out)
{
    pd_chat_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    c->special = json_object();
    char path[4096];
    json_t *tcfg = NULL;
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", model_dir);
    if (access(path, R_OK) == 0) {
        json_error_t je;
        /* JSON_DECODE_INT_AS_REAL: model_max_length is often 1e30, past int64 */
        tcfg = json_load_file(path, JSON_DECODE_INT_AS_REAL | JSON_ALLOW_NUL, &je);
        if (tcfg == NULL) {
            pd_log_error("%s:%d:%d: invalid JSON: %s", path, je.line, je.column, je.text);
            pd_chat_free(c);
            return PD_ERR_PARSE;
        }
        static const char *const names[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
            const char *t = token_text(json_object_get(tcfg, names[i]));
            if (t != NULL) {
                json_object_set_new(c->special, names[i], json_string(t));
            }
        }
    }
    pd_status_t st = PD_OK;
    size_t len = 0;
    char *src = NULL;
    if (override != NULL && override[0] != '\0') {
        src = read_text(override, 16u << 20, &len);
        if (src != NULL) {
            st = parse_template(c, src, len, "--chat-template file", true);
        } else {
            st = parse_template(c, override, strlen(override), "--chat-template", true);
        }
    } else if (snprintf(path, sizeof(path), "%s/chat_template.jinja", model_dir) > 0 &&
               (src = read_text(path, 16u << 20, &len)) != NULL) {
        st = parse_template(c, src, len, "chat_template.jinja", false);
    } else if (tcfg != NULL) {
        json_t *ct = json_object_get(tcfg, "chat_template");
        if (json_is_array(ct)) { /* named templates: the default one */
            json_t *pick = NULL;
            size_t i;
            json_t *v;
            json_array_foreach(ct, i, v)
            {
                const char *name = json_string_value(json_object_get(v, "name"));
                if (name != NULL && strcmp(name, "default") == 0) {
                    pick = json_object_get(v, "template");
                }
            }
            ct = pick;
        }
        if (json_is_string(ct)) {
            st = parse_template(c, json_string_value(ct), json_string_length(ct), "tokenizer_config.json",
                                false);
        }
    }
    free(src);
    json_decref(tcfg);
    if (st != PD_OK) {
        pd_chat_free(c);
        return st;
    }
    if (c->tpl != NULL) {
        pd_log_info("chat template from %s (content format: %s)", c->source,
                    pd_template_iterates_content(c->tpl) ? "openai" : "string");
    } else if (c->error[0] == '\0') {
        pd_log_info("%s has no chat template: /v1/chat/completions answers 400 (give --chat-template)",
                    model_dir);
    }
    *chat_out = c;
    return PD_OK;
}

void pd_chat_free(pd_chat_t *c)
{
    if (c == NULL) {
        return;
    }
    pd_template_free(c->tpl);
    json_decref(c->special);
    free(c);
}

bool pd_chat_has_template(const pd_chat_t *c)
{
    return c != NULL && c->tpl != NULL;
}

const char *pd_chat_template_source(const pd_chat_t *c)
{
    return c != NULL && c->tpl != NULL ? c->source : "none";
}

/* ------------------------------------------------------------------ messages */

static bool bad(pd_http_error_t *err, const char *param, const char *fmt, const char *a, size_t i)
{
    char msg[256];
    snprintf(msg, sizeof(msg), fmt, i, a);
    return pd_http_error_set(err, 400, "BadRequestError", param, "%s", msg);
}

/* content → a string (text parts joined by "\n") or a list of {"type": "text", "text": ...}. */
static json_t *norm_content(const json_t *content, bool as_parts, size_t i, pd_http_error_t *err)
{
    if (content == NULL || json_is_null(content)) {
        return as_parts ? json_array() : json_string("");
    }
    if (json_is_string(content)) {
        if (!as_parts) {
            return json_incref((json_t *)content);
        }
        return json_pack("[{s:s, s:O}]", "type", "text", "text", content);
    }
    if (!json_is_array(content)) {
        bad(err, "messages", "messages[%zu].content must be a string, null or a list of parts, got %s",
            pd_json_type_name(content), i);
        return NULL;
    }
    json_t *parts = json_array();
    size_t k;
    json_t *p;
    json_array_foreach((json_t *)content, k, p)
    {
        const char *type = json_string_value(json_object_get(p, "type"));
        json_t *text = json_object_get(p, "text");
        if (json_is_string(p)) { /* a bare string part */
            text = p;
            type = "text";
        }
        if (type == NULL || strcmp(type, "text") != 0 || !json_is_string(text)) {
            json_decref(parts);
            bad(err, "messages",
                "messages[%zu].content: only text parts ({\"type\": \"text\", \"text\": ...}) are supported, "
                "got "
                "'%s'",
                type != NULL ? type : "a part without a type", i);
            return NULL;
        }
        json_array_append_new(parts, json_pack("{s:s, s:O}", "type", "text", "text", text));
    }
    if (as_parts) {
        return parts;
    }
    size_t total = 0;
    json_array_foreach(parts, k, p)
    {
        total += json_string_length(json_object_get(p, "text")) + 1;
    }
    char *buf = malloc(total + 1);
    size_t n = 0;
    json_array_foreach(parts, k, p)
    {
        json_t *t = json_object_get(p, "text");
        if (k > 0) {
            buf[n++] = '\n';
        }
        memcpy(buf + n, json_string_value(t), json_string_length(t));
        n += json_string_length(t);
    }
    json_t *s = json_stringn_nocheck(buf, n);
    free(buf);
    json_decref(parts);
    return s;
}

/* Assistant tool calls, with function.arguments given as a JSON string turned into its value. */
static json_t *norm_tool_calls(const json_t *calls, size_t i, pd_http_error_t *err)
{
    if (!json_is_array(calls)) {
        bad(err, "messages", "messages[%zu].tool_calls must be a list%s", "", i);
        return NULL;
    }
    json_t *out = json_deep_copy(calls);
    size_t k;
    json_t *tc;
    json_array_foreach(out, k, tc)
    {
        json_t *fn = json_object_get(tc, "function");
        if (!json_is_object(fn) || !json_is_string(json_object_get(fn, "name"))) {
            json_decref(out);
            bad(err, "messages", "messages[%zu].tool_calls: each call needs function.name%s", "", i);
            return NULL;
        }
        json_t *args = json_object_get(fn, "arguments");
        if (args == NULL || json_is_null(args) || (json_is_string(args) && json_string_length(args) == 0)) {
            json_object_set_new(fn, "arguments", json_object());
        } else if (json_is_string(args)) {
            json_error_t je;
            json_t *v = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, &je);
            if (v == NULL) {
                json_decref(out);
                bad(err, "messages", "messages[%zu].tool_calls: function.arguments is not valid JSON%s", "",
                    i);
                return NULL;
            }
            json_object_set_new(fn, "arguments", v);
        }
    }
    return out;
}

static json_t *norm_messages(const json_t *messages, bool as_parts, pd_http_error_t *err)
{
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        pd_http_error_set(err, 400, "BadRequestError", "messages", "'messages' must be a non-empty list");
        return NULL;
    }
    json_t *out = json_array();
    size_t i;
    json_t *m;
    json_array_foreach((json_t *)messages, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!json_is_object(m) || role == NULL) {
            json_decref(out);
            bad(err, "messages", "messages[%zu] must be an object with a string 'role'%s", "", i);
            return NULL;
        }
        bool tool = strcmp(role, "tool") == 0, assistant = strcmp(role, "assistant") == 0;
        /* a tool result's text parts are joined (vLLM: most templates take a tool's content as a
         * string) */
        json_t *content = norm_content(json_object_get(m, "content"), as_parts && !tool, i, err);
        if (content == NULL) {
            json_decref(out);
            return NULL;
        }
        json_t *nm = json_pack("{s:s, s:o}", "role", role, "content", content);
        if (nm == NULL) {
            json_decref(out);
            pd_http_error_set(err, 500, "InternalServerError", NULL, "out of memory");
            return NULL;
        }
        static const char *const keep[] = {"name", "tool_call_id"};
        for (size_t k = 0; k < sizeof(keep) / sizeof(keep[0]); k++) {
            json_t *v = json_object_get(m, keep[k]);
            if (v != NULL && !json_is_null(v)) {
                json_object_set(nm, keep[k], v);
            }
        }
        json_t *reasoning = json_object_get(m, "reasoning");
        if (reasoning == NULL || json_is_null(reasoning)) {
            reasoning = json_object_get(m, "reasoning_content");
        }
        if (assistant && reasoning != NULL && !json_is_null(reasoning)) { /* both names, as vLLM */
            json_object_set(nm, "reasoning", reasoning);
            json_object_set(nm, "reasoning_content", reasoning);
        }
        json_t *calls = json_object_get(m, "tool_calls");
        /* an empty list is dropped: templates then take the plain assistant path (the replies carry
         * "tool_calls": [], and Llama 3.1's template refuses a message with none) */
        if (assistant && calls != NULL && !json_is_null(calls) &&
            !(json_is_array(calls) && json_array_size(calls) == 0)) {
            json_t *tc = norm_tool_calls(calls, i, err);
            if (tc == NULL) {
                json_decref(nm);
                json_decref(out);
                return NULL;
            }
            json_object_set_new(nm, "tool_calls", tc);
        }
        json_array_append_new(out, nm);
    }
    return out;
}

/* Tools as vLLM hands them to templates: {"type", "function": {"name", "description", "parameters"}}. */
static json_t *norm_tools(const json_t *tools, pd_http_error_t *err)
{
    if (tools == NULL || json_is_null(tools)) {
        return json_null();
    }
    if (!json_is_array(tools)) {
        pd_http_error_set(err, 400, "BadRequestError", "tools", "'tools' must be a list");
        return NULL;
    }
    json_t *out = json_array(); /* [] stays [] (vLLM): `tools is not none` templates see a list */
    size_t i;
    json_t *t;
    json_array_foreach((json_t *)tools, i, t)
    {
        json_t *fn = json_object_get(t, "function");
        const char *type = json_string_value(json_object_get(t, "type"));
        if (type == NULL || strcmp(type, "function") != 0 || !json_is_object(fn) ||
            !json_is_string(json_object_get(fn, "name"))) {
            json_decref(out);
            pd_http_error_set(err, 400, "BadRequestError", "tools",
                              "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              i);
            return NULL;
        }
        json_t *desc = json_object_get(fn, "description"), *params = json_object_get(fn, "parameters");
        json_array_append_new(out, json_pack("{s:s, s:{s:O, s:O, s:O}}", "type", "function", "function",
                                             "name", json_object_get(fn, "name"), "description",
                                             desc != NULL ? desc : json_null(), "parameters",
                                             params != NULL ? params : json_null()));
    }
    return out;
}

/* The text of the final message (its last text part for part lists). */
static const char *final_text(const json_t *messages, size_t *len)
{
    json_t *c = json_object_get(json_array_get(messages, json_array_size(messages) - 1), "content");
    if (json_is_array(c)) {
        for (size_t i = json_array_size(c); i-- > 0;) {
            json_t *t = json_object_get(json_array_get(c, i), "text");
            if (json_is_string(t)) {
                *len = json_string_length(t);
                return json_string_value(t);
            }
        }
        return NULL;
    }
    *len = json_string_length(c);
    return json_string_value(c);
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* transformers' continue_final_message: cut the render after the final message's text. */
static bool cut_after_final(const json_t *messages, char *out, size_t *len, pd_http_error_t *err)
{
    size_t fl = 0;
    const char *f = final_text(messages, &fl);
    if (f == NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "continue_final_message",
                                 "continue_final_message is set but the final message has no text");
    }
    size_t b = 0, e = fl; /* final_message.strip() */
    while (b < e && is_ws(f[b])) {
        b++;
    }
    while (e > b && is_ws(f[e - 1])) {
        e--;
    }
    const char *hit = NULL;
    for (size_t i = *len + 1; i-- > 0 && hit == NULL;) { /* rindex */
        if (i + (e - b) <= *len && memcmp(out + i, f + b, e - b) == 0) {
            hit = out + i;
        }
    }
    if (hit == NULL) {
        return pd_http_error_set(err, 400, "BadRequestError", "continue_final_message",
                                 "continue_final_message is set but the final message does not appear in the "
                                 "chat after applying the chat template");
    }
    size_t loc = (size_t)(hit - out);
    if (b == 0 && loc + fl <= *len && memcmp(out + loc, f, fl) == 0) {
        *len = loc + fl; /* the template kept the message's trailing spacing */
    } else {
        *len = loc + (e - b);
    }
    out[*len] = '\0';
    return true;
}

void pd_chat_request_init(pd_chat_request_t *cr, const json_t *root)
{
    memset(cr, 0, sizeof(*cr));
    cr->messages = json_object_get(root, "messages");
    cr->tools = json_object_get(root, "tools");
    cr->chat_template_kwargs = json_object_get(root, "chat_template_kwargs");
    cr->documents = json_object_get(root, "documents");
    cr->reasoning_effort = json_object_get(root, "reasoning_effort");
    json_t *agp = json_object_get(root, "add_generation_prompt"),
           *cfm = json_object_get(root, "continue_final_message");
    cr->add_generation_prompt = !json_is_boolean(agp) || json_is_true(agp);
    cr->continue_final_message = json_is_true(cfm);
}

/* documents and reasoning_effort as template variables (vLLM's request fields; chat_template_kwargs
 * may set them too, and wins). */
static bool top_level_vars(const pd_chat_request_t *req, json_t *ctx, pd_http_error_t *err)
{
    const json_t *d = req->documents, *r = req->reasoning_effort;
    if (d != NULL && !json_is_null(d)) {
        bool ok = json_is_array(d);
        for (size_t i = 0; ok && i < json_array_size(d); i++) {
            ok = json_is_object(json_array_get(d, i));
        }
        if (!ok) {
            return pd_http_error_set(
                err, 400, "BadRequestError", "documents",
                "'documents' must be a list of objects (e.g. {\"title\": ..., \"text\": ...})");
        }
        json_object_set(ctx, "documents", (json_t *)d);
    }
    if (r != NULL && !json_is_null(r)) {
        const char *v = json_string_value(r);
        if (v == NULL || (strcmp(v, "low") != 0 && strcmp(v, "medium") != 0 && strcmp(v, "high") != 0)) {
            return pd_http_error_set(err, 400, "BadRequestError", "reasoning_effort",
                                     "'reasoning_effort' must be one of 'low', 'medium', 'high'");
        }
        json_object_set(ctx, "reasoning_effort", (json_t *)r);
    }
    return true;
}

bool pd_chat_render(const pd_chat_t *c, const pd_chat_request_t *req, char **prompt_out, size_t *len_out,
                    pd_http_error_t *err)
{
    if (c != NULL && c->error[0] != '\0') {
        return pd_http_error_set(err, 400, "BadRequestError", NULL, "%s", c->error);
    }
    if (!pd_chat_has_template(c)) {
        return pd_http_error_set(
            err, 400, "BadRequestError", NULL,
            "this model has no chat template (no chat_template.jinja or tokenizer_config.json "
            "chat_template): start the server with --chat-template, or use /v1/completions");
    }
    if (req->add_generation_prompt && req->continue_final_message) {
        return pd_http_error_set(
            err, 400, "BadRequestError", "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
    }
    json_t *messages = norm_messages(req->messages, pd_template_iterates_content(c->tpl), err);
    if (messages == NULL) {
        return false;
    }
    json_t *tools = norm_tools(req->tools, err);
    if (tools == NULL) {
        json_decref(messages);
        return false;
    }
    json_t *ctx = json_deep_copy(c->special);
    if (!top_level_vars(req, ctx, err)) {
        json_decref(ctx), json_decref(messages), json_decref(tools);
        return false;
    }
    if (req->chat_template_kwargs != NULL && !json_is_null(req->chat_template_kwargs)) {
        if (!json_is_object(req->chat_template_kwargs)) {
            json_decref(ctx), json_decref(messages), json_decref(tools);
            return pd_http_error_set(err, 400, "BadRequestError", "chat_template_kwargs",
                                     "'chat_template_kwargs' must be an object");
        }
        json_object_update(ctx, (json_t *)req->chat_template_kwargs);
    }
    json_object_set_new(ctx, "messages", messages);
    json_object_set_new(ctx, "tools", tools);
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(req->add_generation_prompt));
    char *out = NULL;
    size_t len = 0;
    pd_template_error_t terr;
    /* renders run on the HTTP loop thread: a few ms for real chats (tens of thousands of steps);
     * a hostile or runaway one stops at these bounds instead of stalling the loop */
    pd_template_limits_t lim;
    pd_template_limits_default(&lim);
    lim.max_steps = 2u * 1000 * 1000;
    lim.max_memory = 64u << 20;
    lim.max_output = 8u << 20;
    pd_status_t st = pd_template_render(c->tpl, ctx, &lim, &out, &len, &terr);
    bool ok = true;
    if (st != PD_OK) {
        if (terr.line > 0) {
            ok = pd_http_error_set(err, 400, "BadRequestError", "messages",
                                   "chat template error at line %d column %d: %s", terr.line, terr.column,
                                   terr.message);
        } else {
            ok = pd_http_error_set(err, 400, "BadRequestError", "messages", "chat template error: %s",
                                   terr.message);
        }
    } else if (req->continue_final_message) {
        ok = cut_after_final(messages, out, &len, err);
    }
    json_decref(ctx);
    if (!ok) {
        free(out);
        return false;
    }
    *prompt_out = out;
    *len_out = len;
    return true;
}
