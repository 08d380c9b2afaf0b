/* connector/kv_connector.c — the P/D connector's facade: configuration and flags, helpers the
 * halves share, the ops table and the lifecycle (create, start, stop, destroy). The scheduler half
 * is kv_scheduler.c, the worker half kv_worker.c, host staging kv_staging.c; the control thread is
 * kv_ctl.c and its parts. */
#define _GNU_SOURCE
#include "connector/kv_connector.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/array.h"
#include "common/log.h"
#include "common/time.h"
#include "connector/kv_ctl.h"
#include "connector/kv_engine.h"
#include "scheduler/scheduler.h"

/* ------------------------------------------------------------------ configuration */

void pd_kv_connector_config_defaults(pd_kv_connector_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->role = "decode";
    c->mode = "pull";
    c->pipe = "ucx";
    c->listen = "127.0.0.1:0";
    c->ucx_err_mode = "none";
    c->hold_timeout = 120;
    c->load_timeout = 60;
    c->handshake_timeout = 5;
    c->heartbeat_interval = 1;
    c->heartbeat_misses = 5;
    c->save_timeout = 30;
    c->load_failure_policy = "recompute";
    c->prefault = true;
    c->staging = "auto";
    c->prefix_fetch = "auto";
}

size_t pd_kv_connector_flags(pd_kv_connector_config_t *c, pd_flag_t *out, size_t max)
{
    const pd_flag_t f[] = {
        {"KV connector (prefill/decode transfers)", PD_FLAG_GROUP, NULL, NULL, NULL},
        {"kv-transfer-mode", PD_FLAG_CHOICE, &c->mode,
         "pull: decode reads the prefill's held blocks; push: prefill writes each layer into the decode's "
         "reserved blocks",
         "pull|push"},
        {"kv-pipe", PD_FLAG_CHOICE, &c->pipe,
         "transport for KV pages (nccl: a GPU build with --device cuda; moves device KV in place)",
         "ucx|tcp|nccl"},
        {"kv-listen", PD_FLAG_STR, &c->listen, "HOST:PORT of the KV control listener (port 0 = any free)",
         NULL},
        {"kv-advertise-host", PD_FLAG_STR, &c->advertise_host,
         "host peers dial for this node's KV (default: the --kv-listen host)", NULL},
        {"kv-transfer-config", PD_FLAG_STR, &c->transfer_config,
         "vLLM's JSON: {\"kv_connector\": \"PdConnector\"|\"NixlConnector\"|\"P2pNcclConnector\", "
         "\"kv_role\": "
         "\"kv_producer\"|\"kv_consumer\", \"kv_ip\", \"kv_port\", \"kv_connector_extra_config\": "
         "{transfer_mode, "
         "pipe, hold_timeout, ...}}; its values win over the --kv-* flags",
         NULL},
        {"kv-advertise-port", PD_FLAG_INT, &c->advertise_port,
         "port peers dial for this node's KV control (0 = the --kv-listen port; set it when a NAT, a Service "
         "or a relay forwards another port to the listener)",
         NULL},
        {"kv-data-port", PD_FLAG_INT, &c->data_port,
         "tcp pipe: port of the data listener page requests arrive on (0 = any free; fix it to name it in a "
         "firewall rule or NetworkPolicy)",
         NULL},
        {"kv-ucx-err-mode", PD_FLAG_CHOICE, &c->ucx_err_mode,
         "ucx: none = shared-memory RMA, dead peers found by heartbeat; peer = UCX error handling (TCP RMA, "
         "slower)",
         "none|peer"},
        {"kv-tcp-busy-poll-us", PD_FLAG_INT, &c->tcp_busy_poll_us,
         "tcp pipe: after serving a peer's request, its receiver thread polls this many µs before sleeping "
         "(spends a core while requests keep coming; saves a thread wake-up per page request)",
         NULL},
        {"cluster-token-file", PD_FLAG_STR, &c->cluster_token_file,
         "file holding the secret every node of the cluster shares (proved, never sent; required unless "
         "--insecure-no-kv-auth)",
         NULL},
        {"insecure-no-kv-auth", PD_FLAG_BOOL, &c->insecure_no_kv_auth,
         "run without --cluster-token-file: the KV ports accept any peer that reaches them, which may then "
         "read every KV page this node exports and write pages or answers into it (a test or a sealed host "
         "only)",
         NULL},
        {"kv-hold-timeout", PD_FLAG_DOUBLE, &c->hold_timeout,
         "seconds a prefill holds a finished request's blocks for its reader (pull) or its reservation "
         "(push)",
         NULL},
        {"kv-load-timeout", PD_FLAG_DOUBLE, &c->load_timeout,
         "seconds a decode request waits in WAITING_FOR_REMOTE_KV before the failure policy applies", NULL},
        {"kv-handshake-timeout", PD_FLAG_DOUBLE, &c->handshake_timeout,
         "seconds to dial a peer, authenticate and exchange regions", NULL},
        {"kv-heartbeat-interval", PD_FLAG_DOUBLE, &c->heartbeat_interval, "seconds between heartbeats", NULL},
        {"kv-heartbeat-misses", PD_FLAG_INT, &c->heartbeat_misses,
         "silent heartbeat intervals before a peer is declared dead", NULL},
        {"kv-save-timeout", PD_FLAG_DOUBLE, &c->save_timeout,
         "seconds a prefill step waits for its layer writes (push)", NULL},
        {"kv-prefault", PD_FLAG_BOOL, &c->prefault,
         "touch every page of the KV region in a background thread at start (first-touch faults stay out of "
         "transfers)",
         NULL},
        {"kv-staging", PD_FLAG_CHOICE, &c->staging,
         "auto: copy KV through a host mirror only when the pipe cannot register the KV's memory (device KV "
         "over ucx/tcp); always: also for host KV (tests the GPU path's copies on a CPU)",
         "auto|always"},
        {"kv-prefix-fetch", PD_FLAG_CHOICE, &c->prefix_fetch,
         "a node asked to load a prompt's prefix from the peer that holds it (a prefill, or a decode "
         "resuming a stream after its first decode died; kv_transfer_params.kv_prefix, "
         "set by pd-proxy): auto = when the measured transfer beats computing it at the measured prefill "
         "rate (each choice logged at debug); always; never (computes it)",
         "auto|always|never"},
    };
    size_t n = sizeof(f) / sizeof(f[0]);
    memcpy(out, f, (n < max ? n : max) * sizeof(f[0]));
    return n; /* all of them: more than max tells the caller its array is short */
}

