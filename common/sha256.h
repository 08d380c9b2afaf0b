/* common/sha256.h — SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the control plane's
 * cluster-token challenge: peers prove they know the token without sending it. */
#ifndef PD_COMMON_SHA256_H
#define PD_COMMON_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct pd_sha256 {
    uint32_t h[8];
    uint64_t len; /* bytes hashed so far */
    uint8_t buf[64];
    size_t buf_len;
} pd_sha256_t;

void pd_sha256_init(pd_sha256_t *s);
void pd_sha256_update(pd_sha256_t *s, const void *data, size_t len);
void pd_sha256_final(pd_sha256_t *s, uint8_t out[32]);

/* One-shot SHA-256. */
void pd_sha256(const void *data, size_t len, uint8_t out[32]);

/* HMAC-SHA256(key, msg). */
void pd_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len, uint8_t out[32]);

/* Constant-time comparison of n bytes; 1 if equal. */
int pd_ct_equal(const uint8_t *a, const uint8_t *b, size_t n);

#endif
