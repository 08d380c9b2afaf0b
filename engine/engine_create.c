/* engine/engine_create.c — the engine's configuration and flags, building an engine (backend,
 * model, tokenizer, generation defaults, memory profile, KV cache, scheduler, runner, connector
 * registration) and freeing it, and its read-only accessors. */
#define _GNU_SOURCE
#include "engine/engine_impl.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/log.h"
#include "common/time.h"
#include "engine/grammar_jobs.h"
#include "engine/kv_offload.h"
#include "engine/kv_tier_loader.h"
#include "engine/model_runner.h"
#include "kernels/cpu/isa.h"
#include "model/generation_config.h"
#include "scheduler/scheduler.h"

void pd_engine_config_defaults(pd_engine_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->device = "auto";
    c->matmul_precision = "fp32";
    c->cpu_isa = "auto";
    const char *inv = getenv("PD_BATCH_INVARIANT"); /* vLLM's VLLM_BATCH_INVARIANT=1 */
    c->batch_invariant = inv != NULL && *inv != '\0' && strcmp(inv, "0") != 0;
    c->block_size = 16;
    c->max_num_seqs = 64;
    c->max_num_batched_tokens = 2048;
    c->kv_cache_dtype = "auto";
    c->memory_utilization = 0.9;
    c->tensor_parallel_size = 1;
    c->dtype = "auto";
    c->quantization = "none";
    c->enable_prefix_caching = true;
    c->kv_offload_tier = "none";
    c->kv_offload_load = "auto";
    c->enable_chunked_prefill = true;
    c->load_failure_policy = "recompute";
    c->load_share_wait = 1.0;
    c->generation_config = "auto";
    c->max_queue = 1024;
}

