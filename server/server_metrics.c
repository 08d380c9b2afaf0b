/* server/server_metrics.c — the HTTP front's Prometheus series: vLLM's names, types, buckets and
 * labels (model_name, engine) for what pdserve shares with vLLM, pd: names for what it lacks
 * (requests waiting for remote KV, block states, HTTP errors). Loop thread only, except that
 * the registry itself is thread-safe (the engine and the connector add series of their own). */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "engine/engine.h"
#include "server/http_internal.h"

/* vLLM v1 names its engines 0..N-1; pdserve runs one engine per process */
#define ENGINE_INDEX "0"

static pd_metric_t *gauge(pd_metrics_t *r, const char *name, const char *help)
{
    return pd_metrics_add(r, PD_METRIC_GAUGE, name, help, NULL, NULL, 0);
}

static pd_metric_t *counter(pd_metrics_t *r, const char *name, const char *help)
{
    return pd_metrics_add(r, PD_METRIC_COUNTER, name, help, NULL, NULL, 0);
}

static pd_metric_t *histogram(pd_metrics_t *r, const char *name, const char *help, const double *b, int nb)
{
    return pd_metrics_add(r, PD_METRIC_HISTOGRAM, name, help, NULL, b, nb);
}

/* vllm:cache_config_info: value 1, the cache configuration in its labels (as vLLM's). */
static void cache_config_info(pd_http_server_t *s)
{
    const pd_engine_config_t *cfg = pd_engine_config(s->engine);
    char blocks[16], bsize[16], util[32], cpu_blocks[16];
    snprintf(blocks, sizeof(blocks), "%u", pd_engine_kv(s->engine)->cfg.num_blocks);
    pd_engine_stats_t st;
    pd_engine_get_stats(s->engine, &st);
    snprintf(cpu_blocks, sizeof(cpu_blocks), "%u", st.offload_slots); /* the offload tier's blocks */
    snprintf(bsize, sizeof(bsize), "%d", cfg->block_size);
    snprintf(util, sizeof(util), "%g", cfg->memory_utilization);
    pd_metric_label_t l[6] = {
        {"block_size", bsize},
        {"cache_dtype", cfg->kv_cache_dtype},
        {"enable_prefix_caching", cfg->enable_prefix_caching ? "True" : "False"},
        {"gpu_memory_utilization", util},
        {"num_gpu_blocks", blocks},
        {"num_cpu_blocks", cpu_blocks},
    };
    pd_metric_t *g = pd_metrics_add_labels(s->metrics, PD_METRIC_GAUGE, "vllm:cache_config_info",
                                           "Information of the LLMEngine CacheConfig", l, 6, NULL, 0);
    pd_metric_set(g, 1);
}

