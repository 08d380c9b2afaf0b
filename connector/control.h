/* connector/control.h — the control plane's wire format and handshake (DESIGN.md §6).
 *
 * Frame: u32 payload length (big-endian) | u8 version | u8 type | u16 reserved (0) | payload
 * (a protobuf-c message of proto/pd.proto). Frames above max_frame, an unknown version or type,
 * a non-zero reserved field or an undecodable payload are errors: the connection is closed.
 *
 * Handshake (client = the side that connects; protocol 3):
 *   C → S  Hello{version, nonce_c}
 *   S → C  HelloAck{nonce_s, proof_s = HMAC(token, "pd-server" | nonce_c | nonce_s | A)}      or Reject
 *   C → S  HelloFinish{proof_c = HMAC(token, "pd-client" | nonce_s | nonce_c | A), identity_c} or Reject
 *   S → C  Welcome{identity_s}                                                              or Reject
 * A is the server's control address "host:port" as the server advertises it and as the client
 * dialled it (pd_ctl_identity_t.server_addr): a relay at another address that passes the frames on
 * between a client and the real server cannot complete the handshake, since the two sides' proofs
 * are over different addresses (test_control `test_relay_cannot_join`). The token never crosses the
 * wire; each side proves it knows it over the other's fresh nonce before it learns anything about
 * the other (engine id, role, fingerprint, pipe address). A Reject to a side that has not proven the
 * token says only "rejected". The frames are not MACed: the token authenticates the peer at connect
 * time, not the channel (an attacker on the network path itself can still tamper with a connection;
 * keep the KV ports on a private network, deploy/networkpolicy.yaml). */
#ifndef PD_PIPE_CONTROL_H
#define PD_PIPE_CONTROL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "pd.pb-c.h"

#define PD_PROTOCOL_VERSION                                                                                  \
    3 /* 2: the token is proven both ways before any identity is sent;
                                     * 3: the proofs cover the server's address, WRITE_DONE the prompt */
#define PD_CTL_HEADER            8
#define PD_CTL_DEFAULT_MAX_FRAME (1u << 20)

typedef enum pd_msg_type {
    PD_MSG_HELLO = 1,
    PD_MSG_HELLO_ACK = 2,
    PD_MSG_HELLO_FINISH = 3,
    PD_MSG_REJECT = 4,
    PD_MSG_HEARTBEAT = 5,
    PD_MSG_TRANSFER_GRANT = 6,
    PD_MSG_RESERVATION = 7,
    PD_MSG_READ_DONE = 8,
    PD_MSG_WRITE_DONE = 9,
    PD_MSG_TRANSFER_ACK = 10,
    PD_MSG_ABORT = 11,
    PD_MSG_REGIONS = 12,
    PD_MSG_WELCOME = 13,
} pd_msg_type_t;

typedef enum pd_reject_code {
    PD_REJECT_UNSPECIFIED = 0, /* to a peer that has not proven the token: no details */
    PD_REJECT_VERSION = 1,
    PD_REJECT_FINGERPRINT = 2,
    PD_REJECT_TOKEN = 3,
    PD_REJECT_PROTOCOL = 4,
} pd_reject_code_t;

/* A decoded message; msg is the protobuf-c object (cast by type). */
typedef struct pd_ctl_msg {
    pd_msg_type_t type;
    ProtobufCMessage *msg;
} pd_ctl_msg_t;

void pd_ctl_msg_free(pd_ctl_msg_t *m);

/* The protobuf-c descriptor of a message type, or NULL for an unknown type. */
const ProtobufCMessageDescriptor *pd_ctl_descriptor(pd_msg_type_t type);

/* Encodes msg (whose descriptor must match type) into a malloc'd frame. */
pd_status_t pd_ctl_encode(pd_msg_type_t type, const ProtobufCMessage *msg, uint8_t **frame_out,
                          size_t *len_out);

/* Incremental decoder over a byte stream. */
typedef struct pd_ctl_reader {
    uint8_t *buf;
    size_t len, cap;
    size_t max_frame;
} pd_ctl_reader_t;

void pd_ctl_reader_init(pd_ctl_reader_t *r, size_t max_frame);
void pd_ctl_reader_destroy(pd_ctl_reader_t *r);
/* Appends received bytes. PD_ERR_NO_SPACE if that would buffer more than one maximal frame. */
pd_status_t pd_ctl_reader_feed(pd_ctl_reader_t *r, const void *data, size_t n);
/* Decodes the next complete frame: PD_OK (*out set), PD_ERR_NOT_FOUND (need more bytes),
 * PD_ERR_PARSE / PD_ERR_UNSUPPORTED (a bad frame: close the connection; logged with why). */
pd_status_t pd_ctl_reader_next(pd_ctl_reader_t *r, pd_ctl_msg_t *out);

/* Sends one message on a blocking or non-blocking fd, waiting at most timeout_ms. */
pd_status_t pd_ctl_send(int fd, pd_msg_type_t type, const ProtobufCMessage *msg, int timeout_ms);
/* Receives one message (reading through r), waiting at most timeout_ms. PD_ERR_PEER_GONE on EOF. */
pd_status_t pd_ctl_recv(int fd, pd_ctl_reader_t *r, pd_ctl_msg_t *out, int timeout_ms);

/* What this engine says about itself in a handshake. */
typedef struct pd_ctl_identity {
    const char *engine_id;
    Pd__Role role;
    const Pd__Fingerprint *fingerprint;
    Pd__PipeKind pipe_kind;
    const uint8_t *pipe_address;
    size_t pipe_address_len;
    const uint8_t *token; /* cluster token (may be empty: then both sides must have none) */
    size_t token_len;
    /* the server's control address, "host:port": on the server its advertised one, on the client the
     * one it dialled; both proofs cover it (NULL = ""). The Identity message does not carry it. */
    const char *server_addr;
} pd_ctl_identity_t;

