#define _GNU_SOURCE /* strcasestr, strndup: before any system header */
/* tests/unit/test_chat.c — /v1/chat/completions and the API endpoints around it on real pd-serve
 * processes (loopback, ports from --port-file, every process stopped at the end): chat equals a
 * completion of the rendered prompt, stream and logprob shapes, template sources (--chat-template,
 * chat_template.jinja, tokenizer_config.json, none, one that does not parse), continue_final_message,
 * tools rendered into the prompt, every refusal named, /tokenize /detokenize /version /ping
 * /v1/models/{id} and HEAD, seeds and request ids; the official openai npm client (latest and v4)
 * with tools against pd-serve and through a P/D proxy whose decode node must load the KV. */
#include "http_client.h"
#include "test_util.h"

#include <check.h>
#include <jansson.h>
#include <stdbool.h>

#include "common/log.h"
#include "common/metrics.h"
#include "scheduler/request.h"

static char *g_model, *g_gpt2, *g_dir;
static pid_t g_pid = -1;
static int g_port = -1;

static pid_t start_bin(const char *bin, const char *model, const char *tag, char *const extra[],
                       int *port_out, bool must_start)
{
    char port_file[512], log_file[512], path[512];
    snprintf(port_file, sizeof(port_file), "%s/%s.port", g_dir, tag);
    snprintf(log_file, sizeof(log_file), "%s/%s.log", g_dir, tag);
    snprintf(path, sizeof(path), "%s/bin/%s", tu_binary_dir(), bin);
    unlink(port_file);
    char *argv[48] = {path, "--port", "0", "--port-file", port_file};
    int n = 5;
    if (model != NULL) {
        char *more[] = {"--model",
                        (char *)model,
                        "--kv-cache-memory",
                        "256M",
                        "--max-model-len",
                        "512",
                        "--threads",
                        "1",
                        "--served-model-name",
                        "m",
                        NULL};
        for (int i = 0; more[i] != NULL; i++) {
            argv[n++] = more[i];
        }
    }
    for (int i = 0; extra != NULL && extra[i] != NULL; i++) {
        argv[n++] = extra[i];
    }
    argv[n] = NULL;
    pid_t pid = tu_spawn(argv, log_file);
    ck_assert_int_gt(pid, 0);
    *port_out = tu_wait_port(pid, port_file, must_start ? 120 : 20);
    if (must_start) {
        ck_assert_msg(*port_out > 0, "%s (%s) did not start; see %s", bin, tag, log_file);
    }
    return pid;
}

static void suite_setup(void)
{
    pd_log_set_level(PD_LOG_WARN);
    g_model = tu_make_model("--preset tiny --arch llama");
    g_gpt2 = tu_make_model("--preset tiny --arch gpt2");
    g_dir = tu_mkdtemp("chat");
    ck_assert_ptr_nonnull(g_model);
    g_pid = start_bin("pd-serve", g_model, "main", NULL, &g_port, true);
}

/* The structured-output case: a longer context (tool definitions render long in this vocabulary). */
static void structured_setup(void)
{
    pd_log_set_level(PD_LOG_WARN);
    g_model = tu_make_model("--preset tiny --arch llama");
    g_gpt2 = NULL;
    g_dir = tu_mkdtemp("chat-so");
    ck_assert_ptr_nonnull(g_model);
    char *extra[] = {"--max-model-len", "2048", NULL};
    g_pid = start_bin("pd-serve", g_model, "main", extra, &g_port, true);
}

static void suite_teardown(void)
{
    tu_stop(g_pid, 30);
    tu_rmrf(g_model);
    tu_rmrf(g_gpt2);
    if (getenv("PD_TEST_KEEP_LOGS") == NULL) {
        tu_rmrf(g_dir);
    } else {
        fprintf(stderr, "logs kept in %s\n", g_dir);
    }
    free(g_model), free(g_gpt2), free(g_dir); /* a second case's fixture makes its own */
    g_model = g_gpt2 = g_dir = NULL;
}

/* POSTs body to path; returns the parsed JSON (NULL for a non-JSON body) and the status. */
static json_t *post(int port, const char *path, const char *body, int *status)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", path, NULL, body, &r, 60000), 0);
    *status = r.status;
    json_t *j = json_loads(r.body, JSON_ALLOW_NUL, NULL);
    http_resp_free(&r);
    return j;
}

static const char *chat_content(json_t *resp)
{
    return json_string_value(json_object_get(
        json_object_get(json_array_get(json_object_get(resp, "choices"), 0), "message"), "content"));
}

/* The prompt text the server renders for a chat body (via /tokenize then /detokenize). */
static char *rendered(int port, const char *tokenize_body)
{
    int st;
    json_t *t = post(port, "/tokenize", tokenize_body, &st);
    ck_assert_msg(st == 200, "tokenize answered %d", st);
    json_t *d = json_pack("{s:O}", "tokens", json_object_get(t, "tokens"));
    char *db = json_dumps(d, 0);
    json_t *text = post(port, "/detokenize", db, &st);
    ck_assert_int_eq(st, 200);
    char *s = strdup(json_string_value(json_object_get(text, "prompt")));
    free(db);
    json_decref(t), json_decref(d), json_decref(text);
    return s;
}

static void expect_400(int port, const char *path, const char *body, const char *param, const char *words)
{
    int st;
    json_t *j = post(port, path, body, &st);
    ck_assert_msg(st == 400, "%s %s answered %d, want 400", path, body, st);
    json_t *e = json_object_get(j, "error");
    const char *msg = json_string_value(json_object_get(e, "message"));
    ck_assert_msg(msg != NULL && strstr(msg, words) != NULL, "error '%s' does not say '%s'", msg ? msg : "",
                  words);
    if (param != NULL) {
        ck_assert_str_eq(json_string_value(json_object_get(e, "param")), param);
    }
    ck_assert_int_eq(json_integer_value(json_object_get(e, "code")), 400);
    json_decref(j);
}

/* ------------------------------------------------------------------ chat = completion of the render */

