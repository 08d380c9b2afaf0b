/* engine/engine.c — engine core: admission, step loop, detokenization, stop strings, outputs. */
#define _GNU_SOURCE
#include "engine/engine.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/model_runner.h"
#include "model/generation_config.h"
#include "scheduler/scheduler.h"

/* Engine-side state of a request (req->user points here). */
typedef struct req_ctx {
    void *user;
    pd_detok_t detok;
    char *text; /* output text so far (for stop strings) */
    size_t text_len, text_cap, emitted;
    char *stop[PD_MAX_STOP_STRINGS];
    int32_t num_stop;
    int32_t stop_hit; /* index of the stop string that ended the request, or -1 */
    size_t max_stop_len;
    pd_prompt_logprob_t *plp; /* [num_prompt − 1] prompt_logprobs being gathered, or NULL */
    bool *plp_done;           /* [num_prompt − 1] which are (a preempted request computes again) */
    bool plp_sent;            /* handed to an output */
} req_ctx_t;

/* A queued command from another thread. */
typedef struct cmd {
    int is_abort;
    pd_engine_request_t req;
    int32_t *prompt;
    char id[PD_REQ_ID_MAX];
    char *stop_buf[PD_MAX_STOP_STRINGS];
    struct cmd *next;
} cmd_t;

struct pd_engine {
    pd_engine_config_t cfg;
    char model_name[256];
    pd_backend_t *be;
    pd_model_t *model;
    pd_tokenizer_t *tok;
    pd_generation_config_t gen;
    int32_t eos[PD_MAX_EOS]; /* config.json's EOS ids and generation_config.json's */
    int32_t num_eos;
    pd_kv_cache_t *kv;
    pd_scheduler_t *sched;
    pd_model_runner_t runner;
    int32_t max_model_len;
    size_t max_token_bytes;
    uint64_t prompt_tokens, generation_tokens, steps, finished;
    pd_engine_output_t *aborted_head; /* closing outputs of aborts made between steps */
    pd_engine_output_t **aborted_tail;
    double last_step_s;
    pd_metric_t *step_hist;
    /* threading */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cmd_t *inbox_head, *inbox_tail;
    int32_t inbox_len;
    pd_engine_output_t *out_head, *out_tail;
    pthread_t thread;
    bool running, stop;
    bool woken;         /* the connector has news since the engine last looked */
    int32_t last_items; /* requests the last step ran, +1 when it applied connector news */
    void (*notify)(void *);
    void *notify_ctx;
    pd_engine_stats_t stats; /* snapshot under mu */
};

static void on_release(void *arg, pd_request_t *r);

void pd_engine_config_defaults(pd_engine_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->device = "auto";
    c->matmul_precision = "fp32";
    c->block_size = 16;
    c->max_num_seqs = 64;
    c->max_num_batched_tokens = 2048;
    c->kv_cache_dtype = "auto";
    c->memory_utilization = 0.9;
    c->enable_prefix_caching = true;
    c->enable_chunked_prefill = true;
    c->load_failure_policy = "recompute";
    c->generation_config = "auto";
    c->max_queue = 1024;
}

