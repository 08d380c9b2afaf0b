/* connector/control.c — control-plane frames and the token handshake. */
#define _GNU_SOURCE
#include "connector/control.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/array.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/time.h"

const ProtobufCMessageDescriptor *pd_ctl_descriptor(pd_msg_type_t type)
{
    switch (type) {
    case PD_MSG_HELLO: return &pd__hello__descriptor;
    case PD_MSG_HELLO_ACK: return &pd__hello_ack__descriptor;
    case PD_MSG_HELLO_FINISH: return &pd__hello_finish__descriptor;
    case PD_MSG_REJECT: return &pd__reject__descriptor;
    case PD_MSG_HEARTBEAT: return &pd__heartbeat__descriptor;
    case PD_MSG_TRANSFER_GRANT: return &pd__transfer_grant__descriptor;
    case PD_MSG_RESERVATION: return &pd__reservation__descriptor;
    case PD_MSG_READ_DONE: return &pd__read_done__descriptor;
    case PD_MSG_WRITE_DONE: return &pd__write_done__descriptor;
    case PD_MSG_TRANSFER_ACK: return &pd__transfer_ack__descriptor;
    case PD_MSG_ABORT: return &pd__abort__descriptor;
    case PD_MSG_REGIONS: return &pd__regions__descriptor;
    case PD_MSG_WELCOME: return &pd__welcome__descriptor;
    }
    return NULL;
}

void pd_ctl_msg_free(pd_ctl_msg_t *m)
{
    if (m->msg != NULL) {
        protobuf_c_message_free_unpacked(m->msg, NULL);
    }
    m->msg = NULL;
}

pd_status_t pd_ctl_encode(pd_msg_type_t type, const ProtobufCMessage *msg, uint8_t **frame_out,
                          size_t *len_out)
{
    const ProtobufCMessageDescriptor *d = pd_ctl_descriptor(type);
    if (d == NULL || msg->descriptor != d) {
        pd_log_error("control: message does not match type %d", type);
        return PD_ERR_INVALID_ARG;
    }
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (n > UINT32_MAX) {
        return PD_ERR_NO_SPACE;
    }
    uint8_t *f = malloc(PD_CTL_HEADER + n);
    if (f == NULL) {
        return PD_ERR_NO_MEMORY;
    }
    f[0] = (uint8_t)(n >> 24);
    f[1] = (uint8_t)(n >> 16);
    f[2] = (uint8_t)(n >> 8);
    f[3] = (uint8_t)n;
    f[4] = PD_PROTOCOL_VERSION;
    f[5] = (uint8_t)type;
    f[6] = f[7] = 0;
    protobuf_c_message_pack(msg, f + PD_CTL_HEADER);
    *frame_out = f;
    *len_out = PD_CTL_HEADER + n;
    return PD_OK;
}

void pd_ctl_reader_init(pd_ctl_reader_t *r, size_t max_frame)
{
    memset(r, 0, sizeof(*r));
    r->max_frame = max_frame ? max_frame : PD_CTL_DEFAULT_MAX_FRAME;
}

void pd_ctl_reader_destroy(pd_ctl_reader_t *r)
{
    free(r->buf);
    memset(r, 0, sizeof(*r));
}

pd_status_t pd_ctl_reader_feed(pd_ctl_reader_t *r, const void *data, size_t n)
{
    if (n == 0) {
        return PD_OK; /* (an empty reader has no buffer yet) */
    }
    if (r->len + n > r->max_frame + PD_CTL_HEADER + 65536) {
        pd_log_warn("control: %zu unparsed bytes buffered; refusing more", r->len + n);
        return PD_ERR_NO_SPACE;
    }
    if (pd_array_reserve(&r->buf, &r->cap, r->len + n) != PD_OK) {
        return PD_ERR_NO_MEMORY;
    }
    memcpy(r->buf + r->len, data, n);
    r->len += n;
    return PD_OK;
}