START_TEST(test_chat_equals_completion_of_rendered_prompt)
{
    const char *msgs =
        "[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
        "\"Tell me about caches\"}]";
    char body[1024];
    snprintf(body, sizeof(body), "{\"messages\": %s}", msgs);
    char *text = rendered(g_port, body);
    ck_assert_str_eq(text,
                     "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me "
                     "about caches<|im_end|>\n<|im_start|>assistant\n");
    free(text);
    int st;
    json_t *tok = post(g_port, "/tokenize", body, &st);
    json_t *comp_req = json_pack("{s:O, s:i, s:f}", "prompt", json_object_get(tok, "tokens"), "max_tokens",
                                 10, "temperature", 0.0);
    char *cb = json_dumps(comp_req, 0);
    json_t *comp = post(g_port, "/v1/completions", cb, &st);
    ck_assert_int_eq(st, 200);
    snprintf(body, sizeof(body),
             "{\"model\": \"m\", \"messages\": %s, \"max_tokens\": 10, \"temperature\": 0}", msgs);
    json_t *chat = post(g_port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(json_string_value(json_object_get(chat, "object")), "chat.completion");
    ck_assert_str_eq(chat_content(chat), json_string_value(json_object_get(
                                             json_array_get(json_object_get(comp, "choices"), 0), "text")));
    json_t *ch0 = json_array_get(json_object_get(chat, "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(ch0, "message"), "role")),
                     "assistant");
    ck_assert_str_eq(json_string_value(json_object_get(ch0, "finish_reason")), "length");
    ck_assert(json_is_null(json_object_get(ch0, "stop_reason")));
    json_t *u = json_object_get(chat, "usage");
    ck_assert_int_eq(json_integer_value(json_object_get(u, "prompt_tokens")),
                     json_integer_value(json_object_get(tok, "count")));
    ck_assert_int_eq(json_integer_value(json_object_get(u, "completion_tokens")), 10);
    ck_assert_int_eq(strncmp(json_string_value(json_object_get(chat, "id")), "chatcmpl-", 9), 0);
    free(cb);
    json_decref(tok), json_decref(comp_req), json_decref(comp), json_decref(chat);
}
END_TEST

/* SSE events of a streamed response body. */
static json_t *sse_events(const char *body, bool *done)
{
    json_t *ev = json_array();
    *done = false;
    for (const char *p = body; (p = strstr(p, "data: ")) != NULL;) {
        p += 6;
        const char *e = strstr(p, "\n\n");
        if (e == NULL) {
            break;
        }
        if (strncmp(p, "[DONE]", 6) == 0) {
            *done = true;
        } else {
            json_array_append_new(ev, json_loadb(p, (size_t)(e - p), 0, NULL));
        }
        p = e;
    }
    return ev;
}

START_TEST(test_chat_stream_and_logprobs_shapes)
{
    const char *base =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello there\"}], \"max_tokens\": 6, "
        "\"temperature\": 0, \"logprobs\": true, \"top_logprobs\": 3";
    char body[1024];
    snprintf(body, sizeof(body), "%s}", base);
    int st;
    json_t *full = post(g_port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    json_t *lpc = json_object_get(
        json_object_get(json_array_get(json_object_get(full, "choices"), 0), "logprobs"), "content");
    ck_assert_uint_eq(json_array_size(lpc), 6);
    for (size_t i = 0; i < json_array_size(lpc); i++) {
        json_t *e = json_array_get(lpc, i);
        ck_assert(json_is_string(json_object_get(e, "token")));
        ck_assert(json_real_value(json_object_get(e, "logprob")) <= 0);
        ck_assert(json_array_size(json_object_get(e, "bytes")) >= 1);
        json_t *top = json_object_get(e, "top_logprobs");
        ck_assert_uint_eq(json_array_size(top), 3);
        /* greedy: the sampled token is the most likely one */
        ck_assert_str_eq(json_string_value(json_object_get(json_array_get(top, 0), "token")),
                         json_string_value(json_object_get(e, "token")));
    }
    snprintf(body, sizeof(body), "%s, \"stream\": true, \"stream_options\": {\"include_usage\": true}}",
             base);
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/chat/completions", NULL, body, &r, 60000), 0);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strcasestr(r.head, "text/event-stream"));
    bool done;
    json_t *ev = sse_events(r.body, &done);
    ck_assert(done);
    ck_assert_uint_ge(json_array_size(ev), 3);
    json_t *first = json_array_get(json_object_get(json_array_get(ev, 0), "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(first, "delta"), "role")),
                     "assistant");
    char text[4096] = "";
    const char *finish = NULL;
    size_t lp_entries = 0;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *c = json_array_get(ev, i);
        ck_assert_str_eq(json_string_value(json_object_get(c, "object")), "chat.completion.chunk");
        json_t *ch = json_array_get(json_object_get(c, "choices"), 0);
        if (ch == NULL) { /* the usage chunk */
            ck_assert_int_eq(
                json_integer_value(json_object_get(json_object_get(c, "usage"), "completion_tokens")), 6);
            ck_assert_uint_eq(i, json_array_size(ev) - 1);
            continue;
        }
        const char *d = json_string_value(json_object_get(json_object_get(ch, "delta"), "content"));
        if (d != NULL) {
            strncat(text, d, sizeof(text) - strlen(text) - 1);
        }
        lp_entries += json_array_size(json_object_get(json_object_get(ch, "logprobs"), "content"));
        if (json_is_string(json_object_get(ch, "finish_reason"))) {
            finish = json_string_value(json_object_get(ch, "finish_reason"));
        }
    }
    ck_assert_str_eq(text, chat_content(full));
    ck_assert_str_eq(finish, "length");
    ck_assert_uint_eq(lp_entries, 6);
    json_decref(ev), json_decref(full);
    http_resp_free(&r);
}
END_TEST

/* ------------------------------------------------------------------ template sources */

START_TEST(test_template_sources_in_vllms_order)
{
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}";
    /* --chat-template FILE wins over the model's tokenizer_config.json */
    char tfile[600];
    snprintf(tfile, sizeof(tfile), "%s/custom.jinja", g_dir);
    const char *custom =
        "[{% for m in messages %}{{ m.role }}={{ m.content }}{% endfor %}]"
        "{% if messages[0].content == 'bad' %}{{ raise_exception('bad content, refused') }}{% endif %}";
    ck_assert_int_eq(tu_write_file(tfile, custom, strlen(custom)), 0);
    char *ea[] = {"--chat-template", tfile, NULL};
    int port;
    pid_t pid = start_bin("pd-serve", g_model, "tplfile", ea, &port, true);
    char *text = rendered(port, body);
    ck_assert_str_eq(text, "[user=hi]");
    free(text);
    expect_400(port, "/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"bad\"}]}",
               "messages", "bad content, refused");
    tu_stop(pid, 30);
    /* --chat-template with the template text itself */
    char *eb[] = {"--chat-template", "<{{ messages | length }}>", NULL};
    pid = start_bin("pd-serve", g_model, "tpltext", eb, &port, true);
    text = rendered(port, body);
    ck_assert_str_eq(text, "<1>");
    free(text);
    tu_stop(pid, 30);
    /* chat_template.jinja in the model directory wins over tokenizer_config.json */
    char dir[600], jpath[700];
    snprintf(dir, sizeof(dir), "%s/model-with-jinja", g_dir);
    ck_assert_int_eq(tu_run(30, "cp -r %s %s", g_model, dir), 0);
    snprintf(jpath, sizeof(jpath), "%s/chat_template.jinja", dir);
    ck_assert_int_eq(tu_write_file(jpath, "J:{{ messages[0].content }}", 27), 0);
    pid = start_bin("pd-serve", dir, "tpljinja", NULL, &port, true);
    text = rendered(port, body);
    ck_assert_str_eq(text, "J:hi");
    free(text);
    tu_stop(pid, 30);
    /* a template that does not parse stops the server at start-up, naming line and column */
    char *ec[] = {"--chat-template", "line one\n{% if x %}\n{{ 1 + }}", NULL};
    pid = start_bin("pd-serve", g_model, "tplbad", ec, &port, false);
    int rc = tu_stop(pid, 30);
    ck_assert_msg(port <= 0 && rc != 0, "a server with a broken template started (rc %d)", rc);
    char logp[600];
    snprintf(logp, sizeof(logp), "%s/tplbad.log", g_dir);
    size_t ll = 0;
    char *log = tu_read_file(logp, &ll);
    ck_assert_ptr_nonnull(strstr(log, "does not parse: line 3 column"));
    free(log);
    /* a model without a template: chat is a 400 that says so, completions still work */
    pid = start_bin("pd-serve", g_gpt2, "notpl", NULL, &port, true);
    expect_400(port, "/v1/chat/completions", body, NULL, "no chat template");
    int st;
    json_t *c = post(port, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": 2}", &st);
    ck_assert_int_eq(st, 200);
    json_decref(c);
    tu_stop(pid, 30);
}
END_TEST

START_TEST(test_continue_final_message_and_tools)
{
    char *text =
        rendered(g_port, "{\"messages\": [{\"role\": \"user\", \"content\": \"Continue this\"}, {\"role\": "
                         "\"assistant\", \"content\": \"The beginning of\"}], \"add_generation_prompt\": "
                         "false, \"continue_final_message\": true}");
    size_t n = strlen(text);
    ck_assert_msg(n > 16 && strcmp(text + n - 16, "The beginning of") == 0, "render ends with '%s'",
                  n > 40 ? text + n - 40 : text);
    free(text);
    /* tools are rendered (the template writes them as JSON); tool-call arguments given as a JSON string
     * reach the template as an object, as vLLM passes them */
    text = rendered(
        g_port,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"weather?\"}, {\"role\": \"assistant\", "
        "\"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": "
        "{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]}, {\"role\": "
        "\"tool\", \"tool_call_id\": \"c1\", \"content\": \"21C\"}], \"tools\": [{\"type\": \"function\", "
        "\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}}]}");
    ck_assert_msg(
        strstr(text,
               "<|im_start|>tools\n{\"type\": \"function\", \"function\": {\"name\": "
               "\"get_weather\", \"description\": null, \"parameters\": {\"type\": \"object\"}}}") != NULL,
        "tools not rendered: %s", text);
    ck_assert_msg(
        strstr(text, "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}") != NULL,
        "tool call not rendered as an object: %s", text);
    ck_assert_ptr_nonnull(strstr(text, "<|im_start|>tool\n21C<|im_end|>"));
    free(text);
    /* content as a list of text parts renders as the joined string for a string-content template */
    text = rendered(
        g_port, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
                "\"one\"}, {\"type\": \"text\", \"text\": \"two\"}]}], \"add_generation_prompt\": false}");
    ck_assert_str_eq(text, "<|begin_of_text|><|im_start|>user\none\ntwo<|im_end|>\n");
    free(text);
    /* chat_template_kwargs reach the template */
    char tfile[600];
    snprintf(tfile, sizeof(tfile), "%s/kw.jinja", g_dir);
    const char *kw =
        "{{ greeting | default('none') }}{% if enable_thinking is defined and not enable_thinking %}"
        "/no_think{% endif %}";
    ck_assert_int_eq(tu_write_file(tfile, kw, strlen(kw)), 0);
    char *ea[] = {"--chat-template", tfile, NULL};
    int port;
    pid_t pid = start_bin("pd-serve", g_model, "kw", ea, &port, true);
    text =
        rendered(port, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": "
                       "{\"greeting\": \"hey\", \"enable_thinking\": false}}");
    ck_assert_str_eq(text, "hey/no_think");
    free(text);
    tu_stop(pid, 30);
}
END_TEST

/* The messages a template sees are vLLM's (entrypoints/chat_utils.py): an assistant's empty tool_calls
 * dropped (the replies carry "tool_calls": [], and a client sends that message back: Llama 3.1's
 * template then refused the request), a tool result's text parts joined into a string, `reasoning`
 * (or `reasoning_content`) given as both, `tools: []` kept as a list, and the top-level `documents`
 * and `reasoning_effort` as template variables (bad ones: 400). A template that prints its context
 * as JSON shows the structure; Llama 3.1's (tests/template/templates/llama31_style.jinja) renders
 * the agent loop as it renders the same chat without the empty list. */
START_TEST(test_agent_loop_messages_as_vllm)
{
    char tfile[600];
    snprintf(tfile, sizeof(tfile), "%s/dump.jinja", g_dir);
    const char *dump =
        "{{ messages | tojson }}\n{{ tools | tojson }}\n{{ reasoning_effort | default('unset') }}\n"
        "{{ documents | default(none) | tojson }}";
    ck_assert_int_eq(tu_write_file(tfile, dump, strlen(dump)), 0);
    char *ea[] = {"--chat-template", tfile, NULL};
    int port;
    pid_t pid = start_bin("pd-serve", g_model, "dump", ea, &port, true);
    char *text = rendered(
        port, "{\"messages\": [{\"role\": \"user\", \"content\": \"weather?\"}, {\"role\": \"assistant\", "
              "\"content\": \"Let me think.\", \"tool_calls\": [], \"reasoning\": \"r1\"}, {\"role\": "
              "\"tool\", \"tool_call_id\": \"c1\", \"content\": [{\"type\": \"text\", \"text\": \"21C\"}, "
              "{\"type\": \"text\", \"text\": \"sunny\"}]}, {\"role\": \"assistant\", \"content\": \"ok\", "
              "\"reasoning_content\": \"r2\"}], \"tools\": [], \"reasoning_effort\": \"low\", "
              "\"documents\": [{\"title\": \"t\", \"text\": \"d\"}]}");
    char *lines[4] = {text, NULL, NULL, NULL};
    for (int i = 1; i < 4; i++) {
        lines[i] = strchr(lines[i - 1], '\n');
        ck_assert_msg(lines[i] != NULL, "dump template output: %s", text);
        *lines[i]++ = '\0';
    }
    json_t *got = json_loads(lines[0], 0, NULL);
    json_t *want = json_loads(
        "[{\"role\": \"user\", \"content\": \"weather?\"}, {\"role\": \"assistant\", \"content\": \"Let me "
        "think.\", \"reasoning\": \"r1\", \"reasoning_content\": \"r1\"}, {\"role\": \"tool\", \"content\": "
        "\"21C\\nsunny\", \"tool_call_id\": \"c1\"}, {\"role\": \"assistant\", \"content\": \"ok\", "
        "\"reasoning\": "
        "\"r2\", \"reasoning_content\": \"r2\"}]",
        0, NULL);
    ck_assert_ptr_nonnull(want);
    ck_assert_msg(got != NULL && json_equal(got, want), "messages the template saw: %s", lines[0]);
    ck_assert_str_eq(lines[1], "[]");
    ck_assert_str_eq(lines[2], "low");
    json_t *docs = json_loads(lines[3], 0, NULL),
           *docs_want = json_pack("[{s:s, s:s}]", "title", "t", "text", "d");
    ck_assert_msg(docs != NULL && json_equal(docs, docs_want), "documents the template saw: %s", lines[3]);
    json_decref(got), json_decref(want), json_decref(docs), json_decref(docs_want);
    free(text);
    expect_400(port, "/v1/chat/completions",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"reasoning_effort\": \"max\"}",
               "reasoning_effort", "one of");
    expect_400(port, "/v1/chat/completions",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"documents\": \"a doc\"}",
               "documents", "list of objects");
    tu_stop(pid, 30);

    /* Llama 3.1: the agent loop renders, as the chat without the empty list does */
    char l31[700];
    snprintf(l31, sizeof(l31), "%s/tests/template/templates/llama31_style.jinja", tu_source_dir());
    char *eb[] = {"--chat-template", l31, NULL};
    pid = start_bin("pd-serve", g_model, "l31", eb, &port, true);
    const char *head =
        "{\"chat_template_kwargs\": {\"date_string\": \"26 Jul 2024\"}, \"messages\": [{\"role\": "
        "\"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"";
    const char *tail = "}, {\"role\": \"user\", \"content\": \"again\"}]}";
    char with[1024], without[1024];
    snprintf(with, sizeof(with), "%s, \"tool_calls\": []%s", head, tail);
    snprintf(without, sizeof(without), "%s%s", head, tail);
    char *a = rendered(port, with), *b = rendered(port, without);
    ck_assert_str_eq(a, b);
    free(a), free(b);
    tu_stop(pid, 30);
}
END_TEST

START_TEST(test_refusals_name_the_parameter)
{
    const char *c = "/v1/chat/completions", *p = "/v1/completions";
    const char *m = "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]";
    char b[512];
    static const char *const unimpl[] = {"\"best_of\": 2", "\"guided_decoding_backend\": \"xgrammar\"",
                                         "\"spaces_between_special_tokens\": false",
                                         "\"return_tokens_as_token_ids\": true",
                                         "\"guided_whitespace_pattern\": \" \""};
    for (size_t i = 0; i < sizeof(unimpl) / sizeof(unimpl[0]); i++) {
        char param[64];
        sscanf(unimpl[i], "\"%63[^\"]\"", param);
        snprintf(b, sizeof(b), "{%s, %s}", m, unimpl[i]);
        expect_400(g_port, c, b, param, "not supported");
        snprintf(b, sizeof(b), "{\"prompt\": \"hi\", %s}", unimpl[i]);
        expect_400(g_port, p, b, param, "not supported");
    }
    /* the sampling parameters pdserve implements are range-checked as vLLM does */
    static const struct {
        const char *field, *param, *words;
    } bad[] = {
        {"\"presence_penalty\": 2.5", "presence_penalty", "[-2, 2]"},
        {"\"frequency_penalty\": -3", "frequency_penalty", "[-2, 2]"},
        {"\"repetition_penalty\": 0", "repetition_penalty", "must be in"},
        {"\"min_p\": 1.5", "min_p", "[0, 1]"},
        {"\"temperature\": 2.5", "temperature", "[0, 2]"},
        {"\"min_tokens\": 9, \"max_tokens\": 4", "min_tokens", "max_tokens"},
        {"\"logit_bias\": {\"99999\": 5}", "logit_bias", "outside the vocabulary"},
        {"\"logit_bias\": {\"x\": 5}", "logit_bias", "integer token id"},
        {"\"bad_words\": [\"\"]", "bad_words", "non-empty"},
        {"\"stop\": [\"\"]", "stop", "empty string"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(b, sizeof(b), "{%s, %s}", m, bad[i].field);
        expect_400(g_port, c, b, bad[i].param, bad[i].words);
        snprintf(b, sizeof(b), "{\"prompt\": \"hi\", %s}", bad[i].field);
        expect_400(g_port, p, b, bad[i].param, bad[i].words);
    }
    /* neutral values of those parameters are fine */
    int st;
    snprintf(b, sizeof(b),
             "{%s, \"presence_penalty\": 0, \"repetition_penalty\": 1.0, \"logit_bias\": {}, "
             "\"max_tokens\": 2}",
             m);
    json_t *ok = post(g_port, c, b, &st);
    ck_assert_int_eq(st, 200);
    json_decref(ok);
    expect_400(g_port, c, "{\"model\": \"m\"}", "messages", "required");
    expect_400(g_port, c, "{\"messages\": []}", "messages", "non-empty");
    expect_400(g_port, c, "{\"messages\": [{\"content\": \"no role\"}]}", "messages", "role");
    expect_400(g_port, c,
               "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": "
               "{\"url\": "
               "\"x\"}}]}]}",
               "messages", "image_url");
    snprintf(b, sizeof(b), "{%s, \"continue_final_message\": true}", m);
    expect_400(g_port, c, b, "continue_final_message", "Cannot set both");
    snprintf(b, sizeof(b), "{%s, \"tool_choice\": \"required\"}", m);
    expect_400(g_port, c, b, "tool_choice", "needs \"tools\"");
    snprintf(b, sizeof(b), "{%s, \"tool_choice\": \"sometimes\"}", m);
    expect_400(g_port, c, b, "tool_choice", "tool_choice must be");
    /* tools with "auto" (said, or the default with tools, as vLLM reads it) need a tool-call parser,
     * which pdserve does not have: refused, not answered with the calls left in the text */
    static const char *tool = "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                              "\"parameters\": {\"type\": \"object\"}}}]";
    snprintf(b, sizeof(b), "{%s, %s}", m, tool);
    expect_400(g_port, c, b, "tool_choice", "--tool-call-parser");
    snprintf(b, sizeof(b), "{%s, %s, \"tool_choice\": \"auto\"}", m, tool);
    expect_400(g_port, c, b, "tool_choice", "--tool-call-parser");
    snprintf(b, sizeof(b), "{%s, %s, \"tool_choice\": \"none\", \"max_tokens\": 2}", m, tool);
    int tst;
    json_t *tr = post(g_port, c, b, &tst);
    ck_assert_int_eq(tst, 200); /* "none": rendered, answered as text */
    json_decref(tr);
    snprintf(b, sizeof(b), "{%s, \"n\": 2, \"temperature\": 0}", m);
    expect_400(g_port, c, b, "n", "greedy");
    expect_400(g_port, p, "{\"prompt\": [\"a\", \"b\"], \"n\": 100}", "n", "choices");
    expect_400(g_port, p, "{\"prompt\": [\"a\", [1, 2]]}", "prompt", "mixes");

    snprintf(b, sizeof(b), "{%s, \"top_logprobs\": 2}", m);
    expect_400(g_port, c, b, "top_logprobs", "logprobs");
    snprintf(b, sizeof(b), "{%s, \"stop_token_ids\": [100000]}", m);
    expect_400(g_port, c, b, "stop_token_ids", "outside the vocabulary");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"stop_token_ids\": [-1]}", "stop_token_ids", "outside");
    /* checked before any narrowing: 2^32 + 402 is not token 402 (issue 51) */
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"stop_token_ids\": [4294967698]}", "stop_token_ids",
               "4294967698 is outside");
    snprintf(b, sizeof(b), "{%s, \"tools\": [{\"type\": \"function\"}]}", m);
    expect_400(g_port, c, b, "tools", "tools[0]");
    json_t *nf = post(
        g_port, c, "{\"model\": \"other\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", &st);
    ck_assert_int_eq(st, 404);
    json_decref(nf);
}
END_TEST

START_TEST(test_stop_reason_over_http)
{
    int st;
    /* a token forced by logit_bias and listed in stop_token_ids: finish "stop", stop_reason the id */
    json_t *r =
        post(g_port, "/v1/completions",
             "{\"prompt\": \"hi\", \"max_tokens\": 5, \"temperature\": 0, \"logit_bias\": {\"77\": 100}, "
             "\"stop_token_ids\": [77]}",
             &st);
    ck_assert_int_eq(st, 200);
    json_t *ch = json_array_get(json_object_get(r, "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    ck_assert_int_eq(json_integer_value(json_object_get(ch, "stop_reason")), 77);
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(r, "usage"), "completion_tokens")),
                     1);
    json_decref(r);
    /* the same token's text as a stop string, kept in the output on request; chat reports it too */
    json_t *t = post(g_port, "/detokenize", "{\"tokens\": [77]}", &st);
    const char *word = json_string_value(json_object_get(t, "prompt"));
    char body[512];
    snprintf(
        body, sizeof(body),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 5, \"temperature\": 0, "
        "\"logit_bias\": {\"77\": 100}, \"stop\": [\"%s\"], \"include_stop_str_in_output\": true}",
        word);
    json_t *c = post(g_port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    ch = json_array_get(json_object_get(c, "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(ch, "stop_reason")), word);
    ck_assert_str_eq(chat_content(c), word);
    json_decref(c), json_decref(t);
}
END_TEST

/* Choice texts of a completions answer, by index. */
static int choice_texts(json_t *r, const char **texts, int max)
{
    json_t *ch = json_object_get(r, "choices");
    int n = (int)json_array_size(ch);
    for (int i = 0; i < n && i < max; i++) {
        json_t *c = json_array_get(ch, i);
        ck_assert_int_eq(json_integer_value(json_object_get(c, "index")), i);
        texts[i] = json_string_value(json_object_get(c, "text"));
        if (texts[i] == NULL) {
            texts[i] = json_string_value(json_object_get(json_object_get(c, "message"), "content"));
        }
    }
    return n;
}

START_TEST(test_n_batched_prompts_and_echo)
{
    int st;
    /* n = 3 seeded: choice j equals a single request seeded seed + j (vLLM's children) */
    json_t *r = post(
        g_port, "/v1/completions",
        "{\"prompt\": \"The cache line\", \"n\": 3, \"max_tokens\": 6, \"temperature\": 1, \"seed\": 40}",
        &st);
    ck_assert_int_eq(st, 200);
    const char *t[8];
    ck_assert_int_eq(choice_texts(r, t, 8), 3);
    for (int j = 0; j < 3; j++) {
        char body[256];
        snprintf(body, sizeof(body),
                 "{\"prompt\": \"The cache line\", \"max_tokens\": 6, \"temperature\": 1, \"seed\": %d}",
                 40 + j);
        json_t *one = post(g_port, "/v1/completions", body, &st);
        const char *t1[1];
        choice_texts(one, t1, 1);
        ck_assert_str_eq(t[j], t1[0]);
        json_decref(one);
    }
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(r, "usage"), "completion_tokens")),
                     18);
    json_decref(r);
    /* the choices share the prompt's blocks through the prefix cache */
    char body[4096];
    int k = snprintf(body, sizeof(body), "{\"prompt\": \"");
    for (int i = 0; i < 120; i++) {
        k += snprintf(body + k, sizeof(body) - (size_t)k, "w%d ", i);
    }
    snprintf(body + k, sizeof(body) - (size_t)k, "\", \"n\": 4, \"max_tokens\": 4, \"temperature\": 0.8}");
    http_resp_t m;
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &m, 5000), 0);
    double hits0 = pd_metrics_text_value(m.body, "vllm:prefix_cache_hits_total", -1);
    http_resp_free(&m);
    r = post(g_port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    int prompt_tokens =
        (int)json_integer_value(json_object_get(json_object_get(r, "usage"), "prompt_tokens"));
    json_decref(r);
    ck_assert_int_eq(http_request(g_port, "GET", "/metrics", NULL, NULL, &m, 5000), 0);
    double hits1 = pd_metrics_text_value(m.body, "vllm:prefix_cache_hits_total", -1);
    http_resp_free(&m);
    int full_blocks = (prompt_tokens - 1) / 16 * 16;
    ck_assert_msg(hits1 - hits0 >= 3 * full_blocks, "n = 4 hit %g prompt tokens in the cache, want >= %d",
                  hits1 - hits0, 3 * full_blocks);
    /* batched prompts: one choice per prompt (× n), each equal to the prompt alone; usage sums them */
    r = post(g_port, "/v1/completions",
             "{\"prompt\": [\"alpha beta\", \"gamma\", \"delta epsilon zeta\"], \"max_tokens\": 5, "
             "\"temperature\": 0}",
             &st);
    ck_assert_int_eq(st, 200);
    ck_assert_int_eq(choice_texts(r, t, 8), 3);
    static const char *const ps[3] = {"alpha beta", "gamma", "delta epsilon zeta"};
    int sum_prompt = 0;
    for (int i = 0; i < 3; i++) {
        char b1[256];
        snprintf(b1, sizeof(b1), "{\"prompt\": \"%s\", \"max_tokens\": 5, \"temperature\": 0}", ps[i]);
        json_t *one = post(g_port, "/v1/completions", b1, &st);
        const char *t1[1];
        choice_texts(one, t1, 1);
        ck_assert_str_eq(t[i], t1[0]);
        sum_prompt +=
            (int)json_integer_value(json_object_get(json_object_get(one, "usage"), "prompt_tokens"));
        json_decref(one);
    }
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(r, "usage"), "prompt_tokens")),
                     sum_prompt);
    json_decref(r);
    /* token-id prompts batch too */
    r = post(g_port, "/v1/completions",
             "{\"prompt\": [[5, 6, 7], [8, 9]], \"max_tokens\": 2, \"temperature\": 0}", &st);
    ck_assert_int_eq(st, 200);
    ck_assert_int_eq(choice_texts(r, t, 8), 2);
    json_decref(r);
    /* echo: the prompt starts the text, streamed or not */
    r = post(g_port, "/v1/completions",
             "{\"prompt\": \"Echo me\", \"max_tokens\": 3, \"temperature\": 0, \"echo\": true}", &st);
    ck_assert_int_eq(st, 200);
    choice_texts(r, t, 1);
    ck_assert_int_eq(strncmp(t[0], "Echo me", 7), 0);
    ck_assert_uint_gt(strlen(t[0]), 7);
    char want[256];
    snprintf(want, sizeof(want), "%s", t[0]);
    json_decref(r);
    http_resp_t sr;
    ck_assert_int_eq(
        http_request(g_port, "POST", "/v1/completions", NULL,
                     "{\"prompt\": \"Echo me\", \"max_tokens\": 3, \"temperature\": 0, \"echo\": true, "
                     "\"stream\": true}",
                     &sr, 60000),
        0);
    bool done;
    json_t *ev = sse_events(sr.body, &done);
    char got[256] = "";
    for (size_t i = 0; i < json_array_size(ev); i++) {
        const char *x = json_string_value(
            json_object_get(json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0), "text"));
        if (x != NULL) {
            strncat(got, x, sizeof(got) - strlen(got) - 1);
        }
    }
    ck_assert_str_eq(got, want);
    json_decref(ev);
    http_resp_free(&sr);
    /* chat with n = 2: streamed chunks carry both indexes, each with its role chunk first */
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/chat/completions", NULL,
                                  "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 2, "
                                  "\"max_tokens\": 3, \"temperature\": 1, \"seed\": 3, \"stream\": true}",
                                  &sr, 60000),
                     0);
    ev = sse_events(sr.body, &done);
    ck_assert(done);
    int roles[2] = {0, 0}, finishes[2] = {0, 0};
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *c = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        ck_assert(idx == 0 || idx == 1);
        roles[idx] += json_object_get(json_object_get(c, "delta"), "role") != NULL;
        finishes[idx] += json_is_string(json_object_get(c, "finish_reason"));
    }
    ck_assert(roles[0] == 1 && roles[1] == 1 && finishes[0] == 1 && finishes[1] == 1);
    json_decref(ev);
    http_resp_free(&sr);
}
END_TEST