size_t pd_engine_flags(pd_engine_config_t *c, pd_flag_t *out, size_t max)
{
    pd_flag_t f[] = {
        {"model", PD_FLAG_STR, &c->model_dir, "HF model directory (config.json, safetensors, tokenizer.json)",
         NULL},
        {"device", PD_FLAG_CHOICE, &c->device,
         "compute backend (auto: cuda when a device is present, else cpu)", "auto|cpu|cuda"},
        {"threads", PD_FLAG_INT, &c->threads, "compute threads (0 = all cores)", NULL},
        {"matmul-precision", PD_FLAG_CHOICE, &c->matmul_precision,
         "cuda: input rounding of matmuls on tensor cores (fp32 accumulate); cpu: always fp32",
         "fp32|tf32|bf16|fp16"},
        {"block-size", PD_FLAG_INT, &c->block_size, "tokens per KV cache block", NULL},
        {"max-num-seqs", PD_FLAG_INT, &c->max_num_seqs, "sequences per step at most", NULL},
        {"max-num-batched-tokens", PD_FLAG_INT, &c->max_num_batched_tokens, "tokens per step at most", NULL},
        {"max-model-len", PD_FLAG_INT, &c->max_model_len, "context length limit (0 = the model's)", NULL},
        {"kv-cache-dtype", PD_FLAG_CHOICE, &c->kv_cache_dtype, "KV cache storage type",
         "auto|fp32|fp16|bf16"},
        {"memory-utilization", PD_FLAG_DOUBLE, &c->memory_utilization,
         "fraction of memory the engine plans with", NULL},
        {"kv-cache-memory", PD_FLAG_SIZE, &c->kv_cache_memory,
         "CPU: memory to plan KV cache + model in (e.g. 2G; 0 = physical RAM)", NULL},
        {"enable-prefix-caching", PD_FLAG_BOOL, &c->enable_prefix_caching,
         "reuse KV blocks of equal prefixes", NULL},
        {"enable-chunked-prefill", PD_FLAG_BOOL, &c->enable_chunked_prefill,
         "split long prompts across steps", NULL},
        {"max-queue", PD_FLAG_INT, &c->max_queue, "queued requests before new ones are refused", NULL},
        {"num-blocks-override", PD_FLAG_INT, &c->num_blocks_override,
         "use this many KV blocks instead of the profiled number (0 = profile)", NULL},
        {"generation-config", PD_FLAG_CHOICE, &c->generation_config,
         "auto: the model's generation_config.json sets EOS ids and the defaults of omitted sampling "
         "fields (vLLM's); vllm: ignore it",
         "auto|vllm"},
        {"kv-load-failure-policy", PD_FLAG_CHOICE, &c->load_failure_policy,
         "when remote KV cannot be loaded: recompute the prompt locally, or fail the request",
         "recompute|fail"},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    n = n < max ? n : max;
    memcpy(out, f, n * sizeof(pd_flag_t));
    return n;
}

static pd_dtype_t parse_kv_dtype(const char *s)
{
    if (strcmp(s, "fp16") == 0) {
        return PD_DTYPE_F16;
    }
    if (strcmp(s, "bf16") == 0) {
        return PD_DTYPE_BF16;
    }
    return PD_DTYPE_F32;
}

/* The backend's page copies as the connector's copy ops (it stages a device KV through them). */
static pd_status_t be_copy_pages(void *ctx, void *dst, const void *src, const pd_page_range_t *r, int n,
                                 bool to_host)
{
    pd_backend_t *be = ctx;
    return be->ops->copy_pages(be, dst, src, r, n, to_host ? PD_COPY_D2H : PD_COPY_H2D);
}

static pd_status_t be_pin_host(void *ctx, void *ptr, size_t bytes)
{
    pd_backend_t *be = ctx;
    return be->ops->pin_host(be, ptr, bytes);
}

static void be_unpin_host(void *ctx, void *ptr)
{
    pd_backend_t *be = ctx;
    be->ops->unpin_host(be, ptr);
}

pd_status_t pd_engine_create(const pd_engine_config_t *cfg, pd_engine_t **engine_out)
{
    if (cfg->model_dir == NULL) {
        pd_log_error("engine: --model is required");
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->block_size < 1 || cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < 1 ||
        cfg->max_queue < 1) {
        pd_log_error(
            "engine: --block-size, --max-num-seqs, --max-num-batched-tokens and --max-queue must be >= 1");
        return PD_ERR_INVALID_ARG;
    }
    pd_engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    e->cfg = *cfg;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    const char *base = strrchr(cfg->model_dir, '/');
    snprintf(e->model_name, sizeof(e->model_name), "%s", base != NULL && base[1] ? base + 1 : cfg->model_dir);
    const char *device = cfg->device != NULL ? cfg->device : "auto";
    if (strcmp(device, "auto") == 0) {
        device = pd_backend_resolve("auto");
        pd_log_info("engine: --device auto → %s", device);
    }
    pd_status_t st = pd_backend_create(device, cfg->threads, &e->be);
    if (st == PD_OK) {
        const char *mp = cfg->matmul_precision != NULL ? cfg->matmul_precision : "fp32";
        e->be->matmul_precision = strcmp(mp, "bf16") == 0   ? PD_MATMUL_BF16
                                  : strcmp(mp, "fp16") == 0 ? PD_MATMUL_FP16
                                  : strcmp(mp, "tf32") == 0 ? PD_MATMUL_TF32
                                                            : PD_MATMUL_FP32;
        if (e->be->matmul_precision != PD_MATMUL_FP32 && e->be->host_memory) {
            pd_log_warn("engine: --matmul-precision %s has no effect on the %s backend (fp32)", mp, device);
        }
    }
    if (st == PD_OK) { /* the tokenizer first: a refusal costs no weight loading */
        st = pd_tokenizer_load_dir(cfg->model_dir, &e->tok);
    }
    if (st == PD_OK && (cfg->generation_config == NULL || strcmp(cfg->generation_config, "vllm") != 0)) {
        st = pd_generation_config_load(cfg->model_dir, &e->gen);
    }
    if (st == PD_OK) {
        st = pd_model_load(cfg->model_dir, e->be, &e->model);
    }
    if (st != PD_OK) {
        pd_engine_destroy(e);
        return st;
    }
    const pd_model_config_t *mc = pd_model_config(e->model);
    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_position_embeddings;
    if (mc->arch == PD_ARCH_GPT2 && e->max_model_len > mc->max_position_embeddings) {
        pd_log_error("engine: --max-model-len %d exceeds the model's %d positions", e->max_model_len,
                     mc->max_position_embeddings);
        pd_engine_destroy(e);
        return PD_ERR_INVALID_ARG;
    }
    if (pd_tokenizer_vocab_size(e->tok) > mc->vocab_size) {
        pd_log_error("engine: the tokenizer knows %d ids, the model only %d", pd_tokenizer_vocab_size(e->tok),
                     mc->vocab_size);
        pd_engine_destroy(e);
        return PD_ERR_INVALID_ARG;
    }
    e->max_token_bytes = pd_tokenizer_max_token_bytes(e->tok);
    int32_t max_tokens = cfg->max_num_batched_tokens;
    pd_kv_init_params_t kp = {cfg->block_size, parse_kv_dtype(cfg->kv_cache_dtype), cfg->memory_utilization,
                              cfg->kv_cache_memory, max_tokens, cfg->max_num_seqs, e->max_model_len,
                              /* a device KV is the backend's; the connector stages it */
                              e->be->host_memory ? cfg->kv_allocator : NULL,
                              (uint32_t)(cfg->num_blocks_override > 0 ? cfg->num_blocks_override : 0)};
    st = pd_kv_cache_init(e->model, e->be, &kp, &e->kv);
    if (st != PD_OK) {
        pd_engine_destroy(e);
        return st;
    }
    if (cfg->connector != NULL && cfg->connector->ops->register_kv_caches != NULL) {
        pd_kv_region_desc_t rd;
        memset(&rd, 0, sizeof(rd));
        rd.base = e->kv->region;
        rd.copy = (pd_kv_copy_ops_t){e->be, e->be->ops->copy_pages != NULL ? be_copy_pages : NULL,
                                     e->be->ops->pin_host != NULL ? be_pin_host : NULL,
                                     e->be->ops->unpin_host != NULL ? be_unpin_host : NULL};
        rd.host_memory = e->be->host_memory;
        rd.bytes = e->kv->cfg.region_bytes;
        rd.num_layers = mc->num_layers;
        for (int32_t l = 0; l < mc->num_layers && l < 256; l++) {
            rd.layer_offset[l] = e->kv->cfg.tensors[e->kv->cfg.layer_tensor[l]].offset;
        }
        rd.page_bytes = e->kv->cfg.tensors[0].page_bytes;
        rd.num_groups = e->kv->cfg.num_groups;
        for (int32_t l = 0; l < mc->num_layers && l < 256; l++) {
            rd.layer_group[l] = e->kv->cfg.layer_group[l];
        }
        pd_kv_cache_config_layout(&e->kv->cfg, rd.group_layout, sizeof(rd.group_layout));
        rd.num_blocks = e->kv->cfg.num_blocks;
        rd.block_size = e->kv->cfg.block_size;
        st = cfg->connector->ops->register_kv_caches(cfg->connector, &rd);
        if (st != PD_OK) {
            pd_engine_destroy(e);
            return st;
        }
    }
    pd_scheduler_config_t sc;
    memset(&sc, 0, sizeof(sc));
    sc.max_num_seqs = cfg->max_num_seqs;
    sc.max_num_batched_tokens = max_tokens;
    sc.max_model_len = e->max_model_len;
    sc.block_size = cfg->block_size;
    sc.num_blocks = e->kv->cfg.num_blocks;
    sc.enable_prefix_caching = cfg->enable_prefix_caching;
    sc.enable_chunked_prefill = cfg->enable_chunked_prefill;
    sc.num_kv_groups = e->kv->cfg.num_groups;
    for (int32_t g = 0; g < e->kv->cfg.num_groups; g++) {
        sc.kv_group_window[g] = e->kv->cfg.groups[g].sliding_window;
    }
    e->num_eos = mc->num_eos < PD_MAX_EOS ? mc->num_eos : PD_MAX_EOS;
    memcpy(e->eos, mc->eos_token_ids, (size_t)e->num_eos * sizeof(int32_t));
    pd_generation_config_merge_eos(&e->gen, e->eos, &e->num_eos); /* every EOS id stops */
    sc.num_eos = e->num_eos < 8 ? e->num_eos : 8;
    memcpy(sc.eos_token_ids, e->eos, (size_t)sc.num_eos * sizeof(int32_t));
    sc.load_failure_policy = cfg->load_failure_policy != NULL && strcmp(cfg->load_failure_policy, "fail") == 0
                                 ? PD_LOAD_FAILURE_FAIL
                                 : PD_LOAD_FAILURE_RECOMPUTE;
    st = pd_scheduler_create(&sc, cfg->connector, &e->sched);
    if (st == PD_OK) {
        pd_scheduler_set_release_hook(e->sched, on_release, e);
        st = pd_model_runner_init(&e->runner, e->model, e->be, e->kv, cfg->connector, cfg->max_num_seqs,
                                  max_tokens, e->max_model_len);
    }
    if (st == PD_OK) { /* min_tokens masks every EOS id */
        e->runner.num_eos = sc.num_eos;
        memcpy(e->runner.eos, sc.eos_token_ids, (size_t)sc.num_eos * sizeof(int32_t));
    }
    if (st != PD_OK) {
        pd_engine_destroy(e);
        return st;
    }
    if (cfg->metrics != NULL) {
        e->step_hist = pd_metrics_add(cfg->metrics, PD_METRIC_HISTOGRAM, "pd:engine_step_duration_seconds",
                                      "Duration of one engine step (schedule, forward, update).", NULL,
                                      PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    }
    pd_log_info("engine ready: %s, max_model_len %d, %u KV blocks of %d tokens, max_num_seqs %d, "
                "max_num_batched_tokens %d, prefix caching %s",
                e->model_name, e->max_model_len, e->kv->cfg.num_blocks, cfg->block_size, cfg->max_num_seqs,
                max_tokens, cfg->enable_prefix_caching ? "on" : "off");
    *engine_out = e;
    return PD_OK;
}

static void ctx_free(req_ctx_t *c)
{
    if (c == NULL) {
        return;
    }
    for (int32_t i = 0; i < c->num_stop; i++) {
        free(c->stop[i]);
    }
    free(c->text);
    free(c->plp);
    free(c->plp_done);
    free(c);
}

static void on_release(void *arg, pd_request_t *r)
{
    (void)arg;
    ctx_free(r->user);
    r->user = NULL;
}

static void cmd_free(cmd_t *c)
{
    if (c == NULL) {
        return;
    }
    free(c->prompt);
    for (int i = 0; i < PD_MAX_STOP_STRINGS; i++) {
        free(c->stop_buf[i]);
    }
    json_decref(c->req.kv_transfer_params);
    free(c);
}

void pd_engine_destroy(pd_engine_t *e)
{
    if (e == NULL) {
        return;
    }
    pd_engine_stop(e);
    for (cmd_t *c = e->inbox_head, *n; c != NULL; c = n) {
        n = c->next;
        cmd_free(c);
    }
    pd_engine_output_free(e->out_head);
    pd_engine_output_free(e->aborted_head);
    if (e->runner.logits != NULL) {
        pd_model_runner_destroy(&e->runner);
    }
    pd_scheduler_destroy(e->sched);
    pd_kv_cache_free(e->kv);
    pd_tokenizer_free(e->tok);
    pd_model_free(e->model);
    pd_backend_destroy(e->be);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

const pd_tokenizer_t *pd_engine_tokenizer(const pd_engine_t *e)
{
    return e->tok;
}

const pd_model_config_t *pd_engine_model_config(const pd_engine_t *e)
{
    return pd_model_config(e->model);
}

int32_t pd_engine_max_model_len(const pd_engine_t *e)
{
    return e->max_model_len;
}

const pd_kv_cache_t *pd_engine_kv(const pd_engine_t *e)
{
    return e->kv;
}

const char *pd_engine_model_name(const pd_engine_t *e)
{
    return e->model_name;
}

const char *pd_engine_model_dir(const pd_engine_t *e)
{
    return e->cfg.model_dir;
}

const struct pd_generation_config *pd_engine_generation_config(const pd_engine_t *e)
{
    return &e->gen;
}

/* ------------------------------------------------------------------ admission */

pd_status_t pd_engine_add(pd_engine_t *e, const pd_engine_request_t *rq, char *err, size_t err_len)
{
    const pd_model_config_t *mc = pd_model_config(e->model);
    pd_request_params_t p = rq->params;
    if (rq->num_prompt < 1) {
        snprintf(err, err_len, "the prompt is empty");
        return PD_ERR_INVALID_ARG;
    }
    if (rq->num_prompt >= e->max_model_len) {
        snprintf(err, err_len,
                 "This model's maximum context length is %d tokens. However, you requested %d tokens in the "
                 "prompt",
                 e->max_model_len, rq->num_prompt);
        return PD_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < rq->num_prompt; i++) {
        if (rq->prompt[i] < 0 || rq->prompt[i] >= mc->vocab_size) {
            snprintf(err, err_len, "token id %d at position %d is outside the vocabulary [0, %d)",
                     rq->prompt[i], i, mc->vocab_size);
            return PD_ERR_INVALID_ARG;
        }
    }
    if (p.max_tokens <= 0) {
        p.max_tokens = e->max_model_len - rq->num_prompt;
    }
    if (p.sampling.temperature < 0 || !(p.sampling.top_p > 0 && p.sampling.top_p <= 1) ||
        p.sampling.top_k < -1 || p.logprobs < 0 || p.logprobs > PD_MAX_LOGPROBS) {
        snprintf(err, err_len,
                 "invalid sampling parameters (temperature >= 0, 0 < top_p <= 1, top_k >= -1, "
                 "0 <= logprobs <= 20)");
        return PD_ERR_INVALID_ARG;
    }
    req_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    ctx->user = rq->user;
    ctx->stop_hit = -1;
    for (int32_t i = 0; i < rq->num_stop && i < PD_MAX_STOP_STRINGS; i++) {
        if (rq->stop[i] == NULL || rq->stop[i][0] == '\0') {
            continue;
        }
        ctx->stop[ctx->num_stop] = strdup(rq->stop[i]);
        size_t l = strlen(rq->stop[i]);
        ctx->max_stop_len = l > ctx->max_stop_len ? l : ctx->max_stop_len;
        ctx->num_stop++;
    }
    pd_request_t *r = NULL;
    pd_status_t st = pd_request_create(rq->id, rq->prompt, rq->num_prompt, &p, e->max_model_len, &r);
    if (st != PD_OK) {
        snprintf(err, err_len, "invalid request");
        ctx_free(ctx);
        return st;
    }
    r->user = ctx;
    if (rq->kv_transfer_params != NULL) {
        r->kv_transfer_params = json_incref(rq->kv_transfer_params);
    }
    st = pd_scheduler_add_request(e->sched, r);
    if (st != PD_OK) {
        snprintf(err, err_len, "request id '%s' is already in use", rq->id);
        ctx_free(ctx);
        r->user = NULL;
        pd_request_free(r);
        return st;
    }
    e->prompt_tokens += (uint64_t)rq->num_prompt;
    return PD_OK;
}

static pd_engine_output_t *output_new(const pd_request_t *r);
static void emit_text(req_ctx_t *c, pd_engine_output_t *o, bool finished);
static void output_finish_fields(pd_engine_output_t *o, const pd_request_t *r);

bool pd_engine_abort(pd_engine_t *e, const char *id)
{
    pd_request_t *r = pd_scheduler_abort(e->sched, id);
    if (r == NULL) {
        return false;
    }
    pd_input_batch_remove(&e->runner.batch, r);
    e->finished++;
    pd_engine_output_t *o = output_new(r); /* r stays valid until the next schedule */
    if (o != NULL) {
        emit_text(r->user, o, true);
        output_finish_fields(o, r);
        if (e->aborted_tail == NULL) {
            e->aborted_tail = &e->aborted_head;
        }
        *e->aborted_tail = o;
        e->aborted_tail = &o->next;
    }
    return true;
}

bool pd_engine_has_work(const pd_engine_t *e)
{
    return !pd_scheduler_idle(e->sched);
}

/* ------------------------------------------------------------------ outputs */

void pd_engine_output_free(pd_engine_output_t *o)
{
    while (o != NULL) {
        pd_engine_output_t *n = o->next;
        free(o->text);
        free(o->kv_transfer_params);
        free(o->stop_str);
        free(o->prompt_logprobs);
        free(o);
        o = n;
    }
}

static bool text_append(req_ctx_t *c, const char *s, size_t n)
{
    if (c->text_len + n + 1 > c->text_cap) {
        size_t cap = c->text_cap ? c->text_cap * 2 : 256;
        while (cap < c->text_len + n + 1) {
            cap *= 2;
        }
        char *t = realloc(c->text, cap);
        if (t == NULL) {
            return false;
        }
        c->text = t;
        c->text_cap = cap;
    }
    memcpy(c->text + c->text_len, s, n);
    c->text_len += n;
    c->text[c->text_len] = '\0';
    return true;
}

/* Finds the earliest stop string that ends in the new text; returns its start or -1 (and which
 * string in *which). */
static long find_stop(const req_ctx_t *c, size_t new_from, int32_t *which)
{
    long best = -1;
    for (int32_t i = 0; i < c->num_stop; i++) {
        size_t l = strlen(c->stop[i]);
        size_t from = new_from >= l ? new_from - l + 1 : 0;
        const char *hit = memmem(c->text + from, c->text_len - from, c->stop[i], l);
        if (hit != NULL && (best < 0 || hit - c->text < best)) {
            best = hit - c->text;
            *which = i;
        }
    }
    return best;
}

/* Stores this step's prompt-token scores into their requests (positions already scored, by a run
 * before a preemption, are kept). */
static void gather_prompt_logprobs(pd_engine_t *e, const pd_scheduler_output_t *so)
{
    const pd_input_batch_t *b = &e->runner.batch;
    for (int32_t k = 0; k < b->num_plp; k++) {
        pd_request_t *r = so->items[b->plp_item[k]].req;
        req_ctx_t *c = r->user;
        int32_t n = r->num_prompt_tokens - 1, at = b->plp_pos[k];
        if (c == NULL || n < 1 || at < 0 || at >= n) {
            continue;
        }
        if (c->plp == NULL) {
            c->plp = calloc((size_t)n, sizeof(pd_prompt_logprob_t));
            c->plp_done = calloc((size_t)n, sizeof(bool));
            if (c->plp == NULL || c->plp_done == NULL) {
                free(c->plp), free(c->plp_done);
                c->plp = NULL, c->plp_done = NULL;
                continue;
            }
        }
        if (c->plp_done[at]) {
            continue;
        }
        pd_prompt_logprob_t *p = &c->plp[at];
        p->logprob = e->runner.plp_logprob[k];
        p->rank = e->runner.plp_rank[k];
        p->num_top =
            r->params.prompt_logprobs < PD_MAX_LOGPROBS ? r->params.prompt_logprobs : PD_MAX_LOGPROBS;
        memcpy(p->top_ids, e->runner.plp_top_ids + (size_t)k * PD_MAX_LOGPROBS,
               (size_t)p->num_top * sizeof(int32_t));
        memcpy(p->top_logprobs, e->runner.plp_top_lp + (size_t)k * PD_MAX_LOGPROBS,
               (size_t)p->num_top * sizeof(float));
        c->plp_done[at] = true;
    }
}

/* Moves a request's gathered prompt scores onto its first output. */
static void attach_prompt_logprobs(const pd_request_t *r, pd_engine_output_t *o)
{
    req_ctx_t *c = r->user;
    if (c == NULL || c->plp_sent || !r->params.want_prompt_logprobs) {
        return;
    }
    c->plp_sent = true;
    int32_t n = r->num_prompt_tokens - 1;
    if (n < 1) {
        return;
    }
    o->prompt_logprobs = c->plp;
    o->num_prompt_logprobs = c->plp != NULL ? n : 0;
    c->plp = NULL;
}

static pd_engine_output_t *output_new(const pd_request_t *r)
{
    pd_engine_output_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        return NULL;
    }
    snprintf(o->id, sizeof(o->id), "%s", r->id);
    req_ctx_t *c = r->user;
    o->user = c != NULL ? c->user : NULL;
    o->token = -1;
    o->stop_token = -1;
    return o;
}

/* The text to emit now: all of it when finished, else all but a tail that could still become a
 * stop string (cut back to a UTF-8 character boundary). */
static void emit_text(req_ctx_t *c, pd_engine_output_t *o, bool finished)
{
    size_t upto = c->text_len;
    if (!finished && c->max_stop_len > 1) {
        size_t hold = c->max_stop_len - 1;
        upto = c->text_len > hold ? c->text_len - hold : 0;
        while (upto > c->emitted && ((unsigned char)c->text[upto] & 0xc0) == 0x80) {
            upto--;
        }
    }
    if (upto < c->emitted) {
        upto = c->emitted;
    }
    o->text_len = upto - c->emitted;
    o->text = malloc(o->text_len + 1);
    if (o->text != NULL) {
        if (o->text_len > 0) { /* c->text is NULL until the first text arrives */
            memcpy(o->text, c->text + c->emitted, o->text_len);
        }
        o->text[o->text_len] = '\0';
    } else {
        o->text_len = 0;
    }
    c->emitted = upto;
}

static void output_finish_fields(pd_engine_output_t *o, const pd_request_t *r)
{
    o->finish_reason = pd_request_finish_reason(r);
    o->prompt_tokens = r->num_prompt_tokens;
    o->completion_tokens = pd_request_num_output(r);
    o->cached_tokens = r->num_cached_tokens > 0 ? r->num_cached_tokens : 0;
    double first_sched = r->first_scheduled_time > 0 ? r->first_scheduled_time : r->finish_time;
    o->queue_time = first_sched - r->arrival_time;
    o->ttft = r->first_token_time > 0 ? r->first_token_time - r->arrival_time : 0;
    o->e2e = r->finish_time - r->arrival_time;
    if (r->kv_transfer_params != NULL) {
        o->kv_transfer_params = json_dumps(r->kv_transfer_params, JSON_COMPACT);
    }
    const req_ctx_t *c = r->user;
    if (c != NULL && c->stop_hit >= 0) {
        o->stop_str = strdup(c->stop[c->stop_hit]);
    } else if (r->state == PD_REQ_FINISHED_STOPPED) {
        o->stop_token = r->stop_token;
    }
}

static void push_output(pd_engine_output_t ***tail, pd_engine_output_t *o)
{
    **tail = o;
    *tail = &o->next;
}

pd_status_t pd_engine_step(pd_engine_t *e, pd_engine_output_t **outputs)
{
    double t0 = pd_time_now_s();
    pd_engine_output_t **tail = outputs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    if (e->aborted_head != NULL) {
        *tail = e->aborted_head;
        while (*tail != NULL) {
            tail = &(*tail)->next;
        }
        e->aborted_head = NULL;
        e->aborted_tail = &e->aborted_head;
    }
    const pd_scheduler_output_t *so = pd_scheduler_schedule(e->sched);
    e->last_items = so->num_items;
    pd_model_output_t mo;
    pd_status_t st = pd_model_runner_execute(&e->runner, so, &mo);
    if (st != PD_OK) {
        /* the step failed as a whole: its requests end with an error, the engine goes on */
        pd_log_error("engine: step failed (%s); failing its %d requests", pd_status_str(st), so->num_items);
        for (int32_t i = 0; i < so->num_items; i++) {
            pd_request_t *r = so->items[i].req;
            if (!pd_request_is_finished(r)) {
                pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_ERROR);
            }
        }
        memset(&mo, 0, sizeof(mo));
    }
    pd_scheduler_update_result_t res;
    pd_scheduler_update(e->sched, so, &mo, &res);
    if (mo.finished.num_recving > 0 || mo.finished.num_sending > 0 || mo.num_load_error_blocks > 0) {
        /* the connector's news is applied after scheduling: a load that just finished makes its request
         * runnable in the next step, so that step must come now, not after the idle wait */
        e->last_items++;
    }
    e->steps++;
    e->generation_tokens += (uint64_t)res.num_with_new_token;

    gather_prompt_logprobs(e, so);
    /* new tokens: detokenize, stop strings */
    char *buf = malloc(e->max_token_bytes + 64);
    for (int32_t i = 0; i < res.num_with_new_token && buf != NULL; i++) {
        pd_request_t *r = res.with_new_token[i];
        req_ctx_t *c = r->user;
        int32_t tok = r->tokens[r->num_tokens - 1];
        pd_engine_output_t *o = output_new(r);
        if (o == NULL) {
            continue;
        }
        o->token = tok;
        attach_prompt_logprobs(r, o);
        size_t n = 0;
        size_t before = c->text_len;
        if (pd_detok_step(e->tok, &c->detok, tok, !r->params.keep_special_tokens, buf,
                          e->max_token_bytes + 64, &n) == PD_OK) {
            text_append(c, buf, n);
        }
        bool finished = pd_request_is_finished(r);
        if (c->num_stop > 0 && pd_request_num_output(r) > r->params.min_tokens) {
            int32_t which = -1;
            long at = find_stop(c, before, &which);
            if (at >= 0) {
                /* the stop string is not part of the output unless the request asks for it */
                size_t cut = (size_t)at + (r->params.include_stop_str_in_output ? strlen(c->stop[which]) : 0);
                c->text_len = cut;
                c->text[cut] = '\0';
                c->stop_hit = which;
                if (!finished) {
                    pd_scheduler_finish(e->sched, r, PD_REQ_FINISHED_STOPPED);
                    pd_input_batch_remove(&e->runner.batch, r);
                    finished = true;
                }
            }
        }
        if (finished) {
            char tailbuf[8];
            size_t tn = pd_detok_finish(&c->detok, tailbuf, sizeof(tailbuf));
            text_append(c, tailbuf, tn);
        }
        emit_text(c, o, finished);
        int32_t item = -1;
        for (int32_t k = 0; k < so->num_items; k++) {
            if (so->items[k].req == r) {
                item = k;
                break;
            }
        }
        if (item >= 0 && r->params.logprobs > 0) {
            o->logprob = e->runner.sampled_logprob[item];
            o->num_top = r->params.logprobs;
            memcpy(o->top_ids, e->runner.top_ids + (size_t)item * PD_MAX_LOGPROBS, (size_t)o->num_top * 4);
            memcpy(o->top_logprobs, e->runner.top_logprobs + (size_t)item * PD_MAX_LOGPROBS,
                   (size_t)o->num_top * 4);
        }
        if (finished) {
            output_finish_fields(o, r);
        }
        push_output(&tail, o);
    }
    free(buf);
    /* requests that finished without a new token this step (aborts, errors, stop strings are
     * covered above): a closing output each */
    for (int32_t i = 0; i < res.num_finished; i++) {
        pd_request_t *r = res.finished[i];
        pd_input_batch_remove(&e->runner.batch, r);
        bool had_token = false;
        for (int32_t k = 0; k < res.num_with_new_token; k++) {
            had_token |= res.with_new_token[k] == r;
        }
        e->finished++;
        if (had_token) {
            continue;
        }
        pd_engine_output_t *o = output_new(r);
        if (o != NULL) {
            req_ctx_t *c = r->user;
            emit_text(c, o, true);
            output_finish_fields(o, r);
            push_output(&tail, o);
        }
    }
    e->last_step_s = pd_time_now_s() - t0;
    if (so->num_items > 0) {
        pd_metric_observe(e->step_hist, e->last_step_s);
    }
    return st;
}

/* ------------------------------------------------------------------ threaded use */

static void snapshot_stats(pd_engine_t *e)
{
    pd_scheduler_stats_t ss;
    pd_scheduler_get_stats(e->sched, &ss);
    pd_engine_stats_t *o = &e->stats;
    o->num_running = ss.num_running;
    o->num_waiting = ss.num_waiting;
    o->num_waiting_for_remote_kv = ss.num_waiting_for_remote_kv;
    o->num_holding = ss.num_holding;
    o->num_queued = e->inbox_len;
    o->kv_usage = ss.kv_usage;
    o->blocks_free = ss.blocks_free;
    o->blocks_cached_free = ss.blocks_cached_free;
    o->blocks_used = ss.blocks_used;
    o->num_blocks = e->kv->cfg.num_blocks;
    o->prefix_queries = ss.prefix_queries;
    o->prefix_hits = ss.prefix_hits;
    o->preemptions = ss.num_preemptions;
    o->prompt_tokens = e->prompt_tokens;
    o->generation_tokens = e->generation_tokens;
    o->steps = e->steps;
    o->requests_finished = e->finished;
    o->last_step_s = e->last_step_s;
    o->last_forward_s = e->runner.last_forward_s;
}

void pd_engine_get_stats(pd_engine_t *e, pd_engine_stats_t *out)
{
    pthread_mutex_lock(&e->mu);
    if (!e->running) {
        snapshot_stats(e);
    }
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

/* Applies queued submissions and aborts (engine thread). A submission the engine refuses ends
 * at once with an error output that carries the reason as its text. */
static void drain_inbox(pd_engine_t *e, pd_engine_output_t **outs)
{
    pthread_mutex_lock(&e->mu);
    cmd_t *c = e->inbox_head;
    e->inbox_head = e->inbox_tail = NULL;
    e->inbox_len = 0;
    pthread_mutex_unlock(&e->mu);
    pd_engine_output_t **tail = outs;
    while (*tail != NULL) {
        tail = &(*tail)->next;
    }
    while (c != NULL) {
        cmd_t *next = c->next;
        if (c->is_abort) {
            pd_engine_abort(e, c->id);
        } else {
            char err[256];
            if (pd_engine_add(e, &c->req, err, sizeof(err)) != PD_OK) {
                pd_engine_output_t *o = calloc(1, sizeof(*o));
                if (o != NULL) {
                    snprintf(o->id, sizeof(o->id), "%s", c->id);
                    o->user = c->req.user;
                    o->token = -1;
                    o->stop_token = -1;
                    o->text = strdup(err);
                    o->text_len = strlen(err);
                    o->finish_reason = "error";
                    push_output(&tail, o);
                }
            }
        }
        cmd_free(c);
        c = next;
    }
}

static void *engine_thread(void *arg)
{
    pd_engine_t *e = arg;
    pd_log_info("engine thread started");
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->inbox_head == NULL && !pd_engine_has_work(e)) {
            /* idle: sleep until a submission arrives (bounded, so stop is always seen) */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 200 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        if (!e->stop && e->inbox_head == NULL && !e->woken && e->last_items == 0 && e->aborted_head == NULL) {
            /* work exists but nothing could run (remote KV loading, blocks held for a reader, no
             * free blocks): sleep until the connector or a submission wakes us, bounded */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        e->woken = false;
        bool stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) {
            break;
        }
        pd_engine_output_t *outs = NULL;
        drain_inbox(e, &outs);
        if (pd_engine_has_work(e) || e->aborted_head != NULL) {
            pd_engine_step(e, &outs);
        }
        pthread_mutex_lock(&e->mu);
        snapshot_stats(e);
        if (outs != NULL) {
            if (e->out_tail == NULL) {
                e->out_head = outs;
            } else {
                e->out_tail->next = outs;
            }
            pd_engine_output_t *t = outs;
            while (t->next != NULL) {
                t = t->next;
            }
            e->out_tail = t;
        }
        pthread_mutex_unlock(&e->mu);
        if (outs != NULL && e->notify != NULL) {
            e->notify(e->notify_ctx);
        }
    }
    pd_log_info("engine thread stopped");
    return NULL;
}

/* The connector's wake hook: transfers finished, step again now. */
static void engine_wake(void *arg)
{
    pd_engine_t *e = arg;
    pthread_mutex_lock(&e->mu);
    e->woken = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

pd_status_t pd_engine_start(pd_engine_t *e, void (*notify)(void *ctx), void *ctx)
{
    if (e->cfg.connector != NULL) {
        e->cfg.connector->wake = engine_wake;
        e->cfg.connector->wake_arg = e;
    }
    e->notify = notify;
    e->notify_ctx = ctx;
    pthread_mutex_lock(&e->mu);
    snapshot_stats(e);
    e->stop = false;
    e->running = true;
    pthread_mutex_unlock(&e->mu);
    if (pthread_create(&e->thread, NULL, engine_thread, e) != 0) {
        e->running = false;
        pd_log_error("engine: cannot start the engine thread");
        return PD_ERR_INTERNAL;
    }
    return PD_OK;
}

void pd_engine_stop(pd_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    bool running = e->running;
    e->stop = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (running) {
        pthread_join(e->thread, NULL);
        pthread_mutex_lock(&e->mu);
        e->running = false;
        pthread_mutex_unlock(&e->mu);
    }
}

pd_status_t pd_engine_submit(pd_engine_t *e, const pd_engine_request_t *rq)
{
    cmd_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    c->req = *rq;
    snprintf(c->id, sizeof(c->id), "%s", rq->id);
    c->req.id = c->id;
    c->prompt = malloc((size_t)(rq->num_prompt > 0 ? rq->num_prompt : 1) * sizeof(int32_t));
    if (c->prompt == NULL) {
        free(c);
        return PD_ERR_NO_MEMORY;
    }
    memcpy(c->prompt, rq->prompt, (size_t)rq->num_prompt * sizeof(int32_t));
    c->req.prompt = c->prompt;
    for (int32_t i = 0; i < rq->num_stop && i < PD_MAX_STOP_STRINGS; i++) {
        c->stop_buf[i] = rq->stop[i] != NULL ? strdup(rq->stop[i]) : NULL;
        c->req.stop[i] = c->stop_buf[i];
    }
    if (rq->kv_transfer_params != NULL) {
        json_incref(rq->kv_transfer_params);
    }
    pthread_mutex_lock(&e->mu);
    int32_t backlog = e->inbox_len + e->stats.num_waiting;
    if (backlog >= e->cfg.max_queue) {
        pthread_mutex_unlock(&e->mu);
        cmd_free(c);
        return PD_ERR_NO_SPACE;
    }
    if (e->inbox_tail != NULL) {
        e->inbox_tail->next = c;
    } else {
        e->inbox_head = c;
    }
    e->inbox_tail = c;
    e->inbox_len++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return PD_OK;
}

void pd_engine_abort_async(pd_engine_t *e, const char *id)
{
    cmd_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return;
    }
    c->is_abort = 1;
    snprintf(c->id, sizeof(c->id), "%s", id);
    pthread_mutex_lock(&e->mu);
    if (e->inbox_tail != NULL) {
        e->inbox_tail->next = c;
    } else {
        e->inbox_head = c;
    }
    e->inbox_tail = c;
    e->inbox_len++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

pd_engine_output_t *pd_engine_take_outputs(pd_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    pd_engine_output_t *o = e->out_head;
    e->out_head = e->out_tail = NULL;
    pthread_mutex_unlock(&e->mu);
    return o;
}
