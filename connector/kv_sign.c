/* connector/kv_sign.c — kv_transfer_params that a client cannot forge: what binds a pull load to
 * the prompt it was computed for and to the prefill that holds it.
 *
 * A pull prefill puts the SHA-256 of its prompt's token ids into the params it returns
 * (`prompt_sha256`) and, with a cluster token, an HMAC-SHA256 under the token (`pd_sig`) over every
 * field the decode acts on: the engine id, the address it dials, the request and lease it names,
 * the lease's expiry, the prompt length and hash, the first token of a handover and the grammar's
 * state after it (structured outputs), and each block id.
 * A decode admits a do_remote_prefill pull request only when the hash equals its own prompt's and,
 * with a token, the MAC verifies: a caller who relays another prompt's params, edits a block id or
 * points the decode at another address gets a 400 (test_connector `test_pull_params_bound`).
 * Push loads are bound the same way on the authenticated control channel instead: the prefill's
 * WRITE_DONE carries its prompt's hash and the decode discards KV for another prompt.
 *
 * Without a token (--insecure-no-kv-auth) only the hash is checked: that catches a mix-up, not an
 * attacker, who can compute it. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/sha256.h"
#include "connector/kv_conn.h"

void kv_prompt_hash(const int32_t *tokens, int32_t n, uint8_t out[32])
{
    pd_sha256_t s;
    pd_sha256_init(&s);
    for (int32_t i = 0; i < n; i++) { /* little-endian whatever the host */
        uint32_t v = (uint32_t)tokens[i];
        uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
        pd_sha256_update(&s, b, 4);
    }
    pd_sha256_final(&s, out);
}

static void to_hex(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = '\0';
}

/* A string field as "length:bytes|" (so no choice of strings makes two field lists read alike). */
static void put_str(FILE *f, const char *s)
{
    s = s != NULL ? s : "";
    fprintf(f, "%zu:%s|", strlen(s), s);
}

static void put_int(FILE *f, const json_t *v)
{
    if (json_is_integer(v)) {
        fprintf(f, "%lld|", (long long)json_integer_value(v));
    } else {
        fputs(json_is_null(v) || v == NULL ? "-|" : "?|", f);
    }
}

/* HMAC(token, the signed fields of p) as hex into sig (65 bytes); false when p's block list is not
 * an array of integers or out of memory. */
static bool params_mac(const kv_conn_t *k, const json_t *p, char sig[65])
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) {
        return false;
    }
    fputs("pd-kv-params/1|", f);
    put_str(f, kv_jstr(p, "remote_engine_id"));
    put_str(f, kv_jstr(p, "remote_host"));
    put_int(f, json_object_get(p, "remote_port"));
    put_str(f, kv_jstr(p, "remote_request_id"));
    put_int(f, json_object_get(p, "lease_id"));
    put_int(f, json_object_get(p, "lease_expires_unix_ms"));
    put_int(f, json_object_get(p, "remote_num_tokens"));
    put_int(f, json_object_get(p, "first_token_id"));
    put_str(f, kv_jstr(p, "prompt_sha256"));
    put_str(f, kv_jstr(p, "grammar_state"));
    const json_t *b = json_object_get(p, "remote_block_ids");
    bool ok = json_is_array(b);
    for (size_t i = 0; ok && i < json_array_size(b); i++) {
        ok = json_is_integer(json_array_get(b, i));
        put_int(f, json_array_get(b, i));
    }
    if (fclose(f) != 0 || buf == NULL) {
        free(buf);
        return false;
    }
    uint8_t mac[32];
    pd_hmac_sha256(k->token, k->token_len, buf, len, mac);
    free(buf);
    to_hex(mac, sizeof(mac), sig);
    return ok;
}

pd_status_t kv_params_sign(const kv_conn_t *k, json_t *p, const int32_t *prompt, int32_t num_prompt)
{
    uint8_t h[32];
    char hex[65];
    kv_prompt_hash(prompt, num_prompt, h);
    to_hex(h, sizeof(h), hex);
    if (json_object_set_new(p, "prompt_sha256", json_string(hex)) != 0) {
        return PD_ERR_NO_MEMORY;
    }
    if (k->token_len == 0) {
        return PD_OK; /* nothing to sign with: the hash still catches a mix-up */
    }
    char sig[65];
    if (!params_mac(k, p, sig) || json_object_set_new(p, "pd_sig", json_string(sig)) != 0) {
        return PD_ERR_NO_MEMORY;
    }
    return PD_OK;
}

const char *kv_params_verify(const kv_conn_t *k, const json_t *p, const int32_t *prompt, int32_t num_prompt)
{
    const char *want = kv_jstr(p, "prompt_sha256");
    if (want == NULL) {
        return "kv_transfer_params carry no prompt_sha256: pull parameters come only from a prefill's "
               "answer (pd-proxy passes them on)";
    }
    uint8_t h[32];
    char hex[65];
    kv_prompt_hash(prompt, num_prompt, h);
    to_hex(h, sizeof(h), hex);
    if (strlen(want) != 64 || !pd_ct_equal((const uint8_t *)want, (const uint8_t *)hex, 64)) {
        return "kv_transfer_params were issued for another prompt (prompt_sha256 differs from this "
               "request's)";
    }
    if (k->token_len == 0) {
        return NULL;
    }
    const char *sig = kv_jstr(p, "pd_sig");
    char mine[65];
    if (sig == NULL || strlen(sig) != 64) {
        return "kv_transfer_params are not signed (pd_sig): this node takes pull parameters only as a "
               "prefill of its cluster issued them";
    }
    if (!params_mac(k, p, mine) || !pd_ct_equal((const uint8_t *)sig, (const uint8_t *)mine, 64)) {
        return "kv_transfer_params.pd_sig does not verify: the parameters were altered or not issued by "
               "a prefill of this cluster";
    }
    return NULL;
}
