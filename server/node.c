/* server/node.c — the body of pd-prefill and pd-decode: engine flags + HTTP flags + KV
 * connector flags; builds the connector first (the pipe owns a host KV region, or the host mirror
 * of a device one), then the engine,
 * then starts the control plane and serves. Shutdown runs in reverse: HTTP drain, control plane
 * (pending transfers cancelled), engine, connector. */
#include "server/node.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "connector/kv_connector.h"
#include "engine/engine.h"
#include "server/http_server.h"

/* POST /pd/release → the connector (a prefill's held KV; a decode's lends). */
static bool release_kv(void *ctx, const char *request_id, uint64_t lease_id, const char *transfer_id)
{
    return pd_kv_connector_release(ctx, request_id, lease_id, transfer_id);
}

int pd_node_main(int argc, char **argv, const char *role)
{
    pd_engine_config_t cfg;
    pd_engine_config_defaults(&cfg);
    pd_http_config_t hcfg;
    pd_http_config_defaults(&hcfg);
    pd_kv_connector_config_t kcfg;
    pd_kv_connector_config_defaults(&kcfg);
    kcfg.role = role;
    pd_flag_t flags[96];
    size_t ne = pd_engine_flags(&cfg, flags, 36);
    size_t nh = ne <= 36 ? pd_http_flags(&hcfg, flags + ne, 16) : 0;
    size_t nk = ne <= 36 && nh <= 16 ? pd_kv_connector_flags(&kcfg, flags + ne + nh, 40) : 0;
    if (ne > 36 || nh > 16 || nk > 40) {
        pd_log_error("pd-%s: a flag table outgrew its room in server/node.c", role);
        return 2;
    }
    size_t n = ne + nh + nk;
    char usage[512];
    snprintf(usage, sizeof(usage),
             "usage: pd-%s --model DIR [--port P] [--kv-listen HOST:PORT] [--kv-pipe ucx|tcp] "
             "[--kv-transfer-mode pull|push] [options]\n"
             "The %s half of a disaggregated deployment: the OpenAI completions API plus the KV connector.",
             role, role);
    int first = 0;
    pd_status_t st = pd_flags_parse(flags, n, argc, argv, usage, &first);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK) {
        return 2;
    }
    if (first < argc) {
        pd_log_error("pd-%s: unexpected argument '%s'", role, argv[first]);
        return 2;
    }
    kcfg.load_failure_policy = cfg.load_failure_policy;
    json_t *ktc = NULL; /* --kv-transfer-config: kcfg's strings point into it until exit */
    if (pd_kv_transfer_config_apply(kcfg.transfer_config, &kcfg, &ktc) != PD_OK) {
        return 2;
    }
    /* --device as pd-serve: a device KV (cuda) is staged by the connector through a pinned host
     * mirror the pipe registers (ucx and tcp move host memory) */
    pd_metrics_t *metrics = NULL;
    if (pd_metrics_create(&metrics) != PD_OK) {
        json_decref(ktc);
        return 1;
    }
    pd_connector_t *conn = NULL;
    st = pd_kv_connector_create(&kcfg, metrics, &conn);
    if (st != PD_OK) {
        pd_metrics_destroy(metrics);
        json_decref(ktc);
        return 1;
    }
    cfg.connector = conn;
    cfg.kv_allocator = pd_kv_connector_allocator(conn);
    cfg.metrics = metrics;
    pd_engine_t *e = NULL;
    st = pd_engine_create(&cfg, &e);
    pd_http_server_t *srv = NULL;
    char *info = NULL;
    if (st == PD_OK) {
        const pd_model_config_t *mc = pd_engine_model_config(e);
        const char *dtype = pd_engine_kv_dtype_name(e); /* auto resolved: both pools agree for one model */
        Pd__Fingerprint fp;
        char model_id[160];
        st = pd_model_fingerprint(cfg.model_dir, model_id, sizeof(model_id));
        if (st == PD_OK) { /* the weights' dtype changes the KV both sides compute */
            size_t idlen = strlen(model_id);
            snprintf(model_id + idlen, sizeof(model_id) - idlen, "/%s", pd_engine_weight_dtype_name(e));
        }
        pd_kv_fingerprint(model_id, dtype, cfg.block_size, mc->num_kv_heads, mc->head_size, mc->num_layers,
                          &fp);
        if (st == PD_OK) {
            st = pd_kv_connector_start(conn, &fp);
        }
    }
    if (st == PD_OK) {
        json_t *j = pd_kv_connector_info(conn);
        /* a router hashes prompts into blocks of this many tokens before any event arrives */
        json_object_set_new(j, "block_size", json_integer(cfg.block_size));
        if (pd_engine_kv_events_endpoint(e)[0] != '\0') { /* --kv-events-config: where a router subscribes */
            json_object_set_new(j, "kv_events_endpoint", json_string(pd_engine_kv_events_endpoint(e)));
            json_object_set_new(j, "kv_events_replay_endpoint",
                                json_string(pd_engine_kv_events_replay_endpoint(e)));
        }
        info = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        hcfg.info_json = info;
        hcfg.release_kv = release_kv; /* a prefill's leases, and any node's prefix lends (kv_lend) */
        hcfg.release_ctx = conn;
        hcfg.drain_pending = pd_kv_connector_drain_pending; /* exits once its holds and leases are read */
        st = pd_http_server_create(&hcfg, e, metrics, &srv);
    }
    if (st == PD_OK) {
        st = pd_http_server_run(srv);
    }
    pd_http_server_destroy(srv);
    pd_kv_connector_stop(conn);
    pd_engine_destroy(e);
    pd_kv_connector_destroy(conn);
    json_decref(ktc);
    pd_metrics_destroy(metrics);
    free(info);
    pd_log_info("pd-%s exiting (%s)", role, pd_status_str(st));
    return st == PD_OK ? 0 : 1;
}