size_t pd_engine_flags(pd_engine_config_t *c, pd_flag_t *out, size_t max)
{
    pd_flag_t f[] = {
        {"Model and device", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"model", PD_FLAG_STR, &c->model_dir, "HF model directory (config.json, safetensors, tokenizer.json)",
         NULL},
        {"dtype", PD_FLAG_CHOICE, &c->dtype,
         "storage dtype of the weight matrices (auto: the checkpoint's torch_dtype, float32 when it names "
         "none); compute and accumulation are fp32 on the CPU",
         "auto|float32|float|bfloat16|float16|half"},
        {"quantization", PD_FLAG_CHOICE, &c->quantization,
         "int8: the linear layers quantized at load to int8 with a scale per output channel (a quarter of "
         "fp32's bytes; embeddings and lm_head stay at --dtype; CPU only; logits differ from the "
         "unquantized model, see README)",
         "none|int8"},
        {"generation-config", PD_FLAG_CHOICE, &c->generation_config,
         "auto: the model's generation_config.json sets EOS ids and the defaults of omitted sampling "
         "fields (vLLM's); vllm: ignore it",
         "auto|vllm"},
        {"device", PD_FLAG_CHOICE, &c->device,
         "compute backend (auto: cuda when a device is present, else cpu)", "auto|cpu|cuda"},
        {"threads", PD_FLAG_INT, &c->threads, "compute threads (0 = all cores)", NULL},
        {"cpu-isa", PD_FLAG_CHOICE, &c->cpu_isa,
         "the highest instruction-set level the CPU kernels use (auto: $PD_CPU_ISA, else all the CPU has); "
         "the start-up log names the level and the matmul variants it allows",
         "auto|portable|avx2|avx512|avx512_bf16|amx"},
        {"matmul-precision", PD_FLAG_CHOICE, &c->matmul_precision,
         "input rounding of matmuls, fp32 accumulate (cuda: tensor-core modes; cpu: fp32, or bf16 with "
         "bf16 weights, through oneDNN)",
         "fp32|tf32|bf16|fp16"},
        {"batch-invariant", PD_FLAG_BOOL, &c->batch_invariant,
         "the same bits for a request whatever else is in its batch and however its prompt is chunked: "
         "prefill and decode, pd-serve and P/D, a stream resumed elsewhere (vLLM's VLLM_BATCH_INVARIANT; "
         "also PD_BATCH_INVARIANT=1). Every matmul row through one kernel at every row count, every query's "
         "attention as a decode step's; slower prefill (bench/RESULTS.md). CPU only",
         NULL},
        {"tensor-parallel-size", PD_FLAG_INT, &c->tensor_parallel_size,
         "vLLM's flag; an engine runs on one device: only 1 is accepted", NULL},
        {"Memory and KV cache", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"kv-cache-memory", PD_FLAG_SIZE, &c->kv_cache_memory,
         "memory to plan KV cache + model in (e.g. 2G; 0 = the device's: physical RAM on the CPU, the GPU's "
         "memory on cuda)",
         NULL},
        {"memory-utilization", PD_FLAG_DOUBLE, &c->memory_utilization,
         "fraction of memory the engine plans with", NULL},
        {"gpu-memory-utilization", PD_FLAG_DOUBLE, &c->memory_utilization,
         "vLLM's name for --memory-utilization", NULL},
        {"block-size", PD_FLAG_INT, &c->block_size, "tokens per KV cache block", NULL},
        {"kv-cache-dtype", PD_FLAG_CHOICE, &c->kv_cache_dtype,
         "KV cache storage type (auto: the model's torch_dtype, as vLLM; fp32 when it has none)",
         "auto|fp32|fp16|bf16"},
        {"enable-prefix-caching", PD_FLAG_BOOL, &c->enable_prefix_caching,
         "reuse KV blocks of equal prefixes", NULL},
        {"kv-offload-tier", PD_FLAG_CHOICE, &c->kv_offload_tier,
         "a second KV tier behind the block pool: cached blocks the pool evicts are copied there and a "
         "later prefix hit loads them back instead of recomputing (host: memory; disk: --kv-offload-path)",
         "none|host|disk"},
        {"kv-offload-size", PD_FLAG_SIZE, &c->kv_offload_size, "capacity of --kv-offload-tier (e.g. 8G)",
         NULL},
        {"kv-offload-path", PD_FLAG_STR, &c->kv_offload_path,
         "the file of --kv-offload-tier disk (created; kept across restarts, checksummed; one node per file)",
         NULL},
        {"kv-offload-load", PD_FLAG_CHOICE, &c->kv_offload_load,
         "where --kv-offload-tier loads run: on a thread of their own while the engine steps other "
         "requests (the request waits), or inline at admission on the engine thread (auto: thread for "
         "disk, inline for host, whose copies take microseconds)",
         "auto|thread|inline"},
        {"num-blocks-override", PD_FLAG_INT, &c->num_blocks_override,
         "use this many KV blocks instead of the profiled number (0 = profile)", NULL},
        {"Scheduler", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"speculative-config", PD_FLAG_STR, &c->speculative_config,
         "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
         "\"prompt_lookup_max\": 4} (default: none)",
         NULL},
        {"kv-events-config", PD_FLAG_STR, &c->kv_events_config,
         "publish the prefix cache's changes, vLLM's JSON: {\"enable_kv_cache_events\": true, \"publisher\": "
         "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\"} "
         "(ZMQ PUB, msgpack batches; the events carry prompt token ids: bind to a private address)",
         NULL},
        {"max-model-len", PD_FLAG_INT, &c->max_model_len, "context length limit (0 = the model's)", NULL},
        {"max-num-seqs", PD_FLAG_INT, &c->max_num_seqs, "sequences per step at most", NULL},
        {"max-num-batched-tokens", PD_FLAG_INT, &c->max_num_batched_tokens, "tokens per step at most", NULL},
        {"enable-chunked-prefill", PD_FLAG_BOOL, &c->enable_chunked_prefill,
         "split long prompts across steps", NULL},
        {"max-queue", PD_FLAG_INT, &c->max_queue, "queued requests before new ones are refused", NULL},
        {"kv-load-failure-policy", PD_FLAG_CHOICE, &c->load_failure_policy,
         "when remote KV cannot be loaded: recompute the prompt locally, or fail the request",
         "recompute|fail"},
        {"kv-load-share-wait", PD_FLAG_DOUBLE, &c->load_share_wait,
         "seconds a decode's pull load may wait while another request loads the same prefix, then reads "
         "it from the prefix cache (0: never wait)",
         NULL},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    memcpy(out, f, (n < max ? n : max) * sizeof(f[0]));
    return n; /* all of them: more than max tells the caller its array is short */
}

/* --kv-cache-dtype: auto is the model's dtype (config.json's torch_dtype), as in vLLM — a bf16
 * checkpoint keeps a bf16 cache (half the bytes of fp32, read in place by decode attention);
 * fp32 when the checkpoint is fp32 or says nothing. */
static pd_dtype_t resolve_kv_dtype(const char *s, const pd_model_config_t *mc)
{
    if (strcmp(s, "auto") == 0) {
        s = strcmp(mc->torch_dtype, "bfloat16") == 0                                          ? "bf16"
            : strcmp(mc->torch_dtype, "float16") == 0 || strcmp(mc->torch_dtype, "half") == 0 ? "fp16"
                                                                                              : "fp32";
    }
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

/* The backend --device names (auto: the registry's best), its matmul precision. */
static pd_status_t open_backend(pd_engine_t *e)
{
    const pd_engine_config_t *cfg = &e->cfg;
    const char *device = cfg->device != NULL ? cfg->device : "auto";
    if (strcmp(device, "auto") == 0) {
        device = pd_backend_resolve("auto");
        pd_log_info("engine: --device auto → %s", device);
    }
    pd_status_t st = pd_cpu_isa_set_cap(cfg->cpu_isa); /* before any kernel (the CPU sampler too) */
    if (st != PD_OK) {
        return st;
    }
    st = pd_backend_create(device, cfg->threads, &e->be);
    if (st != PD_OK) {
        return st;
    }
    const char *mp = cfg->matmul_precision != NULL ? cfg->matmul_precision : "fp32";
    e->be->matmul_precision = strcmp(mp, "bf16") == 0   ? PD_MATMUL_BF16
                              : strcmp(mp, "fp16") == 0 ? PD_MATMUL_FP16
                              : strcmp(mp, "tf32") == 0 ? PD_MATMUL_TF32
                                                        : PD_MATMUL_FP32;
    if (cfg->batch_invariant && !e->be->host_memory) {
        pd_log_error("engine: --batch-invariant is not available on the %s backend (its kernels choose by "
                     "batch size; the CPU backends only)",
                     device);
        return PD_ERR_UNSUPPORTED;
    }
    e->be->batch_invariant = cfg->batch_invariant;
    if (cfg->batch_invariant) {
        pd_log_info("engine: --batch-invariant: every matmul row through one kernel at any row count, every "
                    "query's attention as a decode step's: a request's bits do not depend on its batch or "
                    "its prompt's chunks");
    }
    if (e->be->host_memory &&
        (e->be->matmul_precision == PD_MATMUL_TF32 || e->be->matmul_precision == PD_MATMUL_FP16)) {
        pd_log_error("engine: --matmul-precision %s is not available on the %s backend (fp32, or bf16 "
                     "with bf16 weights)",
                     mp, device);
        return PD_ERR_UNSUPPORTED;
    }
    return PD_OK;
}

/* The draft model of --speculative-config (before the KV plan, so the profile counts its weights):
 * the target's vocabulary, full attention only (its pages share the target's block ids). */
static pd_status_t load_draft_model(pd_engine_t *e)
{
    const pd_model_config_t *mc = pd_model_config(e->model);
    pd_status_t st = pd_model_load_dtype(e->spec.draft_model, e->be, e->cfg.dtype, "none", &e->draft_model);
    if (st != PD_OK) {
        pd_log_error("engine: cannot load the draft model %s: %s", e->spec.draft_model, pd_status_str(st));
        return st;
    }
    const pd_model_config_t *dc = pd_model_config(e->draft_model);
    if (dc->vocab_size != mc->vocab_size) {
        pd_log_error("engine: the draft model's vocabulary (%d) is not the target's (%d)", dc->vocab_size,
                     mc->vocab_size);
        return PD_ERR_INVALID_ARG;
    }
    if (dc->sliding_window > 0 || mc->sliding_window > 0 || dc->max_position_embeddings < e->max_model_len) {
        pd_log_error("engine: a draft model needs full-attention models and %d positions (the draft has %d)",
                     e->max_model_len, dc->max_position_embeddings);
        return PD_ERR_UNSUPPORTED;
    }
    pd_log_info("speculative decoding: draft model %s, %d layers, hidden %d, %.1f MiB", e->spec.draft_model,
                dc->num_layers, dc->hidden_size, (double)pd_model_weight_bytes(e->draft_model) / (1 << 20));
    return PD_OK;
}

/* Tokenizer (first: a refusal costs no weight loading), generation defaults and weights; the
 * context length and the vocabulary checked against the model. */
static pd_status_t load_model(pd_engine_t *e)
{
    const pd_engine_config_t *cfg = &e->cfg;
    pd_status_t st = pd_tokenizer_load_dir(cfg->model_dir, &e->tok);
    if (st == PD_OK && (cfg->generation_config == NULL || strcmp(cfg->generation_config, "vllm") != 0)) {
        st = pd_generation_config_load(cfg->model_dir, &e->gen);
    }
    if (st == PD_OK) {
        st = pd_model_load_dtype(cfg->model_dir, e->be, cfg->dtype, cfg->quantization, &e->model);
    }
    if (st != PD_OK) {
        return st;
    }
    if (e->be->host_memory && e->be->matmul_precision == PD_MATMUL_BF16) {
        if (pd_model_linear_dtype(e->model) != PD_DTYPE_BF16) {
            pd_log_error("engine: --matmul-precision bf16 on the CPU needs bf16 weights (--dtype bfloat16, "
                         "no --quantization); these linear layers are %s",
                         pd_model_linear_dtype(e->model) == PD_DTYPE_I8
                             ? "int8"
                             : pd_dtype_torch_name(pd_model_linear_dtype(e->model)));
            return PD_ERR_UNSUPPORTED;
        }
        if (!e->be->bf16_math_native) {
            /* issue 45: emulated bf16 math was slower than fp32 math here and not batch-invariant */
            pd_log_warn("engine: this CPU has no bf16 arithmetic (AVX512-BF16 or AMX, PD_CPU_ISA allowing): "
                        "--matmul-precision bf16 runs as fp32 math");
            e->be->matmul_precision = PD_MATMUL_FP32;
        } else {
            pd_log_info("engine: --matmul-precision bf16: matmul inputs rounded to bf16, fp32 accumulate "
                        "(an AVX512-BF16 GEMV up to 16 rows with AMX, 32 without; oneDNN above)");
        }
    }
    snprintf(e->weights_name, sizeof(e->weights_name), "%s%s",
             pd_dtype_torch_name(pd_model_weight_dtype(e->model)),
             pd_model_linear_dtype(e->model) == PD_DTYPE_I8 ? "+int8" : "");
    const pd_model_config_t *mc = pd_model_config(e->model);
    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_position_embeddings;
    if (mc->arch == PD_ARCH_GPT2 && e->max_model_len > mc->max_position_embeddings) {
        pd_log_error("engine: --max-model-len %d exceeds the model's %d positions", e->max_model_len,
                     mc->max_position_embeddings);
        return PD_ERR_INVALID_ARG;
    }
    if (pd_tokenizer_vocab_size(e->tok) > mc->vocab_size) {
        pd_log_error("engine: the tokenizer knows %d ids, the model only %d", pd_tokenizer_vocab_size(e->tok),
                     mc->vocab_size);
        return PD_ERR_INVALID_ARG;
    }
    e->max_token_bytes = pd_tokenizer_max_token_bytes(e->tok);
    return e->spec.method == PD_SPEC_DRAFT_MODEL ? load_draft_model(e) : PD_OK;
}

/* The KV cache, sized by the memory plan (pd_kv_cache_init), registered with the connector. */
static pd_status_t make_kv_cache(pd_engine_t *e)
{
    const pd_engine_config_t *cfg = &e->cfg;
    e->kv_dtype = resolve_kv_dtype(cfg->kv_cache_dtype, pd_model_config(e->model));
    if (strcmp(cfg->kv_cache_dtype, "auto") == 0) {
        pd_log_info("KV cache dtype: %s (auto: the model's torch_dtype '%s')",
                    e->kv_dtype == PD_DTYPE_BF16  ? "bf16"
                    : e->kv_dtype == PD_DTYPE_F16 ? "fp16"
                                                  : "fp32",
                    pd_model_config(e->model)->torch_dtype);
    }
    pd_kv_init_params_t kp = {cfg->block_size, e->kv_dtype, cfg->memory_utilization, cfg->kv_cache_memory,
                              cfg->max_num_batched_tokens, cfg->max_num_seqs, e->max_model_len,
                              /* a device KV is the backend's; the connector stages it */
                              e->be->host_memory ? cfg->kv_allocator : NULL,
                              (uint32_t)(cfg->num_blocks_override > 0 ? cfg->num_blocks_override : 0), 0,
                              false};
    if (e->draft_model != NULL) {
        kp.companion_block_bytes =
            pd_kv_block_bytes(pd_model_config(e->draft_model), cfg->block_size, e->kv_dtype, e->max_model_len,
                              cfg->max_num_batched_tokens);
    }
    pd_status_t st = pd_kv_cache_init(e->model, e->be, &kp, &e->kv);
    if (st == PD_OK && e->draft_model != NULL) { /* the draft's pages, indexed by the same block ids */
        pd_kv_init_params_t dp = kp;
        dp.allocator = NULL;
        dp.num_blocks_override = e->kv->cfg.num_blocks;
        dp.companion_block_bytes = 0;
        dp.skip_profile = true;
        st = pd_kv_cache_init(e->draft_model, e->be, &dp, &e->draft_kv);
        if (st == PD_OK && (e->kv->cfg.num_groups != 1 || e->draft_kv->cfg.num_groups != 1)) {
            pd_log_error("engine: a draft model needs one KV cache group in both models");
            st = PD_ERR_UNSUPPORTED;
        }
    }
    if (st != PD_OK || cfg->connector == NULL || cfg->connector->ops->register_kv_caches == NULL) {
        return st;
    }
    const pd_model_config_t *mc = pd_model_config(e->model);
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
        rd.layer_group[l] = e->kv->cfg.layer_group[l];
    }
    rd.page_bytes = e->kv->cfg.tensors[0].page_bytes;
    rd.num_groups = e->kv->cfg.num_groups;
    pd_kv_cache_config_layout(&e->kv->cfg, rd.group_layout, sizeof(rd.group_layout));
    rd.num_blocks = e->kv->cfg.num_blocks;
    rd.block_size = e->kv->cfg.block_size;
    return cfg->connector->ops->register_kv_caches(cfg->connector, &rd);
}

/* What prompt tokens cost here (scheduler/prefill_cost.h), for the connector's fetch-or-compute
 * choice: the ratio of attention to matmul work from the model's shape, the first figures from the
 * memory profile's forward (prompts from position 0; a cold run, so an over-estimate the steps soon
 * replace). */
static void make_prefill_cost(pd_engine_t *e)
{
    const pd_model_config_t *mc = pd_model_config(e->model);
    double d = mc->hidden_size, q = (double)mc->num_heads * mc->head_size,
           kv = (double)mc->num_kv_heads * mc->head_size;
    double mlp = (mc->arch == PD_ARCH_GPT2 ? 2.0 : 3.0) * d * mc->intermediate_size;
    int32_t sliding = 0;
    for (int32_t l = 0; l < mc->num_layers; l++) {
        sliding += mc->sliding_window > 0 && mc->sliding_layer[l];
    }
    pd_prefill_cost_init(&e->prefill_cost,
                         pd_prefill_cost_flop_ratio(mc->num_heads, mc->head_size, d * (2 * q + 2 * kv) + mlp),
                         mc->sliding_window, mc->num_layers > 0 ? (double)sliding / mc->num_layers : 0);
    const pd_kv_profile_t *p = &e->kv->profile;
    double positions = 0;
    for (int32_t s = 0, left = p->forward_tokens; s < p->forward_seqs && left > 0; s++) {
        int32_t len = left < p->forward_seq_len ? left : p->forward_seq_len;
        positions += pd_prefill_cost_positions(&e->prefill_cost, 0, len);
        left -= len;
    }
    pd_prefill_cost_observe(&e->prefill_cost, p->forward_tokens, positions, p->forward_s);
    if (p->forward_s > 0) {
        pd_log_info(
            "prefill cost: the profile's forward of %d tokens took %.3f s: at first %.3g s/token + %.3g "
            "s/position (attention per position / matmuls per token: %.3g from the model's shape)",
            p->forward_tokens, p->forward_s, e->prefill_cost.alpha, e->prefill_cost.beta,
            e->prefill_cost.gamma);
    }
    if (e->cfg.connector != NULL) {
        e->cfg.connector->compute_cost = &e->prefill_cost;
    }
}

/* The scheduler over the KV cache's blocks and groups, every EOS id stopping, and the model runner. */
static pd_status_t make_scheduler(pd_engine_t *e)
{
    const pd_engine_config_t *cfg = &e->cfg;
    const pd_model_config_t *mc = pd_model_config(e->model);
    pd_scheduler_config_t sc;
    memset(&sc, 0, sizeof(sc));
    sc.max_num_seqs = cfg->max_num_seqs;
    sc.max_num_batched_tokens = cfg->max_num_batched_tokens;
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
    sc.vocab_size = mc->vocab_size;
    sc.kv_events = e->kv_events_cfg.enabled;
    sc.num_eos = e->num_eos < 8 ? e->num_eos : 8;
    memcpy(sc.eos_token_ids, e->eos, (size_t)sc.num_eos * sizeof(int32_t));
    sc.load_failure_policy = cfg->load_failure_policy != NULL && strcmp(cfg->load_failure_policy, "fail") == 0
                                 ? PD_LOAD_FAILURE_FAIL
                                 : PD_LOAD_FAILURE_RECOMPUTE;
    sc.load_share_wait = cfg->load_share_wait;
    pd_status_t st = pd_scheduler_create(&sc, cfg->connector, &e->sched);
    if (st == PD_OK) {
        pd_scheduler_set_release_hook(e->sched, eng_on_release, e);
        pd_scheduler_set_admit_hook(e->sched, eng_admit_ready, e);
        st = pd_model_runner_init(&e->runner, e->model, e->be, e->kv, cfg->connector, cfg->max_num_seqs,
                                  cfg->max_num_batched_tokens, e->max_model_len, e->spec.num_tokens);
    }
    if (st == PD_OK && e->spec.method != PD_SPEC_NONE) {
        e->spec_reqs = calloc((size_t)cfg->max_num_seqs, sizeof(pd_request_t *));
        e->spec_want = calloc((size_t)cfg->max_num_seqs, sizeof(int32_t));
        e->spec_next = calloc((size_t)cfg->max_num_seqs, sizeof(pd_request_t *));
        st = e->spec_reqs == NULL || e->spec_want == NULL || e->spec_next == NULL ? PD_ERR_NO_MEMORY : PD_OK;
    }
    if (st == PD_OK && e->draft_model != NULL) {
        st = pd_spec_draft_init(&e->draft, e->draft_model, e->draft_kv, cfg->max_num_seqs,
                                cfg->max_num_batched_tokens, e->runner.batch.max_blocks);
    }
    if (st == PD_OK && e->kv_events_cfg.enabled) {
        st = pd_kv_events_pub_create(&e->kv_events_cfg, e->be->host_memory ? "CPU" : "GPU", &e->kv_pub);
    }
    if (st == PD_OK && e->kv_pub != NULL) {
        pd_kv_event_log_t *log = pd_scheduler_kv_events(e->sched);
        pd_kv_events_pub_publish(e->kv_pub, log); /* AllBlocksCleared: this cache starts empty */
        pd_kv_event_log_reset(log);
    }
    if (st == PD_OK) { /* min_tokens masks every EOS id */
        e->runner.num_eos = sc.num_eos;
        e->runner.tok = e->tok;
        memcpy(e->runner.eos, sc.eos_token_ids, (size_t)sc.num_eos * sizeof(int32_t));
    }
    return st;
}

/* The tier's changes as KV events (--kv-events-config), in its medium. */
static void tier_event(void *arg, pd_hash128_t key, bool stored)
{
    pd_engine_t *e = arg;
    pd_kv_event_tier(pd_scheduler_kv_events(e->sched),
                     pd_kv_offload_medium(e->offload) == PD_KV_OFFLOAD_DISK ? PD_KV_MEDIUM_DISK_TIER
                                                                            : PD_KV_MEDIUM_HOST_TIER,
                     pd_kv_event_hash(key), stored);
}

/* --kv-offload-tier: the tier behind the block pool. Its file's fingerprint names everything that
 * changes the KV a block holds: the model's files and weight dtype, the KV dtype and geometry, the
 * matmul precision, the CPU kernels' level and --batch-invariant (its kernels give other last bits:
 * a block from a node without it would break the mode's promise; named only when on, so files
 * written before it keep their fingerprint). */
static pd_status_t make_offload(pd_engine_t *e)
{
    const pd_engine_config_t *cfg = &e->cfg;
    const char *tier = cfg->kv_offload_tier != NULL ? cfg->kv_offload_tier : "none";
    if (strcmp(tier, "none") == 0) {
        return PD_OK;
    }
    if (cfg->kv_offload_size == 0) {
        pd_log_error("engine: --kv-offload-tier %s needs --kv-offload-size (e.g. 8G)", tier);
        return PD_ERR_INVALID_ARG;
    }
    if (e->draft_model != NULL) {
        pd_log_error("engine: --kv-offload-tier with a draft model: its pages would not be offloaded");
        return PD_ERR_UNSUPPORTED;
    }
    const char *mode = cfg->kv_offload_load != NULL ? cfg->kv_offload_load : "auto";
    if (!e->be->host_memory && strcmp(mode, "thread") == 0) {
        pd_log_error(
            "engine: --kv-offload-load thread needs a host-memory KV: a device KV's tier copies run on "
            "the engine's stream (auto or inline)");
        return PD_ERR_UNSUPPORTED;
    }
    const pd_kv_cache_config_t *kc = &e->kv->cfg;
    pd_kv_offload_config_t oc;
    memset(&oc, 0, sizeof(oc));
    oc.medium = strcmp(tier, "disk") == 0 ? PD_KV_OFFLOAD_DISK : PD_KV_OFFLOAD_HOST;
    oc.size_bytes = cfg->kv_offload_size;
    oc.path = cfg->kv_offload_path;
    oc.base = e->kv->region;
    oc.num_tensors = kc->num_tensors;
    oc.page_bytes = kc->tensors[0].page_bytes;
    oc.num_blocks = kc->num_blocks;
    oc.device = e->be->host_memory ? NULL : e->be;
    for (int32_t t = 0; t < kc->num_tensors; t++) {
        oc.tensor_offset[t] = kc->tensors[t].offset;
        if (kc->tensors[t].page_bytes != oc.page_bytes) {
            pd_log_error("engine: --kv-offload-tier needs KV tensors of one page size");
            return PD_ERR_UNSUPPORTED;
        }
    }
    char id[512], layout[128];
    pd_status_t st = pd_model_fingerprint(cfg->model_dir, id, 160);
    if (st != PD_OK) {
        return st;
    }
    pd_kv_cache_config_layout(kc, layout, sizeof(layout));
    size_t n = strlen(id);
    snprintf(id + n, sizeof(id) - n, "|%s|%s|bs%d|%zu×%d|%s|mm%d|%s%s", e->weights_name,
             pd_engine_kv_dtype_name(e), kc->block_size, oc.page_bytes, oc.num_tensors, layout,
             (int)e->be->matmul_precision,
             e->be->host_memory ? pd_cpu_isa_name(pd_cpu_isa_level()) : "device",
             e->be->batch_invariant ? "|batch-invariant" : "");
    oc.fingerprint = pd_hash64(id, strlen(id), 0x6b766f66666c6f61ull);
    st = pd_kv_offload_create(&oc, &e->offload);
    if (st != PD_OK) {
        return st;
    }
    pd_kv_tier_loader_config_t lc = {
        .offload = e->offload,
        .thread = strcmp(mode, "auto") == 0 ? oc.medium == PD_KV_OFFLOAD_DISK : strcmp(mode, "thread") == 0,
        .done = eng_wake,
        .arg = e,
        .read_delay_s = cfg->kv_offload_read_delay,
    };
    if (cfg->metrics != NULL) { /* a block loads in microseconds from memory, milliseconds from a cold disk */
        static const double b[] = {1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.25};
        lc.hist = pd_metrics_add(cfg->metrics, PD_METRIC_HISTOGRAM, "pd:kv_offload_load_seconds",
                                 "Time to load one KV block from the offload tier (read and checksum).", NULL,
                                 b, (int)(sizeof(b) / sizeof(b[0])));
    }
    st = pd_kv_tier_loader_create(&lc, &e->tier_loader);
    if (st != PD_OK) {
        return st;
    }
    pd_log_info("kv offload: loads run %s", pd_kv_tier_loader_mode(e->tier_loader));
    if (pd_scheduler_kv_events(e->sched) != NULL) { /* a reopened file's blocks are announced now */
        pd_kv_offload_set_listener(e->offload, tier_event, e);
    }
    return pd_kv_manager_set_tier(pd_scheduler_kv(e->sched), pd_kv_tier_loader_tier(e->tier_loader));
}

/* vLLM's spec_decode counters (only with --speculative-config, as vLLM registers them). */
static void add_spec_metrics(pd_engine_t *e, pd_metrics_t *m)
{
    if (e->spec.method == PD_SPEC_NONE) {
        return;
    }
    e->spec_m[0] = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:spec_decode_num_drafts_total",
                                  "Number of spec decoding drafts.", NULL, NULL, 0);
    e->spec_m[1] = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:spec_decode_num_draft_tokens_total",
                                  "Number of draft tokens.", NULL, NULL, 0);
    e->spec_m[2] = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:spec_decode_num_accepted_tokens_total",
                                  "Number of accepted tokens.", NULL, NULL, 0);
    for (int32_t j = 0; j < e->spec.num_tokens; j++) {
        char pos[16];
        snprintf(pos, sizeof(pos), "%d", j);
        pd_metric_label_t l = {"position", pos};
        e->spec_pos[j] =
            pd_metrics_add_labels(m, PD_METRIC_COUNTER, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                  "Accepted tokens per draft position.", &l, 1, NULL, 0);
    }
}