/* ------------------------------------------------------------------ helpers */

/* staging (host mirror of a device KV), defined below */

bool kv_jbool(const json_t *o, const char *key)
{
    return json_is_true(json_object_get(o, key));
}

const char *kv_jstr(const json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));
}

void kv_count_policy_action(kv_conn_t *k)
{
    pd_metric_inc(strcmp(k->cfg.load_failure_policy, "fail") == 0 ? k->m.policy_fail : k->m.policy_recompute,
                  1);
}

uint64_t kv_random_u52(void)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v)) {
        v = pd_time_now_ns() * 0x9E3779B97F4A7C15ull;
    }
    return (v & ((1ull << 52) - 1)) | 1; /* JSON-safe integer, never 0 */
}

/* The transfer mode of a request: its kv_transfer_params say, else the node's. */
bool kv_wants_push(const kv_conn_t *k, const json_t *p)
{
    const char *m = kv_jstr(p, "transfer_mode");
    return m != NULL ? strcmp(m, "push") == 0 : k->push;
}

/* ------------------------------------------------------------------ scheduler half */

kv_push_t *kv_push_find(kv_conn_t *k, const char *req_id, bool unlink)
{
    kv_push_t *p;
    pd_list_for_each (p, &k->e->pushes, link) {
        if (strcmp(p->req_id, req_id) == 0) {
            if (unlink) {
                pd_list_del(&p->link);
            }
            return p;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ staging (host mirror) */

/* ------------------------------------------------------------------ worker half */

static void kv_destroy_op(pd_connector_t *c)
{
    pd_kv_connector_destroy(c);
}

static const pd_connector_ops_t KV_OPS = {
    "pd-kv",
    kv_params_error,
    kv_get_num_new_matched_tokens,
    kv_update_state_after_alloc,
    kv_load_may_wait,
    kv_build_connector_meta,
    kv_request_finished,
    kv_register_kv_caches,
    kv_bind_connector_metadata,
    kv_start_load_kv,
    kv_wait_for_layer_load,
    kv_save_kv_layer,
    kv_wait_for_save,
    kv_get_finished,
    kv_get_block_ids_with_load_errors,
    kv_destroy_op,
};

/* ------------------------------------------------------------------ lifecycle */

static void *prefault_main(void *arg)
{
    kv_conn_t *k = arg;
    char *p = k->region->base;
    size_t len = k->region->len;
    double t0 = pd_time_now_s();
    for (size_t off = 0; off < len && !__atomic_load_n(&k->prefault_stop, __ATOMIC_RELAXED); off += 4096) {
        /* an atomic add of 0 is a write access (the page is faulted in writable) that cannot lose a
         * value the engine stores into the same byte meanwhile (a locked RMW is indivisible) */
        __atomic_fetch_add(p + off, 0, __ATOMIC_RELAXED);
    }
    pd_log_info("kv connector: pre-faulted the %.2f GiB KV region in %.1f s (background)",
                (double)len / (1u << 30), pd_time_now_s() - t0);
    return NULL;
}

/* Starts the pre-fault thread over k->region (when --kv-prefault). */
void kv_start_prefault(kv_conn_t *k)
{
#if defined(__SANITIZE_THREAD__)
    k->cfg.prefault = false; /* its atomic touches of pages the engine writes plainly would be reported */
#endif
    if (k->cfg.prefault && !k->prefault_started) {
        /* touch every page in the background: a first-touch fault per 4 KiB page inside a transfer
         * costs more than the copy (measured here: ~18 µs per fault; 4 MiB of fresh blocks read in
         * ~8 ms instead of ~3 ms) */
        k->prefault_started = pthread_create(&k->prefault_thread, NULL, prefault_main, k) == 0;
    }
}

static pd_status_t region_alloc(void *ctx, size_t bytes, void **ptr_out)
{
    kv_conn_t *k = ctx;
    if (k->region != NULL) {
        return PD_ERR_INVALID_ARG; /* one KV region per engine */
    }
    pd_status_t st = k->pipe->ops->alloc_region(k->pipe, bytes, &k->region);
    if (st != PD_OK) {
        pd_log_error("kv connector: the %s pipe cannot allocate %.2f GiB for the KV cache", k->cfg.pipe,
                     (double)bytes / (1u << 30));
        return st;
    }
    *ptr_out = k->region->base;
    kv_start_prefault(k);
    return PD_OK;
}

static void region_free(void *ctx, void *ptr)
{
    kv_conn_t *k = ctx;
    if (k->pipe != NULL && k->region != NULL && k->region->base == ptr) {
        k->pipe->ops->deregister_region(k->pipe, k->region);
        k->region = NULL;
    }
}

/* The series vLLM's NixlConnector exports, with its buckets, so that a vLLM P/D dashboard reads a
 * pdserve pool: on the decode, per completed load, the time pages moved (pull: posted to landed;
 * push: reservation sent to WRITE_DONE), the time to post (scheduled to posted, a handshake
 * included), the bytes and the pages ("descriptors"); failed loads; on the prefill, holds that
 * expired unread. The model_name/engine labels are the registry's constant ones. */
static void metrics_register_vllm(kv_conn_t *k, pd_metrics_t *m)
{
    static const double tb[13] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0};
    double bb[12];
    for (int i = 0; i < 12; i++) {
        bb[i] = (double)(1ull << (11 + 2 * i)); /* 2 KiB .. 8 GiB, as vLLM's */
    }
    static const double db[14] = {10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000};
    k->m.nixl_xfer_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "vllm:nixl_xfer_time_seconds",
                                      "Histogram of transfer duration for KV Cache transfers (NIXL's name).",
                                      NULL, tb + 1, 12);
    k->m.nixl_post_s =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "vllm:nixl_post_time_seconds",
                       "Histogram of transfer post time for KV Cache transfers (NIXL's name).", NULL, tb, 13);
    k->m.nixl_bytes =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "vllm:nixl_bytes_transferred",
                       "Histogram of bytes transferred per KV Cache transfers (NIXL's name).", NULL, bb, 12);
    k->m.nixl_descs =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "vllm:nixl_num_descriptors",
                       "Histogram of number of descriptors (pages) per KV Cache transfers (NIXL's "
                       "name).",
                       NULL, db, 14);
    k->m.nixl_failed = pd_metrics_add(m, PD_METRIC_COUNTER, "vllm:nixl_num_failed_transfers_total",
                                      "Number of failed KV Cache transfers (NIXL's name).", NULL, NULL, 0);
    k->m.nixl_expired = pd_metrics_add(
        m, PD_METRIC_COUNTER, "vllm:nixl_num_kv_expired_reqs_total",
        "Number of requests that had their KV expire (prefill side; NIXL's name).", NULL, NULL, 0);
}

