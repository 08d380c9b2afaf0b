/* server/pd-serve.c — pd-serve: both phases on one node, no connector (the colocated baseline).
 *   server:  pd-serve --model DIR --port 8000 [--kv-cache-memory 2G]      (OpenAI API over HTTP)
 *   offline: pd-serve --model DIR --max-tokens 32 "Hello" "The cache"     (prompts as arguments) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/flags.h"
#include "common/log.h"
#include "common/time.h"
#include "engine/engine.h"
#include "server/http_server.h"

typedef struct result {
    char *text;
    size_t len;
    int32_t tokens;
    const char *finish;
    double ttft;
    double e2e;
} result_t;

int main(int argc, char **argv)
{
    pd_engine_config_t cfg;
    pd_engine_config_defaults(&cfg);
    int max_tokens = 32, top_k = 0;
    double temperature = 0.0, top_p = 1.0;
    int64_t seed = -1;
    bool ignore_eos = false;
    pd_http_config_t hcfg;
    pd_http_config_defaults(&hcfg);
    pd_flag_t flags[64];
    size_t n = pd_engine_flags(&cfg, flags, 36);
    size_t nh = n <= 36 ? pd_http_flags(&hcfg, flags + n, 16) : 0;
    if (n > 36 || nh > 16) {
        pd_log_error("pd-serve: a flag table outgrew its room in server/pd-serve.c");
        return 2;
    }
    n += nh;
    flags[n++] = (pd_flag_t){"Offline generation (pd-serve ... PROMPT...)", PD_FLAG_GROUP, NULL, NULL, NULL};
    flags[n++] = (pd_flag_t){"max-tokens", PD_FLAG_INT, &max_tokens, "tokens to generate per prompt", NULL};
    flags[n++] =
        (pd_flag_t){"temperature", PD_FLAG_DOUBLE, &temperature, "sampling temperature (0 = greedy)", NULL};
    flags[n++] = (pd_flag_t){"top-p", PD_FLAG_DOUBLE, &top_p, "nucleus sampling mass", NULL};
    flags[n++] = (pd_flag_t){"top-k", PD_FLAG_INT, &top_k, "top-k sampling (0 = off)", NULL};
    flags[n++] = (pd_flag_t){"seed", PD_FLAG_INT64, &seed, "sampling seed (-1 = unseeded)", NULL};
    flags[n++] = (pd_flag_t){"ignore-eos", PD_FLAG_BOOL, &ignore_eos, "keep generating past EOS", NULL};
    int first = 0;
    pd_status_t st =
        pd_flags_parse(flags, n, argc, argv,
                       "usage: pd-serve --model DIR [options] [PROMPT...]\n"
                       "Serves the OpenAI completions API on one node (prefill + decode), or, given "
                       "PROMPTs, generates a completion for each and exits.",
                       &first);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    pd_metrics_t *metrics = NULL;
    if (pd_metrics_create(&metrics) != PD_OK) {
        return 1;
    }
    cfg.metrics = metrics;
    pd_engine_t *e = NULL;
    st = pd_engine_create(&cfg, &e);
    if (st != PD_OK) {
        pd_metrics_destroy(metrics);
        return 1;
    }
    if (first >= argc) {
        pd_http_server_t *srv = NULL;
        st = pd_http_server_create(&hcfg, e, metrics, &srv);
        if (st == PD_OK) {
            st = pd_http_server_run(srv);
        }
        pd_http_server_destroy(srv);
        pd_engine_destroy(e);
        pd_metrics_destroy(metrics);
        pd_log_info("pd-serve exiting (%s)", pd_status_str(st));
        return st == PD_OK ? 0 : 1;
    }
    int nprompts = argc - first;
    result_t *res = calloc((size_t)nprompts, sizeof(*res));
    double t0 = pd_time_now_s();
    for (int i = 0; i < nprompts; i++) {
        const char *text = argv[first + i];
        int32_t *ids = NULL;
        size_t nids = 0;
        if (pd_tokenizer_encode(pd_engine_tokenizer(e), text, strlen(text), true, &ids, &nids) != PD_OK) {
            pd_log_error("prompt %d is not valid UTF-8", i);
            return 1;
        }
        char id[32], err[256];
        snprintf(id, sizeof(id), "%d", i);
        pd_engine_request_t rq = {0};
        rq.id = id;
        rq.prompt = ids;
        rq.num_prompt = (int32_t)nids;
        rq.params.max_tokens = max_tokens;
        rq.params.ignore_eos = ignore_eos;
        rq.params.sampling = (pd_sampling_params_t){(float)temperature, top_k, (float)top_p, 0.0f};
        rq.params.has_seed = seed >= 0;
        rq.params.seed = (uint64_t)(seed >= 0 ? seed + i : 0);
        rq.user = &res[i];
        if (pd_engine_add(e, &rq, err, sizeof(err)) != PD_OK) {
            pd_log_error("prompt %d: %s", i, err);
            free(ids);
            return 1;
        }
        free(ids);
    }
    while (pd_engine_has_work(e)) {
        pd_engine_output_t *outs = NULL;
        pd_engine_step(e, &outs);
        for (pd_engine_output_t *o = outs; o != NULL; o = o->next) {
            result_t *r = o->user;
            char *text = realloc(r->text, r->len + o->text_len + 1);
            if (text == NULL) {
                pd_log_error("out of memory keeping the output of prompt %d", (int)(r - res));
                return 1;
            }
            r->text = text;
            memcpy(r->text + r->len, o->text, o->text_len);
            r->len += o->text_len;
            r->text[r->len] = '\0';
            if (o->finish_reason != NULL) {
                r->finish = o->finish_reason;
                r->tokens = o->completion_tokens;
                r->ttft = o->ttft;
                r->e2e = o->e2e;
            }
        }
        pd_engine_output_free(outs);
    }
    double dt = pd_time_now_s() - t0;
    int64_t total = 0;
    for (int i = 0; i < nprompts; i++) {
        printf("--- prompt %d (%s, %d tokens, ttft %.1f ms, %.1f ms total)\n%s%s\n", i, res[i].finish,
               res[i].tokens, res[i].ttft * 1e3, res[i].e2e * 1e3, argv[first + i],
               res[i].text ? res[i].text : "");
        total += res[i].tokens;
        free(res[i].text);
    }
    printf("--- %d prompts, %lld tokens generated in %.2f s (%.1f tokens/s)\n", nprompts, (long long)total,
           dt, (double)total / dt);
    free(res);
    pd_engine_destroy(e);
    pd_metrics_destroy(metrics);
    return 0;
}