/* generation_config.json: its EOS ids stop generation, its sampling values are the defaults of
 * omitted fields; --generation-config vllm ignores it. */
START_TEST(test_generation_config)
{
    int st;
    json_t *g =
        post(g_port, "/v1/completions",
             "{\"prompt\": \"The cache\", \"max_tokens\": 8, \"temperature\": 0, \"return_token_ids\": true}",
             &st);
    json_t *gids = json_object_get(json_array_get(json_object_get(g, "choices"), 0), "token_ids");
    ck_assert_uint_eq(json_array_size(gids), 8);
    int32_t third = (int32_t)json_integer_value(json_array_get(gids, 2));
    int first = 0;
    while (json_integer_value(json_array_get(gids, (size_t)first)) != third) {
        first++;
    }
    char dir[600], path[700], cfg[256];
    snprintf(dir, sizeof(dir), "%s/model-genconfig", g_dir);
    ck_assert_int_eq(tu_run(30, "cp -r %s %s", g_model, dir), 0);
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    snprintf(cfg, sizeof(cfg), "{\"eos_token_id\": [%d], \"temperature\": 0.0, \"top_p\": 0.5}", third);
    ck_assert_int_eq(tu_write_file(path, cfg, strlen(cfg)), 0);
    int port;
    pid_t pid = start_bin("pd-serve", dir, "genconfig", NULL, &port, true);
    const char *omitted = "{\"prompt\": \"The cache\", \"max_tokens\": 8, \"return_token_ids\": true}";
    for (int i = 0; i < 2; i++) { /* temperature omitted: the model's 0, every time the same */
        json_t *r = post(port, "/v1/completions", omitted, &st);
        json_t *ch = json_array_get(json_object_get(r, "choices"), 0);
        json_t *ids = json_object_get(ch, "token_ids");
        ck_assert_uint_eq(json_array_size(ids), (size_t)first + 1); /* generation_config's EOS stopped it */
        for (int k = 0; k <= first; k++) {
            ck_assert_int_eq(json_integer_value(json_array_get(ids, (size_t)k)),
                             json_integer_value(json_array_get(gids, (size_t)k)));
        }
        ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "stop");
        ck_assert(json_is_null(json_object_get(ch, "stop_reason")));
        json_decref(r);
    }
    tu_stop(pid, 30);
    char *ev[] = {"--generation-config", "vllm", NULL};
    pid = start_bin("pd-serve", dir, "genconfig-vllm", ev, &port, true);
    json_t *r =
        post(port, "/v1/completions",
             "{\"prompt\": \"The cache\", \"max_tokens\": 8, \"temperature\": 0, \"return_token_ids\": true}",
             &st);
    ck_assert_uint_eq(
        json_array_size(json_object_get(json_array_get(json_object_get(r, "choices"), 0), "token_ids")), 8);
    json_decref(r);
    tu_stop(pid, 30);
    json_decref(g);
}
END_TEST