/* The handshake (proto/pd.proto, protocol 2): Hello (version, client nonce) → HelloAck (server
 * nonce, the server's proof of the token) → HelloFinish (the client's proof, then its Identity) →
 * Welcome (the server's Identity). Neither side says who it is before the other has proven the
 * token; a Reject to a peer that has not proven it says only "rejected" (details in reason, for the
 * local log). Fingerprints are compared once the peer is authenticated, and a mismatch is rejected
 * with the field named. */

/* The peer's Identity in the message a handshake returned (its HelloFinish on the server side, its
 * Welcome on the client side); NULL for any other message. Valid while m is. */
const Pd__Identity *pd_ctl_peer_identity(const pd_ctl_msg_t *m);

/* Client side of the handshake on a connected fd, reading through r (initialised by the caller;
 * bytes the peer sent after the handshake stay buffered in it). On PD_OK *peer_out holds the
 * server's Welcome (pd_ctl_peer_identity; the caller frees it). PD_ERR_REJECTED (reason filled) when
 * either side refuses: version, token, fingerprint. Blocks up to timeout_ms: a poll loop uses
 * pd_ctl_client_hs_start/step instead. */
pd_status_t pd_ctl_handshake_client(int fd, pd_ctl_reader_t *r, const pd_ctl_identity_t *me, int timeout_ms,
                                    pd_ctl_msg_t *peer_out, char *reason, size_t reason_len);

/* The client side one frame at a time, for a loop that never blocks on a peer: start sends the
 * Hello on a connected fd; step (same contract as pd_ctl_server_hs_step) returns PD_OK with the
 * server's Welcome in *peer_out. */
typedef struct pd_ctl_client_hs {
    int stage; /* 0: waiting for the HelloAck, 1: for the Welcome */
    uint8_t nonce[32];
    uint8_t peer_nonce[32]; /* the server's, from its HelloAck */
    uint8_t session[32];    /* on PD_OK: HMAC(token, "pd-session" | nonce_c | nonce_s), the pipe's
                             * session secret (the server derives the same) */
} pd_ctl_client_hs_t;

void pd_ctl_client_hs_init(pd_ctl_client_hs_t *hs);
void pd_ctl_client_hs_destroy(pd_ctl_client_hs_t *hs);
pd_status_t pd_ctl_client_hs_start(pd_ctl_client_hs_t *hs, int fd, const pd_ctl_identity_t *me,
                                   int send_timeout_ms, char *reason, size_t reason_len);
pd_status_t pd_ctl_client_hs_step(pd_ctl_client_hs_t *hs, int fd, pd_ctl_reader_t *r,
                                  const pd_ctl_identity_t *me, int send_timeout_ms, pd_ctl_msg_t *peer_out,
                                  char *reason, size_t reason_len);

/* Server side (same reader rule); on PD_OK *peer_out holds the client's HelloFinish
 * (pd_ctl_peer_identity). Blocks up to timeout_ms: a poll loop uses pd_ctl_server_hs_step instead. */
pd_status_t pd_ctl_handshake_server(int fd, pd_ctl_reader_t *r, const pd_ctl_identity_t *me, int timeout_ms,
                                    pd_ctl_msg_t *peer_out, char *reason, size_t reason_len);

/* The server side one frame at a time, for a loop that never blocks on a peer: */
typedef struct pd_ctl_server_hs {
    int stage;              /* 0: waiting for the Hello, 1: for the HelloFinish */
    uint8_t peer_nonce[32]; /* the client's, from its Hello */
    uint8_t nonce[32];      /* ours, sent in the HelloAck */
    uint8_t session[32];    /* on PD_OK: the pipe's session secret (as the client's) */
} pd_ctl_server_hs_t;

void pd_ctl_server_hs_init(pd_ctl_server_hs_t *hs);
void pd_ctl_server_hs_destroy(pd_ctl_server_hs_t *hs);

/* Advances hs with the whole frames buffered in r (the caller feeds r from fd, e.g. with
 * pd_ctl_fill(fd, r, 0) when poll says fd is readable). PD_ERR_NOT_FOUND: more bytes needed;
 * PD_OK: authenticated, *peer_out holds the peer's HelloFinish (the caller frees it); anything else:
 * refused or broken (reason filled; a Reject was sent where the protocol says so). Replies are
 * a few hundred bytes on a fresh socket, written with send_timeout_ms as a bound. */
pd_status_t pd_ctl_server_hs_step(pd_ctl_server_hs_t *hs, int fd, pd_ctl_reader_t *r,
                                  const pd_ctl_identity_t *me, int send_timeout_ms, pd_ctl_msg_t *peer_out,
                                  char *reason, size_t reason_len);

/* Reads what fd has into r, first waiting up to timeout_ms for it to be readable (0: no wait).
 * PD_OK (bytes fed, or none yet with timeout 0 → PD_ERR_TIMEOUT), PD_ERR_PEER_GONE on EOF or a
 * socket error, PD_ERR_PARSE when r is full. */
pd_status_t pd_ctl_fill(int fd, pd_ctl_reader_t *r, int timeout_ms);

/* Compares fingerprints field by field; on a mismatch writes which field differs to why. */
bool pd_ctl_fingerprint_equal(const Pd__Fingerprint *a, const Pd__Fingerprint *b, char *why, size_t why_len);

#endif