void pd_http_metrics_register(pd_http_server_t *s)
{
    srv_metrics_t *m = &s->m;
    pd_metrics_t *r = s->metrics;
    pd_metric_label_t k[2] = {{"model_name", s->model_name}, {"engine", ENGINE_INDEX}};
    if (pd_metrics_set_const_labels(r, "vllm:", k, 2) != PD_OK) {
        pd_log_warn("metrics: the model name '%s' does not fit a label; vllm: series carry none",
                    s->model_name);
    }
    m->running = gauge(r, "vllm:num_requests_running", "Number of requests in model execution batches.");
    m->waiting = gauge(r, "vllm:num_requests_waiting",
                       "Number of requests waiting to be processed (incl. those waiting for remote KV).");
    m->kv_usage = gauge(r, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.");
    m->gpu_usage =
        gauge(r, "vllm:gpu_cache_usage_perc",
              "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc "
              "instead.");
    m->prefix_queries = counter(r, "vllm:prefix_cache_queries_total",
                                "Prefix cache queries, in terms of number of queried tokens.");
    m->prefix_hits =
        counter(r, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.");
    m->preemptions =
        counter(r, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.");
    m->prompt_tokens = counter(r, "vllm:prompt_tokens_total", "Number of prefill tokens processed.");
    m->generation_tokens =
        counter(r, "vllm:generation_tokens_total", "Number of generation tokens processed.");
    static const char *reasons[4] = {"finished_reason=stop", "finished_reason=length",
                                     "finished_reason=abort", "finished_reason=error"};
    for (int i = 0; i < 4; i++) {
        m->success[i] = pd_metrics_add(r, PD_METRIC_COUNTER, "vllm:request_success_total",
                                       "Count of successfully processed requests.", reasons[i], NULL, 0);
    }
    double tb[32];
    int ntb = pd_metrics_buckets_125((double)pd_engine_max_model_len(s->engine), tb, 32);
    m->req_prompt =
        histogram(r, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tb, ntb);
    m->req_gen =
        histogram(r, "vllm:request_generation_tokens", "Number of generation tokens processed.", tb, ntb);
    m->req_max_gen = histogram(r, "vllm:request_max_num_generation_tokens",
                               "Histogram of maximum number of requested generation tokens.", tb, ntb);
    static const double nb[5] = {1, 2, 5, 10, 20};
    m->req_n = histogram(r, "vllm:request_params_n", "Histogram of the n request parameter.", nb, 5);
    m->req_max_tokens = histogram(r, "vllm:request_params_max_tokens",
                                  "Histogram of the max_tokens request parameter.", tb, ntb);
    m->ttft = histogram(r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        PD_VLLM_TTFT_BUCKETS, PD_VLLM_TTFT_NUM_BUCKETS);
    m->itl = histogram(r, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                       PD_VLLM_ITL_BUCKETS, PD_VLLM_ITL_NUM_BUCKETS);
    m->tpot = histogram(r, "vllm:time_per_output_token_seconds",
                        "Histogram of time per output token in seconds. DEPRECATED: Use "
                        "vllm:inter_token_latency_seconds instead.",
                        PD_VLLM_ITL_BUCKETS, PD_VLLM_ITL_NUM_BUCKETS);
    const double *rb = PD_VLLM_REQUEST_BUCKETS;
    int nrb = PD_VLLM_REQUEST_NUM_BUCKETS;
    m->e2e = histogram(r, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                       rb, nrb);
    m->queue = histogram(r, "vllm:request_queue_time_seconds",
                         "Histogram of time spent in WAITING phase for request.", rb, nrb);
    m->inference = histogram(r, "vllm:request_inference_time_seconds",
                             "Histogram of time spent in RUNNING phase for request.", rb, nrb);
    m->prefill = histogram(r, "vllm:request_prefill_time_seconds",
                           "Histogram of time spent in PREFILL phase for request (on a decode node: the "
                           "remote KV load and the first step).",
                           rb, nrb);
    m->decode = histogram(r, "vllm:request_decode_time_seconds",
                          "Histogram of time spent in DECODE phase for request.", rb, nrb);
    cache_config_info(s);
    /* pdserve's own: what vLLM has no series for */
    m->waiting_remote =
        gauge(r, "pd:num_requests_waiting_for_remote_kv",
              "Requests waiting for KV from a remote peer (counted in vllm:num_requests_waiting too).");
    m->blocks_free = gauge(r, "pd:kv_blocks_free", "Free KV blocks without cached content.");
    m->blocks_cached =
        gauge(r, "pd:kv_blocks_cached_free", "Free KV blocks that still hold a cached prefix.");
    m->blocks_used = gauge(r, "pd:kv_blocks_used", "KV blocks referenced by requests.");
    m->prefill_cost[0] = gauge(r, "pd:prefill_cost_seconds_per_token",
                               "What computing a prompt token costs this node, before attention's share "
                               "(fitted to its prompt-heavy steps; 0: not measured yet).");
    m->prefill_cost[1] =
        gauge(r, "pd:prefill_cost_seconds_per_position",
              "What each position a prompt token attends to adds to its cost (the same fit).");
    m->http_errors = counter(r, "pd:http_errors_total", "Requests answered with an error.");
    pd_engine_stats_t st;
    pd_engine_get_stats(s->engine, &st);
    if (st.offload) {
        static const char *names[9][2] = {
            {"pd:kv_offload_queries_total",
             "KV blocks looked up in the offload tier past a prefix-cache hit."},
            {"pd:kv_offload_hits_total",
             "KV blocks the offload tier loaded back into the pool (prefix hits)."},
            {"pd:kv_offload_saved_blocks_total", "Evicted KV blocks written to the offload tier."},
            {"pd:kv_offload_corrupt_blocks_total",
             "Offload tier blocks refused by their checksum (dropped; their tokens recomputed)."},
            {"pd:kv_offload_bytes_written_total", "Bytes of KV written to the offload tier."},
            {"pd:kv_offload_bytes_read_total", "Bytes of KV read back from the offload tier."},
            {"pd:kv_offload_read_seconds_total",
             "Seconds spent reading blocks from the offload tier (on its loader thread or the engine's: "
             "--kv-offload-load)."},
            {"pd:kv_offload_blocks", "KV blocks the offload tier holds."},
            {"pd:kv_offload_capacity_blocks", "KV blocks the offload tier can hold."},
        };
        for (int i = 0; i < 9; i++) {
            m->offload[i] = i < 7 ? counter(r, names[i][0], names[i][1]) : gauge(r, names[i][0], names[i][1]);
        }
    }
    m->grammar_handed = counter(r, "pd:grammar_states_handed_over_total",
                                "Structured outputs handed to a decode node with their grammar's state after "
                                "the first token (prefill).");
    m->grammar_resumed = counter(r, "pd:grammar_states_resumed_total",
                                 "Structured outputs resumed at the grammar state their prefill handed over "
                                 "(decode).");
    m->grammar_ahead =
        counter(r, "pd:grammars_walked_ahead_total",
                "Structured outputs' grammars whose token masks were prepared before their first "
                "token, off the engine thread (their requests waited).");
    m->grammar_ahead_s =
        counter(r, "pd:grammar_walk_ahead_seconds_total", "Seconds those preparations took.");
    m->handoffs = counter(r, "pd:drain_handoffs_total",
                          "Streams a draining node ended early for pd-proxy to resume on another node.");
    m->resumed = counter(r, "pd:resumed_requests_total",
                         "Requests that went on after tokens another node streamed (resume_token_ids).");
    static const char *writers[2] = {"loop", "engine"};
    for (int i = 0; i < 2; i++) {
        pd_metric_label_t w = {"writer", writers[i]};
        m->stream_chunks[i] = pd_metrics_add_labels(
            r, PD_METRIC_COUNTER, "pd:stream_chunks_total",
            "Chunks of streamed replies by the thread that wrote them: the engine thread (a plain stream's "
            "token, as its step ends) or the HTTP loop (the rest).",
            &w, 1, NULL, 0);
    }
    m->load_waits = counter(r, "pd:kv_load_waits_total",
                            "Remote KV loads put off while another request loaded the same prefix (then read "
                            "from the local prefix cache).");
}

void pd_http_metrics_refresh(pd_http_server_t *s)
{
    pd_engine_stats_t st;
    pd_engine_get_stats(s->engine, &st);
    srv_metrics_t *m = &s->m;
    pd_metric_set(m->running, st.num_running);
    pd_metric_set(m->waiting, st.num_waiting + st.num_queued + st.num_waiting_for_remote_kv);
    pd_metric_set(m->waiting_remote, st.num_waiting_for_remote_kv);
    pd_metric_set(m->kv_usage, st.kv_usage);
    pd_metric_set(m->gpu_usage, st.kv_usage);
    pd_metric_set(m->blocks_free, st.blocks_free);
    pd_metric_set(m->blocks_cached, st.blocks_cached_free);
    pd_metric_set(m->blocks_used, st.blocks_used);
    pd_metric_set(m->prefill_cost[0], st.prefill_s_per_token);
    pd_metric_set(m->prefill_cost[1], st.prefill_s_per_position);
    /* engine counters are monotonic: add what is new since the last scrape */
    pd_metric_inc(m->prefix_queries, (double)(st.prefix_queries - m->seen_prefix_queries));
    pd_metric_inc(m->prefix_hits, (double)(st.prefix_hits - m->seen_prefix_hits));
    pd_metric_inc(m->prompt_tokens, (double)(st.prompt_tokens - m->seen_prompt));
    pd_metric_inc(m->generation_tokens, (double)(st.generation_tokens - m->seen_gen));
    pd_metric_inc(m->preemptions, (double)(st.preemptions - m->seen_preempt));
    pd_metric_inc(m->load_waits, (double)(st.load_waits - m->seen_load_waits));
    m->seen_load_waits = st.load_waits;
    pd_metric_inc(m->grammar_handed, (double)(st.grammar_states_handed - m->seen_grammar_handed));
    pd_metric_inc(m->grammar_resumed, (double)(st.grammar_states_resumed - m->seen_grammar_resumed));
    m->seen_grammar_handed = st.grammar_states_handed;
    m->seen_grammar_resumed = st.grammar_states_resumed;
    pd_metric_inc(m->grammar_ahead, (double)(st.grammars_walked_ahead - m->seen_grammar_ahead));
    pd_metric_inc(m->grammar_ahead_s, st.grammar_walk_ahead_seconds - m->seen_grammar_ahead_s);
    m->seen_grammar_ahead = st.grammars_walked_ahead;
    m->seen_grammar_ahead_s = st.grammar_walk_ahead_seconds;
    m->seen_prefix_queries = st.prefix_queries;
    m->seen_prefix_hits = st.prefix_hits;
    m->seen_prompt = st.prompt_tokens;
    m->seen_gen = st.generation_tokens;
    m->seen_preempt = st.preemptions;
    if (m->offload[0] != NULL) {
        double now[7] = {(double)st.offload_queries,       (double)st.offload_hits,
                         (double)st.offload_saved,         (double)st.offload_corrupt,
                         (double)st.offload_bytes_written, (double)st.offload_bytes_read,
                         st.offload_read_seconds};
        for (int i = 0; i < 7; i++) {
            pd_metric_inc(m->offload[i], now[i] - m->seen_offload[i]);
            m->seen_offload[i] = now[i];
        }
        pd_metric_set(m->offload[7], st.offload_used);
        pd_metric_set(m->offload[8], st.offload_slots);
    }
}

void pd_http_metrics_admitted(pd_http_server_t *s, int32_t n, int32_t max_tokens)
{
    pd_metric_observe(s->m.req_n, n);
    pd_metric_observe(s->m.req_max_tokens, max_tokens);
    pd_metric_observe(s->m.req_max_gen, (double)max_tokens * n);
}

void pd_http_metrics_token(pd_http_server_t *s, double since_arrival, double since_last, bool first)
{
    if (first) {
        pd_metric_observe(s->m.ttft, since_arrival);
    } else {
        pd_metric_observe(s->m.itl, since_last);
        pd_metric_observe(s->m.tpot, since_last);
    }
}

void pd_http_metrics_finished(pd_http_server_t *s, const pd_engine_output_t *o)
{
    static const char *reasons[4] = {"stop", "length", "abort", "error"};
    srv_metrics_t *m = &s->m;
    for (int i = 0; i < 4; i++) {
        if (strcmp(o->finish_reason, reasons[i]) == 0) {
            pd_metric_inc(m->success[i], 1);
        }
    }
    pd_metric_observe(m->e2e, o->e2e);
    pd_metric_observe(m->queue, o->queue_time);
    pd_metric_observe(m->req_prompt, o->prompt_tokens);
    pd_metric_observe(m->req_gen, o->completion_tokens);
    if (o->ttft > 0) { /* phases as vLLM's: scheduled → first token → last token */
        pd_metric_observe(m->inference, o->e2e - o->queue_time);
        pd_metric_observe(m->prefill, o->ttft - o->queue_time);
        pd_metric_observe(m->decode, o->e2e - o->ttft);
    }
}