static pd_status_t engine_create_here(const pd_engine_config_t *cfg, pd_engine_t **engine_out)
{
    if (cfg->model_dir == NULL) {
        pd_log_error("engine: --model is required");
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->tensor_parallel_size != 1) {
        pd_log_error("engine: --tensor-parallel-size %d: pdserve runs each engine on one device (only 1 is "
                     "supported; scale out with more prefill or decode nodes)",
                     cfg->tensor_parallel_size);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->block_size < 1 || cfg->max_num_seqs < 1 || cfg->max_num_batched_tokens < 1 ||
        cfg->max_queue < 1) {
        pd_log_error(
            "engine: --block-size, --max-num-seqs, --max-num-batched-tokens and --max-queue must be >= 1");
        return PD_ERR_INVALID_ARG;
    }
    if (!(cfg->load_share_wait >= 0 && cfg->load_share_wait <= 3600)) { /* NaN too */
        pd_log_error("engine: --kv-load-share-wait %g: seconds from 0 (never wait) to 3600",
                     cfg->load_share_wait);
        return PD_ERR_INVALID_ARG;
    }
    pd_spec_config_t spec;
    pd_kv_events_config_t kv_events;
    char why[256];
    if (pd_spec_config_parse(cfg->speculative_config, &spec, why, sizeof(why)) != PD_OK ||
        pd_kv_events_config_parse(cfg->kv_events_config, &kv_events, why, sizeof(why)) != PD_OK) {
        pd_log_error("engine: %s", why);
        return PD_ERR_INVALID_ARG;
    }
    pd_engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    e->cfg = *cfg;
    e->spec = spec;
    e->kv_events_cfg = kv_events;
    e->aborted_tail = &e->aborted_head;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    const char *base = strrchr(cfg->model_dir, '/');
    snprintf(e->model_name, sizeof(e->model_name), "%s", base != NULL && base[1] ? base + 1 : cfg->model_dir);
    pd_status_t st = open_backend(e);
    st = st == PD_OK ? load_model(e) : st;
    st = st == PD_OK ? make_kv_cache(e) : st;
    if (st == PD_OK) {
        make_prefill_cost(e);
    }
    st = st == PD_OK ? make_scheduler(e) : st;
    st = st == PD_OK ? make_offload(e) : st;
    if (st != PD_OK) {
        pd_engine_destroy(e);
        return st;
    }
    if (cfg->metrics != NULL) {
        e->step_hist = pd_metrics_add(cfg->metrics, PD_METRIC_HISTOGRAM, "pd:engine_step_duration_seconds",
                                      "Duration of one engine step (schedule, forward, update).", NULL,
                                      PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
        e->iteration_tokens = pd_metrics_add(cfg->metrics, PD_METRIC_HISTOGRAM, "vllm:iteration_tokens_total",
                                             "Histogram of number of tokens per engine_step.", NULL,
                                             PD_VLLM_ITERATION_BUCKETS, PD_VLLM_ITERATION_NUM_BUCKETS);
        add_spec_metrics(e, cfg->metrics);
    }
    if (spec.method == PD_SPEC_NGRAM) {
        pd_log_info("speculative decoding: ngram, %d draft tokens per step, n-grams of %d..%d tokens",
                    spec.num_tokens, spec.lookup_min, spec.lookup_max);
    } else if (spec.method == PD_SPEC_DRAFT_MODEL) {
        pd_log_info("speculative decoding: draft model, %d draft tokens per step", spec.num_tokens);
    }
    pd_log_info("engine ready: %s, max_model_len %d, %u KV blocks of %d tokens, max_num_seqs %d, "
                "max_num_batched_tokens %d, prefix caching %s",
                e->model_name, e->max_model_len, e->kv->cfg.num_blocks, cfg->block_size, cfg->max_num_seqs,
                cfg->max_num_batched_tokens, cfg->enable_prefix_caching ? "on" : "off");
    *engine_out = e;
    return PD_OK;
}

const char *pd_engine_kv_events_endpoint(const pd_engine_t *e)
{
    return pd_kv_events_pub_endpoint(e->kv_pub);
}

const char *pd_engine_kv_events_replay_endpoint(const pd_engine_t *e)
{
    return pd_kv_events_pub_replay_endpoint(e->kv_pub);
}

void pd_engine_destroy(pd_engine_t *e)
{
    if (e == NULL) {
        return;
    }
    pd_engine_stop(e);
    if (e->cfg.connector != NULL && e->cfg.connector->compute_cost == &e->prefill_cost) {
        e->cfg.connector->compute_cost = NULL; /* the connector may outlive the engine */
    }
    pd_grammar_jobs_destroy(e->gjobs); /* before the vocabulary it walks goes (with the runner) */
    for (cmd_t *c = e->inbox_head, *n; c != NULL; c = n) {
        n = c->next;
        eng_cmd_free(c);
    }
    pd_engine_output_free(e->out_head);
    pd_engine_output_free(e->aborted_head);
    if (e->runner.logits != NULL) {
        pd_model_runner_destroy(&e->runner);
    }
    pd_kv_events_pub_destroy(e->kv_pub);
    pd_kv_tier_loader_destroy(e->tier_loader); /* its thread stops before the loads it holds go */
    pd_scheduler_destroy(e->sched);
    pd_kv_offload_destroy(e->offload);
    if (e->draft.tok != NULL) {
        pd_spec_draft_destroy(&e->draft);
    }
    pd_kv_cache_free(e->draft_kv);
    pd_model_free(e->draft_model);
    free(e->spec_reqs), free(e->spec_want), free(e->spec_next);
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

const char *pd_engine_params_error(const pd_engine_t *e, const void *kv_transfer_params)
{
    pd_connector_t *conn = e->cfg.connector;
    if (kv_transfer_params == NULL || conn == NULL || conn->ops->params_error == NULL) {
        return NULL;
    }
    return conn->ops->params_error(conn, kv_transfer_params);
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

const char *pd_engine_weight_dtype_name(const pd_engine_t *e)
{
    return e->weights_name;
}

const char *pd_engine_kv_dtype_name(const pd_engine_t *e)
{
    return e->kv_dtype == PD_DTYPE_BF16 ? "bf16" : e->kv_dtype == PD_DTYPE_F16 ? "fp16" : "fp32";
}

const pd_engine_config_t *pd_engine_config(const pd_engine_t *e)
{
    return &e->cfg;
}

const struct pd_block_pool *pd_engine_block_pool(pd_engine_t *e)
{
    return pd_scheduler_kv(e->sched)->pool;
}

const char *pd_engine_model_dir(const pd_engine_t *e)
{
    return e->cfg.model_dir;
}

const struct pd_generation_config *pd_engine_generation_config(const pd_engine_t *e)
{
    return &e->gen;
}

/* Building an engine runs OpenMP regions (laying weights out, the profile run), and libgomp keeps a
 * thread pool for every thread that ever opened one. It counts the threads of all pools, and once
 * they outnumber the CPUs its barriers spin 100 times and then sleep on a futex: each of a decode
 * step's ~50 regions then pays futex wake-ups (2-core VM, demo model: ~100 context switches per
 * token, steps 0.8 -> 3.2 ms). So the engine is built on a thread that ends, taking its pool with
 * it, and the thread that steps (the engine thread, or the caller of pd_engine_step) holds the only
 * pool (issue 53). */
typedef struct {
    const pd_engine_config_t *cfg;
    pd_engine_t **out;
    pd_status_t st;
} create_job_t;

static void *create_job(void *arg)
{
    create_job_t *j = arg;
    j->st = engine_create_here(j->cfg, j->out);
    return NULL;
}

pd_status_t pd_engine_create(const pd_engine_config_t *cfg, pd_engine_t **engine_out)
{
    create_job_t j = {cfg, engine_out, PD_ERR_INTERNAL};
    pthread_attr_t attr;
    pthread_t t;
    bool started = false;
    if (pthread_attr_init(&attr) == 0) {
        /* a main thread's stack (ulimit -s, usually 8 MiB); a thread's default may be less */
        started =
            pthread_attr_setstacksize(&attr, 8u << 20) == 0 && pthread_create(&t, &attr, create_job, &j) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!started) {
        pd_log_warn("engine: cannot start a thread to build the engine on; building it here (its OpenMP "
                    "pool stays, and may slow the engine's steps down)");
        return engine_create_here(cfg, engine_out);
    }
    pthread_join(t, NULL);
    return j.st;
}
