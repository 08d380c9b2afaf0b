/* connector/kv_transfer_config.c — vLLM's --kv-transfer-config JSON mapped onto the P/D
 * connector's configuration, so that `vllm serve` scripts carry over:
 *
 *   {"kv_connector": "PdConnector" | "NixlConnector" (the ucx pipe) | "P2pNcclConnector" (nccl),
 *    "kv_role": "kv_producer" (pd-prefill) | "kv_consumer" (pd-decode),
 *    "kv_ip": "10.0.0.5", "kv_port": 14579,                   (the control listener)
 *    "kv_connector_extra_config": {"transfer_mode": "push", "pipe": "tcp", "hold_timeout": 30, ...}}
 *
 * Every key is checked: an unknown one, a role this binary does not play, kv_both (pdserve keeps
 * prefill and decode in separate processes) or a connector pdserve does not implement is refused
 * with the key named. Values given here win over the --kv-* flags. */
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "connector/kv_connector.h"

typedef struct extra_key {
    const char *key;
    char kind; /* s string, d double, i int */
    size_t offset;
} extra_key_t;

#define EXTRA(k, kind, field)                                                                                \
    {                                                                                                        \
        k, kind, offsetof(pd_kv_connector_config_t, field)                                                   \
    }
static const extra_key_t EXTRA_KEYS[] = {
    EXTRA("transfer_mode", 's', mode),
    EXTRA("pipe", 's', pipe),
    EXTRA("advertise_host", 's', advertise_host),
    EXTRA("advertise_port", 'i', advertise_port),
    EXTRA("data_port", 'i', data_port),
    EXTRA("ucx_err_mode", 's', ucx_err_mode),
    EXTRA("cluster_token_file", 's', cluster_token_file),
    EXTRA("hold_timeout", 'd', hold_timeout),
    EXTRA("load_timeout", 'd', load_timeout),
    EXTRA("handshake_timeout", 'd', handshake_timeout),
    EXTRA("heartbeat_interval", 'd', heartbeat_interval),
    EXTRA("heartbeat_misses", 'i', heartbeat_misses),
    EXTRA("staging", 's', staging),
};

static pd_status_t refuse(json_t *root, const char *fmt, const char *what)
{
    pd_log_error(fmt, what);
    json_decref(root);
    return PD_ERR_INVALID_ARG;
}

/* kv_connector_extra_config: each key sets its field (type-checked). */
static pd_status_t apply_extra(json_t *root, json_t *extra, pd_kv_connector_config_t *cfg)
{
    const char *key;
    json_t *v;
    json_object_foreach(extra, key, v)
    {
        const extra_key_t *e = NULL;
        for (size_t i = 0; i < sizeof(EXTRA_KEYS) / sizeof(EXTRA_KEYS[0]); i++) {
            e = strcmp(EXTRA_KEYS[i].key, key) == 0 ? &EXTRA_KEYS[i] : e;
        }
        if (e == NULL) {
            return refuse(root, "--kv-transfer-config: kv_connector_extra_config.%s is not a pdserve setting",
                          key);
        }
        char *dst = (char *)cfg + e->offset;
        if (e->kind == 's' && json_is_string(v)) {
            *(const char **)dst = json_string_value(v); /* lives in root, which the caller keeps */
        } else if (e->kind == 'd' && json_is_number(v)) {
            *(double *)dst = json_number_value(v);
        } else if (e->kind == 'i' && json_is_integer(v) && json_integer_value(v) >= 0 &&
                   json_integer_value(v) <= 1 << 30) {
            *(int *)dst = (int)json_integer_value(v);
        } else {
            return refuse(root, "--kv-transfer-config: kv_connector_extra_config.%s has the wrong type", key);
        }
    }
    return PD_OK;
}