START_TEST(test_skip_special_tokens)
{
    int st;
    /* the model's EOS is special: forced twice with ignore_eos, it shows only when asked */
    json_t *t =
        post(g_port, "/tokenize", "{\"prompt\": \"<|end_of_text|>\", \"add_special_tokens\": false}", &st);
    ck_assert_uint_eq(json_array_size(json_object_get(t, "tokens")), 1);
    int eos = (int)json_integer_value(json_array_get(json_object_get(t, "tokens"), 0));
    json_decref(t);
    char body[256];
    for (int keep = 0; keep < 2; keep++) {
        snprintf(body, sizeof(body),
                 "{\"prompt\": \"x\", \"max_tokens\": 2, \"temperature\": 0, \"ignore_eos\": true, "
                 "\"logit_bias\": {\"%d\": 100}%s}",
                 eos, keep ? ", \"skip_special_tokens\": false" : "");
        json_t *r = post(g_port, "/v1/completions", body, &st);
        ck_assert_int_eq(st, 200);
        const char *text =
            json_string_value(json_object_get(json_array_get(json_object_get(r, "choices"), 0), "text"));
        ck_assert_str_eq(text, keep ? "<|end_of_text|><|end_of_text|>" : "");
        json_decref(r);
    }
}
END_TEST

/* prompt_logprobs: each position's entry equals the first-token logprobs of a completion of the
 * prompt's prefix (so the scores are right, past a chunk boundary too), a repeat gives the same
 * (the prefix cache is not read), and chat puts them at the top level. */
START_TEST(test_prompt_logprobs)
{
    int st;
    char body[8192];
    int k = snprintf(body, sizeof(body), "{\"prompt\": \"");
    for (int i = 0; i < 90; i++) {
        k += snprintf(body + k, sizeof(body) - (size_t)k, "tok%d ", i * 7);
    }
    snprintf(body + k, sizeof(body) - (size_t)k,
             "\", \"max_tokens\": 1, \"temperature\": 0, \"prompt_logprobs\": 3, "
             "\"return_token_ids\": true}");
    json_t *r1 = post(g_port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    json_t *r2 = post(g_port, "/v1/completions", body, &st);
    json_t *c1 = json_array_get(json_object_get(r1, "choices"), 0);
    json_t *plp = json_object_get(c1, "prompt_logprobs");
    json_t *ids = json_object_get(c1, "prompt_token_ids");
    size_t n = json_array_size(ids);
    ck_assert_uint_gt(n, PD_PROMPT_LOGPROBS_CHUNK + 10);
    ck_assert_uint_eq(json_array_size(plp), n);
    ck_assert(json_is_null(json_array_get(plp, 0)));
    ck_assert(json_equal(
        plp, json_object_get(json_array_get(json_object_get(r2, "choices"), 0), "prompt_logprobs")));
    size_t checks[] = {
        1,    2, 60, PD_PROMPT_LOGPROBS_CHUNK - 1, PD_PROMPT_LOGPROBS_CHUNK, PD_PROMPT_LOGPROBS_CHUNK + 1,
        n - 1};
    for (size_t c = 0; c < sizeof(checks) / sizeof(checks[0]); c++) {
        size_t i = checks[c];
        json_t *entry = json_array_get(plp, i);
        char key[16];
        snprintf(key, sizeof(key), "%lld", (long long)json_integer_value(json_array_get(ids, i)));
        json_t *own = json_object_get(entry, key);
        ck_assert_msg(own != NULL, "position %zu has no entry for its own token", i);
        ck_assert_int_ge(json_integer_value(json_object_get(own, "rank")), 1);
        /* the prefix's completion scores the same next-token distribution */
        json_t *prefix = json_array();
        for (size_t j = 0; j < i; j++) {
            json_array_append(prefix, json_array_get(ids, j));
        }
        json_t *req = json_pack("{s:o, s:i, s:f, s:i}", "prompt", prefix, "max_tokens", 1, "temperature", 0.0,
                                "logprobs", 3);
        char *rb = json_dumps(req, 0);
        json_t *pr = post(g_port, "/v1/completions", rb, &st);
        ck_assert_int_eq(st, 200);
        json_t *top = json_array_get(
            json_object_get(json_object_get(json_array_get(json_object_get(pr, "choices"), 0), "logprobs"),
                            "top_logprobs"),
            0);
        ck_assert_uint_ge(json_object_size(top), 1); /* keyed by text: tokens that decode alike merge */
        /* every top entry of the completion is among the prompt entry's, with the same logprob */
        int matched = 0;
        const char *tk;
        json_t *tv;
        json_object_foreach(top, tk, tv)
        {
            const char *pk;
            json_t *pv;
            json_object_foreach(entry, pk, pv)
            {
                if (strcmp(json_string_value(json_object_get(pv, "decoded_token")), tk) == 0 &&
                    json_integer_value(json_object_get(pv, "rank")) <= 3) {
                    ck_assert_double_eq_tol(json_real_value(json_object_get(pv, "logprob")),
                                            json_real_value(tv), 1e-3);
                    matched++;
                    break;
                }
            }
        }
        ck_assert_msg(matched == (int)json_object_size(top),
                      "position %zu: %d of the prefix's %zu top entries found", i, matched,
                      json_object_size(top));
        free(rb);
        json_decref(req), json_decref(pr);
    }
    json_decref(r1), json_decref(r2);
    /* chat: at the top level; streaming refuses it (as vLLM) */
    json_t *c = post(g_port, "/v1/chat/completions",
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1, "
                     "\"prompt_logprobs\": 0}",
                     &st);
    ck_assert_int_eq(st, 200);
    json_t *cp = json_object_get(c, "prompt_logprobs");
    ck_assert_uint_ge(json_array_size(cp), 5);
    ck_assert_uint_eq(json_object_size(json_array_get(cp, 1)), 1); /* 0 top entries: only its own token */
    json_decref(c);
    expect_400(g_port, "/v1/completions", "{\"prompt\": \"x\", \"prompt_logprobs\": 1, \"stream\": true}",
               "prompt_logprobs", "stream");
    expect_400(g_port, "/v1/completions", "{\"prompt\": \"x\", \"prompt_logprobs\": 21}", "prompt_logprobs",
               "[0, 20]");
}
END_TEST

/* echo + logprobs: the prompt's tokens lead the completions logprobs (first with null scores, the
 * others with their prompt logprob), then the generated ones; streamed the same; token-id prompts
 * are echoed as their text. */
START_TEST(test_echo_with_logprobs)
{
    int st;
    const char *body =
        "{\"prompt\": \"The cache line\", \"max_tokens\": 3, \"temperature\": 0, \"echo\": true, "
        "\"logprobs\": 2, \"return_token_ids\": true}";
    json_t *r = post(g_port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    json_t *ch = json_array_get(json_object_get(r, "choices"), 0);
    json_t *lp = json_object_get(ch, "logprobs");
    size_t np = json_array_size(json_object_get(ch, "prompt_token_ids"));
    json_t *toks = json_object_get(lp, "tokens"), *tlp = json_object_get(lp, "token_logprobs");
    json_t *off = json_object_get(lp, "text_offset");
    ck_assert_uint_eq(json_array_size(toks), np + 3);
    ck_assert(json_is_null(json_array_get(tlp, 0)));
    ck_assert(json_is_null(json_array_get(json_object_get(lp, "top_logprobs"), 0)));
    for (size_t i = 1; i < np + 3; i++) {
        ck_assert(json_is_number(json_array_get(tlp, i)));
        ck_assert_int_ge(json_integer_value(json_array_get(off, i)),
                         json_integer_value(json_array_get(off, i - 1)));
    }
    /* the prompt entries equal prompt_logprobs' scores of the same prompt */
    json_t *q = post(
        g_port, "/v1/completions",
        "{\"prompt\": \"The cache line\", \"max_tokens\": 1, \"temperature\": 0, \"prompt_logprobs\": 0, "
        "\"return_token_ids\": true}",
        &st);
    json_t *qc = json_array_get(json_object_get(q, "choices"), 0);
    json_t *plp = json_object_get(qc, "prompt_logprobs");
    json_t *pids = json_object_get(qc, "prompt_token_ids");
    for (size_t i = 1; i < np; i++) {
        char key[16];
        snprintf(key, sizeof(key), "%lld", (long long)json_integer_value(json_array_get(pids, i)));
        double want =
            json_real_value(json_object_get(json_object_get(json_array_get(plp, i), key), "logprob"));
        ck_assert_double_eq_tol(json_real_value(json_array_get(tlp, i)), want, 1e-5);
    }
    /* streamed: the same entries, the prompt's in the first chunk */
    char sbody[512];
    snprintf(sbody, sizeof(sbody), "%.*s, \"stream\": true}", (int)strlen(body) - 1, body);
    http_resp_t sr;
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, sbody, &sr, 60000), 0);
    bool done;
    json_t *ev = sse_events(sr.body, &done);
    json_t *all = json_array();
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *l =
            json_object_get(json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0), "logprobs");
        json_array_extend(all, json_object_get(l, "tokens"));
    }
    ck_assert(json_equal(all, toks));
    json_decref(ev), json_decref(all), json_decref(q), json_decref(r);
    http_resp_free(&sr);
    /* a token-id prompt is echoed as its text */
    r = post(g_port, "/v1/completions",
             "{\"prompt\": [72, 101, 108], \"max_tokens\": 1, \"temperature\": 0, \"echo\": true}", &st);
    json_t *d = post(g_port, "/detokenize", "{\"tokens\": [72, 101, 108]}", &st);
    const char *text =
        json_string_value(json_object_get(json_array_get(json_object_get(r, "choices"), 0), "text"));
    const char *pt = json_string_value(json_object_get(d, "prompt"));
    ck_assert_int_eq(strncmp(text, pt, strlen(pt)), 0);
    json_decref(r), json_decref(d);
}
END_TEST

/* ------------------------------------------------------------------ endpoints */