static void metrics_register(kv_conn_t *k, pd_metrics_t *m)
{
    if (m == NULL) {
        return;
    }
    static const char *const kinds[3] = {"kind=pull_load", "kind=push_load", "kind=push_save"};
    static const double pages_b[] = {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536};
    for (int i = 0; i < 3; i++) {
        k->m.started[i] = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_started_total",
                                         "KV transfers started, by kind.", kinds[i], NULL, 0);
        k->m.completed[i] =
            pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_completed_total",
                           "KV transfers completed successfully, by kind.", kinds[i], NULL, 0);
        k->m.failed[i] = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfers_failed_total",
                                        "KV transfers that failed (peer gone, timeout, stale, rejected).",
                                        kinds[i], NULL, 0);
    }
    k->m.bytes = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_transfer_bytes_total",
                                "Bytes of KV pages moved by this node's transfers.", NULL, NULL, 0);
    k->m.latency = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_seconds",
                                  "Latency of one KV transfer (start to completion).", NULL,
                                  PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.pages = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_pages", "Pages per KV transfer.",
                                NULL, pages_b, 9);
    k->m.leases_held = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_leases_granted_total",
                                      "Leases granted on held prefill blocks (pull).", NULL, NULL, 0);
    k->m.leases_now = pd_metrics_add(
        m, PD_METRIC_GAUGE, "pd:kv_leases_held",
        "Requests whose blocks a prefill holds under a lease for a reader (pull).", NULL, NULL, 0);
    k->m.resvs_now = pd_metrics_add(
        m, PD_METRIC_GAUGE, "pd:kv_reservations",
        "Decode reservations a push prefill has received and not yet finished with.", NULL, NULL, 0);
    k->m.leases_expired =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_leases_expired_total",
                       "Holds that ended at --kv-hold-timeout with no reader or reservation.", NULL, NULL, 0);
    k->m.stale =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_stale_reads_total",
                       "READ_DONEs answered STALE or UNKNOWN (the KV was discarded).", NULL, NULL, 0);
    k->m.handshakes_ok = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_handshakes_total",
                                        "Control-plane handshakes, by result.", "result=ok", NULL, 0);
    k->m.handshakes_failed = pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_handshakes_total",
                                            "Control-plane handshakes, by result.", "result=failed", NULL, 0);
    k->m.imported = pd_metrics_add(m, PD_METRIC_GAUGE, "pd:kv_imported_regions",
                                   "Peers' KV regions this node holds imported (UCX maps a peer's region on "
                                   "one host); a dead peer's goes once no transfer addresses it.",
                                   NULL, NULL, 0);
    k->m.params_refused = pd_metrics_add(
        m, PD_METRIC_COUNTER, "pd:kv_params_refused_total",
        "Decode requests whose kv_transfer_params could not be used (incomplete, or pull parameters not "
        "issued for their prompt by a prefill of the cluster: another prompt, altered, unsigned); their "
        "prompts were computed locally.",
        NULL, NULL, 0);
    k->m.prefix_fetches = pd_metrics_add(
        m, PD_METRIC_COUNTER, "pd:kv_prefix_fetches_total",
        "Requests that read a prompt prefix a peer lent (kv_transfer_params.kv_prefix: a prefill's, or a "
        "decode's resumed after its first decode died) instead of computing it; the rest computed it "
        "(--kv-prefix-fetch, logged at debug).",
        NULL, NULL, 0);
    k->m.migrations_lent = pd_metrics_add(
        m, PD_METRIC_COUNTER, "pd:kv_migrations_lent_total",
        "Running requests this decode ended for another to take over (POST /admin/migrate, a drain) with "
        "their KV leased to it, so it reads the KV instead of recomputing it.",
        NULL, NULL, 0);
    k->m.migrations_loaded = pd_metrics_add(
        m, PD_METRIC_COUNTER, "pd:kv_migrations_loaded_total",
        "Requests taken over from another decode (resume_token_ids with its lease) whose KV of prompt and "
        "generated tokens this node started to read from it.",
        NULL, NULL, 0);
    k->m.migration_load_s = pd_metrics_add(
        m, PD_METRIC_HISTOGRAM, "pd:kv_migration_load_seconds",
        "A live migration's KV load on the node that took the request over, queued to done (what the "
        "migration pause cannot go below).",
        NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.policy_recompute =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_load_failure_policy_actions_total",
                       "KV load failures handed to the failure policy.", "policy=recompute", NULL, 0);
    k->m.policy_fail =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_load_failure_policy_actions_total",
                       "KV load failures handed to the failure policy.", "policy=fail", NULL, 0);
    k->m.peers = pd_metrics_add(m, PD_METRIC_GAUGE, "pd:kv_peers", "Connected KV peers.", NULL, NULL, 0);
    static const char *help =
        "Phases of a completed decode-side transfer: queue (scheduled to posted, incl. a "
        "handshake), transfer (pages moving), notify (pages landed to ACK), remote (push: "
        "reservation sent to WRITE_DONE).";
    k->m.phase_queue = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                      "phase=queue", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_transfer = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                         "phase=transfer", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_notify = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                       "phase=notify", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.phase_remote = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_transfer_phase_seconds", help,
                                       "phase=remote", PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    k->m.handshake_s = pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_handshake_seconds",
                                      "Dial + authenticate + region exchange start, per outbound handshake.",
                                      NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    const char *sh = "Bytes copied between the KV cache and its host staging mirror (--kv-staging).";
    k->m.staged_d2h =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_staging_bytes_total", sh, "dir=d2h", NULL, 0);
    k->m.staged_h2d =
        pd_metrics_add(m, PD_METRIC_COUNTER, "pd:kv_staging_bytes_total", sh, "dir=h2d", NULL, 0);
    k->m.staged_seconds =
        pd_metrics_add(m, PD_METRIC_HISTOGRAM, "pd:kv_staging_copy_seconds",
                       "One staging copy (a layer's new pages on a prefill, a load's pages on a decode).",
                       NULL, PD_LATENCY_BUCKETS, PD_LATENCY_NUM_BUCKETS);
    metrics_register_vllm(k, m);
}