/* kv_connector: PdConnector keeps the pipe, NIXL and P2P NCCL name theirs. */
static pd_status_t apply_connector(json_t *root, const char *name, pd_kv_connector_config_t *cfg)
{
    if (name == NULL) {
        return PD_OK;
    }
    if (strcmp(name, "NixlConnector") == 0) {
        cfg->pipe = "ucx"; /* NIXL moves KV over UCX */
    } else if (strcmp(name, "P2pNcclConnector") == 0) {
        cfg->pipe = "nccl";
    } else if (strcmp(name, "PdConnector") != 0) {
        return refuse(
            root,
            "--kv-transfer-config: kv_connector '%s' is not implemented (PdConnector; NixlConnector and "
            "P2pNcclConnector map to its ucx and nccl pipes)",
            name);
    }
    return PD_OK;
}

pd_status_t pd_kv_transfer_config_apply(const char *text, pd_kv_connector_config_t *cfg, json_t **keep_out)
{
    *keep_out = NULL;
    if (text == NULL || text[0] == '\0') {
        return PD_OK;
    }
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(root)) {
        pd_log_error("--kv-transfer-config is not a JSON object: %s", root == NULL ? je.text : "wrong type");
        json_decref(root);
        return PD_ERR_INVALID_ARG;
    }
    static const char *const KNOWN[] = {"kv_connector", "kv_role", "kv_ip", "kv_port",
                                        "kv_connector_extra_config"};
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        bool known = false;
        for (size_t i = 0; i < sizeof(KNOWN) / sizeof(KNOWN[0]); i++) {
            known = known || strcmp(KNOWN[i], key) == 0;
        }
        if (!known) {
            return refuse(root, "--kv-transfer-config: '%s' is not supported by pdserve", key);
        }
    }
    const char *role = json_string_value(json_object_get(root, "kv_role"));
    const char *want = strcmp(cfg->role, "prefill") == 0 ? "kv_producer" : "kv_consumer";
    if (role == NULL || strcmp(role, want) != 0) {
        pd_log_error("--kv-transfer-config: pd-%s is a %s; kv_role is %s%s", cfg->role, want,
                     role ? role : "missing",
                     role != NULL && strcmp(role, "kv_both") == 0
                         ? " (pdserve runs prefill and decode as separate processes)"
                         : "");
        json_decref(root);
        return PD_ERR_INVALID_ARG;
    }
    json_t *conn = json_object_get(root, "kv_connector");
    if (conn != NULL && !json_is_string(conn)) {
        return refuse(root, "--kv-transfer-config: %s must be a string", "kv_connector");
    }
    if (apply_connector(root, json_string_value(conn), cfg) != PD_OK) {
        return PD_ERR_INVALID_ARG; /* refused and freed there */
    }
    json_t *ip = json_object_get(root, "kv_ip"), *port = json_object_get(root, "kv_port");
    if (ip != NULL || port != NULL) {
        if ((ip != NULL && !json_is_string(ip)) || (port != NULL && !json_is_integer(port)) ||
            json_integer_value(port) < 0 || json_integer_value(port) > 65535) {
            return refuse(root, "--kv-transfer-config: %s must be a host string and a port in [0, 65535]",
                          "kv_ip/kv_port");
        }
        char host[64] = "127.0.0.1", listen[96];
        int old_port = 0;
        sscanf(cfg->listen != NULL ? cfg->listen : "", "%63[^:]:%d", host,
               &old_port); /* what is not given stays */
        snprintf(listen, sizeof(listen), "%s:%lld", ip != NULL ? json_string_value(ip) : host,
                 port != NULL ? (long long)json_integer_value(port) : (long long)old_port);
        json_object_set_new(root, "_listen", json_string(listen)); /* kept alive with root */
        cfg->listen = json_string_value(json_object_get(root, "_listen"));
    }
    json_t *extra = json_object_get(root, "kv_connector_extra_config");
    if (extra != NULL && !json_is_object(extra)) {
        return refuse(root, "--kv-transfer-config: %s must be an object", "kv_connector_extra_config");
    }
    if (extra != NULL && apply_extra(root, extra, cfg) != PD_OK) {
        return PD_ERR_INVALID_ARG;
    }
    *keep_out = root;
    return PD_OK;
}