START_TEST(test_api_endpoints)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "GET", "/version", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"version\""));
    http_resp_free(&r);
    static const char *const methods[] = {"GET", "POST"};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(http_request(g_port, methods[i], "/ping", NULL, i ? "{}" : NULL, &r, 5000), 0);
        ck_assert_int_eq(r.status, 200);
        http_resp_free(&r);
    }
    static const char *const gets[] = {"/v1/models", "/health", "/metrics",
                                       "/version",   "/ping",   "/v1/models/m"};
    for (size_t i = 0; i < sizeof(gets) / sizeof(gets[0]); i++) {
        ck_assert_int_eq(http_request(g_port, "HEAD", gets[i], NULL, NULL, &r, 5000), 0);
        ck_assert_msg(r.status == 200 && r.body_len == 0, "HEAD %s: %d with %zu body bytes", gets[i],
                      r.status, r.body_len);
        http_resp_free(&r);
    }
    ck_assert_int_eq(http_request(g_port, "GET", "/v1/models/m", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 200);
    json_t *card = json_loads(r.body, 0, NULL);
    ck_assert_str_eq(json_string_value(json_object_get(card, "id")), "m");
    ck_assert_str_eq(json_string_value(json_object_get(card, "object")), "model");
    json_decref(card);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(g_port, "GET", "/v1/models/nope", NULL, NULL, &r, 5000), 0);
    ck_assert_int_eq(r.status, 404);
    http_resp_free(&r);
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/models", NULL, "{}", &r, 5000), 0);
    ck_assert_int_eq(r.status, 405);
    http_resp_free(&r);
    /* tokenize → detokenize round trip; token strings as the vocabulary writes them */
    int st;
    json_t *t = post(g_port, "/tokenize",
                     "{\"model\": \"m\", \"prompt\": \"Hello world\", \"return_token_strs\": true}", &st);
    ck_assert_int_eq(st, 200);
    size_t n = json_array_size(json_object_get(t, "tokens"));
    ck_assert_int_eq(json_integer_value(json_object_get(t, "count")), (json_int_t)n);
    ck_assert_int_eq(json_integer_value(json_object_get(t, "max_model_len")), 512);
    ck_assert_uint_eq(json_array_size(json_object_get(t, "token_strs")), n);
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(t, "token_strs"), 0)),
                     "<|begin_of_text|>");
    json_t *t2 =
        post(g_port, "/tokenize", "{\"prompt\": \"Hello world\", \"add_special_tokens\": false}", &st);
    ck_assert_uint_eq(json_array_size(json_object_get(t2, "tokens")), n - 1);
    ck_assert(json_is_null(json_object_get(t2, "token_strs")));
    json_t *d = json_pack("{s:O}", "tokens", json_object_get(t2, "tokens"));
    char *db = json_dumps(d, 0);
    json_t *back = post(g_port, "/detokenize", db, &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(json_string_value(json_object_get(back, "prompt")), "Hello world");
    free(db);
    json_decref(t), json_decref(t2), json_decref(d), json_decref(back);
    expect_400(g_port, "/detokenize", "{\"tokens\": [1, 99999]}", "tokens", "token id");
    expect_400(g_port, "/tokenize", "{\"nothing\": 1}", "prompt", "prompt");
}
END_TEST

START_TEST(test_seeds_ids_and_nul)
{
    int st;
    const char *unseeded =
        "{\"prompt\": \"The cache\", \"max_tokens\": 8, \"temperature\": 1.0, \"return_token_ids\": true}";
    json_t *texts = json_array();
    json_t *ids = json_array();
    for (int i = 0; i < 6; i++) {
        json_t *r = post(g_port, "/v1/completions", unseeded, &st);
        ck_assert_int_eq(st, 200);
        json_array_append(texts,
                          json_object_get(json_array_get(json_object_get(r, "choices"), 0), "token_ids"));
        const char *id = json_string_value(json_object_get(r, "id"));
        ck_assert_uint_eq(strlen(id), 5 + 32);
        for (size_t k = 0; k < json_array_size(ids); k++) {
            ck_assert_str_ne(json_string_value(json_array_get(ids, k)), id);
        }
        json_array_append_new(ids, json_string(id));
        json_decref(r);
    }
    /* unseeded requests draw fresh seeds: six identical requests give at least four different outputs */
    int distinct = 0;
    for (size_t i = 0; i < json_array_size(texts); i++) {
        bool seen = false;
        for (size_t k = 0; k < i; k++) {
            seen |= json_equal(json_array_get(texts, i), json_array_get(texts, k));
        }
        distinct += !seen;
    }
    ck_assert_int_ge(distinct, 4);
    /* a negative seed is a seed: reproducible */
    const char *seeded = "{\"prompt\": \"The cache\", \"max_tokens\": 8, \"temperature\": 1.0, \"seed\": -7, "
                         "\"return_token_ids\": true}";
    json_t *a = post(g_port, "/v1/completions", seeded, &st);
    json_t *b = post(g_port, "/v1/completions", seeded, &st);
    ck_assert(json_equal(json_object_get(json_array_get(json_object_get(a, "choices"), 0), "token_ids"),
                         json_object_get(json_array_get(json_object_get(b, "choices"), 0), "token_ids")));
    /* a prompt with a NUL character is valid JSON and is accepted */
    json_t *z = post(g_port, "/v1/completions", "{\"prompt\": \"a\\u0000b\", \"max_tokens\": 2}", &st);
    ck_assert_int_eq(st, 200);
    json_t *zc =
        post(g_port, "/v1/chat/completions",
             "{\"messages\": [{\"role\": \"user\", \"content\": \"a\\u0000b\"}], \"max_tokens\": 2}", &st);
    ck_assert_int_eq(st, 200);
    json_decref(texts), json_decref(ids), json_decref(a), json_decref(b), json_decref(z), json_decref(zc);
}
END_TEST

/* ------------------------------------------------------------------ the official openai client */

/* The concatenated content, the finish_reason and the tool_calls deltas of a chat stream. */
static char *stream_chat(int port, const char *body, const char **finish, int *num_tool_deltas, int *held)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "POST", "/v1/chat/completions", NULL, body, &r, 60000), 0);
    ck_assert_int_eq(r.status, 200);
    bool done;
    json_t *ev = sse_events(r.body, &done);
    ck_assert(done);
    char *text = calloc(1, 8192);
    size_t n = 0;
    static char fin[32];
    *num_tool_deltas = 0;
    *held = 0;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *ch = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
        json_t *d = json_object_get(ch, "delta");
        const char *c = json_string_value(json_object_get(d, "content"));
        if (c != NULL && n + strlen(c) < 8192) {
            memcpy(text + n, c, strlen(c));
            n += strlen(c);
        } else if (c == NULL && json_object_get(d, "role") == NULL) {
            (*held)++; /* a token whose text was held back */
        }
        *num_tool_deltas += json_object_get(d, "tool_calls") != NULL;
        if (json_is_string(json_object_get(ch, "finish_reason"))) {
            snprintf(fin, sizeof(fin), "%s", json_string_value(json_object_get(ch, "finish_reason")));
            *finish = fin;
        }
    }
    json_decref(ev);
    http_resp_free(&r);
    return text;
}

/* --enable-auto-tool-choice --tool-call-parser: tools with tool_choice "auto" are served (the
 * parsers' formats are test_server's test_tool_call_parsers; a random-weight model writes no call):
 * a reply without a call is the same text as with "none", streamed or not, with "tool_calls": [] and
 * its own finish_reason; a reply that starts like a Llama 3 call ("{", forced by logit_bias) is held
 * back while it streams and sent whole as text once it turns out not to be one. The flag alone does
 * not start a server, and the first-token handover is refused (no node sees the whole reply). */
