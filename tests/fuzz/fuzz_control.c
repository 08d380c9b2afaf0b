/* tests/fuzz/fuzz_control.c — the control plane as a peer sees it: the input is the byte stream a
 * peer sends. It is decoded frame by frame (fed in slices whose size the first byte picks), every
 * message's identity and fingerprint inspected, and the same bytes drive a server and a client
 * handshake (with and without a token) over a socketpair. Nothing may crash, leak or read out of
 * bounds, whatever the frames say. */
#define _GNU_SOURCE
#include <string.h>
#include <sys/socket.h>

#include "connector/control.h"
#include "fuzz.h"

static Pd__Fingerprint fingerprint(void)
{
    Pd__Fingerprint f = PD__FINGERPRINT__INIT;
    f.model = "fuzz-model";
    f.kv_dtype = "fp32";
    f.block_size = 16;
    f.layout = "NB2BSHD;g1:full";
    f.num_kv_heads = 2;
    f.head_size = 64;
    f.num_layers = 2;
    f.protocol_version = PD_PROTOCOL_VERSION;
    return f;
}

static void decode_all(const uint8_t *data, size_t size)
{
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 1u << 16);
    size_t slice = size > 0 ? 1 + data[0] % 64 : 1;
    Pd__Fingerprint mine = fingerprint();
    for (size_t off = 0; off < size; off += slice) {
        size_t n = size - off < slice ? size - off : slice;
        if (pd_ctl_reader_feed(&r, data + off, n) != PD_OK) {
            break;
        }
        pd_ctl_msg_t m;
        pd_status_t st;
        while ((st = pd_ctl_reader_next(&r, &m)) == PD_OK) {
            const Pd__Identity *id = pd_ctl_peer_identity(&m);
            if (id != NULL && id->fingerprint != NULL) {
                char why[256];
                pd_ctl_fingerprint_equal(&mine, id->fingerprint, why, sizeof(why));
            }
            pd_ctl_msg_free(&m);
        }
        if (st != PD_ERR_NOT_FOUND) {
            break;
        }
    }
    pd_ctl_reader_destroy(&r);
}

/* One side of a handshake reading the input as its peer's frames. */
static void handshake(const uint8_t *data, size_t size, bool server, const char *token)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        return;
    }
    Pd__Fingerprint fp = fingerprint();
    pd_ctl_identity_t me = {"fuzz-engine",
                            PD__ROLE__ROLE_PREFILL,
                            &fp,
                            PD__PIPE_KIND__PIPE_TCP,
                            (const uint8_t *)"tcp:127.0.0.1:1:1",
                            17,
                            (const uint8_t *)token,
                            strlen(token),
                            "127.0.0.1:7000"};
    pd_ctl_reader_t r;
    pd_ctl_reader_init(&r, 1u << 16);
    pd_ctl_reader_feed(&r, data, size);
    pd_ctl_msg_t peer = {0, NULL};
    char reason[256];
    if (server) {
        pd_ctl_server_hs_t hs;
        pd_ctl_server_hs_init(&hs);
        pd_ctl_server_hs_step(&hs, sv[0], &r, &me, 0, &peer, reason, sizeof(reason));
        pd_ctl_server_hs_destroy(&hs);
    } else {
        pd_ctl_client_hs_t hs;
        pd_ctl_client_hs_init(&hs);
        if (pd_ctl_client_hs_start(&hs, sv[0], &me, 0, reason, sizeof(reason)) == PD_OK) {
            pd_ctl_client_hs_step(&hs, sv[0], &r, &me, 0, &peer, reason, sizeof(reason));
        }
        pd_ctl_client_hs_destroy(&hs);
    }
    pd_ctl_msg_free(&peer);
    pd_ctl_reader_destroy(&r);
    close(sv[0]);
    close(sv[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > (1u << 16)) {
        return 0;
    }
    decode_all(data, size);
    handshake(data, size, true, "");
    handshake(data, size, true, "s3cret");
    handshake(data, size, false, "");
    return 0;
}