static pd_status_t read_token(kv_conn_t *k, const char *path)
{
    if (path == NULL || path[0] == '\0') {
        return PD_OK;
    }
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        pd_log_error("kv connector: cannot read the cluster token file %s: %s", path, strerror(errno));
        return PD_ERR_IO;
    }
    size_t n = fread(k->token, 1, sizeof(k->token), f);
    bool more = fgetc(f) != EOF;
    fclose(f);
    if (more) {
        pd_log_error("kv connector: the cluster token in %s is longer than %zu bytes", path,
                     sizeof(k->token));
        return PD_ERR_INVALID_ARG;
    }
    while (n > 0 && (k->token[n - 1] == '\n' || k->token[n - 1] == '\r')) {
        n--; /* a trailing newline is not part of the secret */
    }
    k->token_len = n;
    return PD_OK;
}

/* The engine's wake-up, called by the mailbox after an event is queued. */
static void wake_engine(void *arg)
{
    kv_conn_t *k = arg;
    if (k->pub.wake != NULL) {
        k->pub.wake(k->pub.wake_arg);
    }
}

pd_status_t pd_kv_connector_create(const pd_kv_connector_config_t *cfg, pd_metrics_t *m, pd_connector_t **out)
{
    bool prefill = strcmp(cfg->role, "prefill") == 0;
    if (!prefill && strcmp(cfg->role, "decode") != 0) {
        pd_log_error("kv connector: role '%s' is neither prefill nor decode", cfg->role);
        return PD_ERR_INVALID_ARG;
    }
    if (strcmp(cfg->mode, "pull") != 0 && strcmp(cfg->mode, "push") != 0) {
        pd_log_error("kv connector: --kv-transfer-mode '%s' is neither pull nor push", cfg->mode);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->hold_timeout <= 0 || cfg->load_timeout <= 0 || cfg->handshake_timeout <= 0 ||
        cfg->heartbeat_interval <= 0 || cfg->heartbeat_misses < 1 || cfg->save_timeout <= 0) {
        pd_log_error("kv connector: every --kv-*-timeout and the heartbeat settings must be positive");
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->tcp_busy_poll_us < 0 || cfg->tcp_busy_poll_us > 1000000) {
        pd_log_error("kv connector: --kv-tcp-busy-poll-us %d is outside [0, 1000000]", cfg->tcp_busy_poll_us);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->advertise_port < 0 || cfg->advertise_port > 65535) {
        pd_log_error("kv connector: --kv-advertise-port %d is outside [0, 65535]", cfg->advertise_port);
        return PD_ERR_INVALID_ARG;
    }
    if (cfg->data_port < 0 || cfg->data_port > 65535 ||
        (cfg->data_port != 0 && strcmp(cfg->pipe, "tcp") != 0)) {
        pd_log_error("kv connector: --kv-data-port %d: a port in [0, 65535], for the tcp pipe only",
                     cfg->data_port);
        return PD_ERR_INVALID_ARG;
    }
    if (strcmp(cfg->pipe, "nccl") == 0 && strcmp(cfg->staging, "always") == 0) {
        pd_log_error("kv connector: --kv-pipe nccl moves device memory itself; --kv-staging always is for "
                     "host pipes (ucx, tcp)");
        return PD_ERR_INVALID_ARG;
    }
    const char *pf = cfg->prefix_fetch != NULL ? cfg->prefix_fetch : "auto";
    if (strcmp(pf, "auto") != 0 && strcmp(pf, "always") != 0 && strcmp(pf, "never") != 0) {
        pd_log_error("kv connector: --kv-prefix-fetch '%s' is none of auto, always, never", pf);
        return PD_ERR_INVALID_ARG;
    }
    kv_conn_t *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    kv_mb_init(&k->mb); /* destroy is safe after any prefix from here */
    k->mb.wake = wake_engine;
    k->mb.wake_arg = k;
    if ((k->e = calloc(1, sizeof(*k->e))) != NULL) {
        kv_eng_init(k->e);
    }
    if ((k->c = calloc(1, sizeof(*k->c))) != NULL) {
        kv_ctl_init(k->c);
    }
    if (k->e == NULL || k->c == NULL) {
        pd_kv_connector_destroy(&k->pub);
        return PD_ERR_NO_MEMORY;
    }
    k->pub.ops = &KV_OPS;
    k->pub.impl = k;
    k->cfg = *cfg;
    k->is_prefill = prefill;
    k->push = strcmp(cfg->mode, "push") == 0;
    k->prefix_fetch = strcmp(pf, "always") == 0  ? KV_PREFIX_FETCH_ALWAYS
                      : strcmp(pf, "never") == 0 ? KV_PREFIX_FETCH_NEVER
                                                 : KV_PREFIX_FETCH_AUTO;
    char port[16] = "";
    if (sscanf(cfg->listen, "%63[^:]:%15s", k->listen_host, port) != 2 || atoi(port) < 0 ||
        atoi(port) > 65535) {
        pd_log_error("kv connector: --kv-listen '%s' is not HOST:PORT", cfg->listen);
        pd_kv_connector_destroy(&k->pub);
        return PD_ERR_INVALID_ARG;
    }
    k->listen_port = atoi(port);
    snprintf(k->advertise_host, sizeof(k->advertise_host), "%s",
             cfg->advertise_host != NULL && cfg->advertise_host[0] ? cfg->advertise_host : k->listen_host);
    uint64_t id = kv_random_u52();
    snprintf(k->engine_id, sizeof(k->engine_id), "%s-%013llx", prefill ? "prefill" : "decode",
             (unsigned long long)id);
    pd_status_t st = read_token(k, cfg->cluster_token_file);
    if (st != PD_OK) {
        pd_kv_connector_destroy(&k->pub);
        return st;
    }
    if (k->token_len == 0 && !cfg->insecure_no_kv_auth) {
        pd_log_error("kv connector: no cluster token: give every node the same --cluster-token-file (e.g. "
                     "`head -c 32 /dev/urandom | base64 > token`), or --insecure-no-kv-auth to accept any "
                     "peer that reaches the KV ports");
        pd_kv_connector_destroy(&k->pub);
        return PD_ERR_INVALID_ARG;
    }
    pd_pipe_config_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.kind = cfg->pipe;
    pc.host = k->listen_host;
    pc.port = cfg->data_port;
    pc.ucx_err_mode = cfg->ucx_err_mode;
    pc.tcp_busy_poll_us = cfg->tcp_busy_poll_us;
    st = pd_pipe_create(&pc, &k->pipe);
    if (st != PD_OK) {
        pd_log_error("kv connector: cannot create a %s pipe (this build has: %s)", cfg->pipe,
                     pd_pipe_kinds());
        pd_kv_connector_destroy(&k->pub);
        return st;
    }
    k->pipe_kind = strcmp(cfg->pipe, "tcp") == 0   ? PD__PIPE_KIND__PIPE_TCP
                   : strcmp(cfg->pipe, "ucx") == 0 ? PD__PIPE_KIND__PIPE_UCX
                                                   : PD__PIPE_KIND__PIPE_NCCL;
    k->alloc = (pd_kv_region_allocator_t){k, region_alloc, region_free};
    metrics_register(k, m);
    pd_log_info("kv connector: %s engine %s, %s mode over the %s pipe", cfg->role, k->engine_id, cfg->mode,
                cfg->pipe);
    *out = &k->pub;
    return PD_OK;
}