pd_status_t pd_ctl_reader_next(pd_ctl_reader_t *r, pd_ctl_msg_t *out)
{
    if (r->len < PD_CTL_HEADER) {
        return PD_ERR_NOT_FOUND;
    }
    const uint8_t *h = r->buf;
    uint32_t n = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
    if (n > r->max_frame) {
        pd_log_warn("control: frame of %u bytes exceeds the %zu byte limit", n, r->max_frame);
        return PD_ERR_PARSE;
    }
    if (h[4] != PD_PROTOCOL_VERSION) {
        pd_log_warn("control: frame version %u, this build speaks %u", h[4], PD_PROTOCOL_VERSION);
        return PD_ERR_UNSUPPORTED;
    }
    const ProtobufCMessageDescriptor *d = pd_ctl_descriptor((pd_msg_type_t)h[5]);
    if (d == NULL || h[6] != 0 || h[7] != 0) {
        pd_log_warn("control: unknown message type %u (or reserved bits set)", h[5]);
        return PD_ERR_PARSE;
    }
    if (r->len < PD_CTL_HEADER + (size_t)n) {
        return PD_ERR_NOT_FOUND;
    }
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, n, r->buf + PD_CTL_HEADER);
    if (m == NULL) {
        pd_log_warn("control: malformed %s message (%u bytes)", d->short_name, n);
        return PD_ERR_PARSE;
    }
    out->type = (pd_msg_type_t)h[5];
    out->msg = m;
    memmove(r->buf, r->buf + PD_CTL_HEADER + n, r->len - PD_CTL_HEADER - n);
    r->len -= PD_CTL_HEADER + n;
    return PD_OK;
}

static int remaining_ms(uint64_t deadline)
{
    uint64_t now = pd_time_now_ns();
    return now >= deadline ? 0 : (int)((deadline - now) / 1000000 + 1);
}

pd_status_t pd_ctl_send(int fd, pd_msg_type_t type, const ProtobufCMessage *msg, int timeout_ms)
{
    uint8_t *f = NULL;
    size_t len = 0;
    pd_status_t st = pd_ctl_encode(type, msg, &f, &len);
    if (st != PD_OK) {
        return st;
    }
    uint64_t deadline = pd_time_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    size_t off = 0;
    while (off < len) {
        ssize_t w = send(fd, f + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            off += (size_t)w;
            continue;
        }
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            struct pollfd p = {fd, POLLOUT, 0};
            int ms = remaining_ms(deadline);
            if (ms == 0 || poll(&p, 1, ms) == 0) {
                st = PD_ERR_TIMEOUT;
                break;
            }
            continue;
        }
        st = PD_ERR_PEER_GONE;
        break;
    }
    free(f);
    return st;
}

pd_status_t pd_ctl_fill(int fd, pd_ctl_reader_t *r, int timeout_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (timeout_ms > 0 && poll(&p, 1, timeout_ms) == 0) {
        return PD_ERR_TIMEOUT;
    }
    uint8_t buf[16384];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) {
        return PD_ERR_PEER_GONE;
    }
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            return timeout_ms > 0 ? PD_OK : PD_ERR_TIMEOUT;
        }
        return PD_ERR_PEER_GONE;
    }
    return pd_ctl_reader_feed(r, buf, (size_t)n) == PD_OK ? PD_OK : PD_ERR_PARSE;
}

pd_status_t pd_ctl_recv(int fd, pd_ctl_reader_t *r, pd_ctl_msg_t *out, int timeout_ms)
{
    uint64_t deadline = pd_time_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        pd_status_t st = pd_ctl_reader_next(r, out);
        if (st != PD_ERR_NOT_FOUND) {
            return st;
        }
        struct pollfd p = {fd, POLLIN, 0};
        int ms = remaining_ms(deadline);
        if (ms == 0 || poll(&p, 1, ms) == 0) {
            return PD_ERR_TIMEOUT;
        }
        uint8_t buf[16384];
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n == 0) {
            return PD_ERR_PEER_GONE;
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) {
                continue;
            }
            return PD_ERR_PEER_GONE;
        }
        st = pd_ctl_reader_feed(r, buf, (size_t)n);
        if (st != PD_OK) {
            return PD_ERR_PARSE;
        }
    }
}