START_TEST(test_auto_tool_choice)
{
    int port;
    char *alone[] = {"--enable-auto-tool-choice", NULL};
    pid_t pid = start_bin("pd-serve", g_model, "tools-noparser", alone, &port, false);
    int rc = tu_stop(pid, 30);
    ck_assert_msg(port <= 0 && rc != 0, "--enable-auto-tool-choice without a parser started (rc %d)", rc);
    char logp[600];
    snprintf(logp, sizeof(logp), "%s/tools-noparser.log", g_dir);
    size_t ll = 0;
    char *log = tu_read_file(logp, &ll);
    ck_assert_ptr_nonnull(strstr(log, "requires --tool-call-parser"));
    free(log);

    char *with[] = {"--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", NULL};
    pid = start_bin("pd-serve", g_model, "tools", with, &port, true);
    static const char *head =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"weather in Paris?\"}], \"max_tokens\": 6, "
        "\"temperature\": 0, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]";
    char body[2048];
    int st;
    snprintf(body, sizeof(body), "%s, \"tool_choice\": \"none\"}", head);
    json_t *none = post(port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    snprintf(body, sizeof(body), "%s}", head); /* "auto": the default with tools */
    json_t *aut = post(port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    json_t *ch = json_array_get(json_object_get(aut, "choices"), 0);
    ck_assert_str_eq(chat_content(aut), chat_content(none));
    ck_assert_uint_eq(json_array_size(json_object_get(json_object_get(ch, "message"), "tool_calls")), 0);
    ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "length");
    const char *finish = NULL;
    int tool_deltas = 0, held = 0;
    snprintf(body, sizeof(body), "%s, \"stream\": true}", head);
    char *streamed = stream_chat(port, body, &finish, &tool_deltas, &held);
    ck_assert_str_eq(streamed, chat_content(aut));
    ck_assert_str_eq(finish, "length");
    ck_assert_int_eq(tool_deltas, 0);
    free(streamed);
    json_decref(none), json_decref(aut);

    /* a reply that starts with "{" may be a Llama 3 call: held back, then text */
    json_t *tk = post(port, "/tokenize", "{\"prompt\": \"{\", \"add_special_tokens\": false}", &st);
    ck_assert_int_eq(st, 200);
    json_int_t brace = json_integer_value(json_array_get(json_object_get(tk, "tokens"), 0));
    json_decref(tk);
    snprintf(body, sizeof(body), "%s, \"logit_bias\": {\"%lld\": 100}}", head, (long long)brace);
    aut = post(port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    const char *text = chat_content(aut);
    ck_assert_msg(text != NULL && text[0] == '{', "the forced reply starts with '%s'", text);
    snprintf(body, sizeof(body), "%s, \"logit_bias\": {\"%lld\": 100}, \"stream\": true}", head,
             (long long)brace);
    streamed = stream_chat(port, body, &finish, &tool_deltas, &held);
    ck_assert_str_eq(streamed, text);
    ck_assert_int_ge(held, 5); /* every token but the last came without text */
    ck_assert_int_eq(tool_deltas, 0);
    free(streamed);
    json_decref(aut);

    /* a reply a grammar makes a Llama 3 call: streamed, the call opens once its name is read and its
     * arguments grow as written (re-dumped); joined they equal the whole answer's call */
    static const char *call_re =
        "\"guided_regex\": \"\\\\{\\\"name\\\": \\\"get_weather\\\", \\\"parameters\\\": "
        "\\\\{\\\"city\\\":  ?\\\"[a-z]{2,8}\\\", \\\"n\\\":[0-9]{1,3}\\\\}\\\\}\"";
    const char *mt = strstr(head, "\"max_tokens\": 6,"); /* room for the call: 90 tokens */
    snprintf(body, sizeof(body), "%.*s\"max_tokens\": 90,%s, %s}", (int)(mt - head), head,
             mt + strlen("\"max_tokens\": 6,"), call_re);
    aut = post(port, "/v1/chat/completions", body, &st);
    ck_assert_msg(st == 200, "%s", body);
    ch = json_array_get(json_object_get(aut, "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls");
    json_t *call = json_array_get(json_object_get(json_object_get(ch, "message"), "tool_calls"), 0);
    const char *want_args =
        json_string_value(json_object_get(json_object_get(call, "function"), "arguments"));
    ck_assert_ptr_nonnull(want_args);
    ck_assert_ptr_nonnull(strstr(want_args, "\"city\": \"")); /* re-dumped: ": " whatever was written */
    snprintf(body + strlen(body) - 1, sizeof(body) - strlen(body) + 1, ", \"stream\": true}");
    http_resp_t sr;
    ck_assert_int_eq(http_request(port, "POST", "/v1/chat/completions", NULL, body, &sr, 60000), 0);
    bool done;
    json_t *ev = sse_events(sr.body, &done);
    ck_assert(done);
    char joined[512] = "", name[64] = "";
    int pieces = 0, opened_at = -1;
    for (size_t i = 0; i < json_array_size(ev); i++) {
        json_t *c0 = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
        json_t *tc = json_array_get(json_object_get(json_object_get(c0, "delta"), "tool_calls"), 0);
        json_t *fn = json_object_get(tc, "function");
        if (json_object_get(tc, "id") != NULL) {
            ck_assert_int_eq(opened_at, -1);
            opened_at = (int)i;
            snprintf(name, sizeof(name), "%s", json_string_value(json_object_get(fn, "name")));
        }
        const char *a = json_string_value(json_object_get(fn, "arguments"));
        if (a != NULL && a[0] != '\0' && strlen(joined) + strlen(a) < sizeof(joined)) {
            strcat(joined, a);
            pieces++;
        }
        if (json_is_string(json_object_get(c0, "finish_reason"))) {
            ck_assert_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "tool_calls");
        }
    }
    ck_assert_str_eq(name, "get_weather");
    ck_assert_str_eq(joined, want_args);
    ck_assert_msg(pieces > 5 && opened_at + 5 < (int)json_array_size(ev),
                  "the call came late (event %d of %zu) or whole (%d pieces)", opened_at, json_array_size(ev),
                  pieces);
    json_decref(ev);
    http_resp_free(&sr);
    json_decref(aut);

    snprintf(body, sizeof(body),
             "%s, \"kv_transfer_params\": {\"do_remote_decode\": true, \"first_token\": true}}", head);
    expect_400(port, "/v1/chat/completions", body, "tool_choice", "first-token handover");
    tu_stop(pid, 30);
}
END_TEST

/* Installs openai@SPEC into build/npm-openai-TAG once; returns the node_modules dir. */
/* ------------------------------------------------------------------ structured outputs */

static void npm_openai(const char *tag, const char *spec, char *modules, size_t cap);

/* The openai client's structured-output and forced-tool-choice round trips (openai_structured.mjs)
 * against port: the answers parse, and each stream carries what its whole answer does. */
static void check_openai_structured(const char *modules, int port)
{
    char out[700];
    snprintf(out, sizeof(out), "%s/openai-structured-%d.json", g_dir, port);
    int rc = tu_run(
        180, "node %s/tests/reference/openai_structured.mjs %s http://127.0.0.1:%d/v1 m 120 > %s 2>%s.err",
        tu_source_dir(), modules, port, out, out);
    ck_assert_msg(rc == 0, "the openai client failed (exit %d); see %s.err", rc, out);
    json_t *res = json_load_file(out, 0, NULL);
    ck_assert_ptr_nonnull(res);
    const char *st = json_string_value(json_object_get(res, "schema_text"));
    ck_assert_ptr_nonnull(st);
    json_t *obj = json_loads(st, 0, NULL);
    ck_assert_msg(json_is_string(json_object_get(obj, "city")) &&
                      json_is_integer(json_object_get(obj, "temp")),
                  "response_format answer '%s'", st);
    json_decref(obj);
    ck_assert_str_eq(json_string_value(json_object_get(res, "schema_stream_text")), st);
    ck_assert_str_eq(json_string_value(json_object_get(res, "schema_finish")), "stop");
    ck_assert_str_eq(json_string_value(json_object_get(res, "schema_stream_finish")), "stop");
    json_t *named = json_object_get(res, "named"), *required = json_object_get(res, "required");
    ck_assert_int_eq(json_array_size(named), 1);
    ck_assert_str_eq(json_string_value(json_object_get(json_array_get(named, 0), "name")), "get_weather");
    ck_assert_msg(json_equal(named, json_object_get(res, "named_stream")), "named: streamed calls differ");
    ck_assert_str_eq(json_string_value(json_object_get(res, "named_finish")), "stop");
    ck_assert_int_ge(json_array_size(required), 1);
    ck_assert_msg(json_equal(required, json_object_get(res, "required_stream")),
                  "required: streamed calls differ");
    ck_assert_str_eq(json_string_value(json_object_get(res, "required_finish")), "tool_calls");
    ck_assert_str_eq(json_string_value(json_object_get(res, "required_stream_finish")), "tool_calls");
    for (size_t i = 0; i < json_array_size(required); i++) {
        json_t *args =
            json_loads(json_string_value(json_object_get(json_array_get(required, i), "arguments")), 0, NULL);
        ck_assert_msg(json_is_object(args), "required call %zu's arguments do not parse", i);
        json_decref(args);
    }
    fprintf(stderr,
            "openai %s: response_format, a named and a required tool choice, streamed and not, on port %d\n",
            json_string_value(json_object_get(res, "version")), port);
    json_decref(res);
}

/* The text of a generation request's first choice (completions or chat) and its finish reason. */
static char *gen_text_as(int port, bool chat, bool stream, const char *spec, const char *sampling,
                         const char **finish)
{
    char body[4096];
    if (chat) {
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"Give me JSON\"}], \"max_tokens\": 160, "
                 "%s, %s%s}",
                 spec, sampling, stream ? ", \"stream\": true" : "");
    } else {
        snprintf(body, sizeof(body), "{\"prompt\": \"Answer:\", \"max_tokens\": 160, %s, %s%s}", spec,
                 sampling, stream ? ", \"stream\": true" : "");
    }
    static char fin[32];
    const char *path = chat ? "/v1/chat/completions" : "/v1/completions";
    if (stream) { /* the pieces joined, the last finish_reason */
        http_resp_t r;
        ck_assert_int_eq(http_request(port, "POST", path, NULL, body, &r, 60000), 0);
        ck_assert_msg(r.status == 200, "%s answered %d", body, r.status);
        bool done;
        json_t *ev = sse_events(r.body, &done);
        ck_assert(done);
        size_t n = 0;
        char *out = calloc(1, 8192);
        for (size_t i = 0; i < json_array_size(ev); i++) {
            json_t *ch = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
            const char *s = json_string_value(chat ? json_object_get(json_object_get(ch, "delta"), "content")
                                                   : json_object_get(ch, "text"));
            if (s != NULL && n + strlen(s) < 8192) {
                memcpy(out + n, s, strlen(s));
                n += strlen(s);
            }
            if (json_is_string(json_object_get(ch, "finish_reason"))) {
                snprintf(fin, sizeof(fin), "%s", json_string_value(json_object_get(ch, "finish_reason")));
            }
        }
        *finish = fin;
        json_decref(ev);
        http_resp_free(&r);
        return out;
    }
    int st;
    json_t *j = post(port, path, body, &st);
    ck_assert_msg(st == 200, "%s answered %d", body, st);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    const char *t = chat ? chat_content(j) : json_string_value(json_object_get(c, "text"));
    snprintf(fin, sizeof(fin), "%s", json_string_value(json_object_get(c, "finish_reason")));
    *finish = fin;
    char *out = strdup(t != NULL ? t : "");
    json_decref(j);
    return out;
}

static char *gen_text(int port, bool chat, const char *spec, const char *sampling, const char **finish)
{
    return gen_text_as(port, chat, false, spec, sampling, finish);
}

/* Every structured-output field, greedy and sampled, on completions and chat: each reply ends
 * (finish_reason stop) and is what its spec allows (python3-jsonschema, Python's re.fullmatch, the
 * choice list); a random-weight model writes nothing valid without the grammar. The refusals. */
static double node_metric(int port, const char *name);

START_TEST(test_structured_outputs)
{
    if (system("/usr/bin/python3 -c 'import jsonschema' >/dev/null 2>&1") != 0) {
        ck_assert_msg(getenv("CI") == NULL,
                      "python3-jsonschema is required (tools/install-deps.sh installs it)");
        return;
    }
    static const char *schemas[] = {
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":12},\"age\":{"
        "\"type\":"
        "\"integer\",\"minimum\":0,\"maximum\":120},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\","
        "\"b\"]},"
        "\"maxItems\":3}},\"required\":[\"name\",\"age\",\"tags\"],\"additionalProperties\":false}",
        "{\"anyOf\":[{\"type\":\"boolean\"},{\"type\":\"string\",\"format\":\"date\"},{\"type\":\"integer\","
        "\"exclusiveMaximum\":0,\"minimum\":-999}]}",
    };
    json_t *sdoc = json_array(), *mdoc = json_array();
    const char *fin;
    int n = 0;
    for (int chat = 0; chat < 2; chat++) {
        for (size_t i = 0; i < sizeof(schemas) / sizeof(schemas[0]); i++) {
            json_t *outs = json_array();
            for (int k = 0; k < 6; k++) {
                char spec[2048], samp[128];
                if (k % 3 == 0) {
                    snprintf(
                        spec, sizeof(spec),
                        "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", "
                        "\"schema\": %s, \"strict\": true}}",
                        schemas[i]);
                } else if (k % 3 == 1) {
                    snprintf(spec, sizeof(spec), "\"structured_outputs\": {\"json\": %s}", schemas[i]);
                } else {
                    json_t *str = json_string(schemas[i]); /* guided_json as JSON text */
                    char *enc = json_dumps(str, JSON_ENCODE_ANY);
                    snprintf(spec, sizeof(spec), "\"guided_json\": %s", enc);
                    free(enc);
                    json_decref(str);
                }
                snprintf(samp, sizeof(samp),
                         k < 2 ? "\"temperature\": 0" : "\"temperature\": 1, \"seed\": %d", k);
                char *t = gen_text(g_port, chat, spec, samp, &fin);
                ck_assert_msg(strcmp(fin, "stop") == 0, "'%s' ended by %s", t, fin);
                json_array_append_new(outs, json_string(t));
                free(t);
                n++;
            }
            json_array_append_new(
                sdoc, json_pack("{s:o, s:o}", "schema", json_loads(schemas[i], 0, NULL), "outputs", outs));
        }
        static const struct {
            const char *kind, *spec, *field;
        } others[] = {
            {"regex", "[A-Z][a-z]{2,5} (and|or) \\\\d{1,3}\\\\.",
             "\"structured_outputs\": {\"regex\": \"%s\"}"},
            {"regex", "(ab|é)+!?", "\"guided_regex\": \"%s\""},
            {"choice", "[\"yes\", \"no\", \"not sure\"]", "\"structured_outputs\": {\"choice\": %s}"},
            {"choice", "[\"positive\", \"negative\"]", "\"guided_choice\": %s"},
            {"grammar_json",
             "root ::= \\\"[\\\" num (\\\",\\\" num){0,3} \\\"]\\\"\\nnum ::= [1-9] [0-9]{0,2}",
             "\"structured_outputs\": {\"grammar\": \"%s\"}"},
        };
        for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++) {
            json_t *outs = json_array();
            for (int k = 0; k < 4; k++) {
                char spec[1024], samp[128];
                snprintf(spec, sizeof(spec), others[i].field, others[i].spec);
                snprintf(samp, sizeof(samp),
                         k == 0 ? "\"temperature\": 0" : "\"temperature\": 1, \"seed\": %d", k);
                char *t = gen_text(g_port, chat, spec, samp, &fin);
                ck_assert_msg(strcmp(fin, "stop") == 0, "%s: '%s' ended by %s", spec, t, fin);
                json_array_append_new(outs, json_string(t));
                free(t);
                n++;
            }
            json_t *sp;
            if (strcmp(others[i].kind, "choice") == 0) {
                sp = json_loads(others[i].spec, 0, NULL);
            } else { /* the spec as the server received it (JSON-unescaped) */
                char q[512];
                snprintf(q, sizeof(q), "\"%s\"", others[i].spec);
                sp = json_loads(q, JSON_DECODE_ANY, NULL);
            }
            ck_assert_ptr_nonnull(sp);
            json_array_append_new(
                mdoc, json_pack("{s:s, s:o, s:o}", "kind", others[i].kind, "spec", sp, "outputs", outs));
        }
    }
    char sp[600], mp[600];
    snprintf(sp, sizeof(sp), "%s/so-schema.json", g_dir);
    snprintf(mp, sizeof(mp), "%s/so-match.json", g_dir);
    ck_assert_int_eq(json_dump_file(sdoc, sp, 0), 0);
    ck_assert_int_eq(json_dump_file(mdoc, mp, 0), 0);
    json_decref(sdoc), json_decref(mdoc);
    ck_assert_int_eq(
        tu_run(60, "/usr/bin/python3 %s/tests/reference/grammar_check.py schema %s", tu_source_dir(), sp), 0);
    ck_assert_int_eq(
        tu_run(60, "/usr/bin/python3 %s/tests/reference/grammar_check.py match %s", tu_source_dir(), mp), 0);
    ck_assert_int_gt(n, 60);
    /* tool_choice "required" and a named function: the reply is the calls, their arguments valid */
    /* short tools: the test server's context is 512 tokens and this vocabulary is small */
    static const char *tools =
        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
        "{\"type\": \"object\", \"properties\": {\"c\": {\"type\": \"string\", \"maxLength\": 6}}, "
        "\"required\": [\"c\"], \"additionalProperties\": false}}}, {\"type\": \"function\", \"function\": "
        "{\"name\": \"add\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": "
        "\"integer\", \"minimum\": 0, \"maximum\": 99}}, \"required\": [\"a\"], \"additionalProperties\": "
        "false}}}]";
    json_t *params = json_object(); /* name → parameters schema */
    json_object_set_new(
        params, "get_weather",
        json_loads("{\"type\": \"object\", \"properties\": {\"c\": {\"type\": \"string\", "
                   "\"maxLength\": 6}}, \"required\": [\"c\"], \"additionalProperties\": false}",
                   0, NULL));
    json_object_set_new(
        params, "add",
        json_loads("{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\", "
                   "\"minimum\": 0, \"maximum\": 99}}, \"required\": [\"a\"], \"additionalProperties\": "
                   "false}",
                   0, NULL));
    json_t *tdoc = json_array();
    int calls_seen = 0;
    for (int k = 0; k < 8; k++) {
        char body[3072];
        const char *choice = k < 4   ? "\"required\""
                             : k < 6 ? "{\"type\": \"function\", \"function\": {\"name\": \"add\"}}"
                                     : "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}";
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}], \"max_tokens\": 120, %s, "
                 "\"tool_choice\": %s, %s}",
                 tools, choice, k % 2 ? "\"temperature\": 1, \"seed\": 5" : "\"temperature\": 0");
        int st;
        json_t *j = post(g_port, "/v1/chat/completions", body, &st);
        ck_assert_msg(st == 200, "%s answered %d", body, st);
        json_t *ch = json_array_get(json_object_get(j, "choices"), 0), *msg = json_object_get(ch, "message");
        json_t *calls = json_object_get(msg, "tool_calls");
        ck_assert_msg(json_array_size(calls) >= 1, "no tool calls in %s", json_dumps(j, 0));
        ck_assert(json_is_null(json_object_get(msg, "content")));
        ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")),
                         k < 4 ? "tool_calls" : "stop");
        size_t ci;
        json_t *call;
        json_array_foreach(calls, ci, call)
        {
            const char *fname = json_string_value(json_object_get(json_object_get(call, "function"), "name"));
            const char *args =
                json_string_value(json_object_get(json_object_get(call, "function"), "arguments"));
            ck_assert_ptr_nonnull(args);
            ck_assert_msg(json_object_get(params, fname) != NULL, "unknown function %s", fname);
            if (k >= 4) {
                ck_assert_str_eq(fname, k < 6 ? "add" : "get_weather");
            }
            ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(call, "id")), "chatcmpl-tool-"));
            json_array_append_new(
                tdoc, json_pack("{s:O, s:[s]}", "schema", json_object_get(params, fname), "outputs", args));
            calls_seen++;
        }
        json_decref(j);
    }
    ck_assert_int_ge(calls_seen, 8);
    snprintf(sp, sizeof(sp), "%s/so-tools.json", g_dir);
    ck_assert_int_eq(json_dump_file(tdoc, sp, 0), 0);
    json_decref(tdoc);
    json_decref(params);
    ck_assert_int_eq(
        tu_run(60, "/usr/bin/python3 %s/tests/reference/grammar_check.py schema %s", tu_source_dir(), sp), 0);
    char sdk[1100] = "";
    if (tu_need(TU_NODE)) { /* the official client, both ways, against pd-serve */
        npm_openai("latest", "latest", sdk, sizeof(sdk));
        check_openai_structured(sdk, g_port);
    }
    /* forced tool choices through P/D (tcp, pull): pd-proxy sends them without the first-token
     * handover, so the decode writes the whole reply under the grammar; the calls equal pd-serve's */
    {
        char tok[600];
        snprintf(tok, sizeof(tok), "%s/cluster-token", g_dir);
        ck_assert_int_eq(tu_write_file(tok, "so-cluster\n", 11), 0);
        char *kv[] = {"--kv-transfer-mode",   "pull", "--kv-pipe",       "tcp",  "--no-kv-prefault",
                      "--cluster-token-file", tok,    "--max-model-len", "2048", NULL};
        int pp, dp, xp;
        pid_t pf = start_bin("pd-prefill", g_model, "so-p", kv, &pp, true);
        pid_t dc = start_bin("pd-decode", g_model, "so-d", kv, &dp, true);
        char pre[64], dec[64];
        snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", pp);
        snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", dp);
        char *xa[] = {"--prefill", pre, "--decode", dec, "--health-interval", "0.2", NULL};
        pid_t x = start_bin("pd-proxy", NULL, "so-x", xa, &xp, true);
        usleep(500 * 1000);
        static const char *const choices[] = {"\"required\"",
                                              "{\"type\": \"function\", \"function\": {\"name\": \"add\"}}"};
        for (int k = 0; k < 2; k++) {
            char body[3072];
            snprintf(body, sizeof(body),
                     "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}], \"max_tokens\": 120, %s, "
                     "\"tool_choice\": %s, \"temperature\": 0}",
                     tools, choices[k]);
            int s1, s2;
            json_t *one = post(g_port, "/v1/chat/completions", body, &s1);
            json_t *pd = post(xp, "/v1/chat/completions", body, &s2);
            ck_assert_int_eq(s1, 200);
            ck_assert_msg(s2 == 200, "P/D answered %d", s2);
            json_t *c1 = json_object_get(json_array_get(json_object_get(one, "choices"), 0), "message");
            json_t *c2 = json_object_get(json_array_get(json_object_get(pd, "choices"), 0), "message");
            json_t *f1 = json_object_get(json_array_get(json_object_get(c1, "tool_calls"), 0), "function");
            json_t *f2 = json_object_get(json_array_get(json_object_get(c2, "tool_calls"), 0), "function");
            ck_assert_ptr_nonnull(f1);
            ck_assert_msg(json_equal(f1, f2), "P/D call %s against pd-serve's %s", json_dumps(f2, 0),
                          json_dumps(f1, 0));
            json_decref(one);
            json_decref(pd);
        }
        if (sdk[0] != '\0') { /* and the client through the proxy */
            check_openai_structured(sdk, xp);
        }
        tu_stop(x, 30);
        tu_stop(dc, 30);
        tu_stop(pf, 30);
    }
    /* a named choice streams its arguments as they are written: the first delta opens the call (id,
     * name), the later ones append to its arguments; joined, they equal the whole answer's */
    {
        char body[3072];
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}], \"max_tokens\": 120, %s, "
                 "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, "
                 "\"temperature\": 0}",
                 tools);
        int st;
        json_t *whole = post(g_port, "/v1/chat/completions", body, &st);
        ck_assert_int_eq(st, 200);
        json_t *wf = json_object_get(
            json_array_get(
                json_object_get(
                    json_object_get(json_array_get(json_object_get(whole, "choices"), 0), "message"),
                    "tool_calls"),
                0),
            "function");
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}], \"max_tokens\": 120, %s, "
                 "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, "
                 "\"temperature\": 0, \"stream\": true}",
                 tools);
        http_resp_t r;
        ck_assert_int_eq(http_request(g_port, "POST", "/v1/chat/completions", NULL, body, &r, 60000), 0);
        bool sdone = false;
        json_t *ev = sse_events(r.body, &sdone);
        char args[1024] = "";
        int opened = 0, deltas = 0;
        const char *last_finish = NULL;
        for (size_t i = 0; i < json_array_size(ev); i++) {
            json_t *ch = json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0);
            json_t *tc = json_array_get(json_object_get(json_object_get(ch, "delta"), "tool_calls"), 0);
            if (json_is_string(json_object_get(ch, "finish_reason"))) {
                last_finish = json_string_value(json_object_get(ch, "finish_reason"));
            }
            if (tc == NULL) {
                continue;
            }
            ck_assert_int_eq(json_integer_value(json_object_get(tc, "index")), 0);
            if (json_object_get(tc, "id") != NULL) {
                opened++;
                ck_assert_str_eq(json_string_value(json_object_get(json_object_get(tc, "function"), "name")),
                                 "get_weather");
            }
            deltas++;
            const char *a = json_string_value(json_object_get(json_object_get(tc, "function"), "arguments"));
            strncat(args, a != NULL ? a : "", sizeof(args) - strlen(args) - 1);
        }
        ck_assert_int_eq(opened, 1);
        ck_assert_int_gt(deltas, 2);
        ck_assert_str_eq(args, json_string_value(json_object_get(wf, "arguments")));
        ck_assert_str_eq(last_finish, "stop");
        json_decref(ev);
        http_resp_free(&r);
        json_decref(whole);
    }
    {
        char body[3072];
        snprintf(body, sizeof(body),
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], %s, \"tool_choice\": {\"type\": "
                 "\"function\", \"function\": {\"name\": \"nope\"}}}",
                 tools);
        expect_400(g_port, "/v1/chat/completions", body, "tool_choice", "not in \"tools\"");
        snprintf(
            body, sizeof(body),
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], %s, \"tool_choice\": \"required\", "
            "\"guided_regex\": \"a\"}",
            tools);
        expect_400(g_port, "/v1/chat/completions", body, "tool_choice", "cannot be combined");
    }
    /* a stream carries the same text */
    const char *spec = "\"guided_choice\": [\"alpha\", \"beta\"]";
    char *whole = gen_text(g_port, false, spec, "\"temperature\": 0", &fin);
    char body[512];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"Answer:\", \"max_tokens\": 20, \"temperature\": 0, \"stream\": true, %s}", spec);
    http_resp_t r;
    ck_assert_int_eq(http_request(g_port, "POST", "/v1/completions", NULL, body, &r, 60000), 0);
    bool done = false;
    json_t *ev = sse_events(r.body, &done);
    char joined[256] = "";
    for (size_t i = 0; i < json_array_size(ev); i++) {
        const char *t = json_string_value(
            json_object_get(json_array_get(json_object_get(json_array_get(ev, i), "choices"), 0), "text"));
        strncat(joined, t != NULL ? t : "", sizeof(joined) - strlen(joined) - 1);
    }
    ck_assert_str_eq(joined, whole);
    json_decref(ev);
    http_resp_free(&r);
    free(whole);
    /* refusals */
    const char *p = "/v1/completions";
    expect_400(g_port, p,
               "{\"prompt\": \"hi\", \"guided_json\": {\"type\": \"object\", \"patternProperties\": {}}}",
               "guided_json", "patternProperties");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"guided_regex\": \"(a\"}", "guided_regex", "missing ')'");
    expect_400(g_port, p,
               "{\"prompt\": \"hi\", \"structured_outputs\": {\"grammar\": \"root ::= root \\\"x\\\"\"}}",
               "grammar", "left-recursive");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"guided_choice\": [\"a\"], \"guided_regex\": \"b\"}", NULL,
               "give one structured output");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"guided_choice\": [\"a\"], \"ignore_eos\": true}",
               "ignore_eos", "ignore_eos");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"structured_outputs\": {\"structural_tag\": \"x\"}}",
               "structured_outputs", "structural_tag");
    expect_400(g_port, p, "{\"prompt\": \"hi\", \"response_format\": {\"type\": \"xml\"}}", "response_format",
               "'xml' is not supported");
    expect_400(g_port, "/v1/chat/completions",
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": {\"type\": "
               "\"json_schema\", \"json_schema\": {\"name\": \"x\"}}}",
               "response_format", "needs \"json_schema\"");
    /* every grammar above was made ready off the engine thread before its first token (its requests
     * waited for it), once per grammar: later requests of a schema found it ready */
    double ahead = node_metric(g_port, "pd:grammars_walked_ahead_total");
    ck_assert_msg(ahead >= 2 && ahead < n, "%g grammars walked ahead for %d requests", ahead, n);
    ck_assert(node_metric(g_port, "pd:grammar_walk_ahead_seconds_total") > 0);
}
END_TEST