const pd_kv_region_allocator_t *pd_kv_connector_allocator(pd_connector_t *c)
{
    kv_conn_t *k = (kv_conn_t *)c;
    /* nccl: the pipe's regions are device memory, never a host engine's KV */
    return strcmp(k->cfg.staging, "always") == 0 || k->pipe_kind == PD__PIPE_KIND__PIPE_NCCL ? NULL
                                                                                             : &k->alloc;
}

pd_status_t pd_kv_connector_start(pd_connector_t *c, const Pd__Fingerprint *fp)
{
    kv_conn_t *k = (kv_conn_t *)c;
    k->fp = *fp;
    snprintf(k->fp_model, sizeof(k->fp_model), "%s", fp->model);
    snprintf(k->fp_dtype, sizeof(k->fp_dtype), "%s", fp->kv_dtype);
    /* the KV cache groups are part of the layout: two engines must interleave block lists alike */
    snprintf(k->fp_layout, sizeof(k->fp_layout), "%s;%s", fp->layout, k->group_layout);
    k->fp.model = k->fp_model;
    k->fp.kv_dtype = k->fp_dtype;
    k->fp.layout = k->fp_layout;
    if (k->region == NULL) {
        pd_log_error("kv connector: start before the engine registered its KV caches");
        return PD_ERR_INVALID_ARG;
    }
    if (k->token_len == 0) {
        pd_log_warn("kv connector: --insecure-no-kv-auth: the KV control port (%s) and the pipe's data "
                    "port accept any peer that can reach them; give every node the same --cluster-token-file",
                    k->cfg.listen);
    }
    return kv_ctl_start(k);
}