bool pd_ctl_fingerprint_equal(const Pd__Fingerprint *a, const Pd__Fingerprint *b, char *why, size_t why_len)
{
    if (a == NULL || b == NULL) {
        snprintf(why, why_len, "fingerprint missing");
        return false;
    }
#define CMP_STR(f)                                                                                           \
    if (strcmp(a->f != NULL ? a->f : "", b->f != NULL ? b->f : "") != 0) {                                   \
        snprintf(why, why_len, "fingerprint mismatch: " #f " '%s' vs '%s'", a->f, b->f);                     \
        return false;                                                                                        \
    }
#define CMP_INT(f)                                                                                           \
    if (a->f != b->f) {                                                                                      \
        snprintf(why, why_len, "fingerprint mismatch: " #f " %u vs %u", a->f, b->f);                         \
        return false;                                                                                        \
    }
    CMP_STR(model)
    CMP_STR(kv_dtype)
    CMP_STR(layout)
    CMP_INT(block_size)
    CMP_INT(num_kv_heads)
    CMP_INT(head_size)
    CMP_INT(num_layers)
    CMP_INT(protocol_version)
#undef CMP_STR
#undef CMP_INT
    return true;
}

/* HMAC(token, label | n1 | n2 | server address): nonces over 64 bytes and addresses over 255 are
 * cut (a handshake refuses other nonce lengths; an address is at most host[64]:port). */
static void proof(const pd_ctl_identity_t *me, const char *label, const uint8_t *n1, size_t l1,
                  const uint8_t *n2, size_t l2, uint8_t out[32])
{
    uint8_t msg[16 + 64 + 64 + 1 + 255];
    size_t k = strlen(label) < 16 ? strlen(label) : 16;
    memcpy(msg, label, k);
    l1 = l1 > 64 ? 64 : l1;
    l2 = l2 > 64 ? 64 : l2;
    if (l1 > 0) { /* a peer's empty nonce arrives as NULL */
        memcpy(msg + k, n1, l1);
    }
    k += l1;
    if (l2 > 0) {
        memcpy(msg + k, n2, l2);
    }
    k += l2;
    size_t la = me->server_addr != NULL ? strnlen(me->server_addr, 255) : 0;
    msg[k++] = (uint8_t)la; /* length first: "a" | "bc" and "ab" | "c" differ */
    if (la > 0) {
        memcpy(msg + k, me->server_addr, la);
    }
    k += la;
    pd_hmac_sha256(me->token, me->token_len, msg, k, out);
}

/* A Reject. To a peer that has not proven the token (authenticated false) it says only
 * "rejected": the reason is for the local log. */
static void send_reject(int fd, bool authenticated, pd_reject_code_t code, const char *reason, int timeout_ms)
{
    Pd__Reject rj = PD__REJECT__INIT;
    rj.reason = authenticated ? (char *)reason : (char *)"rejected";
    rj.code = authenticated ? code : PD_REJECT_UNSPECIFIED;
    pd_ctl_send(fd, PD_MSG_REJECT, &rj.base, timeout_ms);
}

/* The next buffered frame as the handshake's `want` (a Reject ends it): PD_ERR_NOT_FOUND when no
 * whole frame is buffered yet. Every frame before `want` is a protocol error, answered "rejected"
 * (the peer has not proven the token at any point this is called). */
static pd_status_t hs_next(int fd, pd_ctl_reader_t *r, pd_msg_type_t want, int send_ms, pd_ctl_msg_t *out,
                           char *reason, size_t reason_len)
{
    pd_status_t st = pd_ctl_reader_next(r, out);
    if (st == PD_ERR_NOT_FOUND) {
        return st;
    }
    if (st != PD_OK) {
        snprintf(reason, reason_len, "handshake: %s frame from the peer", pd_status_str(st));
        send_reject(fd, false, PD_REJECT_PROTOCOL, reason, send_ms);
        return st;
    }
    if (out->type == PD_MSG_REJECT) {
        Pd__Reject *rj = (Pd__Reject *)out->msg;
        snprintf(reason, reason_len, "rejected by peer: %s", rj->reason != NULL ? rj->reason : "");
        pd_ctl_msg_free(out);
        return PD_ERR_REJECTED;
    }
    if (out->type != want) {
        snprintf(reason, reason_len, "handshake: unexpected message type %d (wanted %d)", out->type, want);
        pd_ctl_msg_free(out);
        send_reject(fd, false, PD_REJECT_PROTOCOL, reason, send_ms);
        return PD_ERR_PARSE;
    }
    return PD_OK;
}

/* me as an Identity message (pointers into me). */
static Pd__Identity identity_msg(const pd_ctl_identity_t *me)
{
    Pd__Identity id = PD__IDENTITY__INIT;
    id.engine_id = (char *)me->engine_id;
    id.role = me->role;
    id.fingerprint = (Pd__Fingerprint *)me->fingerprint;
    id.pipe_kind = me->pipe_kind;
    id.pipe_address.data = (uint8_t *)me->pipe_address;
    id.pipe_address.len = me->pipe_address_len;
    return id;
}

/* An authenticated peer's identity is usable: present, and its fingerprint equals ours (a Reject
 * with the details otherwise: the peer has proven the token). */
static pd_status_t check_identity(int fd, const pd_ctl_identity_t *me, const Pd__Identity *id, int send_ms,
                                  char *reason, size_t reason_len)
{
    if (id == NULL || id->engine_id == NULL || id->engine_id[0] == '\0') {
        snprintf(reason, reason_len, "handshake: the peer did not say who it is");
        send_reject(fd, true, PD_REJECT_PROTOCOL, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    if (!pd_ctl_fingerprint_equal(me->fingerprint, id->fingerprint, reason, reason_len)) {
        send_reject(fd, true, PD_REJECT_FINGERPRINT, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    return PD_OK;
}

const Pd__Identity *pd_ctl_peer_identity(const pd_ctl_msg_t *m)
{
    if (m->msg == NULL) {
        return NULL;
    }
    if (m->type == PD_MSG_WELCOME) {
        return ((const Pd__Welcome *)m->msg)->identity;
    }
    return m->type == PD_MSG_HELLO_FINISH ? ((const Pd__HelloFinish *)m->msg)->identity : NULL;
}

void pd_ctl_client_hs_init(pd_ctl_client_hs_t *hs)
{
    memset(hs, 0, sizeof(*hs));
}

void pd_ctl_client_hs_destroy(pd_ctl_client_hs_t *hs)
{
    memset(hs, 0, sizeof(*hs));
}

pd_status_t pd_ctl_client_hs_start(pd_ctl_client_hs_t *hs, int fd, const pd_ctl_identity_t *me,
                                   int send_timeout_ms, char *reason, size_t reason_len)
{
    (void)me;
    if (getrandom(hs->nonce, sizeof(hs->nonce), 0) != (ssize_t)sizeof(hs->nonce)) {
        snprintf(reason, reason_len, "no randomness for the handshake nonce");
        return PD_ERR_IO;
    }
    Pd__Hello h = PD__HELLO__INIT;
    h.protocol_version = PD_PROTOCOL_VERSION;
    h.nonce.data = hs->nonce;
    h.nonce.len = sizeof(hs->nonce);
    pd_status_t st = pd_ctl_send(fd, PD_MSG_HELLO, &h.base, send_timeout_ms);
    if (st != PD_OK) {
        snprintf(reason, reason_len, "handshake: cannot send Hello (%s)", pd_status_str(st));
    }
    return st;
}

/* Stage 0: the server's HelloAck arrived: check its proof of the token, then prove ours and say who
 * we are. */
static pd_status_t hs_on_ack(pd_ctl_client_hs_t *hs, int fd, const pd_ctl_identity_t *me, int send_ms,
                             const Pd__HelloAck *a, char *reason, size_t reason_len)
{
    uint8_t want[32];
    proof(me, "pd-server", hs->nonce, sizeof(hs->nonce), a->nonce.data, a->nonce.len, want);
    if (a->nonce.len != sizeof(hs->peer_nonce) || a->proof.len != 32 ||
        !pd_ct_equal(want, a->proof.data, 32)) {
        snprintf(reason, reason_len,
                 "the peer does not know the cluster token, or is not the server at %s (a relay)",
                 me->server_addr != NULL ? me->server_addr : "");
        send_reject(fd, false, PD_REJECT_TOKEN, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    memcpy(hs->peer_nonce, a->nonce.data, sizeof(hs->peer_nonce));
    uint8_t mine[32];
    proof(me, "pd-client", a->nonce.data, a->nonce.len, hs->nonce, sizeof(hs->nonce), mine);
    Pd__Identity id = identity_msg(me);
    Pd__HelloFinish fin = PD__HELLO_FINISH__INIT;
    fin.proof.data = mine;
    fin.proof.len = 32;
    fin.identity = &id;
    pd_status_t st = pd_ctl_send(fd, PD_MSG_HELLO_FINISH, &fin.base, send_ms);
    if (st != PD_OK) {
        snprintf(reason, reason_len, "handshake: cannot send HelloFinish (%s)", pd_status_str(st));
    }
    return st;
}

pd_status_t pd_ctl_client_hs_step(pd_ctl_client_hs_t *hs, int fd, pd_ctl_reader_t *r,
                                  const pd_ctl_identity_t *me, int send_timeout_ms, pd_ctl_msg_t *peer_out,
                                  char *reason, size_t reason_len)
{
    for (;;) {
        pd_ctl_msg_t m = {0, NULL};
        pd_status_t st = hs_next(fd, r, hs->stage == 0 ? PD_MSG_HELLO_ACK : PD_MSG_WELCOME, send_timeout_ms,
                                 &m, reason, reason_len);
        if (st != PD_OK) {
            return st;
        }
        if (hs->stage == 0) {
            st = hs_on_ack(hs, fd, me, send_timeout_ms, (const Pd__HelloAck *)m.msg, reason, reason_len);
            pd_ctl_msg_free(&m);
            if (st != PD_OK) {
                return st;
            }
            hs->stage = 1;
            continue;
        }
        st = check_identity(fd, me, pd_ctl_peer_identity(&m), send_timeout_ms, reason, reason_len);
        if (st != PD_OK) {
            pd_ctl_msg_free(&m);
            return st;
        }
        proof(me, "pd-session", hs->nonce, sizeof(hs->nonce), hs->peer_nonce, sizeof(hs->peer_nonce),
              hs->session);
        *peer_out = m;
        return PD_OK;
    }
}

pd_status_t pd_ctl_handshake_client(int fd, pd_ctl_reader_t *r, const pd_ctl_identity_t *me, int timeout_ms,
                                    pd_ctl_msg_t *peer_out, char *reason, size_t reason_len)
{
    uint64_t deadline = pd_time_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    pd_ctl_client_hs_t hs;
    pd_ctl_client_hs_init(&hs);
    pd_status_t st = pd_ctl_client_hs_start(&hs, fd, me, timeout_ms, reason, reason_len);
    while (st == PD_OK && (st = pd_ctl_client_hs_step(&hs, fd, r, me, timeout_ms, peer_out, reason,
                                                      reason_len)) == PD_ERR_NOT_FOUND) {
        int ms = remaining_ms(deadline);
        st = ms > 0 ? pd_ctl_fill(fd, r, ms) : PD_ERR_TIMEOUT;
        if (st != PD_OK) {
            snprintf(reason, reason_len, "handshake: %s while waiting for the peer", pd_status_str(st));
        }
    }
    pd_ctl_client_hs_destroy(&hs);
    return st;
}

void pd_ctl_server_hs_init(pd_ctl_server_hs_t *hs)
{
    memset(hs, 0, sizeof(*hs));
}

void pd_ctl_server_hs_destroy(pd_ctl_server_hs_t *hs)
{
    memset(hs, 0, sizeof(*hs));
}

/* Stage 0: the peer's Hello arrived: check its version, answer with our nonce and proof. */
static pd_status_t hs_on_hello(pd_ctl_server_hs_t *hs, int fd, const pd_ctl_identity_t *me, int send_ms,
                               const Pd__Hello *h, char *reason, size_t reason_len)
{
    if (h->protocol_version != PD_PROTOCOL_VERSION) {
        snprintf(reason, reason_len, "protocol version %u, this engine speaks %u", h->protocol_version,
                 PD_PROTOCOL_VERSION);
        send_reject(fd, false, PD_REJECT_VERSION, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    if (h->nonce.len != sizeof(hs->peer_nonce)) {
        snprintf(reason, reason_len, "handshake: a nonce of %zu bytes", h->nonce.len);
        send_reject(fd, false, PD_REJECT_PROTOCOL, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    memcpy(hs->peer_nonce, h->nonce.data, sizeof(hs->peer_nonce));
    if (getrandom(hs->nonce, sizeof(hs->nonce), 0) != (ssize_t)sizeof(hs->nonce)) {
        snprintf(reason, reason_len, "no randomness for the handshake nonce");
        return PD_ERR_IO;
    }
    uint8_t mine[32];
    proof(me, "pd-server", hs->peer_nonce, sizeof(hs->peer_nonce), hs->nonce, sizeof(hs->nonce), mine);
    Pd__HelloAck a = PD__HELLO_ACK__INIT;
    a.nonce.data = hs->nonce;
    a.nonce.len = sizeof(hs->nonce);
    a.proof.data = mine;
    a.proof.len = 32;
    pd_status_t st = pd_ctl_send(fd, PD_MSG_HELLO_ACK, &a.base, send_ms);
    if (st != PD_OK) {
        snprintf(reason, reason_len, "handshake: cannot send HelloAck (%s)", pd_status_str(st));
    }
    return st;
}

/* Stage 1: the peer's HelloFinish arrived: check its proof of the token, then (authenticated) its
 * fingerprint, then say who we are. */
static pd_status_t hs_on_finish(pd_ctl_server_hs_t *hs, int fd, const pd_ctl_identity_t *me, int send_ms,
                                const pd_ctl_msg_t *fin, char *reason, size_t reason_len)
{
    uint8_t want[32];
    proof(me, "pd-client", hs->nonce, sizeof(hs->nonce), hs->peer_nonce, sizeof(hs->peer_nonce), want);
    const Pd__HelloFinish *f = (const Pd__HelloFinish *)fin->msg;
    if (f->proof.len != 32 || !pd_ct_equal(want, f->proof.data, 32)) {
        snprintf(reason, reason_len, "the peer does not know the cluster token");
        send_reject(fd, false, PD_REJECT_TOKEN, reason, send_ms);
        return PD_ERR_REJECTED;
    }
    pd_status_t st = check_identity(fd, me, f->identity, send_ms, reason, reason_len);
    if (st != PD_OK) {
        return st;
    }
    Pd__Identity id = identity_msg(me);
    Pd__Welcome w = PD__WELCOME__INIT;
    w.identity = &id;
    st = pd_ctl_send(fd, PD_MSG_WELCOME, &w.base, send_ms);
    if (st != PD_OK) {
        snprintf(reason, reason_len, "handshake: cannot send Welcome (%s)", pd_status_str(st));
    }
    return st;
}

pd_status_t pd_ctl_server_hs_step(pd_ctl_server_hs_t *hs, int fd, pd_ctl_reader_t *r,
                                  const pd_ctl_identity_t *me, int send_timeout_ms, pd_ctl_msg_t *peer_out,
                                  char *reason, size_t reason_len)
{
    for (;;) {
        pd_ctl_msg_t m = {0, NULL};
        pd_status_t st = hs_next(fd, r, hs->stage == 0 ? PD_MSG_HELLO : PD_MSG_HELLO_FINISH, send_timeout_ms,
                                 &m, reason, reason_len);
        if (st != PD_OK) {
            return st;
        }
        if (hs->stage == 0) {
            st = hs_on_hello(hs, fd, me, send_timeout_ms, (const Pd__Hello *)m.msg, reason, reason_len);
            pd_ctl_msg_free(&m);
            if (st != PD_OK) {
                return st;
            }
            hs->stage = 1;
            continue;
        }
        st = hs_on_finish(hs, fd, me, send_timeout_ms, &m, reason, reason_len);
        if (st != PD_OK) {
            pd_ctl_msg_free(&m);
            return st;
        }
        proof(me, "pd-session", hs->peer_nonce, sizeof(hs->peer_nonce), hs->nonce, sizeof(hs->nonce),
              hs->session);
        *peer_out = m;
        return PD_OK;
    }
}

pd_status_t pd_ctl_handshake_server(int fd, pd_ctl_reader_t *r, const pd_ctl_identity_t *me, int timeout_ms,
                                    pd_ctl_msg_t *peer_out, char *reason, size_t reason_len)
{
    uint64_t deadline = pd_time_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    pd_ctl_server_hs_t hs;
    pd_ctl_server_hs_init(&hs);
    pd_status_t st;
    while ((st = pd_ctl_server_hs_step(&hs, fd, r, me, timeout_ms, peer_out, reason, reason_len)) ==
           PD_ERR_NOT_FOUND) {
        int ms = remaining_ms(deadline);
        st = ms > 0 ? pd_ctl_fill(fd, r, ms) : PD_ERR_TIMEOUT; /* a dribbling peer too */
        if (st != PD_OK) {
            snprintf(reason, reason_len, "handshake: %s while waiting for the peer", pd_status_str(st));
            break;
        }
    }
    pd_ctl_server_hs_destroy(&hs);
    return st;
}