static void npm_openai(const char *tag, const char *spec, char *modules, size_t cap)
{
    char dir[1024], pkg[64];
    snprintf(pkg, sizeof(pkg), "openai@%s", spec);
    char name[64];
    snprintf(name, sizeof(name), "openai-%s", tag);
    ck_assert_msg(tu_npm_install(name, pkg, dir, sizeof(dir)) == 0, "npm install %s failed", pkg);
    snprintf(modules, cap, "%s/node_modules", dir);
}

static json_t *run_openai_chat(const char *modules, int port, int max_tokens)
{
    char out[700];
    snprintf(out, sizeof(out), "%s/openai-chat-%d.json", g_dir, port);
    int rc =
        tu_run(120, "node %s/tests/reference/openai_chat.mjs %s http://127.0.0.1:%d/v1 m %d > %s 2>%s.err",
               tu_source_dir(), modules, port, max_tokens, out, out);
    ck_assert_msg(rc == 0, "the openai client failed (exit %d); see %s.err", rc, out);
    json_t *res = json_load_file(out, 0, NULL);
    ck_assert_ptr_nonnull(res);
    return res;
}

static void check_openai_result(json_t *res, const char *want_text, int max_tokens)
{
    ck_assert_str_eq(json_string_value(json_object_get(res, "object")), "chat.completion");
    ck_assert_str_eq(json_string_value(json_object_get(res, "role")), "assistant");
    ck_assert_str_eq(json_string_value(json_object_get(res, "stream_role")), "assistant");
    ck_assert_str_eq(json_string_value(json_object_get(res, "text")), want_text);
    ck_assert_str_eq(json_string_value(json_object_get(res, "stream_text")), want_text);
    ck_assert_str_eq(json_string_value(json_object_get(res, "finish")), "length");
    ck_assert_str_eq(json_string_value(json_object_get(res, "stream_finish")), "length");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(res, "usage"), "completion_tokens")),
                     max_tokens);
    ck_assert_int_eq(
        json_integer_value(json_object_get(json_object_get(res, "stream_usage"), "completion_tokens")),
        max_tokens);
}