bool pd_kv_connector_release(pd_connector_t *c, const char *request_id, uint64_t lease_id,
                             const char *transfer_id)
{
    kv_conn_t *k = (kv_conn_t *)c;
    /* ids are kept whole or not at all: a longer one names nothing held here */
    bool by_lease = request_id != NULL && strlen(request_id) < PD_REQ_ID_MAX;
    bool by_transfer = transfer_id != NULL && transfer_id[0] && strlen(transfer_id) < PD_REQ_ID_MAX;
    if (!by_lease && !by_transfer) {
        return false;
    }
    kv_release_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        pd_log_error("kv connector: out of memory releasing %s; its blocks are held until --kv-hold-timeout",
                     by_lease ? request_id : transfer_id);
        return false;
    }
    r->msg.kind = KV_CMD_RELEASE;
    r->by_lease = by_lease;
    snprintf(r->request_id, sizeof(r->request_id), "%s", by_lease ? request_id : "");
    r->lease_id = lease_id;
    snprintf(r->transfer_id, sizeof(r->transfer_id), "%s", by_transfer ? transfer_id : "");
    /* the control thread owns the leases: ask it (bounded; a stopped one answers at once) */
    if (!kv_mb_send(&k->mb, &r->msg, 5.0)) {
        pd_log_warn("kv connector: the control thread did not answer the release of %s within 5 s",
                    by_lease ? request_id : transfer_id);
        return false; /* it frees r when it gets to it */
    }
    bool done = r->released;
    free(r);
    return done;
}

int pd_kv_connector_port(const pd_connector_t *c)
{
    return ((const kv_conn_t *)c)->listen_port;
}

const char *pd_kv_connector_engine_id(const pd_connector_t *c)
{
    return ((const kv_conn_t *)c)->engine_id;
}

json_t *pd_kv_connector_info(const pd_connector_t *c)
{
    const kv_conn_t *k = (const kv_conn_t *)c;
    return json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:b}", "role", k->cfg.role, "engine_id", k->engine_id,
                     "kv_host", k->advertise_host, "kv_port", k->advertise_port, "transfer_mode", k->cfg.mode,
                     "pipe", k->cfg.pipe, "kv_staged", k->staged);
}

int pd_kv_connector_drain_pending(void *c)
{
    kv_conn_t *k = c;
    kv_drain_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return 0; /* nothing to wait with: the drain ends */
    }
    d->msg.kind = KV_CMD_DRAIN;
    d->decode = !k->is_prefill;
    if (!kv_mb_send(&k->mb, &d->msg, 1.0)) {
        return 1; /* the control thread is busy: ask again at the next tick (it frees d) */
    }
    int pending = d->pending;
    free(d);
    return pending;
}

void pd_kv_connector_stop(pd_connector_t *c)
{
    if (c == NULL) {
        return;
    }
    kv_conn_t *k = (kv_conn_t *)c;
    if (k->prefault_started) {
        __atomic_store_n(&k->prefault_stop, true, __ATOMIC_RELAXED);
        pthread_join(k->prefault_thread, NULL);
        k->prefault_started = false;
    }
    if (k->pinned) {
        k->copy.unpin_host(k->copy.ctx, k->region->base); /* before the pipe frees the mirror */
        k->pinned = false;
    }
    if (k->c != NULL) { /* NULL: create failed before it (nor is there a pipe) */
        kv_ctl_stop(k);
    }
}

void pd_kv_connector_destroy(pd_connector_t *c)
{
    if (c == NULL) {
        return;
    }
    kv_conn_t *k = (kv_conn_t *)c;
    pd_kv_connector_stop(c); /* destroys the pipe: every pending operation completes first */
    if (k->e != NULL) {
        kv_eng_free(k->e);
        free(k->e);
    }
    free(k->c);
    kv_mb_destroy(&k->mb);
    free(k);
}