/* The same request as openai_chat.mjs, sent by us: the reference text. */
/* The request of openai_chat.mjs with max_tokens and extra fields ("\"tool_choice\": \"none\", "). */
static void chat_body(char *body, size_t cap, int max_tokens, const char *extra)
{
    snprintf(
        body, cap,
        "{\"model\": \"m\", \"max_tokens\": %d, \"temperature\": 0, %s"
        "\"tools\": [{\"type\": \"function\", "
        "\"function\": {\"name\": \"get_weather\", \"description\": \"Get the current weather for a city.\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "
        "\"required\": "
        "[\"city\"]}}}], \"messages\": [{\"role\": \"system\", \"content\": \"You are a weather bot.\"}, "
        "{\"role\": \"user\", \"content\": \"What is the weather in Paris?\"}, {\"role\": \"assistant\", "
        "\"content\": null, \"tool_calls\": [{\"id\": \"call_1\", \"type\": \"function\", \"function\": "
        "{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]}, {\"role\": "
        "\"tool\", "
        "\"tool_call_id\": \"call_1\", \"content\": \"{\\\"temp_c\\\": 21}\"}, {\"role\": \"user\", "
        "\"content\": [{\"type\": \"text\", \"text\": \"And should I take an umbrella?\"}]}]}",
        max_tokens, extra);
}

static char *reference_chat(int port, int max_tokens)
{
    char body[2048];
    chat_body(body, sizeof(body), max_tokens, "\"tool_choice\": \"none\", ");
    int st;
    json_t *r = post(port, "/v1/chat/completions", body, &st);
    ck_assert_int_eq(st, 200);
    char *t = strdup(chat_content(r));
    json_decref(r);
    return t;
}

START_TEST(test_openai_client_chat_pd_serve)
{
    if (!tu_need(TU_NODE)) {
        return;
    }
    char latest[1100], v4[1100];
    npm_openai("latest", "latest", latest, sizeof(latest));
    npm_openai("4", "4", v4, sizeof(v4));
    char *want = reference_chat(g_port, 8);
    const char *dirs[2] = {latest, v4};
    for (int i = 0; i < 2; i++) {
        json_t *res = run_openai_chat(dirs[i], g_port, 8);
        check_openai_result(res, want, 8);
        const char *ver = json_string_value(json_object_get(res, "version"));
        ck_assert_msg(i == 0 ? atoi(ver) >= 5 : atoi(ver) == 4, "openai client version %s", ver);
        json_decref(res);
    }
    free(want);
}
END_TEST

/* A series' value on the node at port (its /metrics), -1 when absent. */
static double node_metric(int port, const char *name)
{
    http_resp_t r;
    ck_assert_int_eq(http_request(port, "GET", "/metrics", NULL, NULL, &r, 5000), 0);
    double v = pd_metrics_text_value(r.body, name, -1);
    http_resp_free(&r);
    return v;
}

START_TEST(test_openai_client_chat_through_pd_proxy)
{
    if (!tu_need(TU_NODE)) {
        return;
    }
    char latest[1100], v4[1100];
    npm_openai("latest", "latest", latest, sizeof(latest));
    npm_openai("4", "4", v4, sizeof(v4));
    char *want = reference_chat(g_port, 8);
    static const char *const modes[] = {"pull", "push"};
    char tok[600]; /* the nodes' cluster token */
    snprintf(tok, sizeof(tok), "%s/cluster-token", g_dir);
    ck_assert_int_eq(tu_write_file(tok, "chat-cluster\n", 13), 0);
    for (int m = 0; m < 2; m++) {
        char *kv[] = {"--kv-transfer-mode",
                      (char *)modes[m],
                      "--kv-pipe",
                      "tcp",
                      "--kv-heartbeat-interval",
                      "0.2",
                      "--no-kv-prefault",
                      "--cluster-token-file",
                      tok,
                      NULL};
        int pp, dp, xp;
        char tag[32];
        snprintf(tag, sizeof(tag), "p-%s", modes[m]);
        pid_t p = start_bin("pd-prefill", g_model, tag, kv, &pp, true);
        snprintf(tag, sizeof(tag), "d-%s", modes[m]);
        /* the decode reads tool calls (tool_choice "auto"); the prefill needs no parser */
        char *dkv[16] = {NULL};
        int nk = 0;
        for (; kv[nk] != NULL; nk++) {
            dkv[nk] = kv[nk];
        }
        dkv[nk++] = "--enable-auto-tool-choice", dkv[nk++] = "--tool-call-parser", dkv[nk++] = "llama3_json";
        pid_t d = start_bin("pd-decode", g_model, tag, dkv, &dp, true);
        char pre[64], dec[64];
        snprintf(pre, sizeof(pre), "http://127.0.0.1:%d", pp);
        snprintf(dec, sizeof(dec), "http://127.0.0.1:%d", dp);
        char *xa[] = {"--prefill", pre, "--decode", dec, "--health-interval", "0.2", NULL};
        snprintf(tag, sizeof(tag), "x-%s", modes[m]);
        pid_t x = start_bin("pd-proxy", NULL, tag, xa, &xp, true);
        usleep(800 * 1000); /* the proxy learns the prefill's KV address (push) from its first probes */
        const char *done = m == 0 ? "pd:kv_transfers_completed_total{kind=\"pull_load\"}"
                                  : "pd:kv_transfers_completed_total{kind=\"push_load\"}";
        http_resp_t r;
        double before = node_metric(dp, done);
        json_t *res = run_openai_chat(m == 0 ? latest : v4, xp, 8); /* both client majors through P/D */
        check_openai_result(res, want, 8);
        json_decref(res);
        double after = node_metric(dp, done);
        /* two requests (plain and streamed); the second may hit the decode's own prefix cache */
        ck_assert_msg(after >= before + 1, "%s: the decode loaded no KV (%g -> %g)", modes[m], before, after);
        /* n = 2 through P/D: the decode's choices equal pd-serve's (seed + j each) */
        const char *nb =
            "{\"prompt\": \"The cache line is\", \"n\": 2, \"max_tokens\": 6, \"temperature\": 1, "
            "\"seed\": 11}";
        int st;
        json_t *pdr = post(xp, "/v1/completions", nb, &st);
        ck_assert_int_eq(st, 200);
        json_t *ref = post(g_port, "/v1/completions", nb, &st);
        const char *a[2], *b[2];
        ck_assert_int_eq(choice_texts(pdr, a, 2), 2);
        ck_assert_int_eq(choice_texts(ref, b, 2), 2);
        ck_assert_str_eq(a[0], b[0]);
        ck_assert_str_eq(a[1], b[1]);
        json_decref(pdr), json_decref(ref);
        /* tools with tool_choice "auto" (the default) through P/D, streamed: no first-token handover (the
         * decode reads the calls out of the whole reply), the prefill's leg "none"; the text is the
         * same as "none" gives on pd-serve (a random model writes no call) */
        char tb[2048];
        chat_body(tb, sizeof(tb), 8, "\"stream\": true, ");
        const char *fin = NULL;
        int tool_deltas = 0, held = 0;
        char *streamed = stream_chat(xp, tb, &fin, &tool_deltas, &held);
        ck_assert_str_eq(streamed, want);
        ck_assert_int_eq(tool_deltas, 0);
        free(streamed);
        /* structured outputs through P/D, whole and streamed: a stream's prefill samples the first token
         * under the grammar and hands the grammar's state after it to the decode (kv_transfer_params
         * or WRITE_DONE), which resumes it; greedy and seeded replies equal pd-serve's */
        const char *handed = "pd:grammar_states_handed_over_total",
                   *resumed = "pd:grammar_states_resumed_total";
        double handed0 = node_metric(pp, handed);
        double resumed0 = node_metric(dp, resumed);
        static const char *const so[] = {
            "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"p\", \"schema\": "
            "{\"type\": \"object\", \"properties\": {\"k\": {\"type\": \"integer\", \"minimum\": 0, "
            "\"maximum\": 999}, \"s\": {\"type\": \"string\", \"maxLength\": 6}}, \"required\": [\"k\", "
            "\"s\"], "
            "\"additionalProperties\": false}}}",
            "\"guided_regex\": \"[a-z]{3,6}-[0-9]{2}\""};
        for (int q = 0; q < 2; q++) {
            for (int chat = 0; chat < 2; chat++) {
                const char *samp = q == 0 ? "\"temperature\": 0" : "\"temperature\": 1, \"seed\": 11";
                const char *f1, *f2;
                char *one = gen_text(g_port, chat, so[q], samp, &f1);
                char fa[32];
                snprintf(fa, sizeof(fa), "%s", f1);
                for (int stream = 0; stream < 2; stream++) {
                    char *pd = gen_text_as(xp, chat, stream, so[q], samp, &f2);
                    ck_assert_msg(strcmp(one, pd) == 0, "P/D %s%s: '%s' against pd-serve's '%s'", modes[m],
                                  stream ? ", streamed" : "", pd, one);
                    ck_assert_str_eq(f2, "stop");
                    free(pd);
                }
                ck_assert_str_eq(fa, "stop");
                free(one);
            }
        }
        double handed1 = node_metric(pp, handed);
        double resumed1 = node_metric(dp, resumed);
        ck_assert_msg(handed1 - handed0 == 4 && resumed1 - resumed0 == 4,
                      "%s: 4 structured handovers, %g grammar states written and %g resumed", modes[m],
                      handed1 - handed0, resumed1 - resumed0);
        /* the proxy serves the API endpoints too */
        ck_assert_int_eq(http_request(xp, "POST", "/tokenize", NULL, "{\"prompt\": \"hi\"}", &r, 5000), 0);
        ck_assert_int_eq(r.status, 200);
        ck_assert_ptr_nonnull(strstr(r.body, "\"tokens\""));
        http_resp_free(&r);
        ck_assert_int_eq(http_request(xp, "HEAD", "/v1/models", NULL, NULL, &r, 5000), 0);
        ck_assert_int_eq(r.status, 200);
        http_resp_free(&r);
        ck_assert_int_eq(http_request(xp, "GET", "/version", NULL, NULL, &r, 5000), 0);
        ck_assert_int_eq(r.status, 200);
        http_resp_free(&r);
        tu_stop(x, 30);
        tu_stop(d, 30);
        tu_stop(p, 30);
    }
    free(want);
}
END_TEST

int main(void)
{
    tu_probe_tools(TU_NODE);
    Suite *s = suite_create("chat");
    TCase *tc = tcase_create("api");
    tcase_add_unchecked_fixture(tc, suite_setup, suite_teardown);
    tcase_set_timeout(tc, 400);
    tcase_add_test(tc, test_chat_equals_completion_of_rendered_prompt);
    tcase_add_test(tc, test_chat_stream_and_logprobs_shapes);
    tcase_add_test(tc, test_template_sources_in_vllms_order);
    tcase_add_test(tc, test_continue_final_message_and_tools);
    tcase_add_test(tc, test_agent_loop_messages_as_vllm);
    tcase_add_test(tc, test_refusals_name_the_parameter);
    tcase_add_test(tc, test_stop_reason_over_http);
    tcase_add_test(tc, test_n_batched_prompts_and_echo);
    tcase_add_test(tc, test_generation_config);
    tcase_add_test(tc, test_skip_special_tokens);
    tcase_add_test(tc, test_prompt_logprobs);
    tcase_add_test(tc, test_echo_with_logprobs);
    tcase_add_test(tc, test_api_endpoints);
    tcase_add_test(tc, test_seeds_ids_and_nul);
    tcase_add_test(tc, test_auto_tool_choice);
    tcase_add_test(tc, test_openai_client_chat_pd_serve);
    tcase_add_test(tc, test_openai_client_chat_through_pd_proxy);
    suite_add_tcase(s, tc);
    tc = tcase_create("structured");
    tcase_set_timeout(tc, 600);
    tcase_add_unchecked_fixture(tc, structured_setup, suite_teardown);
    tcase_add_test(tc, test_structured_outputs);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
